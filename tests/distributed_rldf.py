"""Two-process RLDF run, launched by tests/test_distributed.py through `accelerate launch --cpu`."""

import math
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from tests.conftest import addition_dataset, length_reward, make_char_tokenizer  # noqa: E402

from dllm_trl.models import build_tiny_llada  # noqa: E402
from dllm_trl.trainers import RLDFConfig, RLDFTrainer  # noqa: E402


def main(output_dir: str):
    torch.set_num_threads(1)
    tokenizer = make_char_tokenizer()
    model = build_tiny_llada(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    args = RLDFConfig(
        output_dir=output_dir, max_completion_length=8, block_length=4, per_device_train_batch_size=2,
        num_generations=4, max_steps=2, logging_steps=1, report_to="none", learning_rate=1e-3, temperature=1.0,
        num_sampled_timesteps=4, beta=0.01, save_strategy="no", use_cpu=True, seed=0,
        drop_zero_variance_groups=True,
    )
    trainer = RLDFTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=addition_dataset(),
                          processing_class=tokenizer)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    # Earlier sampled steps backpropagate under no_sync; the last one must synchronise everything that
    # accumulated, or the replicas (which saw different prompts) drift apart.
    flat = torch.cat([p.detach().flatten() for p in trainer.accelerator.unwrap_model(trainer.model).parameters()])
    replicas = trainer.accelerator.gather(flat.unsqueeze(0))
    assert torch.equal(replicas[0], replicas[1]), "parameters differ across processes"
    assert trainer.state.log_history[0]["rldf/sampled_steps"] > 1, "needs several sampled steps per row"
    if trainer.accelerator.is_main_process:
        print(f"DISTRIBUTED_OK world={trainer.accelerator.num_processes} losses={losses}")


if __name__ == "__main__":
    main(sys.argv[1])
