"""EAPO (eapo.py): the properties its reconstruction must keep, numbered as in the test list of the notes
(1: no injection is GRPO; 2: the λ schedule; 3: speculative resampling emits π_RL; 4: eligibility; 5: μ and ω;
6: what ω corrects (one token) and what it does not (two); 7: the loss and the first mini-batch; 8: resampled
ratio; 9: --pos-only; 10: the prior is frozen and only follows augmented rows)."""
import inspect
import itertools
import math
from pathlib import Path

import pytest
import torch

import eapo
from common.model import ModelConfig, Transformer
from common.sampler import Companion, draw, generate, softmax_stats


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
    assert not (x["rejected"] & ~x["injected"]).any()


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
        assert not x["eligible"][i] and not x["injected"][i] and not x["rejected"][i]
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


def test_5_is_levels_sequence_is_the_truncated_product_none_is_one():
    """--is-level sequence: every token of a completion carries the product of its ω_t, truncated at the cap;
    none: ω ≡ 1 (the ablation without IS)."""
    old = torch.tensor([-1.0, -0.5, -2.0, -0.1, -3.0])
    mu = torch.tensor([-1.5, -0.5, -1.0, -0.4, -3.0])
    seq = torch.tensor([0, 0, 1, 1, 2])
    per_token = eapo.is_weights(old, mu)
    product = torch.stack([per_token[seq == i].prod() for i in range(3)])[seq]
    torch.testing.assert_close(eapo.is_weights(old, mu, "sequence", 0.0, seq), product)
    torch.testing.assert_close(eapo.is_weights(old, mu, "sequence", 1.2, seq), product.clamp(max=1.2))
    assert product.max() > 1.2 and product.min() < 1  # the cap acts, and only from above
    assert torch.equal(eapo.is_weights(old, mu, "none", 0.0, seq), torch.ones(5))


# ------------------------------------------------------------------ 6. what ω corrects, and what it does not

def test_6_per_token_omega_is_unbiased_for_a_one_token_completion():
    """A one-step property: a 6-armed bandit (a completion of one token), softmax policy θ, every position
    critical, λ = 0.6, C_ω = ∞, no clip. The Monte-Carlo mean of the loss gradient from augmented samples (ω
    through eapo.token_loss) matches the exact on-policy gradient -∇ E_π[r]; without ω the same samples are
    biased toward π_RL's arms. Beyond one token the per-token ω is biased: test_6b."""
    theta = torch.tensor([0.5, -0.2, 0.1, 0.8, -1.0, 0.0], requires_grad=True)
    p_rl = torch.tensor([0.05, 0.40, 0.05, 0.05, 0.40, 0.05])
    reward = torch.tensor([1.0, 0.0, 0.5, 0.2, 1.0, 0.0])
    p = theta.detach().softmax(-1)
    exact = -(p * (reward - (p * reward).sum()))  # -∇θ Σ π r for a softmax

    N, no_clip = 400_000, eapo.Config(eps_low=1.0, eps_high=math.inf)
    draft = draw(p.expand(N, -1), torch.Generator().manual_seed(0))
    mix = eapo.PriorMix(0.6, tau=-1.0, temperature=1.0, seed=1)
    a, x = mix(0, draft, theta.detach().expand(N, -1), p_rl.log().expand(N, -1), torch.arange(N))

    def grad(weights):
        theta.grad = None
        logp = torch.log_softmax(theta, -1)[a]  # [N]
        loss, _, _ = eapo.token_loss(logp, logp.detach(), reward[a], torch.zeros(N), no_clip, weights=weights)
        loss.mean().backward()
        return theta.grad.clone()

    old_logp = p.log()[a]
    omega = eapo.is_weights(old_logp, eapo.behaviour_logp(old_logp, x["rl_logp"], 0.6, x["eligible"]))
    unbiased, naive = grad(omega), grad(None)
    assert (unbiased - exact).abs().max() < 0.004, (unbiased, exact)
    assert (naive - exact).abs().max() > 0.05  # the test can tell a missing correction


