"""The README's main job: RLDF on the Sudoku toy raises the held-out greedy solve rate (slow, ~5 min)."""

import dataclasses
import json

import pytest
import torch

from dllm_trl.__main__ import main, main_job_settings, moving_average, parse_args


def test_moving_average_is_a_trailing_mean():
    assert moving_average([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]


def test_flags_are_trl_style_with_hyphenated_aliases(capsys):
    args, config, _ = parse_args(["--output_dir", "a", "--max-steps", "3", "--learning_rate", "1e-4", "--skip_eval"])
    assert (config.output_dir, config.max_steps, config.learning_rate, args.skip_eval) == ("a", 3, 1e-4, True)
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help_text = capsys.readouterr().out
    assert f"(default: {main_job_settings()['max_steps']})" in help_text  # the help shows every default
    for flag in ("--output_dir", "--model_name_or_path", "--max_steps", "--max-steps", "--learning_rate",
                 "--num_generations", "--prompts_per_step", "--num_sampled_timesteps", "--beta", "--temperature",
                 "--eval_size", "--reward", "--eval_steps", "--skip_eval", "--seed", "--report_to", "--save_model",
                 "--config", "--use_peft", "--lora_r", "--lora_alpha", "--model_revision", "--load_in_4bit"):
        assert f"{flag} " in help_text, flag
    with pytest.raises(SystemExit):
        parse_args(["--eval_size", "0"])
    assert "--skip_eval" in capsys.readouterr().err


def test_no_flags_give_the_trainer_the_settings_of_the_argparse_job():
    """The values the job's former argparse command line passed to ``sudoku_rldf_config`` when given no flag, written
    out, reach RLDFConfig unchanged (eval_steps now holds the job's evaluation interval; TRL's evaluation stays off)."""
    from dllm_trl.trainers import RLDFConfig

    args, config, _ = parse_args([])
    before = RLDFConfig(
        output_dir="outputs/sudoku-rldf", max_completion_length=20, block_length=20, unmasking="static",
        diffusion_steps=20, cache_mode="dual", temperature=1.0, num_generations=8, per_device_train_batch_size=64,
        num_sampled_timesteps=4, beta=0.0, learning_rate=1e-4, lr_scheduler_type="constant", max_steps=150,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
        dataloader_pin_memory=False, seed=0, reward_weights=[0.0, 1.0],
    )
    for f in dataclasses.fields(RLDFConfig):
        expected = 50 if f.name == "eval_steps" else getattr(before, f.name)
        assert getattr(config, f.name) == expected, f.name
    assert config.eval_strategy == "no"
    assert dataclasses.asdict(args) == dict(prompts_per_step=8, eval_size=200, reward="cell", skip_eval=False,
                                            save_model=False, threads=None)


def test_yaml_config_sits_between_the_job_defaults_and_the_command_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("learning_rate: 3.0e-4\nmax_steps: 7\nreward: solve\nsave_steps: 5\n")
    args, config, _ = parse_args(["--config", str(path), "--max-steps", "9", "--resume_from_checkpoint", "ckpt"])
    assert (config.learning_rate, config.max_steps, config.save_steps) == (3e-4, 9, 5)
    assert (args.reward, config.reward_weights, config.resume_from_checkpoint) == ("solve", [1.0, 0.0], "ckpt")
    assert config.lr_scheduler_type == "constant" and config.num_sampled_timesteps == 4  # the job's, not TRL's


def test_the_batch_counts_puzzles_or_completions():
    args, config, _ = parse_args(["--num_generations", "4", "--prompts_per_step", "2"])
    assert (args.prompts_per_step, config.per_device_train_batch_size) == (2, 8)
    args, config, _ = parse_args(["--per_device_train_batch_size", "16"])
    assert (args.prompts_per_step, config.num_generations, config.per_device_train_batch_size) == (2, 8, 16)
    args, config, _ = parse_args(["--reward_weights", "1", "0"])
    assert (args.reward, config.reward_weights) == ("solve", [1.0, 0.0])
    with pytest.raises(SystemExit):
        parse_args(["--per_device_train_batch_size", "12"])  # not a whole number of groups of 8
    with pytest.raises(SystemExit):
        parse_args(["--eval_steps", "2.5"])


def test_main_job_runs_with_evaluation_skipped(tmp_path, capsys):
    summary = main(["--output_dir", str(tmp_path), "--max_steps", "1", "--prompts_per_step", "1",
                    "--num_generations", "4", "--skip_eval"])
    assert summary["accuracy_before"] is None and summary["accuracy_after"] is None and len(summary["rewards"]) == 1
    assert (tmp_path / "reward_curve.png").stat().st_size > 0 and (tmp_path / "summary.json").is_file()
    assert not (tmp_path / "_dllm_trl.lock").exists()  # a clean exit leaves no lock file behind
    out = capsys.readouterr()
    assert "evaluation skipped" in out.out
    # The console shows the bar and the closing lines, not TRL's metric dicts: those go to log_history.jsonl.
    assert "'loss'" not in out.out + out.err and "rewards/sudoku_reward/mean" not in out.out + out.err
    logged = [json.loads(line) for line in (tmp_path / "log_history.jsonl").read_text().splitlines()]
    assert any("rewards/sudoku_reward/mean" in entry and "loss" in entry for entry in logged)


def test_main_job_trains_the_checkpoint_it_is_given(tmp_path):
    """--model_name_or_path: a checkpoint written like the shipped one (here: the shipped one with its output layer
    zeroed, so it writes no grid) is the one evaluated and trained."""
    from dllm_trl.toy import load_sudoku_noisy_teacher

    model, tokenizer = load_sudoku_noisy_teacher()
    with torch.no_grad():
        model.lm_head.weight.zero_()
    checkpoint = tmp_path / "checkpoint"
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    args = ["--max_steps", "1", "--prompts_per_step", "1", "--num_generations", "4", "--eval_size", "32",
            "--eval_steps", "0"]
    shipped = main(["--output_dir", str(tmp_path / "shipped"), *args])
    given = main(["--output_dir", str(tmp_path / "given"), "--model_name_or_path", str(checkpoint), *args])
    assert given["settings"]["model_name_or_path"] == str(checkpoint)
    assert shipped["accuracy_before"] > 0 and given["accuracy_before"] == 0


def test_main_job_trains_a_lora_adapter_with_trls_model_flags(tmp_path):
    """--use_peft / --lora_r (TRL's ModelConfig flags, as in the examples): the job trains LoRA weights only."""
    summary = main(["--output_dir", str(tmp_path), "--max_steps", "1", "--prompts_per_step", "1",
                    "--num_generations", "4", "--skip_eval", "--use_peft", "--lora_r", "4", "--lora_alpha", "8",
                    "--lora_target_modules", "q_proj", "v_proj", "--save_model"])
    assert summary["settings"]["use_peft"] is True and len(summary["rewards"]) == 1
    adapter = json.loads((tmp_path / "model" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]


def test_main_job_flags_reward_eval_steps_and_report_to_take_effect(tmp_path):
    """--reward solve trains on the binary reward, --eval_steps evaluates during training, --report_to reaches the
    tracker (TensorBoard writes event files). On the clean checkpoint, whose grids often earn partial credit (the
    job's noisy-teacher one mostly scores 0 or 1 on both rewards, which would not tell them apart)."""
    from dllm_trl.toy import toy_assets_dir

    summary = main(["--output_dir", str(tmp_path), "--model_name_or_path", str(toy_assets_dir("sudoku")),
                    "--max_steps", "3", "--prompts_per_step", "2",
                    "--num_generations", "4", "--eval_size", "8", "--eval_steps", "1", "--reward", "solve",
                    "--report_to", "tensorboard"])
    # every step but the last, which the closing evaluation covers
    assert [step for step, _ in summary["accuracy_during_training"]] == [1, 2]
    assert all(0.0 <= accuracy <= 1.0 for _, accuracy in summary["accuracy_during_training"])
    logged = [json.loads(line) for line in (tmp_path / "log_history.jsonl").read_text().splitlines()]
    steps = [entry for entry in logged if "reward" in entry]
    assert len(steps) == 3
    for entry in steps:  # the trained reward is the binary one (weights 1, 0), the cell reward is only logged
        assert entry["reward"] == pytest.approx(entry["rewards/sudoku_reward/mean"])
    assert any(entry["reward"] != entry["rewards/sudoku_cell_reward/mean"] for entry in steps)
    assert list(tmp_path.rglob("events.out.tfevents.*")), "no TensorBoard event file was written"

@pytest.mark.slow
def test_main_job_raises_the_held_out_solve_rate_at_its_defaults(tmp_path):
    """Issue 12's bar: at least +0.30 held out, a visibly rising reward (docs/main_job.md has the measured run)."""
    summary = main(["--output_dir", str(tmp_path)])
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.30, summary
    rewards = summary["rewards"]
    assert sum(rewards[-20:]) / 20 >= sum(rewards[:20]) / 20 + 0.2, rewards


def _job(*flags, env=None, timeout=600):
    import os
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "dllm_trl", *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("flags, env, message", [
    (["--push_to_hub", "true", "--hub_model_id", "me/job"], {"HF_HUB_OFFLINE": "1"},
     "error: --push_to_hub needs the Hub, but HF_HUB_OFFLINE is set"),
    (["--push_to_hub", "true", "--hub_model_id", "me/job"], {"HF_ENDPOINT": "http://127.0.0.1:9"},
     "error: --push_to_hub: the Hub (http://127.0.0.1:9) cannot be reached"),
    (["--report_to", "wandb"], {}, "error: --report_to wandb: not installed; run `pip install wandb`"),
])
def test_the_main_job_pre_checks_fail_in_one_line_before_loading(tmp_path, flags, env, message):
    job = _job("--output_dir", str(tmp_path / "out"), *flags, env=env)
    output, _ = job.communicate(timeout=300)
    assert job.returncode != 0 and output.strip().splitlines()[-1].startswith(message), output
    assert "Traceback" not in output and "before" not in output  # nothing was loaded or evaluated


def test_the_main_job_refuses_an_output_dir_it_cannot_write(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    job = _job("--output_dir", str(blocker / "out"))
    output, _ = job.communicate(timeout=300)
    assert job.returncode != 0 and f"error: --output_dir {blocker / 'out'}: cannot write there" in output, output


def test_the_main_job_resumes_after_kill_9_to_the_same_weights(tmp_path):
    """kill -9 after the second checkpoint, then --resume_from_checkpoint true: the final weights equal an
    uninterrupted run's."""
    import signal
    import time

    from safetensors.torch import load_file

    common = ["--max_steps", "6", "--save_steps", "2", "--save_strategy", "steps", "--skip_eval", "--save_model",
              "--prompts_per_step", "2", "--threads", "1"]
    whole = _job("--output_dir", str(tmp_path / "whole"), *common)
    assert whole.wait(timeout=600) == 0, whole.stdout.read()
    out = tmp_path / "killed"
    job = _job("--output_dir", str(out), *common)
    deadline = time.time() + 600
    while not (out / "checkpoint-4").exists() and job.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGKILL)
    job.wait()
    assert job.returncode == -signal.SIGKILL and not (out / "model").exists()  # killed before the end
    resumed = _job("--output_dir", str(out), *common, "--resume_from_checkpoint", "true")
    output, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, output
    expected, got = load_file(tmp_path / "whole" / "model" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


def test_the_reward_plot_of_an_interrupted_run_has_no_after_accuracy(tmp_path):
    """SIGTERM stops the job before the final evaluation (accuracy_after None): the plot still writes."""
    from dllm_trl.__main__ import _plot

    _plot([0.2, 0.4, 0.3], [(2, 0.5)], 0.4, None, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
