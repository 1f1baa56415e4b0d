"""KVpop: a fixed-budget, evicting KV cache for Qwen3 (arXiv 2607.05061), the method in one file.

Read top to bottom (README, Method; comments cite its subsections as "README, Method: ..."): the budget -> policies and
eviction times -> targets -> learned scorers -> the boundary loss -> the evicting cache -> generation. The model is
qwen3.py, the kernels' plain and fast forms kernels.py, the teacher-forced evaluation tasks.py.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from checkpoint import read_json, read_safetensors, save_safetensors, write_json
from qwen3 import Qwen3Config


# ----------------------------------------------------------------------------------------------------------
# policies and eviction times (README, Method: budget, eviction times, future attention, baselines)


# scores that change with every query: online cache only (KVCache.step, attention_received)
DYNAMIC = ("h2o", "tova")


def budget_size(budget, total, sinks=4, window=256, state=0):
    """The per-head size S (README, Method: budget) from `budget` (a fraction 0 < x <= 1 of `total` tokens, or an
    integer S > 1) and the pool = S - sinks - window - state. S >= total: no eviction."""
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


def state_charge(policy, dtype):  # m: the entries of a cache in `dtype` a policy's state takes
    return policy.charge(dtype) if isinstance(policy, Scorer) else 0


def entries(size, charge, total):  # the KV entries a cache of size S holds: S - m, or every token if none is evicted
    return size - charge if size < total else total


# pi[t] = t: the pool holds the most recent eligible tokens (StreamingLLM)
def streaming(i, k, v, pos):
    return pos.float().expand(k.shape[:3])


def knorm(i, k, v, pos):  # pi[t] = -|k[t]|: a low key norm marks an important token (KNorm)
    # rounded to bf16: a repeated token's keys differ only by RoPE, which keeps the norm, so they tie in every pass
    return -k.float().norm(dim=-1).bfloat16().float()


# a hash of (layer, head, position), so every pass draws the same numbers
def random_priority(i, k, v, pos):
    h = torch.arange(k.shape[1], device=pos.device)[:, None]
    x = (pos * 2654435761 + h * 40503 + i * 9973) % 2**32
    x = ((x ^ (x >> 16)) * 73244475) % 2**32
    return ((x ^ (x >> 16)).double() / 2**32).float().expand(k.shape[:3])


# A static policy is a function (layer i, new keys k, values v (B, Hkv, n, D), positions pos (n,)) -> priorities (B,
# Hkv, n), fixed once given. To add one, add its name and function here (README, Method: adding a policy).
STATIC = {"streaming": streaming, "knorm": knorm, "random": random_priority}
# the oracle is static too, but needs the future (teacher-forced)
POLICIES = ("full", *STATIC, "oracle", *DYNAMIC)


def resolve(policy):
    """The one policy resolver -> (rule, priority): 'static' and its priority function (layer i, new keys k, values v
    (B, Hkv, n, D), positions pos (n,)) -> (B, Hkv, n), a callable (the oracle, a learned scorer) being its own;
    'dynamic' or 'full' and None. Shared by the online cache and the masked forward, so they agree."""
    if callable(policy) or policy in STATIC:
        return "static", STATIC.get(policy, policy)
    if policy in DYNAMIC or policy == "full":
        return ("full" if policy == "full" else "dynamic"), None
    if policy == "oracle":
        raise ValueError("policy oracle needs the future: it exists for teacher-forced evaluation only")
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")


def masked_attention(q, k, v, pi, sinks, window, pool):
    """The whole online process as one causal mask: eviction times, then masked flash attention."""
    e = kernels.eviction_times(pi, sinks, window, pool)  # (B, Hkv, T)
    return kernels.attention(q, k, v, e, sinks)[0], e


# the targets (README, Method: future attention), the default first, and what each reduces p[d, t] by
TARGETS = ("helpful", "max", "mean")
REDUCE = dict(helpful="max", max="max", mean="mean")


def next_logp(logits, idx):
    """(B, 1, T): log P(x[d+1]), the log-probability logits (B, T, V) give the token that follows each position d of
    idx (B, T); -inf at the last. The helpful target weighs query d's attention by it, as lse - log P: a read at a
    position whose prediction comes out wrong counts little."""
    lp = logits.float().log_softmax(-1)[:, :-1].gather(-1, idx[:, 1:, None])[..., 0]  # (B, T - 1)
    return F.pad(lp, (0, 1), value=-math.inf)[:, None]


@torch.no_grad()
def dense_targets(model, idx, window, target="mean"):
    """One dense pass: every layer's cached (k, v) and its future-attention target r* (B, Hkv, T), target one of
    TARGETS over the queries past the window (README, Method: future attention): the oracle's priorities and the
    scorers' teacher. helpful needs the pass's logits: the targets are made after it."""
    seen = []

    def attn(i, q, k, v, pos):
        y, lse = kernels.attention(q, k, v)
        seen.append((q, k, v, lse))
        return y

    logits = model(idx, attn=attn, head=target == "helpful")
    # helpful: query d's attention weighed by P(x[d + 1]), as its lse raised by -log P
    lw = next_logp(logits, idx) if target == "helpful" else 0.0
    r = [kernels.future_attention(q, k, lse - lw, window, reduce=REDUCE[target]) for q, k, _, lse in seen]
    return [(k, v) for _, k, v, _ in seen], r


def oracle_policy(model, idx, window, target="mean"):  # pi = r*
    r = dense_targets(model, idx, window, target)[1]
    return lambda i, k, v, pos: r[i][:, :, pos]


def attention_received(policy, q, k, lse):
    """(B, Hkv, T): what h2o (every query) or tova (the last query) holds after a prompt fed token by token without
    eviction, the group-mean attention each key received: from a causal pass's lse (B, Hq, T), 128 queries at a time."""
    (B, Hq, T, D), H = q.shape, k.shape[1]
    G, sc, t = Hq // H, torch.zeros(B, H, T, device=q.device), torch.arange(T, device=q.device)
    for j in range(0 if policy == "h2o" else T - 1, T, 128):
        s = q[:, :, j : j + 128].float().view(B, H, G, -1, D) @ k.float()[:, :, None].transpose(-1, -2) / math.sqrt(D)
        p = (s - lse.view(B, H, G, T)[..., j : j + 128, None]).exp()  # (B, H, G, M, T)
        sc += p.masked_fill(t > t[j : j + 128, None], 0).mean(2).sum(-2)
    return sc


