"""XRPO: the allocator, ICL seeding, the corpus, novelty sharpening, and the loop (properties 1-13 of the
method's test list: the numbers in the test names)."""
import math
import random

import pytest
import torch

import xrpo
from common.model import Transformer
from common.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return Transformer.from_pretrained(tiny_model_dir).eval()


# ------------------------------------------------------------------------------------ 1-6: the allocator

@pytest.mark.parametrize("p,dof,value", [
    (0.975, 3, 3.1824), (0.975, 4, 2.7764), (0.975, 7, 2.3646),  # the three of property 1
    (0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 10, 2.2281), (0.975, 30, 2.0423),
    (0.95, 5, 2.0150), (0.995, 20, 2.8453), (0.9, 1, 3.0777), (0.025, 3, -3.1824)])
def test_1_t_quantile_known_values(p, dof, value):
    assert xrpo.t_quantile(p, dof) == pytest.approx(value, abs=1e-3)


def test_1_t_quantile_tends_to_the_normal():
    assert xrpo.t_quantile(0.975, 2000) == pytest.approx(1.95996, abs=2e-3)
    assert xrpo.t_quantile(0.5, 6) == pytest.approx(0.0, abs=1e-12)
    qs = [xrpo.t_quantile(0.975, d) for d in range(1, 60)]
    assert all(a > b for a, b in zip(qs, qs[1:]))  # heavier tails with fewer degrees of freedom


def test_2_delta_shape():
    assert xrpo.ci_shrink(0.0, 5, 0.95) == 0.0
    assert xrpo.ci_shrink(0.5, 1, 0.95) == 0.0  # t with 0 degrees of freedom: undefined, defined as 0
    deltas = [xrpo.ci_shrink(0.4, n, 0.95) for n in range(2, 40)]
    assert all(d > 0 for d in deltas)
    assert all(a > b for a, b in zip(deltas, deltas[1:]))  # strictly decreasing in n
    for n in (2, 4, 9):  # linear in s
        assert xrpo.ci_shrink(0.3, n, 0.95) * 2 == pytest.approx(xrpo.ci_shrink(0.6, n, 0.95), rel=1e-12)


def test_3_magnitudes():
    assert xrpo.ci_shrink(0.5774, 4, 0.95) == pytest.approx(0.2018, abs=5e-4)
    assert xrpo.explore_bonus(0.1, 32, 4) == pytest.approx(0.0935, abs=5e-4)
    # the rewards [1, 1, 0, 0] have exactly that std; their priority is the sum
    pri = xrpo.priorities([[1, 1, 0, 0]], 32, 0.1, 0.95)[0]
    assert pri == pytest.approx(0.2018 + 0.0935, abs=1e-3)


@pytest.mark.parametrize("greedy", [False, True])
def test_4_equal_prompts_share_evenly(greedy):
    for B, T in [(8, 16), (5, 13), (3, 2), (16, 32)]:
        got = xrpo.allocate([[1, 0, 0, 1]] * B, T, 0.1, 0.95, "greedy" if greedy else "proportional")
        assert sum(got) == T and max(got) - min(got) <= 1


@pytest.mark.parametrize("greedy", [False, True])
def test_5_integer_budget_and_monotone_in_std(greedy):
    rng = random.Random(0)
    for _ in range(60):
        B, n, T = rng.randint(1, 10), rng.randint(2, 8), rng.randint(0, 40)
        rewards = [[float(rng.random() < rng.random()) for _ in range(n)] for _ in range(B)]
        lam = rng.choice([0.0, 0.1, 0.5])
        got = xrpo.allocate(rewards, T, lam, 0.95, "greedy" if greedy else "proportional")
        assert all(isinstance(g, int) and g >= 0 for g in got) and sum(got) == T
        std = [torch.tensor(r).std().item() for r in rewards]
        for a in range(B):
            for b in range(B):
                if std[a] > std[b] + 1e-9:
                    assert got[a] >= got[b], (rewards, got)


def test_5_uneven_when_stds_differ():
    got = xrpo.allocate([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], 16, 0.1, 0.95)
    assert sum(got) == 16 and got[0] > got[1] and got[1] == got[2] and got[3] > got[1]


def test_6_lambda_zero_and_positive():
    rewards = [[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 1]]
    for greedy in (False, True):
        got = xrpo.allocate(rewards, 13, 0.0, 0.95, "greedy" if greedy else "proportional")
        assert got[1] == 0 and got[2] == 0 and sum(got) == 13
    assert all(p > 0 for p in xrpo.priorities(rewards, 13, 0.1, 0.95))  # every raw share T·Π/ΣΠ > 0
    for mode in ("proportional", "greedy"):  # nothing ranks them: an even split, not all to the first prompt
        assert xrpo.allocate([[0, 0, 0]] * 4, 6, 0.0, 0.95, mode) == [2, 2, 1, 1], mode


