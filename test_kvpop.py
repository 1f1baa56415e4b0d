"""KVpop tests: the method's definitions in kvpop.py against references written here from the README's Method:
the budget and the state's charge, the eviction rule, the static and dynamic policies, the targets, each scorer
kind's equations (recurrence, chunked and decoding forms), the boundary labels and the boundary loss. The rest of the
suite is in tests/."""

import copy
import itertools
import math
import random

import pytest
import torch

from tools import timing
import kernels
import kvpop
import qwen3
import tasks
import fast
from cache import KVCache

from tests.common import (
    _held, _k_one_thread, _k_simulate, _ref_attention, _ref_boundary_loss, _scorers, _simulate_boundary, small_model,
)


# ---------------------------------------------------------------------------------------------------------
# the budget (README, Method: budget): a scorer's state is charged to the pool, entries + state within the bytes


def test_state_charge_comes_off_the_pool(small_model):
    s = _scorers(small_model.config, 16)[0]  # d_mem 8, head_dim 32: 73 fp32 numbers, 292 bytes
    # an entry is a key and a value of 32: 256 bytes in fp32 -> 2 entries; 128 in bf16 -> 3
    assert s.charge(torch.float32) == math.ceil((8 * 9 + 1) * 4 / (2 * 32 * 4)) == 2
    assert s.charge(torch.bfloat16) == math.ceil((8 * 9 + 1) * 4 / (2 * 32 * 2)) == 3
    kinds = _scorers(small_model.config, 16)  # kvpop, kvpop-mlp, kvpop-window, kvpop-shifted
    assert [t.charge(torch.bfloat16) for t in kinds] == [3, 0, 0, 3]  # the memory's, or none
    assert kvpop.budget_size(50, 200, 4, 16, s.charge(torch.float32)) == (50, 28)
    # the state's fp32 numbers held, (d_m + 1) d_m + 1 a layer and KV head, by its definition and its fast form
    heads = small_model.config.num_hidden_layers * small_model.config.num_key_value_heads
    for scorer in (s, fast.speed_up(copy.deepcopy(s))):
        cache = KVCache(small_model, 1, 48, scorer, 4, 16)
        kv = 2 * cache.k.numel() * cache.k.element_size()
        assert cache.nbytes() - kv == 4 * heads * (8 * 9 + 1)


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
    s = fast.speed_up(kvpop.SCORERS["kvpop"](c, window=16, d_mem=128).eval())  # its decoding form
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
# the eviction rule, step by step (kvpop.evict, run_rule)


@pytest.mark.parametrize("sinks,window,pool", [(3, 5, 7), (0, 1, 4), (2, 12, 1)])
def test_plain_rule_is_the_step_by_step_pool(sinks, window, pool):
    """kvpop.run_rule (evict, step by step) holds at step p what _k_simulate's pool gives: u <= p
    with u < sinks or p < e[u] (ties in priority included)."""
    pri = torch.randint(0, 9, (1, 1, 60), generator=torch.Generator().manual_seed(4)).float()
    e = _k_simulate(pri, sinks, window, pool)[0, 0].tolist()
    held = kvpop.run_rule(pri[0, 0].tolist(), kvpop.Budget(sinks, window, pool))
    for p, got in enumerate(held):
        assert got == [u for u in range(p + 1) if u < sinks or p < e[u]], p


# ---------------------------------------------------------------------------------------------------------
# policies against references written here from the method's definitions alone: nothing below calls
# cache.resolve, KVCache internals or kernels.eviction_times to build an expectation, so a policy that kept the
# wrong tokens (a flipped sign, a wrong tie rule or hash) fails here even where both sides agree


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
            kvpop.oracle_policy(small_model, idx, window, "mean") if policy == "oracle" else policy,
            sinks,
            window,
        )
        for t, (held, logits) in enumerate(want):
            got = small_model(idx[:, t : t + 1], cache=cache)[:, -1]
            assert torch.equal((cache.pos[..., None] == torch.arange(T)).any(-2), held), f"held sets differ at step {t}"
            assert (got - logits).abs().max().item() <= 1e-4, t
        on = tasks.evaluate(small_model, idx, policy, size, sinks, window, online=True, target="mean")[:, -1]
    assert (on - want[-1][1]).abs().max().item() <= 1e-4
    # eviction happened: every head dropped T - size tokens
    assert held.sum(-1).eq(size).all() and size < T


