"""Checkpoint files: config.json (checked), the Hugging Face cache and download, safetensors. A bad file is a one-line
ValueError naming it; a download is never half-written.
"""

import ctypes
import json
import math
import os
import types
import urllib.error
import urllib.request
from dataclasses import fields
from pathlib import Path

import torch
from tqdm import tqdm

from support.flags import TYPES


# config, shard index and tokenizer files: a bad one is a one-line error naming it
def read_json(path):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {path}: {error}") from None


def write_json(data, path):
    """To a temporary name, then renamed: never half-written."""
    Path(path + ".tmp").write_text(json.dumps(data, indent=1))
    os.replace(path + ".tmp", path)


# a checkpoint's torch_dtype, sample.py's --dtype
DTYPES = ("float32", "bfloat16", "float16", "float64")
# the fields a config.json must have; the rest have defaults (head_dim: hidden_size / heads)
CONFIG_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
CONFIG_REQUIRED += ("num_attention_heads", "num_key_value_heads")


def read_config(path, cls):
    """Read and check a config.json before any tensor is read -> cls (qwen3.Qwen3Config): a field that is missing, of
    the wrong kind or out of range is a one-line ValueError naming the file and the field, never a different model."""
    config = read_json(path)

    def need(ok, msg):
        if not ok:
            raise ValueError(f"{path}: {msg}")

    kinds = {list: "an array", str: "a string", bool: "true/false", type(None): "null"}
    what = kinds.get(type(config), "a number")
    need(type(config) is dict, f"must be a JSON object of model settings, not {what}")
    # null = absent, as transformers reads it
    config = {k: value for k, value in config.items() if value is not None}
    # transformers 5 moves rope_theta into rope_parameters and writes "dtype"
    rope = config.get("rope_parameters", {})
    dt = "torch_dtype" if "torch_dtype" in config else "dtype"
    need(type(rope) is dict, "rope_parameters must be an object")
    # defaults as transformers reads them
    theta = rope.get("rope_theta", cls.rope_theta)
    config = dict(torch_dtype=config.get("dtype", "bfloat16"), rope_theta=theta, tie_word_embeddings=False) | config
    scaled = rope.get("rope_type", "default") != "default" or config.get("rope_scaling")
    need(not scaled, "only default RoPE is supported (found rope scaling)")
    act = config.get("hidden_act", "silu")
    need(act == "silu", f"hidden_act {act!r}: Qwen3 uses silu")
    sliding = "sliding-window attention is not supported"
    need(not config.get("use_sliding_window"), f"use_sliding_window: {sliding}")
    for field in fields(cls):
        name, value, typ = field.name, config.get(field.name), field.type
        need(value is not None or name not in CONFIG_REQUIRED, f"{name} is missing; a Qwen3 config needs it")
        if value is None or typ is str:
            continue
        # an integer is a float too; a float must be finite
        typed = type(value) is typ or typ is float and type(value) is int
        need(typed and (typ is not float or math.isfinite(value)), f"{name} {value!r} must be {TYPES[typ]}")
        need(typ is bool or value > 0, f"{name} {value} must be positive")
        config[name] = typ(value)
    h, kv = config["num_attention_heads"], config["num_key_value_heads"]
    need(h % kv == 0, f"num_key_value_heads {kv} must divide num_attention_heads {h}")
    D = config.setdefault("head_dim", config["hidden_size"] // h)
    pairs = "RoPE rotates pairs of dimensions"
    need(D > 0 and D % 2 == 0, f"head_dim {D} must be even and positive ({pairs})")
    torch_dtype = config["torch_dtype"]
    need(torch_dtype in DTYPES, f"{dt} {torch_dtype!r} must be one of {', '.join(DTYPES)}")
    return cls(**{field.name: config[field.name] for field in fields(cls) if field.name in config})


# ----------------------------------------------------------------------------------------------------------
# checkpoint files: HF cache lookup, download, safetensors


# safetensors' dtype names
ST_DTYPES = dict(F64=torch.float64, F32=torch.float32, F16=torch.float16, BF16=torch.bfloat16)
ST_DTYPES |= dict(BOOL=torch.bool, I64=torch.int64, I32=torch.int32, I16=torch.int16)
ST_DTYPES |= dict(I8=torch.int8, U8=torch.uint8)
ST_NAMES = {dt: name for name, dt in ST_DTYPES.items()}
# the files a download takes if the hub has them
OPTIONAL = ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"]
OPTIONAL += ["generation_config.json"]


def shard_names(folder):
    idx = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.isfile(idx):
        return ["model.safetensors"]
    try:
        return sorted(set(read_json(idx)["weight_map"].values()))
    except (KeyError, AttributeError):
        raise ValueError(f"{idx} has no weight_map; the checkpoint index is corrupt") from None


def fetch(url, path, optional=False):
    # Stream to <path>.incomplete, rename once every byte is in: a cut leaves nothing under the final name.
    part, name = path + ".incomplete", os.path.basename(path)
    if os.path.isfile(path):
        return
    # resume a cut download
    resume = dict(Range=f"bytes={os.path.getsize(part)}-") if os.path.isfile(part) else {}
    req = urllib.request.Request(url, headers=resume)
    # unredirected: the token is not passed on to the CDN that serves weights
    token = os.environ.get("HF_TOKEN")
    if token:
        req.add_unredirected_header("Authorization", "Bearer " + token)
    try:
        r = urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:
        # it holds the connection
        e.close()
        if e.code == 404 and optional:
            return
        if e.code != 416:
            raise
        # 416: the partial file is stale, start over
        os.remove(part)
        return fetch(url, path, optional)
    # only now, so a failed lookup leaves no folders
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # a server may ignore Range: take it all
    with r, open(part, "ab" if r.status == 206 else "wb") as f:
        length = r.headers.get("Content-Length")
        total = None if length is None else f.tell() + int(length)
        with tqdm(total=total, initial=f.tell(), unit="B", unit_scale=True, desc=name) as bar:
            while chunk := r.read(1 << 20):
                bar.update(f.write(chunk))
        # urllib ends a cut body silently: count the bytes
        if total is not None and f.tell() != total:
            raise ConnectionError(f"{name} stopped after {f.tell()} of {total} bytes")
    os.replace(part, path)


def checkpoint_dir(path_or_repo, revision="main"):
    p = os.path.expanduser(path_or_repo)
    if os.path.isdir(p):
        if not os.path.isfile(os.path.join(p, "config.json")):
            hint = "pass a Qwen3 checkpoint"
            raise FileNotFoundError(f"checkpoint folder {p} has no config.json; {hint}")
        return p
    # a repo id: owner/name, unchanged by expanduser, no part empty or dots only
    parts = path_or_repo.split("/")
    if len(parts) != 2 or p != path_or_repo or not all(s.strip(".") for s in parts):
        hint = "pass a folder with config.json or a Hugging Face repo id such as Qwen/Qwen3-0.6B"
        raise FileNotFoundError(f"no checkpoint folder {path_or_repo} ({hint})")
    home = os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface")
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub")
    repo = os.path.join(hub, "models--" + path_or_repo.replace("/", "--"))
    ref, snaps = os.path.join(repo, "refs", revision), os.path.join(repo, "snapshots")
    rev = Path(ref).read_text().strip() if os.path.isfile(ref) else revision
    # a snapshot is usable when it holds the config and every weight file
    for s in [rev] + sorted(os.listdir(snaps) if os.path.isdir(snaps) else []):
        d = os.path.join(snaps, s)
        if all(os.path.isfile(os.path.join(d, f)) for f in ["config.json", *shard_names(d)]):
            return d
    d = os.path.join(snaps, rev)
    # the hub's layout, as Hugging Face's own tools use it
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    url = f"{endpoint}/{path_or_repo}/resolve/{rev}/"
    index = "model.safetensors.index.json"
    try:
        fetch(url + "config.json", os.path.join(d, "config.json"))
        fetch(url + index, os.path.join(d, index), True)
        for f in shard_names(d) + OPTIONAL:
            fetch(url + f, os.path.join(d, f), f in OPTIONAL)
    except OSError as e:
        why = e.reason if type(e) is urllib.error.URLError else e
        files = "config.json, *.safetensors, tokenizer.json"
        offline = f"with no network, put the checkpoint files ({files}) in {d}/ or pass a local folder"
        raise ConnectionError(f"cannot download {path_or_repo} ({why}); {offline}") from None
    os.makedirs(os.path.dirname(ref), exist_ok=True)
    Path(ref + ".incomplete").write_text(rev)
    os.replace(ref + ".incomplete", ref)
    return d


def _entry(e):  # a header entry -> (dtype, shape, start, end)
    return ST_DTYPES[e["dtype"]], torch.Size(e["shape"]), *map(int, e["data_offsets"])


def read_safetensors(path):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        # where the data starts: 8-byte length, JSON header
        n = 8 + int.from_bytes(f.read(8), "little")
        if size < 8 or n > size:
            past = f"header runs past the end of the file ({size} bytes)"
            raise ValueError(f"{path}: {past}; it is truncated")
        try:
            entries = json.loads(f.read(n - 8)).items()
            header = {k: _entry(e) for k, e in entries if k != "__metadata__"}
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            why = "the file is corrupt or uses an unsupported dtype"
            raise ValueError(f"{path}: bad safetensors header ({e!r}); {why}") from None
    # private mmap: no copy
    buf = torch.UntypedStorage.from_file(os.fspath(path), shared=False, nbytes=size)
    out = {}
    for k, (dt, shape, a, b) in header.items():
        nbytes = shape.numel() * dt.itemsize
        if not 0 <= a <= b <= size - n or b - a != nbytes:
            says = f"the header says {a}..{b} of {size - n}; the file is truncated or corrupt"
            raise ValueError(f"{path}: tensor {k} {list(shape)} needs {nbytes} bytes, {says}")
        # (bytes,) a view of the mapped file, copied where not aligned to the dtype
        u = torch.empty(0, dtype=torch.uint8).set_(buf, n + a, (b - a,))
        aligned = (n + a) % dt.itemsize == 0
        out[k] = (u if aligned else u.clone()).view(dt).reshape(shape)
    return out


def check_tensors(folder, want, tensors):
    """A checkpoint's tensors against the model's shapes `want` {name: shape}: the first problem (a missing tensor,
    then an unexpected one, then a wrong shape) is a one-line ValueError naming the folder."""
    bad = [f"missing tensor {k} (this config.json expects it)" for k in sorted(want.keys() - tensors.keys())]
    bad += [f"unexpected tensor {k} (not part of a Qwen3 model)" for k in sorted(tensors.keys() - want.keys())]
    wrong = [k for k, shape in want.items() if k in tensors and tensors[k].shape != shape]
    bad += [f"tensor {k} has shape {list(tensors[k].shape)}, config.json implies {list(want[k])}" for k in wrong]
    for msg in bad[:1]:  # the first problem, in this order
        raise ValueError(f"{folder}: {msg}")


def load_safetensors(folder):
    tensors = {}
    for f in shard_names(folder):
        tensors.update(read_safetensors(os.path.join(folder, f)))
    return tensors


def save_safetensors(tensors, path):
    # widest dtypes first, so every tensor starts aligned and loads as a view of the mapped file
    ts = [(k, t.detach().cpu().contiguous()) for k, t in tensors.items()]
    ts.sort(key=lambda kt: -kt[1].itemsize)
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for k, t in ts:
        offsets = [off, off + t.nbytes]
        header[k] = dict(dtype=ST_NAMES[t.dtype], shape=list(t.shape), data_offsets=offsets)
        off += t.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    # pad so the data starts 8-byte aligned
    h += b" " * (-len(h) % 8)
    # the tensors' bytes straight from their memory: no numpy needed
    with open(f"{path}.incomplete", "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        for _, t in ts:
            f.write(ctypes.string_at(t.data_ptr(), t.nbytes) if t.nbytes else b"")
    os.replace(f"{path}.incomplete", path)


# ------------------------------------------------ a learned scorer on disk (kvpop.load_scorer, train.py)
# scorer.json (every setting needed to rebuild it, and what it was trained for) beside scorer.safetensors
def save_scorer(scorer, folder):
    os.makedirs(folder, exist_ok=True)
    save_safetensors(scorer.state_dict(), os.path.join(folder, "scorer.safetensors"))
    settings = dict(kind=scorer.kind, window=scorer.window)
    settings |= dict(d_mem=scorer.d_mem, d_hidden=scorer.d_hidden)
    settings |= dict(arrival=scorer.arrival, received=scorer.received) | scorer.shape
    settings["trained"] = scorer.meta
    write_json(settings, os.path.join(folder, "scorer.json"))


def read_scorer(folder, kinds):
    """A saved scorer, of the class `kinds` (kvpop.SCORERS) names for its kind, frozen."""
    path = os.path.join(folder, "scorer.json")
    if not os.path.isfile(path):
        hint = "pass the --out_dir of a train.py run"
        raise FileNotFoundError(f"{folder} is not a scorer folder (no scorer.json); {hint}")
    saved = read_json(path)
    tensors = read_safetensors(os.path.join(folder, "scorer.safetensors"))
    try:
        names = ("num_hidden_layers", "num_key_value_heads", "head_dim")
        shape = types.SimpleNamespace(**{name: saved[name] for name in names})
        sizes = (saved["window"], saved["d_mem"], saved["d_hidden"])
        received = saved.get("received", False)
        scorer = kinds[saved["kind"]](shape, *sizes, arrival=saved["arrival"], received=received)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: missing or bad field ({e})") from None
    want = {name: x.shape for name, x in scorer.state_dict().items()}
    got = {name: x.shape for name, x in tensors.items()}
    if got != want:
        what = "scorer.safetensors does not hold the tensors scorer.json describes"
        raise ValueError(f"{folder}: {what}")
    scorer.load_state_dict({name: x.float() for name, x in tensors.items()})
    scorer.meta = saved.get("trained", {})
    return scorer.eval().requires_grad_(False)
