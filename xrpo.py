"""XRPO (eXplore-eXploit GRPO, arXiv 2510.06672): GRPO with adaptive rollout allocation, in-context seeding of
unsolved prompts and novelty-guided advantage sharpening. (Components only; the loop follows grpo.py.)
"""
import functools
import math
from dataclasses import dataclass, field

import torch

from common.embed import embed


# ------------------------------------------------------------ hierarchical rollout planning (XRPO §3.2, eqs 1-3)

def _t_central(theta: float, dof: int) -> float:
    """P(|T| <= sqrt(dof) tan(theta)) for Student's t with integer dof: the exact finite sums of
    Abramowitz & Stegun 26.7.3-4 (no special functions needed for whole degrees of freedom)."""
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if dof % 2 == 0:  # sin θ (1 + 1/2 cos²θ + 1·3/(2·4) cos⁴θ + ... up to cos^(ν-2)θ)
        term = total = 1.0
        for k in range(2, dof, 2):
            term *= c2 * (k - 1) / k
            total += term
        return s * total
    total = 0.0  # odd: 2/π (θ + sin θ (cos θ + 2/3 cos³θ + 2·4/(3·5) cos⁵θ + ... up to cos^(ν-2)θ))
    if dof > 1:
        term = total = math.cos(theta)
        for k in range(3, dof - 1, 2):
            term *= c2 * (k - 1) / k
            total += term
    return 2 / math.pi * (theta + s * total)


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, dof: int) -> float:
    """Student-t quantile t_{p,ν} (integer ν >= 1), without scipy: bisect θ = atan(t/√ν) on the exact CDF."""
    if p < 0.5:
        return -t_quantile(1 - p, dof)
    target, lo, hi = 2 * p - 1, 0.0, math.pi / 2  # P(|T| <= t) = 2p - 1, increasing in θ
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_central(mid, dof) < target else (lo, mid)
    return math.sqrt(dof) * math.tan((lo + hi) / 2)


def ci_shrink(s: float, n: int, conf: float) -> float:
    """Δ_q (eq. 2): how much one more rollout narrows the Student-t confidence interval of the prompt's mean
    reward, holding its std s fixed. 0 for s = 0, and for n < 2, where the interval is undefined."""
    if s == 0 or n < 2:
        return 0.0
    p = (1 + conf) / 2  # two-sided interval at confidence `conf`: the 1 - α/2 quantile
    return s * (t_quantile(p, n - 1) / math.sqrt(n) - t_quantile(p, n) / math.sqrt(n + 1))


def explore_bonus(lam: float, round_budget: int, n: int) -> float:
    """φ_q (§3.2): λ √(ln(1 + T) / n_q), T = rollouts allocated in this round. Natural log: our choice (the
    paper writes log without a base)."""
    return lam * math.sqrt(math.log(1 + round_budget) / n)


def priorities(rewards: list[list[float]], round_budget: int, lam: float, conf: float, extra=None) -> list[float]:
    """Π_q = Δ_q + φ_q (eq. 3) per prompt from its rewards so far; `extra[q]` units already planned this round
    count in n_q (the greedy reading) while s_q stays that of the rewards seen."""
    out = []
    for q, r in enumerate(rewards):
        n = len(r) + (extra[q] if extra else 0)
        s = torch.tensor(r, dtype=torch.float64).std().item() if len(r) > 1 else 0.0  # unbiased (ddof = 1)
        out.append(ci_shrink(s, n, conf) + explore_bonus(lam, round_budget, n))
    return out


def allocate(rewards: list[list[float]], budget: int, lam: float, conf: float, greedy: bool = False) -> list[int]:
    """Split one round's `budget` rollouts over the prompts (§3.2), given each prompt's rewards so far.

    proportional (default): shares T·Π_q/ΣΠ, made integers by largest remainder (our choice: the paper only says
      "in proportion to its current priority score"): floors first, then the leftover units to the largest
      fractional parts, ties to the higher Π, then the lower prompt index. The sum is exactly T.
    greedy: one unit at a time to the highest Π, recomputed with n_q + 1 after each unit (eq. 3 read as "the
      priority for the next rollout"); ties to the lower index."""
    B = len(rewards)
    if greedy:
        got = [0] * B
        for _ in range(budget):
            pri = priorities(rewards, budget, lam, conf, extra=got)
            got[max(range(B), key=lambda q: (pri[q], -q))] += 1
        return got
    pri = priorities(rewards, budget, lam, conf)
    total = sum(pri)
    # our choice: with λ = 0 and no prompt varying, nothing ranks the prompts: split evenly
    shares = [budget * p / total for p in pri] if total > 0 else [budget / B] * B
    got = [math.floor(x) for x in shares]
    order = sorted(range(B), key=lambda q: (-(shares[q] - got[q]), -pri[q], q))
    for q in order[:max(budget - sum(got), 0)]:
        got[q] += 1
    assert sum(got) == budget, (got, budget)
    return got


