"""A test-only speculator plugin (entry point ``drafts``) that drafts from recorded runs.

Enabled by ``MUSEGL_DRAFTS``:

* ``record:PATH`` proposes nothing (a do-nothing speculator) and appends
  every decoding sequence it is asked about to PATH (JSON lines of token ids);
* ``replay:PATH:K`` proposes up to K tokens per step: the continuation of a
  recorded sequence that extends the current one, with one draft corrupted
  at index ``len(tokens) % (K + 1)`` (no corruption when that is K), so the
  accepted count varies from 0 to K across steps.

Registered only in tests, never in the product.
"""

from __future__ import annotations

import json
import os

from musegl_core.engine.speculator import NoSpeculator
from musegl_core.plugins import hookimpl
from musegl_core.plugins.specs import SpeculatorSpec


class RecordingSpeculator(NoSpeculator):
    max_draft = 1  # asked every step, proposes nothing

    def __init__(self, path: str):
        self.path = path

    def propose(self, requests):
        with open(self.path, "a", encoding="utf-8") as f:
            for r in requests:
                f.write(json.dumps(list(r.tokens)) + "\n")
        return {}


class ReplayingSpeculator(NoSpeculator):
    def __init__(self, path: str, k: int, vocab: int):
        with open(path, encoding="utf-8") as f:
            self.recorded = [json.loads(line) for line in f if line.strip()]
        self.max_draft = k
        self.vocab = vocab
        self.proposed = 0

    def propose(self, requests):
        out = {}
        for r in requests:
            tokens = list(r.tokens)
            n = len(tokens)
            best = max((seq for seq in self.recorded if len(seq) > n and seq[:n] == tokens), key=len, default=None)
            if best is None:
                continue
            drafts = best[n : n + r.max_draft]
            bad = n % (self.max_draft + 1)
            if bad < len(drafts):
                drafts[bad] = (drafts[bad] + 1) % self.vocab
            out[r.seq] = drafts
            self.proposed += len(drafts)
        return out


def _create(executor, options):
    mode = os.environ.get("MUSEGL_DRAFTS")
    if not mode:
        return None
    kind, _, rest = mode.partition(":")
    if kind == "record":
        return RecordingSpeculator(rest)
    path, _, k = rest.rpartition(":")
    return ReplayingSpeculator(path, int(k), executor.info.vocab_size)


@hookimpl
def musegl_speculators():
    return [SpeculatorSpec("drafts", "drafts from recorded runs (tests only)", _create)]
