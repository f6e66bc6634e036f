"""Training cases that run unchanged on any communicator (gloo ranks or the simulated world)."""

from __future__ import annotations

import gc
import os
import time
import weakref
from typing import Any

import torch

import fzero
from fzero.scopes import GATHER, GRAD_REDUCTION
from helpers import Branchy, Mark, batches, children, deep_mlp, is_grad_reduction, mlp, overlap_data

mse = torch.nn.functional.mse_loss


def train(
    comm: fzero.Communicator,
    *,
    steps: int = 10,
    stage: int = 2,
    compiled: bool = False,
    optimizer: fzero.Optimizer | None = None,
    scaler: fzero.ScalerState | None = None,
    precision: fzero.MixedPrecision = fzero.MixedPrecision(),
    poison: Any = None,
    donate: bool = False,
) -> tuple[fzero.TrainState, list[dict[str, float]], list[bool]]:
    """Train the test MLP; returns the state, per-step metrics and whether the master changed.

    ``poison(step, rank) -> bool``: that rank puts an inf in its micro-batch.
    """
    model = mlp(torch.float32)
    units = children if stage == 3 else None
    state = fzero.init_train_state(
        model, optimizer or fzero.adamw(lr=1e-2), comm, scaler=scaler, precision=precision, alignment=4,
        stage=stage, units=units,
    )
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=compiled, donate=donate)
    history, changed = [], []
    for i, batch in enumerate(batches(steps, comm.world_size, 2, torch.float32)):
        x, y = comm.split_batch(batch)
        if poison is not None:
            x = x.clone()
            for row, r in enumerate(comm.ranks):
                if poison(i, r):
                    x[row, 0, 0] = float("inf")
        before = [m.clone() for m in state.shard.master] if donate else state.shard.master
        state, m = step(state, (x, y))
        history.append({k: float(v) for k, v in m.items()})
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, state.shard.master)))
    return state, history, changed


def torch_nadam() -> fzero.Optimizer:
    """A torch.optim class run by piece, with per-parameter scalar state (``mu_product``)."""
    return fzero.from_torch_optim(torch.optim.NAdam, lr=1e-2, weight_decay=0.1)


def muon() -> fzero.Optimizer:
    """Muon on the test MLP's three matrices, AdamW on its biases and LayerNorm (collectives in
    the optimizer step: each matrix orthogonalized by its owner rank)."""
    return fzero.muon(lr=2e-2, matrices=frozenset({"0.weight", "3.weight", "5.weight"}).__contains__,
                      adamw=dict(lr=1e-2))


def adafactor() -> fzero.Optimizer:
    """torch.optim.Adafactor on the test MLP (collectives in the optimizer step: two small
    all_reduces of the statistics and of the update norms)."""
    return fzero.adafactor(lr=2e-2, weight_decay=0.1)


def counting_newton_schulz() -> dict[str, int]:
    """Count this process's Newton-Schulz calls from now on: ``{"calls": n}`` (live)."""
    import fzero.muon_rules as muon_rules

    counts = {"calls": 0}
    inner = muon_rules.newton_schulz

    def counted(*args: Any) -> torch.Tensor:
        counts["calls"] += 1
        return inner(*args)

    muon_rules.newton_schulz = counted
    return counts


def masters(state: fzero.TrainState) -> list[torch.Tensor]:
    return [m.detach().clone() for m in state.shard.master]


def one_step_volume(comm: fzero.Communicator, stage: int, precision=fzero.MixedPrecision()) -> dict:
    """Collectives of one eager step (after creation), as counted by CountingCommunicator."""
    counting = fzero.comm.CountingCommunicator(comm)
    model = mlp(torch.float32)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), counting, stage=stage, precision=precision, alignment=4)
    step = fzero.make_train_step(fzero.module_loss(model, mse), counting)
    counting.reset()
    batch = batches(1, comm.world_size, 2, torch.float32)[0]
    step(state, counting.split_batch(batch))
    psi = state.layout.num_padded
    big = counting.totals(min_elements=psi)
    return {
        "psi_padded": psi,
        "params": len(state.layout.trainable_slots),
        "big": big,
        "ops": [(r.op, str(r.dtype), r.elements) for r in counting.records],
        "all": counting.totals(),
    }


