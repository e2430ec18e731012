"""``musegl render`` and ``musegl parse``: the debugging aids of issue 4.6.

Both run the server's own code paths (request planning, worker tokenization,
stop handling, response assembly); these tests check that through the CLI.
"""

from __future__ import annotations

import json

import pytest

from musegl_core.cli.main import main

EXAMPLE_1 = (
    "<|begin_of_text|><|start|>system<|message|>You are a helpful AI assistant.\n"
    "Knowledge cutoff: 2026-01-04.\nCurrent date: 2026-03-15.\n\nReasoning strength: high.\n\n"
    '# Valid recipients: "self", "user".<|eot|><|start|>user<|message|>What is 17 * 23?<|eot|><|start|>assistant'
)
DATE = {"chat_template_kwargs": {"current_date": "2026-03-15"}}


def run(capsys, argv, stdin=None, monkeypatch=None):
    if stdin is not None:
        import io

        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def body(*messages, **fields):
    return json.dumps({"model": "m", "messages": list(messages), **DATE, **fields})


USER = {"role": "user", "content": "What is 17 * 23?"}


# -- render -----------------------------------------------------------------------------------
def test_render_prints_the_worked_example_exactly(capsys, tmp_path):
    """The official template's single-user-message example through the front's planning code."""
    path = tmp_path / "request.json"
    path.write_text(body(USER))
    status, out, _ = run(capsys, ["render", str(path), "--plugin", "core"])
    assert status == 0
    assert out == EXAMPLE_1 + "\n"


def test_render_reads_stdin_and_maps_reasoning_effort(capsys, monkeypatch):
    """Reasoning.effort sets the reasoning strength."""
    status, out, _ = run(
        capsys, ["render", "--plugin", "core"], body(USER, reasoning={"effort": "medium"}), monkeypatch
    )
    assert status == 0 and "Reasoning strength: medium." in out


def test_render_ids_keep_client_control_strings_literal(capsys, monkeypatch):
    """A user typing <|eot|> gets the characters;
    6.9: exactly one BOS id first."""
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    request = body({"role": "user", "content": "Hi <|eot|> there"})
    status, out, _ = run(capsys, ["render", "--plugin", "core", "--ids", "--json"], request, monkeypatch)
    assert status == 0
    result = json.loads(out)
    tokenizer = MuseTokenizer.load(default_model_path())
    ids = result["ids"]
    assert ids[0] == tokenizer.bos_id and ids.count(tokenizer.bos_id) == 1
    structural = result["prompt"].count("<|eot|>") - 1  # one is the user's text
    assert ids.count(tokenizer.eot_id) == structural == 2
    assert tokenizer.decode(ids) == result["prompt"]
    assert {"text": "Hi <|eot|> there", "special": False} in result["segments"]


def test_render_ids_with_a_tokenizer_path(capsys, monkeypatch):
    from musegl_core.tiny import default_model_path

    status, out, _ = run(
        capsys, ["render", "--plugin", "core", "--ids", "--tokenizer", str(default_model_path())],
        body(USER), monkeypatch,
    )
    assert status == 0
    text, _, ids = out.rpartition("\n\n# ")
    assert text == EXAMPLE_1 and ids.split("\n")[1].split()[0] == "200000"


