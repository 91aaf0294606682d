"""Trust-region study on the Sudoku toys: paper 2 ("Predictive Divergence Masks") in miniature (SPEC §3).

Five trust regions, each trained from the same checkpoint with the same seeds, prompts per step, group size,
learning rate and rollout settings, in an off-policy stress setting: every rollout batch is reused for
``num_iterations`` optimizer steps (4 by default), so three of every four updates see data from an older policy;
on the diffusion toy the rollout also runs with the dual KV cache, whose approximation makes the recorded
behaviour distribution ``μ`` differ from the training forward even at the first update (SPEC §3.3).

Methods (how each one is expressed; see docs/trust_region.md):

* ``grpo_clip_higher``: TRL's clipped PPO surrogate with ``epsilon = 0.2``, ``epsilon_high = 0.28`` —
  ``trl.GRPOTrainer`` on the causal toy, :class:`~dllm_trl.RLDFTrainer` (its PPO loss) on the diffusion toy;
* ``ppo_ratio_mask``: the same clipped surrogate with a symmetric ``epsilon = 0.2``, i.e. the PPO ratio mask in
  its clipped form (not expressible in ``DPPOMaskConfig``, which has no ratio proximity test);
* ``dppo_topk_kl``: :class:`~dllm_trl.DPPOMaskTrainer`, ``divergence="kl"``, ``mask_direction="ratio"``;
* ``predictive_agg`` / ``predictive_uni``: the same with ``mask_direction="predictive"`` and
  ``tail_estimator="aggregated"`` / ``"uniform"``.

Per run: greedy held-out solve rate of the first ``--eval-size`` test puzzles after training and avg@8 (8
temperature-1 samples per puzzle; the start values are measured once per model), the mean rollout reward per
rollout (collapse is defined on it: the trailing mean of 3 rollouts ends below ``--collapse-fraction`` of the first),
the fraction of loss tokens the trust region drops (``dppo/masked_frac``; ``clip_ratio/region_mean`` for the clipped
surrogates), and for the divergence masks the fraction of tokens outside the trust region (``D > δ``) and, among
those, the fraction on which the predictive and the ratio direction criteria point differently.

Issue 24 added, for the divergence masks on the causal toy: the distribution of the mask's ``D`` by update index and
the δ whose region is as large as clip-higher's ratio window (:func:`divergence_profile`, to calibrate ``--delta``);
and the direction-agreement analysis (:func:`direction_agreement`): every loss call is re-scored with the policy after
the optimizer step that used it (:class:`Rescorer`), and for each out-of-region token the ratio sign, the predictive
sign (both tail estimators) and the realised sign of ΔD are compared, with 95% Wilson intervals in the table. Stresses
that let the criteria differ: ``--top-k`` below the effective vocabulary, ``--rollout-quant`` (fake-quantised rollout
weights, so μ ≠ π_old as with FP8 rollouts) and ``--minibatches``.

Results go to a JSON file after every run (runs already there are skipped, so an interrupted study resumes), then a
Markdown table and a PNG plot::

    python benchmarks/trust_region.py                       # the main study: causal toy, FP8 rollouts, K 2, δ 0.05,
                                                            # 5 methods x 10 seeds, 48 steps (trust_region_stress_delta0.05)
    python benchmarks/trust_region.py --quick               # 1 seed, 3 steps: a rehearsal (written to a temp dir)
    python benchmarks/trust_region.py --methods dppo_topk_kl predictive_uni --seeds 0 1
    python benchmarks/trust_region.py --models causal diffusion --rollout-quant none --top-k 4 --delta 0.15 \
        --seeds 0 1 2 3 4 --name trust_region          # the first, uncalibrated study (superseded)
    python benchmarks/trust_region.py --analysis direction --inputs docs/results/trust_region_stress_delta0.05.json  # pooled

Issue 33, rollouts from a real inference engine: ``--rollout-engine vllm`` rolls the causal toy out with a colocated
vLLM engine (TRL's ``use_vllm``, docs/vllm.md) in ``--engine-dtype`` (bfloat16 by default) while training runs in
float32, so μ (the engine's top-K log-probs) differs from π_old by the engine's own numerics; ``--engine-temperature``
adds a sampling-configuration stress (the engine samples at that temperature, the trainer scores at 1). Every run
records the mismatch of each rollout batch (:func:`rollout_mismatch`) and the trainer's ``sampling/*`` metrics per
step. ``--analysis mismatch`` measures the step-0 mismatch of several rollout sources against the float32 trainer and
the share of tokens each trust region drops because of it::

    python benchmarks/trust_region.py --analysis mismatch --name trust_region_vllm_mismatch
    python benchmarks/trust_region.py --rollout-engine vllm --methods grpo_clip_higher ppo_ratio_mask dppo_topk_kl \
        predictive_agg --seeds 0 1 2 3 4 5 --name trust_region_vllm_bf16

``--models diffusion_gemma`` adds the DiffusionGemma Sudoku toy (``load_sudoku_diffusion_gemma()``;
docs/trust_region.md, "DiffusionGemma column"): the clipped surrogates through :class:`~dllm_trl.RLDFTrainer` with
``DiffusionGemmaRLDFLoss`` (its PPO terms at ``num_iterations > 1``), the divergence masks through
``DiffusionDPPOMaskTrainer`` with ``DiffusionGemmaTrustRegionLoss`` (μ of an accepted token: the tempered distribution
the rollout drew it from, recorded top-K; of a clean target: π_old), both with the toy's ``DiffusionGemmaSampler``. Its
encoder cache is exact, so the stress is the reuse of each rollout alone: ``--cache-mode``, ``--rollout-quant`` and
``--minibatches`` are refused for it. Its decoding is random, so its solve rate is the mean over ``--sampler-seeds`` (no
greedy decoding, no separate avg@N)::

    python benchmarks/trust_region.py --models diffusion_gemma --seeds 0 1 2 --name trust_region_diffusion_gemma
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODELS = ("causal", "diffusion", "diffusion_gemma")
ROLLOUT_ENGINES = ("transformers", "vllm")
ENGINE_DTYPES = ("float32", "bfloat16")
MISMATCH_SOURCES = ("transformers", "transformers:fp8_e5m2", "vllm:float32", "vllm:bfloat16", "vllm:bfloat16:T=0.6")
"""Rollout sources of ``--analysis mismatch`` (see :func:`parse_source`)."""
ROLLOUT_QUANT = ("none", "fp8_e4m3", "fp8_e5m2", "int8")
METHODS = {
    "grpo_clip_higher": dict(kind="clip", epsilon=0.2, epsilon_high=0.28),
    "ppo_ratio_mask": dict(kind="clip", epsilon=0.2),
    "dppo_topk_kl": dict(kind="mask", divergence="kl", mask_direction="ratio"),
    "predictive_agg": dict(kind="mask", divergence="kl", mask_direction="predictive", tail_estimator="aggregated"),
    "predictive_uni": dict(kind="mask", divergence="kl", mask_direction="predictive", tail_estimator="uniform"),
}
LABELS = {
    "grpo_clip_higher": "GRPO clip-higher (ε 0.2 / 0.28)",
    "ppo_ratio_mask": "PPO ratio mask (clip, ε 0.2)",
    "dppo_topk_kl": "DPPO top-K KL (ratio direction)",
    "predictive_agg": "predictive, aggregated tail",
    "predictive_uni": "predictive, uniform tail",
}


DEFAULT_NAME = "trust_region_stress_delta0.05"
"""The main study's output stem (docs/trust_region.md): its settings are the defaults."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["causal"],
                        help="Toys to train (default: the causal one, paper 2's setting).")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)), help="Paired seeds (default 0-9).")
    parser.add_argument("--steps", type=int, default=48,
                        help="Optimizer steps per run (12 rollouts at num_iterations 4).")
    parser.add_argument("--num-iterations", type=int, default=4,
                        help="Optimizer steps per rollout batch (TRL's num_iterations): all but the first off-policy.")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="Constant learning rate (the main job's).")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--delta", type=float, default=0.05,
                        help="δ of the divergence masks, nats (default 0.05: a region as large as clip-higher's on "
                             "the causal toy, docs/trust_region.md; the paper's main value is 0.15).")
    parser.add_argument("--top-k", type=int, default=2,
                        help="K of the behaviour top-K (vocabulary of 22 tokens; 2 leaves mass outside the top-K).")
    parser.add_argument("--eval-size", type=int, default=100, help="First N test puzzles for the greedy solve rate.")
    parser.add_argument("--eval-samples", type=int, default=8,
                        help="Temperature-1 samples per held-out puzzle for avg@N (0 skips it).")
    parser.add_argument("--cache-mode", choices=["dual", "prefix", "none"], default=None,
                        help="Diffusion toy: the rollout sampler's KV cache (default dual; 'none' is exact: μ = the "
                             "training forward). Refused for DiffusionGemma alone (its encoder cache is exact).")
    parser.add_argument("--sampler-seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="DiffusionGemma: seeds of its random held-out decoding; its solve rate is their mean.")
    parser.add_argument("--rollout-quant", choices=ROLLOUT_QUANT, default=None,
                        help="Fake-quantise the rollout model's weights (per-tensor scale, round to the format's grid) "
                             "while it generates, as an FP8 rollout engine does: μ ≠ π_old (causal toy; default fp8_e5m2 when only "
                             "the causal toy runs, none otherwise).")
    parser.add_argument("--minibatches", type=int, default=1,
                        help="Split each rollout batch into N minibatches, one optimizer step each (TRL's "
                             "steps_per_generation; causal toy): num_iterations × N updates per rollout.")
    parser.add_argument("--isolated-sample", type=int, default=None,
                        help="Direction analysis: per update, agreeing out-of-region tokens to measure in isolation "
                             "besides all disagreeing ones (negative: no isolated measurement; default 2, and none "
                             "with --rollout-engine vllm).")
    parser.add_argument("--collapse-fraction", type=float, default=0.5,
                        help="Collapse: the training reward (trailing mean of 3 rollouts) ends below this fraction of "
                             "the first rollout's reward.")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads.")
    parser.add_argument("--quick", action="store_true", help="Rehearsal: 1 seed, 3 steps, output in a temp dir.")
    parser.add_argument("--output-dir", default=str(REPO / "docs" / "results"), help="Where the JSON, table and plot go.")
    parser.add_argument("--name", default=DEFAULT_NAME, help="Stem of the output files (default: the main study's).")
    parser.add_argument("--fresh", action="store_true", help="Ignore runs already in the JSON file.")
    parser.add_argument("--report-only", action="store_true", help="Only rewrite the table and plot from the JSON.")
    parser.add_argument("--rollout-engine", choices=ROLLOUT_ENGINES, default="transformers",
                        help="Causal toy: who generates the rollouts. vllm: a colocated vLLM engine (TRL's use_vllm, "
                             "docs/vllm.md), μ = its top-K log-probs, in --engine-dtype while training runs in "
                             "float32.")
    parser.add_argument("--engine-dtype", choices=ENGINE_DTYPES, default="bfloat16",
                        help="vLLM engine precision (default bfloat16: the engine-vs-float32-training mismatch).")
    parser.add_argument("--engine-temperature", type=float, default=None,
                        help="Stress: the vLLM engine samples at this temperature while the trainer scores π at the "
                             "training temperature (1), a sampling-configuration mismatch μ ≠ π_old (default: none).")
    parser.add_argument("--sources", nargs="+", default=list(MISMATCH_SOURCES),
                        help="--analysis mismatch: rollout sources, 'transformers[:QUANT]' or "
                             "'vllm:DTYPE[:T=TEMPERATURE]' (default: %(default)s).")
    parser.add_argument("--analysis", choices=["direction", "mismatch"],
                        help="direction: pool the direction-agreement counts of the mask runs in the study JSON files "
                             "given by --inputs and write {name}_direction.md (no training). mismatch: roll out the "
                             "start checkpoint from each of --sources and compare its μ with the float32 trainer's π "
                             "(the step-0 rollout mismatch and the share of tokens each trust region drops).")
    parser.add_argument("--inputs", nargs="+", default=[], help="Study JSON files for --analysis.")
    args = parser.parse_args(argv)
    if "diffusion_gemma" in args.models:
        refused = {"--cache-mode": args.cache_mode is not None and "diffusion" not in args.models,
                   "--rollout-quant": args.rollout_quant not in (None, "none"), "--minibatches": args.minibatches > 1}
        if any(refused.values()):
            raise SystemExit(
                f"{', '.join(flag for flag, bad in refused.items() if bad)}: not a stress of the DiffusionGemma toy "
                "(its encoder cache is exact and always on; the fake-quantised rollout and the minibatches are wired "
                "for the causal toy only). Run the other toys separately for them (docs/trust_region.md)."
            )
    args.cache_mode = args.cache_mode or "dual"
    vllm = args.rollout_engine == "vllm"
    if vllm and args.models != ["causal"]:
        raise SystemExit("--rollout-engine vllm rolls out the causal toy only (--models causal): vLLM does not return "
                         "the per-step record the diffusion trainers train on (docs/vllm.md).")
    if vllm and args.rollout_quant not in (None, "none"):
        raise SystemExit("--rollout-quant fake-quantises transformers' rollout weights; with --rollout-engine vllm the "
                         "mismatch is the engine's (--engine-dtype, --engine-temperature): leave --rollout-quant out.")
    if args.engine_temperature is not None and not vllm:
        raise SystemExit("--engine-temperature sets the vLLM engine's sampling temperature: add --rollout-engine vllm.")
    if args.engine_temperature is not None and not args.engine_temperature > 0:
        raise SystemExit(f"--engine-temperature {args.engine_temperature}: the engine samples, so it must be > 0.")
    if args.isolated_sample is None:  # off with vLLM, as in the shipped vLLM study (docs/trust_region.md)
        args.isolated_sample = -1 if vllm else 2
    if args.rollout_quant is None:
        args.rollout_quant = "fp8_e5m2" if args.models == ["causal"] and not vllm else "none"
    if args.quick:
        args.steps, args.seeds = 3, args.seeds[:1]
        if args.name == DEFAULT_NAME:
            args.name = "trust_region_quick"
        if args.output_dir == str(REPO / "docs" / "results"):
            args.output_dir = os.path.join(tempfile.gettempdir(), "dllm_trl_trust_region_quick")
    return args


# ------------------------------------------------------------------------------------------------ token metrics
def direction_disagreement(div, direction, log_ratio, advantages, delta, delta_low=None, delta_high=None) -> dict:
    """Where the predictive and the ratio direction criteria part, among the tokens outside the trust region.

    Returns boolean tensors over the tokens: ``outside`` — the proximity test ``D > δ`` (``δ_high`` where ``A > 0``)
    that both masks share; ``direction`` — outside, and ``sign(g) ≠ sign(r − 1)`` (the two direction criteria point
    differently, whatever the advantage); ``decision`` — the predictive and the DPPO ratio keep-masks differ (the
    same tokens, less those with ``A = 0``, where neither mask drops anything). Library rules only:
    :func:`~dllm_trl.losses.divergence_masks.divergence_proximity`, ``predictive_mask`` and ``dppo_mask``.
    """
    import torch

    from dllm_trl.losses.divergence_masks import divergence_proximity, dppo_mask, predictive_mask

    thresholds = dict(delta=delta, delta_low=delta_low, delta_high=delta_high)
    outside = divergence_proximity(div, advantages, **thresholds)
    decision = predictive_mask(div, direction, advantages, **thresholds) != dppo_mask(div, log_ratio, advantages,
                                                                                       **thresholds)
    return dict(outside=outside, direction=outside & (torch.sign(direction) != torch.sign(log_ratio)),
                decision=decision)


def record_metrics(records, args) -> dict:
    """Token counts of the mask over every loss call of a DPPOMaskTrainer run (``trainer.loss.records``)."""
    import torch

    from dllm_trl.losses.divergence_masks import ppo_mask

    tokens = {name: torch.cat([r[name] for r in records]) for name in ("div", "direction", "log_ratio",
                                                                        "advantages", "keep", "weights")}
    parts = direction_disagreement(tokens["div"], tokens["direction"], tokens["log_ratio"], tokens["advantages"],
                                   args.divergence_threshold, args.divergence_threshold_low,
                                   args.divergence_threshold_high)
    counts = {name: int(value.sum()) for name, value in parts.items()}
    n, outside = tokens["keep"].numel(), counts["outside"]
    keep, weights = tokens["keep"], tokens["weights"].double()
    # What the divergence mask lets through that GRPO clip-higher's ratio rule would have dropped.
    ratio_drops = ~ppo_mask(tokens["log_ratio"], tokens["advantages"], 0.2, 0.28)
    return dict(
        tokens=n,
        masked_tokens=int((~tokens["keep"]).sum()),
        outside_tokens=outside,
        direction_disagree_tokens=counts["direction"],
        decision_disagree_tokens=counts["decision"],
        outside_frac=outside / max(n, 1),
        disagree_frac_of_outside=counts["direction"] / outside if outside else None,
        decision_disagree_frac_of_outside=counts["decision"] / outside if outside else None,
        divergence_mean=float(tokens["div"].double().mean()) if n else None,
        kept_but_ratio_clipped_tokens=int((keep & ratio_drops).sum()),
        kept_weight_mean=float(weights[keep].mean()) if keep.any() else None,
        kept_weight_max=float(weights[keep].max()) if keep.any() else None,
    )


# ------------------------------------------------------------------------------------ direction agreement (issue 24)
def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float] | None:
    """Wilson score interval of a binomial proportion (95% for the default ``z``); ``None`` when ``n = 0``."""
    if n == 0:
        return None
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def direction_agreement(div_before, div_after, g_agg, g_uni, log_ratio, advantages, delta, delta_low=None,
                        delta_high=None, subset=None) -> dict:
    """Does the predicted direction of a token's update match the realised change of its divergence?

    Over the tokens outside the trust region (``D > δ``, ``δ_high`` where ``A > 0``) with ``A ≠ 0`` (and in
    ``subset`` when given), the update moves the token's logits along ``sign(A)·(e_a − π)``, so each criterion predicts
    the sign of ``ΔD``: the ratio criterion ``sign(A)·sign(r − 1)``, the predictive one ``sign(A)·sign(g)`` (``g`` of
    the aggregated or the uniform tail). The realised sign is ``sign(D_after − D_before)``, ``D_after`` re-scored with
    the updated policy on the same behaviour view. Returns integer counts: ``tokens``; ``realised_up`` (ΔD > 0);
    ``ratio_right`` / ``agg_right`` / ``uni_right`` (predicted sign = realised sign); and for each tail, on the tokens
    where its sign and the ratio's differ, ``{tail}_disagree`` and ``{tail}_right_on_disagree`` (there the ratio sign is
    right on the others, unless ``ΔD = 0`` exactly: ``{tail}_tie_on_disagree``) and ``{tail}_up_on_disagree`` (ΔD > 0
    there: the score of "D always rises", the base rate either criterion must beat).
    """
    import torch

    from dllm_trl.losses.divergence_masks import divergence_proximity

    eligible = divergence_proximity(div_before, advantages, delta, delta_low, delta_high) & (advantages != 0)
    if subset is not None:
        eligible = eligible & subset
    a_sign = torch.sign(advantages)
    realised = torch.sign(div_after.double() - div_before.double())
    ratio = a_sign * torch.sign(log_ratio)
    counts = dict(tokens=int(eligible.sum()), realised_up=int((eligible & (realised > 0)).sum()),
                  ratio_right=int((eligible & (ratio == realised)).sum()))
    for tail, g in (("agg", g_agg), ("uni", g_uni)):
        predicted = a_sign * torch.sign(g)
        differ = eligible & (predicted != ratio)
        counts[f"{tail}_right"] = int((eligible & (predicted == realised)).sum())
        counts[f"{tail}_disagree"] = int(differ.sum())
        counts[f"{tail}_right_on_disagree"] = int((differ & (predicted == realised)).sum())
        counts[f"{tail}_tie_on_disagree"] = int((differ & (realised == 0)).sum())
        counts[f"{tail}_up_on_disagree"] = int((differ & (realised > 0)).sum())
    return counts


