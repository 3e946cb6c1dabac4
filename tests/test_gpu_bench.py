"""bench/gpu.py, the one-GPU benchmark, at tiny shapes on the CPU: every part runs and reports numbers, so the script
that waits for a GPU cannot rot; and its time caps skip or stop a part without losing the others' results."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import gpu

REPO = Path(__file__).resolve().parents[1]


def test_cpu_tiny_run_reports_every_part(tmp_path):
    out = tmp_path / "tiny"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), "--cpu-tiny", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert sum(line.startswith("[bench/gpu.py] part ") for line in r.stdout.splitlines()) == 5  # one line per part
    results = json.loads((out / "results.json").read_text())
    parts = results["parts"]
    assert list(parts) == ["ceilings", "sampler", "train", "kernels", "suite"]
    assert all(p["status"] == "ok" for p in parts.values()), {k: p.get("error") for k, p in parts.items()}
    assert parts["ceilings"]["copy_bytes_per_s"] > 0 and parts["ceilings"]["matmul_flops_per_s"] > 0

    sampler = parts["sampler"]["rows"]
    variants = {(b, v) for b in (4, 1, 2) for v in ("ours eager", "transformers")}
    assert {(r["batch"], r["variant"]) for r in sampler} == variants
    assert all(r["tokens_per_s"] > 0 and 0 < r["roofline_fraction"] <= 1 for r in sampler)
    assert all(r["vs_transformers"] > 0 for r in sampler if r["variant"] == "ours eager")
    skipped = {s["what"]: s["why"] for s in parts["sampler"]["skipped"]}
    assert skipped["ours CUDA graphs"].startswith(gpu.CPU_SKIP)

    train = parts["train"]["rows"]
    assert [(r["model"], r["checkpointing"]) for r in train] == [("0.5b", False), ("0.5b", True), ("1.5b", True),
                                                                 ("1.5b", False)]
    for row in train:  # an MFU above 1 would mean the FLOPs or the rate are miscounted
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] <= 1 and row["optimizer_step_s"] > 0
        assert row["peak_rss_bytes"] > 0 and row["peak_gpu_bytes"] == gpu.CPU_SKIP

    ops = [r["op"] for r in parts["kernels"]["rows"]]
    assert ops == ["logprobs_entropy fwd", "policy_loss fwd+bwd", "policy_loss fwd+bwd"]
    assert all(r["ours_ms"] > 0 and r["eager_ms"] > 0 for r in parts["kernels"]["rows"])
    assert parts["kernels"]["skipped"][0]["why"].startswith(gpu.CPU_SKIP)
    (suite,) = parts["suite"]["rows"]
    assert suite["rc"] == 0 and "1 passed" in suite["summary"]

    md = (out / "results.md").read_text()
    assert "| device | torch | Triton | transformers | date | commit | wall s |" in md
    assert f"| {results['meta']['device']} | {results['meta']['torch']} | " in md
    assert "## Goals (issue 39)" in md and "| 1.5b | True | 198 |" in md
    # where the time goes, from the same run: the eager sampler at the largest batch, a 1.5b micro-batch
    assert list(parts["sampler"]["profiles"]) == ["ours eager, B=4, 16 new tokens"]
    assert list(parts["train"]["profiles"]) == ["1.5b checkpointing=True, one micro-batch",
                                                "1.5b checkpointing=False, one micro-batch"]
    assert md.count("<details><summary>profile: ") == 3 and "aten::mm" in md
    assert sorted(f.name for f in out.iterdir()) == ["log.txt", "results.json", "results.md"]  # parts merged


def test_a_part_skips_what_no_longer_fits(tmp_path):
    """On a GPU a measurement that would run past the part's cap is skipped with a note (fails if fits ignores time)."""
    part = gpu.Part("sampler", tmp_path, time.time() + 20, tiny=False)
    assert not part.fits("ours CUDA graphs B=1", "graphs first")  # needs ~90 s
    assert part.fits("ours eager B=1", "eager")  # needs ~10 s
    (skip,) = json.loads((tmp_path / ".part-sampler.json").read_text())["skipped"]
    assert skip["what"] == "ours CUDA graphs B=1" and skip["why"].startswith("time cap: ")


def test_a_failed_measurement_is_recorded_and_the_part_goes_on(tmp_path):
    """An exception in one measurement (a compile error, an out-of-memory) becomes a note, not the part's end."""
    part = gpu.Part("train", tmp_path, time.time() + 60, tiny=True)
    with part.attempt("train 1.5b") as failed:
        raise RuntimeError("boom\nsecond line")
    part.row(model="0.5b")
    assert failed == ["RuntimeError"]
    saved = json.loads((tmp_path / ".part-train.json").read_text())
    assert saved["skipped"] == [{"what": "train 1.5b", "why": "error: RuntimeError: boom"}]
    assert saved["rows"] == [{"model": "0.5b"}]


