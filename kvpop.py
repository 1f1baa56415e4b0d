"""KVpop: a fixed-budget, evicting KV cache for Qwen3 (arXiv 2607.05061), the method in one file.

Read top to bottom, as the README's Method (comments cite its sections as "README, Method: ..."): the budget ->
the eviction rule, plainly -> policies -> targets -> learned scorers -> the boundary loss -> the evicting cache, the
rule's fast form. The model and generation are qwen3.py's; kernels.py holds the plain and fast forms of the masked
attention, the target and the eviction times.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from checkpoint import read_json, read_safetensors, save_safetensors, write_json
from qwen3 import Qwen3Config


# ------------------------------------------------------------------------------------------------
# the budget (README, Method: budget)


def budget_size(budget, total, sinks=4, window=256, state=0):
    """The per-head size S from `budget` (a fraction 0 < x <= 1 of `total` tokens, or an integer S > 1) and the
    pool = S - sinks - window - state. S >= total: no eviction."""
    try:
        x = float(budget)
    except (TypeError, ValueError):
        x = math.nan
    if not (0 < x <= 1 or (x > 1 and x == int(x))):
        raise ValueError(f"budget {budget!r}: use a fraction 0 < x <= 1 of the tokens or an integer S > 1")
    size = min(total, math.ceil(x * total) if x <= 1 else int(x))
    pool = size - sinks - window - state
    if size < total and pool < 0:
        more = f"sinks + window{' + state' * bool(state)} need S >= {sinks + window + state}"
        raise ValueError(f"budget S = {size} leaves no room: {more} (lower --window or raise --budget)")
    return size, pool


def state_charge(policy, dtype):  # m: the entries of `dtype` a policy's state takes
    return policy.charge(dtype) if isinstance(policy, Scorer) else 0


# the KV entries a cache of size S holds: S - m, or every token if none is evicted
def entries(size, charge, total):
    return size - charge if size < total else total


# ------------------------------------------------------------------------------------------------
# the eviction rule, plainly: one KV head, one step (README, How it works)


def evict(held, pi, p, sinks, window, slots):
    """The position whose entry the newcomer p takes, of the positions `held` by a cache of `slots` entries, by
    priorities pi[t]; None while there is room. Else the eligible token (sinks <= t <= p - window: past the sinks,
    out of the window) with the lowest (pi[t], t), priority first, position second: of a tie the older goes."""
    if len(held) < slots:
        return None
    eligible = [t for t in held if sinks <= t <= p - window]
    return min(eligible, key=lambda t: (pi[t], t))


def run_rule(pi, sinks, window, slots):
    """One head fed T tokens one at a time under static priorities pi (T,) -> the sorted positions it holds after
    each step. kernels.eviction_times is the same run as one mask."""
    held, after = [], []
    for p in range(len(pi)):
        gone = evict(held, pi, p, sinks, window, slots)
        held = [t for t in held if t != gone] + [p]
        after.append(sorted(held))
    return after


# ------------------------------------------------------------------------------------------------
# policies (README, Method: eviction times, baselines)


# pi[t] = t: the pool holds the most recent eligible tokens (StreamingLLM)
def streaming(i, k, v, pos):
    return pos.float().expand(k.shape[:3])


# pi[t] = -|k[t]|: a low key norm marks an important token (KNorm). Rounded to bf16: a repeated token's keys
# differ only by RoPE, which keeps the norm, so they tie in every pass
def knorm(i, k, v, pos):
    return -k.float().norm(dim=-1).bfloat16().float()


# a hash of (layer, head, position), so every pass draws the same numbers
def random_priority(i, k, v, pos):
    h = torch.arange(k.shape[1], device=pos.device)[:, None]
    x = (pos * 2654435761 + h * 40503 + i * 9973) % 2**32
    x = ((x ^ (x >> 16)) * 73244475) % 2**32
    x = (x ^ (x >> 16)).double() / 2**32
    return x.float().expand(k.shape[:3])


# A static policy: (layer i, new keys k, values v (B, H, n, D), positions pos (n,)) -> priorities (B, H, n),
# fixed once given. To add one, add its name and function here (README, Method: baselines).
STATIC = {"streaming": streaming, "knorm": knorm, "random": random_priority}
# scores that change with every query: the online cache only (KVCache, attention_received)
DYNAMIC = ("h2o", "tova")
# the oracle is static too, but needs the future (teacher-forced)
POLICIES = ("full", *STATIC, "oracle", *DYNAMIC)


def resolve(policy):
    """The one question asked of a policy: its rule and priority function. 'static' (a heuristic, or the oracle's
    callable): priorities given on arrival; 'learned' (a Scorer, itself the function): given as the token leaves
    the window; 'dynamic' and 'full': None. Shared by the cache and the masked pass, so they agree."""
    if isinstance(policy, Scorer):
        return "learned", policy
    if callable(policy) or policy in STATIC:
        return "static", STATIC.get(policy, policy)
    if policy in DYNAMIC or policy == "full":
        return ("full" if policy == "full" else "dynamic"), None
    if policy == "oracle":
        raise ValueError("policy oracle needs the future: it exists for teacher-forced evaluation only")
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")


def masked_attention(q, k, v, pi, sinks, window, pool):
    """The whole online run as one causal mask: eviction times, then masked flash attention."""
    e = kernels.eviction_times(pi, sinks, window, pool)  # (B, H, T)
    return kernels.attention(q, k, v, e, sinks)[0], e


def attention_received(policy, q, k, lse):
    """(B, H, T): what h2o (every query) or tova (the last query) holds after a prompt fed token by token without
    eviction: the group-mean attention each key received, from a causal pass's lse (B, Hq, T), 128 queries a time."""
    (B, Hq, T, D), H = q.shape, k.shape[1]
    G, t, sc = Hq // H, torch.arange(T, device=q.device), torch.zeros(B, H, T, device=q.device)
    kt = k.float()[:, :, None].mT  # (B, H, 1, D, T)
    for j in range(0 if policy == "h2o" else T - 1, T, 128):
        qj = q[:, :, j : j + 128].float().view(B, H, G, -1, D)
        lj = lse.view(B, H, G, T)[..., j : j + 128, None]
        p = (qj @ kt / math.sqrt(D) - lj).exp()  # (B, H, G, M, T)
        sc += p.masked_fill(t > t[j : j + 128, None], 0).mean(2).sum(-2)
    return sc


