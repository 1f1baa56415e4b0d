"""KVpop kernels: causal attention under eviction times, the future-attention target, eviction
times, the attention a token receives in its window, the boundary.
Each operation is first defined in its plain O(T^2) form, the T x T map the README's formulas
describe (README, Method: eviction times and Method: future attention). Then its fast form, one
public function of the same signature: in torch, in tiles, never a T x T tensor; on a GPU (or on any
tensor when TRITON_INTERPRET=1 was set before import), support/gpus.py's Triton kernel. Sums run in
fp32 (fp64 for fp64 inputs on the torch paths). With PLAIN set (--plain), each public function runs
its plain form instead.

"""

import heapq
import math

import torch

from support import gpus

BLOCK = 128  # torch-path tile: extra memory is O(T * BLOCK) per head
# finite start for running maxima: a fully masked tile gives exp(-inf - NEG) = 0, not nan (jit
# kernels spell it out)
NEG = -1e30
PLAIN = False  # True (--plain): every public function below runs its plain form, the definition


def wide(x):  # fp32, or fp64 for an fp64 input: every sum of the attention and the scorers
    return x.to(torch.promote_types(x.dtype, torch.float32))


# ------ the definitions, plain O(T^2): what the fast forms below compute and bench.py kernels times
def plain_attention(q, k, v, evict_at=None, sinks=0, scale=None):
    """Query i sees key t iff t <= i and (t < sinks or i < evict_at[t]): softmax over the visible
    keys, scores scaled by 1/sqrt(D) unless `scale` -> (out, lse)."""
    T, group = q.shape[2], q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keys = k.float().repeat_interleave(group, 1)  # (B, Hq, T, D)
    scores = q.float() @ keys.transpose(-1, -2) * scale  # (B, Hq, T, T)
    t = torch.arange(T, device=q.device)  # keys
    i = t[:, None]  # queries
    visible = t <= i
    if evict_at is not None:
        leave = evict_at.repeat_interleave(group, 1)[:, :, None, :]  # (B, Hq, 1, T)
        visible = visible & ((t < sinks) | (i < leave))
    lse = scores.masked_fill(~visible, -math.inf).logsumexp(-1)
    weights = (scores - lse[..., None]).exp().masked_fill(~visible, 0)
    return weights @ v.float().repeat_interleave(group, 1), lse


