"""
trl_grpo.py: TRL's GRPOTrainer trains a persuader against PersuasionEnv (lab/env.py).

An outside trainer drives the arena through the environment interface alone: TRL keeps the
policy, its optimiser and its loss; the arena keeps the persuadee, the hidden profile, the
decision state machine and the probes. The hook is GRPOTrainer's `rollout_func` (DECISIONS.md:
TRL's GRPOTrainer on the arena): for each prompt the trainer hands over, one episode is played,

    messages, info = env.reset(seed, options={"instance": id})      # the persuader's prompt
    repeat: persuader message ~ pi_theta(. | context)                 # the trainer's generation
            reply, r_t, terminated, truncated, info = env.step(message)
            context += message, then the reply as a user turn         # env_mask 0: not trained

and the episode's two rewards reach the trainer as two reward functions that it mixes by its
own weights:  R = outcome reward (G(outcome) + 0.5 s) + rpo.LAMBDA * sum_t r_t,  sum_t r_t =
(b_T - b_0) / 2. GRPO then centres R within the group of NUM_GENERATIONS episodes of one
instance. Unlike train.py's Probe-RPO, the dense term enters as the episode's sum (GRPO scores a
whole completion with one number), not as a per-turn return-to-go.

The context is token ids that only append (models.py's chat edge): the persuader's sampled ids
as generated, then the template's closing and the reply's user turn (models.closing_ids,
models.turn_ids), as rollout.py builds the persuader's context.

TRL's own command line (TrlParser over GRPOConfig and the arena's ArenaArguments): every
GRPOConfig flag as TRL names it, `--config recipe.yaml` (the flags override it), TRL's progress
bar, and its loggers with --report_to (tensorboard, wandb, trackio...).

    python -m lab.trl_grpo --policy random:tiny-qwen3 --persuadee random:tiny-qwen3 \\
        --judge none --max_steps 2 --t_max 2 --turn_tokens 8 --output_dir runs/trl-smoke
    python -m lab.trl_grpo --config recipe.yaml --report_to tensorboard
    python -m pytest -q tests/test_trl_grpo.py
"""
import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Optional

import torch
import transformers
from transformers import DynamicCache

from persuarena import arena
from persuarena import engine
from persuarena import models
from persuarena import rpo
from lab import env as persuasion_env
from lab import env_server
from lab import jsonl

NUM_GENERATIONS = 4  # episodes per instance: GRPO's group
NUM_GENERATIONS_MAX = 64  # --num-generations at most: with --server, each a session and a thread at once
TURN_TOKENS = 128  # the most tokens the persuader generates in one message
LEARNING_RATE = 1e-6
# generate's cache argument: `cache` where transformers has renamed it, past_key_values before
CACHE_KWARG = ("cache" if "cache" in getattr(transformers.generation.utils, "ALL_CACHE_NAMES", ())
               else "past_key_values")
REWARD_NAMES = ("arena_outcome", "arena_dense")  # TRL logs rewards/<name>/mean per step
RESUME_MAY_CHANGE = ("steps", "save_every", "server")  # what --resume may set anew (config.json)
SAVE_EVERY = 1  # steps between checkpoints (a run killed mid-way resumes from the last)
WHO = "trl_grpo.py"
PERSUADER = "persuader"  # the run folder's trained persuader, a folder eval.py takes


def prompt_key(messages):
    """A prompt's identity: the (role, content) of its messages."""
    return tuple((m["role"], m["content"]) for m in messages)


