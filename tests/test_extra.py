"""extra.py: every test property of ExTra (arXiv 2606.24994) as we implement it (numbered 1-11 below), the
reduction to grpo.py with both mechanisms off, resume equivalence, a smoke run, and bad input."""
import contextlib
import dataclasses
import json
import math
import zlib

import pytest
import torch
from safetensors.torch import load_file

import extra
import grpo
from common.config import ConfigError, main_guard
from common.model import Transformer
from common.tokenizer import Tokenizer

@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return Transformer.from_pretrained(tiny_model_dir)


# ------------------------------------------------------------------------- the loss: ExTra's dual clip

@pytest.mark.parametrize("c", [3.0, 1.1])
@pytest.mark.parametrize("options", [{}, {"weights", "sampler_logp", "ref_logp", "entropy"}, {"seq_ids"}])
def test_dual_clip_is_the_direct_formula(c, options):
    """extra.token_loss (the fused call with the dual clip added) against the direct formula in float64: the clipped
    surrogate ℓ becomes min(ℓ, -c·A) where A < 0, then weights and TIS multiply it; KL and entropy are untouched.
    Values and gradients (logp, entropy). Catches the dual clip dropped, applied where A > 0, or leaving a gradient
    on the capped tokens; c = 1.1 < 1 + ε_high checks it also binds inside the ratio clip's range."""
    g = torch.Generator().manual_seed(2)
    n = 60
    logp = (-3 * torch.rand(n, generator=g, dtype=torch.float64)).requires_grad_()
    old = logp.detach() - 1.5 * torch.rand(n, generator=g, dtype=torch.float64) + 0.3  # ratios from 0.74 to 3.3
    old[:10] = logp.detach()[:10] - 3.0  # ratio e^3 = 20 > c
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    entropy = (2 * torch.rand(n, generator=g, dtype=torch.float64)).requires_grad_()
    kw = {"weights": torch.rand(n, generator=g, dtype=torch.float64) * 2,
          "sampler_logp": old + 0.5 * torch.randn(n, generator=g, dtype=torch.float64),
          "ref_logp": logp.detach() + torch.randn(n, generator=g, dtype=torch.float64),
          "seq_ids": torch.arange(n) // 6}  # six tokens a sequence, the first ten tokens' sequences far off
    kw = {k: v for k, v in kw.items() if k in options}
    cfg = extra.Config(dual_clip=c, tis_cap=1.5 if "sampler_logp" in kw else 0.0,
                       kl_coef=0.05 if "ref_logp" in kw else 0.0, entropy_coef=0.01 if "entropy" in kw else 0.0)
    fused, low, high = extra.token_loss(logp, old, adv, entropy, cfg, **kw)
    # the direct formula, from grpo.py's written-out loss
    surrogate = grpo.token_loss_plain(logp, old, adv, entropy, dataclasses.replace(cfg, kl_coef=0.0, entropy_coef=0.0),
                                      seq_ids=kw.get("seq_ids"))[0]
    factor = kw.get("weights", torch.ones(n, dtype=torch.float64))
    if "sampler_logp" in kw:
        factor = factor * (old - kw["sampler_logp"]).exp().clamp(max=cfg.tis_cap)
    plain, low_p, high_p = grpo.token_loss_plain(logp, old, adv, entropy, cfg, **kw)
    direct = torch.where(adv < 0, torch.minimum(surrogate, -c * adv), surrogate) * factor + (plain - surrogate * factor)
    capped = (adv < 0) & (surrogate > -c * adv)
    assert capped.sum() >= 3 and ((adv > 0) & (surrogate.detach() < 0) & (old < logp - 2)).any()  # A > 0 at r > c: not capped
    assert torch.equal(low, low_p) and torch.equal(high, high_p)
    torch.testing.assert_close(fused.double(), direct, rtol=1e-5, atol=1e-6)  # the kernel computes in fp32
    weights = torch.rand(n, generator=g, dtype=torch.float64)
    grads = [torch.autograd.grad((loss.double() * weights).sum(), (logp, entropy), allow_unused=True)
             for loss in (fused, direct)]
    assert "ref_logp" in kw or not grads[1][0][capped].any()  # the capped tokens' surrogate is a constant
    for a, b in zip(*grads):
        if a is None or b is None:  # entropy has no gradient when its bonus is off
            assert (a is None or not a.any()) and (b is None or not b.any())
        else:
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def test_dual_clip_off_is_grpo_loss():
    """--dual-clip 0: extra.token_loss equals grpo.token_loss exactly (catches a constant or weight left in when off)."""
    g = torch.Generator().manual_seed(3)
    logp = -3 * torch.rand(30, generator=g)
    old, adv, entropy = logp - 3 * torch.rand(30, generator=g), torch.randn(30, generator=g), torch.rand(30, generator=g)
    cfg = extra.Config(dual_clip=0.0, kl_coef=0.05, entropy_coef=0.01)
    ours = extra.token_loss(logp, old, adv, entropy, cfg, ref_logp=logp + 0.1)
    theirs = grpo.token_loss(logp, old, adv, entropy, grpo.Config(kl_coef=0.05, entropy_coef=0.01), ref_logp=logp + 0.1)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


# ------------------------------------------------------------------ novelty bonus (properties 2-4)

def unit(x):
    return torch.nn.functional.normalize(x, dim=-1)


def test_option_b_adds_alpha_d_to_correct_only():  # property 2
    g = torch.Generator().manual_seed(0)
    correct = torch.randint(0, 2, (4, 6), generator=g).float()
    correct[0, :3] = torch.tensor([1.0, 0.0, 1.0])
    group = torch.arange(4).repeat_interleave(6)
    adv = extra.group_advantages(correct.flatten(), group, "std")
    d = torch.rand(24, generator=g) * 2
    out = extra.bonus_after_norm(adv, correct.flatten(), d, alpha=0.1)
    assert torch.allclose(out - adv, 0.1 * d * correct.flatten())
    wrong = correct.flatten() == 0
    assert torch.equal(out[wrong], adv[wrong]) and wrong.any()
    assert ((out - adv) >= 0).all()


def test_all_correct_gets_alpha_d_all_wrong_gets_zero():  # property 3
    correct = torch.tensor([1.0] * 6 + [0.0] * 6)
    group = torch.arange(2).repeat_interleave(6)
    d = torch.linspace(0.1, 0.9, 12)
    out = extra.bonus_after_norm(extra.group_advantages(correct, group, "std"), correct, d, 0.1)
    assert torch.allclose(out[:6], 0.1 * d[:6]) and torch.equal(out[6:], torch.zeros(6))


def test_option_a_bonus_before_norm():
    rewards, correct = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 0.0])
    d = torch.tensor([0.2, 0.4, 0.8])
    ema = {}
    v = extra.update_var_ema(ema, "x", rewards)
    assert abs(v - rewards.var(unbiased=False).item()) < 1e-7  # initialised at the first value
    assert abs(extra.update_var_ema(ema, "x", torch.ones(3)) - 0.9 * v) < 1e-7
    out = extra.bonus_before_norm(rewards, correct, d, alpha=0.5, var_ema=v, lam=1.0)
    # scaled by the group's largest novelty (0.8), damped by exp(-v), only where correct
    assert torch.allclose(out, rewards + 0.5 * torch.tensor([0.25, 0.5, 0.0]) * math.exp(-v))