def plain_future_attention(q, k, lse, window, eps=1e-6, reduce="mean"):
    """r[t] = max over the group's query heads of log(eps + reduce_{d >= t + window} p[d, t]), p[d,
    t] = exp(q_d . k_t / sqrt(D) - lse[d]); an lse[d] raised by -log P[d] weighs query d by P[d]
    (the helpful target)."""
    (batch, heads, T, D), kv_heads = q.shape, k.shape[1]
    keys = k.float().repeat_interleave(heads // kv_heads, 1)  # (B, Hq, T, D)
    probs = (q.float() @ keys.transpose(-1, -2) * D**-0.5 - lse[..., None]).exp()
    t = torch.arange(T, device=q.device)  # keys
    d = t[:, None]  # queries
    n = T - window - t  # N_t: the queries that see t only past the window
    probs = probs.masked_fill(d < t + window, 0)  # (B, Hq, T queries, T keys)
    reduced = probs.sum(2) / n.clamp(min=1) if reduce == "mean" else probs.amax(2)
    target = torch.log(eps + reduced).view(batch, kv_heads, -1, T).amax(2)  # the group's max
    return target.masked_fill(n <= 0, -math.inf)


def plain_eviction_times(priority, sinks, window, pool):
    """e[t] = max(t + window, window + u_pool(t)), u_pool(t) the pool-th position u >= sinks with
    (pi[u], u) > (pi[t], t); T (never) for the sinks and where fewer than pool such u exist."""
    T = priority.shape[-1]
    u = torch.arange(T, device=priority.device)
    pi_t = priority[..., :, None]  # (B, H, t, 1)
    pi_u = priority[..., None, :]  # (B, H, 1, u)
    better = (pi_u > pi_t) | ((pi_u == pi_t) & (u > u[:, None]))
    better = better & (u >= sinks)  # (B, H, T, T)
    hit = better.cumsum(-1) >= pool  # the pool-th better position reached at u
    u_pool = torch.where(hit.any(-1), hit.int().argmax(-1), T)
    leave = (torch.maximum(u, u_pool) + window).clamp(max=T)
    e = torch.where(u_pool < T, leave, T)
    return e.masked_fill(u < sinks, T)


def plain_boundary(pi, e, q, budget):
    """At each query q (Q,), whether the teacher (priorities pi, eviction times e) keeps t_new = q -
    window (B, H, Q), and the cutoff t_bnd: its pool-th best eligible token, or the best dropped one
    when that is t_new."""
    T, (sinks, window, _) = pi.shape[-1], budget
    u = torch.arange(T, device=pi.device)
    t_new = q - window
    # each token's place in the order of (pi, t)
    ranked = pi.sort(stable=True).indices
    order = torch.empty_like(e)
    order.scatter_(-1, ranked, u.expand_as(e))
    # t_new still visible at q
    t_new_heads = t_new.expand(*e.shape[:2], -1)
    keep = e.gather(-1, t_new_heads) > q
    eligible = (u >= sinks) & (u <= t_new[:, None])  # (Q, T)
    kept = eligible & (e[..., None, :] > q[:, None])  # (B, H, Q, T): exactly the pool
    order = order[..., None, :]
    worst = torch.where(kept, order, T).argmin(-1)
    best_dropped = torch.where(eligible & ~kept, order, -1).argmax(-1)
    return keep, torch.where(worst == t_new, best_dropped, worst)


def plain_window_received(q, k, window):
    """a[t] = max over the group's query heads and d = t .. t + w - 1 of softmax_{u in (d - w,
    d]}(q_d . k_u / sqrt(D))[t]."""
    (batch, heads, T, D), kv_heads = q.shape, k.shape[1]
    keys = wide(k).repeat_interleave(heads // kv_heads, 1)  # (B, Hq, T, D)
    scores = wide(q) @ keys.mT * D**-0.5  # (B, Hq, T queries, T keys)
    t = torch.arange(T, device=q.device)  # keys
    d = t[:, None]  # queries
    inside = (t <= d) & (t > d - window)
    probs = scores.masked_fill(~inside, -math.inf).softmax(-1)
    return probs.amax(2).view(batch, kv_heads, -1, T).amax(2)


# ------------------ the fast forms: one public function each, tiled torch or a Triton kernel (gpus)
def _check_qk(q, k, v=None):
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, H, T, D), got {tuple(q.shape)} and {tuple(k.shape)}")
    (batch, heads, T, D), kv_heads = q.shape, k.shape[1]
    if k.shape != (batch, kv_heads, T, D) or kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"k must be (B, Hkv, T, D) with Hq % Hkv == 0, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")


def _check_heads(x, name, shape, device):
    if tuple(x.shape) != shape or x.device != device:
        raise ValueError(f"{name} must have shape {shape} on {device}, got {tuple(x.shape)} on {x.device}")


# ---------------------------------------------------------------------------------------- attention
def attention(q, k, v, evict_at=None, sinks=0, scale=None):
    """Causal attention where key t is visible to query i iff t <= i and (t < sinks or i <
    evict_at[b, h, t]).

    q (B, Hq, T, D); k, v (B, Hkv, T, D); evict_at (B, Hkv, T) int or None (plain causal). Returns
    out (B, Hq, T, D) in q's dtype and lse (B, Hq, T) fp32, the natural-log softmax normaliser.
    Training (a gradient is needed): the torch path's autograd on CPU, FlexAttention's fused
    backward on CUDA.

    """
    _check_qk(q, k, v)
    if evict_at is not None:
        _check_heads(evict_at, "evict_at", tuple(k.shape[:3]), q.device)
    if PLAIN:
        out, lse = plain_attention(q, k, v, evict_at, sinks, scale)
        return out.to(q.dtype), lse
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    args = (q, k, v, evict_at, sinks, scale)
    # the Triton kernel has no backward
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return gpus.flex_attention(*args) if q.is_cuda else _attention_torch(*args)
    return gpus.attention(*args) if gpus.runs(q) else _attention_torch(*args)


