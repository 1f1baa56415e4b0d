"""bench.py generate --data: every policy answers the problems of a JSONL file through the evicting
cache (one problem at a time, bench_runs.write), each answer graded as it ends and appended to
--out; then the table of accuracy kept against full's. The baby's recall problems:

python -m tools.generate baby/recall.jsonl 32

Grading, --grade math: a reference answer that is a worked solution is what follows its last `####`,
else its last \\boxed{...}. A written answer (under --think: the text after </think>, none without
it) is its last \\boxed{...} (nested braces), else its last number, else its text. Two answers that
both read as numbers are compared as numbers: thousands commas, a sign, decimals, a fraction a/b or
\\frac{a}{b}, a leading `$` or `x =`, a trailing unit of letters or `%`. Others are compared as text
after normalising: lower case, no spaces, `$`, \\left, \\right, thin spaces or a final period,
\\text{...} and \\mathrm{...} read as their content, \\dfrac and \\tfrac as \\frac. Where
math-verify is installed, its verdict can also make them equal. --grade prefix: right when the text,
its leading spaces stripped, starts with the answer."""

import hashlib
import importlib.util
import json
import os
import re
import sys
import time
from fractions import Fraction

import torch
from tqdm import tqdm

import kvpop
import qwen3
from support import baby_tasks, checkpoint, flags, tokenizer
from tools import bench_runs
from tools.speed import token_bytes

# bench.py generate's flags of each way (one given to the other way: an error)
TASK_FLAGS = "prompts tokens T p_cue"
DATA_FLAGS = "question answer grade chat think samples max_new_tokens out"
DATA_FLAGS += " top_k top_p device dtype"
# a question's fields, the first a line has (--question: one)
QUESTION_FIELDS = ("question", "problem", "prompt")
GRADES = ("math", "prefix")

# ------------------------------------------------------------------ grading
# a number: thousands commas or digits, decimals, a fraction
INTEGER = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
NUMBER = rf"[-+]?(?:{INTEGER}(?:\.\d+)?|\.\d+)(?:/{INTEGER})?"


def last_boxed(text):
    """The content of the last \\boxed{...} in text, nested braces kept; None if it has none (or
    unclosed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, opening = 0, start + len("\\boxed")
    for j in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[opening + 1 : j]
    return None


# LaTeX read as plain text: \frac{a}{b} as a/b, \text{x} as x
def plain(s):
    s = s.replace("\u2212", "-").replace("\\%", "%")
    s = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"\1/\2", s)
    return re.sub(r"\\(?:text|mathrm)\{([^{}]*)\}", r"\1", s)


def to_number(s):
    """s as a number (Fraction), or None when it is not one: a sign, commas, decimals, a fraction, a
    leading `$` or `x =`, a trailing unit of letters or %."""
    s = plain(s).replace("$", "").replace("\\!", "").strip()
    s = re.sub(r"^[A-Za-z]\s*=\s*", "", s)
    m = re.fullmatch(rf"({NUMBER})\s*[A-Za-z%. ]*", s)
    if not m:
        return None
    whole, _, below = m.group(1).replace(",", "").partition("/")
    below = Fraction(below) if below else 1
    return Fraction(whole) / below if below else None


# text compared after normalising: lower case; no spaces, $, \left, \right,
# thin spaces, final period
def normal(s):
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\(?:text|mathrm)\{([^{}]*)\}", r"\1", s)
    for mark in ("\\left", "\\right", "\\!", "\\,", "\\;", "$"):
        s = s.replace(mark, "")
    return re.sub(r"\s+", "", s).rstrip(".").lower()


def verified(answer, reference):
    """math-verify's verdict where it is installed (an optional extra), else False."""
    if importlib.util.find_spec("math_verify") is None:
        return False
    from math_verify import parse, verify

    try:
        return bool(verify(parse(f"${reference}$"), parse(f"${answer}$")))
    except Exception:
        return False


