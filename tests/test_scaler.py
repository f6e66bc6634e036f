"""Tests of fzero.scaler against PyTorch's own loss-scaling implementation.

References:
  * the scale update: ``torch._amp_update_scale_`` (the CPU kernel behind
    ``torch.amp.GradScaler.update``) and a real ``torch.amp.GradScaler``;
  * unscaling: ``torch._amp_foreach_non_finite_check_and_unscale_`` with
    ``inv_scale = scale.double().reciprocal().float()`` (as GradScaler does);
  * scaling: ``torch.amp.GradScaler.scale``;
  * min_scale / hysteresis (not in torch): a small pure-Python simulator of
    the documented rule, itself checked against torch where the rules coincide.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import pytest
import torch
import torch.utils._pytree as tp
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from helpers import examples

FLT_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
INF, NAN = float("inf"), float("nan")


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def f32(x: float) -> float:
    """Round a Python float (double) to the nearest float32, overflowing to inf."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(INF, x)


def bits(t: torch.Tensor) -> int:
    """The raw bit pattern of a 0-d / 1-element float32 tensor."""
    assert t.dtype == torch.float32 and t.numel() == 1
    return int(t.reshape(1).view(torch.int32).item())


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def torch_kernel_state(init_scale: float):
    """(scale, growth_tracker) tensors exactly as GradScaler lazily creates them."""
    return (
        torch.full((), init_scale, dtype=torch.float32),
        torch.full((), 0, dtype=torch.int32),
    )


@dataclasses.dataclass
class RefScaler:
    """Independent pure-Python model of fzero's documented update rule.

    torch's rule (products in float64 rounded once to float32, growth kept
    only if finite), then a floor at ``min_scale`` on back-off, and hysteresis
    ``h``: an overflow with ``hysteresis_left > 1`` only decrements it; a
    growth refills it to ``h``; every overflow resets the tracker.
    """

    scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: float | None = None
    hysteresis: int | None = None
    tracker: int = 0
    hysteresis_left: int = 1

    def __post_init__(self) -> None:
        self.scale = f32(self.scale)
        self.hysteresis_left = self.hysteresis or 1

    def update(self, found_inf: bool) -> None:
        if found_inf:
            if self.hysteresis is None or self.hysteresis_left <= 1:
                new = f32(self.scale * self.backoff_factor)
                if self.min_scale is not None:
                    new = max(new, f32(self.min_scale))
                self.scale = new
            else:
                self.hysteresis_left -= 1
            self.tracker = 0
        else:
            successful = self.tracker + 1
            if successful == self.growth_interval:
                grown = f32(self.scale * self.growth_factor)
                if math.isfinite(grown):
                    self.scale = grown
                self.tracker = 0
                if self.hysteresis is not None:
                    self.hysteresis_left = self.hysteresis
            else:
                self.tracker = successful


def found(flag: bool) -> torch.Tensor:
    return torch.tensor(1.0 if flag else 0.0, dtype=torch.float32)


# --------------------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------------------
from fzero.testing.strategies import (  # noqa: E402 - the public strategies
    backoff_factors,
    growth_factors,
    growth_intervals,
    init_scales,
    powers_of_two,
)
from fzero.testing.strategies import (
    overflow_patterns as inf_steps,
)


# ======================================================================================
# 1. trajectory == torch.amp.GradScaler
# ======================================================================================
def _compare_with_kernel(init, gf, bf, gi, steps, **extra):
    fz = fzero.init_scaler(init, gf, bf, gi, **extra)
    s_t, g_t = torch_kernel_state(init)
    assert bits(fz.scale) == bits(s_t)
    for i, inf in enumerate(steps):
        f = found(inf)
        torch._amp_update_scale_(s_t, g_t, f.clone(), gf, bf, gi)
        fz = fzero.update_scale(fz, f)
        assert fz.scale.dtype == torch.float32 and fz.scale.shape == ()
        assert fz.growth_tracker.dtype == torch.int32 and fz.growth_tracker.shape == ()
        assert bits(fz.scale) == bits(s_t), (i, fz.scale.item(), s_t.item())
        assert fz.scale.item() == s_t.item()
        assert int(fz.growth_tracker) == int(g_t), (i, int(fz.growth_tracker), int(g_t))
        assert int(fz.hysteresis_left) == 1
    return fz


