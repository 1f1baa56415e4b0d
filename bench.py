"""Benchmarks: `python bench.py {quality,generate,speed,kernels} [--key value ...]`, one cmd_ function per command,
each reading the defaults under its heading below and the shared ones (`--help` after the command lists them)."""

import os
import sys
import time
import types
import weakref

# before torch loads: large tensors on 2 MB pages (fewer TLB misses as a step streams the cache)
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

import fast
import kernels
import kvpop
import qwen3
import tasks
from cache import KVCache
# registers the research kind kvpop-shifted, whose scorers ship
from experiments import shifted  # noqa: F401
from support import baby_tasks, checkpoint, flags, gpus
from tools import bench_runs
from tools.measures import code_runs, code_table, read_on

# --- shared (each command reads those it names)
model = ""  # checkpoint folder; empty: the baby (quality, generate), a random model of --shape (speed)
policies = ""  # comma-separated; empty: all (quality; generate: but the oracle), streaming + learned (speed)
budgets = "0.25,0.125"  # comma-separated fractions of the tokens kept per head (or integers S)
sinks = 4  # first tokens never evicted
window = 32  # recent tokens never evicted, the baby's (--task code: 192; speed: 256, the paper's)
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N (speed, kernels)
json = ""  # also write the rows to this file (quality, generate, speed, kernels --targets)
plain = False  # run kvpop.py's definitions alone, not fast.py's forms (quality, generate, read)
# --- quality: every policy on held-out sequences of the baby's tasks, or of code files (teacher-forced)
task = "recall"  # comma-separated tasks: recall, cue; or code alone (the code baby's held-out files)
corpus = "torch"  # code: torch (the installed package's .py/.txt source) or a folder of such files
target = "helpful"  # comma-separated targets of the oracle and the scorers: helpful, max, mean
scorer = "shipped"  # comma-separated folders ('' none); shipped: <model>/scorers/<task>-<target>/*
seed = 0  # held-out task seed (training draws other streams)
p_cue = 0.17  # cue task: the share of would-be fillers that start a distractor (the task's own)
n = 128  # sequences (code: held-out files, their first T tokens; at most)
T = 512  # tokens per sequence, the baby's tasks' (--task code: 2048)
threads = 1  # CPU threads (tiny ops: a second one mostly waits)
ref = ""  # quality: the dense model `full` and the key tokens are of (a fine-tune's model before); empty: --model
# --- generate: every policy continues held-out prompts, the text scored by sample.py's scoreboard
prompts = 256  # held-out prompts per task: a sequence's words 1 .. T - tokens - 1 (bos dropped)
tokens = 112  # tokens written per prompt (sample.py's 112 after baby/prompt.txt's 399)
temperature = 1.0  # 0 = greedy; 1: the baby's own distribution, as sample.py samples it
# --- speed: decoding against the bytes it reads, prefill, a training step
shape = "0.6B"  # Qwen3 shape of the random model: 0.6B, 4B or 8B
layers = 0  # layers of the random model (0 = the shape's)
contexts = "8192,32768"  # comma-separated decoding contexts ('' = none)
steps = 16  # decoding rounds timed per row (the median is kept)
prefill = 0  # prompt length of the prefill rows (0 = none)
train = 0  # sequence length of the training-step rows (0 = none)
d_mem = 128  # the kvpop scorer's memory size (the paper's 128)
dtype = "auto"  # auto (bf16 on cuda, fp32 on cpu), float32 or bfloat16
compile = False  # each decoding step one compiled graph (a GPU: CUDA graphs); the first round compiles
# --- kernels: time and peak memory of each kernels.py op against its naive dense version
lengths = ""  # comma-separated T; empty: 4096,16384,32768 on cuda, 1024,2048,4096 on cpu
D = 128  # head dim
group = 2  # query heads of the one KV head timed
targets = ""  # comma-separated GPUs, e.g. sm_75,sm_90: compile every kernel for each instead (no GPU needed)
# what each command reads (another's flag is an unknown option)
COMMAND_FLAGS = {
    "quality": "model policies budgets sinks window json plain task corpus target scorer"
    " seed p_cue n T threads ref",
    "generate": "model policies budgets sinks window json plain task target scorer"
    " seed p_cue T threads prompts tokens temperature",
    "read": "model policies budgets sinks window plain corpus target scorer T tokens",
    "speed": "model policies budgets sinks window device json shape layers contexts"
    " steps prefill train d_mem dtype compile",
    "kernels": "device lengths D group targets json",
}