def record_directions(record, vocab_size):
    """``g`` of both tail estimators and the behaviour tail mass, rebuilt from one loss call's record."""
    from dllm_trl.losses.divergence_masks import directional_derivative, truncated_view

    view = truncated_view(record["mu_ids"], record["mu_logps"], record["action"], record["mu_action_logps"],
                          record["pi_support"], vocab_size=vocab_size, binary=record["mu_ids"].shape[-1] == 0)
    return directional_derivative(view, "kl", "aggregated"), directional_derivative(view, "kl", "uniform"), view.mu_tail


ISOLATED_STEP = 1e-3
"""Parameter-space length of the isolated step (an Adam step of the study moves the parameters by about 0.1)."""


def isolated_changes(model, inputs, record, chosen, vocab_size, temperature=1.0, step=ISOLATED_STEP):
    """ΔD at each ``chosen`` token of a causal loss call when the parameters move by ``step`` along that token's own
    update direction only, ``sign(A)·∇_θ log π_θ(a) / ‖·‖``, from the policy before the optimizer step: the realised
    first-order effect the direction criteria predict, without the other tokens' gradients. In float64 on a copy of
    the model; returns ``(ΔD, D before)`` per chosen token (``D before`` checks the copy against the trainer's ``D``)."""
    import copy

    import torch

    from dllm_trl.losses.divergence_masks import divergence, truncated_view

    # A colocated vLLM engine initialises torch.distributed, after which accelerate wraps the policy of the next
    # trainer of the process in DistributedDataParallel (one process): differentiate the model itself.
    twin = copy.deepcopy(getattr(model, "module", model)).double()
    params = [p for p in twin.parameters() if p.requires_grad]
    completion_mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        completion_mask = completion_mask * inputs["tool_mask"]
    rows, columns = completion_mask.bool().nonzero(as_tuple=True)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    k = record["mu_ids"].shape[-1]

    def divergence_at(logps, i):
        support = torch.cat([record["mu_ids"][i].clamp(min=0), record["action"][i].view(1)])
        view = truncated_view(record["mu_ids"][i:i + 1], record["mu_logps"][i:i + 1].double(),
                              record["action"][i:i + 1], record["mu_action_logps"][i:i + 1].double(),
                              logps[support].unsqueeze(0), vocab_size=vocab_size, binary=k == 0)
        return divergence(view, "kl")[0]

    deltas, befores = [], []
    for i in chosen.tolist():
        b, position = rows[i], inputs["prompt_ids"].shape[1] + columns[i] - 1

        def logps_at():
            # The class's forward: accelerate leaves a forward bound to the original model on the instance, which a
            # deep copy keeps.
            logits = type(twin).forward(twin, input_ids=input_ids[b:b + 1], attention_mask=attention_mask[b:b + 1]).logits
            return (logits[0, position] / temperature).log_softmax(-1)

        logps = logps_at()
        grads = torch.autograd.grad(logps[record["action"][i]], params)
        scale = float(torch.sign(record["advantages"][i])) * step / torch.sqrt(sum(g.square().sum() for g in grads))
        with torch.no_grad():
            before = divergence_at(logps.detach(), i)
            for p, g in zip(params, grads):
                p.add_(g, alpha=float(scale))
            after = divergence_at(logps_at(), i)
            for p, g in zip(params, grads):
                p.sub_(g, alpha=float(scale))
        deltas.append(float(after - before))
        befores.append(float(before))
    return deltas, befores


