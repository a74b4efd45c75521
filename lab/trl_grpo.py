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

    python -m lab.trl_grpo --policy random:tiny-qwen3 --persuadee random:tiny-qwen3 \\
        --judge none --steps 2 --t-max 2 --turn-tokens 8 --out runs/trl-smoke
    python -m pytest -q tests/test_trl_grpo.py
"""
import os

import torch
from transformers import DynamicCache

import arena
import models
import rpo

NUM_GENERATIONS = 4  # episodes per instance: GRPO's group
TURN_TOKENS = 128  # the most tokens the persuader generates in one message
LEARNING_RATE = 1e-6
REWARD_NAMES = ("arena_outcome", "arena_dense")  # TRL logs rewards/<name>/mean per step


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
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), past_key_values=cache,
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
    each prompt NUM_GENERATIONS times), episode seeds seed, seed + 1, ... in order of play.
    on_episode(instance id, episode) sees each episode (tests, logs)."""
    played = [0]

    def rollout_func(prompts, trainer):
        instance_ids = [by_prompt.get(prompt_key(prompt)) for prompt in prompts]
        if None in instance_ids:
            raise ValueError("trl_grpo.py: rollout_func got a prompt that is no instance's "
                             "opening; build the dataset with prompt_dataset(env)")
        model = trainer.accelerator.unwrap_model(trainer.model)
        gen_kwargs = generation_kwargs(trainer, turn_tokens)
        was_training = model.training
        model.eval()
        episodes = []
        for instance_id in instance_ids:
            episode = play_episode(env, model, trainer.processing_class, instance_id,
                                   seed + played[0], gen_kwargs)
            played[0] += 1
            if on_episode is not None:
                on_episode(instance_id, episode)
            episodes.append(episode)
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
    """A GRPOConfig for the arena: one instance per step (a group of num_generations episodes),
    rewards weighted (1, lam) in REWARD_NAMES' order, fp32, nothing saved, logged every step."""
    from trl import GRPOConfig
    return GRPOConfig(**{**dict(
        output_dir=out, max_steps=steps, per_device_train_batch_size=num_generations,
        num_generations=num_generations, gradient_accumulation_steps=1,
        learning_rate=learning_rate, reward_weights=[1.0, lam], logging_steps=1,
        save_strategy="no", report_to="none", bf16=False, gradient_checkpointing=False,
        pad_to_multiple_of=None, seed=seed, dataloader_num_workers=0, disable_tqdm=True,
        use_cpu=not torch.cuda.is_available()), **overrides})


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


class ServerEnv:
    """reset and step, the two calls make_rollout makes, over openenv-core's own client against
    `python -m lab.env_server --serve` (one WebSocket session): the same GRPO run with the arena in
    another process. `instances` are the server's own (the same --scenarios), for the prompts."""

    def __init__(self, url, instances):
        from openenv.core import GenericEnvClient
        self.by_id = {inst["id"]: inst for inst in instances}
        self.client = GenericEnvClient(base_url=url).sync().connect()

    def reset(self, *, seed=None, options=None):
        result = self.client.reset(seed=seed, instance=(options or {}).get("instance"))
        return tuple(result.observation["messages"]), result.observation["info"]

    def step(self, text):
        result = self.client.step({"message": text})
        seen = result.observation
        return (tuple(seen["messages"]), result.reward, seen["terminated"], seen["truncated"],
                seen["info"])

    def close(self):
        self.client.close()


def parse_args(argv=None):
    import engine
    from lab import cli
    ap = cli.new_parser("python -m lab.trl_grpo", __doc__)
    ap.add_argument("--policy", default="smollm2", help="the persuader TRL trains: random:NAME, "
                    "smollm2 or a model folder")
    ap.add_argument("--persuadee", default="smollm2", help="random:NAME, smollm2, a model "
                    "folder or openai:MODEL@URL")
    ap.add_argument("--judge", default="persuadee", help="'persuadee' (its model), 'none' "
                    "(s = 0) or a model name")
    ap.add_argument("--server", help="train against `python -m lab.env_server --serve` at this URL "
                    "(http://127.0.0.1:PORT, started with the same --scenarios) instead of an "
                    "env in this process; --persuadee, --judge, --t-max, --max-new-tokens are "
                    "the server's")
    ap.add_argument("--scenarios", default="train", help="train, heldout or a scenarios.jsonl")
    ap.add_argument("--instances", type=int, default=8, help="train on the first N instances")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--num-generations", type=int, default=NUM_GENERATIONS)
    ap.add_argument("--lam", type=float, default=rpo.LAMBDA)
    ap.add_argument("--learning-rate", type=float, default=LEARNING_RATE)
    ap.add_argument("--t-max", type=int, default=arena.T_MAX_TRAIN)
    ap.add_argument("--turn-tokens", type=int, default=TURN_TOKENS)
    ap.add_argument("--max-new-tokens", type=int, default=engine.MAX_NEW_TOKENS,
                    help="the persuadee's reply, in tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/trl-grpo")
    args = ap.parse_args(argv)
    for name in ("instances", "steps", "t_max", "turn_tokens", "max_new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.num_generations < 2:
        ap.error(f"--num-generations must be at least 2 (GRPO's group), got "
                 f"{args.num_generations}")
    if not (args.lam >= 0 and args.learning_rate > 0):
        ap.error(f"--lam must be >= 0 and --learning-rate > 0, got {args.lam}, "
                 f"{args.learning_rate}")
    if args.server and not args.server.startswith(("http://", "https://", "ws://", "wss://")):
        ap.error(f"--server takes a URL such as http://127.0.0.1:8000, got {args.server!r}")
    if (found := cli.model_problem(args.policy)):  # before any model loads
        ap.error(f"--policy {args.policy} {found}; {cli.MODEL_FIX}")
    return args


def main(argv=None):
    from lab import env as persuasion_env
    args = parse_args(argv)
    instances = persuasion_env.load_instances(args.scenarios)[:args.instances]
    env = (ServerEnv(args.server, instances) if args.server else persuasion_env.PersuasionEnv(
        args.persuadee, scenarios=instances, t_max=args.t_max, max_new_tokens=args.max_new_tokens,
        judge=None if args.judge == "none" else args.judge))
    model, tokenizer = models.load_model(args.policy)
    config = grpo_config(args.out, args.steps, args.lam, args.num_generations,
                         args.learning_rate, args.seed)
    trainer = trainer_for(env, model, tokenizer, config, turn_tokens=args.turn_tokens)
    trainer.train()
    env.close()
    trainer.save_model(args.out)  # the trained persuader and its tokenizer, a folder eval.py takes
    for row in trainer.state.log_history:
        if "reward" in row:
            print(f"step {row['step']}: reward {row['reward']:.4f}  outcome "
                  f"{row['rewards/arena_outcome/mean']:.4f}  dense "
                  f"{row['rewards/arena_dense/mean']:.4f}")


if __name__ == "__main__":
    main()
