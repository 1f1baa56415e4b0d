"""The baby's tasks, the teacher-forced evaluation of eviction on them (quality tables, held-out checks) and the
scoring of what a model writes under eviction (sample.py's scoreboard, bench.py generate); what bench.py quality and
generate run on (`baby_setup`).

recall: multi-query associative recall in single-token Qwen3 words (README, The baby). cue: the same, plus distractor
bindings that only the next word marks as useless (README, The baby). code: real text nobody here wrote, the installed
torch package's own source, and the metrics of eviction on it.
"""

import hashlib
import math
import os
import random

import torch

from support import checkpoint
from support import flags
import kvpop
import qwen3
from support import scorer_files, tokenizer
from cache import KVCache, resolve
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


def held_out_batch(tok, task, n, T, seed=0, p_cue=-1.0):
    """bench.py's n held-out sequences of a task (task_batch), from the stream test-<seed> that training never draws;
    p_cue >= 0 replaces the cue task's rate."""
    rate = dict(p_cue=p_cue) if task == "cue" and p_cue >= 0 else {}
    return task_batch(tok, n, T, random.Random(f"test-{seed}"), **TASKS[task] | rate)


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
    cache = KVCache(model, len(prompt), slots, policy, sinks, window)
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
        cache = KVCache(model, B, kvpop.entries(size, charge, T), policy, sinks, window)
        return torch.cat([model(idx[:, t : t + 1], cache=cache) for t in range(T)], dim=1)
    rule, priority = resolve(policy)
    if rule == "dynamic":
        raise ValueError(
            f"policy {policy} re-scores tokens at every query: it has no eviction-time mask, use online=True"
        )
    if rule == "full" or size >= T:
        return model(idx)

    def attn(i, q, k, v, pos):
        return kvpop.masked_attention(q, k, v, priority(i, k, v, pos), sinks, window, pool)[0]

    return model(idx, attn=attn)


def policy_name(p):  # a learned scorer is named by its kind
    return p if isinstance(p, str) else p.kind + " on arrival" * p.arrival


def quality_runs(net, idx, tgt, dist, policies, budgets, sinks, window, chunk=64, ref=None, target="mean"):
    """Every (policy, budget) on the same sequences, teacher-forced through evaluate -> rows of accuracy on all
    queries, on far ones, relative to full, and mean KL(full || policy) from position S on. `full` is the dense pass of
    ref (a fine-tuned net's starting point), default net itself."""
    size = lambda b: kvpop.budget_size(b, idx.shape[1], sinks, window)[0]
    # queries out of reach of a window at every budget
    far = (dist >= max(map(size, budgets)) - sinks)[tgt >= 0]
    runs = [("full", 1)] + [(p, b) for p in policies if p != "full" for b in budgets]
    hit, kl, rows = {r: [] for r in runs}, {r: [] for r in runs}, []
    # full-vocabulary log-probs of a chunk, then every run on it
    for c in range(0, len(idx), chunk):
        x, m = idx[c : c + chunk], tgt[c : c + chunk] >= 0
        full = evaluate(ref or net, x, "full", 1, sinks, window, online=False).float().log_softmax(-1)
        for p, b in runs:
            online = policy_name(p) in kvpop.DYNAMIC
            lp = full if p == "full" else evaluate(net, x, p, b, sinks, window, online, target).float().log_softmax(-1)
            hit[p, b].append(lp.argmax(-1)[m] == tgt[c : c + chunk][m])
            # (chunk * (T - S),)
            kl[p, b].append((full.exp() * (full - lp)).sum(-1)[:, size(b) :].flatten())
    acc_full = torch.cat(hit["full", 1]).float().mean().item()
    for p, b in runs:
        h, k = torch.cat(hit[p, b]).float(), torch.cat(kl[p, b])
        acc = h.mean().item()
        row = dict(policy=policy_name(p), budget=b, accuracy=round(acc, 4))
        row["far_accuracy"] = round(h[far].mean().item(), 4)
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


# ----------------------------------------------------------------------------------------------------------
# code: the .py/.txt files of a folder, read at run time (torch: the installed package's own source, never copied into
# the repository). A file is held out by the hash of its path under the folder: the split never moves.

HELD_OUT = 10  # one file in about this many is held out: sha256 of its relative path = 0 mod HELD_OUT


def corpus_root(corpus):  # torch: the installed package's folder; else the folder named
    return os.path.dirname(torch.__file__) if corpus == "torch" else corpus


def digest(path):  # a relative path's sha256, an integer
    return int(hashlib.sha256(path.encode()).hexdigest(), 16)


def held_out(path):  # a relative path -> whether its file is held out
    return digest(path) % HELD_OUT == 0


def code_files(corpus):
    """The corpus's .py/.txt files -> (training, held-out) paths relative to its folder, each list sorted."""
    root = corpus_root(corpus)
    paths = []
    for folder, _, names in os.walk(root):
        found = [os.path.join(folder, f) for f in names if f.endswith((".py", ".txt"))]
        paths += [os.path.relpath(f, root) for f in found]
    if not paths:
        where = "no folder" if not os.path.isdir(root) else "no .py/.txt files in"
        raise FileNotFoundError(f"corpus {corpus!r}: {where} {root}; give torch or a folder of .py/.txt files")
    paths.sort()
    return [p for p in paths if not held_out(p)], [p for p in paths if held_out(p)]


