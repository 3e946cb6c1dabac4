"""The default run as a benchmark: accuracy before -> after, and where a step's time goes.

    python bench/grpo.py                      # runs `python grpo.py` (the defaults) and prints the table
    python bench/grpo.py --run runs/NAME      # only summarise a run that already exists
    python bench/grpo.py -- --model DIR --task gsm8k ...   # pass options through to grpo.py

Prints: held-out greedy accuracy at step 0 and at the end, steps, wall time, and the mean per-step split
into sampling, scoring and training with their token rates.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def summarise(run: Path, wall: float | None = None):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/greedy_acc" in r]
    steps = [r for r in rows if "perf/step_s" in r]
    mean = lambda k: sum(r[k] for r in steps) / len(steps)  # noqa: E731
    print(f"\nrun {run}")
    print("| what | value |\n|---|---|")
    print(f"| greedy accuracy, step {evals[0]['step']} -> step {evals[-1]['step']} | "
          f"{evals[0]['eval/greedy_acc']:.3f} -> {evals[-1]['eval/greedy_acc']:.3f} |")
    print(f"| steps | {len(steps)} |")
    if wall is not None:
        print(f"| wall time (evaluation included) | {wall:.0f} s |")
    print(f"| step time (mean) | {mean('perf/step_s'):.1f} s |")
    for part in ("sample", "score", "train"):
        share = mean(f"perf/{part}_s") / mean("perf/step_s")
        print(f"| {part} (mean per step) | {mean(f'perf/{part}_s'):.1f} s ({share:.0%}) |")
    print(f"| sampling tokens/s | {mean('perf/sample_tok_s'):.0f} |")
    print(f"| training tokens/s | {mean('perf/train_tok_s'):.0f} |")
    print(f"| reward, first -> last step | {steps[0]['reward/mean']:.3f} -> {steps[-1]['reward/mean']:.3f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, help="summarise this run folder instead of starting one")
    args, rest = p.parse_known_args()
    if args.run:
        return summarise(args.run)
    name = time.strftime("bench-grpo-%Y%m%d-%H%M%S")
    t0 = time.time()
    cmd = [sys.executable, str(REPO / "grpo.py"), "--run-name", name, *[a for a in rest if a != "--"]]
    subprocess.run(cmd, check=True)
    summarise(Path("runs") / name, time.time() - t0)


if __name__ == "__main__":
    main()
