"""KVpop (arXiv 2607.05061), the method in one file, as the README's Method: the budget -> the
eviction rule, plainly -> policies -> targets -> learned scorers, one class a kind holding its
definition -> the boundary loss. cache.py is the evicting cache, kernels.py the masked attention,
the target and eviction times; fast.py the forms that exist only for speed."""

import math
from typing import NamedTuple

import torch
from torch.nn import Module, Parameter
from torch.nn.functional import logsigmoid, pad, silu, softplus

import kernels
from support.checkpoint import read_scorer


# -------------------------------------------------------------- the budget (README, Method: budget)
class Budget(NamedTuple):
    """A KV head's cache: the first `sinks` tokens, the last `window` and a `pool` of older ones."""

    sinks: int
    window: int
    pool: int

    @property
    def slots(self):  # the entries they take
        return self.sinks + self.window + self.pool


def budget_size(budget, total, sinks=4, window=256, charge=0):
    """S from `budget` (a fraction 0 < x <= 1 of `total` tokens, or an integer S > 1) and pool =
    S - sinks - window - m per KV head, m = charge: the entries a scorer's state takes (S >= total:
    no eviction)."""
    try:
        x = float(budget)
    except (TypeError, ValueError):
        x = math.nan
    whole = x > 1 and x == int(x)
    if not (0 < x <= 1 or whole):
        use = "use a fraction 0 < x <= 1 of the tokens or an integer S > 1"
        raise ValueError(f"budget {budget!r}: {use}")
    kept = math.ceil(x * total) if x <= 1 else int(x)
    size = min(total, kept)
    pool = size - sinks - window - charge
    if size < total and pool < 0:
        more = f"sinks + window{' + state' * bool(charge)} need S >= {sinks + window + charge}"
        fix = "lower --window or raise --budget"
        raise ValueError(f"budget S = {size} leaves no room: {more} ({fix})")
    return size, pool


def state_charge(policy, dtype):  # m: the entries of `dtype` a policy's state takes
    return policy.charge(dtype) if isinstance(policy, Scorer) else 0


# the KV entries a cache of size S holds: S - m, or every token if none is evicted
def entries(size, charge, total):
    return size - charge if size < total else total


# ------------------------- the eviction rule, plainly: one KV head, one step (README, How it works)
def evict(held, pi, p, budget):
    """The position whose entry the newcomer p takes, of the positions `held` by a cache of budget:
    None while there is room, else the eligible token (sinks <= t <= p - window) with the lowest
    (pi[t], t)."""
    if len(held) < budget.slots:
        return None
    eligible = [t for t in held if budget.sinks <= t <= p - budget.window]
    return min(eligible, key=lambda t: (pi[t], t))


def run_rule(pi, budget):
    """The sorted positions one head holds after each of T steps under static priorities pi (T,);
    kernels.eviction_times is the same run as one mask."""
    held, after = [], []
    for p in range(len(pi)):
        gone = evict(held, pi, p, budget)
        held = [t for t in held if t != gone] + [p]
        after.append(sorted(held))
    return after


# --------------------------------------------- policies (README, Method: eviction times, baselines)
# pi[t] = t: the pool holds the most recent eligible tokens (StreamingLLM)
def streaming(layer, k, v, pos):
    return pos.float().expand(k.shape[:3])


# pi[t] = -|k[t]|: a low key norm marks an important token (KNorm). Rounded to bf16: a repeated
# token's keys differ only by RoPE, which keeps the norm, so they tie in every pass
def knorm(layer, k, v, pos):
    norm = k.float().norm(dim=-1)
    return -norm.bfloat16().float()


# a hash of (layer, head, position), so every pass draws the same numbers
def random_priority(layer, k, v, pos):
    head = torch.arange(k.shape[1], device=pos.device)
    bits = pos * 2654435761 + head[:, None] * 40503
    bits = (bits + layer * 9973) % 2**32
    bits = bits ^ (bits >> 16)
    bits = (bits * 73244475) % 2**32
    bits = bits ^ (bits >> 16)
    bits = bits.double() / 2**32
    return bits.float().expand(k.shape[:3])


