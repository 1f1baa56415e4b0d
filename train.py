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
  # the baby Qwen3 itself, from scratch on the recall task
  python train.py --stage pretrain --out_dir my_baby
  # several processes: DDP (scorer), FSDP2 (--finetune)
  torchrun --nproc_per_node=2 train.py ...

The scorer learns the keep-or-drop decisions of a teacher that ranks tokens by the model's future
attention (README, Method: boundary loss); --finetune trains the model too, under that eviction, by
KL to the dense model (fine-tune).
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
from tasks import TASK_RANKS, TASKS, quality_runs, quality_table, task_batch

# --- what to run
stage = "scorer"  # scorer: learn a scorer on a frozen model; pretrain: the baby from scratch
finetune = False  # stage scorer: the model trains too, under the eviction, by KL to the dense model
policy = "scorer"  # --finetune: scorer (--kind evicts) or streaming (StreamingLLM+, pi[t] = t)
out_dir = "out"  # written: scorer + train_state.pt (pretrain: the checkpoint, replaced whole)
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
target = "helpful"  # the teacher: helpful or max (ours), mean (the paper's) future attention past the window
# --- data
data = "baby"  # baby: a baby task (tasks.py); else .txt/.jsonl files (folder, glob), packed
task = "recall"  # --data baby: recall, or cue (distractors only the next word marks)
seq_len = 512  # tokens per sequence
queries = 0  # query positions per sequence in the loss, drawn at random (0 = every one)
# --- eviction at training time (README, Method: budget)
budget = 0.125  # the training budget: fraction of seq_len (or an integer B) per head
sinks = 4  # first tokens never evicted
window = 32  # recent tokens never evicted; a delayed scorer reads this many tokens late
# --- optimisation
batch_size = 8  # sequences per step
max_iters = 600  # scorer steps
lr = 3e-3  # AdamW peak learning rate (pretrain too)
min_lr = 3e-4  # scorer: cosine decay down to this
warmup = 50  # linear warmup steps (pretrain too)
weight_decay = 1e-4  # scorer: AdamW weight decay (--finetune: the model's too)
grad_clip = 1.0  # scorer: clip the gradient norm (--finetune: the model's too)
model_lr = 8e-5  # --finetune: the model's AdamW peak rate (the paper's; the scorer: --lr)
top_logits = 256  # --finetune: KL to the dense model's top this many next tokens
# --- logging, evaluation, checkpoints
log_interval = 25  # print loss, keep/drop accuracy and tokens/s every this many steps
eval_interval = 100  # held-out far accuracy (baby) and a checkpoint, every this many steps
eval_seqs = 32  # held-out sequences per evaluation
final_seqs = 128  # held-out sequences of the final quality table (bench.py quality's; 0 = none)
# --- baby model (pretrain): Qwen3 architecture, 2 layers, head_dim 64 (README, The baby)
vocab_ranks = 2048  # cut vocabulary: Qwen3 ranks below this, then the 26 added tokens
n_layer = 2  # layers
n_embd = 128  # hidden size (= 2 * head_dim: the upper half holds the previous token)
n_ff = 256  # MLP width
rope_theta = 1e4  # RoPE base
keys = 8  # recall task: keys per sequence; fewer at the shorter curriculum lengths
tokens = 4096  # pretrain: tokens per step
phase_steps = 500  # pretrain: most steps at each shorter curriculum length
advance_acc = 0.9  # pretrain: next length once train accuracy (20-step mean) reaches this
final_steps = 600  # pretrain: steps at seq_len, cosine decay to 0
answer_weight = 4.0  # pretrain: weight of the answers' loss on top of every position's next-token loss
final_tasks = "recall,cue"  # pretrain: the tasks the steps at seq_len take in turn (shorter: --task)
given = flags.configure(globals(), None if __name__ == "__main__" else [])  # tests: defaults
# set by torchrun
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
# only rank 0 logs
log = (lambda *a: print(*a, flush=True)) if rank == 0 else lambda *a: None
# bad input: one line, before any heavy work
need = lambda ok, msg: flags.need(ok, msg, "train.py")
need(stage in ("scorer", "pretrain"), f"--stage {stage!r}: choose scorer or pretrain")
need(kind in kvpop.SCORERS, f"--kind {kind!r}: choose from {', '.join(kvpop.SCORERS)}")
need(task in TASKS, f"--task {task!r}: choose from {', '.join(TASKS)}")
need(target in kvpop.TARGETS, f"--target {target!r}: choose {', '.join(kvpop.TARGETS)}")
need(device == "cpu" or device.startswith("cuda"), f"--device {device!r}: choose cpu or cuda")
need(device == "cpu" or torch.cuda.is_available(), f"--device {device}: no CUDA GPU is visible; use --device cpu")
need(dtype in ("auto", "float32", "bfloat16", "float16"), f"--dtype {dtype!r}: auto, float32, bfloat16 or float16")
for name in (
    "threads d_mem d_hidden seq_len window batch_size max_iters log_interval eval_interval eval_seqs n_layer "
    "n_embd n_ff tokens phase_steps final_steps top_logits"
).split():
    need(globals()[name] >= 1, f"--{name} {globals()[name]}: must be at least 1")
