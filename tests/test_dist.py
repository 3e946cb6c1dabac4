"""Data-parallel training on CPU with the gloo backend: 2 processes compute the update of 1 process on the
same global batch, through common/dist.py (DDP and FSDP2) and through grpo.py; and grpo.py under torchrun.

What is compared, and how closely. Splitting a batch over ranks changes the order of the float32 sums
(per-rank partial sums, then the all-reduce), and so does the CPU (its vector width decides how matmuls and
reductions are blocked). Reordering a sum of n terms moves it by at most about n·u·Σ|terms| (u = 2^-24).
So we compare the all-reduced gradients, before any optimizer step, with one process's gradients, to within
GRAD_RTOL of each tensor's largest |gradient|: far above rounding, far below a real error. Weights are
compared after a plain SGD step, whose difference is lr times the gradients' plus the rounding of w.
Not after AdamW: its first update lr·g/(|g| + eps) normalises each element, so where a gradient is near zero
a rounding-sized difference in g becomes a visible one in the weight (1.45e-6 at lr 1e-3, in an earlier
version of this test), while a gradient scaled by 2 gives the same step: the earlier test failed by that
same 1.45e-6 with and without a forgotten world-size factor.
"""
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
# Largest gradient difference allowed, as a share of the tensor's largest |gradient|. Measured on an AVX2
# CPU: at most 1.2e-7 (every tensor, both tests, DDP and FSDP2), i.e. rounding; CPUs with other vector widths
# block the same sums differently, within a small multiple of that. Real errors measured (each made on purpose
# once): a forgotten world-size factor 0.5, token totals of one rank instead of all 1.15, every rank training
# on the same share 1.94, gradients not all-reduced 1.0.
GRAD_RTOL = 1e-4
U = 2.0 ** -24  # fp32 unit roundoff
LR = 0.1  # SGD step of the dist test: large, so that the update is far above the rounding of the weights


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank, world, port):
    """This process becomes rank `rank` of `world` at the next dist.setup(), as under torchrun."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def assert_grads_close(two: dict, one: dict):
    assert two.keys() == one.keys()
    for k in one:
        scale = one[k].abs().max().item()
        err = (two[k] - one[k]).abs().max().item()
        assert err <= GRAD_RTOL * scale, f"{k}: gradients differ by {err:.3g} = {err / scale:.3g} of the largest"


# ------------------------------------------------------------- common/dist.py: a plain data-parallel step

def global_batch(n=8, length=12, vocab=256):
    """n token sequences with a loss on their last 1..length-1 tokens (the 'completion') and one advantage
    each: a trainer's batch, the same in every process."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (n, length), generator=g)
    n_loss = torch.randint(1, length, (n,), generator=g)  # [n] loss tokens per sequence, 1..length-1
    loss_mask = torch.arange(length - 1) >= (length - 1 - n_loss)[:, None]  # [n, length-1] on the last n_loss
    advantages = torch.randn(n, generator=g)
    return list(zip(ids, loss_mask, advantages))


def dp_step(fsdp: bool) -> dict:
    """One training step the way the algorithm files take it, through common/dist.py: this rank's share of
    the batch, the token-mean loss normalised by the global token count, micro-batches accumulated without
    sync until the last, then an SGD step. Returns the whole gradients, their norm and the new weights."""
    from common import dist
    from common.model import ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64,
                                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True))
    policy = dist.wrap(model, fsdp=fsdp)
    mine = dist.shard(global_batch())
    n_tokens = dist.all_reduce_sum(torch.tensor(float(sum(m.sum() for _, m, _ in mine)))).item()
    micro = [mine[i:i + 2] for i in range(0, len(mine), 2)]
    for j, mb in enumerate(micro):
        ids, loss_mask, adv = (torch.stack(x) for x in zip(*mb))
        with dist.accumulate(policy, skip_sync=j < len(micro) - 1):
            logp = torch.log_softmax(policy(ids[:, :-1]).float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
            loss = -(adv[:, None] * logp * loss_mask).sum() / n_tokens  # token-mean over the global batch
            (loss * dist.world()).backward()  # DDP and FSDP2 average gradients over ranks: undo the 1/world
    params = dict(model.named_parameters(remove_duplicate=False))  # the tied lm_head too, as in the weights
    grads = {k: dist.local(p.grad).clone() for k, p in params.items()}
    norm = dist.local(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))).item()
    with torch.no_grad():  # plain SGD (torch.optim would import torch._dynamo: seconds per process)
        for p in model.parameters():
            p -= LR * p.grad
    return {"grads": grads, "norm": norm, "weights": dist.full_state_dict(model)}


def dp_ranks(rank, world, port, out):
    join(rank, world, port)
    torch.set_num_threads(1)
    from common import dist

    dist.setup("cpu")
    results = {"ddp": dp_step(fsdp=False), "fsdp2": dp_step(fsdp=True)}  # one process group, two models
    if dist.is_main():
        torch.save(results, out)
    dist.cleanup()


