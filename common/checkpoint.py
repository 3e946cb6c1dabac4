"""Checkpoints: a Hugging Face folder (loads in `transformers` and as our --model) plus trainer state.

    runs/<name>/checkpoint/   config.json  model.safetensors  tokenizer.json ...  trainer.pt

trainer.pt holds the step, the optimizer, the RNG states and whatever algorithm state the script passes.
Writing is atomic: everything goes to a fresh temporary folder which then replaces the old checkpoint by
renames, so a crash at any moment leaves either the old or the new checkpoint whole.
"""
import dataclasses
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError

from common import dist
from common.errors import RunError
from common.hub import resolve_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def save(ckpt_dir, model, weights: dict, optimizer_state: dict, step: int, model_source=None, extra: dict | None = None):
    """model: the Transformer (for its config); weights: its full state dict; model_source: the folder the
    run started from, whose tokenizer files are copied along."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
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
        raise RunError(f"writing the checkpoint of step {step} to {ckpt_dir} failed ({_reason(e)}); {kept}") from e
    old = ckpt_dir.with_name(ckpt_dir.name + ".old")
    if ckpt_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        ckpt_dir.rename(old)
    tmp.rename(ckpt_dir)
    shutil.rmtree(old, ignore_errors=True)


def save_run(model, optimizer, ckpt_dir, step: int, cfg, extra: dict | None = None):
    """A training run's checkpoint: fp32 master weights and optimizer state, whole (collectives under FSDP2: every
    rank calls this), the run's config (cfg, a dataclass) and the algorithm's `extra` state, written atomically by
    rank 0; never from non-finite weights, which would replace the last good checkpoint with garbage."""
    weights, optim_state = dist.full_state_dict(model), dist.optimizer_state(model, optimizer)
    if not all(torch.isfinite(dist.local(w)).all() for w in weights.values()):
        raise RunError(f"step {step}: the weights are not finite; not saved. The last good checkpoint in {ckpt_dir} "
                       "is intact (rerun with --resume and a lower --lr)")
    if dist.is_main():
        save(ckpt_dir, model, weights, optim_state, step, model_source=resolve_model_dir(cfg.model),
             extra={"config": dataclasses.asdict(cfg), **(extra or {})})
    dist.barrier()


def _reason(e: Exception) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[-1][:200]


def find(ckpt_dir) -> Path | None:
    """The newest complete checkpoint: the folder itself, or the previous one if a save was interrupted."""
    ckpt_dir = Path(ckpt_dir)
    for d in (ckpt_dir, ckpt_dir.with_name(ckpt_dir.name + ".old")):
        if (d / "trainer.pt").is_file() and (d / "model.safetensors").is_file():
            return d
    return None


def load_trainer_state(ckpt: Path) -> dict:
    """The saved step, optimizer state and extras; restores the RNG states as a side effect."""
    state = torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=False)
    set_rng_state(state["rng"])
    return state


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
