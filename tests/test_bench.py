"""bench.py: quality (JSON rows, the oracle per target, a named scorer under its own target), speed (bytes and calls
a step), generate (its counts a recount), retained's interval."""

import itertools
import json
import math
import os
import random
import subprocess
import sys
import types

import pytest
import torch

import bench
import kvpop
import qwen3
import tasks
from support import baby_tasks, checkpoint
from tools import bench_runs, speed, timing

from tests.common import HERE, MODEL_DIR, baby, hf_checkpoint, _ref_marks, run


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
    idx, tgt, dist = baby_tasks.task_batch(tok, 2, 512, random.Random("test-0"), p_cue=0.3)
    for target in ("mean", "max", "helpful"):
        want = tasks.quality_runs(net, idx, tgt, dist, ["oracle"], [0.125], 4, 32, target=target)[0][1]
        assert {k: got[target][k] for k in want} == want, target
    assert len({got[t]["kl"] for t in got}) == 3


def test_bench_quality_ref_judges_every_row_kind(tmp_path, baby):
    """bench.py quality --model M --ref R (a fine-tune's rows) judges every kind of row against the
    dense model before, R: full's and streaming's, and the oracle's and a scorer's (the README's
    fine-tune row is one of these), each the row tasks.quality_runs gives for M against R on
    bench's held-out sequences (the command line, as a user runs it). Judged against M itself, the
    oracle's and the scorer's KL differ: --ref is what they read."""
    import fast

    ref, tok = baby
    torch.manual_seed(0)
    tuned = qwen3.Qwen3.from_pretrained(MODEL_DIR, dtype=torch.float32)
    with torch.no_grad():  # a stand-in for a fine-tune: the baby's weights moved
        for p in tuned.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tuned.save_pretrained(str(tmp_path / "tuned"))
    folder = os.path.join("baby", "scorers", "recall-helpful", "kvpop-window")
    out = tmp_path / "q.json"
    args = ["--model", str(tmp_path / "tuned"), "--ref", MODEL_DIR]
    args += ["--policies", "full,streaming,oracle", "--scorer", folder, "--target", "helpful"]
    args += ["--n", "2", "--budgets", "0.25", "--json", str(out)]
    r = run("bench.py", "quality", *args)
    assert r.returncode == 0, r.stderr
    got = {(row["target"], row["policy"]): row for row in json.loads(out.read_text())}
    # the rows by their definition: the tuned model's runs judged against the dense model before
    seqs = baby_tasks.held_out_batch(tok, "recall", 2, 512)
    learned = fast.speed_up(kvpop.load_scorer(os.path.join(HERE, folder)))  # as bench runs it
    cache = ([0.25], 4, 32)
    heuristics = tasks.quality_runs(tuned, *seqs, ["streaming"], *cache, ref=ref)[0]
    for row in heuristics:  # full's, streaming's
        assert {k: got["-", row["policy"]][k] for k in row} == row, row["policy"]
    policies = ["oracle", learned]
    want = tasks.quality_runs(tuned, *seqs, policies, *cache, ref=ref, target="helpful")[0][1:]
    alone = tasks.quality_runs(tuned, *seqs, policies, *cache, target="helpful")[0][1:]
    for row, own in zip(want, alone):  # the oracle's, the scorer's
        assert {k: got["helpful", row["policy"]][k] for k in row} == row, row["policy"]
        assert own["kl"] != row["kl"], row["policy"]
    assert len(got) == 4


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
    with timing.Meter() as meter:
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
        cache = speed.empty_cache(net, r["policy"], r["budget"], 64, 66, opts, torch.float32)
        speed.fill(cache, 64)
        promoted.clear()
        graph = make_fx(lambda x: net(x, cache=cache), tracing_mode="real")(torch.tensor([[13]])).graph
        traced = sum(isinstance(n.target, torch._ops.OpOverload) for n in graph.nodes) + len(promoted)
        assert r["calls"]["eager"] == traced and promoted, (r, traced)
        assert 0 <= r["calls"]["compiled"] < r["calls"]["eager"] / 4, r


