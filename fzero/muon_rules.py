"""Muon on flat ZeRO shards: ``torch.optim.Muon`` for the matrices, ``torch.optim.AdamW`` for
the rest, as users run them, each matrix orthogonalized once in the world.

:func:`muon` builds the rule (:class:`Muon`): parameter group 0 is Muon's (the matrices the
``matrices`` path predicate picks), group 1 AdamW's (everything else); further groups are the
user's, each a Muon group. Every group's hyperparameters are the ones its ``torch.optim``
class reads (Muon: ``lr``, ``weight_decay``, ``momentum``, ``eps``, the Newton-Schulz
epsilon; AdamW: ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``): 0-d tensors in
``OptState.hyper``, schedulable per group.

Where the state lives: Muon's ``momentum_buffer`` is elementwise, so it is a flat moment
(``[R, shard_numel]``) like AdamW's ``exp_avg``/``exp_avg_sq``: optimizer state stays sharded
(1/W per rank), and checkpoints reshard it as any moment. The momentum is updated on each
parameter's piece of the shard; the Newton-Schulz input of a matrix (its nesterov-blended
momentum) needs the whole matrix, so it travels:

1. ``all_gather`` of the Muon groups' shards of that input, in bfloat16 (torch's
   Newton-Schulz rounds its input to bfloat16 first thing, so this is exact);
2. each matrix's *owner* (:func:`muon_owners`: static, a greedy balance of Newton-Schulz
   cost, the same on every rank) orthogonalizes it, once in the world;
3. ``reduce_scatter(sum)`` of a flat bfloat16 buffer in which only each matrix's owner wrote
   its result (``x + 0 == x``: exact) brings each rank its shard of every result;
4. each rank applies decoupled weight decay and ``-adjusted_lr * O`` to its own pieces, in
   torch's order with torch's Python-float scalars.

Eager only (a Python loop over pieces and owners); a compiled step raises naming the rule.

Imports: ``fzero.optim``, ``fzero.torch_optim_rules``, ``fzero.layout``, ``fzero.comm``,
``fzero.sharding``.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch
from torch.optim import _muon as torch_muon

from .comm import Communicator
from .layout import FlatGroup, Layout
from .layout import shard_pieces, trainable_index
from .optim import GroupSpec, ShardRule, Update, _check_hyper, _groups
from .torch_optim_rules import TorchOptimRule, from_torch_optim, update_by_piece

__all__ = ["Muon", "muon", "muon_owners", "newton_schulz", "hidden_matrices"]

Predicate = Callable[[str], bool]

#: the dtype the Newton-Schulz input and output travel in: torch's iteration reads its input
#: as bfloat16 and returns bfloat16, so the round trip loses nothing
TRANSPORT = torch.bfloat16

_MUON_KEYS = ("lr", "weight_decay", "momentum", "eps")
_ADAMW_KEYS = ("lr", "beta1", "beta2", "eps", "weight_decay")


def newton_schulz(matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """torch's own Newton-Schulz orthogonalization of a 2-D ``matrix`` (any float dtype):
    a bfloat16 matrix of the same shape. No collective. (A module-level name, so a test can
    count the calls.)"""
    return torch_muon._zeropower_via_newtonschulz(matrix, coefficients, steps, eps)


def hidden_matrices(module: torch.nn.Module, exclude: Sequence[str] = ("embed", "lm_head", "wte", "wpe")
                    ) -> Predicate:
    """Path predicate for Muon's usual parameters: 2-D parameters of ``module`` whose path
    contains none of ``exclude`` (embeddings and the output head go to AdamW, as Muon's
    authors run it; the defaults name them in transformers' Llama and GPT-2 families, pass
    your model's names otherwise). Biases, norms and other non-2-D parameters are never
    matrices."""
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
    """``torch.optim.Muon`` on the matrices (groups 0 and 2...), ``torch.optim.AdamW`` on the
    rest (group 1, the one :func:`muon` builds from ``matrices``); build it with :func:`muon`.
    Static: Muon's ``nesterov``, ``ns_coefficients``, ``ns_steps``, ``adjust_lr_fn``."""

    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)
    ns_steps: int = torch_muon.DEFAULT_NS_STEPS
    adjust_lr_fn: Optional[str] = None

    moment_names: ClassVar[tuple[str, ...]] = ("momentum_buffer", "exp_avg", "exp_avg_sq")
    not_compilable: ClassVar[str] = ("its Newton-Schulz step gathers whole matrices to their owner ranks "
                                     "eagerly (an all_gather and a reduce_scatter inside the optimizer step)")

    @property
    def name(self) -> str:
        return "muon"

    def is_muon_group(self, index: int) -> bool:
        """Whether optimizer group ``index`` runs Muon (every group but AdamW's, 1)."""
        return not (index == 1 and isinstance(self.groups[0].match, _NotMatrix))

    def _adamw(self) -> TorchOptimRule:
        """``torch.optim.AdamW`` as a by-piece rule (its hyperparameters come per step)."""
        return _adamw_rule()

    def update_shards(self, u: Update, comm: Communicator) -> None:
        """One step, in place on ``u``'s master shards and moments. Collectives: one
        ``all_gather`` and one ``reduce_scatter(sum)`` of the Muon groups' shards, in bfloat16,
        when the layout has Muon groups."""
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
                update_by_piece(self._adamw(), layout, g, master[g.index], grads[g.index], moments[g.index][1:],
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
        """In place: ``buf`` (``[R, n]``) takes torch's momentum step on every piece of a
        parameter that takes the step; returns Newton-Schulz's input ``[R, n]`` (the
        nesterov blend, or the buffer), zero elsewhere. No collective."""
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
        """For each matrix ``rank`` owns that takes the step: read it whole from ``gathered``
        (``[W * sum(shard_numel)]``, the joined Muon shards of every rank, rank-major),
        orthogonalize it, write the result at the same places of ``results``. No collective."""
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
        """In place on ``p`` (``[R, n]``): torch.optim.Muon's decoupled weight decay, then
        ``-adjusted_lr * update`` (``update``: ``[R, n]`` bfloat16, this rank's shard of every
        orthogonalized matrix), on each piece of a parameter that takes the step."""
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
    """Write ``values`` at flat positions ``[offset, offset + len)`` of a group's flat buffer
    held rank-major as ``out`` (``[W, shard_numel]``, a view): each rank's part of the range
    goes to its row. No collective."""
    width = out.shape[1]
    lo, hi = offset, offset + values.numel()
    for q in range(lo // width, (hi - 1) // width + 1):
        a, b = max(lo, q * width), min(hi, (q + 1) * width)
        out[q, a - q * width:b - q * width] = values[a - lo:b - lo]


def check_matrices(layout: Layout, groups: Sequence[FlatGroup]) -> None:
    """Raise ``ValueError`` naming the first parameter of a Muon group that is not 2-D."""
    for g in groups:
        for i in g.slots:
            s = layout.slots[i]
            if len(s.shape) != 2:
                raise ValueError(
                    f"muon: parameter {s.path} has shape {tuple(s.shape)}; Muon updates 2-D matrices only "
                    "(route it to AdamW: leave it out of muon()'s matrices predicate)")


def _ns_cost(shape: tuple[int, ...]) -> int:
    """Multiply-adds of one Newton-Schulz iteration on a matrix of ``shape`` (``a = min``,
    ``b = max``: two ``a x a x b`` products and one ``a x a x a``)."""
    a, b = min(shape), max(shape)
    return 2 * a * a * b + a * a * a


def muon_owners(layout: Layout, world_size: int, is_muon_group: Callable[[int], bool] = lambda i: i != 1
                ) -> dict[int, int]:
    """``{trainable index: owner rank}`` for every parameter of a Muon group: the rank that
    orthogonalizes it. Static and deterministic (the same on every rank): largest
    Newton-Schulz cost first, each to the least loaded rank (lowest rank on ties), so each
    rank does about 1/W of the work. No collective."""
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


# torch.optim.AdamW is Adam with decoupled weight decay (torch >= 2.6): the AdamW group runs
# torch.optim.Adam(decoupled_weight_decay=True), the same update. (from_torch_optim builds
# torch.optim.AdamW itself too now; this one stays so that Muon checkpoints keep their rule.)
@functools.lru_cache(maxsize=None)
def _adamw_rule() -> TorchOptimRule:
    return from_torch_optim(torch.optim.Adam, decoupled_weight_decay=True)


def muon(
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    *,
    matrices: Predicate,
    adamw: Optional[Mapping[str, Any]] = None,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C),
    eps: float = torch_muon.EPS,
    ns_steps: int = torch_muon.DEFAULT_NS_STEPS,
    adjust_lr_fn: Optional[str] = None,
    groups: Sequence[GroupSpec] = (),
) -> Muon:
    """``torch.optim.Muon(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
    adjust_lr_fn)`` on the parameters whose path satisfies ``matrices`` (2-D; e.g.
    :func:`hidden_matrices`), and ``torch.optim.AdamW(**adamw)`` (``lr``, ``betas``, ``eps``,
    ``weight_decay``; torch's defaults for those not given) on all the others.

    Parameter groups: 0 is Muon's, 1 AdamW's (``set_hyperparams(state, group=1, lr=...)``);
    ``groups`` (as for :func:`fzero.adamw`) are further Muon groups among the matrices.
    Each matrix is orthogonalized once in the world by its owner rank (:func:`muon_owners`);
    the step adds one ``all_gather`` and one ``reduce_scatter`` of the matrices' shards in
    bfloat16. Eager only. A Muon parameter that is not 2-D raises ``ValueError`` naming it at
    the first step.
    """
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
    probe = Muon(defaults)
    named = _groups(rest, [k for k, _ in defaults], probe)
    named = (dataclasses.replace(named[0], name="adamw"),)
    return Muon(defaults, named + _groups(groups, [k for k, _ in defaults], probe), nesterov=nesterov,
                ns_coefficients=tuple(float(c) for c in ns_coefficients), ns_steps=int(ns_steps),
                adjust_lr_fn=adjust_lr_fn)
