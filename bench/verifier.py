"""Our verifier beside math-verify: accuracy, false accepts and time per call, by category.

    python bench/verifier.py                # ours, and math-verify when it is installed
    pip install math-verify==0.9.0          # (for the comparison only; the project does not need it)

Inputs, committed under tests/data/:
  equivalence.jsonl  MATH-500 reference answers against rewrites of them, boxed: equivalent forms and
                     near-misses, labelled by hand, by category
  extraction.jsonl   whole completions with a known reward: non-answers (digits in a subscript, a list
                     marker, a word), explicit answer cues, the cases the rules already got right
  completions.jsonl  real SmolLM2-135M-Instruct completions (arith, MATH-500, GSM8K test problems):
                     no labels; the two verifiers' agreement, and who pays where they disagree

math-verify is called as its README shows it, verify(parse(gold), parse(completion)) with the gold
boxed, from the main thread, where its signal-based timeouts work; the last section shows what
happens to each verifier in a worker thread. Times are CPU milliseconds per call (mean / max).
"""
import json
import os
import sys
import threading
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.config import OneLineParser  # noqa: E402  (a user mistake: one line, exit 2)
from common.verifier import score  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data")


def read(name: str) -> list[dict]:
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def math_verify_score():
    """math-verify as a score(completion, answer) function, or None when it is not installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None

    def mv_score(completion: str, answer: str) -> float:
        try:
            return float(verify(parse("\\boxed{" + answer + "}"), parse(completion)))
        except Exception:
            return 0.0
    return mv_score


def timed(fn, completion: str, answer: str) -> tuple[float, float]:
    # CPU time of this process, not wall time: on a busy machine other programs' load stays out
    start = time.process_time()
    reward = fn(completion, answer)
    return reward, time.process_time() - start


def labelled_table(title: str, rows: list[dict], verifiers: dict) -> None:
    """rows: category, completion, answer, label. Accuracy, false accepts/rejects, ms per call."""
    stats = {name: defaultdict(lambda: [0, 0, 0, 0, 0.0, 0.0]) for name in verifiers}  # n ok fa fr sum max
    for r in rows:
        for name, fn in verifiers.items():
            reward, seconds = timed(fn, r["completion"], r["answer"])
            for key in (r["category"], "all"):
                s = stats[name][key]
                ok = (reward == 1.0) == r["label"]
                s[0] += 1
                s[1] += ok
                s[2] += not ok and not r["label"]
                s[3] += not ok and r["label"]
                s[4] += seconds
                s[5] = max(s[5], seconds)
    print(f"\n## {title}\n")
    head = "| category | n |" + "".join(f" {n} acc | {n} false acc | {n} false rej | {n} CPU ms mean / max |"
                                        for n in verifiers)
    print(head)
    print("|" + "---|" * (2 + 4 * len(verifiers)))
    cats = list(dict.fromkeys(r["category"] for r in rows)) + ["all"]
    for cat in cats:
        line = f"| {cat} | {stats[next(iter(verifiers))][cat][0]} |"
        for name in verifiers:
            n, ok, fa, fr, total, worst = stats[name][cat]
            line += f" {100 * ok / n:.1f}% | {fa} | {fr} | {1000 * total / n:.2f} / {1000 * worst:.1f} |"
        print(line)


def agreement_table(rows: list[dict], verifiers: dict) -> None:
    """Real completions without labels: how often the two agree and who pays where they do not."""
    names = list(verifiers)
    print("\n## Real SmolLM2 completions (no labels): agreement\n")
    cols = ["task", "n"] + [f"reward {m}" for m in names] + ["agree"] + [f"only {m} pays" for m in names]
    cols += [f"{m} CPU ms mean / max" for m in names]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    by_task = defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r)
    for task, task_rows in list(by_task.items()) + [("all", rows)]:
        rewards, times = defaultdict(list), defaultdict(list)
        for r in task_rows:
            for name, fn in verifiers.items():
                reward, seconds = timed(fn, r["completion"], r["answer"])
                rewards[name].append(reward)
                times[name].append(seconds)
        n = len(task_rows)
        line = f"| {task} | {n} | " + " | ".join(f"{sum(rewards[m]) / n:.3f}" for m in names)
        if len(names) == 2:
            a, b = rewards[names[0]], rewards[names[1]]
            agree = sum(x == y for x, y in zip(a, b))
            line += f" | {100 * agree / n:.1f}% | {sum(x > y for x, y in zip(a, b))} | {sum(y > x for x, y in zip(a, b))}"
        else:
            line += " | - | -"  # agreement needs two verifiers
        line += " | " + " | ".join(f"{1000 * sum(times[m]) / n:.2f} / {1000 * max(times[m]):.1f}" for m in names)
        print(line + " |")


def thread_check(verifiers: dict) -> None:
    """Reward code often runs in a worker thread (a pool, a server): does each verifier still work?"""
    print("\n## In a worker thread\n")
    for name, fn in verifiers.items():
        out = {}

        def work():
            try:
                out["reward"] = fn("so the answer is $\\boxed{\\frac{\\sqrt{3}}{3}}$", "\\frac{1}{\\sqrt{3}}")
            except Exception as e:  # math-verify raises here unless its timeouts are turned off
                out["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        print(f"- {name}: " + (f"reward {out['reward']}" if "reward" in out else out["error"]))


def main(argv=None):
    OneLineParser(description=__doc__.splitlines()[0]).parse_args(argv)  # no options: --help, or one line for any
    verifiers = {"ours": score}
    mv = math_verify_score()
    if mv is not None:
        verifiers["math-verify"] = mv
    else:
        print("math-verify is not installed (pip install math-verify==0.9.0): ours only")
    equivalence = [dict(r, completion=f"So the answer is $\\boxed{{{r['candidate']}}}$.", answer=r["gold"])
                   for r in read("equivalence.jsonl")]
    labelled_table("Equivalent forms and near-misses of MATH-500 answers (boxed)", equivalence, verifiers)
    labelled_table("Whole completions: non-answers, answer cues, kept cases", read("extraction.jsonl"), verifiers)
    agreement_table(read("completions.jsonl"), verifiers)
    if mv is not None:
        import math_verify  # the raw library in a thread, as a user would call it
        raw = {"math-verify (raw)": lambda c, a: float(math_verify.verify(math_verify.parse("\\boxed{" + a + "}"),
                                                                          math_verify.parse(c)))}
        thread_check({"ours": score} | raw)
    else:
        thread_check({"ours": score})


if __name__ == "__main__":
    main()
