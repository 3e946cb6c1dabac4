"""grpo.py: the spec's test properties (../shared/specs/grpo.md, "Properties a test can pin"), resume
equivalence, a smoke run as a subprocess, and bad input."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import grpo
from common.model import Transformer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return Transformer.from_pretrained(tiny_model_dir)


def batch_of(n=8, seed=0):
    """n random prompt/completion pairs of different lengths, with rewards in two groups of n/2."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 1000, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    comps = [torch.randint(3, 1000, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    rewards = torch.randint(0, 2, (2, n // 2), generator=g).float()
    rewards[0, 0], rewards[0, 1] = 1.0, 0.0  # at least one mixed group
    return prompts, comps, rewards


def loss_and_grad(model, prompts, comps, adv, cfg, micro=None, extra_pad=0, ref_logp=None):
    """The loop's loss (grpo.micro_batch_loss) summed over micro-batches; returns (loss, flat grad)."""
    model.zero_grad(set_to_none=True)
    lengths = torch.tensor([len(c) for c in comps])
    n = len(comps)
    micro = micro or n
    total = 0.0
    for s in range(0, n, micro):
        idx = list(range(s, min(s + micro, n)))
        ids, mask = grpo.build_batch([prompts[i] for i in idx], [comps[i] for i in idx], 0)
        if extra_pad:
            ids = torch.cat([ids, torch.zeros(len(idx), extra_pad, dtype=torch.long)], 1)
            mask = torch.cat([mask, torch.zeros(len(idx), extra_pad, dtype=torch.bool)], 1)
        w = grpo.token_weights(lengths[idx], cfg.loss_agg, cfg.max_new_tokens, n, int(lengths.sum()))
        tok_adv = adv[idx].repeat_interleave(lengths[idx])
        loss, *_ = grpo.micro_batch_loss(model, ids, mask, tok_adv, w, None, ref_logp, cfg)
        loss.backward()
        total += loss.item()
    return total, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_ratio_one_and_gradient_is_reinforce(model):
    cfg = grpo.Config(loss_agg="token-mean", max_new_tokens=8, temperature=0.7)
    prompts, comps, rewards = batch_of()
    adv = grpo.group_advantages(rewards, "std").flatten()
    _, grad = loss_and_grad(model, prompts, comps, adv, cfg)
    # REINFORCE: -Σ A log π / (number of tokens)
    model.zero_grad(set_to_none=True)
    ids, mask = grpo.build_batch(prompts, comps, 0)
    logp, _ = grpo.token_logprobs(model, ids, mask, cfg.temperature)
    lengths = torch.tensor([len(c) for c in comps])
    logp_old = logp.detach()
    loss_tok, low, high = grpo.policy_loss(logp, logp_old, adv.repeat_interleave(lengths), cfg.eps_low, cfg.eps_high)
    assert not low.any() and not high.any()  # ratio is exactly 1: nothing clipped
    (-(adv.repeat_interleave(lengths) * logp).sum() / lengths.sum()).backward()
    reinforce = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert grad.abs().max() > 0
    torch.testing.assert_close(grad, reinforce, atol=1e-6, rtol=1e-5)


def test_equal_rewards_give_no_gradient(model):
    cfg = grpo.Config(max_new_tokens=8)
    prompts, comps, _ = batch_of()
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    for norm in ("std", "none"):
        adv = grpo.group_advantages(rewards, norm)
        assert torch.equal(adv, torch.zeros_like(adv))
    _, grad = loss_and_grad(model, prompts, comps, torch.zeros(8), cfg)
    assert grad.abs().max() == 0


