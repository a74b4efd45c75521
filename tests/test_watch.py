"""lab/watch.py: the watch-it-learn command is a sweep whose every arm train.py accepts."""
from persuarena import rpo
from persuarena import train
from lab import cli, sweep, watch


def test_each_watch_is_a_sweep_with_a_frozen_control_that_train_py_accepts(tmp_path):
    for preset in watch.WATCHES:
        args, extra = sweep.parse_args(watch.sweep_argv(preset, out=tmp_path))
        assert args.frozen_control and args.lams == [rpo.LAMBDA] and args.seeds == list(watch.SEEDS)
        assert args.steps == watch.WATCHES[preset]["steps"] and args.name == f"watch-{preset}"
        for lam in (rpo.LAMBDA, sweep.FROZEN):
            arm = cli.train_args(sweep.arm_argv(args, extra, lam, 0, tmp_path), train)
            assert arm.preset == preset and arm.judge == "none"
            assert arm.lr == (0.0 if lam == sweep.FROZEN else float(extra[extra.index("--lr") + 1]))


def test_the_tiny_watch_is_the_suites_learning_configuration():
    """What the README's watch command trains is what tests/test_train.py's learning test checks
    (three turns, 8 tokens, greedy persuadee, no KL, no anchor, lr 1.5e-2, G 4, 2 instances)."""
    a = cli.train_args(["--preset", "tiny", *(x.replace(sweep.SEED_FIELD, "0") for x in watch.WATCH_TINY["train"])], train)
    assert (a.group_size, a.instances, a.t_max, a.max_new_tokens) == (4, 2, 3, 8)
    assert (a.persuadee_temperature, a.kl_beta, a.anchor, a.lr) == (0.0, 0.0, False, 1.5e-2)


def test_each_seed_starts_from_its_own_weights_and_its_control_from_the_same(tmp_path):
    """The tiny watch's arms name random:tiny-llama@SEED: seed 1's arm and its frozen control load
    the same initial weights, seed 0's others (random:NAME is @0); a bad seed is refused."""
    import torch

    from persuarena import models
    args, extra = sweep.parse_args(watch.sweep_argv("tiny", out=tmp_path))
    names = {(lam, s): cli.train_args(sweep.arm_argv(args, extra, lam, s, tmp_path), train).persuader
             for lam in (rpo.LAMBDA, sweep.FROZEN) for s in (0, 1)}
    assert names[rpo.LAMBDA, 1] == names[sweep.FROZEN, 1] == "random:tiny-llama@1"
    first = lambda name: next(models.load_model(name, device="cpu")[0].parameters()).detach()
    assert torch.equal(first(names[rpo.LAMBDA, 0]), first("random:tiny-llama"))
    assert not torch.equal(first(names[rpo.LAMBDA, 0]), first(names[rpo.LAMBDA, 1]))
    assert cli.model_problem("random:tiny-llama@x") and models.random_spec("random:tiny-llama@2") == ("tiny-llama", 2)


