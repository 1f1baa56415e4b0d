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

BABY = os.path.join(HERE, "baby")
CODEBABY = os.path.join(HERE, "codebaby")


# ----------------------------------------------------------------------------------------------------------
# code: real text nobody here wrote (support/corpus.py: the corpus and its metrics; pretrain.py --data, train.py
# --task code, bench.py quality --task code), on a tiny corpus made here


def _code_corpus(folder, files=26, lines=30):
    """Made-up Python whose names recur far back: mod0.py .. mod25.py, of which mod7.py and mod25.py are held out."""
    rng = random.Random(0)
    words = "alpha beta gamma delta kernel tensor shape stride".split()
    words += "buffer module device layout".split()
    folder.mkdir()
    for i in range(files):
        body = [f"import {rng.choice(words)}_{i}", ""]
        for j in range(lines):
            a, b = rng.sample(words, 2)
            comment = rng.choice(words)
            signature = f"def {a}_{j}({b}, {a}_{i}):"
            statement = f"    return {b} + {a}_{i}  # {comment}"
            body.append(signature + "\n" + statement)
        (folder / f"mod{i}.py").write_text("\n".join(body))
    return folder


def _path_hash(path):
    """The sha256 of a relative path as a number: paths whose hash is 0 mod 10 are held out."""
    return int(hashlib.sha256(path.encode()).hexdigest(), 16)


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
    assert sorted(train + held) == every
    assert not set(train) & set(held)
    # held out: sha256 of the relative path = 0 mod 10
    ref = [p for p in every if _path_hash(p) % 10 == 0]
    assert held == ref == ["mod25.py", "mod7.py"]
    assert corpus.code_files(str(root)) == (train, held)
    # a new file moves no other
    (root / "new.py").write_text("y = 2")
    train2, held2 = corpus.code_files(str(root))
    assert set(train) <= set(train2)
    assert set(held) <= set(held2)


def _ref_file_metrics(full, local, lp, idx, S):
    """file_metrics from the definitions, one position at a time in Python floats: at each t in S..T-2, KL = sum_v
    p_full(v) (log p_full(v) - log p(v)), top-1 = both argmaxes equal, the log-perplexity ratio term log p_full(y) - log
    p(y) of the next token y = idx[t + 1]; y is key when log p_full(y) - log p_local(y) > 2 and log p_full(y) > -2
    (LongPPL); on the key ones, p's argmax == y and its loss rise log p_full(y) - log p(y).
    -> per file (kl, top1, log_ppl, key_share, key_top1 or nan, key_loss or nan)."""
    best = lambda xs: max(range(len(xs)), key=xs.__getitem__)
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan
    out = []
    files = zip(full.tolist(), local.tolist(), lp.tolist(), idx.tolist())
    for f, l, g, row in files:
        kl, top1, nll, key, right, rise = [], [], [], [], [], []
        for t in range(S, len(row) - 1):
            kl.append(sum(math.exp(a) * (a - b) for a, b in zip(f[t], g[t])))
            top1.append(best(f[t]) == best(g[t]))
            y = row[t + 1]
            full_y, local_y, policy_y = f[t][y], l[t][y], g[t][y]
            nll.append(full_y - policy_y)
            key.append(full_y - local_y > 2 and full_y > -2)
            if key[-1]:
                right.append(best(g[t]) == y)
                rise.append(full_y - policy_y)
        per_file = (kl, top1, nll, key, right, rise)
        out.append(tuple(mean(xs) for xs in per_file))
    return out


METRICS = ("kl", "top1", "log_ppl", "key_share", "key_top1", "key_loss")


def test_code_metrics_match_their_definitions():
    g = torch.Generator().manual_seed(0)
    B, T, V, S = 4, 40, 10, 5
    idx = torch.randint(0, V, (B, T), generator=g)
    logits = torch.randn(B, T, V, generator=g)
    # full often sure and right, the local context and the policy noisy copies of it
    # (file 3 has no key token)
    boost = 6 * torch.rand(B, T - 1, 1, generator=g)
    logits[:, :-1].scatter_add_(-1, idx[:, 1:, None], boost)
    full = logits.log_softmax(-1)
    local_noise = 3 * torch.randn(B, T, V, generator=g)
    local = (logits + local_noise).log_softmax(-1)
    local[3] = full[3]
    policy_noise = 1.5 * torch.randn(B, T, V, generator=g)
    lp = (logits + policy_noise).log_softmax(-1)
    key = measures.key_tokens(full, local, idx, S)
    got = measures.file_metrics(full, lp, idx, S, key)
    per_file = _ref_file_metrics(full, local, lp, idx, S)
    ref = torch.tensor(per_file, dtype=torch.float64)
    for j, name in enumerate(METRICS):
        want = ref[:, j]
        close = torch.allclose(got[name].double(), want, atol=1e-5, equal_nan=True)
        assert close, (name, got[name], want)
    # the case has key tokens in files 0-2, some missed; none in file 3
    key_share, key_top1 = ref[:, 3], ref[:, 4]
    assert (key_share[:3] > 0).all() and key_share[3] == 0
    assert ref[3, 4:].isnan().all()
    assert 0 < key_top1[:3].mean() < 1
    assert (ref[:, 1] < 1).all()
    # the normal 95% interval over files, nan files left out
    x = torch.tensor([0.2, math.nan, 0.5, 0.9, 0.4])
    mean, half = measures.interval(x)
    kept = [0.2, 0.5, 0.9, 0.4]
    m = sum(kept) / 4
    sd = math.sqrt(sum((v - m) ** 2 for v in kept) / 3)
    assert mean == pytest.approx(m)
    assert half == pytest.approx(1.96 * sd / 2)
    one_kept = torch.tensor([0.3, math.nan])
    assert math.isnan(measures.interval(one_kept)[0])


