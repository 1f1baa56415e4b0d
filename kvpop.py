"""KVpop: Qwen3 with a fixed-budget, evicting KV cache (arXiv 2607.05061), in one file.

Read top to bottom: config -> checkpoint files -> tokenizer -> model -> policies and the evicting cache ->
teacher-forced evaluation -> command-line defaults. The method is fixed in SPEC.md; section numbers (§)
below refer to it.
"""
import json
import math
import os
import sys
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels

# ----------------------------------------------------------------------------------------------------------
# config


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
    def from_json(cls, path):
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {path}: {e}") from None
        d.setdefault("torch_dtype", d.get("dtype") or "bfloat16")  # transformers 5 writes "dtype"
        rope = d.get("rope_parameters") or {}  # transformers 5 moves rope_theta in here
        if "rope_theta" in rope:
            d.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default" or d.get("rope_scaling"):
            raise ValueError(f"{path}: only default RoPE is supported (found rope scaling)")
        d.setdefault("tie_word_embeddings", False)  # transformers' default when the key is absent
        if d.get("head_dim") is None:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def to_dict(self):
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        return dict(d, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu")


# ----------------------------------------------------------------------------------------------------------
# checkpoint files: HF cache lookup, download, safetensors

#@@LOAD@@

# ----------------------------------------------------------------------------------------------------------
# tokenizer

#@@TOK@@

# ----------------------------------------------------------------------------------------------------------
# model: Hugging Face's module names, so a checkpoint is a 1:1 copy


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):  # HF order: normalise in fp32, cast back, then scale
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope(x, cos, sin):  # x (B, H, T, D); split-halves rotation
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.Hq, self.Hkv, self.D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.Hq * self.D, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.Hkv * self.D, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.Hkv * self.D, bias=False)
        self.o_proj = nn.Linear(self.Hq * self.D, c.hidden_size, bias=False)
        self.q_norm, self.k_norm = RMSNorm(self.D, c.rms_norm_eps), RMSNorm(self.D, c.rms_norm_eps)

    def forward(self, x, cos, sin, attn):
        B, T, _ = x.shape
        q = rope(self.q_norm(self.q_proj(x).view(B, T, self.Hq, self.D)).transpose(1, 2), cos, sin)
        k = rope(self.k_norm(self.k_proj(x).view(B, T, self.Hkv, self.D)).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(B, T, self.Hkv, self.D).transpose(1, 2)  # (B, Hkv, T, D)
        y = attn(q, k, v)  # (B, Hq, T, D): plain causal, masked by eviction times, or through a cache
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.Hq * self.D))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


def causal(i, q, k, v, pos):  # the default attention: plain causal, flash-style (kernels.py)
    return kernels.attention(q, k, v)[0]