def test_round_budgets_put_the_remainder_last():
    assert xrpo.round_budgets(32, 2) == [16, 16]
    assert xrpo.round_budgets(33, 2) == [16, 17]
    assert xrpo.round_budgets(5, 3) == [1, 1, 3]
    assert xrpo.round_budgets(0, 0) == [] and xrpo.round_budgets(0, 2) == [0, 0]


# -------------------------------------------------------------------------- 7-8: ICL seeding, the corpus

PROBLEMS = ["Tom has 3 apples and buys 4 more. How many apples?", "What is 12 + 30?",
            "Anna has 5 coins and finds 2 more. How many coins?", "What is 7 * 8 - 3?"]


@pytest.fixture
def corpus(tiny, tok):
    c = xrpo.Corpus()
    c.embed_new(tiny, tok, PROBLEMS)
    return c


def test_7_trigger_exemplars_and_fallback(corpus, tok):
    plain = [tok.prompt(p) for p in PROBLEMS]
    alloc = [2, 2, 2, 2]
    # empty corpus: every context is the plain prompt, identical
    ctx = xrpo.round_contexts(tok, PROBLEMS, plain, [[0, 0]] * 4, alloc, corpus, 2, 1024)
    assert all(ids == p and not is_icl for (ids, is_icl), p in zip(ctx, plain))
    solutions = ["a \\boxed{7}", "b \\boxed{42}", "c \\boxed{7}", "d \\boxed{53}"]
    xrpo.update_corpus(corpus, PROBLEMS, solutions, [1, 1, 1, 0])
    correct = [[0, 1], [0, 0], [0, 0], [0, 0]]
    ctx = xrpo.round_contexts(tok, PROBLEMS, plain, correct, alloc, corpus, 2, 1024)
    assert ctx[0] == (plain[0], False)  # a prompt with a correct rollout is never seeded
    for q in (1, 2, 3):
        ids, is_icl = ctx[q]
        text = tok.decode(ids)
        assert is_icl and text.count("<example id=") <= 2 and f"<new_problem>{PROBLEMS[q]}</new_problem>" in text
        assert PROBLEMS[q] not in text.replace(f"<new_problem>{PROBLEMS[q]}</new_problem>", "")  # never q itself
    assert tok.decode(ctx[1][0]).count("<example id=") == 2
    # the only solved problems are 0 and 2: problem 2's examples can only be problem 0's (and 1's)
    assert "c \\boxed{7}" not in tok.decode(ctx[2][0])
    # ICL switched off, or no rollouts this round: plain
    off = xrpo.round_contexts(tok, PROBLEMS, plain, correct, alloc, corpus, 2, 1024, icl=False)
    assert all(not is_icl for _, is_icl in off)
    assert xrpo.round_contexts(tok, PROBLEMS, plain, correct, [2, 0, 2, 2], corpus, 2, 1024)[1] == (plain[1], False)


def test_7_layout_and_k(corpus, tok):
    shots = [("P1", "S1"), ("P2", "S2")]
    text = xrpo.icl_question("NEW", shots)
    order = [text.index(t) for t in ("<task>", "</task>", "<examples>", '<example id="1">', "<problem>P1</problem>",
                                     "<solution>S1</solution>", '<example id="2">', "</examples>",
                                     "<new_problem>NEW</new_problem>")]
    assert order == sorted(order)
    xrpo.update_corpus(corpus, PROBLEMS[1:], ["x", "y", "z"], [1, 1, 1])
    assert len(corpus.neighbours(PROBLEMS[0], 2)) == 2 and len(corpus.neighbours(PROBLEMS[0], 5)) == 3
    assert PROBLEMS[0] not in corpus.neighbours(PROBLEMS[0], 5)
    assert PROBLEMS[1] not in corpus.neighbours(PROBLEMS[1], 5)


def test_7_neighbours_ranked_by_cosine():
    c = xrpo.Corpus()
    c.vectors = {"q": torch.tensor([1.0, 0.0]), "near": torch.tensor([0.8, 0.6]), "far": torch.tensor([0.0, 1.0]),
                 "mid": torch.tensor([0.6, 0.8])}
    for p in ("far", "mid", "near"):
        c.add(p, f"sol of {p}")
    assert c.neighbours("q", 3) == ["near", "mid", "far"]
    assert c.exemplars("q", 1) == [("near", "sol of near")]


def test_7_truncation_keeps_head_and_answer(tok):
    long = "Step one. " * 200 + "So the answer is \\boxed{17}."
    cut = xrpo.truncate_solution(tok, long, 40)
    assert cut.startswith("Step one.") and cut.endswith("\\boxed{17}.") and len(tok.encode(cut)) <= 48
    assert xrpo.truncate_solution(tok, "short \\boxed{1}", 40) == "short \\boxed{1}"
    shots = [("Problem A", long), ("Problem B", long)]
    full = len(tok.prompt(xrpo.icl_question("NEW", shots)))
    ids = xrpo.icl_prompt(tok, "NEW", shots, max_len=300)
    assert full > 300 and len(ids) <= 300
    text = tok.decode(ids)
    assert text.count("<example id=") == 2 and text.count("\\boxed{17}") == 2  # both kept, both shortened
    one = tok.decode(xrpo.icl_prompt(tok, "NEW", shots, max_len=150))
    assert one.count("<example id=") == 1  # too tight for two: the second is dropped
    assert xrpo.icl_prompt(tok, "NEW", shots, max_len=60) is None  # nothing fits: the caller uses the plain prompt


