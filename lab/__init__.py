"""lab: everything around the method. The top level holds the paper (arena, probes, rollout, rpo,
train, eval and the engine they run on); this package holds run folders, served models, the
Gymnasium/OpenEnv export, the memory plan, sweeps, benchmarks, analyses, plots, significance,
records, move labels, and the engine's fast path (fastpath.py). Its scripts run from the
repository root as `python -m lab.NAME`."""
