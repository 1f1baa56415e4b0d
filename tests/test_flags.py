"""Bad input and --help: every flag of every script checked before any work, one line naming it (in-process and
as real runs); --help lists every default once; the flag syntax (hyphens, =, booleans)."""

import os
import subprocess
import sys

import pytest
import torch

import qwen3
from support import flags

from tests.common import HERE, MODEL_DIR, exits, hf_checkpoint, one_line_error


# the checks that need the checkpoint's files
def test_sample_cli_bad_values(tmp_path, monkeypatch):
    hf_checkpoint(tmp_path / "ck")
    m = ["--model", str(tmp_path / "ck"), "--max_new_tokens", "40", "--window", "8"]
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("")
    for args, words in [
        (["--budget", "10"], ["budget", "12"]),  # sinks 4 + window 8
        (["--max_new_tokens", "2000"], ["positions"]),
        (["--prompt", f"FILE:{tmp_path / 'empty.txt'}"], ["--prompt is empty"]),
        (["--prompt", f"FILE:{tmp_path}"], ["--prompt", "cannot read"]),  # a folder
        (["--prompt", f"FILE:{tmp_path / 'latin1.txt'}"], ["--prompt", "cannot read", "utf-8"]),
    ]:
        one_line_error(exits(monkeypatch, "sample.py", *m, *args), *words)