def test_7_a_tight_prompt_keeps_the_nearest_exemplar(tok):
    """Exemplars come nearest first (§3.2: the K most similar solved problems); when only one fits (App. C: the prompt
    must fit its window) it is the nearest. Catches the nearest exemplar dropped first."""
    long = "Step one. " * 200 + "So the answer is \\boxed{17}."
    text = tok.decode(xrpo.icl_prompt(tok, "NEW", [("Problem NEAR", long), ("Problem FAR", long)], max_len=150))
    assert text.count("<example id=") == 1 and "Problem NEAR" in text and "Problem FAR" not in text


def test_8_corpus_update_adds_exactly_the_correct():
    c = xrpo.Corpus(per_problem=3)
    sizes = [0]
    rng = random.Random(1)
    for step in range(6):
        texts = [[f"s{step}-{q}-{i}" for i in range(4)] for q in range(3)]
        correct = [[float(rng.random() < 0.4) for _ in range(4)] for _ in range(3)]
        before = {p: list(v) for p, v in c.solutions.items()}
        xrpo.update_corpus(c, [f"p{q}" for q in range(3) for _ in range(4)], sum(texts, []), sum(correct, []))
        for q in range(3):
            added = [t for t, r in zip(texts[q], correct[q]) if r == 1]
            assert c.solutions.get(f"p{q}", []) == (before.get(f"p{q}", []) + added)[-3:]
            assert not any(t in c.solutions.get(f"p{q}", []) for t, r in zip(texts[q], correct[q]) if r == 0)
        sizes.append(c.size())
    assert all(a <= b for a, b in zip(sizes, sizes[1:]))  # non-decreasing (the per-problem cap only replaces)
    assert sizes[-1] > 0


def test_corpus_keeps_the_answer_after_thinking():
    c = xrpo.Corpus()
    c.add("p", "<think>long musing</think>\n The sum is \\boxed{5}.")
    assert c.solutions["p"] == ["The sum is \\boxed{5}."]


def test_corpus_state_round_trip(corpus):
    xrpo.update_corpus(corpus, PROBLEMS, ["a", "b", "c", "d"], [1, 0, 1, 1])
    again = xrpo.Corpus()
    again.load_state_dict(corpus.state_dict())
    assert again.solutions == corpus.solutions
    assert all(torch.equal(again.vectors[p], corpus.vectors[p]) for p in corpus.vectors)
    assert again.exemplars(PROBLEMS[1], 2) == corpus.exemplars(PROBLEMS[1], 2)


def test_embedding_on_first_sight_equals_all_at_once(tiny, tok):
    lazy, eager = xrpo.Corpus(), xrpo.Corpus()
    lazy.embed_new(tiny, tok, PROBLEMS[:2])
    lazy.embed_new(tiny, tok, PROBLEMS[1:])
    eager.embed_new(tiny, tok, PROBLEMS)
    for p in PROBLEMS:
        torch.testing.assert_close(lazy.vectors[p], eager.vectors[p], atol=1e-5, rtol=1e-5)
        assert lazy.vectors[p].norm().item() == pytest.approx(1.0, abs=1e-5)


# ---------------------------------------------------------------------------------- 10-11: sharpening

def toy_group():
    adv = torch.tensor([0.9, 0.9, 0.9, -1.1, -1.1, 0.0, 0.0, 0.0])
    correct = torch.tensor([1, 1, 1, 0, 0, 1, 1, 1])
    score = torch.tensor([-2.0, -0.2, -0.6, -3.0, -0.1, -1.0, -0.1, -0.5])
    group = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    return adv, correct, score, group


def test_10_sharpening_properties():
    adv, correct, score, group = toy_group()
    new, bonus = xrpo.sharpen(adv, correct, score, group, 2.5, 0.5)
    assert torch.equal(new[correct == 0], adv[correct == 0])  # wrong rollouts untouched
    assert (new >= adv).all() and (bonus <= 0.5 * adv.clamp(min=0) + 1e-7).all()
    s_bar = score[:5].mean()
    assert torch.equal(new[:3][score[:3] >= s_bar], adv[:3][score[:3] >= s_bar])  # η >= 1: unchanged
    assert bonus[0] > 0  # the least likely correct rollout of group 0 is novel: boosted
    assert torch.equal(new[5:], adv[5:])  # all-correct group: A = 0, cap 0, no bonus (literal eq. 6)
    # the literal value on rollout 0: min(max(2.5 (1 - exp(s - s̄)), 0), 0.5 A)
    expect = min(max(2.5 * (1 - math.exp(score[0].item() - s_bar.item())), 0), 0.5 * 0.9)
    assert new[0].item() == pytest.approx(0.9 + expect, rel=1e-6)
    # the option: all-correct groups get bonuses capped at κ
    alt, alt_bonus = xrpo.sharpen(adv, correct, score, group, 2.5, 0.5, all_correct_cap=True)
    assert alt_bonus[5] > 0 and alt_bonus[6] == 0 and (alt_bonus[5:] <= 0.5).all()
    assert torch.equal(alt[:5], new[:5])
    # λ_nov = 0: nothing changes
    assert torch.equal(xrpo.sharpen(adv, correct, score, group, 0.0, 0.5)[0], adv)


