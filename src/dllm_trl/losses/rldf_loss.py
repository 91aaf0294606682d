"""The RLDF loss object (paper 1, SPEC §2): trajectory → sampled states → targets → per-token terms and metrics.

:class:`RLDFLoss` is what :class:`~dllm_trl.RLDFTrainer` calls at each hook; it holds no trainer, accelerator or
optimizer. It covers RLDF and the baseline estimators of paper 1 App. A (``args.policy_estimator``,
:mod:`dllm_trl.losses.estimators`), and the packed scoring of a block-diffusion model's states (SPEC §7,
:mod:`dllm_trl.losses.packed_states`). A loss object declares what it needs and can do through class attributes
(``sampler_requests()``, ``packs_block_states``, ``targets_from_loss_forward``, ``supported_estimators``), never
through the trainer's class.

Batch keys it reads (all aligned by row): ``rollout_prompt_ids`` / ``rollout_prompt_mask`` (B, P), ``rollout_ids``,
``commit_step``, ``valid_mask`` (B, G), ``sampled_steps`` (B, k), ``mask_seed`` (B,), ``advantages`` (B,), and after
target selection ``target_mask`` (B, k, G) (+ ``target_weight`` for random masking, ``targets_pending`` when the loss
forward fixes the targets). The rollout's record ``rollout_commit_prob`` (B, G) and the old-policy pass's
``old_sampling_logps`` (B, k, G) give the ``sampling/*`` mismatch metrics, and ``importance_sampling_ratio`` (B, k, G)
TRL's correction (:mod:`dllm_trl.losses.rollout_mismatch`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..models.bidirectional import attention_mask_dtype, diffusion_block_size, diffusion_config
from ..models.diffusion_gemma import is_diffusion_gemma
from ..models.scoring import chunked_token_logps_at, completion_token_logps
from ..models.engines import model_config, unwrap_model
from .estimators import (
    ESTIMATORS,
    estimator_candidates,
    estimator_state,
    estimator_steps,
    estimator_targets,
)
from .packed_states import pack_sampled_states, packed_read_positions, states_per_forward
from .rollout_mismatch import (
    REPLAYING_ESTIMATORS,
    importance_sampling_ratio,
    mismatch_metrics,
    record_logps,
    recorded_targets,
    sampling_logps_view,
)
from .rldf_terms import (
    INVALID_STEP,
    clean_target_mask,
    corrected_k3_kl,
    policy_token_terms,
    sample_timesteps,
    step_uncertainty,
)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p")
"""The sampler settings that shape the distribution a token is drawn from: the loss scores ``π_old`` with them."""

TRAJECTORY_KEYS = ("rollout_prompt_ids", "rollout_prompt_mask", "rollout_ids", "commit_step", "valid_mask",
                   "sampled_steps")
"""Batch keys of the recorded trajectory (plus ``mask_seed``) that travel with TRL's batch."""


def rollout_entries(prompt_ids, prompt_mask, output) -> dict:
    """The batch entries every diffusion loss keeps of a rollout: its prompts, completion, commit steps and valid
    mask."""
    return {
        "rollout_prompt_ids": prompt_ids,
        "rollout_prompt_mask": prompt_mask,
        "rollout_ids": output.completion_ids,
        "commit_step": output.commit_step,
        "valid_mask": output.completion_mask,
    }


def zero_variance_rows(rewards: torch.Tensor, num_generations: int, reward_weights: torch.Tensor,
                       aggregation: str) -> torch.Tensor:
    """(rows,) bool: the rows of groups whose advantages carry no signal (paper App. C.3).

    ``rewards`` (rows, reward functions) as TRL gathered them, NaN where a function could not score a completion.
    Read as TRL's own ``frac_reward_zero_std`` is — a NaN-aware spread within float rounding of 0 — not from
    ``advantages == 0``, which the rounding of the group mean defeats. With ``sum_then_normalize`` the weighted sum
    is constant over the group's scorable completions; with ``normalize_then_sum`` every reward function is. A group
    with fewer than two scored values has no spread, hence no signal.
    """
    groups = rewards.view(-1, num_generations, rewards.shape[-1])
    if aggregation == "sum_then_normalize":
        total = (groups * reward_weights.to(rewards.device)).nansum(-1)
        total = total.masked_fill(torch.isnan(groups).all(-1), float("nan"))  # unscorable, as TRL marks them
        return _flat(total, dim=1).repeat_interleave(num_generations)
    return _flat(groups, dim=1).all(-1).repeat_interleave(num_generations)


