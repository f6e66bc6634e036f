"""ZeRO stage 3 for any ``nn.Module``: shard units chosen by a wrap policy, no recomputed forward.

A *wrap policy* picks submodules as shard units, as FSDP2 applies ``fully_shard`` to each
transformer block: module classes, or a predicate on ``(name, module)``; without one,
:func:`default_units` takes the blocks a ``transformers`` model names in ``_no_split_modules``.
Each unit's parameters form one bucket of the layout (bucket ``i + 1`` for unit ``i``); the
*root* (bucket 0) holds every parameter no unit claims and every tied one (FSDP2's common
ancestor). Units may not nest.

One local rank's forward and backward, eagerly (:func:`unit_grads`): every unit's parameters
come from :func:`fzero.all_gather_params` of its flat groups, run through the step's runner
(prefetched: a gather is started one unit ahead), and its gradient goes to the step's
``on_ready`` (:func:`fzero.reduce_scatter_grads`) as soon as backward completes it:

* the root is gathered once with the first unit and held until the rank's backward ends;
* a forward pre-hook binds views of the unit's gathered buffers as its parameters
  (:class:`_Gather`, an autograd function whose backward receives the unit's whole gradient);
  a forward hook puts :class:`_Released` placeholders back (any use raises);
* saved tensors that view a gathered unit are packed as tokens (saved-tensor hooks): after its
  forward nothing holds the unit (the last two units excepted: their backward follows soon);
* the unit's outputs pass through :class:`_PreBackward`, whose backward regathers the unit (or
  takes the prefetch), binds it (a checkpointed region recomputes from it) and prefetches the
  unit backward reaches next.

Every rank must call the same units in the same order (each gather is a collective all ranks
join): each call and the end of the forward are checked (:class:`_CallCheck`: on real ranks a
small all-gather of a tag per call, before any gather whose size depends on it), and a
difference raises :class:`UnitCallError` on every rank. Compiled (:class:`CompiledUnits`),
each unit regathers by selective recomputation in backward.

Peak gathered parameters per rank: the root and two units. Each unit's forward runs once, so
dropout draws once per step and stage 3 equals stage 2 bitwise.

Imports: ``fzero.buckets``, ``fzero.comm``, ``fzero.layout``, ``fzero.module``, ``fzero.rng``,
``fzero.sharding``, ``fzero.state``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.utils._pytree as tp

from .buckets import BucketReduction, Runner
from .comm import Communicator
from .layout import FlatGrads, FlatGroup, Layout, compute_dtype, split_views, stack_rows
from .module import ModuleLoss, UnitPolicy, check_loss, default_units, row_of, select_units, unit_buckets
from .rng import rank_rng
from .sharding import all_gather_params
from .state import TrainState

__all__ = ["UnitPolicy", "select_units", "default_units", "unit_buckets", "unit_grads", "UnitCallError",
           "CompiledUnits", "compiled_unit_grads"]

def _mark_used(used: set[int], slot: int, grad: torch.Tensor) -> None:
    """A view's gradient hook: its parameter had a gradient (a plain set: no cycle through the
    view's hooks back to the run that holds views)."""
    used.add(slot)


# Tensor metadata a module may read from a released parameter (HF models read
# ``self.dtype``/``self.device`` from their first parameter outside any unit).
_METADATA_GETTERS = frozenset({
    "shape", "dtype", "device", "requires_grad", "ndim", "layout", "is_cuda", "is_meta", "is_cpu",
    "is_sparse", "is_quantized", "is_nested", "is_leaf", "grad_fn", "grad", "names", "itemsize", "nbytes",
})
_METADATA_METHODS = frozenset({
    "size", "dim", "numel", "element_size", "is_floating_point", "is_complex", "__len__", "__hash__",
    "__repr__", "__format__", "nelement", "get_device", "type",
})


def _func_name(func: Any) -> str:
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") == "__get__" and owner is not None:
        return getattr(owner, "__name__", "")
    return getattr(func, "__name__", "")