def two_step_toy_bias(lam: float, level: str) -> tuple[float, float]:
    """The exact expected gradient of EAPO's loss on a two-step, three-token toy, through eapo.py's own
    behaviour_logp, is_weights and token_loss, every position critical, ρ = 1: a tabular policy (θ[0] gives
    a_1, θ[1 + a_1] gives a_2), a fixed π_RL, a reward on the pair. All 9 completions are enumerated, each
    weighted by its behaviour probability μ(a_1) μ(a_2 | a_1). Returns (|true gradient|, |bias|)."""
    theta = torch.tensor([[0.3, -0.4, 0.9], [0.5, 0.0, -0.6], [-0.2, 0.7, 0.1], [1.0, -0.5, 0.2]],
                         dtype=torch.float64, requires_grad=True)
    rl_first = torch.tensor([0.1, 0.7, 0.2], dtype=torch.float64)
    rl_second = torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.1, 0.8], [0.3, 0.4, 0.3]], dtype=torch.float64)
    reward = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    cfg, expected_loss, objective = eapo.Config(), 0.0, 0.0
    for a1, a2 in itertools.product(range(3), range(3)):
        logp = torch.stack([theta[0].log_softmax(-1)[a1], theta[1 + a1].log_softmax(-1)[a2]])  # [2]
        old = logp.detach()
        mu = eapo.behaviour_logp(old, torch.stack([rl_first[a1], rl_second[a1, a2]]).log(), lam,
                                 torch.ones(2, dtype=torch.bool))
        omega = eapo.is_weights(old, mu, level, 0.0, torch.zeros(2, dtype=torch.long))
        loss, _, _ = eapo.token_loss(logp, old, reward[a1, a2].expand(2), torch.zeros(2, dtype=torch.float64), cfg,
                                     weights=omega)
        expected_loss = expected_loss + mu.sum().exp() * loss.sum()  # E_μ of the summed token losses
        objective = objective + logp.sum().exp() * reward[a1, a2]  # E_π[r]
    true = -torch.autograd.grad(objective, theta, retain_graph=True)[0]
    return float(true.norm()), float((torch.autograd.grad(expected_loss, theta)[0] - true).norm())


@pytest.mark.parametrize("lam", [1.0, 0.5])
def test_6b_two_step_toy_per_token_omega_is_biased_the_sequence_product_is_not(lam):
    """A documented property of our reconstruction (is_weights): the per-token ω corrects the distribution of
    each chosen token, not of the states earlier injected tokens led to, nor of the later tokens the reward
    also depends on. Exactly enumerated, the per-token ω leaves a bias about as large as the gradient itself
    (0.17 against 0.17 at λ = 1, 0.09 at λ = 0.5), no ω a larger one (0.73, 0.26); the untruncated product over
    the completion (--is-level sequence) none (float32 rounding of the fused loss). Fails if is_weights' sequence
    level loses the product (e.g. per token again), or if the per-token ω became the trajectory ratio."""
    norm, token = two_step_toy_bias(lam, "token")
    _, none = two_step_toy_bias(lam, "none")
    _, sequence = two_step_toy_bias(lam, "sequence")
    assert norm == pytest.approx(0.166, abs=1e-3)
    assert token > 0.4 * norm and none > token
    assert sequence < 1e-6


# ------------------------------------------------------------------------------- 7. first mini-batch

def test_7_token_loss_is_grpos_and_weights_each_token_by_omega():
    """eapo.py's loss is grpo.py's token_loss (and its plain twin), verbatim: EAPO's change is only ω, passed as
    `weights`. With ρ = 1 (the first mini-batch) nothing is clipped and the gradient is -ω A per token; ω ≡ 1
    (--is-level none, or no critical token) is grpo.py's loss exactly."""
    import grpo

    assert inspect.getsource(eapo.token_loss) == inspect.getsource(grpo.token_loss)
    assert inspect.getsource(eapo.token_loss_plain) == inspect.getsource(grpo.token_loss_plain)
    cfg = eapo.Config()
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    omega = torch.tensor([1.0, 0.25, 3.0, 1.7])
    loss, low, high = eapo.token_loss(logp, logp.detach(), adv, torch.zeros(4), cfg, weights=omega)
    loss.sum().backward()
    assert not low.any() and not high.any()  # ρ = 1: nothing clipped
    torch.testing.assert_close(logp.grad, -omega * adv)
    # off the first mini-batch, against the plain lines in float64: ω multiplies the clipped surrogate
    new = torch.tensor([-0.7, -2.5, -0.5, -2.9], dtype=torch.float64)
    old64, adv64, w64 = logp.detach().double(), adv.double(), omega.double()
    ratio = (new - old64).exp()
    hand = -w64 * torch.minimum(ratio * adv64, ratio.clamp(0.8, 1.28) * adv64)
    torch.testing.assert_close(eapo.token_loss_plain(new, old64, adv64, torch.zeros(4, dtype=torch.float64), cfg,
                                                     weights=w64)[0], hand)
    ones = eapo.is_weights(old64, new, "none", 0.0, torch.zeros(4, dtype=torch.long))
    assert torch.equal(eapo.token_loss(logp, old64.float(), adv, torch.zeros(4), cfg, weights=ones.float())[0],
                       grpo.token_loss(logp, old64.float(), adv, torch.zeros(4), cfg)[0])


