"""fzero on one GPU: numerics against plain torch, a real launch, and step time and memory at GPT-2 small's size.

One command prints one markdown table (and its footnotes) with three kinds of rows:

* ``numerics``: ``fzero.SimulatedWorld(2)`` and ``SimulatedWorld(8)`` at stages 1-3, each eager, donating
  (``donate=True``) and compiled (``make_train_step(compile=...)``), trained a few steps of AdamW in fp32 on a small
  TinyGPT (``benchmarks/models.py``), against the plain-torch oracle on the same device: what DDP computes, one model
  copy per rank, each rank's gradient summed over the ranks in rank order and divided by W, then
  ``torch.optim.AdamW(fused=True)``. Run under ``torch.use_deterministic_algorithms(True)`` (``warn_only``: an op
  without a deterministic kernel warns, and the footnote counts the warnings) with
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8``. The row gives the largest absolute difference of any parameter on any rank,
  whether every bit agrees, and PASS when the difference is within :data:`NUMERICS_TOL`;
* ``torchrun``: this script under ``python -m torch.distributed.run --nproc-per-node 1`` (NCCL on a GPU, gloo on the
  CPU; a bounded launch, killed with its rank past ``--timeout``) trains the same steps eagerly at stages 1-3 with
  ``fzero.dist.TorchCommunicator``; PASS when its parameters equal ``SimulatedWorld(1)``'s bit for bit (a world of
  one rank reorders no sum);
* ``perf``: a GPT-2-small-sized TinyGPT (about 163M parameters, bf16 compute) at W=1, in the same torchrun launch
  (its process group of one, as a one-GPU job is launched): the median step time after warm-up
  (``torch.cuda.synchronize()`` around every timed step) and the caching allocator's peak, allocated and reserved
  bytes of plain torch (``torch.autocast`` bf16, fp32 parameters, ``torch.optim.AdamW(fused=True)``), FSDP2
  (``fully_shard`` per block and the root, ``MixedPrecisionPolicy(bf16, reduce fp32)``) and fzero stages 1-3, eager
  and compiled, donating, on ``TorchCommunicator``; beside fzero's rows, the bytes its state holds after a step (every
  storage of the state pytree, counted once) and ``fzero.memory_report(...).held_total``. PASS when the last loss is
  finite and within :data:`LOSS_RTOL` of plain torch's (every system trains the same model on the same data).

The script exits non-zero when any row fails or raises (the exception is printed on stderr), so it never passes
silently. A compiled row also fails when no graph was compiled. The launch saves each finished row, so one killed
past ``--timeout`` still reports what it finished (the rest: ERROR).

How to run (from the repository root)::

    python benchmarks/bench_gpu.py                       # on a GPU (sized for 8 minutes of one H200)
    python benchmarks/bench_gpu.py --tiny --device cpu   # tiny sizes: a CPU smoke test (tests/test_bench_gpu.py)
    python benchmarks/bench_gpu.py --only numerics,torchrun   # some sections only (numerics, torchrun, perf)

The last footnote gives the run's time. With ``--tiny`` the launch runs beside this process's numerics (two CPU
processes at once); otherwise after them, so its timed steps have the device to themselves.

``--device auto`` (the default) is ``cuda`` when a GPU is present, else ``cpu``. ``--tiny`` shrinks every model
(the perf rows then time a 0.1M-parameter model: a smoke test of the script, not a measurement) and, on the CPU,
compiles with ``torch.compile(backend="eager")`` (dynamo's whole-step graph and fzero's traced collectives, run by
eager kernels: inductor's C++ compile would take minutes on two cores); elsewhere the compiled rows use inductor
(``--compile-backend`` chooses). On the CPU the allocator columns are ``n/a`` (the CPU has no caching allocator to
ask); the state and memory_report columns are counted the same way on every device.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

# cuBLAS reads this when it first starts: deterministic matmuls need it set before any CUDA work (inherited by the
# torchrun rank too)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import fzero  # noqa: E402
from models import GPTConfig, build_model, lm_loss, make_criterion, random_batch  # noqa: E402

MIB = 2.0**20
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.1
NUMERICS_TOL = 1e-5  # max |p_fzero - p_oracle| over every parameter and rank, fp32 (module doc)
LOSS_RTOL = 0.05  # perf rows: last loss within 5 % of plain torch's (bf16 compute, autocast against bf16 params)
SECTIONS = ("numerics", "torchrun", "perf")
WORLDS = (2, 8)
STAGES = (1, 2, 3)
MODES = ("eager", "donate", "compiled")

# numerics: small enough that W=8 rows and their compiles are quick, deep enough to have stage-3 units
NUMERICS = GPTConfig(vocab=256, d_model=128, n_layers=2, n_heads=4, seq_len=64, global_batch=16)
NUMERICS_TINY = GPTConfig(vocab=64, d_model=32, n_layers=1, n_heads=2, seq_len=8, global_batch=16)
PERF_TINY = GPTConfig(vocab=256, d_model=64, n_layers=1, n_heads=2, seq_len=32, global_batch=4)


def gpt2_small(seq_len: int, batch: int) -> GPTConfig:
    """GPT-2 small's shape as a TinyGPT (untied head, as ``bench_gloo_step.py``'s 162M): about 163M parameters."""
    return GPTConfig(vocab=50304, d_model=768, n_layers=12, n_heads=12, seq_len=seq_len, global_batch=batch)


@dataclasses.dataclass
class Row:
    """One line of the table. ``kind``: numerics, torchrun or perf; ``verdict``: PASS, FAIL or ERROR."""

    name: str
    kind: str
    verdict: str = "ERROR"
    diff: float | None = None
    bitwise: bool | None = None
    tol: str = "-"
    ms: float | None = None
    peak: float | None = None
    allocated: float | None = None
    reserved: float | None = None
    state: float | None = None
    report: float | None = None
    loss: float | None = None
    note: str = ""


# ----------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--tiny", action="store_true", help="tiny models everywhere (a CPU smoke test)")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help="comma-separated sections to run, from: " + ", ".join(SECTIONS))
    p.add_argument("--steps", type=int, default=0, help="timed steps per perf row (default 10; --tiny 3)")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps per perf row, compiles included (default 3; "
                   "--tiny 1)")
    p.add_argument("--numerics-steps", type=int, default=3, help="training steps of every numerics and torchrun row")
    p.add_argument("--seq", type=int, default=0, help="perf rows' sequence length (default 1024 on cuda, 128 on cpu)")
    p.add_argument("--batch", type=int, default=0, help="perf rows' batch in sequences (default 8 on cuda, 4 on cpu)")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend of the compiled rows (default inductor; --tiny on the CPU: eager)")
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (0: torch's default)")
    p.add_argument("--timeout", type=float, default=0.0,
                   help="the torchrun launch (torchrun and perf rows) is killed past this many s (default 480; "
                        "--tiny 120)")
    p.add_argument("--worker", metavar="OUT_DIR", help=argparse.SUPPRESS)  # the torchrun rank's entry
    p.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    if bad := [s for s in args.only if s not in SECTIONS]:
        p.error(f"--only: unknown sections {bad}; choose from {', '.join(SECTIONS)}")
    try:
        args.device = resolve_device(args.device)
    except (RuntimeError, ValueError) as e:
        p.error(str(e))
    cuda = args.device.type == "cuda"
    args.steps = args.steps or (3 if args.tiny else 10)
    args.warmup = args.warmup or (1 if args.tiny else 3)
    args.seq = args.seq or (1024 if cuda else 128)
    args.batch = args.batch or (8 if cuda else 4)
    args.timeout = args.timeout or (120.0 if args.tiny else 480.0)
    if args.compile_backend is None:
        args.compile_backend = "eager" if args.tiny and not cuda else "inductor"
    if min(args.steps, args.warmup, args.numerics_steps) < 1:
        p.error("--steps, --warmup and --numerics-steps must be >= 1")
    return args


def resolve_device(name: str) -> torch.device:
    """``auto``: the GPU when torch sees one, else the CPU; a CUDA device asked for without one is an error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {name}: torch {torch.__version__} sees no CUDA device")
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"--device {name}: cpu or cuda")
    return device


