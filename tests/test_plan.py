"""The memory plan (plan.py): what one rank holds, from configs alone, against real parameter
counts of random models of the same shapes; a run that cannot fit is refused before loading.

    python -m pytest -q test_plan.py
"""
import pytest
import torch

from persuarena import engine
from lab import fastpath, lora, padded, plan, shapes
from persuarena import train
from lab import presets
from test_train import TINY, no_model_loads, parse_train  # noqa: F401 (a fixture)


def test_the_paper_plan_fits_and_its_weights_are_the_parameter_counts(capsys, monkeypatch):
    """train.py --plan for the paper preset on 8 x H200, on this CPU, reads no weight: it fits
    with headroom; its weight figures are the parameter counts of random models of the same
    shapes (built on the meta device), in the bytes of each role's dtype and share."""
    from persuarena import models

    def no_weights(*a, **k):
        raise AssertionError("the plan read a model")
    monkeypatch.setattr(models, "load_model", no_weights)
    rank_plan = plan.print_plan(parse_train(["--preset", "paper", "--plan", "--plan-ranks",
                                                  "8", "--plan-gib", "139", "--out", "/nonexistent"]))
    shown = capsys.readouterr().out
    assert "headroom" in shown and rank_plan["total"] < rank_plan["capacity"]
    count = lambda shape: sum(p.numel() for p in models.random_model(
        shape, torch.bfloat16, "meta")[0].parameters())
    P, E = count("qwen3-4b"), count("qwen3-14b")
    items = dict(rank_plan["items"])
    assert items["policy master weights fp32 (1/8 shard)"] == 4 * P // 8
    assert items["AdamW moments fp32 (1/8 shard)"] == 8 * P // 8
    assert items["rollout copy bfloat16 (persuader engine's weights)"] == 2 * P
    assert items["reference bfloat16 (1/8 shard)"] == 2 * P // 8
    assert items["persuadee bfloat16"] == 2 * E
    for role in ("persuader", "persuadee"):  # the attention transient is planned
        assert items[f"{role} attention transient"] >= 2 * fastpath.ATTENTION_CALL_MB * 2**20
    for shape in ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "smollm2-135m"):
        assert plan.parameter_count(models.random_config(shape)) == count(shape), shape


def test_a_plan_that_cannot_fit_is_refused_in_one_line_before_loading(tmp_path, short_scenarios,
                                                                       no_model_loads):
    """A run whose plan exceeds the device is refused in one line with the numbers before any
    model loads; --plan says the same; a distinct judge is planned into memory, a judge naming
    the persuadee's model is not."""
    with pytest.raises(SystemExit) as e:
        plan.print_plan(parse_train(["--preset", "paper", "--plan", "--plan-ranks", "8",
                                           "--plan-gib", "40", "--out", str(tmp_path)]))
    message = str(e.value.code)
    assert message.startswith("train.py: this run does not fit: ") and "\n" not in message
    assert "GiB a rank needed, 40.0 GiB available" in message
    paper = ["--preset", "paper", "--plan", "--plan-ranks", "8", "--plan-gib", "139", "--out",
             str(tmp_path)]
    shared = plan.memory_plan(parse_train(paper + ["--judge", "Qwen/Qwen3-14B"]), 8, 139, True)
    own = plan.memory_plan(parse_train(paper + ["--judge", "random:qwen3-14b"]), 8, 139, True)
    assert not any(name.startswith("judge") for name, _ in shared["items"])
    assert dict(own["items"])["judge bfloat16 (its own model)"] == dict(shared["items"])["persuadee bfloat16"]
    assert own["total"] > own["capacity"]  # a second 14B does not fit beside the rest
    import os
    monkeypatch_free = pytest.MonkeyPatch()
    monkeypatch_free.setattr(os, "sysconf", lambda name: 1 if name == "SC_PAGE_SIZE" else 2**20)
    try:  # a machine of 1 MiB: the tiny run itself is refused before loading
        with pytest.raises(SystemExit) as e:
            train.main(TINY + ["--scenarios", short_scenarios, "--out", str(tmp_path), "--name", "y"])
    finally:
        monkeypatch_free.undo()
    assert str(e.value.code).startswith("train.py: this run does not fit: ")
    assert not (tmp_path / "y").exists()


