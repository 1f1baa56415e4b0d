"""Tests of support/corpus.py: the code corpus and its metrics (pretrain.py --data, train.py --task code, bench.py
quality --task code), on a tiny corpus made here."""

import hashlib
import json
import math
import os
import random
import re
import sys

import pytest
import torch

import bench
import kernels
import kvpop
import qwen3
import tasks
from support import baby_tasks, corpus, tokenizer
from tools import measures


from tests.common import HERE, one_line_error


# ----------------------------------------------------------------------------------------------------------
# code: real text nobody here wrote (support/corpus.py: the corpus and its metrics; pretrain.py --data, train.py
# --task code, bench.py quality --task code), on a tiny corpus made here


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


def _ref_file_metrics(full, local, lp, idx, S):
    """file_metrics from the definitions, one position at a time in Python floats: at each t in S..T-2, KL = sum_v
    p_full(v) (log p_full(v) - log p(v)), top-1 = both argmaxes equal, the log-perplexity ratio term log p_full(y) - log
    p(y) of the next token y = idx[t + 1]; y is key when log p_full(y) - log p_local(y) > 2 and log p_full(y) > -2
    (LongPPL); on the key ones, p's argmax == y and its loss rise log p_full(y) - log p(y).
    -> per file (kl, top1, log_ppl, key_share, key_top1 or nan, key_loss or nan)."""
    out = []
    for f, l, g, row in zip(full.tolist(), local.tolist(), lp.tolist(), idx.tolist()):
        kl, top1, nll, key, right, rise = [], [], [], [], [], []
        for t in range(S, len(row) - 1):
            best = lambda xs: max(range(len(xs)), key=xs.__getitem__)
            kl.append(sum(math.exp(a) * (a - b) for a, b in zip(f[t], g[t])))
            top1.append(best(f[t]) == best(g[t]))
            y = row[t + 1]
            nll.append(f[t][y] - g[t][y])
            key.append(f[t][y] - l[t][y] > 2 and f[t][y] > -2)
            if key[-1]:
                right.append(best(g[t]) == y)
                rise.append(f[t][y] - g[t][y])
        mean = lambda xs: sum(xs) / len(xs) if xs else math.nan
        out.append((mean(kl), mean(top1), mean(nll), mean(key), mean(right), mean(rise)))
    return out


METRICS = ("kl", "top1", "log_ppl", "key_share", "key_top1", "key_loss")


def test_code_metrics_match_their_definitions():
    g = torch.Generator().manual_seed(0)
    B, T, V, S = 4, 40, 10, 5
    idx = torch.randint(0, V, (B, T), generator=g)
    logits = torch.randn(B, T, V, generator=g)
    # full often sure and right, the local context and the policy noisy copies of it (file 3 has no key token)
    logits[:, :-1].scatter_add_(-1, idx[:, 1:, None], 6 * torch.rand(B, T - 1, 1, generator=g))
    full = logits.log_softmax(-1)
    local = (logits + 3 * torch.randn(B, T, V, generator=g)).log_softmax(-1)
    local[3] = full[3]
    lp = (logits + 1.5 * torch.randn(B, T, V, generator=g)).log_softmax(-1)
    key = measures.key_tokens(full, local, idx, S)
    got = measures.file_metrics(full, lp, idx, S, key)
    ref = torch.tensor(_ref_file_metrics(full, local, lp, idx, S), dtype=torch.float64)
    for j, name in enumerate(METRICS):
        assert torch.allclose(got[name].double(), ref[:, j], atol=1e-5, equal_nan=True), (name, got[name], ref[:, j])
    # the case has key tokens in files 0-2, some missed; none in file 3
    assert (ref[:3, 3] > 0).all() and ref[3, 3] == 0 and ref[3, 4:].isnan().all()
    assert 0 < ref[:3, 4].mean() < 1 and (ref[:, 1] < 1).all()
    # the normal 95% interval over files, nan files left out
    x = torch.tensor([0.2, math.nan, 0.5, 0.9, 0.4])
    mean, half = measures.interval(x)
    kept = [0.2, 0.5, 0.9, 0.4]
    m = sum(kept) / 4
    sd = math.sqrt(sum((v - m) ** 2 for v in kept) / 3)
    assert mean == pytest.approx(m) and half == pytest.approx(1.96 * sd / 2)
    assert math.isnan(measures.interval(torch.tensor([0.3, math.nan]))[0])


