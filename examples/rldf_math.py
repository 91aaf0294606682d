r"""RLDF (paper 1) on math with a masked diffusion LM; the reward is the last ``\boxed{}`` against the answer.

With no arguments it trains the shipped toy diffusion LM on the toy addition task for two steps on CPU::

    python examples/rldf_math.py

The defaults below are toy-sized; real runs name a checkpoint and set the paper's values. Paper 1 App. C for
LLaDA-8B-Instruct on MATH (8 GPUs; 8 prompts × 4 completions per optimizer step; one update per rollout, i.e.
REINFORCE; k = 16 sampled timesteps at τ = 1; clean-target threshold 0.2; blocks of 32 with dynamic unmasking
at 0.9; generation length 256; problems of at most 320 tokens; groups with equal rewards dropped)::

    accelerate launch --config_file examples/accelerate_configs/deepspeed_zero2.yaml examples/rldf_math.py \
        --model_name_or_path GSAI-ML/LLaDA-8B-Instruct --dtype bfloat16 --bf16 true --gradient_checkpointing \
        --dataset_name math --dataset_split train \
        --max_completion_length 256 --block_length 32 --unmasking dynamic --unmasking_threshold 0.9 \
        --cache_mode dual --num_generations 4 --per_device_train_batch_size 4 --gradient_accumulation_steps 1 \
        --num_iterations 1 --num_sampled_timesteps 16 --timestep_temperature 1.0 --clean_target_threshold 0.2 \
        --drop_zero_variance_groups true --learning_rate 1e-6 --lr_scheduler_type constant --temperature 1.0 \
        --logging_steps 1 --save_steps 100 --report_to none \
        --beta 0.01 --max_sequence_length 320 --output_dir llada-8b-rldf-math

Dream-7B-Instruct: β = 0.04 and problems of at most 256 tokens (it samples categorically, LLaDA with Gumbel-max;
each model's default)::

    accelerate launch --config_file examples/accelerate_configs/deepspeed_zero2.yaml examples/rldf_math.py \
        --model_name_or_path Dream-org/Dream-v0-Instruct-7B --dtype bfloat16 --bf16 true --gradient_checkpointing \
        --dataset_name math --dataset_split train \
        --max_completion_length 256 --block_length 32 --unmasking dynamic --unmasking_threshold 0.9 \
        --cache_mode dual --num_generations 4 --per_device_train_batch_size 4 --gradient_accumulation_steps 1 \
        --num_iterations 1 --num_sampled_timesteps 16 --timestep_temperature 1.0 --clean_target_threshold 0.2 \
        --drop_zero_variance_groups true --learning_rate 1e-6 --lr_scheduler_type constant --temperature 1.0 \
        --logging_steps 1 --save_steps 100 --report_to none \
        --beta 0.04 --max_sequence_length 256 --output_dir dream-7b-rldf-math

On one GPU use ``examples/accelerate_configs/single_gpu.yaml`` with ``--gradient_accumulation_steps 8`` (the same
8 × 4 rollout per optimizer step). The paper does not state a step count (Dream converges in about 100 steps).
Paper 1 also trains only on the MATH problems LLaDA solves at least once in 16 samples; this script does not
make that selection (pass such a subset as a file to ``--dataset_name``).

LoRA and 4-bit loading use TRL's flags, e.g. ``--use_peft --lora_r 32 --lora_alpha 64 --lora_target_modules
all-linear --load_in_4bit``; LoRA usually wants a larger learning rate than 1e-6.
"""

from __future__ import annotations

from trl import ModelConfig, TrlParser, get_peft_config

from dllm_trl import RLDFConfig, RLDFTrainer
from dllm_trl.prechecks import check_run_setup
from dllm_trl.data import DatasetArguments
from dllm_trl.families import load_model_and_tokenizer, save_trained_model
from dllm_trl.rewards import math_reward
from dllm_trl.toy import toy_assets_dir, toy_dataset, toy_reward, toy_training_defaults


def main():
    parser = TrlParser((DatasetArguments, RLDFConfig, ModelConfig))
    parser.set_defaults(**toy_training_defaults("outputs/rldf-math"))
    data_args, training_args, model_args = parser.parse_args_and_config()
    check_run_setup(training_args)

    toy = model_args.model_name_or_path is None
    if toy:  # no model named: the shipped toy checkpoint
        model_args.model_name_or_path = str(toy_assets_dir())
    model, tokenizer = load_model_and_tokenizer(model_args)
    if toy and data_args.dataset_name is None:
        train_dataset, reward = toy_dataset("train", size=data_args.train_size), toy_reward
    else:
        train_dataset, reward = data_args.load(default_source="math", tokenizer=tokenizer), math_reward

    trainer = RLDFTrainer(
        model=model,
        reward_funcs=reward,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    save_trained_model(trainer, training_args)
    rewards = [round(entry["reward"], 3) for entry in trainer.state.log_history if "reward" in entry]
    print(f"mean reward per logged step: {rewards}")


if __name__ == "__main__":
    main()