def pooled_stage3(comm: fzero.Communicator, min_bytes: int = 0, steps: int = 3) -> dict:
    """Eager stage 3 on an MLP of three units of one size, with every collective's buffer of at
    least ``min_bytes`` through the communicator's pool (``fzero.dist.gloo.ScratchPool``; 0: all
    of them; the simulated world pools nothing): its masters, and how many of the pool's
    requests an earlier buffer served."""
    import fzero.dist
    from fzero.dist import gloo

    pools: list = []

    class Recorded(gloo.ScratchPool):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            pools.append(self)

    saved = gloo.MIN_BYTES, fzero.dist.ScratchPool
    gloo.MIN_BYTES, fzero.dist.ScratchPool = min_bytes, Recorded
    try:
        model = mlp(sizes=(64, 128, 128, 128, 128, 16))
        state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=3,
                                       units=lambda n, m: n in ("3", "5", "7"))
        step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
        g = torch.Generator().manual_seed(2)
        for _ in range(steps):
            world = comm.world_size
            batch = (torch.randn(4 * world, 64, generator=g), torch.randn(4 * world, 16, generator=g))
            state, _ = step(state, comm.split_batch(batch))
    finally:
        gloo.MIN_BYTES, fzero.dist.ScratchPool = saved
    return {"masters": masters(state), "reused": sum(p.reused for p in pools),
            "held": sum(p.held_bytes() for p in pools), "threads": torch.get_num_threads()}