# A static policy: (layer, new keys k, values v (B, H, n, D), positions pos (n,)) -> priorities
# (B, H, n) of any real dtype, fixed once given. Per token: t's priority reads only k[t], v[t] and
# pos[t], for the cache gives a token at a time and the masked pass all at once. Add one here
# (README, Method: baselines), then run tests/test_cache.py -k online_cache_equals_masked.
STATIC = {"streaming": streaming, "knorm": knorm, "random": random_priority}


# Priorities that change with every query, the online cache only: how each updates the held
# tokens' pi (B, H, slots) by the newcomer's attention (B, H, slots), a group mean. h2o accumulates,
# tova keeps the last query's.
def h2o(pi, attention):
    pi.add_(attention)


def tova(pi, attention):
    pi.copy_(attention)


DYNAMIC = {"h2o": h2o, "tova": tova}
# the oracle: static, but it needs the future (teacher-forced)
POLICIES = ("full", *STATIC, "oracle", *DYNAMIC)


def masked_attention(q, k, v, pi, budget):
    """The whole online run as one causal mask: eviction times, then masked flash attention."""
    e = kernels.eviction_times(pi, *budget)  # (B, H, T)
    return kernels.attention(q, k, v, e, budget.sinks)[0], e


# ------------------------------------------------- the targets (README, Method: future attention)
# the default first, and what each reduces p[q, t] by over q
TARGETS = ("helpful", "max", "mean")
REDUCE = dict(helpful="max", max="max", mean="mean")


def next_logp(logits, idx):
    """log P(x[q + 1]) (B, 1, T) of each position q of idx (B, T) by logits (B, T, V); -inf last."""
    logp = logits.float().log_softmax(-1)
    logp = logp[:, :-1]
    following = idx[:, 1:, None]
    logp = logp.gather(-1, following)[..., 0]  # (B, T - 1)
    logp = pad(logp, (0, 1), value=-math.inf)
    return logp[:, None]


@torch.no_grad()
def dense_targets(model, idx, window, target=TARGETS[0], received=False):
    """One dense pass: every layer's cached (k, v) and its target r* (B, H, T), one of TARGETS: the
    oracle's priorities and the scorers' teacher. received: (k, v, a), a the attention each token
    receives from its window's queries (kernels.window_received), for a scorer that reads it."""
    seen = []

    def attn(layer, q, k, v, pos):
        out, lse = kernels.attention(q, k, v)
        seen.append((q, k, v, lse))
        return out

    logits = model(idx, attn=attn, logits=target == "helpful")
    # helpful: lse - log P[q]; a read before a wrong prediction counts little
    weight = next_logp(logits, idx) if target == "helpful" else 0.0
    reduce = REDUCE[target]
    future = lambda q, k, lse: kernels.future_attention(q, k, lse - weight, window, reduce=reduce)
    targets = [future(q, k, lse) for q, k, _, lse in seen]
    if received:
        return [(k, v, kernels.window_received(q, k, window)) for q, k, v, _ in seen], targets
    return [(k, v) for _, k, v, _ in seen], targets


def oracle_policy(model, idx, window, target=TARGETS[0]):  # pi = r*
    targets = dense_targets(model, idx, window, target)[1]
    return lambda layer, k, v, pos: targets[layer][:, :, pos]


# ---------------- learned scorers (README, Method: scorers): what every kind shares, then each kind
EPS = 1e-6  # the RMS epsilon of the scorers' features and read-out, in training and decoding


# x / RMS(x) over the last dim (the model's RMSNorm keeps HF's order of casts)
def rms(x):
    mean = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(mean + EPS)


