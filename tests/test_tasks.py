"""The baby and its tasks (tasks.py): the recall and cue tasks are seeded and well formed, the shipped checkpoint
answers them, quality_runs and recall_score against their definitions, train.py's cue rates."""

import copy
import random

import torch

import qwen3
import tasks
from support import baby_tasks

from tests.common import baby, _ref_pass, _ref_quality, _ref_recall, tok


def test_task_ranks_keep_every_task_word_one_token(tok):
    task_words = baby_tasks.KEYS + baby_tasks.VALUES + baby_tasks.FILLERS
    ids = [tok.encode(" " + w) for w in task_words]
    assert all(len(i) == 1 for i in ids)
    assert max(i[0] for i in ids) + 1 == baby_tasks.TASK_RANKS


def test_task_is_seeded_and_well_formed(baby):
    _, tok = baby
    ids, bos = baby_tasks.task_ids(tok)
    draw = lambda seed: baby_tasks.task_batch(tok, 8, 512, random.Random(seed))
    a, b = (draw("test-0") for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], draw("test-1")[0])
    idx, tgt, dist = a
    keys = {ids[w] for w in baby_tasks.KEYS}
    values = {ids[w] for w in baby_tasks.VALUES}
    assert (idx[:, 0] == bos).all()
    assert len(set(ids.values())) == len(ids)
    assert max(ids.values()) < bos
    for s in range(8):
        # real Qwen3 text, one id a word
        text = idx[s].tolist()
        assert tok.encode(tok.decode(text)) == text
        for q in (tgt[s] >= 0).nonzero()[:, 0].tolist():
            k, v = idx[s, q].item(), tgt[s, q].item()
            p = q - dist[s, q].item()
            # the answer follows the key; it is the key's latest binding
            assert k in keys and v in values and idx[s, q + 1] == v
            assert idx[s, p] == v and idx[s, p - 1] == k
            assert k not in idx[s, p + 1 : q].tolist()
    # queries, and far ones
    assert (tgt >= 0).sum() >= 8 * 15
    assert (dist >= 124).sum() >= 8 * 5


def test_cue_task_is_well_formed(baby):
    """The cue task: the recall task plus distractors `key' value' no`, key' never bound or queried
    by the sequence's own keys, the marker `no` nowhere else, about one distractor in 9 words; with
    p_cue = 0 it is the recall task."""
    _, tok = baby
    ids, _ = baby_tasks.task_ids(tok)
    cue = baby_tasks.TASKS["cue"]
    idx, tgt, dist = baby_tasks.task_batch(tok, 8, 512, random.Random("test-0"), **cue)
    keys = {ids[w] for w in baby_tasks.KEYS}
    values = {ids[w] for w in baby_tasks.VALUES}
    no = ids[baby_tasks.MARK]
    for s in range(8):
        x = idx[s].tolist()
        marks = [j for j, t in enumerate(x) if t == no]
        spare = {x[j - 2] for j in marks}
        asked = {x[q] for q in (tgt[s] >= 0).nonzero()[:, 0].tolist()}
        bound = lambda j: j + 2 >= 512 or x[j + 2] != no
        live = {x[j] for j in range(1, 512) if x[j] in keys and bound(j)}
        # key' value' no
        assert all(x[j - 1] in values and x[j - 2] in keys for j in marks)
        # distractor keys are never the sequence's own
        assert spare and not spare & live and asked <= live
        assert 512 / 13 < len(marks) < 512 / 6, len(marks)
    plain = baby_tasks.task_batch(tok, 8, 512, random.Random("test-0"))
    no_cue = baby_tasks.task_batch(tok, 8, 512, random.Random("test-0"), p_cue=0.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, no_cue))
    assert not (plain[0] == no).any()


def test_shipped_baby_answers_the_cue_task(baby):
    net, tok = baby
    cue = baby_tasks.TASKS["cue"]
    idx, tgt, dist = baby_tasks.task_batch(tok, 48, 512, random.Random("test-0"), **cue)
    logits = tasks.evaluate(net, idx, "full", 1, 4, 32, online=False)
    pred = logits.argmax(-1)
    m = (tgt >= 0) & (dist >= 124)
    assert (pred[m] == tgt[m]).float().mean() >= 0.95


