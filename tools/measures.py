"""The metrics of eviction on code (bench.py quality --task code, bench.py read): per file (one sequence each), then
a normal 95% interval over files; the key tokens; a file read on under a policy, its far copies marked."""

import math

import torch

import kvpop
from tasks import evaluate, policy_name


def key_tokens(full, local, idx, S):
    """(B, T - S - 1) bool: which next tokens, at the positions t >= S that predict one, are *key* (LongPPL, arXiv
    2410.23771): the full context raises their log-probability by more than 2 nats over the local one, to above -2.
    full, local: log-probs (B, T, V) of the same files; local is streaming at the budget S (the sinks and the latest
    tokens): a key token needs something streaming evicts."""
    # (B, T - S - 1, 1): the tokens positions S.. predict
    nxt = idx[:, S + 1 :, None]
    near = full[:, S:-1].gather(-1, nxt)[..., 0]
    gain = near - local[:, S:-1].gather(-1, nxt)[..., 0]
    return (gain > 2) & (near > -2)


# per file (B,): the mean of x (B, N) where mask; nan in a file without one
def masked_mean(x, mask):
    return (x * mask).sum(-1) / mask.sum(-1)


def file_metrics(full, lp, idx, S, key):
    """Per-file means of log-probs lp (B, T, V) against full's, at the positions t >= S that predict a next token, and
    at the key ones among them (key (B, T - S - 1), key_tokens') -> dict of (B,): KL(full || lp), top-1 agreement,
    log-perplexity over full's; the share of key tokens, lp's top-1 accuracy on them (against the true next token) and
    its loss rise over full there (nan in a file without one)."""
    # (B, T - S - 1, 1): the tokens positions S.. predict
    nxt = idx[:, S + 1 :, None]
    full, lp = full[:, S:-1], lp[:, S:-1]
    kl = (full.exp() * (full - lp)).sum(-1).mean(-1)
    top1 = (lp.argmax(-1) == full.argmax(-1)).float().mean(-1)
    # (B, T - S - 1)
    rise = (full.gather(-1, nxt) - lp.gather(-1, nxt))[..., 0]
    right = (lp.argmax(-1) == nxt[..., 0]).float()
    log_ppl = rise.mean(-1)
    key_share = key.float().mean(-1)
    metrics = dict(kl=kl, top1=top1, log_ppl=log_ppl, key_share=key_share)
    key_top1 = masked_mean(right, key)
    key_loss = masked_mean(rise, key)
    return metrics | dict(key_top1=key_top1, key_loss=key_loss)


def interval(x):
    """Mean and 95% half-width (normal: 1.96 standard errors) over the files of x (files,), nan files left out."""
    x = x[~x.isnan()].double()
    if len(x) < 2:
        return math.nan, math.nan
    return x.mean().item(), 1.96 * x.std().item() / math.sqrt(len(x))


def code_runs(net, idx, policies, budgets, sinks, window, chunk=16, target=kvpop.TARGETS[0], ref=None):
    """Every (policy, budget) on held-out files idx (files, T), teacher-forced through evaluate -> rows of each
    file_metrics' mean over files and 95% half-width (_ci), the perplexity ratio exp(log_ppl) with its interval
    (ppl_lo, ppl_hi), and KL's paired per-file difference from streaming's (kl_paired, its _ci). Key tokens at a
    budget are streaming's there; `full` first, a row a budget (its key top-1 is the bar). ref: the dense model
    full's rows, the key tokens and streaming's paired KL are of (a fine-tune's model before; default net)."""
    ref = ref or net
    T = idx.shape[1]
    size = lambda budget: kvpop.budget_size(budget, T, sinks, window)[0]
    others = [p for p in policies if p != "full"]
    runs = [("full", b) for b in budgets]
    runs += [(p, b) for p in others for b in budgets]
    per = {run: [] for run in runs}
    streamed = {b: [] for b in budgets}  # streaming's per-file KL (on ref) at each budget
    # a chunk of files: full's log-probs, each budget's key tokens, then every run on it
    for start in range(0, len(idx), chunk):
        files = idx[start : start + chunk]

        def logp(model, policy, budget, online=False):
            args = (model, files, policy, budget, sinks, window, online, target)
            return evaluate(*args).float().log_softmax(-1)

        full = logp(ref, "full", 1)
        # each budget's key tokens: those streaming there misses; its KL, the paired baseline
        key = {}
        for budget in budgets:
            local = logp(ref, "streaming", budget)
            key[budget] = key_tokens(full, local, files, size(budget))
            found = file_metrics(full, local, files, size(budget), key[budget])
            streamed[budget].append(found["kl"])
        for policy, budget in runs:
            online = policy_name(policy) in kvpop.DYNAMIC
            got = full
            if policy != "full":
                got = logp(net, policy, budget, online)
            found = file_metrics(full, got, files, size(budget), key[budget])
            per[policy, budget].append(found)
    # nan (no file to average): None
    num = lambda x: None if math.isnan(x) else round(x, 5)
    rows = []
    for (p, b), parts in per.items():
        row = dict(policy=policy_name(p), budget=b, files=len(idx))
        for name in parts[0]:
            mean, half = interval(torch.cat([m[name] for m in parts]))
            row[name], row[name + "_ci"] = num(mean), num(half)
        # the ratio of perplexities: exp of the mean log ratio, and of its interval's ends
        log_ppl, half = row.pop("log_ppl"), row.pop("log_ppl_ci")
        row["ppl_ratio"] = num(math.exp(log_ppl))
        row["ppl_lo"] = num(math.exp(log_ppl - half))
        row["ppl_hi"] = num(math.exp(log_ppl + half))
        # KL's paired per-file difference from streaming's at the same budget
        diff = torch.cat([m["kl"] for m in parts]) - torch.cat(streamed[b])
        row["kl_paired"], row["kl_paired_ci"] = map(num, interval(diff))
        rows.append(row)
    return rows


