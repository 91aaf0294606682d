"""Fidelity of the final-state DiffusionGemma term (issue 33, item 4): the cosine of its policy gradient to the exact
per-step one and to RLDF's, and what it trains, on the DiffusionGemma Sudoku toys, CPU.

An engine that returns only the final completion (vLLM) leaves the final-state term of
``dllm_trl.losses.diffusion_gemma_final_state`` (re-noised final canvases, no self-conditioning); the recorded rollout
gives the exact per-step term ``Σ_n Σ_{i∈A_n} log π(y_{n,i} | x_n, sc_n, T_n)`` (SPEC §8; self-conditioning held at
its record). Per seed: ``--puzzles`` training puzzles × ``--generations`` rollouts with the toy's sampler (the
``"logits"`` carrier: exact for every weight), the partial-credit ``sudoku_cell_reward``, group-normalised advantages
``(r − mean) / (std + 1e-4)``; then the gradient over all weights of ``Σ_b A_b · term_b`` for

* ``exact``: every recorded step of every row (the reference);
* ``rldf`` (all steps): every recorded step with the exact targets plus RLDF's clean targets (the final token where
  the detached policy gives it probability ≥ ``--clean-threshold``), the second reference;
* ``recorded k``: the trainer's ``k`` steps per row drawn by their uncertainty (Alg. 2), the same term on them only
  (``policy_estimator="sequential"``; without importance weights, as the trainer), and with the clean targets
  (``rldf``, the trainer's default);
* ``final-state k``: ``k`` re-noised final canvases per row (levels ``t ~ U(0, 1)``, every completion position
  scored), for each ``k`` in ``--states``, and at the largest ``k`` with only the re-noised positions scored (d1's
  choice for masks);

the cosine of each to ``exact`` and to ``rldf`` (all steps), and each gradient's wall time (forward + backward, one thread); and, for the largest
``k``, the cosine between two independent draws of the final-state gradient (is its direction stable?). Mean ± sample
std over seeds. ::

    python benchmarks/diffusion_gemma_final_state.py                   # noisy teacher, seeds 0-4, ≈ 2 min on one thread
    python benchmarks/diffusion_gemma_final_state.py --toy clean --name diffusion_gemma_final_state_clean

``--train``: what the direction is worth. From the toy, ``--train-steps`` policy-gradient steps with each estimator in
the same loop (the rollouts, rewards and advantages above; AdamW at a constant ``--learning-rate``, gradient norm
clipped at 1, as the trainer's defaults; the loss divided by its number of target tokens): ``recorded`` (the
trainer's ``k`` sampled steps, exact per-step targets: ``sequential``), ``rldf`` (the same steps plus RLDF's clean
targets, the trainer's default) and ``final-state k`` (``--states``' first value), and the
held-out solve rate (binary ``sudoku_reward``, first ``--eval-size`` test puzzles, mean over ``--eval-seeds``) before
and after, per training seed (a second call with the same ``--name`` resumes: it keeps the runs it finds)::

    python benchmarks/diffusion_gemma_final_state.py --train --seeds 0 1 2 --states 4 --name diffusion_gemma_final_state_train
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--toy", choices=["noisy_teacher", "clean"], default="noisy_teacher")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--puzzles", type=int, default=4, help="Training puzzles per seed.")
    parser.add_argument("--generations", type=int, default=8, help="Rollouts per puzzle.")
    parser.add_argument("--recorded-k", type=int, default=4, help="Recorded steps per row (the trainer's k).")
    parser.add_argument("--states", type=int, nargs="+", default=[1, 4, 16, 64],
                        help="Re-noised final states per row.")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train", action="store_true",
                        help="Instead: train with each estimator and compare held-out solve rates (see the docstring).")
    parser.add_argument("--train-steps", type=int, default=100)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--eval-size", type=int, default=200, help="First N test puzzles.")
    parser.add_argument("--eval-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--estimators", nargs="+", choices=["recorded", "rldf", "final-state"],
                        default=["recorded", "rldf", "final-state"], help="--train: which estimators to train with.")
    parser.add_argument("--clean-threshold", type=float, default=0.2, help="RLDF's c (RLDFConfig's default).")
    parser.add_argument("--output-dir", default=str(REPO / "docs" / "results"))
    parser.add_argument("--name", default="diffusion_gemma_final_state")
    return parser.parse_args(argv)


def flat_grad(model, loss_fn) -> tuple[torch.Tensor, float]:
    """The gradient of ``loss_fn()`` over every weight, flattened, and the seconds of its forward + backward."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss_fn().backward()
    seconds = time.perf_counter() - start
    grads = [p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()]
    return torch.cat(grads), seconds