def test_10_small_lambda_is_below_the_cap():
    adv, correct, score, group = toy_group()
    _, bonus = xrpo.sharpen(adv, correct, score, group, 0.01, 0.5)
    eta = torch.exp(score[0] - score[:5].mean())
    assert bonus[0].item() == pytest.approx(0.01 * (1 - eta.item()), rel=1e-5)


def test_10_only_correct_rollouts_gain_a_bonus_whatever_their_advantage():
    """Eq. 6 sharpens correct rollouts only. With a format reward a wrong but boxed rollout can have A > 0 and be its
    group's least likely (η < 1): it still gets no bonus. Catches the bonus gated by the cap κA, not correctness."""
    adv = torch.tensor([0.8, 0.4, -1.2])  # right and boxed, wrong but boxed, wrong: rewards 1.1, 0.1, 0 centred
    correct = torch.tensor([1, 0, 0])
    score = torch.tensor([-1.0, -3.0, -0.5])  # the wrong boxed one is the novel one
    new, bonus = xrpo.sharpen(adv, correct, score, torch.zeros(3, dtype=torch.long), 2.5, 0.5)
    assert torch.equal(bonus, torch.zeros(3)) and torch.equal(new, adv)


def test_11_novelty_invariances():
    torch.manual_seed(0)
    lengths = torch.tensor([3, 5, 2, 4])
    token_logp = -torch.rand(int(lengths.sum())) * 3
    group = torch.tensor([0, 0, 0, 0])
    correct = torch.tensor([1, 1, 0, 1])
    adv = torch.tensor([0.5, 0.5, -1.5, 0.5])
    score = xrpo.sequence_scores(token_logp, lengths)
    shifted = xrpo.sequence_scores(token_logp - 0.7, lengths)  # same constant on every token of every rollout
    a, _ = xrpo.sharpen(adv, correct, score, group, 2.5, 0.5)
    b, _ = xrpo.sharpen(adv, correct, shifted, group, 2.5, 0.5)
    torch.testing.assert_close(a, b)
    # length normalisation: repeating a sequence's per-token log-probs leaves s unchanged
    parts = list(token_logp.split(lengths.tolist()))
    parts[1] = parts[1].repeat(3)
    repeated = xrpo.sequence_scores(torch.cat(parts), torch.tensor([3, 15, 2, 4]))
    torch.testing.assert_close(repeated, score)
    torch.testing.assert_close(score[0], token_logp[:3].mean())


# -------------------------------------------------------------------- 9, 12: groups and the loss context

def test_9_ragged_groups_have_zero_mean_advantages():
    # three prompts with 4, 9 and 3 rollouts (base + rounds), interleaved as the rounds append them
    group = torch.tensor([0] * 4 + [1] * 4 + [2] * 4 + [1] * 5 + [2] * 0 + [0] * 0 + [2] * 1)
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(len(group), generator=g) < 0.5).float()
    rewards[group == 0] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    rewards[group == 2] = 1.0  # all equal
    adv = xrpo.group_advantages(rewards, group, "std")
    for q in (0, 1):
        if rewards[group == q].std() > 0:
            assert abs(adv[group == q].sum().item()) < 1e-5
    assert torch.equal(adv[group == 2], torch.zeros(5))


class GradRecorder:
    """Stands in for AdamW: keeps the step's gradient and leaves the weights alone."""

    def __init__(self, model):
        self.model, self.grads = model, []

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=True)

    def step(self):
        self.grads.append(torch.cat([p.grad.flatten().clone() for p in self.model.parameters()]))


def test_12_icl_prompt_tokens_get_no_loss(tok, tiny_model_dir):
    """Rollouts that train with an in-context prompt as context (--icl-context icl): only their completion tokens
    have a loss term and count in the token-mean; the gradient is REINFORCE's over those tokens alone."""
    from common.batch import Batch
    model = Transformer.from_pretrained(tiny_model_dir)
    plain = tok.prompt("What is 2 + 3?")
    icl = xrpo.icl_prompt(tok, "What is 2 + 3?", [("What is 1 + 1?", "1 + 1 = \\boxed{2}")], 1024)
    comps = [[17, 23, 5], [9, 4], [31, 2, 8, 6], [12]]
    contexts = [plain, plain, icl, icl]
    b = Batch(contexts, comps, torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long),
              torch.zeros(10), torch.ones(4, dtype=torch.bool), ["5"] * 4)
    adv = xrpo.group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), b.group, "std")
    cfg = xrpo.Config(max_grad_norm=1e9, temperature=0.7, micro_batch=3, kl_coef=0.0)
    opt = GradRecorder(model)
    off = torch.autocast("cpu", enabled=False)
    stats = xrpo.update(model, model, opt, b, adv, cfg, tok.pad_id, torch.device("cpu"), off)
    assert stats["tokens"] == sum(len(c) for c in comps)  # only completion tokens are scored
    model.zero_grad(set_to_none=True)
    loss = 0
    for ctx, c, a in zip(contexts, comps, adv):
        ids = torch.tensor([ctx + c])
        logits = model(ids)[0, len(ctx) - 1: -1].double() / 0.7
        loss = loss - a * torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None]).sum()
    (loss / sum(len(c) for c in comps)).backward()
    reinforce = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert opt.grads[0].abs().max() > 0
    torch.testing.assert_close(opt.grads[0], reinforce, atol=1e-6, rtol=1e-4)


