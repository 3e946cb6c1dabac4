"""One GPU, one run: the sampler, the training step and the kernels at Qwen2.5's shapes, measured against the
device's own ceilings, and the kernel and sampler tests with Triton compiled. Results in one folder.

On a lent GPU machine (the device tool: one call, at most 10 minutes; this script caps itself at 540 s):

    run(command="PYTHONUNBUFFERED=1 python3 bench/gpu.py --out $OUT/gpu --commit <git describe --always --dirty>",
        timeout_s=600)

(the commit written out here: no .git travels). The machine's start takes 1-2 of a session's 15 device minutes and
this run about 9.5: one try, then give_back. Commit the results.json and results.md it brings back under
bench/results/<device>-<date>/. Elsewhere:

    python bench/gpu.py --out bench/results/h100-2026-12-01     # any machine with one CUDA GPU
    python bench/gpu.py --cpu-tiny --out /tmp/gpu-tiny           # every part at tiny shapes on a CPU (< 1 min)

Parts, each in its own process (a crash, an out-of-memory or a CUDA error in one cannot take the others with it),
each with a time cap: a part skips, with a note, what no longer fits, and one past its cap is stopped with what it
had measured kept. results.json, results.md and log.txt (the parts' own output) are rewritten after every part.
  1 ceilings  a 1 GiB device-to-device copy (bytes read + written per second) and an 8192^3 bf16 matmul
              (FLOP/s), random data, median of triton's do_bench: the roofs every fraction below divides by.
  2 sampler   common.sampler.generate at Qwen2.5-0.5B's shapes, bf16, batch 256 / 1 / 64 (the goals' batches
              first), 256-token prompts, 512 new tokens, T = 1 sampling, no stop: ours eager, transformers generate
              (the same weights), ours with CUDA graphs (compile=True); tokens/s, and the fraction of the roofline:
              the call's floor (per forward, the larger of bytes / copy rate and FLOPs / matmul rate; bytes are the
              weights + the KV cache read, see generate_floor) over its measured time.
  3 train     the trainer's micro-batch (common.batch.completion_logprobs, GRPO's clipped loss, backward) at
              Qwen2.5-0.5B and 1.5B shapes, fp32 master weights under bf16 autocast as grpo.py runs on a GPU,
              8k tokens packed as the trainer packs them, with and without gradient checkpointing: tokens/s, MFU
              (6 FLOPs per weight per token + attention's, over the measured matmul rate), peak memory
              (torch.cuda.max_memory_allocated, weights and AdamW state included); and the AdamW step's time.
  4 kernels   the fused log-prob + entropy forward at [8192, 151936] bf16 (fraction of the copy rate) and the
              fused clipped loss at 8k-64k tokens, each against its eager reference; then bench/kernels.py's tables.
  5 suite     python -m pytest tests/test_kernels.py tests/test_sampler.py, TRITON_INTERPRET unset: every Triton
              kernel compiled, the CUDA-graph sampler test included.
--cpu-tiny runs the same code at tiny shapes on a CPU; what only CUDA has (CUDA graphs, max_memory_allocated,
bench/kernels.py's GPU tables) is reported as skipped-on-CPU. tests/test_gpu_bench.py runs it.
"""
import argparse
import contextlib
import datetime
import importlib.metadata
import io
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from common.config import OneLineParser  # noqa: E402  (a user mistake: one line, exit 2)
import kernels  # noqa: E402
from common.batch import Batch, completion_logprobs, pack_inputs  # noqa: E402
from common.model import ModelConfig, Transformer  # noqa: E402
from common.optim import adamw  # noqa: E402
from common.sampler import generate  # noqa: E402

# Qwen2.5-0.5B and -1.5B (Hugging Face config.json fields): random weights of these shapes stand in for the real
# ones, which need not travel to the GPU machine. Both tie the LM head to the embeddings.
QWEN25 = {
    "0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6,
                 rms_norm_eps=1e-6, max_position_embeddings=32768),
    "1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6,
                 rms_norm_eps=1e-6, max_position_embeddings=131072),
}
# --cpu-tiny: the same architecture (grouped-query attention, tied head), small enough for a CPU test
TINY_MODELS = {"0.5b": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2),
               "1.5b": dict(vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2)}

SHAPES = {
    "gpu": dict(copy_bytes=2 ** 30, matmul=8192,
                # batch 256 and 1 carry the goals: they run first, so a cut part loses batch 64
                sampler_batches=[256, 1, 64], prompt=256, new=512,
                # 4 prompts x 8 completions of 239 tokens: 4 packed rows of 127 + 8 x 240 = 2047 tokens, 8188 in all
                train_prompts=4, group=8, train_prompt=128, completion=239, timed_micro_batches=3,
                logits_rows=8192, loss_tokens=[8192, 16384, 32768, 65536],
                suite=["tests/test_kernels.py", "tests/test_sampler.py"]),
    "cpu-tiny": dict(copy_bytes=2 ** 24, matmul=256, sampler_batches=[4, 1, 2], prompt=8, new=16,
                     train_prompts=2, group=4, train_prompt=16, completion=20, timed_micro_batches=2,
                     logits_rows=64, loss_tokens=[256, 1024],
                     suite=["tests/test_kernels.py::test_policy_loss_rejects_unbroadcast_advantages"]),
}

