"""Benchmarks, one cmd_ function per command, each reading the defaults under its heading below and the shared
ones (`python bench.py COMMAND --help` lists them); their runs and tables are in tools/:

python bench.py quality   # teacher-forced: every policy on held-out sequences of the baby's tasks, or code files
python bench.py generate  # every policy writes answers, graded: the baby's tasks, or a JSONL file of problems
python bench.py read      # codebaby reads on a held-out file: its key tokens marked under each policy
python bench.py speed     # decoding against the bytes a step reads, prefill, a training step
python bench.py kernels   # each kernels.py op against its naive version, or compiled for each GPU
"""

import os
import sys
import time
import types

# before torch loads: large tensors on 2 MB pages (fewer TLB misses as a step streams the cache)
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
import torch
from tqdm import tqdm

import fast
import kvpop
import qwen3
import tasks
# registers the research kind kvpop-shifted, whose scorers ship
from experiments import shifted  # noqa: F401
from support import baby_tasks, checkpoint, flags
from tools import bench_runs, generate, speed
from tools.measures import code_runs, code_table, read_on

# --- shared (each command reads those it names)
model = ""  # checkpoint folder; empty: the baby (quality, generate), a random model of --shape (speed)
policies = ""  # comma-separated; empty: all (quality; generate: but the oracle), streaming + learned (speed)
budgets = "0.25,0.125"  # comma-separated fractions of the tokens kept per head (or integers S)
sinks = 4  # first tokens never evicted
window = 32  # recent tokens never evicted, the baby's (--task code: 192; speed, --data on a Qwen3: 256)
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N (speed, kernels, generate)
json = ""  # also write the rows to this file (quality, generate, speed, kernels --targets)
plain = False  # run kvpop.py's definitions alone, not fast.py's forms (quality, generate, read)
dtype = "auto"  # auto (bf16 on cuda, fp32 on cpu), float32 or bfloat16 (speed, generate)
# --- quality: every policy on held-out sequences of the baby's tasks, or of code files (teacher-forced)
task = "recall"  # comma-separated tasks: recall, cue; or code alone (the code baby's held-out files)
corpus = "torch"  # code: torch (the installed package's .py/.txt source) or a folder of such files
target = "helpful"  # comma-separated targets of the oracle and the scorers: helpful, max, mean
scorer = "shipped"  # comma-separated folders ('' none); shipped: <model>/scorers/<task>-<target>/*
seed = 0  # held-out task seed (training draws other streams); --data: each answer's, with its problem and sample
p_cue = 0.17  # cue task: the share of would-be fillers that start a distractor (the task's own)
n = 128  # sequences (code: held-out files, their first T tokens; at most)
T = 512  # tokens per sequence, the baby's tasks' (--task code: 2048)
threads = 1  # CPU threads (tiny ops: a second one mostly waits)
ref = ""  # quality: the dense model `full` and the key tokens are of (a fine-tune's model before); empty: --model
# --- generate: every policy writes answers to the same prompts: the baby's tasks' (--task), or --data's problems
prompts = 256  # --task: held-out prompts per task: a sequence's words 1 .. T - tokens - 1 (bos dropped)
tokens = 112  # --task: tokens written per prompt (sample.py's 112 after baby/prompt.txt's 399)
temperature = 1.0  # 0 = greedy; 1: the baby's own distribution (--data on a Qwen3: 0.6 --think, else 0.7)
top_k = 0  # keep the k likeliest tokens, 0 = off (--data on a Qwen3: 20)
top_p = 1.0  # nucleus, 1 = off (--data on a Qwen3: 0.95 --think, else 0.8): Qwen3's advice, as sample.py's
data = ""  # a JSONL file of problems, one a line: answered instead of --task's prompts
question = ""  # --data: the question's field; empty: the first of question, problem, prompt a line has
answer = "answer"  # --data: the answer's field (a solution ending in #### N or \boxed{...}: that)
grade = "math"  # --data: math (the last \boxed{}, else the last number) or prefix (the answer starts the text)
chat = False  # --data: each question in the model's chat template
think = False  # --data, with --chat: the model thinks first; the answer is what follows </think>
samples = 1  # --data: answers a problem, each its own seed (accuracy: pass@1, the mean over them)
max_new_tokens = 2048  # --data: tokens an answer at most (fewer if it ends its turn)
out = ""  # --data: each answer appended to this JSONL file as it ends; a run started again skips those there
# --- speed: decoding against the bytes it reads, prefill, a training step
shape = "0.6B"  # Qwen3 shape of the random model: 0.6B, 4B or 8B
layers = 0  # layers of the random model (0 = the shape's)
contexts = "8192,32768"  # comma-separated decoding contexts ('' = none)
steps = 16  # decoding rounds timed per row (the median is kept)
prefill = 0  # prompt length of the prefill rows (0 = none)
train = 0  # sequence length of the training-step rows (0 = none)
d_mem = 128  # the kvpop scorer's memory size (the paper's 128)
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
    " seed p_cue T threads prompts tokens temperature device dtype top_k top_p"
    " data question answer grade chat think samples max_new_tokens out",
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
def cmd_kernels(argv):
    """Time and peak memory of each kernels.py op vs its naive dense version (and SDPA on a GPU), or --targets."""
    opts, need = settings("kernels", argv)
    if opts.targets:
        return speed.compile_targets(opts, need)
    need(opts.group >= 1, f"--group {opts.group}: use 1 or more")
    dev = opts.device
    default = "1024,2048,4096" if dev == "cpu" else "4096,16384,32768"
    opts.lengths = opts.lengths or default
    lengths = opts.lengths.split(",")
    ok = all(x.strip().isdecimal() and int(x) >= 1 for x in lengths)
    example = "use comma-separated lengths >= 1, e.g. 1024,2048"
    need(ok, f"--lengths {opts.lengths!r}: {example}")
    ok = opts.D >= 1 and (dev == "cpu" or opts.D <= 256)
    limit = "at most 256 on CUDA, the Triton kernels' limit"
    need(ok, f"--D {opts.D}: use a head dim >= 1 ({limit})")
    speed.kernel_rows(dev, opts.D, opts.group, [int(x) for x in lengths])



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
    """Every policy writes answers to the same prompts, graded: --data's problems (tools/generate.py's run -> its
    rows), else each --task's held-out prompts, continued and scored by sample.py's scoreboard -> (rows per task,
    target, policy and budget, target "-" for full and the heuristics; samples {(task, target, policy, budget):
    (prompts, continuations)})."""
    opts, need = settings("generate", argv)
    every = "full,streaming,knorm,random,h2o,tova"
    policies = (opts.policies or every).split(",")
    why = "teacher-forced only (bench.py quality)"
    need("oracle" not in policies, f"--policies oracle: {why}")
    msg = f"--temperature {opts.temperature:g}: use 0 (greedy) or more"
    need(opts.temperature >= 0, msg)
    # each way's own flags: the other way's are refused
    others = generate.TASK_FLAGS if opts.data else generate.DATA_FLAGS
    given = sorted(opts.given & set(others.split()))
    why = "applies without --data" if opts.data else "applies to --data"
    need(not given, f"--{(given or [''])[0]}: {why}")
    if opts.data:
        return generate.run(opts, need, policies)
    need(opts.prompts >= 1, f"--prompts {opts.prompts}: use 1 or more")
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
        learned = [(r, scorers[d]) for r in targets for d in folders[task, r]]
        runs = bench_runs.policy_runs(policies, budgets, learned)
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



# ------------------------------------------------------------------------------------------------------ speed
def cmd_speed(argv):
    """Decoding: tokens/s, KV memory, bandwidth and scorer share per policy and budget; prefill; a training step
    (tools/speed.py's rows)."""
    opts, need = settings("speed", argv)
    opts.window = opts.window if "window" in opts.given else 256
    lowest = dict(layers=0, steps=1, prefill=0, train=0, sinks=0, window=1, d_mem=1)
    for name, least in lowest.items():
        value = getattr(opts, name)
        need(value >= least, f"--{name} {value}: use {least} or more")
    shapes = ", ".join(speed.SHAPES)
    need(opts.shape in speed.SHAPES, f"--shape {opts.shape!r}: choose from {shapes}")
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
        c = speed.shape_config(opts)
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
            net = speed.shape_model(c, dev, dt)
    except (OSError, ValueError) as e:
        need(False, str(e))
    rows = speed.speed_rows(net, scorers, opts, dt, contexts, budgets, policies)
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
