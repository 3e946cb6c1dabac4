"""common.passk: pass@k against brute-force enumeration, majority voting and its ties."""

from itertools import combinations

import pytest

from common.passk import maj_at_k_correct, majority_vote, pass_at_k


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    samples = [True] * c + [False] * (n - c)
    subsets = list(combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n, c, k", [
    (n, c, k) for n in (1, 2, 5, 8, 10) for c in range(n + 1) for k in range(1, n + 1)
])
def test_pass_at_k_matches_enumeration(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_edges():
    assert pass_at_k(16, 0, 4) == 0.0
    assert pass_at_k(16, 16, 4) == 1.0
    assert pass_at_k(16, 1, 16) == 1.0  # k = n: any correct sample is in the only subset
    assert pass_at_k(16, 3, 1) == pytest.approx(3 / 16)  # pass@1 is the accuracy
    assert 0.0 < pass_at_k(10_000, 1, 10) < 0.0011  # large n: no overflow, stays accurate


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_majority_vote_groups_equivalent_answers():
    # 0.5, \frac{1}{2} and 1/2 are one answer with three votes; 3 has two
    assert majority_vote(["3", "0.5", "\\frac{1}{2}", "3", "1/2"]) == "0.5"


def test_majority_vote_ties_go_to_first_seen():
    assert majority_vote(["7", "5", "5", "7"]) == "7"
    assert majority_vote(["5", "7", "7", "5"]) == "5"


def test_majority_vote_ignores_none():
    assert majority_vote([None, None, "4"]) == "4"
    assert majority_vote([None, None]) is None
    assert majority_vote([]) is None


def test_maj_at_k_correct():
    right, wrong = "so \\boxed{12}", "so \\boxed{13}"
    assert maj_at_k_correct([wrong, right, right], "12")
    assert not maj_at_k_correct([wrong, wrong, right], "12")
    assert maj_at_k_correct([right, wrong], "12")  # tie: the first answer wins
    assert not maj_at_k_correct(["no answer", "still none"], "12")
    assert maj_at_k_correct(["\\boxed{13}"], "12", score_fn=lambda c, a: 1.0)  # any verifier
