"""Where a step's embedding rows go (docs/executor.md section 6), backend-neutral.

A chunk's :class:`~musegl_core.engine.executor.EmbeddingSpan` says that chunk
rows ``offset .. offset+count-1`` take rows ``first .. first+count-1`` of a
computed embedding (an image's rows) as their decoder input. An executor
packs the rows of every chunk into one batch; :func:`embedding_rows` turns
the spans of a step into the packed row indices and the embedding rows that
replace them, checked against the hidden size. The executor only moves the
rows to its device and writes them over the looked-up token rows.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from musegl_core.engine.executor import PromptImage, Step


def no_vision_error() -> ValueError:
    """What ``embed_image`` raises for a model loaded without a vision projector."""
    return ValueError("this model was loaded without a vision projector; it cannot encode images")


def check_image_rows(rows: Any, image: PromptImage) -> Any:
    """``rows`` (what a vision tower made of ``image``), or ``ValueError`` when their
    count is not the ``image.rows`` placeholders the prompt holds."""
    if rows.shape[0] != image.rows:
        raise ValueError(f"the image became {rows.shape[0]} rows, its prompt holds {image.rows}")
    return rows


def embedding_rows(step: Step, starts: Sequence[int], hidden_size: int,
                   take: Callable[[Any, int, int], Any]) -> tuple[list[int], list[Any]] | None:
    """``(packed row indices, pieces)`` of every embedding span of ``step``, or None
    when it has none. ``starts[i]`` is the packed row of chunk ``i``'s first token;
    ``take(embedding, first, count)`` returns rows ``first .. first+count-1`` of a
    span's embedding as a backend array (anything with a ``shape``); each must be
    ``(count, hidden_size)`` (``ValueError`` otherwise). The indices list the
    pieces' rows in order."""
    index: list[int] = []
    pieces: list[Any] = []
    for chunk, first_row in zip(step.chunks, starts):
        for span in chunk.embeds:
            rows = take(span.embedding, span.first, span.count)
            if tuple(rows.shape) != (span.count, hidden_size):
                raise ValueError(f"sequence {chunk.seq}: embedding rows must be ({span.count}, "
                                 f"{hidden_size}), got {tuple(rows.shape)}")
            start = int(first_row) + span.offset
            index.extend(range(start, start + span.count))
            pieces.append(rows)
    return (index, pieces) if index else None
