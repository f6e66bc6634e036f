"""Models larger than one rank: a module built on the meta device, materialised piece by
piece into this process's shards.

``init_train_state(model, ..., init=...)`` with ``model`` built under
``torch.device("meta")`` (shapes and dtypes, no values) never creates the whole
model: the module is walked in ``nn.Module.apply``'s order (children first, in
registration order, then the module itself), and

* a tensor is created on the CPU (``torch.empty``; a tensor that is not on the
  meta device is copied) just before the first module that registers it is
  visited, and installed under every name it has (tied names stay tied,
  which ``Module.to_empty`` does not keep);
* the init runs on every visited module: ``"reset_parameters"`` calls the
  module's own ``reset_parameters()`` where it has one (FSDP2's meta-device
  recipe, ``to_empty`` + ``reset_parameters``), a function ``fn(module)`` is
  called on every module, as ``model.apply(fn)`` calls it;
* a tensor is cut into this process's shard rows (:class:`ShardRows`; frozen
  parameters and buffers are kept whole, as the state keeps them) and dropped
  as soon as its *piece* has been visited: a stage-3 unit (see
  :mod:`fzero.units`), or a largest subtree outside the units; the own tensors
  of a module that contains units wait for that module's init.

So a process holds its shards, one piece, and the tensors tied across pieces
(GPT-2's ``wte``/``lm_head``: one tensor). The module itself stays on the meta
device: the walk puts every original tensor back, even on error.

Checks, each a ``ValueError`` naming the tensor: a meta tensor the init did not
write (``_version`` unchanged and not replaced: it would be uninitialised
memory), a tensor written after it was cut (an init of an ancestor reaching
into a finished piece: the shards would not hold what the eager model holds),
tied names replaced apart, a replacement of another shape or dtype; and, on a
real process group, one collective at the end (:func:`agree`): every rank raises
if any rank failed (rather than wait for it in the first step), or if the ranks'
global generators differed before a random init (their shards would come from
different models).

Same numbers as eagerly: the init draws from the global generator in the
walk's order, one module at a time, as ``model.apply(fn)`` on the eagerly built
model does (and as construction does for modules that build their children
before resetting themselves). Seed the generator identically on every rank.

Weights from files are an :class:`InitSource` (:func:`fzero.pretrained`), which
builds the shards its own way and uses :func:`init_buffers_of` for what files
do not hold.

Imports: ``fzero.comm``, ``fzero.layout``, ``fzero.sharding``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence, Union, runtime_checkable

import torch

from .comm import Communicator
from .layout import Layout, named_leaves
from .sharding import ShardState, shard_layout

__all__ = [
    "Init",
    "InitFn",
    "InitSource",
    "Materialized",
    "ShardRows",
    "has_meta",
    "check_init",
    "init_fn",
    "init_name",
    "materialize",
    "materialized_shard",
    "init_buffers_of",
    "to_empty_tied",
    "agree",
    "generator_digest",
]

InitFn = Callable[[torch.nn.Module], Any]
RESET = "reset_parameters"


@dataclasses.dataclass(frozen=True)
class Materialized:
    """What a materialised module gives the state.

    ``master``: per flat group, ``[R, shard_numel]`` in its master dtype (zero padding);
    ``frozen``: the frozen parameters whole, in layout order; ``buffers``: every buffer
    ``[R, *shape]`` in its own dtype, in ``named_buffers`` order (as :func:`fzero.module.init_buffers`).
    """

    master: tuple[torch.Tensor, ...]
    frozen: tuple[torch.Tensor, ...]
    buffers: tuple[torch.Tensor, ...]


@runtime_checkable
class InitSource(Protocol):
    """An init that builds the shards itself (weights from files: :func:`fzero.pretrained`)."""

    def materialize(
        self, module: torch.nn.Module, layout: Layout, comm: Communicator, units: Sequence[str]
    ) -> Materialized: ...


Init = Union[str, InitFn, InitSource]


# ----------------------------------------------------------------------------- checks


def has_meta(params: Any) -> bool:
    """Whether any parameter or buffer of ``params`` (module or pytree) is on the meta device."""
    if isinstance(params, torch.nn.Module):
        tensors: Iterable[Any] = (*params.parameters(), *params.buffers())
    else:
        tensors = (x for _, x in named_leaves(params)[0])
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors)


_WHAT_TO_PASS = (
    "init='reset_parameters' (each module's own reset_parameters, FSDP2's to_empty + reset_parameters), "
    "init=fn (fn(module) on every module in model.apply's order; a transformers model: "
    "init=model._init_weights), or init=fzero.pretrained(path) (weights from a safetensors or "
    "torch.save file)"
)


def check_init(params: Any, init: Optional[Init]) -> None:
    """Raise when ``params`` on the meta device has no ``init``, or ``init`` is not one fzero takes.

    ``ValueError`` for a meta model without ``init`` (a meta tensor has no values; the
    message says what to pass); ``TypeError`` for an ``init`` that is not
    ``"reset_parameters"``, a callable or an :class:`InitSource`, or given with a pytree.
    """
    if init is None:
        if has_meta(params):
            raise ValueError(
                "init_train_state: the model is on the meta device (shapes, no values), so there is "
                f"nothing to shard; say how to fill it: {_WHAT_TO_PASS}"
            )
        return
    if not isinstance(params, torch.nn.Module):
        raise TypeError(f"init_train_state: init= fills an nn.Module, got {type(params).__name__}")
    if not (init == RESET or callable(init) or isinstance(init, InitSource)):
        raise TypeError(f"init_train_state: init must be one of {_WHAT_TO_PASS}; got {init!r}")


def init_name(init: Union[str, InitFn]) -> str:
    """How errors name ``init``."""
    if init == RESET:
        return "init='reset_parameters'"
    return f"init={getattr(init, '__qualname__', None) or type(init).__name__}"


def init_fn(init: Union[str, InitFn]) -> InitFn:
    """The per-module function of ``init``: ``"reset_parameters"`` or ``fn`` itself."""
    if init == RESET:
        return _reset_parameters
    if callable(init):
        return init
    raise TypeError(f"init must be 'reset_parameters' or a function of a module, got {init!r}")


def _reset_parameters(module: torch.nn.Module) -> None:
    reset = getattr(module, RESET, None)
    if callable(reset):
        reset()


def generator_digest() -> list[float]:
    """A 64-bit digest of the global CPU generator's state, as four exact 16-bit floats."""
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).digest()
    return [float(int.from_bytes(digest[k : k + 2], "little")) for k in range(0, 8, 2)]


