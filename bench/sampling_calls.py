"""Where an algorithm file's sampling time goes: every generate() call of a short run, one line each.

    python bench/sampling_calls.py xrpo -- --steps 2 --eval-size 5 --dtype float32
    python bench/sampling_calls.py grpo -- --steps 2 --eval-size 5 --dtype float32
    python bench/sampling_calls.py --prefill-layouts xrpo -- --steps 3 --eval-size 5 --dtype float32

Runs `python <algo>.py <options>` in-process with the file's generate() wrapped, and prints per call: rows sampled,
distinct prompts and their longest / mean length in tokens (the prefill; a batch is left-padded to its longest),
tokens generated, the longest completion (decoding runs until it ends), and seconds. A file that samples in several
calls per step (XRPO's rounds) pays each call's prefill and its decode steps again. Evaluation calls are not wrapped.

--prefill-layouts: before each call that copies some of its prompts' keys and values from an earlier call
(generate's prompt_kv) and prefills the others, also times that prefill both ways, side by side (best of 2): the
new prompts in a layout of their own, their common start once (the sampler's way since 2026-11-30), and in the
layout of all the call's prompts, only the start all of them share once (before). The run itself is unchanged.
"""
import argparse
import importlib
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from common.config import OneLineParser, main_guard  # noqa: E402
from common import sampler  # noqa: E402


def prefill_layouts(model, prompts, counts, kv, reps=2):
    """(new prompts, their common start, all prompts' common start, {"own": s, "all": s}) for a call whose prompts
    with samples are partly in kv, or None: the best seconds of `reps` prefills of the new ones in each layout."""
    uniq = list(dict.fromkeys(tuple(p) for p, k in zip(prompts, counts) if k))
    new = [u for u in uniq if u not in kv]
    if not new or len(new) == len(uniq):
        return None
    dev = model.lm_head.weight.device
    ids, mask, shared = sampler._prompt_layout([list(u[:-1]) for u in uniq], dev)
    rows = [uniq.index(u) for u in new]
    layouts = {"own": sampler._prompt_layout([list(u[:-1]) for u in new], dev), "all": (ids[rows], mask[rows], shared)}
    best = {}
    with torch.inference_mode():
        for _ in range(reps):
            for name, (i, m, c) in layouts.items():
                cache = model.new_cache(len(new), i.shape[1])
                t0 = time.perf_counter()
                sampler.prefill(model, i, m, cache, c)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    return len(new), layouts["own"][2], shared, best


def wrap(module, layouts=False):
    real = module.generate

    def timed(model, prompts, n=1, **kw):
        counts = n if isinstance(n, list) else [n] * len(prompts)
        both = prefill_layouts(model, prompts, counts, kw["prompt_kv"]) if layouts and kw.get("prompt_kv") else None
        if both:
            k, own, common, best = both
            print(f"  prefill of the call's {k} new prompts: their own start ({own} tokens) once {best['own']:5.2f} s"
                  f" | the start of all its prompts ({common} tokens) once {best['all']:5.2f} s", flush=True)
        t0 = time.time()
        out = real(model, prompts, n=n, **kw)
        seconds = time.time() - t0
        lengths = [len(p) for p, k in zip(prompts, counts) if k]
        made = [len(s.tokens) for group in out for s in group]
        print(f"generate: {sum(counts):4d} rows | {len(lengths):3d} prompts, longest {max(lengths, default=0):4d}, "
              f"mean {sum(lengths) / max(len(lengths), 1):5.0f} tokens | {sum(made):5d} generated, longest "
              f"{max(made, default=0):3d} | {seconds:6.2f} s", flush=True)
        return out

    module.generate = timed


def main():
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-layouts", action="store_true", help="also time each partly copied call's prefill "
                        "of its new prompts both ways (see the module docstring)")
    parser.add_argument("algo", choices=["grpo", "exgrpo", "xrpo", "extra", "eapo"])
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="after --: the file's options")
    args = parser.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    module = importlib.import_module(args.algo)
    wrap(module, layouts=args.prefill_layouts)
    main_guard(lambda: module.main(rest))  # a bad option of the file: its one line, exit 2


if __name__ == "__main__":
    main()
