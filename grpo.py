"""GRPO: group-relative policy optimisation from verifiable rewards. The baseline; every other algorithm
file repeats this loop and changes only what makes it different (`diff grpo.py exgrpo.py`).

    python grpo.py                                   # SmolLM2-135M-Instruct on generated arithmetic, 2-core CPU
    python grpo.py --steps 2 --run-name smoke        # any option: python grpo.py --help
    python grpo.py --run-name NAME --resume          # continue a run from its last checkpoint
    torchrun --nproc_per_node=8 grpo.py --model Qwen2.5-Math-1.5B --task math500 ...   # see README

One step (spec = ../shared/specs/grpo.md, cited as "spec N"): sample G completions for each of B prompts,
score them with the verifier, turn rewards into group-relative advantages, then run μ epochs of clipped
policy-gradient updates over M mini-batches. Sources: DeepSeekMath (GRPO), DAPO (clip-higher, token-mean,
dynamic sampling), Dr. GRPO (no std, length-unbiased normalisation).

Left out on purpose: a format reward (off by default, --format-reward adds it), length penalties,
refilling groups dropped by dynamic sampling (we drop them and log how many), value models.
"""
import copy
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import torch

from common import checkpoint, dist
from common.config import check, main_guard, parse
from common.evaluate import evaluate
from common.logger import MetricsLog
from common.model import Transformer, compute_dtype
from common.sampler import generate
from common.tasks import format_question, load_task
from common.tokenizer import Tokenizer
from common.verifier import extract_answer, score
from kernels import policy_loss


@dataclass
class Config:
    # run
    run_name: str = ""  # writes runs/<run-name>/; empty = grpo-<date-time>
    resume: bool = False  # continue runs/<run-name>/ from its last checkpoint
    seed: int = 0  # seeds data order, sampling and init; same seed on CPU = same run
    device: str = "auto"  # auto (cuda if available), cpu or cuda
    dtype: str = "auto"  # matmul dtype: auto (bf16 on GPUs and CPUs with bf16 units, else float32), float32, bfloat16
    # model and data
    model: str = "smollm2"  # Hugging Face folder (Llama / Qwen2 / Qwen3) or smollm2 (offline default)
    task: str = "arith"  # arith (generated), gsm8k, math500, aime24, amc23, or a .jsonl file
    train_size: int = 2000  # problems generated for arith (ignored for data files)
    # rollouts (spec 1)
    steps: int = 15  # training steps
    prompts_per_step: int = 8  # B: prompts per step (across all ranks)
    group_size: int = 8  # G: completions per prompt
    max_new_tokens: int = 96  # L_max: completion budget in tokens
    temperature: float = 0.8  # T_s: sampling temperature; the trainer scores logits / T_s too
    top_p: float = 1.0  # nucleus sampling (1 = off); log-probs stay those of the full softmax
    format_reward: float = 0.0  # added to the reward when the answer is written in \boxed{} (spec 2)
    # advantages and loss (spec 3-7)
    adv_norm: str = "std"  # std (GRPO) or none (Dr. GRPO): divide group-centred rewards by their std?
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
    eps_low: float = 0.2  # clip ratio below 1 - eps_low
    eps_high: float = 0.28  # clip ratio above 1 + eps_high (DAPO clip-higher)
    kl_coef: float = 0.0  # β: k3 KL to the initial model; 0 loads no reference model
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal (DAPO)
    epochs: int = 1  # μ: passes over each batch of rollouts
    mini_batches: int = 1  # M: optimizer steps per epoch
    micro_batch: int = 16  # completions per forward/backward (gradient accumulation; no effect on the math)
    # optimizer (spec 8)
    lr: float = 3e-5  # AdamW learning rate after warm-up
    warmup_steps: int = 3  # linear warm-up from 0
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping
    grad_checkpointing: bool = False  # recompute activations in backward (less memory, more time)
    fsdp: bool = False  # under torchrun: shard weights, gradients and optimizer state with FSDP2 (else DDP)
    # evaluation and checkpoints
    eval_every: int = 15  # evaluate every N steps (and before step 1 and after the last)
    eval_size: int = 100  # held-out problems per evaluation
    eval_samples: int = 0  # sampled completions per problem for pass@k / maj@k (0 = greedy only)
    save_every: int = 15  # checkpoint every N steps (and after the last)

    choices = {"adv_norm": ["std", "none"], "loss_agg": ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
               "device": ["auto", "cpu", "cuda"],
               "dtype": ["auto", "float32", "bfloat16"]}


