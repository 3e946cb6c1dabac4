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


def policy_loss(logp, old_logp, advantages, eps_low=0.2, eps_high=0.2, *,
                weights=None, dual_clip=None, ref_logp=None, kl_coef=0.0):
    """Per-token clipped surrogate (PPO / GRPO), optionally dual-clipped, weighted and KL-regularized.

        r      = exp(logp - old_logp)
        loss   = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
        loss   = min(loss, -c A)            where A < 0, if dual_clip = c (> 1)   (Dual-clip PPO)
        loss  *= w                          if weights (a constant: importance corrections)
        loss  += kl_coef * (exp(ref - logp) - (ref - logp) - 1)      if ref_logp (k3 estimator)

    Only logp receives gradients; old_logp, advantages, weights and ref_logp are constants.
    Returns fp32 loss [...] and two bool indicators of where the clip is active, i.e. where the
    surrogate's gradient is cut by the ratio clip:
        clipped_low  = (r < 1 - eps_low)  & (A < 0)
        clipped_high = (r > 1 + eps_high) & (A > 0)
    (the dual clip is not counted in either).
    """
    logp = logp.float()
    old_logp, adv = old_logp.detach().float(), advantages.detach().float()
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    loss = -surrogate
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    if weights is not None:
        loss = loss * weights.detach().float()
    if ref_logp is not None and kl_coef != 0.0:
        log_ratio_ref = ref_logp.detach().float() - logp
        loss = loss + kl_coef * (torch.exp(log_ratio_ref) - log_ratio_ref - 1)
    ratio = ratio.detach()
    clipped_low = (ratio < 1 - eps_low) & (adv < 0)
    clipped_high = (ratio > 1 + eps_high) & (adv > 0)
    return loss, clipped_low, clipped_high
