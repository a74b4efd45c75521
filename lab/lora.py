"""
LoRA (train.py --lora): rank-r adapters on the attention and MLP projections of a frozen base,
with the peft package (the format peft, TRL and vLLM load). The update is W + (alpha / r) B A,
alpha = LORA_ALPHA_PER_RANK r, B = 0 at the start. The base in --dtype doubles as the KL reference
with the adapter off (AdapterOff); the rollout engine's copy takes the merged weights in place
after each step (refresh_from_lora). A folder holding ADAPTER_CONFIG is a checkpoint:
models.load_model loads it as its base with the adapter merged in (merge_adapter); train.py
--resume restores its adapters under their names in the model (saved_names) with the optimizer.

An adapter folder is checked before any weight loads (adapter_problem, with the base's config,
which lab/cli.py's model_problem finds along the chain of bases): adapter_config.json parses and
names a LoRA adapter of rank r >= 1 and a scale alpha / r (alpha / sqrt r under rsLoRA) within
ADAPTER_SCALE_RANGE; adapter_model.safetensors holds at least one A, B pair, every weight an A
[r, d_in] or B [d_out, r] of a LORA_TARGETS projection of one of the base's layers, all finite.

Tests: python -m pytest -q tests/test_models.py -k lora; tests/test_adversarial.py -k adapter
"""
import json
import math
import re
from pathlib import Path

import torch

from lab import jsonl

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # attention and MLP
LORA_ALPHA_PER_RANK = 2  # alpha = 2 r: the adapter's update B A is scaled by alpha / r = 2
LORA_SEED = 0  # A's initialisation (B starts at 0), the same on every rank
ADAPTER_CONFIG = "adapter_config.json"  # what makes a folder a LoRA checkpoint (peft's file)
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # its weights (peft's file)
ADAPTER_SCALE_RANGE = (1e-3, 1e2)  # alpha / r an adapter folder may carry (attach_lora's: 2);
# below, the adapter is its base in all but name; above, it swamps the base's weights
_SHAPE_FIELDS = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
_ADAPTER_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight")


def attach_lora(model, rank, base_name, seed=None):
    """model (frozen, in its dtype) as a peft model with rank-r adapters in fp32 on every
    LORA_TARGETS projection: B = 0, so it starts as the base; A drawn from `seed`, so every rank
    starts with the same adapters. base_name (the model spec it was loaded from) is recorded in
    the adapter's config, so that a checkpoint names its base."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=rank, lora_alpha=LORA_ALPHA_PER_RANK * rank, lora_dropout=0.0,
                        target_modules=list(LORA_TARGETS), bias="none", task_type="CAUSAL_LM")
    model.requires_grad_(False)
    model.enable_input_require_grads()  # gradient checkpointing's recomputed layers need it
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(LORA_SEED if seed is None else seed)
        lora = get_peft_model(model, config)
    for p in lora.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # adapters (and so AdamW's moments) in fp32
    lora.peft_config["default"].base_model_name_or_path = base_name
    return lora


def lora_parameters(lora):
    """The adapter's parameters: what the optimizer steps and data parallel averages."""
    return [p for p in lora.parameters() if p.requires_grad]


@torch.no_grad()
def merged_lora_weights(lora):
    """(name in the plain model, W + (alpha / r) B A in W's dtype) for every adapted projection,
    one at a time, summed in fp32 as peft's merge does: the weights the rollout copy takes after
    a step (the others never change). One module's merge is alive at a time (lab/plan.py counts
    the largest), never the whole merged model."""
    from peft.tuners.lora import LoraLayer
    for name, module in lora.base_model.model.named_modules():
        if isinstance(module, LoraLayer):
            weight = module.get_base_layer().weight
            delta = sum(module.get_delta_weight(a).float() for a in module.active_adapters)
            yield f"{name}.weight", (weight.float() + delta).to(weight.dtype)


