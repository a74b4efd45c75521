"""
watch.py: Probe-RPO seen to learn, on a laptop: a small λ sweep with a frozen control whose
figure shows the persuadee's belief rising under training against the same seeds untrained.

Each seed trains one arm at lambda rpo.LAMBDA and a frozen control at lr 0 (the same instances and
random streams, only the weights differ), then lab/sweep.py writes its summary, table and
training.png: the training episodes' b_T - b_0 step by step, trained against the control, the
difference with a 95% band over the seeds. The objective is the dense term alone wherever the
persuadee writes no decision tag (every group is then dead for the outcome term, Fig. 7's case),
so what rises is exactly what Probe-RPO rewards: sum_t r_t = (b_T - b_0) / 2. On random models
each seed starts from its own initial weights (random:NAME@SEED), its control from the same.

Beside the curve, what the policy says (lab/audit.py's message scores): the share of its held-out
messages that are degenerate (a repeated unit, invalid tokens), warm only, or make an ask, at the
initial policy and at the last checkpoint, seed by seed, with the first messages quoted; written
to sweeps/NAME/messages.json and appended to table.md by lab/sweep.py, as for every sweep.

    python -m lab.watch                       # tiny random models, three seeds (BENCHMARKS.md: Watch it learn)
    python -m lab.watch --preset cpu          # SmolLM2-135M on both sides (WATCH_CPU: hours on 2 cores)

The settings are the constants below (WATCH_TINY, WATCH_CPU); the figure is
sweeps/NAME/training.png, and the run resumes like any sweep (its arms are kept).
"""
import sys
from pathlib import Path

from persuarena import rpo
from lab import cli, presets, sweep

SEEDS = (0, 1, 2)
# tiny: the suite's learning configuration (tests/test_train.py): three-turn episodes, 8-token
# messages, a greedy persuadee, dense reward alone, no KL, lr 1.5e-2
WATCH_TINY = dict(steps=60, eval_limit=4, train=["--persuader", "random:tiny-llama@{seed}",
                                                 "--group-size", "4", "--instances", "2", "--t-max", "3",
                                                 "--max-new-tokens", "8", "--persuadee-temperature", "0",
                                                 "--kl-beta", "0", "--no-anchor", "--lr", "1.5e-2"])
# cpu: the SmolLM2 tag sweep's settings (BENCHMARKS.md: SmolLM2 with tag decisions)
WATCH_CPU = dict(steps=50, eval_limit=20, train=["--max-new-tokens", "16", "--kl-beta", "0", "--lr", "3e-5"])
WATCHES = {"tiny": WATCH_TINY, "cpu": WATCH_CPU}


def sweep_argv(preset, name=None, out=None, overwrite=False):
    """lab.sweep's arguments for one watch; the cpu watch in the machine's dtype
    (lab.presets.cpu_dtype), named on the command line so that every arm runs it."""
    watch = WATCHES[preset]
    dtype = ["--dtype", presets.cpu_dtype()[0]] if presets.PRESETS[preset].get("dtype") == "machine" else []
    return ["--preset", preset, "--lams", str(rpo.LAMBDA), "--seeds", *map(str, SEEDS),
            "--steps", str(watch["steps"]), "--eval-every", str(watch["steps"]),
            "--eval-limit", str(watch["eval_limit"]), "--frozen-control",
            "--name", f"watch-{preset}" if name is None else name, *(["--out", str(out)] if out else []),
            *(["--overwrite"] if overwrite else []), "--", "--judge", "none", *watch["train"], *dtype]


def main(argv=None):
    p = cli.new_parser("python -m lab.watch", __doc__)
    p.add_argument("--preset", choices=sorted(WATCHES), default="tiny", help="tiny: random "
                   "models, minutes; cpu: SmolLM2, hours on 2 cores")
    p.add_argument("--name", default=None, help="the sweep's folder, OUT/NAME (default watch-PRESET)")
    p.add_argument("--out", default=sweep.SWEEPS_DIR, help="the folder of sweep folders")
    p.add_argument("--overwrite", action="store_true", help="start the watch's sweep again")
    args = p.parse_args(argv)
    if presets.PRESETS[args.preset].get("dtype") == "machine":
        print(presets.dtype_note(presets.cpu_dtype()[0]))
    summary = sweep.main(sweep_argv(args.preset, args.name, args.out, args.overwrite))
    root = Path(args.out) / (f"watch-{args.preset}" if args.name is None else args.name)
    print(f"figure: {root}/training.png (trained against the frozen control)")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
