"""ExGRPO: learning to reason from experience (arXiv 2510.02245). grpo.py plus a replay buffer of the policy's own
successful trajectories: `diff grpo.py exgrpo.py` shows ExGRPO and nothing else.

    python exgrpo.py                                 # SmolLM2-135M-Instruct on generated arithmetic, 2-core CPU
    python exgrpo.py --steps 2 --run-name smoke      # any option: python exgrpo.py --help
    python exgrpo.py --run-name NAME --resume        # continue a run from its last checkpoint (buffer included)
    torchrun --nproc_per_node=8 exgrpo.py --model Qwen2.5-Math-7B --task openr1_math.jsonl --train-size 0 \
        --prompts-per-step 128 --mini-batches 2 --max-new-tokens 8192 --temperature 1.0 --start-acc 0.35 \
        --adv-norm none --loss-agg seq-mean-token-sum-norm --eps-high 0.2 --entropy-coef 0.001 \
        --max-grad-norm 0.015625 --skip-grad-norm 7.8125 --lr 1e-6 --warmup-steps 0 --decay-steps 0 \
        --weight-decay 0.01 --adam-beta2 0.999 --max-stored 0 --steps 700 --fsdp
                                                     # the paper's setting (§5.1, App. D, Table 4)

One step (ExGRPO §4, Alg. 1): once the batch accuracy has passed a threshold (the delayed start; from the next step
on, the mixed phase), every correct rollout of a partially solved question goes into the buffer with the trainer's
log-probs at collection time.
Each step then fills up to ρB of its B questions from the buffer: a question is drawn by its latest success count
k (a Gaussian preference for k = K/2), and its stored trajectory with the lowest mean token entropy under the
current policy is replayed as one member of a group of K whose other K - 1 members are fresh samples. Fresh tokens
get the plain ratio objective (unclipped in the mixed phase), replayed tokens -A f(w) with w the ratio to the
collecting policy and f(w) = w / (w + β) (§4.2, eq. 4). Questions solved by all K rollouts are retired for good.
The paper's host is Dr. GRPO (r - group mean, a constant normaliser) with no KL and an entropy bonus of 0.001
(§3.1, App. D); here the host is grpo.py's defaults, its training pool of 2000 included, so that the two files
compare on equal terms: questions come back through the buffer, not through the fresh draw (docs/exgrpo.md says why).
Table 6's ablations are switches: --no-is-correction, --no-policy-shaping, --trajectory-choice, --bucket-weighting
question, --replay-ratio 0.25 / 0.75; Table 3's σ is --bucket-sigma, and f's β is --shaping-beta. With the paper's
host, two small differences remain: Dr. GRPO's normaliser here is sequences x L_max where the authors' code divides
by ranks x L_max, so our gradient is 64x smaller in the command above (512 sequences a mini-batch, 8 ranks), whose
clip and skip thresholds are the authors' 1.0 and 500 divided by 64 (AdamW's step sees the scale only through its
ε); and the entropy bonus is aggregated like the surrogate, not as a token mean.

Under torchrun each rank owns the questions whose index is its rank modulo the world size: it draws its fresh
questions from them only, and keeps their buffer, buckets and retired set; nothing about the buffer crosses ranks.

Left out on purpose: the paper's dataset, prompt template and Math-Verify reward (we keep the project's tasks and
verifier), re-adding retired questions (an ablation, App. E), and the `linear_clip` bucket weighting of the
authors' code. GRPO options (KL, GSPO, TIS) still work but are not part of ExGRPO.
"""
import copy
import math
import time
from dataclasses import asdict, dataclass, replace

import torch

from common import checkpoint, dist
from common.batch import Batch, completion_logprobs, micro_batches, to_batch, token_index, trainer_logprobs, varied_share
from common.config import RunError, check, main_guard, parse
from common.evaluate import evaluate, evaluation_lost
from common.logger import MetricsLog, check_tracker
from common.memory import peak_rss_gb
from common.model import Transformer, compute_dtype
from common.optim import adamw
from common.options import high_entropy, overlong_penalty, token_mask
from common.sampler import Sample, generate
from common.tasks import format_question, load_task
from common.tokenizer import Tokenizer
from common.verifier import extract_answer, score
from kernels import policy_loss