def settings(command, argv):
    """The command's defaults above, overridden by --key value (flags.configure), checked for what commands share."""
    g = {k: globals()[k] for k in COMMAND_FLAGS[command].split()}
    prog = f"bench.py {command}"
    g.update(__file__=__file__, __prog__=prog)
    given = flags.configure(g, argv)
    need = lambda ok, msg: flags.need(ok, msg, prog)
    # kernels, speed on a GPU: made the current one, where Triton kernels launch
    if g.get("device", "cpu") != "cpu":
        flags.check_device(g["device"], prog)
        torch.cuda.set_device(torch.device(g["device"]).index or 0)
    j = g.get("json", "")
    folder = os.path.dirname(j) or "."
    writable = os.path.isdir(folder) and os.access(folder, os.W_OK)
    ok = not j or not os.path.isdir(j) and writable
    need(ok, f"--json {j}: give a file name in an existing, writable folder")
    # the settings, and the command's name, for messages
    settings = {k: v for k, v in g.items() if k[0] != "_"}
    opts = types.SimpleNamespace(prog=prog, given=given, **settings)
    return opts, need


# ------------------------------------------------------------------------------------------------ kernels
# the storages of the tensors among xs
def storages(xs):
    tensors = [x for x in xs if isinstance(x, torch.Tensor)]
    return [x.untyped_storage() for x in tensors]


class Meter(TorchDispatchMode):
    """The ops dispatched while active: how many (calls), and the peak of the bytes held by the storages they create
    (peak, on a CPU; a storage leaves the count when freed). A compiled graph runs under it untraced: its calls are the
    ops the graph leaves to torch (inductor's C++ and Triton kernels dispatch none)."""

    def __init__(self):
        super().__init__()
        self.live = {}  # data pointer -> bytes
        self.now = self.peak = self.calls = 0

    # a compiled graph runs under the meter (else dynamo leaves the frame to eager torch, or fullgraph raises)
    @classmethod
    def ignore_compile_internals(cls):
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        out = func(*args, **(kwargs or {}))
        # outputs on an input's storage: views, in-place
        ins = {s.data_ptr() for s in storages(args)}
        outs = out if isinstance(out, (tuple, list)) else [out]
        for s in storages(outs):
            ptr, size = s.data_ptr(), s.nbytes()
            if size and ptr not in ins and ptr not in self.live:
                self.live[ptr] = size
                self.now += size
                self.peak = max(self.peak, self.now)
                weakref.finalize(s, self._free, ptr)
        return out

    def _free(self, ptr):
        self.now -= self.live.pop(ptr)


# wall seconds of one run: a GPU runs asynchronously, so wait for it before and after
def clock(fn, dev):
    sync = torch.cuda.synchronize if dev != "cpu" else lambda: None
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


# (seconds, peak bytes allocated above what was live before) of one run of fn
def peak(fn, dev):
    if dev == "cpu":
        with Meter() as meter:
            return clock(fn, dev), meter.peak
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    return clock(fn, dev), torch.cuda.max_memory_allocated() - base


# the torch ops one run of fn dispatches (a compiled fn: those its graph leaves to torch)
def calls(fn):
    with Meter() as meter:
        fn()
    return meter.calls


# a markdown table's header from its comma-separated column names, then the rule under it
def table(cols):
    header = "| " + cols.replace(",", " | ") + " |\n"
    rule = "|---" * (cols.count(",") + 1) + "|"
    return header + rule


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


