"""DiffusionGemma rollout throughput: vLLM's native engine beside our recording sampler (issue 33, item 4).

* ours: ``DiffusionGemmaSampler`` (records every step: what RLDF trains on) on a random transformers model of the
  shape, bf16 on the GPU;
* vLLM: ``vllm.LLM(model=<folder>, load_format="dummy")`` on a folder holding only the shape's ``config.json`` and a
  ``generation_config.json`` with the same decoding settings (:func:`write_engine_folder`; dummy weights, no download),
  ``--vllm-quantization fp8`` in the GPU suite (the anchor's precision), ``ignore_eos`` so every row writes
  ``gen_length`` tokens; returns the final canvases only.

Both at batch 1 and ``--batch``, tokens/s = rows × gen_length / seconds, beside the anchor: DiffusionGemma-26B-A4B on
vLLM, 1,757 tokens/s at batch 1 (H100, FP8; real weights, which stop canvases early — random weights never meet the
stopping rule, so both sides here run every one of the ``--steps`` steps per canvas; ``--sharpen`` above 1 would let
ours stop early, the default keeps the two alike).

vLLM's DiffusionGemma runs only on its Model Runner V2, which needs Triton with a driver: on a CPU, vLLM's CPU build
refuses it (``Model Runner V1 does not support: diffusion models``), and its Gemma 4 import needs a torchvision built
for the installed torch (``docs/vllm.md``, "DiffusionGemma on vLLM"); the stage then prints the blocker and times ours.
The GPU image has no vLLM, and vLLM 0.31.0's CUDA wheel (320.6 MB, pinning torch 2.13.0) cannot travel to the device
(64 MiB a call): on it the stage times ours and says so. ::

    python benchmarks/diffusion_gemma_vllm.py                                       # CPU, small shape
    python benchmarks/diffusion_gemma_vllm.py --shape 26b-a4b --device cuda --dtype bfloat16 --batch 8 --steps 48 \\
        --prompt-length 128 --gen-length 256 --vllm-quantization fp8
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

ANCHOR = "DiffusionGemma-26B-A4B on vLLM (issue 33's anchor: H100, FP8, real weights) | 1 | 1757 | | |"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["small", "26b-a4b"], default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=2, help="The larger batch (batch 1 always runs).")
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--gen-length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="max_denoising_steps per canvas (both sides).")
    parser.add_argument("--sharpen", type=float, default=1.0,
                        help="Our model's final norm × this (1: random logits, every step runs, as vLLM's dummy weights).")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vllm-quantization", default="none", help="vLLM's `quantization` ('fp8', or 'none').")
    parser.add_argument("--vllm-enforce-eager", action="store_true", help="No CUDA graphs / torch.compile in vLLM.")
    parser.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--engine-dir", default="/tmp/dllm_trl_diffusion_gemma_vllm",
                        help="Where the engine's config-only model folder is written.")
    return parser.parse_args(argv)


def write_engine_folder(path, shape: dict, max_denoising_steps: int, entropy_bound: float = 0.1, t_min: float = 0.4,
                        t_max: float = 0.8, stability_threshold: int = 1, confidence_threshold: float = 0.005,
                        eos_token_id: int = 1, pad_token_id: int = 0) -> Path:
    """A model folder vLLM can serve with ``load_format="dummy"``: ``config.json`` of a DiffusionGemma of ``shape``
    (``tests/tiny_models.py``'s ``tiny_diffusion_gemma_config`` fields) and a ``generation_config.json`` with the decoding
    settings vLLM's DiffusionGemma reads (``EntropyBoundSamplerConfig``, the temperature schedule, the stopping rule;
    ``DiffusionGemmaSamplerConfig``'s defaults). No weights, no tokenizer."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
        EntropyBoundSamplerConfig,
    )

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/tiny_models.py
    from tests.tiny_models import tiny_diffusion_gemma_config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_diffusion_gemma_config(**shape, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    config.architectures = ["DiffusionGemmaForBlockDiffusion"]
    config.save_pretrained(path)
    generation = DiffusionGemmaGenerationConfig(
        max_denoising_steps=max_denoising_steps, sampler_config=EntropyBoundSamplerConfig(entropy_bound=entropy_bound),
        t_min=t_min, t_max=t_max, stability_threshold=stability_threshold,
        confidence_threshold=confidence_threshold, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
    )
    generation.save_pretrained(path)
    return path


def shape_of(args) -> dict:
    from diffusion_gemma import SHAPES

    return dict(SHAPES[args.shape])


def prompts_for(batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab - 4, (batch, length), generator=torch.Generator().manual_seed(0))


def time_ours(args, batches) -> list[str]:
    """Rows of our recording sampler at each batch size (after a one-canvas warm-up)."""
    import diffusion_gemma
    from dllm_trl.generation import DiffusionGemmaSampler, DiffusionGemmaSamplerConfig
    from device_memory import sync

    model = diffusion_gemma.build_model(argparse.Namespace(shape=args.shape, device=args.device, dtype=args.dtype,
                                                           sharpen=args.sharpen, trainable="all"))
    vocab, canvas = model.config.text_config.vocab_size, model.config.canvas_length
    settings = dict(max_denoising_steps=args.steps, eos_token_id=vocab - 4, pad_token_id=0)
    DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=canvas, **settings))(
        model, prompts_for(1, args.prompt_length, vocab).to(args.device))
    rows = []
    for batch in batches:
        sampler = DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=args.gen_length, **settings))
        prompts = prompts_for(batch, args.prompt_length, vocab).to(args.device)
        sync(args.device)
        start = time.perf_counter()
        output = sampler(model, prompts)
        sync(args.device)
        seconds = time.perf_counter() - start
        steps = output.num_steps.float().mean().item() / (args.gen_length // canvas)
        rows.append(f"| ours: DiffusionGemmaSampler (records every step), {args.dtype} | {batch} | "
                    f"{batch * args.gen_length / seconds:.1f} | {seconds:.2f} | {steps:.1f} |")
        print(rows[-1], flush=True)
    del model
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    return rows


def vllm_blocker() -> str | None:
    """Why vLLM cannot run here, or None when it is importable."""
    if importlib.util.find_spec("vllm") is None:
        return ("vllm is not installed here (the GPU image has none; vLLM 0.31.0's CUDA wheel is 320.6 MB and pins "
                "torch 2.13.0, against the 64 MiB a device call carries: docs/vllm.md)")
    return None


def time_vllm(args, batches) -> list[str]:
    """Rows of vLLM's native DiffusionGemma at each batch size (after a one-prompt warm-up), on dummy weights."""
    from vllm import LLM, SamplingParams

    shape = shape_of(args)
    vocab = shape["vocab_size"]
    folder = write_engine_folder(args.engine_dir, shape, args.steps, eos_token_id=vocab - 4)
    quantization = None if args.vllm_quantization == "none" else args.vllm_quantization
    engine = LLM(model=str(folder), load_format="dummy", dtype=args.dtype, quantization=quantization,
                 skip_tokenizer_init=True, enforce_eager=args.vllm_enforce_eager, seed=0,
                 max_model_len=args.prompt_length + args.gen_length + shape["canvas_length"],
                 max_num_seqs=max(batches), gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                 limit_mm_per_prompt={"image": 0, "video": 0})
    params = SamplingParams(max_tokens=args.gen_length, ignore_eos=True, detokenize=False)
    engine.generate([{"prompt_token_ids": prompts_for(1, args.prompt_length, vocab)[0].tolist()}], params,
                    use_tqdm=False)
    rows = []
    for batch in batches:
        requests = [{"prompt_token_ids": p.tolist()} for p in prompts_for(batch, args.prompt_length, vocab)]
        start = time.perf_counter()
        outputs = engine.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rows.append(f"| vLLM {getattr(__import__('vllm'), '__version__', '?')} native, {args.dtype}"
                    f"{', ' + quantization if quantization else ''}, dummy weights | {batch} | {tokens / seconds:.1f} | "
                    f"{seconds:.2f} | ≤ {args.steps} |")
        print(rows[-1], flush=True)
    return rows


def main(argv=None, raise_vllm_errors: bool = True):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [1, args.batch] if args.batch > 1 else [1]
    print(f"\n### DiffusionGemma rollout: vLLM's native engine beside ours ({args.shape} shape, prompt "
          f"{args.prompt_length}, gen {args.gen_length}, {args.steps} steps per canvas)\n")
    print("| rollout | batch | tokens/s | seconds | steps per canvas |\n|---|---:|---:|---:|---:|", flush=True)
    if args.shape == "26b-a4b":
        print(f"| {ANCHOR}", flush=True)
    time_ours(args, batches)
    blocker = vllm_blocker()
    if blocker is None:
        try:
            time_vllm(args, batches)
        except Exception as error:  # noqa: BLE001 — the engine's own refusal is the finding on a CPU
            if raise_vllm_errors:
                raise
            lines = [line.split(" [type=")[0].strip() for line in str(error).splitlines() if line.strip()]
            blocker = f"vLLM's engine refused: {type(error).__name__}: {' / '.join(lines[:2])}"[:500]
    if blocker is not None:
        print(f"\nvLLM side not timed: {blocker}\n", flush=True)
    print(json.dumps({"shape": args.shape, "batches": batches, "vllm_blocker": blocker}))


if __name__ == "__main__":
    main(raise_vllm_errors=False)