@dataclass
class Config:
    # run
    run_name: str = ""  # writes runs/<run-name>/; empty = exgrpo-<date-time>
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
    adv_norm: str = "std"  # std (GRPO) or none (Dr. GRPO): divide group-centred rewards by their std? (paper: none)
    loss_agg: str = "token-mean"  # token-mean (DAPO) | seq-mean-token-mean (GRPO) | seq-mean-token-sum-norm (the paper's)
    eps_low: float = 0.2  # clip ratio below 1 - eps_low (fresh tokens are unclipped in the mixed phase)
    eps_high: float = 0.28  # clip ratio above 1 + eps_high (DAPO clip-higher; paper: 0.2, before replay starts)
    seq_ratio: bool = False  # GSPO's one length-normalised ratio per completion (its full recipe: docs/grpo.md)
    tis_cap: float = 0.0  # C: correct for the sampler copy by ρ = π_train / π_sampler, truncated min(ρ, C); 0 = off
    kl_coef: float = 0.0  # β: k3 KL to the initial model; 0 loads no reference model
    entropy_coef: float = 0.0  # entropy bonus: the loss subtracts this times the token entropy (paper: 0.001)
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
    # experience replay (ExGRPO §4); the options marked "Table 6" rerun the paper's ablations (ExGRPO Table 6)
    replay_ratio: float = 0.5  # ρ: up to ⌊ρB⌋ of a step's B questions come from the buffer (per rank); 0 = GRPO
    # our choice: 0.15, not the paper's 0.35 (set for 7B math models): just above untrained SmolLM2's batch accuracy
    # on arith (about 0.09, docs/exgrpo.md), so replay waits for the first learning
    start_acc: float = 0.15  # delayed start: collect after a step with batch accuracy above this, replay from the next
    # preferred success counts k: normal, normal-acc (in k/K), linear, sqrt, uniform (over buckets); question: every
    # stored question alike, whatever its bucket (Table 6 "w/o question selection")
    bucket_weighting: str = "normal"
    bucket_sigma: float = 1.0  # σ of the normal weightings (success-count units; accuracy units for normal-acc)
    # which stored trajectory of a drawn question replays: lowest-entropy (the paper's), highest-entropy or random
    # (Table 6 "highest-entropy trajectory" and "w/o trajectory selection")
    trajectory_choice: str = "lowest-entropy"
    trajectory_score: str = "mean"  # a trajectory's entropy: the mean (or sum) of its token entropies at --temperature
    # our choice (the paper never prunes): each draw scores every stored trajectory of the question under the current
    # policy, and a replayed question stores up to K - 1 more each time it comes back: the cap bounds that pass
    max_stored: int = 4  # trajectories kept per question, the most recent (0 = all, the paper's)
    # replayed tokens: -A f(w); off: the fresh tokens' ratio objective, unclipped in the mixed phase as the
    # authors' `no_reshape` is (Table 6 "w/o policy shaping")
    policy_shaping: bool = True
    shaping_beta: float = 0.1  # β of the shaping f(w) = w / (w + β) (ExGRPO §4.2; the paper's 0.1)
    is_correction: bool = True  # w = π_θ / π_past (collector); off: π_θ / π_θold (Table 6 "w/o IS correction")
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
               "tracker": ["none", "tensorboard", "wandb", "trackio"],
               "bucket_weighting": ["normal", "normal-acc", "linear", "sqrt", "uniform", "question"],
               "trajectory_choice": ["lowest-entropy", "highest-entropy", "random"],
               "trajectory_score": ["mean", "sum"]}


# Options a resumed run must share with the run it continues: they fix the data order and the model; and the buffer
# (its success counts are out of G, its log-probs at the sampling temperature).
RESUME_FIXED = ("seed", "task", "train_size", "prompts_per_step", "model", "group_size", "temperature")


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
    check(0 <= cfg.replay_ratio <= 1, "replay_ratio", "a share of the batch in [0, 1]")
    check(cfg.max_stored >= 0, "max_stored", "a number of trajectories per question, 0 for all")
    check(cfg.bucket_sigma > 0, "bucket_sigma", "a positive number")
    check(cfg.shaping_beta > 0, "shaping_beta", "a positive number")
    # retired (all-correct) and all-wrong groups are part of the buffer's bookkeeping: every group must be seen
    check(not cfg.dynamic_sampling, "dynamic_sampling", "off (ExGRPO keeps every group)")
    # ExGRPO §4.2 puts policy shaping in the clipped surrogate's place on replayed tokens; and those keep no entropies
    check(cfg.loss_type == "clip" and cfg.top_entropy == 1, "loss_type/top_entropy",
          "clip and 1 (ExGRPO's shaping replaces the clipped surrogate; replayed trajectories store no entropies)")


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


# ----------------------------------------------------------------------------- ExGRPO: the experience buffer

@dataclass
class Trajectory:
    tokens: tuple  # the completion's token ids as sampled, its stop token if it stopped (replayed verbatim)
    logp: torch.Tensor  # [len(tokens)] fp32 log π_θold of each token when collected: the trainer's (or its sampler's)


