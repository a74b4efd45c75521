"""
lab/bench_snr.py: the signal to noise of the dense reward (python -m lab.bench --snr PRESET; issue 28).

r_1 = (b_1 - b_0) / 2 of a preset's models, for several sampled persuader opening messages per
held-out instance and several persuadee replies to each (first_turn_rewards); the share of r_1's
variance that the persuader's message decides (significance.message_variance_share) and r_1's
spread, as one JSON line.

    PYTHONPATH=. python -m lab.bench --snr tiny --instances 2 --messages 2 --resamples 2
"""
import json
import time

import numpy as np
import torch

from persuarena import engine
from persuarena import models
from persuarena import probes
from persuarena import rollout
from lab import bench_workload as workload, cli, presets, significance


def first_turn_rewards(preset, instances=4, messages=4, resamples=4, seed=0):
    """r_1 = (b_1 - b_0) / 2 of the preset's models, per instance (the first held-out scenarios,
    pick_instances), per sampled persuader opening message, for `resamples` persuadee replies to
    that one message (each with its own random stream, the probes read after each): the input
    of significance.message_variance_share. Settings (models, dtype, sampling, message length) are
    presets.PRESETS[preset]'s; the persuadee's decision rule (rollout.DECISION) plays no part."""
    from persuarena import train
    cfg = presets.preset_values(preset)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    persuader_model, persuader_tok = train.load(cfg["persuader"], cfg["dtype"], device)
    persuadee_model, persuadee_tok = (
        (persuader_model, persuader_tok) if cfg["persuadee"] == cfg["persuader"]
        else train.load(cfg["persuadee"], cfg["dtype"], device))
    persuader = engine.Engine(persuader_model, persuader_tok)
    persuadee = engine.Engine(persuadee_model, persuadee_tok)
    persuader_sampling, persuadee_sampling = rollout.SAMPLING[cfg["sampling"]]
    max_new, out = cfg["max_new_tokens"], []
    replier = rollout.EngineSide(persuadee, "persuadee", persuadee_sampling, max_new,
                                 decision="tag")  # each reply's probes read after it
    for inst in workload.pick_instances(instances):
        persuader_prompt, persuadee_prompt = rollout.prompt_ids(persuader_tok, persuadee_tok, inst)
        root = persuader.new(persuader_prompt[:-1])
        persuader.forward([root])
        sids = [persuader.fork(root, persuader_prompt[-1:]) for _ in range(messages)]
        keys = [engine.stream_key(seed, inst["id"], m, "persuader") for m in range(messages)]
        said = persuader.generate(sids, max_new, persuader_sampling, keys)
        texts = [persuader_tok.decode(ids, skip_special_tokens=True).strip() for ids, _, _ in said]
        for sid in sids + [root]:
            persuader.free(sid)
        persuadee_root = persuadee.new(persuadee_prompt)
        persuadee.forward([persuadee_root])
        b0 = probes.belief(probes.read_engine(persuadee, [persuadee_root])[0].tolist())
        per_message = []
        for m, text in enumerate(texts):
            forks = [persuadee.fork(persuadee_root, rollout.persuadee_heard(persuadee_tok, text, False))
                     for _ in range(resamples)]
            replies = replier.reply(forks, [engine.stream_key(seed, inst["id"], m, r, "persuadee")
                                            for r in range(resamples)])
            per_message.append([(probes.belief(r.probes) - b0) / 2 for r in replies
                                if r.probes is not None])
            for sid in forks:
                persuadee.free(sid)
        persuadee.free(persuadee_root)
        out.append(per_message)
    return out


def snr_problem(args):
    """--snr's arguments checked before any model loads: one line naming the flag and the fix."""
    if args.snr not in presets.PRESETS:
        raise SystemExit(f"lab.bench: --snr {args.snr} is not a preset; pass one of "
                         f"{', '.join(presets.PRESETS)}, e.g. --snr tiny")
    held_out = len(workload.pick_instances(None))
    least = dict(instances=1, messages=2, resamples=2)  # the variance split needs two of each
    for flag, low in least.items():
        value = getattr(args, flag)
        if value < low:
            raise SystemExit(f"lab.bench: --{flag} {value} is below {low}; pass at least "
                             f"--{flag} {low}" + (" (two of each give the variance split)"
                                                  if low == 2 else ""))
    if args.instances > held_out:
        raise SystemExit(f"lab.bench: --instances {args.instances} exceeds the {held_out} "
                         f"held-out scenarios; pass at most --instances {held_out}")


def snr_main(argv):
    """--snr PRESET [--instances N --messages M --resamples R --seed S]: the share of r_1's
    variance that the persuader's message decides, and r_1's spread."""
    p = cli.new_parser("python -m lab.bench", "the signal to noise of the dense reward (--snr)")
    p.add_argument("--snr", required=True, metavar="PRESET", help="the train.py preset whose "
                   "persuader and persuadee are measured")
    p.add_argument("--instances", type=int, default=4, help="training instances measured")
    p.add_argument("--messages", type=int, default=4, help="persuader messages an instance")
    p.add_argument("--resamples", type=int, default=4,
                   help="persuadee replies resampled a message")
    p.add_argument("--seed", type=int, default=0, help="the random streams")
    args = p.parse_args(argv)
    snr_problem(args)
    models.set_cpu_threads()  # one thread per core the machine's load leaves free
    start = time.perf_counter()
    rewards = first_turn_rewards(args.snr, args.instances, args.messages, args.resamples, args.seed)
    out = significance.message_variance_share(rewards)
    flat = [r for inst in rewards for msg in inst for r in msg]
    out.update(preset=args.snr, instances=args.instances, messages_per_instance=args.messages,
               resamples=args.resamples, r1_mean=float(np.mean(flat)), r1_sd=float(np.std(flat, ddof=1)),
               seconds=time.perf_counter() - start)
    print(json.dumps(out))
    return out

