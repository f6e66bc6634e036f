"""Step time of fzero on models users bring, against a plain torch loop, on one rank.

    python benchmarks/bench_models.py [--rounds 8] [--steps 10] [--threads 1]

Models: HF ``transformers`` GPT-2 (tied embeddings; built from a config, no
download) and the benchmark TinyGPT (``benchmarks/models.py``). Systems, each
on a world of one rank (W=1, ``SimulatedWorld(1)``), fp32, AdamW:

* ``torch loop``: ``model(x)``, ``loss.backward()``, ``torch.optim.AdamW(fused=True)``,
  ``zero_grad``: the reference;
* ``fzero eager``: a stage-2 state (``init_train_state``'s default) and
  ``make_train_step(module_loss(model, criterion))``;
* ``fzero eager donate``: the same with ``donate=True`` (in-place update);
* ``fzero compiled``: ``compile=True`` (``fullgraph``), donating.

Each system is built and warmed up (compiled) first; then ``--rounds`` rounds
run every system for ``--steps`` steps in turn (interleaved, so a load change
hits every system alike), and the table gives the median seconds per step and
the ratio to the torch loop. The losses of the last round are printed to show
that every system trains the same model on the same data.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fzero  # noqa: E402
import models  # noqa: E402


def hf_gpt2(vocab: int, seq: int) -> torch.nn.Module:
    import logging

    from transformers import GPT2Config, GPT2LMHeadModel

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=128, n_layer=4, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    m = GPT2LMHeadModel(cfg).train()
    m.config.use_cache = False
    return m


def tiny_gpt(vocab: int, seq: int) -> torch.nn.Module:
    cfg = models.GPTConfig(vocab=vocab, seq_len=seq)
    return models.build_model(cfg)


def logits_of(out):
    return out if isinstance(out, torch.Tensor) else out.logits


def torch_loop(model: torch.nn.Module, criterion):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)

    def step(batch):
        x, y = batch
        loss = criterion(logits_of(model(x)), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def fzero_system(model: torch.nn.Module, criterion, **kw):
    comm = fzero.SimulatedWorld(1)
    holder = {"state": fzero.init_train_state(model, fzero.adamw(lr=1e-3, weight_decay=0.1), comm)}
    step = fzero.make_train_step(fzero.module_loss(model, criterion), comm, **kw)

    def run(batch):
        holder["state"], m = step(holder["state"], comm.split_batch(batch))
        return m["loss"]

    return run


SYSTEMS = {
    "torch loop (fused AdamW)": lambda m, c: torch_loop(m, c),
    "fzero eager": lambda m, c: fzero_system(m, c),
    "fzero eager donate": lambda m, c: fzero_system(m, c, donate=True),
    "fzero compiled donate": lambda m, c: fzero_system(m, c, donate=True, compile=True),
}


def bench(name: str, model: torch.nn.Module, vocab: int, seq: int, batch: int, rounds: int, steps: int) -> None:
    criterion = models.make_criterion(vocab)
    cfg = models.GPTConfig(vocab=vocab, seq_len=seq, global_batch=batch)
    data = [models.random_batch(cfg, seed=i) for i in range(steps)]
    systems = {}
    for sname, make in SYSTEMS.items():
        run = make(model, criterion)
        for b in data[:3]:
            run(b)  # warm-up (compiles)
        systems[sname] = run
    times = {s: [] for s in systems}
    last = {}
    for _ in range(rounds):
        for sname, run in systems.items():
            t0 = time.perf_counter()
            for b in data:
                loss = run(b)
            float(loss)
            times[sname].append((time.perf_counter() - t0) / steps)
            last[sname] = float(loss)
    params = sum(p.numel() for p in model.parameters())
    print(f"\n{name}: {params / 1e6:.2f} M parameters, batch {batch} x {seq} tokens, W=1, fp32, AdamW, "
          f"{torch.get_num_threads()} thread(s), {rounds} rounds x {steps} steps")
    ref = statistics.median(times["torch loop (fused AdamW)"])
    print("| system | ms/step (median) | x torch loop | last loss |\n|---|---|---|---|")
    for sname, ts in times.items():
        med = statistics.median(ts)
        print(f"| {sname} | {med * 1e3:.1f} | {med / ref:.2f} | {last[sname]:.4f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--models", default="hf_gpt2,tiny_gpt")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.models.split(","):
        model = {"hf_gpt2": hf_gpt2, "tiny_gpt": tiny_gpt}[name](args.vocab, args.seq)
        bench(name, model, args.vocab, args.seq, args.batch, args.rounds, args.steps)


if __name__ == "__main__":
    main()
