"""One decoder-only transformer for Llama, Qwen2 and Qwen3, read from and written to Hugging Face folders.

    model = Transformer.from_pretrained("smollm2")          # or any HF folder: config.json + safetensors
    logits = model(input_ids)                               # [B, T, vocab]
    hidden = model(input_ids, return_hidden=True)           # [B, T, d], final norm applied, no LM head
    model.save_pretrained("out/")                           # loads in `transformers` and here

The three architectures differ only in switches read from config.json:
    Llama  (SmolLM2, Llama-3.x)  optional llama3 rope scaling, optional attention/MLP biases
    Qwen2  (Qwen2.5, -Math)      bias on q/k/v projections
    Qwen3                        per-head RMSNorm on q and k, explicit head_dim
Anything else (another model_type, another rope scaling) is refused rather than run wrong.

Incremental decoding: pass a `KVCache` and `start`, the cache column where these tokens go. Rows may be
left-padded: `attention_mask` [B, start + T] marks real tokens, and positions come from it, so a padded row
computes exactly what the sequence alone would.
"""
import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from common.errors import ModelError, reason
from common.hub import read_json, resolve_model_dir
from common.memory import release_free_memory
from kernels import linear_logprobs_entropy, lm_head_logits

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_GQA_KWARG = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # sdpa(enable_gqa=) exists


@dataclass
class ModelConfig:
    model_type: str  # llama | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads means grouped-query attention
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # only {"rope_type": "llama3", ...} is supported
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama when attention_bias
    o_bias: bool = False  # Llama attention_bias also puts a bias on o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    max_position_embeddings: int = 4096
    extra: dict = field(default_factory=dict)  # fields we keep only to write them back (token ids, ...)

    @classmethod
    def from_hf(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        mt = d.get("model_type")
        if mt not in ARCHITECTURES:
            raise ModelError(f"{source}: model_type {mt!r} is not supported; expected one of {', '.join(ARCHITECTURES)}")

        def need(key):
            if key not in d:
                raise ModelError(f"{source}: missing field {key!r} (required for model_type {mt!r})")
            return d[key]

        if d.get("use_sliding_window"):
            raise ModelError(f"{source}: use_sliding_window=true is not supported (full attention only)")
        # transformers >= 5 writes rope settings into rope_parameters; older versions use rope_theta/rope_scaling
        rope = dict(d.get("rope_parameters") or {})
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or rope
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if rope_type not in ("default", "llama3"):
            raise ModelError(f"{source}: rope scaling type {rope_type!r} is not supported; expected default or llama3")
        if rope_type == "llama3":
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            missing = [k for k in keys if k not in scaling]
            if missing:
                raise ModelError(f"{source}: llama3 rope scaling is missing {', '.join(missing)}")
            scaling = {"rope_type": "llama3", **{k: scaling[k] for k in keys}}
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            model_type=mt, vocab_size=need("vocab_size"), hidden_size=hidden,
            intermediate_size=need("intermediate_size"), num_layers=need("num_hidden_layers"),
            num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), rope_scaling=scaling if rope_type == "llama3" else None,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=(mt == "qwen2") or attention_bias, o_bias=(mt == "llama") and attention_bias,
            mlp_bias=(mt == "llama") and bool(d.get("mlp_bias", False)), qk_norm=(mt == "qwen3"),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            extra={k: d[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in d},
        )

    def to_hf(self, dtype: torch.dtype) -> dict:
        d = {
            "architectures": [ARCHITECTURES[self.model_type]], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "torch_dtype": str(dtype).removeprefix("torch."), **self.extra,
        }
        if self.model_type == "llama":
            d.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        if self.model_type == "qwen3":
            d["attention_bias"] = self.qkv_bias
        if self.rope_scaling:  # transformers >= 5 reads rope settings from here
            d["rope_parameters"] = {"rope_theta": self.rope_theta, **self.rope_scaling}
        return d


# ----------------------------------------------------------------------------------------------- RoPE

def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device="cpu") / cfg.head_dim)
    s = cfg.rope_scaling
    if s:  # Llama 3.1: slow down low frequencies by `factor`, keep high ones, interpolate in between
        wavelen = 2 * math.pi / inv_freq
        ctx = s["original_max_position_embeddings"]
        smooth = ((ctx / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])).clamp(0, 1)
        inv_freq = (1 - smooth) * inv_freq / s["factor"] + smooth * inv_freq
    return inv_freq.float()


