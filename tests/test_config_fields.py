"""Every GRPOConfig field is either honoured by the diffusion trainers or refused when set (never silently ignored),
and the config's messages name the user's field."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import TrainingArguments
from trl import GRPOConfig

from dllm_trl.generation import draw_candidates
from dllm_trl.trainers import DPPOMaskConfig, RLDFConfig, RLDFTrainer
from dllm_trl.trainers.rldf_config import GRPO_FIELDS_KEPT, GRPO_FIELDS_REFUSED

from .conftest import addition_dataset, length_reward, make_char_tokenizer, tiny_training_args
from .test_rldf_trainer import make_trainer

TRAINING_FIELDS = {f.name for f in dataclasses.fields(TrainingArguments)}
GRPO_FIELDS = {f.name: f for f in dataclasses.fields(GRPOConfig) if f.name not in TRAINING_FIELDS}


def default(field):
    return field.default if field.default is not dataclasses.MISSING else field.default_factory()


def other_value(name, value):
    """A value of the field's kind that is not its default."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        return {"loss_type": "grpo", "vllm_mode": "server", "vllm_model_impl": "transformers",
                "importance_sampling_level": "sequence", "vllm_importance_sampling_mode": "token_mask",
                "vllm_server_host": "127.0.0.1"}[name]
    assert value is None, (name, value)
    return {"generation_kwargs": {"do_sample": True}, "transformers_continuous_batching_config": {},
            "cache_implementation": "static", "vllm_server_base_url": "http://127.0.0.1:8000",
            "vllm_structured_outputs_regex": "a+"}.get(name, 2)


def test_every_grpo_field_is_kept_or_refused():
    kept, refused = set(GRPO_FIELDS_KEPT), set(GRPO_FIELDS_REFUSED)
    assert not kept & refused
    assert kept | refused == set(GRPO_FIELDS), f"decide: {set(GRPO_FIELDS) - kept - refused}; stale: {kept | refused - set(GRPO_FIELDS)}"


@pytest.mark.parametrize("name", sorted(GRPO_FIELDS_REFUSED))
def test_refused_fields_name_themselves(tmp_path, name):
    value = other_value(name, default(GRPO_FIELDS[name]))
    with pytest.raises(ValueError, match=rf"{name}=") as error:
        tiny_training_args(RLDFConfig, tmp_path, **{name: value})
    assert "not supported" in str(error.value)


def test_dppo_config_honours_loss_type_and_refuses_clipping(tmp_path):
    config = tiny_training_args(DPPOMaskConfig, tmp_path, loss_type="grpo", num_sampled_timesteps=2)
    assert config.loss_type == "grpo"
    for name, value in (("epsilon", 0.3), ("epsilon_high", 0.3), ("delta", 2.0), ("entropy_coef", 0.1)):
        with pytest.raises(ValueError, match=rf"{name}=.*divergence|{name}=.*entropy"):
            tiny_training_args(DPPOMaskConfig, tmp_path, num_sampled_timesteps=2, **{name: value})


@pytest.mark.parametrize("field, value, message", [
    ("unmasking_threshold", 1.5, "unmasking_threshold=1.5"),
    ("diffusion_steps", 3, "diffusion_steps=3"),
])
def test_sampler_errors_name_the_config_field(tmp_path, field, value, message):
    extra = {"unmasking": "static"} if field == "diffusion_steps" else {}
    with pytest.raises(ValueError, match=message):
        tiny_training_args(RLDFConfig, tmp_path, **{field: value}, **extra)


def test_min_p_truncates_like_its_definition():
    """min_p keeps the tokens whose probability is at least min_p times the largest (after temperature)."""
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    _, _, log_probs = draw_candidates(logits, mask_token_id=0, temperature=0.8, top_p=None, top_k=None,
                                      sampling="categorical", generator=None, min_p=0.1)
    scaled = (logits / 0.8).index_fill(-1, torch.tensor([0]), -math.inf)
    probs = scaled.softmax(-1)
    keep = probs >= 0.1 * probs.max(-1, keepdim=True).values
    expected = torch.where(keep, scaled, -math.inf).log_softmax(-1)
    assert (keep.sum(-1) < 40).all() and (keep.sum(-1) > 1).any()
    torch.testing.assert_close(log_probs, expected)


