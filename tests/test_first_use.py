"""What a first run meets before training starts: bf16 that follows the hardware, every length refused when the
trainer is built (not at the first step), and no lock file left behind by a clean exit."""

from __future__ import annotations

import os

import pytest
import torch

from dllm_trl import RLDFConfig, RLDFTrainer
from dllm_trl.toy import load_toy
from dllm_trl.trainers import CausalDPPOMaskConfig, DPPOMaskConfig
from dllm_trl.trainers.safe_runs import LOCK_NAME, acquire_output_dir, release_output_dir

from .conftest import addition_dataset, length_reward


@pytest.mark.parametrize("config_class", [RLDFConfig, DPPOMaskConfig, CausalDPPOMaskConfig])
def test_bf16_follows_the_hardware_unless_asked(tmp_path, config_class):
    """TRL's default (bf16 unless fp16) stops a config on a machine without a bf16 accelerator."""
    assert not torch.accelerator.is_available()  # this suite runs on CPU
    assert config_class(output_dir=str(tmp_path)).bf16 is False
    assert config_class(output_dir=str(tmp_path), use_cpu=True).bf16 is False
    assert config_class(output_dir=str(tmp_path), use_cpu=True, bf16=True).bf16 is True  # asked: kept


def _args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), block_length=4, per_device_train_batch_size=4, num_generations=4,
                  max_steps=1, report_to="none", num_sampled_timesteps=2, save_strategy="no", use_cpu=True)
    values.update(overrides)
    return RLDFConfig(**values)


def test_a_completion_longer_than_the_model_is_refused_when_the_trainer_is_built(tmp_path):
    model, tokenizer = load_toy()
    assert model.config.max_position_embeddings == 64
    with pytest.raises(ValueError, match=r"max_completion_length=64 = 65 positions exceed .*max_position_embeddings=64"):
        RLDFTrainer(model=model, reward_funcs=length_reward, args=_args(tmp_path, max_completion_length=64),
                    train_dataset=addition_dataset(3, 2))  # no tokenizer: one prompt token at least


def test_the_longest_prompt_is_measured_when_the_trainer_is_built(tmp_path):
    from datasets import Dataset

    model, tokenizer = load_toy()
    rows = addition_dataset(3, 2).to_dict()
    rows["prompt"][4] = "1+" * 30 + "1="  # 62 characters: with 8 completion tokens past the 64 positions
    rows["answer"][4] = "31"
    with pytest.raises(ValueError, match=r"A 6\d-token prompt \+ max_completion_length=8 .* max_position_embeddings=64"):
        RLDFTrainer(model=model, reward_funcs=length_reward, args=_args(tmp_path, max_completion_length=8),
                    train_dataset=Dataset.from_dict(rows), processing_class=tokenizer)


def test_a_released_output_dir_keeps_no_lock_file_and_can_be_taken_again(tmp_path):
    path = acquire_output_dir(str(tmp_path))
    assert os.path.basename(path) == LOCK_NAME and os.path.isfile(path)
    acquire_output_dir(str(tmp_path))  # re-entrant
    release_output_dir(str(tmp_path))
    assert os.path.isfile(path)  # still held once
    release_output_dir(str(tmp_path))
    assert not os.path.exists(path)
    acquire_output_dir(str(tmp_path))
    release_output_dir(str(tmp_path))
    assert not os.path.exists(path)