def agree(comm: Communicator, failure: Optional[Exception], digest: Optional[list[float]]) -> None:
    """Raise on every rank if materialising failed on any rank, or (``digest`` given: a random
    init) the ranks' generators differed when it started; else return.

    A rank that failed alone would leave the others waiting in the step's first collective;
    a random init builds every piece whole on every rank and keeps each rank's slice, so
    ranks with different generators would hold shards of different models. One
    ``all_reduce(max)`` of 9 float64 (the digest, its negation, a failure flag); none
    when this process holds every rank (``failure`` is raised as it is).
    """
    if comm.local_ranks < comm.world_size:
        parts = digest or [0.0] * 4
        x = torch.tensor([parts + [-p for p in parts] + [float(failure is not None)]], dtype=torch.float64)
        top = comm.all_reduce(x.repeat(comm.local_ranks, 1), "max")[0]
        if failure is None and top[8] > 0:
            raise ValueError(
                "init_train_state: another rank failed to fill the model (its error says why); this "
                "rank stops too, rather than wait for it in the first step"
            )
        if failure is None and not torch.equal(top[:4], -top[4:8]):
            raise ValueError(
                "init_train_state: the ranks' global random generators differ, so a random init would "
                "build a different model on each rank; call torch.manual_seed(s) with the same s on "
                "every rank before init_train_state (as for an eagerly built model)"
            )
    if failure is not None:
        raise failure


# ----------------------------------------------------------------------------- shard rows


