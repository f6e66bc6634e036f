"""ZeRO stage 3 for any ``nn.Module``, no recomputed forward. A wrap policy (module classes, a predicate on ``(name,
module)``, or :func:`default_units`) picks submodules as shard units, as FSDP2 applies ``fully_shard`` per block
(buckets: :func:`unit_buckets`; units may not nest). :func:`unit_grads` gathers a unit (prefetched) for its forward and
again for its backward, and reduces it once backward completes it: at most the root and two units gathered at once, each
forward run once (stage 3 equals stage 2 bitwise). All ranks must call the same units in the same order
(:class:`UnitCallError`). :class:`CompiledUnits` regathers by selective recomputation.

Imports: buckets, comm, layout, lockstep, module, rng, scopes, sharding, state.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as tp
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .buckets import BucketReduction, Runner, used_flags
from .comm import Communicator
from .layout import FlatGrads, FlatGroup, Layout, compute_dtype, split_views, stack_rows
from .lockstep import current
from .module import (
    ModuleLoss,
    UnitPolicy,
    _swapped,
    check_loss,
    default_units,
    row_of,
    run_rows,
    select_units,
    unit_buckets,
)
from .rng import rank_rng
from .scopes import GATHER, step_scope
from .sharding import all_gather_params
from .state import TrainState

__all__ = ["UnitPolicy", "select_units", "default_units", "unit_buckets", "unit_grads", "UnitCallError",
           "CompiledUnits", "compiled_unit_grads"]

_Tensors = tuple[torch.Tensor, ...]  # a bucket's flat buffers (one per flat group), their gradients, a unit's outputs

# Metadata a released parameter still gives (HF models read ``self.dtype``/``.device`` from their first parameter).
_METADATA = frozenset({
    "shape", "dtype", "device", "requires_grad", "ndim", "layout", "is_cuda", "is_meta", "is_cpu", "is_sparse",
    "is_quantized", "is_nested", "is_leaf", "grad_fn", "grad", "names", "itemsize", "nbytes", "size", "dim",
    "numel", "element_size", "is_floating_point", "is_complex", "__len__", "__hash__", "__repr__", "__format__",
    "nelement", "get_device", "type"})


class _Released(torch.Tensor):
    """A unit's parameter outside the unit's forward: metadata reads work, any use raises."""

    _fzero_name: str = "?"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        owner = getattr(func, "__self__", None)
        if name == "__get__" and owner is not None:  # an attribute read: the attribute's name
            name = getattr(owner, "__name__", "")
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        found = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, _Released)]
        who = found[0]._fzero_name if found else "?"
        raise RuntimeError(f"fzero stage 3: parameter {who} was used ({name}) outside the forward of the unit that "
                           "holds it: its gathered value exists only while that unit runs. Put the module that uses "
                           "it in the same unit, or leave it to the root (choose units that do not contain it)")


class _Token(NamedTuple):
    """A saved tensor that is a view of a gathered bucket: where it was, not what."""

    bucket: int
    pos: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Gather(torch.autograd.Function):
    """``anchor -> this rank's flat buffers of a bucket`` (compute dtype, ``[padded]``; its frozen groups' left in
    ``run.frozen_flats``); backward: their gradients."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, run: _RankRun, bucket: int) -> _Tensors:  # type: ignore[override]
        ctx.run, ctx.bucket = run, bucket
        if bucket and not run.backward:  # a unit's call in forward
            run.event(bucket)
        flats, n = run.take(bucket), len(run.plan.groups[bucket])
        run.frozen_flats = flats[n:]  # no gradient: outside autograd
        return flats[:n]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, None, None]:  # type: ignore[override]
        ctx.run.deliver(ctx.bucket, grads)
        return None, None, None


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's output tensors; its backward runs before autograd enters the unit."""

    @staticmethod
    def forward(ctx: Any, run: _RankRun, bucket: int, *xs: torch.Tensor) -> _Tensors:  # type: ignore[override]
        ctx.run, ctx.bucket = run, bucket
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.run.bind_for_backward(ctx.bucket)
        return (None, None, *grads)


