"""The engine over the real torch executor on the CPU, for the tests that compare what
it launched: the executor that records its launched steps, and the demo tokenizer."""

from __future__ import annotations

from musegl_core.engine.executor import Step
from musegl_cuda.executor import TorchExecutor


class Recording(TorchExecutor):
    """The real executor, remembering what it was asked to launch."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.launched: list[Step] = []

    def launch(self, step):
        self.launched.append(step)
        return super().launch(step)


def demo_tokenizer():
    """The tokenizer of the demo checkpoint (``musegl make-tiny``)."""
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    return MuseTokenizer.load(str(default_model_path()))


def tier_engine(checkpoint, tokenizer, *, blocks: int, host: int | None, disk=None, dtype: str = "float32",
                block_size: int = 4, **more):
    """An engine over the torch executor on the CPU with ``blocks`` device blocks, a host tier of
    ``host`` bytes (0: none) and, with ``disk`` (a folder), a 64 MiB disk tier under it (the
    host and disk tier tests); ``more``: other :class:`EngineConfig` fields. Returns
    ``(engine, events)``."""
    from musegl_core.engine.engine import Engine, EngineConfig

    executor = TorchExecutor(checkpoint, device="cpu", dtype=dtype, block_size=block_size)
    events: list = []
    config = EngineConfig(max_context=256, max_sessions=6, max_inflight_requests=4, max_decode_sequences=4,
                          max_prefill_chunk=32, kv_blocks=blocks, kv_offload_memory=host,
                          kv_offload_dir=None if disk is None else str(disk),
                          kv_offload_disk=None if disk is None else 64 << 20, **more)
    return Engine(executor, tokenizer, config, events.append), events