class Rescorer:
    """Re-scores every loss call of a causal ``DPPOMaskTrainer`` with the policy after the optimizer step that used it.

    Wraps ``trainer.loss.compute`` to keep the inputs of each call, and, as a callback, runs the same computation
    without gradients at ``on_step_end`` (after ``optimizer.step()``), keeping the re-scored ``D``: ``after[i]`` and
    ``update[i]`` (the 0-based optimizer step) belong to ``trainer.loss.records[i]``. With ``isolated`` it also
    measures :func:`isolated_changes` before the step, on every out-of-region token (``A ≠ 0``) where a predictive
    sign differs from the ratio sign plus ``isolated`` random agreeing ones per call: ``isolated_delta[i]`` (NaN where
    not measured) and ``isolated_check`` (the largest gap between the float64 copy's D and the trainer's).
    """

    def __init__(self, trainer, isolated: int | None = None, seed: int = 0):
        import torch
        from transformers import TrainerCallback

        from dllm_trl.losses.divergence_masks import divergence_proximity

        self.trainer, self.loss = trainer, trainer.loss
        self.compute = trainer.loss.compute
        self.pending, self.after, self.update, self.step = [], {}, {}, 0
        self.isolated_delta, self.isolated_check = {}, 0.0
        generator = torch.Generator().manual_seed(seed)
        rescorer = self

        def measure(model, inputs, index):
            record, args = rescorer.loss.records[index], trainer.args
            g_agg, g_uni, _ = record_directions(record, rescorer.loss.vocab_size)
            outside = divergence_proximity(record["div"], record["advantages"], args.divergence_threshold,
                                           args.divergence_threshold_low, args.divergence_threshold_high)
            outside &= record["advantages"] != 0
            ratio = torch.sign(record["log_ratio"])
            differ = outside & ((torch.sign(g_agg) != ratio) | (torch.sign(g_uni) != ratio))
            agree = (outside & ~differ).nonzero().squeeze(1)
            sample = agree[torch.randperm(agree.numel(), generator=generator)[:isolated]]
            chosen = torch.cat([differ.nonzero().squeeze(1), sample]).sort().values
            delta = torch.full(record["div"].shape, float("nan"), dtype=torch.float64)
            if chosen.numel():
                deltas, befores = isolated_changes(model, inputs, record, chosen, rescorer.loss.vocab_size,
                                                   rescorer.loss.score_temperature)
                delta[chosen] = torch.tensor(deltas, dtype=torch.float64)
                gap = (torch.tensor(befores) - record["div"][chosen].double()).abs().max()
                rescorer.isolated_check = max(rescorer.isolated_check, float(gap))
            rescorer.isolated_delta[index] = delta

        def compute(model, inputs, **kwargs):
            training = rescorer.loss.records is not None and kwargs.get("training", True)
            if training:
                rescorer.pending.append((len(rescorer.loss.records), model, inputs, kwargs))
                rescorer.update[len(rescorer.loss.records)] = rescorer.step
            out = rescorer.compute(model, inputs, **kwargs)
            if training and isolated is not None:
                measure(model, inputs, len(rescorer.loss.records) - 1)
            return out

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                rescorer.rescore()

        trainer.loss.compute = compute
        trainer.add_callback(Callback())

    def rescore(self):
        import torch

        records = self.loss.records
        for index, model, inputs, kwargs in self.pending:
            self.loss.records = scratch = []
            try:
                with torch.no_grad():
                    self.compute(model, inputs, **kwargs)
            finally:
                self.loss.records = records
            self.after[index] = scratch[0]["div"]
        self.pending = []
        self.step += 1


def token_table(records, rescored, updates, vocab_size, isolated=None):
    """One tensor per quantity over every recorded token of a run: the trainer's records, both tail estimators of
    ``g`` rebuilt from the same truncated view, the re-scored ``D``, the update index of the token's step and, when
    given, the isolated ΔD (NaN where not measured)."""
    import torch

    columns = {name: [] for name in ("div", "div_after", "g_agg", "g_uni", "direction", "log_ratio", "advantages",
                                     "keep", "step", "mu_tail", "isolated_delta")}
    for i, (record, after, step) in enumerate(zip(records, rescored, updates)):
        g_agg, g_uni, mu_tail = record_directions(record, vocab_size)
        columns["g_agg"].append(g_agg)
        columns["g_uni"].append(g_uni)
        columns["mu_tail"].append(mu_tail)
        columns["div_after"].append(after)
        columns["step"].append(torch.full_like(record["div"], step, dtype=torch.long))
        columns["isolated_delta"].append(isolated[i] if isolated is not None
                                         else torch.full(record["div"].shape, float("nan"), dtype=torch.float64))
        for name in ("div", "direction", "log_ratio", "advantages", "keep"):
            columns[name].append(record[name])
    return {name: torch.cat(values) for name, values in columns.items()}


QUANTILES = (0.5, 0.9, 0.95, 0.99, 0.999)
DELTA_GRID = (0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.15, 0.2)


def divergence_profile(tokens, updates_per_rollout) -> dict:
    """The distribution of the mask's per-token ``D`` by update index within a rollout batch (0 = first update), and
    the ``δ`` whose region is as large as clip-higher's ratio window: the share of tokens with ``D > δ`` equals the share
    with ``r`` outside ``[0.8, 1.28]`` (same tokens, off-policy updates); ``off_policy_share_above``: the share of
    off-policy tokens with ``D > δ`` on a grid of δ (δ as a quantile of D is one minus it)."""
    import torch

    from dllm_trl.losses.divergence_masks import ppo_proximity

    div = tokens["div"].double()
    index = tokens["step"] % updates_per_rollout
    profile = {}
    for u in range(updates_per_rollout):
        d = div[index == u]
        if d.numel():
            q = torch.quantile(d, torch.tensor(QUANTILES, dtype=d.dtype)).tolist()
            profile[str(u)] = dict(tokens=d.numel(), mean=float(d.mean()), max=float(d.max()),
                                   **{f"q{100 * p:g}": v for p, v in zip(QUANTILES, q)})
    off = index != 0
    d = div[off]
    outside_clip = ppo_proximity(tokens["log_ratio"][off], 0.2, 0.28)
    share = float(outside_clip.double().mean()) if d.numel() else None
    matched = float(torch.quantile(d, 1.0 - share)) if d.numel() and share else None
    above = {f"{delta:g}": float((d > delta).double().mean()) for delta in DELTA_GRID} if d.numel() else {}
    return dict(by_update=profile, clip_outside_share=share, clip_matched_delta=matched, off_policy_share_above=above,
                mu_tail_mean=float(tokens["mu_tail"].double().mean()))

# ----------------------------------------------------------------------------------- rollout mismatch (issue 24)
def fake_quantise(weight, kind: str):
    """``weight`` rounded to a low-precision grid with one per-tensor scale (absmax → the format's largest value) and
    scaled back: ``fp8_e4m3`` / ``fp8_e5m2`` (torch's float8 casts, round to nearest) or symmetric ``int8``."""
    import torch

    if kind == "int8":
        scale = weight.abs().max().clamp(min=1e-12) / 127.0
        return (weight / scale).round().clamp(-127, 127) * scale
    dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kind]
    scale = weight.abs().max().clamp(min=1e-12) / torch.finfo(dtype).max
    return (weight / scale).to(dtype).to(weight.dtype) * scale


@contextlib.contextmanager
def quantised_rollout_weights(model, kind: str):
    """Within the context the weights of every ``nn.Linear`` but the LM head are fake-quantised (as an FP8 rollout
    engine serves them); the full-precision weights come back on exit. Yields how many tensors it rounded."""
    import torch

    saved = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.split(".")[-1] != "lm_head":
                saved.append((module.weight, module.weight.detach().clone()))
                module.weight.copy_(fake_quantise(module.weight, kind))
    try:
        yield len(saved)
    finally:
        with torch.no_grad():
            for weight, original in saved:
                weight.copy_(original)