# ---------------------------------------------------------------------------------------------------------
# the targets (README, Method: future attention), and a[t], the attention a token received in its window


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
    plain = kernels.plain_window_received(q, k, window)  # --plain's form
    assert plain.shape == (2, 2, 37) and (plain.double() - _ref_window_received(q, k, window)).abs().max() <= 1e-6
    if window == 1:  # a query's window is itself alone
        assert torch.equal(got, torch.ones_like(got))


def test_dense_pass_under_plain_is_kvpops(monkeypatch):
    """kernels.PLAIN (train.py --plain): fast.dense_targets runs kvpop.dense_targets, the definition, never
    fast.dense_layer; without it, dense_layer."""
    c = qwen3.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )
    torch.manual_seed(0)
    net = qwen3.Qwen3(c).eval()
    idx = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    layers = []
    real = fast.dense_layer
    monkeypatch.setattr(fast, "dense_layer", lambda *a: layers.append(1) or real(*a))
    for plain in (True, False):
        monkeypatch.setattr(kernels, "PLAIN", plain)
        fast.dense_targets(net, idx, 4, "max")
        assert (len(layers) == 0) is plain, plain


@pytest.mark.parametrize("target", kvpop.TARGETS)
def test_dense_pass_is_its_definition(target, monkeypatch):
    """fast.dense_targets (training's one dense pass a layer) against the definitions written from the README in
    fp64: each layer's k, v (the causal pass through p = softmax), r* (Method: future attention) and a[t]
    (Method: scorers), on a model of 3 layers (its last ends the pass early) and a group of 2 query heads, in blocks
    of 16 queries (the last partial)."""
    monkeypatch.setattr(fast, "ROWS", 16)
    torch.manual_seed(0)
    c = qwen3.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )
    net = qwen3.Qwen3(c).double().eval()
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    window, T, G = 6, 40, 2
    seen = []

    def attn(i, q, k, v, pos):  # the dense causal softmax, p[d, t]
        s = q @ k.repeat_interleave(G, 1).mT / math.sqrt(8)
        p = s.masked_fill(torch.ones(T, T).triu(1).bool(), -math.inf).softmax(-1)
        seen.append((q, k, v, p))
        return p @ v.repeat_interleave(G, 1)

    with torch.no_grad():
        logits = net(idx, attn=attn)
    logp = logits.log_softmax(-1)[:, :-1].gather(-1, idx[:, 1:, None])[..., 0]  # log P[d], d < T - 1
    P = torch.cat([logp.exp(), torch.zeros(2, 1, dtype=torch.float64)], 1)[:, None, :, None]  # P[T - 1] = 0
    kv, rs = fast.dense_targets(net, idx, window, target, received=True)
    assert len(kv) == len(rs) == 3
    d, t = torch.arange(T)[:, None], torch.arange(T)
    n = T - t - window  # N_t
    for (q, k, v, p), (k2, v2, a), r in zip(seen, kv, rs):
        assert (k - k2).abs().max() <= 1e-12 and (v - v2).abs().max() <= 1e-12
        reads = (p * P if target == "helpful" else p) * (d >= t + window)  # (B, Hq, queries, keys)
        A = reads.sum(2) / n.clamp(min=1) if target == "mean" else reads.amax(2)
        ref = torch.log(1e-6 + A).view(2, 2, G, T).amax(2).masked_fill(n <= 0, -math.inf)
        assert torch.equal(r.isinf(), ref.isinf())
        # the helpful target's future attention runs in fp32 (kernels.future_attention), the rest in fp64
        tol = 1e-5 if target == "helpful" else 1e-12
        assert (r - ref)[ref.isfinite()].abs().max() <= tol
        if target == "max":  # a[t] is read the same under every target
            assert (a - _ref_window_received(q, k, window)).abs().max() <= 1e-12