def reduce_scatter_inputs(world: int, dtype: torch.dtype, chunk: int = 1000) -> torch.Tensor:
    """Every rank's input to a reduce-scatter, ``[W, W*chunk]``: values of mixed magnitude
    (so that the order of summation shows in the last bits), a zero of each sign."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(world, world * chunk, generator=g) * torch.logspace(-3, 3, world * chunk)
    x[:, 0], x[:, 1] = 0.0, -0.0
    return x.to(dtype)


def mismatched_models(comm: fzero.Communicator) -> dict:
    """Each rank builds a different model; every rank must get the clear error."""
    sizes = (6, 9, 5, 3) if comm.ranks[0] == 0 else (6, 9, 4, 3)
    model = mlp(torch.float32, sizes=sizes)
    t0 = time.monotonic()
    try:
        fzero.init_train_state(model, fzero.adamw(), comm)
    except ValueError as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def padding_only_rank(comm: fzero.Communicator, steps: int = 5) -> list[torch.Tensor]:
    """2 parameter elements on W ranks with alignment 1: ranks >= 2 own only padding."""
    params = {"w": torch.tensor([0.5, -1.5])}
    state = fzero.init_train_state(params, fzero.sgd(lr=0.1, momentum=0.9), comm, alignment=1)

    def loss_fn(p, batch):
        return ((p["w"] * batch).sum() - 1.0) ** 2

    step = fzero.make_train_step(loss_fn, comm)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        state, _ = step(state, comm.split_batch(torch.randn(comm.world_size, 2, generator=g)))
    return masters(state) + [fzero.full_params(state.shard, comm)["w"].clone()]


def fp16_large_value(world: int) -> float:
    """A gradient value whose plain fp16 sum over ``world`` ranks overflows but whose
    pre-divided sum does not: 40000 at W=2 (FSDP factors (2, 1)); 30000 at W=4 (factors
    (2, 2): 4 * 30000 / 2 = 60000 < 65504, while 4 * 40000 / 2 would overflow, in FSDP too)."""
    return 40000.0 if world <= 2 else 30000.0


def fp16_40000(comm: fzero.Communicator) -> torch.Tensor:
    shard = fzero.init_shard({"w": torch.zeros(8)}, comm, alignment=1)
    value = fp16_large_value(comm.world_size)
    grads = {"w": torch.full((comm.local_ranks, 8), value, dtype=torch.float16)}
    return torch.cat(fzero.reduce_scatter_grads(shard, grads, comm, reduce_dtype=torch.float16), dim=1)


def overlap_order(comm: fzero.Communicator, stage: int) -> dict:
    """Stages 1-2 with one bucket per weight and per bias: how many gradient reductions were issued before
    backward reached the first layer (in the last step), and the trained parameters."""
    counting = fzero.comm.CountingCommunicator(comm)
    marks: list[int] = []
    model = deep_mlp(Mark(counting, marks))
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), counting, stage=stage, bucket_numel=100)
    step = fzero.make_train_step(fzero.module_loss(model, mse), counting)
    for x, y in overlap_data(3, comm.world_size):
        counting.reset()
        marks.clear()
        state, _ = step(state, counting.split_batch((x, y)))
    reductions = [i for i, r in enumerate(counting.records) if is_grad_reduction(r, state.layout)]
    return {
        "reductions": len(reductions),
        "before_first_layer": sum(i < marks[-1] for i in reductions),
        "params": {k: v[-1].clone() for k, v in fzero.full_params(state.shard, comm).items()},
    }


REDUCTION_PRECISIONS = {
    "fp32": fzero.MixedPrecision(),
    "bf16 params": fzero.MixedPrecision(param_dtype=torch.bfloat16),
    "bf16 params and reduce": fzero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
    "bf16 reduce": fzero.MixedPrecision(reduce_dtype=torch.bfloat16),
}


def reduction_buffers(comm: fzero.Communicator, stage: int, precision: str, two_groups: bool) -> dict:
    """One eager donating step under the census (after a first step), on an MLP in buckets of
    unequal sizes (one parameter alone, several together): the peak bytes allocated in each of
    the step's own profiler scopes, and ``memory_report(..., comm=comm)``'s prediction of them
    (per process: the simulated world's rows together). ``two_groups``: an optimizer group
    without weight decay, so that a bucket holds two flat groups (reduced joined)."""
    from fzero.buckets import buckets_of
    from fzero.testing import Census

    torch.manual_seed(0)
    model = mlp(sizes=(64, 256, 256, 16))
    opt = fzero.adamw(groups=[(fzero.optim.no_weight_decay, {"weight_decay": 0.0})] if two_groups else ())
    mp = REDUCTION_PRECISIONS[precision]
    state = fzero.init_train_state(model, opt, comm, stage=stage, bucket_numel=20_000, precision=mp)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, donate=True)
    batch = comm.split_batch((torch.randn(4 * comm.world_size, 64), torch.randn(4 * comm.world_size, 16)))
    held = {"state": step(state, batch)[0]}
    del state
    with Census() as census:
        held["state"], _ = step(held["state"], batch)
    report = fzero.memory_report(held["state"].layout, opt, stage=stage, precision=mp, comm=comm)
    # A buffer whose last reference a backend thread drops (gloo's worker, finishing a
    # collective after the step's wait) is freed where the profiler does not look: the
    # census sees it live until its address is reused, or to the end of the step.
    unseen = {k: census.unseen_bytes(k) for k in report.step_buffers}
    return {"buckets": len({g.bucket for g in held["state"].layout.groups}),
            "joined": sum(len(gs) > 1 for gs in buckets_of(held["state"].layout)),
            "census": {k: census.scope_peaks.get(k, 0) for k in report.step_buffers},
            "joint": census.joint_peak(tuple(report.step_buffers)),
            "seen": census.joint_peak(tuple(report.step_buffers), seen_only=True), "unseen frees": unseen,
            "predicted": {k: v * comm.local_ranks for k, v in report.step_buffers.items()},
            "predicted peak": report.step_peak * comm.local_ranks}


def live_tensors(comm: fzero.Communicator, stage: int, checks: tuple[int, ...] = (3, 13)) -> list[int]:
    """How many tensors are alive (after a garbage collection, once every rank's collectives
    are done) once each step count in ``checks`` has run, eagerly: a step that leaves anything
    behind makes the count grow by at least one a step."""
    model = mlp(torch.float32)
    units = children if stage == 3 else None
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=stage, units=units,
                                   bucket_numel=None if units else 20)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    counts = []
    for i, batch in enumerate(batches(max(checks), comm.world_size, 2, torch.float32), start=1):
        state, metrics = step(state, comm.split_batch(batch))
        if i in checks:
            del metrics
            _settle()
            gc.collect()
            counts.append(sum(isinstance(o, torch.Tensor) for o in gc.get_objects()))
    return counts


def cyclic_garbage(comm: fzero.Communicator, stage: int, compiled: bool, steps: int = 3) -> dict:
    """Run ``steps`` steps with Python's cyclic collector off, then collect: what the collector
    finds is what a training loop would keep alive until the collector happens to run (a
    step's buffers held by a reference cycle grow memory without bound on a long run).
    Returns the number of unreachable tensors, their bytes (storages counted once) and the
    model's fp32 bytes (about 85k parameters, in buckets of 20000 elements at stages 1-2)."""
    sizes = (64, 256, 256, 8)
    model = mlp(torch.float32, sizes=sizes)
    units = children if stage == 3 else None
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=stage, units=units,
                                   bucket_numel=None if units else 20000)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=compiled)
    data = [comm.split_batch(b) for b in batches(steps + 1, comm.world_size, 2, torch.float32, d_in=sizes[0],
                                                  d_out=sizes[-1])]
    state, _ = step(state, data[0])  # compiles, and creates what lives for the whole run
    found, _ = unreachable_after(step, state, data[1:])
    return {**found, "model_bytes": 4 * state.layout.num_params}


