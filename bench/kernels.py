"""Memory and time of the fused kernels against plain PyTorch.

    python bench/kernels.py                      # CPU: LM-head log-probs + entropy, fwd + bwd, peak RSS
    python bench/kernels.py --variant naive      # one CPU variant alone (what the line above runs 3 times)
    python bench/kernels.py --gpu                # GPU tables (needs CUDA): kernel time, bandwidth, memory
    python bench/kernels.py --lm-head-blocks     # CPU: the LM head's logits in vocabulary blocks vs one matmul

CPU: N = 4096 tokens, d = 576, V = 49,152 (SmolLM2's head), fp32. Each variant runs in its own
process and reports its peak RSS (getrusage); a baseline process that only allocates the inputs is
subtracted, so the numbers are the extra memory of forward + backward. Every process takes the runs' MKL branch and
malloc settings (common/memory.py: MKL_CBWR=AUTO on CPUs not made by Intel; `MKL_CBWR=` in front keeps MKL's default).
GPU: N = 8192, V = 151,936 (Qwen), bf16: ours vs eager vs torch.compile, time (do_bench median),
peak memory, bandwidth as a fraction of a device-to-device copy; the LM-head path too (d = 896).
Numbers and commands are kept in docs/kernels.md.
"""
import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.config import OneLineParser  # noqa: E402  (a user mistake: one line, exit 2)

# MKL's branch and malloc's settings as the runs take them, set before MKL's first call (and in each variant's process)
importlib.import_module("common.memory")
import kernels  # noqa: E402
from kernels import reference  # noqa: E402

MB = 2 ** 20


def lm_head_inputs(n, d, vocab, dtype, device, seed=0):
    g = torch.Generator(device).manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, device=device, dtype=dtype).requires_grad_(True)
    weight = (torch.randn(vocab, d, generator=g, device=device, dtype=dtype) / d ** 0.5).requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=g, device=device)
    return hidden, weight, targets


def naive_lm_head(hidden, weight, targets):
    """The way it is usually written: all the logits, log_softmax, gather, entropy."""
    return reference.logprobs_entropy(hidden @ weight.T, targets)


def fwd_bwd(fn, hidden, weight, targets):
    logp, entropy = fn(hidden, weight, targets)
    (logp.sum() + 0.1 * entropy.sum()).backward()


# --- CPU: one process per variant ------------------------------------------------------------------

def run_variant(variant, n, d, vocab, repeat, chunk_size=None):
    """Allocate the inputs, run the variant (baseline: nothing), print peak RSS and time as JSON."""
    torch.manual_seed(0)
    hidden, weight, targets = lm_head_inputs(n, d, vocab, torch.float32, "cpu")
    ours = lambda h, w, t: kernels.linear_logprobs_entropy(h, w, t, chunk_size=chunk_size)  # noqa: E731
    fn = {"naive": naive_lm_head, "ours": ours}.get(variant)
    seconds = []
    for _ in range(repeat if fn else 0):
        hidden.grad = weight.grad = None
        start = time.perf_counter()
        fwd_bwd(fn, hidden, weight, targets)
        seconds.append(time.perf_counter() - start)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"variant": variant, "peak_mb": peak_kb / 1024, "seconds": min(seconds, default=0.0)}))


