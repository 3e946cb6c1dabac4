"""grpo.py: the loop's properties, run through the loop's own functions (update, score, group_advantages) on a
tiny model: the first mini-batch's ratio is 1 and its gradient is REINFORCE's, micro-batching gives the big-batch
gradient, excluded prefix tokens get no gradient, groups of any size (one included), KL to an identical reference
is 0, a non-finite gradient skips the step and the checkpoint stays good; then main() end to end: smoke runs,
resume equivalence, bad input."""
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import grpo
from common import checkpoint, options
from common.batch import Batch, trainer_logprobs
from common.optim import AdamW
from common.config import RunError
from common.model import Transformer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return Transformer.from_pretrained(tiny_model_dir)


def make_batch(n=8, groups=(3, 1, 4), skips=None, seed=0):
    """n random context/completion pairs of different lengths in groups of the given sizes (a ragged batch),
    with skips[i] leading completion tokens excluded from the loss, and rewards that vary inside groups."""
    assert sum(groups) == n
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: torch.randint(lo, hi, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()  # noqa: E731
    ctx = [[int(x) for x in torch.randint(3, 1000, (len(rand(3, 8)),), generator=g)] for _ in range(n)]
    comps = [[int(x) for x in torch.randint(3, 1000, (len(rand(3, 9)),), generator=g)] for _ in range(n)]
    skip = torch.tensor(skips if skips is not None else [0] * n)
    group = torch.tensor([k for k, size in enumerate(groups) for _ in range(size)])
    lengths = torch.tensor([len(c) for c in comps])
    b = Batch(ctx, comps, group, skip, -torch.rand(int(lengths.sum()), generator=g), torch.ones(n, dtype=torch.bool),
                   ["0"] * n)
    rewards = torch.tensor([float(i % 2) for i in range(n)])
    return b, rewards


class RecordingOptimizer:
    """Stands in for AdamW: keeps each step's gradient and never changes the weights, so every mini-batch
    sees π_old and the gradients of different batchings can be compared."""

    def __init__(self, model):
        self.model, self.grads = model, []

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=True)

    def step(self):
        self.grads.append(torch.cat([p.grad.flatten().clone() for p in self.model.parameters()]))


def run_update(model, b, adv, **cfg_kw):
    cfg = grpo.Config(**{"max_grad_norm": 1e9, "temperature": 0.7, "max_new_tokens": 10, **cfg_kw})
    opt = RecordingOptimizer(model)
    old = trainer_logprobs(model, b, cfg.micro_batch, cfg.temperature, 0, torch.device("cpu"),
                           torch.autocast("cpu", enabled=False))[0] if cfg.epochs * cfg.mini_batches > 1 else None
    stats = grpo.update(model, model, opt, b, adv, cfg, 0, torch.device("cpu"), torch.autocast("cpu", enabled=False),
                        old_logp=old)
    return stats, opt.grads


def plain_logprobs(model, context, completion, temperature):
    """log π(completion | context) token by token, from full logits and log_softmax, one sequence alone (no padding,
    no fused head): an independent statement of what the trainer must compute."""
    ids = torch.tensor([context + completion])
    logits = model(ids)[0, len(context) - 1: -1].double() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


# ------------------------------------------------------------------------------- advantages

def test_group_advantages_ragged_groups_and_a_group_of_one():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 1.0, 1.0, 0.0])
    group = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2])  # sizes 3, 1, 4
    adv = grpo.group_advantages(rewards, group, "std")
    for k in range(3):
        r = rewards[group == k]
        want = (r - r.mean()) / (r.std() + 1e-6) if len(r) > 1 else torch.zeros(1)
        torch.testing.assert_close(adv[group == k], want)
    assert adv[3] == 0 and torch.isfinite(adv).all()  # the group of one: 0, never NaN
    centred = grpo.group_advantages(rewards, group, "none")
    torch.testing.assert_close(centred[5:], rewards[5:] - rewards[4:].mean())
    equal = grpo.group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]), "std")
    assert torch.equal(equal, torch.zeros(4))  # all-equal rewards: no signal


# ------------------------------------------------------------------------------- the update

def test_first_update_is_reinforce_with_ratio_one(model):
    """μ = M = 1: nothing is clipped, and the gradient is -Σ A ∇log π / (loss tokens), with log π computed here
    independently (full logits, one sequence at a time); excluded prefix tokens take no part."""
    b, rewards = make_batch(skips=[0, 2, 0, 1, 0, 0, 3, 0])
    adv = grpo.group_advantages(rewards, b.group, "std")
    stats, grads = run_update(model, b, adv, micro_batch=3)
    assert stats["clip_low"] == stats["clip_high"] == 0 and stats["approx_kl"] == 0
    model.zero_grad(set_to_none=True)
    n_loss = int((b.lengths - b.skip).sum())
    loss = sum(-adv[i] * plain_logprobs(model, b.context[i], b.tokens[i], 0.7)[int(b.skip[i]):].sum()
               for i in range(len(b.tokens))) / n_loss
    loss.backward()
    reinforce = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], reinforce, atol=1e-6, rtol=1e-4)


def test_zero_advantage_completions_are_not_run_but_counted(model):
    """A group whose rewards are all equal (A = 0) is left out of the forward and backward, yet the gradient is the
    full batch's: its tokens still count in the token-mean's denominator. With an entropy bonus (or KL), every
    completion is run."""
    b, _ = make_batch(skips=[0, 1, 0, 0, 0, 2, 0, 0])
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])  # group 0 all right, group 1 of one
    adv = grpo.group_advantages(rewards, b.group, "std")
    assert (adv[:4] == 0).all() and (adv[4:] != 0).all()
    stats, grads = run_update(model, b, adv, micro_batch=3)
    n_loss = (b.lengths - b.skip)
    assert stats["tokens"] == int(n_loss[4:].sum())  # only the last group went through the model
    model.zero_grad(set_to_none=True)
    loss = sum(-adv[i] * plain_logprobs(model, b.context[i], b.tokens[i], 0.7)[int(b.skip[i]):].sum()
               for i in range(4, 8)) / int(n_loss.sum())
    loss.backward()
    want = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(grads[0], want, atol=1e-6, rtol=1e-4)
    with_entropy, _ = run_update(model, b, adv, micro_batch=3, entropy_coef=0.01)
    assert with_entropy["tokens"] == int(n_loss.sum())
    # nothing to learn from: no forward at all, and the optimizer still steps on a zero gradient (AdamW's momentum
    # moves the weights as it would have)
    stats, grads = run_update(model, b, torch.zeros(8))
    assert stats["tokens"] == 0 and stats["opt_steps"] == 1 and len(grads) == 1 and not grads[0].any()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_give_the_big_batch_gradient(model, agg):
    b, rewards = make_batch(skips=[1, 0, 0, 2, 0, 1, 0, 0])
    adv = grpo.group_advantages(rewards, b.group, "std")
    _, big = run_update(model, b, adv, loss_agg=agg, micro_batch=8)
    _, small = run_update(model, b, adv, loss_agg=agg, micro_batch=3)
    torch.testing.assert_close(big[0], small[0], atol=1e-7, rtol=1e-5)


