"""Every command the README shows runs (smaller where it must) and prints what the definitions give; the README's
"Add a scorer" code works."""

import ast
import json
import os
import random
import re
import shutil
import subprocess
import sys

import pytest
import torch

import kvpop
import tasks
from support import baby_tasks

from tests.common import (
    CORPUS, HERE, HF_DIR, baby, _check_quality_table, hf_checkpoint, _parse_quality_table, _ref_quality, small_model,
)


def test_readme_add_a_scorer(small_model):
    """README's "Add a scorer": its class, registered, reads x[t + 1] (checked against that definition), trains a few
    steps on the boundary loss (the loss falls), then runs online as it does masked, at a budget that evicts."""
    import train

    text = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    code = re.search(r"### Add a scorer.*?```python\n(.*?)```", text, re.S).group(1)
    exec(code, {})
    try:
        torch.manual_seed(0)
        s = kvpop.SCORERS["kvpop-next"](small_model.config, 8, d_hidden=16)
        idx = torch.randint(0, 384, (2, 96), generator=torch.Generator().manual_seed(1))
        kv, rs = kvpop.dense_targets(small_model, idx, 8)
        # its parallel form: head(x[t], x[t + 1]), zeros after the last token
        x = s.features(*kv[0])
        after = torch.cat([x[..., 1:, :], torch.zeros_like(x[..., :1, :])], -2)
        want = (torch.nn.functional.silu(torch.cat([x, after], -1) @ s.w1[0] + s.b1[0][:, None]) * s.w2[0][:, None]).sum(-1)
        assert (s.parallel(0, x) - want - s.b2[0][:, None]).abs().max().item() <= 1e-5
        budgets = [kvpop.Budget(4, 8, 40 - 4 - 8)]
        qs = train.query_positions(96, 0, budgets)
        opt = torch.optim.Adam(s.parameters(), lr=3e-2)
        losses = []
        for _ in range(6):
            opt.zero_grad()
            losses.append(train.scorer_loss(s, kv, rs, qs, budgets)[0])
            opt.step()
        assert losses[-1] < losses[0], losses
        s.eval().requires_grad_(False)
        on = tasks.evaluate(small_model, idx, s, 40, 4, 8, online=True)
        off = tasks.evaluate(small_model, idx, s, 40, 4, 8, online=False)
        assert (on - off).abs().max().item() <= 1e-4
        assert (on - small_model(idx)).abs().max().item() > 1e-3  # it evicted
    finally:
        kvpop.SCORERS.pop("kvpop-next", None)


# ---------------------------------------------------------------------------------------------------------
# every command the README shows runs (smaller where it must)

