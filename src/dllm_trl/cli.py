"""Pieces shared by the main job, the example scripts, the benchmarks and the evaluation CLI."""

from __future__ import annotations

import json
import os
import time

import torch
from accelerate import PartialState
from transformers import AutoTokenizer, TrainerCallback
from trl import ModelConfig

from .models import load_diffusion_model
from .toy import sudoku_generation_config, toy_assets_dir, toy_generation_config

TOY_TRAINING_DEFAULTS = dict(
    max_steps=2, max_completion_length=8, block_length=4, per_device_train_batch_size=4, num_generations=4,
    num_sampled_timesteps=4, learning_rate=1e-4, beta=0.01, temperature=1.0, logging_steps=1, report_to="none",
)
"""Training arguments of the scripts' no-argument run: two RLDF steps of the toy model on CPU. Saving is TRL's
default: checkpoints every ``save_steps`` and at the last step, and the final model in ``output_dir``."""

REPORT_PACKAGES = {"azure_ml": "azureml-core", "comet_ml": "comet-ml", "dagshub": "dagshub mlflow"}
"""``pip install`` names of the ``--report_to`` backends not installed under their own name."""


def toy_training_defaults(output_dir: str, **overrides) -> dict:
    """:data:`TOY_TRAINING_DEFAULTS` for a script writing to ``output_dir``: bf16 where the GPU has it natively, or
    where the accelerate config asks for it (a DeepSpeed config's bf16 must agree with the training arguments')."""
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION")
    native_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    bf16 = launcher == "bf16" if launcher else native_bf16
    return {**TOY_TRAINING_DEFAULTS, "output_dir": output_dir, "bf16": bf16, **overrides}


def check_report_backends(training_args) -> None:
    """Stop before any model loads when a ``--report_to`` backend is not installed, naming its install command
    (transformers would fail later, at trainer creation)."""
    from transformers.integrations import get_available_reporting_integrations

    available = set(get_available_reporting_integrations())
    missing = [name for name in training_args.report_to if name not in available]
    if missing:
        packages = " ".join(REPORT_PACKAGES.get(name, name) for name in missing)
        raise SystemExit(
            f"error: --report_to {' '.join(missing)}: not installed; run `pip install {packages}` "
            "or pass --report_to none."
        )


def save_trained_model(trainer, training_args) -> None:
    """What a TRL script does after ``train()``: the final model (and tokenizer) in ``output_dir``, pushed to
    the Hub with ``--push_to_hub``."""
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub()
    if trainer.accelerator.is_main_process:
        print(f"saved the trained model to {training_args.output_dir}")


def model_init_kwargs(model_args: ModelConfig, device: str | int | None = None) -> dict:
    """``from_pretrained`` keyword arguments that ``--dtype``, ``--attn_implementation``, ``--model_revision`` and
    ``--load_in_4bit`` / ``--load_in_8bit`` (bitsandbytes, placed on ``device`` or on this process's device) ask for."""
    quantization_config = None
    if model_args.load_in_4bit or model_args.load_in_8bit:
        from trl import get_quantization_config  # imports PEFT and bitsandbytes: only when quantising

        quantization_config = get_quantization_config(model_args)
    placement = device if device is not None else PartialState().local_process_index
    if not torch.accelerator.is_available():
        placement = "cpu"
    kwargs = dict(revision=model_args.model_revision, dtype=model_args.dtype,
                  attn_implementation=model_args.attn_implementation)
    if quantization_config is not None:
        # A quantised model cannot be moved after loading: place it now.
        kwargs.update(quantization_config=quantization_config, device_map={"": placement})
    return kwargs


def check_trainable(model_args: ModelConfig) -> None:
    """Quantised weights cannot be trained: 4-/8-bit loading is QLoRA, i.e. a LoRA adapter on top (``--use_peft``)."""
    if (model_args.load_in_4bit or model_args.load_in_8bit) and not model_args.use_peft:
        flag = "--load_in_4bit" if model_args.load_in_4bit else "--load_in_8bit"
        raise ValueError(f"{flag} quantises the base weights, which cannot be trained: add --use_peft (QLoRA).")


def load_model_and_tokenizer(model_args: ModelConfig, device: str | None = None):
    """The diffusion LM named by ``--model_name_or_path`` (the shipped toy checkpoint when none is named) and its
    tokenizer, loaded as :func:`model_init_kwargs` says.

    A LoRA adapter folder loads on top of its base model (merged unless quantised). With ``device`` the model is
    moved there and put in eval mode, ready for decoding; without, it is ready for training.
    """
    path = model_args.model_name_or_path or str(toy_assets_dir())
    if device is None:
        check_trainable(model_args)
    load_kwargs = model_init_kwargs(model_args, device)
    quantized = "quantization_config" in load_kwargs
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        from peft import PeftConfig, PeftModel

        base = PeftConfig.from_pretrained(path).base_model_name_or_path
        model = PeftModel.from_pretrained(load_diffusion_model(base, **load_kwargs), path)
        if not quantized:
            model = model.merge_and_unload()
    else:
        model = load_diffusion_model(path, **load_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision, padding_side="left")
    if device is None:
        return model, tokenizer
    if not quantized:
        model = model.to(device)
    return model.eval(), tokenizer


