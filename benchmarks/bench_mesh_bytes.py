"""Bytes per rank and step on each mesh axis, counted by ``CountingCommunicator`` on the simulated world, beside the
formulas they must equal (Psi: the padded flat parameters, b: bytes per element, S: ranks per shard group, R:
replicas; block B = 256 values per float32 scale).

    python benchmarks/bench_mesh_bytes.py                 # TinyGPT 7M (about a minute)
    python benchmarks/bench_mesh_bytes.py --size 58M

Rows: HSDP ZeRO-2's replica axis, 2 Psi b (R-1)/(R S), at K=1 and K=4 micro-batches; qwZ's parameter all-gathers
and qgZ's gradient reduce-scatters (int4 and int8) against bf16 collectives of the same step; stage 3's backward
regathers across and within nodes, flat and with hpZ. What is counted is
what one rank sends (ring: (W-1)/W of a gather's output, of a reduce-scatter's input; 2 (W-1)/W of an all-reduce).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fzero  # noqa: E402
from fzero.comm import CountingCommunicator, SimulatedWorld  # noqa: E402
from fzero.quantized import QuantizedCommunicator, payload_bytes  # noqa: E402
from models import build, make_criterion, random_batch  # noqa: E402


def one_step(cfg, comm, counter, *, param_dtype=None, reduce_dtype=None, accum=1, stage=2):
    """Count one step (after a first, uncounted one); returns the layout."""
    model = build("tiny", cfg)
    precision = fzero.MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    units = (type(model.blocks[0]),) if stage == 3 else None
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-4), comm, stage=stage, precision=precision, units=units)
    step = fzero.make_train_step(fzero.module_loss(model, make_criterion(cfg.vocab)), comm, accum_steps=accum)
    batches = [random_batch(cfg, seed=i) for i in range(2)]
    batches = [tuple(torch.cat([t] * accum) for t in b) for b in batches]
    state, _ = step(state, comm.split_batch(batches[0], micro_batches=accum))
    counter.reset()
    step(state, comm.split_batch(batches[1], micro_batches=accum))
    return state.shard.layout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="7M", choices=["7M", "58M"])
    args = p.parse_args()
    from bench_memory import SIZES

    torch.set_num_threads(1)
    cfg = SIZES[args.size]
    r, s = 2, 2
    rows = []
    for accum in (1, 4):
        counter = CountingCommunicator(SimulatedWorld(r * s, mesh=(r, s)))
        layout = one_step(cfg, counter, counter, accum=accum)
        psi = sum(g.padded_numel for g in layout.groups)
        sizes = {g.shard_numel for g in layout.groups}
        got = sum(x.bytes for x in counter.records if x.axis == "replica" and x.elements in sizes)
        rows.append((f"HSDP 2x2 ZeRO-2 replica axis, fp32 gradients, K={accum}", got, 2 * psi * 4 * (r - 1) / (r * s),
                     "2 Psi b (R-1)/(R S)"))
    w = 4
    counted = {}
    for name, bits in (("bf16", None), ("int8", 8), ("int4", 4)):
        counter = CountingCommunicator(SimulatedWorld(w))
        comm = counter if bits is None else QuantizedCommunicator(counter, weights=8, grads=bits)
        layout = one_step(cfg, comm, counter, param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        gathers = sum(x.bytes for x in counter.records if x.op == "all_gather" and x.elements > 1024)
        grads = sum(x.bytes for x in counter.records if x.op in ("reduce_scatter", "all_to_all"))
        counted[name] = (gathers, grads)
    shards = [g.shard_numel for g in layout.groups]
    ring = (w - 1) / w
    bf16_g = sum(w * n * 2 for n in shards) * ring
    rows.append(("flat W=4 bf16 parameter all-gathers", counted["bf16"][0], bf16_g, "W n 2 (W-1)/W"))
    rows.append(("flat W=4 bf16 gradient reduce-scatters", counted["bf16"][1], bf16_g, "W n 2 (W-1)/W"))
    q8 = sum(w * payload_bytes(n, 8, 256) for n in shards) * ring
    q4 = sum(w * payload_bytes(n, 4, 256) for n in shards) * ring
    rows.append(("qwZ int8 parameter all-gathers", counted["int8"][0], q8, "W (n + 4 n/B) (W-1)/W"))
    rows.append(("qgZ int8 gradient all-to-all", counted["int8"][1], q8, "W (n + 4 n/B) (W-1)/W"))
    rows.append(("qgZ int4 gradient all-to-all", counted["int4"][1], q4, "W (n/2 + 4 n/B) (W-1)/W"))
    # stage 3: gathers crossing nodes (2 nodes of 2), flat against hpZ; a simulated rank's run gathers every rank's
    # rows, so the records over all runs are W times one rank's
    gathered = {}
    for hpz in (False, True):
        counter = CountingCommunicator(SimulatedWorld(w, mesh=(2, 2), hpz=True) if hpz else SimulatedWorld(w))
        one_step(cfg, counter, counter, param_dtype=torch.bfloat16, stage=3)
        gathered[hpz] = {ax: sum(x.bytes for x in counter.records if x.op == "all_gather" and x.axis == ax) / w
                         for ax in ("shard", "node")}
    # the node gathers are the backward regathers, each moving (S-1)/S of its buffer where the flat world's moved
    # (W-1)/W: what the flat world's backward moved across nodes, and what hpZ's world axis still carries beyond
    # the flat world's forward
    node = gathered[True]["node"]
    backward = node * ((w - 1) / w) / ((2 - 1) / 2)
    rows.append(("stage 3 all-gathers across nodes, flat W=4", gathered[False]["shard"], gathered[False]["shard"],
                 "forward + backward"))
    rows.append(("stage 3 all-gathers across nodes, hpZ 2x2", gathered[True]["shard"],
                 gathered[False]["shard"] - backward, "flat's - its backward"))
    rows.append(("stage 3 hpZ backward regathers across nodes", gathered[True]["shard"] - (gathered[False]["shard"]
                 - backward), 0, "0"))
    print(f"TinyGPT {args.size} ({layout.num_params:,} parameters), bytes per rank and step:\n")
    print(f"| {'what':50s} | counted | formula | formula's value | x bf16 |")
    print("| --- | --- | --- | --- | --- |")
    for what, got, want, formula in rows:
        quantized = what.startswith("q")
        ratio = f"{got / counted['bf16'][0 if 'gather' in what else 1]:.3f}" if quantized else ""
        mark = "" if math.isclose(got, want) else " (differs)"
        print(f"| {what:50s} | {got:,.0f}{mark} | {formula} | {want:,.0f} | {ratio} |")


if __name__ == "__main__":
    main()
