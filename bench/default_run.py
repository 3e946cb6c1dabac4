"""An algorithm file's default run as a benchmark: accuracy before -> after, wall time, where a step's time goes,
peak memory, and the work done (training FLOPs, sampled tokens), for one or several seeds; beside grpo.py's run of
the seed, each file's time per sampled and per trained token, and its steps' time at grpo.py's token counts; over
the seeds, each file's gain minus grpo.py's of the same seed and machine, mean ± s.e., with bench/compare.py's verdict.

    python bench/default_run.py                       # `python grpo.py` (the defaults), seed 0, and its table
    python bench/default_run.py --seeds 0 1 2         # one run per seed, one after the other
    python bench/default_run.py --algo all --seeds 0 1 2 -- --dtype float32   # the five files, side by side per seed
    python bench/default_run.py --algo exgrpo         # `python exgrpo.py` (its defaults); also xrpo, extra, eapo
    python bench/default_run.py --algo eapo           # EAPO's two commands: a grpo.py run of the seed, then eapo.py
    python bench/default_run.py --run runs/NAME       # only summarise a run that already exists
    python bench/default_run.py --run runs/NAME --held-out 500   # ... and re-evaluate it on 500 problems
    python bench/default_run.py --run DIR/bench-eapo* --base eapo_tau100   # each run paired with another label's
    python bench/default_run.py --seeds 0 -- --dtype float32 --steps 20   # options after -- go to the file
    python bench/default_run.py --algo grpo,exgrpo --seeds 0 1 2 --jobs 6 -- --device cuda   # a GPU at once

EAPO needs a prior pi_RL: unless `--prior` is among the options after --, the newest finished default grpo.py run
of the same seed made by this script (runs/bench-grpo-s<seed>-*) is used, and one is made first if there is none.
--jobs N runs up to N of the (algorithm, seed) runs at once, each child's output in runs/<its name>.log: for a GPU,
where one small-model run leaves the device mostly idle; on a CPU it only makes the runs fight for the cores.
--run's folders are labelled by their names, bench-<label>-s<seed>-*; --base LABEL pairs every run with the run of
its seed labelled LABEL instead of grpo.py's: a file beside a control run of its own (eapo.py with nothing injected).

The CPU's flags are printed with the table: a bf16 matmul runs ~900 GFLOP/s on 2 cores with AMX-BF16 and
~1 GFLOP/s with AVX2 only, so `--dtype auto` trains in bf16 on the first and fp32 on the second. Training FLOPs
are counted as 6 x parameters x tokens through the training forward (each distinct prompt once, as the trainer
packs a group after one copy of its prompt; attention's own FLOPs are left out, a few % at these lengths; gradient
checkpointing, on by default, runs the forward twice, 8 x in fact, so the prediction is a lower bound), and
sampling as 2 x parameters per generated token, so the time on another machine can be predicted from its
matmul rate (--predict-gflops).
"""
import contextlib
import importlib
import io
import json
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from common.config import OneLineParser, fail  # noqa: E402  (a user mistake: one line, exit 2)
from common.plot import read_metrics  # noqa: E402  (one line and exit 2 for an unreadable metrics.jsonl)

importlib.import_module("common.memory")  # MKL's branch as the runs take it (common/memory.py): the rate in their mode

ALGOS = ("grpo", "exgrpo", "xrpo", "extra", "eapo")


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = sorted({f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f" {f}" in text})
    return " ".join(flags) or "none of amx_bf16/avx512_bf16/avx512f/avx2"


def matmul_gflops() -> float:
    """The fp32 matmul rate of this machine now, at a shape of the model's MLP ([4096 x 576] @ [576 x 1536]): on a
    shared machine it moves by tens of % from hour to hour, so a run's wall time is read beside it."""
    import torch

    a, b = torch.randn(4096, 576), torch.randn(576, 1536)
    for _ in range(3):
        a @ b
    t0, n = time.perf_counter(), 20
    for _ in range(n):
        a @ b
    return 2 * 4096 * 576 * 1536 * n / (time.perf_counter() - t0) / 1e9


