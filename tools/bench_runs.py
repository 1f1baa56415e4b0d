"""What bench.py quality and generate run on: their flags checked, the model, its scorers and code's held-out files
loaded (`baby_setup`); and generate's runs, each policy continuing held-out prompts, scored by sample.py's scoreboard.
"""

import os

import torch

import kvpop
import qwen3
from cache import KVCache
from qwen3 import generate
import fast
from support import checkpoint, corpus, flags, tokenizer
from support.baby_tasks import TASKS, recall_answers, task_ids


def retained(hits, counts, full_hits, full_counts, seed=0, draws=1000):
    """A policy's accuracy over full's on the same prompts (per prompt hits and answers, (N,) each, pooled) -> (the
    ratio, its 95% interval): the 2.5th and 97.5th percentiles of the ratio over `draws` resamples of the prompts with
    replacement, a resample drawing the same prompts for both (paired), seeded."""
    gen = torch.Generator().manual_seed(seed)
    # (draws, N)
    pick = torch.randint(len(hits), (draws, len(hits)), generator=gen)
    # each resample's accuracy (draws,)
    acc = lambda h, n: h[pick].sum(1) / n[pick].sum(1)
    mine = acc(hits.double(), counts.double())
    ratio = mine / acc(full_hits.double(), full_counts.double())
    ends = ratio.new_tensor([0.025, 0.975])
    low, high = torch.nanquantile(ratio, ends).tolist()
    full = full_hits.sum() / full_counts.sum()
    point = hits.sum() / counts.sum() / full
    return point.item(), low, high


# a sample's longest run of one word
def longest_run(words):
    runs = [1]
    for j in range(1, len(words)):
        same = words[j] == words[j - 1]
        runs.append(runs[-1] + 1 if same else 1)
    return max(runs)


def scoreboard(words, start, far):
    """A sample's words (its prompt's first) on the scoreboard -> hits, answers, far hits, far answers (far: bound at
    least `far` tokens back), the longest run of one word and the distinct words it writes."""
    marks = recall_answers(words, start).values()
    hits = [hit for hit, _ in marks]
    far_hits = [hit for hit, d in marks if d >= far]
    text = words[start:]
    answers = (sum(hits), len(hits), sum(far_hits), len(far_hits))
    return *answers, longest_run(text), len(set(text))


@torch.no_grad()
def write(model, prompt, policy, budget, sinks, window, tokens, sampling, seed, stop=()):
    """Every prompt (N, P) continued for at most `tokens` tokens, the rows of one batch through an evicting cache
    whose budget is a share of P + tokens, sampled as sample.py samples: seeded, sampling = (temperature, top_k,
    top_p), each row until it writes a stop id -> (N, n) ids, n <= tokens (fewer when every row stopped). What
    bench.py generate writes with, both ways: --task's prompts in one batch, --data's one at a time."""
    total = prompt.shape[1] + tokens
    dtype = next(model.parameters()).dtype
    charge = kvpop.state_charge(policy, dtype)
    size = kvpop.budget_size(budget, total, sinks, window, charge)[0]
    slots = kvpop.entries(size, charge, total)
    cache = KVCache(model, len(prompt), slots, policy, sinks, window)
    torch.manual_seed(seed)
    steps = generate(model, prompt, tokens, *sampling, stop, cache=cache)
    # (N, n)
    return torch.stack(list(steps), 1)


# bench.py generate's runs (target, policy, budget): full, each other policy at each budget, then each scorer
# (learned: [(target, Scorer)]) at each budget
def policy_runs(policies, budgets, learned):
    heuristics = [p for p in policies if p != "full"]
    runs = [("-", "full", 1)]
    runs += [("-", p, b) for p in heuristics for b in budgets]
    return runs + [(r, s, b) for r, s in learned for b in budgets]


