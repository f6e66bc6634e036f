"""fzero.dist.TorchCommunicator on an accelerator backend, without one: torch's fake process group (no communication,
one process as rank 0 of 8) with the communicator's device ``meta``. A guard (:class:`NoHostTensors`, a dispatch mode
on the c10d and functional-collective operators) refuses a CPU tensor at any collective, as an NCCL group does, and
gives zeros where the host reads a meta tensor back (a device would give its data there; the fake group computes
none anyway). Compiled steps: the collectives of the graphs AOTAutograd makes, checked by the compiler itself (a
dispatch mode cannot be active while dynamo traces).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as tp
from torch.utils._python_dispatch import TorchDispatchMode

import fzero
import fzero.dist as fdist
from fzero.dist import DEFAULT_TIMEOUT, TorchCommunicator, device_for, local_rank, start_process_group
from fzero.materialize import agree, generator_digest
from fzero.sharding import shard_layout
from helpers import children, mlp

W = 8
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
# fzero's own collectives (gloo's traced ones; its other operators take the host's hyperparameters by design)
FZERO_COLLECTIVES = ("gather_point_to_point_many", "all_gather_point_to_point", "reduce_scatter_all_to_all",
                     "all_reduce_shard")
aten = torch.ops.aten


@pytest.fixture(scope="module")
def fake8():
    """The default process group: torch's fake one, rank 0 of 8; destroyed after this module's tests."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "another test left a default process group"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=W)
    yield
    dist.destroy_process_group()


def is_collective(op: Any) -> bool:
    namespace = getattr(op, "namespace", None)
    return namespace in COLLECTIVE_NAMESPACES or (namespace == "fzero" and op._opname in FZERO_COLLECTIVES)


class NoHostTensors(TorchDispatchMode):
    """Raise on a collective given a CPU tensor (NCCL refuses one); record each collective's name and its tensors'
    devices and dtypes. A host read of a meta tensor (``.cpu()``, ``.item()``, ``torch.equal``) gives zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[str, ...], tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if is_collective(func):
            tensors = [t for t in tp.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if any(t.device.type == "cpu" for t in tensors):
                raise RuntimeError(f"{func}: a CPU tensor reached a collective (NCCL refuses it): "
                                   f"{[(tuple(t.shape), t.dtype, str(t.device)) for t in tensors]}")
            self.seen.append((str(func), tuple(t.device.type for t in tensors), tuple(t.dtype for t in tensors)))
        meta_in = bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_meta
        if meta_in and func is aten._to_copy.default and torch.device(kwargs.get("device", "meta")).type == "cpu":
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        if meta_in and func is aten._local_scalar_dense.default:
            return False if args[0].dtype == torch.bool else 0
        if meta_in and func is aten.equal.default:
            return True
        return func(*args, **kwargs)

    def collectives(self) -> list[str]:
        return [name for name, _, _ in self.seen]


def check_on(guard: NoHostTensors, device: str = "meta") -> None:
    """Some collective ran, and every tensor of every one was on ``device``."""
    assert guard.seen, "no collective reached the process group"
    assert {d for _, devices, _ in guard.seen for d in devices} == {device}, guard.seen


def every_collective(comm: fzero.Communicator) -> dict[str, torch.Tensor]:
    """Every collective of the protocol once, on ``comm.device``: name -> result."""
    d, w = comm.device, comm.world_size
    x = torch.ones(1, w * 4, device=d)
    out = {f"all_reduce {op}": comm.all_reduce(x, op) for op in ("sum", "avg", "max")}
    out |= {f"reduce_scatter {op}": comm.reduce_scatter(x, op) for op in ("sum", "avg")}
    out["all_gather"] = comm.all_gather(x[:, :3])
    out["all_reduce_shard"] = comm.all_reduce_shard_start(x, "avg")()
    out["all_reduce_replicas"] = comm.all_reduce_replicas_start(x)()
    into = torch.empty(1, w * 3, device=d)
    out["all_gather_into_start"] = comm.all_gather_into_start(x[:, :3].contiguous(), into)()
    many = [torch.empty(1, w * 2, device=d), torch.empty(1, w * 5, device=d, dtype=torch.bfloat16)]
    comm.all_gather_into([torch.ones(1, 2, device=d), torch.ones(1, 5, device=d, dtype=torch.bfloat16)], many)
    out["all_gather_into"] = many[1]
    out["broadcast"] = comm.broadcast(x[:, :5], src=3)
    if not comm.traced:
        out["all_to_all"] = comm.all_to_all_start(torch.ones(1, w * 2, device=d, dtype=torch.uint8))()
    return out


SHAPES = {"all_reduce sum": (1, W * 4), "all_reduce avg": (1, W * 4), "all_reduce max": (1, W * 4),
          "reduce_scatter sum": (1, 4), "reduce_scatter avg": (1, 4), "all_gather": (1, W * 3),
          "all_reduce_shard": (1, 4), "all_reduce_replicas": (1, W * 4), "all_gather_into_start": (1, W * 3),
          "all_gather_into": (1, W * 5), "broadcast": (1, 5), "all_to_all": (1, W * 2)}

PATHS = [{}, {"reduce_scatter_via": "all_to_all", "all_gather_via": "point_to_point", "all_reduce_via": "rank_order"},
         {"reduce_scatter_via": "all_reduce"}]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("via", PATHS, ids=["backend's", "point to point", "via all_reduce"])
def test_every_collective_sends_and_returns_tensors_on_the_device(fake8, via, traced):
    comm = TorchCommunicator(device="meta", **via)
    assert comm.device == torch.device("meta") and comm.timeout is None
    comm = comm.tracing() if traced else comm
    with NoHostTensors() as guard:
        out = every_collective(comm)
    check_on(guard)
    for name, t in out.items():
        assert t.device.type == "meta" and tuple(t.shape) == SHAPES[name], (name, t)
    if traced:  # functional collectives (the traced forms): no c10d call of their own eagerly
        assert any(name.startswith("_c10d_functional") for name in guard.collectives())


def test_the_guard_refuses_a_cpu_tensor_as_nccl_does(fake8):
    """The old communicator's small tensors (tags, agreements, layout checks) were made on the CPU: refused here."""
    comm = TorchCommunicator(device="meta")
    with NoHostTensors(), pytest.raises(RuntimeError, match="a CPU tensor reached a collective"):
        comm.all_gather(torch.ones(1, 3))


