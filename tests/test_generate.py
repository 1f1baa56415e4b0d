"""bench.py generate --data (tools/generate.py): the grading rule on a table of cases; the baby
answering its own recall problems, graded by prefix, against the recall scoreboard's verdict on the
same answers, through the one writer --task uses; a random Qwen3 with the real vocabulary and chat
template, thinking, killed and resumed to the same table; bad input in one line, nothing written."""

import functools
import json
import os
import shutil

import pytest
import torch

import bench
from support import baby_tasks, tokenizer
from support.tokenizer import Tokenizer
from tools import bench_runs, generate

from tests.common import HERE, HF_DIR, MODEL_DIR, _ref_marks, exits, hf_checkpoint, one_line_error

# (written text, reference answer as the file gives it, the answer extracted, right?) under --grade math
CASES = [
    ("so the answer is \\boxed{42}.", "42", "42", True),  # boxed
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{3}}{2}", True),  # nested braces
    ("\\boxed{\\frac{1}{2}}", "0.5", "\\frac{1}{2}", True),  # a fraction against a decimal
    ("first \\boxed{3}, then \\boxed{5}", "5", "5", True),  # several: the last
    ("first \\boxed{5}, then \\boxed{3}", "5", "3", False),
    ("no number here", "7", "no number here", False),  # none
    ("We get 3 apples, then 12 more: 15", "15", "15", True),  # no box: the last number
    ("x = -3/4", "-0.75", "-3/4", True),  # negative fraction
    ("\\boxed{-\\frac{3}{4}}", "-3/4", "-\\frac{3}{4}", True),
    ("\\boxed{-5}", "5", "-5", False),  # the sign counts
    ("It costs 1,234,567 dollars", "1234567", "1,234,567", True),  # thousands separators, a unit
    ("The total is $18.", "Natalia sold 48/2 = 24 clips.\n#### 18", "18", True),  # GSM8K's #### answer
    ("\\boxed{10\\%}", "10", "10\\%", True),  # a trailing unit
    ("\\boxed{x = 5}", "5", "x = 5", True),  # a leading `x =`
    ("\\boxed{1,2}", "12", "1,2", False),  # a comma that is no thousands separator: text
    ("\\boxed{\\text{(B)}}", "(b)", "\\text{(B)}", True),  # text, normalised
    ("\\boxed{\\left(1, 2\\right)}", "(1,2)", "\\left(1, 2\\right)", True),
    ("a worked \\boxed{7}", "so \\boxed{\\dfrac{14}{2}}", "7", True),  # a boxed reference
]


@pytest.mark.parametrize("text,answer,extracted,right", CASES)
def test_grading_cases(text, answer, extracted, right):
    assert generate.extract(text, "math", False, generate.reference(answer)) == (extracted, right)


