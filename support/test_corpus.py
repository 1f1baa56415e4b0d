"""Tests of support/corpus.py: the code corpus and its metrics (pretrain.py --data, train.py --task code, bench.py
quality --task code), on a tiny corpus made here."""

import hashlib
import json
import math
import os
import random
import sys

import pytest
import torch

import bench
import qwen3
import tasks
from support import corpus, tokenizer


from test_kvpop import HERE, one_line_error


# ----------------------------------------------------------------------------------------------------------
# code: real text nobody here wrote (support/corpus.py: the corpus and its metrics; pretrain.py --data, train.py --task code, bench.py
# quality --task code), on a tiny corpus made here


def _code_corpus(folder, files=26, lines=30):
    """Made-up Python whose names recur far back: mod0.py .. mod25.py, of which mod7.py and mod25.py are held out."""
    rng = random.Random(0)
    words = "alpha beta gamma delta kernel tensor shape stride buffer module device layout".split()
    folder.mkdir()
    for i in range(files):
        body = [f"import {rng.choice(words)}_{i}", ""]
        for j in range(lines):
            a, b = rng.sample(words, 2)
            body.append(f"def {a}_{j}({b}, {a}_{i}):\n    return {b} + {a}_{i}  # {rng.choice(words)}")
        (folder / f"mod{i}.py").write_text("\n".join(body))
    return folder


def _main(monkeypatch, script, *args):
    """A command line in this process (bench.py: its quality command), the thread count left alone -> the message it
    exits with, or None when it ran to the end."""
    import runpy

    monkeypatch.chdir(HERE)
    monkeypatch.setattr(sys, "argv", [script, *args])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    try:
        if script == "bench.py":
            bench.cmd_quality(list(args))
        else:
            runpy.run_path(os.path.join(HERE, script), run_name="__main__")
    except SystemExit as e:
        return e.code


def test_code_split_is_fixed_by_path_hash_and_disjoint(tmp_path):
    root = _code_corpus(tmp_path / "c")
    (root / "notes.md").write_text("not code")
    (root / "sub").mkdir()
    (root / "sub" / "a.txt").write_text("x = 1")
    train, held = corpus.code_files(str(root))
    every = sorted([f"mod{i}.py" for i in range(26)] + ["sub/a.txt"])
    assert sorted(train + held) == every and not set(train) & set(held)
    # held out: sha256 of the relative path = 0 mod 10
    ref = [p for p in every if int(hashlib.sha256(p.encode()).hexdigest(), 16) % 10 == 0]
    assert held == ref == ["mod25.py", "mod7.py"] and corpus.code_files(str(root)) == (train, held)
    # a new file moves no other
    (root / "new.py").write_text("y = 2")
    train2, held2 = corpus.code_files(str(root))
    assert set(train) <= set(train2) and set(held) <= set(held2)


def _ref_file_metrics(full, lp, idx, S):
    """file_metrics from the definitions, one position at a time in Python floats: at each t in S..T-2, KL = sum_v
    p_full(v) (log p_full(v) - log p(v)), top-1 = both argmaxes equal, the log-perplexity ratio term log p_full(y) - log
    p(y) of the next token y = idx[t + 1]; far copies: y full predicts right whose previous occurrence u < t + 1 has
    t + 1 - u >= S, the share p predicts right. -> per file (kl, top1, log_ppl, far_copy or nan)."""
    out = []
    for f, g, row in zip(full.tolist(), lp.tolist(), idx.tolist()):
        kl, top1, nll, far, hit = [], [], [], 0, 0
        for t in range(S, len(row) - 1):
            best = lambda xs: max(range(len(xs)), key=xs.__getitem__)
            kl.append(sum(math.exp(a) * (a - b) for a, b in zip(f[t], g[t])))
            top1.append(best(f[t]) == best(g[t]))
            y = row[t + 1]
            nll.append(f[t][y] - g[t][y])
            before = [u for u in range(t + 1) if row[u] == y]
            if before and t + 1 - before[-1] >= S and best(f[t]) == y:
                far, hit = far + 1, hit + (best(g[t]) == y)
        mean = lambda xs: sum(xs) / len(xs)
        out.append((mean(kl), mean(top1), mean(nll), hit / far if far else math.nan))
    return out


def test_code_metrics_match_their_definitions():
    g = torch.Generator().manual_seed(0)
    B, T, V, S = 4, 40, 10, 5
    idx = torch.randint(0, V, (B, T), generator=g)
    logits = torch.randn(B, T, V, generator=g)
    # full often right, the policy a noisy copy of it
    logits[:, :-1].scatter_add_(-1, idx[:, 1:, None], 3 * torch.rand(B, T - 1, 1, generator=g))
    full = logits.log_softmax(-1)
    lp = (logits + 1.5 * torch.randn(B, T, V, generator=g)).log_softmax(-1)
    got = corpus.file_metrics(full, lp, idx, S)
    ref = torch.tensor(_ref_file_metrics(full, lp, idx, S), dtype=torch.float64)
    for j, key in enumerate(("kl", "top1", "log_ppl", "far_copy")):
        assert torch.allclose(got[key].double(), ref[:, j], atol=1e-5, equal_nan=True), (key, got[key], ref[:, j])
    assert 0 < ref[:, 3].nanmean() < 1 and (ref[:, 1] < 1).all()  # the case has far copies, some missed
    # last seen, the distance to the previous occurrence (0: none)
    row = [3, 1, 3, 3, 2, 1]
    assert corpus.last_seen(torch.tensor([row])).tolist() == [[0, 0, 2, 1, 0, 4]]
    # the normal 95% interval over files, nan files left out
    x = torch.tensor([0.2, math.nan, 0.5, 0.9, 0.4])
    mean, half = corpus.interval(x)
    kept = [0.2, 0.5, 0.9, 0.4]
    m = sum(kept) / 4
    sd = math.sqrt(sum((v - m) ** 2 for v in kept) / 3)
    assert mean == pytest.approx(m) and half == pytest.approx(1.96 * sd / 2)
    assert math.isnan(corpus.interval(torch.tensor([0.3, math.nan]))[0])