def recorded_term(model, prompt_ids, prompt_mask, output, steps: torch.Tensor, advantages,
                  clean_threshold: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(−Σ_b A_b Σ_{s∈steps_b} Σ_i log π(target_i | x_s, sc_s, T_s), number of targets)`` by one replay of the
    recorded states; ``steps`` (B, S) bool, which recorded steps of each row count. Targets: the accepted tokens
    (the exact per-step term); with ``clean_threshold`` also RLDF's clean targets (the final token at the completion's
    other positions where the detached policy gives it probability ≥ the threshold: the trainer's ``rldf``)."""
    from dllm_trl.generation.diffusion_gemma import replay_logits

    record = output.denoising_steps
    canvas = torch.where(steps, record.canvas.unsqueeze(0), -1)
    has_sc = record.has_self_conditioning.unsqueeze(0).expand_as(steps)
    logits = replay_logits(model, prompt_ids, prompt_mask, output.completion_ids, canvas, record.state_ids,
                           record.self_conditioning, has_sc, record.carrier)
    rows, slots = steps.nonzero(as_tuple=True)
    logps = (logits.float() / record.temperature[slots].view(-1, 1, 1)).log_softmax(-1)
    accepted = record.accept_mask[rows, slots]
    targets, mask = record.accepted_ids[rows, slots], accepted
    if clean_threshold is not None:
        length = record.state_ids.shape[-1]
        columns = record.canvas[slots].unsqueeze(-1) * length + torch.arange(length)
        final = output.completion_ids[rows.unsqueeze(-1), columns]
        valid = output.completion_mask[rows.unsqueeze(-1), columns].bool()
        targets = torch.where(accepted, targets, final)
        sure = logps.detach().gather(-1, final.unsqueeze(-1)).squeeze(-1).exp() >= clean_threshold
        mask = accepted | (valid & sure)
    picked = logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    drift = (picked.detach() - record.accepted_logps[rows, slots]).abs()[accepted].max().item() if accepted.any() else 0
    if drift > 1e-4:
        raise RuntimeError(f"the replay does not reproduce the rollout's log-probs (max difference {drift:.2e}).")
    return -(advantages[rows].view(-1, 1) * picked * mask).sum(), mask.sum()


def rollout_batch(model, tokenizer, data, generations: int, generator):
    """Rollouts of ``data``'s prompts (``generations`` each) with the toy's sampler (``"logits"`` carrier), their
    partial-credit rewards and group-normalised advantages."""
    from dllm_trl.generation import DiffusionGemmaSampler
    from dllm_trl.generation.decode import decode_completions, encode_prompts
    from dllm_trl.toy import sudoku_cell_reward, sudoku_diffusion_gemma_sampler_config

    prompts = [p for p in data["prompt"] for _ in range(generations)]
    puzzles = [p for p in data["puzzle"] for _ in range(generations)]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts)
    config = sudoku_diffusion_gemma_sampler_config(self_conditioning="logits")
    output = DiffusionGemmaSampler(config)(model, prompt_ids, prompt_mask, generator)
    rewards = torch.tensor(sudoku_cell_reward(decode_completions(tokenizer, output.completion_ids,
                                                                 output.completion_mask), puzzles))
    grouped = rewards.view(-1, generations)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
    return prompt_ids, prompt_mask, output, config, rewards, advantages


