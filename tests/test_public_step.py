"""The step is its public pieces: ``make_train_step`` calls only public fzero functions, the
step module stays small, and the top level is the documented contract.
"""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

import fzero
import fzero.step as step_module
from fzero import sharding

STEP_PY = pathlib.Path(step_module.__file__)


def _fzero_calls(fn, namespace=None) -> dict[str, object]:
    """``{dotted name: object}`` for every call in ``fn``'s source (nested functions included)
    that resolves, through ``namespace`` (default: ``fn``'s globals), to something of fzero's."""
    tree = ast.parse(inspect.getsource(fn).strip() if not inspect.getsource(fn).startswith(" ")
                     else "if True:\n" + inspect.getsource(fn))
    names = namespace if namespace is not None else fn.__globals__
    found = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        parts = []
        while isinstance(f, ast.Attribute):
            parts.append(f.attr)
            f = f.value
        if not isinstance(f, ast.Name) or f.id not in names:
            continue
        obj = names[f.id]
        for attr in reversed(parts):
            obj = getattr(obj, attr, None)
        module = getattr(obj, "__module__", "") or ""
        if module.startswith("fzero"):
            found[".".join([f.id, *reversed(parts)])] = obj
    return found


# Where the pieces live: a function of these modules that the step calls must be one of the
# pieces the top level exports (a validator ``check_*`` aside), not a variant of one.
PIECE_MODULES = ("fzero.sharding", "fzero.scaler", "fzero.grads", "fzero.units", "fzero.buckets", "fzero.optim",
                 "fzero.layout", "fzero.comm")


def _not_allowed(calls: dict[str, object]) -> list[str]:
    top = {id(getattr(fzero, n)) for n in fzero.__all__}
    bad = []
    for name, obj in calls.items():
        module = inspect.getmodule(obj)
        short = getattr(obj, "__name__", "")
        public = not short.startswith("_") and short in getattr(module, "__all__", ())
        twin = module.__name__ in PIECE_MODULES and inspect.isfunction(obj) and id(obj) not in top \
            and not short.startswith("check_")
        if not public or twin:
            bad.append(name)
    return sorted(bad)


def test_make_train_step_calls_only_public_functions():
    calls = _fzero_calls(fzero.make_train_step)
    assert not _not_allowed(calls), f"make_train_step calls fzero functions that are not its public pieces: " \
        f"{_not_allowed(calls)}"
    # the pieces the product promises, each called by the step itself
    for piece in ("loss_grads", "unscale_and_clip", "shard_step", "update_scale", "all_gather_params"):
        assert piece in calls and calls[piece] is getattr(fzero, piece), piece


def test_the_check_finds_a_private_twin():
    def step_with_twins(shard, comm, flats, layout):
        sharding.average_flat_grads_at_once(flats, layout, comm, None)  # a variant of reduce_scatter_grads
        sharding._grad_leaves(layout, {}, 1)  # private
        return fzero.all_gather_params(shard, comm, flat=True)

    assert _not_allowed(_fzero_calls(step_with_twins)) == ["sharding._grad_leaves", "sharding.average_flat_grads_at_once"]


def test_step_module_is_small():
    assert len(STEP_PY.read_text().splitlines()) < 400


def test_top_level_is_small_and_documented():
    names = fzero.__all__
    assert len(names) == len(set(names)) <= 40
    for name in names:
        obj = getattr(fzero, name)
        assert (obj.__doc__ or "").strip(), f"fzero.{name} has no docstring"
        assert name in fzero.__doc__, f"fzero.{name} is not in the package's contract (fzero.__doc__)"
    # internals stay in their modules
    for internal in ("consume", "ensure_live", "check_batch", "build_layout", "NAMESPACE", "ParamSlot"):
        assert internal not in names


def test_flat_and_started_forms_equal_the_tree_forms():
    """``reduce_scatter_grads`` on the parameter tree, on the flat groups, and started then
    waited for give the same bits; ``all_gather_params(flat=True)`` (new buffers and ``into=``)
    holds exactly the tree form's parameters. Buckets of unequal sizes, W=3."""
    import torch

    from fzero.layout import flatten_group
    from fzero.sharding import _grad_leaves

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    comm = fzero.SimulatedWorld(3)
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm, stage=2, bucket_numel=20)
    lay = state.layout
    assert len(lay.groups) > 1
    tree = {n: torch.randn(3, *p.shape) for n, p in model.named_parameters()}
    leaves = _grad_leaves(lay, tree, 3)
    flats = tuple(flatten_group(lay, g, leaves) for g in lay.groups)
    by_tree = fzero.reduce_scatter_grads(state.shard, tree, comm)
    by_flat = fzero.reduce_scatter_grads(state.shard, flats, comm, flat=True)
    started = fzero.reduce_scatter_grads(state.shard, flats, comm, flat=True, start=True)
    assert callable(started)
    for a, b, c in zip(by_tree, by_flat, started()):
        assert torch.equal(a, b) and torch.equal(a, c)
    params = fzero.all_gather_params(state.shard, comm)
    flat = fzero.all_gather_params(state.shard, comm, flat=True)
    into = tuple(torch.full_like(f, float("nan")) for f in flat)
    assert fzero.all_gather_params(state.shard, comm, flat=True, into=into) is not None
    for g, f, i in zip(lay.groups, flat, into):
        assert torch.equal(f, i)
        for k in g.slots:
            s = lay.slots[k]
            assert torch.equal(f[:, s.offset:s.offset + s.numel].reshape(3, *s.shape), params[s.path])
    with pytest.raises(ValueError, match="flat group"):
        fzero.reduce_scatter_grads(state.shard, flats[:-1], comm, flat=True)


def test_import_fzero_leaves_dynamo_unloaded():
    """``import fzero`` does not import ``torch._dynamo`` (1.5 s of a 4 s import, in every rank
    and tool that never compiles); compiling imports it."""
    import subprocess
    import sys

    code = "import sys, fzero, fzero.dist, fzero.checkpoint; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