# ----------------------------------------------------------------------------- helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def deterministic(on: bool) -> Iterator[list[warnings.WarningMessage]]:
    """Deterministic algorithms (``warn_only``: an op without a deterministic kernel warns instead of raising) and
    attention by SDPA's math backend (memory-efficient attention, the one CUDA picks for fp32, has a nondeterministic
    backward); yields the warnings saying an op is nondeterministic. The previous settings come back after."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    before, before_warn = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(on, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught, \
                sdpa_kernel(SDPBackend.MATH) if on else contextlib.nullcontext():
            warnings.simplefilter("always")
            yield caught
        for w in caught:  # everything else is shown as it would have been
            if "determinis" not in str(w.message):
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    finally:
        torch.use_deterministic_algorithms(before, warn_only=before_warn)


def determinism_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return sorted({str(w.message).splitlines()[0][:160] for w in caught if "determinis" in str(w.message)})


def graphs() -> int:
    """Graphs dynamo compiled so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a pytree), views counted once, meta tensors none."""
    seen: dict[int, int] = {}
    for t in torch.utils._pytree.tree_leaves(tensors):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            if hasattr(t, "to_local"):  # an FSDP2 DTensor: this rank's shard
                t = t.to_local()
            s = t.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def batches_for(cfg: GPTConfig, n: int, device: torch.device, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` global batches (the Markov-chain tokens of ``models.random_batch``) on ``device``."""
    return [tuple(t.to(device) for t in random_batch(cfg, seed=10_000 * (seed + 1) + i)) for i in range(n)]


