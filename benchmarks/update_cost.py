"""Cost of the trainers' own update, main before issue 10 vs this checkout, side by side in one run.

Every row runs the real trainer code (not a copy of it) on one fabricated batch, in a fresh process per measurement
(``before_after.py``: main's ``src/`` exported from commit ``--baseline``), interleaved repeats, medians:

* ``rldf k=…``: an on-policy RLDF update of a micro-batch, REINFORCE, "token" normalisation —
  ``_generate_and_score_completions``' target work (main: a no-grad π_old pass over the k states; now: none, the
  loss forward fixes the targets) + ``_compute_loss`` with its per-step backwards + the final backward;
* ``dppo diffusion``: the same for ``DPPOMaskTrainer`` on a diffusion LM (μ from the rollout record / π itself);
* ``dppo causal``: ``DPPOMaskTrainer``'s causal loss + backward on TRL-style completions.

Columns: seconds, and peak resident-memory growth during the update (sampled every 5 ms; glibc's mmap threshold
pinned at 1 MiB so that freed tensors leave the resident set), for main and now. Small
LLaDA-shaped models (d 256, 2 layers) with the real vocabulary (126 464), fp32 on CPU. At this shape the
gradients of the (V, d) embedding and LM-head weights (≈ 250 MiB, the same on both sides) dominate the peak;
``--frozen-embeddings`` freezes them, as a LoRA run does, so that the peak shows the logits and activations::

    python benchmarks/update_cost.py --repeats 2
    python benchmarks/update_cost.py --repeats 2 --frozen-embeddings
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/tiny_models.py

import torch

from before_after import BASELINE_COMMIT, Side, run_interleaved, worker_main
from train_step import PeakMemory

SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4)


def trajectory(rows: int, prompt_len: int, gen: int, block: int, vocab: int, k: int, seed: int = 0) -> dict:
    """A rollout as the sampler records it: random tokens, each block committed in a random order over random steps
    (1–4 tokens a step), all positions valid, k steps sampled per row."""
    g = torch.Generator().manual_seed(seed)
    commit = torch.empty(rows, gen, dtype=torch.long)
    sampled = torch.full((rows, k), -1, dtype=torch.long)
    for b in range(rows):
        step = 0
        for start in range(0, gen, block):
            order = torch.randperm(block, generator=g) + start
            i = 0
            while i < block:
                size = int(torch.randint(1, 5, (1,), generator=g))
                commit[b, order[i : i + size]] = step
                step, i = step + 1, i + size
        chosen = torch.randperm(step, generator=g)[:k].sort().values
        sampled[b, : chosen.numel()] = chosen
    return {
        "rollout_prompt_ids": torch.randint(2, vocab - 2, (rows, prompt_len), generator=g),
        "rollout_prompt_mask": torch.ones(rows, prompt_len, dtype=torch.long),
        "rollout_ids": torch.randint(2, vocab - 2, (rows, gen), generator=g),
        "commit_step": commit,
        "valid_mask": torch.ones(rows, gen, dtype=torch.long),
        "sampled_steps": sampled,
    }


def measure(spec: dict) -> dict:
    from datasets import Dataset
    from trl import GRPOTrainer

    from tests.tiny_models import build_tiny_llada
    from dllm_trl.toy import build_toy_tokenizer
    from dllm_trl.trainers import DPPOMaskConfig, DPPOMaskTrainer, RLDFConfig, RLDFTrainer

    torch.manual_seed(0)
    torch.set_num_threads(spec["threads"])
    rows, vocab, k, top_k = spec["batch"], spec["vocab"], spec["k"], 20
    tokenizer = build_toy_tokenizer()
    common = dict(output_dir="/tmp/update-cost", use_cpu=True, report_to="none", save_strategy="no", bf16=False,
                  per_device_train_batch_size=rows, num_generations=rows, max_completion_length=spec["gen"],
                  block_length=32, num_sampled_timesteps=k, beta=0.0, seed=0, temperature=1.0,
                  drop_zero_variance_groups=False)
    dataset = Dataset.from_dict({"prompt": ["1+2="] * rows})
    if spec["phase"] == "dppo causal":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, eos_token_id=1, pad_token_id=1, **SHAPE))
        args = DPPOMaskConfig(**common, model_kind="causal", divergence_top_k=top_k)
        trainer = DPPOMaskTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                  args=args, train_dataset=dataset, processing_class=tokenizer)
        g = torch.Generator().manual_seed(1)
        length = spec["gen"]
        logps = torch.randn(rows, length, top_k, generator=g).log_softmax(-1).sort(-1, descending=True).values
        inputs = {
            "prompt_ids": torch.randint(2, vocab, (rows, 64), generator=g),
            "prompt_mask": torch.ones(rows, 64, dtype=torch.long),
            "completion_ids": torch.randint(2, vocab, (rows, length), generator=g),
            "completion_mask": torch.ones(rows, length, dtype=torch.long),
            "behaviour_topk_ids": torch.randint(2, vocab, (rows, length, top_k), generator=g),
            "behaviour_topk_logps": logps,
            "behaviour_logps": logps[..., 0],
            "advantages": torch.randn(rows, generator=g),
            "num_items_in_batch": torch.tensor(float(rows * length)),
        }

        def update():
            loss = trainer._compute_loss(trainer.model, inputs)
            trainer.accelerator.backward(loss)
    else:
        model = build_tiny_llada(vocab_size=vocab, mask_token_id=tokenizer.mask_token_id, eos_token_id=1, **SHAPE)
        if spec["phase"] == "dppo diffusion":
            trainer = DPPOMaskTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                      args=DPPOMaskConfig(**common, divergence_top_k=top_k), train_dataset=dataset,
                                      processing_class=tokenizer)
        else:
            trainer = RLDFTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                  args=RLDFConfig(**common), train_dataset=dataset, processing_class=tokenizer)
        rollout = trajectory(rows, 64, spec["gen"], 32, vocab, k)
        if spec["phase"] == "dppo diffusion":
            g = torch.Generator().manual_seed(2)
            logps = torch.randn(rows, spec["gen"], top_k, generator=g).log_softmax(-1).sort(-1, descending=True).values
            rollout.update(rollout_topk_ids=torch.randint(2, vocab - 2, (rows, spec["gen"], top_k), generator=g),
                           rollout_topk_logps=logps, rollout_commit_prob=logps[..., 0].exp())
            trainer._old_pass_pending = False
        scored = {"advantages": torch.randn(rows, generator=torch.Generator().manual_seed(3))}
        trainer.model.train()

        def update():
            trainer._rollout = dict(rollout)
            with mock.patch.object(GRPOTrainer, "_generate_and_score_completions", lambda self, inputs: dict(scored)):
                inputs = trainer._generate_and_score_completions([])
            loss = trainer._compute_loss(trainer.model, inputs)
            trainer.accelerator.backward(loss)
            if getattr(trainer, "_pending_token_norm", False):
                trainer._finish_pending_normalization(trainer.model, loss.detach())

    if spec.get("frozen_embeddings"):  # as LoRA leaves them: no (V, d) weight gradients in the peak
        for module in (trainer.model.get_input_embeddings(), trainer.model.get_output_embeddings()):
            module.requires_grad_(False)
    trainer.current_gradient_accumulation_steps = 1  # what the Trainer's loop sets: one micro-batch per step
    update()  # warm-up (allocator, first-call costs)
    trainer.model.zero_grad(set_to_none=True)
    with PeakMemory("cpu") as memory:
        start = time.perf_counter()
        update()
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_growth_mib": memory.peak}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=BASELINE_COMMIT)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=126464)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=None, help="Phases to run (default: all).")
    parser.add_argument("--frozen-embeddings", action="store_true",
                        help="Freeze the input embeddings and the LM head (as LoRA does): the peak then holds the "
                             "activations and logits, not the (V, d) weight gradients every side shares.")
    args = parser.parse_args()
    # Every tensor of 1 MiB or more gets its own mapping, returned to the system when freed: resident memory then
    # follows the live tensors instead of glibc's high-water mark (which made repeated peaks differ by ±200 MiB).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**20))
    base = dict(vocab=args.vocab, gen=args.gen, batch=args.batch, threads=args.threads,
                frozen_embeddings=args.frozen_embeddings)
    specs = [dict(base, phase="rldf", k=4), dict(base, phase="rldf", k=16), dict(base, phase="dppo diffusion", k=4),
             dict(base, phase="dppo causal", k=4)]
    specs = [s for s in specs if args.only is None or s["phase"] in args.only]
    sides = [Side.baseline(args.baseline), Side.current()]
    results = run_interleaved(__file__, specs, sides, repeats=args.repeats, timeout=3600, log=None)
    trained = "embeddings and LM head frozen" if args.frozen_embeddings else "every weight trained"
    print(f"\nbatch {args.batch}, gen {args.gen}, V {args.vocab}, d 256 x 2 layers, fp32 CPU, {args.threads} thread(s), "
          f"{trained}, median of {args.repeats}; main = {args.baseline}\n")
    print("| update | main s | now s | speed-up | main peak MiB | now peak MiB | memory ÷ |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for index, spec in enumerate(specs):
        old, new = results[("main", index)], results[("new", index)]
        s_old = statistics.median(r["seconds"] for r in old)
        s_new = statistics.median(r["seconds"] for r in new)
        m_old = statistics.median(r["peak_growth_mib"] for r in old)
        m_new = statistics.median(r["peak_growth_mib"] for r in new)
        name = spec["phase"] + (f" k={spec['k']}" if spec["phase"] == "rldf" else "")
        print(f"| {name} | {s_old:.2f} | {s_new:.2f} | {s_old / s_new:.2f}x | {m_old:.0f} | {m_new:.0f} | "
              f"{m_old / max(m_new, 1e-9):.1f}x |")


if __name__ == "__main__":
    if not worker_main(measure):
        main()
