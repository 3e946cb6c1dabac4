"""How often the start model solves each level of the arithmetic task: the measurement behind the comparison's task.

    python bench/task_rates.py                         # SmolLM2, levels 1-5, 64 questions each, 8 samples, 48 tokens
    python bench/task_rates.py --levels 2,3 --samples 16 --model DIR

For each level, sampled as in training (the training split, T = 0.8, the completion budget of the runs): the share
of questions the model solves in none of the samples (XRPO's ICL seeding and ExTra's regeneration exist for those),
pass@1, pass@k, and the share it solves every time (no gradient either). Prints a markdown table.
"""
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import check, main_guard, parse  # noqa: E402
from common.model import Transformer  # noqa: E402
from common.sampler import generate  # noqa: E402
from common.tasks import format_question, load_task  # noqa: E402
from common.tokenizer import Tokenizer  # noqa: E402
from common.verifier import score  # noqa: E402


@dataclass
class Config:
    model: str = "smollm2"  # Hugging Face folder or smollm2
    levels: str = "1,2,3,4,5"  # arithmetic levels to measure (common/tasks.py)
    questions: int = 64  # training-split questions per level
    samples: int = 8  # completions per question
    max_new_tokens: int = 48  # the algorithm files' completion budget
    temperature: float = 0.8  # the algorithm files' sampling temperature
    seed: int = 1  # draws the questions and the samples


def main(argv=None):
    cfg = parse(Config, argv)
    try:
        levels = [int(v) for v in cfg.levels.split(",")]
    except ValueError:
        levels = []
    check(levels and all(1 <= lv <= 5 for lv in levels), "levels", "a comma-separated list of 1..5")
    check(cfg.questions > 0 and cfg.samples > 0, "questions/samples", "positive integers")
    check(cfg.temperature >= 0.01 and cfg.max_new_tokens > 0, "temperature/max_new_tokens",
          "a sampling temperature >= 0.01 (the algorithm files' floor) and a positive token budget")
    model = Transformer.from_pretrained(cfg.model, device="cpu").to(torch.float32).eval()
    tok = Tokenizer.from_pretrained(cfg.model)
    print(f"| level | never solved | pass@1 | pass@{cfg.samples} | always solved | seconds |")
    print("|---|---|---|---|---|---|")
    for level in levels:
        t0 = time.time()
        problems = load_task(f"arith:{level}", "train", n=cfg.questions, seed=cfg.seed)
        with torch.no_grad():
            groups = generate(model, [tok.prompt(format_question(p)) for p in problems], n=cfg.samples,
                              max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, stop_ids=tok.stop_ids,
                              seed=cfg.seed)
        counts = [sum(score(tok.decode(s.tokens, skip_special=True), p.answer) for s in g)
                  for g, p in zip(groups, problems)]
        share = lambda hit: 100 * sum(map(hit, counts)) / len(counts)  # noqa: E731
        print(f"| {level} | {share(lambda c: c == 0):.0f}% | {100 * sum(counts) / (cfg.samples * len(counts)):.1f}% | "
              f"{share(lambda c: c > 0):.0f}% | {share(lambda c: c == cfg.samples):.0f}% | {time.time() - t0:.0f} |",
              flush=True)


if __name__ == "__main__":
    main_guard(main)