def fzero_adamw() -> fzero.Optimizer:
    return fzero.adamw(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


def torch_adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)


def compile_option(mode: str, backend: str) -> Any:
    if mode != "compiled":
        return False
    return True if backend == "inductor" else {"backend": backend}


# ----------------------------------------------------------------------------- numerics
def oracle_params(cfg: GPTConfig, data: list, world: int, device: torch.device) -> dict[str, torch.Tensor]:
    """What DDP computes, without fzero: one model copy per rank on ``device``, each rank's gradient on its slice of
    the batch, summed over ranks in rank order and divided by W, then one fused ``torch.optim.AdamW`` step."""
    main = build_model(cfg).to(device)
    opt = torch_adamw(main.parameters())
    replicas = [copy.deepcopy(main) for _ in range(world)]
    for x, y in data:
        grads: dict[str, torch.Tensor] = {}
        for r, rep in enumerate(replicas):
            with torch.no_grad():
                for p, q in zip(rep.parameters(), main.parameters()):
                    p.copy_(q)
            rep.zero_grad(set_to_none=True)
            lm_loss(rep(x.chunk(world)[r]), y.chunk(world)[r]).backward()
            for n, p in rep.named_parameters():
                grads[n] = p.grad.clone() if n not in grads else grads[n] + p.grad
        for n, p in main.named_parameters():
            p.grad = grads[n] / world
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach() for n, p in main.named_parameters()}


def fzero_params(cfg: GPTConfig, data: list, comm: fzero.Communicator, stage: int, mode: str, device: torch.device,
                 backend: str) -> tuple[dict[str, torch.Tensor], int]:
    """The same run with fzero (``mode``: eager, donate or compiled): every rank's parameters ``{name: [R, ...]}``
    and the graphs compiled for it."""
    if mode == "compiled":
        torch._dynamo.reset()  # every compiled row its own cache: no earlier row's graphs or limits
    g0 = graphs()
    model = build_model(cfg).to(device)  # the state follows the parameters' device
    units = (type(model.blocks[0]),) if stage == 3 else None  # one unit per block, as FSDP2
    state = fzero.init_train_state(model, fzero_adamw(), comm, stage=stage, units=units)
    step = fzero.make_train_step(fzero.module_loss(model, make_criterion(cfg.vocab)), comm,
                                 donate=mode == "donate", compile=compile_option(mode, backend))
    for batch in data:
        state, _ = step(state, comm.split_batch(batch))
    return fzero.full_params(state.shard, comm), graphs() - g0


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, bool]:
    """Largest absolute difference over every parameter and rank row of ``got`` (``[R, ...]``) against ``want``, and
    whether every bit agrees."""
    diff, same = 0.0, True
    for name, w in want.items():
        g = got[name].to(w.device)
        w = w.expand_as(g)
        diff = max(diff, (g.double() - w.double()).abs().max().item())
        same = same and torch.equal(g, w)
    return diff, same