def test_code_commands_run_on_a_tiny_corpus(tmp_path, monkeypatch, capsys):
    """pretrain.py --data, train.py --task code (each twice: the same bits) and bench.py quality --task code --json,
    whose rows for streaming match the metrics recomputed from their definitions on the held-out files."""
    root, model = str(_code_corpus(tmp_path / "c")), tmp_path / "code"
    sha = lambda f: hashlib.sha256(f.read_bytes()).hexdigest()
    tiny = ["--data", root, "--seq_len", "128", "--tokens", "256", "--final_steps", "3"]
    for out in (model, tmp_path / "again"):
        assert _main(monkeypatch, "pretrain.py", *tiny, "--out_dir", str(out)) is None
    assert "key tokens at 0.125" in capsys.readouterr().out
    assert sha(model / "model.safetensors") == sha(tmp_path / "again" / "model.safetensors")
    small = ["--seq_len", "128", "--window", "8", "--budget", "0.25", "--max_iters", "2", "--batch_size", "2"]
    scorer = model / "scorers" / "code-max" / "kvpop-window"  # --task code: the max target
    for out in (scorer, tmp_path / "s2"):
        args = ["--task", "code", "--corpus", root, "--model", str(model), *small, "--eval_seqs", "2"]
        assert _main(monkeypatch, "train.py", *args, "--out_dir", str(out)) is None
    assert "held-out boundary loss" in capsys.readouterr().out
    assert sha(scorer / "scorer.safetensors") == sha(tmp_path / "s2" / "scorer.safetensors")
    # the fine-tune (default kind from that scorer, and StreamingLLM+) prints the command that measures it, bench.py
    # quality --ref: the fine-tuned model's rows (a row a budget) judged against the model before
    tune = ["--task", "code", "--corpus", root, "--model", str(model), *small, "--finetune"]
    ft = str(tmp_path / "ft")
    for extra, learned in [(["--init_from", str(scorer)], ["kvpop-window"]), (["--policy", "streaming"], [])]:
        assert _main(monkeypatch, "train.py", *tune, *extra, "--out_dir", ft) is None
        assert f"quality --task code --model {ft} --ref {model}" in capsys.readouterr().out
        scorers = ["--scorer", ft, "--target", "max"] if learned else ["--scorer", ""]
        bench_args = ["--task", "code", "--corpus", root, "--model", ft, "--ref", str(model), "--T", "128"]
        bench_args += ["--window", "8", "--policies", "full,streaming", "--n", "4", "--json", str(tmp_path / "f.json")]
        assert _main(monkeypatch, "bench.py", *bench_args, *scorers) is None
        rows = json.loads((tmp_path / "f.json").read_text())
        want = [(p, b) for p in ["full", "streaming", *learned] for b in (0.25, 0.125)]
        assert [(r["policy"], r["budget"]) for r in rows] == want
    q = tmp_path / "q.json"
    args = ["--task", "code", "--corpus", root, "--model", str(model), "--T", "128", "--window", "8", "--target", "max"]
    assert _main(monkeypatch, "bench.py", *args, "--n", "4", "--json", str(q)) is None
    assert "key top-1" in capsys.readouterr().out
    rows = json.loads(q.read_text())
    heuristics = [("-", p, b) for p in ("streaming", "h2o", "tova", "knorm", "random") for b in (0.25, 0.125)]
    learned = [("max", p, b) for p in ("oracle", "kvpop-window") for b in (0.25, 0.125)]
    full_rows = [("-", "full", 0.25), ("-", "full", 0.125)]
    assert [(r["target"], r["policy"], r["budget"]) for r in rows] == [*full_rows, *heuristics, *learned]
    assert all(r["task"] == "code" and {*METRICS[:2], *METRICS[3:], "ppl_ratio"} <= set(r) for r in rows)
    assert rows[0]["kl"] == 0 and rows[0]["top1"] == 1 and rows[0]["ppl_ratio"] == 1 and rows[0]["files"] == 2
    # streaming at 0.25 (S = 32) on the 2 held-out files, by the definitions
    net = qwen3.Qwen3.from_pretrained(str(model))
    files = corpus.code_held_out(tokenizer.Tokenizer.from_pretrained(str(model)), root, 128, 4)
    full = tasks.evaluate(net, files, "full", 1, online=False).log_softmax(-1)
    lp = tasks.evaluate(net, files, "streaming", 0.25, 4, 8, online=False).log_softmax(-1)
    ref = torch.tensor(_ref_file_metrics(full, lp, lp, files, 32), dtype=torch.float64)  # (files, 6)
    top1, nll = ref[:, 1], ref[:, 2]
    row = rows[2]
    assert row["key_share"] == pytest.approx(ref[:, 3].mean().item(), abs=1e-5) == rows[0]["key_share"]
    assert row["top1"] == pytest.approx(top1.mean().item(), abs=1e-5) and top1.std() > 0
    assert row["top1_ci"] == pytest.approx(1.96 * top1.std().item() / math.sqrt(2), abs=1e-5)
    assert row["kl"] == pytest.approx(ref[:, 0].mean().item(), abs=1e-5)
    assert row["ppl_ratio"] == pytest.approx(nll.mean().exp().item(), abs=1e-5)


