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
    monkeypatch.setattr(compare.subprocess, "run", lambda *a, **k: pytest.fail(f"started a process: {a}"))
    monkeypatch.setattr(compare, "evaluate_model", lambda *a, **k: pytest.fail("evaluated again"))
    compare.main(tiny_argv(tiny_model_dir, out="out/again.md"))
    second = capsys.readouterr().out
    assert all(f"reuse cmp-{a}-s{s}: finished at step 1" in second for a in ALGOS for s in SEEDS)
    assert stamps == {p: p.stat().st_mtime_ns for p in (workdir / "runs").rglob("*") if p.is_file() and p in stamps}
    tables = lambda t: [line for line in t.splitlines() if line.startswith("|")]  # noqa: E731
    assert tables((workdir / "out/again.md").read_text()) == tables(text)

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