# ------------------------------------------------------------------------------------------------
# the targets (README, Method: future attention): the default first, and what each reduces p[q, t] by over q


TARGETS = ("helpful", "max", "mean")
REDUCE = dict(helpful="max", max="max", mean="mean")


def next_logp(logits, idx):
    """(B, 1, T): log P(x[q + 1]), the log-probability logits (B, T, V) give the token that follows each position
    q of idx (B, T); -inf at the last."""
    lp = logits.float().log_softmax(-1)[:, :-1]
    lp = lp.gather(-1, idx[:, 1:, None])[..., 0]  # (B, T - 1)
    return F.pad(lp, (0, 1), value=-math.inf)[:, None]


@torch.no_grad()
def dense_targets(model, idx, window, target="mean"):
    """One dense pass: every layer's cached (k, v) and its future-attention target r* (B, H, T), `target` one of
    TARGETS: the oracle's priorities and the scorers' teacher. helpful weighs query q's attention p[q, t] by
    P(x[q + 1]): its lse raised by -log P, after the pass."""
    seen = []

    def attn(i, q, k, v, pos):
        y, lse = kernels.attention(q, k, v)
        seen.append((q, k, v, lse))
        return y

    logits = model(idx, attn=attn, head=target == "helpful")
    # helpful: lse - log P[q]; a read before a wrong prediction counts little
    lw = next_logp(logits, idx) if target == "helpful" else 0.0
    red = REDUCE[target]
    rs = [kernels.future_attention(q, k, lse - lw, window, reduce=red) for q, k, _, lse in seen]
    return [(k, v) for _, k, v, _ in seen], rs


def oracle_policy(model, idx, window, target="mean"):  # pi = r*
    r = dense_targets(model, idx, window, target)[1]
    return lambda i, k, v, pos: r[i][:, :, pos]


# ------------------------------------------------------------------------------------------------
# learned scorers (README, Method: scorers)


SCORERS = ("kvpop-window", "kvpop", "kvpop-mlp")  # the default first
DELAYED = ("kvpop", "kvpop-window")  # scored when the token leaves the window, not on arrival
EPS = 1e-6  # the RMS epsilon of the scorers' features and read-out, in training and decoding
ALL = slice(None)  # every layer at once (decoding), in place of one layer's index i


# x / RMS(x) over the last dim (the model's RMSNorm keeps HF's order of casts)
def rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


# a scorer parameter (L, H, ...) of layer i (H, ...), or of ALL layers beside a batch dim (L, 1, H, ...)
def at(p, i):
    return p[i] if i != ALL else p[:, None]


