"""One rank of a 2-rank gloo job in which rank 1 stalls before step ``STALL_AT``.

``stall_worker.py MODE TIMEOUT OUT [compiled]``: ``MODE`` is ``sigstop`` (rank 1 stops itself,
as a swapped-out or debugger-held process would) or ``sleep`` (rank 1 sleeps, as a rank stuck
in its data loader would); ``compiled``: the step is compiled (its collectives are fzero's
operators inside the graph). Rank 0 trains with ``TorchCommunicator(timeout=TIMEOUT)`` and a process
group timeout far longer (so that the communicator's bound is what acts); when its step fails
it writes the error to ``OUT`` as JSON and exits with status 3. Launched by tests/test_stall.py,
which owns both processes and kills them (a stopped process never exits by itself).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import fzero
from fzero.dist import TorchCommunicator
from helpers import CHEAP_COMPILE, batches, mlp

STALL_AT = 3


def main(mode: str, timeout: float, out: str, compiled: bool = False) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    comm = TorchCommunicator(timeout=timeout)
    mse = torch.nn.functional.mse_loss
    state = fzero.init_train_state(mlp(), fzero.adamw(lr=1e-2), comm)
    # compiled: dynamo's graph with gloo's traced operators, each waiting within the timeout (helpers.CHEAP_COMPILE:
    # the operators are the same whatever kernels surround them)
    step = fzero.make_train_step(fzero.module_loss(mlp(), mse), comm, compile=CHEAP_COMPILE if compiled else False)
    for i, batch in enumerate(batches(STALL_AT + 2, 2, 4, torch.float32)):
        if comm.rank == 1 and i + 1 == STALL_AT:
            print("rank 1 stalls", flush=True)
            if mode == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(3600)
        started = time.monotonic()
        try:
            state, _ = step(state, comm.split_batch(batch))
        except fzero.CollectiveError as e:
            with open(out, "w") as f:
                json.dump({"error": str(e), "step": e.step, "collective": e.collective,
                           "waited": time.monotonic() - started}, f)
            os._exit(3)  # the process group is unusable: no clean shutdown is attempted
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4:] == ["compiled"])
