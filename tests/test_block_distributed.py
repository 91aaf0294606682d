"""Block-diffusion models under the sharding engines, launched for real (see test_distributed.py): the block sampler's
cached steps and the packed loss forward go through the wrapped model's own forward, so FSDP2's root unit and ZeRO-3's
per-layer gathering run for them; after two RLDF steps the parameters equal the DDP run's. Two models: SDAR-shaped
(Qwen3 layout) and LLaDA2-shaped (Glm4Moe: fused 3-D expert weights, and each router's persistent float32 buffer
``e_score_correction_bias``, which FSDP2 leaves unsharded).

Three 2-process launches per model (≈ 5 minutes each on a loaded 2-core machine): ``slow``, run with ``-m slow``."""

from __future__ import annotations

import pytest

from tests.tiny_models import build_tiny_llada2, build_tiny_sdar

from .conftest import make_char_tokenizer
from .test_distributed import assert_agrees, launch


BUILDERS = {"sdar": (build_tiny_sdar, {}), "llada2": (build_tiny_llada2, {"moe_intermediate_size": 16})}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def checkpoint(request, tmp_path_factory):
    """A tiny block model of each layout saved by the library (block size 4 on its config)."""
    tokenizer = make_char_tokenizer()
    build, extra = BUILDERS[request.param]
    model = build(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id, eos_token_id=tokenizer.eos_token_id,
                  hidden_size=32, intermediate_size=64, block_size=4, **extra)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ddp(checkpoint, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("ddp"), f"model={checkpoint}")


@pytest.mark.slow
def test_zero3_and_fsdp2_agree_with_ddp_on_a_block_model(ddp, tmp_path, checkpoint):
    zero3 = launch(tmp_path / "zero3", f"model={checkpoint}", "backward_mode=per_step", config="deepspeed_zero3")
    assert zero3["partitioned_at_load"] and zero3["sharded"]
    assert_agrees(zero3, ddp)
    fsdp2 = launch(tmp_path / "fsdp2", f"model={checkpoint}", "fsdp_on_cpu=1", config="fsdp")
    assert fsdp2["distributed_type"] == "DistributedType.FSDP" and fsdp2["sharded"]
    assert_agrees(fsdp2, ddp)
