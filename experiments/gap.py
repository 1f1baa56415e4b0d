"""Where the max oracle's KL gain over streaming comes from that the code student misses (issue
64, item 1), on held-out torch files (bench.py quality --task code's), at each budget:
(a) by head: the policies swapped one (layer, KV head) at a time in one masked pass; KL(full ||
    policy) per token at the positions t >= S (tools/measures.py's); beside the oracle (pi = r*),
    the student's teacher in training (pi* = r* + gamma_h t, the student's gamma);
(b) by position kind: the gain KL(streaming) - KL(policy) summed over the key tokens (LongPPL's,
    key_tokens) and over the others;
(c) by age, at one head: the pool's tokens at each query q >= S by age q - t, and the share of the
    oracle's pool the student's holds, per age bin;
(d) the dense attention p[q, t] (the mean over the head's query heads) the oracle's pool serves
    and the student's does not, and the reverse, per age bin; all reads, and the large ones.

python -m experiments.gap --json gap.json
"""

import torch

import kernels
import kvpop
import qwen3
from support import checkpoint, flags, tokenizer
from support.corpus import code_held_out
from tasks import evaluate
from tools.measures import key_tokens

# --- what to measure
model = "codebaby"  # the frozen model
scorer = "codebaby/scorers/code-max/kvpop-window"  # the student
target = "max"  # the oracle's target
budgets = "0.25,0.125"  # comma-separated fractions of T
n = 16  # the first held-out torch files
T = 2048  # tokens a file
sinks = 4  # first tokens never evicted
layer = 1  # (c, d): the layer of the head measured by age
head = 0  # (c, d): its KV head
swaps = True  # (a): also the runs with one head swapped; false: each policy alone
# --- output
json = ""  # write the numbers here (a .json path); empty: print only
flags.configure(globals())
torch.set_num_threads(1)

# the model, the student, the files, the dense pass
net = qwen3.Qwen3.from_pretrained(model, dtype=torch.float32)
net.requires_grad_(False)
tok = tokenizer.Tokenizer.from_pretrained(model)
student = kvpop.load_scorer(scorer)
window = student.window
idx = code_held_out(tok, "torch", T, n)  # (B, T)
pos = torch.arange(T)
H = net.config.num_key_value_heads
heads = [(i, h) for i in range(net.config.num_hidden_layers) for h in range(H)]
with torch.no_grad():
    full = net(idx).float().log_softmax(-1)  # (B, T, V)
    oracle = kvpop.dense_targets(net, idx, window, target)[1]
print(f"{scorer} on {len(idx)} held-out files, window {window}")


# each policy's priorities (B, H, T) of a layer in the masked pass, from its q, k, v
def read_student(i, q, k, v, pos):
    a = kernels.window_received(q, k, window)
    return student(i, k, v, pos, a)


# the student's teacher in training: the oracle's r* + gamma_h t, the student's recency
def read_teacher(i, q, k, v, pos):
    return oracle[i][:, :, pos] + student.recency(i, pos)


POLICIES = dict(
    streaming=lambda i, q, k, v, pos: kvpop.streaming(i, k, v, pos),
    student=read_student,
    teacher=read_teacher,
    oracle=lambda i, q, k, v, pos: oracle[i][:, :, pos],
)


@torch.no_grad()
def run(choice, budget):
    """One masked pass, choice[(layer, head)] the policy that evicts there -> KL(full || it) per
    token (B, P) at the positions S.. that predict one, every layer's eviction times (B, H, T)."""
    S, pool = kvpop.budget_size(budget, T, sinks, window)
    per_head = kvpop.Budget(sinks, window, pool)
    times = []

    def attn(i, q, k, v, pos):
        names = {choice[i, h] for h in range(H)}
        pis = {p: POLICIES[p](i, q, k, v, pos) for p in names}
        pi = [pis[choice[i, h]][:, h] for h in range(H)]
        out, e = kvpop.masked_attention(q, k, v, torch.stack(pi, 1), per_head)
        times.append(e)
        return out

    lp = net(idx, attn=attn).float().log_softmax(-1)
    f, lp = full[:, S:-1], lp[:, S:-1]
    return (f.exp() * (f - lp)).sum(-1), times


# one policy everywhere but `other` on the head `at`
def mixed(base, other=None, at=None):
    choice = {hd: base for hd in heads}
    if at is not None:
        choice[at] = other
    return choice


# (a) the runs: each policy alone, then one head swapped
def by_head(budget):
    rows = {p: run(mixed(p), budget) for p in POLICIES}
    pairs = [("oracle", "streaming"), ("oracle", "student")]
    pairs += [("student", "oracle"), ("streaming", "oracle")]
    for base, other in pairs * swaps:
        for at in heads:
            name = f"{base}, {other} on L{at[0]}H{at[1]}"
            rows[name] = run(mixed(base, other, at), budget)
    return rows


def by_kind(kl, key):
    """(b) The gain over streaming, KL(streaming) - KL(policy) (B, P), summed over the key tokens
    and over the others, each over all B P tokens (the two add to the mean gain), and the key
    tokens' share; the same for the gain the student misses (the oracle's less its own)."""
    out = {}
    for p in ("student", "teacher", "oracle"):
        gain = kl["streaming"] - kl[p]
        on_key = (gain * key).sum() / gain.numel()
        other = (gain * ~key).sum() / gain.numel()
        out[p] = dict(gain=gain.mean().item(), key=on_key.item())
        out[p]["other"] = other.item()
        out[p]["key_share"] = (on_key / gain.mean()).item()
    missed = {x: out["oracle"][x] - out["student"][x] for x in ("gain", "key", "other")}
    out["missed"] = missed | dict(key_share=missed["key"] / missed["gain"])
    return out


