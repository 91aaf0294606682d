"""The family registry (issue 32): every supported family trains from its official checkpoint folder with nothing but
``RLDFTrainer(model=path)`` — no sampler, loss or block length named — and a family defined outside the package
(here, in this test) trains the same way once registered, touching no file of the package."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dllm_trl import RLDFConfig, RLDFTrainer, load_diffusion_model
from dllm_trl.families import (
    FAMILY_CONFIG_KEY,
    MaskedDiffusionFamily,
    family_for_checkpoint,
    family_named,
    family_of,
    register_family,
    registered_families,
    unregister_family,
)
from dllm_trl.generation import DiffusionGemmaSampler, MaskedDiffusionSampler
from dllm_trl.losses import DiffusionGemmaRLDFLoss, MoERLDFLoss, RLDFLoss
from dllm_trl.models import set_diffusion_properties
from tests.tiny_models import build_tiny_diffusion_gemma
from dllm_trl.trainers import DiffusionDPPOMaskTrainer, DPPOMaskConfig, DPPOMaskTrainer

from .conftest import addition_dataset, length_reward, make_char_tokenizer
from .test_block_models import fast_dllm_v2_raw_config, sdar_raw_config, sdar_weights
from .test_llada2_models import llada2_raw_config, llada2_weights
from .test_models import dream_raw_config, dream_weights, llada_raw_config, llada_weights, write_checkpoint

TOKENS = dict(mask_token_id=1, eos_token_id=0, pad_token_id=0)  # the char tokenizer's <mask> and <pad> (= EOS)


def official_folder(family: str, path) -> str:
    """A tiny checkpoint of ``family`` written the way its official code saves it."""
    if family == "llada":
        raw = llada_raw_config(**TOKENS)
        return write_checkpoint(path, raw, llada_weights(raw))
    if family == "dream":
        raw = dream_raw_config(**TOKENS)
        return write_checkpoint(path, raw, dream_weights(raw))
    if family == "sdar":
        raw = sdar_raw_config(**TOKENS)
        return write_checkpoint(path, raw, sdar_weights(raw))
    if family == "fast_dllm_v2":
        raw = fast_dllm_v2_raw_config(bd_size=4, **TOKENS)
        return write_checkpoint(path, raw, dream_weights(raw))
    if family == "llada2":
        raw = llada2_raw_config(mask_token_id=1, eos_token_id=0, pad_token_id=0)
        return write_checkpoint(path, raw, llada2_weights(raw))
    assert family == "diffusion_gemma"
    model = build_tiny_diffusion_gemma(seed=0, canvas_length=4)
    text = model.config.get_text_config()
    text.eos_token_id = text.pad_token_id = 0
    model.generation_config.max_denoising_steps = 3  # the model's own sampler setting, which the trainer must read
    model.save_pretrained(path)
    return str(path)


def spread_reward(completions, **kwargs):
    """Rewards that differ inside every group, so that every step has a gradient to take."""
    return [float(i % 3) for i in range(len(completions))]


def args_for(tmp_path, config_class=RLDFConfig, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), max_completion_length=8, per_device_train_batch_size=3,
                  num_generations=3, max_steps=1, logging_steps=1, report_to="none", learning_rate=1e-3, num_sampled_timesteps=2,
                  save_strategy="no", use_cpu=True, drop_zero_variance_groups=False, seed=0)
    values.update(overrides)
    return config_class(**values)


# (family, model_init_kwargs, expected block length, default sampler class, default loss class)
FAMILIES = [
    ("llada", {}, 8, MaskedDiffusionSampler, RLDFLoss),  # bidirectional: 32 does not divide 8, so one block
    ("dream", {}, 8, MaskedDiffusionSampler, RLDFLoss),
    ("sdar", {"block_size": 4}, 4, MaskedDiffusionSampler, RLDFLoss),  # SDAR records no block size
    ("fast_dllm_v2", {}, 4, MaskedDiffusionSampler, RLDFLoss),  # its config's bd_size
    ("llada2", {"block_size": 4}, 4, MaskedDiffusionSampler, MoERLDFLoss),
    ("diffusion_gemma", {}, 4, DiffusionGemmaSampler, DiffusionGemmaRLDFLoss),  # its canvas
]


@pytest.mark.parametrize("name, init_kwargs, block, sampler_class, loss_class", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_every_family_trains_from_its_official_folder_with_nothing_named(
    tmp_path, name, init_kwargs, block, sampler_class, loss_class
):
    path = official_folder(name, tmp_path / name)
    with open(f"{path}/config.json") as f:
        raw = json.load(f)
    assert family_for_checkpoint(raw).name == name
    claims = [family.name for family in registered_families() if family.matches_checkpoint(raw)]
    assert claims[0] == name and set(claims[1:]) <= {"masked", "causal"}  # no other family's format is mistaken for it
    args = args_for(tmp_path, model_init_kwargs=init_kwargs)
    assert args.block_length is None
    trainer = RLDFTrainer(model=path, reward_funcs=spread_reward, args=args, train_dataset=addition_dataset(3, 2),
                          processing_class=make_char_tokenizer())
    assert trainer.family is family_named(name) and family_of(trainer.model).name == name
    assert trainer.block_length == block and type(trainer.sampler) is sampler_class and type(trainer.loss) is loss_class
    if sampler_class is DiffusionGemmaSampler:
        assert trainer.sampler.config.max_denoising_steps == 3  # the model's generation_config, as generate() reads it
    else:
        assert trainer.sampler.config.block_length == block
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(math.isfinite(loss) for loss in losses)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters() if n in before)
    if loss_class is MoERLDFLoss:  # MoE families log routing drift by default
        assert any("moe/routing_drift" in entry for entry in trainer.state.log_history)


def test_block_length_not_dividing_the_completion_is_refused_naming_both(tmp_path):
    path = official_folder("fast_dllm_v2", tmp_path / "fast")
    with pytest.raises(ValueError, match=r"max_completion_length=6 must be a multiple of the model's block length 4"):
        RLDFTrainer(model=path, reward_funcs=length_reward, args=args_for(tmp_path, max_completion_length=6),
                    train_dataset=addition_dataset(3, 2), processing_class=make_char_tokenizer())


def test_a_causal_lm_is_refused_by_the_diffusion_trainer_naming_the_fix(tmp_path):
    tokenizer = make_char_tokenizer()
    causal = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2))
    assert family_of(causal).name == "causal"
    marked = set_diffusion_properties(copy.deepcopy(causal), mask_token_id=1)  # a mask token, no family named
    assert family_of(marked).name == "masked"
    with pytest.raises(ValueError, match=r"trains diffusion LMs.*load_diffusion_model\(path, mask_token_id=...\)"):
        RLDFTrainer(model=causal, reward_funcs=length_reward, args=args_for(tmp_path), train_dataset=addition_dataset(),
                    processing_class=tokenizer)


# ------------------------------------------------------------------------------------------ a family from outside
TOY_FORMAT = "toy_dlm"


def write_toy_dlm_checkpoint(path) -> str:
    """A made-up official format: Llama-layout weights, a config of its own keys (``width``, ``depth`` …)."""
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    model.save_pretrained(path)
    raw = {"model_type": TOY_FORMAT, "architectures": ["ToyDLM"], "vocab": 16, "width": 32, "ffn": 64, "depth": 2,
           "heads": 2, "mask_id": 1, "eos_id": 0, "block": 4}
    with open(path / "config.json", "w") as f:
        json.dump(raw, f)
    return str(path)


class CountingSampler(MaskedDiffusionSampler):
    """The toy family's own rollout (the masked one, counting its calls)."""

    calls = 0

    def __call__(self, model, prompt_ids, prompt_mask, generator=None):
        type(self).calls += 1
        return super().__call__(model, prompt_ids, prompt_mask, generator)