def _has_memory(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:  # FakeTensor, FunctionalTensor
        return False
    return True


def unreachable_after(step: Any, state: Any, data: list) -> tuple[dict, Any]:
    """Run ``step`` over ``data`` with Python's cyclic collector off, then collect: the number of
    tensors the collector freed (only a reference cycle kept them) and their bytes (storages
    counted once); and the state the last step returned (live, so none of its tensors is
    counted).

    Every tensor alive before the collection is watched by a weak reference (with its storage's
    address and size read while it is alive); the ones whose reference the collection clears
    (and nothing else in the moment before it) are the cycle's. The collector is not put in ``DEBUG_SAVEALL`` mode: that mode keeps what it
    found in ``gc.garbage`` after clearing the weak references to it and running its
    finalizers, and reading such objects afterwards (and freeing them later, outside the
    collection that found them) is more than a test should ask of the C extensions behind
    them (the compiler's guards and caches, c10d's work objects)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for batch in data:
            state, metrics = step(state, batch)
        del metrics
        # (weak proxies too); not the compiler's fake tensors, which own no memory
        watched = [(weakref.ref(o), o.untyped_storage().data_ptr(), o.untyped_storage().nbytes())
                   for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and _has_memory(o)]
        # A backend's worker thread holds a finished collective's buffers for a moment after the
        # wait returned (a tensor C++ holds keeps its Python object): what it lets go of now is
        # not the collector's (gloo W=2, stage 1: one 170 kB all-reduce buffer a step)
        time.sleep(0.1)
        watched = [w for w in watched if w[0]() is not None]
        gc.collect()
        freed = [(ptr, n) for ref, ptr, n in watched if ref() is None]
        del watched
    finally:
        if was_enabled:
            gc.enable()
    return {"tensors": len(freed), "bytes": sum(dict(freed).values())}, state


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_growth(comm: fzero.Communicator, stage: int, compiled: bool, steps: int = 1000,
                  sizes: tuple[int, ...] = (64, 256, 256, 8), bucket_numel: int = 20_000) -> dict:
    """Train an MLP (about 0.08M parameters: a step's buffers left behind are a bucket or more, tens
    of kB, at any size; its steps cost a third less than a 1.1M one's, most of a step being its fixed
    overhead) for ``steps`` steps as a training loop would (no ``gc.collect()``), reading malloc's live bytes (``mallinfo2``) and the RSS
    after steps ``steps // 4``, ``steps // 2``, ``3 * steps // 4`` and the last one. Returns both lists
    of readings, ``steps`` and the model's fp32 size in bytes. Stages 1-2 in buckets of
    ``bucket_numel`` elements (the gradient hooks of several buckets).

    Steps 2-4 run with Python's cyclic collector off (:func:`unreachable_after`): under
    ``"cyclic"``, what the collector then freed. The same model and compiled graph as the long
    run, so a launch compiles each step once."""
    from fzero.testing.census import malloc_in_use

    model = mlp(torch.float32, sizes=sizes)
    units = children if stage == 3 else None
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-4), comm, stage=stage, units=units,
                                   bucket_numel=None if units else bucket_numel)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=compiled)
    data = [comm.split_batch(b) for b in batches(8, comm.world_size, 2, torch.float32, d_in=sizes[0],
                                                  d_out=sizes[-1])]
    marks = [steps * k // 4 for k in (1, 2, 3, 4)]
    heap, rss, seen = [], [], {}
    state, metrics = step(state, data[1])  # compiles, and creates what lives for the whole run
    cyclic, state = unreachable_after(step, state, [data[i % len(data)] for i in range(2, 5)])
    for i in range(5, steps + 2):
        state, metrics = step(state, data[i % len(data)])
        if i in marks or i - 1 in marks:
            metrics["loss"].item()  # the step has finished
            mark = i if i in marks else i - 1
            got = seen.setdefault(mark, [malloc_in_use()] if i == mark else [])
            if i == mark:
                # A buffer the backend lets go of a moment after the step (one of 6.76 MB came and
                # went between readings in a CI run: +6.76, -6.76, +6.76 MB) is not a leak: the
                # lowest of three readings (now, after every rank's work is done, after one more
                # step) is; a leak is in all three.
                _settle()
                got.append(malloc_in_use())
                rss.append(_rss_bytes())
            else:
                got.append(malloc_in_use())
                heap.append(min(got))
    return {"heap": heap, "rss": rss, "cyclic": cyclic, "model_bytes": 4 * state.layout.num_params, "steps": steps}


def _settle() -> None:
    """Wait until every rank's outstanding collectives are done and give the backend's threads
    a moment to free what they held for them."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    time.sleep(0.05)


class C10dCalls:
    """Counts the c10d collectives fzero's TorchCommunicator issues eagerly while active
    (``with C10dCalls() as calls``): ``calls.counts`` by collective."""

    # (label, the module attribute TorchCommunicator calls through, on fzero.dist or torch.distributed):
    # an all-gather is gloo's own or point to point (TorchCommunicator's all_gather_via), an all-reduce likewise
    # (all_reduce_via: its point-to-point phases are called inside it, not through fzero.dist, so counted once)
    PATCHED = [("all_to_all", "fdist", "point_to_point_reduce_scatter"), ("all_reduce", "dist", "all_reduce"),
               ("all_reduce", "fdist", "point_to_point_all_reduce"),
               ("all_gather", "fdist", "_c10d_all_gather"), ("all_gather", "fdist", "point_to_point_gather"),
               ("reduce_scatter", "fdist", "_c10d_reduce_scatter")]

    def __init__(self):
        self.counts: dict[str, int] = {}
        self._saved: list = []

    def __enter__(self) -> C10dCalls:
        import fzero.dist as fdist

        for label, where, name in self.PATCHED:
            owner = fdist if where == "fdist" else fdist.dist
            original = getattr(owner, name)

            def counted(*args, _label=label, _original=original, **kwargs):
                self.counts[_label] = self.counts.get(_label, 0) + 1
                return _original(*args, **kwargs)

            self._saved.append((owner, name, original))
            setattr(owner, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)
        self._saved.clear()


def gather_shards(rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Rank ``rank``'s shards ``[1, n]`` of three gathers (sizes 7, 3000 and 1)."""
    return [(torch.arange(n, dtype=torch.float64) * (rank + 1) + 1000 * k).to(dtype).unsqueeze(0)
            for k, n in enumerate((7, 3000, 1))]


def gather_ways(comm: fzero.Communicator) -> dict:
    """Every all-gather path of ``TorchCommunicator`` (``all_gather_via``): three gathers
    started at once and waited for last to first, and one into a given buffer, per dtype."""
    from fzero.dist import ALL_GATHER_PATHS, TorchCommunicator

    out: dict = {"default": comm.all_gather_via}
    try:
        TorchCommunicator(all_gather_via="ring")
    except ValueError as e:
        out["unknown"] = str(e)
    for via in ALL_GATHER_PATHS:
        c = TorchCommunicator(all_gather_via=via)
        got = []
        for dtype in (torch.float32, torch.bfloat16):
            shards = gather_shards(c.rank, dtype)
            started = [c.all_gather_start(x) for x in shards]
            got.append([done() for done in reversed(started)][::-1])
            into = torch.empty(1, c.world_size * shards[1].shape[1], dtype=dtype)
            got.append([c.all_gather_into_start(shards[1], into)()])
        out[via] = got
    return out


def stage3_c10d_calls(comm: fzero.Communicator) -> dict:
    """The c10d calls of one eager stage-3 step (after the first) of a model with four units
    and a root, and the step's parameters."""
    torch.manual_seed(0)
    block = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())  # noqa: E731
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), block(), block(), block(), block(), torch.nn.Linear(8, 3))
    units = lambda name, m: name in ("1", "2", "3", "4")  # noqa: E731
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=3, units=units)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    data = batches(2, comm.world_size, 2, torch.float32, d_in=4)
    state, _ = step(state, comm.split_batch(data[0]))
    with C10dCalls() as calls:
        state, _ = step(state, comm.split_batch(data[1]))
    return {"calls": calls.counts, "masters": masters(state)}


