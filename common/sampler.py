"""KV-cached batched sampling for RL rollouts: many prompts x n samples each, with the log-prob and the
entropy of every generated token. Hand-written, in the spirit of gpt-fast.

    from common.sampler import generate
    groups = generate(model, [tok.prompt(q) for q in questions], n=8, max_new_tokens=512,
                      temperature=1.0, stop_ids=tok.stop_ids, seed=0)
    s = groups[0][3]                          # prompt 0, sample 3
    s.tokens, s.logprobs, s.entropies, s.finished

One call, in three stages:
  1. prefill  the distinct prompts, without their last token, go through the model once into a pre-allocated
              KV cache (the start they all share, such as a chat template's system turn, once for all of
              them). Its samples then share each prompt's keys and values (`KVCache.share`): stored once,
              and attention reads them once per prompt, not once per sample.
  2. extend   every sample feeds [last prompt token, *its prefix] (a given start of the completion, if any),
              left-padded inside that segment. This yields the log-probs of the prefix tokens and the logits
              of the first new token. Padding in the middle of a row is fine: positions count real tokens.
  3. decode   one token per live row per step, sampled on the device. The host reads the "done" flags only
              every `check_every` steps, and then drops finished rows from the batch and the cache.
A `Companion` (a second model, e.g. a prior policy) can go through the same three stages on chosen samples,
with its own cache, and replace their tokens at each step (EAPO's experience-augmented rollouts).

Log-probs and entropies are those of softmax(logits / temperature) over the full vocabulary, before any
top-k / top-p truncation: the distribution the trainer recomputes. temperature=0 is greedy (argmax), and
then they are those of the plain T=1 softmax.
"""
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from numbers import Integral

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from common.memory import heap_temporaries, release_free_memory
# the project's one softmax / log-prob / entropy, shared with the trainer's reference ops:
# softmax_stats(logits [B, V], T) -> (logp [B, V], probs [B, V], entropy [B]); logprobs_entropy gathers from it
from kernels.reference import logprobs_entropy, softmax_stats


@dataclass
class Sample:
    tokens: list[int]  # the completion: prefix tokens (if any), then generated ids, the stop token included if hit
    logprobs: torch.Tensor  # [len(tokens)] fp32, log softmax(logits / temperature) at each token (T = 1 if greedy)
    entropies: torch.Tensor  # [len(tokens)] fp32, entropy of that same full-vocabulary distribution
    finished: bool  # a stop token was generated; False: cut off at max_new_tokens
    prefix_len: int = 0  # how many leading tokens came from `prefixes` (scored, not sampled)
    hidden: torch.Tensor | None = None  # return_hidden: [len, d] (or [d] with "mean"), see generate
    extras: dict = field(default_factory=dict)  # a Companion's per-token values: name -> [len(tokens)]


@dataclass
class Companion:
    """A second model decoded in lock-step with the policy (EAPO's prior policy, arXiv 2606.30420): its own KV
    cache, over the samples in `rows` only, with the policy's cache columns, padding and row drops.

    At each generated position t (0 for a completion's first token), mix(t, tokens, logits, companion_logits,
    rows) gets, for the followed rows not yet dropped (a row that emitted a stop stays until the next check_every
    boundary; its later outputs are discarded): the policy's draws [b], the policy's and the companion's raw logits
    [b, V] fp32, and each row's sample index [b]. It returns the tokens to emit [b] (fed to both models and checked
    for stops; .logprobs stay the policy's log-probs of them) and a dict {name: tensor [b]} of per-token values,
    which come back as Sample.extras[name], aligned with .tokens (0 on prefix tokens and on samples the companion
    does not follow).
    """
    model: torch.nn.Module
    mix: Callable
    rows: list[int] | None = None  # samples to follow, prompt-major (sample j of prompt i is sum(n[:i]) + j); None: all


# ------------------------------------------------------------------------------------------ sampling

# The attention kernels sampling may use on CUDA: all but cuDNN's. PyTorch prefers cuDNN's fused attention on an
# H100, and its host-side cost is paid at every layer of every decode step (whose keys, one column longer each
# token, are a new shape each time): 2.4 ms a call, 56 of an eager step's 66 ms at batch 256; without it a step is
# 3.3-4.6x faster (bench/decode_attention.py, docs/sampler.md). None: PyTorch's own choice.
SAMPLING_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _attention_kernels(dev):
    return sdpa_kernel(SAMPLING_ATTENTION) if dev.type == "cuda" and SAMPLING_ATTENTION else nullcontext()


