"""The library's diffusion LMs on EleutherAI's lm-evaluation-harness (``dllm_trl.evaluation.lm_eval``, the ``eval``
extra): lm-eval's scores and completions are the library's own decoding of the same problems and settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from dllm_trl.evaluation.lm_eval import DiffusionLM, cut_at_stop  # noqa: E402
from dllm_trl.toy import (evaluate_accuracy, evaluate_diffusion_gemma_accuracy,  # noqa: E402
                          load_sudoku_diffusion_gemma, load_toy, sudoku_dataset, toy_assets_dir, toy_dataset,
                          toy_generation_config, toy_problems)
from dllm_trl.toy.block import load_toy_block, toy_block_assets_dir, toy_block_generation_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "data" / "lm_eval"


@pytest.fixture(scope="module")
def task_manager():
    return TaskManager(include_path=str(TASKS), include_defaults=False)  # our tasks only (lm-eval's: a 9 s scan)


def run_lm_eval(task_manager, task, model_args="", limit=None, batch_size=64, **kwargs):
    results = lm_eval.simple_evaluate(model="dllm_trl", model_args=model_args, tasks=[task], task_manager=task_manager,
                                      batch_size=batch_size, limit=limit, log_samples=True, **kwargs)
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return results["results"][task]["exact_match,none"], [s["resps"][0][0] for s in samples]


def request(context, **gen_kwargs):
    return Instance(request_type="generate_until", doc={}, arguments=(context, gen_kwargs), idx=0)


def test_task_data_is_the_toy_test_split():
    rows = [json.loads(line) for line in (TASKS / "toy_addition.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["answer"]) for r in rows] == toy_problems("test")


def test_toy_accuracy_is_the_library_accuracy(task_manager):
    accuracy, completions = run_lm_eval(task_manager, "dllm_trl_toy_addition")
    model, tokenizer = load_toy()
    own = evaluate_accuracy(model, tokenizer, toy_dataset("test"), toy_generation_config())
    assert completions == own["completions"]
    assert accuracy == pytest.approx(own["accuracy"]) and 0.1 < accuracy < 0.9  # a partly competent toy


def test_block_model_decodes_as_the_library(task_manager):
    accuracy, completions = run_lm_eval(task_manager, "dllm_trl_toy_addition", f"pretrained={toy_block_assets_dir()}",
                                        limit=16, batch_size=8)
    model, tokenizer = load_toy_block()
    own = evaluate_accuracy(model, tokenizer, toy_dataset("test", size=16), toy_block_generation_config(),
                            batch_size=8)
    assert completions == own["completions"] and accuracy == pytest.approx(own["accuracy"])


def test_diffusion_gemma_decodes_as_the_library(task_manager):
    path = toy_assets_dir("sudoku_diffusion_gemma")
    accuracy, completions = run_lm_eval(task_manager, "dllm_trl_toy_sudoku", f"pretrained={path},seed=3", limit=8,
                                        batch_size=4)
    model, tokenizer = load_sudoku_diffusion_gemma()
    dataset = sudoku_dataset("test", size=8)
    own = evaluate_diffusion_gemma_accuracy(model, tokenizer, dataset, batch_size=4, seeds=(3,))
    assert completions == own["completions"]
    assert accuracy == pytest.approx(sum(c == a for c, a in zip(own["completions"], dataset["answer"])) / 8)


def test_max_gen_toks_rounds_up_to_blocks_then_cuts():
    lm = DiffusionLM(batch_size=4)  # the toy: blocks of 4
    prompts = [p for p, _ in toy_problems("test")[:6]]
    config, _, _ = lm.request_settings({"max_gen_toks": 5})
    assert config.gen_length == 8 and config.block_length == 4
    out = lm.generate_until([request(p, max_gen_toks=1, do_sample=False) for p in prompts])
    model, tokenizer = load_toy()
    # 1 token -> one block of 4 decoded, then cut to its first token
    own = evaluate_accuracy(model, tokenizer, toy_dataset("test", size=6), toy_generation_config(gen_length=4),
                            batch_size=4)
    first_tokens = [tokenizer.decode(tokenizer(c, add_special_tokens=False)["input_ids"][:1])
                    for c in own["completions"]]
    assert out == first_tokens and any(len(c) > 1 for c in own["completions"])


def test_until_cuts_at_the_first_stop_string():
    assert cut_at_stop("12\n34<stop>5", ["<stop>", "\n"]) == "12"
    assert cut_at_stop("1234", ["9", ""]) == "1234"
    lm = DiffusionLM(batch_size=4)
    prompts = [p for p, _ in toy_problems("test")[:8]]
    full = lm.generate_until([request(p) for p in prompts])
    cut = lm.generate_until([request(p, until=["4"]) for p in prompts])
    assert cut == [c.split("4")[0] for c in full] and cut != full


def test_settings_not_understood_are_refused(monkeypatch):
    lm = DiffusionLM()
    with pytest.raises(ValueError, match="max_new_tokens not understood"):
        lm.generate_until([request("1+2=", max_new_tokens=4)])
    with pytest.raises(ValueError, match="do_sample=false with temperature=0.7"):
        lm.generate_until([request("1+2=", do_sample=False, temperature=0.7)])
    with pytest.raises(ValueError, match="--model_args: entropy_bound not understood"):
        DiffusionLM(entropy_bound=0.2)
    with pytest.raises(ValueError, match="batch_size='auto'"):
        DiffusionLM(batch_size="auto")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="runs in one process"):
        DiffusionLM()


def test_likelihood_requests_are_refused():
    lm = DiffusionLM()
    req = Instance(request_type="loglikelihood", doc={}, arguments=("1+2=", "3"), idx=0)
    with pytest.raises(NotImplementedError, match="multiple-choice tasks"):
        lm.loglikelihood([req])
    with pytest.raises(NotImplementedError, match="perplexity"):
        lm.loglikelihood_rolling([req])


def test_diffusion_gemma_greedy_requests_are_refused_unless_sampling_is_allowed():
    path = str(toy_assets_dir("sudoku_diffusion_gemma"))
    with pytest.raises(ValueError, match="sample_when_greedy=true"):
        DiffusionLM(pretrained=path).generate_until([request("x", do_sample=False)])
    dataset = sudoku_dataset("test", size=4)
    lm = DiffusionLM(pretrained=path, sample_when_greedy=True, batch_size=4)
    out = lm.generate_until([request(p, do_sample=False, max_gen_toks=20) for p in dataset["prompt"]])
    own = evaluate_diffusion_gemma_accuracy(lm.model, lm.tokenizer, dataset, batch_size=4, seeds=(0,))
    assert out == own["completions"]


def test_chat_template_prompts_are_the_library_chat_prompts(task_manager):
    _, completions = run_lm_eval(task_manager, "dllm_trl_toy_addition", limit=8, apply_chat_template=True)
    model, tokenizer = load_toy()
    own = evaluate_accuracy(model, tokenizer, toy_dataset("test", size=8, conversational=True),
                            toy_generation_config())
    assert completions == own["completions"]


def test_command_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "dllm_trl.evaluation.lm_eval", "--include_path", str(TASKS), "--tasks",
         "dllm_trl_toy_addition", "--limit", "20", "--batch_size", "20", "--output_path", str(tmp_path),
         "--log_samples"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [results_file] = tmp_path.rglob("results_*.json")
    score = json.loads(results_file.read_text())["results"]["dllm_trl_toy_addition"]["exact_match,none"]
    model, tokenizer = load_toy()
    assert score == pytest.approx(evaluate_accuracy(model, tokenizer, toy_dataset("test", size=20))["accuracy"])
    assert list(tmp_path.rglob("samples_dllm_trl_toy_addition_*.jsonl"))
