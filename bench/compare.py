"""The five algorithms side by side: one model, one task, the same rollouts per step, steps and seeds.

    python bench/compare.py                                   # five algorithms x seeds 0,1,2 x 15 steps (CPU: hours)
    python bench/compare.py --algos grpo,xrpo --seeds 0 --steps 5    # narrow it
    python bench/compare.py --model DIR --task gsm8k --device cuda   # another shared setting (see --help)
    python bench/compare.py --device cuda --jobs 12                  # one GPU: 12 runs, then evaluations, at once
    python bench/compare.py --report-only --runs-dir bench/results/h100-2026-11-23   # from committed metrics

Every run is its own process, started with the command line a user would type (printed before it starts), from the
current folder, so its run lands in runs/<prefix>-<algo>-s<seed>. All runs share the model, the task, the training
pool, B prompts x G completions per step (XRPO: n_base base rollouts + a dynamic rest that adds up to the same B x G),
the steps and the seeds; every other option is the algorithm file's own default (its paper's recipe). EAPO's prior
pi_RL is the checkpoint of the GRPO run of the same seed (started first if it is not there yet).

A run already finished (checkpoint at the last step) is reused, one stopped half-way is resumed (--resume), so the
harness can be stopped and started again. Evaluation: the runs evaluate themselves greedily on --curve-size held-out
problems every --curve-every steps (the plot's points); the harness then evaluates the start model once per seed and
each run's final checkpoint with common.evaluate.evaluate: greedy accuracy, pass@1/4/8 and maj@8 from 8 samples, on
the same --eval-size held-out problems for every algorithm and seed (the algorithm files draw theirs the same way). In-process, because that is the cheapest identical
evaluation: the start model is evaluated once per seed instead of once per run, and samples are drawn only at the
two ends. Results are cached in each run folder (runs/<prefix>-start/ for the start model).

Writes a markdown table (gains over the start model, mean +- std over seeds, cost) with each paper's claim beside
ours to --out, and a PNG next to it (held-out accuracy against rollouts sampled and against training time).
Disk: every run keeps its checkpoint (SmolLM2-135M: 1.6 GB with the optimizer state, so 15 runs take about 24 GB).
"""
import json
import math
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import checkpoint  # noqa: E402
from common.config import RunError, check, main_guard, parse  # noqa: E402

ALGOS = ("grpo", "exgrpo", "xrpo", "extra", "eapo")


@dataclass
class Config:
    algos: str = "grpo,exgrpo,xrpo,extra,eapo"  # comma-separated; one whose file is missing is skipped with a message
    seeds: str = "0,1,2"  # comma-separated seeds; every algorithm runs once per seed
    steps: int = 15  # training steps of every run
    prefix: str = "cmp"  # runs are runs/<prefix>-<algo>-s<seed>; another prefix keeps another setting apart
    # the shared setting
    model: str = "smollm2"  # Hugging Face folder or smollm2 (the CPU default)
    task: str = "arith"  # arith (the CPU default), gsm8k, math500, ... or a .jsonl file
    # our choice: 40, not 200: 15 steps x 8 prompts then see each question 3 times (ExGRPO's buffer, XRPO's ICL
    # corpus and ExTra's novelty memory act only on questions that come back); 200 would need 75 steps for that
    train_size: int = 40  # training pool (arith only)
    prompts_per_step: int = 8  # B: prompts per step
    group_size: int = 8  # G: B x G rollouts per step for every algorithm (XRPO: on average per prompt)
    max_new_tokens: int = 96  # completion budget in tokens
    temperature: float = 0.8  # sampling temperature, in training and for pass@k / maj@k (as the runs evaluate)
    device: str = "auto"  # auto, cpu or cuda (runs and evaluation)
    # a small model leaves a GPU mostly idle, so several runs can share it; on a CPU they would fight for the cores
    jobs: int = 1  # runs (then evaluations) at once; each run's output then goes to runs/<its name>.log
    dtype: str = "auto"  # auto, float32 or bfloat16 (runs and evaluation)
    # evaluation
    eval_size: int = 280  # held-out problems: a standard error of at most sqrt(0.25 / 280) = 3.0 points per number
    eval_samples: int = 8  # sampled completions per problem for pass@1/4/8 and maj@8
    curve_every: int = 5  # the runs' own greedy evaluation (and checkpoint) every N steps: the plot's points
    # our choice: 100 greedy problems for the curves (the algorithm files' default), a third of the table's cost
    curve_size: int = 100  # held-out problems of the runs' own evaluation (for arith the first of the --eval-size ones)
    # output
    out: str = "bench/COMPARE.md"  # the table; the plot goes beside it with the suffix .png
    runs_dir: str = "runs"  # where the runs are (and are made)
    # no runs, no evaluation: the table from the runs' own greedy evaluations (--curve-size problems at step 0 and
    # at the last step) and the plot, e.g. for runs made on another machine whose checkpoints did not come along
    report_only: bool = False

    choices = {"device": ["auto", "cpu", "cuda"], "dtype": ["auto", "float32", "bfloat16"]}


