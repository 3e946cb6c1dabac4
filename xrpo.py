"""XRPO: eXplore-eXploit GRPO (arXiv 2510.06672). grpo.py's loop with three additions, each one switch:

  1. hierarchical rollout planning (§3.2, eqs 1-3): every prompt gets n_base rollouts, then N_plan rounds split the
     rest of the step's budget over the prompts in proportion to Π = Δ + φ: how much one more rollout would
     narrow the Student-t confidence interval of the prompt's mean reward, plus an exploration bonus;
  2. ICL seeding (§3.2, App. C): in a round where a prompt has no correct rollout yet, its rollouts are sampled
     from a prompt that shows up to K verified solutions of similar other problems, taken from a corpus of the
     run's own correct rollouts; they train with that prompt as context and are normalised in the prompt's group;
  3. novelty-guided advantage sharpening (§3.3, eqs 4-6): a correct rollout that the policy finds less likely
     than its group does on average gets a bonus λ_nov (1 - η), capped at κ A. This is XRPO's change to the
     loss: the update receives the sharpened advantages; the clipped objective itself is grpo.py's.

    python xrpo.py                                   # SmolLM2-135M-Instruct on generated arithmetic, 2-core CPU
    python xrpo.py --steps 2 --run-name smoke        # any option: python xrpo.py --help
    python xrpo.py --run-name NAME --resume          # continue a run (the ICL corpus is in the checkpoint)
    python xrpo.py --alloc uniform                   # ablations: w/o HRP (§4.3, Fig. 3b; rounds kept, split evenly),
    python xrpo.py --no-icl                          #   w/o ICL (Table 5),
    python xrpo.py --nov-lambda 0                    #   w/o AS (both: w/o AS+ICL)
    python xrpo.py --icl-init 64                     # the corpus seeded from the base model's answers (Alg. 1's C_init)
    python xrpo.py --icl-context plain               # ICL rollouts train as answers to the plain prompt
    python xrpo.py --rounds 0 --base-rollouts 8 --no-icl --nov-lambda 0   # all off: python grpo.py, bit for bit
    torchrun --nproc_per_node=8 xrpo.py --model Qwen3-1.7B --task dapo_math_17k.jsonl --train-size 0 \
        --prompts-per-step 16 --group-size 8 --base-rollouts 4 --rounds 2 --icl-shots 2 --icl-max-len 8192 \
        --kl-coef 0.001 --max-new-tokens 16384 --temperature 1.0 --lr 2e-6 --decay-steps 0 ...   # the paper's setting (§4.1)

A step samples grpo.py's B×G rollouts in all (B×n_base base + the dynamic rest), so the two compare at an equal
number of rollouts (not in equal time: each round is another sampling call, and in-context prompts are longer).
The CPU defaults plan one round and show one exemplar where the paper uses two of each: each round is another
sampling call and each exemplar 60-90 more prompt tokens (the comments at --rounds and --icl-shots).
The loss is grpo.py's (token-mean, clip 0.2/0.28); the paper adds a KL at β = 0.001 (§4.1), off here as in grpo.py
(--kl-coef 0.001 adds it: a reference model and its forward); --seq-ratio gives XRPO on GSPO. Problem statements
are embedded by the policy's own initial weights (pooled final hidden states) instead of the paper's
separate Qwen3-Embedding-8B, once before the first update: no second model. Evaluation never uses ICL (§4.1).

Off by default, as in grpo.py: a format reward (--format-reward) and DAPO's overlong penalty (--overlong-buffer).
Left out: value models; grpo.py's refill of groups dropped by dynamic sampling (a refill samples beyond the B×G
budget that the planner splits; we drop them and log how many); a per-prompt cap on the allocation (not in the
paper). The authors link their code (github.com/UIUC-MLSys/XRPO), but we could not read it: where the paper leaves
a choice open, the code says "our choice".
"""
import copy
import functools
import math
import time
from dataclasses import asdict, dataclass, field, replace

