"""The four variant files repeat grpo.py's skeleton on purpose, so that `diff grpo.py xrpo.py` shows XRPO and nothing
else. These tests keep it so: a shared option keeps grpo.py's default, and a function of grpo.py that a variant does
not change for its algorithm stays the same text in the variant. A plumbing fix made in one file only fails here."""
import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# What each variant changes of grpo.py's own functions (its algorithm is there) and what it leaves out (its docstring
# says why): everything else of grpo.py's must be in it, word for word.
CHANGED = {
    "exgrpo": {"Config", "validate", "token_loss", "token_loss_plain", "main"},
    "xrpo": {"Config", "validate", "check_context", "main"},
    "extra": {"Config", "validate", "check_resume", "check_context", "token_loss", "token_loss_plain", "main"},
    "eapo": {"Config", "validate", "check_resume", "main"},
}
LEFT_OUT = {
    "exgrpo": {"step_prompts", "refill", "cispo_ratio"},  # step_questions mixes fresh and replayed; CISPO refused
    "xrpo": {"verify", "refill"},  # rollouts are scored round by round, inside its planner
    "extra": {"refill", "cispo_ratio"},  # CISPO refused: the dual clip bounds the clipped surrogate
    "eapo": {"refill"},  # every variant leaves out DAPO's refill
}
# the one default a variant changes for its algorithm: ExTra's finite pool of questions, so that they come back
DEFAULTS = {"exgrpo": {}, "extra": {"train_size": 48}, "xrpo": {}, "eapo": {}}


def top_level(name: str) -> dict:
    """{function or class name: its source text} of an algorithm file's top level."""
    src = (REPO / f"{name}.py").read_text()
    return {n.name: ast.get_source_segment(src, n) for n in ast.parse(src).body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


@pytest.mark.parametrize("algo", sorted(CHANGED))
def test_grpos_functions_are_repeated_word_for_word(algo):
    grpo, variant = top_level("grpo"), top_level(algo)
    missing = set(grpo) - set(variant)
    assert missing == LEFT_OUT[algo], f"{algo}.py lacks {sorted(missing - LEFT_OUT[algo])} of grpo.py's functions"
    differ = {name for name in set(grpo) & set(variant) if grpo[name] != variant[name]}
    assert differ <= CHANGED[algo], (f"{algo}.py's {sorted(differ - CHANGED[algo])} differ from grpo.py's: a fix made in "
                                     f"one file only? make it in all five")
    assert differ == CHANGED[algo], f"{algo}.py's {sorted(CHANGED[algo] - differ)} are grpo.py's again: update CHANGED"


@pytest.mark.parametrize("algo", sorted(CHANGED))
def test_shared_options_keep_grpos_defaults(algo):
    grpo = {f.name: f.default for f in dataclasses.fields(importlib.import_module("grpo").Config)}
    variant = {f.name: f.default for f in dataclasses.fields(importlib.import_module(algo).Config)}
    assert set(grpo) - set(variant) == {"refill_rounds"}, algo  # every variant leaves out DAPO's refill
    drifted = {k: (grpo[k], variant[k]) for k in set(grpo) & set(variant) if grpo[k] != variant[k]}
    assert drifted == {k: (grpo[k], v) for k, v in DEFAULTS[algo].items()}, f"{algo}.py: (grpo.py's, its) {drifted}"
