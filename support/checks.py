"""Bad input, before any heavy work: each script's flags checked on their own, then against the others and the files
they name, every failure one line on stderr and a non-zero exit. `opts`: the script's settings after its --key value
overrides (its module-level defaults), `given`: the keys the command line set."""

import os

import kvpop
from support import checkpoint, flags
from support.corpus import code_files
from tasks import TASKS, TASK_RANKS


def train(opts, given, world):
    """train.py's flags, the training budget and the scorer folders they name."""
    need = lambda ok, msg: flags.need(ok, msg, "train.py")
    flags.check_device(opts.device, "train.py")
    flags.check_dtype(opts.dtype, ("float32", "bfloat16", "float16"), "train.py")
    # a choice from a list
    choices = dict(kind=kvpop.SCORERS, task=(*TASKS, "code"), target=kvpop.TARGETS, policy=("scorer", "streaming"))
    for name, among in choices.items():
        value = getattr(opts, name)
        need(value in among, f"--{name} {value!r}: choose from {', '.join(among)}")
    # a number in range
    counts = "threads d_mem d_hidden seq_len window batch_size max_iters log_interval eval_interval eval_seqs"
    lowest = dict.fromkeys((counts + " top_logits edges").split(), 1)
    lowest.update(dict.fromkeys("queries warmup final_seqs sinks".split(), 0))
    for name, low in lowest.items():
        value = getattr(opts, name)
        need(value >= low, f"--{name} {value}: must be at least {low}")
    for name in ("lr", "model_lr"):
        value = getattr(opts, name)
        need(value > 0, f"--{name} {value}: must be positive")
    # the rest, each its own line
    need(opts.finetune or opts.policy == "scorer", "--policy streaming is StreamingLLM+, a fine-tune: add --finetune")
    batch = f"--batch_size {opts.batch_size}: must split evenly over {world} processes"
    need(opts.batch_size % world == 0, batch)
    need(0 < opts.gamma < 1, f"--gamma {opts.gamma}: must be in (0, 1)")
    need(0 <= opts.min_lr <= opts.lr, f"--min_lr {opts.min_lr}: must be in [0, --lr]")
    decay = "--weight_decay must be in [0, 1) and --grad_clip positive"
    need(0 <= opts.weight_decay < 1 and opts.grad_clip > 0, decay)
    need(1 <= opts.keys <= 16 and opts.seq_len >= 64, "--keys must be 1..16 and --seq_len at least 64")
    rates = f"--p_cue_min {opts.p_cue_min}, --p_cue_max {opts.p_cue_max}"
    need(0 <= opts.p_cue_min <= opts.p_cue_max < 1, f"{rates}: use 0 <= min <= max < 1")
    flags.check_seed(opts.seed, "train.py")
    out_dir = opts.out_dir
    need(out_dir.strip("/") and not os.path.isfile(out_dir), f"--out_dir {out_dir!r}: give a folder name")
    # the training budget (train.load charges the scorer's state too)
    try:
        size = kvpop.budget_size(opts.budget, opts.seq_len, opts.sinks, opts.window)[0]
    except ValueError as e:
        flags.fail(f"--budget: {e}", "train.py")
    need(size < opts.seq_len, f"--budget {opts.budget} keeps all {opts.seq_len} tokens: nothing to learn")
    # a flag that this run would ignore is an error, as an unknown one is
    kind, data, task = opts.kind, opts.data, opts.task
    unread = [
        ("no --finetune", not opts.finetune, "policy model_lr top_logits"),
        ("--policy streaming", opts.policy == "streaming", "kind d_mem d_hidden gamma queries target edges init_from"),
        (f"--kind {kind}", not issubclass(kvpop.SCORERS[kind], kvpop.MemoryScorer), "d_mem arrival"),
        ("--init_from (the folder's sizes)", bool(opts.init_from), "d_mem d_hidden gamma arrival"),
        (f"--data {data} (not the baby's task)", data != "baby", "keys final_seqs task"),
        ("--task code (no baby's task)", task == "code", "keys"),
        ("--task code without --finetune", task == "code" and not opts.finetune, "final_seqs"),
        (f"--task {task}", task != "code", "corpus"),
        (f"--task {task}", task != "cue", "p_cue_min p_cue_max"),
    ]
    for why, on, names in unread:
        for name in names.split():
            need(not (on and name in given), f"--{name} does nothing with {why}; drop it")
    # a scorer to start from, of --kind's kind
    if opts.init_from:
        found = os.path.join(opts.init_from, "scorer.json")
        need(os.path.isfile(found), f"--init_from {opts.init_from}: no scorer.json; give a train.py --out_dir")
        got = checkpoint.read_json(found).get("kind")
        need(got == kind, f"--init_from {opts.init_from} holds a {got} scorer; use --kind {got}")
    ok = not opts.resume or os.path.isfile(os.path.join(out_dir, "train_state.pt"))
    need(ok, f"--resume: no train_state.pt in {out_dir} to continue; drop --resume to start anew")


