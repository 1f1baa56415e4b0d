"""The baby Qwen3 from scratch on its tasks, recall and cue (README, The baby), nanoGPT style: defaults below,
override any with --name value (--help lists them).

  # the shipped baby, bit for bit (about 4 minutes on 2 CPU cores)
  python pretrain.py --out_dir my_baby
  # a tiny one, in seconds
  python pretrain.py --out_dir tiny --seq_len 64 --tokens 256 --phase_steps 2 --final_steps 2
  # the shipped code baby, bit for bit: the installed torch package's own source (README, Real text; about 13 minutes)
  python pretrain.py --data torch --out_dir codebaby --final_steps 700 --tokens 8192

The same Qwen3 class as any checkpoint, 2 layers: layer 0 a hand-built previous-token head, frozen; the rest learns
every position's next token plus --answer_weight x the task's answers, at lengths 64, 128, 256, then --seq_len; with
--data, every next token of the corpus's training files at --seq_len (support/corpus.py). It writes config.json and
model.safetensors into --out_dir and leaves the folder's other files (baby/'s prompt, scorers).
"""

import math
import os
import random
import shutil
import time
import types

import torch
import torch.nn.functional as F

import qwen3
from support import checks, flags, tokenizer
from support.corpus import code_held_out, code_sequences, last_seen
from tasks import TASKS, evaluate, task_batch

# --- run
out_dir = "out"  # written: config.json and model.safetensors (replaced; the folder's other files stay)
seed = 0  # seeds the initialisation and the training sequences
threads = 1  # CPU threads; 2 give the same bits, faster when idle, far slower when busy
# --- baby model: Qwen3 architecture, 2 layers, head_dim 64 (README, The baby)
vocab_ranks = 2048  # cut vocabulary: Qwen3 ranks below this, then the 26 added tokens
n_layer = 2  # layers
n_embd = 128  # hidden size (= 2 * head_dim: the upper half holds the previous token)
n_ff = 256  # MLP width
rope_theta = 1e4  # RoPE base
# --- data: the baby's tasks (tasks.py), or code
data = ""  # empty: the tasks; torch (the installed package's source) or a folder of .py/.txt files: code
task = "recall"  # the task of the shorter curriculum lengths and of the held-out check: recall or cue
final_tasks = "recall,cue"  # the tasks the steps at seq_len take in turn
keys = 8  # recall task: keys per sequence; fewer at the shorter curriculum lengths
seq_len = 0  # tokens per sequence (the curriculum's last length); 0: 512, or 1024 with --data
tokens = 4096  # tokens per step
# --- optimisation
lr = 3e-3  # AdamW peak learning rate
warmup = 50  # linear warmup steps (1 = none)
phase_steps = 500  # most steps at each shorter curriculum length
advance_acc = 0.9  # next length once train accuracy (20-step mean) reaches this
final_steps = 600  # steps at seq_len, cosine decay to 0
answer_weight = 4.0  # weight of the answers' loss on top of every position's next-token loss
flags.configure(globals())
seq_len = seq_len or (1024 if data else 512)


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
        a.v_proj.weight[:, :D] = torch.eye(D)
        a.o_proj.weight[D:, :D] = alpha * torch.eye(D)
    for p in [E, *a.parameters(), *model.model.layers[0].input_layernorm.parameters()]:
        # frozen: gradient destroys the seed in ~250 steps (LOG.md)
        p.requires_grad_(False)


def init_baby():
    torch.manual_seed(seed)
    # 2 query heads on 1 KV head; the input embedding is frozen, the output layer learns: untied
    shape = dict(vocab_size=vocab_ranks + 26, hidden_size=n_embd, intermediate_size=n_ff)
    heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=n_embd // 2)
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


def code_steps(model, opt, params, seqs):
    """--data: --final_steps steps of --tokens // --seq_len of the packed training sequences seqs (n, seq_len), in a
    seeded order drawn anew each epoch, every next token's loss; warmup, then a cosine to 0 -> the steps taken."""
    B, N, t0 = tokens // seq_len, len(seqs), time.time()
    g = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(N, generator=g) for _ in range(-(-final_steps * B // N))])
    for step in range(final_steps):
        f = min(1, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / final_steps))
        opt.param_groups[0]["lr"] = lr * f
        idx = seqs[order[step * B : (step + 1) * B]]  # (B, seq_len)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(idx, attn=causal)
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), idx[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % 50 == 0:
            print(f"step {step + 1} T {seq_len} loss {loss.item():.3f} {time.time() - t0:.0f}s")
    return final_steps


def held_out_batch(tok, files):
    """The held-out check's idx, tgt (the token to predict, -1 where none), dist (how far back it was last written,
    0 if never): --data: the held-out files (the next token everywhere); else the task's sequences."""
    if not data:
        valid = random.Random(f"valid-{seed}")
        return task_batch(tok, 64, seq_len, valid, keys=keys, **TASKS[task])
    tgt = F.pad(files[:, 1:], (0, 1), value=-1)
    dist = F.pad(last_seen(files)[:, 1:], (0, 1))
    return files, tgt, dist


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
    idx, tgt, dist = held_out_batch(tok, files)
    logits = evaluate(model.eval(), idx, "full", 1, online=False)
    # farther back than a 25% budget's plain window
    far = tgt.masked_fill(dist < seq_len // 4 - 4, -1)
    acc, far_acc = accuracy(logits, tgt), accuracy(logits, far)
    print(f"pretrained in {wall:.0f}s ({step} steps); held-out accuracy {acc:.3f}, far {far_acc:.3f}")
    model.save_pretrained(tmp)
    # file by file: what else out_dir holds (baby/'s prompt and scorers) stays
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(tmp):
        os.replace(os.path.join(tmp, f), os.path.join(out_dir, f))
    os.rmdir(tmp)
    print(f"saved {out_dir}/")


if __name__ == "__main__":
    checks.pretrain(types.SimpleNamespace(**globals()))
    torch.set_num_threads(threads)
    pretrain()