def apply_rope(x, cos, sin):
    """x [B, H, T, D]; cos/sin [B, 1, T, D]. Rotates the two halves of each head (the HF convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# --------------------------------------------------------------------------------------------- blocks

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()  # normalise in fp32 as the reference does, then cast back before the scale
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class KVCache:
    """Keys and values of every layer, preallocated: k, v [layers, B, kv_heads, max_len, head_dim].

    A cache may also hold a shared prompt part (see `share`): its first `offset` columns are then not stored
    per row but once per distinct prompt, in pk, pv [layers, U, kv_heads, offset, head_dim], and row b reads
    prompt owner[b]'s. k, v then hold columns offset.. only; column numbers (start, masks) stay the same."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device=None, dtype=torch.float32):
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.offset, self.pk, self.pv = 0, None, None

    def select(self, rows: torch.Tensor):
        """Keep (or repeat) batch rows: rows [B'] indexes the current batch. Used to repeat a prompt's prefill for
        its samples where the cache is not shared (the sampler drops finished rows in place). Rows 0..B-1 in order
        keep the cache as it is: a copy would hold two whole caches at once (evaluation's one sample per prompt)."""
        if len(rows) == self.k.shape[1] and bool((rows == torch.arange(len(rows), device=rows.device)).all()):
            return self
        self.k, self.v = self.k.index_select(1, rows), self.v.index_select(1, rows)
        return self

    def share(self, owner: torch.Tensor, max_len: int) -> "KVCache":
        """A cache of len(owner) rows whose first columns are this (prefilled) cache's: row b reads its row
        owner[b], never copied. k, v are allocated for columns offset..max_len-1 only. For n samples of each
        prompt this stores and reads the prompts' keys and values once instead of n times. The rows of one
        prompt need not be adjacent (a prompt drawn twice into one batch; drop_rows reorders rows anyway)."""
        shared = KVCache.__new__(KVCache)
        L, _, H, W, D = self.k.shape
        shared.k = self.k.new_zeros(L, len(owner), H, max_len - W, D)
        shared.v = torch.zeros_like(shared.k)
        shared.offset, shared.pk, shared.pv = W, self.k, self.v
        # each row's cell in a [U, slots] grid (slots = most rows of one prompt), row-major: owner * slots + its
        # rank among its prompt's rows, so that the queries of one prompt's rows meet its keys in one matmul
        order = torch.argsort(owner, stable=True)
        grouped = owner[order]  # the rows of each prompt together: rank = position - the prompt's first position
        rank = torch.empty_like(owner)
        rank[order] = torch.arange(len(owner), device=owner.device) - torch.searchsorted(grouped, grouped)
        shared.slots = int(rank.max()) + 1
        shared.grid = owner * shared.slots + rank
        return shared

    def keep(self, perm: torch.Tensor):
        """The row bookkeeping of a shared cache after its batch rows were reordered / cut to perm [B']."""
        if self.pk is not None:
            self.grid = self.grid[perm]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(d, h * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, kv * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, kv * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * hd, d, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache, layer, start):
        B, T, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q_proj(x).view(B, T, -1, hd)
        k = self.k_proj(x).view(B, T, -1, hd)
        v = self.v_proj(x).view(B, T, -1, hd).transpose(1, 2)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        if cache is not None and cache.pk is not None:
            return self.o_proj(self._shared_prompt_attention(q, k, v, mask, cache, layer, start))
        if cache is not None and torch.is_tensor(start):  # fixed shapes (a compiled decode step): the whole cache
            cache.k[layer].index_copy_(2, start.view(1), k)
            cache.v[layer].index_copy_(2, start.view(1), v)
            k, v = cache.k[layer], cache.v[layer]
        elif cache is not None:  # write in place, then attend over the filled part only
            cache.k[layer, :, :, start:start + T] = k
            cache.v[layer, :, :, start:start + T] = v
            k, v = cache.k[layer, :, :, :start + T], cache.v[layer, :, :, :start + T]
        groups = self.cfg.num_heads // self.cfg.num_kv_heads
        if T == 1 and groups > 1:
            # one query per row: the query heads that share a kv head become that head's query rows
            # (head h uses kv head h // groups), so k/v are never repeated and any sdpa backend takes the mask
            y = F.scaled_dot_product_attention(q.view(B, self.cfg.num_kv_heads, groups, hd), k, v, attn_mask=mask)
            return self.o_proj(y.reshape(B, 1, -1))
        if groups > 1 and not _GQA_KWARG:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        gqa = {"enable_gqa": groups > 1} if _GQA_KWARG else {}
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and cache is None, **gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def _shared_prompt_attention(self, q, k, v, mask, cache, layer, start):
        """Attention over a cache with a shared prompt part (KVCache.share): softmax over [prompt columns, own
        columns] together, with the prompt's scores and outputs from one matmul per distinct prompt. q [B, H, T,
        hd], k, v [B, kv, T, hd] new; mask None or [B or 1, 1, T, start + T] bool (start: an absolute column).
        Returns [B, T, H * hd]."""
        B, H, T, hd = q.shape
        kv, W = self.cfg.num_kv_heads, cache.offset
        g, U, n = H // kv, cache.pk.shape[1], cache.slots
        at = start - W  # the row part holds columns W..
        cache.k[layer, :, :, at:at + T], cache.v[layer, :, :, at:at + T] = k, v
        k1, v1 = cache.k[layer, :, :, :at + T], cache.v[layer, :, :, :at + T]  # [B, kv, S1, hd]

        def by_prompt(x):  # [B, kv, g T, c] -> [U, kv, n g T, c]: each prompt's rows side by side (empty cells 0)
            x = x.new_zeros(U * n, *x.shape[1:]).index_copy_(0, cache.grid, x)
            return x.view(U, n, kv, g * T, -1).transpose(1, 2).reshape(U, kv, n * g * T, -1)

        def by_row(x):  # the inverse: [U, kv, n g T, c] -> [B, kv, g T, c]
            return x.view(U, kv, n, g * T, -1).transpose(1, 2).reshape(U * n, kv, g * T, -1)[cache.grid]

        qg = q.reshape(B, kv, g * T, hd) * hd ** -0.5  # head h uses kv head h // g: its g x T queries in a row
        s0 = by_row(by_prompt(qg) @ cache.pk[layer].transpose(-1, -2))  # [B, kv, g T, W]
        s1 = qg @ k1.transpose(-1, -2)  # [B, kv, g T, S1]
        scores = torch.cat((s0, s1), -1).float()
        if mask is not None:  # [B, 1, T, S] -> the same for each of the g query heads of a kv head
            m = mask.expand(B, g, T, mask.shape[-1]).reshape(B, 1, g * T, -1)
            scores = scores.masked_fill(~m, float("-inf"))  # (None only for T = 1: it sees every column)
        p = scores.softmax(-1).to(q.dtype)
        y = by_row(by_prompt(p[..., :W]) @ cache.pv[layer]) + p[..., W:] @ v1  # [B, kv, g T, hd]
        return y.view(B, H, T, hd).transpose(1, 2).reshape(B, T, H * hd)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, f, bias=b), nn.Linear(d, f, bias=b), nn.Linear(f, d, bias=b)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LMHead(nn.Linear):
    """The vocabulary projection: an nn.Linear (same weight, same name, tied or not), which outside autograd on a
    CPU runs kernels.lm_head_logits: the vocabulary in column blocks, 15-30% faster there at decode shapes."""

    def forward(self, x):
        # lm_head_logits itself keeps the plain matmul off a CPU, in bf16 and under autocast
        if self.bias is not None or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return super().forward(x)
        return lm_head_logits(x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], self.weight.shape[0])


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, start=0):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, start)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---------------------------------------------------------------------------------------- transformer

