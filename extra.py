"""ExTra: exploratory trajectory optimisation (Hu et al., arXiv 2606.24994). GRPO plus two exploration
signals taken from the policy's own rollouts; read it against grpo.py (`diff grpo.py extra.py`).

    python extra.py                                  # SmolLM2-135M-Instruct on generated arithmetic, 2-core CPU
    python extra.py --steps 2 --run-name smoke       # any option: python extra.py --help
    python extra.py --run-name NAME --resume         # continue a run from its last checkpoint
    python extra.py --no-novelty --no-regen          # the host alone: GRPO with ExTra's loss settings
    python extra.py --model Qwen3-1.7B --task dapo_math_17k.jsonl --train-size 0 --kl-coef 0.001 ...   # docs/extra.md

(i) Novelty bonus (§3.1): each rollout's response tail is embedded; its novelty d is the cosine distance to its
nearest neighbour among the prompt's last H rollouts and its siblings (0 until the memory holds G of them). Correct
rollouts get α·d added to their GRPO advantage after the group normalisation, so all-correct groups still get a
signal that prefers diverse answers.
(ii) Entropy-guided prefix regeneration (§3.2): for hard prompts (at most one correct of G), the most confident
rollout is cut at line breaks; each prefix is scored by its mean token entropy (MTE, low = promising), smoothed
over similar stored prefixes; prompt ++ the best prefix is queued and rolled out later as its own group, so the
policy practises finishing from a promising partial solution. The prefix is context: it gets no loss.
The host: grpo.py with its defaults but a training pool of 48 (the memories need prompts to come back; grpo.py's
--train-size 2000 for its pool), plus ExTra's dual clip (c = 10) in token_loss (like the PPO clip, it acts only
off-policy: with --mini-batches or --epochs above 1, as the recipe's 2 mini-batches; at the defaults every ratio is 1).
The paper's recipe also has a k3 KL of 0.001 to the initial model (--kl-coef 0.001); not a default, so that the
comparison with grpo.py is on equal terms.

Left out: the authors' code embeds with a separate sentence encoder (all-MiniLM-L6-v2, 6 blocks); here the initial
policy's first 6 blocks, frozen, stand in for it (--encoder-blocks; mean-pooled normed hidden states, centred on the
mean embedding of the training problem statements; no second model to download). Under torchrun the memories would
be per rank, so the mechanisms refuse to run there (the host alone runs). Also left out: grpo.py's --refill-rounds
(guided rows and hard-prompt bookkeeping assume B groups of G) and --loss-type cispo (the dual clip bounds PPO's
clipped surrogate). The rest as in grpo.py.

Ablations, as switches: each component off or varied alone. The paper's ablation settings are not public; these
are the ablations in the authors' scripts (curiosity only, regeneration only, α and τ sweeps, a later
warm-up) and the two forms of the bonus their code offers:
    --no-regen                    novelty bonus only (the recipe's "curiosity only")
    --no-novelty                  prefix regeneration only
    --no-novelty --no-regen       the host: GRPO with the dual clip (and --dual-clip 0: grpo.py's loss exactly)
    --novelty-mode before         Option A: the bonus joins the reward before the normalisation (the authors' code's
                                  default, α = 0.01 in their released script; the abstract's form is B, ours)
    --alpha 0.05, --alpha 0.2     the bonus scale (paper: 0.1)
    --tau 1.0, --tau 0            broader prefix-score smoothing; none (the raw MTE's argmin)
    --regen-warmup 200            the authors' later warm-up (their recipe: 30 of 300; with --steps 15: never)
    --no-cuttable-only            the authors' rule: cut only the most confident rollout, even without a line break
"""
import copy
import math
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from common import checkpoint, dist
from common.batch import Batch, completion_logprobs, micro_batches, to_batch, token_index, trainer_logprobs, varied_share
from common.config import RunError, check, main_guard, parse
from common.embed import embed
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
    run_name: str = ""  # writes runs/<run-name>/; empty = extra-<date-time>
    resume: bool = False  # continue runs/<run-name>/ from its last checkpoint
    seed: int = 0  # seeds data order, sampling and init; same seed on the same CPU = same run
    device: str = "auto"  # auto (cuda if available), cpu or cuda
    dtype: str = "auto"  # matmul dtype: auto (bf16 on GPUs and CPUs with bf16 units, else float32), float32, bfloat16
    # model and data
    model: str = "smollm2"  # Hugging Face folder (Llama / Qwen2 / Qwen3) or smollm2 (offline default)
    task: str = "arith"  # arith (generated), gsm8k, math500, aime24, amc23, or a .jsonl file
    # our choice: few problems, so that 16 x 15 draws visit each 5 times (novelty needs a prompt's earlier answers)
    train_size: int = 48  # training problems (of a data file a sample; 0 = all); 48: each seen ~5 times, for memories
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
    dual_clip: float = 10.0  # c: for A < 0 the loss is at most c·|A| (dual-clip PPO, as ExTra's verl recipe); 0 = off
    kl_coef: float = 0.0  # β: k3 KL to the initial model; 0 loads no reference model (paper recipe: 0.001)
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
    # ExTra (i): novelty bonus, §3.1
    novelty: bool = True  # add an embedding-novelty bonus to correct rollouts
    novelty_mode: str = "after"  # after: α·d joins the advantage after normalisation (paper); before: the reward
    alpha: float = 0.1  # α: bonus per unit of cosine distance
    novelty_lambda: float = 1.0  # λ: "before" mode damps the bonus by exp(-λ·v̄), v̄ = EMA of the prompt's reward variance
    # H: rollout embeddings remembered per prompt, at least group_size or novelty never starts (the authors' released
    # recipe: 2G = 16; their paper runs: G = 6)
    memory_size: int = 16
    tail_tokens: int = 512  # a rollout is embedded from its last this many tokens ...
    embed_tokens: int = 256  # ... of which the first this many (their encoder reads at most 256 word pieces)
    # the first this many blocks of the frozen start model embed a text (0, or more than it has: all). The authors'
    # encoder, all-MiniLM-L6-v2, has 6 blocks and 22M parameters; SmolLM2-135M's first 6 hold 21M (outside the
    # embedding table) and cost a fifth of all 30 (load_encoder)
    encoder_blocks: int = 6
    # ExTra (ii): entropy-guided prefix regeneration, §3.2
    regen: bool = True  # queue prompt ++ prefix of hard prompts' most confident rollouts as new groups
    regen_warmup: int = 2  # steps before regeneration starts (ExTra recipe: 30 of 300); nothing stored, queued or injected
    regen_rows: int = 1  # guided prompts per step, replacing the batch's last rows (recipe: 16 of 512 = 3%; here 1 of 16)
    queue_size: int = 8  # guided prompts waiting for a batch; on overflow the oldest go (ExTra recipe: 512)
    boundary_gap: int = 8  # least tokens between cut points (ExTra recipe: 32, for answers of thousands of tokens)
    max_prefixes: int = 15  # cut points per rollout, spread evenly
    prefix_memory: int = 128  # prefixes remembered per prompt
    tau: float = 0.1  # τ: temperature of the similarity smoothing of prefix scores; 0 = no smoothing (raw MTE)
    cuttable_only: bool = True  # cut the most confident rollout that has a line break (ExTra: the most confident)
    # clamp a guided row's advantages at 0: the authors' code after the paper (for their 8B runs), not in its results
    guided_positive_only: bool = False
    max_prompt_len: int = 2048  # guided prompts (prompt ++ prefix) are cut to this many tokens, head kept

    choices = {"adv_norm": ["std", "none"], "loss_agg": ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
               "device": ["auto", "cpu", "cuda"], "dtype": ["auto", "float32", "bfloat16"],
               "loss_type": ["clip", "cispo"], "tis_mode": ["token-truncate", "token-mask", "sequence-truncate", "sequence-mask"],
               "tracker": ["none", "tensorboard", "wandb", "trackio"],
               "novelty_mode": ["after", "before"]}


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
    check(cfg.loss_type == "clip", "loss_type", "clip (ExTra's dual clip bounds the clipped surrogate)")
    check(cfg.prompts_per_step // dist.world() * cfg.group_size >= cfg.mini_batches, "mini_batches",
          "at most the completions per step on each rank (prompts_per_step / world * group_size)")
    for name in ("memory_size", "tail_tokens", "embed_tokens", "boundary_gap", "max_prefixes", "prefix_memory",
                 "max_prompt_len"):
        check(getattr(cfg, name) > 0, name, "a positive integer")
    check(cfg.alpha >= 0 and cfg.novelty_lambda >= 0 and cfg.tau >= 0, "alpha/novelty_lambda/tau",
          "alpha >= 0, novelty_lambda >= 0 and tau >= 0")
    check(cfg.regen_rows >= 0 and cfg.queue_size >= 0 and cfg.regen_warmup >= 0, "regen_rows/queue_size/regen_warmup",
          "non-negative integers")
    check(cfg.dual_clip == 0 or cfg.dual_clip > 1, "dual_clip", "0 (off) or a number > 1")
    # novelty waits until the memory holds a group's worth of embeddings; a smaller memory never gets there
    check(not cfg.novelty or cfg.memory_size >= cfg.group_size, "memory_size", f"at least group_size ({cfg.group_size})")
    check(cfg.encoder_blocks >= 0, "encoder_blocks", "a number of blocks >= 0 (0 = all)")
    # the memories and the queue live in this process; ranks would each keep (and save) different ones
    check(dist.world() == 1 or not (cfg.novelty or cfg.regen), "novelty/regen",
          "a single process (under torchrun run the host alone: --no-novelty --no-regen)")


