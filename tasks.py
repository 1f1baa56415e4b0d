"""The baby's tasks (README, The baby) and the teacher-forced evaluation of eviction on them: the
words, the task's sequences, the recall scoreboard sample.py marks a sample by, `evaluate` (the
online cache or the masked pass), the quality runs and table (train.py's held-out checks, bench.py
quality).

recall: multi-query associative recall in single-token Qwen3 words. cue: the same, plus distractor
bindings that only the next word marks as useless.

"""

import random

import torch

import kernels
import kvpop
from cache import KVCache, resolve

# --------------------------------------------------------------------------------------------------
# the words. A binding is the bigram `key value`; a later `key value'` reassigns (the old value is
# useless from then on); a query is `key value` with the current value, predicted at the key.
# Fillers are never needed again. cue: a distractor `key' value' no` binds a key never queried in
# that sequence, and the marker `no` says so.

KEYS = "name time data value type file user key size state model color group table game car".split()
VALUES = (
    "new true false null good best free real high long last first open main right same next top class "
    "public return void static string array number object event error text line point item list case "
    "world people child year day man work hand play view style method post path system message index "
    "order head action report build check count start find show help read"
).split()
FILLERS = (
    "the of and to in is for on with that it as at by or be we you are was not but from have he his "
    "they their has been were would"
).split()
MARK = "no"  # cue: the word after a distractor binding
# task name -> task()'s settings (cue: ~1 distractor in 9 words)
TASKS = {"recall": {}, "cue": dict(p_cue=0.17)}
# Qwen3 ranks a cut vocabulary must keep so that every word above is one token (" order": 1973)
TASK_RANKS = 1974


def task_ids(tok):  # word -> token id of every task word (each must be one token), and the bos id
    ids = {w: tok.encode(" " + w) for w in KEYS + VALUES + FILLERS + [MARK]}
    for w, t in ids.items():
        if len(t) != 1:
            count = f"task word {w!r} is {len(t)} tokens for this tokenizer"
            raise ValueError(f"{count}; the task needs one each")
    return {w: t[0] for w, t in ids.items()}, tok.special["<|endoftext|>"]


