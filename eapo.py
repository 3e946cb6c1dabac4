"""EAPO (work in progress: the pieces; the loop comes with the new grpo.py skeleton)."""
import math

import torch

from common.sampler import draw, softmax_stats


# -------------------------------------------------------------------------- EAPO: experience from π_RL
# Experience Augmented Policy Optimization (arXiv 2606.30420). Only the abstract and the figure captions are
# public: every "our choice" below is ours, made where the paper's text was not available.

def injection_prob(k: int, lam0: float, T: int, schedule: str = "linear") -> float:
    """λ_k, the chance of taking a critical token from π_RL at step k = 0, 1, ... (experience annealing over
    T steps, EAPO Fig. 4a). After T steps EAPO is plain on-policy RLVR."""
    if k >= T:
        return 0.0
    if schedule == "linear":  # our choice: the paper names T but not the shape; linear is the simplest
        return lam0 * (1 - k / T)
    if schedule == "cosine":
        return lam0 * 0.5 * (1 + math.cos(math.pi * k / T))
    return lam0  # "constant": full strength until T, then off


def augmented_rows(n_prompts: int, G: int, G_e: int) -> list[int]:
    """Sample indices (prompt-major) of the experience-augmented responses: the first G_e of each group
    (EAPO Fig. 2 logs augmented and ordinary responses apart). our choice: the other G - G_e stay on-policy,
    an anchor for every group's baseline."""
    return [i * G + j for i in range(n_prompts) for j in range(G_e)]


def speculative_resample(p_old, p_rl, draft, generator=None):
    """A token distributed exactly as p_rl from a draft ~ p_old (speculative sampling: Chen et al. 2023,
    arXiv 2302.01318; Leviathan et al. 2023, arXiv 2211.17192): keep the draft x with probability
    min(1, p_rl(x) / p_old(x)), else draw from the residual max(0, p_rl - p_old), renormalised.
    p_old, p_rl [b, V] probabilities, draft [b]. Returns (tokens [b], resampled [b] bool: the draft was
    rejected). The chance of a rejection is TV(p_old, p_rl)."""
    q = p_old.gather(-1, draft[:, None])[:, 0]
    r = p_rl.gather(-1, draft[:, None])[:, 0]
    u = torch.rand(len(draft), generator=generator, device=draft.device)
    residual = (p_rl - p_old).clamp(min=0)  # [b, V]
    # u < r / q without a division: r = 0 (an underflowed prior) always rejects; a residual of zero mass
    # means p_rl = p_old, and the draft stays
    rejected = (u * q >= r) & (residual.sum(-1) > 0)
    return torch.where(rejected, draw(residual, generator), draft), rejected


def behaviour_logp(old_logp, rl_logp, lam: float, eligible):
    """log μ_t(a_t), the probability with which each token was actually emitted (EAPO §"adapted importance
    sampling"). At a critical position of an augmented response the token came from π_old with probability
    1 - λ and from π_RL with probability λ, so μ = (1 - λ) π_old + λ π_RL; elsewhere μ = π_old.
    our choice: the coin is folded into the mixture (eligibility is a function of the state, the coin is
    not), which makes ω a smooth function of the token. Log space keeps tiny probabilities finite."""
    if lam <= 0:
        return old_logp.clone()
    mixture = torch.logaddexp(old_logp + (math.log1p(-lam) if lam < 1 else -math.inf), rl_logp + math.log(lam))
    return torch.where(eligible, mixture, old_logp)


def is_weights(old_logp, mu_logp, cap: float = 0.0):
    """ω_t = sg(π_old(a_t) / μ_t(a_t)), the behaviour correction outside the clipped ratio (EAPO's adapted
    importance sampling; our choice of the exact form: the paper gives only its name). Without clipping,
    ω_t ρ_t = π_θ / μ_t, the per-token IS surrogate of the true behaviour policy. cap > 0 truncates ω at
    C_ω (our choice, off by default: truncation trades the unbiasedness for variance)."""
    w = torch.exp(old_logp - mu_logp).detach()  # exactly 1 where μ = π_old
    return w.clamp(max=cap) if cap > 0 else w


def calibrate_tau(entropies, quantile: float) -> float:
    """τ as the `quantile` of the starting policy's token entropies, so that about 1 - quantile of the tokens
    are critical at the start. our choice: the paper sweeps τ (Fig. 2) but its values are for other models;
    a quantile carries over to any model and task."""
    return float(torch.quantile(entropies.double(), quantile))


class PriorMix:
    """The sampler Companion's mix for the augmented rows (EAPO §"experience-augmented rollout"), one call
    per generated position. The policy's draw is the draft. Where the position is critical (the policy's
    entropy at the sampling temperature > τ, strictly) and a coin of probability λ says inject, speculative
    resampling turns it into a draw from π_RL (at the same temperature: our choice, so that π_RL's tokens
    are scored like the policy's). Returns the emitted tokens and per-token extras:
    rl_logp (log π_RL of the token), mu_logp (log μ, sampler numerics), eligible, injected, resampled
    (the draft was rejected) and kl (KL(π_old || π_RL) at the position, over the full vocabulary)."""

    def __init__(self, lam: float, tau: float, temperature: float, seed: int, device="cpu"):
        self.lam, self.tau, self.temperature = lam, tau, temperature
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)  # its own stream: the policy's draws are those it would make without us

    def __call__(self, step, draft, logits, prior_logits, rows):
        logp_old, p_old, entropy = softmax_stats(logits, self.temperature)  # [b, V], [b, V], [b]
        logp_rl, p_rl, _ = softmax_stats(prior_logits, self.temperature)
        eligible = entropy > self.tau  # EAPO: resampling threshold τ; strict, so τ = max entropy means never
        coin = torch.rand(len(draft), generator=self.gen, device=draft.device) < self.lam
        injected = eligible & coin
        spec, rejected = speculative_resample(p_old, p_rl, draft, self.gen)
        tokens = torch.where(injected, spec, draft)
        old_logp = logp_old.gather(-1, tokens[:, None])[:, 0]
        rl_logp = logp_rl.gather(-1, tokens[:, None])[:, 0]
        return tokens, {
            "rl_logp": rl_logp, "mu_logp": behaviour_logp(old_logp, rl_logp, self.lam, eligible),
            "eligible": eligible, "injected": injected, "resampled": injected & rejected,
            "kl": (p_old * (logp_old - logp_rl)).sum(-1),
        }


def pos_only_dropped(correct, augmented):
    """Completions whose loss is dropped under --pos-only: the incorrect augmented ones (EAPO Fig. 3a keeps
    only positive experience, following ExGRPO and DeepSeek-V3.2). Their group's advantages are computed
    before, over the whole group. correct, augmented [N] -> [N] bool."""
    return augmented & (correct <= 0)


def resampled_ratio(resampled: list, augmented: list) -> float:
    """Resampled tokens / tokens, over the augmented responses only (EAPO Fig. 2); ordinary ones add
    nothing. resampled: one bool tensor per completion; augmented: one bool per completion."""
    n = sum(len(r) for r, a in zip(resampled, augmented) if a)
    return sum(int(r.sum()) for r, a in zip(resampled, augmented) if a) / max(n, 1)
