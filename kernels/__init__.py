"""Fused ops for the training step, each a Triton kernel with a plain-PyTorch reference.

    logprobs_entropy(logits, targets, temperature=1.0) -> (logp, entropy)
    linear_logprobs_entropy(hidden, weight, targets, temperature=1.0) -> (logp, entropy)
    lm_head_logits(hidden, weight) -> hidden @ weight.T, in vocabulary blocks on a CPU (no autograd)
    policy_loss(logp, old_logp, advantages, eps_low=0.2, eps_high=0.2, *, weights=None, ref_logp=None,
                kl_coef=0.0, entropy=None, entropy_coef=0.0, seq_ids=None, sampler_logp=None, tis_cap=None)
        -> (loss, clipped_low, clipped_high), per token: GRPO's clipped surrogate and the options
        several algorithms share. weights: a constant factor on the surrogate (EAPO's behaviour weight);
        seq_ids: GSPO's sequence ratio; sampler_logp + tis_cap: truncated importance sampling;
        ref_logp + kl_coef: k3 KL; entropy + entropy_coef: a bonus.
        The math: kernels.reference.policy_loss.

Triton runs on CUDA tensors, the references (kernels.reference, same signatures) elsewhere;
FORCE_TRITON=1 sends CPU tensors through Triton as well, for TRITON_INTERPRET=1 to run in tests.
Without triton installed everything runs the references.
"""
from kernels import reference
from kernels.ops import linear_logprobs_entropy, lm_head_logits, logprobs_entropy, policy_loss

__all__ = ["logprobs_entropy", "linear_logprobs_entropy", "lm_head_logits", "policy_loss", "reference"]
