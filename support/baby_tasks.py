"""The baby's tasks (README, The baby and its tasks): the words, the task's sequences and the recall
scoreboard sample.py marks a sample by. recall: multi-query associative recall in single-token Qwen3
words. cue: the same, plus distractor bindings that only the next word marks as useless.
"""

import random

import torch

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
