"""Training, nanoGPT style: defaults below, override any with --name value (--help lists them).

# the default delayed scorer (kvpop-window) on the frozen baby
python train.py
# the same by the definitions alone, slowly: kvpop.py's scorers, kernels.py's plain forms
python train.py --plain
# a real Qwen3, on a GPU
python train.py --model Qwen/Qwen3-0.6B --data texts/ --seq_len 2048 --window 256 --budget 0.25 --device cuda
# the code baby's scorer
python train.py --task code --batch_size 2 --max_iters 600 --out_dir codebaby/scorers/code-max/kvpop-window
# the paper's recipe: the model trains too, under eviction; then its control, StreamingLLM+
python train.py --finetune --max_iters 300 --init_from baby/scorers/recall-helpful/kvpop-window --out_dir out-ftw
python train.py --finetune --max_iters 300 --policy streaming --out_dir out-sllm

Under torchrun --nproc_per_node=N it runs N processes: DDP for the scorer, FSDP2 for --finetune
(README, Several processes). The scorer learns the keep-or-drop decisions of a teacher that ranks
tokens by the model's future attention (README, Method: boundary loss); --finetune trains the model
too, under that eviction, by KL to the dense model (fine-tune).

"""

import math
import os
import random
import shutil
import sys
import time

import torch

import fast
import kernels
import kvpop
import qwen3
from cache import resolve
from support import checkpoint, flags, processes, tokenizer
from support.corpus import CODE_LENGTH, CODE_WINDOW, code_held_out, code_sequences, pack_files
from support.baby_tasks import TASKS, task_batch
from tasks import quality_runs, quality_table

# --- what to run
finetune = False  # the model trains too, under the eviction, by KL to the dense model
policy = "scorer"  # --finetune: scorer (--kind evicts) or streaming (StreamingLLM+, pi[t] = t)
out_dir = "out"  # written: scorer + train_state.pt (--finetune: the model too)
resume = False  # continue the run in out_dir from its last checkpoint, exactly
seed = 0  # seeds the initialisation and the training data (not the benchmark's)
device = "cpu"  # cpu or cuda
dtype = "auto"  # the frozen model's: auto = the checkpoint's on cuda, float32 on cpu
threads = 1  # CPU threads; 2 give the same bits, faster when idle, far slower when busy
plain = False  # the definitions alone: kvpop.py's, not fast.py's; kernels.py's plain forms (slow)
# --- scorer (README, Method: scorers)
model = "baby"  # the frozen model: a checkpoint folder or Hugging Face id (--task code: codebaby)
kind = "kvpop-window"  # delayed: kvpop-window (min(w - 1, 32) after t), kvpop (mLSTM); kvpop-mlp
d_mem = 16  # kvpop: memory d_mem x d_mem, 3 state entries on the baby (the paper's: 128)
d_hidden = 64  # the read-out's hidden width, every kind (the paper's: 128)
gamma = 0.002  # initial recency weight gamma_h of pi[t] = r[t] + gamma_h * t (learned)
arrival = False  # kvpop: read tokens on arrival, not as they leave the window (delay ablation)
received = False  # kvpop-window: also read log a[t], the attention t got in its window (code: true)
init_from = ""  # a trained scorer's folder to start from (its sizes), e.g. a frozen run's
target = "helpful"  # the teacher: helpful, max (ours), mean (the paper's) (--task code: max)
# --- data
data = "baby"  # baby: a task of support/baby_tasks.py; else .txt/.jsonl files (folder, glob)
task = "recall"  # --data baby: recall, cue (distractors), or code (the code baby's corpus)
corpus = "torch"  # --task code: torch (the installed package's source) or a folder of .py/.txt
keys = 8  # --data baby: keys per sequence
p_cue_min = 0.05  # --task cue: each sequence's distractor rate drawn uniformly from
p_cue_max = 0.35  # [p_cue_min, p_cue_max] (both 0.17: the task's own rate alone)
seq_len = 512  # tokens per sequence (--task code: 2048, support/corpus.py's CODE_LENGTH)
queries = 0  # the loss's query positions per sequence and pool, at random (0: all)
edges = 3  # the loss at the edges of this many pools: the budget's, then each half the last
# --- eviction at training time (README, Method: budget)
budget = 0.125  # the training budget: fraction of seq_len (or an integer S) per head
sinks = 4  # first tokens never evicted
window = 32  # recent tokens kept, the baby's (--task code: 192; the paper's: 256)
# --- optimisation
batch_size = 8  # sequences per step
max_iters = 600  # steps (--task cue: 1200, its range of rates takes longer)
lr = 3e-3  # the scorer's AdamW peak learning rate
min_lr = 3e-4  # cosine decay down to this
warmup = 50  # linear warmup steps
weight_decay = 1e-4  # AdamW weight decay (--finetune: the model's too)
grad_clip = 1.0  # clip the gradient norm (--finetune: the model's too)
model_lr = 1e-5  # --finetune: the model's AdamW peak rate, the baby's (others: 8e-5, the paper's)
top_logits = 256  # --finetune: KL to the dense model's top this many next tokens
# --- logging, evaluation, checkpoints
log_interval = 25  # print loss, keep/drop accuracy and tokens/s every this many steps
eval_interval = 100  # held-out far accuracy (baby) and a checkpoint, every this many steps
eval_seqs = 32  # held-out sequences per evaluation
final_seqs = 128  # held-out sequences of the final quality table (bench.py quality's; 0: none)
given = flags.configure(globals(), None if __name__ == "__main__" else [])  # tests: the defaults
# --task code, unless given: the code baby at its length and window, the max target, reading a[t]
code = task == "code"
model = "codebaby" if code and "model" not in given else model
seq_len = CODE_LENGTH if code and "seq_len" not in given else seq_len
window = CODE_WINDOW if code and "window" not in given else window
target = "max" if code and "target" not in given else target
can_read = {name: cls.receives for name, cls in kvpop.SCORERS.items()}  # a[t]
received = can_read.get(kind, False) if code and "received" not in given else received
model_lr = 8e-5 if model != "baby" and "model_lr" not in given else model_lr
max_iters = 1200 if data == "baby" and task == "cue" and "max_iters" not in given else max_iters
rank, world = processes.rank(), processes.world()  # torchrun's
log = (lambda *a: print(*a, flush=True)) if rank == 0 else lambda *a: None  # rank 0 logs
need = lambda ok, msg: flags.need(ok, msg, "train.py")  # bad input: one line, exit 1