import torch

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
    run_name: str = ""  # writes runs/<run-name>/; empty = xrpo-<date-time>
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
    # hierarchical rollout planning (XRPO §3.2): a step samples B×G rollouts in all, as grpo.py does; G is the mean
    base_rollouts: int = 4  # n_base: rollouts every prompt gets first (§4.1: 4; >= 2, or Δ has no spread to read)
    # N_plan: rounds that split the other B×(G - n_base) rollouts (§4.1: 2). 1 here: each round is one more sampling
    # call, and on a CPU a call of 32 rows costs over half of one of 128 (docs/xrpo.md); --rounds 2 is the paper's
    rounds: int = 1
    # proportional: T·Π/ΣΠ, largest remainder; greedy: one unit at a time to the highest Π (eq. 3); uniform: T/B each,
    # the "w/o HRP" ablation (§4.3, Fig. 3b), which keeps the rounds, so ICL still seeds and AS still sharpens
    alloc: str = "proportional"
    alloc_lambda: float = 0.1  # λ: weight of the exploration bonus φ in Π (§4.1 gives none; Table 4b's default row)
    alloc_conf: float = 0.95  # confidence level of the t-interval behind Δ (our reading of Table 4b's "α" column)
    # ICL seeding (XRPO §3.2, App. C); --no-icl is the "w/o ICL" ablation (Table 5)
    icl: bool = True  # sample a prompt with no correct rollout yet from an in-context prompt of solved neighbours
    # K: verified solutions of similar other problems shown (§4.1: 2). 1 here: each exemplar adds 60-90 tokens to an
    # in-context prompt's prefill and training forward (docs/xrpo.md); --icl-shots 2 is the paper's
    icl_shots: int = 1
    # longest in-context prompt in tokens, exemplars shortened to fit (paper: 8192, its prompt window). With answers of
    # at most 48 tokens two arithmetic exemplars make at most ~270 tokens, so it binds only on longer tasks
    icl_max_len: int = 1024
    icl_per_problem: int = 4  # solutions the corpus keeps per problem, most recent (our choice: the paper never prunes)
    # C_init (Alg. 1; §3.2, §4.2): training problems the base model samples n_base times before step 1, its correct
    # answers seeding the corpus; 0 = an empty corpus (§3.2). Off by default: it costs a sampling round before
    # training (its solutions stay in the corpus, and matter most at step 1, before the run's own correct rollouts
    # join them)
    icl_init: int = 0
    # the context ICL rollouts train with, which the paper leaves open: icl, the in-context prompt q̃ they were
    # sampled from (an on-policy ratio), or plain, the problem's own prompt q, the one evaluation asks (§4.1);
    # sample_rounds says more
    icl_context: str = "icl"
    # novelty-guided advantage sharpening (XRPO §3.3, eq. 6); --nov-lambda 0 is the "w/o AS" ablation (Table 5)
    nov_lambda: float = 2.5  # λ_nov: bonus strength (§4.1); 0 = off
    nov_kappa: float = 0.5  # κ: a bonus is at most κ times the rollout's advantage (§4.1)
    nov_all_correct: bool = False  # our option: all-correct groups (A = 0) get bonuses too, capped at κ
    # advantages and loss
    adv_norm: str = "std"  # std (GRPO) or none (Dr. GRPO): divide group-centred rewards by their std?
    loss_agg: str = "token-mean"  # token-mean (DAPO) | seq-mean-token-mean (GRPO) | seq-mean-token-sum-norm (Dr. GRPO)
    eps_low: float = 0.2  # clip ratio below 1 - eps_low
    eps_high: float = 0.28  # clip ratio above 1 + eps_high (DAPO clip-higher)
    seq_ratio: bool = False  # GSPO's one length-normalised ratio per completion (its full recipe: docs/grpo.md)
    tis_cap: float = 0.0  # C: correct for the sampler copy by ρ = π_train / π_sampler, truncated min(ρ, C); 0 = off
    kl_coef: float = 0.0  # β: k3 KL to the initial model; 0 loads no reference model (paper: 0.001, §4.1)
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
    fsdp: bool = False  # FSDP2: refused under torchrun (ranks train different numbers of completions)
    # evaluation and checkpoints
    eval_every: int = 15  # evaluate every N steps (and before step 1 and after the last)
    eval_size: int = 300  # held-out problems per evaluation (300: one accuracy near 0.3 carries about ±2.6 points of noise)
    eval_samples: int = 0  # completions per problem for pass@k / maj@k, at --temperature and --top-p (0 = greedy only)
    save_every: int = 15  # checkpoint every N steps (and after the last)
    tracker: str = "none"  # also log to tensorboard, wandb or trackio (an optional package: pip install it)

    choices = {"adv_norm": ["std", "none"], "loss_agg": ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
               "device": ["auto", "cpu", "cuda"], "dtype": ["auto", "float32", "bfloat16"],
               "loss_type": ["clip", "cispo"], "tis_mode": ["token-truncate", "token-mask", "sequence-truncate", "sequence-mask"],
               "tracker": ["none", "tensorboard", "wandb", "trackio"],
               "alloc": ["proportional", "greedy", "uniform"], "icl_context": ["icl", "plain"]}


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
    # the allocation spreads the batch's rollouts over all prompts, so ranks hold different numbers of completions
    # and run different numbers of forwards: DDP is fine with that, FSDP2 (a weight gather in each forward) is not
    check(not (cfg.fsdp and dist.world() > 1), "fsdp", "off under torchrun (DDP: XRPO's ranks train different numbers "
          "of completions, and FSDP2 needs the same forwards on every rank)")
    check(2 <= cfg.base_rollouts <= cfg.group_size, "base_rollouts", f"2 ... --group-size ({cfg.group_size}), got "
          f"{cfg.base_rollouts} (the t-interval needs n >= 2): lower --base-rollouts or raise --group-size")
    check(cfg.rounds >= 0 and (cfg.rounds > 0 or cfg.base_rollouts == cfg.group_size), "rounds",
          "a positive number of rounds (or 0 with base_rollouts = group_size: no dynamic budget)")
    check(cfg.alloc_lambda >= 0 and 0 < cfg.alloc_conf < 1, "alloc_lambda/alloc_conf", "λ >= 0 and a level in (0, 1)")
    # K = 0 would seed no prompt and C_init without ICL would fill a corpus nothing reads: refuse both, not ignore
    check((cfg.icl_shots >= 1 or not cfg.icl) and cfg.icl_per_problem > 0, "icl_shots/icl_per_problem",
          "K >= 1 with ICL on (--no-icl turns seeding off) and a positive cap")
    check(cfg.icl_init >= 0 and cfg.icl_init % dist.world() == 0 and (cfg.icl or cfg.icl_init == 0), "icl_init",
          f"0 or a multiple of the world size {dist.world()}, and 0 under --no-icl")
    check(cfg.nov_lambda >= 0 and cfg.nov_kappa >= 0, "nov_lambda/nov_kappa", "non-negative numbers")
    check(not (cfg.nov_all_correct and cfg.dynamic_sampling), "nov_all_correct",
          "off with --dynamic-sampling (which drops the all-correct groups before any bonus)")
    check(cfg.prompts_per_step // dist.world() * cfg.base_rollouts >= cfg.mini_batches, "mini_batches",
          "at most the fewest completions a step can give a rank (prompts_per_step / world * base_rollouts)")


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
    check(not cfg.icl or longest <= cfg.icl_max_len <= limit - cfg.max_new_tokens, "icl_max_len",
          f"between the longest prompt ({longest} tokens) and {limit - cfg.max_new_tokens} (positions - max_new_tokens)")


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