def prompt_dataset(env, instance_ids=None):
    """A datasets.Dataset of the persuader's opening messages ("prompt") and their instance id
    ("instance"), one row per instance, and {prompt_key: instance id} for rollout_func, which sees
    the prompts alone. Two instances whose persuader prompts are the same are refused."""
    from datasets import Dataset
    ids = list(env.by_id) if instance_ids is None else list(instance_ids)
    unknown = [i for i in ids if i not in env.by_id]
    if unknown or not ids:
        raise ValueError(f"trl_grpo.py: no instance {unknown[:3] or ids} in the env's scenarios; "
                         f"ids look like {', '.join(list(env.by_id)[:3])}")
    prompts = [arena.persuader_messages(env.by_id[i]) for i in ids]
    by_prompt = {}
    for i, prompt in zip(ids, prompts):
        if by_prompt.setdefault(prompt_key(prompt), i) != i:
            raise ValueError(f"trl_grpo.py: instances {by_prompt[prompt_key(prompt)]} and {i} give "
                             "the persuader the same prompt; train on one of them")
    return Dataset.from_dict({"prompt": prompts, "instance": ids}), by_prompt


def generation_kwargs(trainer, max_new_tokens):
    """model.generate's arguments: the trainer's own (GRPOConfig's temperature, top-p/k, min-p,
    repetition penalty, generation_kwargs; its end-of-turn ids), max_new_tokens a message's."""
    if getattr(trainer, "generation_kwargs", None) is None:
        raise ValueError("trl_grpo.py: the trainer generates with vLLM (use_vllm); this rollout "
                         "samples with transformers: leave use_vllm off")
    eos = trainer.generation_kwargs["eos_token_id"]
    return {**trainer.generation_kwargs, "max_new_tokens": max_new_tokens,
            "eos_token_id": eos if isinstance(eos, list) else [eos],
            "return_dict_in_generate": True, "output_scores": True}


@torch.no_grad()
def persuader_message(model, context_ids, gen_kwargs, cache=None):
    """One sampled message after context_ids: (its ids, up to and including the end-of-turn
    token if written; each id's log-probability under the processed sampling distribution).
    `cache` (a transformers DynamicCache) holds the episode's context so far: generate runs only
    the ids past it, so each turn prefills its new ids, not the whole conversation again."""
    inputs = torch.tensor([context_ids], device=model.device)
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), **{CACHE_KWARG: cache},
                         **gen_kwargs)
    ids = out.sequences[0, len(context_ids):].tolist()
    ends = [k for k, i in enumerate(ids) if i in gen_kwargs["eos_token_id"]]
    ids = ids[:ends[0] + 1] if ends else ids
    logprobs = [torch.log_softmax(score[0].float(), -1)[i].item()
                for score, i in zip(out.scores, ids)]
    return ids, logprobs


def play_episode(env, model, tokenizer, instance_id, seed, gen_kwargs):
    """One episode of instance_id with the policy as the persuader: the trainer's fields
    (prompt_ids, completion_ids, logprobs, env_mask) and the arena's rewards and outcome."""
    messages, _ = env.reset(seed=seed, options={"instance": instance_id})
    prompt = models.chat_ids(tokenizer, list(messages), True)
    completion, logprobs, mask, step_rewards = [], [], [], []
    cache = DynamicCache()  # the context's keys and values, one turn after another
    while True:
        ids, lps = persuader_message(model, prompt + completion, gen_kwargs, cache)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        observation, reward, terminated, truncated, info = env.step(text)
        completion, logprobs, mask = completion + ids, logprobs + lps, mask + [1] * len(ids)
        step_rewards.append(reward)
        if terminated or truncated:
            break
        heard = (models.closing_ids(tokenizer, ids)
                 + models.turn_ids(tokenizer, observation[0]["content"]))
        completion, logprobs, mask = (completion + heard, logprobs + [0.0] * len(heard),
                                      mask + [0] * len(heard))
    return dict(prompt_ids=prompt, completion_ids=completion, logprobs=logprobs, env_mask=mask,
                arena_dense=sum(step_rewards), arena_outcome=info["outcome_reward"],
                outcome=info["outcome"], turns=len(step_rewards), step_rewards=step_rewards)


