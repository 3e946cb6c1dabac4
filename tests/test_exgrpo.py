"""exgrpo.py: the ExGRPO test properties (arXiv 2510.02245 §3-4, App. C-D) on toy inputs and a tiny model,
the reduction to grpo.py's Dr. GRPO step with replay off, resume equivalence with a non-empty buffer, and a
smoke run of main()."""
import math

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


# ----------------------------------------------------------------------------- 3. n and the batch size

@pytest.mark.parametrize("rho,B,valid,n", [(0.5, 128, 1000, 64), (0.5, 128, 10, 10), (0.5, 8, 0, 0), (0.0, 8, 50, 0),
                                           (0.3, 10, 50, 3), (1.0, 8, 5, 5), (0.5, 7, 50, 3)])
def test_replay_count(rho, B, valid, n):
    assert exgrpo.replay_count(rho, B, valid) == n
    assert n + (B - n) == B  # the rest of the batch is fresh


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
    tiny = QuestionStream(list(range(24)), B=4, seed=3)  # 24 - 8 = 16 < B + 20: keep all
    assert sorted(q for _ in range(6) for q in tiny.next(retired)) == list(range(24))


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

    def forward(self, ids, targets, target_mask, temperature):
        from kernels import logprobs_entropy
        logits = self.table[ids] / 1.0
        return logprobs_entropy(logits[target_mask], targets[target_mask], temperature)


def test_selection_picks_lowest_mean_entropy():
    V = 6
    table = torch.zeros(V, V)  # token 0..2: uniform next-token distribution (entropy log 6)
    table[3, 4] = table[4, 5] = table[5, 3] = 30.0  # tokens 3, 4, 5: nearly deterministic successors
    model = ToyLM(table)
    exp = Experience(K)
    low, high, mid = [3, 4, 5, 3], [0, 1, 2, 0], [3, 4, 0, 1, 2, 0, 4, 5]
    exp.pool[7] = [Trajectory(tuple(high), torch.zeros(4)), Trajectory(tuple(low), torch.zeros(4)),
                   Trajectory(tuple(mid), torch.zeros(8))]
    exp.bucket[7] = 3
    exp.pool[8] = [Trajectory(tuple(mid), torch.zeros(8)), Trajectory(tuple(high), torch.zeros(4))]
    exp.bucket[8] = 5
    prompts = {7: [1, 3], 8: [2]}  # each prompt's last token conditions the first completion token
    h = exgrpo.trajectory_scores(model, [prompts[7]] * 3, [high, low, mid], 0, micro_batch=2)
    hand = []
    for p, c in ((prompts[7], high), (prompts[7], low), (prompts[7], mid)):
        logits = table[torch.tensor(p[-1:] + c[:-1])]
        hand.append(torch.special.entr(logits.softmax(-1)).sum(-1).mean())
    torch.testing.assert_close(h, torch.stack(hand))
    chosen = exgrpo.select_trajectories(model, exp, [7, 8], [prompts[7], prompts[8]], 0, micro_batch=3)
    assert chosen[0].tokens == tuple(low)  # after prompt token 3, `low` is all near-deterministic steps
    assert chosen[1].tokens == tuple(mid)  # mid (half its steps deterministic) beats high
    # the score is recomputed under the current policy: make tokens 0..2 deterministic and 3..5 uniform
    with torch.no_grad():
        model.table.copy_(torch.zeros(V, V))
        model.table[0, 1] = model.table[1, 2] = model.table[2, 0] = 30.0
    chosen = exgrpo.select_trajectories(model, exp, [7], [[1, 0]], 0, micro_batch=3)
    assert chosen[0].tokens == tuple(high)


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
