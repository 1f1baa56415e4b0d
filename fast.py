"""The fast forms: forms that exist only for speed, each tested equal to the definition in kvpop.py it speeds up
(fp64, to 1e-10: the tests) and used where it was measured to pay (LOG.md). `speed_up` puts a scorer on them; a run
with --plain leaves it on kvpop.py's definitions. First the memory kinds' chunked form of the recurrence, then the
decoding forms: each works on every layer at once, a scorer parameter (L, H, ...) read as (L, 1, H, ...) beside the
batch dim, one call a step where kvpop.Decoder makes one a layer.
"""

import math
import types

import torch
from torch.nn.functional import pad, silu, softplus

import kernels
import kvpop
from support import gpus
from kvpop import EPS, rms


def chunked(scorer, layer, x):
    """kvpop.MemoryScorer.recurrent in chunks (training, the masked pass, prefill): r (B, H, T) and the last state, [C; n] (B, H, M + 1,
    M) and its log-scale (B, H). In a chunk, F_q = log f_0 + .. + log f_q: C_q u = sum_{j <= q} exp(F_q - F_j +
    log i_j) v'_j (k'_j . u) over its tokens j, plus the state carried from before it, under one max a row."""
    T = x.shape[2]
    size, delay = scorer.d_mem, scorer.delay
    chunks = x.split(scorer.chunk, -2)
    keyed = scorer.written_under(x)  # what the keys are made of
    gates = [scorer.gates(layer, part) for part in chunks]
    log_inputs, log_forgets = zip(*gates)
    log_input = torch.cat(log_inputs, -1)  # (B, H, T)
    log_forget = torch.cat(log_forgets, -1)
    # decay[..., q + 1] = F_q, in fp64: differences of long sums
    decay = log_forget.double().cumsum(-1)
    decay = pad(decay, (1, 0))
    starts = range(0, T, scorer.chunk)
    # chunk c reads tokens reads[c] .. reads[c + 1] - 1
    reads = [max(start - delay, 0) for start in starts] + [T]
    # [C; n] = sum_j weight_j [v'_j; 1] k'_j^T over the tokens before the chunk, and its log-scale
    memory = x.new_zeros(*x.shape[:2], size + 1, size)
    scale = x.new_full(x.shape[:2], -math.inf)
    out = []
    spans = zip(starts, reads, reads[1:], chunks)
    for start, first, last, part in spans:
        end = start + part.shape[2]  # the chunk's tokens: start .. end - 1
        # the chunk's memory keys k' and values [v'; 1]
        k = keyed[..., start:end, :] @ scorer.wk[layer] / math.sqrt(size)  # (B, H, c, M)
        v = part @ scorer.wv[layer]
        v = pad(v, (0, 1), value=1.0)  # (B, H, c, M + 1)
        # the tokens read in it and their read vectors u
        xr = x[..., first:last, :]  # (B, H, R, X)
        t = torch.arange(first, last, device=x.device)
        u = xr @ scorer.wr[layer]  # (B, H, R, M)
        # the rows: each read's q, then the chunk's last token (where the state moves), as indices into decay
        read_at = (t + delay).clamp(max=T - 1)
        rows = [read_at, t.new_tensor([end - 1])]
        q = torch.cat(rows) + 1
        # log weight of the chunk's token j in row q: F_q - F_j + log i_j for j <= q, else -inf (B, H, R + 1, c)
        j = torch.arange(start + 1, end + 1, device=x.device)
        log_weight = decay[..., None, start + 1 : end + 1]
        log_weight = decay[..., q, None] - log_weight
        log_weight = log_weight.to(x.dtype)
        log_weight = log_weight + log_input[..., None, start:end]
        later = j > q[:, None]
        log_weight = log_weight.masked_fill(later, -math.inf)
        # the carried state's log-scale in row q; one max a row over both
        carried = decay[..., q] - decay[..., start, None]
        carried = carried.to(x.dtype)
        log_carried = scale[..., None, None] + carried[..., None]
        row_max = log_weight.amax(-1, keepdim=True)
        row_max = torch.maximum(row_max, log_carried)
        weight = (log_weight - row_max).exp()
        carry = (log_carried - row_max).exp()
        # the reads [C u; n . u]: the chunk's tokens, decay-masked (B, H, R, M + 1)
        y = u @ k.mT
        y = weight[..., :-1, :] * y
        y = y @ v
        # plus the carried state (none before chunk 0)
        if start:
            y = y + carry[..., :-1, :] * (u @ memory.mT)
        # h = C u / max(|n . u|, 1), stabilised; r = readout(x, rms(h))
        floor = (-row_max[..., :-1, :]).exp()
        divisor = torch.maximum(y[..., size:].abs(), floor)
        h = y[..., :size] / divisor
        out.append(scorer.readout(layer, xr, rms(h)))
        # the state moves to the chunk's last token
        written = v * weight[..., -1, :, None]
        written = written.mT @ k
        memory = carry[..., -1:, :] * memory + written
        scale = row_max[..., -1, 0]
    return torch.cat(out, -1), (memory, scale)


