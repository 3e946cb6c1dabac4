"""EAPO (eapo.py): the properties its reconstruction must keep, numbered as in the test list of the notes
(1: no injection is GRPO; 2: the λ schedule; 3: speculative resampling emits π_RL; 4: eligibility; 5: μ and ω;
6: unbiasedness; 7: first mini-batch; 8: resampled ratio; 9: --pos-only; 10: the prior is frozen and only
follows augmented rows)."""
import math
from pathlib import Path

import pytest
import torch

import eapo
from common.model import ModelConfig, Transformer
from common.sampler import Companion, draw, generate, softmax_stats
from kernels import policy_loss


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# 0.999 quantiles of chi-square by degrees of freedom
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def chi2(counts, probs):
    """Pearson's statistic of counts [V] against probs [V] over the support of probs, and its dof; a token
    outside the support fails outright."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "emitted a token of probability 0"
    expected = counts.sum() * probs[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def toy_pair():
    """π_old and π_RL over 8 tokens: different shapes, π_RL with a zero (an underflowed prior)."""
    p_old = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
    p_rl = torch.tensor([0.05, 0.10, 0.30, 0.25, 0.00, 0.05, 0.15, 0.10])
    return p_old, p_rl


# ----------------------------------------------------------------------------------- 2. schedule

@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant"])
def test_2_schedule_starts_at_lam0_reaches_0_at_T_never_increases(schedule):
    lam = [eapo.injection_prob(k, 0.7, 10, schedule) for k in range(25)]
    assert lam[0] == 0.7 and all(x == 0 for x in lam[10:]) and all(x > 0 for x in lam[:10])
    assert all(a >= b for a, b in zip(lam, lam[1:]))
    if schedule == "linear":
        assert lam[5] == pytest.approx(0.35)
    assert eapo.injection_prob(0, 1.0, 0, schedule) == 0.0  # T = 0: no experience at all


# ------------------------------------------------------------------ 3. speculative resampling = π_RL

def test_3_speculative_resampling_emits_pi_rl_and_rejects_at_rate_tv():
    p_old, p_rl = toy_pair()
    N = 200_000
    g = torch.Generator().manual_seed(0)
    draft = draw(p_old.expand(N, -1), g)
    tokens, rejected = eapo.speculative_resample(p_old.expand(N, -1), p_rl.expand(N, -1), draft, g)
    counts = torch.bincount(tokens, minlength=8).double()
    stat, dof = chi2(counts, p_rl.double())
    assert stat < CHI2_999[dof], (stat, dof)
    # the drafts themselves (π_old) would fail the same test: it can tell the two apart
    assert chi2(torch.bincount(draft, minlength=8).double()[p_rl > 0], p_rl[p_rl > 0].double())[0] > 1000
    tv = 0.5 * (p_old - p_rl).abs().sum().item()
    sd = math.sqrt(tv * (1 - tv) / N)
    assert abs(rejected.float().mean().item() - tv) < 4 * sd, (rejected.float().mean().item(), tv)
    # a rejection never keeps the draft where π_RL has more mass than π_old: resampled tokens lie in the residual
    assert (p_rl[tokens[rejected]] > p_old[tokens[rejected]]).all()


def test_3_equal_distributions_never_reject():
    p = torch.tensor([[0.5, 0.25, 0.25]]).expand(1000, -1)
    draft = draw(p, torch.Generator().manual_seed(1))
    tokens, rejected = eapo.speculative_resample(p, p.clone(), draft, torch.Generator().manual_seed(2))
    assert not rejected.any() and torch.equal(tokens, draft)


@pytest.mark.parametrize("lam", [1.0, 0.4])
def test_3_5_prior_mix_emits_the_mixture_mu_says(lam):
    """Through the whole mix, with every position critical: tokens follow (1 - λ) π_old + λ π_RL, which is
    exactly exp(mu_logp) as the mix reports it (λ = 1: π_RL itself)."""
    p_old, p_rl = toy_pair()
    N, T = 100_000, 0.7
    logits, prior_logits = (p_old.log() * T).expand(N, -1), (p_rl.clamp(min=1e-30).log() * T).expand(N, -1)
    draft = draw(p_old.expand(N, -1), torch.Generator().manual_seed(3))
    mix = eapo.PriorMix(lam, tau=-1.0, temperature=T, seed=4)
    tokens, x = mix(0, draft, logits, prior_logits, torch.arange(N))
    mu = (1 - lam) * p_old + lam * p_rl
    stat, dof = chi2(torch.bincount(tokens, minlength=8).double(), mu.double())
    assert stat < CHI2_999[dof], (stat, dof)
    assert x["eligible"].all() and x["injected"].float().mean().item() == pytest.approx(lam, abs=0.01)
    torch.testing.assert_close(x["mu_logp"].exp(), mu[tokens], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x["rl_logp"].exp(), p_rl[tokens].clamp(min=1e-30), atol=1e-6, rtol=1e-5)
    kl = (p_old * (p_old.log() - p_rl.clamp(min=1e-30).log())).sum()
    torch.testing.assert_close(x["kl"][0], kl, atol=1e-4, rtol=1e-4)
    assert not (x["resampled"] & ~x["injected"]).any()


# --------------------------------------------------------------------------------- 4. eligibility

def test_4_eligibility_is_strict_and_uses_the_sampling_temperature():
    torch.manual_seed(0)
    logits, prior_logits = torch.randn(64, 50) * 2, torch.randn(64, 50) * 2
    T = 0.6
    tempered = softmax_stats(logits, T)[2]
    draft = draw(softmax_stats(logits, T)[1], torch.Generator().manual_seed(0))
    # τ = a row's own tempered entropy: not critical (strict >), even with λ = 1
    for i in range(4):
        _, x = eapo.PriorMix(1.0, float(tempered[i]), T, seed=i)(0, draft, logits, prior_logits, torch.arange(64))
        assert not x["eligible"][i] and not x["injected"][i] and not x["resampled"][i]
        assert torch.equal(x["eligible"], tempered > tempered[i])
    # τ between a row's T = 1 entropy and its tempered one: the tempered softmax decides, both ways
    row = logits[:1].expand(64, -1)
    plain = float(softmax_stats(row[:1], 1.0)[2])
    for temp, critical in ((0.6, False), (1.5, True)):
        tempered = float(softmax_stats(row[:1], temp)[2])
        tau = (tempered + plain) / 2
        _, x = eapo.PriorMix(1.0, tau, temp, seed=9)(0, draft, row, prior_logits, torch.arange(64))
        assert x["eligible"].all() if critical else not x["eligible"].any()


# ------------------------------------------------------------------------------------ 5. μ and ω

def test_5_mu_and_omega():
    g = torch.Generator().manual_seed(0)
    old, rl = -torch.rand(100, generator=g) * 5, -torch.rand(100, generator=g) * 5
    eligible = torch.rand(100, generator=g) < 0.5
    assert torch.equal(eapo.behaviour_logp(old, rl, 0.0, eligible), old)
    one = eapo.behaviour_logp(old, rl, 1.0, eligible)
    assert torch.equal(one[eligible], rl[eligible]) and torch.equal(one[~eligible], old[~eligible])
    mid = eapo.behaviour_logp(old, rl, 0.3, eligible)
    torch.testing.assert_close(mid[eligible].exp(), 0.7 * old[eligible].exp() + 0.3 * rl[eligible].exp())
    w = eapo.is_weights(old, mid)
    assert torch.equal(w[~eligible], torch.ones(int((~eligible).sum())))  # exactly 1, not merely close
    torch.testing.assert_close(w[eligible], old[eligible].exp() / mid[eligible].exp())
    assert eapo.is_weights(old, one, cap=2.0).max() <= 2.0 < eapo.is_weights(old, one).max()


# ------------------------------------------------------------------------------- 6. unbiasedness

def test_6_one_step_bandit_is_weighted_gradient_is_unbiased():
    """A 6-armed bandit, softmax policy θ, every position critical, λ = 0.6, C_ω = ∞, no clip. The Monte-Carlo
    mean of the loss gradient from augmented samples (ω through kernels.policy_loss) matches the exact
    on-policy gradient -∇ E_π[r]; without ω the same samples are biased toward π_RL's arms."""
    theta = torch.tensor([0.5, -0.2, 0.1, 0.8, -1.0, 0.0], requires_grad=True)
    p_rl = torch.tensor([0.05, 0.40, 0.05, 0.05, 0.40, 0.05])
    reward = torch.tensor([1.0, 0.0, 0.5, 0.2, 1.0, 0.0])
    p = theta.detach().softmax(-1)
    exact = -(p * (reward - (p * reward).sum()))  # -∇θ Σ π r for a softmax

    N = 400_000
    draft = draw(p.expand(N, -1), torch.Generator().manual_seed(0))
    mix = eapo.PriorMix(0.6, tau=-1.0, temperature=1.0, seed=1)
    a, x = mix(0, draft, theta.detach().expand(N, -1), p_rl.log().expand(N, -1), torch.arange(N))

    def grad(weights):
        theta.grad = None
        logp = torch.log_softmax(theta, -1)[a]  # [N]
        loss, _, _ = policy_loss(logp, logp.detach(), reward[a], eps_low=1.0, eps_high=float("inf"), weights=weights)
        loss.mean().backward()
        return theta.grad.clone()

    old_logp = p.log()[a]
    omega = eapo.is_weights(old_logp, eapo.behaviour_logp(old_logp, x["rl_logp"], 0.6, x["eligible"]))
    unbiased, naive = grad(omega), grad(None)
    assert (unbiased - exact).abs().max() < 0.004, (unbiased, exact)
    assert (naive - exact).abs().max() > 0.05  # the test can tell a missing correction


