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

# kernels.triton_kernels, imported when a CUDA tensor (or FORCE_TRITON) first asks for it: importing triton maps
# ~0.07 x 10^9 bytes of its libraries into memory, which a CPU run never uses (its peak RSS is what it would add to).
triton_kernels = None
_imported = False


def triton_module():
    """kernels.triton_kernels, imported on the first call; None where triton is not installed (e.g. macOS): then
    the references do everything."""
    global triton_kernels, _imported
    if not _imported:
        _imported = True
        try:
            from kernels import triton_kernels as module
            triton_kernels = module
        except ImportError:
            pass
    return triton_kernels

# Logits elements per chunk of the LM-head path: 2^25 is 128 MB in fp32, and still a large matmul. On a CPU
# half of it: a chunk of ~340 rows x 49k vocabulary multiplies as fast, and the trainer's peak memory is lower.
CHUNK_ELEMENTS = 2 ** 25
CPU_CHUNK_ELEMENTS = 2 ** 24


def use_triton(tensor):
    if not (tensor.is_cuda or os.environ.get("FORCE_TRITON") == "1") or triton_module() is None:
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
    # an output that did not reach the loss gets zeros (or None, with set_materialize_grads(False)), and one
    # after .sum() an expanded (stride-0) tensor; the kernels want contiguous fp32
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
# Triton backward writes d logits over them, and the PyTorch versions work on them in place, ROW_BLOCK
# rows at a time, so that their other temporary (p = exp(log p)) is a block of rows, not a second chunk:
# on a CPU the trainer's peak memory is this backward, on top of the earlier micro-batches' gradients.
ROW_BLOCK = 32


def _chunk_fwd(logits, targets, temperature):
    """(logp, entropy, xmax, logz) of one chunk of logits [c, V]; the kernel's math in PyTorch off-GPU."""
    if use_triton(logits):
        return triton_kernels.logprobs_entropy_fwd(logits, targets, temperature)
    logp_all = logits.float()  # the same tensor when the logits are fp32
    xmax = logp_all.amax(-1)
    logz = torch.empty_like(xmax)
    entropy = torch.empty_like(xmax)
    for rows in _chunks(len(targets), ROW_BLOCK):
        logp = logp_all[rows].sub_(xmax[rows, None]).div_(temperature)
        logz[rows] = torch.logsumexp(logp, -1)
        logp -= logz[rows, None]
        p = logp.exp()
        entropy[rows] = torch.special.entr(p, out=p).sum(-1)
    return logp_all.gather(1, targets[:, None])[:, 0], entropy, xmax, logz


def _chunk_bwd(logits, targets, grad_logp, grad_entropy, xmax, logz, entropy, temperature):
    """d logits of one chunk, in the logits' dtype (over the logits themselves when they are fp32)."""
    if use_triton(logits):
        return triton_kernels.logprobs_entropy_bwd(logits, targets, grad_logp, grad_entropy,
                                                   xmax, logz, entropy, temperature, out=logits)
    dz_all = logits.float()
    for rows in _chunks(len(targets), ROW_BLOCK):
        logp = dz_all[rows].sub_(xmax[rows, None]).div_(temperature).sub_(logz[rows, None])
        p = logp.exp()
        # dz = -p (g_logp + g_entropy (log p + H)) + g_logp 1[j = t], as in the kernel
        dz = logp.add_(entropy[rows, None]).mul_(grad_entropy[rows, None]).add_(grad_logp[rows, None]).mul_(p)
        dz.masked_fill_(p == 0, 0.0).neg_()  # p = 0 with log p = -inf would give nan
    dz_all[torch.arange(len(targets), device=dz_all.device), targets] += grad_logp
    return dz_all.div_(temperature).to(logits.dtype)


# On a CPU, hidden @ weight.T for a whole vocabulary writes a [rows, V] result far larger than the caches, and
# MKL's sgemm then runs below its rate on the model's other matmuls. Column blocks of the output, each a matmul of
# its own written in place, keep the working set small: `python bench/kernels.py --lm-head-blocks` (SmolLM2's head,
# 2-core AVX2 EPYC) gave 1.17-1.21x at a decode step's 64-150 rows, 1.33-1.40x at 16, 1.07-1.15x at 340 rows.
VOCAB_BLOCK = 2048


