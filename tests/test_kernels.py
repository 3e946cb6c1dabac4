"""kernels/: every op against a float64 computation of the same function, values and gradients, through
the Triton kernels and through the PyTorch references.

Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, which
triton reads when it is imported) with FORCE_TRITON=1 (which kernels/ reads at call time). With a GPU
they run compiled, on CUDA tensors.
"""
import os
import subprocess
import sys

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import kernels  # noqa: E402
from kernels import ops, reference  # noqa: E402


def _reimport_interpreted():
    """Another test module may have imported triton before TRITON_INTERPRET was set here; then its
    kernels are compiled ones that cannot take CPU tensors. Import triton and kernels afresh."""
    global kernels, ops, reference
    for name in list(sys.modules):
        if name.split(".")[0] in ("triton", "kernels") and not name.startswith("triton._C"):
            del sys.modules[name]
    import kernels
    from kernels import ops, reference


if not CUDA and ops.triton_module() is not None and not ops.triton_module().INTERPRETED:
    _reimport_interpreted()

DEVICE = "cuda" if CUDA else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


@pytest.fixture(params=["triton", "reference"])
def backend(request, monkeypatch):
    """The module whose ops are tested: kernels (through Triton) or kernels.reference."""
    if request.param == "reference":
        return reference
    if ops.triton_module() is None:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("FORCE_TRITON", "1")
    assert ops.use_triton(torch.zeros(1, device=DEVICE))
    return kernels


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


# --- log-probs and entropy ------------------------------------------------------------------------

def f64_logprobs_entropy(logits, targets, temperature):
    logp_all = torch.log_softmax(logits.double() / temperature, -1)
    p = logp_all.exp()
    return logp_all.gather(-1, targets[..., None])[..., 0], -(p * logp_all).nan_to_num().sum(-1)


