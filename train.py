"""Training, nanoGPT style: defaults below, override any with --name value (--help lists them).

  # the default delayed scorer (kvpop-window) on the frozen baby (minutes)
  python train.py
  # the insertion-time scorer; the paper's mLSTM scorer is --kind kvpop
  python train.py --kind kvpop-mlp --out_dir out-mlp
  # a real Qwen3 on your text files
  python train.py --model Qwen/Qwen3-0.6B --data texts/ --seq_len 2048 --window 256 --budget 0.25
  # the paper's recipe: the model trains too, under eviction
  python train.py --finetune --out_dir out-ft
  # its control, StreamingLLM+ (recency eviction, no scorer)
  python train.py --finetune --policy streaming
  # several processes: DDP (scorer), FSDP2 (--finetune)
  torchrun --nproc_per_node=2 train.py ...

The scorer learns the keep-or-drop decisions of a teacher that ranks tokens by the model's future attention (README,
Method: boundary loss); --finetune trains the model too, under that eviction, by KL to the dense model (fine-tune).
The baby model itself comes from pretrain.py.
"""

import contextlib
import glob
import json
import math
import os
import random
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import flags
import kernels
import kvpop
import qwen3
import tokenizer
from tasks import TASKS, quality_runs, quality_table, task_batch

# --- what to run
finetune = False  # the model trains too, under the eviction, by KL to the dense model
policy = "scorer"  # --finetune: scorer (--kind evicts) or streaming (StreamingLLM+, pi[t] = t)
out_dir = "out"  # written: scorer + train_state.pt (--finetune: the model too)
resume = False  # continue the run in out_dir from its last checkpoint, exactly
seed = 0  # seeds the initialisation and the training data (never the benchmark's sequences)
device = "cpu"  # cpu or cuda
dtype = "auto"  # the frozen model's dtype: auto = the checkpoint's on cuda, float32 on cpu
threads = 1  # CPU threads; 2 give the same bits, faster when idle, far slower when busy
# --- scorer (README, Method: scorers)
model = "baby"  # the frozen model: checkpoint folder or Hugging Face repo id
kind = "kvpop-window"  # delayed: kvpop-window (reads its window), kvpop (mLSTM); kvpop-mlp
d_mem = 16  # kvpop: memory d_mem x d_mem; sets the state charge (3 entries on the baby)
d_hidden = 64  # kvpop-mlp, kvpop-window: hidden width
gamma = 0.002  # initial recency weight gamma_h of pi[t] = r[t] + gamma_h * t (learned)
arrival = False  # kvpop: read each token on arrival, not as it leaves the window (the delay ablation)
init_from = ""  # a trained scorer's folder to start from (its sizes), e.g. --finetune from a frozen run
target = "helpful"  # the teacher: helpful or max (ours), mean (the paper's) future attention past the window
# --- data
data = "baby"  # baby: a baby task (tasks.py); else .txt/.jsonl files (folder, glob), packed
task = "recall"  # --data baby: recall, or cue (distractors only the next word marks)
keys = 8  # --data baby: keys per sequence
seq_len = 512  # tokens per sequence
queries = 0  # query positions per sequence and pool in the loss, drawn at random (0 = every one)
edges = 3  # the boundary loss at the edges of this many pools: the budget's, then each half the last
# --- eviction at training time (README, Method: budget)
budget = 0.125  # the training budget: fraction of seq_len (or an integer S) per head
sinks = 4  # first tokens never evicted
window = 32  # recent tokens never evicted; a delayed scorer reads this many tokens late
# --- optimisation
batch_size = 8  # sequences per step
max_iters = 600  # steps
lr = 3e-3  # the scorer's AdamW peak learning rate
min_lr = 3e-4  # cosine decay down to this
warmup = 50  # linear warmup steps
weight_decay = 1e-4  # AdamW weight decay (--finetune: the model's too)
grad_clip = 1.0  # clip the gradient norm (--finetune: the model's too)
model_lr = -1.0  # --finetune: the model's AdamW peak rate; -1: the paper's 8e-5, the baby's 1e-5 (LOG.md)
top_logits = 256  # --finetune: KL to the dense model's top this many next tokens
# --- logging, evaluation, checkpoints
log_interval = 25  # print loss, keep/drop accuracy and tokens/s every this many steps
eval_interval = 100  # held-out far accuracy (baby) and a checkpoint, every this many steps
eval_seqs = 32  # held-out sequences per evaluation
final_seqs = 128  # held-out sequences of the final quality table (bench.py quality's; 0 = none)
given = flags.configure(globals(), None if __name__ == "__main__" else [])  # tests: defaults
model_lr = (1e-5 if model == "baby" else 8e-5) if model_lr == -1 else model_lr
# set by torchrun
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
# only rank 0 logs
log = (lambda *a: print(*a, flush=True)) if rank == 0 else lambda *a: None
# bad input: one line, before any heavy work
need = lambda ok, msg: flags.need(ok, msg, "train.py")


