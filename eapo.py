"""EAPO: Experience Augmented Policy Optimization (arXiv 2606.30420). GRPO whose rollouts take some tokens from
a frozen policy π_RL of an earlier RL run: at critical decision points (the policy's next-token entropy above τ)
of G_e augmented responses per group, the token is resampled from π_RL, with a probability λ_k annealed to 0 over
T steps; an adapted importance weight corrects the loss for the draw of those tokens. Everything else is grpo.py's
loop (`diff grpo.py eapo.py` shows EAPO, and the refill it leaves out).

    python grpo.py --run-name prior                      # 1. an RL run of the same model gives π_RL
    python eapo.py --prior runs/prior/checkpoint         # 2. EAPO from the base model, with π_RL as experience
    python eapo.py --prior runs/prior/checkpoint --steps 2 --run-name smoke    # any option: python eapo.py --help
    python eapo.py --prior runs/prior/checkpoint --run-name NAME --resume      # continue a run

One step: λ_k = λ_0 max(0, 1 - k/T) (--schedule linear). Sample G completions per prompt; the first G_e of each
group are augmented: π_RL decodes alongside them (its own KV cache, never on ordinary ones) and at each token whose
policy entropy (at the sampling temperature) exceeds τ, with probability λ_k, the policy's draw becomes a draft that
speculative sampling (Chen et al. 2023, arXiv 2302.01318) accepts with min(1, π_RL/π_old) or replaces from the
residual, so the token is exactly π_RL-distributed. Rewards and group advantages are GRPO's, over all G. Each
token's behaviour probability is μ = (1 - λ) π_old + λ π_RL at the critical points of augmented completions, μ =
π_old elsewhere, and the clipped loss of every token is weighted by ω = sg(π_old / μ) (is_weights: what it corrects
and what not; μ here is the behaviour distribution, not grpo.py's μ = --epochs).

Only the paper's abstract, figure captions, reference list and one paragraph are public: the annealing shape, the
form of the adapted importance weight, the split into G_e augmented responses and the defaults of τ, T and G_e are
our reconstruction, each marked "our choice" where the code makes it. Left out: DAPO's refill of dropped groups
(grpo.py's --refill-rounds: refilled groups would need their own augmented rows and π_RL decoding), trajectory-level
experience (EAPO Fig. 3a's baseline), annealing G_e instead of λ, π_RL's entropy as the criterion, and a single
ratio π_θ / μ inside the clip (variants the reconstruction leaves open).

The paper's ablations as switches: without importance sampling, --is-level none (ω ≡ 1; presumably one of Fig. 4b's
"complementary effects of EAPO components"); Pos-Only, --pos-only (only correct augmented completions keep their loss;
Fig. 3a); the annealing length, --anneal-steps T (Fig. 4a); the threshold, --tau or --tau-quantile (Fig. 2).
--is-level sequence weights a completion by the product of its ω_t (truncated at --seq-cap), the correction
the per-token ω lacks beyond one decision (is_weights).
"""
import copy
import math
import os
import time
from dataclasses import asdict, dataclass, replace

import torch

from common import checkpoint, dist
from common.batch import Batch, completion_logprobs, micro_batches, to_batch, token_index, trainer_logprobs, varied_share
from common.config import ConfigError, RunError, check, main_guard, parse
from common.evaluate import evaluate, evaluation_lost
from common.logger import MetricsLog, check_tracker
from common.memory import peak_rss_gb
from common.model import ModelError, Transformer, compute_dtype
from common.optim import adamw
from common.options import high_entropy, overlong_penalty, quantile, token_mask
from common.sampler import Companion, draw, generate, softmax_stats
from common.tasks import format_question, load_task
from common.tokenizer import Tokenizer
from common.verifier import extract_answer, score
from kernels import policy_loss
from kernels.reference import sequence_mean


@dataclass
class Config:
    # run
    run_name: str = ""  # writes runs/<run-name>/; empty = eapo-<date-time>
    resume: bool = False  # continue runs/<run-name>/ from its last checkpoint
    seed: int = 0  # seeds data order, sampling and init; same seed on the same CPU = same run
    device: str = "auto"  # auto (cuda if available), cpu or cuda
    dtype: str = "auto"  # matmul dtype: auto (bf16 on GPUs and CPUs with bf16 units, else float32), float32, bfloat16
    # model and data
    model: str = "smollm2"  # Hugging Face folder (Llama / Qwen2 / Qwen3) or smollm2 (offline default)
    task: str = "arith"  # arith (generated), gsm8k, math500, aime24, amc23, or a .jsonl file
    train_size: int = 2000  # training problems: generated (arith), or a seeded sample of a file's; 0 = the whole file
    # rollouts
    steps: int = 15  # training steps
    # The defaults are sized so that SmolLM2-135M learns the arithmetic task on 2 CPU cores in about 10 minutes: 16
    # prompts a step so that enough groups carry a gradient, answers of at most 48 tokens (a right answer takes ~15;
    # longer ones mostly ramble and end wrong). How they were chosen: docs/benchmarks.md.
    prompts_per_step: int = 16  # B: prompts per step (across all ranks)
    group_size: int = 8  # G: completions per prompt
    max_new_tokens: int = 48  # L_max: completion budget in tokens
    eval_max_new_tokens: int = 64  # evaluations decode max(this, max_new_tokens) tokens
    temperature: float = 0.8  # T_s: sampling temperature; the trainer scores logits / T_s too
    top_p: float = 1.0  # nucleus sampling (1 = off); log-probs stay those of the full softmax
    format_reward: float = 0.0  # added to the reward when the answer is written in \boxed{}
    # advantages and loss
    adv_norm: str = "std"  # std (GRPO) or none (Dr. GRPO): divide group-centred rewards by their std?
    loss_agg: str = "token-mean"  # token-mean (DAPO) | seq-mean-token-mean (GRPO) | seq-mean-token-sum-norm (Dr. GRPO)
    eps_low: float = 0.2  # clip ratio below 1 - eps_low
    eps_high: float = 0.28  # clip ratio above 1 + eps_high (DAPO clip-higher)
    seq_ratio: bool = False  # GSPO's one length-normalised ratio per completion (its full recipe: docs/grpo.md)
    tis_cap: float = 0.0  # C: correct for the sampler copy by ρ = π_train / π_sampler, truncated min(ρ, C); 0 = off
    kl_coef: float = 0.0  # β: k3 KL to the initial model; 0 loads no reference model
    entropy_coef: float = 0.0  # entropy bonus: the loss subtracts this times the token entropy
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal (DAPO)
    # GRPO-family options, all off by default (docs/grpo.md lists them with their sources)
    overlong_mask: bool = False  # completions cut at max_new_tokens get no loss (DAPO's overlong filtering)
    overlong_buffer: int = 0  # L_cache: reward penalty growing over the budget's last L_cache tokens (DAPO); 0 = off
    overlong_penalty: float = 1.0  # that penalty at the budget's end (DAPO: 1)
    loss_type: str = "clip"  # clip (PPO/GRPO) or cispo: clip the weight sg(min(r, 1 + eps_high)), not the update
    tis_mode: str = "token-truncate"  # what --tis-cap does with ρ: {token,sequence}-{truncate,mask} (docs/grpo.md)
    tis_floor: float = 0.0  # the mask modes also drop ρ below this (IcePop: 0.5); 0 = no lower bound
    offpolicy_mask: float = 0.0  # δ: drop A < 0 completions with mean log(π_sampler/π_θ) > δ (DeepSeek-V3.2); 0 = off
    top_entropy: float = 1.0  # train on the top fraction ρ of tokens by entropy (80/20 rule: 0.2); 1 = all
    epochs: int = 1  # μ: passes over each batch of rollouts
    mini_batches: int = 1  # M: optimizer steps per epoch
    micro_batch: int = 8  # completions per forward/backward (gradient accumulation; no effect on the math)
    # optimizer
    lr: float = 3e-5  # AdamW learning rate after warm-up
    warmup_steps: int = 3  # linear warm-up: step k <= N runs at k/N of --lr; 0 = none
    decay_steps: int = 3  # the last N steps lower the rate linearly toward 0 (N/(N+1), ..., 1/(N+1)); 0 = constant
    weight_decay: float = 0.0  # AdamW weight decay
    adam_beta1: float = 0.9  # AdamW β1
    adam_beta2: float = 0.99  # AdamW β2
    max_grad_norm: float = 1.0  # clip the gradient's global norm to this (> 0)
    skip_grad_norm: float = 0.0  # skip an optimizer step whose gradient norm exceeds this (0 = only non-finite ones)
    max_skipped: int = 3  # this many skipped optimizer steps in a row stop the run
    grad_checkpointing: bool = True  # recompute each block's activations in backward: far less memory, some more time
    fsdp: bool = False  # under torchrun: shard weights, gradients and optimizer state with FSDP2 (else DDP)
    # evaluation and checkpoints
    eval_every: int = 15  # evaluate every N steps (and before step 1 and after the last)
    eval_size: int = 300  # held-out problems per evaluation (300: one accuracy near 0.3 carries about ±2.6 points of noise)
    eval_samples: int = 0  # completions per problem for pass@k / maj@k, at --temperature and --top-p (0 = greedy only)
    save_every: int = 15  # checkpoint every N steps (and after the last)
    tracker: str = "none"  # also log to tensorboard, wandb or trackio (an optional package: pip install it)
    # EAPO: experience from a prior RL policy π_RL
    prior: str = ""  # π_RL, required: the checkpoint of an earlier RL run of the same model (runs/<name>/checkpoint)
    lam0: float = 1.0  # λ_0: probability of taking a critical token from π_RL at step 1 (our choice: 1)
    anneal_steps: int = 8  # T: λ reaches 0 after T steps, then the run is plain GRPO (our choice: ~half the run)
    schedule: str = "linear"  # shape of λ_k from λ_0 to 0: linear, cosine, or constant (λ_0 until T)
    augmented: int = -1  # G_e: augmented completions per group (the first G_e); -1 = max(1, G // 4)
    tau: float = -1.0  # τ: critical tokens have policy entropy > τ (nats, at --temperature); -1 = calibrate
    tau_quantile: float = 0.9  # calibration: τ = this quantile of the starting policy's token entropies (our choice)
    is_level: str = "token"  # IS weight ω: token (π_old / μ), sequence (its product over a completion), none (ω ≡ 1)
    omega_cap: float = 0.0  # C_ω: truncate the per-token ω = π_old / μ at this value (0 = no truncation)
    seq_cap: float = 2.0  # --is-level sequence: truncate a completion's product of ω at this value (our choice)
    pos_only: bool = False  # drop the loss of incorrect augmented completions (EAPO Fig. 3a's "Pos-Only")

    choices = {"adv_norm": ["std", "none"], "loss_agg": ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
               "device": ["auto", "cpu", "cuda"], "dtype": ["auto", "float32", "bfloat16"],
               "loss_type": ["clip", "cispo"], "tis_mode": ["token-truncate", "token-mask", "sequence-truncate", "sequence-mask"],
               "tracker": ["none", "tensorboard", "wandb", "trackio"],
               "schedule": ["linear", "cosine", "constant"], "is_level": ["token", "sequence", "none"]}


