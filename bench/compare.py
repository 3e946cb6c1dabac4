"""The five algorithms compared where their mechanisms have room to act, paired by seed, with a verdict per claim.

    python bench/compare.py                                   # 5 algorithms x 5 seeds x 15 steps (2 CPU cores: ~6 h)
    python bench/compare.py --device cuda --jobs 16 --save-every 15 --eval-samples 16   # one GPU (H100: 11.5 min)
    python bench/compare.py --algos grpo,xrpo --seeds 0,1 --steps 5                      # a narrower comparison
    python bench/compare.py --report-only --runs-dir bench/results/compare-h100-2026-11-27 --eval-samples 16

The setting (docs/comparison.md says why): SmolLM2-135M-Instruct on the generated arithmetic task (levels 1-3), whose
start model solves none of 8 samples of most of its questions within the 48-token budget, trained from a pool of 64
questions, so that in 15 steps of 16 prompts every question comes back about four times (ExGRPO's buffer, XRPO's ICL
corpus and ExTra's novelty memory act on questions that return). Every algorithm gets the same model, pool, B x G
rollouts per step (XRPO: its base rollouts plus its rounds add up to the same), steps and seeds; every other option
is the algorithm file's own default. EAPO's prior pi_RL is the GRPO run of the same seed (15 steps that learned: the
table shows by how much), so EAPO starts once that run is done.

Every run is its own process, started with the command line a user would type (printed), from the current folder,
in runs/<prefix>-<algo>-s<seed>. It evaluates itself greedily on --curve-size held-out problems every --curve-every
steps (the curves). The harness then evaluates, each in its own process: the start model once on the held-out
problems and once per seed on that seed's training pool, and every run's final checkpoint on both. Held-out: greedy
accuracy, pass@k from --eval-samples samples, distinct correct answers per problem. Pool: each question's correct
count in --pool-samples samples, so the questions the start model never solved are known and the final model's solve
rate on them is measured. Every evaluation is cached as JSON in its run folder (per-problem counts included), so the
report can be made again from committed results without a checkpoint.

The report (--out, with a PNG beside it) gives each algorithm's gains over the start model, then for each paper's
claim the quantity it should move, measured per seed against GRPO's run of the same seed (or within the run, for
EAPO's augmented responses): mean +- standard error over seeds, and a verdict by the rule in VERDICT_RULE.

--jobs N runs N processes at once (runs first, longest first, then evaluations as their runs finish); on a GPU a
135M model leaves the device mostly idle, so all runs share it. Stop it at any time: the same command continues
(finished runs and cached evaluations are reused, a stopped run resumes from its last checkpoint). The estimated time
of what is left is printed before anything starts. Disk: every run keeps its checkpoint (1.6 GB for SmolLM2 with
its optimizer state: 25 runs take about 40 GB); the plot needs matplotlib.
"""
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import checkpoint, dist  # noqa: E402
from common.config import RunError, check, main_guard, parse  # noqa: E402

ALGOS = ("grpo", "exgrpo", "xrpo", "extra", "eapo")
VERDICT_RULE = ("supported: the mean paired difference lies in the claimed direction by more than 2 standard errors "
                "(s.e. = std over seeds / sqrt(seeds)); contradicted: more than 2 s.e. the other way; undecided: "
                "within 2 s.e. (or a single seed)")


@dataclass
class Config:
    algos: str = "grpo,exgrpo,xrpo,extra,eapo"  # comma-separated; one whose file is missing is skipped with a message
    seeds: str = "0,1,2,3,4"  # comma-separated seeds; every algorithm runs once per seed, paired with GRPO's
    steps: int = 15  # training steps of every run
    prefix: str = "cmp"  # runs are runs/<prefix>-<algo>-s<seed>; another prefix keeps another setting apart
    # the shared setting
    model: str = "smollm2"  # Hugging Face folder or smollm2 (the CPU default)
    task: str = "arith"  # levels 1-3: the start model solves 0 of 8 samples of ~60% of the questions (see the docs)
    train_size: int = 64  # the training pool: 15 steps x 16 prompts see each question about four times
    prompts_per_step: int = 16  # B: prompts per step (the algorithm files' default)
    group_size: int = 8  # G: B x G rollouts per step for every algorithm (XRPO: on average per prompt)
    max_new_tokens: int = 48  # completion budget in tokens, in training and evaluation (the files' default)
    temperature: float = 0.8  # sampling temperature, in training and for pass@k (the files' default)
    device: str = "auto"  # auto, cpu or cuda (runs and evaluation)
    jobs: int = 1  # processes at once; with more than 1 each one's output goes to runs/<its name>.log
    dtype: str = "auto"  # auto, float32 or bfloat16 (runs and evaluation)
    # evaluation
    eval_size: int = 500  # held-out problems (the same for every seed): one accuracy near 0.3 carries ±2.0 points
    eval_samples: int = 4  # sampled completions per held-out problem: pass@1..pass@k, distinct correct answers
    pool_samples: int = 8  # sampled completions per training-pool question: which ones the start model never solves
    curve_every: int = 3  # the runs' own greedy evaluation (and checkpoint) every N steps: the curves
    curve_size: int = 200  # held-out problems of the runs' own evaluation (the first of the --eval-size ones)
    # a stopped run resumes from its last checkpoint; on a GPU, where a run takes minutes, --save-every = --steps
    # writes each run's 1.6 GB (SmolLM2 with its optimizer state) once
    save_every: int = 3
    # output
    out: str = "bench/COMPARE.md"  # the report; the plot goes beside it with the suffix .png
    runs_dir: str = "runs"  # where the runs are: made in runs/ of the current folder; another folder for --report-only
    report_only: bool = False  # nothing run or evaluated: the report from the runs and evaluations already there

    choices = {"device": ["auto", "cpu", "cuda"], "dtype": ["auto", "float32", "bfloat16"]}


