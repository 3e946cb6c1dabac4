"""exgrpo.py: the ExGRPO test properties (arXiv 2510.02245 §3-4, App. C-D) on toy inputs and a tiny model,
the reduction to grpo.py's Dr. GRPO step with replay off, resume equivalence with a non-empty buffer, and a
smoke run of main()."""
import math
from dataclasses import replace

import pytest
import torch

import exgrpo
from exgrpo import Experience, QuestionStream, Trajectory

K = 8


def traj(*tokens):
    return list(tokens), torch.full((len(tokens),), -0.5)


def filled(groups: dict[int, int]) -> Experience:
    """A buffer with question q labelled k = groups[q] and k distinct stored trajectories."""
    exp = Experience(K)
    for q, k in groups.items():
        correct = [True] * k + [False] * (K - k)
        comps = [[q, i] for i in range(K)]
        exp.record(q, correct, comps, [torch.zeros(2)] * K, collect=True)
    return exp


# ----------------------------------------------------------------------------- 1. bucket probabilities

def test_count_unit_gaussian_probabilities():
    w = exgrpo.bucket_weights(K, "normal", sigma=1.0)
    p = exgrpo.bucket_probs(w, [3] * 7)
    torch.testing.assert_close(p, torch.tensor([.0044, .054, .242, .399, .242, .054, .0044], dtype=torch.float64),
                               atol=6e-4, rtol=0)
    assert p.sum().item() == pytest.approx(1.0)
    # bucket 4 empty: weight 0, the others renormalised to sum 1 in the same proportions
    q = exgrpo.bucket_probs(w, [3, 3, 3, 0, 3, 3, 3])
    assert q[3] == 0 and q.sum().item() == pytest.approx(1.0)
    torch.testing.assert_close(q[[0, 1, 2, 4, 5, 6]] / q[2], p[[0, 1, 2, 4, 5, 6]] / p[2])
    # σ is selectable: a wider Gaussian flattens the preference; accuracy units (the paper's formula) are ~flat
    assert exgrpo.bucket_probs(exgrpo.bucket_weights(K, "normal", 1.5), [3] * 7)[3] < p[3]
    acc = exgrpo.bucket_probs(exgrpo.bucket_weights(K, "normal-acc", 1.0), [3] * 7)
    assert acc.min() / acc.max() > 0.9
    lin = exgrpo.bucket_probs(exgrpo.bucket_weights(K, "linear"), [3] * 7)
    torch.testing.assert_close(lin, torch.arange(1, 8, dtype=torch.float64) / 28)


# ----------------------------------------------------------------------------- 2. bucket sampling

@pytest.mark.parametrize("seed", range(5))
def test_bucket_sample_distinct_valid_ids(seed):
    # unbalanced buckets: bucket 4 (the most wanted) holds one question, so the draw overflows
    exp = filled({10: 1, 11: 2, 12: 3, 13: 4, 14: 5, 15: 5, 16: 5, 17: 6, 18: 7, 19: 2})
    exp.record(13, [True] * K, [[0]] * K, [torch.zeros(1)] * K, collect=True)  # 13 retired
    exp.record(20, [False] * K, [[0]] * K, [torch.zeros(1)] * K, collect=True)  # all wrong: nothing stored
    exp.pool[21] = []  # a question with no stored trajectory is never drawn
    exp.bucket[21] = 4
    valid = set(exp.valid())
    assert valid == {10, 11, 12, 14, 15, 16, 17, 18, 19}
    g = torch.Generator().manual_seed(seed)
    w = exgrpo.bucket_weights(K)
    for n in range(len(valid) + 1):
        ids = exgrpo.bucket_sample(exp.buckets(), n, w, g)
        assert len(ids) == n and len(set(ids)) == n and set(ids) <= valid
    assert exgrpo.bucket_sample(exp.buckets(), 50, w, g) and len(exgrpo.bucket_sample(exp.buckets(), 50, w, g)) == 9


def test_bucket_sample_follows_p_and_reassigns_overflow():
    exp = filled({q: 1 + q % 7 for q in range(70)})  # 10 questions in each bucket
    g = torch.Generator().manual_seed(0)
    w = exgrpo.bucket_weights(K)
    hits = torch.zeros(8)
    for _ in range(400):
        for q in exgrpo.bucket_sample(exp.buckets(), 4, w, g):
            hits[exp.bucket[q]] += 1
    share = hits[1:] / hits.sum()
    # 4 draws from buckets of 10 never overflow: the shares are p (±3 points over 1600 draws)
    torch.testing.assert_close(share, exgrpo.bucket_probs(w, [10] * 7).float(), atol=0.03, rtol=0)
    # overflow: bucket 4 holds one question but is asked for ~all n; the rest goes to the buckets with room ∝ p
    exp = Experience(K)
    exp.pool, exp.bucket = {q: [Trajectory((q,), torch.zeros(1))] for q in range(21)}, {}
    exp.bucket.update({q: 2 for q in range(10)} | {q: 3 for q in range(10, 20)} | {20: 4})
    hits = torch.zeros(8)
    for _ in range(300):
        ids = exgrpo.bucket_sample(exp.buckets(), 3, w, g)
        assert len(set(ids)) == 3
        for q in ids:
            hits[exp.bucket[q]] += 1
    assert hits[4] > 0.9 * 300  # the lone question of bucket 4 is in (almost) every draw
    p = exgrpo.bucket_probs(w, [0, 10, 10, 1, 0, 0, 0])
    # the overflow splits between buckets 3 and 2 about as p3 : p2 (4.5 : 1)
    assert 2.5 < hits[3] / hits[2] < 8 and p[2] / p[1] > 4


def test_bucket_sample_survives_underflowing_weights():
    """K = 100 with only buckets 1 and 99 filled: both weights N(k; 50, 1) underflow to 0 (issue 36 item 7). Catches
    the multinomial over an all-zero p raising."""
    exp = Experience(100)
    for q, k in ((1, 1), (2, 99), (3, 99)):
        exp.record(q, [True] * k + [False] * (100 - k), [[q, i] for i in range(100)], [torch.zeros(2)] * 100, True)
    w = exgrpo.bucket_weights(100)
    p = exgrpo.bucket_probs(w, [len(v) for v in exp.buckets().values()])
    assert p[0] == p[98] == 0.5 and p.sum() == 1
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3):
        ids = exgrpo.bucket_sample(exp.buckets(), n, w, g)
        assert len(set(ids)) == n and set(ids) <= {1, 2, 3}


def test_question_choice_is_uniform_over_questions():
    """--bucket-weighting question (ExGRPO Table 6, "w/o question selection"): a lone question in bucket 4 against
    ten in bucket 2 is drawn 1/11 of the time, not 1/2 as with `uniform` (over buckets). Catches the option falling
    back to any bucket weighting."""
    exp = filled({0: 4, **{q: 2 for q in range(1, 11)}})
    assert exgrpo.bucket_weights(K, "question") is None
    g = torch.Generator().manual_seed(0)
    lone = sum(exgrpo.bucket_sample(exp.buckets(), 1, None, g) == [0] for _ in range(2200)) / 2200
    assert lone == pytest.approx(1 / 11, abs=0.02)
    by_bucket = sum(exgrpo.bucket_sample(exp.buckets(), 1, exgrpo.bucket_weights(K, "uniform"), g) == [0]
                    for _ in range(400)) / 400
    assert by_bucket == pytest.approx(0.5, abs=0.08)
    assert sorted(exgrpo.bucket_sample(exp.buckets(), 20, None, g)) == list(range(11))  # n distinct, capped


