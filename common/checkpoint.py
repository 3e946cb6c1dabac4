"""Checkpoints: a Hugging Face folder (loads in `transformers` and as our --model) plus trainer state.

    runs/<name>/checkpoint/   config.json  model.safetensors  tokenizer.json ...  trainer.pt

trainer.pt holds the step, the optimizer, the RNG states and whatever algorithm state the script passes.
Writing is atomic: everything goes to a fresh temporary folder, synced to disk, which then replaces the old
checkpoint by renames, so a crash at any moment (of the process, or of the machine) leaves either the old or the new
checkpoint whole.
"""
import dataclasses
import os
import random
import shutil
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError

from common import config, dist
from common.config import check
from common.errors import ConfigError, RunError, reason
from common.hub import resolve_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def save(ckpt_dir, model, weights: dict, optimizer_state: dict, step: int, model_source=None, extra: dict | None = None):
    """model: the Transformer (for its config); weights: its full state dict; model_source: the folder the
    run started from, whose tokenizer files are copied along."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in ckpt_dir.parent.glob(ckpt_dir.name + ".tmp-*"):  # the half-written folder of a killed save
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=ckpt_dir.parent, prefix=ckpt_dir.name + ".tmp-"))
    try:
        model.save_pretrained(tmp, state_dict=weights)
        if model_source is not None:  # so that the folder is a complete model for `--model`
            for name in TOKENIZER_FILES:
                if (Path(model_source) / name).is_file():
                    shutil.copy(Path(model_source) / name, tmp / name)
        torch.save({"step": step, "optimizer": optimizer_state, "rng": rng_state(), "extra": extra or {}},
                   tmp / "trainer.pt")
    except (OSError, RuntimeError, SafetensorError) as e:  # a full disk, a lost mount: say so in one line, leave no partial folder
        shutil.rmtree(tmp, ignore_errors=True)
        kept = f"the checkpoint of an earlier step in {ckpt_dir} is kept" if find(ckpt_dir) else "no checkpoint was kept"
        raise RunError(f"writing the checkpoint of step {step} to {ckpt_dir} failed ({reason(e)}); {kept}") from e
    except BaseException:  # Ctrl-C during the save: no half-written folder is left behind either
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for path in (*tmp.iterdir(), tmp):  # on disk before the old checkpoint can go: a power loss keeps one whole
        sync(path)
    old = ckpt_dir.with_name(ckpt_dir.name + ".old")
    if ckpt_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        ckpt_dir.rename(old)
    tmp.rename(ckpt_dir)
    sync(ckpt_dir.parent)  # the renames themselves
    shutil.rmtree(old, ignore_errors=True)


def sync(path: Path):
    """fsync a file or a folder (a folder's entries: the renames in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_run(model, optimizer, ckpt_dir, step: int, cfg, extra: dict | None = None):
    """A training run's checkpoint: fp32 master weights and optimizer state, whole (collectives under FSDP2: every
    rank calls this), the run's config (cfg, a dataclass) and the algorithm's `extra` state, written atomically by
    rank 0; never from non-finite weights, which would replace the last good checkpoint with garbage."""
    weights, optim_state = dist.full_state_dict(model), dist.optimizer_state(model, optimizer)
    if not all(torch.isfinite(dist.local(w)).all() for w in weights.values()):
        raise RunError(f"step {step}: the weights are not finite; not saved (lower --lr). {kept(ckpt_dir)}")
    if dist.is_main():
        save(ckpt_dir, model, weights, optim_state, step, model_source=resolve_model_dir(cfg.model),
             extra={"config": dataclasses.asdict(cfg), "algorithm": algorithm(cfg), **(extra or {})})
    dist.barrier()


def find(ckpt_dir) -> Path | None:
    """The newest complete checkpoint: the folder itself, or the previous one if a save was interrupted."""
    ckpt_dir = Path(ckpt_dir)
    for d in (ckpt_dir, ckpt_dir.with_name(ckpt_dir.name + ".old")):
        if (d / "trainer.pt").is_file() and (d / "model.safetensors").is_file():
            return d
    return None


def load_trainer_state(ckpt: Path) -> dict:
    """The saved step, optimizer state and extras; restores the RNG states as a side effect."""
    try:  # truncated, overwritten or foreign: torch.load, pickle and the lookups below raise many kinds
        state = torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=False)
        state["step"] = int(state["step"])
        state["optimizer"], state["extra"]  # noqa: B018 (present, or a KeyError)
        set_rng_state(state["rng"])
    except Exception as e:
        raise ConfigError(f"--resume: expected a readable checkpoint; {ckpt / 'trainer.pt'} is damaged "
                          f"({type(e).__name__}: {reason(e)[:120]})") from None
    return state


