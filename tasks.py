"""The baby's tasks, the teacher-forced evaluation of eviction on them (quality tables, held-out checks) and the
scoring of what a model writes under eviction (sample.py's scoreboard, bench.py generate).

recall: multi-query associative recall in single-token Qwen3 words (README, The baby). cue: the same, plus distractor
bindings that only the next word marks as useless (README, The baby).
"""

import torch

import kvpop
from qwen3 import generate

# ----------------------------------------------------------------------------------------------------------
# the words. A binding is the bigram `key value`; a later `key value'` reassigns (the old value is useless from then
# on); a query is `key value` with the current value, predicted at the key. Fillers are never needed again. cue: a
# distractor `key' value' no` binds a key never queried in that sequence, and the marker `no` says so.

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
            raise ValueError(f"task word {w!r} is {len(t)} tokens for this tokenizer; the task needs one each")
    return {w: t[0] for w, t in ids.items()}, tok.special["<|endoftext|>"]


def task(rng, T, keys=8, p_mention=0.06, p_reassign=0.1, p_oldest=0.7, p_cue=0.0):
    """One sequence of T words (after bos) -> words, [(q, value, q - p)]: at position q (a key) the next word is
    `value`, last written at position p. Keys are bound first; later mentions go mostly to the key mentioned longest
    ago, which is what puts bindings far back. With p_cue > 0 (the cue task) that share of the words that would be
    fillers start a distractor `key' value' no` instead, key' one never queried here."""
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
    """n sequences of task(rng, T, p_cue, **kw) -> idx (n, T) token ids, tgt (n, T) answer ids (-1 elsewhere), dist
    (n, T) how far back the answer was last written (0 elsewhere). p_cue a pair (low, high): each sequence's rate
    is drawn uniformly from it, by rng, just before the sequence."""
    ids, bos = task_ids(tok)
    idx, tgt, dist = (torch.full((n, T), f, dtype=torch.long) for f in (bos, -1, 0))
    for b in range(n):
        # one rate, or this sequence's from the range
        rate = rng.uniform(*p_cue) if isinstance(p_cue, tuple) else p_cue
        words, ans = task(rng, T, p_cue=rate, **kw)
        idx[b, 1:] = torch.tensor([ids[w] for w in words[1:]])
        for q, v, d in ans:
            tgt[b, q], dist[b, q] = ids[v], d
    return idx, tgt, dist


def recall_answers(words, start):
    """The recall scoreboard of a sample: words (the prompt's, then the sample's from index start) -> {j + 1: (hit, d)}
    for each j >= start where the sample writes a bound key and a word after it: hit when that word is the key's
    current value; d how far back it was bound, j less the position of the value last written after the key.
    Bindings come from the prompt and from the sample itself: `key value` binds or reassigns; a distractor `key value
    no` (the cue task) neither binds nor counts."""
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


def retained(hits, counts, full_hits, full_counts, seed=0, draws=1000):
    """A policy's accuracy over full's on the same prompts (per prompt hits and answers, (N,) each, pooled) -> (the
    ratio, its 95% interval): the 2.5th and 97.5th percentiles of the ratio over `draws` resamples of the prompts with
    replacement, a resample drawing the same prompts for both (paired), seeded."""
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randint(len(hits), (draws, len(hits)), generator=gen)  # (draws, N)
    acc = lambda h, n: h[pick].sum(1) / n[pick].sum(1)  # (draws,)
    mine = acc(hits.double(), counts.double())
    ratio = mine / acc(full_hits.double(), full_counts.double())
    low, high = torch.nanquantile(ratio, ratio.new_tensor([0.025, 0.975])).tolist()
    point = hits.sum() / counts.sum() / (full_hits.sum() / full_counts.sum())
    return point.item(), low, high


# a sample's longest run of one word
def longest_run(words):
    runs = [1]
    for j in range(1, len(words)):
        runs.append(runs[-1] + 1 if words[j] == words[j - 1] else 1)
    return max(runs)