# ----------------------------------------------------------------------------------------------------------
# learned scorers (README, Method: scorers)


SCORERS = ("kvpop-window", "kvpop", "kvpop-mlp")  # the default first
DELAYED = ("kvpop", "kvpop-window")  # scored when the token leaves the window, not on arrival
EPS = 1e-6  # the RMS epsilon of the scorers' features and read-out, in training and in decoding


def rms(x):  # x / RMS(x) over the last dim (the model's RMSNorm keeps HF's order of casts)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


ALL = slice(None)  # every layer at once (decoding), in place of one layer's index i


def at(p, i):  # a scorer parameter (L, H, ...) of layer i (H, ...), or of ALL layers beside a batch dim (L, 1, H, ...)
    return p[i] if i != ALL else p[:, None]


class Scorer(nn.Module):
    """Learned static priorities pi[t] = r[t] + softplus(theta_h) * t per layer and KV head, from the cached key and
    value (README, Method: scorers). kvpop-mlp scores t on arrival. The delayed kinds score t when it leaves the
    window: kvpop-window by reading the cached tokens after t, kvpop (the paper's) from an mLSTM memory that has read
    them; the memory is charged as `charge` cache entries."""

    # the parallel forms' chunk of c tokens: O(c (M + c)) memory a chunk (all chunks' under autograd)
    chunk = 128
    # kvpop-window: reads, their width, the most tokens after t they see (ours)
    reads, d_key, ahead = 2, 16, 32

    def __init__(self, config, kind="kvpop-window", window=256, d_mem=128, d_hidden=128, gamma=0.002, arrival=False):
        super().__init__()
        if kind not in SCORERS or not all(type(n) is int and n >= 1 for n in (window, d_mem, d_hidden)):
            raise ValueError(f"scorer kind {kind!r} (use {' or '.join(SCORERS)}), window, d_mem, d_hidden >= 1")
        if arrival and kind != "kvpop":
            raise ValueError(f"arrival: only the kvpop scorer can be read on arrival (the delay ablation), not {kind}")
        L, H, D = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        self.kind, self.window, self.d_mem, self.d_hidden, self.meta = (kind, window, d_mem, d_hidden, {})
        if kind == "kvpop-window" and window < 2:
            raise ValueError("kvpop-window reads the tokens between t and the query that pushes t out: use window >= 2")
        # kvpop reads t from the memory of tokens up to t + delay: t .. t + w - 1, all the cache holds when t leaves
        # the window; or on arrival, t itself (the delay ablation, masked pass only)
        self.arrival, self.delay = arrival, 0 if arrival else window - 1
        self.shape = dict(num_hidden_layers=L, num_key_value_heads=H, head_dim=D)
        X, M = 2 * D, d_mem
        # parameters of shape (L, H, ...): random (scaled by the fan-in), or constant
        randn = lambda *s: nn.Parameter(torch.randn(L, H, *s) / math.sqrt(s[0]))
        const = lambda *s, c=0.0: nn.Parameter(torch.full((L, H, *s), float(c)))
        self.theta = const(c=math.log(math.expm1(gamma)))  # softplus(theta) = gamma at the start
        # A reads over t+1..t+n, n = min(w - 1, ahead) (the tokens cached when t leaves), by content and by offset
        if kind == "kvpop-window":
            A, d, n = self.reads, self.d_key, min(window - 1, self.ahead)
            # query (from x[t]), key and value
            self.wq, self.wk, self.wv = randn(X, A * d), randn(X, A * d), randn(X, A * d)
            # offset bias -slope (o - 1): read 0 starts on the next token, read 1 evenly
            slope = torch.tensor([1.0, 0.0])[:A, None]
            self.bo = nn.Parameter((-slope * torch.arange(n)).expand(L, H, A, n).clone())
        elif kind == "kvpop":
            # memory key, value and read projections
            self.wk, self.wv, self.wr = randn(X, M), randn(X, M), randn(X, M)
            self.wi, self.bi, self.wf = randn(X), const(), randn(X)  # input and forget gate pre-activations
            # forget gate near 1 - 1/window: the memory spans the window
            self.bf = const(c=math.log(window))
        # the read-out every kind shares, head(x, z): z is what the kind read (kvpop-mlp: nothing)
        Z = {"kvpop-mlp": 0, "kvpop-window": self.reads * self.d_key, "kvpop": M}[kind]
        self.w1, self.b1, self.w2, self.b2 = randn(X + Z, d_hidden), const(d_hidden), randn(d_hidden), const()

    def charge(self, dtype):
        """m (README, Method: budget): the cache entries (a key and a value of head_dim in the cache's dtype) whose
        bytes the state takes: kvpop's C, n and its log-scale, (d_m + 1) d_m + 1 numbers in the scorer's dtype per
        layer and KV head; the other kinds keep none."""
        M, D = self.d_mem, self.shape["head_dim"]
        state = ((M + 1) * M + 1) * self.theta.element_size() if self.kind == "kvpop" else 0
        return math.ceil(state / (2 * D * dtype.itemsize))

    def check(self, config, window):
        got = {k: getattr(config, k) for k in self.shape}
        if got != self.shape:
            raise ValueError(f"the scorer was trained for a model with {self.shape}, this model has {got}")
        if self.kind in DELAYED and window != self.window:
            raise ValueError(
                f"the delayed {self.kind} scorer reads each token {self.window} tokens late: it needs "
                f"window {self.window}, got {window} (use --window {self.window})"
            )

    # (B, H, T, 2D) in the scorer's dtype (fp32; fp64 beside an fp64 model): the cached (post-RoPE) key and value,
    # detached, RMS-normalised
    def features(self, k, v):
        return rms(torch.cat([k, v], -1).detach().to(self.theta.dtype))

    def forward(self, i, k, v, pos, memory=None):
        """Priorities (B, H, T) of layer i's tokens at positions pos; kvpop: a whole sequence from 0 (parallel form;
        t > T - 1 - window, never eligible yet, read at T - 1). `memory` (a list) gets the final state."""
        x = self.features(k, v)
        if self.kind == "kvpop-mlp":  # the read-out alone, with nothing read
            r = self.head(i, x, x[..., :0])
        elif self.kind == "kvpop-window":
            r = self.look_parallel(i, x)
        else:
            r, state = self.parallel(i, x)
            if memory is not None:
                memory.append(state)
        return r + self.recency(i, pos.to(r.dtype))

    def recency(self, i, t):  # gamma_h t = softplus(theta_h) t of layer i (every layer's: i = ALL)
        return F.softplus(at(self.theta, i))[..., None] * t

    # kvpop-window: the delayed scorer that reads its window from the cache

    def look(self, i, x, xw, offsets):
        """kvpop-window: scores (B, H, n) of tokens with features x (B, H, n, X) from the features xw (B, H, m, X) of
        tokens after them, offsets (n, m) apart (visible: 1..min(w - 1, ahead)). Read a = 0, 1: softmax over the
        visible o of (W_q x)_a . (W_k xw)_a / sqrt(d) + bo_a[o] pools z_a = sum_o softmax * (W_v xw)_a; then
        r = head(x, [z_0; z_1])."""
        A, d, n = self.reads, self.d_key, self.bo.shape[-1]
        # (B, H, A, n or m, d)
        q, k, v = (
            (y @ w[i]).unflatten(-1, (A, d)).transpose(2, 3) for y, w in ((x, self.wq), (xw, self.wk), (xw, self.wv))
        )
        bias = self.bo[i][:, :, offsets.clamp(1, n) - 1]  # (H, A, n, m)
        s = (q @ k.mT / math.sqrt(d) + bias).masked_fill((offsets < 1) | (offsets > n), -math.inf)
        # (B, H, A, n, m); the last token has nothing after it and reads zeros
        a = s.softmax(-1).nan_to_num(0.0)
        return self.head(i, x, (a @ v).transpose(2, 3).flatten(-2))  # z (B, H, n, A d)

    # the read-out of every kind, r = w_2 . silu(W_1 [x; z] + b_1) + b_2: x (B, H, n, X) and what the kind read z
    # (B, H, n, Z) -> (B, H, n); every layer's (i = ALL): a leading layer dim
    def head(self, i, x, z):
        h = F.silu(torch.cat([x, z], -1) @ at(self.w1, i) + at(self.b1, i)[..., None, :])  # (B, H, n, d_hidden)
        return (h * at(self.w2, i)[..., None, :]).sum(-1) + at(self.b2, i)[..., None]

    def look_parallel(self, i, x):
        """kvpop-window over a whole sequence x (B, H, T, X): chunks of c tokens, each reading the tokens up to n
        after it (a token near the end reads what follows it: it never leaves the window within the sequence)."""
        T, c, n = x.shape[2], self.chunk, self.bo.shape[-1]
        out = []
        for c0 in range(0, T, c):
            c1, n1 = min(c0 + c, T), min(c0 + c + n, T)
            t, j = torch.arange(c0, c1, device=x.device), torch.arange(c0 + 1, n1, device=x.device)
            out.append(self.look(i, x[..., c0:c1, :], x[..., c0 + 1 : n1, :], j - t[:, None]))
        return torch.cat(out, -1)

    def look_online(self, i, k, v, t):
        """kvpop-window when decoding: the priority (B, H, 1) of token t from the cached keys and values k, v (B, H,
        1 + n, D) of t and of the n tokens after it, in position order (i = ALL: every layer's, (L, B, H, ...)). W_k
        and W_v are folded into the read, u_a = W_k,a (W_q x)_a / sqrt(d) and z_a = W_v,a^T (sum_o softmax * xw), so
        the n tokens are never projected."""
        x = self.features(k, v)
        xt, xw = x[..., :1, :], x[..., 1:, :]  # (B, H, 1, X), (B, H, n, X)
        A, d = self.reads, self.d_key
        q = (xt @ at(self.wq, i))[..., 0, :].unflatten(-1, (A, d))  # (B, H, A, d)
        u = torch.einsum("...ad,...xad->...ax", q, at(self.wk, i).unflatten(-1, (A, d))) / math.sqrt(d)  # (B, H, A, X)
        a = (u @ xw.mT + at(self.bo, i)).softmax(-1)  # (B, H, A, n): offsets 1..n
        z = torch.einsum("...ax,...xad->...ad", a @ xw, at(self.wv, i).unflatten(-1, (A, d)))  # (B, H, A, d)
        return self.head(i, xt, z.flatten(-2)[..., None, :]) + self.recency(i, t)

    def online(self, k, v, t, mem=None, scale=None):
        """Decoding: every layer's priority (L, B, H, 1) of token t as it leaves the window, in one call, from the
        cache: k, v (L, B, H, 1 + n, D) of t and the n tokens after it (kvpop-window; else n = 0); kvpop's memories
        mem, scale."""
        if self.kind == "kvpop":
            return self.read(mem, scale, k, v, t)
        if self.kind == "kvpop-window":
            return self.look_online(ALL, k, v, t)
        x = self.features(k, v)
        return self.head(ALL, x, x[..., :0]) + self.recency(ALL, t)

    # kvpop: the mLSTM memory, parallel form (training, the masked pass, prefill)

    def parallel(self, i, x):
        """kvpop, decay-masked form over a whole sequence x (B, H, T, 2D) -> scores (B, H, T) and the final state.
        Token t is read at q = min(t + w - 1, T - 1) (on arrival: q = t) as
        C_q u = sum_{j <= q} exp(F_q - F_j + log i_j) v'_j (k'_j . u), F = cumsum log f,
        under one max per row as the recurrent form's stabiliser. Chunk by chunk over q: the reads in a chunk add the
        state mem = [C; n] carried from the tokens before it, and mem then moves to the chunk's last token. Only x is
        made at full length."""
        (B, H, T, _), M, W, c = x.shape, self.d_mem, self.delay, self.chunk
        xs = x.split(c, -2)  # the chunks of x
        # every token's gates: log i (exponential input), log f (sigmoid forget), and F_j = log f_0 + .. + log f_j
        li = torch.cat([(xc * self.wi[i][:, None]).sum(-1) for xc in xs], -1)  # (B, H, T)
        lf = torch.cat([(xc * self.wf[i][:, None]).sum(-1) for xc in xs], -1)
        li = li + self.bi[i][:, None]
        lf = F.logsigmoid(lf + self.bf[i][:, None])
        # Fc[..., j + 1] = F_j, in fp64: differences of long sums
        Fc = F.pad(lf.double().cumsum(-1), (1, 0))
        starts = range(0, T, c)
        # chunk k holds the reads of tokens reads[k] .. reads[k+1]-1
        reads = [max(c0 - W, 0) for c0 in starts] + [T]
        # [C; n] = sum_j weight_j [v'_j; 1] k'_j^T over the tokens before the chunk
        mem = x.new_zeros(B, H, M + 1, M)
        scale = x.new_full((B, H), -math.inf)  # its log-scale
        out = []
        for c0, r0, r1, xc, lc in zip(starts, reads, reads[1:], xs, li.split(c, -1)):
            c1 = c0 + lc.shape[-1]  # the chunk's tokens: c0 .. c1 - 1
            # the chunk's memory keys k' and values [v'; 1]; the read vectors u of the tokens read in it
            kc = xc @ self.wk[i] / math.sqrt(M)  # (B, H, c, M)
            vc = F.pad(xc @ self.wv[i], (0, 1), value=1.0)  # (B, H, c, M + 1)
            xr = x[..., r0:r1, :]  # (B, H, R, 2D)
            t = torch.arange(r0, r1, device=x.device)
            uc = xr @ self.wr[i]  # (B, H, R, M)
            # the rows: each read at q, then the chunk's last token (where mem moves to); as indices into Fc
            q = torch.cat([(t + W).clamp(max=T - 1), t.new_tensor([c1 - 1])]) + 1
            # log weight of the chunk's token j in row q: F_q - F_j + log i_j for j <= q, else -inf (B, H, R + 1, c)
            j = torch.arange(c0 + 1, c1 + 1, device=x.device)
            logw = (Fc[..., q, None] - Fc[..., None, c0 + 1 : c1 + 1]).to(x.dtype) + lc[..., None, :]
            logw = logw.masked_fill(j > q[:, None], -math.inf)
            # the carried state's log-scale in row q; one max per row over both
            lo = scale[..., None, None] + (Fc[..., q] - Fc[..., c0, None]).to(x.dtype)[..., None]
            sq = torch.maximum(logw.amax(-1, keepdim=True), lo)
            e, g = (logw - sq).exp(), (lo - sq).exp()
            # the reads [C u; n . u]: the chunk's tokens, decay-masked, plus the carried state (none before chunk 0)
            y = (e[..., :-1, :] * (uc @ kc.transpose(-1, -2))) @ vc  # (B, H, R, M + 1)
            if c0:
                y = y + g[..., :-1, :] * (uc @ mem.transpose(-1, -2))
            # h = C u / max(|n . u|, 1), stabilised; r = head(x, rms(h))
            h = y[..., :M] / torch.maximum(y[..., M:].abs(), (-sq[..., :-1, :]).exp())
            out.append(self.head(i, xr, rms(h)))
            # mem moves to the chunk's last token
            mem = g[..., -1:, :] * mem + (vc * e[..., -1, :, None]).transpose(-1, -2) @ kc
            scale = sq[..., -1, 0]
        return torch.cat(out, -1), (mem, scale)

    # kvpop: recurrent form (decoding), every layer at once; the tests check it against the plain equations

    @torch.no_grad()
    def folded(self):
        """kvpop's update weights, made once per cache, with the RMS scale of the raw x = [k; v] folded in (rms(x) =
        sqrt(2D) x rsqrt(|x|^2 + 2D eps)): z = W x rsqrt(|x|^2 + 2D eps) + b is [k'; v'; 1; log i; the forget gate's
        pre-activation] in one product. W (L, 1, H, 2M + 3, 2D), b (L, 1, H, 1, 2M + 3)."""
        X, M = 2 * self.shape["head_dim"], self.d_mem
        one = torch.zeros_like(self.wi[..., None])  # its bias makes the 1 of [v'; 1]
        w = torch.cat([self.wk / math.sqrt(M), self.wv, one, self.wi[..., None], self.wf[..., None]], -1)
        b = F.pad(torch.stack([torch.ones_like(self.bi), self.bi, self.bf], -1), (2 * M, 0))  # no bias on k', v'
        return (w.mT * math.sqrt(X)).contiguous()[:, None], b[:, None, :, None]

    def remember(self, mem, scale, k, v, fold):
        """Every layer's memory takes one more token (k, v (L, B, H, 1, D)), in place: mem = [C; n] = f mem +
        g [v'; 1] k'^T, stabilised by its log-scale s (L, B, H) as in xLSTM: s' = max(log f + s, log i), g = exp(log i -
        s'), f = exp(log f + s - s')."""
        w, b = fold
        M, x = self.d_mem, torch.cat([k, v], -1).to(w.dtype)  # (L, B, H, 1, 2D)
        z = torch.addcmul(b, (w @ x.mT).mT, torch.rsqrt((x * x).sum(-1, keepdim=True) + x.shape[-1] * EPS))
        li, lf = z[..., 0, -2], scale - F.softplus(-z[..., 0, -1])  # log i, log f + scale (L, B, H)
        scale_new = torch.maximum(li, lf)
        g, f = (li - scale_new).exp()[..., None, None], (lf - scale_new).exp()[..., None, None]
        # in place, one pass for the product: mem (L, B, H, M + 1, M) as a batch of matrices
        v1, k1 = z[..., M : 2 * M + 1].reshape(-1, M + 1, 1), (g * z[..., :M]).view(-1, 1, M)  # [v'; 1], g k'
        mem.mul_(f).view(-1, M + 1, M).baddbmm_(v1, k1)
        scale.copy_(scale_new)

    def read(self, mem, scale, k, v, t):
        """kvpop's priority (L, B, H, 1) of the token at t (k, v (L, B, H, 1, D)), every layer at once, from the
        memories as they are: u = W_r x, [C u; n . u] = mem u, h = C u / max(|n . u|, exp(-scale)), r = head(x,
        rms(h)) + gamma_h t."""
        x, M = self.features(k, v), self.d_mem
        y = (x @ at(self.wr, ALL)) @ mem.mT  # (L, B, H, 1, M + 1)
        h = y[..., :M] / torch.maximum(y[..., M:].abs(), (-scale).exp()[..., None, None])
        return self.head(ALL, x, rms(h)) + self.recency(ALL, t)

    def save_pretrained(self, folder):
        """scorer.safetensors + scorer.json (every setting needed to rebuild it, and what it was trained for)."""
        os.makedirs(folder, exist_ok=True)
        save_safetensors(self.state_dict(), os.path.join(folder, "scorer.safetensors"))
        d = dict(kind=self.kind, window=self.window, d_mem=self.d_mem, d_hidden=self.d_hidden, arrival=self.arrival)
        d |= self.shape
        write_json(d | dict(trained=self.meta), os.path.join(folder, "scorer.json"))

    @classmethod
    def from_pretrained(cls, folder):
        f, hint = os.path.join(folder, "scorer.json"), "pass the --out_dir of a train.py run"
        if not os.path.isfile(f):
            raise FileNotFoundError(f"{folder} is not a scorer folder (no scorer.json); {hint}")
        d, sd = read_json(f), read_safetensors(os.path.join(folder, "scorer.safetensors"))
        try:
            shape = {k: d[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")}
            s = cls(Qwen3Config(**shape), d["kind"], d["window"], d["d_mem"], d["d_hidden"], arrival=d["arrival"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{f}: missing or bad field ({e})") from None
        if {k: v.shape for k, v in sd.items()} != {k: v.shape for k, v in s.state_dict().items()}:
            raise ValueError(f"{folder}: scorer.safetensors does not hold the tensors scorer.json describes")
        s.load_state_dict({k: v.float() for k, v in sd.items()})
        s.meta = d.get("trained", {})
        return s.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------------------
# the boundary loss (README, Method: boundary loss)


def boundary(pi, e, q, sinks, window):
    """The teacher's decision for t_new = q - window at each query q (Q,): keep (B, H, Q), and the cutoff t_bnd: the
    pool-th best eligible token, or the best dropped one when that is t_new. pi: priorities, e: their eviction times."""
    T = pi.shape[-1]
    u, tn = torch.arange(T, device=pi.device), q - window
    # by (pi, t)
    order = torch.empty_like(e).scatter_(-1, pi.sort(stable=True).indices, u.expand_as(e))
    keep = e.gather(-1, tn.expand(*e.shape[:2], -1)) > q  # still visible at q
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
    sums the keep/drop counts over processes (training's batch split), None: one process."""
    loss, hits, share = 0.0, 0.0, layers * len(pools)
    for pool, q in zip(pools, qs):  # each pool's edge, its queries q (Q,)
        q = q.to(pi.device)
        y, bnd = boundary(teacher, kernels.eviction_times(teacher, sinks, window, pool), q, sinks, window)
        d = pi.gather(-1, (q - window).expand(*pi.shape[:2], -1)) - pi.gather(-1, bnd)  # (B, H, Q)
        n = torch.stack([y.sum(), (~y).sum()])
        n = total(n) if total is not None else n
        omega = torch.where(y, 0.5 / n[0].clamp(min=1), 0.5 / n[1].clamp(min=1))  # keeps = drops
        loss = loss + (omega * F.softplus(-(2 * y.float() - 1) * d)).sum() / share
        # the student ranks t_new on the teacher's side of t_bnd; balanced: chance is 0.5
        hits += (omega * ((d > 0) == y)).sum().item() / share
    return loss, hits


# ----------------------------------------------------------------------------------------------------------
# the evicting cache (README, How it works)


class KVCache:
    """At most `size` KV entries per layer and KV head, in buffers allocated once: keys (L, B, Hkv, size, D) and
    values transposed, (L, B, Hkv, D, size), so that both products of a decoding step read their matrix row by row,
    the matrix-vector layout that streams memory fastest. Filled slots are always [0, min(t, size)): an evicted slot
    goes to the newcomer, in place. pos[slot]: the token's position; score[slot]: its priority (a learned scorer's
    given when it leaves the window, 0 before), or h2o/tova's. ring[..., t % w]: the slot of window token t. kvpop's
    memories sit beside."""

    def __init__(self, model, batch, size, policy="full", sinks=4, window=256):
        c, p = model.config, next(model.parameters())
        shape = (c.num_hidden_layers, batch, c.num_key_value_heads, size)
        self.k = torch.zeros(*shape, c.head_dim, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(*shape[:3], c.head_dim, size, dtype=p.dtype, device=p.device)
        self.pos = torch.full(shape, -1, dtype=torch.long, device=p.device)
        # priorities in a learned scorer's dtype (fp64 beside an fp64 model), else fp32
        sdt = policy.theta.dtype if isinstance(policy, Scorer) else torch.float32
        self.score = torch.zeros(shape, dtype=sdt, device=p.device)
        self.ring = torch.zeros(*shape[:3], window, dtype=torch.long, device=p.device)
        # per-layer views, made once: a step indexes less
        self.layer = list(zip(self.k, self.v, self.pos, self.score, self.ring))
        self.size, self.policy, self.sinks, self.window, self.t = size, policy, sinks, window, 0
        self.pool, (self.rule, self.priority) = size - sinks - window, resolve(policy)
        if isinstance(policy, Scorer):
            policy.check(c, window)
            if policy.arrival:
                raise ValueError("a kvpop scorer read on arrival (the delay ablation) runs in the masked pass only")
        # a learned scorer scores t as it leaves the window, every layer at once; a heuristic on arrival
        self.learned = isinstance(policy, Scorer)
        # kvpop-window reads the n tokens after t
        self.ahead = policy.bo.shape[-1] if self.learned and policy.kind == "kvpop-window" else 0
        self.memory = self.learned and policy.kind == "kvpop"  # the mLSTM's state, beside the cache
        if self.memory:  # the memory of every layer and head: mem = [C; n] (M + 1, M), its log-scale
            self.mem = torch.zeros(*shape[:3], policy.d_mem + 1, policy.d_mem, dtype=sdt, device=p.device)
            self.scale = torch.full(shape[:3], -math.inf, dtype=sdt, device=p.device)
            # this step's tokens (k, v) per layer, which the memories take after the last layer
            self.pending, self.fold = [], policy.folded()

    def nbytes(self):  # keys, values and a learned scorer's state
        state = sum(x.numel() * x.element_size() for x in (self.mem, self.scale)) if self.memory else 0
        return 2 * self.k.numel() * self.k.element_size() + state

    # can T > 1 tokens come in one pass? (else the model feeds them one at a time)
    def whole(self, T):
        return self.t == 0 and (T <= self.size or self.rule == "static")

    @torch.no_grad()  # inference only: a learned scorer's priorities carry no graph
    # layer i: q (B, Hq, T, D), new k, v (B, Hkv, T, D) at positions pos
    def attend(self, i, q, k, v, pos):
        return self.prefill(i, q, k, v, pos) if k.shape[2] > 1 else self.step(i, q, k, v, pos)

    def prefill(self, i, q, k, v, pos):
        """An empty cache takes a whole prompt at once and ends exactly as if fed token by token."""
        T, size = k.shape[2], self.size
        pi = torch.zeros(k.shape[:3], device=k.device)
        if self.rule == "static":
            mem = []
            pi = self.policy(i, k, v, pos, mem) if self.memory else self.priority(i, k, v, pos)
            if self.learned:  # tokens still in the window are not scored yet; the memory has read them all
                pi = pi.masked_fill(pos > T - 1 - self.window, 0.0)
            if self.memory:
                self.mem[i], self.scale[i] = mem[0]
        if T <= size:  # nothing is evicted yet
            y, lse = kernels.attention(q, k, v)
            keep = torch.arange(T, device=k.device).expand(k.shape[:3])
            if self.rule == "dynamic":
                pi = attention_received(self.policy, q, k, lse)
        # longer than the budget (static): the eviction-time mask, keep what the last query still sees
        else:
            y, e = masked_attention(q, k, v, pi, self.sinks, self.window, self.pool)
            # exactly `size` per head: sinks + window + pool
            seen = (pos < self.sinks) | (e > T - 1)
            keep = torch.sort(seen.byte(), dim=-1, descending=True, stable=True).indices[..., :size]
        n, D = keep.shape[-1], k.shape[-1]
        self.k[i, :, :, :n] = k.gather(2, keep[..., None].expand(-1, -1, -1, D))
        self.v[i, :, :, :, :n] = v.gather(2, keep[..., None].expand(-1, -1, -1, D)).transpose(-1, -2)
        self.pos[i, :, :, :n], self.score[i, :, :, :n] = pos[keep], pi.gather(2, keep)
        # kept in position order: the last m tokens, still in the window, fill the last m slots
        if self.learned:
            nw, a = min(T, self.window), torch.arange(n, device=k.device)
            self.ring[i][..., (a[-nw:] + T - n) % self.window] = a[-nw:]
        return y

    def step(self, i, q, k, v, pos):
        """Layer i's decoding step for the new token at position p = pos[0] (q (B, Hq, 1, D), k, v (B, Hkv, 1, D)):
        the eviction rule (README, How it works), every layer's decision made at layer 0 (the fast form of
        test_kvpop.py's _ref_evicting_run: a layer's decision reads only what the layers stored before this step)."""
        if i == 0:
            self.slots = self.decide(self.t)
        self.put(i, self.slots[i], k, v, pos)
        return self.attention(i, q, self.t)

    def decide(self, p):
        """Every layer's slot (L, B, Hkv, 1) for the newcomer p: token p - w, leaving the window, gets its static
        priority; then the next free slot while there is one, else the slot of the lowest (priority, position) in
        the eligible pool, positions sinks .. p - w (the sinks hold slots [0, sinks)), ties to the older token."""
        if self.learned and p >= self.window:
            j, r = self.leaving(p - self.window)
            self.score.scatter_(-1, j, r)
        if p < self.size:
            return self.pos.new_full((*self.pos.shape[:3], 1), p)
        s, P = self.sinks, self.pos[..., self.sinks :]
        # torch.where, not masked_fill (a copy, then a fill): one pass over each table
        low = torch.where(P > p - self.window, math.inf, self.score[..., s:])
        least = low.amin(-1, keepdim=True)  # ineligible tokens are at inf, above any eligible one
        return torch.where(low > least, 2**62, P).argmin(-1, keepdim=True) + s

    def leaving(self, t):
        """Every layer's slot j (L, B, Hkv, 1) of token t, which leaves the window now, and its priority r by the
        learned scorer, in one call for every layer: from the cached t and the tokens after it (kvpop-window), or
        from the memories (kvpop)."""
        j = self.ring[..., t % self.window, None]
        slots = self.ring[..., torch.arange(t, t + self.ahead + 1, device=j.device) % self.window]  # (L, B, H, 1 + n)
        D = self.k.shape[-1]
        k = self.k.gather(3, slots[..., None].expand(-1, -1, -1, -1, D))  # (L, B, H, 1 + n, D)
        v = self.v.gather(4, slots[..., None, :].expand(-1, -1, -1, D, -1)).mT  # values are stored transposed
        return j, self.policy.online(k, v, t, *([self.mem, self.scale] if self.memory else []))

    def put(self, i, slot, k, v, pos):
        """The newcomer's key, value, position and priority (a heuristic's; a learned scorer's comes later) replace
        the slot's."""
        K, V, P, sc, ring = self.layer[i]  # keys, values (transposed), positions, scores (B, Hkv, size), ring
        D, p = k.shape[-1], self.t
        K.scatter_(2, slot[..., None].expand(-1, -1, 1, D), k)
        V.scatter_(3, slot[..., None, :].expand(-1, -1, D, 1), v.transpose(-1, -2))
        P.scatter_(2, slot, p)
        if self.learned:
            ring[..., p % self.window] = slot[..., 0]
        sc.scatter_(2, slot, self.priority(i, k, v, pos) if self.rule == "static" and not self.learned else 0.0)
        if self.memory:  # kvpop: the memories take token p after the last layer (attention), every layer's at once
            self.pending.append((k, v))

    def attention(self, i, q, p):
        """Attention (B, Hq, 1, D) over the filled slots, in slot order, in the cache's dtype; h2o and tova score
        from it; after the last layer, the memories take token p."""
        K, V, _, sc, _ = self.layer[i]
        (B, H, _, D), G, n = K.shape, q.shape[1] // K.shape[1], min(p + 1, self.size)
        K, V = K[:, :, :n], V[..., :n]
        s = K @ q.view(B, H, G, D).transpose(-1, -2).to(K.dtype)  # (B, Hkv, n, G)
        # (B, Hkv, G, n): a softmax along memory, 4-6x faster
        a = (kernels.wide(s.mT) / math.sqrt(D)).softmax(-1)
        if self.policy == "h2o":  # accumulated attention (group mean)
            sc[..., :n] += a.mean(-2)
        elif self.policy == "tova":  # the current query's attention (group mean)
            sc[..., :n] = a.mean(-2)
        y = a.to(V.dtype) @ V.transpose(-1, -2)
        if self.memory and i == len(self.layer) - 1:
            self.policy.remember(self.mem, self.scale, *[torch.stack(x) for x in zip(*self.pending)], self.fold)
            self.pending.clear()
        return y.to(q.dtype).view(B, H * G, 1, D)  # (B, Hkv, G, D) -> (B, Hq, 1, D)


# ----------------------------------------------------------------------------------------------------------
# generation


def sample_next(logits, temperature, top_k, top_p):  # logits (B, V) fp32 -> (B,)
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        logits = logits.masked_fill(logits < logits.topk(min(top_k, logits.size(-1))).values[:, -1:], -math.inf)
    if top_p < 1.0:  # nucleus: drop the tail whose mass before it already exceeds top_p
        sorted_logits, order = logits.sort(-1, descending=True)
        p = sorted_logits.softmax(-1)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(p.cumsum(-1) - p > top_p, -math.inf))
    return torch.multinomial(logits.softmax(-1), 1)[:, 0]


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, stop=(), cache=None):
    """Stream (B,) next-token tensors. A KVCache sets the budget; default full. A sequence that produced a stop id
    keeps emitting it; generation ends when all have stopped."""
    cache = cache or KVCache(model, len(idx), idx.shape[1] + max_new_tokens)
    x, nxt, done = idx, idx[:, -1], torch.zeros(len(idx), dtype=torch.bool, device=idx.device)
    for _ in range(max_new_tokens):
        nxt = torch.where(done, nxt, sample_next(model(x, cache=cache)[:, -1].float(), temperature, top_k, top_p))
        yield nxt
        done |= torch.isin(nxt, idx.new_tensor(list(stop)))
        if done.all():
            return
        x = nxt[:, None]
