"""A scorer on disk (support/checkpoint.py, kvpop.load_scorer): saved and loaded keeps its kind, tensors and every setting of scorer.json; bad
folders are refused."""

import json

import pytest
import torch

import kvpop
import qwen3
import tasks
from cache import KVCache
from support import checkpoint

from tests.common import _scorers, small_model


def test_scorer_save_load_and_errors(small_model, tmp_path):
    c = small_model.config
    for s in _scorers(c, 16):
        checkpoint.save_scorer(s, tmp_path / s.kind)
        t = kvpop.load_scorer(tmp_path / s.kind)
        assert t.kind == s.kind and t.charge(torch.bfloat16) == s.charge(torch.bfloat16)
        assert all(torch.equal(x, y) for x, y in zip(s.state_dict().values(), t.state_dict().values()))
    with pytest.raises(FileNotFoundError, match="not a scorer folder"):
        kvpop.load_scorer(tmp_path)
    other = kvpop.WindowScorer(qwen3.Qwen3Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=16), window=16)
    with pytest.raises(ValueError, match="trained for a model"):
        tasks.evaluate(small_model, torch.zeros(1, 50, dtype=torch.long), other, 0.5, 4, 16)
    with pytest.raises(ValueError, match="window 16"):
        KVCache(small_model, 1, 40, _scorers(c, 16)[0], 4, 8)
    (tmp_path / "kvpop" / "scorer.json").write_text('{"kind": "kvpop"}')
    with pytest.raises(ValueError, match="scorer.json"):
        kvpop.load_scorer(tmp_path / "kvpop")


def test_scorer_round_trip_keeps_every_setting_of_scorer_json(tmp_path):
    """save_pretrained -> from_pretrained with no setting at its default: every field scorer.json
    holds is the loaded scorer's (a field ignored on load, e.g. the window, fails), and so are the
    tensors."""
    c = qwen3.Qwen3Config(num_hidden_layers=3, num_key_value_heads=2, head_dim=8)
    for kind in kvpop.SCORERS:
        s = kvpop.SCORERS[kind](c, window=13, d_mem=5, d_hidden=7, gamma=0.01)
        s.meta = dict(model="m", budget=0.3, sinks=2, window=13, data="d", iters=9, finetune=False)
        checkpoint.save_scorer(s, tmp_path / kind)
        saved = json.loads((tmp_path / kind / "scorer.json").read_text())
        t = kvpop.load_scorer(tmp_path / kind)
        # the settings, the model's shape and the training record
        got = dict(vars(t), kind=t.kind, **t.shape, trained=t.meta)  # the kind: its class's
        assert set(saved) <= set(got) and {k: got[k] for k in saved} == saved, kind
        assert saved["window"] == 13 and saved["kind"] == kind and saved["trained"]["iters"] == 9
        assert s.state_dict().keys() == t.state_dict().keys()
        assert all(torch.equal(x, t.state_dict()[k]) for k, x in s.state_dict().items())