class ToyDLMFamily(MaskedDiffusionFamily):
    """A family registered from outside the package: one class, no package file touched."""

    name = "toy_dlm"

    def matches_checkpoint(self, raw_config):
        return raw_config.get("model_type") == TOY_FORMAT

    def load(self, name_or_path, raw_config, *, mask_token_id=None, logit_shift=None, sampling=None, block_size=None,
             **from_pretrained_kwargs):
        config = LlamaConfig(vocab_size=raw_config["vocab"], hidden_size=raw_config["width"],
                             intermediate_size=raw_config["ffn"], num_hidden_layers=raw_config["depth"],
                             num_attention_heads=raw_config["heads"], num_key_value_heads=raw_config["heads"],
                             max_position_embeddings=64, eos_token_id=raw_config["eos_id"],
                             pad_token_id=raw_config["eos_id"])
        model = LlamaForCausalLM.from_pretrained(name_or_path, config=config, **from_pretrained_kwargs)
        return self.finish_loading(model, mask_token_id=raw_config["mask_id"], logit_shift=False,
                                   sampling=sampling or "categorical", block_size=raw_config["block"])

    def sampler(self, args, model, block_length):
        return CountingSampler(args.diffusion_generation_config(block_length=block_length))


@pytest.fixture
def toy_family():
    register_family(ToyDLMFamily)
    yield family_named("toy_dlm")
    unregister_family("toy_dlm")


