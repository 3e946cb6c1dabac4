"""What a shallower encoder would do to ExTra's novelty: the frozen start model's first k blocks against all of them.

    python bench/extra_encoder.py                      # SmolLM2, 16 arith prompts x 8 rollouts, depths 30,12,8,6,4
    python bench/extra_encoder.py --depths 30,6 --prompts 32

The paper uses all-MiniLM-L6-v2, a 6-block, 22M-parameter sentence encoder; extra.py embeds each rollout with the
frozen start model's first --encoder-blocks blocks, 6 by default: SmolLM2's first 6 are about MiniLM's size (21M
parameters outside the embedding table), and all 30 were extra.py's encoder before 67e1eda. For rollouts sampled as
in training (T = 0.8, 48 tokens), each depth's row gives the time to embed them (extra.embed_texts, centred on the
statements' mean as extra.py does), the median distance of a rollout to its nearest sibling (the scale of the novelty
bonus; MiniLM: about 0.20, docs/extra.md), the share of exact repeats, and the Spearman correlation of the rollouts'
nearest-sibling distances with the full depth's. Prints a markdown table.
"""
import contextlib
import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import extra  # noqa: E402
from common.config import check, main_guard, parse  # noqa: E402
from common.model import Transformer  # noqa: E402
from common.sampler import generate  # noqa: E402
from common.tasks import format_question, load_task  # noqa: E402
from common.tokenizer import Tokenizer  # noqa: E402


@dataclass
class Config:
    model: str = "smollm2"  # Hugging Face folder or smollm2
    depths: str = "30,12,8,6,4"  # encoder depths in blocks; the first is the reference (all of SmolLM2's)
    prompts: int = 16  # training prompts (extra.py's B)
    samples: int = 8  # rollouts per prompt (extra.py's G)
    seed: int = 1  # draws the prompts and the rollouts


def ranks(x: torch.Tensor) -> torch.Tensor:
    return x.flatten().argsort().argsort().float()


def main(argv=None):
    cfg = parse(Config, argv)
    try:
        depths = [int(v) for v in cfg.depths.split(",")]
    except ValueError:
        depths = []
    check(depths and all(d > 0 for d in depths), "depths", "a comma-separated list of positive block counts")
    check(cfg.prompts > 0 and cfg.samples > 1, "prompts/samples", "a positive count and at least 2 rollouts a prompt")
    model = Transformer.from_pretrained(cfg.model, device="cpu").to(torch.float32).eval().requires_grad_(False)
    check(max(depths) <= len(model.layers), "depths", f"at most the model's {len(model.layers)} blocks")
    tok = Tokenizer.from_pretrained(cfg.model)
    train = load_task("arith", "train", n=48, seed=cfg.seed)  # extra.py's default pool
    problems = [train[i % len(train)] for i in range(cfg.prompts)]
    with torch.no_grad():
        groups = generate(model, [tok.prompt(format_question(p)) for p in problems], n=cfg.samples,
                          max_new_tokens=48, temperature=0.8, stop_ids=tok.stop_ids, seed=cfg.seed)
    special = set(tok.stop_ids)  # as extra.py's main() passes it
    tails = [extra.response_tail(list(s.tokens), special, 512, 256) for g in groups for s in g]
    print(f"| blocks | seconds to embed {len(tails)} rollouts | nearest-sibling distance, median | exact repeats | "
          f"Spearman with {depths[0]} blocks |")
    print("|---|---|---|---|---|")
    reference = None
    for depth in depths:
        encoder = copy.deepcopy(model)
        encoder.layers = encoder.layers[:depth]  # the final norm still applies, as extra.embed_texts reads it
        centre = extra.statement_centre(encoder, train, tok, contextlib.nullcontext())
        t0 = time.time()
        emb = extra.embed_texts(encoder, tails, centre, tok.pad_id, contextlib.nullcontext())
        seconds = time.time() - t0
        emb = emb.view(cfg.prompts, cfg.samples, -1)
        cos = emb @ emb.transpose(1, 2)  # [B, G, G]
        cos.diagonal(dim1=1, dim2=2).fill_(-2.0)  # a rollout is not its own sibling
        nearest = 1 - cos.max(-1).values  # [B, G]
        reference = nearest if reference is None else reference
        rho = torch.corrcoef(torch.stack([ranks(reference), ranks(nearest)]))[0, 1]
        print(f"| {depth} | {seconds:.2f} | {nearest.median():.3f} | {(nearest < 1e-6).float().mean():.0%} | "
              f"{rho:.2f} |", flush=True)


if __name__ == "__main__":
    main_guard(main)