class ShardRows:
    """This process's master rows of every flat group, filled one parameter at a time.

    ``rows[g]``: ``[R, shard_numel]`` zeros in the group's master dtype (so padding is
    zero); :meth:`write` copies the part of one parameter each local rank owns, as
    :func:`fzero.layout.flat_shard` does for a whole group (the same ``copy_``, so the
    same bits).
    """

    def __init__(self, layout: Layout, ranks: Sequence[int]):
        self.layout = layout
        self.ranks = tuple(ranks)
        self.rows = tuple(
            torch.zeros(len(self.ranks), g.shard_numel, dtype=g.master_dtype) for g in layout.groups
        )
        self.missing = {i for i, s in enumerate(layout.slots) if s.group >= 0}

    def spans(self, i: int) -> list[tuple[int, int, int, int]]:
        """``(row, lo, start, stop)`` for slot ``i``: local rank ``row`` owns the parameter's flat
        elements ``[start, stop)``, which go to its row at ``lo``."""
        s = self.layout.slots[i]
        n = self.layout.groups[s.group].shard_numel
        out = []
        for row, r in enumerate(self.ranks):
            a, b = max(r * n, s.offset), min((r + 1) * n, s.offset + s.numel)
            if a < b:
                out.append((row, a - r * n, a - s.offset, b - s.offset))
        return out

    def write(self, i: int, read: Callable[[int, int], torch.Tensor]) -> None:
        """Slot ``i``'s owned parts: ``read(start, stop)`` gives its flat elements ``[start, stop)``
        (1-D, any floating dtype; converted to the master dtype by ``copy_``)."""
        g = self.layout.slots[i].group
        for row, lo, start, stop in self.spans(i):
            self.rows[g][row, lo : lo + stop - start].copy_(read(start, stop))
        self.missing.discard(i)


def flat_reader(t: torch.Tensor) -> Callable[[int, int], torch.Tensor]:
    """``read(start, stop)`` of a whole tensor's flat elements."""
    flat = t.detach().reshape(-1)
    return lambda start, stop: flat[start:stop]


# ----------------------------------------------------------------------------- the tensors of a module


@dataclasses.dataclass(eq=False)
class _Entry:
    """One distinct tensor of a module: its canonical name, every place it is registered,
    and what the walk installed there."""

    name: str
    is_param: bool
    original: torch.Tensor
    slots: list[tuple[dict, str]] = dataclasses.field(default_factory=list)
    owners: list[str] = dataclasses.field(default_factory=list)
    owner_type: str = ""
    installed: Optional[torch.Tensor] = None
    version: int = 0


def _entries(module: torch.nn.Module) -> list[_Entry]:
    """Every distinct parameter and buffer, named as ``named_parameters``/``named_buffers`` name it."""
    canonical: dict[int, tuple[str, bool]] = {}
    for name, t in module.named_parameters():
        canonical.setdefault(id(t), (name, True))
    for name, t in module.named_buffers():
        canonical.setdefault(id(t), (name, False))
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
    """A CPU tensor for ``t``: uninitialised for a meta tensor, a copy otherwise (never the
    caller's own tensor: the init writes into it)."""
    if t.is_meta:
        data = torch.empty(t.shape, dtype=t.dtype, device=device)
    else:
        data = t.detach().to(device, copy=True)
    return torch.nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else data


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    data = torch.empty(t.shape, dtype=t.dtype, device="meta")
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
    """The value the init left for ``e`` (``who`` names the init in errors, ``hint`` says what
    to give instead)."""
    held = {id(table[attr]): table[attr] for table, attr in e.slots}
    if len(held) > 1:
        raise ValueError(
            f"{who} replaced {e.name!r} under some of its tied names only "
            f"({', '.join(o or '<root>' for o in e.owners)})"
        )
    t = next(iter(held.values()))
    if t is None or not isinstance(t, torch.Tensor):
        raise ValueError(f"{who} removed {e.name!r}")
    if t is not e.installed and (tuple(t.shape) != tuple(e.original.shape) or t.dtype != e.original.dtype):
        raise ValueError(
            f"{who} replaced {e.name!r} ({tuple(e.original.shape)} {e.original.dtype}) by a tensor "
            f"{tuple(t.shape)} {t.dtype}"
        )
    unwritten = t is e.installed and t._version == e.version
    if e.original.is_meta and (unwritten or t.is_meta):
        kind = "parameter" if e.is_param else "buffer"
        raise ValueError(
            f"{who} did not write {kind} {e.name!r} (of module {e.owners[0] or '<root>'!r}, a "
            f"{e.owner_type}), which is on the meta device: it would hold uninitialised memory. "
            f"Give an init that writes it: {hint}"
        )
    return t.detach()