def install_rollout_quantisation(trainer, kind: str) -> None:
    """Generate every rollout of a causal trainer (TRL's or ``DPPOMaskTrainer``) with fake-quantised weights. The
    behaviour capture then records the quantised model's distribution, so ``μ ≠ π_old``; the old-policy pass, the
    loss and the evaluation run in full precision."""
    generate = trainer._generate_single_turn

    def quantised(*args, **kwargs):
        with quantised_rollout_weights(trainer.model, kind) as rounded:
            if not rounded:
                raise RuntimeError("no nn.Linear weights to quantise in the rollout model")
            return generate(*args, **kwargs)

    trainer._generate_single_turn = quantised

# ------------------------------------------------------------------------------------ vLLM rollouts (issue 33)
ENGINE_KV_CACHE_BYTES = 1 << 26
"""64 MiB of KV cache: the toy's rollouts need far less, and vLLM's CPU worker would otherwise reserve a share of
RAM."""


def engine_kwargs(dtype: str) -> dict:
    """``vllm.LLM`` arguments of the study's colocated engine: ``dtype``, eager (no inductor compile on 2 cores), a
    small KV cache, and ``max_logprobs`` fixed so that every method's engine has the same arguments (one engine is
    shared by all runs of a process, :func:`shared_engines`)."""
    if dtype not in ENGINE_DTYPES:
        raise ValueError(f"engine dtype {dtype!r}: one of {ENGINE_DTYPES}")
    return {"dtype": dtype, "enforce_eager": True, "kv_cache_memory_bytes": ENGINE_KV_CACHE_BYTES, "max_logprobs": 20}


_ENGINES: dict = {}


@contextlib.contextmanager
def shared_engines():
    """Within the context TRL's colocate backend gets one ``vllm.LLM`` per set of arguments, built on first use and
    reused by every later trainer in this process (an engine start is 3–9 s on 2 cores, a run 20 s). Reuse is exact:
    each run pushes all its weights into the engine before its first rollout (``sync_weights`` at step 0, which also
    resets the prefix cache), and the engine samples from the process's torch RNG, which the trainer seeds."""
    from trl.generation import vllm_generation

    from dllm_trl.generation.vllm_rollouts import replaced_attribute

    build = vllm_generation.LLM

    def engine(*llm_args, **llm_kwargs):
        key = repr((llm_args, sorted(llm_kwargs.items())))
        if key not in _ENGINES:
            _ENGINES[key] = build(*llm_args, **llm_kwargs)
        return _ENGINES[key]

    with replaced_attribute(vllm_generation, "LLM", engine):
        yield


def vllm_trainer(kind, model, output_dir, settings, data, args):
    """A causal trainer rolling out with a colocated vLLM engine in ``args.engine_dtype``: the divergence masks through
    ``CausalDPPOMaskTrainer(use_vllm=True)`` (μ = the engine's top-K), the clipped surrogates through TRL's
    ``GRPOTrainer(use_vllm=True)`` with the same engine backend (weights synced without CUDA) and TRL's importance
    sampling correction off, so that, as in the FP8 study, their ratio is to π_old and they see the mismatch only
    through the data it produced. ``--engine-temperature`` sets the engine's sampling temperature afterwards."""
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import grpo_trainer

    from dllm_trl.generation.vllm_rollouts import engine_rollouts_class, replaced_attribute
    from dllm_trl.trainers import CausalDPPOMaskConfig, CausalDPPOMaskTrainer

    engine = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.05)
    if kind == "clip":
        config = GRPOConfig(output_dir=output_dir, **settings, **engine, vllm_importance_sampling_correction=False)
        rollouts = engine_rollouts_class()

        def build(*build_args, **build_kwargs):
            return rollouts(*build_args, behaviour_top_k=0, engine_kwargs=engine_kwargs(args.engine_dtype),
                            **build_kwargs)

        with replaced_attribute(grpo_trainer, "VLLMGeneration", build):
            trainer = GRPOTrainer(model=model, args=config, **data)
    else:
        settings = {k: v for k, v in settings.items() if k != "model_kind"}  # the causal config has one kind
        config = CausalDPPOMaskConfig(output_dir=output_dir, **settings, **engine,
                                      vllm_engine_kwargs=engine_kwargs(args.engine_dtype))
        trainer = CausalDPPOMaskTrainer(model=model, args=config, **data)
    if args.engine_temperature is not None:
        trainer.vllm_generation.temperature = args.engine_temperature
    return trainer


def rollout_mismatch(old_logps, sampling_logps, mask) -> dict:
    """The rollout–training mismatch of one rollout batch on the sampled tokens (``mask``): ``|log π_old(a) − log
    μ(a)|`` mean / 99th percentile / max and the k3 estimate of KL(μ‖π_old), ``mean(r − 1 − log r)`` with
    ``r = π_old(a)/μ(a)`` (the ``sampling/*`` metrics, computed for every method alike)."""
    import torch

    m = mask.bool()
    log_ratio = (old_logps.double() - sampling_logps.double())[m]
    if not log_ratio.numel():
        raise ValueError("rollout_mismatch: no sampled tokens under the mask")
    gap = log_ratio.abs()
    return dict(tokens=int(gap.numel()), abs_logp_mean=float(gap.mean()),
                abs_logp_q99=float(torch.quantile(gap, 0.99)), abs_logp_max=float(gap.max()),
                kl_k3_mean=float((log_ratio.exp() - 1 - log_ratio).mean()))


def record_rollout_mismatch(trainer) -> list:
    """Appends :func:`rollout_mismatch` of every rollout batch the trainer generates to the returned list (from TRL's
    ``old_per_token_logps``, the trainer's forward, and ``sampling_per_token_logps``, the engine's log μ(a))."""
    rows = []
    generate = trainer._generate_and_score_completions

    def recorded(inputs):
        output = generate(inputs)
        old = output.get("old_per_token_logps")
        if old is None or output.get("sampling_per_token_logps") is None:
            raise RuntimeError("the batch lacks old_per_token_logps or sampling_per_token_logps: the rollout mismatch "
                               "needs num_iterations > 1 and a vLLM rollout")
        rows.append(rollout_mismatch(old, output["sampling_per_token_logps"], output["completion_mask"]))
        return output

    trainer._generate_and_score_completions = recorded
    return rows


def parse_source(text: str) -> dict:
    """A rollout source of ``--analysis mismatch``: ``transformers`` or ``transformers:QUANT`` (fake-quantised
    weights, ``--rollout-quant``), ``vllm:DTYPE`` or ``vllm:DTYPE:T=TEMPERATURE`` (the engine samples at that
    temperature, the trainer scores at 1)."""
    parts = text.split(":")
    if parts[0] == "transformers" and len(parts) <= 2:
        quant = parts[1] if len(parts) == 2 else "none"
        if quant not in ROLLOUT_QUANT:
            raise ValueError(f"source {text!r}: quantisation {quant!r} is not one of {ROLLOUT_QUANT}")
        return dict(engine="transformers", quant=quant, dtype="float32", temperature=None)
    if parts[0] == "vllm" and len(parts) in (2, 3):
        if parts[1] not in ENGINE_DTYPES:
            raise ValueError(f"source {text!r}: engine dtype {parts[1]!r} is not one of {ENGINE_DTYPES}")
        temperature = None
        if len(parts) == 3:
            if not parts[2].startswith("T="):
                raise ValueError(f"source {text!r}: the third field is the engine temperature, written T=0.8")
            temperature = float(parts[2][2:])
            if not temperature > 0:
                raise ValueError(f"source {text!r}: the engine temperature must be > 0")
        return dict(engine="vllm", quant="none", dtype=parts[1], temperature=temperature)
    raise ValueError(f"source {text!r}: write transformers[:QUANT] or vllm:DTYPE[:T=TEMPERATURE]")


MISMATCH_DELTAS = (0.02, 0.05, 0.15)


def mismatch_stats(tokens: dict, deltas=MISMATCH_DELTAS) -> dict:
    """What the step-0 rollout mismatch does to each trust region, over the sampled tokens of one source.

    ``tokens``: flat tensors ``mu_logp`` (log μ(a)), ``pi_logp`` (log π(a), the float32 trainer), ``div`` (top-K
    KL(μ‖π)), ``g_agg`` / ``g_uni`` (the predictive directions) and ``advantages``. At step 0 π_θ = π_old, so a
    token is dropped only because of the mismatch: by DPPO top-K KL where ``D > δ`` and ``A·(r − 1) > 0``, by the
    predictive masks where ``D > δ`` and ``A·g > 0``, by a clip-higher ratio test against μ (ε 0.2 / 0.28) where ``r``
    leaves ``[0.8, 1.28]`` and ``A·(r − 1) > 0``. TRL's clipped surrogates take r to π_old (= 1 at step 0) and drop
    nothing. Returns shares of tokens (``dropped_*`` in [0, 1]) and the gap's and D's mean / q99 / max."""
    import torch

    from dllm_trl.losses.divergence_masks import dppo_mask, ppo_mask, predictive_mask

    log_ratio = tokens["pi_logp"].double() - tokens["mu_logp"].double()
    gap, div, a = log_ratio.abs(), tokens["div"].double(), tokens["advantages"].double()
    n = gap.numel()
    if not n:
        raise ValueError("mismatch_stats: no tokens")
    out = dict(tokens=n, abs_logp_mean=float(gap.mean()), abs_logp_q99=float(torch.quantile(gap, 0.99)),
               abs_logp_max=float(gap.max()), div_mean=float(div.mean()), div_q99=float(torch.quantile(div, 0.99)),
               div_max=float(div.max()),
               ratio_outside_clip_higher=float(((log_ratio.exp() < 0.8) | (log_ratio.exp() > 1.28)).double().mean()),
               dropped_clip_higher_vs_mu=float((~ppo_mask(log_ratio, a, 0.2, 0.28)).double().mean()))
    for delta in deltas:
        out[f"outside_{delta:g}"] = float((div > delta).double().mean())
        out[f"dropped_dppo_{delta:g}"] = float((~dppo_mask(div, log_ratio, a, delta)).double().mean())
        for tail in ("agg", "uni"):
            dropped = ~predictive_mask(div, tokens[f"g_{tail}"].double(), a, delta)
            out[f"dropped_predictive_{tail}_{delta:g}"] = float(dropped.double().mean())
    return out