def check_resume(cfg: Config, saved: dict):
    """A resumed run must see the data and model the checkpoint was trained on."""
    for name in RESUME_FIXED:
        check(saved.get(name, getattr(cfg, name)) == getattr(cfg, name), name,
              f"{saved.get(name)!r} as in the run being resumed (changing it changes the data order or the model)")
    # and the encoder that embedded the memories (checkpoints from before the option embedded with all blocks: 0)
    was = saved.get("encoder_blocks", 0)
    check(was == cfg.encoder_blocks, "encoder_blocks",
          f"{was!r} as in the run being resumed (its memories were embedded with it)")


def check_context(model, tok, problems, cfg):
    """Prompt + completion must fit the model's positions; say so before anything is written."""
    longest = max(len(tok.prompt(format_question(p))) for p in problems)
    limit = model.cfg.max_position_embeddings
    check(longest + max(cfg.max_new_tokens, cfg.eval_max_new_tokens) <= limit, "max_new_tokens/eval_max_new_tokens",
          f"at most {limit - longest}: the longest prompt has {longest} tokens and the model {limit} positions")
    # ExTra: a guided prompt is a prompt ++ a prefix of one of its answers, cut to --max-prompt-len, then answered;
    # a guided row that is itself hard is cut again (prompt ++ prefix ++ prefix ...), so only the cut bounds it
    check(not cfg.regen or cfg.max_prompt_len + cfg.max_new_tokens <= limit, "max_prompt_len/max_new_tokens",
          f"a guided prompt ({cfg.max_prompt_len} tokens at most) and its answer within the model's {limit} positions")


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


