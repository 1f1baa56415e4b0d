"""Benchmarks: `python bench.py <command> [options]`, one function per command (`-h` lists its options).

kernels: each kernels.py operation vs its naive dense version (T x T matrices), and vs PyTorch's
         scaled_dot_product_attention on CUDA; prints time and peak extra memory as a markdown table.
quality: every eviction policy on held-out sequences of the baby's long-range recall task (defined here,
         train.py trains on it): answer accuracy, far accuracy, accuracy relative to full, KL to full.
"""
import argparse
import json
import math
import os
import random
import sys
import time
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
import kvpop


# ------------------------------------------------------------------------------------------------ kernels

def naive_attention(q, k, v, evict_at=None, sinks=0):
    T, G = q.shape[2], q.shape[1] // k.shape[1]
    s = q.float() @ k.float().repeat_interleave(G, 1).transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, Hq, T, T)
    i, t = torch.arange(T, device=q.device)[:, None], torch.arange(T, device=q.device)
    vis = t <= i
    if evict_at is not None:
        vis = vis & ((t < sinks) | (i < evict_at.repeat_interleave(G, 1)[:, :, None, :]))
    lse = s.masked_fill(~vis, -math.inf).logsumexp(-1)
    return (s - lse[..., None]).exp().masked_fill(~vis, 0) @ v.float().repeat_interleave(G, 1), lse


