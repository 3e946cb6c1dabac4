"""Shared test helpers: tiny random models of each architecture, saved by `transformers`."""
import importlib
import os
import shutil

# Without a GPU, Triton kernels can only run in its interpreter, and that must be chosen before triton is
# first imported (any test module importing `kernels` may be first). With a GPU the kernels run compiled.
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# the CPU libraries' settings every run makes (MKL's branch on a CPU not made by Intel): before any test's first
# matmul, so that this process computes as the runs it starts do
importlib.import_module("common.memory")

# A test parametrised over DEVICES runs on the CPU everywhere and on CUDA where there is a GPU (CI has none: skipped
# there with the reason; the GPU path is what a GPU run of the trainer and sampler takes)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU (the CPU case runs here)"))]

# One tiny config per architectural switch we support.
TINY = {
    "llama-gqa": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "llama-tied": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False),
}


def make_hf_model(kind: str, seed: int = 0, vocab_size: int = 256):
    """A randomly initialised `transformers` model; every weight (norms included) drawn at random."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY[kind])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-6, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model


@pytest.fixture(params=list(TINY))
def hf_tiny(request, tmp_path):
    """(kind, transformers model, folder it was saved to)."""
    model = make_hf_model(request.param)
    folder = tmp_path / request.param
    model.save_pretrained(folder)
    return request.param, model, folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer: a complete model folder for end-to-end runs."""
    import shutil

    from common.hub import resolve_model_dir
    from common.model import ModelConfig, Transformer

    src = resolve_model_dir("smollm2")
    cfg = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                      extra={"bos_token_id": 1, "eos_token_id": 2})
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny") / "model"
    Transformer(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, folder / name)
    return folder


class RecordingLibc:
    """Stands in for glibc: records mallopt and malloc_trim calls."""

    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad):
        self.calls.append(("trim",))
        return 1