def test_check_layout_gathers_a_digest_on_the_device(fake8):
    comm = TorchCommunicator(device="meta")
    with NoHostTensors() as guard:
        layout = shard_layout(mlp(), comm)  # calls comm.check_layout
    check_on(guard)
    # one small gather (the fingerprint's 16 bytes a rank), not all_gather_object's pickles on the current device
    assert guard.seen == [("c10d._allgather_base_.default", ("meta", "meta"), (torch.uint8, torch.uint8))]
    assert layout.world_size == W


def test_check_layout_names_the_difference_from_gathered_descriptions(fake8):
    """Where the fingerprints differ, each rank's description comes by a second gather (here the fake group gives
    every rank this rank's bytes; rank 7's fingerprint and description are changed on their way back)."""
    comm = TorchCommunicator(device="cpu")
    layout, other = shard_layout(mlp(), comm), shard_layout(mlp(sizes=(6, 9, 5, 4)), comm)
    gather_host, gather_objects = comm._gather_host, comm._gather_objects
    assert gather_objects(("a", 1), "objects") == [("a", 1)] * W

    def fingerprints(sent: torch.Tensor, what: str) -> torch.Tensor:
        table = gather_host(sent, what).view(W, -1).clone()
        if "fingerprint" in what:
            table[-1] = torch.frombuffer(bytearray.fromhex(other.fingerprint), dtype=torch.uint8)
        return table.view(-1)

    def descriptions(obj: Any, what: str) -> list[Any]:
        return [*gather_objects(obj, what)[:-1], other.describe()]

    comm._gather_host, comm._gather_objects = fingerprints, descriptions  # type: ignore[method-assign]
    with pytest.raises(fdist.LayoutMismatchError, match="rank 0 vs rank 7"):
        comm.check_layout(layout)


def test_unit_call_tags_are_gathered_on_the_device(fake8):
    comm = TorchCommunicator(device="meta")
    with NoHostTensors() as guard:
        tags = comm.all_gather_ints((3, 1, 2))
    check_on(guard)
    assert [dt for _, _, dts in guard.seen for dt in dts] == [torch.float32, torch.float32]
    assert tags == [[0, 0, 0]] * W  # the host's zeros for the meta data


@pytest.mark.parametrize("failed", [False, True])
def test_meta_init_agreement_all_reduces_on_the_device(fake8, failed):
    comm = TorchCommunicator(device="meta")
    with NoHostTensors() as guard:
        if failed:
            with pytest.raises(KeyError, match="this rank's own"):
                agree(comm, KeyError("this rank's own"), generator_digest())
        else:
            agree(comm, None, generator_digest())
    check_on(guard)
    assert [dt for _, _, dts in guard.seen for dt in dts] == [torch.float64]