def branchy_batches(world: int) -> list:
    """Rank 0's micro-batches take Branchy's branch, the other ranks' do not."""
    batches = overlap_data(4, world)
    for x, _ in batches:
        for r in range(world):
            x[4 * r, 0] = 1.0 if r == 0 else -1.0
    return batches


def branchy(comm: fzero.Communicator, stage: int) -> dict[str, torch.Tensor]:
    """Rank-dependent control flow with one bucket per parameter: the ranks' backward passes
    complete different buckets, and every rank must still issue the same collectives."""
    model = Branchy()
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1, momentum=0.9), comm, stage=stage, bucket_numel=1)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    for x, y in branchy_batches(comm.world_size):
        state, _ = step(state, comm.split_batch((x, y)))
    return {k: v[-1].clone() for k, v in fzero.full_params(state.shard, comm).items()}


class WideBlock(torch.nn.Module):
    """One shard unit of :func:`stage3_step_memory`'s model: a square Linear and a tanh."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset VmHWM to the current RSS
        f.write("5")


def stage3_step_memory(comm: fzero.Communicator, compiled: bool, units: int = 12, d: int = 1024,
                       steps: int = 2) -> dict:
    """Peak RSS of one donating stage-3 step above the RSS just before it, on a model whose
    units dominate (``units`` blocks of ``d x d``, 4 MiB each in fp32 at d = 1024; a root of a
    few kB) and whose activations are small (4 rows per rank), after ``steps`` steps (compiled:
    the graph is built in the first).

    glibc is told to map every buffer above 64 kB on its own (``mallopt(M_MMAP_THRESHOLD)``,
    which also stops it raising that threshold as buffers are freed), so a freed buffer leaves
    the RSS at once: the RSS follows the live buffers, collectives' and compiled graphs' alike,
    whichever thread frees them (the census misses frees on gloo's threads). Call it in a
    process of its own (the setting stays). Returns the peak, the unit, root and gradient
    shard sizes in bytes, and the model's."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    if libc.mallopt(-3, 1 << 16) != 1:  # M_MMAP_THRESHOLD
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, d), *[WideBlock(d) for _ in range(units)],
                                torch.nn.Linear(d, 4))
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-3), comm, stage=3, units=(WideBlock,))
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=compiled, donate=True)
    g = torch.Generator().manual_seed(1)
    data = [comm.split_batch((torch.randn(4 * comm.world_size, 16, generator=g),
                              torch.randn(4 * comm.world_size, 4, generator=g))) for _ in range(steps + 1)]
    for batch in data[:steps]:
        state, _ = step(state, batch)
    gc.collect()
    before = _rss_bytes()
    _reset_peak_rss()
    state, metrics = step(state, data[steps])
    peak = _peak_rss_bytes() - before
    lay = state.layout
    unit_bytes = [4 * g.padded_numel for g in lay.groups if g.bucket > 0]
    return {
        "peak": peak,
        "unit": max(unit_bytes),
        "units": sum(unit_bytes),
        "root": sum(4 * g.padded_numel for g in lay.groups if g.bucket == 0),
        "grad_shards": sum(4 * g.shard_numel for g in lay.groups),
        "loss": float(metrics["loss"]),
    }


