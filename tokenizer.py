"""
Tokenizers and chat templates. Every tokenizer here is a tiktoken encoding built from what a
checkpoint ships: a Hugging Face tokenizer.json (byte-level BPE: SmolLM2, Qwen2/3, LLaMA-3
converted), LLaMA-3's original/tokenizer.model, or Qwen's qwen.tiktoken. The chat templates
(ChatML with Qwen3's thinking switched off, and LLaMA-3's headers) are written by hand, so no
Jinja runs and the prompt ids are exactly what the reference templates produce.

    tok = load_tokenizer(model_dir)
    ids = tok.encode_chat([{"role": "user", "content": "Why is the sky blue?"}])
"""
import base64
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from model import CheckpointError

# the pre-tokenizer split patterns, verbatim from each family's tokenizer (split at a '|')
SMOLLM2_REGEX = (r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|"""
                 r"""\s+(?![^\s\p{N}])|\s+""")
GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
               r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN3_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
LLAMA3_N_SPECIAL = 256
STOP_STRINGS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")


def gpt2_byte_decoder() -> dict:
    """Byte-level BPE writes each byte as a printable unicode character; this maps them back."""
    # 188 bytes that stand for themselves
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    unprintable = [b for b in range(256) if b not in printable]
    # the rest stand for 256, 257, ... in byte order
    chars = {b: b for b in printable} | {b: 256 + i for i, b in enumerate(unprintable)}
    return {chr(c): b for b, c in chars.items()}


@dataclass
class Tokenizer:
    encoding: "object"  # tiktoken.Encoding
    n_vocab: int  # ids >= n_vocab are filler ranks for bytes the vocabulary lacks; dropped
    specials: dict = field(default_factory=dict)  # special token string -> id
    chat_format: str = "plain"  # chatml | llama3 | plain
    default_system: str | None = None
    thinking_off: bool = False

    @property
    def stop_ids(self) -> set:
        return {self.specials[s] for s in STOP_STRINGS if s in self.specials}

    @property
    def end_of_turn(self) -> int | None:
        """The token that closes an assistant turn in this chat format (None: plain text has
        none)."""
        closing = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}.get(self.chat_format, "")
        return self.specials.get(closing)

    def encode(self, text: str) -> list:
        """Plain text to ids; special-token strings in the text are treated as ordinary text."""
        return [t for t in self.encoding.encode_ordinary(text) if t < self.n_vocab]

    def decode_bytes(self, ids) -> bytes:
        return self.encoding.decode_bytes([int(t) for t in ids])

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def encode_chat(self, messages: list) -> list:
        """[{'role', 'content'}, ...] to the ids of a prompt that ends where the assistant
        speaks."""
        sp = self.specials
        if self.default_system and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.default_system}] + messages
        ids = []
        if self.chat_format == "chatml":
            for m in messages:
                ids += [sp["<|im_start|>"]] + self.encode(f"{m['role']}\n{m['content']}")
                ids += [sp["<|im_end|>"]] + self.encode("\n")
            ids += [sp["<|im_start|>"]] + self.encode("assistant\n")
            if self.thinking_off:
                ids += [sp["<think>"], *self.encode("\n\n"), sp["</think>"], *self.encode("\n\n")]
        elif self.chat_format == "llama3":
            ids.append(sp["<|begin_of_text|>"])
            for m in messages + [{"role": "assistant", "content": None}]:
                ids += [sp["<|start_header_id|>"]] + self.encode(m["role"])
                ids += [sp["<|end_header_id|>"]] + self.encode("\n\n")
                if m["content"] is not None:
                    ids += self.encode(m["content"]) + [sp["<|eot_id|>"]]
        else:
            ids = self.encode("\n\n".join(m["content"] for m in messages))
        return ids


def tiktoken_encoding(name, pattern, ranks: dict, specials: dict):
    import tiktoken

    return tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens=specials)


def read_json(path: Path):
    """A JSON file of a checkpoint; one that is cut short or not JSON is a one-line error naming
    it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path} is not valid JSON ({e.__class__.__name__}: cut short or damaged?)"
        ) from None


