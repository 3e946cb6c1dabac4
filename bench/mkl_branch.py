"""MKL's default kernels against its MKL_CBWR=AUTO branch (common/memory.py sets it on CPUs not made by Intel), on
the phases of a grpo.py step: each mode in a process of its own, the two in turn.

    python bench/mkl_branch.py                    # 16 arith prompts x 1 and x 8 samples, 48 tokens; reps 2
    python bench/mkl_branch.py --reps 4 --n 1,4,8

MKL reads MKL_CBWR once, at its first call, so a mode cannot change within a process: each repetition starts one
child with `MKL_CBWR=` (empty: MKL's default, which common/memory.py then leaves alone) and one with `MKL_CBWR=AUTO`,
in an order that alternates (a drift of the machine's speed falls on both). A child loads SmolLM2-135M in fp32, then
times one sampling call per --n at T = 0.8 (the prompts x n rows, every row decoding --max-new-tokens tokens: no
stop token, so both modes do the same work), a training pass over the last call's completions (forward and
backward, micro-batches of 8, as grpo.py's update) and a greedy call of --greedy held-out prompts, 64 tokens (an
evaluation's batch). The table gives each child's seconds and each mode's mean, then AUTO's mean over the default's.
"""
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from common.config import OneLineParser  # noqa: E402  (a user mistake: one line, exit 2)

CHILD = """
import json, sys, time
import torch
sys.path.insert(0, {repo!r})
sys.path.append({repo!r} + "/bench")  # after the repo: bench/kernels.py is not the kernels package
from common.batch import to_batch
from common.model import Transformer
from common.sampler import generate
from common.tasks import format_question, load_task
from common.tokenizer import Tokenizer
from sampler_heap import train_pass
model = Transformer.from_pretrained({model!r}, dtype=torch.float32).eval()
tok = Tokenizer.from_pretrained({model!r})
problems = load_task("arith", "train", n={prompts}, seed=0)
prompts = [tok.prompt(format_question(p)) for p in problems]
out = {{}}
generate(model, prompts[:2], n=1, max_new_tokens=4, stop_ids=(), seed=0)  # first-call costs, in neither timing
for n in {ns!r}:
    t = time.perf_counter()
    groups = generate(model, prompts, n=n, max_new_tokens={tokens}, temperature=0.8, stop_ids=(), seed=0)
    out[f"sample {{len(prompts) * n}} rows"] = time.perf_counter() - t
batch = to_batch(prompts, groups, [p.answer for p in problems], group_ids=range(len(prompts)))
t = time.perf_counter()
train_pass(model.train(), batch, tok.pad_id)
out[f"train {{len(batch.tokens)}} completions"] = time.perf_counter() - t
model.eval()
held = [tok.prompt(format_question(p)) for p in load_task("arith", "test", n={greedy}, seed=0)]
t = time.perf_counter()
generate(model, held, n=1, max_new_tokens=64, temperature=0, stop_ids=(), seed=0)
out[f"greedy {{len(held)}} rows"] = time.perf_counter() - t
print("RESULT", json.dumps(out))
"""

def child(mode: str, args) -> dict:
    code = CHILD.format(repo=str(REPO), model=args.model, prompts=args.prompts, ns=args.ns, tokens=args.max_new_tokens,
                        greedy=args.greedy)
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MKL_CBWR": mode}, capture_output=True,
                       text=True)
    if r.returncode:
        sys.exit(f"bench/mkl_branch.py: the child with MKL_CBWR={mode!r} failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main():
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", default="1,8", help="samples per prompt, one sampling call each; the last one is trained")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--greedy", type=int, default=150, help="held-out prompts of the greedy call (an evaluation's)")
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    try:
        args.ns = [int(n) for n in args.n.split(",")]
    except ValueError:
        args.ns = []
    if not args.ns or min(args.ns + [args.prompts, args.max_new_tokens, args.greedy, args.reps]) < 1:
        p.error("expected --n as positive integers (e.g. 1,8) and --prompts, --max-new-tokens, --greedy, --reps >= 1")
    modes = {"": "MKL's default", "AUTO": "MKL_CBWR=AUTO"}
    runs = []  # (mode, rep, {what: seconds})
    for rep in range(args.reps):
        for mode in ("", "AUTO") if rep % 2 == 0 else ("AUTO", ""):
            t = time.time()
            runs.append((mode, rep, child(mode, args)))
            print(f"rep {rep} {modes[mode]}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    whats = list(runs[0][2])
    print("| mode | rep | " + " | ".join(f"{w} (s)" for w in whats) + " |")
    print("|---|---|" + "---|" * len(whats))
    for mode, rep, out in runs:
        print(f"| {modes[mode]} | {rep} | " + " | ".join(f"{out[w]:.2f}" for w in whats) + " |")
    means = {m: [statistics.mean(o[w] for mm, _, o in runs if mm == m) for w in whats] for m in modes}
    for m in modes:
        print(f"| {modes[m]} | mean | " + " | ".join(f"{v:.2f}" for v in means[m]) + " |")
    print("| AUTO / default | | " + " | ".join(f"{a / d:.2f}" for a, d in zip(means["AUTO"], means[""])) + " |")


if __name__ == "__main__":
    main()