def stage3_gather_schedule(comm: fzero.Communicator, steps: int = 2) -> dict:
    """The bytes of gathered parameters live at once in a donating compiled stage-3 step (the
    census's peak of the point-to-point gathers' scope, in the step after ``steps`` steps),
    beside the root's and the units' sizes, on a ``transformers`` GPT-2 (4 blocks of 3 MiB, a
    root of 7.9 MiB: vocabulary 8000, width 256, 64 tokens a row). On this model inductor's
    own reordering moved the gathers ahead of the forward (19.9 MiB: the root and every unit;
    with 6 blocks 44.0, every unit twice) until ``fzero.compiled`` turned it off. (4 blocks,
    not 6: measured 51 s against 59 s to run cold.)"""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from fzero.testing.census import Census

    torch.manual_seed(0)
    vocab = 8000
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=vocab, n_positions=64, n_embd=256, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="eager", use_cache=False)).train()

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    ids = torch.randint(0, vocab, (2 * comm.world_size, 65), generator=torch.Generator().manual_seed(1))
    batch = comm.split_batch((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-3), comm, stage=3, units=(GPT2Block,))
    step = fzero.make_train_step(fzero.module_loss(model, loss), comm, compile=True, donate=True)
    for _ in range(steps):
        state, _ = step(state, batch)
    with Census() as census:
        state, _ = step(state, batch)
    lay = state.layout
    live = [a for a in census.allocations if a.live_at(census.peak_ns)]
    return {"gathered": census.scope_peaks.get(GATHER, 0), "reduction": census.scope_peaks.get(GRAD_REDUCTION, 0),
            "shards": sum(4 * g.shard_numel for g in lay.groups),
            "largest group": max(4 * g.padded_numel for g in lay.groups),
            "unseen reduction": census.unseen_bytes(GRAD_REDUCTION, census.scope_peak_ns(GRAD_REDUCTION)),
            "root": sum(4 * g.padded_numel for g in lay.groups if g.bucket == 0),
            "unit": max(4 * g.padded_numel for g in lay.groups if g.bucket > 0),
            "units": sum(4 * g.padded_numel for g in lay.groups if g.bucket > 0),
            "live": sum(a.nbytes for a in live)}


