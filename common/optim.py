"""AdamW (Loshchilov & Hutter, arXiv 1711.05101, Algorithm 2) for the trainer, without torch.optim:

    optimizer = adamw(model.parameters(), lr=3e-5, betas=(0.9, 0.99), weight_decay=0.0, sharded=False)
    for group in optimizer.param_groups:
        group["lr"] = lr                      # the schedule is the caller's (lr_factor in each algorithm file)
    optimizer.step(); optimizer.zero_grad(set_to_none=True)
    optimizer.state_dict(); optimizer.load_state_dict(saved)   # torch.optim.AdamW's layout, either way

`AdamW.step` runs the fused kernel that torch.optim.AdamW(fused=True) runs (torch._fused_adamw_), on the same state,
so the weights after a step are torch's bit for bit (tests/test_optim.py). Why not torch.optim itself: its first
optimizer imports torch._dynamo, and that imports triton where it is installed, ~0.15 x 10^9 bytes of resident memory
that a CPU run never uses and that a step's peak would carry (docs/benchmarks.md). Under FSDP2 the weights are sharded
DTensors and the checkpoint helpers need a torch.optim.Optimizer: `adamw` gives torch.optim.AdamW there.
`adamw_reference` is the same update written out in plain PyTorch, tested equal to the kernel.
"""
import math

import torch


def adamw_reference(param, grad, exp_avg, exp_avg_sq, step: int, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float):
    """One AdamW update of one tensor, in place: decoupled weight decay, then Adam's step with bias-corrected
    moments. step is the 1-based count of updates, this one included."""
    param.mul_(1 - lr * weight_decay)  # decoupled: the decay does not pass through the moments
    exp_avg.lerp_(grad, 1 - beta1)  # m = β1 m + (1 - β1) g
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  # v = β2 v + (1 - β2) g²
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)  # sqrt(v̂) + ε
    param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))  # θ -= lr m̂ / (sqrt(v̂) + ε)


class AdamW:
    """AdamW over one group of parameters; each parameter's state (step, exp_avg, exp_avg_sq) is made at its first
    update, as torch.optim's is. Parameters without a gradient are left alone."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        params = list(params)
        if not params:
            raise ValueError("AdamW: an empty parameter list")
        self.param_groups = [{"params": params, "lr": lr, "betas": tuple(betas), "eps": eps,
                              "weight_decay": weight_decay}]
        self.state = {}  # parameter -> its state

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            by_kind = {}  # the kernel takes tensors of one device and dtype per call
            for p in group["params"]:
                if p.grad is not None:
                    by_kind.setdefault((p.device, p.dtype), []).append(p)
            for params in by_kind.values():
                states = [self._state(p) for p in params]
                steps = [s["step"] for s in states]
                torch._foreach_add_(steps, 1)
                torch._fused_adamw_(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                                    [s["exp_avg_sq"] for s in states], [], steps, lr=group["lr"], beta1=beta1,
                                    beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                                    maximize=False, grad_scale=None, found_inf=None)

    def _state(self, p):
        if p not in self.state:  # the step count is a float32 tensor beside the weight, as the kernel wants it
            self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                             "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        return self.state[p]

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True):
        """Drop the gradients, or zero them in place (DDP's gradients are views of its buckets: common.dist)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def state_dict(self) -> dict:
        """torch.optim's layout: each parameter by its index in the group, the hyper-parameters beside the indices."""
        params = self.param_groups[0]["params"]
        return {"state": {i: self.state[p] for i, p in enumerate(params) if p in self.state},
                "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(params)))}
                                 for g in self.param_groups]}

    def load_state_dict(self, saved: dict):
        """A state from state_dict, ours or torch.optim.AdamW's (a checkpoint written before this class)."""
        params = self.param_groups[0]["params"]
        (group,) = saved["param_groups"]
        if len(group["params"]) != len(params):
            raise ValueError(f"AdamW.load_state_dict: a state of {len(group['params'])} parameters for "
                             f"{len(params)}")
        for key in ("lr", "betas", "eps", "weight_decay"):
            self.param_groups[0][key] = tuple(group[key]) if key == "betas" else group[key]
        self.state = {}
        for i, s in saved["state"].items():
            p = params[group["params"].index(int(i))]
            self.state[p] = {"step": torch.as_tensor(s["step"], dtype=torch.float32).to(p.device).reshape(()),
                             "exp_avg": s["exp_avg"].to(p.device, p.dtype),
                             "exp_avg_sq": s["exp_avg_sq"].to(p.device, p.dtype)}


def adamw(params, lr: float, betas, weight_decay: float, sharded: bool = False):
    """The trainer's optimizer: AdamW above, or torch.optim.AdamW for FSDP2's sharded weights (its default path:
    the fused kernel does not take DTensors)."""
    if sharded:
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    return AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
