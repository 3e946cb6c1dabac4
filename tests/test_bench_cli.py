"""The bench/ tools and `python -m common.plot` answer a user mistake as the algorithm files do: one line on stderr
and exit 2 (argparse's own parser prints its usage first, and sys.exit("message") exits 1)."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# a mistake each tool refuses before it loads a model or starts a run
MISTAKES = {
    "bench/decode_attention.py": ["--bogus"],
    "bench/decode_gemm.py": ["--reps", "0"],
    "bench/default_run.py": ["--algo", "ppo"],
    "bench/gpu.py": ["--bogus"],
    "bench/kernels.py": ["-n", "0"],
    "bench/mechanisms.py": ["nowhere"],
    "bench/mkl_branch.py": ["--n", "4,x"],
    "bench/options.py": ["--only", "nothing"],
    "bench/phase_memory.py": ["ppo"],
    "bench/same_run.py": ["nowhere"],
    "bench/sampler.py": ["--reps", "0"],
    "bench/sampler_heap.py": ["--reps", "0"],
    "bench/sampling_calls.py": ["ppo"],
    "bench/verifier.py": ["--bogus"],
    "common/plot.py": ["nowhere"],
}


@pytest.mark.parametrize("tool", sorted(MISTAKES))
def test_a_mistake_is_one_line_and_exit_2(tool, tmp_path):
    cmd = [sys.executable, "-m", "common.plot"] if tool == "common/plot.py" else [sys.executable, str(REPO / tool)]
    r = subprocess.run([*cmd, *MISTAKES[tool]], cwd=REPO if tool == "common/plot.py" else tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, (tool, r.returncode, r.stderr)