def test_code_commands_run_on_a_tiny_corpus(tmp_path, monkeypatch, capsys):
    """pretrain.py --data, train.py --task code (each twice: the same bits) and bench.py quality --task code --json,
    whose rows for streaming match the metrics recomputed from their definitions on the held-out files."""
    root = str(_code_corpus(tmp_path / "c"))
    model, again = tmp_path / "code", tmp_path / "again"
    sha = lambda f: hashlib.sha256(f.read_bytes()).hexdigest()
    tiny = ["--data", root, "--seq_len", "128", "--tokens", "256", "--final_steps", "3"]
    for out in (model, again):
        pretrain_args = [*tiny, "--out_dir", str(out)]
        assert _main(monkeypatch, "pretrain.py", *pretrain_args) is None
    assert "key tokens at 0.125" in capsys.readouterr().out
    assert sha(model / "model.safetensors") == sha(again / "model.safetensors")
    small = ["--seq_len", "128", "--window", "8", "--budget", "0.25"]
    small += ["--max_iters", "2", "--batch_size", "2"]
    code = ["--task", "code", "--corpus", root, "--model", str(model)]
    # --task code: the max target
    scorer = model / "scorers" / "code-max" / "kvpop-window"
    scorer_again = tmp_path / "s2"
    for out in (scorer, scorer_again):
        args = [*code, *small, "--eval_seqs", "2"]
        assert _main(monkeypatch, "train.py", *args, "--out_dir", str(out)) is None
    assert "held-out boundary loss" in capsys.readouterr().out
    weights = "scorer.safetensors"
    assert sha(scorer / weights) == sha(scorer_again / weights)
    # the fine-tune (default kind from that scorer, and StreamingLLM+) prints the command that measures it, bench.py
    # quality --ref: the fine-tuned model's rows (a row a budget) judged against the model before
    tune = [*code, *small, "--finetune"]
    ft = str(tmp_path / "ft")
    f_json = tmp_path / "f.json"
    budgets = (0.25, 0.125)
    from_scorer = (["--init_from", str(scorer)], ["kvpop-window"])
    streaming_plus = (["--policy", "streaming"], [])
    for extra, learned in [from_scorer, streaming_plus]:
        assert _main(monkeypatch, "train.py", *tune, *extra, "--out_dir", ft) is None
        printed = capsys.readouterr().out
        assert f"quality --task code --model {ft} --ref {model}" in printed
        if learned:
            scorers = ["--scorer", ft, "--target", "max"]
        else:
            scorers = ["--scorer", ""]
        bench_args = ["--task", "code", "--corpus", root]
        bench_args += ["--model", ft, "--ref", str(model), "--T", "128"]
        bench_args += ["--window", "8", "--policies", "full,streaming"]
        bench_args += ["--n", "4", "--json", str(f_json)]
        assert _main(monkeypatch, "bench.py", *bench_args, *scorers) is None
        rows = json.loads(f_json.read_text())
        policies = ["full", "streaming", *learned]
        want = [(p, b) for p in policies for b in budgets]
        assert [(r["policy"], r["budget"]) for r in rows] == want
    q = tmp_path / "q.json"
    args = [*code, "--T", "128", "--window", "8", "--target", "max"]
    assert _main(monkeypatch, "bench.py", *args, "--n", "4", "--json", str(q)) is None
    assert "key top-1" in capsys.readouterr().out
    rows = json.loads(q.read_text())
    heuristic_policies = ("streaming", "h2o", "tova", "knorm", "random")
    heuristics = [("-", p, b) for p in heuristic_policies for b in budgets]
    learned = [("max", p, b) for p in ("oracle", "kvpop-window") for b in budgets]
    full_rows = [("-", "full", 0.25), ("-", "full", 0.125)]
    got = [(r["target"], r["policy"], r["budget"]) for r in rows]
    assert got == [*full_rows, *heuristics, *learned]
    columns = {*METRICS[:2], *METRICS[3:], "ppl_ratio"}
    assert all(r["task"] == "code" and columns <= set(r) for r in rows)
    first = rows[0]
    assert first["kl"] == 0 and first["top1"] == 1
    assert first["ppl_ratio"] == 1 and first["files"] == 2
    # streaming at 0.25 (S = 32) on the 2 held-out files, by the definitions
    net = qwen3.Qwen3.from_pretrained(str(model))
    tok = tokenizer.Tokenizer.from_pretrained(str(model))
    files = corpus.code_held_out(tok, root, 128, 4)
    full = tasks.evaluate(net, files, "full", 1, online=False).log_softmax(-1)
    streamed = tasks.evaluate(net, files, "streaming", 0.25, 4, 8, online=False)
    lp = streamed.log_softmax(-1)
    per_file = _ref_file_metrics(full, lp, lp, files, 32)
    # (files, 6)
    ref = torch.tensor(per_file, dtype=torch.float64)
    top1, nll = ref[:, 1], ref[:, 2]
    row = rows[2]
    key_share = ref[:, 3].mean().item()
    assert row["key_share"] == pytest.approx(key_share, abs=1e-5) == first["key_share"]
    assert row["top1"] == pytest.approx(top1.mean().item(), abs=1e-5)
    assert top1.std() > 0
    top1_ci = 1.96 * top1.std().item() / math.sqrt(2)
    assert row["top1_ci"] == pytest.approx(top1_ci, abs=1e-5)
    kl = ref[:, 0].mean().item()
    assert row["kl"] == pytest.approx(kl, abs=1e-5)
    # the paired column: each row's per-file KL less streaming's at its budget; streaming's own is 0
    assert row["kl_paired"] == 0 and rows[0]["kl_paired"] == pytest.approx(-kl, abs=1e-5)  # full's: 0 - streaming's
    oracle = next(r for r in rows if r["policy"] == "oracle" and r["budget"] == 0.25)
    lp = tasks.evaluate(net, files, "oracle", 0.25, 4, 8, online=False, target="max").log_softmax(-1)
    diff = torch.tensor(_ref_file_metrics(full, lp, lp, files, 32))[:, 0] - ref[:, 0]
    assert oracle["kl_paired"] == pytest.approx(diff.mean().item(), abs=1e-5)
    assert oracle["kl_paired_ci"] == pytest.approx(1.96 * diff.std().item() / math.sqrt(2), abs=1e-5)
    ppl_ratio = nll.mean().exp().item()
    assert row["ppl_ratio"] == pytest.approx(ppl_ratio, abs=1e-5)