def test_option_a_on_the_official_reward_scale():
    """Option A over a step equals the official code's on ±1 rewards: the same group-normalised advantages, and the
    variance EMA of the ±1 rewards. Catches the bonus added at full α to 0/1 rewards (twice the official code's
    weight against the right/wrong gap) or a damping from the 0/1 variance."""
    cfg = extra.Config(novelty_mode="before", alpha=0.3, novelty_lambda=2.0)
    correct = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    d = torch.tensor([0.3, 0.1, 0.2, 0.4, 0.05, 0.6, 0.0, 0.2])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    ours_ema, theirs_ema = {"p1": 0.5}, {"p1": 0.5}
    ours = extra.group_advantages(extra.novelty_rewards(correct, correct, d, group, ["p0", "p1"], ours_ema, cfg),
                                  group, "std")
    signed, theirs = 2 * correct - 1, []
    for g, key in enumerate(["p0", "p1"]):  # the official form: ±1 rewards, α·d̂·exp(-λ v̄) on the correct ones
        rows = group == g
        v = extra.update_var_ema(theirs_ema, key, signed[rows])
        theirs.append(signed[rows] + cfg.alpha * d[rows] / d[rows].max() * math.exp(-cfg.novelty_lambda * v)
                      * (correct[rows] > 0))
    theirs = extra.group_advantages(torch.cat(theirs), group, "std")
    assert torch.allclose(ours, theirs, atol=1e-6), (ours, theirs)
    assert ours_ema == theirs_ema and abs(ours_ema["p0"] - 4 * correct[:4].var(unbiased=False).item()) < 1e-7


def test_dynamic_sampling_keeps_groups_the_bonus_pays():
    """With Option B an all-correct group with a paid bonus has non-zero advantages: DAPO's dynamic sampling must
    keep it (its rewards are all equal). An all-correct group without a bonus, an all-wrong group, and under Option A
    (whose bonus is in the rewards already) only the rewards decide."""
    group = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    correct = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    d = torch.tensor([0.2, 0.0, 0.0, 0.0, 0.5, 0.5, 0.1, 0.1])  # group 0 paid; 1 not; 2 novel but wrong; 3 varied
    zero = extra.zero_advantage_groups(correct, correct, d, group, 4, "after")
    assert zero.tolist() == [False, True, True, False]
    assert extra.zero_advantage_groups(correct, correct, d, group, 4, "before").tolist() == [True, True, True, False]


def test_novelty_warmup_history_duplicates_and_self():  # property 4
    g = torch.Generator().manual_seed(1)
    n, H = 4, 6
    group = torch.arange(1).repeat_interleave(n)
    memories = {}
    first = unit(torch.randn(n, 8, generator=g))
    assert torch.equal(extra.group_novelty(memories, [("x",)], group, first, H), torch.zeros(n))  # |M| = 0 < n
    second = unit(torch.randn(n, 8, generator=g))
    d = extra.group_novelty(memories, [("x",)], group, second, H)
    assert (d > 0).all()  # history exists and the embeddings differ
    pool = torch.cat([first, second])
    cos = second @ pool.T
    cos[torch.arange(n), n + torch.arange(n)] = -2  # self masked
    assert torch.allclose(d, (1 - cos.max(1).values).clamp(min=0), atol=1e-3)  # fp16 memory
    assert len(memories[("x",)]) == H  # FIFO: 8 pushed, H kept
    # duplicates: a rollout identical to a sibling has novelty 0; a distinct one is never compared with itself
    dup = torch.cat([second[:1], second[:1], unit(torch.randn(2, 8, generator=g))])
    d = extra.novelty(dup, torch.cat([first, second]), n)
    assert d[0] == 0 and d[1] == 0 and (d[2:] > 0).all()
    empty = torch.cat([torch.zeros(2, 8), second[:2]])  # empty answers embed to zero vectors
    assert extra.novelty(empty, first, n)[:2].tolist() == [0.0, 0.0]
    # other prompts' memories are separate (exact key)
    assert torch.equal(extra.group_novelty(memories, [("y",)], group, second, H), torch.zeros(n))


def test_novelty_pools_a_prompts_groups_of_one_step():
    """Two groups of one prompt in a step (a small pool draws a question twice) are one pool of siblings scored
    against the memory before the step, as the authors' code does: on the first visit neither gets a bonus, and on
    the next each row's nearest neighbour may lie in the other group (catches groups visited in order, the second
    scored against the first's embeddings as if they were history)."""
    g = torch.Generator().manual_seed(2)
    n, H = 4, 16
    group, keys, memories = torch.arange(2).repeat_interleave(n), [("x",), ("x",)], {}
    first = unit(torch.randn(2 * n, 8, generator=g))
    assert torch.equal(extra.group_novelty(memories, keys, group, first, H), torch.zeros(2 * n))
    assert len(memories[("x",)]) == 2 * n
    second = unit(torch.randn(2 * n, 8, generator=g))
    second[0] = second[n]  # a row of group 0 repeats a row of group 1: its nearest sibling is in the other group
    d = extra.group_novelty(memories, keys, group, second, H)
    assert d[0] == 0 and d[n] == 0 and (d[1:n] > 0).all() and (d[n + 1:] > 0).all()