class UnitCallError(RuntimeError):
    """The ranks called different shard units, or in another order, in one stage-3 forward. ``call``: the 1-based index
    of the first differing unit call; ``calls``: ``{rank: unit name, or None where its forward called no further
    unit}``. Raised on every rank (simulated world too) before any collective whose size depends on that call."""

    def __init__(self, call: int, calls: Mapping[int, str | None]):
        self.call, self.calls = call, dict(calls)
        said = ", ".join(
            f"rank {r} " + (f"called unit {u!r}" if u is not None else "called no further unit (its forward ended)")
            for r, u in sorted(self.calls.items()))
        super().__init__(
            f"fzero stage 3: the ranks called different shard units at unit call {call} of the forward: {said}. "
            "Each unit's parameters are gathered by a collective every rank must join, so every rank must call "
            "the same units in the same order. Make a data-dependent module one unit as a whole (a "
            "mixture-of-experts layer, not each expert; the block that holds a branch), or leave it to the root")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.call, self.calls))


_END = 0  # the event "the forward called no further unit" (bucket 0, the root, is never called)
_NONE = -1  # no event (before the first)


class _CallCheck:
    """Checks that all ranks call the same units in one forward: *events* (unit calls, :data:`_END`) all-gathered as
    ``(index, previous, event)`` (:meth:`compare`), or compared with rank 0's when simulated (:meth:`record`)."""

    def __init__(self, comm: Communicator, names: Sequence[str]):
        self.names, self.rows, self.ranks = names, comm.local_ranks, tuple(comm.data_ranks)  # names[0]: unused
        self.tagged = self.rows == 1 and comm.world_size > 1  # a real rank among others
        self.reference: list[int] = []  # the simulated world's rank 0 events

    def name(self, event: int) -> str | None:
        return None if event == _END else self.names[event]

    def record(self, row: int, index: int, event: int) -> None:
        if self.rows == 1:  # one rank per process: compared by tags, if at all
            return
        if row == 0:
            self.reference.append(event)
            return
        ref = self.reference[index] if index < len(self.reference) else _END
        if ref != event:
            raise UnitCallError(index + 1, {self.ranks[0]: self.name(ref), self.ranks[row]: self.name(event)})

    def compare(self, tags: Sequence[Sequence[int]]) -> None:
        if all(list(t) == list(tags[0]) for t in tags):
            return
        known = [{i - 1: prev, i: e} for i, prev, e in tags]  # name the first index whose known events differ
        for i in sorted(set().union(*known)):
            seen = {r: k[i] for r, k in enumerate(known) if k.get(i, _NONE) != _NONE}
            if len(set(seen.values())) > 1:
                raise UnitCallError(i, {r: self.name(e) for r, e in seen.items()})
        raise UnitCallError(min(t[0] for t in tags), {r: self.name(t[2]) for r, t in enumerate(tags)})


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static: the layout, its flat groups and frozen groups per bucket (root first, then each unit) and, per bucket,
    where each of its sharded parameters is registered in the module (``(table, attribute, name)``)."""

    layout: Layout
    groups: tuple[tuple[FlatGroup, ...], ...]
    frozen: tuple[tuple[FlatGroup, ...], ...]
    unit_slots: tuple[tuple[tuple[dict, str, str], ...], ...]

    @staticmethod
    def of(layout: Layout, units: Sequence[str], loss_fn: ModuleLoss) -> _Plan:
        groups, frozen = ([tuple(g for g in gs if g.bucket == b) for b in range(len(units) + 1)]
                          for gs in (layout.groups, layout.frozen_groups))
        bucket_of = {s.path: s.bucket for s in layout.slots}
        slots: list[list[tuple[dict, str, str]]] = [[] for _ in groups]
        for table, attr, name in loss_fn._slots:
            if bucket_of.get(name):
                slots[bucket_of[name]].append((table, attr, name))
        return _Plan(layout, tuple(groups), tuple(frozen), tuple(tuple(s) for s in slots))

    def gathered(self, bucket: int) -> tuple[FlatGroup, ...]:
        """The groups a bucket's gather brings: its flat groups, then its frozen groups."""
        return self.groups[bucket] + self.frozen[bucket]

    def views(self, bucket: int, flats: Iterable[torch.Tensor],
              used: set[int] | None = None) -> dict[str, torch.Tensor]:
        """``{path: view}`` of the bucket's parameters by one ``split`` per flat buffer (backward: one ``cat``).
        ``used``: gets the slots whose view had a gradient (a plain set: hooks hold no reference to the run)."""
        tensors = {}
        for g, flat in zip(self.gathered(bucket), flats):
            for i, view in zip(g.slots, split_views(self.layout, g, flat)):
                if used is not None and view.requires_grad:
                    view.register_hook(lambda grad, i=i: used.add(i))
                tensors[self.layout.slots[i].path] = view
        return tensors


