"""LoRA (algorithm.md §9, D44; an extension, not in the paper): the policy trained through low-rank adapters (peft),
the KL reference as the same model with its adapters off, and what a generator or an export takes from it: the
adapters' tensors in peft's file layout, or the merged weights in the base model's.

    W' = W + (alpha / r) · B · A      A: (r, d_in) uniform in ±1/sqrt(d_in) (peft's kaiming init), B: (d_out, r) zero

so the adapted model starts equal to the base model, and only A and B are trained (the optimiser holds nothing else).
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from harness.cli import UserError

ALL_LINEAR = "all-linear"                 # peft's name for every linear layer but the output head
BASE_PREFIX = "base_model.model."         # what peft puts before the base model's parameter names
ADAPTER = "default"                       # the one adapter's name inside peft's layers


@dataclass(frozen=True)
class LoraSettings:
    """--lora_rank, --lora_alpha, --lora_dropout, --lora_target_modules (harness/settings.py:lora_settings)."""
    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def is_lora(lm) -> bool:
    """Whether `lm` (a Policy's lm) carries peft adapters."""
    return hasattr(lm, "peft_config")


def linear_layers(lm) -> dict[str, torch.nn.Module]:
    """{module name: module} of lm's linear layers (torch's Linear and its subclasses)."""
    return {name: m for name, m in lm.named_modules() if isinstance(m, torch.nn.Linear)}


def check_targets(lm, targets: Iterable[str]) -> None:
    """Every target names (as peft matches: the whole module name, or its last dotted parts) a linear layer of lm
    that is not the output head or an embedding, else a UserError naming the target and the layers there are."""
    targets = list(targets)
    if not targets:
        raise UserError(f"--lora_target_modules is empty: name the layers to adapt, or [{ALL_LINEAR}]")
    conv1d = sorted({name.rsplit(".", 1)[-1] for name, m in lm.named_modules() if type(m).__name__ == "Conv1D"})
    if conv1d:                                   # GPT-2's transposed layers: merged_weights assumes nn.Linear
        raise UserError(f"--lora_rank: {type(lm).__name__} computes with transformers' Conv1D layers "
                        f"({', '.join(conv1d)}), whose LoRA weights are transposed (fan_in_fan_out); LoRA here takes "
                        "models of nn.Linear layers")
    linear = linear_layers(lm)
    head = lm.get_output_embeddings()
    kinds = sorted({name.rsplit(".", 1)[-1] for name, m in linear.items() if m is not head})
    for target in targets:
        if target == ALL_LINEAR:
            if len(targets) > 1:
                raise UserError(f"--lora_target_modules {targets}: {ALL_LINEAR} already names every linear layer")
            continue
        hits = [m for name, m in lm.named_modules() if name == target or name.endswith("." + target)]
        if not hits:
            raise UserError(f"--lora_target_modules: the model ({type(lm).__name__}) has no module {target!r}; its "
                            f"linear layers are {', '.join(kinds)} (or give [{ALL_LINEAR}])")
        if any(m is head or isinstance(m, torch.nn.Embedding) for m in hits):
            raise UserError(f"--lora_target_modules {target!r} is the LM head or an embedding: the trainer computes "
                            "the head from its weight (loss.logprobs_and_entropy, chunked), so an adapter there would "
                            "be bypassed; adapt the attention and MLP layers")
        if not all(isinstance(m, torch.nn.Linear) for m in hits):
            raise UserError(f"--lora_target_modules {target!r} is not a linear layer ({type(hits[0]).__name__}); "
                            f"the linear layers are {', '.join(kinds)}")


def add_adapters(lm, lora: LoraSettings, seed: int = 0):
    """lm wrapped by peft with adapters on the target layers, its own weights frozen. A is drawn from a generator
    seeded with `seed` (the same on every rank and process count), B is zero: the adapted model starts equal to lm.
    On the meta device (a sharded policy's skeleton) nothing is drawn: rank 0's values are broadcast later."""
    import peft
    check_targets(lm, lora.target_modules)
    targets = ALL_LINEAR if lora.target_modules == (ALL_LINEAR,) else list(lora.target_modules)
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                             bias="none", task_type="CAUSAL_LM")
    with _quiet():
        model = peft.get_peft_model(lm, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():                        # A anew from `seed` (peft drew it from the global RNG); B is peft's 0
        for name, module in model.named_modules():
            if name.endswith(f"lora_A.{ADAPTER}") and module.weight.device.type != "meta":
                bound = 1 / math.sqrt(module.weight.shape[1])
                module.weight.copy_(torch.empty(module.weight.shape).uniform_(-bound, bound, generator=generator))
    return model


@contextlib.contextmanager
def _quiet():
    """peft 0.21 reads transformers' deprecated is_gradient_checkpointing (a FutureWarning on every wrap)."""
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


class AdaptersOff:
    """The KL reference of a LoRA run: the policy itself with its adapters switched off for the call, i.e. the base
    model RL started from, with no second copy in memory. Called like a Policy: (input_ids, attention_mask, mask,
    temperature) -> (logp, entropy)."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, *args, **kwargs):
        lm = self.policy.module.lm if hasattr(self.policy, "module") else self.policy.lm
        with lm.disable_adapter():
            return self.policy(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# Streams of (name, full tensor) with peft's names (full_named_parameters of a LoRA policy), turned into what is sent


def base_name(name: str) -> str:
    """A peft model's parameter name as the base model names it (its LoRA layers included)."""
    return name.removeprefix(BASE_PREFIX)


def adapter_weights(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapters' tensors, named as in the base model with its LoRA layers (`...q_proj.lora_A.default.weight`)."""
    for name, tensor in named:
        if ".lora_A." in name or ".lora_B." in name:
            yield base_name(name), tensor


def merged_weights(named: Iterable[tuple[str, torch.Tensor]], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """The merged model, in the base model's own names (`...q_proj.weight`): W + scaling · B · A for every adapted
    layer (computed in float32, returned in W's dtype), every other parameter as it is. One adapted layer is held at
    a time (its W, A and B arrive one after another)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        name = base_name(name)
        if name.endswith(".base_layer.bias"):
            yield name.replace(".base_layer.bias", ".bias"), tensor
            continue
        part = next((p for p in ("base_layer.weight", f"lora_A.{ADAPTER}.weight", f"lora_B.{ADAPTER}.weight")
                     if name.endswith("." + p)), None)
        if part is None:
            yield name, tensor
            continue
        layer = name[:-len(part) - 1]
        parts = pending.setdefault(layer, {})
        parts[part.split(".")[0]] = tensor
        if len(parts) == 3:
            weight = parts["base_layer"]
            delta = scaling * (parts["lora_B"].float() @ parts["lora_A"].float())
            yield f"{layer}.weight", (weight.float() + delta).to(weight.dtype)
            del pending[layer]
    if pending:
        raise ValueError(f"LoRA layers without their base weight or both adapters: {sorted(pending)[:3]}")


def peft_file_name(name: str) -> str:
    """An adapter tensor's name in peft's adapter_model.safetensors (what peft and vLLM read): the base model's name
    with peft's prefix and without the adapter's name."""
    return BASE_PREFIX + base_name(name).replace(f".{ADAPTER}.", ".")


def write_adapter(directory: Path, tensors: Iterable[tuple[str, torch.Tensor]], peft_config) -> int:
    """peft's adapter files in `directory`: adapter_model.safetensors (the adapters' tensors in peft's names) and
    adapter_config.json (`peft_config`, a LoraConfig whose target modules peft has resolved), each written to a
    temporary file and renamed. Returns the bytes of tensors written."""
    from safetensors.torch import save_file
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {peft_file_name(name): t.detach().to("cpu").contiguous() for name, t in tensors}
    tmp = directory / f".adapter_model.{os.getpid()}.safetensors"
    save_file(state, str(tmp))
    os.replace(tmp, directory / "adapter_model.safetensors")
    staging = directory / f".config.{os.getpid()}"
    peft_config.save_pretrained(str(staging))
    os.replace(staging / "adapter_config.json", directory / "adapter_config.json")
    staging.rmdir()
    return sum(t.numel() * t.element_size() for t in state.values())