def test_grading_thinking_and_prefix():
    """Under --think the answer is what follows </think> (a number inside the thinking does not
    count; no </think>: no answer); --grade prefix: the text's start, leading spaces stripped; an empty
    reference answer is never matched."""
    assert generate.extract("<think>maybe 4</think>\\boxed{5}", "math", True, "5") == ("5", True)
    assert generate.extract("<think>so 5 ... still thinking", "math", True, "5") == ("", False)
    assert generate.extract(" apple key name", "prefix", False, "apple") == ("apple", True)
    assert generate.extract(" pear apple", "prefix", False, "apple") == ("pear ", False)
    # an empty answer is never right: no text starts with it, no empty text equals it
    assert generate.extract(" pear", "prefix", False, "") == ("", False)
    assert generate.extract("  ", "math", False, "") == ("", False)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_baby_recall_problems_graded_by_prefix_agree_with_the_scoreboard(tmp_path, monkeypatch, capsys):
    """The baby's recall problems (tools/generate.recall_problems: --task recall's held-out
    sequences, each cut after its last query key) answered by --data, --grade prefix: each answer is
    right exactly when the recall scoreboard (_ref_marks, from its definition) marks the word after
    the prompt's last key a hit, under full, streaming and the delayed scorer; both ways of bench.py
    generate write through bench_runs.write."""
    tok = Tokenizer.from_pretrained(MODEL_DIR)
    problems = generate.recall_problems(tok, 8, 256, 48)
    data = _jsonl(tmp_path / "recall.jsonl", problems)
    calls = []
    real = bench_runs.write
    monkeypatch.setattr(bench_runs, "write", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    out = tmp_path / "answers.jsonl"
    args = f"--data {data} --grade prefix --max_new_tokens 1 --policies full,streaming --budgets 40 --out {out}"
    scorer = os.path.join(HERE, "baby", "scorers", "recall-helpful", "kvpop-window")
    rows = bench.cmd_generate(args.split() + ["--scorer", scorer])
    assert [(r["policy"], r["budget"]) for r in rows] == [("full", 1), ("streaming", 40), ("kvpop-window", 40)]
    # one problem at a time, prompts of different lengths
    assert len(calls) == 3 * len(problems) and len({s[1] for s in calls}) > 1
    words = {i: w for w, i in baby_tasks.task_ids(tok)[0].items()}
    records = [json.loads(x) for x in out.read_text().splitlines()[1:]]
    for r in records:
        said = [words.get(i) for i in tok.encode(problems[r["problem"]]["prompt"] + r["text"])]
        P = len(tok.encode(problems[r["problem"]]["prompt"]))
        # the scoreboard's answer at the first word written: the prompt's last key's value
        (j, value), *_ = _ref_marks(said, P - 1)
        assert j == P and r["correct"] == (said[P] == value), r
    assert {r["correct"] for r in records} == {True, False}
    for row in rows:
        mine = [r["correct"] for r in records if r["policy"] == row["policy"]]
        assert row["accuracy"] == pytest.approx(sum(mine) / len(mine), abs=1e-4)
    # the --task way writes through the same function, its prompts in one batch
    calls.clear()
    task = "--task recall --T 256 --tokens 8 --prompts 4 --budgets 40 --policies full --scorer".split()
    bench.cmd_generate(task + [""])
    assert calls == [torch.Size([4, 247])]


@pytest.fixture(scope="module")
def chat_qwen(tmp_path_factory):
    """A random Qwen3 with the real 151,936-token vocabulary, its tokenizer.json and
    tokenizer_config.json (with the chat template) the real ones."""
    folder = tmp_path_factory.mktemp("qwen")
    hf_checkpoint(folder, layers=2, vocab=151936)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(HF_DIR, name), folder / name)
    return str(folder)


def _table(stdout):  # the markdown table a run printed
    return "\n".join(line for line in stdout.splitlines() if line.startswith("|"))


def test_random_qwen3_thinks_and_a_killed_run_resumes_to_the_same_table(chat_qwen, tmp_path, monkeypatch, capsys):
    """--chat --think on a GSM8K- and an AIME-shaped line, two evicting policies at two budgets, 2
    samples: every answer lands in --out with its fields (no answer closes its thinking: accuracy 0,
    retained '-'); cut --out after 7 answers and mid-line (a kill), the run started again writes
    only the rest and prints the same table, its --out the same answers."""
    rows = [
        dict(question="Natalia sold 48 clips in April and half as many in May. How many in all?", answer="#### 72"),
        dict(problem="Find x if 2x = 10.", answer="5"),
    ]
    data = _jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "answers.jsonl"
    args = f"--model {chat_qwen} --data {data} --chat --think --policies full,streaming,h2o --budgets 24,16"
    args += f" --sinks 2 --window 4 --max_new_tokens 4 --samples 2 --scorer '' --out {out}"
    argv = [a.strip("'") for a in args.split()]
    # the real vocabulary read once (seconds), for both runs
    monkeypatch.setattr(tokenizer.Tokenizer, "from_pretrained", functools.lru_cache(Tokenizer.from_pretrained))
    first = bench.cmd_generate(argv)
    table = _table(capsys.readouterr().out)
    lines = out.read_text().splitlines()
    records = [json.loads(x) for x in lines[1:]]
    assert len(records) == 2 * 5 * 2 and json.loads(lines[0])["run"]["think"] is True
    fields = {"problem", "target", "policy", "budget", "sample", "text", "extracted", "correct", "tokens", "limit"}
    assert all(set(r) == fields and r["tokens"] <= 4 for r in records)
    assert [(r["policy"], r["budget"]) for r in first][1:] == [(p, b) for p in ("streaming", "h2o") for b in (24, 16)]
    assert "| - | h2o | 16 |" in table and table.count("\n") == 6
    # killed after 7 answers, the 8th half-written
    out.write_text("\n".join(lines[:8]) + "\n" + lines[8][:20])
    again = bench.cmd_generate(argv)
    printed = capsys.readouterr().out
    assert _table(printed) == table and again == first
    assert "13 answers written, 7 read from --out" in printed
    assert out.read_text().splitlines() == lines