# (part, seconds reserved for it): a part may also use what the parts before it left unused
PLAN = [("ceilings", 20), ("sampler", 220), ("train", 90), ("kernels", 90), ("suite", 110)]
BUDGET_S = 540
# rough seconds one GPU measurement needs (compiling included): what a part checks against its time left
NEED_S = {"eager": 10, "graphs first": 90, "graphs": 40, "transformers": 30, "train": 25, "logits": 10,
          "loss": 5, "kernels table": 60, "suite": 30, "profile": 15}
CPU_SKIP = "skipped-on-CPU"


# ------------------------------------------------------------------------------------------ a part

class Part:
    """One part's results, saved to DIR/.part-<name>.json after every row, so that a part stopped at its cap keeps
    what it measured; its deadline (a time.time()) is when the parent stops it."""

    def __init__(self, name, out, deadline, tiny):
        self.name, self.path, self.deadline, self.tiny = name, Path(out) / f".part-{name}.json", deadline, tiny
        self.data = {"status": "running", "rows": [], "skipped": [], "notes": []}

    def left(self):
        return self.deadline - time.time()

    def fits(self, what, need):
        """True if `need` (a NEED_S key) fits in the time left; else records `what` as skipped."""
        seconds = 0 if self.tiny else NEED_S[need]
        if self.left() >= seconds:
            return True
        self.skip(what, f"time cap: {self.left():.0f} s left, ~{seconds} s needed")
        return False

    def skip(self, what, why):
        self.data["skipped"].append({"what": what, "why": why})
        print(f"  skipped {what}: {why}", flush=True)
        self.save()

    @contextlib.contextmanager
    def attempt(self, what):
        """Runs the block; an exception in it is recorded as `what` skipped with the error (traceback in the log), and
        the part goes on with its next measurement. Yields a list that names the error's type after a failure."""
        failed = []
        try:
            yield failed
        except Exception as e:  # noqa: BLE001 - one measurement failed; the part's others still run
            traceback.print_exc()
            failed.append(type(e).__name__)  # not e: its traceback would keep the failed call's tensors alive
            oom = isinstance(e, torch.cuda.OutOfMemoryError)
            self.skip(what, ("out of memory: " if oom else f"error: {type(e).__name__}: ") + _first_line(e))

    def row(self, **values):
        self.data["rows"].append(values)
        print("  " + ", ".join(f"{k}={_fmt(v)}" for k, v in values.items()), flush=True)
        self.save()

    def save(self):
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)  # whole or not at all, also when the parent kills this process mid-write


def _first_line(e):
    return (str(e).strip().splitlines() or [""])[0][:300]


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def ceilings(out):
    """(copy bytes/s, matmul FLOP/s) measured by part 1, or (None, None) if it failed."""
    try:
        data = json.loads((Path(out) / ".part-ceilings.json").read_text())
        return data["copy_bytes_per_s"], data["matmul_flops_per_s"]
    except (OSError, KeyError, ValueError):
        return None, None


# ----------------------------------------------------------------------------------------- helpers

def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def wall(fn, dev):
    """Seconds of one call, the device's queue drained before and after (for calls of seconds: generate, a step)."""
    sync(dev)
    start = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - start


def kernel_seconds(fn, dev, grad_to_none=()):
    """Median seconds of a short call: triton's do_bench on CUDA (CUDA events, its own warm-up and repeats),
    else the median of 5 timed calls after one warm-up."""
    if dev.type == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, grad_to_none=list(grad_to_none), return_mode="median") / 1e3
    fn()
    return statistics.median(wall(fn, dev) for _ in range(5))


def profile_table(fn, dev, rows=15):
    """The ops one call spends its time in (torch.profiler; device time on CUDA): what a gap to a roof goes to, from
    the same run, since a lent GPU's minutes leave no time for a second one."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(dev)
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def reset_peak(dev):
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory(dev):
    """{peak_gpu_bytes: torch.cuda.max_memory_allocated since reset_peak (CUDA only), peak_rss_bytes: this process's
    peak resident memory so far (getrusage, the host side)}."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    gpu = torch.cuda.max_memory_allocated() if dev.type == "cuda" else CPU_SKIP
    return dict(peak_gpu_bytes=gpu, peak_rss_bytes=rss)


def model_config(size, tiny):
    hf = dict(QWEN25[size], **(TINY_MODELS[size] if tiny else {}))
    return ModelConfig.from_hf(hf, f"QWEN25[{size!r}]")