class Experience:
    """ExGRPO §4.1: the replay buffer E (question id -> its distinct correct trajectories), the bucket label of each
    question (the success count k of its latest collected group) and the retired set S (questions all K rollouts
    solved). Trajectories are token ids with the trainer's log-probs at collection time, the denominator of the
    replayed tokens' importance ratio."""

    def __init__(self, group_size: int, max_stored: int = 0):
        self.K, self.max_stored = group_size, max_stored  # max_stored: the most recent kept per question (0: all)
        self.pool: dict[int, list[Trajectory]] = {}  # E
        self.bucket: dict[int, int] = {}  # question id -> k of its latest collected group
        self.retired: set[int] = set()  # S

    def to_store(self, qid: int, correct: list, completions: list, collect: bool, replayed: bool = False,
                 storable: list | None = None) -> list[bool]:
        """Which of a group's completions record() stores: correct, not stored yet (nor earlier in the group), the
        question partly solved (0 < k < K), collecting; with max_stored, only the last max_stored of them. These are
        the rows whose collection-time log-probs the step must score. replayed: the group's first row came from the
        buffer; it is never stored again (also when the question's fresh group earlier in the step pushed it out under
        max_stored: stored anew, it would carry this step's log-probs as π_past). storable: the completions that may
        be stored (None: all; under --overlong-mask the finished ones, as a truncated one would replay without a loss
        token; they still count in k)."""
        k = sum(bool(c) for c in correct)
        seen, new = {t.tokens for t in self.pool.get(qid, [])}, []
        storable = storable if storable is not None else [True] * len(completions)
        for i, (ok, t) in enumerate(zip(correct, completions)):
            new.append(collect and 0 < k < self.K and bool(ok) and storable[i] and tuple(t) not in seen
                       and not (replayed and i == 0))
            seen.add(tuple(t))
        if self.max_stored and sum(new) > self.max_stored:  # the older ones would be dropped at once
            last = [i for i, s in enumerate(new) if s][-self.max_stored:]
            new = [i in last for i in range(len(new))]
        return new

    def to_store_step(self, groups: list, collect: bool) -> list[list[bool]]:
        """to_store of each of a step's groups [(qid, correct, completions, replayed, storable)] as record() will meet
        them, in order. A question can come twice in one step (replayed, and drawn fresh): its second group is
        compared with a buffer that already holds what its first group stored, so the marks come from record() on a
        copy of the buffer."""
        shadow = Experience(self.K, self.max_stored)
        shadow.pool = {q: list(self.pool.get(q, [])) for q, *_ in groups}
        marks = []
        for q, correct, completions, replayed, storable in groups:
            marks.append(shadow.to_store(q, correct, completions, collect, replayed, storable))
            shadow.record(q, correct, completions, [torch.zeros(len(t)) for t in completions], collect, replayed,
                          storable)
        return marks

    def record(self, qid: int, correct: list, completions: list, logps: list, collect: bool, replayed: bool = False,
               storable: list | None = None):
        """One group's outcome (Alg. 1 l.25-32). All K correct retires the question, from step 1 on. With `collect`
        (once the delayed start has fired), 0 < k < K stores each correct completion not stored yet (to_store) and
        labels the question k; with max_stored, the question keeps its most recent ones. All-wrong groups store
        nothing, keep their old label and are not retired."""
        k = sum(bool(c) for c in correct)
        if k == self.K:
            self.retired.add(qid)
            return
        if not collect or k == 0:
            return
        self.bucket[qid] = k
        stored = self.pool.setdefault(qid, [])
        for new, tokens, logp in zip(self.to_store(qid, correct, completions, collect, replayed, storable), completions,
                                     logps):
            if new:  # de-duplicated by exact content
                assert len(logp) == len(tokens) and torch.isfinite(logp).all(), "a scored log-prob for every token"
                # our choice: token ids, not decoded text as the authors' code keeps (re-tokenising text need not
                # give the same tokens back, and then the stored log-probs would not line up)
                stored.append(Trajectory(tuple(tokens), logp.detach().float().cpu().clone()))
        if self.max_stored:
            del stored[:-self.max_stored]

    def purge(self):
        """After each step, retired questions leave the buffer and the buckets (Alg. 1 l.32)."""
        for qid in self.retired:
            self.pool.pop(qid, None)
            self.bucket.pop(qid, None)

    def valid(self) -> list[int]:
        """E_valid: the questions that can be replayed (not retired, at least one stored trajectory), sorted."""
        return sorted(q for q, ts in self.pool.items() if ts and q not in self.retired and q in self.bucket)

    def buckets(self) -> dict[int, list[int]]:
        """k -> the valid question ids labelled k, for k = 1 .. K-1."""
        out = {k: [] for k in range(1, self.K)}
        for q in self.valid():
            out[self.bucket[q]].append(q)
        return out

    def n_trajectories(self) -> int:
        return sum(len(ts) for ts in self.pool.values())

    def state_dict(self) -> dict:
        return {"pool": {q: [(list(t.tokens), t.logp) for t in ts] for q, ts in self.pool.items()},
                "bucket": dict(self.bucket), "retired": sorted(self.retired)}

    def load_state_dict(self, state: dict):
        self.pool = {int(q): [Trajectory(tuple(toks), logp) for toks, logp in ts] for q, ts in state["pool"].items()}
        self.bucket = {int(q): int(k) for q, k in state["bucket"].items()}
        self.retired = set(int(q) for q in state["retired"])


# ----------------------------------------------------------------------------- ExGRPO: which questions to replay

