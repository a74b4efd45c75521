"""persuarena: PersuArena + Probe-RPO, the package name the project installs its method under.

The repository root is the package (pyproject.toml maps `persuarena` to it): the method's files
stay where a reader opens them (arena.py, probes.py, rollout.py, rpo.py, train.py, eval.py, the
engine, layers, models) and import one another as `from persuarena import arena`, so installing
the project puts no module named train, eval or models on anyone's import path (DECISIONS.md:
One package name). `lab` is the package of everything around the method.

It is also verifiers' environment `persuarena` (`eval persuarena ...`): verifiers imports the
package of that id and takes the Taskset and Env it exports (lab/verifiers_env.py), loaded only
when asked for, so `import persuarena.train` loads no verifiers.
"""

__all__ = ["PersuArenaTaskset", "PersuArenaEnv"]


def __getattr__(name):
    if name in __all__:
        from lab import verifiers_env
        return getattr(verifiers_env, name)
    raise AttributeError(f"module 'persuarena' has no attribute {name!r}")
