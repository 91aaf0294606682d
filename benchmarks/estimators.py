"""Policy estimators and RLDF ablations on the toy task (SPEC §2.4, paper 1 App. A and §6), side by side.

Every run starts from the same toy checkpoint, trains :class:`~dllm_trl.RLDFTrainer` for the same number of
optimizer steps with the same seed list, the same prompts per step, the same group size and the same rollout
settings (the toy's sampler: 8 positions, blocks of 4, dynamic threshold 0.9, dual cache, temperature 1), and
only the loss side changes:

* estimators: ``rldf`` (k sampled states, clipped clean targets), ``sequential`` (x_{t−1}: targets I_t),
  ``all_masking`` (d1; also with 15% prompt masking), ``random_masking`` (ELBO-style; also the complementary pair);
* RLDF ablations (paper 1 §6), one factor at a time from the base (k = 4, τ = 1, c = 0.2, x_0, token norm):
  k ∈ {1, 4, 16}, τ ∈ {0.5, 1, ∞} (at k = 1: toy completions have ≈ 3 decoding steps, so at k = 4 there is
  nothing to choose), c ∈ {0, 0.2, 0.6}, x_0 vs x_{t−1} (= ``sequential``), token vs sample normalisation.

Per run: held-out greedy accuracy after training, the mean rollout reward per step, seconds per optimizer step,
model calls per step and sequence forwards per completion (rollout NFE; the no-grad π_old pass; the loss
forwards), target tokens per state. Results go to a JSON file (runs already there are skipped, so an interrupted
grid resumes), a Markdown table and a PNG plot::

    python benchmarks/estimators.py                       # 4 estimators + 2 variants + ablations, 3 seeds, 60 steps
    python benchmarks/estimators.py --quick               # 2 steps, 1 seed, 3 configurations: a smoke test
    python benchmarks/estimators.py --steps 40 --seeds 0 1 2 3 4 --only main
    python benchmarks/estimators.py --checkpoint /tmp/toy  # a checkpoint from scripts/pretrain_toy.py
    python benchmarks/estimators.py --model block --only main --name estimators_block   # the toy block model

``--model block`` runs the same grid on the toy block-diffusion model (SDAR layout, blocks of 4,
``dllm_trl.toy.block``): its states are scored in packed forwards, and only the trajectory estimators (``rldf``,
``sequential`` and the RLDF ablations) have a block form, so the masking estimators are left out.

``--task sudoku`` runs the study on the 4×4 Sudoku toy (``dllm_trl.toy.sudoku``, ``load_sudoku()``), whose
completions take 20 decoding steps (one cell per step), with its own protocol (docs/estimators_sudoku.md):

* settings: :func:`dllm_trl.toy.sudoku_rldf_config` (the Sudoku sampler at temperature 1, 4 puzzles × 8 generations
  per step), trained on the partial-credit ``sudoku_cell_reward``, evaluated by the greedy binary ``sudoku_reward``
  solve rate of the first ``--eval-size`` (100) test puzzles;
* learning rate tuned per estimator: every estimator configuration runs at each of ``--learning-rates`` on each of
  ``--tune-seeds``; the lr with the best mean final solve rate is that estimator's, and its ``--seeds`` run there;
* the RLDF ablations run at rldf's tuned lr on ``--ablation-seeds``; τ is ablated at k = 4 (20 decoding steps give
  k = 4 something to choose from); x_{t−1} = ``sequential`` at rldf's lr;
* the report adds the paired (same-seed) differences of neighbouring estimators (rldf − sequential, sequential −
  random_masking, random_masking − all_masking). Paper 1 claims no ordering of these; its own evidence for the x̂_0
  targets (rollout reward, KL and loss spikes with β > 0) is measured by ``benchmarks/target_stability.py``::

    python benchmarks/estimators.py --task sudoku            # tuning 6 x 3 lr x 2 seeds, 5 eval seeds, ablations
    python benchmarks/estimators.py --task sudoku --quick    # 2 steps, 3 configurations, 2 lr: a smoke test

``--task sudoku --model diffusion_gemma`` runs that protocol on the DiffusionGemma Sudoku toy
(``load_sudoku_diffusion_gemma()``: uniform-noise block diffusion, one canvas of 20 tokens, no mask token;
docs/estimators_sudoku.md, "DiffusionGemma column"): the trainer gets its ``DiffusionGemmaSampler`` and
``DiffusionGemmaRLDFLoss``; only the trajectory estimators (``rldf``, ``sequential``) and the RLDF ablations exist
there; its decoding is random, so the solve rate is the mean over ``--sampler-seeds`` of
:func:`~dllm_trl.toy.evaluate_diffusion_gemma_accuracy` (not greedy); learning rates 1e-5, 3e-5, 1e-4 (Adam at 3e-4
wrecks it within a few steps)::

    python benchmarks/estimators.py --task sudoku --model diffusion_gemma --only main --seeds 0 1 2
    python benchmarks/estimators.py --task sudoku --model diffusion_gemma --quick   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BASE = dict(policy_estimator="rldf", num_sampled_timesteps=4, timestep_temperature=1.0, clean_target_threshold=0.2,
            loss_normalization="token")
MAIN = {
    "rldf": {},
    "sequential": dict(policy_estimator="sequential"),
    "all_masking": dict(policy_estimator="all_masking"),
    "all_masking+prompt0.15": dict(policy_estimator="all_masking", prompt_mask_prob=0.15),
    "random_masking": dict(policy_estimator="random_masking"),
    "random_masking+pair": dict(policy_estimator="random_masking", complementary_masking=True),
}
# Toy completions take ≈ 3 decoding steps, so at k = 4 almost every row trains on all of its steps and τ has
# (almost) nothing to choose from: the τ ablation runs at k = 1, where the choice of the state is everything.
ABLATIONS = {
    "rldf k=1": dict(num_sampled_timesteps=1),
    "rldf k=16": dict(num_sampled_timesteps=16),
    "rldf k=1 tau=0.5": dict(num_sampled_timesteps=1, timestep_temperature=0.5),
    "rldf k=1 tau=inf": dict(num_sampled_timesteps=1, timestep_temperature=math.inf),
    "rldf c=0": dict(clean_target_threshold=0.0),
    "rldf c=0.6": dict(clean_target_threshold=0.6),
    "rldf sample-norm": dict(loss_normalization="sample"),
}
ABLATION_GROUPS = [
    ("k (sampled states)", ["rldf k=1", "rldf", "rldf k=16"]),
    ("τ (timestep temperature), k = 1", ["rldf k=1 tau=0.5", "rldf k=1", "rldf k=1 tau=inf"]),
    ("c (clean threshold)", ["rldf c=0", "rldf", "rldf c=0.6"]),
    ("target", ["rldf", "sequential"]),
    ("normalisation", ["rldf", "rldf sample-norm"]),
]
# Sudoku completions take 20 decoding steps (one cell each), so k = 4 chooses 4 of 20 states: τ runs at the base k = 4.
SUDOKU_ABLATIONS = {
    "rldf k=1": dict(num_sampled_timesteps=1),
    "rldf k=16": dict(num_sampled_timesteps=16),
    "rldf tau=0.5": dict(timestep_temperature=0.5),
    "rldf tau=inf": dict(timestep_temperature=math.inf),
    "rldf c=0": dict(clean_target_threshold=0.0),
    "rldf c=0.6": dict(clean_target_threshold=0.6),
    "rldf sample-norm": dict(loss_normalization="sample"),
}
SUDOKU_ABLATION_GROUPS = [
    ("k (sampled states)", ["rldf k=1", "rldf", "rldf k=16"]),
    ("τ (timestep temperature), k = 4", ["rldf tau=0.5", "rldf", "rldf tau=inf"]),
    ("c (clean threshold)", ["rldf c=0", "rldf", "rldf c=0.6"]),
    ("target: x_0 vs x_{t−1}", ["rldf", "sequential"]),
    ("normalisation", ["rldf", "rldf sample-norm"]),
]
NEIGHBOUR_PAIRS = [("rldf", "sequential"), ("sequential", "random_masking"), ("random_masking", "all_masking")]
"""Neighbouring estimator pairs whose same-seed differences the Sudoku report gives (paper 1 claims no ordering of
them: its Table 2 has ESPO above d1 on LLaDA and below it on Dream)."""
DIFFUSION_GEMMA_LEARNING_RATES = [1e-5, 3e-5, 1e-4]
"""The DiffusionGemma toy's tuning grid: its accepted tokens are nearly deterministic (log-prob ≈ −0.001), so the
policy gradient is small and Adam makes full-size steps of its noise; at 3e-4 the model breaks within ~5 steps."""
SUDOKU_STEPS = 40
"""Optimizer steps per Sudoku run. Measured at 30 steps on one CPU thread: one seed of the six estimators takes
148 s and one seed of the ablations ≈ 270 s (k = 16 alone 74 s), so 40 steps fit the grid (36 tuning + 30
evaluation runs + the ablations) in about 55 minutes only with the ablations on 3 seeds (docs/estimators_sudoku.md)."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=["addition", "sudoku"], default="addition",
                        help="The addition toy (default, docs/estimators.md) or the 4x4 Sudoku toy "
                             "(docs/estimators_sudoku.md).")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"Optimizer steps per run (default 60; Sudoku {SUDOKU_STEPS}).")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="Evaluation seeds (default 0 1 2; Sudoku 0 1 2 3 4).")
    parser.add_argument("--only", choices=["all", "main", "ablations"], default="all")
    parser.add_argument("--configs", nargs="+", default=None, help="Run only these configuration names.")
    parser.add_argument("--quick", action="store_true", help="Smoke test: 2 steps, seed 0, 3 configurations, 40 eval.")
    parser.add_argument("--model", choices=["diffusion", "block", "diffusion_gemma"], default="diffusion",
                        help="The toy diffusion LM, the toy block-diffusion LM, or (with --task sudoku) the "
                             "DiffusionGemma Sudoku toy.")
    parser.add_argument("--checkpoint", default=None, help="Toy checkpoint (default: the shipped one).")
    parser.add_argument("--learning-rate", type=float, default=3e-5,
                        help="Constant learning rate of the addition toy (3e-4 made RLDF diverge on its checkpoint).")
    parser.add_argument("--learning-rates", type=float, nargs="+", default=None,
                        help="Sudoku: the constant learning rates tuned per estimator (default 3e-5 1e-4 2e-4; "
                             "DiffusionGemma 1e-5 3e-5 1e-4).")
    parser.add_argument("--tune-seeds", type=int, nargs="+", default=[100, 101],
                        help="Sudoku: the seeds of the learning-rate tuning (keep them disjoint from --seeds).")
    parser.add_argument("--ablation-seeds", type=int, nargs="+", default=None,
                        help="Sudoku: seeds of the RLDF ablations, at rldf's tuned lr (default 0 1 2).")
    parser.add_argument("--sampler-seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="DiffusionGemma: seeds of its random held-out decoding; the solve rate is their mean.")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--eval-size", type=int, default=None,
                        help="Held-out problems for greedy accuracy (default 200; Sudoku: the first 100 test puzzles).")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads.")
    parser.add_argument("--output-dir", default=str(REPO / "docs" / "results"), help="Where the table and plot go.")
    parser.add_argument("--name", default=None, help="Stem of the output files (estimators / estimators_sudoku).")
    parser.add_argument("--fresh", action="store_true", help="Ignore runs already in the JSON file.")
    parser.add_argument("--report-only", action="store_true", help="Only rewrite the table and plot from the JSON file.")
    args = parser.parse_args(argv)
    sudoku, gemma = args.task == "sudoku", args.model == "diffusion_gemma"
    if sudoku and args.model == "block":
        raise SystemExit("--task sudoku runs the Sudoku diffusion toys only (no block model of it ships)")
    if gemma and not sudoku:
        raise SystemExit("--model diffusion_gemma is the DiffusionGemma Sudoku toy: add --task sudoku")
    if sudoku and set(args.tune_seeds) & set(args.seeds or [0, 1, 2, 3, 4]):
        raise SystemExit("--tune-seeds must be disjoint from the evaluation --seeds")
    stem = "estimators_sudoku_diffusion_gemma" if gemma else ("estimators_sudoku" if sudoku else "estimators")
    args.learning_rates = args.learning_rates or (DIFFUSION_GEMMA_LEARNING_RATES if gemma else [3e-5, 1e-4, 2e-4])
    if args.quick:
        args.steps, args.seeds = 2, [0]
        args.eval_size = 20 if sudoku else 40
        if sudoku:
            args.learning_rates, args.tune_seeds, args.ablation_seeds = [3e-5, 2e-4], args.tune_seeds[:1], [0]
        if gemma:
            args.learning_rates, args.sampler_seeds = [1e-5, 1e-4], args.sampler_seeds[:1]
        args.configs = args.configs or (["rldf", "sequential", "rldf tau=inf"] if sudoku
                                        else ["rldf", "all_masking", "random_masking+pair"])
        args.name = args.name or f"{stem}_quick"
        if args.output_dir == str(REPO / "docs" / "results"):
            args.output_dir = os.path.join(tempfile.gettempdir(), f"dllm_trl_{stem}_quick")
    args.name = args.name or stem
    args.steps = args.steps or (SUDOKU_STEPS if sudoku else 60)
    args.seeds = args.seeds or ([0, 1, 2, 3, 4] if sudoku else [0, 1, 2])
    args.eval_size = args.eval_size or (100 if sudoku and not gemma else 200)
    args.ablation_seeds = args.ablation_seeds or ([0, 1, 2] if sudoku else args.seeds)
    return args