# ---------------------------------------------------------------------------------------------------------
# the learned scorers: each kind's equations, its decoding forms, the chunked form against the recurrence


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
    """Each kind's two decoding forms: fast.py's (every layer at once; kvpop's RMS folded into the update, its
    reads prepared in blocks; kvpop-window's ring) and its definition's (the kind's own `decoding`: kvpop.Decoder,
    the definition on the tokens the cache holds; kvpop.MemoryDecoder, the recurrence a step), against the
    definition in fp64 to 1e-10: the score each token gets as it leaves the window, after a prompt given whole
    (prefill) or from the first token. The definition: the parallel form (kvpop-mlp, kvpop-window) or the plain
    recurrence (kvpop, kvpop-shifted, which reads under the key of the token before)."""
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
    plain = lambda i: s.recurrent(i, s.features(k[i], v[i]))[0] + s.recency(i, pos.double())
    # the attention each token received (any positive numbers: the forms only carry it to the read-out)
    a = torch.rand(2, 2, 3, T, dtype=torch.float64) + 0.01 if received else None
    a_of = lambda i, n=T: a[i][..., :n] if received else None
    want = torch.stack([plain(i) if memory else s(i, k[i], v[i], pos, a_of(i)) for i in range(2)])[..., : T - w]
    if received:  # it reads a: another a, other scores
        other = torch.stack([s(i, k[i], v[i], pos, a_of(i) * 2) for i in range(2)])[..., : T - w]
        assert (other - want).abs().max().item() > 1e-3
    for scorer in [fast.speed_up(copy.deepcopy(s)), s]:  # the fast forms, then the definitions
        decoder = scorer.decoding(_Held(k, v, w, a))
        got = [torch.stack([decoder.prefill(i, k[i, ..., :prompt, :], v[i, ..., :prompt, :], pos[:prompt], a_of(i, prompt)) for i in range(2)])] if prompt else []
        got = [got[0][..., : max(prompt - w, 0)]] if prompt else []
        # every step from the prompt on, as the cache asks; t = p - w < 0 is no token
        got += [decoder.leaving(torch.tensor(p)) for p in range(prompt, T)][max(w - prompt, 0) :]
        got = torch.cat(got, -1)  # (L, B, H, T - w)
        assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-10, type(decoder)


# one chunk; several; chunks shorter than the window; read on arrival
@pytest.mark.parametrize("chunk, arrival", [(128, False), (16, False), (5, False), (16, True)])
@pytest.mark.parametrize("kind", ["kvpop", "kvpop-shifted"])
def test_mlstm_chunked_form_is_its_plain_recurrence(chunk, arrival, kind):
    """kvpop's plain recurrence (MemoryScorer.recurrent) against the README's equations (the unstabilised reference
    below), and its chunked form (fast.chunked: training, prefill) against the plain one, in fp64 to rounding."""
    c = qwen3.Qwen3Config(num_hidden_layers=2, num_key_value_heads=3, head_dim=16)
    torch.manual_seed(1)
    s = kvpop.SCORERS[kind](c, window=7, d_mem=12, arrival=arrival).double()
    s.chunk = chunk
    with torch.no_grad():  # gates that matter: input gates over e^-6..e^6, forget gates far from 1
        s.wi.mul_(2), s.bf.fill_(1.0)
    k, v = torch.randn(2, 3, 30, 16, dtype=torch.float64) * 3, torch.randn(2, 3, 30, 16, dtype=torch.float64)
    x, pos = s.features(k, v), torch.arange(30)
    for i in range(2):
        plain = s.recurrent(i, x)[0]
        assert (plain + s.recency(i, pos.double()) - _ref_mlstm_scores(s, i, k, v)).abs().max().item() <= 1e-10
        assert (fast.chunked(s, i, x)[0] - plain).abs().max().item() <= 1e-10


def _ref_head(P, h, x, z, t):
    """The read-out every scorer kind shares (README, Method: scorers), one token: r = w_2 . silu(W_1 [x; z] + b_1) +
    b_2, plus the recency term softplus(theta) t."""
    hid = torch.nn.functional.silu(torch.cat([x, z]) @ P["w1"][h] + P["b1"][h])
    return hid @ P["w2"][h] + P["b2"][h] + torch.nn.functional.softplus(P["theta"][h]) * t


def _ref_mlp_scores(s, i, k, v, a=None):
    """kvpop-mlp from its definition, token by token in fp64: r = head(x_t, nothing) + softplus(theta) t."""
    P = {name: p[i].double() for name, p in s.named_parameters()}
    x = torch.cat([k, v], -1).double()
    x = x / (x.pow(2).mean(-1, keepdim=True) + kvpop.EPS).sqrt()
    (B, H, T, X) = x.shape
    r = torch.zeros(B, H, T, dtype=torch.float64)
    for b, h, t in itertools.product(range(B), range(H), range(T)):
        r[b, h, t] = _ref_head(P, h, x[b, h, t], torch.zeros(0, dtype=torch.float64), t)
    return r


