"""Tasks: lists of Problem(prompt, answer, meta) that the algorithms sample prompts from.

    load_task("arith", "train", n=512, seed=0)     # built-in generated arithmetic word problems
    load_task("arith:1,2,2,4", "test", n=200)      # the same with another mix of levels 1..5
    load_task("gsm8k", "test")                     # the project's data/ folder (see data/README.md)
    load_task("my_problems.jsonl", "train")        # any JSON-lines file in one of those formats

Splits. "arith" draws train and test problems from disjoint halves of the problem space (a hash of
the arithmetic expression decides which split may use it), so no test problem is a train problem,
however worded. gsm8k has real train/test files. A file with a single split (math500, aime24,
amc23, your own .jsonl) is split by a hash of each prompt: about 10% "test", the rest "train";
split="all" gives every problem of a file (e.g. to evaluate on all of MATH-500).
"""

import hashlib
import json
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import DataError

DATA = Path(__file__).resolve().parents[1] / "data"  # shipped with the project; any working directory
FILES = {  # task name -> data file per split, relative to the data folder
    "gsm8k": {"train": "gsm8k/train.jsonl", "test": "gsm8k/test.jsonl"},
    "math500": {"all": "math500/test.jsonl"},
    "aime24": {"all": "aime24/test.jsonl"},
    "amc23": {"all": "amc23/test.jsonl"},
}
TEST_PERCENT = 10  # share of a single-split file that the hash puts in "test"
ARITH_N = 1000  # problems generated when load_task("arith", ...) gets n=None
# SmolLM2-135M-Instruct, greedy, 40 test problems per level, 160 new tokens: level 1 65%, level 2
# 25%, level 3 0%, level 4 ~3%; so the default mix starts near 30%. "arith:1,1,2,3" sets another.
ARITH_LEVELS = (1, 2, 3)
EXPECTED = "expected a JSON object with fields question/answer, problem/answer or prompt/answer"


@dataclass
class Problem:
    prompt: str  # the question as the user asks it (no chat template, no answer-format instruction)
    answer: str  # the reference final answer, checked by common.verifier.score
    meta: dict = field(default_factory=dict)  # anything else: level, solution, source fields


def format_question(problem: Problem) -> str:
    """The user message for a problem; the tokenizer's chat template wraps it."""
    return f"{problem.prompt}\nPut your final answer within \\boxed{{}}."


def _in_test(key: str) -> bool:
    # sha256, not hash(): the split must not depend on PYTHONHASHSEED or the machine
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 100 < TEST_PERCENT


# ---------------------------------------------------------------- generated arithmetic ("arith")

NAMES = [("Tom", "he"), ("Anna", "she"), ("Ben", "he"), ("Mia", "she"), ("Sam", "he"),
         ("Lily", "she"), ("Max", "he"), ("Emma", "she"), ("Leo", "he"), ("Zoe", "she")]
ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cards", "shells"]
MORE = ["buys {} more", "gets {} more", "finds {} more"]
LESS = ["gives away {}", "loses {}", "sells {}"]


def _chain(rng: random.Random, terms: int, lo: int, hi: int, ops: str) -> list[tuple[str, int]]:
    """[("", a), ("+", b), ("-", c), ...] with every running total >= 0, so a story can tell it."""
    total = rng.randint(max(lo, 2), hi)  # at least 2: "has 1 apples" reads badly
    chain = [("", total)]
    for _ in range(terms - 1):
        op = rng.choice(ops) if total >= lo else "+"
        x = rng.randint(lo, min(hi, total)) if op == "-" else rng.randint(lo, hi)
        total += x if op == "+" else -x
        chain.append((op, x))
    return chain