def task(rng, T, keys=8, p_mention=0.06, p_reassign=0.1, p_oldest=0.7, p_cue=0.0):
    """One sequence of T words (after bos) -> words, [(q, value, q - p)]: at position q (a key) the
    next word is `value`, last written at position p. Keys are bound first; later mentions go mostly
    to the key mentioned longest ago, which is what puts bindings far back. With p_cue > 0 (the cue
    task) that share of the words that would be fillers start a distractor `key' value' no` instead,
    key' one never queried here."""
    K = rng.sample(KEYS, min(keys, len(KEYS), max(2, T // 32)))
    spare = [k for k in KEYS if k not in K]  # the distractors' keys
    words, val, last, ans = ["<|endoftext|>"], {}, {}, []
    while len(words) < T:
        if len(words) == T - 1 or rng.random() >= (0.3 if len(val) < len(K) else p_mention):
            if p_cue and len(words) <= T - 3 and rng.random() < p_cue:
                words += [rng.choice(spare), rng.choice(VALUES), MARK]
            else:
                words.append(rng.choice(FILLERS))
            continue
        q = len(words)
        if len(val) < len(K):  # bind the next unbound key
            k = K[len(val)]
            val[k] = rng.choice(VALUES)
        else:
            k = min(K, key=last.get) if rng.random() < p_oldest else rng.choice(K)
            if rng.random() < p_reassign:
                val[k] = rng.choice([v for v in VALUES if v != val[k]])
            else:
                ans.append((q, val[k], q - last[k]))
        words += [k, val[k]]
        last[k] = q + 1
    return words, ans


def task_batch(tok, n, T, rng, p_cue=0.0, **kw):
    """n sequences of task(rng, T, p_cue, **kw) -> idx (n, T) token ids, tgt (n, T) answer ids (-1
    elsewhere), dist (n, T) how far back the answer was last written (0 elsewhere). p_cue a pair
    (low, high): each sequence's rate is drawn uniformly from it, by rng, just before the
    sequence."""
    ids, bos = task_ids(tok)
    idx, tgt, dist = (torch.full((n, T), f, dtype=torch.long) for f in (bos, -1, 0))
    for row in range(n):
        # one rate, or this sequence's from the range
        rate = rng.uniform(*p_cue) if isinstance(p_cue, tuple) else p_cue
        words, ans = task(rng, T, p_cue=rate, **kw)
        idx[row, 1:] = torch.tensor([ids[w] for w in words[1:]])
        for q, v, d in ans:
            tgt[row, q], dist[row, q] = ids[v], d
    return idx, tgt, dist


def held_out_batch(tok, task, n, T, seed=0, p_cue=TASKS["cue"]["p_cue"]):
    """bench.py's n held-out sequences of a task (task_batch), from the stream test-<seed> that
    training never draws; the cue task's at distractor rate p_cue."""
    rate = dict(p_cue=p_cue) if task == "cue" else {}
    return task_batch(tok, n, T, random.Random(f"test-{seed}"), **TASKS[task] | rate)


def recall_answers(words, start):
    """The recall scoreboard of a sample: words (the prompt's, then the sample's from index start)
    -> {j + 1: (hit, d)} for each j >= start where the sample writes a bound key and a word after
    it: hit when that word is the key's current value; d how far back it was bound, j less the
    position of the value last written after the key. Bindings come from the prompt and from the
    sample itself: `key value` binds or reassigns; a distractor `key value no` (the cue task)
    neither binds nor counts."""
    val, at, marks = {}, {}, {}
    for j in range(len(words) - 1):
        a, b = words[j], words[j + 1]
        if j + 2 < len(words) and words[j + 2] == MARK:
            continue
        if j >= start and a in val:
            marks[j + 1] = (b == val[a], j - at[a])
        if a in KEYS and b in VALUES:
            val[a], at[a] = b, j + 1
    return marks


def recall_marks(words, start):  # {j + 1: hit} of recall_answers
    return {j: hit for j, (hit, _) in recall_answers(words, start).items()}


def recall_score(words, start):  # (R, N): the hits and the count of recall_marks
    marks = recall_marks(words, start)
    return sum(marks.values()), len(marks)


@torch.no_grad()
def evaluate(model, idx, policy, budget, sinks=4, window=256, online=True, target=kvpop.TARGETS[0]):
    """Teacher-forced logits (B, T, vocab) of idx (B, T) under a per-head budget: online=True, token
    by token through the evicting KVCache; online=False (static policies only), one pass with the
    eviction-time mask. The two agree. target: the oracle's, one of TARGETS."""
    B, T = idx.shape
    if isinstance(policy, kvpop.Scorer):
        policy.check(model.config, window)
    charge = kvpop.state_charge(policy, next(model.parameters()).dtype)  # a delayed scorer's state
    # the cache's size S, and its pool
    size, pool = kvpop.budget_size(budget, T, sinks, window, charge)
    per_head = kvpop.Budget(sinks, window, pool)
    if isinstance(policy, str) and policy == "oracle":
        policy = kvpop.oracle_policy(model, idx, window, target)
    if online:
        cache = KVCache(model, B, kvpop.entries(size, charge, T), policy, sinks, window)
        return torch.cat([model(idx[:, t : t + 1], cache=cache) for t in range(T)], dim=1)
    rule, priority = resolve(policy)
    if rule == "dynamic":
        raise ValueError(
            f"policy {policy} re-scores tokens at every query: no eviction-time mask, use online=True"
        )
    if rule == "full" or size >= T:
        return model(idx)

    def attn(i, q, k, v, pos):
        # a learned scorer that reads a[t]: the attention each token received in its window
        a = [kernels.window_received(q, k, window)] if rule == "learned" and policy.received else []
        return kvpop.masked_attention(q, k, v, priority(i, k, v, pos, *a), per_head)[0]

    return model(idx, attn=attn)


def policy_name(policy):  # a learned scorer is named by its kind
    return policy if isinstance(policy, str) else policy.kind + " on arrival" * policy.arrival


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
        part, answered = idx[start : start + chunk], tgt[start : start + chunk] >= 0
        full = log_probs(evaluate(ref or net, part, "full", 1, sinks, window, online=False))
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
        hits, divergence = torch.cat(hit[policy, budget]).float(), torch.cat(kl[policy, budget])
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
