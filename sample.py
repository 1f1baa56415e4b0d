"""Sample from a Qwen3 checkpoint with a full or an evicting KV cache.

    python sample.py --model Qwen/Qwen3-0.6B --chat --prompt "Why is the sky blue?" --budget 0.25
"""
import os
import sys
import time

import torch

from kvpop import KVCache, Qwen3, Qwen3Config, Tokenizer, budget_size, checkpoint_dir, configure, policy_kind

# --- model
model = "Qwen/Qwen3-0.6B"  # checkpoint folder or Hugging Face repo id
device = "cuda" if torch.cuda.is_available() else "cpu"  # where the model runs
dtype = "auto"  # float32 / bfloat16 / float16; auto = the checkpoint's on cuda, float32 on cpu
# --- prompt
prompt = "The capital of France is"  # the text, or FILE:path to read it from a file
chat = False  # wrap the prompt in Qwen3's chat template
think = False  # with --chat: let the model think first (<think> ... </think>)
# --- sampling
num_samples = 1  # samples drawn one after another
max_new_tokens = 2048  # tokens generated per sample (fewer if the model stops)
temperature = 0.7  # 0 = greedy; Qwen3 suggests 0.6 thinking, 0.7 otherwise
top_k = 20  # keep the k most likely tokens (0 = off)
top_p = 0.8  # nucleus sampling (1 = off); Qwen3 suggests 0.95 thinking, 0.8 otherwise
seed = 1337  # random seed
# --- KV budget (SPEC.md section 1)
budget = 1.0  # fraction of prompt + max_new_tokens kept per head, or an integer B; 1 = full cache
policy = "streaming"  # who stays in the pool: streaming, knorm, random, h2o, tova (full = no eviction)
sinks = 4  # first tokens never evicted
window = 256  # most recent tokens never evicted
show = False  # print the text again, each token shaded by the share of (layer, head) caches holding it
configure(globals())


def fail(msg):
    sys.exit(f"sample.py: {msg}")


def shade(tok, ids, kept):  # grey (evicted everywhere) to white (kept everywhere), 256-colour ANSI
    dec, out = tok.decode_stream(), []
    for i, f in zip(ids, kept.tolist()):
        out.append(f"\x1b[38;5;{238 + round(17 * f)}m{dec(i)}")
    return "".join(out) + "\x1b[0m"


try:  # every check before the (slow) weights load
    folder = checkpoint_dir(model)
    limit = Qwen3Config.from_json(os.path.join(folder, "config.json")).max_position_embeddings
    tok = Tokenizer.from_pretrained(folder)
    text = open(prompt[5:], encoding="utf-8").read() if prompt.startswith("FILE:") else prompt
    ids = tok.encode(tok.chat(text, think) if chat else text)
    total = len(ids) + max_new_tokens
    if not ids or max_new_tokens < 1 or num_samples < 1:
        fail("need a non-empty prompt, --max_new_tokens >= 1 and --num_samples >= 1")
    if total > limit:
        fail(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
             f"{limit} positions; shorten the prompt or lower --max_new_tokens")
    if policy_kind(policy) == "full" and budget != 1:
        fail("policy full never evicts; use --budget 1 or an evicting --policy")
    S, _ = budget_size(budget, total, sinks, window)
    if dtype == "auto":
        dtype = None if device.startswith("cuda") else "float32"
    net = Qwen3.from_pretrained(folder, device=device, dtype=dtype)
except (OSError, ValueError) as e:
    fail(e)

torch.manual_seed(seed)
x = torch.tensor([ids], device=device)
for n in range(num_samples):
    cache = KVCache(net, 1, S, policy if S < total else "full", sinks, window)
    dec, out, t = tok.decode_stream(), [], [time.time()]
    print(text if not chat else tok.decode(ids), end="", flush=True)
    for nxt in net.generate(x, max_new_tokens, temperature, top_k, top_p, tok.stop, cache):
        out.append(int(nxt[0]))
        t.append(time.time())  # t[1]: the prompt is in the cache and the first token sampled
        if out[-1] in tok.stop:
            break
        print(dec(out[-1]), end="", flush=True)
    rate = (len(out) - 1) / (t[-1] - t[1]) if len(out) > 1 else 0.0
    print(f"\n---\nprefill {len(ids)} tokens in {t[1] - t[0]:.2f} s; decode {len(out)} tokens at {rate:.1f} tokens/s")
    full = cache.nbytes() * total / S  # a full cache holds every one of the `total` positions
    print(f"KV cache: {min(cache.t, S)} entries kept per head of {cache.t} tokens; "
          f"{cache.nbytes() / 2**20:.2f} MiB "
          f"vs {full / 2**20:.2f} MiB full ({100 * S / total:.1f}%), policy {cache.policy}")
    if show:
        seq = ids + out[:cache.t - len(ids)]
        p = cache.pos[:, 0]  # (L, Hkv, S) positions held, -1 = empty
        print(shade(tok, seq, torch.bincount(p[p >= 0], minlength=cache.t) / (p.shape[0] * p.shape[1])))
    print("=" * 80)
