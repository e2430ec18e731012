"""Grammars for constrained decoding, written in llguidance's Lark dialect.

A constraint describes the model's **whole raw output** after the generation
prompt ``<|start|>assistant``, channel headers and control tokens included
(``docs/constrained.md``), so the channel parser of the front sees exactly
the structure it expects:

* at most one reasoning message, free text of at most ``reasoning_tokens``
  tokens: `` to=self<|message|>…<|eom|><|start|>assistant``; its text never
  contains ``<|`` (which would spell a control token in plain characters) nor
  a run of three backticks or tildes (a Markdown fence would make the
  following terminator literal, output-grammar 2.3);
* then the constrained part: the final answer `` to=user<|message|>ANSWER<|eot|>``
  (``response_format``), or one or more ATEM tool messages (``tool_choice``
  ``"required"`` or a named function), built by the tool parser plugin.

Special tokens are written ``<|name|>``: llguidance matches them only as the
single special id, never as the characters. JSON answers use llguidance's
JSON-Schema compiler with compact separators (``", "`` and ``": "``, no
other whitespace), so a generation cannot wander off into whitespace.

This module only writes text; :mod:`musegl_core.constrain.matcher` compiles
it (in the worker, against the served vocabulary) and :func:`check` lets the
front refuse a grammar llguidance cannot compile with a 400 before anything runs.
"""

from __future__ import annotations

import json
from typing import Any

#: llguidance's JSON options for every schema: canonical, compact separators.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

#: Free reasoning text: anything but ``<|`` and fence runs.
REASONING_TEXT = r"/(?s:.*)/ & ~/(?s:.*(```|~~~|<\|).*)/"


def json_rule(schema: Any) -> str:
    """``%json{...}`` for ``schema`` with :data:`JSON_OPTIONS` (the schema's own
    ``x-guidance`` is replaced: the output format is the server's decision)."""
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": JSON_OPTIONS}
    elif schema is True:
        schema = {"x-guidance": JSON_OPTIONS}
    return "%json" + json.dumps(schema, ensure_ascii=False)


def reasoning_rules(reasoning_tokens: int) -> str:
    """``reasoning`` (optional in ``start``): one free reasoning message."""
    if reasoning_tokens <= 0:
        return ""
    return (
        'reasoning: " to=self" <|message|> reasoning_text <|eom|> <|start|> "assistant"\n'
        f"reasoning_text[max_tokens={reasoning_tokens}]: REASONING_TEXT\n"
        f"REASONING_TEXT: {REASONING_TEXT}\n"
    )


def answer_grammar(schema: Any, reasoning_tokens: int) -> str:
    """The whole output: optional reasoning, then a final answer that is JSON
    valid against ``schema`` (``True``: any JSON object, ``json_object``)."""
    if schema is True:
        schema = {"type": "object"}
    start = "start: reasoning? answer\n" if reasoning_tokens > 0 else "start: answer\n"
    return (
        start
        + reasoning_rules(reasoning_tokens)
        + 'answer: " to=user" <|message|> answer_json <|eot|>\n'
        + f"answer_json: {json_rule(schema)}\n"
    )


def calls_rule(parallel: bool = True) -> str:
    """``calls``: one or more tool messages joined by ``<|eom|><|start|>assistant``,
    the last ending the turn with ``<|eot|>``; exactly one with ``parallel``
    False (``parallel_tool_calls: false``)."""
    if not parallel:
        return "calls: call_message <|eot|>\n"
    return 'calls: call_message (<|eom|> <|start|> "assistant" call_message)* <|eot|>\n'


def calls_grammar(call_rules: str, reasoning_tokens: int, parallel: bool = True) -> str:
    """The whole output: optional reasoning, then the tool messages of :func:`calls_rule`.

    ``call_rules`` must define ``call_message``: one complete tool message
    without its terminator (header, ``<|message|>``, ATEM block), as the tool
    parser plugin writes it."""
    start = "start: reasoning? calls\n" if reasoning_tokens > 0 else "start: calls\n"
    return start + reasoning_rules(reasoning_tokens) + calls_rule(parallel) + call_rules


#: The terminators that end a tool message after its call markup.
TERMINATORS = "(<|eom|> | <|eot|>)"


#: The nested grammars (``%json``, ``%lark``) one grammar may hold next to a ``max_tokens`` rule
#: (the reasoning bound, :func:`reasoning_rules`). llguidance numbers its lexer classes with one
#: byte, the root grammar's being 0; while any rule carries ``max_tokens`` it gives every nested
#: grammar a class of its own (without one, nested grammars share classes and there is no such
#: limit). The 256th panicked ("class too large"): 256 forced tools with a JSON-valued parameter
#: each, at the default ``--constrained-reasoning-tokens`` (issue 47 item 13).
MAX_NESTED_WITH_TOKEN_BOUND = 255


def nested_grammars(text: str) -> int:
    """The nested grammars of ``text``, counted from above (a ``%json`` spelt inside a schema's
    string counts too)."""
    return text.count("%json") + text.count("%lark")


def lazy_grammars(trigger: str, rules: str, parallel: bool = True):
    """The two grammars of a lazily activated call constraint
    (:class:`~musegl_core.engine.request.LazyGrammar`) from the tool parser's
    lazy rules: ``rules`` define ``lazy_call``, everything after ``trigger``
    up to the end of the call markup followed by ``lazy_end``, which this
    function defines (``ToolParserSpec.grammar``).

    * in a tool message the body must be the call: ``trigger lazy_call``, then
      a terminator (text after the markup would make the tool message
      malformed, output-grammar 2.4) — unless ``lazy_call`` ended early on a
      non-strict tool's opening tag, after which everything is free;
    * in a visible message the constraint starts at the token where the
      trigger begins: a lazy lead (any text ending with the first
      ``trigger``) takes that token's text, then ``lazy_call``; the message
      continues freely after the markup (output-grammar 2.2 rule 5).

    With ``parallel`` False (``parallel_tool_calls: false``) the terminator
    after a tool message's call can only be ``<|eot|>``: the turn ends with
    that one call.
    """
    from musegl_core.engine.request import LazyGrammar

    import re

    lead = "/(?s:.*)" + re.escape(trigger).replace("/", "\\/") + "/"
    end = TERMINATORS if parallel else "<|eot|>"
    tool = f"start: {lark_string(trigger)} lazy_call\nlazy_end: {end}\n" + rules
    visible = f"start: lazy_lead lazy_call\nlazy_lead[lazy]: {lead}\nlazy_end: \"\"\n" + rules
    return LazyGrammar(trigger=trigger, in_tool_message=tool, in_visible_message=visible)


def lark_string(text: str) -> str:
    """A Lark string literal for ``text``."""
    return json.dumps(text, ensure_ascii=False)


def check(grammar: str) -> str | None:
    """None when llguidance compiles ``grammar`` (without a vocabulary), else its error.
    A panic inside llguidance (a Rust ``panic!``, which reaches Python as a
    ``BaseException``, such as "class too large" on a grammar past one of its
    internal limits) is an error too, never an escape past the error handlers."""
    import llguidance

    try:
        error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar))
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # pyo3's PanicException derives from BaseException
        return panic_message(exc)
    return error or None


def panic_message(exc: BaseException) -> str:
    """What a client reads of a panic in llguidance."""
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return (f"the grammar engine (llguidance) gave up on this constraint ({reason}): it is past one of the "
            f"engine's internal limits; constrain fewer tools or a smaller schema")
