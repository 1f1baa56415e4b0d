"""The baby Qwen3 from scratch on its tasks, recall and cue (README, The baby), nanoGPT style: defaults below,
override any with --name value (--help lists them).

  # the shipped baby, bit for bit (about 4 minutes on 2 CPU cores)
  python pretrain.py --out_dir my_baby
  # a tiny one, in seconds
  python pretrain.py --out_dir tiny --seq_len 64 --tokens 256 --phase_steps 2 --final_steps 2
  # the shipped code baby, bit for bit: the installed torch package's own source (README, Real text; ~15 minutes)
  python pretrain.py --data torch --out_dir codebaby --threads 2

The same Qwen3 class as any checkpoint, 2 layers: layer 0 a hand-built previous-token head, frozen; the rest learns
every position's next token plus --answer_weight x the task's answers, at lengths 64, 128, 256, then --seq_len. With
--data, a wider model learns every next token of the corpus's training files at --seq_len (support/corpus.py), its
layer 1 seeded with a copying (induction) head that spans copied later in the same sequence teach to read far back.
It writes config.json and model.safetensors into --out_dir and leaves the folder's other files (prompt, scorers).
"""

import math
import os
import random
import shutil
import time

import torch
import torch.nn.functional as F

import qwen3
from support import flags, tokenizer
from support.corpus import code_files, code_held_out, code_sequences
from support.baby_tasks import TASK_RANKS, TASKS, task_batch
from tasks import evaluate
from tools.measures import code_runs

# --- run
out_dir = "out"  # written: config.json and model.safetensors (replaced; the folder's other files stay)
seed = 0  # seeds the initialisation and the training sequences
threads = 1  # CPU threads; 2 give the same bits, faster when idle, far slower when busy
# --- baby model: Qwen3 architecture, 2 layers, head_dim 64 (README, The baby); 0: the tasks' or --data's value
vocab_ranks = 2048  # cut vocabulary: Qwen3 ranks below this, then the 26 added tokens
n_layer = 2  # layers
n_embd = 0  # hidden size, at least 2 * head_dim (dims 64..127 hold the previous token); 0: 128, or 256 with --data
n_head = 0  # query heads; 0: 2, or 4 with --data
n_kv_head = 0  # KV heads; 0: 1, or 2 with --data
n_ff = 0  # MLP width; 0: 256, or 512 with --data
rope_theta = 0.0  # RoPE base; 0: 1e4, or 1e6 with --data (long-range heads see far positions apart)
# --- data: the baby's tasks (support/baby_tasks.py), or code
data = ""  # empty: the tasks; torch (the installed package's source) or a folder of .py/.txt files: code
task = "recall"  # the task of the shorter curriculum lengths and of the held-out check: recall or cue
final_tasks = "recall,cue"  # the tasks the steps at seq_len take in turn
keys = 8  # recall task: keys per sequence; fewer at the shorter curriculum lengths
seq_len = 0  # tokens per sequence (the curriculum's last length); 0: 512, or 2048 with --data
tokens = 0  # tokens per step; 0: 4096, or 8192 with --data
copies = 0.5  # --data: the share of sequences in which 2 spans of 64-256 tokens come back >= 256 tokens later
# --- optimisation
lr = 3e-3  # AdamW peak learning rate
warmup = 50  # linear warmup steps (1 = none)
phase_steps = 500  # most steps at each shorter curriculum length
advance_acc = 0.9  # next length once train accuracy (20-step mean) reaches this
final_steps = 0  # steps at seq_len, cosine decay to 0; 0: 600, or 300 with --data
answer_weight = 4.0  # weight of the answers' loss on top of every position's next-token loss
flags.configure(globals())
# the defaults that differ with --data
pick = lambda value, tasks, code: value or (code if data else tasks)
n_embd, n_head = pick(n_embd, 128, 256), pick(n_head, 2, 4)
n_kv_head, n_ff = pick(n_kv_head, 1, 2), pick(n_ff, 256, 512)
rope_theta, seq_len = pick(rope_theta, 1e4, 1e6), pick(seq_len, 512, 2048)
tokens, final_steps = pick(tokens, 4096, 8192), pick(final_steps, 600, 300)


# ----------------------------------------------------------------------------------------------------------
# the baby: the same Qwen3 class, tiny, trained from scratch on recall, then recall and cue in turn