def tokenizer_from_hf_json(path: Path) -> Tokenizer:
    """HF tokenizer.json byte-level BPE -> tiktoken. tiktoken merges the adjacent pair whose
    concatenation has the lowest rank; using token ids as ranks reproduces the BPE merge order
    because byte-level BPE trainers number each merged token after the merge that made it."""
    tj = read_json(path)
    model = tj.get("model") if isinstance(tj, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("vocab"), dict):
        raise CheckpointError(f"{path} holds no tokenizer model with a vocabulary: "
                              "is it a tokenizer.json?")
    if model.get("type") != "BPE":
        raise CheckpointError(f"{path}: only byte-level BPE tokenizers are supported, "
                              f"not {model.get('type')}")
    specials = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    byte_of = gpt2_byte_decoder()
    ranks = {}
    for s, i in model["vocab"].items():
        if s in specials:
            continue
        ranks[bytes(byte_of[c] for c in s)] = i
    n_vocab = max(list(model["vocab"].values()) + list(specials.values())) + 1
    # tiktoken needs every single byte to have a rank; give missing bytes filler ranks past the
    # vocabulary (they can never merge with anything) and drop them after encoding, as HF does
    filler = n_vocab + len(specials) + 1  # any rank past every real one would do
    for b in range(256):
        if bytes([b]) not in ranks:
            ranks[bytes([b])] = filler
            filler += 1
    pattern = pre_tokenizer_regex(tj.get("pre_tokenizer") or {})
    encoding = tiktoken_encoding(path.parent.name, pattern, ranks, specials)
    return Tokenizer(encoding, n_vocab, specials)


def pre_tokenizer_regex(pre: dict) -> str:
    """The split regex of a tokenizer.json pre-tokenizer: an explicit Split pattern (Qwen2/3,
    LLaMA-3), or GPT-2's regex with digits split one by one when a Digits step precedes it
    (SmolLM2)."""
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    for s in steps:
        if s.get("type") == "Split" and "Regex" in s.get("pattern", {}):
            return s["pattern"]["Regex"]
    if any(s.get("type") == "Digits" and s.get("individual_digits") for s in steps):
        return SMOLLM2_REGEX
    return GPT2_REGEX


def tokenizer_from_tiktoken_file(path: Path, family: str) -> Tokenizer:
    """A `.tiktoken` ranks file (base64 token, rank per line): Qwen's qwen.tiktoken or LLaMA-3's
    original/tokenizer.model; the special tokens follow the ranks in the family's fixed order."""
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    n = len(ranks)
    if family == "llama3":  # 256 special ids: the named ones, then reserved_special_token_3, ...
        first_reserved = 3  # 0..2 are among the named ones
        names = LLAMA3_SPECIALS + [
            f"<|reserved_special_token_{first_reserved + i}|>"
            for i in range(LLAMA3_N_SPECIAL - len(LLAMA3_SPECIALS))
        ]
        pattern = LLAMA3_REGEX
    else:
        names = QWEN3_SPECIALS
        pattern = QWEN2_REGEX
    specials = {s: n + i for i, s in enumerate(names)}
    encoding = tiktoken_encoding(path.stem, pattern, ranks, specials)
    return Tokenizer(encoding, n + len(names), specials)


def load_tokenizer(model_dir) -> Tokenizer:
    model_dir = Path(model_dir)
    cfg = read_json(model_dir / "config.json") if (model_dir / "config.json").is_file() else {}
    cfg = cfg if isinstance(cfg, dict) else {}
    if (model_dir / "tokenizer.json").is_file():
        tok = tokenizer_from_hf_json(model_dir / "tokenizer.json")
    elif (model_dir / "original" / "tokenizer.model").is_file():
        tok = tokenizer_from_tiktoken_file(model_dir / "original" / "tokenizer.model", "llama3")
    elif list(model_dir.glob("*.tiktoken")):
        tok = tokenizer_from_tiktoken_file(sorted(model_dir.glob("*.tiktoken"))[0], "qwen")
    else:
        raise CheckpointError(f"no tokenizer.json, original/tokenizer.model or *.tiktoken in "
                              f"{model_dir}")
    if "<|start_header_id|>" in tok.specials:
        tok.chat_format = "llama3"
    elif "<|im_start|>" in tok.specials:
        tok.chat_format = "chatml"
        tok.thinking_off = cfg.get("model_type") == "qwen3" and "<think>" in tok.specials
    template_file = model_dir / "tokenizer_config.json"
    if template_file.is_file():
        template = read_json(template_file)
        template = (template.get("chat_template") if isinstance(template, dict) else None) or ""
        # a literal default system prompt in the template (SmolLM2 has one)
        m = re.search(r"<\|im_start\|>system\n([^<{}'\"]+)<\|im_end\|>",
                      template if isinstance(template, str) else "")
        tok.default_system = m.group(1) if m else None
    return tok