def validate(cfg: Config):
    """Refuse impossible options before anything is loaded or written."""
    for name in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "epochs", "mini_batches", "micro_batch", "eval_size"):
        check(getattr(cfg, name) > 0, name, "a positive integer")
    check(cfg.temperature > 0, "temperature", "a positive number (the trainer divides logits by it)")
    check(0 < cfg.top_p <= 1, "top_p", "a number in (0, 1]")
    check(0 <= cfg.eps_low < 1 and cfg.eps_high >= 0, "eps_low/eps_high", "0 <= eps_low < 1 and eps_high >= 0")
    check(cfg.lr > 0 and cfg.kl_coef >= 0, "lr/kl_coef", "lr > 0 and kl_coef >= 0")
    check(cfg.prompts_per_step % dist.world() == 0, "prompts_per_step", f"a multiple of the world size {dist.world()}")
    # ranks would drop different numbers of groups and disagree on how many gradient all-reduces to run
    check(not (cfg.dynamic_sampling and dist.world() > 1), "dynamic_sampling", "a single process (not yet under torchrun)")
    check(cfg.prompts_per_step // dist.world() * cfg.group_size % cfg.mini_batches == 0, "mini_batches",
          "a divisor of the completions per step on each rank (prompts_per_step / world * group_size)")


# ----------------------------------------------------------------------------- rewards -> advantages

def group_advantages(rewards: torch.Tensor, norm: str) -> torch.Tensor:
    """rewards [B, G] -> advantages [B, G], one per completion (spec 3)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if norm == "none":  # Dr. GRPO: the std division re-weights groups by difficulty; leave it out
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + 1e-6)  # unbiased std, as DeepSeekMath's reference


def boxed(text: str) -> bool:
    """The optional format term (spec 2): the completion uses \\boxed and an answer can be read from it."""
    return "\\boxed" in text and extract_answer(text) is not None


# ---------------------------------------------------------------------------- batch and token weights

def build_batch(prompts, completions, pad_id):
    """Right-padded prompt+completion ids [N, T] and a mask [N, T-1] over the positions that predict a
    completion token. Right padding needs no attention mask: real tokens never look ahead at pads."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T - 1, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, len(p) - 1: len(p) - 1 + len(c)] = True
    return ids, mask


def token_weights(lengths: torch.Tensor, agg: str, max_new_tokens: int, n_seqs: int, n_tokens: int) -> torch.Tensor:
    """Per-token factor w_t so that Σ_t w_t ℓ_t is the aggregated loss of the whole mini-batch (spec 7).
    Computed once per mini-batch, so micro-batches add up to exactly the big-batch gradient.
    lengths [n]: completion lengths of these sequences; n_seqs / n_tokens: totals of the mini-batch."""
    if agg == "token-mean":  # DAPO: every token counts the same
        w = torch.full_like(lengths, 1.0 / max(n_tokens, 1), dtype=torch.float32)
    elif agg == "seq-mean-token-mean":  # original GRPO: every completion counts the same
        w = 1.0 / (lengths.float().clamp(min=1) * n_seqs)
    else:  # seq-mean-token-sum-norm, Dr. GRPO: a constant normaliser, no length bias
        w = torch.full_like(lengths, 1.0 / (n_seqs * max_new_tokens), dtype=torch.float32)
    return w.repeat_interleave(lengths)


def token_logprobs(model, ids, mask, temperature):
    """Log-probs and entropies of the completion tokens, flat [n_tokens], from logits / temperature.
    The LM head and log-softmax are fused: the [tokens, vocab] logits are never held whole."""
    return model(ids[:, :-1], targets=ids[:, 1:], target_mask=mask, temperature=temperature)