def shared_options(cfg: Config, seed: int) -> list[str]:
    """The options every algorithm gets: one setting, one seed."""
    return ["--seed", str(seed), "--steps", str(cfg.steps), "--model", cfg.model, "--task", cfg.task,
            "--train-size", str(cfg.train_size), "--prompts-per-step", str(cfg.prompts_per_step),
            "--group-size", str(cfg.group_size), "--max-new-tokens", str(cfg.max_new_tokens),
            "--eval-max-new-tokens", str(cfg.max_new_tokens), "--temperature", str(cfg.temperature),
            "--device", cfg.device, "--dtype", cfg.dtype, "--eval-size", str(cfg.curve_size), "--eval-samples", "0",
            "--eval-every", str(cfg.curve_every), "--save-every", str(cfg.save_every)]


def own_options(cfg: Config, algo: str, seed: int) -> list[str]:
    """What one algorithm needs beyond the shared setting."""
    if algo == "xrpo":  # n_base rollouts per prompt, the rest of B x G planned by priority
        # our choice: n_base = G / 2, xrpo.py's default ratio (4 of 8), so other --group-size values keep it; the
        # paper's 2 rounds and 2 exemplars (xrpo.py's CPU defaults: 1 and 1), as the comparison judges its recipe
        return ["--base-rollouts", str(max(2, cfg.group_size // 2)), "--rounds", "2", "--icl-shots", "2"]
    if algo == "eapo":  # our choice: pi_RL is the GRPO run of the same seed, the cheapest earlier RL run there is
        return ["--prior", str(Path(cfg.runs_dir) / run_name(cfg, "grpo", seed) / "checkpoint")]
    return []


def run_name(cfg: Config, algo: str, seed: int) -> str:
    return f"{cfg.prefix}-{algo}-s{seed}"


def setting(cfg: Config) -> dict:
    """What a reused run must have been made with (all but --steps, which a resumed run may extend)."""
    keep = ("model", "task", "train_size", "prompts_per_step", "group_size", "max_new_tokens", "temperature",
            "dtype", "curve_size", "curve_every")
    return {k: getattr(cfg, k) for k in keep}


def ks(samples: int) -> list[int]:
    """The k of pass@k reported from n samples: 1, 2, 4, ... up to n."""
    return [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= samples]


# ------------------------------------------------------------------------------------------------ runs

def checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run's newest complete checkpoint, or None."""
    import torch

    ckpt = checkpoint.find(run_dir / "checkpoint")
    if ckpt is None:
        return None
    # mmap: read the step without pulling the optimizer state into memory
    return int(torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=False, mmap=True)["step"])


def run_state(cfg: Config, run_dir: Path) -> int | None:
    """The run's checkpoint step after checking that it was made with this setting (None: not started)."""
    info_file = run_dir / "compare.json"
    if run_dir.exists() and any(run_dir.iterdir()):
        check(info_file.is_file(), "prefix", f"a prefix whose runs this harness made: {run_dir} is not one of them")
        made_with = json.loads(info_file.read_text())["setting"]
        check(made_with == setting(cfg), "prefix", f"another prefix: {run_dir} was made with another setting "
              f"({', '.join(f'{k}={v}' for k, v in made_with.items() if setting(cfg).get(k) != v)})")
    step = checkpoint_step(run_dir)
    check(step is None or step <= cfg.steps, "steps", f"at least {step}: {run_dir} ran that far (or another --prefix)")
    return step


def child_env(cfg: Config) -> dict:
    """Side by side, each process gets its share of the CPU threads (on a GPU, one thread each is plenty)."""
    env = dict(os.environ)
    if cfg.jobs > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cfg.jobs))
    return env


def ensure_run(cfg: Config, algo: str, seed: int) -> bool:
    """Run (or resume) one algorithm for one seed unless its checkpoint is already at the last step. True if done."""
    name = run_name(cfg, algo, seed)
    run_dir = Path(cfg.runs_dir) / name
    step = run_state(cfg, run_dir)
    if step == cfg.steps:
        print(f"reuse {name}: finished at step {step}", flush=True)
        return True
    if step is None and run_dir.exists():  # stopped before its first checkpoint: nothing to resume from
        shutil.rmtree(run_dir)
    script = REPO / f"{algo}.py"
    script = script.relative_to(Path.cwd()) if script.is_relative_to(Path.cwd()) else script
    cmd = ["python", str(script), "--run-name", name, *shared_options(cfg, seed), *own_options(cfg, algo, seed)]
    cmd += ["--resume"] if step else []
    print(("resume: " if step else "run: ") + " ".join(cmd), flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    info_file = run_dir / "compare.json"
    info = json.loads(info_file.read_text()) if info_file.is_file() else {"wall_s": 0.0}
    info.update(setting=setting(cfg), command=cmd, machine=machine())
    info_file.write_text(json.dumps(info, indent=1))
    t0 = time.time()
    rc = child([sys.executable, *cmd[1:]], cfg, Path(cfg.runs_dir) / f"{name}.log")
    info["wall_s"] += time.time() - t0  # the process, its own evaluations included, summed over resumes
    info_file.write_text(json.dumps(info, indent=1))
    if rc != 0:
        print(f"{name}: exited with {rc}; left out of the report (rerun the harness to resume it)", flush=True)
    return rc == 0 and checkpoint_step(run_dir) == cfg.steps


def child(cmd: list[str], cfg: Config, log: Path) -> int:
    """Run a process: its output to the console (one job) or to `log` (several at once)."""
    if cfg.jobs == 1:
        return subprocess.run(cmd, env=child_env(cfg)).returncode
    log.parent.mkdir(parents=True, exist_ok=True)  # an evaluation can start before any run has made runs/
    with open(log, "a") as out:
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env(cfg)).returncode