def scoreboard(words, start, far):
    """A sample's words (its prompt's first) on the scoreboard -> hits, answers, far hits, far answers (far: bound at
    least `far` tokens back), the longest run of one word and the distinct words it writes."""
    marks = recall_answers(words, start).values()
    hits = [hit for hit, _ in marks]
    far_hits = [hit for hit, d in marks if d >= far]
    text = words[start:]
    return sum(hits), len(hits), sum(far_hits), len(far_hits), longest_run(text), len(set(text))


@torch.no_grad()
def continue_prompts(model, prompt, policy, budget, sinks, window, tokens, temperature, seed):
    """Every prompt (N, P) continued for `tokens` tokens, the rows of one batch through an evicting cache, sampled as
    sample.py samples (seeded, at temperature, no top-k, no nucleus, no stop) -> (N, tokens) ids."""
    total = prompt.shape[1] + tokens
    charge = kvpop.state_charge(policy, next(model.parameters()).dtype)
    size = kvpop.budget_size(budget, total, sinks, window, charge)[0]
    slots = kvpop.entries(size, charge, total)
    cache = kvpop.KVCache(model, len(prompt), slots, policy, sinks, window)
    torch.manual_seed(seed)
    steps = generate(model, prompt, tokens, temperature, cache=cache)
    return torch.stack(list(steps), 1)  # (N, tokens)


def generate_runs(model, tok, prompt, runs, far, sinks, window, tokens, temperature, seed):
    """Each (policy, budget) of runs, full's first, continues the same prompts (N, P) (continue_prompts) -> rows
    (answers, accuracy, far accuracy, retained = accuracy / full's with its paired bootstrap interval, the longest run
    of one word, distinct words a sample), samples {(policy, budget): (prompt, ids)}."""
    rows, samples = [], {}
    word = {i: w for w, i in task_ids(tok)[0].items()}  # token id -> task word
    for p, b in runs:
        out = continue_prompts(model, prompt, p, b, sinks, window, tokens, temperature, seed)
        name = p if isinstance(p, str) else p.kind
        samples[name, b] = prompt, out
        # each prompt's scoreboard
        seqs = torch.cat([prompt, out], 1).tolist()
        board = [scoreboard([word.get(i) for i in x], prompt.shape[1], far) for x in seqs]
        board = torch.tensor(board, dtype=torch.float64)  # (N, 6)
        hits, n, far_hits, far_n, run, distinct = board.unbind(1)
        full = (hits, n) if p == "full" else full
        ratio, low, high = retained(hits, n, *full, seed)
        row = dict(policy=name, budget=b, answers=int(n.sum()), accuracy=hits.sum() / n.sum())
        row.update(far_answers=int(far_n.sum()), far_accuracy=far_hits.sum() / far_n.sum())
        row.update(retained=ratio, retained_low=low, retained_high=high)
        row.update(longest_run=int(run.max()), distinct=distinct.mean())
        # fractions to 4 decimals
        rounded = lambda v: round(float(v), 4) if isinstance(v, float | torch.Tensor) else v
        rows.append({k: rounded(v) for k, v in row.items()})
    return rows, samples