def test_bucket_sample_is_uniform_within_a_bucket():
    """Once a bucket is drawn, its questions are equally likely (ExGRPO §4.1: buckets by p_k, questions at random
    within one). Catches a sampler that always takes a bucket's first (oldest, lowest-id) questions."""
    exp = filled({q: 3 for q in range(10)})  # one bucket, k = 3, of ten questions
    g = torch.Generator().manual_seed(0)
    hits = torch.zeros(10)
    for _ in range(500):
        for q in exgrpo.bucket_sample(exp.buckets(), 2, exgrpo.bucket_weights(K), g):
            hits[q] += 1
    torch.testing.assert_close(hits / hits.sum(), torch.full((10,), 0.1), atol=0.04, rtol=0)


# ----------------------------------------------------------------------------- 3. n and the batch size

@pytest.mark.parametrize("rho,B,valid,n", [(0.5, 128, 1000, 64), (0.5, 128, 10, 10), (0.5, 8, 0, 0), (0.0, 8, 50, 0),
                                           (0.3, 10, 50, 3), (1.0, 8, 5, 5), (0.5, 7, 50, 3)])
def test_replay_count(rho, B, valid, n):
    assert exgrpo.replay_count(rho, B, valid) == n


def test_step_questions_mix_replayed_and_fresh_in_a_shuffled_order():
    """B questions: n distinct valid replayed ones and the stream's first B - n fresh ones, shuffled
    together (issue 36 item 1). Catches: no shuffle (replayed always first, so with M = 2 the replayed groups all
    land in the first mini-batch), fresh not cut to B - n, replayed ids outside the buffer."""
    exp = filled({10: 1, 11: 2, 12: 3, 13: 4, 14: 5, 15: 6})
    fresh = [0, 1, 2, 3, 4, 5, 6, 7]
    slots = []
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        qids, replay = exgrpo.step_questions(exp, fresh, 3, exgrpo.bucket_weights(K), g)
        assert len(qids) == len(replay) == 8 and sum(replay) == 3 and len(set(qids)) == 8
        assert {q for q, r in zip(qids, replay) if r} <= set(exp.valid())
        assert sorted(q for q, r in zip(qids, replay) if not r) == fresh[:5]
        slots.append(tuple(i for i, r in enumerate(replay) if r))
    assert len(set(slots)) > 10  # the replayed groups' places vary with the seed...
    assert sum(max(s) >= 4 for s in slots) >= 10  # ...and reach the second half of the batch (mini-batch 2 of 2)
    # nothing to replay: the stream's order untouched (so that replay off gives grpo.py's batch)
    assert exgrpo.step_questions(exp, fresh, 0, exgrpo.bucket_weights(K), g) == (fresh, [False] * 8)


# ----------------------------------------------------------------------------- 5. collection

def test_collection_rules():
    exp = Experience(K)
    lp = [torch.randn(3) for _ in range(K)]
    exp.record(1, [False] * K, [[1, 2, 3]] * K, lp, collect=True)  # k = 0
    exp.record(2, [True] * K, [[1, 2, 3]] * K, lp, collect=True)  # k = K
    assert exp.pool == {} and exp.bucket == {} and exp.retired == {2}
    comps = [[5, 6, 7], [5, 6, 7], [5, 6, 8], [9, 9, 9], [5, 6, 7], [1, 1, 1], [2, 2, 2], [3, 3, 3]]
    correct = [True, True, True, False, True, False, True, False]
    exp.record(3, correct, comps, lp, collect=True)  # k = 5: 3 distinct correct completions
    assert exp.bucket[3] == 5
    assert [t.tokens for t in exp.pool[3]] == [(5, 6, 7), (5, 6, 8), (2, 2, 2)]
    torch.testing.assert_close(exp.pool[3][1].logp, lp[2])  # the log-probs of that very completion
    # a later group: the label follows the latest k, stored completions are not duplicated
    exp.record(3, [True, False, False, False, True, False, False, False], comps, lp, collect=True)
    assert exp.bucket[3] == 2 and len(exp.pool[3]) == 3
    exp.record(3, [False] * K, comps, lp, collect=True)  # all wrong: the stale label stays, not retired
    assert exp.bucket[3] == 2 and 3 not in exp.retired
    # before the delayed start nothing is collected, but all-correct questions are retired all the same
    exp.record(4, correct, comps, lp, collect=False)
    exp.record(5, [True] * K, comps, lp, collect=False)
    assert 4 not in exp.pool and 5 in exp.retired


# ----------------------------------------------------------------------------- 6. retirement

def test_retired_question_is_purged_and_never_drawn():
    exp = filled({1: 3, 2: 4, 3: 5})
    exp.record(2, [True] * K, [[0]] * K, [torch.zeros(1)] * K, collect=True)
    assert 2 in exp.retired and 2 not in exp.valid()
    exp.purge()
    assert 2 not in exp.pool and 2 not in exp.bucket
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        assert 2 not in exgrpo.bucket_sample(exp.buckets(), 3, exgrpo.bucket_weights(K), g)
    # a later partial success does not bring it back
    exp.record(2, [True] + [False] * 7, [[0]] * K, [torch.zeros(1)] * K, collect=True)
    exp.purge()
    assert 2 not in exp.valid()


def test_question_stream_drops_retired_at_epoch_start():
    ids = list(range(40))
    s = QuestionStream(ids, B=4, seed=3)
    first = [q for _ in range(10) for q in s.next(set())]
    assert sorted(first) == ids  # one epoch: every question once
    retired = {0, 1, 2, 3, 4, 5, 6, 7}  # 32 remain > B + 20
    second = [q for _ in range(8) for q in s.next(retired)]
    assert sorted(second) == list(range(8, 40))
    # the next epoch starts from those 32 > B + 20: 16 more retire, 16 remain
    third = [q for _ in range(4) for q in s.next(retired | set(range(8, 24)))]
    assert sorted(third) == list(range(24, 40))
    # 16 <= B + 20: the set stays as it is, and neither the questions retired since leave it nor the retired
    # ones of earlier epochs come back (the authors' trainer filters only a set larger than B + 20)
    fourth = [q for _ in range(4) for q in s.next(set(range(28)))]
    assert sorted(fourth) == list(range(24, 40))
    assert sorted(s.state_dict()["active"]) == list(range(24, 40))  # what a resumed run goes on from
    tiny = QuestionStream(list(range(24)), B=4, seed=3)  # 24 is not > B + 20: keep all
    assert sorted(q for _ in range(6) for q in tiny.next(retired)) == list(range(24))
    floor = QuestionStream(list(range(30)), B=4, seed=3)  # 30 > B + 20, but 2 would remain (< B): keep all 30
    floor.new_epoch(set(range(28)))
    assert sorted(floor.order) == list(range(30))


def test_question_stream_equals_grpo_step_prompts_without_retirement():
    grpo = pytest.importorskip("grpo")
    train = list(range(13))
    s = QuestionStream(train, B=4, seed=2)
    for step in range(1, 9):
        assert s.next(set()) == grpo.step_prompts(train, step, 4, seed=2)


def test_question_stream_state_round_trip():
    a = QuestionStream(list(range(30)), B=4, seed=1)
    for _ in range(5):
        a.next({1, 2})
    b = QuestionStream(list(range(30)), B=4, seed=1)
    b.load_state_dict(a.state_dict())
    assert [a.next({1, 2}) for _ in range(12)] == [b.next({1, 2}) for _ in range(12)]


# ----------------------------------------------------------------------------- 7. trajectory selection

