"""
What updates per batch cost on a CPU (BENCHMARKS.md: Updates per batch): one cpu-preset batch
(SmolLM2-135M as persuader, persuadee and KL reference, G 4, 2 instances, T_max 2, 32-token
messages, beta 0.01: step 1's rollout at seed 0) updated from the same initial weights and a
fresh AdamW with 1, 2 and 4 updates, in the order 1 2 4 4 2 1 after one untimed warm-up, each
timed in wall and process CPU seconds (all threads), into result.json beside this file.

    python sweeps/updates-cost/run.py      # from the repository root
"""
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import engine  # noqa: E402
import models  # noqa: E402
import rollout  # noqa: E402
import rpo  # noqa: E402
import train  # noqa: E402
from lab import cli, steps  # noqa: E402

ORDER = (1, 2, 4, 4, 2, 1)


def main():
    engine.CACHE_GB_CPU = 0.5  # each engine's KV pool (2 GB by default): 8 short episodes fit
    out = tempfile.mkdtemp()
    args = cli.train_args(["--preset", "cpu", "--out", out, "--name", "cost"], train)
    device = torch.device("cpu")
    models.set_cpu_threads(device)
    torch.manual_seed(args.seed)
    loaded = train.build_models(args, 1, device)
    engines = train.build_engines(loaded, args, device, {})
    mine = train.step_instances(steps.training_set(args, engines, print), args, 1, 0, 1)
    seed, times = args.seed * 1000003 + 1009, dict(judge_s=0.0, probe_s=0.0)
    played = rollout.rollout_episodes(engines.persuader, engines.persuadee, mine, args.t_max,
                                      seed=seed, timings=times, **train.rollout_options(args))
    played = rollout.judge_episodes(engines.judge, mine, played, seed, args.group_size, times)
    records, _, _ = steps.playable(played, args.group_size)
    advantages = rpo.advantages(rpo.rewards(records, args.group_size, args.anchor), args.lam)
    batch, batch_advantages = steps.silenced(played, records, advantages)
    del engines, played  # the engines' KV pools (2 GB each) are not needed by the update
    gc.collect()
    initial = {k: v.clone() for k, v in loaded.policy.state_dict().items()}
    rows = []
    for updates in (1,) + ORDER:  # the first: warm-up, not kept
        loaded.policy.load_state_dict(initial)
        optimizer = torch.optim.AdamW(loaded.policy.parameters(), lr=args.lr,
                                      weight_decay=train.WEIGHT_DECAY)
        wall, cpu = time.perf_counter(), time.process_time()
        stats = steps.mini_batch_updates(batch, batch_advantages, updates, lambda *mini: train.policy_update(
            loaded.policy, loaded.reference, optimizer, *mini, args, device, 1))
        rows.append(dict(updates=updates, wall_s=time.perf_counter() - wall,
                         cpu_s=time.process_time() - cpu, threads=torch.get_num_threads(),
                         **{k: stats[k] for k in ("persuader_tokens", "clip_frac", "kl",
                                                  "ratio_mean", "grad_norm")}))
        print(rows[-1], flush=True)
    result = dict(order=list(ORDER), warm_up=rows[0], runs=rows[1:],
                  episodes=len(batch), micro_batch=args.micro_batch, kl_beta=args.kl_beta)
    (Path(__file__).parent / "result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