def test_code_commands_run_on_a_tiny_corpus(tmp_path, monkeypatch, capsys):
    """pretrain.py --data, train.py --task code (each twice: the same bits) and bench.py quality --task code --json,
    whose rows for streaming match the metrics recomputed from their definitions on the held-out files."""
    root, model = str(_code_corpus(tmp_path / "c")), tmp_path / "code"
    sha = lambda f: hashlib.sha256(f.read_bytes()).hexdigest()
    tiny = ["--data", root, "--seq_len", "128", "--tokens", "256", "--final_steps", "3"]
    for out in (model, tmp_path / "again"):
        assert _main(monkeypatch, "pretrain.py", *tiny, "--out_dir", str(out)) is None
    assert "held-out accuracy" in capsys.readouterr().out
    assert sha(model / "model.safetensors") == sha(tmp_path / "again" / "model.safetensors")
    small = ["--seq_len", "128", "--window", "8", "--budget", "0.25", "--max_iters", "2", "--batch_size", "2"]
    scorer = model / "scorers" / "code-helpful" / "kvpop-window"
    for out in (scorer, tmp_path / "s2"):
        args = ["--task", "code", "--corpus", root, "--model", str(model), *small, "--eval_seqs", "2"]
        assert _main(monkeypatch, "train.py", *args, "--out_dir", str(out)) is None
    assert "held-out boundary loss" in capsys.readouterr().out
    assert sha(scorer / "scorer.safetensors") == sha(tmp_path / "s2" / "scorer.safetensors")
    q = tmp_path / "q.json"
    args = ["--task", "code", "--corpus", root, "--model", str(model), "--T", "128", "--window", "8"]
    assert _main(monkeypatch, "bench.py", *args, "--n", "4", "--json", str(q)) is None
    assert "far-copy" in capsys.readouterr().out
    rows = json.loads(q.read_text())
    heuristics = [("-", p, b) for p in ("streaming", "h2o", "tova", "knorm", "random") for b in (0.25, 0.125)]
    learned = [("helpful", p, b) for p in ("oracle", "kvpop-window") for b in (0.25, 0.125)]
    assert [(r["target"], r["policy"], r["budget"]) for r in rows] == [("-", "full", 1), *heuristics, *learned]
    assert all(r["task"] == "code" and {"kl", "top1", "far_copy", "ppl_ratio"} <= set(r) for r in rows)
    assert rows[0]["kl"] == 0 and rows[0]["top1"] == 1 and rows[0]["ppl_ratio"] == 1 and rows[0]["files"] == 2
    # streaming at 0.25 (S = 32) on the 2 held-out files, by the definitions
    net = qwen3.Qwen3.from_pretrained(str(model))
    files = corpus.code_held_out(tokenizer.Tokenizer.from_pretrained(str(model)), root, 128, 4)
    full = tasks.evaluate(net, files, "full", 1, online=False).log_softmax(-1)
    lp = tasks.evaluate(net, files, "streaming", 0.25, 4, 8, online=False).log_softmax(-1)
    ref = torch.tensor(_ref_file_metrics(full, lp, files, 32), dtype=torch.float64)  # (files, 4)
    top1, nll = ref[:, 1], ref[:, 2]
    row = rows[1]
    assert row["top1"] == pytest.approx(top1.mean().item(), abs=1e-5) and top1.std() > 0
    assert row["top1_ci"] == pytest.approx(1.96 * top1.std().item() / math.sqrt(2), abs=1e-5)
    assert row["kl"] == pytest.approx(ref[:, 0].mean().item(), abs=1e-5)
    assert row["ppl_ratio"] == pytest.approx(nll.mean().exp().item(), abs=1e-5)


def test_code_corpus_missing_or_too_small_is_one_line(tmp_path, monkeypatch):
    small, empty = tmp_path / "small", tmp_path / "empty"
    small.mkdir()
    (small / "a.py").write_text("x = 1\n")
    empty.mkdir()
    (empty / "a.md").write_text("not code")
    cases = [(tmp_path / "nope", "no folder"), (empty, "no .py/.txt files"), (small, "need")]
    for root, why in cases:
        out = tmp_path / "out"
        pretrain = _main(monkeypatch, "pretrain.py", "--data", str(root), "--out_dir", str(out))
        one_line_error(pretrain, "pretrain.py", str(root), why)
        assert not out.exists() and not os.path.exists(f"{out}.tmp")
        code = ["--task", "code", "--corpus", str(root), "--model", "baby", "--window", "8"]
        train = _main(monkeypatch, "train.py", *code, "--seq_len", "128", "--out_dir", str(out))
        one_line_error(train, "train.py", str(root), why)
        assert not out.exists()
        one_line_error(_main(monkeypatch, "bench.py", *code, "--T", "128"), "bench.py quality", str(root), why)
    # code is its own model's: not beside the baby's tasks
    one_line_error(_main(monkeypatch, "bench.py", "--task", "recall,code"), "code runs alone")