def round_budgets(dynamic: int, rounds: int) -> list[int]:
    """The per-round budgets T of the dynamic rollouts: equal, the remainder in the last round."""
    if rounds == 0:
        return []
    return [dynamic // rounds] * (rounds - 1) + [dynamic - dynamic // rounds * (rounds - 1)]


# ---------------------------------------------------------------------- ICL seeding (XRPO §3.2, App. C)

# The layout and tags of App. C; the wording is ours.
ICL_TASK = ("Below are worked examples, each a <problem> with its <solution>. Work out the general strategy they "
            "use, reason through the new problem with it, and write out a detailed solution. "
            "Put your final answer within \\boxed{}.")


def icl_question(problem: str, exemplars: list[tuple[str, str]]) -> str:
    """The user message of an in-context prompt (App. C): the task, up to K numbered examples, the new problem."""
    examples = "\n".join(f'<example id="{i}">\n<problem>{p}</problem>\n<solution>{s}</solution>\n</example>'
                         for i, (p, s) in enumerate(exemplars, 1))
    return f"<task>\n{ICL_TASK}\n</task>\n\n<examples>\n{examples}\n</examples>\n\n<new_problem>{problem}</new_problem>"


def truncate_solution(tok, text: str, n_tokens: int) -> str:
    """At most about n_tokens tokens of a solution: its head, and its final \\boxed answer when that fits in half
    the budget (App. C truncates over-long exemplars; keeping the answer is our choice: the answer is the part a
    worked example cannot do without)."""
    ids = tok.encode(text)
    if len(ids) <= n_tokens:
        return text
    cut = text.rfind("\\boxed")
    tail = text[cut:] if cut >= 0 else ""
    tail_len = len(tok.encode(tail)) if tail else 0
    if not tail or tail_len > n_tokens // 2:
        return tok.decode(ids[:n_tokens]) + " ..."
    return tok.decode(ids[:n_tokens - tail_len]) + " ... " + tail


def icl_prompt(tok, problem: str, exemplars: list[tuple[str, str]], max_len: int, min_solution: int = 16):
    """Token ids of the in-context prompt for `problem`, at most max_len tokens, or None when no exemplar fits
    (the caller then samples from the plain prompt, App. C). Over-long: every exemplar solution is cut to the
    same, shrinking, token budget before the last exemplar is dropped (our choice: two shortened examples
    teach more than one whole one)."""
    exemplars = list(exemplars)
    while exemplars:
        cap = max(len(tok.encode(s)) for _, s in exemplars)
        while True:
            shown = [(p, truncate_solution(tok, s, cap)) for p, s in exemplars]
            ids = tok.prompt(icl_question(problem, shown))
            if len(ids) <= max_len:
                return ids
            if cap <= min_solution:
                break
            cap = max(min_solution, cap * 3 // 4)
        exemplars.pop()
    return None


def solution_text(completion: str) -> str:
    """What the corpus stores of a correct rollout: the answer-bearing part after a thinking block, if any
    (our choice: the paper's stored solutions, ~900 tokens, are far shorter than its ~13k-token responses)."""
    return completion.rsplit("</think>", 1)[-1].strip()


def round_contexts(tok, problems: list[str], plain: list[list[int]], correct: list[list[float]], alloc: list[int],
                   corpus, k: int, max_len: int, icl: bool = True) -> list[tuple[list[int], bool]]:
    """Each prompt's context for this round's rollouts and whether it is an in-context one (Alg. 1 lines 11-13):
    a prompt none of whose rollouts so far is correct is seeded with up to k solved neighbours; otherwise, or when
    nothing can be retrieved or nothing fits, the plain prompt (zero-shot fallback, App. C)."""
    out = []
    for q, problem in enumerate(problems):
        ids = None
        if icl and alloc[q] > 0 and not any(c == 1 for c in correct[q]):
            shots = corpus.exemplars(problem, k)
            ids = icl_prompt(tok, problem, shots, max_len) if shots else None
        out.append((plain[q], False) if ids is None else (ids, True))
    return out


def update_corpus(corpus, problems: list[str], texts: list[list[str]], correct: list[list[float]]):
    """Alg. 1 line 18: every rollout with full reward becomes a stored solution of its own problem (ICL-seeded ones
    included: they solve q)."""
    for problem, ts, cs in zip(problems, texts, correct):
        for t, c in zip(ts, cs):
            if c == 1:
                corpus.add(problem, t)


@dataclass
class Corpus:
    """The evolving ICL corpus (§3.2, Alg. 1 line 18): verified solutions of the run's own correct rollouts, by
    problem statement, and the statements' embeddings for the neighbour search."""
    per_problem: int = 4  # solutions kept per problem, most recent last (our choice: the paper never prunes)
    solutions: dict = field(default_factory=dict)  # statement -> list of solution texts
    vectors: dict = field(default_factory=dict)  # statement -> unit embedding [d] (fp32, CPU)

    def add(self, problem: str, completion: str):
        kept = self.solutions.setdefault(problem, [])
        kept.append(solution_text(completion))
        del kept[:-self.per_problem]

    def size(self) -> int:
        return sum(len(v) for v in self.solutions.values())

    def embed_new(self, model, tok, problems: list[str], batch: int = 32):
        """Embed statements not seen yet. Called with the frozen initial weights, this gives the same vectors as
        embedding the whole training set once at start (the paper's offline index) at the cost of only the
        problems a run visits."""
        new = list(dict.fromkeys(p for p in problems if p not in self.vectors))
        if new:
            vecs = embed(model, [tok.encode(p) for p in new], batch=batch, pad_id=tok.pad_id).cpu()
            self.vectors.update(zip(new, vecs))

    def neighbours(self, problem: str, k: int) -> list[str]:
        """The k most similar (cosine) other problems with a stored solution. The problem itself and identical
        statements are excluded (our choice: ICL transfers across problems, §3.2; replay is a different method)."""
        cands = [p for p in self.solutions if p != problem and self.solutions[p]]
        if not cands or k <= 0 or problem not in self.vectors:
            return []
        sims = torch.stack([self.vectors[p] for p in cands]) @ self.vectors[problem]  # [n]
        order = sorted(range(len(cands)), key=lambda i: (-sims[i].item(), i))  # ties: older entries first
        return [cands[i] for i in order[:k]]

    def exemplars(self, problem: str, k: int) -> list[tuple[str, str]]:
        """Up to k (neighbour statement, its most recent verified solution) pairs."""
        return [(p, self.solutions[p][-1]) for p in self.neighbours(problem, k)]

    def state_dict(self) -> dict:
        return {"solutions": self.solutions, "vectors": self.vectors}

    def load_state_dict(self, state: dict):
        self.solutions = {p: list(v) for p, v in state["solutions"].items()}
        self.vectors = dict(state["vectors"])


# ---------------------------------------------------- novelty-guided advantage sharpening (XRPO §3.3, eqs 4-6)

def sequence_scores(token_logp: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """s(y) (eq. 4): each rollout's mean token log-prob. token_logp [sum(lengths)] flat, lengths [N] -> [N]."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    sums = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, seq, token_logp.double())
    return (sums / lengths.clamp(min=1)).float()


def sharpen(adv, correct, score, group, lam_nov: float, kappa: float, all_correct_cap: bool = False):
    """A⁺ (eq. 6) for every rollout, and the bonus added. adv, correct, score, group: [N] (group = group id).

    η_i = exp(s_i - s̄) with s̄ the mean score of ALL rollouts of i's group (eq. 5 averages over the N sampled
    rollouts). Only correct rollouts get min(max(λ_nov (1 - η_i), 0), κ A_i). Taken literally, an all-correct
    group (A = 0) gets no bonus; all_correct_cap (our option) caps those at κ instead, for the paper's remark
    that degenerate groups gain signal (§3.3)."""
    n_groups = int(group.max()) + 1 if len(group) else 0
    sums = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, score.double())
    counts = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, torch.ones_like(score, dtype=torch.float64))
    mean = (sums / counts)[group]  # s̄ of each rollout's group
    eta = torch.exp(score.double() - mean)
    cap = kappa * adv.double()
    if all_correct_cap:
        n_correct = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, correct.double())
        cap = torch.where((n_correct == counts)[group], torch.full_like(cap, kappa), cap)
    # clamp at 0: our choice. With binary rewards a correct rollout's A is >= 0 anyway; only the optional format
    # term can give one A < 0, and then the literal cap κA would turn the bonus into a penalty
    bonus = torch.minimum((lam_nov * (1 - eta)).clamp(min=0), cap).clamp(min=0)
    bonus = torch.where(correct.bool(), bonus, torch.zeros_like(bonus)).to(adv.dtype)
    return adv + bonus, bonus