def cpu_table(n, d, vocab, repeat):
    results = {}
    for variant in ["baseline", "naive", "ours"]:
        cmd = [sys.executable, __file__, "--variant", variant, "-n", str(n), "-d", str(d), "-V", str(vocab),
               "--repeat", str(repeat)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    base = results["baseline"]["peak_mb"]
    print(f"CPU, N={n} d={d} V={vocab} fp32, forward + backward, {torch.get_num_threads()} threads")
    print(f"{'variant':<10}{'peak RSS MB':>14}{'extra MB':>12}{'seconds':>10}")
    for variant, r in results.items():
        print(f"{variant:<10}{r['peak_mb']:>14.0f}{r['peak_mb'] - base:>12.0f}{r['seconds']:>10.2f}")
    naive, ours = (results[v] for v in ("naive", "ours"))
    print(f"extra memory ours / naive: {(ours['peak_mb'] - base) / (naive['peak_mb'] - base):.3f}   "
          f"time ours / naive: {ours['seconds'] / naive['seconds']:.2f}")
    chunk = max(1, kernels.ops.CPU_CHUNK_ELEMENTS // vocab)  # the chunk linear_logprobs_entropy takes on a CPU
    print(f"where ours' extra goes: weight.grad {vocab * d * 4 / MB:.0f} MB (the fp32 accumulator itself), "
          f"hidden.grad {n * d * 4 / MB:.0f} MB, two to three [chunk={chunk}, V] fp32 temporaries of "
          f"{chunk * vocab * 4 / MB:.0f} MB (logits, exp, mask), BLAS and allocator slack; "
          f"all the logits would be {n * vocab * 4 / MB:.0f} MB")


# --- GPU ---------------------------------------------------------------------------------------------

def cuda_time_and_peak(fn, grad_to_none=()):
    """(median ms by triton's do_bench, peak extra MB of one call)."""
    from triton.testing import do_bench
    ms = do_bench(fn, grad_to_none=list(grad_to_none), return_mode="median")
    torch.cuda.synchronize()
    for t in grad_to_none:
        t.grad = None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return ms, (torch.cuda.max_memory_allocated() - before) / MB


def copy_bandwidth():
    """Bytes per second of a large device-to-device copy (read + write): the roof for a memory-bound op."""
    from triton.testing import do_bench
    src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms / 1e3)


def gpu_tables(n=8192, vocab=151_936, d=896, device="cuda"):
    dtype = torch.bfloat16
    g = torch.Generator(device).manual_seed(0)
    logits = (torch.randn(n, vocab, generator=g, device=device) * 2).to(dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=g, device=device)
    grad_logp, grad_entropy = torch.randn(2, n, device=device)
    roof = copy_bandwidth()
    ops = {"ours": kernels.logprobs_entropy, "eager": reference.logprobs_entropy,
           "torch.compile": torch.compile(reference.logprobs_entropy)}
    # forward reads the logits once; backward reads them again and writes d logits
    logits_bytes = logits.numel() * logits.element_size()
    print(f"GPU {torch.cuda.get_device_name()}: logits [{n}, {vocab}] bf16 ({logits_bytes / MB:.0f} MB); "
          f"copy bandwidth {roof / 1e9:.0f} GB/s")
    print(f"{'op':<15}{'pass':<10}{'ms':>9}{'peak MB':>10}{'GB/s':>8}{'of copy':>9}")
    for name, op in ops.items():
        def forward():
            with torch.no_grad():
                op(logits, targets)

        def forward_backward():
            logp, entropy = op(logits, targets)
            torch.autograd.backward([logp, entropy], [grad_logp, grad_entropy])
        for label, fn, traffic in [("fwd", forward, logits_bytes), ("fwd+bwd", forward_backward, 3 * logits_bytes)]:
            ms, peak = cuda_time_and_peak(fn, [logits])
            gbs = traffic / (ms / 1e3)
            print(f"{name:<15}{label:<10}{ms:>9.2f}{peak:>10.0f}{gbs / 1e9:>8.0f}{gbs / roof:>9.2f}")
    logits = None  # its memory freed before the LM-head inputs are allocated

    hidden, weight, targets = lm_head_inputs(n, d, vocab, dtype, device)
    variants = {"ours (chunked)": kernels.linear_logprobs_entropy, "eager": naive_lm_head,
                "matmul + ours": lambda h, w, t: kernels.logprobs_entropy(h @ w.T, t)}
    print(f"\nLM head: hidden [{n}, {d}] @ weight [{vocab}, {d}].T, bf16, forward + backward")
    print(f"{'variant':<16}{'ms':>9}{'peak MB':>10}")
    for name, fn in variants.items():
        ms, peak = cuda_time_and_peak(lambda: fwd_bwd(fn, hidden, weight, targets), [hidden, weight])
        print(f"{name:<16}{ms:>9.2f}{peak:>10.0f}")


def lm_head_blocks_table(d, vocab, repeat=5):
    """kernels.lm_head_logits (vocabulary blocks) against one matmul, fp32 CPU, at decode (16-150 rows) and
    training-chunk (340 rows) shapes; the two alternate, the fastest of `repeat` timings (4 calls each) is reported."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, d, generator=g) / d ** 0.5
    print(f"CPU, hidden [rows, {d}] @ weight [{vocab}, {d}].T, fp32, {torch.get_num_threads()} threads, "
          f"blocks of {kernels.ops.VOCAB_BLOCK} columns")
    print(f"{'rows':>6}{'one matmul ms':>15}{'blocks ms':>11}{'ratio':>8}")
    for rows in (16, 64, 128, 150, 340):
        hidden = torch.randn(rows, d, generator=g)
        best = {"one": float("inf"), "blocks": float("inf")}
        for _ in range(repeat):
            for name, fn in (("one", lambda: hidden @ weight.T), ("blocks", lambda: kernels.lm_head_logits(hidden, weight))):
                fn()
                t0 = time.perf_counter()
                for _ in range(4):
                    fn()
                best[name] = min(best[name], (time.perf_counter() - t0) / 4)
        print(f"{rows:>6}{best['one'] * 1e3:>15.1f}{best['blocks'] * 1e3:>11.1f}{best['one'] / best['blocks']:>8.2f}")


def main():
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=["baseline", "naive", "ours"], help="run one CPU variant and exit")
    parser.add_argument("--gpu", action="store_true", help="the GPU tables instead of the CPU one")
    parser.add_argument("--lm-head-blocks", action="store_true", help="only the CPU table of kernels.lm_head_logits")
    parser.add_argument("-n", type=int, default=4096, help="tokens")
    parser.add_argument("-d", type=int, default=576, help="hidden size")
    parser.add_argument("-V", type=int, default=49_152, help="vocabulary size")
    parser.add_argument("--chunk-size", type=int,
                        help="rows per chunk of ours (default on a CPU: 2^24 // V, 341 rows for SmolLM2)")
    parser.add_argument("--repeat", type=int, default=2, help="CPU runs per variant; the fastest is reported")
    args = parser.parse_args()
    if min(args.n, args.d, args.V, args.repeat, args.chunk_size or 1) < 1:
        parser.error("expected -n, -d, -V, --repeat and --chunk-size >= 1")
    if args.lm_head_blocks:
        lm_head_blocks_table(args.d, args.V)
    elif args.variant:
        run_variant(args.variant, args.n, args.d, args.V, args.repeat, args.chunk_size)
    elif args.gpu:
        if not torch.cuda.is_available():
            parser.error("--gpu needs CUDA, and torch.cuda.is_available() is False")
        gpu_tables()
    else:
        cpu_table(args.n, args.d, args.V, args.repeat)
        if torch.cuda.is_available():
            print()
            gpu_tables()


if __name__ == "__main__":
    main()