def _pretrain_globals(monkeypatch, *args):
    """pretrain.py's module (its flags parsed from args, not run) -> its globals."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["pretrain.py", *args])
    script = os.path.join(HERE, "pretrain.py")
    return runpy.run_path(script, run_name="pretrain_under_test")


def test_pretrain_data_step_learns_the_next_token(tmp_path, monkeypatch):
    """pretrain.py --data's first step: the gradient its loss sends to the logits is that of the mean cross entropy of
    each position against the next token (written here from the definition), on the batch it read."""
    root = str(_code_corpus(tmp_path / "c"))
    tiny = ["--data", root, "--seq_len", "128", "--tokens", "256", "--final_steps", "1"]
    g = _pretrain_globals(monkeypatch, *tiny, "--out_dir", str(tmp_path / "o"))
    model = g["init_baby"]()
    seen = {}

    # the step's tokens and logits, and the gradient its loss sends them
    def hook(module, args, out):
        seen["idx"], seen["logits"] = args[0], out
        out.register_hook(lambda grad: seen.__setitem__("grad", grad))

    model.register_forward_hook(hook)
    params = [p for p in model.parameters() if p.requires_grad]
    tok = tokenizer.Tokenizer.from_pretrained("codebaby")
    seqs = corpus.code_sequences(tok, root, 128)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    assert g["code_steps"](model, optimizer, params, seqs) == 1
    # (2, 128)
    idx = seen["idx"]
    x = seen["logits"].detach().requires_grad_(True)
    next_nll = lambda b, t: -x[b, t].log_softmax(-1)[idx[b, t + 1]]
    nll = [next_nll(b, t) for b in range(2) for t in range(127)]
    (want,) = torch.autograd.grad(torch.stack(nll).mean(), x)
    grad = seen["grad"]
    assert torch.allclose(grad, want, atol=1e-7), (grad - want).abs().max()
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
        flags = ["--data", "torch", "--copies", str(share)]
        flags += ["--seq_len", str(T), "--out_dir", out]
        g = _pretrain_globals(monkeypatch, *flags)
        got = g["copy_spans"](idx, torch.Generator().manual_seed(0))
        # the input is left alone
        assert torch.equal(idx, torch.arange(4 * T).view(4, T))
        for row, new in zip(idx.tolist(), got.tolist()):
            # (where, where it was)
            moved = [(t, new[t] - row[0]) for t in range(T) if new[t] != row[t]]
            assert (len(moved) > 0) == bool(share)
            assert len(moved) <= 2 * T // 8
            assert all(0 <= was <= t - T // 8 for t, was in moved), moved


def test_code_corpus_missing_or_too_small_is_one_line(tmp_path, monkeypatch):
    small, empty = tmp_path / "small", tmp_path / "empty"
    small.mkdir()
    (small / "a.py").write_text("x = 1\n")
    empty.mkdir()
    (empty / "a.md").write_text("not code")
    cases = [(tmp_path / "nope", "no folder")]
    cases += [(empty, "no .py/.txt files"), (small, "need")]
    for root, why in cases:
        out = tmp_path / "out"
        pretrain_args = ["--data", str(root), "--out_dir", str(out)]
        pretrain = _main(monkeypatch, "pretrain.py", *pretrain_args)
        one_line_error(pretrain, "pretrain.py", str(root), why)
        assert not out.exists()
        assert not os.path.exists(f"{out}.tmp")
        code = ["--task", "code", "--corpus", str(root)]
        code += ["--model", "baby", "--window", "8"]
        train_args = [*code, "--seq_len", "128", "--out_dir", str(out)]
        train = _main(monkeypatch, "train.py", *train_args)
        one_line_error(train, "train.py", str(root), why)
        assert not out.exists()
        bench_run = _main(monkeypatch, "bench.py", *code, "--T", "128")
        one_line_error(bench_run, "bench.py quality", str(root), why)
    # code is its own model's: not beside the baby's tasks
    together = _main(monkeypatch, "bench.py", "--task", "recall,code")
    one_line_error(together, "code runs alone")


def test_code_files_each_begin_with_end_of_text(tmp_path):
    """code_sequences packs the training files in path order, each as <|endoftext|> then its text's tokens (so no
    file runs into the one before it); code_held_out's rows are the held-out files' first T tokens, <|endoftext|>
    first, in the order of their paths' sha256."""
    root, T = _code_corpus(tmp_path / "c"), 128
    tok = tokenizer.Tokenizer.from_pretrained(CODEBABY)
    eot = tok.special["<|endoftext|>"]
    tokens = lambda name: [eot] + tok.encode((root / name).read_text())
    # the training files: all but mod7.py and mod25.py, sorted by path
    training = sorted(f"mod{i}.py" for i in range(26) if i not in (7, 25))
    ids = [t for name in training for t in tokens(name)]
    n = len(ids) // T
    packed = torch.tensor(ids[: n * T]).view(n, T)
    assert torch.equal(corpus.code_sequences(tok, str(root), T), packed)
    held = sorted(["mod7.py", "mod25.py"], key=_path_hash)
    held_rows = corpus.code_held_out(tok, str(root), T, 4).tolist()
    assert held_rows == [tokens(name)[:T] for name in held]