def test_exact_repeats_are_not_novel_after_rounding():
    """An answer equal to a remembered one has d = 0 exactly (§3.1), though its cosine to its fp16 copy in the memory
    rounds below 1 about half the time (up to ~1e-4); rows a little apart keep their distance (catches d > 0 from
    rounding, which the bonus share and --dynamic-sampling's zero-advantage test count as novel)."""
    g = torch.Generator().manual_seed(3)
    memories, group = {}, torch.zeros(64, dtype=torch.long)
    seen = unit(torch.randn(64, 576, generator=g))
    extra.group_novelty(memories, [("x",)], group, seen, 64)
    again = extra.group_novelty(memories, [("x",)], group, seen, 128)
    assert torch.equal(again, torch.zeros(64))
    near = unit(seen + 0.1 * unit(torch.randn(64, 576, generator=g)))  # ~0.005 from its remembered twin
    d = extra.novelty(near, memories[("x",)].float()[:64], 64)
    assert (d > 0.002).all() and (d < 0.01).all(), d


def test_embed_texts_frozen_centred(model):
    """The encoder's embeddings: a text seen before is not novel, a different one is; centred rows are unit length,
    an empty list stays the zero vector, and equal lists (embedded once) get the same row."""
    seqs = [[5, 6, 7, 8], [5, 6, 7, 8], [900, 901, 33], [77, 78, 79, 80, 81], []]
    plain = extra.embed_texts(model, seqs, None, 0, contextlib.nullcontext())
    centre = plain[2:4].mean(0)
    emb = extra.embed_texts(model, seqs, centre, 0, contextlib.nullcontext())
    torch.testing.assert_close(emb[:4].norm(dim=-1), torch.ones(4))
    assert emb[4].abs().sum() == 0
    torch.testing.assert_close(emb[:4], torch.nn.functional.normalize(plain[:4] - centre, dim=-1))
    d = extra.novelty(emb[:4], emb[:2], n=2)  # the memory holds the first text (twice), not the last two
    assert d[0].abs() < 1e-5 and d[1].abs() < 1e-5 and (d[2:] > 0).all()


# real SmolLM2 samples (T = 0.8) for "What is 65 + 43 - 51?", four different answers
SMOLLM2_ANSWERS = [
    "65 + 43 - 51 = 262\n\nYour answer within \\boxed{} is correct, so no need to add another space.",
    "To solve this problem, we need to multiply 65 by 43 and find the result.\n\n65 * 43 = 2561, so the answer is 2561.",
    "Don't use the \\n in place of \\s with curly braces. However, the math is already encapsulated.",
    "First, 65 + 43 = 108. Then 108 - 51 = 57. So the answer is \\boxed{57}.",
]


@pytest.mark.parametrize("blocks", [extra.Config.encoder_blocks, 0])
def test_novelty_of_distinct_answers_on_smollm2(blocks):
    """On the real SmolLM2, different answers to one prompt lie at least 0.1 from their nearest sibling (MiniLM, the
    paper's encoder, puts SmolLM2's siblings a median 0.20 apart), with the default encoder and with all blocks.
    Uncentred they lie 0.02-0.08 apart: catches the centring on the problem statements dropped."""
    tok = Tokenizer.from_pretrained("smollm2")
    encoder, nothing = extra.load_encoder("smollm2", torch.device("cpu"), blocks), contextlib.nullcontext()
    centre = extra.statement_centre(encoder, extra.load_task("arith", "train", n=16, seed=0), tok, nothing)
    emb = extra.embed_texts(encoder, [tok.encode(a) for a in SMOLLM2_ANSWERS], centre, tok.pad_id, nothing)
    d = extra.novelty(emb, emb[:0], n=0)  # nearest sibling, no memory
    assert (d >= 0.1).all(), d


def test_encoder_is_the_first_blocks(tiny_model_dir):
    """--encoder-blocks k: the start model's first k blocks, then its final norm, embed a text (0, or k above the
    model's depth: all of them). Catches the option ignored, or the last k blocks kept instead of the first."""
    seqs, nothing = [[5, 6, 7, 8], [900, 901, 33, 4, 4]], contextlib.nullcontext()
    full = extra.load_encoder(tiny_model_dir, torch.device("cpu"), 0)
    first = extra.load_encoder(tiny_model_dir, torch.device("cpu"), 1)
    assert len(full.layers) == 2 and len(first.layers) == 1
    assert len(extra.load_encoder(tiny_model_dir, torch.device("cpu"), 6).layers) == 2  # a shallower model: all
    by_hand = Transformer.from_pretrained(tiny_model_dir).eval()
    del by_hand.layers[1]
    torch.testing.assert_close(extra.embed_texts(first, seqs, None, 0, nothing),
                               extra.embed_texts(by_hand, seqs, None, 0, nothing), rtol=0, atol=0)
    assert not torch.allclose(extra.embed_texts(full, seqs, None, 0, nothing),
                              extra.embed_texts(first, seqs, None, 0, nothing), atol=1e-3)


def test_resume_keeps_the_encoder():
    """The memories were embedded by the run's encoder: a resume with other --encoder-blocks is refused, and a
    checkpoint from before the option (no key: all blocks) resumes only with --encoder-blocks 0."""
    saved = dataclasses.asdict(extra.Config())
    extra.check_resume(extra.Config(), saved)
    with pytest.raises(ConfigError, match="--encoder-blocks"):
        extra.check_resume(extra.Config(encoder_blocks=4), saved)
    del saved["encoder_blocks"]
    extra.check_resume(extra.Config(encoder_blocks=0), saved)
    with pytest.raises(ConfigError, match="--encoder-blocks"):
        extra.check_resume(extra.Config(), saved)


def test_response_tail():
    toks = list(range(10, 30)) + [2]  # 20 tokens then the stop token
    assert extra.response_tail(toks, {2}, tail=8, head=5) == list(range(22, 27))