# a scorer parameter (L, H, ...) of every layer beside a batch dim: (L, 1, H, ...)
def every(param):
    return param[:, None]


# kvpop.Scorer.readout of every layer: x (L, B, H, I, X) and what the kind read z (L, B, H, I, Z) -> (L, B, H, I)
def readout(scorer, x, z):
    joined = torch.cat([x, z], -1)
    bias = every(scorer.b1)[..., None, :]
    return output(scorer, joined @ every(scorer.w1) + bias)


# w_2 . silu(a) + b_2 of every layer, from the read-out's pre-activation a (L, B, H, I, d_hidden)
def output(scorer, a):
    w2 = every(scorer.w2)[..., None, :]
    b2 = every(scorer.b2)[..., None]
    return (silu(a) * w2).sum(-1) + b2


# gamma_h t of every layer (L, 1, H, 1)
def recency(scorer, t):
    gamma = softplus(every(scorer.theta))
    return gamma[..., None] * t


class EveryLayer(kvpop.Decoder):
    """kvpop-mlp's decoding: the read-out of the leaving token t alone, every layer in one call."""

    def leaving(self, p):
        t = p - self.cache.window
        x = self.scorer.features(*self.cache.recent_kv(t))  # (L, B, H, 1, X)
        r = readout(self.scorer, x, x[..., :0])
        return r + recency(self.scorer, t)


class WindowRing(kvpop.Decoder):
    """kvpop-window's decoding: the features of t .. t + n, the tokens the next read sees, each made once, as it
    becomes t + n, in a ring of n + 1 (token u at u % (n + 1)), then `read`, kvpop.WindowScorer.look for one token
    with W_k and W_v folded into the read. The ring copies what the cache holds, so it is no state of the scorer's
    and is not charged to the budget; kvpop.Decoder reads the same tokens from the cache each step instead."""

    def __init__(self, scorer, cache):
        super().__init__(scorer, cache)
        grid = cache.pos.shape[:3]  # (L, B, H)
        shape = (*grid, scorer.span, scorer.width)
        self.ring = cache.pos.new_zeros(shape, dtype=scorer.theta.dtype)

    def prefill(self, layer, k, v, pos, a=None):
        """The prompt's priorities, and the ring: its tokens t .. t + n - 1 for the first t to leave, T - w."""
        first = k.shape[2] - self.cache.window
        last = first + self.scorer.span - 1
        u = torch.arange(max(first, 0), max(last, 0), device=k.device)
        keys = k[..., u, :]
        values = v[..., u, :]
        x = self.scorer.features(keys, values)
        slot = u % self.scorer.span
        self.ring[layer][..., slot, :] = x
        return self.scorer(layer, k, v, pos, a)

    def leaving(self, p):
        """Token t + n joins the ring, then t = p - w reads it. Before t + n >= 0 what joins is never read: token u
        is written at step u - n + w, after them."""
        t = p - self.cache.window
        n = self.scorer.span - 1
        x = self.scorer.features(*self.cache.recent_kv(t + n))
        slot = (t + n).view(-1) % (n + 1)
        self.ring[..., slot, :] = x
        order = torch.arange(n + 1, device=self.ring.device)
        order = t + order
        x = self.ring[..., order % (n + 1), :]  # t .. t + n
        a = self.cache.recent_received(t) if self.scorer.received else None  # (L, B, H, 1)
        return self.read(x, t, a)

    def read(self, x, t, a=None):
        """Every layer's priority (L, B, H, 1) of token t from the features x (L, B, H, 1 + n, X) of t and the n
        tokens after it, in position order. W_k and W_v are folded into the read, u_a = W_k,a (W_q x)_a / sqrt(d)
        and z_a = W_v,a^T (sum_o alpha_a[o] x[t + o]): the n tokens are never projected."""
        scorer = self.scorer
        x_t = x[..., :1, :]  # (L, B, H, 1, X)
        after = x[..., 1:, :]  # (L, B, H, n, X)
        reads = (scorer.reads, scorer.d_key)
        query = x_t @ every(scorer.wq)
        query = query[..., 0, :]
        query = query.unflatten(-1, reads)  # (L, B, H, A, d)
        wk = every(scorer.wk).unflatten(-1, reads)
        wv = every(scorer.wv).unflatten(-1, reads)
        u = torch.einsum("...ad,...xad->...ax", query, wk)
        u = u / math.sqrt(scorer.d_key)  # (L, B, H, A, X)
        logits = u @ after.mT + every(scorer.bo)
        alpha = logits.softmax(-1)  # (L, B, H, A, n): offsets 1..n
        pooled = alpha @ after
        z = torch.einsum("...ax,...xad->...ad", pooled, wv)  # (L, B, H, A, d)
        z = z.flatten(-2)[..., None, :]
        return readout(scorer, scorer.with_received(x_t, a), z) + recency(scorer, t)


