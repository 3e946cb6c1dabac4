"""Data-parallel training on CPU with the gloo backend: 2 processes equal 1 process on the same global batch."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


def fixed_generate(model, prompts, n=1, max_new_tokens=8, **kw):
    """Stand-in for the sampler: completions that depend only on the prompt (no sampling noise), so that
    any split of the prompts over ranks sees the same rollouts."""
    from common.sampler import Sample

    out = []
    for p in prompts:
        ns = n if isinstance(n, int) else n[len(out)]
        group = []
        for j in range(ns):
            length = 2 + (sum(p) + j) % 4
            toks = [3 + (sum(p) * 31 + j * 17 + t * 7) % 900 for t in range(length)]
            group.append(Sample(toks, torch.zeros(length), torch.zeros(length), True))
        out.append(group)
    return out


def run_rank(rank, world, port, argv, out_dir):
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    os.chdir(out_dir)
    import common.evaluate
    import grpo

    grpo.generate = common.evaluate.generate = fixed_generate
    grpo.score = lambda text, answer: float(len(text) % 3 == 0)  # mixed, deterministic rewards
    grpo.main(argv)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weights(run_dir):
    from safetensors.torch import load_file
    return load_file(str(run_dir / "checkpoint" / "model.safetensors"))


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_two_processes_equal_one(tmp_path, tiny_model_dir, fsdp):
    argv = ["--model", str(tiny_model_dir), "--steps", "1", "--prompts-per-step", "4", "--group-size", "3",
            "--micro-batch", "2", "--eval-size", "2", "--lr", "1e-3", "--dtype", "float32", "--warmup-steps", "1", "--train-size", "40"]
    run_rank(0, 1, 0, argv + ["--run-name", "one"], tmp_path)
    mp.spawn(run_rank, args=(2, free_port(), argv + ["--run-name", "two"] + (["--fsdp"] if fsdp else []), tmp_path),
             nprocs=2, join=True)
    one, two = weights(tmp_path / "runs/one"), weights(tmp_path / "runs/two")
    base = weights_of_folder(tiny_model_dir)
    assert any(not torch.equal(one[k], base[k]) for k in one)  # the update did change the weights
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=1e-6, rtol=1e-5)
    rows = [json.loads(line) for line in (tmp_path / "runs/two/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1]


def weights_of_folder(folder):
    from safetensors.torch import load_file
    return {("model." + k if not k.startswith(("model.", "lm_head")) else k): v
            for k, v in load_file(str(folder / "model.safetensors")).items()}


def test_torchrun_two_steps(tmp_path, tiny_model_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port()),
           str(REPO / "grpo.py"), "--model", str(tiny_model_dir), "--steps", "2", "--run-name", "tr",
           "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "6", "--eval-size", "3",
           "--train-size", "50", "--micro-batch", "2"]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs/tr/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]  # each step once, from rank 0 alone
    assert [r["step"] for r in rows if "eval/greedy_acc" in r] == [0, 2]
    assert r.stdout.count("done: greedy accuracy") == 1