# --------------------------------------------------------------------------------------------------
# the scorer on the frozen model: its loss (kvpop.boundary_loss), data, checkpoints, the loop


def query_positions(T, it, budgets):
    """The loss's queries, a tensor for each of `budgets`: every q at which its pool is over-full
    (q >= sinks + window + pool), or --queries of them drawn at random, a draw per (--seed, step it,
    budget)."""
    qs = []
    for j, budget in enumerate(budgets):
        q = torch.arange(budget.slots, T)
        if queries and queries < len(q):
            g = torch.Generator().manual_seed(seed * 1_000_003 + it + 7_919 * j)
            q = q[torch.randperm(len(q), generator=g)[:queries].sort().values]
        qs.append(q)
    return qs


def scorer_loss(scorer, kv, rs, qs, budgets, ddp=None):
    """kvpop.boundary_loss of every layer (target rs[i] (B, H, T), -inf past T - window) at each
    budget's queries qs[j], backward per layer if grad is enabled -> (loss, keep/drop accuracy),
    means over layers and budgets. `ddp`: training's scorer; the counts, gradients (reduced in the last
    layer's backward) and results are then the global batch's."""
    T, L = rs[0].shape[-1], len(kv)
    pos = torch.arange(T, device=rs[0].device)
    total, hits = 0.0, 0.0
    count = processes.allsum if ddp else None
    # a: the attention received, for a scorer that reads it
    for i, ((k, v, *a), r) in enumerate(zip(kv, rs)):
        with processes.no_sync(ddp, i < L - 1):
            # the teacher's priorities pi* = r* + gamma_h t
            teacher = r + scorer.recency(i, pos).detach()
            pi = (ddp or scorer)(i, k, v, pos, *a)
            loss, right = kvpop.boundary_loss(pi, teacher, qs, budgets, L, count)
            hits += right
            if torch.is_grad_enabled():
                (loss * world).backward()  # DDP averages over the processes
        total += loss.item()
    if ddp is not None:
        both = torch.tensor([total, hits], dtype=torch.float64)
        total, hits = processes.allsum(both).tolist()
    return total, hits


