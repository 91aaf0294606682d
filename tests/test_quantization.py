"""QLoRA: ``--load_in_4bit`` / ``BitsAndBytesConfig`` is honoured by the loading path every script uses (on the
shipped toy checkpoint), trains the LoRA adapter for real on CPU (bitsandbytes' CPU backend), and is refused where it
cannot apply."""

from __future__ import annotations

import pytest
import torch
from trl import ModelConfig, get_peft_config

from dllm_trl.families import check_trainable, load_model_and_tokenizer
from dllm_trl.trainers import RLDFConfig, RLDFTrainer
from dllm_trl.toy import toy_assets_dir, toy_dataset, toy_training_defaults

bnb = pytest.importorskip("bitsandbytes")

QLORA = dict(model_name_or_path=str(toy_assets_dir()), load_in_4bit=True, use_peft=True,
             lora_target_modules=["q_proj", "v_proj"])


def digit_sum_reward(completions, **kwargs):
    """Dense: varies with the digits a completion holds, so that groups have non-zero advantages."""
    return [float(sum(ord(ch) for ch in c) % 7) for c in completions]


def test_the_loader_needs_a_model_named():
    """The library loader has no default model (the toy is the scripts' default, which they name themselves)."""
    with pytest.raises(ValueError, match="model_name_or_path is not set"):
        load_model_and_tokenizer(ModelConfig(), "cpu")


def test_toy_loads_in_4bit():
    model, _ = load_model_and_tokenizer(ModelConfig(**QLORA))
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 7 * model.config.num_hidden_layers  # every projection of every layer; the head stays
    assert not isinstance(model.lm_head, bnb.nn.Linear4bit)


def test_quantised_training_needs_peft():
    with pytest.raises(ValueError, match="--use_peft"):
        check_trainable(ModelConfig(load_in_4bit=True))
    with pytest.raises(ValueError, match="--use_peft"):
        load_model_and_tokenizer(ModelConfig(load_in_8bit=True))


def _qlora_trainer(tmp_path, model, tokenizer, model_args):
    args = RLDFConfig(**toy_training_defaults(str(tmp_path), use_cpu=True, max_steps=2, seed=1))
    return RLDFTrainer(model=model, reward_funcs=digit_sum_reward, args=args, train_dataset=toy_dataset("train"),
                       processing_class=tokenizer, peft_config=get_peft_config(model_args))


def test_qlora_trains_the_adapter(tmp_path):
    model_args = ModelConfig(**QLORA)
    model, tokenizer = load_model_and_tokenizer(model_args)
    trainer = _qlora_trainer(tmp_path, model, tokenizer, model_args)
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    assert any(n > 0 for n in norms), norms
    moved = [n for n, p in trainer.model.named_parameters() if n in lora and not torch.equal(p, lora[n])]
    assert moved, "no LoRA weight moved: gradients did not reach the adapter"


def test_eval_mode_repacking_is_refused(tmp_path):
    """bitsandbytes repacks 4-bit weights for CPU inference at the first eval-mode forward; training then would be
    silent (no gradients), so the trainer refuses it."""
    model_args = ModelConfig(**QLORA)
    model, tokenizer = load_model_and_tokenizer(model_args)
    with torch.no_grad():
        model.eval()(input_ids=torch.tensor([[3, 4, 5]]))
    if not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False)
               for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)):
        return  # this CPU has no AVX512-BF16: bitsandbytes keeps the trainable layout, nothing to refuse
    trainer = _qlora_trainer(tmp_path, model, tokenizer, model_args)
    with pytest.raises(RuntimeError, match="repacked by bitsandbytes"):
        trainer.train()