def lm_head_logits(hidden, weight):
    """hidden [N, d] @ weight.T -> logits [N, V] (weight [V, d]), on a CPU in fp32 VOCAB_BLOCK vocabulary
    columns at a time into one output. That path writes with out= and has no autograd: it serves inference
    and the fused LM-head path's own forward and backward. Other devices and dtypes, and under autocast (which
    does not touch out= calls): the plain matmul."""
    if (hidden.device.type != "cpu" or hidden.dtype != torch.float32 or weight.dtype != torch.float32
            or torch.is_autocast_enabled("cpu")):
        return hidden @ weight.T
    logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
    for cols in _chunks(weight.shape[0], VOCAB_BLOCK):
        torch.mm(hidden, weight[cols].T, out=logits[:, cols])
    return logits


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
        # four tensors, not rows of one: outputs that are views could not be modified in place by the caller
        logp, entropy, xmax, logz = (torch.empty(N, device=hidden.device, dtype=torch.float32) for _ in range(4))
        with torch.autocast(hidden.device.type, enabled=False):
            for rows in _chunks(N, chunk_size):
                logits = lm_head_logits(hidden[rows].to(dtype), weight_c)  # [c, V]: the only big tensor alive
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
        grad_weight = None  # made from the first chunk's product, once that chunk's temporaries are gone
        with torch.autocast(hidden.device.type, enabled=False):
            for rows in _chunks(hidden.shape[0], ctx.chunk_size):
                h = hidden[rows].to(ctx.dtype)
                dlogits = _chunk_bwd(lm_head_logits(h, weight_c), targets[rows], grad_logp[rows], grad_entropy[rows],
                                     xmax[rows], logz[rows], entropy[rows], ctx.temperature)
                if need_hidden:
                    grad_hidden[rows] = dlogits @ weight_c
                if not need_weight:
                    continue
                if grad_weight is None:
                    # fp32 accumulator: summing per-chunk bf16 products in bf16 would lose the small ones
                    grad_weight = (dlogits.T @ h).float()
                elif dlogits.dtype == torch.float32:
                    grad_weight.addmm_(dlogits.T, h)
                else:
                    grad_weight += dlogits.T @ h
        if need_weight and grad_weight is None:  # no rows at all
            grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        return grad_hidden, grad_weight, None, None, None, None


def _chunks(n, chunk_size):
    return [slice(start, min(start + chunk_size, n)) for start in range(0, n, chunk_size)]