# -------------------------------------------------------------------------------------------- loss

def token_loss(logp, old_logp, adv, entropy, cfg, ref_logp=None, **kw):
    """GRPO's per-token loss ℓ_t in one fused pass (kernels.policy_loss, a Triton kernel on a GPU; token_loss_plain
    below writes grpo.py's out, without the dual clip) with ExTra's dual clip on top, which tests/test_extra.py checks
    against the direct formula. logp, entropy [n] carry gradients; old_logp, adv, ref_logp [n] and kw (weights,
    GSPO's seq_ids, TIS's sampler_logp) are constants.
    ExTra's host adds the dual clip (Dual-clip PPO, Ye et al., arXiv 1912.09729; ExTra's verl recipe, c = 10): where
    A < 0 the surrogate is at most c·|A|. With c > 1 it binds exactly on tokens with A < 0 and r > c, where the
    surrogate is then the constant c·|A| (no gradient): those tokens get weight 0 in the fused call and the constant
    added.
    KL and entropy are untouched."""
    capped = dual_clipped(logp, old_logp, adv, cfg.dual_clip, kw.get("seq_ids"))  # [n] bool
    scale = kw.pop("weights", None)
    scale = torch.ones_like(adv) if scale is None else scale
    loss, clip_low, clip_high = policy_loss(logp, old_logp, adv, cfg.eps_low, cfg.eps_high, ref_logp=ref_logp,
                                            kl_coef=cfg.kl_coef, entropy=entropy, entropy_coef=cfg.entropy_coef,
                                            tis_cap=tis_cap(cfg, kw), weights=scale * ~capped, **kw)
    if "sampler_logp" in kw:  # the constant takes the surrogate's TIS factor too
        scale = scale * (old_logp - kw["sampler_logp"]).exp().clamp(max=cfg.tis_cap)
    return loss + cfg.dual_clip * adv.abs() * scale * capped, clip_low, clip_high


def dual_clipped(logp, old_logp, adv, c, seq_ids=None):
    """[n] bool: the tokens whose surrogate the dual clip caps, A < 0 and r > c (r: GSPO's sequence ratio with
    seq_ids); none when c = 0 (off)."""
    log_ratio = (logp - old_logp).detach()
    if seq_ids is not None:  # the ratio the fused loss uses: the sequence's mean log-ratio
        log_ratio = sequence_mean(log_ratio, seq_ids)
    return (adv < 0) & (log_ratio.exp() > c) if c else torch.zeros_like(adv, dtype=torch.bool)


def tis_cap(cfg, kw):
    """The fused loss's truncated-IS cap: --tis-cap when the update passed the sampler's log-probs (token-truncate)."""
    return cfg.tis_cap if kw.get("sampler_logp") is not None else None


def token_loss_plain(logp, old_logp, adv, entropy, cfg, ref_logp=None, weights=None, seq_ids=None, sampler_logp=None):
    """grpo.py's token_loss written out: the fused policy_loss call inside token_loss above, without the dual clip
    (tests/test_grpo.py checks the two equal). Returns ℓ [n] and where the clip cut the gradient (clipped_low,
    clipped_high [n])."""
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