def test_excluded_prefix_equals_prefix_in_the_context(model):
    """A completion whose first k tokens are excluded trains exactly like one whose context holds those k tokens:
    no gradient through them, and they count in no denominator."""
    skips = [2, 0, 1, 0, 0, 3, 0, 1]
    b, rewards = make_batch(skips=skips)
    moved = Batch([c + t[:k] for c, t, k in zip(b.context, b.tokens, skips)], [t[k:] for t, k in zip(b.tokens, skips)],
                       b.group, torch.zeros(8, dtype=torch.long), b.sampler_logp[b.train_mask()], b.finished, b.answer)
    adv = grpo.group_advantages(rewards, b.group, "std")
    for agg in ("token-mean", "seq-mean-token-mean"):
        _, with_skip = run_update(model, b, adv, loss_agg=agg, micro_batch=4)
        _, with_context = run_update(model, moved, adv, loss_agg=agg, micro_batch=4)
        torch.testing.assert_close(with_skip[0], with_context[0], atol=1e-7, rtol=1e-5)


def test_a_mini_batch_with_no_completion_takes_no_optimizer_step(model):
    """Three completions left (--dynamic-sampling dropped the rest) and M = 4: mini-batches 0..3 hold 0, 1, 1 and 1
    completions, so each epoch takes three optimizer steps; an empty one would be an AdamW step on no data."""
    b, rewards = make_batch(skips=[0, 1, 0, 0, 2, 0, 0, 1])
    keep = torch.tensor([False] * 5 + [True] * 3)
    b, rewards = b.select(keep), rewards[keep]
    adv = grpo.group_advantages(rewards, b.group, "std")
    stats, grads = run_update(model, b, adv, mini_batches=4, epochs=2, micro_batch=3)
    assert stats["opt_steps"] == len(grads) == 6


def test_several_mini_batches_and_epochs_keep_ratio_one_on_pi_old(model):
    """M = 2, μ = 2 with old log-probs from the scoring pass: the weights never move here, so every token's ratio
    must be exactly 1 (old log-probs aligned token by token, skips included) and one gradient per mini-batch."""
    b, rewards = make_batch(skips=[0, 1, 0, 0, 2, 0, 0, 1])
    adv = grpo.group_advantages(rewards, b.group, "std")
    stats, grads = run_update(model, b, adv, mini_batches=2, epochs=2, micro_batch=3)
    assert len(grads) == 4 and stats["opt_steps"] == 4
    assert stats["approx_kl"] < 1e-10 and stats["clip_low"] == stats["clip_high"] == 0
    torch.testing.assert_close(grads[0], grads[2])  # epoch 2 repeats epoch 1 on unchanged weights


def test_a_group_of_one_adds_nothing(model):
    b, rewards = make_batch(n=8, groups=(3, 1, 4))
    adv = grpo.group_advantages(rewards, b.group, "none")
    assert adv[3] == 0
    _, with_single = run_update(model, b, adv, loss_agg="seq-mean-token-sum-norm", adv_norm="none")
    keep = b.group != 1
    _, without = run_update(model, b.select(keep), adv[keep], loss_agg="seq-mean-token-sum-norm", adv_norm="none")
    # the constant normaliser counts completions: 8 with the single, 7 without
    torch.testing.assert_close(with_single[0] * 8 / 7, without[0], atol=1e-7, rtol=1e-5)


def test_kl_to_an_identical_reference_is_zero(model):
    """A KL term to a reference equal to the policy adds exactly nothing to the gradient. Every group's rewards vary,
    so both updates train the same completions in the same one micro-batch, the one the reference is scored in: the
    KL term is then the only difference (with a zero-advantage group the KL run would also train it, in other
    micro-batch shapes, and the two gradients would differ by rounding that depends on the CPU's kernels)."""
    b, rewards = make_batch(groups=(2, 2, 4))
    adv = grpo.group_advantages(rewards, b.group, "std")
    assert (adv != 0).all()
    cpu, plain = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    ref, _ = trainer_logprobs(model, b, 8, 0.7, 0, cpu, plain)
    grads = []
    for kl in (0.0, 0.5):
        opt = RecordingOptimizer(model)
        stats = grpo.update(model, model, opt, b, adv, grpo.Config(temperature=0.7, kl_coef=kl, max_grad_norm=1e9), 0,
                            cpu, plain, ref_logp=ref)
        grads.append(opt.grads[0])
    assert stats["ref_kl"] == pytest.approx(0, abs=1e-9)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-7, rtol=1e-6)


def test_reference_is_scored_like_the_policy(tiny_model_dir):
    """The reference model is loaded and run as the policy is (fp32 weights under the same autocast), so
    KL(π_θ || π_ref) is exactly 0 before the first update, in bf16 autocast too."""
    policy, ref = Transformer.from_pretrained(tiny_model_dir), Transformer.from_pretrained(tiny_model_dir)
    b, _ = make_batch()
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    assert torch.equal(trainer_logprobs(policy, b, 4, 0.8, 0, torch.device("cpu"), bf16)[0],
                       trainer_logprobs(ref, b, 4, 0.8, 0, torch.device("cpu"), bf16)[0])


def test_trainer_logprobs_equal_each_sequence_alone(model):
    """Right padding and the fused head change nothing: each completion's scored log-probs equal those of a
    plain forward of that sequence alone."""
    b, _ = make_batch()
    logp, entropy = trainer_logprobs(model, b, 8, 0.7, 0, torch.device("cpu"), torch.autocast("cpu", enabled=False))
    alone = torch.cat([plain_logprobs(model, c, t, 0.7) for c, t in zip(b.context, b.tokens)])
    torch.testing.assert_close(logp.double(), alone.detach(), atol=2e-5, rtol=1e-5)
    assert (entropy > 0).all()


def test_token_weights():
    lengths = torch.tensor([2, 4])
    torch.testing.assert_close(grpo.token_weights(lengths, "seq-mean-token-mean", 8, 2, 6),
                               torch.tensor([1 / 4, 1 / 4, 1 / 8, 1 / 8, 1 / 8, 1 / 8]))
    torch.testing.assert_close(grpo.token_weights(lengths, "seq-mean-token-sum-norm", 8, 2, 6), torch.full((6,), 1 / 16))
    torch.testing.assert_close(grpo.token_weights(lengths, "token-mean", 8, 2, 6), torch.full((6,), 1 / 6))


@pytest.mark.parametrize("loss_type", ["clip", "cispo"])
@pytest.mark.parametrize("options", [{}, {"weights"}, {"seq_ids"}, {"sampler_logp"}, {"ref_logp"}, {"entropy"},
                                     {"weights", "seq_ids", "sampler_logp", "ref_logp", "entropy"}])