def cmd_kernels(argv):
    """Time and peak memory of each kernels.py op vs its naive dense version (and SDPA on a GPU), or --targets."""
    opts, need = settings("kernels", argv)
    if opts.targets:
        return compile_targets(opts, need)
    need(opts.group >= 1, f"--group {opts.group}: use 1 or more")
    dev = opts.device
    sinks, window = 4, 256
    dt = torch.float32 if dev == "cpu" else torch.bfloat16
    default = "1024,2048,4096" if dev == "cpu" else "4096,16384,32768"
    opts.lengths = opts.lengths or default
    lengths = opts.lengths.split(",")
    ok = all(x.strip().isdecimal() and int(x) >= 1 for x in lengths)
    example = "use comma-separated lengths >= 1, e.g. 1024,2048"
    need(ok, f"--lengths {opts.lengths!r}: {example}")
    ok = opts.D >= 1 and (dev == "cpu" or opts.D <= 256)
    limit = "at most 256 on CUDA, the Triton kernels' limit"
    need(ok, f"--D {opts.D}: use a head dim >= 1 ({limit})")

    # best ms of 3 after a warm-up, and peak MiB
    def measure(fn):
        times = [clock(fn, dev) for _ in range(4)]
        return min(times[1:]) * 1e3, peak(fn, dev)[1] / 2**20

    heads = f"1 KV head x {opts.group} query heads"
    print(f"{dev}, {dt}, D {opts.D}, {heads}", end=", ")
    print(f"sinks {sinks}, window {window}, pool T/4\n")
    cols = "op,T,ours ms,naive ms,naive/ours"
    print(table(cols + ",SDPA ms,ours MiB,naive MiB,naive/ours"))
    attend = F.scaled_dot_product_attention
    for T in map(int, lengths):
        draw = lambda h: torch.randn(1, h, T, opts.D, device=dev, dtype=dt)
        q, k, v = draw(opts.group), draw(1), draw(1)
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


# ---------------------------------------------------------------------------------------------------- quality
def cmd_quality(argv):
    """Teacher-forced quality on held-out task sequences (or code files): every policy, then each target's oracle
    and scorers."""
    opts, need = settings("quality", argv)
    every = "full,oracle,streaming,h2o,tova,knorm,random"
    policies = (opts.policies or every).split(",")
    need(opts.n >= 1, f"--n {opts.n}: use 1 or more")
    setup = bench_runs.baby_setup(opts, need, policies)
    net, tok, budgets, task_names = setup[:4]
    targets, folders, scorers, files = setup[4:]
    code = files is not None
    # a fine-tuned model: judged against the dense model before it
    ref = None
    try:
        if opts.ref:
            ref = qwen3.Qwen3.from_pretrained(opts.ref, dtype=torch.float32)
    except (OSError, ValueError) as e:
        need(False, f"--ref {opts.ref}: {e}")
    t0 = time.time()
    rows, counts = [], []
    # the same held-out sequences for every policy and target of a task
    for task in task_names:
        # code: the held-out files, its metrics per file (code_runs)
        measure, batch = code_runs, (net, files)
        if not code:
            # the task's held-out sequences (idx, tgt, dist)
            held_out = (opts.n, opts.T, opts.seed, opts.p_cue)
            seqs = baby_tasks.held_out_batch(tok, task, *held_out)
            measure, batch = tasks.quality_runs, (net, *seqs)
        cache = (budgets, opts.sinks, opts.window)
        # full and the heuristics read no target
        heuristics = [p for p in policies if p != "oracle"]
        found = measure(*batch, heuristics, *cache, ref=ref)
        found_rows = found if code else found[0]
        rows += [dict(task=task, target="-", **r) for r in found_rows]
        for target in targets:
            oracle = ["oracle"] * ("oracle" in policies)
            learned = oracle + [scorers[d] for d in folders[task, target]]
            runs = measure(*batch, learned, *cache, target=target, ref=ref)
            runs = runs if code else runs[0]
            # full's rows: the heuristics' (target "-")
            runs = [r for r in runs if r["policy"] != "full"]
            rows += [dict(task=task, target=target, **r) for r in runs]
        if code:
            # code: the share of key tokens at each budget (full's rows)
            share = lambda r: f"{r['key_share']:.2%} at {r['budget']:g}"
            keys = ", ".join(share(r) for r in found if r["policy"] == "full")
            counts.append(f"{task}: key tokens {keys}")
        else:
            # a task: its queries and the far ones
            counts.append(f"{task}: {found[2]} queries ({found[1]:.0%} far)")
    what = f"{opts.n} held-out sequences of"
    if code:
        what = f"{len(files)} held-out files, the first"
    counted = "; ".join(counts)
    title = f"{opts.model}: {what} {opts.T} tokens (seed {opts.seed}), {counted}"
    print(f"{title}; sinks {opts.sinks}, window {opts.window}\n")
    show = code_table if code else tasks.quality_table
    print(f"{show(rows)}\n\n{time.time() - t0:.0f}s")
    if opts.json:
        checkpoint.write_json(rows, opts.json)


