"""Where a cue scorer's far errors come from, at layer 1 (the layer that retrieves): how many wrong far answers had
their value token evicted there, what the pool held at those queries, and the priorities r (without gamma_h t) of
live values, distractor values and the rest, beside the teacher's r* (LOG.md, 2026-12-06: cue at --p_cue 0.3).

python -m experiments.cue_evictions --scorer baby/scorers/cue-helpful/kvpop-window --p_cue 0.3
"""

import random

import torch

import kernels
import kvpop
import qwen3
import tasks
from support import baby_tasks, flags, tokenizer

# --- what to measure
scorer = "baby/scorers/cue-helpful/kvpop-window"  # a cue scorer's folder
seed = 0  # held-out sequences: bench.py quality's (test-<seed>)
n = 128  # sequences
p_cue = 0.3  # the distractor rate
budget = 0.125  # the budget evaluated
sinks = 4  # first tokens never evicted
window = 32  # recent tokens never evicted
flags.configure(globals())
torch.set_num_threads(1)
net = qwen3.Qwen3.from_pretrained("baby", dtype=torch.float32)
tok = tokenizer.Tokenizer.from_pretrained("baby")
policy = kvpop.load_scorer(scorer)
idx, tgt, dist = baby_tasks.task_batch(tok, n, 512, random.Random(f"test-{seed}"), p_cue=p_cue)
T = idx.shape[1]
pos = torch.arange(T)
size, pool = kvpop.budget_size(budget, T, sinks, window)
with torch.no_grad():
    kv, rs = kvpop.dense_targets(net, idx, window, "helpful")
    predicted = tasks.evaluate(net, idx, policy, budget, sinks, window, online=False).argmax(-1)
    k, v = kv[1]
    recency = policy.recency(1, pos)[0]
    r = policy(1, k, v, pos)[:, 0] - recency  # (n, T)
    teacher = rs[1][:, 0]
    evicted_at = kernels.eviction_times((r + recency)[:, None], sinks, window, pool)[:, 0]
    teacher_at = kernels.eviction_times((teacher + recency)[:, None], sinks, window, pool)[:, 0]
# the far answers, the value token each reads, and whether it was gone at layer 1
rows, q = (tgt >= 0).nonzero(as_tuple=True)
source = q - dist[rows, q]
far = dist[rows, q] >= kvpop.budget_size(0.25, T, sinks, window)[0] - sinks
wrong = far & (predicted[rows, q] != tgt[rows, q])
gone = wrong & (evicted_at[rows, source] <= q)
teacher_gone = far & (teacher_at[rows, source] <= q)
print(f"{scorer}, p_cue {p_cue}, seed {seed}, budget {budget} (pool {pool}), layer 1")
print(f"far answers {int(far.sum())}, wrong {int(wrong.sum())}, their value evicted {int(gone.sum())}")
print(f"far answers whose value the teacher's ranking evicts: {int(teacher_gone.sum())}")
# what the pool held at the queries whose value was evicted
mark = baby_tasks.task_ids(tok)[0][baby_tasks.MARK]
distractor = torch.zeros_like(idx, dtype=torch.bool)
distractor[:, :-1] = idx[:, 1:] == mark
held = []
for b, query in zip(rows[gone].tolist(), q[gone].tolist()):
    visible = [t for t in range(sinks, query - window + 1) if evicted_at[b, t] > query]
    held.append(sum(bool(distractor[b, t]) for t in visible))
print(f"the pool at those queries: {sum(held) / max(len(held), 1):.1f} distractor values of {pool}")
# priorities by the token's role (the last window's tokens are never scored against a query)
live = torch.zeros_like(distractor)
live[rows, source] = True
for mask in (live, distractor):
    mask[:, T - window :] = False
rest = ~(live | distractor)
rest[:, :sinks], rest[:, T - window :] = False, False
for name, mask in (("live values", live), ("distractor values", distractor), ("the rest", rest)):
    low, mid, high = torch.quantile(r[mask], torch.tensor([0.1, 0.5, 0.9])).tolist()
    print(f"{name}: r {r[mask].mean():.2f} (10/50/90%: {low:.2f} {mid:.2f} {high:.2f}), r* {teacher[mask].mean():.2f}")
