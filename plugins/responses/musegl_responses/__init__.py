"""musegl-responses: the OpenAI Responses API as a musegl API surface (docs/responses.md)."""
