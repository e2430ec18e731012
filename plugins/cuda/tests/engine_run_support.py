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