def ablations_of(args) -> dict[str, dict]:
    return SUDOKU_ABLATIONS if args.task == "sudoku" else ABLATIONS


def ablation_groups_of(args) -> list:
    return SUDOKU_ABLATION_GROUPS if args.task == "sudoku" else ABLATION_GROUPS


def trajectory_only(args) -> bool:
    """Only the trajectory estimators (and the RLDF ablations) have a form on this model: the block model packs its
    states, DiffusionGemma's states are its recorded denoising steps (no mask token to build masked states with)."""
    return args.model in ("block", "diffusion_gemma")


def selected_configs(args) -> dict[str, dict]:
    configs = {}
    ablations = ablations_of(args)
    if args.only in ("all", "main"):
        configs.update(MAIN)
    if args.only in ("all", "ablations"):
        configs.update({"rldf": {}, "sequential": MAIN["sequential"], **ablations})
    if args.configs:
        known = {**MAIN, **ablations}
        unknown = [name for name in args.configs if name not in known]
        if unknown:
            raise SystemExit(f"unknown configurations {unknown}; known: {list(known)}")
        configs = {name: known[name] for name in args.configs}
    if trajectory_only(args):
        configs = {name: c for name, c in configs.items()
                   if c.get("policy_estimator", "rldf") in ("rldf", "sequential")}
    return configs