def test_a_part_stopped_or_crashed_keeps_its_rows(tmp_path):
    """A part killed at its cap (or dead of a crash) keeps the rows it saved, with a status that says so; the kill
    reaches the whole process group (fails if run_capped waits for the child)."""
    part = gpu.Part("train", tmp_path, time.time() + 60, tiny=True)
    part.row(model="0.5b", tokens_per_s=1.0)
    start = time.time()
    rc, output = gpu.run_capped([sys.executable, "-c", "import time; time.sleep(60)"], 1, capture=True)
    assert rc is None and "time cap" in output and time.time() - start < 30
    stopped = gpu.collect(tmp_path, "train", rc)
    assert stopped["status"] == "stopped at its time cap"
    assert stopped["rows"] == [{"model": "0.5b", "tokens_per_s": 1.0}]
    assert gpu.collect(tmp_path, "train", -11)["status"].startswith("crashed (exit code -11")
    assert gpu.collect(tmp_path, "kernels", 1)["rows"] == []  # nothing saved at all: an empty part, not an exception


def test_goals_are_read_off_the_rows():
    parts = {"sampler": {"rows": [
        dict(batch=256, variant="ours CUDA graphs", tokens_per_s=9e4, vs_transformers=6.0, roofline_fraction=0.4),
        dict(batch=256, variant="ours eager", tokens_per_s=5e4, vs_transformers=3.0, roofline_fraction=0.2),
        dict(batch=1, variant="ours CUDA graphs", tokens_per_s=2e3, roofline_fraction=0.65)]},
        "train": {"rows": [dict(model="1.5b", mfu=0.35), dict(model="1.5b", mfu=None), dict(model="0.5b", mfu=0.5)]}}
    lines = gpu.goals(parts)
    assert "largest batch, ours (ours CUDA graphs) >= 5x transformers: 6, met" in lines[0]
    assert lines[1].endswith("0.4, missed") and lines[2].endswith("0.65, met") and lines[3].endswith("0.35, missed")
    assert lines[4].endswith("not measured") and lines[5].endswith("not run")


def test_flop_and_byte_counts_by_hand():
    """The MFU's FLOPs and the roofline's bytes at the tiny 0.5b shapes (2 layers, d 64, 4 heads of 16, 2 kv heads,
    MLP 128, vocabulary 512), counted by hand. Fails if attention's backward (x3), the LM head only at the loss tokens,
    the packed mask's keys or the KV cache's growth per step are miscounted."""
    cfg = gpu.model_config("0.5b", tiny=True)
    assert gpu.matmul_params(cfg) == (2 * (64 * 16 * (4 + 4 + 2 + 2) + 3 * 64 * 128), 512 * 64)
    # 2 rows, each 15 prompt tokens + 4 segments of 21 (the last prompt token, then 20 completion tokens):
    # keys seen per row: 1 + ... + 15 in the prompt, then 15 + j at the j-th token of each segment
    keys = 2 * (sum(range(1, 16)) + 4 * sum(15 + j for j in range(1, 22)))
    flops = 6 * 73728 * 198 + 6 * 32768 * 160 + 3 * 4 * 2 * 4 * 16 * keys
    assert gpu.train_flops(cfg, gpu.train_batch(cfg, gpu.SHAPES["cpu-tiny"])) == (flops, 198, 160)
    # bandwidth-bound (1 byte/s, infinite FLOP/s), batch 2, prompt 8, 4 new tokens: the prefill reads the 1000 weight
    # bytes once, each step reads them again plus k and v of 8, 9, 10, 11 tokens (2 layers x 2 kv heads x 16 x 2 bytes)
    kv = 2 * 2 * 2 * 16 * 2 * 2
    steps = 4 * 1000 + kv * (8 + 9 + 10 + 11)
    assert gpu.generate_floor(cfg, 1000, 2, 8, 4, 1.0, float("inf"), 2) == (1000 + steps, steps / 4)


def test_without_transformers_the_sampler_part_says_so(tmp_path, monkeypatch):
    """The GPU machine may lack transformers: its comparison is skipped with a line saying why, ours still measured
    (fails if the missing import ends the part)."""
    import torch

    monkeypatch.setitem(sys.modules, "transformers", None)  # `from transformers import ...` raises ImportError
    part = gpu.Part("sampler", tmp_path, time.time() + 120, tiny=True)
    gpu.part_sampler(part, torch.device("cpu"), dict(gpu.SHAPES["cpu-tiny"], sampler_batches=[2], new=4))
    assert [(r["batch"], r["variant"]) for r in part.data["rows"]] == [(2, "ours eager")]
    assert part.data["skipped"][0]["what"] == "transformers generate"
    assert part.data["skipped"][0]["why"].startswith("transformers is not installed here")
    md = gpu.markdown({"meta": dict(mode="cpu-tiny", device="cpu", torch="t", triton="t", transformers="-", date="d",
                                    commit="c"), "parts": {"sampler": dict(part.data, elapsed_s=1.0)}})
    assert "- skipped transformers generate: transformers is not installed here" in md


def test_decode_attention_cpu_tiny(capsys):
    """bench/decode_attention.py at tiny shapes: a row per case, and on a CPU the setting changes nothing (the
    sampler leaves PyTorch's attention choice alone there), so every sample's tokens agree."""
    from bench import decode_attention
    decode_attention.main(["--cpu-tiny"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [r[0].strip() for r in rows] == [c[0] for c in decode_attention.CASES]
    for r in rows:
        same, total = r[-1].strip().split("/")
        assert same == total