def random_logits(n, vocab, dtype, seed=0):
    """Random rows, with three extreme ones: a spread of +-1e4, and logits all near +1e4 and -1e4
    (where one fp32 log-sum-exp would have lost the small differences)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[0] *= 1e4 / 3
    logits[1] += 1e4
    logits[2] -= 1e4
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[3] = logits[3].argmax()
    return logits.to(DEVICE, dtype), targets.to(DEVICE)


@pytest.mark.parametrize("dtype, vocab, temperature", [
    (torch.float32, 1000, 1.0), (torch.float32, 3001, 0.7), (torch.float32, 3001, 1.3),
    (torch.bfloat16, 1000, 0.7), (torch.bfloat16, 3001, 1.0)])
def test_logprobs_entropy_matches_float64(backend, dtype, vocab, temperature):
    logits, targets = random_logits(16, vocab, dtype)
    logits.requires_grad_(True)
    logp, entropy = backend.logprobs_entropy(logits, targets, temperature)
    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == targets.shape
    grad_logp, grad_entropy = torch.randn(2, 16, device=DEVICE)
    (logits_grad,) = torch.autograd.grad((logp * grad_logp + entropy * grad_entropy).sum(), logits)
    assert logits_grad.dtype == dtype

    logits64 = logits.detach().double().requires_grad_(True)
    logp64, entropy64 = f64_logprobs_entropy(logits64, targets, temperature)
    (logits64_grad,) = torch.autograd.grad((logp64 * grad_logp + entropy64 * grad_entropy).sum(), logits64)
    assert rel_err(logp, logp64) <= TOL[dtype]
    assert rel_err(entropy, entropy64) <= TOL[dtype]
    assert rel_err(logits_grad, logits64_grad) <= TOL[dtype]


def test_logprobs_entropy_one_output_and_batched_view(backend):
    # [B, T, V] logits as a model returns them, sliced to the positions that predict the next token
    # (a non-contiguous view), and only the entropy reaching the loss (logp's gradient is None)
    logits, _ = random_logits(2 * 9, 1000, torch.float32, seed=1)
    logits = logits.view(2, 9, 1000)[:, :-1].requires_grad_(True)
    targets = torch.randint(0, 1000, (2, 8), device=DEVICE)
    logp, entropy = backend.logprobs_entropy(logits, targets)
    assert logp.shape == entropy.shape == (2, 8)
    (logits_grad,) = torch.autograd.grad(entropy.sum(), logits)
    logits64 = logits.detach().double().requires_grad_(True)
    (logits64_grad,) = torch.autograd.grad(f64_logprobs_entropy(logits64, targets, 1.0)[1].sum(), logits64)
    assert rel_err(logits_grad, logits64_grad) <= 1e-5


# --- the chunked LM-head path ----------------------------------------------------------------------

def hidden_weight(n, d, vocab, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).to(device, dtype)
    weight = (torch.randn(vocab, d, generator=g) / d ** 0.5 * 3).to(device, dtype)
    return hidden, weight, torch.randint(0, vocab, (n,), generator=g).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_path_equals_plain_path(backend, dtype):
    hidden, weight, targets = hidden_weight(13, 32, 1000, dtype)
    hidden.requires_grad_(True), weight.requires_grad_(True)
    grad_logp, grad_entropy = torch.randn(2, 13, device=DEVICE)

    def outputs_and_grads(fn, *args):
        logp, entropy = fn(*args, targets, 0.7)
        grads = torch.autograd.grad((logp * grad_logp + entropy * grad_entropy).sum(), (hidden, weight))
        return (logp, entropy, *grads)

    ours = outputs_and_grads(lambda h, w, *a: backend.linear_logprobs_entropy(h, w, *a, chunk_size=5),
                             hidden, weight)  # 5 does not divide 13: a short last chunk
    plain = outputs_and_grads(lambda h, w, *a: backend.logprobs_entropy(h @ w.T, *a), hidden, weight)
    exact = outputs_and_grads(lambda h, w, *a: f64_logprobs_entropy(h.double() @ w.double().T, *a),
                              hidden, weight)
    assert ours[2].dtype == ours[3].dtype == dtype
    for out, same, ref in zip(ours, plain, exact):
        assert rel_err(out, same) <= TOL[dtype]
        # in bf16 the logits and the gradient matmuls are rounded too, outside the op: 2 roundings
        assert rel_err(out, ref) <= TOL[dtype] * (2 if dtype == torch.bfloat16 else 1)


def test_linear_path_frozen_head_strided_hidden_and_chunks(backend, monkeypatch):
    hidden, weight, targets = hidden_weight(22, 16, 700, torch.float32, seed=2)
    hidden = hidden.view(11, 32)[:, ::2].requires_grad_(True)  # a non-contiguous view, [11, 16]
    targets = targets[:11]
    chunk_rows = []
    chunk_fwd = ops._chunk_fwd
    monkeypatch.setattr(ops, "_chunk_fwd", lambda logits, *a: chunk_rows.append(len(logits)) or chunk_fwd(logits, *a))
    logp, entropy = backend.linear_logprobs_entropy(hidden, weight, targets, chunk_size=4)
    (logp + entropy).sum().backward()
    assert weight.grad is None and hidden.grad.shape == hidden.shape
    if backend is kernels:
        assert chunk_rows == [4, 4, 3]  # never more than chunk_size rows of logits at once
    hidden64 = hidden.detach().double().requires_grad_(True)
    sum(f64_logprobs_entropy(hidden64 @ weight.double().T, targets, 1.0)).sum().backward()
    assert rel_err(hidden.grad, hidden64.grad) <= 1e-5


def test_linear_path_with_no_rows(backend):
    # a micro-batch may hold no loss token: zero gradients of the right shapes, not an error
    hidden, weight, targets = hidden_weight(3, 16, 50, torch.float32, seed=6)
    hidden, targets = hidden[:0].detach().requires_grad_(True), targets[:0]
    weight.requires_grad_(True)
    logp, entropy = backend.linear_logprobs_entropy(hidden, weight, targets, chunk_size=4)
    (logp.sum() + entropy.sum()).backward()
    assert logp.shape == (0,) and hidden.grad.shape == (0, 16)
    assert weight.grad.shape == weight.shape and not weight.grad.any()


def test_linear_path_under_autocast(backend):
    # fp32 master weights, the matmul in bf16 as autocast would run it; gradients come back fp32
    hidden, weight, targets = hidden_weight(9, 32, 1000, torch.float32, seed=3)
    hidden.requires_grad_(True), weight.requires_grad_(True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        logp, entropy = backend.linear_logprobs_entropy(hidden, weight, targets, chunk_size=4)
    (logp - entropy).sum().backward()
    assert logp.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.float32
    hidden64, weight64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    logp64, entropy64 = f64_logprobs_entropy(hidden64 @ weight64.T, targets, 1.0)
    (logp64 - entropy64).sum().backward()
    for out, ref in [(logp, logp64), (entropy, entropy64), (hidden.grad, hidden64.grad), (weight.grad, weight64.grad)]:
        assert rel_err(out, ref) <= 3e-2  # bf16 logits


# The CPU runs of every training step take ops._chunk_fwd / _chunk_bwd (the kernel's math in PyTorch,
# in place), not Triton and not the reference: these pin that path on CPU tensors, FORCE_TRITON unset.

def chunked_cpu_run(monkeypatch, hidden, weight, targets, temperature, grad_logp, grad_entropy, chunk_size):
    """linear_logprobs_entropy through the PyTorch chunk path; returns (logp, entropy, d hidden, d weight)
    and the rows of each chunk forward and backward."""
    monkeypatch.delenv("FORCE_TRITON", raising=False)
    assert not ops.use_triton(hidden)
    rows = {"fwd": [], "bwd": []}
    chunk_fwd, chunk_bwd = ops._chunk_fwd, ops._chunk_bwd
    monkeypatch.setattr(ops, "_chunk_fwd", lambda logits, *a: rows["fwd"].append(len(logits)) or chunk_fwd(logits, *a))
    monkeypatch.setattr(ops, "_chunk_bwd", lambda logits, *a: rows["bwd"].append(len(logits)) or chunk_bwd(logits, *a))
    hidden, weight = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
    logp, entropy = kernels.linear_logprobs_entropy(hidden, weight, targets, temperature, chunk_size=chunk_size)
    grads = torch.autograd.grad((logp * grad_logp + entropy * grad_entropy).sum(), (hidden, weight))
    return (logp, entropy, *grads), rows


def f64_linear_run(hidden, weight, targets, temperature, grad_logp, grad_entropy):
    """The same outputs and gradients in float64 autograd, from all the logits at once."""
    hidden64, weight64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    logp, entropy = f64_logprobs_entropy(hidden64 @ weight64.T, targets, temperature)
    grads = torch.autograd.grad((logp * grad_logp + entropy * grad_entropy).sum(), (hidden64, weight64))
    return logp, entropy, *grads


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
@pytest.mark.parametrize("row_block", [2, 32])  # 2: a chunk's elementwise math in blocks, a short last one
@pytest.mark.parametrize("vocab_block", [300, 2048])  # 300: the logits in vocabulary blocks, a short last one
def test_chunked_cpu_path_matches_float64(monkeypatch, temperature, row_block, vocab_block):
    monkeypatch.setattr(ops, "ROW_BLOCK", row_block)
    monkeypatch.setattr(ops, "VOCAB_BLOCK", vocab_block)
    hidden, weight, targets = hidden_weight(13, 32, 1000, torch.float32, seed=4, device="cpu")
    hidden[0] *= 30  # one row of logits ~ +-300: the max shift must keep it exact
    grad_logp, grad_entropy = torch.randn(2, 13)
    ours, rows = chunked_cpu_run(monkeypatch, hidden, weight, targets, temperature, grad_logp, grad_entropy, 5)
    assert rows == {"fwd": [5, 5, 3], "bwd": [5, 5, 3]}  # several chunks, a short last one
    exact = f64_linear_run(hidden, weight, targets, temperature, grad_logp, grad_entropy)
    for name, out, ref in zip(["logp", "entropy", "d hidden", "d weight"], ours, exact):
        assert out.dtype == torch.float32
        assert rel_err(out, ref) <= 1e-5, name


def test_lm_head_logits_vocabulary_blocks_match_float64(monkeypatch):
    """The CPU path writes each block of columns in place; every column must be written, once, by its own rows."""
    monkeypatch.setattr(ops, "VOCAB_BLOCK", 300)
    hidden, weight, _ = hidden_weight(9, 32, 1000, torch.float32, seed=6, device="cpu")
    ours = kernels.lm_head_logits(hidden, weight)
    assert ours.shape == (9, 1000) and ours.dtype == torch.float32
    assert rel_err(ours, hidden.double() @ weight.double().T) <= 1e-6
    assert kernels.lm_head_logits(hidden[:0], weight).shape == (0, 1000)


def test_chunked_cpu_path_under_bf16_autocast_within_rounding_bound(monkeypatch):
    """Under autocast the head's matmul runs in bf16. Against float64 on the same bf16-rounded inputs, each
    output must stay within a first-order bound built from bf16's unit roundoff u = 2^-8 (round to nearest,
    8 significant bits), whatever the CPU's bf16 GEMM (fp32 accumulation, one rounding of its output):
      logits   |dz_j| <= delta = u max_j |z_j| + d 2^-24 max_j sum_k |h_k w_jk|   per row (z = h W^T)
      logp     |d logp| <= 2 delta / T                     (logp_t = s_t - logsumexp(s), s = z / T)
      entropy  |dH| <= 2 H delta / T                       (dH = -sum_j p_j (log p_j + H) ds_j)
      d logits error per entry, B_j: from p, log p and H moving (first order, as above), plus u |dlogits_j|
               when the kernel's math rounds it to bf16
      d hidden <= (B @ |W|)(1 + u) + u |dlogits| @ |W|,   d weight <= (B^T @ |h|)(1 + u) + u |dlogits|^T @ |h|
               (the bf16 matmuls round their outputs once; d weight's per-chunk partial sums each once)
    Every bound gets a factor 1.5 for the second-order terms."""
    T, u, d = 0.7, 2.0 ** -8, 32
    hidden, weight, targets = hidden_weight(11, d, 1000, torch.float32, seed=5, device="cpu")
    grad_logp, grad_entropy = torch.randn(2, 11)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, rows = chunked_cpu_run(monkeypatch, hidden, weight, targets, T, grad_logp, grad_entropy, 4)
    assert rows["fwd"] == [4, 4, 3] and all(out.dtype == torch.float32 for out in ours)

    # float64 on the rounded inputs: what the bf16 matmul multiplies exactly
    h, w = hidden.bfloat16().double(), weight.bfloat16().double()
    exact = f64_linear_run(h, w, targets, T, grad_logp, grad_entropy)
    z = h @ w.T
    delta = u * z.abs().amax(-1) + d * 2.0 ** -24 * (h.abs() @ w.abs().T).amax(-1)  # [N]
    ds = (delta / T)[:, None]
    logp_all = torch.log_softmax(z / T, -1)
    p, H = logp_all.exp(), exact[1][:, None]
    g_l, g_h = grad_logp.double()[:, None], grad_entropy.double()[:, None]
    dlogits = (g_l * (torch.nn.functional.one_hot(targets, 1000) - p) - g_h * p * (logp_all + H)) / T
    B = 2 * ds * p * (g_l.abs() + g_h.abs() * ((logp_all + H).abs() + 1 + H)) / T
    B = B + u * (dlogits.abs() + B)
    bounds = [2 * ds[:, 0], 2 * H[:, 0] * ds[:, 0],
              (B @ w.abs()) * (1 + u) + u * dlogits.abs() @ w.abs(),
              (B.T @ h.abs()) * (1 + u) + u * dlogits.abs().T @ h.abs()]
    # the bounds have teeth: the same function at T = 0.8 instead of 0.7 breaks every one of them
    near = f64_linear_run(h, w, targets, 0.8, grad_logp, grad_entropy)
    for name, out, ref, other, bound in zip(["logp", "entropy", "d hidden", "d weight"], ours, exact, near, bounds):
        err = (out.double() - ref).abs()
        assert (err <= 1.5 * bound + 1e-6).all(), (name, (err / bound).max().item())
        assert not ((other - ref).abs() <= 1.5 * bound + 1e-6).all(), name


# --- policy loss -----------------------------------------------------------------------------------

EPS_LOW, EPS_HIGH = 0.2, 0.28


def f64_policy_loss(logp, old_logp, adv, eps_low=EPS_LOW, eps_high=EPS_HIGH, weights=None, ref_logp=None,
                    kl_coef=0.0, entropy=None, entropy_coef=0.0, seq_ids=None, sampler_logp=None, tis_cap=None):
    """The float64 loss, its derivatives in logp and in entropy, and the clip indicators, written out region
    by region (derivatives by hand, not by autograd)."""
    logp, old_logp, adv = (t.detach().double() for t in (logp, old_logp, adv))
    log_ratio = logp - old_logp
    if seq_ids is not None:  # GSPO: each token takes its sequence's mean log-ratio (a loop here, unlike the ops)
        log_ratio = log_ratio.clone()
        for i in seq_ids.unique():
            log_ratio[seq_ids == i] = (logp - old_logp)[seq_ids == i].mean()
    ratio = log_ratio.exp()
    low = (ratio < 1 - eps_low) & (adv < 0)
    high = (ratio > 1 + eps_high) & (adv > 0)
    loss = torch.where(low, -(1 - eps_low) * adv, torch.where(high, -(1 + eps_high) * adv, -ratio * adv))
    grad = torch.where(low | high, 0.0, -ratio * adv)
    factor = torch.ones_like(logp)
    if weights is not None:
        factor = factor * weights.detach().double()
    if sampler_logp is not None:
        tis = (old_logp - sampler_logp.detach().double()).exp()
        factor = factor * (tis if tis_cap is None else torch.minimum(tis, torch.tensor(tis_cap).double()))
    loss, grad = loss * factor, grad * factor
    if ref_logp is not None:
        x = ref_logp.detach().double() - logp
        inside = x.abs() <= 10  # beyond, the clamped k3 is constant in logp
        x = x.clamp(-10, 10)
        loss = loss + kl_coef * (x.exp() - x - 1)
        grad = grad + torch.where(inside, kl_coef * (1 - x.exp()), 0.0)
    grad_entropy = None
    if entropy is not None:
        loss = loss - entropy_coef * entropy.detach().double()
        grad_entropy = torch.full_like(loss, -entropy_coef)
    return loss, grad, grad_entropy, low, high


def policy_inputs(n=12, seed=0):
    """Every region: ratios 0.5 (below 1 - eps_low), 1.05 (inside), 1.5 and 5.0 (above 1 + eps_high),
    each with A < 0 and A > 0; then random tokens up to n."""
    g = torch.Generator().manual_seed(seed)
    ratio = torch.tensor([0.5, 1.05, 1.5, 5.0] * 2 + (torch.rand(n - 8, generator=g) * 2 + 0.2).tolist())
    adv = torch.tensor([-1.3] * 4 + [0.7] * 4 + torch.randn(n - 8, generator=g).tolist())
    old_logp = -torch.rand(n, generator=g) * 3
    return [t.to(DEVICE) for t in (old_logp + ratio.log(), old_logp, adv)]


def option_inputs(names, logp, old_logp, seed=1):
    """policy_loss keywords for the named options, with random inputs (no zeros). Float inputs require grad,
    so that the test can check which of them get one."""
    g = torch.Generator().manual_seed(seed)
    n = len(logp)

    def rand(scale=1.0, shift=0.0):
        return (torch.rand(n, generator=g) * scale + shift).to(DEVICE)

    def randn():
        return torch.randn(n, generator=g).to(DEVICE)

    options = {}
    for name in names:
        if name == "weights":
            options["weights"] = rand(1.0, 0.5).requires_grad_(True)
        elif name == "kl":
            options.update(ref_logp=(logp + randn() * 0.3).requires_grad_(True), kl_coef=0.1)
        elif name == "entropy":
            options.update(entropy=rand(3.0, 0.1).requires_grad_(True), entropy_coef=0.3)
        elif name == "seq":  # ids not dense, tokens of a sequence scattered
            options["seq_ids"] = torch.randint(0, max(n // 5, 3), (n,), generator=g).to(DEVICE) * 2 + 1
        elif name in ("tis", "tis_uncapped"):
            options["sampler_logp"] = (old_logp + randn() * 0.5).requires_grad_(True)
            options["tis_cap"] = 1.5 if name == "tis" else None
        elif name == "no_clip":
            options.update(eps_low=1.0, eps_high=float("inf"))
    return options


@pytest.mark.parametrize("names", [(), ("weights",), ("kl",), ("weights", "kl"), ("entropy",), ("seq",), ("tis",),
                                   ("tis_uncapped",), ("no_clip",), ("weights", "kl", "entropy", "seq", "tis")])
@pytest.mark.parametrize("n", [12, 3000])  # 3000 crosses kernel blocks
def test_policy_loss_matches_float64(backend, names, n):
    logp, old_logp, adv = policy_inputs(n)
    options = option_inputs(names, logp, old_logp)
    eps = options.pop("eps_low", EPS_LOW), options.pop("eps_high", EPS_HIGH)
    logp, old_logp, adv = logp.requires_grad_(True), old_logp.requires_grad_(True), adv.requires_grad_(True)
    loss, clipped_low, clipped_high = backend.policy_loss(logp, old_logp, adv, *eps, **options)
    upstream = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    (loss * upstream).sum().backward()

    loss64, grad64, grad_entropy64, low64, high64 = f64_policy_loss(logp, old_logp, adv, *eps, **options)
    assert loss.dtype == torch.float32 and loss.isfinite().all() and rel_err(loss, loss64) <= 1e-5
    assert rel_err(logp.grad, grad64 * upstream) <= 1e-5
    assert torch.equal(clipped_low.bool(), low64) and torch.equal(clipped_high.bool(), high64)
    if "entropy" in names:
        assert rel_err(options["entropy"].grad, grad_entropy64 * upstream) <= 1e-6
    if not {"seq", "no_clip"} & set(names):
        assert clipped_low[:8].tolist() == [True, False, False, False] + [False] * 4
        assert clipped_high[:8].tolist() == [False] * 4 + [False, False, True, True]
    if "no_clip" in names:
        assert not (clipped_low.any() or clipped_high.any())
    constants = [old_logp, adv] + [options[k] for k in ("weights", "ref_logp", "sampler_logp") if k in options]
    assert all(t.grad is None for t in constants)


def test_policy_loss_neutral_options_reproduce_the_plain_surrogate(backend):
    """Every option at its neutral value (or absent) gives the plain clipped surrogate, bit for bit as the
    pre-option reference computed it."""
    logp, old_logp, adv = policy_inputs(300)
    entropy = torch.rand(300, device=DEVICE).requires_grad_(True)
    neutral = dict(weights=torch.ones(300, device=DEVICE), ref_logp=logp + 1.0, kl_coef=0.0, entropy=entropy,
                   entropy_coef=0.0, seq_ids=None, sampler_logp=old_logp.clone(), tis_cap=None)
    outs = []
    for options in ({}, neutral):
        x = logp.clone().requires_grad_(True)
        loss, low, high = backend.policy_loss(x, old_logp, adv, EPS_LOW, EPS_HIGH, **options)
        outs.append((loss, torch.autograd.grad(loss.sum(), x)[0], low, high))
    x = logp.clone().requires_grad_(True)
    ratio = torch.exp(x - old_logp)  # the surrogate as the reference wrote it before the options
    plain = -torch.minimum(ratio * adv, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * adv)
    plain_outs = (plain, torch.autograd.grad(plain.sum(), x)[0],
                  (ratio < 1 - EPS_LOW) & (adv < 0), (ratio > 1 + EPS_HIGH) & (adv > 0))
    for default, with_neutral, before in zip(outs[0], outs[1], plain_outs):
        assert torch.equal(default, with_neutral)
        if backend is reference:
            assert torch.equal(default, before)
        else:  # Triton's exp may differ from torch's in the last bit
            torch.testing.assert_close(default, before.detach(), rtol=1e-6, atol=0)


def test_policy_loss_sequence_ratio(backend):
    lengths = torch.tensor([3, 1, 5, 2, 1])
    perm = torch.randperm(12)  # a sequence's tokens need not be contiguous
    seq_ids = torch.arange(5).repeat_interleave(lengths)[perm].to(DEVICE)
    old_logp = -torch.rand(12, device=DEVICE) * 3
    logp = old_logp + torch.randn(12, device=DEVICE) * 0.1  # small log-ratios: every sequence ratio inside the clip
    adv = torch.randn(12, device=DEVICE)
    loss, _, _ = backend.policy_loss(logp, old_logp, adv, EPS_LOW, EPS_HIGH, seq_ids=seq_ids)
    seq_ratio = torch.stack([(logp - old_logp)[seq_ids == seq_ids[t]].mean().exp() for t in range(12)])
    assert 0.8 < seq_ratio.min() and seq_ratio.max() < 1.28
    torch.testing.assert_close(loss, -adv * seq_ratio)
    # one token per sequence: the sequence ratio is the token ratio, value and gradient
    outs = []
    for ids in (torch.arange(12, device=DEVICE), None):
        x = logp.clone().requires_grad_(True)
        loss, _, _ = backend.policy_loss(x, old_logp, adv, EPS_LOW, EPS_HIGH, seq_ids=ids)
        outs.append((loss, torch.autograd.grad(loss.sum(), x)[0]))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=0)


def test_gspo_gradient_equals_the_sequence_objective(backend):
    """Per-token losses weighted 1 / |y_i| and summed have the value and the gradient (float64 autograd) of
    GSPO's sequence objective sum_i -min(s_i A_i, clip(s_i, 1 - eps, 1 + eps) A_i), clipped sequences included."""
    lengths = torch.tensor([4, 1, 6, 3, 2, 5])
    n = int(lengths.sum())
    perm = torch.randperm(n)
    seq_ids = torch.arange(6).repeat_interleave(lengths)[perm]
    seq_adv = torch.tensor([0.9, -1.1, 0.6, -0.4, 1.3, -0.8])
    seq_shift = torch.tensor([0.5, -0.6, 0.02, 0.1, -0.05, 0.4])  # s_i from ~0.55 to ~1.6: both clips, and inside
    old_logp = -torch.rand(n) * 3
    logp = old_logp + seq_shift[seq_ids] + torch.randn(n) * 0.05
    weight = 1.0 / lengths[seq_ids].double()

    x = logp.to(DEVICE).requires_grad_(True)
    loss, _, _ = backend.policy_loss(x, old_logp.to(DEVICE), seq_adv[seq_ids].to(DEVICE), EPS_LOW, EPS_HIGH,
                                     seq_ids=seq_ids.to(DEVICE))
    objective = (loss.double() * weight.to(DEVICE)).sum()
    (grad,) = torch.autograd.grad(objective, x)

    x64 = logp.double().requires_grad_(True)
    s = torch.stack([(x64 - old_logp.double())[seq_ids == i].mean().exp() for i in range(6)])
    assert (s < 1 - EPS_LOW).any() and (s > 1 + EPS_HIGH).any() and ((s > 0.8) & (s < 1.28)).any()
    seq_loss = -torch.minimum(s * seq_adv.double(), s.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * seq_adv.double())
    (grad64,) = torch.autograd.grad(seq_loss.sum(), x64)
    assert abs(objective.item() - seq_loss.sum().item()) <= 1e-5
    assert rel_err(grad.cpu(), grad64) <= 1e-5


def test_policy_loss_tis_weight_is_capped(backend):
    logp, old_logp, adv = policy_inputs(12)
    weight = torch.tensor([5.0, 0.5, 1.2, 3.0] * 3, device=DEVICE)  # pi_old / pi_sampler
    sampler_logp = old_logp - weight.log()
    outs = []
    for options in ({}, {"sampler_logp": sampler_logp, "tis_cap": 2.0}):
        x = logp.clone().requires_grad_(True)
        loss, _, _ = backend.policy_loss(x, old_logp, adv, EPS_LOW, EPS_HIGH, **options)
        outs.append((loss, torch.autograd.grad(loss.sum(), x)[0]))
    capped = weight.clamp(max=2.0)  # [2, 0.5, 1.2, 2] ...
    for plain, weighted in zip(*outs):
        torch.testing.assert_close(weighted, plain * capped)


def test_policy_loss_kl_is_finite_far_from_the_reference(backend):
    logp, old_logp, adv = policy_inputs(12)
    far = torch.tensor([100.0, -100.0] * 6, device=DEVICE)
    outs = []
    for options in ({}, {"ref_logp": logp + far, "kl_coef": 0.1}):
        x = logp.clone().requires_grad_(True)
        loss, _, _ = backend.policy_loss(x, old_logp, adv, EPS_LOW, EPS_HIGH, **options)
        outs.append((loss, torch.autograd.grad(loss.sum(), x)[0]))
    (plain, plain_grad), (loss, grad) = outs
    assert loss.isfinite().all() and grad.isfinite().all()
    x = far.clamp(-10, 10)  # the log-ratio ref - logp, clamped
    torch.testing.assert_close(loss, plain + 0.1 * (x.exp() - x - 1))
    torch.testing.assert_close(grad, plain_grad)  # beyond the clamp the KL term is flat


def test_policy_loss_entropy_bonus_gradient_reaches_the_hidden_states(backend):
    """logp and entropy from the fused LM-head op, the bonus in the loss: d hidden equals float64 autograd
    through logits of  sum loss = sum surrogate(logp) - coef * entropy."""
    hidden, weight, targets = hidden_weight(9, 32, 1000, torch.float32, seed=6)
    hidden.requires_grad_(True)
    logp, entropy = backend.linear_logprobs_entropy(hidden, weight, targets, chunk_size=4)
    old_logp = logp.detach() + torch.randn(9, device=DEVICE) * 0.2
    adv = torch.randn(9, device=DEVICE)
    loss, _, _ = backend.policy_loss(logp, old_logp, adv, EPS_LOW, EPS_HIGH, entropy=entropy, entropy_coef=0.5)
    (grad,) = torch.autograd.grad(loss.sum(), hidden, retain_graph=True)

    hidden64 = hidden.detach().double().requires_grad_(True)
    logp64, entropy64 = f64_logprobs_entropy(hidden64 @ weight.double().T, targets, 1.0)
    _, dloss_dlogp, dloss_dentropy, _, _ = f64_policy_loss(logp64, old_logp, adv, entropy=entropy64, entropy_coef=0.5)
    (grad64,) = torch.autograd.grad((logp64 * dloss_dlogp + entropy64 * dloss_dentropy).sum(), hidden64)
    assert rel_err(grad, grad64) <= 1e-5
    (grad_without,) = torch.autograd.grad(backend.policy_loss(logp, old_logp, adv, EPS_LOW, EPS_HIGH)[0].sum(), hidden)
    assert rel_err(grad, grad_without) > 1e-2  # the bonus does change the gradient


def test_policy_loss_kl_to_itself_is_zero(backend):
    logp, old_logp, adv = policy_inputs(40)
    logp.requires_grad_(True)
    loss, _, _ = backend.policy_loss(logp, old_logp, adv, EPS_LOW, EPS_HIGH)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    loss_kl, _, _ = backend.policy_loss(logp, old_logp, adv, EPS_LOW, EPS_HIGH, ref_logp=logp.detach(), kl_coef=0.5)
    (grad_kl,) = torch.autograd.grad(loss_kl.sum(), logp)
    assert torch.equal(loss, loss_kl) and torch.equal(grad, grad_kl)


def test_outputs_are_separate_tensors_a_caller_may_modify_in_place(backend):
    """Each op's outputs are tensors of their own, not views into one buffer: a caller (or autograd) may modify one
    in place, and the others stay as they were (an output that is a view of a custom Function's buffer refuses an
    in-place change under autograd)."""
    logits, targets = random_logits(6, 300, torch.float32, seed=3)
    hidden, weight, ids = hidden_weight(6, 16, 300, torch.float32, seed=3)
    logp, old_logp, adv = policy_inputs(12)
    calls = [lambda: backend.logprobs_entropy(logits.requires_grad_(True), targets),
             lambda: backend.linear_logprobs_entropy(hidden.requires_grad_(True), weight, ids),
             lambda: backend.policy_loss(logp.requires_grad_(True), old_logp, adv, EPS_LOW, EPS_HIGH)]
    for call in calls:
        outs = call()
        before = [o.detach().clone() for o in outs]
        for k, out in enumerate(outs):
            out.add_(1) if out.dtype.is_floating_point else out.logical_not_()
            assert all(torch.equal(o.detach(), b) for j, (o, b) in enumerate(zip(outs, before)) if j != k)
            assert not torch.equal(out.detach(), before[k])
            before[k] = out.detach().clone()


def test_policy_loss_rejects_unbroadcast_advantages():
    logp = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="advantages has shape \\[2\\]"):
        kernels.policy_loss(logp, logp, torch.ones(2))