def test_previous_token_head(baby):
    net, tok = baby
    idx = baby_tasks.task_batch(tok, 2, 512, random.Random("test-0"))[0]
    got = {}

    def attn(i, q, k, v, pos):
        if i == 0:
            # (B, 1, T, T): head 0's scores
            s = q[:, :1] @ k.transpose(-1, -2) / 8
            future = pos[None, :] > pos[:, None]
            got["p"] = s.masked_fill(future, -1e9).softmax(-1)
        return qwen3.causal(i, q, k, v, pos)

    net(idx, attn=attn)
    # layer 0, head 0: all attention on the previous token
    assert got["p"][0, 0].diagonal(-1).min() > 0.99


def test_shipped_baby_reaches_its_accuracy(baby):
    net, tok = baby
    idx, tgt, dist = baby_tasks.task_batch(tok, 16, 512, random.Random("test-0"))
    logits = tasks.evaluate(net, idx, "full", 1, 4, 32, online=False)
    pred = logits.argmax(-1)
    m, far = tgt >= 0, dist >= 124
    assert (pred[m] == tgt[m]).float().mean() >= 0.95
    assert (pred[m & far] == tgt[m & far]).float().mean() >= 0.95


def test_eviction_separates_policies(baby):
    net, tok = baby
    idx, tgt, dist = baby_tasks.task_batch(tok, 16, 512, random.Random("test-0"))
    policies = ["oracle", "streaming"]
    rows = tasks.quality_runs(net, idx, tgt, dist, policies, [0.125], 4, 32)[0]
    full, oracle, streaming = (r["far_accuracy"] for r in rows)
    assert oracle >= 0.9 * full
    assert streaming <= oracle - 0.2
    assert rows[2]["kl"] > rows[1]["kl"] > 0


def test_quality_runs_equal_their_definitions(baby):
    """tasks.quality_runs (bench.py quality's and train.py's rows) against _ref_quality: two budgets
    (far is set by the larger), a static policy and the oracle under the max target."""
    net, tok = baby
    cue = baby_tasks.TASKS["cue"]
    seqs = baby_tasks.task_batch(tok, 2, 512, random.Random("q"), **cue)
    policies, budgets = ["streaming", "oracle"], [0.25, 0.125]
    rows, share, n = tasks.quality_runs(net, *seqs, policies, budgets, 4, 32, target="max")
    named = [("streaming", "streaming", "max"), ("oracle", "oracle", "max")]
    ref = _ref_quality(net, seqs, named, [0.25, 0.125])
    tgt, dist = seqs[1:]
    assert n == (tgt >= 0).sum()
    assert share == (dist[tgt >= 0] >= 128 - 4).float().mean().item()
    for r in rows:
        target = "-" if r["policy"] == "full" else "max"
        want = ref[r["policy"], target, r["budget"]]
        got = (r["accuracy"], r["far_accuracy"], r["relative"], r["kl"])
        assert all(abs(x - y) <= 5.1e-5 for x, y in zip(got, want)), (got, want)


def test_recall_score_counts_by_hand():
    """baby_tasks.recall_score on a hand-made prompt and sample (README, Quickstart): a bound key the
    sample writes counts once, right when the next word is the key's current value; the sample's own
    `key value` rebinds; unbound keys, keys in the prompt and the last word do not count."""
    # binds name: true, time: null
    prompt = "name true the time null of name true".split()
    sample = "name true the time good time good size new name true data".split()
    # name true: hit; time good: miss (rebinds time); time good: hit; size: unbound;
    # name true: hit; data: unbound and last
    assert baby_tasks.recall_score(prompt + sample, len(prompt)) == (3, 4)
    # a prompt ending on a key: its value is the sample's first word, not counted
    ends_on_key = "time null time".split() + ["true"]
    assert baby_tasks.recall_score(ends_on_key, 3) == (0, 0)
    # a distractor `key value no` neither binds nor counts: size stays unbound, name stays true
    start = "name true the".split()
    words = start + "size real no name good no name true size new".split()
    assert baby_tasks.recall_score(words, 3) == (1, 1)