# --------------------------------------------------------- prefix regeneration (properties 5-7, 9, 10)

def test_hard_prompts():  # property 5
    correct = torch.zeros(4, 6)
    for r, k in enumerate([0, 1, 2, 6]):
        correct[r, :k] = 1
    assert extra.is_hard(correct).tolist() == [True, True, False, False]


def test_newline_ids_smollm2():
    tok = Tokenizer.from_pretrained("smollm2")
    ids = extra.newline_ids(tok)
    assert ids and all(tok.decode([i]) in ("\n", "\n\n") for i in ids)
    # tokens that hold a line break and more (".\n\n", "\n\n\n", " \n") exist in this vocabulary and mark no boundary
    merged = {i for i in range(2000) if "\n" in tok.decode([i]) and tok.decode([i]) not in ("\n", "\n\n")}
    assert merged and not merged & ids, merged & ids


@pytest.mark.parametrize("seed", range(5))
def test_prefix_cuts_and_mte(seed):  # property 6
    g = torch.Generator().manual_seed(seed)
    NL = 198
    tokens = torch.randint(3, 50, (300,), generator=g)
    tokens[torch.rand(300, generator=g) < 0.15] = NL
    tokens = tokens.tolist()
    ent = torch.rand(300, generator=g)
    for gap in (1, 8, 32):
        cuts = extra.prefix_cuts(tokens, {NL}, gap, max_cuts=15)
        assert 1 <= len(cuts) <= 15
        assert all(tokens[b - 1] == NL for b in cuts)  # right after a line break
        assert all(b2 - b1 >= gap for b1, b2 in zip(cuts, cuts[1:])) and cuts[0] == tokens.index(NL) + 1  # the first
        assert all(b < len(tokens) for b in cuts)  # strict prefixes
        mte = extra.prefix_mte(ent, cuts)
        assert torch.allclose(mte, torch.stack([ent[:b].mean() for b in cuts]))


def test_prefix_cuts_edge_cases():
    NL = 198
    assert extra.prefix_cuts([5, 6, 7], {NL}, 1) == []  # no line break, no prefix
    assert extra.prefix_cuts([5, 6, NL, 7], {NL}, 1) == [3]  # a single boundary is kept
    assert extra.prefix_cuts([5, NL, 6, NL, 7], {NL}, 1) == [2]  # of two, the last is dropped
    assert extra.prefix_cuts([5, NL, 6, NL, 7], {NL}, 3) == [2]  # thinning: the second is too close to the first
    many = ([5] * 3 + [NL]) * 40
    cuts = extra.prefix_cuts(many, {NL}, 4, max_cuts=15)
    assert len(cuts) == 15 and cuts == sorted(set(cuts))


def test_select_prefix():  # property 7
    mte = torch.tensor([0.5, 0.2, 0.9, 0.3])
    assert extra.select_prefix(torch.eye(4), mte, tau=1e-4) == 1  # τ→0, orthogonal: the raw argmin
    same = torch.ones(4, 3)
    assert extra.select_prefix(same, mte, tau=0.1) == 0  # identical: all equal the mean, the first wins
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        k = int(torch.randint(1, 9, (1,), generator=g))
        assert 0 <= extra.select_prefix(torch.randn(k, 5, generator=g), torch.rand(k, generator=g), 0.1) < k
    # smoothing: a low-MTE prefix among similar high-MTE ones loses to a moderately low isolated one
    emb = torch.tensor([[1.0, 0.0], [0.99, 0.14], [0.98, 0.2], [0.0, 1.0]])
    assert extra.select_prefix(emb, torch.tensor([0.1, 0.9, 0.9, 0.3]), tau=0.1) == 3


def test_select_prefix_without_smoothing():
    """--tau 0 (ablation): the raw MTE's argmin, where τ = 0.1's smoothing picks the isolated prefix (catches τ = 0
    falling through to softmax(E Eᵀ / 0))."""
    emb = torch.tensor([[1.0, 0.0], [0.99, 0.14], [0.98, 0.2], [0.0, 1.0]])
    assert extra.select_prefix(emb, torch.tensor([0.1, 0.9, 0.9, 0.3]), tau=0.0) == 0


ABLATIONS = [  # the module docstring's switches and what each sets
    (["--no-regen"], dict(novelty=True, regen=False)),
    (["--no-novelty"], dict(novelty=False, regen=True)),
    (["--no-novelty", "--no-regen"], dict(novelty=False, regen=False, dual_clip=10.0)),
    (["--novelty-mode", "before"], dict(novelty_mode="before")),
    (["--alpha", "0.05"], dict(alpha=0.05)),
    (["--tau", "0"], dict(tau=0.0)),
    (["--regen-warmup", "200"], dict(regen_warmup=200)),
    (["--no-cuttable-only"], dict(cuttable_only=False)),
]


@pytest.mark.parametrize("args,fields", ABLATIONS)
def test_ablation_switches_documented_and_valid(args, fields):
    """Each ablation switch is in the module docstring, parses to the fields it names and passes validation."""
    assert " ".join(args) in extra.__doc__
    cfg = extra.parse(extra.Config, args)
    extra.validate(cfg)
    assert all(getattr(cfg, k) == v for k, v in fields.items())
    assert extra.Config().regen_rows / extra.Config().prompts_per_step <= 1 / 16  # guided rows: a small share (recipe 3%)


def test_guided_context_queue_and_inject():  # properties 8-10 (the parts without a model)
    assert extra.guided_context([1, 2, 3], [4, 5], 10) == [1, 2, 3, 4, 5]
    assert extra.guided_context([1, 2, 3], [4, 5], 4) == [1, 2, 3, 4]  # head kept
    queue = extra.push_queue([], [dict(context=[i], answer=str(i)) for i in range(5)], max_size=3)
    assert [q["answer"] for q in queue] == ["2", "3", "4"]  # overflow drops the oldest
    contexts, answers = [[10], [11], [12], [13]], ["a", "b", "c", "d"]
    c, a, guided, rest = extra.inject(contexts, answers, queue, k=2)
    assert c == [[10], [11], [2], [3]] and a == ["a", "b", "2", "3"]  # the tail rows, graded by their own answer
    assert guided.tolist() == [False, False, True, True] and [q["answer"] for q in rest] == ["4"]  # FIFO pop
    c, a, guided, rest = extra.inject(contexts, answers, rest, k=3)
    assert guided.sum() == 1 and rest == []  # at most what the queue holds
    c, a, guided, rest = extra.inject(contexts[:1], answers[:1], queue, k=3)
    assert guided.sum() == 1 and len(rest) == 2  # at most the batch



