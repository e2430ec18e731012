"""A fast, memory-mapped GGUF parser (GGUF v2/v3, little-endian).

``gguf.GGUFReader`` builds a Python object per array element, so a file whose
metadata holds a 202048-entry token list takes 10–20 s to open. This parser
decodes metadata values directly (numeric arrays in one ``numpy`` call) and
exposes tensor data as zero-copy ``numpy`` views of the mapped file, shaped as
``GGUFReader`` shapes them: typed arrays in torch order for F32/F16 (and the
integer types), raw ``uint8`` rows ``(..., bytes_per_row)`` for BF16 and the
quantized types, ready for ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any, Sequence

import attrs
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_TYPED = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """Not a GGUF file, or a GGUF this parser cannot read."""


@attrs.frozen
class GGUFTensor:
    """One tensor's description; ``data`` is a view of the mapped file."""

    name: str
    shape: tuple[int, ...]  # ggml ``ne`` order: fastest dimension first
    tensor_type: GGMLQuantizationType
    data: np.ndarray


class GGUFFile:
    """Metadata (``fields``: key → Python value) and tensors of a GGUF file.

    ``wanted`` limits which metadata keys are decoded (by prefix); the others
    are stepped over. Tensor data stays mapped until :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike[str], *, wanted: Sequence[str] | None = None, tensors: bool = True):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # empty file
                raise GGUFFormatError(f"{self.path} is not a GGUF file ({exc})") from None
        buf = self._map
        if buf[:4] != b"GGUF":
            raise GGUFFormatError(f"{self.path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: unsupported GGUF version {version} (big-endian or too old)")
        self.version = version
        self.fields: dict[str, Any] = {}
        at = 24
        prefixes = tuple(wanted) if wanted is not None else None
        for _ in range(n_kv):
            key, at = self._string(at)
            (kind,) = struct.unpack_from("<I", buf, at)
            want = prefixes is None or key.startswith(prefixes) or key == "general.alignment"
            value, at = self._value(kind, at + 4, want)
            if want:
                self.fields[key] = value
        self.tensors: dict[str, GGUFTensor] = {}
        if not tensors:
            return
        infos = []
        for _ in range(n_tensors):
            name, at = self._string(at)
            (n_dims,) = struct.unpack_from("<I", buf, at)
            ne = struct.unpack_from(f"<{n_dims}Q", buf, at + 4)
            qtype, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * n_dims)
            at += 4 + 8 * n_dims + 12
            infos.append((name, tuple(int(n) for n in ne), qtype, offset))
        alignment = int(self.fields.get("general.alignment", 32))
        data_start = -(-at // alignment) * alignment
        for name, ne, qtype, offset in infos:
            self.tensors[name] = self._tensor(name, ne, qtype, data_start + offset)

    # -- decoding ----------------------------------------------------------------------
    def _string(self, at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._map, at)
        start = at + 8
        return self._map[start : start + length].decode("utf-8", errors="replace"), start + length

    def _value(self, kind: int, at: int, want: bool) -> tuple[Any, int]:
        buf = self._map
        if kind == _STRING:
            if not want:
                (length,) = struct.unpack_from("<Q", buf, at)
                return None, at + 8 + length
            return self._string(at)
        if kind == _ARRAY:
            item_kind, n = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item_kind in _SCALARS:
                dtype = np.dtype(_SCALARS[item_kind])
                values = np.frombuffer(buf, dtype=dtype, count=n, offset=at).tolist() if want else None
                return values, at + n * dtype.itemsize
            items: list[Any] | None = [] if want else None
            for _ in range(n):
                item, at = self._value(item_kind, at, want)
                if items is not None:
                    items.append(item)
            return items, at
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GGUFFormatError(f"{self.path}: unknown GGUF value type {kind}")
        dtype = np.dtype(fmt)
        return np.frombuffer(buf, dtype=dtype, count=1, offset=at)[0].item(), at + dtype.itemsize

    def _tensor(self, name: str, ne: tuple[int, ...], qtype_id: int, start: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(qtype_id)
        except ValueError:
            raise GGUFFormatError(f"{self.path}: tensor {name} has unknown ggml type {qtype_id}") from None
        shape = tuple(reversed(ne))  # torch order
        typed = _TYPED.get(qtype)
        if typed is not None:
            count = int(np.prod(ne))
            data = np.frombuffer(self._map, dtype=typed, count=count, offset=start).reshape(shape)
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            if ne[0] % block:
                raise GGUFFormatError(f"{self.path}: tensor {name} row of {ne[0]} is not a multiple of {block}")
            row_bytes = ne[0] // block * size
            rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
            data = np.frombuffer(self._map, dtype=np.uint8, count=rows * row_bytes, offset=start)
            data = data.reshape(shape[:-1] + (row_bytes,))
        return GGUFTensor(name, ne, qtype, data)

    def close(self) -> None:
        self.tensors.clear()
        try:
            self._map.close()
        except BufferError:  # views still alive elsewhere; the map closes when they go
            pass
