"""DiffusionGemma under the engines, launched for real with ``accelerate launch`` and 2 processes on CPU (see
test_distributed.py): the replay (encoder over prompt and finished canvases, decoder over the sampled states) runs
inside one forward of the wrapped model (``engines.forward_replacing``), so DDP's reducer synchronises its gradients
and ZeRO-3 / FSDP2 gather the weights it reaches. DDP: the two processes roll out different prompts, so their replicas
stay identical only if the gradients are synchronised (the script asserts it; with the replay run outside the DDP
wrapper they differ), and every text weight trains. ZeRO-3 (partitioned at load) and FSDP2 (encoder and decoder layer
i in one shard group, ``engines.shared_parameter_groups``) must end two RLDF steps (β > 0) on DDP's parameters
(``AGREEMENT``: 1e-5 absolute, float32; measured 1.1e-6 and 1.3e-7). Each launch takes 10–20 s here, so none is
``slow``."""

from __future__ import annotations

import pytest
import torch

from dllm_trl import load_diffusion_model
from tests.tiny_models import build_tiny_diffusion_gemma

from .conftest import make_char_tokenizer
from .test_distributed import assert_agrees, launch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny DiffusionGemma (canvas 4) on the character tokenizer, confident enough to accept tokens each step."""
    tokenizer = make_char_tokenizer()
    model = build_tiny_diffusion_gemma(vocab_size=len(tokenizer), canvas_length=4, eos_token_id=tokenizer.eos_token_id,
                                       pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        model.model.decoder.norm.weight.add_(20.0)
    path = tmp_path_factory.mktemp("diffusion-gemma")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ddp(checkpoint, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("ddp"), f"model={checkpoint}", "family=diffusion_gemma")


def test_ddp_synchronises_the_replay_gradients(ddp, checkpoint):
    assert ddp["world_size"] == 2 and ddp["distributed_type"] == "DistributedType.MULTI_CPU"
    assert ddp["kl"][0] == 0.0 and ddp["kl"][1] > 0.0
    model = load_diffusion_model(checkpoint)
    trainable = {name for name, param in model.named_parameters(remove_duplicate=False)
                 if not name.startswith("model.encoder.") or name.startswith("model.encoder.language_model.")}
    start = {n: v for n, v in model.state_dict().items() if n in trainable}
    moved = [n for n, v in start.items() if (v - ddp["params"][n]).abs().max() > 1e-5]
    assert len(moved) == len(start), f"only {moved} of the text weights were trained (the vision tower is frozen)"


def test_zero3_partitioned_at_load_agrees_with_ddp(ddp, tmp_path, checkpoint):
    zero3 = launch(tmp_path, f"model={checkpoint}", "family=diffusion_gemma", "backward_mode=per_step",
                   config="deepspeed_zero3")
    assert zero3["distributed_type"] == "DistributedType.DEEPSPEED"
    assert zero3["partitioned_at_load"] and zero3["sharded"], "zero3_init_flag must partition the weights at load"
    assert_agrees(zero3, ddp)


def test_fsdp2_trains_checkpoints_and_agrees_with_ddp(ddp, tmp_path, checkpoint):
    fsdp2 = launch(tmp_path, f"model={checkpoint}", "family=diffusion_gemma", "fsdp_on_cpu=1", "save=1", config="fsdp")
    assert fsdp2["distributed_type"] == "DistributedType.FSDP" and fsdp2["sharded"]
    assert_agrees(fsdp2, ddp)
    saved = load_diffusion_model(str(tmp_path / "checkpoint-2"))
    for name, value in saved.state_dict().items():
        torch.testing.assert_close(value, fsdp2["params"][name], atol=0, rtol=0, msg=name)


def test_fsdp2_groups_the_tied_modules(checkpoint):
    """The FSDP2 shard groups formed before accelerate wraps the rest: encoder layer i with decoder layer i, and the
    embeddings, LM head and final norms together; a model without such sharing (LLaDA) gets none."""
    from dllm_trl.models.engines import shared_parameter_groups
    from tests.tiny_models import build_tiny_llada

    model = load_diffusion_model(checkpoint)
    inner = model.model
    groups = shared_parameter_groups(model)
    pairs = [[encoder, decoder] for encoder, decoder in zip(inner.encoder.language_model.layers, inner.decoder.layers)]
    assert groups[:-1] == pairs
    # in module order on every process: a group's flat layout must be the same on all of them
    assert groups[-1] == [inner.encoder.language_model.embed_tokens, inner.encoder.language_model.norm,
                          inner.decoder.embed_tokens, inner.decoder.norm, model.lm_head]
    assert shared_parameter_groups(build_tiny_llada()) == []


def test_example_script_trains_tied_lora_under_ddp(tmp_path):
    """``examples/rldf_diffusion_gemma.py --use_peft`` launched on 2 CPU processes (DDP): both processes train the
    toy with the adapters TRL adds (tied by the loss: a shared lora module runs in the encoder and the decoder of one
    forward, and DDP's reducer must still see each gradient once) and the saved adapter loads merged."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from trl import ModelConfig

    from dllm_trl.families import load_model_and_tokenizer

    script = Path(__file__).resolve().parents[1] / "examples" / "rldf_diffusion_gemma.py"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", str(script),
               "--use_cpu", "true", "--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--max_steps", "2", "--output_dir",
               "lora-ddp"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert done.stdout.count("mean reward per logged step") == 2  # both processes trained
    model, _ = load_model_and_tokenizer(ModelConfig(model_name_or_path=str(tmp_path / "lora-ddp")))
    assert type(model).__name__ == "DiffusionGemmaForBlockDiffusion"
