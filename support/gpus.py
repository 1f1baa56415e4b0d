"""The GPU path of kernels.py: its operations as Triton kernels, launched on CUDA tensors (or on any tensor when
TRITON_INTERPRET=1 was set before import), with tiles chosen per GPU so that a block's shared memory fits (what cannot
fit is refused before launch); FlexAttention for training on CUDA; and the kernels compiled for GPUs without one, by
the ptxas inside the triton wheel: the shared memory a block asks against the GPU's limit, the registers and the spills
(bench.py kernels --targets, the tests). Each kernel is tested against kernels.py's plain form.
"""

# kernel annotations like `constexpr` stay strings without triton (and read as Triton's when it is installed)
from __future__ import annotations

import contextlib
import functools
import io
import itertools
import os
import re

import torch

try:
    import triton
    from triton import language as lang
    from triton.language import constexpr
except ImportError:  # the torch paths need no triton
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# the interpreter runs CPU tensors as this GPU would (an H100; the tests set others)
INTERPRET_AS = (90, 227 * 1024)

# the kernels below, defined without triton too
_jit = triton.jit if triton is not None else lambda fn: fn


def runs(x):  # does a tensor take the Triton kernels?
    return triton is not None and (x.is_cuda or INTERPRET)


# ---------------------------------------------------------- launch configurations: tiles that fit a GPU's shared memory
def launch_config(capability, shared_limit, dtype, head_dim):
    """The attention and future-attention kernels' launch on a GPU of this compute capability (e.g. 89) whose blocks
    may use shared_limit bytes: tiles BLOCK_M x BLOCK_N, BLOCK_D, num_stages, num_warps. What cannot run is refused."""
    kib = shared_limit // 1024
    gpu = f"sm_{capability} ({kib} KiB of shared memory a block)"
    if capability < 75:
        why = "the Triton kernels need compute capability 7.5 or newer"
        raise ValueError(f"{gpu}: {why}; run on the CPU")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        takes = "the Triton kernels take float32, bfloat16 or float16"
        raise ValueError(f"{takes}, got {dtype}; cast q, k and v")
    BLOCK_D = max(16, triton.next_power_of_2(head_dim))
    if BLOCK_D > 256:
        supports = "the Triton kernels support head_dim <= 256"
        raise ValueError(f"{supports}, got {head_dim}; run on the CPU")
    # The largest tile that fits, pipelined over 2 stages where there is room. sm_75 has no asynchronous copies to
    # pipeline and multiplies fp32 on its CUDA cores, where 64 x 64 tiles spill registers.
    tiles = (64, 32, 16) if capability >= 80 else (32, 16)
    stage_counts = (2, 1) if capability >= 80 else (1,)
    # The attention kernel (the larger) asks, bounded as if in fp32, 12 bytes an element of its BLOCK_M x BLOCK_D tile
    # for q, k and v, 8 more a further stage of k and v, and 1 KiB for the eviction times and barriers (triton 3.9,
    # sm_75 to sm_120: bench.py kernels --targets checks it against the compiler)
    for tile in tiles:
        for stages in stage_counts:
            shared = (4 + 8 * stages) * tile * BLOCK_D + 1024
            if shared <= shared_limit:
                # with 4, its accumulators would spill registers
                warps = 8 if tile * BLOCK_D >= 64 * 128 else 4
                blocks = dict(BLOCK_M=tile, BLOCK_N=tile, BLOCK_D=BLOCK_D)
                return dict(blocks, num_stages=stages, num_warps=warps)
    no_room = f"no room for 16 x 16 tiles at head_dim {head_dim}"
    raise ValueError(f"{gpu} has {no_room}; run on the CPU")


# a GPU's compute capability (e.g. 89) and the shared memory a block may use, read once
@functools.cache
def _gpu(index):
    props = torch.cuda.get_device_properties(index)
    capability = props.major * 10 + props.minor
    return capability, props.shared_memory_per_block_optin


def _config(x, head_dim):
    capability, limit = INTERPRET_AS
    if x.is_cuda:
        capability, limit = _gpu(x.device.index or 0)
    return launch_config(capability, limit, x.dtype, head_dim)


