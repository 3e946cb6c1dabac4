"""bench/options.py and bench/sampling_calls.py: every option row is a command grpo.py accepts, reading a metric grpo.py
logs; the generate() wrapper reports each call and returns its samples unchanged."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import grpo
from common.config import parse

REPO = Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


OPTIONS = load("options").OPTIONS
SOURCE = (REPO / "grpo.py").read_text()


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option_row_parses_and_reads_a_logged_metric(name):
    flags, metric, _ = OPTIONS[name]
    cfg = parse(grpo.Config, ["--steps", "3", *flags])
    grpo.validate(cfg)
    assert f'"{metric}"' in SOURCE  # a metric grpo.py writes, by that name


def test_sampling_calls_reports_each_call(capsys):
    from common.sampler import Sample
    calls = load("sampling_calls")
    fake = type(sys)("fake")
    sample = Sample(tokens=[1, 2, 3], logprobs=torch.zeros(3), entropies=torch.zeros(3), finished=True)
    fake.generate = lambda model, prompts, n=1, **kw: [[sample] * k for k in (n if isinstance(n, list) else [n] * len(prompts))]
    calls.wrap(fake)
    out = fake.generate(None, [[1] * 5, [1] * 9, [1] * 40], n=[2, 1, 0])
    assert [len(g) for g in out] == [2, 1, 0]
    line = capsys.readouterr().out
    assert "3 rows" in line and "2 prompts, longest    9, mean     7" in line and "9 generated" in line


def test_sampling_calls_times_the_new_prompts_prefill_both_ways(tiny_model_dir):
    """--prefill-layouts: a call with prompts partly in prompt_kv gets its new prompts' prefill timed in their own
    layout (their longer common start) and in all the call's prompts' layout; other calls get nothing."""
    from common.model import Transformer
    calls = load("sampling_calls")
    model = Transformer.from_pretrained(tiny_model_dir).eval()
    head, task = list(range(10, 16)), list(range(40, 49))
    plain, icl = [head + [1, 2, 3], head + [4, 5]], [head + task + [7, 8], head + task + [9]]
    kv = {tuple(p): None for p in plain}
    k, own, common, best = calls.prefill_layouts(model, plain + icl, [2, 1, 3, 2], kv)
    assert (k, own, common) == (2, len(head) + len(task), len(head)) and best["own"] > 0 and best["all"] > 0
    assert calls.prefill_layouts(model, plain + icl, [2, 1, 0, 0], kv) is None  # nothing new with samples
    assert calls.prefill_layouts(model, icl, [1, 1], kv) is None  # all new: one ordinary prefill


@pytest.mark.parametrize("argv, says", [
    (["sampler.py", "--reps", "0"], "--reps"), (["sampler.py", "--batches", "1,0"], "batch size"),
    (["kernels.py", "-V", "-5"], "-V"), (["decode_gemm.py", "--rows", "8,-4"], "--rows"),
    (["default_run.py", "--run", "x", "--held-out", "-3"], "--held-out"),
    (["task_rates.py", "--temperature", "0"], "--temperature"),
    (["sampling_calls.py", "grpo", "--", "--steps", "0"], "--steps"),
])
def test_bench_tools_refuse_bad_numbers_before_any_work(argv, says):
    """A bench tool given an impossible number stops at once with exit 2 and says which (before: a traceback from
    min() of nothing or a negative shape, or a table of zeros)."""
    import subprocess
    r = subprocess.run([sys.executable, str(REPO / "bench" / argv[0]), *argv[1:]], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and says in r.stderr.strip().splitlines()[-1] and "Traceback" not in r.stderr, r.stderr