def test_the_largest_prefill_runs_in_attention_calls_within_their_budget():
    """The judge's prefill of one rank's 16 transcripts at the Qwen3-14B shape (40 query heads,
    8 kv heads, head_dim 128, bf16; ~4k tokens each, the reason MATH ran out of memory) splits
    into padded-path SDPA calls each within ATTENTION_CALL_MB, with every query in exactly one
    call, and a single 32k-token prefill into windows of its queries."""
    import functools
    cost = functools.partial(padded.call_bytes, heads=40, kv_heads=8, head_dim=128, itemsize=2)
    budget = fastpath.ATTENTION_CALL_MB * 2**20
    for q_lens in (torch.tensor([4096 - 37 * i for i in range(16)]), torch.tensor([32768])):
        tables = torch.zeros(len(q_lens), 32768 // 16, dtype=torch.long)
        calls = padded.padded_calls(q_lens, q_lens, tables, 16, cost, budget)
        assert max(cost(*c.q_pos.shape, c.tables.shape[1] * 16) for c in calls) <= budget
        covered = torch.cat([torch.arange(c.lo, c.hi) for c in calls])
        assert covered.tolist() == list(range(int(q_lens.sum())))
        assert all(len(c.index) == c.hi - c.lo for c in calls)


def test_the_one_gpu_preset_fits_one_h200_and_counts_adapters_base_and_reference(capsys,
                                                                                  monkeypatch):
    """train.py --preset one-gpu --plan: LoRA on the paper's models fits one H200 (139 GiB) with
    over 15% to spare, reading no weight, and says what it gives up against the paper. The
    adapters are counted as peft builds them (16 bytes a parameter: fp32 weights, gradients,
    moments), the frozen base once in bf16 (no reference copy: the base with the adapter off),
    the rollout copy once, nothing sharded."""
    from persuarena import models
    from conftest import tiny_model
    for shape in ("qwen3", "llama"):
        adapted = lora.attach_lora(tiny_model(shape), 4, f"random:tiny-{shape}")
        assert plan.lora_parameter_count(adapted.config, 4) == \
            sum(p.numel() for p in lora.lora_parameters(adapted))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the plan read a model"))
    train.main(["--preset", "one-gpu", "--plan", "--plan-gib", "139", "--out", "/nonexistent"])
    shown = capsys.readouterr().out
    assert "against the paper preset" in shown and "16 episodes a step (paper 128" in shown
    args = parse_train(["--preset", "one-gpu", "--plan", "--out", "/nonexistent"])
    rank_plan = plan.memory_plan(args, 1, 139, True)
    assert rank_plan["capacity"] - rank_plan["total"] > 0.15 * rank_plan["capacity"]
    items = dict(rank_plan["items"])
    P = plan.parameter_count(shapes.model_config(args.persuader))
    L = plan.lora_parameter_count(shapes.model_config(args.persuader), presets.LORA_RANK)
    assert items[f"LoRA adapters r=64 fp32 ({L / 1e6:.0f}M, replicated)"] + \
        items["adapter gradients fp32"] + items["AdamW moments fp32 (adapters)"] == 16 * L
    assert items["frozen base bfloat16 (the reference, adapter off)"] == 2 * P
    assert items["rollout copy bfloat16 (merged, persuader engine's)"] == 2 * P
    assert not any("reference bfloat16" in k or "master" in k or "autocast" in k for k in items)


def test_the_paper_plan_says_the_disk_it_keeps(capsys):
    """--plan prints the disk at the run's fullest: the fp32 weights of the evaluated steps and
    of the latest two checkpoints, AdamW's state (8 bytes a parameter) of those two only."""
    from persuarena import models
    args = parse_train(["--preset", "paper", "--plan", "--plan-ranks", "8", "--plan-gib", "139",
                        "--out", "/nonexistent"])
    plan.print_plan(args)
    assert "disk plan for /nonexistent/" in capsys.readouterr().out
    P = sum(p.numel() for p in models.random_model("qwen3-4b", torch.bfloat16, "meta")[0].parameters())
    saved, evaluated = plan.saved_steps(args)
    assert len(evaluated) == args.steps // args.eval_every and saved[-1] == args.steps
    disk = plan.disk_plan(args)
    weights, optimizer = (n for _, n in disk["items"][:2])
    assert weights == 4 * P * len(evaluated | set(saved[-2:])) and optimizer == 2 * 8 * P
    assert disk["total"] < 0.6 * (4 + 8) * P * len(evaluated)  # against every checkpoint whole


def test_a_disk_that_cannot_hold_the_run_is_refused_in_one_line(tmp_path, short_scenarios,
                                                                 no_model_loads, monkeypatch):
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 2**20, 2**20))
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--scenarios", short_scenarios, "--out", str(tmp_path), "--name", "d"])
    message = str(e.value.code)
    assert message.startswith("train.py: the disk does not hold this run: ") and "\n" not in message
    assert "0.0 GiB free there" in message and "--out" in message