def test_a_family_registered_outside_the_package_loads_and_trains(tmp_path, toy_family):
    path = write_toy_dlm_checkpoint(tmp_path / "toy_dlm")
    assert registered_families()[0] is toy_family
    model = load_diffusion_model(path)
    assert getattr(model.config, FAMILY_CONFIG_KEY) == "toy_dlm" and family_of(model) is toy_family
    CountingSampler.calls = 0
    trainer = RLDFTrainer(model=path, reward_funcs=length_reward, args=args_for(tmp_path),
                          train_dataset=addition_dataset(3, 2), processing_class=make_char_tokenizer())
    assert trainer.block_length == 4 and type(trainer.sampler) is CountingSampler and type(trainer.loss) is RLDFLoss
    trainer.train()
    assert CountingSampler.calls >= 1
    assert all(math.isfinite(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry)
    dppo = DPPOMaskTrainer(model=path, reward_funcs=length_reward,
                           args=args_for(tmp_path, DPPOMaskConfig, divergence_top_k=4),
                           train_dataset=addition_dataset(3, 2), processing_class=make_char_tokenizer())
    assert type(dppo) is DiffusionDPPOMaskTrainer and type(dppo.sampler) is CountingSampler


def test_the_registry_refuses_bad_families(toy_family):
    class Nameless(MaskedDiffusionFamily):
        pass

    class Clash(MaskedDiffusionFamily):
        name = "llada"

    class Odd(MaskedDiffusionFamily):
        name, kind = "odd", "autoregressive"

    for family, message in ((Nameless, "name must be a non-empty string"), (Clash, "built-in family's name"),
                            (Odd, "kind='autoregressive'")):
        with pytest.raises(ValueError, match=message):
            register_family(family)
    with pytest.raises(ValueError, match="not a family registered by the user"):
        unregister_family("llada")


def test_lora_without_target_modules_takes_the_familys(tmp_path):
    """A LoraConfig naming no target_modules gets the family's (DiffusionGemma: the text attention of the encoder and
    decoder, which PEFT has no default for); the caller's config is left as built."""
    from peft import LoraConfig

    path = official_folder("diffusion_gemma", tmp_path / "gemma")
    lora = LoraConfig(r=2, lora_alpha=4, task_type=None)
    trainer = RLDFTrainer(model=path, reward_funcs=spread_reward, args=args_for(tmp_path),
                          train_dataset=addition_dataset(3, 2), processing_class=make_char_tokenizer(), peft_config=lora)
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in trainer.model.named_parameters() if ".lora_A" in name}
    assert adapted and all(name.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj") for name in adapted)
    decoder = [name for name, module in trainer.model.named_modules() if ".decoder." in name and hasattr(module, "lora_A")]
    assert decoder and not any("vision" in name for name in adapted)  # the decoder's twins, tied to the encoder's
    assert lora.target_modules is None