def toy_model(args):
    """``(load(path=...) -> (model, tokenizer), shipped folder, evaluation config)`` of ``args.model`` on
    ``args.task``: the greedy generation config, or the DiffusionGemma toy's (random) sampler settings."""
    if args.task == "sudoku" and args.model == "diffusion_gemma":
        from dllm_trl.toy import load_sudoku_diffusion_gemma, sudoku_diffusion_gemma_sampler_config, toy_assets_dir

        return (load_sudoku_diffusion_gemma, toy_assets_dir("sudoku_diffusion_gemma"),
                sudoku_diffusion_gemma_sampler_config())
    if args.task == "sudoku":
        from dllm_trl.toy import load_sudoku, sudoku_generation_config, toy_assets_dir

        return load_sudoku, toy_assets_dir("sudoku"), sudoku_generation_config()
    if args.model == "block":
        from dllm_trl.toy.block import load_toy_block, toy_block_assets_dir, toy_block_generation_config

        return load_toy_block, toy_block_assets_dir(), toy_block_generation_config()
    from dllm_trl.toy import load_toy, toy_assets_dir, toy_generation_config

    return load_toy, toy_assets_dir(), toy_generation_config()


def task_functions(args) -> dict:
    """The library's pieces of ``args.task``: the RLDF settings, training data and reward, the held-out evaluation
    (``evaluate(model, tokenizer) -> dict`` of :func:`dllm_trl.toy.evaluate_accuracy`, or of
    :func:`~dllm_trl.toy.evaluate_diffusion_gemma_accuracy`) and the trainer's model-specific keyword arguments
    (``trainer_pieces(config) -> dict``: DiffusionGemma's sampler and loss)."""
    from dllm_trl.toy import evaluate_accuracy

    _, _, eval_config = toy_model(args)
    if args.task == "sudoku" and args.model == "diffusion_gemma":
        from dllm_trl.generation import DiffusionGemmaSampler
        from dllm_trl.losses import DiffusionGemmaRLDFLoss
        from dllm_trl.toy import evaluate_diffusion_gemma_accuracy, sudoku_cell_reward, sudoku_dataset, sudoku_reward
        from dllm_trl.toy.configs import sudoku_diffusion_gemma_rldf_config

        held_out = sudoku_dataset("test", size=args.eval_size)
        return dict(
            config=sudoku_diffusion_gemma_rldf_config, train_reward=sudoku_cell_reward,
            train_dataset=lambda: sudoku_dataset("train"),
            evaluate=lambda model, tokenizer: evaluate_diffusion_gemma_accuracy(
                model, tokenizer, held_out, eval_config, batch_size=args.eval_size, reward=sudoku_reward,
                seeds=args.sampler_seeds),
            trainer_pieces=lambda config: dict(sampler=DiffusionGemmaSampler(eval_config),
                                               loss=DiffusionGemmaRLDFLoss(config)),
        )
    if args.task == "sudoku":
        from dllm_trl.toy import sudoku_cell_reward, sudoku_dataset, sudoku_reward, sudoku_rldf_config

        held_out = sudoku_dataset("test", size=args.eval_size)
        return dict(
            config=sudoku_rldf_config, train_reward=sudoku_cell_reward, train_dataset=lambda: sudoku_dataset("train"),
            evaluate=lambda model, tokenizer: evaluate_accuracy(model, tokenizer, held_out, eval_config,
                                                                batch_size=args.eval_size, reward=sudoku_reward),
            trainer_pieces=lambda config: {},
        )
    from dllm_trl.toy import toy_dataset, toy_reward, toy_rldf_config

    held_out = toy_dataset("test", size=args.eval_size)
    return dict(
        config=toy_rldf_config, train_reward=toy_reward, train_dataset=lambda: toy_dataset("train"),
        evaluate=lambda model, tokenizer: evaluate_accuracy(model, tokenizer, held_out, eval_config),
        trainer_pieces=lambda config: {},
    )


class ForwardCounter:
    """Counts model calls and the rows they carry, split into rollout / no-grad scoring / loss (with grad)."""

    def __init__(self):
        self.phase = "train"
        self.calls = {"rollout": 0, "score": 0, "loss": 0}
        self.rows = {"rollout": 0, "score": 0, "loss": 0}

    def hook(self, module, args, kwargs):
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        ids = kwargs.get("inputs_embeds") if ids is None else ids
        ids = kwargs.get("decoder_input_ids") if ids is None else ids  # DiffusionGemma's decoder: the canvas
        phase = "rollout" if self.phase == "rollout" else ("loss" if torch.is_grad_enabled() else "score")
        self.calls[phase] += 1
        self.rows[phase] += 0 if ids is None else int(ids.shape[0])

    def snapshot(self):
        return {"calls": dict(self.calls), "rows": dict(self.rows)}