class Scorer(Module):
    """What every kind shares: pi[t] = r[t] + gamma_h t, r[t] = readout(x[t], z[t]) of the cached
    key and value and what the kind read. A kind adds its parameters and `parallel`, its definition
    over a whole sequence; it decodes by it. A run puts a kind on fast.py's forms (fast.speed_up)
    unless --plain: an edit to a definition here reaches those runs only through fast.py, and
    test_kvpop.py's tests of each fast form against its definition fail until fast.py follows."""

    kind = None  # its name in SCORERS
    delayed = True  # reads the tokens after t: runs with the window it was trained with
    receives = False  # can read a[t], the attention t received from its window's queries
    on_arrival = False  # can be read on arrival (the delay ablation)
    span = 1  # the tokens t .. t + span - 1 its decoding reads as t leaves the window
    chunk = 128  # the parallel forms' tokens a chunk: O(chunk (d_m + chunk)) memory

    # the paper's sizes (a real Qwen3); train.py's defaults are the baby's: window 32, d_mem 16,
    # d_hidden 64
    def __init__(self, config, window=256, d_mem=128, d_hidden=128, gamma=0.002,
                 arrival=False, received=False):
        super().__init__()
        sizes = (window, d_mem, d_hidden)
        if not all(type(size) is int and size >= 1 for size in sizes):
            raise ValueError(f"scorer window, d_mem and d_hidden: integers >= 1, got {sizes}")
        if received and not self.receives:
            can = ", ".join(name for name, cls in SCORERS.items() if cls.receives)
            what = "reads the attention a token received"
            raise ValueError(f"received: only {can} {what}, not {self.kind}")
        if arrival and not self.on_arrival:
            can = ", ".join(name for name, cls in SCORERS.items() if cls.on_arrival)
            what = "can be read on arrival (the delay ablation)"
            raise ValueError(f"arrival: only {can} {what}, not {self.kind}")
        self.layers = config.num_hidden_layers
        self.heads = config.num_key_value_heads
        self.shape = dict(num_hidden_layers=self.layers, num_key_value_heads=self.heads)
        self.shape["head_dim"] = config.head_dim
        self.width = 2 * config.head_dim  # X: a token's features [k; v]
        self.received = received  # the read-out also reads log a[t] (kernels.window_received)
        self.window, self.arrival = window, arrival
        self.d_mem, self.d_hidden = d_mem, d_hidden
        self.meta = {}  # what it was trained for (train.py)
        # gamma_h = softplus(theta_h): gamma at the start; the kind's parameters (read-out last)
        self.theta = self.const(math.log(math.expm1(gamma)))
        self.build()

    # a parameter (L, H, *size): random, scaled by the fan-in size[0]
    def randn(self, *size):
        numbers = torch.randn(self.layers, self.heads, *size)
        return Parameter(numbers / math.sqrt(size[0]))

    # a parameter (L, H, *size), constant
    def const(self, value=0.0, *size):
        shape = (self.layers, self.heads, *size)
        return Parameter(torch.full(shape, float(value)))

    # the read-out's parameters (made last), for what a kind reads z of `width`
    def add_readout(self, width):
        self.w1 = self.randn(self.width + self.received + width, self.d_hidden)
        self.b1 = self.const(0.0, self.d_hidden)
        self.w2 = self.randn(self.d_hidden)
        self.b2 = self.const()

    # m: the cache entries of `dtype` its state takes (README, Method: budget)
    def charge(self, dtype):
        return 0

    # its decoding in the cache, by its definition (fast.speed_up swaps in a faster form)
    def decoding(self, cache):
        return Decoder(self, cache)

    def check(self, config, window):
        got = {name: getattr(config, name) for name in self.shape}
        if got != self.shape:
            trained = f"the scorer was trained for a model with {self.shape}"
            raise ValueError(f"{trained}, this model has {got}")
        if self.delayed and window != self.window:
            late = f"the delayed {self.kind} scorer reads each token {self.window} tokens late"
            fix = f"use --window {self.window}"
            raise ValueError(f"{late}: it needs window {self.window}, got {window} ({fix})")
        if type(self).decoding is Scorer.decoding:  # decodes by Decoder: t .. t + span - 1
            self.check_span(window)

    def check_span(self, window):
        """A kind that decodes by Decoder reads t .. t + span - 1 as t leaves the window: on random
        features, t's r from those tokens alone must be its r in the whole sequence (else decoding
        and the masked pass differ), and they must be in the window."""
        fix = "set span to the tokens t .. t + span - 1 it reads, or give it its own `decoding`"
        if self.span > window:
            raise ValueError(f"{self.kind}: span {self.span} > window {window}; {fix}")
        T = self.span + 3
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, self.heads, T, self.width + self.received, generator=g)
        x = x.to(self.theta)  # (1, H, T, X)
        starts = range(T - self.span + 1)
        with torch.no_grad():
            for layer in range(self.layers):
                whole = self.parallel(layer, x)[..., starts]
                each = [self.parallel(layer, x[..., t : t + self.span, :]) for t in starts]
                alone = torch.stack([r[..., 0] for r in each], -1)
                if not torch.allclose(alone, whole, rtol=1e-4, atol=1e-5):
                    past = f"{self.kind}: r[t] reads past t + span - 1 (span {self.span})"
                    differ = "its decoding would differ from its masked pass"
                    raise ValueError(f"{past}: {differ}; {fix}")

    # x (B, H, T, 2D) in the scorer's dtype (fp64 beside an fp64 model): [k; v], RMS-normalised
    def features(self, k, v):
        x = torch.cat([k, v], -1).detach()
        return rms(x.to(self.theta.dtype))

    # x with log a (B, H, T, X + 1) for the read-out, when the scorer reads a (received); else x
    def with_received(self, x, a):
        if not self.received:
            return x
        if a is None:
            reads = "reads the attention each token received"
            raise ValueError(f"this {self.kind} scorer {reads}: pass a")
        log_a = a.to(x.dtype).clamp(min=EPS).log()
        return torch.cat([x, log_a[..., None]], -1)

    # priorities (B, H, T) of one layer's keys and values at positions pos: a sequence from 0, or a
    # span of it; a (B, H, T): the attention each token received from its window's queries, for a
    # scorer that reads it
    def forward(self, layer, k, v, pos, a=None):
        x = self.with_received(self.features(k, v), a)
        r = self.parallel(layer, x)
        return r + self.recency(layer, pos.to(r.dtype))

    # gamma_h t = softplus(theta_h) t of one layer
    def recency(self, layer, t):
        gamma = softplus(self.theta[layer])
        return gamma[..., None] * t

    # r (B, H, I) = w_2 . silu(W_1 [x; z] + b_1) + b_2 of x (B, H, I, X) and what the kind read z
    def readout(self, layer, x, z):
        joined = torch.cat([x, z], -1)
        a = joined @ self.w1[layer] + self.b1[layer][..., None, :]
        w2 = self.w2[layer][..., None, :]
        return (silu(a) * w2).sum(-1) + self.b2[layer][..., None]