def test_device_from_local_rank(monkeypatch):
    """An accelerator backend's device is LOCAL_RANK's (no accelerator needed to say so); gloo's the CPU."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_rank() == 3
    assert device_for("nccl", local_rank()) == torch.device("cuda", 3)
    assert device_for("cpu:gloo,cuda:nccl", 3) == torch.device("cuda", 3)
    assert device_for("gloo", 3) == torch.device("cpu")
    assert device_for("xccl", 1) == torch.device("xpu", 1)
    monkeypatch.delenv("LOCAL_RANK")
    assert local_rank() is None


def test_the_communicator_takes_its_device_from_local_rank(fake8, monkeypatch):
    """A group of an accelerator backend (here the fake one, for CUDA tensors): the communicator's device is
    ``cuda:LOCAL_RANK``, its waits unbounded by fzero; on the same group as gloo would (CPU), bounded."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    group = dist.new_group(list(range(W)), backend="cuda:fake")
    comm = TorchCommunicator(group)
    assert comm.device == torch.device("cuda", 3) and comm.timeout is None
    assert "device=cuda:3" in repr(comm) and "timeout" not in repr(comm)
    assert comm.tracing().device == comm.device
    assert fzero.comm.CountingCommunicator(comm).device == comm.device  # wrappers take it (Communicator.wrapping)
    host = TorchCommunicator(device="cpu")
    assert host.timeout == DEFAULT_TIMEOUT and "timeout=600s" in repr(host)


@pytest.fixture()
def waits(monkeypatch):
    """Every wait of a c10d work the communicator starts: the ``timeout`` it was given (None: none)."""
    log: list[Any] = []

    class Recorded:
        def __init__(self, work: Any):
            self.work = work

        def wait(self, timeout: datetime.timedelta | None = None) -> Any:
            log.append(timeout)
            return self.work.wait() if timeout is None else self.work.wait(timeout)

    def recording(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            work = fn(*args, **kwargs)
            return Recorded(work) if work is not None else None
        return call

    for name in ("all_reduce", "broadcast", "all_to_all_single", "isend", "irecv"):
        monkeypatch.setattr(dist, name, recording(getattr(dist, name)))
    for name in ("_c10d_all_gather", "_c10d_reduce_scatter"):
        monkeypatch.setattr(fdist, name, recording(getattr(fdist, name)))
    return log


@pytest.mark.parametrize("via", PATHS[:2], ids=["backend's", "point to point"])
def test_waits_on_the_device_have_no_timeout_and_on_the_cpu_are_bounded(fake8, waits, via):
    """NCCL's ``wait(timeout)`` holds the host until the GPU is done; ``wait()`` orders the streams only."""
    with NoHostTensors():
        every_collective(TorchCommunicator(device="meta", **via))
    assert waits and all(t is None for t in waits), waits
    waits.clear()
    every_collective(TorchCommunicator(device="cpu", **via))  # the fake group, as gloo's waits are
    bound = datetime.timedelta(seconds=DEFAULT_TIMEOUT)
    assert waits and all(t is not None and t <= bound for t in waits), waits


def test_start_process_group_sets_the_device_and_binds_the_group(monkeypatch):
    calls: list[tuple[str, Any, Any]] = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device, None)))
    assert start_process_group("nccl", env={"LOCAL_RANK": "3"}) == torch.device("cuda", 3)
    bound = datetime.timedelta(seconds=DEFAULT_TIMEOUT)
    assert calls == [("set_device", torch.device("cuda", 3), None),
                     ("init", "nccl", {"timeout": bound, "device_id": torch.device("cuda", 3)})]
    calls.clear()
    assert start_process_group("gloo", timeout=30, env={"LOCAL_RANK": "1"}) == torch.device("cpu")
    assert calls == [("init", "gloo", {"timeout": datetime.timedelta(seconds=30)})]
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        start_process_group("nccl", env={})