def test_positive_on_guided_clamps_only_the_guided_groups_negatives():
    adv = torch.tensor([-1.0, 1.0, -0.5, 0.5, -2.0, 2.0])
    group = torch.tensor([0, 0, 1, 1, 2, 2])
    guided = torch.tensor([False, True, True])
    assert extra.positive_on_guided(adv, group, guided).tolist() == [-1.0, 1.0, 0.0, 0.5, 0.0, 2.0]


def test_guided_positive_only_reaches_the_update(tmp_path, line_model_dir, monkeypatch):
    """--guided-positive-only: the update sees no negative advantage on a guided row's completions; without it the
    same run's guided rows keep theirs (catches the flag not wired in, or clamping every row). A verifier that
    passes about half of all answers (by a hash of the text) makes hard prompts and mixed guided groups common."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(extra, "score", lambda text, answer: float(zlib.crc32(text.encode()) % 2))
    real_update, real_inject = extra.update, extra.inject

    def run(name, *flags):
        seen, guided_of_step = [], []

        def inject(*a, **kw):
            out = real_inject(*a, **kw)
            guided_of_step.append(out[2])
            return out

        def update(policy, model, optimizer, b, adv, *a, **kw):
            seen.append((adv.clone(), guided_of_step[-1][b.group]))
            return real_update(policy, model, optimizer, b, adv, *a, **kw)

        monkeypatch.setattr(extra, "inject", inject)
        monkeypatch.setattr(extra, "update", update)
        extra.main([*host_args(line_model_dir, tmp_path), "--temperature", "1.0", "--regen-warmup", "0",
                    "--steps", "6", "--regen-rows", "2", "--run-name", name, "--eval-size", "1",
                    "--eval-max-new-tokens", "0", *flags])
        return [a for adv, on in seen for a in adv[on].tolist()], [a for adv, on in seen for a in adv[~on].tolist()]

    guided_plain, other_plain = run("plain")
    guided_pos, other_pos = run("pos", "--guided-positive-only")
    assert min(guided_plain) < 0, "no guided completion with a negative advantage: the test needs one"
    assert guided_pos and min(guided_pos) >= 0
    assert min(other_pos) < 0  # the other rows keep their negative advantages

def test_regenerate_stores_selects_and_queues():
    NL = 198
    cfg = extra.Config(boundary_gap=2, max_prefixes=15, prefix_memory=5, tau=0.1, max_prompt_len=100,
                       cuttable_only=True, embed_tokens=256)
    state = {"prefixes": {}}
    tokens = [[7, 8, NL, 9, 10, NL, 11, 2], [3, 4, 2], [7, 8, NL, 5, 6, NL, 12, 2]]
    ent = [torch.tensor([0.5, 0.5, 0.1, 0.9, 0.9, 0.1, 0.3, 0.1]), torch.full((3,), 0.01), torch.ones(8)]
    fake = lambda seqs: unit(torch.tensor([[len(s), 1.0] for s in seqs]))  # noqa: E731
    items, stored = extra.regenerate(state, [([1, 2], "42", tokens, ent)], fake, {NL}, cfg)
    # rollout 1 is the most confident but has no line break: the most confident cuttable one (0) is cut
    assert stored == 1 and state["prefixes"][(1, 2)][0]["ids"] == [7, 8, NL]
    assert items == [dict(context=[1, 2, 7, 8, NL], answer="42")]
    assert abs(state["prefixes"][(1, 2)][0]["mte"] - ent[0][:3].mean().item()) < 1e-6
    cfg.cuttable_only = False
    items, stored = extra.regenerate(state, [([1, 2], "42", tokens, ent), ([3], "7", tokens, ent)], fake, {NL}, cfg)
    # the paper's rule: the most confident rollout has no break, nothing is stored; yet a hard prompt with prefixes
    # stored on an earlier visit is queued again (as the official code), one without any is not
    assert stored == 0 and items == [dict(context=[1, 2, 7, 8, NL], answer="42")]
    # rows none of whose rollouts can be cut are passed without them (the loop scores only cuttable ones)
    items, stored = extra.regenerate(state, [([1, 2], "42", [], []), ([3], "7", [], [])], fake, {NL}, cfg)
    assert stored == 0 and items == [dict(context=[1, 2, 7, 8, NL], answer="42")]
    cfg.cuttable_only = True
    for _ in range(4):
        extra.regenerate(state, [([1, 2], "42", tokens, ent)], fake, {NL}, cfg)
    assert len(state["prefixes"][(1, 2)]) == 5  # prefix memory is a FIFO of prefix_memory entries


def test_token_entropy_bounds(model):  # property 11
    """The regeneration's entropies: π_θold's over the whole vocabulary at the rollout temperature (as verl computes
    them in the authors' code), recorded by the sampler while it samples: within [0, log V]."""
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(3, 5000, (5,), generator=g).tolist() for _ in range(2)]
    groups = extra.generate(model, contexts, n=2, max_new_tokens=7, temperature=0.8, stop_ids=(), seed=0)
    for c, group in zip(contexts, groups):
        for s in group:
            with torch.no_grad():
                logp = (model(torch.tensor([c + s.tokens]))[0, len(c) - 1:-1].float() / 0.8).log_softmax(-1)
            assert (s.entropies >= 0).all() and (s.entropies <= math.log(model.cfg.vocab_size) + 1e-4).all()
            assert torch.allclose(s.entropies, -(logp.exp() * logp).sum(-1), atol=1e-4)


# ------------------------------------------------------------------------------------ the loop itself