NOWHERE = "/nonexistent/kvpop-model"  # never looked up: every flag is checked before the checkpoint
# (script, args, words of the one line): every flag, each kind of bad value that applies
BAD_FLAGS = [
    ("sample.py", ["--bogus", "1"], ["unknown option '--bogus'"]),
    ("sample.py", ["--seed"], ["--seed needs a value"]),
    ("sample.py", ["--model", NOWHERE], ["no checkpoint folder"]),
    ("sample.py", ["--model", ""], ["no checkpoint"]),
    ("sample.py", ["--device", "nonsense"], ["--device 'nonsense' is not a device"]),
    ("sample.py", ["--device", "cuda:x"], ["not a device"]),
    ("sample.py", ["--device", "meta"], ["not a device"]),
    ("sample.py", ["--device", "cuda"], ["--device cuda: no CUDA GPU is visible; use --device cpu"]),
    ("sample.py", ["--device", "cuda:1"], ["no CUDA GPU"]),
    ("sample.py", ["--dtype", "float8"], ["--dtype 'float8'"]),
    ("sample.py", ["--dtype", "unknown"], ["--dtype"]),
    ("sample.py", ["--prompt", "FILE:/nonexistent/prompt.txt"], ["--prompt", "No such file"]),
    ("sample.py", ["--chat", "maybe"], ["--chat 'maybe' is not true or false"]),
    ("sample.py", ["--think", "2"], ["--think", "true or false"]),
    ("sample.py", ["--think"], ["--think", "--chat"]),
    ("sample.py", ["--show=maybe"], ["--show", "true or false"]),
    ("sample.py", ["--num_samples", "-1"], ["--num_samples -1"]),
    ("sample.py", ["--num_samples", "two"], ["integer"]),
    ("sample.py", ["--max_new_tokens", "-3"], ["--max_new_tokens -3"]),
    ("sample.py", ["--max_new_tokens", "ten"], ["--max_new_tokens 'ten' is not an integer"]),
    ("sample.py", ["--max_new_tokens", "2.5"], ["integer"]),
    ("sample.py", ["--temperature", "-2"], ["--temperature -2"]),
    ("sample.py", ["--temperature=hot"], ["--temperature 'hot' is not a finite number"]),
    ("sample.py", ["--temperature", "nan"], ["finite number"]),
    ("sample.py", ["--temperature", "inf"], ["finite"]),
    ("sample.py", ["--top_k", "-2"], ["--top_k -2"]),
    ("sample.py", ["--top_k", "1.5"], ["--top_k", "integer"]),
    ("sample.py", ["--top_p", "0"], ["--top_p 0"]),
    ("sample.py", ["--top_p", "1.5"], ["--top_p 1.5"]),
    ("sample.py", ["--top_p", "-inf"], ["--top_p", "finite"]),
    ("sample.py", ["--top_p", "x"], ["--top_p", "number"]),
    ("sample.py", ["--seed", "x"], ["--seed 'x' is not an integer"]),
    ("sample.py", ["--seed", "-1"], ["--seed -1"]),
    ("sample.py", ["--seed", str(2**32)], ["--seed"]),
    *[("sample.py", ["--budget", b], ["--budget"]) for b in ["inf", "nan", "0", "-1", "1.5", "abc", ""]],
    ("sample.py", ["--policy", "lru"], ["--policy", "unknown policy 'lru'"]),
    ("sample.py", ["--policy", "oracle"], ["--policy", "oracle", "teacher-forced"]),
    ("sample.py", ["--policy", "full", "--budget", "0.5"], ["--policy full never evicts"]),
    ("sample.py", ["--sinks", "-1"], ["--sinks -1"]),
    ("sample.py", ["--sinks", "a"], ["--sinks", "integer"]),
    # its default: 32, a learned scorer's own, codebaby's 192 or a real Qwen3's 256
    ("sample.py", ["--window", "-2"], ["--window -2"]),
    ("sample.py", ["--window", "0"], ["--window 0"]),
    ("sample.py", ["--plain", "--compile", "--policy", "kvpop"], ["--plain", "no graph", "drop --compile"]),
    ("sample.py", ["--policy", "kvpop", "--scorer", "/nonexistent/scorer"], ["--policy kvpop", "/nonexistent/scorer"]),
    ("sample.py", ["--policy", "kvpop-mlp"], ["--policy kvpop-mlp needs --scorer"]),
    (
        "sample.py",
        ["--policy", "h2o", "--scorer", "baby/scorers/recall-helpful/kvpop"],
        ["--scorer baby/scorers/recall-helpful/kvpop", "learned --policy"],
    ),
    (
        "sample.py",
        ["--scorer", "/nonexistent/scorer"],
        ["--policy kvpop", "/nonexistent/scorer is not a scorer folder"],
    ),
    ("sample.py", ["--window", "a"], ["--window", "integer"]),
    ("bench.py kernels", ["--bogus"], ["unknown option '--bogus'"]),
    ("bench.py kernels", ["--budgets", "0.5"], ["unknown option '--budgets'"]),  # another command's
    ("bench.py kernels", ["--device", "tpu"], ["--device 'tpu'", "cpu or cuda"]),
    ("bench.py kernels", ["--device", "cuda"], ["--device cuda: no CUDA GPU is visible; use --device cpu"]),
    *[("bench.py kernels", ["--lengths", t], ["--lengths"]) for t in ["0", "abc", ",", "1,,2", "-5", "1.5", "²"]],
    ("bench.py kernels", ["--D", "0"], ["--D 0"]),
    ("bench.py kernels", ["--D", "abc"], ["--D 'abc' is not an integer"]),
    ("bench.py kernels", ["--group", "0"], ["--group 0"]),
    ("bench.py kernels", ["--group", "x"], ["--group"]),
    ("bench.py kernels", ["--targets", "sm_89,sm_70"], ["--targets sm_89,sm_70", "among sm_75,sm_80"]),
    ("bench.py kernels", ["--targets", "sm_89,"], ["--targets sm_89,", "use GPUs among"]),
    ("bench.py kernels", ["--targets", "sm_89", "--json", "/nonexistent/k.json"], ["--json /nonexistent/k.json"]),
    ("bench.py speed", ["--bogus"], ["unknown option '--bogus'"]),
    ("bench.py speed", ["--n", "3"], ["unknown option '--n'"]),  # quality's
    ("bench.py speed", ["--model", NOWHERE], ["no checkpoint folder"]),
    ("bench.py speed", ["--shape", "2B"], ["--shape '2B'", "0.6B"]),
    ("bench.py speed", ["--device", "cuda"], ["--device cuda: no CUDA GPU is visible; use --device cpu"]),
    *[("bench.py speed", ["--contexts", x], ["--contexts"]) for x in ["8k", "0", "1,,2", " 8"]],
    *[("bench.py speed", ["--budgets", b], ["budget"]) for b in ["inf", "0", "1.5", ""]],
    ("bench.py speed", ["--budgets", "0.01"], ["leaves no room"]),
    ("bench.py speed", ["--contexts", "", "--prefill", "512"], ["leaves no room"]),
    ("bench.py speed", ["--contexts", "", "--train", "300"], ["leaves no room"]),
    ("bench.py speed", ["--policies", "oracle"], ["--policies", "'oracle'", "online"]),
    ("bench.py speed", ["--policies", "full"], ["--policies", "'full'"]),
    *[("bench.py speed", [f"--{k}", "-1"], [f"--{k} -1"]) for k in ["layers", "prefill", "train", "sinks"]],
    *[("bench.py speed", [f"--{k}", "0"], [f"--{k} 0"]) for k in ["steps", "d_mem"]],
    ("bench.py speed", ["--window", "-1"], ["--window -1"]),  # 0: the command's default
    ("bench.py speed", ["--dtype", "float8"], ["--dtype 'float8'"]),
    ("bench.py speed", ["--json", HERE], ["--json", "file name"]),
    ("bench.py quality", ["--bogus"], ["unknown option '--bogus'"]),
    ("bench.py quality", ["--contexts", "8"], ["unknown option '--contexts'"]),  # speed's
    ("bench.py quality", ["--model", NOWHERE], ["no checkpoint folder"]),
    ("bench.py quality", ["--scorer", "/nonexistent/scorer"], ["/nonexistent/scorer is not a scorer folder"]),
    ("bench.py quality", ["--policies", "bogus"], ["--policies", "unknown policy 'bogus'"]),
    ("bench.py quality", ["--policies", ","], ["--policies", "unknown policy ''"]),
    *[("bench.py quality", ["--budgets", b], ["--budgets", "finite number"]) for b in ["inf", "nan", "", "abc", "1,"]],
    *[("bench.py quality", ["--budgets", b], ["budget"]) for b in ["0", "-1", "1.5"]],
    ("bench.py quality", ["--budgets", "0.01"], ["leaves no room"]),
    ("bench.py quality", ["--seed", "x"], ["--seed 'x' is not an integer"]),
    ("bench.py quality", ["--json", "/nonexistent/dir/q.json"], ["--json", "existing"]),
    ("bench.py quality", ["--json", HERE], ["--json", "file name"]),
    ("bench.py quality", ["--n", "0"], ["--n 0"]),
    ("bench.py quality", ["--n", "x"], ["--n 'x' is not an integer"]),
    ("bench.py quality", ["--T", "10"], ["--T 10"]),
    ("bench.py quality", ["--T", "5000"], ["--T 5000", "positions"]),
    ("bench.py quality", ["--T", "1e3"], ["--T '1e3' is not an integer"]),
    ("bench.py quality", ["--sinks", "-1"], ["--sinks -1"]),
    ("bench.py quality", ["--window", "-1"], ["--window -1"]),
    ("bench.py quality", ["--threads", "0"], ["--threads 0"]),
    ("bench.py quality", ["--threads", "two"], ["--threads"]),
    ("bench.py quality", ["--task", "recall,x"], ["--task", "unknown task 'x'"]),
    ("bench.py quality", ["--target", "sum"], ["--target", "unknown target 'sum'"]),
]
# flag -> bad values (wrong type, out of range, unknown choice); the line must name the flag
TRAIN_BAD = {
    "out_dir": ["", "/"],
    "resume": ["maybe"],
    "seed": ["-1", str(2**32), "x"],
    "device": ["nonsense", "cuda", "tpu"],
    "dtype": ["float8", "x"],
    "threads": ["0", "-1", "1.5"],
    "kind": ["lstm"],
    "d_mem": ["0", "x"],
    "d_hidden": ["0"],
    "gamma": ["0", "1", "nan"],
    "seq_len": ["32", "x"],
    "queries": ["-1"],
    "budget": ["inf", "0", "1.5", "0.01", "1"],
    "sinks": ["-1"],
    "window": ["0"],
    "batch_size": ["0"],
    "max_iters": ["0", "1e3"],
    "lr": ["0", "-1", "nan"],
    "min_lr": ["-1", "1"],
    "warmup": ["-1"],
    "weight_decay": ["-0.1", "1"],
    "grad_clip": ["0"],
    "log_interval": ["0"],
    "eval_interval": ["0"],
    "eval_seqs": ["0"],
    "final_seqs": ["-1"],
    "keys": ["0", "17", "x"],
    "finetune": ["maybe"],
    "policy": ["h2o", "x"],
    "model_lr": ["0", "nan"],
    "top_logits": ["0", "x"],
    "task": ["x"],
    "target": ["sum"],
}
# pretrain.py's (the baby's pretraining)
PRETRAIN_BAD = {
    "out_dir": [HERE, "", "/"],
    "seed": ["-1", str(2**32), "x"],
    "threads": ["0", "1.5"],
    "task": ["x"],
    "final_tasks": ["recall,x", ""],
    "keys": ["0", "17", "x"],
    "seq_len": ["8192", "32", "x"],
    "tokens": ["100", "-1"],
    "lr": ["0", "-1", "nan"],
    "warmup": ["0", "-1"],
    "vocab_ranks": ["100", "200000", "x"],
    "n_layer": ["0"],
    "n_embd": ["127", "16", "x"],
    "n_head": ["-1"],
    "n_kv_head": ["-1", "3"],
    "copies": ["1.5", "-0.1"],
    "n_ff": ["-1"],
    "rope_theta": ["-1", "inf"],
    "phase_steps": ["0"],
    "advance_acc": ["0", "1.5"],
    "final_steps": ["-1"],
    "answer_weight": ["-1", "x"],
}
BAD_FLAGS += [("train.py", [f"--{k}", v], [f"--{k}"]) for k, vs in TRAIN_BAD.items() for v in vs]
BAD_FLAGS += [("pretrain.py", [f"--{k}", v], [f"--{k}"]) for k, vs in PRETRAIN_BAD.items() for v in vs]
BAD_FLAGS += [("train.py", ["--bogus"], ["unknown option '--bogus'"]), ("train.py", ["--lr"], ["--lr needs a value"])]
BAD_FLAGS += [("pretrain.py", ["--bogus"], ["unknown option '--bogus'"]), ("pretrain.py", ["--lr"], ["needs a value"])]
# each script takes only its own flags: the scorer's and the fine-tune's are no pretrain.py flags, and back
BAD_FLAGS += [
    ("pretrain.py", [f"--{k}", v], [f"unknown option '--{k}'"])
    for k, v in [("finetune", "true"), ("resume", "true"), ("device", "cpu"), ("final_seqs", "0"), ("target", "mean")]
]
BAD_FLAGS += [
    ("train.py", [f"--{k}", v], [f"unknown option '--{k}'"])
    for k, v in [("stage", "pretrain"), ("stage", "scorer"), ("n_embd", "64"), ("tokens", "4096")]
]
BAD_FLAGS += [
    ("train.py", ["--policy", "streaming"], ["--policy streaming", "--finetune"]),
    ("train.py", ["--kind", "kvpop-mlp", "--d_mem", "8"], ["--d_mem does nothing", "--kind kvpop-mlp"]),
    ("train.py", ["--arrival"], ["--arrival does nothing", "--kind kvpop-window;"]),
    ("train.py", ["--kind", "kvpop", "--init_from", "baby/scorers/recall-helpful/kvpop", "--d_mem", "8"], ["--d_mem does nothing", "--init_from"]),
    ("train.py", ["--kind", "kvpop", "--init_from", "baby/scorers/recall-helpful/kvpop-mlp"], ["holds a kvpop-mlp scorer", "--kind kvpop-mlp"]),
    ("train.py", ["--edges", "0"], ["--edges 0", "at least 1"]),
    ("train.py", ["--d_mem", "8"], ["--d_mem does nothing", "--kind kvpop-window;"]),
    ("train.py", ["--resume", "--out_dir", NOWHERE], ["--resume", "train_state.pt", "drop --resume"]),
]
IDLE = [
    (["--model_lr", "1e-4"], "no --finetune"),
    (["--top_logits", "64"], "no --finetune"),
    (["--finetune", "--policy", "streaming", "--kind", "kvpop"], "--policy streaming"),
    (["--policy", "scorer"], "no --finetune"),
    (["--finetune", "--policy", "streaming", "--gamma", "0.01"], "--policy streaming"),
    (["--finetune", "--policy", "streaming", "--init_from", "baby/scorers/recall-helpful/kvpop-window"], "--policy streaming"),
    (["--finetune", "--policy", "streaming", "--edges", "1"], "--policy streaming"),
    (["--data", NOWHERE, "--keys", "4"], f"--data {NOWHERE} (not the baby's task)"),
    (["--data", NOWHERE, "--task", "cue"], f"--data {NOWHERE} (not the baby's task)"),
]
# ignored: an error
BAD_FLAGS += [("train.py", a, [f"{a[-2]} does nothing with {why}", "drop it"]) for a, why in IDLE]


