"""lab/watch.py: the watch-it-learn command is a sweep whose every arm train.py accepts."""
import rpo
import train
from lab import cli, sweep, watch


def test_each_watch_is_a_sweep_with_a_frozen_control_that_train_py_accepts(tmp_path):
    for preset in watch.WATCHES:
        args, extra = sweep.parse_args(watch.sweep_argv(preset) + [])
        assert args.frozen_control and args.lams == [rpo.LAMBDA] and args.seeds == list(watch.SEEDS)
        assert args.steps == watch.WATCHES[preset]["steps"] and args.name == f"watch-{preset}"
        for lam in (rpo.LAMBDA, sweep.FROZEN):
            arm = cli.train_args(sweep.arm_argv(args, extra, lam, 0, tmp_path), train)
            assert arm.preset == preset and arm.judge == "none"
            assert arm.lr == (0.0 if lam == sweep.FROZEN else float(extra[extra.index("--lr") + 1]))


def test_the_tiny_watch_is_the_suites_learning_configuration():
    """What the README's watch command trains is what tests/test_train.py's learning test checks
    (three turns, 8 tokens, greedy persuadee, no KL, no anchor, lr 1.5e-2, G 4, 2 instances)."""
    a = cli.train_args(["--preset", "tiny", *watch.WATCH_TINY["train"]], train)
    assert (a.group_size, a.instances, a.t_max, a.max_new_tokens) == (4, 2, 3, 8)
    assert (a.persuadee_temperature, a.kl_beta, a.anchor, a.lr) == (0.0, 0.0, False, 1.5e-2)


def test_the_watch_trains_at_the_methods_lambda_as_edited(monkeypatch):
    """One lambda: an edit of rpo.LAMBDA is the watch's arm."""
    monkeypatch.setattr(rpo, "LAMBDA", 0.25)
    argv = watch.sweep_argv("tiny")
    assert argv[argv.index("--lams") + 1] == "0.25"
