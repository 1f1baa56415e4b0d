"""Tests of pretrain.py (the baby's pretraining): it writes a loadable checkpoint, into a checkpoint folder
keeps its other files, and its first step's gradient is its definition's loss."""

import os
import random
import subprocess
import sys

import torch

import qwen3
from support import baby_tasks, tokenizer

from tests.common import HERE, MODEL_DIR, baby, one_line_error, run


def test_pretrain_into_a_checkpoint_folder_keeps_its_other_files(tmp_path):
    """pretrain.py writes its model files into --out_dir and leaves the rest (baby/ ships a
    prompt and scorers beside its model); a folder that is no checkpoint is refused."""
    tiny = ["--seq_len", "64", "--tokens", "256", "--phase_steps", "2", "--final_steps", "2"]
    d = tmp_path / "b"
    (d / "scorers").mkdir(parents=True)
    (d / "prompt.txt").write_text("hi")
    one_line_error(run("pretrain.py", "--out_dir", str(d), *tiny), "no checkpoint")
    (d / "config.json").write_text(open(os.path.join(MODEL_DIR, "config.json")).read())
    r = run("pretrain.py", "--out_dir", str(d), *tiny)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(d)) == ["config.json", "model.safetensors", "prompt.txt", "scorers"]
    assert (d / "prompt.txt").read_text() == "hi" and not os.path.exists(str(d) + ".tmp")
    assert qwen3.Qwen3.from_pretrained(str(d)).config.num_hidden_layers == 2


def test_pretrain_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "tiny"
    r = subprocess.run(
        [
            sys.executable,
            "pretrain.py",
            "--out_dir",
            str(out),
            "--seq_len",
            "64",
            "--tokens",
            "256",
            "--phase_steps",
            "2",
            "--final_steps",
            "2",
        ],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "held-out accuracy" in r.stdout and not os.path.exists(str(out) + ".tmp")
    net = qwen3.Qwen3.from_pretrained(str(out))
    assert net.config.vocab_size == 2048 + 26 and tokenizer.Tokenizer.from_pretrained(str(out)).n_vocab == 2074


def test_pretrain_step_gradient_is_the_definitions_loss(baby, tmp_path, monkeypatch):
    """pretrain.py's first step (in-process, a tiny run at --seq_len 64): the gradient its loss sends to the logits
    equals that of the loss written here from its definition (README, The baby): the mean next-token cross entropy
    over every position, plus --answer_weight x its mean over the answer positions, the keys q (tgt[q] >= 0) at
    which the next token idx[q + 1] is the recalled value."""
    import runpy

    tok, w = baby[1], 4.0
    argv = ["pretrain.py", "--out_dir", str(tmp_path / "o"), "--seq_len", "64", "--tokens", "256", "--final_steps", "1"]
    monkeypatch.setattr(sys, "argv", argv + ["--answer_weight", str(w), "--final_tasks", "recall"])
    g = runpy.run_path(os.path.join(HERE, "pretrain.py"), run_name="pretrain_under_test")
    model = g["init_baby"]()
    seen = {}

    def hook(module, args, out):  # the step's logits, and the gradient its loss sends them
        seen["idx"], seen["logits"] = args[0], out
        out.register_hook(lambda grad: seen.__setitem__("grad", grad))

    model.register_forward_hook(hook)
    params = [p for p in model.parameters() if p.requires_grad]
    assert g["train_steps"](model, tok, torch.optim.AdamW(params, lr=1e-3), params) == 1
    idx, tgt, _ = baby_tasks.task_batch(tok, 4, 64, random.Random("train-0"), keys=8)
    assert torch.equal(seen["idx"], idx)
    answers = [(b, q) for b in range(4) for q in range(63) if tgt[b, q] >= 0]
    assert answers and all(idx[b, q + 1] == tgt[b, q] for b, q in answers)
    x = seen["logits"].detach().requires_grad_(True)
    ce = -x.float().log_softmax(-1)[:, :-1].gather(-1, idx[:, 1:, None])[..., 0]  # ce[b, q]: position q's next token
    loss = ce.mean() + w * torch.stack([ce[b, q] for b, q in answers]).mean()
    (want,) = torch.autograd.grad(loss, x)
    err, top = (seen["grad"].float() - want.float()).abs().max().item(), want.float().abs().max().item()
    assert err <= 1e-2 * top, (err, top)
