"""
Model shapes without weights: the config of any model spec the project loads (a local folder,
"smollm2", random:NAME, a LoRA checkpoint, a hub name), read with no weight and, for KNOWN_SHAPES,
no download. The memory plan (lab/plan.py) and eval's KV-pool sizing (lab/pools.py) read it.

Tests: python -m pytest -q tests/test_models.py -k config
"""
from pathlib import Path

from persuarena import models
from lab import gguf, lora

KNOWN_SHAPES = {  # models whose shapes (and context) a memory plan knows with no download
    "smollm2": ("smollm2-135m", 8192), "Qwen/Qwen3-4B-Instruct-2507": ("qwen3-4b", 262144),
    "Qwen/Qwen3-14B": ("qwen3-14b", 40960)}


def model_config(name):
    """A model's config, no weight read: random:NAME's shape, a local folder's config.json (the
    converted smollm2 cache), a hub model's cached config, the KNOWN_SHAPES (so that the
    paper's plan needs no download), else the hub's config.json."""
    from transformers import AutoConfig
    if name.startswith("random:"):
        return models.random_config(name.split(":", 1)[1].partition("@")[0])
    if lora.is_adapter(name):
        return model_config(lora.adapter_base(name))
    path = gguf.smollm2_folder() if name == "smollm2" else Path(name).expanduser()
    if (path / "config.json").is_file():
        return AutoConfig.from_pretrained(path)
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        pass
    if name in KNOWN_SHAPES:
        shape, context = KNOWN_SHAPES[name]
        return models.random_config(shape, max_position_embeddings=context)
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise SystemExit(f"lab/shapes.py: no config for '{name}' ({str(e).splitlines()[0][:100]}); "
                         "pass a local model folder, random:NAME or a reachable hub name") from None
