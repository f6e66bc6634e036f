"""Adafactor on flat shards: ``torch.optim.Adafactor``'s step per parameter, statistics from the whole reduced gradient
by two ``all_reduce``\\ s per step (no matrix gathered). The factored second moment ``row_var``/``col_var`` (2-D+: ``R +
C`` per ``R x C``) is replicated ``OptState.vectors``, the elementwise ``variance`` a sharded moment.

Imports: optim, layout, comm.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import ClassVar

import torch

from .comm import Communicator
from .layout import Layout, shard_pieces, trainable_index
from .optim import GroupSpec, ShardRule, Update, _groups, vector_dtype, vector_spans

__all__ = ["Adafactor", "adafactor"]

# torch.optim.Adafactor's constructor checks: name: (test, requirement)
_RANGES = {"lr": (lambda v: v >= 0, ">= 0"), "beta2_decay": (lambda v: v <= 0, "<= 0"),
           "eps1": (lambda v: v >= 0, ">= 0"), "eps2": (lambda v: v >= 0, ">= 0"), "d": (lambda v: v >= 1, ">= 1"),
           "weight_decay": (lambda v: v >= 0, ">= 0")}


def _factored(shape: Sequence[int]) -> bool:
    """Whether torch factors a parameter of ``shape`` (two dimensions or more)."""
    return len(shape) > 1


def _dims(shape: Sequence[int]) -> tuple[int, int, int]:
    """``(B, R, C)``: the leading dimensions' product, and the last two dimensions."""
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def _rectangles(a: int, b: int, R: int, C: int) -> Iterator[tuple[int, int, int, int, int, int]]:
    """The elements ``[a, b)`` of a parameter ``[B, R, C]`` (flat, row-major) as rectangles ``(start, row,
    rows, col, cols, batch)``: ``rows x cols`` elements from flat position ``a + start``, global rows
    ``row..row+rows`` (``batch * R + i``), columns ``col..col+cols`` of ``batch``. No collective."""
    pos = a
    while pos < b:
        row, col = divmod(pos, C)
        batch = row // R
        if col or b - pos < C:  # a partial row
            n = min(C - col, b - pos)
            yield pos - a, row, 1, col, n, batch
            pos += n
            continue
        rows = min((b - pos) // C, (batch + 1) * R - row)  # whole rows, within one batch
        yield pos - a, row, rows, 0, C, batch
        pos += rows * C


@dataclasses.dataclass(frozen=True)
class Adafactor(ShardRule):
    """``torch.optim.Adafactor`` (:func:`adafactor`). Hyperparameters: ``lr``, ``beta2_decay``, ``eps2``, ``d``,
    ``weight_decay``, and ``eps1`` if given (absent: the master dtype's eps). Static: ``maximize``."""

    maximize: bool = False

    moment_names: ClassVar[tuple[str, ...]] = ("variance",)
    vector_names: ClassVar[tuple[str, ...]] = ("row_var", "col_var")
    not_compilable: ClassVar[str] = ("its statistics and clipping need the whole parameter: two all_reduces of "
                                     "per-parameter partial sums inside the optimizer step, eagerly")

    @property
    def name(self) -> str:
        return "adafactor"

    def vector_lengths(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``(B*R, B*C)`` for a parameter ``[..., R, C]`` (``B``: the leading dimensions' product), else ``(0, 0)``."""
        if not _factored(shape):
            return (0, 0)
        B, R, C = _dims(shape)
        return (B * R, B * C)

    def check_hyper(self, name: str, value: float, where: str) -> None:
        ok, need = _RANGES.get(name, (lambda v: True, ""))
        if value != value or not ok(value):
            raise ValueError(f"{where}: invalid {name} {value}" + (f" (torch.optim.Adafactor requires {name} {need})"
                                                                   if need else ""))

    def update_shards(self, u: Update, comm: Communicator) -> None:
        """One step, in place on ``u``'s master shards, ``variance`` and ``[row_var, col_var]``. Collectives:
        two ``all_reduce(sum)``, of the statistics (``T + len(row_var) + len(col_var)``) and the norms (``T``)."""
        if comm is None:
            raise ValueError("shard_step: optimizer adafactor calls collectives in its step: pass comm=")
        layout, master, grads, moments, hyper, own, take, ranks, vectors = (
            u.layout, u.master, u.grads, u.moments, u.hyper, u.own, u.take, u.ranks, u.vectors)
        check_real(layout)  # before anything is written (a donated state is updated in place)
        where = trainable_index(layout)
        slots = layout.trainable_slots
        T = len(slots)
        row_var, col_var = vectors
        (row_spans, col_spans) = vector_spans(self, [s.shape for s in slots])
        dtype, device = vector_dtype(master), master[0].device
        h = [{k: float(v) for k, v in hy.items()} for hy in hyper]
        opt_group = [layout.groups[s.group].opt_group for s in slots]
        n_row = row_var.numel()
        # 1. partial statistics of this process's rows: sum p^2 per parameter, sum g^2 per row and column
        stats = torch.zeros(len(ranks), T + n_row + col_var.numel(), dtype=dtype, device=device)
        pieces = []  # (row, k, param-local begin, p view, g (signed), variance view)
        for row, rank in enumerate(ranks):
            for g in layout.groups:
                for k, lo, hi in shard_pieces(layout, g, rank, where):
                    if k is None or not take[k]:
                        continue
                    s = slots[k]
                    p = master[g.index][row, lo:hi]
                    gr = grads[g.index][row, lo:hi].to(p.dtype)
                    if self.maximize:
                        gr = -gr
                    a = rank * g.shard_numel + lo - s.offset
                    pieces.append((row, k, a, p, gr, moments[g.index][0][row, lo:hi]))
                    stats[row, k] += p.square().sum().to(dtype)
                    if _factored(s.shape):
                        _, R, C = _dims(s.shape)
                        sq = gr.square().to(dtype)
                        rows = stats[row, T + row_spans[k][0]:T + row_spans[k][1]]
                        cols = stats[row, T + n_row + col_spans[k][0]:T + n_row + col_spans[k][1]]
                        for start, r0, nr, c0, nc, b in _rectangles(a, a + p.numel(), R, C):
                            block = sq[start:start + nr * nc].view(nr, nc)
                            rows[r0:r0 + nr] += block.sum(dim=1)
                            cols[b * C + c0:b * C + c0 + nc] += block.sum(dim=0)
        total = comm.all_reduce(stats, "sum")[0]  # every row holds the same sums
        # torch reads each norm as a Python float (``.item()``): one host read for all of them
        param_sq = total[:T].tolist()
        # 2. per parameter, torch's scalars; the factored second moment, alike on every rank
        scal: dict[int, tuple[float, float, float]] = {}  # k: (one_minus_beta2_t, alpha, eps1)
        factored: dict[int, tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # k: R, C, row, col, denom
        for k, s in enumerate(slots):
            if not take[k]:
                continue
            hk = h[opt_group[k]]
            t = float(own[k] + 1)
            one_minus_beta2_t = t ** hk["beta2_decay"]
            rho_t = min(hk["lr"], 1 / (t ** 0.5))
            numel = math.prod(s.shape)
            alpha = max(hk["eps2"], math.sqrt(param_sq[k]) / (numel ** 0.5)) * rho_t
            eps1 = hk.get("eps1", torch.finfo(dtype).eps)
            scal[k] = (one_minus_beta2_t, alpha, eps1)
            if _factored(s.shape):
                B, R, C = _dims(s.shape)
                rv = row_var[row_spans[k][0]:row_spans[k][1]]
                cv = col_var[col_spans[k][0]:col_spans[k][1]]
                rv.lerp_(total[T + row_spans[k][0]:T + row_spans[k][1]].to(rv.dtype) / C, one_minus_beta2_t)
                cv.lerp_(total[T + n_row + col_spans[k][0]:T + n_row + col_spans[k][1]].to(cv.dtype) / R,
                         one_minus_beta2_t)
                factored[k] = (R, C, rv, cv, rv.view(B, R).mean(dim=1).clamp(min=eps1))
        # 3. the update of each own piece, and the partial sums of its squares
        norms = torch.zeros(len(ranks), T, dtype=dtype, device=device)
        updates = []
        for row, k, a, p, gr, variance in pieces:
            one_minus_beta2_t, _, eps1 = scal[k]
            if k in factored:
                R, C, rv, cv, denom_r = factored[k]
                var = torch.empty_like(p)
                for start, r0, nr, c0, nc, b in _rectangles(a, a + p.numel(), R, C):
                    est = rv[r0:r0 + nr].unsqueeze(1) * cv[b * C + c0:b * C + c0 + nc].unsqueeze(0)
                    var[start:start + nr * nc].view(nr, nc).copy_(est.div_(denom_r[b]))
            else:
                variance.lerp_(gr * gr, one_minus_beta2_t)
                var = variance.clone()
            update = var.clamp_(min=eps1 * eps1).rsqrt_()
            update.mul_(gr)
            norms[row, k] += update.square().sum().to(dtype)
            updates.append(update)
        update_sq = comm.all_reduce(norms, "sum")[0].tolist()  # one host read, as above
        # 4. decoupled weight decay and the clipped step, torch's order and Python floats
        for (_, k, _, p, _, _), update in zip(pieces, updates):
            hk = h[opt_group[k]]
            _, alpha, _ = scal[k]
            numel = math.prod(slots[k].shape)
            denom = max(1.0, math.sqrt(update_sq[k]) / ((numel ** 0.5) * hk["d"]))
            if hk["weight_decay"] != 0:
                p.mul_(1 - hk["lr"] * hk["weight_decay"])
            p.add_(update, alpha=-alpha / denom)


def check_real(layout: Layout) -> None:
    """Raise ``ValueError`` naming the first complex trainable parameter (as torch.optim.Adafactor)."""
    for s in layout.trainable_slots:
        if s.dtype.is_complex:
            raise ValueError(f"adafactor: parameter {s.path} is complex ({s.dtype}); torch.optim.Adafactor does "
                             "not support complex parameters")


def adafactor(lr: float = 1e-2, beta2_decay: float = -0.8, eps: tuple[float | None, float] = (None, 1e-3),
              d: float = 1.0, weight_decay: float = 0.0, *, foreach: bool | None = None, maximize: bool = False,
              groups: Sequence[GroupSpec] = ()) -> Adafactor:
    """``torch.optim.Adafactor(lr, beta2_decay, eps, d, weight_decay, maximize)`` on flat shards, eagerly. ``eps =
    (eps1, eps2)``: ``eps1`` None is the master dtype's eps, a number the hyperparameter. ``groups`` as for
    :func:`fzero.adamw`; ``foreach`` ignored. Out-of-range values: ``ValueError`` naming the argument (as torch)."""
    if len(eps) != 2:
        raise ValueError(f"adafactor: eps must be (eps1, eps2), got {eps!r}")
    eps1, eps2 = eps
    defaults = [("lr", lr), ("beta2_decay", beta2_decay)]
    if eps1 is not None:
        defaults.append(("eps1", eps1))
    defaults += [("eps2", eps2), ("d", d), ("weight_decay", weight_decay)]
    defaults = tuple((k, float(v)) for k, v in defaults)
    probe = Adafactor(defaults, maximize=bool(maximize))
    for k, v in defaults:
        probe.check_hyper(k, v, "adafactor")
    return Adafactor(defaults, _groups(groups, [k for k, _ in defaults], probe), maximize=bool(maximize))