# Options a resumed run must share with the run it continues: they fix the data order and the model.
RESUME_FIXED = ("seed", "task", "train_size", "prompts_per_step", "model")
# and EAPO's experience: the prior and the schedule that takes its tokens (τ is an entropy at the sampling
# temperature, so another temperature would move the critical points under a saved τ)
EAPO_FIXED = ("prior", "lam0", "anneal_steps", "schedule", "augmented", "tau", "tau_quantile", "temperature")


def validate(cfg: Config):
    """Refuse impossible options before anything is loaded or written."""
    check_tracker(cfg.tracker)  # its package is installed (imported only once the run starts)
    for name in ("steps", "prompts_per_step", "max_new_tokens", "epochs", "mini_batches", "micro_batch", "eval_size",
                 "eval_every", "save_every", "max_skipped"):
        check(getattr(cfg, name) > 0, name, "a positive integer")
    for name in ("eval_max_new_tokens", "warmup_steps", "decay_steps", "overlong_buffer", "eval_samples", "train_size"):
        check(getattr(cfg, name) >= 0, name, "a non-negative integer")
    # a group of one has no baseline: its advantage would be 0 and it would never learn anything
    check(cfg.group_size >= 2, "group_size", "at least 2 (advantages compare completions of one prompt)")
    # below 0.01, fp32 logits / T overflow (and sampling there is nearly greedy anyway)
    check(cfg.temperature >= 0.01, "temperature", "a number >= 0.01 (the trainer divides logits by it)")
    check(0 < cfg.top_p <= 1, "top_p", "a number in (0, 1]")
    check(0 <= cfg.eps_low < 1 and cfg.eps_high >= 0, "eps_low/eps_high", "0 <= eps_low < 1 and eps_high >= 0")
    check(cfg.lr > 0 and cfg.kl_coef >= 0 and cfg.entropy_coef >= 0, "lr/kl_coef/entropy_coef",
          "lr > 0, kl_coef >= 0 and entropy_coef >= 0")
    check(cfg.max_grad_norm > 0, "max_grad_norm", "a positive number (a norm of 0 would zero every gradient)")
    check(cfg.tis_cap == 0 or cfg.tis_cap >= 1, "tis_cap", "0 (off) or a cap >= 1")
    check(0 <= cfg.tis_floor < 1, "tis_floor", "a number in [0, 1)")
    check(cfg.tis_floor == 0 or cfg.tis_cap and cfg.tis_mode.endswith("mask"), "tis_floor",
          "0 unless --tis-cap with --tis-mode token-mask or sequence-mask (the truncate modes have no floor)")
    check(cfg.overlong_buffer < cfg.max_new_tokens and cfg.overlong_penalty >= 0, "overlong_buffer/overlong_penalty",
          "a buffer shorter than max_new_tokens and a penalty >= 0")
    check(cfg.offpolicy_mask >= 0 and 0 < cfg.top_entropy <= 1, "offpolicy_mask/top_entropy",
          "a δ >= 0, a fraction in (0, 1]")
    check(0 <= cfg.adam_beta1 < 1 and 0 <= cfg.adam_beta2 < 1 and cfg.weight_decay >= 0,
          "adam_beta1/adam_beta2/weight_decay", "betas in [0, 1) and weight_decay >= 0")
    check(cfg.prompts_per_step % dist.world() == 0, "prompts_per_step", f"a multiple of the world size {dist.world()}")
    # ranks would drop different numbers of groups and disagree on how many gradient all-reduces to run
    check(not (cfg.dynamic_sampling and dist.world() > 1), "dynamic_sampling",
          "a single process (under torchrun ranks would drop different numbers of groups)")
    check(cfg.prompts_per_step // dist.world() * cfg.group_size >= cfg.mini_batches, "mini_batches",
          "at most the completions per step on each rank (prompts_per_step / world * group_size)")
    check(cfg.prior != "", "prior", "a checkpoint of an earlier RL run of this model, e.g. "
          "`python grpo.py --run-name prior` then `python eapo.py --prior runs/prior/checkpoint`")
    check(0 <= cfg.lam0 <= 1 and cfg.anneal_steps >= 0, "lam0/anneal_steps", "0 <= lam0 <= 1 and anneal_steps >= 0")
    check(-1 <= cfg.augmented <= cfg.group_size, "augmented", f"-1 (a quarter) or 0..{cfg.group_size} (the group)")
    check(cfg.tau == -1 or cfg.tau >= 0, "tau", "-1 (calibrate) or an entropy >= 0 in nats")
    check(0 < cfg.tau_quantile < 1 and (cfg.omega_cap == 0 or cfg.omega_cap >= 1) and cfg.seq_cap >= 1,
          "tau_quantile/omega_cap/seq_cap", "0 < tau_quantile < 1, omega_cap 0 (off) or >= 1 and seq_cap >= 1")
    check(cfg.omega_cap == 0 or cfg.is_level == "token", "omega_cap",
          "0 unless --is-level token (the sequence-level weight is capped by --seq-cap; none has no weight to cap)")
    # the policy's draw is the speculative draft: it must come from the whole softmax π_old
    check(cfg.top_p == 1 or cfg.lam0 == 0, "top_p", "1 (EAPO drafts from the untruncated policy)")
    check(cfg.offpolicy_mask == 0 or cfg.lam0 == 0, "offpolicy_mask", "0 while π_RL injects tokens (its drift reads "
          "the policy's sampler log-probs, not the mixture μ that drew the injected tokens)")


def check_resume(cfg: Config, saved: dict):
    """A resumed run must see the data and model the checkpoint was trained on."""
    for name in RESUME_FIXED:
        check(saved.get(name, getattr(cfg, name)) == getattr(cfg, name), name,
              f"{saved.get(name)!r} as in the run being resumed (changing it changes the data order or the model)")
    for name in EAPO_FIXED:
        was, now = saved.get(name, getattr(cfg, name)), getattr(cfg, name)
        if name == "prior":  # the same folder however it is written (./runs/x/, runs/x)
            was, now = os.path.realpath(was), os.path.realpath(now)
        check(was == now, name,
              f"{saved.get(name)!r} as in the run being resumed (changing it changes the experience it trains on)")


