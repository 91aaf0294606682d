"""What users type: Hub names (``org/name``), resolved offline through huggingface_hub's own cache (laid out by
:mod:`tests.hub_cache` from the shipped toys and the families' official formats, ``HF_HUB_OFFLINE=1``), through every
entry point that takes a model, adapter or dataset name: the loaders, each trainer, ``load_adapter``, the scripts'
``load_model_and_tokenizer``, the main job and an example's ``--model_name_or_path``, the lm-eval model's
``pretrained=`` and ``load_task_dataset`` from a datasets cache; ``revision=`` / ``cache_dir=`` / ``token=``; and
the messages for a Hub name that is not there and a folder that is not there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch

from dllm_trl import RLDFConfig, RLDFTrainer, load_diffusion_model
from dllm_trl.families import load_adapter
from dllm_trl.toy import toy_assets_dir

from .conftest import addition_dataset, length_reward, make_char_tokenizer
from .hub_cache import add_to_hub_cache
from .test_families import FAMILIES, official_folder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty Hub cache that huggingface_hub (and so transformers and PEFT) reads, offline; subprocesses get the
    same through the environment. Returns a function ``add(repo_id, folder, **kwargs)``."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def add(repo_id, folder, **kwargs):
        return add_to_hub_cache(cache, repo_id, folder, **kwargs)

    add.cache = cache
    return add


def _logits(model, seed=0):
    ids = torch.randint(2, 14, (2, 6), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("name, init_kwargs", [(f[0], f[1]) for f in FAMILIES], ids=[f[0] for f in FAMILIES])
def test_every_familys_official_checkpoint_loads_by_hub_name(hub, tmp_path, name, init_kwargs):
    folder = official_folder(name, tmp_path / name)
    hub(f"test-org/{name}-tiny", folder)
    by_name = load_diffusion_model(f"test-org/{name}-tiny", **init_kwargs)
    by_folder = load_diffusion_model(folder, **init_kwargs)
    assert by_name.config.diffusion_family == by_folder.config.diffusion_family
    if name != "diffusion_gemma":  # its forward needs canvases; its weights are compared instead
        torch.testing.assert_close(_logits(by_name), _logits(by_folder))
    for (key, a), b in zip(by_name.state_dict().items(), by_folder.state_dict().values()):
        assert torch.equal(a, b), key


def test_revision_and_cache_dir_are_honoured(hub, tmp_path, monkeypatch):
    """``revision=`` picks the snapshot its ref points to; ``cache_dir=`` a cache other than the default one."""
    hub("test-org/sudoku", toy_assets_dir("sudoku"), revisions=("main",))
    hub("test-org/sudoku", toy_assets_dir("sudoku_noisy_teacher"), revisions=("noisy",))
    main = load_diffusion_model("test-org/sudoku")
    noisy = load_diffusion_model("test-org/sudoku", revision="noisy")
    assert torch.equal(main.lm_head.weight, load_diffusion_model(str(toy_assets_dir("sudoku"))).lm_head.weight)
    assert torch.equal(noisy.lm_head.weight,
                       load_diffusion_model(str(toy_assets_dir("sudoku_noisy_teacher"))).lm_head.weight)
    other = tmp_path / "elsewhere"
    add_to_hub_cache(other, "test-org/block", toy_assets_dir("toy_block"))
    with pytest.raises(FileNotFoundError, match=r"'test-org/block' is neither a folder .* nor in the local Hub cache"):
        load_diffusion_model("test-org/block")  # not in the default cache
    model = load_diffusion_model("test-org/block", cache_dir=str(other), token="hf_not_needed_offline")
    assert model.config.diffusion_block_size > 0


def test_a_hub_name_that_is_not_there_and_a_missing_folder_each_get_their_message(hub):
    with pytest.raises(FileNotFoundError) as missing:
        load_diffusion_model("GSAI-ML/LLaDA-8B-Instrct")
    message = str(missing.value)
    assert "'GSAI-ML/LLaDA-8B-Instrct' is neither a folder" in message and "HF_HUB_OFFLINE is set" in message
    assert "hf download GSAI-ML/LLaDA-8B-Instrct" in message
    with pytest.raises(FileNotFoundError, match=r"'\./no-such-model': no such folder"):
        load_diffusion_model("./no-such-model")


def test_rldf_trainer_takes_a_hub_name_and_loads_its_tokenizer_from_it(hub, tmp_path):
    hub("test-org/addition-toy", toy_assets_dir("toy"))
    args = RLDFConfig(output_dir=str(tmp_path / "out"), max_completion_length=8, block_length=4,
                      per_device_train_batch_size=4, num_generations=4, max_steps=1, logging_steps=1,
                      report_to="none", num_sampled_timesteps=2, save_strategy="no", use_cpu=True, drop_zero_variance_groups=False)
    trainer = RLDFTrainer(model="test-org/addition-toy", reward_funcs=length_reward, args=args,
                          train_dataset=addition_dataset(3, 2))  # no processing_class: TRL loads it by that name
    assert trainer.processing_class.mask_token_id == trainer.model.config.mask_token_id
    trainer.train()
    assert any("loss" in entry for entry in trainer.state.log_history)


def test_dppo_mask_trainers_take_hub_names(hub, tmp_path):
    from dllm_trl.trainers import (CausalDPPOMaskConfig, CausalDPPOMaskTrainer, DiffusionDPPOMaskTrainer,
                                   DPPOMaskConfig, DPPOMaskTrainer)

    hub("test-org/sudoku-causal", toy_assets_dir("sudoku_causal"))
    hub("test-org/addition-toy", toy_assets_dir("toy"))
    common = dict(max_completion_length=8, per_device_train_batch_size=4, num_generations=4, max_steps=1,
                  report_to="none", save_strategy="no", use_cpu=True)
    causal = DPPOMaskTrainer(model="test-org/sudoku-causal", reward_funcs=length_reward,
                             args=CausalDPPOMaskConfig(output_dir=str(tmp_path / "c"), **common),
                             train_dataset=addition_dataset(3, 2), processing_class=make_char_tokenizer())
    assert isinstance(causal, CausalDPPOMaskTrainer)
    diffusion = DPPOMaskTrainer(model="test-org/addition-toy", reward_funcs=length_reward,
                                args=DPPOMaskConfig(output_dir=str(tmp_path / "d"), block_length=4,
                                                    num_sampled_timesteps=2, **common),
                                train_dataset=addition_dataset(3, 2))
    assert isinstance(diffusion, DiffusionDPPOMaskTrainer)
    diffusion.train()


def test_adapters_load_by_hub_name(hub, tmp_path):
    """``load_adapter(base, "org/adapter")`` and the scripts' loader, which finds the adapter's base model in its
    ``adapter_config.json`` on the Hub (here: a Hub name too)."""
    from peft import LoraConfig, get_peft_model
    from trl import ModelConfig

    from dllm_trl.families import load_model_and_tokenizer

    hub("test-org/addition-toy", toy_assets_dir("toy"))
    base = load_diffusion_model("test-org/addition-toy")
    lora = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.peft_config["default"].base_model_name_or_path = "test-org/addition-toy"
    lora.save_pretrained(tmp_path / "adapter")
    make_char_tokenizer().save_pretrained(tmp_path / "adapter")
    hub("test-org/addition-lora", tmp_path / "adapter")
    expected = _logits(load_adapter(load_diffusion_model("test-org/addition-toy"), str(tmp_path / "adapter")))
    merged = load_adapter(load_diffusion_model("test-org/addition-toy"), "test-org/addition-lora")
    torch.testing.assert_close(_logits(merged), expected)
    assert not torch.allclose(expected, _logits(load_diffusion_model("test-org/addition-toy")))  # the adapter acts
    model, tokenizer = load_model_and_tokenizer(ModelConfig(model_name_or_path="test-org/addition-lora"))
    torch.testing.assert_close(_logits(model), expected)


def test_lm_eval_model_takes_a_hub_name(hub):
    pytest.importorskip("lm_eval")
    from dllm_trl.evaluation.lm_eval import DiffusionLM

    hub("test-org/addition-toy", toy_assets_dir("toy"))
    lm = DiffusionLM(pretrained="test-org/addition-toy")
    assert lm.model.config.mask_token_id == lm.tokenizer.mask_token_id


def _datasets_cache_entry(cache, repo_id, rows, tmp_path):
    """``repo_id``'s train split in the datasets cache ``cache``, as ``load_dataset(repo_id)`` leaves it after a
    download: written by datasets' own parquet builder under the repository's cache folder."""
    from datasets import Dataset
    from datasets.packaged_modules.parquet.parquet import Parquet

    source = tmp_path / "train.parquet"
    Dataset.from_dict(rows).to_parquet(source)
    builder = Parquet(cache_dir=str(cache), dataset_name=repo_id.split("/")[1], config_name="default",
                      hash="0" * 40, data_files={"train": [str(source)]})
    builder.repo_id, builder.config_id = repo_id, "default"  # the folder a Hub download is cached under
    builder._cache_dir = builder._build_cache_dir()
    builder.download_and_prepare()


def test_the_main_job_and_an_example_take_hub_names(hub, tmp_path):
    """In subprocesses, as users run them (``HF_HUB_OFFLINE=1``): the main job trains a Sudoku checkpoint named on
    the Hub; ``examples/rldf_math.py`` trains a Hub model on a Hub dataset from the datasets cache."""
    hub("test-org/sudoku", toy_assets_dir("sudoku"))
    config = json.loads((toy_assets_dir("toy") / "config.json").read_text())
    config["max_position_embeddings"] = 512  # room for the GSM8K-style prompts
    hub("test-org/addition-toy-long", toy_assets_dir("toy"), overrides={"config.json": json.dumps(config).encode()})
    datasets_cache = tmp_path / "datasets"
    _datasets_cache_entry(datasets_cache, "test-org/tiny-gsm", {"question": ["1+1?", "2+2?", "3+3?", "4+4?"],
                                                                 "answer": ["#### 2", "#### 4", "#### 6", "#### 8"]},
                          tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(datasets_cache)}
    job = subprocess.run([sys.executable, "-m", "dllm_trl", "--model_name_or_path", "test-org/sudoku",
                          "--max_steps", "1", "--prompts_per_step", "1", "--num_generations", "4", "--skip_eval",
                          "--output_dir", str(tmp_path / "job")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert summary["settings"]["model_name_or_path"] == "test-org/sudoku" and summary["steps"] == 1
    example = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rldf_math.py"), "--model_name_or_path", "test-org/addition-toy-long",
         "--dataset_name", "test-org/tiny-gsm", "--max_steps", "1", "--max_completion_length", "8", "--block_length",
         "4", "--num_generations", "2", "--per_device_train_batch_size", "2", "--output_dir", str(tmp_path / "ex")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert example.returncode == 0, example.stderr[-3000:]
    assert "mean reward per logged step: [0.0]" in example.stdout
