"""A script's model in and out: the diffusion LM (and its tokenizer) that TRL's ``ModelConfig`` flags name, loaded for
training or for decoding, and the trained model saved (and pushed) after ``train()`` as TRL's scripts do."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from accelerate import PartialState
from transformers import AutoTokenizer
from transformers.utils import cached_file

from ..models.loading import is_hub_name
from .loading import load_adapter, load_diffusion_model

if TYPE_CHECKING:
    from trl import ModelConfig


def model_init_kwargs(model_args: ModelConfig, device: str | int | None = None) -> dict:
    """``from_pretrained`` keyword arguments that ``--dtype``, ``--attn_implementation``, ``--model_revision`` and
    ``--load_in_4bit`` / ``--load_in_8bit`` (bitsandbytes, placed on ``device`` or on this process's device) ask for."""
    quantization_config = None
    if model_args.load_in_4bit or model_args.load_in_8bit:
        from trl import get_quantization_config  # imports PEFT and bitsandbytes: only when quantising

        quantization_config = get_quantization_config(model_args)
    placement = device if device is not None else PartialState().local_process_index
    if not torch.accelerator.is_available():
        placement = "cpu"
    kwargs = dict(revision=model_args.model_revision, dtype=model_args.dtype,
                  attn_implementation=model_args.attn_implementation)
    if quantization_config is not None:
        # A quantised model cannot be moved after loading: place it now.
        kwargs.update(quantization_config=quantization_config, device_map={"": placement})
    return kwargs


def check_trainable(model_args: ModelConfig) -> None:
    """Quantised weights cannot be trained: 4-/8-bit loading is QLoRA, i.e. a LoRA adapter on top (``--use_peft``)."""
    if (model_args.load_in_4bit or model_args.load_in_8bit) and not model_args.use_peft:
        flag = "--load_in_4bit" if model_args.load_in_4bit else "--load_in_8bit"
        raise ValueError(f"{flag} quantises the base weights, which cannot be trained: add --use_peft (QLoRA).")


def load_model_and_tokenizer(model_args: ModelConfig, device: str | None = None):
    """The diffusion LM named by ``--model_name_or_path`` (required: a script that has a default model names it) and
    its tokenizer, loaded as :func:`model_init_kwargs` says.

    A LoRA adapter folder loads on top of its base model (merged unless quantised). With ``device`` the model is
    moved there and put in eval mode, ready for decoding; without, it is ready for training.
    """
    if device is None:
        check_trainable(model_args)
    path = model_args.model_name_or_path
    if not path:
        raise ValueError("model_name_or_path is not set: name the checkpoint to load (--model_name_or_path, a Hub id "
                         "or a folder; the shipped toy is dllm_trl.toy.toy_assets_dir()).")
    load_kwargs = model_init_kwargs(model_args, device)
    quantized = "quantization_config" in load_kwargs
    base = adapter_base_model(path, revision=model_args.model_revision)
    if base is None:
        model = load_diffusion_model(path, **load_kwargs)
    else:
        model = load_adapter(load_diffusion_model(base, **load_kwargs), path, merge=not quantized)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision, padding_side="left")
    except OSError:
        if base is None:
            raise
        # An adapter saved without a tokenizer, or one whose tokenizer transformers cannot resolve without the model's
        # config.json (which an adapter has not; offline, the Hub cache cannot tell it is absent): the base model's.
        tokenizer = AutoTokenizer.from_pretrained(base, padding_side="left")
    if device is None:
        return model, tokenizer
    if not quantized:
        model = model.to(device)
    return model.eval(), tokenizer


def adapter_base_model(path: str, **hub) -> str | None:
    """The base model that the PEFT adapter ``path`` (a folder or a Hub name; ``hub``: ``revision`` / ``token`` /
    ``cache_dir``) was trained on; ``None`` when ``path`` holds no adapter."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            return None
    elif not is_hub_name(path) or cached_file(path, "adapter_config.json", _raise_exceptions_for_missing_entries=False,
                                              _raise_exceptions_for_connection_errors=False, **hub) is None:
        return None  # no adapter there: the model loader says what is missing
    from peft import PeftConfig

    return PeftConfig.from_pretrained(path, **hub).base_model_name_or_path


def save_trained_model(trainer, training_args) -> None:
    """What a TRL script does after ``train()``: the final model (and tokenizer) in ``output_dir``, pushed to
    the Hub with ``--push_to_hub``."""
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub()
    if trainer.accelerator.is_main_process:
        print(f"saved the trained model to {training_args.output_dir}")