def make_rollout(env, by_prompt, turn_tokens=TURN_TOKENS, seed=0, on_episode=None):
    """GRPOTrainer's rollout_func: one env episode per prompt it is handed (the trainer repeats
    each prompt NUM_GENERATIONS times), episode seeds seed + step * n, seed + step * n + 1, ...
    for the n prompts of the trainer's step (its global_step: a resumed run plays the seeds an
    uninterrupted one would).
    An env with `sessions(n)` (ServerEnv) plays the step's episodes at once, one session each,
    so the server batches their persuadee replies; a PersuasionEnv plays them in turn.
    on_episode(instance id, episode) sees each episode (tests, logs), in order of the prompts."""
    def rollout_func(prompts, trainer):
        instance_ids = [by_prompt.get(prompt_key(prompt)) for prompt in prompts]
        if None in instance_ids:
            raise ValueError("trl_grpo.py: rollout_func got a prompt that is no instance's "
                             "opening; build the dataset with prompt_dataset(env)")
        model = trainer.accelerator.unwrap_model(trainer.model)
        gen_kwargs = generation_kwargs(trainer, turn_tokens)
        was_training = model.training
        model.eval()
        step = trainer.state.global_step  # restored on --resume: the streams go on from it
        seeds = [seed + step * len(instance_ids) + k for k in range(len(instance_ids))]
        tokenizer = trainer.processing_class
        if hasattr(env, "sessions"):
            from concurrent.futures import ThreadPoolExecutor
            clients = env.sessions(len(instance_ids))
            with ThreadPoolExecutor(len(instance_ids)) as pool:
                episodes = list(pool.map(lambda a: play_episode(a[0], model, tokenizer, a[1], a[2],
                                                                gen_kwargs),
                                         zip(clients, instance_ids, seeds)))
        else:
            episodes = [play_episode(env, model, tokenizer, i, s, gen_kwargs)
                        for i, s in zip(instance_ids, seeds)]
        for instance_id, episode in zip(instance_ids, episodes):
            if on_episode is not None:
                on_episode(instance_id, episode)
        model.train(was_training)
        keys = ("prompt_ids", "completion_ids", "logprobs", "env_mask") + REWARD_NAMES
        return {k: [e[k] for e in episodes] for k in keys}
    return rollout_func


def arena_outcome(completions, arena_outcome, **kwargs):
    """The outcome reward G(outcome) + 0.5 s of each episode, as the env reported it."""
    return [float(r) for r in arena_outcome]


def arena_dense(completions, arena_dense, **kwargs):
    """sum_t r_t = (b_T - b_0) / 2 of each episode: the env's per-turn rewards added up."""
    return [float(r) for r in arena_dense]


def grpo_config(out, steps, lam=rpo.LAMBDA, num_generations=NUM_GENERATIONS,
                learning_rate=LEARNING_RATE, seed=0, **overrides):
    """A GRPOConfig for the arena in Python (the command line's is parse_args'): one instance
    per step (a group of num_generations episodes), rewards weighted (1, lam) in REWARD_NAMES'
    order, GRPO_DEFAULTS, nothing saved; overrides are GRPOConfig's fields."""
    from trl import GRPOConfig
    return GRPOConfig(**{**GRPO_DEFAULTS, **dict(
        output_dir=out, max_steps=steps, per_device_train_batch_size=num_generations,
        num_generations=num_generations, learning_rate=learning_rate,
        reward_weights=[1.0, lam], save_strategy="no", seed=seed), **overrides})


