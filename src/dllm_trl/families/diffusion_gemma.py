"""DiffusionGemma (SPEC §8): uniform-noise block diffusion (no mask token), transformers' own
``DiffusionGemmaForBlockDiffusion`` loaded unchanged. Canvases of ``config.canvas_length`` tokens decoded by
:class:`~dllm_trl.generation.DiffusionGemmaSampler` with the per-step record, trained by
:class:`~dllm_trl.losses.DiffusionGemmaRLDFLoss` / :class:`~dllm_trl.losses.DiffusionGemmaTrustRegionLoss`; LoRA on
the text attention of the encoder and decoder stacks, tied (:mod:`dllm_trl.models.diffusion_gemma`)."""

from __future__ import annotations

import dataclasses

import torch
from transformers import DiffusionGemmaForBlockDiffusion

from ..models.diffusion_gemma import (
    DIFFUSION_GEMMA_LORA_TARGETS,
    is_diffusion_gemma,
    merge_tied_adapters,
    tie_encoder_adapters,
)
from ..models.engines import model_config, unwrap_model
from ..models.engines import vocab_size as model_vocab_size
from .base import ModelFamily, is_model_type, register_family
from .masked import check_top_k, mark_family

GENERATION_CONFIG_FIELDS = ("max_denoising_steps", "entropy_bound", "t_min", "t_max", "stability_threshold",
                            "confidence_threshold")
"""Sampler settings read from the model's ``generation_config`` when it has them (what ``model.generate`` uses)."""


@register_family
class DiffusionGemmaFamily(ModelFamily):
    """DiffusionGemma checkpoints and models (``model_type: "diffusion_gemma"``)."""

    name = "diffusion_gemma"
    kind = "diffusion"
    lora_target_modules = DIFFUSION_GEMMA_LORA_TARGETS
    greedy_decoding = False

    def matches_checkpoint(self, raw_config: dict) -> bool:
        return is_model_type(raw_config, "diffusion_gemma") or is_model_type(raw_config, "diffusiongemma")

    def matches_model(self, model) -> bool:
        return is_diffusion_gemma(model)

    def load(self, name_or_path, raw_config, *, mask_token_id=None, logit_shift=None, sampling=None, block_size=None,
             **from_pretrained_kwargs):
        given = {name: value for name, value in (("mask_token_id", mask_token_id), ("logit_shift", logit_shift),
                                                 ("sampling", sampling), ("block_size", block_size)) if value is not None}
        if given:
            raise ValueError(
                f"{', '.join(f'{k}={v!r}' for k, v in given.items())}: masked-diffusion properties, and DiffusionGemma is "
                "uniform-noise diffusion (no mask token; its canvas length is config.canvas_length). Load it without "
                "them: load_diffusion_model(path)."
            )
        return mark_family(DiffusionGemmaForBlockDiffusion.from_pretrained(name_or_path, **from_pretrained_kwargs),
                           self)

    # ------------------------------------------------------------------------------------------ model set-up
    def prepare_model(self, model) -> None:
        """Freeze the encoder's multimodal parts (vision tower, its projection): a text rollout never reaches them, so
        they get no gradient, and DDP's reducer would wait for one (with ``find_unused_parameters=False``, TRL's default
        with gradient checkpointing, the next step fails). Attention needs nothing: transformers' class already
        attends as DiffusionGemma decodes."""
        encoder = unwrap_model(model).model.encoder
        for name, param in encoder.named_parameters():
            if not name.startswith("language_model."):
                param.requires_grad_(False)

    def check_peft_config(self, peft_config) -> None:
        """PEFT's task wrappers (``task_type="CAUSAL_LM"``, TRL's ``get_peft_config`` default) assume a causal LM's
        generation API, which ``DiffusionGemmaForBlockDiffusion`` does not have: refused with the fix."""
        task_type = getattr(peft_config, "task_type", None)
        if task_type is not None:
            raise ValueError(f"peft_config.task_type={str(task_type)!r}: PEFT wraps such a model as a causal LM "
                             "(PeftModelForCausalLM needs prepare_inputs_for_generation), which DiffusionGemma is not; "
                             "set task_type=None (--lora_task_type is TRL's flag for it; the example script does so).")

    def prepare_wrapped_model(self, model) -> None:
        """With ``peft_config``, TRL adds the LoRA adapters inside the trainer: tie each encoder adapter to its decoder
        twin (:func:`~dllm_trl.models.tie_encoder_adapters`), as a user who wraps the model first must, so that the
        shared weights keep one adapter each (refused, with the fix, when only the encoder's modules are targeted)."""
        tie_encoder_adapters(model)

    def load_adapter(self, base, path, merge=True):
        """Encoder adapters tied to their decoder twins first, so that each shared weight gets its delta once (PEFT's
        own merge would add both)."""
        from peft import PeftModel

        model = PeftModel.from_pretrained(base, path)
        for name, param in model.named_parameters():  # saved from a tied model: encoder adapter = decoder adapter
            twin = name.replace(".encoder.language_model.layers.", ".decoder.layers.")
            if "lora_" in name and twin != name and not torch.equal(param, model.get_parameter(twin)):
                raise ValueError(f"{path}: the adapter of {name} differs from its decoder twin's (trained untied); "
                                 "tying would drop it: load it with PEFT's PeftModel.from_pretrained instead.")
        if tie_encoder_adapters(model):
            return merge_tied_adapters(model) if merge else model
        return model.merge_and_unload() if merge else model

    def block_length(self, model, max_completion_length: int) -> int:
        return int(model_config(model).canvas_length)

    def sampler_config(self, model, **overrides):
        """``model.generate``'s settings (its ``generation_config``'s, where it sets them), with ``overrides``."""
        from ..generation import DiffusionGemmaSamplerConfig

        generation = getattr(unwrap_model(model), "generation_config", None)
        names = {f.name for f in dataclasses.fields(DiffusionGemmaSamplerConfig)}
        settings = {name: getattr(generation, name) for name in GENERATION_CONFIG_FIELDS
                    if name in names and getattr(generation, name, None) is not None}
        return DiffusionGemmaSamplerConfig(**{**settings, **overrides})

    def sampler_for(self, config):
        from ..generation import DiffusionGemmaSampler

        return DiffusionGemmaSampler(config)

    def sampler(self, args, model, block_length: int):
        return self.sampler_for(self.sampler_config(model, gen_length=args.max_completion_length))

    def rldf_loss(self, args, model):
        from ..losses import DiffusionGemmaRLDFLoss

        return DiffusionGemmaRLDFLoss(args)

    def trust_region_loss(self, args, model):
        from ..losses import DiffusionGemmaTrustRegionLoss

        vocab = model_vocab_size(model)
        check_top_k(args, vocab)
        return DiffusionGemmaTrustRegionLoss(args, vocab)

    def length_unit(self, model, config) -> int:
        return int(model_config(model).canvas_length)

