"""
LoRA (train.py --lora): rank-r adapters on the attention and MLP projections of a frozen base,
with the peft package (the format peft, TRL and vLLM load). The update is W + (alpha / r) B A,
alpha = LORA_ALPHA_PER_RANK r, B = 0 at the start. The base in --dtype doubles as the KL reference
with the adapter off (AdapterOff); the rollout engine's copy takes the merged weights in place
after each step (refresh_from_lora). A folder holding ADAPTER_CONFIG is a checkpoint:
models.load_model loads it as its base with the adapter merged in (merge_adapter); train.py
--resume restores its adapters under their names in the model (saved_names) with the optimizer.

Tests: python -m pytest -q tests/test_models.py -k lora
"""
from pathlib import Path

import torch

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # attention and MLP
LORA_ALPHA_PER_RANK = 2  # alpha = 2 r: the adapter's update B A is scaled by alpha / r = 2
LORA_SEED = 0  # A's initialisation (B starts at 0), the same on every rank
ADAPTER_CONFIG = "adapter_config.json"  # what makes a folder a LoRA checkpoint (peft's file)


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
    every trained parameter: what runs.load_checkpoint restores a LoRA run's adapters under."""
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

    def get_output_embeddings(self):  # rpo.row_logits hooks it
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
