"""kernels: each operation against a brute-force dense reference; Triton under TRITON_INTERPRET=1; the shared memory
the compiled kernels take on each GPU; the training attention's backward and FlexAttention's mask."""

import math
import os
import random
import re
import subprocess
import sys

import pytest
import torch

from tools import timing
import kernels
from support import gpus

from tests.common import _k_one_thread, _k_simulate


# =========================================================================================================
# kernels: each operation against a brute-force dense reference; Triton under TRITON_INTERPRET=1

_K_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _k_tol(device, tol):
    return max(tol, 1e-2) if device == "cuda" else tol  # tl.dot on CUDA rounds fp32 inputs to tf32


def _k_err(x, ref):
    """Max abs error; -inf entries (nothing to attend to / no future) must agree exactly."""
    assert torch.equal(x.isinf().cpu(), ref.isinf().cpu())
    fin = ref.isfinite()
    return (x.double()[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0


def _k_dense_attention(q, k, v, evict_at, sinks, scale):
    """Materialised fp64 softmax under the explicit visibility mask (README, Method: eviction
    times)."""
    T, G = q.shape[2], q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = q.double() @ k.transpose(-1, -2) * scale  # (B, Hq, T, T)
    i, t = torch.arange(T)[:, None], torch.arange(T)[None, :]
    vis = t <= i
    if evict_at is not None:
        vis = vis & ((t < sinks) | (i < evict_at.cpu().repeat_interleave(G, 1)[:, :, None, :]))
    s = s.masked_fill(~vis.to(s.device), -math.inf)
    lse = s.logsumexp(-1)
    return torch.nan_to_num((s - lse[..., None]).exp()) @ v, lse


def _k_dense_future(q, k, lse, window, eps, scale, reduce="mean"):
    """r*[t] = max over the group of log(eps + the mean (or max) over d >= t + window of p[d, t]),
    from the full matrix."""
    B, Hq, T, _ = q.shape
    G = Hq // k.shape[1]
    p = (q.double() @ k.double().repeat_interleave(G, 1).transpose(-1, -2) * scale - lse.double()[..., None]).exp()
    d, t = torch.arange(T)[:, None], torch.arange(T)[None, :]
    # (B, Hq, T queries, T keys); p >= 0, so a max over zeros is 0
    p = p * (d >= t + window).to(p.device)
    n = (T - window - torch.arange(T)).to(p.device)
    m = p.sum(2) / n.clamp(min=1) if reduce == "mean" else p.amax(2)
    r = torch.log(eps + m).view(B, -1, G, T).amax(2)
    return r.masked_fill(n <= 0, -math.inf)


# the per-block shared memory of the GPUs gpus.launch_config is checked for (CUDA C++ Programming Guide, technical
# specifications per compute capability), as (capability, bytes)
_K_GPUS = {"sm_75": (75, 64 << 10), "sm_80": (80, 163 << 10), "sm_86": (86, 99 << 10)}
_K_GPUS |= {"sm_89": (89, 99 << 10), "sm_90": (90, 227 << 10), "sm_120": (120, 99 << 10)}
_K_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# every tile size launch_config picks on one of them at head_dim 64, 128 or 256
_K_CASES = [(*gpu, dtype, D) for gpu in _K_GPUS.values() for dtype in _K_DTYPES for D in (64, 128, 256)]
_K_TILES = sorted({gpus.launch_config(*case)["BLOCK_M"] for case in _K_CASES}) if gpus.triton else [64]


@pytest.fixture(params=_K_TILES if gpus.INTERPRET else [None], ids=lambda tile: f"tile{tile}" if tile else "chosen")
def _k_tile(request, monkeypatch):
    """Under the interpreter, the Triton kernels run at every tile size some GPU gets (the tests' small head_dims
    alone would always get 64 x 64); elsewhere the chosen tiles. -> the length T of a case at this tile: at a tile
    under 64, T x tile / 64 rounded up, as many blocks (and a partial last one) as T has at 64 x 64, for a half or a
    quarter of the interpreter's work; T itself at 64 and at the chosen tiles."""
    if request.param:
        chosen = gpus.launch_config
        tiles = dict(BLOCK_M=request.param, BLOCK_N=request.param)
        monkeypatch.setattr(gpus, "launch_config", lambda *gpu: chosen(*gpu) | tiles)
    tile = min(request.param or 64, 64)
    return lambda T: -(-T * tile // 64)


def _k_qkv(B, G, T, D, device, seed, Hkv=2):
    g = torch.Generator().manual_seed(seed)
    # made (B, T, H, D) and transposed, as a model's projections are: the kernels must take strided
    # input
    q, k, v = (torch.randn(B, T, h, D, generator=g).to(device).transpose(1, 2) for h in (Hkv * G, Hkv, Hkv))
    return q, k, v


@pytest.mark.parametrize("G", [1, 2])
def test_kernels_plain_forms_are_the_definitions(G):
    """kernels.plain_* (the definitions kernels.py opens with, which bench.py kernels times the fast forms against)
    against this file's own: fp64 softmax under the visibility mask, both targets from the full matrix, and the
    step-by-step pool's eviction times (ties among the priorities included)."""
    q, k, v = _k_qkv(2, G, 70, 16, "cpu", 8)
    pri = torch.randint(0, 9, (2, 2, 70), generator=torch.Generator().manual_seed(2)).float()
    e = _k_simulate(pri, 3, 5, 7)
    assert torch.equal(kernels.plain_eviction_times(pri, 3, 5, 7), e)
    out, lse = kernels.plain_attention(q, k, v, e, 3)
    ref, ref_lse = _k_dense_attention(q, k, v, e, 3, 16**-0.5)
    assert _k_err(out, ref) <= 1e-5 and _k_err(lse, ref_lse) <= 1e-5
    for reduce in ("mean", "max"):
        got = kernels.plain_future_attention(q, k, lse, 5, reduce=reduce)
        assert _k_err(got, _k_dense_future(q, k, lse, 5, 1e-6, 16**-0.5, reduce)) <= 1e-5, reduce


@pytest.mark.parametrize("device", _K_DEVICES)
@pytest.mark.parametrize("G", [1, 2, 4])
def test_kernels_attention(_k_tile, device, G):
    for seed, (B, T, D, sinks, mode) in enumerate(
        [
            (1, 1, 16, 0, "causal"),
            (2, 7, 32, 2, "policy"),
            (2, 70, 16, 0, "random"),
            (1, 130, 64, 4, "policy"),
            (2, 133, 32, 3, "causal"),
            (1, 67, 48, 1, "random"),
        ]
    ):
        T = _k_tile(T)
        q, k, v = _k_qkv(B, G, T, D, device, seed)
        pri = torch.randn(B, 2, T)
        e = {
            "causal": None,
            "policy": kernels.eviction_times(pri, sinks, 5, 9),
            # random: some rows see nothing at all
            "random": torch.randint(0, T + 3, (B, 2, T)),
        }[mode]
        e = e.to(device) if e is not None else None
        out, lse = kernels.attention(q, k, v, e, sinks=sinks)
        ref, ref_lse = _k_dense_attention(q, k, v, e, sinks, D**-0.5)
        assert out.dtype == q.dtype and lse.dtype == torch.float32 and out.shape == q.shape
        assert _k_err(out, ref) <= _k_tol(device, 1e-5) and _k_err(lse, ref_lse) <= _k_tol(device, 1e-5), (T, mode)


@pytest.mark.usefixtures("_k_tile")
@pytest.mark.parametrize("plain", [False, True])
def test_kernels_attention_bf16_and_scale(plain, monkeypatch):
    """The tiled form and, under kernels.PLAIN (--plain), plain_attention, both at a given scale."""
    monkeypatch.setattr(kernels, "PLAIN", plain)
    q, k, v = (x.bfloat16() for x in _k_qkv(2, 2, 45, 32, "cpu", 7))
    out, lse = kernels.attention(q, k, v, scale=0.3)
    ref, ref_lse = _k_dense_attention(q, k, v, None, 0, 0.3)  # fp64 of the same bf16 values
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-5
    # one bf16 ulp: the interpreter truncates
    assert ((out.double() - ref).abs() <= 2**-7 * ref.abs() + 1e-5).all()


@pytest.mark.parametrize("device", _K_DEVICES)
@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_kernels_future_attention(_k_tile, device, G, reduce):
    for seed, (B, T, D, window) in enumerate(
        [
            (1, 1, 16, 1),
            (2, 9, 32, 1),
            (2, 70, 16, 5),
            (1, 150, 64, 20),
            (1, 40, 32, 40),
            (2, 30, 32, 50),
            (1, 131, 16, 1),
            (2, 67, 32, 3),
        ]
    ):
        T = _k_tile(T)
        q, k, _ = _k_qkv(B, G, T, D, device, seed)
        # ties: keys repeated in pairs, queries in runs of four, so equal p[d, t] compete for the
        # max
        if seed >= 6:
            k = k[:, :, torch.arange(T) // 2 * 2]
            q = q[:, :, torch.arange(T) // 4 * 4]
        _, lse = _k_dense_attention(q, k, k, None, 0, D**-0.5)
        r = kernels.future_attention(q, k, lse.float(), window, reduce=reduce)
        ref = _k_dense_future(q, k, lse, window, 1e-6, D**-0.5, reduce)
        assert r.shape == (B, 2, T) and r.dtype == torch.float32
        assert (ref.isinf().cpu() == (torch.arange(T) >= T - window)).all()
        assert _k_err(r, ref) <= _k_tol(device, 1e-4), (T, window)


@pytest.mark.usefixtures("_k_one_thread")
@pytest.mark.parametrize("device", _K_DEVICES)
def test_kernels_eviction_times_random(device):
    rng = random.Random(0)
    # 12 heads per instance: 3000 heads, 1080 under the interpreter (which runs each head's program
    # in Python)
    for case in range(90 if gpus.INTERPRET else 250):
        # some span several blocks and chunks
        T = rng.randint(1, 40) if case % 10 else rng.randint(60, 140)
        sinks, window = rng.choice([0, 0, 1, 4]), rng.choice([1, 1, 2, 5, 50])
        k = rng.choice([0, 1, 2, 3, 7, T, T + 5])
        g = torch.Generator().manual_seed(case)
        if case % 2:  # few distinct values: many ties, newer must win
            pri = torch.randint(0, 4, (3, 4, T), generator=g).to(rng.choice([torch.float32, torch.int64]))
        else:
            pri = torch.randn(3, 4, T, generator=g).to(rng.choice([torch.float32, torch.bfloat16]))
        e = kernels.eviction_times(pri.to(device), sinks, window, k)
        assert e.dtype == torch.int64
        assert torch.equal(e.cpu(), _k_simulate(pri, sinks, window, k)), (T, sinks, window, k)


@pytest.mark.parametrize("device", _K_DEVICES)
def test_kernels_eviction_times_edges(device):
    pri = torch.randn(2, 3, 50).to(device)
    pos = torch.arange(50, device=device)
    # sliding window
    assert torch.equal(kernels.eviction_times(pri, 0, 4, 0)[1, 2], (pos + 4).clamp(max=50))
    assert (kernels.eviction_times(pri, 3, 4, 47) == 50).all()  # room for everybody
    assert (kernels.eviction_times(pri, 60, 4, 2) == 50).all()  # all sinks
    # all tied: recency wins
    e = kernels.eviction_times(torch.zeros(1, 1, 50, device=device), 2, 4, 5)
    assert torch.equal(e[0, 0, 2:], torch.where(pos[2:] < 50 - 4 - 5, pos[2:] + 4 + 5, 50))


def test_kernels_bad_input():
    q, k, v = _k_qkv(1, 2, 8, 16, "cpu", 0)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        kernels.attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match="evict_at"):
        kernels.attention(q, k, v, evict_at=torch.zeros(1, 2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="on meta"):
        kernels.attention(q, k, v, evict_at=torch.zeros(1, 2, 8, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match="lse"):
        kernels.future_attention(q, k, torch.zeros(1, 2, 8), 1)
    with pytest.raises(ValueError, match="mean or max"):
        kernels.future_attention(q, k, torch.zeros(1, 4, 8), 1, reduce="sum")
    with pytest.raises(ValueError, match="NaN"):
        kernels.eviction_times(torch.full((1, 1, 4), math.nan), 0, 1, 1)
    with pytest.raises(ValueError, match="window >= 1"):
        kernels.eviction_times(torch.zeros(1, 1, 4), 0, 0, 1)


def test_kernels_dispatch():
    assert gpus.runs(torch.zeros(1)) == (os.environ.get("TRITON_INTERPRET") == "1")


def _k_peak_bytes(fn):
    # counts live tensor storages (CPU has no max_memory_allocated)
    with timing.Meter() as meter:
        fn()
    return meter.peak


@pytest.mark.usefixtures("_k_one_thread")
def test_kernels_memory_torch_path():
    T, D, G = 8192, 128, 2
    q, k, v = _k_qkv(1, G, T, D, "cpu", 0, Hkv=1)
    # scores and their exp
    assert _k_peak_bytes(lambda: (q[0, 0] @ k[0, 0].T).exp()) == 2 * T * T * 4
    # views of inputs are free
    assert _k_peak_bytes(lambda: q[:, :, 5:].transpose(-1, -2).float()) == 0
    out_bytes = G * T * D * 4
    lse = torch.zeros(1, G, T)
    for name, fn in [
        ("attention", lambda: kernels._attention_torch(q, k, v, None, 0, D**-0.5)),
        ("future", lambda: kernels._future_torch(q, k, lse, 256, 1e-6, D**-0.5, "mean")),
        ("future max", lambda: kernels._future_torch(q, k, lse, 256, 1e-6, D**-0.5, "max")),
    ]:
        peak = _k_peak_bytes(fn)
        print(f"{name}: peak extra {peak / 2**20:.1f} MiB, one T x T fp32 = {T * T * 4 / 2**20:.0f} MiB")
        # < 5% of one T x T
        assert peak <= out_bytes + 4 * G * T * kernels.BLOCK * 4 and peak < 0.05 * T * T * 4, name


def test_kernels_triton_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("already inside the interpreter run")
    # every kernel test but this one, the meter and the compiler's (no kernel runs there)
    sel = "test_kernels_ and not interpreter and not memory and not compile_for_gpus"
    # CPU only (CUDA runs the kernels natively); one thread, as the interpreter runs many tiny numpy
    # ops
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    # -n 0: in this one process (the suite's own workers already take the cores)
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-k", sel]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-3000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout, res.stdout[-2000:]


def _k_ptxas():
    """triton's own ptxas (the wheel ships it), or why there is none."""
    if gpus.triton is None:
        return None, "triton is not installed"
    path = gpus.ptxas()
    return (path, "") if os.path.isfile(path) else (None, f"triton's ptxas is absent ({path})")


def test_kernels_compile_for_gpus():
    """Every Triton kernel compiled, no GPU needed, for a T4 (sm_75, 64 KiB of shared memory a block) and an RTX 40xx
    (sm_89, 99 KiB) in fp32 and bf16 at head_dim 128 (every Qwen3), in the launch configuration launch_config chooses
    there: the shared memory the compiler gives each must fit the GPU's limit (_K_GPUS, from the CUDA docs). The
    launch every GPU had before, 64 x 64 tiles over 2 stages, does not fit the RTX 40xx in fp32 (113 KiB)."""
    if _k_ptxas()[0] is None:
        pytest.skip(_k_ptxas()[1])
    for target in ("sm_75", "sm_89"):
        capability, limit = _K_GPUS[target]
        # eviction_times' kernel reads fp64 priorities whatever the model's dtype
        launches = [("eviction_times", gpus._evict_kernel, {}, "float64", gpus.EVICT_CONFIG)]
        for dtype in ("float32", "bfloat16"):
            config = gpus.launch_config(capability, limit, getattr(torch, dtype), 128)
            assert config["BLOCK_D"] == 128
            launches += [(name, kernel, flags, dtype, config) for name, kernel, flags in gpus.LAUNCHES]
        for name, kernel, flags, dtype, config in launches:
            shared, registers, _ = gpus.compile_for_gpu(target, kernel, dtype, config, **flags)
            print(f"{target} {dtype} {name}: {shared} bytes of {limit}, {registers} registers")
            assert 0 < shared <= limit and 0 < registers <= 255, (target, dtype, name, shared)
    before = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, num_stages=2, num_warps=4)
    shared = gpus.compile_for_gpu("sm_89", gpus._attention_kernel, "float32", before, HAS_E=True)[0]
    assert shared > _K_GPUS["sm_89"][1], shared


def test_kernels_targets_limit_is_kib(monkeypatch):
    """bench.py kernels --targets (gpus.compile_targets): a GPU's limit is the shared memory a block may opt in to
    (CUDA C++ Programming Guide), KiB of 1024 bytes: an A100 (sm_80) 163 KiB = 166,912 bytes, an RTX 40xx (sm_89) 99
    KiB = 101,376. At head_dim 128 the attention kernel's bound, (4 + 8 x stages) x tile x 128 + 1024 bytes, lets the
    A100 take 64 x 64 tiles over 2 stages (164,864 bytes) and the RTX 40xx over 1 (99,328); a kernel the compiler gives
    166,000 bytes fits the A100. The compiler is stood in for: no ptxas needed."""
    if gpus.triton is None:
        pytest.skip("triton is not installed")
    asks = {"sm_80": 166_000, "sm_89": 99_328}
    monkeypatch.setattr(gpus, "compile_for_gpu", lambda target, *args, **flags: (asks[target], 64, 0))
    rows = gpus.compile_targets(["sm_80", "sm_89"])
    got = [r for r in rows if (r["kernel"], r["dtype"], r["head_dim"]) == ("attention+evict", "float32", 128)]
    want = [("sm_80", 166_912, "64x64", 2, True), ("sm_89", 101_376, "64x64", 1, True)]
    assert [(r["target"], r["limit"], r["tiles"], r["stages"], r["ok"]) for r in got] == want


def test_kernels_refuse_before_launch(monkeypatch):
    """A GPU, dtype or head_dim the kernels cannot serve is refused with one line before any launch (never triton's
    OutOfResources): here a mocked GPU whose blocks may use 16 KiB of shared memory, where at head_dim 256 the smallest
    q tile alone, 16 rows of 256 fp32, takes all 16 KiB before k and v."""
    monkeypatch.setattr(gpus, "INTERPRET", True)  # CPU tensors take the Triton path, as on a GPU
    monkeypatch.setattr(gpus, "INTERPRET_AS", (86, 16 << 10))

    class NoLaunch:  # stands in for a kernel: launching it fails the test
        def __getitem__(self, grid):
            raise AssertionError(f"a kernel was launched on grid {grid}")

    monkeypatch.setattr(gpus, "_attention_kernel", NoLaunch())
    monkeypatch.setattr(gpus, "_future_kernel", NoLaunch())
    q, k, v = _k_qkv(1, 2, 8, 256, "cpu", 0)
    lse = torch.zeros(1, 4, 8)
    for run in (lambda: kernels.attention(q, k, v), lambda: kernels.future_attention(q, k, lse, 2)):
        with pytest.raises(ValueError) as refused:
            run()
        message = str(refused.value)
        assert "\n" not in message and "sm_86" in message and "head_dim 256" in message, message
    # and on a GPU that has room, the same call would go on to launch
    monkeypatch.setattr(gpus, "INTERPRET_AS", _K_GPUS["sm_86"])
    with pytest.raises(AssertionError, match="launched"):
        kernels.attention(q, k, v)
    # what no GPU serves, one line each
    refusals = [((70, 96 << 10, torch.float32, 128), "7.5"), ((89, 99 << 10, torch.float64, 128), "float64")]
    refusals += [((90, 227 << 10, torch.bfloat16, 512), "head_dim <= 256")]
    for case, reason in refusals:
        with pytest.raises(ValueError, match=re.escape(reason)) as refused:
            gpus.launch_config(*case)
        assert "\n" not in str(refused.value)


# ----------------------------------------------------------------------------------------------------------
# training under eviction: the masked attention's backward (the CPU path), FlexAttention's mask (the CUDA path)


def test_training_attention_gradients_equal_dense_masked_reference():
    """kernels.attention with a gradient (the CPU training path of --finetune) against autograd
    through the materialised masked softmax: outputs, lse and the gradients of q, k, v, fp32,
    1e-4."""
    for seed, (B, G, T, D, sinks, window, k) in enumerate(
        [(2, 2, 400, 32, 4, 16, 40), (1, 1, 140, 16, 0, 1, 3), (1, 4, 129, 64, 2, 32, 0)]
    ):
        q, kk, v = (x.detach().requires_grad_(True) for x in _k_qkv(B, G, T, D, "cpu", seed))
        pri = torch.randn(B, 2, T, generator=torch.Generator().manual_seed(seed)) * 5 + torch.arange(T) * (seed == 0)
        # seed 0: near recency, whole key blocks leave early
        e = kernels.eviction_times(pri, sinks, window, k)
        out, lse = kernels.attention(q, kk, v, e, sinks)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, kk, v), g)
        # the reference, from the definition: visible(i, t) <=> t <= i and (t < sinks or i < e[t]);
        # fp64
        q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, kk, v))
        s = q64 @ k64.repeat_interleave(G, 1).transpose(-1, -2) / math.sqrt(D)
        i, t = torch.arange(T)[:, None], torch.arange(T)
        vis = (t <= i) & ((t < sinks) | (i < e.repeat_interleave(G, 1)[:, :, None, :]))
        ref = s.masked_fill(~vis, -math.inf).softmax(-1) @ v64.repeat_interleave(G, 1)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), g.double())
        # evictions; seed 0 skips a key block
        assert (e < T).any() and (seed or e[..., 128:256].max() <= 384)
        assert (out - ref).abs().max().item() <= 1e-4
        assert (lse - s.masked_fill(~vis, -math.inf).logsumexp(-1)).abs().max().item() <= 1e-4
        for a, b in zip(grads, ref_grads):
            assert (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item()), seed


def test_flex_attention_mask_is_the_visibility_rule():
    """The CUDA training path (FlexAttention, whose backward needs CUDA) builds its block mask from
    the same rule: its forward on CPU equals the dense masked softmax, with and without eviction
    times."""
    q, k, v = _k_qkv(1, 2, 96, 16, "cpu", 3)
    e = kernels.eviction_times(torch.randn(1, 2, 96), 2, 8, 20)
    for ev in (e, None):
        out, lse = gpus.flex_attention(q, k, v, ev, 2, 0.25)
        ref, ref_lse = _k_dense_attention(q, k, v, ev, 2, 0.25)
        assert (out - ref).abs().max().item() <= 1e-5 and (lse - ref_lse).abs().max().item() <= 1e-5