@pytest.fixture(scope="module")
def line_model_dir(tiny_model_dir, tmp_path_factory):
    """A tiny model that writes digits and line breaks only (its untied LM head scores nothing else), so that
    completions have cut points, some are right, and both mechanisms act within a few steps."""
    import shutil

    m = Transformer.from_pretrained(tiny_model_dir)
    tok = Tokenizer.from_pretrained(tiny_model_dir)
    ids = [tok.encode(str(d))[0] for d in range(10)] + [tok.encode("\n")[0]]
    m.cfg.tie_word_embeddings = False
    head = torch.zeros_like(m.lm_head.weight)
    head[ids] = 3.0 * torch.randn(len(ids), head.shape[1], generator=torch.Generator().manual_seed(0))
    m.lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
    m.lm_head.weight.data.copy_(head)
    folder = tmp_path_factory.mktemp("lines") / "model"
    m.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, folder / name)
    return folder


def host_args(model_dir, tmp_path):
    """Options both grpo.py and extra.py take: three prompts that keep coming back."""
    task = tmp_path / "say.jsonl"
    # three train prompts (and one held out, by the task's hash split) whose answers the line model writes
    # last now and then, each about 15-40% of the time
    task.write_text("".join(json.dumps({"prompt": f"Say {p}", "answer": a}) + "\n" for p, a in
                            (("nine", "9"), ("three", "4063"), ("five", "40"), ("zero", "9"))))
    return ["--model", str(model_dir), "--task", str(task), "--prompts-per-step", "2", "--group-size", "4",
            "--max-new-tokens", "12", "--eval-size", "2", "--micro-batch", "8", "--eval-every", "100",
            "--lr", "1e-5", "--temperature", "1.0", "--dtype", "float32", "--device", "cpu"]


# ExTra's options for the tiny runs: regeneration from step 2, cut points 2 tokens apart, one guided row a step
EXTRA_ARGS = ["--boundary-gap", "2", "--regen-warmup", "1", "--regen-rows", "1", "--memory-size", "4"]


def metrics(tmp_path, name):
    return [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def train_rows(tmp_path, name):
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("perf/", "reward/groups_refilled", "reward/refill_rounds"))}
            for r in metrics(tmp_path, name) if "reward/mean" in r}


def weights(tmp_path, name):
    return load_file(str(tmp_path / "runs" / name / "checkpoint" / "model.safetensors"))


def test_mechanisms_off_is_a_grpo_step(tmp_path, line_model_dir, monkeypatch):  # property 1
    """--no-novelty --no-regen: one step of extra.py gives exactly grpo.py's weights with the same options
    (ExTra's dual clip stays on: it cannot bind at ratio 1; the KL term is on in both, to check it is unchanged)."""
    monkeypatch.chdir(tmp_path)
    host = [*host_args(line_model_dir, tmp_path), "--steps", "1"]
    grpo.main([*host, "--kl-coef", "0.001", "--run-name", "g"])
    extra.main([*host, *EXTRA_ARGS, "--kl-coef", "0.001", "--no-novelty", "--no-regen", "--run-name", "x"])
    g, x, init = weights(tmp_path, "g"), weights(tmp_path, "x"), load_file(str(line_model_dir / "model.safetensors"))
    assert g.keys() == x.keys() and all(torch.equal(g[k], x[k]) for k in g)
    assert any(not torch.equal(g[k], init[k]) for k in g)  # the step did move the weights
    gm, xm = train_rows(tmp_path, "g")[1], train_rows(tmp_path, "x")[1]
    assert {k: v for k, v in xm.items() if not k.startswith("extra/")} == gm


def test_both_mechanisms_act_in_the_loop(tmp_path, line_model_dir, monkeypatch):  # properties 8-10 in main()
    """Spy on the loop: which contexts are sampled, which answers grade them, what the update trains on."""
    monkeypatch.chdir(tmp_path)
    tok = Tokenizer.from_pretrained(line_model_dir)
    prompt_of = {tuple(tok.prompt(extra.format_question(p))): p.answer
                 for p in extra.load_task(str(host_args(line_model_dir, tmp_path)[3]), "train")}
    seen = []  # per step: (contexts, n, answers graded per completion, the trained batch, its advantages, novelty, rewards)
    real_generate, real_score, real_update = extra.generate, extra.score, extra.update
    real_novelty, real_embed = extra.group_novelty, extra.embed_texts
    initial = Transformer.from_pretrained(line_model_dir).state_dict()

    def score(text, answer):
        seen[-1][2].append(answer)
        seen[-1][6].append(real_score(text, answer))
        return seen[-1][6][-1]

    def embed_texts(encoder, *a):  # the novelty and the prefixes are embedded by the initial weights, frozen
        assert all(torch.equal(v, initial[k]) for k, v in encoder.state_dict().items())
        return real_embed(encoder, *a)

    monkeypatch.setattr(extra, "generate", lambda m, ctx, n, **k: seen.append([ctx, n, [], None, None, None, []]) or real_generate(m, ctx, n, **k))
    monkeypatch.setattr(extra, "score", score)
    monkeypatch.setattr(extra, "embed_texts", embed_texts)
    monkeypatch.setattr(extra, "group_novelty", lambda *a: seen[-1].__setitem__(5, real_novelty(*a)) or seen[-1][5])
    monkeypatch.setattr(extra, "update", lambda pol, m, o, b, adv, *a, **k: seen[-1].__setitem__(3, b)
                        or seen[-1].__setitem__(4, adv) or real_update(pol, m, o, b, adv, *a, **k))
    warmup = 1
    extra.main([*host_args(line_model_dir, tmp_path), *EXTRA_ARGS, "--steps", "6", "--run-name", "on",
                "--queue-size", "3"])
    rows = train_rows(tmp_path, "on")
    seen = [s for s in seen if s[3] is not None]  # training steps only (evaluation samples too)
    assert len(seen) == 6
    bonus_paid = False
    for step, (ctx, n, answers, b, adv, d, correct) in enumerate(seen, start=1):
        r = rows[step]
        # the update receives GRPO's advantages plus α·d on correct completions (catches the bonus dropped before it)
        correct = torch.tensor(correct)
        bonus = 0.1 * d * correct
        torch.testing.assert_close(adv, extra.group_advantages(correct, b.group, "std") + bonus)
        bonus_paid |= bool(bonus.any())
        assert r["extra/queue_len"] <= 3
        if step <= warmup:  # property 9: nothing stored, queued or injected before the warm-up ends
            assert r["extra/prefixes_stored"] == r["extra/queue_len"] == r["extra/guided_rows"] == 0
        guided = [c for c in ctx if tuple(c) not in prompt_of]
        assert len(guided) == r["extra/guided_rows"] <= 1 and ctx[len(ctx) - len(guided):] == guided  # the tail rows
        for i, c in enumerate(ctx):
            origin = [p for p in prompt_of if tuple(c[:len(p)]) == p]
            assert len(origin) == 1  # property 8: prompt ++ prefix
            assert answers[i * n:(i + 1) * n] == [prompt_of[origin[0]]] * n  # property 10: the origin's answer
            own = slice(i * n, (i + 1) * n)  # row i's completions in the flat batch
            assert all(x == c for x in b.context[own]) and (b.group == b.group[i * n]).sum() == n  # its own group of n
            assert b.skip[own].sum() == 0  # the prefix is context: no completion token of it is trained
    assert sum(r["extra/guided_rows"] for r in rows.values()) >= 2
    assert sum(r["extra/prefixes_stored"] for r in rows.values()) > 0
    assert max(r["extra/novelty"] for r in rows.values()) > 0 and rows[1]["extra/novelty"] == 0
    assert max(r["extra/bonus_share"] for r in rows.values()) > 0 and bonus_paid


