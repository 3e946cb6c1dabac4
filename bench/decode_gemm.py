"""What one decode step's matmuls cost on this CPU, by rows: a pass of fp32 products over SmolLM2-135M's weight shapes.

    python bench/decode_gemm.py                 # 8, 32, 64, 128 rows; plain, fused q/k/v and gate/up, no LM head

A decode step multiplies each row's hidden state by every weight matrix: 30 blocks of seven linears and the 49,152 x
576 LM head, 538 MB in fp32. At few rows that is a matrix-vector product whose floor is reading the weights from
memory; the table gives the time of one pass (best of --reps), the weight bytes read per second, the GFLOP/s, and the
machine's memory read rate (a sum over 512 MB) to hold them against. Random weights of the real shapes.

The last two columns time the same products in the other order, W @ x.T (the output [out, rows], read back
transposed): the same numbers, but MKL is then asked for a GEMM whose small side is its m, not its n, and the two
run at different speeds on some CPUs (MKL takes its generic kernels on non-Intel ones). The two orders are timed
in turn, rep after rep, so that a change in the machine's speed falls on both. MKL's kernels are those the runs
take: common/memory.py picks its branch on import (MKL_CBWR=AUTO on CPUs not made by Intel; `MKL_CBWR=` in front of
the command keeps MKL's default kernels, as bench/mkl_branch.py compares).
"""
import importlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.config import OneLineParser  # noqa: E402  (a user mistake: one line, exit 2)

importlib.import_module("common.memory")  # MKL's branch as the runs take it, set before MKL's first call

D, F, KV, V, LAYERS = 576, 1536, 192, 49152, 30  # SmolLM2-135M: hidden, MLP, k/v width (3 heads x 64), vocabulary


def weights(layout: str) -> list:
    """[(weight [out, in], input width)] of one decode step."""
    block = {"plain": [(D, D), (KV, D), (KV, D), (D, D), (F, D), (F, D), (D, F)],  # q k v o, gate up down
             "fused": [(D + 2 * KV, D), (D, D), (2 * F, D), (D, F)],  # qkv, o, gate+up, down
             "no LM head": [(D, D), (KV, D), (KV, D), (D, D), (F, D), (F, D), (D, F)]}[layout]
    ws = [torch.randn(o, i) for _ in range(LAYERS) for o, i in block]
    return ws if layout == "no LM head" else ws + [torch.randn(V, D)]


def best_of(fns: list, reps: int) -> list:
    """The best time of each of fns over reps, the fns run in turn at every rep."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [min(ts) for ts in times]


def main():
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="8,32,64,128")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        rows_list = []
    if not rows_list or min(rows_list) < 1 or args.reps < 1:
        p.error("expected --rows as positive integers, e.g. 8,32, and --reps >= 1")
    big = torch.randn(128 * 1024 * 1024)
    read = big.numel() * 4 / best_of([big.sum], args.reps)[0] / 1e9
    del big
    print(f"threads {torch.get_num_threads()}, memory read {read:.1f} GB/s (sum over 512 MB)\n")
    print("| weights | rows | ms per pass | weight GB/s | GFLOP/s | W @ x.T: ms per pass | W @ x.T / x @ W.T |\n"
          "|---|---|---|---|---|---|---|")
    for layout in ("plain", "fused", "no LM head"):
        ws = weights(layout)
        nbytes = sum(w.numel() * 4 for w in ws)
        for rows in rows_list:
            inputs = {D: torch.randn(rows, D), F: torch.randn(rows, F)}
            s, other = best_of([lambda: [inputs[w.shape[1]] @ w.T for w in ws],
                                lambda: [(w @ inputs[w.shape[1]].T).T.contiguous() for w in ws]], args.reps)
            print(f"| {layout} ({nbytes / 1e6:.0f} MB) | {rows} | {s * 1e3:.1f} | {nbytes / s / 1e9:.1f} | "
                  f"{2 * rows * nbytes / 4 / s / 1e9:.0f} | {other * 1e3:.1f} | {other / s:.2f} |", flush=True)


if __name__ == "__main__":
    main()
