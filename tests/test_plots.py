"""Tests of plots.py: every figure is written as a PNG of its stated size.
Run: python -m pytest -q test_plots.py"""

import json
import struct
from pathlib import Path

from lab import analyses
import eval as evaluation
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


def test_overlay_and_moves_plots(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report.save_run(tmp_path / "A", LAB, analyses.summarize(LAB))
    report.save_run(tmp_path / "B", SIX, analyses.summarize(SIX))
    assert png_size(tmp_path / "A" / "moves.png") == tuple(round(v * plots.DPI) for v in plots.MOVES_FIGSIZE)
    assert not (tmp_path / "B" / "moves.png").exists()   # no labels stored
    evaluation.main(["--overlay", str(tmp_path / "A"), str(tmp_path / "B"), "--name", "ov"])
    assert png_size(tmp_path / "evals" / "ov" / "overlay.png") == tuple(round(v * plots.DPI) for v in plots.OVERLAY_FIGSIZE)
    assert png_size(tmp_path / "evals" / "ov" / "overlay_probes.png") == \
        tuple(round(v * plots.DPI) for v in plots.PROBE_FIGSIZE)


def test_system_labels_are_the_shortest_distinct_tails():
    assert plots.system_labels(["evals/A", "evals/B"]) == ["A", "B"]
    assert plots.system_labels(["runs/x/eval-8", "runs/y/eval-8"]) == ["x/eval-8", "y/eval-8"]
    assert plots.system_labels(["same", "same"]) == ["same", "same"]
