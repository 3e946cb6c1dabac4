"""bench/task_rates.py on a tiny model: one row per level, shares that add up, bad levels refused."""
import pytest

from bench import task_rates
from common.config import ConfigError


def test_one_row_per_level_and_shares_add_up(tiny_model_dir, capsys):
    task_rates.main(["--model", str(tiny_model_dir), "--levels", "1,3", "--questions", "3", "--samples", "2",
                     "--max-new-tokens", "4"])
    rows = [line.strip("|").split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r[0].strip() for r in rows[1:]] == ["1", "3"]  # after the header
    for r in rows[1:]:
        never, solved = float(r[1].strip().rstrip("%")), float(r[3].strip().rstrip("%"))
        assert never + solved == pytest.approx(100.0)  # a question is solved at least once or never


@pytest.mark.parametrize("levels", ["0", "1,x", "6"])
def test_bad_levels_are_refused(levels):
    with pytest.raises(ConfigError, match="--levels"):
        task_rates.main(["--levels", levels])
