"""ZeRO stage 3 for any ``nn.Module``: shard units chosen by a wrap policy, no recomputed forward.

A *wrap policy* picks submodules as shard units, as FSDP2 applies
``fully_shard`` to each transformer block: module classes, or a predicate on
``(name, module)``. Each unit's parameters form one bucket of the flat layout
(bucket ``i + 1`` for unit ``i``); the *root* (bucket 0) holds every
parameter no unit claims, and every parameter registered under several units
or under a unit and outside it (tied weights: GPT-2's ``wte``/``lm_head``),
FSDP2's rule of the common ancestor. Units may not nest. Without a policy,
:func:`default_units` takes the blocks a ``transformers`` model names in
``_no_split_modules``.

Every rank must call the same units in the same order (each unit's gather is a
collective all ranks join): each call, and the end of the forward, is checked
against the other ranks by a tag riding on a gather the call starts anyway
(:class:`_CallCheck`), and a difference raises :class:`UnitCallError` on every rank.

One local rank's forward and backward (:func:`unit_grads`):

* the root bucket is all-gathered once, with the first unit, and held until the
  rank's backward ends;
* a forward pre-hook on each unit all-gathers the unit's bucket (compute
  dtype) through :class:`_Gather`, an autograd function, and binds views of it
  as the unit's parameters; a forward hook unbinds them (they become
  :class:`_Released` placeholders that raise if used);
* every tensor autograd saves for backward that is a view of a gathered unit
  is packed as a *token* (saved-tensor hooks): after its forward, nothing holds
  the unit's gathered parameters (the last two units excepted: their backward
  follows soon, so they are kept);
* the unit's outputs pass through :class:`_PreBackward`, whose backward runs
  before autograd enters the unit: it gathers the unit again (or takes the
  prefetched gather), binds it, and starts the gather of the unit before it;
  tokens are unpacked as views of that buffer;
* when autograd has the gradient of the whole bucket, it calls
  ``_Gather.backward`` with it: that is the moment the bucket's gradient is
  complete. Once every local rank has delivered it, its average over ranks is
  started (``reduce_scatter``, waited for after backward; on a real rank that
  is during backward, unit by unit); the unit is dropped, and the gather of
  the unit backward reaches after the next one starts with the reduction, in
  one collective where the communicator can carry both
  (``Communicator.batched``: gloo's all-to-all).

In the simulated world the local ranks run in turn and each gathers its units
for itself (``all_gather`` of all rows, keeping its own): W collectives where W
real ranks run one together, a cost of simulating only.

So a unit's forward runs once: no recompute, and dropout draws once per step.
Activation checkpointing composes: a checkpointed region recomputed in
backward finds the unit bound by ``_PreBackward`` (``torch.utils.checkpoint``
restores the generator, so the masks are the same).

Peak gathered parameters per rank: the root and two units (the running one and
the prefetched one). Gradients: one bucket at a time on a real rank (the
simulated world keeps each rank's bucket gradients until the last rank has
delivered them).

Imports: ``fzero.comm``, ``fzero.layout``, ``fzero.buckets``, ``fzero.sharding``, ``fzero.module``, ``fzero.rng``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.utils._pytree as tp

from . import scratch
from .comm import Communicator
from .layout import FlatGroup, Layout, compute_dtype, split_views
from .module import ModuleLoss, check_loss, row_of
from .rng import rank_rng
from .buckets import BucketReduction
from .scopes import GATHER, step_scope
from .sharding import ShardState, gather_flat_groups_start, stack_rows

__all__ = ["UnitPolicy", "select_units", "default_units", "unit_buckets", "unit_grads", "UnitGrads",
           "UnitCallError", "CompiledUnits", "compiled_unit_grads"]

UnitPolicy = Union[type, tuple, Callable[[str, torch.nn.Module], bool]]


def _predicate(policy: UnitPolicy) -> Callable[[str, torch.nn.Module], bool]:
    if isinstance(policy, type):
        policy = (policy,)
    if isinstance(policy, (tuple, list, set, frozenset)):
        classes = tuple(policy)
        if not classes:
            raise ValueError(
                f"units={policy!r} is empty: give module classes, e.g. units=(TransformerBlock,), a predicate "
                "(name, module) -> bool, or leave units out for a transformers model (its _no_split_modules)"
            )
        wrong = [c for c in classes if not (isinstance(c, type) and issubclass(c, torch.nn.Module))]
        if wrong:
            raise TypeError(
                f"units: {wrong[0]!r} ({type(wrong[0]).__name__}) is not an nn.Module class; give module classes, "
                "e.g. units=(TransformerBlock,), or a predicate (name, module) -> bool"
            )
        return lambda name, module: isinstance(module, classes)
    if callable(policy):
        return policy
    raise TypeError(f"units: expected module classes or a predicate (name, module) -> bool, got {policy!r}")


def select_units(module: torch.nn.Module, policy: UnitPolicy) -> tuple[str, ...]:
    """The names of the submodules ``policy`` makes shard units, in ``named_modules`` order.

    Units without parameters are left out (nothing to shard). Raises
    ``ValueError`` if the policy selects no submodule with parameters, or
    selects a module inside another unit (units may not nest: say which two).
    """
    pred = _predicate(policy)
    chosen = []
    for name, m in module.named_modules():
        if name and pred(name, m) and any(True for _ in m.parameters()):
            chosen.append(name)
    if not chosen:
        raise ValueError(
            f"units: the wrap policy selects no submodule with parameters of {type(module).__name__} "
            "(the root itself cannot be a unit); e.g. units=(TransformerBlock,) or "
            "units=lambda name, m: name.startswith('layers.')"
        )
    for i, outer in enumerate(chosen):
        for inner in chosen[i + 1 :]:
            if inner.startswith(outer + "."):
                raise ValueError(
                    f"units: {inner!r} lies inside unit {outer!r}; units may not nest: choose one of "
                    "them (e.g. only the transformer blocks)"
                )
    return tuple(chosen)


def default_units(module: torch.nn.Module) -> tuple[str, ...]:
    """The default wrap policy: the submodules whose class name a ``transformers`` model lists
    in ``_no_split_modules`` (its blocks: what accelerate's FSDP auto-wrap wraps), outermost
    only, in ``named_modules`` order (units without parameters left out).

    Raises ``ValueError`` saying what to pass (``units=``) for a module that names no blocks,
    or whose named blocks are not among its submodules."""
    names = getattr(module, "_no_split_modules", None)
    names = {names} if isinstance(names, str) else set(names or ())
    if not names:
        raise ValueError(
            f"init_train_state: stage 3 needs the model's shard units, and {type(module).__name__} names no "
            "blocks (no _no_split_modules, as transformers models have): pass units=(BlockClass,) or "
            "units=lambda name, module: ..., as FSDP2's fully_shard per block"
        )
    chosen: list[str] = []
    for name, m in module.named_modules():
        if not name or type(m).__name__ not in names or any(name.startswith(c + ".") for c in chosen):
            continue
        if any(True for _ in m.parameters()):
            chosen.append(name)
    if not chosen:
        raise ValueError(
            f"init_train_state: stage 3 needs the model's shard units, and none of {type(module).__name__}'s "
            f"_no_split_modules {sorted(names)} is a submodule with parameters: pass units=(BlockClass,) or "
            "units=lambda name, module: ..."
        )
    return tuple(chosen)


def _unit_of(name: str, units: Sequence[str]) -> Optional[int]:
    for i, u in enumerate(units):
        if name.startswith(u + "."):
            return i
    return None


def unit_buckets(module: torch.nn.Module, units: Sequence[str]) -> dict[str, int]:
    """``{parameter name: bucket}`` (``named_parameters`` names): unit ``i`` is bucket
    ``i + 1``; bucket 0, the root, takes a parameter no unit claims and one
    registered under names in more than one place (tied)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    out = {}
    for name, p in module.named_parameters():
        owners = {_unit_of(n, units) for n in names[id(p)]}
        only = owners.pop() if len(owners) == 1 else None
        out[name] = 0 if only is None else only + 1
    return out


@dataclasses.dataclass
class UnitGrads:
    """What one micro-batch's stage-3 forward and backward gives.

    ``shards``: per flat group, this rank's averaged (still scaled) gradient
    shard ``[R, shard_numel]`` in the master dtype; ``losses`` ``[R]`` fp32;
    ``buffers`` and ``rng`` as :class:`fzero.grads.Grads`.
    """

    shards: tuple[torch.Tensor, ...]
    losses: torch.Tensor
    buffers: tuple[torch.Tensor, ...]
    rng: tuple[torch.Tensor, ...]
    used: Optional[torch.Tensor] = None  # [R, T] float64: 1 where the rank had a gradient
    every: bool = False  # every trainable parameter had a gradient on every local rank (known in Python)


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


def _start_gather(plan: "_Plan", shard: ShardState, comm: Communicator, row: int, dtype: Optional[torch.dtype],
                  buckets: Sequence[int]) -> dict[int, Callable[[], tuple[torch.Tensor, ...]]]:
    """Start gathering ``buckets`` in one ``all_gather`` (compute ``dtype``); per bucket a
    function that waits and gives local rank ``row``'s row of its flat buffers."""
    groups = [g for b in buckets for g in plan.groups[b]]
    with step_scope(GATHER):
        started = gather_flat_groups_start(shard, groups, comm, dtype)
    got: list[tuple[torch.Tensor, ...]] = []

    def arrived(lo: int, hi: int) -> tuple[torch.Tensor, ...]:
        if not got:
            with step_scope(GATHER):
                got.append(started())
        return tuple(f[row] for f in got[0][lo:hi])

    out, lo = {}, 0
    for b in buckets:
        hi = lo + len(plan.groups[b])
        out[b] = lambda lo=lo, hi=hi: arrived(lo, hi)
        lo = hi
    return out


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


def _start_tagged(plan: "_Plan", shard: ShardState, comm: Communicator, dtype: Optional[torch.dtype],
                  bucket: Optional[int], tag: Sequence[int]
                  ) -> tuple[dict[int, Callable[[], tuple[torch.Tensor, ...]]], Callable[[], list[list[int]]]]:
    """A real rank's carrier (one local rank): start gathering ``bucket`` (or nothing) with
    ``tag`` prepended to the payload of its first collective. Returns ``({bucket: waiting
    function of its flat buffers}, waiting function of every rank's tag)``.

    Its size depends only on ``bucket``, which every rank chose from calls already agreed, so
    ranks whose latest call differs still join a collective of one size: the tag, not gloo's
    size check, tells them. Groups of another travel dtype than the first go in a collective
    of their own (untagged). The received buffer is cut into the flat buffers (one copy)."""
    groups = plan.groups[bucket] if bucket is not None else ()
    travel = compute_dtype(groups[0], dtype) if groups else torch.float32
    first = [g for g in groups if compute_dtype(g, dtype) == travel]
    rest = [g for g in groups if compute_dtype(g, dtype) != travel]
    with step_scope(GATHER):
        code = _encode_tag(tag, travel).unsqueeze(0)
        joined = comm.all_gather_start(scratch.cat([code, *(shard.master[g.index].to(travel) for g in first)], dim=1))
        others = gather_flat_groups_start(shard, rest, comm, dtype) if rest else (lambda: ())
    got: list[torch.Tensor] = []
    decoded: list[list[list[int]]] = []
    world, t = comm.world_size, code.shape[1]

    def received() -> torch.Tensor:
        if not decoded:
            with step_scope(GATHER):
                got.append(joined().view(world, -1))
                decoded.append(_decode_tags(got[0][:, :t]))
        return got[0]

    def tags() -> list[list[int]]:
        if not decoded:
            received()
            if not groups:
                got.clear()
        return decoded[0]

    def flats() -> tuple[torch.Tensor, ...]:
        full, out, offset = received(), {}, t
        with step_scope(GATHER):
            for g in first:
                out[g.index] = scratch.reshaped(full[:, offset : offset + g.shard_numel], (g.padded_numel,))
                offset += g.shard_numel
            for g, f in zip(rest, others()):
                out[g.index] = f[0]
        got.clear()  # cut out: the received buffer goes (its tags were read)
        return tuple(out[g.index] for g in groups)

    return ({bucket: flats} if bucket is not None else {}), tags


class _CallCheck:
    """Checks that every rank calls the same units in the same order in one micro-batch's forward.

    The forward's *events* are its unit calls (bucket ``b >= 1``) and its end (:data:`_END`).
    On a real rank an event sends the tag ``(index, previous event, event)`` with its
    *carrier*: the gather the event starts anyway (the prefetch of the unit predicted next), or
    the tag alone when there is none; a carrier is checked (waited for) before the next event
    starts its own, and before any gather that depends on the event. A call of a held unit with
    nothing to prefetch (the last block) sends no carrier of its own: the next event's carries
    it (hence the previous event in the tag). In the simulated world the local ranks run one
    after another: each rank's events are compared with rank 0's as they happen.
    ``names``: unit names by bucket (index 0 unused)."""

    def __init__(self, comm: Communicator, names: Sequence[str]):
        self.names = names
        self.world, self.rows = comm.world_size, comm.local_ranks
        self.tagged = self.rows == 1 and self.world > 1  # a real rank among others: tags travel
        self.ranks = tuple(comm.ranks)
        self.reference: list[int] = []  # the simulated world's rank 0 events

    def name(self, event: int) -> Optional[str]:
        return None if event == _END else self.names[event]

    def record(self, row: int, index: int, event: int) -> None:
        """The simulated world: local rank ``row``'s event ``index`` (0-based) against rank 0's."""
        if self.tagged or self.rows == 1:
            return
        if row == 0:
            self.reference.append(event)
            return
        ref = self.reference[index] if index < len(self.reference) else _END
        if ref != event:
            raise UnitCallError(index + 1, {self.ranks[0]: self.name(ref), self.ranks[row]: self.name(event)})

    def compare(self, tags: Sequence[Sequence[int]]) -> None:
        """A real rank: every rank's ``(index, previous event, event)`` of one carrier (ranks
        whose calls differ may send it at different indices: the first index whose known
        events differ is named)."""
        if all(list(t) == list(tags[0]) for t in tags):
            return
        known = [{i - 1: prev, i: e} for i, prev, e in tags]
        for i in sorted(set().union(*known)):
            seen = {r: k[i] for r, k in enumerate(known) if k.get(i, _NONE) != _NONE}
            if len(set(seen.values())) > 1:
                raise UnitCallError(i, {r: self.name(e) for r, e in seen.items()})
        raise UnitCallError(min(t[0] for t in tags), {r: self.name(t[2]) for r, t in enumerate(tags)})


class _RankRun:
    """One local rank's forward and backward at stage 3: gathers, binds, packs and regathers."""

    def __init__(self, plan: "_Plan", shard: ShardState, comm: Communicator, row: int,
                 dtype: Optional[torch.dtype], reduction: BucketReduction,
                 unit_slots: Sequence[Sequence[tuple[dict, str, str]]], released: Mapping[str, torch.Tensor],
                 check: _CallCheck):
        self.plan, self.shard, self.comm, self.row, self.dtype = plan, shard, comm, row, dtype
        self.reduction, self.unit_slots, self.released, self.check = reduction, unit_slots, released, check
        self.events: list[int] = []  # this forward's unit calls, then _END
        self.pending: Optional[Callable[[], list[list[int]]]] = None  # the last carrier's tags, unchecked
        self.deferred = False  # the last event sent no carrier: the next one carries it
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
        self.last_flats: tuple[torch.Tensor, ...] = ()  # what bucket_tensors gathered last
        self.used: set[int] = set()  # slot indices whose view got a gradient

    def start(self, *buckets: int) -> dict[int, Callable[[], tuple[torch.Tensor, ...]]]:
        return _start_gather(self.plan, self.shard, self.comm, self.row, self.dtype, buckets)

    def take(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """The bucket's flat buffers: its started gather, or one started now."""
        started = self.ahead.pop(bucket, None) or self.start(bucket)[bucket]
        return started()

    def forward_flats(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """The bucket for its forward (prefetched, or gathered now); a unit's call starts the
        gather of the unit predicted next (:meth:`event`). The root travels with the first
        unit: one collective less per step."""
        n = len(self.plan.groups)
        if bucket == 0 and n > 1 and not self.backward and 0 not in self.ahead:
            self.ahead.update(self.start(0, 1))
        if bucket and not self.backward:
            self.event(bucket)
        return self.take(bucket)

    def predicted(self) -> Optional[int]:
        """The unit to prefetch at the next event: the one after the unit the last event called
        (a chain of blocks calls them in order), unless called already or held. A function of
        the events already checked, so every rank starts the same gather."""
        last = self.events[-1] if self.events else 0
        nxt = last + 2 if last + 2 < len(self.plan.groups) else None
        if nxt is None or nxt in self.events or self.held(nxt):
            return None
        return nxt

    def event(self, event: int) -> None:
        """A unit call (its bucket) or the end of the forward (:data:`_END`): checked against the
        other ranks, and the predicted unit's gather started.

        On a real rank the previous event's carrier is checked first, so the carrier this one
        starts has the same size on every rank (after an event that sent none, nothing is
        prefetched: the prediction would rest on a call not yet checked); if the called unit is
        not held, its gather depends on this call, so this call's carrier is checked before it
        starts. A call of a held unit with nothing to prefetch defers its tag to the next event
        (one collective less per step: the last block's call rides on the end's)."""
        self.verify()
        nxt = None if self.deferred else self.predicted()
        prev = self.events[-1] if self.events else _NONE
        self.events.append(event)
        self.check.record(self.row, len(self.events) - 1, event)
        if self.check.tagged:
            defer = nxt is None and event != _END and self.held(event) and not self.deferred
            self.deferred = defer
            if not defer:
                started, self.pending = _start_tagged(self.plan, self.shard, self.comm, self.dtype, nxt,
                                                      (len(self.events), prev, event))
                self.ahead.update(started)
        elif nxt is not None and event != _END:
            self.ahead.update(self.start(nxt))
        if event == _END or not self.held(event):
            self.verify()
        if event == _END and nxt is not None:
            # gathered only to carry the tag at the size every rank expected: no forward follows
            self.ahead.pop(nxt, None)

    def verify(self) -> None:
        """Wait for the last carrier's tags and compare them (raises :class:`UnitCallError`)."""
        if self.pending is not None:
            tags, self.pending = self.pending(), None
            self.check.compare(tags)

    def bucket_tensors(self, bucket: int, track: bool = True) -> dict[str, torch.Tensor]:
        """Gather ``bucket`` through autograd: ``{name: view}`` of its trainable parameters.

        ``track``: pack the views autograd saves as tokens (a unit's; not the root's,
        which is held for the whole forward and backward anyway)."""
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
        # The last two units are kept from their forward to their backward, which is then
        # near (one gather and one wait less each per step): the last unit, and the one before
        # it while the last has yet to run, so that at most two units are held at once.
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
        self.release(self.bound.pop(bucket, {}))
        return _before_backward(self, bucket, out)

    def release(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Stop packing saved views of these tensors' buffers as tokens."""
        for t in tensors.values():
            self.live.pop(t.untyped_storage().data_ptr(), None)

    def regathered(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """The bucket gathered again for backward (once; dropped when its gradient is complete).
        The buffers require grad so that a checkpointed region recomputes as in forward."""
        flats = self.cache.get(bucket)
        if flats is None:
            flats = self.cache[bucket] = self.take(bucket)
        return flats

    def bind_for_backward(self, bucket: int) -> None:
        """Bind the unit's regathered parameters before autograd enters it: a checkpointed
        forward recomputed in backward finds them in the module."""
        flats = self.regathered(bucket)
        # autograd runs backward with grad mode off; the views must require grad as in forward
        with torch.enable_grad():
            tensors = self._views(bucket, [f.detach().requires_grad_(True) for f in flats])
        self.bind(bucket, tensors)
        # prefetch the unit backward reaches next: the one that ran before this one in forward
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
            self.ahead.update(self.start(bucket))

    def _views(self, bucket: int, flats: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{path: view}`` of the bucket's trainable parameters, by one ``split`` per flat buffer
        (its backward is one ``cat``, not a zero-filled flat gradient per view)."""
        tensors = {}
        lay = self.plan.layout
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
            # the reduction and the gather of the unit backward reaches after the next one travel
            # together where the communicator can carry both in one collective (gloo)
            with self.comm.batched():
                self.reduction.add(bucket, self.row, self.acc.pop(bucket))
                self.prefetch_after_next(bucket)

    def prefetch_after_next(self, bucket: int) -> None:
        """Start gathering the unit two before ``bucket`` in forward order, whose backward comes
        after the next unit's, if the next one is held or on its way: two units at most."""
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
        n = len(units) + 1
        return _Plan(layout, tuple(tuple(g for g in layout.groups if g.bucket == b) for b in range(n)))


def check_module_matches(module: torch.nn.Module, layout: Layout) -> None:
    """Raise ``ValueError`` if ``module``'s parameters are no longer those the state was built
    from (names, shapes, dtypes): a layer replaced or resized after ``init_train_state``."""
    have = {n: (tuple(p.shape), p.dtype) for n, p in module.named_parameters()}
    for s in layout.slots:
        got = have.pop(s.path, None)
        if got != (s.shape, s.dtype):
            raise ValueError(
                f"stage 3: parameter {s.path!r} of the state is {s.shape} {s.dtype}, but the module "
                + (f"now has {got[0]} {got[1]}" if got else "has no such parameter")
                + ": the module changed after init_train_state; build the state again"
            )
    if have:
        raise ValueError(f"stage 3: the module has parameters the state does not know: {sorted(have)[:4]}; "
                         "the module changed after init_train_state; build the state again")


def unit_grads(
    loss_fn: ModuleLoss,
    shard: ShardState,
    comm: Communicator,
    batch: Any,
    *,
    units: Sequence[str],
    buffers: Sequence[torch.Tensor],
    buffer_names: Sequence[str],
    rng: Optional[torch.Tensor],
    scale_loss: Callable[[torch.Tensor], torch.Tensor],
    param_dtype: Optional[torch.dtype],
    reduce_dtype: Optional[torch.dtype],
) -> UnitGrads:
    """Stage 3's forward and backward of one micro-batch for every local rank (see the module doc).

    ``batch``: leaves ``[R, ...]``; ``buffers``: ``[R, ...]`` each (the forward
    updates fresh copies); ``rng``: ``[R, n]`` generator states or None.
    Collectives, per rank: one ``all_gather`` per unit in forward (the root in the
    first unit's) and again in backward but for the last two units; one
    ``reduce_scatter`` per unit (the root's in the first unit's) once every local
    rank delivered it.
    """
    module = loss_fn.module
    lay = shard.layout
    check_module_matches(module, lay)
    plan = _Plan.of(lay, units)
    # The first local rank's root and first unit are needed first: their gather runs while
    # the rest of this function sets up (about 1 ms, measured).
    early = _start_gather(plan, shard, comm, 0, param_dtype, (0, 1) if len(plan.groups) > 1 else (0,))
    rows = comm.local_ranks
    bucket_of = {s.path: s.bucket for s in lay.slots if s.group >= 0}
    unit_slots: list[list[tuple[dict, str, str]]] = [[] for _ in plan.groups]
    for table, attr, name in loss_fn._slots:
        b = bucket_of.get(name)
        if b:
            unit_slots[b].append((table, attr, name))
    released = {
        s.path: _released(s.path, s.shape, compute_dtype(s, param_dtype), shard.master[0].device)
        for s in lay.slots if s.group >= 0 and s.bucket > 0
    }
    frozen = {s.path: f.to(compute_dtype(s, param_dtype))
              for s, f in zip(lay.frozen_slots, shard.frozen)}
    device = shard.master[0].device
    # The root's gradient completes last (its embeddings ran first), just after the first
    # unit's: the two travel in one collective.
    reduction = BucketReduction(plan.groups, comm, reduce_dtype,
                                [(0, 1)] + [(b,) for b in range(2, len(plan.groups))])
    losses, new_rng, used = [], [], []
    train_index = [i for i, s in enumerate(lay.slots) if s.group >= 0]
    new_buffers: list[list[torch.Tensor]] = [[] for _ in buffer_names]
    unit_modules = [module.get_submodule(u) for u in units]
    check = _CallCheck(comm, ("", *units))
    for r in range(rows):
        run = _RankRun(plan, shard, comm, r, param_dtype, reduction, unit_slots, released, check)
        run.ahead.update(early)
        early.clear()  # the run holds them now, and drops each at its use
        batch_r = row_of(batch, r)
        bufs = [b[r].clone() for b in buffers]

        handles = []
        try:
            for b, m in enumerate(unit_modules, start=1):
                handles.append(m.register_forward_pre_hook(lambda mod, args, b=b: run.pre_forward(b)))
                handles.append(m.register_forward_hook(
                    lambda mod, args, out, b=b: run.post_forward(b, out), always_call=True))
            with rank_rng(rng[r] if rng is not None else None, device, new_rng), torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(run.pack, run.unpack):
                root = run.bucket_tensors(0, track=False)  # and starts the first unit's gather
                tensors = {**root, **frozen, **released,
                           **dict(zip(buffer_names, bufs))}
                with loss_fn.bound(tensors):
                    loss = loss_fn.forward_loss(tensors, batch_r, param_dtype)
                    check_loss(loss)
                    loss = loss.float()
                    # every rank has called the same units: checked before backward's collectives
                    run.event(_END)
                    run.backward = True
                    scratch.release_free()  # forward's gathers are of other sizes than backward's
                    torch.autograd.grad(scale_loss(loss), [run.anchor], allow_unused=True)
                del tensors
            run.finish_rank()
            used.append([float(i in run.used) for i in train_index])
        finally:
            for h in handles:
                h.remove()
        losses.append(loss.detach())
        for i, b in enumerate(bufs):
            new_buffers[i].append(b)
    shards = reduction.finish(device, param_dtype)
    scratch.release_free()  # before the update, which allocates its own
    return UnitGrads(
        shards,
        torch.stack(losses),
        tuple(stack_rows(b) for b in new_buffers),
        (stack_rows(new_rng),) if rng is not None else (),
        torch.tensor(used, dtype=torch.float64, device=device),
        all(all(row) for row in used),
    )


def _released(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A placeholder with the parameter's shape, ``dtype`` and device, holding one element."""
    # a 0-d element expands to any shape, 0-d included (a learnable temperature, weight_norm's g)
    data = torch.empty((), dtype=dtype, device=device).expand(shape)
    out = torch.Tensor._make_subclass(_Released, data, False)
    out._fzero_name = repr(name)
    return out


# -- compiled stage 3: each unit gathered in its forward, regathered in backward ------------------
#
# Under torch.compile the hooks above do not trace. Instead, while a compiled step runs, each
# unit's ``forward`` is replaced (:meth:`CompiledUnits.installed`) by one that runs the unit inside
# ``torch.utils.checkpoint.checkpoint`` with a selective policy: the region gathers the unit's
# bucket (:class:`_GatherShard`), binds views of it as the unit's parameters and runs the unit's
# own forward. The policy marks the gather (collectives, the cast, the simulated world's
# ``repeat``) and every view MUST_RECOMPUTE and the unit's computation MUST_SAVE: the step's graph
# differentiates its loss inside itself (a forward-loss-backward graph), and AOT autograd's remat
# pass for such graphs (``remat_using_tags_for_fwd_loss_bwd_graph``) then drops the gathered
# buffer after the unit's forward and gathers it again just before the backward that reads it.
# The gather's backward averages the bucket's gradient over ranks (the reduce-scatter) as soon
# as autograd has it whole, inside backward. The views must be in the region too: the unit's
# own ``t()`` of a weight is what its backward reads, and a view outside the region would be
# saved, and with it the whole gathered buffer.


def _regather_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if getattr(op, "namespace", None) == "_c10d_functional" or getattr(op, "is_view", False) \
            or op in _REGATHER_OPS or getattr(op, "name", lambda: "")() in _REGATHER_NAMED:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


_REGATHER_OPS = frozenset({torch.ops.aten.repeat.default, torch.ops.aten._to_copy.default})
# gathers of fzero's own (fzero.dist: gloo's point-to-point all-gather), by name: units does not
# import the communicator that registers them
_REGATHER_NAMED = frozenset({"fzero::all_gather_point_to_point"})


def _regather_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_regather_policy)


def _backward_phase() -> Any:
    """Marks the graph nodes traced inside it as the step's backward (the remat pass's region)."""
    return torch.fx.traceback.annotate({"phase": "backward"})


@torch.library.custom_op("fzero::materialized", mutates_args=())
def _materialized(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x``, opaque to inductor: the reduced gradient shard is computed where backward
    produces it. (Inductor would otherwise fold the end of the reduction, the sum over ranks of
    the ``[W, n]`` a functional all-to-all received, into the optimizer's kernel, and keep every
    unit's received buffer, a whole unit each, until the optimizer runs.) Not needed where the
    reduction is the communicator's own operator (gloo: ``fzero::reduce_scatter_all_to_all``)."""
    return x.clone()


@_materialized.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _GatherShard(torch.autograd.Function):
    """``master shard [shard_numel] -> the rank's full flat buffer [padded]`` (compute dtype);
    backward: the gradient averaged over ranks, this rank's shard in the master dtype (one
    reduce-scatter, or what the communicator makes of it). Pure: it traces."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, comm: Communicator, dtype: torch.dtype,  # type: ignore[override]
                reduce_dtype: torch.dtype) -> torch.Tensor:
        ctx.comm, ctx.reduce_dtype, ctx.master_dtype = comm, reduce_dtype, shard.dtype
        return comm.all_gather(shard.to(dtype).unsqueeze(0))[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        from .sharding import average_flat_grads

        with _backward_phase():
            shard = average_flat_grads(grad.unsqueeze(0), ctx.comm, ctx.reduce_dtype, ctx.master_dtype)[0]
            # A communicator that says what its traced reduction allocates reduces in one
            # operator of its own (gloo's), whose received buffer is gone when it returns:
            # there is nothing left for inductor to fold into the optimizer, and no copy to make.
            if ctx.comm.world_size > 1 and ctx.comm.traced_reduction_footprint(grad.numel()) is None:
                shard = _materialized(shard)
        return shard, None, None, None


class _CompiledRun:
    """What the unit forwards of one traced step need: the master leaves, the plan, the comm."""

    def __init__(self, plan: "_Plan", leaves: Sequence[torch.Tensor], comm: Communicator,
                 dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype],
                 unit_slots: Sequence[Sequence[tuple[dict, str, str]]]):
        self.plan, self.leaves, self.comm = plan, leaves, comm
        self.dtype, self.reduce_dtype, self.unit_slots = dtype, reduce_dtype, unit_slots

    def gathered(self, bucket: int) -> dict[str, torch.Tensor]:
        """``{path: view}`` of the bucket's trainable parameters, gathered through autograd (one
        collective per flat group: a joined gather would cut its groups out by copies)."""
        lay, tensors = self.plan.layout, {}
        for g in self.plan.groups[bucket]:
            flat = _GatherShard.apply(self.leaves[g.index], self.comm, compute_dtype(g, self.dtype),
                                      self.reduce_dtype or g.master_dtype)
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
    gather and regather (see the comment above); :func:`compiled_unit_grads` runs the step's
    forward and backward with them.

    ``installed(units)`` puts the gathering forwards on the unit modules around a compiled call
    (the same function objects every call, so dynamo's guards hold) and restores the modules'
    own afterwards; outside a compiled step the module is untouched."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.run: Optional[_CompiledRun] = None  # set inside the traced step only
        self._forwards: dict[str, Callable[..., Any]] = {}

    def _forward_of(self, bucket: int, unit: torch.nn.Module, own: Callable[..., Any]) -> Callable[..., Any]:
        from torch.utils.checkpoint import checkpoint

        def forward(*args: Any, **kwargs: Any) -> Any:
            run = self.run
            if run is None:  # not inside the step (e.g. a forward of the module by the user)
                return own(*args, **kwargs)
            return checkpoint(run.unit, bucket, own, *args, use_reentrant=False,
                              context_fn=_regather_context, **kwargs)

        return forward

    def installed(self, units: Sequence[str]) -> Any:
        import contextlib

        @contextlib.contextmanager
        def install():  # noqa: ANN202
            put = []
            try:
                for b, name in enumerate(units, start=1):
                    unit = self.module.get_submodule(name)
                    prior = unit.__dict__.get("forward", _NO_FORWARD)
                    if name not in self._forwards:
                        own = prior if prior is not _NO_FORWARD else type(unit).forward.__get__(unit)
                        self._forwards[name] = self._forward_of(b, unit, own)
                    unit.__dict__["forward"] = self._forwards[name]
                    put.append((unit, prior))
                yield
            finally:
                for unit, prior in put:
                    if prior is _NO_FORWARD:
                        unit.__dict__.pop("forward", None)
                    else:
                        unit.__dict__["forward"] = prior

        return install()


def compiled_unit_grads(
    units_run: CompiledUnits,
    loss_fn: ModuleLoss,
    shard: ShardState,
    comm: Communicator,
    batch: Any,
    *,
    units: Sequence[str],
    buffers: Sequence[torch.Tensor],
    buffer_names: Sequence[str],
    scale_loss: Callable[[torch.Tensor], torch.Tensor],
    param_dtype: Optional[torch.dtype],
    reduce_dtype: Optional[torch.dtype],
) -> UnitGrads:
    """Stage 3's forward and backward of one micro-batch inside a compiled step on one local
    rank (``comm.local_ranks == 1``), with ``units_run``'s forwards installed.

    Every flat group's master shard is a leaf; the root's groups are gathered first and held
    (as in eager), each unit's in its forward and again in backward, each averaged over ranks
    in backward as soon as its gradient is complete: ``torch.autograd.grad`` of the scaled loss
    with respect to the leaves gives the averaged gradient shards. Collectives: one
    ``all_gather`` per flat group in forward and again in backward for the units whose
    backward reads their parameters, one ``reduce_scatter`` per flat group."""
    lay = shard.layout
    plan = _Plan.of(lay, units)
    bucket_of = {s.path: s.bucket for s in lay.slots if s.group >= 0}
    unit_slots: list[list[tuple[dict, str, str]]] = [[] for _ in plan.groups]
    for table, attr, name in loss_fn._slots:
        b = bucket_of.get(name)
        if b:
            unit_slots[b].append((table, attr, name))
    leaves = [m[0].detach().requires_grad_(True) for m in shard.master]
    run = _CompiledRun(plan, leaves, comm, param_dtype, reduce_dtype, unit_slots)
    frozen = {s.path: f.to(compute_dtype(s, param_dtype))
              for s, f in zip(lay.frozen_slots, shard.frozen)}
    bufs = [b[0].clone() for b in buffers]
    with torch.enable_grad():
        # Outside its unit's forward a unit's parameter is a stand-in of its shape and compute
        # dtype holding NaN (no memory): the module is not on meta while the step runs, and a
        # use outside the unit (not allowed, see the module doc) turns the loss into NaN
        nan = {}
        for s in lay.slots:
            if s.group >= 0 and s.bucket > 0:
                dt = compute_dtype(s, param_dtype)
                if dt not in nan:
                    nan[dt] = torch.full((), float("nan"), dtype=dt, device=leaves[0].device)
        stand_ins = {s.path: nan[compute_dtype(s, param_dtype)].expand(s.shape) for s in lay.slots
                     if s.group >= 0 and s.bucket > 0}
        tensors = {**stand_ins, **run.gathered(0), **frozen, **dict(zip(buffer_names, bufs))}
        units_run.run = run
        try:
            with loss_fn.bound(tensors):
                loss = loss_fn.forward_loss(tensors, row_of(batch, 0), param_dtype)
                check_loss(loss)
                loss = loss.float()
                with _backward_phase():
                    grads = torch.autograd.grad(scale_loss(loss), leaves, allow_unused=True)
        finally:
            units_run.run = None
    shards = tuple((g if g is not None else torch.zeros_like(m[0])).unsqueeze(0)
                   for g, m in zip(grads, shard.master))
    # Which parameters had a gradient, per flat group (known when tracing): a unit that did
    # not run has none; inside a unit that ran every parameter counts as used
    used = [[float(grads[s.group] is not None) for s in lay.slots if s.group >= 0]]
    return UnitGrads(shards, loss.detach().unsqueeze(0), tuple(b.unsqueeze(0) for b in bufs), (),
                     torch.tensor(used, dtype=torch.float64, device=leaves[0].device), all(used[0]))