for name in "queries warmup final_seqs sinks".split():
    need(globals()[name] >= 0, f"--{name} {globals()[name]}: must be at least 0")
for name in "lr model_lr rope_theta".split():
    need(globals()[name] > 0, f"--{name} {globals()[name]}: must be positive")
need(policy in ("scorer", "streaming"), f"--policy {policy!r}: choose scorer or streaming")
need(finetune or policy == "scorer", "--policy streaming is StreamingLLM+, a fine-tune of the model: add --finetune")
need(stage == "scorer" or world == 1, "--stage pretrain runs in one process (not under torchrun)")
need(batch_size % world == 0, f"--batch_size {batch_size}: the global batch must split evenly over {world} processes")
need(0 < gamma < 1, f"--gamma {gamma}: must be in (0, 1)")
need(0 <= min_lr <= lr, f"--min_lr {min_lr}: must be in [0, --lr]")
need(0 <= weight_decay < 1 and grad_clip > 0, "--weight_decay must be in [0, 1) and --grad_clip positive")
need(0 < advance_acc <= 1, f"--advance_acc {advance_acc}: must be in (0, 1]")
need(answer_weight >= 0, f"--answer_weight {answer_weight}: use 0 or more")
need(
    all(t in TASKS for t in final_tasks.split(",")),
    f"--final_tasks {final_tasks!r}: comma-separated tasks from {', '.join(TASKS)}",
)
need(1 <= keys <= 16 and seq_len >= 64, "--keys must be 1..16 and --seq_len at least 64 (the recall task)")
need(
    n_embd % 4 == 0 and n_embd >= 24,
    f"--n_embd {n_embd}: use a multiple of 4, at least 24 (head_dim = n_embd / 2 "
    "is even and holds the seeded head's 6 rotation pairs)",
)
need(
    TASK_RANKS <= vocab_ranks <= 151643,
    f"--vocab_ranks {vocab_ranks}: use {TASK_RANKS}..151643 (every recall-task word must stay one token)",
)
need(0 <= seed < 2**32, f"--seed {seed}: use an integer 0 <= seed < 2**32")
need(out_dir.strip("/") and not os.path.isfile(out_dir), f"--out_dir {out_dir!r}: give a folder name")
need(stage != "pretrain" or seq_len <= 4096, f"--seq_len {seq_len}: the baby has 4096 positions")
need(stage != "pretrain" or tokens >= seq_len, f"--tokens {tokens}: use at least --seq_len ({seq_len}), one sequence")
need(stage != "pretrain" or warmup >= 1, f"--warmup {warmup}: pretrain needs at least 1 (1 = no warmup)")
try:
    B_train, pool = kvpop.budget_size(budget, seq_len, sinks, window) if stage == "scorer" else (seq_len, 0)
except ValueError as e:  # (pretrain never evicts: --budget, --sinks and --window do not apply)
    sys.exit(f"train.py: --budget: {e}")
