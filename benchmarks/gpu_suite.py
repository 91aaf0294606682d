"""Stages of the prepared GPU suite (issue 10); ``gpu_suite.sh`` runs each in its own process with its own time
limit. Every stage builds its random model directly on the device (8B never touches the CPU), prints Markdown
tables row by row (a stage stopped at its limit keeps what it measured) and, with ``--cpu-rehearsal``, runs the
same code at toy shapes on the CPU.

    python benchmarks/gpu_suite.py STAGE [--cpu-rehearsal]

Stages:
* ``rollout-llada`` / ``rollout-dream``: LLaDA-8B / Dream-7B shapes, gen 256, cache none / prefix / dual,
  dynamic 0.9 (LM head sharpened to logit std 25, so several tokens clear the threshold per step) and static
  (one token per step, NFE 256); batch 1 and 8, a subset at batch 32.
* ``rldf``: LLaDA-8B bf16 + LoRA, 8 prompts × 4 generations: the rollout, then the RLDF update at k = 16 (the
  loss loop of ``train_step.py``).
* ``qlora``: LLaDA-8B with its decoder's linear layers in 4-bit NF4 (bitsandbytes) + LoRA, two RLDF steps
  (rollout + update at k = 8 on 2 prompts × 4 generations, the QLoRA notebook's settings), peak memory.
* ``fastdllm``: the public Fast-dLLM LLaDA ``generate.py`` (directory in ``$FASTDLLM_DIR``) against our sampler
  on the same random weights at batch 1, and our batch-32 aggregate beside it.
* ``dppo``: ``dppo_mask_cost.py`` (bf16 logits, 4 × 512 tokens, V = 126464), its output in a code block.
* ``block``: an SDAR-8B-shaped (Qwen3-8B) block-diffusion model, blocks of 4 (``block_diffusion.py``): the rollout
  at batch 8, gen 256, dynamic 0.9, exact block cache against no cache; then the RLDF update with LoRA r16 and
  gradient checkpointing, the k sampled states of each completion packed into one forward against one forward per
  state, at k = 16 and 4 (8 rows).
* ``llada2``: a LLaDA2.0-mini-shaped MoE block model (``Glm4MoeForCausalLM``, 16B, 256 experts, blocks of 32): the
  rollout at batch 8, gen 256, dynamic 0.9, exact block cache against no cache, peak memory; then one RLDF update
  (LoRA r16 on attention and the dense / shared-expert MLPs, gradient checkpointing, k = 4, packed vs per state).
* ``diffusion_gemma``: a DiffusionGemma-26B-A4B-shaped model (``diffusion_gemma.py``, bf16, canvas 256, 48 steps):
  our recording rollout against ``model.generate`` at batch 8, gen 256 (tokens/s, = generate tokens), then one RLDF
  update at k = 4 with the attention projections trainable.
* ``diffusion_gemma_vllm``: the same shape on vLLM's native DiffusionGemma (``diffusion_gemma_vllm.py``: dummy
  weights, FP8) beside our recording sampler, batch 1 and 8, gen 256, 48 steps, next to the 1,757 tokens/s anchor;
  only ours where vLLM is not installed (the GPU image; see ``docs/vllm.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/tiny_models.py

import torch

import rollout
from device_memory import peak_gib, sync

HERE = Path(__file__).resolve().parent
GPU, CPU = "gpu", "cpu"


def rollout_args(kind: str, shape: str, **overrides) -> SimpleNamespace:
    """rollout.py's arguments for this suite: gen 256 on the GPU, toy sizes in the rehearsal."""
    gpu = kind == GPU
    args = rollout.parse_args([])
    args.shape = shape
    args.device = "cuda" if gpu else "cpu"
    args.dtype = "bfloat16" if gpu else "float32"
    args.logit_std = 25.0
    args.threads = None if gpu else 1
    if not gpu:
        args.vocab, args.prompt_length, args.gen_length = 2000, 16, 64
    args.steps = args.gen_length
    for key, value in overrides.items():
        setattr(args, key, value)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def stage_rollout(kind: str, family: str):
    """Cache none / prefix / dual × dynamic / static at batch 1 and 8, a subset at 32 (batches 1 / 2 / 4 in the
    rehearsal), most telling rows first so that the time limit cuts the least useful ones."""
    gpu = kind == GPU
    args = rollout_args(kind, {"llada": "llada-8b", "dream": "dream-7b"}[family] if gpu else
                        {"llada": "small", "dream": "small-dream"}[family])
    small, medium, large = (1, 8, 32) if gpu else (1, 2, 4)
    grid = [(u, c) for u in ("dynamic", "static") for c in ("none", "prefix", "dual")]
    model = rollout.prepare(args)
    title = f"Rollout {family}"
    rollout.rollout_table(model, args, small, grid, title)
    rollout.rollout_table(model, args, large, [("dynamic", "dual"), ("static", "dual")], title)
    rollout.rollout_table(model, args, medium, grid, title)