def bucket_weights(K: int, method: str = "normal", sigma: float = 1.0) -> torch.Tensor | None:
    """Unnormalised preference w_k of the buckets k = 1 .. K-1 (ExGRPO §4.1), [K-1] float64.
    normal: N(k; K/2, σ) in success-count units, as the authors' code (σ = 1 puts 40% on k = K/2 when K = 8);
    normal-acc: N(k/K; 0.5, σ) in accuracy units, as the paper's formula reads (σ = 1 is nearly uniform);
    linear, sqrt: k/K and sqrt(k/K); uniform: all buckets alike; question: None, no buckets (every question alike)."""
    if method == "question":
        return None
    k = torch.arange(1, K, dtype=torch.float64)
    # our choice: count units by default; the paper's text and the authors' code disagree, its results are the code's
    if method in ("normal", "normal-acc"):
        x = (k - K / 2) if method == "normal" else (k / K - 0.5)
        return torch.exp(-0.5 * (x / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
    return {"linear": k / K, "sqrt": (k / K).sqrt(), "uniform": torch.ones_like(k)}[method]


def bucket_probs(weights: torch.Tensor, sizes: list) -> torch.Tensor:
    """p_k = w_k / Σ over non-empty buckets k' of w_k', and 0 for an empty bucket. weights, sizes: [K-1]."""
    filled = torch.tensor(sizes) > 0
    w = weights * filled
    # our choice: where every filled bucket's weight underflows to 0 (K = 100, only buckets 1 and 99 filled: e^-1200),
    # they are drawn alike, which is also what the weights' true ratio gives when the buckets lie symmetric about K/2
    if w.sum() == 0:
        w = filled.double()
    return w / w.sum() if w.sum() > 0 else w


def replay_count(rho: float, B: int, n_valid: int) -> int:
    """n = min(⌊ρB⌋, |E_valid|) replayed questions in a batch of B (ExGRPO §4.2); the other B - n are fresh."""
    return min(math.floor(rho * B + 1e-9), n_valid)  # + 1e-9: 0.29 * 100 is 28.999999999999996 in floats


def bucket_sample(buckets: dict, n: int, weights: torch.Tensor | None, gen: torch.Generator) -> list[int]:
    """n distinct question ids (ExGRPO §4.1): bucket counts c ~ Multinomial(n, p); a bucket asked for more than it
    holds hands the overflow, one unit at a time, to the buckets with room left, chosen ∝ p among them (as the
    authors' sampler does); then c_k ids uniformly without replacement from bucket k. weights None: n ids uniformly
    without replacement from all the buckets' questions together (Table 6's "w/o question selection")."""
    ks = sorted(buckets)
    sizes = [len(buckets[k]) for k in ks]
    n = min(n, sum(sizes))
    if n == 0:
        return []
    if weights is None:
        every = sorted(q for k in ks for q in buckets[k])
        return [every[int(i)] for i in torch.randperm(len(every), generator=gen)[:n]]
    p = bucket_probs(weights, sizes)
    counts = torch.bincount(torch.multinomial(p, n, replacement=True, generator=gen), minlength=len(ks)).tolist()
    overflow = sum(max(c - s, 0) for c, s in zip(counts, sizes))
    counts = [min(c, s) for c, s in zip(counts, sizes)]
    for _ in range(overflow):
        room = torch.tensor([c < s for c, s in zip(counts, sizes)])
        q = p * room
        q = q if q.sum() > 0 else room.double()  # as in bucket_probs: alike if p underflowed on every bucket with room
        counts[int(torch.multinomial(q, 1, generator=gen))] += 1
    ids = []
    for k, c in zip(ks, counts):
        ids += [buckets[k][int(i)] for i in torch.randperm(len(buckets[k]), generator=gen)[:c]]
    return ids


def step_questions(exp: Experience, fresh: list, n: int, weights, gen: torch.Generator) -> tuple[list, list]:
    """The step's question ids and which are replayed (ExGRPO §4.2): n drawn from the buffer and the first B - n of
    the B fresh ones (the rest are dropped this step, as the authors' loader does), in a seeded random order, as the
    authors' collate shuffles the mixed batch: with M > 1 mini-batches, replayed groups are not all in the first."""
    replayed = bucket_sample(exp.buckets(), n, weights, gen)
    qids = replayed + fresh[:len(fresh) - len(replayed)]
    if not replayed:  # nothing to mix: the fresh order, so that replay off is grpo.py's batch
        return qids, [False] * len(qids)
    order = torch.randperm(len(qids), generator=gen).tolist()
    return [qids[i] for i in order], [i < len(replayed) for i in order]


# ----------------------------------------------------------------------------- ExGRPO: which trajectory to replay

def select_trajectories(model, exp: Experience, qids: list, contexts: list, micro_batch, pad_id, device, autocast,
                        how: str = "mean", choice: str = "lowest-entropy", gen=None, temperature: float = 1.0,
                        now_logp: list | None = None) -> list[Trajectory]:
    """For each drawn question, o* = its stored trajectory of lowest mean token entropy under the current policy,
    H̄(o) = (1/|o|) Σ_t H(π_θ(·|q, o_<t)) over the completion tokens (ExGRPO §3.2, §4.1), recomputed each time the
    question is drawn; at the sampling `temperature`, as the authors' code computes it (verl divides the logits by
    the rollout temperature; §3.2 does not say). how="sum": Σ_t H (no length division). contexts[j]: question
    qids[j]'s prompt. model: our choice, the sampling copy (the trainer itself in fp32 on one process; the authors
    score with the trainer): a bf16 copy may order near-ties otherwise.
    choice: highest-entropy takes the largest H̄ instead; random one stored trajectory uniformly (with gen), with no
    forward (ExGRPO Table 6). now_logp: a list that gets each chosen trajectory's log-probs under `model`, which the
    forward computes beside the entropies (left empty under random)."""
    if choice == "random":
        return [exp.pool[q][int(torch.randint(len(exp.pool[q]), (), generator=gen))] for q in qids]
    cands = [(j, t) for j, q in enumerate(qids) for t in exp.pool[q]]
    if not cands:
        return []
    b = Batch(context=[contexts[j] for j, _ in cands], tokens=[list(t.tokens) for _, t in cands],
              group=torch.arange(len(cands)), skip=torch.zeros(len(cands), dtype=torch.long),
              sampler_logp=torch.cat([t.logp for _, t in cands]), finished=torch.ones(len(cands), dtype=torch.bool),
              answer=[None] * len(cands))
    logp, entropy = trainer_logprobs(model, b, micro_batch, temperature, pad_id, device, autocast)
    # our choice: §3.2's mean over the completion's own tokens (Alg. 1 writes a mean NLL, the authors' code averages
    # summed entropies over a mask that does not line up with the completion)
    scores = [h.mean() if how == "mean" else h.sum() for h in entropy.split(b.lengths.tolist())]
    scores = [-h for h in scores] if choice == "highest-entropy" else scores
    best = {}
    for (j, t), h, lp in zip(cands, scores, logp.split(b.lengths.tolist())):
        if j not in best or h < best[j][0]:  # a tie keeps the earlier-stored trajectory
            best[j] = (h, t, lp)
    if now_logp is not None:
        now_logp.extend(best[j][2] for j in range(len(qids)))
    return [best[j][1] for j in range(len(qids))]


def with_replayed(groups: list, replay: list, replayed: list, stop_ids) -> list:
    """Mixed groups (ExGRPO §4.2): where replay[j], the next of the replayed trajectories joins question j's K - 1
    fresh samples, first. Its 'sampler' log-probs are the stored collection-time ones (π_past of its tokens)."""
    stored = iter(replayed)
    out = []
    for g, r in zip(groups, replay):
        t = next(stored) if r else None
        out.append(g if t is None else [Sample(tokens=list(t.tokens), logprobs=t.logp,
                                               entropies=torch.zeros(len(t.tokens)),
                                               finished=t.tokens[-1] in stop_ids)] + g)
    return out


def scored_rows(model, b: Batch, rows: torch.Tensor, micro_batch, temperature, pad_id, device, autocast):
    """The scoring pass over the completions where rows [N] is True: their trainer log-probs in b's flat [n_tok]
    layout, NaN elsewhere. ExGRPO needs only the rows the buffer stores and those that replay; under torchrun every
    row, since every rank must run the same forwards (FSDP2 gathers the weights in each one) whatever it stores."""
    if dist.world() > 1:
        rows = torch.ones_like(rows)
    out = torch.full((int(b.lengths.sum()),), math.nan)
    if rows.any():
        out[rows.repeat_interleave(b.lengths)] = trainer_logprobs(model, b.select(rows), micro_batch, temperature,
                                                                  pad_id, device, autocast)[0]
    return out


def delayed_start(mixed: bool, batch_acc: float, threshold: float) -> bool:
    """ExGRPO §4.2: mixed-policy training begins after the first step whose batch accuracy (the mean verifier
    score, reward/acc, over all B·K rollouts) is strictly above the threshold, and never stops."""
    return mixed or batch_acc > threshold


# ----------------------------------------------------------------------------- ExGRPO: the fresh questions

class QuestionStream:
    """This rank's fresh questions, B per step: a seeded permutation of its active question ids each epoch. At an
    epoch start the retired questions leave the active set if it still holds more than B + 20 (the authors' trainer
    tests the size of the set left by the last filtering, then filters; once the test fails the set stays as it is,
    and a retired question never comes back). Without retirement (and on one process) it gives grpo.py's
    step_prompts exactly. Its active set and position go in the checkpoint."""

    def __init__(self, ids: list, B: int, seed: int):
        self.ids, self.B, self.seed = list(ids), B, seed
        self.active = list(ids)
        self.epoch, self.order, self.pos = -1, [], 0

    def next(self, retired: set) -> list[int]:
        """The step's B fresh questions. Our choice: a batch runs on across an epoch's end into the next epoch's
        order, as grpo.py's draw does (the authors' loader drops the last partial batch): once retirement leaves an
        active set that B does not divide, a step may hold one question twice."""
        out = []
        while len(out) < self.B:
            if self.pos == len(self.order):
                self.new_epoch(retired)
            out.append(self.order[self.pos])
            self.pos += 1
        return out

    def new_epoch(self, retired: set):
        self.epoch, self.pos = self.epoch + 1, 0
        # the authors' B + 20 rule (mix_trainer_experience.py), with this rank's B and ids (per rank: our choice)
        if len(self.active) > self.B + 20:
            kept = [q for q in self.active if q not in retired]
            # our choice: never fewer than B questions (the authors' drop_last would then make empty epochs)
            self.active = kept if len(kept) >= self.B else self.active
        perm = torch.randperm(len(self.active), generator=torch.Generator().manual_seed(self.seed * 7919 + self.epoch))
        self.order = [self.active[int(i)] for i in perm]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "order": list(self.order), "pos": self.pos, "active": list(self.active)}

    def load_state_dict(self, s: dict):
        self.epoch, self.order, self.pos = s["epoch"], list(s["order"]), s["pos"]
        self.active = list(s.get("active", self.ids))  # checkpoints before it was kept: all of the rank's ids


# -------------------------------------------------------------------------------------------- loss

def token_loss(logp, old_logp, adv, entropy, cfg, ref_logp=None, replayed=None, past_logp=None, **kw):
    """grpo.py's fused per-token loss (kernels.policy_loss, a Triton kernel on a GPU; token_loss_plain below writes
    grpo.py's out, without the replay terms) with weight 0 on replayed tokens, which take -A f(w) instead (ExGRPO
    eq. 4, written here). logp, entropy [n] carry gradients; old_logp, adv, ref_logp [n] and kw (weights, GSPO's
    seq_ids, TIS's sampler_logp) are constants. ExGRPO: replayed [n] bool marks the replayed tokens, past_logp [n]
    their log-probs under the policy that collected them, π_past."""
    shaped = replayed if replayed is not None and cfg.policy_shaping else None
    if replayed is not None and cfg.is_correction:  # importance ratio to π_past (§4.2); Table 6 "w/o IS": to π_θold
        old_logp = torch.where(replayed, past_logp, old_logp)
        if kw.get("sampler_logp") is not None:  # replayed tokens were not sampled now: no TIS factor on them
            kw["sampler_logp"] = torch.where(replayed, old_logp, kw["sampler_logp"])
    mask = kw.get("weights")  # the update's constant per-token factor (the GRPO-family masks), or None
    if shaped is not None:  # the clipped surrogate is 0 on replayed tokens; they take -A f(w) below instead
        kw["weights"] = (~shaped).float() * (1 if mask is None else mask)
    loss, clipped_low, clipped_high = policy_loss(
        logp, old_logp, adv, cfg.eps_low, cfg.eps_high, ref_logp=ref_logp, kl_coef=cfg.kl_coef, entropy=entropy,
        entropy_coef=cfg.entropy_coef, tis_cap=tis_cap(cfg, kw), **kw)
    if shaped is None:
        return loss, clipped_low, clipped_high
    # ExGRPO §4.2 eq. 4, policy shaping: -A f(w), w = π_θ / π_past, f(w) = w / (w + β) = sigmoid(log w - log β),
    # never clipped: its gradient -A β w / (w + β)^2 ∇log π_θ is the plain importance-sampled one, -A w ∇log π_θ,
    # times β / (w + β)^2: up to 1/β larger for tokens the policy has moved away from (w -> 0), damped for w >> β.
    # KL and entropy above still apply to these tokens
    log_w = torch.where(shaped, logp - old_logp.detach(), 0.0)  # 0 elsewhere: no non-finite ratio in the backward
    shaping = torch.where(shaped, adv * torch.sigmoid(log_w - math.log(cfg.shaping_beta)), 0.0)
    loss = loss - (shaping if mask is None else shaping * mask).to(loss.dtype)
    return loss, clipped_low & ~shaped, clipped_high & ~shaped


def tis_cap(cfg, kw):
    """The fused loss's truncated-IS cap: --tis-cap when the update passed the sampler's log-probs (token-truncate)."""
    return cfg.tis_cap if kw.get("sampler_logp") is not None else None


def token_loss_plain(logp, old_logp, adv, entropy, cfg, ref_logp=None, weights=None, seq_ids=None, sampler_logp=None):
    """grpo.py's token_loss written out: the fused policy_loss call inside token_loss above, without the replay terms
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

def exgrpo_metrics(exp: Experience, n, B, mixed, logp, old_logp, beta) -> dict:
    """The buffer's state after the step, this step's replay share, the mixed-phase flag, and the replayed tokens'
    ratio w* = π_θ / π_old at the start of the update (π_old = π_past with the IS correction; 1 without it) with
    its shaped value f(w*) = w* / (w* + β) (logged, not applied, with --no-policy-shaping), summed over ranks."""
    w = (logp - old_logp).exp()  # [replayed tokens]
    f = w / (w + beta)
    w_sum, f_sum, count = dist.all_reduce_sum(torch.tensor([w.sum().item(), f.sum().item(), len(w)])).tolist()
    out = {"exgrpo/buffer_questions": len(exp.valid()), "exgrpo/buffer_trajectories": exp.n_trajectories(),
           "exgrpo/retired": len(exp.retired), "exgrpo/replay_share": n / B, "exgrpo/mixed": float(mixed),
           **{f"exgrpo/bucket_{k}": len(ids) for k, ids in exp.buckets().items()}}
    if count:
        out.update({"exgrpo/w_mean": w_sum / count, "exgrpo/f_w_mean": f_sum / count})
    return out


EXGRPO_SUMS = ("exgrpo/buffer_questions", "exgrpo/buffer_trajectories", "exgrpo/retired")  # and exgrpo/bucket_k


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
        saved = state["extra"].get("exgrpo", [])
        check(len(saved) == dist.world(), "resume", f"an exgrpo.py checkpoint written by {dist.world()} processes "
              f"(this one holds {len(saved)} buffers: each process keeps the buffer of its own questions)")
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
    # ExGRPO's state: this rank's questions, their buffer, and whether the mixed phase has begun. our choice: a rank
    # owns the questions whose index is its rank mod world, so a question's buffer, label and retirement live on one rank
    check(len(train) >= dist.world(), "train_size", f"at least {dist.world()} questions, one or more for each process")
    exp, stream = Experience(G, cfg.max_stored), QuestionStream(range(dist.rank(), len(train), dist.world()), B, cfg.seed)
    # ρ = 0 turns ExGRPO off: no mixed phase (so no unclipped fresh tokens), no retirement: grpo.py's run exactly
    # (on one process, with --train-size 2000; under torchrun the questions are split by rank)
    replaying = cfg.replay_ratio > 0
    mixed = replaying and cfg.start_acc < 0  # our choice: < 0 mixes from step 1 (the paper's Llama-3.1-8B base run)
    if state is not None:
        mine = saved[dist.rank()]
        exp.load_state_dict(mine["buffer"])
        stream.load_state_dict(mine["stream"])
        mixed = replaying and mine["mixed"]
    weights = bucket_weights(G, cfg.bucket_weighting, cfg.bucket_sigma)
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
        # ---- 1. sample: n questions from the buffer (1 replayed + G - 1 fresh samples each), B - n fresh (G each)
        t0 = time.time()
        n = replay_count(cfg.replay_ratio, B, len(exp.valid())) if mixed else 0
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + dist.rank())
        qids, replay = step_questions(exp, stream.next(exp.retired), n, weights, gen)  # [B], replay[j]: from the buffer
        problems = [train[q] for q in qids]
        contexts = [tok.prompt(format_question(p)) for p in problems]
        # (the choice's forward over stored trajectories is timed with the sampling, perf/sample_s); now_logp gets the
        # chosen ones' log-probs under the current policy from it
        now_logp = []
        replayed = select_trajectories(rollout, exp, [q for q, r in zip(qids, replay) if r],
                                       [c for c, r in zip(contexts, replay) if r], cfg.micro_batch, tok.pad_id, device,
                                       autocast, cfg.trajectory_score, cfg.trajectory_choice, gen,
                                       temperature=cfg.temperature, now_logp=now_logp)
        with torch.no_grad(), autocast:
            groups = generate(rollout, contexts, n=[G - r for r in replay], max_new_tokens=cfg.max_new_tokens,
                              temperature=cfg.temperature, top_p=cfg.top_p, stop_ids=tok.stop_ids,
                              seed=cfg.seed * 1_000_003 + step * 1009 + dist.rank())
        b = to_batch(contexts, with_replayed(groups, replay, replayed, tok.stop_ids), [p.answer for p in problems],
                     group_ids=range(B))
        is_replay = torch.tensor([r and i == 0 for r in replay for i in range(G)])  # [N]
        t_sample = time.time()

        # ---- 2. rewards; DAPO's dynamic sampling drops groups whose rewards are all equal (A ≡ 0)
        correct, rewards = verify(b, tok, cfg)  # [N]
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
        # ExGRPO: the buffer keeps the trainer's log-probs of the correct rollouts it collects (§4.1); w* needs the
        # replayed rows' now. our choice: at the sampling temperature, which every ratio here uses (the paper's T = 1).
        # Where the model samples itself (fp32, no FSDP2) both are at hand: the sampler's log-probs are the trainer's
        # up to the kernels' rounding, the selection's forward scored the replayed rows. A bf16 copy's are not: scored.
        # Under --overlong-mask a truncated completion is not stored: replayed, it would have no loss token
        storable = b.finished | (not cfg.overlong_mask)  # [N]
        groups = [(q, correct[j * G:(j + 1) * G].tolist(), b.tokens[j * G:(j + 1) * G], replay[j],
                   storable[j * G:(j + 1) * G].tolist()) for j, q in enumerate(qids)]
        store = torch.tensor([s for marks in exp.to_store_step(groups, mixed) for s in marks])  # [N]
        replay_tok, past_logp = is_replay.repeat_interleave(b.lengths), b.sampler_logp  # [n_tok]
        if old_logp is not None:  # the pass above scored every row
            scored_logp = old_logp
        elif rollout is model and len(now_logp) == len(replayed):  # (under random choice no forward chose them)
            scored_logp = past_logp.clone()
            scored_logp[replay_tok] = torch.cat([torch.zeros(0), *now_logp])
        else:
            scored_logp = scored_rows(model, b, store | is_replay, cfg.micro_batch, cfg.temperature, tok.pad_id, device,
                                      autocast)
        tok_logps = scored_logp.split(b.lengths.tolist())
        # retire all-correct questions; collect once the delayed start has fired
        for j, (q, group_correct, completions, from_buffer, ok) in enumerate(groups if replaying else []):
            exp.record(q, group_correct, completions, tok_logps[j * G:(j + 1) * G], collect=mixed, replayed=from_buffer,
                       storable=ok)
        # replayed rows carry their stored log-probs π_past as 'sampler' log-probs; they were not sampled now, so the
        # sampler-trainer mismatch (and TIS) sees the trainer's own there
        b.sampler_logp = torch.where(replay_tok, scored_logp, past_logp)
        t_score = time.time()

        # ---- 4. advantages: group-relative, one per completion, broadcast to its tokens
        adv = group_advantages(rewards, b.group, cfg.adv_norm)  # [N]
        if cfg.overlong_mask:  # DAPO §3.4, overlong filtering: a completion cut at the budget keeps its reward in its
            # group's advantages but gets no loss tokens (all of it is skipped)
            b = replace(b, skip=torch.where(b.finished, b.skip, b.lengths))

        # ---- 5. update: μ epochs x M mini-batches of clipped policy-gradient steps, then refresh the sampler.
        # Replayed tokens: -A f(w) against π_past (token_loss); fresh tokens: unclipped once mixed training has begun
        # (ExGRPO App. D, Table 4), clipped before it (as the authors' code)
        update_cfg = replace(cfg, eps_low=1.0, eps_high=math.inf) if mixed else cfg
        replay_kw = {"replayed": replay_tok, "past_logp": past_logp} if n else None
        for param_group in optimizer.param_groups:  # this step's rate: warm-up, constant, then decay (lr_factor)
            param_group["lr"] = cfg.lr * lr_factor(step - 1, cfg)
        stats = update(policy, model, optimizer, b, adv, update_cfg, tok.pad_id, device, autocast, old_logp, ref_logp,
                       loss_kw=replay_kw)
        # optimizer steps skipped since the last one taken, counting earlier training steps' when this one took none
        skipped_in_a_row = int(stats["skipped_since_last_step"]) + (skipped_in_a_row if stats["opt_steps"] == 0 else 0)
        if skipped_in_a_row >= cfg.max_skipped:  # a diverged run: stop before it wastes more time
            raise RunError(f"step {step}: {skipped_in_a_row} optimizer steps in a row skipped for a non-finite or too "
                           f"large gradient norm (last {stats['last_grad_norm']:.3g}); lower --lr. "
                           f"{checkpoint.kept(ckpt_dir)}")
        dist.sync_rollout(model, rollout)
        exp.purge()
        correct_sum, rollouts = dist.all_reduce_sum(torch.tensor([correct_all.sum().item(), len(correct_all)])).tolist()
        was_mixed, mixed = mixed, replaying and delayed_start(mixed, correct_sum / rollouts, cfg.start_acc)  # global
        t_train = time.time()

        # ---- 6. log, save, evaluate
        metrics = step_metrics(b_all, correct_all, rewards_all, n_groups, zero_var.sum().item(), zero_var.sum().item()
                               if cfg.dynamic_sampling else 0, stats, (t0, t_sample, t_score, t_train))
        metrics["optim/lr"] = optimizer.param_groups[0]["lr"]
        metrics["response/overlong_masked"] = float(cfg.overlong_mask) * (~b.finished).sum().item()
        # reward/ and response/ count the replayed rows too (correct by construction); exgrpo/fresh_acc does not.
        # replayed trajectories were sampled in an earlier step: not this step's sampling work
        metrics["perf/sampled_tokens"] -= b_all.lengths[is_replay].sum().item()
        metrics["perf/sample_tok_s"] = metrics["perf/sampled_tokens"] / (t_sample - t0)
        w_old = past_logp if cfg.is_correction else scored_logp  # the denominator of the replayed tokens' ratio
        metrics.update(exgrpo_metrics(exp, n, B, was_mixed, scored_logp[replay_tok], w_old[replay_tok],
                                      cfg.shaping_beta))
        metrics["exgrpo/fresh_acc"] = correct_all[~is_replay].float().mean().item()
        sums = METRIC_SUMS + EXGRPO_SUMS + tuple(k for k in metrics if k.startswith("exgrpo/bucket_"))
        # means over completions and trained tokens weigh each rank by its count (XRPO's ranks hold different ones)
        counts = {"reward/": len(b_all.tokens), "response/": len(b_all.tokens), "reward/zero_var_groups": n_groups,
                  "policy/": stats["policy_tokens"], "exgrpo/fresh_acc": int((~is_replay).sum())}
        log.log(step, dist.reduce_metrics(metrics, weights=counts, sums=sums, maxes=METRIC_MAXES))
        if step % cfg.save_every == 0 or step == cfg.steps:
            checkpoint.save_run(model, optimizer, ckpt_dir, step, cfg, extra={"skipped_in_a_row": skipped_in_a_row,
                                "exgrpo": dist.all_gather_list([{"buffer": exp.state_dict(), "stream": stream.state_dict(),
                                                                  "mixed": mixed}])})  # per rank, rank order
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