def _ref_far(words, start, far):
    """[(hit, is_far)] of each answer of _ref_marks: far when the key's value was last written (the last `key value`
    not followed by `no`) at least `far` positions before the key."""
    out, live = [], lambda i: i + 2 >= len(words) or words[i + 2] != "no"
    for j1, v in _ref_marks(words, start):
        j = j1 - 1
        bound = max(i + 1 for i in range(j) if words[i] == words[j] and words[i + 1] in baby_tasks.VALUES and live(i))
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
    idx = baby_tasks.task_batch(tok, 6, 256, random.Random("test-0"), **baby_tasks.TASKS["cue"])[0]
    prompt, full = samples["cue", "-", "full", 1]
    assert torch.equal(prompt, idx[:, 1:208])
    with torch.no_grad():
        greedy = net(torch.cat([prompt, full], 1)).argmax(-1)[:, 206:-1]
    assert torch.equal(greedy, full)
    out = tmp_path / "gen.json"
    args = f"{base} --budgets 48,40 --policies full,h2o --scorer baby/scorers/cue-helpful/kvpop-window --json {out}"
    rows, samples = bench.cmd_generate(args.split())
    assert json.loads(out.read_text()) == rows and "| cue | - | h2o | 40 |" in capsys.readouterr().out
    word = {i: w for w, i in baby_tasks.task_ids(tok)[0].items()}
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
    word = {i: w for w, i in baby_tasks.task_ids(tok)[0].items()}
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


def test_bench_runs_a_named_scorer_once_under_its_own_target(tmp_path):
    """bench.py quality --scorer A,B: each folder runs once, under the target its scorer.json says it was trained for
    (not once per --target under one name); a folder whose target is not asked for is one clear line."""
    import bench

    helpful, maxed = "baby/scorers/recall-helpful/kvpop-window", "baby/scorers/recall-max/kvpop-window"
    assert [kvpop.load_scorer(d).meta["target"] for d in (helpful, maxed)] == ["helpful", "max"]
    out = tmp_path / "rows.json"
    argv = f"--task recall --n 4 --budgets 0.25 --policies full --target helpful,max --json {out}".split()
    bench.cmd_quality(argv + ["--scorer", f"{helpful},{maxed}"])
    learned = [(r["target"], r["policy"]) for r in json.load(open(out)) if r["policy"] == "kvpop-window"]
    assert learned == [("helpful", "kvpop-window"), ("max", "kvpop-window")]
    r = subprocess.run([sys.executable, "bench.py", "quality", "--target", "helpful", "--scorer", maxed], capture_output=True, text=True, cwd=HERE)
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].endswith("was trained for target max: add it to --target")


def test_bench_and_its_tools_import_no_other_script():
    """bench.py and tools/ stand on the core's modules, not on another script: no train, sample or pretrain import
    (bench.py speed once imported train.py, running its flags and presets)."""
    import ast
    import glob

    for path in [os.path.join(HERE, "bench.py"), *glob.glob(os.path.join(HERE, "tools", "*.py"))]:
        tree = ast.parse(open(path, encoding="utf-8").read())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not names & {"train", "sample", "pretrain"}, path


def test_generate_runs_in_their_documented_order():
    """bench_runs.policy_runs: full once, then each other policy at each budget (a policy's budgets together), then
    each scorer under its target at each budget."""
    s = object()
    got = bench_runs.policy_runs(["full", "streaming", "h2o"], [0.5, 0.25], [("max", s)])
    others = [("-", p, b) for p in ("streaming", "h2o") for b in (0.5, 0.25)]
    assert got == [("-", "full", 1), *others, ("max", s, 0.5), ("max", s, 0.25)]


def test_meter_keeps_the_peak_after_a_free():
    """timing.Meter's peak is the most bytes live at once: 8 MB held, freed, then 4 bytes: the peak stays >= 8 MB,
    and a view adds nothing."""
    with timing.Meter() as meter:
        x = torch.zeros(2**21)  # 8 MiB of fp32
        x.view(-1, 2)  # on x's storage
        del x
        torch.zeros(1)
    assert 2**23 <= meter.peak < 2**23 + 1024 and meter.now <= 1024


def test_write_budgets_a_share_of_prompt_and_answer(monkeypatch):
    """bench_runs.write: the cache's budget is a share of P + tokens (a prompt of 20 and 12 to write at 0.5, no state:
    16 entries), and it writes `tokens` ids a row when nothing stops it."""
    made = []
    real = bench_runs.KVCache
    monkeypatch.setattr(bench_runs, "KVCache", lambda *args: made.append(args[2]) or real(*args))
    c = qwen3.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )
    net = qwen3.Qwen3(c).eval()
    prompt = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(0))
    out = bench_runs.write(net, prompt, "streaming", 0.5, 2, 4, 12, (0.0, 0, 1.0), 0)
    assert made == [16] and out.shape == (2, 12)