README_SMALL = {  # each README command -> the flags appended to run it here (a later flag wins)
    "python sample.py --budget 0.25 --show": [],
    "python bench.py read --target max --budgets 0.125 --tokens 256": ["--tokens", "16"],
    "python bench.py quality": ["--n", "2"],
    "python train.py": ["--max_iters", "2", "--final_seqs", "2", "--eval_seqs", "2", "--out_dir", "{tmp}/a"],
    "python bench.py quality --task recall,cue --target mean,helpful --policies full,oracle,streaming,h2o": [
        "--n",
        "2",
    ],
    "python bench.py quality --task cue --p_cue 0.3 --policies full,oracle,h2o --scorer baby/scorers/cue-helpful/kvpop-window": [
        "--n",
        "2",
    ],
    "python bench.py quality --task cue --policies full,oracle --scorer baby/scorers/cue-helpful/kvpop,baby/scorers/cue-helpful/kvpop-arrival": [
        "--n",
        "2",
    ],
    "python train.py --finetune --max_iters 300 --kind kvpop --target mean --init_from baby/scorers/recall-mean/kvpop --out_dir out-ft": [
        "--max_iters",
        "2",
        "--batch_size",
        "2",
        "--final_seqs",
        "2",
        "--eval_seqs",
        "1",
        "--out_dir",
        "{tmp}/c",
    ],
    "python train.py --finetune --max_iters 300 --init_from baby/scorers/recall-helpful/kvpop-window --out_dir out-ftw": [
        "--max_iters",
        "2",
        "--batch_size",
        "2",
        "--final_seqs",
        "2",
        "--eval_seqs",
        "1",
        "--out_dir",
        "{tmp}/f",
    ],
    "python train.py --finetune --max_iters 300 --policy streaming --out_dir out-sllm": [
        "--max_iters",
        "2",
        "--batch_size",
        "2",
        "--final_seqs",
        "2",
        "--eval_seqs",
        "1",
        "--out_dir",
        "{tmp}/d",
    ],
    "torchrun --nproc_per_node=2 train.py --finetune --max_iters 300 --kind kvpop --target mean --init_from baby/scorers/recall-mean/kvpop --out_dir out-ft2": [
        "--max_iters",
        "2",
        "--batch_size",
        "2",
        "--final_seqs",
        "0",
        "--eval_seqs",
        "1",
        "--out_dir",
        "{tmp}/e",
    ],
    "python bench.py speed --layers 28 --contexts 8192 --budgets 0.25": [
        "--model",
        "{tmp}/m",
        "--contexts",
        "300",
        "--steps",
        "1",
        "--window",
        "16",
        "--d_mem",
        "8",
    ],
    "python bench.py speed --contexts '' --layers 2 --prefill 32768 --policies streaming,kvpop": [
        "--model",
        "{tmp}/m",
        "--prefill",
        "256",
        "--window",
        "16",
        "--d_mem",
        "8",
    ],
    "python bench.py kernels --lengths 16384": ["--lengths", "256"],
    "python pretrain.py --out_dir my_baby": [
        "--out_dir",
        "{tmp}/my_baby",
        "--seq_len",
        "64",
        "--tokens",
        "256",
        "--phase_steps",
        "2",
        "--final_steps",
        "2",
    ],
}
# run in this order in one folder, against a random Qwen3 with the real vocabulary in a local
# Hugging Face cache: train writes out/, which the last samples with
README_QWEN = {
    'python sample.py --model Qwen/Qwen3-0.6B --chat --prompt "Why is the sky blue?" --budget 0.25 --policy streaming': [
        "--max_new_tokens",
        "4",
        "--window",
        "1",
    ],
    "python train.py --model Qwen/Qwen3-0.6B --data texts/ --seq_len 2048 --window 256 --budget 0.25 --device cuda": [
        "--device",
        "cpu",
        "--seq_len",
        "64",
        "--window",
        "8",
        "--max_iters",
        "2",
        "--batch_size",
        "2",
        "--eval_seqs",
        "1",
        "--eval_interval",
        "2",
    ],
    'python sample.py --model Qwen/Qwen3-0.6B --scorer out --budget 0.25 --prompt "FILE:long.txt"': [
        "--max_new_tokens",
        "4",
    ],
    "python bench.py generate --model Qwen/Qwen3-0.6B --data test.jsonl --chat --think --max_new_tokens 8192"
    " --policies full,streaming --budgets 0.25,0.125 --out answers.jsonl": [
        "--max_new_tokens",
        "4",
        "--window",
        "4",
        "--budgets",
        "24,16",
    ],
}
README_NOT_RUN = {  # the commands no test runs, and why
    "python bench.py generate --task recall,cue --json gen.json": "15 minutes; test_generate_counts_are_a_recount runs"
    " it small",
    "python pretrain.py --data torch --out_dir codebaby --threads 2": "15 minutes; "
    "test_code_commands_run_on_a_tiny_corpus runs it on a tiny corpus",
    "python train.py --task code --batch_size 2 --max_iters 600 --out_dir codebaby/scorers/code-max/kvpop-window": "13"
    " minutes; the same test runs it on a tiny corpus, test_code_presets_are_the_shipped_scorers one step of it",
    "python train.py --task code --finetune --max_iters 300 --batch_size 1 --init_from codebaby/scorers/code-max/"
    "kvpop-window --out_dir out-code-ft": "30 minutes; the same test runs it on a tiny corpus",
    "python bench.py quality --task code --n 64 --model out-code-ft --ref codebaby --scorer out-code-ft --target max":
    "needs out-code-ft (30 minutes); the same test runs it on a tiny corpus",
    "python bench.py quality --task code --n 64 --target helpful,max,mean": "20 minutes; the same test runs it on a tiny"
    " corpus",
    "python bench.py kernels --targets sm_75,sm_80,sm_86,sm_89,sm_90,sm_120 --json kernels.json": "222 compiles, minutes;"
    " test_kernels_compile_for_gpus compiles a slice of it",
    "pip install -r requirements.txt": "CI runs it (.ci/run)",
    "python -m pytest -q": "this is the test run",
    "python -m pytest -q -k cuda && python bench.py kernels --lengths 4096,16384 && "
    "python bench.py speed --prefill 16384 --train 4096 --compile && python sample.py --device cuda --budget 0.25 --compile"
    " && python bench.py generate --data baby/recall.jsonl --grade prefix --max_new_tokens 1 --device cuda": "needs a GPU",
    "python -m tools.generate recall.jsonl 64": "writes recall.jsonl in the repository; test_generate.py writes the"
    " same problems by its function (recall_problems)",
    "python bench.py generate --data recall.jsonl --grade prefix --max_new_tokens 1 --policies full,streaming --budgets"
    " 128,64 --scorer baby/scorers/recall-helpful/kvpop-window": "a minute; test_baby_recall_problems_graded_by_prefix"
    "_agree_with_the_scoreboard runs it on 8 problems",
    "python bench.py generate --task recall --prompts 64 --policies full,streaming --budgets 128,64 --scorer"
    " baby/scorers/recall-helpful/kvpop-window": "a minute; test_generate_counts_are_a_recount runs --task small",
}