def _pretrain_globals(monkeypatch, *args):
    """pretrain.py's module (its flags parsed from args, not run) -> its globals."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["pretrain.py", *args])
    return runpy.run_path(os.path.join(HERE, "pretrain.py"), run_name="pretrain_under_test")


def test_pretrain_data_step_learns_the_next_token(tmp_path, monkeypatch):
    """pretrain.py --data's first step: the gradient its loss sends to the logits is that of the mean cross entropy of
    each position against the next token (written here from the definition), on the batch it read."""
    root = str(_code_corpus(tmp_path / "c"))
    tiny = ["--data", root, "--seq_len", "128", "--tokens", "256", "--final_steps", "1"]
    g = _pretrain_globals(monkeypatch, *tiny, "--out_dir", str(tmp_path / "o"))
    model = g["init_baby"]()
    seen = {}

    def hook(module, args, out):  # the step's tokens and logits, and the gradient its loss sends them
        seen["idx"], seen["logits"] = args[0], out
        out.register_hook(lambda grad: seen.__setitem__("grad", grad))

    model.register_forward_hook(hook)
    params = [p for p in model.parameters() if p.requires_grad]
    seqs = corpus.code_sequences(tokenizer.Tokenizer.from_pretrained("codebaby"), root, 128)
    assert g["code_steps"](model, torch.optim.AdamW(params, lr=1e-3), params, seqs) == 1
    idx = seen["idx"]  # (2, 128)
    x = seen["logits"].detach().requires_grad_(True)
    nll = [-x[b, t].log_softmax(-1)[idx[b, t + 1]] for b in range(2) for t in range(127)]
    (want,) = torch.autograd.grad(torch.stack(nll).mean(), x)
    assert torch.allclose(seen["grad"], want, atol=1e-7), (seen["grad"] - want).abs().max()
    # the embedding learns but for the seeded head's columns (0, and 64 onwards)
    E = model.model.embed_tokens.weight
    assert E.requires_grad and E.grad[:, 1:64].abs().sum() > 0
    assert E.grad[:, 0].eq(0).all() and E.grad[:, 64:].eq(0).all()


def test_pretrain_data_copies_spans_far_back(tmp_path, monkeypatch):
    """copy_spans: with --copies 1 every sequence gets spans written again at least T/8 later, at most 2 x T/8 tokens
    changed; with --copies 0 none. Seen on sequences of distinct tokens (a token's value is its first position)."""
    T, out = 256, str(tmp_path / "o")
    idx = torch.arange(4 * T).view(4, T)
    for share in (1, 0):
        flags = ["--data", "torch", "--copies", str(share), "--seq_len", str(T), "--out_dir", out]
        g = _pretrain_globals(monkeypatch, *flags)
        got = g["copy_spans"](idx, torch.Generator().manual_seed(0))
        assert torch.equal(idx, torch.arange(4 * T).view(4, T))  # the input is left alone
        for row, new in zip(idx.tolist(), got.tolist()):
            moved = [(t, new[t] - row[0]) for t in range(T) if new[t] != row[t]]  # (where, where it was)
            assert (len(moved) > 0) == bool(share) and len(moved) <= 2 * T // 8
            assert all(0 <= was <= t - T // 8 for t, was in moved), moved


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


def test_code_files_each_begin_with_end_of_text(tmp_path):
    """code_sequences packs the training files in path order, each as <|endoftext|> then its text's tokens (so no
    file runs into the one before it); code_held_out's rows are the held-out files' first T tokens, <|endoftext|>
    first, in the order of their paths' sha256."""
    root, T = _code_corpus(tmp_path / "c"), 128
    tok = tokenizer.Tokenizer.from_pretrained(os.path.join(HERE, "codebaby"))
    eot = tok.special["<|endoftext|>"]
    tokens = lambda name: [eot] + tok.encode((root / name).read_text())
    # the training files: all but mod7.py and mod25.py, sorted by path
    ids = [t for name in sorted(f"mod{i}.py" for i in range(26) if i not in (7, 25)) for t in tokens(name)]
    n = len(ids) // T
    assert torch.equal(corpus.code_sequences(tok, str(root), T), torch.tensor(ids[: n * T]).view(n, T))
    held = sorted(["mod7.py", "mod25.py"], key=lambda p: int(hashlib.sha256(p.encode()).hexdigest(), 16))
    assert corpus.code_held_out(tok, str(root), T, 4).tolist() == [tokens(name)[:T] for name in held]


def test_code_budget_that_keeps_every_token_is_one_line(tmp_path, monkeypatch):
    """bench.py quality --task code --budgets 1: a budget that keeps all T tokens of a file evicts nothing and leaves
    no position to measure: one line naming it."""
    root = str(_code_corpus(tmp_path / "c"))
    args = ["--task", "code", "--corpus", root, "--T", "256", "--scorer", "", "--budgets", "1"]
    one_line_error(_main(monkeypatch, "bench.py", *args), "--budgets 1 keeps all 256 tokens of a file", "use less")


# ----------------------------------------------------------------------------------------------------------
# the code tables against their definitions: a fine-tuned model is judged against the dense model before it, every
# file counts in an interval, each column holds its own metric, and the sample's far copies count what they say


def _tuned(tmp_path):
    """The baby and a copy with moved weights saved as a checkpoint folder (a stand-in for a fine-tune), held-out
    'files' (5, 96) of the recall task's tokens, and the budget's S."""
    torch.manual_seed(0)
    ref = qwen3.Qwen3.from_pretrained(os.path.join(HERE, "baby"), dtype="float32")
    tuned = qwen3.Qwen3.from_pretrained(os.path.join(HERE, "baby"), dtype="float32")
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tuned.save_pretrained(str(tmp_path / "tuned"))
    tok = tokenizer.Tokenizer.from_pretrained(os.path.join(HERE, "baby"))
    files = baby_tasks.task_batch(tok, 5, 96, random.Random("files"))[0]
    return ref, tuned, files


def _ref_rows(ref, tuned, files, budget, sinks, window):
    """Per-file metrics of the tuned model under streaming against the dense ref (its full log-probs, its key tokens
    at the budget), then each metric's mean and 95% half-width over all files (1.96 sd / sqrt(n), nan files out)."""
    S = kvpop.budget_size(budget, files.shape[1], sinks, window)[0]
    lp = lambda m, p, b: tasks.evaluate(m, files, p, b, sinks, window, online=False).float().log_softmax(-1)
    per = _ref_file_metrics(lp(ref, "full", 1), lp(ref, "streaming", budget), lp(tuned, "streaming", budget), files, S)
    out = {}
    for j, name in enumerate(METRICS):
        x = [row[j] for row in per if not math.isnan(row[j])]
        m = sum(x) / len(x)
        out[name] = (m, 1.96 * math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1)) / math.sqrt(len(x)))
    return out


