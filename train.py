"""Training, nanoGPT style: defaults below, override any with --name value.

  python train.py --stage pretrain --out baby   # the baby Qwen3 on the recall task of bench.py (issue [4/6])

The baby is the same Qwen3 class as the real models, tiny, trained from scratch on 2 CPU cores. One circuit is
built by hand (see `seed_previous_token_head`); everything that does long-range retrieval is learned.
"""
import math
import os
import random
import shutil
import time

import torch
import torch.nn.functional as F

import kvpop
from bench import task_batch

# --- what to run
stage = "pretrain"  # pretrain: the baby from scratch
out = "baby"  # checkpoint folder to write (replaced atomically)
seed = 0  # seeds the initialisation and the training sequences (never the benchmark's)
threads = 1  # CPU threads; 2 gives the same bits, faster on an idle machine, far slower on a busy one
# --- baby model: Qwen3 architecture, 2 layers, head_dim 64 (BABY.md: head_dim 32 never learned the task)
vocab_ranks = 2048  # cut vocabulary: Qwen3 ranks below this, then the 26 added tokens
n_layer = 2  # layers
n_embd = 128  # hidden size (= 2 * head_dim: the upper half holds the previous token)
n_ff = 256  # MLP width
rope_theta = 1e4  # RoPE base
# --- task (bench.py): sequence length and live keys
seq_len = 512  # final training length (the benchmark's T)
keys = 8  # keys per sequence; fewer at the shorter curriculum lengths
# --- optimisation
lr = 3e-3  # AdamW peak learning rate
warmup = 50  # linear warmup steps
tokens = 4096  # tokens per step
phase_steps = 500  # most steps at each shorter curriculum length
advance_acc = 0.9  # move to the next length once train accuracy (mean of 20 steps) reaches this
final_steps = 300  # steps at seq_len, cosine decay to 0
kvpop.configure(globals())


def baby_config():
    return kvpop.Qwen3Config(vocab_size=vocab_ranks + 26, hidden_size=n_embd, intermediate_size=n_ff,
                             num_hidden_layers=n_layer, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=n_embd // 2, rope_theta=rope_theta, max_position_embeddings=4096,
                             tie_word_embeddings=True, torch_dtype="float32")


def seed_previous_token_head(model, nf=6, g=2.5, alpha=0.7):
    """Hand-built layer 0 (stated in the README). Embeddings live in the lower half of the residual, with dim 0
    a constant 1 for every token. Head 0's query and key read only dim 0, so q.k depends on distance alone;
    the query is the key rotated back by one step of the nf highest RoPE frequencies, so q.k peaks at distance
    1 (>= 99.9% of the attention for g = 2.5). Its value is the normalised embedding, written to the empty
    upper half: the residual holds [this token, previous token]. Head 1 is switched off."""
    c, a = model.config, model.model.layers[0].self_attn
    D, E = c.head_dim, model.model.embed_tokens.weight
    th = c.rope_theta ** (-torch.arange(0, D, 2).float() / D)[:nf]  # highest frequencies
    with torch.no_grad():
        E.normal_()
        E[:, 0], E[:, D:] = 1.0, 0.0
        for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight):
            w.zero_()
        a.k_proj.weight[:nf, 0] = 1.0  # key: (1, 0) in each rotation pair
        a.q_proj.weight[:nf, 0], a.q_proj.weight[D // 2:D // 2 + nf, 0] = th.cos(), -th.sin()  # R(-theta) key
        a.q_norm.weight.fill_(g)
        a.k_norm.weight.fill_(g)
        a.v_proj.weight[:, :D] = torch.eye(D)
        a.o_proj.weight[D:, :D] = alpha * torch.eye(D)
    frozen = [E, *a.parameters(), *model.model.layers[0].input_layernorm.parameters()]
    for p in frozen:
        p.requires_grad_(False)  # gradient destroys the seed in ~250 steps (BABY.md)


def init_baby():
    torch.manual_seed(seed)
    model = kvpop.Qwen3(baby_config())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(std=0.02)
        for layer in model.model.layers[1:]:  # sharper long-range attention from the start (BABY.md)
            layer.self_attn.q_norm.weight.fill_(1.5)
            layer.self_attn.k_norm.weight.fill_(1.5)
    seed_previous_token_head(model)
    return model


def sdpa(i, q, k, v, pos):  # training attention: plain causal, torch's fused kernel (autograd, bf16)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def accuracy(logits, tgt):
    m = tgt >= 0
    return (logits.argmax(-1)[m] == tgt[m]).float().mean().item()


def pretrain():
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model = init_baby()
    model.save_pretrained(tmp)  # the tokenizer (cut vocabulary) is read from the checkpoint's config
    tok = kvpop.Tokenizer.from_pretrained(tmp)
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"baby: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{sum(p.numel() for p in params) / 1e6:.2f}M trained")
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    rng = random.Random(f"train-{seed}")  # the benchmark draws from "test-..." streams
    lengths = [L for L in (64, 128, 256) if L < seq_len] + [seq_len]
    step, t0 = 0, time.time()
    for T in lengths:
        last, n, accs = T == seq_len, final_steps if T == seq_len else phase_steps, []
        for i in range(n):
            f = min(1, (step + 1) / warmup) * (0.5 * (1 + math.cos(math.pi * i / n)) if last else 1)
            for group in opt.param_groups:
                group["lr"] = lr * f
            idx, tgt, _ = task_batch(tok, tokens // T, T, rng, keys=keys)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits, loss = model(idx, tgt, attn=sdpa)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step, accs = step + 1, (accs + [accuracy(logits, tgt)])[-20:]
            if step % 50 == 0:
                print(f"step {step} T {T} loss {loss.item():.3f} acc {sum(accs) / len(accs):.3f} "
                      f"{time.time() - t0:.0f}s")
            if not last and len(accs) == 20 and sum(accs) / 20 >= advance_acc:
                break
    wall = time.time() - t0
    idx, tgt, dist = task_batch(tok, 64, seq_len, random.Random(f"valid-{seed}"), keys=keys)
    logits = kvpop.evaluate(model.eval(), idx, "full", 1, online=False)
    far = tgt.masked_fill(dist < seq_len // 4 - 4, -1)  # farther back than a 25% budget's plain window
    print(f"pretrained in {wall:.0f}s ({step} steps); held-out accuracy {accuracy(logits, tgt):.3f}, "
          f"far {accuracy(logits, far):.3f}")
    model.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    print(f"saved {out}/")


if __name__ == "__main__":
    torch.set_num_threads(threads)
    if stage != "pretrain":
        raise SystemExit(f"train.py: unknown --stage {stage!r} (pretrain)")
    pretrain()