def test_code_budget_that_keeps_every_token_is_one_line(tmp_path, monkeypatch):
    """bench.py quality --task code --budgets 1: a budget that keeps all T tokens of a file evicts nothing and leaves
    no position to measure: one line naming it."""
    root = str(_code_corpus(tmp_path / "c"))
    args = ["--task", "code", "--corpus", root, "--T", "256"]
    args += ["--scorer", "", "--budgets", "1"]
    message = _main(monkeypatch, "bench.py", *args)
    why = "--budgets 1 keeps all 256 tokens of a file"
    one_line_error(message, why, "use less")


# ----------------------------------------------------------------------------------------------------------
# the code tables against their definitions: a fine-tuned model is judged against the dense model before it, every
# file counts in an interval, each column holds its own metric, and the sample's far copies count what they say


def _tuned(tmp_path):
    """The baby and a copy with moved weights saved as a checkpoint folder (a stand-in for a fine-tune), held-out
    'files' (5, 96) of the recall task's tokens, and the budget's S."""
    torch.manual_seed(0)
    ref = qwen3.Qwen3.from_pretrained(BABY, dtype="float32")
    tuned = qwen3.Qwen3.from_pretrained(BABY, dtype="float32")
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tuned.save_pretrained(str(tmp_path / "tuned"))
    tok = tokenizer.Tokenizer.from_pretrained(BABY)
    files = baby_tasks.task_batch(tok, 5, 96, random.Random("files"))[0]
    return ref, tuned, files


