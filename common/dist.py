"""torch.distributed in the few lines the algorithm files need. Plain `python x.py` is world size 1.

    torchrun --nproc_per_node=8 grpo.py ...      # data parallel: each rank samples and trains its prompts

Which rank does what: every rank generates rollouts for its own prompts (whole groups stay on one rank, so
group advantages need no communication), gradients are averaged by DDP (or sharded by FSDP2), metrics are
reduced, rank 0 alone writes metrics and checkpoints.
"""
import math
import os
from contextlib import contextmanager

import torch
import torch.distributed as td

from common.errors import RunError


def is_distributed() -> bool:
    return td.is_available() and td.is_initialized()


def rank() -> int:
    return td.get_rank() if is_distributed() else 0


def world() -> int:
    return td.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    return rank() == 0


def resolve_device(device: str = "auto") -> str:
    """auto -> cuda when a GPU is there, else cpu; cpu and cuda as they are."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def setup(device: str = "auto") -> torch.device:
    """Join the process group when started by torchrun; return this rank's device."""
    device = resolve_device(device)
    if "RANK" in os.environ and not is_distributed():
        # on GPUs NCCL carries the CUDA tensors (gradients, weights) and gloo the CPU ones (loss normalisers,
        # metrics): NCCL alone refuses CPU tensors
        td.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        if local >= torch.cuda.device_count():
            raise RunError(f"--device cuda: this process is local rank {local}, but the machine has "
                           f"{torch.cuda.device_count()} GPU(s); start at most that many per node (or --device cpu)")
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device(device)


def cleanup():
    """Leave the process group at the end of a run. The barrier first: a gloo worker thread drops its last
    reference to a finished collective's tensors a moment after the caller sees it finish, and that needs the
    GIL; if this process were already shutting Python down by then, the thread would abort it (SIGABRT, or a
    segfault, at exit: 4 of 130 two-rank runs of test_dist.py's DDP + FSDP2 step on a 2-core CPU, the last
    rank to finish saving nothing and exiting at once). The barrier holds every rank until all are done,
    which gives those threads the time: 0 of 250 runs with it."""
    if is_distributed():
        td.barrier()
        td.destroy_process_group()


def shard(items: list) -> list:
    """This rank's contiguous share of a list whose length the world size divides."""
    per = len(items) // world()
    return items[rank() * per:(rank() + 1) * per]


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        x = x.clone()
        td.all_reduce(x)
    return x


def all_gather_list(items: list) -> list:
    """Every rank's list, concatenated in rank order; the list itself in one process."""
    if not is_distributed():
        return items
    parts = [None] * world()
    td.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def reduce_metrics(metrics: dict, sums=(), maxes=(), weights=None) -> dict:
    """Combine per-rank metrics: those named in `sums` are added (totals, throughput), those in `maxes` are
    maxed, the rest averaged over ranks, each rank weighted by `weights`: {key or "prefix/": this rank's count}
    (the longest match; 1 where none), so that a mean over completions or tokens is the whole batch's mean and not a
    mean of per-rank means where ranks hold different counts. A metric only some ranks log or measure (one over
    tokens a rank may not have: absent, or NaN) is combined over those ranks; every rank then logs the same keys (a
    collective over differing keys would hang)."""
    if not is_distributed():
        return metrics
    keys = sorted(set(all_gather_list(list(metrics))))
    has = {k: k in metrics and math.isfinite(float(metrics[k])) for k in keys}
    # a sum or a max takes weight 1, so a total weight of 0 always means: no rank measured it (of weight > 0)
    weight = {k: (1.0 if k in sums or k in maxes else float(_weight(k, weights or {}))) * has[k] for k in keys}
    total_weight = torch.tensor([weight[k] for k in keys], dtype=torch.float64)
    vals = torch.tensor([float(metrics[k]) * weight[k] if has[k] else 0.0 for k in keys], dtype=torch.float64)
    maxed = torch.tensor([float(metrics[k]) if k in maxes and has[k] else float("-inf") for k in keys],
                         dtype=torch.float64)
    td.all_reduce(total_weight)
    td.all_reduce(vals)
    td.all_reduce(maxed, op=td.ReduceOp.MAX)
    out = {}
    for i, k in enumerate(keys):
        if total_weight[i].item() == 0:
            out[k] = math.nan
        else:
            out[k] = maxed[i].item() if k in maxes else vals[i].item() / (1 if k in sums else total_weight[i].item())
    return out


