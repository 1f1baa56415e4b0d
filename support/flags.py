"""Command line, nanoGPT style: a script's module-level defaults, overridden as --key value."""

import math
import os
import re
import sys

import torch

# in error messages
TYPES = {bool: "true or false", int: "an integer", float: "a finite number", str: "text"}


def configure(g, argv=None):
    """Override the simple module-level defaults in g from --key value / --key=value (-> the keys given); --help
    lists them under their headings. A bad key or value exits with one line on stderr. g["__prog__"], if set, names
    the command in messages (bench.py's commands pass a copy of their own defaults)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = g.get("__prog__") or os.path.basename(g.get("__file__", "kvpop"))
    keys = {k for k, v in g.items() if not k.startswith("_") and type(v) in TYPES}
    if "-h" in argv or "--help" in argv:
        out = [f"usage: python {prog} [--key value | --key=value] ..."]
        for line in open(g["__file__"]):
            # the defaults end where they are read, or where the code begins
            if "configure(globals()" in line or line.startswith(("def ", "class ", "@")):
                break
            if line.startswith("# ---"):
                out.append(f"\n{line.strip('# -').strip()}:")
            elif (name := line.split("=")[0].strip()) in keys and "#" in line:
                out.append(f"  --{name} {g[name]!r}".ljust(36) + " " + line.split("#", 1)[1].strip())
        out = [x for x, y in zip(out, out[1:] + ["\n"]) if not (x.endswith(":") and y[0] == "\n")]
        try:
            print("\n".join(out), flush=True)
        # `--help | head` closed the pipe early: not an error, and no traceback
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    given = set()  # the keys set on the command line
    while argv:  # our own copy: taken apart from the front
        opt, eq, val = argv.pop(0).partition("=")
        key = opt[2:].replace("-", "_")
        if not opt.startswith("--") or key not in keys:
            sys.exit(f"{prog}: unknown option {opt!r} (see --help)")
        if not eq and type(g[key]) is bool and (not argv or argv[0].startswith("--")):
            val = "true"  # a bare switch
        elif not eq:
            val = argv.pop(0) if argv else sys.exit(f"{prog}: --{key} needs a value")
        g[key] = parse_value(prog, key, val, type(g[key]))
        given.add(key)
    return given


def parse_value(prog, key, val, typ):
    try:
        x = (
            {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[val.lower()]
            if typ is bool
            else typ(val)
        )
        if typ is not float or math.isfinite(x):
            return x
    except (KeyError, ValueError):
        pass
    sys.exit(f"{prog}: --{key} {val!r} is not {TYPES[typ]}")


def fail(msg, prog=None):
    """Exit with the one line `prog: msg` on stderr; prog: the script's name by default."""
    sys.exit(f"{prog or os.path.basename(sys.argv[0])}: {msg}")


def need(ok, msg, prog=None):
    """A script's check of its flags: unless ok, exit with the one line `prog: msg`."""
    if not ok:
        fail(msg, prog)


# the checks scripts share: --device, --dtype, --seed, --budget


def check_device(device, prog=None):  # cpu, cuda or cuda:N, and that GPU visible
    ok = re.fullmatch(r"cpu|cuda(:\d+)?", device)
    need(ok, f"--device {device!r} is not a device; use cpu or cuda (cuda:N)", prog)
    gpu = device != "cpu"
    need(not gpu or torch.cuda.is_available(), f"--device {device}: no CUDA GPU is visible; use --device cpu", prog)
    n = torch.cuda.device_count() if gpu else 0
    need(not gpu or int(device[5:] or 0) < n, f"--device {device}: only {n} CUDA GPU(s) visible; use cuda:0", prog)


def check_dtype(dtype, allowed, prog=None):  # auto or one of allowed
    need(dtype == "auto" or dtype in allowed, f"--dtype {dtype!r}: use auto, {', '.join(allowed)}", prog)


def check_seed(seed, prog=None):  # 0 <= seed < 2**32
    need(0 <= seed < 2**32, f"--seed {seed}: use an integer 0 <= seed < 2**32", prog)


def check_budget(budget, prog=None):
    """A fraction 0 < x <= 1 of the tokens or an integer S > 1, as kvpop.budget_size takes."""
    whole = budget > 1 and budget == int(budget)
    use = "use a fraction 0 < x <= 1 of the tokens or an integer S > 1"
    need(0 < budget <= 1 or whole, f"--budget {budget:g}: {use}", prog)


def auto_dtype(dtype, device):  # --dtype auto: the checkpoint's own on a GPU (None), float32 on a CPU
    return None if dtype == "auto" and device != "cpu" else "float32" if dtype == "auto" else dtype