def naive_future(q, k, lse, window, eps=1e-6):
    (B, Hq, T, D), Hkv = q.shape, k.shape[1]
    p = (q.float() @ k.float().repeat_interleave(Hq // Hkv, 1).transpose(-1, -2) * D ** -0.5 - lse[..., None]).exp()
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
    """CPU peak meter: bytes of the storages ops create while active, dropped from the count when freed."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = set(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}  # views, in-place
        for x in out if isinstance(out, (tuple, list)) else [out]:
            s = x.untyped_storage() if isinstance(x, torch.Tensor) else None
            if s is None or s.nbytes() == 0 or s.data_ptr() in ins or s.data_ptr() in self.live:
                continue
            self.live.add(s.data_ptr())
            self.now += s.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(s, self._free, s.data_ptr(), s.nbytes())
        return out

    def _free(self, ptr, n):
        self.live.discard(ptr)
        self.now -= n


def measure(fn, dev, reps=3):
    """Best wall time in ms over `reps` runs after a warm-up, and peak extra memory in MiB."""
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    times = []
    for _ in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    if dev == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        return min(times[1:]) * 1e3, (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    with LiveBytes() as meter:
        fn()
    return min(times[1:]) * 1e3, meter.peak / 2 ** 20


def cmd_kernels(argv):
    """Time and peak memory of each kernels.py op vs its naive dense version (and SDPA on CUDA)."""
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(prog="bench.py kernels", description=cmd_kernels.__doc__)
    ap.error = lambda msg: sys.exit(f"bench.py kernels: {msg}")  # one line, exit status 1
    ap.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--T", help="comma-separated lengths (default 4096,16384,32768 on CUDA, 1024,2048,4096 on CPU)")
    ap.add_argument("--D", type=int, default=128, help="head dim")
    ap.add_argument("--group", type=int, default=2, help="query heads of the one KV head timed")
    a = ap.parse_args(argv)
    a.T = ("4096,16384,32768" if a.device == "cuda" else "1024,2048,4096") if a.T is None else a.T
    if a.device == "cuda" and not cuda:
        ap.error("--device cuda: no CUDA GPU is visible; use --device cpu")
    if not all(x.strip().isdecimal() and int(x) >= 1 for x in a.T.split(",")):
        ap.error(f"--T {a.T!r}: use comma-separated lengths >= 1, e.g. 1024,2048")
    if a.D < 1 or a.device == "cuda" and a.D > 256:
        ap.error(f"--D {a.D}: use a head dim >= 1 (at most 256 on CUDA, the Triton kernels' limit)")
    if a.group < 1:
        ap.error(f"--group {a.group}: use 1 or more query heads")
    dev, dt, sinks, window = a.device, torch.bfloat16 if a.device == "cuda" else torch.float32, 4, 256
    print(f"{dev}, {dt}, D {a.D}, 1 KV head x {a.group} query heads, sinks {sinks}, window {window}, pool T/4\n")
    print("| op | T | ours ms | naive ms | naive/ours | SDPA ms | ours MiB | naive MiB | naive/ours |")
    print("|---" * 9 + "|")
    for T in map(int, a.T.split(",")):
        q = torch.randn(1, a.group, T, a.D, device=dev, dtype=dt)
        k, v = (torch.randn(1, 1, T, a.D, device=dev, dtype=dt) for _ in range(2))
        pri = torch.randn(1, 1, T, device=dev)
        e, lse = kernels.eviction_times(pri, sinks, window, T // 4), kernels.attention(q, k, v)[1]
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        for name, ours, naive, ref in [
                ("attention", lambda: kernels.attention(q, k, v), lambda: naive_attention(q, k, v), sdpa),
                ("attention+evict", lambda: kernels.attention(q, k, v, e, sinks),
                 lambda: naive_attention(q, k, v, e, sinks), None),
                ("future_attention", lambda: kernels.future_attention(q, k, lse, window),
                 lambda: naive_future(q, k, lse, window), None),
                ("eviction_times", lambda: kernels.eviction_times(pri, sinks, window, T // 4),
                 lambda: naive_eviction_times(pri, sinks, window, T // 4), None)]:
            (to, mo), (tn, mn) = measure(ours, dev), measure(naive, dev)
            ts = f"{measure(ref, dev)[0]:.1f}" if ref is not None and dev == "cuda" else "-"
            print(f"| {name} | {T} | {to:.1f} | {tn:.1f} | {tn / to:.2f} | {ts} | {mo:.1f} | {mn:.1f} | "
                  f"{mn / max(mo, 1e-3):.0f} |", flush=True)


# ----------------------------------------------------------------------------------------------------------
# the baby's task (issue [4/6]): multi-query associative recall in single-token Qwen3 words. A binding is
# the bigram `key value`; a later `key value'` reassigns (the old value is useless from then on); a query is
# `key value` with the current value, predicted at the key. Fillers are never needed again.

KEYS = "name time data value type file user key size state model color group table game car".split()
VALUES = ("new true false null good best free real high long last first open main right same next top class "
          "public return void static string array number object event error text line point item list case "
          "world people child year day man work hand play view style method post path system message index "
          "order head action report build check count start find show help read").split()
FILLERS = ("the of and to in is for on with that it as at by or be we you are was not but from have he his "
           "they their has been were would").split()
TASK_RANKS = 1974  # Qwen3 ranks a cut vocabulary must keep so that every word above is one token (" order": 1973)


def task_ids(tok):
    """Word -> token id for every task word (each must be one token), and the bos id."""
    ids = {}
    for w in KEYS + VALUES + FILLERS:
        t = tok.encode(" " + w)
        if len(t) != 1:
            raise ValueError(f"task word {w!r} is {len(t)} tokens for this tokenizer; the task needs one each")
        ids[w] = t[0]
    return ids, tok.special["<|endoftext|>"]


def task(rng, T, keys=8, p_mention=0.06, p_reassign=0.1, p_oldest=0.7):
    """One sequence of T words (after bos) -> words, [(q, value, q - p)]: at position q (a key) the next word
    is `value`, last written at position p. Keys are bound first; later mentions go mostly to the key
    mentioned longest ago, which is what puts bindings far back."""
    K = rng.sample(KEYS, min(keys, len(KEYS), max(2, T // 32)))
    words, val, last, ans = ["<|endoftext|>"], {}, {}, []
    while len(words) < T:
        if len(words) == T - 1 or rng.random() >= (0.3 if len(val) < len(K) else p_mention):
            words.append(rng.choice(FILLERS))
            continue
        q = len(words)
        if len(val) < len(K):  # bind the next unbound key
            k = K[len(val)]
            val[k] = rng.choice(VALUES)
        else:
            k = min(K, key=last.get) if rng.random() < p_oldest else rng.choice(K)
            if rng.random() < p_reassign:
                val[k] = rng.choice([v for v in VALUES if v != val[k]])
            else:
                ans.append((q, val[k], q - last[k]))
        words += [k, val[k]]
        last[k] = q + 1
    return words, ans


def task_batch(tok, n, T, rng, **kw):
    """n sequences -> idx (n, T) token ids, tgt (n, T) answer ids (-1 elsewhere), dist (n, T) how far back
    the answer was last written (0 elsewhere)."""
    ids, bos = task_ids(tok)
    idx, tgt, dist = (torch.full((n, T), f, dtype=torch.long) for f in (bos, -1, 0))
    for b in range(n):
        words, ans = task(rng, T, **kw)
        idx[b, 1:] = torch.tensor([ids[w] for w in words[1:]])
        for q, v, d in ans:
            tgt[b, q], dist[b, q] = ids[v], d
    return idx, tgt, dist


def quality_runs(net, idx, tgt, dist, policies, budgets, sinks, window, chunk=64):
    """Every (policy, budget) on the same sequences, teacher-forced through kvpop.evaluate -> rows of
    accuracy on all queries, on far ones, relative to full, and mean KL(full || policy) past position B."""
    size = lambda b: kvpop.budget_size(b, idx.shape[1], sinks, window)[0]  # noqa: E731
    far = dist >= max(map(size, budgets)) - sinks  # out of reach of a plain window at every budget
    name = lambda p: p if isinstance(p, str) else p.kind  # noqa: E731 (a learned scorer is named by its kind)
    runs = [("full", 1)] + [(p, b) for p in policies if p != "full" for b in budgets]
    hit, kl = {r: [] for r in runs}, {r: [] for r in runs}
    for c in range(0, len(idx), chunk):  # full-vocabulary log-probs of a chunk, then every run on it
        x, m = idx[c:c + chunk], tgt[c:c + chunk] >= 0
        full = kvpop.evaluate(net, x, "full", 1, sinks, window, online=False).float().log_softmax(-1)
        for p, b in runs:
            lp = full if p == "full" else kvpop.evaluate(
                net, x, p, b, sinks, window, online=name(p) in kvpop.DYNAMIC).float().log_softmax(-1)
            hit[p, b].append(lp.argmax(-1)[m] == tgt[c:c + chunk][m])
            kl[p, b].append((full.exp() * (full - lp)).sum(-1)[:, size(b):].flatten())  # (chunk * (T - B),)
    far, rows = torch.cat([far[c:c + chunk][tgt[c:c + chunk] >= 0] for c in range(0, len(idx), chunk)]), []
    for p, b in runs:
        h, k = torch.cat(hit[p, b]).float(), torch.cat(kl[p, b])
        acc = h.mean().item()
        rel = acc / (rows[0]["accuracy"] if rows else acc)
        rows.append(dict(policy=name(p), budget=b, accuracy=round(acc, 4), far_accuracy=round(h[far].mean().item(), 4),
                         relative=round(rel, 4), kl=round(k.mean().item(), 4) if len(k) else 0.0))
    return rows, far.float().mean().item(), len(far)


def quality_table(rows):
    return "| policy | budget | accuracy | far accuracy | relative | KL |\n|---|---|---|---|---|---|\n" + "\n".join(
        f"| {r['policy']} | {r['budget']:g} | {r['accuracy']:.1%} | {r['far_accuracy']:.1%} | {r['relative']:.3f} | "
        f"{r['kl']:.3f} |" for r in rows)


def cmd_quality(argv):
    """Eviction quality of every policy on held-out sequences of the baby's recall task (teacher-forced)."""
    ap = argparse.ArgumentParser(prog="bench.py quality", description=cmd_quality.__doc__)
    ap.error = lambda msg: sys.exit(f"bench.py quality: {msg}")  # one line, exit status 1
    ap.add_argument("--model", default="baby", help="checkpoint folder (default: the shipped baby)")
    ap.add_argument("--scorer", default="baby/kvpop,baby/kvpop-mlp",
                    help="comma-separated learned scorer folders, a row each, named by kind ('' for none)")
    ap.add_argument("--policies", default="full,oracle,streaming,h2o,tova,knorm,random", help="comma-separated")
    ap.add_argument("--budgets", default="0.25,0.125", help="comma-separated fractions of T (or integers B)")
    ap.add_argument("--seed", type=int, default=0, help="held-out task seed (training draws other streams)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--n", type=int, default=128, help="sequences")
    ap.add_argument("--T", type=int, default=512, help="tokens per sequence")
    ap.add_argument("--sinks", type=int, default=4, help="first tokens never evicted")
    ap.add_argument("--window", type=int, default=32, help="recent tokens never evicted")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (tiny ops: a second one mostly waits)")
    a = ap.parse_args(argv)
    policies = a.policies.split(",")
    for p in policies:
        if p not in kvpop.POLICIES:
            ap.error(f"--policies: unknown policy {p!r}; choose from {','.join(kvpop.POLICIES)}")
    budgets = [kvpop.parse_value(ap.prog, "budgets", b, float) for b in a.budgets.split(",")]  # not inf, nan, ''
    for flag, least in [("n", 1), ("T", 64), ("sinks", 0), ("window", 1), ("threads", 1)]:
        if getattr(a, flag) < least:
            ap.error(f"--{flag} {getattr(a, flag)}: use {least} or more")
    folder = os.path.dirname(a.json or "") or "."
    if a.json and (os.path.isdir(a.json) or not os.path.isdir(folder) or not os.access(folder, os.W_OK)):
        ap.error(f"--json {a.json}: give a file name in an existing, writable folder")
    try:
        limit = kvpop.Qwen3Config.from_json(os.path.join(kvpop.checkpoint_dir(a.model), "config.json"))
        scorers = [kvpop.Scorer.from_pretrained(d) for d in a.scorer.split(",") if d]
        for s in [None] + scorers:  # a bad budget, or a scorer for another model or window, raises here
            if s is not None:
                s.check(limit, a.window)
            for b in budgets:
                kvpop.budget_size(b, a.T, a.sinks, a.window, getattr(s, "charge", 0))
        if a.T > limit.max_position_embeddings:  # checked before the weights load
            raise ValueError(f"--T {a.T}: the model has {limit.max_position_embeddings} positions; lower --T")
        torch.set_num_threads(a.threads)
        net = kvpop.Qwen3.from_pretrained(a.model, dtype=torch.float32)
        tok = kvpop.Tokenizer.from_pretrained(kvpop.checkpoint_dir(a.model))
        idx, tgt, dist = task_batch(tok, a.n, a.T, random.Random(f"test-{a.seed}"))
    except (OSError, ValueError) as e:
        ap.error(str(e))
    t0 = time.time()
    rows, far, n = quality_runs(net, idx, tgt, dist, policies + scorers, budgets, a.sinks, a.window)
    print(f"{a.model}: {a.n} held-out sequences of {a.T} tokens (seed {a.seed}), {n} queries ({far:.0%} far), "
          f"sinks {a.sinks}, window {a.window}\n")
    print(quality_table(rows))
    print(f"\n{time.time() - t0:.0f}s")
    if a.json:
        with open(a.json + ".tmp", "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(a.json + ".tmp", a.json)


if __name__ == "__main__":
    commands = {"kernels": cmd_kernels, "quality": cmd_quality}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        raise SystemExit(f"usage: python bench.py {{{','.join(commands)}}} [options]  (-h after a command for help)")
    commands[sys.argv[1]](sys.argv[2:])
