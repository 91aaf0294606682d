"""End-to-end checks of RLDFTrainer on tiny random diffusion LMs (CPU)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from peft import LoraConfig
from trl import GRPOTrainer

from tests.tiny_models import build_tiny_dream, build_tiny_llada
from dllm_trl.trainers import RLDFConfig, RLDFTrainer

from .conftest import addition_dataset, length_reward, make_char_tokenizer, tiny_training_args

OVERRIDDEN = [
    "_generate_single_turn",
    "_get_per_token_logps_and_entropies",
    "_generate_and_score_completions",
    "_compute_loss",
    "training_step",
    "_calculate_rewards",
    "_save_rng_state",
    "_load_rng_state",
    "train",
    "_save_checkpoint",
    "_push_from_checkpoint",
    "save_model",
]


def test_overridden_methods_exist_in_pinned_trl():
    from dllm_trl.trainers.common import SafeRunMixin

    own = {name for cls in (RLDFTrainer, SafeRunMixin) for name, value in vars(cls).items()
           if inspect.isfunction(value) and name != "__init__"}
    private_helpers = {"make_loss", "_old_logps_needed", "_zero_variance_rows", "_clean_targets_from_loss",
                       "_loss_normalizer", "_finish_pending_normalization", "_generator_files", "_forwards_matched",
                       # SafeRunMixin's own (issue 30)
                       "_on_main_then_everywhere", "_checkpoint_to_resume", "_stop_on_sigterm", "_sigterm_agreed",
                       "_interrupted"}
    assert own - private_helpers == set(OVERRIDDEN)
    for name in OVERRIDDEN:
        assert hasattr(GRPOTrainer, name), f"GRPOTrainer.{name} no longer exists: RLDFTrainer overrides a ghost"
    parent = inspect.signature(GRPOTrainer._generate_single_turn).parameters
    assert list(parent)[:5] == ["self", "prompt_ids", "images", "multimodal_fields", "num_generations"]


def make_args(tmp_path, **overrides):
    return tiny_training_args(RLDFConfig, tmp_path, **overrides)


def make_trainer(tmp_path, model=None, peft_config=None, **overrides):
    tokenizer = make_char_tokenizer()
    if model is None:
        model = build_tiny_llada(
            vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id, eos_token_id=tokenizer.eos_token_id
        )
    return RLDFTrainer(
        model=model,
        reward_funcs=length_reward,
        args=make_args(tmp_path, **overrides),
        train_dataset=addition_dataset(),
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def snapshot(module):
    return {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}


def changed(before, module):
    after = dict(module.named_parameters())
    return [name for name, value in before.items() if not torch.equal(value, after[name].detach())]


@pytest.mark.parametrize("builder", [build_tiny_llada, build_tiny_dream])
def test_train_updates_parameters_and_logs(tmp_path, builder):
    tokenizer = make_char_tokenizer()
    model = builder(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id, eos_token_id=tokenizer.eos_token_id)
    trainer = make_trainer(tmp_path, model=model)
    before = snapshot(trainer.model)
    trainer.train()
    assert changed(before, trainer.model)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert math.isfinite(entry["loss"])
        for key in ("reward", "kl", "rldf/token_utility", "rldf/target_tokens_per_step", "rldf/nfe_per_completion",
                    "rldf/rollout_time", "rldf/loss_time", "rldf/sampled_step_uncertainty", "rewards/length_reward/mean"):
            assert key in entry, key
        assert 0 < entry["rldf/token_utility"] <= 1


def test_lora_trains_adapter_only(tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    trainer = make_trainer(tmp_path, peft_config=lora)
    before = snapshot(trainer.model)
    assert before and all("lora_" in name for name in before)
    trainer.train()
    moved = changed(before, trainer.model)
    assert any("lora_A" in name for name in moved) or any("lora_B" in name for name in moved)
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


def test_ppo_iterations_and_gradient_accumulation(tmp_path):
    trainer = make_trainer(tmp_path, num_iterations=2, gradient_accumulation_steps=2, max_steps=2)
    before = snapshot(trainer.model)
    trainer.train()
    assert changed(before, trainer.model)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert all("clip_ratio/region_mean" in e for e in logs)
    assert all(math.isfinite(e["loss"]) for e in logs)


def test_static_unmasking_and_prefix_cache(tmp_path):
    trainer = make_trainer(tmp_path, unmasking="static", diffusion_steps=4, cache_mode="prefix", beta=0.0)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert all(e["rldf/nfe_per_completion"] == 4 for e in logs)


def test_resume_restores_optimizer_step_and_generator(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, beta=0.0)
    trainer.train()
    final_generator = trainer._rollout_generator.get_state()
    final_params = snapshot(trainer.model)

    resumed = make_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, beta=0.0)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    assert resumed.state.global_step == 2
    assert torch.equal(resumed._rollout_generator.get_state(), final_generator)
    for name, value in snapshot(resumed.model).items():
        torch.testing.assert_close(value, final_params[name], rtol=1e-5, atol=1e-6)


def test_config_validation_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="block_length"):
        make_args(tmp_path, max_completion_length=10, block_length=4)
    with pytest.raises(ValueError, match="clean_target_threshold"):
        make_args(tmp_path, clean_target_threshold=1.5)
    with pytest.raises(ValueError, match="num_sampled_timesteps"):
        make_args(tmp_path, num_sampled_timesteps=0)
    with pytest.raises(ValueError, match="loss_normalization"):
        make_args(tmp_path, loss_normalization="seq")
    with pytest.raises(ValueError, match="timestep_temperature"):
        make_args(tmp_path, timestep_temperature=-1.0)
    with pytest.raises(ValueError, match="cache_mode"):
        make_args(tmp_path, cache_mode="full")
    with pytest.raises(ValueError, match="steps"):
        make_args(tmp_path, unmasking="static", diffusion_steps=3)
    with pytest.raises(ValueError, match="use_vllm"):
        make_args(tmp_path, use_vllm=True)


def test_non_diffusion_model_is_rejected(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    plain = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2))
    with pytest.raises(ValueError, match="mask_token_id"):
        make_trainer(tmp_path, model=plain)


def test_existing_adapter_is_its_own_kl_reference(tmp_path):
    """SFT then RL: a PeftModel that already carries a trained adapter. The KL reference is that adapter as loaded
    (TRL's frozen "ref" copy), not the base model with adapters off, so the KL of the first step is exactly 0."""
    from peft import get_peft_model

    tokenizer = make_char_tokenizer()
    base = build_tiny_llada(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    sft = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    trainer = make_trainer(tmp_path, model=sft, beta=0.05, max_steps=2)
    assert "ref" in trainer.model.peft_config
    trainer.train()
    kl = [e["kl"] for e in trainer.state.log_history if "kl" in e]
    assert kl[0] == 0.0 and kl[1] > 0.0


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention"])
def test_attention_without_explicit_masks_is_refused(tmp_path, implementation):
    tokenizer = make_char_tokenizer()
    model = build_tiny_llada(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    model.config._attn_implementation = implementation  # what `attn_implementation=` at load would set
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        make_trainer(tmp_path, model=model)


@pytest.mark.parametrize("norm", ["token", "sample"])
def test_on_policy_targets_from_the_loss_forward_train_like_a_prepass(tmp_path, norm):
    """On-policy, the clean targets come from the loss forward itself (k forwards per micro-batch instead of 2k); with
    gradient accumulation and clipping that bites, the run equals one with a separate no-grad π_old pass: the
    normaliser is applied to the accumulated gradients before the Trainer clips them."""
    runs = []
    for from_loss in (True, False):
        trainer = make_trainer(tmp_path / str(from_loss), beta=0.0, gradient_accumulation_steps=2, max_steps=3,
                               loss_normalization=norm, max_grad_norm=0.05, bf16=False)  # fp32: exact comparison
        trainer.defer_clean_targets = from_loss
        start = snapshot(trainer.model)
        trainer.train()
        logs = [e for e in trainer.state.log_history if "loss" in e]
        runs.append((snapshot(trainer.model), [e["loss"] for e in logs], [e["grad_norm"] for e in logs]))
    (params, losses, norms), (base_params, base_losses, base_norms) = runs
    assert max(base_norms) > 0.05  # clipping was active
    assert losses == pytest.approx(base_losses, rel=1e-5, abs=1e-7)
    assert norms == pytest.approx(base_norms, rel=1e-4)
    # Adam turns a rounding-size gradient difference on a near-zero gradient element into a step of up to lr of
    # either sign (seen once: 1 element of 1024 apart by 2.3e-6 at lr 1e-6), so the updates are compared as tensors.
    for name, value in params.items():
        update, base_update = value - start[name], base_params[name] - start[name]
        assert (update - base_update).norm() <= 1e-2 * base_update.norm() + 1e-12, name
        assert int(((update - base_update).abs() > 1e-7).sum()) <= max(1, update.numel() // 100), name


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def test_a_step_without_learning_signal_logs_no_entropy_or_kl(tmp_path):
    """Every group has equal rewards, so no token is scored: entropy and KL have no value to report (a logged 0 read
    like a policy collapsed to determinism, on toy runs where most steps had no signal)."""
    trainer = make_trainer(tmp_path, drop_zero_variance_groups=True)
    trainer.reward_funcs = [constant_reward]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs and all(entry["frac_reward_zero_std"] == 1.0 for entry in logs)
    assert all("entropy" not in entry and "kl" not in entry for entry in logs), logs