def random_model(cfg, dev, dtype):
    """Our Transformer with random weights (matrices N(0, 0.02), norms 1), built on the device: no CPU init of 1.5B."""
    torch.manual_seed(0)
    with torch.device(dev):
        model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    return model.to(dtype)


def matmul_params(cfg):
    """(weights in the layers' matmuls, weights in the LM head): a token's forward costs 2 FLOPs per weight it meets."""
    d, hd = cfg.hidden_size, cfg.head_dim
    attention = d * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)  # q, o; k, v
    return cfg.num_layers * (attention + 3 * d * cfg.intermediate_size), cfg.vocab_size * d


def attention_flops(cfg, keys):
    """Forward FLOPs of attention for queries that see `keys` keys in all: q.k and p.v, 2 FLOPs per multiply-add."""
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys


# --------------------------------------------------------------------------------------- 1 ceilings

def part_ceilings(p, dev, s):
    """The two roofs: bytes a device-to-device copy moves per second (read + written), FLOP/s of a square matmul.
    Random data, not zeros: zeros ran a bf16 matmul 13% faster on an H200 of this workplace."""
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        p.data.update(device=props.name, sm_count=props.multi_processor_count, gpu_memory_bytes=props.total_memory)
    else:
        p.data.update(device=f"CPU ({torch.get_num_threads()} threads)")
    src = torch.randint(0, 256, (s["copy_bytes"],), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / kernel_seconds(lambda: dst.copy_(src), dev)
    del src, dst
    n, dtype = s["matmul"], torch.bfloat16 if dev.type == "cuda" else torch.float32
    a, b = torch.randn(2, n, n, device=dev, dtype=dtype)
    rate = 2 * n ** 3 / kernel_seconds(lambda: a @ b, dev)
    p.data.update(copy_bytes_per_s=copy, matmul_flops_per_s=rate, matmul=f"{n}^3 {str(dtype).removeprefix('torch.')}")
    p.row(copy_GBps=copy / 1e9, matmul_TFLOPs=rate / 1e12)


# ---------------------------------------------------------------------------------------- 2 sampler

def generate_floor(cfg, weight_bytes, B, P, new, copy, rate, elem=2):
    """(seconds, seconds per decode step) no implementation can beat for one generate call: for the prefill and then
    for each decode step, the larger of bytes over the copy rate and FLOPs over the matmul rate. Bytes counted: every
    weight once per forward (the tied matrix once, read as the LM head) + the KV cache a step reads (k and v of every
    earlier token, each row and layer); the logits and the sampling's [B, vocab] temporaries are not counted, nor any
    cache write. FLOPs: 2 per matmul weight per token (the prefill's LM head at one position) + attention's."""
    body, head = matmul_params(cfg)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem * B
    prefill = max(weight_bytes / copy, (2 * (body * P + head) * B + attention_flops(cfg, B * P * (P + 1) / 2)) / rate)
    steps = 0.0
    for t in range(new):
        ctx = P + t
        flops = 2 * (body + head) * B + attention_flops(cfg, B * ctx)
        steps += max((weight_bytes + kv_per_token * ctx) / copy, flops / rate)
    return prefill + steps, steps / new


def load_transformers_twin(ours, tmp):
    """transformers' model with our weights (written and read back as a Hugging Face folder), or the reason why not."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        return None, f"transformers is not installed here ({e})"
    ours.save_pretrained(tmp)
    dev, dtype = ours.lm_head.weight.device, ours.lm_head.weight.dtype
    return AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(dev).eval(), None


def sampler_variants(ours, hf, prompts, new, dev):
    """name -> (a short warm-up, the timed call); T = 1 sampling (what RL runs), no stop token: every row makes
    `new` tokens. The CUDA-graph path's warm-up is a whole call: its cache shape, and so its graphs, depend on it."""
    from bench.sampler import hf_generate

    def ours_call(n_new, compile=False):
        return lambda: generate(ours, prompts, max_new_tokens=n_new, temperature=1.0, stop_ids=(), seed=0,
                                compile=compile)

    def hf_call(n_new):
        return lambda: hf_generate(hf, prompts, 1, n_new, True, (), 0, 0, True)
    # the CUDA-graph path last: if its compilation outlasts the part's cap, the other two are measured already
    variants = {"ours eager": (ours_call(min(8, new)), ours_call(new))}
    if hf is not None:
        variants["transformers"] = (hf_call(min(8, new)), hf_call(new))
    if dev.type == "cuda":
        variants["ours CUDA graphs"] = (ours_call(new, True), ours_call(new, True))
    return variants


def part_sampler(p, dev, s):
    copy, rate = ceilings(p.path.parent)
    cfg, dtype = model_config("0.5b", p.tiny), torch.bfloat16 if dev.type == "cuda" else torch.float32
    ours = random_model(cfg, dev, dtype).eval()
    weight_bytes = sum(t.numel() * t.element_size() for t in ours.parameters())
    p.data.update(model="Qwen2.5-0.5B shapes", dtype=str(dtype).removeprefix("torch."), weight_bytes=weight_bytes,
                  prompt=s["prompt"], new=s["new"], sampling="T=1, no top-k/top-p, no stop")
    hf = None
    with p.attempt("transformers generate"), tempfile.TemporaryDirectory() as tmp:  # a failed load: ours still runs
        hf, why = load_transformers_twin(ours, tmp)
        if hf is None:
            p.skip("transformers generate", why)
    if dev.type != "cuda":
        p.skip("ours CUDA graphs", f"{CPU_SKIP}: compile=True captures CUDA graphs")
    else:  # what the floor does not count, and the fixed-shape step costs
        p.data["notes"].append("the CUDA-graph step attends over the whole preallocated cache (prompt + new, rounded "
                               "up to 128 columns) at every step, the eager step over the filled columns only")
    compiled_once, broken = False, set()  # a variant that failed once is not tried at the other batches
    for B in s["sampler_batches"]:
        g = torch.Generator().manual_seed(B)
        prompts = torch.randint(0, cfg.vocab_size, (B, s["prompt"]), generator=g).tolist()
        floor, step_floor = (generate_floor(cfg, weight_bytes, B, s["prompt"], s["new"], copy, rate, dtype.itemsize)
                             if copy else (None, None))
        for name, (warm, call) in sampler_variants(ours, hf, prompts, s["new"], dev).items():
            need = {"ours eager": "eager", "transformers": "transformers"}.get(name) or (
                "graphs" if compiled_once else "graphs first")  # the first CUDA-graph call compiles the step
            if name in broken:
                p.skip(f"{name} B={B}", "it failed at an earlier batch")
            elif p.fits(f"{name} B={B}", need):
                with p.attempt(f"{name} B={B}") as failed:
                    compiled_once |= name == "ours CUDA graphs"
                    sampler_row(p, dev, B, s["new"], name, warm, call, floor, step_floor)
                if failed:
                    broken.add(name)
        if B == max(s["sampler_batches"]):  # the goals' batch, before the next batches could use up the time
            sampler_profile(p, ours, prompts, min(32, s["new"]), dev)


def sampler_profile(p, ours, prompts, new, dev):
    what = f"profile of ours eager B={len(prompts)}"
    if p.fits(what, "profile"):
        with p.attempt(what):
            short = sampler_variants(ours, None, prompts, new, dev)["ours eager"][1]
            p.data["profiles"] = {f"ours eager, B={len(prompts)}, {new} new tokens": profile_table(short, dev)}
            p.save()


def sampler_row(p, dev, B, new, name, warm, call, floor, step_floor):
    warm_s = wall(warm, dev)
    reset_peak(dev)
    seconds = wall(call, dev)
    row = dict(batch=B, variant=name, tokens_per_s=B * new / seconds, seconds=seconds, ms_per_step=seconds * 1e3 / new,
               warmup_s=warm_s, **peak_memory(dev))
    if floor:
        row.update(roofline_fraction=floor / seconds, floor_ms_per_step=step_floor * 1e3)
    if name == "ours CUDA graphs":
        from torch._dynamo.utils import counters
        # inductor falls back to plain kernel launches, silently, when it cannot capture; and a call that compiles
        # again (new shapes) pays for it inside the timed call: both counts so far in this process
        row.update(cudagraph_skips=counters["inductor"]["cudagraph_skips"],
                   graphs_compiled=counters["stats"]["unique_graphs"])
    p.row(**row)
    transformers_vs(p)  # after every row: a part stopped at its cap keeps the ratios too


def transformers_vs(p):
    """Each of our rows' speed as a multiple of transformers' at the same batch."""
    theirs = {r["batch"]: r["tokens_per_s"] for r in p.data["rows"] if r["variant"] == "transformers"}
    for r in p.data["rows"]:
        if r["variant"] != "transformers" and r["batch"] in theirs:
            r["vs_transformers"] = r["tokens_per_s"] / theirs[r["batch"]]
    p.save()


# ------------------------------------------------------------------------------------------ 3 train

def train_batch(cfg, s):
    """One micro-batch of GRPO completions as the trainer holds them: train_prompts prompts x group completions, each
    group packed into one row after a single copy of its prompt (common.batch.pack_inputs, via completion_logprobs)."""
    g = torch.Generator().manual_seed(0)
    P, L, G = s["train_prompt"], s["completion"], s["group"]
    prompts = [torch.randint(1, cfg.vocab_size, (P,), generator=g).tolist() for _ in range(s["train_prompts"])]
    N = len(prompts) * G
    return Batch(context=[prompts[i // G] for i in range(N)],
                 tokens=[torch.randint(1, cfg.vocab_size, (L,), generator=g).tolist() for _ in range(N)],
                 group=torch.arange(N) // G, skip=torch.zeros(N, dtype=torch.long), sampler_logp=torch.zeros(N * L),
                 finished=torch.ones(N, dtype=torch.bool), answer=[""] * N)


def train_flops(cfg, b):
    """(useful FLOPs of one forward + backward of batch b, tokens through the forward, loss tokens): 6 per matmul
    weight per token (the LM head only at the loss tokens, where the fused head runs) + 3x the forward attention over
    the keys each query really sees (the packed mask's True entries; padding has none here). What gradient
    checkpointing and the fused head recompute is not counted: MFU counts the model's FLOPs, not the hardware's."""
    ids, _, target_mask, _, mask, _ = pack_inputs(b.context, b.tokens, b.skip.tolist(), 0)
    R, T = ids.shape
    keys = int(mask.sum()) if mask is not None else R * T * (T + 1) // 2
    body, head = matmul_params(cfg)
    targets = int(target_mask.sum())
    return 6 * body * R * T + 6 * head * targets + 3 * attention_flops(cfg, keys), R * T, targets


def micro_step(model, b, adv, dev, autocast):
    """What grpo.py's update does for one micro-batch: the packed forward with the fused LM head, the clipped
    surrogate (kernels.policy_loss at GRPO's defaults, eps 0.2 / 0.28, token-mean), backward."""
    idx = list(range(len(b.tokens)))
    with autocast:
        logp, entropy, tok = completion_logprobs(model, b, idx, 1.0, 0, dev)
        loss, _, _ = kernels.policy_loss(logp, logp.detach(), adv[tok].to(dev), 0.2, 0.28, entropy=entropy)
        (loss.sum() / len(tok)).backward()


def train_one(p, dev, s, size, checkpointing, rate):
    cfg = model_config(size, p.tiny)
    reset_peak(dev)
    model = random_model(cfg, dev, torch.float32).train()  # fp32 master weights, as grpo.py keeps them
    model.gradient_checkpointing = checkpointing
    optimizer = adamw(model.parameters(), lr=1e-6, betas=(0.9, 0.99), weight_decay=0.0)  # grpo.py's
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    b = train_batch(cfg, s)
    adv = torch.randn(len(b.tokens)).sign().repeat_interleave(b.lengths)  # +-1 per completion, per token
    flops, fwd_tokens, loss_tokens = train_flops(cfg, b)

    def optimizer_step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    micro_step(model, b, adv, dev, autocast)  # warm-up: kernels compiled, AdamW's state allocated
    optimizer_step()
    k = s["timed_micro_batches"]
    seconds = wall(lambda: [micro_step(model, b, adv, dev, autocast) for _ in range(k)], dev) / k
    opt_s = wall(optimizer_step, dev)
    p.row(model=size, checkpointing=checkpointing, params=sum(t.numel() for t in model.parameters()),
          fwd_tokens=fwd_tokens, loss_tokens=loss_tokens, tokens_per_s=fwd_tokens / seconds, micro_batch_s=seconds,
          optimizer_step_s=opt_s, mfu=flops / seconds / rate if rate else None, tflops_per_s=flops / seconds / 1e12,
          **peak_memory(dev))
    what = f"profile of {size} checkpointing={checkpointing}"
    if size == "1.5b" and p.fits(what, "profile"):  # the size the MFU goal is set for
        with p.attempt(what):
            text = profile_table(lambda: micro_step(model, b, adv, dev, autocast), dev)
            p.data.setdefault("profiles", {})[f"{size} checkpointing={checkpointing}, one micro-batch"] = text
            p.save()


def part_train(p, dev, s):
    _, rate = ceilings(p.path.parent)
    p.data.update(setup="fp32 master weights, bf16 autocast on CUDA (fp32 on CPU), fused AdamW; "
                        f"{s['train_prompts']} prompts x {s['group']} completions, prompt {s['train_prompt']}, "
                        f"completion {s['completion']} tokens")
    # 1.5B with checkpointing before without: if the latter runs out of memory, the former is already measured
    for size, checkpointing in [("0.5b", False), ("0.5b", True), ("1.5b", True), ("1.5b", False)]:
        what = f"train {size} checkpointing={checkpointing}"
        if not p.fits(what, "train"):
            continue
        with p.attempt(what):  # out of memory included: recorded, and train_one's tensors are freed with its frame
            train_one(p, dev, s, size, checkpointing, rate)
        reset_peak(dev)


# ---------------------------------------------------------------------------------------- 4 kernels

def part_kernels(p, dev, s):
    copy, _ = ceilings(p.path.parent)
    if p.fits("logprobs_entropy forward", "logits"):
        with p.attempt("logprobs_entropy forward"):
            logits_forward(p, dev, s, copy)
    for n in s["loss_tokens"]:
        if p.fits(f"policy_loss n={n}", "loss"):
            with p.attempt(f"policy_loss n={n}"):
                loss_row(p, dev, n)
    if dev.type != "cuda":
        p.skip("bench/kernels.py tables", f"{CPU_SKIP}: gpu_tables times with CUDA events and CUDA memory stats")
    elif p.fits("bench/kernels.py tables", "kernels table"):
        from bench.kernels import gpu_tables
        text = io.StringIO()
        with p.attempt("bench/kernels.py tables"), contextlib.redirect_stdout(text):
            gpu_tables()
        p.data["kernels_py_tables"] = text.getvalue()  # what it printed, also when it failed half-way
        print(text.getvalue(), flush=True)
        p.save()


def logits_forward(p, dev, s, copy):
    """kernels.logprobs_entropy forward (no grad) on [rows, 151936] logits against the eager reference; the bytes
    counted are one read of the logits (the outputs are 2 floats per row)."""
    rows, vocab = s["logits_rows"], model_config("0.5b", p.tiny).vocab_size
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(dev).manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g, device=dev) * 2).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g, device=dev)
    times = {}
    for name, op in (("ours", kernels.logprobs_entropy), ("eager", kernels.reference.logprobs_entropy)):
        with torch.no_grad():
            times[name] = kernel_seconds(lambda: op(logits, targets), dev)
    rate = logits.numel() * logits.element_size() / times["ours"]
    p.row(op="logprobs_entropy fwd", shape=f"[{rows}, {vocab}] {str(dtype).removeprefix('torch.')}",
          ours_ms=times["ours"] * 1e3, eager_ms=times["eager"] * 1e3, speedup=times["eager"] / times["ours"],
          GBps=rate / 1e9, of_copy=rate / copy if copy else None)


