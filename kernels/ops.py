"""The fused ops: autograd Functions around the Triton kernels, the chunked LM-head path, and the
dispatch between Triton and the PyTorch references.

Dispatch: Triton runs on CUDA tensors; elsewhere logprobs_entropy and policy_loss are the functions in
kernels/reference.py, and the LM-head path runs its chunks with the kernel's math written in PyTorch.
FORCE_TRITON=1 (read at call time) sends CPU tensors through the Triton kernels too, for the
interpreter (TRITON_INTERPRET=1) to run them in tests.
"""
import os

import torch

from kernels import reference

try:
    from kernels import triton_kernels
except ImportError:  # no triton (e.g. macOS): the references do everything
    triton_kernels = None

# Logits elements per chunk of the LM-head path: 2^25 is 128 MB in fp32, and still a large matmul.
CHUNK_ELEMENTS = 2 ** 25


def use_triton(tensor):
    if triton_kernels is None or not (tensor.is_cuda or os.environ.get("FORCE_TRITON") == "1"):
        return False
    if not tensor.is_cuda and not triton_kernels.INTERPRETED:
        raise RuntimeError("kernels: FORCE_TRITON=1 on CPU tensors needs TRITON_INTERPRET=1, "
                           "set before triton is first imported")
    return True


def _flat(tensor):
    """A contiguous 1-D view (or copy) of tensor, as the kernels index it."""
    return tensor.reshape(-1).contiguous()


def _check_temperature(op, temperature):
    if not temperature > 0:
        raise ValueError(f"kernels.{op}: temperature must be > 0, got {temperature}")


def _grad_or_zeros(grad, like):
    # autograd passes None for an output that did not reach the loss, and an expanded
    # (stride-0) tensor after .sum(); the kernels want contiguous fp32
    return torch.zeros_like(like) if grad is None else grad.float().contiguous()


# --- log-probs and entropy from logits -----------------------------------------------------------

class _LogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature):
        logp, entropy, xmax, logz = triton_kernels.logprobs_entropy_fwd(logits, targets, temperature)
        # per row only (max, log Z, entropy): backward recomputes p from the logits
        ctx.save_for_backward(logits, targets, xmax, logz, entropy)
        ctx.temperature = temperature
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, xmax, logz, entropy = ctx.saved_tensors
        dlogits = triton_kernels.logprobs_entropy_bwd(
            logits, targets, _grad_or_zeros(grad_logp, xmax), _grad_or_zeros(grad_entropy, xmax),
            xmax, logz, entropy, ctx.temperature)
        return dlogits, None, None


def logprobs_entropy(logits, targets, temperature=1.0):
    """log softmax(logits / T)[target] and entropy of softmax(logits / T) per row, in one read of
    the logits (and one more in backward, which writes d logits in logits' dtype).

    logits [..., V] any float dtype, targets [...] long (valid ids). Returns fp32 (logp, entropy)
    [...], both differentiable in logits.
    """
    _check_temperature("logprobs_entropy", temperature)
    if not use_triton(logits):
        return reference.logprobs_entropy(logits, targets, temperature)
    V = logits.shape[-1]
    rows = logits.reshape(-1, V)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    logp, entropy = _LogprobsEntropy.apply(rows, _flat(targets), float(temperature))
    return logp.view(targets.shape), entropy.view(targets.shape)


# --- the same from hidden states, one chunk of logits at a time --------------------------------

# The chunk's logits are ours (just computed from hidden @ weight.T), so they may be overwritten: the
# Triton backward writes d logits over them, and the PyTorch versions work on them in place, which
# keeps their temporaries to about two chunks.

def _chunk_fwd(logits, targets, temperature):
    """(logp, entropy, xmax, logz) of one chunk of logits [c, V]; the kernel's math in PyTorch off-GPU."""
    if use_triton(logits):
        return triton_kernels.logprobs_entropy_fwd(logits, targets, temperature)
    logp_all = logits.float()  # the same tensor when the logits are fp32
    xmax = logp_all.amax(-1)
    logz = torch.logsumexp(logp_all.sub_(xmax[:, None]).div_(temperature), -1)
    logp_all -= logz[:, None]
    p = logp_all.exp()
    entropy = torch.special.entr(p, out=p).sum(-1)
    return logp_all.gather(1, targets[:, None])[:, 0], entropy, xmax, logz


def _chunk_bwd(logits, targets, grad_logp, grad_entropy, xmax, logz, entropy, temperature):
    """d logits of one chunk, in the logits' dtype."""
    if use_triton(logits):
        return triton_kernels.logprobs_entropy_bwd(logits, targets, grad_logp, grad_entropy,
                                                   xmax, logz, entropy, temperature, out=logits)
    logp_all = logits.float().sub_(xmax[:, None]).div_(temperature).sub_(logz[:, None])
    p = logp_all.exp()
    # dz = -p (g_logp + g_entropy (log p + H)) + g_logp 1[j = t], as in the kernel
    dz = logp_all.add_(entropy[:, None]).mul_(grad_entropy[:, None]).add_(grad_logp[:, None]).mul_(p)
    dz.masked_fill_(p == 0, 0.0).neg_()  # p = 0 with log p = -inf would give nan
    dz[torch.arange(len(targets), device=dz.device), targets] += grad_logp
    return dz.div_(temperature).to(logits.dtype)


