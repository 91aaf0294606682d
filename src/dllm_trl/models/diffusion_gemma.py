"""DiffusionGemma as a model: :func:`is_diffusion_gemma`, and LoRA on it, whose encoder and decoder share their weights.

``DiffusionGemmaForBlockDiffusion`` ties each encoder layer's weights to the same decoder layer's (one ``Parameter``,
two modules). PEFT adapts modules, not parameters, so ``target_modules`` that match both get two independent adapters
on one shared weight: the adapted encoder and decoder drift apart as they train (rollouts and the training forward
still agree with each other), and ``merge_and_unload`` adds both deltas to the one shared weight — the merged model is
neither of them.

* :func:`tie_encoder_adapters`: right after ``get_peft_model``, each encoder adapter becomes its decoder twin's (the
  same ``lora_A`` / ``lora_B`` modules), so the adapted model keeps DiffusionGemma's tying: one adapter per weight,
  trained by the gradients of both paths.
* :func:`merge_tied_adapters`: merges such a model into plain weights, each delta once.
"""

from __future__ import annotations

import re

from torch import nn

from .engines import unwrap_model, unwrap_peft

DIFFUSION_GEMMA_LORA_TARGETS = r".*(language_model|decoder)\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"
"""PEFT ``target_modules`` (a regex) for LoRA on DiffusionGemma's text attention: the same projections in the encoder
and the decoder stack (tied by :func:`tie_encoder_adapters`), none in the vision tower (whose projections wrap their
``nn.Linear`` in a clipping module PEFT cannot adapt)."""



def is_diffusion_gemma(model) -> bool:
    """Whether ``model`` (through any engine wrapper) is transformers' ``DiffusionGemmaForBlockDiffusion``."""
    return getattr(getattr(unwrap_model(model), "config", None), "model_type", None) == "diffusion_gemma"


_ENCODER_LAYER = re.compile(r"^(.*)\.encoder\.language_model\.layers\.(\d+)\.(.+)$")


def _lora_pairs(model: nn.Module):
    """``(encoder module name, encoder module, decoder module)`` for every adapted encoder module whose decoder twin
    (same layer, same path) is adapted too."""
    modules = dict(model.named_modules())
    for name, module in modules.items():
        match = _ENCODER_LAYER.match(name)
        if match is None or not hasattr(module, "lora_A"):
            continue
        twin = modules.get(f"{match.group(1)}.decoder.layers.{match.group(2)}.{match.group(3)}")
        if twin is not None and hasattr(twin, "lora_A"):
            yield name, module, twin


def tie_encoder_adapters(model: nn.Module) -> int:
    """Make every LoRA adapter of an encoder layer the very adapter of its decoder twin (``model``: a PEFT-wrapped
    DiffusionGemma). Returns the number of modules tied; raises when an adapted encoder module has no adapted twin
    (its adapter would change only the encoder, untying the model)."""
    pairs = list(_lora_pairs(model))
    modules = dict(model.named_modules())
    lonely = [name for name, module in modules.items()
              if _ENCODER_LAYER.match(name) and hasattr(module, "lora_A") and name not in {p[0] for p in pairs}]
    if lonely:
        raise ValueError(f"{lonely[0]} is adapted but its decoder twin is not: target the same modules in the "
                         "encoder and the decoder (e.g. target_modules=r'.*(language_model|decoder)\\.layers\\..*"
                         "\\.(q|k|v|o)_proj'), or none of the encoder's.")
    for _, encoder, decoder in pairs:
        encoder.lora_A, encoder.lora_B = decoder.lora_A, decoder.lora_B
        encoder.lora_dropout = decoder.lora_dropout
    return len(pairs)


def merge_tied_adapters(model: nn.Module) -> nn.Module:
    """A PEFT-wrapped DiffusionGemma whose encoder adapters are tied to the decoder's (:func:`tie_encoder_adapters`),
    merged into plain weights: the encoder's adapter layers are dropped (their twin's delta is the same), then the
    decoder's are merged, so each shared weight receives its delta once. Returns the transformers model."""
    pairs = list(_lora_pairs(model))
    for name, encoder, decoder in pairs:
        if encoder.lora_A is not decoder.lora_A:
            raise ValueError(f"{name}'s adapter is not its decoder twin's: tie them (tie_encoder_adapters) before "
                             "training, or merge with PEFT's merge_and_unload (which adds both deltas).")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, encoder.get_base_layer())
    return unwrap_peft(model.merge_and_unload())