def trainer_for(env, model, tokenizer, config, *, instance_ids=None, turn_tokens=TURN_TOKENS,
                on_episode=None):
    """A GRPOTrainer whose completions are env episodes (make_rollout) and whose rewards are
    the arena's (arena_outcome, arena_dense)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental
    from trl import GRPOTrainer
    dataset, by_prompt = prompt_dataset(env, instance_ids)
    tokenizer.padding_side = "left"  # TRL pads prompts on the left
    return GRPOTrainer(model=model, reward_funcs=[arena_outcome, arena_dense], args=config,
                       train_dataset=dataset, processing_class=tokenizer,
                       rollout_func=make_rollout(env, by_prompt, turn_tokens, config.seed,
                                                 on_episode))


class ServerEnv(env_server.ServerSession):
    """The arena in another process: one session for calls made on it, and sessions(n), n
    sessions kept open across steps, that make_rollout plays a step's episodes on at once.
    `instances` are the server's own (the same --scenarios), for the prompts."""

    def __init__(self, url, instances):
        super().__init__(url, who=WHO)
        self.url, self.by_id, self.pool = url, {inst["id"]: inst for inst in instances}, []

    def sessions(self, n):
        """n sessions, this one the first (n episodes at once take n of the server's slots)."""
        while len(self.pool) < n - 1:
            self.pool.append(env_server.ServerSession(self.url, who=WHO))
        return [self] + self.pool[:n - 1]

    def close(self):
        for session in self.pool:
            session.close()
        super().close()


@dataclasses.dataclass
class ArenaArguments:
    """The arena's flags, beside GRPOConfig's own (TrlParser parses both, and --config FILE)."""
    policy: str = dataclasses.field(default="smollm2", metadata={"help": "the persuader TRL "
                                    "trains: random:NAME, smollm2 or a model folder"})
    persuadee: str = dataclasses.field(default="smollm2", metadata={
        "help": "random:NAME, smollm2, a model folder or openai:MODEL@URL"})
    judge: str = dataclasses.field(default="auto", metadata={
        "help": "'auto' (the presets' rule: none for a local persuadee on a CPU, else the "
                "persuadee's model), 'persuadee', 'none' (s = 0) or a model name"})
    server: Optional[str] = dataclasses.field(default=None, metadata={
        "help": "train against `python -m lab.env_server --serve` at this URL "
                "(http://127.0.0.1:PORT, started with the same --scenarios) instead of an env in "
                "this process, a step's episodes played at once as sessions; --persuadee, "
                "--judge, --t_max, --max_new_tokens are then the server's"})
    scenarios: str = dataclasses.field(default="train", metadata={
        "help": "train, heldout or a scenarios.jsonl"})
    instances: int = dataclasses.field(default=8, metadata={
        "help": "train on the first N instances"})
    lam: float = dataclasses.field(default=rpo.LAMBDA, metadata={
        "help": "the dense term's weight: reward = outcome + lam * sum_t r_t (rpo.LAMBDA)"})
    t_max: int = dataclasses.field(default=arena.T_MAX_TRAIN, metadata={
        "help": "the turn budget of an episode (arena.T_MAX_TRAIN)"})
    turn_tokens: int = dataclasses.field(default=TURN_TOKENS, metadata={
        "help": "the most tokens the persuader writes in one message"})
    max_new_tokens: int = dataclasses.field(default=engine.MAX_NEW_TOKENS, metadata={
        "help": "the persuadee's reply, in tokens (engine.MAX_NEW_TOKENS)"})
    resume: bool = dataclasses.field(default=False, metadata={
        "help": "continue the run in --output_dir from its last checkpoint"})
    overwrite: bool = dataclasses.field(default=False, metadata={
        "help": "replace the run in --output_dir (a folder this program wrote)"})


# TRL's GRPOConfig turns activation checkpointing on; the arena's tiny and CPU runs keep it off,
# by the name the installed transformers reads (activation_checkpointing, once gradient_*)
CHECKPOINTING = next(name for name in ("activation_checkpointing", "gradient_checkpointing")
                     if name in transformers.TrainingArguments.__dataclass_fields__)
GRPO_DEFAULTS = dict(  # GRPOConfig's defaults for the arena (a --config file or a flag overrides)
    output_dir="runs/trl-grpo", max_steps=2, num_generations=NUM_GENERATIONS,
    per_device_train_batch_size=NUM_GENERATIONS, gradient_accumulation_steps=1,
    learning_rate=LEARNING_RATE, logging_steps=1, save_strategy="steps", save_steps=SAVE_EVERY,
    save_total_limit=2, bf16=False, pad_to_multiple_of=None, **{CHECKPOINTING: False},
    dataloader_num_workers=0, use_cpu=not torch.cuda.is_available())


