"""The layers: support/ (what the core stands on) imports nothing of the core or the tooling; the core imports no
tooling or research (tools/, experiments/, bench.py, pretrain.py); and the core runs with all of them deleted."""

import ast
import glob
import os
import shutil
import subprocess
import sys

from tests.common import HERE

CORE = ["kvpop", "kernels", "fast", "cache", "qwen3", "tasks", "train", "sample"]
TOOLING = ["bench", "pretrain", "tools", "experiments", "tests"]


def _imports(path):
    """The top-level module names a file imports (anywhere in it, a function's imports too)."""
    tree = ast.parse(open(os.path.join(HERE, path), encoding="utf-8").read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_support_imports_nothing_of_the_core():
    modules = sorted(glob.glob(os.path.join(HERE, "support", "*.py")))
    assert len(modules) >= 6
    for path in modules:
        back = _imports(path) & {*CORE, *TOOLING}
        assert not back, (path, back)


def test_the_core_imports_no_tooling_or_research():
    for name in CORE:
        found = _imports(f"{name}.py") & set(TOOLING)
        assert not found, (name, found)


def test_the_core_runs_without_the_tooling(tmp_path):
    """A copy of the repository without bench.py, pretrain.py, tools/, experiments/ and the tests trains the
    default scorer two steps and samples at a quarter of the cache (the README's two core commands)."""
    gone = {"bench.py", "pretrain.py", "tools", "experiments", "tests", "test_kvpop.py"}
    skip = shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "out", "out-*", *gone)
    copy = tmp_path / "core"
    shutil.copytree(HERE, copy, ignore=skip)
    assert not any((copy / name).exists() for name in gone)
    run = lambda *args: subprocess.run([sys.executable, *args], cwd=copy, capture_output=True, text=True)
    trained = run("train.py", "--max_iters", "2", "--eval_seqs", "2", "--final_seqs", "2", "--out_dir", "out")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "saved out/" in trained.stdout and (copy / "out" / "scorer.json").exists()
    sampled = run("sample.py", "--budget", "0.25", "--num_samples", "1", "--max_new_tokens", "16")
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert "policy kvpop-window (out)" in sampled.stdout
