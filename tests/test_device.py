"""The state on a device that is not the CPU: every leaf there, no device mix, no host read inside a step.

A CPU-only torch runs no CUDA kernel, so the device here is ``meta``, which is as strict as CUDA where it matters: a
meta tensor meeting a CPU one raises ("Tensor on device cpu is not on the expected device meta!"; a 0-d CPU tensor
is a scalar to both, as on CUDA), and reading one on the host raises (``.item()``, ``bool``: on CUDA a stall until
the device drains). So a state built with ``init_train_state(..., device="meta")`` that steps without raising mixes no
CPU tensor into its step, and :class:`HostReads` records every read of a device tensor an eager step makes.

The rules that run torch.optim piece by piece (``ShardRule``: Muon, Adafactor, ``from_torch_optim``) read their step
counts and the overflow flag on the host, as torch.optim's own non-capturable step and ``GradScaler.step`` do: they
step on meta under :class:`HostAnswers`, which answers such a read with zeros and records where it came from, so the
test holds them to no device mix and to reads in the rule's own code only.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as tp
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

import fzero
from fzero.comm import CountingCommunicator
from fzero.compiled import no_missed_steps
from fzero.quantized import QuantizedCommunicator
from fzero.schedules import warmup_cosine
from helpers import CHEAP_COMPILE

META = torch.device("meta")
# what a step may read on the host: nothing of the device's
HOST_READ_OPS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
                 torch.ops.aten.nonzero.default)


class HostReads(TorchDispatchMode):
    """Records each host read (``_local_scalar_dense``, ``is_nonzero``, ``nonzero``) of a tensor not on the CPU, and
    each copy from the host to such a tensor (on CUDA a copy from pageable host memory waits for the device too)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in HOST_READ_OPS and args[0].device.type != "cpu":
            self.reads.append(f"{func} of a {args[0].device} tensor")
        elif func is torch.ops.aten.copy_.default and args[1].device.type == "cpu" != args[0].device.type:
            self.reads.append(f"{func} from the host to {args[0].device}, {tuple(args[1].shape)}")
        elif func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu" and \
                torch.device(kwargs.get("device") or "cpu").type != "cpu" and not kwargs.get("non_blocking"):
            # (an asynchronous copy is fzero's own choice, from pinned memory on CUDA: replicas._sent)
            self.reads.append(f"{func} from the host to {kwargs['device']}, {tuple(args[0].shape)}")
        return func(*args, **kwargs)


class Net(torch.nn.Module):
    """Two blocks (stage 3's units), an unused head when asked, dropout."""

    def __init__(self, spare: bool = False) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 12)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.out = torch.nn.Linear(12, 3)
        self.spare = torch.nn.Linear(12, 3) if spare else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(12, 12)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(torch.relu(self.fc(h)))


def meta_net(spare: bool = False) -> Net:
    with torch.device("meta"):
        return Net(spare)