# a mean and its 95% half-width, "-" where no file has a key token
def cell(row, name, form):
    half = row[f"{name}_ci"]
    if half is None:
        return "-"
    return f"{row[name]:{form}} ± {half:{form.lstrip('+')}}"


# a markdown table of code_runs' rows, each mean with its 95% half-width ("-": no key token)
def code_table(rows):
    names = "target|policy|budget|KL|KL - streaming's (paired)|top-1"
    names += "|key share|key top-1|key loss rise|perplexity ratio"
    columns = names.split("|")
    header = "| " + " | ".join(columns) + " |"
    lines = [header, "|---" * len(columns) + "|"]
    for row in rows:
        cells = [row.get("target", "-"), row["policy"], f"{row['budget']:g}"]
        cells += [cell(row, "kl", ".4f"), cell(row, "kl_paired", "+.4f")]
        cells += [cell(row, "top1", ".1%")]
        cells += [cell(row, "key_share", ".2%"), cell(row, "key_top1", ".1%")]
        ends = f"({row['ppl_lo']:.3f}-{row['ppl_hi']:.3f})"
        cells += [cell(row, "key_loss", ".2f"), f"{row['ppl_ratio']:.3f} {ends}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_on(net, tok, read, n, policies, S, sinks, window, budget):
    """sample.py --model codebaby: the file read (token ids) read on from its n-th token, teacher-forced, under each of
    policies {name: policy} (the online cache) at S entries; printed with each key token (it needs what streaming
    evicts) marked ✓ where the policy's likeliest next token is it, ✗ where not, then each policy's count ("full":
    no eviction, the ceiling)."""
    device = next(net.parameters()).device
    seq = torch.tensor([read], device=device)
    # (1, T, V) each
    full = evaluate(net, seq, "full", 1, online=False).float().log_softmax(-1)
    local = evaluate(net, seq, "streaming", S, sinks, S - sinks, online=False)
    local = local.float().log_softmax(-1)
    # (T - n,)
    key = key_tokens(full, local, seq, n - 1)[0].tolist()
    keyed = [j for j in range(len(key)) if key[j]]
    for name, policy in policies.items():
        # full: the whole cache, the ceiling
        size = seq.shape[1] if policy == "full" else S
        logits = evaluate(net, seq, policy, size, sinks, window)
        guess = logits.argmax(-1)[0, n - 1 : -1].tolist()
        right = [guess[j] == read[n + j] for j in keyed]
        dec, sign = tok.decode_stream(), {True: "✓", False: "✗"}
        mark = lambda j, i: sign[guess[j] == i] if key[j] else ""
        marked = [dec(i) + mark(j, i) for j, i in enumerate(read[n:])]
        print("".join(marked) + dec(), end="\n" + "=" * 80 + "\n")
        print(f"far copies {name} {budget:g}: {sum(right)}/{len(right)}")
