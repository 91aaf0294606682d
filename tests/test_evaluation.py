"""dllm_trl.evaluation on the toy model and small fixtures: cells, scoring, reports, CLI, adapters."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from trl import ModelConfig

from dllm_trl.data import prepare_dataset, sample_dataset
from dllm_trl.evaluation import (
    EvalTask,
    TaskAccuracy,
    evaluate_model,
    generation_config,
    main,
    markdown_tables,
    pass_at_k,
)
from dllm_trl.evaluation import reports
from dllm_trl.families import load_model_and_tokenizer
from dllm_trl.rewards import code_reward, math_reward
from dllm_trl.toy import evaluate_accuracy, load_toy, toy_assets_dir, toy_dataset, toy_generation_config, toy_reward


@pytest.fixture(scope="module")
def toy():
    return load_toy()


def test_generation_config_per_cell():
    static = generation_config(256, "static", block_length=32)
    assert (static.unmasking, static.total_steps, static.block_length, static.temperature) == ("static", 256, 32, 0.0)
    assert generation_config(8, "static", block_length=4, tokens_per_step=2).total_steps == 4
    dynamic = generation_config(4, "dynamic", block_length=32, threshold=0.8)
    assert (dynamic.block_length, dynamic.threshold, dynamic.steps) == (4, 0.8, None)


def test_task_accuracy_metric():
    metric = TaskAccuracy(keep_in_memory=True)
    metric.add_batch(rewards=[[1.0], [0.0], [0.5]])
    metric.add_batch(rewards=[[1.0]])
    assert metric.compute() == {"accuracy": 0.5, "mean_reward": 0.625}
    metric.add_batch(rewards=[[1.0, 0.0, 0.0], [0.0, 0.5, 0.0]])  # two problems, three samples each
    expected = {"accuracy": 1 / 6, "mean_reward": 1.5 / 6, "pass@1": 1 / 6, "pass@3": 0.5}
    assert metric.compute(ks=[1, 3]) == pytest.approx(expected)


def brute_force_pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Fraction of the k-subsets of the samples (the first num_correct of them correct) holding a correct one."""
    subsets = list(itertools.combinations(range(num_samples), k))
    return sum(any(i < num_correct for i in subset) for subset in subsets) / len(subsets)


def test_pass_at_k_matches_brute_force():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100), rel=1e-12)
    with pytest.raises(ValueError, match="k"):
        pass_at_k(4, 1, 5)


def test_sampled_cells_report_pass_at_k(toy):
    model, tokenizer = toy
    torch.manual_seed(0)
    results = evaluate_model(
        model, tokenizer, [EvalTask("toy", toy_dataset("test", size=12), toy_reward)], gen_lengths=[8],
        unmasking=["dynamic"], block_length=4, batch_size=16, progress=False, num_samples=4, temperature=1.0,
        pass_at=[1, 2, 4],
    )
    (cell,) = results["cells"]
    assert cell["num_problems"] == 12 and cell["num_samples"] == 4
    records = results["completions"]
    assert sorted((r["index"], r["sample"]) for r in records) == [(i, s) for i in range(12) for s in range(4)]
    correct = [sum(r["reward"] >= 1 for r in records if r["index"] == i) for i in range(12)]
    for k in (1, 2, 4):
        expected = sum(brute_force_pass_at_k(4, c, k) for c in correct) / 12
        assert cell[f"pass@{k}"] == pytest.approx(expected)
    assert cell["pass@1"] == pytest.approx(cell["accuracy"])
    assert 0 < cell["pass@1"] < cell["pass@4"] < 1  # the toy solves some problems some of the time
    assert len({r["completion"] for r in records if r["index"] == 0}) > 1, "samples differ at temperature 1"
    with pytest.raises(ValueError, match="temperature"):
        evaluate_model(model, tokenizer, [], num_samples=4, temperature=0.0)


def test_eval_task_scores_with_the_dataset_columns():
    math = EvalTask("gsm8k", prepare_dataset(sample_dataset("gsm8k")), math_reward)
    answers = math.dataset["answer"]
    assert math.score([f"\\boxed{{{a}}}" for a in answers[:2]] + ["\\boxed{0}", "none"]) == [1.0, 1.0, 0.0, 0.0]
    code = EvalTask("mbpp", prepare_dataset(sample_dataset("mbpp")).select([0, 1]), code_reward)
    solutions = [f"```python\n{s}\n```" for s in code.dataset["solution"]]
    assert code.score([solutions[0], "```python\ndef is_mirror(text):\n    return True\n```"]) == [1.0, 2 / 3]