def sampled_steps(output, k: int, generator) -> torch.Tensor:
    """(B, S) bool: the trainer's ``k`` recorded steps per row, drawn by their uncertainty (Alg. 2, τ = 1)."""
    from dllm_trl.losses import sample_timesteps

    record = output.denoising_steps
    active = record.active
    accepted = record.accept_mask & active.unsqueeze(-1)
    count = accepted.sum(-1)
    uncertainty = -(record.accepted_logps.double() * accepted).sum(-1) / count.clamp_min(1)
    sampled = sample_timesteps(uncertainty.float(), count > 0, k, 1.0, generator)
    total = active.shape[1]  # padding slots of `sampled` land in an extra column, dropped
    chosen = torch.zeros(active.shape[0], total + 1, dtype=torch.bool)
    return chosen.scatter(1, torch.where(sampled >= 0, sampled, total), True)[:, :total]


def run_seed(model, tokenizer, args, seed: int) -> dict:
    from dllm_trl.losses.diffusion_gemma_final_state import (
        final_state_logps,
        final_state_policy_loss,
        final_state_states,
    )
    from dllm_trl.toy import sudoku_dataset

    data = sudoku_dataset("train").select(range(seed * args.puzzles, (seed + 1) * args.puzzles))
    prompt_ids, prompt_mask, output, config, rewards, advantages = rollout_batch(
        model, tokenizer, data, args.generations, torch.Generator().manual_seed(seed))
    active = output.denoising_steps.active
    exact, exact_s = flat_grad(model, lambda: recorded_term(model, prompt_ids, prompt_mask, output, active, advantages)[0])
    rldf_all, _ = flat_grad(model, lambda: recorded_term(model, prompt_ids, prompt_mask, output, active, advantages,
                                                         args.clean_threshold)[0])
    result = {"seed": seed, "reward_mean": rewards.mean().item(), "steps_per_row": active.sum(1).float().mean().item(),
              "exact_seconds": exact_s, "cosine": {}, "cosine_rldf": {}, "seconds": {},
              "rldf_all_to_exact": torch.nn.functional.cosine_similarity(rldf_all, exact, dim=0).item()}

    def measure(name, loss_fn):
        grad, result["seconds"][name] = flat_grad(model, loss_fn)
        result["cosine"][name] = torch.nn.functional.cosine_similarity(grad, exact, dim=0).item()
        result["cosine_rldf"][name] = torch.nn.functional.cosine_similarity(grad, rldf_all, dim=0).item()
        return grad

    chosen = sampled_steps(output, args.recorded_k, torch.Generator().manual_seed(seed))
    measure(f"recorded k={args.recorded_k}",
            lambda: recorded_term(model, prompt_ids, prompt_mask, output, chosen, advantages)[0])
    measure(f"recorded k={args.recorded_k} + clean targets (`rldf`)",
            lambda: recorded_term(model, prompt_ids, prompt_mask, output, chosen, advantages, args.clean_threshold)[0])

    vocab = model.config.get_text_config().vocab_size
    for k in args.states:
        states = final_state_states(output.completion_ids, output.completion_mask, model.config.canvas_length, k,
                                    vocab, config.t_min, config.t_max, torch.Generator().manual_seed(1000 + seed))
        first = measure(f"final-state k={k}", lambda: final_state_policy_loss(
            final_state_logps(model, prompt_ids, prompt_mask, output.completion_ids, states), states["state_valid"],
            advantages))
        if k == max(args.states):  # d1's choice: only the positions the noise replaced are scored
            measure(f"final-state k={k}, re-noised positions only", lambda: final_state_policy_loss(
                final_state_logps(model, prompt_ids, prompt_mask, output.completion_ids, states),
                states["state_valid"] & states["state_noised"], advantages))
            # Is the final-state direction stable? The same term on an independent draw of k states.
            other = final_state_states(output.completion_ids, output.completion_mask, model.config.canvas_length, k,
                                       vocab, config.t_min, config.t_max, torch.Generator().manual_seed(2000 + seed))
            second = flat_grad(model, lambda: final_state_policy_loss(
                final_state_logps(model, prompt_ids, prompt_mask, output.completion_ids, other), other["state_valid"],
                advantages))[0]
            result["self_cosine"] = torch.nn.functional.cosine_similarity(first, second, dim=0).item()
    return result


