"""LoRA under gradient checkpointing (issue 30): every adapter weight gets a gradient, the base weights none.

Checkpointed layers recompute their forward in the backward pass. With reentrant checkpointing a layer whose inputs
do not require grad yields outputs that do not either, so the adapters inside it would silently get no gradient;
the trainer must make the embedding output require grad (``enable_input_require_grads``) for them to learn.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from tests.tiny_models import build_tiny_llada
from dllm_trl.trainers import RLDFConfig, RLDFTrainer

from .conftest import addition_dataset, length_reward, make_char_tokenizer, tiny_training_args

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# A trainable copy of the final norm, outside the checkpointed layers: were the layers' adapters cut off, the loss
# would still have a gradient path and training would run on silently (without it, the backward fails loudly).
TRAINED_OUTSIDE_LAYERS = ["model.norm"]


def lora_trainer(tmp_path, checkpointing_kwargs):
    tokenizer = make_char_tokenizer()
    model = build_tiny_llada(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    # Nonzero lora_B, so that lora_A gets a gradient at the first step too (with B = 0 its gradient is exactly 0).
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False,
                      modules_to_save=TRAINED_OUTSIDE_LAYERS)
    args = tiny_training_args(RLDFConfig, tmp_path, max_steps=1, gradient_checkpointing=True,
                              gradient_checkpointing_kwargs=checkpointing_kwargs)
    return RLDFTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=addition_dataset(),
                       processing_class=tokenizer, peft_config=lora)


def train_one_step(trainer):
    """Train one step; return the gradient norm each parameter had when the optimizer stepped, and the parameters
    before and after."""
    grad_norms = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p, name=name: grad_norms.__setitem__(name, p.grad.norm()))
             for name, p in trainer.model.named_parameters() if p.requires_grad]
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    try:
        trainer.train()
    finally:
        for hook in hooks:
            hook.remove()
    after = dict(trainer.model.named_parameters())
    return grad_norms, before, after


@pytest.mark.parametrize("checkpointing_kwargs", [None, {"use_reentrant": False}, {"use_reentrant": True}],
                         ids=["default", "non_reentrant", "reentrant"])
def test_every_lora_weight_learns_under_gradient_checkpointing(tmp_path, checkpointing_kwargs):
    trainer = lora_trainer(tmp_path, checkpointing_kwargs)
    grad_norms, before, after = train_one_step(trainer)
    base = trainer.model.get_base_model()
    layers = base.model.layers
    # The setting reached the model (Trainer.train enables it): the decoder layers ran checkpointed.
    assert base.is_gradient_checkpointing and all(layer.gradient_checkpointing for layer in layers)
    reentrant = (checkpointing_kwargs or {}).get("use_reentrant", False)  # transformers' default: non-reentrant
    assert all(layer._gradient_checkpointing_func.keywords["use_reentrant"] is reentrant for layer in layers)
    adapters = [name for name in before if "lora_" in name]
    assert len(adapters) == 2 * len(LORA_TARGETS) * len(layers)
    norm_copy = [name for name in before if "modules_to_save" in name]
    assert len(norm_copy) == 1 and grad_norms[norm_copy[0]] > 0
    assert {name for name, p in after.items() if p.requires_grad} == {*adapters, *norm_copy}
    no_gradient = [name for name in adapters if name not in grad_norms or grad_norms[name] == 0]
    assert not no_gradient, f"LoRA weights without a gradient: {no_gradient}"
    unmoved = [name for name in adapters if torch.equal(before[name], after[name].detach())]
    assert not unmoved, f"LoRA weights the step left unchanged: {unmoved}"
    moved_base = [name for name in before if name not in adapters + norm_copy
                  and not torch.equal(before[name], after[name].detach())]
    assert not moved_base, f"base weights changed under LoRA: {moved_base}"
