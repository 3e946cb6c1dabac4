"""bench/default_run.py on a tiny model: EAPO's two commands (its prior made first), the tables, --run again."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-size", "3",
        "--train-size", "8", "--micro-batch", "4", "--dtype", "float32", "--device", "cpu"]



def load_default_run():
    """bench/default_run.py as a module (bench/ is not a package), for its table functions."""
    spec = importlib.util.spec_from_file_location("default_run", REPO / "bench" / "default_run.py")
    default_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(default_run)
    return default_run

def bench(tmp_path, *args):
    r = subprocess.run([sys.executable, str(REPO / "bench" / "default_run.py"), *args], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_eapo_pipeline_then_summary_again(tmp_path, tiny_model_dir, monkeypatch):
    out = bench(tmp_path, "--algo", "eapo", "--seeds", "0", "--jobs", "2", "--", "--model", str(tiny_model_dir), *TINY,
                "--decay-steps", "0")  # so that bench/same_run.py's --decay-steps 0 repeats the step below
    runs = sorted((tmp_path / "runs").glob("bench-*-s0-*[0-9]"))
    assert [r.name.split("-")[1] for r in runs] == ["eapo", "grpo"]  # the prior was made first, by grpo.py
    assert f"--prior {Path('runs') / runs[1].name / 'checkpoint'}" in out  # ... and eapo.py was given it
    assert "| eapo/lambda at steps 1, 1, 1 |" in out and "| greedy accuracy, step 0 -> step 1 |" in out
    again = bench(tmp_path, "--run", *map(str, runs), str(runs[0]) + ".log")  # a glob's .log files are skipped
    assert again.count("| greedy accuracy, step 0 -> step 1 |") == 2
    assert "| eapo | 0 |" in again and "| grpo | 0 |" in again  # the overview, one row per run
    # --held-out on the run's own problems (3) gives the run's own evaluations at step 0 and at its last step
    rows = [json.loads(line) for line in (runs[1] / "metrics.jsonl").read_text().splitlines()]
    accs = [r["eval/greedy_acc"] for r in rows if "eval/greedy_acc" in r]
    held = bench(tmp_path, "--run", str(runs[1]), "--held-out", "3")
    assert f"| greedy accuracy on 3 held-out problems, start -> checkpoint | {accs[0]:.3f} -> {accs[-1]:.3f}" in held
    # runs that start from one model (eapo.py's and its prior's) evaluate it once: three evaluations for two runs
    import common.evaluate
    calls, real = [], common.evaluate.evaluate
    monkeypatch.setattr(common.evaluate, "evaluate", lambda *a, **k: calls.append(1) or real(*a, **k))
    start_acc = {}
    both = [load_default_run().reevaluate(run, 3, start_acc) for run in runs]
    assert len(calls) == 3 and both[0][0] == both[1][0] == accs[0], (calls, both)
    # bench/same_run.py --algo eapo: π_RL's grpo.py run again in full, then eapo.py's step on its checkpoint, both equal
    r = subprocess.run([sys.executable, str(REPO / "bench" / "same_run.py"), str(tmp_path / "runs"), "--algo", "eapo",
                        "--steps", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    table = {line.split(" | ")[0]: line.split(" | ") for line in r.stdout.splitlines() if line.startswith("| ")}
    assert set(table) >= {"| grpo (π_RL)", "| eapo"}, r.stdout
    assert all(table[k][3].strip() == "0" and int(table[k][2]) > 10 for k in ("| grpo (π_RL)", "| eapo")), r.stdout


def test_bench_grpo_is_default_run_for_grpo(tmp_path, tiny_model_dir):
    """bench/grpo.py: grpo.py's runs, seeds 0 1 2 unless --seeds is given; other algorithms are refused."""
    r = subprocess.run([sys.executable, str(REPO / "bench" / "grpo.py"), "--seeds", "3", "--", "--model",
                        str(tiny_model_dir), *TINY], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert [p.name.split("-")[1:3] for p in (tmp_path / "runs").glob("bench-*[0-9]")] == [["grpo", "s3"]]
    assert "| greedy accuracy, step 0 -> step 1 |" in r.stdout
    r = subprocess.run([sys.executable, str(REPO / "bench" / "grpo.py"), "--algo", "xrpo"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--algo" in r.stderr, r.stderr


def test_bad_algo_and_missing_run_are_one_line_errors(tmp_path):
    for args, field in ((["--algo", "ppo"], "--algo"), (["--run", str(tmp_path / "nope")], "--run")):
        r = subprocess.run([sys.executable, str(REPO / "bench" / "default_run.py"), *args], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and field in r.stderr, r.stderr


def test_phase_memory_and_mechanisms_answer_help():
    """Their own command lines (not argparse): --help prints the docstring and exits 0 (before: a usage error)."""
    for script in ("phase_memory.py", "mechanisms.py"):
        r = subprocess.run([sys.executable, str(REPO / "bench" / script), "--help"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and f"python bench/{script}" in r.stdout and not r.stderr, (script, r)


def test_one_at_a_time_runs_each_seed_side_by_side(tmp_path, tiny_model_dir):
    """--jobs 1: seed by seed, grpo.py first, each other file right after it (EAPO takes that run as its prior), and
    the overview gives each run's wall time as a ratio to grpo.py's run of the same seed."""
    out = bench(tmp_path, "--algo", "eapo,grpo", "--seeds", "1", "0", "--", "--model", str(tiny_model_dir), *TINY)
    started = [line.split("--seed ")[1].split()[0] + " " + line.split()[1].split("/")[-1]
               for line in out.splitlines() if line.startswith("run:")]
    assert started == ["1 grpo.py", "1 eapo.py", "0 grpo.py", "0 eapo.py"], started
    rows = [line for line in out.splitlines() if line.startswith("| grpo | ") or line.startswith("| eapo | ")]
    grpo_rows = [r for r in rows if r.startswith("| grpo | 1 |") or r.startswith("| grpo | 0 |")]
    assert len(grpo_rows) == 2 and all(" | 1.00 | " in r for r in grpo_rows), rows
    assert "CPU flags:" in out and "| gain, lowest | gain - grpo.py's, paired: mean ± s.e. | wall / grpo, mean (highest) |" in out
    # the summary over seeds: eapo's lowest gain is the lower of its two runs' gains, its highest peak the higher
    for seed in ("1", "0"):  # the trained- and sampled-tokens columns: the run's sums, their ratios to grpo.py's
        row = next(r for r in rows if r.startswith(f"| eapo | {seed} |"))
        cells = []
        for key in ("perf/train_fwd_tokens", "perf/sampled_tokens"):
            tokens = {a: sum(json.loads(line).get(key, 0) for line in
                             next((tmp_path / "runs").glob(f"bench-{a}-s{seed}-*[0-9]")).joinpath("metrics.jsonl")
                             .read_text().splitlines()) for a in ("grpo", "eapo")}
            ratio = f" ({tokens['eapo'] / tokens['grpo']:.2f})" if tokens["eapo"] and tokens["grpo"] else ""
            cells.append(f"{tokens['eapo']:.0f}{ratio}")
        assert f"| {cells[0]} | {cells[1]} |" in row, (row, cells)
    # each run keeps what was measured of it (bench.json): --run later prints the same rows, wall time, its ratio,
    # peak RSS and matmul rates included, and the CPU flags they were made with
    again = bench(tmp_path, "--run", *map(str, sorted((tmp_path / "runs").glob("bench-*[0-9]"))))
    assert sorted(r for r in again.splitlines() if r.startswith(("| grpo | ", "| eapo | "))) == sorted(rows)
    assert "CPU flags (recorded with the runs): " in again and "(4 of the 4 runs recorded them)" in again
    starts = tuple(f"| {a} | {s} |" for a in ("grpo", "eapo") for s in "01")
    run_rows = [r[:12] for r in again.splitlines() if r.startswith(starts)]
    assert run_rows == ["| grpo | 0 |", "| eapo | 0 |", "| grpo | 1 |", "| eapo | 1 |"]  # seed by seed, grpo first


def test_a_failed_run_keeps_the_others_table(tmp_path, tiny_model_dir):
    """One run failing (xrpo.py refuses --group-size 2 below its 4 base rollouts) does not lose the finished runs'
    table: grpo.py's row is printed, the exit is non-zero and its last line names the failed run. Fails on the old
    behaviour, where the first failure exited before any table."""
    r = subprocess.run([sys.executable, str(REPO / "bench" / "default_run.py"), "--algo", "grpo,xrpo", "--seeds", "0",
                        "--", "--model", str(tiny_model_dir), *TINY], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode != 0
    assert "| grpo | 0 | " in r.stdout and "| xrpo | 0 | " not in r.stdout, r.stdout[-2000:]
    assert r.stderr.strip().splitlines()[-1].endswith("1 run(s) failed: xrpo.py seed 0 (their errors above)")


def test_phase_memory_reports_each_phase(tmp_path, tiny_model_dir):
    """bench/phase_memory.py: RSS before and after every sampling call, update and evaluation of a 1-step run, the
    peak never below the current RSS; an unknown algorithm is a one-line error."""
    r = subprocess.run([sys.executable, str(REPO / "bench" / "phase_memory.py"), "grpo", "--", "--model",
                        str(tiny_model_dir), *TINY], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith(("before ", "after "))]
    assert [line.split(":")[0] for line in lines] == ["before evaluate", "after evaluate", "before generate",
                                                      "after generate", "before update", "after update",
                                                      "before evaluate", "after evaluate"], lines
    for line in lines:
        v = line.split(": ")[1].split()
        values = dict(zip(v[::2], map(float, v[1::2])))
        assert 0 < values["VmRSS"] <= values["VmHWM"] and values["RssAnon"] > 0, line
    bad = subprocess.run([sys.executable, str(REPO / "bench" / "phase_memory.py"), "ppo"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "algorithm" in bad.stderr


def test_phase_memory_joint_samples_eapos_step_in_one_call(tmp_path, tiny_model_dir):
    """bench/phase_memory.py eapo --joint: the injecting step samples in one call (eapo.py's GPU path) where the CPU
    default makes two (augmented, then ordinary); after τ's calibration call, 1 sampling call against 2. --joint
    with another file is a one-line error. Catches a flag that does not reach PriorWeights.apart."""
    def calls(*flags):
        options = ["--model", str(tiny_model_dir), "--prior", str(tiny_model_dir), "--run-name", "pm" + "".join(flags)]
        r = subprocess.run([sys.executable, str(REPO / "bench" / "phase_memory.py"), "eapo", *flags, "--", *options,
                            *TINY], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.count("before generate:")

    assert (calls(), calls("--joint")) == (3, 2)
    bad = subprocess.run([sys.executable, str(REPO / "bench" / "phase_memory.py"), "grpo", "--joint"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--joint" in bad.stderr


def test_mechanisms_sums_each_files_own_metrics(tmp_path):
    """bench/mechanisms.py: one line per variant run from its metrics (sums over steps, first step of replay, λ's
    last step), none for grpo.py; no run folder is a one-line error. Catches a line that reads one step only."""
    steps = {"exgrpo": [{"exgrpo/replay_share": 0.0, "exgrpo/retired": 0},
                        {"exgrpo/replay_share": 0.5, "exgrpo/retired": 3}],
             "xrpo": [{"xrpo/rollouts_min": 4, "xrpo/rollouts_max": 12, "xrpo/seeded_prompts": 2,
                       "xrpo/icl_rollouts": 9, "xrpo/bonus_given": 1}] * 2,
             "extra": [{"extra/bonus_share": 0.0, "extra/prefixes_stored": 2, "extra/guided_rows": 0},
                       {"extra/bonus_share": 0.25, "extra/prefixes_stored": 1, "extra/guided_rows": 1}],
             "eapo": [{"eapo/injected_ratio": 0.05, "eapo/lambda": 1.0},
                      {"eapo/injected_ratio": 0.0, "eapo/lambda": 0.0}],
             "grpo": [{}, {}]}
    for algo, rows in steps.items():
        run = tmp_path / f"bench-{algo}-s0-1"
        (tmp_path / f"cmp-{algo}-s3").mkdir()  # bench/compare.py's name for the same run
        run.mkdir()
        lines = [{"step": 0, "eval/greedy_acc": 0.2}]
        lines += [{"step": i + 1, "perf/step_s": 1.0, **r} for i, r in enumerate(rows)]
        for folder in (run, tmp_path / f"cmp-{algo}-s3"):
            (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    folders = sorted(map(str, tmp_path.glob("bench-*")))
    r = subprocess.run([sys.executable, str(REPO / "bench" / "mechanisms.py"), *folders], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = dict(line.split(": ", 1) for line in r.stdout.splitlines())
    assert out == {
        "bench-eapo-s0-1": "π_RL decided 5.0% of the augmented tokens at step 1; λ 1.00 at step 1, 0 from step 2",
        "bench-exgrpo-s0-1": "replay from step 2, up to 50% of the batch; 3 questions retired",
        "bench-extra-s0-1": "novelty bonus at 1 of 2 steps (up to 25% of the correct answers); 3 prefixes stored, "
                            "1 guided prompts (a prompt and a stored prefix)",
        "bench-xrpo-s0-1": "4-12 rollouts a prompt; 4 prompts seeded with exemplars (18 rollouts); novelty bonus on 2 "
                           "correct rollouts"}, out
    r = subprocess.run([sys.executable, str(REPO / "bench" / "mechanisms.py"), *sorted(map(str, tmp_path.glob("cmp-*")))],
                       capture_output=True, text=True, timeout=60)
    assert dict(line.split(": ", 1) for line in r.stdout.splitlines()) == {
        k.replace("bench-", "cmp-").replace("-s0-1", "-s3"): v for k, v in out.items()}, r.stdout
    r = subprocess.run([sys.executable, str(REPO / "bench" / "mechanisms.py"), str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "metrics.jsonl" in r.stderr


def test_overview_scales_the_wall_ratio_by_the_matmul_rates(capsys):
    """The ratio at grpo.py's matmul rate: a run on a machine that became 1.5x slower, and took 1.5x as long,
    did grpo.py's work; a run without its probes gets no adjusted ratio."""
    default_run = load_default_run()

    def run(wall, gflops):
        return {"wall_s": wall, "gflops": gflops, "acc_before": 0.25, "acc_after": 0.4, "peak_rss_gb": 2.5,
                "step_split": {"sample": 1.0, "score": 0.0, "train": 1.0}, "train_tokens": 10, "sampled_tokens": 20}
    default_run.overview([("grpo", 0, run(400.0, (300.0, 300.0))), ("xrpo", 0, run(600.0, (180.0, 220.0))),
                          ("extra", 0, run(480.0, None))], "CPU flags: test")
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and " | 0 | " in line}
    assert rows["xrpo"][5:7] == ["1.50", "1.00"]  # 600 / 400, times 200 / 300
    assert rows["extra"][5:7] == ["1.20", "-"] and rows["grpo"][5:7] == ["1.00", "1.00"]
    # two grpo.py runs of a seed: the ratios are to the last one given, and the output says so
    default_run.overview([("grpo", 0, run(400.0, None)), ("grpo", 0, run(500.0, None)), ("xrpo", 0, run(600.0, None))],
                         "CPU flags: test")
    out = capsys.readouterr().out
    assert "seed 0: 2 grpo.py runs; the ratios below are to the one made beside each run, else to the last one given" in out
    assert [line.split(" | ")[5] for line in out.splitlines() if line.startswith("| xrpo | 0 |")] == ["1.20"]


def fake_run(folder, label, seed, after, wall, flags="avx2", trained=100):
    """A finished run's folder as bench/default_run.py --run reads it: folder/bench-<label>-s<seed>-<time>/ with one
    step's metrics, held-out accuracy 0.25 -> after, and its bench.json (wall time, peak RSS, CPU flags)."""
    run = folder / f"bench-{label}-s{seed}-20261130-000000"
    run.mkdir(parents=True)
    step = {"step": 1, "perf/step_s": 10.0, "perf/sample_s": 4.0, "perf/score_s": 1.0, "perf/train_s": 5.0,
            "reward/mean": 0.5, "perf/train_fwd_tokens": trained, "perf/sampled_tokens": 100}
    rows = [{"step": 0, "eval/greedy_acc": 0.25}, step, {"step": 1, "eval/greedy_acc": after}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "bench.json").write_text(json.dumps({"wall_s": wall, "peak_rss_gb": 2.5, "cpu_flags": flags}))
    return run


def test_run_takes_each_ratio_to_the_grpo_run_made_beside_it(tmp_path):
    """--run over folders of two sessions: each run's wall ratio and token ratio are to the grpo.py run of its seed
    in its own folder, read from there when it is not given; not to the last grpo.py run given."""
    def fake(folder, algo, wall, trained, flags="avx2"):
        return fake_run(tmp_path / folder, algo, 0, 0.4, wall, flags, trained)
    old_grpo, old_xrpo = fake("a", "grpo", 400.0, 1000), fake("a", "xrpo", 600.0, 1500)
    fake("b", "grpo", 500.0, 2000)
    new_xrpo = fake("b", "xrpo", 550.0, 3000, flags="amx_bf16 avx2")  # another machine: each folder pairs its own
    out = bench(tmp_path, "--run", str(old_grpo), str(old_xrpo), str(new_xrpo))
    assert "CPU flags (recorded with the runs): avx2 (2 runs); amx_bf16 avx2 (1 run) (3 of the 3 runs" in out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| xrpo | 0 | ") and " -> " in line]
    assert [(r[5], r[9]) for r in rows] == [("1.50", "1500 (1.50)"), ("1.10", "3000 (1.50)")], rows
    summary = next(line for line in out.splitlines() if line.startswith("| xrpo | 2 (1 seed) | "))
    assert "| 1.30 (1.50) |" in summary, summary
    assert "| grpo | 1 | " in out  # the grpo.py run read from b/ for its ratios is not a row of its own


def test_run_without_grpo_beside_takes_the_same_cpus_grpo_run(tmp_path):
    """--run, a folder with no grpo.py run of the seed (say, one file rerun after a fix): its ratios and its paired
    gain are to the grpo.py run of the seed that recorded the same CPU flags, not to another processor's run that
    happens to be given last."""
    def fake(folder, algo, wall, after, flags):
        return fake_run(tmp_path / folder, algo, 0, after, wall, flags)
    rerun = fake("c", "extra", 600.0, 0.45, "amx_bf16 avx2")
    same, other = fake("b", "grpo", 500.0, 0.40, "amx_bf16 avx2"), fake("a", "grpo", 400.0, 0.30, "avx2")
    out = bench(tmp_path, "--run", str(rerun), str(same), str(other))
    row = next(line.split(" | ") for line in out.splitlines() if line.startswith("| extra | 0 | "))
    assert row[5] == "1.20", row  # 600 / 500, not 600 / 400
    summary = next(line for line in out.splitlines() if line.startswith("| extra | 1 | "))
    assert "| +5.0: undecided |" in summary, summary  # +20 against +15, not against +5


def test_run_pairs_with_another_label_under_base(tmp_path):
    """--run --base LABEL: every run pairs with the run of its seed labelled LABEL (in its own folder, else the one
    given), not with grpo.py's: eapo.py beside its own control runs (nothing injected). A label no folder has is a
    one-line error."""
    def fake(folder, label, seed, after, wall):
        return fake_run(tmp_path / folder, label, seed, after, wall)
    runs = [fake("a", "grpo", 0, 0.45, 400.0), fake("a", "eapo", 0, 0.35, 500.0), fake("a", "grpo", 1, 0.40, 400.0),
            fake("a", "eapo", 1, 0.45, 600.0), fake("b", "eapo_tau100", 0, 0.40, 450.0)]
    fake("a", "eapo_tau100", 1, 0.30, 480.0)  # not given: read from beside eapo.py's seed-1 run
    out = bench(tmp_path, "--run", *map(str, runs), "--base", "eapo_tau100")
    rows = {(r[0][2:], r[1]): r for r in (line.split(" | ") for line in out.splitlines() if " -> " in line)}
    # seed 0: 500 / 450 against the control given; seed 1: 600 / 480 against the one beside it; grpo.py's too
    assert rows["eapo", "0"][5] == "1.11" and rows["eapo", "1"][5] == "1.25" and rows["grpo", "0"][5] == "0.89", rows
    summary = next(line for line in out.splitlines() if line.startswith("| eapo | 2 | "))
    assert "| +5.0 ± 10.0: undecided |" in summary, summary  # +10 - +15 = -5 and +20 - +5 = +15
    assert "| grpo | 2 | +17.5 ± 3.5 | +15.0 | +7.5 ± 2.5: supported |" in out  # grpo.py too pairs with the control
    assert "gain - eapo_tau100's, paired" in out and "paired verdicts (better than eapo_tau100's gain)" in out
    out = bench(tmp_path, "--run", *map(str, runs))  # the default base: grpo.py's, as before
    assert "| eapo | 2 | " in out and "| -2.5 ± 7.5: undecided |" in out, out  # -10 and +5
    r = subprocess.run([sys.executable, str(REPO / "bench" / "default_run.py"), "--run", str(runs[1]),
                        "--base", "eapo_t"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--base" in r.stderr, r.stderr


def test_summary_gives_each_files_mean_and_worst_run(capsys):
    """The table over seeds: the mean gain and the lowest, the gain minus grpo.py's of the same seed (mean ± s.e.,
    with compare.py's verdict), the mean wall ratio and the highest, the highest peak RSS (a goal holds for every
    run, so the worst one is shown beside the mean)."""
    default_run = load_default_run()

    def run(after, wall, rss):
        return {"wall_s": wall, "gflops": None, "acc_before": 0.25, "acc_after": after, "peak_rss_gb": rss,
                "step_split": {"sample": 1.0, "score": 0.0, "train": 1.0}, "train_tokens": 10, "sampled_tokens": 20}
    default_run.overview([("grpo", 0, run(0.40, 400.0, 2.5)), ("xrpo", 0, run(0.45, 600.0, 2.6)),
                          ("extra", 0, run(0.50, 400.0, 2.5)), ("eapo", 0, run(0.30, 400.0, 2.5)),
                          ("grpo", 1, run(0.35, 500.0, 2.5)), ("xrpo", 1, run(0.30, 550.0, 2.8)),
                          ("extra", 1, run(0.40, 500.0, 2.5)), ("eapo", 1, run(0.25, 500.0, 2.5))], "CPU flags: test")
    out = capsys.readouterr().out
    summary = {line.split(" | ")[0][2:]: line for line in out.splitlines() if line.startswith("| ") and " | 2 | " in line}
    # gains +20 and +5: mean +12.5, std 10.6, lowest +5; against grpo.py's +15 and +10: +5 and -5, mean 0 ± 5.0;
    # wall ratios 1.50 and 1.10: mean 1.30, highest 1.50
    assert summary["xrpo"] == (f"| xrpo | 2 | +12.5 ± 10.6 | +5.0 | +0.0 ± 5.0: undecided | 1.30 (1.50) | - | "
                               f"{2.8 * 2 ** 30 / 1e9:.2f} x 10^9 B |"), summary
    # +25 and +15 against +15 and +10: +10 and +5, 7.5 ± 2.5, beyond 2 s.e.; +5 and 0: -10 both times
    assert "| +7.5 ± 2.5: supported |" in summary["extra"] and "| -10.0 ± 0.0: contradicted |" in summary["eapo"]
    assert "| grpo | 2 | +12.5 ± 3.5 | +10.0 | - |" in summary["grpo"]
    assert "paired verdicts (better than grpo.py's gain) — supported: the mean paired difference" in out

def test_summary_counts_a_seed_run_twice_once(capsys):
    """A seed run more than once (grpo.py beside each file's run; a run repeated on another CPU) is one sample of
    the statistics over seeds, its runs' mean, gain and paired difference alike (before: each run counted, so the
    README's command printed grpo.py's +17.0 ± 2.0 over 8 runs for +16.8 ± 2.3 over its 3 seeds)."""
    default_run = load_default_run()

    def run(after):
        return {"wall_s": 400.0, "gflops": None, "acc_before": 0.25, "acc_after": after, "peak_rss_gb": 2.5,
                "step_split": {"sample": 1.0, "score": 0.0, "train": 1.0}, "train_tokens": 10, "sampled_tokens": 20}
    default_run.overview([("grpo", 0, run(0.40)), ("grpo", 0, run(0.40)), ("xrpo", 0, run(0.45)),
                          ("xrpo", 0, run(0.35)), ("grpo", 1, run(0.35)), ("xrpo", 1, run(0.30))], "CPU flags: test")
    out = capsys.readouterr().out
    # grpo.py: +15 (twice) and +10 -> +12.5 ± 3.5, not +13.3 ± 2.9
    assert "| grpo | 3 (2 seeds) | +12.5 ± 3.5 | +10.0 | - |" in out, out
    # xrpo.py: seed 0's +20 and +10 -> +15, seed 1 +5 -> +10.0 ± 7.1, lowest +5; paired 0 and -5 -> -2.5 ± 2.5
    assert "| xrpo | 3 (2 seeds) | +10.0 ± 7.1 | +5.0 | -2.5 ± 2.5: undecided |" in out, out


def test_work_table_holds_each_file_to_grpos_token_counts(capsys):
    """Time per unit of work: a file that samples at 2x grpo.py's cost per token and trains at 1.1x, with 10 s of
    scoring, would take (0.2 x 1000 + 10 + 0.11 x 2000) / 300 = 1.43x grpo.py's steps at grpo.py's token counts,
    however many tokens it sampled and trained itself. A run that logged no phase times gets no row."""
    default_run = load_default_run()

    def run(sample, score, train, sampled, trained, phases=True):
        r = {"wall_s": 500.0, "gflops": None, "acc_before": 0.25, "acc_after": 0.4, "peak_rss_gb": 2.5, "steps": 15,
             "step_split": {"sample": sample / 15, "score": score / 15, "train": train / 15},
             "train_tokens": trained, "sampled_tokens": sampled}
        return {**r, "phase_s": {"sample": sample, "score": score, "train": train}} if phases else r
    default_run.overview([("grpo", 0, run(100.0, 0.0, 200.0, 1000, 2000)),
                          ("xrpo", 0, run(300.0, 10.0, 330.0, 1500, 3000)),
                          ("extra", 0, run(100.0, 0.0, 100.0, 1000, 1000, phases=False))], "CPU flags: test")
    out = capsys.readouterr().out
    work = out[out.index("| sampling, ms per sampled token"):].split("\n\n")[0].splitlines()[2:]
    assert work == ["| grpo | 0 | 100.0 (1.00) | 0.0 | 100.0 (1.00) | 1.00 |",
                    "| xrpo | 0 | 200.0 (2.00) | 0.7 | 110.0 (1.10) | 1.43 |"], work


def test_same_run_repeats_a_committed_run_and_names_a_differing_value(tmp_path, tiny_model_dir):
    """bench/same_run.py: the first step of a default_run.py run again, equal in every metric but perf/; a value
    changed in the committed metrics.jsonl is reported and the exit code is 1."""
    bench(tmp_path, "--algo", "grpo", "--seeds", "0", "--", "--model", str(tiny_model_dir), *TINY[2:], "--steps", "2",
          "--decay-steps", "0", "--temperature", "1.0")
    folder = tmp_path / "runs"

    def same_run():
        return subprocess.run([sys.executable, str(REPO / "bench" / "same_run.py"), str(folder), "--algo", "grpo",
                               "--steps", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})

    r = subprocess.run([sys.executable, str(REPO / "bench" / "same_run.py"), str(tmp_path / "nowhere")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "nowhere: expected a folder" in r.stderr, r.stderr
    r = same_run()
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    row = next(line for line in r.stdout.splitlines() if line.startswith("| grpo |"))
    assert row.split("|")[4].strip() == "0" and int(row.split("|")[3]) > 10, row
    before = tmp_path / "before"
    shutil.copytree(folder, before)
    metrics = next(folder.glob("bench-grpo-s0-*")) / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    step1 = next(r for r in lines if r["step"] == 1 and "reward/mean" in r)
    step1["reward/mean"] += 0.5
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    r = same_run()
    assert r.returncode == 1 and "step 1: reward/mean" in r.stdout, r.stdout
    # --against: the runs of two folders compared as they are, every step (2 here), nothing run again
    for against, code in ((before, 0), (folder, 1)):
        r = subprocess.run([sys.executable, str(REPO / "bench" / "same_run.py"), str(before), "--against", str(against)],
                           cwd=tmp_path, capture_output=True, text=True, timeout=60)
        row = next(line for line in r.stdout.splitlines() if line.startswith("| grpo |"))
        assert r.returncode == code and "running:" not in r.stdout and f"against {against.name}/bench-grpo-s0-" in row
        assert ("step 1: reward/mean" in row) == bool(code) and int(row.split("|")[3]) > 20, r.stdout


def test_unreadable_metrics_are_one_line_errors(tmp_path):
    """--run and bench/mechanisms.py on a torn or empty metrics.jsonl: one line naming it, exit 2 (a traceback
    before: JSONDecodeError, IndexError)."""
    for name, text in (("torn", '{"step": 0, "eval/greedy_acc": 0.2}\n{"step": 1, "rew'), ("empty", "\n")):
        run = tmp_path / f"bench-grpo-s0-{name}"
        run.mkdir()
        (run / "metrics.jsonl").write_text(text)
        for script in (["default_run.py", "--run"], ["mechanisms.py"]):
            r = subprocess.run([sys.executable, str(REPO / "bench" / script[0]), *script[1:], str(run)],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 2 and r.stderr.count("\n") == 1 and "metrics.jsonl" in r.stderr, (script, r.stderr)
