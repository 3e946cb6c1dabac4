"""The command line built from a Config dataclass: its --help text, and its one-line errors.
This paragraph runs over two lines, so a description cut back to the docstring's first line
fails the test below.

Not part of the description.
"""
import dataclasses
import re
from dataclasses import dataclass

import pytest

from common.config import parse

import grpo


@dataclass
class Config:
    rate: float = 0.5  # a rate, in %
    # a comment block above a field
    # that has no comment of its own
    name: str = "plain"
    flag: bool = True  # a boolean switch
    bare: int = 3
    choices = {"name": ["plain", "fancy"]}


def help_text(cls, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per help text, where argparse has the room
    with pytest.raises(SystemExit):
        parse(cls, ["--help"])
    return capsys.readouterr().out


def options(text: str) -> dict:
    """--flag -> its entry in --help (the flag's line and the help lines under it)."""
    entries = re.split(r"\n  (?=--)", text.split("options:", 1)[1])[1:]
    return {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries}


def test_help_shows_the_docstrings_whole_first_paragraph(capsys, monkeypatch):
    """Fails when the description is cut back to the docstring's first line, or runs past the first paragraph."""
    text = " ".join(help_text(Config, capsys, monkeypatch).split())
    assert ("The command line built from a Config dataclass: its --help text, and its one-line errors. This "
            "paragraph runs over two lines, so a description cut back to the docstring's first line fails the "
            "test below.") in text
    assert "Not part of the description" not in text
    grpo_text = " ".join(help_text(grpo.Config, capsys, monkeypatch).split())
    assert " ".join(grpo.__doc__.split("\n\n")[0].split()) in grpo_text


def test_help_shows_every_options_comment_and_default(capsys, monkeypatch):
    """Fails without a help formatter that adds defaults (booleans included), when a field without a comment
    of its own loses the comment above it, or when a % in a comment breaks argparse's formatting."""
    shown = options(help_text(Config, capsys, monkeypatch))
    assert shown["--rate"].endswith("a rate, in % (default: 0.5)")
    assert shown["--name"].endswith("a comment block above a field that has no comment of its own (default: plain)")
    assert shown["--flag"].endswith("a boolean switch (default: True)")
    assert shown["--bare"] == "--bare BARE (default: 3)"
    grpo_shown = options(help_text(grpo.Config, capsys, monkeypatch))
    assert len(grpo_shown) == len(grpo.Config.__dataclass_fields__)
    empty = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(grpo.Config) if f.default == ""}
    assert empty and all(("(default: " in entry) != (flag in empty) for flag, entry in grpo_shown.items())
    # an empty default is not shown as "(default: )": its comment says what empty means
    assert grpo_shown["--run-name"].endswith("empty = grpo-<date-time>"), grpo_shown["--run-name"]


def test_parse_reads_flags_and_refuses_a_bad_choice_in_one_line(capsys):
    cfg = parse(Config, ["--rate", "0.25", "--name", "fancy", "--no-flag"])
    assert (cfg.rate, cfg.name, cfg.flag, cfg.bare) == (0.25, "fancy", False, 3)
    with pytest.raises(SystemExit) as e:
        parse(Config, ["--name", "odd"])
    assert e.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_a_float_option_refuses_non_finite_values_in_one_line(value, capsys):
    """No option means inf or nan; before, --format-reward nan or ExTra's --alpha inf trained every step on NaN
    (each update skipped) and a run of one step ended with "done"."""
    with pytest.raises(SystemExit) as e:
        parse(Config, [f"--rate={value}"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--rate" in err and "finite" in err
    assert parse(Config, ["--rate", "-0.001"]).rate == -0.001
