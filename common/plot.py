"""Learning curves of one or more runs, to a PNG (needs matplotlib: `pip install matplotlib`).

    python -m common.plot runs/grpo-a runs/grpo-b --out curves.png
    python -m common.plot runs/* --metrics eval/greedy_acc reward/mean response/len_mean
"""
import json
from pathlib import Path

from common.config import OneLineParser, fail

DEFAULT = ["eval/greedy_acc", "reward/mean", "response/len_mean", "policy/entropy"]


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        fail(f"{path}: not found (expected a run folder holding metrics.jsonl)")
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError:
        fail(f"{path}: not text (expected a run folder or its metrics.jsonl)")
    rows = []
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            fail(f"{path}:{i}: expected a JSON object with a step, one per line")
        rows.append(row)
    return rows


def main(argv=None):
    p = OneLineParser(description="Plot learning curves of runs to a PNG")
    p.add_argument("runs", nargs="+", type=Path, help="run folders (runs/<name>) or metrics.jsonl files")
    p.add_argument("--metrics", nargs="+", default=DEFAULT, help="metric names, one panel each")
    p.add_argument("--out", default="curves.png", help="the PNG to write")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.suffix.lower() != ".png" or not out.parent.is_dir():
        fail(f"--out: expected a .png file in an existing folder, got {args.out}")
    runs = {run: read_metrics(run) for run in args.runs}  # every file read (and refused) before anything is drawn
    logged = {k for rows in runs.values() for r in rows for k in r}
    unknown = [name for name in args.metrics if name not in logged]
    if unknown and args.metrics != DEFAULT:  # the default panels stay empty where a run lacks one
        fail(f"--metrics: {unknown[0]} is not logged by these runs (they log e.g. {', '.join(sorted(logged - {'step'})[:6])})")
    try:  # matplotlib is optional: only this script needs it
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fail("plotting needs matplotlib: pip install matplotlib")
    fig, axes = plt.subplots(1, len(args.metrics), figsize=(4.2 * len(args.metrics), 3.4), squeeze=False)
    for run, rows in runs.items():
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
