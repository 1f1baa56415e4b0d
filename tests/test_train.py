"""train.py: the training objectives against their definitions (the first step's loss, the fine-tune's KL and boundary
loss, the held-out line), learning rates, kill and resume, two processes (DDP, FSDP2), the fine-tuned checkpoint,
what its flags set."""

import copy
import json
import math
import os
import random
import re
import subprocess
import sys

import pytest
import safetensors.torch
import torch

import kvpop
import qwen3
import tasks
from support import baby_tasks

from tests.common import (
    HERE, MODEL_DIR, SHIPPED, baby, _k_simulate, _ref_boundary_loss, _ref_edges_loss, _ref_pass, run,
)


def test_finetune_loss_is_the_kl_to_the_teachers_top_k_under_eviction(baby):
    """train.finetune_loss's KL against KL(p_K || p) computed here: p_K the dense teacher's top-K
    probabilities, renormalised; p the student's softmax over the whole vocabulary, its logits from
    tasks.evaluate(online=False) under the scorer's eviction. A reversed KL or a student attending
    without eviction fails by far more than the tolerance (checked below)."""
    import train

    net, tok = baby
    idx = baby_tasks.task_batch(tok, 2, 128, random.Random("finetune"))[0]
    student = copy.deepcopy(net).train()
    with torch.no_grad():  # a student that differs from its teacher
        for p in student.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    scorer = kvpop.load_scorer(os.path.join(SHIPPED, "kvpop")).requires_grad_(True)
    budget, sinks, window, K = 0.5, 4, 32, 256
    B, pool = kvpop.budget_size(budget, 128, sinks, window, kvpop.state_charge(scorer, torch.float32))
    kl = train.finetune_loss(
        student, net, scorer, idx, [torch.arange(sinks + window + pool, 128)], [kvpop.Budget(sinks, window, pool)], K, "mean"
    )[0]
    with torch.no_grad():
        top = net(idx).float().topk(K, -1)
        p_K = top.values.softmax(-1)  # (B, T, K)
        lp = {
            pol: tasks.evaluate(student, idx, pol, budget, sinks, window, online=False).float().log_softmax(-1)
            for pol in (scorer, "full")
        }
        ref, no_eviction = (
            (p_K * (p_K.log() - lp[x].gather(-1, top.indices))).sum(-1).mean().item() for x in (scorer, "full")
        )
        q_K = lp[scorer].gather(-1, top.indices).exp()
        reversed_kl = (q_K * (q_K.log() - p_K.log())).sum(-1).mean().item()
    assert abs(kl - ref) <= 1e-5 * ref, (kl, ref)
    # the test tells them apart
    assert min(abs(ref - no_eviction), abs(ref - reversed_kl)) > 100 * 1e-5 * ref
    # the step's backward ran
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)


