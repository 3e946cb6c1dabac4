"""Tokenizer: tokenizer.json through the `tokenizers` library, plus the two things RL code needs from it:
which ids end a completion, and how to turn a question into a prompt (ChatML for instruct models, plain text
for base models).

    tok = Tokenizer.from_pretrained("smollm2")
    ids = tok.prompt("What is 2 + 3?")        # chat-formatted, ends with the assistant header
    text = tok.decode(completion_ids, skip_special=True)
"""
import re

from tokenizers import Tokenizer as HFTokenizer

from common.errors import ModelError, reason
from common.hub import read_json, resolve_model_dir

# Tokens that end a turn or a document in the model families we support.
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


class Tokenizer:
    def __init__(self, tok, config: dict):
        self.tok = tok
        self.config = config
        vocab = tok.get_vocab(with_added_tokens=True)
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.stop_ids = sorted({vocab[t] for t in (*END_TOKENS, eos) if t in vocab})  # ids that end a completion
        self.eos_id = vocab.get(eos, self.stop_ids[0] if self.stop_ids else 0)
        self.pad_id = self.eos_id  # padding is always masked out; any id will do
        self.is_chat = "<|im_start|>" in vocab  # ChatML (Qwen, SmolLM2); otherwise plain prompts
        self.default_system = _default_system(config.get("chat_template") or "")
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_pretrained(cls, path) -> "Tokenizer":
        folder = resolve_model_dir(path)
        if not (folder / "tokenizer.json").is_file():
            raise ModelError(f"{folder}: no tokenizer.json")
        config_file = folder / "tokenizer_config.json"
        config = read_json(config_file) if config_file.is_file() else {}
        try:
            tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises its own plain Exception for a malformed file
            raise ModelError(f"{folder / 'tokenizer.json'}: not a readable tokenizer ({reason(e)})") from None
        return cls(tok, config)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (like <|im_start|>) become their ids.
        Nothing is added (no BOS): prompt formatting is explicit, in `prompt`."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def format(self, question: str, system: str | None = None) -> str:
        """The prompt text for one question: ChatML with the assistant header open, or the question itself."""
        if not self.is_chat:
            return question
        system = self.default_system if system is None else system
        head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
        return f"{head}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"

    def prompt(self, question: str, system: str | None = None) -> list[int]:
        return self.encode(self.format(question, system))


def _default_system(template: str) -> str:
    """The system message a ChatML template inserts when none is given (SmolLM2, Qwen2.5 have one).
    We read it from the template's literal text rather than run Jinja."""
    m = re.search(r"<\|im_start\|>system\\?n?\s*(.*?)<\|im_end\|>", template, re.S)
    if not m or "{" in m.group(1) or "message" in m.group(1):
        return ""
    return m.group(1).strip()
