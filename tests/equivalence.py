"""Fixed-seed training scenarios whose final weights are pinned by goldens (``tests/data/equivalence``).

Each scenario builds a tiny random model with a fixed seed, trains it for two optimizer steps through the public
API (``RLDFTrainer`` / ``DPPOMaskTrainer`` + ``.train()``, CPU, fp32) on the addition task with the dense
``length_reward``, and returns the final trainable parameters plus ``"__log__"``: a (steps, 2) float64 tensor of the
logged ``loss`` and ``reward`` of every step (NaN where TRL logs no reward: a step that reuses a rollout).
``tests/test_equivalence.py`` compares a fresh run against the goldens, so that a refactor of the trainers (loss /
sampler objects) can be checked to train as the code did when the goldens were written.

Regenerate the goldens (only when a behaviour change is intended, and say so in the commit)::

    OMP_NUM_THREADS=1 python -m tests.equivalence --write            # every scenario
    OMP_NUM_THREADS=1 python -m tests.equivalence --write NAME ...   # some of them

Without ``--write`` nothing is written: the command runs the scenarios, reports how far each is from its golden,
and exits with status 1 when one is outside the tolerance (or has no golden).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from .conftest import addition_dataset, length_reward, make_char_tokenizer, tiny_training_args

GOLDEN_DIR = Path(__file__).parent / "data" / "equivalence"
LOG_KEY = "__log__"
LOG_FIELDS = ("loss", "reward")

ADAM_EPSILON = 1e-5
"""Adam's ε in every scenario. Some elements' exact gradient is (nearly) 0 while the computed one is float rounding
(~1e-8: in ``rldf_llada_all_masking`` every row of a group is scored at the same fully masked state, so the head rows
of unsampled tokens get Σ_b A_b · (same term) = 0 up to rounding). With TRL's ε = 1e-8 Adam scales such a gradient to
a move of up to lr/2, so the goldens pinned the machine's rounding (which kernels, which summation order): 6 of the 8
scenarios failed once their nonzero gradients were perturbed by 1e-8, and ``rldf_llada_all_masking`` failed on AMD
EPYC / AVX2 machines. With ε = 1e-5 such a gradient moves its weight by < 1e-6 while every real gradient (median
|g| ~ 1e-2) still takes Adam's full-size step (``test_goldens_do_not_pin_rounding_noise``)."""

# Small enough that every golden stays well under 200 KB in float32 (about 22k parameters).
TINY_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
MODEL_SEED = 0


@dataclass(frozen=True)
class Scenario:
    trainer: str  # "rldf" or "dppo"
    model: str  # "llada", "dream", "sdar" or "causal"
    overrides: dict = field(default_factory=dict)  # config fields on top of tests.conftest.tiny_training_args
    description: str = ""


# DPPO settings of tests/test_dppo_mask_trainer.py (k = 2 sampled states, top-K = 4).
_DPPO = dict(num_sampled_timesteps=2, divergence_top_k=4)
# The tiny random models put ~1/14 on every token, so at the default c = 0.2 the only targets are the committed
# tokens; c = 0.06 makes the clean targets (still-masked tokens above c, Alg. 3) part of what the goldens pin.
_CLEAN = dict(clean_target_threshold=0.06)
# At lr 1e-3 the off-policy step's D(μ‖π) is ~1e-3: δ = 1e-3 makes the trust-region mask drop part of the tokens
# (about 10-70 % on step 2), so the mask decisions are pinned too (at the default δ = 0.15 it never fires).
_FIRING = dict(divergence_threshold=0.001)

