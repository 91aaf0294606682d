"""Block-diffusion models (SPEC §7): the exact block cache and the packed RLDF update, each side by side in one run.

Two tables:

* rollout: tokens/s of the block decoder with the exact cache of finished blocks (``cache="dual"``; ``prefix`` is the
  same for a block model) against no cache (every step runs the whole canvas), dynamic and static unmasking, NFE,
  ms/step, peak memory and the share of tokens equal to the uncached decode (100%: the cache is exact);
* RLDF update: the sampled states of each completion scored in one packed forward (clean prefix once + each state's
  noisy block) against one forward per state (what a bidirectional model needs), at k = 4 and 16: the no-grad π_old
  pass that fixes the clean targets and the loss forward + backward, seconds, forwards and peak memory, and the
  largest difference between the two losses (they are equal but for float rounding).

CPU default: SDAR's layout (Qwen3) at d 256 × 2 layers with the real vocabulary (151 936), blocks of 4, prompt 128,
gen 256, batch 1 and 8 for the rollout, 4 prompts × 2 generations for the update. Random weights with the LM head
rescaled so that the logits at masked positions have standard deviation ``--logit-std`` (confidences spread over
(0, 1) and several tokens clear the 0.9 threshold per step)::

    python benchmarks/block_diffusion.py
    python benchmarks/block_diffusion.py --shape sdar-8b --device cuda --batch 8 --logit-std 25   # see gpu_suite.py
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/tiny_models.py

import torch

import rollout
from train_step import PeakMemory

SMALL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64)
SMALL_LLADA2 = dict(SMALL, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                    topk_group=2)
SHAPES = ("small", "sdar-8b", "small-llada2", "llada2-mini")
"""``*llada2*``: LLaDA2's MoE on ``Glm4MoeForCausalLM`` (LLaDA2.0-mini: 16B, 256 experts, 8 + 1 shared active)."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="small")
    parser.add_argument("--vocab", type=int, default=None, help="Override the shape's vocabulary size.")
    parser.add_argument("--block-size", type=int, default=4, help="Attention block of the model (SDAR's RL runs: 4).")
    parser.add_argument("--gen-length", type=int, default=256)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--batch", default="1,8", help="Rollout batch sizes, comma-separated.")
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--logit-std", type=float, default=25.0)
    parser.add_argument("--prompts", type=int, default=4, help="RLDF update: prompts (× --generations rows).")
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--ks", default="4,16", help="RLDF update: sampled states per completion.")
    parser.add_argument("--lora", action="store_true", help="Train LoRA adapters with gradient checkpointing (8B).")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(rollout.DTYPES), default=None, help="Default: bf16 on GPU, fp32 on CPU.")
    parser.add_argument("--repeats", type=int, default=1, help="Timed runs per row (interleaved; the median counts).")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-update", action="store_true")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    return args


def layout(args) -> str:
    return "LLaDA2 (Glm4Moe) layout" if "llada2" in args.shape else "SDAR layout"


