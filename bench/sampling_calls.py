"""Where an algorithm file's sampling time goes: every generate() call of a short run, one line each.

    python bench/sampling_calls.py xrpo -- --steps 2 --eval-size 5 --dtype float32
    python bench/sampling_calls.py grpo -- --steps 2 --eval-size 5 --dtype float32

Runs `python <algo>.py <options>` in-process with the file's generate() wrapped, and prints per call: rows sampled,
distinct prompts and their longest / mean length in tokens (the prefill; a batch is left-padded to its longest),
tokens generated, the longest completion (decoding runs until it ends), and seconds. A file that samples in several
calls per step (XRPO's rounds) pays each call's prefill and its decode steps again. Evaluation calls are not wrapped.
"""
import argparse
import importlib
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from common.config import OneLineParser, main_guard  # noqa: E402


def wrap(module):
    real = module.generate

    def timed(model, prompts, n=1, **kw):
        t0 = time.time()
        out = real(model, prompts, n=n, **kw)
        seconds = time.time() - t0
        counts = n if isinstance(n, list) else [n] * len(prompts)
        lengths = [len(p) for p, k in zip(prompts, counts) if k]
        made = [len(s.tokens) for group in out for s in group]
        print(f"generate: {sum(counts):4d} rows | {len(lengths):3d} prompts, longest {max(lengths, default=0):4d}, "
              f"mean {sum(lengths) / max(len(lengths), 1):5.0f} tokens | {sum(made):5d} generated, longest "
              f"{max(made, default=0):3d} | {seconds:6.2f} s", flush=True)
        return out

    module.generate = timed


def main():
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("algo", choices=["grpo", "exgrpo", "xrpo", "extra", "eapo"])
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="after --: the file's options")
    args = parser.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    module = importlib.import_module(args.algo)
    wrap(module)
    main_guard(lambda: module.main(rest))  # a bad option of the file: its one line, exit 2


if __name__ == "__main__":
    main()