def sample(opts):
    """sample.py's flags, each on its own, before anything is looked up, downloaded or loaded."""
    need = flags.need
    flags.check_device(opts.device)
    flags.check_dtype(opts.dtype, checkpoint.DTYPES)
    need(opts.chat or not opts.think, "--think only applies to the chat template; add --chat or drop --think")
    need(opts.threads >= 0, f"--threads {opts.threads}: use 1 or more (0: the default)")
    need(opts.num_samples >= 1, f"--num_samples {opts.num_samples}: use 1 or more (0: the default)")
    need(opts.max_new_tokens >= 1, f"--max_new_tokens {opts.max_new_tokens}: generate at least 1 token")
    need(opts.temperature >= 0, f"--temperature {opts.temperature:g}: use 0 (greedy) or more (-1: the default)")
    off = "use 0 (off) or the number of likeliest tokens kept (-1: the default)"
    need(opts.top_k >= 0, f"--top_k {opts.top_k}: {off}")
    need(0 < opts.top_p <= 1, f"--top_p {opts.top_p:g}: use 0 < top_p <= 1 (1 = off)")
    flags.check_seed(opts.seed)
    flags.check_budget(opts.budget)
    need(opts.sinks >= 0, f"--sinks {opts.sinks}: use 0 or more")
    need(opts.window >= 0, f"--window {opts.window}: use 1 or more (0: the default)")
    learned = ", ".join(kvpop.SCORERS)
    why = f"only a learned --policy ({learned}) reads one; drop --scorer or choose one of those"
    need(not opts.scorer or opts.policy in kvpop.SCORERS, f"--scorer {opts.scorer}: {why}")


def pretrain(opts):
    """pretrain.py's flags, then the folder it writes into and the corpus --data names."""
    need = lambda ok, msg: flags.need(ok, msg, "pretrain.py")
    # a number in range
    for name in "threads n_layer n_head n_kv_head n_ff tokens phase_steps final_steps warmup".split():
        value = getattr(opts, name)
        need(value >= 1, f"--{name} {value}: must be at least 1")
    for name in ("lr", "rope_theta"):
        value = getattr(opts, name)
        need(value > 0, f"--{name} {value}: must be positive")
    # the rest: each its own check
    need(int(os.environ.get("WORLD_SIZE", 1)) == 1, "pretraining runs in one process (not under torchrun)")
    names = ", ".join(TASKS)
    need(opts.task in TASKS, f"--task {opts.task!r}: choose from {names}")
    finals = set(opts.final_tasks.split(","))
    need(finals <= set(TASKS), f"--final_tasks {opts.final_tasks!r}: comma-separated tasks from {names}")
    need(0 < opts.advance_acc <= 1, f"--advance_acc {opts.advance_acc}: must be in (0, 1]")
    need(opts.answer_weight >= 0, f"--answer_weight {opts.answer_weight}: use 0 or more")
    need(1 <= opts.keys <= 16, f"--keys {opts.keys}: use 1..16 (the recall task)")
    seq_len = opts.seq_len
    lengths = "use 64 (the recall task) .. 4096 (the baby's positions)"
    need(64 <= seq_len <= 4096, f"--seq_len {seq_len}: {lengths}")
    need(opts.tokens >= seq_len, f"--tokens {opts.tokens}: use at least --seq_len ({seq_len}), one sequence")
    embd, heads, kv = opts.n_embd, opts.n_head, opts.n_kv_head
    need(embd >= 128, f"--n_embd {embd}: use 128 or more (head_dim 64, and dims 64..127 hold the previous token)")
    need(heads % kv == 0, f"--n_head {heads}: use a multiple of --n_kv_head ({kv}), query heads share KV heads")
    need(0 <= opts.copies <= 1, f"--copies {opts.copies}: use a share in [0, 1]")
    ranks = f"use {TASK_RANKS}..151643 (every recall-task word must stay one token)"
    need(TASK_RANKS <= opts.vocab_ranks <= 151643, f"--vocab_ranks {opts.vocab_ranks}: {ranks}")
    flags.check_seed(opts.seed, "pretrain.py")
    out_dir = opts.out_dir
    need(out_dir.strip("/") and not os.path.isfile(out_dir), f"--out_dir {out_dir!r}: give a folder name")
    # flags first, then the folder pretraining writes into
    ours = not os.path.exists(out_dir) or os.path.isfile(os.path.join(out_dir, "config.json"))
    name_new = "pretrain.py writes its model files there, so name a new one"
    need(ours, f"--out_dir {out_dir}: exists and is no checkpoint; {name_new}")
    # --data: a folder with .py/.txt files (their tokens are counted once read)
    try:
        code_files(opts.data) if opts.data else None
    except FileNotFoundError as e:
        need(False, f"--data: {e}")