def parse_args(argv=None):
    """TRL's own command line: TrlParser over (ArenaArguments, GRPOConfig), `--config
    recipe.yaml` read first and the flags over it; GRPOConfig's flags as TRL names them
    (--output_dir, --max_steps, --learning_rate, --num_generations, --report_to ...). Returns
    the arena's arguments with `grpo`, the GRPOConfig (its reward weights (1, lam))."""
    from trl import GRPOConfig, TrlParser
    from lab import cli
    parser = TrlParser((ArenaArguments, GRPOConfig), prog="python -m lab.trl_grpo",
                       description=__doc__.strip().split("\n\n")[0])
    parser.set_defaults(**GRPO_DEFAULTS)
    parser.add_argument("--config", help="a YAML recipe of any of these fields (TrlParser's), "
                        "read first: the flags override it")  # consumed before the parse
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not batch_given(argv):  # one instance a step: the batch is the group's episodes
            group = parser.parse_args_and_config(list(argv))[1].num_generations
            parser.set_defaults(per_device_train_batch_size=group)
        arena_args, config, *_ = parser.parse_args_and_config(list(argv))
    except (ValueError, OSError) as e:  # GRPOConfig's own checks, a --config file
        parser.error(str(e).splitlines()[0])
    config.reward_weights = [1.0, arena_args.lam]
    args = argparse.Namespace(**vars(arena_args), grpo=config, out=config.output_dir,
                              steps=config.max_steps, seed=config.seed,
                              num_generations=config.num_generations,
                              learning_rate=config.learning_rate, save_every=config.save_steps)
    args.judge = persuasion_env.preset_judge(args.persuadee, args.judge)
    if problem := flag_problem(args):
        parser.error(problem)
    if (found := cli.model_problem(args.policy)):  # before any model loads
        parser.error(f"--policy {args.policy} {found}; {cli.MODEL_FIX}")
    return args


def batch_given(argv):
    """Whether the flags or the --config recipe set per_device_train_batch_size."""
    flags = ("--per_device_train_batch_size", "--per-device-train-batch-size")
    if any(a.split("=")[0] in flags for a in argv):
        return True
    if "--config" not in argv or argv.index("--config") + 1 >= len(argv):
        return False
    import yaml
    try:
        recipe = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())
    except (OSError, yaml.YAMLError):
        return False  # TrlParser names the file's problem
    return isinstance(recipe, dict) and "per_device_train_batch_size" in recipe


FLAGS = dict(steps="--max_steps", t_max="--t_max", turn_tokens="--turn_tokens",
             max_new_tokens="--max_new_tokens", save_every="--save_steps",
             instances="--instances")  # the flag that sets each checked value


def flag_problem(args):
    """What is wrong with the numbers and the --server URL, in one line, or None."""
    for name, flag in FLAGS.items():
        if getattr(args, name) < 1:
            return f"{flag} must be at least 1, got {getattr(args, name)}"
    if not 2 <= args.num_generations <= NUM_GENERATIONS_MAX:
        return (f"--num_generations must be in 2..{NUM_GENERATIONS_MAX} (GRPO's group; with "
                f"--server each episode is a session and a thread at once), got "
                f"{args.num_generations}")
    if not (math.isfinite(args.lam) and args.lam >= 0):
        return f"--lam must be >= 0 and finite, got {args.lam}"
    if not (math.isfinite(args.learning_rate) and 0 < args.learning_rate <= 1):
        return f"--learning_rate must be in (0, 1], got {args.learning_rate}"
    if not 0 <= args.seed < 2**32:
        return f"--seed must be in 0..{2**32 - 1}, got {args.seed}"
    if args.server and not args.server.startswith(("http://", "https://", "ws://", "wss://")):
        return f"--server takes a URL such as http://127.0.0.1:8000, got {args.server!r}"
    return None


