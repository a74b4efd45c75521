"""lab: everything around the method. The method is the package `persuarena` (the repository
root's arena, probes, rollout, rpo, train, eval and the engine they run on, imported as
`from persuarena import rpo`); this package holds run folders, served models, the
Gymnasium/OpenEnv/verifiers/TRL exports, the memory plan, sweeps, benchmarks, analyses, plots,
significance, records, move labels, and the engine's fast path (fastpath.py). Its scripts run as
`python -m lab.NAME`, from any folder once installed (pip install -r requirements.txt).
Importing it changes nothing of the import path (DECISIONS.md: One package name)."""