# ------------------------------------------------------------------------------------------------------------ attention
@_jit
def _attention_kernel(
    Q, K, V, E, Out, LSE, T, D, group, sinks, scale,
    HAS_E: constexpr, BLOCK_M: constexpr,
    BLOCK_N: constexpr, BLOCK_D: constexpr,
):  # fmt: skip
    # query block; b * Hq + query head, in int64 because offsets like query_head * T * D pass 2**31 at long T
    i0 = lang.program_id(0) * BLOCK_M
    query_head = lang.program_id(1).to(lang.int64)
    # = b * Hkv + KV head, since query heads h*G .. h*G+G-1 read KV head h
    kv_head = query_head // group
    i = i0 + lang.arange(0, BLOCK_M)
    dims = lang.arange(0, BLOCK_D)
    # BLOCK_D pads D to a power of two
    dims_in = dims[None, :] < D
    # (BLOCK_M, BLOCK_D)
    q_offsets = query_head * T * D + i[:, None] * D + dims[None, :]
    q_mask = (i[:, None] < T) & dims_in
    q = lang.load(Q + q_offsets, mask=q_mask, other=0.0).to(lang.float32)
    m = lang.full([BLOCK_M], -1e30, lang.float32)
    row_sum = lang.zeros([BLOCK_M], lang.float32)
    acc = lang.zeros([BLOCK_M, BLOCK_D], lang.float32)
    for j0 in range(0, lang.minimum(i0 + BLOCK_M, T), BLOCK_N):
        j = j0 + lang.arange(0, BLOCK_N)
        # (BLOCK_N, BLOCK_D)
        kv_offsets = kv_head * T * D + j[:, None] * D + dims[None, :]
        kv_mask = (j[:, None] < T) & dims_in
        k = lang.load(K + kv_offsets, mask=kv_mask, other=0.0).to(lang.float32)
        v = lang.load(V + kv_offsets, mask=kv_mask, other=0.0).to(lang.float32)
        # (BLOCK_M, BLOCK_N)
        scores = lang.dot(q, lang.trans(k)) * scale
        visible = (j[None, :] <= i[:, None]) & (j[None, :] < T)
        if HAS_E:
            e = lang.load(E + kv_head * T + j, mask=j < T, other=0)
            # a sink, or not yet evicted
            kept = (j[None, :] < sinks) | (i[:, None] < e[None, :])
            visible = visible & kept
        scores = lang.where(visible, scores, float("-inf"))
        m_new = lang.maximum(m, lang.max(scores, 1))
        p = lang.exp(scores - m_new[:, None])
        rescale = lang.exp(m - m_new)
        row_sum = row_sum * rescale + lang.sum(p, 1)
        acc = acc * rescale[:, None] + lang.dot(p, v)
        m = m_new
    # a row that sees nothing gets out 0 and lse -inf
    seen = row_sum > 0
    row_sum = lang.where(seen, row_sum, 1.0)
    out = (acc / row_sum[:, None]).to(Out.dtype.element_ty)
    lang.store(Out + q_offsets, out, mask=q_mask)
    lse = lang.where(seen, m + lang.log(row_sum), float("-inf"))
    lang.store(LSE + query_head * T + i, lse, mask=i < T)


