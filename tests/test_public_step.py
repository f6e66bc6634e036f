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


PIECES = ("scale", "loss_grads", "reduce_scatter_grads", "accumulate", "unscale_and_check", "shard_step",
          "all_gather_params", "update_scale")


def test_make_train_step_calls_only_public_functions():
    calls = _fzero_calls(step_module.train_step)
    assert not _not_allowed(calls), f"the step calls fzero functions that are not its public pieces: " \
        f"{_not_allowed(calls)}"
    # the pieces the product promises, each called by the step itself
    for piece in PIECES:
        assert piece in calls and calls[piece] is getattr(fzero, piece), piece


def test_the_check_finds_a_private_twin():
    def step_with_twins(shard, comm, grads, layout):
        sharding.global_norm(grads, comm)  # public in its module, not a piece of the step
        sharding._cut(grads, layout.groups)  # private
        return fzero.all_gather_params(shard, comm)

    assert _not_allowed(_fzero_calls(step_with_twins)) == ["sharding._cut", "sharding.global_norm"]


def test_the_hand_composed_step_is_the_pieces_by_name():
    """``examples/compose_by_hand.py`` imports only torch and fzero (and the standard library's
    annotation types), its step is at most 60 lines, and it calls each piece by its name."""
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "compose_by_hand.py"
    tree = ast.parse(path.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module and n.module != "__future__"}
    assert imported <= {"torch", "fzero", "typing", "collections"}, imported
    spec = importlib.util.spec_from_file_location("compose_by_hand", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    hand = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "hand_step")
    step = next(n for n in ast.walk(hand) if isinstance(n, ast.FunctionDef) and n.name == "step")
    assert step.end_lineno - step.lineno + 1 <= 60
    called = {n.func.attr for n in ast.walk(step) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and isinstance(n.func.value, ast.Name) and n.func.value.id == "fzero"}
    assert set(PIECES) <= called, set(PIECES) - called


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


def test_flat_and_tree_forms_equal():
    """``reduce_scatter_grads`` on the parameter tree and on the flat groups give the same bits;
    ``all_gather_params`` (new buffers and ``into=``) holds exactly ``full_params``' parameters.
    Buckets of unequal sizes, W=3."""
    import torch

    from fzero.layout import flat_grads

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    comm = fzero.SimulatedWorld(3)
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm, stage=2, bucket_numel=20)
    lay = state.layout
    assert len(lay.groups) > 1
    tree = {n: torch.randn(3, *p.shape) for n, p in model.named_parameters()}
    flats = flat_grads(lay, tree, 3)
    by_tree = fzero.reduce_scatter_grads(state.shard, tree, comm)
    by_flat = fzero.reduce_scatter_grads(state.shard, flats, comm)
    for a, b in zip(by_tree, by_flat):
        assert torch.equal(a, b)
    params = fzero.full_params(state.shard, comm)
    flat = fzero.all_gather_params(state.shard, comm)
    into = tuple(torch.full_like(f, float("nan")) for f in flat)
    assert fzero.all_gather_params(state.shard, comm, into=into) is not None
    for g, f, i in zip(lay.groups, flat, into):
        assert torch.equal(f, i)
        for k in g.slots:
            s = lay.slots[k]
            assert torch.equal(f[:, s.offset:s.offset + s.numel].reshape(3, *s.shape), params[s.path])
    with pytest.raises(ValueError, match="flat buffers for"):
        fzero.reduce_scatter_grads(state.shard, type(flats)(flats.groups, flats[:-1]), comm)


def test_import_fzero_leaves_dynamo_unloaded():
    """``import fzero`` does not import ``torch._dynamo`` (1.5 s of a 4 s import, in every rank
    and tool that never compiles); compiling imports it."""
    import subprocess
    import sys

    code = "import sys, fzero, fzero.dist, fzero.checkpoint; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