@pytest.mark.parametrize("options, message", [
    ({"seq_ids": torch.zeros(2, 5)}, "seq_ids must be a long tensor"),
    ({"seq_ids": torch.zeros(10, dtype=torch.long)}, "seq_ids has shape \\[10\\]"),
    ({"entropy": torch.ones(2, 5, dtype=torch.long), "entropy_coef": 0.1}, "entropy must be a float tensor"),
    ({"sampler_logp": torch.zeros(5)}, "sampler_logp has shape"),
    ({"entropy_coef": 0.1}, "entropy_coef=0.1 needs entropy"),
    ({"tis_cap": 2.0}, "tis_cap=2.0 needs sampler_logp"),
    ({"kl_coef": 0.1}, "kl_coef=0.1 needs ref_logp"),
    ({"eps_low": 1.5}, "0 <= eps_low <= 1"),
    ({"sampler_logp": torch.zeros(2, 5), "tis_cap": 0.0}, "tis_cap must be > 0"),
])
def test_policy_loss_rejects_bad_options(options, message):
    logp = torch.zeros(2, 5)
    with pytest.raises(ValueError, match=message) as error:
        kernels.policy_loss(logp, logp, torch.ones(2, 5), **options)
    assert "\n" not in str(error.value)


# --- Triton itself ---------------------------------------------------------------------------------

