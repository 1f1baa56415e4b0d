"""The levers tried on the code scorer (issue: learned eviction clearly better than recency on real text), each a
change to the default recipe (train.py --task code) registered or patched here, then train.py run as it is:

python -m experiments.levers train --lever reach --max_iters 200 --out_dir lv/reach
python -m experiments.levers eval --scorers lv/base,lv/reach --n 16

Levers: reach (kvpop-window's reads see the whole window, w - 1 tokens, not 32); pairwise (the boundary loss plus a
pairwise loss at every eviction: the teacher's evicted token below each token its pool keeps); margin (each boundary
term weighed by how clear the teacher's decision is); value (the max target
weighs each read by the norm of what it adds to the output, ||W_o,g v[t]||, KVzap's idea); none (the default recipe).
Larger read-outs, windows and more data are train.py's own flags (--d_hidden, --window, --max_iters). `eval` prints
KL and key top-1 (tools/measures.py's) per budget for streaming, the max oracle, the value oracle and each scorer,
with the paired per-file difference from streaming."""

import math
import runpy
import sys

import torch
from torch.nn.functional import logsigmoid

import fast
import kernels
import kvpop
import qwen3
from support import flags, tokenizer
from support.corpus import code_held_out
from tasks import evaluate
from tools.measures import file_metrics, interval, key_tokens


# ------------------------------------------------------------------------- reach: the whole window
class ReachScorer(kvpop.WindowScorer):
    """kvpop-window whose two reads see every token after t that the window holds as t leaves it."""

    kind = "kvpop-window-reach"
    ahead = 1 << 30


kvpop.SCORERS[ReachScorer.kind] = ReachScorer


# ------------------------------------------------------- pairwise: every eviction's competitors
def pairwise_loss(pi, teacher, budget):
    """At each step p where the teacher evicts a pool token ev[p] (not the newcomer), the mean over the tokens its pool
    keeps at p of softplus(pi[ev] - pi[kept]): the student should rank the evicted below each of them."""
    e = kernels.eviction_times(teacher, *budget)  # (B, H, T)
    T = pi.shape[-1]
    u = torch.arange(T)
    # ev[p]: the token step p evicts (-1: none)
    ev = torch.full((*pi.shape[:2], T + 1), -1, dtype=torch.long)
    ev.scatter_(-1, e, u.expand_as(e))
    ev = ev[..., :T]
    steps = ((ev >= 0) & (ev >= budget.sinks)).any((0, 1)).nonzero()[:, 0]
    steps = steps[::4]  # every 4th such step: a quarter of the work, the same pairs in expectation
    gone = ev[..., steps].clamp(min=0)  # (B, H, P)
    # the pool the teacher keeps at step p: eligible and still visible
    eligible = (u >= budget.sinks) & (u <= steps[:, None] - budget.window)  # (P, T)
    kept = eligible & (e[..., None, :] > steps[:, None])  # (B, H, P, T)
    margin = pi.gather(-1, gone)[..., None] - pi[..., None, :]  # (B, H, P, T)
    losses = -logsigmoid(-margin) * kept
    valid = (ev[..., steps] >= 0)[..., None]
    return (losses * valid).sum() / (kept * valid).sum().clamp(min=1)


def with_pairwise(boundary_loss):
    def loss(pi, teacher, qs, budgets, layers=1, allsum=None):
        base, hits = boundary_loss(pi, teacher, qs, budgets, layers, allsum)
        return base + pairwise_loss(pi, teacher, budgets[0]) / layers, hits

    return loss


# --------------------------------------------------------- margin: the clear decisions weigh most
def margin_boundary_loss(pi, teacher, qs, budgets, layers=1, allsum=None):
    """kvpop.boundary_loss with each (query, head) term weighed by how clear the teacher's decision is, |pi*[t_new] -
    pi*[t_bnd]| (LambdaRank's idea: a swap of near-ties costs nothing, of a large read and a small one much),
    normalised to mean 1 over each pool's keeps and drops."""
    loss, hits = 0.0, 0.0
    share = layers * len(budgets)
    for budget, q in zip(budgets, qs):
        e = kernels.eviction_times(teacher, *budget)
        keep, t_bnd = kernels.boundary(teacher, e, q, budget)
        t_new = (q - budget.window).expand(*pi.shape[:2], -1)
        margin = pi.gather(-1, t_new) - pi.gather(-1, t_bnd)  # (B, H, Q)
        clear = (teacher.gather(-1, t_new) - teacher.gather(-1, t_bnd)).abs().nan_to_num(0.0, 0.0, 0.0)
        y = 2 * keep.float() - 1
        weight = torch.zeros_like(clear)
        for side in (keep, ~keep):  # each side's weights sum to 1/2, as kvpop's omega's
            weight += side * clear / (2 * (side * clear).sum().clamp(min=1e-12))
        loss = loss + (weight * torch.nn.functional.softplus(-y * margin)).sum() / share
        counts = torch.stack([keep.sum(), (~keep).sum()]).clamp(min=1)
        omega = torch.where(keep, 0.5 / counts[0], 0.5 / counts[1])
        hits += (omega * ((margin > 0) == keep)).sum().item() / share
    return loss, hits


