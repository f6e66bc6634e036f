"""The flat parameter layout: trainable parameters packed, in tree order, into one flat buffer per *flat group*
(parameters sharing a bucket, optimizer group, dtype and ``keep_dtype``), zero-padded to split into ``world_size`` equal
shards, each a multiple of ``alignment`` long; frozen parameters stay whole, or (stage 3: ``shard_frozen``) are packed
alike into *frozen groups*. A trainable parameter of a named *parameter group* (``axis``: an expert's) is packed into
flat groups of its own, sharded over that group's ranks (``Layout.axes``). The layout is static: hashable, kept as
pytree metadata of the state.

Imports: none of fzero.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as tp

__all__ = ["ParamSlot", "FlatGroup", "Layout", "build_layout", "named_leaves", "path_str", "compute_dtype"]


def check_floating_tensor(what: str, x: Any) -> torch.Tensor:
    """``x`` if it is a dense floating-point tensor; otherwise a ``TypeError`` naming ``what``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"{what}: sparse tensors are not supported ({x.layout})")
    if not x.is_floating_point():
        raise TypeError(f"{what}: expected a floating-point tensor, got {x.dtype}")
    return x


def path_str(keypath: Sequence[Any]) -> str:
    """A dotted name for a pytree key path: ``layers.0.weight``."""
    def part(k: Any) -> str:
        if isinstance(k, tp.MappingKey):
            return str(k.key)
        if isinstance(k, tp.SequenceKey):
            return str(k.idx)
        return k.name if isinstance(k, tp.GetAttrKey) else str(k)

    return ".".join(part(k) for k in keypath)


