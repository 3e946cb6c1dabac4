"""A sampling call with its temporaries from the heap (the sampler's way on a CPU) against one whose large blocks all
come from mmap (glibc's fixed threshold of 1 MB, common/memory.py), side by side in one process.

    python bench/sampler_heap.py                        # grpo.py's call: 16 arith prompts x 8, 48 tokens, T = 0.8
    python bench/sampler_heap.py --prompts 8 --n 4 --reps 4
    python bench/sampler_heap.py --train                # the update's forward + backward over those completions

Each repetition samples new prompts twice in each mode (mmap, heap, heap, mmap: an order that cancels a drift of the
machine's speed), after freeing ~0.4 x 10^9 B of blocks the way an update does; same seed, so both modes sample the same
tokens (checked). A block that comes from mmap is zero-filled page by page when it is first written and unmapped when
freed; a decode step allocates a dozen [rows, vocabulary] temporaries (25 MB each at 128 rows), so under the fixed
threshold every token pays those page faults again. The table gives each mode's seconds per call. With --train, the
same for a training pass over one call's completions (micro-batches of 8, forward and backward, as grpo.py's update),
which keeps the fixed threshold in the algorithm files.
"""
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common.sampler as sampler  # noqa: E402
from common.batch import completion_logprobs, to_batch  # noqa: E402
from common.config import OneLineParser  # noqa: E402  (a user mistake: one line, exit 2)
from common.hub import resolve_model_dir  # noqa: E402
from common.memory import release_free_memory  # noqa: E402
from common.model import Transformer  # noqa: E402
from common.tasks import format_question, load_task  # noqa: E402
from common.tokenizer import Tokenizer  # noqa: E402


def train_pass(model, batch, pad_id, micro_batch=8):
    """Forward and backward over every completion of batch, micro_batch at a time; the gradients are dropped after."""
    for i in range(0, len(batch.tokens), micro_batch):
        logp, entropy, _ = completion_logprobs(model, batch, list(range(i, min(i + micro_batch, len(batch.tokens)))),
                                               0.8, pad_id, "cpu")
        (logp.sum() + entropy.sum()).backward()
    model.zero_grad(set_to_none=True)


def main():
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--train", action="store_true", help="time a training pass instead of the sampling call")
    args = p.parse_args()
    if min(args.prompts, args.n, args.max_new_tokens, args.reps) < 1:
        p.error("expected --prompts, --n, --max-new-tokens and --reps >= 1")
    path = resolve_model_dir(args.model)
    model = Transformer.from_pretrained(path, dtype=torch.float32).eval()
    tok = Tokenizer.from_pretrained(path)
    train = load_task("arith", "train", n=args.prompts * args.reps, seed=0)
    heap = sampler.heap_temporaries
    seconds = {"mmap": [], "heap": []}
    what = "training pass" if args.train else "call"
    print(f"threads {torch.get_num_threads()}, {args.prompts} prompts x {args.n}, up to {args.max_new_tokens} tokens, "
          f"each mode's seconds per {what}\n")
    print("| rep | mode | seconds | tokens |\n|---|---|---|---|")
    for rep in range(args.reps):
        problems = train[rep * args.prompts:(rep + 1) * args.prompts]
        contexts = [tok.prompt(format_question(q)) for q in problems]
        made = {}
        if args.train:
            groups = sampler.generate(model, contexts, n=args.n, max_new_tokens=args.max_new_tokens, temperature=0.8,
                                      stop_ids=tok.stop_ids, seed=rep)
            batch = to_batch(contexts, groups, [q.answer for q in problems], group_ids=range(len(contexts)))
        for mode in ("mmap", "heap", "heap", "mmap"):
            sampler.heap_temporaries = heap if mode == "heap" else contextlib.nullcontext
            freed = [torch.randn(1 << 18) for _ in range(400)]  # what an update frees before the next call
            del freed
            t = time.perf_counter()
            if args.train:
                with sampler.heap_temporaries():
                    train_pass(model.train(), batch, tok.pad_id)
                release_free_memory()  # as generate() does after its call
                model.eval()
                tokens = batch.tokens
            else:
                groups = sampler.generate(model, contexts, n=args.n, max_new_tokens=args.max_new_tokens,
                                          temperature=0.8, stop_ids=tok.stop_ids, seed=rep)
                tokens = [s.tokens for g in groups for s in g]
                assert made.setdefault("tokens", tokens) == tokens, "the two modes sampled different tokens"
            seconds[mode].append(time.perf_counter() - t)
            print(f"| {rep} | {mode} | {seconds[mode][-1]:.2f} | {sum(map(len, tokens))} |", flush=True)
    sampler.heap_temporaries = heap
    m, h = statistics.mean(seconds["mmap"]), statistics.mean(seconds["heap"])
    print(f"\nmean seconds per {what}: mmap {m:.2f}, heap {h:.2f}: heap / mmap = {h / m:.2f}")


if __name__ == "__main__":
    main()