# ------------------------------------------------------------ hierarchical rollout planning (XRPO §3.2, eqs 1-3)

def _t_central(theta: float, dof: int) -> float:
    """P(|T| <= sqrt(dof) tan(theta)) for Student's t with integer dof: the exact finite sums of
    Abramowitz & Stegun 26.7.3-4 (no special functions needed for whole degrees of freedom)."""
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if dof % 2 == 0:  # sin θ (1 + 1/2 cos²θ + 1·3/(2·4) cos⁴θ + ... up to cos^(ν-2)θ)
        term = total = 1.0
        for k in range(2, dof, 2):
            term *= c2 * (k - 1) / k
            total += term
        return s * total
    total = 0.0  # odd: 2/π (θ + sin θ (cos θ + 2/3 cos³θ + 2·4/(3·5) cos⁵θ + ... up to cos^(ν-2)θ))
    if dof > 1:
        term = total = math.cos(theta)
        for k in range(3, dof - 1, 2):
            term *= c2 * (k - 1) / k
            total += term
    return 2 / math.pi * (theta + s * total)


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, dof: int) -> float:
    """Student-t quantile t_{p,ν} (integer ν >= 1), without scipy: bisect θ = atan(t/√ν) on the exact CDF."""
    if p < 0.5:
        return -t_quantile(1 - p, dof)
    target, lo, hi = 2 * p - 1, 0.0, math.pi / 2  # P(|T| <= t) = 2p - 1, increasing in θ
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_central(mid, dof) < target else (lo, mid)
    return math.sqrt(dof) * math.tan((lo + hi) / 2)


def ci_shrink(s: float, n: int, conf: float) -> float:
    """Δ_q (eq. 2): how much one more rollout narrows the Student-t confidence interval of the prompt's mean
    reward, holding its std s fixed. 0 for s = 0, and (our choice) for n < 2, where the interval is undefined."""
    if s == 0 or n < 2:
        return 0.0
    p = (1 + conf) / 2  # two-sided interval at confidence `conf`: the 1 - α/2 quantile
    return s * (t_quantile(p, n - 1) / math.sqrt(n) - t_quantile(p, n) / math.sqrt(n + 1))


def explore_bonus(lam: float, round_budget: int, n: int) -> float:
    """φ_q (§3.2): λ √(ln(1 + T) / n_q), T = rollouts allocated in this round. Natural log: our choice (the
    paper writes log without a base)."""
    return lam * math.sqrt(math.log(1 + round_budget) / n)


def priorities(rewards: list[list[float]], round_budget: int, lam: float, conf: float, extra=None) -> list[float]:
    """Π_q = Δ_q + φ_q (eq. 3) per prompt from its rewards so far; `extra[q]` units already planned this round
    count in n_q (the greedy reading) while s_q stays that of the rewards seen."""
    out = []
    for q, r in enumerate(rewards):
        n = len(r) + (extra[q] if extra else 0)
        s = torch.tensor(r, dtype=torch.float64).std().item() if len(r) > 1 else 0.0  # unbiased (ddof = 1)
        out.append(ci_shrink(s, n, conf) + explore_bonus(lam, round_budget, n))
    return out


def allocate(rewards: list[list[float]], budget: int, lam: float, conf: float, mode: str = "proportional") -> list[int]:
    """Split one round's `budget` rollouts over the prompts (§3.2), given each prompt's rewards so far.

    proportional (default): shares T·Π_q/ΣΠ, made integers by largest remainder (our choice: the paper only says
      "in proportion to its current priority score"): floors first, then the leftover units to the largest
      fractional parts, ties to the higher Π, then the lower prompt index. The sum is exactly T.
    greedy: one unit at a time to the highest Π, recomputed with n_q + 1 after each unit (eq. 3 read as "the
      priority for the next rollout"); ties to the prompt with fewer units so far, then the lower index (our
      choice: with λ = 0 and no prompt varying every Π is 0, and the round then splits evenly, as proportional's)
    uniform: T/B each, the leftover units to the lowest indices (the "w/o HRP" ablation, §4.3)."""
    B = len(rewards)
    if mode == "greedy":
        got = [0] * B
        for _ in range(budget):
            pri = priorities(rewards, budget, lam, conf, extra=got)
            got[max(range(B), key=lambda q: (pri[q], -got[q], -q))] += 1
        return got
    pri = priorities(rewards, budget, lam, conf) if mode == "proportional" else [1.0] * B
    total = sum(pri)
    # our choice: with λ = 0 and no prompt varying, nothing ranks the prompts: split evenly
    shares = [budget * p / total for p in pri] if total > 0 else [budget / B] * B
    got = [math.floor(x) for x in shares]
    order = sorted(range(B), key=lambda q: (-(shares[q] - got[q]), -pri[q], q))
    for q in order[:max(budget - sum(got), 0)]:
        got[q] += 1
    assert sum(got) == budget, (got, budget)
    return got


