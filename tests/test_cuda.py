"""The five algorithm files on a CUDA GPU, where there is one (skipped elsewhere, CI included: it has no GPU): each
trains a few steps end to end in bf16 autocast, the GPU path of the trainer (our AdamW's CUDA kernel, activation
checkpointing, the Triton kernels compiled) and of the sampler, and a run stopped after step 2 and resumed gives
the uninterrupted run's steps 3 and 4. The same properties on a CPU: each file's own tests."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_grpo import AS_IF_CUT, digit_model_dir, digits_task  # noqa: F401 (digit_model_dir: a fixture)

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (each file's CPU runs are "
                                                                     "tested in its own test file)")
# each file's own switch where its mechanism would otherwise wait (ExGRPO's delayed start)
OWN = {"exgrpo": ["--start-acc", "-1"], "eapo": ["--prior", "{model}"]}


def run(tmp_path, algo, model, *args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    own = [a.format(model=model) for a in OWN.get(algo, [])]
    r = subprocess.run([sys.executable, str(REPO / f"{algo}.py"), "--model", str(model), "--task",
                        str(digits_task(tmp_path)), "--prompts-per-step", "2", "--group-size", "8", "--max-new-tokens",
                        "1", "--eval-size", "3", "--micro-batch", "4", "--eval-every", "100", "--lr", "1e-2",
                        "--device", "cuda", "--dtype", "auto", *own, *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("algo", ["grpo", "exgrpo", "xrpo", "extra", "eapo"])
def test_trains_and_resumes_exactly_on_cuda(tmp_path, digit_model_dir, algo):  # noqa: F811
    run(tmp_path, algo, digit_model_dir, "--steps", "4", "--run-name", "full")
    run(tmp_path, algo, digit_model_dir, "--steps", "2", "--run-name", "cut", *AS_IF_CUT)
    run(tmp_path, algo, digit_model_dir, "--steps", "4", "--run-name", "cut", "--resume")

    def train_rows(name):
        lines = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith("perf/")}
                for r in map(json.loads, lines) if "reward/mean" in r}

    full, cut = train_rows("full"), train_rows("cut")
    assert sorted(cut) == [1, 2, 3, 4]
    assert any(full[s]["optim/grad_norm"] > 0 for s in (1, 2))  # it did learn before the cut
    for step in (3, 4):
        assert cut[step] == full[step], step
