"""One step's completions as a flat batch, and the trainer's forward over it.

    b = to_batch(contexts, generate(model, contexts, n=8, ...), answers, group_ids=range(len(contexts)))
    logp, entropy = trainer_logprobs(model, b, micro_batch=16, temperature=0.8, pad_id=tok.pad_id, device=dev,
                                     autocast=autocast)              # every completion token, flat [n_tok], no grad
    logp, entropy, pos = completion_logprobs(model, b, idx, 0.8, tok.pad_id, dev)   # completions idx, with grad

Every algorithm file builds its step on this: completion i was sampled from context[i] (a prompt, an in-context
prompt, a prompt plus a given prefix...), belongs to group[i] (advantages are relative within a group; groups
may differ in size), and its first skip[i] tokens were given rather than sampled, so they get no loss. Per-token
values live in flat [n_tok] tensors over all completion tokens, completion after completion.
"""
import itertools
import math
from dataclasses import dataclass

import torch

from common.memory import release_free_memory


@dataclass
class Batch:
    """One step's completions, flat (CleanRL's `b_` batch)."""
    context: list  # [N] token ids each completion is conditioned on
    tokens: list  # [N] completion token ids, the stop token included when one was hit
    group: torch.Tensor  # [N] long: advantages are relative within a group; groups may differ in size
    skip: torch.Tensor  # [N] long: leading completion tokens excluded from the loss and every denominator
    sampler_logp: torch.Tensor  # [n_tok] the sampler's log-probs of every completion token, flat
    finished: torch.Tensor  # [N] bool: a stop token ended the completion (False: cut at max_new_tokens)
    answer: list  # [N] the reference answer each completion is graded against
    sampler_entropy: torch.Tensor | None = None  # [n_tok] the entropy of the sampler's distribution at each token

    @property
    def lengths(self) -> torch.Tensor:  # [N] completion tokens
        return torch.tensor([len(t) for t in self.tokens], dtype=torch.long)

    def train_mask(self) -> torch.Tensor:  # [n_tok] bool: the completion tokens that get a loss
        return torch.cat([torch.zeros(0, dtype=torch.bool)] +
                         [torch.arange(n) >= k for n, k in zip(self.lengths.tolist(), self.skip.tolist())])

    def select(self, keep: torch.Tensor) -> "Batch":
        """The completions where keep [N] is True, in order."""
        idx, tok = keep.nonzero()[:, 0].tolist(), keep.repeat_interleave(self.lengths)
        return Batch([self.context[i] for i in idx], [self.tokens[i] for i in idx], self.group[keep], self.skip[keep],
                     self.sampler_logp[tok], self.finished[keep], [self.answer[i] for i in idx],
                     None if self.sampler_entropy is None else self.sampler_entropy[tok])


def concat(a: Batch, b: Batch) -> Batch:
    """The completions of a, then those of b (group ids as they are: keep them distinct)."""
    both = a.sampler_entropy is not None and b.sampler_entropy is not None
    return Batch(a.context + b.context, a.tokens + b.tokens, torch.cat([a.group, b.group]), torch.cat([a.skip, b.skip]),
                 torch.cat([a.sampler_logp, b.sampler_logp]), torch.cat([a.finished, b.finished]), a.answer + b.answer,
                 torch.cat([a.sampler_entropy, b.sampler_entropy]) if both else None)


def to_batch(contexts, groups, answers, group_ids) -> Batch:
    """generate()'s nested output (one list of samples per context) -> a flat Batch. answers and group_ids give
    one value per context; a sample's given prefix (Sample.prefix_len) is excluded from the loss."""
    rows = [(c, s, a, g) for c, ss, a, g in zip(contexts, groups, answers, group_ids) for s in ss]
    return Batch(context=[c for c, _, _, _ in rows], tokens=[s.tokens for _, s, _, _ in rows],
                 group=torch.tensor([g for _, _, _, g in rows], dtype=torch.long),
                 skip=torch.tensor([s.prefix_len for _, s, _, _ in rows], dtype=torch.long),
                 sampler_logp=torch.cat([torch.zeros(0)] + [s.logprobs.float().cpu() for _, s, _, _ in rows]),
                 finished=torch.tensor([s.finished for _, s, _, _ in rows], dtype=torch.bool),
                 answer=[a for _, _, a, _ in rows],
                 sampler_entropy=torch.cat([torch.zeros(0)] + [s.entropies.float().cpu() for _, s, _, _ in rows]))