# ------------------------------------------------------------------------------ 8. resampled ratio

def test_8_resampled_ratio_counts_augmented_responses_only():
    flags = [torch.tensor([1, 0, 0, 1], dtype=torch.bool), torch.tensor([1, 1], dtype=torch.bool),
             torch.tensor([0, 0, 0], dtype=torch.bool)]
    assert eapo.augmented_share(flags, [True, False, True]) == pytest.approx(2 / 7)
    assert eapo.augmented_share(flags, [False, False, False]) == 0.0


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


def test_tau_calibration_takes_more_entropies_than_torch_quantile_does(monkeypatch):
    """A paper-scale first step has more token entropies than torch.quantile's 2^24: the same τ from the order
    statistics (the limit lowered here to reach that path)."""
    import common.options
    ent = torch.rand(1001, generator=torch.Generator().manual_seed(1)) * 3
    expected = [eapo.calibrate_tau(ent, q) for q in (0.5, 0.9, 0.95)]
    monkeypatch.setattr(common.options, "QUANTILE_MAX", 100)
    assert [eapo.calibrate_tau(ent, q) for q in (0.5, 0.9, 0.95)] == pytest.approx(expected, rel=1e-12)


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
    flags = [s.extras["rejected"] for s in samples]
    assert all(not f.any() for f, a in zip(flags, augmented) if not a)
    ratio = eapo.augmented_share(flags, augmented)
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


# grpo.py's own metrics: its timings and DAPO's refill, which the variant files do not have
GRPO_ONLY = ("perf/", "reward/groups_refilled", "reward/refill_rounds")


def test_1_lambda_0_step_equals_grpo(in_tmp, models, monkeypatch):
    """λ_0 = 0: the same rollouts (generated tokens), the same metrics and the same weights as grpo.py."""
    import grpo

    from common import dist

    grpo_calls, eapo_calls = recording(monkeypatch, grpo), recording(monkeypatch, eapo)
    grpo.main(run_args(models, "--steps", "2", "--run-name", "g"))
    reduced, reduce = [], dist.reduce_metrics
    monkeypatch.setattr(dist, "reduce_metrics", lambda m, **kw: reduced.append(kw["weights"]) or reduce(m, **kw))
    eapo.main(run_args(models, "--steps", "2", "--run-name", "e", "--prior", str(models[1]), "--lam0", "0"))
    # under torchrun: no augmented token on any rank leaves the ratios unmeasured (weight 0), while λ and τ, the
    # step's own, keep weight 1 and stay defined (with the ratios' weight they were NaN once λ = 0)
    assert [(dist._weight("eapo/injected_ratio", w), dist._weight("eapo/lambda", w), dist._weight("eapo/tau", w))
            for w in reduced] == [(0, 1, 1)] * 2
    assert [t for t, _ in grpo_calls] == [t for t, _ in eapo_calls[-2:]]  # (the first eapo call calibrates τ)
    g, e = rows_of("g"), rows_of("e")
    assert any(r["optim/grad_norm"] > 0 for r in g.values())  # something was learnt
    for step in (1, 2):
        assert {k: v for k, v in e[step].items() if not k.startswith(("eapo/", "perf/"))} == \
               {k: v for k, v in g[step].items() if not k.startswith(GRPO_ONLY)}
        assert e[step]["eapo/lambda"] == 0 and e[step]["eapo/rejected_ratio"] == 0
    wg, we = weights("g"), weights("e")
    assert all(torch.equal(wg[k], we[k]) for k in wg)