def test_toy_cells_match_the_toy_evaluator(toy):
    model, tokenizer = toy
    dataset = toy_dataset("test", size=16)
    results = evaluate_model(
        model, tokenizer, [EvalTask("toy", dataset, toy_reward)], gen_lengths=[4, 8], unmasking=["dynamic", "static"],
        block_length=4, batch_size=8, progress=False,
    )
    cells = results["cells"]
    assert [(c["gen_length"], c["unmasking"]) for c in cells] == [(n, m) for n in (4, 8) for m in ("dynamic", "static")]
    for cell in cells:
        assert 0.0 <= cell["accuracy"] <= 1.0 and cell["num_problems"] == 16
        assert cell["tokens_per_second"] > 0 and cell["nfe"] > 0
    assert cells[1]["nfe_per_problem"] == 4  # static: one token per step in the single block of 4
    reference = evaluate_accuracy(model, tokenizer, dataset, toy_generation_config(), batch_size=16)
    assert cells[2]["accuracy"] == reference["accuracy"]
    assert len(results["completions"]) == 4 * 16
    scored = [r for r in results["completions"] if (r["gen_length"], r["unmasking"]) == (8, "dynamic")]
    assert [r["completion"] for r in sorted(scored, key=lambda r: r["index"])] == reference["completions"]


def table_cells(**scores):
    return [
        dict(dataset=d, gen_length=n, unmasking=m, accuracy=a, mean_reward=a, num_problems=4, num_samples=1,
             tokens_per_second=10.0, nfe=8, nfe_per_problem=8.0, seconds=1.0, **scores)
        for d, n, m, a in [("gsm8k", 128, "dynamic", 0.5), ("gsm8k", 256, "dynamic", 0.75),
                           ("gsm8k", 128, "static", 0.25)]
    ]


def test_markdown_tables():
    lines = markdown_tables(table_cells()).splitlines()
    assert lines[0] == "| dataset | unmasking | score | 128 | 256 |"
    assert lines[2] == "| gsm8k | dynamic | accuracy | 50.0 | 75.0 |"
    assert lines[3] == "| gsm8k | static | accuracy | 25.0 | – |"
    assert "| gsm8k | dynamic | 256 | 75.0 | 0.750 | 4 | 1 | 10.0 | 8.0 | 1.0 |" in lines
    sampled = markdown_tables(table_cells(**{"pass@1": 0.5, "pass@4": 0.9})).splitlines()
    assert sampled[2:4] == ["| gsm8k | dynamic | pass@1 | 50.0 | 50.0 |", "| gsm8k | dynamic | pass@4 | 90.0 | 90.0 |"]
    assert "| gsm8k | static | 128 | 25.0 | 50.0 | 90.0 | 0.250 | 4 | 1 | 10.0 | 8.0 | 1.0 |" in sampled


def test_results_are_written_before_the_plot(tmp_path, monkeypatch):
    def failing_plot(cells, path):
        raise RuntimeError("no display")

    monkeypatch.setattr(reports, "plot_results", failing_plot)
    results = {"cells": table_cells(), "completions": [{"completion": "1", "reward": 0.0}]}
    with pytest.raises(RuntimeError, match="no display"):
        reports.write_results(results, str(tmp_path), {"model": "toy"})
    assert json.loads((tmp_path / "results.json").read_text())["cells"] == results["cells"]
    assert (tmp_path / "results.md").read_text() == markdown_tables(results["cells"])
    assert (tmp_path / "completions.jsonl").read_text() == '{"completion": "1", "reward": 0.0}\n'