def _ref_mlstm_scores(s, i, k, v, a=None):
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
    """A scorer's parallel form (one chunk, several, chunks shorter than the window) and the scores
    the evicting cache gives each token as it leaves the window, against ref(s, i, k, v, a) ->
    (B, H, T), a (B, H, T) the attention each token received (None unless the scorer reads it);
    every parameter moved from its start (biases start at 0) by 0.1 randn first."""
    w = s.window
    with torch.no_grad():
        for p in s.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())))
    idx = torch.randint(0, 384, (2, T), generator=torch.Generator().manual_seed(seed))
    qkv = []

    def attn(i, q, k, v, pos):
        qkv.append((q, k, v))
        return qwen3.causal(i, q, k, v, pos)

    with torch.no_grad():
        small_model(idx, attn=attn)
    # each layer's (k, v); for a scorer that reads it, a[t] by its definition (_ref_window_received)
    a = [_ref_window_received(q, k, w) if s.received else None for q, k, _ in qkv]
    kv = [(k, v) for _, k, v in qkv]
    for i, (k, v) in enumerate(kv):
        want = ref(s, i, k, v, a[i])
        for chunk in (128, 16, 5):
            s.chunk = chunk
            got = s(i, k, v, torch.arange(T), a[i])
            assert (got.double() - want).abs().max().item() <= tol, chunk
    if not cache:
        return
    # room for all: every token stays in its slot t; the cache measures a[t] itself
    cache = KVCache(small_model, 2, T, s, 4, w)
    for t in range(T):
        small_model(idx[:, t : t + 1], cache=cache)
    for i, (k, v) in enumerate(kv):  # the cache scores t = p - w at step p: tokens up to T - 1 - w
        got = cache.pi[i][..., : T - w].double()
        assert (got - ref(s, i, k, v, a[i])[..., : T - w]).abs().max().item() <= tol


def _ref_window_scores(s, i, k, v, received=None):
    """kvpop-window from its definition (README, Method: scorers), token by token in fp64: x =
    rms([k; v]); read a of token t attends over o = 1..min(n, T - 1 - t), n = min(w - 1, ahead), with
    logits (W_q x_t)_a . (W_k x_{t+o})_a / sqrt(d) + b_a[o] and pools z_a = sum_o softmax * (W_v
    x_{t+o})_a (zeros with nothing after t); r = w_2 . silu(W_1 [x_t; z] + b_1) + b_2 +
    softplus(theta) t. With --received the read-out also takes log a[t] (received (B, H, T), the
    attention t received in its window), after x_t in W_1's rows: W_1 [x_t; log a[t]; z]; the reads
    see x alone. k, v (B, H, T, D) -> (B, H, T)."""
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
                token = x[b, h, t]
                if s.received:  # log a[t] joins the token's features in the read-out
                    token = torch.cat([token, received[b, h, t, None].double().log()])
                r[b, h, t] = _ref_head(P, h, token, torch.cat(z), t)
    return r


# reads over the whole window; over its first 4 tokens; the read-out reading log a[t] too
@pytest.mark.parametrize("w, ahead, received", [(6, 32, False), (9, 4, False), (6, 32, True)])
def test_window_scorer_equals_its_definition(small_model, w, ahead, received, monkeypatch):
    """kvpop-window's parallel form (one chunk, several, chunks shorter than the window) and the
    scores the evicting cache gives each token as it leaves the window (its folded form), against
    the definition token by token; with --received, a[t] from its definition too."""
    monkeypatch.setattr(kvpop.WindowScorer, "ahead", ahead)
    torch.manual_seed(2)
    kind = kvpop.SCORERS["kvpop-window"]
    s, T = kind(small_model.config, w, d_hidden=8, received=received), 40
    with torch.no_grad():  # reads that matter: content and offset both move the softmax
        s.bo.normal_(0, 2), s.wq.mul_(2)
    _check_scorer_against(small_model, s, _ref_window_scores, T, seed=4, tol=1e-5)