def test_1_tau_infinite_samples_grpo_tokens_with_omega_1(in_tmp, models, monkeypatch):
    """τ = +∞ with λ = 1, sampling as on a GPU (one call, π_RL beside the augmented rows): the prior runs alongside
    but nothing is critical: grpo's tokens, ω ≡ 1, the same step."""
    import grpo

    monkeypatch.setattr(eapo.PriorWeights, "apart", property(lambda self: False))
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
    never given a gradient (10), tokens get resampled at step 1, λ halves at step 2 and is 0 at step 3. ω comes
    from the sampler's numbers: no scoring pass over the batch (fails if it came back, as grpo.py skips it)."""
    calls = recording(monkeypatch, eapo)
    scored = []
    monkeypatch.setattr(eapo, "trainer_logprobs", lambda *a, **kw: scored.append(1) or (_ for _ in ()).throw(
        AssertionError("a scoring pass ran")))
    # an entropy bonus puts every completion through the update (the tiny model's rewards may all be equal)
    eapo.main(run_args(models, "--steps", "3", "--run-name", "s", "--prior", str(models[1]), "--tau", "0",
                       "--anneal-steps", "2", "--entropy-coef", "1e-3"))
    rows = rows_of("s")
    assert [rows[k]["eapo/lambda"] for k in (1, 2, 3)] == [1.0, 0.5, 0.0]
    assert rows[1]["eapo/rejected_ratio"] > 0 and rows[3]["eapo/rejected_ratio"] == 0
    assert rows[1]["eapo/injected_ratio"] == 1.0 and rows[1]["eapo/kl_prior"] > 0
    assert rows[1]["eapo/omega_max"] != 1.0 and not scored
    # π_RL's work: G / 4 = 2 augmented completions of each of 2 prompts, one token each; none once λ = 0
    assert rows[1]["eapo/prior_tokens"] == 4 and rows[3]["eapo/prior_tokens"] == 0
    # 7: the first mini-batch's ratio is exactly 1 (the scoring pass's π_old is the update's own π_θ), over trained tokens
    assert rows[1]["policy/entropy"] > 0 and rows[1]["policy/approx_kl"] == 0
    assert rows[1]["policy/clipfrac_high"] == rows[1]["policy/clipfrac_low"] == 0
    # on a CPU each step with λ > 0 samples its augmented completions (G_e = 2 of each prompt) with π_RL, then the rest
    assert [c is not None for _, c in calls] == [True, False, True, False, False]
    (_, c1), _, (_, c2), _, _ = calls
    assert c1.rows is None and c2.rows is None  # π_RL follows every row of its call
    assert all(not p.requires_grad and p.grad is None for p in c1.model.parameters())
    state = torch.load(in_tmp / "runs" / "s" / "checkpoint" / "trainer.pt", weights_only=False)
    assert state["extra"]["eapo"]["tau"] == 0.0


def test_prior_is_held_only_while_it_samples_on_a_cpu(in_tmp, models, monkeypatch):
    """On a CPU π_RL's weights are loaded for each step's sampling and gone (no reference left) when the update runs,
    so the update's peak memory is grpo.py's. Fails if the step keeps the companion (and so π_RL) alive, or if π_RL
    stays loaded for the whole run."""
    import gc
    import weakref

    held, alive_at_update = [], []
    real_hold, real_update = eapo.PriorWeights.hold, eapo.update
    monkeypatch.setattr(eapo.PriorWeights, "hold", lambda self: held.append(weakref.ref(m := real_hold(self))) or m)

    def update(*a, **kw):
        gc.collect()
        alive_at_update.append(sum(r() is not None for r in held))
        return real_update(*a, **kw)

    monkeypatch.setattr(eapo, "update", update)
    eapo.main(run_args(models, "--steps", "2", "--run-name", "h", "--prior", str(models[1]), "--tau", "0",
                       "--anneal-steps", "2"))
    assert len(held) == 2 and alive_at_update == [0, 0]


