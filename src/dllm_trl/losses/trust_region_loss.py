"""The (predictive) divergence trust-region losses (paper 2, SPEC §3) as loss objects.

Loss (paper Eq. 13): ``−Σ M · w · A · log π_θ(a)`` with the truncated importance weight
``w = stopgrad(min(π_θ(a)/μ(a), C))`` and the keep-mask ``M = NOT(D(μ‖π_θ) > δ AND direction)``, plus ``β`` · k3-KL
to the reference. ``μ`` is the behaviour distribution, kept as its top-K plus ``μ(a)``; the mask math is
:mod:`dllm_trl.losses.divergence_masks`. ``π_θ`` is scored as the sampler draws (logits / T, the mask token
excluded on diffusion LMs), so it compares like with like against ``μ``.

* :class:`CausalTrustRegionLoss`: causal LMs (the paper's setting); ``μ`` captured during generation
  (:class:`~dllm_trl.generation.BehaviourCapture`), terms aggregated with TRL's ``loss_type``.
* :class:`DiffusionTrustRegionLoss`: RLDF's sampled states and targets ``Ô_t`` (:class:`RLDFLoss`) with the masked
  policy gradient as the per-token term. Tokens committed at the sampled step take ``μ`` from the rollout record
  (KV-cache approximation included), the other targets from ``π_old(· | q, o_t)`` — stored by the old-policy pass,
  or the current policy itself on an on-policy batch. ``behaviour_source="old"`` takes every ``μ`` from ``π_old``;
  only then may ``rollout_importance_sampling_correction`` multiply the terms by TRL's ratio ``π_old/μ`` of the
  recorded tokens (the decoupled form; :mod:`dllm_trl.losses.rollout_mismatch`).
"""

from __future__ import annotations

import torch

from ..models.bidirectional import diffusion_block_size, diffusion_config
from ..models.engines import apply_at
from ..models.scoring import state_canvas
from .divergence_masks import (
    directional_derivative,
    divergence,
    masked_policy_gradient_terms,
    support_log_probs,
    trust_region_mask,
    truncated_view,
)
from .rldf_terms import INVALID_STEP, corrected_k3_kl, noisy_state
from .rldf_loss import LossCall, RLDFLoss

MASK_PARTS = ("keep", "div", "direction", "log_ratio", "weights", "from_rollout")
"""Per-token mask quantities kept for the metrics (and the study records)."""