def loss_row(p, dev, n):
    """kernels.policy_loss forward + backward as grpo.py calls it (entropy given, its coefficient 0) against
    kernels.reference.policy_loss; on a CPU both are the reference."""
    g = torch.Generator(dev).manual_seed(n)
    logp = (-torch.rand(n, generator=g, device=dev) * 3).requires_grad_(True)
    old = logp.detach() + 0.1 * torch.randn(n, generator=g, device=dev)
    adv, entropy = torch.randn(n, generator=g, device=dev), torch.rand(n, generator=g, device=dev)
    times = {}
    for name, op in (("ours", kernels.policy_loss), ("eager", kernels.reference.policy_loss)):
        def fwd_bwd():
            op(logp, old, adv, 0.2, 0.28, entropy=entropy)[0].sum().backward()
        times[name] = kernel_seconds(fwd_bwd, dev, [logp])
    p.row(op="policy_loss fwd+bwd", shape=f"[{n}] fp32", ours_ms=times["ours"] * 1e3, eager_ms=times["eager"] * 1e3,
          speedup=times["eager"] / times["ours"])


# ------------------------------------------------------------------------------------------ 5 suite

def part_suite(p, dev, s):
    """The kernel and sampler tests in a subprocess, Triton compiled (TRITON_INTERPRET unset): with a GPU every
    kernel test runs its Triton kernel for real, and the CUDA-graph sampler test is not skipped."""
    if not p.fits("test suite", "suite"):
        return
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *s["suite"]]
    if dev.type == "cuda" and _has("xdist"):
        cmd += ["-n", "8"]  # compiling the kernels' variants is CPU work: 8 workers share it
    if any(t.startswith("tests/test_sampler.py") for t in s["suite"]) and not _smollm2_weights():
        cmd += ["--deselect", "tests/test_sampler.py::test_greedy_matches_transformers_smollm2"]
        p.data["notes"].append("deselected test_greedy_matches_transformers_smollm2: the SmolLM2 weights are not here")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FORCE_TRITON")}
    start = time.time()
    rc, output = run_capped(cmd, p.left() - 2, env=env, capture=True)
    print(output, flush=True)
    lines = [line for line in output.splitlines() if line.strip()]
    summary = next((line.strip("= ") for line in reversed(lines) if " in " in line and (
        "passed" in line or "failed" in line or "error" in line)), lines[-1] if lines else "")
    p.row(command=" ".join(cmd[1:]), rc=rc, seconds=time.time() - start, summary=summary,
          failed=[line for line in lines if line.startswith(("FAILED", "ERROR"))])


