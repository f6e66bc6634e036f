"""What fzero knows of an ``nn.Module`` beyond its parameters, and the loss of a module.

* :class:`ModuleSpec` (static): the module's buffers (names, persistence),
  the names under which tied parameters and buffers appear in its
  ``state_dict``, and the ``state_dict`` key order. Built once by
  :func:`module_spec`; it is how a trained state is exported with every key
  ``load_state_dict(strict=True)`` expects (GPT-2's ``lm_head.weight``).
* Buffers are state: :func:`init_buffers` stacks each buffer per local rank
  (``[R, *shape]``); the step hands each rank fresh copies to its forward,
  which updates them in place (BatchNorm's running statistics and
  ``num_batches_tracked``), and keeps the results. :func:`broadcast_buffers`
  gives every rank rank 0's buffers (DDP's ``broadcast_buffers=True``) with
  one ``broadcast`` per buffer dtype.
* :func:`module_loss`: a loss function for any model output (tensor,
  tuple/list, dict or ``transformers`` ``ModelOutput``), with a criterion
  on the logits or with the model's own loss, and batches given as a tensor,
  a tuple of positional arguments or a dict of keyword arguments.

Imports: ``fzero.comm``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import weakref
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.utils._pytree as tp
from torch.nn.utils.stateless import _reparametrize_module

from .comm import Communicator

__all__ = [
    "ModuleSpec",
    "module_spec",
    "init_buffers",
    "broadcast_buffers",
    "ModuleLoss",
    "module_loss",
    "model_output",
    "check_loss",
    "row_of",
    "adopt_parameters",
    "release_parameters",
    "restore_parameters",
    "check_materialized",
    "UnitPolicy",
    "select_units",
    "default_units",
    "unit_buckets",
]

LOW_PRECISION = (torch.float16, torch.bfloat16)
OUTPUTS = ("logits", "whole")  # what module_loss hands a criterion


@dataclasses.dataclass(frozen=True)
class ModuleSpec:
    """Static facts about a module that its parameter layout does not hold.

    ``buffers``: buffer names (deduplicated, ``named_buffers`` order);
    ``persistent``: whether each is in the ``state_dict``; ``aliases``:
    ``(alias, canonical)`` names of tied parameters and buffers (the
    canonical name is the one ``named_parameters``/``named_buffers`` keep);
    ``state_dict_keys``: the module's ``state_dict`` keys in order;
    ``units``: the names of the stage-3 shard units (:mod:`fzero.units`).
    """

    buffers: tuple[str, ...] = ()
    persistent: tuple[bool, ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()
    state_dict_keys: tuple[str, ...] = ()
    units: tuple[str, ...] = ()


def _non_persistent(module: torch.nn.Module) -> set[str]:
    out = set()
    for prefix, m in module.named_modules(remove_duplicate=False):
        for name in getattr(m, "_non_persistent_buffers_set", ()):
            out.add(f"{prefix}.{name}" if prefix else name)
    return out


def module_spec(module: torch.nn.Module) -> ModuleSpec:
    """The :class:`ModuleSpec` of ``module``.

    Raises ``TypeError`` naming a buffer fzero cannot carry per rank: a
    sparse or non-strided tensor, or one that requires grad.
    """
    buffers = []
    for name, b in module.named_buffers():
        if b.layout != torch.strided:
            raise TypeError(f"buffer {name!r}: only dense (strided) buffers can be carried per rank, got {b.layout}")
        if b.requires_grad:
            raise TypeError(f"buffer {name!r} requires grad: make it a parameter, or detach it")
        buffers.append(name)
    skip = _non_persistent(module)
    canonical: dict[int, str] = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        canonical.setdefault(id(t), name)
    aliases = []
    for name, t in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        if canonical.get(id(t), name) != name:
            aliases.append((name, canonical[id(t)]))
    return ModuleSpec(
        buffers=tuple(buffers),
        persistent=tuple(n not in skip for n in buffers),
        aliases=tuple(aliases),
        state_dict_keys=tuple(module.state_dict(keep_vars=True).keys()),
    )


def init_buffers(module: torch.nn.Module, spec: ModuleSpec, rows: int) -> tuple[torch.Tensor, ...]:
    """Each buffer of ``spec`` stacked for ``rows`` local ranks: ``[R, *shape]`` copies."""
    named = dict(module.named_buffers())
    return tuple(named[n].detach().unsqueeze(0).repeat(rows, *([1] * named[n].dim())) for n in spec.buffers)


def broadcast_buffers(buffers: Sequence[torch.Tensor], comm: Communicator) -> tuple[torch.Tensor, ...]:
    """Rank 0's buffers on every rank (DDP's ``broadcast_buffers``): one ``broadcast``
    per dtype, of the buffers of that dtype flattened into one ``[R, n]`` row."""
    if not buffers:
        return ()
    rows = buffers[0].shape[0]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, b in enumerate(buffers):
        by_dtype.setdefault(b.dtype, []).append(i)
    out: list[Optional[torch.Tensor]] = [None] * len(buffers)
    for idx in by_dtype.values():
        flat = torch.cat([buffers[i].reshape(rows, -1) for i in idx], dim=1)
        flat = comm.broadcast(flat, 0)
        offset = 0
        for i in idx:
            n = buffers[i][0].numel()
            out[i] = flat[:, offset : offset + n].reshape(buffers[i].shape)
            offset += n
    return tuple(out)  # type: ignore[arg-type]


def model_output(out: Any, key: str) -> torch.Tensor:
    """The tensor of a model output that a loss needs.

    ``key="logits"`` (for a criterion) or ``"loss"`` (the model's own loss).
    A tensor is itself; a dict or ``transformers`` ``ModelOutput`` gives
    ``out[key]``; a tuple or list its first element. Raises ``ValueError``
    naming the output's type and keys when there is no such tensor.
    """
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        value = out.get(key)
        if isinstance(value, torch.Tensor):
            return value
        raise ValueError(
            f"module_loss: the model returned a {type(out).__name__} without a tensor {key!r} "
            f"(keys: {sorted(k for k, v in out.items() if v is not None)}); "
            + ("pass labels in the batch so that the model computes its loss, or give a criterion"
               if key == "loss" else "give a loss_fn of your own that picks the output")
        )
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ValueError(
        f"module_loss: cannot find a tensor in the model's output of type {type(out).__name__} "
        "(expected a tensor, a tuple/list starting with one, or a dict/ModelOutput with "
        f"{key!r})"
    )


def _accepts(forward: Callable[..., Any]) -> Optional[set[str]]:
    """Keyword names ``forward`` accepts, or None if it takes ``**kwargs``."""
    params = inspect.signature(forward).parameters.values()
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


_Slot = tuple[dict, str, str]  # (the owner's _parameters or _buffers, attribute, canonical name)


def _tensor_slots(module: torch.nn.Module) -> tuple[_Slot, ...]:
    """Where each parameter and buffer is registered, tied names included."""
    canonical: dict[int, str] = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        canonical.setdefault(id(t), name)
    slots = []
    for prefix, m in module.named_modules(remove_duplicate=False):
        for table in (m._parameters, m._buffers):
            for attr, t in table.items():
                if t is not None:
                    slots.append((table, attr, canonical[id(t)]))
    return tuple(slots)


@contextlib.contextmanager
def _swapped(slots: Sequence[_Slot], tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    saved = []
    try:
        for table, attr, name in slots:
            new = tensors.get(name)
            if new is not None:
                saved.append((table, attr, table[attr]))
                table[attr] = new
        yield
    finally:
        for table, attr, old in reversed(saved):
            table[attr] = old


class ModuleLoss:
    """The loss of a module for one rank's batch: what :func:`module_loss` returns.

    Called as ``loss_fn(tensors, batch)`` it runs the module with ``tensors``
    in place of its parameters and buffers (as ``functional_call``). The
    step instead keeps the module bound to ``tensors`` (:meth:`bound`) from
    forward to the end of backward and calls :meth:`forward_loss`: a
    checkpointed region (``torch.utils.checkpoint``) reruns its forward
    during backward, and must find the same tensors in the module then.
    """

    def __init__(self, module: torch.nn.Module, criterion: Optional[Callable[..., torch.Tensor]],
                 output: str = "logits"):
        if output not in OUTPUTS:
            raise ValueError(f"module_loss: output must be one of {OUTPUTS}, got {output!r}")
        if output == "whole" and criterion is None:
            raise ValueError(
                "module_loss(model, output='whole'): the whole output goes to a criterion; give one "
                "(criterion(output, target)), or leave output='logits' for the model's own loss"
            )
        self.module = module
        self.criterion = criterion
        self.output = output
        self._param_names = [n for n, _ in module.named_parameters()]
        self._accepted = _accepts(module.forward)
        self._slots = _tensor_slots(module)

    def bound(self, tensors: Mapping[str, torch.Tensor], traced: bool = False) -> Any:
        """A context in which the module's parameters and buffers are ``tensors`` (tied
        names follow the canonical one, as in ``functional_call``).

        Eagerly, a direct swap of the registered tensors through slots found once
        (``functional_call``'s general path re-walks the module on every call,
        measured at about 15 % of a tiny GPT-2 step); in a traced step (``traced``),
        ``functional_call``'s own mechanism, which dynamo traces.
        """
        if traced:
            return _reparametrize_module(self.module, dict(tensors), tie_weights=True)
        return _swapped(self._slots, tensors)

    def __call__(self, tensors: Mapping[str, torch.Tensor], batch: Any) -> torch.Tensor:
        with self.bound(tensors):
            return self.forward_loss(tensors, batch)

    def _run(self, dtype: Optional[torch.dtype], inputs: Any) -> Any:
        def cast(x: Any) -> Any:
            if dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point():
                return x.to(dtype)
            return x

        if isinstance(inputs, Mapping):
            if self._accepted is not None:
                unknown = sorted(set(inputs) - self._accepted)
                if unknown:
                    raise ValueError(
                        f"module_loss: the batch has keys {unknown} that {type(self.module).__name__}"
                        f".forward does not take (it takes {sorted(self._accepted)})"
                    )
            return self.module(**{k: cast(v) for k, v in inputs.items()})
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        return self.module(*(cast(a) for a in args))

    def forward_loss(self, tensors: Mapping[str, torch.Tensor], batch: Any,
                     dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The loss, with the module already bound to ``tensors`` (see :meth:`bound`).

        ``dtype``: the dtype floating inputs are cast to (default: the first parameter's). The
        step passes its policy's ``param_dtype``: a model whose first parameter keeps its own
        dtype (``MixedPrecision.keep_dtype``: a BatchNorm first) still gets 16-bit inputs."""
        if dtype is None:
            dtype = next((tensors[n].dtype for n in self._param_names if n in tensors), None)
        if self.criterion is None:
            loss = model_output(self._run(dtype, batch), "loss")
            if loss.dim() != 0:
                raise ValueError(
                    f"module_loss: the model's own loss has shape {tuple(loss.shape)}, expected a 0-d "
                    "tensor; give a criterion, or make the model reduce its loss"
                )
            return loss.float()
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError(
                "module_loss(model, criterion): the batch must be (inputs, target); for a model "
                "that computes its own loss, use module_loss(model) with the labels in the inputs"
            )
        inputs, target = batch
        out = self._run(dtype, inputs)
        if self.output == "whole":
            # every 16-bit tensor of the output upcast, as the logits are: an auxiliary loss
            # (a router's, a second head's) is computed in fp32 too
            return self.criterion(tp.tree_map(_upcast, out), target)
        return self.criterion(_upcast(model_output(out, "logits")), target)


