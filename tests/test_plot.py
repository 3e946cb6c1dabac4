"""python -m common.plot: what it refuses, in one line and exit 2, before matplotlib (which CI does not install)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def plot(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "common.plot", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("case, says", [
    ("missing", "not found"), ("binary", "not text"), ("not_json", ":2: expected a JSON object with a step"),
    ("no_step", ":1: expected a JSON object with a step"), ("out_txt", "--out: expected a .png"),
    ("out_dir_missing", "--out: expected a .png file in an existing folder"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case, says):
    run = tmp_path / "run"
    run.mkdir()
    metrics = run / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 0, "eval/greedy_acc": 0.2}) + "\n")
    out = tmp_path / "curves.png"
    if case == "missing":
        metrics.unlink()
    elif case == "binary":
        metrics.write_bytes(b"\xff\xfe\x00binary")
    elif case == "not_json":
        metrics.write_text(metrics.read_text() + "{bad\n")
    elif case == "no_step":
        metrics.write_text('{"reward/mean": 1}\n')
    elif case == "out_txt":
        out = tmp_path / "curves.txt"
    else:
        out = tmp_path / "nowhere" / "curves.png"
    r = plot(tmp_path, run, "--out", out)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    assert not out.exists()
