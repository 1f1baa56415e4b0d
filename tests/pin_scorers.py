"""Records the shipped scorers' pins, which tests/test_scorer_pins.py checks: for every scorer
folder under baby/scorers and codebaby/scorers, its priorities on a fixed short sequence (fp64)
and, for a code scorer, the held-out KL of two files at 0.125 as `bench.py quality --task code`
computes it (fp32, as it does), each beside the sha256 of its scorer.safetensors. Re-run it when
a scorer is retrained or a new one ships, and commit tests/scorer_pins.json with the scorer
(written to a temporary name, then renamed):

python -m tests.pin_scorers
"""

import functools
import glob
import hashlib
import json
import os

import torch

import kvpop
import qwen3
import tasks
from experiments import shifted  # noqa: F401 (registers kvpop-shifted, whose scorers ship)
from support import corpus, tokenizer

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
PINS = os.path.join(HERE, "tests", "scorer_pins.json")
# the fixed sequence: seeded random ids, long enough to fill a scorer's window and read past it
SEED = 0
LENGTH = dict(baby=64, codebaby=256)
# the code KL: bench.py quality --task code's files (torch's held-out source), budget, sinks
FILES, BUDGET, SINKS = 2, 0.125, 4


def shipped():  # every shipped scorer folder, relative to the repository, sorted
    found = glob.glob(os.path.join(HERE, "*baby", "scorers", "*", "*", "scorer.json"))
    return sorted(os.path.relpath(os.path.dirname(f), HERE) for f in found)


def model_of(folder):  # the model a shipped scorer belongs to: the folder it ships in
    return folder.split(os.sep)[0]


def digest(folder):  # the sha256 of the scorer's tensors
    with open(os.path.join(HERE, folder, "scorer.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@functools.cache
def model(name, dtype=torch.float64):  # a shipped model, frozen
    net = qwen3.Qwen3.from_pretrained(os.path.join(HERE, name), dtype=dtype)
    return net.requires_grad_(False)


def scorer(folder, dtype=torch.float64):  # a shipped scorer, by its definition (not fast.py)
    return kvpop.load_scorer(os.path.join(HERE, folder)).to(dtype)


@torch.no_grad()
def priorities(folder):
    """pi (L, H, T) the scorer gives the fixed sequence, every layer, from one dense pass of its
    model (with a[t], for a scorer that reads it)."""
    name, s = model_of(folder), scorer(folder)
    net = model(name)
    T = LENGTH[name]
    seed = torch.Generator().manual_seed(SEED)
    idx = torch.randint(0, net.config.vocab_size, (1, T), generator=seed)
    kv = kvpop.dense_targets(net, idx, s.window, received=s.received)[0]
    pos = torch.arange(T)
    # each layer's (k, v) and, for a scorer that reads it, a
    pis = [s(i, *kva[:2], pos, *kva[2:])[0] for i, kva in enumerate(kv)]
    return torch.stack(pis)


@functools.cache
def code_files():  # (2, 2048): bench.py quality --task code --n 2's held-out files
    tok = tokenizer.Tokenizer.from_pretrained(os.path.join(HERE, "codebaby"))
    return corpus.code_held_out(tok, "torch", corpus.CODE_LENGTH, FILES)


def files_digest():  # the held-out files' token ids, hashed: another torch's source is another pin
    ids = json.dumps(code_files().tolist())
    return hashlib.sha256(ids.encode()).hexdigest()


@functools.cache
@torch.no_grad()
def dense_logp():  # (2, 2048, V) full's log-probs of the held-out files, fp32
    net = model("codebaby", torch.float32)
    return tasks.evaluate(net, code_files(), "full", 1, online=False).log_softmax(-1)


@torch.no_grad()
def code_kl(folder):
    """KL(full || scorer) at BUDGET as bench.py quality --task code's kl (measures.file_metrics),
    in fp32 (the masked pass): per file the mean over the positions t >= S that predict a next
    token, then the mean over the files."""
    s, idx = scorer(folder, torch.float32), code_files()
    S = kvpop.budget_size(BUDGET, idx.shape[1], SINKS, s.window)[0]
    net, args = model("codebaby", torch.float32), (BUDGET, SINKS, s.window, False)
    lp = tasks.evaluate(net, idx, s, *args).log_softmax(-1)
    full = dense_logp()
    kl = (full.exp() * (full - lp)).sum(-1)  # (files, T)
    return kl[:, S:-1].mean(-1).mean().item()


def pin(folder):  # one folder's pins: digest, priorities (9 decimals), the code KL
    pis = [[[round(p, 9) for p in head] for head in layer] for layer in priorities(folder).tolist()]
    found = dict(digest=digest(folder), priorities=pis)
    if model_of(folder) == "codebaby":
        found |= dict(files=files_digest(), kl=code_kl(folder))
    return found


if __name__ == "__main__":
    torch.set_num_threads(1)
    pins = {}
    for folder in shipped():
        pins[folder] = pin(folder)
        print(folder, "kl", pins[folder].get("kl", "-"))
    # a folder a line; to a temporary name, then renamed
    lines = [f" {json.dumps(f)}: {json.dumps(p)}" for f, p in pins.items()]
    with open(PINS + ".tmp", "w") as f:
        f.write("{\n" + ",\n".join(lines) + "\n}\n")
    os.replace(PINS + ".tmp", PINS)
    print(f"{len(pins)} scorers pinned in {os.path.relpath(PINS, HERE)}")
