r"""RLDF on DiffusionGemma: transformers' own ``DiffusionGemmaForBlockDiffusion`` (uniform-noise block diffusion, no
mask token), rolled out by ``DiffusionGemmaSampler`` (= ``model.generate`` token for token, every denoising step
recorded) and trained by ``DiffusionGemmaRLDFLoss`` (docs/diffusion_gemma.md).

With no arguments it trains the shipped noisy-teacher DiffusionGemma Sudoku toy for two steps on CPU::

    python examples/rldf_diffusion_gemma.py

``python benchmarks/diffusion_gemma_sudoku.py`` runs the toy's full recipe (100 steps, +0.45 held-out solve rate).
A real run names a checkpoint and a dataset; ``--max_completion_length`` must be whole canvases and
``--block_length`` the model's ``canvas_length`` (256 for the 26B-A4B model). LoRA (``--use_peft``) freezes the
embeddings, where the default self-conditioning carrier is exact, and the trainer ties each encoder adapter to its
decoder twin (the two stacks share their weights). Without ``--lora_target_modules`` the adapters go on the
attention projections of both text stacks (``dllm_trl.models.DIFFUSION_GEMMA_LORA_TARGETS``)::

    accelerate launch --config_file examples/accelerate_configs/deepspeed_zero3.yaml examples/rldf_diffusion_gemma.py \
        --model_name_or_path path/to/diffusion-gemma --dtype bfloat16 --bf16 true \
        --dataset_name math --dataset_split train --max_sequence_length 512 \
        --max_completion_length 256 --block_length 256 --max_denoising_steps 48 \
        --num_generations 8 --per_device_train_batch_size 8 --num_sampled_timesteps 4 \
        --use_peft --lora_r 32 --lora_alpha 64 --learning_rate 1e-5 --lr_scheduler_type constant --beta 0.0 \
        --logging_steps 1 --save_steps 100 --report_to none --output_dir diffusion-gemma-rldf-math

Start with a low learning rate: under the entropy-bounded acceptance the sampled tokens are nearly deterministic, so
the policy gradient is small and mostly noise, which Adam scales up to full-size steps (on the toy, lr 3e-4 ruins the
model within 5 steps; docs/diffusion_gemma.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import ModelConfig, TrlParser, get_peft_config

from dllm_trl import RLDFConfig, RLDFTrainer
from dllm_trl.data import DatasetArguments
from dllm_trl.generation import DiffusionGemmaSampler, DiffusionGemmaSamplerConfig
from dllm_trl.losses import DiffusionGemmaRLDFLoss
from dllm_trl.models import DIFFUSION_GEMMA_LORA_TARGETS, is_diffusion_gemma
from dllm_trl.families import load_model_and_tokenizer, save_trained_model
from dllm_trl.prechecks import check_run_setup
from dllm_trl.rewards import math_reward
from dllm_trl.toy import load_sudoku_diffusion_gemma_noisy_teacher, sudoku_cell_reward, sudoku_dataset
from dllm_trl.toy import toy_training_defaults

SAMPLER_DEFAULTS = DiffusionGemmaSamplerConfig()


@dataclass
class DiffusionGemmaArguments:
    """How the rollout denoises (``DiffusionGemmaSamplerConfig``; its length is ``--max_completion_length``)."""

    max_denoising_steps: int | None = field(
        default=None, metadata={"help": "Denoising steps per canvas (default: the model's generation_config, else 48)."})
    entropy_bound: float = field(default=SAMPLER_DEFAULTS.entropy_bound,
                                 metadata={"help": "Entropy bound of each step's accept set."})
    t_min: float = field(default=SAMPLER_DEFAULTS.t_min, metadata={"help": "Temperature of a canvas's last step."})
    t_max: float = field(default=SAMPLER_DEFAULTS.t_max, metadata={"help": "Temperature of a canvas's first step."})
    self_conditioning: str = field(
        default=SAMPLER_DEFAULTS.self_conditioning,
        metadata={"help": "What the record keeps of the self-conditioning input: 'embedding' (exact with frozen "
                          "embeddings, e.g. LoRA) or 'logits' (exact always, vocabulary-sized).",
                  "choices": ["embedding", "logits"]},
    )

    def sampler_config(self, model, gen_length: int) -> DiffusionGemmaSamplerConfig:
        steps = self.max_denoising_steps or getattr(model.generation_config, "max_denoising_steps", None)
        return DiffusionGemmaSamplerConfig(
            gen_length=gen_length, max_denoising_steps=steps or SAMPLER_DEFAULTS.max_denoising_steps,
            entropy_bound=self.entropy_bound, t_min=self.t_min, t_max=self.t_max,
            self_conditioning=self.self_conditioning)


def make_parser() -> TrlParser:
    parser = TrlParser((DatasetArguments, RLDFConfig, ModelConfig, DiffusionGemmaArguments))
    # The toy's answer is one canvas of 20 tokens; two steps of 4 puzzles x 4 rollouts, no KL (docs/diffusion_gemma.md).
    parser.set_defaults(**toy_training_defaults("outputs/rldf-diffusion-gemma", max_completion_length=20,
                                                block_length=20, beta=0.0))
    return parser


def main():
    data_args, training_args, model_args, gemma_args = make_parser().parse_args_and_config()
    check_run_setup(training_args)

    toy = model_args.model_name_or_path is None
    if toy:
        model, tokenizer = load_sudoku_diffusion_gemma_noisy_teacher()
        model.train()
    else:
        model, tokenizer = load_model_and_tokenizer(model_args)
    if not is_diffusion_gemma(model):
        raise SystemExit(f"--model_name_or_path {model_args.model_name_or_path}: not a DiffusionGemma model; masked "
                         "diffusion LMs train with examples/rldf_math.py.")
    if toy and data_args.dataset_name is None:
        train_dataset, reward = sudoku_dataset("train", size=data_args.train_size), sudoku_cell_reward
    else:
        train_dataset, reward = data_args.load(default_source="math", tokenizer=tokenizer), math_reward

    peft_config = get_peft_config(model_args)
    if peft_config is not None:
        peft_config.task_type = None  # a plain PeftModel: DiffusionGemma has no causal-LM generation API for PEFT
        if not model_args.lora_target_modules:
            peft_config.target_modules = DIFFUSION_GEMMA_LORA_TARGETS
    trainer = RLDFTrainer(
        model=model,
        reward_funcs=reward,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        sampler=DiffusionGemmaSampler(gemma_args.sampler_config(model, training_args.max_completion_length)),
        loss=DiffusionGemmaRLDFLoss(training_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    save_trained_model(trainer, training_args)
    rewards = [round(entry["reward"], 3) for entry in trainer.state.log_history if "reward" in entry]
    print(f"mean reward per logged step: {rewards}")


if __name__ == "__main__":
    main()
