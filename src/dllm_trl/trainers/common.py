"""What every trainer of the package does the same way at its hooks: the KL reference, up-front input checks,
quieting TRL's use of transformers' old checkpointing names, and logging summed metrics."""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
from trl.trainer.utils import disable_dropout_in_model

from ..models.bidirectional import diffusion_block_size
from ..models.engines import (
    broadcast_from_main,
    check_launch,
    is_partitioned,
    prepare_frozen_model,
    unwrap_model,
    uses_peft,
)
from ..models.loading import load_diffusion_model


def reference_copy(model, load=None):
    """A frozen copy of the policy as it is now, before PEFT wraps it.

    A deep copy, except when DeepSpeed ZeRO-3 partitioned the weights at load (``zero3_init_flag``): no process holds
    them whole, so the reference is loaded again from the policy's checkpoint (partitioned the same way) by
    ``load(path, **from_pretrained_kwargs)`` — :func:`~dllm_trl.load_diffusion_model` by default.
    """
    if not is_partitioned(model):
        return copy.deepcopy(model)
    base = unwrap_model(model)
    path = getattr(base, "name_or_path", "") or ""
    if not path:
        raise ValueError(
            "DeepSpeed ZeRO-3 partitioned the policy's weights at load (zero3_init_flag: true) and the model has no "
            "checkpoint path to load the KL reference from. Pass `model=` as a checkpoint path (or a model loaded with "
            "`load_diffusion_model(path)`), set `beta=0.0`, or set `zero3_init_flag: false` in the accelerate config."
        )
    config = base.config
    from_pretrained_kwargs = dict(dtype=base.dtype, attn_implementation=config._attn_implementation)
    if load is None:
        return load_diffusion_model(
            path, mask_token_id=config.mask_token_id, logit_shift=getattr(config, "diffusion_logit_shift", False),
            sampling=getattr(config, "diffusion_sampling", None), block_size=diffusion_block_size(config),
            **from_pretrained_kwargs,
        )
    return load(path, **from_pretrained_kwargs)


def check_training_inputs(model, train_dataset, tokenizer) -> None:
    """Clear errors, up front, for inputs TRL would fail on deep inside (or silently train nothing with)."""
    if train_dataset is not None and hasattr(train_dataset, "__len__"):
        if len(train_dataset) == 0:
            raise ValueError("train_dataset is empty: there is nothing to train on.")
        columns = getattr(train_dataset, "column_names", None)
        if columns is not None and "prompt" not in columns:
            raise ValueError(
                f"train_dataset has no 'prompt' column (it has {columns}): rename the column that holds the prompts, "
                "e.g. dataset.rename_column('question', 'prompt'), or load it with dllm_trl.data.load_task_dataset."
            )
    tokenizer_mask = getattr(tokenizer, "mask_token_id", None)
    model_mask = getattr(getattr(model, "config", None), "mask_token_id", None)
    if tokenizer_mask is not None and model_mask is not None and tokenizer_mask != model_mask:
        raise ValueError(
            f"The tokenizer's mask token (id {tokenizer_mask}) is not the model's (config.mask_token_id={model_mask}): "
            "the model would be trained on a token it was never pre-trained to fill. Pass the checkpoint's tokenizer, or "
            "load the model with load_diffusion_model(..., mask_token_id=...)."
        )


def refuse_unsupported_kwargs(trainer_name: str, kwargs: dict) -> None:
    for unsupported in ("tools", "rollout_func", "environment_factory"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"{unsupported}= is not supported by {trainer_name}.")


def init_with_reference(trainer, parent_init, model, args, load=None, **kwargs):
    """Run ``parent_init`` (a ``GRPOTrainer.__init__``) and return the KL reference it left for us to prepare.

    With PEFT, TRL's own semantics hold: the reference is the base model with adapters disabled, or — for a model
    that already carries an adapter (SFT then RL) — TRL's frozen copy ``"ref"`` of that adapter. Otherwise TRL would
    rebuild the reference with ``AutoModelForCausalLM`` from the policy's path, which cannot read LLaDA/Dream (nor
    an in-memory model): :func:`reference_copy` builds it instead, and ``beta`` is hidden from TRL meanwhile.
    """
    beta = args.beta
    reference = reference_copy(model, load) if beta != 0.0 and not uses_peft(model, kwargs.get("peft_config")) else None
    if reference is not None:
        args.beta = 0.0
    try:
        with old_checkpointing_names_quiet():  # PEFT's PeftModel reads is_gradient_checkpointing
            parent_init(model=model, args=args, **kwargs)
    finally:
        args.beta = beta
    trainer.beta = beta
    check_launch(trainer.accelerator)
    return reference


def prepare_reference(reference, accelerator, disable_dropout: bool):
    """The frozen KL reference, on every process, wrapped for the engine."""
    reference.requires_grad_(False)
    reference.eval()
    if disable_dropout:
        disable_dropout_in_model(reference)
    if not is_partitioned(reference):  # a partitioned reference was loaded shard by shard from the checkpoint
        broadcast_from_main(reference, accelerator)
    return prepare_frozen_model(reference, accelerator)


@contextlib.contextmanager
def old_checkpointing_names_quiet():
    """TRL (``unwrap_model_for_generation``, ``disable_gradient_checkpointing``: the rollout and the π_old pass) and
    PEFT (``PeftModel``) read and toggle gradient checkpointing through transformers' old names
    (``is_gradient_checkpointing``, ``gradient_checkpointing_disable/enable``), which transformers ≥ 5.24 deprecates
    with a FutureWarning on every step. What they do is right; only those warnings, raised inside TRL and PEFT, are
    dropped here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated",
                                category=FutureWarning)
        yield


def log_metric_sums(trainer, mode: str, sums: dict) -> None:
    """Add ``name -> (numerator, denominator, skip_when_empty)`` over every process (one reduce) and append
    ``numerator / max(denominator, 1)`` to ``trainer._metrics[mode]`` (nothing where the denominator is 0 and the
    metric is skipped when empty: no value, not 0)."""
    if not sums:
        return
    flat = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=trainer.accelerator.device)
                        for num, den, _ in sums.values() for v in (num, den)])
    flat = trainer.accelerator.reduce(flat, reduction="sum")
    for n, (name, (_, _, skip_when_empty)) in enumerate(sums.items()):
        numerator, denominator = flat[2 * n], flat[2 * n + 1]
        if skip_when_empty and denominator.item() <= 0:
            continue
        trainer._metrics[mode][name].append((numerator / denominator.clamp_min(1)).item())
