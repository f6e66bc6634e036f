"""Cross-rank agreement of everything a training state keeps replicated (replicas drift silently: nondeterministic
kernels, bit flips, another checkpoint loaded). Each rank hashes what must be identical (:func:`replica_items`) and one
small collective compares the hashes: :func:`replicas_differ` is pure tensor code (no host sync, ``fullgraph=True``),
:func:`check_replicas` eager and names what differs where. States are duck-typed (``shard``, ``opt``, ``scaler``,
``params``, optionally ``precision``, ``buffers``, ``rng``, ``module``), of one structure on every rank.

Imports: comm.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from .comm import Communicator

__all__ = ["ReplicaDivergenceError", "Divergence", "replica_items", "replica_digest", "replicas_differ",
           "check_replicas", "with_replica_check", "digest_parts", "parts_differ"]

Policy = Literal["broadcast", "local"]
Item = tuple[str, torch.Tensor | None, bool]

_K1 = 0x1E3779B97F4A7C15  # odd
_K2 = 0x2545F4914F6CDD1C  # even
_BLOCK = 64
_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_SCALER_STATIC = ("growth_factor", "backoff_factor", "growth_interval", "min_scale", "hysteresis", "dynamic")


class ReplicaDivergenceError(ValueError):
    """Ranks hold different values of something replicated; ``differences``: a :class:`Divergence` per item."""

    def __init__(self, message: str, differences: Sequence[Divergence] = ()):
        super().__init__(message)
        self.differences = tuple(differences)


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


@dataclasses.dataclass(frozen=True)
class Divergence:
    """A differing replicated item: ``agree`` ranks hold the majority value (ties: lowest rank's), ``differ`` the
    others; ``located``: a parameter buffer's differing parameters."""

    item: str
    agree: tuple[int, ...]
    differ: tuple[int, ...]
    located: tuple[str, ...] = ()

    def describe(self) -> str:
        tie = len(self.agree) == len(self.differ)  # no majority (e.g. two ranks)
        others = f"from {_ranks(self.agree)}" if tie else f"({_ranks(self.agree)} agree)"
        text = f"{self.item} differs on {_ranks(self.differ)} {others}"
        return text + (f" [parameters: {', '.join(self.located)}]" if self.located else "")


def _check_policies(buffers: str, rng: str) -> None:
    for name, value in (("buffers", buffers), ("rng", rng)):
        if value not in ("broadcast", "local"):
            raise ValueError(f"{name} must be 'broadcast' or 'local', got {value!r}")


def _named(state: Any, field: str) -> list[tuple[str, torch.Tensor]]:
    """The state's ``buffers``/``rng`` (tensor, sequence or dict), named by key, ``module`` buffer name or index."""
    given = getattr(state, field, None)
    if isinstance(given, dict):
        return [(f"{field}[{k!r}]", t) for k, t in given.items()]
    values = () if given is None else (given,) if isinstance(given, torch.Tensor) else tuple(given)
    spec = getattr(getattr(state, "module", None), "buffers", ()) if field == "buffers" else ()
    names = [repr(n) for n in spec] if len(spec) == len(values) else [str(i) for i in range(len(values))]
    return [(f"{field}[{n}]", t) for n, t in zip(names, values)]


def _signature_of(layout: Any, optimizer: Any, scaler_static: tuple, precision: Any) -> int:
    """A 64-bit hash of the layout fingerprint, optimizer signature and groups, scaler rule, precision policy."""
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


# torch.compiler.assume_constant_result's mark, set without importing torch._dynamo (seconds of import time)
_signature_of._dynamo_marked_constant = True  # type: ignore[attr-defined]


def replica_items(state: Any, *, buffers: Policy = "local", rng: Policy = "local") -> list[Item]:
    """``[(name, tensor, has_rank_axis)]`` that must agree across ranks (not master shards or moments), first
    ``("static", None, False)``; ``buffers``/``rng`` only under ``"broadcast"``. ``ValueError`` for another policy."""
    _check_policies(buffers, rng)
    items: list[Item] = [("static", None, False)]
    items += [(f"scaler.{k}", getattr(state.scaler, k), False) for k in ("scale", "growth_tracker", "hysteresis_left")]
    items.append(("opt.step", state.opt.step, False))
    items += [("opt.missed", m, False) for m in getattr(state.opt, "missed", ())]
    optimizer = getattr(state.opt, "optimizer", None)
    items += [(f"opt.scalars[{n!r}]", v, False)
              for n, v in zip(getattr(optimizer, "scalar_names", ()), getattr(state.opt, "scalars", ()))]
    items += [(f"opt.vectors[{n!r}]", v, False)  # empty when no parameter has one
              for n, v in zip(getattr(optimizer, "vector_names", ()), getattr(state.opt, "vectors", ())) if v.numel()]
    for g, hyper in enumerate(state.opt.hyper):
        items += [(f"opt.hyper[{g}][{k!r}]", v, False) for k, v in hyper.items()]
    layout = getattr(state.shard, "layout", None)
    for g, p in enumerate(state.params):
        what = f"params flat group {g}"
        if layout is not None and g < len(layout.groups):
            fg = layout.groups[g]
            if fg.axis:  # a parameter group's values differ between its rank groups: not a replica of the world's
                continue
            what += f" ({str(fg.dtype).replace('torch.', '')}, {len(fg.slots)} parameters)"
        items.append((what, p, True))
    paths = ([s.path for s in layout.slots if s.group < 0] if layout is not None
             else [str(i) for i in range(len(state.shard.frozen))])
    if not getattr(layout, "frozen_groups", ()):  # stage 3's are shards, each rank's its own
        items += [(f"frozen[{path!r}]", t, False) for path, t in zip(paths, state.shard.frozen)]
    for field, policy in (("buffers", buffers), ("rng", rng)):
        if policy == "broadcast":
            items += [(name, t, True) for name, t in _named(state, field)]
    return items


def _words(x: torch.Tensor, rows: int, traced: bool = False) -> torch.Tensor:
    """Each row of ``x``'s bits as int64 words ``[rows, n]``: 64-bit words if a row's length allows, else its own."""
    x = x.detach().reshape(rows, -1)
    x = (x.view(torch.uint8) if x.dtype == torch.bool else x).contiguous()
    es = x.element_size()
    if es not in _INT_OF_SIZE:  # complex128 and the like: read as 8-byte words
        x = x.view(torch.int64) if (x.shape[1] * es) % 8 == 0 else x.view(torch.uint8)
        es = x.element_size()
    if es < 8 and x.shape[1] % (8 // es) == 0 and x.shape[1] > 0:
        if not traced and (x.storage_offset() * es) % 8:
            x = x.clone()
        return x.view(torch.int64)
    return x.view(_INT_OF_SIZE[es]).to(torch.int64)


def _fold(words: torch.Tensor) -> torch.Tensor:
    """``[rows, n]`` int64 words -> ``[rows]`` hashes ``K1 * sum(words) + K2 * sum(i * block_i)`` (64-word blocks, mod
    2**64): exact, and any one changed word changes it."""
    rows, n = words.shape
    m = n - n % _BLOCK
    nb = m // _BLOCK
    blocks = words[:, :m].reshape(rows, nb, _BLOCK).sum(2)
    tail = words[:, m:].sum(1)
    pos = torch.arange(1, nb + 1, dtype=torch.int64, device=words.device)
    s1 = blocks.sum(1) + tail
    s2 = (blocks * pos).sum(1) + tail * (nb + 1)
    return s1 * _K1 + s2 * _K2


def _to_columns(h: torch.Tensor) -> torch.Tensor:
    """``[rows, k]`` int64 -> ``[rows, 2k]`` float64 (low, high 32 bits of each; exact)."""
    return torch.stack([(h & 0xFFFFFFFF).to(torch.float64), (h >> 32).to(torch.float64)], dim=2).reshape(h.shape[0], -1)


def _sent(x: torch.Tensor, device: torch.device, traced: bool) -> torch.Tensor:
    """Host tensor ``x`` on ``device``: on CUDA from pinned memory, asynchronously (a copy from pageable memory waits
    for the device to finish its queue)."""
    if traced:
        return x.to(device)
    return (x.pin_memory() if device.type == "cuda" else x).to(device, non_blocking=True)


def _hashes(items: list[Item], state: Any, rows: int, traced: bool = False) -> torch.Tensor:
    """``[rows, k]`` int64, a hash per item: 0-d replicated ones (and "static") their bits, others :func:`_fold`."""
    device = state.device  # its digests live there, and the collectives that compare them
    static = (getattr(state.shard, "layout", None), getattr(state.opt, "optimizer", None),
              tuple(getattr(state.scaler, k, None) for k in _SCALER_STATIC), getattr(state, "precision", None))
    # each 0-d item's bits as one int64 where it lives: the host's (the signature, hyperparameters) sent to the
    # device in one copy (_sent)
    host: list[tuple[int, torch.Tensor]] = [(0, torch.tensor(_signature_of(*static), dtype=torch.int64, device="cpu"))]
    on_device: list[tuple[int, torch.Tensor]] = []
    folded = []
    for i, (_, t, ranked) in enumerate(items[1:], 1):
        if ranked or t.dim() > 0:
            folded.append(i)
            continue
        v = t.detach().view(torch.uint8) if t.dtype == torch.bool else t.detach()
        es = v.element_size()
        if es not in _INT_OF_SIZE:  # complex128: the sum of its words
            v, es = v.reshape(1).view(torch.int64).sum(), 8
        (host if v.device.type == "cpu" else on_device).append((i, v.view(_INT_OF_SIZE[es]).to(torch.int64)))
    cols, order = [], []
    for group, sent in ((host, device.type != "cpu"), (on_device, False)):
        if not group:
            continue
        bits = torch.stack([v for _, v in group])
        cols.append((_sent(bits, device, traced) if sent else bits).unsqueeze(0).expand(rows, -1))
        order += [i for i, _ in group]
    for i in folded:
        _, t, ranked = items[i]
        h = _fold(_words(t, rows if ranked else 1, traced))  # where t lives: a host one's hashes alone are sent
        h = _sent(h, device, traced) if h.device != device else h
        cols.append((h if ranked else h.expand(rows)).unsqueeze(1))
        order.append(i)
    out = torch.cat(cols, dim=1) if len(cols) > 1 else cols[0]
    if order == list(range(len(order))):
        return out
    return out[:, sorted(range(len(order)), key=order.__getitem__)]  # the columns back in item order


def replica_digest(state: Any, comm: Communicator, *, buffers: Policy = "local", rng: Policy = "local") -> torch.Tensor:
    """Each local rank's digest: ``[R, 2k]`` float64, low and high 32 bits of each item's hash. No collective or
    sync."""
    return _to_columns(_hashes(replica_items(state, buffers=buffers, rng=rng), state, comm.local_ranks, comm.traced))


def replicas_differ(state: Any, comm: Communicator, *, buffers: Policy = "local",
                    rng: Policy = "local") -> torch.Tensor:
    """0-d bool tensor, True on every rank iff some replicated item differs between ranks: one ``all_reduce(max)`` of
    ``[digest, -digest]`` (``[R, 4k]`` float64). No host sync; traces under ``torch.compile(fullgraph=True)``."""
    d = replica_digest(state, comm, buffers=buffers, rng=rng)
    m = comm.all_reduce(torch.cat([d, -d], dim=1), "max")
    return (m[:, : d.shape[1]] != -m[:, d.shape[1] :]).any()


def _compare(comm: Communicator, h: torch.Tensor) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """One ``all_gather`` of the ``[R, k]`` hashes ``h`` (on the state's device), read back to the host; per column
    ``(agree, differ)`` as in :class:`Divergence`."""
    w, k = comm.world_size, h.shape[1]
    table = comm.all_gather(_to_columns(h))[0].cpu().reshape(w, k, 2).tolist()
    out = []
    for j in range(k):
        values = [tuple(table[r][j]) for r in range(w)]
        counts = Counter(values)
        major = next(v for v in values if counts[v] == max(counts.values()))
        out.append((tuple(r for r, v in enumerate(values) if v == major),
                    tuple(r for r, v in enumerate(values) if v != major)))
    return out


def _locate(state: Any, comm: Communicator, groups: list[int]) -> dict[int, list[tuple[str, tuple[int, ...]]]]:
    """Per flat group of ``groups``: the parameters (and ``<padding>``) that differ, and where. One ``all_gather``."""
    layout, rows = state.shard.layout, comm.local_ranks
    hashes, where = [], []
    for g in groups:
        buf, fg = state.params[g], layout.groups[g]
        spans = [(s.path, s.offset, s.offset + s.numel) for s in (layout.slots[si] for si in fg.slots)]
        for path, lo, hi in [*spans, ("<padding>", fg.numel, None)]:
            hashes.append(_fold(_words(buf[:, lo:hi], rows)))
            where.append((g, path))
    out: dict[int, list[tuple[str, tuple[int, ...]]]] = {g: [] for g in groups}
    for (g, path), (_, differ) in zip(where, _compare(comm, torch.stack(hashes, dim=1))):
        if differ:
            out[g].append((path, differ))
    return out


def digest_parts(state: Any, comm: Communicator, *, buffers: Policy = "local", rng: Policy = "local") -> torch.Tensor:
    """``[R, 8k]`` float64 to ride on a step's ``all_reduce(sum)`` (no collective of its own): each item hash as four
    16-bit values ``d``, then ``d*d``; summed, ``W * sum(d*d) == sum(d)**2`` iff all ranks agree."""
    h = _hashes(replica_items(state, buffers=buffers, rng=rng), state, comm.local_ranks, comm.traced)
    d = torch.stack([(h >> s) & 0xFFFF for s in (0, 16, 32, 48)], dim=2).reshape(h.shape[0], -1).to(torch.float64)
    return torch.cat([d, d * d], dim=1)


def parts_differ(summed: torch.Tensor, world_size: int) -> torch.Tensor:
    """0-d bool: the ranks' :func:`digest_parts` (``summed`` over ranks) differed. ``ValueError`` past 1448 ranks."""
    if world_size > 1448:
        raise ValueError("parts_differ: 16-bit digests are exact up to 1448 ranks")
    k = summed.shape[-1] // 2
    s1, s2 = summed[..., :k], summed[..., k:]
    return (s2 * world_size != s1 * s1).any()


def check_replicas(state: Any, comm: Communicator, *, buffers: Policy = "local", rng: Policy = "local",
                   locate: bool = True) -> None:
    """Raise :class:`ReplicaDivergenceError` on every rank if replicated items differ, naming items and ranks.
    Eager: one ``all_gather`` of the ``[R, 2k]`` digests, with ``locate`` a second naming a differing group's
    parameters. ``buffers``/``rng``: ``"broadcast"`` (must agree, as DDP's ``broadcast_buffers``) or ``"local"``."""
    items = replica_items(state, buffers=buffers, rng=rng)
    compared = _compare(comm, _hashes(items, state, comm.local_ranks))
    found = [Divergence(name, agree, differ) for (name, _, _), (agree, differ) in zip(items, compared) if differ]
    if not found:
        return
    groups = {d.item: int(d.item.split()[3]) for d in found if d.item.startswith("params flat group ")}
    if locate and groups and getattr(state.shard, "layout", None) is not None:
        located = _locate(state, comm, sorted(set(groups.values())))
        found = [dataclasses.replace(d, located=tuple(f"{p} on {_ranks(r)}" for p, r in located[groups[d.item]]))
                 if d.item in groups else d for d in found]
    lines = "\n  ".join(d.describe() for d in found)
    raise ReplicaDivergenceError(
        f"replicas disagree (seen on {_ranks(comm.ranks)}, world size {comm.world_size}):\n  {lines}", found)


def with_replica_check(step: Callable[[Any, Any], tuple[Any, dict]], comm: Communicator, every: int = 1, *,
                       mode: Literal["raise", "flag"] = "raise", buffers: Policy = "local",
                       rng: Policy = "local") -> Callable[[Any, Any], tuple[Any, dict]]:
    """``step`` followed, every ``every`` calls (counted here, outside a compiled ``step``), by a check of the
    state it returns: :func:`check_replicas` (``mode="raise"``) or ``metrics["replicas_differ"]`` (``"flag"``:
    0-d float, 1.0 if :func:`replicas_differ`, else 0.0; no host sync). ``ValueError`` for bad arguments."""
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"with_replica_check: every must be a positive int, got {every!r}")
    if mode not in ("raise", "flag"):
        raise ValueError(f"with_replica_check: mode must be 'raise' or 'flag', got {mode!r}")
    _check_policies(buffers, rng)
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
        flag = (replicas_differ(new_state, comm, buffers=buffers, rng=rng).to(torch.float32)
                if due else torch.zeros((), dtype=torch.float32, device=new_state.device))
        return new_state, {**metrics, "replicas_differ": flag}

    return checked_step