def varied_share(group: torch.Tensor, rewards: torch.Tensor) -> float:
    """The share of completions whose group's rewards are not all equal: those with a non-zero group-relative
    advantage, so a gradient (what XRPO's allocation and ExGRPO's replay aim to raise)."""
    if len(group) == 0:
        return 0.0
    _, inverse = group.unique(return_inverse=True)
    n = int(inverse.max()) + 1
    r = rewards.double()
    lo = torch.full((n,), math.inf, dtype=torch.float64).scatter_reduce(0, inverse, r, "amin")
    hi = torch.full((n,), -math.inf, dtype=torch.float64).scatter_reduce(0, inverse, r, "amax")
    return (hi > lo)[inverse].double().mean().item()


def token_index(lengths: torch.Tensor, idx) -> torch.Tensor:
    """Positions in the flat [n_tok] arrays of the tokens of completions idx, completion after completion."""
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.cat([torch.zeros(0, dtype=torch.long)] +
                     [torch.arange(int(offsets[i]), int(offsets[i] + lengths[i])) for i in idx])


def micro_batches(idx: list, group: torch.Tensor, size: int) -> list[list]:
    """The completions idx (in batch order) cut into micro-batches of at most `size`, each group whole where it
    fits: a micro-batch then holds few distinct contexts and its packed rows little padding (groups of unequal size,
    as XRPO's, would otherwise straddle the cuts). A group larger than `size` fills micro-batches of its own first.
    Gradient accumulation sums every micro-batch, so where the cuts fall changes no gradient; groups of `size`
    each (grpo.py's) are cut exactly as fixed chunks of `size` would be."""
    out, current = [], []
    for _, members in itertools.groupby(idx, key=lambda i: int(group[i])):
        members = list(members)
        if current and len(current) + len(members) > size:
            out.append(current)
            current = []
        while len(members) > size:
            out.append(members[:size])
            members = members[size:]
        current += members
    return out + ([current] if current else [])


def first_fit(sizes: list, capacity: int) -> list[list]:
    """Bins of at most `capacity`, first fit, largest first: the indices of the sizes in each bin."""
    bins, room = [], []
    for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        b = next((b for b in range(len(bins)) if room[b] >= sizes[k]), None)
        if b is None:
            bins.append([])
            room.append(capacity)
            b = len(bins) - 1
        bins[b].append(k)
        room[b] -= sizes[k]
    return bins


# Most tokens in one packed block (a context and its completions, one row whose attention mask is [T, T]); a
# single longer completion still gets a block of its own.
MAX_PACKED_TOKENS = 2048