class Scorer(nn.Module):
    """Learned static priorities pi[t] = r[t] + gamma_h t per layer and KV head, from the cached key and value
    (README, Method: scorers). kvpop-mlp reads t alone (the paper's insertion-time scorer). The delayed kinds score
    t as it leaves the window:
    kvpop-window reading the cached tokens after t, kvpop (the paper's) from an mLSTM memory that has read them;
    the memory is charged as `charge` cache entries."""

    # the parallel forms' chunk of c tokens: O(c (M + c)) memory a chunk
    chunk = 128
    # kvpop-window: reads A, their width d, the most tokens after t they see (ours)
    reads, d_key, ahead = 2, 16, 32

    def __init__(self, config, kind="kvpop-window", window=256, d_mem=128, d_hidden=128, gamma=0.002, arrival=False):
        super().__init__()
        if kind not in SCORERS or not all(type(n) is int and n >= 1 for n in (window, d_mem, d_hidden)):
            raise ValueError(f"scorer kind {kind!r} (use {' or '.join(SCORERS)}), window, d_mem, d_hidden >= 1")
        if arrival and kind != "kvpop":
            raise ValueError(f"arrival: only the kvpop scorer can be read on arrival (the delay ablation), not {kind}")
        if kind == "kvpop-window" and window < 2:
            raise ValueError("kvpop-window reads the tokens between t and the query that pushes t out: use window >= 2")
        L, H, D = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        self.kind, self.window, self.meta = kind, window, {}
        self.d_mem, self.d_hidden = d_mem, d_hidden
        # kvpop reads t from its memory of the tokens up to t + delay = t + w - 1, the last one cached as t leaves the
        # window; on arrival, up to t itself (the delay ablation)
        self.arrival, self.delay = arrival, 0 if arrival else window - 1
        self.shape = dict(num_hidden_layers=L, num_key_value_heads=H, head_dim=D)
        X, M = 2 * D, d_mem
        # parameters of shape (L, H, ...): random (scaled by the fan-in), or constant
        randn = lambda *s: nn.Parameter(torch.randn(L, H, *s) / math.sqrt(s[0]))
        const = lambda *s, c=0.0: nn.Parameter(torch.full((L, H, *s), float(c)))
        self.theta = const(c=math.log(math.expm1(gamma)))  # softplus(theta) = gamma at the start
        if kind == "kvpop-window":
            # A reads over t+1..t+n, n = min(w - 1, ahead), by content and by offset
            A, d, n = self.reads, self.d_key, min(window - 1, self.ahead)
            self.wq, self.wk, self.wv = randn(X, A * d), randn(X, A * d), randn(X, A * d)  # query (of x[t]), key, value
            # offset bias -slope (o - 1): read 0 starts on the next token, read 1 evenly
            slope = torch.tensor([1.0, 0.0])[:A, None]
            self.bo = nn.Parameter((-slope * torch.arange(n)).expand(L, H, A, n).clone())
        if kind == "kvpop":
            self.wk, self.wv, self.wr = randn(X, M), randn(X, M), randn(X, M)  # memory key, value, read projections
            self.wi, self.bi, self.wf = randn(X), const(), randn(X)  # input, forget gate pre-activations
            self.bf = const(c=math.log(window))  # the forget gate near 1 - 1/w: the memory spans the window
        # the read-out every kind shares, head(x, z): z is what the kind read
        Z = {"kvpop-mlp": 0, "kvpop-window": self.reads * self.d_key, "kvpop": M}[kind]
        self.w1, self.b1 = randn(X + Z, d_hidden), const(d_hidden)
        self.w2, self.b2 = randn(d_hidden), const()

    def charge(self, dtype):
        """m (README, Method: budget): the cache entries (a key and a value of head_dim in `dtype`) whose bytes the
        state takes: kvpop's C, n and its log-scale, (d_m + 1) d_m + 1 numbers in the scorer's dtype per layer and KV
        head; the other kinds keep none."""
        M, D = self.d_mem, self.shape["head_dim"]
        state = ((M + 1) * M + 1) * self.theta.element_size() if self.kind == "kvpop" else 0
        return math.ceil(state / (2 * D * dtype.itemsize))

    def check(self, config, window):
        got = {k: getattr(config, k) for k in self.shape}
        if got != self.shape:
            raise ValueError(f"the scorer was trained for a model with {self.shape}, this model has {got}")
        if self.kind in DELAYED and window != self.window:
            late = f"the delayed {self.kind} scorer reads each token {self.window} tokens late"
            raise ValueError(f"{late}: it needs window {self.window}, got {window} (use --window {self.window})")

    # (B, H, T, 2D) in the scorer's dtype (fp32; fp64 beside an fp64 model): the cached (post-RoPE) key and value,
    # detached, RMS-normalised
    def features(self, k, v):
        return rms(torch.cat([k, v], -1).detach().to(self.theta.dtype))

    def forward(self, i, k, v, pos, memory=None):
        """Priorities (B, H, T) of layer i's tokens at positions pos; the delayed kinds read a whole sequence from 0
        (a token still in the window at the end reads what follows it). kvpop: `memory` (a list) gets the final
        state."""
        x = self.features(k, v)
        if self.kind == "kvpop-mlp":  # the read-out alone, with nothing read
            r = self.head(i, x, x[..., :0])
        if self.kind == "kvpop-window":
            r = self.look_parallel(i, x)
        if self.kind == "kvpop":
            r, state = self.parallel(i, x)
            if memory is not None:
                memory.append(state)
        return r + self.recency(i, pos.to(r.dtype))

    # gamma_h t = softplus(theta_h) t of layer i (every layer's: i = ALL)
    def recency(self, i, t):
        return F.softplus(at(self.theta, i))[..., None] * t

    # the read-out of every kind, r = w_2 . silu(W_1 [x; z] + b_1) + b_2: x (B, H, I, X) and what the kind read z
    # (B, H, I, Z) -> (B, H, I); every layer's (i = ALL): a leading dim L
    def head(self, i, x, z):
        return self.out(i, torch.cat([x, z], -1) @ at(self.w1, i) + at(self.b1, i)[..., None, :])

    # w_2 . silu(a) + b_2 from the read-out's pre-activation a (B, H, I, d_hidden)
    def out(self, i, a):
        return (F.silu(a) * at(self.w2, i)[..., None, :]).sum(-1) + at(self.b2, i)[..., None]

    # kvpop-window: the delayed scorer that reads its window from the cache

    def look(self, i, x, xw, offsets):
        """kvpop-window: scores (B, H, I) of tokens with features x (B, H, I, X) from the features xw (B, H, J, X)
        of tokens after them, offsets (I, J) apart (visible: 1..n, n = min(w - 1, ahead)). Read a = 0, 1: a softmax over
        the visible o of (W_q x)_a . (W_k xw)_a / sqrt(d) + bo_a[o] pools z_a = sum_o softmax * (W_v xw)_a; then
        r = head(x, [z_0; z_1])."""
        A, d, n = self.reads, self.d_key, self.bo.shape[-1]
        split = lambda y, w: (y @ w[i]).unflatten(-1, (A, d)).transpose(2, 3)  # (B, H, A, I or J, d)
        q, k, v = split(x, self.wq), split(xw, self.wk), split(xw, self.wv)
        bias = self.bo[i][:, :, offsets.clamp(1, n) - 1]  # (H, A, I, J)
        hidden = (offsets < 1) | (offsets > n)
        s = (q @ k.mT / math.sqrt(d) + bias).masked_fill(hidden, -math.inf)
        # (B, H, A, I, J); the last token has nothing after it and reads zeros
        a = s.softmax(-1).nan_to_num(0.0)
        z = (a @ v).transpose(2, 3).flatten(-2)  # (B, H, I, A d)
        return self.head(i, x, z)

    def look_parallel(self, i, x):
        """kvpop-window over a whole sequence x (B, H, T, X): chunks of c tokens, each reading the n after it."""
        T, c, n = x.shape[2], self.chunk, self.bo.shape[-1]
        out = []
        for c0 in range(0, T, c):
            c1, n1 = min(c0 + c, T), min(c0 + c + n, T)
            t, j = torch.arange(c0, c1, device=x.device), torch.arange(c0 + 1, n1, device=x.device)
            xc, xw = x[..., c0:c1, :], x[..., c0 + 1 : n1, :]
            out.append(self.look(i, xc, xw, j - t[:, None]))
        return torch.cat(out, -1)

    def look_online(self, x, t):
        """kvpop-window when decoding: every layer's priority (L, B, H, 1) of token t from the features x (L, B, H,
        1 + n, X) of t and the n tokens after it, in position order. W_k and W_v are folded into the read,
        u_a = W_k,a (W_q x)_a / sqrt(d) and z_a = W_v,a^T (sum_o softmax * xw): the n tokens are never projected."""
        xt, xw = x[..., :1, :], x[..., 1:, :]  # (L, B, H, 1, X), (L, B, H, n, X)
        A, d = self.reads, self.d_key
        q = (xt @ at(self.wq, ALL))[..., 0, :].unflatten(-1, (A, d))  # (L, B, H, A, d)
        wk, wv = (at(w, ALL).unflatten(-1, (A, d)) for w in (self.wk, self.wv))
        u = torch.einsum("...ad,...xad->...ax", q, wk) / math.sqrt(d)  # (L, B, H, A, X)
        a = (u @ xw.mT + at(self.bo, ALL)).softmax(-1)  # (L, B, H, A, n): offsets 1..n
        z = torch.einsum("...ax,...xad->...ad", a @ xw, wv)  # (L, B, H, A, d)
        return self.head(ALL, xt, z.flatten(-2)[..., None, :]) + self.recency(ALL, t)

    def online(self, x, t):
        """Decoding, kvpop-window and kvpop-mlp (kvpop: `read`): every layer's priority (L, B, H, 1) of token t as it
        leaves the window, in one call, from the features x (L, B, H, 1 + n, X) of t and the n tokens after it."""
        if self.kind == "kvpop-window":
            return self.look_online(x, t)
        return self.head(ALL, x, x[..., :0]) + self.recency(ALL, t)

    # kvpop: the mLSTM memory, parallel form (training, the masked pass, prefill)

    def parallel(self, i, x):
        """kvpop, decay-masked form over a whole sequence x (B, H, T, 2D) -> scores (B, H, T) and the final state.
        Token t is read at q = min(t + w - 1, T - 1) (on arrival: q = t) as
        C_q u = sum_{j <= q} exp(F_q - F_j + log i_j) v'_j (k'_j . u), F = cumsum log f,
        under one max per row as the recurrent form's stabiliser. Chunk by chunk over q: the reads in a chunk add
        the state mem = [C; n] carried from the tokens before it, and mem then moves to the chunk's last token.
        Only x is made at full length."""
        (B, H, T, _), M, delay, c = x.shape, self.d_mem, self.delay, self.chunk
        xs = x.split(c, -2)  # the chunks of x
        # every token's gates: log i (exponential input), log f (sigmoid forget)
        li = torch.cat([(xc * self.wi[i][:, None]).sum(-1) for xc in xs], -1)
        lf = torch.cat([(xc * self.wf[i][:, None]).sum(-1) for xc in xs], -1)
        li = li + self.bi[i][:, None]  # (B, H, T)
        lf = F.logsigmoid(lf + self.bf[i][:, None])
        # Fc[..., j + 1] = F_j = log f_0 + .. + log f_j, in fp64: differences of long sums
        Fc = F.pad(lf.double().cumsum(-1), (1, 0))
        starts = range(0, T, c)
        # chunk k holds the reads of tokens reads[k] .. reads[k+1] - 1
        reads = [max(c0 - delay, 0) for c0 in starts] + [T]
        # [C; n] = sum_j weight_j [v'_j; 1] k'_j^T over the tokens before the chunk
        mem = x.new_zeros(B, H, M + 1, M)
        scale = x.new_full((B, H), -math.inf)  # its log-scale
        out = []
        for c0, r0, r1, xc, lc in zip(starts, reads, reads[1:], xs, li.split(c, -1)):
            c1 = c0 + lc.shape[-1]  # the chunk's tokens: c0 .. c1 - 1
            # the chunk's memory keys k' and values [v'; 1]
            kc = xc @ self.wk[i] / math.sqrt(M)  # (B, H, c, M)
            vc = F.pad(xc @ self.wv[i], (0, 1), value=1.0)  # (B, H, c, M + 1)
            # the read vectors u of the tokens read in it
            xr = x[..., r0:r1, :]  # (B, H, R, 2D)
            t = torch.arange(r0, r1, device=x.device)
            uc = xr @ self.wr[i]  # (B, H, R, M)
            # the rows: each read at q, then the chunk's last token (where mem moves to), as indices into Fc
            q = torch.cat([(t + delay).clamp(max=T - 1), t.new_tensor([c1 - 1])]) + 1
            # log weight of the chunk's token j in row q: F_q - F_j + log i_j for j <= q, else -inf (B, H, R + 1, c)
            j = torch.arange(c0 + 1, c1 + 1, device=x.device)
            dF = Fc[..., q, None] - Fc[..., None, c0 + 1 : c1 + 1]
            logw = dF.to(x.dtype) + lc[..., None, :]
            logw = logw.masked_fill(j > q[:, None], -math.inf)
            # the carried state's log-scale in row q; one max per row over both
            dF0 = (Fc[..., q] - Fc[..., c0, None]).to(x.dtype)
            lo = scale[..., None, None] + dF0[..., None]
            sq = torch.maximum(logw.amax(-1, keepdim=True), lo)
            e, g = (logw - sq).exp(), (lo - sq).exp()
            # the reads [C u; n . u]: the chunk's tokens, decay-masked (B, H, R, M + 1)
            y = (e[..., :-1, :] * (uc @ kc.mT)) @ vc
            # plus the carried state (none before chunk 0)
            if c0:
                y = y + g[..., :-1, :] * (uc @ mem.mT)
            # h = C u / max(|n . u|, 1), stabilised; r = head(x, rms(h))
            h = y[..., :M] / torch.maximum(y[..., M:].abs(), (-sq[..., :-1, :]).exp())
            out.append(self.head(i, xr, rms(h)))
            # mem moves to the chunk's last token
            mem = g[..., -1:, :] * mem + (vc * e[..., -1, :, None]).mT @ kc
            scale = sq[..., -1, 0]
        return torch.cat(out, -1), (mem, scale)

    # kvpop: the recurrent form (decoding), every layer at once; the tests check it against the plain equations

    @torch.no_grad()
    def folded(self):
        """kvpop's update weights, made once per cache, with the RMS scale of the raw x = [k; v] folded in
        (rms(x) = sqrt(2D) x rsqrt(|x|^2 + 2D eps)): z = W x rsqrt(|x|^2 + 2D eps) + b is [k'; v'; 1; log i; the
        forget gate's pre-activation] in one product, x^T W: W (L, 1, H, 2D, 2M + 3) (a row vector times a matrix
        stored row by row, 2.5x faster than W x on a CPU), b (L, 1, H, 1, 2M + 3)."""
        X, M = 2 * self.shape["head_dim"], self.d_mem
        one = torch.zeros_like(self.wi[..., None])  # its bias makes the 1 of [v'; 1]
        gates = [self.wi[..., None], self.wf[..., None]]
        w = torch.cat([self.wk / math.sqrt(M), self.wv, one, *gates], -1)
        b = torch.stack([torch.ones_like(self.bi), self.bi, self.bf], -1)
        b = F.pad(b, (2 * M, 0))  # no bias on k', v'
        return (w * math.sqrt(X)).contiguous()[:, None], b[:, None, :, None]

    def remember(self, mem, scale, k, v, fold):
        """Every layer's memory takes one more token (k, v (L, B, H, 1, D)), in place:
        mem = [C; n] = f mem + g [v'; 1] k'^T, stabilised by its log-scale s (L, B, H) as in xLSTM:
        s' = max(log f + s, log i), g = exp(log i - s'), f = exp(log f + s - s')."""
        w, b = fold
        M, x = self.d_mem, torch.cat([k, v], -1).to(w.dtype)  # (L, B, H, 1, 2D)
        r = torch.rsqrt((x * x).sum(-1, keepdim=True) + x.shape[-1] * EPS)
        z = torch.addcmul(b, x @ w, r)
        li, lf = z[..., 0, -2], scale - F.softplus(-z[..., 0, -1])  # log i, log f + s (L, B, H)
        s = torch.maximum(li, lf)
        g, f = (li - s).exp()[..., None, None], (lf - s).exp()[..., None, None]
        # in place, one pass for the product: mem (L, B, H, M + 1, M) as a batch of matrices
        v1 = z[..., M : 2 * M + 1].reshape(-1, M + 1, 1)  # [v'; 1]
        k1 = (g * z[..., :M]).view(-1, 1, M)  # g k'
        mem.mul_(f).view(-1, M + 1, M).baddbmm_(v1, k1)
        scale.copy_(s)

    def prepare(self, x):
        """kvpop: what a read needs of tokens with features x (L, B, H, c, X) alone, every layer's: u = W_r x and
        W_1's product with x in the read-out (made for c tokens at once, the weights are read once for c)."""
        return x @ at(self.wr, ALL), x @ at(self.w1, ALL)[..., : x.shape[-1], :]

    def read(self, mem, scale, u, wx, t):
        """kvpop's priority (L, B, H, 1) of the token at t, every layer at once, from the memories as they are and
        its prepared u, wx (L, B, H, 1, ...): [C u; n . u] = mem u, h = C u / max(|n . u|, exp(-scale)),
        r = head(x, rms(h)) + gamma_h t."""
        M, X = self.d_mem, 2 * self.shape["head_dim"]
        y = u @ mem.mT  # (L, B, H, 1, M + 1)
        h = y[..., :M] / torch.maximum(y[..., M:].abs(), (-scale).exp()[..., None, None])
        a = wx + rms(h) @ at(self.w1, ALL)[..., X:, :] + at(self.b1, ALL)[..., None, :]
        return self.out(ALL, a) + self.recency(ALL, t)

    def save_pretrained(self, folder):
        """scorer.safetensors + scorer.json (every setting needed to rebuild it, and what it was trained for)."""
        os.makedirs(folder, exist_ok=True)
        save_safetensors(self.state_dict(), os.path.join(folder, "scorer.safetensors"))
        d = dict(kind=self.kind, window=self.window, d_mem=self.d_mem, d_hidden=self.d_hidden, arrival=self.arrival)
        d |= self.shape | dict(trained=self.meta)
        write_json(d, os.path.join(folder, "scorer.json"))

    @classmethod
    def from_pretrained(cls, folder):
        f = os.path.join(folder, "scorer.json")
        if not os.path.isfile(f):
            hint = "pass the --out_dir of a train.py run"
            raise FileNotFoundError(f"{folder} is not a scorer folder (no scorer.json); {hint}")
        d, sd = read_json(f), read_safetensors(os.path.join(folder, "scorer.safetensors"))
        try:
            c = Qwen3Config(**{k: d[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")})
            s = cls(c, d["kind"], d["window"], d["d_mem"], d["d_hidden"], arrival=d["arrival"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{f}: missing or bad field ({e})") from None
        shapes = lambda sd: {k: v.shape for k, v in sd.items()}
        if shapes(sd) != shapes(s.state_dict()):
            raise ValueError(f"{folder}: scorer.safetensors does not hold the tensors scorer.json describes")
        s.load_state_dict({k: v.float() for k, v in sd.items()})
        s.meta = d.get("trained", {})
        return s.eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------------
# the boundary loss (README, Method: boundary loss)


def boundary(pi, e, q, sinks, window):
    """The teacher's decision for t_new = q - window at each query q (Q,): keep (B, H, Q), and the cutoff t_bnd: the
    pool-th best eligible token, or the best dropped one when that is t_new. pi: the teacher's priorities, e: their
    eviction times."""
    T = pi.shape[-1]
    u, tn = torch.arange(T, device=pi.device), q - window
    # each token's place in the order of (pi, t)
    order = torch.empty_like(e).scatter_(-1, pi.sort(stable=True).indices, u.expand_as(e))
    keep = e.gather(-1, tn.expand(*e.shape[:2], -1)) > q  # t_new still visible at q
    elig = (u >= sinks) & (u <= tn[:, None])  # (Q, T)
    kept = elig & (e[..., None, :] > q[:, None])  # (B, H, Q, T): exactly the pool
    worst = torch.where(kept, order[..., None, :], T).argmin(-1)
    best_dropped = torch.where(elig & ~kept, order[..., None, :], -1).argmax(-1)
    return keep, torch.where(worst == tn, best_dropped, worst)


def boundary_loss(pi, teacher, qs, sinks, window, pools, layers=1, total=None):
    """One layer's boundary loss: the student's priorities pi (B, H, T) against the teacher's pi* = r* + gamma_h t
    (B, H, T), at the edge of each of `pools` at its queries qs[j] (Q,): y = keep t_new = q - w, t_bnd the cutoff;
    sum omega softplus(-y (pi[t_new] - pi[t_bnd])), omega weighing each pool's keeps and drops half each -> (loss,
    balanced keep/drop accuracy), each this layer's share of the mean over `layers` layers and the pools. `total`
    sums the keep/drop counts over processes (training's batch split); None: one process."""
    loss, hits, share = 0.0, 0.0, layers * len(pools)
    for pool, q in zip(pools, qs):  # each pool's edge, its queries q (Q,)
        q = q.to(pi.device)
        y, bnd = boundary(teacher, kernels.eviction_times(teacher, sinks, window, pool), q, sinks, window)
        tn = (q - window).expand(*pi.shape[:2], -1)  # t_new
        d = pi.gather(-1, tn) - pi.gather(-1, bnd)  # (B, H, Q)
        n = torch.stack([y.sum(), (~y).sum()])  # keeps and drops, over the processes if split
        n = total(n) if total is not None else n
        omega = torch.where(y, 0.5 / n[0].clamp(min=1), 0.5 / n[1].clamp(min=1))
        loss = loss + (omega * F.softplus(-(2 * y.float() - 1) * d)).sum() / share
        # the student ranks t_new on the teacher's side of t_bnd; chance is 0.5
        hits += (omega * ((d > 0) == y)).sum().item() / share
    return loss, hits


# ------------------------------------------------------------------------------------------------
# the evicting cache: the rule's fast form, every layer at once (README, How it works)


class KVCache:
    """`evict`'s rule for every layer, batch row and KV head at once, in buffers allocated once: `slots` = S - m
    entries a layer and head, keys (L, B, H, slots, D) and values transposed (L, B, H, D, slots), so both products
    of a step read their matrix row by row, the layout that streams memory fastest. Filled slots are
    [0, min(t, slots)); an evicted slot goes to the newcomer, in place. pos[slot]: its token's position (-1: empty);
    score[slot]: its priority (a learned scorer's, given as the token leaves the window, 0 before; h2o's and tova's
    attention).

    t: the tokens taken so far, the next newcomer's position p (qwen3's forward advances it). A learned scorer's work
    for a step is done at layer 0 for every layer (`score_leaving`): ring[..., t % w] is window token t's slot; near
    holds the features of the tokens the next read sees, t .. t + n (t + n joins as t leaves), twice over so that
    they are one slice in position order; kvpop's memories sit beside, with the next leaving tokens' prepared
    reads."""

    def __init__(self, model, batch, slots, policy="full", sinks=4, window=256):
        c, p = model.config, next(model.parameters())
        L, H, D = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
        self.rule, self.priority = resolve(policy)
        self.policy, self.slots, self.sinks, self.window, self.t = policy, slots, sinks, window, 0
        self.pool = slots - sinks - window
        self.kind = policy.kind if self.rule == "learned" else None  # a learned scorer's kind
        # priorities in a learned scorer's dtype (fp64 beside an fp64 model), else fp32
        sdt = policy.theta.dtype if self.kind else torch.float32
        dev, shape = dict(device=p.device), (L, batch, H, slots)
        self.k = torch.zeros(*shape, D, dtype=p.dtype, **dev)
        self.v = torch.zeros(L, batch, H, D, slots, dtype=p.dtype, **dev)
        self.pos = torch.full(shape, -1, **dev)
        self.score = torch.zeros(shape, dtype=sdt, **dev)
        # per-layer views, made once: a step indexes less
        self.layer = list(zip(self.k, self.v, self.score))
        self.new = None  # every layer's slot (L, B, H, 1) for this step's newcomer, set at layer 0
        if self.kind:
            policy.check(c, window)
            if policy.arrival:
                raise ValueError("a kvpop scorer read on arrival (the delay ablation) runs in the masked pass only")
            self.ring = torch.zeros(L, batch, H, window, dtype=torch.long, **dev)
            self.n = policy.bo.shape[-1] if self.kind == "kvpop-window" else 0  # the tokens a read sees after t
        if self.kind in ("kvpop-window", "kvpop-mlp"):
            self.near = torch.zeros(L, batch, H, 2 * self.n + 2, 2 * D, dtype=sdt, **dev)
        if self.kind == "kvpop":
            # every layer and head's memory [C; n] (M + 1, M), its log-scale, how many tokens it has read
            M = policy.d_mem
            self.mem = torch.zeros(L, batch, H, M + 1, M, dtype=sdt, **dev)
            self.scale = torch.full((L, batch, H), -math.inf, dtype=sdt, **dev)
            # the update's weights, folded once per cache: the scorer is frozen while decoding
            self.known, self.fold = 0, policy.folded()
            # the next leaving tokens' prepared reads, c = min(w, 32) of them from token b0 on (none yet: b0 < -c)
            self.block, self.b0, self.ready = min(window, 32), -window - 32, None

    def nbytes(self):  # keys, values and a learned scorer's state
        state = (self.mem, self.scale) if self.kind == "kvpop" else ()
        return 2 * self.k.numel() * self.k.element_size() + sum(x.numel() * x.element_size() for x in state)

    # can T > 1 tokens come in one pass? (else the model feeds them one at a time)
    def whole(self, T):
        return self.t == 0 and (T <= self.slots or self.rule in ("static", "learned"))

    # layer i: q (B, Hq, T, D), new k, v (B, H, T, D) at positions pos; inference only: no graph
    @torch.no_grad()
    def attend(self, i, q, k, v, pos):
        return self.prefill(i, q, k, v, pos) if k.shape[2] > 1 else self.step(i, q, k, v, pos)

    def prefill(self, i, q, k, v, pos):
        """An empty cache takes a whole prompt at once and ends exactly as if fed token by token."""
        T, slots = k.shape[2], self.slots
        pi = torch.zeros(k.shape[:3], device=k.device)
        if self.rule == "static":
            pi = self.priority(i, k, v, pos)
        if self.rule == "learned":
            pi = self.prefill_scorer(i, k, v, pos)
        if T <= slots:  # nothing is evicted yet
            y, lse = kernels.attention(q, k, v)
            keep = torch.arange(T, device=k.device).expand(k.shape[:3])
            if self.rule == "dynamic":
                pi = attention_received(self.policy, q, k, lse)
        # longer than the budget (static, learned): the eviction-time mask; keep what the last query still sees,
        # exactly `slots` a head: sinks + window + pool
        else:
            y, e = masked_attention(q, k, v, pi, self.sinks, self.window, self.pool)
            seen = (pos < self.sinks) | (e > T - 1)
            keep = seen.byte().sort(dim=-1, descending=True, stable=True).indices[..., :slots]
        count, D = keep.shape[-1], k.shape[-1]
        rows = keep[..., None].expand(-1, -1, -1, D)
        self.k[i, :, :, :count] = k.gather(2, rows)
        self.v[i, :, :, :, :count] = v.gather(2, rows).mT
        self.pos[i, :, :, :count], self.score[i, :, :, :count] = pos[keep], pi.gather(2, keep)
        # kept in position order: the last tokens, still in the window, fill the last slots
        if self.kind:
            nw, a = min(T, self.window), torch.arange(count, device=k.device)
            self.ring[i][..., (a[-nw:] + T - count) % self.window] = a[-nw:]
        return y

    def prefill_scorer(self, i, k, v, pos):
        """Layer i's learned priorities of a prompt (B, H, T), 0 for the tokens still in the window (not scored yet),
        and the scorer's state after it: kvpop's memories, which have read every token, and the features of the next
        read's tokens t .. t + n - 1, t = T - w."""
        T, w, memory = k.shape[2], self.window, []
        pi = self.policy(i, k, v, pos, memory)
        if self.kind == "kvpop":
            (self.mem[i], self.scale[i]), self.known = memory[0], T
        else:
            u = torch.arange(max(T - w, 0), max(T - w + self.n, 0), device=k.device)
            self.keep_near(i, u, self.policy.features(k[..., u, :], v[..., u, :]))
        return pi.masked_fill(pos > T - 1 - w, 0.0)

    def step(self, i, q, k, v, pos):
        """Layer i's decoding step for the newcomer p = self.t: at layer 0 `decide` applies the rule to every layer
        at once (a layer's decision reads only what it stored before this step); then the newcomer's key and value
        go to its slot, and it attends."""
        if i == 0:
            self.new = self.decide(self.t)
        self.put(i, self.new[i], k, v, pos)
        return self.attention(i, q, self.t)

    def decide(self, p):
        """Every layer's slot (L, B, H, 1) for the newcomer p: a learned scorer first gives token p - w, leaving the
        window, its priority; then the next free slot while there is one, else the slot of the eligible token
        (sinks <= t <= p - w) with the lowest (priority, position). The newcomer's position, and its score (0) under
        a learned or dynamic policy, go in here."""
        if self.kind:
            self.score_leaving(p)
        new = self.pos.new_full((*self.pos.shape[:3], 1), p) if p < self.slots else self.lowest(p)
        self.pos.scatter_(-1, new, p)
        if self.rule in ("learned", "dynamic"):
            self.score.scatter_(-1, new, 0.0)
        if self.kind:
            self.ring[..., p % self.window] = new[..., 0]
        return new

    def lowest(self, p):
        """Every layer's slot (L, B, H, 1) of the eligible token with the lowest (score, position), past the sinks'
        slots [0, sinks)."""
        s, P = self.sinks, self.pos[..., self.sinks :]
        # ineligible tokens at inf, above any eligible one (torch.where: one pass a table)
        low = torch.where(P > p - self.window, math.inf, self.score[..., s:])
        least = low.amin(-1, keepdim=True)
        # of the lowest, the oldest (the others at a position above any)
        return torch.where(low > least, 2**62, P).argmin(-1, keepdim=True) + s

    def score_leaving(self, p):
        """A learned scorer's work of step p for every layer at once: token t = p - w, leaving the window, gets its
        priority, read from the memories (kvpop, which take token p - 1 first) or from the features of t .. t + n
        (the others; token p - w + n's join `near` first)."""
        w, n, t = self.window, self.n, p - self.window
        assert not self.kind == "kvpop" or self.known >= p - 1, "the memories missed a token"
        if self.kind == "kvpop" and self.known < p:
            self.policy.remember(self.mem, self.scale, *self.cached(p - 1), self.fold)
            self.known = p
        if self.kind != "kvpop" and t + n >= 0:
            x = self.policy.features(*self.cached(t + n))  # (L, B, H, 1, X)
            self.keep_near(ALL, t + n, x[..., 0, :])
        if t < 0:
            return
        if self.kind == "kvpop":
            r = self.read_memory(t)
        else:
            a = t % (n + 1)  # near[..., a : a + n + 1, :] holds t .. t + n
            r = self.policy.online(self.near[..., a : a + n + 1, :], t)
        self.score.scatter_(-1, self.ring[..., t % w, None], r)  # r (L, B, H, 1)

    def read_memory(self, t):
        """kvpop: token t's read of the memories, its u and W_1 x prepared with the next c - 1 leaving tokens',
        t .. t + c - 1 (all cached: c <= w)."""
        c = self.block
        if not self.b0 <= t < self.b0 + c:
            u = torch.arange(t, t + c, device=self.ring.device)
            self.b0, self.ready = t, self.policy.prepare(self.policy.features(*self.cached(u)))
        j = t - self.b0
        return self.policy.read(self.mem, self.scale, *(x[..., j : j + 1, :] for x in self.ready), t)

    # every layer's cached keys and values (L, B, H, len(u), D) of window tokens u (a tensor), or (L, B, H, 1, D) of
    # token u
    def cached(self, u):
        j = self.ring[..., u % self.window] if torch.is_tensor(u) else self.ring[..., u % self.window, None]
        j, D = j[..., None], self.k.shape[-1]  # (L, B, H, len(u), 1)
        k = self.k.gather(3, j.expand(-1, -1, -1, -1, D))
        v = self.v.gather(4, j.mT.expand(-1, -1, -1, D, -1))
        return k, v.mT

    # the features x (..., X) of token u, or (..., len(u), X) of tokens u, into near at u % (n + 1), twice over;
    # layer i's (or ALL layers')
    def keep_near(self, i, u, x):
        a = u % (self.n + 1)
        self.near[i][..., a, :] = x
        self.near[i][..., a + self.n + 1, :] = x

    def put(self, i, slot, k, v, pos):
        """Layer i's newcomer key and value (and a static heuristic's priority) into its slot."""
        K, V, sc = self.layer[i]  # keys, values (transposed), scores (B, H, slots)
        D = k.shape[-1]
        K.scatter_(2, slot[..., None].expand(-1, -1, 1, D), k)
        V.scatter_(3, slot[..., None, :].expand(-1, -1, D, 1), v.mT)
        if self.rule == "static":
            sc.scatter_(2, slot, self.priority(i, k, v, pos))

    def attention(self, i, q, p):
        """The newcomer p's attention (B, Hq, 1, D) over layer i's filled slots, in slot order, in the cache's dtype;
        h2o and tova score from it."""
        K, V, sc = self.layer[i]
        (B, H, _, D), G, used = K.shape, q.shape[1] // K.shape[1], min(p + 1, self.slots)
        K, V = K[:, :, :used], V[..., :used]
        s = K @ q.view(B, H, G, D).mT.to(K.dtype)  # (B, H, used, G)
        # (B, H, G, used): a softmax along memory, 4-6x faster
        a = (kernels.wide(s.mT) / math.sqrt(D)).softmax(-1)
        # h2o: accumulated attention, tova: the current query's (group means)
        if self.policy == "h2o":
            sc[..., :used] += a.mean(-2)
        if self.policy == "tova":
            sc[..., :used] = a.mean(-2)
        y = a.to(V.dtype) @ V.mT  # (B, H, G, D)
        return y.to(q.dtype).view(B, H * G, 1, D)