class ToyLM(torch.nn.Module):
    """A 'model' whose next-token logits depend only on the current token: logits = table[token]."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, ids, targets, target_mask, temperature, **attention):
        from kernels import logprobs_entropy
        return logprobs_entropy(self.table[ids][target_mask], targets[target_mask], temperature)


def select(model, exp, qids, contexts, how="mean", choice="lowest-entropy", gen=None):
    no_autocast = torch.autocast("cpu", enabled=False)
    return exgrpo.select_trajectories(model, exp, qids, contexts, 2, 0, torch.device("cpu"), no_autocast, how, choice,
                                      gen)


def test_selection_picks_lowest_mean_entropy():
    V = 6
    table = torch.zeros(V, V)  # after tokens 0..2: a uniform next token (entropy log 6)
    table[3, 4] = table[4, 5] = table[5, 3] = 30.0  # after tokens 3, 4, 5: a nearly certain one
    model = ToyLM(table)
    low, high, mid = (3, 4, 5, 3), (0, 1, 2, 0), (3, 4, 0, 1, 2, 0, 4, 5)
    exp = Experience(K)
    exp.pool = {7: [Trajectory(high, torch.zeros(4)), Trajectory(low, torch.zeros(4)), Trajectory(mid, torch.zeros(8))],
                8: [Trajectory(mid, torch.zeros(8)), Trajectory(high, torch.zeros(4))]}
    exp.bucket = {7: 3, 8: 5}
    # the context's last token conditions the first completion token
    chosen = select(model, exp, [7, 8], [[1, 3], [2, 5]])
    assert chosen[0].tokens == low  # after prompt token 3, every step of `low` is nearly certain
    assert chosen[1].tokens == mid  # half of mid's steps are nearly certain, none of high's
    # sum instead of mean prefers the short trajectory at equal per-token entropy: high (4 tokens) beats mid (8)
    assert select(model, exp, [8], [[2, 0]], how="sum")[0].tokens == high
    # recomputed under the current policy: make tokens 0..2 certain and 3..5 uniform
    with torch.no_grad():
        model.table.zero_()
        model.table[0, 1] = model.table[1, 2] = model.table[2, 0] = 30.0
    assert select(model, exp, [7], [[1, 2]])[0].tokens == high


def test_trajectory_choice_highest_entropy_and_random():
    """ExGRPO Table 6's trajectory ablations. highest-entropy takes the argmax of H̄ (catches it falling back to the
    argmin); random draws each stored trajectory alike, with no forward (catches a fixed or entropy-based pick)."""
    table = torch.zeros(6, 6)
    table[3, 4] = table[4, 5] = table[5, 3] = 30.0
    low, high, mid = (3, 4, 5, 3), (0, 1, 2, 0), (3, 4, 0, 1, 2, 0, 4, 5)
    exp = Experience(K)
    exp.pool = {7: [Trajectory(low, torch.zeros(4)), Trajectory(high, torch.zeros(4)), Trajectory(mid, torch.zeros(8))]}
    exp.bucket = {7: 3}
    assert select(ToyLM(table), exp, [7], [[1, 3]], choice="highest-entropy")[0].tokens == high
    assert select(ToyLM(table), exp, [7], [[1, 3]], choice="lowest-entropy")[0].tokens == low
    g = torch.Generator().manual_seed(0)
    # model None: no forward
    picks = [select(None, exp, [7, 7], [[1], [1]], choice="random", gen=g) for _ in range(300)]
    share = {t: sum(p[0].tokens == t for p in picks) / 300 for t in (low, high, mid)}
    assert all(s == pytest.approx(1 / 3, abs=0.1) for s in share.values())


def test_selection_scores_the_policy_entropy_at_the_given_temperature():
    """H̄(o) is the entropy of π_θ's softmax at the temperature given (the sampling one, as the authors' verl code
    computes it): a step with two likely next tokens (H = 0.77) is lower than one with a favourite and a spread tail
    (H = 1.32) at T = 1, while at T = 0.5 the order flips. Catches the selection's forward ignoring the temperature."""
    def entropy(row, T):
        return -(torch.softmax(row / T, -1) * torch.log_softmax(row / T, -1)).sum().item()

    table = torch.zeros(6, 6)  # after token 5 (the prompt's last): uniform, the same first step for both
    table[0, :2] = 5.0  # after token 0: two likely tokens
    table[2, 0] = 2.0  # after token 2: one favourite, the other five spread
    assert entropy(table[0], 1.0) < entropy(table[2], 1.0) and entropy(table[0], 0.5) > entropy(table[2], 0.5)
    tie, spread = (0, 0, 0, 0), (2, 2, 2, 2)
    exp = Experience(K)
    exp.pool, exp.bucket = {7: [Trajectory(spread, torch.zeros(4)), Trajectory(tie, torch.zeros(4))]}, {7: 3}
    assert select(ToyLM(table), exp, [7], [[1, 5]])[0].tokens == tie
    no_autocast = torch.autocast("cpu", enabled=False)
    at_half = exgrpo.select_trajectories(ToyLM(table), exp, [7], [[1, 5]], 2, 0, torch.device("cpu"), no_autocast,
                                         temperature=0.5)
    assert at_half[0].tokens == spread  # the order flips at T = 0.5


# ----------------------------------------------------------------------------- 12. delayed start

def test_delayed_start_strict_and_sticky():
    assert exgrpo.delayed_start(False, 0.35, 0.35) is False  # strictly above
    assert exgrpo.delayed_start(False, 0.3501, 0.35) is True
    mixed = False
    for acc in [0.1, 0.2, 0.4, 0.0, 0.1]:
        mixed = exgrpo.delayed_start(mixed, acc, 0.35)
    assert mixed is True  # never flips back


# ----------------------------------------------------------------------------- buffer state

def test_experience_state_round_trip(tmp_path):
    exp = filled({1: 3, 2: 6})
    exp.record(9, [True] * K, [[0]] * K, [torch.zeros(1)] * K, collect=True)
    torch.save({"exp": exp.state_dict()}, tmp_path / "s.pt")
    back = Experience(K)
    back.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=False)["exp"])
    assert back.retired == exp.retired and back.bucket == exp.bucket and back.valid() == exp.valid()
    for q in exp.pool:
        assert [t.tokens for t in back.pool[q]] == [t.tokens for t in exp.pool[q]]
        for a, b in zip(back.pool[q], exp.pool[q]):
            assert torch.equal(a.logp, b.logp)


# ----------------------------------------------------------------------------- 8. the shaped replay loss

def test_shaping_function_and_gradient():
    """exgrpo.token_loss on replayed (shaped) tokens: -A f(w), f(w) = w / (w + β), never clipped (ExGRPO §4.2 eq. 4),
    in float64 against hand-computed values and gradients. Catches a clipped or unshaped replayed token, a β other
    than cfg.shaping_beta, and clip counters that count replayed tokens."""
    logp = torch.full((4,), -1.0, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.0, -1.0 - math.log(5.0), -1.0 + math.log(100.0), -1.0 - math.log(5.0)],
                       dtype=torch.float64)  # w = 1, 5, 0.01 on the replayed tokens; ratio 5 on the fresh one
    adv = torch.ones(4, dtype=torch.float64)
    shaped = torch.tensor([True, True, True, False])
    cfg = exgrpo.Config(eps_high=0.2)
    # π_θold of every token is the update's own forward; replayed tokens are measured against past_logp (π_past)
    loss, low, high = exgrpo.token_loss(logp, logp.detach().clone(), adv, torch.zeros(4, dtype=torch.float64), cfg,
                                        replayed=shaped, past_logp=torch.where(shaped, old, logp.detach()))
    fresh_ratio_5 = exgrpo.token_loss(logp, old, adv, torch.zeros(4, dtype=torch.float64), cfg, replayed=shaped,
                                      past_logp=old)
    w = torch.tensor([1.0, 5.0, 0.01], dtype=torch.float64)
    torch.testing.assert_close(loss[:3].detach().double(), -w / (w + 0.1))
    assert loss[0].item() == pytest.approx(-1 / 1.1)  # f(1) = 1/1.1
    assert fresh_ratio_5[0][3].item() == pytest.approx(-1.2)  # a fresh token: the clipped surrogate, clip(5) = 1.2
    assert fresh_ratio_5[2][3] and not fresh_ratio_5[2][:3].any()  # clipped there (no gradient); replayed never
    loss, low, high = fresh_ratio_5
    loss.sum().backward()
    # d(-A f(w))/d log π = -A β w / (w + β)^2: 0.1 / 1.21 = 0.0826 at w = 1; never cut by a clip
    assert -logp.grad[0].item() == pytest.approx(0.1 / 1.21, rel=1e-6)
    torch.testing.assert_close(-logp.grad[:3], 0.1 * w / (w + 0.1) ** 2)
    assert not high[:3].any() and high[3]  # the fresh token at ratio 5 is clipped (no gradient), the shaped one is not
    assert logp.grad[3] == 0
    # β is cfg.shaping_beta (ExGRPO Table 6's β option)
    half = exgrpo.token_loss(logp.detach(), old, adv, torch.zeros(4, dtype=torch.float64),
                             exgrpo.Config(shaping_beta=0.5), replayed=shaped, past_logp=old)[0]
    torch.testing.assert_close(half[:3].double(), -w / (w + 0.5))


