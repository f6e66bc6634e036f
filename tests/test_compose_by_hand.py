"""``examples/compose_by_hand.py``'s hand-composed step equals ``make_train_step`` bitwise.

Stages 1-3, eager and compiled, with dynamic loss scaling (one step overflows and is
skipped), gradient clipping and accumulation, on a transformers GPT-2 (tied embeddings) and
a ResNet with BatchNorm. Every leaf of the state and every metric is compared exactly
(``rtol=atol=0``; the overflowing step's norm is NaN on both sides): the example is a
transcript of the step, not an approximation of it.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch
import torch.utils._pytree as tp

import fzero
import user_models as um
from helpers import CHEAP_COMPILE, LONG

pytest.importorskip("transformers")

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "compose_by_hand.py"
STEPS = 4


def _example():
    """The example, imported as a module is (in ``sys.modules``: dynamo guards the globals of a function it inlines,
    the hand step inside fzero's compiled call, through its module)."""
    if "compose_by_hand" not in sys.modules:
        spec = importlib.util.spec_from_file_location("compose_by_hand", EXAMPLE)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["compose_by_hand"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["compose_by_hand"]


def _case(kind: str, world: int, accum: int):
    """(model builder, loss, batches with one overflowing step, units for stage 3)."""
    n = world * accum * 2
    if kind == "gpt2":
        data = um.token_batches(STEPS, n)
        # a scale so large that the first step's scaled gradients overflow: it is skipped and
        # the scale backs off
        scaler = lambda: fzero.init_scaler(2.0**127, growth_interval=2, backoff_factor=2.0**-20)  # noqa: E731
        return um.gpt2, lambda m: fzero.module_loss(m, um.lm_criterion), data, scaler, None
    data = um.image_batches(STEPS, n, torch.float32)
    x, y = data[1]
    x = x.clone()
    x[0, 0, 0, 0] = float("inf")  # rank 0's first example at step 1: a non-finite gradient
    data[1] = (x, y)
    scaler = lambda: fzero.init_scaler(2.0**10, growth_interval=2)  # noqa: E731
    return um.resnet, lambda m: fzero.module_loss(m, torch.nn.functional.cross_entropy), data, scaler, \
        (um.Block,)


def _run(make_step, kind: str, stage: int, world: int, accum: int):
    build, loss_of, data, scaler, units = _case(kind, world, accum)
    model = build()
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2, weight_decay=0.1), comm, stage=stage,
                                   scaler=scaler(), units=units if stage == 3 else None)
    step = make_step(loss_of(model), comm)
    out = []
    for batch in data:
        state, metrics = step(state, comm.split_batch(batch, micro_batches=accum) if accum > 1
                              else comm.split_batch(batch))
        out.append(metrics)
    return state, out


def _assert_bitwise(a, b) -> None:
    (sa, ma), (sb, mb) = a, b
    la, spec_a = tp.tree_flatten(sa)
    lb, spec_b = tp.tree_flatten(sb)
    assert spec_a == spec_b
    assert len(la) == len(lb) > 0
    for i, (x, y) in enumerate(zip(la, lb)):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=f"state leaf {i}")
    assert [sorted(m) for m in ma] == [sorted(m) for m in mb]
    for step_a, step_b in zip(ma, mb):
        for k in step_a:
            torch.testing.assert_close(step_a[k], step_b[k], rtol=0, atol=0, equal_nan=True, msg=k)
    assert any(m["found_inf"].item() == 1.0 for m in ma), "no step overflowed: the skip path is untested"


CASES = [(kind, stage) for kind in ("gpt2", "resnet") for stage in (1, 2, 3)]


@pytest.mark.parametrize("kind,stage", CASES)
def test_hand_step_equals_make_train_step_eagerly(kind, stage):
    hand = _example().hand_step
    world, accum, clip = 2, 2, 0.5
    want = _run(lambda loss, comm: fzero.make_train_step(loss, comm, clip_norm=clip, accum_steps=accum),
                kind, stage, world, accum)
    got = _run(lambda loss, comm: hand(loss, comm, clip_norm=clip, accum_steps=accum), kind, stage, world, accum)
    _assert_bitwise(got, want)


# Compiling with inductor costs about 40 s of CPU per graph here (two per case), most of it in
# g++ (0.6 s per kernel). The suite compiles every stage and model once: stage 1 on the ResNet,
# stage 2 on GPT-2, stage 3 on one rank with one micro-batch (the units regather in backward) on
# GPT-2 and on several (every unit gathered at once) on the ResNet. In CI they compile with
# helpers.CHEAP_COMPILE (backend "aot_eager": the same dynamo graph and AOTAutograd partition,
# run by eager kernels: about 8 s a graph), which is where a hand composition could differ from
# make_train_step's; inductor's regathering stage 3 runs in test_distributed.py (compiled_s3, the
# gloo rank against the simulated world bitwise) and test_compiled_memory.py. The long profile
# (FZERO_HYPOTHESIS_PROFILE=long) compiles all of them with inductor.
COMPILED = [(kind, stage, 2, 2) for kind, stage in CASES] + [("gpt2", 3, 1, 1)]
COMPILED_CI = [("resnet", 1, 2, 2), ("gpt2", 2, 2, 2), ("gpt2", 3, 1, 1), ("resnet", 3, 2, 2)]


@pytest.mark.parametrize("kind,stage,world,accum", COMPILED if LONG else COMPILED_CI)
def test_hand_step_equals_make_train_step_compiled(kind, stage, world, accum):
    hand = _example().hand_step
    clip = 0.5
    how = CHEAP_COMPILE
    torch._dynamo.reset()
    want = _run(lambda loss, comm: fzero.make_train_step(loss, comm, clip_norm=clip, accum_steps=accum, compile=how),
                kind, stage, world, accum)
    got = _run(lambda loss, comm: hand(loss, comm, clip_norm=clip, accum_steps=accum, compile=how),
               kind, stage, world, accum)
    _assert_bitwise(got, want)