# ------------------------------------------------------------------------------------------------ evaluation

def held_out_problems(cfg: Config):
    from common.tasks import load_task

    # the runs' own evaluation draws its held-out set with seed 0 for every seed: the same problems (its first
    # --curve-size), so the curves and this evaluation score the same questions (greedy answers can still differ
    # by a few problems between the two: they decode in batches of different sizes)
    return load_task(cfg.task, "test", n=cfg.eval_size, seed=0)[: cfg.eval_size]


def pool_problems(cfg: Config, seed: int):
    from common.tasks import load_task

    return load_task(cfg.task, "train", n=cfg.train_size, seed=seed)  # as the algorithm files draw their pool


def sample_counts(model, tok, problems, n, cfg, seed, batch) -> tuple[list[int], list[int]]:
    """Per problem: how many of n samples are correct, and how many distinct correct completions there are (the
    text with whitespace collapsed: two samples that differ only in spacing are one solution)."""
    from common.sampler import generate
    from common.tasks import format_question
    from common.verifier import score

    correct, distinct = [], []
    for i in range(0, len(problems), batch):
        chunk = problems[i:i + batch]
        groups = generate(model, [tok.prompt(format_question(p)) for p in chunk], n=n, temperature=cfg.temperature,
                          max_new_tokens=cfg.max_new_tokens, stop_ids=tok.stop_ids, seed=seed * 1_000_003 + i)
        for group, p in zip(groups, chunk):
            texts = [" ".join(tok.decode(s.tokens, skip_special=True).split()) for s in group]
            right = [t for t in texts if score(t, p.answer)]
            correct.append(len(right))
            distinct.append(len(set(right)))
    return correct, distinct


