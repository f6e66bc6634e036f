"""What fzero knows of an ``nn.Module`` beyond its parameters (:class:`ModuleSpec`: buffers, which are state kept
per rank, tied names, ``state_dict`` keys), the loss of a module (:func:`module_loss`), who owns its parameter
memory (:func:`hand_over_parameters`, :func:`release_parameters`, ...) and stage 3's shard units (:func:`select_units`).

Imports: comm, layout, lockstep, rng.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as tp
from torch.nn.utils.stateless import _reparametrize_module

from .comm import Communicator
from .layout import FlatGroup, Layout, group_views
from .lockstep import Lockstep
from .rng import get_rng_state, set_rng_state

__all__ = ["ModuleSpec", "module_spec", "init_buffers", "broadcast_buffers", "ModuleLoss", "module_loss",
           "model_output", "check_loss", "row_of", "hand_over_parameters", "hand_over_frozen", "release_parameters",
           "restore_parameters", "check_materialized", "UnitPolicy", "select_units", "default_units", "unit_buckets"]

LOW_PRECISION = (torch.float16, torch.bfloat16)
OUTPUTS = ("logits", "whole")  # what module_loss hands a criterion


@dataclasses.dataclass(frozen=True)
class ModuleSpec:
    """A module beyond its layout: ``buffers`` (names, ``named_buffers`` order) and whether each is ``persistent`` (in
    the ``state_dict``); ``aliases``, ``(alias, canonical)`` names of tied tensors; ``state_dict_keys`` in order;
    ``units``, the stage-3 shard units' names; ``requires_grad``, each parameter's flag at build time."""

    buffers: tuple[str, ...] = ()
    persistent: tuple[bool, ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()
    state_dict_keys: tuple[str, ...] = ()
    units: tuple[str, ...] = ()
    requires_grad: tuple[bool, ...] = ()


def _canonical(module: torch.nn.Module) -> dict[int, str]:
    """``{id(tensor): the name named_parameters/named_buffers keep}`` (reversed: the first name wins)."""
    return {id(t): name for name, t in reversed([*module.named_parameters(), *module.named_buffers()])}


def module_spec(module: torch.nn.Module) -> ModuleSpec:
    """The :class:`ModuleSpec` of ``module``; ``TypeError`` for a non-strided or grad-requiring buffer."""
    buffers = []
    for name, b in module.named_buffers():
        if b.layout != torch.strided:
            raise TypeError(f"buffer {name!r}: only dense (strided) buffers can be carried per rank, got {b.layout}")
        if b.requires_grad:
            raise TypeError(f"buffer {name!r} requires grad: make it a parameter, or detach it")
        buffers.append(name)
    skip = {f"{prefix}.{name}" if prefix else name for prefix, m in module.named_modules(remove_duplicate=False)
            for name in getattr(m, "_non_persistent_buffers_set", ())}
    canonical = _canonical(module)
    aliases = [(name, canonical[id(t)]) for name, t in [*module.named_parameters(remove_duplicate=False),
                                                         *module.named_buffers(remove_duplicate=False)]
               if canonical.get(id(t), name) != name]
    return ModuleSpec(buffers=tuple(buffers), persistent=tuple(n not in skip for n in buffers), aliases=tuple(aliases),
                      state_dict_keys=tuple(module.state_dict(keep_vars=True).keys()),
                      requires_grad=tuple(p.requires_grad for p in module.parameters()))


def init_buffers(module: torch.nn.Module, spec: ModuleSpec, rows: int) -> tuple[torch.Tensor, ...]:
    """Each buffer of ``spec`` stacked for ``rows`` local ranks: ``[R, *shape]`` copies."""
    named = dict(module.named_buffers())
    return tuple(named[n].detach().unsqueeze(0).repeat(rows, *([1] * named[n].dim())) for n in spec.buffers)


def broadcast_buffers(buffers: Sequence[torch.Tensor], comm: Communicator) -> tuple[torch.Tensor, ...]:
    """Rank 0's buffers on every rank (DDP's ``broadcast_buffers``): one ``broadcast`` per dtype, as one ``[R, n]``."""
    rows = buffers[0].shape[0] if buffers else 0
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, b in enumerate(buffers):
        by_dtype.setdefault(b.dtype, []).append(i)
    out: list[torch.Tensor | None] = [None] * len(buffers)
    for idx in by_dtype.values():
        flat = comm.broadcast(torch.cat([buffers[i].reshape(rows, -1) for i in idx], dim=1), 0)
        for i, part in zip(idx, flat.split([buffers[i][0].numel() for i in idx], dim=1)):
            out[i] = part.reshape(buffers[i].shape)
    return tuple(out)  # type: ignore[arg-type]


def model_output(out: Any, key: str) -> torch.Tensor:
    """The tensor a loss needs from a model output, ``key="logits"`` (for a criterion) or ``"loss"``: a tensor itself,
    a dict's/``ModelOutput``'s ``out[key]``, a tuple's or list's first element; else ``ValueError`` (type, keys)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        value = out.get(key)
        if isinstance(value, torch.Tensor):
            return value
        raise ValueError(f"module_loss: the model returned a {type(out).__name__} without a tensor {key!r} "
                         f"(keys: {sorted(k for k, v in out.items() if v is not None)}); "
                         + ("pass labels in the batch so that the model computes its loss, or give a criterion"
                            if key == "loss" else "give a loss_fn of your own that picks the output"))
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ValueError(f"module_loss: cannot find a tensor in the model's output of type {type(out).__name__} "
                     f"(expected a tensor, a tuple/list starting with one, or a dict/ModelOutput with {key!r})")


