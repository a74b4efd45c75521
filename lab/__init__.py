"""lab: everything around the method. The top level holds the paper (arena, probes, rollout, rpo,
train, eval and the engine they run on); this package holds run folders, served models, the
Gymnasium/OpenEnv export, the memory plan, sweeps, benchmarks, analyses, plots, significance,
records, move labels, and the engine's fast path (fastpath.py). Its scripts run as
`python -m lab.NAME`, from any folder once installed (pip install -r requirements.txt)."""
import os as _os
import sys as _sys

# The repository root first on the import path: `python -m lab.NAME` run elsewhere (PYTHONPATH
# naming the root) imports the project's train, eval, rpo..., never a same-named file of the
# current folder (which `-m` puts first).
_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_sys.path[:] = [_ROOT] + [p for p in _sys.path if _os.path.abspath(p or ".") != _ROOT]