def stage_rldf(kind: str):
    """The RLDF update at k = 16 against the rollout of the same batch (bf16 + LoRA on the GPU)."""
    import train_step
    from dllm_trl import DiffusionGenerationConfig, diffusion_generate
    from dllm_trl.losses import sample_timesteps, step_uncertainty

    gpu = kind == GPU
    device = "cuda" if gpu else "cpu"
    if not gpu:
        torch.set_num_threads(1)
    args = SimpleNamespace(shape="llada-8b" if gpu else "small", device=device, vocab=None if gpu else 2000, sharpen=8.0)
    prompts, generations, gen, prompt_length = (8, 4, 256, 128) if gpu else (2, 2, 32, 16)
    torch.manual_seed(0)
    model = train_step.build_model(args)
    mask_id, vocab = model.config.mask_token_id, model.config.vocab_size
    batch = prompts * generations
    prompt = torch.randint(2, vocab - 2, (prompts, prompt_length), device=device).repeat_interleave(generations, 0)
    prompt_mask = torch.ones_like(prompt)
    config = DiffusionGenerationConfig(gen_length=gen, block_length=32, cache="dual", temperature=1.0,
                                       stop_at_eos=False, seed=0)
    print(f"\n### RLDF update vs rollout: {'LLaDA-8B bf16 + LoRA r16, gradient checkpointing' if gpu else 'toy'}, "
          f"{batch} rows ({prompts} prompts × {generations}), prompt {prompt_length}, gen {gen}, dynamic 0.9, "
          f"dual cache, temperature 1\n")
    print("| phase | seconds | × rollout | peak GiB |\n|---|---:|---:|---:|", flush=True)
    model.eval()
    diffusion_generate(model, prompt, prompt_mask, DiffusionGenerationConfig(gen_length=32, block_length=32, cache="dual"))
    memory = {}
    with peak_gib(device, memory):
        start = time.perf_counter()
        out = diffusion_generate(model, prompt, prompt_mask, config)
        sync(device)
        rollout_seconds = time.perf_counter() - start
    print(f"| rollout (NFE {out.nfe}, {out.num_steps.float().mean():.0f} steps/row) | {rollout_seconds:.2f} | 1.00 "
          f"| {memory['peak']:.1f} |", flush=True)
    steps_total = int(out.num_steps.max())
    uncertainty, has = step_uncertainty(out.commit_step, out.commit_prob, out.completion_mask, steps_total)
    advantages = torch.randn(batch, device=device)
    rollout_batch = (prompt, prompt_mask, out.completion_ids, out.commit_step, out.completion_mask)
    generator = torch.Generator(device=device).manual_seed(0)
    model.train()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if gpu else contextlib.nullcontext()
    for k in (16, 4):
        sampled = sample_timesteps(uncertainty, has, k, 1.0, generator)
        with autocast, peak_gib(device, memory):
            start = time.perf_counter()
            train_step.rldf_update(model, rollout_batch, sampled, advantages, mask_id)
            sync(device)
            seconds = time.perf_counter() - start
        print(f"| RLDF update k={k} (π_old pass + per-step backward) | {seconds:.2f} | {seconds / rollout_seconds:.2f} "
              f"| {memory['peak']:.1f} |", flush=True)


