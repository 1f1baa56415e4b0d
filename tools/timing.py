"""Timing and memory of a run, for bench.py kernels and speed: wall seconds (a GPU waited on), the
peak bytes its tensors hold, the torch ops it dispatches; and a markdown table's header."""

import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


# the storages of the tensors among xs
def storages(xs):
    tensors = [x for x in xs if isinstance(x, torch.Tensor)]
    return [x.untyped_storage() for x in tensors]


class Meter(TorchDispatchMode):
    """The ops dispatched while active: how many (calls), and the peak of the bytes held by the
    storages they create (peak, on a CPU; a storage leaves the count when freed). A compiled graph
    runs under it untraced: its calls are the ops the graph leaves to torch (inductor's C++ and
    Triton kernels dispatch none)."""

    def __init__(self):
        super().__init__()
        self.live = {}  # data pointer -> bytes
        self.now = self.peak = self.calls = 0

    # a compiled graph runs under the meter (else dynamo leaves the frame to eager torch, or fullgraph raises)
    @classmethod
    def ignore_compile_internals(cls):
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        out = func(*args, **(kwargs or {}))
        # outputs on an input's storage: views, in-place
        ins = {s.data_ptr() for s in storages(args)}
        outs = out if isinstance(out, (tuple, list)) else [out]
        for s in storages(outs):
            ptr, size = s.data_ptr(), s.nbytes()
            if size and ptr not in ins and ptr not in self.live:
                self.live[ptr] = size
                self.now += size
                self.peak = max(self.peak, self.now)
                weakref.finalize(s, self._free, ptr)
        return out

    def _free(self, ptr):
        self.now -= self.live.pop(ptr)


# wall seconds of one run: a GPU runs asynchronously, so wait for it before and after
def clock(fn, dev):
    sync = torch.cuda.synchronize if dev != "cpu" else lambda: None
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


# (seconds, peak bytes allocated above what was live before) of one run of fn
def peak(fn, dev):
    if dev == "cpu":
        with Meter() as meter:
            return clock(fn, dev), meter.peak
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    return clock(fn, dev), torch.cuda.max_memory_allocated() - base


# the torch ops one run of fn dispatches (a compiled fn: those its graph leaves to torch)
def calls(fn):
    with Meter() as meter:
        fn()
    return meter.calls


# a markdown table's header from its comma-separated column names, then the rule under it
def table(cols):
    header = "| " + cols.replace(",", " | ") + " |\n"
    rule = "|---" * (cols.count(",") + 1) + "|"
    return header + rule