class FoldedMemory(kvpop.Decoder):
    """kvpop's decoding, its plain recurrence (kvpop.MemoryScorer.recurrent) a token a step: every layer and head's
    memory [C; n] (M + 1, M) and its log-scale, charged to the budget, take each token once it is cached, the RMS of
    x = [k; v] folded into the update's weights; and, eagerly, the reads of the next c = min(w, 32) leaving tokens
    prepared together (the weights read once for c); kvpop.MemoryDecoder is the definition's decoding.
    Each token is written under its own key: a kind whose `written_under` differs needs its own
    `write` (experiments/shifted.py)."""

    def __init__(self, scorer, cache):
        super().__init__(scorer, cache)
        if scorer.arrival:
            ablation = "read on arrival (the delay ablation) runs in the masked pass only"
            raise ValueError(f"a {scorer.kind} scorer {ablation}")
        own = type(scorer).written_under is kvpop.MemoryScorer.written_under
        if not own and type(self).write is FoldedMemory.write:
            why = "writes each token under its own key, not its written_under"
            fix = "give it a form with its own `write` (experiments/shifted.py)"
            raise ValueError(f"fast.FoldedMemory {why} ({scorer.kind}): {fix}")
        grid = cache.pos.shape[:3]  # (L, B, H)
        size = scorer.d_mem
        shape = (*grid, size + 1, size)
        self.memory = cache.pos.new_zeros(shape, dtype=scorer.theta.dtype)
        self.scale = self.memory.new_full(grid, -math.inf)
        self.state = (self.memory, self.scale)
        # the update's weights, folded once: the scorer is frozen while decoding
        self.fold = self.folded()
        self.start = 0  # the tokens a prompt gave the memories
        # the prepared reads u, W_1 x: `block` of them, from token `first` on (none yet)
        self.block = min(cache.window, 32)
        self.first = cache.pos.new_tensor(-cache.window - self.block)
        reads = (*grid, self.block)
        u = self.memory.new_zeros(*reads, size)
        w1x = self.memory.new_zeros(*reads, scorer.d_hidden)
        self.prepared = (u, w1x)

    @torch.no_grad()
    def folded(self):
        """The update's weights with the RMS scale of the raw x = [k; v] folded in (rms(x) = sqrt(2D) x rsqrt(|x|^2 +
        2D eps)): z = W x rsqrt(|x|^2 + 2D eps) + b is [k'; v'; 1; log i; the forget gate's pre-activation] in one
        product, x^T W: W (L, 1, H, 2D, 2M + 3) (a row vector times a matrix stored row by row, the faster product on
        a CPU, LOG.md), b (L, 1, H, 1, 2M + 3)."""
        scorer = self.scorer
        one = torch.zeros_like(scorer.wi[..., None])  # its bias makes the 1 of [v'; 1]
        gates = [scorer.wi[..., None], scorer.wf[..., None]]
        key = scorer.wk / math.sqrt(scorer.d_mem)
        weight = torch.cat([key, scorer.wv, one, *gates], -1)
        biases = [torch.ones_like(scorer.bi), scorer.bi, scorer.bf]
        bias = torch.stack(biases, -1)
        bias = pad(bias, (2 * scorer.d_mem, 0))  # no bias on k', v'
        weight = (weight * math.sqrt(scorer.width)).contiguous()
        return weight[:, None], bias[:, None, :, None]

    def project(self, k, v):
        """[k'; v'; 1; log i; the forget gate's pre-activation] (L, B, H, 1, 2M + 3) of tokens with keys and values
        k, v (L, B, H, 1, D): x^T W rsqrt(|x|^2 + 2D eps) + b of their x = [k; v]."""
        weight, bias = self.fold
        x = torch.cat([k, v], -1).to(weight.dtype)  # (L, B, H, 1, 2D)
        square = (x * x).sum(-1, keepdim=True)
        inverse = torch.rsqrt(square + x.shape[-1] * EPS)
        return torch.addcmul(bias, x @ weight, inverse)

    def remember(self, z, key, take):
        """The memories take one more token, its value and gates z (project's), under `key` k' (L, B, H, 1, M), in
        place: [C; n] = f [C; n] + g [v'; 1] k'^T, stabilised by the log-scale s (L, B, H) as in xLSTM:
        s' = max(log f + s, log i), g = exp(log i - s'), f = exp(log f + s - s'). take (a bool tensor) False: the
        memories stay as they are (g = 0, f = 1), without a branch."""
        memory, scale = self.memory, self.scale
        size = self.scorer.d_mem
        log_input = z[..., 0, -2]  # (L, B, H)
        log_forget = scale - softplus(-z[..., 0, -1])  # log f + s
        new_scale = torch.maximum(log_input, log_forget)
        take = torch.as_tensor(take, device=memory.device)
        write = torch.where(take, (log_input - new_scale).exp(), 0.0)
        forget = torch.where(take, (log_forget - new_scale).exp(), 1.0)
        write = write[..., None, None]
        forget = forget[..., None, None]
        # in place, one pass for the product: memory (L, B, H, M + 1, M) as a batch of matrices
        value = z[..., size : 2 * size + 1]
        value = value.reshape(-1, size + 1, 1)  # [v'; 1]
        key = write * key
        key = key.view(-1, 1, size)  # g k'
        matrices = memory.mul_(forget).view(-1, size + 1, size)
        matrices.baddbmm_(value, key)
        scale.copy_(torch.where(take, new_scale, scale))

    def prepare(self, x):
        """What a read needs of tokens with features x (L, B, H, c, X) alone: u = W_r x and W_1's product with x in
        the read-out (made for c tokens at once, the weights are read once for c)."""
        scorer = self.scorer
        u = x @ every(scorer.wr)
        w1 = every(scorer.w1)[..., : scorer.width, :]
        return u, x @ w1

    def read(self, u, w1x, t):
        """The priority (L, B, H, 1) of the token at t from the memories as they are and its prepared u, W_1 x (L, B, H,
        1, ...): [C u; n . u] = [C; n] u, h = C u / max(|n . u|, exp(-s)), r = readout(x, rms(h)) + gamma_h t."""
        scorer, size = self.scorer, self.scorer.d_mem
        product = u @ self.memory.mT  # [C u; n . u] (L, B, H, 1, M + 1)
        floor = (-self.scale).exp()[..., None, None]
        divisor = torch.maximum(product[..., size:].abs(), floor)
        h = product[..., :size] / divisor
        w1 = every(scorer.w1)[..., scorer.width :, :]
        b1 = every(scorer.b1)[..., None, :]
        a = w1x + rms(h) @ w1 + b1
        return output(scorer, a) + recency(scorer, t)

    def prefill(self, layer, k, v, pos, a=None):
        """The prompt's priorities, and the memories after reading it."""
        x = self.scorer.features(k, v)
        r, (memory, scale) = chunked(self.scorer, layer, x)
        self.memory[layer] = memory
        self.scale[layer] = scale
        self.start = k.shape[2]
        return r + self.scorer.recency(layer, pos.to(r.dtype))

    def leaving(self, p):
        """The memories take token p - 1 (unless the prompt gave it), then t = p - w reads them (t < 0: a number
        the cache drops). Eagerly, the reads of t .. t + c - 1 are prepared at once as t passes the block (all
        cached: c <= w); in a compiled graph, t's own read each step: no branch and no host read, the step one
        graph (the weights W_r, W_1 read every step)."""
        take = p > self.start
        self.write(p, take)
        t = p - self.cache.window
        if torch.compiler.is_compiling():
            x = self.scorer.features(*self.cache.recent_kv(t))
            u, w1x = self.prepare(x)
        else:
            u, w1x = self.prepared_read(t)
        return self.read(u, w1x, t)

    # the memories take token p - 1 under its own key
    def write(self, p, take):
        z = self.project(*self.cache.recent_kv(p - 1))
        key = z[..., : self.scorer.d_mem]
        self.remember(z, key, take)

    # t's prepared read u, W_1 x (L, B, H, 1, ...): the block of t .. t + c - 1 made anew once t is past it
    def prepared_read(self, t):
        if not self.first <= t < self.first + self.block:
            block = torch.arange(self.block, device=t.device) + t
            x = self.scorer.features(*self.cache.recent_kv(block))
            self.prepared = self.prepare(x)
            self.first = t.clone()
        j = (t - self.first).view(1)
        u, w1x = self.prepared
        read = u.index_select(-2, j)
        return read, w1x.index_select(-2, j)


