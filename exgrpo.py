"""ExGRPO: learning to reason from the policy's own successful experience (arXiv 2510.02245).

(The training loop is added once grpo.py's new skeleton lands; the ExGRPO parts are below.)
"""
import math
from dataclasses import dataclass

import torch


# ----------------------------------------------------------------------------- the experience buffer

@dataclass
class Trajectory:
    tokens: tuple  # the completion's token ids, the stop token included (replayed verbatim)
    logp: torch.Tensor  # [len(tokens)] fp32: log π_θold of each token, the trainer's forward at collection time


class Experience:
    """ExGRPO §4.1: the replay buffer E (question id -> its distinct correct trajectories), the bucket label of
    each question (its latest group success count k), and the retired set S (questions solved by every rollout).

    Trajectories are kept as token ids with the log-probs the trainer computed when they were collected, so a
    replayed completion is exactly what was sampled and its importance weight has the right denominator.
    # our choice: token ids, not decoded text (re-tokenising text need not give back the same tokens)."""

    def __init__(self, group_size: int):
        self.K = group_size
        self.pool: dict[int, list[Trajectory]] = {}  # E
        self.bucket: dict[int, int] = {}  # question id -> success count k of its latest collected group
        self.retired: set[int] = set()  # S

    def record(self, qid: int, correct: list[bool], completions: list, logps: list, collect: bool):
        """One group's outcome (Alg. 1 l.25-32): all K correct retires the question (from step 1 on);
        with `collect` (after the delayed start), 0 < k < K stores each correct completion not stored yet
        and sets the bucket label. All-wrong groups store nothing and keep their old label (and are not retired)."""
        k = sum(bool(c) for c in correct)
        if k == self.K:
            self.retired.add(qid)
            return
        if not collect or k == 0:
            return
        self.bucket[qid] = k
        stored = self.pool.setdefault(qid, [])
        seen = {t.tokens for t in stored}
        for ok, tokens, logp in zip(correct, completions, logps):
            tokens = tuple(tokens)
            if ok and tokens not in seen:  # de-duplicated by exact token content
                assert len(logp) == len(tokens), "one collection-time log-prob per token"
                stored.append(Trajectory(tokens, logp.detach().float().cpu().clone()))
                seen.add(tokens)

    def purge(self):
        """After each step: retired questions leave the buffer and the buckets (Alg. 1 l.32)."""
        for qid in self.retired:
            self.pool.pop(qid, None)
            self.bucket.pop(qid, None)

    def valid(self) -> list[int]:
        """E_valid: questions that can be replayed (not retired, at least one stored trajectory), sorted."""
        return sorted(q for q, ts in self.pool.items() if ts and q not in self.retired and q in self.bucket)

    def buckets(self) -> dict[int, list[int]]:
        """k -> the valid question ids labelled k (k = 1 .. K-1)."""
        out = {k: [] for k in range(1, self.K)}
        for q in self.valid():
            out[self.bucket[q]].append(q)
        return out

    def n_trajectories(self) -> int:
        return sum(len(ts) for ts in self.pool.values())

    def state_dict(self) -> dict:
        return {"pool": {q: [(list(t.tokens), t.logp) for t in ts] for q, ts in self.pool.items()},
                "bucket": dict(self.bucket), "retired": sorted(self.retired)}

    def load_state_dict(self, state: dict):
        self.pool = {int(q): [Trajectory(tuple(toks), logp) for toks, logp in ts] for q, ts in state["pool"].items()}
        self.bucket = {int(q): int(k) for q, k in state["bucket"].items()}
        self.retired = set(int(q) for q in state["retired"])


# ----------------------------------------------------------------------------- which questions to replay