need(stage == "pretrain" or B_train < seq_len, f"--budget {budget} keeps all {seq_len} tokens: nothing to learn")
for why, on, names in [  # a flag that this run would ignore is an error, as an unknown one is
    (
        "--stage pretrain",
        stage == "pretrain",
        "finetune resume device dtype model kind d_mem d_hidden gamma target "
        "data "
        "queries budget sinks window batch_size max_iters min_lr weight_decay grad_clip log_interval eval_interval "
        "eval_seqs final_seqs",
    ),
    (
        "--stage scorer",
        stage == "scorer",
        "vocab_ranks n_layer n_embd n_ff rope_theta tokens phase_steps advance_acc final_steps answer_weight "
        "final_tasks",
    ),
    ("no --finetune", not finetune, "policy model_lr top_logits"),
    ("--policy streaming (no scorer)", policy == "streaming", "kind d_mem d_hidden gamma queries target"),
    (f"--kind {kind}", True, {"kvpop": "d_hidden", "kvpop-mlp": "d_mem", "kvpop-window": "d_mem"}[kind]),
    (f"--data {data} (not the baby's task)", data != "baby", "keys final_seqs task"),
]:
    k = next((k for k in names.split() if on and k in given), None)
    need(k is None, f"--{k} does nothing with {why}; drop it (see --help)")
# flags first, then the folder pretraining would write into
need(
    stage != "pretrain" or not os.path.exists(out_dir) or os.path.isfile(os.path.join(out_dir, "config.json")),
    f"--out_dir {out_dir}: exists and is no checkpoint; pretrain writes its model files there, so name a new one",
)
need(
    not resume or os.path.isfile(os.path.join(out_dir, "train_state.pt")),
    f"--resume: no train_state.pt in {out_dir} to continue; drop --resume to start anew",
)


# ----------------------------------------------------------------------------------------------------------
# the scorer: frozen-model targets, teacher decisions, the boundary loss


def boundary(pi, e, q, sinks, window):
    """The teacher's decision for t_new = q - window at each query q (Q,): keep (B, H, Q), and the
    cutoff t_bnd: the k-th best eligible token, or the best dropped one when that is t_new. pi:
    priorities, e: their eviction times."""
    T = pi.shape[-1]
    u, tn = torch.arange(T, device=pi.device), q - window
    # by (pi, t)
    rank = torch.empty_like(e).scatter_(-1, pi.sort(stable=True).indices, u.expand_as(e))
    keep = e.gather(-1, tn.expand(*e.shape[:2], -1)) > q  # still visible at q
    elig = (u >= sinks) & (u <= tn[:, None])  # (Q, T)
    kept = elig & (e[..., None, :] > q[:, None])  # (B, H, Q, T): exactly the pool, k tokens
    worst = torch.where(kept, rank[..., None, :], T).argmin(-1)
    best_dropped = torch.where(elig & ~kept, rank[..., None, :], -1).argmax(-1)
    return keep, torch.where(worst == tn, best_dropped, worst)


def allsum(x):  # in place: the sum over processes, each holding its share of the global batch
    if world > 1:
        dist.all_reduce(x)
    return x


def query_positions(T, it):
    """The loss's queries: every q at which the pool is over-full (q >= sinks + window + pool), or
    --queries of them drawn at random, a draw per step."""
    # the pool is over-full: every step decides one token
    q = torch.arange(sinks + window + pool, T)
    if queries and queries < len(q):
        g = torch.Generator().manual_seed(seed * 1_000_003 + it)
        q = q[torch.randperm(len(q), generator=g)[:queries].sort().values]
    return q