# ----------------------------------------------------------------------------------------------------------
# the scorer's loss on the frozen model's targets (the boundary loss itself: kvpop.boundary_loss), the fine-tune's


def allsum(x):  # in place: the sum over processes, each holding its share of the global batch
    if world > 1:
        dist.all_reduce(x)
    return x


def query_positions(T, it):
    """The loss's queries, a tensor for each of `pools`: every q at which that pool is over-full (q >= sinks +
    window + pool), or --queries of them drawn at random, a draw per step and pool."""
    qs = []
    for j, p in enumerate(pools):
        # the pool is over-full: every step decides one token
        q = torch.arange(sinks + window + p, T)
        if queries and queries < len(q):
            g = torch.Generator().manual_seed(seed * 1_000_003 + it + 7_919 * j)
            q = q[torch.randperm(len(q), generator=g)[:queries].sort().values]
        qs.append(q)
    return qs


def scorer_loss(scorer, kv, rs, qs, sinks, window, pools, ddp=None):
    """kvpop.boundary_loss of every layer, each pool's queries qs[j]: backward per layer (one layer's graph alive)
    when grad is enabled -> (loss, keep/drop accuracy), means over layers and pools. `ddp`: training's scorer; the
    keep/drop weights count the global batch, gradients are reduced once, in the last layer's backward."""
    T, L = rs[0].shape[-1], len(kv)  # rs: every layer's target r* (B, H, T)
    pos, total, hits = torch.arange(T, device=rs[0].device), 0.0, 0.0
    for i, ((k, v), r) in enumerate(zip(kv, rs)):
        with ddp.no_sync() if isinstance(ddp, DDP) and i < L - 1 else contextlib.nullcontext():
            # (B, H, T); -inf past T - window
            teacher = r + scorer.recency(i, pos).detach()
            pi = (ddp or scorer)(i, k, v, pos)
            # this process's part of the global loss (the keep/drop counts summed over the processes)
            loss, right = kvpop.boundary_loss(pi, teacher, qs, sinks, window, pools, L, allsum if ddp else None)
            hits += right
            if torch.is_grad_enabled():
                (loss * world).backward()  # DDP averages gradients over the processes
        total += loss.item()
    if ddp is not None:
        total, hits = allsum(torch.tensor([total, hits], dtype=torch.float64)).tolist()
    return total, hits


def finetune_loss(net, teacher, scorer, idx, qpos, sinks, window, pool, pools, top_logits, target, ddp=None):
    """One --finetune step's backward: the model learns under the student's eviction by KL to the dense teacher's top
    `top_logits`; the scorer by the boundary loss at each pool's queries qpos against the dense teacher's --target
    future attention (the frozen run's teacher), on the student's keys and values -> KL, boundary loss, keep/drop
    accuracy."""
    with torch.no_grad():
        top = teacher(idx).float().topk(min(top_logits, teacher.config.vocab_size), -1)  # (B, T, K)
        rs = kvpop.dense_targets(teacher, idx, window, target)[1] if scorer is not None else None
    lt, kv = top.values.log_softmax(-1), []
    evict_by = kvpop.resolve(scorer or "streaming")[1]  # the student's priorities

    def attn(i, q, k, v, pos):
        with torch.no_grad():
            e = kernels.eviction_times(evict_by(i, k, v, pos), sinks, window, pool)
        kv.append((k.detach(), v.detach()))
        return kernels.attention(q, k, v, e, sinks)[0]

    lp = net(idx, attn=attn).float().log_softmax(-1).gather(-1, top.indices)
    # FSDP averages gradients: every process holds as many tokens
    kl = (lt.exp() * (lt - lp)).sum(-1).mean()
    kl.backward()
    b = scorer_loss(scorer, kv, rs, qpos, sinks, window, pools, ddp) if scorer is not None else (0.0, 0.0)
    return allsum(kl.detach().double()).item() / world, *b


