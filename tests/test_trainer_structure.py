"""The trainers are hook glue over a sampler and a loss object, one model kind per class (issue 21)."""

from __future__ import annotations

import dataclasses
import inspect

import torch
from trl import GRPOConfig, GRPOTrainer

from dllm_trl.generation import MaskedDiffusionSampler
from dllm_trl.losses import RLDFLoss
from dllm_trl.trainers import (
    CausalDPPOMaskConfig,
    CausalDPPOMaskTrainer,
    DPPO_MASK_TRAINERS,
    DiffusionDPPOMaskTrainer,
    DPPOMaskConfig,
    DPPOMaskTrainer,
    RLDFConfig,
    RLDFTrainer,
)

from .conftest import addition_dataset, length_reward, make_char_tokenizer, tiny_training_args
from .test_dppo_mask_trainer import digit_reward, snapshot, tiny_causal, tiny_diffusion

OWN_HELPERS = {"make_loss", "_old_logps_needed", "_zero_variance_rows", "_clean_targets_from_loss",
               "_loss_normalizer", "_finish_pending_normalization", "_generator_files", "_forwards_matched",
               "_generate_with_engine", "_log_engine_mismatch",
               # SafeRunMixin's (issue 30)
               "_on_main_then_everywhere", "_checkpoint_to_resume", "_stop_on_sigterm", "_sigterm_agreed",
               "_interrupted"}
"""Methods of the package's trainers that TRL does not have (everything else they define overrides a TRL hook)."""


def test_every_trainer_overrides_only_hooks_the_pinned_trl_has():
    from dllm_trl.trainers.common import SafeRunMixin

    for trainer_class in (RLDFTrainer, DiffusionDPPOMaskTrainer, CausalDPPOMaskTrainer, SafeRunMixin):
        own = {name for name, value in vars(trainer_class).items() if inspect.isfunction(value)}
        for name in own - OWN_HELPERS - {"__init__"}:
            assert hasattr(GRPOTrainer, name), f"{trainer_class.__name__}.{name} overrides a ghost"


def test_the_causal_config_carries_no_rldf_field():
    from dllm_trl.trainers.rldf_config import SafeRunArguments

    grpo = {f.name for f in dataclasses.fields(GRPOConfig)} | {f.name for f in dataclasses.fields(SafeRunArguments)}
    rldf_only = {f.name for f in dataclasses.fields(RLDFConfig)} - grpo
    causal = {f.name for f in dataclasses.fields(CausalDPPOMaskConfig)}
    assert rldf_only and not causal & rldf_only
    assert {"divergence", "divergence_top_k", "mask_direction", "is_cap"} <= causal


def test_dppo_mask_trainer_builds_the_trainer_of_the_model_kind_once(tmp_path):
    def build(model, **overrides):
        return DPPOMaskTrainer(model=model, reward_funcs=length_reward, train_dataset=addition_dataset(),
                               processing_class=make_char_tokenizer(),
                               args=tiny_training_args(DPPOMaskConfig, tmp_path, num_sampled_timesteps=2,
                                                       divergence_top_k=4, **overrides))

    diffusion, causal = build(tiny_diffusion()), build(tiny_causal(), model_kind="causal")
    assert type(diffusion) is DiffusionDPPOMaskTrainer and diffusion.model_kind == "diffusion"
    assert type(causal) is CausalDPPOMaskTrainer and causal.model_kind == "causal"
    assert isinstance(diffusion, DPPO_MASK_TRAINERS) and isinstance(causal, DPPO_MASK_TRAINERS)
    assert inspect.isfunction(DPPOMaskTrainer)  # an honest factory, not a class that returns another class


def test_the_causal_config_trains_as_the_combined_config_does(tmp_path):
    """CausalDPPOMaskConfig (GRPO + mask fields) and DPPOMaskConfig(model_kind="causal") give the same weights."""
    common = dict(max_completion_length=8, per_device_train_batch_size=4, num_generations=4, max_steps=2,
                  logging_steps=1, report_to="none", learning_rate=1e-3, temperature=1.0, beta=0.01,
                  save_strategy="no", use_cpu=True, seed=0, divergence_top_k=4, divergence_threshold=0.05)
    weights = []
    for name, args in (("causal", CausalDPPOMaskConfig(output_dir=str(tmp_path / "a"), **common)),
                       ("combined", DPPOMaskConfig(output_dir=str(tmp_path / "b"), model_kind="causal", **common))):
        trainer = DPPOMaskTrainer(model=tiny_causal(), reward_funcs=digit_reward, args=args,
                                  train_dataset=addition_dataset(), processing_class=make_char_tokenizer())
        assert type(trainer) is CausalDPPOMaskTrainer, name
        before = snapshot(trainer.model)
        trainer.train()
        weights.append(snapshot(trainer.model))
    assert any(not torch.equal(before[k], v) for k, v in weights[0].items())  # it trained
    for key, value in weights[0].items():
        torch.testing.assert_close(value, weights[1][key], rtol=0, atol=0, msg=key)


class CountingSampler(MaskedDiffusionSampler):
    calls = 0

    def __call__(self, model, prompt_ids, prompt_mask, generator=None):
        self.calls += 1
        return super().__call__(model, prompt_ids, prompt_mask, generator)


class CountingLoss(RLDFLoss):
    steps = 0

    def step_loss(self, model, inputs, j, call, scored=None):
        self.steps += 1
        return super().step_loss(model, inputs, j, call, scored)


def test_a_sampler_and_a_loss_object_plug_into_the_trainer_unchanged(tmp_path):
    """What a new model family adds: a sampler and a loss object, handed to RLDFTrainer; no trainer changes."""
    args = tiny_training_args(RLDFConfig, tmp_path, max_steps=1)
    sampler, loss = CountingSampler(args.diffusion_generation_config()), CountingLoss(args)
    trainer = RLDFTrainer(model=tiny_diffusion(), reward_funcs=length_reward, args=args, sampler=sampler, loss=loss,
                          train_dataset=addition_dataset(), processing_class=make_char_tokenizer())
    assert trainer.sampler is sampler and trainer.loss is loss
    trainer.train()
    assert sampler.calls >= 1 and loss.steps >= 1