def test_import_without_triton_falls_back_to_references():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, kernels\n"
            "logp, entropy = kernels.logprobs_entropy(torch.randn(3, 7), torch.tensor([0, 1, 6]))\n"
            "assert kernels.ops.triton_module() is None and logp.shape == (3,)\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_kernels as tk
fp32 = "*fp32"
rows = {"row_stride": "i64", "V": "i32", "inv_t": "fp32", "BLOCK_V": "constexpr"}
fwd = {"logits_ptr": "*bf16", "targets_ptr": "*i64",
       **dict.fromkeys(["logp_ptr", "entropy_ptr", "xmax_ptr", "logz_ptr"], fp32), **rows}
bwd = {"logits_ptr": "*bf16", "dlogits_ptr": "*bf16", "targets_ptr": "*i64",
       **dict.fromkeys(["grad_logp_ptr", "grad_entropy_ptr", "xmax_ptr", "logz_ptr", "entropy_ptr"], fp32),
       "drow_stride": "i64", **rows}
loss = {**dict.fromkeys(["logp_ptr", "old_logp_ptr", "adv_ptr", "weights_ptr", "ref_logp_ptr", "entropy_ptr"], fp32),
        "seq_log_ratio_ptr": fp32, "sampler_logp_ptr": fp32, "loss_ptr": fp32, "dloss_ptr": fp32,
        "clipped_low_ptr": "*i8", "clipped_high_ptr": "*i8", "n": "i32",
        **dict.fromkeys(["ratio_low", "ratio_high", "kl_coef", "entropy_coef", "tis_cap", "kl_max"], "fp32"),
        **dict.fromkeys(["HAS_WEIGHTS", "HAS_REF", "HAS_ENTROPY", "HAS_SEQ", "HAS_TIS", "BLOCK"], "constexpr")}
jobs = [(tk._logprobs_entropy_fwd, fwd, {"BLOCK_V": 8192}), (tk._logprobs_entropy_bwd, bwd, {"BLOCK_V": 8192}),
        (tk._policy_loss_fwd, loss, {**dict.fromkeys(["HAS_WEIGHTS", "HAS_REF", "HAS_ENTROPY", "HAS_SEQ", "HAS_TIS"],
                                                     True), "BLOCK": 1024})]
for kernel, signature, constexprs in jobs:
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16})
    assert compiled.asm["ptx"], kernel
"""


@pytest.mark.skipif(ops.triton_module() is None, reason="triton is not installed")
def test_kernels_compile_for_a_gpu():
    """The interpreter accepts some code that the compiler rejects: compile every kernel for sm_90
    (no GPU needed, only triton's bundled toolchain), outside the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], cwd=ROOT, env=env, check=True)