def _recorded_rates(tmp_path, *args):
    """Run train.py as __main__ in a child process whose AdamW records, at every step, each
    optimizer's learning rate, named by what it trains -> {'scorer': [...], 'model': [...]}."""
    drive = tmp_path / "drive.py"
    drive.write_text(
        "import json, runpy, sys\nimport torch\n"
        "seen = {}\n"
        "step = torch.optim.AdamW.step\n"
        "def record(self, *a, **kw):\n"
        "    n = sum(p.numel() for g in self.param_groups for p in g['params'])\n"
        "    seen.setdefault('model' if n > 100_000 else 'scorer', []).append(self.param_groups[0]['lr'])\n"
        "    return step(self, *a, **kw)\n"
        "torch.optim.AdamW.step = record\n"
        f"sys.argv = {list(map(str, args))!r}\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
        f"open({str(tmp_path / 'rates.json')!r}, 'w').write(json.dumps(seen))\n"
    )
    env = dict(os.environ, PYTHONPATH=HERE)  # the repository's modules, for the script in tmp_path
    r = subprocess.run([sys.executable, str(drive)], cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((tmp_path / "rates.json").read_text())


def test_learning_rates_follow_warmup_then_cosine(tmp_path):
    """Every step's learning rates against the closed form (README, Method: fine-tune): the scorer's
    lr(it) = min_lr + (lr - min_lr) min(1, (it + 1) / warmup) (1 + cos(pi it / max_iters)) / 2, the
    model's lr(it) model_lr / lr. A constant rate, a schedule without warmup or the model at the
    scorer's rate fails."""
    n, lr, min_lr, warmup, model_lr = 12, 3e-3, 3e-4, 4, 8e-5
    rates = _recorded_rates(
        tmp_path,
        *_train_args(
            tmp_path / "o",
            "--finetune",
            "--max_iters",
            n,
            "--warmup",
            warmup,
            "--eval_interval",
            n,
            "--lr",
            lr,
            "--min_lr",
            min_lr,
            "--model_lr",
            model_lr,
        ),
    )
    want = [
        min_lr + (lr - min_lr) * min(1, (it + 1) / warmup) * (1 + math.cos(math.pi * it / n)) / 2 for it in range(n)
    ]
    assert len(rates["scorer"]) == len(rates["model"]) == n
    assert all(abs(a - b) <= 1e-12 for a, b in zip(rates["scorer"], want)), (rates["scorer"], want)
    assert all(abs(a - b * model_lr / lr) <= 1e-14 for a, b in zip(rates["model"], want)), rates["model"]


def _train_args(out, *extra):
    return (
        "train.py",
        "--out_dir",
        str(out),
        "--batch_size",
        "2",
        "--seq_len",
        "128",
        "--max_iters",
        "6",
        "--log_interval",
        "1",
        "--eval_interval",
        "3",
        "--eval_seqs",
        "2",
        "--final_seqs",
        "0",
        "--window",
        "16",
        "--budget",
        "0.375",
        *extra,
    )


def _losses(text):
    return [line.rsplit(",", 1)[0] for line in text.splitlines() if line.startswith("step") and "loss" in line]


def test_train_killed_then_resumed_reproduces_the_loss_curve(tmp_path):
    ref = run(*_train_args(tmp_path / "a"))
    assert ref.returncode == 0, ref.stderr
    assert len(_losses(ref.stdout)) == 6 and "saved" in ref.stdout
    # the same run, killed (SIGKILL) as soon as its step-3 checkpoint is written
    p = subprocess.Popen([sys.executable, *_train_args(tmp_path / "b")], cwd=HERE, stdout=subprocess.PIPE, text=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith("step 3:") and "saved" in line:
            p.kill()
            break
    p.wait()
    assert p.returncode == -9 and len(_losses("".join(seen))) == 3
    s = kvpop.load_scorer(tmp_path / "b")  # what the killed run left loads
    assert s.meta["iters"] == 3
    res = run(*_train_args(tmp_path / "b", "--resume"))
    assert res.returncode == 0, res.stderr
    assert _losses(res.stdout) == _losses(ref.stdout)[3:]  # the same numbers, printed to 6 decimals


def _held_out_keep_drop_accuracy(net, tok, scorer, budget, target, T=512, sinks=4, window=32):
    """The definition's balanced keep/drop accuracy of a scorer, per layer, on 4 of the benchmark's
    held-out sequences (the teacher: the frozen model's future attention, `target` over the queries;
    the labels: _ref_boundary_loss's step-by-step pool)."""
    idx = baby_tasks.task_batch(tok, 4, T, random.Random("test-0"))[0]
    kv, r = kvpop.dense_targets(net, idx, window, target)
    pool, gamma = (
        kvpop.budget_size(budget, T, sinks, window, kvpop.state_charge(scorer, torch.float32))[1],
        scorer.theta.detach(),
    )
    with torch.no_grad():
        pi = [scorer(i, k, v, torch.arange(T)) for i, (k, v) in enumerate(kv)]
    return [
        _ref_boundary_loss(p[None], x[None], torch.nn.functional.softplus(gamma[i : i + 1]), sinks, window, pool)[1]
        for i, (p, x) in enumerate(zip(pi, r))
    ]


def test_training_learns_the_teachers_decisions(tmp_path, baby):
    """40 scorer steps on the frozen baby lift the held-out keep/drop accuracy (0.5 = chance) of the
    layer that retrieves (layer 1) from the untrained scorer's to well above chance, and the shipped
    scorers' are there too; a flipped loss sign learns the opposite. (Layer 0 only reads the
    previous token: its target is flat, within 1 nat of log(eps), and its decisions are close to
    arbitrary, so it is not asserted.)"""
    net, tok = baby
    r = run(
        "train.py",
        "--out_dir",
        str(tmp_path),
        "--max_iters",
        "40",
        "--batch_size",
        "4",
        "--warmup",
        "5",
        "--final_seqs",
        "0",
        "--eval_interval",
        "40",
        "--eval_seqs",
        "4",
    )
    assert r.returncode == 0, r.stderr
    # train.py's initialisation at --seed 0 (its defaults: kvpop-window, the helpful target)
    torch.manual_seed(0)
    init = kvpop.SCORERS["kvpop-window"](net.config, 32, d_hidden=64)
    before = _held_out_keep_drop_accuracy(net, tok, init, 0.125, "helpful")[1]
    after = _held_out_keep_drop_accuracy(net, tok, kvpop.load_scorer(tmp_path), 0.125, "helpful")[1]
    assert after >= 0.75 and after >= before + 0.2, (before, after)
    # trained by python train.py at budget 0.125: 0.874, 0.843, 0.856 on the whole-sequence baby,
    # whose layer 1 also predicts every filler (0.914, 0.906, 0.877 on the answers-only one; LOG.md)
    for kind in kvpop.SCORERS:
        shipped = kvpop.load_scorer(os.path.join(SHIPPED, kind))
        assert _held_out_keep_drop_accuracy(net, tok, shipped, 0.125, "helpful")[1] >= 0.8, kind


@pytest.mark.parametrize("task, target", [("recall", "mean"), ("recall", "max"), ("cue", "helpful")])
def test_train_first_step_loss_is_the_definitions(tmp_path, baby, task, target):
    """The loss train.py prints at step 1 (the untrained scorer at --seed 0, that step's sequences
    of --task) equals the definition's boundary loss against the frozen model's --target future
    attention: an ignored --task or
    --target, or a teacher built from another pass, fails."""
    net, tok = baby
    r = run(
        "train.py",
        "--out_dir",
        str(tmp_path),
        "--task",
        task,
        "--target",
        target,
        "--max_iters",
        "1",
        "--batch_size",
        "2",
        "--seq_len",
        "128",
        "--window",
        "16",
        "--budget",
        "0.375",
        "--final_seqs",
        "0",
        "--eval_seqs",
        "1",
    )
    assert r.returncode == 0, r.stderr
    printed = float(re.search(r"step 1: loss (\d+\.\d+)", r.stdout).group(1))
    torch.manual_seed(0)
    s = kvpop.SCORERS["kvpop-window"](net.config, 16, d_hidden=64)
    # cue: train.py draws each sequence's distractor rate from its default range, 0.05-0.35
    rates = dict(p_cue=(0.05, 0.35)) if task == "cue" else {}
    idx = baby_tasks.task_batch(tok, 2, 128, random.Random("scorer-train-0-0"), **baby_tasks.TASKS[task] | rates)[0]
    kv, rs = kvpop.dense_targets(net, idx, 16, target)
    pool = kvpop.budget_size(0.375, 128, 4, 16)[1]
    with torch.no_grad():
        pi = torch.stack([s(i, k, v, torch.arange(128)) for i, (k, v) in enumerate(kv)])
    ref = _ref_edges_loss(pi, torch.stack(rs), torch.nn.functional.softplus(s.theta), 4, 16, pool)[0].item()
    assert abs(printed - ref) <= 2e-6, (printed, ref)


def _ft_args(out, *extra):
    return (*_train_args(out, *extra), "--batch_size", "4")


def _curve(text):  # the loss numbers of the step lines (not the tokens/s)
    return [float(x) for line in _losses(text) for x in re.findall(r"\d+\.\d{6}", line)]


# PYTHONFAULTHANDLER: a worker killed by a signal prints where its Python code was
def _torchrun(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args],
        capture_output=True,
        text=True,
        cwd=HERE,
        timeout=600,
        env=os.environ | dict(PYTHONFAULTHANDLER="1"),
        **kw,
    )


WHY = re.compile(r"rror|xception|terminate|what\(\)|Fatal|File |line \d|corrupt|free\(|OMP:|[Aa]bort")


# a failed torchrun: its workers' error lines first (its summary alone can fill a report), then its
# tail
def _why(p):
    return "\n".join([s for s in p.stderr.splitlines() if WHY.search(s)][:60]) + "\n[...]\n" + p.stderr[-1500:]


@pytest.mark.parametrize("mode", ["scorer", "finetune"])
def test_two_processes_give_the_one_process_loss_curve(tmp_path, mode):
    """torchrun, 2 CPU processes (gloo), half the global batch each: DDP (scorer) or FSDP2
    (--finetune) give the one-process loss curve to 1e-5 relative (the sums over processes add in
    another order: not bit-equal)."""
    extra = ("--finetune",) if mode == "finetune" else ()
    one = run(*_ft_args(tmp_path / "one", *extra))
    two = _torchrun(*_ft_args(tmp_path / "two", *extra))
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, _why(two)
    a, b = _curve(one.stdout), _curve(two.stdout)
    assert len(a) == len(b) == 6 * (3 if extra else 1) and "2 process(es)" in two.stdout
    assert all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for x, y in zip(a, b)), (a, b)
    # rank 0
    assert two.stdout.count("saved") == 2 and "step 1:" in two.stdout and two.stdout.count("step 1:") == 1