class Decoder:
    """A kind's decoding by its definition: as token t leaves the window at step p = t + w, each
    layer's scorer runs on what the cache then holds, t .. t + span - 1, for t's priority
    (fast.py: faster forms)."""

    state = ()  # the tensors charged to the budget (KVCache.nbytes)

    def __init__(self, scorer, cache):
        self.scorer, self.cache = scorer, cache

    # one layer's priorities (B, H, T) of a prompt's keys and values (B, H, T, D) at positions pos
    def prefill(self, layer, k, v, pos, a=None):
        return self.scorer(layer, k, v, pos, a)

    # every layer's priority (L, B, H, 1) of token t = p - w (p a tensor; t < 0: the cache drops it)
    def leaving(self, p):
        t = p - self.cache.window
        span = t + torch.arange(self.scorer.span, device=t.device)
        k, v = self.cache.recent_kv(span)  # (L, B, H, span, D)
        # (L, B, H, span): t's a is complete, the later tokens' are not read
        a = self.cache.recent_received(span) if self.scorer.received else [None] * len(k)
        scores = []
        for layer in range(len(k)):  # each layer's scorer on its tokens: t's score
            scores.append(self.scorer(layer, k[layer], v[layer], span, a[layer])[..., :1])
        return torch.stack(scores)


class MLPScorer(Scorer):
    """kvpop-mlp (the paper's insertion-time baseline): reads nothing, z[t] is empty; any window."""

    kind = "kvpop-mlp"
    delayed = False

    def build(self):  # the read-out of x alone
        self.add_readout(0)

    # a whole sequence's features x (B, H, T, X) -> r (B, H, T)
    def parallel(self, layer, x):
        return self.readout(layer, x, x[..., :0])