def prepare_run(args, explicit=()):
    """The run folder --out, checked and locked before any model loads (lab/runs.py's rules:
    no link, an existing run refused without --resume or --overwrite, --overwrite of a folder
    this project wrote only, never inside another run; --resume only of a run of this program),
    its config.json written atomically. Returns (run_dir, the checkpoint to resume or None)."""
    from lab import runs
    run_dir = Path(args.out).absolute()
    for parent in run_dir.parents:
        if (parent / runs.MARKER).is_file():
            raise runs.say_error(WHO, f"--out {args.out} is inside the run {parent}; pass an "
                                      "--out of its own (e.g. runs/trl-grpo)")
    runs.check_folder(run_dir.parent, run_dir.name, WHO, args.resume, args.overwrite,
                      flag="--out")
    config = run_dir / "config.json"
    if args.resume and not ours(config):
        raise runs.say_error(WHO, f"--resume: {run_dir} is not a run of {WHO} (its config.json "
                                  "is another program's, or missing); pass another --out")
    if args.overwrite and config.is_file() and not ours(config):
        raise runs.say_error(WHO, f"--overwrite: {run_dir} is a run of another program (its "
                                  "config.json); nothing was deleted: pass another --out")
    runs.lock(run_dir, WHO, flag="--out")
    if args.overwrite:
        runs.clear(run_dir)
    latest = run_dir / "latest"
    if not args.resume:
        settings = {k: v for k, v in vars(args).items() if k != "grpo"}
        runs.write_atomic(config, json.dumps({"who": WHO, **settings, "grpo": args.grpo.to_dict()},
                                             indent=1, default=str), who=WHO)
        return run_dir, None
    if not latest.is_file():
        raise runs.say_error(WHO, f"--resume: no checkpoint in {run_dir} yet; pass "
                                  "--overwrite to start it again")
    pin_resumed(args, config, explicit)
    return run_dir, run_dir / latest.read_text().strip()