# SIGKILL to torchrun and every process under it (its workers are not in its group)
def _kill_tree(pid):
    kids = {}
    for d in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{d}/stat").read()
            kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d))
        except (OSError, ValueError, IndexError):
            pass
    todo, tree = [pid], []
    while todo:
        tree.append(todo.pop())
        todo += kids.get(tree[-1], [])
    for p in tree:
        os.kill(p, 9)


def test_distributed_finetune_killed_then_resumed(tmp_path):
    """A 2-process --finetune run killed (SIGKILL to every process) after a checkpoint resumes where
    it stopped: the steps after its last checkpoint print the uninterrupted run's losses, and what
    it left is a model Qwen3 loads. (Checkpoints every step: the processes may run on a little
    before the kill lands.) One sequence a process a step, 8 steps."""
    args = ("--finetune", "--eval_interval", "1", "--max_iters", "8")
    ref = _torchrun(*_train_args(tmp_path / "a", *args))
    assert ref.returncode == 0, _why(ref)
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            *_train_args(tmp_path / "b", *args),
        ],
        cwd=HERE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    for line in p.stdout:
        if line.startswith("step 3:") and "saved" in line:
            _kill_tree(p.pid)
            break
    p.wait()
    n = kvpop.load_scorer(tmp_path / "b").meta["iters"]
    assert 3 <= n < 8 and torch.load(tmp_path / "b" / "train_state.pt", weights_only=True)["iter"] == n
    qwen3.Qwen3.from_pretrained(tmp_path / "b")  # what the killed run left loads
    res = _torchrun(*_train_args(tmp_path / "b", *args, "--resume"))
    assert res.returncode == 0, _why(res)
    assert f"resuming {tmp_path / 'b'} at step {n}" in res.stdout
    a, b = _curve(ref.stdout)[3 * n :], _curve(res.stdout)
    assert len(a) == len(b) == 3 * (8 - n) and all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for x, y in zip(a, b))


