"""The raw JSON body of a request, before any schema looks at it.

Every route that takes a JSON body reads it through :func:`load_json_object`
(by way of :func:`musegl_core.http.schemas.parse_body`), which refuses with a
400 what Python's ``json`` module accepts but nothing later can use:

* **nesting deeper than** :data:`MAX_JSON_DEPTH` levels (code
  ``json_too_deep``), wherever it is, unknown fields included: a deep value
  would otherwise end in a ``RecursionError`` somewhere later (at about 970
  levels already in ``json.loads``). ``param`` names the top-level field that
  holds it. 128 levels leave room for every legitimate body: a tool schema
  may nest 64 levels (``tool-validation.md``), plus the few of the body
  around it;
* **a lone UTF-16 surrogate** (``"\\ud800"`` without its pair) in any string
  or key (code ``invalid_unicode``): JSON's escapes can spell it, but it is
  not a character, so no tokenizer, stop matcher or UTF-8 writer can take it.
  ``param`` is the path of the string (``messages[0].content``, ``stop[1]``).
  A surrogate *pair* is one character and fine.

Both checks are cheap on ordinary bodies: surrogates are looked for only when
the raw bytes hold a ``\\uD800``-``\\uDFFF`` escape or a surrogate's raw UTF-8
bytes (``ED A0 80``: not valid UTF-8, but Python's decoder passes them), and the depth walk visits
containers only (a list of scalars, such as a prompt's token ids, is one
C-level pass).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, Iterator

from musegl_core.errors import ApiError, bad_request

#: The deepest nesting of arrays and objects a body may have (the body itself is level 1).
MAX_JSON_DEPTH = 128

#: a surrogate spelled as an escape, or encoded raw (UTF-8's ED A0 80 .. ED BF BF, which
#: ``json.loads`` decodes with ``surrogatepass``)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf][\x80-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTAINERS = (dict, list)
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)


def load_json_object(body: bytes) -> dict[str, Any]:
    """``body`` as a JSON object, or a 400 ``invalid_request_error``."""
    try:
        payload = json.loads(body)
    except RecursionError:
        raise too_deep(_deep_field_in_text(body)) from None
    except (UnicodeDecodeError, ValueError) as exc:
        if "integer string conversion" in str(exc):  # Python's digit limit, not a JSON error
            raise bad_request(f"the request body holds an integer of more than {sys.get_int_max_str_digits()} "
                              "digits, which no field takes", code="invalid_json") from None
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(payload, dict):
        raise bad_request("the request body must be a JSON object")
    deep = deep_field(payload)
    if deep is not None:
        raise too_deep(deep)
    if _SURROGATE_ESCAPE.search(body):
        where = lone_surrogate_path(payload)
        if where is not None:
            raise bad_request(
                f"'{where}' holds a lone UTF-16 surrogate escape (such as \\ud800 without its pair), "
                "which is not a character; send valid Unicode", code="invalid_unicode", param=where)
    return payload


def too_deep(field: str | None) -> ApiError:
    where = f"'{field}'" if field else "the request body"
    return bad_request(f"{where} is nested more than {MAX_JSON_DEPTH} levels deep (arrays and objects)",
                       code="json_too_deep", param=field)


def deep_field(payload: dict[str, Any]) -> str | None:
    """The top-level key whose value nests past :data:`MAX_JSON_DEPTH` (the
    body is level 1), or None. Iterative: no depth can exhaust the stack."""
    stack: list[tuple[Any, int, str]] = [(value, 2, key) for key, value in payload.items()
                                         if isinstance(value, _CONTAINERS)]
    while stack:
        value, depth, field = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return field
        items = value.values() if isinstance(value, dict) else value
        kinds = set(map(type, items))
        if dict in kinds or list in kinds:
            stack.extend((item, depth + 1, field) for item in items if isinstance(item, _CONTAINERS))
    return None


def _deep_field_in_text(body: bytes) -> str | None:
    """The top-level key under which ``body`` (too deep for ``json.loads``)
    first nests past :data:`MAX_JSON_DEPTH`; the scan stops there."""
    depth, key, last_string = 0, None, None
    for match in _TOKENS.finditer(body):
        token = match.group()
        if token[:1] == b'"':
            if depth == 1:
                last_string = token
            continue
        if token in (b"[", b"{"):
            if depth == 1:
                key = last_string
            depth += 1
            if depth > MAX_JSON_DEPTH:
                break
        else:
            depth -= 1
    if key is None:
        return None
    try:
        return json.loads(key)
    except ValueError:
        return None


def lone_surrogate_path(payload: Any) -> str | None:
    """The path (``messages[0].content``) of the first string or key holding
    a lone surrogate, or None."""
    for path, text in _strings(payload, ""):
        if _SURROGATE.search(text):
            return path or None
    return None


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every string and key of ``value`` with its path, depth first (iterative)."""
    stack = [(value, path)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            yield path, value
        elif isinstance(value, dict):
            children = []
            for key, item in value.items():
                child = f"{path}.{key}" if path else key
                if _SURROGATE.search(key):
                    yield (child.encode("utf-8", "backslashreplace").decode("ascii"), key)
                children.append((item, child))
            stack.extend(reversed(children))
        elif isinstance(value, list):
            stack.extend(reversed([(item, f"{path}[{i}]") for i, item in enumerate(value)]))