def test_on_a_cpu_augmented_completions_sample_apart_with_pi_rl_gone_before_the_others(in_tmp, models, monkeypatch):
    """On a CPU (priors.apart) a step with λ > 0 samples its G_e augmented completions of each prompt in one call with
    π_RL and, once π_RL's weights are gone, the G - G_e ordinary ones: π_RL and the sampler's buffers for all G rows
    never meet. The groups keep the augmented ones first (augmented_rows), the ordinary ones carry zero extras, and
    the augmented ones what π_RL's mix gave them. Fails if π_RL outlives its call or the two calls are merged out of
    order."""
    import gc
    import weakref

    held, calls, groups_seen = [], [], []
    real_hold, real_generate, real_rollouts = eapo.PriorWeights.hold, eapo.generate, eapo.rollouts
    monkeypatch.setattr(eapo.PriorWeights, "hold", lambda self: held.append(weakref.ref(m := real_hold(self))) or m)

    def generate(*a, **kw):
        gc.collect()
        calls.append((kw["n"], kw.get("companion") is not None, sum(r() is not None for r in held)))
        return real_generate(*a, **kw)

    monkeypatch.setattr(eapo, "generate", generate)
    monkeypatch.setattr(eapo, "rollouts", lambda *a, **kw: groups_seen.append(g := real_rollouts(*a, **kw)) or g)
    eapo.main(run_args(models, "--steps", "1", "--run-name", "a", "--prior", str(models[1]), "--tau", "0"))
    # (n, with π_RL, π_RL's loaded copies alive as the call starts): 2 of 8 with it, then 6 without it
    assert calls == [(2, True, 1), (6, False, 0)]
    (groups,) = groups_seen
    assert all(len(g) == 8 for g in groups)
    for g in groups:
        assert all(s.extras["injected"].all() for s in g[:2])  # τ = 0, λ = 1: π_RL decides every augmented token
        assert all(not s.extras["injected"].any() and not s.extras["rl_logp"].any() for s in g[2:])
    assert rows_of("a")[1]["eapo/injected_ratio"] == 1.0


def test_on_a_cpu_the_ordinary_call_copies_the_prompts_keys_and_values_of_the_augmented_one(pair, monkeypatch):
    """The two calls of a CPU step sample the same prompts with the same weights: the second copies the first call's
    prefill of the policy instead of running it again, and samples exactly what it samples with its own prefill
    (prompts of different lengths, so left padding too). Fails if the second call prefills again (the saving
    lost) or if the copied keys and values differ from a prefill's in any bit."""
    import types

    import common.sampler

    policy, prior = pair
    priors = types.SimpleNamespace(apart=True, hold=lambda: prior)
    cfg = types.SimpleNamespace(max_new_tokens=10, temperature=0.9, top_p=1.0)
    prefills, real_prefill, real_generate = [], common.sampler.prefill, eapo.generate
    monkeypatch.setattr(common.sampler, "prefill",
                        lambda model, *a, **kw: prefills.append(model) or real_prefill(model, *a, **kw))

    def run(reuse):
        prefills.clear()
        monkeypatch.setattr(eapo, "generate", real_generate if reuse else
                            lambda *a, prompt_kv=None, **kw: real_generate(*a, **kw))
        groups = eapo.rollouts(policy, priors, eapo.PriorMix(0.5, 0.0, 0.9, seed=5), PROMPTS, 4, 1, cfg, [0, 1], 7)
        return [s for g in groups for s in g], [m is policy for m in prefills]

    copied, copied_prefills = run(reuse=True)
    own, own_prefills = run(reuse=False)
    assert copied_prefills.count(True) == 1 and own_prefills.count(True) == 2  # the policy's; π_RL's once either way
    assert len(copied) == len(own) == 12
    for a, b in zip(copied, own):
        assert a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs) and torch.equal(a.entropies, b.entropies)


def test_ranks_draw_disjoint_random_streams(in_tmp, models, monkeypatch):
    """Under torchrun each rank samples its own prompts with seeds of its own: a step's augmented call, its
    ordinary call (on a CPU) and π_RL's coins take seed, seed + 2 and seed + 1, and rank r starts at 3r, so that no
    two ranks share a stream (with a start of r, rank 1's policy draws repeated rank 0's coins)."""
    seeds = {}
    real_generate, real_init = eapo.generate, eapo.PriorMix.__init__
    monkeypatch.setattr(eapo, "generate", lambda *a, **kw: seeds[rank].append(kw["seed"]) or real_generate(*a, **kw))
    monkeypatch.setattr(eapo.PriorMix, "__init__", lambda self, lam, tau, temperature, seed, device="cpu":
                        seeds[rank].append(seed) or real_init(self, lam, tau, temperature, seed, device))
    monkeypatch.setattr(eapo.dist, "world", lambda: 2)  # as under torchrun --nproc_per_node=2
    for rank in (0, 1):
        seeds[rank] = []
        monkeypatch.setattr(eapo.dist, "rank", lambda: rank)
        eapo.main(run_args(models, "--steps", "1", "--run-name", f"r{rank}", "--prior", str(models[1]), "--tau", "0"))
    assert len(seeds[0]) == len(seeds[1]) == 3 and len(set(seeds[0]) | set(seeds[1])) == 6, seeds


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


