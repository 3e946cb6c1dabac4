"""torch.distributed in the few lines the algorithm files need. Plain `python x.py` is world size 1.

    torchrun --nproc_per_node=8 grpo.py ...      # data parallel: each rank samples and trains its prompts

Which rank does what: every rank generates rollouts for its own prompts (whole groups stay on one rank, so
group advantages need no communication), gradients are averaged by DDP (or sharded by FSDP2), metrics are
reduced, rank 0 alone writes metrics and checkpoints.
"""
import os

import torch
import torch.distributed as td


def is_distributed() -> bool:
    return td.is_available() and td.is_initialized()


def rank() -> int:
    return td.get_rank() if is_distributed() else 0


def world() -> int:
    return td.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    return rank() == 0


def setup(device: str = "auto") -> torch.device:
    """Join the process group when started by torchrun; return this rank's device."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if "RANK" in os.environ and not is_distributed():
        td.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device(device)


def cleanup():
    if is_distributed():
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


def reduce_metrics(metrics: dict, sums=()) -> dict:
    """Average metrics over ranks (values in `sums` are added instead; max_* are maxed)."""
    if not is_distributed():
        return metrics
    keys = sorted(metrics)
    vals = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    maxed = torch.tensor([float(metrics[k]) if "max" in k else float("-inf") for k in keys], dtype=torch.float64)
    td.all_reduce(vals)
    td.all_reduce(maxed, op=td.ReduceOp.MAX)
    out = {}
    for i, k in enumerate(keys):
        out[k] = maxed[i].item() if "max" in k else vals[i].item() / (1 if k in sums else world())
    return out


def barrier():
    if is_distributed():
        td.barrier()
