"""Models larger than one rank: ``init_train_state(model, ..., init=...)`` with a meta-device model. The init runs in
``model.apply``'s order; each tensor is created on the state's device (``init_train_state(device=)``, default the CPU) just
before its first module, and cut into this process's
rows and dropped once its piece (:func:`piece_of`) is done; the module stays on meta. Random inits draw from the global
generator as ``model.apply(fn)`` does: seed every rank alike. Weights files: :class:`InitSource`.

Imports: comm, layout, sharding.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.utils._pytree as tp

from .comm import Communicator
from .layout import Layout
from .sharding import ShardState, shard_layout

__all__ = ["Init", "InitFn", "InitSource", "Materialized", "ShardRows", "has_meta", "check_init", "init_fn",
           "init_name", "materialize", "materialized_shard", "init_buffers_of", "to_empty_tied", "agree",
           "generator_digest"]

InitFn = Callable[[torch.nn.Module], Any]
RESET = "reset_parameters"


@dataclasses.dataclass(frozen=True)
class Materialized:
    """``master``: per flat group ``[R, shard_numel]``, master dtype, zero padded; ``frozen``: frozen parameters, layout
    order (stage 3: ``[R, shard_numel]`` per frozen group); ``buffers``: ``[R, *shape]``, ``named_buffers`` order."""

    master: tuple[torch.Tensor, ...]
    frozen: tuple[torch.Tensor, ...]
    buffers: tuple[torch.Tensor, ...]


@runtime_checkable
class InitSource(Protocol):
    """An init that builds the shards itself (weights from files: :func:`fzero.pretrained`)."""

    def materialize(self, module: torch.nn.Module, layout: Layout, comm: Communicator,
                    units: Sequence[str], device: torch.device) -> Materialized: ...


Init = str | InitFn | InitSource


def has_meta(params: Any) -> bool:
    """Whether any parameter or buffer of ``params`` (module or pytree) is on the meta device."""
    is_module = isinstance(params, torch.nn.Module)
    tensors = (*params.parameters(), *params.buffers()) if is_module else tp.tree_leaves(params)
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors)


_WHAT_TO_PASS = (
    "init='reset_parameters' (each module's own reset_parameters, FSDP2's to_empty + reset_parameters), init=fn "
    "(fn(module) on every module in model.apply's order; a transformers model: init=model._init_weights), "
    "or init=fzero.pretrained(path) (weights from a safetensors or torch.save file)")


def check_init(params: Any, init: Init | None) -> None:
    """``ValueError`` if ``params`` is on the meta device without ``init``; ``TypeError`` for an ``init`` that is
    not ``"reset_parameters"``, a callable or an :class:`InitSource`, or one given with a pytree."""
    if init is None:
        if has_meta(params):
            raise ValueError(
                "init_train_state: the model is on the meta device (shapes, no values), so there is "
                f"nothing to shard; say how to fill it: {_WHAT_TO_PASS}")
        return
    if not isinstance(params, torch.nn.Module):
        raise TypeError(f"init_train_state: init= fills an nn.Module, got {type(params).__name__}")
    if not (init == RESET or callable(init) or isinstance(init, InitSource)):
        raise TypeError(f"init_train_state: init must be one of {_WHAT_TO_PASS}; got {init!r}")


def init_name(init: str | InitFn) -> str:
    """How errors name ``init``."""
    name = getattr(init, "__qualname__", None) or type(init).__name__
    return "init='reset_parameters'" if init == RESET else f"init={name}"


def init_fn(init: str | InitFn) -> InitFn:
    """The per-module function of ``init``: ``"reset_parameters"`` or ``fn`` itself."""
    if init == RESET:
        return _reset_parameters
    if callable(init):
        return init
    raise TypeError(f"init must be 'reset_parameters' or a function of a module, got {init!r}")


def _reset_parameters(module: torch.nn.Module) -> None:
    if callable(reset := getattr(module, RESET, None)):
        reset()


def generator_digest() -> list[float]:
    """A 64-bit digest of the global CPU generator's state, as four exact 16-bit floats."""
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).digest()
    return [float(int.from_bytes(digest[k : k + 2], "little")) for k in range(0, 8, 2)]


