"""Tests of qwen3.py and checkpoint loading: logits against transformers, incremental decoding, save / load,
config.json's fields (good, bad: one line naming the field), bad checkpoint files."""

import json
import math
import os

import pytest
import torch

import qwen3
from cache import KVCache
from support import checkpoint

from tests.common import MODEL_DIR, exits, hf_checkpoint, one_line_error


@pytest.mark.parametrize(
    "tied,kv,q,shard",
    [(True, 2, 4, None), (False, 4, 4, None), (True, 1, 4, None), (False, 2, 2, None), (True, 2, 4, "100KB")],
)
def test_logits_match_transformers(tmp_path, tied, kv, q, shard):
    hf = hf_checkpoint(tmp_path, tied, kv, q, shard=shard)
    if shard:
        assert os.path.exists(tmp_path / "model.safetensors.index.json")
    m = qwen3.Qwen3.from_pretrained(str(tmp_path))
    idx = torch.randint(0, 384, (2, 96))
    with torch.no_grad():
        err = (hf(idx).logits - m(idx)).abs().max().item()
    assert m.config.tie_word_embeddings == tied and m.config.num_key_value_heads == kv
    assert err <= 1e-4, err


def test_bf16_checkpoint_loads_as_bf16(tmp_path):
    hf = hf_checkpoint(tmp_path, dtype=torch.bfloat16)
    m = qwen3.Qwen3.from_pretrained(str(tmp_path))
    assert next(m.parameters()).dtype == torch.bfloat16
    idx = torch.randint(0, 384, (1, 80))
    with torch.no_grad():
        a, b = hf(idx).logits.float(), m(idx).float()
    # bf16 has 8 bits of mantissa: compare at the scale of the logits, and the argmax almost
    # everywhere
    assert (a - b).abs().max().item() <= 0.05 * a.abs().max().item()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95


def test_incremental_decoding_matches_full_forward(tmp_path):
    hf_checkpoint(tmp_path, kv=2, q=4)
    m = qwen3.Qwen3.from_pretrained(str(tmp_path))
    idx = torch.randint(0, 384, (2, 72))
    with torch.no_grad():
        full = m(idx)
        cache = KVCache(m, 2, 72)
        steps = [m(idx[:, :30], cache=cache)] + [m(idx[:, t : t + 1], cache=cache) for t in range(30, 72)]
    assert (torch.cat(steps, 1) - full[:, 29:]).abs().max().item() <= 1e-4


def test_save_pretrained_roundtrip(tmp_path):
    cfg = qwen3.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
    )
    a = qwen3.Qwen3(cfg)
    a.save_pretrained(str(tmp_path / "ck"))
    b = qwen3.Qwen3.from_pretrained(str(tmp_path / "ck"))
    idx = torch.randint(0, 64, (1, 20))
    assert torch.equal(a(idx), b(idx)) and b.config == qwen3.Qwen3Config(**{**vars(cfg), "torch_dtype": "float32"})


def test_config_variants(tmp_path):
    d = dict(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters={"rope_theta": 5e6, "rope_type": "default"},
        dtype="float32",
    )
    (tmp_path / "config.json").write_text(__import__("json").dumps(d))
    c = qwen3.Qwen3Config.from_json(tmp_path / "config.json")
    assert (c.rope_theta, c.torch_dtype, c.head_dim, c.tie_word_embeddings) == (5e6, "float32", 4, False)


# in-process: see test_bad_input_end_to_end
def test_bad_checkpoints_give_one_clear_line(tmp_path, monkeypatch):
    sample = lambda *a: exits(monkeypatch, "sample.py", "--max_new_tokens", "8", *a)
    one_line_error(sample("--model", str(tmp_path / "nope")), "nope")
    (tmp_path / "empty").mkdir()
    one_line_error(sample("--model", str(tmp_path / "empty")), "config.json")
    hf_checkpoint(tmp_path / "ck")
    st = tmp_path / "ck" / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    one_line_error(sample("--model", str(tmp_path / "ck")), "model.safetensors")
    st.write_bytes(b"\xff" * 64)
    one_line_error(sample("--model", str(tmp_path / "ck")), "model.safetensors")
    hf_checkpoint(tmp_path / "ck2")  # a config that disagrees with the tensors: a wrong shape
    cfg = tmp_path / "ck2" / "config.json"
    cfg.write_text(cfg.read_text().replace('"intermediate_size": 112', '"intermediate_size": 100'))
    one_line_error(sample("--model", str(tmp_path / "ck2")), "mlp", "shape")


