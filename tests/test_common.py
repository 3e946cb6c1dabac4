"""common/ as a whole: the user errors live in one module, no two modules of common/ import each other, and the
memory helpers."""
import ast
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from common import errors, memory
from common.config import main_guard

COMMON = Path(__file__).resolve().parents[1] / "common"


def test_each_error_is_one_class_importable_where_it_always_was():
    """Fails when a module defines its own copy of an error (main_guard would not catch it)."""
    from common.config import ConfigError, RunError
    from common.model import ModelError
    from common.tasks import DataError

    assert (ConfigError, RunError, ModelError, DataError) == (
        errors.ConfigError, errors.RunError, errors.ModelError, errors.DataError)


@pytest.mark.parametrize("error, code", [(errors.ConfigError, 2), (errors.ModelError, 2), (errors.DataError, 2),
                                         (errors.RunError, 1)])
def test_main_guard_prints_one_line_and_exits(error, code, capsys):
    def main():
        raise error("--steps: expected a positive number")

    with pytest.raises(SystemExit) as e:
        main_guard(main)
    assert e.value.code == code
    assert capsys.readouterr().err == "error: --steps: expected a positive number\n"


def imports(path: Path) -> set:
    """The modules of common/ that `path` imports, at its top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "common":
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("common.")}
    return out - {path.stem}


def test_common_has_no_import_cycle():
    """Fails when two modules of common/ import each other, directly or through others (as hub.py and
    model.py once did, from inside functions)."""
    graph = {path.stem: imports(path) for path in COMMON.glob("*.py")}

    def reaches(start, target, seen):
        return any(m == target or (m not in seen and reaches(m, target, seen | {m})) for m in graph.get(start, ()))

    cycles = sorted(m for m in graph if reaches(m, m, set()))
    assert not cycles, f"import cycles through {cycles}: {({m: sorted(graph[m]) for m in cycles})}"


def test_peak_rss_is_in_gb_and_the_heap_trim_finds_glibc():
    """Fails when the peak is read in the wrong unit (KiB on Linux, bytes on macOS), or when glibc's malloc_trim
    is not found where it exists (the trainer's peak would silently grow)."""
    touched = b"x" * (300 * 2**20)  # 300 MiB, written: resident
    assert 0.3 <= memory.peak_rss_gb() < 64
    del touched
    memory.release_free_memory()
    if sys.platform == "linux" and platform.libc_ver()[0] == "glibc":
        assert memory._LIBC is not None


def test_heap_temporaries_raise_the_mmap_threshold_inside_only_and_hand_the_pages_back(monkeypatch):
    """Fails when the threshold is not raised inside, or not set back to the fixed 1 MB after (also when the body
    raises: the trainer's blocks would then pile up in the heap). Handing the pages back is the caller's (it trims
    once its temporaries are dropped: test_sampler.py)."""
    from conftest import RecordingLibc

    libc = RecordingLibc()
    monkeypatch.setattr(memory, "_LIBC", libc)
    monkeypatch.setattr(memory, "_MALLOPT", True)
    with pytest.raises(RuntimeError):
        with memory.heap_temporaries():
            assert libc.calls == [("mallopt", memory.M_MMAP_THRESHOLD, 64 << 20)]
            raise RuntimeError("a failed sampling call")
    assert libc.calls == [("mallopt", memory.M_MMAP_THRESHOLD, 64 << 20),
                          ("mallopt", memory.M_MMAP_THRESHOLD, memory.MMAP_THRESHOLD)]
    assert memory.MMAP_THRESHOLD == 1 << 20


@pytest.mark.parametrize("preset", [None, "1024"])
def test_the_onednn_primitive_caches_are_capped_before_the_algorithm_files_run(preset):
    """Fails when the caps are dropped, set too late to exist once an algorithm file is imported, or override a
    value the user set (in bf16 on a CPU the uncapped caches grow a run's memory step by step: common/memory.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    if preset:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = env["LRU_CACHE_CAPACITY"] = preset
    code = ("import os, grpo, exgrpo, xrpo, extra, eapo; "
            "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=COMMON.parent, env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [preset or "64"] * 2


@pytest.mark.parametrize("cpuinfo, branch", [("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\n", "AUTO"),
                                             ("vendor_id\t: HygonGenuine\n", "AUTO"),
                                             ("processor\t: 0\nvendor_id\t: GenuineIntel\n", None),
                                             ("", None)])
def test_mkl_takes_its_instruction_set_branch_on_cpus_not_made_by_intel(cpuinfo, branch):
    """Fails if Intel's CPUs lose MKL's default, or AMD's keep it (common/memory.py: its slower kernels there)."""
    assert memory.mkl_branch(cpuinfo) == branch


def _first_sgemm_cnr(env: dict) -> str:
    """The CNR mode MKL reports (MKL_VERBOSE) for the first matmul of a process that imports the five files."""
    code = "import grpo, exgrpo, xrpo, extra, eapo, torch; torch.ones(64, 64) @ torch.ones(64, 64)"
    out = subprocess.run([sys.executable, "-c", code], cwd=COMMON.parent, env={**env, "MKL_VERBOSE": "1"},
                         capture_output=True, text=True, check=True).stdout
    return next((word for line in out.splitlines() if "GEMM" in line for word in line.split() if word.startswith("CNR:")),
                "no MKL line")


@pytest.mark.parametrize("preset", [None, ""])
def test_mkls_branch_is_set_before_its_first_call_and_a_users_value_wins(preset):
    """On this machine's CPU: MKL runs the branch common/memory.py chose for it (or MKL's default, CNR:OFF, when the
    user set MKL_CBWR empty). Fails where the setting comes after MKL's first call (MKL would not read it), where it
    overrides the user's value, or where an Intel CPU is moved off MKL's default."""
    import torch

    if not torch.backends.mkl.is_available():
        pytest.skip("this PyTorch is not built with MKL (the setting is MKL's only)")
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if preset is not None:
        env["MKL_CBWR"] = preset
    chosen = memory._MKL_BRANCH  # for this machine's /proc/cpuinfo
    assert _first_sgemm_cnr(env) == ("CNR:AUTO" if chosen and preset is None else "CNR:OFF")
