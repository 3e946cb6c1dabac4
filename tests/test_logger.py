"""common.logger.MetricsLog: the progress line and its time left (with a fake clock), the optional trackers (with fake
modules in sys.modules), and the resume trimming of metrics.jsonl."""
import importlib
import importlib.util
import json
import sys
import types

import pytest
import torch

from common.errors import ConfigError
from common.logger import MetricsLog, _duration, check_tracker

TRAIN = {"reward/mean": 0.41, "reward/acc": 0.39, "response/len_mean": 22.1, "perf/step_s": 10.0}
EVAL = {"eval/greedy_acc": 0.3, "perf/eval_s": 30.0}


class Clock:
    """time.monotonic's stand-in: the test sets the time."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def lines(capsys):
    return capsys.readouterr().out.splitlines()


def test_progress_line_step_of_total_and_time_left(tmp_path, capsys):
    clock = Clock()
    log = MetricsLog(tmp_path, total_steps=15, clock=clock)
    clock.now += 30
    log.log(0, EVAL)  # the step-0 evaluation took 30 s
    for step in (1, 2, 3):
        clock.now += 10  # each step 10 s
        log.log(step, TRAIN)
    out = lines(capsys)
    assert out[0] == "step   0/15 | eval/greedy_acc 0.3 | s 30"
    # 10 s x 12 steps left + the final evaluation's 30 s = 150 s
    assert out[-1] == "step   3/15 | reward 0.41 | acc 0.39 | len 22.1 | s 10 | left 2m30s"


def test_time_left_is_the_mean_and_counts_intermediate_evaluations(tmp_path, capsys):
    clock = Clock()
    log = MetricsLog(tmp_path, total_steps=10, clock=clock)
    clock.now += 4
    log.log(1, TRAIN)  # no step-0 evaluation: timed from construction, 4 s
    clock.now += 6
    log.log(1, {"eval/greedy_acc": 0.5, "perf/eval_s": 5.0})
    clock.now += 2
    log.log(2, TRAIN)  # 8 s since the last training row: the evaluation between is part of this step
    # mean (4 + 8) / 2 = 6 s x 8 steps left + 5 s of evaluation = 53 s
    assert lines(capsys)[-1].endswith("| left 0m53s")


def test_first_step_is_timed_from_the_step0_evaluation_not_construction(tmp_path, capsys):
    clock = Clock()
    log = MetricsLog(tmp_path, total_steps=3, clock=clock)
    clock.now += 100
    log.log(0, {"eval/greedy_acc": 0.3, "perf/eval_s": 20.0})
    clock.now += 7
    log.log(1, TRAIN)
    assert lines(capsys)[-1].endswith("| left 0m34s")  # 7 s x 2 + 20 s


def test_last_step_shows_only_the_final_evaluation(tmp_path, capsys):
    clock = Clock()
    log = MetricsLog(tmp_path, total_steps=2, clock=clock)
    log.log(0, EVAL)
    for step in (1, 2):
        clock.now += 50
        log.log(step, TRAIN)
    assert lines(capsys)[-1].endswith("| left 0m30s")


def test_hours_format(tmp_path, capsys):
    clock = Clock()
    log = MetricsLog(tmp_path, total_steps=100, clock=clock)
    clock.now += 40
    log.log(1, TRAIN)
    assert lines(capsys)[-1].endswith("| left 1h06m")  # 40 s x 99 = 3960 s
    assert [_duration(s) for s in (0, 59.6, 310, 3599, 3600, 3720, 36000)] == \
        ["0m00s", "1m00s", "5m10s", "59m59s", "1h00m", "1h02m", "10h00m"]


def test_no_total_keeps_the_old_line(tmp_path, capsys):
    clock = Clock()
    log = MetricsLog(tmp_path, clock=clock)
    clock.now += 10
    log.log(3, TRAIN)
    log.log(3, {"eval/greedy_acc": 0.25})
    assert lines(capsys) == ["step    3 | reward 0.41 | acc 0.39 | len 22.1 | s 10", "step    3 | eval/greedy_acc 0.25"]


def test_file_rows_and_resume_trimming(tmp_path, capsys):
    log = MetricsLog(tmp_path, total_steps=5)
    for step in range(5):
        log.log(step, {"reward/mean": torch.tensor(0.5), "x": float("nan")}, console=False)
    assert capsys.readouterr().out == ""
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[1] == {"step": 1, "reward/mean": 0.5, "x": None}
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "reward/me')  # torn by a crash
    MetricsLog(tmp_path, resume_step=2)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    MetricsLog(tmp_path, enabled=False, resume_step=0)  # another rank leaves the file alone
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


# ---- trackers: fake modules record what they were given

ROW = {"reward/mean": torch.tensor(0.5), "reward/acc": 1, "bad": float("inf"), "nan": torch.tensor(float("nan")),
       "name": "text", "flag": True, "none": None}
FORWARDED = {"reward/mean": 0.5, "reward/acc": 1}  # finite numbers only


def fake_tracker_module(name, calls):
    module = types.ModuleType(name)
    module.init = lambda **kw: calls.append(("init", kw))
    module.log = lambda values, step=None: calls.append(("log", dict(values), step))
    module.finish = lambda: calls.append(("finish",))
    return module


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_wandb_and_trackio(name, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, name, fake_tracker_module(name, calls))
    log = MetricsLog(tmp_path, tracker=name, config={"lr": 1e-6}, run_name="r1")
    log.log(3, ROW, console=False)
    log.close()
    log.close()
    expected = dict(project="rlvr", name="r1", config={"lr": 1e-6}, resume="allow")
    if name == "wandb":
        expected.update(dir=str(tmp_path), id=calls[0][1]["id"])
    assert calls == [("init", expected), ("log", FORWARDED, 3), ("finish",)]


def test_wandb_id_is_stable_per_run_name(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake_tracker_module("wandb", calls))
    for run_name in ("a", "a", "b"):
        MetricsLog(tmp_path, tracker="wandb", run_name=run_name)
    ids = [kw["id"] for _, kw in calls]
    assert ids[0] == ids[1] != ids[2] and ids[0].isalnum()


def test_tensorboard(tmp_path, monkeypatch):
    calls = []

    class SummaryWriter:
        def __init__(self, log_dir):
            calls.append(("writer", log_dir))

        def add_text(self, tag, text):
            calls.append(("text", tag, text))

        def add_scalar(self, key, value, step):
            calls.append(("scalar", key, value, step))

        def close(self):
            calls.append(("close",))

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = SummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    log = MetricsLog(tmp_path, tracker="tensorboard", config={"lr": 1e-6})
    log.log(0, {"eval/greedy_acc": 0.25}, console=False)
    log.log(1, ROW, console=False)
    log.close()
    log.close()
    assert calls[0] == ("writer", str(tmp_path / "tensorboard"))
    assert calls[1][:2] == ("text", "config") and '"lr": 1e-06' in calls[1][2]
    assert calls[2:] == [("scalar", "eval/greedy_acc", 0.25, 0), ("scalar", "reward/mean", 0.5, 1),
                         ("scalar", "reward/acc", 1, 1), ("close",)]


@pytest.mark.parametrize("name, module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb"),
                                          ("trackio", "trackio")])
def test_missing_package_is_a_config_error(name, module, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    with pytest.raises(ConfigError, match=rf"--tracker {name} needs .*\(pip install {name}\)"):
        MetricsLog(tmp_path, tracker=name)


def test_unknown_tracker_is_a_config_error(tmp_path):
    for enabled in (True, False):
        with pytest.raises(ConfigError, match="--tracker: expected one of none, tensorboard, wandb, trackio"):
            MetricsLog(tmp_path, enabled=enabled, tracker="mlflow")


def test_disabled_rank_logs_and_imports_nothing(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake_tracker_module("wandb", calls))
    monkeypatch.setitem(sys.modules, "trackio", None)  # would be a ConfigError if imported
    for tracker in ("wandb", "trackio"):
        log = MetricsLog(tmp_path, enabled=False, total_steps=3, tracker=tracker, run_name="r")
        log.log(1, TRAIN)
        log.close()
    assert calls == [] and capsys.readouterr().out == "" and not (tmp_path / "metrics.jsonl").exists()


def test_close_without_tracker(tmp_path):
    log = MetricsLog(tmp_path)
    log.close()
    log.close()


def test_console_shows_a_missing_value_as_a_dash(tmp_path, capsys):
    """A metric not measured this step (the policy entropy of a step that trained no token: null in the file)
    reads "-" on the console, not "None" or a 0 that looks measured."""
    MetricsLog(tmp_path).log(1, {"reward/mean": 0.25, "policy/entropy": float("nan")})
    line = capsys.readouterr().out
    assert "reward 0.25" in line and "ent -" in line and "None" not in line, line


@pytest.mark.parametrize("algo", ["grpo", "exgrpo", "xrpo", "extra", "eapo"])
def test_a_missing_tracker_package_stops_the_file_before_it_loads_or_writes(algo, tmp_path, monkeypatch):
    """Each algorithm file refuses --tracker wandb without wandb in its option checks: before, the refusal came after
    the data and the model had loaded, and left an empty runs/<name>/ behind."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(algo)
    loaded = []
    monkeypatch.setattr(module.Transformer, "from_pretrained", lambda *a, **k: loaded.append(a))
    with pytest.raises(ConfigError, match=r"--tracker wandb needs the wandb package \(pip install wandb\)"):
        module.main(["--tracker", "wandb", "--run-name", "t"])
    assert not loaded and not (tmp_path / "runs").exists()


def test_check_tracker_passes_an_installed_package_and_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    check_tracker("none")
    with pytest.raises(ConfigError, match="--tracker: expected one of"):
        check_tracker("mlflow")
    with pytest.raises(ConfigError, match="--tracker wandb needs"):
        check_tracker("wandb")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "wandb" else None)
    check_tracker("wandb")