@pytest.mark.parametrize("level", ["none", "sequence"])
def test_is_level_reaches_the_update(in_tmp, models, monkeypatch, level):
    """--is-level none gives the update ω ≡ 1 (the ablation without IS, EAPO Fig. 4b); sequence one weight per
    completion, the truncated product of its per-token ω (fails if the flag were parsed but not used)."""
    seen = []
    real_update = eapo.update
    monkeypatch.setattr(eapo, "update", lambda *a, **kw: seen.append((a[3], a[-1])) or real_update(*a, **kw))
    eapo.main(run_args(models, "--steps", "1", "--run-name", level, "--prior", str(models[1]), "--tau", "0",
                       "--is-level", level, "--max-new-tokens", "3"))
    b, loss_kw = seen[0]
    w = loss_kw["weights"]
    if level == "none":
        assert torch.equal(w, torch.ones_like(w))
    else:
        per_seq = w.split(b.lengths.tolist())
        assert all((s == s[0]).all() for s in per_seq) and w.max() <= 2.0  # --seq-cap's default
        assert any(s[0] != 1 for s in per_seq)  # some augmented completion got a weight


def test_resume_refuses_another_prior_or_schedule(in_tmp, models, capsys):
    """A resumed run keeps its experience: another π_RL, λ_0, T, G_e, τ (given, or its calibration quantile) or
    sampling temperature (which τ's entropies are measured at) is one line naming the option (fails without the
    check: the run would go on with another prior or schedule)."""
    import shutil

    common = run_args(models, "--prior", str(models[1]), "--run-name", "r", "--tau", "0")
    eapo.main([*common, "--steps", "1"])
    another = str(shutil.copytree(models[1], in_tmp / "another_prior"))
    for option, value in (("--prior", another), ("--lam0", "0.5"), ("--anneal-steps", "3"), ("--augmented", "1"),
                          ("--tau", "0.5"), ("--tau-quantile", "0.5"), ("--temperature", "1.0")):
        code, err = run_cli(capsys, *common, "--steps", "2", "--resume", option, value)
        assert code == 2 and len(err.strip().splitlines()) == 1 and option in err, err
    assert sorted(rows_of("r")) == [1]  # nothing trained or logged after the refusals
    # the same prior folder written another way is the same prior
    eapo.main([*common[:-6], "--prior", str(models[1]) + "/", "--run-name", "r", "--tau", "0", "--steps", "2",
               "--resume"])
    assert sorted(rows_of("r")) == [1, 2]
    # another --dtype (not fixed on resume) reads π_RL's weights in bf16: still the same prior
    eapo.main([*common, "--steps", "3", "--resume", "--dtype", "bfloat16"])
    assert sorted(rows_of("r")) == [1, 2, 3]
    # the same path holding another checkpoint: refused (the run would go on with another π_RL)
    prior_copy = str(shutil.copytree(models[1], in_tmp / "prior_copy"))
    moved = [*common[:-6], "--prior", prior_copy, "--run-name", "m", "--tau", "0"]
    eapo.main([*moved, "--steps", "1"])
    shutil.copy(Path(models[0]) / "model.safetensors", Path(prior_copy) / "model.safetensors")  # the policy's weights
    code, err = run_cli(capsys, *moved, "--steps", "2", "--resume")
    assert code == 2 and "--prior: expected the π_RL of the run being resumed" in err, err