def toy_rldf_config(output_dir: str, **overrides):
    """RLDF settings that improve the toy model on CPU (the main job's and the estimator benchmark's):
    the toy sampler settings, 4 prompts x 8 generations per step, k = 4, β = 0, constant lr 3e-5."""
    from .trainers import RLDFConfig  # imports TRL's trainers and PEFT: only for the scripts that train

    gen = toy_generation_config()
    values = dict(
        output_dir=output_dir, max_completion_length=gen.gen_length, block_length=gen.block_length,
        unmasking_threshold=gen.threshold, cache_mode="dual", temperature=1.0, num_generations=8,
        per_device_train_batch_size=32, num_sampled_timesteps=4, beta=0.0, learning_rate=3e-5,
        lr_scheduler_type="constant", max_steps=60, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, gradient_checkpointing=False,
    )
    values.update(overrides)
    return RLDFConfig(**values)


def sudoku_rldf_config(output_dir: str, *, config_class=None, **overrides):
    """RLDF settings of the main job on the Sudoku toy (and the base of the Sudoku benchmarks): the toy's sampler
    (20 positions in one block, one cell per step, dual cache) at temperature 1, 4 puzzles x 8 generations per step,
    k = 4, β = 0, constant learning rate (see docs/main_job.md for the sweep).

    ``config_class`` is :class:`~dllm_trl.trainers.RLDFConfig` by default; a subclass (``DPPOMaskConfig``) takes the
    same settings plus its own fields from ``overrides``."""
    from .trainers import RLDFConfig

    config_class = config_class or RLDFConfig
    gen = sudoku_generation_config()
    values = dict(
        output_dir=output_dir, max_completion_length=gen.gen_length, block_length=gen.block_length,
        unmasking=gen.unmasking, diffusion_steps=gen.steps, cache_mode="dual", temperature=1.0, num_generations=8,
        per_device_train_batch_size=32, num_sampled_timesteps=4, beta=0.0, learning_rate=1e-4,
        lr_scheduler_type="constant", max_steps=150, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, gradient_checkpointing=False, dataloader_pin_memory=False,
    )
    values.update(overrides)
    return config_class(**values)


class RewardProgressBar(TrainerCallback):
    """One tqdm bar in place of transformers' progress bar and log printer: the mean rollout reward (moving average
    over ``window`` steps), the moving averages of the logged metrics named in ``shown`` (label → metric key), the
    held-out accuracy whenever ``evaluate(model)`` runs (every ``eval_steps``), and seconds per step.

    TRL's full metric dicts still reach the ``report_to`` backends, and go one JSON object per line to
    ``metrics_path``; ``accuracies`` collects ``(step, accuracy)`` of the evaluations during training.
    """

    def __init__(self, evaluate=None, eval_steps: int = 0, metrics_path: str | None = None, initial_accuracy=None,
                 window: int = 10, description: str = "RLDF", shown: dict | None = None):
        self.evaluate, self.eval_steps, self.metrics_path, self.window = evaluate, eval_steps, metrics_path, window
        self.description = description
        self.accuracies: list[tuple[int, float]] = []
        self.rewards: list[float] = []
        self.shown = {"reward": "reward", **(shown or {})}
        self.history: dict[str, list[float]] = {label: [] for label in self.shown}
        self.postfix = {} if initial_accuracy is None else {"acc": f"{initial_accuracy:.3f}"}
        self.bar = None
        self._step_start = time.perf_counter()

    def install(self, trainer):
        """Replace the trainer's own progress bar / log printer by this callback."""
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        trainer.remove_callback(ProgressCallback)
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(self)
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from tqdm.auto import tqdm

        if self.metrics_path:
            open(self.metrics_path, "w").close()
        self.bar = tqdm(total=state.max_steps, desc=self.description, dynamic_ncols=True, unit="step")

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        seconds = time.perf_counter() - self._step_start
        if (self.evaluate is not None and self.eval_steps and state.global_step % self.eval_steps == 0
                and state.global_step < state.max_steps):
            accuracy = self.evaluate(model)
            self.accuracies.append((state.global_step, accuracy))
            self.postfix["acc"] = f"{accuracy:.3f}"
        self.postfix["s/step"] = f"{seconds:.2f}"
        if self.bar is not None:
            self.bar.set_postfix(self.postfix, refresh=False)
            self.bar.update(1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "reward" in logs:
            self.rewards.append(logs["reward"])
            averages = {}
            for label, key in self.shown.items():
                if key in logs:
                    self.history[label].append(logs[key])
                    recent = self.history[label][-self.window:]
                    averages[label] = f"{sum(recent) / len(recent):.3f}"
            self.postfix = {**averages, **{k: v for k, v in self.postfix.items() if k not in averages}}
        if self.metrics_path and state.is_world_process_zero:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps({"step": state.global_step, **logs}) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
