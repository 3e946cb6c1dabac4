"""The Triton kernels and their launchers. Importing this module needs triton; kernels/ falls back
to the references in kernels/reference.py when it cannot be imported.

Log-probs + entropy, one program per row, two passes over the logits in all (forward + backward):
  forward   reads each logit once: an online log-sum-exp (the online softmax normaliser of Milakov and
            Gimelshein, arXiv 1805.02867, §3, Algorithm 3) that also carries sum(e^d d), which gives
            the entropy without a second pass (d = (x - running max) / T, rescaled when the max moves)
  backward  reads each logit once more and writes d logits once, from both output gradients, with
            p recomputed from three saved fp32 numbers per row (max, log Z, entropy): the softmax is
            never stored.
Policy loss: one elementwise pass that writes the loss and its derivative in logp, so backward is a
multiply.

Under TRITON_INTERPRET=1, set before triton is first imported, these run on CPU tensors. The interpreter gets bf16 arithmetic wrong, so every
load is cast to fp32 right away (which is also what we want on the GPU: fp32 accumulation).
"""
import torch
import triton
import triton.language as tl

# Below any real logit, but finite: the first rescale is then exp(-huge) = 0, not exp(-inf + inf) = nan.
_FLOOR = tl.constexpr(-1e30)


@triton.jit
def _logprobs_entropy_fwd(logits_ptr, targets_ptr, logp_ptr, entropy_ptr, xmax_ptr, logz_ptr,
                          row_stride, V, inv_t, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    xmax = tl.full([], _FLOOR, tl.float32)  # running max of the raw logits
    sumexp = tl.zeros([], tl.float32)       # sum e^d,    d = (x - xmax) / T
    sum_ed = tl.zeros([], tl.float32)       # sum e^d d,  for the entropy
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < V, other=_FLOOR).to(tl.float32)
        new_max = tl.maximum(xmax, tl.max(x, 0))
        shift = (xmax - new_max) * inv_t  # <= 0: moves the old terms onto the new max
        scale = tl.exp(shift)
        d = (x - new_max) * inv_t
        e = tl.exp(d)
        # e^(d + shift) (d + shift) summed = scale * (sum_ed + shift * sumexp); e = 0 terms are 0, not nan
        sum_ed = scale * (sum_ed + shift * sumexp) + tl.sum(tl.where(e > 0, e * d, 0.0), 0)
        sumexp = scale * sumexp + tl.sum(e, 0)
        xmax = new_max
    logz = tl.log(sumexp)
    x_target = tl.load(row_ptr + tl.load(targets_ptr + row)).to(tl.float32)
    # (x - max) / T stays exact for large logits, where a single fp32 lse = max/T + log Z would not
    tl.store(logp_ptr + row, (x_target - xmax) * inv_t - logz)
    tl.store(entropy_ptr + row, logz - sum_ed / sumexp)  # H = log Z - sum p d
    tl.store(xmax_ptr + row, xmax)
    tl.store(logz_ptr + row, logz)