def compiled_reduction_census(comm: fzero.Communicator, sizes: tuple[int, ...], stage: int = 2,
                              steps: int = 2) -> dict:
    """A donating compiled stage-1 or -2 fp32 step of an MLP of ``sizes`` under the census (the step
    after ``steps`` steps): the census's ``fzero::grad_reduction`` peak and its in-block bytes at
    the step's peak (activations are a few rows), the bytes live at the peak whose free the
    census did not see (freed on gloo's thread: they count until their address is reused), and
    the layout's gradient shards and largest flat group."""
    from fzero.testing.census import Census

    model = mlp(sizes=sizes)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-3), comm, stage=stage, bucket_numel=1 << 18)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=True, donate=True)
    g = torch.Generator().manual_seed(1)
    batch = comm.split_batch((torch.randn(2 * comm.world_size, sizes[0], generator=g),
                              torch.randn(2 * comm.world_size, sizes[-1], generator=g)))
    for _ in range(steps):
        state, _ = step(state, batch)
    with Census() as census:
        state, _ = step(state, batch)
    lay = state.layout
    return {"reduction": census.scope_peaks.get(GRAD_REDUCTION, 0), "peak": census.peak_bytes,
            "unseen": census.unseen_bytes(at_ns=census.peak_ns), "shards": sum(4 * g.shard_numel for g in lay.groups),
            # the largest collective: the groups joined when small (fzero.sharding.JOIN_NUMEL), else a group
            "largest group": 4 * max(sum(g.padded_numel for g in lay.groups)
                                     if sum(g.padded_numel for g in lay.groups) <= fzero.sharding.JOIN_NUMEL else 0,
                                     *(g.padded_numel for g in lay.groups)),
            "groups": len(lay.groups)}


