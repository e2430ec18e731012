"""Adversarial input finishes within its budgets.

Each test measures wall time; the worst cases are reported in the plugin's
README. Limits are generous multiples of what a 2-core machine needs.
"""

from __future__ import annotations

import json
import time

from musegl_core.chat.messages import ToolDef

from musegl_atem.budget import BudgetExhausted, OutputBudget, RegexBudget

from atem_support import args, call, is_output_error, run, schema_error


def timed(fn):
    """``fn()`` and the CPU seconds this thread spent on it: the bound is on the work done,
    which other processes on a shared (or xdist-loaded) machine do not change."""
    started = time.thread_time()
    result = fn()
    return result, time.thread_time() - started


_DRAFTS = {
    "draft7": "http://json-schema.org/draft-07/schema#",
    "2019-09": "https://json-schema.org/draft/2019-09/schema",
    "2020-12": None,  # the default dialect
}


def _distinct_properties(uri, bad=None, n=4000):
    """One tool with ``n`` distinct property schemas (within the 4096-node
    limit); ``bad`` replaces the first or last one by a malformed node."""
    properties = {
        f"p{i}": {"type": "string", "description": f"parameter {i}", "minLength": i, "maxLength": i + 10} for i in range(n)
    }
    if bad == "first":
        properties["p0"] = {"type": "string", "required": True}
    elif bad == "last":
        properties[f"p{n - 1}"] = {"type": 5}
    schema = {"type": "object", "properties": properties}
    if uri:
        schema["$schema"] = uri
    return ToolDef("t", parameters=schema)


def test_tv18_large_valid_looking_schema_preflight_is_fast_in_every_draft():
    """4000 distinct property schemas: accepted, or 400 for one malformed node
    at either end of the walk, well under a second in every dialect (the
    metaschema check used to take 0.8 s under Draft 7 and ~2.5 s under
    2019-09/2020-12). A slow run is retried twice and the best time counts, so a
    moment of contention on a shared CI machine does not fail the bound."""
    measured = {}
    for draft, uri in _DRAFTS.items():
        for bad in (None, "first", "last"):
            tool = _distinct_properties(uri, bad)
            error, seconds = timed(lambda: schema_error([tool]))
            for _ in range(2):
                if seconds < 1.0:
                    break
                seconds = min(seconds, timed(lambda: schema_error([tool]))[1])
            measured[f"{draft}/{bad or 'valid'}"] = round(seconds, 3)
            if bad is None:
                assert error is None, error
            else:
                assert error is not None and error.status == 400 and error.code == "invalid_tool_schema"
                assert ("required" if bad == "first" else "type") in error.message
            assert seconds < 1.0, (draft, bad, seconds)
    print("preflight seconds:", measured)


def test_tv21_redos_pattern_hits_the_regex_budget():
    t = ToolDef("t", parameters={"type": "object", "properties": {"v": {"type": "string", "pattern": "^(a|aa)+$"}}})
    result, seconds = timed(lambda: args(t, [("v", "a" * 40 + "!")]))
    assert is_output_error(result) and "ms budget" in result.message
    assert seconds < 2.0


def test_tv21_redos_pattern_property_name_is_prompt():
    t = ToolDef("t", parameters={"type": "object", "patternProperties": {"^(a|a)*$": {"type": "string"}}})
    _, seconds = timed(lambda: args(t, [("a" * 30 + "!", "x")]))
    assert seconds < 2.0


def test_tv21_budget_is_shared_by_all_calls_of_a_response():
    budget = RegexBudget()
    import regex

    slow = regex.compile("^(a|aa)+$")
    try:
        for _ in range(100):
            budget.search(slow, "a" * 26 + "!")
    except BudgetExhausted:
        pass
    assert budget.used >= budget.seconds


def test_tv42_unique_items_over_20000_distinct_objects():
    t = ToolDef("t", parameters={"type": "object", "properties": {"v": {"type": "array", "uniqueItems": True}}})
    body = json.dumps([{"id": i, "tags": [i, str(i)]} for i in range(20_000)])
    result, seconds = timed(lambda: args(t, [("v", body)]))
    assert seconds < 5.0
    assert is_output_error(result) or len(result["v"]) == 20_000


def test_tv43_huge_enum_is_bounded():
    t = ToolDef("t", parameters={"type": "object", "properties": {"v": {"enum": list(range(300_000))}}})
    result, seconds = timed(lambda: args(t, [("v", "299999")]))
    assert result == {"v": 299999} and seconds < 5.0


def test_tv43_deeply_nested_arguments_fail_cleanly():
    t = ToolDef("t", parameters={"type": "object"})
    for body in ("[" * 100_000 + "]" * 100_000, '{"a":' * 500 + "1" + "}" * 500):
        result, seconds = timed(lambda: run(call("t.t", [("v", body)]), [t]))
        assert seconds < 2.0
        # Too deep to be JSON (stays a string) or refused by the depth limit.
        assert is_output_error(result) or isinstance(result[0][1]["v"], str)


def test_tv43_ten_megabyte_argument_bodies():
    text = ToolDef("t", parameters={"type": "object", "properties": {"v": {"type": "string", "maxLength": 10}}})
    body = "x" * (10 << 20)
    result, seconds = timed(lambda: run(call("t.t", [("v", body)]), [text], chunk=1 << 16))
    assert is_output_error(result) and seconds < 10.0
    array = ToolDef("t", parameters={"type": "object", "properties": {"v": {"type": "array", "items": {"type": "integer"}}}})
    body = "[" + ",".join(["1"] * (5 << 20)) + "]"
    result, seconds = timed(lambda: run(call("t.t", [("v", body)]), [array], chunk=1 << 20))
    assert is_output_error(result) and "units of work" in result.message and seconds < 10.0


def test_tv43_many_calls_share_the_output_budget():
    t = ToolDef("t", parameters={"type": "object", "properties": {"v": {"type": "array"}}})
    body = json.dumps(list(range(100_000)))
    output = "".join(call("t.t", [("v", body)]).replace("<|eot|>", "<|eom|><|start|>assistant") for _ in range(30))
    result, seconds = timed(lambda: run(output, [t], chunk=1 << 20))
    assert is_output_error(result) and seconds < 10.0


def test_tv43_ordinary_calls_fit_the_budget():
    t = ToolDef("t", parameters={"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}})
    params = [(f"p{i}", str(i)) for i in range(300)]
    result = run(call("t.t", params), [t])
    assert result[0][1] == {f"p{i}": i for i in range(300)}


def test_coercion_tries_at_most_1024_combinations():
    t = ToolDef("t", parameters={"type": "object", "additionalProperties": {"type": ["integer", "string"]}, "maxProperties": 0})
    params = [(f"p{i}", "1") for i in range(11)]
    result, seconds = timed(lambda: args(t, params))
    assert is_output_error(result) and "1024" in result.message and seconds < 5.0


def test_output_budget_counts():
    budget = OutputBudget(limit=3)
    budget.spend(3)
    try:
        budget.spend()
    except BudgetExhausted:
        return
    raise AssertionError("the budget did not run out")