def test_dr_grpo_normalisation_and_padding(model):
    cfg = grpo.Config(adv_norm="none", loss_agg="seq-mean-token-sum-norm", max_new_tokens=12)
    prompts, comps, rewards = batch_of()
    adv = grpo.group_advantages(rewards, "none")
    torch.testing.assert_close(adv, rewards - rewards.mean(1, keepdim=True))
    lengths = torch.tensor([len(c) for c in comps])
    w = grpo.token_weights(lengths, cfg.loss_agg, cfg.max_new_tokens, 8, int(lengths.sum()))
    torch.testing.assert_close(w, torch.full_like(w, 1 / (8 * 12)))  # Σ ℓ / (n × L_max)
    plain, g1 = loss_and_grad(model, prompts, comps, adv.flatten(), cfg)
    padded, g2 = loss_and_grad(model, prompts, comps, adv.flatten(), cfg, extra_pad=5)
    assert plain == pytest.approx(padded, rel=1e-6, abs=1e-9)
    torch.testing.assert_close(g1, g2)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batching_gives_the_same_gradient(model, agg):
    cfg = grpo.Config(loss_agg=agg, max_new_tokens=10)
    prompts, comps, rewards = batch_of()
    adv = grpo.group_advantages(rewards, "std").flatten()
    _, big = loss_and_grad(model, prompts, comps, adv, cfg, micro=8)
    _, small = loss_and_grad(model, prompts, comps, adv, cfg, micro=4)
    torch.testing.assert_close(big, small, atol=1e-6, rtol=1e-5)


def test_seq_mean_token_mean_weights():
    lengths = torch.tensor([2, 4])
    w = grpo.token_weights(lengths, "seq-mean-token-mean", 8, 2, 6)
    torch.testing.assert_close(w, torch.tensor([1 / 4, 1 / 4, 1 / 8, 1 / 8, 1 / 8, 1 / 8]))


def test_kl_to_identical_reference_is_zero(model):
    prompts, comps, rewards = batch_of()
    adv = grpo.group_advantages(rewards, "std").flatten()
    ids, mask = grpo.build_batch(prompts, comps, 0)
    with torch.no_grad():
        ref_logp, _ = grpo.token_logprobs(model, ids, mask, 0.7)
    _, with_kl = loss_and_grad(model, prompts, comps, adv, grpo.Config(kl_coef=0.5, temperature=0.7), ref_logp=ref_logp)
    _, without = loss_and_grad(model, prompts, comps, adv, grpo.Config(kl_coef=0.0, temperature=0.7))
    torch.testing.assert_close(with_kl, without, atol=1e-7, rtol=1e-6)


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


def test_resume_gives_the_same_run(tmp_path, digit_model_dir):
    task = tmp_path / "digits.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"Say {d}", "answer": str(d)}) + "\n" for d in list(range(10)) * 3))
    common = ["--model", str(digit_model_dir), "--task", str(task), "--prompts-per-step", "2", "--group-size", "8",
              "--max-new-tokens", "1", "--eval-size", "3", "--micro-batch", "4", "--eval-every", "100", "--lr", "1e-2", "--dtype", "float32"]
    run_grpo(tmp_path, *common, "--steps", "4", "--run-name", "full")
    run_grpo(tmp_path, *common, "--steps", "2", "--run-name", "cut")
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
    (["--group-size", "0"], ["--group-size", "positive"]),
    (["--prompts-per-step", "3", "--group-size", "3", "--mini-batches", "2"], ["--mini-batches"]),
    (["--loss-agg", "mean"], ["--loss-agg", "invalid choice"]),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, tiny_model_dir, args, words):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2"\n')
    argv = ["--model", str(tiny_model_dir), "--run-name", "bad", *TINY_RUN, *args]
    r = run_grpo(tmp_path, *argv, check=False)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()


def test_existing_run_is_not_overwritten(tmp_path, tiny_model_dir):
    (tmp_path / "runs" / "taken").mkdir(parents=True)
    (tmp_path / "runs" / "taken" / "metrics.jsonl").write_text('{"step": 0}\n')
    r = run_grpo(tmp_path, "--model", str(tiny_model_dir), "--run-name", "taken", *TINY_RUN, check=False)
    assert r.returncode == 2 and "--resume" in r.stderr
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