@pytest.fixture(scope="module")
def soft(tiny_model_dir):
    """The tiny model with small (tied) embeddings: near-uniform next tokens, so that samples differ."""
    m = Transformer.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        m.embed_tokens.weight.mul_(0.02)
    return m


def sample_rounds_of(model, tok, problems, corpus, **options):
    """xrpo.sample_rounds on plain prompts with the tiny model: n_base = 2 and one round of the other 2 per prompt."""
    from common.tasks import format_question
    cfg = xrpo.Config(**{"group_size": 4, "base_rollouts": 2, "rounds": 1, "max_new_tokens": 4, "temperature": 1.0,
                         **options})
    contexts = [tok.prompt(format_question(p)) for p in problems]
    b, _, _, icl, per_prompt = xrpo.sample_rounds(model, tok, problems, contexts, corpus, cfg, 0,
                                                  torch.autocast("cpu", enabled=False))
    return contexts, b, icl, per_prompt


def test_rounds_draw_new_rollouts(soft, tok):
    """A round samples new rollouts of its prompts (Alg. 1: each round draws n_q more from π_θ), not copies of the
    base round's. One prompt, 2 base rollouts and a round of 2: the round's completions repeat none of the base's.
    Catches every round sampled with the base round's seed."""
    from common.tasks import Problem
    _, b, icl, per_prompt = sample_rounds_of(soft, tok, [Problem("What is 2 + 3?", "5")], xrpo.Corpus(), icl=False)
    assert per_prompt == [4] and not icl.any()
    assert not {tuple(t) for t in b.tokens[:2]} & {tuple(t) for t in b.tokens[2:]}


@pytest.mark.parametrize("trained_in", ["plain", "icl"])
def test_icl_rollouts_join_the_prompts_group_and_train_in_the_chosen_context(soft, tok, trained_in):
    """A prompt with no correct base rollout is sampled in the round from its in-context prompt (§3.2, App. C); those
    rollouts are normalised in the prompt's group, and train in the in-context prompt they were sampled from
    (--icl-context icl, the default) or in the plain prompt, the one evaluation asks (plain). Catches the option
    ignored either way, and seeded rollouts in a group of their own."""
    from common.tasks import Problem
    near, solution = "What is 1 + 1?", "1 + 1 = \\boxed{2}"
    corpus = xrpo.Corpus()
    corpus.vectors = {"What is 2 + 3?": torch.tensor([1.0, 0.0]), near: torch.tensor([0.8, 0.6])}
    corpus.add(near, solution)
    problem = Problem("What is 2 + 3?", "no digit answers this")  # every rollout wrong: the round is seeded
    contexts, b, icl, per_prompt = sample_rounds_of(soft, tok, [problem], corpus, icl_context=trained_in)
    assert per_prompt == [4] and icl.tolist() == [False, False, True, True]
    seeded = xrpo.icl_prompt(tok, problem.prompt, [(near, solution)], xrpo.Config().icl_max_len)
    assert seeded != contexts[0]
    assert b.context[:2] == [contexts[0]] * 2
    assert b.context[2:] == [contexts[0] if trained_in == "plain" else seeded] * 2
    assert b.group.tolist() == [0, 0, 0, 0]


# ---------------------------------------------------------------------------------- the loop: main()

@pytest.fixture(scope="module")
def digit_model_dir(tiny_model_dir, tmp_path_factory):
    """A tiny model whose untied LM head scores only the ten digit tokens: it answers "Say 7" with one digit, right
    about one time in ten, so rewards vary, groups differ and the corpus fills."""
    import shutil
    m = Transformer.from_pretrained(tiny_model_dir)
    m.cfg.tie_word_embeddings = False
    tok = Tokenizer.from_pretrained(tiny_model_dir)
    digits = [tok.encode(str(d))[0] for d in range(10)]
    with torch.no_grad():  # the last prompt position's state is about the same for every prompt: aim the digits at it
        h = m(torch.tensor([tok.prompt("Say 0")]), return_hidden=True)[0, -1]
    head = torch.zeros_like(m.lm_head.weight)
    noise = torch.randn(10, head.shape[1], generator=torch.Generator().manual_seed(1))
    head[digits] = 15 * h / h.norm() ** 2 + 0.1 * noise
    m.lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
    m.lm_head.weight.data.copy_(head)
    folder = tmp_path_factory.mktemp("digits") / "model"
    m.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, folder / name)
    return folder


