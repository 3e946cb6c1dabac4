"""The default run as a benchmark: accuracy before -> after, wall time, where a step's time goes, peak memory,
and the work done (training FLOPs, sampled tokens), for one or several seeds.

    python bench/grpo.py                          # `python grpo.py` (the defaults), seed 0, and its table
    python bench/grpo.py --seeds 0 1 2            # one run per seed, one after the other
    python bench/grpo.py --run runs/NAME          # only summarise a run that already exists
    python bench/grpo.py --seeds 0 -- --dtype float32 --steps 20   # options after -- go to grpo.py

The CPU's flags are printed with the table: a bf16 matmul runs ~900 GFLOP/s on 2 cores with AMX-BF16 and
~1 GFLOP/s with AVX2 only, so `--dtype auto` trains in bf16 on the first and fp32 on the second. Training FLOPs
are counted as 6 x parameters x tokens through the training forward (each distinct prompt once, as the trainer
packs a group after one copy of its prompt; attention's own FLOPs are left out, a few % at these lengths), and
sampling as 2 x parameters per generated token, so the time on another machine can be predicted from its
matmul rate (--predict-gflops).
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = sorted({f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f" {f}" in text})
    return " ".join(flags) or "none of amx_bf16/avx512_bf16/avx512f/avx2"


def n_params(run: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in (run / "checkpoint").glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(_prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def _prod(shape):
    out = 1
    for d in shape:
        out *= d
    return out


def summarise(run: Path, wall: float | None = None, rss_gb: float | None = None, predict_gflops: float = 111.0):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/greedy_acc" in r]
    steps = [r for r in rows if "perf/step_s" in r]
    mean = lambda k: sum(r[k] for r in steps) / len(steps)  # noqa: E731
    total = lambda k: sum(r.get(k, 0) for r in steps)  # noqa: E731
    params = n_params(run)
    train_flops = 6 * params * total("perf/train_fwd_tokens")
    sample_flops = 2 * params * total("perf/sampled_tokens")
    out = {"run": str(run), "acc_before": evals[0]["eval/greedy_acc"], "acc_after": evals[-1]["eval/greedy_acc"],
           "steps": len(steps), "wall_s": wall, "peak_rss_gb": rss_gb or max(r.get("perf/peak_rss_gb", 0) for r in steps)}
    print(f"\nrun {run}  (CPU flags: {cpu_flags()})")
    print("| what | value |\n|---|---|")
    print(f"| greedy accuracy, step {evals[0]['step']} -> step {evals[-1]['step']} | "
          f"{out['acc_before']:.3f} -> {out['acc_after']:.3f} ({100 * (out['acc_after'] - out['acc_before']):+.1f} points) |")
    print(f"| steps | {len(steps)} |")
    if wall is not None:
        print(f"| wall time (model load and evaluations included) | {wall:.0f} s |")
    print(f"| step time (mean) | {mean('perf/step_s'):.1f} s |")
    for part in ("sample", "score", "train"):
        share = mean(f"perf/{part}_s") / mean("perf/step_s")
        print(f"| {part} (mean per step) | {mean(f'perf/{part}_s'):.1f} s ({share:.0%}) |")
    print(f"| peak RSS | {out['peak_rss_gb']:.2f} GB |")
    by_step = ", ".join(f"{steps[i].get('perf/peak_rss_gb', 0):.2f}" for i in (0, len(steps) // 2, -1))
    print(f"| peak RSS so far at the first, middle and last step | {by_step} GB |")
    print(f"| sampled tokens (all steps) | {total('perf/sampled_tokens'):.0f} ({sample_flops / 1e12:.2f} TFLOP at 2 x {params / 1e6:.0f}M per token) |")
    print(f"| tokens through the training forward | {total('perf/train_fwd_tokens'):.0f} ({train_flops / 1e12:.2f} TFLOP at 6 x params) |")
    print(f"| training + sampling time predicted at {predict_gflops:.0f} GFLOP/s | "
          f"{(train_flops + sample_flops) / (predict_gflops * 1e9):.0f} s (matmul-bound lower bound) |")
    print(f"| reward, first -> last step | {steps[0]['reward/mean']:.3f} -> {steps[-1]['reward/mean']:.3f} |")
    return out


def run_once(seed: int, rest: list) -> tuple[Path, float, float]:
    """One `python grpo.py` in a child that reports its own child's peak RSS (so seeds do not mix)."""
    name = time.strftime(f"bench-grpo-s{seed}-%Y%m%d-%H%M%S")
    cmd = [sys.executable, str(REPO / "grpo.py"), "--run-name", name, "--seed", str(seed), *rest]
    # the child's output streams as usual; its peak RSS comes back on the probe's stderr, last line
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
             "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
             "sys.exit(r.returncode)")
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", probe, *cmd], stderr=subprocess.PIPE, text=True)
    wall = time.time() - t0
    lines = r.stderr.splitlines()
    print("\n".join(line for line in lines if not line.startswith("PEAK_RSS_KB")), file=sys.stderr)
    if r.returncode:
        sys.exit(f"bench/grpo.py: {' '.join(cmd)} failed with exit code {r.returncode}")
    kb = [float(line.split()[1]) for line in lines if line.startswith("PEAK_RSS_KB")]
    return Path("runs") / name, wall, (kb[-1] / 2 ** 20 if kb else None)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, help="summarise this run folder instead of starting one")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run of grpo.py per seed")
    p.add_argument("--predict-gflops", type=float, default=111.0,
                   help="matmul rate for the time prediction (111: fp32 on 2 cores of an AVX2-only AMD EPYC)")
    args, rest = p.parse_known_args()
    rest = [a for a in rest if a != "--"]
    if args.run:
        return summarise(args.run, predict_gflops=args.predict_gflops)
    results = [summarise(*run_once(seed, rest), predict_gflops=args.predict_gflops) for seed in args.seeds]
    if len(results) > 1:
        print(f"\n| seed | before -> after | gain | wall | peak RSS |\n|---|---|---|---|---|")
        for seed, r in zip(args.seeds, results):
            print(f"| {seed} | {r['acc_before']:.3f} -> {r['acc_after']:.3f} | {100 * (r['acc_after'] - r['acc_before']):+.1f} | "
                  f"{r['wall_s']:.0f} s | {r['peak_rss_gb']:.2f} GB |")


if __name__ == "__main__":
    main()