@given(init=init_scales, gf=growth_factors, bf=backoff_factors, gi=growth_intervals, steps=inf_steps)
def test_trajectory_matches_torch_update_kernel(init, gf, bf, gi, steps):
    _compare_with_kernel(init, gf, bf, gi, steps)


@given(
    init=st.floats(2.0**100, FLT_MAX, allow_nan=False),
    gf=growth_factors,
    bf=backoff_factors,
    gi=st.integers(1, 2),
    steps=st.lists(st.booleans(), min_size=1, max_size=40),
)
def test_trajectory_near_float32_max_matches_torch(init, gf, bf, gi, steps):
    """Growth past float32 max is refused (scale kept, tracker reset), as in torch."""
    _compare_with_kernel(init, gf, bf, gi, steps)


@given(
    init=st.floats(1e-30, 1.0, allow_nan=False),
    gf=growth_factors,
    bf=st.floats(1e-6, 0.5, allow_nan=False),
    gi=growth_intervals,
    steps=st.lists(st.booleans(), min_size=1, max_size=40),
)
def test_trajectory_small_scales_matches_torch(init, gf, bf, gi, steps):
    """Back-off into float32 subnormals / zero rounds exactly like torch."""
    _compare_with_kernel(init, gf, bf, gi, steps)


def test_growth_refused_at_float32_max():
    s = fzero.init_scaler(FLT_MAX, growth_factor=2.0, growth_interval=1)
    s = fzero.update_scale(s, found(False))
    assert s.scale.item() == FLT_MAX and math.isfinite(s.scale.item())
    assert int(s.growth_tracker) == 0
    # A factor whose product rounds back to FLT_MAX (finite) is applied.
    s = fzero.init_scaler(FLT_MAX, growth_factor=1.0 + 2.0**-30, growth_interval=1)
    s = fzero.update_scale(s, found(False))
    assert s.scale.item() == FLT_MAX


