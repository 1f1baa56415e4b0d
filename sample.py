"""Sample from a Qwen3 checkpoint with a full or an evicting KV cache.

# offline: the shipped baby, its recall prompt, its delayed scorer
python sample.py --budget 0.25 --show
# the same by the definitions alone, slowly: kvpop.py's scorer, the cache by kvpop.evict
python sample.py --budget 0.25 --plain
# a real Qwen3 (the Hugging Face cache, else downloaded), evicting by recency
python sample.py --model Qwen/Qwen3-0.6B --chat --prompt "Why is the sky blue?" --budget 0.25 --policy streaming
"""

import os
import time

# before torch loads: large tensors on 2 MB pages (fewer TLB misses as a step streams the cache)
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
import torch

import fast
import kernels
from cache import KVCache, resolve
from kvpop import SCORERS, budget_size, entries, load_scorer, state_charge
from qwen3 import Qwen3, Qwen3Config, generate
from support.baby_tasks import recall_marks, recall_score, task_ids
from support.checkpoint import DTYPES, checkpoint_dir, read_json
from support.corpus import CODE_LENGTH, CODE_WINDOW, code_held_out
from support.flags import auto_dtype, check_budget, check_device, check_dtype, check_seed
from support.flags import configure, fail, need
from support.tokenizer import Tokenizer

# --- model
model = "baby"  # checkpoint folder or Hugging Face repo id; baby, codebaby: the demos
device = "cuda" if torch.cuda.is_available() else "cpu"  # where the model runs
dtype = "auto"  # float32 / bfloat16 / float16; auto = the checkpoint's on cuda, float32 on cpu
threads = 1  # CPU threads (a model over 100M parameters: torch's count)
compile = False  # each decoding step one compiled graph (a GPU: CUDA graphs; a CPU: inductor)
plain = False  # the definitions alone: kvpop.py's scorers and kvpop.evict a token a step (slow)
# --- prompt
prompt = "FILE:baby/prompt.txt"  # text or FILE:path (codebaby: a held-out file; Qwen3: a sentence)
chat = False  # wrap the prompt in Qwen3's chat template
think = False  # with --chat: let the model think first (<think> ... </think>)
# --- sampling: the baby's own distribution (a nucleus would cut its rare keys); Qwen3's advice
num_samples = 4  # samples drawn one after another, for the baby's recall scoreboard (others: 1)
max_new_tokens = 112  # tokens a sample, fewer if it stops (codebaby: 256, others: 2048)
temperature = 1.0  # 0 = greedy (a real Qwen3: 0.7, thinking 0.6)
top_k = 0  # keep the k most likely tokens, 0 = off (a real Qwen3: 20)
top_p = 1.0  # nucleus sampling, 1 = off (a real Qwen3: 0.8, thinking 0.95)
seed = 1337  # random seed
# --- KV budget (README, Method: budget)
budget = 1.0  # fraction of prompt + max_new_tokens kept per head, or an integer S; 1 = full cache
policy = "kvpop-window"  # a learned kind, streaming, knorm, random, h2o, tova, full (Qwen3: streaming)
scorer = ""  # a scorer's folder; empty: out/ if it holds --policy's kind, else the (code)baby's
sinks = 4  # first tokens never evicted
window = 32  # recent tokens never evicted (a scorer: its own; codebaby: 192; a real Qwen3: 256)
show = False  # print the text again, each token shaded by how many (layer, head) caches hold it
given = configure(globals())
# the presets of the demos and of a real Qwen3, each unless given
baby, code = model == "baby", model == "codebaby"
qwen = not (baby or code)
preset = lambda name, value: globals()[name] if name in given else value
sentence = "" if code else "The capital of France is"
prompt = preset("prompt", "FILE:baby/prompt.txt" if baby else sentence)
num_samples = preset("num_samples", 4 if baby else 1)
max_new_tokens = preset("max_new_tokens", 112 if baby else 256 if code else 2048)
temperature = preset("temperature", (0.6 if think else 0.7) if qwen else 1.0)
top_k = preset("top_k", 20 if qwen else 0)
top_p = preset("top_p", (0.95 if think else 0.8) if qwen else 1.0)
window = preset("window", CODE_WINDOW if code else 256 if qwen else 32)
# a scorer folder names its kind (a --scorer without scorer.json: said below)
kind_file = os.path.join(scorer, "scorer.json")
named = scorer and os.path.isfile(kind_file)
scorer_kind = str(read_json(kind_file).get("kind", "")) if named else ""
policy = preset("policy", scorer_kind or policy)
policy = preset("policy", "streaming" if qwen and not scorer else policy)