def check_context(model, tok, problems, cfg):
    """Prompt + completion must fit the model's positions; say so before anything is written."""
    longest = max(len(tok.prompt(format_question(p))) for p in problems)
    limit = model.cfg.max_position_embeddings
    check(longest + max(cfg.max_new_tokens, cfg.eval_max_new_tokens) <= limit, "max_new_tokens/eval_max_new_tokens",
          f"at most {limit - longest}: the longest prompt has {longest} tokens and the model {limit} positions")


# ----------------------------------------------------------------------------- rewards -> advantages

def group_advantages(rewards: torch.Tensor, group: torch.Tensor, norm: str) -> torch.Tensor:
    """rewards [N], group ids [N] -> advantages [N] relative to each completion's group (GRPO, DeepSeekMath
    §4.1.2). Groups may differ in size; a group of one has advantage 0 (our choice, as TRL; verl's GRPO gives it its
    raw reward)."""
    n = int(group.max()) + 1 if len(group) else 0
    count = torch.bincount(group, minlength=n).double()
    mean = torch.zeros(n, dtype=torch.float64).index_add_(0, group, rewards.double()) / count.clamp(min=1)
    centred = rewards.double() - mean[group]
    if norm == "none":  # Dr. GRPO §3.1: the std division re-weights groups by difficulty; leave it out
        return centred.float()
    # our choice, as verl: the unbiased std and ε = 1e-6 (DeepSeekMath writes std(r) and released no code; TRL takes
    # the biased one + 1e-4: a factor √(G/(G-1)) for equal groups). A group of one: centred = 0, so 0 / (0 + 1e-6) = 0
    var = torch.zeros(n, dtype=torch.float64).index_add_(0, group, centred ** 2) / (count - 1).clamp(min=1)
    return (centred / (var.sqrt()[group] + 1e-6)).float()


def boxed(text: str) -> bool:
    """The optional format term: the completion uses \\boxed and an answer can be read from it."""
    return "\\boxed" in text and extract_answer(text) is not None


def verify(b: Batch, tok, cfg):
    """Each completion's verifier score (0/1) [N] and reward [N]: the score, the optional format term and DAPO's
    optional overlong penalty."""
    texts = [tok.decode(t, skip_special=True) for t in b.tokens]
    correct = torch.tensor([score(t, a) for t, a in zip(texts, b.answer)])  # [N]
    rewards = correct + cfg.format_reward * torch.tensor([float(boxed(t)) for t in texts])
    if cfg.overlong_buffer:
        rewards = rewards + overlong_penalty(b.lengths, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
    return correct, rewards


def varied_groups(rewards: torch.Tensor, group: torch.Tensor, n_groups: int) -> torch.Tensor:
    """[n_groups] bool: the groups whose rewards are not all equal, the only ones with a nonzero advantage. Our choice
    for --dynamic-sampling: on the rewards the advantages see; DAPO's constraint (eq. 8: 0 < correct < G) and its
    recipe filter on accuracy, which differs only with reward shaping (--overlong-buffer, --format-reward): a
    group all correct whose lengths vary is kept here and trains on the length penalty."""
    group_max = torch.full((n_groups,), -math.inf).scatter_reduce(0, group, rewards, "amax")
    group_min = torch.full((n_groups,), math.inf).scatter_reduce(0, group, rewards, "amin")
    return group_max > group_min


def token_weights(n_loss: torch.Tensor, agg: str, max_new_tokens: int, n_seqs: int, n_tokens: int) -> torch.Tensor:
    """Per-token factor w_t so that Σ_t w_t ℓ_t is the aggregated loss of the whole mini-batch. Computed
    from the mini-batch's totals, so micro-batches add up to exactly the big-batch gradient.
    n_loss [n]: loss tokens per completion; n_seqs / n_tokens: totals of the mini-batch.
    Returns w [n_loss.sum()], completion after completion."""
    if agg == "token-mean":  # DAPO §3.3: every token counts the same. Over the whole mini-batch, as DAPO's released
        # code does ("across all the tokens in all the sequences in a batch"); eq. 8 as printed normalises per group
        w = torch.full_like(n_loss, 1.0 / max(n_tokens, 1), dtype=torch.float32)
    elif agg == "seq-mean-token-mean":  # DeepSeekMath eq. 3: every completion counts the same
        w = 1.0 / (n_loss.float().clamp(min=1) * max(n_seqs, 1))
    else:  # seq-mean-token-sum-norm, Dr. GRPO §3.1: a constant normaliser, no length bias. Dr. GRPO's 1/G is kept:
        # verl's mode of this name divides by max_new_tokens alone, B·G times our loss (mind it with grad clipping)
        w = torch.full_like(n_loss, 1.0 / (max(n_seqs, 1) * max_new_tokens), dtype=torch.float32)
    return w.repeat_interleave(n_loss)


def step_prompts(train, step, n, seed):
    """The n prompts of a step: walk a fresh seeded permutation of the train set each epoch. A function of
    (step, seed) alone, so a resumed run sees the same prompts as an uninterrupted one."""
    out, perms = [], {}
    for k in range((step - 1) * n, step * n):
        epoch, i = divmod(k, len(train))
        if epoch not in perms:
            perms[epoch] = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        out.append(train[int(perms[epoch][i])])
    return out


# -------------------------------------------------------------------------- EAPO: experience from π_RL
# Experience Augmented Policy Optimization (arXiv 2606.30420). Only the abstract and the figure captions are
# public: every "our choice" below is ours, made where the paper's text was not available.

def injection_prob(k: int, lam0: float, T: int, schedule: str = "linear") -> float:
    """λ_k, the chance of taking a critical token from π_RL at step k = 0, 1, ... (EAPO's "experience
    annealing steps T", Fig. 4a). After T steps EAPO is plain on-policy RLVR."""
    if k >= T:
        return 0.0
    if schedule == "linear":  # our choice: the paper names T but not the shape (or what decays); linear λ
        return lam0 * (1 - k / T)
    if schedule == "cosine":
        return lam0 * 0.5 * (1 + math.cos(math.pi * k / T))
    return lam0  # "constant": full strength until T, then off


def augmented_rows(n_prompts: int, G: int, G_e: int) -> list[int]:
    """Sample indices (prompt-major) of the experience-augmented responses: the first G_e of each group
    (Fig. 2b-c report on "the experience-augmented responses", so only some are; which and how many is our
    choice). The other G - G_e stay on-policy, an anchor for every group's baseline."""
    return [i * G + j for i in range(n_prompts) for j in range(G_e)]


def speculative_resample(p_old, p_rl, draft, generator=None):
    """A token distributed exactly as p_rl from a draft ~ p_old (speculative sampling: Chen et al. 2023,
    arXiv 2302.01318; Leviathan et al. 2023, arXiv 2211.17192): keep the draft x with probability
    min(1, p_rl(x) / p_old(x)), else draw from the residual max(0, p_rl - p_old), renormalised.
    p_old, p_rl [b, V] probabilities, draft [b]. Returns (tokens [b], rejected [b] bool: the draft was
    rejected and the token drawn from the residual). The chance of a rejection is TV(p_old, p_rl)."""
    q = p_old.gather(-1, draft[:, None])[:, 0]
    r = p_rl.gather(-1, draft[:, None])[:, 0]
    u = torch.rand(len(draft), generator=generator, device=draft.device)
    residual = (p_rl - p_old).clamp(min=0)  # [b, V]
    # u < r / q without a division: r = 0 (an underflowed prior) always rejects; a residual of zero mass
    # means p_rl = p_old, and the draft stays
    rejected = (u * q >= r) & (residual.sum(-1) > 0)
    return torch.where(rejected, draw(residual, generator), draft), rejected


def behaviour_logp(old_logp, rl_logp, lam: float, eligible):
    """log μ_t(a_t), the probability with which each token was actually emitted: the denominator of EAPO's
    "adapted importance sampling" (abstract). At a critical position of an augmented response the token came
    from π_old with probability 1 - λ and from π_RL with probability λ, so μ = (1 - λ) π_old + λ π_RL;
    elsewhere μ = π_old. our choice: the coin is folded into the mixture (eligibility is a function of the
    state, the coin is not), so ω depends on the emitted token alone, not on the unlogged coin, and is at most
    1 / (1 - λ) for λ < 1 (conditioning on the coin would give the unbounded π_old / π_RL at any λ). At λ = 1
    (λ_0's default, step 1) the mixture is π_RL and ω = π_old / π_RL is unbounded; --omega-cap bounds it. Log space
    keeps tiny probabilities finite."""
    if lam <= 0:
        return old_logp.clone()
    mixture = torch.logaddexp(old_logp + (math.log1p(-lam) if lam < 1 else -math.inf), rl_logp + math.log(lam))
    return torch.where(eligible, mixture, old_logp)


def is_weights(old_logp, mu_logp, level: str = "token", cap: float = 0.0, seq_ids=None):
    """EAPO's adapted importance weight ω [n_tok] (abstract: "adapted importance sampling"; our choice of the form,
    the paper gives only its name), a constant factor on each token's clipped loss (token_loss's `weights`).
    old_logp, mu_logp [n_tok]: log π_old and log μ of each emitted token (equal where μ = π_old, so log ω = 0
    exactly off the critical points and on ordinary completions); seq_ids [n_tok]: each token's completion.
        token:     ω_t = min(sg(π_old(a_t) / μ_t(a_t)), C)
        sequence:  ω_t = min(Π_{s in y} π_old(a_s) / μ_s(a_s), C)   for every token t of completion y
        none:      ω_t = 1                                          (the ablation without IS, EAPO Fig. 4b)
    cap C: 0 = none. What the per-token ω corrects: the distribution of the token drawn at a state, so that
    ω_t ρ_t = π_θ / μ_t is the IS surrogate of that one draw, exact when the completion is that one token
    (tests/test_eapo.py, test_6's bandit). What it does not correct: the rest of the completion. An injected
    token changes every later state, and the reward scores the whole completion, whose other tokens μ drew too;
    so beyond one token the per-token weights leave a bias (test_6b: an exactly enumerated
    two-step toy, a bias as large as the gradient at λ = 1). The product over the completion is the whole
    ratio π_old(y) / μ(y): unbiased untruncated, with a variance that grows with the critical tokens of a
    completion; its cap bounds the variance and gives back some bias."""
    log_w = (old_logp - mu_logp).detach()  # [n_tok]
    if level == "none":
        return torch.ones_like(log_w)
    if level == "sequence":  # the sum of a completion's log-ratios, back on each of its tokens
        n_seq = int(seq_ids.max()) + 1 if len(seq_ids) else 0
        log_w = log_w.new_zeros(n_seq).index_add_(0, seq_ids, log_w)[seq_ids]
    w = log_w.exp()
    return w.clamp(max=cap) if cap > 0 else w


def calibrate_tau(entropies, level: float) -> float:
    """τ as the `level` quantile of the starting policy's token entropies, so that about 1 - level of the tokens
    are critical at the start. our choice: the paper sweeps τ (Fig. 2) but its values are for other models;
    a quantile carries over to any model and task."""
    return float(quantile(entropies.double(), level))


class PriorMix:
    """The sampler Companion's mix for the augmented rows (EAPO Fig. 1: π_RL's actions resampled "at critical
    decision points" of the current policy's rollout), one call per generated position. The policy's draw is
    the draft. Where the position is critical (the policy's entropy at the sampling temperature > τ) and a
    coin of probability λ says inject, speculative resampling turns it into a draw from π_RL (at the same
    temperature: our choice, so that π_RL's tokens are scored like the policy's). Returns the emitted tokens
    and per-token extras: old_logp, rl_logp (log π_old, log π_RL of the token), mu_logp (log μ), eligible,
    injected (π_RL decided the token), rejected (injected, and the speculative draft rejected) and kl
    (KL(π_old || π_RL) at the position, full vocabulary)."""

    def __init__(self, lam: float, tau: float, temperature: float, seed: int, device="cpu"):
        self.lam, self.tau, self.temperature = lam, tau, temperature
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)  # its own stream: the policy's draws are those it would make without us

    def __call__(self, t, draft, logits, prior_logits, rows):
        logp_old, p_old, entropy = softmax_stats(logits, self.temperature)  # [b, V], [b, V], [b]
        logp_rl, p_rl, _ = softmax_stats(prior_logits, self.temperature)
        # EAPO's resampling threshold τ, strict. our choice: the learner's entropy decides (not π_RL's), as in the
        # high-entropy "forking token" work the paper cites
        eligible = entropy > self.tau
        coin = torch.rand(len(draft), generator=self.gen, device=draft.device) < self.lam
        injected = eligible & coin
        # on every row, injected or not: the random stream then does not depend on which rows inject
        spec, rejected = speculative_resample(p_old, p_rl, draft, self.gen)
        tokens = torch.where(injected, spec, draft)
        old_logp = logp_old.gather(-1, tokens[:, None])[:, 0]
        rl_logp = logp_rl.gather(-1, tokens[:, None])[:, 0]
        return tokens, {
            "old_logp": old_logp, "rl_logp": rl_logp, "mu_logp": behaviour_logp(old_logp, rl_logp, self.lam, eligible),
            "eligible": eligible, "injected": injected, "rejected": injected & rejected,
            "kl": (p_old * (logp_old - logp_rl)).sum(-1),
        }


