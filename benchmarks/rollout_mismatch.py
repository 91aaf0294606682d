"""The rollout–training mismatch of the toy rollouts (issue 24): KV cache none / prefix / dual.

Each toy model (as shipped, i.e. at the first RL update) decodes its training prompts with its RL sampler settings at
temperature 1 (``toy_rldf_config`` / ``sudoku_rldf_config``: addition 8 positions in blocks of 4, dynamic threshold
0.9; Sudoku 20 positions, one cell per step), once per cache mode. Every decoding step of every completion is then
scored the way the trainers score a sampled state (``RLDFLoss.score_for_policy_pass(old_pass=True)``: one plain full
forward of ``q ⊕ o_t``, the sampler's distribution at each token committed at ``t``) and compared with the rollout's
record ``μ(a)``: ``Δ = log π_old(a) − log μ(a)`` over every committed valid token, the k3 estimate
``r − 1 − log r`` of ``KL(μ ‖ π_old)`` (``r = e^Δ``), and the ratio ``r`` TRL's correction would clamp (share
above TRL's default ``C_max = 3``). The trainers log the same quantities at their sampled states as ``sampling/*``.

    OMP_NUM_THREADS=1 python benchmarks/rollout_mismatch.py              # both toys, 256 completions each
    OMP_NUM_THREADS=1 python benchmarks/rollout_mismatch.py --task addition --completions 64

Prints one Markdown table (about a minute on one CPU thread with the defaults).
"""

from __future__ import annotations

import argparse
import time

import torch

from dllm_trl.generation import MaskedDiffusionSampler
from dllm_trl.generation.decode import encode_prompts
from dllm_trl.losses import RLDFLoss
from dllm_trl.losses.rollout_mismatch import record_logps, recorded_targets
from dllm_trl.toy import load_sudoku, load_toy, sudoku_dataset, sudoku_rldf_config, toy_dataset, toy_rldf_config

CACHES = ("none", "prefix", "dual")
TASKS = {
    "addition": (load_toy, toy_dataset, toy_rldf_config),
    "sudoku": (load_sudoku, sudoku_dataset, sudoku_rldf_config),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=[*TASKS, "both"], default="both")
    parser.add_argument("--completions", type=int, default=256, help="Completions per task and cache mode.")
    parser.add_argument("--group", type=int, default=8, help="Completions per prompt.")
    parser.add_argument("--batch", type=int, default=64, help="Completions decoded and scored at a time.")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def measure(task: str, cache: str, args) -> dict:
    """Per-token ``Δ`` over every committed valid token of ``args.completions`` rollouts (all steps scored)."""
    load, dataset, rldf_config = TASKS[task]
    model, tokenizer = load()
    config = rldf_config("unused", cache_mode=cache, num_sampled_timesteps=64, timestep_temperature=0.0)
    loss, sampler = RLDFLoss(config), MaskedDiffusionSampler(config.diffusion_generation_config())
    prompts = list(dataset("train")["prompt"])[: -(-args.completions // args.group)]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [p for p in prompts for _ in range(args.group)])
    generator = torch.Generator().manual_seed(args.seed)
    diffs, start = [], time.perf_counter()
    for first in range(0, args.completions, args.batch):
        rows = slice(first, min(first + args.batch, args.completions))
        with torch.no_grad():
            output = sampler(model, prompt_ids[rows], prompt_mask[rows], generator)
            # τ = 0 and k above any step count: every step with a valid token is a sampled state.
            batch, _ = loss.sample_states(prompt_ids[rows], prompt_mask[rows], output, generator, torch.Generator())
            _, extra = loss.score_for_policy_pass(model, batch, batch_size=args.batch, old_pass=True)
        recorded = recorded_targets(batch["commit_step"], batch["valid_mask"], batch["sampled_steps"])
        committed = (batch["commit_step"] < 2**31 - 1) & batch["valid_mask"].bool()
        assert int(recorded.sum()) == int(committed.sum()), "a committed token was not scored"
        diff = extra["old_sampling_logps"] - record_logps(batch["rollout_commit_prob"]).unsqueeze(1)
        diffs.append(diff[recorded].double())
    diff = torch.cat(diffs)
    ratio = diff.exp()
    kl = ratio - 1 - diff
    quantile = lambda x, q: float(torch.quantile(x, q))  # noqa: E731
    return dict(task=task, cache=cache, tokens=diff.numel(), seconds=time.perf_counter() - start,
                abs_mean=float(diff.abs().mean()), abs_p99=quantile(diff.abs(), 0.99), abs_max=float(diff.abs().max()),
                kl_mean=float(kl.mean()), kl_p99=quantile(kl, 0.99), kl_max=float(kl.max()),
                ratio_min=float(ratio.min()), ratio_mean=float(ratio.mean()), ratio_max=float(ratio.max()),
                above_cap=float((ratio > 3.0).double().mean()))


def table(results: list[dict]) -> str:
    head = ("| task | cache | tokens | mean \\|Δ\\| | p99 \\|Δ\\| | max \\|Δ\\| | mean k3 | p99 k3 | max k3 | "
            "ratio min / mean / max | ratio > 3 |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in results:
        lines.append(
            f"| {r['task']} | {r['cache']} | {r['tokens']} | {r['abs_mean']:.2e} | {r['abs_p99']:.2e} | "
            f"{r['abs_max']:.2e} | {r['kl_mean']:.2e} | {r['kl_p99']:.2e} | {r['kl_max']:.2e} | "
            f"{r['ratio_min']:.3f} / {r['ratio_mean']:.3f} / {r['ratio_max']:.3f} | {100 * r['above_cap']:.2f} % |"
        )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    tasks = list(TASKS) if args.task == "both" else [args.task]
    results = [measure(task, cache, args) for task in tasks for cache in CACHES]
    print(table(results))
    print(f"\n{args.completions} completions per row (groups of {args.group}, seed {args.seed}); "
          f"{sum(r['seconds'] for r in results):.0f} s of decoding and scoring.")


if __name__ == "__main__":
    main()
