"""Tests of support/tokenizer.py: ids identical to Hugging Face tokenizers on the real Qwen3 tokenizer.json."""

import json
import os
import random
import shutil
import unicodedata

import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizer

from support.tokenizer import QWEN3_ADDED, Tokenizer
from tests.common import CORPUS, HF_DIR, tok


# =========================================================================================================
# tokenizer: ids identical to Hugging Face tokenizers on the real Qwen3 tokenizer.json




def _json(name):
    with open(os.path.join(HF_DIR, name), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def hf_tok():
    return HFTokenizer.from_file(os.path.join(HF_DIR, "tokenizer.json"))


@pytest.fixture(scope="module")
def tok_vocab(tmp_path_factory):  # a folder with vocab.json + tokenizer_config.json only
    d = tmp_path_factory.mktemp("vocab_only")
    for f in ("vocab.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(HF_DIR, f), d)
    return Tokenizer.from_pretrained(str(d))


@pytest.fixture(scope="module")
def tok_pypi():
    return Tokenizer.from_pretrained(None)


def test_corpus_size():
    assert len(CORPUS) > 4000 and CORPUS != unicodedata.normalize("NFC", CORPUS)


def test_parity_with_hf(tok, hf_tok):
    ids = tok.encode(CORPUS)
    assert ids == hf_tok.encode(CORPUS, add_special_tokens=False).ids
    # added tokens were found
    assert {151643, 151644, 151645, 151667, 151668, 151657, 151659} <= set(ids)
    for line in CORPUS.splitlines(keepends=True):
        assert tok.encode(line) == hf_tok.encode(line, add_special_tokens=False).ids, repr(line)


def test_parity_added_token_edges(tok, hf_tok):
    # '>' + U+0338 composes to U+226F under NFC: HF splits the added token out first, so it survives
    for s in ["<think>\u0338x", "a<|im_end|>\u0301", "\u0338<|im_start|>", "<|im_end|><|im_end|>", "", "<|im_start"]:
        assert tok.encode(s) == hf_tok.encode(s, add_special_tokens=False).ids, repr(s)
    assert tok.encode("<think>\u0338")[0] == 151667


def test_parity_fuzz(tok, hf_tok):  # random mixes of the pieces where tokenizers tend to disagree
    rng = random.Random(0)
    pools = [
        " \t\n\r\u00a0\u3000",
        "abcXYZ'sdtlmrevSDTLMREV",
        "0123456789",
        "!?.,;:-_()[]{}<>|/\\\"'`~@#$%^&*+=",
        "éüñçßøæœ",
        "\u0301\u0308\u0338\u0323\u0302\u200d\ufe0f",
        "中文日本語한국어",
        "αβγдежعربيहिन्दी",
        "🇯🇵👍🏽👨🧑💻🌈",
        "\u1100\u1112\u1161\u1175\u11a8\u11ab",
    ] + [QWEN3_ADDED]
    for _ in range(2000):
        s = "".join(
            "".join(rng.choices(p, k=1 if p is QWEN3_ADDED else rng.randint(1, 6)))
            for p in rng.choices(pools, k=rng.randint(1, 30))
        )
        assert tok.encode(s) == hf_tok.encode(s, add_special_tokens=False).ids, repr(s)


def test_roundtrip(tok):
    assert tok.decode(tok.encode(CORPUS)) == unicodedata.normalize("NFC", CORPUS)
    for line in CORPUS.splitlines(keepends=True):
        assert tok.decode(tok.encode(line)) == unicodedata.normalize("NFC", line)


def test_sources_agree(tok, tok_vocab, tok_pypi):
    ids = tok.encode(CORPUS)
    assert tok_vocab.encode(CORPUS) == ids and tok_pypi.encode(CORPUS) == ids
    for t in (tok, tok_vocab, tok_pypi):
        assert t.n_vocab == 151669 and t.stop == {151643, 151645}
        assert [t.encode(a) for a in QWEN3_ADDED] == [[i] for i in range(151643, 151669)]
    # the whole vocabulary, rank = id
    ranks = [tok.enc.decode_single_token_bytes(i) for i in range(151643)]
    assert [tok_pypi.enc.decode_single_token_bytes(i) for i in range(151643)] == ranks
    assert [tok_vocab.enc.decode_single_token_bytes(i) for i in range(151643)] == ranks


def test_added_token_names_match_tokenizer_json():
    added = _json("tokenizer.json")["added_tokens"]
    assert [(a["id"], a["content"]) for a in added] == list(enumerate(QWEN3_ADDED, 151643))


def _stream(tok, ids):
    step, chunks, seen = tok.decode_stream(), [], b""
    for i in ids:
        chunks.append(step(i))
        seen += tok.enc.decode_single_token_bytes(i)
        assert "\ufffd" not in chunks[-1]
        # all complete characters so far, and nothing of an incomplete one
        assert "".join(chunks) == seen.decode("utf-8", errors="ignore")
    return chunks


def test_stream_split_characters(tok):
    text = "🇯🇵🇺🇸🏳\ufe0f\u200d🌈 👨\u200d👩\u200d👧 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ 𓀀𓁐 龘靐齉 ﷽ " + CORPUS
    ids = tok.encode(text)
    split = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert len(split) > 20  # the text really has characters split across tokens
    chunks = _stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids) == unicodedata.normalize("NFC", text)
    assert sum(c == "" for c in chunks) > 10  # incomplete bytes were held back


def test_stream_cut_inside_a_character_flushes_like_decode(tok):
    ids = tok.encode("🇯🇵🇺🇸🏳\ufe0f\u200d🌈 👨\u200d👩\u200d👧 𓀀𓁐 龘靐齉 ﷽")
    cuts = [n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd")]
    assert len(cuts) > 5  # generations that end inside a multi-byte character
    for n in cuts:
        dec = tok.decode_stream()
        assert "".join(dec(i) for i in ids[:n]) + dec() == tok.decode(ids[:n])


def test_stream_invalid_bytes_match_decode(tok):
    b = tok.enc.encode_single_token
    # bad, good, held
    ids = [b(b"\xf0\x9f"), b(b"a"), b(b"\xe9"), b(b"\xe4\xb8"), b(b"\xad"), b(b"\xf0")]
    step = tok.decode_stream()
    assert "".join(step(i) for i in ids[:-1]) == tok.decode(ids[:-1]) == "\ufffda\ufffd中"
    assert step(ids[-1]) == ""  # an incomplete last character waits


def test_chat_template(tok, hf_tok):
    p = "What is 2+2?"
    off, on = tok.chat(p, think=False), tok.chat(p, think=True)
    assert on == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"
    ids = tok.encode(off)
    assert ids == [
        151644,
        872,
        198,
        3838,
        374,
        220,
        17,
        10,
        17,
        30,
        151645,
        198,
        151644,
        77091,
        198,
        151667,
        271,
        151668,
        271,
    ]
    assert ids == hf_tok.encode(off, add_special_tokens=False).ids and tok.encode(on) == ids[:-4]
    # the same strings as Qwen3's own chat template renders
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders it
    tpl = env.from_string(_json("tokenizer_config.json")["chat_template"])
    msgs = [{"role": "user", "content": p}]
    assert tpl.render(messages=msgs, add_generation_prompt=True, enable_thinking=False) == off
    assert tpl.render(messages=msgs, add_generation_prompt=True) == on


def test_cut_vocab(tmp_path):
    V = 4096 + 26
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": V}))
    # no tokenizer files: PyPI ranks, cut by config.json
    cut = Tokenizer.from_pretrained(str(tmp_path))
    ids = cut.encode(CORPUS)
    assert max(ids) < V and cut.n_vocab == V and cut.decode(ids) == unicodedata.normalize("NFC", CORPUS)
    assert [cut.encode(a) for a in QWEN3_ADDED] == [[i] for i in range(4096, V)]
    assert cut.stop == {4096, 4098} and cut.encode(cut.chat("hi", think=False))[-4:] == [4120, 271, 4121, 271]
    # fewer merges, more tokens
    assert len(ids) > len(Tokenizer.from_pretrained(None).encode(CORPUS))
    assert "".join(map(cut.decode_stream(), ids)) == cut.decode(ids)
    # same cut from the tokenizer.json source
    shutil.copy(os.path.join(HF_DIR, "tokenizer.json"), tmp_path)
    assert Tokenizer.from_pretrained(str(tmp_path)).encode(CORPUS) == ids
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 256 + 26}))  # bytes only
    b = Tokenizer.from_pretrained(str(tmp_path))
    assert [b.enc.decode_single_token_bytes(i) for i in b.encode("héllo")] == [bytes([c]) for c in "héllo".encode()]


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer folder"):
        Tokenizer.from_pretrained(str(tmp_path / "missing"))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        Tokenizer.from_pretrained(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {}}))
    with pytest.raises(ValueError, match="byte-level BPE"):
        Tokenizer.from_pretrained(str(tmp_path))
    os.remove(tmp_path / "tokenizer.json")
    for V, msg in [(100, "ranks 0..255"), ("big", "must be an integer")]:
        (tmp_path / "config.json").write_text(json.dumps({"vocab_size": V}))
        with pytest.raises(ValueError, match=msg):
            Tokenizer.from_pretrained(str(tmp_path))