def step_prompts(train, step, n, seed):
    """The n prompts of a step: walk a fresh seeded permutation of the train set each epoch. A function of
    (step, seed) alone, so a resumed run sees the same prompts as an uninterrupted one."""
    out, perms = [], {}
    for g in range((step - 1) * n, step * n):
        epoch, i = divmod(g, len(train))
        if epoch not in perms:
            perms[epoch] = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        out.append(train[int(perms[epoch][i])])
    return out


def micro_batch_loss(policy, ids, mask, tok_adv, w, old_logp, ref_logp, cfg):
    """Σ_t w_t ℓ_t over one micro-batch (spec 6-7). old_logp None: this forward is π_old itself (μ = M = 1)."""
    logp, entropy = token_logprobs(policy, ids, mask, cfg.temperature)
    old = logp.detach() if old_logp is None else old_logp
    loss_tok, clip_low, clip_high = policy_loss(logp, old, tok_adv, cfg.eps_low, cfg.eps_high,
                                                ref_logp=ref_logp, kl_coef=cfg.kl_coef)
    # w divides by the global totals; DDP averages gradients over ranks, so undo its 1/world
    loss = (loss_tok * w).sum() * dist.world()
    return loss, logp, entropy, old, clip_low, clip_high


# ---------------------------------------------------------------------------------------- main loop