def digit_args(model_dir, tmp_path):
    task = tmp_path / "digits.jsonl"
    task.write_text("".join(f'{{"prompt": "Say {d}", "answer": "{d}"}}\n' for d in list(range(10)) * 3))
    return ["--model", str(model_dir), "--task", str(task), "--prompts-per-step", "4", "--group-size", "6",
            "--max-new-tokens", "1", "--eval-size", "3", "--micro-batch", "8",
            "--eval-every", "100", "--lr", "1e-2", "--dtype", "float32"]


def run_main(module, tmp_path, monkeypatch, *argv):
    monkeypatch.chdir(tmp_path)
    module.main(list(argv))


def rows_of(tmp_path, name):
    import json
    return [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def test_13_mechanisms_off_is_grpo(tmp_path, monkeypatch, digit_model_dir):
    """No dynamic budget, ICL off, λ_nov = 0: one step of xrpo.py gives grpo.py's weights, bit for bit."""
    import grpo
    from safetensors.torch import load_file
    args = digit_args(digit_model_dir, tmp_path) + ["--steps", "1", "--group-size", "8", "--kl-coef", "0.001"]
    run_main(grpo, tmp_path, monkeypatch, *args, "--run-name", "grpo")
    run_main(xrpo, tmp_path, monkeypatch, *args, "--run-name", "xrpo", "--base-rollouts", "8", "--rounds", "0",
             "--no-icl", "--nov-lambda", "0")
    a = load_file(tmp_path / "runs" / "grpo" / "checkpoint" / "model.safetensors")
    b = load_file(tmp_path / "runs" / "xrpo" / "checkpoint" / "model.safetensors")
    start = load_file(digit_model_dir / "model.safetensors")
    assert any(not torch.equal(a[k], start[k]) for k in a)  # the step did train
    assert all(torch.equal(a[k], b[k]) for k in a)
    ga, xa = rows_of(tmp_path, "grpo")[1], rows_of(tmp_path, "xrpo")[1]
    assert {k: v for k, v in ga.items() if not k.startswith(("perf/", "reward/groups_refilled", "reward/refill_rounds"))} == \
           {k: v for k, v in xa.items() if not k.startswith(("perf/", "xrpo/"))}


# A run cut at step 2 by a crash had taken the whole run's rates; asked for 2 steps, it would decay its own last steps
# (--decay-steps): it runs without the decay, which in the 4-step run is still under the warm-up at steps 1 and 2.
AS_IF_CUT = ["--decay-steps", "0"]


def test_resume_gives_the_same_run_and_the_mechanisms_act(tmp_path, monkeypatch, digit_model_dir):
    args = digit_args(digit_model_dir, tmp_path) + ["--base-rollouts", "3"]
    run_main(xrpo, tmp_path, monkeypatch, *args, "--steps", "4", "--run-name", "full")
    run_main(xrpo, tmp_path, monkeypatch, *args, "--steps", "2", "--run-name", "cut", *AS_IF_CUT)
    run_main(xrpo, tmp_path, monkeypatch, *args, "--steps", "4", "--run-name", "cut", "--resume")

    def train_rows(name):
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith("perf/")}
                for r in rows_of(tmp_path, name) if "reward/mean" in r}

    full, cut = train_rows("full"), train_rows("cut")
    assert sorted(cut) == [1, 2, 3, 4]
    for step in (3, 4):
        assert cut[step] == full[step], step
    rows = list(full.values())
    # every step spends exactly B×G rollouts, unevenly; ICL prompts are used; bonuses are given; the corpus grows
    assert all(r["xrpo/rollouts_mean"] == 6 for r in rows)
    assert any(r["xrpo/rollouts_max"] > r["xrpo/rollouts_min"] for r in rows)
    assert any(r["xrpo/icl_share"] > 0 for r in rows) and rows[0]["xrpo/icl_share"] == 0  # the corpus starts empty
    assert any((r["xrpo/bonus_share"] or 0) > 0 for r in rows)
    sizes = [r["xrpo/corpus_size"] for r in rows]
    assert sizes == sorted(sizes) and sizes[-1] > 0
    state = torch.load(tmp_path / "runs" / "full" / "checkpoint" / "trainer.pt", weights_only=False)
    assert sum(len(v) for v in state["extra"]["xrpo_corpus"]["solutions"].values()) == sizes[-1]