# --- ranks that call different stage-3 units -------------------------------------------------


class BranchUnits(torch.nn.Module):
    """Units ``a``, ``extra`` and ``b`` (of different sizes); the unit ``branch`` (``extra``, or
    ``b``: the last) runs only for a batch whose first element is positive, so the ranks' unit
    calls depend on their data."""

    def __init__(self, branch: str = "extra"):
        super().__init__()
        self.branch = branch
        self.inp = torch.nn.Linear(4, 8)
        self.a = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.extra = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.b = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        taken = bool(x[0, 0] > 0)  # a host decision on the rank's own data
        h = self.a(self.inp(x))
        if taken or self.branch != "extra":
            h = self.extra(h)
        if taken or self.branch != "b":
            h = self.b(h)
        return self.out(h)


class ExpertList(torch.nn.Module):
    """A mixture of experts written as a list of experts: each token goes to the expert its
    second feature names, and only the experts some token goes to run (as MoE layers do)."""

    def __init__(self, d: int = 8, experts: int = 4):
        super().__init__()
        self.inp = torch.nn.Linear(4, d)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(experts))
        self.out = torch.nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        route = x[:, 1].long()
        mixed = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            hit = route == e
            if hit.any():
                mixed = mixed.index_put((hit.nonzero()[:, 0],), expert(h[hit]))
        return self.out(torch.tanh(h + mixed))


def _divergent_data(world: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of 4 rows per rank: for ``"branch"`` and ``"last"`` rank 0's first row takes the branch
    and the others' do not; for ``"experts"`` rank 0 routes to experts 0 and 1, the others to
    expert 0 only."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(4 * world, 4, generator=g), torch.randn(4 * world, 3, generator=g)
    for r in range(world):
        rows = slice(4 * r, 4 * r + 4)
        if kind in ("branch", "last"):
            x[4 * r, 0] = 1.0 if r == 0 else -1.0
        else:
            x[rows, 1] = torch.tensor([0.0, 1.0, 0.0, 1.0]) if r == 0 else 0.0
    return x, y


DIVERGENT = {
    "branch": (BranchUnits, lambda name, m: name in ("a", "extra", "b")),
    "experts": (ExpertList, lambda name, m: name.startswith("experts.")),
    "last": (lambda: BranchUnits("b"), lambda name, m: name in ("a", "extra", "b")),
}


def divergent_units(comm: fzero.Communicator, kind: str) -> dict:
    """One stage-3 step of a model whose ranks call different units: the error every rank
    raises (type and text), how long it took, and whether a collective still works after it
    (the ranks stopped in step: nothing was left half-issued)."""
    build, units = DIVERGENT[kind]
    torch.manual_seed(0)
    model = build()
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm, stage=3, units=units)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    batch = comm.split_batch(_divergent_data(comm.world_size, kind))
    t0 = time.monotonic()
    try:
        step(state, batch)
        error, kind_of = None, None
    except Exception as e:  # noqa: BLE001 - the test reads which
        error, kind_of = str(e), type(e).__name__
    seconds = time.monotonic() - t0
    after = comm.all_reduce(torch.ones(comm.local_ranks, 1), "sum")
    return {"error": error, "type": kind_of, "seconds": seconds, "after": after.flatten().tolist()}


def agreeing_experts(comm: fzero.Communicator) -> dict:
    """Experts as units, every rank routing to the same experts, in an order that is no chain:
    step 1 to experts 0 and 3 (3 is gathered when called, after the check), step 2 to expert 0
    alone (the end of the forward carries its tag on a gather it then drops). Trains; returns
    the masters and losses."""
    torch.manual_seed(0)
    model = ExpertList()
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm, stage=3, units=DIVERGENT["experts"][1])
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    losses = []
    for routes in ((0.0, 3.0), (0.0, 0.0)):
        x, y = _divergent_data(comm.world_size, "experts")
        x[:, 1] = torch.tensor(routes).repeat(2 * comm.world_size)
        state, m = step(state, comm.split_batch((x, y)))
        losses.append(m["loss"].item())
    return {"masters": masters(state), "losses": losses}
