"""KVpop kernels: causal attention under eviction times, the future-attention target, eviction times.

Each operation is first defined in its plain O(T^2) form, the T x T map the README's formulas describe (README, Method:
eviction times and Method: future attention). Then its fast form, one public function of the same signature: a Triton
kernel on CUDA tensors (or on any tensor when TRITON_INTERPRET=1 was set before import), a plain-torch path otherwise,
in tiles, never a T x T tensor. Sums run in fp32 (fp64 for fp64 inputs on the torch paths). The kernels' tiles are
chosen per GPU (`launch_config`) so that a block's shared memory fits; what cannot fit is refused before launch.
"""

# kernel annotations like `tl.constexpr` stay strings without triton
from __future__ import annotations

import functools
import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch paths need no triton
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRET_AS = (90, 227 * 1024)  # the interpreter runs CPU tensors as this GPU would (an H100; the tests set others)
BLOCK = 128  # torch-path tile: extra memory is O(T * BLOCK) per head
# finite start for running maxima: a fully masked tile gives exp(-inf - NEG) = 0, not nan (jit kernels spell it out)
NEG = -1e30


def wide(x):  # fp32, or fp64 for an fp64 input: every sum of the attention and the scorers
    return x.to(torch.promote_types(x.dtype, torch.float32))


# -------------------------- the definitions, plain O(T^2): what the fast forms below compute and bench.py kernels times
def plain_attention(q, k, v, evict_at=None, sinks=0):
    """Query i sees key t iff t <= i and (t < sinks or i < evict_at[t]): softmax over the visible keys -> (out, lse)."""
    T, group = q.shape[2], q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, 1)  # (B, Hq, T, D)
    scores = q.float() @ keys.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, Hq, T, T)
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
    """r[t] = max over the group's query heads of log(eps + reduce_{d >= t + window} p[d, t]), p[d, t] = exp(q_d . k_t
    / sqrt(D) - lse[d]); an lse[d] raised by -log P[d] weighs query d by P[d] (the helpful target)."""
    (B, heads, T, D), kv_heads = q.shape, k.shape[1]
    keys = k.float().repeat_interleave(heads // kv_heads, 1)  # (B, Hq, T, D)
    p = (q.float() @ keys.transpose(-1, -2) * D**-0.5 - lse[..., None]).exp()
    t = torch.arange(T, device=q.device)  # keys
    d = t[:, None]  # queries
    n = T - window - t  # N_t: the queries that see t only past the window
    p = p.masked_fill(d < t + window, 0)  # (B, Hq, T queries, T keys)
    m = p.sum(2) / n.clamp(min=1) if reduce == "mean" else p.amax(2)
    target = torch.log(eps + m).view(B, kv_heads, -1, T).amax(2)  # the group's max
    return target.masked_fill(n <= 0, -math.inf)


def plain_eviction_times(priority, sinks, window, pool):
    """e[t] = max(t + window, window + u_pool(t)), u_pool(t) the pool-th position u >= sinks with (pi[u], u) > (pi[t],
    t); T (never) for the sinks and where fewer than pool such u exist."""
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


# --------------------------------------------- the fast forms: one public function each, a Triton kernel or tiled torch
_jit = triton.jit if triton is not None else lambda fn: fn  # the kernels below, defined without triton too


def _use_triton(x):
    return triton is not None and (x.is_cuda or INTERPRET)


def _check_qk(q, k, v=None):
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, H, T, D), got {tuple(q.shape)} and {tuple(k.shape)}")
    (B, heads, T, D), kv_heads = q.shape, k.shape[1]
    if k.shape != (B, kv_heads, T, D) or kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"k must be (B, Hkv, T, D) with Hq % Hkv == 0, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")


def _check_heads(x, name, shape, device):
    if tuple(x.shape) != shape or x.device != device:
        raise ValueError(f"{name} must have shape {shape} on {device}, got {tuple(x.shape)} on {x.device}")


