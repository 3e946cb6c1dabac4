"""One step's completions as a flat batch, and the trainer's forward over it.

    b = to_batch(contexts, generate(model, contexts, n=8, ...), answers, group_ids=range(len(contexts)))
    logp, entropy = trainer_logprobs(model, b, micro_batch=16, temperature=0.8, pad_id=tok.pad_id, device=dev,
                                     autocast=autocast)              # every completion token, flat [n_tok], no grad
    logp, entropy, tok = completion_logprobs(model, b, idx, 0.8, tok.pad_id, dev)   # completions idx, with grad

Every algorithm file builds its step on this: completion i was sampled from context[i] (a prompt, an in-context
prompt, a prompt plus a given prefix...), belongs to group[i] (advantages are relative within a group; groups
may differ in size), and its first skip[i] tokens were given rather than sampled, so they get no loss. Per-token
values live in flat [n_tok] tensors over all completion tokens, completion after completion.
"""
from dataclasses import dataclass

import torch


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

    @property
    def lengths(self) -> torch.Tensor:  # [N] completion tokens
        return torch.tensor([len(t) for t in self.tokens], dtype=torch.long)

    def train_mask(self) -> torch.Tensor:  # [n_tok] bool: the completion tokens that get a loss
        return torch.cat([torch.zeros(0, dtype=torch.bool)] +
                         [torch.arange(n) >= k for n, k in zip(self.lengths.tolist(), self.skip.tolist())])

    def select(self, keep: torch.Tensor) -> "Batch":
        """The completions where keep [N] is True, in order."""
        idx = keep.nonzero()[:, 0].tolist()
        return Batch([self.context[i] for i in idx], [self.tokens[i] for i in idx], self.group[keep], self.skip[keep],
                     self.sampler_logp[keep.repeat_interleave(self.lengths)], self.finished[keep],
                     [self.answer[i] for i in idx])


def to_batch(contexts, groups, answers, group_ids) -> Batch:
    """generate()'s nested output (one list of samples per context) -> a flat Batch. answers and group_ids give
    one value per context; a sample's given prefix (Sample.prefix_len) is excluded from the loss."""
    rows = [(c, s, a, g) for c, ss, a, g in zip(contexts, groups, answers, group_ids) for s in ss]
    return Batch(context=[c for c, _, _, _ in rows], tokens=[s.tokens for _, s, _, _ in rows],
                 group=torch.tensor([g for _, _, _, g in rows], dtype=torch.long),
                 skip=torch.tensor([s.prefix_len for _, s, _, _ in rows], dtype=torch.long),
                 sampler_logp=torch.cat([torch.zeros(0)] + [s.logprobs.float().cpu() for _, s, _, _ in rows]),
                 finished=torch.tensor([s.finished for _, s, _, _ in rows], dtype=torch.bool),
                 answer=[a for _, _, a, _ in rows])


def token_index(lengths: torch.Tensor, idx) -> torch.Tensor:
    """Positions in the flat [n_tok] arrays of the tokens of completions idx, completion after completion."""
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.cat([torch.zeros(0, dtype=torch.long)] +
                     [torch.arange(int(offsets[i]), int(offsets[i] + lengths[i])) for i in idx])


def build_inputs(contexts, completions, skip, pad_id):
    """Right-padded context+completion ids [n, T] and a mask [n, T-1] over the positions that predict a
    completion token at or after skip. Right padding needs no attention mask: real tokens never see the pads."""
    seqs = [c + t for c, t in zip(contexts, completions)]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T - 1, dtype=torch.bool)
    for i, (c, t, k) in enumerate(zip(contexts, completions, skip)):
        ids[i, : len(c) + len(t)] = torch.tensor(c + t)
        mask[i, len(c) - 1 + k: len(c) - 1 + len(t)] = True
    return ids, mask


def completion_logprobs(model, b: Batch, idx, temperature, pad_id, device, loss_only=True):
    """log π and entropy (of softmax(logits / temperature)) of the tokens of completions idx that get a loss (all
    their tokens with loss_only=False), flat and completion after completion, with their positions `tok` in b's
    flat [n_tok] arrays. The LM head and log-softmax are fused: the [tokens, vocab] logits are never held whole."""
    skip = b.skip[idx].tolist() if loss_only else [0] * len(idx)
    ids, mask = build_inputs([b.context[i] for i in idx], [b.tokens[i] for i in idx], skip, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    logp, entropy = model(ids[:, :-1], targets=ids[:, 1:], target_mask=mask, temperature=temperature)
    tok = token_index(b.lengths, idx)
    if loss_only:
        tok = tok[b.train_mask()[tok]]
    return logp, entropy, tok


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