class Qwen3(nn.Module):
    def __init__(self, config):
        super().__init__()
        c = self.config = config
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(c.vocab_size, c.hidden_size),
            layers=nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers)),
            norm=RMSNorm(c.hidden_size, c.rms_norm_eps)))
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, idx, targets=None, cache=None, attn=causal):
        """idx (B, T) -> logits (B, T, vocab), or (logits, loss) with targets (-1 = ignored).
        attn(i, q, k, v, pos) is layer i's attention; with a cache the tokens continue the cached sequence
        and only the last position's logits are computed (that is all generation needs)."""
        B, T = idx.shape
        t0 = 0 if cache is None else cache.t
        pos = torch.arange(t0, t0 + T, device=idx.device)
        if cache is not None:
            attn = cache.attend
        x = self.model.embed_tokens(idx)
        cos, sin = self.rope(pos, x.dtype)
        for i, block in enumerate(self.model.layers):
            x = block(x, cos, sin, lambda q, k, v, i=i: attn(i, q, k, v, pos))
        if cache is not None:
            cache.t += T
            x = x[:, -1:]
        logits = self.lm_head(self.model.norm(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)

    def rope(self, pos, dtype):  # cos, sin (T, D), computed in fp32 and cast as HF does
        D = self.config.head_dim
        inv = 1.0 / self.config.rope_theta ** (torch.arange(0, D, 2, device=pos.device).float() / D)
        f = pos.float()[:, None] * inv
        f = torch.cat((f, f), dim=-1)
        return f.cos().to(dtype), f.sin().to(dtype)

    @classmethod
    def from_pretrained(cls, path_or_repo, device=None, dtype=None):
        folder = checkpoint_dir(path_or_repo)
        config = Qwen3Config.from_json(os.path.join(folder, "config.json"))
        with torch.device("meta"):
            model = cls(config)
        want = {k: v.shape for k, v in model.state_dict().items()}
        sd = load_safetensors(folder)
        if config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)  # some tied checkpoints store the shared matrix twice
            want.pop("lm_head.weight")
        for name in sorted(want.keys() - sd.keys())[:1]:
            raise ValueError(f"{folder}: missing tensor {name} (this config.json expects it)")
        for name in sorted(sd.keys() - want.keys())[:1]:
            raise ValueError(f"{folder}: unexpected tensor {name} (not part of a Qwen3 model)")
        for name, shape in want.items():
            if sd[name].shape != shape:
                raise ValueError(f"{folder}: tensor {name} has shape {list(sd[name].shape)}, "
                                 f"config.json implies {list(shape)}")
        dtype = dtype or getattr(torch, config.torch_dtype)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        model.load_state_dict(sd, strict=False, assign=True)  # strict check done above, tied head aside
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        print(f"loaded {len(sd)} tensors ({sum(t.numel() for t in sd.values()) / 1e6:.1f}M parameters) "
              f"from {folder}", file=sys.stderr)
        return model.to(device=device, dtype=dtype).eval()

    def save_pretrained(self, folder):
        """A normal checkpoint folder (config.json + model.safetensors) that from_pretrained loads."""
        os.makedirs(folder, exist_ok=True)
        sd = {k: v for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight")
        save_safetensors(sd, os.path.join(folder, "model.safetensors"))
        dtype = str(next(self.parameters()).dtype).removeprefix("torch.")
        d = dict(self.config.to_dict(), torch_dtype=dtype)
        with open(os.path.join(folder, "config.json.tmp"), "w") as f:
            json.dump(d, f, indent=2)
        os.replace(os.path.join(folder, "config.json.tmp"), os.path.join(folder, "config.json"))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, stop=(), cache=None):
        """Stream (B,) next-token tensors. A KVCache sets the budget; default full.
        A sequence that produced a stop id keeps emitting it; generation ends when all have stopped."""
        B, T = idx.shape
        cache = cache or KVCache(self, B, T + max_new_tokens)
        logits = self(idx, cache=cache)[:, -1]
        done = torch.zeros(B, dtype=torch.bool, device=idx.device)
        for _ in range(max_new_tokens):
            nxt = sample_next(logits.float(), temperature, top_k, top_p)
            nxt = torch.where(done, idx.new_tensor(next(iter(stop), 0)), nxt) if stop else nxt
            yield nxt
            done |= torch.isin(nxt, idx.new_tensor(list(stop)))
            if done.all():
                return
            logits = self(nxt[:, None], cache=cache)[:, -1]


def sample_next(logits, temperature, top_k, top_p):  # logits (B, V) fp32 -> (B,)
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:  # nucleus: drop the tail whose mass before it already exceeds top_p
        sorted_logits, order = logits.sort(-1, descending=True)
        p = sorted_logits.softmax(-1)
        drop = p.cumsum(-1) - p > top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    return torch.multinomial(logits.softmax(-1), 1)[:, 0]


# ----------------------------------------------------------------------------------------------------------
# policies and the evicting cache (§1, §2, §6)

STATIC = ("streaming", "knorm", "random", "oracle")  # a priority per token, fixed once it leaves the window
DYNAMIC = ("h2o", "tova")  # scores that change with every query: online cache only
POLICIES = ("full",) + STATIC + DYNAMIC


def budget_size(budget, total, sinks=4, window=256, state=0):
    """§1: the per-head budget B from `budget` (a fraction 0 < x <= 1 of `total` tokens, or an integer
    B > 1) and the pool size k = B - sinks - window - state. B >= total means nothing is ever evicted."""
    try:
        x = float(budget)
    except (TypeError, ValueError):
        x = math.nan
    if not (0 < x <= 1 or (x > 1 and x == int(x))):
        raise ValueError(f"budget {budget!r}: use a fraction 0 < x <= 1 of the tokens or an integer B > 1")
    B = min(total, math.ceil(x * total) if x <= 1 else int(x))
    k = B - sinks - window - state
    if B < total and k < 0:
        raise ValueError(f"budget B = {B} leaves no room: sinks + window{' + state' * bool(state)} need "
                         f"B >= {sinks + window + state} (lower --window or raise --budget)")
    return B, k


def priority(policy, i, k, v, pos):
    """Static priorities (B, Hkv, n) of new tokens (§2, §6) in layer i: k, v (B, Hkv, n, D) cached after
    RoPE, at positions pos (n,). A callable policy (oracle, learned scorers) is asked directly. The online
    cache and the masked forward both call this, which is what makes them agree."""
    if callable(policy):
        return policy(i, k, v, pos)
    if policy == "streaming":  # pi[t] = t: the pool holds the most recent eligible tokens
        return pos.float().expand(k.shape[:3])
    if policy == "knorm":  # low key norm = important (KNorm). Rounded to bf16: a repeated token's keys
        # differ only by RoPE, which keeps the norm, so they must tie exactly in every pass (newer wins)
        return -k.float().norm(dim=-1).bfloat16().float()
    if policy == "random":  # a hash of (layer, head, position), so every pass draws the same numbers
        h = torch.arange(k.shape[1], device=pos.device)[:, None]
        x = (pos * 2654435761 + h * 40503 + i * 9973) % 2**32
        x = ((x ^ (x >> 16)) * 73244475) % 2**32
        return ((x ^ (x >> 16)).double() / 2**32).float().expand(k.shape[:3])
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")


