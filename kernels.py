"""KVpop kernels: causal attention under eviction times, the future-attention target, eviction times.

Each operation is first defined in its plain O(T^2) form, the T x T map the README's formulas describe (README, Method:
eviction times and Method: future attention). Then its fast form, one public function of the same signature: a Triton
kernel on CUDA tensors (or on any tensor when TRITON_INTERPRET=1 was set before import), a plain-torch path otherwise,
in tiles, never a T x T tensor. Sums run in fp32 (fp64 for fp64 inputs on the torch paths).
"""

# kernel annotations like `tl.constexpr` stay strings without triton
from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch paths need no triton
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 128  # torch-path tile: extra memory is O(T * BLOCK) per head
# finite start for running maxima, so a fully masked tile gives exp(-inf - NEG) = 0, not nan (the kernels spell it out:
# jit code reads no globals)
NEG = -1e30


def wide(x):  # fp32, or fp64 for an fp64 input: every sum of the attention and the scorers
    return x.to(torch.promote_types(x.dtype, torch.float32))


# ----------------------------------------------------------------------------------------------
# the definitions, plain O(T^2): what the fast forms below compute, and what bench.py kernels times them against


def plain_attention(q, k, v, evict_at=None, sinks=0):
    """Query i sees key t iff t <= i and (t < sinks or i < evict_at[t]): softmax over the visible keys -> (out, lse)."""
    T, G = q.shape[2], q.shape[1] // k.shape[1]
    s = q.float() @ k.float().repeat_interleave(G, 1).transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, Hq, T, T)
    i, t = torch.arange(T, device=q.device)[:, None], torch.arange(T, device=q.device)
    vis = t <= i
    if evict_at is not None:
        vis = vis & ((t < sinks) | (i < evict_at.repeat_interleave(G, 1)[:, :, None, :]))
    lse = s.masked_fill(~vis, -math.inf).logsumexp(-1)
    return (s - lse[..., None]).exp().masked_fill(~vis, 0) @ v.float().repeat_interleave(G, 1), lse