def source_tokens(source: dict, args, prompts_n: int, generations: int, seed: int = 0) -> tuple[dict, float]:
    """Roll out the start checkpoint from ``source`` on the first ``prompts_n`` test puzzles × ``generations`` (a
    ``DPPOMaskTrainer`` with K = ``--top-k``, so μ is recorded as the masks read it), re-score every completion with
    the float32 model at temperature 1, and return the per-token tensors of :func:`mismatch_stats` with the rollout's
    wall seconds. Advantages: reward minus the group mean (``sudoku_cell_reward``; the masks read only their sign)."""
    import copy

    import torch

    from dllm_trl.evaluation.tasks import score_completions
    from dllm_trl.losses.divergence_masks import directional_derivative, divergence, truncated_view
    from dllm_trl.toy import sudoku_cell_reward, sudoku_dataset

    run_args = copy.copy(args)
    run_args.rollout_engine, run_args.engine_dtype = source["engine"], source["dtype"]
    run_args.engine_temperature, run_args.rollout_quant = source["temperature"], source["quant"]
    held_out = sudoku_dataset("test", size=prompts_n)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer, tokenizer = make_trainer("causal", "dppo_topk_kl", seed, run_args, output_dir)
        if source["quant"] != "none":
            install_rollout_quantisation(trainer, source["quant"])
        prompt_ids = [tokenizer(text)["input_ids"] for text in held_out["prompt"] for _ in range(generations)]
        torch.manual_seed(seed)
        start = time.perf_counter()
        trainer.model.eval()
        completion_ids, _ = trainer._generate_single_turn(prompt_ids, None, {}, generations)
        seconds = time.perf_counter() - start
        behaviour = trainer._behaviour
    model, vocab_size = trainer.model, trainer.loss.vocab_size
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    rewards = torch.tensor(score_completions(sudoku_cell_reward, texts, held_out, num_samples=generations))
    advantages = rewards - rewards.view(-1, generations).mean(1).repeat_interleave(generations)
    columns = {name: [] for name in ("mu_logp", "pi_logp", "div", "g_agg", "g_uni", "advantages")}
    with torch.no_grad():
        for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
            n = len(completion)
            if not n:
                continue
            logits = model(torch.tensor([prompt + list(completion)])).logits[0, len(prompt) - 1:-1].float()
            logps = logits.log_softmax(-1)
            mu_ids = behaviour["behaviour_topk_ids"][row, :n].cpu()
            action = torch.tensor(list(completion))
            support = torch.cat([mu_ids.clamp(min=0), action[:, None]], dim=1)
            view = truncated_view(mu_ids, behaviour["behaviour_topk_logps"][row, :n].cpu(), action,
                                  behaviour["behaviour_logps"][row, :n].cpu(), logps.gather(1, support),
                                  vocab_size=vocab_size, binary=mu_ids.shape[-1] == 0)
            columns["mu_logp"].append(behaviour["behaviour_logps"][row, :n].cpu())
            columns["pi_logp"].append(logps.gather(1, action[:, None])[:, 0])
            columns["div"].append(divergence(view, "kl"))
            columns["g_agg"].append(directional_derivative(view, "kl", "aggregated"))
            columns["g_uni"].append(directional_derivative(view, "kl", "uniform"))
            columns["advantages"].append(advantages[row].expand(n))
    return {name: torch.cat(values) for name, values in columns.items()}, seconds


MISMATCH_COLUMNS = (
    ("tokens", "tokens", "{:.0f}"),
    ("abs_logp_mean", "mean \\|log μ(a) − log π(a)\\|", "{:.2g}"),
    ("abs_logp_q99", "q99", "{:.2g}"),
    ("abs_logp_max", "max", "{:.2g}"),
    ("div_mean", "mean D", "{:.2g}"),
    ("div_q99", "q99 D", "{:.2g}"),
    ("div_max", "max D", "{:.2g}"),
)