# A run cut at step 2 by a crash had taken the whole run's rates; asked for 2 steps, it would decay its own last steps
# (--decay-steps): it runs without the decay, which in the 4-step run is still under the warm-up at steps 1 and 2.
AS_IF_CUT = ["--decay-steps", "0"]


def test_resume_gives_the_same_run(tmp_path, line_model_dir, monkeypatch):
    """Memories, prefix memories and the queue travel in the checkpoint: a cut run continues exactly."""
    monkeypatch.chdir(tmp_path)
    common = [*host_args(line_model_dir, tmp_path), *EXTRA_ARGS]
    extra.main([*common, "--steps", "4", "--run-name", "full"])
    extra.main([*common, "--steps", "2", "--run-name", "cut", *AS_IF_CUT])
    extra.main([*common, "--steps", "4", "--run-name", "cut", "--resume"])
    full, cut = train_rows(tmp_path, "full"), train_rows(tmp_path, "cut")
    assert sorted(cut) == [1, 2, 3, 4]
    assert full[2]["extra/queue_len"] > 0 and full[3]["extra/guided_rows"] > 0  # the queue crossed the cut
    assert full[3]["extra/novelty"] > 0  # and so did the novelty memory
    for step in (3, 4):
        assert cut[step] == full[step], step
    f, c = weights(tmp_path, "full"), weights(tmp_path, "cut")
    assert all(torch.equal(f[k], c[k]) for k in f)


