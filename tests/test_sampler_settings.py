"""The losses score π_old with the settings of the sampler that made the rollout, not with ``args``' (issue 32).

A sampler handed to the trainer may sample at other settings than ``args`` describe; the rollout's record μ is then
the sampler's distribution, and the loss's sampler-consistent view of π_old must be too. Without a cache the
sampler's forward is the training forward, so the two agree to float rounding.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dllm_trl.generation import MaskedDiffusionSampler
from dllm_trl.losses import RLDFLoss
from dllm_trl.losses.trust_region_loss import DiffusionTrustRegionLoss
from dllm_trl.trainers import DPPOMaskConfig, DPPOMaskTrainer, RLDFConfig, RLDFTrainer

from .conftest import addition_dataset, length_reward, make_char_tokenizer, tiny_training_args
from .test_dppo_mask_trainer import digit_reward, tiny_diffusion

SAMPLER_TEMPERATURE = 0.7


def _sampler_config(args, **changes):
    """The sampler settings ``args`` describe, with ``changes``: a sampler the caller built themselves."""
    return dataclasses.replace(args.diffusion_generation_config(), **changes)


def _rldf_trainer(tmp_path, sampler, config_class=RLDFConfig, reward=length_reward, **overrides):
    args = tiny_training_args(config_class, tmp_path, max_steps=1, bf16=False, **overrides)
    trainer_class = RLDFTrainer if config_class is RLDFConfig else DPPOMaskTrainer
    return trainer_class(model=tiny_diffusion(), reward_funcs=reward, args=args, train_dataset=addition_dataset(),
                         processing_class=make_char_tokenizer(), sampler=sampler(args) if sampler else None)


def _first_loss_log(trainer):
    return next(entry for entry in trainer.state.log_history if "loss" in entry)


def test_rldf_mismatch_reads_the_sampler_temperature(tmp_path):
    """Sampler at T = 0.7, args at 1.0, no cache: the record μ(a) is the training forward's at T = 0.7, so the
    logged mismatch is ~0 (it read ~0.87 when the loss took args' temperature)."""
    trainer = _rldf_trainer(
        tmp_path, lambda args: MaskedDiffusionSampler(_sampler_config(args, temperature=SAMPLER_TEMPERATURE)),
        cache_mode="none",
    )
    assert trainer.args.temperature == 1.0
    trainer.train()
    log = _first_loss_log(trainer)
    assert log["sampling/sampling_logp_difference/max"] <= 1e-5
    assert log["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-5)


def test_trust_region_scores_at_the_sampler_temperature(tmp_path):
    """DiffusionTrustRegionLoss: π_θ is scored as the sampler drew. On-policy without a cache π_θ = μ at the tokens
    committed at the sampled step (μ from the rollout record), so their log-ratio and divergence vanish."""
    trainer = _rldf_trainer(
        tmp_path, lambda args: MaskedDiffusionSampler(_sampler_config(args, temperature=0.6)),
        config_class=DPPOMaskConfig, reward=digit_reward, cache_mode="none", num_sampled_timesteps=2,
        divergence_top_k=4, beta=0.0, clean_target_threshold=0.05,
    )
    assert trainer.loss.score_temperature == 0.6
    trainer.loss.records = []
    trainer.train()
    records = trainer.loss.records
    from_rollout = torch.cat([r["from_rollout"] for r in records])
    log_ratio = torch.cat([r["log_ratio"] for r in records])[from_rollout]
    div = torch.cat([r["div"] for r in records])[from_rollout]
    assert from_rollout.sum() > 0
    assert log_ratio.abs().max() <= 1e-5
    assert div.abs().max() <= 1e-5
    assert _first_loss_log(trainer)["sampling/sampling_logp_difference/max"] <= 1e-5


def test_trainer_leaves_the_callers_sampler_config_alone(tmp_path):
    """The loss's requests (the trust-region loss asks for the behaviour top-K) go into a copy of the config."""
    args = tiny_training_args(DPPOMaskConfig, tmp_path, max_steps=1, divergence_top_k=4, num_sampled_timesteps=2)
    config = _sampler_config(args, temperature=0.9)
    before = dataclasses.asdict(config)
    sampler = MaskedDiffusionSampler(config)
    trainer = DPPOMaskTrainer(model=tiny_diffusion(), reward_funcs=digit_reward, args=args,
                              train_dataset=addition_dataset(), processing_class=make_char_tokenizer(), sampler=sampler)
    assert dataclasses.asdict(config) == before and config.record_topk == 0
    assert trainer.sampler.config.record_topk == 4 and trainer.sampler.config.temperature == 0.9
    assert trainer.loss.sampler_config is trainer.sampler.config


def test_an_explicit_trust_region_temperature_must_match_the_sampler(tmp_path):
    args = tiny_training_args(DPPOMaskConfig, tmp_path, divergence_top_k=4, num_sampled_timesteps=2)
    loss = DiffusionTrustRegionLoss(args, 16, 0.5, 1, 0)
    with pytest.raises(ValueError, match=r"temperature=0\.5.*temperature=1\.0"):
        loss.bind_sampler(args.diffusion_generation_config())
    followed = DiffusionTrustRegionLoss(args, 16, None, 1, 0)
    followed.bind_sampler(_sampler_config(args, temperature=0.3))
    assert followed.score_temperature == 0.3


def test_the_correction_is_refused_for_a_sampler_it_cannot_correct(tmp_path):
    """``rollout_importance_sampling_correction``'s conditions hold for the sampler that rolls out, not only args."""
    args = tiny_training_args(RLDFConfig, tmp_path, rollout_importance_sampling_correction=True, cache_mode="dual")
    with pytest.raises(ValueError, match="cache='none'"):
        RLDFLoss(args).bind_sampler(_sampler_config(args, cache="none"))
    with pytest.raises(ValueError, match="temperature=0.0"):
        RLDFLoss(args).bind_sampler(_sampler_config(args, temperature=0.0))
    trust = tiny_training_args(DPPOMaskConfig, tmp_path, rollout_importance_sampling_correction=True,
                               behaviour_source="old", divergence_top_k=4, num_sampled_timesteps=2)
    with pytest.raises(ValueError, match="top_p=0.9"):
        DiffusionTrustRegionLoss(trust, 16, None, 1, 0).bind_sampler(_sampler_config(trust, top_p=0.9))


def test_a_sampler_without_sampling_settings_is_refused(tmp_path):
    args = tiny_training_args(RLDFConfig, tmp_path)

    @dataclasses.dataclass
    class Settings:
        gen_length: int = 8

    with pytest.raises(ValueError, match="temperature"):
        RLDFLoss(args).bind_sampler(Settings())
