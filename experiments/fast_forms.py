"""Does each fast decoding form pay? A random Qwen3 of bench.py speed's shape takes decoding steps with every learned
kind, through its form in fast.py and by its definition (the kind's `decoding` in kvpop.py), beside streaming, the rounds interleaved so that the machine's noise falls on all alike -> tokens/s and the ratio to
streaming (LOG.md, 2026-12-06: the refactor).

python -m experiments.fast_forms --layers 28 --context 8192
"""

import copy
import types

import torch

from tools import speed, timing
import fast
import kvpop
import qwen3
from support import flags

# --- what to measure
shape = "0.6B"  # Qwen3 shape of the random model (bench.py speed's)
layers = 28  # its layers
context = 8192  # tokens the cache has read
budget = 0.25  # fraction of them kept per head
steps = 16  # rounds timed (the median is kept), after one warm-up round
compile = False  # each step one compiled graph (inductor on a CPU)
flags.configure(globals())

torch.set_num_threads(torch.get_num_threads())
count, hidden, intermediate, query_heads, tied = speed.SHAPES[shape]
config = qwen3.Qwen3Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers)
config.num_attention_heads, config.tie_word_embeddings = query_heads, tied
config.max_position_embeddings = 131072
opts = types.SimpleNamespace(sinks=4, window=256)
dtype = torch.float32
torch.manual_seed(0)
net = speed.shape_model(config, "cpu", dtype).requires_grad_(False)
step = torch.compile(net, fullgraph=True, dynamic=False) if compile else net
# each run: streaming, then every kind by its fast form and by its definition
runs = {"streaming": "streaming"}
for kind, cls in kvpop.SCORERS.items():
    scorer = cls(config, opts.window, 128).eval()
    runs[f"{kind} fast"] = fast.speed_up(copy.deepcopy(scorer))
    runs[f"{kind} definition"] = scorer
caches = {}
for name, policy in runs.items():
    cache = speed.empty_cache(net, policy, budget, context, context + steps + 1, opts, dtype)
    speed.fill(cache, context)
    caches[name] = cache, []
token = torch.tensor([[13]])
for _ in range(steps + 1):
    for cache, seconds in caches.values():
        seconds.append(timing.clock(lambda: step(token, cache=cache), "cpu"))
median = {name: sorted(seconds[1:])[steps // 2] for name, (cache, seconds) in caches.items()}
print(f"Qwen3-{shape} shape, {layers} layers, context {context}, budget {budget}, compile {compile}\n")
print(timing.table("decoding,tokens/s,of streaming"))
for name, seconds in median.items():
    print(f"| {name} | {1 / seconds:.2f} | {median['streaming'] / seconds:.3f} |")
