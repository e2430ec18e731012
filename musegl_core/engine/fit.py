"""Whether a model fits its device: the start-up arithmetic ``musegl serve`` prints.

Before the worker loads anything, ``musegl serve`` asks the executor's plugin for a
:class:`MemoryPlan` (``ExecutorSpec.memory_plan``: the device, the memory it has,
and the bytes the weights will take there, by stored type, from the checkpoint's
tensor table alone) and the KV layout (``kv_layout``). :class:`Fit` adds them up:

    weights + KV of one --max-context request + the executor's reserve  <=  device memory

(KV blocks are taken on demand, docs/engine.md "KV memory: blocks on demand": sessions
hold what they fill, so the least the pool must hold is one request of --max-context
positions, as the engine's own check asks) and gives one line either way: what the
weights take, the KV bytes a position, the room left for KV in bytes, positions and
sessions of --max-context; or, when it does not fit, the numbers and the flags that
would make it fit (a smaller --max-context, the executor's lighter weight forms, a
lighter KV dtype, a KV cache memory cap). With ``--kv-cache-memory`` the KV side is
that cap.

:func:`checkpoint_tensor_bytes` reads the tensor table of a GGUF file or a Hugging
Face directory (the text weights' bytes per stored type); :func:`q4_k_m_types` is
llama.cpp's type choice for a Q4_K_M file (``llama-quantize``), so a shape's
Q4_K_M bytes can be worked out without the file (the 30B check in the tests).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import attrs

from musegl_core.engine.kv_sizing import human_bytes

#: GGUF block sizes: type -> (values, bytes) per block (ggml's table, for the arithmetic)
GGML_BLOCKS: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20),
    "q5_0": (32, 22), "q5_1": (32, 24), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
    "q2_k": (256, 84), "q3_k": (256, 110), "q8_k": (256, 292),
}


def matrix_bytes(dtype: str, rows: int, cols: int) -> int:
    """Bytes of a ``rows x cols`` matrix stored as ``dtype`` (a GGUF type name)."""
    values, size = GGML_BLOCKS[dtype]
    return rows * (cols // values) * size


@attrs.frozen
class MemoryPlan:
    """What an executor's plugin says about memory before loading: the ``device`` (in
    words), the bytes it has (``memory``; None: unknown), what the weights will take
    there by form (``weights``, e.g. ``{"q4_k": ..., "q6_k": ...}``), what the executor
    keeps aside for activations and workspace (``reserve``), and lighter forms of the
    weights other flags would give (``alternatives``: ``(flags, weight bytes)``)."""

    device: str
    memory: int | None
    weights: Mapping[str, int]
    reserve: int = 0
    alternatives: tuple[tuple[str, int], ...] = ()
    #: ``(bytes per KV block, block size)`` when the plan knows it (else the spec's ``kv_layout``)
    kv_layout: tuple[int, int] | None = None

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())


@attrs.frozen
class Fit:
    """A :class:`MemoryPlan` against the KV cache the limits need."""

    plan: MemoryPlan
    kv_bytes_per_token: float
    max_sessions: int
    max_context: int
    snapshots: int = 0
    kv_cap: int | None = None  # --kv-cache-memory
    kv_flags: tuple[tuple[str, float], ...] = ()  # (flag, factor on the KV bytes), e.g. ("--kv-cache-dtype fp8", 0.5)

    @property
    def slots(self) -> int:
        return self.max_sessions + self.snapshots

    @property
    def kv_needed(self) -> int:
        """KV bytes of one request of --max-context positions, the least the pool must hold
        (blocks on demand); the --kv-cache-memory cap when given."""
        if self.kv_cap is not None:
            return self.kv_cap
        return int(self.max_context * self.kv_bytes_per_token)

    @property
    def kv_positions(self) -> int | None:
        """Positions the KV room holds (None: device memory unknown or no KV bytes)."""
        room = self.kv_cap if self.kv_cap is not None else self.room
        if room is None or self.kv_bytes_per_token <= 0:
            return None
        return max(int(room // self.kv_bytes_per_token), 0)

    @property
    def room(self) -> int | None:
        """Device bytes left for the KV cache after the weights and the reserve (None: unknown)."""
        if self.plan.memory is None:
            return None
        return self.plan.memory - self.plan.weight_bytes - self.plan.reserve

    @property
    def fits(self) -> bool:
        room = self.room
        return room is None or self.kv_needed <= room

    def line(self) -> str:
        """One line: the weights on the device, the KV at the limits and the room left."""
        plan = self.plan
        forms = ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(plan.weights.items(), key=lambda kv: -kv[1]))
        weights = f"weights {human_bytes(plan.weight_bytes)} on {plan.device}" + (f" ({forms})" if forms else "")
        kv = self._kv_words()
        if self.room is None:
            return f"{weights}; {kv}; device memory unknown"
        left = self.room - self.kv_needed
        held = ""
        positions = self.kv_positions
        if positions is not None and left >= 0:
            held = f" = {positions:,} positions = {positions / self.max_context:.1f} sessions of --max-context"
        return (f"{weights}; {kv}; KV room {human_bytes(max(self.room, 0))} of {human_bytes(plan.memory)}"
                + (f" (reserve {human_bytes(plan.reserve)})" if plan.reserve else "")
                + held
                + (f", {human_bytes(left)} left" if left >= 0 else f", {human_bytes(-left)} short"))

    def _kv_words(self) -> str:
        if self.kv_cap is not None:
            return f"KV cache {human_bytes(self.kv_cap)} (--kv-cache-memory)"
        return (f"KV {human_bytes(self.kv_needed)} for one {self.max_context}-token request "
                f"({human_bytes(self.kv_bytes_per_token)}/token; blocks on demand)")

    def refusal(self) -> str:
        """The one line for a model that does not fit: the numbers and the flags that help."""
        return f"the model does not fit {self.plan.device}: {self.line()}; flags that would help: " \
               + "; ".join(self.helpful_flags())

    def helpful_flags(self) -> list[str]:
        plan, room = self.plan, self.room
        assert room is not None
        out = []
        if room > 0 and self.kv_cap is None and self.kv_bytes_per_token > 0:
            context = int(room / self.kv_bytes_per_token)
            if context >= 1:
                out.append(f"--max-context {context}")
        if room > 0 and self.kv_cap is not None:
            out.append(f"--kv-cache-memory {human_bytes(room)}")
        for flag, factor in self.kv_flags:
            if self.kv_cap is None and self.kv_needed * factor <= room:
                out.append(flag)
        for flags, weight_bytes in plan.alternatives:
            if weight_bytes < plan.weight_bytes:
                alt_room = plan.memory - weight_bytes - plan.reserve
                verdict = "fits" if self.kv_needed <= alt_room else f"leaves {human_bytes(max(alt_room, 0))} for KV"
                out.append(f"{flags} (weights {human_bytes(weight_bytes)}: {verdict})")
        if not out:
            out.append("none of this executor's: the weights alone need "
                       f"{human_bytes(plan.weight_bytes + plan.reserve)}; a smaller quantization of the checkpoint "
                       "or a device with more memory")
        return out


# ---------------------------------------------------------------------------
# the checkpoint's tensor table


@attrs.frozen
class TensorEntry:
    """One tensor of a checkpoint's table: name as stored, form (``q4_k``, ``f16``,
    ``mlx_q4_g64`` ...), logical ``shape`` (torch order) and bytes in the file (an MLX
    matrix's codes, scales and biases together)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _text_tensor(name: str) -> bool:
    return "vision" not in name and not name.startswith(("v.", "mm.", "model.multi_modal"))


def checkpoint_tensors(path: str | os.PathLike[str]) -> list[TensorEntry]:
    """The text tensors of a GGUF file or a Hugging Face directory, from the tensor table
    alone (no weight is read)."""
    path = Path(path)
    out: list[TensorEntry] = []
    if path.is_file():
        from musegl_core.checkpoint.gguf_file import GGUFFile

        reader = GGUFFile(path, wanted=())
        try:
            for tensor in reader.tensors.values():
                if _text_tensor(tensor.name):
                    out.append(TensorEntry(tensor.name, tensor.tensor_type.name.lower(),
                                           tuple(reversed(tensor.shape)), int(tensor.data.nbytes)))
        finally:
            reader.close()
        return out
    import json

    from musegl_core.checkpoint.hf_reader import open_safetensors
    from musegl_core.checkpoint.stored import mlx_dtype

    raw = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    quant = raw.get("quantization") if isinstance(raw.get("quantization"), dict) else None
    files, names_in = open_safetensors(path)
    entries = {n: files[f].entries[n] for n, f in names_in}
    for f in files.values():
        f.close()

    def size(name: str) -> int:
        begin, end = entries[name]["data_offsets"]
        return int(end - begin)

    for name, entry in entries.items():
        if not _text_tensor(name):
            continue
        base = name.rsplit(".", 1)[0]
        if quant is not None and name.endswith(".weight") and f"{base}.scales" in entries:
            bits, group = int(quant.get("bits", 0)), int(quant.get("group_size", 0))
            rows, words = entry["shape"]
            out.append(TensorEntry(name, mlx_dtype(bits, group), (rows, words * 32 // max(bits, 1)),
                                   size(name) + size(f"{base}.scales") + size(f"{base}.biases")))
        elif quant is not None and name.endswith((".scales", ".biases")) and f"{base}.weight" in entries:
            continue
        else:
            out.append(TensorEntry(name, entry["dtype"].lower(), tuple(entry["shape"]), size(name)))
    return out


def checkpoint_tensor_bytes(path: str | os.PathLike[str]) -> dict[str, int]:
    """Bytes of a checkpoint's text tensors by stored form (:func:`checkpoint_tensors`)."""
    out: dict[str, int] = {}
    for t in checkpoint_tensors(path):
        out[t.kind] = out.get(t.kind, 0) + t.nbytes
    return out


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's layers that get more bits in ``_M`` files: the first and last eighth, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_types(config, fused_qkv: bool = False) -> dict[str, str]:
    """GGUF tensor name -> type in a Q4_K_M file as llama.cpp's ``llama-quantize`` writes it
    for a decoder of ``config`` (Q4_K, with Q6_K for the head, the ``attn_v`` and
    ``ffn_down`` of the layers :func:`use_more_bits` picks, Q5_K for a fused ``attn_qkv``;
    a matrix whose rows do not fill 256-value blocks falls back as llama.cpp does: Q5_0
    for Q4_K, Q5_1 for Q5_K, Q8_0 for Q6_K and the head)."""
    fallback = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
    h, hd = config.hidden_size, config.head_dim
    q, ffn = config.num_heads * hd, config.intermediate_size
    n = config.num_layers
    types: dict[str, str] = {}

    def put(name: str, kind: str, cols: int) -> None:
        types[name] = kind if cols % 256 == 0 else fallback[kind]

    put("token_embd.weight", "q4_k", h)
    types["output.weight"] = "q6_k" if h % 256 == 0 else "q8_0"
    for i in range(n):
        b = f"blk.{i}"
        if fused_qkv:
            put(f"{b}.attn_qkv.weight", "q5_k", h)
        else:
            put(f"{b}.attn_q.weight", "q4_k", h)
            put(f"{b}.attn_k.weight", "q4_k", h)
            put(f"{b}.attn_v.weight", "q6_k" if use_more_bits(i, n) else "q4_k", h)
        put(f"{b}.attn_gate.weight", "q4_k", h)
        put(f"{b}.attn_output.weight", "q4_k", q)
        put(f"{b}.ffn_gate.weight", "q4_k", h)
        put(f"{b}.ffn_up.weight", "q4_k", h)
        put(f"{b}.ffn_down.weight", "q6_k" if use_more_bits(i, n) else "q4_k", ffn)
    return types


def decoder_matrix_shapes(config, fused_qkv: bool = False) -> dict[str, tuple[int, int]]:
    """GGUF matrix name -> ``(rows, cols)`` of a Muse Glimmer decoder of ``config``."""
    h, hd = config.hidden_size, config.head_dim
    q, kv, ffn = config.num_heads * hd, config.num_kv_heads * hd, config.intermediate_size
    shapes = {"token_embd.weight": (config.vocab_size, h), "output.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        b = f"blk.{i}"
        if fused_qkv:
            shapes[f"{b}.attn_qkv.weight"] = (q + 2 * kv, h)
        else:
            shapes.update({f"{b}.attn_q.weight": (q, h), f"{b}.attn_k.weight": (kv, h),
                           f"{b}.attn_v.weight": (kv, h)})
        shapes.update({f"{b}.attn_gate.weight": (q, h), f"{b}.attn_output.weight": (h, q),
                       f"{b}.ffn_gate.weight": (ffn, h), f"{b}.ffn_up.weight": (ffn, h),
                       f"{b}.ffn_down.weight": (h, ffn)})
    return shapes


def q4_k_m_bytes(config, fused_qkv: bool = False) -> dict[str, int]:
    """The matrices' bytes by type of a Q4_K_M file of ``config`` (:func:`q4_k_m_types`);
    the norms (float32) are left out (kilobytes)."""
    types, out = q4_k_m_types(config, fused_qkv), {}
    for name, (rows, cols) in decoder_matrix_shapes(config, fused_qkv).items():
        kind = types[name]
        out[kind] = out.get(kind, 0) + matrix_bytes(kind, rows, cols)
    return out


# ---------------------------------------------------------------------------
# musegl serve


def serve_fit(config, plugins) -> Fit | None:
    """The :class:`Fit` of ``musegl serve``'s settings (a ``ServeConfig``) on the chosen
    executor, or None where it cannot be told before loading (an executor without
    ``memory_plan``, or with neither the plan's nor the spec's KV layout, random weights
    from a config, tensor parallelism)."""
    from musegl_core.plugins.specs import ExecutorOptions

    extra = dict(config.extra)
    if config.model is None or extra.get("load_format") == "dummy" or (extra.get("tensor_parallel_size") or 1) > 1:
        return None
    spec = plugins.choose_executor(config.executor, config.model)
    if spec.memory_plan is None:
        return None
    options = ExecutorOptions(model=config.model, device=config.device, dtype=config.dtype,
                              max_context=config.max_context, extra=extra)
    plan = spec.memory_plan(options)
    if plan is None:
        return None
    if plan.kv_layout is None and spec.kv_layout is None:
        return None
    per_block, block_size = plan.kv_layout or spec.kv_layout(options)
    kv_flags = []
    if "kv_cache_dtype" in attrs.fields_dict(type(config)) and getattr(config, "kv_cache_dtype", None) != "fp8":
        kv_flags.append(("--kv-cache-dtype fp8", 0.5))  # one byte a value where the cache holds two
    return Fit(plan, per_block / block_size, config.max_sessions, config.max_context,
               snapshots=config.prefix_cache_entries, kv_cap=config.kv_cache_memory, kv_flags=tuple(kv_flags))


def check_serve_fit(config, plugins, log) -> None:
    """Log the fit line of ``musegl serve``'s settings; raise ConfigError (one line: the
    numbers and the flags that would help) when the model does not fit its device."""
    from musegl_core.errors import ConfigError

    try:
        fit = serve_fit(config, plugins)
    except ConfigError:
        raise
    except Exception as exc:  # a table the plan cannot read: the worker's load reports what is wrong
        log.debug("no start-up fit: %s", exc, exc_info=True)
        return
    if fit is None:
        return
    if not fit.fits:
        raise ConfigError(fit.refusal())
    log.info("memory: %s", fit.line())
