"""Worker run by torchrun for tests/test_param_groups_gloo.py: four gloo ranks, the experts of
:mod:`param_group_cases` over their rank groups ``{0, 2}`` and ``{1, 3}``.

Usage: param_group_worker.py OUT_DIR CASE [CASE ...] (see dist_harness.worker_main).
"""

from __future__ import annotations

import sys

import param_group_cases as pc
from fzero.comm import CountingCommunicator
from fzero.dist import TorchCommunicator
from helpers import CHEAP_COMPILE

# case name -> (stage, clip, accum, optimizer, starve, compiled: the masked model, one graph)
CASES = {"sgd1": (1, 0.05, 2, "sgd", False, False), "sgd2": (2, 0.05, 2, "sgd", False, False),
         "sgd3": (3, 0.05, 2, "sgd", False, False), "adamw2": (2, None, 1, "adamw", False, False),
         "starve2": (2, None, 1, "adamw", True, False), "starve3": (3, None, 1, "adamw", True, False),
         "compiled2": (2, 0.05, 1, "sgd", False, True)}


def run_case(name: str, _flat) -> dict:
    if name in CASES:
        stage, clip, accum, opt, starve, compiled = CASES[name]
        counter = CountingCommunicator(TorchCommunicator(groups=pc.GROUPS))
        got = pc.run_fzero(counter.inner, stage, clip, accum, starve=starve, opt=opt, counter=counter,
                           masked=compiled, compile=CHEAP_COMPILE if compiled else False)
        return {"params": got["params"][0], "losses": got["losses"], "norms": got["norms"],
                "missed": got["state"].opt.missed[0], "repr": repr(counter.inner.param_group("experts")),
                "records": [(r.op, r.axis, r.elements, r.bytes) for r in counter.records]}
    if name == "wrong":  # named errors before any collective: a hang would time the test out
        messages = []
        for groups in [{"experts": (3, 2)}, {"experts": [[0, 1], [1, 2]]}, {"": (2, 2)}]:
            try:
                TorchCommunicator(groups=groups)
                messages.append(None)
            except ValueError as e:
                messages.append(str(e))
        return {"messages": messages}
    raise ValueError(f"unknown case {name}")


if __name__ == "__main__":
    from dist_harness import worker_main

    worker_main(run_case, sys.argv[1:])