def seed_previous_token_head(model, nf=6, g=2.5, alpha=0.7):
    """Hand-built layer 0 (README, The baby): head 0's q and k read only dim 0 (a constant 1), the query rotated back
    one RoPE step: it attends to distance 1 and copies the previous token to the residual's upper half; head 1 off."""
    a, D = model.model.layers[0].self_attn, model.config.head_dim
    E = model.model.embed_tokens.weight
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
        a.v_proj.weight[:D, :D] = torch.eye(D)
        a.o_proj.weight[D : 2 * D, :D] = alpha * torch.eye(D)
    for p in [E, *a.parameters(), *model.model.layers[0].input_layernorm.parameters()]:
        # frozen: gradient destroys the seed in ~250 steps (LOG.md)
        p.requires_grad_(False)


def seed_induction_head(model, low=12, g=1.5):
    """--data: layer 1's query head 0 on KV head 0 starts as a copying head: its query reads the current token (dims
    1..D-1), its key the previous token (dims D+1..2D-1), both through one random map into the `low` slowest RoPE
    pairs, so a token attends to what followed its earlier occurrences. Trained on from there (LOG.md: unseeded, no
    such head grows here)."""
    a, D = model.model.layers[1].self_attn, model.config.head_dim
    # the slowest rotation pairs: (i, i + D/2) for the last `low` i
    pairs = torch.cat([torch.arange(D // 2 - low, D // 2), torch.arange(D - low, D)])
    R = torch.randn(2 * low, D - 1) / (D - 1) ** 0.5
    with torch.no_grad():
        a.q_proj.weight[:D].zero_()
        a.k_proj.weight[:D].zero_()
        a.q_proj.weight[pairs, 1:D] = R
        a.k_proj.weight[pairs, D + 1 : 2 * D] = R
        a.q_norm.weight.fill_(g)
        a.k_norm.weight.fill_(g)


def learn_embedding(model):
    """--data: the input embedding learns too, but for the seeded head's columns (0, and D onwards: zero, the previous
    token's place)."""
    E, D = model.model.embed_tokens.weight, model.config.head_dim
    keep = torch.ones_like(E)
    keep[:, 0], keep[:, D:] = 0.0, 0.0
    E.requires_grad_(True)
    E.register_hook(lambda grad: grad * keep)


def init_baby():
    torch.manual_seed(seed)
    # n_head query heads on n_kv_head KV heads; the output layer learns, apart from the input embedding: untied
    shape = dict(vocab_size=vocab_ranks + 26, hidden_size=n_embd, intermediate_size=n_ff)
    heads = dict(num_attention_heads=n_head, num_key_value_heads=n_kv_head, head_dim=64)
    rest = dict(num_hidden_layers=n_layer, rope_theta=rope_theta, max_position_embeddings=4096)
    config = qwen3.Qwen3Config(**shape, **heads, **rest, tie_word_embeddings=False)
    config.torch_dtype = "float32"
    model = qwen3.Qwen3(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(std=0.02)
        # sharper long-range attention from the start (LOG.md)
        for layer in model.model.layers[1:]:
            layer.self_attn.q_norm.weight.fill_(1.5)
            layer.self_attn.k_norm.weight.fill_(1.5)
    seed_previous_token_head(model)
    if data:
        seed_induction_head(model)
        learn_embedding(model)
    return model


def causal(i, q, k, v, pos):
    """Plain causal attention, the model's attention hook in training: torch's fused kernel (autograd)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def accuracy(logits, tgt):  # on the answers (tgt >= 0)
    return (logits.argmax(-1)[tgt >= 0] == tgt[tgt >= 0]).float().mean().item()


def train_steps(model, tok, opt, params):
    """The curriculum: at each shorter length until the train accuracy reaches --advance_acc (at most --phase_steps),
    then --final_steps at --seq_len, the tasks in turn -> the steps taken."""
    # the benchmark draws from "test-..." streams
    rng = random.Random(f"train-{seed}")
    step, t0, finals = 0, time.time(), final_tasks.split(",")
    for T in [L for L in (64, 128, 256) if L < seq_len] + [seq_len]:
        last, accs = T == seq_len, []
        n = final_steps if last else phase_steps
        for i in range(n):
            f = min(1, (step + 1) / warmup) * (0.5 * (1 + math.cos(math.pi * i / n)) if last else 1)
            opt.param_groups[0]["lr"] = lr * f
            now = finals[i % len(finals)] if last else task
            idx, tgt, _ = task_batch(tok, tokens // T, T, rng, keys=keys, **TASKS[now])
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(idx, attn=causal)
            # the next token everywhere, and the answers (tgt: the next token where it is a recalled value) once more
            ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), idx[:, 1:].flatten(), reduction="none")
            loss = ce.mean() + answer_weight * ce[tgt[:, :-1].flatten() >= 0].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step, accs = step + 1, (accs + [accuracy(logits, tgt)])[-20:]
            if step % 50 == 0:
                acc, secs = sum(accs) / len(accs), time.time() - t0
                print(f"step {step} T {T} loss {loss.item():.3f} acc {acc:.3f} {secs:.0f}s")
            if not last and len(accs) == 20 and sum(accs) / 20 >= advance_acc:
                break
    return step


def copy_spans(idx, g):
    """--data's curriculum: in a --copies share of the sequences idx (B, T), 2 spans of T/32 to T/8 tokens each written
    again at least T/8 tokens later (64-256 tokens, 256 later, at T = 2048), as code repeats its names -> a copy."""
    idx, T = idx.clone(), idx.shape[1]
    shortest, longest = T // 32, T // 8  # a span's length, and the least distance to its copy
    for row in idx:
        if torch.rand((), generator=g) >= copies:
            continue
        for _ in range(2):
            n = int(torch.randint(shortest, longest + 1, (), generator=g))
            start = int(torch.randint(1, T - longest - 2 * n, (), generator=g))
            to = int(torch.randint(start + max(longest, n), T - n + 1, (), generator=g))
            row[to : to + n] = row[start : start + n]
    return idx


def next_token_loss(logits, idx):  # the mean cross-entropy of each position's logits (B, T, V) on the next token
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), idx[:, 1:].flatten())


def code_steps(model, opt, params, seqs):
    """--data: --final_steps steps of --tokens // --seq_len of the packed training sequences seqs (n, seq_len), in a
    seeded order drawn anew each epoch, spans copied in some (copy_spans), every next token's loss, in float32 (bf16
    is ~10x slower on CPUs without bf16 units); warmup, then a cosine to 0 -> the steps taken."""
    B, N, t0 = tokens // seq_len, len(seqs), time.time()
    g = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(N, generator=g) for _ in range(-(-final_steps * B // N))])
    for step in range(final_steps):
        f = min(1, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / final_steps))
        opt.param_groups[0]["lr"] = lr * f
        idx = copy_spans(seqs[order[step * B : (step + 1) * B]], g)  # (B, seq_len)
        loss = next_token_loss(model(idx, attn=causal), idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % 25 == 0:
            print(f"step {step + 1} T {seq_len} loss {loss.item():.3f} {time.time() - t0:.0f}s")
    return final_steps


def task_check(model, tok):
    """The held-out accuracy on the task's answers, and on those written farther back than a 25% budget's window."""
    idx, tgt, dist = task_batch(tok, 64, seq_len, random.Random(f"valid-{seed}"), keys=keys, **TASKS[task])
    logits = evaluate(model, idx, "full", 1, online=False)
    far = tgt.masked_fill(dist < seq_len // 4 - 4, -1)
    return f"held-out accuracy {accuracy(logits, tgt):.3f}, far {accuracy(logits, far):.3f}"


def key_check(model, files):
    """--data: on the held-out files (B, T), full's next-token accuracy, and at budgets 0.25 and 0.125 the share of
    next tokens that are key (README, Real text: they need what streaming evicts) with full's accuracy on them, means
    over files as bench.py quality --task code's (streaming's window: any, it keeps the latest tokens)."""
    right = evaluate(model, files, "full", 1, online=False).argmax(-1)[:, :-1] == files[:, 1:]  # (B, T - 1)
    found = [f"held-out accuracy {right.float().mean():.3f}"]
    for row in code_runs(model, files, [], [0.25, 0.125], 4, 1):  # full's row at each budget
        hit = "-" if row["key_top1"] is None else f"{row['key_top1']:.3f}"  # None: no file has a key token
        found.append(f"key tokens at {row['budget']:g} {row['key_share']:.2%} (full right on {hit})")
    return ", ".join(found)


def pretrain():
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model = init_baby()
    # the tokenizer (cut vocabulary) is read from the checkpoint's config
    model.save_pretrained(tmp)
    tok = tokenizer.Tokenizer.from_pretrained(tmp)
    # --data: the training files packed, 16 held-out files; too few tokens: one line, nothing left written
    try:
        seqs = code_sequences(tok, data, seq_len) if data else None
        files = code_held_out(tok, data, seq_len, 16) if data else None
    except ValueError as e:
        shutil.rmtree(tmp)
        flags.fail(e, "pretrain.py")
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in model.parameters()) / 1e6
    trained = sum(p.numel() for p in params) / 1e6
    print(f"baby: {n:.2f}M parameters, {trained:.2f}M trained")
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    t0 = time.time()
    step = code_steps(model, opt, params, seqs) if data else train_steps(model, tok, opt, params)
    wall = time.time() - t0
    check = key_check(model.eval(), files) if data else task_check(model.eval(), tok)
    print(f"pretrained in {wall:.0f}s ({step} steps); {check}")
    model.save_pretrained(tmp)
    # file by file: what else out_dir holds (baby/'s prompt and scorers) stays
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(tmp):
        os.replace(os.path.join(tmp, f), os.path.join(out_dir, f))
    os.rmdir(tmp)
    print(f"saved {out_dir}/")


def check():
    """pretrain.py's flags, then the folder it writes into and the corpus --data names: one line and exit 1 each."""
    need = lambda ok, msg: flags.need(ok, msg, "pretrain.py")
    # a number in range
    for name in "threads n_layer n_head n_kv_head n_ff tokens phase_steps final_steps warmup".split():
        value = globals()[name]
        need(value >= 1, f"--{name} {value}: must be at least 1")
    for name in ("lr", "rope_theta"):
        value = globals()[name]
        need(value > 0, f"--{name} {value}: must be positive")
    # the rest: each its own check
    need(int(os.environ.get("WORLD_SIZE", 1)) == 1, "pretraining runs in one process (not under torchrun)")
    names = ", ".join(TASKS)
    need(task in TASKS, f"--task {task!r}: choose from {names}")
    finals = set(final_tasks.split(","))
    need(finals <= set(TASKS), f"--final_tasks {final_tasks!r}: comma-separated tasks from {names}")
    need(0 < advance_acc <= 1, f"--advance_acc {advance_acc}: must be in (0, 1]")
    need(answer_weight >= 0, f"--answer_weight {answer_weight}: use 0 or more")
    need(1 <= keys <= 16, f"--keys {keys}: use 1..16 (the recall task)")
    lengths = "use 64 (the recall task) .. 4096 (the baby's positions)"
    need(64 <= seq_len <= 4096, f"--seq_len {seq_len}: {lengths}")
    need(tokens >= seq_len, f"--tokens {tokens}: use at least --seq_len ({seq_len}), one sequence")
    embd, heads, kv = n_embd, n_head, n_kv_head
    need(embd >= 128, f"--n_embd {embd}: use 128 or more (head_dim 64, and dims 64..127 hold the previous token)")
    need(heads % kv == 0, f"--n_head {heads}: use a multiple of --n_kv_head ({kv}), query heads share KV heads")
    need(0 <= copies <= 1, f"--copies {copies}: use a share in [0, 1]")
    ranks = f"use {TASK_RANKS}..151643 (every recall-task word must stay one token)"
    need(TASK_RANKS <= vocab_ranks <= 151643, f"--vocab_ranks {vocab_ranks}: {ranks}")
    flags.check_seed(seed, "pretrain.py")
    need(out_dir.strip("/") and not os.path.isfile(out_dir), f"--out_dir {out_dir!r}: give a folder name")
    # flags first, then the folder pretraining writes into
    ours = not os.path.exists(out_dir) or os.path.isfile(os.path.join(out_dir, "config.json"))
    name_new = "pretrain.py writes its model files there, so name a new one"
    need(ours, f"--out_dir {out_dir}: exists and is no checkpoint; {name_new}")
    # --data: a folder with .py/.txt files (their tokens are counted once read)
    try:
        code_files(data) if data else None
    except FileNotFoundError as e:
        need(False, f"--data: {e}")


if __name__ == "__main__":
    check()
    torch.set_num_threads(threads)
    pretrain()