def _ref_rows(ref, tuned, files, budget, sinks, window):
    """Per-file metrics of the tuned model under streaming against the dense ref (its full log-probs, its key tokens
    at the budget), then each metric's mean and 95% half-width over all files (1.96 sd / sqrt(n), nan files out)."""
    S = kvpop.budget_size(budget, files.shape[1], sinks, window)[0]

    def lp(model, policy, b):
        logits = tasks.evaluate(model, files, policy, b, sinks, window, online=False)
        return logits.float().log_softmax(-1)

    full = lp(ref, "full", 1)
    local = lp(ref, "streaming", budget)
    policy = lp(tuned, "streaming", budget)
    per = _ref_file_metrics(full, local, policy, files, S)
    out = {}
    for j, name in enumerate(METRICS):
        x = [row[j] for row in per if not math.isnan(row[j])]
        m = sum(x) / len(x)
        sd = math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1))
        out[name] = (m, 1.96 * sd / math.sqrt(len(x)))
    return out


def test_code_runs_judge_against_the_reference_over_every_file(tmp_path):
    """code_runs(tuned, ref=ref) in chunks of 2 files: every metric and interval equals the definition's over all 5
    files, against the dense model before (ref), and the perplexity ratio's interval brackets it (lo < ratio < hi)."""
    ref, tuned, files = _tuned(tmp_path)
    policies, budgets = ["streaming"], [0.25]
    rows = measures.code_runs(tuned, files, policies, budgets, 4, 8, chunk=2, ref=ref)
    row = next(r for r in rows if r["policy"] == "streaming")
    want = _ref_rows(ref, tuned, files, 0.25, 4, 8)
    for name in ("kl", "top1", "key_share"):
        mean, half = want[name]
        assert row[name] == pytest.approx(mean, abs=2e-5), name
        assert row[name + "_ci"] == pytest.approx(half, abs=2e-5), name
    log_ppl, half = want["log_ppl"]
    ratio, lo, hi = row["ppl_ratio"], row["ppl_lo"], row["ppl_hi"]
    assert ratio == pytest.approx(math.exp(log_ppl), abs=2e-5)
    assert lo == pytest.approx(math.exp(log_ppl - half), abs=2e-5) and lo < ratio
    assert hi == pytest.approx(math.exp(log_ppl + half), abs=2e-5) and hi > ratio
    # the files have key tokens: the key columns are measured
    assert want["key_share"][0] > 0


def test_bench_quality_ref_judges_against_the_model_before(tmp_path, monkeypatch, capsys):
    """bench.py quality --ref: the fine-tuned model's rows under streaming, and full's, are tasks.quality_runs' of the
    fine-tuned model (the checkpoint in out_dir) against the dense model before (--ref, the folder it started from)."""
    ref, tuned, _ = _tuned(tmp_path)
    out = tmp_path / "q.json"
    args = ["--model", str(tmp_path / "tuned"), "--ref", BABY]
    args += ["--policies", "full,streaming", "--scorer", ""]
    args += ["--n", "8", "--json", str(out)]
    assert _main(monkeypatch, "bench.py", *args) is None
    rows = json.loads(out.read_text())
    tok = tokenizer.Tokenizer.from_pretrained(BABY)
    seqs = baby_tasks.held_out_batch(tok, "recall", 8, 512)
    policies, budgets = ["streaming"], [0.25, 0.125]
    want = tasks.quality_runs(tuned, *seqs, policies, budgets, 4, 32, ref=ref)[0]
    judged = [{k: r[k] for k in w} for r, w in zip(rows, want)]
    assert judged == want and len(rows) == len(want)
    alone = tasks.quality_runs(tuned, *seqs, policies, budgets, 4, 32)[0]
    # judged against itself, another KL: --ref is read
    assert alone[1]["kl"] != want[1]["kl"]


def test_code_table_puts_each_metric_in_its_column():
    """code_table's columns, read back from a row whose every metric is a different number."""
    names = ("kl", "top1", "key_share", "key_top1", "key_loss", "kl_paired")
    row = dict(target="max", policy="p", budget=0.25)
    row.update(ppl_ratio=1.5, ppl_lo=1.25, ppl_hi=1.75)
    for j, name in enumerate(names):
        row[name], row[name + "_ci"] = 0.1 * (j + 1), 0.01 * (j + 1)
    lines = measures.code_table([row]).splitlines()
    split = lambda line: [c.strip() for c in line.strip("| ").split("|")]
    header = split(lines[0])
    cells = dict(zip(header, split(lines[2])))
    assert cells["KL"] == "0.1000 ± 0.0100"
    assert cells["top-1"] == "20.0% ± 2.0%"
    assert cells["key share"] == "30.00% ± 3.00%"
    assert cells["key top-1"] == "40.0% ± 4.0%"
    assert cells["key loss rise"] == "0.50 ± 0.05"
    assert cells["perplexity ratio"] == "1.500 (1.250-1.750)"
    assert cells["KL - streaming's (paired)"] == "+0.6000 ± 0.0600"