class TrustRegionTerms:
    """The masked terms and their metrics, shared by the causal and the diffusion trust-region losses.

    ``records``: set to a list to keep the per-token mask tensors of every loss call (the trust-region study).
    """

    records: list | None = None

    def __init__(self, args, vocab_size: int, temperature: float):
        self.args = args
        self.vocab_size = vocab_size  # sampleable tokens: the uniform-tail estimator spreads the tail over them
        self.score_temperature = temperature if temperature > 0 else 1.0  # the sampler's softmax(logits / T)

    def masked_terms(self, pi_support, mu_ids, mu_logps, action, mu_action_logps, advantages):
        """Per-token ``−M · w · A · log π_θ(a)`` and the detached mask quantities (SPEC §3).

        ``pi_support`` (…, K+1): log π_θ at ``[topK(μ) ids, a]`` (with gradient; slot K is log π_θ(a)).
        """
        args = self.args
        mu_action_logps = mu_action_logps.detach().float()
        view = truncated_view(
            mu_ids, mu_logps.detach(), action, mu_action_logps, pi_support.detach(),
            vocab_size=self.vocab_size, binary=mu_ids.shape[-1] == 0,
        )
        div = divergence(view, args.divergence)
        direction = directional_derivative(view, args.divergence, args.tail_estimator)
        log_ratio = pi_support[..., -1].detach().float() - mu_action_logps
        keep = trust_region_mask(
            args.mask_rule, advantages=advantages, log_ratio=log_ratio, div=div, direction=direction,
            delta=args.divergence_threshold, delta_low=args.divergence_threshold_low,
            delta_high=args.divergence_threshold_high,
        )
        terms, weights = masked_policy_gradient_terms(pi_support[..., -1], mu_action_logps, advantages, keep,
                                                      args.is_cap)
        parts = {"keep": keep, "div": div, "direction": direction, "log_ratio": log_ratio, "weights": weights}
        return terms, parts

    @staticmethod
    def mask_buffers(shape, device) -> dict:
        """Per-target buffers (B, k, G) of the mask quantities (:data:`MASK_PARTS`) that the step terms fill."""
        return {
            "keep": torch.ones(shape, dtype=torch.bool, device=device),
            "div": torch.zeros(shape, device=device),
            "direction": torch.zeros(shape, device=device),
            "log_ratio": torch.zeros(shape, device=device),
            "weights": torch.ones(shape, device=device),
            "from_rollout": torch.zeros(shape, dtype=torch.bool, device=device),
        }

    def target_mask_metric_sums(self, inputs, call) -> dict:
        """:meth:`mask_metric_sums` over the targets of the sampled states of a diffusion batch."""
        advantages = inputs["advantages"].view(-1, 1, 1).expand(inputs["target_mask"].shape)
        return self.mask_metric_sums(inputs["target_mask"], advantages, **call.extra)

    def kl_and_parts(self, call, inputs, at, terms, parts, action_logps, old_logps):
        """``terms`` plus ``β`` · k3 KL to the reference at the target positions ``at`` = (rows, steps, columns), with
        the KL and the mask ``parts`` stored in ``call`` for the metrics."""
        if call.beta != 0.0:
            step_kl = corrected_k3_kl(action_logps, inputs["ref_per_token_logps"][at], old_logps,
                                      self.args.use_bias_correction_kl)
            terms = terms + call.beta * step_kl
            call.kl[at] = step_kl.detach()
        for name, value in parts.items():
            call.extra[name][at] = value.detach().to(call.extra[name].dtype)
        return terms

    def stand_in(self, inputs) -> dict:
        """The loss's stand-in (:meth:`RLDFLoss.stand_in`) with π_old's top-K ids, which a dropped row leaves unset
        (-1), made valid token ids."""
        batch = super().stand_in(inputs)
        if "old_topk_ids" in batch:
            batch["old_topk_ids"] = batch["old_topk_ids"].clamp_min(0)
        return batch

    def record(self, loss_mask, **tensors):
        if self.records is None:
            return
        m = loss_mask.bool()
        self.records.append({name: value.detach()[m].cpu() for name, value in tensors.items()})

    def mask_metric_sums(self, loss_mask, advantages, keep, div, direction, log_ratio, weights, from_rollout):
        """``dppo/*`` metrics as ``name -> (numerator, denominator, skip_when_empty)`` over ``loss_mask``."""
        m = loss_mask.bool()
        masked = ~keep & m
        pos, neg = m & (advantages > 0), m & (advantages < 0)
        disagree = (torch.sign(direction) != torch.sign(log_ratio)) & m
        # Where the choice of direction changes the decision: outside the trust region, and the two disagree.
        args = self.args
        low = args.divergence_threshold if args.divergence_threshold_low is None else args.divergence_threshold_low
        high = args.divergence_threshold if args.divergence_threshold_high is None else args.divergence_threshold_high
        outside = div > torch.where(advantages > 0, high, low)
        decisions_differ = outside & ((advantages * direction > 0) != (advantages * torch.sign(log_ratio) > 0)) & m
        zero = torch.zeros((), device=m.device)
        n = m.sum().float()
        rollout = (from_rollout & m).sum().float()
        return {
            "dppo/masked_frac": (masked.sum().float(), n, False),
            "dppo/masked_frac_pos": ((masked & pos).sum().float(), pos.sum().float(), False),
            "dppo/masked_frac_neg": ((masked & neg).sum().float(), neg.sum().float(), False),
            "dppo/divergence_mean": (torch.where(m, div.float(), zero).sum(), n, False),
            "dppo/direction_disagree_frac": (disagree.sum().float(), n, False),
            "dppo/is_weight_mean": (torch.where(m, weights.float(), zero).sum(), n, False),
            "dppo/mu_from_rollout": (rollout, n, False),
            "dppo/mu_from_old": (n - rollout, n, False),
            "dppo/mask_disagree_frac": (decisions_differ.sum().float(), n, False),
        }