def _readme_commands():
    """The command lines of the README's shell blocks (fenced by a bare ```; a ```python block is code, not
    commands)."""
    lines, shell, fence = [], False, None
    for line in open(os.path.join(HERE, "README.md"), encoding="utf-8").read().splitlines():
        if line.startswith("```"):
            fence = line if fence is None else None
            shell = fence == "```"
        elif shell and line.strip().startswith(("python ", "torchrun ", "pip ")):
            lines.append(line.strip())
    return lines


def _run_readme(cmd, extra, tmp, cwd=HERE, env=None):
    import shlex

    argv = shlex.split(cmd) + [x.format(tmp=tmp) for x in extra]
    if argv[0] == "python":
        argv[0] = sys.executable
    else:  # torchrun
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", *argv[1:]]
    if cwd != HERE:  # the script from the repository, the relative paths from cwd
        argv[1] = os.path.join(HERE, argv[1])
    r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, (cmd, r.stderr[-3000:])
    return r


def test_every_readme_command_is_known():
    """A command added to the README without a run here (or a reason not to) fails this test."""
    cmds = _readme_commands()
    known = {**README_SMALL, **README_QWEN, **README_NOT_RUN}
    assert [c for c in cmds if c not in known] == []
    assert [c for c in known if c not in cmds] == []  # and none is left over from an older README


@pytest.mark.parametrize("cmd", list(README_SMALL))
def test_readme_command_runs(cmd, tmp_path, baby):
    """Each README command, smaller: it runs, and the figures it prints are checked: the quality
    tables against _ref_quality (bench.py quality with the task/target flags: every row; the plain
    one: full's row and relative = accuracy / full's), train.py's final table against _ref_quality
    with the run's target and scorer, sample.py's cache line against the budget."""
    _run_and_check(cmd, README_SMALL[cmd], tmp_path, baby)


def _run_and_check(cmd, extra, tmp_path, baby):
    if "{tmp}/m" in " ".join(extra):
        hf_checkpoint(tmp_path / "m", layers=2)
    r = _run_readme(cmd, extra, tmp_path)
    argv = cmd.split() + [x.format(tmp=tmp_path) for x in extra]
    flag = lambda k, d: argv[len(argv) - 1 - argv[::-1].index(f"--{k}") + 1] if f"--{k}" in argv else d
    if cmd.startswith(("python train.py", "python pretrain.py")):  # a scorer or a model was written
        assert "saved" in r.stdout
    if cmd.startswith("python train.py") and "--finetune" not in cmd:
        # the final table: bench.py quality's first sequences, the run's task, target and scorer
        net, tok = baby
        task, target = flag("task", "recall"), flag("target", "helpful")
        seqs = baby_tasks.task_batch(tok, int(flag("final_seqs", 128)), 512, random.Random("test-0"), **baby_tasks.TASKS[task])
        scorer = kvpop.load_scorer(flag("out_dir", "out"))
        runs = [(p, p, target) for p in ("oracle", "streaming", "h2o")] + [(scorer.kind, scorer, target)]
        _check_quality_table(r.stdout, _ref_quality(net, seqs, runs, [0.25, 0.125]))
    if cmd.startswith("python bench.py quality"):
        rows = _parse_quality_table(r.stdout)
        for task in {row["task"] for row in rows}:
            full = [x for x in rows if x["task"] == task and x["policy"] == "full"]
            assert len(full) == 1 and full[0]["relative"] == 1 and full[0]["KL"] == 0
            for x in rows:  # relative = accuracy / full's, to the printed digits
                if x["task"] == task and full[0]["accuracy"]:
                    assert abs(x["relative"] - x["accuracy"] / full[0]["accuracy"]) < 2e-3, x
    if "kvpop-arrival" in cmd:  # the delay table: the same scorer read when t leaves the window and on arrival
        assert [x["policy"] for x in _parse_quality_table(r.stdout)][-4:] == ["kvpop"] * 2 + ["kvpop on arrival"] * 2
    if cmd.startswith("python bench.py quality --task") and "--scorer" not in cmd:
        net, tok = baby
        for task in ("recall", "cue"):
            seqs = baby_tasks.task_batch(tok, 2, 512, random.Random("test-0"), **baby_tasks.TASKS[task])
            runs = [(p, p, "-") for p in ("streaming", "h2o")]
            for target in flag("target", "helpful").split(","):
                runs += [("oracle", "oracle", target)]
                for kind in kvpop.SCORERS:  # the shipped scorers of this task and target (bench.py: those there)
                    d = os.path.join(HERE, "baby", "scorers", f"{task}-{target}", kind)
                    runs += [(kind, kvpop.load_scorer(d), target)] if os.path.isdir(d) else []
            _check_quality_table(r.stdout, _ref_quality(net, seqs, runs, [0.25, 0.125]), task)
    if cmd.startswith("python bench.py read"):  # the scoreboard: each policy's far copies
        board = r"far copies kvpop-window 0.125: \d+/\d+\n(.*\n)*far copies streaming 0.125: \d+/\d+"
        assert re.search(board + r"\n(.*\n)*far copies full 0.125: \d+/\d+", r.stdout)
    elif cmd.startswith("python sample.py"):  # B = ceil(0.25 (399 + 112)) entries, no state
        assert re.search(
            r"KV cache: 128 entries kept per head of 510 tokens; .* full \(25.0%\), "
            r"policy kvpop-window",
            r.stdout,
        )