# ------------------------------------------------------------- ExTra (i): the novelty bonus (ExTra §3.1)

def response_tail(tokens: list[int], special: set[int], tail: int, head: int) -> list[int]:
    """What a rollout's embedding reads: its last `tail` tokens without special ones (the stop token), then
    only the first `head` of those. Our choice: `head` mirrors the authors' encoder (all-MiniLM-L6-v2), which
    truncates its input at 256 word pieces, so the start of the tail is what gets embedded."""
    return [t for t in tokens if t not in special][-tail:][:head]


ROUNDING = 1e-3  # cosine distances at or below this are rounding, not novelty (unit rows, fp16 memory: up to ~1e-4)


def novelty(group_emb: torch.Tensor, memory: torch.Tensor, n: int) -> torch.Tensor:
    """Cosine distance of each rollout to its nearest neighbour among the prompt's remembered rollouts and
    its siblings, never itself. group_emb [G, d], memory [m, d], unit rows -> d [G] in [0, 2]. Zero for the
    whole group while the memory holds fewer than n embeddings: a prompt's first visit gets no bonus."""
    G, m = group_emb.shape[0], memory.shape[0]
    if m < n:
        return torch.zeros(G)
    cos = group_emb @ torch.cat([memory, group_emb]).T  # [G, m + G]
    cos[torch.arange(G), m + torch.arange(G)] = float("-inf")  # a rollout is not its own neighbour
    d = 1 - cos.max(dim=1).values
    # an exact repeat has d = 0 (§3.1); rounding (fp32 products, the fp16 memory) leaves it up to ~1e-4, which the
    # bonus share and --dynamic-sampling's zero-advantage test would count as novel: distances that small are 0
    d = torch.where(d > ROUNDING, d, 0.0)
    return d * (group_emb.norm(dim=1) > 0)  # an empty answer embeds to the zero vector: not novel either


def remember(memory: torch.Tensor, group_emb: torch.Tensor, H: int) -> torch.Tensor:
    """The prompt's FIFO of its last H rollout embeddings, correct or not: [m, d] -> [min(m + G, H), d]."""
    return torch.cat([memory, group_emb])[-H:]


def positive_on_guided(adv, group, guided):
    """A guided row's completions keep their positive advantages and lose their negative ones (the authors' code
    after the paper, commit 0e97a40: failed continuations of an off-distribution prefix pushed their 8B policy away
    from what it still writes at evaluation). adv, group [N]; guided [B] bool, by group id."""
    return torch.where(guided[group], adv.clamp(min=0), adv)


def bonus_after_norm(adv, correct, d, alpha):
    """Option B (ExTra abstract: the bonus comes 'after GRPO normalization'): correct rollouts get α·d on top
    of their advantage, so an all-correct group (A = 0) still prefers its unusual answers. Shapes [N]."""
    return adv + alpha * d * (correct > 0)


def bonus_before_norm(rewards, correct, d, alpha, var_ema, lam):
    """Option A (the authors' code's default, which it calls legacy; the abstract describes B): α·d joins the
    reward of correct rollouts before the group normalisation, d scaled to the group's largest novelty and damped
    by exp(-λ·v̄), v̄ = var_ema, the EMA of the prompt's reward variance (a prompt whose rewards already vary needs
    less push). Shapes [G]."""
    top = d.max()
    d = d / top if top > 1e-8 else d
    return rewards + alpha * d * math.exp(-lam * var_ema) * (correct > 0)


def zero_advantage_groups(rewards, correct, d, group, n_groups: int, mode: str) -> torch.Tensor:
    """[n_groups] bool: the groups whose advantages are all 0, which DAPO's dynamic sampling drops: equal rewards,
    and with Option B ("after") no correct member paid a bonus (an all-correct group's only signal is α·d)."""
    zero = ~varied_groups(rewards, group, n_groups)
    if mode == "after":
        zero[group[(d > 0) & (correct > 0)]] = False
    return zero


def update_var_ema(ema: dict, key, rewards: torch.Tensor, weight: float = 0.1) -> float:
    """v̄_x ← (1 - w) v̄_x + w Var(r_x) (population variance), starting at the first value; returns v̄_x."""
    v = rewards.var(unbiased=False).item()
    ema[key] = v if key not in ema else (1 - weight) * ema[key] + weight * v
    return ema[key]


# ----------------------------------------- ExTra (ii): entropy-guided prefix regeneration (ExTra §3.2)

def is_hard(correct: torch.Tensor) -> torch.Tensor:
    """correct [B, G] -> [B] bool: at most one correct rollout (pass rate <= 1/G)."""
    return correct.sum(dim=1) <= 1