@pytest.mark.parametrize("script, args, words", BAD_FLAGS, ids=[" ".join([s, *a]) for s, a, _ in BAD_FLAGS])
def test_bad_flags_one_line_before_any_work(monkeypatch, script, args, words):
    model = MODEL_DIR if "quality" in script else NOWHERE
    m = ["--model", model] if script in ("sample.py", "bench.py quality") else []
    m = [] if "--model" in args else m
    one_line_error(exits(monkeypatch, script, *m, *args), *words)


@pytest.mark.parametrize("command", ["kernels", "quality", "generate", "speed"])
def test_bench_help_lists_the_commands_defaults(command):
    """bench.py COMMAND --help lists the defaults that command reads (bench.COMMAND_FLAGS), in file
    order, under non-empty headings; every default before the first function is read by some
    command."""
    import ast

    import bench

    keys = []
    for node in ast.parse(open(os.path.join(HERE, "bench.py")).read()).body:
        if isinstance(node, ast.FunctionDef):
            break
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Constant, ast.IfExp, ast.UnaryOp)):
            keys += [t.id for t in node.targets]
    read = {k for v in bench.COMMAND_FLAGS.values() for k in v.split()}
    assert set(keys) == read, set(keys) ^ read
    r = subprocess.run(
        [sys.executable, "bench.py", command, "--help"], capture_output=True, text=True, cwd=HERE, timeout=120
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.splitlines()[1:]
    mine = bench.COMMAND_FLAGS[command].split()
    assert [x.split()[0] for x in lines if x.startswith("  --")] == [f"--{k}" for k in keys if k in mine]
    heads = [x for x in lines if x and not x.startswith("  --")]
    assert heads and all(len(x) > 1 and x.endswith(":") for x in heads), heads


@pytest.mark.parametrize("script", ["train.py", "pretrain.py", "sample.py"])
def test_help_lists_every_default_once(script):
    """--help names every module-level default (the simple assignments before configure() reads the
    flags) once, in file order, under non-empty headings; and a reader that closes the pipe early
    (`--help | head`) is no error."""
    import ast

    keys = []
    for node in ast.parse(open(os.path.join(HERE, script)).read()).body:
        if "configure(globals()" in ast.unparse(node):
            break
        # x = 1 / a if c else b
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Constant, ast.IfExp, ast.UnaryOp)):
            keys += [t.id for t in node.targets]
    r = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, cwd=HERE, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.splitlines()[1:]
    assert [x.split()[0] for x in lines if x.startswith("  --")] == [f"--{k}" for k in keys]
    heads = [x for x in lines if x and not x.startswith("  --")]
    assert heads and all(len(x) > 1 and x.endswith(":") for x in heads), heads
    r = subprocess.run(
        f"set -o pipefail; {sys.executable} {script} --help | true",
        shell=True,
        executable="/bin/bash",
        # `true` reads nothing and exits
        capture_output=True,
        text=True,
        cwd=HERE,
        timeout=120,
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_bad_input_end_to_end(tmp_path):
    """The same checks as real runs, in parallel: exit status 1, exactly one line on stderr, no
    traceback."""
    from concurrent.futures import ThreadPoolExecutor

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("[1, 2]")
    bad, env = str(tmp_path / "bad"), dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU visible
    cases = [
        (["sample.py", "--device", "cuda"], "no CUDA GPU"),
        (["sample.py", "--model", bad], "config.json: must be"),
        (["train.py", "--keys", "0"], "--keys"),
        (["train.py", "--data", str(tmp_path / "*.txt")], "--data"),
        (["pretrain.py", "--tokens", "100"], "--tokens"),
        (["bench.py", "kernels", "--T", "abc"], "--T"),
        (["bench.py", "quality", "--budgets", "inf"], "'inf'"),
    ]
    with ThreadPoolExecutor(4) as pool:
        done = list(
            pool.map(
                lambda c: subprocess.run(
                    [sys.executable, *c[0]], capture_output=True, text=True, cwd=HERE, env=env, timeout=300
                ),
                cases,
            )
        )
    for (args, words), r in zip(cases, done):
        assert r.returncode == 1, (args, r.stderr)
        one_line_error(r, words)


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--policies", "lru"], "unknown policy 'lru'"),
        (["--budgets", "0.01"], "leaves no room"),
        (["--scorer", "x"], "x is not a scorer folder"),
        (["--model", "no/such/dir"], "no checkpoint folder"),
    ],
)
# in-process; test_bad_input_end_to_end runs it for real
def test_bench_quality_bad_flags(args, msg, monkeypatch):
    one_line_error(exits(monkeypatch, "bench.py quality", "--model", MODEL_DIR, *args), msg)