def test_shaped_tokens_keep_kl_and_entropy_and_mechanism_off_is_grpo():
    """KL and the entropy bonus still act on replayed tokens; with no replayed token (shaped None or all False)
    token_loss is grpo.py's. Catches the KL/entropy dropped on shaped tokens (e.g. a -A f(w) that replaces the whole
    loss there) and any change to the fresh tokens' loss."""
    grpo = pytest.importorskip("grpo")
    torch.manual_seed(0)
    n = 12
    logp = (-torch.rand(n, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(n, dtype=torch.float64)
    ref = logp.detach() + 0.5 * torch.randn(n, dtype=torch.float64)
    adv, entropy = torch.randn(n, dtype=torch.float64), torch.rand(n, dtype=torch.float64)
    cfg = exgrpo.Config(kl_coef=0.05, entropy_coef=0.01)
    want = grpo.token_loss(logp, old, adv, entropy, grpo.Config(kl_coef=0.05, entropy_coef=0.01), ref_logp=ref)
    for replayed in (None, torch.zeros(n, dtype=torch.bool)):
        got = exgrpo.token_loss(logp, old, adv, entropy, cfg, ref_logp=ref, replayed=replayed, past_logp=ref)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    shaped = torch.arange(n) % 3 == 0
    past = old - 0.2  # the replayed tokens' π_past differs from their π_θold
    loss = exgrpo.token_loss(logp, old, adv, entropy, cfg, ref_logp=ref, replayed=shaped, past_logp=past)[0]
    w = (logp.detach() - past).exp()
    x = (ref - logp.detach()).clamp(-10, 10)
    hand = -adv * w / (w + cfg.shaping_beta) + 0.05 * (x.exp() - x - 1) - 0.01 * entropy
    torch.testing.assert_close(loss[shaped].detach().double(), hand[shaped])
    torch.testing.assert_close(loss[~shaped], want[0][~shaped])


def test_switches_in_token_loss():
    """ExGRPO Table 6 in the loss: --no-policy-shaping gives replayed tokens grpo.py's objective against π_past;
    --no-is-correction keeps the shaping but against π_θold. Catches either switch ignored in token_loss."""
    grpo = pytest.importorskip("grpo")
    torch.manual_seed(1)
    n = 10
    logp = (-torch.rand(n) * 3).requires_grad_()
    old, past = logp.detach() + 0.1 * torch.randn(n), logp.detach() - 0.7
    adv, entropy, replayed = torch.randn(n), torch.rand(n), torch.arange(n) % 2 == 0
    cfg = exgrpo.Config(eps_low=1.0, eps_high=math.inf)  # the mixed phase's unclipped fresh tokens
    plain = exgrpo.token_loss(logp, old, adv, entropy, replace(cfg, policy_shaping=False), replayed=replayed,
                              past_logp=past)
    want = grpo.token_loss(logp, torch.where(replayed, past, old), adv, entropy, grpo.Config(eps_low=1.0,
                                                                                                 eps_high=math.inf))
    for a, b in zip(plain, want):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(plain[0][replayed], -adv[replayed] * (logp - past)[replayed].exp())  # -A w, no clip
    no_is = exgrpo.token_loss(logp, old, adv, entropy, replace(cfg, is_correction=False), replayed=replayed,
                              past_logp=past)[0]
    against_old = exgrpo.token_loss(logp, old, adv, entropy, cfg, replayed=replayed, past_logp=old)[0]
    torch.testing.assert_close(no_is, against_old)
    assert not torch.allclose(no_is, exgrpo.token_loss(logp, old, adv, entropy, cfg, replayed=replayed,
                                                       past_logp=past)[0])


def test_replayed_tokens_take_no_sampler_correction():
    """--tis-cap corrects for the sampler copy; replayed tokens were not sampled this step, so with their ratio taken
    to π_past they must carry no TIS factor (before, min(π_past / π_θold, C) weighed them under --no-policy-shaping).
    Fresh tokens keep theirs."""
    torch.manual_seed(2)
    n = 8
    logp = (-torch.rand(n) * 3).requires_grad_()
    old, past, sampler = logp.detach() + 0.1 * torch.randn(n), logp.detach() - 0.7, logp.detach() - 0.3
    adv, entropy, replayed = torch.randn(n), torch.rand(n), torch.arange(n) % 2 == 0
    cfg = exgrpo.Config(policy_shaping=False, tis_cap=2.0)
    with_tis = exgrpo.token_loss(logp, old, adv, entropy, cfg, replayed=replayed, past_logp=past, sampler_logp=sampler)[0]
    without = exgrpo.token_loss(logp, old, adv, entropy, cfg, replayed=replayed, past_logp=past)[0]
    torch.testing.assert_close(with_tis[replayed], without[replayed])
    factor = (old - sampler).exp().clamp(max=2.0)[~replayed]
    torch.testing.assert_close(with_tis[~replayed], without[~replayed] * factor)


def test_metrics_use_the_configured_beta():
    """exgrpo/f_w_mean is f(w) with --shaping-beta, not a fixed 0.1. Catches a hard-coded β."""
    w = torch.tensor([0.5, 2.0])
    out = exgrpo.exgrpo_metrics(filled({1: 3}), 1, 4, True, w.log(), torch.zeros(2), beta=0.5)
    assert out["exgrpo/w_mean"] == pytest.approx(1.25)
    assert out["exgrpo/f_w_mean"] == pytest.approx(((w / (w + 0.5)).mean()).item())


# ----------------------------------------------------------------------------- 10. advantages of a mixed group

@pytest.mark.parametrize("j", range(8))
def test_mixed_group_advantage(j):
    grpo = pytest.importorskip("grpo")
    rewards = torch.tensor([1.0] + [1.0] * j + [0.0] * (7 - j))  # the replayed success, then 7 fresh samples
    adv = exgrpo.group_advantages(rewards, torch.zeros(8, dtype=torch.long), "none")
    assert adv[0].item() == pytest.approx(1 - (1 + j) / 8)
    if j == 7:
        assert torch.equal(adv, torch.zeros(8))  # all equal: no signal (and the question is retired)
    torch.testing.assert_close(adv, grpo.group_advantages(rewards, torch.zeros(8, dtype=torch.long), "none"))


# ----------------------------------------------------------------------------- end to end on a tiny model

RUN = ["--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "5", "--eval-size", "2", "--train-size", "6",
       "--micro-batch", "4", "--temperature", "1.0", "--dtype", "float32"]


def parity_reward(text, answer):
    """A test reward a random model earns half the time: an even number of characters."""
    return float(len(text) % 2 == 0)


@pytest.fixture(scope="module")
def soft_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with small embeddings (tied to the head): near-uniform next tokens, so samples differ."""
    import shutil

    from common.model import Transformer
    model = Transformer.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.embed_tokens.weight.mul_(0.02)
    folder = tmp_path_factory.mktemp("soft") / "model"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, folder / name)
    return folder


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(exgrpo, "score", parity_reward)
    torch.set_num_threads(1)
    return tmp_path


def rows(path):
    import json
    return [json.loads(line) for line in path.read_text().splitlines()]


def weights_of(ckpt):
    from safetensors.torch import load_file
    return load_file(str(ckpt / "model.safetensors"))


def trainer_state(ckpt):
    return torch.load(ckpt / "trainer.pt", weights_only=False)


def spy_main(monkeypatch, argv):
    """Run exgrpo.main, recording each step's questions, selected trajectories, update inputs and token_loss calls."""
    seen = {"questions": [], "selected": [], "update": [], "loss": []}
    real_questions, real_select, real_update, real_loss = (exgrpo.step_questions, exgrpo.select_trajectories,
                                                           exgrpo.update, exgrpo.token_loss)

    def spy_questions(*a, **kw):
        out = real_questions(*a, **kw)
        seen["questions"].append(out)
        return out

    def spy_select(*a, **kw):
        out = real_select(*a, **kw)
        seen["selected"].append([(t.tokens, t.logp.clone()) for t in out])
        return out

    def spy_update(policy, model, optimizer, b, adv, cfg, *a, **kw):
        seen["update"].append((b, cfg.eps_low, cfg.eps_high, a[3], kw.get("loss_kw")))
        return real_update(policy, model, optimizer, b, adv, cfg, *a, **kw)

    def spy_loss(logp, old, adv, entropy, cfg, **kw):
        seen["loss"].append((cfg.policy_shaping, cfg.is_correction, kw.get("replayed")))
        return real_loss(logp, old, adv, entropy, cfg, **kw)

    for name, spy in (("step_questions", spy_questions), ("select_trajectories", spy_select), ("update", spy_update),
                      ("token_loss", spy_loss)):
        monkeypatch.setattr(exgrpo, name, spy)
    exgrpo.main(argv)
    return seen


def test_smoke_main_replays_at_a_temperature(in_tmp, soft_model_dir, monkeypatch):
    """A 4-step run at T = 0.7 (issue 36 item 5: at T = 1 a temperature mismatch between the stored, the scored and the
    update's log-probs would pass): replay starts, the replayed rows are the selected trajectories with their stored
    log-probs as π_old, those equal the trainer's scoring pass of the step that collected them, and fresh tokens
    have ratio 1. Catches stored or scored log-probs at T = 1 while the update uses T_s, and replayed rows misplaced
    in the shuffled batch."""
    seen = spy_main(monkeypatch, ["--model", str(soft_model_dir), "--run-name", "smoke", "--steps", "4", "--start-acc",
                                  "-1", "--prompts-per-step", "4", *RUN[2:], "--temperature", "0.7"])
    steps = [r for r in rows(in_tmp / "runs/smoke/metrics.jsonl") if "exgrpo/mixed" in r]
    assert len(steps) == 4 and all(r["exgrpo/mixed"] == 1.0 for r in steps)
    assert steps[0]["exgrpo/replay_share"] == 0  # the first mixed step has an empty buffer
    assert steps[0]["exgrpo/buffer_trajectories"] > 0  # ...and fills it
    assert any(r["exgrpo/replay_share"] == 0.5 for r in steps[1:])  # ⌊ρB⌋ = 2 of the 4 questions
    replay_steps = [r for r in steps if r["exgrpo/replay_share"] > 0]
    assert all(0 < r["exgrpo/f_w_mean"] < 1 and r["exgrpo/w_mean"] > 0 for r in replay_steps)
    assert all(sum(r[f"exgrpo/bucket_{k}"] for k in range(1, 4)) == r["exgrpo/buffer_questions"] for r in steps)
    sampled = {}  # completion tokens -> the sampler's log-probs (at T_s) of the step that sampled them
    n_replayed = 0
    for (b, eps_low, eps_high, old_logp, loss_kw), (qids, replay), chosen in zip(seen["update"], seen["questions"],
                                                                                seen["selected"]):
        assert torch.equal(torch.bincount(b.group), torch.full((4,), 4))  # B groups of G
        assert (eps_low, eps_high) == (1.0, math.inf)  # mixed phase: fresh tokens unclipped
        assert old_logp is None  # μ = M = 1: the update's own forward is π_old, no full scoring pass
        starts = (torch.cumsum(b.lengths, 0) - b.lengths).tolist()
        span = [slice(st, st + n) for st, n in zip(starts, b.lengths.tolist())]
        replayed_rows = [4 * j for j, r in enumerate(replay) if r]  # the replayed trajectory leads its group
        assert len(chosen) == len(replayed_rows) and bool(loss_kw) == bool(chosen)
        for i, (tokens, stored) in zip(replayed_rows, chosen):
            assert tuple(b.tokens[i]) == tokens and loss_kw["replayed"][span[i]].all()
            torch.testing.assert_close(loss_kw["past_logp"][span[i]], stored, atol=0, rtol=0)  # π_past
            # ...the trainer's log-probs when it was sampled, at T_s: the sampler's then, up to the kernels' rounding
            torch.testing.assert_close(stored, sampled[tokens], atol=2e-4, rtol=0)
            n_replayed += 1
        if loss_kw:
            assert int(loss_kw["replayed"].sum()) == sum(int(b.lengths[i]) for i in replayed_rows)
        for i in set(range(len(b.tokens))) - set(replayed_rows):
            sampled.setdefault(tuple(b.tokens[i]), b.sampler_logp[span[i]])
    assert n_replayed > 0
    assert len([t for sel in seen["selected"] for t in sel]) == n_replayed
    state = trainer_state(in_tmp / "runs/smoke/checkpoint")["extra"]["exgrpo"]
    assert len(state) == 1 and state[0]["mixed"] and state[0]["buffer"]["pool"]


def test_overlong_mask_stores_only_finished_trajectories(in_tmp, soft_model_dir, monkeypatch):
    """Under --overlong-mask a truncated completion trains no token, so replayed it would fill a replay slot with
    nothing to learn: the buffer keeps only the finished correct completions (ending in a stop token). A near-uniform
    model's 5-token answers, half of them 'correct' (parity reward), a sixth of the vocabulary stopping them: most
    finish, some are cut. Fails when truncated ones are stored under the mask, or none is; without the mask they are."""
    real_tokenizer = exgrpo.Tokenizer.from_pretrained

    def many_stops(*a, **kw):
        tok = real_tokenizer(*a, **kw)
        tok.stop_ids = list(range(0, tok.vocab_size, 6))
        return tok
    monkeypatch.setattr(exgrpo.Tokenizer, "from_pretrained", many_stops)
    stop, stored, real_record = set(many_stops(soft_model_dir).stop_ids), [], Experience.record

    def spy_record(self, qid, *a, **kw):
        real_record(self, qid, *a, **kw)
        stored.extend(t.tokens for t in self.pool.get(qid, []))
    monkeypatch.setattr(Experience, "record", spy_record)
    run = ["--model", str(soft_model_dir), "--steps", "3", "--start-acc", "-1", "--prompts-per-step", "4", *RUN[2:]]
    exgrpo.main([*run, "--run-name", "masked", "--overlong-mask"])
    assert stored and all(t[-1] in stop for t in stored), stored
    stored.clear()
    exgrpo.main([*run, "--run-name", "plain"])
    assert any(t[-1] not in stop for t in stored)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_log_probs_for_the_buffer_and_w_without_a_scoring_pass_where_the_model_samples_itself(
        in_tmp, soft_model_dir, monkeypatch, dtype):
    """In fp32 the model samples itself: no scoring pass runs; the buffer stores the sampler's log-probs exactly, and
    the replayed rows' current log-probs (w*'s, and the 'sampler' value TIS sees) are the selection forward's, equal
    to the trainer's before the update. With a bf16 sampling copy the rows to store and replay are scored by the
    trainer. Catches the selection's log-probs placed on the wrong replayed rows, a pass that still runs in fp32, and
    a bf16 run storing its copy's log-probs."""
    from common.batch import trainer_logprobs
    scored, sampled, checked = [], {}, []
    real_scored, real_update = exgrpo.scored_rows, exgrpo.update
    monkeypatch.setattr(exgrpo, "scored_rows", lambda *a, **kw: scored.append(1) or real_scored(*a, **kw))

    def spy_update(policy, model, optimizer, b, adv, cfg, *a, **kw):
        starts = (torch.cumsum(b.lengths, 0) - b.lengths).tolist()
        replayed = (kw.get("loss_kw") or {}).get("replayed")
        rows = [i for i in range(len(b.tokens)) if replayed is not None and bool(replayed[starts[i]])]
        if rows:  # the trainer's log-probs of the replayed rows now, before the update
            sub = b.select(torch.tensor([i in rows for i in range(len(b.tokens))]))
            now, _ = trainer_logprobs(model, sub, 4, cfg.temperature, 0, "cpu", torch.autocast("cpu", enabled=False))
            at = torch.cat([torch.arange(starts[i], starts[i] + int(b.lengths[i])) for i in rows])
            if dtype == "float32":  # (a bf16 copy's selection forward is not the trainer's: scored again instead)
                torch.testing.assert_close(b.sampler_logp[at], now, atol=1e-5, rtol=0)
            checked.append(len(rows))
        for i in set(range(len(b.tokens))) - set(rows):
            logp_i = b.sampler_logp[starts[i]:starts[i] + int(b.lengths[i])].clone()  # a copy, not a view into b
            sampled.setdefault(tuple(b.tokens[i]), []).append(logp_i)
        return real_update(policy, model, optimizer, b, adv, cfg, *a, **kw)

    monkeypatch.setattr(exgrpo, "update", spy_update)
    exgrpo.main(["--model", str(soft_model_dir), "--run-name", "own", "--steps", "4", "--start-acc", "-1",
                 "--prompts-per-step", "4", *RUN[2:-2], "--dtype", dtype])
    pool = trainer_state(in_tmp / "runs/own/checkpoint")["extra"]["exgrpo"][0]["buffer"]["pool"]
    stored = [(tuple(tokens), logp) for ts in pool.values() for tokens, logp in ts]
    assert stored
    if dtype == "float32":
        assert not scored and sum(checked) > 0
        for tokens, logp in stored:  # exactly the sampler's, at one of the steps that sampled this completion
            assert any(torch.equal(logp, seen) for seen in sampled[tokens])
    else:
        assert scored  # the bf16 copy's log-probs differ from the trainer's: scored
        assert any(not any(torch.equal(logp, seen) for seen in sampled[tokens]) for tokens, logp in stored)


def test_retirement_in_the_loop(in_tmp, soft_model_dir, monkeypatch):
    """From step 3 on every rollout is right: each question drawn at steps 3-4 is retired (issue 36 item 5), leaves the
    buffer and its bucket, and no retired question is replayed afterwards. Catches retirement disabled (no question
    retired, or a retired one kept in the buffer or replayed)."""
    calls = []

    def parity_then_right(text, answer):
        calls.append(1)
        return 1.0 if len(calls) > 2 * 16 else parity_reward(text, answer)  # 16 rollouts a step

    monkeypatch.setattr(exgrpo, "score", parity_then_right)
    seen = spy_main(monkeypatch, ["--model", str(soft_model_dir), "--run-name", "retire", "--steps", "4",
                                  "--start-acc", "-1", "--prompts-per-step", "4", *RUN[2:]])
    (q1, _), (q2, _), (q3, r3), (q4, r4) = seen["questions"]
    steps = [r for r in rows(in_tmp / "runs/retire/metrics.jsonl") if "exgrpo/mixed" in r]
    assert any(r3) and steps[1]["exgrpo/buffer_questions"] > 0  # step 3 replayed stored questions
    state = trainer_state(in_tmp / "runs/retire/checkpoint")["extra"]["exgrpo"][0]["buffer"]
    retired = set(state["retired"])
    assert set(q3) | set(q4) <= retired and steps[3]["exgrpo/retired"] == len(retired)
    assert not retired & {int(q) for q in state["pool"]} and not retired & {int(q) for q in state["bucket"]}
    assert not set(q3) & {q for q, r in zip(q4, r4) if r}  # step 3's questions, retired, are not replayed at step 4
    assert steps[2]["exgrpo/buffer_questions"] < steps[1]["exgrpo/buffer_questions"]



def test_selection_scores_at_the_sampling_temperature_in_the_loop(in_tmp, soft_model_dir, monkeypatch):
    """The loop scores stored trajectories at --temperature (catches it falling back to T = 1)."""
    temps, real = [], exgrpo.select_trajectories
    monkeypatch.setattr(exgrpo, "select_trajectories",
                        lambda *a, **kw: temps.append(kw.get("temperature")) or real(*a, **kw))
    monkeypatch.setattr(exgrpo, "score", parity_reward)
    exgrpo.main(["--model", str(soft_model_dir), "--run-name", "temp", "--steps", "3", "--start-acc", "-1", *RUN,
                 "--temperature", "0.7"])
    assert temps and set(temps) == {0.7}

def test_nothing_is_collected_before_the_delayed_start(in_tmp, soft_model_dir):
    """Before the delayed start fires (ExGRPO §4.2, Alg. 1: collection belongs to the mixed phase) partly solved
    questions store nothing, so replay, once it begins, never draws trajectories of the pre-threshold policy. Catches
    collection from step 1 (record and the scoring marks both called with collect=True)."""
    exgrpo.main(["--model", str(soft_model_dir), "--run-name", "early", "--steps", "2", "--start-acc", "2", *RUN])
    steps = [r for r in rows(in_tmp / "runs/early/metrics.jsonl") if "exgrpo/mixed" in r]
    assert len(steps) == 2 and any(r["reward/zero_var_groups"] < 1 for r in steps)  # some groups were partly solved
    assert all(r["exgrpo/mixed"] == 0 and r["exgrpo/buffer_trajectories"] == 0 for r in steps)


def test_ablations_no_shaping_no_is_correction(in_tmp, soft_model_dir, monkeypatch):
    """ExGRPO Table 6 end to end: the switches reach token_loss at replay steps (catches the loop not passing them
    on; test_switches_in_token_loss catches token_loss ignoring either), and the logged ratio w* of the replayed
    tokens follows the switch: 1, against π_θold rather than the stored π_past (catches the metric ignoring it)."""
    seen = spy_main(monkeypatch, ["--model", str(soft_model_dir), "--run-name", "abl", "--steps", "3", "--start-acc",
                                  "-1", "--prompts-per-step", "4", *RUN[2:], "--no-policy-shaping",
                                  "--no-is-correction", "--trajectory-choice", "random", "--bucket-weighting",
                                  "question"])
    assert sum(map(len, seen["selected"])) > 0  # replay happened (random trajectories of uniformly drawn questions)
    assert any(replayed is not None for *_, replayed in seen["loss"])
    assert all((shaping, correction) == (False, False) for shaping, correction, _ in seen["loss"])
    steps = [r for r in rows(in_tmp / "runs/abl/metrics.jsonl") if "exgrpo/w_mean" in r]
    assert steps and all(r["exgrpo/w_mean"] == pytest.approx(1.0, abs=1e-5) for r in steps)


def test_replay_off_equals_grpo_step(in_tmp, soft_model_dir, monkeypatch):
    grpo = pytest.importorskip("grpo")
    monkeypatch.setattr(grpo, "score", parity_reward)
    common = ["--model", str(soft_model_dir), "--steps", "2", *RUN]
    grpo.main([*common, "--run-name", "grpo"])
    # ρ = 0 (whatever --start-acc: no mixed phase, no retirement), and replay on but before the delayed start
    exgrpo.main([*common, "--run-name", "off", "--replay-ratio", "0", "--start-acc", "-1"])
    exgrpo.main([*common, "--run-name", "early", "--start-acc", "2"])
    want = weights_of(in_tmp / "runs/grpo/checkpoint")
    start = weights_of(soft_model_dir)
    assert any(not torch.equal(want[k], start[k]) for k in want)
    for name in ("off", "early"):
        got = weights_of(in_tmp / f"runs/{name}/checkpoint")
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-5)
        ours = [r["reward/acc"] for r in rows(in_tmp / f"runs/{name}/metrics.jsonl") if "reward/acc" in r]
        assert ours == [r["reward/acc"] for r in rows(in_tmp / "runs/grpo/metrics.jsonl") if "reward/acc" in r]
    # ρ = 0 never enters the mixed phase (its fresh tokens would go unclipped, which binds with --mini-batches > 1)
    # nor retires a question (the stream would drop it at the next epoch): grpo.py's run beyond these two steps too
    off = [r for r in rows(in_tmp / "runs/off/metrics.jsonl") if "reward/acc" in r]
    assert all(r["exgrpo/mixed"] == 0 and r["exgrpo/retired"] == 0 and r["exgrpo/buffer_questions"] == 0 for r in off)


# A run cut at step 2 by a crash had taken the whole run's rates; asked for 2 steps, it would decay its own last steps
# (--decay-steps): it runs without the decay, which in the 4-step run is still under the warm-up at steps 1 and 2.
AS_IF_CUT = ["--decay-steps", "0"]


def test_resume_with_a_full_buffer_is_exact(in_tmp, soft_model_dir):
    common = ["--model", str(soft_model_dir), "--start-acc", "-1", "--save-every", "2", *RUN]
    exgrpo.main([*common, "--run-name", "straight", "--steps", "4"])
    exgrpo.main([*common, "--run-name", "halves", "--steps", "2", *AS_IF_CUT])
    half = trainer_state(in_tmp / "runs/halves/checkpoint")["extra"]["exgrpo"][0]
    assert half["buffer"]["pool"] and half["mixed"]  # the checkpoint holds a non-empty buffer
    exgrpo.main([*common, "--run-name", "halves", "--steps", "4", "--resume"])
    a, b = weights_of(in_tmp / "runs/straight/checkpoint"), weights_of(in_tmp / "runs/halves/checkpoint")
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (trainer_state(in_tmp / f"runs/{n}/checkpoint")["extra"]["exgrpo"][0] for n in ("straight", "halves"))
    assert sa["stream"] == sb["stream"] and sa["mixed"] == sb["mixed"]
    assert sa["buffer"]["bucket"] == sb["buffer"]["bucket"] and sa["buffer"]["retired"] == sb["buffer"]["retired"]
    assert {q: [t for t, _ in ts] for q, ts in sa["buffer"]["pool"].items()} == \
           {q: [t for t, _ in ts] for q, ts in sb["buffer"]["pool"].items()}
    ra, rb = rows(in_tmp / "runs/straight/metrics.jsonl"), rows(in_tmp / "runs/halves/metrics.jsonl")
    key = lambda r: {k: v for k, v in r.items() if not k.startswith("perf/")}  # noqa: E731
    train_a, train_b = ([key(r) for r in rs if "reward/acc" in r] for rs in (ra, rb))  # (halves also evaluated at 2)
    assert len(train_a) == 4 and train_a == train_b
    assert any(r["exgrpo/replay_share"] > 0 for r in train_a[2:])  # replay happened after the resume point
    from common.config import main_guard
    # the buffer's log-probs are at the sampling temperature: another --temperature is refused (issue 36 item 6)
    with pytest.raises(SystemExit) as e:
        main_guard(lambda: exgrpo.main([*common, "--run-name", "straight", "--steps", "6", "--resume",
                                        "--temperature", "0.9"]))
    assert e.value.code == 2
    # resumed with ρ = 0 from a checkpoint in the mixed phase: ExGRPO off from there on, as a ρ = 0 run is
    exgrpo.main([*common, "--run-name", "straight", "--steps", "5", "--resume", "--replay-ratio", "0"])
    after = [r for r in rows(in_tmp / "runs/straight/metrics.jsonl") if "reward/acc" in r][4:]
    assert len(after) == 1 and after[0]["exgrpo/mixed"] == 0 and after[0]["exgrpo/replay_share"] == 0
    # a checkpoint without the buffers (e.g. grpo.py's) cannot be resumed: one line, exit 2
    ckpt = in_tmp / "runs/straight/checkpoint/trainer.pt"
    saved = torch.load(ckpt, weights_only=False)
    del saved["extra"]["exgrpo"]
    torch.save(saved, ckpt)
    with pytest.raises(SystemExit) as e:
        main_guard(lambda: exgrpo.main([*common, "--run-name", "straight", "--steps", "6", "--resume"]))
    assert e.value.code == 2


# ----------------------------------------------------------------------------- 11. constant normaliser

def test_mixed_loss_is_padding_free_and_divided_by_a_constant(soft_model_dir):
    """One update of a mixed batch (a replayed row with its stored log-probs, shaped) with plain SGD: micro-batches of
    1 (no padding) and of 8 (padded to the longest) give the same step, and doubling L_max halves it."""
    from common.batch import Batch, trainer_logprobs
    from common.model import Transformer
    torch.manual_seed(0)
    contexts = [[1, 5, 9], [1, 5, 9], [2, 7], [2, 7], [3, 3, 3, 3], [3, 3, 3, 3], [4], [4]]
    tokens = [torch.randint(10, 500, (n,)).tolist() for n in (3, 7, 2, 5, 9, 4, 1, 6)]
    b = Batch(contexts, tokens, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), torch.zeros(8, dtype=torch.long),
              torch.zeros(sum(map(len, tokens))), torch.ones(8, dtype=torch.bool), ["1"] * 8)
    adv = torch.tensor([0.5, -0.5, 0.5, -0.5, 0.25, -0.25, 0.0, 0.0])
    shaped = (torch.arange(8) % 2 == 0).repeat_interleave(b.lengths)  # row 0 of each group was replayed
    cpu, no_autocast = torch.device("cpu"), torch.autocast("cpu", enabled=False)

    def step(micro, max_new_tokens):
        model = Transformer.from_pretrained(soft_model_dir)
        logp, _ = trainer_logprobs(model, b, 8, 1.0, 0, cpu, no_autocast)
        old = torch.where(shaped, logp - 0.3, logp)  # stored log-probs: the collecting policy differed
        cfg = exgrpo.Config(micro_batch=micro, max_new_tokens=max_new_tokens, temperature=1.0, eps_low=1.0,
                            eps_high=math.inf, max_grad_norm=1e9, loss_agg="seq-mean-token-sum-norm")  # the paper's
        before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        exgrpo.update(model, model, opt, b, adv, cfg, 0, cpu, no_autocast, None, None,
                      loss_kw={"replayed": shaped, "past_logp": old})
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach() - before

    one, eight, long = step(1, 12), step(8, 12), step(8, 24)
    assert one.abs().max() > 0
    torch.testing.assert_close(one, eight, atol=1e-7, rtol=1e-4)
    torch.testing.assert_close(long, eight / 2, atol=1e-7, rtol=1e-4)


