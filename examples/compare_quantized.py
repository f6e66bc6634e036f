"""The main job (``train_gpt.py``) on a simulated 2x2 mesh twice: with full-precision collectives, and with ZeRO++'s
quantized ones (qwZ: int8 parameter all-gathers; qgZ: int4 gradient reduce-scatters). Prints the final losses (mean of
the last 10 steps) and their relative difference, and plots both loss curves on one figure.

    python examples/compare_quantized.py                 # 400 steps each, about 5 minutes on 2 CPU cores
    python examples/compare_quantized.py --steps 100 --qgz 8 --out runs

Any other argument is handed to both runs (e.g. ``--stage 3``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_gpt  # noqa: E402


def final_loss(losses: list[float], k: int = 10) -> float:
    tail = losses[-k:]
    return sum(tail) / len(tail)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--qgz", type=int, choices=[4, 8], default=4, help="gradient bits")
    p.add_argument("--out", default="runs", help="directory for the plot")
    args, rest = p.parse_known_args(argv)
    common = ["--mesh", "2,2", "--steps", str(args.steps), "--sample-chars", "0", "--out", args.out, *rest]
    runs = {"full precision": train_gpt.main(common),
            f"qwZ int8 + qgZ int{args.qgz}": train_gpt.main([*common, "--qwz", "--qgz", str(args.qgz)])}
    (base_name, base), (quant_name, quant) = runs.items()
    a, b = final_loss(base["losses"]), final_loss(quant["losses"])
    result = {"base": a, "quantized": b, "relative": (b - a) / a, "plot": None}
    print(f"\nfinal loss (mean of the last 10 of {args.steps} steps): {base_name} {a:.4f}, {quant_name} {b:.4f} "
          f"({100 * result['relative']:+.2f} %)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return result
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, run in runs.items():
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"], lw=1, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"char-level GPT, simulated 2x2 mesh: full precision vs quantized ({100 * result['relative']:+.2f} %)")
    ax.legend()
    path = Path(args.out) / "compare_quantized.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    result["plot"] = str(path)
    print(f"plot: {path}")
    return result


if __name__ == "__main__":
    main()