def generate_table(rows):  # a markdown table of bench.py generate's rows
    head = "task policy budget answers accuracy far_accuracy_(answers) retained_[95%] longest_run distinct"
    lines = ["| " + " | ".join(head.split()).replace("_", " ") + " |", "|---" * 9 + "|"]
    for r in rows:
        cells = [r["task"], r["policy"], f"{r['budget']:g}", r["answers"], f"{r['accuracy']:.1%}"]
        cells += [f"{r['far_accuracy']:.1%} ({r['far_answers']})"]
        cells += [f"{r['retained']:.3f} [{r['retained_low']:.3f}, {r['retained_high']:.3f}]"]
        cells += [r["longest_run"], f"{r['distinct']:.1f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


@torch.no_grad()
def evaluate(model, idx, policy, budget, sinks=4, window=256, online=True, target="mean"):
    """Teacher-forced logits (B, T, vocab) of idx (B, T) under a per-head budget: online=True, token by token through
    the evicting KVCache; online=False (static policies only), one pass with the eviction-time mask. The two agree.
    target: the oracle's, one of TARGETS."""
    B, T = idx.shape
    if isinstance(policy, kvpop.Scorer):
        policy.check(model.config, window)
    charge = kvpop.state_charge(policy, next(model.parameters()).dtype)  # a delayed scorer's state
    size, pool = kvpop.budget_size(budget, T, sinks, window, charge)  # the cache's size S, and its pool
    if isinstance(policy, str) and policy == "oracle":
        policy = kvpop.oracle_policy(model, idx, window, target)
    if online:
        cache = kvpop.KVCache(model, B, kvpop.entries(size, charge, T), policy, sinks, window)
        return torch.cat([model(idx[:, t : t + 1], cache=cache) for t in range(T)], dim=1)
    rule, priority = kvpop.resolve(policy)
    if rule == "dynamic":
        raise ValueError(
            f"policy {policy} re-scores tokens at every query: it has no eviction-time mask, use online=True"
        )
    if rule == "full" or size >= T:
        return model(idx)

    def attn(i, q, k, v, pos):
        return kvpop.masked_attention(q, k, v, priority(i, k, v, pos), sinks, window, pool)[0]

    return model(idx, attn=attn)


def quality_runs(net, idx, tgt, dist, policies, budgets, sinks, window, chunk=64, ref=None, target="mean"):
    """Every (policy, budget) on the same sequences, teacher-forced through evaluate -> rows of accuracy on all
    queries, on far ones, relative to full, and mean KL(full || policy) from position S on. `full` is the dense pass of
    ref (a fine-tuned net's starting point), default net itself."""
    size = lambda b: kvpop.budget_size(b, idx.shape[1], sinks, window)[0]
    # queries out of reach of a window at every budget
    far = (dist >= max(map(size, budgets)) - sinks)[tgt >= 0]
    # a learned scorer is named by its kind
    name = lambda p: p if isinstance(p, str) else p.kind + " on arrival" * p.arrival
    runs = [("full", 1)] + [(p, b) for p in policies if p != "full" for b in budgets]
    hit, kl, rows = {r: [] for r in runs}, {r: [] for r in runs}, []
    # full-vocabulary log-probs of a chunk, then every run on it
    for c in range(0, len(idx), chunk):
        x, m = idx[c : c + chunk], tgt[c : c + chunk] >= 0
        full = evaluate(ref or net, x, "full", 1, sinks, window, online=False).float().log_softmax(-1)
        for p, b in runs:
            online = name(p) in kvpop.DYNAMIC
            lp = full if p == "full" else evaluate(net, x, p, b, sinks, window, online, target).float().log_softmax(-1)
            hit[p, b].append(lp.argmax(-1)[m] == tgt[c : c + chunk][m])
            # (chunk * (T - S),)
            kl[p, b].append((full.exp() * (full - lp)).sum(-1)[:, size(b) :].flatten())
    acc_full = torch.cat(hit["full", 1]).float().mean().item()
    for p, b in runs:
        h, k = torch.cat(hit[p, b]).float(), torch.cat(kl[p, b])
        acc = h.mean().item()
        row = dict(policy=name(p), budget=b, accuracy=round(acc, 4), far_accuracy=round(h[far].mean().item(), 4))
        rows.append(row | dict(relative=round(acc / acc_full, 4), kl=round(k.mean().item(), 4) if len(k) else 0.0))
    return rows, far.float().mean().item(), len(far)


def quality_table(rows):  # a markdown table; with task and target columns when the rows have them
    cols = [c for c in ("task", "target") if c in rows[0]]
    head = cols + ["policy", "budget", "accuracy", "far accuracy", "relative", "KL"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        cells = [r[c] for c in cols] + [r["policy"], f"{r['budget']:g}"]
        cells += [f"{r['accuracy']:.1%}", f"{r['far_accuracy']:.1%}"]
        cells += [f"{r['relative']:.3f}", f"{r['kl']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