def code_tokens(tok, corpus, paths):  # each file's token ids, <|endoftext|> first: a list of lists
    root, bos = corpus_root(corpus), tok.special["<|endoftext|>"]
    ids = []
    for p in paths:
        with open(os.path.join(root, p), encoding="utf-8", errors="replace") as f:
            ids.append([bos] + tok.encode(f.read()))
    return ids


def code_sequences(tok, corpus, T):
    """The training files, in path order, packed into sequences -> (n, T); at least 2 of them, or ValueError."""
    train = code_files(corpus)[0]
    ids = [t for f in code_tokens(tok, corpus, train) for t in f]
    n = len(ids) // T
    if n < 2:
        what = f"{len(train)} training files hold {len(ids)} tokens"
        raise ValueError(f"corpus {corpus!r}: {what}; need at least 2 x {T}, add files or lower the length")
    return torch.tensor(ids[: n * T]).view(n, T)


def code_held_out(tok, corpus, T, n):
    """The first T tokens of each held-out file that has T, at most n files in the order of their paths' hashes (a
    fixed draw across folders) -> (files, T); at least 2 files (an interval needs two), or ValueError."""
    held = sorted(code_files(corpus)[1], key=digest)
    ids = [f[:T] for f in code_tokens(tok, corpus, held) if len(f) >= T][:n]
    if len(ids) < 2:
        what = f"{len(ids)} of its {len(held)} held-out files have {T} tokens"
        raise ValueError(f"corpus {corpus!r}: {what}; need 2, add files or lower the length")
    return torch.tensor(ids)


# ----------------------------------------------------------------------------------------------------------
# the metrics on code, per file (one sequence each), then a normal 95% interval over files


def last_seen(idx):
    """(B, T): how far back token idx[b, t] was last seen in its row (0: never before)."""
    dist = torch.zeros_like(idx)
    for b, row in enumerate(idx.tolist()):
        seen = {}
        for t, token in enumerate(row):
            dist[b, t] = t - seen.get(token, t)
            seen[token] = t
    return dist


def file_metrics(full, lp, idx, S):
    """Per-file means of log-probs lp (B, T, V) against full's, at the positions t >= S that predict a next token
    -> dict of (B,): KL(full || lp), top-1 agreement, log-perplexity over full's, far-copy accuracy (the next tokens
    full predicts right that were last seen >= S back: the share lp predicts right; nan in a file without one)."""
    nxt = idx[:, S + 1 :, None]  # (B, T - S - 1, 1): the tokens positions S.. predict
    full, lp = full[:, S:-1], lp[:, S:-1]
    guess = full.argmax(-1)  # (B, T - S - 1)
    kl = (full.exp() * (full - lp)).sum(-1).mean(-1)
    top1 = (lp.argmax(-1) == guess).float().mean(-1)
    nll = (full.gather(-1, nxt) - lp.gather(-1, nxt))[..., 0].mean(-1)
    # far copies full gets right
    far = (last_seen(idx)[:, S + 1 :] >= S) & (guess == nxt[..., 0])
    hit = ((lp.argmax(-1) == nxt[..., 0]) & far).sum(-1)
    return dict(kl=kl, top1=top1, log_ppl=nll, far_copy=hit / far.sum(-1))


def interval(x):
    """Mean and 95% half-width (normal: 1.96 standard errors) over the files of x (files,), nan files left out."""
    x = x[~x.isnan()].double()
    if len(x) < 2:
        return math.nan, math.nan
    return x.mean().item(), 1.96 * x.std().item() / math.sqrt(len(x))


def code_runs(net, idx, policies, budgets, sinks, window, chunk=16, target="mean"):
    """Every (policy, budget) on held-out files idx (files, T), teacher-forced through evaluate -> rows of each
    file_metrics' mean over files and 95% half-width (_ci), and the perplexity ratio exp(log_ppl) with its interval
    (ppl_lo, ppl_hi). `full` first, at budget 1, measured at the smallest budget's positions. -> (rows, the share of
    next tokens last seen >= S back at the largest budget, their count)."""
    size = lambda b: kvpop.budget_size(b, idx.shape[1], sinks, window)[0]
    runs = [("full", 1)] + [(p, b) for p in policies if p != "full" for b in budgets]
    per = {r: [] for r in runs}
    # a chunk of files: full's log-probs, then every run on it
    for c in range(0, len(idx), chunk):
        x = idx[c : c + chunk]
        full = evaluate(net, x, "full", 1, sinks, window, online=False).float().log_softmax(-1)
        for p, b in runs:
            online = policy_name(p) in kvpop.DYNAMIC
            lp = full if p == "full" else evaluate(net, x, p, b, sinks, window, online, target).float().log_softmax(-1)
            per[p, b].append(file_metrics(full, lp, x, size(min(budgets) if p == "full" else b)))
    rows, num = [], lambda x: None if math.isnan(x) else round(x, 5)  # nan (no file to average): None
    for (p, b), parts in per.items():
        row = dict(policy=policy_name(p), budget=b, files=len(idx))
        for key in parts[0]:
            mean, half = interval(torch.cat([m[key] for m in parts]))
            row[key], row[key + "_ci"] = num(mean), num(half)
        # the ratio of perplexities: exp of the mean log ratio, and of its interval's ends
        log_ppl, half = row.pop("log_ppl"), row.pop("log_ppl_ci")
        row["ppl_ratio"] = num(math.exp(log_ppl))
        row["ppl_lo"], row["ppl_hi"] = num(math.exp(log_ppl - half)), num(math.exp(log_ppl + half))
        rows.append(row)
    far = last_seen(idx)[:, 1:] >= size(max(budgets))
    return rows, far.float().mean().item(), far.numel()