def graph_collectives(found: list[tuple[str, set[str]]]) -> Any:
    """A compiler (AOTAutograd's forward and backward graphs, run by torch's kernels as ``aot_eager``) that records
    each collective of the graphs and the devices of its tensors."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        for node in gm.graph.nodes:
            if node.op == "call_function" and is_collective(node.target):
                vals = [a.meta.get("val") for a in tp.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]
                found.append((str(node.target), {v.device.type for v in vals if isinstance(v, torch.Tensor)}))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record)


def meta_mlp() -> torch.nn.Module:
    with torch.device("meta"):
        return mlp()


@pytest.mark.filterwarnings("ignore:aten..broadcast_tensors")  # autograd on meta tensors through a compiled graph
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_step_on_the_device_sends_no_cpu_tensor(fake8, stage, compiled):
    """``init_train_state`` and a step on ``device="meta"``: every collective's tensors on it (eager: the guard;
    compiled: the graphs' collectives). The communicator's own thread is off, as the guard is one thread's."""
    comm = TorchCommunicator(device="meta")
    comm.overlaps = False
    model = meta_mlp()
    with NoHostTensors() as guard:
        state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=stage, init="reset_parameters",
                                       device="meta", units=children if stage == 3 else None)
    check_on(guard)
    assert state.shard.master[0].device.type == "meta"
    loss_fn = fzero.module_loss(model, torch.nn.functional.mse_loss)
    batch = (torch.zeros(1, 2, 6, device="meta"), torch.zeros(1, 2, 3, device="meta"))
    found: list[tuple[str, set[str]]] = []
    step = fzero.make_train_step(loss_fn, comm, compile={"backend": graph_collectives(found)} if compiled else False)
    with NoHostTensors() if not compiled else contextlib.nullcontext() as guard:
        state, metrics = step(state, batch)
    if compiled:
        assert found and all(devices == {"meta"} for _, devices in found), found
        names = {name for name, _ in found}
        assert "_c10d_functional.all_gather_into_tensor.default" in names
        assert ("_c10d_functional.reduce_scatter_tensor.default" in names) == (stage > 1)
    else:
        check_on(guard)
        names = guard.collectives()
        assert ("c10d._reduce_scatter_base_.default" in names) == (stage > 1)
        if stage == 3:  # a tag per unit call and the forward's end (float32 on the device): the three units, the end
            tags = [s for s in guard.seen if s[0] == "c10d._allgather_base_.default" and s[2][0] == torch.float32
                    and s[1] == ("meta", "meta")]
            assert len(tags) >= 4
    assert {k: v.device.type for k, v in metrics.items() if k != "lr"} == dict.fromkeys(
        ("loss", "found_inf", "scale", "grad_norm"), "meta")
    assert state.shard.master[0].device.type == "meta"


def test_a_mesh_step_on_the_device_sends_no_cpu_tensor(fake8):
    """HSDP (2 replicas of 4 shards): the shard and replica groups' communicators take the device."""
    comm = TorchCommunicator(device="meta", mesh=(2, 4))
    comm.overlaps = False
    assert comm.replica is not None and comm.replica.device == comm.device
    model = meta_mlp()
    with NoHostTensors() as guard:
        state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=2, init="reset_parameters",
                                       device="meta")
        step = fzero.make_train_step(fzero.module_loss(model, torch.nn.functional.mse_loss), comm)
        step(state, (torch.zeros(1, 2, 6, device="meta"), torch.zeros(1, 2, 3, device="meta")))
    check_on(guard)


@pytest.mark.parametrize("dtype,members,native", [(torch.float32, W, True), (torch.bfloat16, W, True),
                                                  (torch.float16, W, False), (torch.float32, 6, False)],
                         ids=["fp32 W=8", "bf16 W=8", "fp16 W=8", "fp32 W=6"])
def test_averages_are_the_backends_avg_where_it_gives_the_divides_bits(fake8, monkeypatch, dtype, members, native):
    """On an accelerator ``avg`` is ``ReduceOp.AVG`` (no divide pass after) where 1/W scales exactly (W a power of
    two) and the scaled terms stay normal (not fp16); otherwise a SUM, then the divide, as on gloo."""
    ops: list[Any] = []
    real_all_reduce, real_reduce_scatter = dist.all_reduce, fdist._c10d_reduce_scatter
    monkeypatch.setattr(fdist.dist, "all_reduce", lambda t, op, **kw: (ops.append(op), real_all_reduce(t, op, **kw))[1])
    monkeypatch.setattr(fdist, "_c10d_reduce_scatter",
                        lambda out, x, op, **kw: (ops.append(op), real_reduce_scatter(out, x, op, **kw))[1])
    group = dist.new_group(list(range(members)))
    comm = TorchCommunicator(group, device="meta", reduce_scatter_via="reduce_scatter", all_reduce_via="all_reduce")
    x = torch.ones(1, members * 4, device="meta", dtype=dtype)
    comm.all_reduce(x, "avg")
    comm.reduce_scatter(x, "avg")
    comm.all_reduce(x, "sum")
    want = dist.ReduceOp.AVG if native else dist.ReduceOp.SUM
    assert ops == [want, want, dist.ReduceOp.SUM]
