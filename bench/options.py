"""grpo.py's GRPO-family options, each in a short run, and the metric that shows it acting: one table.

    python bench/options.py                          # every option, 3 steps each, 20 held-out problems
    python bench/options.py --only cispo refill      # some of them
    python bench/options.py --steps 5 -- --seed 1    # options after -- go to every run

Each row is `python grpo.py --steps N --eval-size E --run-name opt-<name>-<time> <its flags>`, one after the
other, and reads the row's metric from runs/<name>/metrics.jsonl: its mean over the steps and its step-by-step
values. The sampler-mismatch options (--tis-mode ... mask, --offpolicy-mask) only have something to act on when the
sampler is a bf16 copy of the fp32 trainer, so those rows run with --dtype bfloat16 (slow without bf16 units),
with thresholds far tighter than the papers' (IcePop masks outside [0.5, 5]; at 135M parameters the bf16/fp32 gap
is a few hundredths of a nat per token, and those bounds mask nothing); the others keep grpo.py's --dtype auto. A run's accuracy after 3 steps says nothing about an option's worth: this
checks that each option acts, not which is better.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from common.config import OneLineParser  # noqa: E402  (a user mistake: one line, exit 2)
from bench.default_run import cpu_flags  # noqa: E402

# name -> (flags, the metric that shows the option acting, what the metric counts)
OPTIONS = {
    "baseline": ([], "reward/zero_var_groups", "share of groups with equal rewards"),
    "refill": (["--dynamic-sampling", "--refill-rounds", "2"], "reward/groups_refilled",
               "groups added by refill rounds (of those dropped)"),
    "overlong-mask": (["--overlong-mask"], "response/overlong_masked", "completions cut at the budget, no loss"),
    "overlong-buffer": (["--overlong-buffer", "16"], "reward/mean", "mean reward, lowered by the penalty"),
    # CISPO's weight differs from PPO's clip only off π_old (r != 1): later mini-batches of a step are
    "cispo": (["--loss-type", "cispo", "--mini-batches", "4", "--eps-high", "0.02"], "policy/clipfrac_high",
              "trained tokens whose weight was clipped at 1 + eps_high (each keeps its gradient)"),
    "tis-token-mask": (["--dtype", "bfloat16", "--tis-cap", "1.02", "--tis-mode", "token-mask", "--tis-floor", "0.98"],
                       "policy/masked_tokens", "share of trained tokens masked"),
    "tis-sequence-mask": (["--dtype", "bfloat16", "--tis-cap", "1.1", "--tis-mode", "sequence-mask"],
                          "policy/masked_tokens", "share of trained tokens masked"),
    "offpolicy-mask": (["--dtype", "bfloat16", "--offpolicy-mask", "0.002"], "policy/masked_tokens",
                       "share of trained tokens masked"),
    "top-entropy": (["--top-entropy", "0.2"], "policy/masked_tokens", "share of trained tokens masked"),
}


def run(name: str, flags: list, steps: int, eval_size: int, rest: list) -> dict:
    run_name = f"opt-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = [sys.executable, str(REPO / "grpo.py"), "--steps", str(steps), "--eval-size", str(eval_size),
           "--run-name", run_name, *flags, *rest]
    t0 = time.time()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: `{' '.join(cmd)}` failed: {done.stderr.strip().splitlines()[-1:]}")
    rows = [json.loads(line) for line in (REPO / "runs" / run_name / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "wall": time.time() - t0, "cmd": " ".join(cmd[1:])}


def main():
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=list(OPTIONS), help="these options only")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--eval-size", type=int, default=20)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="after --: options for every grpo.py run")
    args = parser.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    print(f"CPU flags: {cpu_flags()}; {args.steps} steps per run, {args.eval_size} held-out problems", flush=True)
    print("| option | flags | metric | mean | per step | s/step |\n|---|---|---|---|---|---|", flush=True)
    for name in args.only or OPTIONS:
        flags, metric, _ = OPTIONS[name]
        out = run(name, flags, args.steps, args.eval_size, rest)
        steps = [r for r in out["rows"] if "reward/mean" in r]
        values = [r.get(metric, float("nan")) for r in steps]
        step_s = statistics.mean(r["perf/step_s"] for r in steps)
        shown = ", ".join(f"{v:.3g}" for v in values)
        print(f"| {name} | `{' '.join(flags) or '(defaults)'}` | `{metric}` | {statistics.mean(values):.3g} | "
              f"{shown} | {step_s:.1f} |", flush=True)
    described = {metric: what for _, metric, what in (OPTIONS[n] for n in args.only or OPTIONS)}
    print("\n" + "\n".join(f"{metric}: {what}" for metric, what in described.items()))


if __name__ == "__main__":
    main()
