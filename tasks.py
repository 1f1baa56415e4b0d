"""The teacher-forced evaluation of eviction on the baby's tasks (support/baby_tasks.py) and on
text: `evaluate` (the online cache or the masked pass), the quality runs and table (train.py's
held-out checks, bench.py quality)."""

import torch

import kernels
import kvpop
from cache import KVCache, resolve

@torch.no_grad()
def evaluate(model, idx, policy, budget, sinks=4, window=256, online=True,
             target=kvpop.TARGETS[0]):
    """Teacher-forced logits (B, T, vocab) of idx (B, T) under a per-head budget: online=True,
    token by token through the evicting KVCache; online=False, one pass with the eviction-time mask
    (static and learned policies; a dynamic one is refused). The two agree. target: the oracle's,
    one of TARGETS."""
    B, T = idx.shape
    if isinstance(policy, kvpop.Scorer):
        policy.check(model.config, window)
    # a delayed scorer's state
    charge = kvpop.state_charge(policy, next(model.parameters()).dtype)
    # the cache's size S, and its pool
    size, pool = kvpop.budget_size(budget, T, sinks, window, charge)
    per_head = kvpop.Budget(sinks, window, pool)
    if isinstance(policy, str) and policy == "oracle":
        policy = kvpop.oracle_policy(model, idx, window, target)
    if online:
        slots = kvpop.entries(size, charge, T)
        cache = KVCache(model, B, slots, policy, sinks, window)
        steps = [model(idx[:, t : t + 1], cache=cache) for t in range(T)]
        return torch.cat(steps, dim=1)
    rule, priority = resolve(policy)
    if rule == "dynamic":
        rescored = f"policy {policy} re-scores tokens at every query"
        raise ValueError(f"{rescored}: no eviction-time mask, use online=True")
    if rule == "full" or size >= T:
        return model(idx)

    def attn(i, q, k, v, pos):
        # a learned scorer that reads a[t]: the attention each token received in its window
        reads = rule == "learned" and policy.received
        a = [kernels.window_received(q, k, window)] if reads else []
        pi = priority(i, k, v, pos, *a)
        return kvpop.masked_attention(q, k, v, pi, per_head)[0]

    return model(idx, attn=attn)


def policy_name(policy):  # a learned scorer is named by its kind
    if isinstance(policy, str):
        return policy
    return policy.kind + " on arrival" * policy.arrival


def quality_runs(net, idx, tgt, dist, policies, budgets, sinks, window, chunk=64, ref=None,
                 target=kvpop.TARGETS[0]):
    """Every (policy, budget) on the same sequences, teacher-forced through evaluate -> rows of
    accuracy on all queries, on far ones, relative to full, and mean KL(full || policy) from
    position S on. `full` is the dense pass of ref (a fine-tuned net's starting point), default net
    itself."""
    size = lambda budget: kvpop.budget_size(budget, idx.shape[1], sinks, window)[0]
    # queries out of reach of a window at every budget
    far = (dist >= max(map(size, budgets)) - sinks)[tgt >= 0]
    evicting = [policy for policy in policies if policy != "full"]
    runs = [("full", 1)] + [(policy, budget) for policy in evicting for budget in budgets]
    hit, kl = {run: [] for run in runs}, {run: [] for run in runs}
    rows = []
    log_probs = lambda logits: logits.float().log_softmax(-1)
    # full-vocabulary log-probs of a chunk, then every run on it
    for start in range(0, len(idx), chunk):
        part = idx[start : start + chunk]
        answered = tgt[start : start + chunk] >= 0
        dense = evaluate(ref or net, part, "full", 1, sinks, window, online=False)
        full = log_probs(dense)
        for policy, budget in runs:
            online = policy_name(policy) in kvpop.DYNAMIC
            args = (policy, budget, sinks, window, online, target)
            lp = full if policy == "full" else log_probs(evaluate(net, part, *args))
            right = lp.argmax(-1)[answered] == tgt[start : start + chunk][answered]
            hit[policy, budget].append(right)
            # (chunk * (T - S),)
            per_token = (full.exp() * (full - lp)).sum(-1)
            kl[policy, budget].append(per_token[:, size(budget) :].flatten())
    acc_full = torch.cat(hit["full", 1]).float().mean().item()
    for policy, budget in runs:
        hits = torch.cat(hit[policy, budget]).float()
        divergence = torch.cat(kl[policy, budget])
        acc = hits.mean().item()
        row = dict(policy=policy_name(policy), budget=budget, accuracy=round(acc, 4))
        row["far_accuracy"] = round(hits[far].mean().item(), 4)
        mean_kl = round(divergence.mean().item(), 4) if len(divergence) else 0.0
        rows.append(row | dict(relative=round(acc / acc_full, 4), kl=mean_kl))
    return rows, far.float().mean().item(), len(far)


# a markdown table of quality_runs' rows; task and target columns when they have them
def quality_table(rows):
    cols = [col for col in ("task", "target") if col in rows[0]]
    columns = cols + ["policy", "budget", "accuracy", "far accuracy", "relative", "KL"]
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for row in rows:
        cells = [row[col] for col in cols] + [row["policy"], f"{row['budget']:g}"]
        cells += [f"{row['accuracy']:.1%}", f"{row['far_accuracy']:.1%}"]
        cells += [f"{row['relative']:.3f}", f"{row['kl']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