class WindowScorer(Scorer):
    """kvpop-window (delayed, ours, the default): as t leaves the window it reads the n = min(w - 1,
    32) cached tokens after it, two reads a = 0, 1 by content and offset o = 1..n (README, Method:
    scorers); no state of its own.
    alpha_a[o] = softmax_o((W_q x[t])_a . (W_k x[t + o])_a / sqrt(d) + bo_a[o])
    z_a = sum_o alpha_a[o] (W_v x[t + o])_a; bo_0[o] starts at -(o - 1) (read 0 starts on the next
    token), bo_1 flat."""

    kind = "kvpop-window"
    receives = True
    reads = 2  # A
    d_key = 16  # d: each read's width
    ahead = 32  # the most tokens after t a read sees (ours)

    def build(self):
        if self.window < 2:
            reads = "reads the tokens between t and the query that pushes t out"
            raise ValueError(f"kvpop-window {reads}: use window >= 2")
        n = min(self.window - 1, self.ahead)
        self.span = 1 + n  # t and the n after it
        width = self.reads * self.d_key
        self.wq = self.randn(self.width, width)  # the query, of x[t]
        self.wk = self.randn(self.width, width)  # the keys, of x[t + o]
        self.wv = self.randn(self.width, width)  # the values, of x[t + o]
        # the offset bias: -slope (o - 1) a read
        slope = torch.tensor([1.0, 0.0])[: self.reads, None]
        bias = -slope * torch.arange(n)  # (A, n)
        self.bo = Parameter(bias.expand(self.layers, self.heads, -1, -1).clone())
        self.add_readout(width)

    # a projection (..., A d) as its reads (..., A, I, d)
    def split(self, y):
        reads = y.unflatten(-1, (self.reads, self.d_key))
        return reads.transpose(2, 3)

    def look(self, layer, x, after, offsets):
        """r (B, H, I) of tokens x (B, H, I, X) from the tokens `after` them (B, H, J, X), offsets
        (I, J) apart. The reads see the features alone; log a (received), a last column, goes to the
        read-out."""
        n, X = self.bo.shape[-1], self.width
        q = self.split(x[..., :X] @ self.wq[layer])  # (B, H, A, I, d)
        k = self.split(after[..., :X] @ self.wk[layer])  # (B, H, A, J, d)
        v = self.split(after[..., :X] @ self.wv[layer])
        offset = offsets.clamp(1, n) - 1
        bias = self.bo[layer][:, :, offset]  # (H, A, I, J)
        hidden = (offsets < 1) | (offsets > n)
        logits = q @ k.mT / math.sqrt(self.d_key) + bias
        logits = logits.masked_fill(hidden, -math.inf)
        # the last token has nothing after it and reads zeros
        alpha = logits.softmax(-1).nan_to_num(0.0)  # (B, H, A, I, J)
        z = (alpha @ v).transpose(2, 3)
        z = z.flatten(-2)  # (B, H, I, A d)
        return self.readout(layer, x, z)

    # a whole sequence's features x (B, H, T, X) -> r (B, H, T): in chunks, each reading n after it
    def parallel(self, layer, x):
        T = x.shape[2]
        n = self.bo.shape[-1]
        out = []
        for start in range(0, T, self.chunk):
            end = min(start + self.chunk, T)
            reach = min(start + self.chunk + n, T)
            t = torch.arange(start, end, device=x.device)
            after = torch.arange(start + 1, reach, device=x.device)
            offsets = after - t[:, None]  # (I, J)
            tokens = x[..., start:end, :]
            following = x[..., start + 1 : reach, :]
            out.append(self.look(layer, tokens, following, offsets))
        return torch.cat(out, -1)