QWEN3_06B = dict(  # Qwen/Qwen3-0.6B's config.json (transformers 4.51)
    architectures=["Qwen3ForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=151643,
    eos_token_id=151645,
    head_dim=128,
    hidden_act="silu",
    hidden_size=1024,
    initializer_range=0.02,
    intermediate_size=3072,
    max_position_embeddings=40960,
    max_window_layers=28,
    model_type="qwen3",
    num_attention_heads=16,
    num_hidden_layers=28,
    num_key_value_heads=8,
    rms_norm_eps=1e-06,
    rope_scaling=None,
    rope_theta=1000000,
    sliding_window=None,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    transformers_version="4.51.0",
    use_cache=True,
    use_sliding_window=False,
    vocab_size=151936,
)
class _Drop:  # a field left out; its repr names it in the test ids (object()'s address differs between processes,
    # and pytest-xdist's workers must collect the same ids)
    def __repr__(self):
        return "DROP"


DROP = _Drop()
BAD_CONFIGS = [  # (changes to QWEN3_06B, or a whole non-object file; words of the one line)
    *[({f: DROP}, [f, "missing"]) for f in checkpoint.CONFIG_REQUIRED],
    *[({f: "28"}, [f"{f} '28' must be an integer"]) for f in checkpoint.CONFIG_REQUIRED],
    ({"num_key_value_heads": 8.0}, ["num_key_value_heads 8.0 must be an integer"]),
    ({"hidden_size": True}, ["hidden_size True must be an integer"]),
    ({"vocab_size": [1]}, ["vocab_size"]),
    ({"head_dim": 128.5}, ["head_dim"]),
    ({"max_position_embeddings": "40960"}, ["max_position_embeddings"]),
    ({"tie_word_embeddings": "false"}, ["tie_word_embeddings 'false' must be true or false"]),
    ({"tie_word_embeddings": 0}, ["tie_word_embeddings"]),
    ({"rms_norm_eps": "1e-6"}, ["rms_norm_eps", "number"]),
    ({"rope_theta": math.nan}, ["rope_theta nan must be a finite number"]),
    ({"rope_theta": math.inf}, ["rope_theta"]),
    ({"torch_dtype": 16}, ["torch_dtype 16 must be one of"]),
    ({"torch_dtype": "float8"}, ["torch_dtype 'float8'"]),
    ({"torch_dtype": DROP, "dtype": "int8"}, ["dtype 'int8'"]),
    ({"rope_parameters": "default"}, ["rope_parameters"]),
    *[({f: 0}, [f"{f} 0 must be positive"]) for f in checkpoint.CONFIG_REQUIRED + ("head_dim", "max_position_embeddings")],
    ({"hidden_size": -1024}, ["hidden_size -1024 must be positive"]),
    ({"rms_norm_eps": 0}, ["rms_norm_eps"]),
    ({"rms_norm_eps": -1e-6}, ["rms_norm_eps"]),
    ({"rope_theta": -1}, ["rope_theta"]),
    ({"head_dim": 127}, ["head_dim 127 must be even"]),
    (
        {"head_dim": DROP, "hidden_size": 24, "num_attention_heads": 8, "num_key_value_heads": 8},
        ["head_dim 3 must be even"],
    ),
    ({"num_key_value_heads": 3}, ["num_key_value_heads 3 must divide num_attention_heads 16"]),
    ({"hidden_act": "gelu"}, ["hidden_act 'gelu'"]),
    ({"use_sliding_window": True}, ["use_sliding_window"]),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["only default RoPE"]),
    ([1, 2], ["must be a JSON object", "not an array"]),
    ("text", ["not a string"]),
    (None, ["not null"]),
    (3, ["not a number"]),
]


@pytest.mark.parametrize("change, words", BAD_CONFIGS, ids=[str(c) for c, _ in BAD_CONFIGS])
def test_bad_config_json_one_line_naming_the_field(tmp_path, change, words):
    d = {k: v for k, v in {**QWEN3_06B, **change}.items() if v is not DROP} if type(change) is dict else change
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError) as e:
        qwen3.Qwen3Config.from_json(str(tmp_path / "config.json"))
    one_line_error(str(e.value), str(tmp_path / "config.json") + ":", *words)


def test_good_configs_load(tmp_path):
    for change, want in [
        ({}, dict(rope_theta=1e6, torch_dtype="bfloat16", head_dim=128)),
        ({"torch_dtype": None, "head_dim": None}, dict(torch_dtype="bfloat16", head_dim=64)),
        # transformers 5's form
        (
            {
                "torch_dtype": DROP,
                "dtype": "float16",
                "rope_theta": DROP,
                "rope_parameters": {"rope_theta": 5e6, "rope_type": "default"},
            },
            dict(torch_dtype="float16", rope_theta=5e6),
        ),
        ({"tie_word_embeddings": DROP, "rms_norm_eps": 1}, dict(tie_word_embeddings=False)),
    ]:
        (tmp_path / "config.json").write_text(
            json.dumps({k: v for k, v in {**QWEN3_06B, **change}.items() if v is not DROP})
        )
        c = qwen3.Qwen3Config.from_json(str(tmp_path / "config.json"))
        assert all(getattr(c, k) == v and type(getattr(c, k)) is type(v) for k, v in want.items()), c
    assert qwen3.Qwen3Config.from_json(os.path.join(MODEL_DIR, "config.json")).head_dim == 64


def test_bad_config_json_through_every_caller(tmp_path, monkeypatch):
    hf_checkpoint(tmp_path)
    cfg = tmp_path / "config.json"
    cfg.write_text(cfg.read_text().replace('"num_key_value_heads": 2', '"num_key_value_heads": 3'))
    words = [f"{cfg}: num_key_value_heads 3 must divide num_attention_heads 4"]
    with pytest.raises(ValueError) as e:
        qwen3.Qwen3.from_pretrained(str(tmp_path))
    one_line_error(str(e.value), *words)
    one_line_error(exits(monkeypatch, "sample.py", "--model", str(tmp_path)), *words)
    one_line_error(exits(monkeypatch, "bench.py quality", "--model", str(tmp_path)), *words)


def test_audit_head_dim_zero_refused(tmp_path):
    """head_dim (absent: hidden_size // heads) must be even and positive: hidden_size 2 over 4 heads gives 0, a
    one-line ValueError naming it. Break: `D > 0 and` dropped from the check."""
    d = dict(vocab_size=10, hidden_size=2, intermediate_size=8, num_hidden_layers=1)
    d |= dict(num_attention_heads=4, num_key_value_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="head_dim 0 must be even and positive"):
        qwen3.Qwen3Config.from_json(tmp_path / "config.json")