def agree(comm: Communicator, failure: Exception | None, digest: list[float] | None) -> None:
    """Raise on every rank if materialising failed on any rank (``failure`` as it is), or (``digest`` given) the
    ranks' generators differed. One ``all_reduce(max)`` of 9 float64 on the communicator's device, read back to the
    host; none when this process holds every rank."""
    if comm.local_ranks < comm.data_world_size:
        parts = digest or [0.0] * 4
        x = torch.tensor([parts + [-p for p in parts] + [float(failure is not None)]], dtype=torch.float64,
                         device=comm.device)
        top = comm.all_reduce_replicas_start(comm.all_reduce(x.repeat(comm.local_ranks, 1), "max"), "max")()[0].cpu()
        if failure is None and top[8] > 0:
            raise ValueError("init_train_state: another rank failed to fill the model (its error says why); this "
                             "rank stops too, rather than wait for it in the first step")
        if failure is None and not torch.equal(top[:4], -top[4:8]):
            raise ValueError("init_train_state: the ranks' global random generators differ, so a random init would "
                             "build a different model on each rank; call torch.manual_seed(s) with the same s on "
                             "every rank before init_train_state (as for an eagerly built model)")
    if failure is not None:
        raise failure


class ShardRows:
    """This process's master rows: ``rows[g]``, ``[R, shard_numel]``, master dtype, zero padded (``frozen``: stage 3's
    frozen group rows, in their dtype); :meth:`write` copies as :func:`fzero.layout.flat_shard` does."""

    def __init__(self, layout: Layout, ranks: Sequence[int], device: torch.device | str | None = None):
        self.layout = layout
        self.ranks = tuple(ranks)
        self.rows = tuple(torch.zeros(len(self.ranks), g.shard_numel, dtype=g.master_dtype, device=device)
                          for g in layout.groups)
        self.frozen = tuple(torch.zeros(len(self.ranks), g.shard_numel, dtype=g.dtype, device=device)
                            for g in layout.frozen_groups)

    def write(self, i: int, read: Callable[[int, int], torch.Tensor]) -> None:
        """Slot ``i``'s owned parts; ``read(start, stop)``: its flat elements ``[start, stop)`` (1-D, any float)."""
        s = self.layout.slots[i]
        rows, g = (self.rows, s.group) if s.group >= 0 else (self.frozen, s.frozen_group)
        n = rows[g].shape[1]
        for row, r in enumerate(self.ranks):
            a, b = max(r * n, s.offset), min((r + 1) * n, s.offset + s.numel)
            if a < b:
                rows[g][row, a - r * n : b - r * n].copy_(read(a - s.offset, b - s.offset))


@dataclasses.dataclass(eq=False)
class _Entry:
    """One distinct tensor of a module: canonical name, every place it is registered, what the walk installed."""

    name: str
    is_param: bool
    original: torch.Tensor
    slots: list[tuple[dict, str]] = dataclasses.field(default_factory=list)
    owners: list[str] = dataclasses.field(default_factory=list)
    owner_type: str = ""
    installed: torch.Tensor | None = None
    version: int = 0


def _entries(module: torch.nn.Module) -> list[_Entry]:
    """Every distinct parameter and buffer, named as ``named_parameters``/``named_buffers`` name it."""
    canonical = {id(t): (name, False) for name, t in module.named_buffers()}  # each tensor's first name
    canonical.update({id(t): (name, True) for name, t in module.named_parameters()})
    entries: dict[int, _Entry] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        for table in (m._parameters, m._buffers):
            for attr, t in table.items():
                if t is None:
                    continue
                name, is_param = canonical[id(t)]
                e = entries.setdefault(id(t), _Entry(name, is_param, t, owner_type=type(m).__name__))
                e.slots.append((table, attr))
                e.owners.append(prefix)
    return list(entries.values())


