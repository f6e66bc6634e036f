"""torchrun worker for the meta-device cases on gloo: USAGE meta_init_worker.py OUT_DIR CASE...

Cases (``meta_cases``): ``meta_chain``, ``meta_gpt2`` (stage 3 from a meta model, a few
steps), ``pretrained_llama`` (rank 0 saves with ``save_pretrained``; each rank reads
only its slices of the safetensors file),
``different_seeds`` (the random init refuses ranks whose generators differ),
``one_rank_fails`` (a file missing on one rank: every rank raises).
"""

from __future__ import annotations

import sys
import tempfile

import torch.distributed as dist

import meta_cases as mc
from dist_harness import worker_main


def run_case(name: str, comm):  # noqa: ANN001, ANN201 - a TorchCommunicator; per-case results
    if name == "different_seeds":
        return {"error": mc.different_seeds(comm)}
    if name == "one_rank_fails":
        return {"error": mc.one_rank_fails(comm, tempfile.mkdtemp())}
    kind, model = name.split("_")
    if kind == "meta":
        return mc.meta_run(model, comm)
    # save_pretrained writes on rank 0 only (transformers' rule under torch.distributed)
    box = [mc.saved_checkpoint(model, "safetensors", tempfile.mkdtemp()) if comm.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return mc.pretrained_run(model, comm, box[0])


if __name__ == "__main__":
    worker_main(run_case, sys.argv[1:])