def _has(module):
    import importlib.util
    return importlib.util.find_spec(module) is not None


def _smollm2_weights():
    try:
        from common.hub import resolve_model_dir
        resolve_model_dir("smollm2")
        return True
    except Exception:  # noqa: BLE001 - any reason (no package, no network) means the test cannot run here
        return False


PARTS = {"ceilings": part_ceilings, "sampler": part_sampler, "train": part_train, "kernels": part_kernels,
         "suite": part_suite}


# ----------------------------------------------------------------------------------------- the parent

def run_capped(cmd, seconds, env=None, capture=False, stdout=None):
    """(return code, output if capture) of cmd in its own process group, the whole group killed after `seconds`
    (torch.compile's and pytest-xdist's workers too); return code None when killed."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True, text=True,
                            stdout=subprocess.PIPE if capture else stdout, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=max(seconds, 1))
        return proc.returncode, out or ""
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # the group may be gone already
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, (out or "") + f"\n[stopped at its time cap of {seconds:.0f} s]"


def run_parts(args):
    out, mode = Path(args.out), "cpu-tiny" if args.cpu_tiny else "gpu"
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    results = {"meta": meta(mode, args.budget, args.commit), "parts": {}}
    scale = args.budget / BUDGET_S
    env = dict(os.environ)
    if mode == "gpu":  # the kernels run compiled, never in the interpreter
        env = {k: v for k, v in env.items() if k not in ("TRITON_INTERPRET", "FORCE_TRITON")}
    with open(out / "log.txt", "w") as log:
        for i, (name, _) in enumerate(PLAN):
            deadline = start + args.budget - scale * sum(share for _, share in PLAN[i + 1:])
            t = time.time()
            log.write(f"\n===== part {i + 1} {name} =====\n")
            log.flush()
            cmd = [sys.executable, __file__, "--part", name, "--out", str(out), "--deadline", str(deadline)]
            rc, _ = run_capped(cmd + (["--cpu-tiny"] if args.cpu_tiny else []), deadline - t + 5, env=env, stdout=log)
            part = collect(out, name, rc)
            part["elapsed_s"] = time.time() - t
            results["parts"][name] = part
            results["meta"]["elapsed_s"] = time.time() - start
            write_results(out, results)
            print(f"[bench/gpu.py] part {i + 1}/{len(PLAN)} {name}: {part['status']} in {part['elapsed_s']:.1f} s "
                  f"({len(part['rows'])} rows, {len(part['skipped'])} skipped; {time.time() - start:.0f} s elapsed)",
                  flush=True)
    for f in [*out.glob(".part-*.json"), *out.glob(".part-*.tmp")]:  # merged into results.json
        f.unlink()
    print((out / "results.md").read_text())


def collect(out, name, rc):
    """The part's saved results; a part killed at its cap or crashed keeps its rows, with the status saying so."""
    try:
        part = json.loads((out / f".part-{name}.json").read_text())
    except (OSError, ValueError):
        part = {"status": "running", "rows": [], "skipped": [], "notes": []}
    if rc is None:
        part["status"] = "stopped at its time cap"
    elif part["status"] == "running":
        part["status"] = f"crashed (exit code {rc}, see log.txt)"
    return part