def _autocast_dtype(hidden, weight):
    """The dtype autocast would run the LM-head matmul in, or the inputs' common dtype."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _LinearLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, dtype, chunk_size):
        N = hidden.shape[0]
        weight_c = weight.to(dtype)  # no copy when weight already has the compute dtype
        logp, entropy, xmax, logz = torch.empty(4, N, device=hidden.device, dtype=torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            for rows in _chunks(N, chunk_size):
                logits = hidden[rows].to(dtype) @ weight_c.T  # [c, V]: the only big tensor alive
                outs = _chunk_fwd(logits, targets[rows], temperature)
                for buffer, out in zip((logp, entropy, xmax, logz), outs):
                    buffer[rows] = out
        ctx.save_for_backward(hidden, weight, targets, xmax, logz, entropy)
        ctx.temperature, ctx.dtype, ctx.chunk_size = temperature, dtype, chunk_size
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, xmax, logz, entropy = ctx.saved_tensors
        grad_logp, grad_entropy = _grad_or_zeros(grad_logp, xmax), _grad_or_zeros(grad_entropy, xmax)
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        weight_c = weight.to(ctx.dtype)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # fp32 accumulator: summing per-chunk bf16 products in bf16 would lose the small ones
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            for rows in _chunks(hidden.shape[0], ctx.chunk_size):
                h = hidden[rows].to(ctx.dtype)
                dlogits = _chunk_bwd(h @ weight_c.T, targets[rows], grad_logp[rows], grad_entropy[rows],
                                     xmax[rows], logz[rows], entropy[rows], ctx.temperature)
                if need_hidden:
                    grad_hidden[rows] = dlogits @ weight_c
                if need_weight and dlogits.dtype == torch.float32:
                    grad_weight.addmm_(dlogits.T, h)
                elif need_weight:
                    grad_weight += dlogits.T @ h
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        return grad_hidden, grad_weight, None, None, None, None


def _chunks(n, chunk_size):
    return [slice(start, min(start + chunk_size, n)) for start in range(0, n, chunk_size)]


def linear_logprobs_entropy(hidden, weight, targets, temperature=1.0, *, chunk_size=None):
    """logprobs_entropy(hidden @ weight.T, targets, temperature) without ever holding all the logits.

    hidden [..., d], weight [V, d] (the LM head), targets [...] long. Works a chunk of chunk_size
    rows at a time (default: CHUNK_ELEMENTS // V), forward and backward (which recomputes the
    chunk's logits), so the extra memory is about chunk_size * V, not N * V. Differentiable in
    hidden and weight. Under autocast the matmul runs in the autocast dtype, as it would in a model.
    """
    d = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"kernels.linear_logprobs_entropy: weight must be [V, {d}], got {list(weight.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"kernels.linear_logprobs_entropy: targets must be {list(hidden.shape[:-1])} "
                         f"(hidden's leading dims), got {list(targets.shape)}")
    _check_temperature("linear_logprobs_entropy", temperature)
    chunk_size = chunk_size or max(1, CHUNK_ELEMENTS // weight.shape[0])
    logp, entropy = _LinearLogprobsEntropy.apply(
        hidden.reshape(-1, d), weight, _flat(targets), float(temperature),
        _autocast_dtype(hidden, weight), int(chunk_size))
    return logp.view(targets.shape), entropy.view(targets.shape)


# --- policy loss ------------------------------------------------------------------------------------

class _PolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, old_logp, adv, weights, ref_logp, eps_low, eps_high, dual_clip, kl_coef):
        loss, dloss_dlogp, clipped_low, clipped_high = triton_kernels.policy_loss_fwd(
            logp, old_logp, adv, weights, ref_logp, eps_low, eps_high, dual_clip, kl_coef)
        ctx.save_for_backward(dloss_dlogp)  # the kernel wrote the local derivative already
        ctx.logp_dtype = logp.dtype
        ctx.mark_non_differentiable(clipped_low, clipped_high)
        return loss, clipped_low, clipped_high

    @staticmethod
    def backward(ctx, grad_loss, _grad_low, _grad_high):
        (dloss_dlogp,) = ctx.saved_tensors
        return (grad_loss * dloss_dlogp).to(ctx.logp_dtype), *([None] * 8)


def policy_loss(logp, old_logp, advantages, eps_low=0.2, eps_high=0.2, *,
                weights=None, dual_clip=None, ref_logp=None, kl_coef=0.0):
    """Per-token clipped surrogate, r = exp(logp - old_logp):

        loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), capped at -dual_clip * A where A < 0,
               times weights, plus kl_coef * k3(ref_logp, logp)   (kernels.reference.policy_loss)

    Returns fp32 loss, bool clipped_low = (r < 1 - eps_low) & (A < 0) and bool clipped_high =
    (r > 1 + eps_high) & (A > 0) (where the ratio clip cuts the gradient; the dual clip is not
    counted), all of logp's shape. Only logp gets a gradient."""
    named = {"old_logp": old_logp, "advantages": advantages, "weights": weights, "ref_logp": ref_logp}
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != logp.shape:
            raise ValueError(f"kernels.policy_loss: {name} has shape {list(tensor.shape)}, "
                             f"expected logp's shape {list(logp.shape)} (broadcast it first)")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"kernels.policy_loss: dual_clip must be > 1, got {dual_clip}")
    if not use_triton(logp):
        return reference.policy_loss(logp, old_logp, advantages, eps_low, eps_high, weights=weights,
                                     dual_clip=dual_clip, ref_logp=ref_logp, kl_coef=kl_coef)
    if ref_logp is None or kl_coef == 0.0:
        ref_logp, kl_coef = None, 0.0
    flat = [None if t is None else _flat(t.detach()) for t in (old_logp, advantages, weights, ref_logp)]
    outs = _PolicyLoss.apply(_flat(logp), *flat, float(eps_low), float(eps_high), dual_clip, float(kl_coef))
    return tuple(out.view(logp.shape) for out in outs)