@pytest.mark.parametrize("options", [[], ["--seq-ratio", "--alloc", "greedy", "--nov-all-correct"]])
def test_smoke_main_on_tiny_model(tmp_path, monkeypatch, tiny_model_dir, options):
    """One step of main() end to end; the second run with the options: XRPO on GSPO, greedy allocation, bonuses in
    all-correct groups."""
    run_main(xrpo, tmp_path, monkeypatch, "--model", str(tiny_model_dir), "--steps", "1", "--run-name", "smoke",
             "--prompts-per-step", "2", "--group-size", "4", "--base-rollouts", "3", "--rounds", "1",
             "--max-new-tokens", "6", "--eval-size", "3", "--train-size", "50", "--micro-batch", "4",
             "--dtype", "float32", *options)
    rows = rows_of(tmp_path, "smoke")
    assert [r["step"] for r in rows if "eval/greedy_acc" in r] == [0, 1]
    step = next(r for r in rows if "reward/mean" in r)
    assert step["xrpo/rollouts_mean"] == 4 and "xrpo/icl_share" in step and "xrpo/corpus_size" in step
    assert Transformer.from_pretrained(tmp_path / "runs" / "smoke" / "checkpoint").cfg.num_layers == 2


@pytest.mark.parametrize("args,option", [
    (["--base-rollouts", "1"], "--base-rollouts"),
    (["--base-rollouts", "9"], r"--base-rollouts: expected 2 \.\.\. --group-size \(8\), got 9"),
    (["--rounds", "0"], "--rounds"),
    (["--alloc-conf", "95"], "alloc-conf"),
    (["--icl-max-len", "5"], "--icl-max-len"),
    (["--nov-all-correct", "--dynamic-sampling"], "--nov-all-correct"),
    (["--icl-shots", "0"], "--icl-shots"),
    (["--no-icl", "--icl-init", "4"], "--icl-init"),
])
def test_bad_options_are_refused_before_anything_is_written(tmp_path, monkeypatch, tiny_model_dir, args, option):
    from common.config import ConfigError
    with pytest.raises(ConfigError, match=option):  # main_guard turns it into one line and exit 2 (tested in grpo)
        run_main(xrpo, tmp_path, monkeypatch, "--model", str(tiny_model_dir), "--run-name", "bad",
                 "--train-size", "20", "--eval-size", "2", *args)
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------- what the update receives, and the paper's ablations

def spy_on_update(monkeypatch):
    """Records the batch and the advantages every call of xrpo.update receives, then runs the real update."""
    calls, real = [], xrpo.update

    def spy(policy, model, optimizer, b, adv, *args, **kw):
        calls.append((b, adv.clone()))
        return real(policy, model, optimizer, b, adv, *args, **kw)
    monkeypatch.setattr(xrpo, "update", spy)
    return calls


def test_update_receives_the_sharpened_advantages(tmp_path, monkeypatch, digit_model_dir):
    """The advantages `update` gets are eq. 6's A⁺, recomputed here from what the update sees: the batch's rewards
    (verifier), group advantages, and s(y) from the sampler's log-probs. Catches the sharpened advantages being
    dropped before `update` (bonuses are paid, so plain A differs) and s(y) read from anything else."""
    from common.verifier import score
    calls = spy_on_update(monkeypatch)
    tok = Tokenizer.from_pretrained(digit_model_dir)
    run_main(xrpo, tmp_path, monkeypatch, *digit_args(digit_model_dir, tmp_path), "--steps", "3", "--run-name", "spy",
             "--base-rollouts", "3")
    assert len(calls) == 3
    paid = 0
    for b, adv in calls:
        correct = torch.tensor([score(tok.decode(t, skip_special=True), a) for t, a in zip(b.tokens, b.answer)])
        plain = xrpo.group_advantages(correct, b.group, "std")
        new, bonus = xrpo.sharpen(plain, correct, xrpo.sequence_scores(b.sampler_logp, b.lengths), b.group,
                                  2.5, 0.5)
        torch.testing.assert_close(adv, new, rtol=0, atol=1e-6)
        paid += int((bonus > 0).sum())
    assert paid > 0