def test_duplicate_lengths_and_modes_are_evaluated_once(tmp_path, toy):
    result = main(["--num_problems", "8", "--gen_lengths", "8", "8", "4", "8", "--unmasking", "dynamic", "dynamic",
                   "--output_dir", str(tmp_path)])
    assert [(c["gen_length"], c["unmasking"]) for c in result["cells"]] == [(8, "dynamic"), (4, "dynamic")]
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def run_cli(args: list[str], cwd, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    return subprocess.run([sys.executable, "-m", "dllm_trl.evaluation", *args], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=300)


def test_cli_on_a_local_checkpoint_with_local_files_offline(tmp_path, toy):
    """A saved checkpoint and a local file, with HF_HUB_OFFLINE=1 outside any git checkout: nothing spurious."""
    model, tokenizer = toy
    model.save_pretrained(tmp_path / "checkpoint")
    tokenizer.save_pretrained(tmp_path / "checkpoint")
    toy_dataset("test", size=8).to_json(str(tmp_path / "toy_test.jsonl"))
    done = run_cli(["--model_name_or_path", str(tmp_path / "checkpoint"), "--datasets", "toy_test.jsonl",
                    "--dataset_layout", "prepared_math", "--gen_lengths", "8", "--unmasking", "dynamic",
                    "--block_length", "4", "--output_dir", "eval"], tmp_path, HF_HUB_OFFLINE="1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| toy_test | dynamic | accuracy |" in done.stdout
    assert "fatal" not in done.stderr and "Warning" not in done.stderr, done.stderr[-3000:]
    saved = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert saved["settings"]["model"] == str(tmp_path / "checkpoint")
    assert saved["_dllm_trl_commit"] is None or len(saved["_dllm_trl_commit"]) == 40  # a clone records its commit


def test_cli_offline_hub_dataset_fails_fast_with_a_clear_message(tmp_path):
    done = run_cli(["--model_name_or_path", str(toy_assets_dir()), "--datasets", "gsm8k"], tmp_path,
                   HF_HUB_OFFLINE="1")
    assert done.returncode == 2
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("error: Dataset 'gsm8k' (Hub dataset 'openai/gsm8k')") and "HF_HUB_OFFLINE" in message
    assert "local" in message and "Traceback" not in done.stderr
    assert "Loading weights" not in done.stderr, "the data is checked before the model loads"


def test_cli_writes_json_markdown_plot_and_completions(tmp_path):
    fixtures = {}
    for layout in ("gsm8k", "mbpp"):
        fixtures[layout] = tmp_path / f"{layout}_fixture.jsonl"
        sample_dataset(layout).to_json(str(fixtures[layout]))
    out = tmp_path / "eval"
    with pytest.warns(UserWarning, match="max_position_embeddings=64"):  # GSM8K/MBPP prompts: longer than the toy's
        result = main([
            "--datasets", "toy", str(fixtures["gsm8k"]), str(fixtures["mbpp"]), "--num_problems", "16",
            "--gen_lengths", "4", "8", "--unmasking", "dynamic", "static", "--batch_size", "8", "--output_dir",
            str(out),
        ])
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["cells"]) == 3 * 2 * 2 and saved["settings"]["gen_lengths"] == [4, 8]
    assert "_timestamp" in saved and saved["settings"]["model"] == "toy"
    assert [c["dataset"] for c in saved["cells"][::4]] == ["toy", "gsm8k_fixture", "mbpp_fixture"]
    assert [c["num_problems"] for c in saved["cells"][::4]] == [16, 4, 4]
    # The toy model only writes digits: no box, no code block.
    assert all(c["accuracy"] == 0.0 for c in saved["cells"][4:])
    markdown = (out / "results.md").read_text()
    assert "| dataset | unmasking | score | 4 | 8 |" in markdown and "| mbpp_fixture | static |" in markdown
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 4 * (16 + 4 + 4)
    assert result["cells"] == saved["cells"]


def test_lora_adapter_folder_loads_on_its_base(tmp_path, toy):
    from peft import LoraConfig, get_peft_model

    model, tokenizer = load_toy()
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    tokenizer.save_pretrained(tmp_path / "adapter")
    model_args = ModelConfig(model_name_or_path=str(tmp_path / "adapter"))
    loaded, loaded_tokenizer = load_model_and_tokenizer(model_args, "cpu")
    assert not hasattr(loaded, "peft_config")  # merged
    dataset = toy_dataset("test", size=8)
    task = [EvalTask("toy", dataset, toy_reward)]
    kwargs = dict(gen_lengths=[8], unmasking=["dynamic"], block_length=4, progress=False)
    merged = evaluate_model(loaded, loaded_tokenizer, task, **kwargs)["completions"]
    wrapped = evaluate_model(peft_model, tokenizer, task, **kwargs)["completions"]
    assert [r["completion"] for r in merged] == [r["completion"] for r in wrapped]


def test_the_evaluation_refuses_an_output_dir_it_cannot_write_before_loading(tmp_path, capsys):
    from dllm_trl.evaluation import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match="error: --output_dir .*: cannot write there"):
        main(["--output_dir", str(blocker / "out")])
    assert "Loading weights" not in capsys.readouterr().err
