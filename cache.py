"""The evicting KV cache: kvpop.evict's rule for every layer, batch row and KV head at once, the
fast form of one decoding step (README, How it works). It only evicts: slots, positions, priorities,
the rule (`lowest`), put, attention, prefill. A learned policy's decoder (its kind's `decoding`:
kvpop.py's definition, or fast.py's form) gives it the priority of each token as it leaves the
window; the cache knows no scorer's kind. Under kernels.PLAIN (--plain) it takes every token a step
at a time, no prefill, and chooses by kvpop.evict itself, a head at a time (`by_rule`). First, how
it reads a policy.

"""

import itertools
import math

import torch

import kernels
from kvpop import DYNAMIC, POLICIES, STATIC, Budget, Scorer, evict, masked_attention


def resolve(policy):
    """A policy's rule and priority function, the cache's and the masked pass's: 'static' (a
    heuristic, or the oracle's callable): given on arrival, cast once to fp32; 'learned' (a Scorer,
    itself the function): given as the token leaves the window; 'dynamic': its update of the priorities;
    'full': None."""
    if isinstance(policy, Scorer):
        return "learned", policy
    if callable(policy) or policy in STATIC:
        given = STATIC.get(policy, policy)
        return "static", lambda *args: given(*args).float()
    if policy in DYNAMIC:
        return "dynamic", DYNAMIC[policy]
    if policy == "full":
        return "full", None
    if policy == "oracle":
        raise ValueError("policy oracle needs the future: it is for teacher-forced evaluation only")
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")