def _upcast(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in LOW_PRECISION else x


def module_loss(
    module: torch.nn.Module,
    criterion: Optional[Callable[..., torch.Tensor]] = None,
    *,
    output: str = "logits",
) -> ModuleLoss:
    """``loss_fn(tensors, batch)`` for ``module``, as :func:`fzero.make_train_step` takes it.

    ``tensors`` maps the module's parameter and buffer names to tensors (the
    step passes each rank's parameters in the compute dtype and fresh copies
    of its buffers, which the forward may update in place).

    With a ``criterion``, ``batch = (inputs, target)`` and the loss is
    ``criterion(output, target)``, where the output is the model's tensor,
    the first element of a tuple, or ``logits`` of a dict/``ModelOutput``
    (``output="logits"``, the default). ``output="whole"``: the criterion gets the
    model's whole output as the model returned it (a dict, a tuple, a ``ModelOutput``,
    a tensor), so a loss can use several heads or an auxiliary loss the model returns
    beside its logits (a mixture-of-experts router's). Without a criterion, ``batch = inputs`` and the loss is the model's own
    (``output.loss``; e.g. a ``transformers`` model given ``labels``), or a
    0-d tensor the model returns. ``inputs``: a tensor, a tuple of positional
    arguments, or a dict of keyword arguments (checked against the forward's
    signature unless it takes ``**kwargs``).

    As FSDP2's ``cast_forward_inputs``, floating inputs are cast to the
    compute dtype (the dtype of the parameters given); a 16-bit output is
    upcast to float32 before the criterion (with ``output="whole"``, every 16-bit
    tensor of the output), so the loss is fp32.
    """
    return ModuleLoss(module, criterion, output)


def check_loss(loss: Any) -> None:
    """Raise ``ValueError`` unless ``loss`` is a 0-d floating tensor with an autograd graph."""
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
        raise ValueError(f"loss_fn must return a 0-d floating-point tensor, got {loss!r:.80}")
    if not loss.requires_grad:
        raise ValueError(
            "loss_fn returned a loss that does not depend on the trainable parameters it was given "
            "(no autograd graph): did it run the model under torch.no_grad, or use its own tensors?"
        )


def row_of(batch: Any, r: int) -> Any:
    """Local rank ``r``'s part of a batch whose tensor leaves are ``[R, ...]``."""
    return tp.tree_map(lambda x: x[r] if isinstance(x, torch.Tensor) else x, batch)


# -- who owns a module's parameter memory ---------------------------------------------------
# After init_train_state the training state owns the parameters: the module keeps its
# Parameter objects (identity, names, shapes, requires_grad) but no memory of its own.
_RELEASED = "_fzero_released"


def adopt_parameters(module: torch.nn.Module, views: Mapping[str, torch.Tensor]) -> None:
    """Point each parameter ``name`` of ``module`` at ``views[name]`` (same shape and dtype):
    the module's own storage is freed and the module reads the state's buffers.

    Stages 1-2 hand in views of the gathered parameters (row 0); a donating step
    gathers into those buffers in place, so the module follows the training."""
    named = dict(module.named_parameters())
    with torch.no_grad():
        for name, view in views.items():
            p = named[name]
            if p.shape != view.shape or p.dtype != view.dtype:
                raise ValueError(f"adopt_parameters: {name!r} is {tuple(p.shape)} {p.dtype}, the view "
                                 f"{tuple(view.shape)} {view.dtype}")
            p.data = view
            p.grad = None


def release_parameters(module: torch.nn.Module, names: Sequence[str]) -> None:
    """Move parameters ``names`` of ``module`` to the meta device (shape, dtype and
    ``requires_grad`` kept, memory freed), as FSDP2 and DeepSpeed's ZeRO-3 leave a module
    whose parameters they shard. A forward of the module outside a step then raises a
    ``RuntimeError`` that says to call ``fzero.write_back`` (a meta parameter would
    otherwise compute meta outputs without complaint). Stage 3."""
    named = dict(module.named_parameters())
    # checked for every parameter before any is released, so a refusal leaves the module whole
    for name in names:
        if not named[name].is_meta and weakref.getweakrefcount(named[name]):
            raise RuntimeError(
                f"stage 3 cannot take parameter {name!r} of this {type(module).__name__}: something "
                "holds a weak reference to it (torch.compile keeps them for a module a compiled "
                "function ran, e.g. an earlier compiled step), and the parameter cannot be swapped "
                "for its meta stand-in: build the state from a fresh module, or drop that function "
                "and call torch._dynamo.reset() first"
            )
    for name in names:
        p = named[name]
        if not p.is_meta:
            torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                                           requires_grad=p.requires_grad))
        p.grad = None
    if names and getattr(module, _RELEASED, None) is None:
        probe = named[names[0]]

        def guard(mod: torch.nn.Module, args: Any) -> None:
            if probe.is_meta and _bound_is_meta(mod, names[0]):
                raise RuntimeError(
                    f"{type(mod).__name__}: its parameters were handed to a fzero stage-3 state by "
                    "init_train_state and live there (this module holds none): call "
                    "fzero.write_back(state, comm, model) before running the module itself"
                )

        setattr(module, _RELEASED, module.register_forward_pre_hook(guard))


