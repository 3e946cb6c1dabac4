"""Plain-PyTorch references for every op in kernels/.

Each function here has the same signature and meaning as the fused op it mirrors, is written the
obvious way (materialize, log_softmax, gather), and is differentiable through ordinary autograd.
They run on CPU, they are what the Triton kernels are tested against, and they are the code to read
first: the kernels compute exactly these functions, only with less memory traffic.
"""
import torch


def softmax_stats(logits, temperature=1.0):
    """logits [..., V] -> (logp [..., V], probs [..., V], entropy [...]) of softmax(logits / T) over the
    full vocabulary, differentiable. The project's one softmax: the sampler draws from probs and records
    logp and entropy with it (common/sampler.py), logprobs_entropy below gathers from it.
    Math runs in fp32 (or fp64 when given fp64) whatever the input dtype.
    """
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1:
        # softmax does not see a shift; subtracting the max before the division by T keeps fp32 exact
        # for logits of large magnitude (x / T alone would round 1e4 + 0.5 by ~5e-4). At T = 1
        # log_softmax's own max shift does the same. In place: the sampler runs this every token.
        x = (x - x.detach().amax(-1, keepdim=True)).div_(temperature)
    logp = torch.log_softmax(x, dim=-1)
    probs = logp.exp()
    # p log p is 0 where p is 0: nan_to_num turns the 0 * -inf of a masked (-inf) logit into that 0
    # (in the forward only; a real nan still shows in logp). A where() would cost the sampler ~2 passes.
    entropy = -(probs * logp).nan_to_num_(0.0).sum(-1)
    return logp, probs, entropy


def logprobs_entropy(logits, targets, temperature=1.0):
    """log softmax(logits / T)[target] and the entropy of softmax(logits / T), per row.

    logits [..., V] (any float dtype), targets [...] long. Returns fp32 (logp, entropy) [...].
    Math runs in fp32 (or fp64 when given fp64) whatever the input dtype.
    """
    logp_all, _, entropy = softmax_stats(logits, temperature)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp.float(), entropy.float()


def linear_logprobs_entropy(hidden, weight, targets, temperature=1.0, *, chunk_size=None):
    """logprobs_entropy(hidden @ weight.T, ...): hidden [..., d], weight [V, d].

    The reference materializes all the logits; chunk_size is accepted (and ignored) so that the
    signature matches the chunked op.
    """
    return logprobs_entropy(hidden @ weight.T, targets, temperature)


# k3's log-ratio ref_logp - logp is clamped to [-KL_LOG_RATIO_MAX, KL_LOG_RATIO_MAX] before exp
KL_LOG_RATIO_MAX = 10.0


def sequence_mean(values, seq_ids):
    """Per token, the mean of values over the tokens that share its sequence id. values [...] float,
    seq_ids [...] long (ids >= 0, any order: a sequence's tokens need not be contiguous)."""
    flat, ids = values.reshape(-1), seq_ids.reshape(-1)
    n = int(ids.max()) + 1 if ids.numel() else 0  # one host sync; ids need not be dense
    sums = torch.zeros(n, dtype=flat.dtype, device=flat.device).index_add_(0, ids, flat)
    counts = torch.bincount(ids, minlength=n).clamp(min=1)
    return (sums / counts)[ids].view(values.shape)