def summary(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:+.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{mean:+.3f}"


def table(results: list[dict], args) -> str:
    names = list(results[0]["cosine"])
    lines = [
        f"Gradient cosine to the exact per-step term, DiffusionGemma Sudoku toy `{args.toy}`, {args.puzzles} puzzles × "
        f"{args.generations} rollouts per seed, seeds {args.seeds}, one CPU thread; mean ± sample std over seeds "
        f"(exact: {statistics.fmean(r['steps_per_row'] for r in results):.1f} recorded steps per row, "
        f"{statistics.fmean(r['exact_seconds'] for r in results):.2f} s per gradient). Last column: the cosine to RLDF's "
        f"term on every recorded step (exact targets + clean targets, c = {args.clean_threshold}), itself at "
        f"{summary([r['rldf_all_to_exact'] for r in results])} to the exact term.",
        "",
        "| estimator | cosine to exact | per seed | s / gradient | cosine to `rldf`, all steps |",
        "|---|---|---|---:|---|",
    ]
    for name in names:
        cosines = [r["cosine"][name] for r in results]
        lines.append(f"| {name} | **{summary(cosines)}** | {', '.join(f'{c:+.2f}' for c in cosines)} | "
                     f"{statistics.fmean(r['seconds'][name] for r in results):.2f} | "
                     f"{summary([r['cosine_rldf'][name] for r in results])} |")
    agreement = [r["self_cosine"] for r in results]
    lines += ["", f"Two independent draws of {max(args.states)} final states per row agree with each other at cosine "
                  f"{summary(agreement)} (per seed {', '.join(f'{c:+.2f}' for c in agreement)})."]
    return "\n".join(lines) + "\n"


def load_toy(args):
    from dllm_trl.toy import load_sudoku_diffusion_gemma, load_sudoku_diffusion_gemma_noisy_teacher

    return (load_sudoku_diffusion_gemma_noisy_teacher if args.toy == "noisy_teacher" else load_sudoku_diffusion_gemma)()


def held_out(model, tokenizer, args) -> float:
    from dllm_trl.toy import evaluate_diffusion_gemma_accuracy, sudoku_dataset

    test = sudoku_dataset("test", size=args.eval_size)
    return evaluate_diffusion_gemma_accuracy(model, tokenizer, test, batch_size=args.eval_size,
                                             seeds=args.eval_seeds)["accuracy"]


def train_run(args, estimator: str, seed: int) -> dict:
    """``--train-steps`` steps from the toy with ``estimator`` (``"recorded"`` or ``"final-state"``); the held-out
    solve rate after, the mean reward of the first and last 10 steps, seconds."""
    from dllm_trl.losses.diffusion_gemma_final_state import (
        final_state_logps,
        final_state_policy_loss,
        final_state_states,
    )
    from dllm_trl.toy import sudoku_dataset

    model, tokenizer = load_toy(args)
    train = sudoku_dataset("train")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    generator = torch.Generator().manual_seed(10_000 + seed)
    vocab, canvas = model.config.get_text_config().vocab_size, model.config.canvas_length
    rewards, start = [], time.perf_counter()
    for step in range(args.train_steps):
        picks = [order[(step * args.puzzles + i) % len(order)] for i in range(args.puzzles)]
        prompt_ids, prompt_mask, output, config, reward, advantages = rollout_batch(
            model, tokenizer, train.select(picks), args.generations, generator)
        rewards.append(reward.mean().item())
        if estimator in ("recorded", "rldf"):
            chosen = sampled_steps(output, args.recorded_k, generator)
            total, targets = recorded_term(model, prompt_ids, prompt_mask, output, chosen, advantages,
                                           args.clean_threshold if estimator == "rldf" else None)
            loss = total / targets.clamp_min(1)
        else:
            states = final_state_states(output.completion_ids, output.completion_mask, canvas, args.states[0], vocab,
                                        config.t_min, config.t_max, generator)
            logps = final_state_logps(model, prompt_ids, prompt_mask, output.completion_ids, states)
            loss = final_state_policy_loss(logps, states["state_valid"], advantages)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return {"estimator": estimator, "seed": seed, "after": held_out(model, tokenizer, args),
            "reward_first10": statistics.fmean(rewards[:10]), "reward_last10": statistics.fmean(rewards[-10:]),
            "seconds": time.perf_counter() - start}


SETTINGS = ("toy", "train_steps", "learning_rate", "puzzles", "generations", "recorded_k", "eval_size", "eval_seeds")
"""What a resumed ``--train`` run must share with the runs it finds."""


def train_main(args):
    out = Path(args.output_dir)
    path = out / f"{args.name}.json"
    previous = json.loads(path.read_text()) if path.exists() else None
    if previous is not None:  # resume: keep the runs already measured under the same settings
        clash = [key for key in SETTINGS if previous["args"].get(key) != getattr(args, key)]
        if clash or previous["args"]["states"][0] != args.states[0]:
            raise SystemExit(f"{path} holds runs with other settings ({clash or ['states']}): pass another --name.")
        before, runs = previous["before"], previous["runs"]
    else:
        model, tokenizer = load_toy(args)
        before, runs = held_out(model, tokenizer, args), []
    for seed in args.seeds:
        for estimator in args.estimators:
            if any(r["seed"] == seed and r["estimator"] == estimator for r in runs):
                continue
            runs.append(train_run(args, estimator, seed))
            print(json.dumps(runs[-1]), flush=True)
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"args": vars(args), "before": before, "runs": runs}, indent=1) + "\n")
    names = {"recorded": f"recorded k={args.recorded_k}, exact per-step targets (`sequential`)",
             "rldf": f"recorded k={args.recorded_k}, + clean targets c = {args.clean_threshold} (`rldf`)",
             "final-state": f"final-state k={args.states[0]}"}
    names = {key: names[key] for key in args.estimators}
    lines = [f"Training with each estimator from the DiffusionGemma Sudoku toy `{args.toy}`: {args.train_steps} steps, "
             f"{args.puzzles} puzzles × {args.generations} rollouts, AdamW lr {args.learning_rate} (constant), "
             f"gradient norm clipped at 1, seeds {args.seeds}, one CPU thread. Held-out: binary `sudoku_reward` on the "
             f"first {args.eval_size} test puzzles, mean over sampler seeds {args.eval_seeds}; before: {before:.3f}.",
             "", "| estimator | after (mean ± std) | Δ | per seed | reward, first 10 → last 10 steps | s / run |",
             "|---|---|---|---|---|---:|"]
    for estimator, name in names.items():
        mine = [r for r in runs if r["estimator"] == estimator and r["seed"] in args.seeds]
        after = [r["after"] for r in mine]
        lines.append(f"| {name} | {summary(after).lstrip('+')} | **{summary([a - before for a in after])}** | "
                     f"{', '.join(f'{a:.3f}' for a in after)} | "
                     f"{statistics.fmean(r['reward_first10'] for r in mine):.3f} → "
                     f"{statistics.fmean(r['reward_last10'] for r in mine):.3f} | "
                     f"{statistics.fmean(r['seconds'] for r in mine):.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "before": before, "runs": runs}, indent=1) + "\n")
    (out / f"{args.name}_table.md").write_text(text)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.train:
        train_main(args)
        return
    model, tokenizer = load_toy(args)
    start = time.perf_counter()
    results = []
    for seed in args.seeds:
        results.append(run_seed(model, tokenizer, args, seed))
        print(json.dumps(results[-1]), flush=True)
    text = table(results, args)
    print(text + f"\n{time.perf_counter() - start:.0f} s in all")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")
    (out / f"{args.name}_table.md").write_text(text)


if __name__ == "__main__":
    main()
