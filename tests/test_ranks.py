"""lab/ranks.py: a GPU rank sets its device before the process group; every rank reduces the
same timing keys in one order."""
import datetime

import torch

from lab import ranks



def test_a_gpu_rank_sets_its_device_before_the_process_group(monkeypatch):
    import torch.distributed as dist
    calls = []
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", str(d))))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **k: calls.append(
        ("init", backend, str(k["device_id"]), k["timeout"])))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    assert ranks.setup_distributed()[:2] == (1, 2)
    assert calls == [("set_device", "cuda:1"),
                     ("init", "nccl", "cuda:1", datetime.timedelta(seconds=ranks.DIST_TIMEOUT_S))]


def test_every_rank_all_reduces_the_same_timing_keys_in_one_order(monkeypatch):
    """A rank that admitted no group measured no persuader_s: it still reduces every key of
    ranks.TIMING_KEYS, in their order, as a busy rank does."""
    reduced = []
    monkeypatch.setattr(ranks, "all_sum", lambda value, device: reduced.append(value) or value)
    busy = dict(step_s=9.0, judge_s=1.0, probe_s=2.0, persuadee_s=3.0, persuader_s=4.0,
                rollout_s=5.0, update_s=6.0)
    idle = dict(judge_s=0.0, probe_s=0.0, rollout_s=0.5, update_s=0.1, step_s=0.7)
    for times in (busy, idle):
        reduced.clear()
        out = ranks.mean_timings(times, "cpu")
        assert list(out) == list(ranks.TIMING_KEYS) and len(reduced) == 1 + len(ranks.TIMING_KEYS)
    assert ranks.mean_timings(busy, "cpu")["persuader_s"] == 4.0
