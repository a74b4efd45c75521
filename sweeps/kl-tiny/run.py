"""
The KL-on learning run of BENCHMARKS.md (Updates per batch and the KL in a learning run): the tiny
watch's configuration (lab.watch.WATCH_TINY: three-turn episodes, 8-token messages, a greedy
persuadee, lambda 0.5, lr 1.5e-2, G 4, 2 instances a step, 60 steps, a frozen control at lr 0
beside each seed) with the KL term on at the paper's beta 0.01 and the tiny preset's 2 updates a
batch (one group a mini-batch: the clip acts from the second). Each seed's persuader starts from
its own initial weights (random:tiny-llama built under torch.manual_seed(seed); its frozen control
from the same ones), so the seeds replicate the initialisation as well as the sampling; the
persuadee (random:tiny-qwen3) is the same frozen model for all.

    python sweeps/kl-tiny/run.py        # from the repository root; the sweep's files land here
    python sweeps/kl-tiny/run.py --name kl-tiny-beta0 --kl-beta 0    # the same with beta 0

Flags after the name go to every arm's train.py, after (so over) the ones below. Beside the
sweep's own files (its arms' runs are not kept in git) it writes objective.jsonl, the trained
arms' update figures step by step, and samples-60_sSEED.json, each trained arm's last samples.
"""
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import models  # noqa: E402
import train  # noqa: E402
from lab import cli, sweep  # noqa: E402

SEEDS = (0, 1, 2)
STEPS = 60
SEEDED = "tiny-llama"  # the persuader's random model: built from the arm's seed
TRAIN = ["--judge", "none", "--group-size", "4", "--instances", "2", "--t-max", "3",
         "--max-new-tokens", "8", "--persuadee-temperature", "0", "--kl-beta", "0.01",
         "--no-anchor", "--lr", "1.5e-2"]

arm = {"seed": 0}
parse, build = cli.train_args, models.random_model


def parse_recording_seed(argv, own):
    args = parse(argv, own)
    arm["seed"] = args.seed  # the run (or the initial policy's evaluation) about to load
    return args


def seeded_model(name, *a, seed=0, **kw):
    return build(name, *a, seed=arm["seed"] if name == SEEDED else seed, **kw)


OBJECTIVE = ("kl", "clip_frac", "ratio_mean", "grad_norm", "updates", "loss", "belief_change",
             "collapsed_group_share")  # what objective.jsonl keeps of each step's metrics


def collect(folder):
    """objective.jsonl and samples-STEPS_sSEED.json from the trained arms' runs."""
    rows = []
    for seed in SEEDS:
        run = folder / "runs" / sweep.arm_name(0.5, seed)
        for line in (run / "metrics.jsonl").read_text().splitlines():
            m = json.loads(line)
            rows.append(dict(seed=seed, step=m["step"], **{k: m.get(k) for k in OBJECTIVE}))
        shutil.copyfile(run / f"samples-{STEPS}.json", folder / f"samples-{STEPS}_s{seed}.json")
    (folder / "objective.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


cli.train_args, models.random_model = parse_recording_seed, seeded_model
if __name__ == "__main__":
    argv = sys.argv[1:]
    name, extra = (argv[1], argv[2:]) if argv[:1] == ["--name"] else ("kl-tiny", argv)
    sweep.main(["--preset", "tiny", "--lams", "0.5", "--seeds", *map(str, SEEDS),
                "--steps", str(STEPS), "--eval-every", str(STEPS), "--eval-limit", "4",
                "--frozen-control", "--name", name, "--", *TRAIN, *extra])
    collect(Path(sweep.SWEEPS_DIR) / name)