@torch.no_grad()
def refresh_from_lora(lora, rollout_model):
    """Write the merged weights into the rollout copy in place, module by module (its parameters
    are the actor engine's own tensors, as train.copy_weights writes them); the caller then
    refreshes the engine."""
    target = dict(rollout_model.named_parameters())
    for name, weight in merged_lora_weights(lora):
        target[name].copy_(weight)


def saved_names(lora):
    """{an adapter weight's name in peft's file (no adapter name): its name in the model} for
    every trained parameter: what checkpoints.load_checkpoint restores a LoRA run's adapters under."""
    adapter = lora.active_adapter
    return {name.replace(f".{adapter}.", ".", 1): name
            for name, p in lora.named_parameters() if p.requires_grad}


def average_lora_gradients(lora, world):
    """Data parallel under torchrun: the adapters are replicated (every rank starts from the same
    seed and takes the same steps), and each adapter gradient is averaged over the ranks as the
    backward pass accumulates it (every rank runs the same micro-batches), as FSDP averages a
    full model's."""
    if world == 1:
        return lora
    import torch.distributed as dist

    def average(p):
        dist.all_reduce(p.grad)
        p.grad.div_(world)
    for p in lora_parameters(lora):
        p.register_post_accumulate_grad_hook(average)
    return lora


def is_adapter(name_or_path):
    return (Path(name_or_path).expanduser() / ADAPTER_CONFIG).is_file()


def _one_line(error):
    return f"{type(error).__name__}: {' '.join(str(error).split())[:80]}"


def read_adapter_config(folder):
    """(adapter_config.json as a dict, None), or (None, what is wrong with it): it parses, is a
    LoRA adapter's, with an integer rank r >= 1 and a finite lora_alpha whose scale (alpha / r,
    alpha / sqrt r under rsLoRA) lies in ADAPTER_SCALE_RANGE."""
    path = Path(folder).expanduser() / ADAPTER_CONFIG
    try:
        record = jsonl.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"{ADAPTER_CONFIG} cannot be read ({_one_line(e)})"
    if not isinstance(record, dict):
        return None, f"{ADAPTER_CONFIG} is not a JSON object"
    if record.get("peft_type", "LORA") != "LORA":
        return None, f"{ADAPTER_CONFIG} is a {json.dumps(record.get('peft_type'))} adapter, not LoRA"
    r, alpha = record.get("r"), record.get("lora_alpha")
    if type(r) is not int or r < 1:
        return None, f"{ADAPTER_CONFIG} holds \"r\": {json.dumps(r)}, not a rank >= 1"
    if type(alpha) not in (int, float) or not math.isfinite(alpha):
        return None, f"{ADAPTER_CONFIG} holds \"lora_alpha\": {json.dumps(alpha)}, not a finite number"
    scale = alpha / (math.sqrt(r) if record.get("use_rslora") else r)
    low, high = ADAPTER_SCALE_RANGE
    if not low <= scale <= high:
        return None, (f"{ADAPTER_CONFIG} scales the adapter by {scale:g} (lora_alpha {alpha:g}, r "
                      f"{r}), outside [{low:g}, {high:g}]")
    return record, None