# --------------------------------------------------------------------------------------------------- generate
def cmd_generate(argv):
    """Every policy continues the same held-out prompts of each task; the written text is scored by sample.py's
    scoreboard -> (rows per task, target, policy and budget, target "-" for full and the heuristics; samples
    {(task, target, policy, budget): (prompts, continuations)})."""
    opts, need = settings("generate", argv)
    every = "full,streaming,knorm,random,h2o,tova"
    policies = (opts.policies or every).split(",")
    why = "teacher-forced only (bench.py quality)"
    need("oracle" not in policies, f"--policies oracle: {why}")
    need(opts.prompts >= 1, f"--prompts {opts.prompts}: use 1 or more")
    msg = f"--temperature {opts.temperature:g}: use 0 (greedy) or more"
    need(opts.temperature >= 0, msg)
    why = "generate scores the baby's tasks; code: bench.py quality"
    need("code" not in opts.task.split(","), f"--task code: {why}")
    why = "use 1 .. T - 2 (a prompt of 1 or more)"
    need(1 <= opts.tokens <= opts.T - 2, f"--tokens {opts.tokens}: {why}")
    setup = bench_runs.baby_setup(opts, need, policies, spare=1)
    net, tok, budgets, task_names = setup[:4]
    targets, folders, scorers = setup[4:7]
    # far: bound at least S back, S the largest budget's (the same answers' bar at every budget)
    S = lambda b: kvpop.budget_size(b, opts.T - 1, opts.sinks, opts.window)[0]
    far = max(S(b) for b in budgets)
    t0 = time.time()
    rows, samples = [], {}
    for task in task_names:
        # held-out prompts: bench.py quality's sequences (test-<seed>),
        # their bos dropped as in baby/prompt.txt
        held_out = (opts.prompts, opts.T, opts.seed, opts.p_cue)
        idx = baby_tasks.held_out_batch(tok, task, *held_out)[0]
        prompt = idx[:, 1 : opts.T - opts.tokens]  # (N, P)
        # full, each heuristic at each budget, then each target's scorers
        heuristics = [p for p in policies if p != "full"]
        runs = [("-", "full", 1)]
        runs += [("-", p, b) for p in heuristics for b in budgets]
        learned = [(r, scorers[d]) for r in targets for d in folders[task, r]]
        runs += [(r, s, b) for r, s in learned for b in budgets]
        cache = (opts.sinks, opts.window)
        sampling = (opts.tokens, opts.temperature, opts.seed)
        bar = tqdm(runs, desc=task, leave=False)
        args = (net, tok, prompt, bar, far, *cache, *sampling)
        got_rows, got_samples = bench_runs.generate_runs(*args)
        rows += [dict(task=task) | r for r in got_rows]
        samples |= {(task, *k): v for k, v in got_samples.items()}
    P = opts.T - opts.tokens - 1
    prompts = f"{opts.prompts} held-out prompts a task (seed {opts.seed})"
    title = f"{opts.model}: {prompts} of {P} tokens"
    written = f"{opts.tokens} written each at temperature {opts.temperature:g}"
    print(f"{title}, {written}; far: >= {far} back\n")
    print(f"{bench_runs.generate_table(rows)}\n\n{time.time() - t0:.0f}s")
    if opts.json:
        checkpoint.write_json(rows, opts.json)
    return rows, samples


# ------------------------------------------------------------------------------------------------------- read
def cmd_read(argv):
    """codebaby reads on its first held-out file (support/corpus.py) from T - tokens, teacher-forced, under each
    learned scorer of --target, streaming and full (the ceiling): each key token (it needs what streaming evicts)
    marked ✓ where the policy's likeliest next token is it, ✗ where not (tools/measures.py's read_on)."""
    opts, need = settings("read", argv)
    opts.task, opts.n, opts.p_cue, opts.threads = "code", 2, 0.0, 1
    policies = (opts.policies or "streaming,full").split(",")
    setup = bench_runs.baby_setup(opts, need, policies)
    net, tok, budgets = setup[:3]
    targets, folders, scorers, files = setup[4:]
    need(1 <= opts.tokens < opts.T, f"--tokens {opts.tokens}: use 1 .. T - 1")
    read, n = files[0].tolist(), opts.T - opts.tokens
    # every target's scorers, by name, then the policies named
    chosen = [scorers[d] for t in targets for d in folders["code", t]]
    learned = {tasks.policy_name(s): s for s in chosen}
    runs = learned | {p: p for p in policies}
    # the prompt's last lines, then the file read on under each policy at each budget
    last = tok.decode(read[:n]).splitlines()[-20:]
    print("...\n" + "\n".join(last), end="\n" + "=" * 80 + "\n")
    for b in budgets:
        S = kvpop.budget_size(b, opts.T, opts.sinks, opts.window)[0]
        read_on(net, tok, read, n, runs, S, opts.sinks, opts.window, b)