def sample(probs, top_k=0, top_p=1.0, generator=None):
    """probs [B, V] -> token ids [B], drawn from probs restricted to its top_k entries, then to the smallest
    head whose mass reaches top_p (renormalised). No host synchronisation anywhere."""
    order = None  # when set, probs holds the head of the distribution, sorted, and order its token ids
    if 0 < top_k < probs.shape[-1]:
        probs, order = probs.topk(top_k, dim=-1)
    if top_p < 1.0:
        if order is None:  # a full sort per step: slow on CPU (RL usually samples with top_p = 1)
            probs, order = probs.sort(-1, descending=True)
        cum = probs.cumsum(-1)
        probs = probs.masked_fill(cum - probs >= top_p * cum[:, -1:], 0.0)  # the mass before it reaches top_p
    j = draw(probs, generator)
    return j if order is None else order.gather(-1, j[:, None])[:, 0]


def draw(probs, generator=None):
    """One index per row with probability proportional to probs [B, K] (unnormalised, zeros allowed)."""
    if probs.device.type == "cpu":
        # invert the CDF with one uniform per row; u lies in (0, total], so a zero-probability entry (same cdf
        # as its left neighbour) is never the first with cdf >= u
        cdf = probs.cumsum(-1)
        u = (1 - torch.rand(probs.shape[0], 1, generator=generator)) * cdf[:, -1:]
        return torch.searchsorted(cdf, u)[:, 0]
    # on GPU an exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with probability p_i. It needs
    # no scan (whose float rounding is not monotone there); on CPU the K draws would cost more than the model.
    return (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(-1)


def sample_from_logits(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None):
    """logits [B, V] -> token ids [B]; temperature 0 is greedy."""
    if temperature == 0:
        return logits.max(-1).indices  # argmax (max is ~3x faster than argmax on CPU)
    return sample(softmax_stats(logits, temperature)[1], top_k, top_p, generator)


# ------------------------------------------------------------------------------------------- forward

def prefill(model, ids, mask, cache, shared=0):
    """ids, mask [U, W]: prompts into cache columns 0..W-1, their first `shared` columns the same tokens in every
    row (the chat template's system turn, ...), then each prompt's rest, left-padded. The shared columns go
    through the model once, for one row, and are copied to the others: with a chat template they are often half
    of each prompt. Prompts of very different lengths (XRPO's in-context prompts beside plain ones) go through in
    groups of similar length, each at its own width: the short ones are not padded to the longest. Only the cache
    is wanted: asking for hidden states skips the LM head ([U, W, vocab])."""
    if shared and ids.shape[0] > 1:
        one = model.new_cache(1, shared)
        model(ids[:1, :shared], cache=one, return_hidden=True)
        cache.k[:, :, :, :shared], cache.v[:, :, :, :shared] = one.k, one.v
    else:
        shared = 0
    W = ids.shape[1]
    if W == shared:
        return
    groups = _length_groups(mask[:, shared:].sum(1).tolist())
    if len(groups) == 1:
        model(ids[:, shared:], attention_mask=None if mask.all() else mask, cache=cache, start=shared,
              return_hidden=True)
        return
    for rows, width in groups:  # each group's columns W - width.. hold all of its tokens (left padding)
        cols = torch.cat((torch.arange(shared), torch.arange(W - width, W))).to(ids.device)
        part = model.new_cache(len(rows), shared + width)
        part.k[:, :, :, :shared], part.v[:, :, :, :shared] = cache.k[:, rows, :, :shared], cache.v[:, rows, :, :shared]
        m = mask[rows][:, cols]
        model(ids[rows, W - width:], attention_mask=None if m.all() else m, cache=part, start=shared,
              return_hidden=True)
        cache.k[:, rows, :, W - width:W], cache.v[:, rows, :, W - width:W] = part.k[:, :, :, shared:], part.v[:, :, :, shared:]


def _length_groups(lengths: list, slack: float = 0.5) -> list:
    """Rows by length, longest first, in groups [(rows, width)] whose every row is at least `slack` of the group's
    width: no row is padded to more than twice its length. Rows of similar lengths make one group (the arithmetic
    task's prompts, 0.51-1.0 of the longest after their shared start: one group, a single forward)."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    groups = []
    for r in order:
        if groups and lengths[r] >= slack * groups[-1][1]:
            groups[-1][0].append(r)
        else:
            groups.append(([r], lengths[r]))
    return [(sorted(rows), w) for rows, w in groups if w > 0]  # a row with no tokens of its own has nothing to prefill


def _prompt_cache(model, ids, pmask, shared, sel, max_len, plain=False, keys=None, reuse=None):
    """The KV cache of the S samples after the prefill of their distinct prompts ids, pmask [U, W] (the first
    `shared` columns the same in every row); sample s continues prompt sel[s]. With several samples per prompt,
    each prompt's keys and values are stored once and read once by decode attention (KVCache.share): for 8
    samples of arithmetic prompts ~0.3 GB less cache and half the bytes attention reads. Also when a prompt appears
    twice among the prompts (its samples then are not adjacent), where repeated rows would raise a run's peak
    (docs/benchmarks.md, Memory). Otherwise, and for a compiled step (plain: one fixed layout), each prompt's rows are
    repeated for its samples; one-sample prompts (evaluation) gain nothing from sharing and would peak higher.
    reuse: generate's prompt_kv, keyed by keys[u] (prompt u's token tuple): prompts found there are copied, not
    prefilled; the others are prefilled (in a layout of their own, the start they share once) and stored there."""
    S, (U, W) = len(sel), ids.shape
    share = not plain and S > U and W > 0
    cache = model.new_cache(U, W if share else max_len)
    todo = list(range(U)) if reuse is None else [u for u in range(U) if keys[u] not in reuse]
    if len(todo) == U:
        prefill(model, ids, pmask, cache, shared)
    elif todo:  # only the prompts not seen before, in a layout of their own: their common start may be longer than
        # all prompts' (XRPO's in-context prompts share their task and tags, the plain prompts only the system turn),
        # and it goes through the model once. A token's keys and values depend on its position, not on its column
        part_ids, part_mask, part_shared = _prompt_layout([list(keys[u][:-1]) for u in todo], ids.device)
        part = model.new_cache(len(todo), part_ids.shape[1])
        prefill(model, part_ids, part_mask, part, part_shared)
        for i, u in enumerate(todo):
            cols, part_cols = pmask[u].nonzero()[:, 0], part_mask[i].nonzero()[:, 0]
            cache.k[:, u].index_copy_(2, cols, part.k[:, i].index_select(2, part_cols))
            cache.v[:, u].index_copy_(2, cols, part.v[:, i].index_select(2, part_cols))
    for u in range(U if reuse is not None else 0):  # a prompt's keys and values at its real (unpadded) columns
        cols = pmask[u].nonzero()[:, 0]
        if keys[u] in reuse:
            cache.k[:, u].index_copy_(2, cols, reuse[keys[u]][0])
            cache.v[:, u].index_copy_(2, cols, reuse[keys[u]][1])
        else:
            reuse[keys[u]] = cache.k[:, u].index_select(2, cols), cache.v[:, u].index_select(2, cols)
    return cache.share(sel, max_len) if share else cache.select(sel)


def decode_step(model, tok, pos, cache, col, mask):
    """One token per row (tok, pos [B]) written at cache column `col`, attending over columns 0..col only.
    mask [B, >col] bool marks real columns, or None when no row has padding. Returns hidden states [B, d]."""
    m = None if mask is None else mask[:, :col + 1]
    return model(tok[:, None], attention_mask=m, positions=pos[:, None], cache=cache, start=col, return_hidden=True)[:, 0]


def decode_step_static(model, tok, pos, col, cache, mask):
    """decode_step with fixed shapes, for torch.compile(mode="reduce-overhead") (CUDA graphs): `col` is a
    0-dim tensor and attention runs over the whole cache with mask [B, max_len], set here at `col`."""
    mask.index_fill_(1, col.view(1), True)
    return model(tok[:, None], attention_mask=mask, positions=pos[:, None], cache=cache, start=col,
                 return_hidden=True)[:, 0]


def drop_rows(cache, done, filled):
    """Drop the batch rows where done [B] is True. Kept rows from the end move into the holes (at most as
    many rows as were dropped, and only their first `filled` columns) and the cache shrinks to a view of the
    same memory: far cheaper than cache.select, which copies every row. Returns the old index of each row."""
    n = int((~done).sum())
    holes = done[:n].nonzero()[:, 0]
    movers = (~done[n:]).nonzero()[:, 0] + n
    filled -= cache.offset  # a shared cache's rows hold only the columns after the shared prompts
    for t in (cache.k, cache.v):
        t[:, holes, :, :filled] = t[:, movers, :, :filled]
    cache.k, cache.v = cache.k[:, :n], cache.v[:, :n]
    perm = torch.arange(n, device=done.device)
    perm[holes] = movers
    cache.keep(perm)
    return perm


_compiled = {}


def _compile(fn, **kw):
    key = (fn, tuple(sorted(kw.items())))  # the options too: a CUDA call after a CPU one still gets its CUDA graphs
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, **kw)
    return _compiled[key]


# ------------------------------------------------------------------------------------------ generate

def generate(model, prompts, n=1, max_new_tokens=256, temperature=1.0, top_p=1.0, top_k=0, stop_ids=None,
             seed=None, *, prefixes=None, companion=None, return_hidden=False, check_every=8, compile=False,
             prompt_kv=None):
    """Sample completions: returns one list per prompt of its Sample's (prompt-major, n[i] of them).

    prompts: list of token-id lists. n: int, or one int per prompt (0 gives an empty list).
    stop_ids: ids that end a completion (kept in .tokens); None: the model config's eos_token_id; () never stops.
    seed: same seed, same completions (on one device); None draws one from torch's global RNG.
    prefixes: None, or one entry per prompt: a list of ids shared by that prompt's samples, or a list of
      n[i] lists (one per sample). They are the start of the COMPLETION: each sample's .tokens, .logprobs,
      .entropies (and .hidden) begin with its prefix, scored by the same softmax; max_new_tokens counts
      only the tokens generated after it, and stop ids inside a prefix do not stop it.
    companion: a Companion: a second model stepped alongside on some samples, which may replace their tokens
      and returns per-token extras (see Companion). It always decodes eagerly, also under compile=True.
    return_hidden: True gives each sample .hidden [len(tokens), d] fp32, the final-norm hidden state whose
      LM-head output scored each token (so row 0 is the prompt's last position); "mean" averages those rows.
    check_every: steps between host reads of the done flags (early exit, dropping finished rows).
    compile: torch.compile the one-token step (CUDA graphs on GPU); the batch then keeps a fixed shape and
      finished rows are not dropped, only the early exit remains.
    prompt_kv: a dict the caller keeps across calls while the weights stay the same: each prompt's keys and values
      are stored there after its prefill and copied from there instead of prefilled again (a prompt sampled in
      several calls, as XRPO's rounds do). A prompt's keys and values do not depend on its batch's padding.
    """
    ns, pre = _check_args(model, prompts, n, prefixes, max_new_tokens, temperature, top_p, top_k)
    if check_every < 1:
        raise ValueError(f"generate: expected check_every >= 1, got {check_every}")
    if stop_ids is None:
        eos = model.cfg.extra.get("eos_token_id")
        stop_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    owner = [i for i, k in enumerate(ns) for _ in range(k)]  # sample -> its prompt
    S = len(owner)
    if S == 0:
        return [[] for _ in prompts]
    dev = model.lm_head.weight.device
    release_free_memory()  # what the trainer freed goes back to the OS before the KV cache is allocated
    uniq = {}  # distinct prompts with samples, each prefilled once
    urow = [uniq.setdefault(tuple(prompts[i]), len(uniq)) for i in owner]
    W = max(len(p) for p in uniq) - 1  # prefill width: all but the last prompt token
    L = max(len(p) for p in pre)  # longest prefix
    steps = max_new_tokens
    max_len = W + L + max(steps, 1)
    if compile:  # fewer distinct cache shapes, fewer recompiles
        max_len = -(-max_len // 128) * 128
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed if seed is not None else int(torch.randint(2**62, (1,))))

    # on a CPU the decode steps' temporaries come from the heap (common.memory), except beside a companion: two
    # models' caches and temporaries make that call a run's peak (EAPO's), and the heap would add to it
    heap = heap_temporaries() if dev.type == "cpu" and companion is None else nullcontext()
    with torch.inference_mode(), _attention_kernels(dev), heap:
        ids, pmask, C = _prompt_layout([p[:-1] for p in uniq], dev)  # [U, W]: the distinct prompts but their last token
        seg, smask = _left_pad([[prompts[owner[s]][-1], *pre[s]] for s in range(S)], L + 1, dev)  # [S, L+1]
        sel = torch.tensor(urow, device=dev)
        cache = _prompt_cache(model, ids, pmask, C, sel, max_len, plain=compile, keys=list(uniq), reuse=prompt_kv)
        mask = torch.zeros(S, max_len, dtype=torch.bool, device=dev)  # real tokens; columns turn on as written
        mask[:, :W], mask[:, W:W + L + 1] = pmask[sel], smask
        padded = not mask[:, :W + L + 1].all()
        h = model(seg, attention_mask=mask[:, :W + L + 1] if padded else None, cache=cache, start=W,
                  return_hidden=True)  # [S, L+1, d]

        # the prefix tokens, scored from the states one column to their left
        is_pre = smask[:, 1:] & smask[:, :-1]  # [S, L], True where the next column holds a prefix token
        pre_h = h[:, :L][is_pre]  # [N, d]
        pre_logits, pre_targets = model.lm_head(pre_h), seg[:, 1:][is_pre]
        pre_logp, pre_ent = logprobs_entropy(pre_logits, pre_targets, temperature or 1.0)
        pre_logits = None

        follower = None if companion is None else _Follower(companion, S, steps, dev)
        if follower is not None:
            follower.start(ids, pmask, C, urow, seg, mask, W + L + 1, padded)
        h = h[:, -1]  # [S, d], predicts the first new token
        pos = torch.tensor([len(prompts[owner[s]]) + len(pre[s]) for s in range(S)], device=dev)
        rows = torch.arange(S, device=dev)  # sample index of each active row
        out_tok = torch.full((S, steps), -1, dtype=torch.long, device=dev)
        out_logp = torch.zeros(S, steps, device=dev)
        out_ent = torch.zeros(S, steps, device=dev)
        out_h = torch.zeros(S, steps, h.shape[-1], device=dev) if return_hidden else None
        stops = torch.tensor(list(stop_ids), dtype=torch.long, device=dev)
        done = torch.zeros(S, dtype=torch.bool, device=dev)
        col = W + L + 1  # cache column of the next token fed
        if compile:
            step_fn = _compile(decode_step_static, mode="reduce-overhead" if dev.type == "cuda" else None, fullgraph=True)
            stats = _compile(softmax_stats)
            for t in (cache.k, cache.v, mask):
                torch._dynamo.mark_static_address(t)  # written in place by the graph: do not copy
            col_t = torch.tensor(col, device=dev)
        else:
            stats = softmax_stats
        for t in range(steps):
            logits = model.lm_head(h)  # [B, V]
            logp_all, probs, ent = stats(logits, temperature or 1.0)
            tok = logits.max(-1).indices if temperature == 0 else sample(probs, top_k, top_p, gen)
            if follower is not None:
                follower.step(t, tok, logits)  # may replace the followed rows' tokens, in place
            out_tok[rows, t] = tok
            out_logp[rows, t] = logp_all.gather(-1, tok[:, None])[:, 0]
            out_ent[rows, t] = ent
            if return_hidden:
                out_h[rows, t] = h.float()
            done |= torch.isin(tok, stops)
            if t + 1 == steps:
                break
            if (t + 1) % check_every == 0:  # the only host syncs in the loop
                if dev.type == "cpu":  # the steps' freed blocks under mmap's threshold: else RSS creeps over a call
                    release_free_memory()
                n_done = int(done.sum())
                if n_done == len(rows):
                    break
                if follower is not None:
                    follower.drop(done, col)
                if n_done and not compile:  # finished rows stop costing compute
                    keep = drop_rows(cache, done, col)
                    rows, tok, pos, mask, done = rows[keep], tok[keep], pos[keep], mask[keep], done[keep]
                    if follower is not None:
                        follower.moved(rows)
            if compile:
                torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are consumed
                h = step_fn(model, tok, pos, col_t, cache, mask)
                col_t += 1
            else:
                mask[:, col] = True
                h = decode_step(model, tok, pos, cache, col, mask if padded else None)
            if follower is not None:
                follower.feed(tok, pos, col)
            pos, col = pos + 1, col + 1

    extras = {} if follower is None else follower.out
    cache = h = logits = logp_all = probs = follower = None  # dropped here, not when generate returns
    release_free_memory()  # and the caches' and the step temporaries' pages before the trainer runs
    # outside inference mode, so that the returned tensors can enter autograd code (as old log-probs)
    return _collect(ns, pre, out_tok.clone(), out_logp.clone(), out_ent.clone(), pre_logp.clone(),
                    pre_ent.clone(), stops.cpu(), out_h.clone() if return_hidden else None,
                    pre_h.float().clone() if return_hidden else None, return_hidden,
                    {k: v.clone() for k, v in extras.items()})


class _Follower:
    """A Companion's decoding state inside generate. Its cache rows hold the followed samples (`rows`, in its
    own order: row drops permute the policy's batch and its batch differently); `slot` maps each sample to
    its row in the policy's batch, so every step reads and writes the policy's tensors at slot[rows]."""

    def __init__(self, companion, S, steps, dev):
        wanted = range(S) if companion.rows is None else sorted(set(companion.rows))
        if not all(isinstance(r, Integral) and 0 <= r < S for r in wanted):
            raise ValueError(f"generate: companion.rows must be sample indices in [0, {S}), got {list(wanted)[:8]}...")
        self.c, self.S, self.steps = companion, S, steps
        self.rows = torch.tensor(list(wanted), dtype=torch.long, device=dev)  # [b] sample index of each cache row
        self.slot = torch.arange(S, device=dev)  # [S] each live sample's row in the policy's batch
        self.out = {}  # name -> [S, steps] extras

    def start(self, ids, pmask, shared, urow, seg, mask, width, padded):
        """The policy's prefill and extend (same columns, same padding) on the followed samples only: ids,
        pmask [U, W] the distinct prompts (their first `shared` columns the same in every row), urow each sample's prompt, seg [S, width - W] the extend segments,
        mask [S, max_len] the policy's real-token mask with its first `width` columns filled."""
        model, rows = self.c.model, self.rows.tolist()
        if not rows:
            return
        uniq = sorted({urow[s] for s in rows})
        sel = torch.tensor([uniq.index(urow[s]) for s in rows], dtype=torch.long, device=ids.device)
        self.cache = _prompt_cache(model, ids[uniq], pmask[uniq], shared, sel, mask.shape[1])  # shared as the policy's
        self.mask, self.padded = mask[self.rows], padded  # [b, max_len], a copy: columns turn on as written
        self.h = model(seg[self.rows], attention_mask=self.mask[:, :width] if padded else None, cache=self.cache,
                       start=ids.shape[1], return_hidden=True)[:, -1]  # [b, d]

    def step(self, t, tok, logits):
        """mix: the followed rows' tokens (replaced in tok [B], in place) and their extras at position t."""
        if not len(self.rows):
            return
        at = self.slot[self.rows]
        new, extras = self.c.mix(t, tok[at], logits[at].float(), self.c.model.lm_head(self.h).float(), self.rows)
        tok[at] = new
        for name, value in extras.items():
            if name not in self.out:
                self.out[name] = torch.zeros(self.S, self.steps, dtype=value.dtype, device=value.device)
            self.out[name][self.rows, t] = value

    def drop(self, done, col):
        """Drop the followed rows that finished; done [B] is the policy's batch before it drops its own."""
        if len(self.rows):
            finished = done[self.slot[self.rows]]
            if finished.any():
                keep = drop_rows(self.cache, finished, col)
                self.rows, self.mask = self.rows[keep], self.mask[keep]

    def moved(self, rows):
        """The policy's batch was compacted: rows [B'] is the sample in each of its rows now."""
        self.slot[rows] = torch.arange(len(rows), device=rows.device)

    def feed(self, tok, pos, col):
        """The emitted tokens of the followed rows go into the companion's cache at column col."""
        if len(self.rows):
            at = self.slot[self.rows]
            self.mask[:, col] = True
            self.h = decode_step(self.c.model, tok[at], pos[at], self.cache, col, self.mask if self.padded else None)


def _collect(ns, pre, out_tok, out_logp, out_ent, pre_logp, pre_ent, stops, out_h, pre_h, return_hidden, out_x):
    """Cut each sample at its first stop token and prepend its prefix: the per-prompt lists of Sample. out_x:
    per-token extras of the generated tokens [S, steps] (zeros on the prefix tokens)."""
    out_tok, out_logp, out_ent = out_tok.cpu(), out_logp.cpu(), out_ent.cpu()
    out_x = {k: v.cpu() for k, v in out_x.items()}
    pre_logp, pre_ent = pre_logp.cpu().split([len(p) for p in pre]), pre_ent.cpu().split([len(p) for p in pre])
    if return_hidden:
        out_h, pre_h = out_h.cpu(), pre_h.cpu().split([len(p) for p in pre])
    is_stop = torch.isin(out_tok, stops)
    finished = is_stop.any(1).tolist()
    first = ((is_stop.cumsum(1) == 0).sum(1) + 1).clamp(max=out_tok.shape[1]).tolist()  # length up to the stop
    groups, s = [], 0
    for k in ns:
        group = []
        for _ in range(k):
            m = first[s]
            sample = Sample(tokens=pre[s] + out_tok[s, :m].tolist(), logprobs=torch.cat((pre_logp[s], out_logp[s, :m])),
                            entropies=torch.cat((pre_ent[s], out_ent[s, :m])), finished=finished[s], prefix_len=len(pre[s]))
            sample.extras = {k: torch.cat((x.new_zeros(len(pre[s])), x[s, :m])) for k, x in out_x.items()}
            if return_hidden:
                hid = torch.cat((pre_h[s], out_h[s, :m]))
                sample.hidden = hid.mean(0) if return_hidden == "mean" else hid
            group.append(sample)
            s += 1
        groups.append(group)
    return groups


def _common_prefix_len(seqs) -> int:
    """How many leading tokens all of seqs (lists of ids) share."""
    first, n = seqs[0], min(map(len, seqs))
    for other in seqs[1:]:
        n = next((i for i in range(n) if other[i] != first[i]), n)
    return n


def _prompt_layout(seqs, dev):
    """Prompts (id lists) -> (ids, mask [N, W] with W the longest, shared): the start all of them share in columns
    0..shared-1, then each one's rest, left-padded (padding in the middle of a row is fine: positions count real
    tokens)."""
    C, W = _common_prefix_len(seqs), max(map(len, seqs))
    ids, mask = _left_pad([s[C:] for s in seqs], W - C, dev)  # [N, W - C]
    head = torch.tensor(seqs[0][:C], dtype=torch.long, device=dev).expand(len(seqs), C)
    return torch.cat((head, ids), 1), torch.cat((torch.ones_like(head, dtype=torch.bool), mask), 1), C


def _left_pad(seqs, width, dev):
    """list of id lists -> (ids [N, width] long, mask [N, width] bool), each row's tokens at its right end."""
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):], mask[i, width - len(s):] = torch.tensor(s), True
    return ids.to(dev), mask.to(dev)


