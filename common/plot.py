"""Learning curves of one or more runs, to a PNG (needs matplotlib: `pip install matplotlib`).

    python -m common.plot runs/grpo-a runs/grpo-b --out curves.png
    python -m common.plot runs/* --metrics eval/greedy_acc reward/mean response/len_mean
"""
import argparse
import json
import sys
from pathlib import Path

DEFAULT = ["eval/greedy_acc", "reward/mean", "response/len_mean", "policy/entropy"]


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise SystemExit(f"error: {path}: not found (expected a run folder holding metrics.jsonl)")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise SystemExit(f"error: {path}:{i}: not a JSON object") from None
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description="Plot learning curves of runs to a PNG")
    p.add_argument("runs", nargs="+", type=Path, help="run folders (runs/<name>) or metrics.jsonl files")
    p.add_argument("--metrics", nargs="+", default=DEFAULT, help="metric names, one panel each")
    p.add_argument("--out", default="curves.png", help="the PNG to write")
    args = p.parse_args(argv)
    try:  # matplotlib is optional: only this script needs it
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: plotting needs matplotlib: pip install matplotlib")
    fig, axes = plt.subplots(1, len(args.metrics), figsize=(4.2 * len(args.metrics), 3.4), squeeze=False)
    for run in args.runs:
        rows = read_metrics(run)
        for ax, name in zip(axes[0], args.metrics):
            pts = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o" if name.startswith("eval/") else None, label=run.name)
    for ax, name in zip(axes[0], args.metrics):
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