# ---------------------- speed: a step reads every weight and every kept key and value once: its cost follows bytes
# a shape: layers, hidden, MLP width, query heads, tied head; the rest: Qwen3Config's (vocab, 8 KV heads of 128, ...)
SHAPES = {
    "0.6B": (28, 1024, 3072, 16, True),
    "4B": (36, 2560, 9728, 32, True),
    "8B": (36, 4096, 12288, 32, False),
}


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
    """Make the cache look as if it had read C tokens (sinks, a pool spread over the past, the window), with synthetic
    keys and values: a step costs the same whatever they hold. Returns the entries held."""
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


def speed_decode(net, scorers, opts, dt, W, contexts, budgets, policies):
    """The decoding rows: tokens/s of full, then each policy at each budget, beside the bytes a step reads (W of
    weights) and a model-sized matrix-vector product (the limit); a context's rows stepped in turn: the same minutes."""
    c, dev = net.config, opts.device
    rows = []
    mode = "reduce-overhead" if dev.startswith("cuda") else None
    step = net
    if opts.compile:
        step = torch.compile(net, fullgraph=True, dynamic=False, mode=mode)
    E = c.hidden_size
    heads = c.num_hidden_layers * c.num_key_value_heads
    # KV bytes of a token
    per_tok = 2 * heads * c.head_dim * dt.itemsize
    # the median, after the warm-up round
    med = lambda t: sorted(t[1:])[len(t) // 2 - 1]
    # a row's floats to 4 decimals
    four = lambda v: round(v, 4) if isinstance(v, float) else v
    cols = "policy,budget,context,tokens/s,speedup,ideal,of ideal"
    cols += ",KV+state MiB,GB/s,limit GB/s,of limit,scorer share"
    cols += ",calls a step eager" + " / compiled" * opts.compile
    print(table(cols))
    for C in contexts:
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
        limit = M.numel() * dt.itemsize / med(lim) / 1e9
        # full first: its seconds and bytes are the context's yardstick
        for (p, b), (cache, n, times) in runs.items():
            sec = med(times)
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
                r["scorer_share"] = 1 - med(ratios)
            # the torch calls of a step, eager and compiled (those its graph leaves to torch):
            # one more step each
            eager = calls(lambda: net(tok, cache=cache))
            r["calls"] = dict(eager=eager)
            if opts.compile:
                compiled = calls(lambda: step(tok, cache=cache))
                r["calls"]["compiled"] = compiled
            share = "-"
            if "scorer_share" in r:
                share = f"{r['scorer_share']:.1%}"
            run = f"| {p} | {b:g} | {C} | {1 / sec:.2f}"
            gain = f"{speedup:.2f}x | {ideal:.2f}x | {speedup / ideal:.0%}"
            held = f"{kv / 2**20:.0f} | {gbps:.1f}"
            of_limit = f"{limit:.1f} | {gbps / limit:.0%}"
            counted = " / ".join(map(str, r["calls"].values()))
            cells = f"{run} | {gain} | {held} | {of_limit} | {share} | {counted} |"
            print(cells, flush=True)
            rows.append({k: four(v) for k, v in r.items()})
        del runs, M
    return rows


def speed_prefill(net, scorers, opts, dt, b, policies):
    """Prefill rows: seconds and peak memory of a prompt into an empty cache, full, then each static policy at b."""
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
    """One training step of the first learned policy at budget b, through train.py's own loss, timed part by part."""
    import train as trainer

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
    step = lambda: trainer.scorer_loss(scorer, kv, rs, [q], budgets)
    loss = clock(step, dev)
    parts["scorer forward + backward"] = loss - parts["eviction times"]
    total = sum(parts.values())
    print(f"\n{kind} scorer training step, 1 x {T} tokens, budget {b:g}\n")
    print(table("part,seconds,share"))
    for k, v in parts.items():
        print(f"| {k} | {v:.2f} | {v / total:.0%} |")
    row = lambda k, v: dict(train=T, kind=kind, part=k, seconds=round(v, 3))
    return [row(k, v) for k, v in parts.items()]


def cmd_speed(argv):
    """Decoding: tokens/s, KV memory, bandwidth and scorer share per policy and budget; prefill; a training step."""
    opts, need = settings("speed", argv)
    opts.window = opts.window if "window" in opts.given else 256
    lowest = dict(layers=0, steps=1, prefill=0, train=0, sinks=0, window=1, d_mem=1)
    for name, least in lowest.items():
        value = getattr(opts, name)
        need(value >= least, f"--{name} {value}: use {least} or more")
    shapes = ", ".join(SHAPES)
    need(opts.shape in SHAPES, f"--shape {opts.shape!r}: choose from {shapes}")
    flags.check_dtype(opts.dtype, ("float32", "bfloat16"), "bench.py speed")
    dev = opts.device
    # auto on a GPU: bf16
    dt = getattr(torch, flags.auto_dtype(opts.dtype, dev) or "bfloat16")
    every = ",".join(["streaming", *kvpop.SCORERS])
    policies = [p for p in (opts.policies or every).split(",") if p]
    # all but full and the oracle
    online = (*kvpop.STATIC, *kvpop.DYNAMIC, *kvpop.SCORERS)
    listed = opts.contexts.split(",") if opts.contexts else []
    ok = all(x.isdecimal() and int(x) >= 1 for x in listed)
    example = "use comma-separated lengths >= 1, e.g. 8192,32768"
    need(ok, f"--contexts {opts.contexts!r}: {example}")
    bad = next((p for p in policies if p not in online), None)
    why = f"{bad!r} is not a policy that decodes online"
    need(bad is None, f"--policies: {why}; choose from {', '.join(online)}")
    parse = lambda b: flags.parse_value("bench.py speed", "budgets", b, float)
    budgets = [parse(b) for b in opts.budgets.split(",")]
    contexts = [int(x) for x in listed]
    # every check first: the weights load or are drawn last
    try:
        if opts.model:
            folder = checkpoint.checkpoint_dir(opts.model)
            c = qwen3.Qwen3Config.from_json(os.path.join(folder, "config.json"))
        else:
            L, E, intermediate, Hq, tied = SHAPES[opts.shape]
            c = qwen3.Qwen3Config(hidden_size=E, intermediate_size=intermediate)
            c.num_attention_heads = Hq
            c.tie_word_embeddings = tied
            c.num_hidden_layers = opts.layers or L
            c.max_position_embeddings = 131072
        torch.manual_seed(0)
        new = lambda k: kvpop.SCORERS[k](c, opts.window, opts.d_mem)
        scorers = {k: new(k).eval().to(dev) for k in kvpop.SCORERS}
        scorers = {k: fast.speed_up(s) for k, s in scorers.items()}
        lengths = [T for T in (opts.prefill, opts.train) if T]
        prompts = [(T, budgets[0]) for T in lengths]
        decoding = [(C, b) for C in contexts for b in budgets]
        charge = scorers["kvpop"].charge(dt)
        # raises if no room
        for C, b in decoding + prompts:
            kvpop.budget_size(b, C, opts.sinks, opts.window, charge)
        if opts.model:
            net = qwen3.Qwen3.from_pretrained(opts.model, dev, dt)
        else:
            net = shape_model(c, dev, dt)
    except (OSError, ValueError) as e:
        need(False, str(e))
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
    if opts.json:
        checkpoint.write_json(rows, opts.json)


if __name__ == "__main__":
    commands = {
        "kernels": cmd_kernels,
        "quality": cmd_quality,
        "generate": cmd_generate,
        "read": cmd_read,
        "speed": cmd_speed,
    }
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        usage = f"usage: python bench.py {{{','.join(commands)}}} [options]"
        raise SystemExit(f"{usage}  (-h after a command for help)")
    commands[sys.argv[1]](sys.argv[2:])