@pytest.fixture(scope="module")
def dp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "two.pt"
    mp.spawn(dp_ranks, args=(2, free_port(), out), nprocs=2, join=True)
    return dp_step(fsdp=False), torch.load(out)  # one process (this one, not distributed), two processes


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_processes_equal_one(dp_results, mode):
    one, two = dp_results[0], dp_results[1][mode]
    assert_grads_close(two["grads"], one["grads"])
    assert one["norm"] > 0 and abs(two["norm"] - one["norm"]) <= GRAD_RTOL * one["norm"]
    assert two["weights"].keys() == one["weights"].keys() == one["grads"].keys()
    for k, w in one["weights"].items():
        grad_tol = GRAD_RTOL * one["grads"][k].abs().max().item()  # |w' - w''| <= lr |g' - g''| + rounding of w
        torch.testing.assert_close(two["weights"][k], w, rtol=4 * U, atol=LR * grad_tol)
    assert min(g.abs().max() for g in one["grads"].values()) * LR > 1e3 * U  # each step far above rounding


# ------------------------------------------------------------------------------------------- grpo.py

def fixed_generate(model, prompts, n=1, max_new_tokens=8, **kw):
    """Stand-in for the sampler: completions that depend only on the prompt (no sampling noise), so that
    any split of the prompts over ranks sees the same rollouts."""
    from common.sampler import Sample

    out = []
    for p in prompts:
        ns = n if isinstance(n, int) else n[len(out)]
        group = []
        for j in range(ns):
            length = 2 + (sum(p) + j) % 4
            toks = [3 + (sum(p) * 31 + j * 17 + t * 7) % 900 for t in range(length)]
            group.append(Sample(toks, torch.zeros(length), torch.zeros(length), True))
        out.append(group)
    return out


def grpo_ranks(rank, world, port, ports, argv, out_dir):
    """grpo.main(argv) with fixed rollouts and rewards: on rank 0 first as one plain process, then on both
    ranks under DDP and under FSDP2. Rank 0 saves, per run, the gradients each optimizer step receives (after all
    micro-batches and the all-reduce), in the optimizer's parameter order. Two steps: the second shows that the
    first one's gradients were cleared (under DDP they are zeroed in place, see dist.zero_grad)."""
    torch.set_num_threads(1)
    os.chdir(out_dir)
    import common.sampler
    import common.verifier

    # patched before grpo (and common.evaluate) import them, whatever names they import them under
    common.sampler.generate = fixed_generate
    common.verifier.score = lambda text, answer: float(len(text) % 3 == 0)  # mixed, deterministic rewards
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    import common.optim
    from common import dist

    grads = {}

    def record(optimizer, args=(), kwargs=None):
        grads[run].append([dist.local(p.grad).clone() for group in optimizer.param_groups for p in group["params"]])

    register_optimizer_step_pre_hook(record)  # torch.optim.AdamW: FSDP2's optimizer
    ours = common.optim.AdamW.step  # one process and DDP

    def recorded_step(optimizer):
        record(optimizer)
        return ours(optimizer)

    common.optim.AdamW.step = recorded_step
    import grpo

    runs = [("one", [])] if rank == 0 else []
    runs += [("ddp", []), ("fsdp2", ["--fsdp"])]
    for run, extra in runs:
        if run != "one":
            join(rank, world, ports[run])  # a fresh port for each process group
        grads[run] = []
        grpo.main(argv + ["--run-name", run] + extra)
    if rank == 0:
        torch.save(grads, Path("runs") / "grads.pt")


@pytest.fixture(scope="module")
def grpo_results(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("grpo")
    # no clipping: a clipped gradient has norm 1 whatever its scale, which would hide a wrong normalisation
    argv = ["--model", str(tiny_model_dir), "--steps", "2", "--prompts-per-step", "4", "--group-size", "3",
            "--micro-batch", "2", "--eval-size", "2", "--dtype", "float32", "--train-size", "40",
            "--max-grad-norm", "1e9", "--device", "cpu"]  # gloo on CPU, also where a GPU is visible
    ports = {"ddp": free_port(), "fsdp2": free_port()}
    mp.spawn(grpo_ranks, args=(2, 0, ports, argv, tmp), nprocs=2, join=True)
    return tmp, torch.load(tmp / "runs/grads.pt")


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_grpo_two_processes_equal_one(grpo_results, mode):
    tmp, grads = grpo_results
    assert len(grads["one"]) == len(grads[mode]) == 2  # one optimizer step per training step
    for one, two in zip(grads["one"], grads[mode]):
        assert one and len(two) == len(one) and all(g.abs().max() > 0 for g in one)
        assert_grads_close(dict(enumerate(two)), dict(enumerate(one)))
    rows = [json.loads(line) for line in (tmp / "runs" / mode / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]  # each step logged once (by rank 0)
    assert (tmp / "runs" / mode / "checkpoint" / "model.safetensors").is_file()


def test_torchrun_two_steps(tmp_path, tiny_model_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port()),
           str(REPO / "grpo.py"), "--model", str(tiny_model_dir), "--steps", "2", "--run-name", "tr",
           "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "6", "--eval-size", "3",
           "--train-size", "50", "--micro-batch", "2", "--device", "cpu"]  # two ranks: gloo, even beside one GPU
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs/tr/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]  # each step once, from rank 0 alone
    assert [r["step"] for r in rows if "eval/greedy_acc" in r] == [0, 2]
    assert r.stdout.count("done: greedy accuracy") == 1