def run_one(name, overrides, seed, args, checkpoint, learning_rate=None):
    """Train one configuration at one seed (at ``learning_rate``, default ``args.learning_rate``) and evaluate it."""
    import torch
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    from dllm_trl.trainers import RLDFTrainer

    torch.set_num_threads(args.threads)
    load, _, _ = toy_model(args)
    task = task_functions(args)
    learning_rate = args.learning_rate if learning_rate is None else learning_rate
    model, tokenizer = load(path=checkpoint)
    settings = {**BASE, **overrides}
    completions_per_step = args.num_generations * args.prompts_per_step
    with tempfile.TemporaryDirectory() as output_dir:
        config = task["config"](
            output_dir,
            num_generations=args.num_generations,
            per_device_train_batch_size=completions_per_step,
            beta=args.beta,
            learning_rate=learning_rate,
            max_steps=args.steps,
            seed=seed,
            disable_tqdm=True,
            **settings,
        )
        trainer = RLDFTrainer(model=model, reward_funcs=task["train_reward"], args=config,
                              train_dataset=task["train_dataset"](), processing_class=tokenizer,
                              **task["trainer_pieces"](config))
        trainer.remove_callback(PrinterCallback)  # disable_tqdm swaps the progress bar for a printer of every log
        counter = ForwardCounter()
        # The decoder: the sampler calls it directly (its cached steps skip the LM head's module), the loss through
        # the full model. DiffusionGemma's get_decoder() is its canvas decoder, which every denoising step and every
        # replayed state runs (its encoder's passes over prompt and finished canvases are not counted).
        handle = trainer.model.get_decoder().register_forward_pre_hook(counter.hook, with_kwargs=True)
        generate = trainer._generate_single_turn

        def counted_generate(*a, **kw):
            counter.phase = "rollout"
            try:
                return generate(*a, **kw)
            finally:
                counter.phase = "train"

        trainer._generate_single_turn = counted_generate
        step_times = []

        class Timer(TrainerCallback):
            def on_step_begin(self, *a, **kw):
                self.start = time.perf_counter()

            def on_step_end(self, *a, **kw):
                step_times.append(time.perf_counter() - self.start)

        trainer.add_callback(Timer())
        start = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - start
        handle.remove()
        trainer._generate_single_turn = generate
    after = task["evaluate"](trainer.model, tokenizer)
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    mean = lambda key: statistics.fmean(e[key] for e in logs if key in e) if any(key in e for e in logs) else None  # noqa: E731
    counts = counter.snapshot()
    steps = max(len(step_times), 1)
    completions = steps * completions_per_step
    record = dict(
        name=name,
        seed=seed,
        settings={k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in settings.items()},
        steps=len(step_times),
        accuracy=after["accuracy"],
        rewards=[e["reward"] for e in logs],
        kl=[e.get("kl") for e in logs],  # logged only with β > 0
        losses=[e.get("loss") for e in logs],
        seconds_per_step=statistics.fmean(step_times) if step_times else None,
        train_seconds=train_seconds,
        rollout_seconds_per_step=mean("rldf/rollout_time"),
        loss_seconds_per_step=mean("rldf/loss_time"),
        model_calls_per_step={k: v / steps for k, v in counts["calls"].items()},
        forwards_per_completion={k: v / completions for k, v in counts["rows"].items()},
        states_per_completion=mean("rldf/sampled_steps"),
        target_tokens_per_state=mean("rldf/target_tokens_per_step"),
        token_utility=mean("rldf/token_utility"),
    )
    if args.task == "sudoku":  # runs of one configuration and seed differ by learning rate there
        record = dict(learning_rate=learning_rate, **record)
    if "accuracies" in after:  # DiffusionGemma: the solve rate of each sampler seed
        record["sampler_seed_accuracies"] = after["accuracies"]
    return record


