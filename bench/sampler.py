"""Our sampler against `transformers` generate, side by side in one run (same model, prompts, dtype, settings).

    python bench/sampler.py                      # CPU: SmolLM2 fp32 decode speed + the RL rollout workload
    python bench/sampler.py --only decode --batches 16 --reps 3
    python bench/sampler.py --only gpu           # CUDA: Qwen2.5-0.5B shapes, random weights, bf16

Sections
  decode   EOS ignored, so both produce the same number of tokens: batch 1/16/64, 64 new tokens, greedy and
           sampled (T=1, no top-k/top-p). tokens/s counts generated tokens over the whole call (prefill included).
  rollout  what RL runs: 8 chat prompts x 8 samples, T=1, stop at the end-of-turn tokens, up to 128 new
           tokens; seconds per round, averaged over seeds (transformers: num_return_sequences=8).
  gpu      only with CUDA: batch 1/64/256, 256-token prompts, 512 new tokens, ours eager and compiled vs
           transformers; plus the fraction of the memory-bandwidth floor reached by our compiled decode.
The machine may be shared: each measurement alternates ours and theirs and keeps the best of --reps.
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.config import OneLineParser  # noqa: E402  (a user mistake: one line, exit 2)
from common.hub import resolve_model_dir  # noqa: E402
from common.model import ModelConfig, Transformer  # noqa: E402
from common.sampler import generate  # noqa: E402
from common.tokenizer import Tokenizer  # noqa: E402

QUESTIONS = [
    "What is 7 * 8?", "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?",
    "Write a haiku about autumn.", "Explain why the sky is blue in two sentences.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h?", "Name three prime numbers above 50.",
    "What is the capital of Australia, and why is it not Sydney?", "If x + 3 = 10, what is x?",
]


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev):
    sync(dev)
    t = time.perf_counter()
    out = fn()
    sync(dev)
    return time.perf_counter() - t, out


def left_pad(prompts, pad, dev):
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = torch.tensor(p), 1
    return ids.to(dev), mask.to(dev)


def hf_generate(hf, prompts, n, new, sample, stop_ids, pad, seed, ignore_eos):
    ids, mask = left_pad(prompts, pad, hf.device)
    torch.manual_seed(seed)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
    if ignore_eos:
        kw.update(eos_token_id=None, min_new_tokens=new)
    else:
        kw.update(eos_token_id=list(stop_ids))
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, num_return_sequences=n,
                          pad_token_id=pad, **kw)
    return out[:, ids.shape[1]:]


def bench_decode(ours, hf, prompts_all, args, dev, pad):
    rows = []
    for B in args.batches:
        prompts = [prompts_all[i % len(prompts_all)] for i in range(B)]
        for sample in (False, True):
            t_ours, t_hf = [], []
            for r in range(args.reps):
                t, out = timed(lambda: generate(ours, prompts, max_new_tokens=args.new, temperature=1.0 if sample else 0,
                                                stop_ids=(), seed=r), dev)
                assert all(len(g[0].tokens) == args.new for g in out)
                t_ours.append(t)
                t, out = timed(lambda: hf_generate(hf, prompts, 1, args.new, sample, (), pad, r, True), dev)
                assert out.shape == (B, args.new)
                t_hf.append(t)
            a, b = B * args.new / min(t_ours), B * args.new / min(t_hf)
            rows.append((f"decode B={B} {'sampled' if sample else 'greedy'}", f"{a:.1f} tok/s", f"{b:.1f} tok/s", a / b))
            print_row(rows[-1])
    return rows


def bench_rollout(ours, hf, prompts, args, dev, tok):
    t_ours, t_hf, len_ours, len_hf = [], [], [], []
    for seed in range(args.seeds):
        t, out = timed(lambda: generate(ours, prompts, n=8, max_new_tokens=128, temperature=1.0,
                                        stop_ids=tok.stop_ids, seed=seed), dev)
        t_ours.append(t)
        len_ours.append(statistics.mean(len(s.tokens) for g in out for s in g))
        t, out = timed(lambda: hf_generate(hf, prompts, 8, 128, True, tok.stop_ids, tok.pad_id, seed, False), dev)
        t_hf.append(t)
        stop = torch.isin(out, torch.tensor(tok.stop_ids, device=out.device))
        len_hf.append(torch.where(stop.any(1), stop.int().argmax(1) + 1, out.shape[1]).float().mean().item())
    a, b = statistics.mean(t_ours), statistics.mean(t_hf)
    row = ("rollout 8x8, T=1, <=128 new", f"{a:.2f} s ({statistics.mean(len_ours):.0f} tok/sample)",
           f"{b:.2f} s ({statistics.mean(len_hf):.0f} tok/sample)", b / a)
    print_row(row)
    return [row]


def copy_bandwidth(dev):
    x = torch.empty(1 << 28, dtype=torch.uint8, device=dev)  # 256 MiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    t, _ = timed(lambda: [y.copy_(x) for _ in range(20)], dev)
    return 2 * x.numel() * 20 / t  # bytes read + written per second


def bench_gpu(args):
    from transformers import AutoModelForCausalLM

    dev = torch.device("cuda")
    cfg = ModelConfig(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                      num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6, tie_word_embeddings=True, qkv_bias=True,
                      rms_norm_eps=1e-6, max_position_embeddings=32768)
    torch.manual_seed(0)
    ours = Transformer(cfg).to(dev, torch.bfloat16).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.02)
    folder = Path(args.tmp) / "qwen25-05b-shapes"
    ours.save_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(dev).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    bw = copy_bandwidth(dev)
    P, new = 256, 512
    print(f"GPU {torch.cuda.get_device_name()}: weights {weight_bytes / 1e9:.2f} GB, copy bandwidth {bw / 1e9:.0f} GB/s")
    rows = []
    for B in args.gpu_batches:
        g = torch.Generator().manual_seed(B)
        prompts = torch.randint(0, cfg.vocab_size, (B, P), generator=g).tolist()
        res = {}
        for name, fn in [
            ("ours", lambda: generate(ours, prompts, max_new_tokens=new, temperature=0, stop_ids=())),
            ("ours compiled", lambda: generate(ours, prompts, max_new_tokens=new, temperature=0, stop_ids=(), compile=True)),
            ("transformers", lambda: hf_generate(hf, prompts, 1, new, False, (), 0, 0, True)),
        ]:
            fn()  # warm-up (and compile)
            res[name] = min(timed(fn, dev)[0] for _ in range(args.reps))
        # per decode step: all weights + the live KV cache (bf16 k and v, average length P + new/2)
        kv_bytes = 2 * cfg.num_layers * B * cfg.num_kv_heads * (P + new / 2) * cfg.head_dim * 2
        floor = new * (weight_bytes + kv_bytes) / bw
        for name in ("ours", "ours compiled"):
            rows.append((f"gpu B={B} {name}", f"{B * new / res[name]:.0f} tok/s", f"{B * new / res['transformers']:.0f} tok/s",
                         res["transformers"] / res[name]))
            print_row(rows[-1])
        print(f"    B={B}: compiled reaches {floor / res['ours compiled']:.0%} of the bandwidth floor "
              f"({floor * 1e3 / new:.2f} ms/step floor, {res['ours compiled'] * 1e3 / new:.2f} ms/step measured, prefill included)")
    return rows


def print_row(r):
    print(f"{r[0]:<32} {r[1]:>26} {r[2]:>26} {r[3]:>7.2f}x", flush=True)


def main():
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["decode", "rollout", "gpu"], default=None, help="run one section")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads, for both")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--gpu-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 256])
    ap.add_argument("--new", type=int, default=64, help="new tokens in the decode section")
    ap.add_argument("--reps", type=int, default=2, help="repeats per measurement (best kept)")
    ap.add_argument("--seeds", type=int, default=3, help="rollout rounds averaged")
    ap.add_argument("--tmp", default="/tmp/rlvr-bench", help="where the GPU section saves its random model")
    args = ap.parse_args()
    if min(args.threads, args.new, args.reps, args.seeds, *args.batches, *args.gpu_batches) < 1:
        ap.error("expected --threads, --new, --reps, --seeds and every batch size >= 1")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    print(f"{'':<32} {'ours':>26} {'transformers':>26} {'speedup':>8}")
    if args.only in (None, "decode", "rollout"):
        dev = torch.device("cpu")
        tok = Tokenizer.from_pretrained("smollm2")
        ours = Transformer.from_pretrained("smollm2").eval()
        hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir("smollm2"), dtype=torch.float32).eval()
        prompts = [tok.prompt(q) for q in QUESTIONS]
        print(f"CPU, SmolLM2-135M fp32, {args.threads} threads, torch {torch.__version__}")
        if args.only in (None, "decode"):
            bench_decode(ours, hf, prompts, args, dev, tok.pad_id)
        if args.only in (None, "rollout"):
            bench_rollout(ours, hf, prompts, args, dev, tok)
    if args.only in (None, "gpu") and torch.cuda.is_available():
        bench_gpu(args)


if __name__ == "__main__":
    main()
