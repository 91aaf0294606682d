"""Predictive divergence-mask RL (DPPOMaskTrainer) on math, for masked diffusion LMs and causal LMs.

With no arguments it trains the toy addition model of ``dllm_trl.toy`` for two steps on CPU::

    python examples/dppo_mask_math.py                        # toy diffusion LM
    python examples/dppo_mask_math.py --model_kind causal    # tiny random Qwen2 causal LM, same task
    python examples/dppo_mask_math.py --mask_direction ratio # DPPO-TopK-KL, the paper's baseline

Real runs name a checkpoint and a math dataset (a preset such as ``math`` or ``gsm8k``, a Hub dataset or a local
json/jsonl/parquet/csv file; rewarded by the last ``\\boxed{}``), and override the toy-sized defaults set below,
e.g.::

    python examples/dppo_mask_math.py --model_name_or_path GSAI-ML/LLaDA-8B-Instruct --dtype bfloat16 \\
        --dataset_name math --max_completion_length 256 --block_length 32 --divergence_top_k 20 \\
        --max_steps 200 --per_device_train_batch_size 8 --learning_rate 1e-6 --bf16 true

The final model is saved to ``--output_dir``.
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config

from dllm_trl.prechecks import check_run_setup
from dllm_trl.data import DatasetArguments
from dllm_trl.families import check_trainable, load_model_and_tokenizer, model_init_kwargs, save_trained_model
from dllm_trl.rewards import math_reward
from dllm_trl.toy import build_toy_tokenizer, toy_assets_dir, toy_dataset, toy_reward, toy_training_defaults
from dllm_trl.trainers import DPPOMaskConfig, DPPOMaskTrainer


def toy_causal_model():
    """A tiny random Qwen2 causal LM with the toy tokenizer."""
    tokenizer = build_toy_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=False, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config), tokenizer


def main():
    parser = TrlParser((DatasetArguments, DPPOMaskConfig, ModelConfig))
    parser.set_defaults(
        **toy_training_defaults("outputs/dppo-mask-math", per_device_train_batch_size=8, learning_rate=1e-5,
                                divergence_top_k=8)
    )
    data_args, args, model_args = parser.parse_args_and_config()
    check_run_setup(args)

    check_trainable(model_args)
    if model_args.model_name_or_path:
        model = model_args.model_name_or_path  # the trainer loads it as args.model_kind says
        args.model_init_kwargs = model_init_kwargs(model_args)
        tokenizer = AutoTokenizer.from_pretrained(model, revision=model_args.model_revision, padding_side="left")
    elif args.model_kind != "causal":
        model_args.model_name_or_path = str(toy_assets_dir())  # the shipped toy checkpoint
        model, tokenizer = load_model_and_tokenizer(model_args)
    elif get_quantization_config(model_args) is not None:
        raise ValueError("--load_in_4bit / --load_in_8bit quantise a checkpoint at load; the toy causal LM is built "
                         "in memory: name a causal checkpoint with --model_name_or_path.")
    else:
        model, tokenizer = toy_causal_model()
    if data_args.dataset_name:
        dataset, reward = data_args.load(default_source="math", tokenizer=tokenizer), math_reward
    else:
        dataset, reward = toy_dataset("train", size=data_args.train_size), toy_reward

    trainer = DPPOMaskTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    print(f"model kind: {trainer.model_kind}, mask: {args.mask_rule} / {args.divergence}, "
          f"K={args.divergence_top_k}, δ={args.divergence_threshold}")
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    save_trained_model(trainer, args)
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print({k: round(v, 4) for k, v in entry.items() if k == "loss" or k == "reward" or k.startswith("dppo/")})


if __name__ == "__main__":
    main()