class _RankRun:
    """One local rank's stage-3 forward and backward. The root is gathered with the first unit, held to the end. A
    unit's forward pre-hook binds views of its gathered buffers (:class:`_Gather`); its forward hook puts back the
    :class:`_Released` placeholders and passes its outputs through :class:`_PreBackward`, whose backward regathers it.
    Saved views are packed as :class:`_Token` (no unit held from forward to backward but the last two)."""

    def __init__(self, plan: _Plan, state: TrainState, comm: Communicator, row: int, reduction: BucketReduction,
                 runner: Runner, released: Mapping[str, torch.Tensor], check: _CallCheck):
        self.plan, self.state, self.comm, self.row, self.reduction = plan, state, comm, row, reduction
        self.runner, self.released, self.check = runner, released, check
        self.events: list[int] = []  # this forward's unit calls, then _END
        self.pending: Callable[[], list[list[int]]] | None = None  # the last event's tags, unchecked
        self.anchor = torch.zeros((), requires_grad=True)
        self.backward = False
        self.expected = [0] * len(plan.groups)  # per bucket: its uses in forward
        self.delivered = [0] * len(plan.groups)  # per bucket: the gradients of those uses received
        self.acc: dict[int, _Tensors] = {}  # their sum
        self.cache: dict[int, _Tensors] = {}  # arrived, held for backward
        self.live: dict[int, tuple[int, int, int]] = {}  # storage -> (bucket, pos, offset): saved as tokens
        self.bound: dict[int, Mapping[str, torch.Tensor]] = {}  # a running unit's views (their storage in live)
        self.ahead: dict[int, Callable[[], _Tensors]] = {}  # started gathers (prefetch)
        self.order: list[int] = []  # units in the order of their first forward
        self.last_flats: _Tensors = ()  # those of the last bucket_tensors, for pre_forward
        self.used: set[int] = set()  # slot indices whose view got a gradient
        self.frozen_flats: _Tensors = ()  # the frozen groups' buffers of the last _Gather
        self.secondary: dict[int, _Tensors] = {}  # hpZ: per unit, every row's slice of its gather within its node

    def start(self, *buckets: int) -> None:
        """Start gathering ``buckets`` (one :func:`fzero.all_gather_params`, via the runner) into :attr:`ahead`. hpZ
        (``comm.node``): a forward gather keeps each row's slice within its node (:attr:`secondary`), and backward
        regathers from those within the node (``node.all_gather``), never across nodes."""
        groups = [g for b in buckets for g in self.plan.gathered(b)]
        node = self.comm.node
        if node is not None and self.backward and all(b in self.secondary for b in buckets):
            held = [s for b in buckets for s in self.secondary.pop(b)]
            done = self.runner.submit(self.comm.overlaps, lambda: tuple(node.all_gather(s) for s in held))
        else:
            done = self.runner.submit(self.comm.overlaps, all_gather_params, self.state.shard, self.comm,
                                      self.state.precision.param_dtype, groups=groups)
            if node is not None and not self.backward:
                done = self._keeping_secondary(done, [b for b in buckets if b])  # the root is held to the end
        lo = 0
        for b in buckets:
            hi = lo + len(self.plan.gathered(b))
            self.ahead[b] = lambda lo=lo, hi=hi: tuple(f[self.row] for f in done()[lo:hi])
            lo = hi

    def _keeping_secondary(self, done: Callable[[], _Tensors], buckets: Sequence[int]) -> Callable[[], _Tensors]:
        """``done``, which on its first call also keeps the node slices of ``buckets``' flats (after the root's)."""
        node, kept = self.comm.node, []

        def first() -> _Tensors:
            if not kept:
                kept.append(done())
                lo = len(kept[0]) - sum(len(self.plan.gathered(b)) for b in buckets)
                with step_scope(GATHER):
                    for b in buckets:
                        hi = lo + len(self.plan.gathered(b))
                        # row r keeps its node place's slice (selects: no index tensor copied to the device)
                        self.secondary[b] = tuple(
                            torch.stack([f.view(f.shape[0], node.world_size, -1).select(0, r).select(0, q)
                                         for r, q in enumerate(node.ranks)])
                            for f in kept[0][lo:hi])
                        lo = hi
            return kept[0]

        return first

    def take(self, bucket: int) -> _Tensors:
        if bucket not in self.ahead:
            self.start(bucket)
        return self.ahead.pop(bucket)()

    def event(self, event: int) -> None:
        """A unit call or the end (:data:`_END`): checked against the other ranks, the next unit's gather started."""
        self.verify()
        nxt = (self.events[-1] if self.events else 0) + 2  # the unit after the last one called: a chain of blocks
        if nxt >= len(self.plan.groups) or nxt in self.events or self.held(nxt):
            nxt = None
        prev = self.events[-1] if self.events else _NONE
        self.events.append(event)
        self.check.record(self.row, len(self.events) - 1, event)
        if self.check.tagged:
            self.pending = self.runner.submit(self.comm.overlaps, self.comm.all_gather_ints,
                                              (len(self.events), prev, event))
        # at the forward's end too (no rank knows yet if its peers call another unit): the same gather, dropped
        self.prefetch(nxt)
        if event == _END or not self.held(event):  # a unit's own gather starts only once its call is checked
            self.verify()
        if event == _END and nxt is not None:
            self.ahead.pop(nxt)()

    def verify(self) -> None:
        """Wait for the last event's tags and compare them (raises :class:`UnitCallError`)."""
        if self.pending is not None:
            tags, self.pending = self.pending(), None
            self.check.compare(tags)

    def bucket_tensors(self, bucket: int, track: bool = True) -> dict[str, torch.Tensor]:
        """Gather ``bucket`` through autograd: ``{name: view}``; ``track``: pack the views autograd saves as tokens."""
        if bucket and not self.expected[bucket]:
            self.order.append(bucket)
        self.expected[bucket] += 1
        flats = (*_Gather.apply(self.anchor, self, bucket), *self.frozen_flats)
        self.last_flats = tuple(f.detach() for f in flats)
        if track:
            for pos, flat in enumerate(flats):
                self.live[flat.untyped_storage().data_ptr()] = (bucket, pos, flat.storage_offset())
        return self.plan.views(bucket, flats, self.used)

    def bind(self, bucket: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Make ``tensors`` the unit's parameters (:attr:`released` puts the placeholders back)."""
        for table, attr, name in self.plan.unit_slots[bucket]:
            table[attr] = tensors[name]

    def pre_forward(self, bucket: int) -> None:
        if self.backward:  # a checkpointed unit recomputed through its __call__
            self.bind_for_backward(bucket)
            return
        # keep the last unit (and the one before while the last has yet to run) to its backward: two at most
        n = len(self.plan.groups)
        keep = bucket == n - 1 or (bucket == n - 2 and self.expected[n - 1] == 0)
        tensors = self.bucket_tensors(bucket, track=not keep)
        flats, self.last_flats = self.last_flats, ()
        if keep and bucket not in self.cache:
            self.cache[bucket] = flats
        self.bind(bucket, tensors)
        self.bound[bucket] = tensors

    def post_forward(self, bucket: int, out: Any) -> Any:
        if self.backward:
            return out
        self.bind(bucket, self.released)
        for t in self.bound.pop(bucket, {}).values():  # its saved views are no longer tokens
            self.live.pop(t.untyped_storage().data_ptr(), None)
        leaves, spec = tp.tree_flatten(out)
        idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not idx:
            return out
        new = _PreBackward.apply(self, bucket, *(leaves[i] for i in idx))  # one node for all outputs
        for i, x in zip(idx, new):
            leaves[i] = x
        return tp.tree_unflatten(leaves, spec)

    def regathered(self, bucket: int) -> _Tensors:
        """The bucket gathered again for backward (once; dropped when its gradient is complete)."""
        if bucket not in self.cache:
            self.cache[bucket] = self.take(bucket)
        return self.cache[bucket]

    def bind_for_backward(self, bucket: int) -> None:
        """Bind the unit's regathered parameters before autograd enters it; prefetch the unit backward reaches next."""
        flats, n = self.regathered(bucket), len(self.plan.groups[bucket])
        with torch.enable_grad():  # autograd runs backward with grad mode off
            tensors = self.plan.views(bucket, [f.detach().requires_grad_(i < n) for i, f in enumerate(flats)],
                                      self.used)
        self.bind(bucket, tensors)
        self.prefetch(self.before(bucket, 1))
        after = self.before(bucket, -1)
        if after is not None and not self.plan.groups[after]:  # a frozen unit (no gradient to await) is done
            self.cache.pop(after, None)
            self.bind(after, self.released)

    def before(self, bucket: int, k: int) -> int | None:
        """The unit ``k`` places before ``bucket`` in forward order (``k < 0``: after), if there is one."""
        i = self.order.index(bucket) if bucket in self.order else -1
        return self.order[i - k] if i >= 0 and 0 <= i - k < len(self.order) else None

    def held(self, bucket: int) -> bool:
        return bucket in self.cache or bucket in self.ahead  # gathered, or its gather on its way

    def prefetch(self, bucket: int | None) -> None:
        if bucket is not None and not self.held(bucket):
            self.start(bucket)

    def deliver(self, bucket: int, grads: _Tensors) -> None:
        prev = self.acc.get(bucket)
        self.acc[bucket] = grads if prev is None else tuple(a + g for a, g in zip(prev, grads))
        self.delivered[bucket] += 1
        if self.delivered[bucket] == self.expected[bucket]:
            self.cache.pop(bucket, None)
            self.ahead.pop(bucket, None)
            self.secondary.pop(bucket, None)
            self.bind(bucket, self.released)
            self.reduction.add(bucket, self.row, self.acc.pop(bucket))
            # prefetch the unit two before (backward reaches it after the next one) if the next is held: two at most
            after = self.before(bucket, 2)
            if after is not None and self.held(self.before(bucket, 1)):  # type: ignore[arg-type]
                self.prefetch(after)

    def pack(self, t: torch.Tensor) -> Any:
        hit = self.live.get(t.untyped_storage().data_ptr()) if t.layout == torch.strided else None
        if hit is None:
            return t
        bucket, pos, base = hit
        return _Token(bucket, pos, t.storage_offset() - base, tuple(t.size()), tuple(t.stride()))

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Token):
            return saved
        base = self.regathered(saved.bucket)[saved.pos].detach()
        return base.as_strided(saved.size, saved.stride, base.storage_offset() + saved.offset)

    def finish_rank(self) -> None:
        """Hand over buckets only some of whose uses were on the loss's path: the gradient of those."""
        for b, grads in list(self.acc.items()):
            self.reduction.add(b, self.row, grads)
        self.acc.clear()
        self.cache.clear()
        self.ahead.clear()
        self.secondary.clear()