# ---------------------------------------------------------- launch configurations: tiles that fit a GPU's shared memory
def launch_config(capability, shared_limit, dtype, head_dim):
    """The attention and future-attention kernels' launch on a GPU of this compute capability (e.g. 89) whose blocks
    may use shared_limit bytes: tiles BLOCK_M x BLOCK_N, BLOCK_D, num_stages, num_warps. What cannot run is refused."""
    gpu = f"sm_{capability} ({shared_limit // 1024} KiB of shared memory a block)"
    if capability < 75:
        raise ValueError(f"{gpu}: the Triton kernels need compute capability 7.5 or newer; run on the CPU")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the Triton kernels take float32, bfloat16 or float16, got {dtype}; cast q, k and v")
    BLOCK_D = max(16, triton.next_power_of_2(head_dim))
    if BLOCK_D > 256:
        raise ValueError(f"the Triton kernels support head_dim <= 256, got {head_dim}; run on the CPU")
    # The largest tile that fits, pipelined over 2 stages where there is room. sm_75 has no asynchronous copies to
    # pipeline and multiplies fp32 on its CUDA cores, where 64 x 64 tiles spill registers.
    tiles = (64, 32, 16) if capability >= 80 else (32, 16)
    stage_counts = (2, 1) if capability >= 80 else (1,)
    # The attention kernel (the larger) asks, bounded as if in fp32, 12 bytes an element of its BLOCK_M x BLOCK_D tile
    # for q, k and v, 8 more a further stage of k and v, and 1 KiB for the eviction times and barriers (triton 3.9,
    # sm_75 to sm_120: bench.py kernels --targets checks it against the compiler)
    for tile in tiles:
        for stages in stage_counts:
            if (4 + 8 * stages) * tile * BLOCK_D + 1024 <= shared_limit:
                warps = 8 if tile * BLOCK_D >= 64 * 128 else 4  # with 4, its accumulators would spill registers
                return dict(BLOCK_M=tile, BLOCK_N=tile, BLOCK_D=BLOCK_D, num_stages=stages, num_warps=warps)
    raise ValueError(f"{gpu} has no room for 16 x 16 tiles at head_dim {head_dim}; run on the CPU")


# a GPU's compute capability (e.g. 89) and the shared memory a block may use, read once
@functools.cache
def _gpu(index):
    props = torch.cuda.get_device_properties(index)
    return props.major * 10 + props.minor, props.shared_memory_per_block_optin


def _config(x, head_dim):
    capability, limit = _gpu(x.device.index or 0) if x.is_cuda else INTERPRET_AS
    return launch_config(capability, limit, x.dtype, head_dim)


