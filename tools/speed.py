"""bench.py speed and kernels' runs: a random Qwen3 of a shape, a cache filled as if it had read C
tokens, the decoding, prefill and training-step rows; each kernels.py op timed against its naive
version, or compiled per GPU."""

import os

import torch
import torch.nn.functional as F

import kernels
import kvpop
import qwen3
from cache import KVCache
from support import checkpoint, gpus
from tools.timing import calls, clock, peak, table


def compile_targets(opts, need):
    """--targets: every kernel compiled for each GPU (gpus.py), a row printed as it comes."""
    targets = opts.targets.split(",")
    known = ",".join(gpus.SHARED_KIB)
    ok = set(targets) <= set(gpus.SHARED_KIB)
    need(ok, f"--targets {opts.targets}: use GPUs among {known}")
    ptxas = gpus.ptxas()
    why = "reinstall triton (its wheel ships ptxas)"
    need(os.path.isfile(ptxas), f"--targets: no {ptxas}; {why}")
    cols = "kernel,target,dtype,head_dim,tiles,stages,warps"
    print(table(cols + ",shared,limit,registers,spills,ok"))
    # a row's cells, a refusal's reason marked
    cell = lambda k, v: f"refused: {v}" if k == "refused" else str(v)
    rows = []
    for row in gpus.compile_targets(targets):
        rows.append(row)
        cells = [cell(k, v) for k, v in row.items()]
        print("| " + " | ".join(cells) + " |", flush=True)
    if opts.json:
        # a refused row is not ok
        rows = [dict(row, ok=row.get("ok", False)) for row in rows]
        checkpoint.write_json(rows, opts.json)


def kernel_rows(dev, D, group, lengths):
    """Each kernels.py op at each length T, ours against its naive plain_ version (and SDPA on a
    GPU): a row printed as it comes, best ms of 3 after a warm-up and peak MiB."""
    sinks, window = 4, 256
    dt = torch.float32 if dev == "cpu" else torch.bfloat16

    # best ms of 3 after a warm-up, and peak MiB
    def measure(fn):
        times = [clock(fn, dev) for _ in range(4)]
        return min(times[1:]) * 1e3, peak(fn, dev)[1] / 2**20

    heads = f"1 KV head x {group} query heads"
    print(f"{dev}, {dt}, D {D}, {heads}", end=", ")
    print(f"sinks {sinks}, window {window}, pool T/4\n")
    cols = "op,T,ours ms,naive ms,naive/ours"
    print(table(cols + ",SDPA ms,ours MiB,naive MiB,naive/ours"))
    attend = F.scaled_dot_product_attention
    for T in lengths:
        draw = lambda h: torch.randn(1, h, T, D, device=dev, dtype=dt)
        q, k, v = draw(group), draw(1), draw(1)
        pri = torch.randn(1, 1, T, device=dev)
        pool = T // 4
        e = kernels.eviction_times(pri, sinks, window, pool)
        lse = kernels.attention(q, k, v)[1]
        sdpa = lambda: attend(q, k, v, is_causal=True, enable_gqa=True)
        # each op, ours and its naive plain_ version, on the same inputs
        ops = [("attention", (q, k, v))]
        ops += [("attention+evict", (q, k, v, e, sinks))]
        ops += [("future_attention", (q, k, lse, window))]
        ops += [("eviction_times", (pri, sinks, window, pool))]
        for name, x in ops:
            op = name.split("+")[0]
            ours = getattr(kernels, op)
            naive = getattr(kernels, "plain_" + op)
            ours_ms, ours_mib = measure(lambda: ours(*x))
            naive_ms, naive_mib = measure(lambda: naive(*x))
            sdpa_ms = "-"
            if name == "attention" and dev != "cpu":
                sdpa_ms = f"{measure(sdpa)[0]:.1f}"
            ms = f"{ours_ms:.1f} | {naive_ms:.1f} | {naive_ms / ours_ms:.2f}"
            mib_ratio = naive_mib / max(ours_mib, 1e-3)
            mib = f"{ours_mib:.1f} | {naive_mib:.1f} | {mib_ratio:.0f}"
            print(f"| {name} | {T} | {ms} | {sdpa_ms} | {mib} |", flush=True)


# ---------------------- speed: a step reads every weight and every kept key and value once: its cost follows bytes
# a shape: layers, hidden, MLP width, query heads, tied head; the rest: Qwen3Config's (vocab, 8 KV heads of 128, ...)
SHAPES = {
    "0.6B": (28, 1024, 3072, 16, True),
    "4B": (36, 2560, 9728, 32, True),
    "8B": (36, 4096, 12288, 32, False),
}