def round_budgets(dynamic: int, rounds: int) -> list[int]:
    """The per-round budgets T of the dynamic rollouts: equal, the remainder in the last round."""
    if rounds == 0:
        return []
    return [dynamic // rounds] * (rounds - 1) + [dynamic - dynamic // rounds * (rounds - 1)]


# ---------------------------------------------------------------------- ICL seeding (XRPO §3.2, App. C)

# The layout and tags of App. C; the wording is ours, and short: at our scale every token of it is paid in each forward
ICL_TASK = "Solve the new problem the way the worked examples solve theirs. Put your final answer within \\boxed{}."


def icl_question(problem: str, exemplars: list[tuple[str, str]]) -> str:
    """The user message of an in-context prompt (App. C): the task, up to K numbered examples, the new problem."""
    examples = "\n".join(f'<example id="{i}">\n<problem>{p}</problem>\n<solution>{s}</solution>\n</example>'
                         for i, (p, s) in enumerate(exemplars, 1))
    return f"<task>\n{ICL_TASK}\n</task>\n\n<examples>\n{examples}\n</examples>\n\n<new_problem>{problem}</new_problem>"


def truncate_solution(tok, text: str, n_tokens: int) -> str:
    """At most about n_tokens tokens of a solution: its head, and its final \\boxed answer when that fits in half
    the budget (App. C truncates over-long exemplars; keeping the answer is our choice: the answer is the part a
    worked example cannot do without)."""
    ids = tok.encode(text)
    if len(ids) <= n_tokens:
        return text
    cut = text.rfind("\\boxed")
    tail = text[cut:] if cut >= 0 else ""
    tail_len = len(tok.encode(tail)) if tail else 0
    if not tail or tail_len > n_tokens // 2:
        return tok.decode(ids[:n_tokens]) + " ..."
    return tok.decode(ids[:n_tokens - tail_len]) + " ... " + tail


def icl_prompt(tok, problem: str, exemplars: list[tuple[str, str]], max_len: int, min_solution: int = 16):
    """Token ids of the in-context prompt for `problem`, at most max_len tokens, or None when no exemplar fits
    (the caller then samples from the plain prompt, App. C). Over-long: every exemplar solution is cut to the
    same, shrinking, token budget before the last exemplar is dropped (our choice: two shortened examples
    teach more than one whole one)."""
    exemplars = list(exemplars)
    while exemplars:
        cap = max(len(tok.encode(s)) for _, s in exemplars)
        while True:
            shown = [(p, truncate_solution(tok, s, cap)) for p, s in exemplars]
            ids = tok.prompt(icl_question(problem, shown))
            if len(ids) <= max_len:
                return ids
            if cap <= min_solution:
                break
            cap = max(min_solution, cap * 3 // 4)
        exemplars.pop()
    return None


def solution_text(completion: str) -> str:
    """What the corpus stores of a correct rollout: the answer-bearing part after a thinking block, if any
    (our choice: the paper's stored solutions, ~900 tokens, are far shorter than its ~13k-token responses)."""
    return completion.rsplit("</think>", 1)[-1].strip()


def round_contexts(tok, problems: list[str], plain: list[list[int]], correct: list[list[float]], alloc: list[int],
                   corpus, k: int, max_len: int, icl: bool = True) -> list[tuple[list[int], bool]]:
    """Each prompt's context for this round's rollouts and whether it is an in-context one (Alg. 1 lines 11-13):
    a prompt none of whose rollouts so far is correct is seeded with up to k solved neighbours; otherwise, or when
    nothing can be retrieved or nothing fits, the plain prompt (zero-shot fallback, App. C). Our choice where the
    paper differs with itself: App. C seeds a prompt that failed its base rollouts for all its remaining budget,
    Alg. 1 checks the rollouts so far in each round; we follow Alg. 1 (the two agree with one round, the default)."""
    out = []
    for q, problem in enumerate(problems):
        ids = None
        if icl and alloc[q] > 0 and not any(c == 1 for c in correct[q]):
            shots = corpus.exemplars(problem, k)
            ids = icl_prompt(tok, problem, shots, max_len) if shots else None
        out.append((plain[q], False) if ids is None else (ids, True))
    return out


def update_corpus(corpus, problems: list[str], texts: list[str], correct: list[float]):
    """Alg. 1 line 18: every rollout with full reward becomes a stored solution of its own problem (ICL-seeded ones
    included: they solve q). One entry per rollout in the three lists."""
    for problem, text, c in zip(problems, texts, correct):
        if c == 1:
            corpus.add(problem, text)


@dataclass
class Corpus:
    """The evolving ICL corpus (§3.2, Alg. 1 line 18): verified solutions of the run's own correct rollouts, by
    problem statement, and the statements' embeddings for the neighbour search."""
    per_problem: int = 4  # solutions kept per problem, most recent last (our choice: the paper never prunes)
    solutions: dict = field(default_factory=dict)  # statement -> list of solution texts
    vectors: dict = field(default_factory=dict)  # statement -> unit embedding [d] (fp32, CPU)

    def add(self, problem: str, completion: str):
        kept = self.solutions.setdefault(problem, [])
        kept.append(solution_text(completion))
        del kept[:-self.per_problem]

    def size(self) -> int:
        return sum(len(v) for v in self.solutions.values())

    def embed_new(self, model, tok, problems: list[str], batch: int = 32):
        """Embed statements not seen yet. Called with the frozen initial weights, this gives the same vectors as
        embedding the whole training set once at start (the paper's offline index) at the cost of only the
        problems a run visits."""
        new = list(dict.fromkeys(p for p in problems if p not in self.vectors))
        if new:
            vecs = embed(model, [tok.encode(p) for p in new], batch=batch, pad_id=tok.pad_id).cpu()
            self.vectors.update(zip(new, vecs))

    def neighbours(self, problem: str, k: int) -> list[str]:
        """The k most similar (cosine) other problems with a stored solution. The problem itself and identical
        statements are excluded (our choice: ICL transfers across problems, §3.2; replay is a different method).
        Our choice: no similarity floor. App. C falls back to the plain prompt when no "suitable" example exists
        without defining suitable; we read it as none stored, and App. F finds even random exemplars help."""
        cands = [p for p in self.solutions if p != problem and self.solutions[p]]
        if not cands or k <= 0 or problem not in self.vectors:
            return []
        sims = torch.stack([self.vectors[p] for p in cands]) @ self.vectors[problem]  # [n]
        order = sorted(range(len(cands)), key=lambda i: (-sims[i].item(), i))  # ties: older entries first
        return [cands[i] for i in order[:k]]

    def exemplars(self, problem: str, k: int) -> list[tuple[str, str]]:
        """Up to k (neighbour statement, one verified solution) pairs: the neighbour's most recent solution (our
        choice: the freshest is closest to the current policy)."""
        return [(p, self.solutions[p][-1]) for p in self.neighbours(problem, k)]

    def state_dict(self) -> dict:
        return {"solutions": self.solutions, "vectors": self.vectors}

    def load_state_dict(self, state: dict):
        self.solutions = {p: list(v) for p, v in state["solutions"].items()}
        self.vectors = dict(state["vectors"])


def embed_statements(corpus, initial, statements: list[str], cfg, tok, device):
    """The neighbour index (§4.2: neighbours precomputed over the training set): the statements a run will draw,
    embedded by the initial weights before the first update, so no frozen copy is held through the run; the same
    vectors as embedding the whole training set at start, for only the problems the run visits. initial: the model
    while it still holds the initial weights, or None (a resumed run), which loads them for this alone."""
    if any(p not in corpus.vectors for p in statements):
        model = initial if initial is not None else Transformer.from_pretrained(cfg.model, device=device)
        corpus.embed_new(model, tok, statements)


def initial_problems(train, cfg) -> list:
    """C_init's problems (Alg. 1): the first icl_init of a permutation of the training set drawn with its own seed
    (our choice: the paper does not say which problems its baseline sampled)."""
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed * 7919 + 1_000_003))
    return [train[int(i)] for i in order[:cfg.icl_init]]