# ------------------------------------------------------------------------------- 7. first mini-batch

def test_7_first_minibatch_ratio_is_one_and_gradient_scales_with_omega():
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    omega = torch.tensor([1.0, 0.25, 3.0, 1.7])
    loss, low, high = policy_loss(logp, logp.detach(), adv, 0.2, 0.28, weights=omega)
    loss.sum().backward()
    assert not low.any() and not high.any()  # ρ = 1: nothing clipped
    torch.testing.assert_close(logp.grad, -omega * adv)


# ------------------------------------------------------------------------------ 8. resampled ratio

def test_8_resampled_ratio_counts_augmented_responses_only():
    flags = [torch.tensor([1, 0, 0, 1], dtype=torch.bool), torch.tensor([1, 1], dtype=torch.bool),
             torch.tensor([0, 0, 0], dtype=torch.bool)]
    assert eapo.resampled_ratio(flags, [True, False, True]) == pytest.approx(2 / 7)
    assert eapo.resampled_ratio(flags, [False, False, False]) == 0.0


# -------------------------------------------------------------------------------------- 9. pos-only

def test_9_pos_only_drops_incorrect_augmented_responses():
    correct = torch.tensor([1.0, 0.0, 1.0, 0.0])
    augmented = torch.tensor([True, True, False, False])
    assert eapo.pos_only_dropped(correct, augmented).tolist() == [False, True, False, False]