# bad input, each flag on its own, before anything is looked up or loaded: one line, exit 1
check_device(device)
check_dtype(dtype, DTYPES)
need(chat or not think, "--think only applies to the chat template; add --chat or drop --think")
need(threads >= 1, f"--threads {threads}: use 1 or more")
need(num_samples >= 1, f"--num_samples {num_samples}: use 1 or more")
need(max_new_tokens >= 1, f"--max_new_tokens {max_new_tokens}: generate at least 1 token")
need(temperature >= 0, f"--temperature {temperature:g}: use 0 (greedy) or more")
off = "use 0 (off) or the number of likeliest tokens kept"
need(top_k >= 0, f"--top_k {top_k}: {off}")
need(0 < top_p <= 1, f"--top_p {top_p:g}: use 0 < top_p <= 1 (1 = off)")
check_seed(seed)
check_budget(budget)
need(sinks >= 0, f"--sinks {sinks}: use 0 or more")
need(window >= 1, f"--window {window}: use 1 or more")
no_graph = "--plain runs kvpop.evict in Python, a head at a time: no graph to compile"
need(not (plain and compile), f"{no_graph}; drop --compile or --plain")
kernels.PLAIN = plain  # every kernel by its plain form, the cache by kvpop.evict
research = f"holds a {scorer_kind} scorer, a kind sample.py does not load (experiments/: bench.py)"
need(not scorer_kind or scorer_kind in SCORERS, f"--scorer {scorer} {research}")
learned = ", ".join(SCORERS)
why = f"only a learned --policy ({learned}) reads one; drop --scorer or choose one of those"
need(not scorer or policy in SCORERS, f"--scorer {scorer}: {why}")
# a learned scorer, before the model: --scorer, else out/ if it holds this kind, else the shipped
try:
    pol = policy
    if policy in SCORERS:
        trained = "a scorer train.py trained for this model"
        need(scorer or baby or code, f"--policy {policy} needs --scorer DIR, {trained}")
        if not scorer:
            out = os.path.isfile("out/scorer.json")
            out = out and read_json("out/scorer.json").get("kind") == policy
            shipped = "codebaby/scorers/code-max" if code else "baby/scorers/recall-helpful"
            scorer = "out" if out else f"{shipped}/{policy}"
        pol = load_scorer(scorer).to(device)
        pol = pol if plain else fast.speed_up(pol)  # fast.py's forms, unless --plain
        need(policy == pol.kind, f"--scorer {scorer} holds a {pol.kind} scorer, not {policy}")
        ablation = "reads on arrival (the delay ablation): bench.py quality runs it"
        need(not pol.arrival, f"--scorer {scorer} {ablation}")
        window = preset("window", pol.window)  # a delayed scorer reads at its own window
    rule = resolve(pol)[0]
except (OSError, ValueError) as e:
    fail(f"--policy {policy}: {e}")
never = "--policy full never evicts; use --budget 1 or an evicting --policy"
need(rule != "full" or budget == 1, never)
try:
    text = open(prompt[5:], encoding="utf-8").read() if prompt.startswith("FILE:") else prompt
except (OSError, UnicodeDecodeError) as e:
    why = getattr(e, "strerror", None) or e
    fail(f"--prompt {prompt}: cannot read it ({why}); use FILE:path of a UTF-8 file")
# then against the checkpoint, before the (slow) weights load; a scorer's state comes off the budget
try:
    folder = checkpoint_dir(model)
    config = Qwen3Config.from_json(os.path.join(folder, "config.json"))
    tok = Tokenizer.from_pretrained(folder)
    ids = tok.encode(tok.chat(text, think) if chat else text)
    # codebaby: the first held-out torch file of 2048 tokens (support/corpus.py), from its opening
    if code and not text:
        opening = code_held_out(tok, "torch", CODE_LENGTH, 2)[0, : CODE_LENGTH - max_new_tokens]
        opening = opening.tolist()
        ids, text = opening, tok.decode(opening)
    total, limit = len(ids) + max_new_tokens, config.max_position_embeddings
    need(ids, "--prompt is empty; give some text or FILE:path")
    asked = f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens})"
    asked += f" exceeds the model's {limit} positions"
    need(total <= limit, f"{asked}; shorten the prompt or lower --max_new_tokens")
    if policy in SCORERS:
        pol.check(config, window)
    dtype = auto_dtype(dtype, device)
    charge = state_charge(pol, getattr(torch, dtype or config.torch_dtype))
    S = budget_size(budget, total, sinks, window, charge)[0]
    net = Qwen3.from_pretrained(folder, device=device, dtype=dtype, config=config)
except (OSError, ValueError) as e:
    fail(e)