def _flat(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Whether ``values`` along ``dim`` are constant to float rounding, NaNs ignored (TRL's ``nanstd``)."""
    count = (~torch.isnan(values)).sum(dim)
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    spread = torch.nanmean((values - mean) ** 2, dim=dim).sqrt()
    spread = torch.where(count > 1, spread * (count / (count - 1).clamp_min(1)).sqrt(), 0.0)
    return spread <= 1e-6 * (1 + torch.nan_to_num(torch.nanmean(values.abs(), dim=dim), nan=0.0))


@dataclass
class LossCall:
    """What the sampled steps of one loss call share: the per-(row, step) ``normalizer``, the trainer's current
    ``beta`` / clipping range, and buffers the step terms fill for the metrics (``kl``, ``ratio``, ``entropy``,
    (B, k, G)). ``count_targets``: add the targets fixed by the loss forward to ``new_target_count``.
    ``sampling_logps`` / ``sampling_scored`` (B, k, G): the sampler-consistent ``log π_old`` the loss forward read at
    the recorded targets (when no old-policy pass brought it), for the ``sampling/*`` metrics."""

    normalizer: torch.Tensor
    beta: float
    epsilon_low: float
    epsilon_high: float
    kl: torch.Tensor
    ratio: torch.Tensor
    entropy: torch.Tensor | None
    count_targets: bool = False
    new_target_count: torch.Tensor | int = 0
    extra: dict = field(default_factory=dict)
    sampling_logps: torch.Tensor | None = None
    sampling_scored: torch.Tensor | None = None


class RLDFLoss:
    """RLDF (Alg. 2–3, Eq. 7–10) and its baseline estimators on a recorded denoising trajectory.

    ``args`` is an :class:`~dllm_trl.RLDFConfig`, read at every call (so a field changed on the trainer's
    ``args`` takes effect).
    """

    record_topk = 0
    """How many top-K log-probs of each committed token's distribution the sampler must record (0: none)."""
    packs_block_states = True
    """A block-diffusion model's sampled states are scored in packed forwards (SPEC §7)."""
    targets_from_loss_forward = True
    """An on-policy batch may fix ``Ô_t`` in the loss forward itself (π_old is the current policy)."""
    supported_estimators = ESTIMATORS
    logs_ppo_terms = True
    """The per-token terms are PPO/REINFORCE ones: entropy and clipping metrics are logged."""
    sampling_logps_key = "old_sampling_logps"
    """Batch key of the old-policy pass's sampler-consistent ``log π_old`` at the recorded targets (B, k, G)."""

    sampler_config = None
    """The config of the sampler whose rollouts this loss scores (:meth:`bind_sampler`); until one is bound, the
    sampler ``args`` describe (``args.diffusion_generation_config()``, the trainer's default sampler)."""

    def __init__(self, args):
        self.args = args

    def sampler_requests(self) -> dict:
        """Sampler settings (``DiffusionGenerationConfig`` fields) this loss needs the rollout to record, e.g.
        ``record_topk``: the trainer sets them on (a copy of) its sampler's config."""
        return {"record_topk": self.record_topk} if self.record_topk else {}

    reads_sampling_settings = True
    """Whether π_old is scored with the sampler's sampling settings (temperature, top-p / top-k / min-p), which its
    config must then have."""

    def bind_sampler(self, config) -> None:
        """Score ``π_old`` with the settings of the sampler that makes the rollouts: ``config`` is that sampler's
        config (held, not copied, so that the two read the same settings). The trainer calls it once, at init.
        Refuses, naming the field, a sampler whose settings this loss cannot honour."""
        if self.reads_sampling_settings and self.args.policy_estimator in REPLAYING_ESTIMATORS:  # the mismatch view
            missing = [name for name in SAMPLING_FIELDS if not hasattr(config, name)]
            if missing:
                raise ValueError(
                    f"{type(self).__name__} scores the rollout's record μ(a) under the sampler's processing, but the "
                    f"sampler's config ({type(config).__name__}) has no {', '.join(missing)}: give the sampler a "
                    "config with the sampling fields of DiffusionGenerationConfig."
                )
        if self.args.rollout_importance_sampling_correction:
            refusal = None
            if getattr(config, "cache", None) == "none":
                refusal = ("the sampler's cache='none' decodes with full forwards, so the record is exactly the training "
                           "forward's: there is nothing to correct")
            elif not getattr(config, "temperature", 1.0) > 0:
                refusal = (f"the sampler's temperature={config.temperature} decodes greedily: no token is sampled, so "
                           "there is no behaviour distribution to correct for")
            if refusal:
                raise ValueError(f"rollout_importance_sampling_correction=True is not supported here: {refusal}. Leave "
                                 "it False (the mismatch is still logged as sampling/*).")
        self.sampler_config = config

    def sampling_settings(self):
        """The settings of the sampler that made the rollouts (:attr:`sampler_config`)."""
        if self.sampler_config is not None:
            return self.sampler_config
        # No sampler bound (a loss used on its own): the arguments' sampling settings; the block length is not read.
        return self.args.diffusion_generation_config(block_length=self.args.max_completion_length)

    # -------------------------------------------------------------------------------------------- rollout side
    corrects_rollout_mismatch = True
    """Whether this loss can apply ``rollout_importance_sampling_correction`` (refused at init when not)."""

    def check_model_kind(self, model) -> None:
        """Refuse a model this loss cannot score (here: one without a mask token)."""
        if getattr(model_config(model), "mask_token_id", None) is None:
            raise ValueError(
                f"{type(self).__name__} scores masked-diffusion states, and this {type(unwrap_model(model)).__name__} "
                "has no config.mask_token_id: load a masked-diffusion LM with load_diffusion_model(...), or let the "
                "trainer pick the loss of the model's family (leave loss= unset)."
            )

    def check_model(self, model) -> None:
        """Refuse, at init, a model or setting this loss cannot train: the model's kind (:meth:`check_model_kind`),
        the estimator, the block-diffusion forms, the rollout-mismatch correction."""
        self.check_model_kind(model)
        if self.args.rollout_importance_sampling_correction and not self.corrects_rollout_mismatch:
            raise ValueError(f"rollout_importance_sampling_correction=True is not supported by {type(self).__name__}: "
                             "its rollout has no approximate cache to correct. Leave it False.")
        estimator = self.args.policy_estimator
        if estimator not in self.supported_estimators:
            raise ValueError(
                f"policy_estimator={estimator!r} is not supported by {type(self).__name__}: it builds its own states "
                f"at the sampled denoising steps; use one of {self.supported_estimators}."
            )
        if diffusion_block_size(model) is not None and estimator not in ("rldf", "sequential"):
            raise ValueError(
                f"policy_estimator={estimator!r} has no block-diffusion form (its states mask every block at once, "
                f"which a block-diffusion model never decodes from); use one of ('rldf', 'sequential')."
            )
        if self.args.rollout_importance_sampling_correction and diffusion_block_size(model) is not None:
            raise ValueError(
                "rollout_importance_sampling_correction=True corrects the approximation of a bidirectional model's "
                "prefix / dual cache; a block-diffusion model's cache of finished blocks is exact (the ratio is 1 up "
                "to float rounding), so there is nothing to correct. Leave it False."
            )

    def sample_states(self, prompt_ids, prompt_mask, output, generator, mask_seed_generator):
        """The trajectory the batch carries: the rollout's record plus the states the loss will score — the
        weighted timestep draw of Alg. 2 (``generator``, right after the rollout) and each row's ``mask_seed``.

        Returns ``(trajectory, (sum, count))`` of the sampled steps' uncertainty ``P_t`` (a metric)."""
        args = self.args
        num_steps = int(output.num_steps.max().item()) if output.num_steps.numel() else 0
        uncertainty, has_tokens = step_uncertainty(
            output.commit_step, output.commit_prob, output.completion_mask, max(num_steps, 1)
        )
        sampled = sample_timesteps(uncertainty, has_tokens, args.num_sampled_timesteps, args.timestep_temperature,
                                   generator)
        sampled_weight = uncertainty.gather(1, sampled.clamp_min(0))[sampled != INVALID_STEP]
        rows = output.completion_ids.shape[0]
        mask_seed = torch.randint(0, 2**62, (rows,), generator=mask_seed_generator).to(prompt_ids.device)
        trajectory = {
            **rollout_entries(prompt_ids, prompt_mask, output),
            "sampled_steps": estimator_steps(
                args.policy_estimator, sampled, output.completion_mask, mask_seed, args.complementary_masking
            ),
            "mask_seed": mask_seed,
        }
        trajectory["rollout_commit_prob"] = output.commit_prob  # μ(a), against which the mismatch is measured
        if output.topk_ids is not None:  # the behaviour distribution, when the loss asked for it (record_topk)
            trajectory.update(rollout_topk_ids=output.topk_ids, rollout_topk_logps=output.topk_logps)
        return trajectory, (sampled_weight.sum(), float(sampled_weight.numel()))

    # ------------------------------------------------------------------------------------------------ states
    def state_inputs(self, batch, rows, j, mask_token_id):
        """``(prompt_ids, prompt_mask, completion state)`` of state ``j`` of ``rows`` (:func:`estimator_state`)."""
        seed = batch.get("mask_seed")
        prompt_ids, state = estimator_state(
            self.args.policy_estimator,
            rollout_ids=batch["rollout_ids"][rows],
            commit_step=batch["commit_step"][rows],
            valid_mask=batch["valid_mask"][rows],
            step=batch["sampled_steps"][rows, j],
            prompt_ids=batch["rollout_prompt_ids"][rows],
            prompt_mask=batch["rollout_prompt_mask"][rows],
            mask_token_id=mask_token_id,
            mask_seed=None if seed is None else seed[rows],
            prompt_mask_prob=self.args.prompt_mask_prob,
        )
        return prompt_ids, batch["rollout_prompt_mask"][rows], state

    def state_candidates(self, batch, rows, j, block_size=None):
        """(rows, G) bool: the positions of state ``j`` whose log-prob a term may read (a superset of its targets,
        which for RLDF are only known once π_old is scored), so scoring passes run the LM head there only."""
        seed = batch.get("mask_seed")
        return estimator_candidates(
            self.args.policy_estimator,
            commit_step=batch["commit_step"][rows],
            valid_mask=batch["valid_mask"][rows],
            step=batch["sampled_steps"][rows, j],
            mask_seed=None if seed is None else seed[rows],
            block_size=block_size,
        )

    def candidate_mask(self, batch, block_size):
        """(B, k, G): every position that can be a target of each sampled state."""
        rows = torch.arange(batch["sampled_steps"].shape[0], device=batch["sampled_steps"].device)
        return torch.stack([self.state_candidates(batch, rows, j, block_size)
                            for j in range(batch["sampled_steps"].shape[1])], dim=1)

    def target_mask(self, batch, old_logps, block_size):
        """Ô_t (B, k, G) of every sampled state (the estimator's targets); empty for padding steps. Estimators with
        per-token weights (random masking) also store ``batch["target_weight"]`` (B, k, G)."""
        sampled = batch["sampled_steps"]
        masks, weights = [], []
        for j in range(sampled.shape[1]):
            targets, weight = estimator_targets(
                self.args.policy_estimator,
                commit_step=batch["commit_step"],
                valid_mask=batch["valid_mask"],
                step=sampled[:, j],
                mask_seed=batch.get("mask_seed"),
                clean_prob=None if old_logps is None else old_logps[:, j].exp(),
                clean_threshold=self.args.clean_target_threshold,
                block_size=block_size,
            )
            masks.append(targets)
            weights.append(weight)
        if weights and weights[0] is not None:
            batch["target_weight"] = torch.stack(weights, dim=1)
        return torch.stack(masks, dim=1)

    @property
    def targets_need_old_policy(self) -> bool:
        """Whether the targets read π_old (RLDF's clipped clean targets); the other estimators' do not."""
        return self.args.policy_estimator == "rldf"

    def drop_rows(self, batch, rows: torch.Tensor) -> None:
        """Rows that teach nothing keep their shape but lose every sampled state."""
        batch["sampled_steps"] = batch["sampled_steps"].masked_fill(rows.unsqueeze(1), INVALID_STEP)

    # --------------------------------------------------------------------------------------------- scoring
    def _packs(self, model) -> bool:
        return self.packs_block_states and diffusion_block_size(model) is not None

    def score_for_policy_pass(self, model, batch, batch_size=None, old_pass=False):
        """TRL's reference / old-policy passes: ``(log-probs (B, k, G), extra batch entries)``. The old-policy pass
        also reads the sampler-consistent ``log π_old`` at the recorded targets (``sampling_logps_key``) from the same
        forwards: the training side of the rollout–training mismatch."""
        with torch.no_grad():
            if old_pass and self.measures_mismatch(batch):
                logps, sampling = self.score_states(model, batch, batch_size=batch_size, with_sampling=True)
                return logps, {self.sampling_logps_key: sampling}
            return self.score_states(model, batch, batch_size=batch_size), {}

    def measures_mismatch(self, batch) -> bool:
        """Whether the batch's sampled states replay its rollout and carry the record ``μ(a)``
        (:mod:`dllm_trl.losses.rollout_mismatch`)."""
        return self.args.policy_estimator in REPLAYING_ESTIMATORS and "rollout_commit_prob" in batch

    def _sampling_view(self, model, at, targets):
        """:func:`sampling_logps_view` with the settings of the sampler that made the rollout."""
        cfg = self.sampling_settings()
        return sampling_logps_view(at, targets, diffusion_config(model).mask_token_id, cfg.temperature, cfg.top_p,
                                   cfg.top_k, cfg.min_p)

    def score_states(self, model, batch, step_index=None, batch_size=None, with_sampling=False):
        """(B, k, G) log-probs of ``rollout_ids`` at each sampled state at its candidates (zeros elsewhere); with
        ``with_sampling`` also the sampler-consistent log-probs at the recorded targets (B, k, G), same forwards."""
        if step_index is None and self._packs(model):
            return self._packed_scores(model, batch, batch_size, with_sampling)
        sampled = batch["sampled_steps"]
        rows, k = sampled.shape
        out = torch.zeros(rows, k, batch["rollout_ids"].shape[1], device=sampled.device)
        sampling = torch.zeros_like(out) if with_sampling else None
        recorded = self.recorded_targets(batch) if with_sampling else None
        mask_id = diffusion_config(model).mask_token_id
        chunk = batch_size or rows
        for j in range(k) if step_index is None else [step_index]:
            active = (sampled[:, j] != INVALID_STEP).nonzero().squeeze(1)
            for part in active.split(chunk) if active.numel() else ():
                prompt_ids, prompt_mask, state = self.state_inputs(batch, part, j, mask_id)
                read = self.state_candidates(batch, part, j, diffusion_block_size(model))
                ids = batch["rollout_ids"][part]
                view = None if sampling is None else self._sampling_view_at(model, read, recorded[part, j], ids)
                values = completion_token_logps(model, prompt_ids, prompt_mask, state, ids, read_mask=read,
                                                extra_view=view)
                if sampling is None:
                    out[part, j] = values
                else:
                    out[part, j], sampling[part, j] = values
        return out if sampling is None else (out, sampling)

    def recorded_targets(self, batch) -> torch.Tensor:
        """(B, k, G): the tokens each sampled state's rollout step committed (:func:`recorded_targets`)."""
        return recorded_targets(batch["commit_step"], batch["valid_mask"], batch["sampled_steps"])

    def _sampling_view_at(self, model, read, recorded, ids):
        """The sampling view of a forward that reads ``read`` (rows, G) of ``ids``, at the ``recorded`` positions."""
        rows, columns = read.nonzero(as_tuple=True)
        return self._sampling_view(model, recorded[rows, columns], ids[rows, columns])

    def loss_chunks(self, model, inputs, steps: list[int]) -> list[list[int]]:
        """The sampled-step indices grouped into forwards (each followed by its backward under per-step backward):
        one per step, or for a block-diffusion model as many per packed forward as :func:`states_per_forward`
        allows."""
        if not self._packs(model):
            return [[j] for j in steps]
        width = states_per_forward(
            inputs["rollout_prompt_ids"].shape[1], inputs["rollout_ids"].shape[1], diffusion_block_size(model)
        )
        return [steps[i : i + width] for i in range(0, len(steps), width)]

    def packed_state_logps(self, model, batch, rows, steps, read, with_entropy=False, entropy_grad=True, call=None,
                           sampling_at=None):
        """``log π(o_i | q, o_t)`` (len(rows), len(steps), G) at ``read`` for the sampled steps ``steps`` of
        ``rows``: one forward over the prompt, the clean completion and each state's noisy block (SPEC §7).
        ``with_entropy``: also the entropy there (without gradient unless ``entropy_grad``). ``call``: the loss call
        the forward belongs to (None in the scoring passes), for :meth:`observe_loss_forward`. ``sampling_at``
        (like ``read``): also the sampler-consistent log-probs there, returned last."""
        config = diffusion_config(model)
        shift = 1 if getattr(config, "diffusion_logit_shift", False) else 0
        rollout_ids = batch["rollout_ids"][rows]
        packed = pack_sampled_states(
            batch["rollout_prompt_ids"][rows], batch["rollout_prompt_mask"][rows], rollout_ids,
            batch["commit_step"][rows], batch["sampled_steps"][rows][:, steps], diffusion_block_size(config),
            config.mask_token_id, attention_mask_dtype(model),
        )
        read_rows, read_columns, index = packed_read_positions(packed, read, shift)
        observed = contextlib.nullcontext() if call is None else self.observe_loss_forward(
            model, batch, rows, steps, packed, read, call
        )
        targets = rollout_ids[index[0], index[2]]
        view = None if sampling_at is None else self._sampling_view(model, sampling_at[index], targets)
        with observed:
            values = chunked_token_logps_at(
                model, read_rows, read_columns, targets, with_entropy=with_entropy, entropy_grad=entropy_grad,
                extra_view=view,
                input_ids=packed.input_ids, attention_mask=packed.attention_mask, position_ids=packed.position_ids,
            )
        scatter = lambda v: torch.zeros(read.shape, dtype=v.dtype, device=v.device).index_put(index, v)  # noqa: E731
        return tuple(scatter(v) for v in values) if isinstance(values, tuple) else scatter(values)

    def observe_loss_forward(self, model, batch, rows, steps, packed, read, call: LossCall):
        """A context entered around each packed loss forward (``packed``: its layout; ``read`` (len(rows), len(steps),
        G): the positions it scores) through which a subclass reads what the model computes there into ``call.extra``
        (:class:`~dllm_trl.losses.RoutingDriftMixin`: the experts each token is routed to). Nothing here."""
        return contextlib.nullcontext()

    def _packed_scores(self, model, batch, batch_size=None, with_sampling=False):
        sampled = batch["sampled_steps"]
        rows, k = sampled.shape
        out = torch.zeros(rows, k, batch["rollout_ids"].shape[1], device=sampled.device)
        sampling = torch.zeros_like(out) if with_sampling else None
        recorded = self.recorded_targets(batch) if with_sampling else None
        every = torch.arange(rows, device=sampled.device)
        block_size = diffusion_block_size(model)
        read = torch.stack([self.state_candidates(batch, every, j, block_size) for j in range(k)], dim=1)
        live = (sampled != INVALID_STEP).any(1).nonzero().squeeze(1)
        for part in live.split(batch_size or rows) if live.numel() else ():
            for steps in self.loss_chunks(model, batch, list(range(k))):
                at = (part.unsqueeze(1), torch.tensor(steps, device=part.device))
                values = self.packed_state_logps(model, batch, part, steps, read[part][:, steps],
                                                 sampling_at=None if sampling is None else recorded[at])
                if sampling is None:
                    out[at] = values
                else:
                    out[at], sampling[at] = values
        return out if sampling is None else (out, sampling)

    # ------------------------------------------------------------------------------------------------ loss
    def begin(self, inputs, normalizer, beta, epsilon_low, epsilon_high, count_targets=False) -> LossCall:
        """The shared state of one loss call over ``inputs``."""
        shape = inputs["target_mask"].shape
        kl = torch.zeros(shape, device=inputs["target_mask"].device)
        entropy = torch.zeros_like(kl) if self.logs_ppo_terms else None
        call = LossCall(normalizer, beta, epsilon_low, epsilon_high, kl, torch.ones_like(kl), entropy, count_targets)
        if self.measures_mismatch(inputs) and self.sampling_logps_key not in inputs:
            # No old-policy pass: the loss forward is π_old's (on-policy), so the mismatch is read from it.
            call.sampling_logps = torch.zeros_like(kl)
            call.sampling_scored = torch.zeros(shape, dtype=torch.bool, device=kl.device)
        return call

    def normalizer(self, inputs, accumulation: int, share: float) -> torch.Tensor:
        """Per-(row, step) weight of a target token's term, so that summing gives Eq. 10 / Eq. 13.

        ``token``: every target token of the generation batch weighs the same (TRL's ``dapo`` convention: global
        count, ``share`` = processes × generation batch / accumulation steps). ``sample``: ``1/(|Ô_t| |S_b|)`` per
        token, averaged over the micro-batch's completions and the ``accumulation`` steps (TRL's ``grpo``).
        """
        targets, sampled = inputs["target_mask"], inputs["sampled_steps"]
        pending = "targets_pending" in inputs  # targets fixed in the loss forward: counts applied later
        if self.args.loss_normalization == "token":
            count = 1.0 if pending else inputs["num_target_tokens"].clamp(min=1.0)
            return torch.full(sampled.shape, share, device=sampled.device) / count
        if pending:  # the 1/|Ô_t| factor is applied by step_loss
            per_step = torch.ones(sampled.shape, device=sampled.device)
        else:
            weighted = targets.sum(-1) if "target_weight" not in inputs else inputs["target_weight"].sum(-1)
            per_step = weighted.clamp(min=1)
        steps = (sampled != INVALID_STEP).sum(-1, keepdim=True).clamp(min=1)
        return 1.0 / (per_step * steps * sampled.shape[0] * accumulation)

    def chunk_loss(self, model, inputs, steps, call: LossCall):
        """:meth:`step_loss` summed over ``steps``; their log-probs come from one packed forward when packing."""
        if not self._packs(model):
            (j,) = steps
            return self.step_loss(model, inputs, j, call)
        sampled = inputs["sampled_steps"]
        rows = (sampled[:, steps] != INVALID_STEP).any(1).nonzero().squeeze(1)
        at = (rows.unsqueeze(1), torch.tensor(steps, device=rows.device))
        read = inputs["target_mask"][at]
        measured = None if call.sampling_logps is None else self.recorded_targets(inputs)[at] & read
        values = self.packed_state_logps(model, inputs, rows, steps, read, with_entropy=True,
                                         entropy_grad=self.args.entropy_coef != 0.0, call=call, sampling_at=measured)
        logps, entropy = values[:2]
        if measured is not None:
            call.sampling_logps[at] = torch.where(measured, values[2], call.sampling_logps[at])
            call.sampling_scored[at] |= measured
        where = torch.full((sampled.shape[0],), -1, dtype=torch.long, device=rows.device)
        where[rows] = torch.arange(rows.numel(), device=rows.device)
        loss = 0.0
        for n, j in enumerate(steps):
            active = (sampled[:, j] != INVALID_STEP).nonzero().squeeze(1)
            scored = (logps[where[active], n], entropy[where[active], n])
            loss = loss + self.step_loss(model, inputs, j, call, scored=scored)
        return loss

    def step_loss(self, model, inputs, j, call: LossCall, scored=None):
        """Weighted sum of the per-token terms of sampled step ``j`` over the rows that have one (``scored``: their
        ``(log-probs, entropies)`` at the state's read positions, when a packed forward computed them)."""
        args = self.args
        sampled = inputs["sampled_steps"]
        active = (sampled[:, j] != INVALID_STEP).nonzero().squeeze(1)
        read = inputs["target_mask"][active, j]
        if scored is None:
            mask_id = diffusion_config(model).mask_token_id
            prompt_ids, prompt_mask, state = self.state_inputs(inputs, active, j, mask_id)
            ids = inputs["rollout_ids"][active]
            measured = None if call.sampling_logps is None else self.recorded_targets(inputs)[active, j] & read
            view = None if measured is None else self._sampling_view_at(model, read, measured, ids)
            scored = completion_token_logps(model, prompt_ids, prompt_mask, state, ids, read_mask=read,
                                            with_entropy=True, entropy_grad=args.entropy_coef != 0.0, extra_view=view)
            if measured is not None:
                call.sampling_logps[active, j] = scored[2]
                call.sampling_scored[active, j] = measured
        logps, entropy = scored[:2]
        targets = read
        if "targets_pending" in inputs:  # on-policy: Ô_t from this very forward (π_θ = π_old, detached)
            targets = read & clean_target_mask(inputs["commit_step"][active], inputs["valid_mask"][active],
                                               sampled[active, j], logps.detach().exp(), args.clean_target_threshold)
            inputs["target_mask"][active, j] = targets
            if call.count_targets:
                call.new_target_count = call.new_target_count + targets.sum()
        old_all, ref_all = inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps")
        old = None if old_all is None else old_all[active, j]
        terms, ratio = policy_token_terms(logps, inputs["advantages"][active], old, call.epsilon_low, call.epsilon_high,
                                          delta=args.delta)
        if "importance_sampling_ratio" in inputs:  # TRL's correction of the rollout–training mismatch
            terms = terms * inputs["importance_sampling_ratio"][active, j]
        if call.beta != 0.0:
            step_kl = corrected_k3_kl(logps, ref_all[active, j], old, args.use_bias_correction_kl)
            terms = terms + call.beta * step_kl
            call.kl[active, j] = step_kl.detach()
        if args.entropy_coef != 0.0:  # as TRL: an entropy bonus per target token
            terms = terms - args.entropy_coef * entropy
        call.entropy[active, j] = entropy.detach()
        if ratio is not None:
            call.ratio[active, j] = ratio.detach()
        weights = call.normalizer[active, j].unsqueeze(-1)
        if "target_weight" in inputs:
            weights = weights * inputs["target_weight"][active, j]
        if "targets_pending" in inputs and args.loss_normalization == "sample":
            weights = weights / targets.sum(-1, keepdim=True).clamp(min=1)  # the 1/|Ô_t| of Eq. 10
        return (terms * targets * weights).sum()

    def stand_in(self, inputs) -> dict:
        """A one-row, one-state copy of ``inputs`` on which any pass of this loss makes exactly the module calls, in
        the same order, of one of its forwards on a real state (SPEC §9): the first row (copied, so that nothing a
        pass writes reaches ``inputs``), its state 0 (a state of every estimator and of every rollout, dropped rows
        included) with the first completion position as its only target, and a zero advantage. A subclass whose
        batch holds values that a dropped row leaves out of range makes them valid here."""
        rows = inputs["sampled_steps"].shape[0]
        batch = {key: value[:1].clone() if torch.is_tensor(value) and value.dim() and value.shape[0] == rows else value
                 for key, value in inputs.items()}
        batch["sampled_steps"] = torch.zeros(1, 1, dtype=inputs["sampled_steps"].dtype,
                                             device=inputs["sampled_steps"].device)
        if "target_mask" in batch:
            batch["target_mask"].zero_()
            batch["target_mask"][0, 0, 0] = True
        if "advantages" in batch:
            batch["advantages"].zero_()
        return batch

    def zero_loss(self, model, inputs, call: LossCall | None = None):
        """A zero that still flows through the model (DDP needs a graph) when no state has a target; also the idle
        partner of another process's loss chunk (SPEC §9). It is :meth:`chunk_loss` itself on :meth:`stand_in`, in a
        loss call of its own with zero weights and no KL (no metric, record or target count changes), times 0, so
        that it makes the calls of a real chunk (the head, the entropy, the sampler's view, a trust region's support)
        in their order, whatever the objective."""
        batch = self.stand_in(inputs)
        normalizer = torch.zeros(batch["sampled_steps"].shape, device=batch["sampled_steps"].device)
        low, high = (0.0, 0.0) if call is None else (call.epsilon_low, call.epsilon_high)
        own = self.begin(batch, normalizer, 0.0, low, high)
        records, self.records = getattr(self, "records", None), None  # a trust region's diagnostics: not this
        try:
            return self.chunk_loss(model, batch, [0], own) * 0.0
        finally:
            self.records = records

    # --------------------------------------------------------------------------------------------- metrics
    def metric_sums(self, inputs, call: LossCall) -> dict:
        """``name -> (numerator, denominator, skip_when_empty)`` summed over this process's tokens; the trainer
        adds them over processes and logs ``numerator / max(denominator, 1)`` (skipped where the denominator is 0
        and ``skip_when_empty``)."""
        targets, sampled = inputs["target_mask"], inputs["sampled_steps"]
        step_valid = sampled != INVALID_STEP
        steps = step_valid.sum().float()
        target_count = targets.sum().float()
        lengths = inputs["valid_mask"].bool().sum(-1, keepdim=True).float().clamp_min(1).expand_as(step_valid)
        utility = (targets.sum(-1).float() / lengths * step_valid).sum()
        rows = torch.tensor(float(step_valid.shape[0]), device=steps.device)
        sums = {
            "rldf/target_tokens_per_step": (target_count, steps, False),
            "rldf/token_utility": (utility, steps, False),
            "rldf/sampled_steps": (steps, rows, False),
        }
        if call.entropy is not None:  # TRL's metric: mean entropy of the tokens the loss reads
            sums["entropy"] = ((call.entropy * targets).sum(), target_count, True)
        if call.beta != 0.0:
            sums["kl"] = ((call.kl * targets).sum(), target_count, True)
        if self.logs_ppo_terms and "old_per_token_logps" in inputs:  # PPO clipping happened
            adv = inputs["advantages"].view(-1, 1, 1)
            low = ((call.ratio < 1 - call.epsilon_low) & (adv < 0) & targets).sum().float()
            high = ((call.ratio > 1 + call.epsilon_high) & (adv > 0) & targets).sum().float()
            sums["clip_ratio/low_mean"] = (low, target_count, False)
            sums["clip_ratio/high_mean"] = (high, target_count, False)
            sums["clip_ratio/region_mean"] = (low + high, target_count, False)
        sums.update(self._mismatch(inputs, call)[0])
        return sums

    def metric_extremes(self, inputs, call: LossCall) -> dict:
        """``name -> (value or None, "max" | "min")`` of this process's tokens; the trainer takes the maximum /
        minimum over processes (the ``sampling/*`` extremes)."""
        return self._mismatch(inputs, call)[1]

    def _mismatch(self, inputs, call: LossCall) -> tuple[dict, dict]:
        """The ``sampling/*`` metrics (:func:`mismatch_metrics`) at the recorded targets of this call's states, from
        the old-policy pass when it ran, else from the loss forward (π_old on-policy)."""
        if not self.measures_mismatch(inputs):
            return {}, {}
        scored = self.recorded_targets(inputs) & inputs["target_mask"]
        if self.sampling_logps_key in inputs:
            train_logps = inputs[self.sampling_logps_key]
        elif call.sampling_logps is not None:
            train_logps, scored = call.sampling_logps, scored & call.sampling_scored
        else:
            return {}, {}
        return mismatch_metrics(train_logps, record_logps(inputs["rollout_commit_prob"]), scored,
                                inputs.get("importance_sampling_ratio"),
                                sequence=self.args.rollout_importance_sampling_mode.startswith("sequence"))

    def correct_rollout_mismatch(self, model, batch, batch_size=None) -> None:
        """``batch["importance_sampling_ratio"]``: TRL's corrected ratio ``ρ`` (B, k, G) of
        ``args.rollout_importance_sampling_*`` (:func:`~dllm_trl.losses.rollout_mismatch.importance_sampling_ratio`).

        As TRL does for its vLLM correction, π_old is scored for every batch, so that ``ρ`` is known before the first
        loss forward: when TRL's old-policy pass did not run (on-policy), the same pass runs here (``model``), and
        its log-probs become the batch's ``old_per_token_logps``.
        """
        if "old_per_token_logps" not in batch:
            logps, extra = self.score_for_policy_pass(model, batch, batch_size=batch_size, old_pass=True)
            batch["old_per_token_logps"] = logps
            batch.update(extra)
        if not self.measures_mismatch(batch) or self.sampling_logps_key not in batch:
            raise RuntimeError("rollout_importance_sampling_correction needs the rollout's record and the old-policy "
                               f"pass's {self.sampling_logps_key!r} in the batch.")
        args = self.args
        batch["importance_sampling_ratio"] = importance_sampling_ratio(
            batch[self.sampling_logps_key], record_logps(batch["rollout_commit_prob"]), self.recorded_targets(batch),
            args.rollout_importance_sampling_mode, args.rollout_importance_sampling_clip_min,
            args.rollout_importance_sampling_clip_max,
        )