def plain_future_attention(q, k, lse, window, eps=1e-6, reduce="mean"):
    """r[t] = max over the group's query heads of log(eps + reduce_{d >= t + window} p[d, t]), p[d, t] = exp(q_d . k_t
    / sqrt(D) - lse[d]); an lse[d] raised by -log P[d] weighs query d by P[d] (the helpful target)."""
    (B, Hq, T, D), Hkv = q.shape, k.shape[1]
    p = (q.float() @ k.float().repeat_interleave(Hq // Hkv, 1).transpose(-1, -2) * D**-0.5 - lse[..., None]).exp()
    d, t = torch.arange(T, device=q.device)[:, None], torch.arange(T, device=q.device)
    n = T - window - t  # N_t: the queries that see t only past the window
    p = p.masked_fill(d < t + window, 0)  # (B, Hq, T queries, T keys)
    m = p.sum(2) / n.clamp(min=1) if reduce == "mean" else p.amax(2)
    return torch.log(eps + m).view(B, Hkv, -1, T).amax(2).masked_fill(n <= 0, -math.inf)


def plain_eviction_times(priority, sinks, window, pool):
    """e[t] = max(t + window, window + u_pool(t)), u_pool(t) the pool-th position u >= sinks with (pi[u], u) > (pi[t],
    t); T (never) for the sinks and where fewer than pool such u exist."""
    T = priority.shape[-1]
    u = torch.arange(T, device=priority.device)
    pt, pu = priority[..., :, None], priority[..., None, :]  # (B, H, t, 1), (B, H, 1, u)
    better = ((pu > pt) | ((pu == pt) & (u > u[:, None]))) & (u >= sinks)  # (B, H, T, T)
    hit = better.cumsum(-1) >= pool  # the pool-th better position reached at u
    uk = torch.where(hit.any(-1), hit.int().argmax(-1), T)
    e = torch.where(uk < T, (torch.maximum(u, uk) + window).clamp(max=T), T)
    return e.masked_fill(u < sinks, T)


# ----------------------------------------------------------------------------------------------
# the fast forms: one public function each, a Triton kernel or tiled torch


def _use_triton(x):
    return triton is not None and (x.is_cuda or INTERPRET)


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


def _check_qk(q, k, v=None):
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, H, T, D), got {tuple(q.shape)} and {tuple(k.shape)}")
    (B, Hq, T, D), Hkv = q.shape, k.shape[1]
    if k.shape != (B, Hkv, T, D) or Hkv == 0 or Hq % Hkv:
        raise ValueError(f"k must be (B, Hkv, T, D) with Hq % Hkv == 0, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    return B, Hq, Hkv, T, D


def _check_heads(x, name, shape, device):
    if tuple(x.shape) != shape or x.device != device:
        raise ValueError(f"{name} must have shape {shape} on {device}, got {tuple(x.shape)} on {x.device}")


# ----------------------------------------------------------------------------------------------
# attention


def attention(q, k, v, evict_at=None, sinks=0, scale=None):
    """Causal attention where key t is visible to query i iff t <= i and (t < sinks or i < evict_at[b, h, t]).

    q (B, Hq, T, D); k, v (B, Hkv, T, D); evict_at (B, Hkv, T) int or None (plain causal). Returns out (B, Hq, T, D) in
    q's dtype and lse (B, Hq, T) fp32, the natural-log softmax normaliser. Training (a gradient is needed): the torch
    path's autograd on CPU, FlexAttention's fused backward on CUDA.
    """
    B, Hq, Hkv, T, D = _check_qk(q, k, v)
    if evict_at is not None:
        _check_heads(evict_at, "evict_at", (B, Hkv, T), q.device)
    scale = D**-0.5 if scale is None else scale
    # the Triton kernel has no backward
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return (_attention_flex if q.is_cuda else _attention_torch)(q, k, v, evict_at, sinks, scale)
    if _use_triton(q):
        return _attention_triton(q, k, v, evict_at, sinks, scale)
    return _attention_torch(q, k, v, evict_at, sinks, scale)


def _attention_torch(q, k, v, evict_at, sinks, scale):
    (B, Hq, T, D), Hkv, dtype = q.shape, k.shape[1], q.dtype
    G = Hq // Hkv
    q = wide(q).view(B, Hkv, G, T, D)  # query heads h*G .. h*G+G-1 read KV head h
    k, v = wide(k)[:, :, None], wide(v)[:, :, None]  # (B, Hkv, 1, T, D)
    out = torch.empty(B, Hkv, G, T, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hkv, G, T, dtype=q.dtype, device=q.device)
    pos = torch.arange(T, device=q.device)
    # a key block is skipped for query blocks that start after all its tokens left
    if evict_at is not None:
        e = evict_at[:, :, None, None]  # (B, Hkv, 1, 1, T)
        last = [evict_at[..., j : j + BLOCK].max().item() for j in range(0, T, BLOCK)]
    for i in range(0, T, BLOCK):
        qi, I = (q[:, :, :, i : i + BLOCK] * scale, pos[i : i + BLOCK, None])  # (B, Hkv, G, M, D), (M, 1)
        m = torch.full(qi.shape[:-1], NEG, dtype=q.dtype, device=q.device)  # (B, Hkv, G, M)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(qi)
        for j in range(0, min(i + BLOCK, T), BLOCK):
            if evict_at is not None and j >= sinks and last[j // BLOCK] <= i:
                continue
            s = qi @ k[:, :, :, j : j + BLOCK].transpose(-1, -2)  # (B, Hkv, G, M, N)
            J = pos[j : j + BLOCK]
            if evict_at is not None:
                s = s.masked_fill(~((J <= I) & ((J < sinks) | (I < e[..., j : j + BLOCK]))), -math.inf)
            elif j + BLOCK > i:  # only the diagonal block has causally hidden keys
                s = s.masked_fill(J > I, -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            a = torch.exp(m - m_new)  # rescales what was summed under the old maximum
            l = l * a + p.sum(-1)
            acc = acc * a[..., None] + p @ v[:, :, :, j : j + BLOCK]
            m = m_new
        # a row that sees nothing is 0
        out[:, :, :, i : i + BLOCK] = acc / torch.where(l > 0, l, 1)[..., None]
        lse[:, :, :, i : i + BLOCK] = torch.where(l > 0, m + torch.log(l), -math.inf)
    return out.view(B, Hq, T, D).to(dtype), lse.view(B, Hq, T)


@_jit
def _attention_kernel(
    Q, K, V, E, O, L, T, D, G, sinks, scale, HAS_E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr
):
    # query block; b * Hq + query head, in int64 because offsets like bh * T * D pass 2**31 at long T
    i0, bh = tl.program_id(0) * BM, tl.program_id(1).to(tl.int64)
    kvh = bh // G  # = b * Hkv + KV head, since query heads h*G .. h*G+G-1 read KV head h
    i, d = i0 + tl.arange(0, BM), tl.arange(0, BD)
    qmask = (i[:, None] < T) & (d[None, :] < D)
    q = tl.load(Q + bh * T * D + i[:, None] * D + d[None, :], mask=qmask, other=0.0).to(tl.float32)
    m = tl.full([BM], -1e30, tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    for j0 in range(0, tl.minimum(i0 + BM, T), BN):
        j = j0 + tl.arange(0, BN)
        kvmask = (j[:, None] < T) & (d[None, :] < D)
        k = tl.load(K + kvh * T * D + j[:, None] * D + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
        v = tl.load(V + kvh * T * D + j[:, None] * D + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale  # (BM, BN)
        vis = (j[None, :] <= i[:, None]) & (j[None, :] < T)
        if HAS_E:
            e = tl.load(E + kvh * T + j, mask=j < T, other=0)
            vis = vis & ((j[None, :] < sinks) | (i[:, None] < e[None, :]))
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        a = tl.exp(m - m_new)
        l = l * a + tl.sum(p, 1)
        acc = acc * a[:, None] + tl.dot(p, v)
        m = m_new
    seen = l > 0  # a row that sees nothing gets out 0 and lse -inf
    l = tl.where(seen, l, 1.0)
    tl.store(O + bh * T * D + i[:, None] * D + d[None, :], (acc / l[:, None]).to(O.dtype.element_ty), mask=qmask)
    tl.store(L + bh * T + i, tl.where(seen, m + tl.log(l), float("-inf")), mask=i < T)


def _tiles(D):  # with num_stages=2 the fp32 D=128 tiles use 164 KB of shared memory on sm_90
    BD = max(16, triton.next_power_of_2(D))
    if BD > 256:
        raise ValueError(f"the Triton kernels support head_dim <= 256, got {D}")
    return (64 if BD <= 128 else 32), BD


def _attention_triton(q, k, v, evict_at, sinks, scale):
    (B, Hq, T, D), Hkv = q.shape, k.shape[1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, T, device=q.device)
    e = evict_at.contiguous() if evict_at is not None else q  # q stands in for the unused pointer
    B_, BD = _tiles(D)
    grid = (triton.cdiv(T, B_), B * Hq)
    args = (q, k, v, e, out, lse, T, D, Hq // Hkv, sinks, scale)
    _attention_kernel[grid](*args, HAS_E=evict_at is not None, BM=B_, BN=B_, BD=BD, num_stages=2)
    return out, lse


# FlexAttention, compiled once (eager it builds the T x T scores; on CPU it has no backward)
_flex = None


def _attention_flex(q, k, v, evict_at, sinks, scale):
    """Training on CUDA: PyTorch's FlexAttention, block-sparse from the same visibility rule, with its backward."""
    global _flex
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    (B, Hq, T, D), G = q.shape, q.shape[1] // k.shape[1]

    def visible(b, h, i, t):
        return (t <= i) if evict_at is None else (t <= i) & ((t < sinks) | (i < evict_at[b, h // G, t]))

    mask = create_block_mask(visible, B, Hq, T, T, device=q.device)
    if q.is_cuda and _flex is None:
        _flex = torch.compile(flex_attention)
    flex = _flex if q.is_cuda else flex_attention
    out, aux = flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=G > 1, return_aux=AuxRequest(lse=True))
    return out, aux.lse.float()


# ----------------------------------------------------------------------------------------------
# future attention


def future_attention(q, k, lse, window, eps=1e-6, scale=None, reduce="mean"):
    """Target r[b, h, t] = max over h's query heads of log(eps + reduce_{t+window <= d < T} p[d, t]), reduce the mean
    (the paper's) or the max over those queries.

    p[d, t] = exp(q_d . k_t * scale - lse[d]); q (B, Hq, T, D), k (B, Hkv, T, D), lse (B, Hq, T) from the forward pass.
    Returns (B, Hkv, T) fp32, -inf where t + window >= T (no query outside the window). Computed as a transposed
    attention in which keys play queries; memory O(B * H * T). README, Method: future attention.
    """
    B, Hq, Hkv, T, D = _check_qk(q, k)
    _check_heads(lse, "lse", (B, Hq, T), q.device)
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if reduce not in ("mean", "max"):
        raise ValueError(f"reduce must be mean or max, got {reduce!r}")
    scale = D**-0.5 if scale is None else scale
    if _use_triton(q):
        return _future_triton(q, k, lse, window, eps, scale, reduce)
    return _future_torch(q, k, lse, window, eps, scale, reduce)


def _future_torch(q, k, lse, window, eps, scale, reduce):
    (B, Hq, T, D), Hkv = q.shape, k.shape[1]
    G = Hq // Hkv
    q, lse = q.float().view(B, Hkv, G, T, D), lse.float().view(B, Hkv, G, T)
    k = k.float()[:, :, None] * scale  # (B, Hkv, 1, T, D)
    r = torch.full((B, Hkv, T), -math.inf, device=q.device)
    pos = torch.arange(T, device=q.device)
    for t in range(0, T - window, BLOCK):  # keys t >= T - window have no query beyond the window
        t1 = min(t + BLOCK, T - window)
        kt, I = k[:, :, :, t:t1], pos[t:t1, None]  # (B, Hkv, 1, N, D), (N, 1)
        m = torch.full((B, Hkv, G, t1 - t), NEG, device=q.device)
        l = torch.zeros_like(m)
        for d in range(t + window, T, BLOCK):
            # (B, Hkv, G, N, M)
            s = kt @ q[:, :, :, d : d + BLOCK].transpose(-1, -2) - lse[:, :, :, None, d : d + BLOCK]
            # only the first query block holds queries still inside some key's window
            if d < t1 - 1 + window:
                s = s.masked_fill(pos[d : d + BLOCK] < I + window, -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            if reduce == "mean":  # the running sum, rescaled to the new maximum
                l = l * torch.exp(m - m_new) + torch.exp(s - m_new[..., None]).sum(-1)
            m = m_new
        n = (T - window - pos[t:t1]).float()  # N_t >= 1 for every key in this block
        # log of the mean, or of the max
        log_p = m + torch.log(l) - torch.log(n) if reduce == "mean" else m
        r[:, :, t:t1] = torch.log(eps + torch.exp(log_p)).amax(2)
    return r


@_jit
def _future_kernel(
    Q, K, L, R, T, D, G, window, eps, scale, MAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr
):
    t0, kvh = tl.program_id(0) * BM, tl.program_id(1).to(tl.int64)  # key block, b * Hkv + KV head
    t, d = t0 + tl.arange(0, BM), tl.arange(0, BD)
    kmask = (t[:, None] < T) & (d[None, :] < D)
    k = tl.load(K + kvh * T * D + t[:, None] * D + d[None, :], mask=kmask, other=0.0).to(tl.float32) * scale
    n = (T - window - t).to(tl.float32)  # N_t: how many queries see key t only outside the window
    ok = n > 0  # the last `window` keys have none (and an empty sum, l = 0)
    best = tl.full([BM], float("-inf"), tl.float32)
    for g in range(0, G):
        bh = kvh * G + g
        m = tl.full([BM], -1e30, tl.float32)
        l = tl.zeros([BM], tl.float32)
        for d0 in range(t0 + window, T, BN):
            i = d0 + tl.arange(0, BN)
            qmask = (i[:, None] < T) & (d[None, :] < D)
            q = tl.load(Q + bh * T * D + i[:, None] * D + d[None, :], mask=qmask, other=0.0).to(tl.float32)
            lse = tl.load(L + bh * T + i, mask=i < T, other=0.0).to(tl.float32)
            s = tl.dot(k, tl.trans(q)) - lse[None, :]  # (BM, BN)
            s = tl.where((i[None, :] >= t[:, None] + window) & (i[None, :] < T), s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            l = l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
            m = m_new
        if MAX:  # the largest p[d, t]
            p = tl.exp(m)
        else:  # the mean of p[d, t]
            p = tl.exp(m + tl.log(tl.where(ok, l, 1.0)) - tl.log(tl.where(ok, n, 1.0)))
        best = tl.maximum(best, tl.log(eps + p))
    tl.store(R + kvh * T + t, tl.where(ok, best, float("-inf")), mask=t < T)


def _future_triton(q, k, lse, window, eps, scale, reduce):
    (B, Hq, T, D), Hkv = q.shape, k.shape[1]
    r = torch.empty(B, Hkv, T, device=q.device)
    B_, BD = _tiles(D)
    grid = (triton.cdiv(T, B_), B * Hkv)
    args = (q.contiguous(), k.contiguous(), lse.contiguous(), r, T, D, Hq // Hkv, window, eps, scale)
    _future_kernel[grid](*args, MAX=reduce == "max", BM=B_, BN=B_, BD=BD, num_stages=2)
    return r


# ----------------------------------------------------------------------------------------------
# eviction times


def eviction_times(priority, sinks, window, pool):
    """e[b, h, t]: the first query that no longer sees token t (README, Method: eviction times), T meaning never.

    With u_pool(t) the pool-th smallest position u >= sinks whose (priority[u], u) beats (priority[t], t): e[t] = min(T,
    max(t + window, window + u_pool(t))), T when fewer than pool such u exist or t < sinks. priority (B, Hkv, T) static
    per token; returns (B, Hkv, T) int64.
    """
    if priority.dim() != 3:
        raise ValueError(f"priority must be (B, Hkv, T), got shape {tuple(priority.shape)}")
    if window < 1 or sinks < 0 or pool < 0:
        raise ValueError(f"need window >= 1, sinks >= 0, pool >= 0; got window={window}, sinks={sinks}, pool={pool}")
    if priority.is_floating_point() and priority.isnan().any():
        raise ValueError("priority contains NaN; every token needs a comparable priority")
    if _use_triton(priority):
        return _evict_triton(priority, sinks, window, pool)
    return _evict_torch(priority, sinks, window, pool)


def _evict_torch(priority, sinks, window, pool):
    B, H, T = priority.shape
    dev, N = priority.device, B * H
    pos = torch.arange(T, device=dev)
    e = (pos + window).clamp(max=T).repeat(N, 1)  # (N, T); pool = 0 is the sliding window
    e[:, :sinks] = T
    if pool >= T - sinks:  # room for every eligible token: nobody is evicted
        e[:, sinks:] = T
    if pool == 0 or pool >= T - sinks:
        return e.view(B, H, T)
    # Visit order: decreasing (priority, t), sinks last. Sorting the reversed row stably puts the newer token first
    # among equal priorities; a second stable sort moves the (never eligible) sinks to the end.
    order = (T - 1) - priority.reshape(N, T).flip(1).sort(dim=1, descending=True, stable=True).indices
    order = order.gather(1, (order < sinks).to(torch.uint8).sort(dim=1, stable=True).indices)
    # Fenwick tree over positions (index u + 1), size P a power of two; upd[u] lists the cells that an insert of u
    # touches, padded with the unused cell 0 so that one scatter inserts a token in every head.
    P = 1 << max(T - 1, 1).bit_length()
    i, upd = pos + 1, []
    while len(upd) < P.bit_length():
        upd.append(torch.where(i <= P, i, 0))
        i = i + (i & -i)
    upd = torch.stack(upd, 1)  # (T, levels)
    tree = torch.zeros(N, P + 1, dtype=torch.long, device=dev)
    # Visits go C at a time (10x fewer Python steps): token j of a chunk sees the tree plus the chunk's tokens before
    # it, which binary lifting adds to each Fenwick cell it reads (cell nxt covers p+1..nxt).
    C, M = 64, T - sinks
    before = torch.ones(C, C, dtype=torch.bool, device=dev).tril(-1)  # [j, j2]: j2 visited before j
    for c in range(0, M, C):
        t = order[:, c : min(c + C, M)]  # (N, n)
        n, idx = t.shape[1], (t + 1)[:, None, :]
        # p: largest with prefix count < pool
        p, rem, bit = torch.zeros_like(t), torch.full_like(t, pool), P // 2
        while bit:
            nxt = p + bit
            inside = (idx > p[:, :, None]) & (idx <= nxt[:, :, None]) & before[:n, :n]  # (N, n, n)
            cnt = tree.gather(1, nxt) + inside.sum(-1)
            go = cnt < rem
            p, rem, bit = torch.where(go, nxt, p), rem - cnt * go, bit // 2
        # tokens visited before: fewer than pool means never evicted
        better = c + torch.arange(n, device=dev)
        e.scatter_(1, t, torch.where(better >= pool, (torch.maximum(t, p) + window).clamp(max=T), T))
        tree.scatter_add_(1, upd[t].view(N, -1), torch.ones(N, n * upd.shape[1], dtype=torch.long, device=dev))
    return e.view(B, H, T)


@_jit
def _evict_kernel(PR, E, T, sinks, window, pool, BT: tl.constexpr, BU: tl.constexpr):
    # Parallel form for the GPU: each token scans all positions u in order and counts those that beat it until the count
    # reaches pool. O(T^2) work but O(T) memory, and every token block runs independently.
    n = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    pt = tl.load(PR + n * T + t, mask=t < T, other=0.0)
    cnt = tl.zeros([BT], tl.int32)
    uk = tl.full([BT], T, tl.int32)  # T: fewer than pool better tokens
    for u0 in range(sinks, T, BU):
        u = u0 + tl.arange(0, BU)
        pu = tl.load(PR + n * T + u, mask=u < T, other=0.0)
        better = (pu[None, :] > pt[:, None]) | ((pu[None, :] == pt[:, None]) & (u[None, :] > t[:, None]))
        better = (better & (u[None, :] < T)).to(tl.int32)  # (BT, BU)
        run = cnt[:, None] + tl.cumsum(better, 1)
        # pool = 0 stops at u = sinks <= t
        uk = tl.minimum(uk, tl.min(tl.where(run >= pool, u[None, :], T), 1))
        cnt += tl.sum(better, 1)
    e = tl.where(uk < T, tl.minimum(tl.maximum(t, uk) + window, T), T)
    tl.store(E + n * T + t, tl.where(t < sinks, T, e).to(tl.int64), mask=t < T)


def _evict_triton(priority, sinks, window, pool):
    B, H, T = priority.shape
    e = torch.empty(B, H, T, dtype=torch.int64, device=priority.device)
    pr = priority.to(torch.float64).contiguous()  # exact for every float and for ints below 2**53
    _evict_kernel[(triton.cdiv(T, 64), B * H)](pr, e, T, sinks, window, pool, BT=64, BU=64)
    return e
