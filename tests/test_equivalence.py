"""Equivalence (golden) tests: two fixed-seed optimizer steps of each trainer scenario land on the pinned weights.

Every scenario of :mod:`tests.equivalence` (tiny random LLaDA / Dream / SDAR / causal models, RLDFTrainer and
DPPOMaskTrainer through ``.train()``, CPU, fp32, one thread) is run and every trainable parameter, plus the logged
per-step ``loss`` and ``reward``, is compared with ``tests/data/equivalence/<scenario>.safetensors``, written by the
code at the goldens' commit (``python -m tests.equivalence --write``). A refactor of the trainers must keep them.

Tolerance: ``torch.testing.assert_close(atol=1e-5, rtol=1e-4)`` per element, NaN = NaN (the ``reward`` of a step
that reuses a rollout is not logged). Not bitwise, because a refactor may legitimately change the order of float
sums (chunking of the sampled states, where the normaliser is applied, fused vs separate passes); such a change moves
the results by ~1e-7 to 1e-6: running every scenario with 2 threads instead of 1 (a different reduction order)
moved the weights by at most 1.4e-6, within the tolerance, 7× below ``atol``.

A behavioural change, on the other hand, shows in the weights' change over the two steps (Adam, lr 1e-3 then
5e-4). Measured against the initial weights at the goldens' commit, over the ~20-22k parameters of each scenario:

* median |Δweight| 1.2e-3 to 1.5e-3, i.e. 105-122× the per-element tolerance ``atol + rtol·|w|``;
* 1st percentile of the nonzero |Δweight| 4.8e-4 to 6.4e-4 (29-46× the tolerance);
* minimum nonzero |Δweight| 1.6e-5 to 2.7e-4 in seven scenarios (1.4× to 5.8× the tolerance) and 3.7e-6 in
  ``rldf_llada_all_masking``, where one element of 21,600 (its two Adam updates nearly cancel) moves by less than
  the tolerance — the only one in all scenarios; ``atol = 1e-5`` is 100× below the typical move, not below every
  element's;
* 64 to 288 entries per scenario do not move at all: the embedding rows of tokens that never occur in an input
  (zero gradient, no weight decay); they are compared like the rest.

So a change that alters the training (a target, a weight, a normaliser, a mask decision, a random draw) moves
thousands of elements by ~1e-4 to 1e-3 and fails: ``test_a_changed_setting_is_caught`` checks it for a changed
``learning_rate`` (1e-3 → 1.1e-3), ``clean_target_threshold`` (0.06 → 0.07), ``epsilon`` (0.2 → 0.1) and
``divergence_threshold`` (1e-3 → 3e-3): each moves 19-21k of the ~21.6k weights outside the tolerance (max 9e-4 to
3e-3; the learning-rate and ``c`` changes also alter step 2's rollout).

Threshold decisions (clean targets ``p > c``, trust-region mask ``D > δ``) are discrete, so a rounding change could
flip one if a value sat on the threshold. Measured by moving ``c`` and ``δ`` until the run changes: the nearest
clean-target probability is 5.6e-5 from ``c`` (``rldf_sdar_block``; the other scenarios have none within 1e-4) and
the nearest divergence 7.7e-5 from ``δ`` (``dppo_causal``; in ``dppo_diffusion`` no D lies between 5e-6 and
2.1e-3): 40× or more above the largest change a different reduction order made to any weight.

Adam's ε is 1e-5 in every scenario (``tests.equivalence.ADAM_EPSILON``; the figures above were measured at TRL's
1e-8, the real gradients' moves are the same). At 1e-8 the goldens pinned float rounding: a gradient element whose
exact value is ~0 but whose computed value is rounding noise (~1e-8) took a move of up to lr/2, so
``rldf_llada_all_masking`` failed on AMD EPYC / AVX2 machines (lm_head 104-108 of 480 elements off) and 6 of the 8
scenarios failed once every nonzero gradient was perturbed by 1e-8 (``test_goldens_do_not_pin_rounding_noise``,
which passes at 1e-5 with the largest move 2.7e-6, 3.7× below ``atol``).

The scenarios are bit-reproducible on CPU, in one process and across processes (checked at the goldens' commit):
the model is built from a fixed seed, TRL seeds the sampler and the global RNG from ``args.seed``, the trainers'
rollout and mask-seed generators are seeded from it too, and ``run_scenario`` pins one intra-op thread.
"""

from __future__ import annotations

import pytest
import torch

from .equivalence import (
    ATOL,
    GOLDEN_DIR,
    RTOL,
    SCENARIO_NAMES,
    build_trainer,
    golden_path,
    load_golden,
    log_tensor,
    main,
    mismatches,
    run_scenario,
    trainable_parameters,
)


@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_training_matches_golden(tmp_path, name):
    assert golden_path(name).exists(), f"no golden for {name}: `python -m tests.equivalence --write {name}`"
    problems = mismatches(run_scenario(name, tmp_path), load_golden(name))
    assert not problems, f"{name} no longer trains as pinned (atol={ATOL}, rtol={RTOL}):\n" + "\n".join(problems)


@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_goldens_do_not_pin_rounding_noise(tmp_path, name):
    """Perturbing every nonzero gradient element by N(0, 1e-8) — the size of float rounding in these sums, what
    another machine's kernels or summation order change — keeps the run within the goldens' tolerance (with TRL's
    Adam ε = 1e-8, 6 of the 8 scenarios moved up to 1e-3, see ``tests.equivalence.ADAM_EPSILON``)."""
    torch.set_num_threads(1)
    trainer = build_trainer(name, tmp_path)
    noise = torch.Generator().manual_seed(0)
    for param in trainer.model.parameters():
        if param.requires_grad:
            param.register_hook(lambda g: g + 1e-8 * torch.randn(g.shape, generator=noise) * (g != 0))
    trainer.train()
    assert not mismatches({**trainable_parameters(trainer.model), "__log__": log_tensor(trainer.state.log_history)},
                          load_golden(name))


def test_goldens_and_scenarios_agree():
    assert sorted(path.stem for path in GOLDEN_DIR.glob("*.safetensors")) == sorted(SCENARIO_NAMES)


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("rldf_llada_onpolicy_token", dict(learning_rate=1.1e-3)),
        ("rldf_llada_onpolicy_token", dict(clean_target_threshold=0.07)),
        ("rldf_llada_ppo_sample", dict(epsilon=0.1)),
        ("dppo_diffusion", dict(divergence_threshold=0.003)),
    ],
    ids=["learning_rate", "clean_target_threshold", "epsilon", "divergence_threshold"],
)
def test_a_changed_setting_is_caught(tmp_path, name, overrides):
    """The comparison has teeth: one setting changed, the run falls outside the tolerance — and not by a hair."""
    result, golden = run_scenario(name, tmp_path, **overrides), load_golden(name)
    assert mismatches(result, golden)
    assert mismatches(result, golden, atol=10 * ATOL, rtol=10 * RTOL)
    moved = max(float((result[key] - golden[key]).abs().max()) for key in golden if key != "__log__")
    assert moved > 10 * ATOL


def test_cli_refuses_to_overwrite_without_write(capsys):
    path = golden_path(SCENARIO_NAMES[0])
    before = path.read_bytes(), path.stat().st_mtime_ns
    assert main([SCENARIO_NAMES[0]]) == 0
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
    assert "wrote" not in capsys.readouterr().out