# the scripts' docstring commands that the README lacks -> the flags appended to run them here
DOC_SMALL = {
    "python train.py --plain": ["--max_iters", "2", "--final_seqs", "2", "--eval_seqs", "2", "--out_dir", "{tmp}/p"],
}
DOC_RUN_ELSEWHERE = {  # ... or the test that runs them
    "python sample.py --budget 0.25 --plain": "test_sample_plain_writes_the_same_text (--policy kvpop-window, kvpop; "
    "--num_samples 2), against the run without --plain",
}


def _docstring_commands(script):  # the command lines of a script's opening docstring
    doc = ast.get_docstring(ast.parse(open(os.path.join(HERE, script), encoding="utf-8").read()))
    return [line for line in doc.splitlines() if line.startswith(("python ", "torchrun "))]


def test_every_docstring_command_is_known():
    """train.py's and sample.py's opening commands, each one line: a README command (run above, or not run for
    the reason given), one of DOC_SMALL (run below) or DOC_RUN_ELSEWHERE; a command wrapped onto two lines is
    none of them."""
    cmds = _docstring_commands("train.py") + _docstring_commands("sample.py")
    known = {**README_SMALL, **README_QWEN, **README_NOT_RUN, **DOC_SMALL, **DOC_RUN_ELSEWHERE}
    assert len(cmds) >= 8 and [c for c in cmds if c not in known] == []
    assert [c for c in {**DOC_SMALL, **DOC_RUN_ELSEWHERE} if c not in cmds] == []


@pytest.mark.parametrize("cmd", list(DOC_SMALL))
def test_docstring_command_runs(cmd, tmp_path, baby):
    """Each DOC_SMALL command, smaller, checked as the README's are (train.py --plain's final table against
    _ref_quality, computed on the fast forms)."""
    _run_and_check(cmd, DOC_SMALL[cmd], tmp_path, baby)


def test_readme_line_counts_are_the_files():
    """The README's file map gives each file's lines: each is the file's count."""
    text = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    block = text.split("## The code")[1].split("```")[1]
    rows = re.findall(r"^(\S+\.py) +(\d+) ", block, re.M)
    lines = lambda name: len(open(os.path.join(HERE, name), encoding="utf-8").read().splitlines())
    assert len(rows) >= 10 and {f: int(n) for f, n in rows} == {f: lines(f) for f, _ in rows}


def test_readme_real_qwen3_commands_on_a_local_cache(tmp_path):
    """The README's four commands for a real Qwen3 (sample, train a scorer on text files, sample
    with it, answer a problem set), offline: a random Qwen3 with the real 151,936-token vocabulary saved by transformers
    in a local Hugging Face cache under Qwen/Qwen3-0.6B, its tokenizer.json the real one."""
    snap = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / "0123abc"
    hf_checkpoint(snap, layers=2, vocab=151936)
    # the real tokenizer and chat template
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(HF_DIR, name), snap / name)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0123abc")
    (tmp_path / "texts").mkdir()
    text = " ".join(CORPUS.split()[:400])
    for n in range(3):
        (tmp_path / "texts" / f"{n}.txt").write_text(text[n * 300 :] + text[: n * 300])
    (tmp_path / "long.txt").write_text(text[:600])
    # a GSM8K-shaped problem set
    problem = dict(question="Natalia sold 48 clips. How many?", answer="She sold 48.\n#### 48")
    (tmp_path / "test.jsonl").write_text(json.dumps(problem) + "\n")
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_ENDPOINT="http://127.0.0.1:9")
    out = [_run_readme(c, extra, tmp_path, tmp_path, env).stdout for c, extra in README_QWEN.items()]
    assert "tokens/s" in out[0] and "saved out/" in out[1]
    assert "policy kvpop-window (out)" in out[2] and (tmp_path / "out" / "scorer.json").exists()
    assert "| - | streaming | 16 |" in out[3] and (tmp_path / "answers.jsonl").exists()