def _check_untouched(closed: Iterable[_Entry], module_name: str, who: str) -> None:
    for e in closed:
        if any(table[attr] is not e.installed for table, attr in e.slots) or e.installed._version != e.version:
            raise ValueError(
                f"{who} of module {module_name or '<root>'!r} wrote {e.name!r} after fzero had cut it "
                "into shards (its piece was complete): an ancestor's init reaching into a finished "
                "unit. Initialise it from its own module, or choose units that contain both"
            )


def _apply_order(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules in the order ``module.apply(fn)`` calls ``fn``: children first, then the module."""
    out: list[torch.nn.Module] = []

    def visit(m: torch.nn.Module) -> None:
        for child in m.children():
            visit(child)
        out.append(m)

    visit(module)
    return out


def piece_of(name: str, units: Sequence[str]) -> str:
    """The top module of the piece holding module ``name``'s own tensors: its unit, else the
    largest subtree containing it that holds no unit (below the root), else itself."""
    for u in units:
        if name == u or name.startswith(u + "."):
            return u
    parts = name.split(".") if name else []
    for k in range(1, len(parts) + 1):
        top = ".".join(parts[:k])
        if not any(u == top or u.startswith(top + ".") for u in units):
            return top
    return name


@dataclasses.dataclass
class _Schedule:
    """The walk: modules in ``apply`` order and their names; which tensors open before and
    close after each visit; the visits that may reach a finished piece (ancestors of a
    piece's top module), after which closed tensors are checked."""

    visits: list[torch.nn.Module]
    names: list[str]
    opens: dict[int, list[_Entry]]
    closes: dict[int, list[_Entry]]
    above: set[int]


def _schedule(module: torch.nn.Module, entries: Sequence[_Entry], units: Sequence[str]) -> _Schedule:
    visits = _apply_order(module)
    named = dict(module.named_modules(remove_duplicate=False))
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, m in enumerate(visits):
        first.setdefault(id(m), i)
        last[id(m)] = i
    first_name: dict[int, str] = {}
    for name, m in named.items():
        first_name.setdefault(id(m), name)
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
    return _Schedule(visits, names, opens, closes, above)


# ----------------------------------------------------------------------------- the walk


def _walk(
    module: torch.nn.Module,
    fn: InitFn,
    who: str,
    units: Sequence[str],
    cut: Callable[[_Entry, torch.Tensor], None],
    device: torch.device,
) -> None:
    """Run ``fn`` on every module in ``apply`` order with each tensor live only within its piece;
    ``cut(entry, value)`` takes each value as its piece completes. The module's own tensors are
    back in place afterwards."""
    entries = _entries(module)
    plan = _schedule(module, entries, units)
    closed: list[_Entry] = []
    try:
        for i, m in enumerate(plan.visits):
            for e in plan.opens.get(i, ()):
                _install(e, _fresh(e.original, device))
            with torch.no_grad():
                fn(m)
            if i in plan.above:  # only an ancestor of a finished piece can reach into it
                _check_untouched(closed, plan.names[i], who)
            for e in plan.closes.get(i, ()):
                value = _take(e, who)
                cut(e, value)
                del value
                _install(e, _placeholder(e.original))
                closed.append(e)
    finally:
        _restore(entries)


def materialize(
    module: torch.nn.Module,
    layout: Layout,
    comm: Communicator,
    init: Init,
    units: Sequence[str] = (),
) -> Materialized:
    """This process's shards, frozen parameters and buffers of ``module`` filled by ``init``.

    ``init``: ``"reset_parameters"``, ``fn(module)``, or an :class:`InitSource` (which
    builds them itself). ``units``: the stage-3 unit names (pieces are units and the
    largest subtrees outside them). Peak: the shards, one piece, tensors tied across
    pieces. Collective: :func:`agree` (on a process group: every rank raises if one failed,
    or if a random init found the ranks' generators different).
    """
    digest = None if isinstance(init, InitSource) else generator_digest()
    try:
        if isinstance(init, InitSource):
            made = init.materialize(module, layout, comm, units)
        else:
            made = _random_init(module, layout, comm.ranks, init, units)
    except Exception as e:  # noqa: BLE001 - every rank learns of it (agree), then it is raised
        agree(comm, e, digest)
        raise
    agree(comm, None, digest)
    return made


def _random_init(
    module: torch.nn.Module, layout: Layout, ranks: Sequence[int], init: Union[str, InitFn], units: Sequence[str]
) -> Materialized:
    """:func:`materialize` by ``"reset_parameters"`` or ``fn(module)``: the walk, each tensor cut
    into the local ranks' rows (parameters), kept whole (frozen) or per rank (buffers)."""
    fn = init_fn(init)
    rows = ShardRows(layout, ranks)
    slot_of = {s.path: i for i, s in enumerate(layout.slots)}
    frozen: dict[int, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    reps = len(rows.ranks)

    def cut(e: _Entry, value: torch.Tensor) -> None:
        if not e.is_param:
            buffers[e.name] = value.unsqueeze(0).repeat(reps, *([1] * value.dim()))
            return
        i = slot_of[e.name]
        if layout.slots[i].group >= 0:
            rows.write(i, flat_reader(value))
        else:  # kept whole; a tensor the init put in place of ours may be the caller's: copied
            frozen[i] = value if value.data_ptr() == e.installed.data_ptr() else value.clone()

    _walk(module, fn, init_name(init), units, cut, torch.device("cpu"))
    return Materialized(rows.rows, _frozen_in_order(layout, frozen), _buffers_in_order(module, buffers))


def materialized_shard(
    module: torch.nn.Module, comm: Communicator, init: Init, units: Sequence[str] = (), **layout_kw: Any
) -> tuple[ShardState, tuple[torch.Tensor, ...]]:
    """:func:`fzero.sharding.init_shard` for a module filled by ``init`` (:func:`materialize`), and
    its buffers ``[R, *shape]``. ``layout_kw``: those of :func:`fzero.sharding.shard_layout`.
    Collectives: ``comm.check_layout`` and those of :func:`materialize`."""
    layout = shard_layout(module, comm, **layout_kw)
    made = materialize(module, layout, comm, init, units)
    return ShardState(made.master, made.frozen, layout), made.buffers


def _frozen_in_order(layout: Layout, frozen: dict[int, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(frozen[i] for i, s in enumerate(layout.slots) if s.group < 0)


def _buffers_in_order(module: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(buffers[n] for n, _ in module.named_buffers())


def init_buffers_of(
    module: torch.nn.Module, names: Iterable[str], fn: InitFn, who: str, hint: str = _WHAT_TO_PASS
) -> dict[str, torch.Tensor]:
    """Buffers ``names`` (canonical) computed by ``fn`` on the modules that register them.

    For what weight files do not hold (non-persistent buffers such as a rotary
    ``inv_freq``): only those buffers are created (on the CPU), ``fn`` runs on each
    module registering one, in ``apply`` order, under ``no_grad`` and with the global
    generator forked (loading weights draws nothing). A meta buffer ``fn`` did not
    write is a ``ValueError`` naming it (``who`` names the init, ``hint`` what to give
    instead). Buffers not on the meta
    device are taken as they are. The module is left as it was.
    """
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
            for m in _apply_order(module):
                if id(m) in owners:
                    fn(m)
        for e in todo:
            out[e.name] = _take(e, who, hint)
    finally:
        _restore(todo)
    return out


def to_empty_tied(module: torch.nn.Module, device: Union[str, torch.device] = "cpu") -> torch.nn.Module:
    """``module.to_empty(device=device)`` for its meta tensors, keeping tied names tied
    (``to_empty`` gives each registration its own tensor). Values are uninitialised: load
    them next (:func:`fzero.write_back` does). Returns ``module``."""
    device = torch.device(device)
    for e in _entries(module):
        if e.original.is_meta:
            _install(e, _fresh(e.original, device))
    return module
