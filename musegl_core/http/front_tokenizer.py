"""The served model's tokenizer, loaded once by the front.

The front never runs the model and never tokenizes a generation request
(the worker does that, once). It loads the tokenizer only for the
``/tokenize`` and ``/detokenize`` endpoints.

:class:`FrontTokenizer` loads the tokenizer of ``--model`` (GGUF or Hugging
Face directory) once, at application start-up, off the event loop. When no
model path is configured (tests that run the front without a model) or the
tokenizer cannot be read, it stays empty and those endpoints answer 503.
"""

from __future__ import annotations

import asyncio
import logging

from musegl_core.model_tokenizer import load_tokenizer
from musegl_core.config import ServeConfig
from musegl_core.tokenizer import MuseTokenizer, TokenizerError

log = logging.getLogger("musegl.http")


class FrontTokenizer:
    """Holds the served tokenizer once :meth:`load` has run (``None`` before)."""

    def __init__(self) -> None:
        self.tokenizer: MuseTokenizer | None = None

    async def load(self, config: ServeConfig) -> MuseTokenizer | None:
        """Load the tokenizer of ``config.model`` in a thread; failures are logged."""
        if config.model is None:
            return None
        try:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, config.model)
        except (OSError, ValueError, TokenizerError) as exc:
            log.warning("the front could not load the tokenizer of %s (%s); /tokenize and /detokenize are unavailable",
                        config.model, exc)
        return self.tokenizer
