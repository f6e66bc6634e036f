"""safetensors files written one tensor at a time: the header (every tensor's name, dtype, shape and byte range) is
known before any data, so a file of many tensors is written holding only the tensor being written. The format is the
one ``safetensors`` documents: an 8-byte little-endian header length, a JSON header (``__metadata__`` and one entry
per tensor, padded with spaces so that the data start on an 8-byte boundary), then the tensors' bytes back to back,
little-endian, C order. Written here rather than with ``safetensors.torch.save_file``, which needs every tensor of a
file in memory at once (and ``safetensors`` is not a dependency of fzero).

Imports: none of fzero.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import torch

__all__ = ["TensorHeader", "SafetensorsWriter", "DTYPE_CODES", "SIZE_UNITS", "parse_size"]

# safetensors' dtype names
DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
}
# max_shard_size units as transformers' save_pretrained reads them (decimal)
SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_ALIGN = 8


@dataclasses.dataclass(frozen=True)
class TensorHeader:
    """One tensor of a file: its name, shape and dtype; ``nbytes`` its data."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def parse_size(size: int | str) -> int:
    """Bytes of ``max_shard_size``: an int, or a string with a unit of :data:`SIZE_UNITS` (``"5GB"``: 5 * 10**9), as
    ``save_pretrained`` takes it. ``ValueError`` naming the value otherwise."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        text = size.strip()
        unit = text[-2:].upper()
        if unit in SIZE_UNITS:
            try:
                value = float(text[:-2].strip())
            except ValueError:
                value = -1.0
            if value > 0 and math.isfinite(value):
                return max(1, int(value * SIZE_UNITS[unit]))
    raise ValueError(f"max_shard_size must be a positive number of bytes or a string like '5GB' "
                     f"(units {', '.join(SIZE_UNITS)}), got {size!r}")


def _header_bytes(tensors: Sequence[TensorHeader], metadata: dict[str, str]) -> bytes:
    """The JSON header with each tensor's byte range in order, padded to the alignment."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    at = 0
    for t in tensors:
        if t.dtype not in DTYPE_CODES:
            raise TypeError(f"tensor {t.name!r}: dtype {t.dtype} has no safetensors name")
        header[t.name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return blob + b" " * (-len(blob) % _ALIGN)


class SafetensorsWriter:
    """Writes one safetensors file whose tensors are ``tensors`` (in this order): the header at once, then each tensor
    by :meth:`write` as it comes, checked against its header; :meth:`close` checks every one was written and makes
    the file durable (fsync). A context manager; an ``OSError`` of the file passes through."""

    def __init__(self, path: Path, tensors: Sequence[TensorHeader], metadata: dict[str, str] | None = None) -> None:
        if sys.byteorder != "little":
            raise NotImplementedError("safetensors files hold little-endian data; this host is big-endian")
        self.path, self.tensors = Path(path), list(tensors)
        self.next = 0
        head = _header_bytes(self.tensors, {"format": "pt", **(metadata or {})})
        self.file: BinaryIO = open(self.path, "xb")  # noqa: SIM115 - closed by close()
        try:
            self.file.write(len(head).to_bytes(8, "little") + head)
        except BaseException:
            self.file.close()
            raise

    def write(self, tensor: torch.Tensor) -> None:
        """The next tensor's data; ``ValueError`` if it is not the shape and dtype its header says."""
        want = self.tensors[self.next]
        if tuple(tensor.shape) != want.shape or tensor.dtype != want.dtype:
            raise ValueError(f"{self.path}: tensor {want.name!r} is {tensor.dtype}{list(tensor.shape)}, its header "
                             f"says {want.dtype}{list(want.shape)}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            self.file.write(memoryview(data.view(torch.uint8).numpy()))
        self.next += 1

    def close(self) -> None:
        """Fsync and close once every tensor was written (``ValueError`` otherwise)."""
        try:
            if self.next != len(self.tensors):
                raise ValueError(f"{self.path}: {len(self.tensors) - self.next} tensors were not written, first "
                                 f"{self.tensors[self.next].name!r}")
            self.file.flush()
            os.fsync(self.file.fileno())
        finally:
            self.file.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        if kind is None:
            self.close()
        else:
            self.file.close()
