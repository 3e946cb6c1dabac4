"""GRPO: group-relative policy optimisation from verifiable rewards. The baseline; every other algorithm
file repeats this loop and changes only what makes it different (`diff grpo.py exgrpo.py`).

    python grpo.py                                   # SmolLM2-135M-Instruct on generated arithmetic, 2-core CPU
    python grpo.py --steps 2 --run-name smoke        # any option: python grpo.py --help
    python grpo.py --run-name NAME --resume          # continue a run from its last checkpoint
    torchrun --nproc_per_node=8 grpo.py --model Qwen2.5-Math-1.5B --task math500 ...   # see README

One step: sample G completions for each of B prompts, reward them with the verifier, turn rewards into
group-relative advantages, then run μ epochs of clipped policy-gradient updates over M mini-batches.
Sources: DeepSeekMath (GRPO, arXiv 2402.03300 §4.1), DAPO (clip-higher, token-level loss, dynamic sampling;
arXiv 2503.14476 §3), Dr. GRPO (no std, a constant normaliser; arXiv 2503.20783 §3.1), GSPO (sequence-level
ratio; arXiv 2507.18071 §4), and truncated importance sampling against the sampler (Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training").

The step is a flat batch of completions, each with its own context (the token ids it was sampled from), a group
id (groups may differ in size) and a count of leading completion tokens that get no loss. GRPO uses one group of
G per prompt and excludes tokens only with --overlong-mask (all of a truncated completion's); the variants use the
rest.

The GRPO-family options that other frameworks offer are flags here, all off by default: DAPO's dynamic
sampling with refill and overlong handling, CISPO, masking of sampler/trainer mismatch (IcePop, DeepSeek-V3.2),
training on the high-entropy tokens only; docs/grpo.md lists them. Left out on purpose: value models.
"""
import copy
import math
import time
from dataclasses import asdict, dataclass, replace

import torch

from common import checkpoint, dist
from common.batch import Batch, completion_logprobs, concat, micro_batches, to_batch, token_index, trainer_logprobs, varied_share
from common.config import RunError, check, main_guard, parse
from common.evaluate import evaluate, evaluation_lost
from common.logger import MetricsLog, check_tracker
from common.memory import peak_rss_gb
from common.model import Transformer, compute_dtype
from common.optim import adamw
from common.options import high_entropy, overlong_penalty, token_mask
from common.sampler import generate
from common.tasks import format_question, load_task
from common.tokenizer import Tokenizer
from common.verifier import extract_answer, score
from kernels import policy_loss
from kernels.reference import sequence_mean


@dataclass
class Config:
    # run
    run_name: str = ""  # writes runs/<run-name>/; empty = grpo-<date-time>
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
    refill_rounds: int = 0  # with --dynamic-sampling: up to N more rounds of B prompts to refill B varied groups (DAPO)
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

    choices = {"adv_norm": ["std", "none"], "loss_agg": ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
               "device": ["auto", "cpu", "cuda"], "dtype": ["auto", "float32", "bfloat16"],
               "loss_type": ["clip", "cispo"], "tis_mode": ["token-truncate", "token-mask", "sequence-truncate", "sequence-mask"],
               "tracker": ["none", "tensorboard", "wandb", "trackio"]}


# Options a resumed run must share with the run it continues: they fix the data order and the model.
RESUME_FIXED = ("seed", "task", "train_size", "prompts_per_step", "model")


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
    check(cfg.refill_rounds == 0 or cfg.refill_rounds > 0 and cfg.dynamic_sampling, "refill_rounds",
          "0, or a positive count with --dynamic-sampling (which drops the groups to refill)")
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


def check_resume(cfg: Config, saved: dict):
    """A resumed run must see the data and model the checkpoint was trained on."""
    for name in RESUME_FIXED:
        check(saved.get(name, getattr(cfg, name)) == getattr(cfg, name), name,
              f"{saved.get(name)!r} as in the run being resumed (changing it changes the data order or the model)")


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


