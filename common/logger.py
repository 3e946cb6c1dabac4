"""Metrics: one JSON object per line in runs/<run-name>/metrics.jsonl, a short line on the console, and optionally
the same numbers in TensorBoard, Weights & Biases or Trackio.

    log = MetricsLog(run_dir, enabled=dist.is_main(), resume_step=..., total_steps=cfg.steps,
                     tracker=cfg.tracker, config=asdict(cfg), run_name=cfg.run_name)
    log.log(step, metrics)   # every row: the file, the tracker, and a console line
    log.close()              # at the end: finishes the tracker (safe to call twice)

A training row's console line reads `step   3/15 | reward 0.41 | ... | s 27.3 | left 5m10s`: time left is this
process's mean wall seconds per step (saves and intermediate evaluations included) times the steps left, plus the
last evaluation's seconds, since a final evaluation follows the last step. Rows with eval/ keys are evaluations.
"""
import hashlib
import importlib
import importlib.util
import json
import math
import time
from pathlib import Path

from common.errors import ConfigError

# What the console line shows, in order, with its short label (the file gets every metric).
CONSOLE = [("reward/mean", "reward"), ("reward/acc", "acc"), ("response/len_mean", "len"),
           ("policy/entropy", "ent"), ("policy/clipfrac_high", "clip+"), ("policy/approx_kl", "kl"),
           ("optim/grad_norm", "gnorm"), ("perf/train_tok_s", "tok/s"), ("perf/step_s", "s")]
TRACKERS = ("none", "tensorboard", "wandb", "trackio")
PROJECT = "rlvr"  # the W&B / Trackio project every run goes to


class MetricsLog:
    def __init__(self, run_dir: Path, enabled: bool = True, resume_step: int | None = None,
                 total_steps: int | None = None, tracker: str = "none", config: dict | None = None,
                 run_name: str = "", clock=time.monotonic):
        if tracker not in TRACKERS:  # checked on every rank, so that all of them stop alike
            raise ConfigError(f"--tracker: expected one of {', '.join(TRACKERS)}, got {tracker!r}")
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled, self.total_steps, self.clock = enabled, total_steps, clock
        # time left: seconds and count of this process's training steps, when the last one ended, last eval's seconds
        self._train_s, self._trained, self._since, self._eval_s = 0.0, 0, clock(), 0.0
        self._tracker = None  # (log(values, step), close()) of the chosen tracker
        self.evaluated: set[int] = set()  # the steps with an evaluation row, of a resumed run's kept rows
        if enabled and resume_step is not None and self.path.exists():
            self._trim(resume_step)
        if enabled and tracker != "none":
            # imported here and only when chosen: the trackers are optional packages, not requirements
            self._tracker = _open_tracker(tracker, Path(run_dir), config or {}, run_name)

    def _trim(self, resume_step: int):
        # a resumed run continues after its checkpoint: lines a crash left beyond it are dropped, and so is
        # a line torn by a crash in the middle of a write
        rows = [(line, _parse(line)) for line in self.path.read_text().splitlines()]
        kept = [line for line, row in rows if row is not None and row.get("step", math.inf) <= resume_step]
        self.evaluated = {row["step"] for _, row in rows if row is not None and row.get("step", math.inf) <= resume_step
                          and any(k.startswith("eval/") for k in row)}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)

    def log(self, step: int, metrics: dict, console: bool = True):
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        evaluation = any(k.startswith("eval/") for k in metrics)
        self._clock_row(evaluation, row)
        if self._tracker is not None:
            self._tracker[0]({k: v for k, v in row.items() if k != "step" and _number(v)}, step)
        if console:
            print(self._line(step, row, evaluation), flush=True)

    def _clock_row(self, evaluation: bool, row: dict):
        now = self.clock()
        if evaluation:
            if _number(row.get("perf/eval_s")):
                self._eval_s = row["perf/eval_s"]
            if not self._trained:  # the first step is timed from the evaluation before it (step 0's)
                self._since = now
        else:  # from the last training row: the saves and evaluations between two steps are part of a step's cost
            self._train_s, self._trained, self._since = self._train_s + now - self._since, self._trained + 1, now

    def _line(self, step: int, row: dict, evaluation: bool) -> str:
        if evaluation:
            shown = [f"{k} {_fmt(v)}" for k, v in row.items() if k.startswith("eval/")]
            shown += [f"s {_fmt(row['perf/eval_s'])}"] if _number(row.get("perf/eval_s")) else []
        else:
            shown = [f"{label} {_fmt(row[k])}" for k, label in CONSOLE if k in row]
        if self.total_steps is None:
            return f"step {step:4d} | " + " | ".join(shown)
        if not evaluation:
            left = self._train_s / self._trained * max(self.total_steps - step, 0) + self._eval_s
            shown.append(f"left {_duration(left)}")
        width = max(3, len(str(self.total_steps)))
        return f"step {step:{width}d}/{self.total_steps} | " + " | ".join(shown)

    def close(self):
        """Finish the tracker; a second call, or one with no tracker, does nothing."""
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker[1]()


def check_tracker(name: str):
    """Refuse a --tracker whose package is not installed, without importing it (the algorithm files call this before
    they load the model or create the run's folder; MetricsLog imports it when the run starts)."""
    if name not in TRACKERS:
        raise ConfigError(f"--tracker: expected one of {', '.join(TRACKERS)}, got {name!r}")
    if name != "none" and importlib.util.find_spec(name) is None:  # the tensorboard package, not torch's wrapper
        raise _missing(name)


def _missing(name: str) -> ConfigError:
    return ConfigError(f"--tracker {name} needs the {name} package (pip install {name})")


def _open_tracker(name: str, run_dir: Path, config: dict, run_name: str):
    """(log(values, step), close()) for TensorBoard, W&B or Trackio; a missing package is a user error."""
    try:
        module = importlib.import_module("torch.utils.tensorboard" if name == "tensorboard" else name)
    except ImportError:  # torch.utils.tensorboard raises it too when the tensorboard package is absent
        raise _missing(name) from None
    if name == "tensorboard":
        writer = module.SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")

        def scalars(values: dict, step: int):
            for k, v in values.items():
                writer.add_scalar(k, v, step)
        return scalars, writer.close
    if name == "wandb":
        # the id follows from the run name, so that --resume continues the same W&B run instead of starting another
        run_id = hashlib.sha1(run_name.encode()).hexdigest()[:16]
        module.init(project=PROJECT, name=run_name, config=config, dir=str(run_dir), resume="allow", id=run_id)
    else:  # trackio: wandb's API, kept locally; its runs are found again by name
        module.init(project=PROJECT, name=run_name, config=config, resume="allow")
    return (lambda values, step: module.log(values, step=step)), module.finish


def _duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _parse(line: str):
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def _plain(v):
    v = v.item() if hasattr(v, "item") else v
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _number(v) -> bool:
    """A number a tracker can plot: an int or float of a row (_plain has made non-finite floats None), not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v):
    v = _plain(v)
    if v is None:  # not finite, or not measured this step (say, a step that trained no token)
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