class CausalTrustRegionLoss(TrustRegionTerms):
    """The trust-region loss of a causal LM on TRL's batch plus the captured behaviour top-K
    (``behaviour_topk_ids`` / ``behaviour_topk_logps`` (B, C, K), ``behaviour_logps`` (B, C))."""

    def compute(self, model, inputs, *, beta, loss_type, accumulation, num_processes, steps_per_generation,
                max_completion_length, training, autocast):
        """``(loss, metric sums)`` of a micro-batch; ``π_θ`` at the completion tokens only, chunk by chunk, so memory
        grows with tokens × K, not tokens × V."""
        args = self.args
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        loss_mask = mask.bool()
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        top_k = args.divergence_top_k
        mu_ids = inputs["behaviour_topk_ids"][..., :top_k].long()
        mu_logps = inputs["behaviour_topk_logps"][..., :top_k]
        mu_action = inputs["behaviour_logps"]
        rows, columns = loss_mask.nonzero(as_tuple=True)

        def view(hidden, head):
            return support_log_probs(hidden, head, mu_ids[rows, columns], completion_ids[rows, columns],
                                     temperature=self.score_temperature)

        with autocast():
            support = apply_at(model, rows, columns + prompt_ids.shape[1] - 1, view, input_ids=input_ids,
                               attention_mask=attention_mask, use_cache=False).support
        pi_support = support.new_zeros(*mu_ids.shape[:-1], top_k + 1).index_put((rows, columns), support)
        advantages = inputs["advantages"]
        advantages = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).expand_as(mu_action)
        terms, parts = self.masked_terms(pi_support, mu_ids, mu_logps, completion_ids, mu_action, advantages)
        logps = pi_support[..., -1]
        if beta != 0.0:
            per_token_kl = corrected_k3_kl(logps, inputs["ref_per_token_logps"], inputs.get("old_per_token_logps"),
                                           args.use_bias_correction_kl)
            terms = terms + beta * per_token_kl
        terms = torch.where(loss_mask, terms, 0.0)
        loss = aggregate(terms, mask, loss_type, accumulation=accumulation, num_processes=num_processes,
                         steps_per_generation=steps_per_generation, max_completion_length=max_completion_length,
                         num_items_in_batch=inputs.get("num_items_in_batch"), training=training)
        from_rollout = torch.ones_like(loss_mask)
        sums = {}
        if beta != 0.0:
            sums["kl"] = (torch.where(loss_mask, per_token_kl.detach(), 0.0).sum(), mask.sum().float(), False)
        sums.update(self.mask_metric_sums(loss_mask, advantages, from_rollout=from_rollout, **parts))
        self.record(loss_mask, mu_ids=mu_ids, mu_logps=mu_logps, mu_action_logps=mu_action, pi_support=pi_support,
                    action=completion_ids, advantages=advantages, from_rollout=from_rollout, **parts)
        return loss, sums


def aggregate(per_token_loss, mask, loss_type, *, accumulation, num_processes, steps_per_generation,
              max_completion_length, num_items_in_batch, training):
    """TRL's ``loss_type`` normalisers (grpo / bnpo / dr_grpo / dapo), gradient accumulation included."""
    mask = mask.float()
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length) / accumulation
    if loss_type == "dapo":
        normalizer = num_items_in_batch.clamp(min=1.0) / num_processes
        if training:
            normalizer = normalizer * accumulation / steps_per_generation
        return (per_token_loss * mask).sum() / normalizer
    raise ValueError(f"Unknown loss type: {loss_type}")


