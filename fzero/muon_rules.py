"""Muon on flat shards: ``torch.optim.Muon`` for the matrices (group 0, and the user's groups 2...),
``torch.optim.AdamW`` for the rest (group 1); moments are sharded, updated piece by piece. Newton-Schulz needs the
whole matrix: an ``all_gather`` of the Muon shards in bfloat16 (exact: torch's iteration rounds its input to it), each
matrix's owner (:func:`muon_owners`) orthogonalizes it, a ``reduce_scatter(sum)`` of a buffer only owners wrote brings
each rank its shard of every result, to which it applies decoupled weight decay and ``-adjusted_lr * O``. Eager only.

Imports: optim, torch_optim_rules, layout, comm.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch.optim import _muon as torch_muon

from .comm import Communicator
from .layout import FlatGroup, Layout, shard_pieces, trainable_index
from .optim import GroupSpec, ShardRule, Update, _check_hyper, _groups
from .torch_optim_rules import TorchOptimRule, from_torch_optim, update_by_piece

__all__ = ["Muon", "muon", "muon_owners", "newton_schulz", "hidden_matrices"]

Predicate = Callable[[str], bool]

#: the dtype the Newton-Schulz input and output travel in (torch's iteration reads and returns bfloat16)
TRANSPORT = torch.bfloat16
_ADAMW_KEYS = ("lr", "beta1", "beta2", "eps", "weight_decay")
_NS_COEFFICIENTS = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)


def newton_schulz(matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """torch's Newton-Schulz orthogonalization of a 2-D ``matrix``: a bfloat16 matrix of its shape. No
    collective. (A module-level name, so a test can count the calls.)"""
    return torch_muon._zeropower_via_newtonschulz(matrix, coefficients, steps, eps)


def hidden_matrices(module: torch.nn.Module, exclude: Sequence[str] = ("embed", "lm_head", "wte", "wpe")) -> Predicate:
    """Path predicate of Muon's usual parameters: ``module``'s 2-D parameters whose path contains none of
    ``exclude`` (embeddings and the head go to AdamW; the defaults are transformers' Llama and GPT-2 names)."""
    names = frozenset(n for n, p in module.named_parameters()
                      if p.dim() == 2 and not any(word in n for word in exclude))
    return names.__contains__


@dataclasses.dataclass(frozen=True)
class _NotMatrix:
    """The predicate of the AdamW group: paths the user's ``matrices`` predicate rejects."""

    matrices: Predicate

    def __call__(self, path: str) -> bool:
        return not self.matrices(path)


@dataclasses.dataclass(frozen=True)
class Muon(ShardRule):
    """``torch.optim.Muon`` on the matrices (groups 0 and 2...), ``torch.optim.AdamW`` on the rest (group 1);
    built by :func:`muon`. Static: ``nesterov``, ``ns_coefficients``, ``ns_steps``, ``adjust_lr_fn``."""

    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = _NS_COEFFICIENTS
    ns_steps: int = torch_muon.DEFAULT_NS_STEPS
    adjust_lr_fn: str | None = None

    moment_names: ClassVar[tuple[str, ...]] = ("momentum_buffer", "exp_avg", "exp_avg_sq")
    not_compilable: ClassVar[str] = ("its Newton-Schulz step gathers whole matrices to their owner ranks "
                                     "eagerly (an all_gather and a reduce_scatter inside the optimizer step)")

    @property
    def name(self) -> str:
        return "muon"

    def is_muon_group(self, index: int) -> bool:
        """Whether optimizer group ``index`` runs Muon (every group but AdamW's, 1)."""
        return not (index == 1 and isinstance(self.groups[0].match, _NotMatrix))

    def update_shards(self, u: Update, comm: Communicator) -> None:
        """One step, in place on ``u``'s master shards and moments. Collectives, when the layout has Muon
        groups: one ``all_gather`` and one ``reduce_scatter(sum)`` of their shards, in bfloat16."""
        if comm is None:
            raise ValueError("shard_step: optimizer muon calls collectives in its step: pass comm=")
        layout, master, grads, moments, hyper, own, take, ranks = (u.layout, u.master, u.grads, u.moments, u.hyper,
                                                                    u.own, u.take, u.ranks)
        where = trainable_index(layout)
        muon_groups = [g for g in layout.groups if self.is_muon_group(g.opt_group)]
        check_matrices(layout, muon_groups)  # before anything is written (a donated state is updated in place)
        for g in layout.groups:
            if not self.is_muon_group(g.opt_group):
                h = hyper[g.opt_group]
                update_by_piece(_adamw_rule(), layout, g, master[g.index], grads[g.index], moments[g.index][1:],
                                {k: h[k] for k in _ADAMW_KEYS}, own, take, [], ranks)
        if not muon_groups:
            return
        blended = [self._momentum(layout, g, grads[g.index], moments[g.index][0],
                                  hyper[g.opt_group], take, ranks, where) for g in muon_groups]
        gathered = comm.all_gather(torch.cat([b.to(TRANSPORT) for b in blended], dim=1))
        owners = muon_owners(layout, comm.world_size, self.is_muon_group)
        results = torch.zeros_like(gathered)
        for row, rank in enumerate(ranks):
            self._orthogonalize_owned(layout, muon_groups, gathered[row], results[row], owners, rank, take, where,
                                      comm.world_size, hyper)
        mine = comm.reduce_scatter(results, "sum")
        widths = [g.shard_numel for g in muon_groups]
        for g, update in zip(muon_groups, torch.split(mine, widths, dim=1)):
            self._apply(layout, g, master[g.index], update, hyper[g.opt_group], take, ranks, where)

    def _momentum(self, layout: Layout, group: FlatGroup, grad: torch.Tensor, buf: torch.Tensor,
                  hyper: Mapping[str, torch.Tensor], take: Sequence[bool], ranks: Sequence[int],
                  where: Mapping[int, int]) -> torch.Tensor:
        """In place: ``buf`` (``[R, n]``) takes torch's momentum step on the pieces that take the step;
        returns Newton-Schulz's input ``[R, n]`` (the nesterov blend, or the buffer), zero elsewhere."""
        momentum = float(hyper["momentum"])
        out = torch.zeros_like(grad)
        for row, rank in enumerate(ranks):
            for k, lo, hi in shard_pieces(layout, group, rank, where):
                if k is None or not take[k]:
                    continue
                b, gr = buf[row, lo:hi], grad[row, lo:hi]
                b.lerp_(gr, 1 - momentum)  # Python floats, as torch.optim.Muon passes them
                out[row, lo:hi] = gr.lerp(b, momentum) if self.nesterov else b
        return out

    def _orthogonalize_owned(self, layout: Layout, groups: Sequence[FlatGroup], gathered: torch.Tensor,
                             results: torch.Tensor, owners: Mapping[int, int], rank: int, take: Sequence[bool],
                             where: Mapping[int, int], world: int, hyper: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Each matrix ``rank`` owns that takes the step, read whole from ``gathered`` (every rank's joined
        Muon shards, rank-major), orthogonalized into the same places of ``results``. No collective."""
        whole = gathered.view(world, -1)
        out = results.view(world, -1)
        begin = 0
        for g in groups:
            width = g.shard_numel
            flat = whole[:, begin:begin + width].reshape(-1)  # the group's whole flat buffer
            for i in g.slots:
                k = where[i]
                if owners[k] != rank or not take[k]:
                    continue
                s = layout.slots[i]
                matrix = flat[s.offset:s.offset + s.numel].view(s.shape)
                o = newton_schulz(matrix, self.ns_coefficients, self.ns_steps, float(hyper[g.opt_group]["eps"]))
                _scatter_into(out[:, begin:begin + width], s.offset, o.reshape(-1).to(out.dtype))
            begin += width

    def _apply(self, layout: Layout, group: FlatGroup, p: torch.Tensor, update: torch.Tensor,
               hyper: Mapping[str, torch.Tensor], take: Sequence[bool], ranks: Sequence[int],
               where: Mapping[int, int]) -> None:
        """In place on ``p`` (``[R, n]``), the pieces that take the step: torch's decoupled weight decay, then
        ``-adjusted_lr * update`` (this rank's bfloat16 shard of the orthogonalized matrices)."""
        lr, wd = float(hyper["lr"]), float(hyper["weight_decay"])
        for row, rank in enumerate(ranks):
            for k, lo, hi in shard_pieces(layout, group, rank, where):
                if k is None or not take[k]:
                    continue
                shape = torch.Size(layout.trainable_slots[k].shape)
                piece = p[row, lo:hi]
                piece.mul_(1 - lr * wd)
                piece.add_(update[row, lo:hi], alpha=-torch_muon._adjust_lr(lr, self.adjust_lr_fn, shape))


def _scatter_into(out: torch.Tensor, offset: int, values: torch.Tensor) -> None:
    """Write ``values`` into flat ``[offset, offset + len)`` of the ``[W, shard_numel]`` buffer ``out``."""
    width = out.shape[1]
    lo, hi = offset, offset + values.numel()
    for q in range(lo // width, (hi - 1) // width + 1):
        a, b = max(lo, q * width), min(hi, (q + 1) * width)
        out[q, a - q * width:b - q * width] = values[a - lo:b - lo]


def check_matrices(layout: Layout, groups: Sequence[FlatGroup]) -> None:
    """Raise ``ValueError`` naming the first parameter of a Muon group that is not 2-D."""
    for s in (layout.slots[i] for g in groups for i in g.slots):
        if len(s.shape) != 2:
            raise ValueError(f"muon: parameter {s.path} has shape {tuple(s.shape)}; Muon updates 2-D matrices only "
                             "(route it to AdamW: leave it out of muon()'s matrices predicate)")


def _ns_cost(shape: tuple[int, ...]) -> int:
    """Multiply-adds of one Newton-Schulz iteration on a matrix of ``shape``."""
    a, b = min(shape), max(shape)
    return 2 * a * a * b + a * a * a


def muon_owners(layout: Layout, world_size: int, is_muon_group: Callable[[int], bool] = lambda i: i != 1
                ) -> dict[int, int]:
    """``{trainable index: owner rank}`` of every Muon parameter, the same on every rank: largest
    Newton-Schulz cost first, each to the least loaded rank (lowest on ties). No collective."""
    where = trainable_index(layout)
    mats = [(where[i], layout.slots[i].shape) for g in layout.groups if is_muon_group(g.opt_group) for i in g.slots]
    mats.sort(key=lambda km: (-_ns_cost(km[1]), km[0]))
    load = [(0, r) for r in range(world_size)]
    owners = {}
    for k, shape in mats:
        cost, r = heapq.heappop(load)
        owners[k] = r
        heapq.heappush(load, (cost + _ns_cost(shape), r))
    return owners


# the AdamW group runs torch.optim.Adam(decoupled_weight_decay=True), AdamW's update (torch >= 2.6)
@functools.cache
def _adamw_rule() -> TorchOptimRule:
    return from_torch_optim(torch.optim.Adam, decoupled_weight_decay=True)


def muon(lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95, *, matrices: Predicate,
         adamw: Mapping[str, Any] | None = None, nesterov: bool = True,
         ns_coefficients: tuple[float, float, float] = _NS_COEFFICIENTS, eps: float = torch_muon.EPS,
         ns_steps: int = torch_muon.DEFAULT_NS_STEPS, adjust_lr_fn: str | None = None,
         groups: Sequence[GroupSpec] = ()) -> Muon:
    """``torch.optim.Muon(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn)`` on the
    parameters ``matrices`` picks (2-D: :func:`hidden_matrices`), ``torch.optim.AdamW(**adamw)`` (``lr``, ``betas``,
    ``eps``, ``weight_decay``) on the others. Groups: 0 Muon's, 1 AdamW's, ``groups`` (as for :func:`fzero.adamw`)
    further Muon groups. Eager only; a Muon parameter not 2-D raises at the first step."""
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"muon: adjust_lr_fn {adjust_lr_fn!r} is not one of None, 'original', 'match_rms_adamw'")
    if len(ns_coefficients) != 3 or ns_steps >= 100:
        raise ValueError("muon: ns_coefficients must be three numbers and ns_steps below 100 (torch's limits)")
    aw = {**dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2), **dict(adamw or {})}
    unknown = set(aw) - {"lr", "betas", "eps", "weight_decay"}
    if unknown:
        raise ValueError(f"muon: adamw takes lr, betas, eps, weight_decay; got {sorted(unknown)}")
    defaults = (("lr", float(lr)), ("weight_decay", float(weight_decay)), ("momentum", float(momentum)),
                ("eps", float(eps)), ("beta1", float(aw["betas"][0])), ("beta2", float(aw["betas"][1])))
    for k, v in defaults:
        _check_hyper(k, v, "muon")
    rest = ((_NotMatrix(matrices), dict(lr=aw["lr"], eps=aw["eps"], weight_decay=aw["weight_decay"])),)
    probe, names = Muon(defaults), [k for k, _ in defaults]
    named = (dataclasses.replace(_groups(rest, names, probe)[0], name="adamw"),)
    return Muon(defaults, named + _groups(groups, names, probe), nesterov=nesterov,
                ns_coefficients=tuple(float(c) for c in ns_coefficients), ns_steps=int(ns_steps),
                adjust_lr_fn=adjust_lr_fn)
