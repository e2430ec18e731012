"""Small HTTP helpers shared by the HTTP tests."""

import httpx


def chat(url, messages, headers=None, **extra):
    body = {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
