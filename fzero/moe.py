"""Expert parallelism: a mixture-of-experts layer's experts split over the ranks of an *expert-parallel group*, each
rank holding ``E / EP`` of them, every token sent to its experts' ranks and back by all-to-all; and the groups an
expert's parameters are sharded over (:func:`expert_groups`: the ranks holding the same experts), which
``init_train_state(groups=)`` takes. The router, its top-k and the load-balancing loss stay the model's own: a
``transformers`` sparse block (Mixtral, Qwen2-MoE, any whose ``experts`` take ``(hidden, top_k_index,
top_k_weights)`` and hold ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``) keeps its router and computes
the same numbers; :func:`expert_parallel` converts it in place, each rank keeping its own experts' weights.

Dropless, as the blocks it replaces: each expert computes every token routed to it, so the sizes sent depend on the
routing and are read on the host (one small all-to-all of counts per layer and pass, as the blocks' own loop over
the experts they hit); an expert no token reached is not run (no gradient: ``make_train_step(unused=)`` decides).
Eager only. In one process (``SimulatedWorld``) the rows meet at each all-to-all (:mod:`fzero.lockstep`).

Imports: comm, lockstep.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .comm import Communicator
from .lockstep import current

__all__ = ["EXPERT_PARALLEL", "EXPERTS", "expert_groups", "all_to_all", "ExpertParallelExperts", "ExpertGroup",
           "expert_parallel"]

EXPERT_PARALLEL = "expert_parallel"  # the parameter group whose ranks exchange tokens: together they hold every expert
EXPERTS = "experts"  # the group an expert's parameters are sharded and averaged over: the ranks holding the same ones


def expert_groups(world_size: int, ep: int) -> dict[str, list[list[int]]]:
    """The two groups of expert parallelism of degree ``ep`` over ``world_size`` ranks, for a communicator's
    ``groups=``: ``"expert_parallel"``, consecutive ranks ``[q*ep, ..., q*ep + ep - 1]`` (the ``i``-th of them holds
    experts ``[i*E/ep, (i+1)*E/ep)``); ``"experts"``, the ranks holding the same experts, ``[i, i + ep, i + 2*ep,
    ...]`` (``world_size / ep`` of them: rank group ``i`` holds the ``i``-th slice). ``ValueError`` unless ``ep``
    divides ``world_size``."""
    if not (isinstance(ep, int) and isinstance(world_size, int) and ep >= 1 and world_size >= 1
            and world_size % ep == 0):
        raise ValueError(f"expert_groups: the expert-parallel degree must divide the world size, got ep={ep!r} for "
                         f"{world_size!r} ranks")
    return {EXPERT_PARALLEL: [list(range(q * ep, (q + 1) * ep)) for q in range(world_size // ep)],
            EXPERTS: [list(range(i, world_size, ep)) for i in range(ep)]}


def _exchange(comm: Communicator, chunks: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    """This row's chunk ``k`` to rank ``k`` of ``comm``, and what each rank sent it (``Communicator.all_to_all_lists``;
    rows of a simulated world meet in lockstep)."""
    if comm.local_ranks == 1:
        return comm.all_to_all_lists([list(chunks)])[0]
    where = current()
    if where is None:
        raise RuntimeError(f"{what}: in a simulated world of {comm.local_ranks} rows an expert-parallel layer runs "
                           "inside fzero's step (fzero.loss_grads), whose rows meet at each all-to-all")
    steps, row = where
    return steps.meet(row, what, list(chunks), lambda rows: comm.all_to_all_lists(rows))


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: backward sends each received chunk's gradient back to the rank it came from (the
    same exchange: what rank ``k`` received from us is our chunk ``k``)."""

    @staticmethod
    def forward(ctx: Any, comm: Communicator, *chunks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = tuple(_exchange(comm, chunks, "all_to_all"))
        ctx.comm, ctx.device = comm, chunks[0].device
        ctx.like = [torch.empty_like(o, device="meta") for o in out]
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        # a received chunk nothing used has a zero gradient: every rank still takes part in the exchange
        sent = [torch.zeros(m.shape, dtype=m.dtype, device=ctx.device) if g is None else g.contiguous()
                for g, m in zip(grads, ctx.like)]
        return (None, *_exchange(ctx.comm, sent, "all_to_all (backward)"))


def all_to_all(chunks: Sequence[torch.Tensor], comm: Communicator) -> list[torch.Tensor]:
    """Chunk ``k`` (any first dimension; the rest and the dtype alike) to rank ``k`` of ``comm`` (an expert-parallel
    group's communicator); returns what each rank sent this one, differentiable. Collectives: one all-to-all of the
    sizes (read on the host), one of the chunks; backward the same for their gradients."""
    return list(_AllToAll.apply(comm, *chunks))


class ExpertParallelExperts(torch.nn.Module):
    """``E / EP`` experts of a sparse block (``gate_up_proj [E/EP, 2I, H]``, ``down_proj [E/EP, H, I]``, the block's
    activation), called as the block calls its experts: ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])
    -> [T, H]``. Each token goes to the ranks of its ``k`` experts in ``comm`` (the expert-parallel group's: rank
    ``i`` holds experts ``[i*E/EP, (i+1)*E/EP)``), which run it and send it back, weighted there as the block does."""

    fzero_meets = True  # its forward and backward call collectives every rank of its group must join (fzero.lockstep)

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act_fn: Callable[[torch.Tensor], Any],
                 num_experts: int, comm: Communicator):
        super().__init__()
        if gate_up_proj.dim() != 3 or down_proj.dim() != 3 or gate_up_proj.shape[0] != down_proj.shape[0]:
            raise ValueError(f"ExpertParallelExperts: gate_up_proj {tuple(gate_up_proj.shape)} and down_proj "
                             f"{tuple(down_proj.shape)} must be [E/EP, 2I, H] and [E/EP, H, I]")
        ep = comm.world_size
        if gate_up_proj.shape[0] * ep != num_experts:
            raise ValueError(f"ExpertParallelExperts: {gate_up_proj.shape[0]} local experts on each of {ep} ranks, "
                             f"but the block has {num_experts}")
        self.gate_up_proj = torch.nn.Parameter(gate_up_proj)
        self.down_proj = torch.nn.Parameter(down_proj)
        self.act_fn, self.num_experts, self.comm = act_fn, num_experts, comm

    @property
    def local_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        ep, local, k = self.comm.world_size, self.local_experts, top_k_index.shape[1]
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # every (token, slot) by expert: each rank's run in its order
        counts = torch.bincount(chosen, minlength=self.num_experts)
        per_expert = counts.tolist()  # host: the sizes of what is sent (dropless)
        # how many of ours each rank's experts get, expert by expert (no gradient)
        theirs = _exchange(self.comm, list(counts.view(ep, local)), "all_to_all (expert counts)")
        their_counts = torch.stack(theirs).tolist()  # [source rank][local expert]
        sent = hidden[order // k]
        per_rank = [sum(per_expert[p * local:(p + 1) * local]) for p in range(ep)]
        received = all_to_all(list(sent.split(per_rank)), self.comm)
        # this rank's experts on what they received, from every rank in rank order, then back in the same places
        pieces = [list(r.split(c)) for r, c in zip(received, their_counts)]
        done: list[list[torch.Tensor | None]] = [[None] * local for _ in range(ep)]
        for e in range(local):
            tokens = [pieces[s][e] for s in range(ep)]
            sizes = [t.shape[0] for t in tokens]
            if not sum(sizes):  # no token reached this expert: not run, no gradient (as the block skips it)
                continue
            gate, up = torch.nn.functional.linear(torch.cat(tokens), self.gate_up_proj[e]).chunk(2, dim=-1)
            out = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
            for s, part in enumerate(out.split(sizes)):
                done[s][e] = part
        back = [torch.cat([p if p is not None else pieces[s][e] * 0 for e, p in enumerate(done[s])])
                for s in range(ep)]
        results = torch.cat(all_to_all(back, self.comm))  # ours, in `order`
        weights = top_k_weights.reshape(-1)[order, None]
        out = torch.zeros_like(hidden)
        return out.index_add(0, order // k, (results * weights).to(hidden.dtype))


@dataclasses.dataclass(frozen=True)
class ExpertGroup:
    """What :func:`expert_parallel` converted, for ``init_train_state(groups={"experts": group})``: called with a
    parameter path, whether it is an expert's; :meth:`values` gives a rank group's own experts' initial values (in one
    process every rank group's slice of the block's experts, kept until the state is built; on a real rank only its
    own, which its module holds)."""

    paths: frozenset[str]
    full: Any = dataclasses.field(default=None, compare=False, repr=False)  # {path: (tensor [E, ...], local)}

    def __call__(self, path: str) -> bool:
        return path in self.paths

    def values(self, path: str, part: int) -> torch.Tensor | None:
        """The initial value of expert parameter ``path`` in rank group ``part`` (the ``part``-th slice of the
        experts), or None where the module's own is it (a real rank's)."""
        if self.full is None:
            return None
        whole, local = self.full[path]
        return whole[part * local:(part + 1) * local]


def expert_parallel(model: torch.nn.Module, comm: Communicator, *, group: str = EXPERT_PARALLEL) -> ExpertGroup:
    """Convert ``model``'s sparse blocks in place: every submodule's ``experts`` that hold ``gate_up_proj [E, 2I, H]``
    and ``down_proj [E, H, I]`` (``transformers``' Mixtral, Qwen2-MoE and their kind) become an
    :class:`ExpertParallelExperts` of this rank's ``E / EP`` experts (``EP``: the size of ``comm``'s parameter group
    ``group``; this rank's slice: its place there), their pretrained weights kept. Returns the :class:`ExpertGroup` to
    give ``init_train_state(groups={"experts": ...})``. ``ValueError`` if there is no such block, or ``EP`` does not
    divide a block's experts."""
    ep_comm = comm.param_group(group)
    ep, one_process = ep_comm.world_size, comm.local_ranks > 1
    mine = ep_comm.ranks[0]  # a real rank's place; in one process rank group 0's (the rows' own come from values())
    paths: set[str] = set()
    full: dict[str, tuple[torch.Tensor, int]] = {}
    for name, module in list(model.named_modules()):
        experts = getattr(module, "experts", None)
        if isinstance(experts, ExpertParallelExperts) or not _is_sparse_experts(experts):
            continue
        total = experts.gate_up_proj.shape[0]
        if total % ep:
            raise ValueError(f"expert_parallel: {name or 'the model'}.experts has {total} experts, which {ep} "
                             "expert-parallel ranks do not divide")
        local = total // ep
        piece = slice(mine * local, (mine + 1) * local)
        converted = ExpertParallelExperts(experts.gate_up_proj.detach()[piece].clone(),
                                          experts.down_proj.detach()[piece].clone(), experts.act_fn, total, ep_comm)
        module.experts = converted
        prefix = f"{name}.experts." if name else "experts."
        for attr, whole in (("gate_up_proj", experts.gate_up_proj), ("down_proj", experts.down_proj)):
            paths.add(prefix + attr)
            if one_process:
                full[prefix + attr] = (whole.detach(), local)
    if not paths:
        raise ValueError("expert_parallel: the model has no sparse block whose experts hold gate_up_proj and "
                         "down_proj (a transformers Mixtral or Qwen2-MoE block)")
    return ExpertGroup(frozenset(paths), full if one_process else None)


def _is_sparse_experts(experts: Any) -> bool:
    return isinstance(experts, torch.nn.Module) and all(
        isinstance(getattr(experts, a, None), torch.nn.Parameter) and getattr(experts, a).dim() == 3
        for a in ("gate_up_proj", "down_proj")) and callable(getattr(experts, "act_fn", None))