@pytest.mark.parametrize("bad", [["--replay-ratio", "1.5"], ["--bucket-sigma", "0"], ["--dynamic-sampling"],
                                 ["--bucket-weighting", "x"], ["--shaping-beta", "0"], ["--trajectory-choice", "x"],
                                 ["--loss-type", "cispo"]])
def test_bad_options_are_one_line_errors(in_tmp, bad, capsys):
    from common.config import main_guard
    with pytest.raises(SystemExit) as e:
        main_guard(lambda: exgrpo.main(bad))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert bad[0] in err or bad[0][2:].replace("-", "_") in err
    assert not (in_tmp / "runs").exists()  # refused before anything is written


def test_fewer_questions_than_processes_is_a_one_line_error(in_tmp, soft_model_dir, monkeypatch, capsys):
    """Each process owns the questions whose index is its rank mod the world size: with fewer questions than
    processes a rank would own none, and its question stream would look for one forever."""
    from common.config import main_guard
    monkeypatch.setattr(exgrpo.dist, "world", lambda: 2)  # as under torchrun --nproc_per_node=2, rank 0
    real_stream = exgrpo.QuestionStream

    def stream(ids, *args):  # without the check: fail here, instead of the stream's endless search for a question
        assert len(ids), "a rank was given no question"
        return real_stream(ids, *args)

    monkeypatch.setattr(exgrpo, "QuestionStream", stream)
    with pytest.raises(SystemExit) as e:
        main_guard(lambda: exgrpo.main(["--model", str(soft_model_dir), "--steps", "1", *RUN, "--train-size", "1"]))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--train-size" in err and "2 questions" in err