def test_code_runs_judge_against_the_reference_over_every_file(tmp_path):
    """code_runs(tuned, ref=ref) in chunks of 2 files: every metric and interval equals the definition's over all 5
    files, against the dense model before (ref), and the perplexity ratio's interval brackets it (lo < ratio < hi)."""
    ref, tuned, files = _tuned(tmp_path)
    rows = measures.code_runs(tuned, files, ["streaming"], [0.25], 4, 8, chunk=2, ref=ref)
    row = next(r for r in rows if r["policy"] == "streaming")
    want = _ref_rows(ref, tuned, files, 0.25, 4, 8)
    for name in ("kl", "top1", "key_share"):
        assert row[name] == pytest.approx(want[name][0], abs=2e-5), name
        assert row[name + "_ci"] == pytest.approx(want[name][1], abs=2e-5), name
    log_ppl, half = want["log_ppl"]
    assert row["ppl_ratio"] == pytest.approx(math.exp(log_ppl), abs=2e-5)
    assert row["ppl_lo"] == pytest.approx(math.exp(log_ppl - half), abs=2e-5) and row["ppl_lo"] < row["ppl_ratio"]
    assert row["ppl_hi"] == pytest.approx(math.exp(log_ppl + half), abs=2e-5) and row["ppl_hi"] > row["ppl_ratio"]
    assert want["key_share"][0] > 0  # the files have key tokens: the key columns are measured


