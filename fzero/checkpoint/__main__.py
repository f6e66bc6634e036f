"""The command line: a checkpoint without the training job, no process group.

    python -m fzero.checkpoint info PATH [--follow-symlinks]
    python -m fzero.checkpoint verify PATH [--follow-symlinks]
    python -m fzero.checkpoint consolidate PATH OUT.pt [--optim OPTIM.pt] [--follow-symlinks]
    python -m fzero.checkpoint export PATH OUT_DIR [--dtype bf16] [--max-shard-size 5GB] [--config FILE]
                                      [--adapter NAME | --whole-model] [--follow-symlinks]

PATH: a checkpoint root (its ``LATEST`` is used) or one checkpoint directory; its files
are read only inside it unless --follow-symlinks. Exit
status 0 on success, 1 when the checkpoint is incomplete, corrupt or not fzero's, or an
output cannot be written (one line on stderr naming the file), 2 on usage errors.
Nothing in the checkpoint is run: its metadata is read with an allow-list of types.
"""

from __future__ import annotations

import argparse
import sys
import time

from .offline import checkpoint_info, consolidate_checkpoint, verify_checkpoint
from .pretrained import EXPORT_DTYPES, export_pretrained


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _info(path: str, follow_symlinks: bool) -> None:
    info = checkpoint_info(path, follow_symlinks=follow_symlinks)
    print(f"checkpoint  {info['directory']}")
    print(f"saved at    world size {info['world_size']}, stage {info['stage']}, step {info['step']}")
    print(f"parameters  {info['num_params']} tensors, {info['num_elements']:,} elements "
          f"({info['trainable_elements']:,} trainable)")
    print(f"optimizer   {info['optimizer']}, " + "; ".join(
        f"group {k}: " + ", ".join(f"{n} {v:g}" for n, v in h.items()) for k, h in enumerate(info["hyperparameters"])))
    prec = info["precision"]
    print(f"precision   compute {prec['param_dtype'] or 'parameter dtype'}, "
          f"reduce {prec['reduce_dtype'] or 'master dtype'}")
    print("stored      " + ", ".join(f"{k} {_mib(v)}" for k, v in info["bytes_by_kind"].items()))
    print(f"files       {len(info['files'])}, {_mib(sum(info['files'].values()))}; "
          f"checksums {'yes' if info['checksums'] else 'no (saved before fzero wrote them)'}")
    if info["extra"]:
        print(f"extra       {', '.join(info['extra'])}")
    width = max(len(p["path"]) for p in info["params"]) if info["params"] else 0
    for p in info["params"]:
        group = "frozen" if p["group"] < 0 else f"group {p['group']}"
        print(f"  {p['path']:<{width}}  {str(list(p['shape'])):<16} {p['dtype']:<15} {group}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fzero.checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="world size, stage, step, parameters, sizes")
    verify = sub.add_parser("verify", help="check every checksum")
    c = sub.add_parser("consolidate", help="write a plain model state dict (torch.save)")
    e = sub.add_parser("export", help="write a save_pretrained directory (safetensors), or a peft adapter's")
    for p in (info, verify, c, e):
        p.add_argument("path")
        p.add_argument("--follow-symlinks", action="store_true",
                       help="follow symlinks out of the checkpoint root (default: refused)")
    c.add_argument("out", help="the model state dict file (e.g. model.pt)")
    c.add_argument("--optim", metavar="OPTIM.pt", help="also write the torch.optim state dict there")
    e.add_argument("out", help="the directory to create (absent or empty)")
    e.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), help="cast floating tensors to it (default: as saved)")
    e.add_argument("--max-shard-size", default="5GB", help="bytes per file, e.g. 5GB or 500MB (default 5GB)")
    e.add_argument("--config", metavar="FILE", help="config.json (adapter_config.json for an adapter) to copy in")
    which = e.add_mutually_exclusive_group()
    which.add_argument("--adapter", metavar="NAME", help="export this peft adapter (default: the one there is)")
    which.add_argument("--whole-model", action="store_true", help="export the whole model of a peft state")
    args = parser.parse_args(argv)
    follow = args.follow_symlinks
    try:
        if args.command == "info":
            _info(args.path, follow)
        elif args.command == "verify":
            t0 = time.perf_counter()
            n = verify_checkpoint(args.path, follow_symlinks=follow)
            print(f"ok: every checksum of {args.path} matches ({_mib(n)} checked in {time.perf_counter() - t0:.2f} s)")
        elif args.command == "export":
            adapter = False if args.whole_model else args.adapter
            out = export_pretrained(args.path, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                                    config=args.config, adapter=adapter, follow_symlinks=follow)
            print(f"wrote {out}: " + ", ".join(sorted(f.name for f in out.iterdir())))
        else:
            out = consolidate_checkpoint(args.path, args.out, optim=args.optim, follow_symlinks=follow)
            print(f"wrote {out}" + (f" and {args.optim}" if args.optim else ""))
    # CheckpointError is a ValueError; others: an export's option (a config that is not JSON, a size, an adapter the
    # state lacks); OSError: stdout or stderr closed
    except (ValueError, OSError) as e:
        print(f"error: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