def _release_before_embedding_backward(grad):
    """A hook on the embeddings' output: it runs when their gradient is ready, just before the embedding's own
    backward. With tied embeddings that backward is a CPU trainer's peak (all the gradients, the LM head's gradient
    of the tied weight, which autograd holds until this one arrives, and this one, 0.1 GB each for SmolLM2), and
    the pages the layers' backward freed are still resident in glibc's heap: they go back to the OS first."""
    release_free_memory()


def _embedding(n: int, d: int) -> nn.Embedding:
    """nn.Embedding(n, d), built without its random init on the meta device (from_pretrained), where that init
    imports torch._dynamo and with it triton: ~0.07 x 10^9 bytes of a CPU run's memory that nothing uses."""
    if torch.empty(0).is_meta:
        return nn.Embedding(n, d, _weight=torch.empty(n, d))
    return nn.Embedding(n, d)


class _Recompute(torch.autograd.Function):
    """Activation checkpointing of one block in one process: the forward keeps only the block's input, the backward
    runs the block again with autograd on and back-propagates through it (the reentrant form of
    torch.utils.checkpoint, same gradients; like it, for loss.backward(), not torch.autograd.grad). Ours because
    torch's imports torch._dynamo on its first call, and with it triton where installed: ~0.15 x 10^9 bytes of a CPU
    run's resident memory for nothing. Under torch.distributed the model calls torch's (non-reentrant), the form
    whose interplay with DDP's and FSDP2's hooks torch tests."""

    @staticmethod
    def forward(ctx, block, x, *args):  # runs without autograd, as a Function's forward does
        ctx.block, ctx.args = block, args
        ctx.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in {"cpu", x.device.type}]
        ctx.save_for_backward(x)
        return block(x, *args)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad(), contextlib.ExitStack() as stack:
            for device_type, enabled, dtype in ctx.autocast:  # the forward's autocast, which backward runs outside of
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            out = ctx.block(x, *ctx.args)
        torch.autograd.backward(out, grad)
        return (None, x.grad, *(None for _ in ctx.args))


