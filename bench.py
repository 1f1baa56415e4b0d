"""Benchmarks: `python bench.py {kernels,quality,speed} [options]`, one cmd_ function per command
(its docstring and options: `-h` after the command). The tasks and their quality evaluation are in
tasks.py."""

import argparse
import math
import os
import random
import sys
import time
import weakref

# before torch loads: large tensors on 2 MB pages, see README
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
import kvpop
import tasks


# ------------------------------------------------------------------------------------------------
# kernels


def naive_attention(q, k, v, evict_at=None, sinks=0):
    T, G = q.shape[2], q.shape[1] // k.shape[1]
    # (B, Hq, T, T)
    s = q.float() @ k.float().repeat_interleave(G, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    i, t = torch.arange(T, device=q.device)[:, None], torch.arange(T, device=q.device)
    vis = t <= i
    if evict_at is not None:
        vis = vis & ((t < sinks) | (i < evict_at.repeat_interleave(G, 1)[:, :, None, :]))
    lse = s.masked_fill(~vis, -math.inf).logsumexp(-1)
    return (s - lse[..., None]).exp().masked_fill(~vis, 0) @ v.float().repeat_interleave(G, 1), lse


def naive_future(q, k, lse, window, eps=1e-6):
    (B, Hq, T, D), Hkv = q.shape, k.shape[1]
    p = (
        q.float() @ k.float().repeat_interleave(Hq // Hkv, 1).transpose(-1, -2) * D**-0.5
        - lse[..., None]
    ).exp()
    d, t = torch.arange(T, device=q.device)[:, None], torch.arange(T, device=q.device)
    n = T - window - t  # (T,)
    m = p.masked_fill(d < t + window, 0).sum(2) / n.clamp(min=1)  # (B, Hq, T keys)
    return torch.log(eps + m).view(B, Hkv, -1, T).amax(2).masked_fill(n <= 0, -math.inf)


def naive_eviction_times(priority, sinks, window, k):
    T = priority.shape[-1]
    u = torch.arange(T, device=priority.device)
    pt, pu = priority[..., :, None], priority[..., None, :]  # (B, H, t, 1), (B, H, 1, u)
    better = ((pu > pt) | ((pu == pt) & (u > u[:, None]))) & (u >= sinks)  # (B, H, T, T)
    hit = better.cumsum(-1) >= k  # k-th better position reached at u
    uk = torch.where(hit.any(-1), hit.int().argmax(-1), T)
    e = torch.where(uk < T, (torch.maximum(u, uk) + window).clamp(max=T), T)
    return e.masked_fill(u < sinks, T)


class LiveBytes(TorchDispatchMode):
    """CPU peak meter: bytes of the storages ops create while active, dropped from the count when
    freed."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0  # live: data pointer -> bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # views, in-place
        ins = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for x in out if isinstance(out, (tuple, list)) else [out]:
            s = x.untyped_storage() if isinstance(x, torch.Tensor) else None
            if (
                s is not None
                and s.nbytes()
                and s.data_ptr() not in ins
                and s.data_ptr() not in self.live
            ):
                self.live[s.data_ptr()] = s.nbytes()
                self.now += s.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(s, self._free, s.data_ptr())
        return out

    def _free(self, ptr):
        self.now -= self.live.pop(ptr)


# wall seconds of one run: CUDA runs asynchronously, so wait for the GPU before and after
def clock(fn, dev):
    sync = torch.cuda.synchronize if dev == "cuda" else lambda: None
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def peak(fn, dev):  # (seconds, peak bytes allocated above what was live before) of one run of fn
    if dev == "cpu":
        with LiveBytes() as meter:
            return clock(fn, dev), meter.peak
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    return clock(fn, dev), torch.cuda.max_memory_allocated() - base


# a GPU for --device cuda, flag >= least[flag], --json: a file in a writable folder
def check_flags(ap, a, **least):
    if getattr(a, "device", None) == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is visible; use --device cpu")
    for flag, n in least.items():
        if getattr(a, flag) < n:
            ap.error(f"--{flag} {getattr(a, flag)}: use {n} or more")
    json = getattr(a, "json", None)
    folder = os.path.dirname(json or "") or "."
    if json and (
        os.path.isdir(json) or not os.path.isdir(folder) or not os.access(folder, os.W_OK)
    ):
        ap.error(f"--json {json}: give a file name in an existing, writable folder")


def table(*cols):  # a markdown table's head: its column names, then the rule under them
    return "| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|"


def cmd_kernels(argv):
    """Time and peak memory of each kernels.py op vs its naive dense version (and SDPA on CUDA)."""
    ap = argparse.ArgumentParser(prog="bench.py kernels", description=cmd_kernels.__doc__)
    ap.error = lambda msg: sys.exit(f"bench.py kernels: {msg}")  # one line, exit status 1
    ap.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"]
    )
    ap.add_argument(
        "--T",
        help="comma-separated lengths (default 4096,16384,32768 on CUDA, 1024,2048,4096 on CPU)",
    )
    ap.add_argument("--D", type=int, default=128, help="head dim")
    ap.add_argument("--group", type=int, default=2, help="query heads of the one KV head timed")
    a = ap.parse_args(argv)
    check_flags(ap, a, group=1)
    dev, dt, sinks, window = (
        a.device,
        torch.bfloat16 if a.device == "cuda" else torch.float32,
        4,
        256,
    )
    a.T = ("4096,16384,32768" if dev == "cuda" else "1024,2048,4096") if a.T is None else a.T
    if not all(x.strip().isdecimal() and int(x) >= 1 for x in a.T.split(",")):
        ap.error(f"--T {a.T!r}: use comma-separated lengths >= 1, e.g. 1024,2048")
    if a.D < 1 or dev == "cuda" and a.D > 256:
        ap.error(f"--D {a.D}: use a head dim >= 1 (at most 256 on CUDA, the Triton kernels' limit)")
    # noqa: E731
    measure = lambda fn: (
        min([clock(fn, dev) for _ in range(4)][1:]) * 1e3,
        peak(fn, dev)[1] / 2**20,
    )
    print(
        f"{dev}, {dt}, D {a.D}, 1 KV head x {a.group} query heads, sinks {sinks}, window {window}, pool T/4\n"
    )
    print(
        table(
            "op",
            "T",
            "ours ms",
            "naive ms",
            "naive/ours",
            "SDPA ms",
            "ours MiB",
            "naive MiB",
            "naive/ours",
        )
    )
    for T in map(int, a.T.split(",")):
        q, k, v = (torch.randn(1, h, T, a.D, device=dev, dtype=dt) for h in (a.group, 1, 1))
        pri = torch.randn(1, 1, T, device=dev)
        e, lse = kernels.eviction_times(pri, sinks, window, T // 4), kernels.attention(q, k, v)[1]
        # noqa: E731
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        for name, ours, naive, x in [  # each op, ours and naive, on the same inputs
            ("attention", kernels.attention, naive_attention, (q, k, v)),
            ("attention+evict", kernels.attention, naive_attention, (q, k, v, e, sinks)),
            ("future_attention", kernels.future_attention, naive_future, (q, k, lse, window)),
            (
                "eviction_times",
                kernels.eviction_times,
                naive_eviction_times,
                (pri, sinks, window, T // 4),
            ),
        ]:
            # best ms of 3 after a warm-up
            (to, mo), (tn, mn) = measure(lambda: ours(*x)), measure(lambda: naive(*x))
            ts = f"{measure(sdpa)[0]:.1f}" if name == "attention" and dev == "cuda" else "-"
            print(
                f"| {name} | {T} | {to:.1f} | {tn:.1f} | {tn / to:.2f} | {ts} | {mo:.1f} | {mn:.1f} | "
                f"{mn / max(mo, 1e-3):.0f} |",
                flush=True,
            )


# the folders of the scorers python train.py wrote for the baby, every kind
def shipped_scorers(task, target):
    return [
        d
        for k in kvpop.SCORERS
        if os.path.isfile(os.path.join(d := f"baby/scorers/{task}-{target}/{k}", "scorer.json"))
    ]


def cmd_quality(argv):
    """Eviction quality of every policy on held-out sequences of the baby's tasks (teacher-forced):
    for each task the policies, then for each target the oracle and the scorers trained on it."""
    ap = argparse.ArgumentParser(prog="bench.py quality", description=cmd_quality.__doc__)
    ap.error = lambda msg: sys.exit(f"bench.py quality: {msg}")  # one line, exit status 1
    ap.add_argument("--model", default="baby", help="checkpoint folder (default: the shipped baby)")
    ap.add_argument(
        "--task", default="recall", help=f"comma-separated tasks, of {','.join(tasks.TASKS)}"
    )
    ap.add_argument(
        "--target",
        default="max",
        help="comma-separated targets of the oracle and scorers: mean, max",
    )
    ap.add_argument(
        "--scorer",
        help="comma-separated learned scorer folders, a row each, named by kind ('' for "
        "none; default: the shipped ones of each task and target, baby/scorers/<task>-<target>/<kind>)",
    )
    ap.add_argument(
        "--policies", default="full,oracle,streaming,h2o,tova,knorm,random", help="comma-separated"
    )
    ap.add_argument(
        "--budgets", default="0.25,0.125", help="comma-separated fractions of T (or integers B)"
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="held-out task seed (training draws other streams)"
    )
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--n", type=int, default=128, help="sequences")
    ap.add_argument("--T", type=int, default=512, help="tokens per sequence")
    ap.add_argument("--sinks", type=int, default=4, help="first tokens never evicted")
    ap.add_argument("--window", type=int, default=32, help="recent tokens never evicted")
    ap.add_argument(
        "--threads", type=int, default=1, help="CPU threads (tiny ops: a second one mostly waits)"
    )
    a = ap.parse_args(argv)
    policies, task_names, targets = a.policies.split(","), a.task.split(","), a.target.split(",")
    if bad := [p for p in policies if p not in kvpop.POLICIES]:
        ap.error(f"--policies: unknown policy {bad[0]!r}; choose from {','.join(kvpop.POLICIES)}")
    if bad := [t for t in task_names if t not in tasks.TASKS]:
        ap.error(f"--task: unknown task {bad[0]!r}; choose from {','.join(tasks.TASKS)}")
    if bad := [t for t in targets if t not in ("mean", "max")]:
        ap.error(f"--target: unknown target {bad[0]!r}; choose mean or max")
    # not inf, nan, ''
    budgets = [kvpop.parse_value(ap.prog, "budgets", b, float) for b in a.budgets.split(",")]
    check_flags(ap, a, n=1, T=64, sinks=0, window=1, threads=1)
    try:
        limit = kvpop.Qwen3Config.from_json(
            os.path.join(kvpop.checkpoint_dir(a.model), "config.json")
        )
        folders = {
            (t, r): shipped_scorers(t, r)
            if a.scorer is None
            else [d for d in a.scorer.split(",") if d]
            for t in task_names
            for r in targets
        }
        scorers = {d: kvpop.Scorer.from_pretrained(d) for ds in folders.values() for d in ds}
        # a scorer for another model or window, or a budget that leaves no room, raises
        for s in scorers.values():
            s.check(limit, a.window)
        for s, b in [(s, b) for s in [None, *scorers.values()] for b in budgets]:
            kvpop.budget_size(b, a.T, a.sinks, a.window, getattr(s, "charge", 0))
        if a.T > limit.max_position_embeddings:  # checked before the weights load
            raise ValueError(
                f"--T {a.T}: the model has {limit.max_position_embeddings} positions; lower --T"
            )
        torch.set_num_threads(a.threads)
        net = kvpop.Qwen3.from_pretrained(a.model, dtype=torch.float32)
        tok = kvpop.Tokenizer.from_pretrained(kvpop.checkpoint_dir(a.model))
    except (OSError, ValueError) as e:
        ap.error(str(e))
    t0, rows, head = time.time(), [], []
    for task in task_names:  # the same held-out sequences for every policy and target of a task
        idx, tgt, dist = tasks.task_batch(
            tok, a.n, a.T, random.Random(f"test-{a.seed}"), **tasks.TASKS[task]
        )
        plain = [p for p in policies if p != "oracle"]  # full and the heuristics read no target
        runs, far, n = tasks.quality_runs(net, idx, tgt, dist, plain, budgets, a.sinks, a.window)
        rows += [dict(task=task, target="-", **r) for r in runs]
        for target in targets:
            learned = ["oracle"] * ("oracle" in policies) + [
                scorers[d] for d in folders[task, target]
            ]
            runs = tasks.quality_runs(
                net, idx, tgt, dist, learned, budgets, a.sinks, a.window, reduce=target
            )[0]
            rows += [dict(task=task, target=target, **r) for r in runs[1:]]  # full is above
        head.append(f"{task}: {n} queries ({far:.0%} far)")
    print(
        f"{a.model}: {a.n} held-out sequences of {a.T} tokens (seed {a.seed}), {'; '.join(head)}; sinks {a.sinks}, "
        f"window {a.window}\n\n{tasks.quality_table(rows)}\n\n{time.time() - t0:.0f}s"
    )
    if a.json:
        kvpop.write_json(rows, a.json)


# ----------------------------------------------------------------------------------------------------------
# speed: a decoding step reads every weight and every kept key and value once, so its cost should
# follow bytes

SHAPES = {
    "0.6B": (28, 1024, 3072, 16, True),
    "4B": (36, 2560, 9728, 32, True),
    "8B": (36, 4096, 12288, 32, False),
}


def shape_model(c, device, dtype):  # a Qwen3 with random weights, built without initialising twice
    with torch.device("meta"):
        net = kvpop.Qwen3(c)
    # unties the head, and the memory may hold denormals that slow a CPU: fill it
    net.to_empty(device=device)
    if c.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    for p in net.parameters():
        p.data.normal_(0, 0.02) if p.dim() > 1 else p.data.fill_(1.0)
    return net.to(dtype).eval()


def fill(cache, C):
    """Make the cache look as if it had read C tokens (sinks, a pool spread over the past, the
    window), with synthetic keys and values: a step costs the same whatever they hold. Returns the
    entries held."""
    S, s, w = cache.size, cache.sinks, cache.window
    pos = (
        torch.arange(C)
        if C <= S
        else torch.cat(
            [
                torch.arange(s),
                torch.linspace(s, C - w - 1, S - s - w).long(),
                torch.arange(C - w, C),
            ]
        )
    )
    n = len(pos)
    cache.k[..., :n, :].normal_(), cache.v[..., :n].normal_()  # values are stored transposed
    cache.pos[..., :n], cache.score[..., :n], cache.t = pos.to(cache.pos.device), torch.rand(n), C
    if cache.delayed:  # the window's slots, as decoding left them
        cache.ring[..., pos[-w:] % w] = torch.arange(n - w, n, device=cache.ring.device)
    if cache.memory:
        cache.S.normal_(0, 0.01), cache.m.zero_()
    return n


def cmd_speed(argv):
    """Decoding tokens/s, KV memory and bandwidth of each policy and budget beside full and the
    matrix-vector limit, the scorer's share of a step; prefill time and peak memory; a scorer
    training step, part by part. A step reads the weights (the input embedding only when tied to the
    head; a learned scorer's too), kept keys, values, state."""
    ap = argparse.ArgumentParser(prog="bench.py speed", description=cmd_speed.__doc__)
    ap.error = lambda msg: sys.exit(f"bench.py speed: {msg}")  # one line, exit status 1
    ap.add_argument("--model", help="checkpoint folder (default: a random model of --shape)")
    ap.add_argument(
        "--shape", default="0.6B", choices=list(SHAPES), help="Qwen3 shape of the random model"
    )
    ap.add_argument(
        "--layers", type=int, default=0, help="layers of the random model (0 = the shape's)"
    )
    ap.add_argument(
        "--contexts", default="8192,32768", help="comma-separated decoding contexts ('' = none)"
    )
    ap.add_argument(
        "--budgets", default="0.25,0.125", help="comma-separated fractions of the context"
    )
    ap.add_argument(
        "--policies",
        default="streaming,kvpop-window,kvpop,kvpop-mlp",
        help="comma-separated, besides full",
    )
    ap.add_argument(
        "--steps", type=int, default=16, help="decoding steps timed per row (the median is kept)"
    )
    ap.add_argument(
        "--prefill", type=int, default=0, help="prompt length of the prefill rows (0 = none)"
    )
    ap.add_argument(
        "--train", type=int, default=0, help="sequence length of the training-step rows (0 = none)"
    )
    ap.add_argument("--sinks", type=int, default=4, help="first tokens never evicted")
    ap.add_argument("--window", type=int, default=256, help="recent tokens never evicted")
    ap.add_argument(
        "--d_mem", type=int, default=128, help="the kvpop scorer's memory size (the paper's 128)"
    )
    ap.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"]
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: bf16 on cuda",
    )
    ap.add_argument("--json", help="also write the rows to this file")
    a = ap.parse_args(argv)
    check_flags(ap, a, layers=0, steps=1, prefill=0, train=0, sinks=0, window=1, d_mem=1)
    dev, policies = a.device, [p for p in a.policies.split(",") if p]
    online = (*kvpop.STATIC, *kvpop.DYNAMIC, *kvpop.SCORERS)  # every policy but full and the oracle
    dt = getattr(
        torch, a.dtype if a.dtype != "auto" else "bfloat16" if dev == "cuda" else "float32"
    )
    if not all(x.isdecimal() and int(x) >= 1 for x in a.contexts.split(",") if a.contexts):
        ap.error(f"--contexts {a.contexts!r}: use comma-separated lengths >= 1, e.g. 8192,32768")
    if bad := [p for p in policies if p not in online]:
        ap.error(
            f"--policies: {bad[0]!r} is not a policy that decodes online; choose from {', '.join(online)}"
        )
    budgets = [kvpop.parse_value(ap.prog, "budgets", b, float) for b in a.budgets.split(",")]
    contexts = [int(x) for x in a.contexts.split(",") if a.contexts]
    try:  # every check first: the weights load or are drawn last
        if a.model:
            c = kvpop.Qwen3Config.from_json(
                os.path.join(kvpop.checkpoint_dir(a.model), "config.json")
            )
        # a named shape: layers, hidden, MLP width, query heads, tied head; the rest, shared by
        # every shape,
        else:
            # are Qwen3Config's defaults (vocab, 8 KV heads of 128, rope_theta)
            L, E, F_, Hq, tied = SHAPES[a.shape]
            c = kvpop.Qwen3Config(
                num_hidden_layers=a.layers or L,
                hidden_size=E,
                intermediate_size=F_,
                num_attention_heads=Hq,
                tie_word_embeddings=tied,
                max_position_embeddings=131072,
            )
        torch.manual_seed(0)
        make = {k: kvpop.Scorer(c, k, a.window, a.d_mem).eval().to(dev) for k in kvpop.SCORERS}
        for C, b in [(C, b) for C in contexts for b in budgets] + [
            (T, budgets[0]) for T in (a.prefill, a.train) if T
        ]:
            kvpop.budget_size(b, C, a.sinks, a.window, make["kvpop"].charge)  # no room: raises here
        net = kvpop.Qwen3.from_pretrained(a.model, dev, dt) if a.model else shape_model(c, dev, dt)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    net.requires_grad_(False)  # frozen: the timed passes build no graph
    pol = lambda p: make.get(p, p)  # noqa: E731

    # `full` entries for full, else the budget's less those the scorer's state takes
    def empty_cache(p, b, T, full):
        charge = getattr(pol(p), "charge", 0)
        S = full if p == "full" else kvpop.budget_size(b, T, a.sinks, a.window, charge)[0] - charge
        return kvpop.KVCache(net, 1, S, pol(p), a.sinks, a.window)

    emb = net.model.embed_tokens.weight
    W = sum(
        p.numel() * p.element_size()
        for p in net.parameters()
        if p is not emb or c.tie_word_embeddings
    )
    # KV bytes of a token
    per_tok = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * dt.itemsize
    print(
        f"{a.model or f'Qwen3-{a.shape} shape, {c.num_hidden_layers} layers, random weights'}; {dev} "
        f"({torch.cuda.get_device_name() if dev == 'cuda' else f'{torch.get_num_threads()} threads'}), "
        f"{str(dt)[6:]}; weights read per step {W / 1e9:.2f} GB; sinks {a.sinks}, window {a.window}\n"
    )
    med = lambda t: sorted(t[1:])[len(t) // 2 - 1]  # noqa: E731 (after the warm-up round)
    rows = []
    if contexts:
        print(
            table(
                "policy",
                "budget",
                "context",
                "tokens/s",
                "speedup",
                "ideal",
                "of ideal",
                "KV+state MiB",
                "GB/s",
                "limit GB/s",
                "of limit",
                "scorer share",
            )
        )
    # every row of a context in one cache each, stepped in turn with the limit: the same minutes
    for C in contexts:
        # a model-sized matrix
        M = torch.randn(W // (c.hidden_size * dt.itemsize), c.hidden_size, device=dev).to(dt)
        x, tok, runs, lim = (
            torch.randn(c.hidden_size, device=dev, dtype=dt),
            torch.tensor([[13]], device=dev),
            {},
            [],
        )
        for p, b in [("full", 1)] + [(p, b) for b in budgets for p in policies]:
            cache = empty_cache(p, b, C, C + a.steps + 1)
            # the cache, the entries it holds, its step times
            runs[p, b] = cache, fill(cache, C), []
        for _ in range(a.steps + 1):  # the first round warms up
            lim.append(clock(lambda: M @ x, dev))
            for cache, n, sec in runs.values():
                sec.append(clock(lambda: net(tok, cache=cache), dev))
        limit = M.numel() * dt.itemsize / med(lim) / 1e9
        # full first: its seconds and bytes are the context's yardstick
        for (p, b), (cache, n, times) in runs.items():
            sec = med(times)
            # held + state
            kv = cache.nbytes() - 2 * cache.k.numel() * cache.k.element_size() + per_tok * n
            # + a scorer's
            w = (
                W + sum(t.numel() * t.element_size() for t in make[p].parameters())
                if p in make
                else W
            )
            full = (sec, W + kv) if p == "full" else full
            su, ideal, gbps = full[0] / sec, full[1] / (w + kv), (w + kv) / sec / 1e9
            r = dict(
                policy=p,
                budget=b,
                context=C,
                tokens_per_s=round(1 / sec, 3),
                kv_mib=kv / 2**20,
                gbps=gbps,
                limit_gbps=limit,
                speedup=su,
                ideal_speedup=ideal,
            )
            # the scorer's share: against streaming's step in the
            if p in kvpop.SCORERS and ("streaming", b) in runs:
                # same round
                r["scorer_share"] = 1 - med([x / y for x, y in zip(runs["streaming", b][2], times)])
            share = f"{r['scorer_share']:.1%}" if "scorer_share" in r else "-"
            print(
                f"| {p} | {b:g} | {C} | {1 / sec:.2f} | {su:.2f}x | {ideal:.2f}x | {su / ideal:.0%} | "
                f"{kv / 2**20:.0f} | {gbps:.1f} | {limit:.1f} | {gbps / limit:.0%} | {share} |",
                flush=True,
            )
            rows.append({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()})
        del runs, M
    # a prompt into an empty cache: full, then each policy at budgets[0]
    for T in [a.prefill] * bool(a.prefill):
        idx, b = torch.randint(0, net.config.vocab_size, (1, T), device=dev), budgets[0]
        print(
            f"\nprefill of a {T}-token prompt, logits of its last position\n\n"
            + table(
                "policy",
                "budget",
                "seconds",
                "vs full",
                "cache MiB",
                "peak extra MiB",
                "peak MiB",
                "full's extra + budget's share MiB",
            )
        )
        for p in ["full"] + [p for p in policies if kvpop.policy_kind(pol(p)) == "static"]:
            cache = empty_cache(p, b, T, T)
            (sec, extra), mem = peak(lambda: net(idx, cache=cache), dev), cache.nbytes()
            # full's extra: one layer's working set
            full = (sec, mem, extra) if p == "full" else full
            rows.append(
                dict(
                    policy=p,
                    budget=1 if p == "full" else b,
                    prefill=T,
                    seconds=round(sec, 2),
                    cache_mib=round(mem / 2**20, 1),
                    peak_mib=round((mem + extra) / 2**20, 1),
                )
            )
            print(
                f"| {p} | {rows[-1]['budget']:g} | {sec:.1f} | {full[0] / sec:.2f}x | {mem / 2**20:.0f} | "
                f"{extra / 2**20:.0f} | {(mem + extra) / 2**20:.0f} | "
                f"{'-' if p == 'full' else round((b * full[1] + full[2]) / 2**20)} |",
                flush=True,
            )
            del cache
    # one training step of the first learned policy, through train.py's own loss, timed by part
    if a.train:
        import train

        kind = next((p for p in policies if p in kvpop.SCORERS), "kvpop-window")
        T, b, scorer = a.train, budgets[0], make[kind].train()
        pool = kvpop.budget_size(b, T, a.sinks, a.window, scorer.charge)[1]
        idx, seen = torch.randint(0, net.config.vocab_size, (1, T), device=dev), []

        def attn(i, q, k, v, pos):  # the frozen forward, keeping what the targets are made of
            y, lse = kernels.attention(q, k, v)
            seen.append((q, k, v, lse))
            return y

        forward = clock(lambda: net(idx, attn=attn, head=False), dev)
        rs = []  # every layer's future-attention target r* (the default, max)
        targets = clock(
            lambda: rs.extend(
                kernels.future_attention(q, k, lse, a.window, reduce="max") for q, k, v, lse in seen
            ),
            dev,
        )
        # the teacher's eviction times, as boundary_loss makes them
        pos = torch.arange(T, device=dev)
        evict = clock(
            lambda: [
                kernels.eviction_times(
                    r + F.softplus(scorer.theta[i]).detach()[:, None] * pos, a.sinks, a.window, pool
                )
                for i, r in enumerate(rs)
            ],
            dev,
        )
        q = torch.arange(a.sinks + a.window + pool, T)  # every query at which the pool is over-full
        kv = [(k, v) for _, k, v, _ in seen]
        # fwd + bwd
        loss = clock(lambda: train.boundary_loss(scorer, kv, rs, q, a.sinks, a.window, pool), dev)
        parts = {
            "frozen forward": forward,
            "future-attention targets": targets,
            "eviction times": evict,
            # boundary_loss makes the eviction times again
            "scorer forward + backward": loss - evict,
        }
        total = sum(parts.values())
        print(
            f"\n{kind} scorer training step, 1 x {T} tokens, budget {b:g}\n\n"
            + table("part", "seconds", "share")
            + "".join(f"\n| {k} | {v:.2f} | {v / total:.0%} |" for k, v in parts.items())
        )
        rows += [dict(train=T, kind=kind, part=k, seconds=round(v, 3)) for k, v in parts.items()]
    if a.json:
        kvpop.write_json(rows, a.json)


if __name__ == "__main__":
    commands = {"kernels": cmd_kernels, "quality": cmd_quality, "speed": cmd_speed}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        raise SystemExit(
            f"usage: python bench.py {{{','.join(commands)}}} [options]  (-h after a command for help)"
        )
    commands[sys.argv[1]](sys.argv[2:])
