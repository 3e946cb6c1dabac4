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


if not CUDA and ops.triton_kernels is not None and not ops.triton_kernels.INTERPRETED:
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
    if ops.triton_kernels is None:
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

def hidden_weight(n, d, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(vocab, d, generator=g) / d ** 0.5 * 3).to(DEVICE, dtype)
    return hidden, weight, torch.randint(0, vocab, (n,), generator=g).to(DEVICE)


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


# --- policy loss -----------------------------------------------------------------------------------

EPS_LOW, EPS_HIGH = 0.2, 0.28


def f64_policy_loss(logp, old_logp, adv, weights=None, dual_clip=None, ref_logp=None, kl_coef=0.0):
    """The float64 loss and its gradient in logp, written out region by region."""
    logp, old_logp, adv = logp.double(), old_logp.double(), adv.double()
    ratio = torch.exp(logp - old_logp)
    clipped_low = (ratio < 1 - EPS_LOW) & (adv < 0)
    clipped_high = (ratio > 1 + EPS_HIGH) & (adv > 0)
    loss = torch.where(clipped_low, -(1 - EPS_LOW) * adv, torch.where(clipped_high, -(1 + EPS_HIGH) * adv, -ratio * adv))
    grad = torch.where(clipped_low | clipped_high, 0.0, -ratio * adv)
    if dual_clip is not None:
        capped = (adv < 0) & (loss > -dual_clip * adv)
        loss, grad = torch.where(capped, -dual_clip * adv, loss), torch.where(capped, 0.0, grad)
    if weights is not None:
        loss, grad = loss * weights.double(), grad * weights.double()
    if ref_logp is not None:
        log_ratio_ref = ref_logp.double() - logp
        loss = loss + kl_coef * (log_ratio_ref.exp() - log_ratio_ref - 1)
        grad = grad + kl_coef * (1 - log_ratio_ref.exp())
    return loss, grad, clipped_low, clipped_high


def policy_inputs(n=12, seed=0):
    """Every region: ratios 0.5 (below 1 - eps_low), 1.05 (inside), 1.5 (above 1 + eps_high) and
    5.0 (past a dual clip of 3), each with A < 0 and A > 0; then random tokens up to n."""
    g = torch.Generator().manual_seed(seed)
    ratio = torch.tensor([0.5, 1.05, 1.5, 5.0] * 2 + (torch.rand(n - 8, generator=g) * 2 + 0.2).tolist())
    adv = torch.tensor([-1.3] * 4 + [0.7] * 4 + torch.randn(n - 8, generator=g).tolist())
    old_logp = -torch.rand(n, generator=g) * 3
    return [t.to(DEVICE) for t in (old_logp + ratio.log(), old_logp, adv)]


@pytest.mark.parametrize("options", [{}, {"dual_clip": 3.0}, {"weights": True}, {"ref_logp": True, "kl_coef": 0.1},
                                     {"dual_clip": 3.0, "weights": True, "ref_logp": True, "kl_coef": 0.05}])
@pytest.mark.parametrize("n", [12, 3000])  # 3000 crosses kernel blocks
def test_policy_loss_matches_float64(backend, options, n):
    logp, old_logp, adv = policy_inputs(n)
    g = torch.Generator().manual_seed(1)
    options = dict(options)
    if options.get("weights"):
        options["weights"] = (torch.rand(n, generator=g) + 0.5).to(DEVICE).requires_grad_(True)
    if options.get("ref_logp"):
        options["ref_logp"] = (logp + torch.randn(n, generator=g).to(DEVICE) * 0.3).requires_grad_(True)
    logp, old_logp, adv = logp.requires_grad_(True), old_logp.requires_grad_(True), adv.requires_grad_(True)
    loss, clipped_low, clipped_high = backend.policy_loss(logp, old_logp, adv, EPS_LOW, EPS_HIGH, **options)
    upstream = torch.randn(n, generator=g).to(DEVICE)
    (loss * upstream).sum().backward()

    loss64, grad64, low64, high64 = f64_policy_loss(logp.detach(), old_logp, adv, **options)
    assert loss.dtype == torch.float32 and rel_err(loss, loss64) <= 1e-5
    assert rel_err(logp.grad, grad64 * upstream) <= 1e-5
    assert torch.equal(clipped_low.bool(), low64) and torch.equal(clipped_high.bool(), high64)
    assert clipped_low[:8].tolist() == [True, False, False, False] + [False] * 4
    assert clipped_high[:8].tolist() == [False] * 4 + [False, False, True, True]
    constants = [old_logp, adv] + [options[k] for k in ("weights", "ref_logp") if k in options]
    assert all(t.grad is None for t in constants)


def test_policy_loss_kl_to_itself_is_zero(backend):
    logp, old_logp, adv = policy_inputs(40)
    logp.requires_grad_(True)
    loss, _, _ = backend.policy_loss(logp, old_logp, adv, EPS_LOW, EPS_HIGH)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    loss_kl, _, _ = backend.policy_loss(logp, old_logp, adv, EPS_LOW, EPS_HIGH, ref_logp=logp.detach(), kl_coef=0.5)
    (grad_kl,) = torch.autograd.grad(loss_kl.sum(), logp)
    assert torch.equal(loss, loss_kl) and torch.equal(grad, grad_kl)


def test_policy_loss_rejects_unbroadcast_advantages():
    logp = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="advantages has shape \\[2\\]"):
        kernels.policy_loss(logp, logp, torch.ones(2))


# --- Triton itself ---------------------------------------------------------------------------------

def test_import_without_triton_falls_back_to_references():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, kernels\n"
            "logp, entropy = kernels.logprobs_entropy(torch.randn(3, 7), torch.tensor([0, 1, 6]))\n"
            "assert kernels.ops.triton_kernels is None and logp.shape == (3,)\n")
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
loss = {**dict.fromkeys(["logp_ptr", "old_logp_ptr", "adv_ptr", "weights_ptr", "ref_logp_ptr", "loss_ptr",
                         "dloss_ptr"], fp32),
        "clipped_low_ptr": "*i8", "clipped_high_ptr": "*i8", "n": "i32",
        **dict.fromkeys(["ratio_low", "ratio_high", "dual_clip", "kl_coef"], "fp32"),
        **dict.fromkeys(["HAS_WEIGHTS", "HAS_DUAL", "HAS_REF", "BLOCK"], "constexpr")}
jobs = [(tk._logprobs_entropy_fwd, fwd, {"BLOCK_V": 8192}), (tk._logprobs_entropy_bwd, bwd, {"BLOCK_V": 8192}),
        (tk._policy_loss_fwd, loss, {"HAS_WEIGHTS": True, "HAS_DUAL": True, "HAS_REF": True, "BLOCK": 1024})]
for kernel, signature, constexprs in jobs:
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16})
    assert compiled.asm["ptx"], kernel
"""


@pytest.mark.skipif(ops.triton_kernels is None, reason="triton is not installed")
def test_kernels_compile_for_a_gpu():
    """The interpreter accepts some code that the compiler rejects: compile every kernel for sm_90
    (no GPU needed, only triton's bundled toolchain), outside the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], cwd=ROOT, env=env, check=True)
