"""Text corpora. The code corpus: real text nobody here wrote, the installed torch package's own source (or any folder
of .py/.txt files), read at run time, never copied into the repository (train.py --task code, bench.py quality --task
code, pretrain.py --data). A file is held out by the hash of its path under the folder: the split never moves. Last,
train.py --data's text files, packed. tools/measures.py: the metrics of eviction on code.
"""

import contextlib
import glob
import hashlib
import json
import os

import torch

HELD_OUT = 10  # one file in about this many is held out: sha256 of its relative path = 0 mod HELD_OUT
# code's presets (train.py --task code, bench.py quality --task code, sample.py --model codebaby): the length, and the
# window the shipped scorer was trained with (a delayed scorer runs at its own window; LOG.md: the window per budget)
CODE_LENGTH = 2048
CODE_WINDOW = 192


def corpus_root(corpus):  # torch: the installed package's folder; else the folder named
    return os.path.dirname(torch.__file__) if corpus == "torch" else corpus


def digest(path):  # a relative path's sha256, an integer
    return int(hashlib.sha256(path.encode()).hexdigest(), 16)


def held_out(path):  # a relative path -> whether its file is held out
    return digest(path) % HELD_OUT == 0


def code_files(corpus):
    """The corpus's .py/.txt files -> (training, held-out) paths relative to its folder, each list sorted."""
    root = corpus_root(corpus)
    paths = []
    for folder, _, names in os.walk(root):
        found = [os.path.join(folder, f) for f in names if f.endswith((".py", ".txt"))]
        paths += [os.path.relpath(f, root) for f in found]
    if not paths:
        where = "no folder" if not os.path.isdir(root) else "no .py/.txt files in"
        raise FileNotFoundError(f"corpus {corpus!r}: {where} {root}; give torch or a folder of .py/.txt files")
    paths.sort()
    return [p for p in paths if not held_out(p)], [p for p in paths if held_out(p)]


def code_tokens(tok, corpus, paths):  # each file's token ids, <|endoftext|> first: a list of lists
    root, bos = corpus_root(corpus), tok.special["<|endoftext|>"]
    ids = []
    for p in paths:
        with open(os.path.join(root, p), encoding="utf-8", errors="replace") as f:
            ids.append([bos] + tok.encode(f.read()))
    return ids


def code_sequences(tok, corpus, T):
    """The training files, in path order, packed into sequences -> (n, T); at least 2 of them, or ValueError."""
    train = code_files(corpus)[0]
    ids = [t for f in code_tokens(tok, corpus, train) for t in f]
    n = len(ids) // T
    if n < 2:
        what = f"{len(train)} training files hold {len(ids)} tokens"
        raise ValueError(f"corpus {corpus!r}: {what}; need at least 2 x {T}, add files or lower the length")
    return torch.tensor(ids[: n * T]).view(n, T)


def code_held_out(tok, corpus, T, n):
    """The first T tokens of each held-out file that has T, at most n files in the order of their paths' hashes (a
    fixed draw across folders) -> (files, T); at least 2 files (an interval needs two), or ValueError."""
    held = sorted(code_files(corpus)[1], key=digest)
    ids = [f[:T] for f in code_tokens(tok, corpus, held) if len(f) >= T][:n]
    if len(ids) < 2:
        what = f"{len(ids)} of its {len(held)} held-out files have {T} tokens"
        raise ValueError(f"corpus {corpus!r}: {what}; need 2, add files or lower the length")
    return torch.tensor(ids)


def pack_files(tok, data, seq_len, held):
    """train.py --data's .txt/.jsonl files (a folder: the files under it; a .jsonl line: its "text", if a JSON object
    with one) packed into sequences (n, seq_len) -> (the training ones, the held-out ones: the last, at most `held`)."""
    found = []
    for p in glob.glob(os.path.expanduser(data)):
        found += glob.glob(os.path.join(p, "**", "*"), recursive=True) if os.path.isdir(p) else [p]
    files = sorted(f for f in found if f.endswith((".txt", ".jsonl")) and os.path.isfile(f))
    ids = []
    for f in files:
        jsonl = f.endswith(".jsonl")
        with open(f, encoding="utf-8", errors="replace") as fh:
            for line in fh if jsonl else [fh.read()]:
                text = ""
                with contextlib.suppress(ValueError, AttributeError):
                    text = json.loads(line).get("text", "") if jsonl else line
                if isinstance(text, str) and text.strip():
                    ids += tok.encode(text) + [tok.special["<|endoftext|>"]]
    n = len(ids) // seq_len
    what = f"{len(files)} .txt/.jsonl files with {len(ids)} tokens of text"
    if n < 2:
        raise ValueError(f"--data {data}: {what}; need at least 2 x --seq_len ({2 * seq_len}) tokens")
    seqs = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
    n_valid = max(1, min(held, n // 10))
    return seqs[:-n_valid], seqs[-n_valid:]