def test_scorer_parallel_memory_is_linear():
    """A long prefill runs the memory's chunked form (fast.py) over the whole prompt: beyond the
    features x (T, 2D) and one RMS temporary while making them, it may hold only one chunk's working
    set, never a (T, M) projection or read-out."""
    c = qwen3.Qwen3Config(num_hidden_layers=1, num_key_value_heads=2, head_dim=64)
    # M = 2D: each full-length projection is one x more
    s, T = fast.speed_up(kvpop.SCORERS["kvpop"](c, window=256, d_mem=128)), 4096
    k, v = torch.randn(1, 2, T, 64), torch.randn(1, 2, T, 64)
    with torch.no_grad(), timing.Meter() as meter:
        s(0, k, v, torch.arange(T))
    # 2 x the features (4 MiB each) + 1 MiB, whatever T is
    assert meter.peak <= 2 * (2 * k.numel() * 4) + 2**20


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


def test_a_kind_that_reads_past_its_span_is_refused():
    """README, Add a scorer: a kind decoding by kvpop.Decoder reads only t .. t + span - 1. The README's kvpop-next
    (reads t + 1) with span = 1 would decode differently from its masked pass (silently, before); check refuses it
    in one line naming span, and every registered kind passes. A span past the window is refused too."""
    import re

    text = open("README.md", encoding="utf-8").read()
    code = re.search(r"### Add a scorer.*?```python\n(.*?)```", text, re.S).group(1)
    c = qwen3.Qwen3Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=8)
    try:
        for span, error in (("1", "reads past t \\+ span - 1 \\(span 1\\)"), ("9", "span 9 > window 8"), ("2", None)):
            exec(code.replace("span = 2", f"span = {span}"), {})
            s = kvpop.SCORERS["kvpop-next"](c, 8, d_hidden=4)
            if error:
                with pytest.raises(ValueError, match=error):
                    s.check(c, 8)
            else:
                s.check(c, 8)
    finally:
        kvpop.SCORERS.pop("kvpop-next", None)
    for kind, cls in kvpop.SCORERS.items():
        cls(c, 8, d_mem=4, d_hidden=4).check(c, 8)


def test_folded_memory_refuses_a_kind_it_cannot_serve(small_model):
    """fast.FoldedMemory writes each token under its own key: a MemoryScorer kind with its own written_under put on
    it (without the write that reads it) is refused in one line; kvpop-shifted's own form (experiments/shifted.py)
    serves it."""
    from experiments import shifted

    s = shifted.ShiftedMemoryScorer(small_model.config, 8, d_mem=4, d_hidden=4)
    cache = KVCache(small_model, 1, 20, kvpop.SCORERS["kvpop"](small_model.config, 8, d_mem=4), 4, 8)
    with pytest.raises(ValueError, match="not its written_under.*experiments/shifted.py"):
        fast.FoldedMemory(s, cache)
    shifted.ShiftedFoldedMemory(s, cache)


# ---------------------------------------------------------------------------------------------------------
# the boundary (kernels.plain_boundary): the teacher's decisions against a step-by-step simulation


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
        y, bnd = kernels.plain_boundary(pi, e, q, kvpop.Budget(sinks, window, k))
        # the sweep training runs (kernels.boundary) gives the definition's labels and cutoffs
        fast_y, fast_bnd = kernels.boundary(pi, e, q, kvpop.Budget(sinks, window, k))
        assert torch.equal(fast_y, y) and torch.equal(fast_bnd, bnd), trial
        for b in range(2):
            for h in range(3):
                want = _simulate_boundary(pi[b, h].tolist(), sinks, window, k, T)
                assert sorted(want) == q.tolist()
                for j, qq in enumerate(q.tolist()):
                    assert (bool(y[b, h, j]), int(bnd[b, h, j])) == want[qq], (trial, b, h, qq)


# ---------------------------------------------------------------------------------------------------------
# the training objective against its definition (README, Method: boundary loss, fine-tune):
# the references call none of train.py's functions, so a flipped sign, a missing recency term or unbalanced
# weights fail here


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
        loss, acc = train.scorer_loss(s, kv, list(r), [q], [kvpop.Budget(sinks, window, k)])
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
        train.scorer_loss(s, kv, list(r), [q1], [kvpop.Budget(sinks, window, k)])
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
            _FixedScorer(pi, theta), [(None, None)] * 2, list(r), [torch.arange(14, 60)], [kvpop.Budget(2, 8, 4)]
        )
    _, ref, _ = _ref_boundary_loss(pi, r, torch.nn.functional.softplus(theta), 2, 8, 4)
    assert abs(acc - ref) <= 1e-6, (acc, ref)
