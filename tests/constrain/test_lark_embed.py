"""Embedding a client's Lark grammar (a freeform tool's input) in the server's grammar."""

from __future__ import annotations

import pytest

from musegl_core.constrain.grammar import check
from musegl_core.constrain.lark_embed import LarkEmbedError, embed_lark

GRAMMAR = '''start: greeting NAME LF? // a comment with start: inside
greeting: "hello " | "hi "  -> greeting
NAME: /[a-z]+/
%import common.LF
'''


def test_definitions_and_imports_are_renamed_and_strings_kept():
    rules, start = embed_lark(GRAMMAR, "ff0")
    assert start == "ff0_start"
    assert "ff0_greeting FF0_NAME FF0_LF?" in rules
    assert '"hello " | "hi "  -> greeting' in rules  # the tree alias stays
    assert "%import common.LF -> FF0_LF" in rules and "comment" not in rules


def test_two_embedded_copies_compile_side_by_side():
    first, a = embed_lark(GRAMMAR, "ff0")
    second, b = embed_lark(GRAMMAR, "ff1")
    assert check(f"start: {a} | {b}\n{first}{second}") is None


@pytest.mark.parametrize("grammar, reason", [
    ("start: \"a\"\n%ignore \" \"\n", "%ignore"),
    ("rule: \"a\"\n", "no 'start'"),
    ("start: LF\n%import common (LF, WS)\n", "only '%import module.NAME'"),
    ("   ", "empty"),
])
def test_grammars_that_would_change_their_surroundings_are_refused(grammar, reason):
    with pytest.raises(LarkEmbedError, match=reason.replace("(", r"\(")):
        embed_lark(grammar, "ff0")