def test_scoring_pass_covers_every_row_under_torchrun(monkeypatch):
    """One process scores only the rows to store or replay; under torchrun every rank scores all its rows, so that
    ranks with different rewards run the same forwards (FSDP2 gathers the weights in each: a rank that skipped the
    pass left the others waiting forever at step 1)."""
    from common.batch import Batch

    b = Batch(context=[[1, 2]] * 3, tokens=[[3, 4], [5], [6, 7, 8]], group=torch.zeros(3, dtype=torch.long),
              skip=torch.zeros(3, dtype=torch.long), sampler_logp=torch.zeros(6), finished=torch.ones(3, dtype=torch.bool),
              answer=["1"] * 3)
    seen = []
    monkeypatch.setattr(exgrpo, "trainer_logprobs", lambda m, sub, *a: seen.append(len(sub.tokens)) or
                        (-torch.ones(int(sub.lengths.sum())), None))
    rows = torch.tensor([False, True, False])
    one = exgrpo.scored_rows(None, b, rows, 8, 1.0, 0, "cpu", None)
    assert seen == [1] and one.isnan().tolist() == [True, True, False, True, True, True]
    monkeypatch.setattr(exgrpo.dist, "world", lambda: 2)
    assert not exgrpo.scored_rows(None, b, torch.zeros(3, dtype=torch.bool), 8, 1.0, 0, "cpu", None).isnan().any()
    assert seen == [1, 3]