def code_table(rows):  # a markdown table of code_runs' rows, each mean with its 95% half-width
    head = ["target", "policy", "budget", "KL", "top-1", "perplexity ratio", "far-copy"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        cells = [r.get("target", "-"), r["policy"], f"{r['budget']:g}"]
        cells += [f"{r['kl']:.4f} ± {r['kl_ci']:.4f}", f"{r['top1']:.1%} ± {r['top1_ci']:.1%}"]
        cells += [f"{r['ppl_ratio']:.3f} ({r['ppl_lo']:.3f}-{r['ppl_hi']:.3f})"]
        far = f"{r['far_copy']:.1%} ± {r['far_copy_ci']:.1%}" if r["far_copy_ci"] is not None else "-"
        cells.append(far)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# bench.py quality and generate: their flags checked, the model, its scorers and the held-out code files loaded


# the scorer folders --scorer names; shipped: those python train.py wrote for the model (baby, code), every kind
def scorer_folders(scorer, model, task, target):
    if scorer != "shipped":
        return [d for d in scorer.split(",") if d]
    folders = [f"{model}/scorers/{task}-{target}/{k}" for k in kvpop.SCORERS]
    return [d for d in folders if os.path.isfile(os.path.join(d, "scorer.json"))]


def baby_setup(a, need, policies, spare=0):
    """bench.py quality, generate: names and numbers checked (a budget of T - spare tokens), then the model -> net, tok,
    budgets, tasks, targets, folders {(task, target): [folder]}, scorers {folder: Scorer}, code's held-out files."""
    task_names, targets = a.task.split(","), a.target.split(",")
    # code: its own model (codebaby/) and length, so alone
    code = task_names == ["code"]
    need(code or "code" not in task_names, f"--task {a.task}: code runs alone (its own model, codebaby/)")
    a.model = a.model or ("codebaby" if code else "baby")
    a.window, a.T = a.window or 32, a.T or (1024 if code else 512)
    # every name known, or exit naming the first that is not
    for flag, what, names, known in [
        ("policies", "policy", policies, kvpop.POLICIES),
        ("task", "task", task_names, (*TASKS, "code")),
        ("target", "target", targets, kvpop.TARGETS),
    ]:
        bad = [x for x in names if x not in known]
        need(not bad, f"--{flag}: unknown {what} {(bad or [''])[0]!r}; choose from {','.join(known)}")
    for name, least in dict(T=64, sinks=0, window=1, threads=1).items():
        need(getattr(a, name) >= least, f"--{name} {getattr(a, name)}: use {least} or more")
    need(a.p_cue < 1, f"--p_cue {a.p_cue}: use a rate below 1 (-1: the cue task's own)")
    budgets = [flags.parse_value(a.prog, "budgets", b, float) for b in a.budgets.split(",")]
    try:
        folder = checkpoint.checkpoint_dir(a.model)
        config = qwen3.Qwen3Config.from_json(os.path.join(folder, "config.json"))
        folders = {(t, r): scorer_folders(a.scorer, a.model, t, r) for t in task_names for r in targets}
        scorers = {d: scorer_files.load(d) for ds in folders.values() for d in ds}
        # a scorer for another model or window, or a budget that leaves no room, raises
        for s in scorers.values():
            s.check(config, a.window)
        for s in [None, *scorers.values()]:
            for b in budgets:
                kvpop.budget_size(b, a.T - spare, a.sinks, a.window, kvpop.state_charge(s, torch.float32))
        most = config.max_position_embeddings  # checked before the weights load
        need(a.T <= most, f"--T {a.T}: the model has {most} positions; lower --T")
        tok = tokenizer.Tokenizer.from_pretrained(folder)
        files = code_held_out(tok, a.corpus, a.T, a.n) if code else None  # (files, T)
        torch.set_num_threads(a.threads)
        net = qwen3.Qwen3.from_pretrained(a.model, dtype=torch.float32)
    except (OSError, ValueError) as e:
        need(False, str(e))
    return net, tok, budgets, task_names, targets, folders, scorers, files