@pytest.mark.parametrize(
    "lines,extra,words",
    [
        (['{"question": "a", "answer": "1"}', '{"question": "b"}'], [], ["--data", "line 2 has no answer field"]),
        (['{"query": "a", "answer": "1"}'], [], ["line 1 has no question/problem/prompt field"]),
        (['{"q": "a", "a": "1"}'], ["--question", "q", "--answer", "x"], ["line 1 has no x field"]),
        (["not json"], [], ["line 1 is not a JSON object"]),
        ([], [], ["holds no problems"]),
        (['{"prompt": "a", "answer": "1"}'], ["--budgets", "0.01"], ["--budgets 0.01", "leaves no room"]),
        (['{"prompt": "a", "answer": "1"}'], ["--grade", "bogus"], ["--grade 'bogus'", "math, prefix"]),
        (['{"prompt": "a", "answer": "1"}'], ["--chat"], ["--chat: baby has no chat template"]),
        (['{"prompt": "a", "answer": "1"}'], ["--think"], ["--think", "--chat"]),
        (['{"prompt": "a", "answer": "1"}'], ["--tokens", "8"], ["--tokens: applies without --data"]),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(lines, extra, words, tmp_path, monkeypatch):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(x + "\n" for x in lines))
    out, rows = tmp_path / "out.jsonl", tmp_path / "rows.json"
    args = ["--data", str(data), "--out", str(out), "--json", str(rows), *extra]
    one_line_error(exits(monkeypatch, "bench.py generate", *args), *words)
    assert not out.exists() and not rows.exists()


def test_out_of_another_run_is_refused(tmp_path, monkeypatch):
    """--out holding another run's answers (other settings): one line, the file untouched; --chat
    without --data."""
    data = _jsonl(tmp_path / "p.jsonl", [dict(prompt="a", answer="1")])
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"run": {"model": "other"}}) + "\n")
    message = exits(monkeypatch, "bench.py generate", "--data", data, "--out", str(out))
    one_line_error(message, "holds the answers of another run")
    assert out.read_text() == json.dumps({"run": {"model": "other"}}) + "\n"
    # the same settings, other problems in the file
    opts = bench.settings("generate", ["--data", data])[0]
    opts.model = "baby"
    out.write_text(json.dumps({"run": generate.settings_of(opts)}) + "\n")
    _jsonl(tmp_path / "p.jsonl", [dict(prompt="b", answer="2")])
    message = exits(monkeypatch, "bench.py generate", "--data", data, "--out", str(out))
    one_line_error(message, "holds the answers of another run")
    one_line_error(exits(monkeypatch, "bench.py generate", "--chat"), "--chat: applies to --data")


def test_each_problem_and_sample_has_its_own_seed():
    """An answer's seed (generate.seed_of) is one for each (seed, problem, sample): --samples draws differ, a
    problem's draws differ from another's, and the seed is a non-negative signed 64-bit integer."""
    seeds = [generate.seed_of(seed, p, s) for seed in (0, 1) for p in range(3) for s in range(3)]
    assert len(set(seeds)) == len(seeds) and all(0 <= x < 2**63 for x in seeds)
    assert generate.seed_of(0, 1, 2) == generate.seed_of(0, 1, 2)


def test_read_problems_skips_blank_lines_and_check_lengths_reads_the_shortest(tmp_path):
    """--data: a blank line between problems is skipped (not the end of the file); each budget must leave a pool on
    the shortest problem with its answer (a budget is a share of it), not the longest alone."""
    import types

    rows = [dict(question="a", answer="1"), dict(prompt="b", answer="#### 2")]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    assert generate.read_problems(str(path)) == [("a", "1"), ("b", "2")]

    def need(ok, message):
        if not ok:
            raise ValueError(message)

    opts = types.SimpleNamespace(max_new_tokens=4, sinks=4, window=8)
    config = types.SimpleNamespace(max_position_embeddings=1024)
    generate.check_lengths(opts, need, config, [400, 300], [0.25], [], torch.float32)
    with pytest.raises(ValueError, match=r"--budgets 0.25 on the shortest problem \(20 tokens\)"):
        generate.check_lengths(opts, need, config, [400, 16], [0.25], [], torch.float32)