# the bytes a token's key and value take in every layer's cache: what a step reads per token held
def token_bytes(c, dt):
    heads = c.num_hidden_layers * c.num_key_value_heads
    return 2 * heads * c.head_dim * dt.itemsize


# the config of --model's checkpoint, else of a random Qwen3 of --shape (--layers of them)
def shape_config(opts):
    if opts.model:
        folder = checkpoint.checkpoint_dir(opts.model)
        return qwen3.Qwen3Config.from_json(os.path.join(folder, "config.json"))
    L, E, intermediate, Hq, tied = SHAPES[opts.shape]
    c = qwen3.Qwen3Config(hidden_size=E, intermediate_size=intermediate)
    c.num_attention_heads = Hq
    c.tie_word_embeddings = tied
    c.num_hidden_layers = opts.layers or L
    c.max_position_embeddings = 131072
    return c


# a Qwen3 with random weights, built without initialising twice
def shape_model(c, device, dtype):
    with torch.device("meta"):
        net = qwen3.Qwen3(c)
    # unties the head, and the memory may hold denormals that slow a CPU: fill it
    net.to_empty(device=device)
    if c.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    for p in net.parameters():
        p.data.normal_(0, 0.02) if p.dim() > 1 else p.data.fill_(1.0)
    return net.to(dtype).eval()


# a cache for T tokens at budget b: `full` entries for full, else the budget's less those a scorer's state takes
def empty_cache(net, policy, b, T, full, opts, dt):
    charge = kvpop.state_charge(policy, dt)
    size = kvpop.budget_size(b, T, opts.sinks, opts.window, charge)[0]
    slots = full if policy == "full" else size - charge
    return KVCache(net, 1, slots, policy, opts.sinks, opts.window)


def fill(cache, C):
    """Make the cache look as if it had read C tokens (sinks, a pool spread over the past, the
    window), with synthetic keys and values: a step costs the same whatever they hold. Returns the
    entries held."""
    sinks, window = cache.sinks, cache.window
    pos = torch.arange(C)
    if C > cache.slots:
        pool_size = cache.slots - sinks - window
        pool = torch.linspace(sinks, C - window - 1, pool_size).long()
        recent = torch.arange(C - window, C)
        pos = torch.cat([torch.arange(sinks), pool, recent])
    n = len(pos)
    cache.k[..., :n, :].normal_()
    cache.v[..., :n].normal_()  # values are stored transposed
    cache.pos[..., :n] = pos.to(cache.pos.device)
    cache.pi[..., :n] = torch.rand(n)
    cache.t.fill_(C)
    # a learned scorer's state charged to the budget (kvpop's memories), as if it had read every token
    for x in cache.decoder.state if cache.decoder else ():
        x.normal_(0, 0.01)
    return n


def time_steps(net, step, scorers, opts, dt, W, C, budgets, policies):
    """Full's cache, then each policy's at each budget, filled as at context C, each stepped
    opts.steps + 1 times in turn (the first round warms up), beside a model-sized matrix-vector
    product -> ({(policy, budget): (cache, entries held, step seconds)}, the product's GB/s: the
    limit)."""
    dev, E = opts.device, net.config.hidden_size
    # a model-sized matrix
    height = W // (E * dt.itemsize)
    M = torch.randn(height, E, device=dev).to(dt)
    x = torch.randn(E, device=dev, dtype=dt)
    tok = torch.tensor([[13]], device=dev)
    runs, lim = {}, []
    # the cache, the entries it holds, its step times
    pairs = [("full", 1)] + [(p, b) for b in budgets for p in policies]
    full_size = C + opts.steps + 1
    for p, b in pairs:
        kind = scorers.get(p, p)
        cache = empty_cache(net, kind, b, C, full_size, opts, dt)
        runs[p, b] = cache, fill(cache, C), []
    # the first round warms up
    for _ in range(opts.steps + 1):
        lim.append(clock(lambda: M @ x, dev))
        for cache, n, sec in runs.values():
            sec.append(clock(lambda: step(tok, cache=cache), dev))
    return runs, M.numel() * dt.itemsize / median(lim) / 1e9