# a small model's decoding step is too small to share: one thread unless --threads is given
small = sum(p.numel() for p in net.parameters()) < 1e8
torch.set_num_threads(threads if small or "threads" in given else torch.get_num_threads())
# --compile: one graph a decoding step; on a GPU replayed as a CUDA graph
mode = "reduce-overhead" if device.startswith("cuda") else None
compiled = torch.compile(net, fullgraph=True, dynamic=False, mode=mode) if compile else None
# the policy the cache runs (full: the budget keeps every token); the baby's token id -> word
name = policy if S < total else "full"
word = {i: w for w, i in task_ids(tok)[0].items()} if baby else {}


def shade(ids, kept):
    """ids as text, each token grey (evicted everywhere) to white (kept everywhere) in 256-colour
    ANSI."""
    dec = tok.decode_stream()
    out = [f"\x1b[38;5;{238 + round(17 * f)}m{dec(i)}" for i, f in zip(ids, kept.tolist())]
    return "".join(out) + dec() + "\x1b[0m"


def draw(pol, size, echo):
    """num_samples samples under policy pol with `size` entries per head, seeded alike -> their ids;
    echo: print the prompt, then each sample (the baby's marked when it ends, any other as it comes)
    and its report; t[1]: the prompt is in the cache and the first token sampled."""
    torch.manual_seed(seed)
    x, outs = torch.tensor([ids], device=device), []
    if echo:
        print(tok.decode(ids) if chat else text, end="\n" + "=" * 80 + "\n", flush=True)
    # the policy's own samples: each step through the compiled model, if --compile
    step = compiled if echo else None
    for _ in range(num_samples):
        cache = KVCache(net, 1, size, pol, sinks, window)
        dec, out, t = tok.decode_stream(), [], [time.time()]
        outs.append(out)
        drawn = (max_new_tokens, temperature, top_k, top_p, tok.stop)
        for nxt in generate(net, x, *drawn, cache, step):
            out.append(int(nxt[0]))
            t.append(time.time())
            if out[-1] in tok.stop:
                break
            if echo and not baby:
                print(dec(out[-1]), end="", flush=True)
        if echo:
            print(marked(out) if baby else "", end="")
            report(cache, out, t, dec)
    return outs


def marked(out):
    """The baby's sample, each word the scoreboard counts marked: ✓ its key's current value, ✗
    another."""
    marks = recall_marks([word.get(i) for i in ids + out], len(ids))
    dec, sign = tok.decode_stream(), {True: "✓", False: "✗", None: ""}
    text = [dec(i) + sign[marks.get(len(ids) + j)] for j, i in enumerate(out) if i not in tok.stop]
    return "".join(text) + dec()


def report(cache, out, t, dec):
    """Flush dec (a character cut off by the end of generation), then print the sample's timing and
    cache lines, and with --show its shading. The full cache: every position, every layer; most: the
    most entries any (layer, row, KV head) holds; p: (L, Hkv, entries) positions held, -1 =
    empty."""
    print(dec(), end="")
    rate = (len(out) - 1) / (t[-1] - t[1]) if len(out) > 1 else 0.0
    prefill = f"prefill {len(ids)} tokens in {t[1] - t[0]:.2f} s"
    on = f"{torch.get_num_threads()} thread(s)" if device == "cpu" else device
    print(f"\n---\n{prefill}; decode {len(out)} tokens at {rate:.1f} tokens/s on {on}")
    state = f" + scorer state worth {charge}" if charge and S < total else ""
    full = 2 * cache.k[:, :, :, 0].numel() * cache.k.element_size() * total
    most = int((cache.pos >= 0).sum(-1).max())
    taken = int(cache.t)
    kept = f"{most} entries kept per head{state} of {taken} tokens"
    used = cache.nbytes()
    size = f"{used / 2**20:.2f} MiB vs {full / 2**20:.2f} MiB full ({100 * used / full:.1f}%)"
    learned = f" ({scorer})" if name in SCORERS else ""
    print(f"KV cache: {kept}; {size}, policy {name}{learned}")
    if show:
        seq, p = ids + out[: taken - len(ids)], cache.pos[:, 0]
        heads = p.shape[0] * p.shape[1]
        print(shade(seq, torch.bincount(p[p >= 0], minlength=taken) / heads))
    print("=" * 80)


outs = draw(pol if S < total else "full", entries(S, charge, total), True)
# the baby: its recall scoreboard, the same prompt and seed under the policy, full and streaming
if baby:
    board = {name: outs}
    for p, size in [("full", total)] + [("streaming", S)] * (S < total):
        if p not in board:
            board[p] = draw(p, size, False)
    for p, samples in board.items():
        scores = [recall_score([word.get(i) for i in ids + o], len(ids)) for o in samples]
        R, N = map(sum, zip(*scores))
        print(f"recall {p} {budget:g}: {R}/{N}")
