"""common/optim.py: the trainer's AdamW against torch.optim.AdamW (the same fused kernel, so the same bits) and
against its plain-PyTorch reference; its state through a checkpoint; and what it is for: a CPU training run that
imports neither torch._dynamo nor triton (common.model's activation checkpointing is the other half)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.optim import AdamW, adamw, adamw_reference
from conftest import DEVICES  # CUDA too where there is a GPU: a GPU run's trainer calls the kernel's CUDA build

ROOT = Path(__file__).resolve().parents[1]
HYPER = dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)


def params(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 5, generator=g).to(device).requires_grad_(),
            torch.randn(7, generator=g).to(device).requires_grad_(),
            torch.randn(3, 3, generator=g).to(device).requires_grad_()]


def grads(t, ps):
    """Step t's gradients; the last parameter has none at odd steps (left alone, its step count stays)."""
    g = torch.Generator().manual_seed(100 + t)
    return [None if (i == len(ps) - 1 and t % 2) else torch.randn(p.shape, generator=g).to(p.device)
            for i, p in enumerate(ps)]


def run(opt, ps, steps, start=0):
    for t in range(start, steps):
        for p, g in zip(ps, grads(t, ps)):
            p.grad = g
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_is_torch_fused_adamw_bit_for_bit(device):
    ours, theirs = params(device=device), params(device=device)
    run(AdamW(ours, **HYPER), ours, 6)
    run(torch.optim.AdamW(theirs, fused=True, **HYPER), theirs, 6)
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
    assert not torch.equal(ours[0], params(device=device)[0])  # it did move


def test_adamw_matches_the_plain_reference():
    ps, ref = params(), [p.detach().clone() for p in params()]
    m, v, n = [torch.zeros_like(p) for p in ref], [torch.zeros_like(p) for p in ref], [0] * len(ref)
    run(AdamW(ps, **HYPER), ps, 6)
    for t in range(6):
        for i, g in enumerate(grads(t, ref)):
            if g is not None:
                n[i] += 1
                adamw_reference(ref[i], g, m[i], v[i], n[i], HYPER["lr"], *HYPER["betas"], 1e-8, HYPER["weight_decay"])
    for p, q in zip(ps, ref):
        torch.testing.assert_close(p.detach(), q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("writer", ["ours", "torch"])
def test_a_saved_state_continues_exactly(tmp_path, writer):
    """Three steps, the state through torch.save, three more: the same weights as six steps at once. A state from
    torch.optim.AdamW (checkpoints written before common/optim.py) continues as torch's would."""
    ps = params()
    first = AdamW(ps, **HYPER) if writer == "ours" else torch.optim.AdamW(ps, fused=True, **HYPER)
    run(first, ps, 3)
    torch.save({"w": [p.detach() for p in ps], "opt": first.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt")
    resumed = [w.clone().requires_grad_() for w in saved["w"]]
    second = AdamW(resumed, lr=1.0, betas=(0.5, 0.5), weight_decay=0.0)  # the state brings the hyper-parameters back
    second.load_state_dict(saved["opt"])
    assert second.param_groups[0]["betas"] == HYPER["betas"] and second.param_groups[0]["lr"] == HYPER["lr"]
    run(second, resumed, 6, start=3)
    whole = params()
    run(AdamW(whole, **HYPER) if writer == "ours" else torch.optim.AdamW(whole, fused=True, **HYPER), whole, 6)
    for p, q in zip(resumed, whole):
        assert torch.equal(p, q)


def test_state_of_other_parameters_is_refused():
    opt = AdamW(params()[:2], **HYPER)
    with pytest.raises(ValueError, match="3 parameters for 2"):
        opt.load_state_dict(AdamW(params(), **HYPER).state_dict())


def test_zero_grad_drops_or_zeroes_in_place():
    ps = params()
    opt = AdamW(ps, **HYPER)
    for p in ps:
        p.grad = torch.ones_like(p)
    kept = ps[0].grad
    opt.zero_grad(set_to_none=False)
    assert ps[0].grad is kept and not kept.any()
    opt.zero_grad()
    assert all(p.grad is None for p in ps)


def test_sharded_runs_get_torch_adamw():
    assert isinstance(adamw(params(), sharded=True, **HYPER), torch.optim.AdamW)
    assert isinstance(adamw(params(), sharded=False, **HYPER), AdamW)


def test_a_cpu_training_step_imports_neither_dynamo_nor_triton(tmp_path, tiny_model_dir):
    """torch.optim's optimizers and torch.utils.checkpoint import torch._dynamo on first use, and it imports triton
    where installed: ~0.15 x 10^9 bytes of a CPU run's peak memory. A grpo.py step with gradient checkpointing on
    (the default) must not."""
    code = ("import itertools, sys, common.verifier\n"
            "n = itertools.count()\n"
            "common.verifier.score = lambda text, answer: float(next(n) % 2)  # varied rewards: a backward\n"
            "import grpo\n"
            f"grpo.main(['--model', {str(tiny_model_dir)!r}, '--steps', '2', '--prompts-per-step', '2', "
            "'--group-size', '2', '--eval-size', '2', '--max-new-tokens', '8', '--dtype', 'float32', "
            "'--device', 'cpu', '--run-name', 'r', '--train-size', '20'])\n"
            "loaded = [m for m in ('torch._dynamo', 'triton') if m in sys.modules]\n"
            "assert not loaded, loaded\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "runs/r/metrics.jsonl").read_text().splitlines()]
    assert any(r.get("perf/train_fwd_tokens", 0) > 0 for r in rows)  # a forward and backward through the blocks


def test_a_resumed_run_keeps_its_command_lines_hyper_parameters():
    """dist.load_optimizer_state brings back the moments and step counts but not the saved betas or weight decay:
    a run resumed with --adam-beta2 0.999 --weight-decay 0.1 trains with them (before, the checkpoint's silently
    won while the new run's config recorded the command line's)."""
    from common import dist

    model = torch.nn.Linear(3, 2)
    first = AdamW(model.parameters(), **HYPER)
    model(torch.randn(4, 3)).sum().backward()
    first.step()
    second = AdamW(model.parameters(), lr=1.0, betas=(0.5, 0.999), weight_decay=0.3)
    dist.load_optimizer_state(model, second, first.state_dict())
    group = second.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1.0, (0.5, 0.999), 0.3)
    saved = first.state_dict()["state"][0]
    assert all(torch.equal(second.state_dict()["state"][0][k], saved[k]) for k in saved)

