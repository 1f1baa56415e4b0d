"""Qwen3, self-contained: Hugging Face's module names, so loading a checkpoint is a 1:1 copy with a
count and shape check. Every layer's attention is a hook, attn(layer, q, k, v, pos): cache.py's
evicting cache and kvpop.py's masked pass plug in there. Then generation: sampling, and a stream of
new tokens through a cache.

"""

import math
import os
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from support import checkpoint


@dataclass
class Qwen3Config:
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = True
    torch_dtype: str = "bfloat16"

    @classmethod
    # a checkpoint's config.json, checked (support/checkpoint.py)
    def from_json(cls, path):
        return checkpoint.read_config(path, cls)


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):  # HF order: normalise in fp32 (fp64 for fp64), cast back, then scale
        xf = kernels.wide(x)
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope(x, cos, sin):  # x (B, H, T, D); split-halves rotation
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, c, layer_idx):
        super().__init__()
        self.layer_idx, self.Hq, self.Hkv, self.D = layer_idx, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.Hq * self.D, bias=False)
        self.k_proj, self.v_proj = (nn.Linear(c.hidden_size, self.Hkv * self.D, bias=False) for _ in range(2))
        self.o_proj = nn.Linear(self.Hq * self.D, c.hidden_size, bias=False)
        self.q_norm, self.k_norm = RMSNorm(self.D, c.rms_norm_eps), RMSNorm(self.D, c.rms_norm_eps)

    # attn(layer, q, k, v, pos): plain causal, masked by eviction times, or through a cache
    def forward(self, x, cos, sin, pos, attn):
        # (B, Hq, T, D)
        q = rope(self.q_norm(self.q_proj(x).unflatten(-1, (-1, self.D))).transpose(1, 2), cos, sin)
        k = rope(self.k_norm(self.k_proj(x).unflatten(-1, (-1, self.D))).transpose(1, 2), cos, sin)
        v = self.v_proj(x).unflatten(-1, (-1, self.D)).transpose(1, 2)  # (B, Hkv, T, D)
        return self.o_proj(attn(self.layer_idx, q, k, v, pos).transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj, self.up_proj = (nn.Linear(c.hidden_size, c.intermediate_size, bias=False) for _ in range(2))
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer_idx)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, pos, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, pos, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


def causal(i, q, k, v, pos):  # the default attention: plain causal, flash-style (kernels.py)
    return kernels.attention(q, k, v)[0]


class Qwen3(nn.Module):
    def __init__(self, config):
        super().__init__()
        c = self.config = config
        layers = nn.ModuleList(Block(c, i) for i in range(c.num_hidden_layers))
        embed, norm = nn.Embedding(c.vocab_size, c.hidden_size), RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.model = nn.ModuleDict(dict(embed_tokens=embed, layers=layers, norm=norm))
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, idx, cache=None, attn=causal, logits=True):
        """idx (B, T) -> logits (B, T, vocab), or with logits=False the last layer's output (B, T,
        hidden). attn(i, q, k, v, pos) is layer i's attention; with a cache the tokens continue the
        cached sequence and only the last position is returned (B, 1, ...)."""
        # a prompt the cache cannot take whole goes token by token, each through every layer:
        # exactly the sequence of decoding steps
        if cache is not None and idx.shape[1] > 1 and not cache.whole(idx.shape[1]):
            for t in range(idx.shape[1] - 1):
                self(idx[:, t : t + 1], cache=cache, logits=False)
            idx = idx[:, -1:]
        t0, attn = (0, attn) if cache is None else (cache.t, cache.attend)
        pos = torch.arange(idx.shape[1], device=idx.device) + t0
        x = self.model.embed_tokens(idx)
        D = self.config.head_dim  # RoPE's cos, sin (T, D): computed in fp32 and cast as HF does
        inv = 1.0 / self.config.rope_theta ** (torch.arange(0, D, 2, device=idx.device).float() / D)
        f = (pos.float()[:, None] * inv).repeat(1, 2)  # each frequency twice, for the two halves
        cos, sin = f.cos().to(x.dtype), f.sin().to(x.dtype)
        for block in self.model.layers:
            x = block(x, cos, sin, pos, attn)
        if cache is not None:
            cache.t += len(pos)
            x = x[:, -1:]
        if not logits:  # passes that only need the layers' attention: no (B, T, vocab) logits
            return x
        return self.lm_head(self.model.norm(x))

    @classmethod
    # config: its config.json, if read
    def from_pretrained(cls, path_or_repo, device=None, dtype=None, config=None):
        folder = checkpoint.checkpoint_dir(path_or_repo)
        config = config or Qwen3Config.from_json(os.path.join(folder, "config.json"))
        with torch.device("meta"):
            model = cls(config)
        # tied: lm_head.weight is not listed
        want = {k: p.shape for k, p in model.named_parameters()}
        sd = checkpoint.load_safetensors(folder)
        if config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)  # some tied checkpoints store the shared matrix twice
        checkpoint.check_tensors(folder, want, sd)
        dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype or config.torch_dtype)
        # strict check done above, the tied output layer aside
        model.load_state_dict(sd, strict=False, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        n = sum(t.numel() for t in sd.values())
        print(f"loaded {len(sd)} tensors ({n / 1e6:.1f}M parameters) from {folder}", file=sys.stderr)
        return model.to(device=device, dtype=dtype).eval()

    def save_pretrained(self, folder, weights=None):
        """A normal checkpoint folder (config.json + model.safetensors) that from_pretrained loads.
        weights: the tensors to write instead of the parameters (a sharded model's, gathered)."""
        os.makedirs(folder, exist_ok=True)
        weights = weights or dict(self.named_parameters())
        tensors = {k: weights[k] for k, _ in self.named_parameters()}
        checkpoint.save_safetensors(tensors, os.path.join(folder, "model.safetensors"))
        dtype = str(next(self.parameters()).dtype).removeprefix("torch.")
        hf = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", torch_dtype=dtype)
        checkpoint.write_json(dict(asdict(self.config), **hf), os.path.join(folder, "config.json"))


# --------------------------------------------------------------------------------------- generation


def sample_next(logits, temperature, top_k, top_p):  # logits (B, V) fp32 -> (B,)
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:  # nucleus: drop the tail whose mass before it already exceeds top_p
        sorted_logits, order = logits.sort(-1, descending=True)
        p = sorted_logits.softmax(-1)
        tail = sorted_logits.masked_fill(p.cumsum(-1) - p > top_p, -math.inf)
        logits = logits.scatter(-1, order, tail)
    return torch.multinomial(logits.softmax(-1), 1)[:, 0]


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, stop=(), cache=None, step=None):
    """Stream (B,) next-token tensors. With a cache (cache.KVCache, which sets the budget) each step
    feeds the newest token, through `step` if given (the model compiled: one graph a step), the
    prompt through the model; without one, the whole sequence. A sequence that produced a stop id
    keeps emitting it; generation ends when all have stopped."""
    x, seq, nxt = idx, idx, idx[:, -1]
    done = torch.zeros(len(idx), dtype=torch.bool, device=idx.device)
    stop = idx.new_tensor(list(stop))
    run = model
    for _ in range(max_new_tokens):
        logits = run(x, cache=cache)[:, -1].float()
        run = model if step is None else step
        nxt = torch.where(done, nxt, sample_next(logits, temperature, top_k, top_p))
        yield nxt
        done |= torch.isin(nxt, stop)
        if done.all():
            return
        seq = torch.cat([seq, nxt[:, None]], 1)
        x = nxt[:, None] if cache is not None else seq