# ----------------------------------------------------------------------- 3.6 the calibrated threshold

def test_tau_quantile_makes_that_share_of_tokens_critical():
    ent = torch.rand(10_000, generator=torch.Generator().manual_seed(0)) * 3
    tau = eapo.calibrate_tau(ent, 0.9)
    assert (ent > tau).float().mean().item() == pytest.approx(0.1, abs=0.002)


# ---------------------------------------------------------------- the mix inside the sampler (1, 8, 10)

@pytest.fixture(scope="module")
def pair():
    """A tiny policy and a different tiny prior with the same vocabulary (64 tokens)."""
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(0)
    policy, prior = Transformer(cfg).eval(), Transformer(cfg).eval()
    with torch.no_grad():  # the random init with a tied head is nearly deterministic: flatten it
        for m, s in ((policy, 0.2), (prior, 0.3)):
            m.embed_tokens.weight.mul_(s)
    return policy, prior


PROMPTS = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]


def sample_with(policy, prior, lam, tau, rows, **kw):
    calls = []  # batch size of every prior forward
    hook = prior.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    try:
        mix = eapo.PriorMix(lam, tau, 0.9, seed=5)
        groups = generate(policy, PROMPTS, n=4, max_new_tokens=10, temperature=0.9, stop_ids=[0, 1], seed=7,
                          check_every=2, companion=Companion(prior, mix, rows=rows), **kw)
    finally:
        hook.remove()
    return [s for g in groups for s in g], calls