def batch_for(comm: fzero.Communicator, device: torch.device, accum: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    lead = (comm.local_ranks,) if accum == 1 else (comm.local_ranks, accum)
    return torch.randn(*lead, 4, 6, device=device), torch.randn(*lead, 4, 3, device=device)


class HostAnswers(TorchDispatchMode):
    """Answers a host read of a meta tensor (a copy to the CPU, ``.item()``) with zeros, recording the fzero module
    and function that asked (the innermost fzero frame)."""

    def __init__(self) -> None:
        super().__init__()
        self.askers: set[tuple[str, str]] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        meta_in = bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_meta
        to_host = func is torch.ops.aten._to_copy.default and torch.device(kwargs.get("device") or "meta").type == "cpu"
        if meta_in and (to_host or func is torch.ops.aten._local_scalar_dense.default):
            frame = next(f for f in reversed(traceback.extract_stack()) if f"{os.sep}fzero{os.sep}" in f.filename)
            self.askers.add((os.path.basename(frame.filename), frame.name))
            if to_host:
                return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
            return False if args[0].dtype == torch.bool else 0
        return func(*args, **kwargs)


def off_device(state: fzero.TrainState, device: torch.device, scheduled: set[str] = frozenset()) -> list[str]:
    """The state's leaves not on ``device``, but the ones torch keeps on the host by design: unscheduled
    hyperparameters (0-d float64, scalars to the kernels), generator states, the calls counter, the ``ShardRule``s'
    per-parameter scalars."""
    out = []
    for path, x in tp.tree_flatten_with_path(state)[0]:
        name = tp.keystr(path)
        if not isinstance(x, torch.Tensor) or x.device == device:
            continue
        hyper = ".opt.hyper" in name and x.dim() == 0 and not any(f"'{k}'" in name for k in scheduled)
        if x.device.type == "cpu" and (hyper or name.startswith((".rng", ".calls", ".opt.scalars"))):
            continue
        out.append(f"{name} on {x.device}")
    return out


def steps_on(device: torch.device, comm: fzero.Communicator, *, stage: int = 2, optimizer: Any = None,
             compile: Any = False, donate: bool = False, accum: int = 1, spare: bool = False,
             precision: fzero.MixedPrecision = fzero.MixedPrecision(), init: Any = "reset_parameters",
             steps: int = 2, **step_kw: Any) -> tuple[fzero.TrainState, list[str]]:
    """``steps`` steps of :class:`Net` (``spare``: with a head no loss reaches) on a state built on ``device``; the
    state and the host reads they made. ``step_kw``: for ``make_train_step``."""
    model = meta_net(spare)
    state = fzero.init_train_state(model, optimizer or fzero.adamw(1e-3), comm, stage=stage, init=init,
                                   device=device, precision=precision,
                                   units=(Block,) if stage == 3 else None)
    step = fzero.make_train_step(fzero.module_loss(model, torch.nn.functional.mse_loss), comm, compile=compile,
                                 donate=donate, accum_steps=accum, **step_kw)
    batch = batch_for(comm, device, accum)
    # a dispatch mode and torch.compile do not mix: a compiled step is held to no read by the meta device alone
    reads = HostReads() if not compile else contextlib.nullcontext(HostReads())
    with reads as seen:
        for _ in range(steps):
            state, _ = step(state, batch)
    return state, seen.reads


COMPILED = dict(compile=CHEAP_COMPILE)
CASES: dict[str, tuple[Callable[[], fzero.Communicator], dict[str, Any]]] = {
    "stage1": (lambda: fzero.SimulatedWorld(2), dict(stage=1)),
    "stage2": (lambda: fzero.SimulatedWorld(2), dict(stage=2)),
    "stage3": (lambda: fzero.SimulatedWorld(2), dict(stage=3)),
    "stage1 donating": (lambda: fzero.SimulatedWorld(2), dict(stage=1, donate=True)),
    "stage2 donating": (lambda: fzero.SimulatedWorld(2), dict(stage=2, donate=True)),
    "stage3 donating": (lambda: fzero.SimulatedWorld(2), dict(stage=3, donate=True)),
    "stage1 compiled": (lambda: fzero.SimulatedWorld(2), dict(stage=1, **COMPILED)),
    "stage2 compiled": (lambda: fzero.SimulatedWorld(2), dict(stage=2, **COMPILED)),
    "stage3 compiled": (lambda: fzero.SimulatedWorld(1), dict(stage=3, **COMPILED)),
    "stage2 compiled donating": (lambda: fzero.SimulatedWorld(2), dict(stage=2, donate=True, **COMPILED)),
    "sgd": (lambda: fzero.SimulatedWorld(2), dict(optimizer=fzero.sgd(1e-2, momentum=0.9))),
    "sgd compiled": (lambda: fzero.SimulatedWorld(2), dict(optimizer=fzero.sgd(1e-2, momentum=0.9), **COMPILED)),
    "fp16 dynamic scaling": (lambda: fzero.SimulatedWorld(2),
                             dict(precision=fzero.MixedPrecision(param_dtype=torch.float16))),
    "bf16 stage3": (lambda: fzero.SimulatedWorld(2),
                    dict(stage=3, precision=fzero.MixedPrecision(param_dtype=torch.bfloat16))),
    "accumulation": (lambda: fzero.SimulatedWorld(2), dict(accum=2)),
    "accumulation stage3": (lambda: fzero.SimulatedWorld(2), dict(stage=3, accum=2)),
    "clipping": (lambda: fzero.SimulatedWorld(2), dict(clip_norm=0.5)),
    "unused parameter": (lambda: fzero.SimulatedWorld(2), dict(spare=True, steps=3)),
    "unused parameter stage3": (lambda: fzero.SimulatedWorld(2), dict(stage=3, spare=True, steps=3)),
    "unused parameter compiled": (lambda: fzero.SimulatedWorld(2), dict(spare=True, **COMPILED)),
    "unused parameter zeros": (lambda: fzero.SimulatedWorld(2), dict(spare=True, unused="zeros")),
    "schedules": (lambda: fzero.SimulatedWorld(2), dict(schedules={"lr": warmup_cosine(1e-3, 1, 10)})),
    "schedules compiled": (lambda: fzero.SimulatedWorld(2),
                           dict(schedules={"lr": warmup_cosine(1e-3, 1, 10)}, **COMPILED)),
    # "flag": the digest rides on the step's all-reduce; reading it ("raise", every N calls) is the caller's host read
    "replica check": (lambda: fzero.SimulatedWorld(2), dict(check_replicas_every=1, replica_check="flag")),
    "mesh (2, 2)": (lambda: fzero.SimulatedWorld(4, mesh=(2, 2)), dict(stage=2)),
    "mesh (2, 2) stage3": (lambda: fzero.SimulatedWorld(4, mesh=(2, 2)), dict(stage=3)),
    "hpZ": (lambda: fzero.SimulatedWorld(4, mesh=(2, 2), hpz=True), dict(stage=3)),
    "quantized": (lambda: QuantizedCommunicator(fzero.SimulatedWorld(2), weights=8, grads=4), dict(stage=2)),
    "quantized stage3": (lambda: QuantizedCommunicator(fzero.SimulatedWorld(2), weights=8, grads=8), dict(stage=3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_state_on_a_device_steps_there_without_host_reads(case: str) -> None:
    make_comm, kw = CASES[case]
    state, reads = steps_on(META, make_comm(), **kw)
    scheduled = set(kw.get("schedules", {}))
    assert off_device(state, META, scheduled) == []
    assert reads == []
    assert state.device == META
    # known on the host: no parameter sat out a step, so a compiled step takes the fused update (unless one did)
    skipping = kw.get("spare", False) and kw.get("unused", "skip") == "skip"
    assert no_missed_steps(state.opt) is (not skipping)


def test_pretrained_weights_are_read_into_shards_on_the_state_device(tmp_path: Any) -> None:
    source = Net()
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(tmp_path / "model.safetensors"))
    for stage in (2, 3):
        state, reads = steps_on(META, fzero.SimulatedWorld(2), stage=stage,
                                init=fzero.pretrained(tmp_path / "model.safetensors"))
        assert off_device(state, META) == [] and reads == []


def test_the_default_device_is_the_models_and_device_is_checked() -> None:
    comm = fzero.SimulatedWorld(2)
    model = Net()
    state = fzero.init_train_state(model, fzero.adamw(), comm)
    assert state.device == torch.device("cpu") and off_device(state, torch.device("cpu")) == []
    with pytest.raises(ValueError, match=r"'inp.weight' is on cpu, but device='meta'"):
        fzero.init_train_state(Net(), fzero.adamw(), comm, device="meta")


def test_a_batch_on_another_device_than_the_state_is_named_before_any_collective() -> None:
    comm = CountingCommunicator(fzero.SimulatedWorld(2))
    model = meta_net()
    state = fzero.init_train_state(model, fzero.adamw(), comm, init="reset_parameters", device="meta")
    before = len(comm.records)
    step = fzero.make_train_step(fzero.module_loss(model, torch.nn.functional.mse_loss), comm)
    x, y = batch_for(comm, META)
    with pytest.raises(ValueError, match=r"batch\[1\] is on cpu, the state on meta"):
        step(state, (x, torch.randn(y.shape)))
    assert len(comm.records) == before


def test_write_back_gives_the_module_back_on_the_state_device() -> None:
    comm = fzero.SimulatedWorld(2)
    model = meta_net()
    state = fzero.init_train_state(model, fzero.adamw(), comm, stage=3, init="reset_parameters", device="meta",
                                   units=(Block,))
    fzero.write_back(state, comm, model)
    assert {p.device for p in model.parameters()} == {META}


def shard_rules() -> dict[str, Any]:
    return {"muon": fzero.muon(lr=2e-2, matrices=lambda path: path.endswith("fc.weight")),
            "adafactor": fzero.adafactor(lr=2e-2),
            "from_torch_optim": fzero.from_torch_optim(torch.optim.NAdam, lr=1e-2)}


# where a ShardRule's step reads the device on the host: the overflow flag, the step count, which parameters
# sat out (torch.optim's own non-capturable step reads its counts on the host)
RULE_READS = {"sharding.py": {"_step_in_place"}, "muon_rules.py": None, "adafactor_rules.py": None,
              "torch_optim_rules.py": None}


@pytest.mark.parametrize("rule", list(shard_rules()))
@pytest.mark.parametrize("stage", [2, 3])
def test_shard_rules_step_on_the_state_device_reading_only_in_the_rule(rule: str, stage: int) -> None:
    comm = fzero.SimulatedWorld(2)
    model = meta_net()
    state = fzero.init_train_state(model, shard_rules()[rule], comm, stage=stage, init="reset_parameters",
                                   device=META, units=(Block,) if stage == 3 else None)
    step = fzero.make_train_step(fzero.module_loss(model, torch.nn.functional.mse_loss), comm)
    batch = batch_for(comm, META)
    with HostAnswers() as answers:
        for _ in range(2):
            state, _ = step(state, batch)
    assert off_device(state, META) == []
    assert answers.askers, "a ShardRule's step reads its overflow flag on the host"
    outside = {(f, fn) for f, fn in answers.askers if f not in RULE_READS or (RULE_READS[f] and fn not in RULE_READS[f])}
    assert outside == set()


def test_unscale_and_check_alone_with_used_flags_builds_nothing_on_the_host() -> None:
    comm = fzero.SimulatedWorld(2)
    grads = [torch.randn(2, 8, device=META), torch.randn(2, 3, device=META)]
    with HostReads() as seen:
        checked = fzero.unscale_and_check(fzero.static_scaler(1.0, device=META), grads, comm,
                                          used=torch.ones(2, 5, device=META))
    assert seen.reads == []
    assert {t.device for t in (*checked.grads, checked.found_inf, checked.grad_norm, checked.loss, checked.used)} == {
        META}


def test_the_overlap_thread_runs_collectives_on_the_callers_cuda_stream(monkeypatch: Any) -> None:
    """A thread starts on the default stream of device 0: the runner hands it the caller's current stream (and so
    device). No CUDA here: torch.cuda's stream calls are stand-ins that record what the thread ran under."""
    from fzero.buckets import Runner

    caller, entered = object(), []

    @contextlib.contextmanager
    def stream(s: Any) -> Any:
        entered.append(s)
        yield

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: caller)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    runner = Runner()
    with runner:
        result = runner.submit(True, lambda x: (x, list(entered)), 7)
    assert result() == (7, [caller])