def test_read_on_counts_each_policys_far_copies(capsys):
    """bench.py read's reading (read_on) on a recall sequence of the baby read on from token 200 at S =
    64: each policy's printed count, and its ✓ marks, equal the key tokens (full beats streaming at S by 2 nats) its
    likeliest next token gets right, computed here from the masked passes; full's count is the ceiling."""
    net = qwen3.Qwen3.from_pretrained(BABY, dtype="float32")
    tok = tokenizer.Tokenizer.from_pretrained(BABY)
    batch = baby_tasks.task_batch(tok, 1, 320, random.Random("read"))[0]
    read = batch[0].tolist()
    n, S, sinks, window = 200, 64, 4, 32
    scorer = os.path.join(BABY, "scorers", "recall-helpful", "kvpop-window")
    learned = kvpop.load_scorer(scorer)
    policies = {"kvpop-window": learned, "streaming": "streaming", "full": "full"}
    measures.read_on(net, tok, read, n, policies, S, sinks, window, 0.125)
    out = capsys.readouterr().out
    seq = torch.tensor([read])

    def lp(policy, size, w):
        logits = tasks.evaluate(net, seq, policy, size, sinks, w, online=False)
        return logits[0].float().log_softmax(-1)

    full, local = lp("full", len(read), window), lp("streaming", S, S - sinks)
    # the key tokens: positions q >= n predicted at q - 1
    gain = lambda q: full[q - 1, read[q]] - local[q - 1, read[q]]
    sure = lambda q: full[q - 1, read[q]] > -2
    key = [q for q in range(n, len(read)) if gain(q) > 2 and sure(q)]
    assert len(key) >= 3
    # block j: policy j's marked text, before its count
    blocks = re.split(r"far copies .*\n", out)
    counts = {}
    for j, (name, policy) in enumerate(policies.items()):
        size = len(read) if name == "full" else S
        guess = lp(policy, size, window).argmax(-1)
        right = sum(int(guess[q - 1]) == read[q] for q in key)
        counts[name] = right
        assert f"far copies {name} 0.125: {right}/{len(key)}" in out
        assert blocks[j].count("✓") == right
        assert blocks[j].count("✗") == len(key) - right
    assert counts["full"] >= max(counts.values())
    assert counts["full"] > counts["streaming"]


# ----------------------------------------------------------------------------------------------------------
# the real-text model's recipe (pretrain.py --data, as LOG.md states it): the shipped model's shape, a copying head
# seeded in layer 1, two spans of T/32 to T/8 tokens copied at least T/8 later, every sequence once an epoch


def test_pretrain_data_defaults_build_the_shipped_code_model(monkeypatch):
    """pretrain.py --data torch's defaults make a model of codebaby/'s config (width, heads, RoPE base 1e6, ...)."""
    g = _pretrain_globals(monkeypatch, "--data", "torch", "--out_dir", "unused")
    got = vars(g["init_baby"]().config)
    shipped = json.load(open(os.path.join(CODEBABY, "config.json")))
    shared = [k for k in shipped if k in got]
    assert {k: got[k] for k in shared} == {k: shipped[k] for k in shared}
    assert shipped["rope_theta"] == 1e6
    assert g["seq_len"] == 2048 == corpus.CODE_LENGTH


def test_pretrain_data_seeds_a_copying_head(monkeypatch):
    """At initialisation, layer 1's query head 0 reads the current token and its key the previous one: in a span
    repeated later (distinct tokens), each token of the copy attends most to the token after its earlier occurrence."""
    g = _pretrain_globals(monkeypatch, "--data", "torch", "--out_dir", "unused")
    model = g["init_baby"]()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randperm(2000, generator=gen)[:200]
    # tokens 40..89 again at 200..249
    idx = torch.cat([tokens, tokens[40:90]])[None]
    seen = {}

    def attn(i, q, k, v, pos):
        seen[i] = (q, k)
        return kernels.attention(q, k, v)[0]

    with torch.no_grad():
        model(idx, attn=attn)
    q, k = seen[1]
    # query head 0 on KV head 0 (T, T)
    scores = q[0, 0] @ k[0, 0].T
    future = torch.ones_like(scores, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, -math.inf)
    # copy positions d = 201..249 hold token 40 + d - 200 - ...
    looks = scores.argmax(-1)[201:250]
    assert looks.tolist() == list(range(42, 91))