def test_1_no_injection_samples_what_the_policy_alone_samples(pair):
    policy, prior = pair
    alone = [s for g in generate(policy, PROMPTS, n=4, max_new_tokens=10, temperature=0.9, stop_ids=[0, 1], seed=7,
                                 check_every=2) for s in g]
    rows = eapo.augmented_rows(3, 4, 2)
    for lam, tau in ((0.0, -1.0), (1.0, math.inf)):
        samples, _ = sample_with(policy, prior, lam, tau, rows)
        for i, (a, b) in enumerate(zip(alone, samples)):
            assert a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs)
            assert not b.extras["injected"].any()
            # μ = π_old on augmented rows (the sampler's own log-probs); ordinary rows get no values at all
            torch.testing.assert_close(b.extras["mu_logp"], a.logprobs if i in rows else torch.zeros(len(a.tokens)))


def test_8_10_prior_follows_augmented_rows_only_and_resampled_flags_stay_there(pair):
    policy, prior = pair
    rows = eapo.augmented_rows(3, 4, 2)  # samples 0, 1, 4, 5, 8, 9
    samples, calls = sample_with(policy, prior, 1.0, -1.0, rows)
    assert calls and max(calls) <= len(rows)  # the prior's batch never holds an ordinary row
    augmented = [i in rows for i in range(len(samples))]
    flags = [s.extras["resampled"] for s in samples]
    assert all(not f.any() for f, a in zip(flags, augmented) if not a)
    ratio = eapo.resampled_ratio(flags, augmented)
    assert 0 < ratio < 1
    for s, a in zip(samples, augmented):
        if a:  # every token injected (λ = 1, τ < 0): μ is π_RL's log-prob of it
            assert s.extras["injected"].all()
            torch.testing.assert_close(s.extras["mu_logp"], s.extras["rl_logp"])
    assert all(p.grad is None for p in prior.parameters())


# ------------------------------------------------------------------------------------ main() end to end

@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    """(policy, prior, data file): a tiny model that answers with one digit token (its untied LM head scores
    only the ten digits), a prior made from it with another head (as an RL run would leave it), and a
    'Say d' task, so that rewards vary, updates happen and the two policies differ."""
    import json
    import shutil

    from common.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("eapo")
    digits = [Tokenizer.from_pretrained(tiny_model_dir).encode(str(d))[0] for d in range(10)]
    for name, seed in (("policy", 0), ("prior", 1)):
        m = Transformer.from_pretrained(tiny_model_dir)
        m.cfg.tie_word_embeddings = False
        head = torch.zeros_like(m.lm_head.weight)
        head[digits] = 1.5 * torch.randn(10, head.shape[1], generator=torch.Generator().manual_seed(seed))
        m.lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
        m.lm_head.weight.data.copy_(head)
        m.save_pretrained(root / name)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny_model_dir / f, root / name / f)
    task = root / "digits.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"Say {d}", "answer": str(d)}) + "\n" for d in list(range(10)) * 3))
    return root / "policy", root / "prior", task


def run_args(models, *more):
    policy, prior, task = models
    return ["--model", str(policy), "--task", str(task), "--prompts-per-step", "2", "--group-size", "8",
            "--max-new-tokens", "1", "--eval-size", "3", "--micro-batch", "4", "--eval-every", "100", "--lr", "1e-2",
            "--dtype", "float32", *more]


def rows_of(run):
    """The training lines of runs/<run>/metrics.jsonl (in the current folder), by step."""
    import json

    lines = (Path("runs") / run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "reward/mean" in r}


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run main() in a fresh folder: it writes runs/<name>/ there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def recording(monkeypatch, module):
    """Wrap module.generate: keep every training rollout's tokens (and the companion it was given)."""
    calls = []
    real = module.generate

    def wrapped(*args, **kw):
        out = real(*args, **kw)
        calls.append(([s.tokens for g in out for s in g], kw.get("companion")))
        return out

    monkeypatch.setattr(module, "generate", wrapped)
    return calls


