"""KVpop: a fixed-budget, evicting KV cache for Qwen3 (arXiv 2607.05061), the method in one file.

Read top to bottom (README, Method; comments cite its subsections as "README, Method: ..."): the budget -> policies and
eviction times -> targets -> learned scorers -> the evicting cache -> generation. The model is qwen3.py, the
teacher-forced evaluation tasks.py; files, tokenizer and flags have their own modules.
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
def dense_targets(model, idx, window, reduce="mean"):
    """One dense pass: every layer's cached (k, v) and its future-attention target r* (B, Hkv, T), reduce one of
    TARGETS over the queries past the window (README, Method: future attention): the oracle's priorities and the
    scorers' teacher. helpful needs the pass's logits: the targets are made after it."""
    seen = []

    def attn(i, q, k, v, pos):
        y, lse = kernels.attention(q, k, v)
        seen.append((q, k, v, lse))
        return y

    logits = model(idx, attn=attn, head=reduce == "helpful")
    lw = next_logp(logits, idx) if reduce == "helpful" else 0.0
    r = [kernels.future_attention(q, k, lse - lw, window, reduce=REDUCE[reduce]) for q, k, _, lse in seen]
    return [(k, v) for _, k, v, _ in seen], r


def oracle_policy(model, idx, window, reduce="mean"):  # pi = r*
    r = dense_targets(model, idx, window, reduce)[1]
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


class Scorer(nn.Module):
    """Learned static priorities pi[t] = r[t] + softplus(theta_h) * t per layer and KV head, from the cached key and
    value (README, Method: scorers). kvpop-mlp scores t on arrival. The delayed kinds score t when it leaves the
    window: kvpop-window by reading the cached tokens after t, kvpop (the paper's) from an mLSTM memory that has read
    them; the memory is charged as `charge` cache entries."""

    # the parallel forms' chunk of c tokens: O(c (M + c)) memory a chunk (all chunks' under autograd)
    chunk = 128
    # kvpop-window: reads, their width, the most tokens after t they see (ours)
    reads, d_key, ahead = 2, 16, 32

    def __init__(self, config, kind="kvpop-window", window=256, d_mem=128, d_hidden=128, gamma=0.002):
        super().__init__()
        if kind not in SCORERS or not all(type(n) is int and n >= 1 for n in (window, d_mem, d_hidden)):
            raise ValueError(f"scorer kind {kind!r} (use {' or '.join(SCORERS)}), window, d_mem, d_hidden >= 1")
        L, H, D = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        self.kind, self.window, self.d_mem, self.d_hidden, self.meta = (kind, window, d_mem, d_hidden, {})
        self.shape = dict(num_hidden_layers=L, num_key_value_heads=H, head_dim=D)
        X, M = 2 * D, d_mem
        # parameters of shape (L, H, ...)
        w = lambda *s: nn.Parameter(torch.randn(L, H, *s) / math.sqrt(s[0]))
        z = lambda *s, c=0.0: nn.Parameter(torch.full((L, H, *s), float(c)))
        self.theta = z(c=math.log(math.expm1(gamma)))  # softplus(theta) = gamma at the start
        if kind == "kvpop-mlp":
            self.w1, self.b1, self.w2, self.b2 = w(X, d_hidden), z(d_hidden), w(d_hidden), z()
        # A reads over t+1..t+n, n = min(w, ahead), each by content and by offset
        elif kind == "kvpop-window":
            A, d, n = self.reads, self.d_key, min(window, self.ahead)
            # query (from x[t]), key and value
            self.wq, self.wk, self.wv = w(X, A * d), w(X, A * d), w(X, A * d)
            # offset bias -slope (o - 1): read 0 starts on the next token, read 1 evenly
            slope = torch.tensor([1.0, 0.0])[:A, None]
            self.bo = nn.Parameter((-slope * torch.arange(n)).expand(L, H, A, n).clone())
            self.w1, self.b1, self.w2, self.b2 = (w(X + A * d, d_hidden), z(d_hidden), w(d_hidden), z())
        else:
            # memory key, value and read projections
            self.wk, self.wv, self.wr = w(X, M), w(X, M), w(X, M)
            self.wi, self.bi, self.wf = w(X), z(), w(X)  # input and forget gate pre-activations
            # forget gate near 1 - 1/window: the memory spans the window
            self.bf = z(c=math.log(window))
            # read-out of norm(h), linear skip from x, bias
            self.wo, self.ws, self.b = w(M), w(X), z()

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

    def recency(self, i, t):  # gamma_h t = softplus(theta_h) t of layer i (every layer's: i = slice(None))
        return F.softplus(self.theta[i])[..., None] * t

    # kvpop-window: the delayed scorer that reads its window from the cache

    def look(self, i, x, xw, offsets):
        """kvpop-window: scores (B, H, n) of tokens with features x (B, H, n, X) from the features xw (B, H, m, X) of
        tokens after them, offsets (n, m) apart (visible: 1..min(w, ahead)). Read a: softmax over the visible o of
        (W_q x)_a . (W_k xw)_a / sqrt(d) + b_a[o] pools z_a = sum_o softmax * (W_v xw)_a; then r = w_2 . silu(W_1 [x;
        z_1 .. z_A] + b_1) + b_2."""
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

    # r = w_2 . silu(W_1 [x; z] + b_1) + b_2: x (B, H, n, X), z (B, H, n, A d) -> (B, H, n)
    def head(self, i, x, z):
        h = F.silu(torch.cat([x, z], -1) @ self.w1[i] + self.b1[i][:, None])  # (B, H, n, d_hidden)
        return (h * self.w2[i][:, None]).sum(-1) + self.b2[i][:, None]

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
        1 + n, D) of t and of the n tokens after it, in position order. W_k and W_v are folded into the read, u_a =
        W_k,a (W_q x)_a / sqrt(d) and z_a = W_v,a^T (sum_o softmax * xw), so the n tokens are never projected."""
        x = self.features(k, v)
        xt, xw = x[..., :1, :], x[..., 1:, :]  # (B, H, 1, X), (B, H, n, X)
        A, d = self.reads, self.d_key
        q = (xt @ self.wq[i]).view(*xt.shape[:2], A, d)  # (B, H, A, d)
        # (B, H, A, X)
        u = torch.einsum("bhad,hxad->bhax", q, self.wk[i].unflatten(-1, (A, d))) / math.sqrt(d)
        a = (u @ xw.mT + self.bo[i]).softmax(-1)  # (B, H, A, n): offsets 1..n
        # (B, H, A, d)
        z = torch.einsum("bhax,hxad->bhad", a @ xw, self.wv[i].unflatten(-1, (A, d)))
        return self.head(i, xt, z.flatten(-2)[:, :, None]) + self.recency(i, t)

    # kvpop: the mLSTM memory, parallel form (training, the masked pass, prefill)

    def parallel(self, i, x):
        """kvpop, decay-masked form over a whole sequence x (B, H, T, 2D) -> scores (B, H, T) and the final state.
        Token t is read at q = min(t + w, T - 1) (t > T - 1 - w never leaves the window here) as C_q u = sum_{j <= q}
        exp(F_q - F_j + log i_j) v'_j (k'_j . u), F = cumsum log f, under one max per row as the recurrent form's
        stabiliser. Chunk by chunk over q: the reads in a chunk add the state S = [C; n] carried from the tokens
        before it, and S then moves to the chunk's last token. Only x is made at full length."""
        (B, H, T, _), M, W, c = x.shape, self.d_mem, self.window, self.chunk
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
        S = x.new_zeros(B, H, M + 1, M)
        m = x.new_full((B, H), -math.inf)  # its log-scale
        out = []
        for c0, r0, r1, xc, lc in zip(starts, reads, reads[1:], xs, li.split(c, -1)):
            c1 = c0 + lc.shape[-1]  # the chunk's tokens: c0 .. c1 - 1
            # the chunk's memory keys k' and values [v'; 1]; the read vectors u of the tokens read in it
            kc = xc @ self.wk[i] / math.sqrt(M)  # (B, H, c, M)
            vc = F.pad(xc @ self.wv[i], (0, 1), value=1.0)  # (B, H, c, M + 1)
            xr = x[..., r0:r1, :]  # (B, H, R, 2D)
            t = torch.arange(r0, r1, device=x.device)
            uc = xr @ self.wr[i]  # (B, H, R, M)
            # the rows: each read at q, then the chunk's last token (where S moves to); as indices into Fc
            q = torch.cat([(t + W).clamp(max=T - 1), t.new_tensor([c1 - 1])]) + 1
            # log weight of the chunk's token j in row q: F_q - F_j + log i_j for j <= q, else -inf (B, H, R + 1, c)
            j = torch.arange(c0 + 1, c1 + 1, device=x.device)
            logw = (Fc[..., q, None] - Fc[..., None, c0 + 1 : c1 + 1]).to(x.dtype) + lc[..., None, :]
            logw = logw.masked_fill(j > q[:, None], -math.inf)
            # the carried state's log-scale in row q; one max per row over both
            lo = m[..., None, None] + (Fc[..., q] - Fc[..., c0, None]).to(x.dtype)[..., None]
            mq = torch.maximum(logw.amax(-1, keepdim=True), lo)
            e, g = (logw - mq).exp(), (lo - mq).exp()
            # the reads [C u; n . u]: the chunk's tokens, decay-masked, plus the carried state (none before chunk 0)
            y = (e[..., :-1, :] * (uc @ kc.transpose(-1, -2))) @ vc  # (B, H, R, M + 1)
            if c0:
                y = y + g[..., :-1, :] * (uc @ S.transpose(-1, -2))
            # h = C u / max(|n . u|, 1), stabilised; r = w_o . rms(h) + w_s . x
            h = y[..., :M] / torch.maximum(y[..., M:].abs(), (-mq[..., :-1, :]).exp())
            out.append((rms(h) * self.wo[i][:, None]).sum(-1) + (xr * self.ws[i][:, None]).sum(-1))
            # S moves to the chunk's last token
            S = g[..., -1:, :] * S + (vc * e[..., -1, :, None]).transpose(-1, -2) @ kc
            m = mq[..., -1, 0]
        return torch.cat(out, -1) + self.b[i][:, None], (S, m)

    # kvpop: recurrent form (decoding), folded for speed; the tests check it against the plain equations

    @torch.no_grad()
    def folded(self):
        """kvpop's decoding weights, made once per cache, with the RMS scale of the raw x = [k; v] folded in (rms(x)
        = sqrt(2D) x rsqrt(|x|^2 + 2D eps)): z = W x rsqrt(|x|^2 + 2D eps) + b is [k'; v'; 1; log i; the forget
        gate's pre-activation; 0] in one product. Per layer: W (H, 2M + 4, 2D), b (H, 1, 2M + 4) and sqrt(M) w_o (H,
        1, M); then W_r^T (L, H, M, 2D), every layer's read projection, for prepare_read."""
        X, M = 2 * self.shape["head_dim"], self.d_mem
        zero = torch.zeros_like(self.wi[..., None])  # (L, H, 2D, 1)
        w = torch.cat([self.wk / math.sqrt(M), self.wv, zero, self.wi[..., None], self.wf[..., None], zero], -1)
        w = w.transpose(-1, -2) * math.sqrt(X)  # (L, H, 2M + 4, 2D)
        b = torch.stack([torch.ones_like(self.bi), self.bi, self.bf, torch.zeros_like(self.bi)], -1)
        b = F.pad(b, (2 * M, 0))  # (L, H, 2M + 4): no bias on k', v'
        per_layer = zip(w.contiguous(), b[:, :, None], self.wo[:, :, None] * math.sqrt(M))
        return list(per_layer), self.wr.mT.contiguous()

    def step(self, i, m, k, v, fold):
        """kvpop's recurrent form, for one token k, v (B, H, 1, D) and the memory's log-scale m (B, H, 1, 1): the
        pending update z = [k'; v'; 1; log i; log f + m; 0] and e = [g, f, exp(-m')] = exp([log i, log f + m, 0] -
        m'), m' = max(log f + m, log i): xLSTM's stabiliser. `read` uses it at once, `settle` after the last layer."""
        w, b, _ = fold[0][i]
        x = torch.cat([k, v], -1).to(w.dtype)  # (B, H, 1, 2D)
        s = torch.rsqrt((x * x).sum(-1, keepdim=True) + x.shape[-1] * EPS)  # rms(x) = sqrt(2D) x s
        z = torch.addcmul(b, (w @ x.mT).mT, s)  # (B, H, 1, 2M + 4)
        # views into z: log i, the forget gate's pre-activation
        li, lf = z[..., -3:-2], z[..., -2:-1]
        # in place, z[..., -3:] becomes [log i, log f + m, 0], log f = -softplus(-x) (F.logsigmoid wakes a thread)
        torch.sub(m, F.softplus(-lf), out=lf)
        m_new = torch.maximum(li, lf)  # (amax over the slice costs 2-3x more in a step)
        e = (z[..., -3:] - m_new).exp()  # [g, f, exp(-m')]
        return z, e, m_new

    def prepare_read(self, S, k, v, t, fold):
        """What reading the token at t (k, v (L, B, H, 1, D)) of every layer needs from the states S as they are, one
        pass for all: u = W_r x, S u = [C u, n . u] and w_s . x + b + softplus(theta) t, lists per layer."""
        x = self.features(k, v)  # (L, B, H, 1, 2D)
        u = (fold[1][:, None] @ x.mT).mT  # (L, B, H, 1, M)
        skip = (x[..., 0, :] * self.ws[:, None]).sum(-1) + self.b[:, None] + F.softplus(self.theta)[:, None] * t
        # u S^T: 6-7x faster than S u on CPU
        return [y.unbind(0) for y in (u, u @ S.mT, skip[..., None])]

    def read(self, i, upd, u, Su, skip, fold):
        """kvpop: the priority (B, H, 1) of layer i's leaving token from prepare_read's (u, S u, skip) and the pending
        update, without forming the new state: y = S' u = f S u + g [v'; 1] (k' . u), d = max(|n' . u|, exp(-m')), r
        = skip + w_o . rms(y / d), computed as sqrt(M) w_o . y rsqrt(|y|^2 + M eps d^2): no division, no mean."""
        (z, e, _), M = upd, self.d_mem
        g, f = e[..., :1], e[..., 1:2]  # the input and forget factors, stabilised
        k1, v1 = z[..., :M], z[..., M : 2 * M + 1]  # k' and [v'; 1]
        y = torch.addcmul(f * Su, v1, g * (k1 * u).sum(-1, keepdim=True))  # (B, H, 1, M + 1)
        d = torch.maximum(y[..., M:].abs(), e[..., 2:])  # (B, H, 1, 1)
        y = y[..., :M]
        s = torch.rsqrt(torch.addcmul((y * y).sum(-1, keepdim=True), d, d, value=M * EPS))
        return torch.addcmul(skip, (y * fold[0][i][2]).sum(-1), s[..., 0])

    @staticmethod
    def settle(S, m, upd):
        """In place, batched over the leading dims (a layer's heads, or every layer's): S = f S + g [v', 1] k'^T."""
        (z, e, m_new), M = upd, S.shape[-1]
        S.mul_(e[..., 1:2]).addcmul_(z[..., M : 2 * M + 1].mT, e[..., :1] * z[..., :M])
        m.copy_(m_new.view(m.shape))

    def save_pretrained(self, folder):
        """scorer.safetensors + scorer.json (every setting needed to rebuild it, and what it was trained for)."""
        os.makedirs(folder, exist_ok=True)
        save_safetensors(self.state_dict(), os.path.join(folder, "scorer.safetensors"))
        d = dict(kind=self.kind, window=self.window, d_mem=self.d_mem, d_hidden=self.d_hidden, **self.shape)
        write_json(d | dict(trained=self.meta), os.path.join(folder, "scorer.json"))

    @classmethod
    def from_pretrained(cls, folder):
        f, hint = os.path.join(folder, "scorer.json"), "pass the --out_dir of a train.py run"
        if not os.path.isfile(f):
            raise FileNotFoundError(f"{folder} is not a scorer folder (no scorer.json); {hint}")
        d, sd = read_json(f), read_safetensors(os.path.join(folder, "scorer.safetensors"))
        try:
            shape = {k: d[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")}
            s = cls(Qwen3Config(**shape), d["kind"], d["window"], d["d_mem"], d["d_hidden"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{f}: missing or bad field ({e})") from None
        if {k: v.shape for k, v in sd.items()} != {k: v.shape for k, v in s.state_dict().items()}:
            raise ValueError(f"{folder}: scorer.safetensors does not hold the tensors scorer.json describes")
        s.load_state_dict({k: v.float() for k, v in sd.items()})
        s.meta = d.get("trained", {})
        return s.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------------------
# the evicting cache (README, How it works)


class KVCache:
    """At most `size` KV entries per layer and KV head, in buffers allocated once: keys (L, B, Hkv, size, D) and
    values transposed, (L, B, Hkv, D, size), so that both products of a decoding step read their matrix row by row,
    the matrix-vector layout that streams memory fastest. Filled slots are always [0, min(t, size)): an evicted slot
    goes to the newcomer, in place. pos[slot]: the token's position; score[slot]: its priority (0 until a delayed
    scorer reads it), or h2o/tova's. A delayed scorer's state sits beside them."""

    def __init__(self, model, batch, size, policy="full", sinks=4, window=256):
        c, p = model.config, next(model.parameters())
        shape = (c.num_hidden_layers, batch, c.num_key_value_heads, size)
        self.k = torch.zeros(*shape, c.head_dim, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(*shape[:3], c.head_dim, size, dtype=p.dtype, device=p.device)
        self.pos = torch.full(shape, -1, dtype=torch.long, device=p.device)
        # priorities in a learned scorer's dtype (fp64 beside an fp64 model), else fp32
        sdt = policy.theta.dtype if isinstance(policy, Scorer) else torch.float32
        self.score = torch.zeros(shape, dtype=sdt, device=p.device)
        # per-layer views, made once: a step indexes less
        self.layer = list(zip(self.k, self.v, self.pos, self.score))
        self.size, self.policy, self.sinks, self.window, self.t = size, policy, sinks, window, 0
        self.pool, (self.rule, self.priority) = size - sinks - window, resolve(policy)
        if isinstance(policy, Scorer):
            policy.check(c, window)
        # scores t as it leaves the window
        self.delayed = isinstance(policy, Scorer) and policy.kind in DELAYED
        self.memory = self.delayed and policy.kind == "kvpop"  # the mLSTM's state, beside the cache
        if self.delayed:  # the slot of t at t % w
            self.ring = torch.zeros(*shape[:3], window, dtype=torch.long, device=p.device)
        if self.memory:  # the memory of every layer and head: S = [C; n] (M + 1, M), log-scale m
            self.S = torch.zeros(*shape[:3], policy.d_mem + 1, policy.d_mem, dtype=sdt, device=p.device)
            self.m = torch.full(shape[:3], -math.inf, dtype=sdt, device=p.device)
            # (B, Hkv, 1, 1) views, as the recurrent step takes m
            self.ms = [m[..., None, None] for m in self.m]
            # this step's updates; prepare_read's result and its step
            self.pending, self.prepared = [], (-1, None)
            self.fold = policy.folded()

    def nbytes(self):  # keys, values and a delayed scorer's state
        state = sum(x.numel() * x.element_size() for x in (self.S, self.m)) if self.memory else 0
        return 2 * self.k.numel() * self.k.element_size() + state

    # can T > 1 tokens come in one pass? (else the model feeds them one at a time)
    def whole(self, T):
        return self.t == 0 and (T <= self.size or self.rule == "static")

    @torch.no_grad()  # inference only: a learned scorer's priorities carry no graph
    # layer i: q (B, Hq, T, D), new k, v (B, Hkv, T, D) at positions pos
    def attend(self, i, q, k, v, pos):
        return self.prefill(i, q, k, v, pos) if k.shape[2] > 1 else self.step(i, q, k, v, pos, self.t)

    def prefill(self, i, q, k, v, pos):
        """An empty cache takes a whole prompt at once and ends exactly as if fed token by token."""
        T, size = k.shape[2], self.size
        pi = torch.zeros(k.shape[:3], device=k.device)
        # tokens still in the window are not scored yet; the memory has read them all
        if self.delayed:
            mem = []
            pi = self.policy(i, k, v, pos, mem).masked_fill(pos > T - 1 - self.window, 0.0)
            if self.memory:
                self.S[i], self.m[i] = mem[0]
        elif self.rule == "static":
            pi = self.priority(i, k, v, pos)
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
        if self.delayed:
            nw, a = min(T, self.window), torch.arange(n, device=k.device)
            self.ring[i][..., (a[-nw:] + T - n) % self.window] = a[-nw:]
        return y

    # token t's slot (B, Hkv, 1) and what the scorer's read of it needs, lists over the layers
    def prepare_read(self, t):
        j = self.ring[..., t % self.window, None]  # (L, B, Hkv, 1): t is still in the window
        r, shape = ((torch.arange(j.numel(), device=j.device), j.reshape(-1)), (*j.shape, self.k.shape[-1]))
        k, v = self.k.flatten(0, 2)[r].view(shape), self.v.flatten(0, 2)[r[0], :, r[1]].view(shape)
        return [j.unbind(0), *self.policy.prepare_read(self.S, k, v, t, self.fold)]

    def window_kv(self, i, k, v, p):
        """Layer i's keys and values (B, Hkv, 1 + n, D) of token t = p - w and of the n tokens after it (n = w: the
        last is the new token p, not cached yet): from the cache, whose ring has the window's slots."""
        K, V, D, n = *self.layer[i][:2], k.shape[-1], self.policy.bo.shape[-1]
        t = p - self.window
        # cached: t .. t + n, or .. p - 1
        pos = torch.arange(t, min(t + n, p - 1) + 1, device=k.device)
        slots = self.ring[i][..., pos % self.window]  # (B, Hkv, 1 + n or n)
        kw = K.gather(2, slots[..., None].expand(-1, -1, -1, D))
        # values are stored transposed
        vw = V.gather(3, slots[:, :, None, :].expand(-1, -1, D, -1)).mT
        return (torch.cat([kw, k], 2), torch.cat([vw, v], 2)) if t + n == p else (kw, vw)

    def victims(self, p):
        """Per layer of a full cache: the slot (L, B, Hkv, 1) of the lowest (score, position) in the pool
        s <= t <= p - w (the sinks hold slots [0, s)), and that score. A delayed scorer's p - w is read later."""
        s, P = self.sinks, self.pos[..., self.sinks :]
        # torch.where, not masked_fill (a copy, then a fill): one pass over each table (8.1 -> 4.8 ms a step at 32k)
        low = torch.where(P > p - self.window - int(self.delayed), math.inf, self.score[..., s:])
        least = low.amin(-1, keepdim=True)  # ineligible tokens are at inf, above any eligible one
        return (torch.where(low > least, 2**62, P).argmin(-1, keepdim=True) + s).unbind(0), least.unbind(0)

    def step(self, i, q, k, v, pos, p):
        """Layer i's decoding step for the new token at position p (q (B, Hq, 1, D), k, v (B, Hkv, 1, D), pos = [p]),
        the eviction rule (README, How it works)."""
        # a delayed scorer scores token p - w as it leaves the window: j its slot, r its priority
        j, r = self.leaving(i, k, v, p)
        # the newcomer takes the next free slot (B, Hkv, 1) while there is one
        if p < self.size:
            slot = self.pos.new_full(k.shape[:3], p)
        # else the slot of the lowest (priority, position) in the eligible pool: slots past the sinks, positions up to
        # p - w; every layer's at once at layer 0 (a layer's scores change only at that layer), ties to the older token
        else:
            if i == 0:
                self.low = self.victims(p)
            slot, least = self.low[0][i], self.low[1][i]
            # token p - w, scored only now, goes if it scored below the rest
            if r is not None:
                slot = torch.where(r < least, j, slot)
        # the newcomer's key, value, position and priority (a delayed scorer's comes later) replace the slot's
        self.put(i, slot, k, v, pos, p)
        return self.attention(i, q, p)

    def leaving(self, i, k, v, p):
        """A delayed scorer's priority r (B, Hkv, 1) of token p - w, which leaves the window now, and its slot j,
        both written into the cache; (None, None) for other policies and before p = w."""
        j = r = None
        if self.memory:  # kvpop: the memory reads token p, then token p - w is read from it
            upd = self.policy.step(i, self.ms[i], k, v, self.fold)
            if p >= self.window:
                if self.prepared[0] != p:  # from the states as they are, every layer's at once
                    self.prepared = p, self.prepare_read(p - self.window)
                j, *rd = [x[i] for x in self.prepared[1]]
                r = self.policy.read(i, upd, *rd, self.fold)
            # the memories take token p after the last layer (attention), every layer's at once
            self.pending.append(upd)
        elif self.delayed and p >= self.window:  # kvpop-window: token p - w reads the w tokens after it
            j = self.ring[i][..., p % self.window, None]
            r = self.policy.look_online(i, *self.window_kv(i, k, v, p), p - self.window)
        if r is not None:
            self.score[i].scatter_(2, j, r)
        return j, r

    def put(self, i, slot, k, v, pos, p):
        K, V, P, sc = self.layer[i]  # keys, values (transposed), positions and scores (B, Hkv, size)
        D = k.shape[-1]
        K.scatter_(2, slot[..., None].expand(-1, -1, 1, D), k)
        V.scatter_(3, slot[..., None, :].expand(-1, -1, D, 1), v.transpose(-1, -2))
        P.scatter_(2, slot, p)
        if self.delayed:
            self.ring[i, ..., p % self.window] = slot[..., 0]
        sc.scatter_(2, slot, self.priority(i, k, v, pos) if self.rule == "static" and not self.delayed else 0.0)

    def attention(self, i, q, p):
        """Attention (B, Hq, 1, D) over the filled slots, in slot order, in the cache's dtype; h2o and tova score
        from it; after the last layer, the memories take token p."""
        K, V, _, sc = self.layer[i]
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
            Scorer.settle(self.S, self.m, [torch.stack(x) for x in zip(*self.pending)])
            self.pending.clear()
            # and the next step's read is prepared now, while the states are in cache
            if p + 1 >= self.window:
                self.prepared = p + 1, self.prepare_read(p + 1 - self.window)
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