def _arith(rng: random.Random, level: int) -> tuple[str, int, str | None]:
    """(expression, value, word problem or None) for one difficulty level.

    1: a + b, one digit          2: a +/- b, up to two digits    3: three terms, +/-, up to two digits
    4: a * b +/- c, 2-3 digits   5: (a +/- b) * c +/- d, 2-3 digits
    """
    name, he = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    if level <= 3:
        terms, lo, hi, ops = {1: (2, 1, 9, "+"), 2: (2, 1, 99, "+-"), 3: (3, 1, 99, "+-")}[level]
        chain = _chain(rng, terms, lo, hi, ops)
        expr = " ".join(f"{op} {x}" if op else str(x) for op, x in chain)
        value = sum(-x if op == "-" else x for op, x in chain)
        steps = [rng.choice(MORE if op == "+" else LESS).format(x) for op, x in chain[1:]]
        story = (f"{name} has {chain[0][1]} {item}. {he.capitalize()} {' and then '.join(steps)}. "
                 f"How many {item} does {name} have now?")
        return expr, value, story
    a, b, c = rng.randint(10, 99), rng.randint(2, 9), rng.randint(10, 999)
    if level == 4:
        op = rng.choice("+-") if a * b >= c else "+"
        value = a * b + c if op == "+" else a * b - c
        more = (rng.choice(MORE) if op == "+" else rng.choice(LESS)).format(c)
        story = (f"{name} buys {a} boxes with {b} {item} in each box, and then {more}. "
                 f"How many {item} does {name} have now?")
        return f"{a} * {b} {op} {c}", value, story
    d, op1, op2 = rng.randint(10, 99), rng.choice("+-"), rng.choice("+-")
    value = ((c + d if op1 == "+" else c - d) * b) + (a if op2 == "+" else -a)
    return f"({c} {op1} {d}) * {b} {op2} {a}", value, None


def arith_problems(n: int, split: str = "train", seed: int = 0, levels=ARITH_LEVELS) -> list[Problem]:
    """n arithmetic problems, the i-th a function of (seed, split, i) only.

    Each problem's level is drawn uniformly from `levels` (repeat a level to weight it, e.g.
    (1, 1, 2, 3)); half are worded as a short story, half as "What is 23 + 17 - 9?" (level 5 is
    always an expression). The hash of the expression picks its split: a problem drawn for the
    wrong split is redrawn, so train and test never share an expression.
    """
    if split not in ("train", "test"):
        raise DataError(f"arith: unknown split '{split}': expected train or test")
    if not levels or any(lv not in (1, 2, 3, 4, 5) for lv in levels):
        raise DataError(f"arith: levels {levels!r}: expected a non-empty tuple of 1..5")
    problems = []
    for i in range(n):
        for attempt in range(10_000):  # ~10 tries for "test"; 9 of the 72 level-1 sums are test
            rng = random.Random(f"arith/{seed}/{split}/{i}/{attempt}")  # str seeds are stable
            level = rng.choice(levels)
            expr, value, story = _arith(rng, level)
            if _in_test(expr) == (split == "test"):
                break
        else:
            raise DataError(f"arith: no {split} problem found for levels {levels!r}")
        prompt = story if story and rng.random() < 0.5 else f"What is {expr}?"
        problems.append(Problem(prompt, str(value), {"level": level, "expr": expr}))
    return problems


# ---------------------------------------------------------------- JSON-lines files

def _answer_text(value) -> str | None:
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # not through float: an integer of 400 digits is still exact
    if isinstance(value, float) and math.isfinite(value):
        return str(int(value)) if value.is_integer() else repr(value)  # AMC: 27.0 -> "27"
    return None


def _problem(d, where: str) -> Problem:
    """One parsed line -> Problem: GSM8K, MATH, AIME/AMC or plain prompt/answer, told apart by fields."""
    if not isinstance(d, dict):
        raise DataError(f"{where}: {EXPECTED}, got {type(d).__name__}")
    key = next((k for k in ("problem", "question", "prompt") if k in d), None)
    if key is None or "answer" not in d:
        raise DataError(f"{where}: {EXPECTED}; got fields {', '.join(sorted(d)) or 'none'}")
    if not isinstance(d[key], str) or not d[key].strip():
        raise DataError(f"{where}: field '{key}' must be a non-empty string")
    answer = _answer_text(d["answer"])
    if not answer:
        raise DataError(f"{where}: field 'answer' must be a non-empty string or a finite number")
    for name, text in ((key, d[key]), ("answer", answer)):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # JSON's \ud800 escapes decode to a lone surrogate, which no tokenizer can encode
            raise DataError(f"{where}: field '{name}' holds an unpaired UTF-16 surrogate (a \\uD800-\\uDFFF escape)") from None
    meta = {k: v for k, v in d.items() if k not in ("problem", "question", "prompt", "answer")}
    if key == "question" and "####" in answer:  # GSM8K: worked solution ending in "#### 1,234"
        meta["solution"] = answer
        answer = answer.rsplit("####", 1)[1].strip().replace(",", "")
        if not answer:
            raise DataError(f"{where}: nothing after '####' in field 'answer'")
    return Problem(d[key].strip(), answer, meta)


