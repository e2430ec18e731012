"""KV-cache bytes: what a position, a session and a memory budget hold.

One module for the arithmetic every part of the server states about KV memory:
the start-up line that says how much KV room a server has
(:func:`room_line`), the 30B capacity table of docs/engine.md
(:func:`capacity_table`, checked against the doc by a test), and the element
size of a ``--kv-cache-dtype`` (:func:`element_bytes`).

A decoder stores, for every layer, K and V of ``num_kv_heads × head_dim``
elements at each position it keeps. Today every layer keeps every position
(:func:`position_bytes`); a **sliding-aware** cache keeps, for a sliding
layer, only the blocks that hold the last ``window`` positions, at most
``ceil(window / block_size) + 1`` blocks (:func:`session_bytes`). FP8 KV
(e4m3) stores one byte an element; its per-head scales are a handful of
floats per layer, not per position, so they do not count here.
"""

from __future__ import annotations

import attrs

GIB = 1 << 30
#: the element size of each ``--kv-cache-dtype`` that is not ``auto`` (which stores the model's dtype)
KV_DTYPE_BYTES = {"fp8": 1}


def element_bytes(kv_cache_dtype: str, model_itemsize: int) -> int:
    """Bytes of one stored K or V element: the model's dtype for ``auto``, else the named one's."""
    if kv_cache_dtype == "auto":
        return model_itemsize
    try:
        return KV_DTYPE_BYTES[kv_cache_dtype]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r} (auto, {', '.join(KV_DTYPE_BYTES)})") from None