def mismatch_markdown(rows: list[dict], deltas=MISMATCH_DELTAS) -> str:
    """The step-0 mismatch table: one row per source (``rows``: ``source``, ``seconds`` and :func:`mismatch_stats`'s
    fields), then the share of tokens each trust region drops at each δ."""
    def pct(value):
        return f"{100 * value:.2f}%"

    head = [label for _, label, _ in MISMATCH_COLUMNS]
    lines = ["| rollout source | " + " | ".join(head) + " | r outside [0.8, 1.28] | rollout s |",
             "|---|" + "---|" * (len(head) + 2)]
    for row in rows:
        cells = [fmt.format(row[key]) for key, _, fmt in MISMATCH_COLUMNS]
        lines.append(f"| {row['source']} | " + " | ".join(cells)
                     + f" | {pct(row['ratio_outside_clip_higher'])} | {row['seconds']:.1f} |")
    lines += ["", "Share of the sampled tokens dropped at step 0 (π_θ = π_old: by the mismatch alone); TRL's clipped "
              "surrogates (ratio to π_old) drop none:", "",
              "| rollout source | clip-higher ratio test against μ | "
              + " | ".join(f"D > {d:g} | DPPO δ {d:g} | predictive agg. δ {d:g} | predictive uni. δ {d:g}"
                           for d in deltas)
              + " |", "|---|---|" + "---|" * (4 * len(deltas))]
    for row in rows:
        cells = [pct(row["dropped_clip_higher_vs_mu"])]
        for d in deltas:
            cells += [pct(row[f"outside_{d:g}"]), pct(row[f"dropped_dppo_{d:g}"]),
                      pct(row[f"dropped_predictive_agg_{d:g}"]), pct(row[f"dropped_predictive_uni_{d:g}"])]
        lines.append(f"| {row['source']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def mismatch_report(args) -> list[dict]:
    """``--analysis mismatch``: :func:`source_tokens` and :func:`mismatch_stats` per source into ``{name}.json`` and
    ``{name}_table.md``."""
    sources = [(text, parse_source(text)) for text in args.sources]
    rows = []
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with shared_engines():
        for text, source in sources:
            tokens, seconds = source_tokens(source, args, args.eval_size, args.num_generations)
            rows.append(dict(source=text, seconds=seconds, **mismatch_stats(tokens)))
            print(f"{text}: {rows[-1]}", flush=True)
    setup = dict(prompts=args.eval_size, generations=args.num_generations, top_k=args.top_k, split="test",
                 trainer="float32, temperature 1")
    (out / f"{args.name}.json").write_text(json.dumps(dict(setup=setup, rows=rows), indent=1) + "\n")
    table = mismatch_markdown(rows)
    (out / f"{args.name}_table.md").write_text(table)
    print(table)
    return rows


# ------------------------------------------------------------------------------------------------------- runs
def load_model(model_kind):
    from dllm_trl.toy import load_sudoku, load_sudoku_causal, load_sudoku_diffusion_gemma

    return {"causal": load_sudoku_causal, "diffusion_gemma": load_sudoku_diffusion_gemma}.get(model_kind, load_sudoku)()


def solve_rate(model_kind, model, tokenizer, eval_size, sampler_seeds=(0, 1, 2)) -> float:
    """The greedy solve rate of the first ``eval_size`` test puzzles; DiffusionGemma (random decoding): the mean solve
    rate over ``sampler_seeds`` of its toy sampler."""
    from dllm_trl.toy import (
        SUDOKU_GEN_LENGTH,
        evaluate_accuracy,
        evaluate_causal_accuracy,
        evaluate_diffusion_gemma_accuracy,
        sudoku_dataset,
        sudoku_generation_config,
        sudoku_reward,
    )

    held_out = sudoku_dataset("test", size=eval_size)
    if model_kind == "diffusion_gemma":
        result = evaluate_diffusion_gemma_accuracy(model, tokenizer, held_out, batch_size=eval_size,
                                                   reward=sudoku_reward, seeds=sampler_seeds)
    elif model_kind == "causal":
        result = evaluate_causal_accuracy(model, tokenizer, held_out, max_new_tokens=SUDOKU_GEN_LENGTH,
                                          batch_size=eval_size, reward=sudoku_reward)
    else:
        result = evaluate_accuracy(model, tokenizer, held_out, sudoku_generation_config(), batch_size=eval_size,
                                   reward=sudoku_reward)
    return result["accuracy"]


def sampled_solve_rate(model_kind, model, tokenizer, eval_size, samples, seed=1234) -> float:
    """avg@N: ``samples`` temperature-1 completions per held-out puzzle (no top-k / top-p; the diffusion toy with its
    Sudoku sampler at temperature 1), the share solved over all of them; the sampling RNG is forked and seeded."""
    import torch

    from dllm_trl.evaluation.tasks import score_completions
    from dllm_trl.generation import decode_prompts
    from dllm_trl.toy import SUDOKU_GEN_LENGTH, sudoku_dataset, sudoku_generation_config, sudoku_reward

    held_out = sudoku_dataset("test", size=eval_size)
    prompts = [prompt for prompt in held_out["prompt"] for _ in range(samples)]

    def generate(input_ids, attention_mask):
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=SUDOKU_GEN_LENGTH,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        new = out[:, input_ids.shape[1]:]
        is_eos = (new == tokenizer.eos_token_id).long()
        return new, (is_eos.cumsum(1) - is_eos) == 0, new.shape[1]

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if model_kind == "causal":
            decoded = decode_prompts(model, tokenizer, prompts, batch_size=len(prompts), generate=generate)
        else:
            decoded = decode_prompts(model, tokenizer, prompts, sudoku_generation_config(temperature=1.0),
                                     batch_size=len(prompts))
    rewards = score_completions(sudoku_reward, decoded.completions, held_out, num_samples=samples)
    return sum(r >= 1.0 for r in rewards) / max(len(rewards), 1)


def make_trainer(model_kind, method, seed, args, output_dir):
    """The trainer of one run; every method shares the settings below and differs only in its loss."""
    from trl import GRPOConfig, GRPOTrainer

    from dllm_trl.toy import SUDOKU_GEN_LENGTH, sudoku_cell_reward, sudoku_dataset, sudoku_rldf_config
    from dllm_trl.trainers import DPPOMaskConfig, DPPOMaskTrainer, RLDFTrainer

    settings = dict(METHODS[method])
    kind = settings.pop("kind")
    if kind == "mask":
        settings.update(divergence_threshold=args.delta, divergence_top_k=args.top_k, model_kind=model_kind)
    batch = args.num_generations * args.prompts_per_step
    if batch % args.minibatches:
        raise ValueError(f"--minibatches {args.minibatches} does not divide the rollout batch of {batch}")
    minibatch = dict(steps_per_generation=args.minibatches) if args.minibatches > 1 else {}
    if minibatch and model_kind != "causal":
        raise ValueError("--minibatches applies to the causal toy")
    common = dict(
        temperature=1.0, num_generations=args.num_generations,
        per_device_train_batch_size=batch // args.minibatches, **minibatch,
        max_completion_length=SUDOKU_GEN_LENGTH,
        beta=0.0, learning_rate=args.learning_rate, lr_scheduler_type="constant", max_steps=args.steps,
        num_iterations=args.num_iterations, seed=seed, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, gradient_checkpointing=False, dataloader_pin_memory=False, disable_tqdm=True,
    )
    model, tokenizer = load_model(model_kind)
    data = dict(reward_funcs=sudoku_cell_reward, train_dataset=sudoku_dataset("train"), processing_class=tokenizer)
    if model_kind == "diffusion_gemma":
        return diffusion_gemma_trainer(kind, model, output_dir, {**common, **settings}, data), tokenizer
    if model_kind == "causal" and args.rollout_engine == "vllm":
        return vllm_trainer(kind, model, output_dir, {**common, **settings}, data, args), tokenizer
    if model_kind == "causal" and kind == "clip":
        config = GRPOConfig(output_dir=output_dir, **common, **settings)
        return GRPOTrainer(model=model, args=config, **data), tokenizer
    if model_kind == "causal":
        config = DPPOMaskConfig(output_dir=output_dir, **common, **settings)
        return DPPOMaskTrainer(model=model, args=config, **data), tokenizer
    if kind == "clip":
        return RLDFTrainer(model=model, args=sudoku_rldf_config(output_dir, **common, **settings,
                                                                cache_mode=args.cache_mode), **data), tokenizer
    config = sudoku_rldf_config(output_dir, config_class=DPPOMaskConfig, **common, **settings,
                                cache_mode=args.cache_mode)
    return DPPOMaskTrainer(model=model, args=config, **data), tokenizer


def diffusion_gemma_trainer(kind, model, output_dir, settings, data):
    """The DiffusionGemma toy's trainer of one method: its sampler with ``DiffusionGemmaRLDFLoss`` (the clipped
    surrogates: PPO terms at ``num_iterations > 1``) or ``DiffusionGemmaTrustRegionLoss`` (the divergence masks)."""
    from dllm_trl.generation import DiffusionGemmaSampler
    from dllm_trl.losses import DiffusionGemmaRLDFLoss, DiffusionGemmaTrustRegionLoss
    from dllm_trl.toy import sudoku_diffusion_gemma_sampler_config
    from dllm_trl.toy.configs import sudoku_diffusion_gemma_rldf_config
    from dllm_trl.trainers import DiffusionDPPOMaskTrainer, DPPOMaskConfig, RLDFTrainer

    sampler = DiffusionGemmaSampler(sudoku_diffusion_gemma_sampler_config())
    if kind == "clip":
        config = sudoku_diffusion_gemma_rldf_config(output_dir, **settings)
        return RLDFTrainer(model=model, args=config, sampler=sampler, loss=DiffusionGemmaRLDFLoss(config), **data)
    settings["model_kind"] = "diffusion"  # the DPPOMaskConfig kind: not causal
    config = sudoku_diffusion_gemma_rldf_config(output_dir, config_class=DPPOMaskConfig, **settings)
    loss = DiffusionGemmaTrustRegionLoss(config, model.config.get_text_config().vocab_size)
    return DiffusionDPPOMaskTrainer(model=model, args=config, sampler=sampler, loss=loss, **data)


def run_one(model_kind, method, seed, args) -> dict:
    import torch
    from transformers.trainer_callback import PrinterCallback

    torch.set_num_threads(args.threads)
    if model_kind != "causal" and args.rollout_quant != "none":
        raise ValueError("--rollout-quant applies to the causal toy (the diffusion rollout has its own cache mismatch)")
    updates_per_rollout = args.num_iterations * args.minibatches
    vllm = args.rollout_engine == "vllm"
    with tempfile.TemporaryDirectory() as output_dir, shared_engines() if vllm else contextlib.nullcontext():
        trainer, tokenizer = make_trainer(model_kind, method, seed, args, output_dir)
        engine_mismatch = record_rollout_mismatch(trainer) if vllm else None
        trainer.remove_callback(PrinterCallback)  # disable_tqdm swaps the progress bar for a log printer
        masks = METHODS[method]["kind"] == "mask"
        if args.rollout_quant != "none":
            install_rollout_quantisation(trainer, args.rollout_quant)
        rescorer = None
        if masks:
            trainer.loss.records = []  # the trainer keeps the per-token mask tensors of every loss call here
            if model_kind == "causal":
                rescorer = Rescorer(trainer, isolated=None if args.isolated_sample < 0 else args.isolated_sample,
                                    seed=seed)
        if vllm:
            # The engine samples from this process's torch RNG, and building an engine reseeds it with vLLM's own seed
            # (0): only the first run of a process builds one (shared_engines), so every run reseeds here, after it.
            from transformers import set_seed

            set_seed(seed)
        start = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - start
    start = time.perf_counter()
    after = solve_rate(model_kind, trainer.model, tokenizer, args.eval_size, args.sampler_seeds)
    sampled = (sampled_solve_rate(model_kind, trainer.model, tokenizer, args.eval_size, args.eval_samples)
               if args.eval_samples and model_kind != "diffusion_gemma" else None)
    eval_seconds = time.perf_counter() - start
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]  # one per optimizer step
    masked_key = "dppo/masked_frac" if masks else "clip_ratio/region_mean"
    masked = [entry.get(masked_key) for entry in logs]
    # Optimizer step i (0-based) is update (i mod updates_per_rollout) of its rollout batch: 0 is on-policy (up to
    # the rollout mismatch).
    off_policy = [m for i, m in enumerate(masked) if i % updates_per_rollout and m is not None]
    result = dict(
        model=model_kind, method=method, seed=seed, steps=len(logs),
        solve_rate=after, sampled_solve_rate=sampled,
        rewards=[entry["reward"] for entry in logs if "reward" in entry],  # one per rollout batch
        rollout_steps=[i for i, entry in enumerate(logs) if "reward" in entry],
        masked_frac_per_step=masked,
        masked_frac=statistics.fmean(logged) if (logged := [m for m in masked if m is not None]) else None,
        masked_frac_off_policy=statistics.fmean(off_policy) if off_policy else None,
        train_seconds=train_seconds, eval_seconds=eval_seconds,
    )
    if vllm:
        result["rollout_mismatch"] = engine_mismatch  # one per rollout batch, every method
        # The trainer's own sampling/* metrics per optimizer step (CausalDPPOMaskTrainer logs them with use_vllm;
        # TRL's GRPOTrainer only with its importance sampling correction, off here).
        result["sampling_per_step"] = {key: [entry.get(key) for entry in logs]
                                       for key in sorted({k for e in logs for k in e if k.startswith("sampling/")})}
    if masks:
        records = trainer.loss.records
        result.update(record_metrics(records, trainer.args))
        result["mu_from_rollout"] = statistics.fmean(e["dppo/mu_from_rollout"] for e in logs
                                                     if "dppo/mu_from_rollout" in e)
    if rescorer is not None:
        if sorted(rescorer.after) != list(range(len(records))):
            raise RuntimeError("the re-scoring missed loss calls: the trainer's step structure is not the expected one")
        tokens = token_table(records, [rescorer.after[i] for i in range(len(records))],
                             [rescorer.update[i] for i in range(len(records))], trainer.loss.vocab_size,
                             [rescorer.isolated_delta[i] for i in range(len(records))] if rescorer.isolated_delta
                             else None)
        own = tokens["g_agg" if trainer.args.tail_estimator == "aggregated" else "g_uni"]
        result["direction_rebuild_error"] = float((own - tokens["direction"]).abs().max())
        thresholds = dict(delta=trainer.args.divergence_threshold, delta_low=trainer.args.divergence_threshold_low,
                          delta_high=trainer.args.divergence_threshold_high)
        quantities = [tokens[name] for name in ("div", "div_after", "g_agg", "g_uni", "log_ratio", "advantages")]
        off = tokens["step"] % updates_per_rollout != 0
        result["direction_agreement"] = dict(
            all=direction_agreement(*quantities, **thresholds),
            kept=direction_agreement(*quantities, **thresholds, subset=tokens["keep"]),
            off_policy=direction_agreement(*quantities, **thresholds, subset=off),
        )
        if rescorer.isolated_delta:
            measured = ~tokens["isolated_delta"].isnan()
            isolated = [tokens["div"], tokens["div"].double() + tokens["isolated_delta"], *quantities[2:]]
            result["direction_agreement"]["isolated"] = direction_agreement(*isolated, **thresholds, subset=measured)
            result["isolated_check"] = rescorer.isolated_check
        result["divergence_profile"] = divergence_profile(tokens, updates_per_rollout)
    return result


# ---------------------------------------------------------------------------------------------------- report
def _mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _fmt(mean_std, digits=3, percent=False, signed=False):
    mean, std = mean_std
    if mean is None:
        return "—"
    if percent:
        return f"{100 * mean:.{digits}f}% ± {100 * std:.{digits}f}%"
    return f"{mean:{'+' if signed else ''}.{digits}f} ± {std:.{digits}f}"


def trailing_rewards(rewards, window=3):
    return [statistics.fmean(rewards[max(0, j - window + 1): j + 1]) for j in range(len(rewards))]


def collapsed(run, fraction) -> bool:
    """Collapse on the training reward: the trailing mean of the last 3 rollout rewards ends below ``fraction`` × the
    first rollout's reward (the first rollout is on the starting checkpoint, shared by every method at a seed). A run
    whose trailing mean dips below the line but recovers by the end does not count."""
    return trailing_rewards(run["rewards"])[-1] < fraction * run["rewards"][0]


def pooled_agreement(runs, part="all") -> dict | None:
    """Direction-agreement counts summed over runs (``part``: ``all``, ``kept`` or ``off_policy`` tokens)."""
    parts = [r["direction_agreement"][part] for r in runs if part in r.get("direction_agreement", {})]
    if not parts:
        return None
    return {key: sum(p[key] for p in parts) for key in parts[0]}


def _rate(k, n):
    """``k/n (p%, 95% Wilson [lo, hi])``."""
    interval = wilson_interval(k, n)
    if interval is None:
        return f"0/0"
    return f"{k}/{n} = {100 * k / n:.1f}% [{100 * interval[0]:.1f}, {100 * interval[1]:.1f}]"