def test_max_stored_keeps_the_most_recent_and_scores_only_those():
    """--max-stored 2: a question keeps its two latest distinct trajectories; to_store marks (for the scoring pass)
    only the new ones that will be kept, so no stored trajectory lacks its collection-time log-probs, also when a
    completion repeats an earlier one of its group (the unscored first row once came back as NaN log-probs and its
    replays made the loss NaN). Catches a cap that keeps the oldest, or one that scores rows it then drops."""
    exp = Experience(K, max_stored=2)
    exp.record(0, [True, True, False] + [False] * (K - 3), [[0, i] for i in range(K)], [torch.zeros(2)] * K,
               collect=True)
    assert [t.tokens for t in exp.pool[0]] == [(0, 0), (0, 1)]
    correct, comps = [True, True, True, True] + [False] * (K - 4), [[1, 0], [1, 1], [1, 2], [1, 2]] + [[1, 9]] * (K - 4)
    marks = exp.to_store(0, correct, comps, collect=True)
    assert marks == [False, True, True, False] + [False] * (K - 4)  # the 4th repeats the 3rd: stored once
    logps = [torch.full((2,), -1.0) if m else torch.full((2,), float("nan")) for m in marks]
    exp.record(0, correct, comps, logps, collect=True)
    assert [t.tokens for t in exp.pool[0]] == [(1, 1), (1, 2)]
    assert all(torch.isfinite(t.logp).all() for t in exp.pool[0])
    unbounded = Experience(K)
    for step in range(3):
        unbounded.record(0, correct, [[step, i] for i in range(K)], [torch.zeros(2)] * K, collect=True)
    assert len(unbounded.pool[0]) == 12  # 0 (the paper's): every distinct correct one