@attrs.frozen
class KVShape:
    """What the KV arithmetic needs of a decoder: its layers (how many slide), KV heads,
    head size, window, and the pool's block size."""

    num_layers: int
    sliding_layers: int
    num_kv_heads: int
    head_dim: int
    window: int
    block_size: int = 16

    @classmethod
    def of(cls, config, block_size: int = 16) -> "KVShape":
        """From a :class:`~musegl_core.checkpoint.config.TextConfig`."""
        return cls(config.num_layers, sum(config.sliding), config.num_kv_heads, config.head_dim,
                   config.sliding_window, block_size)

    @property
    def full_layers(self) -> int:
        return self.num_layers - self.sliding_layers

    def layer_bytes(self, itemsize: int) -> int:
        """K and V of one layer at one position."""
        return 2 * self.num_kv_heads * self.head_dim * itemsize

    @property
    def window_positions(self) -> int:
        """The most positions a sliding layer keeps: the blocks that can hold a window."""
        return (-(-self.window // self.block_size) + 1) * self.block_size


def position_bytes(shape: KVShape, itemsize: int) -> int:
    """Bytes a position costs when every layer keeps it (the cache today)."""
    return shape.num_layers * shape.layer_bytes(itemsize)


def session_bytes(shape: KVShape, positions: int, itemsize: int, sliding_aware: bool = False) -> int:
    """Bytes a session of ``positions`` positions holds (whole blocks). Sliding-aware:
    sliding layers keep only the blocks a window can reach."""
    blocks = -(-positions // shape.block_size) * shape.block_size
    if not sliding_aware:
        return blocks * position_bytes(shape, itemsize)
    kept = min(blocks, shape.window_positions)
    return shape.layer_bytes(itemsize) * (shape.full_layers * blocks + shape.sliding_layers * kept)


def sessions_held(memory: int, shape: KVShape, positions: int, itemsize: int, sliding_aware: bool = False) -> int:
    """How many sessions of ``positions`` positions ``memory`` bytes hold at once."""
    return memory // session_bytes(shape, positions, itemsize, sliding_aware)


def room_line(*, device_blocks: int, block_size: int, block_bytes: int, max_context: int,
              host_bytes: int | None = None, companions: int = 0, window: int | None = None,
              disk_bytes: int | None = None) -> str:
    """The start-up line that states the KV room (``musegl serve`` logs it): the device pool in
    bytes, positions and sessions of ``--max-context``, and the host tier. ``device_blocks`` of
    ``block_bytes`` (every layer); with sliding pages (``companions`` per block, ``window``) a
    session's sliding layers keep only the blocks a window reaches."""
    positions = device_blocks * block_size
    per_session = -(-max_context // block_size)
    if companions and window:
        pages = device_blocks * (1 + companions)
        session_pages = per_session + companions * min(per_session, -(-window // block_size) + 1)
        sessions = pages // session_pages
        room = (f"{positions:,} positions of every layer, or {pages:,} pages of {block_size} positions "
                f"(sliding layers keep their window of {window:,})")
    else:
        sessions = device_blocks // per_session
        room = f"{positions:,} positions ({device_blocks:,} blocks of {block_size})"
    line = (f"KV room: device {human(device_blocks * block_bytes)} = {room} = {sessions:,} "
            f"session{'s' if sessions != 1 else ''} of --max-context {max_context:,} at once "
            f"(blocks on demand: shorter sessions hold less)")
    if host_bytes:
        host_positions = host_bytes // block_bytes * block_size
        host_sessions = host_bytes // block_bytes // per_session
        if companions and window:  # host pages hold what the device's pages hold
            host_pages = host_bytes // (block_bytes // (1 + companions))
            host_sessions = host_pages // session_pages
        line += (f"; host tier {human(host_bytes)} = {host_positions:,} positions = "
                 f"{host_sessions:,} sessions of --max-context {max_context:,}")
    else:
        line += "; host tier: none"
    if disk_bytes:  # a block file holds a block's bytes, a 57-byte header and its 16-byte key (engine/kv_disk.py)
        disk_positions = disk_bytes // (block_bytes + 73) * block_size
        line += (f"; disk tier {human(disk_bytes)} = {disk_positions:,} positions = "
                 f"{disk_positions // max_context:,} sessions of --max-context {max_context:,}")
    return line


def human(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# -- the 30B capacity table (docs/engine.md "KV memory") ---------------------------------------

#: the 30B shape (transformers' ``MuseGlimmerTextConfig()``): 52 layers, 39 of them sliding (window 2048),
#: 2 KV heads of 128, hidden 6656, MLP 19968, 32 query heads, a 202,048-id vocabulary, untied head
GLIMMER_30B = KVShape(num_layers=52, sliding_layers=39, num_kv_heads=2, head_dim=128, window=2048)
GLIMMER_30B_DIMS = dict(hidden=6656, ffn=19968, heads=32, vocab=202048)

#: GPUs of the table: name, bytes (the nominal decimal size)
GPUS = (("80 GB (H100)", 80 * 10**9), ("141 GB (H200)", 141 * 10**9))
#: the fraction of the memory beside the weights the pool may take (``--kv-cache-fraction``'s default)
FRACTION = 0.9
#: activations kept beside the pool: the lone-prompt step of 32,768 rows at 268,800 bytes a row
#: (docs/engine.md "A lone prompt"; ``prefill_row_bytes`` at the 30B shape)
ACTIVATION_BYTES = 32768 * 268800
HOST_TIER = 64 * GIB
CONTEXT = 131072


def glimmer_30b_weight_bytes(fp8_weights: bool = False) -> int:
    """The 30B's weights: every layer's products (bf16, or FP8 with per-channel scales), the
    embedding table and the head in bf16 (norms are negligible and left out)."""
    d = GLIMMER_30B_DIMS
    s = GLIMMER_30B
    qkvg = (2 * d["heads"] + 2 * s.num_kv_heads) * s.head_dim * d["hidden"]
    layer = qkvg + d["heads"] * s.head_dim * d["hidden"] + 3 * d["hidden"] * d["ffn"]
    products = s.num_layers * layer * (1 if fp8_weights else 2)
    return products + 2 * d["vocab"] * d["hidden"] * 2


def device_kv_room(gpu_bytes: int, fp8_weights: bool = False) -> int:
    """The pool a GPU holds beside the 30B: ``FRACTION`` of what the weights leave, less the
    lone-prompt activations."""
    return int(FRACTION * (gpu_bytes - glimmer_30b_weight_bytes(fp8_weights))) - ACTIVATION_BYTES


#: the table's rows: label, sliding-aware, KV element bytes, FP8 weights
CONFIGS = (("today (bf16 KV, every position of every layer)", False, 2, False),
           ("sliding-aware (bf16 KV)", True, 2, False),
           ("+ FP8 KV", True, 1, False),
           ("+ FP8 weights", True, 1, True))


def capacity_table() -> str:
    """docs/engine.md's table: 131,072-position sessions of the 30B held at once on each GPU's
    device pool and in a 64 GiB host tier (a session's device image; markdown)."""
    head = ("| KV layout | " + " | ".join(f"{name}: device pool, sessions" for name, _ in GPUS)
            + " | 64 GiB host tier, sessions |")
    lines = [head, "|" + "---|" * (len(GPUS) + 2)]
    for label, aware, itemsize, fp8w in CONFIGS:
        per = session_bytes(GLIMMER_30B, CONTEXT, itemsize, aware)
        cells = []
        for _, gpu in GPUS:
            room = device_kv_room(gpu, fp8w)
            cells.append(f"{human(room)}, {room // per}")
        lines.append(f"| {label} ({human(per)} a session) | " + " | ".join(cells) + f" | {HOST_TIER // per} |")
    return "\n".join(lines)