def summarise(runs, baseline, fraction=0.5):
    pooled_out = sum(r.get("outside_tokens", 0) for r in runs)
    pooled_dis = sum(r.get("direction_disagree_tokens", 0) for r in runs)
    masks = any("outside_tokens" in r for r in runs)
    return dict(
        seeds=[r["seed"] for r in runs],
        solve_rate=_mean_std([r["solve_rate"] for r in runs]),
        sampled=_mean_std([r.get("sampled_solve_rate") for r in runs]),
        per_seed=[r["solve_rate"] for r in runs],
        per_seed_sampled=[r.get("sampled_solve_rate") for r in runs],
        collapses=sum(collapsed(r, fraction) for r in runs),
        masked=_mean_std([r["masked_frac"] for r in runs]),
        masked_off=_mean_std([r["masked_frac_off_policy"] for r in runs]),
        outside=_mean_std([r.get("outside_frac") for r in runs]),
        disagree=_mean_std([r.get("disagree_frac_of_outside") for r in runs]),
        disagree_pooled=(pooled_dis / pooled_out if pooled_out else None) if masks else None,
        pooled_counts=(pooled_dis, pooled_out) if masks else None,
        reward_first=_mean_std([r["rewards"][0] for r in runs]),
        reward_tail=_mean_std([statistics.fmean(r["rewards"][-max(1, len(r["rewards"]) // 4):]) for r in runs]),
        seconds=_mean_std([r["train_seconds"] + r["eval_seconds"] for r in runs]),
    )


T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086)
"""Two-sided 95% quantiles of Student's t for 1–20 degrees of freedom (1.96 beyond)."""


def _paired(rows, runs, reference, key):
    """Paired per-seed differences to ``reference``: mean ± std [95% t-interval of the mean]."""
    if not rows or rows[0]["method"] == reference:
        return "—"
    ref = {r["seed"]: r.get(key) for r in runs if r["method"] == reference}
    deltas = [r[key] - ref[r["seed"]] for r in rows if ref.get(r["seed"]) is not None and r.get(key) is not None]
    if not deltas:
        return "—"
    mean, std = _mean_std(deltas)
    if len(deltas) < 2:
        return _fmt((mean, std), signed=True)
    half = (T_975[len(deltas) - 2] if len(deltas) - 1 <= len(T_975) else 1.96) * std / len(deltas) ** 0.5
    return f"{_fmt((mean, std), signed=True)} [{mean - half:+.3f}, {mean + half:+.3f}]"


HEADER = (
    "| method | seeds | greedy solve rate | avg@{n} | per seed (greedy / avg@{n}) | Δ avg@{n} vs DPPO (paired) "
    "| Δ avg@{n} vs clip-higher (paired) | Δ greedy vs DPPO (paired) | collapses (training reward) "
    "| reward, first rollout | reward, last quarter | masked tokens (off-policy steps) | tokens with D > δ "
    "| s / run |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)
DIRECTION_HEADER = (
    "| method | tokens | realised ΔD > 0 | ratio sign right | predictive (agg.) right | predictive (uni.) right "
    "| agg. ≠ ratio | agg. right where they differ | ΔD > 0 where agg. differs | uni. ≠ ratio "
    "| uni. right where they differ | ΔD > 0 where uni. differs |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def engine_mismatch_lines(runs) -> list[str]:
    """The rollout–training mismatch of vLLM runs by method (:func:`rollout_mismatch` of each rollout batch): the
    mean over runs of each run's mean over its rollouts, and the largest over all; none without ``rollout_mismatch``."""
    if not any(r.get("rollout_mismatch") for r in runs):
        return []
    lines = ["Rollout–training mismatch on the sampled tokens (|log π_old(a) − log μ(a)|, π_old the float32 trainer, "
             "μ the engine; every rollout batch of every run; mean over runs ± std of each run's mean over its "
             "rollouts):",
             "", "| method | rollouts | first rollout, mean | all rollouts, mean | q99 (mean over rollouts) | max "
             "| k3 KL(μ‖π_old), mean |", "|---|---|---|---|---|---|---|"]
    for method in METHODS:
        rows = [r["rollout_mismatch"] for r in runs if r["method"] == method and r.get("rollout_mismatch")]
        if not rows:
            continue
        per_run = lambda key: [statistics.fmean(b[key] for b in batches) for batches in rows]
        first = _mean_std([batches[0]["abs_logp_mean"] for batches in rows])
        lines.append(f"| {LABELS[method]} | {sum(len(b) for b in rows)} | {_fmt(first, 4)} | "
                     f"{_fmt(_mean_std(per_run('abs_logp_mean')), 4)} | "
                     f"{_fmt(_mean_std(per_run('abs_logp_q99')), 3)} | "
                     f"{max(b['abs_logp_max'] for batches in rows for b in batches):.3f} | "
                     f"{_fmt(_mean_std(per_run('kl_k3_mean')), 5)} |")
    return lines + [""]


def direction_lines(runs, part="all") -> list[str]:
    """The direction-agreement table of one model's runs, pooled over seeds per method and over all methods."""
    lines = [DIRECTION_HEADER]
    groups = [(LABELS[m], [r for r in runs if r["method"] == m]) for m in METHODS]
    groups.append(("all mask runs", runs))
    for label, rows in groups:
        c = pooled_agreement(rows, part)
        if c is None:
            continue
        n = c["tokens"]
        cells = [str(n), _rate(c["realised_up"], n), _rate(c["ratio_right"], n), _rate(c["agg_right"], n),
                 _rate(c["uni_right"], n), _rate(c["agg_disagree"], n),
                 _rate(c["agg_right_on_disagree"], c["agg_disagree"]), _rate(c["agg_up_on_disagree"], c["agg_disagree"]),
                 _rate(c["uni_disagree"], n), _rate(c["uni_right_on_disagree"], c["uni_disagree"]),
                 _rate(c["uni_up_on_disagree"], c["uni_disagree"])]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def profile_lines(runs) -> list[str]:
    """The distribution of D by update index (median over runs of each run's quantile) and the clip-matched δ."""
    profiles = [r["divergence_profile"] for r in runs if "divergence_profile" in r]
    if not profiles:
        return []
    keys = ["mean"] + [f"q{100 * p:g}" for p in QUANTILES] + ["max"]
    lines = ["| update of the rollout batch | tokens / run | " + " | ".join(keys) + " |",
             "|---|---|" + "---|" * len(keys)]
    updates = sorted({u for p in profiles for u in p["by_update"]}, key=int)
    for u in updates:
        rows = [p["by_update"][u] for p in profiles if u in p["by_update"]]
        cells = [f"{statistics.median(row[k] for row in rows):.4f}" for k in keys]
        lines.append(f"| {int(u) + 1} | {statistics.median(row['tokens'] for row in rows):.0f} | "
                     + " | ".join(cells) + " |")
    matched = [p["clip_matched_delta"] for p in profiles if p["clip_matched_delta"] is not None]
    share = [p["clip_outside_share"] for p in profiles if p["clip_outside_share"] is not None]
    tail = [p["mu_tail_mean"] for p in profiles]
    grid = [p.get("off_policy_share_above") for p in profiles if p.get("off_policy_share_above")]
    lines += ["", f"Off-policy updates: share of tokens outside clip-higher's ratio window [0.8, 1.28]: median "
              f"{100 * statistics.median(share):.2f}% over {len(share)} runs; the δ with the same share of D > δ "
              f"(clip-matched δ): median {statistics.median(matched):.4f} nats (range {min(matched):.4f}–"
              f"{max(matched):.4f}). Mean behaviour tail mass outside the top-K: {statistics.median(tail):.4f}."]
    if grid:
        lines += ["", "| δ (nats) | " + " | ".join(grid[0]) + " |", "|---|" + "---|" * len(grid[0]),
                  "| quantile of off-policy D (median over runs) | "
                  + " | ".join(f"{1 - statistics.median(g[k] for g in grid):.3f}" for k in grid[0]) + " |"]
    return lines


def rollout_description(setup) -> str:
    """Who generated the rollouts, in the words of the table's introduction."""
    if setup.get("rollout_engine") == "vllm":
        temperature = setup.get("engine_temperature")
        return (f"rollouts from a colocated vLLM engine in {setup['engine_dtype']} (training in float32)"
                + (f", sampling at temperature {temperature:g} while the trainer scores at 1 (μ ≠ π_old)"
                   if temperature is not None else "") + "; clipped surrogates without TRL's importance sampling")
    quant = setup.get("rollout_quant", "none")
    return f"rollout weights: {'full precision' if quant == 'none' else quant + ' fake-quantised (μ ≠ π_old)'}"


def markdown(store, args) -> str:
    setup = store["setup"]
    fraction = args.collapse_fraction
    n = setup.get("eval_samples", 0)
    quant = setup.get("rollout_quant", "none")
    intro = (
        f"{setup['steps']} optimizer steps per run, {setup['prompts_per_step']} puzzles × {setup['num_generations']} "
        f"generations per rollout, each rollout reused for num_iterations = {setup['num_iterations']} passes"
        f"{' in ' + str(setup['minibatches']) + ' minibatches' if setup.get('minibatches', 1) > 1 else ''}, lr "
        f"{setup['learning_rate']:g} constant, β 0, δ = {setup['delta']:g} nats (top-K KL, K = {setup['top_k']}); "
        f"{rollout_description(setup)}"
        f"{'; diffusion rollout cache: ' + setup['cache_mode'] if 'cache_mode' in setup else ''}. "
        f"Greedy solve rate and avg@{n} ({n} temperature-1 samples per puzzle): first {setup['eval_size']} puzzles of "
        "the test split; mean ± sample std over seeds. Collapse: the training reward (trailing mean of 3 rollouts) "
        f"ends below {fraction:g} × the first rollout's. Δ (paired): per-seed difference to the run of the reference "
        "method at the same seed (same first rollout), mean ± std [95% t-interval of the mean]. Masked tokens: mean over off-policy steps of the "
        "share of loss tokens the trust region drops (clipped surrogates: TRL's clip_ratio/region_mean)."
    )
    lines = [intro, ""]
    for model_kind in MODELS:
        runs = [r for r in store["runs"] if r["model"] == model_kind]
        if not runs:
            continue
        baseline = store["baseline"][model_kind]
        start_sampled = store.get("baseline_sampled", {}).get(model_kind)
        start = f"greedy {baseline:.2f}" + (f", avg@{n} {start_sampled:.3f}" if start_sampled is not None else "")
        header = HEADER.format(n=n)
        if model_kind == "diffusion_gemma":
            start = f"solve rate {baseline:.3f}, mean over sampler seeds {setup['sampler_seeds']}"
            header = header.replace("greedy solve rate", "solve rate (sampler-seed mean)")
            header = header.replace("greedy", "solve rate")
            lines += [f"### {model_kind} toy (start: {start})", "",
                      "DiffusionGemma decodes at random (uniform-noise canvases, sampled tokens): its solve rate is "
                      f"the mean over sampler seeds {setup['sampler_seeds']} of the toy sampler's solve rate, not a greedy one, "
                      f"and avg@{n} is not measured (it would be the same quantity over more seeds). Its encoder cache "
                      "is exact: the stress is the reuse of each rollout alone.", "", header]
        else:
            lines += [f"### {model_kind} toy (start: {start})", "", header]
        for method in METHODS:
            rows = [r for r in runs if r["method"] == method]
            if not rows:
                continue
            s = summarise(rows, baseline, fraction)
            per_seed = ", ".join(f"{a:.2f}/{'—' if b is None else f'{b:.3f}'}"
                                 for a, b in zip(s["per_seed"], s["per_seed_sampled"]))
            lines.append(
                f"| {LABELS[method]} | {len(rows)} | {_fmt(s['solve_rate'])} | {_fmt(s['sampled'])} | [{per_seed}] | "
                f"{_paired(rows, runs, 'dppo_topk_kl', 'sampled_solve_rate')} | "
                f"{_paired(rows, runs, 'grpo_clip_higher', 'sampled_solve_rate')} | "
                f"{_paired(rows, runs, 'dppo_topk_kl', 'solve_rate')} | {s['collapses']}/{len(rows)} | "
                f"{_fmt(s['reward_first'])} | {_fmt(s['reward_tail'])} | {_fmt(s['masked_off'], 2, True)} | "
                f"{_fmt(s['outside'], 2, True)} | {s['seconds'][0]:.0f} |"
            )
        lines.append("")
        lines += engine_mismatch_lines(runs)
        mask_runs = [r for r in runs if "direction_agreement" in r]
        if mask_runs:
            lines += ["Direction agreement on the tokens outside the region with A ≠ 0, pooled over seeds: the sign of "
                      "ΔD each criterion predicts for the token's own update against the realised sign of "
                      "D(after the optimizer step) − D(before), same behaviour view; k/n = share [95% Wilson "
                      "interval].", ""]
            lines += direction_lines(mask_runs, "all")
            lines += ["", "The same on the off-policy updates only (2nd and later update of a rollout batch):", ""]
            lines += direction_lines(mask_runs, "off_policy")
            if pooled_agreement(mask_runs, "isolated") is not None:
                lines += ["", "Isolated first-order check: ΔD when the parameters move a short step (length "
                          f"{ISOLATED_STEP:g}) along the token's own update direction only, from the policy before the "
                          "update. Measured on every out-of-region token where a predictive sign differs from the "
                          f"ratio sign, plus {setup.get('isolated_sample')} random agreeing ones per update, so only "
                          "the 'where they differ' columns are the full population:", ""]
                lines += direction_lines(mask_runs, "isolated")
            lines += ["", "Per-token D of the mask runs (nats), by update index within a rollout batch:", ""]
            lines += profile_lines(mask_runs)
            lines.append("")
    return "\n".join(lines)


def plot(store, path, fraction=0.5):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in MODELS if any(r["model"] == m for r in store["runs"])]
    fig, axes = plt.subplots(len(models), 3, figsize=(15, 4.2 * len(models)), squeeze=False)
    for row, model_kind in zip(axes, models):
        runs = [r for r in store["runs"] if r["model"] == model_kind]
        baseline = store["baseline"][model_kind]
        present = [m for m in METHODS if any(r["method"] == m for r in runs)]
        for i, method in enumerate(present):
            rows = [r for r in runs if r["method"] == method]
            n = min(len(r["rewards"]) for r in rows)
            mean = [statistics.fmean(r["rewards"][j] for r in rows) for j in range(n)]
            window = 3
            smooth = [statistics.fmean(mean[max(0, j - window + 1): j + 1]) for j in range(n)]
            row[0].plot([step + 1 for step in rows[0]["rollout_steps"][:n]], smooth, label=LABELS[method],
                        color=f"C{i}", marker=".")
            n = min(len(r["masked_frac_per_step"]) for r in rows)
            masked = [statistics.fmean(r["masked_frac_per_step"][j] or 0.0 for r in rows) for j in range(n)]
            row[2].plot(range(1, n + 1), masked, label=LABELS[method], color=f"C{i}", lw=1)
            rates = [r["solve_rate"] for r in rows]
            row[1].bar(i, statistics.fmean(rates), color=f"C{i}", alpha=0.6)
            row[1].scatter([i] * len(rates), rates, color="k", s=12, zorder=3)
        row[0].set(title=f"{model_kind}: rollout reward (seed mean, trailing mean of 3)",
                   xlabel="optimizer step of the rollout", ylabel="mean partial-credit reward")
        row[1].axhline(baseline, color="r", ls="--", lw=1, label="start")
        first = statistics.fmean(r["rewards"][0] for r in runs)
        row[0].axhline(fraction * first, color="r", ls=":", lw=1, label=f"collapse line ({fraction:g} × first, mean)")
        row[1].set_xticks(range(len(present)), [LABELS[m] for m in present], rotation=25, ha="right", fontsize=7)
        rate = "solve rate (sampler-seed mean)" if model_kind == "diffusion_gemma" else "greedy solve rate"
        row[1].set(title=f"{model_kind}: final {rate} (dots = seeds)", ylabel="solve rate")
        row[2].set(title=f"{model_kind}: share of loss tokens masked / clipped (seed mean)",
                   xlabel="optimizer step (a new rollout every num_iterations)", ylabel="masked fraction")
        for ax in row:
            ax.title.set_fontsize(9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def direction_report(paths) -> str:
    """The direction-agreement tables pooled over the causal mask runs of several study JSON files."""
    sections = []
    runs = []
    for path in paths:
        store = json.loads(Path(path).read_text())
        setup = store["setup"]
        chosen = [r for r in store["runs"] if "direction_agreement" in r]
        runs += chosen
        sections.append(f"* `{Path(path).name}`: δ = {setup['delta']:g}, K = {setup['top_k']}, rollout "
                        f"{setup.get('rollout_quant', 'none')}, num_iterations {setup['num_iterations']}, minibatches "
                        f"{setup.get('minibatches', 1)}; {len(chosen)} mask runs")
    lines = ["Pooled over:", "", *sections, "", "All out-of-region tokens with A ≠ 0 (realised = re-scored after the "
             "optimizer step; k/n = share [95% Wilson interval]):", "", *direction_lines(runs, "all")]
    if pooled_agreement(runs, "isolated") is not None:
        lines += ["", f"Isolated first-order check (a step of length {ISOLATED_STEP:g} along the token's own update "
                  "direction; every disagreeing token, plus a sample of agreeing ones, so only the 'where they differ' "
                  "columns are the full population):", "", *direction_lines(runs, "isolated")]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if args.analysis == "direction":
        if not args.inputs:
            raise SystemExit("--analysis direction needs --inputs (study JSON files)")
        report = direction_report(args.inputs)
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}_direction.md").write_text(report)
        print(report)
        return report
    import torch

    if args.analysis == "mismatch":
        torch.set_num_threads(args.threads)
        return mismatch_report(args)

    torch.set_num_threads(args.threads)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / f"{args.name}.json"
    store = {} if args.fresh or not results_path.is_file() else json.loads(results_path.read_text())
    setup = dict(steps=args.steps, num_iterations=args.num_iterations, learning_rate=args.learning_rate,
                 num_generations=args.num_generations, prompts_per_step=args.prompts_per_step, delta=args.delta,
                 top_k=args.top_k, eval_size=args.eval_size, eval_samples=args.eval_samples,
                 rollout_quant=args.rollout_quant, minibatches=args.minibatches, isolated_sample=args.isolated_sample)
    if args.rollout_engine == "vllm":  # only then, so that the stored studies' setups still match
        setup.update(rollout_engine="vllm", engine_dtype=args.engine_dtype, engine_temperature=args.engine_temperature)
    if "diffusion" in args.models:
        setup["cache_mode"] = args.cache_mode
    if "diffusion_gemma" in args.models:
        setup["sampler_seeds"] = args.sampler_seeds
    if args.report_only:
        if not store.get("runs"):
            raise SystemExit(f"no runs in {results_path} to report")
    elif store.get("setup") != setup:
        store = {"setup": setup, "baseline": {}, "baseline_sampled": {}, "runs": []}
    start = time.perf_counter()
    for model_kind in args.models:
        if model_kind not in store["baseline"] and not args.report_only:
            model, tokenizer = load_model(model_kind)
            store["baseline"][model_kind] = solve_rate(model_kind, model, tokenizer, args.eval_size,
                                                       args.sampler_seeds)
            if args.eval_samples and model_kind != "diffusion_gemma":
                store.setdefault("baseline_sampled", {})[model_kind] = sampled_solve_rate(
                    model_kind, model, tokenizer, args.eval_size, args.eval_samples)
            results_path.write_text(json.dumps(store, indent=1) + "\n")
    done = {(r["model"], r["method"], r["seed"]) for r in store["runs"]}
    todo = [(m, method, seed) for m in args.models for method in args.methods for seed in args.seeds
            if (m, method, seed) not in done]
    if args.report_only:
        todo = []
    print(f"start solve rates {store['baseline']}; {len(todo)} runs to do", flush=True)
    for n, (model_kind, method, seed) in enumerate(todo, 1):
        result = run_one(model_kind, method, seed, args)
        store["runs"].append(result)
        results_path.write_text(json.dumps(store, indent=1) + "\n")
        masked = result["masked_frac"]
        sampled = result["sampled_solve_rate"]
        print(f"[{n}/{len(todo)}] {model_kind:9s} {method:16s} seed {seed}: solve rate "
              f"{store['baseline'][model_kind]:.2f} -> {result['solve_rate']:.2f}"
              f"{'' if sampled is None else f' (avg@{args.eval_samples} {sampled:.3f})'}, masked "
              f"{'—' if masked is None else f'{100 * masked:.2f}%'}, {result['train_seconds']:.0f}+"
              f"{result['eval_seconds']:.0f} s ({time.perf_counter() - start:.0f} s so far)", flush=True)
    if todo:
        store["wall_seconds"] = store.get("wall_seconds", 0.0) + (time.perf_counter() - start)
        results_path.write_text(json.dumps(store, indent=1) + "\n")
    table = markdown(store, args)
    (out / f"{args.name}_table.md").write_text(table)
    if store["runs"]:
        plot(store, out / f"{args.name}.png", args.collapse_fraction)
    print("\n" + table)
    print(f"wrote {results_path}, {out / (args.name + '_table.md')}, {out / (args.name + '.png')}")
    return store


if __name__ == "__main__":
    sys.exit(main() and 0)
