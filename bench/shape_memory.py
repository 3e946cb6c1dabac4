"""Resident memory of a bf16 training loop on a CPU whose micro-batches change shape, as a run's do: what oneDNN's
and ideep's primitive caches hold (common/memory.py caps them at 64 each).

    python bench/shape_memory.py                           # SmolLM2-135M's shape, random weights, 6 steps, the caps
    LRU_CACHE_CAPACITY=1024 ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 python bench/shape_memory.py   # the libraries' own
    python bench/shape_memory.py --fixed                   # every micro-batch the same shape
    python bench/shape_memory.py --dtype float32           # fp32 matmuls (MKL, not oneDNN)

A step: 6 micro-batches of 8 sequences of 40-120 tokens (80 with --fixed), each a forward through the fused
LM-head log-probs under autocast and a backward, then an AdamW step. Prints this process's resident memory after
each step and its peak so far (VmRSS, VmHWM and its parts; GB of 10^9 bytes): with uncapped caches in bf16 the first
grows with every step; with fixed shapes or capped caches it stays flat.
"""
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from common.config import OneLineParser  # noqa: E402  (a user mistake: one line, exit 2)
from common.memory import release_free_memory  # noqa: E402  (sets the caps unless the environment has them)
from common.model import ModelConfig, Transformer  # noqa: E402
from phase_memory import memory  # noqa: E402  (this process's VmRSS, VmHWM, ... from /proc/self/status)

SMOLLM2_135M = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)


def main():
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--fixed", action="store_true", help="every micro-batch 8 x 80 tokens")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("expected --steps >= 1")
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_hf(SMOLLM2_135M))
    dtype = getattr(torch, args.dtype)
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    lengths = random.Random(0)
    t0 = time.time()
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        for _ in range(6):
            T = 80 if args.fixed else lengths.randint(40, 120)
            ids = torch.randint(model.cfg.vocab_size, (8, T))
            loss_positions = torch.zeros(8, T, dtype=torch.bool)
            loss_positions[:, T // 2:] = True
            release_free_memory()
            with autocast:
                logp, _ = model(ids, targets=ids.roll(-1, 1), target_mask=loss_positions)
            release_free_memory()
            (logp.sum() * 1e-3).backward()
        optimizer.step()
        release_free_memory()
        print(f"step {step}: {memory()}  ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