def _check_args(model, prompts, n, prefixes, max_new_tokens, temperature, top_p, top_k):
    """Validate the call; returns (samples per prompt, one prefix per sample). Messages name the argument."""
    V = model.cfg.vocab_size

    def ids_ok(seq, what):
        if not all(isinstance(t, Integral) and 0 <= t < V for t in seq):
            raise ValueError(f"generate: {what} must hold token ids in [0, {V}), got {list(seq)[:8]}...")

    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"generate: prompts must be a list of token-id lists, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"generate: prompts[{i}] must be a non-empty list of token ids")
        ids_ok(p, f"prompts[{i}]")
    ns = [n] * len(prompts) if isinstance(n, Integral) else list(n)
    if len(ns) != len(prompts) or not all(isinstance(k, Integral) and k >= 0 for k in ns):
        raise ValueError(f"generate: n must be an int >= 0 or one per prompt ({len(prompts)}), got {n}")
    if max_new_tokens < 0 or temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"generate: expected max_new_tokens >= 0, temperature >= 0, 0 < top_p <= 1, top_k >= 0; "
                         f"got {max_new_tokens}, {temperature}, {top_p}, {top_k}")
    if prefixes is None:
        return ns, [[] for k in ns for _ in range(k)]
    if len(prefixes) != len(prompts):
        raise ValueError(f"generate: prefixes must have one entry per prompt ({len(prompts)}), got {len(prefixes)}")
    pre = []
    for i, (p, k) in enumerate(zip(prefixes, ns)):
        per_sample = len(p) > 0 and isinstance(p[0], (list, tuple))
        if per_sample and len(p) != k:
            raise ValueError(f"generate: prefixes[{i}] has {len(p)} per-sample prefixes, but n[{i}] is {k}")
        for j, q in enumerate(p if per_sample else [p] * k):
            ids_ok(q, f"prefixes[{i}]" + (f"[{j}]" if per_sample else ""))
            pre.append(list(q))
    return ns, pre
