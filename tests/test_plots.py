"""Tests of plots.py: every figure is written as a PNG of its stated size.
Run: python -m pytest -q test_plots.py"""

import json
import struct
from pathlib import Path

import numpy as np

from lab import analyses
from persuarena import eval as evaluation
from lab import plots
from lab import report
from test_analyses import LAB, SIX


def png_size(path):
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plots_png_size(tmp_path):
    plots.plot_beliefs(SIX, tmp_path / "b.png")
    plots.plot_probes(SIX, tmp_path / "p.png")
    assert png_size(tmp_path / "b.png") == tuple(round(v * plots.DPI) for v in plots.BELIEF_FIGSIZE)
    assert png_size(tmp_path / "p.png") == tuple(round(v * plots.DPI) for v in plots.PROBE_FIGSIZE)
    assert (tmp_path / "b.png").stat().st_size > 10_000


def test_plot_run(tmp_path):
    rows = [{"step": s, "reward_mean": 0.1 * s, "outcome_ACCEPT": 0.2, "outcome_PENDING": 0.5,
             "kl": 0.01 * s, "note": "text", "flag": True} for s in range(5)]
    rows[4]["heldout_full_accept"] = 0.3  # logged only at eval steps
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = plots.plot_run(tmp_path)
    # panels: outcome shares, reward_mean, kl, heldout_full_accept -> 2 rows of RUN_COLS
    w, h = plots.RUN_PANEL_SIZE
    assert path == tmp_path / "curves.png"
    assert png_size(path) == (round(w * plots.RUN_COLS * plots.DPI), round(h * 2 * plots.DPI))


def test_overlay_and_moves_plots(tmp_path, monkeypatch, figures):
    monkeypatch.chdir(tmp_path)
    report.save_run(tmp_path / "A", LAB, analyses.summarize(LAB))
    report.save_run(tmp_path / "B", SIX, analyses.summarize(SIX))
    assert png_size(tmp_path / "A" / "moves.png") == tuple(round(v * plots.DPI) for v in plots.MOVES_FIGSIZE)
    assert not (tmp_path / "B" / "moves.png").exists()   # no labels stored
    evaluation.main(["--overlay", str(tmp_path / "A"), str(tmp_path / "B"), "--name", "ov"])
    assert png_size(tmp_path / "evals" / "ov" / "overlay.png") == tuple(round(v * plots.DPI) for v in plots.OVERLAY_FIGSIZE)
    assert png_size(tmp_path / "evals" / "ov" / "overlay_probes.png") == \
        tuple(round(v * plots.DPI) for v in plots.PROBE_FIGSIZE)


def test_run_panels_keep_advantage_magnitudes_out_of_the_outcome_shares():
    panels = plots.run_panels(["outcome_ACCEPT", "outcome_term_abs", "outcome_WALK_AWAY", "kl"])
    assert panels == [("outcome shares", ["outcome_ACCEPT", "outcome_WALK_AWAY"]),
                      ("outcome_term_abs", ["outcome_term_abs"]), ("kl", ["kl"])]


def test_system_labels_are_the_shortest_distinct_tails():
    assert plots.system_labels(["evals/A", "evals/B"]) == ["A", "B"]
    assert plots.system_labels(["runs/x/eval-8", "runs/y/eval-8"]) == ["x/eval-8", "y/eval-8"]
    assert plots.system_labels(["same", "same"]) == ["same", "same"]


def test_running_mean_by_hand():
    assert plots.running_mean([1.0, 2.0, 3.0, 4.0], window=2) == [1.0, 1.5, 2.5, 3.5]
    assert plots.running_mean([], window=3) == []


def test_plot_training_draws_the_difference_from_the_control(tmp_path, monkeypatch):
    """training.png's right panel: per seed the running mean of arm minus same-seed control, and
    their mean over seeds, computed by hand here (a swapped sign or an unpaired seed fails)."""
    control = {0: [0.0, 0.1, 0.2], 1: [0.3, 0.3, 0.3]}
    arms = {"lambda 1": {0: [0.5, 0.5, 0.5], 1: [0.0, 0.6, 0.3]}}
    figures = []
    monkeypatch.setattr(plots, "_save_fig", lambda fig, path: figures.append((fig, path)))
    plots.plot_training(arms, control, tmp_path, window=2)
    (fig, path), = figures
    assert path == tmp_path / "training.png"
    left, right = fig.axes
    seed0 = [0.5, 0.45, 0.35]      # running means (window 2) of 0.5, 0.4, 0.3
    seed1 = [-0.3, 0.0, 0.15]      # of -0.3, 0.3, 0.0
    drawn = [line.get_ydata() for line in right.get_lines() if len(line.get_ydata()) == 3]
    assert any(np.allclose(d, seed0) for d in drawn) and any(np.allclose(d, seed1) for d in drawn)
    assert any(np.allclose(d, (np.array(seed0) + seed1) / 2) for d in drawn)
    frozen = [line for line in left.get_lines() if line.get_label().startswith("frozen")][0]
    assert np.allclose(frozen.get_ydata(), [0.15, 0.175, 0.225])  # seeds averaged: 0.15, 0.2, 0.25
    plots.plt.close(fig)
    monkeypatch.undo()
    plots.plot_training(arms, control, tmp_path)
    assert png_size(tmp_path / "training.png") == tuple(round(v * plots.DPI) for v in plots.OVERLAY_FIGSIZE)