def generate_runs(model, tok, prompt, runs, far, sinks, window, tokens, temperature, seed):
    """Each (target, policy, budget) of runs (target "-": full and the heuristics), full's first, continues the same
    prompts (N, P) (write) -> rows (answers, accuracy, far accuracy, retained = accuracy / full's with its
    paired bootstrap interval, the longest run of one word, distinct words a sample), samples {(target, policy,
    budget): (prompt, ids)}: two scorers of one kind, trained for two targets, keep a row each."""
    rows, samples = [], {}
    # token id -> task word
    word = {i: w for w, i in task_ids(tok)[0].items()}
    words = lambda ids: [word.get(i) for i in ids]
    P = prompt.shape[1]
    sampling = (sinks, window, tokens, (temperature, 0, 1.0), seed)
    # fractions to 4 decimals
    fraction = lambda v: isinstance(v, float | torch.Tensor)
    rounded = lambda v: round(float(v), 4) if fraction(v) else v
    for target, p, b in runs:
        out = write(model, prompt, p, b, *sampling)
        name = p if isinstance(p, str) else p.kind
        samples[target, name, b] = prompt, out
        # each prompt's scoreboard
        seqs = torch.cat([prompt, out], 1).tolist()
        board = [scoreboard(words(x), P, far) for x in seqs]
        # (N, 6)
        board = torch.tensor(board, dtype=torch.float64)
        hits, n, far_hits, far_n, run, distinct = board.unbind(1)
        full = (hits, n) if p == "full" else full
        ratio, low, high = retained(hits, n, *full, seed)
        row = dict(target=target, policy=name, budget=b)
        row.update(answers=int(n.sum()), accuracy=hits.sum() / n.sum())
        far_accuracy = far_hits.sum() / far_n.sum()
        row.update(far_answers=int(far_n.sum()), far_accuracy=far_accuracy)
        row.update(retained=ratio, retained_low=low, retained_high=high)
        row.update(longest_run=int(run.max()), distinct=distinct.mean())
        rows.append({k: rounded(v) for k, v in row.items()})
    return rows, samples


