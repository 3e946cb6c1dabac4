"""common.tasks: the generated arith task, the JSONL formats and their errors, load_task.

The named-task tests read the project's data/ folder (shipped in the repository, see data/README.md),
whatever $RLVR_DATA_DIR says, and fail, never skip, if a file is missing.
"""

import json
import re
from pathlib import Path

import pytest

from common import tasks
from common.tasks import DataError, Problem, arith_problems, format_question, load_jsonl, load_task
from common.verifier import score


DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture
def data_dir(monkeypatch) -> Path:
    monkeypatch.delenv("RLVR_DATA_DIR", raising=False)  # the shipped files, not a user's folder
    assert tasks.data_dirs() == [DATA]
    return DATA


def write(tmp_path, lines: list[str]) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------ arith

def _value(expr: str) -> int:
    assert re.fullmatch(r"[\d+\-* ()]+", expr)
    return eval(expr)  # safe here: the generator's own expressions, checked by the regex above


def test_arith_answers_are_correct_integers():
    for p in arith_problems(500, "train", seed=1, levels=(1, 2, 3, 4, 5)):
        assert p.answer == str(_value(p.meta["expr"]))
        assert p.prompt.endswith("?")
        assert score(f"\\boxed{{{p.answer}}}", p.answer) == 1.0


def test_arith_is_deterministic_per_seed_split_index():
    a = arith_problems(50, "train", seed=3)
    assert a == arith_problems(50, "train", seed=3)
    assert a[:20] == arith_problems(20, "train", seed=3)  # problem i does not depend on n
    assert a != arith_problems(50, "train", seed=4)


def test_arith_test_split_never_overlaps_train():
    levels = (1, 2, 3, 4, 5)
    train = {p.meta["expr"] for p in arith_problems(3000, "train", seed=0, levels=levels)}
    test = arith_problems(3000, "test", seed=0, levels=levels)
    assert not train & {p.meta["expr"] for p in test}
    assert not {p.prompt for p in arith_problems(3000, "train", seed=0)} & {p.prompt for p in test}


def test_arith_levels_span_easy_to_hard():
    by_level = {lv: arith_problems(100, "train", seed=0, levels=(lv,)) for lv in (1, 2, 3, 4, 5)}
    assert all(p.meta["level"] == lv for lv, ps in by_level.items() for p in ps)
    assert all(int(p.answer) <= 18 for p in by_level[1])  # one-digit sums
    assert all(len(re.findall(r"\d+", p.meta["expr"])) == 3 for p in by_level[3])
    assert any("*" in p.meta["expr"] for p in by_level[4])
    assert any(not p.prompt.startswith("What is") for p in by_level[3])  # some are word problems


def test_arith_rejects_bad_arguments():
    with pytest.raises(DataError):
        arith_problems(5, "valid")
    with pytest.raises(DataError):
        arith_problems(5, levels=(7,))


def test_format_question_asks_for_a_box():
    text = format_question(Problem("What is 2 + 3?", "5"))
    assert text.startswith("What is 2 + 3?\n") and "\\boxed{}" in text


# ------------------------------------------------------------------ JSONL formats

def test_formats_are_detected_per_line(tmp_path):
    path = write(tmp_path, [
        json.dumps({"question": "Q1", "answer": "3 + 4 = <<3+4=7>>7\n#### 1,007"}),  # GSM8K
        json.dumps({"problem": "Q2", "solution": "\\boxed{\\frac12}", "answer": "\\frac12", "level": 3}),
        json.dumps({"problem": "Q3", "answer": 27.0}),  # AMC: a float in JSON
        json.dumps({"problem": "Q4", "answer": 204}),
        "",  # blank lines are skipped
        json.dumps({"prompt": "Q5", "answer": "x"}),
        json.dumps({"question": "Q6", "answer": "0.25"}),
    ])
    ps = load_jsonl(path)
    assert [p.prompt for p in ps] == ["Q1", "Q2", "Q3", "Q4", "Q5", "Q6"]
    assert [p.answer for p in ps] == ["1007", "\\frac12", "27", "204", "x", "0.25"]
    assert ps[0].meta["solution"].endswith("#### 1,007") and ps[1].meta["level"] == 3


