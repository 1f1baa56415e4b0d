"""How well a code scorer follows its teacher, per layer and KV head, on the sequences it trained on against held-out
files (issue: the student learns its teacher on real text). At the budget's pool, for each (layer, head):
- acc: the balanced keep/drop accuracy at the pool's edge (kvpop.boundary_loss's, every query);
- auc: at the last query, the chance that the student ranks a token the teacher keeps above one it dropped (rank
  based, over every eligible token: near-ties in r* cannot dominate it);
- overlap: the share of the teacher's pool the student's own pool holds at the last query (1: the same tokens);
- recent: the share of the teacher's pool that streaming would hold too (1: a head whose teacher keeps recency).

python -m experiments.student --scorer codebaby/scorers/code-max/kvpop-window
"""

import torch

import kernels
import kvpop
import qwen3
from support import flags, tokenizer
from support.corpus import code_held_out, code_sequences

# --- what to measure
scorer = "codebaby/scorers/code-max/kvpop-window"  # a code scorer's folder
model = "codebaby"  # the frozen model it was trained on
target = ""  # the teacher's target; empty: the one the scorer was trained on
budget = 0.125  # the budget whose pool is measured
sinks = 4  # first tokens never evicted
n = 32  # sequences of each kind: the first it trained on, and held-out files
seed = 0  # train.py's --seed (which training sequences came first)
flags.configure(globals(), None if __name__ == "__main__" else [])  # imported (tests): the defaults
torch.set_num_threads(1)


def auc(score, positive, negative):
    """The chance that score (N,) ranks a positive above a negative, ties half (Mann-Whitney), pair by pair."""
    above = score[positive][:, None] - score[negative][None, :]
    return ((above > 0).double() + 0.5 * (above == 0).double()).mean().item()


def measure(net, policy, idx, window, pool, goal):
    """Per (layer, head) means over the sequences idx (B, T): acc, auc, overlap, recent."""
    T = idx.shape[1]
    pos = torch.arange(T)
    q = torch.arange(sinks + window + pool, T)
    last = T - 1
    eligible = (pos >= sinks) & (pos <= last - window)
    with torch.no_grad():
        kv, rs = kvpop.dense_targets(net, idx, window, goal, policy.received)
    rows = []
    for layer, ((k, v, *a), r) in enumerate(zip(kv, rs)):  # a: the attention received, if the scorer reads it
        with torch.no_grad():
            pi = policy(layer, k, v, pos, *a)  # (B, H, T)
            teacher = r + policy.recency(layer, pos)
        e_teacher = kernels.eviction_times(teacher, sinks, window, pool)
        e_student = kernels.eviction_times(pi, sinks, window, pool)
        keep, cut = kernels.boundary(teacher, e_teacher, q, kvpop.Budget(sinks, window, pool))
        t_new = (q - window).expand_as(keep)
        right = (pi.gather(-1, t_new) > pi.gather(-1, cut)) == keep  # (B, H, Q)
        kept = eligible & (e_teacher > last)  # the teacher's pool at the last query
        dropped = eligible & ~kept
        ours = eligible & (e_student > last)
        streaming = eligible & (pos > last - window - pool)
        for head in range(pi.shape[1]):
            y, hit = keep[:, head], right[:, head].double()
            balanced = 0.5 * (hit * y).sum() / y.sum().clamp(min=1) + 0.5 * (hit * ~y).sum() / (~y).sum().clamp(min=1)
            size = kept[:, head].sum(-1).double()
            row = dict(layer=layer, head=head, acc=balanced.item())
            aucs = [auc(pi[b, head], kept[b, head], dropped[b, head]) for b in range(len(idx))]
            row["auc"] = sum(aucs) / len(aucs)
            row["overlap"] = ((kept & ours)[:, head].sum(-1) / size).mean().item()
            row["recent"] = ((kept & streaming)[:, head].sum(-1) / size).mean().item()
            rows.append(row)
    return rows


if __name__ == "__main__":
    net = qwen3.Qwen3.from_pretrained(model, dtype=torch.float32).requires_grad_(False)
    tok = tokenizer.Tokenizer.from_pretrained(model)
    policy = kvpop.load_scorer(scorer)
    trained = policy.meta
    goal = target or trained.get("target", kvpop.TARGETS[0])
    T = trained.get("seq_len", 2048)
    window = policy.window
    pool = kvpop.budget_size(budget, T, sinks, window)[1]
    # the first n sequences train.py drew (its batch order at --seed), and n held-out files
    seqs = code_sequences(tok, "torch", T)
    first = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed * 100_003))[:n]
    sets = dict(train=seqs[first], held_out=code_held_out(tok, "torch", T, n))
    print(f"{scorer}: target {goal}, budget {budget:g} (window {window}, pool {pool}), {n} sequences each")
    print("| sequences | layer | KV head | keep/drop accuracy | AUC | pool overlap | teacher's pool recent |")
    print("|---|---|---|---|---|---|---|")
    for name, idx in sets.items():
        for row in measure(net, policy, idx, window, pool, goal):
            cells = f"{row['acc']:.3f} | {row['auc']:.3f} | {row['overlap']:.3f} | {row['recent']:.3f}"
            print(f"| {name} | {row['layer']} | {row['head']} | {cells} |")