def check_module_matches(module: torch.nn.Module, layout: Layout) -> None:
    """``ValueError`` if ``module``'s parameter names, shapes or dtypes differ from the state's (changed since)."""
    have = {n: (tuple(p.shape), p.dtype) for n, p in module.named_parameters()}
    for s in layout.slots:
        got, want = have.pop(s.path, None), (s.shape, s.dtype)
        if got != want:
            raise ValueError(f"stage 3: parameter {s.path!r} of the state is {want[0]} {want[1]}, but the module "
                             + (f"now has {got[0]} {got[1]}" if got else "has no such parameter")
                             + ": the module changed after init_train_state; build the state again")
    if have:
        raise ValueError(f"stage 3: the module has parameters the state does not know: {sorted(have)[:4]}; "
                         "the module changed after init_train_state; build the state again")


def unit_grads(loss_fn: ModuleLoss, state: TrainState, comm: Communicator, batch: Any,
               scaled: Callable[[torch.Tensor], torch.Tensor], on_ready: Callable[[FlatGrads], Sequence[torch.Tensor]],
               runner: Runner) -> tuple:
    """Stage 3's forward and backward of one micro-batch for every local rank: ``(shards, losses, buffers, rng, used,
    every)`` as :class:`fzero.grads.Grads`. Collectives, per rank, through ``runner``: the root's and every unit's
    gather in forward, again in backward but for the last two units, a tag per unit call on real ranks, ``on_ready`` per
    unit (the root's with the first unit's). Raises :class:`UnitCallError`, or ``ValueError`` if the module changed."""
    module, lay = loss_fn.module, state.layout
    units, dtype = state.module.units, state.precision.param_dtype
    check_module_matches(module, lay)
    plan = _Plan.of(lay, units, loss_fn)
    device = state.shard.master[0].device
    released = {}  # each unit parameter's placeholder (stage 3 shards every one): one element expanded, no memory
    for s in lay.slots:
        if s.bucket > 0:
            data = torch.empty((), dtype=compute_dtype(s, dtype), device=device).expand(s.shape)
            released[s.path] = torch.Tensor._make_subclass(_Released, data, False)
            released[s.path]._fzero_name = repr(s.path)
    # the root's gradient completes last (its embeddings ran first), just after the first unit's
    reduction = BucketReduction(plan.groups, on_ready, runner, comm.overlaps, comm.local_ranks,
                                [(0, 1)] + [(b,) for b in range(2, len(plan.groups))])
    check = _CallCheck(comm, ("", *units))
    rng = state.rng[0] if state.rng else None
    runs: dict[int, _RankRun] = {}
    running = [0]  # the row whose forward runs (rows in lockstep: each thread's own, fzero.lockstep)

    def run_now() -> _RankRun:
        at = current()
        return runs[at[1] if at is not None else running[0]]

    def one(r: int) -> tuple[torch.Tensor, list[float], list[torch.Tensor], list[torch.Tensor]]:
        running[0] = r
        run = runs[r] = _RankRun(plan, state, comm, r, reduction, runner, released, check)
        run.start(*((0, 1) if len(plan.groups) > 1 else (0,)))  # the root with the first unit
        bufs = [b[r].clone() for b in state.buffers]
        left: list[torch.Tensor] = []
        with rank_rng(rng[r] if rng is not None else None, device, left), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(run.pack, run.unpack):
            tensors = {**run.bucket_tensors(0, track=False), **released, **dict(zip(state.module.buffers, bufs))}
            with loss_fn.bound(tensors):
                loss = loss_fn.forward_loss(tensors, row_of(batch, r), dtype)
                check_loss(loss)
                loss = loss.to(torch.promote_types(loss.dtype, torch.float32))  # a float64 model's: float64
                run.event(_END)  # every rank called the same units: checked before backward
                run.backward = True
                torch.autograd.grad(scaled(loss), [run.anchor], allow_unused=True)
            del tensors
        run.finish_rank()
        return loss.detach(), [float(i in run.used) for i, s in enumerate(lay.slots) if s.group >= 0], bufs, left

    handles = []
    try:
        for b, m in enumerate(map(module.get_submodule, units), start=1):
            handles.append(m.register_forward_pre_hook(lambda mod, args, b=b: run_now().pre_forward(b)))
            handles.append(m.register_forward_hook(lambda mod, args, out, b=b: run_now().post_forward(b, out),
                                                   always_call=True))
        with comm.reusing_buffers():
            rows = run_rows(one, loss_fn, comm.local_ranks, device if rng is not None else None, False)
            shards = reduction.finish(device, dtype)
    finally:
        for h in handles:
            h.remove()
    losses, used, new_buffers = [row[0] for row in rows], [row[1] for row in rows], [row[2] for row in rows]
    new_rng = [row[3][0] for row in rows if row[3]]
    return (shards, torch.stack(losses), tuple(stack_rows(b) for b in zip(*new_buffers)),
            (stack_rows(new_rng),) if rng is not None else state.rng,
            used_flags(used, device), all(all(row) for row in used))