def policy_loss(logp, old_logp, advantages, eps_low=0.2, eps_high=0.2, *, weights=None, ref_logp=None, kl_coef=0.0,
                entropy=None, entropy_coef=0.0, seq_ids=None, sampler_logp=None, tis_cap=None):
    """Per-token policy-gradient loss: the clipped surrogate of PPO / GRPO and the options several algorithms share
    (a variant's own change to the loss is written in its own file).
    Every option has a neutral default; with all of them off this is the plain clipped surrogate: PPO's
    L^CLIP (arXiv 1707.06347, §3, Eq. 7) per token, as in GRPO (arXiv 2402.03300, §4.1.1, Eq. 3), with
    DAPO's decoupled clip range eps_low / eps_high ("clip-higher", arXiv 2503.14476, §3.1).

        r     = exp(logp - old_logp)                                   the token's ratio, or with seq_ids
              = sg(s) exp(logp - sg(logp)),  s = exp(mean over the token's sequence of (logp - old_logp))
        loss  = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
        loss *= weights
        loss *= min(exp(old_logp - sampler_logp), tis_cap)             if sampler_logp
        loss += kl_coef * (exp(x) - x - 1),   x = clamp(ref_logp - logp, -10, 10)   if ref_logp
        loss -= entropy_coef * entropy                                 if entropy

    - weights: a constant per-token factor on the surrogate (not on KL or entropy): importance
      corrections such as EAPO's behaviour weight omega = sg(pi_old / mu) (arXiv 2606.30420); a weight
      of 0 takes a token out of the surrogate, so a variant can put its own term there.
    - seq_ids (long): the sequence (completion) of each token. GSPO (arXiv 2507.18071 §4) in its
      GSPO-token form: every token of sequence i uses the value s_i, with gradient s_i d logp_t, and the
      clip applies to s_i. With one advantage per sequence and a caller that weights each token 1 / |y_i|,
      the gradient is that of the sequence objective -min(s_i A, clip(s_i) A). The length normalisation
      is the caller's aggregation weights, not done here.
    - sampler_logp, tis_cap: truncated importance sampling against the log-probs of the policy copy that
      sampled (e.g. bf16 weights, while the update runs fp32 master weights): a constant factor
      min(pi_old / pi_sampler, tis_cap) on the surrogate, from "Your Efficient RL Framework Secretly
      Brings You Off-Policy RL Training" (Yao et al., 2025). tis_cap None: not truncated.
    - ref_logp, kl_coef: the k3 estimator of KL(pi || pi_ref) (Schulman, "Approximating KL divergence"),
      as GRPO uses it (arXiv 2402.03300, §4.1.1, Eq. 4).
      The clamp keeps exp finite (ref_logp - logp > 88 would overflow fp32); where it is active the
      term is constant, so it contributes no gradient on those tokens: the KL stops pulling a token
      whose log-ratio to the reference is beyond +-10 nats (torch.clamp's gradient, kept by the kernel).
    - entropy, entropy_coef: an entropy bonus (ExGRPO uses 0.001). The gradient flows into entropy
      (e.g. from linear_logprobs_entropy); everything else except logp is a constant.

    eps_low = 1, eps_high = inf switch the clip off. Returns fp32 loss [...] and two bool indicators of
    where the ratio clip cuts the surrogate's gradient:
        clipped_low  = (r < 1 - eps_low)  & (A < 0)
        clipped_high = (r > 1 + eps_high) & (A > 0)
    """
    logp = logp.float()
    old_logp, adv = old_logp.detach().float(), advantages.detach().float()
    if seq_ids is None:
        log_ratio = logp - old_logp
    else:
        log_ratio = sequence_mean(logp.detach() - old_logp, seq_ids) + (logp - logp.detach())
    ratio = torch.exp(log_ratio)
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    if weights is not None:
        loss = loss * weights.detach().float()
    if sampler_logp is not None:
        tis = torch.exp(old_logp - sampler_logp.detach().float())
        loss = loss * (tis if tis_cap is None else tis.clamp(max=tis_cap))
    if ref_logp is not None and kl_coef != 0.0:
        x = (ref_logp.detach().float() - logp).clamp(-KL_LOG_RATIO_MAX, KL_LOG_RATIO_MAX)
        loss = loss + kl_coef * (torch.exp(x) - x - 1)
    if entropy is not None and entropy_coef != 0.0:
        loss = loss - entropy_coef * entropy.float()
    ratio = ratio.detach()
    clipped_low = (ratio < 1 - eps_low) & (adv < 0)
    clipped_high = (ratio > 1 + eps_high) & (adv > 0)
    return loss, clipped_low, clipped_high