class _Released(torch.Tensor):
    """A unit's parameter outside the unit's forward: metadata reads work, any use raises.

    Without it the module would still hold its original ``nn.Parameter``,
    and code using a unit's parameter from outside the unit would silently
    compute with the initial values.
    """

    _fzero_name: str = "?"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = _func_name(func)
        if name in _METADATA_GETTERS or name in _METADATA_METHODS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        found = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, _Released)]
        who = found[0]._fzero_name if found else "?"
        raise RuntimeError(
            f"fzero stage 3: parameter {who} was used ({name}) outside the forward of the unit that "
            "holds it: its gathered value exists only while that unit runs. Put the module that uses "
            "it in the same unit, or leave it to the root (choose units that do not contain it)"
        )


@dataclasses.dataclass(frozen=True)
class _Token:
    """A saved tensor that is a view of a gathered bucket: where it was, not what."""

    bucket: int
    pos: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Gather(torch.autograd.Function):
    """``anchor -> this rank's gathered flat buffers of one bucket`` (compute dtype, ``[padded]`` each).

    The all-gather happens in ``forward`` (on the master shards, outside
    autograd); ``backward`` receives the gradient of every flat buffer of the
    bucket at once, when autograd has it complete, and hands it to the run.
    """

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, run: "_RankRun", bucket: int) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.run, ctx.bucket = run, bucket
        return run.forward_flats(bucket)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, None, None]:  # type: ignore[override]
        ctx.run.deliver(ctx.bucket, grads)
        return None, None, None


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's output tensors; its backward runs before autograd enters the unit."""

    @staticmethod
    def forward(ctx: Any, run: "_RankRun", bucket: int, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.run, ctx.bucket = run, bucket
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.run.bind_for_backward(ctx.bucket)
        return (None, None, *grads)


def _before_backward(run: "_RankRun", bucket: int, out: Any) -> Any:
    """``out`` with its tensors that require grad passed through one :class:`_PreBackward`."""
    leaves, spec = tp.tree_flatten(out)
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not idx:
        return out
    new = _PreBackward.apply(run, bucket, *(leaves[i] for i in idx))
    for i, x in zip(idx, new):
        leaves[i] = x
    return tp.tree_unflatten(leaves, spec)


class UnitCallError(RuntimeError):
    """The ranks called different shard units, or in another order, in one stage-3 forward.

    ``call``: the 1-based index of the first unit call (of this micro-batch's forward) that
    differs; ``calls``: ``{rank: unit name, or None where the rank's forward called no
    further unit}``. Raised on every rank (and by the simulated world, which compares its
    ranks' calls) before any collective whose size depends on the differing call.
    """

    def __init__(self, call: int, calls: Mapping[int, Optional[str]]):
        self.call, self.calls = call, dict(calls)
        said = ", ".join(
            f"rank {r} " + (f"called unit {u!r}" if u is not None else "called no further unit (its forward ended)")
            for r, u in sorted(self.calls.items())
        )
        super().__init__(
            f"fzero stage 3: the ranks called different shard units at unit call {call} of the forward: {said}. "
            "Each unit's parameters are gathered by a collective every rank must join, so every rank must call "
            "the same units in the same order. Make a data-dependent module one unit as a whole (a "
            "mixture-of-experts layer, not each expert; the block that holds a branch), or leave it to the root"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.call, self.calls))


_END = 0  # the event "the forward called no further unit" (bucket 0, the root, is never called)
_NONE = -1  # no event (before the first)