@triton.jit
def _logprobs_entropy_bwd(logits_ptr, dlogits_ptr, targets_ptr, grad_logp_ptr, grad_entropy_ptr,
                          xmax_ptr, logz_ptr, entropy_ptr, row_stride, drow_stride, V, inv_t,
                          BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    drow_ptr = dlogits_ptr + row * drow_stride
    target = tl.load(targets_ptr + row)
    g_logp = tl.load(grad_logp_ptr + row)
    g_entropy = tl.load(grad_entropy_ptr + row)
    xmax = tl.load(xmax_ptr + row)
    logz = tl.load(logz_ptr + row)
    entropy = tl.load(entropy_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < V, other=_FLOOR).to(tl.float32)
        logp = (x - xmax) * inv_t - logz
        p = tl.exp(logp)
        # d logp_t / dz = 1[j = t] - p;   dH / dz = -p (log p + H);   dz / dx = 1 / T
        dz = tl.where(p > 0, -p * (g_logp + g_entropy * (logp + entropy)), 0.0)
        dz = tl.where(cols == target, dz + g_logp, dz)
        tl.store(drow_ptr + cols, (dz * inv_t).to(dlogits_ptr.dtype.element_ty), mask=cols < V)


@triton.jit
def _policy_loss_fwd(logp_ptr, old_logp_ptr, adv_ptr, weights_ptr, ref_logp_ptr, entropy_ptr,
                     seq_log_ratio_ptr, sampler_logp_ptr, loss_ptr, dloss_ptr, clipped_low_ptr, clipped_high_ptr,
                     n, ratio_low, ratio_high, kl_coef, entropy_coef, tis_cap, kl_max,
                     HAS_WEIGHTS: tl.constexpr, HAS_REF: tl.constexpr, HAS_ENTROPY: tl.constexpr,
                     HAS_SEQ: tl.constexpr, HAS_TIS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    logp = tl.load(logp_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    old_logp = tl.load(old_logp_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    adv = tl.load(adv_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SEQ:  # GSPO: the sequence's mean log-ratio as the value; d ratio / d logp is still ratio
        ratio = tl.exp(tl.load(seq_log_ratio_ptr + offs, mask=mask, other=0.0).to(tl.float32))
    else:
        ratio = tl.exp(logp - old_logp)
    clipped_ratio = tl.minimum(tl.maximum(ratio, ratio_low), ratio_high)
    loss = -tl.minimum(ratio * adv, clipped_ratio * adv)
    clipped_low = (ratio < ratio_low) & (adv < 0)
    clipped_high = (ratio > ratio_high) & (adv > 0)
    # min() takes the clipped branch exactly where one of these holds; there it is flat in logp
    dloss = tl.where(clipped_low | clipped_high, 0.0, -adv * ratio)
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        loss = loss * w
        dloss = dloss * w
    if HAS_TIS:
        sampler_logp = tl.load(sampler_logp_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tis = tl.minimum(tl.exp(old_logp - sampler_logp), tis_cap)
        loss = loss * tis
        dloss = dloss * tis
    if HAS_REF:
        x = tl.load(ref_logp_ptr + offs, mask=mask, other=0.0).to(tl.float32) - logp
        in_range = (x >= -kl_max) & (x <= kl_max)  # outside, the clamped term is flat in logp
        x = tl.minimum(tl.maximum(x, -kl_max), kl_max)
        ratio_ref = tl.exp(x)
        loss = loss + kl_coef * (ratio_ref - x - 1.0)
        dloss = dloss + tl.where(in_range, kl_coef * (1.0 - ratio_ref), 0.0)
    if HAS_ENTROPY:  # its gradient, -entropy_coef per unit of loss, goes to entropy in backward
        loss = loss - entropy_coef * tl.load(entropy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(loss_ptr + offs, loss, mask=mask)
    tl.store(dloss_ptr + offs, dloss, mask=mask)
    tl.store(clipped_low_ptr + offs, clipped_low.to(tl.int8), mask=mask)
    tl.store(clipped_high_ptr + offs, clipped_high.to(tl.int8), mask=mask)


# True when TRITON_INTERPRET=1 was set before triton was imported: the kernels then run on CPU tensors
INTERPRETED = not isinstance(_policy_loss_fwd, triton.runtime.JITFunction)


def _launch_config(V):
    """(BLOCK_V, num_warps). Small blocks under the interpreter so that tests cross block borders."""
    if INTERPRETED:
        return 512, 4
    block_v = min(8192, triton.next_power_of_2(V))
    return block_v, (16 if block_v >= 8192 else 8 if block_v >= 2048 else 4)


def logprobs_entropy_fwd(logits, targets, temperature):
    """logits [N, V] with unit column stride -> fp32 (logp, entropy, xmax, logz), each [N]."""
    N, V = logits.shape
    logp, entropy, xmax, logz = (torch.empty(N, device=logits.device, dtype=torch.float32) for _ in range(4))
    block_v, num_warps = _launch_config(V)
    _logprobs_entropy_fwd[(N,)](
        logits, targets, logp, entropy, xmax, logz, logits.stride(0), V, 1.0 / temperature,
        BLOCK_V=block_v, num_warps=num_warps)
    return logp, entropy, xmax, logz


def logprobs_entropy_bwd(logits, targets, grad_logp, grad_entropy, xmax, logz, entropy, temperature,
                         out=None):
    """d logits [N, V] in logits' dtype. out may be logits itself: each element is read before it
    is overwritten, by the same program."""
    N, V = logits.shape
    dlogits = torch.empty_like(logits) if out is None else out
    block_v, num_warps = _launch_config(V)
    _logprobs_entropy_bwd[(N,)](
        logits, dlogits, targets, grad_logp, grad_entropy, xmax, logz, entropy,
        logits.stride(0), dlogits.stride(0), V, 1.0 / temperature,
        BLOCK_V=block_v, num_warps=num_warps)
    return dlogits


def policy_loss_fwd(logp, old_logp, adv, eps_low, eps_high, *, weights=None, ref_logp=None, kl_coef=0.0,
                    entropy=None, entropy_coef=0.0, seq_log_ratio=None, sampler_logp=None, tis_cap=None, kl_max=10.0):
    """Flat contiguous inputs [N] -> fp32 loss, fp32 d loss / d logp, bool clipped_low, clipped_high.
    seq_log_ratio: GSPO's per-token sequence mean of logp - old_logp (fp32)."""
    n = logp.numel()
    # separate tensors, not rows of one: outputs that are views could not be modified in place by the caller
    loss, dloss = (torch.empty(n, device=logp.device, dtype=torch.float32) for _ in range(2))
    clipped_low, clipped_high = (torch.empty(n, device=logp.device, dtype=torch.int8) for _ in range(2))
    optional = [weights, ref_logp, entropy, seq_log_ratio, sampler_logp]
    block = 1024
    _policy_loss_fwd[(triton.cdiv(n, block),)](
        logp, old_logp, adv, *[logp if t is None else t for t in optional],  # absent ones are never read
        loss, dloss, clipped_low, clipped_high, n, 1.0 - eps_low, 1.0 + eps_high,
        float(kl_coef), float(entropy_coef), float("inf") if tis_cap is None else float(tis_cap), float(kl_max),
        HAS_WEIGHTS=weights is not None, HAS_REF=ref_logp is not None, HAS_ENTROPY=entropy is not None,
        HAS_SEQ=seq_log_ratio is not None, HAS_TIS=sampler_logp is not None, BLOCK=block)
    return loss, dloss, clipped_low.bool(), clipped_high.bool()