def test_finetuned_checkpoint_loads_and_samples(tmp_path):
    """--finetune writes a normal checkpoint folder (changed weights, the scorer beside it) and
    StreamingLLM+ one without a scorer; Qwen3.from_pretrained loads both and sample.py samples from
    them under their eviction."""
    for policy in ("scorer", "streaming"):
        out = tmp_path / policy
        r = run(*_train_args(out, "--finetune", "--policy", policy, "--max_iters", "2", "--eval_interval", "2"))
        assert r.returncode == 0, r.stderr
        ft, base = qwen3.Qwen3.from_pretrained(out), qwen3.Qwen3.from_pretrained(MODEL_DIR)
        diff = [(a - b).abs().max().item() for a, b in zip(ft.parameters(), base.parameters())]
        assert max(diff) > 0 and (out / "scorer.json").exists() == (policy == "scorer")
        args = [
            "--model",
            str(out),
            "--prompt",
            "FILE:baby/prompt.txt",
            "--max_new_tokens",
            "8",
            "--window",
            "16",
            "--budget",
            "0.25",
            "--temperature",
            "0",
        ]
        # a scorer names its kind
        args += ["--scorer", str(out)] if policy == "scorer" else ["--policy", "streaming"]
        s = run("sample.py", *args)
        assert s.returncode == 0 and "tokens/s" in s.stdout, s.stderr
        assert f"policy {'kvpop' if policy == 'scorer' else 'streaming'}" in s.stdout