def _fresh(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Like ``t`` on ``device``: uninitialised if either is meta, else a copy (the init writes into it)."""
    data = (torch.empty(t.shape, dtype=t.dtype, device=device) if t.is_meta or device.type == "meta"
            else t.detach().to(device, copy=True))
    return torch.nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else data


def _install(e: _Entry, t: torch.Tensor) -> None:
    for table, attr in e.slots:
        table[attr] = t
    e.installed, e.version = t, t._version


def _restore(entries: Iterable[_Entry]) -> None:
    for e in entries:
        for table, attr in e.slots:
            table[attr] = e.original
        e.installed = None


def _take(e: _Entry, who: str, hint: str = _WHAT_TO_PASS) -> torch.Tensor:
    """The value the init left for ``e`` (``who`` names the init in errors, ``hint`` what to give instead)."""
    held = {id(table[attr]): table[attr] for table, attr in e.slots}
    if len(held) > 1:
        raise ValueError(
            f"{who} replaced {e.name!r} under some of its tied names only "
            f"({', '.join(o or '<root>' for o in e.owners)})")
    t = next(iter(held.values()))
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{who} removed {e.name!r}")
    if t is not e.installed and (tuple(t.shape) != tuple(e.original.shape) or t.dtype != e.original.dtype):
        raise ValueError(
            f"{who} replaced {e.name!r} ({tuple(e.original.shape)} {e.original.dtype}) by a tensor "
            f"{tuple(t.shape)} {t.dtype}")
    unwritten = t is e.installed and t._version == e.version
    # a state built on the meta device (shapes only, as a test of where tensors go) installs meta tensors: written
    # is what counts there
    if e.original.is_meta and (unwritten or (t.is_meta and not e.installed.is_meta)):
        kind = "parameter" if e.is_param else "buffer"
        raise ValueError(
            f"{who} did not write {kind} {e.name!r} (of module {e.owners[0] or '<root>'!r}, a "
            f"{e.owner_type}), which is on the meta device: it would hold uninitialised memory. "
            f"Give an init that writes it: {hint}")
    return t.detach()


def _check_untouched(closed: Iterable[_Entry], module_name: str, who: str) -> None:
    for e in closed:
        if any(table[attr] is not e.installed for table, attr in e.slots) or e.installed._version != e.version:
            raise ValueError(
                f"{who} of module {module_name or '<root>'!r} wrote {e.name!r} after fzero had cut it "
                "into shards (its piece was complete): an ancestor's init reaching into a finished "
                "unit. Initialise it from its own module, or choose units that contain both")


def _apply_order(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Modules in the order ``module.apply(fn)`` calls ``fn``: children first, then the module."""
    for child in module.children():
        yield from _apply_order(child)
    yield module


def piece_of(name: str, units: Sequence[str]) -> str:
    """Top of ``name``'s piece: its unit, else its largest unit-free subtree below the root, else ``name``."""
    for u in units:
        if name == u or name.startswith(u + "."):
            return u
    parts = name.split(".") if name else []
    for k in range(1, len(parts) + 1):
        top = ".".join(parts[:k])
        if not any(u == top or u.startswith(top + ".") for u in units):
            return top
    return name


def _schedule(module: torch.nn.Module, entries: Sequence[_Entry], units: Sequence[str]) -> tuple[
        list[torch.nn.Module], list[str], dict[int, list[_Entry]], dict[int, list[_Entry]], set[int]]:
    """The modules in ``apply`` order, their names, the tensors opened before and closed after each visit, and the
    visits that may reach a finished piece (ancestors of a piece's top module)."""
    visits = list(_apply_order(module))
    named = dict(module.named_modules(remove_duplicate=False))
    first = {id(m): i for i, m in reversed(list(enumerate(visits)))}  # a shared module: its first visit
    last = {id(m): i for i, m in enumerate(visits)}
    first_name = {id(m): name for name, m in reversed(list(named.items()))}
    opens: dict[int, list[_Entry]] = {}
    closes: dict[int, list[_Entry]] = {}
    tops: set[str] = set()
    for e in entries:
        start = min(first[id(named[o])] for o in e.owners)
        stop = max(last[id(named[piece_of(o, units)])] for o in e.owners)
        opens.setdefault(start, []).append(e)
        closes.setdefault(stop, []).append(e)
        tops.update(piece_of(o, units) for o in e.owners)
    names = [first_name[id(m)] for m in visits]
    above = {i for i, n in enumerate(names) if any(t != n and (n == "" or t.startswith(n + ".")) for t in tops)}
    return visits, names, opens, closes, above


def _walk(module: torch.nn.Module, fn: InitFn, who: str, units: Sequence[str],
          cut: Callable[[_Entry, torch.Tensor], None], device: torch.device) -> None:
    """Run ``fn`` on every module in ``apply`` order with each tensor live only within its piece;
    ``cut(entry, value)`` takes each value as its piece completes. The module's tensors are restored."""
    entries = _entries(module)
    visits, names, opens, closes, above = _schedule(module, entries, units)
    closed: list[_Entry] = []
    try:
        for i, m in enumerate(visits):
            for e in opens.get(i, ()):
                _install(e, _fresh(e.original, device))
            with torch.no_grad():
                fn(m)
            if i in above:  # only an ancestor of a finished piece can reach into it
                _check_untouched(closed, names[i], who)
            for e in closes.get(i, ()):
                cut(e, _take(e, who))
                _install(e, _fresh(e.original, torch.device("meta")))
                closed.append(e)
    finally:
        _restore(entries)


def materialize(module: torch.nn.Module, layout: Layout, comm: Communicator, init: Init,
                units: Sequence[str] = (), device: torch.device | str = "cpu") -> Materialized:
    """The :class:`Materialized` of ``module`` filled by ``init``, every tensor on ``device`` (each piece built and
    initialised there). ``ValueError`` if the init leaves a meta tensor unwritten, writes a finished piece, breaks ties
    or changes a shape or dtype. Collective: :func:`agree`."""
    device = torch.device(device)
    digest = None if isinstance(init, InitSource) else generator_digest()
    try:
        made = (init.materialize(module, layout, comm, units, device) if isinstance(init, InitSource)
                else _random_init(module, layout, comm.ranks, init, units, device))
    except Exception as e:  # noqa: BLE001 - every rank learns of it (agree), then it is raised
        agree(comm, e, digest)
        raise
    agree(comm, None, digest)
    return made


def _random_init(module: torch.nn.Module, layout: Layout, ranks: Sequence[int], init: str | InitFn,
                 units: Sequence[str], device: torch.device) -> Materialized:
    """:func:`materialize` by ``"reset_parameters"`` or ``fn(module)``: the walk on ``device``, cutting each tensor."""
    fn = init_fn(init)
    rows = ShardRows(layout, ranks, device)
    slot_of = {s.path: i for i, s in enumerate(layout.slots)}
    frozen: dict[int, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}

    def cut(e: _Entry, value: torch.Tensor) -> None:
        if not e.is_param:
            buffers[e.name] = value.unsqueeze(0).repeat(len(rows.ranks), *([1] * value.dim()))
            return
        i = slot_of[e.name]
        if layout.slots[i].group >= 0 or layout.slots[i].frozen_group >= 0:
            flat = value.reshape(-1)
            rows.write(i, lambda start, stop: flat[start:stop])
        else:  # kept whole; a tensor the init put in place of ours may be the caller's: copied
            frozen[i] = value if value.data_ptr() == e.installed.data_ptr() else value.clone()

    _walk(module, fn, init_name(init), units, cut, device)
    return Materialized(rows.rows, rows.frozen or tuple(frozen[i] for i, s in enumerate(layout.slots) if s.group < 0),
                        tuple(buffers[n] for n, _ in module.named_buffers()))


def materialized_shard(module: torch.nn.Module, comm: Communicator, init: Init, units: Sequence[str] = (),
                       **layout_kw: Any) -> tuple[ShardState, tuple[torch.Tensor, ...]]:
    """:func:`fzero.sharding.init_shard` for a module filled by ``init`` (:func:`materialize`), and its buffers
    ``[R, *shape]``. ``layout_kw``: for :func:`fzero.sharding.shard_layout`. Collective (with ``comm.check_layout``)."""
    layout = shard_layout(module, comm, **layout_kw)
    made = materialize(module, layout, comm, init, units)  # on the CPU, as init_shard of a CPU module
    return ShardState(made.master, made.frozen, layout), made.buffers


def init_buffers_of(module: torch.nn.Module, names: Iterable[str], fn: InitFn, who: str,
                    hint: str = _WHAT_TO_PASS) -> dict[str, torch.Tensor]:
    """Buffers ``names`` (e.g. a rotary ``inv_freq``) made on CPU by ``fn`` on their modules, in ``apply`` order,
    generator forked, module unchanged. ``ValueError`` if ``fn`` left one unwritten."""
    wanted = set(names)
    entries = [e for e in _entries(module) if not e.is_param and e.name in wanted]
    out = {e.name: e.original.detach().clone() for e in entries if not e.original.is_meta}
    todo = [e for e in entries if e.original.is_meta]
    if not todo:
        return out
    owners = {id(module.get_submodule(o)) for e in todo for o in e.owners}
    try:
        for e in todo:
            _install(e, _fresh(e.original, torch.device("cpu")))
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for m in list(_apply_order(module)):
                if id(m) in owners:
                    fn(m)
        for e in todo:
            out[e.name] = _take(e, who, hint)
    finally:
        _restore(todo)
    return out


def to_empty_tied(module: torch.nn.Module, device: str | torch.device = "cpu") -> torch.nn.Module:
    """``module.to_empty(device=device)`` for its meta tensors, ties kept; returns ``module`` (values uninitialised)."""
    device = torch.device(device)
    for e in _entries(module):
        if e.original.is_meta:
            _install(e, _fresh(e.original, device))
    return module