def numerics_rows(args: argparse.Namespace, cfg: GPTConfig) -> list[Row]:
    rows = []
    data = batches_for(cfg, args.numerics_steps, args.device)
    for world in WORLDS:
        try:
            want = oracle_params(cfg, data, world, args.device)
        except Exception as e:  # noqa: BLE001 - every row of this world says why
            traceback.print_exc()
            rows += [Row(f"SimulatedWorld({world}) s{s} {m}", "numerics", note=f"oracle: {describe(e)}")
                     for s in STAGES for m in MODES]
            continue
        for stage in STAGES:
            for mode in MODES:
                row = Row(f"SimulatedWorld({world}) s{stage} {mode}", "numerics", tol=f"{NUMERICS_TOL:g}")
                try:
                    got, compiled = fzero_params(cfg, data, fzero.SimulatedWorld(world), stage, mode, args.device,
                                                 args.compile_backend)
                    row.diff, row.bitwise = compare(got, want)
                    row.verdict = "PASS" if row.diff <= NUMERICS_TOL else "FAIL"
                    if mode == "compiled":
                        row.note = f"{compiled} graph(s), backend {args.compile_backend}"
                        if compiled < 1:
                            row.verdict, row.note = "FAIL", "no graph compiled: the step ran eagerly"
                except Exception as e:  # noqa: BLE001 - one failing row must not hide the others
                    traceback.print_exc()
                    row.note = describe(e)
                rows.append(row)
    return rows


# ----------------------------------------------------------------------------- the torchrun rank
def worker(args: argparse.Namespace) -> None:
    """The torchrun rank (a one-process group, as a one-GPU job is launched): the numerics model's steps eagerly at
    stages 1-3 on ``TorchCommunicator`` (every parameter), then the perf rows; what is done so far is saved to
    ``OUT_DIR/rank{r}.pt`` after every row, so a launch killed midway still reports its finished rows."""
    import torch.distributed as dist

    from fzero.dist import TorchCommunicator

    watch_parent(args.parent_pid, args.timeout)
    device = args.device  # the launcher's own (one rank: LOCAL_RANK 0 takes the device the script was given)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            **({"device_id": device} if device.type == "cuda" else {}))
    path = os.path.join(args.worker, f"rank{dist.get_rank()}.pt")
    out: dict[str, Any] = {"numerics": {}, "perf": [], "determinism": []}

    def save() -> None:
        torch.save(out, path + ".tmp")
        os.replace(path + ".tmp", path)  # the launcher never reads half a file

    try:
        if "torchrun" in args.only:
            cfg = NUMERICS_TINY if args.tiny else NUMERICS
            data = batches_for(cfg, args.numerics_steps, device)
            with deterministic(True) as caught:
                for stage in STAGES:
                    try:
                        got, _ = fzero_params(cfg, data, TorchCommunicator(), stage, "eager", device,
                                              args.compile_backend)
                        out["numerics"][f"s{stage}"] = {k: v.cpu() for k, v in got.items()}
                    except Exception:  # noqa: BLE001 - the launcher reports it on the row
                        traceback.print_exc()
                        out["numerics"][f"s{stage}"] = traceback.format_exc()[-1500:]
                    save()
            out["determinism"] = determinism_warnings(caught)
            save()
        if "perf" in args.only:
            cfg = PERF_TINY if args.tiny else gpt2_small(args.seq, args.batch)
            data = batches_for(cfg, args.warmup + args.steps, device, seed=1)
            for name, make in perf_systems(cfg, data, device, args.compile_backend):
                out["perf"].append(dataclasses.asdict(measure(name, make, args, device)))
                save()
    finally:
        dist.destroy_process_group()


def watch_parent(pid: int, timeout: float) -> None:
    """End this rank when the launching script is gone (killed outright, it cannot kill this session) or past
    ``timeout`` seconds."""
    start = time.monotonic()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            gone = False
            if pid:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    gone = True
            if gone or time.monotonic() - start > timeout:
                print(f"bench_gpu rank: {'the launching script is gone' if gone else 'past --timeout'}; exiting",
                      file=sys.stderr, flush=True)
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


