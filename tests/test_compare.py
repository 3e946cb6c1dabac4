"""bench/compare.py: two algorithms for one step on a tiny model, the report, reuse and resume; the statistics and
verdicts from synthetic numbers; the job scheduler."""
import json
import math
import sys
import threading
import time
from pathlib import Path

import pytest

from bench import compare
from common.config import ConfigError, RunError
from common.passk import pass_at_k

# a variant that exists (EAPO first: it also exercises the prior made by the GRPO run); else GRPO alone
VARIANT = next((a for a in ("eapo", "xrpo", "exgrpo", "extra") if (compare.REPO / f"{a}.py").is_file()), None)
ALGOS = ("grpo", VARIANT) if VARIANT else ("grpo",)


def tiny_argv(model_dir, out="out/report.md", seeds="0"):
    # --curve-size = --eval-size: the runs' own greedy evaluation sees the same batch as the harness's
    return ["--algos", ",".join(ALGOS), "--seeds", seeds, "--steps", "1", "--model", str(model_dir),
            "--max-new-tokens", "4", "--eval-size", "4", "--eval-samples", "2", "--pool-samples", "3",
            "--prompts-per-step", "2", "--group-size", "2", "--train-size", "5", "--curve-every", "1",
            "--curve-size", "4", "--save-every", "1", "--jobs", "2", "--out", out]