def test_metrics_omega_over_critical_tokens_and_no_ordinary_accuracy_without_ordinary_responses():
    """eapo/omega_mean and omega_max read the critical tokens only (ω = 1 elsewhere would dilute the mean), and
    eapo/acc_ordinary is absent, not 0, when every completion is augmented (fails on either old reading)."""
    from common.sampler import Sample

    def sample(n):
        flags = torch.zeros(n, dtype=torch.bool)
        return Sample(tokens=[5] * n, logprobs=torch.zeros(n), entropies=torch.ones(n), finished=True,
                      extras={"rejected": flags, "injected": flags})

    groups = [[sample(3), sample(2)]]
    x = {"aug": torch.ones(5, dtype=torch.bool), "eligible": torch.tensor([True, False, False, True, False]),
         "kl": torch.zeros(5)}
    omega = torch.tensor([0.5, 1.0, 1.0, 0.25, 1.0])
    m = eapo.eapo_metrics(1.0, 0.5, groups, torch.tensor([True, True]), torch.tensor([1.0, 0.0]), x, omega)
    assert m["eapo/omega_mean"] == pytest.approx(0.375) and m["eapo/omega_max"] == 0.5
    assert m["eapo/acc_augmented"] == 0.5 and "eapo/acc_ordinary" not in m
    m = eapo.eapo_metrics(1.0, 0.5, groups, torch.tensor([True, False]), torch.tensor([1.0, 0.0]), x, omega)
    assert m["eapo/acc_ordinary"] == 0.0 and m["eapo/acc_augmented"] == 1.0
    x["eligible"][:] = False  # no critical token: no ω to report
    assert "eapo/omega_mean" not in eapo.eapo_metrics(1.0, 0.5, groups, torch.tensor([True, True]),
                                                      torch.tensor([1.0, 0.0]), x, omega)


def test_compare_reads_the_annealing_length_T(tmp_path):
    """bench/compare.py's EAPO claim names T: λ is 0 from step T + 1 (k = step - 1 = T), so a run with eapo.py's
    default --anneal-steps reports that value (it reported T + 1)."""
    import json

    from bench import compare

    cfg = compare.Config(runs_dir=str(tmp_path))
    run = tmp_path / compare.run_name(cfg, "eapo", 0)
    run.mkdir(parents=True)
    T = eapo.Config.anneal_steps
    lines = [{"step": s, "eapo/lambda": eapo.injection_prob(s - 1, 1.0, T), "perf/step_s": 1.0,
              "perf/sampled_tokens": 1.0, "perf/train_tok_s": 1.0, "perf/train_s": 1.0} for s in range(1, 16)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run / "compare.json").write_text(json.dumps({"wall_s": 1.0}))
    assert compare.run_summary(cfg, "eapo", 0)["anneal_end"] == T


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
    aug[eapo.augmented_rows(2, 8, 2)] = True
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


def test_omega_cap_outside_the_token_level_is_refused(in_tmp, models, capsys):
    """--omega-cap truncates the per-token ω: with --is-level sequence (capped by --seq-cap) or none it would be
    ignored, so it is one line naming it, before anything is written."""
    for level in ("sequence", "none"):
        code, err = run_cli(capsys, *run_args(models, "--prior", str(models[1]), "--run-name", "x", "--is-level", level,
                                              "--omega-cap", "5"))
        assert code == 2 and len(err.strip().splitlines()) == 1 and "--omega-cap" in err, err
    assert not (in_tmp / "runs").exists()