def boundary_loss(scorer, kv, rs, q, sinks, window, pool, ddp=None):
    """Mean over layers of the balanced boundary loss at queries q (Q,) (README, Method: boundary
    loss), backward per layer (one layer's graph alive) when grad is enabled -> (loss, keep/drop
    accuracy). `ddp`: training's scorer; the keep/drop weights count the global batch, gradients are
    reduced once, in the last layer's backward."""
    T, L = rs[0].shape[-1], len(kv)  # rs: every layer's target r* (B, H, T)
    q, pos, total, hits = q.to(rs[0].device), torch.arange(T, device=rs[0].device), 0.0, 0.0
    for i, ((k, v), r) in enumerate(zip(kv, rs)):
        with ddp.no_sync() if isinstance(ddp, DDP) and i < L - 1 else contextlib.nullcontext():
            # (B, H, T); -inf past T - window
            teacher = r + F.softplus(scorer.theta[i]).detach()[:, None] * pos
            y, bnd = boundary(teacher, kernels.eviction_times(teacher, sinks, window, pool), q, sinks, window)
            pi = (ddp or scorer)(i, k, v, pos)
            # (B, H, Q)
            d = pi.gather(-1, (q - window).expand(*pi.shape[:2], -1)) - pi.gather(-1, bnd)
            n = torch.stack([y.sum(), (~y).sum()])
            n = allsum(n) if ddp is not None else n
            w = torch.where(y, 0.5 / n[0].clamp(min=1), 0.5 / n[1].clamp(min=1))  # keeps = drops
            # this process's part of the global loss
            loss = (w * F.softplus(-(2 * y.float() - 1) * d)).sum() / L
            if torch.is_grad_enabled():
                (loss * world).backward()  # DDP averages gradients over the processes
        right = (d > 0) == y  # the student ranks t_new on the teacher's side of t_bnd
        # balanced: chance is 0.5
        total, hits = total + loss.item(), hits + (w * right).sum().item() / L
    if ddp is not None:
        total, hits = allsum(torch.tensor([total, hits], dtype=torch.float64)).tolist()
    return total, hits


def finetune_loss(net, teacher, scorer, idx, qpos, sinks, window, pool, top_logits, ddp=None):
    """One --finetune step's backward: the model learns under the student's eviction by KL to the
    dense teacher's top `top_logits`, the scorer by the boundary loss at queries qpos on this
    evicting pass's future attention -> KL, boundary loss, keep/drop accuracy."""
    with torch.no_grad():
        logits = teacher(idx)  # (B, T, V)
        top = logits.float().topk(min(top_logits, teacher.config.vocab_size), -1)  # (B, T, K)
        lw = kvpop.next_logp(logits, idx) if target == "helpful" else 0.0  # the dense model's P
    lt, kv, rs = top.values.log_softmax(-1), [], []

    def attn(i, q, k, v, pos):
        with torch.no_grad():
            e = kernels.eviction_times(kvpop.priority(scorer or "streaming", i, k, v, pos), sinks, window, pool)
        y, lse = kernels.attention(q, k, v, e, sinks)
        if scorer is not None:
            kv.append((k.detach(), v.detach()))
            rs.append(
                kernels.future_attention(q.detach(), k.detach(), lse.detach() - lw, window, reduce=kvpop.REDUCE[target])
            )
        return y

    lp = net(idx, attn=attn).float().log_softmax(-1).gather(-1, top.indices)
    # FSDP averages gradients: every process holds as many tokens
    kl = (lt.exp() * (lt - lp)).sum(-1).mean()
    kl.backward()
    b = boundary_loss(scorer, kv, rs, qpos, sinks, window, pool, ddp) if scorer is not None else (0.0, 0.0)
    return allsum(kl.detach().double()).item() / world, *b


# step it's scorer rate: linear warmup times a cosine from --lr down to --min_lr
def learning_rate(it):
    warm = min(1, (it + 1) / max(warmup, 1))
    return min_lr + (lr - min_lr) * warm * 0.5 * (1 + math.cos(math.pi * it / max_iters))