def checkpoint(block, x, *args):
    """block(x, *args), its activations recomputed in backward (args: tensors that need no gradient)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch_checkpoint(block, x, *args, use_reentrant=False)
    return _Recompute.apply(block, x, *args)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.inv_freq = rope_inv_freq(cfg)  # a plain tensor, not a buffer: never saved, never on meta
        self.gradient_checkpointing = False  # recompute each block in backward: less memory, ~1/3 more time

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(self.cfg, batch, max_len, device=p.device, dtype=p.dtype)

    def forward(self, input_ids, *, attention_mask=None, positions=None, cache=None, start=0, return_hidden=False,
                targets=None, target_mask=None, temperature=1.0):
        """input_ids [B, T] -> logits [B, T, vocab] (or final hidden states [B, T, d]).

        attention_mask: [B, start + T] bool/int, 1 on real tokens (left padding is 0). Without a cache and
          without padding, leave it None: attention is plain causal. Or [B, T, T] bool: query t sees key s
          (no cache; give positions too), for sequences packed side by side after a shared prefix.
        positions: [B, T] rope positions; by default counted over real tokens only (so padding shifts nothing).
        cache, start: a KVCache; these T tokens are written at columns start..start+T-1 and attend to all
          filled columns before them. A 0-dim tensor `start` (T = 1, positions and a whole-cache
          attention_mask given) keeps every shape fixed, for a compiled decode step (CUDA graphs).
        targets, target_mask: [B, T] ids and bool; if given, return (logp, entropy) [n] fp32 of the targets at the
          masked positions under softmax(logits / temperature), through the fused LM-head kernel that never
          holds the whole [tokens, vocab] logits. It is done inside forward so that DDP / FSDP see the head's use.
        """
        B, T = input_ids.shape
        dev = input_ids.device
        mask = None
        if torch.is_tensor(start):  # a compiled one-token step: attention_mask [B, max_len] marks the live columns
            mask = attention_mask[:, None, None, :]
        elif attention_mask is not None and attention_mask.dim() == 3:  # [B, T, S]: who sees whom, given whole
            mask = attention_mask.bool()[:, None]  # e.g. several completions packed after one shared prompt
        elif attention_mask is not None:
            valid = attention_mask.bool()
            if positions is None:
                positions = (valid.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            cols = torch.arange(start + T, device=dev)
            causal = cols[None, :] <= (start + torch.arange(T, device=dev))[:, None]  # [T, S]
            # a padding query may see nothing else; letting it see itself keeps softmax finite (its output is unused)
            mask = (causal[None] & valid[:, None, :]) | (cols[None, None, :] == start + torch.arange(T, device=dev)[None, :, None])
            mask = mask[:, None]  # [B, 1, T, S]
        elif cache is not None:
            mask = (torch.arange(start + T, device=dev)[None, :] <= (start + torch.arange(T, device=dev))[:, None])[None, None]
            if T == 1:
                mask = None  # one new token sees the whole filled cache: no mask needed
        if positions is None:
            positions = torch.arange(start, start + T, device=dev)[None].expand(B, T)
        if self.inv_freq.device != dev:
            self.inv_freq = self.inv_freq.to(dev)
        angles = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, T, D]
        x = self.embed_tokens(input_ids)
        if x.requires_grad and x.device.type == "cpu":
            x.register_hook(_release_before_embedding_backward)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for i, layer in enumerate(self.layers):
            if self.gradient_checkpointing and self.training and cache is None:
                x = checkpoint(layer, x, cos, sin, mask)
            else:
                x = layer(x, cos, sin, mask, cache, i, start)
        x = self.norm(x)
        if targets is not None:
            return linear_logprobs_entropy(x[target_mask], self.lm_head.weight, targets[target_mask], temperature)
        return x if return_hidden else self.lm_head(x)

    # ------------------------------------------------------------------------------------------ I/O

    @classmethod
    def from_pretrained(cls, path, device=None, dtype=None) -> "Transformer":
        """Read a Hugging Face folder (config.json + model.safetensors or a sharded index). dtype defaults
        to float32. Weights go straight into place: the model is built on the meta device, never random-initialised."""
        folder = resolve_model_dir(path)
        cfg = ModelConfig.from_hf(read_json(folder / "config.json"), str(folder / "config.json"))
        dtype = dtype or torch.float32
        with torch.device("meta"):
            try:
                model = cls(cfg)
            except (TypeError, ValueError, RuntimeError) as e:  # a field of the wrong type or sign: "30", -1, ...
                raise ModelError(f"{folder / 'config.json'}: cannot build the model ({reason(e)})") from None
        state = {}
        for f in _weight_files(folder):
            try:
                tensors = load_file(str(f), device=str(device or "cpu"))
            except (SafetensorError, OSError) as e:  # a truncated or foreign file
                raise ModelError(f"{f}: not readable safetensors ({reason(e)})") from None
            for name, t in tensors.items():
                state[name.removeprefix("model.")] = t.to(dtype)
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
        missing = sorted(expected - set(state))
        if missing:
            raise ModelError(f"{folder}: weights are missing tensor {missing[0]!r} ({len(missing)} missing in all)")
        unexpected = sorted(k for k in set(state) - expected if "rotary_emb" not in k)
        if unexpected:
            raise ModelError(f"{folder}: unexpected tensor {unexpected[0]!r} for model_type {cfg.model_type!r}")
        shapes = {k: v.shape for k, v in model.state_dict().items()}
        wrong = sorted(k for k in expected if state[k].shape != shapes[k])
        if wrong:
            raise ModelError(f"{folder}: tensor {wrong[0]!r} has shape {tuple(state[wrong[0]].shape)}, config.json "
                             f"says {tuple(shapes[wrong[0]])} ({len(wrong)} such tensors)")
        model.load_state_dict({k: state[k] for k in expected}, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.to(device) if device else model

    def save_pretrained(self, path, state_dict: dict | None = None):
        """Write config.json + model.safetensors in Hugging Face names (a tied LM head is not written twice).
        state_dict: the weights to write, when they are not this module's own (e.g. gathered from FSDP2 shards)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {}
        for name, t in (state_dict if state_dict is not None else self.state_dict()).items():
            if name == "lm_head.weight":
                if self.cfg.tie_word_embeddings:
                    continue
                state[name] = t
            else:
                state["model." + name] = t
        state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
        dtype = state["model.embed_tokens.weight"].dtype
        (path / "config.json").write_text(json.dumps(self.cfg.to_hf(dtype), indent=2))
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def compute_dtype(device, name: str = "auto") -> torch.dtype:
    """The dtype for matmuls: bf16 on CUDA and on CPUs with bf16 matrix units (AMX, AVX512-BF16), where its
    matmuls are several times faster than fp32's (bench/sampler.py measures it); fp32 elsewhere. On such a CPU with
    2 cores grpo.py's default run took 0.78-0.81x fp32's time in bf16 and peaked 0.7 x 10^9 B higher: the bf16 copy
    of the weights that samples, and autocast's casts of the weights kept for the backward (docs/benchmarks.md)."""
    if name != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return torch.float32
    return torch.bfloat16 if ("amx_bf16" in flags or "avx512_bf16" in flags) else torch.float32


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / f for f in sorted(set(read_json(index)["weight_map"].values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelError(f"{folder}: no model.safetensors or model.safetensors.index.json")