# kvpop.MemoryScorer.parallel in chunks
def chunked_parallel(scorer, layer, x):
    return chunked(scorer, layer, x)[0]


# ------------------------------------------------------------ the frozen model's pass, dense
ROWS = 256  # the dense pass's queries a block: memory O(B Hq ROWS T)


def dense_layer(q, k, v, window, reduce, received, output=True):
    """One layer's attention out (B, Hq, T, D) and lse (B, Hq, T) (kernels.attention), the
    future-attention reduce of p[d, t] over d >= t + w (kernels.future_attention's, before the
    log) and a[t] (kernels.window_received), (B, Hkv, G, T) and (B, Hkv, T), from one dense score block a ROWS
    queries: p[d, t] = exp(s[d, t] - lse[d]) serves the output and the target, the band
    (d - w, d] of the same scores a[t]. reduce None: no target (helpful: it needs the logits);
    output False: no out (None)."""
    (B, Hq, T, D), Hkv = q.shape, k.shape[1]
    G = Hq // Hkv
    q = kernels.wide(q).view(B, Hkv, G, T, D) * D**-0.5
    k, v = kernels.wide(k), kernels.wide(v)  # (B, Hkv, T, D)
    out = torch.empty_like(q) if output else None
    lse = q.new_empty(q.shape[:-1])  # (B, Hkv, G, T)
    future = torch.zeros_like(lse)  # the running max or sum over queries (B, Hkv, G, T)
    a = q.new_zeros(B, Hkv, T)  # the running max of the window's reads, over the group
    pos = torch.arange(T, device=q.device)
    for i in range(0, T, ROWS):
        end = min(i + ROWS, T)
        M = end - i
        rows, cols = pos[i:end].repeat(G)[:, None], pos[:end]  # (G M, 1), (end,)
        # the block's scores, the group's query heads one after another, causal, and softmax
        s = q[..., i:end, :].flatten(2, 3) @ k[..., :end, :].mT  # (B, Hkv, G M, end)
        s[..., i:].masked_fill_(cols[i:] > rows, -math.inf)
        p = s.softmax(-1)
        if output:
            out[..., i:end, :] = (p @ v[..., :end, :]).unflatten(2, (G, M))
        if reduce is None:  # helpful's target reads lse later
            lse[..., i:end] = s.logsumexp(-1).unflatten(2, (G, M))
        # keys before `first` are past the window of every query of the block
        first = max(i - window + 1, 0)
        band = rows - cols[first:] < window  # (G M, end - first): inside the window
        # the target: the reads from past the window, a running max or sum over queries
        if reduce is not None:
            near = p[..., first:].masked_fill(band, 0)
            reads = [x.unflatten(2, (G, M)) for x in (p[..., :first], near)]
            if reduce == "max":
                reads = torch.cat([x.amax(-2) for x in reads], -1)  # (B, Hkv, G, end)
                future[..., :end] = torch.maximum(future[..., :end], reads)
            else:
                future[..., :end] += torch.cat([x.sum(-2) for x in reads], -1)
        # a[t]: each query's softmax over its own window (d - w, d], of the same scores
        if received:
            inside = band & (cols[first:] <= rows)
            read = s[..., first:].masked_fill(~inside, -math.inf)
            read = read.softmax(-1).amax(-2)  # (B, Hkv, end - first)
            a[..., first:end] = torch.maximum(a[..., first:end], read)
    out = out.view(B, Hq, T, D) if output else None
    return out, lse.view(B, Hq, T), future, a


