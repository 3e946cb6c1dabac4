"""Fused ops for the training step, each a Triton kernel with a plain-PyTorch reference.

    logprobs_entropy(logits, targets, temperature=1.0) -> (logp, entropy)
    linear_logprobs_entropy(hidden, weight, targets, temperature=1.0) -> (logp, entropy)
    policy_loss(logp, old_logp, advantages, eps_low=0.2, eps_high=0.2, *, weights=None,
                dual_clip=None, ref_logp=None, kl_coef=0.0) -> (loss, clipped_low, clipped_high)

Triton runs on CUDA tensors, the references (kernels.reference, same signatures) elsewhere;
FORCE_TRITON=1 sends CPU tensors through Triton as well, for TRITON_INTERPRET=1 to run in tests.
Without triton installed everything runs the references.
"""
from kernels import reference
from kernels.ops import linear_logprobs_entropy, logprobs_entropy, policy_loss

__all__ = ["logprobs_entropy", "linear_logprobs_entropy", "policy_loss", "reference"]
