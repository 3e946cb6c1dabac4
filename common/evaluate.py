"""Evaluation: greedy accuracy, pass@k (unbiased) and majority@k over sampled completions.

    python -m common.evaluate --model smollm2 --data gsm8k --split test --limit 200 --samples 8
    python -m common.evaluate --model runs/grpo/checkpoint --data math500 --split all   # or --data my.jsonl

Under torchrun every rank scores its share of the problems and the counts are summed.
"""
import time
from dataclasses import dataclass

import torch

from common import dist
from common.config import check, main_guard, parse
from common.model import Transformer
from common.passk import maj_at_k_correct, pass_at_k
from common.sampler import generate
from common.tasks import format_question, load_task
from common.tokenizer import Tokenizer
from common.verifier import score


def evaluation_lost(log, step: int, cfg) -> bool:
    """A resumed run's checkpoint step was due an evaluation (every cfg.eval_every steps and after cfg.steps) that
    its metrics.jsonl lacks: the run stopped during it, after the save, so it runs again. Rank 0 holds the log
    (a MetricsLog); every rank follows its answer, since evaluate is collective."""
    due = step % cfg.eval_every == 0 or step == cfg.steps
    return due and dist.all_gather_list([step not in log.evaluated])[0]


@torch.no_grad()
def evaluate(model, tok, problems, samples=0, temperature=1.0, max_new_tokens=256, batch=150, seed=0,
             sample_batch=64, top_p=1.0) -> dict:
    """Greedy accuracy on `problems`, `batch` problems per generate call; with samples=n > 0 also pass@k for
    k = 1, 2, 4, ... n and maj@n over completions sampled at `temperature` and `top_p`, `sample_batch` problems
    (x n completions) per call; and the seconds it took (perf/eval_s). The sampled completions are seeded per
    call: the same sample_batch, the same samples."""
    was_training = model.training
    model.eval()
    t0 = time.time()
    mine = problems[dist.rank()::dist.world()]  # each rank scores a strided share; counts are summed below
    prompts = [tok.prompt(format_question(p)) for p in mine]
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if k <= samples]
    totals = torch.zeros(2 + len(ks), dtype=torch.float64)  # greedy correct, maj correct, pass@k sums
    # greedy batches of prompts of similar length: a batch is left-padded to its longest prompt
    by_length = sorted(range(len(mine)), key=lambda j: len(prompts[j]))
    for i in range(0, len(mine), batch):
        idx = by_length[i:i + batch]
        greedy = generate(model, [prompts[j] for j in idx], n=1, max_new_tokens=max_new_tokens, temperature=0.0,
                          stop_ids=tok.stop_ids)
        totals[0] += sum(score(tok.decode(g[0].tokens, skip_special=True), mine[j].answer) for g, j in zip(greedy, idx))
    for i in range(0, len(mine) if samples else 0, sample_batch):
        sampled = generate(model, prompts[i:i + sample_batch], n=samples, max_new_tokens=max_new_tokens,
                           temperature=temperature, top_p=top_p, stop_ids=tok.stop_ids, seed=seed + i)
        for group, p in zip(sampled, mine[i:i + sample_batch]):
            texts = [tok.decode(s.tokens, skip_special=True) for s in group]
            correct = sum(score(t, p.answer) for t in texts)
            totals[1] += maj_at_k_correct(texts, p.answer)
            for j, k in enumerate(ks):
                totals[2 + j] += pass_at_k(samples, int(correct), k)
    totals = dist.all_reduce_sum(totals)
    n = max(len(problems), 1)
    out = {"eval/greedy_acc": totals[0].item() / n}
    if samples:
        out[f"eval/maj@{samples}"] = totals[1].item() / n
        out.update({f"eval/pass@{k}": totals[2 + j].item() / n for j, k in enumerate(ks)})
    out["perf/eval_s"] = time.time() - t0
    model.train(was_training)
    return out


@dataclass
class Config:
    model: str = "smollm2"  # a Hugging Face model folder, a checkpoint folder, or smollm2
    data: str = "arith"  # task name (arith, gsm8k, math500, aime24, amc23) or a .jsonl file
    split: str = "test"  # test, train, or all: every problem of a file task (arith has only train and test)
    limit: int = 0  # evaluate a seeded sample of N problems, a training run's --eval-size N set at seed 0 (0 = all)
    samples: int = 0  # completions per problem for pass@k and maj@k (0 = greedy only)
    temperature: float = 1.0  # sampling temperature for pass@k / maj@k
    top_p: float = 1.0  # nucleus sampling for pass@k / maj@k (1 = off)
    max_new_tokens: int = 256  # generation budget per completion
    # 150: a default run's 300 held-out problems in two calls; a larger batch decodes faster per problem on a CPU, for
    # a KV cache of ~6 MB per prompt (0.9 GB at 150; measured in docs/benchmarks.md)
    batch: int = 150  # problems per greedy generation call
    sample_batch: int = 64  # problems per sampled generation call (x samples completions each)
    seed: int = 0  # seeds the arith task and the sampler
    device: str = "auto"  # auto, cpu or cuda


def main():
    cfg = parse(Config)
    check(cfg.limit >= 0 and cfg.samples >= 0 and cfg.batch > 0 and cfg.sample_batch > 0, "limit/samples/batch",
          "non-negative numbers, batch and sample_batch > 0")
    check(0 < cfg.top_p <= 1, "top_p", "a number in (0, 1]")
    problems = load_task(cfg.data, cfg.split, n=cfg.limit or None, seed=cfg.seed)
    device = dist.resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = Transformer.from_pretrained(cfg.model, device=device, dtype=dtype)
    tok = Tokenizer.from_pretrained(cfg.model)
    t0 = time.time()
    res = evaluate(model, tok, problems, cfg.samples, cfg.temperature, cfg.max_new_tokens, cfg.batch, cfg.seed,
                   cfg.sample_batch, cfg.top_p)
    print(f"{cfg.model} on {cfg.data}/{cfg.split} ({len(problems)} problems, {time.time() - t0:.0f}s): "
          + "  ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in res.items() if k.startswith("eval/")))


if __name__ == "__main__":
    main_guard(main)
