"""Cross-rank agreement of everything a training state keeps replicated.

Data-parallel replicas can drift silently: a nondeterministic kernel, a bit
flip in memory or on the wire, a rank that loaded another checkpoint. Each
rank computes a small *digest* of what must be identical on every rank and
one small collective compares the digests.

Compared (the *items*, in this order):

* ``static``: a hash of the static metadata (layout fingerprint, optimizer
  kind, defaults, group overrides and flags, scaler rule, precision);
* ``scaler.scale``, ``scaler.growth_tracker``, ``scaler.hysteresis_left``;
* ``opt.step``, ``opt.missed`` and every hyperparameter ``opt.hyper[g]['name']``;
* ``params flat group g``: the gathered compute-dtype buffers of stages 1-2
  (padding included), per local rank; stage 3 keeps none;
* ``frozen['path']``: frozen parameters (replicated, no rank axis);
* ``buffers[...]`` (if the state has ``buffers``) when ``buffers="broadcast"``;
* ``rng[...]`` (if the state has ``rng``) when ``rng="broadcast"``.

Not compared: master shards and optimizer moments (each rank owns a different
shard by design).

The digest of an item is a 64-bit integer computed from the *bit patterns*
(NaN-safe, and exact, so independent of summation order and thread count):
the data are read as 64-bit words (narrower words for odd sizes), summed in
blocks of 64 words, and ``h = K1 * sum(blocks) + K2 * sum(block_index * block)``
with ``K1`` odd and ``K2`` even, all modulo 2**64. A change of any bits of
one word changes ``h`` with certainty (the difference is the word's
difference times an odd number); several changes are missed with
probability about 2**-64. 0-d items are their bit pattern. Each 64-bit
value travels as two exact float64 numbers (low and high 32 bits).

Two layers:

* :func:`replica_digest` / :func:`replicas_differ`: pure tensor code, no host
  sync, ``torch.compile(fullgraph=True)``-safe; ``replicas_differ`` costs one
  ``all_reduce(max)`` of ``[R, 4k]`` float64 (k items).
* :func:`check_replicas`: eager; one ``all_gather`` of the digests, then
  raises :class:`ReplicaDivergenceError` on every rank naming what differs on
  which ranks (and, with ``locate=True``, a second ``all_gather`` names the
  parameters of a differing flat group).

Every rank must pass states of the same structure (same layout, optimizer
and buffers), which ``init_train_state`` checks at creation; otherwise the
collectives have different sizes.

Imports: ``fzero.comm``; the state is duck-typed (``TrainState``: ``shard``,
``opt``, ``scaler``, ``params``, ``precision``, and optionally ``buffers`` and
``rng``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from typing import Any, Callable, Literal, Optional, Sequence

import torch

from .comm import Communicator

__all__ = [
    "ReplicaDivergenceError",
    "Divergence",
    "replica_items",
    "replica_digest",
    "replicas_differ",
    "check_replicas",
    "with_replica_check",
    "digest_parts",
    "parts_differ",
]

Policy = Literal["broadcast", "local"]

# h = K1 * sum(words) + K2 * sum(block_position * block_sum)  (mod 2**64); K1 odd, K2 even.
_K1 = 0x1E3779B97F4A7C15
_K2 = 0x2545F4914F6CDD1C
_BLOCK = 64
_LOW32 = 0xFFFFFFFF
_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class ReplicaDivergenceError(ValueError):
    """Ranks hold different values of something that must be replicated.

    ``differences``: one :class:`Divergence` per item that differs.
    """

    def __init__(self, message: str, differences: Sequence["Divergence"] = ()):
        super().__init__(message)
        self.differences = tuple(differences)


@dataclasses.dataclass(frozen=True)
class Divergence:
    """One replicated item that differs: ``agree`` holds the majority value
    (ties: the group with the lowest rank), ``differ`` the other ranks.
    ``located``: for a parameter buffer, the parameters that differ."""

    item: str
    agree: tuple[int, ...]
    differ: tuple[int, ...]
    located: tuple[str, ...] = ()

    def describe(self) -> str:
        ranks = ", ".join(map(str, self.differ))
        who = "rank" if len(self.differ) == 1 else "ranks"
        agree = ", ".join(map(str, self.agree))
        if len(self.agree) == len(self.differ):  # no majority (e.g. two ranks)
            text = f"{self.item} differs on {who} {ranks} from {'rank' if len(self.agree) == 1 else 'ranks'} {agree}"
        else:
            text = f"{self.item} differs on {who} {ranks} ({'rank' if len(self.agree) == 1 else 'ranks'} {agree} agree)"
        if self.located:
            text += f" [parameters: {', '.join(self.located)}]"
        return text


def _check_policy(name: str, value: str) -> None:
    if value not in ("broadcast", "local"):
        raise ValueError(f"{name} must be 'broadcast' or 'local', got {value!r}")


def _as_tuple(x: Any) -> tuple:
    if x is None:
        return ()
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, dict):
        return tuple(x.values())
    return tuple(x)


def _names(state: Any, field: str, values: tuple, given: Any) -> list[str]:
    """Names of ``buffers``/``rng`` entries: a dict's keys, else the state's (or its
    layout's) ``buffer_names``/``buffer_paths`` (``rng_names``), else indices."""
    if isinstance(given, dict):
        return [f"{field}[{k!r}]" for k in given]
    spec = getattr(state, "module", None)
    if field == "buffers" and spec is not None and len(getattr(spec, "buffers", ())) == len(values):
        return [f"{field}[{n!r}]" for n in spec.buffers]
    owners = (state, getattr(state.shard, "layout", None))
    attrs = ("buffer_names", "buffer_paths", "buffers_names") if field == "buffers" else (f"{field}_names",)
    names = next((getattr(o, a) for o in owners for a in attrs if getattr(o, a, None) is not None), None)
    if names is not None and len(names) == len(values):
        return [f"{field}[{n!r}]" for n in names]
    return [f"{field}[{i}]" for i in range(len(values))]


def _frozen_paths(state: Any) -> list[str]:
    layout = getattr(state.shard, "layout", None)
    if layout is None:
        return [str(i) for i in range(len(state.shard.frozen))]
    return [s.path for s in layout.slots if s.group < 0]


_SCALER_STATIC = ("growth_factor", "backoff_factor", "growth_interval", "min_scale", "hysteresis", "dynamic")


def _constant_under_compile(fn: Callable) -> Callable:
    """What ``torch.compiler.assume_constant_result(fn)`` does: marks ``fn`` so that dynamo
    calls it while tracing and puts its result in the graph as a constant. That function
    imports ``torch._dynamo`` to set the mark, 2.5 s of a 4.1 s ``import fzero`` in every
    rank and tool that never compiles; the mark is the attribute set here (torch sets it the
    same way on its own functions; ``tests/test_replicas.py`` checks that the two agree)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@_constant_under_compile
def _signature_of(layout: Any, optimizer: Any, scaler_static: tuple, precision: Any) -> int:
    """A 64-bit hash of the static metadata (a constant when compiled: every argument is
    static pytree metadata, never a tensor)."""
    parts: list[str] = []
    if layout is not None:
        parts.append(f"layout={layout.fingerprint}")
    if optimizer is not None:
        groups = [(g.name, tuple(g.overrides)) for g in optimizer.groups]
        parts.append(f"optimizer={optimizer.signature}|{tuple(optimizer.defaults)}|{groups}")
    parts.append("scaler=" + "|".join(map(repr, scaler_static)))
    if precision is not None:
        parts.append(f"precision={getattr(precision, 'param_dtype', None)}|{getattr(precision, 'reduce_dtype', None)}")
    digest = hashlib.sha256("\n".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def _static_signature(state: Any) -> int:
    """Hash of what every rank must share statically: layout fingerprint, optimizer signature
    (name and static configuration), defaults, group overrides, the scaler's rule, the precision policy."""
    return _signature_of(
        getattr(state.shard, "layout", None),
        getattr(state.opt, "optimizer", None),
        tuple(getattr(state.scaler, k, None) for k in _SCALER_STATIC),
        getattr(state, "precision", None),
    )


def replica_items(
    state: Any, *, buffers: Policy = "local", rng: Policy = "local"
) -> list[tuple[str, Optional[torch.Tensor], bool]]:
    """``[(name, tensor, has_rank_axis)]``: what must agree across ranks, in digest order.

    The first item is ``("static", None, False)`` (the static metadata hash).
    """
    _check_policy("buffers", buffers)
    _check_policy("rng", rng)
    items: list[tuple[str, Optional[torch.Tensor], bool]] = [("static", None, False)]
    sc = state.scaler
    for k in ("scale", "growth_tracker", "hysteresis_left"):
        items.append((f"scaler.{k}", getattr(sc, k), False))
    items.append(("opt.step", state.opt.step, False))
    for m in getattr(state.opt, "missed", ()):  # each parameter's skipped steps: replicated too
        items.append(("opt.missed", m, False))
    names = getattr(getattr(state.opt, "optimizer", None), "scalar_names", ())
    for name, v in zip(names, getattr(state.opt, "scalars", ())):  # per-parameter rule state
        items.append((f"opt.scalars[{name!r}]", v, False))
    vnames = getattr(getattr(state.opt, "optimizer", None), "vector_names", ())
    for name, v in zip(vnames, getattr(state.opt, "vectors", ())):  # per-parameter vector state
        if v.numel():  # empty when no parameter has one
            items.append((f"opt.vectors[{name!r}]", v, False))
    for g, hyper in enumerate(state.opt.hyper):
        for k, v in hyper.items():
            items.append((f"opt.hyper[{g}][{k!r}]", v, False))
    layout = getattr(state.shard, "layout", None)
    for g, p in enumerate(state.params):
        what = f"params flat group {g}"
        if layout is not None and g < len(layout.groups):
            fg = layout.groups[g]
            what += f" ({str(fg.dtype).replace('torch.', '')}, {len(fg.slots)} parameters)"
        items.append((what, p, True))
    for path, t in zip(_frozen_paths(state), state.shard.frozen):
        items.append((f"frozen[{path!r}]", t, False))
    for field, policy in (("buffers", buffers), ("rng", rng)):
        given = getattr(state, field, None)
        values = _as_tuple(given)
        if policy == "broadcast" and values:
            for name, t in zip(_names(state, field, values, given), values):
                items.append((name, t, True))
    return items


def _words(x: torch.Tensor, rows: int, traced: bool = False) -> torch.Tensor:
    """The bit pattern of each row of ``x`` as int64 words ``[rows, n]``."""
    x = x.detach().reshape(rows, -1)
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    x = x.contiguous()
    es = x.element_size()
    if es not in _INT_OF_SIZE:  # complex128 and the like: read as 8-byte words
        x = x.view(torch.int64) if (x.shape[1] * es) % 8 == 0 else x.view(torch.uint8)
        es = x.element_size()
    n = x.shape[1]
    # Rows whose byte length is a multiple of 8 are read as 64-bit words (for the big fp32
    # buffers a free reinterpretation), others as their own words widened to int64. The same
    # words eagerly and compiled; a view at an offset that is not 8-byte aligned is copied first.
    if es < 8 and n % (8 // es) == 0 and n > 0:
        if not traced and (x.storage_offset() * es) % 8:
            x = x.clone()
        return x.view(torch.int64)
    w = x.view(_INT_OF_SIZE[es])
    return w if w.dtype == torch.int64 else w.to(torch.int64)


def _fold(words: torch.Tensor) -> torch.Tensor:
    """``[rows, n]`` int64 words -> ``[rows]`` 64-bit hashes (wrapping arithmetic)."""
    rows, n = words.shape
    m = n - n % _BLOCK
    nb = m // _BLOCK
    blocks = words[:, :m].reshape(rows, nb, _BLOCK).sum(2)
    tail = words[:, m:].sum(1)
    pos = torch.arange(1, nb + 1, dtype=torch.int64, device=words.device)
    s1 = blocks.sum(1) + tail
    s2 = (blocks * pos).sum(1) + tail * (nb + 1)
    return s1 * _K1 + s2 * _K2


def _permute_back(order: list[int]) -> Optional[list[int]]:
    """The index list that puts columns computed in ``order`` back in item order (None: already)."""
    if order == list(range(len(order))):
        return None
    inv = [0] * len(order)
    for pos, i in enumerate(order):
        inv[i] = pos
    return inv


def _scalar_bits(values: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-d tensors -> their bit patterns as int64 ``[m]`` (one stack per word size)."""
    by_size: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for i, v in enumerate(values):
        v = v.detach()
        if v.dtype == torch.bool:
            v = v.view(torch.uint8)
        es = v.element_size()
        if es not in _INT_OF_SIZE:  # complex: fold its words
            v, es = v.reshape(1).view(torch.int64).sum(), 8
        elif v.dtype != _INT_OF_SIZE[es]:
            v = v.view(_INT_OF_SIZE[es])
        by_size.setdefault(es, []).append((i, v.to(device)))
    parts, order = [], []
    for es, group in by_size.items():
        stacked = torch.stack([v for _, v in group])
        parts.append(stacked if es == 8 else stacked.to(torch.int64))
        order += [i for i, _ in group]
    bits = torch.cat(parts)
    inv = _permute_back(order)
    return bits if inv is None else bits[inv]


def _digest_device(state: Any) -> torch.device:
    for t in (*state.params, *state.shard.master):
        return t.device
    return state.opt.step.device


def _to_columns(h: torch.Tensor) -> torch.Tensor:
    """``[rows, k]`` int64 -> ``[rows, 2k]`` float64 (low, high 32 bits of each; exact)."""
    lo = (h & _LOW32).to(torch.float64)
    hi = (h >> 32).to(torch.float64)
    return torch.stack([lo, hi], dim=2).reshape(h.shape[0], -1)


def _hashes(items: list[tuple[str, Optional[torch.Tensor], bool]], state: Any, rows: int,
            traced: bool = False) -> torch.Tensor:
    """``[rows, k]`` int64: one 64-bit hash per item (0-d replicated items: their bits)."""
    device = _digest_device(state)
    sig = torch.tensor([_static_signature(state)], dtype=torch.int64, device=device)
    is_scalar = [t is None or (not ranked and t.dim() == 0) for _, t, ranked in items]
    scalars = [t for (_, t, _), s in zip(items, is_scalar) if s and t is not None]
    head = torch.cat([sig, _scalar_bits(scalars, device)]) if scalars else sig
    cols = [head.unsqueeze(0).expand(rows, -1)]
    for (_, t, ranked), s in zip(items, is_scalar):
        if not s:
            h = _fold(_words(t.to(device), rows if ranked else 1, traced))
            cols.append((h if ranked else h.expand(rows)).unsqueeze(1))
    out = torch.cat(cols, dim=1) if len(cols) > 1 else cols[0]
    # "static" (items[0]) is first in the scalar part, as in replica_items
    inv = _permute_back([i for i, s in enumerate(is_scalar) if s] + [i for i, s in enumerate(is_scalar) if not s])
    return out if inv is None else out[:, inv]


def replica_digest(
    state: Any, comm: Communicator, *, buffers: Policy = "local", rng: Policy = "local"
) -> torch.Tensor:
    """Each local rank's digest of its replicated items: ``[R, 2k]`` float64, two exact
    columns per item of :func:`replica_items`. Pure, no collective, no host sync."""
    items = replica_items(state, buffers=buffers, rng=rng)
    return _to_columns(_hashes(items, state, comm.local_ranks, comm.traced))


def replicas_differ(
    state: Any, comm: Communicator, *, buffers: Policy = "local", rng: Policy = "local"
) -> torch.Tensor:
    """0-d bool tensor, True iff some replicated item differs between ranks (agreed by all).

    One ``all_reduce(max)`` of ``[digest, -digest]`` (``[R, 4k]`` float64):
    the ranks agree iff ``max == -max(-x) == min`` for every column. No host
    sync; traces under ``torch.compile(fullgraph=True)``.
    """
    d = replica_digest(state, comm, buffers=buffers, rng=rng)
    k = d.shape[1]
    m = comm.all_reduce(torch.cat([d, -d], dim=1), "max")
    return (m[:, :k] != -m[:, k:]).any()


def _split_by_value(values: list[tuple[float, ...]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    counts = Counter(values)
    best = max(counts.values())
    major = next(v for v in values if counts[v] == best)  # ties: the value of the lowest rank
    agree = tuple(r for r, v in enumerate(values) if v == major)
    differ = tuple(r for r, v in enumerate(values) if v != major)
    return agree, differ


def _locate(state: Any, comm: Communicator, groups: list[int]) -> dict[int, list[tuple[str, tuple[int, ...]]]]:
    """Per differing flat group: the parameters whose slices differ, and on which ranks.
    One ``all_gather``; every rank calls it with the same ``groups``."""
    layout = state.shard.layout
    rows, w = comm.local_ranks, comm.world_size
    hashes, where = [], []
    for g in groups:
        buf = state.params[g]
        fg = layout.groups[g]
        for si in fg.slots:
            s = layout.slots[si]
            hashes.append(_fold(_words(buf[:, s.offset : s.offset + s.numel], rows)))
            where.append((g, s.path))
        hashes.append(_fold(_words(buf[:, fg.numel :], rows)))  # the padding
        where.append((g, "<padding>"))
    table = comm.all_gather(_to_columns(torch.stack(hashes, dim=1)))[0].reshape(w, len(where), 2).tolist()
    out: dict[int, list[tuple[str, tuple[int, ...]]]] = {g: [] for g in groups}
    for j, (g, path) in enumerate(where):
        agree, differ = _split_by_value([tuple(table[r][j]) for r in range(w)])
        if differ:
            out[g].append((path, differ))
    return out


def digest_parts(
    state: Any, comm: Communicator, *, buffers: Policy = "local", rng: Policy = "local"
) -> torch.Tensor:
    """``[R, 8k]`` float64 to ride on a step's existing ``all_reduce(sum)``: each 64-bit item
    hash cut into four 16-bit values ``d``, followed by their squares ``d*d``.

    After the sum over ranks, :func:`parts_differ` tells whether the ranks agree: by
    Cauchy-Schwarz, ``W * sum(d*d) == sum(d)**2`` for every column iff every rank's ``d``
    is the same, and with 16-bit values both sides are exact integers in float64 up to
    W = 1448 ranks. No collective of its own: no latency added to the step.
    """
    h = _hashes(replica_items(state, buffers=buffers, rng=rng), state, comm.local_ranks, comm.traced)
    d = torch.stack([(h >> s) & 0xFFFF for s in (0, 16, 32, 48)], dim=2).reshape(h.shape[0], -1)
    d = d.to(torch.float64)
    return torch.cat([d, d * d], dim=1)


def parts_differ(summed: torch.Tensor, world_size: int) -> torch.Tensor:
    """0-d bool: the ranks' :func:`digest_parts` differed, given their sum over ranks ``[c]``."""
    if world_size > 1448:
        raise ValueError("parts_differ: 16-bit digests are exact up to 1448 ranks")
    k = summed.shape[-1] // 2
    s1, s2 = summed[..., :k], summed[..., k:]
    return (s2 * world_size != s1 * s1).any()


def check_replicas(
    state: Any,
    comm: Communicator,
    *,
    buffers: Policy = "local",
    rng: Policy = "local",
    locate: bool = True,
) -> None:
    """Raise :class:`ReplicaDivergenceError` on every rank if replicated items differ.

    Eager (reads the result on the host). One ``all_gather`` of the
    ``[R, 2k]`` digests; if a parameter buffer differs and ``locate``, a
    second ``all_gather`` (one digest per parameter of the differing groups)
    names the parameters. ``buffers``: ``"broadcast"`` (module buffers must
    agree, as DDP's ``broadcast_buffers``) or ``"local"`` (per-rank, e.g.
    unsynchronised batch-norm statistics); ``rng``: the same for per-rank
    generator states (``"local"`` by default: ranks usually draw different
    dropout masks).
    """
    items = replica_items(state, buffers=buffers, rng=rng)
    rows, w = comm.local_ranks, comm.world_size
    digest = _to_columns(_hashes(items, state, rows))
    k = len(items)
    table = comm.all_gather(digest)[0].reshape(w, k, 2).tolist()
    found: list[Divergence] = []
    param_groups: dict[int, int] = {}
    for i, (name, t, ranked) in enumerate(items):
        agree, differ = _split_by_value([tuple(table[r][i]) for r in range(w)])
        if differ:
            found.append(Divergence(name, agree, differ))
            if name.startswith("params flat group "):
                param_groups[len(found) - 1] = int(name.split()[3])
    if not found:
        return
    if locate and param_groups and getattr(state.shard, "layout", None) is not None:
        located = _locate(state, comm, sorted(set(param_groups.values())))
        for idx, g in param_groups.items():
            d = found[idx]
            found[idx] = dataclasses.replace(
                d, located=tuple(f"{p} on {'rank' if len(r) == 1 else 'ranks'} {', '.join(map(str, r))}"
                                 for p, r in located[g])
            )
    here = ("rank " if len(comm.ranks) == 1 else "ranks ") + ", ".join(map(str, comm.ranks))
    lines = "\n  ".join(d.describe() for d in found)
    raise ReplicaDivergenceError(
        f"replicas disagree (seen on {here}, world size {w}):\n  {lines}", found
    )


def with_replica_check(
    step: Callable[[Any, Any], tuple[Any, dict]],
    comm: Communicator,
    every: int = 1,
    *,
    mode: Literal["raise", "flag"] = "raise",
    buffers: Policy = "local",
    rng: Policy = "local",
) -> Callable[[Any, Any], tuple[Any, dict]]:
    """``step`` followed, every ``every`` calls, by a replica check of the state it returns.

    ``mode="raise"``: :func:`check_replicas` (eager; raises
    :class:`ReplicaDivergenceError` naming the item and ranks). ``mode="flag"``:
    ``metrics["replicas_differ"]`` (0-d float: 1.0 if replicas differ, 0.0 on
    steps without a check) from :func:`replicas_differ`, with no host sync.
    The call count lives in this Python wrapper, outside a compiled ``step``,
    so nothing recompiles.
    """
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"with_replica_check: every must be a positive int, got {every!r}")
    if mode not in ("raise", "flag"):
        raise ValueError(f"with_replica_check: mode must be 'raise' or 'flag', got {mode!r}")
    _check_policy("buffers", buffers)
    _check_policy("rng", rng)
    calls = 0

    def checked_step(state: Any, batch: Any) -> tuple[Any, dict]:
        nonlocal calls
        new_state, metrics = step(state, batch)
        calls += 1
        due = calls % every == 0
        if mode == "raise":
            if due:
                check_replicas(new_state, comm, buffers=buffers, rng=rng)
            return new_state, metrics
        flag = (
            replicas_differ(new_state, comm, buffers=buffers, rng=rng).to(torch.float32)
            if due else torch.zeros((), dtype=torch.float32)
        )
        return new_state, {**metrics, "replicas_differ": flag}

    return checked_step
