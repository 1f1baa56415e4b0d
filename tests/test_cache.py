"""The evicting cache (cache.py, fast.py): the online cache against the masked forward for every policy and
scorer on many shapes, the rule per layer, prefill against token-by-token decoding, the budget held, no copies in a
decoding step, one graph under torch.compile."""

import copy
import itertools
import os
import random

import pytest
import torch

from tools import speed, timing
import kernels
import kvpop
import qwen3
import tasks
from support import baby_tasks
from cache import KVCache, resolve
import fast

from tests.common import MODEL_DIR, SHIPPED, baby, _held, _scorers, small_model


# ---------------------------------------------------------------------------------------------------------
# the evicting cache: exactness of the online cache vs the masked forward (README, Method: eviction
# times)


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
        cache.pi.copy_(torch.randint(0, 4, (L, B, H, S), generator=g).float())
        # the lowest priorities on a sink and on token p - w + 1: the rule must pass over them
        cache.pi[..., 0], cache.pi[..., -1], cache.pos[..., -1] = -2.0, -1.0, p - 7
        cache.pi[..., -2], cache.pos[..., -2] = -0.5, p - 8  # token p - w: eligible
        slots = cache.lowest(p)
        for i in range(L):
            for b in range(B):
                for h in range(H):
                    pos, score = cache.pos[i, b, h].tolist(), cache.pi[i, b, h].tolist()
                    pool = [j for j in range(3, S) if pos[j] <= p - 8]
                    want = min(pool, key=lambda j: (score[j], pos[j]))
                    assert slots[i, b, h, 0].item() == want


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
        return kvpop.masked_attention(q, k, v, pis[-1], kvpop.Budget(sinks, w, size - sinks - w))[0]

    net(idx, attn=attn)
    cache = KVCache(net, 2, size, sc, sinks, w)
    want = [[[kvpop.run_rule(pi[b, h].tolist(), kvpop.Budget(sinks, w, size - sinks - w)) for h in range(pi.shape[1])]
             for b in range(2)] for pi in pis]
    for t in range(idx.shape[1]):
        net(idx[:, t : t + 1], cache=cache)
        for i, b, h in itertools.product(range(len(pis)), range(2), range(pis[0].shape[1])):
            got = sorted(u for u in cache.pos[i, b, h].tolist() if u >= 0)
            assert got == want[i][b][h][t], (i, b, h, t)


@pytest.mark.parametrize("policy", [*kvpop.STATIC, "oracle"])  # every static policy a fork adds too
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


