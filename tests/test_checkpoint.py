"""Tests of support/checkpoint.py: safetensors I/O, the Hugging Face cache, downloads from a local hub."""

import http.server
import json
import os
import shutil
import socket
import threading

import pytest
import safetensors.torch
import torch

from support.checkpoint import ST_DTYPES, checkpoint_dir, load_safetensors, read_safetensors, save_safetensors


# =========================================================================================================
# checkpoint files: safetensors I/O, the Hugging Face cache, downloads from a local hub

REPO = "org/tiny"


@pytest.fixture(scope="module")
def hf_ck(tmp_path_factory):
    # Tiny Qwen3s saved by transformers: untied fp32 in one file, tied bf16 in 200KB shards.
    import transformers

    torch.manual_seed(0)
    root, sd = tmp_path_factory.mktemp("hf_ck"), []
    for name, tied, dt, shard in [("single", False, torch.float32, "5GB"), ("sharded", True, torch.bfloat16, "200KB")]:
        cfg = transformers.Qwen3Config(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=tied,
        )
        m = transformers.Qwen3ForCausalLM(cfg).to(dt)
        m.save_pretrained(root / name, max_shard_size=shard)
        sd.append({k: v.clone() for k, v in m.state_dict().items() if not (tied and k == "lm_head.weight")})
    (root / "single" / "tokenizer.json").write_text('{"fake": true}')
    return root, *sd


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