def meta(mode, budget, commit=None):
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"
    try:  # a copy of the working tree (the device tool's) may come without .git: then --commit says it
        commit = commit or subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True,
                                          text=True).stdout
    except OSError:
        commit = ""
    return dict(mode=mode, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                torch=torch.__version__, triton=version("triton"), transformers=version("transformers"),
                python=sys.version.split()[0], commit=commit.strip() or "unknown (no git here)", budget_s=budget)


# ---------------------------------------------------------------------------------------- results.md

def write_results(out, results):
    parts = results["parts"]
    results["meta"]["device"] = parts.get("ceilings", {}).get("device", "unknown")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_cell(v) for v in r) + " |" for r in rows]


def _cell(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return "-" if v is None else str(v)


def _gb(v):
    return v / 1e9 if isinstance(v, (int, float)) else v


def markdown(results):
    m, parts = results["meta"], results["parts"]
    lines = [f"# bench/gpu.py ({m['mode']})", ""]
    lines += table(["device", "torch", "Triton", "transformers", "date", "commit", "wall s"],
                   [[m["device"], m["torch"], m["triton"], m["transformers"], m["date"], m["commit"],
                     m.get("elapsed_s")]])
    for name, part in parts.items():
        lines += ["", f"## {name}: {part['status']} ({part['elapsed_s']:.0f} s)", ""]
        if part.get("error"):
            lines += [f"error: `{part['error']}`", ""]
        lines += SECTIONS[name](part) if part["rows"] else []
        lines += [f"- skipped {s['what']}: {s['why']}" for s in part["skipped"]]
        lines += [f"- {note}" for note in part["notes"]]
        for title, text in part.get("profiles", {}).items():  # folded: long, and read only to explain a gap
            lines += ["", f"<details><summary>profile: {title}</summary>", "", "```", text.rstrip(), "```",
                      "</details>"]
    lines += ["", "## Goals (issue 39)", ""]
    if m["mode"] == "cpu-tiny":
        lines += ["(tiny shapes on a CPU: these lines check the script, not the code's speed)", ""]
    lines += goals(parts)
    return "\n".join(lines) + "\n"


def md_ceilings(part):
    return table(["copy GB/s (read + write)", "matmul TFLOP/s", "matmul"],
                 [[r["copy_GBps"], r["matmul_TFLOPs"], part.get("matmul")] for r in part["rows"]])


def md_sampler(part):
    head = (f"{part.get('model')}, {part.get('dtype')}, prompt {part.get('prompt')}, {part.get('new')} new, "
            f"{part.get('sampling')}")
    skips = max((r.get("cudagraph_skips", 0) for r in part["rows"]), default=0)
    note = ["", f"inductor skipped CUDA graphs {skips} time(s): those rows ran without them (log.txt says why)"]
    return [head, ""] + table(
        ["batch", "variant", "tokens/s", "ms/step", "floor ms/step", "of roofline", "vs transformers", "warm-up s",
         "peak GPU GB"],
        [[r["batch"], r["variant"], r["tokens_per_s"], r["ms_per_step"], r.get("floor_ms_per_step"),
          r.get("roofline_fraction"), r.get("vs_transformers"), r["warmup_s"], _gb(r["peak_gpu_bytes"])]
         for r in part["rows"]]) + (note if skips else [])


def md_train(part):
    return [part.get("setup", ""), ""] + table(
        ["model", "checkpointing", "tokens/micro-batch", "tokens/s", "MFU", "TFLOP/s", "micro-batch s",
         "AdamW step s", "peak GPU GB"],
        [[r["model"], r["checkpointing"], r["fwd_tokens"], r["tokens_per_s"], r["mfu"], r["tflops_per_s"],
          r["micro_batch_s"], r["optimizer_step_s"], _gb(r["peak_gpu_bytes"])] for r in part["rows"]])


def md_kernels(part):
    lines = table(["op", "shape", "ours ms", "eager ms", "speedup", "GB/s", "of copy"],
                  [[r["op"], r["shape"], r["ours_ms"], r["eager_ms"], r["speedup"], r.get("GBps"), r.get("of_copy")]
                   for r in part["rows"]])
    if part.get("kernels_py_tables"):
        lines += ["", "bench/kernels.py's tables:", "", "```", part["kernels_py_tables"].rstrip(), "```"]
    return lines


def md_suite(part):
    return [f"`{r['command']}`: {r['summary']} (exit code {r['rc']}, {r['seconds']:.0f} s)" for r in part["rows"]] + \
           [f"- {line}" for r in part["rows"] for line in r["failed"]]


SECTIONS = {"ceilings": md_ceilings, "sampler": md_sampler, "train": md_train, "kernels": md_kernels, "suite": md_suite}


def goals(parts):
    """The issue's targets against this run's rows (at tiny CPU shapes they say nothing about a GPU)."""
    rows = {name: part["rows"] for name, part in parts.items()}

    def sampler(batch, variant):
        return next((r for r in rows.get("sampler", []) if r["batch"] == batch and r["variant"] == variant), {})
    big = max((r for r in rows.get("sampler", []) if r["variant"] != "transformers"),
              key=lambda r: (r["batch"], r["tokens_per_s"]), default={})
    one = sampler(min((r["batch"] for r in rows.get("sampler", [])), default=None), "ours CUDA graphs")
    mfu = max((r["mfu"] for r in rows.get("train", []) if r["model"] == "1.5b" and r.get("mfu")), default=None)
    fwd = next((r.get("of_copy") for r in rows.get("kernels", []) if r["op"] == "logprobs_entropy fwd"), None)
    suite = next((r["summary"] for r in rows.get("suite", [])), None)
    checks = [(f"largest batch, ours ({big.get('variant')}) >= 5x transformers", big.get("vs_transformers"), 5),
              ("largest batch, ours >= 50% of the roofline", big.get("roofline_fraction"), 0.5),
              ("batch 1 with CUDA graphs >= 60% of the roofline (bandwidth floor)", one.get("roofline_fraction"), 0.6),
              ("training MFU at 1.5B >= 40%", mfu, 0.4),
              ("logprobs_entropy forward >= 80% of the copy rate", fwd, 0.8)]
    lines = [f"- {what}: {'not measured' if v is None else f'{v:.3g}, ' + ('met' if v >= target else 'missed')}"
             for what, v, target in checks]
    return lines + [f"- suite with Triton compiled: {suite or 'not run'}"]


# ------------------------------------------------------------------------------------------- main

def run_part(args):
    """A child process: one part, its results saved as it goes; an exception is recorded, not raised."""
    tiny = args.cpu_tiny
    dev = torch.device("cpu" if tiny else "cuda")
    p = Part(args.part, args.out, args.deadline, tiny)
    p.save()
    try:
        PARTS[args.part](p, dev, SHAPES["cpu-tiny" if tiny else "gpu"])
        p.data["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - recorded; the other parts run in their own processes
        traceback.print_exc()
        p.data.update(status="error", error=f"{type(e).__name__}: {_first_line(e)}")
    p.save()


def main():
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for results.json, results.md and log.txt")
    ap.add_argument("--cpu-tiny", action="store_true", help="every part at tiny shapes on the CPU")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all the parts together")
    ap.add_argument("--commit", help="the commit measured, where no .git came with the files (the device tool's copy)")
    ap.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)  # a child: run one part
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        return run_part(args)
    if not args.cpu_tiny and not torch.cuda.is_available():
        ap.error("no CUDA device here (torch.cuda.is_available() is False); --cpu-tiny runs it on a CPU")
    run_parts(args)


if __name__ == "__main__":
    main()