# the median of a row's step times, after the warm-up round
def median(times):
    return sorted(times[1:])[len(times) // 2 - 1]


# a decoding row's markdown cells
def decode_cells(r, sec, limit):
    share = "-"
    if "scorer_share" in r:
        share = f"{r['scorer_share']:.1%}"
    run = f"| {r['policy']} | {r['budget']:g} | {r['context']} | {1 / sec:.2f}"
    speedup, ideal, gbps = r["speedup"], r["ideal_speedup"], r["gbps"]
    gain = f"{speedup:.2f}x | {ideal:.2f}x | {speedup / ideal:.0%}"
    held = f"{r['kv_mib']:.0f} | {gbps:.1f}"
    of_limit = f"{limit:.1f} | {gbps / limit:.0%}"
    counted = " / ".join(map(str, r["calls"].values()))
    return f"{run} | {gain} | {held} | {of_limit} | {share} | {counted} |"


def speed_decode(net, scorers, opts, dt, W, contexts, budgets, policies):
    """The decoding rows: tokens/s of full, then each policy at each budget, beside the bytes a step
    reads (W of weights) and a model-sized matrix-vector product (the limit); a context's rows
    stepped in turn: the same minutes."""
    c, dev = net.config, opts.device
    rows = []
    mode = "reduce-overhead" if dev.startswith("cuda") else None
    step = net
    if opts.compile:
        step = torch.compile(net, fullgraph=True, dynamic=False, mode=mode)
    per_tok = token_bytes(c, dt)
    tok = torch.tensor([[13]], device=dev)
    # a row's floats to 4 decimals
    four = lambda v: round(v, 4) if isinstance(v, float) else v
    cols = "policy,budget,context,tokens/s,speedup,ideal,of ideal"
    cols += ",KV+state MiB,GB/s,limit GB/s,of limit,scorer share"
    cols += ",calls a step eager" + " / compiled" * opts.compile
    print(table(cols))
    for C in contexts:
        runs, limit = time_steps(net, step, scorers, opts, dt, W, C, budgets, policies)
        # full first: its seconds and bytes are the context's yardstick
        for (p, b), (cache, n, times) in runs.items():
            sec = median(times)
            # held + state
            kv = cache.nbytes() - 2 * cache.k.nbytes + per_tok * n
            w = W
            if p in scorers:
                w = W + sum(t.nbytes for t in scorers[p].parameters())
            full = (sec, W + kv) if p == "full" else full
            speedup = full[0] / sec
            ideal = full[1] / (w + kv)
            gbps = (w + kv) / sec / 1e9
            r = dict(policy=p, budget=b, context=C)
            r.update(tokens_per_s=round(1 / sec, 3))
            r.update(kv_mib=kv / 2**20, gbps=gbps, limit_gbps=limit)
            r.update(speedup=speedup, ideal_speedup=ideal)
            # the scorer's share of a step: 1 - streaming's step / the scorer's, same round
            if p in kvpop.SCORERS and ("streaming", b) in runs:
                streaming = runs["streaming", b][2]
                ratios = [x / y for x, y in zip(streaming, times)]
                r["scorer_share"] = 1 - median(ratios)
            # the torch calls of a step, eager and compiled (those its graph leaves to torch):
            # one more step each
            eager = calls(lambda: net(tok, cache=cache))
            r["calls"] = dict(eager=eager)
            if opts.compile:
                compiled = calls(lambda: step(tok, cache=cache))
                r["calls"]["compiled"] = compiled
            print(decode_cells(r, sec, limit), flush=True)
            rows.append({k: four(v) for k, v in r.items()})
        del runs
    return rows


def speed_prefill(net, scorers, opts, dt, b, policies):
    """Prefill rows: seconds and peak memory of a prompt into an empty cache, full, then each static
    policy at b."""
    T, dev = opts.prefill, opts.device
    rows = []
    mib = lambda x: round(x / 2**20, 1)
    idx = torch.randint(0, net.config.vocab_size, (1, T), device=dev)
    cols = "policy,budget,seconds,vs full,cache MiB,peak extra MiB,peak MiB"
    cols += ",full's extra + budget's share MiB"
    title = f"prefill of a {T}-token prompt, logits of its last position"
    print(f"\n{title}\n\n" + table(cols))
    static = [p for p in policies if p not in kvpop.DYNAMIC]
    for p in ["full"] + static:
        cache = empty_cache(net, scorers.get(p, p), b, T, T, opts, dt)
        sec, extra = peak(lambda: net(idx, cache=cache), dev)
        mem = cache.nbytes()
        # full's extra: one layer's working set
        full = (sec, mem, extra) if p == "full" else full
        budget, share = 1, "-"
        if p != "full":
            budget = b
            share = round((b * full[1] + full[2]) / 2**20)
        row = dict(policy=p, budget=budget, prefill=T, seconds=round(sec, 2))
        sizes = dict(cache_mib=mib(mem), peak_mib=mib(mem + extra))
        rows.append(row | sizes)
        held = (mem, extra, mem + extra)
        mibs = " | ".join(f"{x / 2**20:.0f}" for x in held)
        timing = f"{sec:.1f} | {full[0] / sec:.2f}x"
        print(f"| {p} | {budget:g} | {timing} | {mibs} | {share} |", flush=True)
        del cache
    return rows


def speed_train(net, scorers, opts, dt, b, policies):
    """One training step of the first learned policy at budget b, timed part by part: the loss
    train.py's scorer_loss takes in one process (kvpop.boundary_loss, backward, layer by layer)."""
    learned = (p for p in policies if p in kvpop.SCORERS)
    kind = next(learned, "kvpop-window")
    T, dev = opts.train, opts.device
    sinks, window = opts.sinks, opts.window
    seen, rs = [], []
    scorer = scorers[kind].train()
    pool = kvpop.budget_size(b, T, sinks, window, scorer.charge(dt))[1]
    idx = torch.randint(0, net.config.vocab_size, (1, T), device=dev)

    # the frozen forward, keeping what the targets are made of
    def attn(i, q, k, v, pos):
        y, lse = kernels.attention(q, k, v)
        seen.append((q, k, v, lse))
        return y

    # the frozen forward with its logits: the default target (helpful) weighs each query by P(next token)
    forward = lambda: seen.append(net(idx, attn=attn))
    parts = {"frozen forward": clock(forward, dev)}
    lw = kvpop.next_logp(seen[-1], idx)
    seen = seen[:-1]

    # every layer's future-attention target r*
    def future():
        for q, k, _, lse in seen:
            r = kernels.future_attention(q, k, lse - lw, window, reduce="max")
            rs.append(r)

    parts["future-attention targets"] = clock(future, dev)
    # the teacher's eviction times, as kvpop.boundary_loss makes them
    pos = torch.arange(T, device=dev)
    teacher = lambda i, r: r + scorer.recency(i, pos).detach()
    evict_at = lambda pri: kernels.eviction_times(pri, sinks, window, pool)
    evict = lambda: [evict_at(teacher(i, r)) for i, r in enumerate(rs)]
    parts["eviction times"] = clock(evict, dev)
    # the queries where the pool is over-full
    q = torch.arange(sinks + window + pool, T)
    kv = [(k, v) for _, k, v, _ in seen]
    # fwd + bwd, less the eviction times kvpop.boundary_loss makes again
    budgets = [kvpop.Budget(sinks, window, pool)]

    # each layer's boundary loss, backward
    def step():
        for i, ((k, v), r) in enumerate(zip(kv, rs)):
            pi = scorer(i, k, v, pos)
            edge = (pi, teacher(i, r), [q], budgets, len(kv))
            kvpop.boundary_loss(*edge)[0].backward()

    loss = clock(step, dev)
    parts["scorer forward + backward"] = loss - parts["eviction times"]
    total = sum(parts.values())
    print(f"\n{kind} scorer training step, 1 x {T} tokens, budget {b:g}\n")
    print(table("part,seconds,share"))
    for k, v in parts.items():
        print(f"| {k} | {v:.2f} | {v / total:.0%} |")
    row = lambda k, v: dict(train=T, kind=kind, part=k, seconds=round(v, 3))
    return [row(k, v) for k, v in parts.items()]




def speed_rows(net, scorers, opts, dt, contexts, budgets, policies):
    """bench.py speed's rows: its title, then the decoding rows at each context, the prefill and the
    training step rows at the first budget (each when asked for)."""
    c, dev = net.config, opts.device
    # frozen: the timed passes build no graph
    net.requires_grad_(False)
    # the weights a step reads: the input embedding only when tied to the head (and a learned scorer's: per row)
    emb = net.model.embed_tokens.weight
    read = [p for p in net.parameters() if p is not emb or c.tie_word_embeddings]
    W = sum(p.nbytes for p in read)
    where = f"{torch.get_num_threads()} threads"
    if dev != "cpu":
        where = torch.cuda.get_device_name()
    layers = c.num_hidden_layers
    drawn = f"Qwen3-{opts.shape} shape, {layers} layers, random weights"
    print(f"{opts.model or drawn}; {dev} ({where}), {str(dt)[6:]}", end="; ")
    weights = f"weights read per step {W / 1e9:.2f} GB"
    print(f"{weights}; sinks {opts.sinks}, window {opts.window}\n")
    rows = []
    common = (net, scorers, opts, dt)
    if contexts:
        rows += speed_decode(*common, W, contexts, budgets, policies)
    if opts.prefill:
        rows += speed_prefill(*common, budgets[0], policies)
    if opts.train:
        rows += speed_train(*common, budgets[0], policies)
    return rows
