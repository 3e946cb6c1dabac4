"""The offline default model: converted from its GGUF, it must agree with `transformers` on the same folder,
tokenize like it, and answer a simple question."""
import pytest
import torch

from common.hub import resolve_model_dir
from common.model import Transformer
from common.tokenizer import Tokenizer

HARD_STRINGS = [
    "Hello, world! 😀🚀 naïve café",
    "日本語のテキストと中文字符",
    "1234567890 3.14159 -42 1,000,000 007",
    "tabs\tand  double  spaces\n\n\nand    runs      of   whitespace   ",
    r"$\frac{1}{2} + \sqrt{x^2} = \boxed{\dfrac{3}{4}}$ \left( a \right)",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "",
    " leading space and trailing space ",
]


@pytest.fixture(scope="module")
def folder():
    return resolve_model_dir("smollm2")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained("smollm2")


def test_tokenizer_matches_transformers(folder, tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    for s in HARD_STRINGS:
        ids = tok.encode(s)
        assert ids == hf.encode(s, add_special_tokens=False), s
        assert tok.decode(ids) == s
    # digits are split one by one
    assert len(tok.encode("12345")) == 5


def test_chat_format_matches_template(folder, tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    msgs = [{"role": "user", "content": "What is 7 * 6?"}]
    assert tok.format("What is 7 * 6?") == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert tok.is_chat and tok.eos_id in tok.stop_ids
    assert tok.decode([tok.eos_id]) == "<|im_end|>"


def test_converted_model_matches_transformers(folder, tok):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = Transformer.from_pretrained("smollm2").eval()
    ids = torch.tensor([tok.prompt("Natalia sold clips to 48 of her friends in April. How many?")])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_answers_paris(tok):
    model = Transformer.from_pretrained("smollm2").eval()
    ids = tok.prompt("What is the capital of France?")
    out = []
    with torch.no_grad():  # plain greedy decoding with the KV cache
        cache = model.new_cache(1, len(ids) + 20)
        logits = model(torch.tensor([ids]), cache=cache, start=0)
        for t in range(20):
            nxt = int(logits[0, -1].argmax())
            if nxt in tok.stop_ids:
                break
            out.append(nxt)
            logits = model(torch.tensor([[nxt]]), cache=cache, start=len(ids) + t)
    assert "Paris" in tok.decode(out)