def algorithm(cfg) -> str:
    """The name of the algorithm file whose Config cfg is (grpo, exgrpo, ...), also when it runs as __main__."""
    return Path(sys.modules[type(cfg).__module__].__file__).stem


def open_run(cfg):
    """The run's folder and, with --resume, its newest checkpoint and trainer state (the RNG states restored). Names
    an unnamed run <algorithm>-<date-time>. Refuses in one line: a name already taken by another run (or by a file),
    --resume where nothing was saved, and a checkpoint that is damaged or that another algorithm file wrote.
    Returns run_dir, ckpt_dir, ckpt (None on a fresh run) and state (None on a fresh run)."""
    algo = algorithm(cfg)
    check(cfg.run_name or not cfg.resume, "resume", "--run-name NAME with it: the run in runs/NAME/ to continue")
    cfg.run_name = cfg.run_name or datetime.now().strftime(f"{algo}-%Y%m%d-%H%M%S")
    check(Path(cfg.run_name).name == cfg.run_name and cfg.run_name not in (".", ".."), "run_name",
          f"a plain folder name for runs/<run-name> (no '/', '.' or '..'), got {cfg.run_name!r}")
    run_dir = Path("runs") / cfg.run_name
    ckpt_dir = run_dir / "checkpoint"
    check(not run_dir.exists() or run_dir.is_dir(), "run_name", f"a name for a folder: {run_dir} is a file")
    started, ckpt = (run_dir / "metrics.jsonl").exists(), find(ckpt_dir)
    config.interrupt_note = lambda: kept(ckpt_dir)  # what Ctrl-C leaves behind, for main_guard's last line
    if not cfg.resume:
        check(not started, "run_name", f"a new name: {run_dir} already holds a run (" +
              ("add --resume to continue it)" if ckpt else "which saved no checkpoint: delete it to start it again)"))
        return run_dir, ckpt_dir, None, None
    check(ckpt is not None, "resume", f"a checkpoint in {ckpt_dir} (none found" +
          ("; the run stopped before its first one: delete the folder to start it again)" if started else ")"))
    state = load_trainer_state(ckpt)
    saved = state["extra"].get("algorithm", algo)  # checkpoints of before 2026-11-28 do not say
    check(saved == algo, "resume", f"a checkpoint of {algo}.py; {ckpt} was written by {saved}.py (to start "
          f"{algo}.py from its weights, pass --model {ckpt} and a new --run-name)")
    return run_dir, ckpt_dir, ckpt, state


def kept(ckpt_dir) -> str:
    """What a run that stops now leaves behind, for its last message: how to continue it or start it again."""
    run_dir = Path(ckpt_dir).parent
    if find(ckpt_dir):
        return (f"The last checkpoint in {ckpt_dir} is intact (rerun with --run-name {run_dir.name} --resume to "
                "continue from it)")
    if (run_dir / "metrics.jsonl").exists():
        return f"No checkpoint was saved yet (delete {run_dir} to start the run again)"
    return "No checkpoint was saved yet (nothing to resume: start the run again)"


def rng_state() -> dict:
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict):
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
