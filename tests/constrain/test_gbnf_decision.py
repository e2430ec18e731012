"""Why `grammar` (GBNF) stays a 400 (docs/constrained.md 5): llguidance's
GBNF->Lark converter does not keep a grammar's language. If these start to
fail, the converter became faithful on them and the decision can be revisited."""

from __future__ import annotations

import pytest

llguidance = pytest.importorskip("llguidance")
from llguidance.gbnf_to_lark import gbnf_to_lark  # noqa: E402

from musegl_core.constrain.matcher import ll_tokenizer  # noqa: E402
from musegl_core.tiny import default_model_path  # noqa: E402
from musegl_core.tokenizer import MuseTokenizer  # noqa: E402


def accepts(gbnf: str, text: str) -> bool:
    ll = ll_tokenizer(MuseTokenizer.load(default_model_path()))
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(gbnf)), log_level=0)
    assert not matcher.is_error()
    return all(matcher.consume_token(t) for t in ll.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.parametrize("gbnf, text", [
    ('root ::= word "s"\nword ::= [a-z]+', "cats"),  # GBNF: word = "cat"; converted: WORD eats the "s"
    ('root ::= ("ab" | "a") "bc"', "abc"),  # GBNF: "a" "bc"; converted: the lexer takes "ab"
])
def test_the_converted_grammar_rejects_strings_the_gbnf_accepts(gbnf, text):
    assert not accepts(gbnf, text)


def test_the_converter_is_right_where_lexemes_cannot_overlap():
    assert accepts('root ::= num "." num\nnum ::= [0-9]+', "1.5")