@contextlib.contextmanager
def _swapped(slots: Sequence[tuple[dict, str, str]], tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    saved = []
    try:
        for table, attr, name in slots:
            if (new := tensors.get(name)) is not None:
                saved.append((table, attr, table[attr]))
                table[attr] = new
        yield
    finally:
        for table, attr, old in reversed(saved):
            table[attr] = old


def run_rows(one: Callable[[int], Any], loss_fn: Any, rows: int, rng_device: torch.device | None,
             traced: bool) -> list[Any]:
    """``one(r)`` for every local row, in row order: in turn, or in lockstep (:class:`fzero.lockstep.Lockstep`) where
    ``loss_fn``'s module :attr:`~ModuleLoss.meets` and there are several rows. A row parked at a meeting keeps what the
    module's registrations held and (``rng_device``) its generator state, and gets them back when it takes the turn
    again; at the end the caller's are put back."""
    if not (isinstance(loss_fn, ModuleLoss) and loss_fn.meets and rows > 1):
        return [one(r) for r in range(rows)]
    if traced:
        raise NotImplementedError("a module whose forward calls collectives every rank must join (an expert-parallel "
                                  f"layer) runs eagerly in a simulated world of {rows} rows: compile=False")
    held: dict[int, tuple[list[tuple[dict, str, Any]], torch.Tensor | None]] = {}

    def park(r: int) -> None:
        held[r] = (loss_fn.slot_values(), get_rng_state(rng_device) if rng_device is not None else None)

    def resume(r: int) -> None:
        values, generator = held.pop(r)
        loss_fn.restore(values)
        if generator is not None:
            set_rng_state(generator, rng_device)

    outside = loss_fn.slot_values()
    caller = get_rng_state(rng_device) if rng_device is not None else None
    try:
        return Lockstep(rows, park, resume).run(one)
    finally:  # each row ended restoring what it found when it began, another row's: the caller's back
        loss_fn.restore(outside)
        if caller is not None:
            set_rng_state(caller, rng_device)


class ModuleLoss:
    """What :func:`module_loss` returns: ``loss_fn(tensors, batch)`` runs the module on ``tensors``. The step keeps
    it :meth:`bound` through forward and backward (checkpointing reruns forward) and calls :meth:`forward_loss`."""

    def __init__(self, module: torch.nn.Module, criterion: Callable[..., torch.Tensor] | None,
                 output: str = "logits"):
        if output not in OUTPUTS:
            raise ValueError(f"module_loss: output must be one of {OUTPUTS}, got {output!r}")
        if output == "whole" and criterion is None:
            raise ValueError("module_loss(model, output='whole'): the whole output goes to a criterion; give one "
                             "(criterion(output, target)), or leave output='logits' for the model's own loss")
        self.module, self.criterion, self.output = module, criterion, output
        self._param_names = [n for n, _ in module.named_parameters()]
        self._params = tuple(module.parameters())  # fzero swaps their contents, never the objects
        forward = inspect.signature(module.forward).parameters.values()  # _accepted: its keywords (None: **kwargs)
        self._accepted = (None if any(p.kind == p.VAR_KEYWORD for p in forward)
                          else {p.name for p in forward if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)})
        canonical = _canonical(module)  # _slots: (table, attribute, canonical name) of every registration
        self._slots = tuple((table, attr, canonical[id(t)]) for _, m in module.named_modules(remove_duplicate=False)
                            for table in (m._parameters, m._buffers) for attr, t in table.items() if t is not None)

    def check_trainable(self, spec: ModuleSpec) -> None:
        """Raise ``ValueError`` naming the parameters whose ``requires_grad`` changed since the state was built (the
        trainable set is fixed then: layout, masters, moments); a flag read each, no module walk (every micro-batch)."""
        flags = tuple(p.requires_grad for p in self._params)
        if flags == spec.requires_grad or len(flags) != len(spec.requires_grad):  # another module: the layout's checks
            return
        changed = [f"{n!r} ({'now' if now else 'no longer'} requires grad)"
                   for n, now, was in zip(self._param_names, flags, spec.requires_grad) if now != was]
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise ValueError(f"parameters changed requires_grad after init_train_state: {', '.join(changed[:3])}{more}; "
                         "a state trains the parameters it was built with: fzero.write_back(state, comm, model), set "
                         "requires_grad, then a new state (fzero.init_train_state) and step (optimizer moments afresh)")

    @property
    def meets(self) -> bool:
        """Whether some submodule's forward calls collectives every rank must join (``fzero_meets``: an
        expert-parallel layer's all-to-all), so a simulated world runs its rows in lockstep (:mod:`fzero.lockstep`)."""
        return any(getattr(m, "fzero_meets", False) for m in self.module.modules())

    def slot_values(self) -> list[tuple[dict, str, Any]]:
        """What the module's parameter and buffer registrations hold now, for :meth:`restore`: rows in lockstep keep
        their bound tensors (a stage-3 unit's too) this way while another row runs."""
        return [(table, attr, table[attr]) for table, attr, _ in self._slots]

    @staticmethod
    def restore(values: Sequence[tuple[dict, str, Any]]) -> None:
        """Put back what :meth:`slot_values` found."""
        for table, attr, value in values:
            table[attr] = value

    def bound(self, tensors: Mapping[str, torch.Tensor], traced: bool = False) -> Any:
        """A context in which the module's parameters and buffers are ``tensors`` (tied names follow the canonical
        one): eagerly a swap through slots found once (cheaper than ``functional_call``), traced the latter's own."""
        if traced:
            return _reparametrize_module(self.module, dict(tensors), tie_weights=True)
        return _swapped(self._slots, tensors)

    def __call__(self, tensors: Mapping[str, torch.Tensor], batch: Any) -> torch.Tensor:
        with self.bound(tensors):
            return self.forward_loss(tensors, batch)

    def _run(self, dtype: torch.dtype | None, inputs: Any) -> Any:
        def cast(x: Any) -> Any:
            floating = dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point()
            return x.to(dtype) if floating else x

        if isinstance(inputs, Mapping):
            unknown = sorted(set(inputs) - self._accepted) if self._accepted is not None else []
            if unknown:
                raise ValueError(f"module_loss: the batch has keys {unknown} that {type(self.module).__name__}"
                                 f".forward does not take (it takes {sorted(self._accepted)})")
            return self.module(**{k: cast(v) for k, v in inputs.items()})
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        return self.module(*(cast(a) for a in args))

    def forward_loss(self, tensors: Mapping[str, torch.Tensor], batch: Any,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
        """The loss, the module already :meth:`bound` to ``tensors``. ``dtype``: floating inputs' cast (default: the
        first parameter's; the step passes ``param_dtype``). ``ValueError`` for a batch or loss of the wrong form."""
        if dtype is None:
            dtype = next((tensors[n].dtype for n in self._param_names if n in tensors), None)
        if self.criterion is None:
            loss = model_output(self._run(dtype, batch), "loss")
            if loss.dim() != 0:
                raise ValueError(f"module_loss: the model's own loss has shape {tuple(loss.shape)}, expected a 0-d "
                                 "tensor; give a criterion, or make the model reduce its loss")
            return loss.to(torch.promote_types(loss.dtype, torch.float32))
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError("module_loss(model, criterion): the batch must be (inputs, target); for a model "
                             "that computes its own loss, use module_loss(model) with the labels in the inputs")
        inputs, target = batch
        out = self._run(dtype, inputs)
        if self.output == "whole":  # every 16-bit tensor upcast: an auxiliary loss is fp32 too
            return self.criterion(tp.tree_map(_upcast, out), target)
        return self.criterion(_upcast(model_output(out, "logits")), target)


def _upcast(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in LOW_PRECISION else x


def module_loss(module: torch.nn.Module, criterion: Callable[..., torch.Tensor] | None = None, *,
                output: str = "logits") -> ModuleLoss:
    """A step's ``loss_fn(tensors, batch)`` for ``module`` (``tensors``: its parameters and buffers by name). With a
    ``criterion``, ``batch = (inputs, target)`` and the loss is ``criterion(output, target)``: the model's tensor, a
    tuple's first element or a dict's/``ModelOutput``'s ``logits`` (``output="logits"``), or the whole output
    (``output="whole"``: several heads, an auxiliary loss). Without, ``batch = inputs`` and the loss is the model's own
    (``output.loss``, or a 0-d tensor it returns). ``inputs``: a tensor, a tuple of positional or a dict of keyword
    arguments (checked against the forward's signature unless ``**kwargs``). Floating inputs are cast to the compute
    dtype (as FSDP2); a 16-bit output is upcast to float32 before the criterion."""
    return ModuleLoss(module, criterion, output)


def check_loss(loss: Any) -> None:
    """Raise ``ValueError`` unless ``loss`` is a 0-d floating tensor with an autograd graph."""
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
        raise ValueError(f"loss_fn must return a 0-d floating-point tensor, got {loss!r:.80}")
    if not loss.requires_grad:
        raise ValueError("loss_fn returned a loss that does not depend on the trainable parameters it was given "
                         "(no autograd graph): did it run the model under torch.no_grad, or use its own tensors?")


def row_of(batch: Any, r: int) -> Any:
    """Local rank ``r``'s part of a batch whose tensor leaves are ``[R, ...]``."""
    return tp.tree_map(lambda x: x[r] if isinstance(x, torch.Tensor) else x, batch)


# -- parameter memory: after init_train_state the state owns it; the module's Parameter objects hold none of their own
_RELEASED = "_fzero_released"


def hand_over_parameters(module: torch.nn.Module, layout: Layout, gathered: Sequence[torch.Tensor],
                         groups: Sequence[FlatGroup] | None = None) -> set[str]:
    """At stages 1-2, make the state own the module's trainable parameters: each whose dtype is its compute dtype
    becomes a view of row 0 of the gathered buffers; ``groups``: only these flat groups, ``gathered`` their buffers in
    order. Returns the names now viewing the state; ``ValueError`` if a shape or dtype is not its view's."""
    named = dict(module.named_parameters())
    adopted = set()
    with torch.no_grad():
        for g, flat in zip(layout.groups if groups is None else groups, gathered):
            for i, view in zip(g.slots, group_views(layout, g, flat[0])):
                s = layout.slots[i]
                p = named[s.path]
                if view.dtype != s.dtype or p.is_meta:  # another compute dtype: its own copy; built on meta: stays
                    continue
                if p.shape != view.shape or p.dtype != view.dtype:
                    raise ValueError(f"hand_over_parameters: {s.path!r} is {tuple(p.shape)} {p.dtype}, the view "
                                     f"{tuple(view.shape)} {view.dtype}")
                p.data, p.grad = view, None  # its own storage is freed: it reads the state's buffers
                adopted.add(s.path)
    return adopted


def hand_over_frozen(module: Any, layout: Layout, frozen: list[torch.Tensor],
                     dtype_of: Callable[[Any], torch.dtype]) -> tuple[torch.Tensor, ...]:
    """``ShardState.frozen`` (each frozen parameter, or stage 3's frozen group rows) cast to ``dtype_of`` (slot or
    group) one at a time, each original freed as cast; a module's whole frozen parameters hold the copy."""
    named = dict(module.named_parameters()) if isinstance(module, torch.nn.Module) else {}  # a pytree's: copies
    out = []
    for i, s in enumerate(layout.frozen_groups or layout.frozen_slots):
        out.append(frozen[i].detach().to(dtype_of(s)))
        frozen[i] = out[-1]  # the original freed as it is cast (once the module holds the copy too)
        if getattr(s, "path", None) in named and not named[s.path].is_meta:
            named[s.path].data = out[-1]
    return tuple(out)


def release_parameters(module: torch.nn.Module, names: Sequence[str]) -> None:
    """Move parameters ``names`` of ``module`` to the meta device (shape, dtype and ``requires_grad`` kept), as
    FSDP2 leaves a module it shards (stage 3); a forward outside a step then raises ``RuntimeError`` (call
    ``fzero.write_back``). ``RuntimeError``, nothing released, if something holds a weak reference to one."""
    named = dict(module.named_parameters())
    for name in names:  # all checked first, so a refusal leaves the module whole
        if not named[name].is_meta and weakref.getweakrefcount(named[name]):
            raise RuntimeError(
                f"stage 3 cannot take parameter {name!r} of this {type(module).__name__}: something holds a weak "
                "reference to it (torch.compile keeps them for a module a compiled function ran, e.g. an earlier "
                "compiled step), and the parameter cannot be swapped for its meta stand-in: build the state from a "
                "fresh module, or drop that function and call torch._dynamo.reset() first")
    for name in names:
        p = named[name]
        if not p.is_meta:
            torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                                           requires_grad=p.requires_grad))
        p.grad = None
    if names and getattr(module, _RELEASED, None) is None:
        probe, (owner, _, attr) = named[names[0]], names[0].rpartition(".")

        def guard(mod: torch.nn.Module, args: Any) -> None:
            if not probe.is_meta:
                return
            bound = (mod.get_submodule(owner) if owner else mod)._parameters.get(attr)  # a step binds its own
            if bound is probe:  # (a state on the meta device binds meta tensors: identity, not the device, tells)
                raise RuntimeError(f"{type(mod).__name__}: its parameters were handed to a fzero stage-3 state by "
                                   "init_train_state and live there (this module holds none): call "
                                   "fzero.write_back(state, comm, model) before running the module itself")

        setattr(module, _RELEASED, module.register_forward_pre_hook(guard))