def evaluate_model(cfg: Config, model_dir, seed: int, held_out: bool) -> dict:
    """One model: on the seed's training pool (--pool-samples samples per question) and, if held_out, on the held-out
    problems (greedy, then --eval-samples samples each). Per-problem counts, so any rate can be computed later."""
    import torch

    from common.model import Transformer, compute_dtype
    from common.sampler import generate
    from common.tasks import format_question
    from common.tokenizer import Tokenizer
    from common.verifier import score

    device = torch.device(dist.resolve_device(cfg.device))
    dtype = compute_dtype(device, cfg.dtype)
    tok = Tokenizer.from_pretrained(model_dir)
    model = Transformer.from_pretrained(model_dir, device=device).to(dtype).eval()  # as the runs' rollout copy
    # completions per generate call: the KV cache stays near 1 GB (on a GPU shared by many processes too)
    rows = 512 if device.type == "cuda" else 256
    out = {}
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        pool = pool_problems(cfg, seed)
        out["pool_correct"], _ = sample_counts(model, tok, pool, cfg.pool_samples, cfg, seed,
                                               max(1, rows // cfg.pool_samples))
        if held_out:
            problems = held_out_problems(cfg)
            greedy = []
            for i in range(0, len(problems), rows):
                chunk = problems[i:i + rows]
                outs = generate(model, [tok.prompt(format_question(p)) for p in chunk], n=1, temperature=0.0,
                                max_new_tokens=cfg.max_new_tokens, stop_ids=tok.stop_ids)
                greedy += [int(score(tok.decode(g[0].tokens, skip_special=True), p.answer))
                           for g, p in zip(outs, chunk)]
            out["greedy"] = greedy
            out["correct"], out["distinct"] = sample_counts(model, tok, problems, cfg.eval_samples, cfg, seed,
                                                            max(1, rows // cfg.eval_samples))
    return out


def eval_key(cfg: Config, seed: int, step: int, held_out: bool) -> dict:
    return {"model": cfg.model, "task": cfg.task, "step": step, "seed": seed, "held_out": held_out,
            "eval_size": cfg.eval_size if held_out else 0, "eval_samples": cfg.eval_samples if held_out else 0,
            "train_size": cfg.train_size, "pool_samples": cfg.pool_samples, "temperature": cfg.temperature,
            "max_new_tokens": cfg.max_new_tokens, "dtype": cfg.dtype}


def eval_file(cfg: Config, algo: str | None, seed: int) -> Path:
    """Where an evaluation is cached: the start model's per seed in runs/<prefix>-start, a run's in its folder."""
    if algo is None:
        return Path(cfg.runs_dir) / f"{cfg.prefix}-start" / f"s{seed}.json"
    return Path(cfg.runs_dir) / run_name(cfg, algo, seed) / "compare_eval.json"


def cached(cfg: Config, algo: str | None, seed: int) -> dict | None:
    """A cached evaluation made with this setting, or None."""
    path = eval_file(cfg, algo, seed)
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    want = eval_key(cfg, seed, 0 if algo is None else cfg.steps, algo is not None or seed == first_seed(cfg))
    return saved if saved["key"] == want else None


def first_seed(cfg: Config) -> int:
    return int(cfg.seeds.split(",")[0])


def ensure_eval(cfg: Config, algo: str | None, seed: int) -> bool:
    """Evaluate the start model (algo None) or a run's final checkpoint, in a process of its own, unless cached.
    The start model is evaluated on the held-out problems once (with the first seed): greedy answers and samples
    of one model on one problem set; on the training pool once per seed (each seed draws its own pool)."""
    if cached(cfg, algo, seed) is not None:
        return True
    what = "the start model" if algo is None else run_name(cfg, algo, seed)
    print(f"evaluate {what} (seed {seed})", flush=True)
    job = {"config": asdict(cfg), "algo": algo, "seed": seed}
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from bench.compare import eval_job; "
            "eval_job(json.loads(sys.argv[2]))")
    log = Path(cfg.runs_dir) / f"{cfg.prefix}-eval-{algo or 'start'}-s{seed}.log"
    rc = child([sys.executable, "-c", code, str(REPO), json.dumps(job)], cfg, log)
    if rc != 0:
        print(f"evaluating {what} (seed {seed}) exited with {rc}", flush=True)
    return rc == 0 and cached(cfg, algo, seed) is not None


def eval_job(job: dict):
    """The body of one evaluation process (see ensure_eval): evaluate and write the cache atomically."""
    cfg = Config(**job["config"])
    algo, seed = job["algo"], job["seed"]
    held_out = algo is not None or seed == first_seed(cfg)
    run_dir = Path(cfg.runs_dir) / run_name(cfg, algo, seed) if algo else None
    model_dir = cfg.model if algo is None else checkpoint.find(run_dir / "checkpoint")
    t0 = time.time()
    saved = {"key": eval_key(cfg, seed, 0 if algo is None else cfg.steps, held_out),
             "eval": evaluate_model(cfg, model_dir, seed, held_out), "eval_s": time.time() - t0}
    path = eval_file(cfg, algo, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(saved))
    tmp.replace(path)


# ------------------------------------------------------------------------------------------------ the plan

def plan(cfg: Config, present: list[str], seeds: list[int]) -> dict:
    """Every job: key -> (dependencies, function). Runs first, the longest first; then evaluations, each after its
    run. EAPO's run waits for the GRPO run of its seed (its prior)."""
    jobs = {}
    order = sorted(present, key=lambda a: -COST[a])
    for algo in order:
        for seed in seeds:
            deps = [("run", "grpo", seed)] if algo == "eapo" else []
            jobs["run", algo, seed] = (deps, lambda a=algo, s=seed: ensure_run(cfg, a, s))
            if algo == "eapo" and "grpo" not in present:
                jobs["run", "grpo", seed] = ([], lambda s=seed: ensure_run(cfg, "grpo", s))
    for seed in seeds:
        jobs["eval", None, seed] = ([], lambda s=seed: ensure_eval(cfg, None, s))
        for algo in order:
            jobs["eval", algo, seed] = ([("run", algo, seed)], lambda a=algo, s=seed: ensure_eval(cfg, a, s))
    return jobs


def execute(cfg: Config, jobs: dict) -> dict:
    """Run the jobs, up to cfg.jobs at once, each as soon as its dependencies are done; a job whose dependency failed
    is skipped. Returns key -> True (done) / False (failed or skipped)."""
    done, running, pending = {}, {}, list(jobs)
    with ThreadPoolExecutor(cfg.jobs) as pool:
        while pending or running:
            for key in list(pending):
                deps = jobs[key][0]
                if any(done.get(d) is False for d in deps):
                    print(f"skip {key[0]} {key[1] or 'start'} seed {key[2]}: {deps} did not finish", flush=True)
                    done[key] = False
                    pending.remove(key)
                elif len(running) < cfg.jobs and all(done.get(d) for d in deps):
                    running[pool.submit(jobs[key][1])] = key
                    pending.remove(key)
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                key = running.pop(future)
                try:
                    done[key] = bool(future.result())
                except Exception:  # e.g. a run made with another setting: stop, with its one-line message
                    for f in running:
                        f.cancel()
                    raise
    return done


# rough cost of a run relative to GRPO's (the default runs side by side on a CPU, docs/benchmarks.md), to start the
# longest first and to estimate the time left
COST = {"grpo": 1.0, "exgrpo": 1.3, "xrpo": 1.5, "extra": 1.2, "eapo": 1.6}
# measured: a GRPO step of the default setting takes ~28 s on 2 CPU cores at ~190 GFLOP/s of fp32 matmul, and a sampled
# completion ~0.09 s there; on an H200 with 20 processes sharing it (and 16 CPU cores), ~14 s a step and ~0.012 s a
# completion (docs/comparison.md)
CPU_STEP_S, CPU_SAMPLE_S, CPU_GFLOPS, GPU_STEP_S, GPU_SAMPLE_S = 28.0, 0.09, 190.0, 14.0, 0.012


def estimate(cfg: Config, jobs: dict) -> str:
    """The time the jobs left will take, from the measured rates above (on a CPU scaled by this machine's matmul
    rate now)."""
    from bench.default_run import matmul_gflops

    gpu = dist.resolve_device(cfg.device) == "cuda"
    rate = 0.0 if gpu else matmul_gflops()
    scale = 1.0 if gpu else CPU_GFLOPS / max(rate, 1.0)
    step_s, sample_s = (GPU_STEP_S, GPU_SAMPLE_S) if gpu else (CPU_STEP_S * scale, CPU_SAMPLE_S * scale)
    curve = (cfg.steps // cfg.curve_every + 1) * cfg.curve_size * sample_s  # the runs' own greedy evaluations
    run_s, eval_s = {}, 0.0  # run_s[(algo, seed)]: the seconds left of that run
    for kind, algo, seed in jobs:
        if kind == "run" and not run_finished(cfg, algo, seed):
            step = checkpoint_step(Path(cfg.runs_dir) / run_name(cfg, algo, seed)) or 0
            run_s[algo, seed] = COST[algo] * step_s * (cfg.steps - step) + curve
        elif kind == "eval" and cached(cfg, algo, seed) is None:
            held = algo is not None or seed == first_seed(cfg)
            eval_s += sample_s * (cfg.train_size * cfg.pool_samples + held * cfg.eval_size * (cfg.eval_samples + 1))
    n_evals = sum(1 for kind, algo, seed in jobs if kind == "eval" and cached(cfg, algo, seed) is None)
    if gpu:  # all at once: the longest chain of runs (EAPO after its GRPO run), then the evaluations side by side
        chains = [s + (run_s.get(("grpo", seed), 0.0) if algo == "eapo" else 0.0) for (algo, seed), s in run_s.items()]
        total = max(chains, default=0.0) + eval_s / cfg.jobs
    else:  # a CPU's cores are shared: processes side by side take as long as one after the other
        total = sum(run_s.values()) + eval_s
    when = f"{total / 3600:.1f} h" if total >= 3600 else f"{total / 60:.0f} min"
    return (f"left: {len(run_s)} runs, {n_evals} evaluations; estimated {when} "
            f"({'one GPU, all at once' if gpu else f'{rate:.0f} GFLOP/s fp32 matmul now'})")


def run_finished(cfg: Config, algo: str, seed: int) -> bool:
    return checkpoint_step(Path(cfg.runs_dir) / run_name(cfg, algo, seed)) == cfg.steps


# ------------------------------------------------------------------------------------------------ reading results

def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run_summary(cfg: Config, algo: str, seed: int) -> dict:
    """A finished run's cost, curves and mechanism metrics, from its metrics.jsonl. rollouts: completions sampled
    (ExGRPO's replayed trajectories are in its batch but were not sampled this step: left out)."""
    run_dir = Path(cfg.runs_dir) / run_name(cfg, algo, seed)
    rows = read_rows(run_dir)
    per_step = cfg.prompts_per_step * cfg.group_size
    rollouts = tok_sampled = tok_trained = train_s = 0.0
    curve, entropy, varied, aug = [], [], [], []  # curve: (step, rollouts so far, training s so far, greedy accuracy)
    for r in rows:
        if "perf/step_s" in r:
            replayed = round(r.get("exgrpo/replay_share", 0.0) * cfg.prompts_per_step)
            rollouts += per_step - replayed  # a replayed question's buffer trajectory takes one rollout's place
            tok_sampled += r["perf/sampled_tokens"]
            tok_trained += r["perf/train_tok_s"] * r["perf/train_s"]  # = tokens through the loss, all epochs
            train_s += r["perf/step_s"]
            if r.get("policy/entropy") is not None:  # null on a step that trained no token
                entropy.append((r["step"], r["policy/entropy"]))
            if "reward/varied_rollouts" in r:
                varied.append(r["reward/varied_rollouts"])
            if r.get("eapo/injected_ratio", 0.0) > 0 and "eapo/acc_augmented" in r:
                aug.append((r["step"], r["eapo/acc_augmented"] - r["eapo/acc_ordinary"]))
        if "eval/greedy_acc" in r:
            curve.append((r["step"], rollouts, train_s, r["eval/greedy_acc"]))
    lam = [r["step"] - 1 for r in rows if r.get("eapo/lambda") == 0.0]  # T: λ_k = 0 from k = T, i.e. step T + 1
    info = json.loads((run_dir / "compare.json").read_text())
    late = [e for s, e in entropy if s > cfg.steps * 2 / 3]  # the last third of the steps
    early = [d for s, d in aug if s <= cfg.steps / 2]  # the first half, where the prior leads (EAPO §3)
    return {"rollouts": rollouts, "tok_sampled": tok_sampled, "tok_trained": tok_trained, "train_s": train_s,
            "wall_s": info["wall_s"], "curve": curve, "entropy": entropy, "machine": info.get("machine"),
            "entropy_late": statistics.fmean(late) if late else None,
            "varied": statistics.fmean(varied) if varied else None,
            "aug_minus_ord": statistics.fmean(early) if early else None, "anneal_end": lam[0] if lam else None}


def quantities(cfg: Config, ev: dict, start_pool: list[int]) -> dict:
    """The numbers of one final evaluation: accuracies on the held-out problems, and the solve rate on the pool
    questions the start model never solved."""
    from common.passk import pass_at_k

    n, out = cfg.eval_samples, {"greedy": statistics.fmean(ev["greedy"])}
    for k in ks(n):
        out[f"pass@{k}"] = statistics.fmean(pass_at_k(n, c, k) for c in ev["correct"])
    out["gap"] = out[f"pass@{ks(n)[-1]}"] - out["pass@1"]
    out["distinct"] = statistics.fmean(ev["distinct"])
    never = [i for i, c in enumerate(start_pool) if c == 0]
    out["never_solved"] = (statistics.fmean(ev["pool_correct"][i] / cfg.pool_samples for i in never)
                           if never else None)
    return out


def collect(cfg: Config, present: list[str], seeds: list[int]):
    """results[algo][seed] = {"q": quantities, "summary": run_summary} for every finished and evaluated run;
    start = the start model's quantities on the held-out problems; pools[seed] = its never-solved share."""
    results, pools = {}, {}
    start_eval = cached(cfg, None, first_seed(cfg))
    start = quantities(cfg, start_eval["eval"], start_eval["eval"]["pool_correct"]) if start_eval else None
    for seed in seeds:
        start_seed = cached(cfg, None, seed)
        if start_seed is None:
            continue
        pool = start_seed["eval"]["pool_correct"]
        pools[seed] = sum(c == 0 for c in pool) / len(pool)
        for algo in present:
            run_dir = Path(cfg.runs_dir) / run_name(cfg, algo, seed)
            final = cached(cfg, algo, seed)
            if final is None or not (run_dir / "metrics.jsonl").is_file():
                continue
            results.setdefault(algo, {})[seed] = {"q": quantities(cfg, final["eval"], pool),
                                                  "summary": run_summary(cfg, algo, seed),
                                                  "eval_s": final["eval_s"]}
    return results, start, pools


# ------------------------------------------------------------------------------------------------ statistics

def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (nan for one value)."""
    m = statistics.fmean(xs)
    return m, statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")


def verdict(xs: list[float] | None, unit: str = "") -> tuple[str, str]:
    """(mean ± s.e. text, verdict) for paired differences whose claimed direction is positive; see VERDICT_RULE."""
    if not xs:
        return "not measured", "not measured"
    m, se = mean_se(xs)
    digits = 2 if abs(m) < 1 else 1
    unit = f" {unit}" if unit else ""
    if math.isnan(se):
        return f"{m:+.{digits}f}{unit} (one seed)", "undecided"
    text = f"{m:+.{digits}f} ± {se:.{digits}f}{unit} ({len(xs)} seeds)"
    return text, "supported" if m > 2 * se else "contradicted" if m < -2 * se else "undecided"


def steps_to(curve: list[tuple], target: float, censor: float) -> float:
    """The first step at which a (step, ..., accuracy) curve reaches target, linearly interpolated; `censor` if
    never (the run did not get there within its steps)."""
    pts = [(c[0], c[-1]) for c in curve]
    for (s0, a0), (s1, a1) in zip(pts, pts[1:]):
        if a1 >= target:
            return s0 if a0 >= target else s0 + (target - a0) / (a1 - a0) * (s1 - s0)
    return pts[0][0] if pts and pts[0][1] >= target else censor


def paired(results: dict, algo: str, value) -> list[float] | None:
    """Per seed both have: value(algo's run) − value(GRPO's run of the same seed)."""
    if algo not in results or "grpo" not in results:
        return None
    seeds = sorted(set(results[algo]) & set(results["grpo"]))
    diffs = [value(results[algo][s], results["grpo"][s]) for s in seeds]
    diffs = [d for d in diffs if d is not None]
    return diffs or None


def q_diff(key: str, scale: float = 100.0):
    def diff(a, g):
        return None if a["q"][key] is None or g["q"][key] is None else scale * (a["q"][key] - g["q"][key])
    return diff


def s_diff(key: str, scale: float = 1.0):
    def diff(a, g):
        x, y = a["summary"][key], g["summary"][key]
        return None if x is None or y is None else scale * (x - y)
    return diff


def steps_saved(cfg: Config):
    """GRPO's steps to its own final greedy accuracy minus the algorithm's steps to that same accuracy (per seed)."""
    def diff(a, g):
        target = g["summary"]["curve"][-1][-1]
        if target <= g["summary"]["curve"][0][-1]:
            return None  # GRPO did not improve on this seed: nothing to reach
        censor = cfg.steps + cfg.curve_every
        return steps_to(g["summary"]["curve"], target, censor) - steps_to(a["summary"]["curve"], target, censor)
    return diff


PAPER_ALGO = {"ExGRPO (arXiv 2510.02245)": "exgrpo", "XRPO (arXiv 2510.06672)": "xrpo",
              "ExTra (arXiv 2606.24994)": "extra", "EAPO (arXiv 2606.30420)": "eapo"}


def claims(cfg: Config, results: dict) -> list[tuple]:
    """(paper, its claim, what we measure, unit, per-seed values) for every claim; values are paired differences
    to GRPO's run of the same seed, except EAPO's augmented-vs-ordinary, which is within its own run."""
    top = f"pass@{ks(cfg.eval_samples)[-1]}"
    exgrpo, xrpo, extra, eapo = list(PAPER_ALGO)  # the papers' names, in ALGOS order
    ends = {r["summary"]["anneal_end"] for r in results.get("eapo", {}).values()}
    eapo_T = (f"one annealing length, T = {ends.pop()} steps" if len(ends) == 1 and None not in ends
              else f"annealing not finished within {cfg.steps} steps")
    eapo_own = [100 * r["summary"]["aug_minus_ord"] for r in results.get("eapo", {}).values()
                if r["summary"]["aug_minus_ord"] is not None] or None  # within EAPO's own runs
    return [
        (exgrpo, "above on-policy RLVR: +3.5 pts in-distribution average (Qwen2.5-Math-7B, Table 1)",
         "held-out pass@1", "pts", paired(results, "exgrpo", q_diff("pass@1"))),
        (exgrpo, "replaying partly solved questions puts more of each batch where rewards vary (§3.1)",
         "share of trained rollouts in groups with reward variance", "pts",
         paired(results, "exgrpo", s_diff("varied", 100))),
        (exgrpo, "keeps policy entropy from collapsing while it exploits low-entropy experience (§4.4, Fig. 8)",
         "policy entropy over the last third of the steps", "nats", paired(results, "exgrpo", s_diff("entropy_late"))),
        (xrpo, "reaches GRPO's accuracy in fewer steps (2.4-2.7x fewer, 1.5B models, §4.2)",
         "steps GRPO needs to reach its final greedy accuracy minus the steps XRPO needs", "steps",
         paired(results, "xrpo", steps_saved(cfg))),
        (xrpo, "allocation spends rollouts where rewards vary (§3.2)",
         "share of trained rollouts in groups with reward variance", "pts",
         paired(results, "xrpo", s_diff("varied", 100))),
        (xrpo, "ICL seeding breaks through questions the model cannot solve (§3.3)",
         "pass@1 on the pool questions the start model never solved", "pts",
         paired(results, "xrpo", q_diff("never_solved"))),
        (xrpo, "higher pass@1 and pass@k than GRPO (Table 6: +1.1 pass@1, +2.5 pass@4)", "held-out pass@1", "pts",
         paired(results, "xrpo", q_diff("pass@1"))),
        (xrpo, "", f"held-out {top}", "pts", paired(results, "xrpo", q_diff(top))),
        (extra, "+5 pts pass@1 and +7 pts pass@16 over GRPO (Qwen3-1.7B, six math benchmarks)", "held-out pass@1",
         "pts", paired(results, "extra", q_diff("pass@1"))),
        (extra, "", f"held-out {top} (our largest k)", "pts", paired(results, "extra", q_diff(top))),
        (extra, "the novelty bonus keeps distinct correct solutions (§3)", "distinct correct answers per problem",
         "", paired(results, "extra", q_diff("distinct", 1.0))),
        (extra, "exploration widens the gap between pass@k and pass@1", f"{top} − pass@1", "pts",
         paired(results, "extra", q_diff("gap"))),
        (extra, "regeneration from high-entropy prefixes turns unsolved prompts into signal (§3)",
         "pass@1 on the pool questions the start model never solved", "pts",
         paired(results, "extra", q_diff("never_solved"))),
        (eapo, "above the same-recipe on-policy run for every annealing length T (Qwen2.5-Math-7B, Qwen3-8B; no "
         "numbers public)", f"held-out pass@1 ({eapo_T})", "pts", paired(results, "eapo", q_diff("pass@1"))),
        (eapo, "augmented responses are more accurate than ordinary ones early in training",
         "rollout accuracy, augmented − ordinary, first half of the steps (within its own run)", "pts", eapo_own),
    ]


# ------------------------------------------------------------------------------------------------ report

def count(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def gains_table(cfg: Config, results: dict, start: dict | None) -> list[str]:
    """Each algorithm's final held-out numbers and gains over the start model (mean ± s.e. over seeds) and cost."""
    keys = ["greedy"] + [f"pass@{k}" for k in ks(cfg.eval_samples)]
    lines = ["| algorithm | seeds | " + " | ".join(f"Δ {k}" for k in keys) + " | distinct correct | never-solved pool "
             "pass@1 | varied rollouts | train time | rollouts | tokens sampled | tokens trained |",
             "|---" * (len(keys) + 9) + "|"]
    for algo, by_seed in results.items():
        seeds = sorted(by_seed)

        def ms(values, digits=1):
            m, se = mean_se(values)
            return f"{m:+.{digits}f}" + ("" if math.isnan(se) else f" ± {se:.{digits}f}")

        gains = [ms([100 * (by_seed[s]["q"][k] - start[k]) for s in seeds]) if start else "-" for k in keys]
        never = [100 * by_seed[s]["q"]["never_solved"] for s in seeds if by_seed[s]["q"]["never_solved"] is not None]
        mean = lambda key: statistics.fmean(by_seed[s]["summary"][key] for s in seeds)  # noqa: E731
        lines.append(f"| {algo} | {len(seeds)} | " + " | ".join(gains)
                     + f" | {statistics.fmean(by_seed[s]['q']['distinct'] for s in seeds):.2f} | "
                     + (f"{statistics.fmean(never):.1f}%" if never else "-")
                     + f" | {100 * mean('varied'):.0f}% | {mean('train_s') / 60:.1f} min | {mean('rollouts'):.0f} | "
                     f"{count(mean('tok_sampled'))} | {count(mean('tok_trained'))} |")
    return lines


def claims_table(cfg: Config, results: dict) -> tuple[list[str], dict]:
    """The claims of the algorithms that ran, each with our value and its verdict; and how many of each verdict."""
    rows = ["| paper | its claim | what we measure | ours (mean ± s.e.) | verdict |", "|---|---|---|---|---|"]
    tally = {}
    for paper, claim, what, unit, values in claims(cfg, results):
        if PAPER_ALGO[paper] not in results:
            continue
        text, word = verdict(values, unit)
        rows.append(f"| {paper if claim else ''} | {claim} | {what} | {text} | **{word}** |")
        tally[word] = tally.get(word, 0) + 1
    return rows, tally


def plot(cfg: Config, results: dict, path: Path):
    """Left: held-out greedy accuracy against rollouts sampled, one line per algorithm (mean over seeds) with a band
    from the lowest to the highest seed. Right: the policy's entropy on its trained tokens, step by step."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for algo in results:
        # per evaluation step, the seeds that have it (a run stopped during its last evaluation lacks that point)
        points = {}
        for s in results[algo]:
            for step, rollouts, _, acc in results[algo][s]["summary"]["curve"]:
                points.setdefault(step, []).append((rollouts, 100 * acc))
        steps = sorted(points)
        x = [statistics.fmean(r for r, _ in points[st]) for st in steps]
        accs = [[a for _, a in points[st]] for st in steps]
        line, = axes[0].plot(x, [statistics.fmean(a) for a in accs], marker="o", label=algo)
        axes[0].fill_between(x, [min(a) for a in accs], [max(a) for a in accs], color=line.get_color(), alpha=0.15)
        ents = {}
        for s in results[algo]:
            for step, e in results[algo][s]["summary"]["entropy"]:
                ents.setdefault(step, []).append(e)
        axes[1].plot(sorted(ents), [statistics.fmean(ents[st]) for st in sorted(ents)], color=line.get_color(),
                     label=algo)
    axes[0].set_xlabel("rollouts sampled")
    axes[0].set_ylabel(f"greedy accuracy, {cfg.curve_size} held-out (%)")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("policy entropy on trained tokens (nats)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{Path(cfg.model).name} on {cfg.task}, pool of {cfg.train_size}: mean over seeds, band = min..max",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return path


def machine() -> str:
    """CPU model, cores and vector units, GPU, torch threads: what the times were measured on."""
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


def report(cfg: Config, command: str, results: dict, start: dict | None, pools: dict, wall: float | None) -> str:
    png = plot(cfg, results, Path(cfg.out).with_suffix(".png")) if results else None
    ran_on = sorted({r["summary"]["machine"] or "not recorded" for by in results.values() for r in by.values()})
    run_h = sum(r["summary"]["wall_s"] for by in results.values() for r in by.values()) / 3600
    eval_h = sum(r["eval_s"] for by in results.values() for r in by.values()) / 3600
    seeds = sorted({s for by in results.values() for s in by})
    lines = [f"# Comparison: {', '.join(results) or 'no algorithm'}", "",
             f"Command: `{command}`  ",
             f"Setting: {cfg.model} on {cfg.task}, a training pool of {cfg.train_size} questions per seed, "
             f"{cfg.steps} steps of {cfg.prompts_per_step} prompts x {cfg.group_size} completions, "
             f"{cfg.max_new_tokens} new tokens, T = {cfg.temperature}, seeds {', '.join(map(str, seeds)) or '-'}; "
             "every other option is the algorithm file's default.  ",
             f"Machine: {'; '.join(ran_on) or '-'}.  ",
             f"Time: {run_h:.1f} h in the runs' processes and {eval_h:.2f} h in the final evaluations, summed over "
             "processes" + (f"; {wall / 60:.1f} min of wall time for this command" if wall else "") + ".", "",
             f"Start model: the pool questions it never solved in {cfg.pool_samples} samples, per seed: "
             + (", ".join(f"{100 * pools[s]:.0f}%" for s in sorted(pools)) or "-")
             + (f"; on the {cfg.eval_size} held-out problems greedy {100 * start['greedy']:.1f}%, "
                f"pass@1 {100 * start['pass@1']:.1f}%, pass@{ks(cfg.eval_samples)[-1]} "
                f"{100 * start[f'pass@{ks(cfg.eval_samples)[-1]}']:.1f}%." if start else "."), "",
             f"## Gains over the start model ({cfg.eval_size} held-out problems, the same for every seed)", "",
             f"Points, mean ± s.e. over seeds; pass@k unbiased from {cfg.eval_samples} samples at T = "
             f"{cfg.temperature}. Distinct correct: different correct completions per problem among the samples. "
             f"Never-solved pool pass@1: the final model on the pool questions its start model solved in none of "
             f"{cfg.pool_samples} samples. Varied rollouts: the share of trained rollouts whose group's rewards "
             "differ (those with a gradient), mean over steps. Train time: the runs' step times summed (evaluation "
             "excluded); rollouts sampled and tokens: per run, mean over seeds (EAPO's leave out its prior).", ""]
    lines += gains_table(cfg, results, start)
    rows, tally = claims_table(cfg, results)
    lines += ["", "## The papers' claims at our scale", "",
              f"Each value: per seed, the variant's run minus GRPO's run of the same seed (EAPO's last row: within its "
              f"own run), then mean ± standard error over seeds. Verdict rule: {VERDICT_RULE}.", ""] + rows
    lines += ["", "Verdicts: " + ", ".join(f"{n} {w}" for w, n in sorted(tally.items())) + "."]
    if png:
        lines += ["", f"![held-out accuracy against rollouts; entropy by step]({png.name})"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ main

def parse_list(text: str, option: str, cast) -> list:
    try:
        items = [cast(v) for v in text.split(",") if v.strip()]
    except ValueError:
        items = []
    check(len(items) > 0, option, "a comma-separated list, e.g. 0,1,2" if cast is int else "e.g. grpo,xrpo")
    return items


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse(Config, argv)
    algos, seeds = parse_list(cfg.algos, "algos", str), parse_list(cfg.seeds, "seeds", int)
    check(set(algos) <= set(ALGOS), "algos", f"names among {','.join(ALGOS)} (got {cfg.algos})")
    for name in ("steps", "jobs", "train_size", "prompts_per_step", "eval_size", "eval_samples", "pool_samples",
                 "curve_every", "curve_size", "save_every"):
        check(getattr(cfg, name) > 0, name, "a positive integer")
    check(cfg.group_size >= 2, "group_size", "at least 2")
    check(cfg.curve_size <= cfg.eval_size, "curve_size", f"at most --eval-size ({cfg.eval_size})")
    # the algorithm files write runs/<run-name> in the current folder: another --runs-dir can only be read
    check(cfg.report_only or Path(cfg.runs_dir).resolve() == Path("runs").resolve(), "runs_dir",
          "runs (the algorithm files write runs/<name> in the current folder); another folder with --report-only")
    present = [a for a in algos if (REPO / f"{a}.py").is_file()]
    for a in algos:
        if a not in present:
            print(f"skip {a}: {REPO / f'{a}.py'} does not exist (not written yet)")
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    t0, failed = time.time(), []
    if not cfg.report_only and present:
        jobs = plan(cfg, present, seeds)
        print(estimate(cfg, jobs), flush=True)
        try:
            done = execute(cfg, jobs)
        except KeyboardInterrupt:
            sys.stderr.write("interrupted: rerun the same command to continue (finished runs and evaluations are "
                             "reused, a stopped run resumes from its last checkpoint)\n")
            sys.exit(130)
        failed = [f"{k[0]} {k[1] or 'start'} s{k[2]}" for k, ok in done.items() if not ok]
    results, start, pools = collect(cfg, present, seeds)
    results = {a: results[a] for a in present if a in results}  # report order = --algos order
    # an empty report would overwrite --out (a committed COMPARE.md) with nothing: refuse it, naming what was looked for
    check(bool(results), "runs_dir", f"finished runs of {', '.join(present) or 'the --algos'} (seeds {cfg.seeds}) in "
          f"{cfg.runs_dir}, made with these options (their names carry --eval-samples and the rest); none found, "
          f"{cfg.out} left as it was")
    text = report(cfg, shlex.join(["python", "bench/compare.py", *argv]), results, start, pools,
                  None if cfg.report_only else time.time() - t0)
    Path(cfg.out).write_text(text)
    print("\n" + text + f"wrote {cfg.out}")
    if failed:
        raise RunError(f"did not finish: {', '.join(failed)} (left out of the report; rerun to continue them)")


if __name__ == "__main__":
    main_guard(main)