# step it's scorer rate: linear warmup times a cosine from --lr down to --min_lr
def learning_rate(it):
    warm = min(1, (it + 1) / max(warmup, 1))
    return min_lr + (lr - min_lr) * warm * 0.5 * (1 + math.cos(math.pi * it / max_iters))


def batch(tok, it, n):
    """Training sequences (n, seq_len) of step `it`: a function of (seed, it), so a checkpoint's data position is its
    step. The baby task draws fresh ones; files are packed once and drawn in a seeded order."""
    if data == "baby":
        return task_batch(tok, n, seq_len, random.Random(f"scorer-train-{seed}-{it}"), keys=keys, **TASKS[task])[0]
    N = len(chunks) - n_valid  # the last n_valid chunks are held out
    perm = lambda ep: torch.randperm(N, generator=torch.Generator().manual_seed(seed * 100_003 + ep))
    return torch.stack([chunks[perm(j // N)[j % N]] for j in range(it * n, it * n + n)])


def pack_files(tok):  # -> the text as sequences (n, seq_len), and how many of them are held out
    # a folder stands for the files under it
    tree = lambda p: glob.glob(os.path.join(p, "**", "*"), recursive=True) if os.path.isdir(p) else [p]
    files = sorted(f for p in glob.glob(os.path.expanduser(data)) for f in tree(p) if f.endswith((".txt", ".jsonl")))
    files = [f for f in files if os.path.isfile(f)]
    ids = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            for line in fh if f.endswith(".jsonl") else [fh.read()]:
                text = ""  # unless the line is a JSON object with "text"
                with contextlib.suppress(ValueError, AttributeError):
                    text = json.loads(line).get("text", "") if f.endswith(".jsonl") else line
                if isinstance(text, str) and text.strip():
                    ids += tok.encode(text) + [tok.special["<|endoftext|>"]]
    n = len(ids) // seq_len
    found = f"{len(files)} .txt/.jsonl files with {len(ids)} tokens of text"
    need(n >= 2, f"--data {data}: {found}; need at least 2 x --seq_len ({2 * seq_len}) tokens")
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len), max(1, min(eval_seqs, n // 10))


def held_out(net, tok, pol):
    """Held-out (rank 0): far accuracy at the training budget (baby task), else the boundary loss and its accuracy."""
    if data == "baby":
        x = task_batch(tok, eval_seqs, seq_len, random.Random(f"valid-{seed}"), keys=keys, **TASKS[task])
        rows = quality_runs(net, *[t.to(device) for t in x], [pol], [budget], sinks, window)[0]
        full, at_b = (r["far_accuracy"] for r in rows)
        return f"held-out far accuracy at budget {budget:g}: {at_b:.3f} (full {full:.3f})"
    if finetune:
        return "no held-out measure for --finetune on text"
    with torch.no_grad():
        kv, rs = kvpop.dense_targets(net, chunks[-n_valid:].to(device), window, target)
        loss, acc = scorer_loss(pol, kv, rs, query_positions(seq_len, 0), sinks, window, pools)
    return f"held-out boundary loss {loss:.4f}, keep/drop accuracy {acc:.3f}"


def save(it, folder, scorer, opt, student, opt_m):
    """Everything to resume, written atomically by rank 0 (every process joins the gathering of --finetune's shards)."""
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd, osd = get_state_dict(student, opt_m, options=full) if student is not None else (None, None)
    if rank:
        return
    if student is not None:
        student.save_pretrained(out_dir, sd)
        for src, dst in [(os.path.join(folder, f), os.path.join(out_dir, f)) for f in checkpoint.OPTIONAL]:
            # the tokenizer files travel with the weights
            if os.path.isfile(src) and not os.path.isfile(dst):
                shutil.copyfile(src, dst + ".tmp")
                os.replace(dst + ".tmp", dst)
    if scorer is not None:
        # what the scorer was trained for, in scorer.json
        scorer.meta = {k: globals()[k] for k in "model budget sinks window data task target edges".split()}
        scorer.meta.update(iters=it, finetune=finetune)
        scorer.save_pretrained(out_dir)
    state = dict(scorer=scorer and scorer.state_dict(), opt=opt and opt.state_dict(), model=sd, model_opt=osd, iter=it)
    torch.save(state, os.path.join(out_dir, "tmp.pt"))
    os.replace(os.path.join(out_dir, "tmp.pt"), os.path.join(out_dir, "train_state.pt"))


def load():
    """Every check against the model's config, tokenizer and data first, the weights last -> the checkpoint folder,
    tokenizer, frozen dense model, the model to fine-tune (--finetune), the scorer (None for StreamingLLM+) and the
    checkpoint to resume from. Sets this module's data (chunks, n_valid) and the training pool."""
    global chunks, n_valid, pool, pools
    learned = policy == "scorer"  # else StreamingLLM+ (--finetune): no scorer
    try:
        folder = checkpoint.checkpoint_dir(model)
        config = qwen3.Qwen3Config.from_json(os.path.join(folder, "config.json"))
        tok = tokenizer.Tokenizer.from_pretrained(folder)
        need(seq_len <= (P := config.max_position_embeddings), f"--seq_len {seq_len}: the model has only {P} positions")
        chunks, n_valid = pack_files(tok) if data != "baby" else (None, 0)
        torch.manual_seed(seed)
        scorer = kvpop.Scorer(config, kind, window, d_mem, d_hidden, gamma, arrival).to(device) if learned else None
        ck = torch.load(os.path.join(out_dir, "train_state.pt"), weights_only=True) if resume else None
        # a trained scorer to start from: --resume's own, or --init_from's
        if learned and (resume or init_from):
            scorer = kvpop.Scorer.from_pretrained(out_dir if resume else init_from)
            scorer.check(config, window)
            scorer = scorer.to(device).requires_grad_(True).train()
        if resume and learned:
            scorer.load_state_dict(ck["scorer"])
        dt = flags.auto_dtype(dtype, device)
        charge = kvpop.state_charge(scorer, getattr(torch, dt or config.torch_dtype))
        # the scorer's state comes off it
        size, pool = kvpop.budget_size(budget, seq_len, sinks, window, charge)
        fix = f"after sinks + window + the scorer's state ({charge}); raise --budget or lower --window/--d_mem"
        need(pool >= 1, f"--budget {budget}: S = {size} leaves no pool {fix}")
        # the boundary loss's pools: the budget's, then halved, --edges in all
        pools = list(dict.fromkeys(max(pool >> j, 1) for j in range(edges)))
        # the final table's budgets fit too
        for b in (0.25, 0.125) if data == "baby" and final_seqs else ():
            try:
                kvpop.budget_size(b, seq_len, sinks, window, charge)
            except ValueError:
                fix = f"at --seq_len {seq_len}, --window {window}; use --final_seqs 0 or a longer --seq_len"
                need(False, f"--final_seqs {final_seqs}: the final table's budget {b} leaves no room {fix}")
        net = qwen3.Qwen3.from_pretrained(folder, device, dt).requires_grad_(False)  # frozen, dense
        student = qwen3.Qwen3.from_pretrained(folder, device, dt).train() if finetune else None
        # the weights of the step train_state.pt records (model.safetensors may be newer)
        if resume and finetune:
            student.load_state_dict(ck["model"])
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        sys.exit(f"train.py: {e}")
    what = f"{kind} scorer: {sum(p.numel() for p in scorer.parameters())} parameters" if learned else "StreamingLLM+"
    what += f" for {model} ({config.num_hidden_layers} layers x {config.num_key_value_heads} KV heads)"
    split = f"S = {size} per head: {sinks} sinks + {window} window + {pool} pool + {charge} state"
    log(f"{what}{', fine-tuning the model' * finetune}; budget {budget:g} = {split}; {world} process(es)")
    return folder, tok, net, student, scorer, ck


def distribute(net, student, scorer):
    """Several processes (torchrun): the scorer replicated (DDP; the model is frozen), or under --finetune the models
    split block by block (FSDP2) -> what computes the scorer's priorities (the DDP wrapper, or the scorer)."""
    if world > 1 and finetune:
        for m in (*net.model.layers, net, *student.model.layers, student):
            # each block's weights split over the processes, gathered for its forward/backward
            fully_shard(m)
    return DDP(scorer) if scorer is not None and world > 1 else scorer


def optimizers(scorer, student, ck):
    """An AdamW per module trained, its peak rate --lr (scorer) or --model_lr (model); with --resume, their states as
    the checkpoint left them -> {module: optimizer}, the step to start from."""
    adamw = lambda m, r: torch.optim.AdamW(m.parameters(), lr=r, betas=(0.9, 0.95), weight_decay=weight_decay)
    opts = {m: adamw(m, r) for m, r in ((scorer, lr), (student, model_lr)) if m is not None}
    if not resume:
        return opts, 0
    if scorer is not None:
        opts[scorer].load_state_dict(ck["opt"])
    if finetune:
        full = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(student, opts[student], ck["model_opt"], options=full)
    log(f"resuming {out_dir} at step {ck['iter']}")
    return opts, ck["iter"]


def train_step(it, tok, net, student, scorer, ddp, opts):
    """Step it on this process's share of the batch -> KL (fine-tune), boundary loss, keep/drop accuracy."""
    for o in opts.values():  # the model's rate follows the scorer's, in proportion
        o.zero_grad(set_to_none=True)
        o.param_groups[0]["lr"] = learning_rate(it) * (o.defaults["lr"] / lr)  # defaults: its peak
    n = batch_size // world
    idx = batch(tok, it, batch_size)[rank * n : (rank + 1) * n].to(device)
    q = query_positions(seq_len, it)
    if finetune:  # the model under the scorer's eviction, and the scorer on that pass
        kl, loss, acc = finetune_loss(student, net, scorer, idx, q, sinks, window, pool, pools, top_logits, target, ddp)
    else:  # the scorer on the frozen model's keys, values and targets
        kv, rs = kvpop.dense_targets(net, idx, window, target)
        kl, (loss, acc) = 0.0, scorer_loss(scorer, kv, rs, q, sinks, window, pools, ddp)
    for m, o in opts.items():
        torch.nn.utils.clip_grad_norm_(m.parameters(), grad_clip)
        o.step()
    return kl, loss, acc


def final_table(folder, tok, net, scorer):
    """The quality table on bench.py quality's held-out sequences: the trained scorer beside the oracle, streaming and
    h2o, or (--finetune) the fine-tuned model under its eviction against the dense model it started from."""
    idx, tgt, dist = task_batch(tok, final_seqs, seq_len, random.Random("test-0"), **TASKS[task])
    # the dense start
    ref = qwen3.Qwen3.from_pretrained(folder, dtype="float32") if finetune else None
    pols = [scorer or "streaming"] if finetune else ["oracle", "streaming", "h2o", scorer]
    ev = qwen3.Qwen3.from_pretrained(out_dir) if finetune else net  # --finetune: the model as saved
    rows, far, n = quality_runs(ev, idx, tgt, dist, pols, [0.25, 0.125], sinks, window, ref=ref, target=target)
    for r in rows[1:] if finetune else []:
        r["policy"] = f"{r['policy']} (fine-tuned)" if scorer is not None else "StreamingLLM+"
    print(f"\n{final_seqs} held-out sequences (bench.py quality's), {n} queries ({far:.0%} far)\n")
    print(quality_table(rows))


def train():
    folder, tok, net, student, scorer, ck = load()
    ddp = distribute(net, student, scorer)
    opts, it0 = optimizers(scorer, student, ck)
    t0, seen = time.time(), []
    for it in range(it0, max_iters):
        seen.append(train_step(it, tok, net, student, scorer, ddp, opts))
        if (it + 1) % log_interval == 0 or it == it0:
            # the means over this interval's steps so far (the first line: step 1 alone)
            kl, loss, acc = (sum(x) / len(seen) for x in zip(*seen))
            parts = f" (KL {kl:.6f} + boundary {loss:.6f})" * finetune
            speed = (it + 1 - it0) * batch_size * seq_len / (time.time() - t0)
            log(f"step {it + 1}: loss {loss + kl:.6f}{parts}, keep/drop accuracy {acc:.3f}, {speed:.0f} tokens/s")
            seen = seen if (it + 1) % log_interval else []
        if (it + 1) % eval_interval == 0 or it + 1 == max_iters:
            save(it + 1, folder, scorer, opts.get(scorer), student, opts.get(student))
            # the scorer as it trains: it has no dropout, so eval mode would change nothing
            if rank == 0:
                ev = qwen3.Qwen3.from_pretrained(out_dir, device, torch.float32) if finetune else net
                log(f"step {it + 1}: {held_out(ev, tok, scorer or 'streaming')}; saved {out_dir}/")
    log(f"trained in {time.time() - t0:.0f}s")
    if data == "baby" and final_seqs and rank == 0:
        final_table(folder, tok, net, scorer)


def check_flags():
    """Bad input: one line on stderr and a non-zero exit, before any heavy work (the main block calls it first)."""
    flags.check_device(device, "train.py")
    flags.check_dtype(dtype, ("float32", "bfloat16", "float16"), "train.py")
    # a choice from a list
    choices = [("kind", kvpop.SCORERS), ("task", TASKS), ("target", kvpop.TARGETS), ("policy", ("scorer", "streaming"))]
    for name, among in choices:
        need(globals()[name] in among, f"--{name} {globals()[name]!r}: choose from {', '.join(among)}")
    # a number in range
    counts = "threads d_mem d_hidden seq_len window batch_size max_iters log_interval eval_interval eval_seqs"
    counts += " top_logits edges"
    for name in counts.split():
        need(globals()[name] >= 1, f"--{name} {globals()[name]}: must be at least 1")
    for name in "queries warmup final_seqs sinks".split():
        need(globals()[name] >= 0, f"--{name} {globals()[name]}: must be at least 0")
    for name in "lr model_lr".split():
        need(globals()[name] > 0, f"--{name} {globals()[name]}: must be positive")
    # the rest, each its own line
    for ok, msg in [
        (finetune or policy == "scorer", "--policy streaming is StreamingLLM+, a fine-tune: add --finetune"),
        (batch_size % world == 0, f"--batch_size {batch_size}: the batch must split evenly over {world} processes"),
        (0 < gamma < 1, f"--gamma {gamma}: must be in (0, 1)"),
        (0 <= min_lr <= lr, f"--min_lr {min_lr}: must be in [0, --lr]"),
        (0 <= weight_decay < 1 and grad_clip > 0, "--weight_decay must be in [0, 1) and --grad_clip positive"),
        (1 <= keys <= 16 and seq_len >= 64, "--keys must be 1..16 and --seq_len at least 64 (the recall task)"),
        (0 <= seed < 2**32, f"--seed {seed}: use an integer 0 <= seed < 2**32"),
        (out_dir.strip("/") and not os.path.isfile(out_dir), f"--out_dir {out_dir!r}: give a folder name"),
    ]:
        need(ok, msg)
    # the training budget (load() charges the scorer's state too)
    try:
        size, pool = kvpop.budget_size(budget, seq_len, sinks, window)
    except ValueError as e:
        sys.exit(f"train.py: --budget: {e}")
    need(size < seq_len, f"--budget {budget} keeps all {seq_len} tokens: nothing to learn")
    # a flag that this run would ignore is an error, as an unknown one is
    for why, on, names in [
        ("no --finetune", not finetune, "policy model_lr top_logits"),
        ("--policy streaming", policy == "streaming", "kind d_mem d_hidden gamma queries target edges init_from"),
        (f"--kind {kind}", True, {"kvpop": "", "kvpop-mlp": "d_mem arrival", "kvpop-window": "d_mem arrival"}[kind]),
        ("--init_from (its sizes are the folder's)", bool(init_from), "d_mem d_hidden gamma arrival"),
        (f"--data {data} (not the baby's task)", data != "baby", "keys final_seqs task"),
    ]:
        k = next((k for k in names.split() if on and k in given), None)
        need(k is None, f"--{k} does nothing with {why}; drop it (see --help)")
    # a scorer to start from: its kind is --kind's
    f = os.path.join(init_from, "scorer.json")
    need(not init_from or os.path.isfile(f), f"--init_from {init_from}: no scorer.json; give a train.py --out_dir")
    got = init_from and checkpoint.read_json(f).get("kind")
    need(not init_from or got == kind, f"--init_from {init_from} holds a {got} scorer; use --kind {got}")
    # flags first, then the folder
    need(
        not resume or os.path.isfile(os.path.join(out_dir, "train_state.pt")),
        f"--resume: no train_state.pt in {out_dir} to continue; drop --resume to start anew",
    )


if __name__ == "__main__":
    check_flags()
    torch.set_num_threads(threads)
    if world > 1:  # torchrun: one process per CPU share (gloo) or GPU (nccl)
        dist.init_process_group("gloo" if device == "cpu" else "nccl")
        device = device if device == "cpu" else f"cuda:{int(os.environ['LOCAL_RANK'])}"
    train()
    # DDP and FSDP keep the group's threads (gloo's run loops) alive past destroy_process_group, and Python's exit can
    # then abort a worker ("terminate called without an active exception"): a worker leaves without it
    if world > 1:
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)