def restore_parameters(module: torch.nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Give released (meta) parameters memory holding ``values[name]``; remove :func:`release_parameters`' guard."""
    for name, p in module.named_parameters():
        if p.is_meta and name in values:
            torch.utils.swap_tensors(p, torch.nn.Parameter(
                values[name].detach().to(p.dtype).clone(), requires_grad=p.requires_grad))
    handle = getattr(module, _RELEASED, None)
    if handle is not None:
        handle.remove()
        setattr(module, _RELEASED, None)


def check_materialized(module: torch.nn.Module) -> None:
    """Raise ``ValueError`` if ``module``'s parameters are on the meta device because an earlier stage-3
    :func:`fzero.init_train_state` took them (a model built on meta is not judged here)."""
    meta = [n for n, p in module.named_parameters() if p.is_meta]
    if meta and getattr(module, _RELEASED, None) is not None:
        raise ValueError(
            f"init_train_state: {type(module).__name__}'s parameters ({meta[0]!r}, ...) were handed to a stage-3 "
            "state by an earlier init_train_state and are on the meta device: build the model again (or "
            "copy.deepcopy it before the first init_train_state), or fzero.write_back(state, comm, model) first")


# -- stage 3's shard units: which submodules (wrap policy) ------------------------------------------
UnitPolicy = type | tuple | Callable[[str, torch.nn.Module], bool]


def _predicate(policy: UnitPolicy) -> Callable[[str, torch.nn.Module], bool]:
    if isinstance(policy, type):
        policy = (policy,)
    if isinstance(policy, (tuple, list, set, frozenset)):
        classes = tuple(policy)
        if not classes:
            raise ValueError(
                f"units={policy!r} is empty: give module classes, e.g. units=(TransformerBlock,), a predicate "
                "(name, module) -> bool, or leave units out for a transformers model (its _no_split_modules)")
        wrong = [c for c in classes if not (isinstance(c, type) and issubclass(c, torch.nn.Module))]
        if wrong:
            raise TypeError(
                f"units: {wrong[0]!r} ({type(wrong[0]).__name__}) is not an nn.Module class; give module classes, "
                "e.g. units=(TransformerBlock,), or a predicate (name, module) -> bool")
        return lambda name, module: isinstance(module, classes)
    if callable(policy):
        return policy
    raise TypeError(f"units: expected module classes or a predicate (name, module) -> bool, got {policy!r}")


def select_units(module: torch.nn.Module, policy: UnitPolicy) -> tuple[str, ...]:
    """The submodules with parameters that ``policy`` (module classes or a predicate ``(name, module) -> bool``)
    makes shard units, in ``named_modules`` order; ``ValueError`` if it selects none, or units nest (naming two)."""
    pred = _predicate(policy)
    chosen = [name for name, m in module.named_modules()
              if name and pred(name, m) and any(True for _ in m.parameters())]
    if not chosen:
        raise ValueError(f"units: the wrap policy selects no submodule with parameters of {type(module).__name__} "
                         "(the root itself cannot be a unit); e.g. units=(TransformerBlock,) or "
                         "units=lambda name, m: name.startswith('layers.')")
    for i, outer in enumerate(chosen):
        for inner in chosen[i + 1 :]:
            if inner.startswith(outer + "."):
                raise ValueError(f"units: {inner!r} lies inside unit {outer!r}; units may not nest: choose one of "
                                 "them (e.g. only the transformer blocks)")
    return tuple(chosen)


def default_units(module: torch.nn.Module) -> tuple[str, ...]:
    """The default wrap policy: the outermost submodules with parameters whose class a ``transformers`` model lists
    in ``_no_split_modules`` (its blocks); ``ValueError`` (pass ``units=``) if it names none or none is a submodule."""
    names = getattr(module, "_no_split_modules", None)
    names = {names} if isinstance(names, str) else set(names or ())
    if not names:
        raise ValueError(f"init_train_state: stage 3 needs the model's shard units, and {type(module).__name__} "
                         "names no blocks (no _no_split_modules, as transformers models have): pass "
                         "units=(BlockClass,) or units=lambda name, module: ..., as FSDP2's fully_shard per block")
    chosen = [name for name, m in module.named_modules()
              if name and type(m).__name__ in names and any(True for _ in m.parameters())]
    chosen = [name for name in chosen if not any(name.startswith(c + ".") for c in chosen)]  # the outermost
    if not chosen:
        raise ValueError(f"init_train_state: stage 3 needs the model's shard units, and none of "
                         f"{type(module).__name__}'s _no_split_modules {sorted(names)} is a submodule with "
                         "parameters: pass units=(BlockClass,) or units=lambda name, module: ...")
    return tuple(chosen)


def unit_buckets(module: torch.nn.Module, units: Sequence[str]) -> dict[str, int]:
    """``{parameter name: bucket}`` (``named_parameters`` names): unit ``i`` is bucket ``i + 1``; bucket 0, the
    root, takes a parameter no unit claims, or one tied across units (or to the root)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    out = {}
    for name, p in module.named_parameters():
        # the unit each of its (tied) names lies in (None: the root); one unit for all of them, or the root
        owners = {next((i for i, u in enumerate(units) if n.startswith(u + ".")), None) for n in names[id(p)]}
        out[name] = owners.pop() + 1 if len(owners) == 1 and None not in owners else 0
    return out