def pos_only_dropped(correct, augmented):
    """Completions whose loss is dropped under --pos-only: the incorrect augmented ones (EAPO Fig. 3a keeps
    only positive experience, following ExGRPO and DeepSeek-V3.2). Their group's advantages are computed
    before, over the whole group. correct, augmented [N] -> [N] bool."""
    return augmented & (correct <= 0)


def augmented_share(flags: list, augmented: list) -> float:
    """Flagged tokens / tokens, over the augmented responses only (EAPO Fig. 2b's ratios); ordinary ones add
    nothing. flags: one bool tensor per completion; augmented: one bool per completion."""
    n = sum(len(f) for f, a in zip(flags, augmented) if a)
    return sum(int(f.sum()) for f, a in zip(flags, augmented) if a) / max(n, 1)


@torch.no_grad()  # a freshly loaded model's weights require gradients: no graph, and no warning about one
def fingerprint(model) -> list[float]:
    """The sum and the sum of squares of every weight of a model, in float64."""
    return [sum(float(p.double().sum()) for p in model.parameters()),
            sum(float(p.double().pow(2).sum()) for p in model.parameters())]


class PriorWeights:
    """π_RL, frozen: no gradient ever reaches it. It must share the policy's vocabulary and tokenizer, or its
    probabilities would be of other tokens. On a CPU its weights are held only while it samples: `hold()` loads them
    from the checkpoint for a step's augmented completions (file-backed, from the page cache: ~0.05 s for
    SmolLM2-135M), and they are gone before the ordinary completions sample and the update runs, whose memory is then
    grpo.py's (π_RL's fp32 weights would add 0.54 x 10^9 B to the gradients and AdamW moments; `rollouts`,
    docs/eapo.md). On a GPU they stay."""

    def __init__(self, cfg, model, tok, device, dtype):
        self.path, self.device, self.dtype = cfg.prior, device, dtype
        try:
            prior = self.load()
            prior_tok = Tokenizer.from_pretrained(cfg.prior)
        except ModelError as e:  # name the option; a run's folder given for its checkpoint is the likely slip
            inside = os.path.join(cfg.prior, "checkpoint")
            raise ConfigError(f"--prior: expected a checkpoint of an earlier RL run, runs/<name>/checkpoint"
                              f"{f' ({inside}?)' if os.path.isdir(inside) else ''}; {e}") from None
        check(prior.cfg.vocab_size == model.cfg.vocab_size and prior_tok.tok.get_vocab(True) == tok.tok.get_vocab(True),
              "prior", f"a model with the policy's tokenizer and vocabulary ({cfg.prior} has others)")
        self.resident = prior if torch.device(device).type != "cpu" else None
        # the sum and the sum of squares of every weight, in float64, of the checkpoint's fp32 weights (not of a bf16
        # copy: --dtype may change on resume): a resumed run checks that its π_RL is the same (its --prior path may
        # since hold another checkpoint). Checkpoints before 2026-11-29 kept those of the run's dtype: also accepted
        self.fingerprints = [fingerprint(prior)]
        if dtype != torch.float32:
            self.fingerprints.insert(0, fingerprint(Transformer.from_pretrained(self.path, device="cpu")))

    @property
    def fingerprint(self) -> list[float]:
        return self.fingerprints[0]

    def load(self):
        return Transformer.from_pretrained(self.path, device=self.device, dtype=self.dtype).eval().requires_grad_(False)

    def hold(self):
        return self.resident if self.resident is not None else self.load()

    @property
    def apart(self):
        """Whether the augmented completions sample in a call of their own (where π_RL is held per step: a CPU)."""
        return self.resident is None