def policy_kind(policy):
    """'static', 'dynamic' or 'full'. Callables (the oracle, learned scorers) give static priorities."""
    if callable(policy) or policy in STATIC[:3]:
        return "static"
    if policy == "oracle":
        raise ValueError("policy oracle needs the future: it exists for teacher-forced evaluation only")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    return "dynamic" if policy in DYNAMIC else "full"


def masked_attention(q, k, v, pi, sinks, window, pool):
    """The whole online process as one causal mask (§2): eviction times, then masked flash attention."""
    e = kernels.eviction_times(pi, sinks, window, pool)  # (B, Hkv, T)
    return kernels.attention(q, k, v, e, sinks)[0], e


def oracle_policy(model, idx, window):
    """§3: pi = r*, the future-attention target of every layer, from one dense forward pass."""
    r = []

    def attn(i, q, k, v, pos):
        y, lse = kernels.attention(q, k, v)
        r.append(kernels.future_attention(q, k, lse, window))  # (B, Hkv, T)
        return y
    model(idx, attn=attn)
    return lambda i, k, v, pos: r[i][:, :, pos]


class KVCache:
    """At most `size` entries per layer and KV head (§1) in dense (L, B, Hkv, size, D) buffers, so the
    memory saving is real. Slots fill from 0 and an evicted slot is reused by the newcomer, so the filled
    slots are always [0, min(t, size)). pos[slot] is the token's position (keys keep their RoPE), score[slot]
    its static priority or, for h2o/tova, its attention score."""

    def __init__(self, model, batch, size, policy="full", sinks=4, window=256):
        c, p = model.config, next(model.parameters())
        shape = (c.num_hidden_layers, batch, c.num_key_value_heads, size)
        self.k = torch.zeros(*shape, c.head_dim, dtype=p.dtype, device=p.device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full(shape, -1, dtype=torch.long, device=p.device)
        self.score = torch.zeros(shape, device=p.device)
        self.size, self.policy, self.sinks, self.window, self.t = size, policy, sinks, window, 0
        self.pool, self.kind = size - sinks - window, policy_kind(policy)

    def nbytes(self):
        return 2 * self.k.numel() * self.k.element_size()

    def attend(self, i, q, k, v, pos):  # layer i: q (B, Hq, T, D), new k, v (B, Hkv, T, D) at positions pos
        T = k.shape[2]
        if pos[0] == 0 and T > 1 and (T <= self.size or self.kind == "static"):
            return self.prefill(i, q, k, v, pos)
        # token by token: layer i's cache sees exactly the sequence of one-token decoding steps
        return torch.cat([self.step(i, q[:, :, j:j + 1], k[:, :, j:j + 1], v[:, :, j:j + 1], pos[j:j + 1])
                          for j in range(T)], dim=2)

    def prefill(self, i, q, k, v, pos):  # an empty cache takes a whole prompt at once
        T, S = k.shape[2], self.size
        static = self.kind == "static"
        pi = priority(self.policy, i, k, v, pos) if static else torch.zeros(k.shape[:3], device=k.device)
        if T <= S:  # nothing is evicted yet
            y, keep = kernels.attention(q, k, v)[0], torch.arange(T, device=k.device).expand(k.shape[:3])
        else:  # longer than the budget: the eviction-time mask, then keep what the last query still sees
            y, e = masked_attention(q, k, v, pi, self.sinks, self.window, self.pool)
            seen = (pos < self.sinks) | (e > T - 1)  # exactly S per head: sinks + window + pool
            keep = torch.sort(seen.byte(), dim=-1, descending=True, stable=True).indices[..., :S]
        n, D = keep.shape[-1], k.shape[-1]
        self.k[i, :, :, :n] = k.gather(2, keep[..., None].expand(-1, -1, -1, D))
        self.v[i, :, :, :n] = v.gather(2, keep[..., None].expand(-1, -1, -1, D))
        self.pos[i, :, :, :n], self.score[i, :, :, :n] = pos[keep], pi.gather(2, keep)
        return y

    def step(self, i, q, k, v, pos):  # one new token at position p = pos[0]
        p, S, B, H = int(pos[0]), self.size, k.shape[0], k.shape[1]
        P, sc = self.pos[i], self.score[i]  # (B, Hkv, S)
        if p < S:
            slot = torch.full((B, H), p, device=k.device)
        else:  # evict the lowest (score, position) of the eligible pool s <= t <= p - w (§2)
            ok = (P >= self.sinks) & (P <= p - self.window)
            low = sc.masked_fill(~ok, math.inf)
            low = P.masked_fill(~ok | (low > low.amin(-1, keepdim=True)), 2**62)
            slot = low.argmin(-1)  # (B, Hkv): among equal scores the older token goes
        s = slot[..., None, None].expand(-1, -1, 1, k.shape[-1])
        self.k[i].scatter_(2, s, k)
        self.v[i].scatter_(2, s, v)
        P.scatter_(2, slot[..., None], pos.expand(B, H, 1))
        new = priority(self.policy, i, k, v, pos) if self.kind == "static" else 0.0
        sc.scatter_(2, slot[..., None], torch.as_tensor(new, device=k.device).float().expand(B, H, 1))
        n, G = min(p + 1, S), q.shape[1] // H
        Kc, Vc = self.k[i, :, :, :n], self.v[i, :, :, :n]  # (B, Hkv, n, D), in slot order
        a = (q.view(B, H, G, -1).float() @ Kc.float().transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
        if self.policy == "h2o":  # accumulated attention (group mean)
            sc[..., :n] += a.mean(2)
        elif self.policy == "tova":  # the current query's attention (group mean)
            sc[..., :n] = a.mean(2)
        return (a @ Vc.float()).to(q.dtype).view(B, H * G, 1, -1)


@torch.no_grad()
def evaluate(model, idx, policy, budget, sinks=4, window=256, online=True):
    """Teacher-forced logits (B, T, vocab) of idx (B, T) under eviction with a per-head budget (§1).
    online=True feeds the tokens one at a time through the physically evicting KVCache; online=False runs
    one forward pass with the eviction-time mask (static policies only). The two must agree (§2)."""
    B, T = idx.shape
    S, pool = budget_size(budget, T, sinks, window)
    if policy == "oracle":
        policy = oracle_policy(model, idx, window)
    if online:
        cache = KVCache(model, B, S, policy, sinks, window)
        return torch.cat([model(idx[:, t:t + 1], cache=cache) for t in range(T)], dim=1)
    if policy_kind(policy) == "dynamic":
        raise ValueError(f"policy {policy} re-scores tokens at every query: it has no eviction-time mask, "
                         f"use online=True")
    if policy_kind(policy) == "full" or S >= T:
        return model(idx)

    def attn(i, q, k, v, pos):
        return masked_attention(q, k, v, priority(policy, i, k, v, pos), sinks, window, pool)[0]
    return model(idx, attn=attn)


# ----------------------------------------------------------------------------------------------------------
# command line: nanoGPT-style overrides of a script's module-level defaults


def configure(g, argv=None):
    """Override the simple module-level defaults in g from --key value / --key=value; --help lists them.
    A bad key or value exits with one line on stderr."""
    argv, prog = sys.argv[1:] if argv is None else argv, os.path.basename(g.get("__file__", "kvpop"))
    keys = {k for k, v in g.items() if not k.startswith("_") and type(v) in (bool, int, float, str)}
    if "-h" in argv or "--help" in argv:
        print(f"usage: python {prog} [--key value | --key=value] ...")
        for line in open(g["__file__"]):
            name = line.split("=")[0].strip()
            if line.startswith("# ---"):
                print(f"\n{line.strip('# -').strip()}:")
            elif name in keys and "#" in line:
                print(f"  --{name} {g[name]!r:<14} {line.split('#', 1)[1].strip()}")
        sys.exit(0)
    i = 0
    while i < len(argv):
        key, eq, val = argv[i].partition("=")
        key = key[2:].replace("-", "_")
        if not argv[i].startswith("--") or key not in keys:
            sys.exit(f"{prog}: unknown option {argv[i].partition('=')[0]!r} (see --help)")
        if not eq:
            if type(g[key]) is bool and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
                val = "true"  # a bare switch
            elif i + 1 == len(argv):
                sys.exit(f"{prog}: --{key} needs a value")
            else:
                i, val = i + 1, argv[i + 1]
        g[key] = parse_value(prog, key, val, type(g[key]))
        i += 1


def parse_value(prog, key, val, typ):
    try:
        if typ is bool:
            return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[val.lower()]
        x = typ(val)
        if typ is float and not math.isfinite(x):
            raise ValueError
        return x
    except (KeyError, ValueError):
        kind = {bool: "true or false", int: "an integer", float: "a number", str: "text"}[typ]
        sys.exit(f"{prog}: --{key} {val!r} is not {kind}")