def weights(run):
    from safetensors.torch import load_file

    return load_file(str(Path("runs") / run / "checkpoint" / "model.safetensors"))


def test_1_lambda_0_step_equals_grpo(in_tmp, models, monkeypatch):
    """λ_0 = 0: the same rollouts (generated tokens), the same metrics and the same weights as grpo.py."""
    import grpo

    grpo_calls, eapo_calls = recording(monkeypatch, grpo), recording(monkeypatch, eapo)
    grpo.main(run_args(models, "--steps", "2", "--run-name", "g"))
    eapo.main(run_args(models, "--steps", "2", "--run-name", "e", "--prior", str(models[1]), "--lam0", "0"))
    assert [t for t, _ in grpo_calls] == [t for t, _ in eapo_calls[-2:]]  # (the first eapo call calibrates τ)
    g, e = rows_of("g"), rows_of("e")
    assert any(r["optim/grad_norm"] > 0 for r in g.values())  # something was learnt
    for step in (1, 2):
        assert {k: v for k, v in e[step].items() if not k.startswith(("eapo/", "perf/"))} == \
               {k: v for k, v in g[step].items() if not k.startswith("perf/")}
        assert e[step]["eapo/lambda"] == 0 and e[step]["eapo/resampled_ratio"] == 0
    wg, we = weights("g"), weights("e")
    assert all(torch.equal(wg[k], we[k]) for k in wg)


def test_1_tau_infinite_samples_grpo_tokens_with_omega_1(in_tmp, models, monkeypatch):
    """τ = +∞ with λ = 1: the prior runs alongside but nothing is critical: grpo's tokens, ω ≡ 1, the same step."""
    import grpo

    grpo_calls, eapo_calls = recording(monkeypatch, grpo), recording(monkeypatch, eapo)
    seen = []
    real_update = eapo.update
    monkeypatch.setattr(eapo, "update", lambda *a, **kw: seen.append(a[-1]) or real_update(*a, **kw))
    grpo.main(run_args(models, "--steps", "1", "--run-name", "g"))
    eapo.main(run_args(models, "--steps", "1", "--run-name", "e", "--prior", str(models[1]), "--tau", "1e9"))
    assert grpo_calls[0][0] == eapo_calls[0][0] and eapo_calls[0][1] is not None
    assert torch.equal(seen[0]["weights"], torch.ones_like(seen[0]["weights"]))
    wg, we = weights("g"), weights("e")
    assert all(torch.equal(wg[k], we[k]) for k in wg)  # the scoring pass's π_old is the update's, bit for bit


def test_smoke_mechanism_acts_and_anneals(in_tmp, models, monkeypatch):
    """Three steps with T = 2 and every token critical (τ = 0): the prior follows only the augmented rows and is
    never given a gradient (10), tokens get resampled at step 1, λ halves at step 2 and is 0 at step 3."""
    calls = recording(monkeypatch, eapo)
    eapo.main(run_args(models, "--steps", "3", "--run-name", "s", "--prior", str(models[1]), "--tau", "0",
                       "--anneal-steps", "2"))
    rows = rows_of("s")
    assert [rows[k]["eapo/lambda"] for k in (1, 2, 3)] == [1.0, 0.5, 0.0]
    assert rows[1]["eapo/resampled_ratio"] > 0 and rows[3]["eapo/resampled_ratio"] == 0
    assert rows[1]["eapo/injected_ratio"] == 1.0 and rows[1]["eapo/kl_prior"] > 0
    assert rows[1]["eapo/omega_max"] != 1.0
    # 7: the first mini-batch's ratio is exactly 1 (the scoring pass's π_old is the update's own π_θ)
    assert rows[1]["policy/approx_kl"] == 0 and rows[1]["policy/clipfrac_high"] == rows[1]["policy/clipfrac_low"] == 0
    (_, c1), (_, c2), (_, c3) = calls
    assert c1.rows == c2.rows == eapo.augmented_rows(2, 8, 4) and c3 is None
    assert all(not p.requires_grad and p.grad is None for p in c1.model.parameters())
    state = torch.load(in_tmp / "runs" / "s" / "checkpoint" / "trainer.pt", weights_only=False)
    assert state["extra"]["eapo"]["tau"] == 0.0


