"""What each run's own mechanism did, one line per run, from its metrics.jsonl: the evidence that a variant's
mechanism acted in a default run (docs/benchmarks.md, the README's last column).

    python bench/mechanisms.py runs/bench-*                                  # runs of bench/default_run.py
    python bench/mechanisms.py bench/results/cpu-2026-11-27-all/bench-*
    python bench/mechanisms.py bench/results/compare-h100-2026-11-27/cmp-*    # runs of bench/compare.py

Counts summed over a run's steps (a prompt seeded at two steps counts twice); grpo.py's runs have no line.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.config import fail  # noqa: E402  (a user mistake: one line, exit 2)
from common.plot import read_metrics  # noqa: E402  (one line and exit 2 for an unreadable metrics.jsonl)

ALGOS = ("grpo", "exgrpo", "xrpo", "extra", "eapo")


def mechanism(algo: str, steps: list) -> str | None:
    """steps: the run's per-step metrics rows, in order."""
    col = lambda k: [s.get(k) or 0 for s in steps]  # noqa: E731 (None: not logged at that step)
    first = lambda k: next((s["step"] for s in steps if s.get(k)), "-")  # noqa: E731
    if algo == "exgrpo":
        return (f"replay from step {first('exgrpo/replay_share')}, up to {max(col('exgrpo/replay_share')):.0%} of the "
                f"batch; {steps[-1]['exgrpo/retired']:.0f} questions retired")
    if algo == "xrpo":
        return (f"{min(col('xrpo/rollouts_min')):.0f}-{max(col('xrpo/rollouts_max')):.0f} rollouts a prompt; "
                f"{sum(col('xrpo/seeded_prompts')):.0f} prompts seeded with exemplars "
                f"({sum(col('xrpo/icl_rollouts')):.0f} rollouts); novelty bonus on {sum(col('xrpo/bonus_given')):.0f} "
                f"correct rollouts")
    if algo == "extra":
        return (f"novelty bonus at {sum(1 for v in col('extra/bonus_share') if v)} of {len(steps)} steps (up to "
                f"{max(col('extra/bonus_share')):.0%} of the correct answers); {sum(col('extra/prefixes_stored')):.0f} "
                f"prefixes stored, {sum(col('extra/guided_rows')):.0f} guided prompts (a prompt and a stored prefix)")
    if algo == "eapo":
        off = next((s["step"] for s in steps if not s["eapo/lambda"]), "-")
        return (f"π_RL decided {steps[0]['eapo/injected_ratio']:.1%} of the augmented tokens at step 1; λ "
                f"{steps[0]['eapo/lambda']:.2f} at step 1, 0 from step {off}")
    return None


def main():
    if sys.argv[1:2] in (["-h"], ["--help"]):  # the docstring is its help
        print(__doc__.strip())
        return
    runs = [Path(a) for a in sys.argv[1:] if (Path(a) / "metrics.jsonl").is_file()]
    if not runs:
        fail("bench/mechanisms.py: expected run folders holding metrics.jsonl (e.g. runs/bench-*)")
    for run in runs:
        rows = read_metrics(run)
        steps = [r for r in rows if "perf/step_s" in r]
        # bench-<algo>-s<seed>-... (bench/default_run.py) or <prefix>-<algo>-s<seed> (bench/compare.py)
        algo = next((part for part in run.name.split("-") if part in ALGOS), None)
        line = mechanism(algo, steps) if algo else None
        if line:
            print(f"{run.name}: {line}")


if __name__ == "__main__":
    main()