@pytest.mark.parametrize(
    "fields, param, code",
    [
        ({"n": 9}, "n", None),
        ({"grammar": "root ::= x"}, "grammar", "unsupported_parameter"),
        ({"add_generation_prompt": False}, "add_generation_prompt", "unsupported_parameter"),
        ({"chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs.bos_token", "unsupported_parameter"),
        ({"reasoning_effort": "minimal"}, "reasoning_effort", "unsupported_parameter"),
    ],
)
def test_render_applies_the_server_validation(capsys, monkeypatch, fields, param, code):
    """The same 400s as the server, on stderr, exit 1."""
    payload = json.loads(body(USER))
    payload.update(fields)
    status, out, err = run(capsys, ["render", "--plugin", "core"], json.dumps(payload), monkeypatch)
    assert status == 1 and out == ""
    error = json.loads(err)
    assert error["status"] == 400
    assert (error["error"]["param"], error["error"]["code"]) == (param, code)


def test_render_closes_a_trailing_assistant_message(capsys, monkeypatch):
    """A final assistant message is history; the generation prompt follows."""
    request = body(USER, {"role": "assistant", "content": "391"})
    status, out, _ = run(capsys, ["render", "--plugin", "core"], request, monkeypatch)
    assert status == 0
    assert out.rstrip("\n").endswith("<|start|>assistant to=user<|message|>391<|eot|><|start|>assistant")


# -- parse ------------------------------------------------------------------------------------
def parse(capsys, monkeypatch, text, *flags):
    status, out, err = run(capsys, ["parse", "--plugin", "core", *flags], text, monkeypatch)
    return status, (json.loads(out) if out else None), err


def test_parse_r1_reasoning_and_content(capsys, monkeypatch):
    status, result, _ = parse(
        capsys, monkeypatch, " to=self<|message|>Think.<|eom|><|start|>assistant to=user<|message|>Hi!<|eot|>"
    )
    assert status == 0
    assert result == {"content": "Hi!", "reasoning_content": "Think.", "finish_reason": "stop"}


def test_parse_stops_at_eot_like_the_worker(capsys, monkeypatch):
    """<|eot|> ends generation unless ignore_eos."""
    text = " to=user<|message|>A<|eot|> to=user<|message|>B"
    assert parse(capsys, monkeypatch, text)[1]["content"] == "A"
    assert parse(capsys, monkeypatch, text, "--ignore-eos")[1]["content"] == "A\n\nB"


def test_parse_hidden_reasoning_and_stop_strings(capsys, monkeypatch):
    text = " to=self<|message|>Plan.<|eom|><|start|>assistant to=user<|message|>alpha beta<|eot|>"
    _, result, _ = parse(capsys, monkeypatch, text, "--hide-reasoning", "--stop", "beta")
    assert result == {"content": "alpha ", "finish_reason": "stop"}


def test_parse_r6_length_cut_drops_control_fragment(capsys, monkeypatch):
    _, result, _ = parse(capsys, monkeypatch, " to=user<|message|>Answer<|eo", "--finish", "length")
    assert result == {"content": "Answer", "finish_reason": "length"}


def test_parse_shows_tool_messages_without_a_tool_parser(capsys, monkeypatch):
    """With tools active the tool-addressed body is handed off."""
    call = '<atem:function_calls>\n<atem:invoke name="get_time.get_time">\n</atem:invoke>\n</atem:function_calls>'
    text = f" to=self<|message|>t<|eom|><|start|>assistant to=get_time.get_time<|message|>{call}<|eot|>"
    _, result, _ = parse(capsys, monkeypatch, text, "--tools-active")
    assert result["reasoning_content"] == "t"
    assert [(m["recipient"], m["body"]) for m in result["tool_messages"]] == [("get_time.get_time", call)]
    _, inactive, _ = parse(capsys, monkeypatch, text)
    assert inactive["content"] == call  # 2.2.7: tools inactive → content


def test_parse_tool_calls_through_the_atem_plugin(capsys, monkeypatch):
    """A flat alias maps back to the declared name, when the atem plugin is installed."""
    pytest.importorskip("musegl_atem.plugin")
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]
    text = (
        ' to=get_time.get_time<|message|><atem:function_calls>\n<atem:invoke name="get_time.get_time">\n'
        '<atem:parameter name="tz">UTC</atem:parameter>\n</atem:invoke>\n</atem:function_calls><|eot|>'
    )
    status, out, err = run(
        capsys, ["parse", "--plugin", "atem", "--tools", json.dumps(tools)], text, monkeypatch
    )
    assert status == 0, err
    result = json.loads(out)
    assert result["finish_reason"] == "tool_calls"
    call = result["tool_calls"][0]["function"]
    assert call["name"] == "get_time" and json.loads(call["arguments"]) == {"tz": "UTC"}


def test_commands_are_registered(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "render" in out and "parse" in out