def batch(tok, it, n):
    """Training sequences (n, seq_len) of step `it`: a function of (seed, it), so a checkpoint's
    data position is its step. The baby task draws fresh ones; files are packed once and drawn in a
    seeded order."""
    if data == "baby":
        return task_batch(tok, n, seq_len, random.Random(f"scorer-train-{seed}-{it}"), keys=keys, **TASKS[task])[0]
    N = len(chunks) - n_valid  # the last n_valid chunks are held out
    perm = lambda ep: torch.randperm(N, generator=torch.Generator().manual_seed(seed * 100_003 + ep))
    return torch.stack([chunks[perm(j // N)[j % N]] for j in range(it * n, it * n + n)])


def pack_files(tok):  # -> the text as sequences (n, seq_len), and how many of them are held out
    files = sorted(
        f
        for p in glob.glob(os.path.expanduser(data))
        for f in (glob.glob(os.path.join(p, "**", "*"), recursive=True) if os.path.isdir(p) else [p])
        if f.endswith((".txt", ".jsonl")) and os.path.isfile(f)
    )
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
    need(
        n >= 2,
        f"--data {data}: {len(files)} .txt/.jsonl files with {len(ids)} tokens of text; need at least "
        f"2 x --seq_len ({2 * seq_len}) tokens",
    )
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len), max(1, min(eval_seqs, n // 10))


def evaluate(net, tok, pol):
    """Held-out (rank 0): far accuracy at the training budget (baby task), else the boundary loss
    and its accuracy."""
    if data == "baby":
        x = task_batch(tok, eval_seqs, seq_len, random.Random(f"valid-{seed}"), keys=keys, **TASKS[task])
        rows = quality_runs(net, *[t.to(device) for t in x], [pol], [budget], sinks, window)[0]
        full, at_b = (r["far_accuracy"] for r in rows)
        return f"held-out far accuracy at budget {budget:g}: {at_b:.3f} (full {full:.3f})"
    if finetune:
        return "no held-out measure for --finetune on text"
    with torch.no_grad():
        x = chunks[-n_valid:].to(device)
        loss, acc = boundary_loss(
            pol, *kvpop.dense_targets(net, x, window, target), query_positions(seq_len, 0), sinks, window, pool
        )
    return f"held-out boundary loss {loss:.4f}, keep/drop accuracy {acc:.3f}"


def save(it, folder, scorer, opt, student, opt_m):
    """Everything to resume, written atomically by rank 0 (every process joins the gathering of
    --finetune's shards)."""
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
        scorer.meta = dict(
            model=model,
            budget=budget,
            sinks=sinks,
            window=window,
            data=data,
            task=task,
            target=target,
            iters=it,
            finetune=finetune,
        )
        scorer.save_pretrained(out_dir)
    state = dict(scorer=scorer and scorer.state_dict(), opt=opt and opt.state_dict(), model=sd, model_opt=osd, iter=it)
    torch.save(state, os.path.join(out_dir, "tmp.pt"))
    os.replace(os.path.join(out_dir, "tmp.pt"), os.path.join(out_dir, "train_state.pt"))


def load():
    """Every check against the model's config, tokenizer and data first, the weights last -> the
    checkpoint folder, tokenizer, frozen dense model, the model to fine-tune (--finetune), the
    scorer (None for StreamingLLM+) and the checkpoint to resume from. Sets this module's data
    (chunks, n_valid) and the training pool."""
    global chunks, n_valid, pool
    learned = policy == "scorer"  # else StreamingLLM+ (--finetune): no scorer
    try:
        folder = checkpoint.checkpoint_dir(model)
        config = qwen3.Qwen3Config.from_json(os.path.join(folder, "config.json"))
        tok = tokenizer.Tokenizer.from_pretrained(folder)
        need(seq_len <= (P := config.max_position_embeddings), f"--seq_len {seq_len}: the model has only {P} positions")
        chunks, n_valid = pack_files(tok) if data != "baby" else (None, 0)
        torch.manual_seed(seed)
        scorer = kvpop.Scorer(config, kind, window, d_mem, d_hidden, gamma).to(device) if learned else None
        ck = torch.load(os.path.join(out_dir, "train_state.pt"), weights_only=True) if resume else None
        if resume and learned:
            scorer = kvpop.Scorer.from_pretrained(out_dir).to(device).requires_grad_(True).train()
            scorer.load_state_dict(ck["scorer"])
        dt = None if dtype == "auto" and device != "cpu" else "float32" if dtype == "auto" else dtype
        charge = kvpop.state_charge(scorer, getattr(torch, dt or config.torch_dtype))
        # the scorer's state comes off it
        B, pool = kvpop.budget_size(budget, seq_len, sinks, window, charge)
        need(
            pool >= 1,
            f"--budget {budget}: B = {B} leaves no pool after sinks + window + the scorer's "
            f"state ({charge}); raise --budget or lower --window/--d_mem",
        )
        # the final table's budgets fit too
        for b in (0.25, 0.125) if data == "baby" and final_seqs else ():
            try:
                kvpop.budget_size(b, seq_len, sinks, window, charge)
            except ValueError:
                need(
                    False,
                    f"--final_seqs {final_seqs}: the final table's budget {b} leaves no room at --seq_len "
                    f"{seq_len}, --window {window}; use --final_seqs 0 or a longer --seq_len",
                )
        net = qwen3.Qwen3.from_pretrained(folder, device, dt).requires_grad_(False)  # frozen, dense
        student = qwen3.Qwen3.from_pretrained(folder, device, dt).train() if finetune else None
        # the weights of the step train_state.pt records (model.safetensors may be newer)
        if resume and finetune:
            student.load_state_dict(ck["model"])
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        sys.exit(f"train.py: {e}")
    what = f"{kind} scorer: {sum(p.numel() for p in scorer.parameters())} parameters" if learned else "StreamingLLM+"
    log(
        f"{what} for {model} ({config.num_hidden_layers} layers x {config.num_key_value_heads} KV heads)"
        f"{', fine-tuning the model' * finetune}; budget {budget:g} = {B} per head: {sinks} sinks + "
        f"{window} window + {pool} pool + {charge} state; {world} process(es)"
    )
    return folder, tok, net, student, scorer, ck


def distribute(net, student, scorer):
    """Several processes (torchrun): the scorer replicated (DDP; the model is frozen), or under
    --finetune the models split block by block (FSDP2) -> what computes the scorer's priorities (the
    DDP wrapper, or the scorer)."""
    if world > 1 and finetune:
        for m in (*net.model.layers, net, *student.model.layers, student):
            # each block's weights split over the processes, gathered for its forward/backward
            fully_shard(m)
    return DDP(scorer) if scorer is not None and world > 1 else scorer


def optimizers(scorer, student, ck):
    """An AdamW per module trained, its peak rate --lr (scorer) or --model_lr (model); with
    --resume, their states as the checkpoint left them -> {module: optimizer}, the step to start
    from."""
    opts = {
        m: torch.optim.AdamW(m.parameters(), lr=r, betas=(0.9, 0.95), weight_decay=weight_decay)
        for m, r in ((scorer, lr), (student, model_lr))
        if m is not None
    }
    if not resume:
        return opts, 0
    if scorer is not None:
        opts[scorer].load_state_dict(ck["opt"])
    if finetune:
        set_optimizer_state_dict(
            student, opts[student], ck["model_opt"], options=StateDictOptions(full_state_dict=True)
        )
    log(f"resuming {out_dir} at step {ck['iter']}")
    return opts, ck["iter"]


def train_step(it, tok, net, student, scorer, ddp, opts):
    """Step it on this process's share of the batch -> KL (fine-tune), boundary loss, keep/drop
    accuracy."""
    for o in opts.values():  # the model's rate follows the scorer's, in proportion
        o.zero_grad(set_to_none=True)
        o.param_groups[0]["lr"] = learning_rate(it) * (o.defaults["lr"] / lr)  # defaults: its peak
    n = batch_size // world
    idx = batch(tok, it, batch_size)[rank * n : (rank + 1) * n].to(device)
    q = query_positions(seq_len, it)
    if finetune:  # the model under the scorer's eviction, and the scorer on that pass
        kl, loss, acc = finetune_loss(student, net, scorer, idx, q, sinks, window, pool, top_logits, ddp)
    else:  # the scorer on the frozen model's keys, values and targets
        kl, (loss, acc) = (
            0.0,
            boundary_loss(scorer, *kvpop.dense_targets(net, idx, window, target), q, sinks, window, pool, ddp),
        )
    for m, o in opts.items():
        torch.nn.utils.clip_grad_norm_(m.parameters(), grad_clip)
        o.step()
    return kl, loss, acc


def final_table(folder, tok, net, scorer):
    """The quality table on bench.py quality's held-out sequences: the trained scorer beside the
    oracle, streaming and h2o, or (--finetune) the fine-tuned model under its eviction against the
    dense model it started from."""
    idx, tgt, dist = task_batch(tok, final_seqs, seq_len, random.Random("test-0"), **TASKS[task])
    # the dense start
    ref = qwen3.Qwen3.from_pretrained(folder, dtype="float32") if finetune else None
    pols = [scorer or "streaming"] if finetune else ["oracle", "streaming", "h2o", scorer]
    ev = qwen3.Qwen3.from_pretrained(out_dir) if finetune else net  # --finetune: the model as saved
    rows, far, n = quality_runs(ev, idx, tgt, dist, pols, [0.25, 0.125], sinks, window, ref=ref, reduce=target)
    for r in rows[1:] if finetune else []:
        r["policy"] = f"{r['policy']} (fine-tuned)" if scorer is not None else "StreamingLLM+"
    print(f"\n{final_seqs} held-out sequences (bench.py quality's), {n} queries ({far:.0%} far)\n")
    print(quality_table(rows))


def train():
    folder, tok, net, student, scorer, ck = load()
    ddp = distribute(net, student, scorer)
    opts, it0 = optimizers(scorer, student, ck)
    t0 = time.time()
    for it in range(it0, max_iters):
        kl, loss, acc = train_step(it, tok, net, student, scorer, ddp, opts)
        if (it + 1) % log_interval == 0 or it == it0:
            log(
                f"step {it + 1}: loss {loss + kl:.6f}{f' (KL {kl:.6f} + boundary {loss:.6f})' * finetune}, keep/drop "
                f"accuracy {acc:.3f}, {(it + 1 - it0) * batch_size * seq_len / (time.time() - t0):.0f} tokens/s"
            )
        if (it + 1) % eval_interval == 0 or it + 1 == max_iters:
            save(it + 1, folder, scorer, opts.get(scorer), student, opts.get(student))
            # the scorer as it trains: it has no dropout, so eval mode would change nothing
            if rank == 0:
                ev = qwen3.Qwen3.from_pretrained(out_dir, device, torch.float32) if finetune else net
                log(f"step {it + 1}: {evaluate(ev, tok, scorer or 'streaming')}; saved {out_dir}/")
    log(f"trained in {time.time() - t0:.0f}s")
    if data == "baby" and final_seqs and rank == 0:
        final_table(folder, tok, net, scorer)


# ----------------------------------------------------------------------------------------------------------
# the baby (stage pretrain): the same Qwen3 class, tiny, trained from scratch on the recall task


def seed_previous_token_head(model, nf=6, g=2.5, alpha=0.7):
    """Hand-built layer 0 (README, The baby): head 0's q and k read only dim 0 (a constant 1), the
    query rotated back one RoPE step: it attends to distance 1 and copies the previous token to the
    residual's upper half; head 1 off."""
    a, E, D = (model.model.layers[0].self_attn, model.model.embed_tokens.weight, model.config.head_dim)
    # the nf highest RoPE frequencies
    th = model.config.rope_theta ** (-torch.arange(0, D, 2).float() / D)[:nf]
    with torch.no_grad():
        E.normal_()
        E[:, 0], E[:, D:] = 1.0, 0.0
        for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight):
            w.zero_()
        a.k_proj.weight[:nf, 0] = 1.0  # key: (1, 0) in each rotation pair
        # R(-theta) key
        a.q_proj.weight[:nf, 0], a.q_proj.weight[D // 2 : D // 2 + nf, 0] = th.cos(), -th.sin()
        a.q_norm.weight.fill_(g)
        a.k_norm.weight.fill_(g)
        a.v_proj.weight[:, :D] = torch.eye(D)
        a.o_proj.weight[D:, :D] = alpha * torch.eye(D)
    for p in [E, *a.parameters(), *model.model.layers[0].input_layernorm.parameters()]:
        # frozen: gradient destroys the seed in ~250 steps (README, The baby)
        p.requires_grad_(False)


def init_baby():
    torch.manual_seed(seed)
    model = qwen3.Qwen3(
        qwen3.Qwen3Config(
            vocab_size=vocab_ranks + 26,
            hidden_size=n_embd,
            intermediate_size=n_ff,
            num_hidden_layers=n_layer,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=n_embd // 2,
            rope_theta=rope_theta,
            max_position_embeddings=4096,
            tie_word_embeddings=False,  # the input embedding is frozen, the output layer learns
            torch_dtype="float32",
        )
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(std=0.02)
        # sharper long-range attention from the start (README, The baby)
        for layer in model.model.layers[1:]:
            layer.self_attn.q_norm.weight.fill_(1.5)
            layer.self_attn.k_norm.weight.fill_(1.5)
    seed_previous_token_head(model)
    return model


def pretrain():
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model = init_baby()
    # the tokenizer (cut vocabulary) is read from the checkpoint's config
    model.save_pretrained(tmp)
    tok = tokenizer.Tokenizer.from_pretrained(tmp)
    params = [p for p in model.parameters() if p.requires_grad]
    print(
        f"baby: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"{sum(p.numel() for p in params) / 1e6:.2f}M trained"
    )
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    rng = random.Random(f"train-{seed}")  # the benchmark draws from "test-..." streams
    sdpa = lambda i, q, k, v, pos: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    accuracy = lambda logits, tgt: (logits.argmax(-1)[tgt >= 0] == tgt[tgt >= 0]).float().mean().item()
    step, t0, finals = 0, time.time(), final_tasks.split(",")
    for T in [L for L in (64, 128, 256) if L < seq_len] + [seq_len]:  # the curriculum
        last, n, accs = T == seq_len, final_steps if T == seq_len else phase_steps, []
        for i in range(n):
            f = min(1, (step + 1) / warmup) * (0.5 * (1 + math.cos(math.pi * i / n)) if last else 1)
            opt.param_groups[0]["lr"] = lr * f
            now = finals[i % len(finals)] if last else task
            idx, tgt, _ = task_batch(tok, tokens // T, T, rng, keys=keys, **TASKS[now])
            # sdpa: plain causal, torch's fused kernel (autograd); the next token everywhere, and
            # the answers (tgt: the next token where it is a recalled value) once more
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(idx, attn=sdpa)
            ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), idx[:, 1:].flatten(), reduction="none")
            loss = ce.mean() + answer_weight * ce[tgt[:, :-1].flatten() >= 0].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step, accs = step + 1, (accs + [accuracy(logits, tgt)])[-20:]
            if step % 50 == 0:
                print(
                    f"step {step} T {T} loss {loss.item():.3f} acc {sum(accs) / len(accs):.3f} {time.time() - t0:.0f}s"
                )
            if not last and len(accs) == 20 and sum(accs) / 20 >= advance_acc:
                break
    wall = time.time() - t0
    idx, tgt, dist = task_batch(tok, 64, seq_len, random.Random(f"valid-{seed}"), keys=keys, **TASKS[task])
    logits = kvpop.evaluate(model.eval(), idx, "full", 1, online=False)
    # farther back than a 25% budget's plain window
    far = tgt.masked_fill(dist < seq_len // 4 - 4, -1)
    print(
        f"pretrained in {wall:.0f}s ({step} steps); held-out accuracy {accuracy(logits, tgt):.3f}, "
        f"far {accuracy(logits, far):.3f}"
    )
    model.save_pretrained(tmp)
    # file by file: what else out_dir holds (baby/'s prompt and scorers) stays
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(tmp):
        os.replace(os.path.join(tmp, f), os.path.join(out_dir, f))
    os.rmdir(tmp)
    print(f"saved {out_dir}/")


if __name__ == "__main__":
    torch.set_num_threads(threads)
    if world > 1:  # torchrun: one process per CPU share (gloo) or GPU (nccl)
        dist.init_process_group("gloo" if device == "cpu" else "nccl")
        device = device if device == "cpu" else f"cuda:{int(os.environ['LOCAL_RANK'])}"
    pretrain() if stage == "pretrain" else train()
    # DDP and FSDP keep the group's threads (gloo's run loops) alive past destroy_process_group;
    # in 1 of 60 runs here Python's exit then aborted a worker ("terminate called without an
    # active exception"): a worker leaves without that teardown
    if world > 1:
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)
