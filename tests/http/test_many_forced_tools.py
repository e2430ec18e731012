"""256 or more tools with a forced call (issue 47 item 13).

With the reasoning bound (``--constrained-reasoning-tokens``, default 1024, a
``max_tokens`` rule) llguidance gives each nested JSON grammar a lexer class of
its own, numbered with one byte: the 256th tool with a JSON-valued parameter
panicked ("class too large"). Now identical parameter schemas share one nested
grammar, and past the limit the grammar leaves out the reasoning message, so
the forced call works on every surface; a panic that still comes is a JSON 400
with the request id (tests/http/test_hardening_iii.py)."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from musegl_core.config import ServeConfig
from musegl_core.constrain import grammar as g
from musegl_core.service.constraints import output_grammar
from musegl_core.testing.server import running_server, scripted_plugin_env

pytest.importorskip("musegl_atem")
from musegl_atem.grammar import call_grammar  # noqa: E402

TOOLS = 300
LAST = f"tool_{TOOLS - 1}"
#: the scripted model calls the last tool with n = 305 (its schema asks for at least 299)
CALL = (f" to={LAST}.{LAST}<|message|><atem:function_calls>\n<atem:invoke name=\"{LAST}.{LAST}\">\n"
        '<atem:parameter name="n">305</atem:parameter>\n</atem:invoke>\n</atem:function_calls><|eot|>')


def parameters(i: int) -> dict:
    """A JSON-valued (integer) parameter whose schema differs from tool to tool."""
    return {"type": "object", "properties": {"n": {"type": "integer", "minimum": i}}, "required": ["n"]}


def grammar_of(schemas: list[dict], reasoning: int = 1024) -> str:
    tools = [SimpleNamespace(name=f"tool_{i}", parameters=schema, strict=False) for i, schema in enumerate(schemas)]
    parser = SimpleNamespace(name="atem", grammar=call_grammar, prepare=None)
    return output_grammar(None, config=SimpleNamespace(constrained_reasoning_tokens=reasoning), mode="required",
                          named=None, tools_active=True, tools=tools, tool_parser=parser, prepared_tools=None,
                          aliases={})


def test_a_real_panic_in_llguidance_is_a_base_exception_that_check_turns_into_an_error():
    """How llguidance's Rust panic reaches Python (pyo3's PanicException: a BaseException,
    not an Exception, so ``except Exception`` handlers miss it), on the grammar that
    panicked before: 256 distinct nested JSON grammars next to a max_tokens rule."""
    import llguidance

    rules = "".join(f'j{i}: %json{{"type": "integer", "minimum": {i}}}\n' for i in range(256))
    text = ("start: bounded (" + " | ".join(f"j{i}" for i in range(256)) + ")\n"
            'bounded[max_tokens=8]: /[a-z]*/\n' + rules)
    with pytest.raises(BaseException) as caught:
        llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(text))
    assert not isinstance(caught.value, Exception) and "class too large" in str(caught.value)
    assert "class too large" in g.check(text)  # returned, never raised
    assert g.check(text.replace("[max_tokens=8]", "")) is None  # without the bound: classes are shared


def test_past_the_limit_the_grammar_leaves_out_the_reasoning_message():
    text = grammar_of([parameters(i) for i in range(TOOLS)])
    assert g.nested_grammars(text) == TOOLS and "reasoning" not in text
    assert g.check(text) is None
    at_limit = grammar_of([parameters(i) for i in range(g.MAX_NESTED_WITH_TOKEN_BOUND)])
    assert "start: reasoning? calls" in at_limit and g.check(at_limit) is None


def test_identical_parameter_schemas_share_one_nested_grammar():
    text = grammar_of([parameters(7)] * TOOLS)
    assert g.nested_grammars(text) == 1 and "start: reasoning? calls" in text
    assert g.check(text) is None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    with scripted_plugin_env(tmp_path_factory.mktemp("many-tools"), [{"when": "", "reply": CALL}]):
        config = ServeConfig(model=str(default_model_path()), port=0, executor="scripted", max_context=65536,
                             tool_parser="atem")
        with running_server(config) as running:
            yield running


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def test_chat_completions_required(server):
    body = {"model": "m", "max_tokens": 400, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": f"tool_{i}", "parameters": parameters(i)}}
                      for i in range(TOOLS)]}
    response = post(server.url, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text[:500]
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]["function"]
    assert (call["name"], call["arguments"]) == (LAST, '{"n": 305}')


def test_anthropic_messages_any(server):
    body = {"model": "m", "max_tokens": 400, "messages": [{"role": "user", "content": "x"}],
            "tool_choice": {"type": "any"},
            "tools": [{"name": f"tool_{i}", "input_schema": parameters(i)} for i in range(TOOLS)]}
    response = post(server.url, "/v1/messages", body)
    assert response.status_code == 200, response.text[:500]
    message = response.json()
    assert message["stop_reason"] == "tool_use"
    use = [block for block in message["content"] if block["type"] == "tool_use"][0]
    assert (use["name"], use["input"]) == (LAST, {"n": 305})


def test_responses_required(server):
    body = {"model": "m", "max_output_tokens": 400, "input": "x", "tool_choice": "required",
            "tools": [{"type": "function", "name": f"tool_{i}", "parameters": parameters(i)} for i in range(TOOLS)]}
    response = post(server.url, "/v1/responses", body)
    assert response.status_code == 200, response.text[:500]
    calls = [item for item in response.json()["output"] if item["type"] == "function_call"]
    assert [(c["name"], c["arguments"]) for c in calls] == [(LAST, '{"n": 305}')]