@pytest.mark.parametrize("line, says", [
    ('{"question": "Q", "answer": "1"', "invalid JSON"),
    ('[1, 2]', "expected a JSON object with fields question/answer, problem/answer or prompt/answer"),
    ('{"question": "Q"}', "got fields question"),
    ('{"text": "Q", "answer": "1"}', "expected a JSON object"),
    ('{"problem": 5, "answer": "1"}', "field 'problem' must be a non-empty string"),
    ('{"problem": "Q", "answer": ["1"]}', "field 'answer' must be a non-empty string or a finite number"),
    ('{"problem": "Q", "answer": NaN}', "field 'answer' must be a non-empty string or a finite number"),
    ('{"problem": "Q\\ud800", "answer": "1"}', "field 'problem' holds an unpaired UTF-16 surrogate"),
    ('[' * 100_000 + ']' * 100_000, "unreadable JSON"),  # deeper than Python's stack: a RecursionError before
    ('{"problem": "Q", "answer": 1' + '0' * 5000 + '}', "unreadable JSON"),  # over Python's 4300-digit limit
    ('{"problem": "Q", "answer": true}', "field 'answer'"),
    ('{"question": "Q", "answer": "so\\n####  "}', "nothing after '####'"),
])
def test_malformed_line_names_file_and_line(tmp_path, line, says):
    path = write(tmp_path, ['{"prompt": "ok", "answer": "1"}', line])
    with pytest.raises(DataError) as e:
        load_jsonl(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:2: ") and says in msg and "\n" not in msg


def test_a_long_integer_answer_stays_exact(tmp_path):
    """An integer answer is not read through a float: 401 digits would overflow it (a traceback before)."""
    assert load_jsonl(write(tmp_path, ['{"problem": "Q", "answer": 1' + "0" * 400 + "}"]))[0].answer == "1" + "0" * 400
    assert load_jsonl(write(tmp_path, ['{"problem": "Q", "answer": 27.0}']))[0].answer == "27"


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no problems"):
        load_jsonl(write(tmp_path, [""]))


# ------------------------------------------------------------------ load_task

def test_unknown_task():
    with pytest.raises(DataError, match="unknown task 'gsm9k': expected arith, gsm8k, math500, aime24, "
                                        "amc23 or a path to a .jsonl file"):
        load_task("gsm9k", "train")


def test_named_tasks_load_shipped_data(data_dir):
    sizes = {("gsm8k", "train"): 7473, ("gsm8k", "test"): 1319, ("math500", "all"): 500,
             ("aime24", "all"): 30, ("amc23", "all"): 40}
    for (name, split), size in sizes.items():
        ps = load_task(name, split)
        assert len(ps) == size
        assert all(p.prompt and p.answer for p in ps)
    assert load_task("gsm8k", "test")[0].answer == "18"
    assert load_task("amc23", "all")[0].answer == "27"  # 27.0 in the file
    assert len(load_task("gsm8k", "all")) == 7473 + 1319
    for folder in ("gsm8k", "math500"):  # MIT: the notice travels with the files
        assert "MIT License" in (data_dir / folder / "LICENSE").read_text()


def test_named_tasks_load_from_any_working_directory(data_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert len(load_task("amc23", "all")) == 40


def test_single_split_files_are_hash_split(data_dir):
    train, test = load_task("math500", "train"), load_task("math500", "test")
    assert len(train) + len(test) == 500 and 25 <= len(test) <= 75
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert test == load_task("math500", "test")  # deterministic


def test_an_empty_split_of_a_tiny_file_is_refused_in_one_line(tmp_path):
    """One problem: the hash split leaves one side empty, which is a DataError
    naming the file, not a ZeroDivisionError at step 1 or an accuracy over 0 problems."""
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(1)))
    sides = {}
    for split in ("train", "test"):
        try:
            sides[split] = len(load_task(str(path), split))
        except DataError as e:
            assert str(path) in str(e) and f"{split} split is empty" in str(e)
            sides[split] = 0
    assert sorted(sides.values()) == [0, 1]


def test_n_draws_a_seeded_sample(data_dir):
    a = load_task("gsm8k", "test", n=20, seed=0)
    assert len(a) == 20 and a == load_task("gsm8k", "test", n=20, seed=0)
    assert a != load_task("gsm8k", "test", n=20, seed=1)
    assert len(load_task("aime24", "all", n=100)) == 30  # n larger than the file: everything
    assert len(load_task("arith", "train", n=7)) == 7


def test_arith_levels_from_the_task_name():
    assert {p.meta["level"] for p in load_task("arith:4,5", "train", n=50)} == {4, 5}
    assert load_task("arith:1", "test", n=5) == arith_problems(5, "test", levels=(1,))
    with pytest.raises(DataError, match="arith:1,1,2,3"):
        load_task("arith:easy", "train")
    with pytest.raises(DataError, match="levels"):
        load_task("arith:9", "train")


def test_load_task_from_a_path(tmp_path):
    path = write(tmp_path, [json.dumps({"prompt": f"Q{i}", "answer": str(i)}) for i in range(200)])
    every = load_task(str(path), "all")
    train, test = load_task(str(path), "train"), load_task(str(path), "test")
    assert len(every) == 200 and len(train) + len(test) == 200 and test
    with pytest.raises(DataError, match="missing.jsonl: no such file"):
        load_task(str(tmp_path / "missing.jsonl"), "train")


def test_data_dir_search_order(tmp_path, monkeypatch):
    (tmp_path / "aime24").mkdir()
    (tmp_path / "aime24" / "test.jsonl").write_text('{"problem": "P", "answer": 1}\n')
    monkeypatch.setenv("RLVR_DATA_DIR", str(tmp_path))
    assert tasks.data_dirs()[0] == tmp_path
    assert [p.answer for p in load_task("aime24", "all")] == ["1"]
