"""kernels.py's Triton kernels compiled for GPUs without one, by the ptxas inside the triton wheel: for each launch
kernels.launch_config chooses on a GPU, the shared memory a block asks against the GPU's limit, the registers and the
spills (bench.py kernels --targets, the tests)."""

import contextlib
import io
import itertools
import os
import re

import torch

import kernels

# the shared memory a block may opt in to, KiB (CUDA C++ Programming Guide, technical specifications per capability)
SHARED_KIB = {"sm_75": 64, "sm_80": 163, "sm_86": 99, "sm_89": 99, "sm_90": 227, "sm_120": 99}
# the kernels' arguments but the pointers to q, k, v and out (Q, K, V, Out), which have the inputs' dtype
ARGUMENT_TYPES = {"E": "*i64", "LSE": "*fp32", "R": "*fp32", "PRIORITY": "*fp64", "scale": "fp32", "eps": "fp32"}
ARGUMENT_TYPES |= dict.fromkeys(("T", "D", "group", "sinks", "window", "pool"), "i32")
# the attention and future kernels as they launch: a name, the kernel, its flag
LAUNCHES = [("attention" + "+evict" * evict, kernels._attention_kernel, {"HAS_E": evict}) for evict in (False, True)]
LAUNCHES += [(f"future {reduce}", kernels._future_kernel, {"MAX": reduce == "max"}) for reduce in ("mean", "max")]


def ptxas():  # where the triton wheel keeps its ptxas (absent: nothing compiles)
    return os.path.join(os.path.dirname(kernels.triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_for_gpu(target, kernel, dtype, config, **constexprs):
    """The kernel compiled for a GPU (target "sm_89") as it launches on dtype tensors, no GPU needed -> (shared memory
    a block asks, registers a thread, bytes spilled)."""
    triton = kernels.triton
    constants = constexprs | {name: value for name, value in config.items() if name.startswith("BLOCK")}
    pointer = "*" + {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, "fp64")
    types = {name: ARGUMENT_TYPES.get(name, pointer) for name in kernel.arg_names if name not in constants}
    # pointers 16-byte aligned and D a multiple of 16, as torch's tensors and head_dims 64-256 are at launch
    aligned = [name for name in types if types[name][0] == "*" or name == "D"]
    hints = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = triton.compiler.ASTSource(kernel, types, constants, hints)
    gpu = triton.backends.compiler.GPUTarget("cuda", int(target[3:]), 32)
    options = {name: value for name, value in config.items() if name.startswith("num")}
    # compiled afresh (not read from triton's cache), printing ptxas -v's log: the registers and spills
    knobs = triton.knobs
    with knobs.nvidia.scope(), knobs.compilation.scope():
        knobs.nvidia.dump_ptxas_log = knobs.compilation.always_compile = True
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            compiled = triton.compile(source, target=gpu, options=options)
    log = printed.getvalue()
    registers = re.search(r"Used (\d+) registers", log)[1]
    spilled = re.search(r"(\d+) bytes spill stores", log)[1]
    return compiled.metadata.shared, int(registers), int(spilled)


def compile_targets(targets):
    """Every kernel compiled for each GPU of targets (e.g. ["sm_75", "sm_89"]) in float32, bfloat16 and float16 at
    head_dim 64, 128 and 256, in the launch configuration kernels.py chooses there: a row at a time (each compile takes
    seconds), a kernel's or a refused dtype and head_dim's (kernel "all", refused: the one line)."""
    for target in targets:
        limit = SHARED_KIB[target] * 1024
        # eviction_times' kernel reads fp64 priorities, whatever the model's dtype and head_dim
        launches = [("eviction_times", kernels._evict_kernel, {}, "float64", None, kernels.EVICT_CONFIG)]
        for dtype, head_dim in itertools.product(("float32", "bfloat16", "float16"), (64, 128, 256)):
            try:
                config = kernels.launch_config(int(target[3:]), limit, getattr(torch, dtype), head_dim)
                launches += [(*launch, dtype, head_dim, config) for launch in LAUNCHES]
            except ValueError as refused:  # one line, before any launch
                yield dict(kernel="all", target=target, dtype=dtype, head_dim=head_dim, refused=str(refused))
        for name, fn, constexprs, dtype, head_dim, config in launches:
            shared, registers, spills = compile_for_gpu(target, fn, dtype, config, **constexprs)
            tiles = "x".join(str(v) for k, v in config.items() if k.startswith("BLOCK") and k != "BLOCK_D")
            row = dict(kernel=name, target=target, dtype=dtype, head_dim=head_dim, tiles=tiles)
            row.update(stages=config["num_stages"], warps=config["num_warps"], shared=shared, limit=limit)
            yield dict(row, registers=registers, spills=spills, ok=shared <= limit)
