"""DiffusionGemma on vLLM (issue 33, item 4): the config-only model folder the GPU suite serves with
``load_format="dummy"`` (``benchmarks/diffusion_gemma_vllm.py``), and what vLLM 0.31's CPU build does with it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dllm_trl.generation import DiffusionGemmaSamplerConfig
from tests.tiny_models import DIFFUSION_GEMMA_26B_A4B_SHAPE

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "diffusion_gemma_vllm.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("diffusion_gemma_vllm_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def folder(bench, tmp_path_factory):
    return bench.write_engine_folder(tmp_path_factory.mktemp("dg26b"), DIFFUSION_GEMMA_26B_A4B_SHAPE, 48,
                                     eos_token_id=262140)


def test_the_26b_a4b_folder_holds_the_shape_and_our_sampler_settings(folder):
    from transformers import AutoConfig
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json"]  # no weights
    config = AutoConfig.from_pretrained(folder)
    text = config.get_text_config()
    assert config.model_type == "diffusion_gemma" and config.architectures == ["DiffusionGemmaForBlockDiffusion"]
    assert (config.canvas_length, text.vocab_size, text.hidden_size, text.num_hidden_layers, text.num_experts,
            text.top_k_experts) == (256, 262144, 2816, 30, 128, 8)
    assert text.layer_types.count("full_attention") == 5 and text.layer_types[-1] == "full_attention"
    ours = DiffusionGemmaSamplerConfig()
    # What vLLM's DiffusionGemmaModelState reads (gen_config[...]: an EntropyBound sampler_config, the schedule, the
    # stopping rule), equal to our sampler's defaults, so that both sides decode alike.
    raw = json.loads((folder / "generation_config.json").read_text())
    assert "EntropyBound" in raw["sampler_config"]["_cls_name"]
    assert raw["sampler_config"]["entropy_bound"] == ours.entropy_bound
    assert (raw["max_denoising_steps"], raw["t_min"], raw["t_max"], raw["stability_threshold"],
            raw["confidence_threshold"]) == (48, ours.t_min, ours.t_max, ours.stability_threshold,
                                             ours.confidence_threshold)
    loaded = DiffusionGemmaGenerationConfig.from_pretrained(folder)
    assert loaded.sampler_config.entropy_bound == ours.entropy_bound and loaded.eos_token_id == 262140


@pytest.mark.vllm
def test_vllm_reads_the_folder_as_a_diffusion_model(folder):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.config import get_config, try_get_generation_config

    config = get_config(str(folder), trust_remote_code=False)
    assert config.canvas_length == 256  # vLLM's ModelConfig.is_diffusion tests exactly this
    assert try_get_generation_config(str(folder), trust_remote_code=False).to_diff_dict()["max_denoising_steps"] == 48


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_cpu_refuses_diffusion_gemma(bench, tmp_path):
    """The blockers on CPU, as vLLM 0.31's CPU build states them: its engine config refuses diffusion models (Model
    Runner V1; V2 needs Triton with a CPU backend), and without a torchvision built for the installed torch its
    DiffusionGemma module does not import (transformers' Gemma 4 image processor). When this fails, vLLM may serve
    DiffusionGemma on CPU: test vLLM's output against ours instead."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    folder = bench.write_engine_folder(tmp_path / "tiny", {}, 4)  # tiny_diffusion_gemma_config's defaults
    args = EngineArgs(model=str(folder), load_format="dummy", dtype="float32", enforce_eager=True,
                      skip_tokenizer_init=True, max_model_len=128, limit_mm_per_prompt={"image": 0, "video": 0})
    with pytest.raises(Exception, match=r"Model Runner V1 does not support: diffusion models"):
        args.create_engine_config()
    if importlib.util.find_spec("torchvision") is None:  # the CPU recipe removes PyPI's CUDA torchvision
        with pytest.raises(ModuleNotFoundError, match="Gemma4Processor"):
            importlib.import_module("vllm.model_executor.models.diffusion_gemma")
