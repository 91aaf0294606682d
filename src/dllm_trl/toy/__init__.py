"""The embedded toy model, tokenizer and task: two-number addition (``"37+45="`` → ``"82"``).

One call gives a partly competent masked-diffusion LM and its tokenizer::

    from dllm_trl.toy import load_toy, toy_dataset, toy_reward, toy_generation_config, evaluate_accuracy

    model, tokenizer = load_toy()
    print(evaluate_accuracy(model, tokenizer, toy_dataset("test"))["accuracy"])

``python -m dllm_trl.toy`` decodes the held-out split and prints accuracy and tokens/s. The checkpoint is
produced by ``scripts/pretrain_toy.py``.
"""

from .configs import TOY_TRAINING_DEFAULTS, sudoku_rldf_config, sudoku_rldf_settings, toy_rldf_config
from .configs import toy_training_defaults
from .evaluate import evaluate_accuracy, main
from .evaluate import evaluate_causal_accuracy, evaluate_diffusion_gemma_accuracy
from .model import SUDOKU_GEN_LENGTH, TOY_GEN_LENGTH, TOY_MODEL_SHAPE, load_sudoku, load_sudoku_causal, load_toy
from .model import SUDOKU_DIFFUSION_GEMMA_SHAPE, SUDOKU_DIFFUSION_GEMMA_STEPS, load_sudoku_diffusion_gemma
from .model import load_sudoku_diffusion_gemma_noisy_teacher, load_sudoku_noisy_teacher
from .model import sudoku_diffusion_gemma_sampler_config
from .model import sudoku_generation_config, toy_assets_dir, toy_generation_config
from .sudoku import noisy_teacher_problems, sudoku_cell_reward, sudoku_dataset, sudoku_problems, sudoku_reward
from .sudoku import sudoku_up_to_relabelling_reward
from .task import TEST_SIZE, completion_text, toy_dataset, toy_problems, toy_reward
from .tokenizer import CHAT_TEMPLATE, build_toy_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "SUDOKU_DIFFUSION_GEMMA_SHAPE",
    "SUDOKU_DIFFUSION_GEMMA_STEPS",
    "SUDOKU_GEN_LENGTH",
    "TEST_SIZE",
    "TOY_GEN_LENGTH",
    "TOY_MODEL_SHAPE",
    "TOY_TRAINING_DEFAULTS",
    "build_toy_tokenizer",
    "completion_text",
    "evaluate_accuracy",
    "evaluate_causal_accuracy",
    "evaluate_diffusion_gemma_accuracy",
    "load_sudoku",
    "load_sudoku_causal",
    "load_sudoku_diffusion_gemma",
    "load_sudoku_diffusion_gemma_noisy_teacher",
    "load_sudoku_noisy_teacher",
    "load_toy",
    "main",
    "noisy_teacher_problems",
    "sudoku_cell_reward",
    "sudoku_dataset",
    "sudoku_diffusion_gemma_sampler_config",
    "sudoku_generation_config",
    "sudoku_problems",
    "sudoku_reward",
    "sudoku_rldf_config",
    "sudoku_rldf_settings",
    "sudoku_up_to_relabelling_reward",
    "toy_assets_dir",
    "toy_dataset",
    "toy_generation_config",
    "toy_problems",
    "toy_reward",
    "toy_rldf_config",
    "toy_training_defaults",
]