# (c, d) age bins of q - t, the last open
EDGES = [window, window + 32, window + 128, window + 512, T]
BINS = [f"[{lo}, {hi})" for lo, hi in zip(EDGES, EDGES[1:])]
LARGE = 0.1  # (d) a large read: p[q, t] at least this


@torch.no_grad()
def by_age(evict, budget):
    """At the head (layer, head), per age bin, means over queries q >= S and files: each policy's
    pool tokens and their dense attention mass, the student's share of the oracle's pool, and the
    mass served by the oracle's pool alone and by the student's alone (all reads, and the large
    ones). evict: {policy: eviction times (B, T) at the head}."""
    S = kvpop.budget_size(budget, T, sinks, window)[0]
    q = pos[S:, None]  # (Q, 1)
    age = q - pos  # (Q, T)
    eligible = (pos >= sinks) & (age >= window)
    bins = torch.bucketize(age, torch.tensor(EDGES), right=True) - 1
    group = net.config.num_attention_heads // H
    sums = {}

    def add(name, mask, weight):  # per bin: the sum of weight (Q, T) over mask
        got = [(weight * (mask & (bins == b))).sum().item() for b in range(len(BINS))]
        sums[name] = [x + y for x, y in zip(sums.get(name, [0] * len(BINS)), got)]

    # dense q, k of the layer (the dense pass again, one file at a time)
    for b in range(len(idx)):
        seen = {}

        def attn(i, qi, k, v, p):
            seen[i] = qi, k
            return kernels.attention(qi, k, v)[0]

        net(idx[b : b + 1], attn=attn)
        qs, k = seen[layer]
        qs = qs[0, head * group : (head + 1) * group]  # (G, T, D)
        scores = qs @ k[0, head].mT * qs.shape[-1] ** -0.5  # (G, T, T)
        causal = pos <= pos[:, None]
        probs = scores.masked_fill(~causal, -torch.inf).softmax(-1)
        p = probs.mean(0)[S:]  # (Q, T)
        pools = {name: eligible & (e[b] > q) for name, e in evict.items()}
        ones = torch.ones_like(p)
        for name, pool in pools.items():
            add(f"{name} tokens", pool, ones)
            add(f"{name} mass", pool, p)
        for ref in ("teacher", "oracle"):
            add(f"shared {ref}", pools[ref] & pools["student"], ones)
        add("oracle only mass", pools["oracle"] & ~pools["student"], p)
        add("student only mass", pools["student"] & ~pools["oracle"], p)
        # of that, the large reads alone
        big = p * (p >= LARGE)
        add(f"oracle only mass, p >= {LARGE:g}", pools["oracle"] & ~pools["student"], big)
        add(f"student only mass, p >= {LARGE:g}", pools["student"] & ~pools["oracle"], big)
    queries = len(idx) * (T - S)
    out = {name: [x / queries for x in v] for name, v in sums.items()}
    for ref in ("teacher", "oracle"):
        shared, held = out.pop(f"shared {ref}"), out[f"{ref} tokens"]
        holds = [s / max(o, 1e-9) for s, o in zip(shared, held)]
        out[f"student holds of {ref}'s"] = holds
    return out


# ---- each budget: the runs, then the tables
found = {}
for budget in map(float, budgets.split(",")):
    S = kvpop.budget_size(budget, T, sinks, window)[0]
    runs = by_head(budget)
    kl = {name: got[0] for name, got in runs.items()}
    # (a)
    stream, best = kl["streaming"].mean(), kl["oracle"].mean()
    print(f"\n## budget {budget:g} (S {S}): (a) KL by head, gap closed from streaming to oracle")
    print("| run | KL | gap closed |\n|---|---|---|")
    rows = {}
    for name, x in kl.items():
        rows[name] = x.mean().item()
        closed = (stream - x.mean()) / (stream - best)
        print(f"| {name} | {rows[name]:.4f} | {closed:.0%} |")
    # (b): key tokens, those streaming at this budget misses
    with torch.no_grad():
        local = evaluate(net, idx, "streaming", budget, sinks, window, online=False)
    key = key_tokens(full, local.float().log_softmax(-1), idx, S)  # (B, P)
    kinds = by_kind(kl, key)
    print(f"\n(b) the gain over streaming by position kind ({key.float().mean():.2%} key tokens)")
    print("| policy | gain | on key tokens | on the others | key share |")
    print("|---|---|---|---|---|")
    for p, g in kinds.items():
        cells = f"{g['gain']:.4f} | {g['key']:.4f} | {g['other']:.4f}"
        print(f"| {p} | {cells} | {g['key_share']:.0%} |")
    # (c, d) at the head, the pure runs' eviction times
    evict = {p: runs[p][1][layer][:, head] for p in POLICIES}
    ages = by_age(evict, budget)
    print(f"\n(c, d) L{layer}H{head} by age q - t, a query's mean (tokens; dense attention mass)")
    print("| measure | " + " | ".join(BINS) + " | all |")
    print("|---" * (len(BINS) + 2) + "|")
    for name, v in ages.items():
        whole = "-" if "holds" in name else f"{sum(v):.3g}"
        print(f"| {name} | " + " | ".join(f"{x:.3g}" for x in v) + f" | {whole} |")
    share = key.float().mean().item()
    found[budget] = dict(by_head=rows, by_kind=kinds, by_age=ages, key_share=share)

if json:
    numbers = dict(scorer=scorer, files=len(idx), bins=BINS, budgets=found)
    checkpoint.write_json(numbers, json)
    print(f"wrote {json}")