def test_bench_quality_ref_judges_against_the_model_before(tmp_path, monkeypatch, capsys):
    """bench.py quality --ref: the fine-tuned model's rows under streaming, and full's, are tasks.quality_runs' of the
    fine-tuned model (the checkpoint in out_dir) against the dense model before (--ref, the folder it started from)."""
    ref, tuned, _ = _tuned(tmp_path)
    out = tmp_path / "q.json"
    args = ["--model", str(tmp_path / "tuned"), "--ref", os.path.join(HERE, "baby"), "--policies", "full,streaming"]
    assert _main(monkeypatch, "bench.py", *args, "--scorer", "", "--n", "8", "--json", str(out)) is None
    rows = json.loads(out.read_text())
    tok = tokenizer.Tokenizer.from_pretrained(os.path.join(HERE, "baby"))
    seqs = baby_tasks.held_out_batch(tok, "recall", 8, 512)
    want = tasks.quality_runs(tuned, *seqs, ["streaming"], [0.25, 0.125], 4, 32, ref=ref)[0]
    assert [{k: r[k] for k in w} for r, w in zip(rows, want)] == want and len(rows) == len(want)
    alone = tasks.quality_runs(tuned, *seqs, ["streaming"], [0.25, 0.125], 4, 32)[0]
    assert alone[1]["kl"] != want[1]["kl"]  # judged against itself, another KL: --ref is read


def test_code_table_puts_each_metric_in_its_column():
    """code_table's columns, read back from a row whose every metric is a different number."""
    names = ("kl", "top1", "key_share", "key_top1", "key_loss")
    row = dict(target="max", policy="p", budget=0.25, ppl_ratio=1.5, ppl_lo=1.25, ppl_hi=1.75)
    for j, name in enumerate(names):
        row[name], row[name + "_ci"] = 0.1 * (j + 1), 0.01 * (j + 1)
    lines = measures.code_table([row]).splitlines()
    header = [c.strip() for c in lines[0].strip("| ").split("|")]
    cells = dict(zip(header, (c.strip() for c in lines[2].strip("| ").split("|"))))
    assert cells["KL"] == "0.1000 ± 0.0100" and cells["top-1"] == "20.0% ± 2.0%"
    assert cells["key share"] == "30.00% ± 3.00%" and cells["key top-1"] == "40.0% ± 4.0%"
    assert cells["key loss rise"] == "0.50 ± 0.05" and cells["perplexity ratio"] == "1.500 (1.250-1.750)"


def test_read_on_counts_each_policys_far_copies(capsys):
    """bench.py read's reading (read_on) on a recall sequence of the baby read on from token 200 at S =
    64: each policy's printed count, and its ✓ marks, equal the key tokens (full beats streaming at S by 2 nats) its
    likeliest next token gets right, computed here from the masked passes; full's count is the ceiling."""
    
    net = qwen3.Qwen3.from_pretrained(os.path.join(HERE, "baby"), dtype="float32")
    tok = tokenizer.Tokenizer.from_pretrained(os.path.join(HERE, "baby"))
    read = baby_tasks.task_batch(tok, 1, 320, random.Random("read"))[0][0].tolist()
    n, S, sinks, window = 200, 64, 4, 32
    learned = kvpop.load_scorer(os.path.join(HERE, "baby", "scorers", "recall-helpful", "kvpop-window"))
    policies = {"kvpop-window": learned, "streaming": "streaming", "full": "full"}
    measures.read_on(net, tok, read, n, policies, S, sinks, window, 0.125)
    out = capsys.readouterr().out
    seq = torch.tensor([read])
    lp = lambda p, size, w: tasks.evaluate(net, seq, p, size, sinks, w, online=False)[0].float().log_softmax(-1)
    full, local = lp("full", len(read), window), lp("streaming", S, S - sinks)
    # the key tokens: positions q >= n predicted at q - 1
    gain = lambda q: full[q - 1, read[q]] - local[q - 1, read[q]]
    key = [q for q in range(n, len(read)) if gain(q) > 2 and full[q - 1, read[q]] > -2]
    assert len(key) >= 3
    blocks = re.split(r"far copies .*\n", out)  # block j: policy j's marked text, before its count
    counts = {}
    for j, (name, policy) in enumerate(policies.items()):
        guess = lp(policy, len(read) if name == "full" else S, window).argmax(-1)
        right = sum(int(guess[q - 1]) == read[q] for q in key)
        counts[name] = right
        assert f"far copies {name} 0.125: {right}/{len(key)}" in out
        assert blocks[j].count("✓") == right and blocks[j].count("✗") == len(key) - right
    assert counts["full"] >= max(counts.values()) and counts["full"] > counts["streaming"]