def main(argv=None):
    cfg = parse(Config, argv)
    device = dist.setup(cfg.device)
    validate(cfg)
    cfg.run_name = cfg.run_name or datetime.now().strftime("grpo-%Y%m%d-%H%M%S")
    run_dir, ckpt_dir = Path("runs") / cfg.run_name, Path("runs") / cfg.run_name / "checkpoint"
    ckpt = checkpoint.find(ckpt_dir) if cfg.resume else None
    check(not cfg.resume or ckpt is not None, "resume", f"a checkpoint in {ckpt_dir} (none found)")
    check(cfg.resume or not (run_dir / "metrics.jsonl").exists(), "run_name",
          f"a new name: {run_dir} already holds a run (add --resume to continue it)")
    torch.manual_seed(cfg.seed)

    # data first: a bad task or data line fails before the model is loaded
    train = load_task(cfg.task, "train", n=cfg.train_size, seed=cfg.seed)
    held_out = load_task(cfg.task, "test", n=cfg.eval_size, seed=cfg.seed)[: cfg.eval_size]
    tok = Tokenizer.from_pretrained(cfg.model)
    dtype = compute_dtype(device, cfg.dtype)
    model = Transformer.from_pretrained(ckpt or cfg.model, device=device)  # fp32 master weights
    model.gradient_checkpointing = cfg.grad_checkpointing
    ref_model = None
    if cfg.kl_coef > 0:  # spec 6: the reference policy exists only when it is used
        ref_model = Transformer.from_pretrained(cfg.model, device=device, dtype=dtype).eval().requires_grad_(False)
    # Rollouts come from a whole copy of the weights in the compute dtype, refreshed after each update
    # (sampling is memory-bound: bf16 weights read half the bytes; and FSDP2's sharded weights cannot sample).
    separate = dtype != torch.float32 or (cfg.fsdp and dist.is_distributed())
    rollout = copy.deepcopy(model).to(dtype).requires_grad_(False) if separate else model
    policy = dist.wrap(model, fsdp=cfg.fsdp)  # DDP, FSDP2, or the model itself
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    warmup = lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1))  # noqa: E731  (spec 8: warm-up, then constant)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    start_step = 0
    if ckpt is not None:
        state = checkpoint.load_trainer_state(ckpt)
        dist.load_optimizer_state(model, optimizer, state["optimizer"])
        start_step = state["step"]
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup, last_epoch=start_step - 1)
    if dist.is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(run_dir, enabled=dist.is_main(), resume_step=start_step if ckpt else None)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    B, G = cfg.prompts_per_step // dist.world(), cfg.group_size  # this rank's prompts per step
    eval_kw = dict(samples=cfg.eval_samples, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
    t_start = time.time()
    first_acc = None
    if start_step == 0:
        with autocast:
            first = evaluate(rollout, tok, held_out, seed=cfg.seed, **eval_kw)
        first_acc = first["eval/greedy_acc"]
        log.log(0, first)

    for step in range(start_step + 1, cfg.steps + 1):
        t0 = time.time()
        # ---- 1. rollouts: B prompts x G completions from the current policy (spec 1)
        batch = dist.shard(step_prompts(train, step, cfg.prompts_per_step, cfg.seed))
        prompts = [tok.prompt(format_question(p)) for p in batch]
        with torch.no_grad(), autocast:
            groups = generate(rollout, prompts, n=G, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                              top_p=cfg.top_p, stop_ids=tok.stop_ids, seed=cfg.seed * 1_000_003 + step * 1009 + dist.rank())
        t_sample = time.time()

        # ---- 2-3. rewards and group advantages (spec 2, 3)
        texts = [[tok.decode(s.tokens, skip_special=True) for s in g] for g in groups]
        correct = torch.tensor([[score(t, p.answer) for t in ts] for ts, p in zip(texts, batch)])  # [B, G]
        rewards = correct + cfg.format_reward * torch.tensor([[float(boxed(t)) for t in ts] for ts in texts])
        adv = group_advantages(rewards, cfg.adv_norm)  # [B, G]
        zero_var = rewards.std(dim=1) == 0
        keep = ~zero_var if cfg.dynamic_sampling else torch.ones(B, dtype=torch.bool)  # spec 4
        t_score = time.time()

        # ---- flatten the kept groups into completions; fix the mini-/micro-batch partition once
        samples = [s for g, k in zip(groups, keep) if k for s in g]
        seq_adv = adv[keep].flatten()  # [N]
        seq_prompts = [p for p, k in zip(prompts, keep) if k for _ in range(G)]
        lengths = torch.tensor([len(s.tokens) for s in samples], dtype=torch.long)
        N = len(samples)
        mini = [list(range(m * N // cfg.mini_batches, (m + 1) * N // cfg.mini_batches)) for m in range(cfg.mini_batches)]
        micro = [[idx[i:i + cfg.micro_batch] for i in range(0, len(idx), cfg.micro_batch)] for idx in mini]

        def micro_inputs(idx):
            ids, mask = build_batch([seq_prompts[i] for i in idx], [samples[i].tokens for i in idx], tok.pad_id)
            return ids.to(device), mask.to(device)

        # ---- 5. old (and reference) log-probs: the trainer's own forward before any update, so the
        # ratio is exactly 1 on the first mini-batch. With μ = M = 1 the update's forward provides them.
        old_logp, ref_logp = {}, {}
        with torch.no_grad(), autocast:
            for idx in (i for mb in micro for i in mb):
                ids, mask = micro_inputs(idx)
                if cfg.epochs * cfg.mini_batches > 1:
                    old_logp[idx[0]] = token_logprobs(model, ids, mask, cfg.temperature)[0]
                if ref_model is not None:
                    ref_logp[idx[0]] = token_logprobs(ref_model, ids, mask, cfg.temperature)[0]

        # ---- 6-8. μ epochs x M mini-batches of clipped policy-gradient steps
        stats = dict.fromkeys(["tokens", "clip_low", "clip_high", "approx_kl", "ref_kl", "entropy", "mismatch"], 0.0)
        grad_norm = torch.tensor(0.0)
        for epoch in range(cfg.epochs if N else 0):
            for mb, mb_micro in enumerate(micro):
                # the aggregation's totals over the whole mini-batch, summed over ranks (spec 7)
                n_seqs, n_tokens = dist.all_reduce_sum(torch.tensor([len(mini[mb]), float(lengths[mini[mb]].sum())])).tolist()
                optimizer.zero_grad(set_to_none=True)
                for j, idx in enumerate(mb_micro):
                    ids, mask = micro_inputs(idx)
                    w = token_weights(lengths[idx], cfg.loss_agg, cfg.max_new_tokens, int(n_seqs), int(n_tokens)).to(device)
                    tok_adv = seq_adv[idx].repeat_interleave(lengths[idx]).to(device)
                    old, ref = old_logp.get(idx[0]), ref_logp.get(idx[0])
                    last_micro = j == len(mb_micro) - 1  # gradients are all-reduced on the last one only
                    with autocast, dist.accumulate(policy, skip_sync=not last_micro):
                        loss, logp, entropy, old, clip_low, clip_high = micro_batch_loss(
                            policy, ids, mask, tok_adv, w, old, ref, cfg)
                        loss.backward()
                    with torch.no_grad():  # diagnostics (spec "Metrics every step")
                        log_ratio = logp.detach() - old
                        stats["tokens"] += len(logp)
                        stats["clip_low"] += clip_low.float().sum().item()
                        stats["clip_high"] += clip_high.float().sum().item()
                        stats["approx_kl"] += (log_ratio.exp() - 1 - log_ratio).sum().item()
                        stats["entropy"] += entropy.sum().item()
                        if ref is not None:
                            stats["ref_kl"] += ((ref - logp).exp() - (ref - logp) - 1).sum().item()
                        if epoch == 0:
                            sampler_logp = torch.cat([samples[i].logprobs for i in idx]).to(device)
                            stats["mismatch"] += (sampler_logp - old).abs().sum().item()
                grad_norm = dist.local(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
                optimizer.step()
        scheduler.step()
        dist.sync_rollout(model, rollout)
        t_train = time.time()

        # ---- metrics (spec "Metrics every step"), reduced over ranks
        seen = max(stats["tokens"], 1)
        metrics = {
            "reward/mean": rewards.mean().item(), "reward/acc": correct.mean().item(),
            "reward/zero_var_groups": zero_var.float().mean().item(), "reward/groups_dropped": float((~keep).sum()),
            "response/len_mean": sum(len(s.tokens) for g in groups for s in g) / (B * G),
            "response/len_max": float(max(len(s.tokens) for g in groups for s in g)),
            "response/truncated": sum(not s.finished for g in groups for s in g) / (B * G),
            "policy/entropy": stats["entropy"] / seen, "policy/clipfrac_low": stats["clip_low"] / seen,
            "policy/clipfrac_high": stats["clip_high"] / seen, "policy/approx_kl": stats["approx_kl"] / seen,
            "policy/sampler_logp_diff": stats["mismatch"] / max(int(lengths.sum()), 1),
            "optim/grad_norm": float(grad_norm), "optim/lr": scheduler.get_last_lr()[0],
            "perf/sample_tok_s": sum(len(s.tokens) for g in groups for s in g) / (t_sample - t0),
            "perf/train_tok_s": stats["tokens"] / max(t_train - t_score, 1e-9),
            "perf/sample_s": t_sample - t0, "perf/score_s": t_score - t_sample, "perf/train_s": t_train - t_score,
            "perf/step_s": t_train - t0,
        }
        if ref_model is not None:
            metrics["policy/ref_kl"] = stats["ref_kl"] / seen
        log.log(step, dist.reduce_metrics(metrics, sums=("reward/groups_dropped",)))

        # ---- evaluation and checkpoint
        if step % cfg.eval_every == 0 or step == cfg.steps:
            with autocast:
                last = evaluate(rollout, tok, held_out, seed=cfg.seed, **eval_kw)
            log.log(step, last)
        if step % cfg.save_every == 0 or step == cfg.steps:
            # fp32 master weights and optimizer state, whole (collectives under FSDP2: every rank calls them)
            weights, optim_state = dist.full_state_dict(model), dist.optimizer_state(model, optimizer)
            if dist.is_main():
                checkpoint.save(ckpt_dir, model, weights, optim_state, step, model_source=_model_dir(cfg.model),
                                extra={"config": asdict(cfg)})
            dist.barrier()

    if dist.is_main() and cfg.steps > start_step:
        before = f"{first_acc:.3f} → " if first_acc is not None else "(resumed) "
        print(f"done: greedy accuracy {before}{last['eval/greedy_acc']:.3f} on {len(held_out)} held-out problems, "
              f"{cfg.steps - start_step} steps in {_minutes(time.time() - t_start)}; "
              f"metrics {run_dir / 'metrics.jsonl'}, checkpoint {ckpt_dir}")
    dist.cleanup()


def _model_dir(name):
    from common.hub import resolve_model_dir
    return resolve_model_dir(name)


def _minutes(seconds):
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


if __name__ == "__main__":
    main_guard(main)
