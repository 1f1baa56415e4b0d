"""Several processes (`torchrun --nproc_per_node=N train.py`): each takes its share of a step's batch; the scorer is
replicated (DDP: the same step as one process), --finetune's models sharded block by block (FSDP2). In one process
every function here is the identity, or does nothing (README, Method: several processes)."""

import contextlib
import os
import sys

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP


def rank():  # this process, torchrun's numbering
    return int(os.environ.get("RANK", 0))


def world():  # the processes
    return int(os.environ.get("WORLD_SIZE", 1))


def start(device):
    """Join the group (gloo on a CPU, nccl on GPUs) -> this process's device."""
    if world() == 1:
        return device
    dist.init_process_group("gloo" if device == "cpu" else "nccl")
    return device if device == "cpu" else f"cuda:{int(os.environ['LOCAL_RANK'])}"


def finish():
    """DDP and FSDP keep the group's threads (gloo's run loops) alive past destroy_process_group, and Python's exit can
    then abort a worker ("terminate called without an active exception"): a worker leaves without it."""
    if world() > 1:
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)


def allsum(x):
    """In place: the sum over the processes, each holding its share of the global batch."""
    if world() > 1:
        dist.all_reduce(x)
    return x


def distribute(net, student, scorer, finetune):
    """The scorer replicated (DDP), --finetune's models split block by block (FSDP2) -> the scorer to call (the DDP
    wrapper, or the scorer)."""
    if world() > 1 and finetune:
        # each block's weights split over the processes, gathered for its forward/backward
        for m in (*net.model.layers, net, *student.model.layers, student):
            fully_shard(m)
    return DDP(scorer) if scorer is not None and world() > 1 else scorer


# a backward that leaves DDP's gradients unreduced (all but a step's last: one reduction a step)
def no_sync(ddp, unreduced):
    return ddp.no_sync() if isinstance(ddp, DDP) and unreduced else contextlib.nullcontext()


# a sharded model's full weights and its optimizer's, gathered from every process (on the CPU)
def gather(model, opt):
    return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# an optimizer's full saved state, into a sharded model's optimizer
def load_optimizer(model, opt, saved):
    set_optimizer_state_dict(model, opt, saved, options=StateDictOptions(full_state_dict=True))