# ------------------------------------------------------------------------------------------------ reporting
def _mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(runs, name):
    rows = [r for r in runs if r["name"] == name]
    acc = [r["accuracy"] for r in rows]
    tail = [statistics.fmean(r["rewards"][-max(1, len(r["rewards"]) // 3) :]) for r in rows if r["rewards"]]
    first = [r["rewards"][0] for r in rows if r["rewards"]]
    return dict(
        name=name,
        seeds=[r["seed"] for r in rows],
        accuracy=_mean_std(acc),
        accuracy_runs=acc,
        reward_first=_mean_std(first),
        reward_tail=_mean_std(tail),
        seconds_per_step=_mean_std([r["seconds_per_step"] for r in rows]),
        calls=_mean_std([sum(r["model_calls_per_step"].values()) for r in rows])[0],
        fwd_rollout=_mean_std([r["forwards_per_completion"]["rollout"] for r in rows])[0],
        fwd_score=_mean_std([r["forwards_per_completion"]["score"] for r in rows])[0],
        fwd_loss=_mean_std([r["forwards_per_completion"]["loss"] for r in rows])[0],
        targets=_mean_std([r["target_tokens_per_state"] for r in rows])[0],
        utility=_mean_std([r["token_utility"] for r in rows])[0],
    )


HEADER = (
    "| configuration | seeds | held-out accuracy | per seed | Δ vs rldf (paired) | reward step 1 | reward last third "
    "| s / step | model calls / step | fwd/compl. rollout | fwd/compl. π_old pass | fwd/compl. loss | targets / state "
    "| token utility |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _paired_delta(runs, name, seeds):
    acc = {(r["name"], r["seed"]): r["accuracy"] for r in runs}
    deltas = [acc[name, s] - acc["rldf", s] for s in seeds if (name, s) in acc and ("rldf", s) in acc]
    if not deltas or name == "rldf":
        return "—"
    mean, std = _mean_std(deltas)
    return f"{mean:+.3f} ± {std:.3f}"


def _row(runs, name, seeds):
    rows = [r for r in runs if r["name"] == name and r["seed"] in seeds]
    s = summarise(rows, name)
    per_seed = ", ".join(f"{a:.3f}" for a in s["accuracy_runs"])
    return (
        f"| {name} | {len(s['seeds'])} | {s['accuracy'][0]:.3f} ± {s['accuracy'][1]:.3f} | [{per_seed}] "
        f"| {_paired_delta(rows + [r for r in runs if r['name'] == 'rldf'], name, s['seeds'])} "
        f"| {s['reward_first'][0]:.3f} ± {s['reward_first'][1]:.3f} | {s['reward_tail'][0]:.3f} ± {s['reward_tail'][1]:.3f} "
        f"| {s['seconds_per_step'][0]:.2f} ± {s['seconds_per_step'][1]:.2f} | {s['calls']:.1f} "
        f"| {s['fwd_rollout']:.2f} | {s['fwd_score']:.2f} | {s['fwd_loss']:.2f} | {s['targets']:.2f} "
        f"| {s['utility']:.3f} |"
    )


def markdown(runs, baseline, args, order):
    steps = sorted({r["steps"] for r in runs})
    seeds_of = {}
    for r in runs:
        seeds_of.setdefault(r["name"], set()).add(r["seed"])
    lines = [
        f"Toy task{' on the toy block-diffusion model' if args.model == 'block' else ''}, "
        f"{', '.join(map(str, steps))} optimizer steps per run, {args.prompts_per_step} prompts × "
        f"{args.num_generations} generations per step, lr {args.learning_rate:g} constant, β {args.beta:g}. Held-out "
        f"greedy accuracy of the starting checkpoint on the same {args.eval_size} problems: **{baseline:.3f}**.",
        "",
        "Accuracy and rewards: mean ± sample std over seeds (per-seed values in brackets). Δ vs rldf: per-seed "
        "difference to the rldf run of the same seed (same prompts, same first rollout), mean ± std. Reward = mean "
        "rollout reward (temperature 1) of the first step / over the last third of the steps. Forwards per "
        "completion: sequence forwards (rows through the model; rollout = NFE with the dual cache) divided by "
        "completions; the loss skips groups whose rewards are all equal. s / step: wall time on a shared 2-core CPU "
        "(other jobs ran alongside: compare forwards, not seconds, across tables).",
        "",
        "### Estimators",
        "",
        HEADER,
    ]
    main_names = [n for n in order if n in MAIN and n in seeds_of]
    for name in main_names:
        lines.append(_row(runs, name, seeds_of[name]))
    ablation_names = list(dict.fromkeys(n for _, group in ABLATION_GROUPS for n in group if n in seeds_of))
    if any(n in ABLATIONS for n in ablation_names):
        common = set.intersection(*(seeds_of[n] for n in ablation_names))
        lines += ["", f"### RLDF ablations (seeds {sorted(common)}, the same for every row)", ""]
        for title, group in ABLATION_GROUPS:
            present = [n for n in group if n in seeds_of]
            if len(present) < 2:
                continue
            lines += [f"**{title}**", "", HEADER]
            lines += [_row(runs, name, common) for name in present]
            lines.append("")
    return "\n".join(lines) + "\n"


def _smooth(values, window):
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def _curves(ax, runs, names, title, ylabel="mean rollout reward"):
    """Reward per optimizer step of each configuration: mean over its runs of a trailing mean, band = min–max."""
    window = 1
    for name in names:
        rows = [r for r in runs if r["name"] == name and r["rewards"]]
        if not rows:
            continue
        n = min(len(r["rewards"]) for r in rows)
        window = max(1, n // 6)
        per_seed = [_smooth(r["rewards"][:n], window) for r in rows]
        mean = [statistics.fmean(c[i] for c in per_seed) for i in range(n)]
        low = [min(c[i] for c in per_seed) for i in range(n)]
        high = [max(c[i] for c in per_seed) for i in range(n)]
        x = range(1, n + 1)
        (line,) = ax.plot(x, mean, label=name)
        ax.fill_between(x, low, high, color=line.get_color(), alpha=0.12)
    ax.set_title(f"{title}; trailing mean over {window} steps", fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _bars(ax, runs, names, baseline, title, ylabel="held-out greedy accuracy"):
    """Final held-out score of each configuration: bar = mean over its runs, dots = the runs."""
    present = [n for n in names if any(r["name"] == n for r in runs)]
    for i, name in enumerate(present):
        acc = [r["accuracy"] for r in runs if r["name"] == name]
        ax.bar(i, statistics.fmean(acc), color="C0", alpha=0.6)
        ax.scatter([i] * len(acc), acc, color="k", s=10, zorder=3)
    ax.axhline(baseline, color="r", ls="--", lw=1, label="start checkpoint")
    ax.set_xticks(range(len(present)), present, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")


def plot(runs, baseline, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds_of = {}
    for r in runs:
        seeds_of.setdefault(r["name"], set()).add(r["seed"])
    ablation_names = list(dict.fromkeys(n for _, group in ABLATION_GROUPS for n in group if n in seeds_of))
    common = set.intersection(*(seeds_of[n] for n in ablation_names)) if ablation_names else set()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    _curves(axes[0, 0], runs, list(MAIN), "estimators: reward (mean over seeds, band = min–max)")
    _bars(axes[0, 1], runs, list(MAIN), baseline, "estimators: final held-out accuracy (dots = seeds)")
    common_runs = [r for r in runs if r["seed"] in common]
    _curves(axes[1, 0], common_runs, [n for n in ablation_names if n != "sequential"],
            f"RLDF ablations (seeds {sorted(common)}): reward")
    _bars(axes[1, 1], common_runs, ablation_names, baseline,
          f"RLDF ablations (seeds {sorted(common)}): final held-out accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --------------------------------------------------------------------------------------------- the Sudoku study
def _key(run):
    return run["name"], run["seed"], run["learning_rate"]


def tail_reward(run, steps=10):
    """Mean rollout reward over the last ``steps`` optimizer steps of a run."""
    return statistics.fmean(run["rewards"][-steps:]) if run["rewards"] else None


def lr_tuning(runs, names, learning_rates, tune_seeds) -> dict:
    """Per configuration and learning rate, the tuning runs' final solve rates and last-10-step rewards, and the
    chosen rate: the best mean solve rate over the tuning seeds (ties: the higher mean reward of the last 10 steps,
    then the smaller rate). A configuration is chosen for only when every tuning run of it is there; with a single
    rate there is nothing to tune, and that rate is chosen."""
    index = {_key(r): r for r in runs}
    tuning = {}
    for name in names:
        per_lr, complete = {}, True
        for lr in learning_rates:
            rows = [index[name, seed, lr] for seed in tune_seeds if (name, seed, lr) in index]
            complete &= len(rows) == len(tune_seeds)
            per_lr[repr(lr)] = dict(
                learning_rate=lr, seeds=[r["seed"] for r in rows], solve_rates=[r["accuracy"] for r in rows],
                solve_rate=statistics.fmean(r["accuracy"] for r in rows) if rows else None,
                reward_last10=statistics.fmean(tail_reward(r) for r in rows) if rows else None,
            )
        chosen = learning_rates[0] if len(learning_rates) == 1 else None
        if complete and chosen is None:
            best = max(per_lr.values(), key=lambda e: (e["solve_rate"], e["reward_last10"], -e["learning_rate"]))
            chosen = best["learning_rate"]
        tuning[name] = dict(per_lr=per_lr, chosen=chosen)
    return tuning


def paired_differences(runs_a, runs_b) -> dict:
    """Same-seed differences a − b of the final solve rate and of the last-10-step reward: per seed, mean ± std and
    how many seeds have a > b, a = b, a < b."""
    a = {r["seed"]: r for r in runs_a}
    b = {r["seed"]: r for r in runs_b}
    seeds = sorted(set(a) & set(b))
    out = dict(seeds=seeds)
    for field, value in (("solve_rate", lambda r: r["accuracy"]), ("reward_last10", tail_reward)):
        deltas = [value(a[s]) - value(b[s]) for s in seeds]
        mean, std = _mean_std(deltas) if deltas else (None, None)
        out[field] = dict(per_seed=deltas, mean=mean, std=std, positive=sum(d > 0 for d in deltas),
                          ties=sum(d == 0 for d in deltas), negative=sum(d < 0 for d in deltas))
    return out


def sudoku_views(store, args) -> dict:
    """The runs each part of the report reads: every estimator at its chosen lr on the evaluation seeds; every
    ablation row (rldf, sequential and the ablations) at rldf's chosen lr on the ablation seeds."""
    runs = store["runs"]
    chosen = {name: t["chosen"] for name, t in store.get("tuning", {}).items() if t["chosen"] is not None}
    main = [r for r in runs if r["name"] in MAIN and r["seed"] in args.seeds
            and r["learning_rate"] == chosen.get(r["name"])]
    ablation_lr = chosen.get("rldf")
    ablation_names = {"rldf", "sequential", *SUDOKU_ABLATIONS}
    ablations = [r for r in runs if r["name"] in ablation_names and r["seed"] in args.ablation_seeds
                 and r["learning_rate"] == ablation_lr]
    return dict(main=main, ablations=ablations, chosen=chosen, ablation_lr=ablation_lr)


def sudoku_summary(runs, name) -> dict:
    s = summarise(runs, name)
    rows = [r for r in runs if r["name"] == name]
    s["reward_last10"] = _mean_std([tail_reward(r) for r in rows])
    s["learning_rate"] = rows[0]["learning_rate"] if rows else None
    return s


SUDOKU_HEADER = (
    "| configuration | lr | seeds | final solve rate | per seed | Δ vs rldf (paired) | reward step 1 "
    "| reward last 10 steps | s / step | model calls / step | fwd/compl. rollout | fwd/compl. π_old pass "
    "| fwd/compl. loss | states / compl. | targets / state | token utility |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _fmt(mean_std, digits=3, signed=False):
    mean, std = mean_std
    if mean is None or math.isnan(mean):
        return "—"
    mean = 0.0 if abs(mean) < 0.5 * 10**-digits else mean  # no "-0.000" for a mean that rounds to zero
    return f"{mean:{'+' if signed else ''}.{digits}f} ± {std:.{digits}f}"


def _sudoku_row(runs, name):
    s = sudoku_summary(runs, name)
    rldf = [r for r in runs if r["name"] == "rldf"]
    mine = [r for r in runs if r["name"] == name]
    delta = "—"
    if name != "rldf" and rldf:
        paired = paired_differences(mine, rldf)["solve_rate"]
        delta = _fmt((paired["mean"], paired["std"]), signed=True)
    states = _mean_std([r["states_per_completion"] for r in mine])[0]
    return (
        f"| {name} | {s['learning_rate']:g} | {len(s['seeds'])} | {_fmt(s['accuracy'])} "
        f"| [{', '.join(f'{a:.2f}' for a in s['accuracy_runs'])}] | {delta} | {_fmt(s['reward_first'])} "
        f"| {_fmt(s['reward_last10'])} | {_fmt(s['seconds_per_step'], 2)} | {s['calls']:.1f} | {s['fwd_rollout']:.2f} "
        f"| {s['fwd_score']:.2f} | {s['fwd_loss']:.2f} | {states:.2f} | {s['targets']:.2f} | {s['utility']:.3f} |"
    )


def sudoku_markdown(store, args) -> str:
    setup, views = store["setup"], sudoku_views(store, args)
    lrs = setup["learning_rates"]
    gemma = setup.get("model") == "diffusion_gemma"
    toy, rollouts, final, reward_of, forwards = (
        "4×4 Sudoku toy (`load_sudoku()`)",
        "the Sudoku sampler at temperature 1, 20 decoding steps, one cell each",
        f"greedy, binary `sudoku_reward`, first {setup['eval_size']} test puzzles",
        "temperature-1 rollouts",
        "sequence forwards (rows through the model)",
    )
    if gemma:
        toy, rollouts, final, reward_of, forwards = (
            "4×4 Sudoku, DiffusionGemma toy (`load_sudoku_diffusion_gemma()`: uniform-noise block diffusion)",
            "the toy's `DiffusionGemmaSampler`: one canvas of 20 tokens, at most 16 denoising steps, temperatures "
            "0.8 → 0.4, entropy-bound acceptance",
            f"**not greedy** (DiffusionGemma's decoding is random): the mean over sampler seeds "
            f"{setup['sampler_seeds']} of the binary `sudoku_reward` solve rate on the first "
            f"{setup['eval_size']} test puzzles (`evaluate_diffusion_gemma_accuracy`)",
            "rollouts",
            "decoder forwards (canvases through the decoder; the encoder's passes are not counted)",
        )
    lines = [
        f"{toy}, {setup['steps']} optimizer steps per run, {setup['prompts_per_step']} "
        f"puzzles × {setup['num_generations']} generations per step (rollouts: {rollouts}), trained on "
        f"`sudoku_cell_reward`, β {setup['beta']:g}, constant lr. "
        f"Final solve rate: {final}; start "
        f"checkpoint **{store['baseline_accuracy']:.3f}**.",
        "",
        f"Learning rate tuned per estimator over {', '.join(f'{lr:g}' for lr in lrs)} on tuning seeds "
        f"{setup['tune_seeds']} (best mean final solve rate; ties: higher last-10-step reward, then the smaller lr); "
        f"evaluation seeds {sorted(args.seeds)} at that lr. Ablations at rldf's tuned lr on seeds "
        f"{sorted(args.ablation_seeds)}; τ at k = 4. Mean ± sample std over seeds (per seed in brackets). Δ: same-seed "
        f"difference (same prompts, same first rollout). Reward: mean partial-credit reward of the {reward_of}. "
        f"Forwards per completion: {forwards} / completions; the loss skips "
        "groups whose rewards are all equal. s / step: one CPU thread, another job on the machine's other core.",
        "",
        "### Learning-rate tuning (mean final solve rate over the tuning seeds [per seed]; reward last 10 steps)",
        "",
        "| configuration | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | chosen |",
        "|---|" + "---|" * (len(lrs) + 1),
    ]
    for name, t in store.get("tuning", {}).items():
        cells = []
        for lr in lrs:
            e = t["per_lr"][repr(lr)]
            cells.append("—" if e["solve_rate"] is None else
                         f"{e['solve_rate']:.3f} [{', '.join(f'{a:.2f}' for a in e['solve_rates'])}]; "
                         f"{e['reward_last10']:.3f}")
        chosen = "—" if t["chosen"] is None else f"{t['chosen']:g}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {chosen} |")
    main_names = [n for n in MAIN if any(r["name"] == n for r in views["main"])]
    if main_names:
        lines += ["", f"### Estimators (each at its tuned lr; seeds {sorted(args.seeds)})", "", SUDOKU_HEADER]
        lines += [_sudoku_row(views["main"], name) for name in main_names]
    if store.get("paired"):
        header = ("| pair | seeds | Δ final solve rate | per seed | seeds with Δ > 0 / = 0 / < 0 "
                  "| Δ reward last 10 steps | seeds with Δ > 0 / = 0 / < 0 |")
        lines += ["", "### Neighbouring estimators: paired differences (no ordering claimed by paper 1)", "",
                  header, "|---|---|---|---|---|---|---|"]
        for entry in store["paired"]:
            sr, rw = entry["solve_rate"], entry["reward_last10"]
            lines.append(
                f"| {entry['a']} − {entry['b']} | {len(entry['seeds'])} | {_fmt((sr['mean'], sr['std']), signed=True)} "
                f"| [{', '.join(f'{d:+.2f}' for d in sr['per_seed'])}] | {sr['positive']} / {sr['ties']} / "
                f"{sr['negative']} | {_fmt((rw['mean'], rw['std']), signed=True)} | {rw['positive']} / {rw['ties']} / "
                f"{rw['negative']} |"
            )
    present = {r["name"] for r in views["ablations"]}
    if present & set(SUDOKU_ABLATIONS):
        lines += ["", f"### RLDF ablations (rldf's tuned lr {views['ablation_lr']:g}; seeds "
                      f"{sorted(args.ablation_seeds)}, the same for every row)", ""]
        for title, group in SUDOKU_ABLATION_GROUPS:
            names = [n for n in group if n in present]
            if len(names) < 2:
                continue
            lines += [f"**{title}**", "", SUDOKU_HEADER]
            lines += [_sudoku_row(views["ablations"], name) for name in names]
            lines.append("")
    if store.get("wall_seconds"):
        lines += ["", f"Wall clock of the runs: {store['wall_seconds']:.0f} s over {len(store['runs'])} runs."]
    return "\n".join(lines) + "\n"


def sudoku_plot(store, args, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    views, baseline = sudoku_views(store, args), store["baseline_accuracy"]
    gemma = store["setup"].get("model") == "diffusion_gemma"
    rate = "solve rate (mean over sampler seeds)" if gemma else "greedy solve rate"
    fig, axes = plt.subplots(2, 3, figsize=(17, 8.5))
    _curves(axes[0, 0], views["main"], list(MAIN), "estimators at tuned lr: reward", "mean partial-credit reward")
    _bars(axes[0, 1], views["main"], list(MAIN), baseline, "estimators at tuned lr: final solve rate (dots = seeds)",
          rate)
    ax = axes[0, 2]
    for i, (name, t) in enumerate(store.get("tuning", {}).items()):
        points = [(e["learning_rate"], e["solve_rate"]) for e in t["per_lr"].values() if e["solve_rate"] is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=name, color=f"C{i}")
    ax.axhline(baseline, color="r", ls="--", lw=1, label="start checkpoint")
    ax.set(xscale="log", xlabel="learning rate", ylabel="mean final solve rate (tuning seeds)")
    ax.set_title(f"learning-rate tuning, seeds {store['setup']['tune_seeds']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    names = list(dict.fromkeys(n for _, group in SUDOKU_ABLATION_GROUPS for n in group))
    lr = views["ablation_lr"]
    _curves(axes[1, 0], views["ablations"], [n for n in names if n != "sequential"],
            f"RLDF ablations (lr {lr}): reward", "mean partial-credit reward")
    _bars(axes[1, 1], views["ablations"], names, baseline, f"RLDF ablations (lr {lr}): final solve rate", rate)
    ax = axes[1, 2]
    for i, entry in enumerate(store.get("paired", [])):
        deltas = entry["solve_rate"]["per_seed"]
        if deltas:
            ax.bar(i, statistics.fmean(deltas), color="C0", alpha=0.6)
            ax.scatter([i] * len(deltas), deltas, color="k", s=12, zorder=3)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(store.get("paired", []))), [f"{e['a']}\n− {e['b']}" for e in store.get("paired", [])],
                  fontsize=7)
    ax.set_ylabel("paired Δ final solve rate")
    ax.set_title("neighbouring estimators: same-seed differences (dots = seeds)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def sudoku_report(store, args):
    """Recompute the tuning choice, the per-configuration summary and the paired differences into ``store``."""
    names = [n for n in MAIN if any(r["name"] == n for r in store["runs"])]
    store["tuning"] = lr_tuning(store["runs"], names, store["setup"]["learning_rates"], store["setup"]["tune_seeds"])
    views = sudoku_views(store, args)
    summary = {}
    for part in ("main", "ablations"):
        for name in dict.fromkeys(r["name"] for r in views[part]):
            s = sudoku_summary(views[part], name)
            summary[f"{part}/{name}"] = dict(
                name=name, learning_rate=s["learning_rate"], seeds=s["seeds"], solve_rate=list(s["accuracy"]),
                solve_rates=s["accuracy_runs"], reward_first=list(s["reward_first"]),
                reward_last10=list(s["reward_last10"]), seconds_per_step=list(s["seconds_per_step"]),
                model_calls_per_step=s["calls"],
                forwards_per_completion=dict(rollout=s["fwd_rollout"], score=s["fwd_score"], loss=s["fwd_loss"]),
                target_tokens_per_state=s["targets"], token_utility=s["utility"],
            )
    store["summary"] = summary
    by_name = {}
    for r in views["main"]:
        by_name.setdefault(r["name"], []).append(r)
    store["paired"] = [dict(a=a, b=b, **paired_differences(by_name[a], by_name[b]))
                       for a, b in NEIGHBOUR_PAIRS if a in by_name and b in by_name]
    return store


def main_sudoku(args):
    import torch

    torch.set_num_threads(args.threads)
    load, shipped, _ = toy_model(args)
    checkpoint = args.checkpoint or str(shipped)
    if not (Path(checkpoint) / "config.json").is_file():
        raise SystemExit(f"no Sudoku checkpoint at {checkpoint}")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / f"{args.name}.json"
    store = {} if args.fresh or not results_path.is_file() else json.loads(results_path.read_text())
    setup = dict(task="sudoku", steps=args.steps, learning_rates=args.learning_rates, tune_seeds=args.tune_seeds,
                 num_generations=args.num_generations, prompts_per_step=args.prompts_per_step, beta=args.beta,
                 eval_size=args.eval_size, train_reward="sudoku_cell_reward", eval_reward="sudoku_reward",
                 checkpoint="shipped" if args.checkpoint is None else os.path.abspath(checkpoint),
                 **({"model": "diffusion_gemma", "sampler_seeds": args.sampler_seeds}
                    if args.model == "diffusion_gemma" else {}))
    if args.report_only:
        if not store.get("runs"):
            raise SystemExit(f"no runs in {results_path} to report")
    elif store.get("setup") != setup:
        store = {"setup": setup, "runs": []}
    if "baseline_accuracy" not in store:
        model, tokenizer = load(path=checkpoint)
        store["baseline_accuracy"] = task_functions(args)["evaluate"](model, tokenizer)["accuracy"]
    configs = selected_configs(args)
    main_names = [n for n in configs if n in MAIN] if args.only in ("all", "main") else []
    ablation_names = ([n for n in configs if n in SUDOKU_ABLATIONS or n in ("rldf", "sequential")]
                      if args.only in ("all", "ablations") else [])
    start = time.perf_counter()
    ran = 0

    def execute(todo, phase):
        nonlocal ran
        done = {_key(r) for r in store["runs"]}
        todo = [t for t in dict.fromkeys(todo) if t not in done]
        for n, (name, seed, lr) in enumerate(todo, 1):
            began = time.perf_counter()
            result = run_one(name, configs[name], seed, args, checkpoint, lr)
            result["run_seconds"] = time.perf_counter() - began  # training, evaluation and set-up
            store["runs"].append(result)
            store["wall_seconds"] = store.get("wall_seconds", 0.0) + result["run_seconds"]
            results_path.write_text(json.dumps(store, indent=1) + "\n")
            ran += 1
            print(f"[{phase} {n}/{len(todo)}] {name:22s} lr {lr:g} seed {seed:3d}: solve rate "
                  f"{result['accuracy']:.3f}, reward {result['rewards'][0]:.3f} -> last 10 {tail_reward(result):.3f}, "
                  f"{result['seconds_per_step']:.2f} s/step ({time.perf_counter() - start:.0f} s so far)", flush=True)

    if not args.report_only:
        print(f"start checkpoint solve rate {store['baseline_accuracy']:.3f}", flush=True)
        if len(args.learning_rates) > 1:
            execute([(n, s, lr) for n in main_names for lr in args.learning_rates for s in args.tune_seeds], "tune")
        sudoku_report(store, args)
        chosen = {n: t["chosen"] for n, t in store["tuning"].items()}
        if len(args.learning_rates) == 1:
            chosen = dict.fromkeys(main_names, args.learning_rates[0])
        execute([(n, s, chosen[n]) for n in main_names for s in args.seeds if chosen.get(n) is not None], "eval")
        if ablation_names:
            if chosen.get("rldf") is None:
                raise SystemExit("the ablations run at rldf's tuned learning rate: tune rldf first (--only main)")
            execute([(n, s, chosen["rldf"]) for n in ablation_names for s in args.ablation_seeds], "ablation")
    sudoku_report(store, args)
    results_path.write_text(json.dumps(store, indent=1) + "\n")
    table = sudoku_markdown(store, args)
    (out / f"{args.name}_table.md").write_text(table)
    sudoku_plot(store, args, out / f"{args.name}.png")
    print("\n" + table)
    print(f"{ran} runs in {time.perf_counter() - start:.0f} s; wrote {results_path}, "
          f"{out / (args.name + '_table.md')}, {out / (args.name + '.png')}")
    return store


def main(argv=None):
    args = parse_args(argv)
    if args.task == "sudoku":
        return main_sudoku(args)
    import torch

    from dllm_trl.toy import evaluate_accuracy, toy_dataset

    torch.set_num_threads(args.threads)
    load, shipped, eval_config = toy_model(args)
    checkpoint = args.checkpoint or str(shipped)
    if not (Path(checkpoint) / "config.json").is_file():
        raise SystemExit(f"no toy checkpoint at {checkpoint}: run scripts/pretrain_toy.py (--output-dir) first")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / f"{args.name}.json"
    store = {} if args.fresh or not results_path.is_file() else json.loads(results_path.read_text())
    setup = dict(steps=args.steps, learning_rate=args.learning_rate, num_generations=args.num_generations,
                 prompts_per_step=args.prompts_per_step, beta=args.beta, eval_size=args.eval_size,
                 checkpoint="shipped" if args.checkpoint is None else os.path.abspath(checkpoint),
                 **({"model": "block"} if args.model == "block" else {}))
    if store.get("setup") != setup:
        store = {"setup": setup, "runs": []}
    if "baseline_accuracy" not in store:
        model, tokenizer = load(path=checkpoint)
        store["baseline_accuracy"] = evaluate_accuracy(
            model, tokenizer, toy_dataset("test", size=args.eval_size), eval_config
        )["accuracy"]
    configs = selected_configs(args)
    done = {(r["name"], r["seed"]) for r in store["runs"]}
    todo = [(name, seed) for name in configs for seed in args.seeds if (name, seed) not in done]
    if args.report_only:
        todo = []
    print(f"start checkpoint accuracy {store['baseline_accuracy']:.3f}; {len(todo)} runs to do", flush=True)
    start = time.perf_counter()
    for n, (name, seed) in enumerate(todo, 1):
        result = run_one(name, configs[name], seed, args, checkpoint)
        store["runs"].append(result)
        results_path.write_text(json.dumps(store, indent=1) + "\n")
        print(
            f"[{n}/{len(todo)}] {name:24s} seed {seed}: accuracy {result['accuracy']:.3f}, reward "
            f"{result['rewards'][0]:.3f} -> {statistics.fmean(result['rewards'][-5:]):.3f}, "
            f"{result['seconds_per_step']:.2f} s/step ({time.perf_counter() - start:.0f} s so far)",
            flush=True,
        )
    runs = store["runs"]  # every run of this setup in the file, whatever this invocation ran
    order = list(MAIN) + [n for n in ABLATIONS]
    table = markdown(runs, store["baseline_accuracy"], args, order)
    (out / f"{args.name}_table.md").write_text(table)
    plot(runs, store["baseline_accuracy"], out / f"{args.name}.png")
    print("\n" + table)
    print(f"wrote {results_path}, {out / (args.name + '_table.md')}, {out / (args.name + '.png')}")
    return store


if __name__ == "__main__":
    sys.exit(main() and 0)