def test_pretrain_data_copies_two_spans_of_t_over_32_to_t_over_8(monkeypatch):
    """copy_spans at --copies 1 on distinct tokens: each sequence gets 2 copied runs (each from a contiguous source),
    1 or 3 where the second covers or cuts the first; in the sequences of 2 runs each is T/32 to T/8 tokens long."""
    T = 2048
    idx = torch.arange(16 * T).view(16, T)
    flags = ["--data", "torch", "--copies", "1", "--out_dir", "unused"]
    g = _pretrain_globals(monkeypatch, *flags)
    got = g["copy_spans"](idx, torch.Generator().manual_seed(0))
    counts, lengths = [], []
    for row, new in zip(idx.tolist(), got.tolist()):
        # (start, length) of runs copied from one contiguous source
        runs = []
        for t in range(T):
            if new[t] == row[t]:
                continue
            last_end = runs[-1][0] + runs[-1][1] if runs else None
            if last_end == t and new[t] == new[t - 1] + 1:
                runs[-1][1] += 1
            else:
                runs.append([t, 1])
        counts.append(len(runs))
        if len(runs) == 2:
            lengths += [n for _, n in runs]
    # the second may cover or cut the first: rarely
    assert set(counts) <= {1, 2, 3} and counts.count(2) >= 12
    short = sum(n < T // 32 for n in lengths)
    # one cut short by the other, at most
    assert short <= 1 and max(lengths) <= T // 8


def test_pretrain_data_sees_every_sequence_once_an_epoch(tmp_path, monkeypatch):
    """code_steps reads the packed sequences in a seeded order, --tokens / --seq_len a step: over as many steps as an
    epoch has, every sequence once (no batch overlaps the next). Files of 6 functions: 36 sequences, 18 steps."""
    root = str(_code_corpus(tmp_path / "c", lines=6))
    tok = tokenizer.Tokenizer.from_pretrained("codebaby")
    seqs = corpus.code_sequences(tok, root, 128)
    steps = len(seqs) // 2
    tiny = ["--data", root, "--seq_len", "128", "--tokens", "256"]
    tiny += ["--final_steps", str(steps), "--copies", "0"]
    g = _pretrain_globals(monkeypatch, *tiny, "--out_dir", str(tmp_path / "o"))
    model = g["init_baby"]()
    read = []
    record = lambda module, args, out: read.extend(args[0].tolist())
    model.register_forward_hook(record)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    g["code_steps"](model, optimizer, params, seqs)
    rows = {tuple(r) for r in seqs.tolist()}
    assert len(read) == 2 * steps >= len(rows) - 1
    assert all(tuple(r) in rows for r in read)
    # no sequence twice
    assert len({tuple(r) for r in read}) == len(read)


def test_bench_read_hands_read_on_the_scorer_streaming_and_full(monkeypatch):
    """bench.py read hands read_on the learned scorer, streaming and full by name, at the scorer's window, the
    budget's S and the file read on from T - tokens (read_on itself: test_read_on_counts_each_policys_far_copies)."""
    import bench

    got = {}
    monkeypatch.setattr(bench, "read_on", lambda *args: got.update(args=args))
    monkeypatch.chdir(HERE)
    bench.cmd_read(["--target", "max", "--budgets", "0.125", "--tokens", "256"])
    net, tok, read, n, policies, S, sinks, window, budget = got["args"]
    scorer = os.path.join(CODEBABY, "scorers", "code-max", "kvpop-window")
    shipped = kvpop.load_scorer(scorer)
    assert list(policies) == ["kvpop-window", "streaming", "full"]
    assert policies["streaming"] == "streaming"
    assert policies["full"] == "full"
    learned = policies["kvpop-window"]
    assert learned.state_dict().keys() == shipped.state_dict().keys()
    given, want = learned.state_dict(), shipped.state_dict()
    assert all(torch.equal(given[name], want[name]) for name in want)
    assert window == shipped.window
    assert S == kvpop.budget_size(0.125, len(read), sinks, window)[0]
    assert budget == 0.125
    assert len(read) == 2048 and n == 2048 - 256


def test_student_measures_score_the_teacher_and_streaming_as_they_must():
    """experiments/student.py's measures, on 2 held-out code files at 0.125: a 'student' whose priorities are its
    teacher's (r* + gamma t) keeps the same pool (accuracy, AUC, overlap 1); a student that ranks by position alone
    (streaming) holds exactly the recent share of the teacher's pool."""
    from experiments import student

    net = qwen3.Qwen3.from_pretrained(CODEBABY, dtype="float32")
    net = net.requires_grad_(False)
    tok = tokenizer.Tokenizer.from_pretrained(CODEBABY)
    idx = corpus.code_held_out(tok, "torch", 1024, 2)
    window, pool = 64, kvpop.budget_size(0.125, 1024, 4, 64)[1]
    rs = kvpop.dense_targets(net, idx, window, "max")[1]

    # the teacher's own priorities, as a scorer would give them
    class Follower:
        received = False

        def recency(self, layer, pos):
            return 0.002 * pos.float()

        def __call__(self, layer, k, v, pos):
            return rs[layer] + self.recency(layer, pos)

    # streaming
    class Recent(Follower):
        def __call__(self, layer, k, v, pos):
            return pos.float().expand(k.shape[:3])

    followed = student.measure(net, Follower(), idx, window, pool, "max")
    for row in followed:
        assert row["auc"] == 1 and row["overlap"] == 1, row
        # balanced: where the teacher's newcomers are all kept or all dropped (layer 0 here) half is all there is
        assert row["acc"] == (1 if row["layer"] == 1 else 0.5), row
    rows = student.measure(net, Recent(), idx, window, pool, "max")
    assert all(row["overlap"] == pytest.approx(row["recent"]) for row in rows)
    # a head whose teacher keeps far tokens
    assert any(row["recent"] < 0.5 for row in rows)


def test_student_measures_count_the_pools_exactly(monkeypatch):
    """experiments/student.py's overlap and recent share on a hand-built teacher and student, one
    layer and head, sinks 2, window 4, pool 4, T 20: at the last query (19) the eligible tokens are
    2..15 and each pool is the 4 best of them (README, Method: eviction times). The teacher ranks
    15, 12, 11, 3 (then 9): its pool {3, 11, 12, 15}. The student ranks 5, 3, 11, 15 (then 12,
    which 15 evicts at the last query): its pool {3, 5, 11, 15} holds 3 of the teacher's;
    streaming's pool, the newest 4, {12, 13, 14, 15}, holds 2. Each set one token larger or smaller
    (a pool of 3 or 5, the eligible tokens one off, a token evicted at the last query counted)
    gives another share."""
    from experiments import student

    T, window, pool = 20, 4, 4
    r, pi = torch.zeros(1, 1, T), torch.zeros(1, 1, T)
    for rank, t in enumerate([15, 12, 11, 3, 9]):  # the teacher's r*, best first
        r[..., t] = 5.0 - rank
    for rank, t in enumerate([5, 3, 11, 15, 12]):  # the student's priorities, best first
        pi[..., t] = 5.0 - rank
    kv = torch.zeros(1, 1, T, 8)
    # the teacher's targets, as the dense pass would give them
    monkeypatch.setattr(kvpop, "dense_targets", lambda *args: ([(kv, kv)], [r]))
    monkeypatch.setattr(student, "sinks", 2)

    class Hand:
        received = False

        def recency(self, layer, pos):  # no recency: the priorities as given
            return 0.0 * pos

        def __call__(self, layer, k, v, pos):
            return pi

    idx = torch.zeros(1, T, dtype=torch.long)
    (row,) = student.measure(None, Hand(), idx, window, pool, "max")
    assert (row["layer"], row["head"]) == (0, 0)
    assert row["overlap"] == 3 / 4 and row["recent"] == 2 / 4


def test_code_runs_paired_column_at_every_budget():
    """tools/measures.code_runs' kl_paired on a tiny random model, 3 files, two budgets: a mean of per-file
    differences is the difference of the means, so at each budget streaming's own is 0, full's is minus streaming's
    KL there and random's is its KL less streaming's there (rows rounded to 5 decimals); code_table prints it signed in
    its own column. Weights x6: attention far from uniform, so the budgets' KL differ."""
    torch.manual_seed(0)
    c = qwen3.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )
    net = qwen3.Qwen3(c).eval()
    with torch.no_grad():
        for w in net.parameters():
            w.mul_(6 if w.dim() == 2 else 1)
    idx = torch.randint(0, 64, (3, 48), generator=torch.Generator().manual_seed(1))
    budgets = [0.5, 0.25]
    rows = measures.code_runs(net, idx, ["full", "streaming", "random"], budgets, 2, 4)
    at = {(r["policy"], r["budget"]): r for r in rows}
    for b in budgets:
        kl = at["streaming", b]["kl"]
        assert kl > 0 and at["streaming", b]["kl_paired"] == 0
        assert at["full", b]["kl_paired"] == pytest.approx(-kl, abs=2e-5)
        assert at["random", b]["kl_paired"] == pytest.approx(at["random", b]["kl"] - kl, abs=2e-5)
    assert at["streaming", 0.25]["kl"] != at["streaming", 0.5]["kl"]  # the budgets differ
    lines = measures.code_table(rows).splitlines()
    column = lines[0].split(" | ").index("KL - streaming's (paired)")
    row = at["random", 0.25]
    cells = next(line for line in lines if "| random | 0.25 |" in line).split(" | ")
    assert cells[column] == f"{row['kl_paired']:+.4f} ± {row['kl_paired_ci']:.4f}"