class Launch:
    """:func:`worker` under ``python -m torch.distributed.run --nproc-per-node 1``, on a thread of this process
    (``fzero.testing.run_torchrun``: a new session; torchrun and its rank killed past ``--timeout``)."""

    def __init__(self, args: argparse.Namespace):
        from fzero.testing import run_torchrun

        self.dir = tempfile.mkdtemp(prefix="bench-gpu-")
        self.timeout = args.timeout
        forwarded = ["--device", str(args.device), "--threads", str(args.threads),
                     "--only", ",".join(args.only), "--numerics-steps", str(args.numerics_steps),
                     "--steps", str(args.steps), "--warmup", str(args.warmup), "--seq", str(args.seq),
                     "--batch", str(args.batch), "--timeout", str(args.timeout),
                     "--compile-backend", args.compile_backend, "--parent-pid", str(os.getpid()),
                     *(["--tiny"] if args.tiny else [])]
        self.result: dict[str, Any] = {}

        def run() -> None:
            try:
                self.result["rc"], self.result["out"] = run_torchrun(
                    1, os.path.abspath(__file__), ["--worker", self.dir, *forwarded], timeout=args.timeout,
                    pythonpath=[HERE])
            except Exception as e:  # noqa: BLE001 - reported on the rows
                self.result["rc"], self.result["out"] = -1, describe(e)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def results(self) -> tuple[dict[str, Any], str]:
        """What the rank saved (possibly in part) and, when the launch failed, why (its output's tail on stderr)."""
        self.thread.join(self.timeout + 60)  # run_torchrun's own bound comes first
        rc, out = self.result.get("rc", "still running"), self.result.get("out", "")
        path = os.path.join(self.dir, "rank0.pt")
        saved = torch.load(path, weights_only=True) if os.path.exists(path) else {}
        shutil.rmtree(self.dir, ignore_errors=True)
        why = "" if rc == 0 else f"launch killed past --timeout {self.timeout:g}s" if rc is None \
            else f"launch exited {rc}"
        if why or "Traceback" in out:
            print(f"torchrun launch ({why or 'a row raised'}), its output's tail:\n{out[-6000:]}", file=sys.stderr)
        return saved, why


def torchrun_rows(args: argparse.Namespace, sim: dict[int, Any], saved: dict[str, Any], why: str) -> list[Row]:
    """The launch's parameters against ``SimulatedWorld(1)``'s (``sim``), bit for bit."""
    backend = "nccl" if args.device.type == "cuda" else "gloo"
    rows = []
    for stage in STAGES:
        row = Row(f"torchrun W=1 s{stage} eager", "torchrun", tol="0 (bitwise)")
        theirs, ours = saved.get("numerics", {}).get(f"s{stage}"), sim[stage]
        if isinstance(ours, str):
            row.note = f"SimulatedWorld(1): {ours}"
        elif theirs is None or isinstance(theirs, str):
            row.note = why or "not run" if theirs is None else "rank: " + theirs.strip().splitlines()[-1][:200]
        else:
            row.diff, row.bitwise = compare({k: v.to(args.device) for k, v in theirs.items()},
                                            {k: v[0] for k, v in ours.items()})
            row.verdict = "PASS" if row.bitwise else "FAIL"
            row.note = f"{backend}, TorchCommunicator against SimulatedWorld(1)"
        rows.append(row)
    return rows


def simulated_one(args: argparse.Namespace, cfg: GPTConfig) -> dict[int, Any]:
    """``SimulatedWorld(1)``'s parameters at stages 1-3 (the torchrun rows' reference), or why it failed."""
    data = batches_for(cfg, args.numerics_steps, args.device)
    sim: dict[int, Any] = {}
    for stage in STAGES:
        try:
            sim[stage], _ = fzero_params(cfg, data, fzero.SimulatedWorld(1), stage, "eager", args.device,
                                         args.compile_backend)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            sim[stage] = describe(e)
    return sim