def test_plain_runs_the_definitions(small_model, monkeypatch):
    """kernels.PLAIN (--plain): the cache takes every token a step and chooses by kvpop.evict itself, the masked
    pass and the targets run kernels.py's plain forms, never the tiled ones; the logits are the fast path's (a
    static, a learned that reads a[t], a dynamic policy), the boundary loss too."""
    import cache
    import train

    idx = torch.randint(0, 384, (1, 72), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    s = kvpop.SCORERS["kvpop-window"](small_model.config, 8, d_hidden=16, received=True)
    runs = [("knorm", True), ("knorm", False), (s, True), (s, False), ("h2o", True)]
    budgets = [kvpop.Budget(4, 8, 12)]
    qs = train.query_positions(72, 0, budgets)
    loss = lambda: train.scorer_loss(s, *kvpop.dense_targets(small_model, idx, 8, "helpful", True), qs, budgets)
    with torch.no_grad():
        want = [tasks.evaluate(small_model, idx, p, 24, 4, 8, online=o) for p, o in runs] + [loss()]

    def refused(*args):
        raise AssertionError("a fast form ran under kernels.PLAIN")

    called = []
    counted = lambda f: lambda *args: called.append(f.__name__) or f(*args)
    monkeypatch.setattr(kernels, "PLAIN", True)
    monkeypatch.setattr(cache, "evict", counted(kvpop.evict))
    for name in ("_attention_torch", "_future_torch", "_evict_torch"):
        monkeypatch.setattr(kernels, name, refused)
    for name in ("plain_attention", "plain_future_attention", "plain_eviction_times", "plain_boundary"):
        monkeypatch.setattr(kernels, name, counted(getattr(kernels, name)))
    monkeypatch.setattr(kernels, "plain_window_received", counted(kernels.plain_window_received))
    monkeypatch.setattr(KVCache, "lowest", refused)
    monkeypatch.setattr(KVCache, "prefill", refused)
    with torch.no_grad():
        got = [tasks.evaluate(small_model, idx, p, 24, 4, 8, online=o) for p, o in runs] + [loss()]
    for a, b in zip(want[:-1], got[:-1]):
        assert (a - b).abs().max().item() <= 1e-4
    assert abs(want[-1][0] - got[-1][0]) <= 1e-5 and want[-1][1] == got[-1][1]
    names = {"evict", "plain_attention", "plain_future_attention", "plain_eviction_times", "plain_boundary"}
    assert set(called) == names | {"plain_window_received"}, set(called)


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
    # a learned kind on its fast forms (fast.py), the forms decoding runs
    pol = fast.speed_up(kvpop.SCORERS[policy](net.config, window=8)) if policy in kvpop.SCORERS else policy
    peaks, D, H = [], net.config.head_dim, net.config.num_key_value_heads
    for n in (1024, 4096):
        cache = KVCache(net, 1, n, pol, 4, 8)
        speed.fill(cache, n - 1 if policy == "full" else 4 * n)
        bufs = [x.data_ptr() for x in (cache.k, cache.v, cache.pos, cache.pi)]
        with torch.no_grad(), timing.Meter() as meter:
            for _ in range(2):
                net(torch.tensor([[5]]), cache=cache)
        assert bufs == [x.data_ptr() for x in (cache.k, cache.v, cache.pos, cache.pi)]
        peaks.append(meter.peak)
    assert 0 < peaks[1] - peaks[0] < (4096 - 1024) * H * D * dtype.itemsize, peaks


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


# every policy crosses the fill -> evict boundary while decoding; kvpop's 600 steps cross its prepared blocks many times
@pytest.mark.parametrize("policy, steps", [(p, 48) for p in ("full", "streaming", "knorm", "random", "h2o", "tova", "kvpop-window", "kvpop-mlp", "kvpop-shifted")] + [("kvpop", 600)])
def test_decoding_step_is_one_graph(baby, policy, steps):
    """A decoding step traced whole by torch.compile (fullgraph: a graph break raises; a recompilation
    raises too) from the first step to the last, and the compiled run the eager one: the same logits at every
    step (bit for bit), the same positions held after it. The prompt goes eagerly (generate's `step`)."""
    import torch._dynamo

    net, tok = baby
    idx = baby_tasks.task_batch(tok, 1, 40, random.Random("one-graph"))[0]
    # a shipped scorer on its fast forms (fast.py): --plain's definitions are not one graph
    folder = os.path.join(MODEL_DIR, "scorers", "recall-helpful", policy)
    pol = fast.speed_up(kvpop.load_scorer(folder)) if policy in kvpop.SCORERS else policy
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
    sinks 0-4, budgets as fractions and integers, T no multiple of the chunks (128; the first two
    past one chunk, the rest 60-140, for time on a new machine), gamma up to 0.5 (near-ties between
    old and new tokens), model_fp64's case first."""
    rng, out = random.Random(12), [(24, 4, 0.5, 197, 0.002), (24, 0, 0.5, 150, 0.002)]
    while len(out) < n:
        w, sinks, T = rng.choice([1, 2, 5, 8, 16, 24, 31, 32, 33, 40, 48]), rng.randint(0, 4), rng.randint(60, 140)
        b = rng.choice([0.3, 0.5, 0.75, w + sinks + 8 + rng.randint(0, 40)])
        if T % 128 and sinks + w + 8 < kvpop.budget_size(b, T, 0, 0)[0] < T:
            out.append((w, sinks, b, T, rng.choice([0.002, 0.05, 0.5])))
    return out


@pytest.mark.parametrize("kind", kvpop.SCORERS)
def test_every_scorer_online_equals_masked_on_every_shape(model_fp64, kind):
    """README, Method: eviction times. The online cache and the masked pass apply one rule to the
    same priorities; in fp64 (the model, its attention and the scorer alike) the two paths' rounding
    (~1e-15) is far below any gap between priorities, so they evict the same tokens on every shape:
    36 shapes (every other one on fast.py's forms, the rest on kvpop.py's definitions), scorers
    with every parameter moved by 0.3 randn. (In fp32 two priorities closer than
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
        if n % 2:  # every other shape on fast.py's forms, the rest on the definitions
            s = fast.speed_up(s)
        x = idx[:, :T]
        on = tasks.evaluate(model_fp64, x, s, b, sinks, w, online=True)
        off = tasks.evaluate(model_fp64, x, s, b, sinks, w, online=False)
        assert (on - off).abs().max().item() <= 1e-4, (w, sinks, b, T, gamma)
        evicted += (on - model_fp64(x)).abs().max().item() > 1e-3
    assert evicted >= 30  # the shapes evict (a budget that keeps everything proves nothing)


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


@pytest.mark.parametrize("kind", kvpop.SCORERS)
def test_trained_scorer_online_equals_masked(baby, kind):
    s = kvpop.load_scorer(os.path.join(SHIPPED, kind))
    net, tok = baby
    idx = baby_tasks.task_batch(tok, 2, 256, random.Random("t"))[0]
    for budget in (0.25, 48):
        on = tasks.evaluate(net, idx, s, budget, 4, 32, online=True)
        off = tasks.evaluate(net, idx, s, budget, 4, 32, online=False)
        assert (on - off).abs().max().item() <= 1e-4


def test_plain_cache_takes_a_prompt_a_token_a_step(small_model, monkeypatch):
    """Under kernels.PLAIN (--plain) a prompt written through the cache (sample.py, bench.py generate) comes in a token
    a step, never by prefill; otherwise it is prefilled in one pass."""
    idx = torch.randint(0, 384, (1, 30), generator=torch.Generator().manual_seed(2))
    for plain in (True, False):
        monkeypatch.setattr(kernels, "PLAIN", plain)
        cache = KVCache(small_model, 1, 20, "knorm", 4, 8)
        assert cache.whole(30) is not plain
        passes, real = [], KVCache.prefill
        monkeypatch.setattr(KVCache, "prefill", lambda self, *a: passes.append(1) or real(self, *a))
        with torch.no_grad():
            small_model(idx, cache=cache)
        monkeypatch.undo()
        assert (len(passes) == 0) is plain, plain  # else one prefill a layer