def pack_inputs(contexts, completions, skip, pad_id):
    """Completions that share a context go into one block after a single copy of it (shared-prefix training: the
    prompt's states are computed once per group instead of once per completion, and its gradient is the sum).

    A block is context[:-1], then for each completion a segment [context[-1], *completion] whose tokens see the
    shared part and the earlier tokens of their own segment only, at the positions they would have alone; the
    context's last token is repeated so that each segment predicts its own first token. Blocks go into rows first
    fit, longest first, each row at most as long as the longest block: several short blocks then share a row
    instead of each being padded to the longest (uneven groups, as XRPO's, or contexts of different lengths), and
    a block sees nothing of its row's other blocks. Returns ids [R, T], targets [R, T], target mask [R, T]
    (completion tokens at or after skip), positions [R, T], a who-sees-whom mask [R, T, T] (None when every row
    holds one completion: then plain causal attention does it), and for each masked target the index (into the
    inputs) of the completion it belongs to, row after row."""
    members_of = {}  # context -> its blocks' member completions, in order of first appearance
    for i, c in enumerate(contexts):
        members = members_of.setdefault(tuple(c), [[]])
        if members[-1] and len(c) + sum(len(completions[j]) + 1 for j in members[-1]) + len(completions[i]) > MAX_PACKED_TOKENS:
            members.append([])  # this block is full: the context again in a new block
        members[-1].append(i)
    blocks = [(list(c), m) for c, ms in members_of.items() for m in ms]
    size = [len(c) - 1 + sum(len(completions[i]) + 1 for i in m) for c, m in blocks]
    T = max(size)
    rows = first_fit(size, T)
    ids, targets, pos = (torch.full((len(rows), T), v, dtype=torch.long) for v in (pad_id, pad_id, 0))
    block = torch.full((len(rows), T), -1, dtype=torch.long)  # which block a column belongs to; -1: padding
    segment = torch.full((len(rows), T), -2, dtype=torch.long)  # -1: shared context, -2: padding, j: member j
    target_mask = torch.zeros(len(rows), T, dtype=torch.bool)
    owner = []
    for r, ks in enumerate(rows):
        at = 0
        for k in ks:
            c, members = blocks[k]
            P = len(c) - 1
            ids[r, at:at + P], pos[r, at:at + P], segment[r, at:at + P] = torch.tensor(c[:-1], dtype=torch.long), torch.arange(P), -1
            block[r, at:at + size[k]] = k
            at += P
            for j, i in enumerate(members):
                t, L = completions[i], len(completions[i])
                ids[r, at:at + L + 1] = torch.tensor([c[-1], *t], dtype=torch.long)
                targets[r, at:at + L] = torch.tensor(t, dtype=torch.long)
                pos[r, at:at + L + 1] = torch.arange(P, P + L + 1)
                segment[r, at:at + L + 1] = j
                target_mask[r, at + skip[i]:at + L] = True
                owner += [i] * (L - skip[i])
                at += L + 1
    mask = None
    if any(len(ks) > 1 or len(blocks[ks[0]][1]) > 1 for ks in rows):
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        same = (segment[:, :, None] == segment[:, None, :]) | (segment[:, None, :] == -1)
        # padding sees padding, itself included: no query is left with nothing to see
        mask = causal & same & (block[:, :, None] == block[:, None, :])
    return ids, targets, target_mask, pos, mask, torch.tensor(owner, dtype=torch.long)


def completion_logprobs(model, b: Batch, idx, temperature, pad_id, device, loss_only=True):
    """log π and entropy (of softmax(logits / temperature)) of the tokens of completions idx that get a loss (all
    their tokens with loss_only=False), flat and completion after completion, with their positions `tok` in b's
    flat [n_tok] arrays. The LM head and log-softmax are fused: the [tokens, vocab] logits are never held whole."""
    # on a CPU, the freed pages of the last micro-batch's temporaries (glibc keeps them in its heap, among live
    # memory) go back to the OS before this forward, and this forward's before the backward (release_free_memory)
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu:
        release_free_memory()
    skip = b.skip[idx].tolist() if loss_only else [0] * len(idx)
    ids, targets, target_mask, pos, mask, owner = pack_inputs([b.context[i] for i in idx], [b.tokens[i] for i in idx],
                                                              skip, pad_id)
    kw = {} if mask is None else dict(attention_mask=mask.to(device), positions=pos.to(device))
    logp, entropy = model(ids.to(device), targets=targets.to(device), target_mask=target_mask.to(device),
                          temperature=temperature, **kw)
    order = torch.argsort(owner, stable=True).to(device)  # rows hold completions grouped by context: back to idx order
    tok = token_index(b.lengths, idx)
    if loss_only:
        tok = tok[b.train_mask()[tok]]
    if on_cpu:
        release_free_memory()
    return logp[order], entropy[order], tok


@torch.no_grad()
def trainer_logprobs(model, b: Batch, micro_batch, temperature, pad_id, device, autocast):
    """The scoring pass: the trainer's own log-probs and entropies of every completion token, flat [n_tok] on the
    CPU, at the sampling temperature and with the update's numerics (same model, same autocast)."""
    logp, entropy = [torch.zeros(0)], [torch.zeros(0)]
    for i in range(0, len(b.tokens), micro_batch):
        with autocast:
            lp, ent, _ = completion_logprobs(model, b, list(range(i, min(i + micro_batch, len(b.tokens)))),
                                             temperature, pad_id, device, loss_only=False)
        logp.append(lp.float().cpu())
        entropy.append(ent.float().cpu())
    return torch.cat(logp), torch.cat(entropy)