class MemoryScorer(Scorer):
    """kvpop (delayed, the paper's): an mLSTM matrix memory [C; n] that takes every token q (README,
    Method: scorers),
    C_q = f_q C_{q-1} + i_q v'_q k'_q^T,   n_q = f_q n_{q-1} + i_q k'_q,
    k' = W_k x / sqrt(d_m),   v' = W_v x,
    with an exponential input gate i and a sigmoid forget gate f. Token t is read at q = t + w - 1,
    as it leaves the window (on arrival, the delay ablation: q = t), with u = W_r x[t]:
    z[t] = rms(C_q u / max(|n_q . u|, 1))."""

    kind = "kvpop"
    on_arrival = True

    def build(self):
        # t is read from the memory of the tokens up to t + delay
        self.delay = 0 if self.arrival else self.window - 1
        # the memory's key, value and read projections
        self.wk = self.randn(self.width, self.d_mem)
        self.wv = self.randn(self.width, self.d_mem)
        self.wr = self.randn(self.width, self.d_mem)
        # the gates' pre-activations; the forget gate starts near 1 - 1/w: memory spans the window
        self.wi = self.randn(self.width)
        self.bi = self.const()
        self.wf = self.randn(self.width)
        self.bf = self.const(math.log(self.window))
        self.add_readout(self.d_mem)

    # m: the entries (a key and a value in `dtype`) of C, n and s: (d_m + 1) d_m + 1 numbers a head
    def charge(self, dtype):
        numbers = (self.d_mem + 1) * self.d_mem + 1
        entry = 2 * self.shape["head_dim"] * dtype.itemsize
        return math.ceil(numbers * self.theta.element_size() / entry)

    # the features each token's memory key is made of: its own (the paper's)
    def written_under(self, x):
        return x

    # log i (the exponential input gate), log f (the sigmoid forget gate) (B, H, T)
    def gates(self, layer, x):
        wi, bi = self.wi[layer][:, None], self.bi[layer][:, None]
        log_input = (x * wi).sum(-1) + bi
        wf, bf = self.wf[layer][:, None], self.bf[layer][:, None]
        log_forget = (x * wf).sum(-1) + bf
        return log_input, logsigmoid(log_forget)

    # a whole sequence's features x (B, H, T, X) -> r (B, H, T) by the recurrence (fast.py: chunked)
    def parallel(self, layer, x):
        return self.recurrent(layer, x)[0]

    # its memory keys k', values v' and read vectors u (B, H, T, M) of features x
    def project(self, layer, x):
        k = self.written_under(x) @ self.wk[layer]
        k = k / math.sqrt(self.d_mem)
        return k, x @ self.wv[layer], x @ self.wr[layer]

    # an empty memory: C (B, H, M, M), n (B, H, M, 1) and the log-scale s (B, H), in x's dtype
    def empty(self, x):
        size = self.d_mem
        memory = x.new_zeros(*x.shape[:2], size, size)
        norm = x.new_zeros(*x.shape[:2], size, 1)
        return memory, norm, x.new_full(x.shape[:2], -math.inf)

    def remember(self, state, k, v, log_input, log_forget):
        """The memory after one more token, its k', v' (B, H, M) and gates (B, H): C and n are
        stored as exp(-s) times their values, s' = max(log f + s, log i) (xLSTM's stabiliser)."""
        memory, norm, scale = state
        forgotten = log_forget + scale
        new_scale = torch.maximum(forgotten, log_input)
        forget = (forgotten - new_scale).exp()[..., None, None]
        write = (log_input - new_scale).exp()[..., None, None]
        outer = v[..., :, None] * k[..., None, :]  # v' k'^T
        memory = forget * memory + write * outer
        norm = forget * norm + write * k[..., :, None]
        return memory, norm, new_scale

    # z = rms(C u / max(|n . u|, 1)) of read vectors u (B, H, R, M); stabilised, exp(-s) for 1
    def recall(self, state, u):
        memory, norm, scale = state
        floor = (-scale).exp()[..., None, None]
        divisor = torch.maximum((u @ norm).abs(), floor)
        return rms(u @ memory.mT / divisor)

    def recurrent(self, layer, x):
        """The plain recurrence, the definition: r (B, H, T) of x a token at a time; last state."""
        T = x.shape[2]
        k, v, u = self.project(layer, x)  # (B, H, T, M)
        log_input, log_forget = self.gates(layer, x)
        state = self.empty(x)
        read_at = torch.arange(T, device=x.device) + self.delay
        read_at = read_at.clamp(max=T - 1)  # each token's q
        z = torch.zeros_like(u)
        for q in range(T):
            gates = log_input[..., q], log_forget[..., q]
            state = self.remember(state, k[..., q, :], v[..., q, :], *gates)
            # the tokens read at q
            now = read_at == q
            z[..., now, :] = self.recall(state, u[..., now, :])
        return self.readout(layer, x, z), state

    def decoding(self, cache):  # decodes by the recurrence, a token a step
        return MemoryDecoder(self, cache)