def same(answer, reference):
    """--grade math: equal as numbers when both are, else as normalised text (or by math-verify)."""
    a, b = to_number(answer), to_number(reference)
    if a is not None and b is not None:
        return a == b
    return normal(answer) == normal(reference) or verified(answer, reference)


def reference(answer):
    """A reference answer: what follows a worked solution's last `####`, else its last \\boxed{},
    else itself."""
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip()
    boxed = last_boxed(answer)
    return (answer if boxed is None else boxed).strip()


def extract(text, grade, think, answer):
    """A written text's answer -> (extracted, right): under think, the text after </think> (none: no
    answer); math: its last \\boxed{}, else its last number, else the text; prefix: its start, as
    long as the answer."""
    if think:
        _, closed, text = text.rpartition("</think>")
        if not closed:
            return "", False
    if grade == "prefix":
        start = text.lstrip()[: len(answer)]
        return start, start == answer and answer != ""
    found = re.findall(NUMBER, plain(text))
    boxed = last_boxed(text)
    got = boxed if boxed is not None else found[-1] if found else text.strip()
    return got, got != "" and same(got, answer)


# ------------------------------------------------------------------ problems
def read_problems(path, question="", answer="answer"):
    """The JSONL file's problems -> [(question, reference answer)]; a line that is no JSON object
    with both fields, or a file with none, raises ValueError naming the line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read it ({getattr(e, 'strerror', None) or e})")
    fields = (question,) if question else QUESTION_FIELDS
    problems = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            raise ValueError(f"line {n} is not a JSON object")
        q = next((f for f in fields if f in row), None)
        missing = "/".join(fields) if q is None else answer
        how = "name yours with --question, --answer"
        if q is None or answer not in row:
            raise ValueError(f"line {n} has no {missing} field ({how})")
        problems.append((str(row[q]), reference(str(row[answer]))))
    if not problems:
        raise ValueError("holds no problems; give one JSON object a line")
    return problems


def recall_problems(tok, n, T, tokens, seed=0):
    """The baby's recall problems: bench.py generate --task recall's held-out sequences (n of T
    tokens, seed), each cut after its last query key before position T - tokens (inside --task's
    prompt), bos dropped -> [{"prompt": its words as text, "answer": the key's value}] (a sequence
    with no query there: none)."""
    idx = baby_tasks.held_out_batch(tok, "recall", n, T, seed)[0]
    word = {i: w for w, i in baby_tasks.task_ids(tok)[0].items()}
    problems = []
    for ids in idx.tolist():
        words = [word.get(i) for i in ids]
        # a query: the key's next word is its current value
        marks = baby_tasks.recall_answers(words, 1)
        queries = [j for j, (hit, _) in marks.items() if hit]
        queries = [j for j in queries if j < T - tokens]
        if queries:
            prompt = tok.decode(ids[1 : queries[-1]])
            answer = tok.decode([ids[queries[-1]]])
            problems.append(dict(prompt=prompt, answer=answer))
    return problems


# a problem's prompt ids: its question, in the chat template under --chat
def prompt_ids(tok, question, opts):
    return tok.encode(tok.chat(question, opts.think) if opts.chat else question)


# does the checkpoint folder hold a chat template (tokenizer_config.json's, or chat_template.jinja)?
def has_chat_template(folder):
    path = os.path.join(folder, "tokenizer_config.json")
    config = checkpoint.read_json(path) if os.path.isfile(path) else {}
    jinja = os.path.join(folder, "chat_template.jinja")
    return "chat_template" in config or os.path.isfile(jinja)


# an answer's seed: one for each (problem, sample), whatever the policy
def seed_of(seed, problem, sample):
    digest = hashlib.sha256(f"{seed}-{problem}-{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# ------------------------------------------------------------------ --out
def answered(path, run):
    """The answers --out holds {(problem, target, policy, budget, sample): record}, its first line
    the run's settings; a last line a kill cut off is dropped (the file rewritten without it). A
    file of another run's answers, or with a line that is no JSON, raises ValueError naming it."""
    if not path or not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    # a last line is whole when the file ends in a newline
    if lines[-1]:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write("\n".join(lines[:-1] + [""]))
        os.replace(path + ".tmp", path)
    records = []
    for n, line in enumerate(lines[:-1], 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"line {n} is not JSON; give another --out")
    if records and records[0] != {"run": run}:
        why = "holds the answers of another run (settings differ)"
        raise ValueError(f"{why}; give another --out")
    key = lambda r: (r["problem"], r["target"], r["policy"], r["budget"], r["sample"])
    return {key(r): r for r in records[1:]}


def answer_all(net, tok, problems, runs, opts, done):
    """Each problem (the bar), each run (target, policy, budget) and sample not done yet: its answer
    written through the run's cache, seeded by (problem, sample), graded, kept in done and appended
    to --out as it ends."""
    dev = next(net.parameters()).device
    sampling = (opts.temperature, opts.top_k, opts.top_p)
    out = open(opts.out, "a", encoding="utf-8") if opts.out else None
    if out and out.tell() == 0:
        out.write(json.dumps({"run": settings_of(opts)}) + "\n")
    for i, (question, answer) in enumerate(tqdm(problems, desc="problems", leave=False)):
        prompt = torch.tensor([prompt_ids(tok, question, opts)], device=dev)
        for target, p, b in runs:
            name = p if isinstance(p, str) else p.kind
            for s in range(opts.samples):
                if (i, target, name, b, s) in done:
                    continue
                seed = seed_of(opts.seed, i, s)
                cache = (opts.sinks, opts.window, opts.max_new_tokens)
                drawn = (*cache, sampling, seed, tok.stop)
                ids = bench_runs.write(net, prompt, p, b, *drawn)[0].tolist()
                said = [t for t in ids if t not in tok.stop]
                text = tok.decode(said)
                got, right = extract(text, opts.grade, opts.think, answer)
                limit = len(said) == opts.max_new_tokens
                r = dict(problem=i, target=target, policy=name, budget=b, sample=s)
                r.update(text=text, extracted=got, correct=right, tokens=len(said), limit=limit)
                done[i, target, name, b, s] = r
                if out:
                    out.write(json.dumps(r) + "\n")
                    out.flush()
    if out:
        out.close()


# what decides an answer's text, the problems' bytes too: --out's first line, a resumed run's the same
def settings_of(opts):
    keys = "model data question answer grade chat think temperature top_k top_p"
    keys += " max_new_tokens seed sinks window dtype plain"
    run = {k: getattr(opts, k) for k in keys.split()}
    with open(opts.data, "rb") as f:
        run["data_sha256"] = hashlib.sha256(f.read()).hexdigest()
    return run


# ------------------------------------------------------------------ the table
def table_rows(runs, done, problems, samples, kv, seed):
    """A row per run (target, policy, budget) over the problems (a count) and samples of each:
    accuracy (pass@1: each problem's share of right answers, averaged), retained = accuracy / full's
    with a paired bootstrap interval over problems, the answers' mean length in tokens, how many hit
    --max_new_tokens, the cache's MiB (kv {(policy, budget): MiB})."""
    rows = []
    for target, p, b in runs:
        name = p if isinstance(p, str) else p.kind
        mine = [[done[i, target, name, b, s] for s in range(samples)] for i in range(problems)]
        # (N,) right answers and answers a problem
        hits = torch.tensor([sum(r["correct"] for r in rs) for rs in mine], dtype=torch.float64)
        counts = torch.tensor([len(rs) for rs in mine], dtype=torch.float64)
        full = (hits, counts) if name == "full" else full
        ratio, low, high = bench_runs.retained(hits, counts, *full, seed)
        answers = [r for rs in mine for r in rs]
        row = dict(target=target, policy=name, budget=b, problems=problems)
        row.update(answers=len(answers), accuracy=float(hits.sum() / counts.sum()))
        row.update(retained=ratio, retained_low=low, retained_high=high)
        row.update(mean_tokens=sum(r["tokens"] for r in answers) / len(answers))
        row.update(at_limit=sum(r["limit"] for r in answers), kv_mib=kv[name, b])
        rows.append({k: rounded(v) for k, v in row.items()})
    return rows


# a float to 4 decimals; nan (retained, where full's accuracy is 0) as None
def rounded(v):
    if not isinstance(v, float):
        return v
    return None if v != v else round(v, 4)


# a markdown table of the rows
def data_table(rows):
    cols = "target,policy,budget,accuracy,retained [95%],mean tokens,at limit,KV MiB"
    lines = ["| " + cols.replace(",", " | ") + " |", "|---" * 8 + "|"]
    for r in rows:
        kept = "-"
        if r["retained"] is not None:
            ends = f"{r['retained_low']:.3f}, {r['retained_high']:.3f}"
            kept = f"{r['retained']:.3f} [{ends}]"
        cells = [r["target"], r["policy"], f"{r['budget']:g}", f"{r['accuracy']:.1%}"]
        cells += [kept, f"{r['mean_tokens']:.1f}"]
        cells += [f"{r['at_limit']}/{r['answers']}", f"{r['kv_mib']:.3g}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------ the run
def data_setup(opts, need, policies):
    """--data's flags checked, its problems read, the model and scorers loaded, every budget checked
    against every problem -> net, tok, problems, their prompts' lengths, runs [(target, policy,
    budget)], bytes a token."""
    qwen = opts.model not in ("", "baby", "codebaby")
    opts.model = opts.model or "baby"
    # a Qwen3: its advice for sampling (thinking or not), the paper's window
    preset = lambda k, v: setattr(opts, k, getattr(opts, k) if k in opts.given else v)
    preset("temperature", (0.6 if opts.think else 0.7) if qwen else opts.temperature)
    preset("top_k", 20 if qwen else opts.top_k)
    preset("top_p", (0.95 if opts.think else 0.8) if qwen else opts.top_p)
    preset("window", 256 if qwen else opts.window)
    grades = ", ".join(GRADES)
    need(opts.grade in GRADES, f"--grade {opts.grade!r}: choose from {grades}")
    for name in ("samples", "max_new_tokens"):
        value = getattr(opts, name)
        need(value >= 1, f"--{name} {value}: use 1 or more")
    need(opts.top_k >= 0, f"--top_k {opts.top_k}: use 0 (off) or more")
    need(0 < opts.top_p <= 1, f"--top_p {opts.top_p:g}: use 0 < top_p <= 1")
    need(opts.chat or not opts.think, "--think: add --chat (thinking is the chat template's)")
    flags.check_device(opts.device, opts.prog)
    flags.check_dtype(opts.dtype, ("float32", "bfloat16"), opts.prog)
    budgets, task_names, targets = bench_runs.check_names(opts, need, policies)
    try:
        problems = read_problems(opts.data, opts.question, opts.answer)
    except ValueError as e:
        need(False, f"--data {opts.data}: {e}")
    dt = getattr(torch, flags.auto_dtype(opts.dtype, opts.device) or "bfloat16")
    try:
        folder = checkpoint.checkpoint_dir(opts.model)
        no_template = "has no chat template (tokenizer_config.json); drop --chat"
        need(not opts.chat or has_chat_template(folder), f"--chat: {opts.model} {no_template}")
        config = qwen3.Qwen3Config.from_json(os.path.join(folder, "config.json"))
        pairs = [(t, r) for t in task_names for r in targets]
        found = bench_runs.find_scorers(opts, need, config, pairs, opts.device)
        folders, scorers = found
        tok = tokenizer.Tokenizer.from_pretrained(folder)
        lengths = [len(prompt_ids(tok, q, opts)) for q, _ in problems]
        check_lengths(opts, need, config, lengths, budgets, scorers.values(), dt)
        answers_before = answered(opts.out, settings_of(opts))
        torch.set_num_threads(opts.threads)
        net = qwen3.Qwen3.from_pretrained(folder, opts.device, dt, config)
    except (OSError, ValueError) as e:
        need(False, str(e))
    learned = [(r, scorers[d]) for t in task_names for r in targets for d in folders[t, r]]
    runs = bench_runs.policy_runs(policies, budgets, learned)
    return net, tok, problems, lengths, runs, token_bytes(config, dt), answers_before


def check_lengths(opts, need, config, lengths, budgets, scorers, dt):
    """Every prompt with --max_new_tokens within the model's positions, every budget leaving a pool
    on each."""
    most = config.max_position_embeddings
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    total = lengths[longest] + opts.max_new_tokens
    why = f"the model has {most} positions; lower --max_new_tokens"
    need(total <= most, f"--data problem {longest + 1}: {total} tokens with its answer; {why}")
    shortest = min(lengths) + opts.max_new_tokens
    for s in [None, *scorers]:
        charge = kvpop.state_charge(s, dt)
        for b in budgets:
            try:
                kvpop.budget_size(b, shortest, opts.sinks, opts.window, charge)
            except ValueError as e:
                need(False, f"--budgets {b:g} on the shortest problem ({shortest} tokens): {e}")


def run(opts, need, policies):
    """bench.py generate --data: every run answers every problem (answer_all), then the table -> its
    rows."""
    t0 = time.time()
    setup = data_setup(opts, need, policies)
    net, tok, problems, lengths, runs, per_token, done = setup
    resumed = len(done)
    answer_all(net, tok, problems, runs, opts, done)
    # the cache's MiB at each budget: its S entries (the budget's share of prompt + max_new_tokens,
    # a scorer's state inside) of a token's keys and values in every layer, the mean over problems
    totals = [P + opts.max_new_tokens for P in lengths]
    kv, dt = {}, next(net.parameters()).dtype
    for _, p, b in runs:
        charge = kvpop.state_charge(p, dt)
        kept = lambda T: kvpop.budget_size(b, T, opts.sinks, opts.window, charge)[0]
        size = lambda T: T if p == "full" else kept(T)
        name = p if isinstance(p, str) else p.kind
        kv[name, b] = sum(size(T) for T in totals) * per_token / len(totals) / 2**20
    rows = table_rows(runs, done, len(problems), opts.samples, kv, opts.seed)
    sampling = f"temperature {opts.temperature:g}, top-k {opts.top_k}, top-p {opts.top_p:g}"
    what = f"{len(problems)} problems of {opts.data}, {opts.samples} answer(s) each"
    most = f"of at most {opts.max_new_tokens} tokens"
    print(f"{opts.model}: {what} {most}, {sampling}; grade {opts.grade}", end="")
    print(f"; sinks {opts.sinks}, window {opts.window}\n")
    print(data_table(rows))
    written = len(done) - resumed
    print(f"\n{time.time() - t0:.0f}s, {written} answers written, {resumed} read from --out")
    if opts.json:
        checkpoint.write_json(rows, opts.json)
    return rows


# python -m tools.generate FILE [N]: the baby's recall problems of N held-out sequences (256)
# written to FILE, of bench.py generate --task recall's default length (T 512, 112 written)
if __name__ == "__main__":
    path, n = sys.argv[1], int((sys.argv[2:] or [256])[0])
    tok = tokenizer.Tokenizer.from_pretrained("baby")
    lines = [json.dumps(p) + "\n" for p in recall_problems(tok, n, 512, 112)]
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(lines)
    os.replace(path + ".tmp", path)
    print(f"{path}: {len(lines)} recall problems")