def named_leaves(tree: Any) -> tuple[list[tuple[str, Any]], tp.TreeSpec]:
    """``[(dotted path, leaf)]`` in tree order, and the tree's spec; an ``nn.Module`` is read as its named
    parameters. Two leaves with one path (``{"a": {"b": t}, "a.b": t2}``) are a ``ValueError`` naming both."""
    if isinstance(tree, torch.nn.Module):
        tree = dict(tree.named_parameters())
    leaves, spec = tp.tree_flatten_with_path(tree)
    named = [(path_str(p), x) for p, x in leaves]
    first: dict[str, int] = {}
    for i, (name, _) in enumerate(named):
        if (j := first.setdefault(name, i)) != i:
            raise ValueError(f"parameters {tp.keystr(leaves[j][0])} and {tp.keystr(leaves[i][0])} both have the path "
                             f"{name!r}: paths name parameters in layouts and checkpoints, so each must be unique "
                             "(rename a key)")
    return named, spec


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """One parameter: where it lives (``group == -1``: frozen; ``frozen_group >= 0``: a sharded frozen one's group,
    ``offset`` in it). ``bucket``: its shard unit (0: the root). ``keep_dtype``: computed in its own ``dtype``."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    group: int
    offset: int
    numel: int
    bucket: int = 0
    keep_dtype: bool = False
    frozen_group: int = -1
    axis: str = ""


@dataclasses.dataclass(frozen=True)
class FlatGroup:
    """One flat buffer: ``numel`` parameter elements, ``padded_numel = world_size * shard_numel`` with padding
    (``world_size``: its parameter group's, ``axis``; ``""``: the world's); ``slots``: indices into
    :attr:`Layout.slots`, in buffer order. ``opt_group == -1``: a frozen group."""

    index: int
    opt_group: int
    dtype: torch.dtype
    slots: tuple[int, ...]
    numel: int
    padded_numel: int
    shard_numel: int
    bucket: int = 0
    keep_dtype: bool = False
    axis: str = ""

    @property
    def master_dtype(self) -> torch.dtype:
        """The fp32 master copy's dtype (float64 for float64 parameters)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """Where every parameter of a tree lives: ``slots`` (every leaf in tree order), ``groups`` (flat buffers), ``spec``
    (tree structure), ``frozen_groups`` (stage 3's sharded frozen parameters), ``axes`` (each parameter group's
    ``(name, world_size, parts)``: its ranks per rank group, and how many rank groups, each holding its own values of
    the group's parameters); eq/hash: :attr:`fingerprint`."""

    slots: tuple[ParamSlot, ...]
    groups: tuple[FlatGroup, ...]
    spec: tp.TreeSpec
    world_size: int
    alignment: int
    frozen_groups: tuple[FlatGroup, ...] = ()
    axes: tuple[tuple[str, int, int], ...] = ()

    def axis_size(self, axis: str) -> int:
        """The ranks a flat group of parameter group ``axis`` is sharded over (``""``: the world's)."""
        return self.world_size if not axis else next(w for name, w, _ in self.axes if name == axis)

    def parts(self, axis: str) -> int:
        """How many rank groups hold their own values of a parameter of group ``axis`` (``""``: 1)."""
        return 1 if not axis else next(p for name, _, p in self.axes if name == axis)

    def saved_shape(self, slot: ParamSlot) -> tuple[int, ...]:
        """The shape ``slot`` is saved and exported in: its own, or a parameter group's rank groups' values stacked
        along the first dimension, rank group 0 first (an expert-parallel layer's: every expert, by expert index)."""
        parts = self.parts(slot.axis)
        if parts == 1:
            return slot.shape
        return (parts * slot.shape[0], *slot.shape[1:]) if slot.shape else (parts,)

    @property
    def num_positions(self) -> int:
        """The length of the per-parameter vectors (used flags, ``OptState.missed``): one position per trainable
        parameter, and a parameter group's one per rank group holding it (:func:`positions`)."""
        extra = sum((parts - 1) * sum(s.axis == name for s in self.trainable_slots) for name, _, parts in self.axes)
        return len(self.trainable_slots) + extra

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(s.path for s in self.slots)

    @property
    def trainable_slots(self) -> tuple[ParamSlot, ...]:
        return tuple(s for s in self.slots if s.group >= 0)

    @property
    def frozen_slots(self) -> tuple[ParamSlot, ...]:
        return tuple(s for s in self.slots if s.group < 0)

    @property
    def num_params(self) -> int:
        """Trainable parameter elements (Ψ)."""
        return sum(g.numel for g in self.groups)

    @property
    def num_padded(self) -> int:
        """Trainable elements including padding (Ψ_padded)."""
        return sum(g.padded_numel for g in self.groups)

    def describe(self) -> tuple[tuple[Any, ...], ...]:
        """Rows ``(path, shape, dtype, keep_dtype, flat group, optimizer group, bucket)`` after a header row
        ``(world size, alignment, tree structure)``: what the fingerprint hashes."""
        head = ("world_size", self.world_size, "alignment", self.alignment, str(self.spec), self.axes)
        return (head,) + tuple((s.path, s.shape, str(s.dtype), s.keep_dtype,
                                s.group if s.frozen_group < 0 else f"frozen {s.frozen_group}",
                                self.groups[s.group].opt_group if s.group >= 0 else -1, s.bucket, s.axis)
                               for s in self.slots)

    @property
    def fingerprint(self) -> str:
        # computed once (not functools.cached_property: dynamo cannot enter its lock on Python 3.11)
        fp = self.__dict__.get("_fingerprint")
        if fp is None:
            fp = hashlib.sha256(repr(self.describe()).encode()).hexdigest()[:32]
            object.__setattr__(self, "_fingerprint", fp)
        return fp

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def first_difference(self, other: Layout) -> str | None:
        """A sentence naming the first thing that differs from ``other``, or None."""
        return first_difference(self.describe(), other.describe())

    def with_world_size(self, world_size: int, shard_frozen: bool | None = None) -> Layout:
        """The same parameters laid out for another world size; ``shard_frozen``: in frozen groups (default: as
        here)."""
        if self.axes:
            raise ValueError("a layout with parameter groups moves to another world size with its groups: not "
                             "supported yet")
        unpacked = [dataclasses.replace(s, group=self.groups[s.group].opt_group if s.group >= 0 else -1,
                                        frozen_group=-1) for s in self.slots]
        shard_frozen = bool(self.frozen_groups) if shard_frozen is None else shard_frozen
        return _pack(unpacked, self.spec, world_size, self.alignment, shard_frozen)


def first_difference(mine: Sequence[tuple[Any, ...]], theirs: Sequence[tuple[Any, ...]]) -> str | None:
    """A sentence naming the first difference between two :meth:`Layout.describe` tables, or None."""
    a, b = mine[0], theirs[0]
    for i in (0, 2):
        if a[i + 1] != b[i + 1]:
            return f"{a[i]} differs: {a[i + 1]} vs {b[i + 1]}"
    fields = ("path", "shape", "dtype", "keep_dtype", "flat group", "optimizer group", "bucket", "parameter group")
    for i, (x, y) in enumerate(zip(mine[1:], theirs[1:])):
        if x[0] != y[0]:
            return f"parameter #{i} is {x[0]!r} vs {y[0]!r}"
        for field, u, v in zip(fields[1:], x[1:], y[1:]):
            if u != v:
                return f"parameter {x[0]!r}: {field} {u} vs {v}"
    if len(mine) != len(theirs):
        extra = max(mine, theirs, key=len)[min(len(mine), len(theirs))][0]
        return f"parameter count differs ({len(mine) - 1} vs {len(theirs) - 1}); first extra: {extra!r}"
    if a[5:] != b[5:]:
        return f"parameter groups differ: {a[5:]} vs {b[5:]}"
    return "the parameter tree structure differs (same paths, other container types)" if a[4] != b[4] else None


def _pack(slots: Iterable[ParamSlot], spec: tp.TreeSpec, world_size: int, alignment: int,
          shard_frozen: bool = False, axes: tuple[tuple[str, int, int], ...] = ()) -> Layout:
    """Give slots (``group``: opt-group index, -1 frozen) flat groups and offsets; ``shard_frozen``: frozen ones too;
    a slot of a parameter group (``axis``) goes to flat groups of that group, sharded over its ``world_size``."""
    slots = list(slots)
    sizes = {"": world_size, **{name: w for name, w, _ in axes}}
    keys: dict[tuple[int, str, int, torch.dtype, bool], list[int]] = {}
    for i, s in enumerate(slots):
        if s.group >= 0 or shard_frozen:
            keys.setdefault((s.bucket, s.axis, s.group, s.dtype, s.keep_dtype), []).append(i)
    groups: tuple[list[FlatGroup], list[FlatGroup]] = ([], [])
    for (bucket, axis, opt_group, dtype, keep), members in sorted(keys.items(), key=lambda kv: kv[0][0]):
        out, offset, ranks = groups[opt_group < 0], 0, sizes[axis]
        for i in members:
            where = {"group": len(out)} if opt_group >= 0 else {"frozen_group": len(out)}
            slots[i] = dataclasses.replace(slots[i], offset=offset, **where)
            offset += slots[i].numel
        # ceil(offset / ranks) rounded up to a multiple of alignment (one alignment at least)
        shard = max(-(-offset // (ranks * alignment)) * alignment, alignment)
        out.append(FlatGroup(len(out), opt_group, dtype, tuple(members), offset, shard * ranks, shard, bucket,
                             keep, axis))
    return Layout(tuple(slots), tuple(groups[0]), spec, world_size, alignment, tuple(groups[1]), axes)


def build_layout(params: Any, world_size: int, *, trainable: Callable[[str], bool] | None = None,
                 group_of: Callable[[str], int] | None = None, bucket_of: Callable[[str], int] | None = None,
                 keep_dtype: Callable[[str], bool] | None = None, alignment: int = 16,
                 shard_frozen: bool = False, axis_of: Callable[[str], str] | None = None,
                 axes: Sequence[tuple[str, int, int]] = ()) -> Layout:
    """Lay out ``params`` (an ``nn.Module`` or a pytree of tensors) for ``world_size`` ranks. ``trainable(path)``: which
    leaves the optimizer updates (default: every pytree leaf, a module's ``requires_grad`` parameters);
    ``group_of(path)``: a trainable leaf's optimizer group (default 0); ``bucket_of(path)``: its shard unit (default 0,
    the root); ``keep_dtype(path)``: whether it keeps its own dtype for compute (default: none); ``shard_frozen``:
    frozen leaves in frozen groups (stage 3); ``axis_of(path)``: a trainable leaf's parameter group (default ``""``,
    the world), one of ``axes`` (``(name, world_size, parts)`` each). ``TypeError`` names a non-tensor, sparse or
    non-floating leaf; ``ValueError`` if nothing is trainable, or names a frozen leaf given a parameter group."""
    for name, value in (("world_size", world_size), ("alignment", alignment)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    is_module = isinstance(params, torch.nn.Module)
    leaves, spec = named_leaves(params)
    slots = []
    for path, x in leaves:
        check_floating_tensor(f"parameter {path!r}", x)
        train = (x.requires_grad if is_module else True) if trainable is None else bool(trainable(path))
        group = (group_of(path) if group_of is not None else 0) if train else -1
        bucket = bucket_of(path) if bucket_of is not None else 0
        keep = bool(keep_dtype(path)) if keep_dtype is not None else False
        axis = axis_of(path) if axis_of is not None else ""
        if axis and not train:
            raise ValueError(f"parameter {path!r} is frozen but in parameter group {axis!r}: a group's parameters "
                             "differ between its rank groups and are trained there (a frozen one is held whole, the "
                             "same on every rank); train it, or leave it out of the group")
        if axis not in {"", *(name for name, _, _ in axes)}:
            raise ValueError(f"parameter {path!r}: unknown parameter group {axis!r}")
        slots.append(ParamSlot(path, tuple(x.shape), x.dtype, group, 0, x.numel(), bucket, keep, axis=axis))
    if not any(s.group >= 0 for s in slots):
        raise ValueError("no trainable parameters: every parameter is frozen (requires_grad=False or excluded by "
                         "`trainable`)" if slots else "no trainable parameters: the parameter tree is empty")
    named = {s.axis for s in slots}  # only the parameter groups some parameter is in
    return _pack(slots, spec, world_size, alignment, shard_frozen, tuple(a for a in axes if a[0] in named))


def compute_dtype(x: ParamSlot | FlatGroup, param_dtype: torch.dtype | None) -> torch.dtype:
    """``x``'s gather/compute dtype: its own if ``param_dtype`` is None or ``x.keep_dtype``, else ``param_dtype``."""
    return x.dtype if param_dtype is None or x.keep_dtype else param_dtype


def flat_shard(layout: Layout, group: FlatGroup, leaves: Sequence[torch.Tensor], rank: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Rank ``rank``'s shard ``[shard_numel]`` of ``group``'s flat buffer (master dtype, zero padded; into ``out``,
    zeros, if given) from full ``leaves`` (layout order, no local-rank axis), never materialising the whole buffer."""
    lo, hi = rank * group.shard_numel, (rank + 1) * group.shard_numel
    if out is None:
        out = torch.zeros(group.shard_numel, dtype=group.master_dtype, device=leaves[group.slots[0]].device)
    for i in group.slots:
        s = layout.slots[i]
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < b:
            out[a - lo:b - lo].copy_(leaves[i].detach().reshape(-1)[a - s.offset:b - s.offset])
    return out


def flatten_group(layout: Layout, group: FlatGroup, leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate ``group``'s leaves (each ``[R, *shape]``) into ``[R, padded_numel]``, zero padded."""
    rows = leaves[group.slots[0]].shape[0]
    parts = [leaves[i].reshape(rows, -1) for i in group.slots]
    if group.padding:
        parts.append(parts[0].new_zeros(rows, group.padding))
    return torch.cat(parts, dim=1)


def group_views(layout: Layout, group: FlatGroup, flat: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``flat`` (``[padded_numel]``, one rank's buffer) shaped as ``group``'s parameters."""
    return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in (layout.slots[i] for i in group.slots)]


def split_views(layout: Layout, group: FlatGroup, flat: torch.Tensor) -> list[torch.Tensor]:
    """:func:`group_views` by one ``split``: backward gives ``flat`` one gradient by one ``cat`` (not one per view)."""
    sizes = [layout.slots[i].numel for i in group.slots] + ([group.padding] if group.padding else [])
    return [p.view(layout.slots[i].shape) for i, p in zip(group.slots, flat.split(sizes))]


def flatten_one(layout: Layout, group: FlatGroup, leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate one rank's ``group`` leaves (each ``[*shape]``) into ``[padded_numel]``, zero padded."""
    parts = [leaves[i].reshape(-1) for i in group.slots]
    if group.padding:
        parts.append(parts[0].new_zeros(group.padding))
    return torch.cat(parts)


def trainable_index(layout: Layout, part: Mapping[str, int] | None = None) -> dict[int, int]:
    """``{index in layout.slots: position in the per-parameter vectors}`` (:func:`positions`) for a rank in rank group
    ``part[axis]`` of each parameter group (default: the first of each): ``layout.trainable_slots`` order."""
    index = {i: k for k, i in enumerate(i for i, s in enumerate(layout.slots) if s.group >= 0)}
    if not part or not any(part.values()):
        return index
    moved = positions(layout)
    return {i: moved[(i, part.get(layout.slots[i].axis, 0))] if layout.slots[i].axis else k for i, k in index.items()}


def positions(layout: Layout) -> dict[tuple[int, int], int]:
    """Where a parameter group's parameters sit in the per-parameter vectors beyond its first rank group: ``{(index in
    layout.slots, rank group q >= 1): position}``. The first :attr:`Layout.trainable_slots` positions are theirs in
    rank group 0 (so a layout without groups keeps its order); then each parameter group in :attr:`Layout.axes` order,
    its rank groups 1, 2, ... in turn, each its parameters in slot order: a vector agreed over the world holds every
    rank group's values of every parameter once (:attr:`Layout.num_positions` long)."""
    out, k = {}, len(layout.trainable_slots)
    for name, _, parts in layout.axes:
        members = [i for i, s in enumerate(layout.slots) if s.group >= 0 and s.axis == name]
        for q in range(1, parts):
            for i in members:
                out[(i, q)] = k
                k += 1
    return out


def shard_pieces(layout: Layout, group: FlatGroup, rank: int,
                 where: dict[int, int] | None = None) -> list[tuple[int | None, int, int]]:
    """``(parameter, lo, hi)`` for each parameter's piece of ``group``'s shard on ``rank``, in shard coordinates;
    ``parameter`` is its :func:`trainable_index` position (``None``: the padding)."""
    where = trainable_index(layout) if where is None else where
    lo, hi = rank * group.shard_numel, (rank + 1) * group.shard_numel
    out, begin = [], 0
    for k, n in [(where[i], layout.slots[i].numel) for i in group.slots] + [(None, group.padding)]:
        a, b = max(begin, lo), min(begin + n, hi)
        if b > a:
            out.append((k, a - lo, b - lo))
        begin += n
    return out


class FlatGrads(tuple):
    """One ``[R, padded_numel]`` gradient buffer per flat group of ``groups`` (a bucket's or the layout's)."""

    groups: tuple[FlatGroup, ...]

    def __new__(cls, groups: Sequence[FlatGroup], flats: Sequence[torch.Tensor]) -> FlatGrads:
        if len(groups) != len(flats):
            raise ValueError(f"FlatGrads: {len(flats)} flat buffers for {len(groups)} flat groups")
        out = super().__new__(cls, flats)
        out.groups = tuple(groups)
        return out

    def of(self, group: FlatGroup) -> torch.Tensor:
        """The flat buffer of ``group``."""
        return self[next(i for i, g in enumerate(self.groups) if g.index == group.index)]


def flat_grads(layout: Layout, grads: Any, rows: int) -> FlatGrads:
    """Gradients shaped like the parameters (``{path: tensor}`` or the model's structure; leaves ``[R, *shape]``;
    frozen ones absent or None) as every flat group's flat buffer; ``ValueError`` naming a path that mismatches."""
    by_path, known = dict(named_leaves(grads)[0]), set(layout.paths)
    for path in by_path:
        if path not in known:
            raise ValueError(f"grads has an entry {path!r} that is not a parameter of the layout")
    leaves: list[torch.Tensor | None] = []
    for s in layout.slots:
        g = by_path.get(s.path)
        if s.group >= 0:
            if g is None:
                raise ValueError(f"grads is missing trainable parameter {s.path!r}")
            check_floating_tensor(f"grads[{s.path!r}]", g)
            if tuple(g.shape) != (rows, *s.shape):
                raise ValueError(f"grads[{s.path!r}] has shape {tuple(g.shape)}; parameter {s.path!r} needs "
                                 f"{(rows, *s.shape)} (leading local-rank axis {rows})")
        leaves.append(g if s.group >= 0 else None)
    return FlatGrads(layout.groups, [flatten_group(layout, g, leaves) for g in layout.groups])


def param_tree(layout: Layout, flats: Sequence[torch.Tensor], frozen: Mapping[str, torch.Tensor],
               param_dtype: torch.dtype | None = None) -> Any:
    """The parameters in the user's structure, each leaf ``[R, *shape]``: trainable ones view ``flats`` (one
    ``[R, padded_numel]`` per flat group), frozen ones (``frozen[path]``, whole) broadcast in compute dtype."""
    rows = flats[0].shape[0] if flats else 1
    leaves = []
    for s in layout.slots:
        if s.group >= 0:
            leaves.append(flats[s.group][:, s.offset:s.offset + s.numel].view(rows, *s.shape))
        else:
            f = frozen[s.path].to(compute_dtype(s, param_dtype))
            leaves.append(f.unsqueeze(0).expand(rows, *f.shape))
    return tp.tree_unflatten(leaves, layout.spec)


def stack_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-rank tensors stacked on a new local-rank axis; one rank (a real process): a view."""
    return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(list(rows))