# ----------------------------------------------------------------------------- perf
@dataclasses.dataclass
class System:
    """A perf row's system: ``step(i)`` runs step ``i`` and returns its loss tensor, ``state()`` the tensors it holds
    between steps, ``report`` memory_report's held bytes (fzero)."""

    step: Callable[[int], torch.Tensor]
    state: Callable[[], Any]
    report: float | None = None
    note: str = ""


def plain_torch(cfg: GPTConfig, data: list, device: torch.device) -> System:
    """fp32 parameters, ``torch.autocast`` bf16, ``torch.optim.AdamW(fused=True)``: a one-GPU torch loop."""
    model = build_model(cfg).to(device)
    opt = torch_adamw(model.parameters())

    def step(i: int) -> torch.Tensor:
        x, y = data[i]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(x)
        loss = lm_loss(logits.float(), y)
        loss.backward()
        opt.step()
        return loss.detach()

    state = lambda: [list(model.parameters()), [p.grad for p in model.parameters()], opt.state]  # noqa: E731
    return System(step, state, note="autocast bf16, AdamW(fused=True)")


def fsdp2(cfg: GPTConfig, data: list, device: torch.device) -> System:
    """FSDP2 on the launch's one-process group: ``fully_shard`` on every block and the root, bf16 compute, fp32
    reduction."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(cfg).to(device)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch_adamw(model.parameters())

    def step(i: int) -> torch.Tensor:
        x, y = data[i]
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        return loss.detach()

    state = lambda: [list(model.parameters()), [p.grad for p in model.parameters()], opt.state]  # noqa: E731
    return System(step, state, note="fully_shard(blocks, root), bf16/fp32, AdamW(fused=True)")


def fzero_system(cfg: GPTConfig, data: list, device: torch.device, stage: int, compiled: bool,
                 backend: str) -> System:
    """fzero on ``TorchCommunicator`` over the launch's one-process group, bf16 compute, donating."""
    from fzero.dist import TorchCommunicator

    comm = TorchCommunicator()
    model = build_model(cfg).to(device)  # the state follows the parameters' device
    precision = fzero.MixedPrecision(param_dtype=torch.bfloat16)
    optimizer = fzero_adamw()
    units = (type(model.blocks[0]),) if stage == 3 else None
    holder = {"state": fzero.init_train_state(model, optimizer, comm, stage=stage, units=units, precision=precision)}
    step_fn = fzero.make_train_step(fzero.module_loss(model, make_criterion(cfg.vocab)), comm, donate=True,
                                    compile=compile_option("compiled" if compiled else "eager", backend))
    batches = [comm.split_batch(b) for b in data]
    report = fzero.memory_report(holder["state"].layout, optimizer, stage=stage, precision=precision, comm=comm)

    def step(i: int) -> torch.Tensor:
        holder["state"], metrics = step_fn(holder["state"], batches[i])
        return metrics["loss"]

    note = "donating" + (f", backend {backend}" if compiled else "")
    return System(step, lambda: holder["state"], report=report.held_total, note=note)


def perf_names() -> list[str]:
    return ["torch AdamW(fused)", "FSDP2 W=1", *(f"fzero s{s} {how}" for how in ("eager", "compiled") for s in STAGES)]


def perf_systems(cfg: GPTConfig, data: list, device: torch.device,
                 backend: str) -> list[tuple[str, Callable[[], System]]]:
    """The perf rows' systems (:func:`perf_names`), each built when its row starts."""
    makers: list[Callable[[], System]] = [
        lambda: plain_torch(cfg, data, device), lambda: fsdp2(cfg, data, device),
        *(lambda s=s, c=c: fzero_system(cfg, data, device, s, c, backend) for c in (False, True) for s in STAGES)]
    return list(zip(perf_names(), makers))