def load_jsonl(path) -> list[Problem]:
    """Every problem of a JSON-lines file; blank lines are skipped, anything else malformed raises."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file (expected a JSON-lines file of problems)")
    problems = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8").strip()
                if line:
                    problems.append(_problem(json.loads(line), where))
            except DataError:
                raise
            except UnicodeDecodeError:
                raise DataError(f"{where}: not UTF-8 text; {EXPECTED}") from None
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg}, column {e.colno}); {EXPECTED}") from None
            except (ValueError, RecursionError) as e:  # an integer of over 4300 digits; nesting deeper than Python's stack
                raise DataError(f"{where}: unreadable JSON ({str(e)[:100] or type(e).__name__}); {EXPECTED}") from None
    if not problems:
        raise DataError(f"{path}: no problems in the file; {EXPECTED}, one per line")
    return problems


def data_dirs() -> list[Path]:
    """Where the named tasks' files are looked for, in order: $RLVR_DATA_DIR if set, then data/."""
    env = os.environ.get("RLVR_DATA_DIR")
    return ([Path(env)] if env else []) + [DATA]


def _find(rel: str, task: str) -> Path:
    for d in data_dirs():
        if (d / rel).is_file():
            return d / rel
    tried = ", ".join(str(d) for d in data_dirs())
    raise DataError(f"task '{task}': {rel} not found in {tried} (set RLVR_DATA_DIR to the data folder)")


def _split(problems: list[Problem], split: str, where: str) -> list[Problem]:
    if split == "all":
        return problems
    if split not in ("train", "test"):
        raise DataError(f"{where}: unknown split '{split}': expected train, test or all")
    chosen = [p for p in problems if _in_test(p.prompt) == (split == "test")]
    if not chosen:  # a tiny file: training would divide by zero, evaluation would score nothing
        raise DataError(f"{where}: its {split} split is empty: a file without a split of its own puts ~10% of its "
                        f"{len(problems)} problems in test, by a hash of each question; give it more problems")
    return chosen


def load_task(name_or_path: str, split: str = "train", n: int | None = None, seed: int = 0) -> list[Problem]:
    """The problems of a task: "arith[:levels]", "gsm8k", "math500", "aime24", "amc23" or a .jsonl path.

    n=None gives every problem of a file (in file order) or ARITH_N generated ones; a smaller n
    gives a sample of n drawn with `seed` (for arith, `seed` picks the generated problems).
    """
    if name_or_path == "arith" or name_or_path.startswith("arith:"):
        spec = name_or_path.partition(":")[2]
        try:
            levels = tuple(int(v) for v in spec.split(",")) if spec else ARITH_LEVELS
        except ValueError:
            raise DataError(f"task '{name_or_path}': expected arith or arith:<levels>, "
                            "e.g. arith:1,1,2,3") from None
        return arith_problems(ARITH_N if n is None else n, split, seed, levels)
    if name_or_path in FILES:
        files = FILES[name_or_path]
        if split in files:
            problems = load_jsonl(_find(files[split], name_or_path))
        elif "all" in files:  # one file: hash split
            problems = _split(load_jsonl(_find(files["all"], name_or_path)), split, name_or_path)
        elif split == "all":
            problems = [p for s in ("train", "test") for p in load_jsonl(_find(files[s], name_or_path))]
        else:
            raise DataError(f"{name_or_path}: unknown split '{split}': expected train, test or all")
    elif name_or_path.endswith(".jsonl") or Path(name_or_path).is_file():
        problems = _split(load_jsonl(name_or_path), split, name_or_path)
    else:
        raise DataError(f"unknown task '{name_or_path}': expected arith, gsm8k, math500, aime24, amc23 "
                        "or a path to a .jsonl file")
    if n is not None and n < len(problems):
        problems = random.Random(seed).sample(problems, n)
    return problems