def test_smoke_default_options(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """main() with the defaults but a tiny model and budget: runs, evaluates, saves ExTra's state."""
    monkeypatch.chdir(tmp_path)
    extra.main(["--model", str(tiny_model_dir), "--steps", "2", "--run-name", "smoke", "--prompts-per-step", "2",
                "--group-size", "2", "--memory-size", "2", "--max-new-tokens", "6", "--eval-size", "3",
                "--micro-batch", "2", "--dtype", "float32"])
    rows = metrics(tmp_path, "smoke")
    assert [row["step"] for row in rows if "reward/mean" in row] == [1, 2]
    assert [row["step"] for row in rows if "eval/greedy_acc" in row] == [0, 2]
    assert all("extra/novelty" in row for row in rows if "reward/mean" in row)
    assert "done: greedy accuracy" in capsys.readouterr().out
    state = torch.load(tmp_path / "runs" / "smoke" / "checkpoint" / "trainer.pt", weights_only=False)["extra"]
    assert set(state["extra_state"]) == {"novelty", "var_ema", "prefixes", "queue"}


@pytest.mark.parametrize("args,words", [
    (["--memory-size", "2", "--group-size", "4"], ["--memory-size", "at least group_size"]),
    (["--tau", "-1"], ["tau"]),
    (["--dual-clip", "0.5"], ["--dual-clip"]),
    (["--novelty-mode", "sideways"], ["--novelty-mode", "invalid choice"]),
    (["--loss-type", "cispo"], ["--loss-type", "dual clip"]),
    (["--max-new-tokens", "2100"], ["--max-prompt-len/max-new-tokens", "guided prompt"]),  # 2048 + 2100 > 4096
    (["--encoder-blocks", "-1"], ["--encoder-blocks", ">= 0"]),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, tiny_model_dir, monkeypatch, capsys, args, words):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        main_guard(lambda: extra.main(["--model", str(tiny_model_dir), "--run-name", "bad", *args]))
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert all(w in err for w in words), err
    assert not (tmp_path / "runs").exists()


def test_option_a_in_the_loop(tmp_path, line_model_dir, monkeypatch):
    """--novelty-mode before: the bonus is paid into the rewards (extra/bonus_mean, what the rewards gained over the
    verifier's), while reward/ keeps reporting the verifier's scores."""
    monkeypatch.chdir(tmp_path)
    extra.main([*host_args(line_model_dir, tmp_path), *EXTRA_ARGS, "--steps", "3", "--run-name", "a",
                "--novelty-mode", "before", "--alpha", "0.5", "--no-regen"])
    rows = train_rows(tmp_path, "a")
    paid = [r for r in rows.values() if r["extra/bonus_share"] > 0]
    assert paid and all(r["extra/bonus_mean"] > 0 for r in paid)  # what the rewards gained (rewards - verifier's)
    assert all(r["reward/mean"] == pytest.approx(r["reward/acc"]) for r in rows.values())  # reward/: the verifier's


# ------------------------------------------------------------- added by mutation testing (fail on a mutant each)

def test_novelty_memory_is_the_last_H_rollouts():
    """§3.1's memory is the prompt's last H rollouts: after three visits of G = 2 with H = 4 the first visit's
    embeddings are gone, so a rollout equal to one of them is novel and one equal to a kept one is not (catches a
    FIFO that keeps the oldest H)."""
    g = torch.Generator().manual_seed(4)
    visits = [unit(torch.randn(2, 8, generator=g)) for _ in range(3)]
    memories, group = {}, torch.zeros(2, dtype=torch.long)
    for v in visits:
        extra.group_novelty(memories, [("x",)], group, v, 4)
    torch.testing.assert_close(memories[("x",)].float(), torch.cat(visits[1:]), atol=1e-3, rtol=0)
    d = extra.group_novelty(memories, [("x",)], group, torch.cat([visits[0][:1], visits[2][1:]]), 4)
    assert d[0] > 0.05 and d[1] < 1e-3, d


def test_prefix_cuts_gap_is_at_least_not_more_than():
    """Cut points are kept greedily at least min_gap apart (§3.2's boundary gap): with a line break at every token they
    fall exactly min_gap apart from the first break on, the last dropped (catches a strict gap, min_gap + 1 apart,
    and a first cut that waits min_gap tokens, which the authors' merge of close splits does not)."""
    NL = 198
    for gap in (1, 3, 5):
        cuts = extra.prefix_cuts([NL] * 31, {NL}, gap, max_cuts=100)
        assert cuts == list(range(1, 32, gap))[:-1], (gap, cuts)  # 1, 1 + gap, ..., the last dropped
    # breaks after tokens 5, 33, 40 and 70, gap 32: 5 kept, 33 too close to it, 40 kept, 70 too close; 40 dropped
    tokens = [NL if i in (4, 32, 39, 69) else 5 for i in range(80)]
    assert extra.prefix_cuts(tokens, {NL}, 32) == [5]


def test_prefix_cuts_thinning_spreads_over_the_whole_answer():
    """More candidates than max_cuts: the kept cut points are spread evenly over all candidates, from the first to
    near the last, not the first max_cuts of them (catches a thinning that keeps only the answer's beginning)."""
    NL = 198
    tokens = ([5] * 3 + [NL]) * 40  # a candidate every 4 tokens
    every = extra.prefix_cuts(tokens, {NL}, 4, max_cuts=1000)  # 39 (the last break dropped)
    cuts = extra.prefix_cuts(tokens, {NL}, 4, max_cuts=15)
    assert len(cuts) == 15 and set(cuts) <= set(every) and cuts[0] == every[0]
    spacing = {(b - a) // 4 for a, b in zip(cuts, cuts[1:])}  # in candidates
    assert max(spacing) - min(spacing) <= 1 and cuts[-1] >= every[-1] - 4 * (len(every) // 15 + 1), cuts


def test_select_prefix_smoothing_is_a_weighted_mean():
    """m̃ = softmax(E Eᵀ / τ) m with each row of the softmax summing to 1 (§3.2): m̃ is a weighted mean of the MTEs,
    so adding a constant to every MTE cannot change the choice (catches the softmax taken over the wrong axis)."""
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        k = int(torch.randint(2, 9, (1,), generator=g))
        emb, mte = torch.randn(k, 4, generator=g), torch.rand(k, generator=g)
        for tau in (0.1, 1.0):
            assert extra.select_prefix(emb, mte, tau) == extra.select_prefix(emb, mte + 1.0, tau)


def test_regenerate_scores_the_cut_rollout_and_keeps_the_newest_prefixes():
    """A stored prefix's MTE is the mean T = 1 entropy over the prefix of the rollout it was cut from (§3.2), whichever
    member of the group that is, and the prefix memory keeps the newest --prefix-memory entries (catches the MTE read
    off another rollout, or a memory that keeps the oldest)."""
    NL = 198
    cfg = extra.Config(boundary_gap=1, prefix_memory=2, tau=0.1, max_prompt_len=100, cuttable_only=True)
    fake = lambda seqs: unit(torch.tensor([[len(s), 1.0] for s in seqs]))  # noqa: E731
    state = {"prefixes": {}}
    for v in range(3):  # three visits; the most confident rollout is the group's last, cut after its first break
        tokens = [[4, NL, 5, NL, 6], [4, NL, 5, NL, 6], [10 + v, NL, 7, NL, 2]]
        ent = [torch.full((5,), 2.0), torch.full((5,), 1.5), torch.tensor([0.2 + v, 0.4, 0.0, 0.0, 0.0])]
        extra.regenerate(state, [([1], "9", tokens, ent)], fake, {NL}, cfg)
    memory = state["prefixes"][(1,)]
    assert [m["ids"] for m in memory] == [[11, NL], [12, NL]]
    assert [m["mte"] for m in memory] == pytest.approx([(1.2 + 0.4) / 2, (2.2 + 0.4) / 2])


def test_regeneration_scores_the_rollouts_own_entropies(tmp_path, line_model_dir, monkeypatch):
    """§3.2's MTE is π_θold's at the rollout temperature (verl divides the logits by it in the authors' code): the
    loop hands regenerate each hard row's rollouts with the sampler's entropies of their tokens at --temperature
    (catches entropies at another temperature, or of other rollouts)."""
    monkeypatch.chdir(tmp_path)
    sampled, handed, real = [], [], extra.generate

    def generate(*a, **kw):
        groups = real(*a, **kw)
        if kw.get("temperature") == 0.7:  # the training samples (evaluation is greedy)
            sampled.append({tuple(s.tokens): s.entropies for g in groups for s in g})
        return groups

    def regenerate(state, rows, embed, nl_ids, cfg):
        handed.extend(rows)
        return [], 0

    monkeypatch.setattr(extra, "generate", generate)
    monkeypatch.setattr(extra, "regenerate", regenerate)
    extra.main([*host_args(line_model_dir, tmp_path), "--temperature", "0.7", "--regen-warmup", "0", "--no-novelty",
                "--steps", "2", "--run-name", "t", "--eval-size", "1", "--eval-max-new-tokens", "0"])
    assert handed, "no hard row was handed to regenerate: the test needs one"
    for _, _, tokens, entropies in handed:
        for t, e in zip(tokens, entropies):
            assert any(torch.equal(e, step.get(tuple(t), torch.empty(0))) for step in sampled)