def bucket_weights(K: int, method: str = "normal", sigma: float = 1.0) -> torch.Tensor:
    """Unnormalised preference w_k for the buckets k = 1 .. K-1 (ExGRPO §4.1, Alg. 2), [K-1] float64.

    normal:     N(k; K/2, σ) in success-count units, as the authors' code does (σ = 1 puts ~40% on k = K/2)
    normal-acc: N(k/K; 0.5, σ) in accuracy units, as the paper's formula reads (σ = 1 is nearly uniform)
    linear, sqrt: k/K and sqrt(k/K) (prefer easier questions); uniform: every bucket alike."""
    k = torch.arange(1, K, dtype=torch.float64)
    if method == "normal":
        return torch.exp(-0.5 * ((k - K / 2) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
    if method == "normal-acc":
        return torch.exp(-0.5 * ((k / K - 0.5) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
    if method == "linear":
        return k / K
    if method == "sqrt":
        return (k / K).sqrt()
    if method == "uniform":
        return torch.ones_like(k)
    raise ValueError(f"bucket_weights: unknown method {method!r}")


def bucket_probs(weights: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """p_k = w_k / Σ_{non-empty k'} w_k' and 0 for an empty bucket. weights, sizes: [K-1]."""
    w = weights * (torch.tensor(sizes) > 0)
    return w / w.sum() if w.sum() > 0 else w


def replay_count(rho: float, B: int, n_valid: int) -> int:
    """n = min(⌊ρB⌋, |E_valid|) replayed questions in a batch of B (ExGRPO §4.2); the other B - n are fresh."""
    return min(math.floor(rho * B + 1e-9), n_valid)  # the epsilon: 0.3 * 10 is 2.9999999999999996 in floats


def bucket_sample(buckets: dict[int, list[int]], n: int, weights: torch.Tensor, gen: torch.Generator) -> list[int]:
    """n distinct question ids (ExGRPO Alg. 2): bucket counts c ~ Multinomial(n, p); a bucket asked for more
    than it holds gives its overflow back one unit at a time to the buckets with room left, chosen ∝ p among
    them; then c_k ids are drawn uniformly without replacement inside bucket k."""
    ks = sorted(buckets)
    sizes = [len(buckets[k]) for k in ks]
    n = min(n, sum(sizes))
    if n == 0:
        return []
    p = bucket_probs(weights, sizes)
    counts = torch.bincount(torch.multinomial(p, n, replacement=True, generator=gen), minlength=len(ks)).tolist()
    overflow = sum(max(c - s, 0) for c, s in zip(counts, sizes))
    counts = [min(c, s) for c, s in zip(counts, sizes)]
    for _ in range(overflow):
        room = torch.tensor([c < s for c, s in zip(counts, sizes)])
        q = p * room
        # our choice: if every bucket with room has weight 0 in float64 (a far Gaussian tail), fall back to uniform
        q = q if q.sum() > 0 else room.double()
        counts[int(torch.multinomial(q, 1, generator=gen))] += 1
    ids = []
    for k, c in zip(ks, counts):
        pick = torch.randperm(len(buckets[k]), generator=gen)[:c].tolist()
        ids += [buckets[k][i] for i in pick]
    return ids


# ----------------------------------------------------------------------------- which trajectory to replay

@torch.no_grad()
def trajectory_scores(model, prompts: list, candidates: list, pad_id: int, micro_batch: int, how: str = "mean"):
    """Mean token entropy H̄(o) = (1/|o|) Σ_t H(π_θ(·|q, o_<t)) of each candidate under the current policy at
    T = 1 (ExGRPO §3.2), over the completion tokens only. how="sum": Σ_t H instead (no length division).
    prompts[i]: the prompt of candidate i (token ids); candidates[i]: its completion. Returns [len(candidates)]."""
    out = []
    for s in range(0, len(candidates), micro_batch):
        ps, cs = prompts[s:s + micro_batch], candidates[s:s + micro_batch]
        ids, mask = pad_batch(ps, cs, pad_id)
        dev = next(model.parameters()).device
        _, entropy = model(ids[:, :-1].to(dev), targets=ids[:, 1:].to(dev), target_mask=mask.to(dev), temperature=1.0)
        for h in entropy.float().cpu().split([len(c) for c in cs]):
            out.append(h.sum() / (len(h) if how == "mean" else 1))
    return torch.stack(out) if out else torch.zeros(0)


def select_trajectories(model, exp: Experience, qids: list[int], prompts: list, pad_id: int, micro_batch: int,
                        how: str = "mean") -> list[Trajectory]:
    """For each drawn question, o* = the stored trajectory with the lowest H̄ under the current policy
    (ExGRPO §3.2, §4.1), recomputed every time the question is drawn. prompts[j]: question qids[j]'s prompt."""
    cands = [(j, t) for j, q in enumerate(qids) for t in exp.pool[q]]
    scores = trajectory_scores(model, [prompts[j] for j, _ in cands], [list(t.tokens) for _, t in cands],
                               pad_id, micro_batch, how)
    best: dict[int, tuple] = {}
    for (j, t), h in zip(cands, scores.tolist()):
        if j not in best or h < best[j][0]:  # ties: the earlier-stored trajectory
            best[j] = (h, t)
    return [best[j][1] for j in range(len(qids))]


def pad_batch(prompts, completions, pad_id):
    """Right-padded prompt+completion ids [N, T] and the mask [N, T-1] of positions predicting a completion token."""
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T - 1, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, : len(p) + len(c)] = torch.tensor(list(p) + list(c))
        mask[i, len(p) - 1: len(p) - 1 + len(c)] = True
    return ids, mask


# ----------------------------------------------------------------------------- when replay starts

def delayed_start(mixed: bool, batch_acc: float, threshold: float) -> bool:
    """ExGRPO §4.2: mixed-policy training switches on after the first step whose batch accuracy (mean reward
    over all B·K rollouts) is strictly above the threshold, and never switches back."""
    return mixed or batch_acc > threshold


def shaping(w: torch.Tensor, beta: float) -> torch.Tensor:
    """f(w) = w / (w + β): the replayed tokens' importance weight, reshaped (ExGRPO §4.2, eq. 4)."""
    return w / (w + beta)


# ----------------------------------------------------------------------------- fresh questions

class QuestionStream:
    """The fresh questions, B per step, walking a seeded permutation of the training set each epoch. At each
    epoch start the retired questions leave it, unless fewer than B + 20 questions would remain (as in the
    authors' sampler). Without retirement it is grpo.py's step_prompts exactly.
    state: (epoch, this epoch's order, position), saved in the checkpoint."""

    def __init__(self, ids: list[int], B: int, seed: int):
        self.ids, self.B, self.seed = list(ids), B, seed
        self.epoch, self.order, self.pos = -1, [], 0

    def next(self, retired: set) -> list[int]:
        out = []
        while len(out) < self.B:
            if self.pos == len(self.order):
                self.new_epoch(retired)
            out.append(self.order[self.pos])
            self.pos += 1
        return out

    def new_epoch(self, retired: set):
        self.epoch, self.pos = self.epoch + 1, 0
        active = [q for q in self.ids if q not in retired]
        active = active if len(active) > self.B + 20 else self.ids
        perm = torch.randperm(len(active), generator=torch.Generator().manual_seed(self.seed * 7919 + self.epoch))
        self.order = [active[int(i)] for i in perm]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "order": list(self.order), "pos": self.pos}

    def load_state_dict(self, s: dict):
        self.epoch, self.order, self.pos = s["epoch"], list(s["order"]), s["pos"]