# kernels.attention on a GPU
def attention(q, k, v, evict_at, sinks, scale):
    (B, heads, T, D), kv_heads = q.shape, k.shape[1]
    # refuses, before anything runs, a GPU without room for the tiles
    config = _config(q, D)
    q, k, v = (x.contiguous() for x in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty(B, heads, T, device=q.device)
    # q stands in for the unused pointer
    e = evict_at.contiguous() if evict_at is not None else q
    grid = (triton.cdiv(T, config["BLOCK_M"]), B * heads)
    group = heads // kv_heads
    args = (q, k, v, e, out, lse, T, D, group, sinks, scale)
    has_e = evict_at is not None
    _attention_kernel[grid](*args, HAS_E=has_e, **config)
    return out, lse


# torch.compile, once per function (FlexAttention eager builds the T x T scores; on CPU it has no backward)
_compile_once = functools.cache(torch.compile)


def flex_attention(q, k, v, evict_at, sinks, scale):
    """Training on CUDA: PyTorch's FlexAttention, block-sparse from the same visibility rule, with its backward."""
    from torch.nn.attention import flex_attention as flex_module

    (B, heads, T, D), kv_heads = q.shape, k.shape[1]
    group = heads // kv_heads

    def visible(b, h, i, t):
        if evict_at is None:
            return t <= i
        kept = (t < sinks) | (i < evict_at[b, h // group, t])
        return (t <= i) & kept

    shape = (B, heads, T, T)
    mask = flex_module.create_block_mask(visible, *shape, device=q.device)
    flex = flex_module.flex_attention
    if q.is_cuda:
        flex = _compile_once(flex)
    lse_request = flex_module.AuxRequest(lse=True)
    options = dict(scale=scale, enable_gqa=group > 1, return_aux=lse_request)
    out, aux = flex(q, k, v, block_mask=mask, **options)
    return out, aux.lse.float()


# ----------------------------------------------------------------------------------------------------- future attention
@_jit
def _future_kernel(
    Q, K, LSE, R, T, D, group, window, eps, scale,
    MAX: constexpr, BLOCK_M: constexpr,
    BLOCK_N: constexpr, BLOCK_D: constexpr,
):  # fmt: skip
    # key block
    t0 = lang.program_id(0) * BLOCK_M
    # b * Hkv + KV head
    kv_head = lang.program_id(1).to(lang.int64)
    t = t0 + lang.arange(0, BLOCK_M)
    dims = lang.arange(0, BLOCK_D)
    # BLOCK_D pads D to a power of two
    dims_in = dims[None, :] < D
    # (BLOCK_M, BLOCK_D)
    k_offsets = kv_head * T * D + t[:, None] * D + dims[None, :]
    k_mask = (t[:, None] < T) & dims_in
    k = lang.load(K + k_offsets, mask=k_mask, other=0.0).to(lang.float32) * scale
    # N_t: how many queries see key t only outside the window
    n = (T - window - t).to(lang.float32)
    # the last `window` keys have none (and an empty sum, row_sum = 0)
    has_future = n > 0
    best = lang.full([BLOCK_M], float("-inf"), lang.float32)
    for g in range(0, group):
        query_head = kv_head * group + g
        m = lang.full([BLOCK_M], -1e30, lang.float32)
        row_sum = lang.zeros([BLOCK_M], lang.float32)
        for d0 in range(t0 + window, T, BLOCK_N):
            d = d0 + lang.arange(0, BLOCK_N)
            # (BLOCK_N, BLOCK_D)
            q_offsets = query_head * T * D + d[:, None] * D + dims[None, :]
            q_mask = (d[:, None] < T) & dims_in
            q = lang.load(Q + q_offsets, mask=q_mask, other=0.0).to(lang.float32)
            lse = lang.load(LSE + query_head * T + d, mask=d < T, other=0.0)
            lse = lse.to(lang.float32)
            # (BLOCK_M, BLOCK_N)
            scores = lang.dot(k, lang.trans(q)) - lse[None, :]
            outside = (d[None, :] >= t[:, None] + window) & (d[None, :] < T)
            scores = lang.where(outside, scores, float("-inf"))
            m_new = lang.maximum(m, lang.max(scores, 1))
            rescale = lang.exp(m - m_new)
            row_sum = row_sum * rescale + lang.sum(lang.exp(scores - m_new[:, None]), 1)
            m = m_new
        if MAX:  # the largest p[d, t]
            p = lang.exp(m)
        else:  # the mean of p[d, t]
            total = lang.where(has_future, row_sum, 1.0)
            count = lang.where(has_future, n, 1.0)
            p = lang.exp(m + lang.log(total) - lang.log(count))
        best = lang.maximum(best, lang.log(eps + p))
    r = lang.where(has_future, best, float("-inf"))
    lang.store(R + kv_head * T + t, r, mask=t < T)


# kernels.future_attention on a GPU
def future_attention(q, k, lse, window, eps, scale, reduce):
    (B, heads, T, D), kv_heads = q.shape, k.shape[1]
    # refuses, before anything runs, a GPU without room for the tiles
    config = _config(q, D)
    r = torch.empty(B, kv_heads, T, device=q.device)
    grid = (triton.cdiv(T, config["BLOCK_M"]), B * kv_heads)
    inputs = (q.contiguous(), k.contiguous(), lse.contiguous())
    group = heads // kv_heads
    args = (*inputs, r, T, D, group, window, eps, scale)
    _future_kernel[grid](*args, MAX=reduce == "max", **config)
    return r


# ------------------------------------------------------------------------------------------------------- eviction times
@_jit
def _evict_kernel(
    PRIORITY, E, T, sinks, window, pool,
    BLOCK_T: constexpr, BLOCK_U: constexpr,
):  # fmt: skip
    # Parallel form for the GPU: each token scans all positions u in order and counts those that beat it until the count
    # reaches pool. O(T^2) work but O(T) memory, and every token block runs independently.
    kv_head = lang.program_id(1).to(lang.int64)
    t = lang.program_id(0) * BLOCK_T + lang.arange(0, BLOCK_T)
    # (BLOCK_T, 1)
    pi_t = lang.load(PRIORITY + kv_head * T + t, mask=t < T, other=0.0)[:, None]
    count = lang.zeros([BLOCK_T], lang.int32)
    # T: fewer than pool better tokens
    u_pool = lang.full([BLOCK_T], T, lang.int32)
    for u0 in range(sinks, T, BLOCK_U):
        u = u0 + lang.arange(0, BLOCK_U)
        # (1, BLOCK_U)
        pi_u = lang.load(PRIORITY + kv_head * T + u, mask=u < T, other=0.0)[None, :]
        newer = u[None, :] > t[:, None]
        better = (pi_u > pi_t) | ((pi_u == pi_t) & newer)
        # (BLOCK_T, BLOCK_U)
        better = (better & (u[None, :] < T)).to(lang.int32)
        running = count[:, None] + lang.cumsum(better, 1)
        # pool = 0 stops at u = sinks <= t
        reached = lang.where(running >= pool, u[None, :], T)
        u_pool = lang.minimum(u_pool, lang.min(reached, 1))
        count += lang.sum(better, 1)
    leave = lang.minimum(lang.maximum(t, u_pool) + window, T)
    e = lang.where(u_pool < T, leave, T)
    e = lang.where(t < sinks, T, e).to(lang.int64)
    lang.store(E + kv_head * T + t, e, mask=t < T)


# eviction_times' kernel: 64 tokens by 64 positions, half a KiB of shared memory on every GPU
EVICT_CONFIG = dict(BLOCK_T=64, BLOCK_U=64, num_stages=3, num_warps=4)


# kernels.eviction_times on a GPU
def eviction_times(priority, sinks, window, pool):
    B, H, T = priority.shape
    e = torch.empty(B, H, T, dtype=torch.int64, device=priority.device)
    # exact for every float and for ints below 2**53
    priority = priority.to(torch.float64).contiguous()
    grid = (triton.cdiv(T, EVICT_CONFIG["BLOCK_T"]), B * H)
    _evict_kernel[grid](priority, e, T, sinks, window, pool, **EVICT_CONFIG)
    return e


# ------------------------------------------------------------------------------------ the kernels compiled for GPUs
# the shared memory a block may opt in to, KiB (CUDA C++ Programming Guide, technical specifications per capability)
SHARED_KIB = {
    "sm_75": 64,
    "sm_80": 163,
    "sm_86": 99,
    "sm_89": 99,
    "sm_90": 227,
    "sm_120": 99,
}
# the kernels' arguments but the pointers to q, k, v and out (Q, K, V, Out), which have the inputs' dtype
ARGUMENT_TYPES = {"E": "*i64", "LSE": "*fp32", "R": "*fp32", "PRIORITY": "*fp64"}
ARGUMENT_TYPES |= {"scale": "fp32", "eps": "fp32"}
INT_ARGUMENTS = ("T", "D", "group", "sinks", "window", "pool")
ARGUMENT_TYPES |= dict.fromkeys(INT_ARGUMENTS, "i32")
# the attention and future kernels as they launch: a name, the kernel, its flag
LAUNCHES = [
    ("attention", _attention_kernel, {"HAS_E": False}),
    ("attention+evict", _attention_kernel, {"HAS_E": True}),
    ("future mean", _future_kernel, {"MAX": False}),
    ("future max", _future_kernel, {"MAX": True}),
]


# where the triton wheel keeps its ptxas (absent: nothing compiles)
def ptxas():
    package = os.path.dirname(triton.__file__)
    return os.path.join(package, "backends", "nvidia", "bin", "ptxas")


def compile_for_gpu(target, kernel, dtype, config, **constexprs):
    """The kernel compiled for a GPU (target "sm_89") as it launches on dtype tensors, no GPU needed -> (shared memory
    a block asks, registers a thread, bytes spilled)."""
    blocks = {k: v for k, v in config.items() if k.startswith("BLOCK")}
    constants = constexprs | blocks
    pointers = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    pointer = "*" + pointers.get(dtype, "fp64")
    arguments = [name for name in kernel.arg_names if name not in constants]
    types = {name: ARGUMENT_TYPES.get(name, pointer) for name in arguments}
    # pointers 16-byte aligned and D a multiple of 16, as torch's tensors and head_dims 64-256 are at launch
    aligned = [name for name in types if types[name][0] == "*" or name == "D"]
    index = lambda name: (kernel.arg_names.index(name),)
    hints = {index(name): [["tt.divisibility", 16]] for name in aligned}
    source = triton.compiler.ASTSource(kernel, types, constants, hints)
    gpu = triton.backends.compiler.GPUTarget("cuda", int(target[3:]), 32)
    options = {k: v for k, v in config.items() if k.startswith("num")}
    # compiled afresh (not read from triton's cache), printing ptxas -v's log: the registers and spills
    knobs = triton.knobs
    with knobs.nvidia.scope(), knobs.compilation.scope():
        knobs.nvidia.dump_ptxas_log = knobs.compilation.always_compile = True
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            compiled = triton.compile(source, target=gpu, options=options)
    log = printed.getvalue()
    registers = re.search(r"Used (\d+) registers", log)[1]
    spilled = re.search(r"(\d+) bytes spill stores", log)[1]
    return compiled.metadata.shared, int(registers), int(spilled)


def compile_targets(targets):
    """Every kernel compiled for each GPU of targets (e.g. ["sm_75", "sm_89"]) in float32, bfloat16 and float16 at
    head_dim 64, 128 and 256, in the launch configuration kernels.py chooses there: a row at a time (each compile takes
    seconds), a kernel's or a refused dtype and head_dim's (kernel "all", refused: the one line)."""
    dtypes = ("float32", "bfloat16", "float16")
    # the tiles of a launch configuration: BLOCK_M x BLOCK_N (BLOCK_T x BLOCK_U)
    is_tile = lambda k: k.startswith("BLOCK") and k != "BLOCK_D"
    for target in targets:
        limit = SHARED_KIB[target] * 1024
        capability = int(target[3:])
        # eviction_times' kernel reads fp64 priorities, whatever the model's dtype and head_dim
        evict = ("eviction_times", _evict_kernel, {}, "float64", None, EVICT_CONFIG)
        launches = [evict]
        for dtype, head_dim in itertools.product(dtypes, (64, 128, 256)):
            try:
                dt = getattr(torch, dtype)
                config = launch_config(capability, limit, dt, head_dim)
                launches += [(*launch, dtype, head_dim, config) for launch in LAUNCHES]
            except ValueError as refused:
                # one line, before any launch
                where = dict(target=target, dtype=dtype, head_dim=head_dim)
                yield dict(kernel="all", **where, refused=str(refused))
        for name, fn, constexprs, dtype, head_dim, config in launches:
            compiled = compile_for_gpu(target, fn, dtype, config, **constexprs)
            shared, registers, spills = compiled
            tiles = "x".join(str(v) for k, v in config.items() if is_tile(k))
            row = dict(kernel=name, target=target, dtype=dtype, head_dim=head_dim)
            row.update(tiles=tiles, stages=config["num_stages"])
            row.update(warps=config["num_warps"], shared=shared, limit=limit)
            yield dict(row, registers=registers, spills=spills, ok=shared <= limit)