def rollouts(rollout, priors, mix, contexts, G, G_e, cfg, stop_ids, seed):
    """G completions of each prompt (groups, prompt-major), the first G_e of each experience-augmented: π_RL decodes
    alongside them and `mix` may take their critical tokens from it (EAPO Fig. 1). On a GPU one sampling call. On a
    CPU (priors.apart) the augmented completions come first, in a call of their own with π_RL, and the ordinary ones
    after it, once π_RL's weights are gone: π_RL's weights (0.54 x 10^9 bytes in fp32) and the sampler's buffers for
    all G rows never meet, which keeps a step's peak memory near grpo.py's (docs/eapo.md). Memory, not EAPO: on a GPU
    memory is not the limit and a second sequential call would cost a step's sampling latency again.
    Both ways each completion is drawn from the same distribution; only the random draws differ."""
    kw = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, stop_ids=stop_ids)
    if G_e == 0:
        return generate(rollout, contexts, n=G, seed=seed, **kw)
    if not priors.apart:
        companion = Companion(priors.hold(), mix, rows=augmented_rows(len(contexts), G, G_e))
        return generate(rollout, contexts, n=G, seed=seed, companion=companion, **kw)
    # the prompts' keys and values from the first call's prefill: the second call copies them, the same numbers
    prompt_kv = {}
    augmented = generate(rollout, contexts, n=G_e, seed=seed, companion=Companion(priors.hold(), mix),
                         prompt_kv=prompt_kv, **kw)
    ordinary = generate(rollout, contexts, n=G - G_e, seed=seed + 2, prompt_kv=prompt_kv, **kw)  # π_RL's weights gone
    like = augmented[0][0].extras  # the ordinary completions' per-token extras: zeros, as a joint call gives them
    for s in (s for g in ordinary for s in g):
        s.extras = {k: v.new_zeros(len(s.tokens)) for k, v in like.items()}
    return [a + o for a, o in zip(augmented, ordinary)]


def calibrate(rollout, contexts, cfg, tok, seed) -> float:
    """τ from the starting policy: two completions of each of the first step's prompts, at the sampling
    temperature. our choice: the first step's prompts are the ones τ first acts on."""
    groups = generate(rollout, contexts, n=2, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                      stop_ids=tok.stop_ids, seed=seed)
    return calibrate_tau(torch.cat([s.entropies for g in groups for s in g]), cfg.tau_quantile)


def flat_extras(groups, keep_tok):
    """The prior's per-token values of the kept completions, flat [n_tok] like Batch (zeros on ordinary ones)."""
    samples = [s for g in groups for s in g]
    return {k: torch.cat([s.extras[k] for s in samples])[keep_tok] for k in samples[0].extras}


def eapo_metrics(lam, tau, groups, aug, correct, prior_tok, omega) -> dict:
    """EAPO's diagnostics (its Fig. 2b logs the "resampled ratio", the share of augmented responses' tokens π_RL
    decided: our injected_ratio; Fig. 2c the accuracy of augmented responses). rejected_ratio: the augmented
    responses' tokens whose speculative draft was rejected and redrawn from the residual, over all their tokens, as
    injected_ratio (so at most it; a detail of our sampling). aug, correct [N] over all completions of the
    step; the ratios over all augmented tokens; prior_tok (flat_extras, with "aug") and omega [n_tok] over the kept
    ones' tokens (kl_prior, omega_*)."""
    entropies = torch.cat([s.entropies for g in groups for s in g])
    m = {"eapo/lambda": lam, "eapo/tau": tau, "eapo/eligible_share": (entropies > tau).float().mean().item(),
         "eapo/injected_ratio": 0.0, "eapo/rejected_ratio": 0.0, "eapo/prior_tokens": 0.0}
    if aug.any():
        samples = [s for g in groups for s in g]
        # EAPO's extra sampling work: the tokens π_RL decoded alongside (against perf/sampled_tokens, the policy's)
        m["eapo/prior_tokens"] = float(sum(len(s.tokens) for s, a in zip(samples, aug.tolist()) if a))
        m["eapo/injected_ratio"] = augmented_share([s.extras["injected"] for s in samples], aug.tolist())
        m["eapo/rejected_ratio"] = augmented_share([s.extras["rejected"] for s in samples], aug.tolist())
        m["eapo/acc_augmented"] = correct[aug].mean().item()
        if not aug.all():  # absent, not 0, when every completion is augmented (--augmented G)
            m["eapo/acc_ordinary"] = correct[~aug].mean().item()
    if prior_tok and prior_tok["aug"].any():  # over the kept augmented completions' tokens
        on_aug = prior_tok["aug"]  # [n_tok]
        critical = on_aug & prior_tok["eligible"]  # where ω can differ from 1 (under sequence: its completion's product)
        if critical.any():
            m["eapo/omega_mean"], m["eapo/omega_max"] = omega[critical].mean().item(), omega[critical].max().item()
        # our choice: the exact KL(π_old || π_RL) over the vocabulary, at the augmented rows' positions (the
        # prior never runs on ordinary rows); the paper's Fig. 3b plots a KL whose target is cut off
        m["eapo/kl_prior"] = prior_tok["kl"][on_aug].mean().item()
    return m


EAPO_SUMS = ("eapo/prior_tokens",)  # like perf/sampled_tokens, which it is read against
EAPO_MAXES = ("eapo/omega_max",)


# -------------------------------------------------------------------------------------------- loss

def token_loss(logp, old_logp, adv, entropy, cfg, ref_logp=None, **kw):
    """GRPO's per-token loss ℓ_t in one fused pass (kernels.policy_loss, a Triton kernel on a GPU): exactly the lines
    of token_loss_plain below, which tests/test_grpo.py checks it against. logp, entropy [n] carry gradients;
    old_logp, adv, ref_logp [n] and kw (weights, GSPO's seq_ids, TIS's sampler_logp) are constants.
    Returns ℓ [n] and the clip's cuts, clipped_low and clipped_high [n] bool (CISPO: where its weight was clipped)."""
    if cfg.loss_type == "cispo":  # the unclipped surrogate r·A times the constant min(r, 1 + ε_high) / r: CISPO's
        ratio = cispo_ratio(logp, old_logp, kw.get("seq_ids"))  # value and gradient, in the same fused pass
        weight = ratio.clamp(max=1 + cfg.eps_high) / ratio
        kw["weights"] = weight if kw.get("weights") is None else kw["weights"] * weight
        loss, _, _ = policy_loss(logp, old_logp, adv, 1.0, math.inf, ref_logp=ref_logp, kl_coef=cfg.kl_coef,
                                 entropy=entropy, entropy_coef=cfg.entropy_coef, tis_cap=tis_cap(cfg, kw), **kw)
        return loss, torch.zeros_like(weight, dtype=torch.bool), ratio > 1 + cfg.eps_high
    return policy_loss(logp, old_logp, adv, cfg.eps_low, cfg.eps_high, ref_logp=ref_logp, kl_coef=cfg.kl_coef,
                       entropy=entropy, entropy_coef=cfg.entropy_coef, tis_cap=tis_cap(cfg, kw), **kw)


def tis_cap(cfg, kw):
    """The fused loss's truncated-IS cap: --tis-cap when the update passed the sampler's log-probs (token-truncate)."""
    return cfg.tis_cap if kw.get("sampler_logp") is not None else None


def cispo_ratio(logp, old_logp, seq_ids=None):
    """[n] the (detached) ratio r that CISPO's weight clips: per token, or GSPO's per-completion mean."""
    log_ratio = (logp - old_logp).detach()
    return (log_ratio if seq_ids is None else sequence_mean(log_ratio, seq_ids)).exp()


def token_loss_plain(logp, old_logp, adv, entropy, cfg, ref_logp=None, weights=None, seq_ids=None, sampler_logp=None):
    """token_loss written out. Returns ℓ [n] and where the clip cut the gradient (clipped_low, clipped_high [n])."""
    old_logp = old_logp.detach()
    if seq_ids is None:  # r_t = π_θ / π_old, one ratio per token (PPO, arXiv 1707.06347 eq. 6)
        log_ratio = logp - old_logp
    else:  # GSPO §4 (GSPO-token): every token of completion i takes s_i = exp(mean log-ratio), gradient s_i ∇log π_θ
        n_seq = int(seq_ids.max()) + 1
        seq_sum = logp.new_zeros(n_seq).index_add_(0, seq_ids, (logp - old_logp).detach())
        log_ratio = (seq_sum / torch.bincount(seq_ids, minlength=n_seq))[seq_ids] + logp - logp.detach()
    ratio = log_ratio.exp()
    # the clipped surrogate (PPO eq. 7) per token, as GRPO's objective (arXiv 2402.03300 §4.1.1, eq. 3), with DAPO's
    # clip-higher (arXiv 2503.14476 §3.1): ε_high > ε_low leaves an unlikely token more room to rise
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
    if cfg.loss_type == "cispo":  # CISPO (MiniMax-M1, arXiv 2506.13585 §3.1, eq. 4-5): clip the importance weight,
        # sg(min(r, 1 + ε_high)) with no lower bound, not the update: every token keeps its gradient A ∇log π_θ
        weight = ratio.detach().clamp(max=1 + cfg.eps_high)
        # value -weight·A, gradient -weight·A·∇log π_θ (r is s_i under GSPO)
        loss = -weight * adv * ratio / ratio.detach()
    if weights is not None:  # a constant per-token factor on the surrogate (masks, a variant's weight), not KL/entropy
        loss = loss * weights
    if sampler_logp is not None:  # truncated IS: the sampling copy (e.g. bf16) is not exactly π_old (Yao et al. 2025)
        loss = loss * (old_logp - sampler_logp).exp().clamp(max=cfg.tis_cap)
    if ref_logp is not None:  # k3 estimate of KL(π_θ || π_ref), GRPO eq. 4; the clamp keeps exp() finite
        x = (ref_logp - logp).clamp(-10, 10)
        loss = loss + cfg.kl_coef * (x.exp() - x - 1)
    loss = loss - cfg.entropy_coef * entropy  # the entropy bonus
    ratio = ratio.detach()
    if cfg.loss_type == "cispo":  # nothing cut; "clipped high" reports where the weight was clipped
        return loss, torch.zeros_like(ratio, dtype=torch.bool), ratio > 1 + cfg.eps_high
    return loss, (ratio < 1 - cfg.eps_low) & (adv < 0), (ratio > 1 + cfg.eps_high) & (adv > 0)