def n_params(run: Path) -> int:
    """Parameters of the run's checkpoint; 0 when it has none (metrics copied from another machine)."""
    from safetensors import safe_open

    total = 0
    for f in (run / "checkpoint").glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(_prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _prod(shape):
    out = 1
    for d in shape:
        out *= d
    return out


def summarise(run: Path, wall: float | None = None, rss_gb: float | None = None, predict_gflops: float = 111.0,
              gflops: tuple | None = None, flags: str | None = None):
    rows = read_metrics(run)
    evals = [r for r in rows if "eval/greedy_acc" in r]
    steps = [r for r in rows if "perf/step_s" in r]
    if not evals or not steps:
        fail(f"{run / 'metrics.jsonl'}: expected a finished run's metrics, with evaluations and steps")
    mean = lambda k: sum(r[k] for r in steps) / len(steps)  # noqa: E731
    total = lambda k: sum(r.get(k, 0) for r in steps)  # noqa: E731
    params = n_params(run)
    train_flops = 6 * params * total("perf/train_fwd_tokens")
    sample_flops = 2 * params * total("perf/sampled_tokens")
    out = {"run": str(run), "acc_before": evals[0]["eval/greedy_acc"], "acc_after": evals[-1]["eval/greedy_acc"],
           "steps": len(steps), "wall_s": wall, "peak_rss_gb": rss_gb or max(r.get("perf/peak_rss_gb", 0) for r in steps),
           "step_split": {part: mean(f"perf/{part}_s") for part in ("sample", "score", "train")}, "gflops": gflops,
           "train_tokens": total("perf/train_fwd_tokens"), "sampled_tokens": total("perf/sampled_tokens"),
           "phase_s": {part: total(f"perf/{part}_s") for part in ("sample", "score", "train")}, "cpu_flags": flags}
    print(f"\nrun {run}" + (f"  (CPU flags: {flags})" if flags else ""))
    print("| what | value |\n|---|---|")
    print(f"| greedy accuracy, step {evals[0]['step']} -> step {evals[-1]['step']} | "
          f"{out['acc_before']:.3f} -> {out['acc_after']:.3f} ({100 * (out['acc_after'] - out['acc_before']):+.1f} points) |")
    print(f"| steps | {len(steps)} |")
    if wall is not None:
        print(f"| wall time (evaluations included) | {wall:.0f} s |")
    eval_s = [r["perf/eval_s"] for r in evals if "perf/eval_s" in r]
    if eval_s:  # runs made before the evaluation timed itself have no perf/eval_s
        print(f"| evaluations | {sum(eval_s):.0f} s ({' + '.join(f'{t:.0f}' for t in eval_s)}) |")
    if eval_s and wall is not None:
        print(f"| steps, all of them | {total('perf/step_s'):.0f} s |")
        print(f"| the rest (start-up, loading, checkpoints) | {wall - sum(eval_s) - total('perf/step_s'):.0f} s |")
    print(f"| step time (mean) | {mean('perf/step_s'):.1f} s |")
    for part in ("sample", "score", "train"):
        share = mean(f"perf/{part}_s") / mean("perf/step_s")
        print(f"| {part} (mean per step) | {mean(f'perf/{part}_s'):.1f} s ({share:.0%}) |")
    print(f"| peak RSS | {out['peak_rss_gb']:.2f} GB of 2^30 bytes ({out['peak_rss_gb'] * 2 ** 30 / 1e9:.2f} x 10^9 bytes) |")
    by_step = ", ".join(f"{steps[i].get('perf/peak_rss_gb', 0):.2f}" for i in (0, len(steps) // 2, -1))
    print(f"| peak RSS so far at the first, middle and last step | {by_step} GB |")
    print(f"| sampled tokens (all steps) | {total('perf/sampled_tokens'):.0f}"
          + (f" ({sample_flops / 1e12:.2f} TFLOP at 2 x {params / 1e6:.0f}M per token) |" if params else " |"))
    print(f"| tokens through the training forward | {total('perf/train_fwd_tokens'):.0f}"
          + (f" ({train_flops / 1e12:.2f} TFLOP at 6 x params) |" if params else " |"))
    if params:
        print(f"| training + sampling time predicted at {predict_gflops:.0f} GFLOP/s | "
              f"{(train_flops + sample_flops) / (predict_gflops * 1e9):.0f} s (matmul-bound lower bound) |")
    if gflops:
        print(f"| this machine's fp32 matmul rate before / after the run | {gflops[0]:.0f} / {gflops[1]:.0f} GFLOP/s |")
    print(f"| reward, first -> last step | {steps[0]['reward/mean']:.3f} -> {steps[-1]['reward/mean']:.3f} |")
    # the algorithm's own metrics (exgrpo/..., xrpo/..., extra/..., eapo/...): is its mechanism acting?
    own = sorted({k for r in steps for k in r if "/" in k and k.split("/")[0] in ALGOS[1:] and _number(r[k])})
    for k in own:
        at = (steps[0], steps[len(steps) // 2], steps[-1])
        print(f"| {k} at steps {', '.join(str(r['step']) for r in at)} | "
              f"{', '.join(f'{r[k]:.3g}' if _number(r.get(k)) else '-' for r in at)} |")
    return out


def logged_time(run: Path) -> float | None:
    """The run's own time from the last line of the log beside it (runs/<name>.log, written with --jobs > 1)."""
    log = Path(f"{run}.log")
    found = re.findall(r"steps in (\d+)m(\d+)s", log.read_text()) if log.is_file() else []
    return 60 * int(found[-1][0]) + int(found[-1][1]) if found else None


def reevaluate(run: Path, size: int, start_acc: dict | None = None) -> tuple[float, float]:
    """Greedy accuracy of the run's start model and of its checkpoint on `size` held-out problems, drawn as the run
    draws its own (with seed 0 for every seed; for arith its own problems are the first of them): a second look with
    less noise. start_acc: the start models' accuracies found so far, by what decides them (model, task, size,
    device, dtype, tokens); runs of one command mostly share their start model, evaluated then once (greedy decoding
    draws nothing, so the run's seed does not enter)."""
    import torch

    from common import checkpoint, dist
    from common.evaluate import evaluate
    from common.model import Transformer, compute_dtype
    from common.tasks import load_task
    from common.tokenizer import Tokenizer

    ckpt = checkpoint.find(run / "checkpoint")
    if ckpt is None:
        fail(f"--held-out: {run / 'checkpoint'} holds no checkpoint to evaluate")
    cfg = torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=False, mmap=True)["extra"]["config"]
    device = torch.device(dist.resolve_device(cfg["device"]))
    dtype = compute_dtype(device, cfg["dtype"])
    held_out = load_task(cfg["task"], "test", n=size, seed=0)[:size]
    max_new_tokens = max(cfg.get("eval_max_new_tokens", 0), cfg["max_new_tokens"])

    def accuracy(model_dir):  # as the run evaluates itself: its rollout copy's dtype, greedy
        model = Transformer.from_pretrained(model_dir, device=device).to(dtype)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            return evaluate(model, Tokenizer.from_pretrained(model_dir), held_out, seed=cfg["seed"],
                            max_new_tokens=max_new_tokens)["eval/greedy_acc"]

    start_acc = {} if start_acc is None else start_acc
    key = (cfg["model"], cfg["task"], size, str(device), str(dtype), max_new_tokens)
    if key not in start_acc:
        start_acc[key] = accuracy(cfg["model"])
    evals = [start_acc[key], accuracy(ckpt)]
    print(f"| greedy accuracy on {size} held-out problems, start -> checkpoint | {evals[0]:.3f} -> {evals[1]:.3f} "
          f"({100 * (evals[1] - evals[0]):+.1f} points) |")
    return evals[0], evals[1]


def overview(results: list, machine: str, base_label: str = "grpo"):
    """One row per run (wall time also as a ratio to grpo.py's run of the same seed, when there is one), then the
    mean +- std of the gain and of that ratio over seeds per algorithm, under `machine`: the line that says which CPU
    made the runs. A run's grpo.py run is its "base" when it has one (--run: the one made beside it), else the last
    grpo.py run of its seed given. base_label: the label of the runs the others pair with (--base: another label
    than grpo pairs a file with a variant of its own, the "grpo" of every text below then that label)."""
    # the work a file's mechanism adds, beside grpo.py's of the seed: tokens through the training forward (what it
    # makes trainable) and tokens sampled (its rollouts are grpo.py's B x G; prefix and in-context prompts are extra)
    name, short = ("grpo.py", "grpo") if base_label == "grpo" else (base_label, base_label)
    base_runs = {seed: r for algo, seed, r in results if algo == base_label}
    base_of = lambda seed, r: r.get("base") or base_runs.get(seed, {})  # noqa: E731

    def ratio(seed, r):
        base = base_of(seed, r).get("wall_s")
        return r["wall_s"] / base if r["wall_s"] and base else None

    def with_ratio(seed, r, key):  # "17196 (0.93)": the run's count and its ratio to grpo.py's of the seed
        base = base_of(seed, r).get(key)
        return f"{r.get(key) or 0:.0f}" + (f" ({r[key] / base:.2f})" if r.get(key) and base else "")

    def at_grpo_rate(seed, r):
        """The ratio had the machine kept the matmul rate of grpo.py's run: the wall ratio times the run's mean
        rate (probes before and after it) over grpo.py's. An estimate: a shared machine drifts by tens of % within
        an hour, and the probes see only the run's two ends; None where a run has no probes."""
        x, rate, base = ratio(seed, r), mean_rate(r), mean_rate(base_of(seed, r))
        return x * rate / base if x is not None and rate and base else None

    print(f"\n{machine}")
    for seed in sorted({seed for algo, seed, _ in results if algo == base_label}):
        n = sum(algo == base_label and s == seed for algo, s, _ in results)
        if n > 1:  # the ratios then depend on the order the runs were given in: say which one they use
            print(f"seed {seed}: {n} {name} runs; the ratios below are to the one made beside each run, "
                  "else to the last one given")
    print(f"\n| algorithm | seed | before -> after | gain | wall | wall / {short} | at {short}'s matmul rate "
          f"| step: sample + score + train | peak RSS | trained tokens (x {short}) | sampled tokens (x {short}) "
          "| fp32 matmul before / after |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    two = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
    for algo, seed, r in results:
        wall = f"{r['wall_s']:.0f} s" if r["wall_s"] is not None else "-"
        rel, adjusted = two(ratio(seed, r)), two(at_grpo_rate(seed, r))
        split = " + ".join(f"{r['step_split'][k]:.1f}" for k in ("sample", "score", "train")) + " s"
        rate = f"{r['gflops'][0]:.0f} / {r['gflops'][1]:.0f} GFLOP/s" if r.get("gflops") else "-"
        print(f"| {algo} | {seed} | {r['acc_before']:.3f} -> {r['acc_after']:.3f} | "
              f"{100 * (r['acc_after'] - r['acc_before']):+.1f} | {wall} | {rel} | {adjusted} | {split} | "
              f"{r['peak_rss_gb'] * 2 ** 30 / 1e9:.2f} x 10^9 B | {with_ratio(seed, r, 'train_tokens')} | "
              f"{with_ratio(seed, r, 'sampled_tokens')} | {rate} |")
    work_table(results, base_of, short)
    # over the seeds: the mean and the worst run, since a goal (a gain of at least 10 points, at most 1.2x grpo.py's
    # wall time, at most 3 x 10^9 B) is about every run
    # and the gain against grpo.py's run beside it (same seed, same machine), paired as bench/compare.py pairs them:
    # the seed's luck and the machine's float sums are shared by the two runs, so the difference is the algorithm's
    from bench.compare import VERDICT_RULE, mean_se, verdict

    gain = lambda r: 100 * (r["acc_after"] - r["acc_before"])  # noqa: E731
    print(f"\n| algorithm | runs | gain, mean ± std (points) | gain, lowest | gain - {name}'s, paired: mean ± s.e. "
          f"| wall / {short}, mean (highest) | at {short}'s matmul rate, mean | peak RSS, highest |"
          "\n|---|---|---|---|---|---|---|---|")
    for algo in dict.fromkeys(a for a, _, _ in results):
        runs = [(s, r) for a, s, r in results if a == algo]
        # a seed run more than once (beside each file's run, or again after a change elsewhere: on one kind of CPU
        # the same run) counts once, with its runs' mean, so that the statistics are over seeds
        by_seed = {}
        for s, r in runs:
            by_seed.setdefault(s, []).append(r)
        gains = [statistics.fmean(gain(r) for r in rs) for rs in by_seed.values()]
        diffs = [statistics.fmean(d) for s, rs in by_seed.items() if (d := [
            gain(r) - gain(b) for r in rs if (b := base_of(s, r)) and b is not r and "acc_after" in b])]
        if algo == base_label or not diffs:
            paired = "-"
        else:
            m, se = mean_se(diffs)
            m = round(m, 1) + 0.0  # no "-0.0" for a difference that is 0 up to float sums
            paired = f"{m:+.1f}" + (f" ± {se:.1f}" if len(diffs) > 1 else "") + f": {verdict(diffs)[1]}"
        spread = f" ± {statistics.stdev(gains):.1f}" if len(gains) > 1 else ""
        walls, adjusted = ([x for x in (fn(s, r) for s, r in runs) if x is not None] for fn in (ratio, at_grpo_rate))
        wall = f"{two(statistics.fmean(walls))} ({two(max(walls))})" if walls else two(None)
        rss = max(r["peak_rss_gb"] for _, r in runs) * 2 ** 30 / 1e9
        count = f"{len(runs)}" if len(runs) == len(by_seed) else f"{len(runs)} ({len(by_seed)} seed{'s' * (len(by_seed) > 1)})"
        print(f"| {algo} | {count} | {statistics.fmean(gains):+.1f}{spread} | {min(gains):+.1f} | {paired} | "
              f"{wall} | {two(statistics.fmean(adjusted) if adjusted else None)} | {rss:.2f} x 10^9 B |")
    print(f"paired verdicts (better than {name}'s gain) — {VERDICT_RULE}")


def work_table(results: list, base_of, short: str = "grpo"):
    """Time per unit of work beside grpo.py's run of the seed: a file whose mechanism makes more of the batch
    trainable, or samples more, takes longer at the same rates. Sampling per sampled token, training per token
    through the training forward, the scoring phase per step; then the steps' time had the run done grpo.py's work
    at its own rates (its per-token sampling and training times times grpo.py's token counts, plus its scoring),
    over grpo.py's steps' time. Runs that logged no phase times get no row."""
    def per_token(x, part, key):  # seconds of a phase per token it handled; None without either
        return x["phase_s"][part] / x[key] if x.get("phase_s") and x.get(key) else None

    rows = []
    for algo, seed, r in results:
        base = base_of(seed, r)
        s, t = per_token(r, "sample", "sampled_tokens"), per_token(r, "train", "train_tokens")
        s0, t0 = per_token(base, "sample", "sampled_tokens"), per_token(base, "train", "train_tokens")
        if not (s and t and s0 and t0):
            continue
        score = r["phase_s"]["score"]
        at_grpo_work = s * base["sampled_tokens"] + score + t * base["train_tokens"]
        rows.append(f"| {algo} | {seed} | {1e3 * s:.1f} ({s / s0:.2f}) | {score / r['steps']:.1f} | "
                    f"{1e3 * t:.1f} ({t / t0:.2f}) | {at_grpo_work / sum(base['phase_s'].values()):.2f} |")
    if rows:
        print(f"\n| algorithm | seed | sampling, ms per sampled token (x {short}) | scoring, s a step "
              f"| training, ms per trained token (x {short}) | steps' time at {short}'s token counts / {short}'s |\n"
              "|---|---|---|---|---|---|")
        print("\n".join(rows))


def pair_beside(results: list, predict_gflops: float, base_label: str = "grpo"):
    """--run: each run's base is the grpo.py run of its seed made beside it, in the same folder (read from there if
    it is not among the runs given), so that a ratio is always of two runs one after the other on one machine,
    however folders of different days are mixed; a grpo.py run is its own base. A folder with no grpo.py run of the
    seed: the last grpo.py run of the seed given that recorded the same CPU flags (not another processor's, whose
    runs of a seed are other runs); with none, overview's rule (the last grpo.py run of the seed given).
    base_label: the label whose runs play grpo.py's part (--base)."""
    given = {Path(r["run"]).resolve(): r for _, _, r in results}
    for algo, seed, r in results:
        if algo == base_label:
            r["base"] = r
            continue
        folder = Path(r["run"]).parent
        beside = sorted(p for p in folder.glob(f"bench-{base_label}-s{seed}-*") if (p / "metrics.jsonl").is_file())
        if not beside:
            same_cpu = [g for a, s, g in results if a == base_label and s == seed and r["cpu_flags"]
                        and g["cpu_flags"] == r["cpu_flags"]]
            if same_cpu:
                r["base"] = same_cpu[-1]
        else:
            path = beside[-1].resolve()
            if path not in given:
                with contextlib.redirect_stdout(io.StringIO()):  # its own table is not asked for
                    m = measured(path)
                    given[path] = summarise(path, m.get("wall_s"), m.get("peak_rss_gb"), predict_gflops,
                                            m.get("gflops"), m.get("cpu_flags"))
            r["base"] = given[path]


def mean_rate(r: dict) -> float | None:
    """A run's fp32 matmul rate, the mean of its probes before and after; None without both."""
    rates = r.get("gflops") or ()
    return statistics.fmean(rates) if len(rates) == 2 and all(rates) else None


def finished_run(algo: str, seed: int) -> Path | None:
    """The newest run of `algo` for `seed` made by this script whose checkpoint holds its last step."""
    from common import checkpoint

    import torch

    for run in sorted(Path("runs").glob(f"bench-{algo}-s{seed}-*"), reverse=True):
        ckpt = checkpoint.find(run / "checkpoint") if run.is_dir() else None
        if ckpt is not None:
            state = torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=False, mmap=True)
            if state["step"] == state["extra"].get("config", {}).get("steps"):
                return run
    return None


def run_once(algo: str, seed: int, rest: list, log: bool = False) -> tuple:
    """One `python <algo>.py` in a child that reports its own child's peak RSS (so runs do not mix). Returns the
    run folder, wall seconds, peak RSS in GB, and this machine's matmul rate before and after (None with log=True);
    None if the run failed (said on stderr; the other runs go on, and their table is still printed)."""
    if algo == "eapo" and "--prior" not in rest:  # EAPO's first command: the prior is a grpo.py run
        prior = finished_run("grpo", seed) or (run_once("grpo", seed, rest, log) or [None])[0]
        if prior is None:
            print(f"bench/default_run.py: eapo.py seed {seed} not run: its prior, a grpo.py run, failed", file=sys.stderr)
            return None
        rest = [*rest, "--prior", str(prior / "checkpoint")]
    name = time.strftime(f"bench-{algo}-s{seed}-%Y%m%d-%H%M%S")
    cmd = [sys.executable, str(REPO / f"{algo}.py"), "--run-name", name, "--seed", str(seed), *rest]
    print("run:", " ".join(cmd[1:]), flush=True)
    # the child's output streams as usual; its peak RSS comes back on the probe's stderr, last line
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
             "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
             "sys.exit(r.returncode)")
    rate = matmul_gflops() if not log else None  # not beside other runs: they would share the cores
    t0 = time.time()
    Path("runs").mkdir(exist_ok=True)
    out = open(Path("runs") / f"{name}.log", "w") if log else None
    try:
        r = subprocess.run([sys.executable, "-c", probe, *cmd], stdout=out, stderr=subprocess.PIPE, text=True)
        lines = r.stderr.splitlines()
        print("\n".join(line for line in lines if not line.startswith("PEAK_RSS_KB")), file=out or sys.stderr)
    finally:
        if out:
            out.close()
    wall = time.time() - t0
    if r.returncode:
        print(f"bench/default_run.py: {' '.join(cmd[1:])} failed with exit code {r.returncode}", file=sys.stderr)
        return None
    kb = [float(line.split()[1]) for line in lines if line.startswith("PEAK_RSS_KB")]
    rss, rates = (kb[-1] / 2 ** 20 if kb else None), (rate and (rate, matmul_gflops()))
    # kept beside the run's metrics, so that a benchmark stopped part-way (or --run later) keeps these numbers
    (Path("runs") / name / "bench.json").write_text(json.dumps(
        {"wall_s": wall, "peak_rss_gb": rss, "gflops": rates, "cpu_flags": cpu_flags(), "command": cmd[1:]}))
    return Path("runs") / name, wall, rss, rates


def measured(run: Path) -> dict:
    """What run_once measured of a run (bench.json): wall time, peak RSS, matmul rates, CPU flags. Runs made before
    it was kept: the run's own timer from the log beside it (--jobs > 1) and the metrics' peak RSS."""
    f = run / "bench.json"
    return json.loads(f.read_text()) if f.is_file() else {"wall_s": logged_time(run)}


def main():
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, nargs="+", help="summarise these run folders instead of starting runs")
    p.add_argument("--algo", default="grpo",
                   help="the algorithm file(s), comma-separated: grpo, exgrpo, xrpo, extra, eapo; or all")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run of each algorithm per seed")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (for a GPU; 1 on a CPU)")
    p.add_argument("--held-out", type=int, default=0,
                   help="with --run: also evaluate the start model and the checkpoint greedily on this many held-out problems")
    p.add_argument("--base", default="grpo",
                   help="with --run: the label (folders bench-<label>-s<seed>-*) whose run of a seed the others pair "
                        "with: grpo, or e.g. eapo_tau100 to set eapo.py's runs beside its own control runs")
    p.add_argument("--predict-gflops", type=float, default=111.0,
                   help="matmul rate for the time prediction (111: fp32 on 2 cores of an AVX2-only AMD EPYC)")
    args, rest = p.parse_known_args()
    rest = [a for a in rest if a != "--"]
    if args.jobs < 1 or args.held_out < 0 or not 0 < args.predict_gflops < float("inf"):
        p.error("expected --jobs >= 1, --held-out >= 0 and a finite --predict-gflops > 0")
    if args.run:
        results, flags, start_acc = [], [], {}
        for run in args.run:
            if run.suffix == ".log" and run.is_file():  # a shell glob also matches the runs' logs beside them
                continue
            if not (run / "metrics.jsonl").is_file():
                p.error(f"--run: {run / 'metrics.jsonl'} not found (expected a run folder)")
            name = re.fullmatch(r"bench-(\w+)-s(\d+)-.*", run.name)
            m = measured(run)
            flags.append(m.get("cpu_flags"))
            results.append((name[1] if name else run.name, int(name[2]) if name else -1,
                            summarise(run, m.get("wall_s"), m.get("peak_rss_gb"), args.predict_gflops, m.get("gflops"),
                                      m.get("cpu_flags"))))
            if args.held_out:
                reevaluate(run, args.held_out, start_acc)
        if args.base != "grpo" and not any(algo == args.base for algo, _, _ in results) and not any(
                next(Path(r["run"]).parent.glob(f"bench-{args.base}-s*"), None) for _, _, r in results):  # a typo
            p.error(f"--base: no run labelled {args.base!r} among --run (folders bench-{args.base}-s<seed>-*)")
        pair_beside(results, args.predict_gflops, args.base)
        # seed by seed, each in the order of ALGOS (a shell glob gives them by name)
        results.sort(key=lambda x: (x[1], ALGOS.index(x[0]) if x[0] in ALGOS else len(ALGOS)))
        # --run reads runs made anywhere: the flags they recorded (bench.json), never this machine's as theirs
        recorded = {f: flags.count(f) for f in flags if f}  # runs of several machines are paired within each folder
        if recorded:
            each = "; ".join(f"{f} ({n} run{'s' * (n > 1)})" for f, n in recorded.items())
            machine = (f"CPU flags (recorded with the runs): {each} "
                       f"({len(flags) - flags.count(None)} of the {len(flags)} runs recorded them)")
        else:
            machine = f"machine: not recorded in the runs (this machine's CPU flags: {cpu_flags()})"
        return overview(results, machine, args.base)
    algos = list(ALGOS) if args.algo == "all" else [a for a in args.algo.split(",") if a]
    for a in algos:
        if a not in ALGOS:
            p.error(f"--algo: expected names among {','.join(ALGOS)}, got {a!r}")
    # One at a time: seed by seed, each algorithm right after grpo.py's run of the same seed (the machine's speed
    # drifts over hours, so a ratio of neighbouring runs is what compares); EAPO's prior is that grpo.py run.
    # At once (a GPU): EAPO in a second wave, so that its prior is made by the first when grpo is asked for too.
    waves = ([[(a, s) for s in args.seeds for a in ALGOS if a in algos]] if args.jobs == 1 else
             [[(a, s) for a in algos if a != "eapo" for s in args.seeds], [("eapo", s) for s in args.seeds if "eapo" in algos]])
    done = []
    for wave in waves:
        with ThreadPoolExecutor(args.jobs) as pool:
            done += list(pool.map(lambda job: (job, run_once(*job, rest, log=args.jobs > 1)), wave))
    # a failed run loses only its own row: the finished runs' table is printed, then the exit says which failed
    results = [(algo, seed, summarise(path, wall, rss, args.predict_gflops, gflops, cpu_flags()))
               for (algo, seed), (path, wall, rss, gflops) in ((job, r) for job, r in done if r is not None)]
    if results:
        overview([(algo, seed, r) for algo, seed, r in results], f"CPU flags: {cpu_flags()}")
    failed = [f"{algo}.py seed {seed}" for (algo, seed), r in done if r is None]
    if failed:
        sys.exit(f"bench/default_run.py: {len(failed)} run(s) failed: {', '.join(failed)} (their errors above)")


if __name__ == "__main__":
    main()