SCENARIOS: dict[str, Scenario] = {
    "rldf_llada_onpolicy_token": Scenario(
        "rldf", "llada",
        dict(**_CLEAN, policy_estimator="rldf", num_iterations=1, loss_normalization="token", beta=0.01),
        "on-policy RLDF: clean targets fixed by the loss forward, token normalisation applied before clipping",
    ),
    "rldf_llada_ppo_sample": Scenario(
        "rldf", "llada",
        dict(**_CLEAN, num_iterations=2, loss_normalization="sample", beta=0.01, use_bias_correction_kl=False),
        "PPO: TRL's π_old pass runs (gradient_accumulation_steps=1 is not a multiple of steps_per_generation=1 × "
        "num_iterations=2); step 2 reuses step 1's rollout off-policy, so the ratio clipping is live",
    ),
    "rldf_dream_random_masking": Scenario(
        "rldf", "dream", dict(policy_estimator="random_masking"),
        "ELBO-style random-masking baseline (1/t weights) on a Dream-shaped model (logit shift)",
    ),
    "rldf_llada_all_masking": Scenario(
        "rldf", "llada", dict(policy_estimator="all_masking"),
        "d1's all-masking baseline on a LLaDA-shaped model",
    ),
    "rldf_sdar_block": Scenario(
        "rldf", "sdar", dict(_CLEAN),
        "block-diffusion model: packed sampled states (one forward per completion) and block-local targets",
    ),
    "dppo_diffusion": Scenario(
        "dppo", "llada", dict(**_DPPO, **_CLEAN, **_FIRING, num_iterations=2),
        "predictive mask on a diffusion LM: π_old pass (old top-K; μ from π_old for the clean targets, from the "
        "rollout record for the committed tokens), off-policy second step where the mask fires",
    ),
    "dppo_causal": Scenario(
        "dppo", "causal", dict(**_DPPO, **_FIRING, model_kind="causal", num_iterations=2),
        "predictive mask on an ordinary causal LM (TRL's generate + the behaviour capture), off-policy second step",
    ),
    "dppo_sdar_block": Scenario(
        "dppo", "sdar", dict(**_DPPO, **_CLEAN, **_FIRING, num_iterations=2),
        "predictive mask on a block-diffusion model (packed π_old pass), off-policy second step",
    ),
}
SCENARIO_NAMES = list(SCENARIOS)


def build_model(kind: str, tokenizer):
    """The scenario's tiny random model, built from ``MODEL_SEED`` without touching the global RNG."""
    from tests.tiny_models import build_tiny_dream, build_tiny_llada, build_tiny_sdar

    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    if kind == "causal":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**ids, **TINY_SHAPE, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=tokenizer.bos_token_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(MODEL_SEED)
            return LlamaForCausalLM(config)
    builder = {"llada": build_tiny_llada, "dream": build_tiny_dream, "sdar": build_tiny_sdar}[kind]
    extra = {"block_size": 4} if kind == "sdar" else {}
    return builder(mask_token_id=tokenizer.mask_token_id, seed=MODEL_SEED, **ids, **TINY_SHAPE, **extra)


def build_trainer(name: str, tmp_dir, **overrides):
    """The scenario's trainer, not yet trained; ``overrides`` change config fields (for the sensitivity checks)."""
    from dllm_trl.trainers import DPPOMaskConfig, DPPOMaskTrainer, RLDFConfig, RLDFTrainer

    scenario = SCENARIOS[name]
    config_class, trainer_class = {
        "rldf": (RLDFConfig, RLDFTrainer),
        "dppo": (DPPOMaskConfig, DPPOMaskTrainer),
    }[scenario.trainer]
    # fp32 explicitly (bf16=False): the goldens must not depend on an autocast default. Adam's ε: see ADAM_EPSILON.
    args = tiny_training_args(config_class, Path(tmp_dir), bf16=False,
                              **{"adam_epsilon": ADAM_EPSILON, **scenario.overrides, **overrides})
    tokenizer = make_char_tokenizer()
    return trainer_class(
        model=build_model(scenario.model, tokenizer),
        reward_funcs=length_reward,
        args=args,
        train_dataset=addition_dataset(),
        processing_class=tokenizer,
    )


def trainable_parameters(model) -> dict[str, torch.Tensor]:
    return {
        name: p.detach().to("cpu", torch.float32).clone() for name, p in model.named_parameters() if p.requires_grad
    }


def log_tensor(log_history) -> torch.Tensor:
    # TRL logs `reward` only on the steps that generate (with num_iterations = 2 step 2 reuses step 1's rollout): NaN.
    rows = [[float(entry.get(key, float("nan"))) for key in LOG_FIELDS] for entry in log_history if "loss" in entry]
    return torch.tensor(rows, dtype=torch.float64)