def test_token_loss_plain_is_the_fused_loss(options, loss_type):
    """grpo.py's written-out loss and the fused call it stands beside: equal values, clip masks and gradients (logp
    and entropy) in float64, with ratios spread far enough that both clips and the TIS cap act."""
    g = torch.Generator().manual_seed(1)
    n = 40
    logp = (-3 * torch.rand(n, generator=g, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + 0.6 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    entropy = (2 * torch.rand(n, generator=g, dtype=torch.float64)).requires_grad_()
    kw = {"weights": torch.rand(n, generator=g, dtype=torch.float64) * 2,
          "seq_ids": torch.randint(0, 5, (n,), generator=g),
          "sampler_logp": old + 0.5 * torch.randn(n, generator=g, dtype=torch.float64),
          "ref_logp": logp.detach() + torch.randn(n, generator=g, dtype=torch.float64)}
    kw = {k: v for k, v in kw.items() if k in options}
    cfg = grpo.Config(tis_cap=1.5 if "sampler_logp" in options else 0.0, kl_coef=0.05 if "ref_logp" in options else 0,
                      entropy_coef=0.01 if "entropy" in options else 0.0, loss_type=loss_type)
    outs = [f(logp, old, adv, entropy, cfg, **dict(kw)) for f in (grpo.token_loss, grpo.token_loss_plain)]
    (fused, low_f, high_f), (plain, low_p, high_p) = outs
    assert (low_p.any() or loss_type == "cispo") and high_p.any()  # both clips (CISPO's one) act on these inputs
    assert torch.equal(low_f, low_p) and torch.equal(high_f, high_p)
    torch.testing.assert_close(fused.double(), plain, rtol=1e-5, atol=1e-6)  # the kernel computes in fp32
    weights = torch.rand(n, generator=g, dtype=torch.float64)
    grads = [torch.autograd.grad((loss.double() * weights).sum(), (logp, entropy), allow_unused=True)
             for loss in (fused, plain)]
    for a, b in zip(*grads):
        if a is None or b is None:  # entropy has no gradient when the bonus is off, in both
            assert a is None or not a.any()
            assert b is None or not b.any()
        else:
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def test_policy_metrics_average_the_tokens_the_update_trains_also_under_torchrun(model, monkeypatch):
    """The policy/ means are over the tokens the update trains: on one process the completions with A != 0, all of
    them under an entropy bonus or a KL. Under torchrun every completion goes through the forward (ranks run the same
    forwards), and the means must still cover the same tokens (they covered every forwarded one, so the logged entropy
    moved with the world size). Catches stats taken over every forwarded token."""
    b, _ = make_batch()
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])  # group 0 all right, group 1 of one: A = 0
    adv = grpo.group_advantages(rewards, b.group, "std")
    on = (adv != 0).repeat_interleave(b.lengths - b.skip)  # loss tokens with an advantage (make_batch: skip then loss)

    def metrics(**kw):
        cfg = grpo.Config(max_grad_norm=1e9, temperature=0.7, max_new_tokens=10, **kw)
        stats = grpo.update(model, model, RecordingOptimizer(model), b, adv, cfg, 0, torch.device("cpu"),
                            torch.autocast("cpu", enabled=False))
        return grpo.step_metrics(b, rewards, rewards, 3, 2, 0, stats, (0, 1, 2, 3)), stats
    one, stats = metrics()
    assert stats["policy_tokens"] == stats["tokens"] == on.sum()  # one process forwards only those
    bonus, stats = metrics(entropy_coef=1e-3)
    assert stats["policy_tokens"] == stats["tokens"] == len(on) > on.sum()  # the bonus trains every token
    monkeypatch.setattr(grpo.dist, "world", lambda: 2)  # what each rank does under torchrun: every completion runs
    ranks, stats = metrics()
    assert stats["tokens"] == len(on) and stats["policy_tokens"] == on.sum()
    ranks_bonus, _ = metrics(entropy_coef=1e-3)
    for name in ("policy/entropy", "policy/approx_kl", "policy/sampler_logp_diff"):
        assert ranks[name] == pytest.approx(one[name], rel=1e-5), name
        assert ranks_bonus[name] == pytest.approx(bonus[name], rel=1e-5), name
    assert one["policy/entropy"] != pytest.approx(bonus["policy/entropy"], rel=1e-3)  # the two sets differ


def test_non_finite_gradient_skips_the_step(model, monkeypatch):
    b, rewards = make_batch()
    adv = grpo.group_advantages(rewards, b.group, "std")
    real = grpo.policy_loss

    def nan_loss(logp, *args, **kw):
        loss, low, high = real(logp, *args, **kw)
        return loss * float("nan"), low, high

    monkeypatch.setattr(grpo, "policy_loss", nan_loss)
    before = [p.detach().clone() for p in model.parameters()]
    opt = AdamW(model.parameters(), lr=1e-2)
    cfg = grpo.Config(mini_batches=2)
    stats = grpo.update(model, model, opt, b, adv, cfg, 0, torch.device("cpu"), torch.autocast("cpu", enabled=False))
    assert stats["skipped"] == 2 and stats["opt_steps"] == 0 and stats["skipped_since_last_step"] == 2
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))


def test_checkpoint_is_on_disk_before_the_old_one_goes(tmp_path, tiny_model_dir, monkeypatch):
    """After a power loss either checkpoint is whole: every file of the new one and its folder are synced before the
    renames, and the parent folder (the renames) before the old one is deleted. Fails without any of the syncs."""
    m = Transformer.from_pretrained(tiny_model_dir)
    ckpt, cfg = tmp_path / "checkpoint", grpo.Config(model=str(tiny_model_dir))
    checkpoint.save_run(m, AdamW(m.parameters(), lr=1e-3), ckpt, 1, cfg)
    synced, real_sync = [], checkpoint.sync

    def spy(path):
        synced.append((Path(path), (tmp_path / "checkpoint.old").exists(), ckpt.exists()))
        real_sync(path)
    monkeypatch.setattr(checkpoint, "sync", spy)
    checkpoint.save_run(m, AdamW(m.parameters(), lr=1e-3), ckpt, 2, cfg)
    files = {p.name for p in ckpt.iterdir()}
    before = [(p, old, new) for p, old, new in synced if p.parent == tmp_path and p.name.startswith("checkpoint.tmp-")]
    assert {p.name for p, _, _ in synced if p.parent.name.startswith("checkpoint.tmp-")} == files
    assert len(before) == 1 and before[0][2]  # the new folder itself, while the old checkpoint still stood
    assert synced[-1] == (tmp_path, True, True)  # the renames, before the old checkpoint is deleted
    assert not (tmp_path / "checkpoint.old").exists()


def test_no_checkpoint_from_non_finite_weights(tmp_path, tiny_model_dir):
    m = Transformer.from_pretrained(tiny_model_dir)
    opt = AdamW(m.parameters(), lr=1e-3)
    ckpt = tmp_path / "checkpoint"
    cfg = grpo.Config(model=str(tiny_model_dir))
    checkpoint.save_run(m, opt, ckpt, 1, cfg)
    good = (ckpt / "model.safetensors").read_bytes()
    with torch.no_grad():
        m.norm.weight[0] = float("nan")
    with pytest.raises(RunError, match="not finite"):
        checkpoint.save_run(m, opt, ckpt, 2, cfg)
    assert (ckpt / "model.safetensors").read_bytes() == good
    # a save killed half-way (SIGKILL) leaves its temporary folder: the next save removes it; one interrupted by
    # Ctrl-C removes its own
    (tmp_path / "checkpoint.tmp-killed").mkdir()
    (tmp_path / "checkpoint.tmp-killed" / "trainer.pt").write_bytes(b"partial")
    with torch.no_grad():
        m.norm.weight[0] = 1.0

    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    real_save = torch.save
    torch.save = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save_run(m, opt, ckpt, 3, cfg)
    finally:
        torch.save = real_save
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    assert (ckpt / "model.safetensors").read_bytes() == good