def test_more_ranks_than_gpus_is_one_line_error(monkeypatch):
    """torchrun --nproc_per_node=2 on a one-GPU machine: a RunError naming the cause, not CUDA's traceback."""
    from common import dist as common_dist
    from common.config import RunError

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RunError, match="local rank 1, but the machine has 1 GPU"):
        common_dist.setup("cuda")


def test_gpu_ranks_reduce_cpu_tensors_too(monkeypatch):
    """Under torchrun on GPUs the process group has gloo beside NCCL: the loss normalisers and the metrics are CPU
    tensors, which NCCL alone refuses (the first all_reduce of a multi-GPU run would fail)."""
    from common import dist as common_dist

    backends = []
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(common_dist, "is_distributed", lambda: False)
    monkeypatch.setattr(common_dist.td, "init_process_group", lambda backend: backends.append(backend))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    common_dist.setup("cuda")
    common_dist.setup("cpu")
    assert backends == ["cpu:gloo,cuda:nccl", "gloo"]


def gather_ranks(rank, world, port, out):
    join(rank, world, port)
    from common import dist as common_dist

    common_dist.setup("cpu")
    gathered = common_dist.all_gather_list([rank * 10 + i for i in range(rank + 1)])  # ranks hold different lengths
    # rank 0 logs "only0" (say, a mean over tokens rank 1 did not have), rank 1 "only1"
    # "policy/" means are weighted by the rank's tokens (3 and 1), but for "policy/n"; "w/zero" weighs rank 0 by 0
    metrics = [{"mean": 1.0, "max": 5.0, "sum": 2.0, "only0": 4.0, "nan1": 6.0, "nan_all": math.nan,
                "policy/ent": 1.0, "policy/n": 1.0, "w/zero": 100.0},
               {"mean": 3.0, "max": 7.0, "sum": 3.0, "only1": 1.0, "nan1": math.nan, "nan_all": math.nan,
                "policy/ent": 3.0, "policy/n": 3.0, "w/zero": 4.0}]
    weights = {"policy/": [3, 1][rank], "policy/n": 1, "w/": [0, 2][rank], "sum": 5, "max": 5}
    reduced = common_dist.reduce_metrics(metrics[rank], sums=("sum", "only1"), maxes=("max",), weights=weights)
    torch.save((gathered, reduced), out / f"gathered{rank}.pt")
    common_dist.cleanup()


def test_all_gather_list_and_metrics_over_ranks(tmp_path):
    """all_gather_list: each rank sees every rank's items, rank 0's first (XRPO's allocation statistics over the
    whole batch). reduce_metrics: averaged (weighted by each rank's count where given: a mean over the whole
    batch's tokens, not of per-rank means), summed or maxed, and a key only some ranks log (or log NaN: not
    measured there) is combined over those ranks, every rank ending with the same keys (before, differing keys made
    the all_reduce hang or fail, and one rank's NaN made the whole metric NaN)."""
    mp.spawn(gather_ranks, args=(2, free_port(), tmp_path), nprocs=2, join=True)
    expected = {"mean": 2.0, "max": 7.0, "sum": 5.0, "only0": 4.0, "only1": 1.0, "nan1": 6.0,  # NaN: not measured
                "policy/ent": 1.5, "policy/n": 2.0, "w/zero": 4.0}  # weighted: (3·1 + 1·3) / 4; (0·100 + 2·4) / 2
    for r in range(2):
        gathered, reduced = torch.load(tmp_path / f"gathered{r}.pt")
        assert gathered == [0, 10, 11] and math.isnan(reduced.pop("nan_all")) and reduced == expected, reduced


def test_cleanup_waits_for_every_rank_before_leaving(monkeypatch):
    """dist.cleanup() passes a barrier before it destroys the process group. Without it, a rank with nothing
    left to do began shutting Python down while a gloo worker thread was still releasing a finished
    collective's tensors, and died of SIGABRT or SIGSEGV at exit (the two-process tests above, now and then).
    That race cannot be provoked on demand, so this pins the order of the two calls."""
    from common import dist as common_dist

    calls = []
    monkeypatch.setattr(common_dist, "is_distributed", lambda: True)
    monkeypatch.setattr(common_dist.td, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(common_dist.td, "destroy_process_group", lambda *a, **k: calls.append("destroy"))
    common_dist.cleanup()
    assert calls == ["barrier", "destroy"]