def shared_options(cfg: Config, seed: int) -> list[str]:
    """The options every algorithm gets: one setting, one seed."""
    return ["--seed", str(seed), "--steps", str(cfg.steps), "--model", cfg.model, "--task", cfg.task,
            "--train-size", str(cfg.train_size), "--prompts-per-step", str(cfg.prompts_per_step),
            "--group-size", str(cfg.group_size), "--max-new-tokens", str(cfg.max_new_tokens),
            "--eval-max-new-tokens", str(cfg.max_new_tokens),
            "--temperature", str(cfg.temperature), "--device", cfg.device, "--dtype", cfg.dtype,
            "--eval-size", str(cfg.curve_size), "--eval-samples", "0", "--eval-every", str(cfg.curve_every),
            "--save-every", str(cfg.curve_every)]


def own_options(cfg: Config, algo: str, seed: int) -> list[str]:
    """What one algorithm needs beyond the shared setting."""
    if algo == "xrpo":  # n_base rollouts per prompt, the rest of B x G planned by priority
        # our choice: n_base = G / 2, xrpo.py's default ratio (4 of 8), so other --group-size values keep it
        return ["--base-rollouts", str(max(2, cfg.group_size // 2))]
    if algo == "eapo":  # our choice: pi_RL is the GRPO run of the same seed, the cheapest earlier RL run there is
        return ["--prior", str(Path(cfg.runs_dir) / run_name(cfg, "grpo", seed) / "checkpoint")]
    return []


def metrics(cfg: Config) -> list[tuple[str, str]]:
    """(key, label) of the numbers in the table: greedy, pass@k for k = 1, 4, 8, ... up to the samples, maj@samples."""
    if cfg.eval_samples == 0:
        return [("eval/greedy_acc", "greedy")]
    ks = [k for k in (1, 4, 8, 16, 32, 64, 128, 256) if k <= cfg.eval_samples]
    return ([("eval/greedy_acc", "greedy")] + [(f"eval/pass@{k}", f"pass@{k}") for k in ks]
            + [(f"eval/maj@{cfg.eval_samples}", f"maj@{cfg.eval_samples}")])


def run_name(cfg: Config, algo: str, seed: int) -> str:
    return f"{cfg.prefix}-{algo}-s{seed}"


def setting(cfg: Config) -> dict:
    """What a reused run must have been made with (all but --steps, which a resumed run may extend)."""
    keep = ("model", "task", "train_size", "prompts_per_step", "group_size", "max_new_tokens", "temperature",
            "dtype", "curve_size", "curve_every")
    return {k: getattr(cfg, k) for k in keep}


# ------------------------------------------------------------------------------------------------ runs

def checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run's newest complete checkpoint, or None."""
    import torch

    ckpt = checkpoint.find(run_dir / "checkpoint")
    if ckpt is None:
        return None
    # mmap: read the step without pulling the optimizer state into memory
    return int(torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=False, mmap=True)["step"])


def ensure_run(cfg: Config, algo: str, seed: int, log: bool = False) -> bool:
    """Run (or resume) one algorithm for one seed unless its checkpoint is already at the last step. True if done."""
    name = run_name(cfg, algo, seed)
    run_dir = Path(cfg.runs_dir) / name
    info_file = run_dir / "compare.json"
    step = checkpoint_step(run_dir)
    if run_dir.exists() and any(run_dir.iterdir()):
        check(info_file.is_file(), "prefix", f"a prefix whose runs this harness made: {run_dir} is not one of them")
        made_with = json.loads(info_file.read_text())["setting"]
        check(made_with == setting(cfg), "prefix", f"another prefix: {run_dir} was made with another setting "
              f"({', '.join(f'{k}={v}' for k, v in made_with.items() if setting(cfg).get(k) != v)})")
    check(step is None or step <= cfg.steps, "steps", f"at least {step}: {run_dir} ran that far (or another --prefix)")
    if step == cfg.steps:
        print(f"reuse {name}: finished at step {step}")
        return True
    if step is None and run_dir.exists():  # stopped before its first checkpoint: nothing to resume from
        shutil.rmtree(run_dir)
    script = REPO / f"{algo}.py"
    script = script.relative_to(Path.cwd()) if script.is_relative_to(Path.cwd()) else script
    cmd = ["python", str(script), "--run-name", name, *shared_options(cfg, seed), *own_options(cfg, algo, seed)]
    cmd += ["--resume"] if step else []
    print(("resume: " if step else "run: ") + " ".join(cmd), flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    info = json.loads(info_file.read_text()) if info_file.is_file() else {"wall_s": 0.0}
    info.update(setting=setting(cfg), command=cmd, machine=machine())
    info_file.write_text(json.dumps(info, indent=1))
    t0 = time.time()
    out = open(Path(cfg.runs_dir) / f"{name}.log", "a") if log else None
    try:
        rc = subprocess.run([sys.executable, *cmd[1:]], stdout=out, stderr=subprocess.STDOUT if log else None).returncode
    finally:
        if out:
            out.close()
    info["wall_s"] += time.time() - t0  # the process, its own evaluations included, summed over resumes
    info_file.write_text(json.dumps(info, indent=1))
    if rc != 0:
        print(f"{name}: exited with {rc}; left out of the table (rerun the harness to resume it)", flush=True)
    return rc == 0 and checkpoint_step(run_dir) == cfg.steps


# ------------------------------------------------------------------------------------------------ evaluation

def evaluate_model(cfg: Config, model_dir, seed: int) -> dict:
    """Greedy accuracy, pass@k and maj@k of one model on the held-out problems the runs evaluate on; `seed` seeds
    the samples."""
    import torch

    from common.evaluate import evaluate
    from common.model import Transformer, compute_dtype
    from common.tasks import load_task
    from common.tokenizer import Tokenizer

    device = torch.device("cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    dtype = compute_dtype(device, cfg.dtype)
    # the same problems as the runs' own evaluation: grpo.py draws its held-out set with seed 0 for every seed
    held_out = load_task(cfg.task, "test", n=cfg.eval_size, seed=0)[: cfg.eval_size]
    tok = Tokenizer.from_pretrained(model_dir)
    model = Transformer.from_pretrained(model_dir, device=device).to(dtype)  # as the runs' rollout copy
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        out = evaluate(model, tok, held_out, samples=cfg.eval_samples, temperature=cfg.temperature,
                       max_new_tokens=cfg.max_new_tokens, seed=seed)
    return {k: v for k, v in out.items() if k.startswith("eval/")}  # its time is kept apart (cached_eval's eval_s)


def cached_eval(cfg: Config, cache: Path, model_dir, seed: int, step: int) -> dict:
    """evaluate_model kept in `cache` (a JSON file), reused while the model's step and the settings are the same.
    Returns {"key", "eval": the metrics, "eval_s": the seconds it took}."""
    key = {"model": cfg.model, "step": step, "eval_size": cfg.eval_size, "eval_samples": cfg.eval_samples, "seed": seed,
           "temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens, "task": cfg.task, "dtype": cfg.dtype,
           "problems": "drawn with seed 0"}  # before, each seed drew its own: such a cache is stale
    if cache.is_file():
        saved = json.loads(cache.read_text())
        if saved["key"] == key:
            return saved
    print(f"evaluate {model_dir} on {cfg.eval_size} held-out problems (seed {seed}, {cfg.eval_samples} samples)",
          flush=True)
    t0 = time.time()
    saved = {"key": key, "eval": evaluate_model(cfg, model_dir, seed), "eval_s": time.time() - t0}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(saved, indent=1))
    return saved


# ------------------------------------------------------------------------------------------------ reading runs

def run_summary(cfg: Config, algo: str, seed: int) -> dict:
    """Cost and curve of a finished run, from its metrics.jsonl. rollouts: completions sampled (ExGRPO's replayed
    trajectories are in its batch but were not sampled this step: left out); tokens: sampled and trained."""
    run_dir = Path(cfg.runs_dir) / run_name(cfg, algo, seed)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    per_step = cfg.prompts_per_step * cfg.group_size
    rollouts = tok_sampled = tok_trained = train_s = 0.0
    curve = []  # (step, rollouts so far, training seconds so far, greedy accuracy)
    for r in rows:
        if "perf/step_s" in r:
            replayed = round(r.get("exgrpo/replay_share", 0.0) * cfg.prompts_per_step)
            rollouts += per_step - replayed
            # the step's sampled tokens; where a run did not log them (older files), the batch's completion tokens
            # (perf/sample_tok_s x perf/sample_s) with ExGRPO's replayed share taken out in proportion to rollouts
            tok_sampled += r["perf/sampled_tokens"] if "perf/sampled_tokens" in r else (
                r["perf/sample_tok_s"] * r["perf/sample_s"] * (per_step - replayed) / per_step)
            tok_trained += r["perf/train_tok_s"] * r["perf/train_s"]  # = tokens through the loss, all epochs
            train_s += r["perf/step_s"]
        if "eval/greedy_acc" in r:
            curve.append((r["step"], rollouts, train_s, r["eval/greedy_acc"]))
    lam = [r["step"] - 1 for r in rows if r.get("eapo/lambda") == 0.0]  # T: λ_k = 0 from k = T, i.e. step T + 1
    info = json.loads((run_dir / "compare.json").read_text())
    return {"rollouts": rollouts, "tok_sampled": tok_sampled, "tok_trained": tok_trained, "train_s": train_s,
            "wall_s": info["wall_s"], "curve": curve, "anneal_end": lam[0] if lam else None,
            "machine": info.get("machine")}


# ------------------------------------------------------------------------------------------------ report

def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else float("nan")


def pm(xs: list[float], scale: float = 100.0, digits: int = 1) -> str:
    m, s = mean_std([x * scale for x in xs])
    return f"{m:+.{digits}f} ± {s:.{digits}f}" if not math.isnan(s) else f"{m:+.{digits}f}"


def count(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def table(cfg: Config, results: dict, before: dict) -> list[str]:
    """results[algo][seed] = {"eval": ..., "summary": ...}; before[seed] = the start model's evaluation."""
    names = [label for _, label in metrics(cfg)]
    lines = ["| algorithm | seeds | " + " | ".join(f"Δ {n}" for n in names)
             + " | train time | rollouts | tokens sampled | tokens trained |",
             "|---" * (len(names) + 6) + "|"]
    for algo, by_seed in results.items():
        seeds = sorted(by_seed)
        gains = [pm([by_seed[s]["eval"][k] - before[s][k] for s in seeds]) for k, _ in metrics(cfg)]
        cost = lambda key: statistics.fmean(by_seed[s]["summary"][key] for s in seeds)  # noqa: E731
        lines.append(f"| {algo} | {len(seeds)} | " + " | ".join(gains) + f" | {cost('train_s') / 60:.1f} min | "
                     f"{cost('rollouts'):.0f} | {count(cost('tok_sampled'))} | {count(cost('tok_trained'))} |")
    if before:
        start = [f"{statistics.fmean(before[s][k] for s in before) * 100:.1f}" for k, _ in metrics(cfg)]
        lines += ["", f"Start model (mean over seeds {', '.join(map(str, sorted(before)))}): "
                  + ", ".join(f"{n} {v}%" for n, v in zip(names, start)) + "."]
    return lines


def paired(results: dict, before: dict, algo: str, key: str) -> list[float] | None:
    """Per seed: the algorithm's gain minus GRPO's gain on the same seed (points), for seeds both have."""
    if algo not in results or "grpo" not in results:
        return None
    seeds = sorted(set(results[algo]) & set(results["grpo"]))
    return [100 * (results[algo][s]["eval"][key] - results["grpo"][s]["eval"][key]) for s in seeds] or None


def verdict(diffs: list[float] | None, eval_size: int) -> str:
    """'same way' / 'opposite' from the mean paired difference, and whether it is above the noise: the standard
    error over seeds, or (one seed) the binomial standard error of a difference of two accuracies near 0.5."""
    if not diffs:
        return "not measured (needs both runs of a seed)"
    m = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 100 * math.sqrt(2 * 0.25 / eval_size)
    way = "same way" if m > 0 else "opposite way" if m < 0 else "no difference"
    seeds = f"{len(diffs)} seed" + "s" * (len(diffs) > 1)
    return f"{m:+.1f} pts ({seeds}, s.e. {se:.1f}): {way}" + (", within noise" if m and abs(m) <= 2 * se else "")


def crossing(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first step at which a (step, accuracy) curve reaches target, linearly interpolated; None if never."""
    for (s0, a0), (s1, a1) in zip(curve, curve[1:]):
        if a1 >= target:
            return s0 if a0 >= target else s0 + (target - a0) / (a1 - a0) * (s1 - s0)
    return None


def mean_curve(results: dict, algo: str) -> list[tuple[float, float]]:
    """(step, greedy accuracy) averaged over seeds at the eval steps all seeds share."""
    curves = [dict((c[0], c[3]) for c in results[algo][s]["summary"]["curve"]) for s in results[algo]]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return [(st, statistics.fmean(c[st] for c in curves)) for st in steps]


def xrpo_claim(cfg: Config, results: dict) -> str:
    """Steps to reach GRPO's final greedy accuracy (mean curves over seeds): GRPO's own against XRPO's."""
    if "xrpo" not in results or "grpo" not in results:
        return "not measured (needs grpo and xrpo runs)"
    g, x = mean_curve(results, "grpo"), mean_curve(results, "xrpo")
    start, target = g[0][1], g[-1][1]
    where = f" (greedy on {cfg.curve_size} problems every {cfg.curve_every} steps, mean over seeds)"
    if target <= start:
        return f"not testable: GRPO did not improve ({100 * start:.1f}% → {100 * target:.1f}%)" + where
    steps_g, steps_x = crossing(g, target), crossing(x, target)
    if steps_x is None:
        return f"XRPO does not reach GRPO's final {100 * target:.1f}% within {x[-1][0]} steps: opposite way" + where
    way = "same way" if steps_x < steps_g else "opposite way" if steps_x > steps_g else "no difference"
    return (f"GRPO first reaches its final {100 * target:.1f}% at step {steps_g:.1f}, XRPO at step {steps_x:.1f}: "
            f"{steps_g / steps_x:.1f}x fewer steps: {way}" + where)


def claims(cfg: Config, results: dict, before: dict) -> list[str]:
    """Each paper's headline claim next to what our runs say, computed from them."""
    n, tops = cfg.eval_size, [label for _, label in metrics(cfg) if label.startswith("pass@")]
    # without samples (--report-only) greedy accuracy stands in for pass@1, and pass@k is not measured
    key1, name1 = ("eval/pass@1", "pass@1") if tops else ("eval/greedy_acc", "greedy accuracy")
    extra_k = (f"; Δ {tops[-1]} (the largest k of our {cfg.eval_samples} samples): "
               + verdict(paired(results, before, "extra", f"eval/{tops[-1]}"), n)) if tops else "; pass@k not measured"
    xrpo = xrpo_claim(cfg, results)
    eapo_T = "annealing length not read"
    if "eapo" in results:
        ends = {results["eapo"][s]["summary"]["anneal_end"] for s in results["eapo"]}
        eapo_T = (f"one annealing length, T = {ends.pop()} steps (eapo.py's default)" if ends and None not in ends
                  else f"one annealing length, not finished within {cfg.steps} steps")
    rows = [
        ("ExGRPO (arXiv 2510.02245)", "above on-policy RLVR: +3.5 pts in-distribution average (Qwen2.5-Math-7B)",
         f"Δ {name1} ExGRPO − GRPO: " + verdict(paired(results, before, "exgrpo", key1), n)),
        ("XRPO (arXiv 2510.06672)", "reaches GRPO's accuracy in 2.4–2.7x fewer steps (1.5B models)", xrpo),
        ("ExTra (arXiv 2606.24994)", "+5 pts pass@1 and +7 pts pass@16 over GRPO, six math benchmarks (Qwen3-1.7B)",
         f"Δ {name1} ExTra − GRPO: " + verdict(paired(results, before, "extra", key1), n) + extra_k),
        ("EAPO (arXiv 2606.30420)", "above the same-recipe on-policy run for every annealing length T "
         "(Qwen2.5-Math-7B, Qwen3-8B; no numbers public)",
         f"Δ {name1} EAPO − GRPO: " + verdict(paired(results, before, "eapo", key1), n) + f"; {eapo_T}"),
    ]
    out = ["| paper | its claim | ours |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    out += ["", "What differs: the papers train 1.5B–8B models for hundreds of steps on competition math "
            f"(MATH, AIME) with batches of hundreds of prompts; here {cfg.model} trains {cfg.steps} steps on "
            f"{cfg.task} with {cfg.prompts_per_step} x {cfg.group_size} rollouts per step from a pool of "
            f"{cfg.train_size} questions, with each file's own defaults, so mechanisms that need many revisits (replay "
            "buffers, novelty memories, ICL corpora) have little time to act. A difference within 2 standard errors "
            "is noise."]
    return out


def plot(cfg: Config, results: dict, path: Path):
    """Held-out greedy accuracy against rollouts sampled and against training time: one line per algorithm (mean
    over seeds) with a band from the lowest to the highest seed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for algo in results:
        curves = [results[algo][s]["summary"]["curve"] for s in sorted(results[algo])]
        n = min(len(c) for c in curves)
        for ax, col, scale in ((axes[0], 1, 1.0), (axes[1], 2, 1 / 60)):
            x = [statistics.fmean(c[i][col] for c in curves) * scale for i in range(n)]
            accs = [[100 * c[i][3] for c in curves] for i in range(n)]
            line, = ax.plot(x, [statistics.fmean(a) for a in accs], marker="o", label=algo)
            ax.fill_between(x, [min(a) for a in accs], [max(a) for a in accs], color=line.get_color(), alpha=0.2)
    axes[0].set_xlabel("rollouts sampled")
    axes[1].set_xlabel("training time (min, evaluation excluded)")
    axes[0].set_ylabel(f"greedy accuracy, {cfg.curve_size} held-out (%)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{Path(cfg.model).name} on {cfg.task}: mean over seeds, band = min..max", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return path


def machine() -> str:
    """CPU model, cores and vector units, GPU, torch threads: what the times in the table were measured on."""
    import os
    import platform

    import torch

    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        info = []
    field = lambda name: next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith(name)), "")  # noqa: E731
    units = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in field("flags").split()]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{field('model name') or platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores "
            f"({'/'.join(units) or 'no AVX2'}), {gpu}; torch {torch.__version__}, {torch.get_num_threads()} threads")


def report(cfg: Config, command: str, results: dict, before: dict, hours: tuple[float, float]) -> str:
    png = plot(cfg, results, Path(cfg.out).with_suffix(".png")) if results else None
    noise = 100 * math.sqrt(0.3 * 0.7 / cfg.eval_size), 100 * math.sqrt(0.25 / cfg.eval_size)
    ks = ", ".join(label.removeprefix("pass@") for _, label in metrics(cfg) if label.startswith("pass@"))
    ran_on = sorted({r["summary"]["machine"] or "not recorded" for by in results.values() for r in by.values()})
    how = (f"pass@k (k = {ks}; unbiased) and maj@{cfg.eval_samples} come from {cfg.eval_samples} samples per problem "
           f"at T = {cfg.temperature} (maj@1 is pass@1 in expectation)." if cfg.eval_samples else
           f"Greedy accuracy from the runs' own evaluations at step 0 and step {cfg.steps} (--report-only: the "
           "harness's own evaluation, pass@k and maj@k, was not run).")
    lines = [f"# Comparison: {', '.join(results) or 'no algorithm'}", "",
             f"Command: `{command}`  ",
             f"Setting: {cfg.model} on {cfg.task}, a training pool of {cfg.train_size}, {cfg.steps} steps of "
             f"{cfg.prompts_per_step} prompts x {cfg.group_size} completions, {cfg.max_new_tokens} new tokens, "
             f"T = {cfg.temperature}; every other option is the algorithm file's default.  ",
             f"Machine: {'; '.join(ran_on) if cfg.report_only else machine()}.  ",
             f"Time: {hours[0]:.1f} h in the runs' processes, {hours[1]:.1f} h in the harness's evaluations.", "",
             f"Gains over the start model in points: after − before on the same {cfg.eval_size} held-out problems "
             f"for every algorithm, mean ± std over seeds. One number has a standard error of {noise[0]:.1f} points at "
             f"p = 0.3 ({noise[1]:.1f} at p = 0.5); a gain, paired on the same problems, somewhat less. {how} "
             "Train time: the runs' step times summed "
             "(sampling, scoring, update; evaluation excluded). Rollouts and tokens: per run, mean over seeds. "
             "EAPO's cost leaves out its prior (the GRPO run of its seed).", ""]
    lines += table(cfg, results, before) + ["", "## The papers' claims and ours", ""] + claims(cfg, results, before)
    if png:
        lines += ["", f"![held-out accuracy against rollouts and time]({png.name})"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ main

def parse_list(text: str, option: str, cast) -> list:
    try:
        items = [cast(v) for v in text.split(",") if v.strip()]
    except ValueError:
        items = []
    check(len(items) > 0, option, "a comma-separated list, e.g. 0,1,2" if cast is int else "e.g. grpo,xrpo")
    return items


def run_all(cfg: Config, present: list[str], seeds: list[int]):
    """--jobs > 1: make every run first, up to cfg.jobs at once (EAPO's after the GRPO runs, its priors)."""
    from concurrent.futures import ThreadPoolExecutor

    first = [(a, s) for s in seeds for a in present if a != "eapo"]
    first += [("grpo", s) for s in seeds if "eapo" in present and "grpo" not in present]
    for wave in (first, [("eapo", s) for s in seeds if "eapo" in present]):
        with ThreadPoolExecutor(cfg.jobs) as pool:
            list(pool.map(lambda job: ensure_run(cfg, *job, log=True), wave))


def eval_all(cfg: Config, present: list[str], seeds: list[int]):
    """--jobs > 1: the evaluations collect() needs (each seed's start model, every finished run), up to cfg.jobs at
    once, each in its own process; collect() then reads them from their caches."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    todo = []
    for seed in seeds:
        runs = [Path(cfg.runs_dir) / run_name(cfg, a, seed) for a in present]
        runs = [r for r in runs if checkpoint_step(r) == cfg.steps]
        if runs:
            todo.append((Path(cfg.runs_dir) / f"{cfg.prefix}-start" / f"s{seed}.json", cfg.model, seed, 0))
        todo += [(r / "compare_eval.json", checkpoint.find(r / "checkpoint"), seed, cfg.steps) for r in runs]
    if todo:
        with ProcessPoolExecutor(cfg.jobs, mp_context=get_context("spawn")) as pool:
            list(pool.map(cached_eval, [cfg] * len(todo), *zip(*todo)))


def from_runs(cfg: Config, present: list[str], seeds: list[int]):
    """--report-only: results and start accuracies from the runs' own greedy evaluations, nothing run."""
    results, before = {}, {}
    for seed in seeds:
        for algo in present:
            run_dir = Path(cfg.runs_dir) / run_name(cfg, algo, seed)
            if not (run_dir / "compare.json").is_file():
                print(f"skip {run_dir}: not a run of this harness")
                continue
            made_with = json.loads((run_dir / "compare.json").read_text())["setting"]
            check(made_with == setting(cfg), "runs_dir", f"runs made with this setting: {run_dir} differs in "
                  f"{', '.join(k for k, v in made_with.items() if setting(cfg).get(k) != v)}")
            summary = run_summary(cfg, algo, seed)
            curve = summary["curve"]
            if not curve or curve[0][0] != 0 or curve[-1][0] != cfg.steps:
                print(f"skip {run_dir}: no evaluation at step 0 and step {cfg.steps} (not finished?)")
                continue
            # every algorithm of a seed starts from the same model on the same problems: one start accuracy
            check(before.setdefault(seed, {"eval/greedy_acc": curve[0][3]})["eval/greedy_acc"] == curve[0][3],
                  "runs_dir", f"runs of one seed that start from the same accuracy ({run_dir} does not)")
            results.setdefault(algo, {})[seed] = {"eval": {"eval/greedy_acc": curve[-1][3]}, "summary": summary}
    return results, before


def cached_harness_evals(cfg: Config, present: list[str], seeds: list[int]) -> list[str]:
    """--report-only: the harness's own evaluations that exist in the runs folder (a run whose final evaluation
    and its seed's start evaluation are both cached), as after − before in points; [] if there are none."""
    names = ("eval/greedy_acc", "eval/pass@1", "eval/pass@4", "eval/pass@8", f"eval/maj@{cfg.eval_samples}")
    rows, size = [], None
    for seed in seeds:
        start_file = Path(cfg.runs_dir) / f"{cfg.prefix}-start" / f"s{seed}.json"
        for algo in present:
            after_file = Path(cfg.runs_dir) / run_name(cfg, algo, seed) / "compare_eval.json"
            if not (start_file.is_file() and after_file.is_file()):
                continue
            start, after = (json.loads(f.read_text()) for f in (start_file, after_file))
            size = after["key"]["eval_size"]
            gains = [f"{100 * (after['eval'][k] - start['eval'][k]):+.1f}" if k in after["eval"] else "-" for k in names]
            rows.append(f"| {algo} | {seed} | " + " | ".join(gains) + " |")
    if not rows:
        return []
    return (["", f"## The harness's own evaluations that finished ({size} problems, {cfg.eval_samples} samples)", "",
             "| algorithm | seed | " + " | ".join(f"Δ {k.removeprefix('eval/')}" for k in names) + " |",
             "|---" * (len(names) + 2) + "|"] + rows)


def collect(cfg: Config, present: list[str], seeds: list[int]):
    """Every run made or reused, every evaluation made or read from its cache. Returns results[algo][seed] (the
    final evaluation and the run's summary), before[seed] (the start model's evaluation), done[(algo, seed)] (did the
    run finish) and eval_s[...] (seconds each evaluation took)."""
    results, before, done, eval_s = {}, {}, {}, {}
    for seed in seeds:
        for algo in present:
            if algo == "eapo":  # its prior first: the GRPO run of the same seed
                if done.get(("grpo", seed)) is None:
                    done["grpo", seed] = ensure_run(cfg, "grpo", seed)
                if not done["grpo", seed]:
                    print(f"skip eapo seed {seed}: its prior, the GRPO run, did not finish")
                    continue
            if done.get((algo, seed)) is None:
                done[algo, seed] = ensure_run(cfg, algo, seed)
            if not done[algo, seed]:
                continue
            run_dir = Path(cfg.runs_dir) / run_name(cfg, algo, seed)
            if seed not in before:  # the start model, once per seed: the same for every algorithm
                start = cached_eval(cfg, Path(cfg.runs_dir) / f"{cfg.prefix}-start" / f"s{seed}.json", cfg.model, seed, 0)
                before[seed], eval_s["start", seed] = start["eval"], start["eval_s"]
            after = cached_eval(cfg, run_dir / "compare_eval.json", checkpoint.find(run_dir / "checkpoint"), seed,
                                cfg.steps)
            eval_s[algo, seed] = after["eval_s"]
            results.setdefault(algo, {})[seed] = {"eval": after["eval"], "summary": run_summary(cfg, algo, seed)}
    return results, before, done, eval_s


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse(Config, argv)
    algos, seeds = parse_list(cfg.algos, "algos", str), parse_list(cfg.seeds, "seeds", int)
    check(set(algos) <= set(ALGOS), "algos", f"names among {','.join(ALGOS)} (got {cfg.algos})")
    for name in ("steps", "jobs", "train_size", "prompts_per_step", "eval_size", "curve_every", "curve_size"):
        check(getattr(cfg, name) > 0, name, "a positive integer")
    check(cfg.group_size >= 2 and cfg.eval_samples >= 1, "group_size/eval_samples", "group_size >= 2 and samples >= 1")
    present = [a for a in algos if (REPO / f"{a}.py").is_file()]
    for a in algos:
        if a not in present:
            print(f"skip {a}: {REPO / f'{a}.py'} does not exist (not written yet)")
    if "eapo" in present and not (REPO / "grpo.py").is_file():
        print("skip eapo: its prior is a grpo.py run, and grpo.py does not exist")
        present.remove("eapo")
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    harness_evals = []
    if cfg.report_only:
        harness_evals = cached_harness_evals(cfg, present, seeds)
        cfg.eval_samples, cfg.eval_size = 0, cfg.curve_size  # the table's numbers are the runs' own evaluations
        (results, before), done, eval_s = from_runs(cfg, present, seeds), {}, {}
    else:
        try:
            if cfg.jobs > 1:
                run_all(cfg, present, seeds)
                eval_all(cfg, present, seeds)
            results, before, done, eval_s = collect(cfg, present, seeds)
        except KeyboardInterrupt:
            sys.stderr.write("interrupted: rerun the same command to continue (finished runs are reused, a stopped "
                             "one resumes from its last checkpoint)\n")
            sys.exit(130)
    results = {a: results[a] for a in present if a in results}  # table order = --algos order
    run_s = sum(results[a][s]["summary"]["wall_s"] for a in results for s in results[a])
    text = report(cfg, shlex.join(["python", "bench/compare.py", *argv]), results, before,
                  (run_s / 3600, sum(eval_s.values()) / 3600)) + "\n".join(harness_evals + [""] * bool(harness_evals))
    Path(cfg.out).write_text(text)
    print("\n" + text + f"wrote {cfg.out}")
    failed = [f"{a}-s{s}" for (a, s), ok in done.items() if not ok]
    if failed:
        raise RunError(f"runs that did not finish: {', '.join(failed)} (left out of the table; rerun to resume them)")


if __name__ == "__main__":
    main_guard(main)
