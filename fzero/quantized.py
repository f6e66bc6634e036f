"""Quantized collectives (ZeRO++'s qwZ and qgZ) as a communicator: :class:`QuantizedCommunicator` wraps any
communicator and sends 16-bit parameter all-gathers as int8, and gradient reduce-scatters as int8 or int4, block-wise
with one float32 scale per block (:func:`quantize_blocks`). Only what travels is quantized: master weights, optimizer
state and every sum stay in float32.

Imports: comm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .comm import Communicator, ReduceOp, rank_order_sum

__all__ = ["QuantizedCommunicator", "quantize_blocks", "dequantize_blocks", "payload_bytes", "QUANT_BITS"]

QUANT_BITS = (4, 8)
_SIXTEEN = (torch.float16, torch.bfloat16)


def payload_bytes(n: int, bits: int, block: int) -> int:
    """Bytes of ``n`` values quantized to ``bits`` in blocks of ``block``: the codes (padded to whole blocks) and a
    float32 scale per block."""
    blocks = math.ceil(n / block)
    return blocks * block * bits // 8 + 4 * blocks


def quantize_blocks(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """``[R, n]`` floating -> ``[R, payload_bytes(n, bits, block)]`` uint8: per block of ``block`` values (the last
    zero-padded) the symmetric codes ``round(x / s)`` in ``[-q, q]``, ``q = 2**(bits-1) - 1``, ``s = amax / q`` (so each
    value is off by at most ``s / 2``), int4 packed two to a byte, then the scales as float32 bytes. A non-finite value
    makes its block's scale non-finite, so the whole block dequantizes non-finite (an overflow stays visible)."""
    rows, n = x.shape
    blocks = math.ceil(n / block)
    v = torch.nn.functional.pad(x.float(), (0, blocks * block - n)).view(rows, blocks, block)
    q = 2 ** (bits - 1) - 1
    amax = v.abs().amax(dim=2)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / q)
    codes = torch.round(v / scale.unsqueeze(2)).clamp_(-q, q).nan_to_num_(0).to(torch.int8)
    if bits == 4:  # two codes a byte: offset to 1..15, low nibble first
        pairs = (codes + 8).to(torch.uint8).view(rows, blocks, block // 2, 2)
        data = (pairs[..., 0] | (pairs[..., 1] << 4)).reshape(rows, -1)
    else:
        data = codes.view(torch.uint8).reshape(rows, -1)
    return torch.cat([data, scale.view(torch.uint8).reshape(rows, -1)], dim=1)


def dequantize_blocks(payload: torch.Tensor, n: int, bits: int, block: int) -> torch.Tensor:
    """The float32 ``[R, n]`` values a :func:`quantize_blocks` payload ``[R, m]`` stands for."""
    rows, blocks = payload.shape[0], math.ceil(n / block)
    code_bytes = blocks * block * bits // 8
    scale = payload[:, code_bytes:].reshape(-1).clone().view(torch.float32).view(rows, blocks, 1)  # aligned copy
    data = payload[:, :code_bytes]
    if bits == 4:
        codes = torch.stack([data & 15, data >> 4], dim=2).to(torch.int8) - 8
    else:
        codes = data.contiguous().view(torch.int8)
    return (codes.reshape(rows, blocks, block).float() * scale).reshape(rows, -1)[:, :n]


class QuantizedCommunicator(Communicator):
    """``inner``'s collectives, quantized on the wire. ``weights`` (qwZ, 8 or None): every 16-bit ``all_gather`` (the
    compute-dtype parameter gathers; float32 and float64 gathers, e.g. tags and digests, travel as they are) as int8
    codes and scales, dequantized by every rank alike, so all ranks hold the same parameters. ``grads`` (qgZ, 4, 8 or
    None): every floating ``reduce_scatter`` as one ``all_to_all`` of each chunk's codes to the rank that owns it,
    which dequantizes and adds the ranks' chunks in rank order in float32 (no value is quantized twice). ``block``:
    values per scale (even). Eager steps only (``all_to_all`` is not traced); stage 1's all-reduce and a mesh's replica
    all-reduce are not quantized. ``ValueError`` on bad settings."""

    def __init__(self, inner: Communicator, *, weights: int | None = 8, grads: int | None = 8,
                 block: int = 256):
        if weights not in (None, 8):
            raise ValueError(f"QuantizedCommunicator: weights must be 8 (int8) or None, got {weights!r}")
        if grads not in (None, *QUANT_BITS):
            raise ValueError(f"QuantizedCommunicator: grads must be 4, 8 or None, got {grads!r}")
        if not (isinstance(block, int) and block >= 2 and block % 2 == 0):
            raise ValueError(f"QuantizedCommunicator: block must be an even int >= 2, got {block!r}")
        if inner.groups:  # a parameter group's collectives would go past the quantizer, at full precision, unsaid
            raise ValueError(f"QuantizedCommunicator: {inner!r} has parameter groups, whose collectives are not "
                             "quantized yet")
        self.wrapping(inner)  # hpZ's node gathers are not quantized
        self.weights, self.grads, self.block = weights, grads, block

    def __repr__(self) -> str:
        return f"QuantizedCommunicator({self.inner!r}, weights={self.weights}, grads={self.grads}, block={self.block})"

    def __getattr__(self, name: str) -> Any:  # backend attributes (rank, group, ...) come from inner
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def tracing(self) -> QuantizedCommunicator:
        raise NotImplementedError("QuantizedCommunicator: quantized collectives run in eager steps (compile=False)")

    def all_reduce_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        return self.inner.all_reduce_start(x, op)

    def all_reduce_shard_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        return self.inner.all_reduce_shard_start(x, op)

    def all_to_all_start(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        return self.inner.all_to_all_start(x)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self.inner.broadcast(x, src)

    def check_layout(self, layout: Any) -> None:
        self.inner.check_layout(layout)

    def all_gather_start(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        if self.weights is None or x.dtype not in _SIXTEEN or x.dim() != 2:
            return self.inner.all_gather_start(x)
        self._check_rows(x, "all_gather")
        rows, n, w = x.shape[0], x.shape[1], self.world_size
        started = self.inner.all_gather_start(quantize_blocks(x, self.weights, self.block))

        def done() -> torch.Tensor:
            got = started().view(rows * w, -1)  # each rank's payload
            return dequantize_blocks(got, n, self.weights, self.block).to(x.dtype).view(rows, w * n)

        return done

    def all_gather_into_start(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        self._check_into(x, out)
        started = self.all_gather_start(x)
        return lambda: out.copy_(started())

    def reduce_scatter_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        if self.grads is None or not x.is_floating_point():
            return self.inner.reduce_scatter_start(x, op)
        self._check_rows(x, "reduce_scatter")
        if op not in ("sum", "avg"):
            raise ValueError("reduce_scatter supports 'sum' and 'avg'")
        n, rows, w = self._chunk(x, "reduce_scatter"), x.shape[0], self.world_size
        sent = quantize_blocks(x.reshape(rows * w, n), self.grads, self.block).view(rows, -1)
        started = self.inner.all_to_all_start(sent)

        def done() -> torch.Tensor:
            got = dequantize_blocks(started().view(rows * w, -1), n, self.grads, self.block).view(rows, w, n)
            total = rank_order_sum(got.unbind(1))
            return (total.div_(self.world_size) if op == "avg" else total).to(x.dtype)

        return done