def test_mask_truncated_completions_drops_rows_without_eos(tmp_path):
    """As TRL: a completion that never reached EOS (truncated) gets no loss; the others keep theirs."""
    from .test_rldf_loss import prepare_batch

    trainer = make_trainer(tmp_path, beta=0.0, mask_truncated_completions=True)
    eos = trainer.processing_class.eos_token_id
    rows, gen = 4, trainer.args.max_completion_length
    rollout = torch.full((rows, gen), 5)
    rollout[:2, 3] = eos  # rows 0, 1 end; rows 2, 3 are truncated
    batch = {
        "rollout_prompt_ids": torch.full((rows, 3), 6), "rollout_prompt_mask": torch.ones(rows, 3, dtype=torch.long),
        "rollout_ids": rollout, "commit_step": torch.arange(gen).repeat(rows, 1),
        "valid_mask": torch.ones(rows, gen, dtype=torch.long), "sampled_steps": torch.tensor([[0, 2, -1, -1]] * rows),
        "advantages": torch.tensor([1.0, -1.0, 1.0, -1.0]),
    }
    inputs = prepare_batch(trainer, batch, trajectory_keys=[k for k in batch if k != "advantages"])
    assert (inputs["sampled_steps"][2:] == -1).all() and (inputs["sampled_steps"][:2] != -1).any()
    assert not inputs["valid_mask"][2:].any()


def test_training_inputs_are_checked_up_front(tmp_path):
    from datasets import Dataset

    with pytest.raises(ValueError, match="empty"):
        make_trainer_with(tmp_path, Dataset.from_dict({"prompt": []}))
    with pytest.raises(ValueError, match="no 'prompt' column"):
        make_trainer_with(tmp_path, Dataset.from_dict({"question": ["1+1="]}))
    tokenizer = make_char_tokenizer()
    tokenizer.add_special_tokens({"mask_token": "<bos>"})  # a different mask token than the model's
    with pytest.raises(ValueError, match="mask token"):
        make_trainer_with(tmp_path, addition_dataset(), tokenizer)


def make_trainer_with(tmp_path, dataset, tokenizer=None):
    from tests.tiny_models import build_tiny_llada

    reference = make_char_tokenizer()
    model = build_tiny_llada(vocab_size=len(reference), mask_token_id=reference.mask_token_id,
                             eos_token_id=reference.eos_token_id)
    return RLDFTrainer(model=model, reward_funcs=length_reward, args=tiny_training_args(RLDFConfig, tmp_path),
                       train_dataset=dataset, processing_class=tokenizer or reference)


def test_dppo_on_a_diffusion_lm_refuses_loss_type(tmp_path):
    from tests.tiny_models import build_tiny_llada
    from dllm_trl.trainers import DPPOMaskTrainer

    tokenizer = make_char_tokenizer()
    model = build_tiny_llada(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    args = tiny_training_args(DPPOMaskConfig, tmp_path, loss_type="grpo", num_sampled_timesteps=2, divergence_top_k=4)
    with pytest.raises(ValueError, match="loss_type='grpo'.*loss_normalization"):
        DPPOMaskTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=addition_dataset(),
                        processing_class=tokenizer)


@pytest.mark.parametrize("config_class", [RLDFConfig, DPPOMaskConfig])
@pytest.mark.parametrize("key, value", [("every_n_layers", 2), ("offload", True)])
def test_checkpointing_kwargs_lost_at_the_first_rollout_are_refused(tmp_path, config_class, key, value):
    """TRL turns checkpointing off for each rollout and back on with ``gradient_checkpointing_kwargs`` handed to
    ``torch.utils.checkpoint`` as they are: transformers' ``every_n_layers``/``offload`` would hold for the first
    rollout only (then every layer is checkpointed, without offload)."""
    with pytest.raises(ValueError, match=f"gradient_checkpointing_kwargs.*{key}"):
        tiny_training_args(config_class, tmp_path, gradient_checkpointing_kwargs={"use_reentrant": False, key: value})
    for harmless in ({key: {"every_n_layers": 1, "offload": False}[key]}, {"use_reentrant": True}, None):
        tiny_training_args(config_class, tmp_path, gradient_checkpointing_kwargs=harmless)