def batch(tok, texts, it):
    """Step it's sequences (batch_size, seq_len), a function of (--seed, it): a checkpoint's data
    position is its step. The baby task's are drawn fresh; of --data's texts[0] (N), the j-th is the
    (j % N)-th in epoch j // N's order."""
    if data == "baby" and task != "code":
        rng = random.Random(f"scorer-train-{seed}-{it}")
        # cue: a range of distractor rates, a rate a sequence (one rate: the task's own)
        rate = (p_cue_min, p_cue_max) if p_cue_min < p_cue_max else p_cue_min
        rates = dict(p_cue=rate) if task == "cue" else {}
        settings = TASKS[task] | rates
        return task_batch(tok, batch_size, seq_len, rng, keys=keys, **settings)[0]
    seqs, rows = texts[0], []
    N = len(seqs)
    for j in range(it * batch_size, (it + 1) * batch_size):
        g = torch.Generator().manual_seed(seed * 100_003 + j // N)
        rows.append(seqs[torch.randperm(N, generator=g)[j % N]])
    return torch.stack(rows)


def load():
    """Every check against the model's config, tokenizer and data first, the weights last -> the
    checkpoint folder, tokenizer, --data's sequences (pack_files; None: the baby's task), the frozen
    dense model, the model to fine-tune (--finetune), the scorer (None: StreamingLLM+), the loss's
    pools, the checkpoint to resume from."""
    learned = policy == "scorer"
    folder = checkpoint.checkpoint_dir(model)
    config = qwen3.Qwen3Config.from_json(os.path.join(folder, "config.json"))
    tok = tokenizer.Tokenizer.from_pretrained(folder)
    P = config.max_position_embeddings
    need(seq_len <= P, f"--seq_len {seq_len}: the model has only {P} positions")
    texts = pack_files(tok, data, seq_len, eval_seqs) if data != "baby" else None
    # --task code: the corpus's training files packed, its first held-out files
    if task == "code":
        held = code_held_out(tok, corpus, seq_len, eval_seqs)
        texts = code_sequences(tok, corpus, seq_len), held
    # the scorer: a fresh one at --seed, or a trained one (--resume's own, or --init_from's)
    torch.manual_seed(seed)
    sizes = (window, d_mem, d_hidden, gamma, arrival, received)
    scorer = kvpop.SCORERS[kind](config, *sizes).to(device) if learned else None
    state = os.path.join(out_dir, "train_state.pt")
    saved = torch.load(state, weights_only=True) if resume else None
    if learned and (resume or init_from):
        scorer = kvpop.load_scorer(out_dir if resume else init_from)
        scorer.check(config, window)
        scorer = scorer.to(device).requires_grad_(True).train()
        if resume:
            scorer.load_state_dict(saved["scorer"])
    # its fast forms (fast.py): the chunked memory of kvpop's kinds; --plain: its definitions
    scorer = scorer if plain or not learned else fast.speed_up(scorer)
    # the budget: the scorer's state comes off it
    dt = flags.auto_dtype(dtype, device)
    charge = kvpop.state_charge(scorer, getattr(torch, dt or config.torch_dtype))
    size, pool = kvpop.budget_size(budget, seq_len, sinks, window, charge)
    room = f"sinks + window + the scorer's state ({charge})"
    fix = "raise --budget or lower --window/--d_mem"
    need(pool >= 1, f"--budget {budget}: S = {size} leaves no pool after {room}; {fix}")
    # the boundary loss's budgets: the training one, then its pool halved, --edges in all
    pools = dict.fromkeys(max(pool >> j, 1) for j in range(edges))
    budgets = [kvpop.Budget(sinks, window, p) for p in pools]
    # the final table's budgets fit too
    tabled = data == "baby" and (task != "code" or finetune) and final_seqs
    for b in (0.25, 0.125) if tabled else ():
        try:
            kvpop.budget_size(b, seq_len, sinks, window, charge)
        except ValueError:
            where = f"at --seq_len {seq_len}, --window {window}"
            fix = "use --final_seqs 0 or a longer --seq_len"
            why = f"the final table's budget {b} leaves no room {where}"
            need(False, f"--final_seqs {final_seqs}: {why}; {fix}")
    # the frozen dense model; --finetune: the model it trains, at the step train_state.pt records
    net = qwen3.Qwen3.from_pretrained(folder, device, dt).requires_grad_(False)
    student = None
    if finetune:
        student = qwen3.Qwen3.from_pretrained(folder, device, dt).train()
    if resume and finetune:
        student.load_state_dict(saved["model"])
    count = sum(p.numel() for p in scorer.parameters()) if learned else 0
    what = f"{kind} scorer: {count} parameters" if learned else "StreamingLLM+"
    heads = f"{config.num_hidden_layers} layers x {config.num_key_value_heads} KV heads"
    what += f" for {model} ({heads}){', fine-tuning the model' * finetune}"
    split = f"S = {size} per head: {sinks} sinks + {window} window"
    split += f" + {pool} pool + {charge} state"
    log(f"{what}; budget {budget:g} = {split}; {world} process(es)")
    return folder, tok, texts, net, student, scorer, budgets, saved


def save(it, folder, scorer, scorer_opt, student, model_opt):
    """Everything to resume, written atomically by rank 0; --finetune: the model too, its full state
    gathered from every process's shards, and the tokenizer files beside it."""
    weights, model_opt_saved = None, None
    if student is not None:
        weights, model_opt_saved = processes.gather(student, model_opt)
    if rank:
        return
    if student is not None:
        student.save_pretrained(out_dir, weights)
        for f in checkpoint.OPTIONAL:
            src, dst = os.path.join(folder, f), os.path.join(out_dir, f)
            if os.path.isfile(src) and not os.path.isfile(dst):
                shutil.copyfile(src, dst + ".tmp")
                os.replace(dst + ".tmp", dst)
    if scorer is not None:
        # what the scorer was trained for, in scorer.json
        names = "model budget sinks window seq_len data task"
        names += " corpus" * (task == "code") + " target edges"
        names += " p_cue_min p_cue_max" * (task == "cue")
        scorer.meta = {k: globals()[k] for k in names.split()}
        scorer.meta.update(iters=it, finetune=finetune)
        checkpoint.save_scorer(scorer, out_dir)
    scorer_saved = dict(scorer=scorer and scorer.state_dict())
    scorer_saved["opt"] = scorer_opt and scorer_opt.state_dict()
    saved = dict(scorer_saved, model=weights, model_opt=model_opt_saved, iter=it)
    torch.save(saved, os.path.join(out_dir, "tmp.pt"))
    written = os.path.join(out_dir, "tmp.pt")
    os.replace(written, os.path.join(out_dir, "train_state.pt"))


def held_out(evaluated, tok, pol, texts, budgets):
    """Held-out (rank 0), of `evaluated` (the frozen model, or --finetune's as saved) under `pol`:
    far accuracy at the training budget (baby), else loss and keep/drop accuracy on texts[1]."""
    if data == "baby" and task != "code":
        rng = random.Random(f"valid-{seed}")
        x = task_batch(tok, eval_seqs, seq_len, rng, keys=keys, **TASKS[task])
        x = [t.to(device) for t in x]
        rows = quality_runs(evaluated, *x, [pol], [budget], sinks, window)[0]
        full, at_b = (r["far_accuracy"] for r in rows)
        return f"held-out far accuracy at budget {budget:g}: {at_b:.3f} (full {full:.3f})"
    if finetune:
        return "no held-out measure for --finetune on text"
    qs = query_positions(seq_len, 0, budgets)
    with torch.no_grad():
        held = texts[1].to(device)
        kv, rs = fast.dense_targets(evaluated, held, window, target, pol.received)
        loss, acc = scorer_loss(pol, kv, rs, qs, budgets)
    return f"held-out boundary loss {loss:.4f}, keep/drop accuracy {acc:.3f}"


def final_table(folder, tok, net, scorer):
    """The quality table on bench.py quality's held-out sequences: the scorer beside the oracle,
    streaming and h2o, or (--finetune) the fine-tuned model as saved under its eviction, against the
    dense model before. Code: the command that measures it (bench.py quality, its files)."""
    if task == "code":
        learned = f"--scorer {out_dir} --target {target}"
        scorers = learned if scorer is not None else "--scorer '' --policies streaming"
        bench = f"python bench.py quality --task code --model {out_dir} --ref {model}"
        return print(f"measure it: {bench} {scorers}")
    rng = random.Random("test-0")  # bench.py quality's
    seqs = task_batch(tok, final_seqs, seq_len, rng, **TASKS[task])
    ref, evaluated, pols = None, net, ["oracle", "streaming", "h2o", scorer]
    if finetune:
        ref = qwen3.Qwen3.from_pretrained(folder, dtype="float32")
        evaluated = qwen3.Qwen3.from_pretrained(out_dir)
        pols = [scorer or "streaming"]
    budgets = [0.25, 0.125]
    runs = (pols, budgets, sinks, window)
    rows, far, n = quality_runs(evaluated, *seqs, *runs, ref=ref, target=target)
    for r in rows[1:] if finetune else []:
        tuned = f"{r['policy']} (fine-tuned)"
        r["policy"] = tuned if scorer is not None else "StreamingLLM+"
    print(f"\n{final_seqs} held-out sequences (bench.py quality's), {n} queries ({far:.0%} far)\n")
    print(quality_table(rows))


# step it's scorer rate: linear warmup times a cosine from --lr down to --min_lr
def learning_rate(it):
    warm = min(1, (it + 1) / max(warmup, 1))
    return min_lr + (lr - min_lr) * warm * 0.5 * (1 + math.cos(math.pi * it / max_iters))


def train():
    # a bad checkpoint or data file: one line
    try:
        folder, tok, texts, net, student, scorer, budgets, saved = load()
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        sys.exit(f"train.py: {e}")
    ddp = processes.distribute(net, student, scorer, finetune)
    # an AdamW per module trained, its peak rate --lr (scorer) or --model_lr (model)
    hyper = dict(betas=(0.9, 0.95), weight_decay=weight_decay)
    peaks = [(m, r) for m, r in ((scorer, lr), (student, model_lr)) if m is not None]
    opts = {m: torch.optim.AdamW(m.parameters(), lr=r, **hyper) for m, r in peaks}
    it0 = saved["iter"] if resume else 0
    if resume:  # the optimizers' states as the checkpoint left them
        if scorer is not None:
            opts[scorer].load_state_dict(saved["opt"])
        if finetune:
            processes.load_optimizer(student, opts[student], saved["model_opt"])
        log(f"resuming {out_dir} at step {it0}")
    n = batch_size // world  # this process's share of a batch
    t0, seen = time.time(), []
    for it in range(it0, max_iters):
        # the model's rate follows the scorer's, in proportion to its peak (its optimizer's default)
        for o in opts.values():
            o.zero_grad(set_to_none=True)
            o.param_groups[0]["lr"] = learning_rate(it) * (o.defaults["lr"] / lr)
        idx = batch(tok, texts, it)[rank * n : (rank + 1) * n].to(device)
        qs = query_positions(seq_len, it, budgets)
        if finetune:
            # the model under the scorer's eviction, and the scorer on that pass
            args = (budgets, top_logits, target, ddp)
            kl, loss, acc = finetune_loss(student, net, scorer, idx, qs, *args)
        else:
            # the scorer on the frozen model's keys, values and targets
            kv, rs = fast.dense_targets(net, idx, window, target, scorer.received)
            kl, (loss, acc) = 0.0, scorer_loss(scorer, kv, rs, qs, budgets, ddp)
        for m, o in opts.items():
            torch.nn.utils.clip_grad_norm_(m.parameters(), grad_clip)
            o.step()
        seen.append((kl, loss, acc))
        if (it + 1) % log_interval == 0 or it == it0:
            # the means over this interval's steps so far (the first line: the first step alone)
            kl, loss, acc = (sum(x) / len(seen) for x in zip(*seen))
            parts = f" (KL {kl:.6f} + boundary {loss:.6f})" * finetune
            speed = (it + 1 - it0) * batch_size * seq_len / (time.time() - t0)
            stats = f"keep/drop accuracy {acc:.3f}, {speed:.0f} tokens/s"
            log(f"step {it + 1}: loss {loss + kl:.6f}{parts}, {stats}")
            seen = seen if (it + 1) % log_interval else []
        if (it + 1) % eval_interval == 0 or it + 1 == max_iters:
            save(it + 1, folder, scorer, opts.get(scorer), student, opts.get(student))
            # held-out, the scorer as it trains (no dropout: eval mode would change nothing)
            if rank == 0:
                evaluated = net
                if finetune:
                    evaluated = qwen3.Qwen3.from_pretrained(out_dir, device, torch.float32)
                measured = held_out(evaluated, tok, scorer or "streaming", texts, budgets)
                log(f"step {it + 1}: {measured}; saved {out_dir}/")
    log(f"trained in {time.time() - t0:.0f}s")
    if data == "baby" and (task != "code" or finetune) and final_seqs and rank == 0:
        final_table(folder, tok, net, scorer)


# --------------------------------------------------------------------------------------------------
# the fine-tune (--finetune) and several processes (torchrun: DDP for a scorer, FSDP2 a fine-tune)


def finetune_loss(student, net, scorer, idx, qs, budgets, top_logits, target, ddp=None):
    """One --finetune step's backward: the student (the model fine-tuned) learns under the scorer's
    eviction at budgets[0] by KL to the frozen dense model net's top `top_logits`; the scorer by the
    boundary loss at each budget's queries qs against net's --target future attention (the frozen
    run's teacher), on the student's keys and values -> KL, boundary loss, keep/drop accuracy."""
    budget = budgets[0]
    window = budget.window
    with torch.no_grad():
        K = min(top_logits, net.config.vocab_size)
        top = net(idx).float().topk(K, -1)  # (B, T, K)
        rs = None
        if scorer is not None:
            rs = kvpop.dense_targets(net, idx, window, target)[1]
    lt, kv = top.values.log_softmax(-1), []
    # the scorer's priorities (or StreamingLLM+'s)
    evict_by = resolve(scorer or "streaming")[1]

    def attn(i, q, k, v, pos):
        with torch.no_grad():
            # the scorer's priorities, with the attention each token received if it reads it
            reads = scorer is not None and scorer.received
            a = [kernels.window_received(q, k, window)] if reads else []
            e = kernels.eviction_times(evict_by(i, k, v, pos, *a), *budget)
        kv.append((k.detach(), v.detach(), *a))
        return kernels.attention(q, k, v, e, budget.sinks)[0]

    # KL(net's top K || student); FSDP averages gradients: every process holds as many tokens
    lp = student(idx, attn=attn).float().log_softmax(-1).gather(-1, top.indices)
    kl = (lt.exp() * (lt - lp)).sum(-1).mean()
    kl.backward()
    b = (0.0, 0.0)
    if scorer is not None:
        b = scorer_loss(scorer, kv, rs, qs, budgets, ddp)
    return processes.allsum(kl.detach().double()).item() / world, *b


def check(given):
    """Bad input, before any work: each flag on its own, then against the others and the files they
    name, every failure one line on stderr and exit 1. given: the flags the command line set."""
    flags.check_device(device, "train.py")
    flags.check_dtype(dtype, ("float32", "bfloat16", "float16"), "train.py")
    # a choice from a list
    choices = dict(kind=kvpop.SCORERS, task=(*TASKS, "code"), target=kvpop.TARGETS)
    choices["policy"] = ("scorer", "streaming")
    for name, among in choices.items():
        value = globals()[name]
        need(value in among, f"--{name} {value!r}: choose from {', '.join(among)}")
    # a number in range
    counts = "threads d_mem d_hidden seq_len window batch_size max_iters"
    counts += " log_interval eval_interval eval_seqs"
    lowest = dict.fromkeys((counts + " top_logits edges").split(), 1)
    lowest.update(dict.fromkeys("queries warmup final_seqs sinks".split(), 0))
    for name, low in lowest.items():
        value = globals()[name]
        need(value >= low, f"--{name} {value}: must be at least {low}")
    for name in ("lr", "model_lr"):
        value = globals()[name]
        need(value > 0, f"--{name} {value}: must be positive")
    # the rest, each its own line
    fine_tune = "--policy streaming is StreamingLLM+, a fine-tune: add --finetune"
    need(finetune or policy == "scorer", fine_tune)
    split = f"--batch_size {batch_size}: must split evenly over {world} processes"
    need(batch_size % world == 0, split)
    need(0 < gamma < 1, f"--gamma {gamma}: must be in (0, 1)")
    need(0 <= min_lr <= lr, f"--min_lr {min_lr}: must be in [0, --lr]")
    decay = "--weight_decay must be in [0, 1) and --grad_clip positive"
    need(0 <= weight_decay < 1 and grad_clip > 0, decay)
    need(1 <= keys <= 16 and seq_len >= 64, "--keys must be 1..16 and --seq_len at least 64")
    rates = f"--p_cue_min {p_cue_min}, --p_cue_max {p_cue_max}"
    need(0 <= p_cue_min <= p_cue_max < 1, f"{rates}: use 0 <= min <= max < 1")
    flags.check_seed(seed, "train.py")
    folder = out_dir.strip("/") and not os.path.isfile(out_dir)
    need(folder, f"--out_dir {out_dir!r}: give a folder name")
    # the training budget (train.load charges the scorer's state too)
    try:
        size = kvpop.budget_size(budget, seq_len, sinks, window)[0]
    except ValueError as e:
        flags.fail(f"--budget: {e}", "train.py")
    need(size < seq_len, f"--budget {budget} keeps all {seq_len} tokens: nothing to learn")
    # a flag that this run would ignore is an error, as an unknown one is
    memory = issubclass(kvpop.SCORERS[kind], kvpop.MemoryScorer)  # kvpop and its variants
    unread = [
        ("no --finetune", not finetune, "policy model_lr top_logits"),
        ("--policy streaming", policy == "streaming", "kind d_mem d_hidden gamma queries"),
        ("--policy streaming", policy == "streaming", "target edges init_from"),
        (f"--kind {kind}", not memory, "d_mem arrival"),
        ("--init_from (the folder's sizes)", bool(init_from), "d_mem d_hidden gamma arrival"),
        (f"--data {data} (not the baby's task)", data != "baby", "keys final_seqs task"),
        ("--task code (no baby's task)", task == "code", "keys"),
        ("--task code without --finetune", task == "code" and not finetune, "final_seqs"),
        (f"--task {task}", task != "code", "corpus"),
        (f"--task {task}", task != "cue", "p_cue_min p_cue_max"),
    ]
    for why, on, names in unread:
        for name in names.split():
            need(not (on and name in given), f"--{name} does nothing with {why}; drop it")
    # a scorer to start from, of --kind's kind
    if init_from:
        found = os.path.join(init_from, "scorer.json")
        give = "give a train.py --out_dir"
        need(os.path.isfile(found), f"--init_from {init_from}: no scorer.json; {give}")
        got = checkpoint.read_json(found).get("kind")
        need(got == kind, f"--init_from {init_from} holds a {got} scorer; use --kind {got}")
    ok = not resume or os.path.isfile(os.path.join(out_dir, "train_state.pt"))
    need(ok, f"--resume: no train_state.pt in {out_dir} to continue; drop --resume to start anew")


if __name__ == "__main__":
    check(given)
    torch.set_num_threads(threads)
    kernels.PLAIN = plain  # every kernel by its plain form, the cache by kvpop.evict
    device = processes.start(device)
    train()
    processes.finish()
