"""transformers running a quantized checkpoint's own weights, dequantized, in float32.

The exactness tests of stored weights compare an executor with the oracle on the
very values the file holds: :func:`reference_with_weights` returns a float32 copy
of a transformers model (built by :func:`~musegl_core.testing.reference_models.build_tiny_model`
with the file's shape) whose text weights are :meth:`Checkpoint.read`'s float32
values of the file (GGUF blocks and MLX codes decoded by the core's readers, GGUF Q/K
rows un-permuted, centered norms as transformers stores them).
"""

from __future__ import annotations

import copy


def reference_with_weights(model, checkpoint):
    """A float32 copy of ``model`` (a ``MuseGlimmerForConditionalGeneration`` of the
    checkpoint's shape) with the text weights of ``checkpoint`` (an open
    :class:`~musegl_core.checkpoint.loader.Checkpoint`)."""
    import torch

    twin = copy.deepcopy(model).float().eval()
    params = dict(twin.named_parameters())
    with torch.no_grad():
        for name, values in checkpoint.iter_weights():
            key = "lm_head.weight" if name == "lm_head.weight" else f"model.language_model.{name}"
            target = params[key]
            tensor = torch.from_numpy(values)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"{name}: the checkpoint has {tuple(tensor.shape)}, the model {tuple(target.shape)}")
            target.copy_(tensor)
    return twin