def table_row(text: str, algo: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {algo} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def read_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def tables(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return tmp_path


def test_two_algorithms_one_step_then_reuse(tiny_model_dir, workdir, monkeypatch, capsys):
    compare.main(tiny_argv(tiny_model_dir))
    first = capsys.readouterr().out
    assert "estimated" in first.split("run: ")[0]  # the time left is printed before anything starts
    text = (workdir / "out/report.md").read_text()
    start = json.loads((workdir / "runs/cmp-start/s0.json").read_text())["eval"]
    assert len(start["greedy"]) == 4 and len(start["correct"]) == 4 and len(start["pool_correct"]) == 5
    for algo in ALGOS:
        run = workdir / "runs" / f"cmp-{algo}-s0"
        assert f"run: python {compare.REPO / algo}.py --run-name cmp-{algo}-s0" in first  # the user's command
        assert (workdir / "runs" / f"cmp-{algo}-s0.log").read_text().count("done: greedy accuracy") == 1  # --jobs 2
        rows = read_rows(run)
        after = json.loads((run / "compare_eval.json").read_text())["eval"]
        # the harness evaluates what the run evaluated itself: same problems, same model, same greedy answers
        assert sum(start["greedy"]) / 4 == rows[0]["eval/greedy_acc"] and rows[0]["step"] == 0
        assert sum(after["greedy"]) / 4 == rows[-1]["eval/greedy_acc"] and rows[-1]["step"] == 1
        assert all(0 <= c <= 2 for c in after["correct"]) and all(0 <= d <= c for d, c in zip(after["distinct"],
                                                                                              after["correct"]))
        assert all(0 <= c <= 3 for c in after["pool_correct"]) and len(after["pool_correct"]) == 5
        cells = table_row(text, algo)
        assert cells[1] == "1"
        assert cells[2] == f"{100 * (sum(after['greedy']) - sum(start['greedy'])) / 4:+.1f}"  # Δ greedy, points
        assert cells[3] == f"{100 * (sum(after['correct']) - sum(start['correct'])) / 8:+.1f}"  # Δ pass@1
        step = next(r for r in rows if "perf/step_s" in r)
        assert 0 <= step["reward/varied_rollouts"] <= 1
        assert cells[-3] == "4"  # rollouts: 1 step x 2 prompts x 2 completions
        assert cells[-2] == f"{step['perf/sampled_tokens']:.0f}"
    if VARIANT == "eapo":  # its prior is the GRPO run of its seed
        command = json.loads((workdir / "runs/cmp-eapo-s0/compare.json").read_text())["command"]
        assert command[command.index("--prior") + 1] == str(Path("runs/cmp-grpo-s0/checkpoint"))
    assert "## The papers' claims at our scale" in text and "Verdict rule: supported" in text

    # a second call reuses every run and every evaluation: no process is started, the same report
    stamps = {p: p.stat().st_mtime_ns for p in (workdir / "runs").rglob("*") if p.is_file()}
    real_run = compare.subprocess.run
    monkeypatch.setattr(compare.subprocess, "run", lambda *a, **k: pytest.fail(f"started a process: {a}"))
    compare.main(tiny_argv(tiny_model_dir, out="out/again.md"))
    second = capsys.readouterr().out
    assert all(f"reuse cmp-{a}-s0: finished at step 1" in second for a in ALGOS)
    assert stamps == {p: p.stat().st_mtime_ns for p in (workdir / "runs").rglob("*") if p.is_file() and p in stamps}
    assert tables((workdir / "out/again.md").read_text()) == tables(text)
    # --report-only: nothing run or evaluated (still patched), the same tables from the cached results
    compare.main([*tiny_argv(tiny_model_dir), "--report-only", "--out", "out/only.md"])
    assert tables((workdir / "out/only.md").read_text()) == tables(text)

    # more steps: the finished run is continued from its checkpoint, not started again; its evaluation is redone
    argv = tiny_argv(tiny_model_dir, out="out/longer.md")
    argv[argv.index("--algos") + 1], argv[argv.index("--steps") + 1] = "grpo", "2"
    monkeypatch.setattr(compare.subprocess, "run", real_run)
    compare.main(argv)
    third = capsys.readouterr().out
    run = workdir / "runs/cmp-grpo-s0"
    assert "resume: python" in third and "--resume" in third and "evaluate cmp-grpo-s0" in third
    assert [r["step"] for r in read_rows(run)] == [0, 1, 1, 2, 2]  # evaluations at 0, 1, 2 and two training steps
    assert json.loads((run / "compare_eval.json").read_text())["key"]["step"] == 2
    assert table_row((workdir / "out/longer.md").read_text(), "grpo")[-3] == "8"  # 2 steps x 4 rollouts

    # a run made with another setting is not silently reused
    with pytest.raises(ConfigError, match="--prefix"):
        compare.main([*tiny_argv(tiny_model_dir), "--max-new-tokens", "5"])


def test_missing_file_is_skipped_and_bad_options_refused(workdir, monkeypatch, capsys):
    monkeypatch.setattr(compare, "REPO", workdir)  # a folder holding no algorithm file
    (workdir / "t.md").write_text("a committed report")
    with pytest.raises(ConfigError, match="--runs-dir: .*none found, t.md left as it was"):
        compare.main(["--algos", "xrpo,extra", "--out", "t.md"])
    out = capsys.readouterr().out
    assert "skip xrpo:" in out and "skip extra:" in out and "not written yet" in out
    assert not (workdir / "runs").exists() and (workdir / "t.md").read_text() == "a committed report"
    # no run where --report-only looks (a wrong folder, or other options than the runs'): the report is not emptied
    monkeypatch.setattr(compare, "REPO", compare.Path(__file__).resolve().parents[1])
    with pytest.raises(ConfigError, match="none found, t.md left as it was"):
        compare.main(["--report-only", "--runs-dir", "nowhere", "--out", "t.md"])
    assert (workdir / "t.md").read_text() == "a committed report"
    for argv, option in ((["--algos", "grpo,ppo"], "--algos"), (["--seeds", "a,b"], "--seeds"),
                         (["--eval-size", "10", "--curve-size", "20"], "--curve-size"), (["--jobs", "0"], "--jobs"),
                         (["--runs-dir", "elsewhere"], "--runs-dir")):
        with pytest.raises(ConfigError, match=option):
            compare.main(argv)


def test_quantities_from_per_problem_counts():
    """pass@k, the pass@k - pass@1 gap, distinct answers and the never-solved pool rate, by hand."""
    cfg = compare.Config(eval_samples=4, pool_samples=2)
    ev = {"greedy": [1, 0, 0, 1], "correct": [4, 2, 0, 1], "distinct": [2, 2, 0, 1], "pool_correct": [2, 1, 0, 1]}
    q = compare.quantities(cfg, ev, start_pool=[0, 2, 0, 1])  # the start model never solved pool questions 0 and 2
    assert q["greedy"] == 0.5 and q["pass@1"] == pytest.approx((1 + 0.5 + 0 + 0.25) / 4)
    assert q["pass@4"] == 0.75 and q["pass@2"] == pytest.approx((1 + pass_at_k(4, 2, 2) + 0 + 0.5) / 4)
    assert q["gap"] == pytest.approx(0.75 - q["pass@1"]) and q["distinct"] == 1.25
    assert q["never_solved"] == pytest.approx((2 / 2 + 0 / 2) / 2)
    assert compare.quantities(cfg, ev, start_pool=[1, 1, 1, 1])["never_solved"] is None


def test_verdicts_by_the_rule():
    """Supported beyond +2 s.e., contradicted beyond -2 s.e., undecided within, or with one seed."""
    assert compare.verdict([3.0, 3.5, 2.5, 3.0, 3.0])[1] == "supported"
    assert compare.verdict([-3.0, -3.5, -2.5, -3.0, -3.0])[1] == "contradicted"
    assert compare.verdict([4.0, -3.0, 2.0, -1.0, 0.5])[1] == "undecided"
    m, se = compare.mean_se([1.0, 2.0, 3.0])
    assert (m, se) == (2.0, pytest.approx(1 / math.sqrt(3)))
    assert compare.verdict([5.0], "pts") == ("+5.0 pts (one seed)", "undecided")
    assert compare.verdict([1.0, 3.5], "pts") == ("+2.2 ± 1.2 pts (2 seeds)", "undecided")
    assert compare.verdict(None)[1] == "not measured"
    # the boundary: mean exactly 2 s.e. is not beyond it
    xs = [1.0, 3.0]  # mean 2, s.e. 1: 2 > 2 * 1 is false; [1.5, 2.5]: s.e. 0.5, 2 > 1 is true
    assert compare.verdict(xs)[1] == "undecided" and compare.verdict([1.5, 2.5])[1] == "supported"


def synthetic(cfg, curve, q, varied=0.5, entropy=0.4, aug=None):
    summary = {"rollouts": 240.0, "tok_sampled": 1e4, "tok_trained": 1e4, "train_s": 60.0, "wall_s": 90.0,
               "curve": [(st, 16 * st, 4.0 * st, a) for st, a in curve], "entropy": [(1, entropy)], "machine": "m",
               "entropy_late": entropy, "varied": varied, "aug_minus_ord": aug, "anneal_end": 8}
    base = {"greedy": 0.3, "pass@1": 0.3, "pass@2": 0.4, "pass@4": 0.5, "gap": 0.2, "distinct": 1.0,
            "never_solved": 0.1}
    return {"q": {**base, **q}, "summary": summary, "eval_s": 10.0}


def test_claims_from_synthetic_runs():
    """Each claim's value is the paired difference it names, seed by seed, and its verdict follows the rule."""
    cfg = compare.Config(eval_samples=4, steps=9, curve_every=3)
    grpo_curve = [(0, 0.30), (3, 0.34), (6, 0.38), (9, 0.40)]
    results = {
        "grpo": {s: synthetic(cfg, grpo_curve, {"pass@1": 0.30 + 0.01 * s}) for s in range(3)},
        # XRPO reaches GRPO's final 40% at step 3 on every seed: 6 steps fewer; its varied share +20 points
        "xrpo": {s: synthetic(cfg, [(0, 0.3), (3, 0.40), (6, 0.41), (9, 0.42)], {"pass@1": 0.27 + 0.01 * s},
                              varied=0.7) for s in range(3)},
        # ExTra: +2 distinct answers everywhere, never-solved rate noisy around 0
        "extra": {s: synthetic(cfg, grpo_curve, {"distinct": 3.0, "never_solved": 0.1 + (-0.05, 0.06, 0.0)[s]})
                  for s in range(3)},
        "eapo": {s: synthetic(cfg, grpo_curve, {}, aug=(0.1, 0.12, 0.08)[s]) for s in range(3)},
    }
    found = {(paper.split()[0], what): (values, compare.verdict(values)[1])
             for paper, _, what, _, values in compare.claims(cfg, results)}
    steps, v = found["XRPO", "steps GRPO needs to reach its final greedy accuracy minus the steps XRPO needs"]
    assert steps == [6.0, 6.0, 6.0] and v == "supported"
    values, v = found["XRPO", "share of trained rollouts in groups with reward variance"]
    assert values == pytest.approx([20.0] * 3) and v == "supported"
    assert found["XRPO", "held-out pass@1"][1] == "contradicted"  # 3 points below GRPO on every seed
    assert found["ExTra", "distinct correct answers per problem"] == ([2.0] * 3, "supported")
    values, v = found["ExTra", "pass@1 on the pool questions the start model never solved"]
    assert values == pytest.approx([-5.0, 6.0, 0.0]) and v == "undecided"
    values, v = found["EAPO", "rollout accuracy, augmented − ordinary, first half of the steps (within its own run)"]
    assert values == pytest.approx([10.0, 12.0, 8.0]) and v == "supported"
    assert found["ExGRPO", "held-out pass@1"] == (None, "not measured")  # no ExGRPO runs
    assert ("EAPO", "held-out pass@1 (one annealing length, T = 8 steps)") in found
    # a seed where XRPO never reaches the target counts as the steps plus one evaluation interval
    results["xrpo"][0]["summary"]["curve"] = [(st, 0, 0, 0.3) for st in (0, 3, 6, 9)]
    values = compare.paired(results, "xrpo", compare.steps_saved(cfg))
    assert values[0] == 9.0 - 12.0
    rows, tally = compare.claims_table(cfg, results)  # the claims of the algorithms that ran: not ExGRPO's
    assert sum(tally.values()) == len(rows) - 2 == sum(paper.startswith(("XRPO", "ExTra", "EAPO"))
                                                       for paper, *_ in compare.claims(cfg, results))
    assert not any("ExGRPO" in row for row in rows)


def test_run_summary_reads_the_mechanism_metrics(tmp_path):
    cfg = compare.Config(steps=4, runs_dir=str(tmp_path), prompts_per_step=4, group_size=2)
    run = tmp_path / "cmp-eapo-s0"
    run.mkdir()
    (run / "compare.json").write_text(json.dumps({"wall_s": 5.0, "machine": "m"}))
    rows = [{"step": 0, "eval/greedy_acc": 0.2}]
    for step in (1, 2, 3, 4):
        rows.append({"step": step, "perf/step_s": 2.0, "perf/sampled_tokens": 10.0, "perf/train_tok_s": 5.0,
                     "perf/train_s": 1.0, "policy/entropy": 0.1 * step, "reward/varied_rollouts": 0.25 * step,
                     "reward/zero_var_groups": 0.0, "eapo/injected_ratio": 0.5 if step < 4 else 0.0,
                     "eapo/acc_augmented": 0.5, "eapo/acc_ordinary": 0.5 - 0.1 * step})
    rows.append({"step": 4, "eval/greedy_acc": 0.4})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    s = compare.run_summary(cfg, "eapo", 0)
    assert s["rollouts"] == 32 and s["tok_sampled"] == 40 and s["train_s"] == 8.0
    assert s["curve"] == [(0, 0.0, 0.0, 0.2), (4, 32.0, 8.0, 0.4)]
    assert s["entropy_late"] == pytest.approx((0.3 + 0.4) / 2)
    assert s["varied"] == pytest.approx(0.625)
    assert s["aug_minus_ord"] == pytest.approx((0.1 + 0.2) / 2)  # injecting steps in the first half: 1, 2


def test_execute_runs_dependencies_first_and_skips_after_a_failure():
    cfg = compare.Config(jobs=3)
    log, lock, live, most = [], threading.Lock(), [0], [0]

    def job(name, ok=True):
        def run():
            with lock:
                live[0] += 1
                most[0] = max(most[0], live[0])
            time.sleep(0.02)
            with lock:
                live[0] -= 1
                log.append(name)
            return ok
        return run

    jobs = {("run", "grpo", 0): ([], job("grpo")), ("run", "xrpo", 0): ([], job("xrpo", ok=False)),
            ("run", "eapo", 0): ([("run", "grpo", 0)], job("eapo")),
            ("eval", "xrpo", 0): ([("run", "xrpo", 0)], job("eval-xrpo")),
            ("eval", "eapo", 0): ([("run", "eapo", 0)], job("eval-eapo")),
            ("eval", None, 0): ([], job("eval-start")), ("eval", None, 1): ([], job("eval-start-1"))}
    done = compare.execute(cfg, jobs)
    assert done[("run", "xrpo", 0)] is False and done[("eval", "xrpo", 0)] is False and "eval-xrpo" not in log
    assert log.index("grpo") < log.index("eapo") < log.index("eval-eapo") and most[0] <= 3
    assert all(done[k] for k in jobs if "xrpo" not in k)

    def broken():
        raise RunError("a setting mismatch")

    with pytest.raises(RunError, match="mismatch"):
        compare.execute(cfg, {("run", "grpo", 0): ([], broken)})


def test_a_child_logs_into_a_folder_not_made_yet(workdir):
    """With --jobs > 1 the start model's evaluation can be the first job to write under runs/, before any training
    run has made the folder: its log is still written (it raised FileNotFoundError, a race under load)."""
    cfg = compare.Config(jobs=2)
    log = workdir / "runs" / "cmp-eval-start-s0.log"
    assert compare.child([sys.executable, "-c", "print('hello')"], cfg, log) == 0
    assert log.read_text() == "hello\n"