def test_p_cue_range_is_drawn_per_sequence(baby, monkeypatch):
    """train.py --task cue's batch (README, The baby): each sequence's distractor rate drawn uniformly from
    [--p_cue_min, --p_cue_max] (default 0.05, 0.35) by the step's own stream, just before the sequence: equal to
    baby_tasks.task replayed by hand, and the distractor share of the would-be fillers spans the range; min = max = 0.17
    draws nothing: the task's own batch."""
    import train

    tok = baby[1]
    monkeypatch.setattr(train, "task", "cue")
    monkeypatch.setattr(train, "batch_size", 48)
    assert (train.p_cue_min, train.p_cue_max) == (0.05, 0.35)
    idx = train.batch(tok, None, 3)
    ids, bos = baby_tasks.task_ids(tok)
    rng, shares = random.Random("scorer-train-0-3"), []
    for b in range(48):
        rate = rng.uniform(0.05, 0.35)
        words = baby_tasks.task(rng, 512, keys=8, p_cue=rate)[0]
        assert idx[b].tolist() == [bos] + [ids[w] for w in words[1:]]
        marks = words.count(baby_tasks.MARK)
        fillers = sum(w in baby_tasks.FILLERS for w in words)
        shares.append(marks / (marks + fillers))
    assert min(shares) < 0.1 and max(shares) > 0.28
    # one rate (min = max): the task's stream as before the range
    monkeypatch.setattr(train, "p_cue_min", 0.17)
    monkeypatch.setattr(train, "p_cue_max", 0.17)
    stream = random.Random("scorer-train-0-3")
    cue = baby_tasks.TASKS["cue"]
    fixed = baby_tasks.task_batch(tok, 48, 512, stream, keys=8, **cue)[0]
    assert torch.equal(train.batch(tok, None, 3), fixed)


def test_quality_runs_take_full_from_the_reference_model(baby):
    """tasks.quality_runs with ref (a fine-tuned net's dense start): the full row and every KL come from ref's
    dense pass (README, Results: KL(full || policy)), the policy row from net under streaming, here by its mask
    (the sinks and the last S - sinks tokens) and an fp64 softmax."""
    net, tok = baby
    ref = copy.deepcopy(net)
    # a dense start that differs from the net evaluated
    with torch.no_grad():
        for p in ref.parameters():
            gen = torch.Generator().manual_seed(7 + p.numel())
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    seqs = baby_tasks.task_batch(tok, 2, 256, random.Random("quality-ref"))
    idx, tgt, dist = seqs
    rows = tasks.quality_runs(net, *seqs, ["streaming"], [0.25], 4, 32, ref=ref)[0]
    T, S, m = 256, 64, tgt >= 0
    d, t = torch.arange(T)[:, None], torch.arange(T)[None, :]
    stream = (t <= d) & ((t < 4) | (t > d - (S - 4)))
    with torch.no_grad():
        full = ref(idx).double().log_softmax(-1)
        own = net(idx).double().log_softmax(-1)
    mask = lambda i, k, v: stream.expand(2, k.shape[1], T, T)
    lp = _ref_pass(net, idx, mask)[0].double().log_softmax(-1)
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
        expected = want[r["policy"]]
        assert all(abs(x - y) <= 5.1e-5 for x, y in zip(got, expected)), (r, expected)
    # the test tells ref's dense pass from net's
    assert abs(kl(full, lp) - kl(own, lp)) > 1e-3, (kl(full, lp), kl(own, lp))


def test_recall_score_equals_its_definition_on_random_words():
    """baby_tasks.recall_score against _ref_recall on 400 random word sequences over a few keys, values, fillers and
    `no`: bindings only by `key value` (a value, not any word), distractors skipped, counting from start."""
    words = baby_tasks.KEYS[:3] + baby_tasks.VALUES[:3]
    words += baby_tasks.FILLERS[:2] + [baby_tasks.MARK]
    unbinding = lambda a, b: a in baby_tasks.KEYS and b not in baby_tasks.VALUES
    rng, rebound = random.Random(11), 0
    for _ in range(400):
        seq = [rng.choice(words) for _ in range(rng.randint(2, 30))]
        start = rng.randint(0, len(seq))
        got = baby_tasks.recall_score(seq, start)
        assert got == _ref_recall(seq, start), (seq, start)
        # a bound key followed by a word that is no value: a binding the definition does not make
        rebound += any(unbinding(a, b) for a, b in zip(seq, seq[1:]))
    assert rebound > 100
