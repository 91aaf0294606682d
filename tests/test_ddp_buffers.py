"""The diffusion trainers leave buffers out of DDP without the deprecated ``broadcast_buffers`` argument: no
FutureWarning, and no buffer broadcast in any forward (processes run different numbers of forwards per step)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from accelerate.utils import DistributedDataParallelKwargs

from tests.tiny_models import build_tiny_llada
from dllm_trl.trainers import RLDFConfig, RLDFTrainer

from .conftest import addition_dataset, length_reward, tiny_training_args


def test_ddp_wraps_the_policy_without_buffer_sync_or_deprecation(tmp_path, char_tokenizer):
    model = build_tiny_llada(vocab_size=len(char_tokenizer), mask_token_id=char_tokenizer.mask_token_id,
                             eos_token_id=char_tokenizer.eos_token_id)
    args = tiny_training_args(RLDFConfig, tmp_path)
    assert args.ddp_broadcast_buffers is None  # nothing deprecated for accelerate to pass on
    trainer = RLDFTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=addition_dataset(),
                          processing_class=char_tokenizer)
    assert any(True for _ in trainer.model.named_buffers())  # RoPE frequencies
    # What transformers' Trainer hands accelerate, and accelerate hands DDP.
    ddp_kwargs = {} if args.ddp_broadcast_buffers is None else {"broadcast_buffers": args.ddp_broadcast_buffers}
    kwargs = DistributedDataParallelKwargs(**ddp_kwargs).to_kwargs()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            ddp = torch.nn.parallel.DistributedDataParallel(trainer.model, **kwargs)
        assert ddp.modules_buffers == [] and not ddp.will_sync_module_buffers()
    finally:
        dist.destroy_process_group()