def quantize_decoder_4bit(model, compute_dtype):
    """Swap every linear layer of the decoder blocks for a bitsandbytes NF4 ``Linear4bit`` (double quantisation),
    quantising the weights where they are; embeddings, norms and the LM head stay as they were."""
    import bitsandbytes as bnb

    device = model.get_input_embeddings().weight.device
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, linear in list(parent.named_children()):
                if not isinstance(linear, torch.nn.Linear):
                    continue
                quantized = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                              compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                                              device="meta")
                quantized.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, compress_statistics=True,
                                                     quant_type="nf4", module=quantized)
                if linear.bias is not None:
                    quantized.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
                setattr(parent, name, quantized.to(device))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model


def stage_qlora(kind: str):
    """8B in 4-bit + LoRA: two RLDF steps (rollout + update), peak memory against the 24 GB target."""
    import train_step
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from dllm_trl import DiffusionGenerationConfig, diffusion_generate
    from dllm_trl.losses import sample_timesteps, step_uncertainty
    from dllm_trl.models import set_diffusion_properties
    from tests.tiny_models import LLADA_8B_SHAPE, tiny_llada_config

    gpu = kind == GPU
    device = "cuda" if gpu else "cpu"
    if not gpu:
        torch.set_num_threads(1)
    shape = dict(LLADA_8B_SHAPE) if gpu else dict(LLADA_8B_SHAPE, **rollout.SHAPE_OVERRIDES, vocab_size=2000,
                                                      mask_token_id=1999, eos_token_id=1998)
    mask_id, eos = shape.pop("mask_token_id"), shape.pop("eos_token_id")
    config = tiny_llada_config(eos_token_id=eos, **shape)
    config._attn_implementation = "sdpa"
    compute_dtype = torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(0)
    with torch.device(device), rollout.default_dtype(compute_dtype):
        model = LlamaForCausalLM(config)
    set_diffusion_properties(model, mask_token_id=mask_id)
    quantize_decoder_4bit(model, compute_dtype)
    model.requires_grad_(False)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # as train_step.py: confidences clear the threshold
    model = get_peft_model(model, LoraConfig(r=32, lora_alpha=64, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    after_build = torch.cuda.memory_allocated() / 2**30 if gpu else float("nan")
    prompts, generations, gen, prompt_length, k = (2, 4, 256, 128, 8) if gpu else (1, 2, 32, 16, 4)
    batch = prompts * generations
    generator = torch.Generator(device=device).manual_seed(0)
    # AdamW's states for the adapters, allocated up front so that the peak includes them (train_step's loop
    # clears the gradients after its backward, so the steps below measure forward/backward without the update).
    adapters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(adapters, lr=1e-5)
    for p in adapters:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"\n### 4-bit 8B + LoRA: {'LLaDA-8B' if gpu else 'toy'} decoder in NF4 (double quant, compute "
          f"{str(compute_dtype).replace('torch.', '')}), LoRA r32 on every projection, gradient checkpointing, "
          f"{batch} rows ({prompts} × {generations}), prompt {prompt_length}, gen {gen}, k = {k}, AdamW states "
          f"allocated; "
          f"{after_build:.1f} GiB allocated after building\n")
    print("| RLDF step | rollout s | update s | NFE | peak GiB (target < 24 GB = 22.4 GiB) |\n|---:|---:|---:|---:|---:|",
          flush=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if gpu else contextlib.nullcontext()
    for step in range(2):
        prompt = torch.randint(2, config.vocab_size - 2, (prompts, prompt_length), device=device, generator=generator)
        prompt = prompt.repeat_interleave(generations, 0)
        prompt_mask = torch.ones_like(prompt)
        memory = {}
        with peak_gib(device, memory):
            model.eval()
            start = time.perf_counter()
            cfg = DiffusionGenerationConfig(gen_length=gen, block_length=32, cache="dual", temperature=1.0,
                                            stop_at_eos=False, seed=step)
            out = diffusion_generate(model, prompt, prompt_mask, cfg)
            sync(device)
            rollout_seconds = time.perf_counter() - start
            steps_total = int(out.num_steps.max())
            uncertainty, has = step_uncertainty(out.commit_step, out.commit_prob, out.completion_mask, steps_total)
            sampled = sample_timesteps(uncertainty, has, k, 1.0, generator)
            model.train()
            start = time.perf_counter()
            with autocast:
                train_step.rldf_update(model, (prompt, prompt_mask, out.completion_ids, out.commit_step,
                                               out.completion_mask), sampled, torch.randn(batch, device=device), mask_id)
            sync(device)
            update_seconds = time.perf_counter() - start
        print(f"| {step + 1} | {rollout_seconds:.2f} | {update_seconds:.2f} | {out.nfe} | {memory['peak']:.1f} |", flush=True)


def fastdllm_model(llama, fastdllm_dir: Path):
    """Fast-dLLM's own LLaDA model (OLMo-style code) holding ``llama``'s weights, built on ``llama``'s device, and
    its generate module. Our LLaMA names map onto LLaDA's through the loader's table (SPEC §4)."""
    import re

    from dllm_trl.families.llada import LLADA_KEY_MAPPING

    sys.path.insert(0, str(fastdllm_dir))
    import generate as fast_generate
    from model.configuration_llada import ActivationType, BlockType, LayerNormType, ModelConfig
    from model.modeling_llada import LLaDAModel

    c = llama.config
    weight = llama.get_input_embeddings().weight
    config = ModelConfig(
        d_model=c.hidden_size, n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads,
        n_layers=c.num_hidden_layers, mlp_hidden_size=c.intermediate_size, activation_type=ActivationType.silu,
        block_type=BlockType.llama, layer_norm_type=LayerNormType.rms, rms_norm_eps=c.rms_norm_eps, rope=True,
        rope_theta=c.rope_parameters["rope_theta"], rope_full_precision=True, include_bias=False,
        include_qkv_bias=False, weight_tying=False, vocab_size=c.vocab_size, embedding_size=c.vocab_size,
        max_sequence_length=4096, attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0,
        flash_attention=False, alibi=False, scale_logits=False, mask_token_id=c.mask_token_id,
        eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id, init_device="meta",
    )
    with rollout.default_dtype(weight.dtype):
        llada = LLaDAModel(config, init_params=False)
    # LLaDAModel switches the memory-efficient SDPA kernel off for the whole process; ours may need it.
    torch.backends.cuda.enable_mem_efficient_sdp(True)
    llada = llada.to_empty(device=weight.device).eval().requires_grad_(False)
    ours = llama.state_dict()
    with torch.no_grad():
        for name, tensor in llada.state_dict().items():
            source = "model." + name
            for pattern, replacement in LLADA_KEY_MAPPING.items():
                source = re.sub(pattern, replacement, source)
            tensor.copy_(ours[source])

    class FastDllmLM(torch.nn.Module):
        """The interface Fast-dLLM's generate functions call (``model(x, past_key_values=, use_cache=,
        replace_position=).logits / .past_key_values``, ``model.device``) over the bare LLaDAModel."""

        def __init__(self):
            super().__init__()
            self.llada = llada

        @property
        def device(self):
            return weight.device

        def forward(self, input_ids, past_key_values=None, use_cache=False, replace_position=None):
            out = self.llada(input_ids, past_key_values=past_key_values, use_cache=use_cache,
                             replace_position=replace_position)
            return SimpleNamespace(logits=out.logits, past_key_values=out.attn_key_values)

    return FastDllmLM(), fast_generate


def stage_fastdllm(kind: str):
    """Fast-dLLM's generate / prefix / dual cache at batch 1 against ours, same weights, same settings."""
    from dllm_trl import diffusion_generate

    fastdllm_dir = os.environ.get("FASTDLLM_DIR")
    if not fastdllm_dir or not (Path(fastdllm_dir) / "generate.py").exists():
        print(f"\n### Fast-dLLM side by side: skipped — FASTDLLM_DIR={fastdllm_dir!r} does not hold Fast-dLLM's "
              "llada/generate.py (see benchmarks/gpu_wheels.sh)\n")
        return
    try:
        import einops  # noqa: F401  (Fast-dLLM's model code needs it; the GPU image has it)
    except ImportError:
        print("\n### Fast-dLLM side by side: skipped — Fast-dLLM's model code needs `einops` (pip install einops)\n")
        return
    gpu = kind == GPU
    args = rollout_args(kind, "llada-8b" if gpu else "small")
    model = rollout.prepare(args)
    theirs, fast_generate = fastdllm_model(model, Path(fastdllm_dir))
    mask_id = model.config.mask_token_id
    prompt = rollout.make_prompts(args, model, 1)
    gen, block = args.gen_length, args.block_length
    functions = {"none": fast_generate.generate, "prefix": fast_generate.generate_with_prefix_cache,
                 "dual": fast_generate.generate_with_dual_cache}
    print(f"\n### Fast-dLLM `generate.py` vs ours, batch 1, same random {'LLaDA-8B' if gpu else 'toy'} weights "
          f"({args.dtype}, logit std {args.logit_std}), prompt {args.prompt_length}, gen {gen}, block {block}, greedy; "
          f"static = one token per step\n")
    print("| cache | unmasking | Fast-dLLM tokens/s | ours tokens/s | ours / Fast-dLLM | NFE Fast-dLLM / ours "
          "| tokens = Fast-dLLM |\n|---|---|---:|---:|---:|---:|---:|", flush=True)
    best_fast = 0.0
    for unmasking in ("dynamic", "static"):
        for cache in ("none", "prefix", "dual"):
            threshold = args.threshold if unmasking == "dynamic" else None
            run_theirs = lambda length=gen: functions[cache](theirs, prompt, steps=length, gen_length=length, block_length=block,
                                                  temperature=0.0, remasking="low_confidence", mask_id=mask_id,
                                                  threshold=threshold)
            config = rollout.generation_config(args, unmasking, cache)
            run_theirs(block)  # warm-up: one block
            diffusion_generate(model, prompt, generation_config=rollout.generation_config(args, unmasking, cache, block))
            sync(args.device)
            start = time.perf_counter()
            canvas, their_nfe = run_theirs()
            sync(args.device)
            their_seconds = time.perf_counter() - start
            out, our_seconds, _, _ = rollout.timed_generate(model, prompt, config, args.device)
            same = (canvas[:, args.prompt_length:] == out.completion_ids).float().mean().item()
            best_fast = max(best_fast, gen / their_seconds)
            print(f"| {cache} | {unmasking} | {gen / their_seconds:.1f} | {gen / our_seconds:.1f} "
                  f"| {their_seconds / our_seconds:.2f} | {their_nfe} / {out.nfe} | {same:.0%} |", flush=True)
    large = 32 if gpu else 4
    prompts = rollout.make_prompts(args, model, large)
    diffusion_generate(model, prompts, generation_config=rollout.generation_config(args, "dynamic", "dual", block))
    out, seconds, peak, _ = rollout.timed_generate(model, prompts, rollout.generation_config(args, "dynamic", "dual"), args.device)
    aggregate = large * gen / seconds
    print(f"\nOurs at batch {large} (dual cache, dynamic): {aggregate:.1f} tokens/s aggregate (peak {peak:.1f} GiB) = "
          f"**{aggregate / best_fast:.1f}×** Fast-dLLM's best batch-1 figure ({best_fast:.1f} tokens/s; target ≥ 10×)\n",
          flush=True)


def stage_dppo(kind: str):
    """``dppo_mask_cost.py`` on 4 × 512 tokens (its inputs are drawn on the CPU: 8 × 1024 would take most of the
    stage's time)."""
    argv = ["--device", "cuda", "--batch", "4", "--length", "512", "--repeats", "10"] if kind == GPU else [
        "--device", "cpu", "--batch", "1", "--length", "32", "--vocab", "2000", "--repeats", "2"]
    print(f"\n### DPPO mask cost (`dppo_mask_cost.py {' '.join(argv)}`)\n\n```", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1") if kind == CPU else None
    try:
        subprocess.run([sys.executable, str(HERE / "dppo_mask_cost.py"), *argv], check=True, env=env)
    finally:
        print("```", flush=True)


def stage_block(kind: str):
    """The SDAR-8B shape: rollout exact block cache vs none, then the RLDF update packed vs one forward per state."""
    import block_diffusion

    gpu = kind == GPU
    shape = ["--shape", "sdar-8b", "--device", "cuda"] if gpu else [
        "--shape", "small", "--device", "cpu", "--vocab", "2000", "--prompt-length", "16", "--gen-length", "32",
        "--threads", "1"]
    args = block_diffusion.parse_args(shape + ["--prompts", "4" if gpu else "2", "--generations", "2", "--lora"])
    if args.threads:
        torch.set_num_threads(args.threads)
    model = block_diffusion.build_model(args)
    block_diffusion.rollout_table(model, args, 8 if gpu else 2, [("dynamic", "none"), ("dynamic", "dual")],
                                  "Block-diffusion rollout (SDAR-8B shape)" if gpu else "Block-diffusion rollout")
    block_diffusion.update_table(block_diffusion.enable_lora(model), args, [16, 4])


def stage_llada2(kind: str):
    """The LLaDA2.0-mini shape: rollout exact block cache vs none at batch 8, then one RLDF update with LoRA."""
    import block_diffusion

    gpu = kind == GPU
    shape = ["--shape", "llada2-mini", "--device", "cuda", "--block-size", "32"] if gpu else [
        "--shape", "small-llada2", "--device", "cpu", "--vocab", "2000", "--prompt-length", "16", "--gen-length",
        "32", "--block-size", "8", "--threads", "1"]
    args = block_diffusion.parse_args(shape + ["--prompts", "2", "--generations", "2", "--lora"])
    if args.threads:
        torch.set_num_threads(args.threads)
    model = block_diffusion.build_model(args)
    block_diffusion.rollout_table(model, args, 8 if gpu else 2, [("dynamic", "none"), ("dynamic", "dual")],
                                  "LLaDA2 rollout (LLaDA2.0-mini shape)" if gpu else "LLaDA2 rollout")
    block_diffusion.update_table(block_diffusion.enable_lora(model), args, [4])


def stage_diffusion_gemma(kind: str):
    """The DiffusionGemma-26B-A4B shape: the recording rollout against ``generate``, then one RLDF update."""
    import diffusion_gemma

    gpu = kind == GPU
    diffusion_gemma.main(
        ["--shape", "26b-a4b", "--device", "cuda", "--dtype", "bfloat16", "--batch", "8", "--prompt-length", "128",
         "--gen-length", "256", "--steps", "48", "--k", "4", "--trainable", "attention"] if gpu else
        ["--batch", "2", "--prompt-length", "16", "--gen-length", "64", "--steps", "8", "--k", "2", "--threads", "1"]
    )


def stage_diffusion_gemma_vllm(kind: str):
    """The DiffusionGemma-26B-A4B shape: vLLM's native rollout (dummy weights, FP8) beside our recording sampler at
    batch 1 and 8, next to the anchor (1,757 tokens/s at batch 1, H100, FP8). Without vLLM on the machine (the GPU
    image has none, and its wheel cannot travel: ``docs/vllm.md``) only ours is timed, with the reason printed."""
    import diffusion_gemma_vllm

    gpu = kind == GPU
    diffusion_gemma_vllm.main(
        ["--shape", "26b-a4b", "--device", "cuda", "--dtype", "bfloat16", "--batch", "8", "--prompt-length", "128",
         "--gen-length", "256", "--steps", "48", "--vllm-quantization", "fp8"] if gpu else
        ["--batch", "2", "--prompt-length", "16", "--gen-length", "64", "--steps", "8", "--threads", "1",
         "--vllm-enforce-eager"],
        raise_vllm_errors=gpu,
    )


STAGES = {
    "rollout-llada": lambda kind: stage_rollout(kind, "llada"),
    "rollout-dream": lambda kind: stage_rollout(kind, "dream"),
    "rldf": stage_rldf,
    "qlora": stage_qlora,
    "fastdllm": stage_fastdllm,
    "dppo": stage_dppo,
    "block": stage_block,
    "llada2": stage_llada2,
    "diffusion_gemma": stage_diffusion_gemma,
    "diffusion_gemma_vllm": stage_diffusion_gemma_vllm,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=sorted(STAGES))
    parser.add_argument("--cpu-rehearsal", action="store_true", help="Toy shapes on the CPU.")
    args = parser.parse_args()
    kind = CPU if args.cpu_rehearsal else GPU
    if kind == GPU and not torch.cuda.is_available():
        raise SystemExit("No CUDA device: run the GPU suite on the GPU machine, or pass --cpu-rehearsal.")
    STAGES[args.stage](kind)


if __name__ == "__main__":
    main()