# ------------------------------------------------------------------------------------------------------------ attention
def attention(q, k, v, evict_at=None, sinks=0, scale=None):
    """Causal attention where key t is visible to query i iff t <= i and (t < sinks or i < evict_at[b, h, t]).

    q (B, Hq, T, D); k, v (B, Hkv, T, D); evict_at (B, Hkv, T) int or None (plain causal). Returns out (B, Hq, T, D) in
    q's dtype and lse (B, Hq, T) fp32, the natural-log softmax normaliser. Training (a gradient is needed): the torch
    path's autograd on CPU, FlexAttention's fused backward on CUDA.
    """
    _check_qk(q, k, v)
    if evict_at is not None:
        _check_heads(evict_at, "evict_at", tuple(k.shape[:3]), q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    args = (q, k, v, evict_at, sinks, scale)
    # the Triton kernel has no backward
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return _attention_flex(*args) if q.is_cuda else _attention_torch(*args)
    return _attention_triton(*args) if _use_triton(q) else _attention_torch(*args)


def _attention_torch(q, k, v, evict_at, sinks, scale):
    (B, heads, T, D), kv_heads = q.shape, k.shape[1]
    dtype, group = q.dtype, heads // kv_heads
    q = wide(q).view(B, kv_heads, group, T, D)  # query heads h*G .. h*G+G-1 read KV head h
    k = wide(k)[:, :, None]  # (B, Hkv, 1, T, D)
    v = wide(v)[:, :, None]
    out = q.new_empty(B, kv_heads, group, T, D)
    lse = q.new_empty(B, kv_heads, group, T)
    pos = torch.arange(T, device=q.device)
    # a key block is skipped for query blocks that start after all its tokens left
    if evict_at is not None:
        last = [evict_at[..., j : j + BLOCK].max().item() for j in range(0, T, BLOCK)]
        evict_at = evict_at[:, :, None, None]  # (B, Hkv, 1, 1, T)
    for i in range(0, T, BLOCK):
        q_block = q[:, :, :, i : i + BLOCK] * scale  # (B, Hkv, G, M, D)
        rows = pos[i : i + BLOCK, None]  # (M, 1)
        m = q.new_full(q_block.shape[:-1], NEG)  # (B, Hkv, G, M)
        row_sum = torch.zeros_like(m)
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
            m_new = torch.maximum(m, scores.amax(-1))
            p = torch.exp(scores - m_new[..., None])
            rescale = torch.exp(m - m_new)  # rescales what was summed under the old maximum
            row_sum = row_sum * rescale + p.sum(-1)
            acc = acc * rescale[..., None] + p @ v[:, :, :, j : j + BLOCK]
            m = m_new
        # a row that sees nothing is 0
        seen = row_sum > 0
        out[:, :, :, i : i + BLOCK] = acc / torch.where(seen, row_sum, 1)[..., None]
        lse[:, :, :, i : i + BLOCK] = torch.where(seen, m + torch.log(row_sum), -math.inf)
    return out.view(B, heads, T, D).to(dtype), lse.view(B, heads, T)


@_jit
def _attention_kernel(
    Q, K, V, E, Out, LSE, T, D, group, sinks, scale,
    HAS_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # query block; b * Hq + query head, in int64 because offsets like head * T * D pass 2**31 at long T
    i0 = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // group  # = b * Hkv + KV head, since query heads h*G .. h*G+G-1 read KV head h
    i = i0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dims_in = dims[None, :] < D  # BLOCK_D pads D to a power of two
    q_offsets = head * T * D + i[:, None] * D + dims[None, :]  # (BLOCK_M, BLOCK_D)
    q_mask = (i[:, None] < T) & dims_in
    q = tl.load(Q + q_offsets, mask=q_mask, other=0.0).to(tl.float32)
    m = tl.full([BLOCK_M], -1e30, tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j0 in range(0, tl.minimum(i0 + BLOCK_M, T), BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        kv_offsets = kv_head * T * D + j[:, None] * D + dims[None, :]  # (BLOCK_N, BLOCK_D)
        kv_mask = (j[:, None] < T) & dims_in
        k = tl.load(K + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(V + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k)) * scale  # (BLOCK_M, BLOCK_N)
        visible = (j[None, :] <= i[:, None]) & (j[None, :] < T)
        if HAS_E:
            e = tl.load(E + kv_head * T + j, mask=j < T, other=0)
            kept = (j[None, :] < sinks) | (i[:, None] < e[None, :])  # a sink, or not yet evicted
            visible = visible & kept
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        rescale = tl.exp(m - m_new)
        row_sum = row_sum * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p, v)
        m = m_new
    seen = row_sum > 0  # a row that sees nothing gets out 0 and lse -inf
    row_sum = tl.where(seen, row_sum, 1.0)
    out = (acc / row_sum[:, None]).to(Out.dtype.element_ty)
    tl.store(Out + q_offsets, out, mask=q_mask)
    lse = tl.where(seen, m + tl.log(row_sum), float("-inf"))
    tl.store(LSE + head * T + i, lse, mask=i < T)


def _attention_triton(q, k, v, evict_at, sinks, scale):
    (B, heads, T, D), kv_heads = q.shape, k.shape[1]
    config = _config(q, D)  # refuses, before anything runs, a GPU without room for the tiles
    q, k, v = (x.contiguous() for x in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty(B, heads, T, device=q.device)
    e = evict_at.contiguous() if evict_at is not None else q  # q stands in for the unused pointer
    grid = (triton.cdiv(T, config["BLOCK_M"]), B * heads)
    args = (q, k, v, e, out, lse, T, D, heads // kv_heads, sinks, scale)
    _attention_kernel[grid](*args, HAS_E=evict_at is not None, **config)
    return out, lse


# torch.compile, once per function (FlexAttention eager builds the T x T scores; on CPU it has no backward)
_compile_once = functools.cache(torch.compile)


def _attention_flex(q, k, v, evict_at, sinks, scale):
    """Training on CUDA: PyTorch's FlexAttention, block-sparse from the same visibility rule, with its backward."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    (B, heads, T, D), kv_heads = q.shape, k.shape[1]
    group = heads // kv_heads

    def visible(b, h, i, t):
        if evict_at is None:
            return t <= i
        return (t <= i) & ((t < sinks) | (i < evict_at[b, h // group, t]))

    mask = create_block_mask(visible, B, heads, T, T, device=q.device)
    flex = _compile_once(flex_attention) if q.is_cuda else flex_attention
    lse_request = AuxRequest(lse=True)
    out, aux = flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=group > 1, return_aux=lse_request)
    return out, aux.lse.float()


# ----------------------------------------------------------------------------------------------------- future attention
def future_attention(q, k, lse, window, eps=1e-6, reduce="mean"):
    """plain_future_attention's target r (B, Hkv, T) fp32, reduce the mean (the paper's) or the max over the queries
    d >= t + window; -inf where t + window >= T. q (B, Hq, T, D), k (B, Hkv, T, D), lse (B, Hq, T) from the forward
    pass. A transposed attention in which keys play queries; memory O(B * H * T). README, Method: future attention."""
    _check_qk(q, k)
    _check_heads(lse, "lse", tuple(q.shape[:3]), q.device)
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if reduce not in ("mean", "max"):
        raise ValueError(f"reduce must be mean or max, got {reduce!r}")
    args = (q, k, lse, window, eps, q.shape[-1] ** -0.5, reduce)
    return _future_triton(*args) if _use_triton(q) else _future_torch(*args)


def _future_torch(q, k, lse, window, eps, scale, reduce):
    (B, heads, T, D), kv_heads = q.shape, k.shape[1]
    group = heads // kv_heads
    q = q.float().view(B, kv_heads, group, T, D)
    lse = lse.float().view(B, kv_heads, group, T)
    k = k.float()[:, :, None] * scale  # (B, Hkv, 1, T, D)
    r = q.new_full((B, kv_heads, T), -math.inf)
    pos = torch.arange(T, device=q.device)
    for t in range(0, T - window, BLOCK):  # keys t >= T - window have no query beyond the window
        t_end = min(t + BLOCK, T - window)
        k_block = k[:, :, :, t:t_end]  # (B, Hkv, 1, N, D)
        rows = pos[t:t_end, None]  # (N, 1)
        m = q.new_full((B, kv_heads, group, t_end - t), NEG)
        row_sum = torch.zeros_like(m)
        for d in range(t + window, T, BLOCK):
            queries = q[:, :, :, d : d + BLOCK].transpose(-1, -2)
            scores = k_block @ queries - lse[:, :, :, None, d : d + BLOCK]  # (B, Hkv, G, N, M)
            # only the first query block holds queries still inside some key's window
            if d < t_end - 1 + window:
                scores = scores.masked_fill(pos[d : d + BLOCK] < rows + window, -math.inf)
            m_new = torch.maximum(m, scores.amax(-1))
            if reduce == "mean":  # the running sum, rescaled to the new maximum
                rescale = torch.exp(m - m_new)
                row_sum = row_sum * rescale + torch.exp(scores - m_new[..., None]).sum(-1)
            m = m_new
        n = (T - window - pos[t:t_end]).float()  # N_t >= 1 for every key in this block
        # log of the mean, or of the max
        log_p = m + torch.log(row_sum) - torch.log(n) if reduce == "mean" else m
        r[:, :, t:t_end] = torch.log(eps + torch.exp(log_p)).amax(2)
    return r


@_jit
def _future_kernel(
    Q, K, LSE, R, T, D, group, window, eps, scale,
    MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t0 = tl.program_id(0) * BLOCK_M  # key block
    kv_head = tl.program_id(1).to(tl.int64)  # b * Hkv + KV head
    t = t0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dims_in = dims[None, :] < D  # BLOCK_D pads D to a power of two
    k_offsets = kv_head * T * D + t[:, None] * D + dims[None, :]  # (BLOCK_M, BLOCK_D)
    k_mask = (t[:, None] < T) & dims_in
    k = tl.load(K + k_offsets, mask=k_mask, other=0.0).to(tl.float32) * scale
    n = (T - window - t).to(tl.float32)  # N_t: how many queries see key t only outside the window
    has_future = n > 0  # the last `window` keys have none (and an empty sum, row_sum = 0)
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for g in range(0, group):
        head = kv_head * group + g
        m = tl.full([BLOCK_M], -1e30, tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        for d0 in range(t0 + window, T, BLOCK_N):
            d = d0 + tl.arange(0, BLOCK_N)
            q_offsets = head * T * D + d[:, None] * D + dims[None, :]  # (BLOCK_N, BLOCK_D)
            q_mask = (d[:, None] < T) & dims_in
            q = tl.load(Q + q_offsets, mask=q_mask, other=0.0).to(tl.float32)
            lse = tl.load(LSE + head * T + d, mask=d < T, other=0.0).to(tl.float32)
            scores = tl.dot(k, tl.trans(q)) - lse[None, :]  # (BLOCK_M, BLOCK_N)
            outside = (d[None, :] >= t[:, None] + window) & (d[None, :] < T)
            scores = tl.where(outside, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            rescale = tl.exp(m - m_new)
            row_sum = row_sum * rescale + tl.sum(tl.exp(scores - m_new[:, None]), 1)
            m = m_new
        if MAX:  # the largest p[d, t]
            p = tl.exp(m)
        else:  # the mean of p[d, t]
            total = tl.where(has_future, row_sum, 1.0)
            count = tl.where(has_future, n, 1.0)
            p = tl.exp(m + tl.log(total) - tl.log(count))
        best = tl.maximum(best, tl.log(eps + p))
    r = tl.where(has_future, best, float("-inf"))
    tl.store(R + kv_head * T + t, r, mask=t < T)


def _future_triton(q, k, lse, window, eps, scale, reduce):
    (B, heads, T, D), kv_heads = q.shape, k.shape[1]
    config = _config(q, D)  # refuses, before anything runs, a GPU without room for the tiles
    r = torch.empty(B, kv_heads, T, device=q.device)
    grid = (triton.cdiv(T, config["BLOCK_M"]), B * kv_heads)
    args = (q.contiguous(), k.contiguous(), lse.contiguous(), r, T, D, heads // kv_heads, window, eps, scale)
    _future_kernel[grid](*args, MAX=reduce == "max", **config)
    return r


# ------------------------------------------------------------------------------------------------------- eviction times
def eviction_times(priority, sinks, window, pool):
    """plain_eviction_times' e[b, h, t], the first query that no longer sees token t (README, Method: eviction times),
    T meaning never: priority (B, Hkv, T) static per token -> (B, Hkv, T) int64."""
    if priority.dim() != 3:
        raise ValueError(f"priority must be (B, Hkv, T), got shape {tuple(priority.shape)}")
    if window < 1 or sinks < 0 or pool < 0:
        raise ValueError(f"need window >= 1, sinks >= 0, pool >= 0; got window={window}, sinks={sinks}, pool={pool}")
    if priority.is_floating_point() and priority.isnan().any():
        raise ValueError("priority contains NaN; every token needs a comparable priority")
    args = (priority, sinks, window, pool)
    return _evict_triton(*args) if _use_triton(priority) else _evict_torch(*args)


def _evict_torch(priority, sinks, window, pool):
    B, H, T = priority.shape
    device = priority.device
    heads = B * H
    pos = torch.arange(T, device=device)
    e = (pos + window).clamp(max=T).repeat(heads, 1)  # (B * H, T); pool = 0 is the sliding window
    e[:, :sinks] = T
    if pool >= T - sinks:  # room for every eligible token: nobody is evicted
        e[:, sinks:] = T
    if pool == 0 or pool >= T - sinks:
        return e.view(B, H, T)
    # Visit order: decreasing (priority, t), sinks last. Sorting the reversed row stably puts the newer token first
    # among equal priorities; a second stable sort moves the (never eligible) sinks to the end.
    flipped = priority.reshape(heads, T).flip(1)
    order = (T - 1) - flipped.sort(dim=1, descending=True, stable=True).indices
    sinks_last = (order < sinks).to(torch.uint8).sort(dim=1, stable=True).indices
    order = order.gather(1, sinks_last)
    # Fenwick tree over positions (index u + 1), size a power of two; cells[u] lists the cells that an insert of u
    # touches, padded with the unused cell 0 so that one scatter inserts a token in every head.
    size = 1 << max(T - 1, 1).bit_length()
    cell = pos + 1
    cells = []
    while len(cells) < size.bit_length():
        cells.append(torch.where(cell <= size, cell, 0))
        cell = cell + (cell & -cell)
    cells = torch.stack(cells, 1)  # (T, levels)
    tree = torch.zeros(heads, size + 1, dtype=torch.long, device=device)
    # Visits go a chunk at a time (one Python step a chunk, not a token): token j of a chunk sees the tree plus the
    # chunk's tokens before it, which binary lifting adds to each Fenwick cell it reads (cell `reach` covers
    # prefix + 1 .. reach).
    chunk = 64
    eligible = T - sinks
    before = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril(-1)  # [j, j2]: j2 visited before j
    for start in range(0, eligible, chunk):
        t = order[:, start : min(start + chunk, eligible)]  # (B * H, width)
        width = t.shape[1]
        index = (t + 1)[:, None, :]
        # prefix: the largest with a count of better tokens < pool
        prefix = torch.zeros_like(t)
        remaining = torch.full_like(t, pool)
        bit = size // 2
        while bit:
            reach = prefix + bit
            inside = (index > prefix[:, :, None]) & (index <= reach[:, :, None])
            inside = inside & before[:width, :width]  # (B * H, width, width)
            count = tree.gather(1, reach) + inside.sum(-1)
            go = count < remaining
            prefix = torch.where(go, reach, prefix)
            remaining = remaining - count * go
            bit = bit // 2
        # tokens visited before: fewer than pool means never evicted
        better = start + torch.arange(width, device=device)
        leave = (torch.maximum(t, prefix) + window).clamp(max=T)
        e.scatter_(1, t, torch.where(better >= pool, leave, T))
        ones = torch.ones(heads, width * cells.shape[1], dtype=torch.long, device=device)
        tree.scatter_add_(1, cells[t].view(heads, -1), ones)
    return e.view(B, H, T)


@_jit
def _evict_kernel(PRIORITY, E, T, sinks, window, pool, BLOCK_T: tl.constexpr, BLOCK_U: tl.constexpr):
    # Parallel form for the GPU: each token scans all positions u in order and counts those that beat it until the count
    # reaches pool. O(T^2) work but O(T) memory, and every token block runs independently.
    head = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    pi_t = tl.load(PRIORITY + head * T + t, mask=t < T, other=0.0)[:, None]  # (BLOCK_T, 1)
    count = tl.zeros([BLOCK_T], tl.int32)
    u_pool = tl.full([BLOCK_T], T, tl.int32)  # T: fewer than pool better tokens
    for u0 in range(sinks, T, BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U)
        pi_u = tl.load(PRIORITY + head * T + u, mask=u < T, other=0.0)[None, :]  # (1, BLOCK_U)
        newer = u[None, :] > t[:, None]
        better = (pi_u > pi_t) | ((pi_u == pi_t) & newer)
        better = (better & (u[None, :] < T)).to(tl.int32)  # (BLOCK_T, BLOCK_U)
        running = count[:, None] + tl.cumsum(better, 1)
        # pool = 0 stops at u = sinks <= t
        reached = tl.where(running >= pool, u[None, :], T)
        u_pool = tl.minimum(u_pool, tl.min(reached, 1))
        count += tl.sum(better, 1)
    leave = tl.minimum(tl.maximum(t, u_pool) + window, T)
    e = tl.where(u_pool < T, leave, T)
    e = tl.where(t < sinks, T, e).to(tl.int64)
    tl.store(E + head * T + t, e, mask=t < T)


# eviction_times' kernel: 64 tokens by 64 positions, half a KiB of shared memory on every GPU
EVICT_CONFIG = dict(BLOCK_T=64, BLOCK_U=64, num_stages=3, num_warps=4)


def _evict_triton(priority, sinks, window, pool):
    B, H, T = priority.shape
    e = torch.empty(B, H, T, dtype=torch.int64, device=priority.device)
    priority = priority.to(torch.float64).contiguous()  # exact for every float and for ints below 2**53
    grid = (triton.cdiv(T, EVICT_CONFIG["BLOCK_T"]), B * H)
    _evict_kernel[grid](priority, e, T, sinks, window, pool, **EVICT_CONFIG)
    return e
