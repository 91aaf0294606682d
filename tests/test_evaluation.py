"""dllm_trl.evaluation on the toy model and small fixtures: cells, scoring, reports, CLI, adapters."""

from __future__ import annotations

import json

import pytest
from trl import ModelConfig

from dllm_trl.data import prepare_dataset, sample_dataset
from dllm_trl.evaluation import (
    EvalTask,
    TaskAccuracy,
    evaluate_model,
    generation_config,
    load_model_and_tokenizer,
    main,
    markdown_tables,
)
from dllm_trl.rewards import code_reward, math_reward
from dllm_trl.toy import evaluate_accuracy, load_toy, toy_dataset, toy_generation_config, toy_reward


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
    metric.add_batch(rewards=[1.0, 0.0, 0.5])
    metric.add_batch(rewards=[1.0])
    assert metric.compute() == {"accuracy": 0.5, "mean_reward": 0.625}


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


def test_markdown_tables():
    cells = [
        dict(dataset=d, gen_length=n, unmasking=m, accuracy=a, mean_reward=a, num_problems=4, tokens_per_second=10.0,
             nfe=8, nfe_per_problem=8.0, seconds=1.0)
        for d, n, m, a in [("gsm8k", 128, "dynamic", 0.5), ("gsm8k", 256, "dynamic", 0.75),
                           ("gsm8k", 128, "static", 0.25)]
    ]
    table = markdown_tables(cells)
    lines = table.splitlines()
    assert lines[0] == "| dataset | unmasking | 128 | 256 |"
    assert lines[2] == "| gsm8k | dynamic | 50.0 | 75.0 |"
    assert lines[3] == "| gsm8k | static | 25.0 | – |"
    assert "| gsm8k | dynamic | 256 | 75.0 | 0.750 | 4 | 10.0 | 8.0 | 1.0 |" in lines


def test_cli_writes_json_markdown_plot_and_completions(tmp_path):
    fixtures = {}
    for layout in ("gsm8k", "mbpp"):
        fixtures[layout] = tmp_path / f"{layout}_fixture.jsonl"
        sample_dataset(layout).to_json(str(fixtures[layout]))
    out = tmp_path / "eval"
    result = main([
        "--datasets", "toy", str(fixtures["gsm8k"]), str(fixtures["mbpp"]), "--num_problems", "16",
        "--gen_lengths", "4", "8", "--unmasking", "dynamic", "static", "--batch_size", "8", "--output_dir", str(out),
    ])
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["cells"]) == 3 * 2 * 2 and saved["settings"]["gen_lengths"] == [4, 8]
    assert "_timestamp" in saved and saved["settings"]["model"] == "toy"
    assert [c["dataset"] for c in saved["cells"][::4]] == ["toy", "gsm8k_fixture", "mbpp_fixture"]
    assert [c["num_problems"] for c in saved["cells"][::4]] == [16, 4, 4]
    # The toy model only writes digits: no box, no code block.
    assert all(c["accuracy"] == 0.0 for c in saved["cells"][4:])
    markdown = (out / "results.md").read_text()
    assert "| dataset | unmasking | 4 | 8 |" in markdown and "| mbpp_fixture | static |" in markdown
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