def test_open_run_refuses_in_one_line_what_cannot_be_started_or_resumed(tmp_path, tiny_model_dir, monkeypatch):
    """checkpoint.open_run, the five files' first step: a run name taken by a file, a run that saved no checkpoint
    (before: neither reusable nor resumable, and no word of deleting it), a damaged trainer.pt (before: a torch.load
    traceback) and another algorithm file's checkpoint (before: a KeyError in xrpo.py, extra.py and eapo.py, and
    grpo.py went on silently)."""
    from common.errors import ConfigError
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()

    def refused(name, resume, match):
        with pytest.raises(ConfigError, match=match):
            checkpoint.open_run(grpo.Config(model=str(tiny_model_dir), run_name=name, resume=resume))

    (tmp_path / "runs/file").write_text("")
    refused("file", False, "is a file")
    for outside in ("../x", "a/b", "..", "/tmp/x"):  # runs/<run-name> stays inside runs/
        refused(outside, False, "a plain folder name")
    (tmp_path / "runs/dead").mkdir()
    (tmp_path / "runs/dead/metrics.jsonl").write_text("")  # a run that stopped before its first checkpoint
    refused("dead", False, "saved no checkpoint: delete it")
    refused("dead", True, "before its first one: delete the folder")
    assert checkpoint.kept("runs/dead/checkpoint").startswith("No checkpoint was saved yet")
    cfg = grpo.Config(model=str(tiny_model_dir), run_name="fresh")
    assert checkpoint.open_run(cfg)[2:] == (None, None)
    assert checkpoint.open_run(grpo.Config(model=str(tiny_model_dir)))[0].name.startswith("grpo-")  # an unnamed run
    m = Transformer.from_pretrained(tiny_model_dir)
    checkpoint.save_run(m, AdamW(m.parameters(), lr=1e-3), "runs/fresh/checkpoint", 3, cfg)
    (tmp_path / "runs/fresh/metrics.jsonl").write_text("")
    refused("fresh", False, "add --resume")
    assert checkpoint.kept("runs/fresh/checkpoint").startswith("The last checkpoint in runs/fresh/checkpoint is intact")
    run_dir, _, ckpt, state = checkpoint.open_run(replace(cfg, resume=True))
    assert run_dir == Path("runs/fresh") and ckpt is not None and state["step"] == 3
    assert state["extra"]["algorithm"] == "grpo"
    saved = torch.load(ckpt / "trainer.pt", weights_only=False)
    saved["extra"]["algorithm"] = "xrpo"
    torch.save(saved, ckpt / "trainer.pt")
    refused("fresh", True, "a checkpoint of grpo.py; .* was written by xrpo.py")
    (ckpt / "trainer.pt").write_bytes((ckpt / "trainer.pt").read_bytes()[:1000])  # truncated
    refused("fresh", True, "trainer.pt is damaged")



def test_ctrl_c_says_how_to_continue_the_run_it_stopped(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """Ctrl-C's last line names what the run left behind: before its first checkpoint there is nothing to resume
    (before: "rerun with --resume", which then failed), after it the command that continues it, with the run's
    name (an unnamed run's name is made up from the time: before, the user was not told it). --resume without
    --run-name is refused in one line (before: a run named from the current time, and "no checkpoint" in it)."""
    from common import config
    from common.errors import ConfigError
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(config, "interrupt_note", None)

    def interrupted(cfg, save=False):
        def main():
            run_dir, ckpt_dir, _, _ = checkpoint.open_run(cfg)
            if save:
                m = Transformer.from_pretrained(tiny_model_dir)
                checkpoint.save_run(m, AdamW(m.parameters(), lr=1e-3), ckpt_dir, 1, cfg)
                (run_dir / "metrics.jsonl").write_text("")
            raise KeyboardInterrupt
        with pytest.raises(SystemExit) as e:
            config.main_guard(main)
        assert e.value.code == 130
        return capsys.readouterr().err

    assert interrupted(grpo.Config(model=str(tiny_model_dir), run_name="a")) == \
        "interrupted. No checkpoint was saved yet (nothing to resume: start the run again)\n"
    cfg = grpo.Config(model=str(tiny_model_dir))  # unnamed: grpo-<date-time>
    err = interrupted(cfg, save=True)
    assert cfg.run_name.startswith("grpo-") and err == (
        f"interrupted. The last checkpoint in runs/{cfg.run_name}/checkpoint is intact (rerun with --run-name "
        f"{cfg.run_name} --resume to continue from it)\n")
    with pytest.raises(ConfigError, match="--resume: expected --run-name NAME with it"):
        checkpoint.open_run(grpo.Config(model=str(tiny_model_dir), resume=True))
    run_dir, _, ckpt, state = checkpoint.open_run(grpo.Config(model=str(tiny_model_dir), run_name=cfg.run_name,
                                                              resume=True))  # the command it printed works
    assert ckpt is not None and state["step"] == 1

def test_lr_warms_up_holds_then_decays_over_the_last_steps():
    f = [grpo.lr_factor(s, grpo.Config(steps=15, warmup_steps=3, decay_steps=3)) for s in range(15)]
    assert f == pytest.approx([1 / 3, 2 / 3] + [1.0] * 10 + [3 / 4, 2 / 4, 1 / 4])  # the last update is small, not 0
    assert [grpo.lr_factor(s, grpo.Config(steps=15, warmup_steps=3, decay_steps=0)) for s in range(15)] == \
        pytest.approx([1 / 3, 2 / 3] + [1.0] * 13)  # --decay-steps 0: constant to the end
    assert [grpo.lr_factor(s, grpo.Config(steps=3, warmup_steps=0, decay_steps=5)) for s in range(3)] == \
        pytest.approx([3 / 6, 2 / 6, 1 / 6])  # a run shorter than its decay starts part-way down


def test_step_prompts_cover_each_epoch_once():
    train = list(range(10))
    seen = [p for step in range(1, 6) for p in grpo.step_prompts(train, step, 4, seed=1)]
    assert sorted(seen[:10]) == train and sorted(seen[10:20]) == train
    assert grpo.step_prompts(train, 3, 4, seed=1) == grpo.step_prompts(train, 3, 4, seed=1)


# -------------------------------------------------------------------------------- end to end

def run_grpo(tmp_path, *args, check=True):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(REPO / "grpo.py"), *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


TINY_RUN = ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "6", "--eval-size", "3",
            "--train-size", "50", "--micro-batch", "2", "--temperature", "1.0", "--dtype", "float32"]


def metrics(tmp_path, name):
    return [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def test_smoke_two_steps(tmp_path, tiny_model_dir):
    r = run_grpo(tmp_path, "--model", str(tiny_model_dir), "--steps", "2", "--run-name", "smoke", *TINY_RUN)
    rows = metrics(tmp_path, "smoke")
    assert [row["step"] for row in rows if "reward/mean" in row] == [1, 2]
    assert [row["step"] for row in rows if "eval/greedy_acc" in row] == [0, 2]
    # the rate each step's update used, not the next step's: 1/3 of --lr (warm-up), then 1/4 (the last of 2 steps is
    # also the last of the --decay-steps 3 decay, which wins over the warm-up's 2/3)
    assert [row["optim/lr"] for row in rows if "reward/mean" in row] == pytest.approx([1e-5, 0.75e-5])
    assert "done: greedy accuracy" in r.stdout
    ckpt = tmp_path / "runs" / "smoke" / "checkpoint"
    assert Transformer.from_pretrained(ckpt).cfg.num_layers == 2  # the checkpoint is a model folder


@pytest.fixture(scope="module")
def digit_model_dir(tiny_model_dir, tmp_path_factory):
    """A tiny model that answers with one digit token, so that rewards vary and updates happen:
    its untied LM head scores only the ten digit tokens."""
    import shutil

    from common.tokenizer import Tokenizer

    m = Transformer.from_pretrained(tiny_model_dir)
    m.cfg.tie_word_embeddings = False
    digits = [Tokenizer.from_pretrained(tiny_model_dir).encode(str(d))[0] for d in range(10)]
    head = torch.zeros_like(m.lm_head.weight)
    head[digits] = 3.0 * torch.randn(10, head.shape[1], generator=torch.Generator().manual_seed(0))
    m.lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
    m.lm_head.weight.data.copy_(head)
    folder = tmp_path_factory.mktemp("digit") / "model"
    m.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, folder / name)
    return folder


# A run cut at step 2 by a crash had taken the whole run's rates; asked for 2 steps, it would decay its own last steps
# (--decay-steps): it runs without the decay, which in the 4-step run is still under the warm-up at steps 1 and 2.
AS_IF_CUT = ["--decay-steps", "0"]


