"""Deterministic prompts for the two bench workloads.

Everything here is a pure function of the seed and the indices, so two runs
with the same options send the same text (the model's replies, which the
``agent`` workload feeds back, are deterministic too at temperature 0).

Sizes are given in *tokens* but the text is made of words, so the runner
converts with a measured ``tokens_per_word`` (see
:func:`musegl_core.bench.runner.calibrate`): tokenizers differ a lot (the tiny
checkpoints' 400-merge BPE spends about 2.5 tokens on an English word, a real
200k-vocabulary tokenizer about 1.1).
"""

from __future__ import annotations

import random
from typing import Any

import attrs

#: The workloads ``musegl bench --workload`` accepts.
WORKLOADS = ("chat", "agent")

# Plain English words, most of them in the tiny tokenizer's corpus, so the
# filler tokenizes like ordinary prose on any tokenizer.
_WORDS = tuple(
    """
    the quick brown fox jumps over lazy dog model test hello how can help you today would like
    know weather and in is sunny with light breeze temperature around degrees what it that makes
    are helpful assistant think step by then answer question clearly user wants time so should
    call tool message ends turn token server holds back partial characters sessions keep their
    transcript cache follow cheap serve beginning there was text into bytes she said they meet at
    station seven but train late numbers split groups digits streaming responses send one chunk
    per result items value filter count name status done order request reply history agent plan
    file code read write check again next first last small large fast slow list table report
    """.split()
)

SYSTEM_PROMPT = "You are a helpful assistant. Think step by step, then answer the question clearly."


def words_for(tokens: int, tokens_per_word: float) -> int:
    """How many filler words make about ``tokens`` tokens (at least one)."""
    return max(1, round(tokens / max(tokens_per_word, 0.1)))


def filler_text(seed: int, *key: int | str, words: int) -> str:
    """``words`` deterministic pseudo-English words for ``(seed, *key)``.

    The text opens with its key spelled out, so two prompts never share more
    than a few leading tokens (no accidental prefix reuse between requests).
    """
    rng = random.Random("|".join(map(str, (seed, *key))))
    label = "-".join(map(str, key))
    body = [rng.choice(_WORDS) for _ in range(max(words - 1, 0))]
    sentences: list[str] = []
    while body:
        length = rng.randint(6, 14)
        sentence, body = body[:length], body[length:]
        sentences.append(" ".join(sentence).capitalize() + ".")
    return f"Request {label}: " + " ".join(sentences)


@attrs.frozen
class ChatPrompt:
    """One independent ``chat`` request: a single user message."""

    index: int
    messages: tuple[dict[str, Any], ...]


def chat_prompt(seed: int, index: int, *, words: int) -> ChatPrompt:
    """The ``index``-th independent prompt of a ``chat`` run."""
    return ChatPrompt(index, ({"role": "user", "content": filler_text(seed, "chat", index, words=words)},))


@attrs.define
class Conversation:
    """The growing history of one ``agent`` conversation in a named session.

    Every turn appends the assistant reply the client received and a new user
    message of about ``turn_words`` words; the full history is resubmitted
    with the same ``session_id``, so the server should execute only the suffix.
    """

    index: int
    session_id: str
    seed: int
    turn_words: int
    messages: list[dict[str, Any]] = attrs.field(factory=list)
    turns_done: int = 0
    #: the system prompt (``--shared-system-tokens``: the same long one in every conversation)
    system: str = SYSTEM_PROMPT
    #: ids of the tool calls of the last reply, answered before the next user message
    open_calls: list[str] = attrs.field(factory=list)
    #: ``--context-tokens``: words of the conversation's own context (files read, an earlier
    #: history), sent ahead of its first user message; 0: none
    context_words: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.messages:
            self.messages.append({"role": "system", "content": self.system})

    def next_user_turn(self) -> tuple[dict[str, Any], ...]:
        """Append a tool result for each call of the last reply, then the next user message,
        and return the history to submit."""
        turn = self.turns_done + 1
        for n, call_id in enumerate(self.open_calls):
            self.messages.append({"role": "tool", "tool_call_id": call_id,
                                  "content": filler_text(self.seed, "agent-tool", self.index, turn, n,
                                                         words=self.turn_words)})
        self.open_calls = []
        text = filler_text(self.seed, "agent", self.index, turn, words=self.turn_words)
        if turn == 1 and self.context_words:
            text = filler_text(self.seed, "agent-context", self.index, words=self.context_words) + "\n\n" + text
        self.messages.append({"role": "user", "content": text})
        return tuple(dict(message) for message in self.messages)

    def record_reply(self, content: str, reasoning: str, tool_calls: list[dict[str, Any]] | None = None) -> None:
        """Append the assistant reply exactly as the client received it (its tool calls too)."""
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
            self.open_calls = [call.get("id") or f"call_{self.index}_{self.turns_done}_{n}"
                               for n, call in enumerate(tool_calls)]
            for call, call_id in zip(tool_calls, self.open_calls):
                call["id"] = call_id
        self.messages.append(message)
        self.turns_done += 1