# ----------------------------------------------------------------------------------------------------------
# the real-text model's recipe (pretrain.py --data, as LOG.md states it): the shipped model's shape, a copying head
# seeded in layer 1, two spans of T/32 to T/8 tokens copied at least T/8 later, every sequence once an epoch


def test_pretrain_data_defaults_build_the_shipped_code_model(monkeypatch):
    """pretrain.py --data torch's defaults make a model of codebaby/'s config (width, heads, RoPE base 1e6, ...)."""
    g = _pretrain_globals(monkeypatch, "--data", "torch", "--out_dir", "unused")
    got = vars(g["init_baby"]().config)
    shipped = json.load(open(os.path.join(HERE, "codebaby", "config.json")))
    assert {k: got[k] for k in shipped if k in got} == {k: v for k, v in shipped.items() if k in got}
    assert shipped["rope_theta"] == 1e6 and g["seq_len"] == 2048 == corpus.CODE_LENGTH


def test_pretrain_data_seeds_a_copying_head(monkeypatch):
    """At initialisation, layer 1's query head 0 reads the current token and its key the previous one: in a span
    repeated later (distinct tokens), each token of the copy attends most to the token after its earlier occurrence."""
    g = _pretrain_globals(monkeypatch, "--data", "torch", "--out_dir", "unused")
    model = g["init_baby"]()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randperm(2000, generator=gen)[:200]
    idx = torch.cat([tokens, tokens[40:90]])[None]  # tokens 40..89 again at 200..249
    seen = {}

    def attn(i, q, k, v, pos):
        seen[i] = (q, k)
        return kernels.attention(q, k, v)[0]

    with torch.no_grad():
        model(idx, attn=attn)
    q, k = seen[1]
    scores = q[0, 0] @ k[0, 0].T  # query head 0 on KV head 0 (T, T)
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -math.inf)
    looks = scores.argmax(-1)[201:250]  # copy positions d = 201..249 hold token 40 + d - 200 - ...
    assert looks.tolist() == list(range(42, 91))