def run_scenario(name: str, tmp_dir, return_initial: bool = False, **overrides):
    """Train scenario ``name`` for two steps in ``tmp_dir``: {parameter name: final value (float32, cpu)} + ``__log__``.

    With ``return_initial=True`` returns ``(final, initial)``, the second being the parameters before training.
    """
    torch.set_num_threads(1)  # tiny matmuls; and one thread keeps CPU reductions in one order
    trainer = build_trainer(name, tmp_dir, **overrides)
    initial = trainable_parameters(trainer.model)
    trainer.train()
    final = trainable_parameters(trainer.model)
    final[LOG_KEY] = log_tensor(trainer.state.log_history)
    steps = trainer.args.max_steps
    if final[LOG_KEY].shape != (steps, len(LOG_FIELDS)):
        raise RuntimeError(f"{name}: expected {steps} logged steps with {LOG_FIELDS}, got {final[LOG_KEY].shape}.")
    return (final, initial) if return_initial else final


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.safetensors"


def load_golden(name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(golden_path(name)))


def write_golden(name: str, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    path = golden_path(name)
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(path),
              metadata={"scenario": name, "fields_of_log": ",".join(LOG_FIELDS)})
    return path


ATOL = 1e-5
RTOL = 1e-4
"""Tolerance of the comparison with the goldens; why these values: the docstring of ``tests/test_equivalence.py``."""


def max_abs_difference(result: dict[str, torch.Tensor], golden: dict[str, torch.Tensor]) -> float:
    """Largest |result − golden| over every tensor (NaN = NaN; inf where the names, shapes or NaN patterns differ)."""
    if result.keys() != golden.keys():
        return float("inf")
    worst = 0.0
    for key, expected in golden.items():
        actual = result[key]
        if actual.shape != expected.shape or not torch.equal(actual.isnan(), expected.isnan()):
            return float("inf")
        worst = max(worst, float((actual.double() - expected.double()).nan_to_num().abs().max()))
    return worst


def mismatches(result: dict[str, torch.Tensor], golden: dict[str, torch.Tensor],
               atol: float = ATOL, rtol: float = RTOL) -> list[str]:
    """One message per tensor of ``golden`` that ``result`` lacks or does not match within ``atol`` / ``rtol``
    (``torch.testing.assert_close``, NaN = NaN), and one per tensor ``result`` has beyond the golden's."""
    problems = [f"{key}: not in the golden" for key in result.keys() - golden.keys()]
    for key, expected in golden.items():
        if key not in result:
            problems.append(f"{key}: missing from the run")
            continue
        try:
            torch.testing.assert_close(result[key], expected, atol=atol, rtol=rtol, equal_nan=True)
        except AssertionError as error:
            problems.append(f"{key}: {error}")
    return problems


def main(argv=None) -> int:
    import argparse
    import time

    parser = argparse.ArgumentParser(prog="python -m tests.equivalence", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"scenarios (default: all): {', '.join(SCENARIO_NAMES)}")
    parser.add_argument("--write", action="store_true", help="(over)write the goldens of the scenarios run")
    options = parser.parse_args(argv)
    names = options.names or SCENARIO_NAMES
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {SCENARIO_NAMES}")
    failed = []
    for name in names:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            result = run_scenario(name, tmp)
        seconds = time.perf_counter() - start
        exists = golden_path(name).exists()
        line = f"{name}: {seconds:.1f}s"
        if exists:
            golden = load_golden(name)
            difference = max_abs_difference(result, golden)
            line += f", max |Δ| vs golden {difference:.3g}"
            if difference == 0.0:
                line += " (bitwise identical)"
            elif mismatches(result, golden):
                line += f" (OUTSIDE atol={ATOL}, rtol={RTOL})"
                failed.append(name)
        if options.write:
            path = write_golden(name, result)
            line += f", wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path} " \
                    f"({path.stat().st_size / 1024:.0f} KB)"
        elif not exists:
            line += " (no golden; run with --write to create it)"
            failed.append(name)
        print(line, flush=True)
    if failed and not options.write:
        print(f"{len(failed)} scenario(s) without a matching golden: {failed}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
