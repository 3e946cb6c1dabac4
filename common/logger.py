"""Metrics: one JSON object per line in runs/<run-name>/metrics.jsonl, and a short line on the console."""
import json
import math
from pathlib import Path

# What the console line shows, in order, with its short label (the file gets every metric).
CONSOLE = [("reward/mean", "reward"), ("reward/acc", "acc"), ("response/len_mean", "len"),
           ("policy/entropy", "ent"), ("policy/clipfrac_high", "clip+"), ("policy/approx_kl", "kl"),
           ("optim/grad_norm", "gnorm"), ("perf/train_tok_s", "tok/s"), ("perf/step_s", "s")]


class MetricsLog:
    def __init__(self, run_dir: Path, enabled: bool = True, resume_step: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        if enabled and resume_step is not None and self.path.exists():
            # a resumed run continues after its checkpoint: lines a crash left beyond it are dropped, and so is
            # a line torn by a crash in the middle of a write
            rows = [(line, _parse(line)) for line in self.path.read_text().splitlines()]
            kept = [line for line, row in rows if row is not None and row.get("step", math.inf) <= resume_step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(self.path)

    def log(self, step: int, metrics: dict, console: bool = True):
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if console:
            if any(k.startswith("eval/") for k in metrics):
                shown = [f"{k} {_fmt(v)}" for k, v in metrics.items() if k.startswith("eval/")]
            else:
                shown = [f"{label} {_fmt(metrics[k])}" for k, label in CONSOLE if k in metrics]
            print(f"step {step:4d} | " + " | ".join(shown), flush=True)


def _parse(line: str):
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def _plain(v):
    v = v.item() if hasattr(v, "item") else v
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _fmt(v):
    v = _plain(v)
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