def test_pretrain_data_copies_two_spans_of_t_over_32_to_t_over_8(monkeypatch):
    """copy_spans at --copies 1 on distinct tokens: each sequence gets 2 copied runs (each from a contiguous source),
    1 or 3 where the second covers or cuts the first; in the sequences of 2 runs each is T/32 to T/8 tokens long."""
    T = 2048
    idx = torch.arange(16 * T).view(16, T)
    g = _pretrain_globals(monkeypatch, "--data", "torch", "--copies", "1", "--out_dir", "unused")
    got = g["copy_spans"](idx, torch.Generator().manual_seed(0))
    counts, lengths = [], []
    for row, new in zip(idx.tolist(), got.tolist()):
        runs = []  # (start, length) of runs copied from one contiguous source
        for t in range(T):
            if new[t] != row[t]:
                if runs and runs[-1][0] + runs[-1][1] == t and new[t] == new[t - 1] + 1:
                    runs[-1][1] += 1
                else:
                    runs.append([t, 1])
        counts.append(len(runs))
        lengths += [n for _, n in runs] if len(runs) == 2 else []
    assert set(counts) <= {1, 2, 3} and counts.count(2) >= 12  # the second may cover or cut the first: rarely
    short = sum(n < T // 32 for n in lengths)
    assert short <= 1 and max(lengths) <= T // 8  # one cut short by the other, at most


def test_pretrain_data_sees_every_sequence_once_an_epoch(tmp_path, monkeypatch):
    """code_steps reads the packed sequences in a seeded order, --tokens / --seq_len a step: over as many steps as an
    epoch has, every sequence once (no batch overlaps the next). Files of 6 functions: 36 sequences, 18 steps."""
    root = str(_code_corpus(tmp_path / "c", lines=6))
    seqs = corpus.code_sequences(tokenizer.Tokenizer.from_pretrained("codebaby"), root, 128)
    steps = len(seqs) // 2
    tiny = ["--data", root, "--seq_len", "128", "--tokens", "256", "--final_steps", str(steps), "--copies", "0"]
    g = _pretrain_globals(monkeypatch, *tiny, "--out_dir", str(tmp_path / "o"))
    model = g["init_baby"]()
    read = []
    model.register_forward_hook(lambda module, args, out: read.extend(args[0].tolist()))
    params = [p for p in model.parameters() if p.requires_grad]
    g["code_steps"](model, torch.optim.AdamW(params, lr=1e-3), params, seqs)
    rows = {tuple(r) for r in seqs.tolist()}
    assert len(read) == 2 * steps >= len(rows) - 1 and all(tuple(r) in rows for r in read)
    assert len({tuple(r) for r in read}) == len(read)  # no sequence twice


def test_bench_read_hands_read_on_the_scorer_streaming_and_full(monkeypatch):
    """bench.py read hands read_on the learned scorer, streaming and full by name, at the scorer's window, the
    budget's S and the file read on from T - tokens (read_on itself: test_read_on_counts_each_policys_far_copies)."""
    import bench

    got = {}
    monkeypatch.setattr(bench, "read_on", lambda *args: got.update(args=args))
    monkeypatch.chdir(HERE)
    bench.cmd_read(["--target", "max", "--budgets", "0.125", "--tokens", "256"])
    net, tok, read, n, policies, S, sinks, window, budget = got["args"]
    shipped = kvpop.load_scorer(os.path.join(HERE, "codebaby", "scorers", "code-max", "kvpop-window"))
    assert list(policies) == ["kvpop-window", "streaming", "full"] and policies["streaming"] == "streaming"
    assert policies["full"] == "full" and policies["kvpop-window"].state_dict().keys() == shipped.state_dict().keys()
    given, want = policies["kvpop-window"].state_dict(), shipped.state_dict()
    assert all(torch.equal(given[name], want[name]) for name in want)
    assert window == shipped.window and S == kvpop.budget_size(0.125, len(read), sinks, window)[0] and budget == 0.125
    assert len(read) == 2048 and n == 2048 - 256


def test_student_measures_score_the_teacher_and_streaming_as_they_must():
    """experiments/student.py's measures, on 2 held-out code files at 0.125: a 'student' whose priorities are its
    teacher's (r* + gamma t) keeps the same pool (accuracy, AUC, overlap 1); a student that ranks by position alone
    (streaming) holds exactly the recent share of the teacher's pool."""
    from experiments import student

    net = qwen3.Qwen3.from_pretrained(os.path.join(HERE, "codebaby"), dtype="float32").requires_grad_(False)
    tok = tokenizer.Tokenizer.from_pretrained(os.path.join(HERE, "codebaby"))
    idx = corpus.code_held_out(tok, "torch", 1024, 2)
    window, pool = 64, kvpop.budget_size(0.125, 1024, 4, 64)[1]
    rs = kvpop.dense_targets(net, idx, window, "max")[1]

    class Follower:  # the teacher's own priorities, as a scorer would give them
        received = False

        def recency(self, layer, pos):
            return 0.002 * pos.float()

        def __call__(self, layer, k, v, pos):
            return rs[layer] + self.recency(layer, pos)

    class Recent(Follower):  # streaming
        def __call__(self, layer, k, v, pos):
            return pos.float().expand(k.shape[:3])

    for row in student.measure(net, Follower(), idx, window, pool, "max"):
        assert row["auc"] == 1 and row["overlap"] == 1, row
        # balanced: where the teacher's newcomers are all kept or all dropped (layer 0 here) half is all there is
        assert row["acc"] == (1 if row["layer"] == 1 else 0.5), row
    rows = student.measure(net, Recent(), idx, window, pool, "max")
    assert all(row["overlap"] == pytest.approx(row["recent"]) for row in rows)
    assert any(row["recent"] < 0.5 for row in rows)  # a head whose teacher keeps far tokens
