"""Sentence embeddings from the policy itself: pooled final hidden states, L2-normalised.

    from common.embed import embed, pool_hidden
    e = embed(model, [[ids...], [ids...]])        # [n, d], each row of unit length
    e = pool_hidden(hidden, mask)                 # the same pooling, on hidden states a forward already made

ExTra's novelty bonus compares rollouts by the cosine of text embeddings, and XRPO finds a problem's neighbours by
them. The papers use a separate sentence encoder; here the policy's own final hidden states stand in for it, so no
second model is loaded.
Only the trunk runs (`return_hidden=True`): the [tokens, vocab] logits are never formed.
"""
import torch
import torch.nn.functional as F


def pool_hidden(hidden: torch.Tensor, mask: torch.Tensor, pool: str = "mean") -> torch.Tensor:
    """hidden [B, T, d] final hidden states, mask [B, T] true on real tokens (any padding side) -> [B, d] fp32,
    unit length. pool: "mean" over the real tokens, or "last" = the last real token. A row with no real
    token gives the zero vector (cosine 0 to everything)."""
    mask = mask.bool()
    h = hidden.float()
    if pool == "mean":
        w = mask.float().unsqueeze(-1)  # [B, T, 1]
        pooled = (h * w).sum(1) / w.sum(1).clamp(min=1.0)
    elif pool == "last":
        T = mask.shape[1]
        last = torch.where(mask, torch.arange(T, device=mask.device), -1).amax(1)  # [B], -1 when empty
        pooled = h[torch.arange(h.shape[0], device=h.device), last.clamp(min=0)] * (last >= 0).float()[:, None]
    else:
        raise ValueError(f"pool must be 'mean' or 'last', got {pool!r}")
    return F.normalize(pooled, dim=-1)


@torch.no_grad()
def embed(model, seqs: list[list[int]], batch: int = 32, pool: str = "mean", pad_id: int = 0) -> torch.Tensor:
    """Embed token-id lists with `model`'s own trunk -> [n, d] fp32 on the model's device, unit rows.

    Sequences are sorted by length and right-padded per micro-batch of `batch` (little padding, and the
    attention mask keeps padding from changing a real token's hidden state), then put back in input order."""
    dev = next(model.parameters()).device
    d = model.cfg.hidden_size
    out = torch.zeros(len(seqs), d, device=dev)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    order = [i for i in order if len(seqs[i]) > 0]  # empty sequences stay zero vectors
    for s in range(0, len(order), batch):
        rows = order[s:s + batch]
        T = max(len(seqs[i]) for i in rows)
        ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), T, dtype=torch.bool)
        for j, i in enumerate(rows):
            ids[j, :len(seqs[i])] = torch.as_tensor(seqs[i], dtype=torch.long)
            mask[j, :len(seqs[i])] = True
        ids, mask = ids.to(dev), mask.to(dev)
        # all rows full length: plain causal attention, the mask is only needed when something is padded
        hidden = model(ids, attention_mask=None if bool(mask.all()) else mask, return_hidden=True)  # [b, T, d]
        out[torch.as_tensor(rows, device=dev)] = pool_hidden(hidden, mask, pool)
    return out
