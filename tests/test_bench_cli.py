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


# the tools that time a CPU's matmuls in their own process: each must take MKL's kernels as the runs do, which
# common/memory.py picks when it is imported (MKL_CBWR=AUTO on CPUs not made by Intel; on a 2-core AMD EPYC with AVX2
# only MKL's default kernels took 2x the time of a decode pass at 8 rows, a path no run takes)
TIMES_CPU_MATMULS = ["bench/decode_gemm.py", "bench/default_run.py", "bench/extra_encoder.py", "bench/kernels.py",
                     "bench/sampler.py", "bench/sampler_heap.py", "bench/sampling_calls.py", "bench/task_rates.py"]


@pytest.mark.parametrize("tool", TIMES_CPU_MATMULS)
def test_a_cpu_timing_tool_takes_the_runs_mkl_branch(tool):
    code = ("import runpy, sys\n"
            f"sys.argv = [{tool!r}, '--help']\n"
            "try:\n"
            f"    runpy.run_path({tool!r}, run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "print('common.memory' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip().splitlines()[-1:] == ["True"], (tool, r.stdout[-300:], r.stderr[-300:])