CONFIGS = [
    # init_scale, growth_factor, backoff_factor, growth_interval
    (2.0**16, 2.0, 0.5, 2),
    (3.7, 1.5, 0.3, 1),
    (1000.1, 3.0, 0.9, 3),
]
PATTERNS = [
    [False, False, True, False, False, False, True, True, False, False, False, False],
    [True, True, True, False, False, True, False, False, False, False, False, True],
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_trajectory_matches_real_grad_scaler(config, pattern):
    """Drive a real torch.amp.GradScaler + SGD and fzero side by side.

    fzero's found_inf comes from its own unscale_and_check on the same scaled
    gradients; the unscaled gradients must equal what GradScaler.step leaves
    in ``.grad``; scale and growth tracker must agree bitwise after every update.
    """
    init, gf, bf, gi = config
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    q = torch.nn.Parameter(torch.randn(2, 3))
    opt = torch.optim.SGD([p, q], lr=0.1)
    scaler = torch.amp.GradScaler(
        device="cpu", init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=gi
    )
    fz = fzero.init_scaler(init, gf, bf, gi)
    comm = fzero.SimulatedWorld(1)
    x = torch.randn(5)
    for i, inf in enumerate(pattern):
        opt.zero_grad()
        loss = (p * x).sum() + (q**2).sum()
        scaled = scaler.scale(loss)
        assert_bitwise(fzero.scale(fz, loss.detach()), scaled.detach())
        scaled.backward()
        if inf:
            with torch.no_grad():
                (q.grad if i % 2 else p.grad).view(-1)[i % 5] = INF if i % 3 else NAN
        grads = {"p": p.grad.detach().clone()[None], "q": q.grad.detach().clone()[None]}
        unscaled, fz_found = fzero.unscale_and_check(fz, grads, comm)
        p_before = p.detach().clone()
        scaler.step(opt)
        torch_found = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
        assert fz_found.item() == torch_found == (1.0 if inf else 0.0)
        assert_bitwise(unscaled["p"][0], p.grad)
        assert_bitwise(unscaled["q"][0], q.grad)
        if inf:
            assert torch.equal(p.detach(), p_before)  # torch skipped the step
        scaler.update()
        fz = fzero.update_scale(fz, fz_found)
        assert fz.scale.item() == scaler.get_scale(), (i, fz.scale.item(), scaler.get_scale())
        assert bits(fz.scale) == bits(scaler._scale)
        assert int(fz.growth_tracker) == int(scaler._growth_tracker), i
        assert fz.growth_tracker.dtype == scaler._growth_tracker.dtype


# ======================================================================================
# 2. min_scale floor, hysteresis, static scaler
# ======================================================================================
def _run(scaler, steps):
    out = []
    for inf in steps:
        scaler = fzero.update_scale(scaler, found(inf))
        out.append((scaler.scale.item(), int(scaler.growth_tracker), int(scaler.hysteresis_left)))
    return scaler, out


def test_hysteresis_hand_checked():
    s = fzero.init_scaler(1024.0, 2.0, 0.5, 2, hysteresis=3)
    assert (s.scale.item(), int(s.growth_tracker), int(s.hysteresis_left)) == (1024.0, 0, 3)
    T, F = True, False
    _, got = _run(s, [T, T, T, T, F, F, T, F, T, T])
    assert got == [
        (1024.0, 0, 2),  # overflow tolerated
        (1024.0, 0, 1),  # overflow tolerated
        (512.0, 0, 1),   # none left: back off
        (256.0, 0, 1),
        (256.0, 1, 1),
        (512.0, 0, 3),   # growth refills
        (512.0, 0, 2),
        (512.0, 1, 2),
        (512.0, 0, 1),   # tracker reset by the tolerated overflow
        (256.0, 0, 1),
    ]


def test_min_scale_hand_checked():
    T, F = True, False
    s = fzero.init_scaler(8.0, 2.0, 0.5, 3, min_scale=2.0)
    _, got = _run(s, [T, T, T, T, F, F, F, T, T])
    assert [g[0] for g in got] == [4.0, 2.0, 2.0, 2.0, 2.0, 2.0, 4.0, 2.0, 2.0]
    assert [g[1] for g in got] == [0, 0, 0, 0, 1, 2, 0, 0, 0]
    # Floor not a power of the backoff factor: 10 * 0.25 = 2.5 is clamped to 3.
    s = fzero.init_scaler(10.0, 2.0, 0.25, 100, min_scale=3.0)
    _, got = _run(s, [T, T])
    assert [g[0] for g in got] == [3.0, 3.0]


def test_min_scale_and_hysteresis_hand_checked():
    T, F = True, False
    s = fzero.init_scaler(16.0, 2.0, 0.5, 2, min_scale=4.0, hysteresis=2)
    _, got = _run(s, [T, T, T, T, F, F, T, T])
    assert got == [
        (16.0, 0, 1),
        (8.0, 0, 1),
        (4.0, 0, 1),
        (4.0, 0, 1),
        (4.0, 1, 1),
        (8.0, 0, 2),
        (8.0, 0, 1),
        (4.0, 0, 1),
    ]


@given(init=init_scales, gf=growth_factors, bf=backoff_factors, gi=growth_intervals, steps=inf_steps)
def test_reference_simulator_agrees_with_torch(init, gf, bf, gi, steps):
    """Validates the test's own simulator where its rule is torch's (no floor, no hysteresis)."""
    ref = RefScaler(init, gf, bf, gi)
    s_t, g_t = torch_kernel_state(init)
    for inf in steps:
        ref.update(inf)
        torch._amp_update_scale_(s_t, g_t, found(inf), gf, bf, gi)
        assert ref.scale == s_t.item() and ref.tracker == int(g_t)


@given(
    init=init_scales,
    gf=growth_factors,
    bf=backoff_factors,
    gi=growth_intervals,
    floor_frac=st.one_of(st.none(), st.floats(1e-6, 1.0, allow_nan=False)),
    hysteresis=st.one_of(st.none(), st.integers(1, 4)),
    steps=inf_steps,
)
def test_min_scale_and_hysteresis_match_reference(init, gf, bf, gi, floor_frac, hysteresis, steps):
    min_scale = None if floor_frac is None else init * floor_frac
    fz = fzero.init_scaler(init, gf, bf, gi, min_scale=min_scale, hysteresis=hysteresis)
    ref = RefScaler(init, gf, bf, gi, min_scale=min_scale, hysteresis=hysteresis)
    assert int(fz.hysteresis_left) == ref.hysteresis_left
    for i, inf in enumerate(steps):
        fz = fzero.update_scale(fz, found(inf))
        ref.update(inf)
        assert fz.scale.item() == ref.scale, (i, fz.scale.item(), ref.scale)
        assert int(fz.growth_tracker) == ref.tracker, i
        assert int(fz.hysteresis_left) == ref.hysteresis_left, i
        assert fz.hysteresis_left.dtype == torch.int32 and fz.growth_tracker.dtype == torch.int32
        if min_scale is not None:
            assert fz.scale.item() >= f32(min_scale)


@given(init=init_scales, gf=growth_factors, bf=backoff_factors, gi=growth_intervals, steps=inf_steps)
def test_hysteresis_one_is_torch_rule(init, gf, bf, gi, steps):
    """hysteresis=1 tolerates no overflow: torch's rule exactly."""
    _compare_with_kernel(init, gf, bf, gi, steps, hysteresis=1)


@pytest.mark.parametrize("value", [1.0, 2.0**16, 3.3])
def test_static_scaler_never_changes(value):
    s = fzero.static_scaler(value)
    assert s.dynamic is False
    assert s.scale.dtype == torch.float32 and s.scale.item() == f32(value)
    for inf in [True, False, False, True, True] + [False] * 10:
        s2 = fzero.update_scale(s, found(inf))
        assert s2.scale.item() == f32(value)
        assert int(s2.growth_tracker) == 0 and int(s2.hysteresis_left) == 1
        assert s2.dynamic is False
        s = s2
    # non-finite gradients are still detected with a static scale
    g = torch.ones(2, 3)
    g[1, 2] = INF
    _, fi = fzero.unscale_and_check(s, [g], fzero.SimulatedWorld(2))
    assert fi.item() == 1.0


# ======================================================================================
# 3. scale()
# ======================================================================================
def test_scale_nested_example():
    s = fzero.init_scaler(2.0)
    t = lambda v: torch.tensor(float(v))  # noqa: E731
    out = fzero.scale(s, [t(8), (t(4), t(8)), [t(4), t(8)]])
    assert type(out) is list and type(out[1]) is tuple and type(out[2]) is list
    assert len(out) == 3 and len(out[1]) == 2 and len(out[2]) == 2
    vals = [out[0].item(), [x.item() for x in out[1]], [x.item() for x in out[2]]]
    assert vals == [16.0, [8.0, 16.0], [8.0, 16.0]]
    assert all(x.shape == () for x in tp.tree_leaves(out))


def test_scale_preserves_dict_and_nesting():
    s = fzero.init_scaler(4.0)
    tree = {"a": torch.ones(2), "b": [torch.full((3,), 2.0), (torch.full((1, 2), 3.0),)]}
    out = fzero.scale(s, tree)
    assert type(out) is dict and set(out) == {"a", "b"}
    assert type(out["b"]) is list and type(out["b"][1]) is tuple
    ref = torch.amp.GradScaler(device="cpu", init_scale=4.0)
    assert_bitwise(out["a"], ref.scale(tree["a"]))
    assert_bitwise(out["b"][0], ref.scale(tree["b"][0]))
    assert_bitwise(out["b"][1][0], ref.scale(tree["b"][1][0]))


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@given(
    init=st.one_of(init_scales, st.floats(1e-3, 1.0, allow_nan=False)),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=examples(15))
def test_scale_matches_grad_scaler(dtype, init, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, 3, generator=g) * 2.0 ** torch.randint(-20, 8, (4, 3), generator=g)).to(dtype)
    y = torch.randn(7, generator=g).to(dtype)
    y[3] = INF
    y[5] = NAN
    s = fzero.init_scaler(init)
    ref = torch.amp.GradScaler(device="cpu", init_scale=init)
    out = fzero.scale(s, (x, [y]))
    expected = ref.scale((x, [y]))
    assert type(out) is tuple and type(out[1]) is list
    assert out[0].dtype == dtype and out[1][0].dtype == dtype
    assert_bitwise(out[0], expected[0])
    assert_bitwise(out[1][0], expected[1][0])
    # A 0-d loss stays 0-d and keeps its dtype (torch promotes a 0-d fp16/bf16
    # loss to fp32 by type promotion; its value rounded to the dtype is the reference).
    loss = x.sum()
    assert_bitwise(fzero.scale(s, loss), ref.scale(loss).to(dtype))