class Seen(Exception):
    """Raised by the last layer's attention in dense_targets: the rest of the pass (its output,
    o_proj, the MLP) computes nothing a target or a[t] reads."""


@torch.no_grad()
def dense_targets(model, idx, window, target=kvpop.TARGETS[0], received=False):
    """kvpop.dense_targets by one dense pass a layer (dense_layer): the output, the max and mean
    targets and a[t] from the same scores; helpful's target after the logits, as kvpop's. The
    Triton kernels' device, or kernels.PLAIN (--plain): kvpop.dense_targets."""
    if gpus.runs(idx) or kernels.PLAIN:
        return kvpop.dense_targets(model, idx, window, target, received)
    reduce = kvpop.REDUCE[target] if target != "helpful" else None
    seen, targets = [], []
    T = idx.shape[1]
    n = T - window - torch.arange(T, device=idx.device)  # N_t
    last = model.config.num_hidden_layers - 1

    def attn(layer, q, k, v, pos):
        done = layer == last and reduce is not None  # no logits wanted: the pass ends here
        out, lse, future, a = dense_layer(q, k, v, window, reduce, received, not done)
        seen.append((q, k, v, lse, a))
        if reduce == "mean":
            future = future / n.clamp(min=1)
        # log(eps + A), eps = kernels.future_attention's; the group's max
        r = torch.log(1e-6 + future).amax(2)
        targets.append(r.masked_fill(n <= 0, -math.inf))
        if done:
            raise Seen
        return out.to(q.dtype)

    try:
        logits = model(idx, attn=attn, logits=target == "helpful")
    except Seen:
        logits = None
    if target == "helpful":  # weighs each read by P[d]: lse[d] - log P[d]
        weight = kvpop.next_logp(logits, idx)
        reads = [(q, k, lse - weight) for q, k, _, lse, _ in seen]
        targets = [kernels.future_attention(*r, window, reduce="max") for r in reads]
    if received:
        return [(k, v, a) for _, k, v, _, a in seen], targets
    return [(k, v) for _, k, v, _, _ in seen], targets


# the kinds' fast decoding forms and whole-sequence forms; a kind not named runs its definition
FAST = {kvpop.MLPScorer: EveryLayer, kvpop.WindowScorer: WindowRing}
FAST[kvpop.MemoryScorer] = FoldedMemory
WHOLE = {kvpop.MemoryScorer: chunked_parallel}


def speed_up(scorer):
    """The scorer on its kind's fast forms, in place: how it decodes in the cache, and its whole-sequence form
    (training, the masked pass, prefill). Not called, it runs kvpop.py's definitions (--plain)."""
    form, whole = FAST.get(type(scorer)), WHOLE.get(type(scorer))
    if form:
        scorer.decoding = types.MethodType(form, scorer)
    if whole:
        scorer.parallel = types.MethodType(whole, scorer)
    return scorer