# a markdown table of bench.py generate's rows
def generate_table(rows):
    columns = "task target policy budget answers accuracy far_accuracy_(answers)"
    columns += " retained_[95%] longest_run distinct"
    header = "| " + " | ".join(columns.split()).replace("_", " ") + " |"
    lines = [header, "|---" * 10 + "|"]
    for r in rows:
        cells = [r["task"], r["target"], r["policy"], f"{r['budget']:g}"]
        cells += [r["answers"], f"{r['accuracy']:.1%}"]
        cells += [f"{r['far_accuracy']:.1%} ({r['far_answers']})"]
        interval = f"[{r['retained_low']:.3f}, {r['retained_high']:.3f}]"
        cells += [f"{r['retained']:.3f} {interval}"]
        cells += [r["longest_run"], f"{r['distinct']:.1f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# bench.py quality and generate: their flags checked, the model, its scorers and the held-out code files loaded


# the scorer folders of a target: named by --scorer, each under the target it was trained for (scorer.json), or
# shipped: <model>/scorers/<task>-<target>/<kind> at this window (a delayed scorer runs at the window it was trained
# with), in the registry's order
def scorer_folders(scorer, model, task, target, window):
    if scorer != "shipped":
        named = [d for d in scorer.split(",") if d]
        return [d for d in named if trained_target(d) == target]
    shipped = f"{model}/scorers/{task}-{target}"
    folders = [f"{shipped}/{k}" for k in kvpop.SCORERS]
    saved = lambda d: os.path.join(d, "scorer.json")
    folders = [d for d in folders if os.path.isfile(saved(d))]
    delayed = lambda s: kvpop.SCORERS[s["kind"]].delayed
    fits = lambda s: s["window"] == window or not delayed(s)
    return [d for d in folders if fits(checkpoint.read_json(saved(d)))]


# the target a scorer folder was trained for (a folder that is none: load says so)
def trained_target(folder):
    path = os.path.join(folder, "scorer.json")
    saved = checkpoint.read_json(path) if os.path.isfile(path) else {}
    return saved.get("trained", {}).get("target", kvpop.TARGETS[0])


def check_names(opts, need, policies):
    """bench.py quality, generate: the names and numbers of their flags checked -> budgets, tasks, targets."""
    task_names = opts.task.split(",")
    targets = opts.target.split(",")
    # code: its own model (codebaby/) and length, so alone
    code = task_names == ["code"]
    why = "code runs alone (its own model, codebaby/)"
    need(code or "code" not in task_names, f"--task {opts.task}: {why}")
    # every name known, or exit naming the first that is not
    for flag, what, names, known in [
        ("policies", "policy", policies, kvpop.POLICIES),
        ("task", "task", task_names, (*TASKS, "code")),
        ("target", "target", targets, kvpop.TARGETS),
    ]:
        bad = [x for x in names if x not in known]
        unknown = f"unknown {what} {(bad or [''])[0]!r}"
        need(not bad, f"--{flag}: {unknown}; choose from {','.join(known)}")
    lowest = dict(T=64, sinks=0, window=1, threads=1)
    for name, least in lowest.items():
        value = getattr(opts, name)
        need(value >= least, f"--{name} {value}: use {least} or more")
    need(0 <= opts.p_cue < 1, f"--p_cue {opts.p_cue}: use a rate in [0, 1)")
    parse = lambda b: flags.parse_value(opts.prog, "budgets", b, float)
    budgets = [parse(b) for b in opts.budgets.split(",")]
    return budgets, task_names, targets


def find_scorers(opts, need, config, pairs, device="cpu"):
    """The scorer folders of each (task, target) of pairs, loaded on device (their fast forms unless --plain) and
    checked against the model's config and --window -> folders {(task, target): [folder]}, scorers {folder:
    Scorer}. Raises ValueError or OSError on a folder that is no scorer or does not fit."""
    find = lambda t, r: scorer_folders(opts.scorer, opts.model, t, r, opts.window)
    folders = {(t, r): find(t, r) for t, r in pairs}
    # a named scorer runs once, under its own target: that target must be asked for
    named = []
    if opts.scorer != "shipped":
        named = [d for d in opts.scorer.split(",") if d]
    targets = {r for _, r in pairs}
    for d in named:
        # a folder that is no scorer: its own line
        kvpop.load_scorer(d)
        trained = trained_target(d)
        why = f"was trained for target {trained}: add it to --target"
        need(trained in targets, f"--scorer {d} {why}")
    load = lambda d: kvpop.load_scorer(d).to(device)
    scorers = {d: load(d) for ds in folders.values() for d in ds}
    # their fast forms, unless --plain: kvpop.py's definitions
    if not opts.plain:
        scorers = {d: fast.speed_up(s) for d, s in scorers.items()}
    # a scorer for another model or window raises
    for s in scorers.values():
        s.check(config, opts.window)
    return folders, scorers


def baby_setup(opts, need, policies, spare=0):
    """bench.py quality, generate: names and numbers checked (a budget of T - spare tokens), then the model -> net, tok,
    budgets, tasks, targets, folders {(task, target): [folder]}, scorers {folder: Scorer}, code's held-out files."""
    code = opts.task == "code"
    opts.model = opts.model or ("codebaby" if code else "baby")
    if code and "window" not in opts.given:
        opts.window = corpus.CODE_WINDOW
    if code and "T" not in opts.given:
        opts.T = corpus.CODE_LENGTH
    budgets, task_names, targets = check_names(opts, need, policies)
    try:
        folder = checkpoint.checkpoint_dir(opts.model)
        config = qwen3.Qwen3Config.from_json(os.path.join(folder, "config.json"))
        pairs = [(t, r) for t in task_names for r in targets]
        folders, scorers = find_scorers(opts, need, config, pairs)
        # a budget that leaves no room raises
        length = opts.T - spare
        for s in [None, *scorers.values()]:
            charge = kvpop.state_charge(s, torch.float32)
            for b in budgets:
                kvpop.budget_size(b, length, opts.sinks, opts.window, charge)
        # code: a budget must leave a file's last positions to measure
        for b in budgets if code else ():
            kept = kvpop.budget_size(b, opts.T, opts.sinks, opts.window)[0]
            kept_all = f"keeps all {opts.T} tokens of a file"
            why = f"{kept_all}: nothing is evicted, use less"
            need(kept < opts.T - 1, f"--budgets {b:g} {why}")
        # checked before the weights load
        most = config.max_position_embeddings
        why = f"the model has {most} positions; lower --T"
        need(opts.T <= most, f"--T {opts.T}: {why}")
        tok = tokenizer.Tokenizer.from_pretrained(folder)
        # code: the held-out files (files, T)
        files = None
        if code:
            files = corpus.code_held_out(tok, opts.corpus, opts.T, opts.n)
        torch.set_num_threads(opts.threads)
        net = qwen3.Qwen3.from_pretrained(opts.model, dtype=torch.float32)
    except (OSError, ValueError) as e:
        need(False, str(e))
    return net, tok, budgets, task_names, targets, folders, scorers, files