class MemoryDecoder(Decoder):
    """kvpop's decoding by its definition, the recurrence a step: as token p comes, each layer's
    memory takes token p - 1 (now cached), then t = p - w reads it. Its C, n, s: charged state."""

    def __init__(self, scorer, cache):
        super().__init__(scorer, cache)
        if scorer.arrival:
            ablation = "read on arrival (the delay ablation) runs in the masked pass only"
            raise ValueError(f"a {scorer.kind} scorer {ablation}")
        x = cache.pos.new_zeros(cache.pos.shape[1:3], dtype=scorer.theta.dtype)  # (B, H)
        self.memories = [scorer.empty(x) for _ in range(scorer.layers)]  # a layer's C, n, s
        self.start = 0  # the tokens a prompt gave the memories

    @property
    def state(self):  # the tensors charged to the budget (KVCache.nbytes)
        return [tensor for memory in self.memories for tensor in memory]

    def prefill(self, layer, k, v, pos, a=None):
        x = self.scorer.features(k, v)
        r, self.memories[layer] = self.scorer.recurrent(layer, x)
        self.start = k.shape[2]
        return r + self.scorer.recency(layer, pos.to(r.dtype))

    def leaving(self, p):
        """Each layer's memory takes token p - 1 (unless the prompt gave it; its key of p - 2, p - 1
        as its kind writes), then t = p - w reads it (t < 0: dropped)."""
        scorer, t = self.scorer, p - self.cache.window
        written = torch.arange(max(int(p) - 2, 0), int(p), device=p.device)
        k, v = self.cache.recent_kv(written)  # (L, B, H, 2, D)
        k_t, v_t = self.cache.recent_kv(t)  # (L, B, H, 1, D)
        scores = []
        for layer in range(scorer.layers):
            if p > self.start:
                x = scorer.features(k[layer], v[layer])
                key, value, _ = scorer.project(layer, x)
                gates = [g[..., -1] for g in scorer.gates(layer, x)]
                state = (self.memories[layer], key[..., -1, :], value[..., -1, :], *gates)
                self.memories[layer] = scorer.remember(*state)
            x_t = scorer.features(k_t[layer], v_t[layer])
            u = scorer.project(layer, x_t)[2]
            z = scorer.recall(self.memories[layer], u)
            r = scorer.readout(layer, x_t, z)
            scores.append(r + scorer.recency(layer, t.to(r.dtype)))
        return torch.stack(scores)


# the learned kinds by name, the default first: a new kind is a class registered here (README)
SCORERS = {"kvpop-window": WindowScorer, "kvpop": MemoryScorer, "kvpop-mlp": MLPScorer}


# ------------------------------------------------ the boundary loss (README, Method: boundary loss)
# the teacher's labels and cutoffs: kernels.plain_boundary defines them, kernels.boundary sweeps
def boundary_loss(pi, teacher, qs, budgets, layers=1, allsum=None):
    """One layer's share of the boundary loss over `layers` and the budgets, and of the balanced
    keep/drop accuracy: the scorer's pi (B, H, T) against the teacher's pi* = r* + gamma_h t at each
    budget's pool edge, at its queries qs[j] (Q,). `allsum` sums the keep/drop counts over processes
    (training's batch split); None: one process."""
    loss, hits = 0.0, 0.0
    share = layers * len(budgets)
    # each pool's edge, at its queries q (Q,)
    for budget, q in zip(budgets, qs):
        q = q.to(pi.device)
        e = kernels.eviction_times(teacher, *budget)
        keep, t_bnd = kernels.boundary(teacher, e, q, budget)  # boundary's sweep
        t_new = (q - budget.window).expand(*pi.shape[:2], -1)
        margin = pi.gather(-1, t_new) - pi.gather(-1, t_bnd)  # (B, H, Q)
        # keeps and drops, over the processes if split
        counts = [keep.sum(), (~keep).sum()]
        counts = torch.stack(counts)
        counts = allsum(counts) if allsum is not None else counts
        halves = 0.5 / counts.clamp(min=1)
        omega = torch.where(keep, halves[0], halves[1])
        y = 2 * keep.float() - 1  # the README's y: +1 keep, -1 drop
        losses = omega * softplus(-y * margin)
        loss = loss + losses.sum() / share
        # the student ranks t_new on the teacher's side of t_bnd; chance is 0.5
        right = (margin > 0) == keep
        hits += (omega * right).sum().item() / share
    return loss, hits


# ------------------------------------------------- a scorer on disk (support/checkpoint.py's files)
# frozen, its class from SCORERS, on its definitions (fast.speed_up: faster)
def load_scorer(folder):
    return read_scorer(folder, SCORERS)