def newline_ids(tok) -> set[int]:
    """Ids that are a line break and nothing else: '\\n' and '\\n\\n' when each is one token, and any id
    below 1000 decoding to exactly '\\n'. Merged tokens such as '.\\n\\n' mark no boundary."""
    ids = {i for i in range(min(1000, tok.vocab_size)) if tok.decode([i]) == "\n"}
    for text in ("\n", "\n\n"):
        if len(enc := tok.encode(text)) == 1:
            ids.add(enc[0])
    return ids


def prefix_cuts(tokens: list[int], nl_ids: set[int], min_gap: int, max_cuts: int = 15) -> list[int]:
    """Cut points b (prefix = tokens[:b]) right after line breaks: the first one, then each at least min_gap
    tokens after the last kept (the authors' merge of close splits), the last dropped when there are several (the
    answer follows it; little is left to explore), then at most max_cuts spread evenly."""
    cuts = []
    for b in (i + 1 for i, t in enumerate(tokens) if t in nl_ids):
        if not cuts or b - cuts[-1] >= min_gap:
            cuts.append(b)
    if len(cuts) > 1:
        cuts = cuts[:-1]
    if len(cuts) > max_cuts:
        cuts = [cuts[i * len(cuts) // max_cuts] for i in range(max_cuts)]
    return cuts


def prefix_mte(entropies: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """Mean token entropy (MTE) of each prefix, mean(H_0 .. H_{b-1}) per cut b: entropies [L] -> [len(cuts)].
    Low MTE = the policy was confident along the way; the authors' code continues from the lowest."""
    csum = torch.cat([torch.zeros(1, dtype=torch.float64), entropies.double().cumsum(0)])
    b = torch.tensor(cuts, dtype=torch.long)
    return (csum[b] / b).float()


def select_prefix(emb: torch.Tensor, mte: torch.Tensor, tau: float) -> int:
    """The stored prefix with the lowest similarity-smoothed MTE, m̃ = softmax(E Eᵀ / τ) m: a prefix wins
    with its neighbours, not alone. emb [k, d], mte [k] -> index (the first, i.e. oldest, on ties).
    τ = 0: no smoothing, the raw MTE's argmin (an ablation switch of ours)."""
    if tau == 0:
        return int(torch.argmin(mte))
    e = F.normalize(emb.float(), dim=-1)
    smoothed = torch.softmax(e @ e.T / tau, dim=1) @ mte.float()  # [k]
    return int(torch.argmin(smoothed))


def guided_context(prompt: list[int], prefix: list[int], max_len: int) -> list[int]:
    """A guided prompt: the prompt followed by the chosen prefix, cut to max_len tokens keeping the head."""
    return (list(prompt) + list(prefix))[:max_len]


def push_queue(queue: list, items: list, max_size: int) -> list:
    """FIFO of guided prompts waiting for a batch; on overflow the oldest go."""
    return (queue + items)[-max_size:] if max_size > 0 else []


def inject(contexts: list, answers: list, queue: list, k: int):
    """Replace the last k rows of the step's batch by the k oldest queued guided prompts, each graded against
    its own problem's answer (carried in the queue; the official code keeps the replaced row's answer, a bug).
    Returns (contexts, answers, guided [B] bool, the rest of the queue)."""
    k = min(k, len(queue), len(contexts))
    B = len(contexts)
    items, rest = queue[:k], queue[k:]
    contexts = contexts[:B - k] + [it["context"] for it in items]
    answers = answers[:B - k] + [it["answer"] for it in items]
    return contexts, answers, torch.arange(B) >= B - k, rest


def group_novelty(memories: dict, keys: list, group: torch.Tensor, emb: torch.Tensor, H: int) -> torch.Tensor:
    """Novelty of every completion of the step, then each prompt's embeddings join its memory.
    keys [n_groups] the prompt key of each group (its exact context ids), group [N], emb [N, d] -> d [N].
    Groups of one prompt in a batch (a small pool draws a question twice) are one pool of siblings, scored against
    the memory as it stood before the step, as the authors' code does: the prompt's first visit gets no bonus."""
    groups_of = {}  # prompt key -> its group ids in this step
    for g, key in enumerate(keys):
        groups_of.setdefault(key, []).append(g)
    d = torch.zeros(len(group))
    for key, ids in groups_of.items():
        rows = torch.isin(group, torch.tensor(ids)).nonzero()[:, 0]
        memory = memories.get(key, torch.zeros(0, emb.shape[1])).float()
        d[rows] = novelty(emb[rows], memory, n=int((group == ids[0]).sum()))  # warm-up: one group's G (authors' n)
        memories[key] = remember(memory, emb[rows], H).half()  # our choice: fp16 storage, the memory is large at scale
    return d


def cut_rollout(tokens: list, entropies: list, nl_ids: set, min_gap: int, max_cuts: int, cuttable_only: bool):
    """The rollout of a hard group to cut: the one with the lowest mean token entropy, correct or not.
    Returns (its index, its cuts), (None, []) when it has no line break to cut at. cuttable_only: our
    choice for short answers, where the most confident rollout is often one line without a break: take the
    most confident among those that can be cut (the authors' code takes the most confident, and then gets nothing)."""
    order = sorted(range(len(tokens)), key=lambda j: float(entropies[j].mean()) if len(tokens[j]) else float("inf"))
    for j in order if cuttable_only else order[:1]:
        cuts = prefix_cuts(tokens[j], nl_ids, min_gap, max_cuts)
        if cuts:
            return j, cuts
    return None, []


def regenerate(state: dict, hard_rows: list, embed_fn, nl_ids: set, cfg) -> tuple[list, int]:
    """ExTra §3.2 for the step's hard prompts. hard_rows: (context, answer, tokens [G lists], entropies [G
    tensors]) per hard row. Each cuts its most confident rollout into prefixes and stores them (ids, MTE,
    embedding) in its prompt's prefix memory; then every hard prompt whose memory holds prefixes, cut now or on an
    earlier visit, queues prompt ++ the memory's best prefix (as the official code's _enqueue_guided_prompts).
    Returns (the queue items, prefixes stored)."""
    cut = [cut_rollout(tokens, ent, nl_ids, cfg.boundary_gap, cfg.max_prefixes, cfg.cuttable_only)
           for _, _, tokens, ent in hard_rows]  # (rollout j, its cuts) per row
    prefixes = [tokens[j][:b] for (_, _, tokens, _), (j, cuts) in zip(hard_rows, cut) for b in cuts]
    emb = iter(embed_fn([p[:cfg.embed_tokens] for p in prefixes]) if prefixes else [])  # [n_prefixes, d]
    items = []
    for (context, answer, tokens, ent), (j, cuts) in zip(hard_rows, cut):
        memory = state["prefixes"].get(tuple(context), []) + ([
            dict(ids=tokens[j][:b], mte=float(m), emb=next(emb).half()) for b, m in zip(cuts, prefix_mte(ent[j], cuts))]
            if cuts else [])
        if memory:
            state["prefixes"][tuple(context)] = memory = memory[-cfg.prefix_memory:]
            best = select_prefix(torch.stack([m["emb"] for m in memory]).float(), torch.tensor([m["mte"] for m in memory]),
                                 cfg.tau)
            items.append(dict(context=guided_context(context, memory[best]["ids"], cfg.max_prompt_len), answer=answer))
    return items, len(prefixes)


def novelty_rewards(rewards, correct, d, group, keys, var_ema: dict, cfg) -> torch.Tensor:
    """Option A over the step: each group's rewards [N] with its bonus, after updating its prompt's v̄.
    The official code's rewards are ±1 (its math_dapo.py: 1.0 if correct else -1.0), ours 0/1: on its scale the
    bonus joins 2r - 1, and 2r - 1 + α·d̂ = 2(r + α·d̂/2) - 1, so ours adds α/2, with v̄ the variance of the ±1
    rewards (4 Var(r)). The group-normalised advantages are then the official code's."""
    out = rewards.clone()
    for g, key in enumerate(keys):
        rows = group == g
        v = update_var_ema(var_ema, key, 2 * rewards[rows] - 1)
        out[rows] = bonus_before_norm(rewards[rows], correct[rows], d[rows], cfg.alpha / 2, v, cfg.novelty_lambda)
    return out


def load_encoder(model_name, device, blocks: int = 0):
    """Our stand-in for the authors' sentence encoder (all-MiniLM-L6-v2): the initial policy, frozen, so a stored
    embedding stays comparable with a new one of the same text (the live policy's drift by 1e-5 to 1e-3 after 1-4
    updates would rival the novelty signal, ~0.01-0.03, uncentred). Our choice: its first `blocks` blocks (0 = all;
    a shallower model keeps all its own), then its final norm: at --encoder-blocks 6 the depth of MiniLM-L6. An
    embedding then costs about blocks/30 of a SmolLM2-135M forward, and its rollouts' nearest siblings lie a median
    0.28-0.29 apart (all 30 blocks: 0.24-0.26; MiniLM: 0.20; `python bench/extra_encoder.py`). Loaded for each step
    and dropped before the update (on a CPU the weights are memory-mapped, ~0.1 s to open; on a GPU it is a full load
    each step), so the update's peak holds no second copy."""
    encoder = Transformer.from_pretrained(model_name, device=device).eval().requires_grad_(False)
    if blocks:
        encoder.layers = encoder.layers[:blocks]
    return encoder


def embed_texts(encoder, seqs, centre, pad_id, autocast) -> torch.Tensor:
    """Embeddings [n, d] fp32 on the CPU of token-id lists: the encoder's mean-pooled final hidden states, minus
    `centre` (the mean embedding of the training problem statements), unit length; an empty list embeds to zeros.
    Our choice: the centring removes a direction every text shares (~93% of each pooled vector), which shrank every
    distance ~6x against MiniLM's; centred, SmolLM2's rollouts of one prompt lie a median 0.24 from their nearest
    sibling (MiniLM: 0.20). Equal lists embed once (the encoder is frozen, so they embed equally)."""
    unique = list(dict.fromkeys(map(tuple, seqs)))
    with autocast:
        emb = embed(encoder, [list(s) for s in unique], pad_id=pad_id).float().cpu()  # [u, d]
    if centre is not None:
        emb = F.normalize(emb - centre, dim=-1) * (emb.norm(dim=-1, keepdim=True) > 0)
    row = {s: i for i, s in enumerate(unique)}
    return emb[[row[tuple(s)] for s in seqs]]


def statement_centre(encoder, problems, tok, autocast, n: int = 256) -> torch.Tensor:
    """[d]: the mean embedding of the first n training problem statements (our choice: n bounds the cost on large
    data files; the mean of a few hundred is already stable)."""
    return embed_texts(encoder, [tok.encode(p.prompt) for p in problems[:n]], None, tok.pad_id, autocast).mean(0)


def new_state() -> dict:
    """ExTra's state, saved in every checkpoint: per-prompt rollout embeddings (novelty), per-prompt reward
    variance EMAs (Option A), per-prompt prefix memories, and the queue of guided prompts."""
    return {"novelty": {}, "var_ema": {}, "prefixes": {}, "queue": []}


def extra_metrics(state, d, bonus, correct, hard, guided, stored, cfg) -> dict:
    """extra/ metrics of one step. d, correct [N]; bonus [N]: what each completion was paid (to its advantage, or
    with --novelty-mode before to its 0/1 reward); hard, guided [B]."""
    right = correct > 0
    G = len(correct) // len(hard)
    return {
        "extra/novelty": d.mean().item(),  # over all completions, 0 on first visits
        "extra/bonus_share": ((d > 0) & right).sum().item() / max(right.sum().item(), 1),  # of correct completions
        "extra/bonus_mean": bonus[right].mean().item() if cfg.novelty and right.any() else 0.0,
        "extra/hard_prompts": hard.sum().item(),
        "extra/prefixes_stored": float(stored),
        "extra/prefix_memory": float(sum(len(m) for m in state["prefixes"].values())),
        "extra/queue_len": float(len(state["queue"])),
        "extra/guided_rows": guided.sum().item(),
        "extra/guided_acc": correct.view(-1, G)[guided].mean().item() if guided.any() else float("nan"),
    }


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
    extra_state = state["extra"]["extra_state"] if state else new_state()  # ExTra's memories and queue
    nl_ids, special = newline_ids(tok), set(tok.stop_ids)
    if state is not None:
        dist.load_optimizer_state(model, optimizer, state["optimizer"])
    if dist.is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(run_dir, enabled=dist.is_main(), resume_step=start_step if ckpt else None, total_steps=cfg.steps,
                     tracker=cfg.tracker, config=asdict(cfg), run_name=cfg.run_name)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    centre = (statement_centre(load_encoder(cfg.model, device, cfg.encoder_blocks), train, tok, autocast)
              if cfg.novelty or cfg.regen else None)
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
        # ExTra §3.2: the oldest queued guided prompts (prompt ++ prefix) replace the last rows, each its own group
        regen_on = cfg.regen and step > cfg.regen_warmup
        contexts, answers, guided, extra_state["queue"] = inject(
            contexts, [p.answer for p in problems], extra_state["queue"], cfg.regen_rows if regen_on else 0)
        with torch.no_grad(), autocast:
            groups = generate(rollout, contexts, n=G, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                              top_p=cfg.top_p, stop_ids=tok.stop_ids, seed=cfg.seed * 1_000_003 + step * 1009 + dist.rank())
        b = to_batch(contexts, groups, answers, group_ids=range(B))
        t_sample = time.time()

        # ---- 2. rewards; DAPO's dynamic sampling drops groups whose advantages are all 0 (equal rewards and no bonus)
        correct, rewards = verify(b, tok, cfg)  # [N]
        verified = rewards  # the verifier's rewards, which reward/ logs (Option A adds its bonus to `rewards`)
        # ExTra §3.1: novelty of each completion against its prompt's memory (keyed by the exact context) and siblings
        keys, d = [tuple(c) for c in contexts], torch.zeros(len(b.tokens))  # d [N]
        # the initial weights' first --encoder-blocks blocks, frozen
        encoder = load_encoder(cfg.model, device, cfg.encoder_blocks) if cfg.novelty or regen_on else None
        if cfg.novelty:
            tails = [response_tail(t, special, cfg.tail_tokens, cfg.embed_tokens) for t in b.tokens]
            d = group_novelty(extra_state["novelty"], keys, b.group, embed_texts(encoder, tails, centre, tok.pad_id, autocast),
                              cfg.memory_size)
            if cfg.novelty_mode == "before":  # Option A: into the reward, before the normalisation
                rewards = novelty_rewards(rewards, correct, d, b.group, keys, extra_state["var_ema"], cfg)
        n_groups = int(b.group.max()) + 1
        zero_var = ~varied_groups(verified, b.group, n_groups)  # [groups]
        zero_adv = zero_advantage_groups(rewards, correct, d, b.group, n_groups, cfg.novelty_mode)  # ExTra: bonus too
        keep = ~zero_adv[b.group] if cfg.dynamic_sampling else torch.ones(len(rewards), dtype=torch.bool)
        b_all, correct_all, rewards_all = b, correct, verified
        bonus_all = rewards - verified if cfg.novelty_mode == "before" else cfg.alpha * d * (correct > 0)  # [N] paid
        b, rewards = b.select(keep), rewards[keep]

        # ---- 3. score: the trainer's log-probs of the batch before any update: π_old when μ·M > 1 (with μ = M = 1
        # the update's own detached forward is π_old), π_ref with --kl-coef; before advantages, which some variants
        # base on them
        old_logp = ref_logp = None
        if cfg.epochs * cfg.mini_batches > 1:
            old_logp, _ = trainer_logprobs(model, b, cfg.micro_batch, cfg.temperature, tok.pad_id, device, autocast)
        if ref_model is not None:
            ref_logp, _ = trainer_logprobs(ref_model, b, cfg.micro_batch, cfg.temperature, tok.pad_id, device, autocast)
        # ExTra §3.2: the hard prompts' most confident rollouts (lowest mean entropy), cut into prefixes at line breaks
        hard = is_hard(correct.view(B, G))  # [B]
        items, stored = [], 0
        if regen_on and hard.any():
            # ExTra §3.2 scores rollouts and prefixes by their mean token entropy: in the authors' code π_θold's at
            # the rollout temperature (verl divides the logits by it). Our choice: the sampler's own entropies of each
            # token, the sampling copy's distribution, so no second pass
            # (context, answer, its G rollouts' tokens, their entropies) per hard row
            rows = [(contexts[r], answers[r], [s.tokens for s in groups[r]], [s.entropies for s in groups[r]])
                    for r in hard.nonzero()[:, 0].tolist()]
            items, stored = regenerate(extra_state, rows, lambda s: embed_texts(encoder, s, centre, tok.pad_id, autocast),
                                       nl_ids, cfg)
            extra_state["queue"] = push_queue(extra_state["queue"], items, cfg.queue_size)
        encoder = None  # dropped before the update, so that its peak holds no second copy of the weights
        t_score = time.time()

        # ---- 4. advantages: group-relative, one per completion, broadcast to its tokens
        adv = group_advantages(rewards, b.group, cfg.adv_norm)  # [N]
        if cfg.overlong_mask:  # DAPO §3.4, overlong filtering: a completion cut at the budget keeps its reward in its
            # group's advantages but gets no loss tokens (all of it is skipped)
            b = replace(b, skip=torch.where(b.finished, b.skip, b.lengths))
        if cfg.novelty and cfg.novelty_mode == "after":  # Option B (ExTra's abstract: after GRPO normalization)
            adv = bonus_after_norm(adv, correct[keep], d[keep], cfg.alpha)
        if cfg.guided_positive_only:
            adv = positive_on_guided(adv, b.group, guided)

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
        metrics = step_metrics(b_all, correct_all, rewards_all, n_groups, zero_var.sum().item(), zero_adv.sum().item()
                               if cfg.dynamic_sampling else 0, stats, (t0, t_sample, t_score, t_train))
        metrics["optim/lr"] = optimizer.param_groups[0]["lr"]
        metrics["response/overlong_masked"] = float(cfg.overlong_mask) * (~b.finished).sum().item()
        metrics.update(extra_metrics(extra_state, d, bonus_all, correct, hard, guided, stored, cfg))
        # means over completions and trained tokens weigh each rank by its count (XRPO's ranks hold different ones)
        counts = {"reward/": len(b_all.tokens), "response/": len(b_all.tokens), "reward/zero_var_groups": n_groups,
                  "policy/": stats["policy_tokens"]}
        log.log(step, dist.reduce_metrics(metrics, weights=counts, sums=METRIC_SUMS, maxes=METRIC_MAXES))
        if step % cfg.save_every == 0 or step == cfg.steps:
            checkpoint.save_run(model, optimizer, ckpt_dir, step, cfg, extra={"skipped_in_a_row": skipped_in_a_row,
                                                                             "extra_state": extra_state})
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
