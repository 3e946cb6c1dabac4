"""The GRPO-family options that act on single tokens, completions or rewards, shared by all five algorithm files (each
off by default; docs/grpo.md lists them with the loop options that live in grpo.py itself):

    rewards = rewards + overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
    weights = token_mask(old, logp, sampler_logp, adv, seq_ids, cfg)   # a constant factor per token, or None
    keep = high_entropy(sampler_entropy, cfg.top_entropy)              # [n] bool

The update multiplies a token's clipped surrogate by the factor, so a factor of 0 takes the token out of the policy
gradient (a KL or entropy term still acts on it) while the loss's denominators (token-mean, sequence-mean) stay
those of the batch.
"""
import math

import torch

from kernels.reference import sequence_mean


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476 §3.4, eq. 13), [N]: 0 up to L_max - L_cache tokens, then
    falling linearly to -penalty at L_max = max_new_tokens (the sampler stops there, so no completion is longer)."""
    return -penalty * (lengths.float() - (max_new_tokens - buffer)).clamp(min=0) / buffer


def token_mask(old, logp, sampler_logp, adv, seq, cfg):
    """The options that weight or drop whole tokens or completions from π_old, π_θ and the sampler's log-probs, as one
    constant factor per token, None when all are off. old, logp (detached), sampler_logp, adv [n]; seq [n] each
    token's completion. Truncated IS at the token (--tis-mode token-truncate) is the fused loss's own sampler_logp."""
    w = None
    if cfg.tis_cap and cfg.tis_mode != "token-truncate":  # the sampler's mismatch, per token or per completion
        log_rho = old - sampler_logp  # log ρ_t = log π_old / π_sampler
        if cfg.tis_mode.startswith("sequence"):  # the completion's ρ: the product of its tokens' ratios
            n_seq = int(seq.max()) + 1 if seq.numel() else 0  # none under torchrun when a micro-batch's are all masked
            log_rho = torch.zeros(n_seq, dtype=old.dtype, device=old.device).index_add_(0, seq, log_rho)[seq]
        rho = log_rho.exp()
        if cfg.tis_mode.endswith("truncate"):  # min(ρ, C) (Yao et al. 2025)
            w = rho.clamp(max=cfg.tis_cap)
        else:  # ρ inside [floor, C], 0 outside: IcePop (Ring-1T, arXiv 2510.18855), TRL's *_mask modes
            w = torch.where((rho <= cfg.tis_cap) & (rho >= cfg.tis_floor), rho, 0.0)
    if cfg.offpolicy_mask:  # DeepSeek-V3.2 (arXiv 2512.02556 §3.1, Off-Policy Sequence Masking): a completion with
        # A < 0 that the policy has drifted from, mean log(π_sampler / π_θ) > δ, teaches little and can destabilise
        drift = sequence_mean(sampler_logp - logp, seq)
        keep = ~((adv < 0) & (drift > cfg.offpolicy_mask))
        w = keep.float() if w is None else w * keep
    return w


def high_entropy(entropy: torch.Tensor, keep: float) -> torch.Tensor:
    """[n] bool: the tokens whose entropy is in the top fraction `keep` (Wang et al., "Beyond the 80/20 rule", arXiv
    2506.01939 §4: train on the forking tokens only, keep = 0.2). Our choice: the sampler's entropies over the
    mini-batch rank the tokens, so the cut is the same whatever --micro-batch (the paper ranks the trainer's)."""
    if keep >= 1 or len(entropy) == 0:
        return torch.ones_like(entropy, dtype=torch.bool)
    return entropy >= quantile(entropy.float(), 1 - keep)


QUANTILE_MAX = 2 ** 24  # the most elements torch.quantile takes


def quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile(x, q) of a 1-D tensor (linear interpolation) at any length. torch.quantile refuses more than
    2^24 elements (a rank's mini-batch of 16.7M loss tokens, a paper-scale step's entropies); beyond that, the same
    value from the two order statistics around (n - 1) q."""
    if len(x) <= QUANTILE_MAX:
        return torch.quantile(x, q)
    pos = (len(x) - 1) * q
    low, high = (torch.kthvalue(x, k + 1).values for k in (math.floor(pos), math.ceil(pos)))
    return torch.lerp(low, high, pos - math.floor(pos))