def given(argv):
    """The settings a command line names (--flag or --flag=value), by their dest."""
    import sys
    argv = sys.argv[1:] if argv is None else argv
    names = {a[2:].partition("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    return {TRL_NAMES.get(n, n) for n in names}


TRL_NAMES = dict(max_steps="steps", output_dir="out", save_steps="save_every")  # GRPOConfig's
# flags under the names parse_args gives them on args


def pin_resumed(args, config, explicit):
    """--resume keeps every setting config.json recorded (lab/cli.pin_settings, as train.py's):
    one the command line leaves out takes the recorded value, one it names with another is
    refused in one line (only RESUME_MAY_CHANGE may change); config.json stays as written."""
    from lab import cli
    recorded = jsonl.loads(config.read_text())
    cli.pin_settings(args, recorded, explicit, WHO, RESUME_MAY_CHANGE,
                     ("who", "out", "resume", "overwrite", "grpo"), record=str(config),
                     restart="start a new run (another --output_dir)")
    args.grpo = resumed_config(recorded["grpo"], args)
    if problem := flag_problem(args):
        raise SystemExit(f"{WHO}: --resume: {problem} (the value read from {config})")


def resumed_config(recorded, args):
    """The GRPOConfig the run recorded, its max_steps and save_steps as this command sets them."""
    from trl import GRPOConfig
    fields = {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
    derived = ("generation_batch_size",)  # GRPOConfig sets it from steps_per_generation
    kept = {k: v for k, v in recorded.items() if k in fields and k not in derived}
    return GRPOConfig(**{**kept, "max_steps": args.steps, "save_steps": args.save_every})


def ours(config):
    """Whether config.json is one this program wrote."""
    try:
        return jsonl.loads(config.read_text()).get("who") == WHO
    except (OSError, ValueError, AttributeError):
        return False


def latest_callback(run_dir):
    """A TrainerCallback that, once the Trainer has written checkpoint-STEP whole, names it in
    run_dir/latest (written atomically): a checkpoint cut by a kill is never resumed from, nor
    one whose weights hold a NaN or an infinity (the run stops in one line instead)."""
    from transformers import TrainerCallback
    from lab import runs

    from lab import checkpoints

    class Latest(TrainerCallback):
        def on_save(self, args, state, control, model=None, **kwargs):
            folder = run_dir / f"checkpoint-{state.global_step}"
            if model is not None and (bad := checkpoints.nonfinite_weight(model.state_dict())):
                raise runs.say_error(WHO, f"the persuader's {bad} is not finite at step "
                                     f"{state.global_step}; latest still names the last finite "
                                     "checkpoint: lower --learning-rate, then --resume (or "
                                     "--overwrite)")
            if folder.is_dir():
                runs.write_atomic(run_dir / "latest", folder.name, who=WHO)
    return Latest()


def arena_env(args, instances):
    """The env the run trains against: the server's sessions (--server) or one in-process."""
    from lab import env as persuasion_env
    if args.server:
        return ServerEnv(args.server, instances)
    return persuasion_env.PersuasionEnv(
        args.persuadee, scenarios=instances, t_max=args.t_max, max_new_tokens=args.max_new_tokens,
        judge=args.judge)


def main(argv=None):
    from lab import env as persuasion_env
    from lab import runs
    args = parse_args(argv)
    try:
        instances = persuasion_env.load_instances(args.scenarios)[:args.instances]
    except ValueError as e:
        raise SystemExit(f"{WHO}: --scenarios: {e}") from None
    run_dir, resume = prepare_run(args, given(argv))
    if resume:  # the run's own scenarios and instances (pinned)
        instances = persuasion_env.load_instances(args.scenarios)[:args.instances]
    restore = runs.exit_on_interrupt(WHO, run_dir)  # Ctrl-C: at once, in one line
    try:
        train_run(args, instances, run_dir, resume)
    finally:
        restore()
        runs.unlock(run_dir)


def train_run(args, instances, run_dir, resume):
    """The run in run_dir (prepared and locked): trained, its persuader saved."""
    from lab import checkpoints, runs
    env = arena_env(args, instances)
    model, tokenizer = models.load_model(args.policy)
    config = args.grpo
    config.output_dir = str(run_dir)
    trainer = trainer_for(env, model, tokenizer, config, turn_tokens=args.turn_tokens)
    trainer.add_callback(latest_callback(run_dir))
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    except (ConnectionError, TimeoutError) as e:
        why = "did not answer in time" if isinstance(e, TimeoutError) else "went away mid-run"
        raise SystemExit(f"{WHO}: the arena {why} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120] if str(e) else ''}); the run keeps its "
                         f"last checkpoint: rerun with --resume") from None
    except OSError as e:  # a checkpoint's write: a full disk, most often
        raise SystemExit(runs.write_failure(WHO, "a checkpoint", run_dir, e, "latest names the "
                                            "last whole one")) from None
    finally:
        env.close()
    if bad := checkpoints.nonfinite_weight(model.state_dict()):
        raise runs.say_error(WHO, f"the persuader's {bad} is not finite after training; not "
                                  "saving it: lower --learning-rate and rerun with --overwrite")
    try:
        runs.write_folder_atomic(run_dir / PERSUADER, trainer.save_model)
    except OSError as e:
        raise SystemExit(runs.write_failure(WHO, PERSUADER, run_dir, e, "the checkpoints are "
                                            "intact")) from None
    for row in trainer.state.log_history:
        if "reward" in row:
            print(f"step {row['step']}: reward {row['reward']:.4f}  outcome "
                  f"{row['rewards/arena_outcome/mean']:.4f}  dense "
                  f"{row['rewards/arena_dense/mean']:.4f}")


if __name__ == "__main__":
    main()