def test_uniform_allocation_splits_evenly():
    rewards = [[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert xrpo.allocate(rewards, 16, 0.1, 0.95) != [4, 4, 4, 4]  # the planner would not
    assert xrpo.allocate(rewards, 16, 0.1, 0.95, "uniform") == [4, 4, 4, 4]
    assert xrpo.allocate(rewards, 14, 0.1, 0.95, "uniform") == [4, 4, 3, 3]


@pytest.mark.parametrize("ablation", ["--alloc uniform", "--no-icl"])
def test_ablations_switch_off_one_mechanism_each(tmp_path, monkeypatch, digit_model_dir, ablation):
    """Table 5's "w/o HRP" keeps the rounds (so ICL still seeds) with G rollouts for every prompt; "w/o ICL" keeps the
    uneven plan and never seeds. Catches --alloc uniform falling back to the planner or dropping the rounds (and
    with them ICL), and --no-icl seeding anyway."""
    run_main(xrpo, tmp_path, monkeypatch, *digit_args(digit_model_dir, tmp_path), "--steps", "4", "--run-name", "abl",
             "--base-rollouts", "2", *ablation.split())
    rows = [r for r in rows_of(tmp_path, "abl") if "reward/mean" in r]
    uneven = any(r["xrpo/rollouts_max"] > r["xrpo/rollouts_min"] for r in rows)
    seeded = sum(r["xrpo/seeded_prompts"] for r in rows)
    if ablation == "--no-icl":
        assert uneven and seeded == 0
    else:
        assert not uneven and all(r["xrpo/rollouts_max"] == 6 for r in rows) and seeded > 0
    assert any((r["xrpo/bonus_share"] or 0) > 0 for r in rows)  # AS still acts


def test_icl_init_seeds_the_corpus_before_step_1(tmp_path, monkeypatch, digit_model_dir):
    """--icl-init N: the base model's correct answers to N training problems fill the corpus before the first
    update (Alg. 1's C_init), so step 1 can already seed; without it the corpus starts empty and step 1 cannot.
    Catches the option being ignored."""
    args = digit_args(digit_model_dir, tmp_path) + ["--steps", "1", "--base-rollouts", "3"]
    run_main(xrpo, tmp_path, monkeypatch, *args, "--run-name", "init", "--icl-init", "12")
    run_main(xrpo, tmp_path, monkeypatch, *args, "--run-name", "empty")
    init, empty = (next(r for r in rows_of(tmp_path, n) if "reward/mean" in r) for n in ("init", "empty"))
    assert empty["xrpo/seeded_prompts"] == 0 and init["xrpo/seeded_prompts"] > 0
    state = torch.load(tmp_path / "runs" / "init" / "checkpoint" / "trainer.pt", weights_only=False)
    step_1 = init["reward/acc"] * init["xrpo/rollouts_mean"] * 4  # correct rollouts of step 1
    assert sum(len(v) for v in state["extra"]["xrpo_corpus"]["solutions"].values()) > step_1


def test_correct_icl_rollouts_join_the_corpus(tmp_path, monkeypatch, digit_model_dir):
    """Alg. 1 line 18: every correct rollout of the step joins the corpus, ICL-seeded ones included (they solve q).
    C_init is scored right and the step's base rollouts wrong, so every prompt is seeded, and the seeded rollouts are
    then counted right: update_corpus must receive them as correct. Catches the corpus fed plain rollouts only."""
    phase, seen = {"init": False}, {}
    real_seed, real_rounds, real_update = xrpo.seed_corpus, xrpo.sample_rounds, xrpo.update_corpus

    def seed_corpus(*args):
        phase["init"] = True
        real_seed(*args)
        phase["init"] = False

    def sample_rounds(*args):
        b, texts, correct, icl, per_prompt = real_rounds(*args)
        seen["correct"] = torch.maximum(correct, icl.float())
        return b, texts, seen["correct"], icl, per_prompt

    monkeypatch.setattr(xrpo, "score", lambda text, answer: float(phase["init"]))
    monkeypatch.setattr(xrpo, "seed_corpus", seed_corpus)
    monkeypatch.setattr(xrpo, "sample_rounds", sample_rounds)

    def update_corpus(corpus, problems, texts, correct):
        seen["fed"] = list(correct)  # C_init's call first, the step's last
        real_update(corpus, problems, texts, correct)

    monkeypatch.setattr(xrpo, "update_corpus", update_corpus)
    run_main(xrpo, tmp_path, monkeypatch, *digit_args(digit_model_dir, tmp_path), "--steps", "1", "--run-name", "c",
             "--base-rollouts", "3", "--icl-init", "4")
    assert seen["correct"].sum() > 0 and seen["fed"] == seen["correct"].tolist()


def test_fsdp_under_torchrun_is_refused(monkeypatch):
    """XRPO's allocation gives ranks different numbers of completions, so FSDP2 (a weight gather in every forward)
    would wait forever: under torchrun --fsdp is one line naming the option; DDP and one process are fine."""
    from common.config import ConfigError

    monkeypatch.setattr(xrpo.dist, "world", lambda: 2)
    with pytest.raises(ConfigError, match="--fsdp: expected off under torchrun"):
        xrpo.validate(xrpo.Config(fsdp=True))
    xrpo.validate(xrpo.Config())
    monkeypatch.setattr(xrpo.dist, "world", lambda: 1)
    xrpo.validate(xrpo.Config(fsdp=True))



def test_rollout_histogram_shares_add_up_to_one():
    """xrpo/hist_*: every prompt in exactly one bin, also with --rounds 0 --base-rollouts G (every prompt at n_base =
    G, which the G-to-2G bin counted too), and with an uneven allocation."""
    group, icl, correct = torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.bool), torch.zeros(4)
    corpus = xrpo.Corpus(4)
    hist = ("xrpo/hist_base", "xrpo/hist_below_G", "xrpo/hist_G_to_2G", "xrpo/hist_2G_up")
    for cfg, per_prompt in [(xrpo.Config(rounds=0, base_rollouts=8), [8, 8, 8]),
                            (xrpo.Config(), [4, 6, 8, 13, 16, 4])]:
        m = xrpo.xrpo_metrics(per_prompt, cfg, group, icl, correct, correct, torch.zeros(4), corpus)
        assert sum(m[k] for k in hist) == pytest.approx(1.0), m
    assert m["xrpo/hist_base"] == pytest.approx(2 / 6) and m["xrpo/hist_2G_up"] == pytest.approx(1 / 6)
