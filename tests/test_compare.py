"""bench/compare.py on a tiny model: two algorithms for one step, the table, the reuse of finished runs."""
import json
from pathlib import Path

import pytest

from bench import compare
from common.config import ConfigError

# a variant that exists (EAPO first: it also exercises the prior made by the GRPO run); else GRPO on two seeds
VARIANT = next((a for a in ("eapo", "xrpo", "exgrpo", "extra") if (compare.REPO / f"{a}.py").is_file()), None)
ALGOS, SEEDS = ("grpo", VARIANT) if VARIANT else ("grpo",), (0,) if VARIANT else (0, 1)


def tiny_argv(model_dir, out="out/table.md"):
    return ["--algos", ",".join(ALGOS), "--seeds", ",".join(map(str, SEEDS)), "--steps", "1", "--model", str(model_dir),
            "--max-new-tokens", "4", "--eval-size", "3", "--eval-samples", "2", "--prompts-per-step", "2",
            "--group-size", "2", "--train-size", "4", "--curve-every", "1", "--curve-size", "3", "--out", out]


def table_row(text: str, algo: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {algo} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def read_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return tmp_path


def test_two_algorithms_one_step_then_reuse(tiny_model_dir, workdir, monkeypatch, capsys):
    compare.main(tiny_argv(tiny_model_dir))
    first = capsys.readouterr().out
    text = (workdir / "out/table.md").read_text()
    for algo in ALGOS:
        seed = SEEDS[0]
        run = workdir / "runs" / f"cmp-{algo}-s{seed}"
        assert f"run: python {compare.REPO / algo}.py --run-name cmp-{algo}-s{seed}" in first  # the user's command
        rows = read_rows(run)
        start = json.loads((workdir / f"runs/cmp-start/s{seed}.json").read_text())["eval"]
        after = json.loads((run / "compare_eval.json").read_text())["eval"]
        # the harness evaluates what the run evaluated itself: same problems, same model, same greedy answers
        assert start["eval/greedy_acc"] == rows[0]["eval/greedy_acc"] and rows[0]["step"] == 0
        assert after["eval/greedy_acc"] == rows[-1]["eval/greedy_acc"] and rows[-1]["step"] == 1
        assert set(after) == {"eval/greedy_acc", "eval/pass@1", "eval/pass@2", "eval/maj@2"}
        cells = table_row(text, algo)
        assert cells[1] == str(len(SEEDS))
        if len(SEEDS) == 1:  # the gain column is after - before, in points
            assert cells[2] == f"{100 * (after['eval/greedy_acc'] - start['eval/greedy_acc']):+.1f}"
        step = next(r for r in rows if "perf/step_s" in r)
        assert cells[-3] == "4"  # rollouts: 1 step x 2 prompts x 2 completions
        assert cells[-2] == f"{step['response/len_mean'] * 4:.0f}"  # tokens sampled: the completions' lengths
        assert cells[-1] == f"{step['perf/train_tok_s'] * step['perf/train_s']:.0f}"
    if VARIANT == "eapo":  # its prior is the GRPO run of its seed
        command = json.loads((workdir / "runs/cmp-eapo-s0/compare.json").read_text())["command"]
        assert command[command.index("--prior") + 1] == str(Path("runs/cmp-grpo-s0/checkpoint"))
    assert "## The papers' claims and ours" in text and "EAPO (arXiv 2606.30420)" in text

    # a second call reuses every run and every evaluation: no process is started, nothing is re-evaluated
    stamps = {p: p.stat().st_mtime_ns for p in (workdir / "runs").rglob("*") if p.is_file()}
    real_run, real_evaluate = compare.subprocess.run, compare.evaluate_model
    monkeypatch.setattr(compare.subprocess, "run", lambda *a, **k: pytest.fail(f"started a process: {a}"))
    monkeypatch.setattr(compare, "evaluate_model", lambda *a, **k: pytest.fail("evaluated again"))
    compare.main(tiny_argv(tiny_model_dir, out="out/again.md"))
    second = capsys.readouterr().out
    assert all(f"reuse cmp-{a}-s{s}: finished at step 1" in second for a in ALGOS for s in SEEDS)
    assert stamps == {p: p.stat().st_mtime_ns for p in (workdir / "runs").rglob("*") if p.is_file() and p in stamps}
    tables = lambda t: [line for line in t.splitlines() if line.startswith("|")]  # noqa: E731
    assert tables((workdir / "out/again.md").read_text()) == tables(text)

    # --report-only: the table from the runs' own greedy evaluations, nothing run or evaluated (still patched)
    compare.main([*tiny_argv(tiny_model_dir), "--report-only", "--out", "out/report.md"])
    report = (workdir / "out/report.md").read_text()
    for algo in ALGOS:
        rows = read_rows(workdir / "runs" / f"cmp-{algo}-s{SEEDS[0]}")
        gain = 100 * (rows[-1]["eval/greedy_acc"] - rows[0]["eval/greedy_acc"])
        assert table_row(report, algo)[2] == (f"{gain:+.1f}" if len(SEEDS) == 1 else table_row(report, algo)[2])
    assert "| algorithm | seeds | Δ greedy | train time |" in report and "pass@k not measured" in report
    # ... and the harness's own cached evaluations, after − before, beside it
    start = json.loads((workdir / f"runs/cmp-start/s{SEEDS[0]}.json").read_text())["eval"]
    after = json.loads((workdir / f"runs/cmp-grpo-s{SEEDS[0]}/compare_eval.json").read_text())["eval"]
    row = table_row(report.split("## The harness's own evaluations that finished")[1], "grpo")
    assert row[2] == f"{100 * (after['eval/greedy_acc'] - start['eval/greedy_acc']):+.1f}"

    # more steps: the finished run is continued from its checkpoint, not started again
    argv = tiny_argv(tiny_model_dir, out="out/longer.md")
    argv[argv.index("--algos") + 1], argv[argv.index("--steps") + 1] = "grpo", "2"
    monkeypatch.setattr(compare.subprocess, "run", real_run)
    monkeypatch.setattr(compare, "evaluate_model", real_evaluate)
    compare.main(argv)
    third = capsys.readouterr().out
    run = workdir / f"runs/cmp-grpo-s{SEEDS[0]}"
    assert f"resume: python {compare.REPO / 'grpo'}.py --run-name cmp-grpo-s{SEEDS[0]}" in third and "--resume" in third
    assert [r["step"] for r in read_rows(run)] == [0, 1, 1, 2, 2]  # evaluations at 0, 1, 2 and two training steps
    assert table_row((workdir / "out/longer.md").read_text(), "grpo")[-3] == "8"  # 2 steps x 4 rollouts

    # a run made with another setting is not silently reused
    with pytest.raises(ConfigError, match="--prefix"):
        compare.main([*tiny_argv(tiny_model_dir), "--max-new-tokens", "5"])


def test_missing_file_is_skipped_and_bad_options_refused(workdir, monkeypatch, capsys):
    monkeypatch.setattr(compare, "REPO", workdir)  # a folder holding no algorithm file
    compare.main(["--algos", "xrpo,extra", "--out", "t.md"])
    out = capsys.readouterr().out
    assert "skip xrpo:" in out and "skip extra:" in out and "not written yet" in out
    assert not (workdir / "runs").exists() and "no algorithm" in (workdir / "t.md").read_text()
    with pytest.raises(ConfigError, match="--algos"):
        compare.main(["--algos", "grpo,ppo"])
    with pytest.raises(ConfigError, match="--seeds"):
        compare.main(["--seeds", "a,b"])


def test_claims_and_table_from_numbers():
    """The table and the claims column are computed from the measured numbers: synthetic runs with known gains."""
    cfg = compare.Config(eval_samples=8, eval_size=280, curve_every=5)
    keys = [k for k, _ in compare.metrics(cfg)]
    assert keys == ["eval/greedy_acc", "eval/pass@1", "eval/pass@4", "eval/pass@8", "eval/maj@8"]
    before = {s: {k: 0.30 for k in keys} for s in (0, 1, 2)}

    def runs(gains, curve):  # per seed: every metric up by the seed's gain; one greedy curve for all seeds
        summary = {"rollouts": 960.0, "tok_sampled": 4.0e4, "tok_trained": 4.0e4, "train_s": 600.0, "wall_s": 900.0,
                   "curve": [(st, 64 * st, 40.0 * st, a) for st, a in curve], "anneal_end": 8}
        return {s: {"eval": {k: 0.30 + g for k in keys}, "summary": summary} for s, g in enumerate(gains)}

    results = {"grpo": runs([0.02, 0.04, 0.06], [(0, 0.3), (5, 0.34), (10, 0.38), (15, 0.40)]),
               "exgrpo": runs([0.05, 0.07, 0.09], [(0, 0.3), (5, 0.3), (10, 0.3), (15, 0.3)]),
               "xrpo": runs([0.00, 0.04, 0.02], [(0, 0.3), (5, 0.40), (10, 0.41), (15, 0.42)]),
               "eapo": runs([0.00, 0.01, 0.02], [(0, 0.3), (5, 0.3), (10, 0.3), (15, 0.3)])}
    rows = {line.split("|")[1].strip(): line for line in compare.table(cfg, results, before) if line.startswith("| ")}
    assert rows["grpo"].startswith("| grpo | 3 | +4.0 ± 2.0 | +4.0 ± 2.0 |")  # gains in points, mean ± std
    assert rows["grpo"].endswith("| 10.0 min | 960 | 40.0k | 40.0k |")
    text = "\n".join(compare.claims(cfg, results, before))
    assert "ExGRPO − GRPO: +3.0 pts (3 seeds, s.e. 0.0): same way |" in text  # every seed +3 over GRPO's
    # GRPO first reaches its final 40% at step 15, XRPO at step 5: 3x fewer steps
    assert "GRPO first reaches its final 40.0% at step 15.0, XRPO at step 5.0: 3.0x fewer steps: same way" in text
    assert "EAPO − GRPO: -3.0 pts (3 seeds, s.e. 0.6): opposite way;" in text and "T = 8 steps" in text
    assert "ExTra − GRPO: not measured" in text


def test_jobs_runs_and_evaluations_side_by_side(tiny_model_dir, workdir, capsys):
    """--jobs 2: the runs, then the evaluations, two at a time (each run's output in its log); same table."""
    argv = [*tiny_argv(tiny_model_dir), "--algos", "grpo", "--seeds", "0,1", "--jobs", "2"]
    compare.main(argv)
    for seed in (0, 1):
        run = workdir / "runs" / f"cmp-grpo-s{seed}"
        assert (workdir / "runs" / f"cmp-grpo-s{seed}.log").read_text().count("done: greedy accuracy") == 1
        start = json.loads((workdir / f"runs/cmp-start/s{seed}.json").read_text())["eval"]
        after = json.loads((run / "compare_eval.json").read_text())["eval"]
        rows = read_rows(run)
        assert start["eval/greedy_acc"] == rows[0]["eval/greedy_acc"]
        assert after["eval/greedy_acc"] == rows[-1]["eval/greedy_acc"]
    assert table_row((workdir / "out/table.md").read_text(), "grpo")[1] == "2"