def _attention_torch(q, k, v, evict_at, sinks, scale):
    (batch, heads, T, D), kv_heads = q.shape, k.shape[1]
    dtype, group = q.dtype, heads // kv_heads
    q = wide(q).view(batch, kv_heads, group, T, D)  # query heads h*G .. h*G+G-1 read KV head h
    k = wide(k)[:, :, None]  # (B, Hkv, 1, T, D)
    v = wide(v)[:, :, None]
    out = q.new_empty(batch, kv_heads, group, T, D)
    lse = q.new_empty(batch, kv_heads, group, T)
    pos = torch.arange(T, device=q.device)
    # a key block is skipped for query blocks that start after all its tokens left
    if evict_at is not None:
        last = [evict_at[..., j : j + BLOCK].max().item() for j in range(0, T, BLOCK)]
        evict_at = evict_at[:, :, None, None]  # (B, Hkv, 1, 1, T)
    for i in range(0, T, BLOCK):
        q_block = q[:, :, :, i : i + BLOCK] * scale  # (B, Hkv, G, M, D)
        rows = pos[i : i + BLOCK, None]  # (M, 1)
        row_max = q.new_full(q_block.shape[:-1], NEG)  # (B, Hkv, G, M)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros_like(q_block)
        for j in range(0, min(i + BLOCK, T), BLOCK):
            if evict_at is not None and j >= sinks and last[j // BLOCK] <= i:
                continue
            scores = q_block @ k[:, :, :, j : j + BLOCK].transpose(-1, -2)  # (B, Hkv, G, M, N)
            cols = pos[j : j + BLOCK]
            if evict_at is not None:
                leave = evict_at[..., j : j + BLOCK]
                visible = (cols <= rows) & ((cols < sinks) | (rows < leave))
                scores = scores.masked_fill(~visible, -math.inf)
            elif j + BLOCK > i:  # only the diagonal block has causally hidden keys
                scores = scores.masked_fill(cols > rows, -math.inf)
            m_new = torch.maximum(row_max, scores.amax(-1))
            probs = torch.exp(scores - m_new[..., None])
            rescale = torch.exp(row_max - m_new)  # rescales what was summed under the old maximum
            row_sum = row_sum * rescale + probs.sum(-1)
            acc = acc * rescale[..., None] + probs @ v[:, :, :, j : j + BLOCK]
            row_max = m_new
        # a row that sees nothing is 0
        seen = row_sum > 0
        out[:, :, :, i : i + BLOCK] = acc / torch.where(seen, row_sum, 1)[..., None]
        lse[:, :, :, i : i + BLOCK] = torch.where(seen, row_max + torch.log(row_sum), -math.inf)
    return out.view(batch, heads, T, D).to(dtype), lse.view(batch, heads, T)


# --------------------------------------------------------------------------------- future attention
def future_attention(q, k, lse, window, eps=1e-6, reduce="mean"):
    """plain_future_attention's target r (B, Hkv, T) fp32, reduce the mean (the paper's) or the max
    over the queries d >= t + window; -inf where t + window >= T. q (B, Hq, T, D), k (B, Hkv, T, D),
    lse (B, Hq, T) from the forward pass. A transposed attention in which keys play queries; memory
    O(B * H * T). README, Method: future attention."""
    _check_qk(q, k)
    _check_heads(lse, "lse", tuple(q.shape[:3]), q.device)
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if reduce not in ("mean", "max"):
        raise ValueError(f"reduce must be mean or max, got {reduce!r}")
    if PLAIN:
        return plain_future_attention(q, k, lse, window, eps, reduce)
    args = (q, k, lse, window, eps, q.shape[-1] ** -0.5, reduce)
    return gpus.future_attention(*args) if gpus.runs(q) else _future_torch(*args)


def _future_torch(q, k, lse, window, eps, scale, reduce):
    (batch, heads, T, D), kv_heads = q.shape, k.shape[1]
    group = heads // kv_heads
    q = q.float().view(batch, kv_heads, group, T, D)
    lse = lse.float().view(batch, kv_heads, group, T)
    k = k.float()[:, :, None] * scale  # (B, Hkv, 1, T, D)
    r = q.new_full((batch, kv_heads, T), -math.inf)
    pos = torch.arange(T, device=q.device)
    for t in range(0, T - window, BLOCK):  # keys t >= T - window have no query beyond the window
        t_end = min(t + BLOCK, T - window)
        k_block = k[:, :, :, t:t_end]  # (B, Hkv, 1, N, D)
        rows = pos[t:t_end, None]  # (N, 1)
        row_max = q.new_full((batch, kv_heads, group, t_end - t), NEG)
        row_sum = torch.zeros_like(row_max)
        for d in range(t + window, T, BLOCK):
            queries = q[:, :, :, d : d + BLOCK].transpose(-1, -2)
            scores = k_block @ queries - lse[:, :, :, None, d : d + BLOCK]  # (B, Hkv, G, N, M)
            # only the first query block holds queries still inside some key's window
            if d < t_end - 1 + window:
                scores = scores.masked_fill(pos[d : d + BLOCK] < rows + window, -math.inf)
            m_new = torch.maximum(row_max, scores.amax(-1))
            if reduce == "mean":  # the running sum, rescaled to the new maximum
                rescale = torch.exp(row_max - m_new)
                row_sum = row_sum * rescale + torch.exp(scores - m_new[..., None]).sum(-1)
            row_max = m_new
        n = (T - window - pos[t:t_end]).float()  # N_t >= 1 for every key in this block
        # log of the mean, or of the max
        log_p = row_max + torch.log(row_sum) - torch.log(n) if reduce == "mean" else row_max
        r[:, :, t:t_end] = torch.log(eps + torch.exp(log_p)).amax(2)
    return r


# ------------------------------------------------------------------------------- attention received
def window_received(q, k, window):
    """plain_window_received's a[t] (B, Hkv, T) fp32: the most attention token t receives from a
    query of its window, d = t .. t + w - 1, each query's softmax taken over its own window (d - w,
    d] alone (so no eviction changes it), the max over the group's query heads. A delayed scorer
    reads it as t leaves the window (README, Method: scorers); the cache keeps the running max
    (cache.py). 128 queries a time: memory O(B Hq 128 (128 + w))."""
    _check_qk(q, k)
    if PLAIN:
        return plain_window_received(q, k, window)
    (batch, heads, T, D), kv_heads = q.shape, k.shape[1]
    group = heads // kv_heads
    keys = wide(k).repeat_interleave(group, 1)  # (B, Hq, T, D)
    a = wide(q).new_zeros(batch, heads, T)
    pos = torch.arange(T, device=q.device)
    for d in range(0, T, BLOCK):
        end = min(d + BLOCK, T)
        first = max(d - window + 1, 0)  # the oldest key a query of the block sees in its window
        scores = wide(q[:, :, d:end]) @ keys[:, :, first:end].mT * D**-0.5  # (B, Hq, M, N)
        rows, cols = pos[d:end, None], pos[first:end]
        inside = (cols <= rows) & (cols > rows - window)
        probs = scores.masked_fill(~inside, -math.inf).softmax(-1)
        a[..., first:end] = torch.maximum(a[..., first:end], probs.amax(2))
    return a.view(batch, kv_heads, group, T).amax(2)


# ----------------------------------------------------------------------------------- eviction times
def eviction_times(priority, sinks, window, pool):
    """plain_eviction_times' e[b, h, t], the first query that no longer sees token t (README,
    Method: eviction times), T meaning never: priority (B, Hkv, T) static per token -> (B, Hkv, T)
    int64."""
    if priority.dim() != 3:
        raise ValueError(f"priority must be (B, Hkv, T), got shape {tuple(priority.shape)}")
    if window < 1 or sinks < 0 or pool < 0:
        raise ValueError(f"need window >= 1, sinks >= 0, pool >= 0; got window={window}, sinks={sinks}, pool={pool}")
    if priority.is_floating_point() and priority.isnan().any():
        raise ValueError("priority contains NaN; every token needs a comparable priority")
    if PLAIN:
        return plain_eviction_times(priority, sinks, window, pool)
    args = (priority, sinks, window, pool)
    return gpus.eviction_times(*args) if gpus.runs(priority) else _evict_torch(*args)


def _evict_torch(priority, sinks, window, pool):
    batch, H, T = priority.shape
    device = priority.device
    heads = batch * H
    pos = torch.arange(T, device=device)
    e = (pos + window).clamp(max=T).repeat(heads, 1)  # (B * H, T); pool = 0 is the sliding window
    e[:, :sinks] = T
    if pool >= T - sinks:  # room for every eligible token: nobody is evicted
        e[:, sinks:] = T
    if pool == 0 or pool >= T - sinks:
        return e.view(batch, H, T)
    # Visit order: decreasing (priority, t), sinks last. Sorting the reversed row stably puts the
    # newer token first among equal priorities; a second stable sort moves the (never eligible)
    # sinks to the end.
    flipped = priority.reshape(heads, T).flip(1)
    order = (T - 1) - flipped.sort(dim=1, descending=True, stable=True).indices
    sinks_last = (order < sinks).to(torch.uint8).sort(dim=1, stable=True).indices
    order = order.gather(1, sinks_last)
    # u_pool(t) is the pool-th smallest position visited before t: a max-heap (of -u) keeps the
    # pool smallest visited so far, a head at a time
    rows = order[:, : T - sinks].tolist()
    times = e.tolist()
    for row, visits in zip(times, rows):
        heap = []
        for t in visits:
            if len(heap) < pool:  # fewer than pool better tokens: never evicted
                row[t] = T
                heapq.heappush(heap, -t)
                continue
            u_pool = -heap[0]
            row[t] = min(max(t, u_pool) + window, T)
            if t < u_pool:
                heapq.heapreplace(heap, -t)
    e = torch.tensor(times, device=device)
    return e.view(batch, H, T)


# ----------------------------------------------------------------------------------------- boundary
def boundary(pi, e, q, budget):
    """plain_boundary's (keep, t_bnd) (B, H, Q) by one sweep over the steps, O(B H T), no (Q, T)
    mask. From the first full step on, each step p evicts one token, ev[p] (e == p). The pool at q
    loses its worst token at the first later step p that evicts a pool token rather than the
    newcomer p - window; till then it is unchanged, so that token is its worst at q. The best
    dropped by q is the running max of the order over ev[..q]."""
    if PLAIN:
        return plain_boundary(pi, e, q, budget)
    batch, H, T = pi.shape
    sinks, window = budget.sinks, budget.window
    u = torch.arange(T, device=pi.device)
    # each token's place in the order of (pi, t), and the token at each place
    ranked = pi.sort(stable=True).indices  # (B, H, T)
    order = torch.empty_like(ranked)
    order.scatter_(-1, ranked, u.expand_as(ranked))
    # ev[p]: the token step p evicts, -1 where none; slot T gathers the never-evicted
    ev = torch.full((batch, H, T + 1), -1, dtype=torch.long, device=pi.device)
    ev.scatter_(-1, e, u.expand_as(e))
    ev = ev[..., :T]
    # steps that evict a pool token, not the newcomer: the pool's worst until then
    from_pool = (ev >= 0) & (ev != u - window)
    step = torch.where(from_pool, u, T)
    later = step.flip(-1).cummin(-1).values.flip(-1)  # the first such step >= p
    later = torch.cat([later[..., 1:], later.new_full((batch, H, 1), T)], -1)  # > p
    # the pool at the end (no such step left): the eligible tokens never evicted, its worst
    final = (u >= sinks) & (u <= T - 1 - window) & (e >= T)
    last_worst = torch.where(final, order, T).argmin(-1, keepdim=True)  # (B, H, 1)
    worst = torch.where(later < T, ev.gather(-1, later.clamp(max=T - 1)), last_worst)
    # the best dropped by step p: the running max of the order over the evicted tokens
    dropped_order = torch.where(ev >= 0, order.gather(-1, ev.clamp(min=0)), -1)
    best_order = dropped_order.cummax(-1).values
    best_dropped = ranked.gather(-1, best_order.clamp(min=0))
    # at the queries
    t_new = (q - window).expand(batch, H, -1)
    keep = e.gather(-1, t_new) > q
    worst_q = worst[..., q]
    return keep, torch.where(worst_q == t_new, best_dropped[..., q], worst_q)