def _train_fails(monkeypatch, *args):
    """train.py run as __main__ in this process (its flag checks, then load()'s checks against the model, the budget,
    --data and the final table), no CUDA GPU visible -> its stderr as a run's: what it wrote there, then the line it
    exits with (a string: exit status 1). Loading the weights, the first step after every check, fails the test."""
    import contextlib
    import io
    import runpy

    monkeypatch.chdir(HERE)
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this process's threads stay
    monkeypatch.setattr(qwen3.Qwen3, "from_pretrained", lambda *a, **k: pytest.fail(f"train.py {args}: no error"))
    err = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        runpy.run_path(os.path.join(HERE, "train.py"), run_name="__main__")
    assert isinstance(e.value.code, str), (args, e.value.code)
    return err.getvalue() + e.value.code + "\n"


# in-process (one line each, before the weights load); test_bad_input_end_to_end runs train.py for real
def test_train_bad_input(tmp_path, monkeypatch):
    bad = tmp_path / "texts"
    bad.mkdir()
    (bad / "a.txt").write_text("  \n")
    (bad / "b.jsonl").write_text('{"text": ""}\n[1, 2]\nnot json\n')
    cases = [
        (("--kind", "kvpop-lstm"), ["--kind"]),
        (("--budget", "0.1", "--window", "60"), ["budget", "no room"]),
        # 4 + 32 + 3 state entries
        (("--budget", "38", "--window", "32", "--kind", "kvpop"), ["no room", "39"]),
        (("--budget", "39", "--window", "32", "--kind", "kvpop"), ["no pool"]),
        (("--data", str(bad)), ["--data", "tokens"]),
        (("--device", "cuda"), ["cuda"]),
        (("--max_iters", "0"), ["--max_iters"]),
        (("--task", "cue", "--p_cue_min", "0.4"), ["--p_cue_min 0.4", "min <= max"]),
        (("--p_cue_max", "0.3"), ["--p_cue_max", "does nothing", "--task recall"]),
        (("--seq_len", "128", "--window", "16", "--budget", "0.375"), ["--final_seqs 128", "final table"]),
    ]
    for args, words in cases:
        one_line_error(_train_fails(monkeypatch, "--out_dir", str(tmp_path / "o"), *args), *words)
        assert not (tmp_path / "o").exists()


