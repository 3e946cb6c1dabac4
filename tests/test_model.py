"""The model against `transformers`: same logits both ways, KV-cached decoding equal to the full forward."""
import json

import pytest
import torch

from common.model import ModelError, Transformer
from conftest import DEVICES


def hf_logits(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_parity_our_loader_on_their_save(hf_tiny):
    kind, hf, folder = hf_tiny
    ours = Transformer.from_pretrained(folder).eval()
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_parity_their_loader_on_our_save(hf_tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    kind, hf, folder = hf_tiny
    ours = Transformer.from_pretrained(folder).eval()
    ours.save_pretrained(tmp_path / "ours")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(theirs).__name__ == type(hf).__name__
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(theirs, ids), ours(ids), atol=1e-4, rtol=1e-4)
    if ours.cfg.tie_word_embeddings:
        assert theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()


def test_sharded_checkpoint_and_dtype(tmp_path):
    from conftest import make_hf_model

    hf = make_hf_model("qwen3")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = Transformer.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert ours.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours.float()(ids), hf_logits(hf, ids), atol=0.1, rtol=0.05)


def test_hidden_states_and_fused_head_match_transformers(hf_tiny):
    """return_hidden gives the final-norm states: through the LM head by hand (float64) they give transformers'
    logits. The training path (targets=...) gives log softmax(logits / T) and its entropy at the targets."""
    _, hf, folder = hf_tiny
    m = Transformer.from_pretrained(folder).eval()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (2, 12), generator=g)
    theirs = hf_logits(hf, ids).double()  # [2, 12, 256]
    with torch.no_grad():
        hidden = m(ids, return_hidden=True)  # [2, 12, d]
        assert hidden.shape == (2, 12, m.cfg.hidden_size)
        torch.testing.assert_close(hidden.double() @ m.lm_head.weight.double().T, theirs, atol=1e-4, rtol=1e-4)
        targets = torch.randint(0, 256, (2, 12), generator=g)
        target_mask = torch.rand(2, 12, generator=g) < 0.7
        logp, entropy = m(ids, targets=targets, target_mask=target_mask, temperature=0.7)
    logp_all = torch.log_softmax(theirs[target_mask] / 0.7, -1)  # [n, 256]
    target_logp = logp_all.gather(-1, targets[target_mask][:, None])[:, 0]
    torch.testing.assert_close(logp, target_logp.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(entropy, -(logp_all.exp() * logp_all).sum(-1).float(), atol=1e-4, rtol=1e-4)


def test_left_padding_matches_each_sequence_alone(hf_tiny):
    _, hf, folder = hf_tiny
    m = Transformer.from_pretrained(folder).eval()
    g = torch.Generator().manual_seed(3)
    lens = [9, 4, 7]
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in lens]
    T = max(lens)
    ids = torch.zeros(len(lens), T, dtype=torch.long)
    mask = torch.zeros(len(lens), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):], mask[i, T - len(s):] = s, 1
    with torch.no_grad():
        padded = m(ids, attention_mask=mask)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(padded[i, T - len(s):], m(s[None])[0], atol=1e-5, rtol=1e-5)
        # and transformers agrees on the padded batch too
        torch.testing.assert_close(padded[mask.bool()], hf_logits(hf, ids, mask)[mask.bool()], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3"])
def test_kv_cache_decoding_equals_full_forward(kind, tmp_path):
    """Prefill a left-padded ragged batch, then feed one token at a time: every position's logits must
    equal the full no-cache forward over the whole sequence."""
    from conftest import make_hf_model

    make_hf_model(kind).save_pretrained(tmp_path)
    m = Transformer.from_pretrained(tmp_path).eval()
    g = torch.Generator().manual_seed(4)
    prompt_lens, new = [6, 2, 5], 7
    P = max(prompt_lens)
    ids = torch.randint(0, 256, (3, P + new), generator=g)
    mask = torch.ones_like(ids)
    for i, n in enumerate(prompt_lens):
        mask[i, : P - n] = 0
    with torch.no_grad():
        full = m(ids, attention_mask=mask)
        cache = m.new_cache(3, P + new)
        step_logits = [m(ids[:, :P], attention_mask=mask[:, :P], cache=cache, start=0)]
        for t in range(P, P + new):
            step_logits.append(m(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, start=t))
    cached = torch.cat(step_logits, dim=1)
    valid = mask.bool()
    torch.testing.assert_close(cached[valid], full[valid], atol=1e-5, rtol=1e-5)
    # without padding the mask may be left out: one row decoded token by token
    with torch.no_grad():
        cache = m.new_cache(1, P + new)
        steps = [m(ids[:1, :3], cache=cache, start=0)] + [m(ids[:1, t:t + 1], cache=cache, start=t) for t in range(3, P + new)]
        torch.testing.assert_close(torch.cat(steps, 1)[0], m(ids[:1])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast", [False, True])
def test_gradient_checkpointing_same_gradients(tmp_path, autocast, device):
    """Recomputed blocks give the gradients of stored activations; under bf16 autocast too, with the backward run
    outside the autocast context (the recompute must restore the forward's, or it would run in fp32)."""
    from conftest import make_hf_model

    make_hf_model("llama-gqa").save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (2, 10), device=device)
    grads = []
    for ckpt in (False, True):
        m = Transformer.from_pretrained(tmp_path, device=device).train()
        m.gradient_checkpointing = ckpt
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = m(ids).float().logsumexp(-1).mean()
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------ bad input

def one_line_error(fn, *words):
    with pytest.raises(ModelError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg
    return msg


def test_missing_folder(tmp_path, monkeypatch):
    one_line_error(lambda: Transformer.from_pretrained(tmp_path / "nope"), "nope", "not found")
    # a Hub id (org/name, where no folder org/ exists) is answered with how to get a local copy; a local path is not
    monkeypatch.chdir(tmp_path)
    one_line_error(lambda: Transformer.from_pretrained("Qwen/Qwen3-0.6B"), "not found",
                   "huggingface-cli download Qwen/Qwen3-0.6B --local-dir DIR")
    (tmp_path / "runs").mkdir()
    with pytest.raises(ModelError) as e:
        Transformer.from_pretrained("runs/nope")
    assert "huggingface-cli" not in str(e.value)


def test_missing_config_field(hf_tiny):
    _, _, folder = hf_tiny
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps(cfg))
    one_line_error(lambda: Transformer.from_pretrained(folder), "config.json", "num_hidden_layers")


@pytest.mark.parametrize("damage, words", [
    ("config_list", ["config.json", "expected a JSON object"]),
    ("config_string_layers", ["config.json", "cannot build the model"]),
    ("config_wrong_size", ["has shape", "config.json says"]),
    ("weights_truncated", ["model.safetensors", "not readable safetensors"]),
])
def test_a_damaged_model_folder_is_a_one_line_error(hf_tiny, damage, words):
    """Each of these was a traceback (AttributeError, TypeError, RuntimeError's size mismatch, SafetensorError)."""
    _, _, folder = hf_tiny
    cfg = json.loads((folder / "config.json").read_text())
    if damage == "config_list":
        (folder / "config.json").write_text("[]")
    elif damage == "config_string_layers":
        (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": str(cfg["num_hidden_layers"])}))
    elif damage == "config_wrong_size":
        (folder / "config.json").write_text(json.dumps({**cfg, "intermediate_size": cfg["intermediate_size"] + 8}))
    else:
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:len(weights.read_bytes()) // 2])
    one_line_error(lambda: Transformer.from_pretrained(folder), *words)


@pytest.mark.parametrize("name, text", [("tokenizer.json", '{"version": '), ("tokenizer_config.json", "{oops"),
                                        ("tokenizer_config.json", "[1]")])
def test_a_damaged_tokenizer_is_a_one_line_error(tiny_model_dir, tmp_path, name, text):
    import shutil

    from common.tokenizer import Tokenizer
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / name).write_text(text)
    one_line_error(lambda: Tokenizer.from_pretrained(folder), name)


@pytest.mark.parametrize("field,value,words", [
    ("model_type", "mamba", ["model_type", "mamba"]),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, ["yarn"]),
])
def test_unknown_model_type_or_rope(tmp_path, field, value, words):
    from conftest import make_hf_model

    make_hf_model("llama-gqa").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    one_line_error(lambda: Transformer.from_pretrained(tmp_path), *words)
