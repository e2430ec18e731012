"""A test-only executor plugin that replays scripted model output.

It implements the real executor contract and runs behind the real engine,
worker and tokenizer; only the "model" is a script: what a tool parser, a
dialect or an API surface needs to be tested end to end without a trained
model. Registered through a ``musegl`` entry point that
:func:`musegl_core.testing.server.scripted_plugin_env` installs for the
duration of a test, never in the product.

The script is a JSON file named by ``MUSEGL_SCRIPT``: a list of
``{"when": "<substring of the decoded prompt>", "reply": "<raw output>"}``.
The first entry whose ``when`` occurs in the prompt's text (special tokens
written out) is replayed: ``reply`` is tokenized with special tokens parsed
and emitted one token per decode step, followed by EOS (unless the entry sets
``"eos": false``, in which case the last token repeats until max_tokens). Two more keys shape
failures: ``"fail_after": N`` makes the step that would sample token N + 1
raise (an executor failure after N generated tokens), and
``"prefill_delay": S`` sleeps S seconds before the first token (a slow
prefill, for the streaming preflight timeout) and ``"token_delay": S``
sleeps S seconds before every token (a slow generation, for shutdown).
``"pieces": [...]`` replaces ``reply``: each string is tokenized on its own and
the ids are concatenated, so the output is ids that are not the canonical
tokenization of its text (as a real model's often are).

Grammar masks (constrained decoding) are honoured like a sampler would: when
a row's mask forbids the scripted token, the executor draws an allowed id
with the row's uniform number instead and leaves the script for good; off
script it draws allowed ids while masks come and ends with EOS at the first
unmasked row. A test can so script the free part of an output (the text
before a tool call opens) and let the grammar alone shape the rest.
"""

from __future__ import annotations

import json
import os
import time

from musegl_core.engine.executor import ExecutorLimits, ModelInfo, StepOutput
from musegl_core.plugins import hookimpl
from musegl_core.plugins.specs import ExecutorSpec


class ScriptedExecutor:
    block_size = 16
    limits = ExecutorLimits()

    def __init__(self, model: str, script_path: str):
        from musegl_core.tokenizer import MuseTokenizer

        self.tokenizer = MuseTokenizer.load(model)
        with open(script_path, encoding="utf-8") as f:
            self.script = json.load(f)
        self.info = ModelInfo(
            name="scripted", vocab_size=self.tokenizer.vocab_size, hidden_size=8, num_layers=1,
            native_context=1 << 20, dtype="none", backend="scripted",
            vision=os.environ.get("MUSEGL_SCRIPT_VISION", "1") != "0",  # "0": a text-only model
        )
        # The "KV cache": the token id written at each cache slot (block * block_size + offset),
        # so prompts whose prefix was reused from a session or snapshot read back whole.
        self._cells: dict[int, int] = {}
        self._prompts: dict[int, list[int]] = {}
        self._replies: dict[int, list[int]] = {}
        self._entries: dict[int, dict] = {}
        self._sampled: dict[int, int] = {}
        self.num_blocks = 0

    def kv_bytes_per_block(self) -> int:
        return 0

    def kv_memory_available(self) -> int | None:
        return None

    def embed_image(self, image):
        """The script does not look at images: it accepts them (so the worker's real image
        preprocessing and placement run) and replies by script; the rows are zeros."""
        import numpy as np

        return np.zeros((image.rows, self.info.hidden_size), dtype=np.float32)

    def allocate_kv(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def _slot(self, chunk, position: int) -> int:
        return chunk.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def _reply_for(self, seq: int) -> list[int]:
        text = self.tokenizer.decode(self._prompts.pop(seq, []))
        for entry in self.script:
            if entry["when"] in text:
                self._entries[seq] = entry
                if "pieces" in entry:  # tokenized piece by piece: ids a model may emit, not the canonical ones
                    ids = [i for piece in entry["pieces"] for i in self.tokenizer.encode(piece, special=True)]
                else:
                    ids = self.tokenizer.encode(entry["reply"], special=True)
                if entry.get("eos", True):
                    ids.append(self.tokenizer.eos_id)
                return ids
        raise RuntimeError(f"no scripted reply matches the prompt (…{text[-80:]!r})")

    def step(self, step):
        out = StepOutput()
        for chunk in step.chunks:
            if any(b >= self.num_blocks for b in chunk.blocks):
                raise ValueError("block id outside the pool")
            for position, token in zip(chunk.positions, chunk.tokens):
                self._cells[self._slot(chunk, position)] = token
            if chunk.seq not in self._replies:
                self._prompts[chunk.seq] = [self._cells.get(self._slot(chunk, p), 0)
                                            for p in range(chunk.positions[-1] + 1)]
            if not chunk.sample:
                continue
            if chunk.seq not in self._replies:
                self._replies[chunk.seq] = self._reply_for(chunk.seq)
            entry = self._entries.get(chunk.seq, {})
            sampled = self._sampled.get(chunk.seq, 0)
            if sampled == 0 and entry.get("prefill_delay"):
                time.sleep(entry["prefill_delay"])
            if entry.get("token_delay"):
                time.sleep(entry["token_delay"])
            if entry.get("fail_after") is not None and sampled >= entry["fail_after"]:
                raise RuntimeError("scripted executor failure")
            self._sampled[chunk.seq] = sampled + 1
            reply = self._replies[chunk.seq]
            mask = chunk.masks[0] if len(chunk.masks) else None
            if reply is None:  # off script: masked draws, EOS once free
                out.tokens[chunk.seq] = [self._draw(mask, chunk) if mask is not None else self.tokenizer.eos_id]
                continue
            token = reply[0]
            if mask is not None and not (int(mask[token // 32]) >> (token % 32)) & 1:
                self._replies[chunk.seq] = None
                out.tokens[chunk.seq] = [self._draw(mask, chunk)]
                continue
            out.tokens[chunk.seq] = [reply.pop(0) if len(reply) > 1 else reply[0]]
        return out

    def _draw(self, mask, chunk) -> int:
        import numpy as np

        bits = np.unpackbits(np.asarray(mask, dtype=np.uint32).view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: self.info.vocab_size])
        u = chunk.uniforms[0] if len(chunk.uniforms) else 0.5
        return int(allowed[min(int(u * len(allowed)), len(allowed) - 1)])

    def copy_blocks(self, pairs) -> None:
        for src, dst in pairs:
            for offset in range(self.block_size):
                if src * self.block_size + offset in self._cells:
                    self._cells[dst * self.block_size + offset] = self._cells[src * self.block_size + offset]

    def release_sequence(self, seq: int) -> None:
        self._prompts.pop(seq, None)
        self._replies.pop(seq, None)
        self._entries.pop(seq, None)
        self._sampled.pop(seq, None)

    def close(self) -> None:
        pass


def _create(options):
    return ScriptedExecutor(options.model, os.environ["MUSEGL_SCRIPT"])


@hookimpl
def musegl_executors():
    return [ExecutorSpec("scripted", "replays scripted output (tests only)", _create, lambda: True, -100)]