def _weight(key: str, weights: dict) -> float:
    """The weight of the longest entry of `weights` that is `key` or a prefix of it ending in "/"; 1 if none."""
    match = max((w for w in weights if w == key or w.endswith("/") and key.startswith(w)), key=len, default=None)
    return 1.0 if match is None else weights[match]


def barrier():
    if is_distributed():
        td.barrier()


# ------------------------------------------------------------------------- DDP or FSDP2, and rollouts

def wrap(model, fsdp: bool = False):
    """The module to train through: the model itself (one process), DDP (replicated), or the model sharded
    in place with FSDP2 (each block, then the rest) for models whose Adam state does not fit one device."""
    if not is_distributed():
        return model
    if fsdp:
        # imported here: FSDP2 only, and they take seconds to import
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        # the mesh on the model's own device type: left to itself FSDP2 picks CUDA whenever a GPU is visible,
        # even for a CPU (gloo) run
        mesh = init_device_mesh(next(model.parameters()).device.type, (world(),))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    # gradient_as_bucket_view: the gradients are views of DDP's all-reduce buckets instead of a second copy of them
    return torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)


def zero_grad(optimizer, model):
    """optimizer.zero_grad(), freeing the gradients' memory where that frees any. Under DDP the gradients are
    views of its buckets, which live as long as the model: dropping the views frees nothing, and the next
    backward outside DDP's sync (the first micro-batches of gradient accumulation) would allocate a whole second
    set of gradients (0.5 GB for 135M parameters), so there they are zeroed in place instead."""
    optimizer.zero_grad(set_to_none=not is_distributed() or is_sharded(model))


def is_sharded(model) -> bool:
    return type(model).__name__.startswith("FSDP")


def full_state_dict(model) -> dict:
    """Every parameter whole, on every rank (a collective under FSDP2)."""
    if not is_sharded(model):
        return model.state_dict()
    # imported here: FSDP2 only, and it takes seconds to import
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def sync_rollout(model, rollout):
    """Copy the trained weights into the whole copy that samples rollouts (under FSDP2; see grpo.py)."""
    if rollout is not model:
        rollout.load_state_dict(full_state_dict(model))


def optimizer_state(model, optimizer) -> dict:
    """The optimizer's state as one whole dict (gathered under FSDP2; only rank 0's copy is complete)."""
    if not is_sharded(model):
        return optimizer.state_dict()
    # imported here: FSDP2 only, and it takes seconds to import
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model, optimizer, state: dict):
    """A checkpoint's optimizer state (moments, step counts) into `optimizer`, whose hyper-parameters (learning
    rate, betas, weight decay: this run's command line) stay as they are, as the run's saved config records them."""
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    if not is_sharded(model):
        optimizer.load_state_dict(state)
    else:
        # imported here: FSDP2 only, and it takes seconds to import
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
    for group, h in zip(optimizer.param_groups, hyper):
        group.update(h)


@contextmanager
def accumulate(policy, skip_sync: bool):
    """Gradient accumulation: with skip_sync, this micro-batch's backward adds to local gradients without
    the all-reduce (DDP no_sync / FSDP2 set_requires_gradient_sync); the last micro-batch syncs everything."""
    if not (skip_sync and is_distributed()):
        yield
    elif is_sharded(policy):
        policy.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            policy.set_requires_gradient_sync(True)
    else:
        with policy.no_sync():
            yield


def local(t):
    """A plain tensor from a possibly sharded (DTensor) one, e.g. the gradient norm under FSDP2."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
