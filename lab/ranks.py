"""
ranks.py: ranks under torchrun: one process per GPU (NCCL), or gloo on a CPU.

setup_distributed starts the process group (collectives time out after DIST_TIMEOUT_S);
all_sum and mean_timings reduce numbers over ranks (TIMING_KEYS in one order on every rank);
agree gives rank 0's verdict (a refusal's line, or None) to every rank; finish_distributed ends
the group; shard splits a model over the ranks (FSDP2). torch is imported inside each function.
    torchrun --nproc-per-node 2 train.py --preset tiny --name two-ranks
Tests: python -m pytest -q tests/test_ranks.py
"""
import os
import sys

DIST_TIMEOUT_S = 3600  # collectives wait this long: above the slowest rank-0-only step (a paper
# preset's held-out summary and the checkpoint gather and save of a 4B policy)
TIMING_KEYS = ("judge_s", "probe_s", "persuader_s", "persuadee_s", "rollout_s", "update_s",
               "step_s")  # all-reduced in this order on every rank, whatever a rank measured


def setup_distributed():
    """(rank, world, device): one process per GPU under torchrun (the device set before the
    process group starts, with NCCL bound to it), gloo on CPU; collectives time out after
    DIST_TIMEOUT_S. Without torchrun: (0, 1, cuda or cpu)."""
    import datetime

    import torch
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=DIST_TIMEOUT_S)
        if cuda:
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def all_sum(value, device):
    """Sum a number over ranks (a no-op in one process)."""
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        return value
    t = torch.tensor(float(value), device=device, dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def mean_timings(times, device):
    """The TIMING_KEYS of times (0 where a rank measured none), each averaged over ranks, in the
    same order on every rank (a rank that admitted no group has no persuader_s of its own)."""
    world = all_sum(1, device)
    return {k: all_sum(times.get(k, 0.0), device) / world for k in TIMING_KEYS}


def finish_distributed():
    """End the process group, if one was started (a rank exiting with it alive can abort gloo)."""
    if "RANK" in os.environ and "torch.distributed" in sys.modules:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def agree(message):
    """Rank 0's verdict (a refusal's line, or None) on every rank: a check made on rank 0 alone
    ends every rank, not only the one that made it."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard(model, world, compute_dtype=None):
    """FSDP2: each decoder layer, then the root, sharded over the ranks. With a compute_dtype
    (the policy's bf16) the MixedPrecisionPolicy gathers the fp32 master shards cast to it for
    forward and backward and reduce-scatters the gradients in fp32; AdamW then steps fp32 shards
    with fp32 moments. A frozen model (the reference) is sharded as it is, without gradients."""
    if world == 1:
        return model
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = (MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
              if compute_dtype not in (None, torch.float32) else MixedPrecisionPolicy())
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)