# A run cut at step 2 by a crash had taken the whole run's rates; asked for 2 steps, it would decay its own last steps
# (--decay-steps): it runs without the decay, which in the 4-step run is still under the warm-up at steps 1 and 2.
AS_IF_CUT = ["--decay-steps", "0"]


def test_resume_gives_the_same_run(in_tmp, models):
    """Cut at step 2 while λ > 0 (τ calibrated in the first part, read back from the checkpoint), resume to 4."""
    common = run_args(models, "--prior", str(models[1]), "--anneal-steps", "3", "--tau-quantile", "0.5")
    eapo.main([*common, "--steps", "4", "--run-name", "full"])
    eapo.main([*common, "--steps", "2", "--run-name", "cut", *AS_IF_CUT])
    eapo.main([*common, "--steps", "4", "--run-name", "cut", "--resume"])
    full, cut = rows_of("full"), rows_of("cut")
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("perf/")}  # noqa: E731
    assert full[3]["eapo/lambda"] > 0
    for step in (3, 4):
        assert strip(cut[step]) == strip(full[step]), step


def recording_correct(monkeypatch):
    """Keep the per-completion correctness vector the loop computes (through eapo.pos_only_dropped)."""
    seen = []
    real = eapo.pos_only_dropped
    monkeypatch.setattr(eapo, "pos_only_dropped", lambda correct, aug: seen.append(correct.clone()) or real(correct, aug))
    return seen


def test_9_pos_only_in_the_loop(in_tmp, models, monkeypatch):
    """--pos-only: incorrect augmented completions get no loss tokens; advantages are those of the whole group."""
    seen = {}
    real_update = eapo.update

    def spy(policy, model, opt, b, adv, *a, **kw):
        seen.setdefault("runs", []).append((b.skip.clone(), b.lengths, adv.clone()))
        return real_update(policy, model, opt, b, adv, *a, **kw)

    monkeypatch.setattr(eapo, "update", spy)
    correct = recording_correct(monkeypatch)
    common = run_args(models, "--prior", str(models[1]), "--tau", "0", "--steps", "1")
    eapo.main([*common, "--run-name", "all"])
    eapo.main([*common, "--run-name", "pos", "--pos-only"])
    (skip0, lengths, adv0), (skip1, _, adv1) = seen["runs"]
    assert torch.equal(adv0, adv1) and (skip0 == 0).all()
    aug = torch.zeros(16, dtype=torch.bool)
    aug[eapo.augmented_rows(2, 8, 4)] = True
    dropped = aug & (correct[-1] == 0)
    assert dropped.any() and torch.equal(skip1, torch.where(dropped, lengths, 0))


def run_cli(capsys, *args):
    """main() as the command line runs it: a user mistake is one line on stderr and exit status 2."""
    with pytest.raises(SystemExit) as e:
        eapo.main_guard(lambda: eapo.main(list(args)))
    return e.value.code, capsys.readouterr().err


def test_without_prior_one_line_names_the_two_commands(in_tmp, models, capsys):
    code, err = run_cli(capsys, *run_args(models, "--run-name", "x"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "python grpo.py --run-name prior" in err and "python eapo.py --prior runs/prior/checkpoint" in err
    assert not (in_tmp / "runs").exists()


def test_prior_with_another_tokenizer_is_refused(in_tmp, models, capsys):
    import json
    import shutil

    other = in_tmp / "other"
    shutil.copytree(models[1], other)
    t = json.loads((other / "tokenizer.json").read_text())
    vocab = t["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids: same size, other tokenizer
    (other / "tokenizer.json").write_text(json.dumps(t))
    code, err = run_cli(capsys, *run_args(models, "--run-name", "x", "--prior", str(other)))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--prior" in err and "tokenizer" in err, err
    assert not (in_tmp / "runs").exists()