def projection_shapes(config):
    """{projection: (d_in, d_out)} of each LORA_TARGETS projection of a decoder layer, from its
    config (no weight read)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inner = config.intermediate_size
    return dict(q_proj=(hidden, heads * head_dim), k_proj=(hidden, kv_heads * head_dim),
                v_proj=(hidden, kv_heads * head_dim), o_proj=(heads * head_dim, hidden),
                gate_proj=(hidden, inner), up_proj=(hidden, inner), down_proj=(inner, hidden))


def adapter_weight_problem(name, shape, config, rank):
    """What is wrong with an adapter weight's name and shape for the base's config, or None: an
    A [rank, d_in] or B [d_out, rank] of a LORA_TARGETS projection of one of its layers (rank
    None: any, as under peft's per-module rank_pattern)."""
    match = _ADAPTER_KEY.fullmatch(name)
    shapes = projection_shapes(config)
    if not match or match[2] not in shapes:
        return f"holds {name}, which is no LoRA A or B of a {'/'.join(LORA_TARGETS)} projection"
    if int(match[1]) >= config.num_hidden_layers:
        return f"holds {name}, but the base has {config.num_hidden_layers} layers"
    d_in, d_out = shapes[match[2]]
    r = "r" if rank is None else rank
    want = [r, d_in] if match[3] == "A" else [d_out, r]
    if len(shape) == 2 and all(w == "r" or w == n for w, n in zip(want, shape)):
        return None
    return f"holds {name} of shape {shape}, where the base's config gives [{want[0]}, {want[1]}]"


def adapter_problem(folder, record, config):
    """(what is wrong with an adapter folder's weights, or None; a warning, or None): see the
    module's docstring. record: its config (read_adapter_config); config: its base's config
    (None, for a hub base not in this machine's cache: the shapes go unchecked). Reads the
    adapter's weights (small), never the base's. An adapter whose every B is 0 changes nothing:
    warned, as a run with it still means something (it is its base)."""
    from safetensors import SafetensorError, safe_open
    path = Path(folder).expanduser() / ADAPTER_WEIGHTS
    try:
        with safe_open(str(path), "pt") as weights:
            tensors = {name: weights.get_tensor(name) for name in weights.keys()}
    except (OSError, SafetensorError, ValueError) as e:
        return f"{ADAPTER_WEIGHTS} cannot be read ({_one_line(e)})", None
    kinds = {_ADAPTER_KEY.fullmatch(name)[3] for name in tensors if _ADAPTER_KEY.fullmatch(name)}
    if kinds != {"A", "B"}:
        return f"{ADAPTER_WEIGHTS} holds no LoRA A and B weights: the adapter is empty", None
    rank = None if record.get("rank_pattern") else record["r"]
    if not all(hasattr(config, k) for k in _SHAPE_FIELDS):
        config = None  # no decoder this project runs (models.check_supported refuses it at load)
    for name, tensor in sorted(tensors.items()):
        if config is not None and (problem := adapter_weight_problem(name, list(tensor.shape),
                                                                     config, rank)):
            return f"{ADAPTER_WEIGHTS} {problem}", None
        if not torch.isfinite(tensor).all():
            return f"{ADAPTER_WEIGHTS} holds non-finite values in {name}", None
    if not any(t.any() for name, t in tensors.items() if name.endswith("lora_B.weight")):
        return None, f"{ADAPTER_WEIGHTS} changes nothing (every B is 0): it runs as its base"
    return None, None


def adapter_base(folder):
    """The model spec a LoRA checkpoint's adapter was trained on (attach_lora's base_name)."""
    from peft import PeftConfig
    return PeftConfig.from_pretrained(str(Path(folder).expanduser())).base_model_name_or_path


def merge_adapter(base, folder):
    """The base model (loaded from adapter_base(folder)) with the checkpoint's adapter merged in: a
    LoRA checkpoint as the plain model the engine runs (peft's PeftModel.from_pretrained,
    merge_and_unload). models.load_model loads a checkpoint folder this way."""
    from peft import PeftModel
    lora = PeftModel.from_pretrained(base, str(Path(folder).expanduser()))
    return lora.merge_and_unload().eval()


class AdapterOff:
    """The frozen base of a LoRA model, its adapter disabled and in eval mode: the KL reference,
    no second copy.
    Called as the model is; parameters() as the model's (where its forwards run)."""

    def __init__(self, lora):
        self.lora = lora

    def parameters(self):
        return self.lora.parameters()

    def get_output_embeddings(self):  # steps.row_logits hooks it
        return self.lora.get_output_embeddings()

    def __call__(self, *args, **kwargs):
        """The base's forward in eval mode (no checkpointing, its cache returned: a frozen
        reference has nothing to recompute), the model's mode restored after."""
        training = self.lora.training
        self.lora.eval()
        try:
            with self.lora.disable_adapter():
                return self.lora(*args, **kwargs)
        finally:
            self.lora.train(training)