def test_offpolicy_mask_while_injecting_is_refused(in_tmp, models, capsys):
    """DeepSeek-V3.2's drift mask reads the policy's sampler log-probs, which are not the μ of the injected tokens:
    with λ0 > 0 it is one line naming it; with λ0 = 0 (grpo.py's step) it is taken."""
    code, err = run_cli(capsys, *run_args(models, "--prior", str(models[1]), "--run-name", "x", "--offpolicy-mask", "0.1"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--offpolicy-mask" in err, err
    assert not (in_tmp / "runs").exists()
    eapo.validate(eapo.Config(prior=str(models[1]), lam0=0.0, offpolicy_mask=0.1))

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



def test_a_prior_that_is_no_checkpoint_is_refused_naming_prior(in_tmp, models, capsys):
    """--prior given a run's folder (its checkpoint is inside) or a missing path: one line that names --prior and,
    for the run's folder, the checkpoint it holds (before: the model loader's message, naming neither)."""
    import shutil

    shutil.copytree(models[1], in_tmp / "prior_run" / "checkpoint")
    code, err = run_cli(capsys, *run_args(models, "--run-name", "x", "--prior", "prior_run"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: --prior: expected a checkpoint of an earlier RL run") and \
        "(prior_run/checkpoint?)" in err, err
    code, err = run_cli(capsys, *run_args(models, "--run-name", "y", "--prior", "no/such/folder"))
    assert code == 2 and err.startswith("error: --prior: expected") and "checkpoint?" not in err, err

# ------------------------------------------------------------- added by mutation testing (fail on a mutant each)

@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_2_linear_and_cosine_anneal_symmetrically_to_0_at_T(schedule):
    """Linear and cosine both take λ from λ_0 at k = 0 to 0 at k = T point-symmetrically: λ_k + λ_{T-k} = λ_0 (λ_0 / 2
    half-way), so λ comes down to 0 at T without a jump (catches a cosine over another period, cut off at T)."""
    T, lam0 = 10, 0.8
    for k in range(1, T):
        pair = eapo.injection_prob(k, lam0, T, schedule) + eapo.injection_prob(T - k, lam0, T, schedule)
        assert pair == pytest.approx(lam0), (k, pair)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_5_omega_in_the_loop_is_pi_old_over_mu_on_the_kept_tokens(in_tmp, models, monkeypatch, level):
    """The abstract's adapted IS weights, end to end over two steps (λ = 0.6, then 0.45) with a calibrated τ: on
    augmented completions the sampler emitted with μ = (1 - λ) π_old + λ π_RL exactly where the policy's entropy
    exceeds τ (μ = π_old elsewhere), and with --dynamic-sampling dropping a group before a kept one the update weights
    each kept token by ω = π_old / μ, truncated at --seq-cap under sequence (one-token completions: the product is ω).
    Catches the sampler given λ_0 or --tau instead of the step's λ and the calibrated τ, μ taken as π_RL, ω read off
    the dropped groups' tokens, and --seq-cap forgotten."""
    made, seen = [], []
    real_rollouts, real_update = eapo.rollouts, eapo.update
    monkeypatch.setattr(eapo, "rollouts", lambda *a, **kw: made.append(g := real_rollouts(*a, **kw)) or g)
    monkeypatch.setattr(eapo, "update", lambda *a, **kw: seen.append((a[3], a[-1])) or real_update(*a, **kw))

    def verify(b, tok, cfg):  # even groups all wrong (dropped), odd ones right once (kept): on any CPU's samples
        first = torch.ones(len(b.group), dtype=torch.bool)
        first[1:] = b.group[1:] != b.group[:-1]
        correct = (first & (b.group % 2 == 1)).float()
        return correct, correct.clone()
    monkeypatch.setattr(eapo, "verify", verify)
    # λ_0 = 0.6 annealed over T = 4; half of each group augmented; a small --lr keeps step 2's entropies above τ
    eapo.main(run_args(models, "--steps", "2", "--run-name", "w", "--prior", str(models[1]), "--lam0", "0.6",
                       "--anneal-steps", "4", "--augmented", "4", "--tau-quantile", "0.3", "--dynamic-sampling",
                       "--lr", "1e-4", "--prompts-per-step", "8", "--seed", "0", "--is-level", level,
                       "--seq-cap", "1.2"))
    rows, G_e, cap = rows_of("w"), 4, 1.2 if level == "sequence" else math.inf
    assert [rows[k]["eapo/lambda"] for k in (1, 2)] == pytest.approx([0.6, 0.45]) and len(made) == len(seen) == 2
    acted = set()  # the run can tell: μ != π_old at λ = 0.45, a group dropped before a kept one, ω above the cap
    for step, groups, (b, loss_kw) in zip((1, 2), made, seen):
        lam, tau = rows[step]["eapo/lambda"], rows[step]["eapo/tau"]
        kept, expected = sorted(set(b.group.tolist())), [torch.zeros(0, dtype=torch.float64)]
        acted |= {"shifted"} if kept != list(range(len(kept))) else set()
        for g, group in enumerate(groups):
            for j, s in enumerate(group):
                p_old, p_rl = s.logprobs.double().exp(), s.extras["rl_logp"].double().exp()
                critical = (s.entropies > tau) & (j < G_e)
                mu = torch.where(critical, (1 - lam) * p_old + lam * p_rl, p_old)
                if j < G_e:  # what the sampler reports (ordinary completions carry no μ)
                    assert torch.equal(s.extras["eligible"], s.entropies > tau)
                    torch.testing.assert_close(s.extras["mu_logp"].double().exp(), mu, rtol=1e-5, atol=1e-12)
                acted |= {"annealed"} if step == 2 and ((mu / p_old - 1).abs() > 0.01).any() else set()
                omega = p_old / mu
                omega = omega.prod().expand(len(omega)) if level == "sequence" else omega
                if g in kept:
                    acted |= {"binds"} if (omega > 1.2).any() else set()
                    expected.append(omega.clamp(max=cap))
        torch.testing.assert_close(loss_kw["weights"].double(), torch.cat(expected), rtol=1e-5, atol=1e-6)
    assert acted == {"annealed", "shifted", "binds"}