def linear_logprobs_entropy(hidden, weight, targets, temperature=1.0, *, chunk_size=None):
    """logprobs_entropy(hidden @ weight.T, targets, temperature) without ever holding all the logits.

    hidden [..., d], weight [V, d] (the LM head), targets [...] long. Works a chunk of chunk_size
    rows at a time (default: CHUNK_ELEMENTS // V, on a CPU CPU_CHUNK_ELEMENTS // V), forward and backward (which recomputes the
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
    chunk_size = chunk_size or max(1, (CPU_CHUNK_ELEMENTS if weight.device.type == "cpu" else CHUNK_ELEMENTS)
                                   // weight.shape[0])
    logp, entropy = _LinearLogprobsEntropy.apply(
        hidden.reshape(-1, d), weight, _flat(targets), float(temperature),
        _autocast_dtype(hidden, weight), int(chunk_size))
    return logp.view(targets.shape), entropy.view(targets.shape)


# --- policy loss ------------------------------------------------------------------------------------

class _PolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, entropy, old_logp, adv, eps_low, eps_high, options):
        loss, dloss_dlogp, clipped_low, clipped_high = triton_kernels.policy_loss_fwd(
            logp, old_logp, adv, eps_low, eps_high, entropy=entropy, **options)
        ctx.save_for_backward(dloss_dlogp)  # the kernel wrote the local derivative already
        ctx.logp_dtype = logp.dtype
        ctx.entropy_coef = options["entropy_coef"]
        ctx.entropy_dtype = None if entropy is None else entropy.dtype
        ctx.mark_non_differentiable(clipped_low, clipped_high)
        return loss, clipped_low, clipped_high

    @staticmethod
    def backward(ctx, grad_loss, _grad_low, _grad_high):
        (dloss_dlogp,) = ctx.saved_tensors
        grad_logp = (grad_loss * dloss_dlogp).to(ctx.logp_dtype)
        # loss -= entropy_coef * entropy: the bonus is linear in entropy
        grad_entropy = None if ctx.entropy_dtype is None else (-ctx.entropy_coef * grad_loss).to(ctx.entropy_dtype)
        return grad_logp, grad_entropy, None, None, None, None, None


def _check_policy_inputs(logp, float_inputs, seq_ids, eps_low, eps_high, kl_coef, entropy_coef, tis_cap):
    """One-line ValueErrors for inputs policy_loss cannot use."""
    def fail(message):
        raise ValueError(f"kernels.policy_loss: {message}")

    named = {**float_inputs, "seq_ids": seq_ids}
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != logp.shape:
            fail(f"{name} has shape {list(tensor.shape)}, expected logp's shape {list(logp.shape)} "
                 "(broadcast it first)")
    for name, tensor in float_inputs.items():
        if tensor is not None and not tensor.is_floating_point():
            fail(f"{name} must be a float tensor, got {tensor.dtype}")
    if seq_ids is not None and seq_ids.dtype != torch.long:
        fail(f"seq_ids must be a long tensor (sequence index per token), got {seq_ids.dtype}")
    if not (0 <= eps_low <= 1 and eps_high >= 0):
        fail(f"expected 0 <= eps_low <= 1 and eps_high >= 0 (1 and inf: no clip), got {eps_low}, {eps_high}")
    if tis_cap is not None and not tis_cap > 0:
        fail(f"tis_cap must be > 0 (or None: no truncation), got {tis_cap}")
    for coef, name, needs in ((kl_coef, "kl_coef", "ref_logp"), (entropy_coef, "entropy_coef", "entropy"),
                              (tis_cap, "tis_cap", "sampler_logp")):
        if coef not in (None, 0.0) and float_inputs[needs] is None:
            fail(f"{name}={coef} needs {needs}")


def policy_loss(logp, old_logp, advantages, eps_low=0.2, eps_high=0.2, *, weights=None, ref_logp=None, kl_coef=0.0,
                entropy=None, entropy_coef=0.0, seq_ids=None, sampler_logp=None, tis_cap=None):
    """Per-token clipped surrogate with its options; the math, written out, is kernels.reference.policy_loss:

        r = exp(logp - old_logp)  (with seq_ids: GSPO's sequence ratio, per token, gradient r d logp)
        loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), times weights and
               min(exp(old_logp - sampler_logp), tis_cap); plus kl_coef * k3(ref_logp, logp) with the
               log-ratio clamped to +-10; minus entropy_coef * entropy

    All inputs have logp's shape; seq_ids is long. Returns fp32 loss, bool clipped_low =
    (r < 1 - eps_low) & (A < 0) and bool clipped_high = (r > 1 + eps_high) & (A > 0) (where the ratio clip
    cuts the gradient), all of logp's shape.
    logp gets a gradient, and entropy when entropy_coef != 0; every other input is a constant.
    eps_low = 1, eps_high = inf switch the clip off."""
    float_inputs = {"old_logp": old_logp, "advantages": advantages, "weights": weights, "ref_logp": ref_logp,
                    "entropy": entropy, "sampler_logp": sampler_logp}
    _check_policy_inputs(logp, float_inputs, seq_ids, eps_low, eps_high, kl_coef, entropy_coef, tis_cap)
    options = dict(weights=weights, ref_logp=ref_logp, kl_coef=kl_coef, entropy=entropy, entropy_coef=entropy_coef,
                   seq_ids=seq_ids, sampler_logp=sampler_logp, tis_cap=tis_cap)
    if not use_triton(logp):
        return reference.policy_loss(logp, old_logp, advantages, eps_low, eps_high, **options)
    if kl_coef == 0.0:
        ref_logp = None
    if entropy_coef == 0.0:
        entropy = None
    seq_log_ratio = None
    if seq_ids is not None:  # GSPO: the per-sequence mean log-ratio, a constant, computed once here
        seq_log_ratio = reference.sequence_mean(logp.detach().float() - old_logp.detach().float(), seq_ids)
    flat = {name: None if t is None else _flat(t.detach()) for name, t in
            dict(weights=weights, ref_logp=ref_logp, seq_log_ratio=seq_log_ratio, sampler_logp=sampler_logp).items()}
    kernel_options = dict(flat, kl_coef=float(kl_coef), entropy_coef=float(entropy_coef), tis_cap=tis_cap,
                          kl_max=reference.KL_LOG_RATIO_MAX)
    outs = _PolicyLoss.apply(_flat(logp), None if entropy is None else _flat(entropy), _flat(old_logp.detach()),
                             _flat(advantages.detach()), float(eps_low), float(eps_high), kernel_options)
    return tuple(out.view(logp.shape) for out in outs)