def test_train_distributed_bad_input(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    one_line_error(exits(monkeypatch, "train.py", "--batch_size", "8"), "--batch_size 8", "3 processes")


def test_pretrain_refuses_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    one_line_error(exits(monkeypatch, "pretrain.py"), "one process", "torchrun")


def test_flags_take_hyphens_and_equals():
    """--key value, --key=value, and - for _ in a key (--max-iters is --max_iters); a bare bool
    switch is true; an unknown key is an error."""
    g = dict(max_iters=5, min_lr=0.1, finetune=False, __file__=os.path.join(HERE, "train.py"))
    assert flags.configure(g, ["--max-iters", "7", "--min-lr=0.5", "--finetune"]) == {"max_iters", "min_lr", "finetune"}
    assert (g["max_iters"], g["min_lr"], g["finetune"]) == (7, 0.5, True)
    with pytest.raises(SystemExit, match="unknown option '--max_iter'"):
        flags.configure(g, ["--max_iter", "3"])


def test_flags_read_booleans_in_any_case():
    """A boolean flag takes true/yes/1 and false/no/0 in any case (flags.TYPES: `true or false`): --finetune True,
    --finetune=FALSE, Yes, nO; anything else is one line naming the flag."""
    for val, want in [("True", True), ("FALSE", False), ("Yes", True), ("nO", False), ("TRUE", True), ("0", False)]:
        for argv in (["--finetune", val], [f"--finetune={val}"]):
            g = dict(finetune=not want, __file__=os.path.join(HERE, "train.py"))
            assert flags.configure(g, argv) == {"finetune"} and g["finetune"] is want, (argv, g["finetune"])
    with pytest.raises(SystemExit, match="--finetune 'Truth' is not true or false"):
        flags.configure(dict(finetune=False, __file__=os.path.join(HERE, "train.py")), ["--finetune", "Truth"])


def test_audit_cuda_index_past_the_last_gpu_refused(monkeypatch):
    """--device cuda:N names one of the visible GPUs 0..n-1: with 2 visible, cuda:1 passes and cuda:2 is a one-line
    error. Break: the bound `< n` written `<= n`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for ok in ("cuda", "cuda:0", "cuda:1"):
        flags.check_device(ok, "train.py")
    with pytest.raises(SystemExit) as e:
        flags.check_device("cuda:2", "train.py")
    one_line_error(e.value.code, "--device cuda:2", "2 CUDA GPU(s)")


def test_audit_gamma_beside_init_from_refused(monkeypatch):
    """--init_from takes the folder's scorer as it is (its gamma too): --gamma beside it is ignored, so an error, as
    an unknown flag is. Break: gamma dropped from the --init_from row of the ignored flags."""
    init = ["--init_from", os.path.join("baby", "scorers", "recall-helpful", "kvpop-window")]
    msg = exits(monkeypatch, "train.py", *init, "--gamma", "0.01")
    one_line_error(msg, "--gamma does nothing with --init_from", "drop it")