# ------------------------------------------------------------------------------------------ update

def update(policy, model, optimizer, b: Batch, adv, cfg, pad_id, device, autocast, old_logp=None, ref_logp=None,
           loss_kw=None):
    """μ epochs x M mini-batches of clipped policy-gradient steps on batch b, forwards through `policy` (DDP, FSDP2
    or the model itself), steps on `model`'s parameters. adv [N]; old_logp [n_tok] π_old, None when μ = M = 1 (the
    update's own detached forward is π_old); ref_logp [n_tok] π_ref, None without --kl-coef; loss_kw: more per-token
    [n_tok] tensors for token_loss (weights, ...). Returns diagnostics summed over trained tokens and optimizer steps,
    and last_grad_norm and skipped_since_last_step (optimizer steps skipped since the last one taken)."""
    N, lengths = len(b.tokens), b.lengths
    n_train = lengths - b.skip  # loss tokens per completion
    tok_adv = adv.repeat_interleave(lengths)  # [n_tok]
    mini = [list(range(m * N // cfg.mini_batches, (m + 1) * N // cfg.mini_batches)) for m in range(cfg.mini_batches)]
    # A completion with advantage 0 (all of its group right or all wrong) adds exactly 0 to the gradient unless a
    # term acts without the advantage (KL, entropy bonus), and one without loss tokens adds nothing: on one process
    # both are left out of the forward and backward but kept in the aggregation's totals, so the gradient is the
    # same. Most groups are such early and late in a run. Under torchrun every completion runs: ranks must run the
    # same forwards (FSDP2 gathers the weights in each one, and a rank with none would skip DDP's all-reduce).
    keeps_all = cfg.kl_coef > 0 or cfg.entropy_coef > 0
    active = [dist.world() > 1 or (keeps_all or a != 0) and n > 0 for a, n in zip(adv.tolist(), n_train.tolist())]
    stats = dict.fromkeys(["tokens", "policy_tokens", "fwd_tokens", "clip_low", "clip_high", "approx_kl", "ref_kl",
                           "entropy", "mismatch", "mismatch_tokens", "masked", "grad_norm", "grad_norm_max",
                           "opt_steps", "skipped", "skipped_since_last_step"], 0.0)
    forking = torch.ones(len(b.sampler_logp), dtype=torch.bool)  # [n_tok] the tokens --top-entropy trains on
    for epoch in range(cfg.epochs if N else 0):
        for idx in mini:
            # the aggregation's totals over the whole mini-batch, summed over ranks
            n_seqs, n_tokens, n_members = dist.all_reduce_sum(torch.tensor(
                [float((n_train[idx] > 0).sum()), float(n_train[idx].sum()), float(len(idx))])).tolist()
            if n_members == 0:  # fewer completions than mini-batches (--dynamic-sampling dropped groups): no step
                continue
            # ranked over the mini-batch's loss tokens, those of zero-advantage completions too (our choice: the
            # paper's batches have none, after DAPO's filter; without --dynamic-sampling fewer than ρ of the tokens
            # that carry a gradient train)
            if cfg.top_entropy < 1:
                tok_mb = token_index(lengths, idx)
                tok_mb = tok_mb[b.train_mask()[tok_mb]]
                forking[tok_mb] = high_entropy(b.sampler_entropy[tok_mb], cfg.top_entropy)
            dist.zero_grad(optimizer, model)
            trained = [i for i in idx if active[i]]
            micro = micro_batches(trained, b.group, cfg.micro_batch)
            for j, mb in enumerate(micro):
                w = token_weights(n_train[mb], cfg.loss_agg, cfg.max_new_tokens, int(n_seqs), int(n_tokens))
                with autocast, dist.accumulate(policy, skip_sync=j < len(micro) - 1):  # all-reduce on the last
                    # log π_θ of the loss tokens of completions mb, and their positions tok in the flat [n_tok] arrays
                    logp, entropy, tok = completion_logprobs(policy, b, mb, cfg.temperature, pad_id, device)
                    extra = {k: v[tok].to(device) for k, v in (loss_kw or {}).items()}
                    seq = torch.arange(len(mb)).repeat_interleave(n_train[mb]).to(device)  # each token's completion
                    if cfg.seq_ratio:  # GSPO §4: the ratio is one per completion, over its loss tokens
                        extra["seq_ids"] = seq
                    if cfg.tis_cap and cfg.tis_mode == "token-truncate":
                        extra["sampler_logp"] = b.sampler_logp[tok].to(device)
                    old = logp.detach() if old_logp is None else old_logp[tok].to(device)
                    ref = None if ref_logp is None else ref_logp[tok].to(device)
                    mask = token_mask(old, logp.detach(), b.sampler_logp[tok].to(device), tok_adv[tok].to(device), seq, cfg)
                    if cfg.top_entropy < 1:
                        mask = forking[tok].to(device).float() * (1 if mask is None else mask)
                    if mask is not None:  # one constant factor per token, with the variant's own weights
                        extra["weights"] = mask if extra.get("weights") is None else extra["weights"] * mask
                    loss_tok, clip_low, clip_high = token_loss(logp, old, tok_adv[tok].to(device), entropy, cfg,
                                                               ref_logp=ref, **extra)
                    # w divides by the global totals; DDP averages gradients over ranks, so undo its 1/world
                    ((loss_tok * w.to(device)).sum() * dist.world()).backward()
                with torch.no_grad():  # diagnostics over the tokens the update trains: A != 0, or all under a KL or
                    # an entropy term; not the others that torchrun puts through the forward (ranks run the same ones)
                    on = (tok_adv[tok].to(device) != 0) | keeps_all
                    log_ratio = (logp.detach() - old)[on]
                    stats["tokens"] += len(logp)
                    stats["policy_tokens"] += int(on.sum())
                    # tokens through the forward: each distinct context once (packed), then the completions
                    contexts = {tuple(b.context[i]) for i in mb}
                    stats["fwd_tokens"] += sum(map(len, contexts)) + sum(len(b.tokens[i]) for i in mb)
                    stats["clip_low"] += clip_low[on].float().sum().item()
                    stats["clip_high"] += clip_high[on].float().sum().item()
                    stats["approx_kl"] += (log_ratio.exp() - 1 - log_ratio).sum().item()
                    stats["entropy"] += entropy.detach()[on].sum().item()
                    stats["masked"] += 0 if mask is None else (mask[on] == 0).sum().item()
                    if ref is not None:  # k3, its log-ratio clamped to ±10 as in the loss
                        log_ratio_ref = (ref - logp.detach())[on].clamp(-10, 10)
                        stats["ref_kl"] += (log_ratio_ref.exp() - log_ratio_ref - 1).sum().item()
                    if epoch == 0:
                        stats["mismatch"] += (b.sampler_logp[tok].to(device) - old)[on].abs().sum().item()
                        stats["mismatch_tokens"] += int(on.sum())
            if not micro:  # nothing to train on: a zero gradient, so AdamW's step (momentum) is that of the full batch
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
            skipped = optimizer_step(model, optimizer, cfg, stats)
            stats["skipped"] += skipped
            stats["skipped_since_last_step"] = stats["skipped_since_last_step"] + 1 if skipped else 0
    return stats


def lr_factor(step: int, cfg: Config) -> float:
    """The learning rate at 0-based `step` as a fraction of --lr: a linear warm-up, constant, then a linear decay over
    the last --decay-steps steps (warmup-stable-decay; MiniCPM, arXiv 2404.06395 §4). The decay is our choice (the GRPO
    papers keep the rate constant): late in a short run greedy accuracy can move by several points from one update to
    the next, and small last updates end the run on its plateau (docs/benchmarks.md)."""
    warm = (step + 1) / cfg.warmup_steps if step < cfg.warmup_steps else 1.0
    left = cfg.steps - step  # steps left, this one included: 1 at the last
    return min(warm, left / (cfg.decay_steps + 1), 1.0)


def optimizer_step(model, optimizer, cfg, stats) -> bool:
    """Clip and step; a non-finite gradient norm (or one above --skip-grad-norm) skips the step instead.
    The norm is of the all-reduced gradient, so every rank decides the same. Returns True if skipped."""
    grad_norm = float(dist.local(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)))
    stats["last_grad_norm"] = grad_norm
    if not math.isfinite(grad_norm) or (cfg.skip_grad_norm > 0 and grad_norm > cfg.skip_grad_norm):
        dist.zero_grad(optimizer, model)
        return True
    optimizer.step()
    dist.zero_grad(optimizer, model)  # free the gradients now (one process, FSDP): sampling and evaluation need the memory
    stats["grad_norm"] += grad_norm
    stats["grad_norm_max"] = max(stats["grad_norm_max"], grad_norm)
    stats["opt_steps"] += 1
    return False


def step_metrics(b: Batch, correct, rewards, n_groups, n_zero_var, dropped, stats, times) -> dict:
    """The per-step metrics (one JSON line) for this rank; dist.reduce_metrics combines the ranks."""
    # the policy/ metrics are over the tokens the update trains (update's `on`); a step without any logs them null
    lengths, seen = b.lengths.float(), stats["policy_tokens"] or math.nan
    t0, t_sample, t_score, t_train = times
    return {
        "reward/mean": rewards.mean().item(), "reward/acc": correct.mean().item(),
        "reward/zero_var_groups": n_zero_var / max(n_groups, 1), "reward/groups_dropped": float(dropped),
        "reward/varied_rollouts": varied_share(b.group, rewards),
        "response/len_mean": lengths.mean().item(), "response/len_max": lengths.max().item(),
        "response/truncated": (~b.finished).float().mean().item(),
        "policy/entropy": stats["entropy"] / seen, "policy/clipfrac_low": stats["clip_low"] / seen,
        "policy/clipfrac_high": stats["clip_high"] / seen, "policy/approx_kl": stats["approx_kl"] / seen,
        "policy/ref_kl": stats["ref_kl"] / seen,
        "policy/sampler_logp_diff": stats["mismatch"] / max(stats["mismatch_tokens"], 1),
        "policy/masked_tokens": stats["masked"] / seen,
        "optim/grad_norm": stats["grad_norm"] / max(stats["opt_steps"], 1), "optim/grad_norm_max": stats["grad_norm_max"],
        "optim/skipped_steps": stats["skipped"],
        "perf/sampled_tokens": lengths.sum().item(), "perf/train_fwd_tokens": stats["fwd_tokens"],
        "perf/sample_tok_s": lengths.sum().item() / (t_sample - t0),
        "perf/train_tok_s": stats["tokens"] / max(t_train - t_score, 1e-9),
        "perf/sample_s": t_sample - t0, "perf/score_s": t_score - t_sample, "perf/train_s": t_train - t_score,
        "perf/step_s": t_train - t0, "perf/peak_rss_gb": peak_rss_gb(),
    }


# Ranks' metrics are averaged, except these: totals are summed, maxima maxed. (optim/skipped_steps is averaged: every
# rank skips the same steps, judged on the gradient norm after the all-reduce.)
METRIC_SUMS = ("reward/groups_dropped", "perf/sampled_tokens", "perf/train_fwd_tokens", "perf/sample_tok_s",
               "perf/train_tok_s", "response/overlong_masked")
METRIC_MAXES = ("response/len_max", "optim/grad_norm_max", "perf/peak_rss_gb", "perf/sample_s", "perf/score_s", "perf/train_s", "perf/step_s")


# ---------------------------------------------------------------------------------------- main loop

def main(argv=None):
    cfg = parse(Config, argv)
    check(cfg.device != "cuda" or torch.cuda.is_available(), "device", "cpu or auto: this machine has no CUDA GPU")
    device = dist.setup(cfg.device)
    validate(cfg)
    # runs/<run-name>/, and with --resume its newest checkpoint and trainer state (the RNG states restored)
    run_dir, ckpt_dir, ckpt, state = checkpoint.open_run(cfg)
    if state is not None:
        check_resume(cfg, state["extra"].get("config", {}))
    torch.manual_seed(cfg.seed)

    # data first: a bad task or data line fails before the model is loaded
    train = load_task(cfg.task, "train", n=cfg.train_size or None, seed=cfg.seed)
    # the same held-out problems for every seed (seed 0 draws them), so runs of different seeds compare directly
    held_out = load_task(cfg.task, "test", n=cfg.eval_size, seed=0)[: cfg.eval_size]
    tok = Tokenizer.from_pretrained(cfg.model)
    dtype = compute_dtype(device, cfg.dtype)
    model = Transformer.from_pretrained(ckpt or cfg.model, device=device)  # fp32 master weights
    check_context(model, tok, train + held_out, cfg)
    model.gradient_checkpointing = cfg.grad_checkpointing
    ref_model = None
    if cfg.kl_coef > 0:  # the reference exists only when used; fp32 under autocast, scored as the policy is
        ref_model = Transformer.from_pretrained(cfg.model, device=device).eval().requires_grad_(False)
    priors = PriorWeights(cfg, model, tok, device, dtype)  # π_RL samples alongside the rollout copy, in its dtype
    was = state["extra"]["eapo"].get("prior_fingerprint") if state else None  # absent in checkpoints before 2026-11-28
    same = lambda now: all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(was, now))  # noqa: E731
    check(was is None or any(map(same, priors.fingerprints)), "prior",
          f"the π_RL of the run being resumed: {cfg.prior} now holds other weights")
    # With bf16 compute (or FSDP2) rollouts come from a whole copy of the weights in that dtype, refreshed after each
    # update (sampling is memory-bound: bf16 weights read half the bytes; FSDP2's sharded weights cannot sample);
    # in fp32 on one process the model samples itself.
    separate = dtype != torch.float32 or (cfg.fsdp and dist.is_distributed())
    rollout = copy.deepcopy(model).to(dtype).requires_grad_(False) if separate else model
    policy = dist.wrap(model, fsdp=cfg.fsdp)  # DDP, FSDP2, or the model itself
    # AdamW's fused kernel, one pass over the weights per step, without torch.optim's imports (common/optim.py)
    optimizer = adamw(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                      weight_decay=cfg.weight_decay, sharded=cfg.fsdp)
    start_step = state["step"] if state else 0
    if state is not None:
        dist.load_optimizer_state(model, optimizer, state["optimizer"])
    if dist.is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(run_dir, enabled=dist.is_main(), resume_step=start_step if ckpt else None, total_steps=cfg.steps,
                     tracker=cfg.tracker, config=asdict(cfg), run_name=cfg.run_name)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    B, G = cfg.prompts_per_step // dist.world(), cfg.group_size  # this rank's prompts per step
    # our choice (the paper's split is not public): G_e = G / 4, at least 1. π_RL decodes alongside every augmented
    # completion, so G_e sets EAPO's extra sampling work (eapo/prior_tokens): a quarter of the policy's rows for the
    # first T steps (a half would double it); the other completions are every group's on-policy anchor
    G_e = max(1, G // 4) if cfg.augmented < 0 else cfg.augmented
    eval_kw = dict(samples=cfg.eval_samples, temperature=cfg.temperature, top_p=cfg.top_p,
                   max_new_tokens=max(cfg.eval_max_new_tokens, cfg.max_new_tokens))
    # the streak of skipped optimizer steps goes on across a resume, as in an uninterrupted run
    t_start, first_acc, skipped_in_a_row = time.time(), None, state["extra"].get("skipped_in_a_row", 0) if state else 0
    if start_step == 0:
        with autocast:
            first = evaluate(rollout, tok, held_out, seed=cfg.seed, **eval_kw)
        first_acc = first["eval/greedy_acc"]
        log.log(0, first)
    elif evaluation_lost(log, start_step, cfg):  # the run stopped in the evaluation after its last checkpoint
        with autocast:
            last = evaluate(rollout, tok, held_out, seed=cfg.seed, **eval_kw)
        log.log(start_step, last)
    tau = cfg.tau if cfg.tau >= 0 else state["extra"]["eapo"]["tau"] if state else None
    if tau is None:  # EAPO's τ is swept per model; we calibrate it on the starting policy (a quantile)
        problems = step_prompts(train, 1, cfg.prompts_per_step, cfg.seed)  # all of them: one τ on every rank
        with torch.no_grad(), autocast:
            tau = calibrate(rollout, [tok.prompt(format_question(p)) for p in problems], cfg, tok, cfg.seed + 17)
        tau = dist.all_gather_list([tau])[0]  # rank 0's: GPU sampling need not be bitwise the same on every rank

    for step in range(start_step + 1, cfg.steps + 1):
        # ---- 1. sample: G completions for each of this rank's B prompts, from the current policy
        t0 = time.time()
        problems = dist.shard(step_prompts(train, step, cfg.prompts_per_step, cfg.seed))
        contexts = [tok.prompt(format_question(p)) for p in problems]
        # a rank draws from seed, seed + 1 and seed + 2 (the policy, π_RL's mix, the ordinary call): so on one process
        # the policy's draws are grpo.py's; under torchrun a rank > 0's are not (grpo.py's rank r uses seed + r)
        seed = cfg.seed * 1_000_003 + step * 1009 + 3 * dist.rank()
        lam = injection_prob(step - 1, cfg.lam0, cfg.anneal_steps, cfg.schedule)  # k = step - 1: λ_0 at step 1
        aug_rows = augmented_rows(B, G, G_e) if lam > 0 else []
        mix = PriorMix(lam, tau, cfg.temperature, seed + 1, device)  # π_RL's tokens at critical points
        with torch.no_grad(), autocast:
            groups = rollouts(rollout, priors, mix, contexts, G, G_e if aug_rows else 0, cfg, tok.stop_ids, seed)
        b = to_batch(contexts, groups, [p.answer for p in problems], group_ids=range(B))
        aug = torch.zeros(len(b.tokens), dtype=torch.bool)  # [N] augmented completions
        aug[aug_rows] = True
        t_sample = time.time()

        # ---- 2. rewards; DAPO's dynamic sampling drops groups whose rewards are all equal (A ≡ 0)
        correct, rewards = verify(b, tok, cfg)  # [N]
        n_groups = int(b.group.max()) + 1
        zero_var = ~varied_groups(rewards, b.group, n_groups)  # [groups]
        keep = ~zero_var[b.group] if cfg.dynamic_sampling else torch.ones(len(rewards), dtype=torch.bool)
        b_all, correct_all, rewards_all = b, correct, rewards
        keep_tok = keep.repeat_interleave(b.lengths)  # [n_tok]
        b, rewards, correct, aug_all, aug = b.select(keep), rewards[keep], correct[keep], aug, aug[keep]

        # ---- 3. score: the trainer's log-probs of the batch before any update: π_old when μ·M > 1 (with μ = M = 1
        # the update's own detached forward is π_old), π_ref with --kl-coef; before advantages, which some variants
        # base on them
        old_logp = ref_logp = None
        if cfg.epochs * cfg.mini_batches > 1:
            old_logp, _ = trainer_logprobs(model, b, cfg.micro_batch, cfg.temperature, tok.pad_id, device, autocast)
        if ref_model is not None:
            ref_logp, _ = trainer_logprobs(ref_model, b, cfg.micro_batch, cfg.temperature, tok.pad_id, device, autocast)
        t_score = time.time()

        # ---- 4. advantages: group-relative, one per completion, broadcast to its tokens
        adv = group_advantages(rewards, b.group, cfg.adv_norm)  # [N]
        if cfg.overlong_mask:  # DAPO §3.4, overlong filtering: a completion cut at the budget keeps its reward in its
            # group's advantages but gets no loss tokens (all of it is skipped)
            b = replace(b, skip=torch.where(b.finished, b.skip, b.lengths))
        if cfg.pos_only:  # after the advantages, which see the whole group; out of every denominator too
            b.skip = torch.where(pos_only_dropped(correct, aug), b.lengths, b.skip)

        # ---- EAPO's adapted importance weight ω (is_weights), from the π_old and μ the sampler drew each token with.
        # our choice: the sampler's numbers, not a rescoring by the trainer: π_old / μ is then the exact ratio of
        # the distributions that drew the tokens, and no extra forward is needed (grpo.py skips it with μ = M = 1);
        # the sampling copy's own mismatch to the trainer is --tis-cap's, as in grpo.py
        prior_tok, omega, loss_kw = {}, None, None  # the sampler's per-token values of the kept completions
        if aug_rows:
            prior_tok = flat_extras(groups, keep_tok)
            prior_tok["aug"] = aug.repeat_interleave(b.lengths)
            seq_ids = torch.arange(len(b.tokens)).repeat_interleave(b.lengths)  # [n_tok] each token's completion
            cap = cfg.seq_cap if cfg.is_level == "sequence" else cfg.omega_cap
            omega = is_weights(prior_tok["old_logp"], prior_tok["mu_logp"], cfg.is_level, cap, seq_ids)
            loss_kw = {"weights": omega}

        # ---- 5. update: μ epochs x M mini-batches of clipped policy-gradient steps, then refresh the sampler
        for param_group in optimizer.param_groups:  # this step's rate: warm-up, constant, then decay (lr_factor)
            param_group["lr"] = cfg.lr * lr_factor(step - 1, cfg)
        stats = update(policy, model, optimizer, b, adv, cfg, tok.pad_id, device, autocast, old_logp, ref_logp,
                       loss_kw)
        # optimizer steps skipped since the last one taken, counting earlier training steps' when this one took none
        skipped_in_a_row = int(stats["skipped_since_last_step"]) + (skipped_in_a_row if stats["opt_steps"] == 0 else 0)
        if skipped_in_a_row >= cfg.max_skipped:  # a diverged run: stop before it wastes more time
            raise RunError(f"step {step}: {skipped_in_a_row} optimizer steps in a row skipped for a non-finite or too "
                           f"large gradient norm (last {stats['last_grad_norm']:.3g}); lower --lr. "
                           f"{checkpoint.kept(ckpt_dir)}")
        dist.sync_rollout(model, rollout)
        t_train = time.time()

        # ---- 6. log, save, evaluate
        metrics = step_metrics(b_all, correct_all, rewards_all, n_groups, zero_var.sum().item(), zero_var.sum().item()
                               if cfg.dynamic_sampling else 0, stats, (t0, t_sample, t_score, t_train))
        metrics["optim/lr"] = optimizer.param_groups[0]["lr"]
        metrics["response/overlong_masked"] = float(cfg.overlong_mask) * (~b.finished).sum().item()
        metrics.update(eapo_metrics(lam, tau, groups, aug_all, correct_all, prior_tok, omega))
        # means over completions and trained tokens weigh each rank by its count (XRPO's ranks hold different ones)
        counts = {"reward/": len(b_all.tokens), "response/": len(b_all.tokens), "reward/zero_var_groups": n_groups,
                  "policy/": stats["policy_tokens"]}
        # EAPO's ratios: over augmented tokens (eligible_share: all tokens), its accuracies over their completions
        # (λ and τ are the step's, the same on every rank: weight 1, so that they stay defined once λ = 0)
        counts.update({"eapo/": int(b_all.lengths[aug_all].sum()), "eapo/eligible_share": int(b_all.lengths.sum()),
                       "eapo/acc_augmented": int(aug_all.sum()), "eapo/acc_ordinary": int((~aug_all).sum()),
                       "eapo/lambda": 1, "eapo/tau": 1})
        log.log(step, dist.reduce_metrics(metrics, weights=counts, sums=METRIC_SUMS + EAPO_SUMS,
                                          maxes=METRIC_MAXES + EAPO_MAXES))
        if step % cfg.save_every == 0 or step == cfg.steps:
            checkpoint.save_run(model, optimizer, ckpt_dir, step, cfg, extra={"skipped_in_a_row": skipped_in_a_row,
                                 "eapo": {"tau": tau, "prior_fingerprint": priors.fingerprint}})
        if step == cfg.steps:  # saved, and no update follows: AdamW's two moments (twice the weights' memory)
            optimizer.state.clear()  # need not be held through the last evaluation
        if step % cfg.eval_every == 0 or step == cfg.steps:
            with autocast:
                last = evaluate(rollout, tok, held_out, seed=cfg.seed, **eval_kw)
            log.log(step, last)

    if dist.is_main() and cfg.steps > start_step:
        before = f"{first_acc:.3f} → " if first_acc is not None else "(resumed) "
        print(f"done: greedy accuracy {before}{last['eval/greedy_acc']:.3f} on {len(held_out)} held-out problems, "
              f"{cfg.steps - start_step} step{'s' * (cfg.steps - start_step != 1)} in {_minutes(time.time() - t_start)}; "
              f"metrics {run_dir / 'metrics.jsonl'}, checkpoint {ckpt_dir}")
    elif dist.is_main():
        print(f"nothing to train: {run_dir} has trained {start_step} steps (--steps {cfg.steps}); raise --steps to go on")
    log.close()
    dist.cleanup()


def _minutes(seconds):
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


if __name__ == "__main__":
    main_guard(main)