class KVCache:
    """Buffers allocated once: `slots` = S - m entries a layer and head, keys (L, B, H, slots, D)
    and values transposed (L, B, H, D, slots), so both products of a step read their matrix row by
    row, the layout that streams memory fastest. Filled slots are [0, min(t, slots)); an evicted
    slot goes to the newcomer, in place. pos[slot]: its token's position (-1: empty); recent[t % w]:
    the slot of window token t; pi[slot]: its priority (a static policy's, given on arrival; a
    learned scorer's, as the token leaves the window; h2o's and tova's attention). t: the tokens
    taken so far, the next newcomer's position p, a tensor (qwen3's forward advances it). A decoding
    step has the same shapes and no Python branch on t from the first step on, so it can be one
    graph (torch.compile, CUDA graphs)."""

    def __init__(self, model, batch, slots, policy="full", sinks=4, window=256):
        config, param = model.config, next(model.parameters())
        self.rule, self.priority = resolve(policy)
        self.policy, self.slots = policy, slots
        self.sinks, self.window = sinks, window
        self.plain = kernels.PLAIN  # the rule by kvpop.evict, every token a step
        self.budget = Budget(sinks, window, slots - sinks - window)
        self.t = torch.tensor(0, device=param.device)
        learned = self.rule == "learned"
        if learned:
            policy.check(config, window)
        # priorities in a learned scorer's dtype (fp64 beside an fp64 model), else fp32
        dtype = policy.theta.dtype if learned else torch.float32
        heads = config.num_key_value_heads
        shape = (config.num_hidden_layers, batch, heads, slots)
        self.k = param.new_zeros(*shape, config.head_dim)
        self.v = self.k.transpose(-1, -2).contiguous()
        self.pos = torch.full(shape, -1, device=param.device)
        self.pi = torch.zeros(shape, dtype=dtype, device=param.device)
        # a scorer that reads a[t]: the running max of the attention each window token received
        self.reads_received = learned and policy.received
        self.received = torch.zeros(shape, device=param.device) if self.reads_received else None
        self.recent = self.pos.new_zeros(*shape[:3], window)
        # per-layer views, made once: a step indexes less
        layers = zip(self.k, self.v, self.pi)
        self.layer = list(layers)
        # every layer's slot (L, B, H, 1) for this step's newcomer, set at layer 0
        self.new = None
        self.decoder = policy.decoding(self) if learned else None

    def nbytes(self):  # keys, values and a learned scorer's state
        state = sum(x.nbytes for x in self.decoder.state) if self.decoder else 0
        entry = self.k.numel() * self.k.element_size()
        return 2 * entry + state

    # can T > 1 tokens come in one pass? (else the model feeds them one at a time; --plain: always)
    def whole(self, T):
        evicting = self.rule in ("static", "learned")
        return int(self.t) == 0 and not self.plain and (T <= self.slots or evicting)

    # one layer: q (B, Hq, T, D), new k, v (B, H, T, D) at positions pos; inference only: no graph
    @torch.no_grad()
    def attend(self, layer, q, k, v, pos):
        if k.shape[2] > 1:
            return self.prefill(layer, q, k, v, pos)
        return self.step(layer, q, k, v, pos)

    def prefill(self, layer, q, k, v, pos):
        """An empty cache takes a whole prompt at once and ends exactly as if fed token by token."""
        T = k.shape[2]
        pi = torch.zeros(k.shape[:3], device=k.device)
        if self.rule == "static":
            pi = self.priority(layer, k, v, pos)
        # a learned policy's priorities: 0 for the tokens still in the window (not scored yet)
        a = kernels.window_received(q, k, self.window) if self.reads_received else None
        if self.rule == "learned":
            pi = self.decoder.prefill(layer, k, v, pos, a)
            pi = pi.masked_fill(pos > T - 1 - self.window, 0.0)
        # nothing is evicted yet
        if T <= self.slots:
            out, lse = kernels.attention(q, k, v)
            keep = torch.arange(T, device=k.device)
            keep = keep.expand(k.shape[:3])
            if self.rule == "dynamic":
                pi = dynamic_priorities(self.policy, q, k, lse)
        # longer than the budget (static, learned): the eviction-time mask; keep what the last query
        # still sees, exactly `slots` a head: sinks + window + pool, in position order
        else:
            out, e = masked_attention(q, k, v, pi, self.budget)
            seen = (pos < self.sinks) | (e > T - 1)
            seen = seen.byte()
            order = seen.sort(dim=-1, descending=True, stable=True)
            keep = order.indices[..., : self.slots]
        pi = pi.gather(2, keep)
        self.store(layer, keep, k, v, pos[keep], pi)
        if self.reads_received:
            self.received[layer, :, :, : keep.shape[-1]] = a.gather(2, keep)
        # the last tokens, still in the window, fill the last kept slots (kept in position order)
        last = min(T, self.window)
        count = keep.shape[-1]
        slots = torch.arange(count - last, count, device=k.device)
        ring = pos[-last:] % self.window
        self.recent[layer][..., ring] = slots
        return out

    # one layer's kept keys and values (B, H, count), positions and priorities, into its first slots
    def store(self, layer, keep, k, v, pos, pi):
        count = keep.shape[-1]
        D = k.shape[-1]
        rows = keep[..., None].expand(-1, -1, -1, D)
        keys = k.gather(2, rows)
        self.k[layer, :, :, :count] = keys
        values = v.gather(2, rows)
        self.v[layer, :, :, :, :count] = values.mT
        self.pos[layer, :, :, :count] = pos
        self.pi[layer, :, :, :count] = pi

    def step(self, layer, q, k, v, pos):
        """One layer's decoding step for the newcomer p = self.t: at layer 0 `decide` applies the
        rule to every layer at once (a layer's decision reads only what it stored before this step);
        then the newcomer's key and value go to its slot, and it attends."""
        if layer == 0:
            self.new = self.decide(self.t)
        self.put(layer, self.new[layer], k, v, pos)
        return self.attention(layer, q)

    def decide(self, p):
        """Every layer's slot (L, B, H, 1) for the newcomer p: a learned policy first gives token p
        - w, leaving the window, its priority; then the next free slot while there is one, else the
        slot of the eligible token (sinks <= t <= p - w) with the lowest (priority, position). The
        newcomer's position, and its priority (0) under a learned policy (not scored until it leaves
        the window) or a dynamic one, go in here."""
        # a learned policy's decoder scores the leaving token p - w in its slot (none before one)
        if self.decoder:
            r = self.decoder.leaving(p)  # (L, B, H, 1)
            leaving = self.slot_of(p - self.window)
            old = self.pi.gather(-1, leaving)
            r = torch.where(p >= self.window, r, old)
            self.pi.scatter_(-1, leaving, r)
        # the next free slot while there is one, else the lowest eligible (both made: no branch)
        free = p.expand(*self.pos.shape[:3], 1)  # (L, B, H, 1)
        lowest = self.by_rule(p) if self.plain else self.lowest(p)
        slot = torch.where(p < self.slots, free, lowest)
        self.pos.scatter_(-1, slot, free)
        ring = (p % self.window).view(1)
        self.recent.index_copy_(-1, ring, slot)
        if self.rule in ("learned", "dynamic"):
            self.pi.scatter_(-1, slot, 0.0)
        if self.reads_received:
            self.received.scatter_(-1, slot, 0.0)
        return slot

    def lowest(self, p):
        """Every layer's slot (L, B, H, 1) of the eligible token with the lowest (priority, position),
        past the sinks' slots [0, sinks)."""
        held = self.pos[..., self.sinks :]
        pi = self.pi[..., self.sinks :]
        # ineligible tokens at inf, above any eligible one (torch.where: one pass a table)
        young = held > p - self.window
        low = torch.where(young, math.inf, pi)
        least = low.amin(-1, keepdim=True)
        # of the lowest, the oldest (the others at a position above any)
        oldest = torch.where(low > least, 2**62, held)
        return oldest.argmin(-1, keepdim=True) + self.sinks

    def by_rule(self, p):
        """`lowest`'s slots (L, B, H, 1) by kvpop.evict itself, a head at a time (--plain; it reads
        the host, so no graph)."""
        slot = torch.zeros_like(self.pos[..., :1])
        for head in itertools.product(*map(range, self.pos.shape[:3])):
            held = self.pos[head].tolist()  # a slot's position, -1: empty
            pi = dict(zip(held, self.pi[head].tolist()))
            taken = [t for t in held if t >= 0]
            gone = evict(taken, pi, int(p), self.budget)  # None while there is room
            slot[head] = held.index(gone) if gone is not None else 0
        return slot

    # every layer's slots (L, B, H, n) of the window tokens at positions u (a tensor)
    def slot_of(self, u):
        ring = u.view(-1) % self.window
        return self.recent.index_select(-1, ring)

    # every layer's keys and values (L, B, H, n, D) of the window tokens at positions u (a tensor)
    def recent_kv(self, u):
        slot = self.slot_of(u)[..., None]  # (L, B, H, n, 1)
        D = self.k.shape[-1]
        rows = slot.expand(-1, -1, -1, -1, D)
        keys = self.k.gather(3, rows)
        values = self.v.gather(4, rows.mT)
        return keys, values.mT

    # every layer's a (L, B, H, n) of the window tokens at positions u (a tensor), so far
    def recent_received(self, u):
        return self.received.gather(-1, self.slot_of(u))

    def put(self, layer, slot, k, v, pos):
        """One layer's newcomer key and value (and a static policy's priority) into its slot (B, H,
        1)."""
        keys, values, held_pi = self.layer[layer]  # (B, H, slots, D), (B, H, D, slots), (B, H, slots)
        D = k.shape[-1]
        rows = slot[..., None].expand(-1, -1, 1, D)
        keys.scatter_(2, rows, k)
        values.scatter_(3, rows.mT, v.mT)
        if self.rule == "static":
            pi = self.priority(layer, k, v, pos)
            held_pi.scatter_(2, slot, pi)

    def receive(self, layer, logits):
        """The newcomer d's attention over its window (d - w, d] alone, softmax there, its group's
        max, into the running max a of each window token (B, H, slots): kernels.window_received, a
        query at a time."""
        held = self.pos[layer]
        # (B, H, slots): the window, the newcomer with it
        inside = (held > self.t - self.window) & (held >= 0)
        probs = logits.masked_fill(~inside[:, :, None], -math.inf).softmax(-1)
        probs = probs.amax(-2)  # (B, H, slots)
        a = self.received[layer]
        a.copy_(torch.where(inside, torch.maximum(a, probs), a))

    def attention(self, layer, q):
        """The newcomer's attention (B, Hq, 1, D) over one layer's slots, empty ones masked, in slot
        order, in the cache's dtype; a dynamic policy updates its scores from it."""
        keys, values, held_pi = self.layer[layer]
        batch, heads, _, D = keys.shape
        query = q.view(batch, heads, -1, D).mT
        query = query.to(keys.dtype)  # (B, H, D, G)
        logits = (keys @ query).mT  # (B, H, G, used): a softmax along memory
        logits = kernels.wide(logits) / math.sqrt(D)
        empty = self.pos[layer, :, :, None] < 0  # (B, H, 1, slots)
        logits = logits.masked_fill(empty, -math.inf)
        attention = logits.softmax(-1)
        if self.rule == "dynamic":
            self.priority(held_pi, attention.mean(-2))
        if self.reads_received:
            self.receive(layer, logits)
        attention = attention.to(values.dtype)
        out = attention @ values.mT  # (B, H, G, D)
        out = out.to(q.dtype)
        return out.view(batch, -1, 1, D)


def dynamic_priorities(policy, q, k, lse):
    """h2o's and tova's prefill (B, H, T): what they hold after a prompt fed token by token without
    eviction, the group-mean attention each key received (h2o: from every query; tova: the last),
    from a causal pass's lse (B, Hq, T), 128 queries a time."""
    batch, heads = k.shape[:2]
    T, D = k.shape[2:]
    group = q.shape[1] // heads
    t = torch.arange(T, device=q.device)
    received = torch.zeros(batch, heads, T, device=q.device)
    keys = k.float()[:, :, None].mT  # (B, H, 1, D, T)
    first = 0 if policy == "h2o" else T - 1
    for j in range(first, T, 128):
        queries = q[:, :, j : j + 128].float()
        queries = queries.view(batch, heads, group, -1, D)
        norms = lse.view(batch, heads, group, T)
        norms = norms[..., j : j + 128, None]
        logits = queries @ keys / math.sqrt(D)
        probs = (logits - norms).exp()  # (B, H, G, M, T)
        unseen = t > t[j : j + 128, None]
        probs = probs.masked_fill(unseen, 0)
        received += probs.mean(2).sum(-2)
    return received
