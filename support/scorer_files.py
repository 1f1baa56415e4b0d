"""A learned scorer on disk: scorer.json (every setting needed to rebuild it, and what it was trained for) beside
scorer.safetensors. Loading knows every registered kind (kvpop.SCORERS), kvpop-shifted's too: support/shifted.py
registers it, imported here."""

import os

import kvpop
from qwen3 import Qwen3Config
from support import shifted  # noqa: F401 (registers kvpop-shifted)
from support.checkpoint import read_json, read_safetensors, save_safetensors, write_json


def save(scorer, folder):
    os.makedirs(folder, exist_ok=True)
    save_safetensors(scorer.state_dict(), os.path.join(folder, "scorer.safetensors"))
    settings = dict(kind=scorer.kind, window=scorer.window)
    settings |= dict(d_mem=scorer.d_mem, d_hidden=scorer.d_hidden)
    settings |= dict(arrival=scorer.arrival, received=scorer.received) | scorer.shape
    settings["trained"] = scorer.meta
    write_json(settings, os.path.join(folder, "scorer.json"))


def load(folder):
    """A saved scorer, of the class its kind names in kvpop.SCORERS, frozen."""
    path = os.path.join(folder, "scorer.json")
    if not os.path.isfile(path):
        hint = "pass the --out_dir of a train.py run"
        raise FileNotFoundError(f"{folder} is not a scorer folder (no scorer.json); {hint}")
    saved = read_json(path)
    tensors = read_safetensors(os.path.join(folder, "scorer.safetensors"))
    try:
        shape = {name: saved[name] for name in ("num_hidden_layers", "num_key_value_heads", "head_dim")}
        sizes = (saved["window"], saved["d_mem"], saved["d_hidden"])
        kind = kvpop.SCORERS[saved["kind"]]
        scorer = kind(Qwen3Config(**shape), *sizes, arrival=saved["arrival"], received=saved.get("received", False))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: missing or bad field ({e})") from None
    want = {name: x.shape for name, x in scorer.state_dict().items()}
    got = {name: x.shape for name, x in tensors.items()}
    if got != want:
        raise ValueError(f"{folder}: scorer.safetensors does not hold the tensors scorer.json describes")
    scorer.load_state_dict({name: x.float() for name, x in tensors.items()})
    scorer.meta = saved.get("trained", {})
    return scorer.eval().requires_grad_(False)
