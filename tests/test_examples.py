"""examples/: the accelerate configs parse, every script answers --help, and with no arguments each one runs
on the toy model on CPU (two optimizer steps for the trainers) in a subprocess."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from dllm_trl.toy import load_toy

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CONFIGS = EXAMPLES / "accelerate_configs"
SCRIPTS = ["rldf_math.py", "rldf_code.py", "dppo_mask_math.py", "evaluate.py", "rldf_diffusion_gemma.py"]
TIMEOUT = 240


def run_example(args: list[str], cwd: Path, launcher: list[str] | None = None,
                expected_warning: str | None = None) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = (launcher or [sys.executable]) + args
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    # Python warnings (pin_memory on CPU, DDP's deprecated broadcast_buffers, deprecations) are bugs to fix at
    # their source.
    warnings = re.findall(r"^.*\w+Warning: .*$", output, flags=re.M)
    assert all(expected_warning and expected_warning in w for w in warnings), "\n".join(warnings)
    return output


def assert_saved_model(folder: Path) -> None:
    """``folder`` holds what TRL scripts save after training: a model and tokenizer that load back."""
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    model, tokenizer = load_toy(path=folder)
    assert model.config.mask_token_id == tokenizer.mask_token_id


@pytest.mark.parametrize(
    "name, distributed_type, processes",
    [
        ("single_gpu", "NO", 1),
        ("multi_gpu", "MULTI_GPU", 8),
        ("deepspeed_zero2", "DEEPSPEED", 8),
        ("deepspeed_zero3", "DEEPSPEED", 8),
        ("fsdp", "FSDP", 8),
    ],
)
def test_accelerate_configs(name, distributed_type, processes):
    path = CONFIGS / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text())
    assert raw["distributed_type"] == distributed_type and raw["num_processes"] == processes
    config = load_config_from_file(str(path))  # accelerate's own loader rejects unknown keys
    assert config.distributed_type.value == distributed_type
    if name.startswith("deepspeed"):
        assert config.deepspeed_config["zero_stage"] == int(name[-1])
    if name == "fsdp":
        fsdp = config.fsdp_config
        assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        # The wrapped layer class comes from the model's `_no_split_modules`: one file for LLaDA and Dream alike.
        assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, monkeypatch):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    assert exit_info.value.code == 0
    text = stdout.getvalue()
    for flag in ("--model_name_or_path", "--load_in_4bit", "--use_peft"):
        assert flag in text
    if script.startswith("rldf"):
        assert "--num_sampled_timesteps" in text and "--dataset_name" in text and "--max_sequence_length" in text
    if script == "evaluate.py":
        assert "--gen_lengths" in text and "--unmasking" in text and "--num_samples" in text
        assert "HF_HUB_OFFLINE=1" in text


def docstring_commands(script: str) -> list[list[str]]:
    """The arguments after ``examples/<script>`` of every command in the script's docstring."""
    lines = iter(ast.get_docstring(ast.parse((EXAMPLES / script).read_text())).splitlines())
    commands = []
    for line in lines:
        if not re.match(r" {4}\S", line):
            continue
        while line.endswith("\\"):
            line = line[:-1] + next(lines)
        words = shlex.split(line)
        if f"examples/{script}" in words:
            commands.append(words[words.index(f"examples/{script}") + 1 :])
    return commands


@pytest.mark.parametrize("script", ["rldf_math.py", "rldf_code.py", "evaluate.py"])
def test_docstring_commands_parse(script):
    from trl import ModelConfig, TrlParser

    from dllm_trl import RLDFConfig
    from dllm_trl.data import DatasetArguments
    from dllm_trl.evaluation import EvaluationArguments

    trainer = (DatasetArguments, RLDFConfig, ModelConfig)
    dataclasses = (EvaluationArguments, ModelConfig) if script == "evaluate.py" else trainer
    commands = docstring_commands(script)
    assert commands
    for arguments in commands:
        # argparse level: unknown flags and unparsable values fail; no config object is built (--bf16 needs a GPU).
        TrlParser(dataclasses).parse_args(arguments)


@pytest.mark.parametrize("script", ["rldf_math.py", "rldf_code.py"])
def test_docstring_gives_paper_commands(script):
    doc = ast.get_docstring(ast.parse((EXAMPLES / script).read_text()))
    for needle in ("GSAI-ML/LLaDA-8B-Instruct", "Dream-org/Dream-v0-Instruct-7B", "--beta 0.01", "--beta 0.04",
                   "--learning_rate 1e-6", "--num_sampled_timesteps 16", "--block_length 32",
                   "--unmasking_threshold 0.9", "--clean_target_threshold 0.2", "--num_generations 4",
                   "--max_sequence_length 320", "--max_sequence_length 256", "accelerate launch --config_file"):
        assert needle in doc, needle


def logged_rewards(output: str) -> list:
    match = re.search(r"per logged step: (\[.*\])", output)
    assert match, output[-2000:]
    return ast.literal_eval(match.group(1))