def refill(rollout, tok, train, step, b: Batch, rewards, cfg, autocast):
    """DAPO's dynamic sampling with its refill (arXiv 2503.14476 §3.2, Algorithm 1): while the batch holds fewer than
    B groups with varied rewards, sample G completions of B more prompts and keep their varied groups, for at most
    --refill-rounds rounds; the surplus of the last round is dropped, as DAPO does. b, rewards: the step's varied
    groups. Our choice: the further prompts are a seeded draw from the training set, a function of (seed, step,
    round) as step_prompts is, so that a resumed run refills as an uninterrupted one and the data order stays; drawn
    with replacement, so a round may repeat a prompt. Also ours: rounds that run out short leave the step training on
    the varied groups it has (reward/groups_refilled says how many came; verl's DAPO recipe stops with an error).
    Returns the batch, its rewards, the groups added and the rounds sampled."""
    B, G, have, added, rounds = cfg.prompts_per_step, cfg.group_size, len(b.group.unique()), 0, 0
    while have < B and rounds < cfg.refill_rounds:
        rounds += 1
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + step * 1009 + rounds)
        problems = [train[int(i)] for i in torch.randint(len(train), (B,), generator=gen)]
        contexts = [tok.prompt(format_question(p)) for p in problems]
        with torch.no_grad(), autocast:
            groups = generate(rollout, contexts, n=G, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                              top_p=cfg.top_p, stop_ids=tok.stop_ids, seed=cfg.seed * 1_000_003 + step * 1009 + 7919 * rounds)
        more = to_batch(contexts, groups, [p.answer for p in problems], group_ids=range(B))
        _, more_rewards = verify(more, tok, cfg)
        taken = varied_groups(more_rewards, more.group, B).nonzero()[:, 0][:B - have]  # the first groups that vary
        keep = torch.isin(more.group, taken)
        more = more.select(keep)
        more.group += rounds * B  # ids distinct from the groups already in the batch
        b, rewards = concat(b, more), torch.cat([rewards, more_rewards[keep]])
        have, added = have + len(taken), added + len(taken)
    return b, rewards, added, rounds


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

    for step in range(start_step + 1, cfg.steps + 1):
        # ---- 1. sample: G completions for each of this rank's B prompts, from the current policy
        t0 = time.time()
        problems = dist.shard(step_prompts(train, step, cfg.prompts_per_step, cfg.seed))
        contexts = [tok.prompt(format_question(p)) for p in problems]
        with torch.no_grad(), autocast:
            groups = generate(rollout, contexts, n=G, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                              top_p=cfg.top_p, stop_ids=tok.stop_ids, seed=cfg.seed * 1_000_003 + step * 1009 + dist.rank())
        b = to_batch(contexts, groups, [p.answer for p in problems], group_ids=range(B))
        t_sample = time.time()

        # ---- 2. rewards; DAPO's dynamic sampling drops groups whose rewards are all equal (A ≡ 0)
        correct, rewards = verify(b, tok, cfg)  # [N]
        n_groups = int(b.group.max()) + 1
        zero_var = ~varied_groups(rewards, b.group, n_groups)  # [groups]
        keep = ~zero_var[b.group] if cfg.dynamic_sampling else torch.ones(len(rewards), dtype=torch.bool)
        b_all, correct_all, rewards_all = b, correct, rewards
        b, rewards = b.select(keep), rewards[keep]
        refilled = rounds = 0
        if cfg.refill_rounds:  # DAPO Alg. 1: sample further prompts until B groups have varied rewards
            # (the reward/ and response/ metrics describe b_all, the first round; the refill's time is perf/score_s's)
            b, rewards, refilled, rounds = refill(rollout, tok, train, step, b, rewards, cfg, autocast)

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

        # ---- 5. update: μ epochs x M mini-batches of clipped policy-gradient steps, then refresh the sampler
        for param_group in optimizer.param_groups:  # this step's rate: warm-up, constant, then decay (lr_factor)
            param_group["lr"] = cfg.lr * lr_factor(step - 1, cfg)
        stats = update(policy, model, optimizer, b, adv, cfg, tok.pad_id, device, autocast, old_logp, ref_logp)
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
        metrics.update({"reward/groups_refilled": refilled, "reward/refill_rounds": rounds})
        # means over completions and trained tokens weigh each rank by its count (XRPO's ranks hold different ones)
        counts = {"reward/": len(b_all.tokens), "response/": len(b_all.tokens), "reward/zero_var_groups": n_groups,
                  "policy/": stats["policy_tokens"]}
        log.log(step, dist.reduce_metrics(metrics, weights=counts, sums=METRIC_SUMS, maxes=METRIC_MAXES))
        if step % cfg.save_every == 0 or step == cfg.steps:
            checkpoint.save_run(model, optimizer, ckpt_dir, step, cfg, extra={"skipped_in_a_row": skipped_in_a_row})
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
