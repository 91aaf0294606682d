"""The library's diffusion LMs on EleutherAI's lm-evaluation-harness (``dllm_trl.evaluation.lm_eval``, the ``eval``
extra): lm-eval's scores and completions are the library's own decoding of the same problems and settings."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import torch  # noqa: E402

from dllm_trl.evaluation.lm_eval import DiffusionLM, cut_at_stop, request_generator  # noqa: E402
from dllm_trl.losses.elbo import sequence_elbo  # noqa: E402
from dllm_trl.toy import (evaluate_accuracy, evaluate_diffusion_gemma_accuracy,  # noqa: E402
                          load_sudoku_diffusion_gemma, load_toy, sudoku_dataset, toy_assets_dir, toy_dataset,
                          toy_generation_config, toy_problems)
from dllm_trl.toy.block import load_toy_block, toy_block_assets_dir, toy_block_generation_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "data" / "lm_eval"
_spec = importlib.util.spec_from_file_location("toy_addition_choice", TASKS / "toy_addition_choice.py")
choice_task = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(choice_task)
load_choice_dataset = choice_task.load_dataset


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


def test_settings_not_understood_are_refused():
    lm = DiffusionLM()
    with pytest.raises(ValueError, match="max_new_tokens not understood"):
        lm.generate_until([request("1+2=", max_new_tokens=4)])
    with pytest.raises(ValueError, match="do_sample=false with temperature=0.7"):
        lm.generate_until([request("1+2=", do_sample=False, temperature=0.7)])
    with pytest.raises(ValueError, match="--model_args: entropy_bound not understood"):
        DiffusionLM(entropy_bound=0.2)
    with pytest.raises(ValueError, match="batch_size='auto'"):
        DiffusionLM(batch_size="auto")


def likelihood_request(context, continuation):
    return Instance(request_type="loglikelihood", doc={}, arguments=(context, continuation), idx=0)


def test_loglikelihood_is_the_seeded_elbo_and_rolling_sums_the_windows():
    lm = DiffusionLM(mc_num=8, mc_batch_size=4, seed=3)
    model, tokenizer = load_toy()
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    [(value, greedy)] = lm.loglikelihood([likelihood_request("13+54= ", "67")])  # the space moves to the continuation
    own = sequence_elbo(model, torch.tensor(ids("13+54=")), torch.tensor(ids(" 67")), "llada", 8, 4,
                        request_generator(3, ids("13+54="), ids(" 67")), with_greedy=True)
    assert (value, greedy) == (own.value, own.greedy)
    assert lm.loglikelihood([likelihood_request("13+54=", "67")]) != [(value, greedy)]
    # perplexity: lm-eval's disjoint windows of max_length tokens (the first after BOS; the last filled up with context)
    lm = DiffusionLM(estimator="left_to_right", max_length=4)
    text = "12+34=46 7"
    [rolling] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    tokens, bos = ids(text), tokenizer.bos_token_id
    windows = [([bos], tokens[:4]), (tokens[3:4], tokens[4:8]), (tokens[5:8], tokens[8:])]
    expected = sum(sequence_elbo(model, torch.tensor(c), torch.tensor(x), "left_to_right").value for c, x in windows)
    assert rolling == pytest.approx(expected, abs=1e-9)


def test_likelihood_of_a_uniform_noise_model_is_refused():
    lm = DiffusionLM(pretrained=str(toy_assets_dir("sudoku_diffusion_gemma")))
    with pytest.raises(ValueError, match="uniform-noise"):
        lm.loglikelihood([likelihood_request("1+2=", "3")])
    with pytest.raises(ValueError, match="mc_num=10 is not a multiple of mc_batch_size=4"):
        DiffusionLM(mc_num=10, mc_batch_size=4)


def test_named_chat_template_is_the_one_rendered():
    lm = DiffusionLM()
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    lm.tokenizer.chat_template = {"default": lm.tokenizer.chat_template, "plain": plain}
    assert lm.chat_template("plain") == plain
    assert lm.apply_chat_template([{"role": "user", "content": "1+2="}]) == "1+2="
    with pytest.raises(ValueError, match="not available"):
        lm.chat_template("nope")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_cli(tmp_path, name, *args, launcher=(), **env_vars):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env_vars}
    out = tmp_path / name
    return subprocess.Popen(
        [*launcher, "-m", "dllm_trl.evaluation.lm_eval", "--include_path", str(TASKS), "--output_path", str(out),
         "--log_samples", *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def cli_samples(tmp_path, name, task):
    [path] = (tmp_path / name).rglob(f"samples_{task}_2*.jsonl")  # the file name's timestamp
    rows = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda r: r["doc_id"])
    [results_file] = (tmp_path / name).rglob("results_*.json")
    return json.loads(results_file.read_text())["results"][task], [r["resps"] for r in rows]


def test_command_line_on_one_and_two_processes(tmp_path):
    """lm-eval's command line on the four-way multiple-choice toy task (the library's own ELBO scores, accuracy above
    chance) and the generation task (the library's accuracy), then the same under ``accelerate launch`` with two CPU
    processes: each process scores its half, and the gathered per-request results are the one-process ones."""
    tasks = "dllm_trl_toy_addition_choice,dllm_trl_toy_addition"
    args = ("--tasks", tasks, "--limit", "16", "--batch_size", "8", "--model_args", "mc_num=16,mc_batch_size=16")
    one = run_cli(tmp_path, "one", *args, launcher=(sys.executable,))
    two = run_cli(tmp_path, "two", *args, launcher=(
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(ROOT / "examples" / "accelerate_configs" / "multi_gpu.yaml"), "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())),
                  LMEVAL_LOG_LEVEL="DEBUG", CUDA_VISIBLE_DEVICES="")
    outputs = [process.communicate(timeout=400)[0] for process in (one, two)]
    for process, output in zip((one, two), outputs):
        assert process.returncode == 0, output[-3000:]
    # 16 documents x 4 choices, half on each rank (lm-eval's debug line, once per process)
    assert outputs[1].count("dllm_trl_toy_addition_choice; number of requests on this rank: 32") == 2, outputs[1][-3000:]
    choice, choice_resps = cli_samples(tmp_path, "one", "dllm_trl_toy_addition_choice")
    # the library's own scores of every choice, each request from its own seeded generator
    model, tokenizer = load_toy()
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    data = load_choice_dataset()["test"].select(range(16))
    own_scores = [[sequence_elbo(model, torch.tensor(ids(d["prompt"])), torch.tensor(ids(c)), "llada", 16, 16,
                                 request_generator(0, ids(d["prompt"]), ids(c))).value for c in d["choices"]]
                  for d in data]
    assert [[float(r[0][0]) for r in resps] for resps in choice_resps] == own_scores
    own_accuracy = sum(max(range(4), key=s.__getitem__) == d["label"] for s, d in zip(own_scores, data)) / len(data)
    assert choice["acc,none"] == pytest.approx(own_accuracy) and own_accuracy > 0.5  # chance: 0.25
    # two processes: each document answered as by one process, gathered on the first
    for task in tasks.split(","):
        assert cli_samples(tmp_path, "two", task) == cli_samples(tmp_path, "one", task)
    # the generation task through the command line: the library's own accuracy
    generation, _ = cli_samples(tmp_path, "one", "dllm_trl_toy_addition")
    own = evaluate_accuracy(model, tokenizer, toy_dataset("test", size=16))["accuracy"]
    assert generation["exact_match,none"] == pytest.approx(own)


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


def test_decoding_and_scoring_show_lm_evals_progress_bar(capsys):
    """Minutes of decoding on a real model are not silent: a bar per kind of request, as lm-eval's HF model shows."""
    lm = DiffusionLM(pretrained=str(toy_assets_dir()), mc_num=2, mc_batch_size=2)
    lm.generate_until([request("1+2=", do_sample=False), request("3+4=", do_sample=False)])
    assert "Running generate_until requests" in capsys.readouterr().err
    lm.generate_until([request("1+2=", do_sample=False)], disable_tqdm=True)
    assert "Running generate_until requests" not in capsys.readouterr().err