def _bound_is_meta(module: torch.nn.Module, name: str) -> bool:
    """Whether the tensor registered as ``name`` right now (a step binds its own) is on meta."""
    owner, _, attr = name.rpartition(".")
    sub = module.get_submodule(owner) if owner else module
    t = sub._parameters.get(attr)
    return t is not None and t.is_meta


def restore_parameters(module: torch.nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Give every released (meta) parameter of ``module`` memory of its own holding
    ``values[name]`` and remove the guard :func:`release_parameters` installed."""
    for name, p in module.named_parameters():
        if p.is_meta and name in values:
            torch.utils.swap_tensors(p, torch.nn.Parameter(
                values[name].detach().to(p.dtype).clone(), requires_grad=p.requires_grad))
    handle = getattr(module, _RELEASED, None)
    if handle is not None:
        handle.remove()
        setattr(module, _RELEASED, None)


def check_materialized(module: torch.nn.Module) -> None:
    """Raise ``ValueError`` if ``module``'s parameters are on the meta device because an earlier
    stage-3 :func:`fzero.init_train_state` took them (a model built on meta is
    :mod:`fzero.materialize`'s to judge)."""
    meta = [n for n, p in module.named_parameters() if p.is_meta]
    if not meta:
        return
    if getattr(module, _RELEASED, None) is None:
        return  # built on the meta device: fzero.materialize says what to pass
    raise ValueError(
        f"init_train_state: {type(module).__name__}'s parameters ({meta[0]!r}, ...) were handed to a "
        "stage-3 state by an earlier init_train_state and are on the meta device: build the model "
        "again (or copy.deepcopy it before the first init_train_state), or fzero.write_back(state, "
        "comm, model) first"
    )


# -- stage 3's shard units: which submodules (wrap policy) --------------------------------------
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