# -------------------------------------------------------------------------- value: what a read adds
def output_norms(model, layer, v):
    """||W_o,g v[t]|| (B, Hq, T): the norm of what token t's value adds to the output of query head g per unit of
    attention (W_o,g: o_proj's columns of head g)."""
    attn = model.model.layers[layer].self_attn
    Hq, D = attn.Hq, attn.D
    w = attn.o_proj.weight.view(-1, Hq, D).transpose(0, 1)  # (Hq, hidden, D)
    v = v.repeat_interleave(Hq // v.shape[1], 1)  # (B, Hq, T, D)
    return (v.float() @ w.float().mT).norm(dim=-1)


@torch.no_grad()
def value_targets(model, idx, window, target="max", received=False):
    """fast.dense_targets with the value-aware max target: r*[t] = max_g log(eps + ||W_o,g v[t]|| max_{q >= t + w}
    p_g[q, t]) (its plain definition: kernels.plain_future_attention's max with each column scaled by the norm)."""
    seen, targets = [], []
    T = idx.shape[1]
    n = T - window - torch.arange(T)

    def attn(layer, q, k, v, pos):
        out, _, future, a = fast.dense_layer(q, k, v, window, "max", received)
        norms = output_norms(model, layer, v).view(future.shape)  # (B, Hkv, G, T)
        r = torch.log(1e-6 + future * norms).amax(2)
        targets.append(r.masked_fill(n <= 0, -math.inf))
        seen.append((k, v, a) if received else (k, v))
        return out.to(q.dtype)

    model(idx, attn=attn, logits=False)
    return seen, targets


def value_oracle(model, idx, window):  # pi = the value-aware r*
    targets = value_targets(model, idx, window)[1]
    return lambda layer, k, v, pos: targets[layer][:, :, pos]


LEVERS = dict(none={}, reach=dict(kind=ReachScorer.kind), pairwise={}, margin={}, value={})


def train(lever, args):
    """train.py --task code with the lever applied, every other flag passed on."""
    if lever == "pairwise":
        kvpop.boundary_loss = with_pairwise(kvpop.boundary_loss)
    if lever == "margin":
        kvpop.boundary_loss = margin_boundary_loss
    if lever == "value":
        fast.dense_targets = value_targets
    kind = [f"--{k}={v}" for k, v in LEVERS[lever].items()]
    sys.argv = ["train.py", "--task", "code", *kind, *args]
    runpy.run_path("train.py", run_name="__main__")


# ------------------------------------------------------------------------------------------ eval
def evaluation(scorers, n, budgets, value, window=192, sinks=4):
    torch.set_num_threads(1)
    net = qwen3.Qwen3.from_pretrained("codebaby", "cpu", torch.float32).requires_grad_(False)
    tok = tokenizer.Tokenizer.from_pretrained("codebaby")
    idx = code_held_out(tok, "torch", 2048, n)
    T = idx.shape[1]
    policies = {"streaming": "streaming", "oracle (max)": "oracle"}
    if value:
        policies["oracle (value)"] = value_oracle(net, idx, window)
    for folder in scorers:
        policies[folder] = kvpop.load_scorer(folder)
    full = evaluate(net, idx, "full", 1, sinks, window, False).float().log_softmax(-1)
    print(f"{len(idx)} held-out files; KL, key top-1, KL - streaming's (paired, per file), mean ± 95%")
    for budget in budgets:
        S = kvpop.budget_size(budget, T, sinks, window)[0]
        found = {}
        for name, policy in policies.items():
            lp = evaluate(net, idx, policy, budget, sinks, window, False, "max").float().log_softmax(-1)
            if name == "streaming":
                key = key_tokens(full, lp, idx, S)
            found[name] = file_metrics(full, lp, idx, S, key)
        for name, m in found.items():
            kl, kl_ci = interval(m["kl"])
            key1, key1_ci = interval(m["key_top1"])
            diff, diff_ci = interval(m["kl"] - found["streaming"]["kl"])
            cells = f"KL {kl:.4f} ± {kl_ci:.4f}  key top-1 {key1:.1%} ± {key1_ci:.1%}"
            print(f"{budget:g} {name:>40}: {cells}  paired {diff:+.4f} ± {diff_ci:.4f}", flush=True)


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "train":
        lever = rest[rest.index("--lever") + 1]
        others = [a for i, a in enumerate(rest) if a != "--lever" and rest[i - 1] != "--lever"]
        train(lever, others)
    else:
        opts = dict(scorers="", n=16, budgets="0.25,0.125", value=False)
        flags.configure(opts, rest)
        budgets = [float(b) for b in opts["budgets"].split(",")]
        evaluation([s for s in opts["scorers"].split(",") if s], opts["n"], budgets, opts["value"])