# -- compiled stage 3: hooks do not trace, so each unit's ``forward`` runs inside ``torch.utils.checkpoint`` with a
# selective policy (gather and views MUST_RECOMPUTE, the rest MUST_SAVE): the remat pass regathers before backward.

_REGATHER_OPS = frozenset({torch.ops.aten.repeat.default, torch.ops.aten._to_copy.default,
                           torch.ops.aten.clone.default})


def _regather_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    gather = getattr(op, "namespace", None) in ("_c10d_functional", "fzero") or getattr(op, "is_view", False)
    return CheckpointPolicy.MUST_RECOMPUTE if gather or op in _REGATHER_OPS else CheckpointPolicy.MUST_SAVE


def _regather_context() -> Any:
    return create_selective_checkpoint_contexts(_regather_policy)


def _backward_phase() -> Any:
    """Marks the graph nodes traced inside it as the step's backward (the remat pass's region)."""
    return torch.fx.traceback.annotate({"phase": "backward"})


class _GatherShard(torch.autograd.Function):
    """``master shard [shard_numel] -> flat buffer [padded]`` of one flat group; backward: ``on_ready`` of the grad."""

    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor, run: _CompiledRun,  # type: ignore[override]
                group: FlatGroup) -> torch.Tensor:
        ctx.run, ctx.group = run, group
        return all_gather_params(run.shard, run.comm, run.dtype, groups=(group,))[0][0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        with _backward_phase():
            return ctx.run.on_ready(FlatGrads((ctx.group,), (grad.unsqueeze(0),)))[0][0], None, None


class _CompiledRun:
    """What the unit forwards of one traced step need."""

    def __init__(self, plan: _Plan, shard: Any, leaves: Sequence[torch.Tensor], comm: Communicator,
                 dtype: torch.dtype | None, on_ready: Callable[[FlatGrads], Sequence[torch.Tensor]]):
        self.plan, self.shard, self.leaves, self.comm = plan, shard, leaves, comm
        self.dtype, self.on_ready = dtype, on_ready

    def gathered(self, bucket: int) -> dict[str, torch.Tensor]:
        """``{path: view}`` of the bucket's parameters, trainable ones gathered through autograd."""
        flats = (_GatherShard.apply(self.leaves[g.index], self, g) if g.opt_group >= 0 else
                 all_gather_params(self.shard, self.comm, self.dtype, groups=(g,))[0][0]
                 for g in self.plan.gathered(bucket))
        return self.plan.views(bucket, flats)  # lazily: each group gathered, then split

    def unit(self, bucket: int, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The unit's forward with its parameters gathered and bound (the checkpointed region)."""
        with _swapped(self.plan.unit_slots[bucket], self.gathered(bucket)):
            return forward(*args, **kwargs)


class CompiledUnits:
    """Compiled stage 3 (one local rank, one micro-batch): the unit forwards that gather and regather.
    ``installed(units)`` puts them on the units around a compiled call (the same objects each call: dynamo's guards
    hold)."""

    _NO_FORWARD = object()  # a unit without a forward of its own in its __dict__

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.run: _CompiledRun | None = None  # set inside the traced step only
        self._forwards: dict[str, Callable[..., Any]] = {}

    def _forward_of(self, bucket: int, own: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            run = self.run
            if run is None:  # not inside the step (a forward of the module by the user)
                return own(*args, **kwargs)
            return checkpoint(run.unit, bucket, own, *args, use_reentrant=False, context_fn=_regather_context, **kwargs)
        return forward

    @contextlib.contextmanager
    def installed(self, units: Sequence[str]) -> Any:
        put = []
        try:
            for b, name in enumerate(units, start=1):
                unit = self.module.get_submodule(name)
                prior = unit.__dict__.get("forward", self._NO_FORWARD)
                if name not in self._forwards:
                    own = prior if prior is not self._NO_FORWARD else type(unit).forward.__get__(unit)
                    self._forwards[name] = self._forward_of(b, own)
                unit.__dict__["forward"] = self._forwards[name]
                put.append((unit, prior))
            yield
        finally:
            for unit, prior in put:
                if prior is self._NO_FORWARD:
                    unit.__dict__.pop("forward", None)
                else:
                    unit.__dict__["forward"] = prior


def compiled_unit_grads(units_run: CompiledUnits, loss_fn: ModuleLoss, state: TrainState, comm: Communicator,
                        batch: Any, scaled: Callable[[torch.Tensor], torch.Tensor],
                        on_ready: Callable[[FlatGrads], Sequence[torch.Tensor]]) -> tuple:
    """Stage 3's forward and backward of one micro-batch inside a compiled step on one local rank, with ``units_run``'s
    forwards installed: ``(shards, losses, buffers, rng, used, every)``; the averaged shards are the gradients of
    master-shard leaves. Collectives: one ``all_gather`` per flat group in forward (the root's held) and again in
    backward for units whose backward reads them, ``on_ready`` per flat group where backward completes it."""
    lay, dtype = state.layout, state.precision.param_dtype
    plan = _Plan.of(lay, state.module.units, loss_fn)
    leaves = [m[0].detach().requires_grad_(True) for m in state.shard.master]
    # the gathers read the state's shards; the leaves only route each gradient (_GatherShard)
    run = _CompiledRun(plan, state.shard, leaves, comm, dtype, on_ready)
    bufs = [b[0].clone() for b in state.buffers]
    with torch.enable_grad():
        # a unit's parameter outside its unit: a NaN stand-in (no memory), so a use there turns the loss into NaN
        nan: dict[torch.dtype, torch.Tensor] = {}
        stand_ins = {}
        for s in lay.slots:
            if s.bucket > 0:
                dt = compute_dtype(s, dtype)
                nan.setdefault(dt, torch.full((), float("nan"), dtype=dt, device=leaves[0].device))
                stand_ins[s.path] = nan[dt].expand(s.shape)
        tensors = {**stand_ins, **run.gathered(0), **dict(zip(state.module.buffers, bufs))}
        units_run.run = run
        try:
            with loss_fn.bound(tensors, traced=True):
                loss = loss_fn.forward_loss(tensors, row_of(batch, 0), dtype)
                check_loss(loss)
                loss = loss.to(torch.promote_types(loss.dtype, torch.float32))  # a float64 model's: float64
                with _backward_phase():
                    grads = torch.autograd.grad(scaled(loss), leaves, allow_unused=True)
        finally:
            units_run.run = None
    shards = tuple((g if g is not None else torch.zeros_like(m[0])).unsqueeze(0)
                   for g, m in zip(grads, state.shard.master))
    # per flat group (known when tracing): a unit that ran used all its parameters, one that did not, none
    used = [[float(grads[s.group] is not None) for s in lay.slots if s.group >= 0]]
    return (shards, loss.detach().unsqueeze(0), tuple(b.unsqueeze(0) for b in bufs), state.rng,
            used_flags(used, leaves[0].device), all(used[0]))