def _encode_tag(values: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """int64 values as their bytes, one element each in ``dtype`` ([8 * len]): 0..255 is exact
    in every floating dtype (bf16 and fp16 included), so the tag survives any gather."""
    return torch.tensor(list(values), dtype=torch.int64).view(torch.uint8).to(dtype)


def _decode_tags(x: torch.Tensor) -> list[list[int]]:
    """``[W, 8 * n]`` received tags (any dtype) -> each rank's n int64 values."""
    return x.round().to(torch.uint8).contiguous().view(torch.int64).tolist()


class _CallCheck:
    """Checks that every rank calls the same units in the same order in one micro-batch's forward.

    The forward's *events* are its unit calls (bucket ``b >= 1``) and its end (:data:`_END`).
    On a real rank each event all-gathers the tag ``(index, previous event, event)``, checked
    before the next event and before any gather that depends on the event; in the simulated
    world the local ranks run one after another and each rank's events are compared with rank
    0's as they happen. ``names``: unit names by bucket (index 0 unused)."""

    def __init__(self, comm: Communicator, names: Sequence[str]):
        self.names, self.rows, self.ranks = names, comm.local_ranks, tuple(comm.ranks)
        self.tagged = self.rows == 1 and comm.world_size > 1  # a real rank among others
        self.reference: list[int] = []  # the simulated world's rank 0 events

    def name(self, event: int) -> Optional[str]:
        return None if event == _END else self.names[event]

    def record(self, row: int, index: int, event: int) -> None:
        """The simulated world: local rank ``row``'s event ``index`` against rank 0's."""
        if self.tagged or self.rows == 1:
            return
        if row == 0:
            self.reference.append(event)
            return
        ref = self.reference[index] if index < len(self.reference) else _END
        if ref != event:
            raise UnitCallError(index + 1, {self.ranks[0]: self.name(ref), self.ranks[row]: self.name(event)})

    def compare(self, tags: Sequence[Sequence[int]]) -> None:
        """A real rank: every rank's ``(index, previous event, event)``; the first index whose
        known events differ is named."""
        if all(list(t) == list(tags[0]) for t in tags):
            return
        known = [{i - 1: prev, i: e} for i, prev, e in tags]
        for i in sorted(set().union(*known)):
            seen = {r: k[i] for r, k in enumerate(known) if k.get(i, _NONE) != _NONE}
            if len(set(seen.values())) > 1:
                raise UnitCallError(i, {r: self.name(e) for r, e in seen.items()})
        raise UnitCallError(min(t[0] for t in tags), {r: self.name(t[2]) for r, t in enumerate(tags)})


def _tags(comm: Communicator, tag: Sequence[int]) -> list[list[int]]:
    return _decode_tags(comm.all_gather(_encode_tag(tag, torch.float32).unsqueeze(0)).view(comm.world_size, -1))


class _RankRun:
    """One local rank's forward and backward at stage 3: gathers, binds, packs and regathers."""

    def __init__(self, plan: "_Plan", state: TrainState, comm: Communicator, row: int, reduction: BucketReduction,
                 runner: Runner, unit_slots: Sequence[Sequence[tuple[dict, str, str]]],
                 released: Mapping[str, torch.Tensor], check: _CallCheck):
        self.plan, self.state, self.comm, self.row, self.reduction, self.runner = plan, state, comm, row, reduction, runner
        self.unit_slots, self.released, self.check = unit_slots, released, check
        self.events: list[int] = []  # this forward's unit calls, then _END
        self.pending: Optional[Callable[[], list[list[int]]]] = None  # the last event's tags, unchecked
        self.anchor = torch.zeros((), requires_grad=True)
        self.backward = False
        self.expected = [0] * len(plan.groups)
        self.delivered = [0] * len(plan.groups)
        self.acc: dict[int, tuple[torch.Tensor, ...]] = {}
        self.cache: dict[int, tuple[torch.Tensor, ...]] = {}  # arrived, held for backward
        self.live: dict[int, tuple[int, int, int]] = {}
        self.bound: dict[int, Mapping[str, torch.Tensor]] = {}
        self.ahead: dict[int, Callable[[], tuple[torch.Tensor, ...]]] = {}  # started gathers (prefetch)
        self.order: list[int] = []  # units in the order of their first forward
        self.last_flats: tuple[torch.Tensor, ...] = ()
        self.used: set[int] = set()  # slot indices whose view got a gradient

    def start(self, *buckets: int) -> None:
        """Start gathering ``buckets`` in one call of :func:`fzero.all_gather_params` through the
        runner (small groups travel in one collective); each bucket's started gather in
        :attr:`ahead` gives this rank's row of its flat buffers."""
        groups = [g for b in buckets for g in self.plan.groups[b]]
        done = self.runner.submit(self.comm.overlaps, all_gather_params, self.state.shard, self.comm,
                                  self.state.precision.param_dtype, groups=groups)
        lo = 0
        for b in buckets:
            hi = lo + len(self.plan.groups[b])
            self.ahead[b] = lambda lo=lo, hi=hi: tuple(f[self.row] for f in done()[lo:hi])
            lo = hi

    def take(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """The bucket's flat buffers: its started gather, or one started now."""
        if bucket not in self.ahead:
            self.start(bucket)
        return self.ahead.pop(bucket)()

    def forward_flats(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """The bucket for its forward; a unit's call starts the gather of the unit predicted
        next (:meth:`event`). The root's gather starts with the first unit's (:func:`unit_grads`)."""
        if bucket and not self.backward:
            self.event(bucket)
        return self.take(bucket)

    def predicted(self) -> Optional[int]:
        """The unit to prefetch at the next event: the one after the unit the last checked event
        called (a chain of blocks), unless called already or held: the same on every rank."""
        last = self.events[-1] if self.events else 0
        nxt = last + 2 if last + 2 < len(self.plan.groups) else None
        return None if nxt is None or nxt in self.events or self.held(nxt) else nxt

    def event(self, event: int) -> None:
        """A unit call (its bucket) or the end of the forward (:data:`_END`): checked against the
        other ranks, and the predicted unit's gather started. The previous event's tags are
        compared first, so the prefetch has the same size everywhere; a call of a unit that is
        not held is compared before its own gather starts."""
        self.verify()
        nxt = self.predicted()
        prev = self.events[-1] if self.events else _NONE
        self.events.append(event)
        self.check.record(self.row, len(self.events) - 1, event)
        if self.check.tagged:
            self.pending = self.runner.submit(self.comm.overlaps, _tags, self.comm, (len(self.events), prev, event))
        if nxt is not None:
            # the same gather on every rank (chosen from checked events), also at the end of the
            # forward, where no rank knows yet whether its peers called another unit: dropped then
            self.prefetch(nxt)
        if event == _END or not self.held(event):
            self.verify()
        if event == _END and nxt is not None:
            self.ahead.pop(nxt)()

    def verify(self) -> None:
        """Wait for the last event's tags and compare them (raises :class:`UnitCallError`)."""
        if self.pending is not None:
            tags, self.pending = self.pending(), None
            self.check.compare(tags)

    def bucket_tensors(self, bucket: int, track: bool = True) -> dict[str, torch.Tensor]:
        """Gather ``bucket`` through autograd: ``{name: view}`` of its trainable parameters.
        ``track``: pack the views autograd saves as tokens (a unit's, not the root's)."""
        if not self.backward:
            if bucket and not self.expected[bucket]:
                self.order.append(bucket)
            self.expected[bucket] += 1
        flats = _Gather.apply(self.anchor, self, bucket)
        self.last_flats = tuple(f.detach() for f in flats)
        if track:
            for pos, flat in enumerate(flats):
                self.live[flat.untyped_storage().data_ptr()] = (bucket, pos, flat.storage_offset())
        return self._views(bucket, flats)

    def bind(self, bucket: int, tensors: Mapping[str, torch.Tensor]) -> None:
        for table, attr, name in self.unit_slots[bucket]:
            table[attr] = tensors[name]

    def unbind(self, bucket: int) -> None:
        for table, attr, name in self.unit_slots[bucket]:
            table[attr] = self.released[name]

    def pre_forward(self, bucket: int) -> None:
        if self.backward:  # a checkpointed unit recomputed through its __call__
            self.bind_for_backward(bucket)
            return
        # the last unit, and the one before it while the last has yet to run, are kept from
        # their forward to their backward: at most two units held at once
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
        self.unbind(bucket)
        for t in self.bound.pop(bucket, {}).values():  # its saved views are no longer tokens
            self.live.pop(t.untyped_storage().data_ptr(), None)
        return _before_backward(self, bucket, out)

    def regathered(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """The bucket gathered again for backward (once; dropped when its gradient is complete)."""
        flats = self.cache.get(bucket)
        if flats is None:
            flats = self.cache[bucket] = self.take(bucket)
        return flats

    def bind_for_backward(self, bucket: int) -> None:
        """Bind the unit's regathered parameters before autograd enters it (a checkpointed
        forward recomputed in backward finds them), and prefetch the unit backward reaches next."""
        flats = self.regathered(bucket)
        with torch.enable_grad():  # autograd runs backward with grad mode off
            tensors = self._views(bucket, [f.detach().requires_grad_(True) for f in flats])
        self.bind(bucket, tensors)
        self.prefetch(self.before(bucket, 1))

    def before(self, bucket: int, k: int) -> Optional[int]:
        """The unit ``k`` places before ``bucket`` in forward order, if there is one."""
        i = self.order.index(bucket) if bucket in self.order else -1
        return self.order[i - k] if i >= k else None

    def held(self, bucket: int) -> bool:
        """Gathered and kept, or its gather on its way."""
        return bucket in self.cache or bucket in self.ahead

    def prefetch(self, bucket: Optional[int]) -> None:
        if bucket is not None and not self.held(bucket):
            self.start(bucket)

    def _views(self, bucket: int, flats: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{path: view}`` of the bucket's trainable parameters by one ``split`` per flat buffer
        (its backward is one ``cat``, not a zero-filled flat gradient per view)."""
        tensors, lay = {}, self.plan.layout
        for g, flat in zip(self.plan.groups[bucket], flats):
            for i, view in zip(g.slots, split_views(lay, g, flat)):
                if view.requires_grad:
                    view.register_hook(functools.partial(_mark_used, self.used, i))
                tensors[lay.slots[i].path] = view
        return tensors

    def deliver(self, bucket: int, grads: tuple[torch.Tensor, ...]) -> None:
        prev = self.acc.get(bucket)
        self.acc[bucket] = grads if prev is None else tuple(a + g for a, g in zip(prev, grads))
        self.delivered[bucket] += 1
        if self.delivered[bucket] == self.expected[bucket]:
            self.cache.pop(bucket, None)
            self.ahead.pop(bucket, None)
            self.unbind(bucket)
            self.reduction.add(bucket, self.row, self.acc.pop(bucket))
            # the unit two before this one in forward order, whose backward comes after the
            # next one's, if the next is held or on its way: two units at most
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
        """Hand over what this rank's backward never delivered whole (a bucket some of whose
        uses were not on the loss's path: the gradient of the uses that were)."""
        for b, grads in list(self.acc.items()):
            self.reduction.add(b, self.row, grads)
        self.acc.clear()
        self.cache.clear()
        self.ahead.clear()


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static: the layout and its flat groups per bucket (root first, then each unit)."""

    layout: Layout
    groups: tuple[tuple[FlatGroup, ...], ...]

    @staticmethod
    def of(layout: Layout, units: Sequence[str]) -> "_Plan":
        return _Plan(layout, tuple(tuple(g for g in layout.groups if g.bucket == b) for b in range(len(units) + 1)))


def _unit_slots(plan: _Plan, loss_fn: ModuleLoss) -> list[list[tuple[dict, str, str]]]:
    """Per bucket, where each of its trainable parameters is registered in the module."""
    bucket_of = {s.path: s.bucket for s in plan.layout.slots if s.group >= 0}
    out: list[list[tuple[dict, str, str]]] = [[] for _ in plan.groups]
    for table, attr, name in loss_fn._slots:
        if bucket_of.get(name):
            out[bucket_of[name]].append((table, attr, name))
    return out


def check_module_matches(module: torch.nn.Module, layout: Layout) -> None:
    """Raise ``ValueError`` if ``module``'s parameters are no longer those the state was built
    from (names, shapes, dtypes): a layer replaced or resized after ``init_train_state``."""
    have = {n: (tuple(p.shape), p.dtype) for n, p in module.named_parameters()}
    for s in layout.slots:
        got = have.pop(s.path, None)
        if got != (s.shape, s.dtype):
            raise ValueError(f"stage 3: parameter {s.path!r} of the state is {s.shape} {s.dtype}, but the module "
                             + (f"now has {got[0]} {got[1]}" if got else "has no such parameter")
                             + ": the module changed after init_train_state; build the state again")
    if have:
        raise ValueError(f"stage 3: the module has parameters the state does not know: {sorted(have)[:4]}; "
                         "the module changed after init_train_state; build the state again")


def unit_grads(loss_fn: ModuleLoss, state: TrainState, comm: Communicator, batch: Any,
               scaled: Callable[[torch.Tensor], torch.Tensor], on_ready: Callable[[FlatGrads], Sequence[torch.Tensor]],
               runner: Runner) -> tuple:
    """Stage 3's forward and backward of one micro-batch for every local rank (module doc):
    ``(shards, losses, buffers, rng, used, every)`` as :class:`fzero.grads.Grads`.
    Collectives, per rank: the root's and every unit's gather in forward, again in backward
    but for the last two units, a tag per unit call on real ranks, and ``on_ready`` per unit
    (the root's with the first unit's), all through ``runner``."""
    module, lay = loss_fn.module, state.layout
    units, dtype = state.module.units, state.precision.param_dtype
    check_module_matches(module, lay)
    plan = _Plan.of(lay, units)
    unit_slots = _unit_slots(plan, loss_fn)
    device = state.shard.master[0].device
    released = {s.path: _released(s.path, s.shape, compute_dtype(s, dtype), device)
                for s in lay.slots if s.group >= 0 and s.bucket > 0}
    frozen = {s.path: f.to(compute_dtype(s, dtype)) for s, f in zip(lay.frozen_slots, state.shard.frozen)}
    # the root's gradient completes last (its embeddings ran first), just after the first unit's
    reduction = BucketReduction(plan.groups, on_ready, runner, comm.overlaps, comm.local_ranks,
                                [(0, 1)] + [(b,) for b in range(2, len(plan.groups))])
    losses, new_rng, used, new_buffers = [], [], [], [[] for _ in state.buffers]
    train_index = [i for i, s in enumerate(lay.slots) if s.group >= 0]
    unit_modules = [module.get_submodule(u) for u in units]
    check = _CallCheck(comm, ("", *units))
    rng = state.rng[0] if state.rng else None
    with comm.reusing_buffers():
        for r in range(comm.local_ranks):
            run = _RankRun(plan, state, comm, r, reduction, runner, unit_slots, released, check)
            run.start(*((0, 1) if len(plan.groups) > 1 else (0,)))  # the root with the first unit
            bufs = [b[r].clone() for b in state.buffers]
            handles = []
            try:
                for b, m in enumerate(unit_modules, start=1):
                    handles.append(m.register_forward_pre_hook(lambda mod, args, b=b: run.pre_forward(b)))
                    handles.append(m.register_forward_hook(
                        lambda mod, args, out, b=b: run.post_forward(b, out), always_call=True))
                with rank_rng(rng[r] if rng is not None else None, device, new_rng), torch.enable_grad(), \
                        torch.autograd.graph.saved_tensors_hooks(run.pack, run.unpack):
                    tensors = {**run.bucket_tensors(0, track=False), **frozen, **released,
                               **dict(zip(state.module.buffers, bufs))}
                    with loss_fn.bound(tensors):
                        loss = loss_fn.forward_loss(tensors, row_of(batch, r), dtype)
                        check_loss(loss)
                        loss = loss.float()
                        run.event(_END)  # every rank called the same units: checked before backward
                        run.backward = True
                        torch.autograd.grad(scaled(loss), [run.anchor], allow_unused=True)
                    del tensors
                run.finish_rank()
                used.append([float(i in run.used) for i in train_index])
            finally:
                for h in handles:
                    h.remove()
            losses.append(loss.detach())
            for i, b in enumerate(bufs):
                new_buffers[i].append(b)
        shards = reduction.finish(device, dtype)
    return (shards, torch.stack(losses), tuple(stack_rows(b) for b in new_buffers),
            (stack_rows(new_rng),) if rng is not None else state.rng,
            torch.tensor(used, dtype=torch.float64, device=device), all(all(row) for row in used))


def _released(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A placeholder with the parameter's shape, ``dtype`` and device, holding one element."""
    data = torch.empty((), dtype=dtype, device=device).expand(shape)  # a 0-d element expands to any shape
    out = torch.Tensor._make_subclass(_Released, data, False)
    out._fzero_name = repr(name)
    return out


# -- compiled stage 3: each unit gathered in its forward, regathered in backward ------------------
#
# Hooks do not trace. While a compiled step runs, each unit's ``forward`` is replaced
# (:meth:`CompiledUnits.installed`) by one that runs the unit inside ``torch.utils.checkpoint``
# with a selective policy: the region gathers the unit's flat groups (:class:`_GatherShard`),
# binds views of them as the unit's parameters and runs the unit's own forward. The policy marks
# the gather (collectives, casts, copies) and every view MUST_RECOMPUTE and the unit's compute
# MUST_SAVE; AOT autograd's remat pass for a forward-loss-backward graph
# (``remat_using_tags_for_fwd_loss_bwd_graph``) then drops the gathered buffer after the unit's
# forward and gathers it again just before the backward that reads it. The gather's backward
# hands the unit's gradient to the step's ``on_ready`` as soon as autograd has it whole.


def _regather_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if getattr(op, "namespace", None) in ("_c10d_functional", "fzero") or getattr(op, "is_view", False) \
            or op in _REGATHER_OPS:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


_REGATHER_OPS = frozenset({torch.ops.aten.repeat.default, torch.ops.aten._to_copy.default,
                           torch.ops.aten.clone.default})


def _regather_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_regather_policy)


def _backward_phase() -> Any:
    """Marks the graph nodes traced inside it as the step's backward (the remat pass's region)."""
    return torch.fx.traceback.annotate({"phase": "backward"})


class _GatherShard(torch.autograd.Function):
    """``master shard [shard_numel] -> the rank's flat buffer [padded]`` of one flat group
    (:func:`fzero.all_gather_params`); backward: the step's ``on_ready`` of its gradient, this
    rank's averaged shard. Pure: it traces."""

    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor, run: "_CompiledRun", group: FlatGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.run, ctx.group = run, group
        return all_gather_params(run.shard, run.comm, run.dtype, groups=(group,))[0][0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        with _backward_phase():
            return ctx.run.on_ready(FlatGrads((ctx.group,), (grad.unsqueeze(0),)))[0][0], None, None


class _CompiledRun:
    """What the unit forwards of one traced step need: the leaves' shard, the plan, the comm."""

    def __init__(self, plan: _Plan, shard: Any, leaves: Sequence[torch.Tensor], comm: Communicator,
                 dtype: Optional[torch.dtype], on_ready: Callable[[FlatGrads], Sequence[torch.Tensor]],
                 unit_slots: Sequence[Sequence[tuple[dict, str, str]]]):
        self.plan, self.shard, self.leaves, self.comm = plan, shard, leaves, comm
        self.dtype, self.on_ready, self.unit_slots = dtype, on_ready, unit_slots

    def gathered(self, bucket: int) -> dict[str, torch.Tensor]:
        """``{path: view}`` of the bucket's trainable parameters, gathered through autograd."""
        lay, tensors = self.plan.layout, {}
        for g in self.plan.groups[bucket]:
            flat = _GatherShard.apply(self.leaves[g.index], self, g)
            for i, view in zip(g.slots, split_views(lay, g, flat)):
                tensors[lay.slots[i].path] = view
        return tensors

    def unit(self, bucket: int, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The unit's forward with its parameters gathered and bound (the checkpointed region)."""
        tensors = self.gathered(bucket)
        saved = []
        for table, attr, name in self.unit_slots[bucket]:
            saved.append((table, attr, table[attr]))
            table[attr] = tensors[name]
        try:
            return forward(*args, **kwargs)
        finally:
            for table, attr, old in reversed(saved):
                table[attr] = old


_NO_FORWARD = object()


class CompiledUnits:
    """Compiled stage 3 on one rank (one local rank, one micro-batch): the unit forwards that
    gather and regather; :func:`compiled_unit_grads` runs the step's forward and backward with
    them. ``installed(units)`` puts them on the unit modules around a compiled call (the same
    function objects every call, so dynamo's guards hold) and restores the modules' own after."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.run: Optional[_CompiledRun] = None  # set inside the traced step only
        self._forwards: dict[str, Callable[..., Any]] = {}

    def _forward_of(self, bucket: int, own: Callable[..., Any]) -> Callable[..., Any]:
        from torch.utils.checkpoint import checkpoint

        def forward(*args: Any, **kwargs: Any) -> Any:
            run = self.run
            if run is None:  # not inside the step (a forward of the module by the user)
                return own(*args, **kwargs)
            return checkpoint(run.unit, bucket, own, *args, use_reentrant=False,
                              context_fn=_regather_context, **kwargs)

        return forward

    @contextlib.contextmanager
    def installed(self, units: Sequence[str]) -> Any:
        put = []
        try:
            for b, name in enumerate(units, start=1):
                unit = self.module.get_submodule(name)
                prior = unit.__dict__.get("forward", _NO_FORWARD)
                if name not in self._forwards:
                    own = prior if prior is not _NO_FORWARD else type(unit).forward.__get__(unit)
                    self._forwards[name] = self._forward_of(b, own)
                unit.__dict__["forward"] = self._forwards[name]
                put.append((unit, prior))
            yield
        finally:
            for unit, prior in put:
                if prior is _NO_FORWARD:
                    unit.__dict__.pop("forward", None)
                else:
                    unit.__dict__["forward"] = prior


def compiled_unit_grads(units_run: CompiledUnits, loss_fn: ModuleLoss, state: TrainState, comm: Communicator,
                        batch: Any, scaled: Callable[[torch.Tensor], torch.Tensor],
                        on_ready: Callable[[FlatGrads], Sequence[torch.Tensor]]) -> tuple:
    """Stage 3's forward and backward of one micro-batch inside a compiled step on one local
    rank, with ``units_run``'s forwards installed: ``(shards, losses, buffers, rng, used, every)``.
    Every flat group's master shard is a leaf; the root is gathered first and held, each unit
    in its forward and again in backward, each reduced (``on_ready``) where backward completes
    it: ``torch.autograd.grad`` of the scaled loss with respect to the leaves gives the
    averaged shards. Collectives: one ``all_gather`` per flat group in forward and again in
    backward for units whose backward reads them, ``on_ready`` per flat group."""
    lay, dtype = state.layout, state.precision.param_dtype
    plan = _Plan.of(lay, state.module.units)
    leaves = [m[0].detach().requires_grad_(True) for m in state.shard.master]
    # the gathers read the state's shards; the leaves only route each gradient (_GatherShard)
    run = _CompiledRun(plan, state.shard, leaves, comm, dtype, on_ready, _unit_slots(plan, loss_fn))
    frozen = {s.path: f.to(compute_dtype(s, dtype)) for s, f in zip(lay.frozen_slots, state.shard.frozen)}
    bufs = [b[0].clone() for b in state.buffers]
    with torch.enable_grad():
        # outside its unit's forward a unit's parameter is a NaN stand-in of its shape and compute
        # dtype (no memory): a use outside the unit (not allowed) turns the loss into NaN
        nan: dict[torch.dtype, torch.Tensor] = {}
        stand_ins = {}
        for s in lay.slots:
            if s.group >= 0 and s.bucket > 0:
                dt = compute_dtype(s, dtype)
                nan.setdefault(dt, torch.full((), float("nan"), dtype=dt, device=leaves[0].device))
                stand_ins[s.path] = nan[dt].expand(s.shape)
        tensors = {**stand_ins, **run.gathered(0), **frozen, **dict(zip(state.module.buffers, bufs))}
        units_run.run = run
        try:
            with loss_fn.bound(tensors, traced=True):
                loss = loss_fn.forward_loss(tensors, row_of(batch, 0), dtype)
                check_loss(loss)
                loss = loss.float()
                with _backward_phase():
                    grads = torch.autograd.grad(scaled(loss), leaves, allow_unused=True)
        finally:
            units_run.run = None
    shards = tuple((g if g is not None else torch.zeros_like(m[0])).unsqueeze(0)
                   for g, m in zip(grads, state.shard.master))
    # which parameters had a gradient, per flat group (known when tracing): a unit that did not
    # run has none; inside a unit that ran every parameter counts as used
    used = [[float(grads[s.group] is not None) for s in lay.slots if s.group >= 0]]
    return (shards, loss.detach().unsqueeze(0), tuple(b.unsqueeze(0) for b in bufs), state.rng,
            torch.tensor(used, dtype=torch.float64, device=leaves[0].device), all(used[0]))
