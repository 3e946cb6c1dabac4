"""Eager decoding on CUDA with and without cuDNN's fused attention: ms per decode step, side by side.

    python bench/decode_attention.py              # a CUDA GPU: Qwen2.5-0.5B and SmolLM2-135M shapes, random bf16 weights
    python bench/decode_attention.py --cpu-tiny   # the same code at tiny shapes on a CPU (checks the script only)

common.sampler.SAMPLING_ATTENTION keeps cuDNN out of sampling on CUDA; None gives PyTorch's own choice. Each row
times generate() at 8 and at 40 new tokens (after a warm-up call) and divides the difference by 32, so prefill and
the first call's set-up drop out; "same tokens" counts the samples whose tokens both settings drew alike (bf16
attention kernels round differently, so a sample may part ways). Results of 2026-11-27 on an H100:
bench/results/h100-2026-11-27-decode.
"""
import importlib.util
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from common.config import OneLineParser  # noqa: E402  (a user mistake: one line, exit 2)
import common.sampler as sampler  # noqa: E402
from common.model import ModelConfig  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench" / "gpu.py")  # its shapes and random init
gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu)

SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=1e5,
               rms_norm_eps=1e-5, max_position_embeddings=8192)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
# (model, prompts, samples per prompt, prompt tokens): bench/gpu.py's batches, then the default run's 16 x 8
CASES = [("qwen2.5-0.5b", 256, 1, 256), ("qwen2.5-0.5b", 1, 1, 256), ("qwen2.5-0.5b", 64, 1, 256),
         ("smollm2-135m", 16, 8, 60), ("smollm2-135m", 128, 1, 60)]


def ms_per_step(model, prompts, n, dev, short=8, long=40):
    def timed(new):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        groups = sampler.generate(model, prompts, n=n, max_new_tokens=new, temperature=1.0, stop_ids=(), seed=0)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t, groups
    timed(4)  # warm-up
    t_short, _ = timed(short)
    t_long, groups = timed(long)
    return (t_long - t_short) / (long - short) * 1000, groups


def main(argv=None):
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-tiny", action="store_true", help="tiny shapes on the CPU")
    args = ap.parse_args(argv)
    if not args.cpu_tiny and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --cpu-tiny to check the script on a CPU)")
    dev = torch.device("cpu" if args.cpu_tiny else "cuda")
    smol = dict(SMOLLM2, **(TINY if args.cpu_tiny else {}))
    models = {"qwen2.5-0.5b": gpu.random_model(gpu.model_config("0.5b", args.cpu_tiny), dev, torch.bfloat16),
              "smollm2-135m": gpu.random_model(ModelConfig.from_hf(smol, "SMOLLM2"), dev, torch.bfloat16)}
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (tiny shapes)"
    print(f"{name}, torch {torch.__version__}\n")
    print("| model | prompts x n | prompt | cuDNN allowed ms/step | cuDNN excluded ms/step | ratio | same tokens |")
    print("|---|---|---|---|---|---|---|")
    ours = sampler.SAMPLING_ATTENTION
    for model, B, n, P in CASES:
        B, P = (min(B, 4), 8) if args.cpu_tiny else (B, P)
        prompts = torch.randint(0, models[model].cfg.vocab_size, (B, P), generator=torch.Generator().manual_seed(0))
        sampler.SAMPLING_ATTENTION = None
        t_cudnn, groups_cudnn = ms_per_step(models[model], prompts.tolist(), n, dev)
        sampler.SAMPLING_ATTENTION = ours
        t_ours, groups_ours = ms_per_step(models[model], prompts.tolist(), n, dev)
        same = sum(list(a.tokens) == list(b.tokens) for ga, gb in zip(groups_cudnn, groups_ours) for a, b in zip(ga, gb))
        print(f"| {model} | {B} x {n} | {P} | {t_cudnn:.1f} | {t_ours:.1f} | {t_cudnn / t_ours:.2f} | {same}/{B * n} |",
              flush=True)


if __name__ == "__main__":
    main()