class DiffusionTrustRegionLoss(TrustRegionTerms, RLDFLoss):
    """RLDF's states and targets with the masked policy gradient per target token (SPEC §3.3)."""

    packs_block_states = False  # one state per forward: the support is gathered at the targets only
    targets_from_loss_forward = False  # μ of the other targets needs π_old's top-K: the old pass or this forward
    supported_estimators = ("rldf", "sequential")
    logs_ppo_terms = False
    sampling_logps_key = "old_behaviour_logps"  # the old pass's π_old(a), scored as the sampler draws

    def __init__(self, args, vocab_size: int, temperature: float | None, mask_token_id: int, logit_shift: int):
        """``temperature``: the sampler's, at which ``π`` is scored; ``None`` follows the sampler bound by
        :meth:`bind_sampler` (``args.temperature`` until then). A number must agree with that sampler."""
        self.fixed_temperature = temperature
        TrustRegionTerms.__init__(self, args, vocab_size, args.temperature if temperature is None else temperature)
        self.mask_token_id, self.logit_shift = mask_token_id, logit_shift

    def bind_sampler(self, config) -> None:
        """:meth:`RLDFLoss.bind_sampler`; ``π`` is then scored at the sampler's temperature. Refused: a ``temperature``
        given at construction that the sampler does not sample at, and, under
        ``rollout_importance_sampling_correction``, a truncating sampler (the forward scores the untruncated
        distribution, so ``π_old/μ`` would measure the truncation, not the cache)."""
        RLDFLoss.bind_sampler(self, config)
        if self.fixed_temperature is not None and self.fixed_temperature != config.temperature:
            raise ValueError(
                f"{type(self).__name__}(temperature={self.fixed_temperature}) but the sampler samples at temperature="
                f"{config.temperature}: μ is the sampler's distribution, so π must be scored at its temperature. Pass "
                "temperature=None (follow the sampler) or the sampler's value."
            )
        if self.args.rollout_importance_sampling_correction:
            truncating = {name: getattr(config, name) for name in ("top_p", "top_k", "min_p")
                          if getattr(config, name) not in (None, 0, 1.0)}
            if truncating:
                settings = ", ".join(f"{name}={value}" for name, value in truncating.items())
                raise ValueError(
                    f"rollout_importance_sampling_correction=True is not supported here: the sampler's {settings} "
                    "truncates, and the trust-region forward scores the untruncated distribution, so π_old/μ would "
                    "measure the truncation, not the cache. Sample untruncated or leave the correction off."
                )
        self.score_temperature = config.temperature if config.temperature > 0 else 1.0

    @property
    def record_topk(self) -> int:
        return max(self.args.divergence_top_k, 1)

    def score_for_policy_pass(self, model, batch, batch_size=None, old_pass=False):
        """The old-policy pass also keeps π_old's sampler-consistent top-K and ``μ(a)`` from the same forward."""
        if not old_pass:
            return super().score_for_policy_pass(model, batch, batch_size)
        with torch.no_grad():
            scores = self._score_sampled_states(model, batch, batch_size=batch_size)
        return scores.pop("logps"), scores

    def support_at(self, model, batch, rows, j, positions, support_ids, own_topk=0, use_own=None):
        """:func:`~dllm_trl.losses.divergence_masks.support_log_probs` of ``π(· | q, o_t)`` (state ``j`` of ``rows``)
        at completion ``positions = (row index into rows, column)``: the sampler's distribution at
        ``[support_ids..., a]``, computed only there and chunk by chunk."""
        state = noisy_state(batch["rollout_ids"][rows], batch["commit_step"][rows], batch["sampled_steps"][rows, j],
                            self.mask_token_id)
        input_ids, attention_mask, prompt_width = state_canvas(
            diffusion_config(model), batch["rollout_prompt_ids"][rows], batch["rollout_prompt_mask"][rows], state,
            self.logit_shift,
        )
        index, columns = positions
        action = batch["rollout_ids"][rows][index, columns]

        def view(hidden, head):
            return support_log_probs(hidden, head, support_ids, action, temperature=self.score_temperature,
                                     excluded_id=self.mask_token_id, own_topk=own_topk, use_own=use_own)

        offset = prompt_width - self.logit_shift
        return apply_at(model, index, columns + offset, view, input_ids=input_ids, attention_mask=attention_mask,
                        use_cache=False)

    def _score_sampled_states(self, model, batch, batch_size=None):
        """No-grad old-policy pass over every sampled ``o_t`` at its candidates: RLDF's ``logps`` (B, k, G) and,
        sampler-consistent, ``old_topk_ids`` int32 / ``old_topk_logps`` (B, k, G, K) and ``old_behaviour_logps``
        (B, k, G). Zeros (ids −1) elsewhere."""
        sampled = batch["sampled_steps"]
        rows, k = sampled.shape
        gen, device = batch["rollout_ids"].shape[1], sampled.device
        top_k = self.args.divergence_top_k
        out = {
            "logps": torch.zeros(rows, k, gen, device=device),
            "old_topk_ids": torch.full((rows, k, gen, top_k), -1, dtype=torch.int32, device=device),
            "old_topk_logps": torch.zeros(rows, k, gen, top_k, device=device),
            "old_behaviour_logps": torch.zeros(rows, k, gen, device=device),
        }
        chunk = batch_size or rows
        for j in range(k):
            active = (sampled[:, j] != INVALID_STEP).nonzero().squeeze(1)
            for part in active.split(chunk) if active.numel() else ():
                candidates = self.state_candidates(batch, part, j, diffusion_block_size(model))
                index, columns = candidates.nonzero(as_tuple=True)
                n = index.numel()
                view = self.support_at(
                    model, batch, part, j, (index, columns), torch.zeros(n, top_k, dtype=torch.long, device=device),
                    own_topk=top_k, use_own=torch.ones(n, dtype=torch.bool, device=device),
                )
                at = (part[index], j, columns)
                out["logps"][at] = view.raw_action
                out["old_topk_ids"][at] = view.own_ids.to(torch.int32)
                out["old_topk_logps"][at] = view.own_logps
                out["old_behaviour_logps"][at] = view.support[:, -1]
        return out

    def begin(self, inputs, normalizer, beta, epsilon_low, epsilon_high, count_targets=False) -> LossCall:
        call = super().begin(inputs, normalizer, beta, epsilon_low, epsilon_high, count_targets)
        call.extra = self.mask_buffers(inputs["target_mask"].shape, inputs["target_mask"].device)
        return call

    def step_loss(self, model, inputs, j, call: LossCall, scored=None):
        """Weighted sum over the rows that have sampled step ``j`` of the masked terms at its targets Ô_t. Only the
        targets go through the LM head."""
        args = self.args
        top_k = args.divergence_top_k
        sampled = inputs["sampled_steps"]
        active = (sampled[:, j] != INVALID_STEP).nonzero().squeeze(1)
        index, columns = inputs["target_mask"][active, j].nonzero(as_tuple=True)
        rows = active[index]
        t = sampled[rows, j]
        action = inputs["rollout_ids"][rows, columns]
        committed_now = inputs["commit_step"][rows, columns] == t
        from_rollout = committed_now & (args.behaviour_source == "rollout")
        roll_ids = inputs["rollout_topk_ids"][rows, columns, :top_k]
        roll_logps = inputs["rollout_topk_logps"][rows, columns, :top_k]
        roll_action = inputs["rollout_commit_prob"][rows, columns].float().clamp_min(1e-30).log()
        has_old = "old_topk_ids" in inputs
        if has_old:
            other_ids = inputs["old_topk_ids"][rows, j, columns].long()
            other_logps = inputs["old_topk_logps"][rows, j, columns]
        else:  # on-policy: π_old's top-K is this forward's own
            other_ids = torch.zeros_like(roll_ids)
        view = self.support_at(
            model, inputs, active, j, (index, columns), torch.where(from_rollout.unsqueeze(-1), roll_ids, other_ids),
            own_topk=0 if has_old else top_k, use_own=None if has_old else ~from_rollout,
        )
        pi_support = view.support
        logps = pi_support[..., -1]
        if not has_old:
            other_ids, other_logps = view.own_ids, view.own_logps
        keep_rollout = from_rollout.unsqueeze(-1)
        mu_ids = torch.where(keep_rollout, roll_ids, other_ids)
        mu_logps = torch.where(keep_rollout, roll_logps, other_logps)
        other_action = inputs["old_behaviour_logps"][rows, j, columns] if has_old else logps.detach()
        mu_action = torch.where(from_rollout, roll_action, other_action)
        advantages = inputs["advantages"][rows]
        terms, parts = self.masked_terms(pi_support, mu_ids, mu_logps, action, mu_action, advantages)
        if "importance_sampling_ratio" in inputs:  # TRL's correction π_old/μ of the recorded tokens (decoupled)
            terms = terms * inputs["importance_sampling_ratio"][rows, j, columns]
        if call.sampling_logps is not None:  # on-policy: this forward is π_old's, scored as the sampler draws
            call.sampling_logps[rows, j, columns] = logps.detach()
            call.sampling_scored[rows, j, columns] = committed_now
        parts["from_rollout"] = from_rollout
        old = inputs["old_per_token_logps"][rows, j, columns] if has_old else None
        terms = self.kl_and_parts(call, inputs, (rows, j, columns), terms, parts, view.raw_action, old)
        self.record(
            torch.ones_like(from_rollout), mu_ids=mu_ids, mu_logps=mu_logps, mu_action_logps=mu_action,
            pi_support=pi_support, action=action, advantages=advantages, **parts,
        )
        return (terms * call.normalizer[rows, j]).sum()

    def metric_sums(self, inputs, call: LossCall) -> dict:
        sums = super().metric_sums(inputs, call)
        sums.update(self.target_mask_metric_sums(inputs, call))
        return sums