@pytest.mark.parametrize(
    "bad, path",
    [
        (torch.tensor([1, 2]), "['a'][1]"),
        (torch.tensor([True, False]), "['a'][1]"),
        (torch.tensor([1, 2], dtype=torch.int32), "['a'][1]"),
        (3, "['a'][1]"),
    ],
)
def test_scale_non_floating_leaf_raises_with_path(bad, path):
    s = fzero.init_scaler(2.0)
    with pytest.raises(TypeError) as e:
        fzero.scale(s, {"a": [torch.ones(2), bad], "b": torch.ones(1)})
    assert path in str(e.value)


# ======================================================================================
# 4. unscale_and_check
# ======================================================================================
SHAPES = [(3, 4), (5,), (2, 1, 3)]


def _make_grads(W, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    leaves = []
    for shape in SHAPES:
        mag = 2.0 ** torch.randint(-12, 12, (W, *shape), generator=g)
        leaves.append((torch.randn(W, *shape, generator=g) * mag).to(dtype))
    return leaves


def _tree(leaves):
    return {"w": leaves[0], "rest": (leaves[1], [leaves[2]])}


def _torch_unscale(leaves, scale_value):
    """GradScaler's unscale: inv_scale in float64 rounded to float32, foreach kernel."""
    scale_t = torch.full((), scale_value, dtype=torch.float32)
    inv = scale_t.double().reciprocal().float()
    found_t = torch.zeros((), dtype=torch.float32)
    clones = [x.clone() for x in leaves]
    for c in clones:  # one call per dtype group, as GradScaler._unscale_grads_ does
        torch._amp_foreach_non_finite_check_and_unscale_([c], found_t, inv)
    return clones, found_t


class SpyWorld(fzero.SimulatedWorld):
    def __init__(self, w):
        super().__init__(w)
        self.calls = []

    def all_reduce(self, x, op="sum"):
        out = super().all_reduce(x, op)
        self.calls.append((op, x.clone(), out.clone()))
        return out


unscale_scales = st.one_of(powers_of_two, st.floats(1e-3, 2.0**24, allow_nan=False))


@given(
    data=st.data(),
    W=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    scale_value=unscale_scales,
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=examples(40))
def test_unscale_and_check_matches_torch(data, W, dtype, scale_value, seed):
    bad = data.draw(
        st.one_of(
            st.none(),
            st.tuples(
                st.integers(0, len(SHAPES) - 1),
                st.integers(0, W - 1),
                st.integers(0, 100),
                st.sampled_from([INF, -INF, NAN]),
            ),
        ),
        label="bad",
    )
    _check_unscale(W, dtype, scale_value, seed, bad)


# Explicit cases of the property above (it draws with st.data(), which @example cannot give):
# float64 gradients with scales whose inverse is not exact in float32. torch multiplies them,
# in float64, by the *float32-rounded* inverse; unscaling in float32, or by the exact float64
# inverse, differs here, and the ci profile's draws never reach float64 with such a scale.
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale_value", [3.0, 1000.0, 0.1, 2.0**16])
@pytest.mark.parametrize("bad", [None, (1, 1, 2, INF)])
def test_unscale_and_check_matches_torch_examples(dtype, scale_value, bad):
    _check_unscale(2, dtype, scale_value, 0, bad)


def _check_unscale(W, dtype, scale_value, seed, bad):
    leaves = _make_grads(W, dtype, seed)
    if bad is not None:
        li, row, pos, val = bad
        flat = leaves[li][row].view(-1)
        flat[pos % flat.numel()] = val
    originals = [x.clone() for x in leaves]

    expected, torch_found = _torch_unscale(leaves, scale_value)
    comm = SpyWorld(W)
    out, fi = fzero.unscale_and_check(fzero.init_scaler(scale_value), _tree(leaves), comm)

    # structure and values
    assert type(out) is dict and type(out["rest"]) is tuple and type(out["rest"][1]) is list
    got = [out["w"], out["rest"][0], out["rest"][1][0]]
    for a, e in zip(got, expected):
        assert_bitwise(a, e)
    # the inputs are not modified (pure function)
    for x, o in zip(leaves, originals):
        assert_bitwise(x, o)
    # found_inf: one 0-d float32 agreed value, torch's answer
    assert fi.shape == () and fi.dtype == torch.float32
    assert fi.item() == torch_found.item() == (0.0 if bad is None else 1.0)
    # agreed through exactly one all_reduce(max) over the rank axis; every rank sees it
    assert len(comm.calls) == 1
    op, x_in, x_out = comm.calls[0]
    assert op == "max" and x_in.shape == (W,)
    assert torch.all(x_out == fi)


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("kind", [INF, NAN])
def test_found_inf_from_any_single_rank(W, kind):
    """Non-finite values in exactly one rank's row are seen by every rank."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for row in range(W):
            leaves = _make_grads(W, dtype, 7)
            leaves[1][row, 2] = kind
            _, torch_found = _torch_unscale([leaves[1][row]], 1024.0)
            _, other_rows_found = _torch_unscale(
                [leaves[1][r] for r in range(W) if r != row], 1024.0
            )
            assert torch_found.item() == 1.0 and other_rows_found.item() == 0.0
            _, fi = fzero.unscale_and_check(
                fzero.init_scaler(1024.0), _tree(leaves), fzero.SimulatedWorld(W)
            )
            assert fi.shape == () and fi.item() == 1.0, (dtype, row)


class OneRankOfTwo(fzero.Communicator):
    """Rank 0 of a 2-rank world (R=1) whose peer reports ``peer_found``."""

    def __init__(self, peer_found: float):
        self.world_size, self.local_ranks, self.ranks = 2, 1, (0,)
        self.peer = peer_found

    def all_reduce(self, x, op="sum"):
        assert op == "max" and x.shape == (1,)
        return torch.maximum(x, torch.full_like(x, self.peer))


def test_found_inf_comes_from_the_collective():
    """A real rank with clean local grads must still skip if its peer overflowed."""
    grads = [torch.ones(1, 4)]
    s = fzero.init_scaler(8.0)
    _, fi = fzero.unscale_and_check(s, grads, OneRankOfTwo(1.0))
    assert fi.item() == 1.0
    _, fi = fzero.unscale_and_check(s, grads, OneRankOfTwo(0.0))
    assert fi.item() == 0.0


def test_unscale_empty_rows():
    s = fzero.init_scaler(4.0)
    g = {"e": torch.zeros(2, 0), "x": torch.full((2, 3), 8.0)}
    out, fi = fzero.unscale_and_check(s, g, fzero.SimulatedWorld(2))
    assert out["e"].shape == (2, 0) and fi.item() == 0.0
    expected, _ = _torch_unscale([g["x"]], 4.0)
    assert_bitwise(out["x"], expected[0])


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_unscale_sparse_grad_raises(layout):
    W = 2
    dense = torch.zeros(W, 3)
    dense[1, 2] = 4.0
    sparse = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    with pytest.raises(TypeError):
        fzero.unscale_and_check(
            fzero.init_scaler(2.0), {"a": torch.ones(W, 2), "s": sparse}, fzero.SimulatedWorld(W)
        )


@pytest.mark.parametrize("W", [1, 2, 3])
def test_unscale_missing_rank_axis_raises(W):
    comm = fzero.SimulatedWorld(W)
    s = fzero.init_scaler(2.0)
    for bad in (torch.ones(W + 1, 3), torch.tensor(1.0), torch.ones(2 * W + 1)):
        with pytest.raises(ValueError):
            fzero.unscale_and_check(s, {"ok": torch.ones(W, 2), "bad": bad}, comm)


def test_unscale_non_floating_raises():
    with pytest.raises(TypeError):
        fzero.unscale_and_check(
            fzero.init_scaler(2.0), [torch.ones(2, 2, dtype=torch.int64)], fzero.SimulatedWorld(2)
        )


# ======================================================================================
# 5. acceptance: an inf in one rank's gradients only
# ======================================================================================
def test_inf_in_one_rank_only_backs_off():
    W = 3
    comm = fzero.SimulatedWorld(W)
    s = fzero.init_scaler(2.0**10)
    clean = [torch.full((W, 4), 3.0), torch.full((W, 2, 2), -5.0)]
    for _ in range(2):  # two clean steps: tracker at 2
        _, fi = fzero.unscale_and_check(s, clean, comm)
        assert fi.item() == 0.0
        s = fzero.update_scale(s, fi)
    assert int(s.growth_tracker) == 2 and s.scale.item() == 2.0**10

    grads = [torch.full((W, 4), 3.0), torch.full((W, 2, 2), -5.0)]
    grads[1][1, 0, 1] = INF  # only rank 1
    assert torch.isfinite(grads[1][0]).all() and torch.isfinite(grads[1][2]).all()
    out, fi = fzero.unscale_and_check(s, grads, comm)
    assert fi.shape == () and fi.item() == 1.0
    expected, torch_found = _torch_unscale(grads, 2.0**10)
    assert torch_found.item() == 1.0
    for a, e in zip(out, expected):
        assert_bitwise(a, e)
    s = fzero.update_scale(s, fi)
    assert s.scale.item() == 2.0**9
    assert int(s.growth_tracker) == 0


# ======================================================================================
# 6. update_scale is branch-free: compiles to one graph, no recompiles
# ======================================================================================
def test_update_scale_compiles_fullgraph_without_recompiles():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def update_scale_fn(scaler, found_inf):
        return fzero.update_scale(scaler, found_inf)

    compiled = torch.compile(update_scale_fn, fullgraph=True)
    pattern = [True, True, True, False, False, True, True, True, True, False, False, False]
    kw = dict(growth_interval=2, min_scale=2.0**8, hysteresis=2)
    eager = fzero.init_scaler(2.0**10, **kw)
    comp = fzero.init_scaler(2.0**10, **kw)
    ref = RefScaler(2.0**10, 2.0, 0.5, 2, min_scale=2.0**8, hysteresis=2)
    seen = set()
    for i, inf in enumerate(pattern):
        f = found(inf)
        eager = fzero.update_scale(eager, f)
        comp = compiled(comp, f)
        ref.update(inf)
        assert type(comp) is fzero.ScalerState
        assert dataclasses.replace(comp, scale=None, growth_tracker=None, hysteresis_left=None) == (
            dataclasses.replace(eager, scale=None, growth_tracker=None, hysteresis_left=None)
        )
        for name in ("scale", "growth_tracker", "hysteresis_left"):
            assert_bitwise(getattr(comp, name), getattr(eager, name))
        assert (comp.scale.item(), int(comp.growth_tracker), int(comp.hysteresis_left)) == (
            ref.scale, ref.tracker, ref.hysteresis_left
        ), i
        seen.add((comp.scale.item(), int(comp.hysteresis_left)))
    # the pattern exercises tolerated overflows, back-offs, the floor and growth
    assert len(seen) >= 3
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