def test_resume_gives_the_same_run(tmp_path, digit_model_dir):
    common = digit_run(digit_model_dir, tmp_path)
    run_grpo(tmp_path, *common, "--steps", "4", "--run-name", "full")
    run_grpo(tmp_path, *common, "--steps", "2", "--run-name", "cut", *AS_IF_CUT)
    run_grpo(tmp_path, *common, "--steps", "4", "--run-name", "cut", "--resume")

    def train_rows(name):
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith("perf/")}
                for r in metrics(tmp_path, name) if "reward/mean" in r}

    full, cut = train_rows("full"), train_rows("cut")
    assert sorted(cut) == [1, 2, 3, 4]
    assert sum(full[s]["optim/grad_norm"] > 0 for s in (1, 2)) >= 1  # the model did change before the cut
    for step in (3, 4):
        assert cut[step] == full[step], step


@pytest.mark.parametrize("args,words", [
    (["--model", "no/such/model"], ["no/such/model", "not found"]),
    (["--task", "no_such_task"], ["unknown task", "no_such_task"]),
    (["--task", "missing.jsonl"], ["missing.jsonl"]),
    (["--task", "bad.jsonl"], ["bad.jsonl:2"]),
    (["--group-size", "1"], ["--group-size", "at least 2"]),
    (["--eval-every", "0"], ["--eval-every", "positive"]),
    (["--save-every", "0"], ["--save-every", "positive"]),
    (["--train-size", "-1"], ["--train-size", "non-negative"]),
    (["--decay-steps", "-1"], ["--decay-steps", "non-negative"]),
    (["--max-new-tokens", "5000"], ["--max-new-tokens", "positions"]),
    (["--tis-cap", "0.5"], ["--tis-cap"]),
    (["--prompts-per-step", "3", "--group-size", "3", "--mini-batches", "10"], ["--mini-batches"]),
    (["--loss-agg", "mean"], ["--loss-agg", "invalid choice"]),
    (["--refill-rounds", "2"], ["--refill-rounds", "--dynamic-sampling"]),
    (["--overlong-buffer", "6"], ["--overlong-buffer", "shorter than max_new_tokens"]),
    (["--top-entropy", "0"], ["--offpolicy-mask/top-entropy", "(0, 1]"]),
    (["--tis-floor", "1"], ["--tis-floor", "[0, 1)"]),
    (["--tis-floor", "0.5"], ["--tis-floor", "token-mask or sequence-mask"]),
    (["--tis-cap", "2", "--tis-floor", "0.5"], ["--tis-floor", "no floor"]),
    (["--tracker", "mlflow"], ["--tracker", "invalid choice"]),
    (["--max-grad-norm", "0"], ["--max-grad-norm", "positive"]),
    (["--eval-samples", "-1"], ["--eval-samples", "non-negative"]),
    (["--task", "one.jsonl"], ["one.jsonl", "split is empty"]),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, tiny_model_dir, args, words):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2"\n')
    (tmp_path / "one.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')  # one of its two splits is empty
    argv = ["--model", str(tiny_model_dir), "--run-name", "bad", *TINY_RUN, *args]
    r = run_grpo(tmp_path, *argv, check=False)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a CUDA GPU")
def test_cuda_without_a_gpu_is_one_line(tmp_path, tiny_model_dir):
    r = run_grpo(tmp_path, "--model", str(tiny_model_dir), "--run-name", "bad", *TINY_RUN, "--device", "cuda", check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--device" in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()


def digits_task(tmp_path):
    task = tmp_path / "digits.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"Say {d}", "answer": str(d)}) + "\n" for d in list(range(10)) * 3))
    return task


def digit_run(digit_model_dir, tmp_path):
    return ["--model", str(digit_model_dir), "--task", str(digits_task(tmp_path)), "--prompts-per-step", "2",
            "--group-size", "8", "--max-new-tokens", "1", "--eval-size", "3", "--micro-batch", "4", "--eval-every", "100",
            "--lr", "1e-2", "--dtype", "float32"]


def test_loop_with_every_option_on(tmp_path, digit_model_dir):
    """M > 1, μ > 1, β > 0, dynamic sampling, GSPO ratio, truncated IS and an entropy bonus, in main() itself."""
    run_grpo(tmp_path, *digit_run(digit_model_dir, tmp_path), "--steps", "3", "--run-name", "all", "--epochs", "2",
             "--mini-batches", "2", "--kl-coef", "0.1", "--dynamic-sampling", "--seq-ratio", "--tis-cap", "2",
             "--entropy-coef", "0.01", "--warmup-steps", "1")
    rows = [r for r in metrics(tmp_path, "all") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    trained = [r for r in rows if r["reward/groups_dropped"] < 2]
    assert trained, "every group was dropped: the digit model's rewards did not vary"
    for r in trained:
        assert r["optim/grad_norm"] > 0 and r["optim/skipped_steps"] == 0
        assert r["policy/ref_kl"] >= 0 and r["policy/approx_kl"] >= 0
    assert any(r["policy/approx_kl"] > 0 for r in trained)  # the second epoch/mini-batch sees moved weights


def test_diverged_run_stops_and_keeps_the_checkpoint(tmp_path, digit_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # an entropy bonus runs every completion through the loss, also those of groups with advantage 0
    argv = [*digit_run(digit_model_dir, tmp_path), "--run-name", "nan", "--save-every", "1", "--max-skipped", "2",
            "--entropy-coef", "0.001"]
    grpo.main([*argv, "--steps", "2"])
    ckpt = tmp_path / "runs" / "nan" / "checkpoint"
    good = (ckpt / "model.safetensors").read_bytes()
    real = grpo.policy_loss
    monkeypatch.setattr(grpo, "policy_loss", lambda logp, *a, **k: (real(logp, *a, **k)[0] * float("nan"), *real(logp, *a, **k)[1:]))
    with pytest.raises(RunError, match="2 optimizer steps in a row"):
        grpo.main([*argv, "--steps", "6", "--resume"])
    rows = [r for r in metrics(tmp_path, "nan") if "optim/skipped_steps" in r]
    assert [r["optim/skipped_steps"] for r in rows if r["step"] > 2][:1] == [1.0]
    assert (ckpt / "model.safetensors").read_bytes() == good  # the skipped steps changed no weight
    # step 3's checkpoint holds the streak (1 skipped): resumed, step 4 is the second in a row, as it was before
    # (a streak restarted at 0 would stop the run a step later, at step 5)
    assert torch.load(ckpt / "trainer.pt", weights_only=False)["step"] == 3
    with pytest.raises(RunError, match="step 4: 2 optimizer steps in a row"):
        grpo.main([*argv, "--steps", "6", "--resume"])


def test_a_failed_checkpoint_write_is_one_line_and_keeps_the_last_one(tmp_path, digit_model_dir, monkeypatch):
    """A full disk while writing step 2's checkpoint: a RunError naming the folder and the cause (main_guard prints it
    as one line), no partial folder left behind, step 1's checkpoint whole, and the run resumes from it."""
    monkeypatch.chdir(tmp_path)
    argv = [*digit_run(digit_model_dir, tmp_path), "--run-name", "full", "--save-every", "1"]
    grpo.main([*argv, "--steps", "1"])
    run = tmp_path / "runs" / "full"

    def disk_full(self, path, state_dict=None):
        (Path(path) / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(Transformer, "save_pretrained", disk_full)
        with pytest.raises(RunError, match=r"step 2 .*No space left on device.*earlier step .* is kept"):
            grpo.main([*argv, "--steps", "2", "--resume"])
    assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == ["checkpoint"]
    assert torch.load(run / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 1
    grpo.main([*argv, "--steps", "2", "--resume"])
    assert torch.load(run / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 2


def test_resume_after_a_torn_metrics_line_and_refuses_other_data(tmp_path, digit_model_dir):
    argv = [*digit_run(digit_model_dir, tmp_path), "--run-name", "torn"]
    run_grpo(tmp_path, *argv, "--steps", "1")
    log = tmp_path / "runs" / "torn" / "metrics.jsonl"
    log.write_text(log.read_text() + '{"step": 2, "reward/me')  # a crash in the middle of a write
    r = run_grpo(tmp_path, *argv, "--steps", "2", "--resume", "--seed", "5", check=False)
    assert r.returncode == 2 and "--seed" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    run_grpo(tmp_path, *argv, "--steps", "2", "--resume")
    assert [row["step"] for row in metrics(tmp_path, "torn") if "reward/mean" in row] == [1, 2]
    # resumed at its end: one line says so (before: exit 0 and nothing printed at all)
    r = run_grpo(tmp_path, *argv, "--steps", "2", "--resume")
    assert "nothing to train: runs/torn has trained 2 steps (--steps 2)" in r.stdout, r.stdout


def test_existing_run_is_not_overwritten(tmp_path, tiny_model_dir):
    (tmp_path / "runs" / "taken").mkdir(parents=True)
    (tmp_path / "runs" / "taken" / "metrics.jsonl").write_text('{"step": 0}\n')
    r = run_grpo(tmp_path, "--model", str(tiny_model_dir), "--run-name", "taken", *TINY_RUN, check=False)
    assert r.returncode == 2 and "--run-name" in r.stderr and "saved no checkpoint: delete it" in r.stderr
    assert (tmp_path / "runs" / "taken" / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_evaluate_command_line(tmp_path, tiny_model_dir):
    """python -m common.evaluate: greedy accuracy, pass@k and maj@k lines on a data file."""
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(4)))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "common.evaluate", "--model", str(tiny_model_dir), "--data", "p.jsonl",
                        "--split", "all", "--samples", "4", "--max-new-tokens", "4"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    for key in ("greedy_acc", "maj@4", "pass@1", "pass@2", "pass@4"):
        assert key in r.stdout, r.stdout


def test_evaluations_decode_the_eval_budget_after_the_checkpoint(tmp_path, digit_model_dir, monkeypatch):
    """Evaluations decode max(--eval-max-new-tokens, --max-new-tokens) tokens, so a short training budget cannot
    lower the measured accuracy; the last one runs after the final checkpoint is written (AdamW's state is then
    dropped, so it is not held through that evaluation's KV cache)."""
    monkeypatch.chdir(tmp_path)
    real, seen = grpo.evaluate, []

    def spy(*a, **k):
        seen.append((k["max_new_tokens"], (tmp_path / "runs" / name / "checkpoint").exists()))
        return real(*a, **k)

    monkeypatch.setattr(grpo, "evaluate", spy)
    for name, extra, budget in (("e64", [], 64), ("e0", ["--eval-max-new-tokens", "0"], 1),
                                ("e3", ["--max-new-tokens", "3", "--eval-max-new-tokens", "2"], 3)):
        seen.clear()
        grpo.main([*digit_run(digit_model_dir, tmp_path), "--steps", "1", "--run-name", name, *extra])
        assert seen == [(budget, False), (budget, True)], (name, seen)



def test_sampled_evaluation_samples_at_the_runs_top_p(tmp_path, digit_model_dir, monkeypatch):
    """pass@k / maj@k are measured at the run's sampling settings: --top-p reaches evaluate's sampled generate
    calls (and not its greedy ones)."""
    import common.evaluate
    monkeypatch.chdir(tmp_path)
    real, calls = common.evaluate.generate, []

    def spy(*a, **k):
        calls.append((k["temperature"], k.get("top_p", 1.0)))
        return real(*a, **k)

    monkeypatch.setattr(common.evaluate, "generate", spy)
    grpo.main([*digit_run(digit_model_dir, tmp_path), "--steps", "1", "--run-name", "tp", "--top-p", "0.9",
               "--eval-samples", "2", "--temperature", "0.7"])
    assert {c for c in calls if c[0] == 0.0} == {(0.0, 1.0)}, calls  # greedy: no nucleus
    assert {c for c in calls if c[0] != 0.0} == {(0.7, 0.9)}, calls  # sampled: the run's temperature and top-p

# ------------------------------------------------------------------- the GRPO-family options (docs/grpo.md)

def test_overlong_penalty_is_dapo_eq13():
    lengths = torch.tensor([30, 40, 44, 48])  # L_max 48, L_cache 8: free up to 40, then linear to -1 at 48
    assert options.overlong_penalty(lengths, 48, 8, 1.0).tolist() == [0.0, 0.0, -0.5, -1.0]
    assert options.overlong_penalty(lengths, 48, 8, 0.5).tolist() == [0.0, 0.0, -0.25, -0.5]


def test_varied_groups_finds_the_groups_with_a_gradient():
    rewards, group = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1, 2, 2])
    assert grpo.varied_groups(rewards, group, 4).tolist() == [False, True, False, False]  # group 3 is empty


def test_cispo_clips_the_weight_and_keeps_every_gradient():
    """MiniMax-M1 eq. 4: ∂ℓ/∂log π = -sg(min(r, 1 + ε_high)) A on every token, where PPO's clip gives 0 on tokens with
    r > 1 + ε_high and A > 0; in the plain loss and the fused one."""
    log_r = torch.tensor([-1.0, 0.0, 0.1, 0.5, 0.5, -2.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0, -1.0, -0.5], dtype=torch.float64)
    old = torch.full((6,), -1.0, dtype=torch.float64)
    entropy = torch.zeros(6, dtype=torch.float64)
    cfg = grpo.Config(loss_type="cispo")
    expect = -log_r.exp().clamp(max=1.28) * adv
    for f in (grpo.token_loss_plain, grpo.token_loss):
        logp = (old + log_r).requires_grad_()
        loss, low, high = f(logp, old, adv, entropy, cfg)
        grad, = torch.autograd.grad(loss.sum(), logp)
        torch.testing.assert_close(grad.double(), expect, rtol=1e-5, atol=1e-6)
        assert high.tolist() == [False, False, False, True, True, False] and not low.any()
    ppo_logp = (old + log_r).requires_grad_()
    grad, = torch.autograd.grad(grpo.token_loss_plain(ppo_logp, old, adv, entropy, grpo.Config())[0].sum(), ppo_logp)
    assert grad[3] == 0 and expect[3] != 0  # the token PPO's clip silences, CISPO still moves


@pytest.mark.parametrize("mode,floor,expect", [
    ("token-mask", 0.0, [0.4, 1.0, 2.0, 0.0]),  # ρ kept up to C = 3
    ("token-mask", 0.5, [0.0, 1.0, 2.0, 0.0]),  # IcePop's band [0.5, 3]
    ("sequence-truncate", 0.0, [0.4, 0.4, 3.0, 3.0]),  # ρ of a completion: the product of its tokens', 8 -> 3
    ("sequence-mask", 0.0, [0.4, 0.4, 0.0, 0.0]),
])
def test_sampler_mismatch_modes(mode, floor, expect):
    rho = torch.tensor([0.4, 1.0, 2.0, 4.0])  # π_old / π_sampler per token; completions [0, 0, 1, 1]
    old, seq, adv = torch.zeros(4), torch.tensor([0, 0, 1, 1]), torch.ones(4)
    cfg = grpo.Config(tis_cap=3.0, tis_mode=mode, tis_floor=floor)
    w = options.token_mask(old, old, -rho.log(), adv, seq, cfg)
    torch.testing.assert_close(w, torch.tensor(expect))
    assert options.token_mask(old, old, -rho.log(), adv, seq, grpo.Config(tis_cap=3.0)) is None  # token-truncate: fused


def test_offpolicy_sequence_mask_drops_drifted_negative_completions():
    """DeepSeek-V3.2: completion 0's mean log(π_sampler / π_θ) is 0.5 > δ = 0.4: dropped when A < 0 only;
    completion 1 (drift -0.5) always stays."""
    logp, seq = torch.zeros(4), torch.tensor([0, 0, 1, 1])
    sampler = torch.tensor([0.2, 0.8, -0.5, -0.5])
    cfg = grpo.Config(offpolicy_mask=0.4)
    assert options.token_mask(logp, logp, sampler, -torch.ones(4), seq, cfg).tolist() == [0.0, 0.0, 1.0, 1.0]
    assert options.token_mask(logp, logp, sampler, torch.ones(4), seq, cfg).tolist() == [1.0, 1.0, 1.0, 1.0]
    assert options.token_mask(logp, logp, sampler, -torch.ones(4), seq, grpo.Config()) is None



@pytest.mark.parametrize("mode", ["sequence-truncate", "sequence-mask", "token-mask"])
def test_token_mask_takes_a_micro_batch_without_loss_tokens(mode):
    """Under torchrun every completion goes through the forward, so a micro-batch of wholly masked completions (a
    truncated group under --overlong-mask) has no loss token: the options give an empty weight, not an error."""
    empty, cfg = torch.zeros(0), grpo.Config(tis_cap=2.0, tis_mode=mode, offpolicy_mask=0.1)
    w = options.token_mask(empty, empty, empty, empty, torch.zeros(0, dtype=torch.long), cfg)
    assert w is not None and w.shape == (0,)

def test_high_entropy_keeps_the_top_fraction(monkeypatch):
    entropy = torch.arange(1, 11) / 10  # 0.1 .. 1.0
    assert options.high_entropy(entropy, 0.2).nonzero()[:, 0].tolist() == [8, 9]
    assert options.high_entropy(entropy, 1.0).all()
    # beyond torch.quantile's size limit the order statistics give the same cut (the limit lowered to reach that path)
    g = torch.Generator().manual_seed(0)
    cases = [(torch.rand(n, generator=g), keep) for n in (10, 37, 1000) for keep in (0.2, 0.5, 0.9)]
    expected = [options.high_entropy(e, keep) for e, keep in cases]
    quantiles = [torch.quantile(e.double(), q) for e, _ in cases for q in (0.0, 0.1, 0.9, 1.0)]
    monkeypatch.setattr(options, "QUANTILE_MAX", 5)
    for (e, keep), mask in zip(cases, expected):
        assert torch.equal(options.high_entropy(e, keep), mask), (len(e), keep)
    assert options.high_entropy(entropy, 0.2).nonzero()[:, 0].tolist() == [8, 9]
    got = [options.quantile(e.double(), q) for e, _ in cases for q in (0.0, 0.1, 0.9, 1.0)]
    torch.testing.assert_close(torch.stack(got), torch.stack(quantiles), rtol=1e-12, atol=1e-12)


def with_entropies(b, seed=0):
    b.sampler_entropy = torch.rand(len(b.sampler_logp), generator=torch.Generator().manual_seed(seed)) * 3
    return b


@pytest.mark.parametrize("options", [dict(top_entropy=0.3), dict(tis_cap=2.0, tis_mode="sequence-mask"),
                                     dict(tis_cap=1.5, tis_mode="token-mask", tis_floor=0.8), dict(offpolicy_mask=0.05),
                                     dict(loss_type="cispo")])
def test_options_keep_micro_batches_the_big_batch_gradient(model, options):
    b, rewards = make_batch(skips=[1, 0, 0, 2, 0, 1, 0, 0])
    b = with_entropies(b)
    adv = grpo.group_advantages(rewards, b.group, "std")
    stats, big = run_update(model, b, adv, micro_batch=8, **options)
    _, small = run_update(model, b, adv, micro_batch=3, **options)
    torch.testing.assert_close(big[0], small[0], atol=1e-7, rtol=1e-5)
    _, plain = run_update(model, b, adv, micro_batch=8)
    if options.get("loss_type") == "cispo":  # on π_old (r = 1) CISPO's gradient is PPO's
        torch.testing.assert_close(big[0], plain[0], atol=1e-7, rtol=1e-5)
    else:
        assert not torch.equal(big[0], plain[0]) and stats["masked"] > 0  # the option changed the gradient


def test_top_entropy_trains_exactly_the_high_entropy_tokens(model):
    """--top-entropy ρ is the loss with weight 0 on every token below the mini-batch's (1 - ρ) entropy quantile."""
    b, rewards = make_batch()
    b = with_entropies(b, seed=3)
    adv = grpo.group_advantages(rewards, b.group, "std")
    _, cut = run_update(model, b, adv, top_entropy=0.25)
    mask = options.high_entropy(b.sampler_entropy, 0.25)
    assert 0 < mask.sum() < len(mask)
    cfg = grpo.Config(max_grad_norm=1e9, temperature=0.7, max_new_tokens=10)
    opt = RecordingOptimizer(model)
    grpo.update(model, model, opt, b, adv, cfg, 0, torch.device("cpu"), torch.autocast("cpu", enabled=False),
                loss_kw={"weights": mask.float()})
    torch.testing.assert_close(cut[0], opt.grads[0], atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_overlong_mask_takes_completions_out_of_loss_and_totals(model, agg):
    """Masked completions (skip = their length) give the gradient of the batch without them, advantages unchanged."""
    b, rewards = make_batch()
    adv = grpo.group_advantages(rewards, b.group, "std")
    finished = torch.tensor([True, False, True, True, False, True, True, True])
    masked = grpo.replace(b, skip=torch.where(finished, b.skip, b.lengths))
    stats, grads = run_update(model, masked, adv, loss_agg=agg)
    stats_without, without = run_update(model, b.select(finished), adv[finished], loss_agg=agg)
    torch.testing.assert_close(grads[0], without[0], atol=1e-7, rtol=1e-5)
    assert stats["tokens"] == stats_without["tokens"] > 0


def test_refill_tops_the_batch_up_to_b_varied_groups(monkeypatch):
    """DAPO Alg. 1 on a stub sampler: each round's prompts have varied rewards in their first group only; refill keeps
    sampling rounds until B groups vary, drops the surplus, and gives every kept group a new id."""
    from common.sampler import Sample
    from common.tasks import Problem
    calls = []

    def fake_generate(model, contexts, n, **kw):
        calls.append(len(contexts))
        return [[Sample(tokens=[1 + (j == 0 and i % 2)], logprobs=torch.zeros(1), entropies=torch.zeros(1), finished=True)
                 for i in range(n)] for j in range(len(contexts))]

    class Tok:
        stop_ids = [0]
        prompt = staticmethod(lambda text: [5])
        decode = staticmethod(lambda ids, skip_special=True: str(ids[0] - 1))  # token 2 reads "1", token 1 "0"

    monkeypatch.setattr(grpo, "generate", fake_generate)
    train = [Problem(prompt=f"q{i}", answer="1") for i in range(10)]
    cfg = grpo.Config(prompts_per_step=3, group_size=4, dynamic_sampling=True, refill_rounds=5)
    start = to_batch_of([[1, 2, 1, 2]], group_id=0)
    b, rewards, added, rounds = grpo.refill(None, Tok(), train, 1, start, torch.tensor([0.0, 1, 0, 1]), cfg,
                                            torch.autocast("cpu", enabled=False))
    assert (added, rounds, calls) == (2, 2, [3, 3])  # one varied group per round: 1 + 1 + 1 = B = 3
    assert len(b.tokens) == 12 and len(rewards) == 12 and len(b.group.unique()) == 3
    assert b.group.tolist()[4:] == [3] * 4 + [6] * 4  # round r's group j gets id r * B + j


def to_batch_of(token_rows, group_id):
    from common.batch import to_batch
    from common.sampler import Sample
    samples = [Sample(tokens=[t], logprobs=torch.zeros(1), entropies=torch.zeros(1), finished=True) for t in token_rows[0]]
    return to_batch([[5]], [samples], ["1"], group_ids=[group_id])


def test_loop_with_the_family_options_on(tmp_path, digit_model_dir):
    """Refill, overlong shaping and masking, CISPO, the mismatch masks and the entropy cut, in main() itself, and the
    metrics that show them acting."""
    run_grpo(tmp_path, *digit_run(digit_model_dir, tmp_path), "--steps", "3", "--run-name", "family",
             "--dynamic-sampling", "--refill-rounds", "2", "--loss-type", "cispo",
             "--tis-cap", "2", "--tis-mode", "sequence-mask", "--tis-floor", "0.5", "--offpolicy-mask", "0.5",
             "--top-entropy", "0.5", "--warmup-steps", "1")
    rows = [r for r in metrics(tmp_path, "family") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # a step that dropped groups refills (1 or 2 rounds), never with more than it dropped
        assert (r["reward/refill_rounds"] > 0) == (r["reward/groups_dropped"] > 0) and r["reward/refill_rounds"] <= 2
        assert r["reward/groups_refilled"] <= r["reward/groups_dropped"]
        # null on a step that trained no token (every group dropped and none refilled)
        assert r["policy/masked_tokens"] is None or 0 <= r["policy/masked_tokens"] <= 1
        assert math.isfinite(r["optim/grad_norm"])
    assert any(r["reward/groups_dropped"] > 0 for r in rows) and any(r["policy/masked_tokens"] is not None for r in rows)


def test_overlong_options_in_the_loop(tmp_path, tiny_model_dir):
    """The tiny model rarely stops within 6 tokens: the mask takes those completions out, the penalty lowers rewards."""
    run_grpo(tmp_path, "--model", str(tiny_model_dir), "--steps", "1", "--run-name", "long", *TINY_RUN,
             "--overlong-mask", "--overlong-buffer", "3")
    row = [r for r in metrics(tmp_path, "long") if "reward/mean" in r][0]
    assert row["response/overlong_masked"] == 4 * row["response/truncated"] > 0
    assert row["reward/mean"] < 0  # the penalty: -1 for a completion cut at 6 tokens, and no right answer


def test_policy_metrics_of_a_step_that_trained_nothing_are_null(tmp_path):
    """A step whose groups all had equal rewards trains no token: its policy/ metrics (means over trained tokens)
    are null in metrics.jsonl, not 0, which would read as an entropy collapse (and pull a mean over steps down)."""
    from common.batch import Batch
    from common.logger import MetricsLog

    b = Batch(context=[[1]] * 2, tokens=[[2, 3], [4]], group=torch.zeros(2, dtype=torch.long),
              skip=torch.zeros(2, dtype=torch.long), sampler_logp=torch.zeros(3), finished=torch.ones(2, dtype=torch.bool),
              answer=["1"] * 2)
    stats = dict.fromkeys(["tokens", "policy_tokens", "fwd_tokens", "clip_low", "clip_high", "approx_kl", "ref_kl",
                           "entropy", "mismatch", "mismatch_tokens", "masked", "grad_norm", "grad_norm_max",
                           "opt_steps", "skipped"], 0.0)
    times = (0.0, 1.0, 1.0, 2.0)
    none = grpo.step_metrics(b, torch.zeros(2), torch.zeros(2), 1, 1, 0, stats, times)
    some = grpo.step_metrics(b, torch.zeros(2), torch.zeros(2), 1, 1, 0,
                             {**stats, "tokens": 4.0, "policy_tokens": 4.0, "entropy": 2.0}, times)
    assert some["policy/entropy"] == 0.5
    log = MetricsLog(tmp_path, total_steps=1)
    log.log(1, none, console=False)
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert all(row[k] is None for k in ("policy/entropy", "policy/approx_kl", "policy/clipfrac_high"))


def test_under_torchrun_every_completion_goes_through_the_forward(model, monkeypatch):
    """One process leaves out of the forward the completions that add nothing (advantage 0, or no loss tokens left
    after --overlong-mask); under torchrun every rank must run the same forwards (FSDP2 gathers weights in each, and
    a rank with none would skip DDP's all-reduce), so all go through, and the gradient stays the same."""
    b, rewards = make_batch()
    adv = grpo.group_advantages(rewards, b.group, "std")
    b.skip = torch.where(torch.arange(len(b.tokens)) < 2, b.lengths, b.skip)  # two completions without loss tokens
    seen, real = [], grpo.completion_logprobs
    monkeypatch.setattr(grpo, "completion_logprobs", lambda m, bb, idx, *a, **k: seen.extend(idx) or real(m, bb, idx, *a, **k))
    _, alone = run_update(model, b, adv)
    assert 0 not in seen and 1 not in seen
    seen.clear()
    monkeypatch.setattr(grpo.dist, "world", lambda: 2)  # no process group: the collectives stay local
    _, ranked = run_update(model, b, adv)
    assert sorted(seen) == list(range(len(b.tokens)))
    torch.testing.assert_close(ranked[0], 2 * alone[0])  # the loss is scaled by the world size for DDP's mean


def test_a_run_stopped_in_its_last_evaluation_evaluates_again_on_resume(tmp_path, digit_model_dir, monkeypatch):
    """The final checkpoint is written before the final evaluation; a run stopped during that evaluation and resumed
    has no step left to train, and before this it ended without the evaluation. Now the resumed run evaluates that
    step, with the numbers of the uninterrupted run; a step whose evaluation was logged is not evaluated again."""
    monkeypatch.chdir(tmp_path)
    argv = [*digit_run(digit_model_dir, tmp_path), "--steps", "2"]
    grpo.main([*argv, "--run-name", "whole"])
    real, calls = grpo.evaluate, []

    def stop_at_the_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("stopped")
        return real(*a, **k)

    monkeypatch.setattr(grpo, "evaluate", stop_at_the_second)
    with pytest.raises(RuntimeError, match="stopped"):
        grpo.main([*argv, "--run-name", "cut"])
    assert [r["step"] for r in metrics(tmp_path, "cut") if "eval/greedy_acc" in r] == [0]
    monkeypatch.setattr(grpo, "evaluate", real)
    grpo.main([*argv, "--run-name", "cut", "--resume"])
    evals = {n: [(r["step"], r["eval/greedy_acc"]) for r in metrics(tmp_path, n) if "eval/greedy_acc" in r]
             for n in ("whole", "cut")}
    assert evals["cut"] == evals["whole"] and [s for s, _ in evals["whole"]] == [0, 2]
    calls.clear()
    monkeypatch.setattr(grpo, "evaluate", lambda *a, **k: calls.append(1) or real(*a, **k))
    grpo.main([*argv, "--run-name", "cut", "--resume"])  # logged already: nothing to do
    assert calls == [] and [r["step"] for r in metrics(tmp_path, "cut") if "eval/greedy_acc" in r] == [0, 2]