def all_dtypes():
    g = torch.Generator().manual_seed(1)
    out = {f"x.{name}": (torch.randn(3, 5, generator=g) * 100).to(dt) for name, dt in ST_DTYPES.items()}
    out["x.BOOL"] = torch.rand(3, 5, generator=g) > 0.5
    out["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    out["empty"] = torch.zeros(0, 4, dtype=torch.float16)
    out["strided"] = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()  # non-contiguous input
    # odd size: the writer must keep others aligned
    out["u8"] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    return out


def test_roundtrip_all_dtypes_ours_and_package(tmp_path):
    t = all_dtypes()
    save_safetensors(t, tmp_path / "ours.safetensors")
    assert_same(read_safetensors(tmp_path / "ours.safetensors"), t)
    assert_same(safetensors.torch.load_file(tmp_path / "ours.safetensors"), t)
    safetensors.torch.save_file({k: v.contiguous() for k, v in t.items()}, tmp_path / "theirs.safetensors")
    assert_same(read_safetensors(tmp_path / "theirs.safetensors"), t)
    # no temp file left
    assert sorted(os.listdir(tmp_path)) == ["ours.safetensors", "theirs.safetensors"]


def test_loaded_tensors_are_file_views_and_writes_stay_in_memory(tmp_path):
    p = tmp_path / "a.safetensors"
    save_safetensors({"w": torch.ones(1000), "b": torch.zeros(3, dtype=torch.uint8)}, p)
    before = p.read_bytes()
    w = read_safetensors(p)["w"]
    # a view into the whole mapped file, not a copy
    assert w.untyped_storage().nbytes() == len(before)
    w.mul_(3)
    assert p.read_bytes() == before and torch.equal(read_safetensors(p)["w"], torch.ones(1000))


def test_misaligned_file_loads(tmp_path):
    # Other writers may place a 4-byte tensor at an odd offset; it must still load exactly.
    h = json.dumps(
        {
            "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]},
        }
    ).encode()
    h += b" " * (-len(h) % 8)
    data = bytes([7, 8, 9]) + torch.tensor([1.5, -2.0]).numpy().tobytes()
    (tmp_path / "m.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + data)
    got = read_safetensors(tmp_path / "m.safetensors")
    assert_same(got, safetensors.torch.load_file(tmp_path / "m.safetensors"))
    assert got["b"].tolist() == [1.5, -2.0]


def test_transformers_checkpoints_load_exactly(hf_ck):
    root, sd32, sd16 = hf_ck
    single, sharded = load_safetensors(root / "single"), load_safetensors(root / "sharded")
    assert_same(single, sd32)
    assert_same(sharded, sd16)
    assert len(json.loads((root / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]) == len(sd16)
    assert len([f for f in os.listdir(root / "sharded") if f.endswith(".safetensors")]) > 1


def write_header(path, header, data=b""):
    h = json.dumps(header).encode() if isinstance(header, (dict, list)) else header
    path.write_bytes(len(h).to_bytes(8, "little") + h + data)


@pytest.mark.parametrize(
    "case, match",
    [
        ("short", "header runs past the end of the file"),
        ("huge_len", "header runs past the end of the file"),
        ("bad_json", "bad safetensors header"),
        ("list", "bad safetensors header"),
        ("dtype", "bad safetensors header .*F8_E4M3.*unsupported dtype"),
        ("no_shape", "bad safetensors header"),
        ("size", r"tensor w \[3, 3\] needs 36 bytes, the header says 0..16"),
        ("cut", r"tensor w \[64\] needs 256 bytes, the header says 0..256 of 200; the file is truncated"),
    ],
)
def test_corrupt_safetensors_give_one_clear_line(tmp_path, case, match):
    p = tmp_path / "bad.safetensors"
    w = {"dtype": "F32", "shape": [3, 3], "data_offsets": [0, 36]}
    if case == "short":
        p.write_bytes(b"\x10\x00\x00")
    elif case == "huge_len":
        p.write_bytes((1 << 62).to_bytes(8, "little") + b"{}")
    elif case == "bad_json":
        write_header(p, b'{"w": {"dtype": ')
    elif case == "list":
        write_header(p, [1, 2])
    elif case == "dtype":
        write_header(p, {"w": dict(w, dtype="F8_E4M3")}, bytes(36))
    elif case == "no_shape":
        write_header(p, {"w": {"dtype": "F32", "data_offsets": [0, 36]}}, bytes(36))
    elif case == "size":
        write_header(p, {"w": dict(w, data_offsets=[0, 16])}, bytes(16))
    else:
        save_safetensors({"w": torch.ones(64)}, p)
        p.write_bytes(p.read_bytes()[:-56])
    with pytest.raises(ValueError, match=match) as e:
        read_safetensors(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_missing_shard_is_named(hf_ck, tmp_path):
    shutil.copytree(hf_ck[0] / "sharded", tmp_path / "c")
    gone = sorted(f for f in os.listdir(tmp_path / "c") if f.endswith(".safetensors"))[-1]
    os.remove(tmp_path / "c" / gone)
    with pytest.raises(FileNotFoundError, match=gone):
        load_safetensors(tmp_path / "c")


def test_local_folders_and_bad_paths(hf_ck, tmp_path):
    assert checkpoint_dir(str(hf_ck[0] / "single")) == str(hf_ck[0] / "single")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        checkpoint_dir(str(tmp_path))
    for bad in [str(tmp_path / "nope"), "nope", "./nope/x", "a/b/c", "/abs"]:
        with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
            checkpoint_dir(bad)


def free_endpoint(monkeypatch):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connection refused
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")


def test_hf_cache_lookup(hf_ck, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    free_endpoint(monkeypatch)
    repo = tmp_path / "home" / "hub" / "models--org--tiny"
    shutil.copytree(hf_ck[0] / "sharded", repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert checkpoint_dir(REPO) == str(repo / "snapshots" / "abc123")
    os.remove(repo / "refs" / "main")  # no ref: any complete snapshot will do
    assert checkpoint_dir(REPO) == str(repo / "snapshots" / "abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "other"))  # takes precedence over HF_HOME
    shutil.copytree(hf_ck[0] / "single", tmp_path / "other" / "models--org--tiny" / "snapshots" / "main")
    assert checkpoint_dir(REPO) == str(tmp_path / "other" / "models--org--tiny" / "snapshots" / "main")
    os.remove(tmp_path / "other" / "models--org--tiny" / "snapshots" / "main" / "model.safetensors")
    # a snapshot missing weights is not used
    with pytest.raises(ConnectionError, match="cannot download"):
        checkpoint_dir(REPO)


def serve(root, log, cut=False, cdn=False):
    # The hub's URL layout, 404 for missing files, Range support; cut=True sends half a .safetensors
    # and hangs up; cdn=True redirects weights to /cdn/ as the hub does.
    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            log.append((self.path, self.headers.get("Range"), self.headers.get("Authorization")))
            rel = self.path.removeprefix(f"/{REPO}/resolve/main/").removeprefix("/cdn/")
            f = root / rel
            if rel == self.path or not f.is_file():
                return self.send_error(404)
            if cdn and f.suffix == ".safetensors" and not self.path.startswith("/cdn/"):
                self.send_response(302)
                self.send_header("Location", "/cdn/" + rel)
                return self.end_headers()
            data = f.read_bytes()
            start = int(self.headers["Range"][6:-1]) if self.headers.get("Range") else 0
            if start >= len(data) > 0:
                return self.send_error(416)
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            end = start + (len(data) - start) // 2 if cut and f.suffix == ".safetensors" else len(data)
            self.wfile.write(data[start:end])

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def stop(srv):
    srv.shutdown()
    srv.server_close()


def hub_env(tmp_path, monkeypatch, srv):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{srv.server_address[1]}/")
    return tmp_path / "home" / "hub" / "models--org--tiny"


def test_download_cut_midway_then_resumed(hf_ck, tmp_path, monkeypatch):
    log = []
    srv = serve(hf_ck[0] / "single", log, cut=True)
    repo = hub_env(tmp_path, monkeypatch, srv)
    snap = repo / "snapshots" / "main"
    with pytest.raises(ConnectionError, match=r"cannot download org/tiny \(model.safetensors stopped after") as e:
        checkpoint_dir(REPO)
    stop(srv)
    assert "\n" not in str(e.value)
    assert not (snap / "model.safetensors").exists() and (snap / "model.safetensors.incomplete").exists()
    have = (snap / "model.safetensors.incomplete").stat().st_size
    assert 0 < have < (hf_ck[0] / "single" / "model.safetensors").stat().st_size
    log.clear()
    srv = serve(hf_ck[0] / "single", log)
    hub_env(tmp_path, monkeypatch, srv)
    d = checkpoint_dir(REPO)
    stop(srv)
    assert d == str(snap) and (repo / "refs" / "main").read_text() == "main"
    # resumed, not redone
    assert (f"/{REPO}/resolve/main/model.safetensors", f"bytes={have}-", None) in log
    assert sorted(os.listdir(snap)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    for f in os.listdir(snap):
        assert (snap / f).read_bytes() == (hf_ck[0] / "single" / f).read_bytes()
    assert_same(load_safetensors(d), hf_ck[1])
    free_endpoint(monkeypatch)
    assert checkpoint_dir(REPO) == d  # now served from the cache, offline


def test_download_sharded_with_token(hf_ck, tmp_path, monkeypatch):
    log = []
    srv = serve(hf_ck[0] / "sharded", log, cdn=True)
    repo = hub_env(tmp_path, monkeypatch, srv)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    (repo / "snapshots" / "main").mkdir(parents=True)
    # stale: gets a 416
    (repo / "snapshots" / "main" / "config.json.incomplete").write_bytes(bytes(10**5))
    d = checkpoint_dir(REPO)
    stop(srv)
    assert sorted(os.listdir(d)) == sorted(os.listdir(hf_ck[0] / "sharded"))
    assert d == str(repo / "snapshots" / "main")
    assert (f"/{REPO}/resolve/main/config.json", "bytes=100000-", "Bearer hf_secret") in log
    assert {a for p, _, a in log if not p.startswith("/cdn/")} == {"Bearer hf_secret"}
    assert {a for p, _, a in log if p.startswith("/cdn/")} == {None}  # the token stays with the hub
    assert len([p for p, _, _ in log if p.startswith("/cdn/")]) == len(os.listdir(d)) - 3
    assert_same(load_safetensors(d), hf_ck[2])


def test_no_network_and_missing_repo_give_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    free_endpoint(monkeypatch)
    snap = os.path.join(str(tmp_path), "hub", "models--org--tiny", "snapshots", "main")
    with pytest.raises(ConnectionError) as e:
        checkpoint_dir(REPO)
    assert not os.path.exists(snap)  # a failed lookup leaves no empty folders in the cache
    assert str(e.value) == (
        "cannot download org/tiny ([Errno 111] Connection refused); with no network, put "
        "the checkpoint files (config.json, *.safetensors, tokenizer.json) in "
        f"{snap}/ or pass a local folder"
    )
    srv = serve(tmp_path, [])
    hub_env(tmp_path, monkeypatch, srv)
    with pytest.raises(ConnectionError, match=r"cannot download org/tiny \(HTTP Error 404: Not Found\)"):
        checkpoint_dir(REPO)
    stop(srv)