def test_rldf_math_runs_two_toy_steps(tmp_path):
    assert len(logged_rewards(run_example([str(EXAMPLES / "rldf_math.py")], tmp_path))) == 2
    assert_saved_model(tmp_path / "outputs" / "rldf-math")


def test_missing_report_backend_is_named_before_the_model_loads(monkeypatch, capsys):
    import transformers.integrations

    monkeypatch.setattr(transformers.integrations, "get_available_reporting_integrations", lambda: ["wandb"])
    monkeypatch.setattr(sys, "argv", ["rldf_math.py", "--report_to", "tensorboard"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(EXAMPLES / "rldf_math.py"), run_name="__main__")
    assert str(exit_info.value.code) == (
        "error: --report_to tensorboard: not installed; run `pip install tensorboard` or pass --report_to none."
    )
    assert "Loading weights" not in capsys.readouterr().err


def test_rldf_code_runs_two_toy_steps(tmp_path):
    # MBPP prompts are longer than the toy's 64 positions: the sampler says so (the run only checks the plumbing).
    output = run_example([str(EXAMPLES / "rldf_code.py")], tmp_path, expected_warning="max_position_embeddings=64")
    assert logged_rewards(output) == [0.0, 0.0]  # the toy model writes no code


def test_dppo_mask_math_runs_two_toy_steps(tmp_path):
    output = run_example([str(EXAMPLES / "dppo_mask_math.py"), "--output_dir", "my-run"], tmp_path)
    assert_saved_model(tmp_path / "my-run")
    # Its own summary: one dict of plain numbers per logged step (the trainer's log lines hold strings).
    assert len(re.findall(r"^\{'loss': -?\d", output, flags=re.M)) == 2, output[-2000:]


def test_evaluate_runs_on_the_toy(tmp_path):
    output = run_example([str(EXAMPLES / "evaluate.py"), "--num_problems", "32"], tmp_path)
    assert "| toy | dynamic |" in output and "| toy | static |" in output
    assert {p.name for p in (tmp_path / "outputs" / "eval").iterdir()} >= {"results.json", "results.md", "results.png"}


def test_accelerate_launch_single_gpu_config(tmp_path):
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "single_gpu.yaml")]
    output = run_example([str(EXAMPLES / "rldf_math.py"), "--max_steps", "1"], tmp_path, launcher)
    assert len(logged_rewards(output)) == 1


@pytest.mark.parametrize("script", ["rldf_math.py", "dppo_mask_math.py"])
def test_examples_checkpoint_and_resume(tmp_path, script):
    """--save_steps writes checkpoints; --resume_from_checkpoint true continues from the newest (one more step here),
    it does not start again."""
    flags = [str(EXAMPLES / script), "--output_dir", "run", "--save_strategy", "steps", "--save_steps", "1"]
    run_example(flags, tmp_path)
    assert {p.name for p in (tmp_path / "run").iterdir()} >= {"checkpoint-1", "checkpoint-2"}
    output = run_example(flags + ["--max_steps", "3", "--resume_from_checkpoint", "true"], tmp_path)
    assert (tmp_path / "run" / "checkpoint-3").is_dir()
    assert len(re.findall(r"^\{'loss': '", output, flags=re.M)) == 1, output[-3000:]  # step 3 only


def test_rldf_diffusion_gemma_runs_two_toy_steps(tmp_path):
    """No arguments: two RLDF steps of the noisy-teacher DiffusionGemma Sudoku toy; the saved model is transformers'
    DiffusionGemma class again."""
    from dllm_trl.families import load_diffusion_model

    assert len(logged_rewards(run_example([str(EXAMPLES / "rldf_diffusion_gemma.py")], tmp_path))) == 2
    saved = tmp_path / "outputs" / "rldf-diffusion-gemma"
    assert type(load_diffusion_model(str(saved))).__name__ == "DiffusionGemmaForBlockDiffusion"


def test_rldf_diffusion_gemma_lora_run_saves_tied_adapters_that_load_merged(tmp_path):
    """--use_peft: the script's default targets (both text stacks' attention), a plain PeftModel, tied adapters; the
    saved adapter loads (as examples/evaluate.py loads it) into one merged DiffusionGemma."""
    from trl import ModelConfig

    from dllm_trl.families import load_model_and_tokenizer

    output = run_example([str(EXAMPLES / "rldf_diffusion_gemma.py"), "--output_dir", "lora", "--use_peft",
                          "--lora_r", "4", "--lora_alpha", "8", "--max_steps", "1"], tmp_path)
    assert len(logged_rewards(output)) == 1
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert config["task_type"] is None and "decoder" in config["target_modules"]
    model, _ = load_model_and_tokenizer(ModelConfig(model_name_or_path=str(tmp_path / "lora")))
    assert type(model).__name__ == "DiffusionGemmaForBlockDiffusion"


def test_rldf_diffusion_gemma_docstring_commands_parse():
    script = runpy.run_path(str(EXAMPLES / "rldf_diffusion_gemma.py"), run_name="examples")
    commands = docstring_commands("rldf_diffusion_gemma.py")
    assert len(commands) == 2 and any("--use_peft" in c for c in commands)
    for arguments in commands:
        script["make_parser"]().parse_args(arguments)