def build_model(args):
    """A random SDAR- or LLaDA2-shaped block-diffusion model, created directly on ``args.device`` in ``args.dtype``."""
    from transformers import Glm4MoeForCausalLM, Qwen3ForCausalLM

    from dllm_trl.models import set_diffusion_properties
    from tests.tiny_models import LLADA2_MINI_SHAPE, SDAR_8B_SHAPE, tiny_llada2_config, tiny_sdar_config

    if "llada2" in args.shape:
        shape = dict(LLADA2_MINI_SHAPE, **(SMALL_LLADA2 if args.shape == "small-llada2" else {}))
        model_class, make_config = Glm4MoeForCausalLM, tiny_llada2_config
    else:
        shape = dict(SDAR_8B_SHAPE, **(SMALL if args.shape == "small" else {}))
        model_class, make_config = Qwen3ForCausalLM, tiny_sdar_config
    if args.vocab is not None:
        shape.update(vocab_size=args.vocab, mask_token_id=args.vocab - 1, eos_token_id=args.vocab - 2)
    mask_id = shape.pop("mask_token_id")
    config = make_config(**shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    with torch.device(args.device), rollout.default_dtype(rollout.DTYPES[args.dtype]):
        model = model_class(config)
    model.eval().requires_grad_(False)
    model = set_diffusion_properties(model, mask_token_id=mask_id, sampling="categorical", block_size=args.block_size)
    if args.logit_std:
        rollout.sharpen(model, make_prompts(args, model, 8), args.logit_std)
    return model


def make_prompts(args, model, batch):
    return rollout.make_prompts(argparse.Namespace(seed=args.seed, prompt_length=args.prompt_length, device=args.device),
                                 model, batch)


def generation_config(args, unmasking, cache, gen_length=None, **overrides):
    from dllm_trl import DiffusionGenerationConfig

    gen_length = gen_length or args.gen_length
    return DiffusionGenerationConfig(
        gen_length=gen_length, block_length=args.block_size, unmasking=unmasking, threshold=args.threshold,
        steps=gen_length // 2 if unmasking == "static" else None, cache=cache, stop_at_eos=False, **overrides,
    )


def rollout_table(model, args, batch: int, modes, title="Block-diffusion rollout"):
    """tokens/s of each (unmasking, cache) mode at ``batch``, rows printed as they are measured; "× no cache" and
    "= no-cache tokens" need the ``none`` cache of the same unmasking earlier in ``modes``."""
    config = model.config
    print(f"\n### {title}: {layout(args)} {args.shape} (d {config.hidden_size}, {config.num_hidden_layers} layers, vocab "
          f"{config.vocab_size}), {args.dtype}, {rollout.device_name(args.device)}\nbatch {batch}, prompt "
          f"{args.prompt_length}, gen {args.gen_length}, attention/decoding block {args.block_size}, threshold "
          f"{args.threshold}, static {args.gen_length // 2} steps, greedy, logit std {args.logit_std}, median of "
          f"{args.repeats}\n")
    print("| cache | unmasking | tokens/s | NFE | seconds | ms/step | × no cache | peak mem (GiB) | tokens/step "
          "| = no-cache tokens |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    prompts = make_prompts(args, model, batch)
    from dllm_trl import diffusion_generate

    for unmasking, cache in modes:  # warm-up: one block per mode
        diffusion_generate(model, prompts, generation_config=generation_config(args, unmasking, cache, args.block_size))
    runs = {mode: [] for mode in modes}
    tokens = batch * args.gen_length
    for repeat in range(args.repeats):
        for mode in modes:
            runs[mode].append(rollout.timed_generate(model, prompts, generation_config(args, *mode), args.device))
            if repeat + 1 < args.repeats:
                continue
            out = runs[mode][0][0]
            seconds = statistics.median(run[1] for run in runs[mode])
            reference = runs.get((mode[0], "none"))
            ratio = agree = "–"
            if reference and len(reference) == args.repeats:
                ratio = f"{statistics.median(run[1] for run in reference) / seconds:.2f}"
                agree = f"{(out.completion_ids == reference[0][0].completion_ids).float().mean().item():.0%}"
            per_step = tokens / out.num_steps.sum().item()
            peak = max(run[2] for run in runs[mode])
            print(f"| {mode[1]} | {mode[0]} | {tokens / seconds:.1f} | {out.nfe} | {seconds:.2f} | "
                  f"{1000 * seconds / out.nfe:.1f} | {ratio} | {peak:.2f} | {per_step:.2f} | {agree} |", flush=True)


# ------------------------------------------------------------------------------------------------ RLDF update
def per_state_logps(model, batch, steps, reads):
    """One forward per sampled state ``j`` (the unpacked path): ``[(rows, logps (rows, G))]``."""
    from dllm_trl.losses import noisy_state
    from dllm_trl.models import completion_token_logps, diffusion_config

    prompt, prompt_mask, rollout_ids, commit = batch
    out = []
    for j in range(steps.shape[1]):
        rows = (steps[:, j] >= 0).nonzero().squeeze(1)
        state = noisy_state(rollout_ids[rows], commit[rows], steps[rows, j], diffusion_config(model).mask_token_id)
        out.append((rows, completion_token_logps(model, prompt[rows], prompt_mask[rows], state, rollout_ids[rows],
                                                 read_mask=reads[rows, j])))
    return out


def packed_logps(model, batch, steps, reads):
    """Every sampled state in one packed forward: logps (R, k, G) (the trainer's ``_packed_state_logps``)."""
    from dllm_trl.losses.packed_states import pack_sampled_states, packed_read_positions
    from dllm_trl.models import attention_mask_dtype, diffusion_config, token_logps_at

    prompt, prompt_mask, rollout_ids, commit = batch
    config = diffusion_config(model)
    packed = pack_sampled_states(prompt, prompt_mask, rollout_ids, commit, steps, config.diffusion_block_size,
                                 config.mask_token_id, attention_mask_dtype(model))
    rows, columns, index = packed_read_positions(packed, reads, 0)
    logps = token_logps_at(model, rows, columns, rollout_ids[index[0], index[2]], input_ids=packed.input_ids,
                           attention_mask=packed.attention_mask, position_ids=packed.position_ids)
    return torch.zeros(reads.shape, device=logps.device).index_put(index, logps)


def rldf_update(model, batch, steps, valid, advantages, packed: bool, threshold=0.2):
    """One RLDF update's forward/backward work (REINFORCE, token normalisation): the no-grad π_old pass over the
    candidates, the clean targets, the loss and its backward (one per state unpacked, one in all packed).
    Returns the loss and the number of model forwards."""
    from dllm_trl.losses import policy_token_terms
    from dllm_trl.losses.estimators import estimator_candidates, estimator_targets
    from dllm_trl.models import diffusion_block_size

    _, _, rollout_ids, commit = batch
    block = diffusion_block_size(model)
    candidates = torch.stack([estimator_candidates("rldf", commit_step=commit, valid_mask=valid, step=steps[:, j],
                                                   block_size=block) for j in range(steps.shape[1])], 1)
    with torch.no_grad():
        if packed:
            old = packed_logps(model, batch, steps, candidates)
        else:
            old = torch.zeros(candidates.shape, device=candidates.device)
            for j, (rows, logps) in enumerate(per_state_logps(model, batch, steps, candidates)):
                old[rows, j] = logps
    targets = torch.stack([estimator_targets("rldf", commit_step=commit, valid_mask=valid, step=steps[:, j],
                                             clean_prob=old[:, j].exp(), clean_threshold=threshold, block_size=block)[0]
                           for j in range(steps.shape[1])], 1)
    count = targets.sum().clamp_min(1)
    if packed:
        logps = packed_logps(model, batch, steps, targets)
        terms, _ = policy_token_terms(logps, advantages)
        loss = (terms * targets).sum() / count
        loss.backward()
        forwards = 2
    else:
        loss, forwards = 0.0, 0
        for j in range(steps.shape[1]):
            (rows, logps), = per_state_logps(model, batch, steps[:, j : j + 1], targets[:, j : j + 1])
            if rows.numel() == 0:
                continue
            terms, _ = policy_token_terms(logps, advantages[rows])
            part = (terms * targets[rows, j]).sum() / count
            part.backward()
            loss = loss + part.detach()
            forwards += 2
    model.zero_grad(set_to_none=True)
    return float(loss.detach() if torch.is_tensor(loss) else loss), forwards


def update_table(model, args, ks, title="RLDF update on a block model"):
    """Packed vs one forward per state at each k, on one rollout (temperature 1, dynamic, block cache)."""
    from dllm_trl import diffusion_generate
    from dllm_trl.losses import sample_timesteps, step_uncertainty

    rows = args.prompts * args.generations
    prompts = make_prompts(args, model, args.prompts).repeat_interleave(args.generations, 0)
    mask = torch.ones_like(prompts)
    out = diffusion_generate(model, prompts, mask, generation_config(args, "dynamic", "dual", temperature=1.0, seed=0))
    steps_total = int(out.num_steps.max())
    uncertainty, has = step_uncertainty(out.commit_step, out.commit_prob, out.completion_mask, steps_total)
    batch = (prompts, mask, out.completion_ids, out.commit_step)
    advantages = torch.randn(rows, device=args.device, generator=torch.Generator(args.device).manual_seed(1))
    generator = torch.Generator(device=args.device).manual_seed(0)
    unit = "GPU peak MiB" if torch.device(args.device).type == "cuda" else "peak RSS growth MiB"
    print(f"\n### {title}: {layout(args)} {args.shape}, {args.dtype}{', LoRA + gradient checkpointing' if args.lora else ''}"
          f", {rollout.device_name(args.device)}\n{rows} rows ({args.prompts} prompts × {args.generations}), prompt "
          f"{args.prompt_length}, gen {args.gen_length}, block {args.block_size}, {steps_total} decoding steps (mean "
          f"{out.num_steps.float().mean():.0f}/row); π_old pass + loss forward/backward (REINFORCE, c = 0.2), median "
          f"of {args.repeats}\n")
    print(f"| k | one forward per state (s) | packed (s) | speed-up | forwards per state / packed | {unit} per state "
          "| packed | \\|Δ loss\\| |\n|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    model.train()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if torch.device(args.device).type == "cuda" else (
        contextlib.nullcontext())
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
    for k in ks:
        steps = sample_timesteps(uncertainty, has, k, 1.0, generator)
        results = {True: [], False: []}
        with autocast:
            rldf_update(model, batch, steps, out.completion_mask, advantages, packed=True)  # warm-up
            for _ in range(args.repeats):
                for packed in (False, True):
                    with PeakMemory(args.device) as memory:
                        sync()
                        start = time.perf_counter()
                        loss, forwards = rldf_update(model, batch, steps, out.completion_mask, advantages, packed)
                        sync()
                        seconds = time.perf_counter() - start
                    results[packed].append((seconds, memory.peak, loss, forwards))
        unpacked_s = statistics.median(r[0] for r in results[False])
        packed_s = statistics.median(r[0] for r in results[True])
        delta = abs(results[True][0][2] - results[False][0][2])
        print(f"| {k} | {unpacked_s:.2f} | {packed_s:.2f} | {unpacked_s / packed_s:.2f} | {results[False][0][3]} / "
              f"{results[True][0][3]} | {max(r[1] for r in results[False]):.0f} | {max(r[1] for r in results[True]):.0f} "
              f"| {delta:.1e} |", flush=True)
    model.eval()


def enable_lora(model):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    return model


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    modes = [(u, c) for u in ("dynamic", "static") for c in ("none", "dual")]
    for batch in [int(b) for b in args.batch.split(",")]:
        rollout_table(model, args, batch, modes)
    if args.skip_update:
        return
    if args.lora:
        model = enable_lora(model)
    else:
        model.requires_grad_(True)
    update_table(model, args, [int(k) for k in args.ks.split(",")])


if __name__ == "__main__":
    main()