# ----------------------------------------------------------------------------------------------------------
# tests for what an audit broke on purpose


def _ref_future_target(q, k, lse, window, reduce, P=None):
    """r*[h, t] from its definition (README, Method: future attention), materialised in fp64: p[d, t] = exp(q_d .
    k_t / sqrt(D) - lse[d]) with lse the pass's own normaliser; A[t] the mean (or max) over d >= t + w of p[d, t],
    helpful: the max of P[d] p[d, t] (P (B, T)); r* = max over h's query heads of log(1e-6 + A); -inf where t + w >=
    T. -> (B, Hkv, T) fp64."""
    (B, Hq, T, D), H = q.shape, k.shape[1]
    s = q.double() @ k.double().repeat_interleave(Hq // H, 1).mT / math.sqrt(D)
    p = (s - lse.double()[..., None]).exp()  # (B, Hq, T queries, T keys)
    if P is not None:
        p = p * P.double()[:, None, :, None]
    d, t = torch.arange(T)[:, None], torch.arange(T)[None, :]
    p = p * (d >= t + window)
    A = p.sum(-2) / (T - window - torch.arange(T)).clamp(min=1) if reduce == "mean" else p.amax(-2)
    r = torch.log(1e-6 + A).view(B, H, Hq // H, T).amax(2)
    r[..., T - window :] = -math.inf
    return r


def _next_token_p(logits, idx):  # P[d] = P(idx[d + 1] | idx[..d]) from logits, 0 at the last position
    P = logits.double().softmax(-1)[:, :-1].gather(-1, idx[:, 1:, None])[..., 0]
    return torch.cat([P, P.new_zeros(len(idx), 1)], 1)


def test_finetune_boundary_loss_is_on_the_dense_teachers_helpful_target(baby):
    """train.finetune_loss's boundary loss (--target helpful) against _ref_boundary_loss made here from the
    definition (README, Method: fine-tune): the scorer's priorities on the student's keys and values under its own
    eviction (_k_simulate, fp64 softmax over what stays visible), the target the dense teacher's future attention,
    each query's attention weighted by P(next token) from the dense teacher."""
    import train

    net, tok = baby
    T, sinks, window, budget = 128, 4, 16, 0.375
    idx = baby_tasks.task_batch(tok, 2, T, random.Random("finetune-target"))[0]
    student = copy.deepcopy(net).train()
    with torch.no_grad():  # a student that differs from its teacher
        for p in student.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    torch.manual_seed(4)
    scorer = kvpop.SCORERS["kvpop-window"](net.config, window, d_hidden=16)
    pool = kvpop.budget_size(budget, T, sinks, window)[1]
    qpos = torch.arange(sinks + window + pool, T)
    _, loss, _ = train.finetune_loss(student, net, scorer, idx, [qpos], [kvpop.Budget(sinks, window, pool)], 256, "helpful")
    d, t = torch.arange(T)[:, None], torch.arange(T)[None, :]

    def visible(i, k, v):  # the student's eviction: the scorer's priorities, the online pool simulated
        with torch.no_grad():
            e = _k_simulate(scorer(i, k, v, torch.arange(T)), sinks, window, pool)
        return (t <= d) & ((t < sinks) | (d < e[..., None, :]))

    _, seen = _ref_pass(student, idx, visible)  # the student's keys and values under its eviction
    _, dense = _ref_pass(net, idx, lambda i, k, v: (t <= d).expand(len(idx), k.shape[1], T, T))  # the teacher's
    with torch.no_grad():
        P = _next_token_p(net(idx), idx)  # the dense teacher's
        pi = torch.stack([scorer(i, k, v, torch.arange(T)) for i, (_, k, v, _) in enumerate(seen)])
    targets = lambda P, run: torch.stack([_ref_future_target(q, k, lse, window, "max", P) for q, k, _, lse in run])
    gamma = torch.nn.functional.softplus(scorer.theta.detach())
    ref = _ref_boundary_loss(pi, targets(P, dense).float(), gamma, sinks, window, pool)[0].item()
    # the test tells P from 1 / P (a wrong sign of log P), and the teacher's pass from the student's evicting one
    inv = _ref_boundary_loss(pi, targets(1 / P.clamp(min=1e-30), dense).float(), gamma, sinks, window, pool)[0].item()
    own = _ref_boundary_loss(pi, targets(P, seen).float(), gamma, sinks, window, pool)[0].item()
    assert abs(loss - ref) <= 1e-5 * max(1.0, ref), (loss, ref, inv, own)
    assert abs(inv - ref) > 1e-3 and abs(own - ref) > 1e-3, (inv, own, ref)


def test_train_on_text_holds_out_the_boundary_loss_of_its_target(tmp_path, baby):
    """train.py --data FOLDER --target max, one step: the held-out line's boundary loss and keep/drop accuracy equal
    _ref_boundary_loss of the saved scorer on the last packed sequence, its teacher the frozen model's max future
    attention made here from a dense fp64 pass (README, Method: future attention, boundary loss)."""
    net, tok = baby
    rng = random.Random(3)
    text = " ".join(rng.choice(baby_tasks.KEYS + baby_tasks.VALUES + baby_tasks.FILLERS) for _ in range(700))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text(text)
    T, sinks, window, budget = 128, 4, 16, 0.375
    r = run(
        "train.py", "--out_dir", str(tmp_path / "o"), "--data", str(tmp_path / "texts"), "--target", "max",
        "--max_iters", "1", "--batch_size", "2", "--seq_len", str(T), "--window", str(window),
        "--budget", str(budget), "--eval_seqs", "1", "--d_hidden", "16",
    )
    assert r.returncode == 0, r.stderr
    loss, acc = map(float, re.search(r"held-out boundary loss (\S+), keep/drop accuracy (\d\.\d+)", r.stdout).groups())
    ids = tok.encode(text) + [tok.special["<|endoftext|>"]]
    n = len(ids) // T
    held = torch.tensor(ids[(n - 1) * T : n * T])[None]  # --eval_seqs 1: the last packed sequence is held out
    scorer = kvpop.load_scorer(tmp_path / "o")
    d, t = torch.arange(T)[:, None], torch.arange(T)[None, :]
    _, seen = _ref_pass(net, held, lambda i, k, v: (t <= d).expand(len(held), k.shape[1], T, T))
    with torch.no_grad():
        pi = torch.stack([scorer(i, k, v, torch.arange(T)) for i, (_, k, v, _) in enumerate(seen)])
    gamma, pool = torch.nn.functional.softplus(scorer.theta.detach()), kvpop.budget_size(budget, T, sinks, window)[1]
    ref = {
        reduce: _ref_edges_loss(
            pi, torch.stack([_ref_future_target(q, k, lse, window, reduce) for q, k, _, lse in seen]).float(),
            gamma, sinks, window, pool,
        )
        for reduce in ("max", "mean")
    }
    ref = {reduce: (x.item(), a) for reduce, (x, a) in ref.items()}
    assert abs(loss - ref["max"][0]) <= 1e-4 and abs(acc - ref["max"][1]) <= 1e-3, (loss, acc, ref)
    # the test tells the targets apart
    assert abs(ref["max"][0] - ref["mean"][0]) > 1e-3, ref


# ---------------------------------------------------------------------------------------------------------
# the mutation audit: each test below fails on a break the rest of the suite let pass (named in its docstring)


def _train_globals(monkeypatch, *args):
    """train.py run as __main__ with these flags, stopped once its flag checks pass (where it sets the threads) ->
    its module globals then (the flags as the run would use them)."""
    import runpy

    class Checked(Exception):
        pass

    def stop(n):
        raise Checked(sys._getframe(1).f_globals)

    monkeypatch.chdir(HERE)
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    monkeypatch.setattr(torch, "set_num_threads", stop)
    with pytest.raises(Checked) as e:
        runpy.run_path(os.path.join(HERE, "train.py"), run_name="__main__")
    return e.value.args[0]


def test_audit_edges_sets_the_number_of_pools(monkeypatch):
    """--edges: the boundary loss's pools are the budget's, then each half the last, --edges in all (README, Method:
    boundary loss); on the baby at the defaults S = 0.125 x 512 = 64 = 4 sinks + 32 window + 28 pool (kvpop-window
    has no state). Break: range(edges) written range(3)."""
    import train

    monkeypatch.chdir(HERE)
    for edges, want in [(1, [28]), (2, [28, 14]), (5, [28, 14, 7, 3, 1]), (7, [28, 14, 7, 3, 1])]:
        monkeypatch.setattr(train, "edges", edges)
        assert [budget.pool for budget in train.load()[6]] == want, edges


def test_audit_model_lr_defaults(monkeypatch):
    """--model_lr -1 (the default): the baby's fine-tune at 1e-5, a real checkpoint's at the paper's 8e-5; a rate given
    is kept. Break: the two defaults swapped."""
    assert _train_globals(monkeypatch, "--finetune")["model_lr"] == 1e-5
    assert _train_globals(monkeypatch, "--finetune", "--model", "Qwen/Qwen3-0.6B")["model_lr"] == 8e-5
    assert _train_globals(monkeypatch, "--finetune", "--model_lr", "3e-4")["model_lr"] == 3e-4
    # --task code's model (codebaby, from its default) at the rate it has when spelled out (issue: 1e-5 before)
    code = _train_globals(monkeypatch, "--task", "code", "--finetune")
    assert code["model"] == "codebaby" and code["model_lr"] == 8e-5
    assert _train_globals(monkeypatch, "--task", "code", "--model", "codebaby", "--finetune")["model_lr"] == 8e-5


def test_audit_arrival_reaches_the_scorer(monkeypatch):
    """--kind kvpop --arrival (the delay ablation): token t is read on arrival, from the memory of tokens 0..t, so
    changing the tokens after t leaves its priority alone; the delayed scorer (the default) reads t at t + w - 1 and
    sees them. Break: arrival not passed to the scorer's constructor."""
    import train

    monkeypatch.chdir(HERE)
    monkeypatch.setattr(train, "kind", "kvpop")
    T, t = 64, 20
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 1, T, 64, generator=g), torch.randn(1, 1, T, 64, generator=g)  # the baby's head_dim
    k2, v2 = k.clone(), v.clone()
    k2[..., t + 1 :, :], v2[..., t + 1 :, :] = torch.randn(2, T - t - 1, 64, generator=g)
    for arrival in (True, False):
        monkeypatch.setattr(train, "arrival", arrival)
        scorer = train.load()[5]
        with torch.no_grad():
            a, b = (scorer(1, x, y, torch.arange(T))[..., : t + 1] for x, y in ((k, v), (k2, v2)))
        assert torch.equal(a, b) == arrival, arrival


def test_audit_init_from_starts_from_that_scorer(monkeypatch):
    """--init_from: training starts from the trained scorer in that folder, its weights as stored in its
    scorer.safetensors (read here with safetensors, not the scorer's loader), not a fresh one at --seed. Break:
    `if learned and (resume or init_from)` written `if learned and resume`."""
    import train

    monkeypatch.chdir(HERE)
    folder = os.path.join(SHIPPED, "kvpop-window")
    monkeypatch.setattr(train, "init_from", folder)
    got = train.load()[5].state_dict()
    stored = safetensors.torch.load_file(os.path.join(folder, "scorer.safetensors"))
    assert set(stored) <= set(got)
    assert all(torch.equal(got[name].float(), stored[name].float()) for name in stored)


def test_audit_log_line_is_the_intervals_mean(monkeypatch, tmp_path, capsys):
    """The step lines print the mean over the interval's steps so far (the first: the first step alone): with the
    per-step (loss, accuracy) set to (1, .5), (2, .25), (6, 1), (3, 0), (3, 0), (9, .5) and --log_interval 3, step 1
    prints 1, step 3 (1 + 2 + 6) / 3 = 3, step 6 (3 + 3 + 9) / 3 = 5. Break: the mean replaced by the last step."""
    import train

    steps = iter([(1.0, 0.5), (2.0, 0.25), (6.0, 1.0), (3.0, 0.0), (3.0, 0.0), (9.0, 0.5)])
    monkeypatch.chdir(HERE)
    settings = dict(max_iters=6, log_interval=3, eval_interval=6, final_seqs=0, batch_size=1, seq_len=128, window=16)
    for name, value in (settings | dict(budget=0.375, out_dir=str(tmp_path))).items():
        monkeypatch.setattr(train, name, value)
    monkeypatch.setattr(train.fast, "dense_targets", lambda *a: (None, None))
    monkeypatch.setattr(train, "scorer_loss", lambda *a: next(steps))
    monkeypatch.setattr(train, "held_out", lambda *a: "")
    train.train()
    lines = [line for line in capsys.readouterr().out.splitlines() if "accuracy" in line]
    found = [re.search(r"step (\d+): loss ([\d.]+), keep/drop accuracy ([\d.]+)", line).groups() for line in lines]
    assert found == [("1", "1.000000", "0.500"), ("3", "3.000000", "0.583"), ("6", "5.000000", "0.167")], lines


CODE_SCORER = os.path.join(HERE, "codebaby", "scorers", "code-max", "kvpop-window")  # the shipped default on code


def test_code_presets_are_the_shipped_scorers(tmp_path):
    """train.py --task code's presets (length, window, target, a[t] read) are those the shipped default code scorer
    was trained with: one step writes a scorer.json whose settings equal it but for the steps; --model is kept when
    given; bench.py quality --task code runs at the same window and length (its title says so)."""
    shipped = json.load(open(os.path.join(CODE_SCORER, "scorer.json")))
    run = lambda *a: subprocess.run([sys.executable, *a], capture_output=True, text=True, cwd=HERE, timeout=600)
    flags = "--task code --batch_size 1 --max_iters 1 --eval_interval 1 --eval_seqs 2".split()
    r = run("train.py", *flags, "--out_dir", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr
    got = json.load(open(tmp_path / "a" / "scorer.json"))
    for d in (got, shipped):
        d["trained"].pop("iters")
    assert got == shipped
    r = run("train.py", *flags, "--model", "baby", "--out_dir", str(tmp_path / "b"))
    assert r.returncode == 0 and json.load(open(tmp_path / "b" / "scorer.json"))["trained"]["model"] == "baby"
    r = run("bench.py", "quality", "--task", "code", "--n", "2", "--policies", "full", "--budgets", "0.25", "--scorer", "")
    window, length = shipped["window"], shipped["trained"]["seq_len"]
    assert r.returncode == 0 and f"the first {length} tokens" in r.stdout and f"window {window}\n" in r.stdout


def test_audit_plain_trains_the_definition(monkeypatch):
    """train.py --plain: load() never puts the scorer on fast.py's forms (fast.speed_up), without it it does;
    and the script sets kernels.PLAIN from --plain before it trains. Breaks: `plain or` dropped from load's choice;
    kernels.PLAIN = plain written kernels.PLAIN = False."""
    import fast
    import kernels
    import train

    monkeypatch.chdir(HERE)
    monkeypatch.setattr(kernels, "PLAIN", False)  # restored after
    sped = []
    monkeypatch.setattr(fast, "speed_up", lambda s: sped.append(s) or s)
    monkeypatch.setattr(train, "plain", True)
    assert train.load()[5] is not None and sped == []
    monkeypatch.setattr(train, "plain", False)
    assert train.load()[5] is sped[0]
    # the script: stopped where it starts its processes, after setting kernels.PLAIN
    import runpy

    class Started(Exception):
        pass

    def start(device):
        raise Started(kernels.PLAIN)

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr("support.processes.start", start)
    for flag in (True, False):
        monkeypatch.setattr(sys, "argv", ["train.py", *(["--plain"] if flag else [])])
        with pytest.raises(Started) as e:
            runpy.run_path(os.path.join(HERE, "train.py"), run_name="__main__")
        assert e.value.args[0] is flag