def seed_corpus(rollout, tok, problems, corpus, cfg, seed, autocast):
    """C_init (Alg. 1; §3.2: the corpus "grows conservatively from baseline-correct solutions"): n_base samples of
    each problem from the base model, plain prompts; the correct ones join the corpus. Every rank samples its share."""
    mine = dist.shard(problems)
    with torch.no_grad(), autocast:
        groups = generate(rollout, [tok.prompt(format_question(p)) for p in mine], n=cfg.base_rollouts,
                          max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                          stop_ids=tok.stop_ids, seed=seed)
    rows = [(p, tok.decode(s.tokens, skip_special=True)) for p, g in zip(mine, groups) for s in g]
    everyone = dist.all_gather_list  # every rank's rows, rank after rank: the corpus is one on every rank
    update_corpus(corpus, everyone([p.prompt for p, _ in rows]), everyone([t for _, t in rows]),
                  everyone([score(t, p.answer) for p, t in rows]))


# ---------------------------------------------------- novelty-guided advantage sharpening (XRPO §3.3, eqs 4-6)

def sequence_scores(token_logp: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """s(y) (eq. 4): each rollout's mean token log-prob. token_logp [sum(lengths)] flat, lengths [N] -> [N]."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    sums = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, seq, token_logp.double())
    return (sums / lengths.clamp(min=1)).float()


def sharpen(adv, correct, seq_logp, group, lam_nov: float, kappa: float, all_correct_cap: bool = False):
    """A⁺ (eq. 6) for every rollout, and the bonus added. adv, correct, seq_logp (s, eq. 4), group: [N] (group id).

    η_i = exp(s_i - s̄) with s̄ the mean s of ALL rollouts of i's group, right and wrong, plain and in-context, each in
    its own context (eq. 5's N rollouts read as the group's: §3.3 calls η relative to the group). Our choice, since
    the paper does not say which context scores an ICL rollout: the in-context prompt it was sampled from (the
    sampler's log-probs; a scoring pass, μ·M > 1, scores the context it trains in, --icl-context). Exemplars tend to
    raise an ICL rollout's log-probs, so in a seeded group its correct rollouts (all ICL ones with one round) sit
    above s̄ more often and gain less. s is at the sampling temperature, as the trainer's π_old is (eq. 4 writes
    π_θ; the paper samples at T = 1, where the two agree). Only correct
    rollouts get min(max(λ_nov (1 - η_i), 0), κ A_i). Taken literally, an all-correct group (A = 0) gets no bonus;
    all_correct_cap (our option) caps those at κ instead, for the paper's remark that degenerate groups gain signal
    (§3.3)."""
    n_groups = int(group.max()) + 1 if len(group) else 0
    sums = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, seq_logp.double())
    counts = torch.bincount(group, minlength=n_groups).double()
    mean = (sums / counts)[group]  # s̄ of each rollout's group
    eta = torch.exp(seq_logp.double() - mean)
    cap = kappa * adv.double()
    if all_correct_cap:
        n_correct = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, correct.double())
        cap = torch.where((n_correct == counts)[group], torch.full_like(cap, kappa), cap)
    # clamp at 0: our choice. With binary rewards a correct rollout's A is >= 0 anyway; only the optional format
    # term can give one A < 0, and then the literal cap κA would turn the bonus into a penalty
    bonus = torch.minimum((lam_nov * (1 - eta)).clamp(min=0), cap).clamp(min=0)
    bonus = torch.where(correct.bool(), bonus, torch.zeros_like(bonus)).to(adv.dtype)
    return adv + bonus, bonus


# ------------------------------------------------------------------------------- one XRPO step's rollouts

def sample_rounds(rollout, tok, problems, contexts, corpus, cfg, seed, autocast):
    """Alg. 1 lines 4-16: n_base rollouts of every prompt, then cfg.rounds rounds, each splitting its budget T by the
    priorities of the rewards so far and sampling a prompt with no correct rollout yet from its in-context prompt.
    Prompt q's group is all its rollouts, whatever round and context they came from.
    The context an ICL rollout trains with is our choice (the paper does not say). With cfg.icl_context "icl" (the
    default) it is q̃, the in-context prompt it was sampled from: the update's ratio is a true importance ratio, as
    in a pipeline that trains each rollout on the prompt that generated it, and the exemplars go through every
    training forward. With "plain" it is the problem's prompt q, the one evaluation asks, shared in the forward with
    the group's plain rollouts; the sampler log-probs stay q̃'s, the distribution the rollout was drawn from: with
    μ·M = 1 the ratio is 1 and the gradient REINFORCE's on q, π_old (μ·M > 1) is scored on q, and --tis-cap weights
    them by π_old(y|q) / π(y|q̃). The budget is the whole batch's (§3.2): under torchrun every rank plans all
    prompts from the gathered scores, then samples its own share of the plan.
    Returns the flat Batch, each rollout's text and 0/1 verifier score [N], whether its context was an in-context
    prompt [N] (bool), and how many rollouts each prompt got."""
    B, answers = len(problems), [p.answer for p in problems]
    kw = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, stop_ids=tok.stop_ids)
    budgets = round_budgets(B * dist.world() * (cfg.group_size - cfg.base_rollouts), cfg.rounds)
    plan, round_ctx = [cfg.base_rollouts] * B, [(c, False) for c in contexts]  # the base round: plain prompts
    chunks = [[] for _ in range(B)]  # each prompt's (context, samples, texts, scores, is_icl), round after round
    so_far = [[] for _ in range(B)]  # each prompt's 0/1 scores so far this step
    # the prompts' keys and values, kept from round to round (the weights and the corpus change only after the step):
    # a prompt sampled again, plain or with the same in-context prompt, is not prefilled again
    prompt_kv = {}
    for r in range(len(budgets) + 1):
        if r > 0:  # our choice: the allocator reads the verifier's 0/1, not the optional format term
            plan = allocate(dist.all_gather_list(so_far), budgets[r - 1], cfg.alloc_lambda, cfg.alloc_conf, cfg.alloc)
            plan = plan[dist.rank() * B:(dist.rank() + 1) * B]  # this rank's prompts (gather is rank after rank)
            round_ctx = round_contexts(tok, [p.prompt for p in problems], contexts, so_far, plan, corpus,
                                       cfg.icl_shots, cfg.icl_max_len, icl=cfg.icl)
        with torch.no_grad(), autocast:
            groups = generate(rollout, [c for c, _ in round_ctx], n=plan, seed=seed + 104_729 * r,
                              prompt_kv=prompt_kv, **kw)
        for q, ((c, is_icl), g) in enumerate(zip(round_ctx, groups)):
            ts = [tok.decode(s.tokens, skip_special=True) for s in g]
            cs = [score(t, answers[q]) for t in ts]
            so_far[q] += cs
            chunks[q].append((c, g, ts, cs, is_icl))
    # prompt after prompt, each prompt's rounds side by side: a micro-batch of the update then holds few distinct
    # contexts, and each distinct context goes through its forward once
    flat = [(q, *chunk) for q in range(B) for chunk in chunks[q]]  # (q, context, samples, texts, scores, is_icl)
    trained_in = [contexts[f[0]] if f[5] and cfg.icl_context == "plain" else f[1] for f in flat]
    b = to_batch(trained_in, [f[2] for f in flat], [answers[f[0]] for f in flat], [f[0] for f in flat])
    correct = torch.tensor([c for f in flat for c in f[4]])
    icl = torch.tensor([f[5] for f in flat for _ in f[2]], dtype=torch.bool)
    return b, [t for f in flat for t in f[3]], correct, icl, [len(s) for s in so_far]


def xrpo_metrics(per_prompt, cfg, group, icl, correct, kept_correct, bonus, corpus) -> dict:
    """The evidence that XRPO's mechanisms act: uneven allocation, ICL use and success, bonuses, corpus size.
    per_prompt: rollouts of each prompt of every rank; group, icl, correct [N]: this rank's rollouts; kept_correct,
    bonus: those trained on (dynamic sampling may drop groups). The XRPO_SUMS counts are this rank's, summed over
    ranks, and xrpo_rates turns them into rates; rollouts_* and hist_* are every rank's prompts already; the corpus
    is one on every rank."""
    n, B = torch.tensor(per_prompt, dtype=torch.float), len(per_prompt)
    seeded = group[icl].unique()  # this rank's prompts sampled from an in-context prompt
    solved = group[icl & (correct == 1)].unique()  # ... whose zero-reward symmetry ICL broke
    G, base = cfg.group_size, cfg.base_rollouts
    share = lambda mask: mask.float().mean().item()  # noqa: E731
    return {
        "xrpo/rollouts_mean": n.mean().item(), "xrpo/rollouts_min": n.min().item(), "xrpo/rollouts_max": n.max().item(),
        "xrpo/rollouts_std": n.std().item() if B > 1 else 0.0,
        # histogram: shares of prompts with n_base only, fewer than G, G to 2G-1, 2G or more rollouts
        "xrpo/hist_base": share(n == base), "xrpo/hist_below_G": share((n > base) & (n < G)),
        "xrpo/hist_G_to_2G": share((n > base) & (n >= G) & (n < 2 * G)),
        "xrpo/hist_2G_up": share((n > base) & (n >= 2 * G)),
        "xrpo/seeded_prompts": float(len(seeded)), "xrpo/seeded_solved": float(len(solved)),
        "xrpo/icl_rollouts": float(icl.sum()), "xrpo/icl_correct": float(correct[icl].sum()),
        "xrpo/plain_rollouts": float((~icl).sum()), "xrpo/plain_correct": float(correct[~icl].sum()),
        "xrpo/bonus_given": float((bonus > 0).sum()), "xrpo/bonus_sum": float(bonus.sum()),
        "xrpo/correct_trained": float((kept_correct == 1).sum()),
        "xrpo/corpus_size": float(corpus.size()), "xrpo/corpus_problems": float(len(corpus.solutions)),
    }


def xrpo_rates(m: dict) -> dict:
    """Rates from the counts summed over ranks; null (NaN) where nothing was counted (no ICL rollout, no bonus)."""
    rate = lambda a, b: m[a] / m[b] if m[b] else float("nan")  # noqa: E731
    return {"xrpo/icl_share": m["xrpo/icl_rollouts"] / (m["xrpo/icl_rollouts"] + m["xrpo/plain_rollouts"]),
            "xrpo/icl_acc": rate("xrpo/icl_correct", "xrpo/icl_rollouts"),
            "xrpo/plain_acc": rate("xrpo/plain_correct", "xrpo/plain_rollouts"),
            "xrpo/bonus_share": rate("xrpo/bonus_given", "xrpo/correct_trained"),  # of the correct rollouts
            "xrpo/bonus_mean": rate("xrpo/bonus_sum", "xrpo/bonus_given")}  # over the rollouts given one


XRPO_SUMS = ("xrpo/seeded_prompts", "xrpo/seeded_solved", "xrpo/icl_rollouts", "xrpo/icl_correct", "xrpo/plain_rollouts",
             "xrpo/plain_correct", "xrpo/bonus_given", "xrpo/bonus_sum", "xrpo/correct_trained")
XRPO_MAXES = ("xrpo/rollouts_max",)


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
    # XRPO's state: the corpus of verified solutions and the problem statements' embeddings (both in the checkpoint)
    corpus = Corpus(per_problem=cfg.icl_per_problem)
    if state is not None:
        corpus.load_state_dict(state["extra"]["xrpo_corpus"])
    init_problems = initial_problems(train, cfg) if cfg.icl and state is None else []  # C_init (Alg. 1), sampled below
    if cfg.icl:
        run = step_prompts(train, 1, cfg.steps * cfg.prompts_per_step, cfg.seed)  # every problem this run draws
        embed_statements(corpus, None if ckpt else model, [p.prompt for p in run + init_problems], cfg, tok, device)
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
    if init_problems:  # C_init: the base model's correct samples seed the corpus before the first update
        seed_corpus(rollout, tok, init_problems, corpus, cfg, cfg.seed * 1_000_003 + dist.rank(), autocast)

    for step in range(start_step + 1, cfg.steps + 1):
        # ---- 1. sample (XRPO Alg. 1): n_base rollouts of each of this rank's prompts, then rounds that spend the
        # rest of the B×G budget by priority, seeding prompts with no correct rollout yet with solved neighbours
        t0 = time.time()
        problems = dist.shard(step_prompts(train, step, cfg.prompts_per_step, cfg.seed))
        contexts = [tok.prompt(format_question(p)) for p in problems]
        b, texts, correct, icl, per_prompt = sample_rounds(rollout, tok, problems, contexts, corpus, cfg,
                                                           cfg.seed * 1_000_003 + step * 1009 + dist.rank(), autocast)
        t_sample = time.time()

        # ---- 2. rewards; DAPO's dynamic sampling drops groups whose rewards are all equal (A ≡ 0)
        rewards = correct + cfg.format_reward * torch.tensor([float(boxed(t)) for t in texts])
        if cfg.overlong_buffer:  # DAPO §3.4, eq. 13
            rewards = rewards + overlong_penalty(b.lengths, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
        n_groups = int(b.group.max()) + 1
        zero_var = ~varied_groups(rewards, b.group, n_groups)  # [groups]
        keep = ~zero_var[b.group] if cfg.dynamic_sampling else torch.ones(len(rewards), dtype=torch.bool)
        b_all, correct_all, rewards_all = b, correct, rewards
        b, rewards = b.select(keep), rewards[keep]

        # ---- 3. score: the trainer's log-probs of the batch before any update: π_old when μ·M > 1 (with μ = M = 1
        # the update's own detached forward is π_old), π_ref with --kl-coef; before advantages, which some variants
        # base on them
        old_logp = ref_logp = None
        if cfg.epochs * cfg.mini_batches > 1:
            old_logp, _ = trainer_logprobs(model, b, cfg.micro_batch, cfg.temperature, tok.pad_id, device, autocast)
        if ref_model is not None:
            ref_logp, _ = trainer_logprobs(ref_model, b, cfg.micro_batch, cfg.temperature, tok.pad_id, device, autocast)
        t_score = time.time()

        # ---- 4. advantages: group-relative, one per completion, broadcast to its tokens; then sharpened (XRPO eq. 6)
        adv = group_advantages(rewards, b.group, cfg.adv_norm)  # [N]
        if cfg.overlong_mask:  # DAPO §3.4, overlong filtering: a completion cut at the budget keeps its reward in its
            # group's advantages but gets no loss tokens (all of it is skipped)
            b = replace(b, skip=torch.where(b.finished, b.skip, b.lengths))
        # XRPO §3.3: a correct rollout that the policy finds less likely than its group does on average gains a
        # bonus; s(y) (eq. 4) from π_old (eq. 4's π_θ before the update). Our choice: the scoring pass's log-probs
        # when the step makes one (μ·M > 1), in the context trained with, else the sampler's, in the context sampled
        # from (an ICL rollout's q̃), and no second forward is paid: the same weights in fp32, a bf16 copy under
        # --dtype auto on bf16 hardware
        bonus = torch.zeros_like(adv)
        if cfg.nov_lambda > 0:
            token_logp = b.sampler_logp if old_logp is None else old_logp
            adv, bonus = sharpen(adv, correct[keep], sequence_scores(token_logp, b.lengths), b.group, cfg.nov_lambda,
                                 cfg.nov_kappa, cfg.nov_all_correct)
        # Alg. 1 line 18: the step's correct rollouts join the corpus (every rank's: the corpus stays one; under
        # --no-icl too, unread, so that xrpo/corpus_size shows what the ablation gave up)
        update_corpus(corpus, dist.all_gather_list([problems[q].prompt for q in b_all.group]),
                      dist.all_gather_list(texts), dist.all_gather_list(correct_all.tolist()))

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
        # the allocation's statistics over every rank's prompts (a mean of per-rank minima would not be the minimum)
        metrics.update(xrpo_metrics(dist.all_gather_list(per_prompt), cfg, b_all.group, icl, correct_all, correct[keep],
                                    bonus, corpus))
        # means over completions and trained tokens weigh each rank by its count (XRPO's ranks hold different ones)
        counts = {"reward/": len(b_all.tokens), "response/": len(b_all.tokens), "reward/zero_var_groups": n_groups,
                  "policy/": stats["policy_tokens"]}
        metrics = dist.reduce_metrics(metrics, weights=counts, sums=METRIC_SUMS + XRPO_SUMS,
                                      maxes=METRIC_MAXES + XRPO_MAXES)
        log.log(step, {**metrics, **xrpo_rates(metrics)})
        if step % cfg.save_every == 0 or step == cfg.steps:
            checkpoint.save_run(model, optimizer, ckpt_dir, step, cfg, extra={"skipped_in_a_row": skipped_in_a_row,
                                                                             "xrpo_corpus": corpus.state_dict()})
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