def test_a_question_twice_in_a_step_scores_what_its_second_group_stores():
    """A question can come twice in one step (replayed, and drawn fresh). record() meets its second group after the
    first group's trajectories are stored (and, with --max-stored, older ones dropped), so the rows to score must be
    marked against that buffer, not the one the step began with. Two cases: with the cap, the second group's new rows
    shift once a repeat of the first group's drops out (marking against the old buffer left a stored row unscored:
    NaN log-probs and an assertion, seen on a GPU run); without it, a repeat of the first group is not new. Fails if
    to_store_step marks each group against the step's starting buffer."""
    exp = Experience(K, max_stored=2)
    first = ([True, True] + [False] * (K - 2), [[5], [6]] + [[9]] * (K - 2))
    second = ([True, True, True] + [False] * (K - 3), [[4], [5], [6]] + [[9]] * (K - 3))
    marks = exp.to_store_step([(0, *first, False, None), (0, *second, False, None)], collect=True)
    assert exp.pool == {} and exp.bucket == {}  # marking stores nothing
    assert marks[0] == [True, True] + [False] * (K - 2)
    assert marks[1] == [True, False, False] + [False] * (K - 3)  # [5] and [6] are stored by then
    assert marks[1] != exp.to_store(0, *second, collect=True)  # the starting buffer would mark [5] and [6]
    for (correct, comps), m in zip((first, second), marks):  # record() stores exactly the marked rows: all scored
        exp.record(0, correct, comps, [torch.zeros(1) if x else torch.full((1,), float("nan")) for x in m], True)
    assert sorted(t.tokens for t in exp.pool[0]) == [(4,), (6,)]
    plain = Experience(K)
    marks = plain.to_store_step([(3, *first, False, None), (7, *first, False, None), (3, *first, False, None)],
                               collect=True)
    assert marks[0] == marks[1] == first[0] and marks[2] == [False] * K  # question 3's repeats: already stored
    assert plain.pool == {}  # marking stores nothing


def test_a_replayed_trajectory_keeps_its_collection_log_probs():
    """π_past is the policy that collected a trajectory (ExGRPO §4.2, eq. 4's denominator). Its question drawn fresh
    in the same step, with --max-stored 2, can push the replayed trajectory out of the buffer before its own group is
    recorded; it must not come back with this step's log-probs as π_past (its next replay's w would be ~1: the shaping
    would treat a stale trajectory as fresh). Fails if record() or to_store_step store a group's replayed row."""
    exp = Experience(K, max_stored=2)
    exp.record(0, [True] + [False] * (K - 1), [[1]] + [[9]] * (K - 1), [torch.full((1,), -5.0)] * K, collect=True)
    fresh = ([True, True] + [False] * (K - 2), [[3], [4]] + [[9]] * (K - 2), False)  # drawn fresh: two new correct
    replay = ([True, True] + [False] * (K - 2), [[1], [5]] + [[9]] * (K - 2), True)  # [1] from the buffer, [5] new
    marks = exp.to_store_step([(0, *fresh, None), (0, *replay, None)], collect=True)
    assert marks[1] == [False, True] + [False] * (K - 2)  # the replayed row is not scored to be stored
    for (correct, comps, replayed), m in zip((fresh, replay), marks):
        exp.record(0, correct, comps, [torch.full((1,), -0.1)] * K, True, replayed)
    assert [t.tokens for t in exp.pool[0]] == [(4,), (5,)]  # [1] was pushed out by [3] and [4], and stays out
    exp = Experience(K)  # unbounded: [1] is still stored, with its own log-probs
    exp.record(0, [True] + [False] * (K - 1), [[1]] + [[9]] * (K - 1), [torch.full((1,), -5.0)] * K, collect=True)
    exp.record(0, *replay[:2], [torch.full((1,), -0.1)] * K, True, True)
    assert {t.tokens: float(t.logp[0]) for t in exp.pool[0]} == {(1,): -5.0, (5,): pytest.approx(-0.1)}
