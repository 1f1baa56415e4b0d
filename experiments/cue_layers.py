"""Per layer, on held-out cue sequences: each scorer's keep/drop accuracy at the pool's edge and P(a live value's
priority > a distractor value's), beside the teacher's (LOG.md, 2026-12-05 night).

python -m experiments.cue_layers --scorers baby/scorers/cue-helpful/kvpop,baby/scorers/cue-helpful/kvpop-mlp
"""

import random

import torch

import kvpop
from experiments import shifted  # noqa: F401 (registers kvpop-shifted)
import qwen3
from support import baby_tasks, flags, tokenizer

# --- what to measure
scorers = "baby/scorers/cue-helpful/kvpop,baby/scorers/cue-helpful/kvpop-shifted,"  # comma-separated folders
scorers += "baby/scorers/cue-helpful/kvpop-mlp,baby/scorers/cue-helpful/kvpop-window"
target = "helpful"  # the teacher's future attention
seed = 0  # held-out sequences: bench.py quality's (test-<seed>)
n = 64  # sequences
p_cue = 0.17  # the cue task's distractor rate
budget = 0.125  # the pool whose edge is measured
sinks = 4  # first tokens never evicted
window = 32  # recent tokens never evicted
flags.configure(globals())
torch.set_num_threads(1)
net = qwen3.Qwen3.from_pretrained("baby", dtype=torch.float32)
tok = tokenizer.Tokenizer.from_pretrained("baby")
idx, tgt, dist = baby_tasks.task_batch(tok, n, 512, random.Random(f"test-{seed}"), p_cue=p_cue)
T = idx.shape[1]
pos = torch.arange(T)
pool = kvpop.budget_size(budget, T, sinks, window)[1]
queries = [torch.arange(sinks + window + pool, T)]
# live values: the ones a later query reads; distractor values: the word before `no`
live = torch.zeros_like(idx, dtype=torch.bool)
rows, cols = (tgt >= 0).nonzero(as_tuple=True)
live[rows, cols - dist[rows, cols]] = True
mark = baby_tasks.task_ids(tok)[0][baby_tasks.MARK]
distractor = torch.zeros_like(live)
distractor[:, :-1] = idx[:, 1:] == mark
# only tokens with a target (they leave the window before the end)
live[:, T - window :], distractor[:, T - window :] = False, False
with torch.no_grad():
    kv, rs = kvpop.dense_targets(net, idx, window, target)
    learned = {d: kvpop.load_scorer(d) for d in scorers.split(",")}


def above(pi):
    """P(pi[live] > pi[distractor]) over the pairs of one sequence, pooled over the sequences; pi (B, T)."""
    wins, pairs = 0.0, 0
    for b in range(len(pi)):
        a, d = pi[b][live[b]], pi[b][distractor[b]]
        wins += (a[:, None] > d[None, :]).sum().item()
        pairs += len(a) * len(d)
    return wins / pairs


def next_share(s, i, k, v):
    """How much of t's read falls on t + 1 (B, T): kvpop, |w_j (k'_j . u_t)| at j = t + 1 over its sum over the
    memory's tokens j <= q = t + w - 1 (kvpop-shifted: k'_j of x[j - 1]), w_j = exp(F_q - F_j + log i_j);
    kvpop-window, the mean over its reads of the softmax at offset 1; kvpop-mlp reads nothing (0)."""
    x, W = s.features(k, v), s.window
    B, H, T, _ = x.shape
    share = torch.zeros(B, T)
    if isinstance(s, kvpop.MemoryScorer):  # kvpop, kvpop-shifted
        li = (x * s.wi[i][:, None]).sum(-1) + s.bi[i][:, None]  # (B, H, T)
        lf = torch.nn.functional.logsigmoid((x * s.wf[i][:, None]).sum(-1) + s.bf[i][:, None])
        Fc = lf.double().cumsum(-1)  # F_j
        written = s.written_under(x)  # what the keys are made of
        key, u = written @ s.wk[i] / s.d_mem**0.5, x @ s.wr[i]  # (B, H, T, M)
        t = torch.arange(T - W + 1)
        q = t + W - 1
        j = torch.arange(T)
        logw = Fc[..., q, None] - Fc[..., None, :] + li[..., None, :]  # (B, H, R, T)
        logw = logw.masked_fill(j > q[:, None], -torch.inf)
        w = (logw - logw.amax(-1, keepdim=True)).exp() * (u[..., t, :] @ key.mT)
        share[:, t] = (w.abs()[..., t, t + 1] / w.abs().sum(-1))[:, 0].float()
    if s.kind == "kvpop-window":
        A, d, m = s.reads, s.d_key, s.bo.shape[-1]
        split = lambda y, wt: (y @ wt[i]).unflatten(-1, (A, d)).transpose(2, 3)  # (B, H, A, T, d)
        qa, ka = split(x, s.wq), split(x, s.wk)
        t = torch.arange(T - m)
        offsets = torch.arange(1, m + 1)
        logits = (qa[..., t, None, :] * ka[..., t[:, None] + offsets, :]).sum(-1) / d**0.5 + s.bo[i][:, :, None, :]
        share[:, t] = logits.softmax(-1)[..., 0].mean(2)[:, 0]
    return share


print(f"{n} cue sequences (seed {seed}, p_cue {p_cue}), pool {pool}; {int(live.sum())} live values, "
      f"{int(distractor.sum())} distractor values\n")
head = "| layer | kind | keep/drop accuracy | P(live > distractor) | read on t + 1: live | distractor |"
print(head + "\n|---|---|---|---|---|---|")
first = next(iter(learned.values()))
for i, ((k, v), r) in enumerate(zip(kv, rs)):
    # the teacher with the first scorer's recency term, as its loss sees it
    teacher = r + first.recency(i, pos)
    print(f"| {i} | teacher | 1.000 | {above(teacher[:, 0]):.3f} | - | - |")
    for d, s in learned.items():
        with torch.no_grad():
            mine = r + s.recency(i, pos)
            pi = s(i, k, v, pos)
            right = kvpop.boundary_loss(pi, mine, queries, [kvpop.Budget(sinks, window, pool)])[1]
            share = next_share(s, i, k, v)
        name = s.kind + " on arrival" * s.arrival
        reads = f"{share[live].mean():.3f} | {share[distractor].mean():.3f}"
        print(f"| {i} | {name} ({d}) | {right:.3f} | {above(pi[:, 0]):.3f} | {reads} |", flush=True)
