"""Small models and reference training loops shared by the tests."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import torch

import fzero

# The hypothesis profile (conftest.py): the long one also runs the full matrices that CI
# samples (tests that import LONG).
LONG = os.environ.get("FZERO_HYPOTHESIS_PROFILE", "ci") == "long"
# ``make_train_step(compile=...)`` for compiled tests whose subject is dynamo's side of a step
# (one graph, no graph breaks, no recompiles, guards, warnings around the call) and not the
# code inductor generates: in CI, backend "aot_eager" (the same dynamo graph and AOTAutograd
# partition, run by torch's eager kernels). Inductor spends 0.6 s of g++ per kernel, 30-90 s a
# test; the long profile compiles them with inductor. Every compiled path keeps an inductor
# test in CI beside its cheap ones (each file says which).
CHEAP_COMPILE = True if LONG else {"backend": "aot_eager"}


def examples(ci: int) -> int:
    """``max_examples`` for a property test whose own count is sized to its time in CI (a slow one, fewer than the
    ``ci`` profile's default): ``ci`` there, and in the long profile as many times more as the two profiles'
    defaults are apart (conftest.py), so the long run explores each test as much more as it does the rest."""
    if not LONG:
        return ci
    from hypothesis import settings

    return ci * settings.get_profile("long").max_examples // settings.get_profile("ci").max_examples


def mlp(dtype: torch.dtype = torch.float32, seed: int = 0, sizes=(6, 9, 5, 3)) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    layers.insert(2, torch.nn.LayerNorm(sizes[1]))
    return torch.nn.Sequential(*layers[:-1]).to(dtype)


def batches(n: int, world: int, per_rank: int, dtype: torch.dtype, seed: int = 1, d_in: int = 6, d_out: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(world * per_rank, d_in, generator=g, dtype=dtype),
            torch.randn(world * per_rank, d_out, generator=g, dtype=dtype),
        )
        for _ in range(n)
    ]


def reference_run(
    model: torch.nn.Module,
    make_opt: Callable[[torch.nn.Module], torch.optim.Optimizer],
    data,
    world: int,
) -> torch.nn.Module:
    """Single-process torch.optim training on the gradient averaged over ``world`` micro-batches."""
    model = copy.deepcopy(model)
    opt = make_opt(model)
    for x, y in data:
        opt.zero_grad()
        losses = [
            torch.nn.functional.mse_loss(model(xr), yr)
            for xr, yr in zip(x.chunk(world), y.chunk(world))
        ]
        (sum(losses) / world).backward()
        opt.step()
    return model


def run_steps(step, state: fzero.TrainState, comm: fzero.Communicator, data) -> tuple[fzero.TrainState, list[float]]:
    """``step`` over every global batch of ``data`` (split over ``comm``'s ranks): the last state
    and each step's loss."""
    losses = []
    for batch in data:
        state, m = step(state, comm.split_batch(batch))
        losses.append(m["loss"].item())
    return state, losses


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def params_of_rank(state: fzero.TrainState, comm: fzero.Communicator, row: int) -> dict[str, torch.Tensor]:
    full = fzero.full_params(state.shard, comm)
    return {k: v[row] for k, v in full.items()}


def children(name: str, module: torch.nn.Module) -> bool:
    """Wrap policy: every top-level child of the model is a stage-3 shard unit."""
    return "." not in name


# -- stages 1-2 gradient buckets (test_overlap.py, dist_cases.py) ---------------------------------
class Mark(torch.nn.Module):
    """Identity; when backward reaches its output, records how many collectives were issued."""

    def __init__(self, counting: fzero.comm.CountingCommunicator, marks: list[int]):
        super().__init__()
        self.counting, self.marks = counting, marks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:
            x.register_hook(lambda g: self.marks.append(len(self.counting.records)))
        return x


def deep_mlp(mark=None, width=32, depth=4, dtype=torch.float64):
    """Linear layers with Tanh between; ``mark`` (a module) right after the first Linear."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, width)]
    if mark is not None:
        layers.append(mark)
    for _ in range(depth - 1):
        layers += [torch.nn.Tanh(), torch.nn.Linear(width, width)]
    layers += [torch.nn.Tanh(), torch.nn.Linear(width, 4)]
    return torch.nn.Sequential(*layers).to(dtype)


def overlap_data(n, world, k=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4 * world * k, 8, generator=g, dtype=dtype),
             torch.randn(4 * world * k, 4, generator=g, dtype=dtype)) for _ in range(n)]


class Branchy(torch.nn.Module):
    """Rank-dependent control flow: a branch only some batches take (its parameters get no
    gradient on the ranks that skip it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.branch = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.b = torch.nn.Linear(8, 4, dtype=torch.float64)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if bool(x[0, 0] > 0):
            h = h + torch.tanh(self.branch(h))
        return self.b(h)


def branchy_reference(data_, world, lr=0.1):
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in data_:
        opt.zero_grad()
        sum(torch.nn.functional.mse_loss(model(xr), yr) for xr, yr in zip(x.chunk(world), y.chunk(world))).div(world).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return dict(model.named_parameters())


def is_grad_reduction(record, layout) -> bool:
    """A gradient reduction among ``CountingCommunicator.records``: an all-reduce or a
    reduce-scatter, but not the step's one scalar all-reduce (float64: norm, loss and one
    used-flag per trainable parameter, ``fzero.scaler.unscale_and_clip``)."""
    scalar = (record.op == "all_reduce" and record.dtype == torch.float64
              and record.elements == 2 + len(layout.trainable_slots))
    return record.op in ("all_reduce", "reduce_scatter") and record.elements > 2 and not scalar


def train_sharded(model: torch.nn.Module, rule, data, world: int, stage: int,  # noqa: ANN001
                  criterion: Callable = torch.nn.functional.mse_loss, state=None, comm=None,  # noqa: ANN001
                  donate: bool = False):  # noqa: ANN201
    """Train ``model`` with update rule ``rule`` at ``stage`` on ``comm`` (default
    ``SimulatedWorld(world)``) over ``data`` (global batches), starting from ``state`` when given
    (``rule`` is then unused). A stage-3 state takes over the module's parameters: give each
    run its own module. Stage 3 makes each child of a module without a ``transformers`` config
    a unit (a transformers model takes its blocks). Asserts that no step overflowed. Returns
    ``(state, comm)``."""
    comm = comm or fzero.SimulatedWorld(world)
    if state is None:
        units = {"units": children} if stage == 3 and not hasattr(model, "config") else {}
        state = fzero.init_train_state(model, rule, comm, stage=stage, alignment=4, **units)
    step = fzero.make_train_step(fzero.module_loss(model, criterion), comm, donate=donate)
    for batch in data:
        state, metrics = step(state, comm.split_batch(batch))
        assert metrics["found_inf"].item() == 0.0
    return state, comm


def assert_params_close(state, comm, ref: torch.nn.Module, tol: float, where=()) -> None:  # noqa: ANN001
    """Every rank's gathered parameters equal ``ref``'s within relative ``tol`` (max over
    elements, :func:`max_rel_err`); ``where`` labels a failure."""
    full = fzero.full_params(state.shard, comm)
    for n, p in ref.named_parameters():
        for r in range(comm.world_size):
            err = max_rel_err(full[n][r], p.detach())
            assert err <= tol, (*where, n, r, err)


def straddles(state, which: Callable[[tuple], bool]) -> bool:  # noqa: ANN001
    """Whether some parameter whose shape satisfies ``which`` lies on more than one rank's shard."""
    lay = state.shard.layout
    for g in lay.groups:
        for i in g.slots:
            s = lay.slots[i]
            if which(tuple(s.shape)) and s.offset // g.shard_numel != (s.offset + s.numel - 1) // g.shard_numel:
                return True
    return False