def measure(name: str, make: Callable[[], System], args: argparse.Namespace, device: torch.device) -> Row:
    """Build one system, warm it up (compiles), time ``args.steps`` steps (synchronized around each on a GPU), read
    the allocator and count what the system holds."""
    row = Row(name, "perf", tol=f"loss {LOSS_RTOL:.0%}")
    cuda, compiled = device.type == "cuda", "compiled" in name
    system = loss = None
    gc.collect()
    if compiled:
        torch._dynamo.reset()  # no earlier row's graphs held (their memory) or cached
    if cuda:
        torch.cuda.empty_cache()
        sync(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    try:
        g0 = graphs()
        system = make()
        for i in range(args.warmup):
            system.step(i)
        sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for i in range(args.warmup, args.warmup + args.steps):
            sync(device)
            t = time.perf_counter()
            loss = system.step(i)
            sync(device)
            times.append(time.perf_counter() - t)
        row.ms = statistics.median(times) * 1e3
        row.loss = float(loss)
        loss = None  # from here on only the system's own state is held
        gc.collect()
        if cuda:
            row.peak = (torch.cuda.max_memory_allocated(device) - base) / MIB
            row.allocated = (torch.cuda.memory_allocated(device) - base) / MIB
            row.reserved = torch.cuda.memory_reserved(device) / MIB
        row.state = storage_bytes(system.state()) / MIB
        row.report = system.report / MIB if system.report is not None else None
        row.note = system.note
        row.verdict = "PENDING"  # judge_perf compares the loss with plain torch's
        if compiled and graphs() - g0 < 1:
            row.verdict, row.note = "FAIL", "no graph compiled: the step ran eagerly"
    except Exception as e:  # noqa: BLE001 - one failing system must not hide the others
        traceback.print_exc()
        row.note = describe(e)
    finally:
        del system, loss
        gc.collect()
    return row


def perf_rows(saved: dict[str, Any], why: str) -> list[Row]:
    """The launch's perf rows, judged: PASS when the last loss is finite and within ``LOSS_RTOL`` of plain torch's."""
    got = {r["name"]: Row(**r) for r in saved.get("perf", [])}
    rows = [got.get(name) or Row(name, "perf", note=why or "not run") for name in perf_names()]
    ref = rows[0].loss if rows[0].verdict != "ERROR" else None
    for row in rows:
        if row.verdict == "PENDING":
            ok = row.loss is not None and math.isfinite(row.loss) and (
                ref is None or abs(row.loss - ref) <= LOSS_RTOL * abs(ref))
            row.verdict = "PASS" if ok else "FAIL"
    return rows


# ----------------------------------------------------------------------------- report
def describe(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:200].replace("|", "/")


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[Row], cuda: bool) -> str:
    """The one markdown table: every row, ``-`` where a column does not apply."""
    head = ["row", "kind", "max abs diff", "bitwise", "tol", "median ms/step", "peak MiB", "allocated MiB",
            "reserved MiB", "state MiB", "memory_report held MiB", "last loss", "verdict", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        # the allocator's columns: read on a GPU; on the CPU there is no caching allocator to read (n/a)
        alloc = [fmt(v, ".1f") if cuda else "n/a" if r.kind == "perf" else "-" for v in (r.peak, r.allocated,
                                                                                        r.reserved)]
        cells = [r.name, r.kind, fmt(r.diff, ".3g"), "-" if r.bitwise is None else "yes" if r.bitwise else "no",
                 r.tol, fmt(r.ms, ".1f"), *alloc, fmt(r.state, ".1f"), fmt(r.report, ".1f"), fmt(r.loss, ".4f"),
                 r.verdict, r.note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def footnotes(args: argparse.Namespace, numerics: GPTConfig, perf: GPTConfig, n_perf: int,
              det: list[str]) -> list[str]:
    cuda = args.device.type == "cuda"
    where = torch.cuda.get_device_name(args.device) if cuda else f"CPU, {torch.get_num_threads()} thread(s)"
    out = [
        f"Device {args.device} ({where}), torch {torch.__version__}.",
        f"numerics: TinyGPT vocab {numerics.vocab}, d_model {numerics.d_model}, {numerics.n_layers} layer(s), "
        f"seq {numerics.seq_len}, global batch {numerics.global_batch}, fp32, {args.numerics_steps} AdamW steps "
        f"(lr {LR:g}, weight decay {WEIGHT_DECAY:g}); oracle: one model copy per rank, gradients summed in rank order "
        f"and divided by W, torch.optim.AdamW(fused=True), on the same device; PASS: max abs difference <= "
        f"{NUMERICS_TOL:g} over every parameter and rank. Deterministic algorithms on (warn_only), attention by SDPA's "
        "math backend, "
        f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}; ops that warned they have no "
        f"deterministic kernel: {'; '.join(det) if det else 'none'}.",
        f"compiled rows: torch.compile backend {args.compile_backend}"
        + (" (--tiny on the CPU: dynamo's whole-step graph run by eager kernels, not inductor's code)"
           if args.compile_backend == "eager" else "") + ".",
        f"torchrun: python -m torch.distributed.run --nproc-per-node 1, {'nccl' if cuda else 'gloo'}, "
        "TorchCommunicator; PASS: bitwise equal to SimulatedWorld(1).",
        "perf: in the torchrun launch (its one-process group: FSDP2's and TorchCommunicator's), "
        + ("beside this process's numerics (--tiny); " if args.tiny else "after this process's numerics, alone on "
           "the device; ")
        + f"TinyGPT vocab {perf.vocab}, d_model {perf.d_model}, {perf.n_layers} layer(s), seq {perf.seq_len}, "
        f"batch {perf.global_batch}: {n_perf:,} parameters, bf16 compute, W=1; median of {args.steps} steps after "
        f"{args.warmup} warm-up step(s)" + (", torch.cuda.synchronize() around each" if cuda else "") + ". "
        "state MiB: the distinct storages the system holds between steps (torch: parameters, gradients, AdamW state; "
        "fzero: the TrainState pytree after a donating step); memory_report held MiB: fzero.memory_report's "
        "held_total for the state's layout.",
    ]
    if cuda:
        out.append("peak/allocated MiB: torch.cuda.max_memory_allocated over the timed steps and memory_allocated "
                   "after them, each less what was allocated before the system was built; reserved MiB: "
                   "torch.cuda.memory_reserved (the caching allocator's whole pool).")
    else:
        out.append("peak/allocated/reserved MiB: n/a on the CPU (no caching allocator to ask; RSS is the whole "
                   "process's); state MiB and memory_report are counted the same way as on a GPU.")
    if args.tiny:
        out.append("--tiny: every model shrunk; perf numbers are a smoke test of the script, not a measurement.")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.type == "cuda":
        torch.cuda.set_device(args.device)
    elif args.threads:
        torch.set_num_threads(args.threads)  # the launch's rank runs as many: bitwise equality needs it
    if args.worker:
        worker(args)
        return 0
    t0 = time.perf_counter()
    numerics_cfg = NUMERICS_TINY if args.tiny else NUMERICS
    perf_cfg = PERF_TINY if args.tiny else gpt2_small(args.seq, args.batch)
    launched = [s for s in args.only if s in ("torchrun", "perf")]
    # --tiny is a smoke test: the launch runs beside this process's numerics. A measurement gives its timed steps
    # the device alone, after the numerics.
    launch = Launch(args) if launched and args.tiny else None
    rows: list[Row] = []
    with deterministic(True) as caught:
        if "numerics" in args.only:
            rows += numerics_rows(args, numerics_cfg)
        sim = simulated_one(args, numerics_cfg) if "torchrun" in args.only else {}
    det = determinism_warnings(caught)
    t_numerics = time.perf_counter() - t0
    if launched and launch is None:
        gc.collect()
        if args.device.type == "cuda":
            torch.cuda.empty_cache()  # this process's cached blocks back to the device before the launch
        launch = Launch(args)
    saved, why = launch.results() if launch is not None else ({}, "")
    det = sorted({*det, *saved.get("determinism", [])})
    if "torchrun" in args.only:
        rows += torchrun_rows(args, sim, saved, why)
    if "perf" in args.only:
        rows += perf_rows(saved, why)
    with torch.device("meta"):
        n_perf = sum(p.numel() for p in build_model(perf_cfg).parameters())
    print(table(rows, args.device.type == "cuda"))
    print()
    for line in footnotes(args, numerics_cfg, perf_cfg, n_perf, det):
        print(f"- {line}")
    failed = [r.name for r in rows if r.verdict != "PASS"]
    print(f"- {len(rows) - len(failed)}/{len(rows)} rows PASS in {time.perf_counter() - t0:.1f} s (this process's "
          f"numerics {t_numerics:.1f} s)" + (f"; not passing: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