def test_the_plan_lists_the_forward_transients_and_the_lora_merge():
    """Beside attention: each engine's forward transient at engine.FORWARD_TOKENS new tokens (the
    most a forward runs: the judge's prompts and the fidelity forks are chunked), and under LoRA
    the merge of the largest projection (fp32 weight, delta, sum, and the bf16 cast), measured
    against the parameters of a random model of the paper's shape."""
    from persuarena import engine
    from persuarena import models
    paper = dict(plan.memory_plan(parse_train(["--preset", "paper", "--plan", "--out",
                                                "/nonexistent"]), 8, 139, True)["items"])
    label = f"forward transient ({engine.FORWARD_TOKENS} tokens at most)"
    persuadee = shapes.model_config(presets.preset_values("paper")["persuadee"])
    assert paper[f"persuadee {label}"] == plan.forward_transient_bytes(persuadee, 2, engine.FORWARD_TOKENS)
    assert paper[f"persuadee {label}"] > engine.FORWARD_TOKENS * 3 * persuadee.intermediate_size * 2
    assert f"persuader {label}" in paper and not any("LoRA merge" in k for k in paper)
    one = dict(plan.memory_plan(parse_train(["--preset", "one-gpu", "--plan", "--out",
                                              "/nonexistent"]), 1, 139, True)["items"])
    model = models.random_model("qwen3-4b", torch.bfloat16, "meta")[0]
    largest = max(m.weight.numel() for name, m in model.named_modules()
                  if name.rsplit(".", 1)[-1] in lora.LORA_TARGETS)
    assert one["LoRA merge, one module at a time"] == largest * (4 + 4 + 4 + 2)
    # the update's logits: each row's own kept positions (steps.row_logits), t_max x
    # max_new_tokens a row, in bf16 (logits and their gradient) and fp32 (autograd's and the
    # reference's rows)
    args = parse_train(["--preset", "paper", "--plan", "--out", "/nonexistent"])
    assert paper["update logits, each row's kept positions"] == (
        args.micro_batch * args.t_max * args.max_new_tokens * 151936 * (2 + 2 + 4 + 4))


def test_the_decode_memory_says_what_the_heldout_evaluation_gives_up():
    """Decode memory is sized for the training batch at the training context; the paper's
    held-out evaluation (15 scenarios a rank, bucket 16, T_max 10) runs past it, and its line
    says by how much covering it would grow: the same arithmetic as fastpath's sizing."""
    from lab import fastpath
    args = parse_train(["--preset", "paper", "--plan", "--out", "/nonexistent"])
    items = dict(plan.memory_plan(args, 8, 139, True)["items"])
    cfg = shapes.model_config(args.persuader)
    rows, tokens = plan.engine_contexts(args, 8, 16)[1]
    extent = fastpath.round_up(tokens + fastpath.SYNC_EVERY, fastpath.CAPACITY_BUCKET)
    persuader = next(k for k in items if k.startswith("persuader decode memory"))
    more = (fastpath.decode_memory_bytes(16, extent, plan.kv_token_bytes(cfg, 2)) - items[persuader]) / 2**30
    assert rows == 15 and more > 0
    assert persuader.endswith(f"held-out turns past it decode in smaller batches; 16 rows at {extent} "
                          f"tokens: +{more:.1f} GiB)")
    small = plan.memory_plan(parse_train(["--preset", "paper", "--plan", "--out", "/nonexistent",
                                          "--eval-every", "0"]), 8, 139, True)["items"]
    assert "persuader decode memory" in dict(small)  # no evaluation: nothing given up


def test_the_plan_on_a_machine_without_a_gpu_is_the_run_it_would_start(capsys, monkeypatch):
    """`python train.py --plan` (the cpu preset, no GPU here) plans this machine's one process
    and exits 0; the paper preset is planned on the node it is for, said; one-gpu on its one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert train.main(["--plan", "--out", "/nonexistent"]) == []
    shown = capsys.readouterr().out
    assert "on this machine" in shown and "1 CPU rank(s)" in shown
    train.main(["--preset", "paper", "--plan", "--out", "/nonexistent"])
    assert f"planning the paper preset on {plan.PLAN_NODE[0]} GPU(s)" in capsys.readouterr().out
    train.main(["--preset", "one-gpu", "--plan", "--out", "/nonexistent"])
    assert "for 1 GPU(s) of 139.0 GiB" in capsys.readouterr().out
