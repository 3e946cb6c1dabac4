"""Evaluation math: pass@k and majority@k from n sampled completions per problem.

pass@k is the unbiased estimator of Chen et al. 2021 (Codex, arXiv 2107.03374, §2.1, Eq. 1): with n
samples of which c are correct, the chance that a random k-subset holds at least one correct sample,
1 - C(n-c, k) / C(n, k). maj@k asks whether the most common final answer (equivalent answers grouped by
common.verifier.answer_key) is right: the majority vote of self-consistency (Wang et al. 2022,
arXiv 2203.11171, §2).
"""

from collections import Counter

from common.verifier import answer_key, extract_answer, score


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k), as a product so that large n neither overflows nor loses precision."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i)
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority_vote(answers: list[str | None]) -> str | None:
    """The most common answer, equivalent answers counted together; ties go to the one seen first.

    Returns the first-seen spelling of the winning group; None answers (nothing extracted) do not
    vote, and if no answer votes the result is None.
    """
    keys = [None if a is None else answer_key(a) for a in answers]
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return None
    best = max(counts.values())
    for a, k in zip(answers, keys):  # first occurrence order breaks ties
        if k is not None and counts[k] == best:
            return a
    return None


def maj_at_k_correct(completions: list[str], answer: str, score_fn=score) -> bool:
    """Whether the majority answer of `completions` is correct.

    The completion that first gave the majority answer is scored with `score_fn(completion,
    answer)`, so any verifier with the signature of common.verifier.score can be used.
    """
    answers = [extract_answer(c) for c in completions]
    winner = majority_vote(answers)
    if winner is None:
        return False
    return score_fn(completions[answers.index(winner)], answer) > 0
