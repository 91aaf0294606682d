"""RLDF on DiffusionGemma's uniform-noise rollout (SPEC §2 on §8): trajectory → sampled steps → per-token terms.

A DiffusionGemma rollout (:class:`~dllm_trl.generation.DiffusionGemmaSampler`) draws, at every step ``n`` of every
canvas, ``y_{n,i} ~ π_θ(· | x_n, sc_n, T_n)`` at each position and keeps it on the accept set ``A_n``; the other
positions are re-noised with uniform tokens, which do not depend on θ. ``sc_n`` is the self-conditioning input: the
previous step's tempered logits (zeros at a canvas's first step), so it depends on θ through every earlier step of the
canvas. Given the accept sets, the log-likelihood of the recorded draws is ``Σ_n Σ_{i∈A_n} log π_θ(y_{n,i} | x_n, sc_n,
T_n)``; a position accepted at several steps counts once per step. :class:`DiffusionGemmaRLDFLoss` builds RLDF on
these per-step terms:

* **Weighted timestep sampling** (Alg. 2, Eq. 5–6): per row, over its recorded steps (the steps it was still
  denoising, in the canvases up to the one that finished its sequence), ``P_n = −mean_{i∈A_n} log π_old(y_{n,i})``
  from the rollout's record; ``k`` steps drawn without replacement from ``softmax(P / τ)``.
* **Targets** (``policy_estimator``): ``"sequential"`` — the accepted tokens ``A_n`` with their drawn tokens ``y``;
  ``"rldf"`` — those plus the **clipped clean target**: positions outside ``A_n`` inside the completion proper (up to
  its first EOS) whose final token (the argmax the canvas ended on) the detached π_old predicts at the state with
  probability ≥ ``clean_target_threshold``; their target is that final token.
* **Terms**: REINFORCE / PPO (``num_iterations > 1``) and the k3 KL against the reference, at the same state, per
  target token — the masked-diffusion :class:`~dllm_trl.losses.RLDFLoss`'s own per-token code, normalisation and
  metrics. The distribution is the temperature-scaled one the rollout drew from (``softmax(logits / T_n)``).
* **Scoring**: the states of a micro-batch are replayed in one forward of the wrapped model
  (:func:`~dllm_trl.generation.diffusion_gemma.replay_logits`, so DDP and ZeRO-3 see it): the encoder runs over
  prompt and finished canvases chunk by chunk as in the rollout (with gradient: encoder and decoder share weights),
  each state's decoder call reads the cache up to its canvas. All sampled steps of
  a micro-batch form one forward (one backward), as the encoder cache is shared by them, unless
  ``states_per_forward`` splits them (memory: each forward holds its states' full-vocabulary logits).

**What the gradient is the gradient of.** With ``sequential`` targets and REINFORCE, the default
(``self_conditioning_gradient="recorded"``) differentiates

    Σ_rows A Σ_{n∈S} c_n Σ_{i∈A_n} log π_θ(y_{n,i} | x_n, sc_rec_n, T_n)

(``S``: the row's ``k`` sampled steps; ``c_n``: the normalisation weight of the step's targets, e.g. ``1 / (|Ô_n| · k
· rows)`` under ``"sample"``); ``rldf`` adds the clean targets' terms, PPO and the KL replace ``A log π_θ`` by their
per-token functions of the same ``log π_θ``. Held fixed, with no gradient:

* ``sc_rec_n``, the **self-conditioning input the rollout recorded** (a constant of the forward: no gradient runs
  through the self-conditioning chain, step n+1's logits feeding step n's input; with the ``"embedding"`` carrier the
  recorded soft embedding also holds its dependence on ``E``); the reference and π_old read the same recorded input;
* the **accept sets** ``A_n`` and the **final argmax** (the clean targets, the output): deterministic, discontinuous
  functions of the logits, not differentiated;
* the **sampled steps**: ``k`` of the row's ``N`` steps, drawn by π_old's uncertainty, scored with **no importance
  correction**, so the sum over ``S`` is a biased stand-in for the sum over all steps.

It is therefore not the score function of the sampled trajectory: an independent check on tiny models (issue 32)
found its cosine to the gradient through the self-conditioning chain 0.79–0.89 (relative error 0.46–0.67), and the
step sampling moving it further (cosine 0.64–0.79 to the all-steps frozen-chain gradient).

``self_conditioning_gradient="chain"`` recomputes ``sc_n`` instead of reading the record: from the canvas's first
step (zeros) through step ``n+1``, each step's decoder call reads its recorded canvas ``x`` and the previous recomputed
input, ``sc_n(θ) = logits_θ(x_{n+1}, sc_{n+1}(θ)) / T_{n+1}``; the sum above with ``sc_n(θ)`` in place of ``sc_rec_n``
is differentiated through the whole chain. π_old and the reference are scored through their own chains. At the
rollout's weights the recomputed input equals the recorded one (up to float rounding; with the ``"embedding"``
carrier while ``E`` is the rollout's), so the forward value is unchanged. Still held fixed: the accept sets, the final
argmax, and the step sampling (with every step scored and ``sequential`` targets, the sum is the log-likelihood of the
recorded draws given the accept sets). Cost: one extra decoder call per earlier step of each sampled step's canvas
(shared by a row's sampled steps in that canvas), in the π_old, reference and loss forwards, and the activations of
those calls for the backward (docs/diffusion_gemma.md measures it). Refused where a forward is a collective of every
process (FSDP, ZeRO-3): the decoder calls per forward follow each process's own sampled steps.

Other approximations: with the ``"embedding"`` carrier (default) the recorded soft embedding is the rollout policy's,
``softmax(logits) · E``: exact for π_θ and for the KL reference while they share the frozen ``E`` (LoRA, whose
reference is the base model), not for a reference with other embeddings or after an update of ``E`` (then use the
``"logits"`` carrier or ``"chain"``); the clean targets (``"rldf"``) are RLDF's biased x₀ estimator, as for masked
diffusion.

Accepted positions after the first EOS of the EOS canvas count in the per-step terms: their draws shape the canvas's
other positions through bidirectional attention. Steps of canvases after the row finished (all padding) do not.
"""

from __future__ import annotations

import dataclasses

import torch

from ..generation.diffusion_gemma import SelfConditioningChain, replay_logits
from ..models.diffusion_gemma import is_diffusion_gemma
from ..models.engines import forwards_are_collective, unwrap_model
from .rldf_terms import INVALID_STEP, sample_timesteps
from .rldf_loss import LossCall, RLDFLoss, rollout_entries
from .trust_region_loss import TrustRegionTerms

DIFFUSION_GEMMA_ESTIMATORS = ("rldf", "sequential")
SELF_CONDITIONING_GRADIENTS = ("recorded", "chain")
"""``"recorded"``: each state reads the rollout's self-conditioning input, a constant; ``"chain"``: the input is
recomputed with gradient through the canvas's earlier steps."""
CHAIN_KEYS = ("chain_state_ids", "chain_canvas", "chain_temperature")
"""Batch entries of the rollout's whole record (per row, every step) that the ``"chain"`` replay reads."""

MASK_DIFFUSION_FIELDS = {
    "unmasking": "DiffusionGemma accepts tokens by an entropy bound: set entropy_bound on DiffusionGemmaSamplerConfig",
    "unmasking_threshold": "DiffusionGemma accepts tokens by an entropy bound: set entropy_bound on "
                           "DiffusionGemmaSamplerConfig",
    "diffusion_steps": "set max_denoising_steps (per canvas) on DiffusionGemmaSamplerConfig",
    "cache_mode": "DiffusionGemma's encoder cache is exact and always on",
    "sampling_style": "DiffusionGemma draws categorically from its tempered logits",
    "temperature": "DiffusionGemma's temperature follows a schedule: set t_min / t_max on DiffusionGemmaSamplerConfig",
    "top_p": "DiffusionGemma's rollout draws from the full tempered distribution",
    "top_k": "DiffusionGemma's rollout draws from the full tempered distribution",
    "min_p": "DiffusionGemma's rollout draws from the full tempered distribution",
    "prompt_mask_prob": "it masks prompt tokens, and DiffusionGemma has no mask token",
}
"""RLDFConfig fields of masked-diffusion decoding, refused at a non-default value on a DiffusionGemma run (-> why and
what to set instead)."""

STATE_KEYS = ("state_canvas", "state_ids", "state_temperature", "state_accept", "state_target_ids", "state_valid",
              "state_rollout_logps", "state_self_conditioning", "state_has_self_conditioning")


def check_diffusion_gemma_args(args, model) -> None:
    """Refuse, with the field's name and the fix, settings that only mean something for masked diffusion."""
    canvas = unwrap_model(model).config.canvas_length
    if args.block_length is not None and args.block_length != canvas:
        raise ValueError(
            f"block_length={args.block_length} is a masked-diffusion setting; DiffusionGemma decodes canvases of its "
            f"config's canvas_length={canvas}: set block_length={canvas} (and max_completion_length to a multiple of it)."
        )
    defaults = {f.name: f.default for f in dataclasses.fields(type(args))}
    for name, why in MASK_DIFFUSION_FIELDS.items():
        if name in defaults and getattr(args, name) != defaults[name]:
            raise ValueError(f"{name}={getattr(args, name)!r} is a masked-diffusion setting, not used by DiffusionGemma: "
                             f"{why}; leave {name} at its default ({defaults[name]!r}).")
    if args.policy_estimator not in DIFFUSION_GEMMA_ESTIMATORS:
        raise ValueError(f"policy_estimator={args.policy_estimator!r} builds masked states; DiffusionGemma's states are "
                         f"its recorded denoising steps: use one of {DIFFUSION_GEMMA_ESTIMATORS}.")


def check_no_mask_token(model) -> None:
    """A DiffusionGemma model carrying mask-diffusion properties (``set_diffusion_properties`` or a loader's
    ``mask_token_id=``) was set up as the wrong kind of model."""
    config = unwrap_model(model).config
    for name in ("mask_token_id", "diffusion_block_size", "diffusion_logit_shift"):
        if getattr(config, name, None) is not None:
            raise ValueError(
                f"config.{name}={getattr(config, name)!r} is a masked-diffusion property, and DiffusionGemma is "
                "uniform-noise diffusion with no mask token: load it with load_diffusion_model(path) (no "
                "mask_token_id / block_size / logit_shift) or transformers' DiffusionGemmaForBlockDiffusion."
            )


class DiffusionGemmaRLDFLoss(RLDFLoss):
    """RLDF on DiffusionGemma's recorded denoising steps (module docstring). Pass ``loss=DiffusionGemmaRLDFLoss(args)``
    with ``sampler=DiffusionGemmaSampler(...)`` to :class:`~dllm_trl.RLDFTrainer`. ``states_per_forward``: sampled
    steps per loss forward (None: all of a micro-batch's in one, sharing one encoder pass).
    ``self_conditioning_gradient``: ``"recorded"`` (default) feeds each sampled state the rollout's
    self-conditioning input, held fixed; ``"chain"`` recomputes it through the canvas's earlier steps, so the gradient
    also runs through the self-conditioning chain (module docstring; costs one decoder call per earlier step)."""

    packs_block_states = False
    targets_from_loss_forward = False
    """The clean targets are fixed by a no-grad π_old pass over the sampled states before the loss."""
    supported_estimators = DIFFUSION_GEMMA_ESTIMATORS

    def __init__(self, args, states_per_forward: int | None = None, self_conditioning_gradient: str = "recorded"):
        super().__init__(args)
        if states_per_forward is not None and states_per_forward < 1:
            raise ValueError(f"states_per_forward={states_per_forward} must be ≥ 1 (or None: all sampled steps in one).")
        if self_conditioning_gradient not in SELF_CONDITIONING_GRADIENTS:
            raise ValueError(f"self_conditioning_gradient={self_conditioning_gradient!r}: expected one of "
                             f"{SELF_CONDITIONING_GRADIENTS} ('recorded': the rollout's input held fixed; 'chain': "
                             "the gradient through the self-conditioning chain).")
        self.self_conditioning_gradient = self_conditioning_gradient
        # A forward holds the float32 logits of its states, (rows × steps, L, V): 268 MB per state at L = 256,
        # V = 262 144, about three times that with the log-softmax and its gradient. Fewer steps per forward bound it,
        # at the cost of one encoder pass per forward.
        self.states_per_forward = states_per_forward

    reads_sampling_settings = False
    """Each denoising step's temperature comes with the rollout's record (``state_temperature``): nothing of the
    sampler's config is read."""

    corrects_rollout_mismatch = False  # the encoder cache is exact: nothing to correct

    def check_model_kind(self, model) -> None:
        """DiffusionGemma, without masked-diffusion properties, with no masked-diffusion setting in ``args``
        (:meth:`RLDFLoss.check_model` runs the shared checks around it)."""
        if not is_diffusion_gemma(model):
            raise ValueError(f"{type(self).__name__} trains DiffusionGemma; got {type(unwrap_model(model)).__name__}. "
                             "Use RLDFLoss for masked-diffusion models.")
        check_no_mask_token(model)
        check_diffusion_gemma_args(self.args, model)

    def sample_states(self, prompt_ids, prompt_mask, output, generator, mask_seed_generator):
        """The batch's trajectory: the rollout's completion and, for ``k`` steps per row drawn by their uncertainty
        (Alg. 2), each step's recorded state (module docstring). Returns ``(trajectory, (sum, count))`` of the sampled
        steps' uncertainty."""
        record = output.denoising_steps
        if record is None:
            raise ValueError(f"{type(self).__name__} needs the per-step record of DiffusionGemmaSampler "
                             "(output.denoising_steps); this sampler returned none.")
        args = self.args
        accepted = record.accept_mask & record.active.unsqueeze(-1)
        count = accepted.sum(-1)
        uncertainty = -(record.accepted_logps.double() * accepted).sum(-1) / count.clamp_min(1)
        sampled = sample_timesteps(uncertainty.float(), count > 0, args.num_sampled_timesteps,
                                   args.timestep_temperature, generator)
        valid = sampled != INVALID_STEP
        s = sampled.clamp_min(0)
        rows = torch.arange(sampled.shape[0], device=sampled.device).unsqueeze(1)
        length = record.state_ids.shape[-1]
        canvas = record.canvas[s]
        span = canvas.unsqueeze(-1) * length + torch.arange(length, device=s.device)  # (B, k, L) completion columns
        final = output.completion_ids.gather(1, span.flatten(1)).view_as(span)
        accept = record.accept_mask[rows, s] & valid.unsqueeze(-1)
        trajectory = {
            **rollout_entries(prompt_ids, prompt_mask, output),
            "sampled_steps": sampled,
            "state_canvas": torch.where(valid, canvas, -1),
            "state_ids": record.state_ids[rows, s],
            "state_temperature": record.temperature[s],
            "state_accept": accept,
            # The drawn token where accepted (the per-step term), the final output token elsewhere (clean targets).
            "state_target_ids": torch.where(accept, record.accepted_ids[rows, s], final),
            "state_valid": output.completion_mask.gather(1, span.flatten(1)).view_as(span).bool(),
            "state_rollout_logps": record.accepted_logps[rows, s],
            # "chain" recomputes the sampled states' inputs from the whole record's canvases (below) instead.
            **({} if self.self_conditioning_gradient == "chain"
               else {"state_self_conditioning": record.self_conditioning[rows, s]}),
            "state_has_self_conditioning": record.has_self_conditioning[s] & valid,
            "state_sc_is_logits": torch.full((sampled.shape[0],), record.carrier == "logits", device=s.device),
        }
        if self.self_conditioning_gradient == "chain":
            batch = sampled.shape[0]
            trajectory["chain_state_ids"] = record.state_ids
            trajectory["chain_canvas"] = record.canvas.unsqueeze(0).expand(batch, -1).clone()
            trajectory["chain_temperature"] = record.temperature.unsqueeze(0).expand(batch, -1).clone()
        weight = uncertainty.float().gather(1, s)[valid]
        return trajectory, (weight.sum(), float(weight.numel()))

    # ------------------------------------------------------------------------------------------------ states
    def state_candidates(self, batch, rows, j, block_size=None):
        accept = batch["state_accept"][rows, j]
        if self.args.policy_estimator == "sequential":
            return accept
        return accept | batch["state_valid"][rows, j]

    def target_mask(self, batch, old_logps, block_size):
        """Ô (B, k, L): the accepted tokens, plus (``rldf``) the valid positions whose final token π_old predicts
        with probability ≥ ``clean_target_threshold`` (Alg. 3)."""
        live = (batch["sampled_steps"] != INVALID_STEP).unsqueeze(-1)
        accept = batch["state_accept"] & live
        if self.args.policy_estimator == "sequential":
            return accept
        clean = ~accept & batch["state_valid"] & (old_logps.detach().exp() >= self.args.clean_target_threshold)
        return accept | (clean & live)

    # ----------------------------------------------------------------------------------------------- scoring
    def state_log_probs(self, model, batch, rows, steps):
        """``(where, log_probs)``: the tempered log-distribution ``log softmax(logits / T_n)`` (n, L, V) of every live
        state among ``steps`` of ``rows``, ``where`` its (row index into ``rows``, index into ``steps``)."""
        pick = lambda key: batch[key][rows][:, steps]  # noqa: E731
        live = pick("sampled_steps") != INVALID_STEP
        canvas = torch.where(live, pick("state_canvas"), -1)
        carrier = "logits" if bool(batch["state_sc_is_logits"][rows].any()) else "embedding"
        if self.self_conditioning_gradient == "chain":
            if forwards_are_collective(model):
                raise ValueError("self_conditioning_gradient='chain' is not supported where a forward is a collective "
                                 "of every process (FSDP, ZeRO-3): its decoder calls per forward follow each process's "
                                 "own sampled steps, so the weight gathers would not pair up; use DDP or ZeRO-1/2, or "
                                 "self_conditioning_gradient='recorded'.")
            missing = [key for key in CHAIN_KEYS if key not in batch]
            if missing:
                raise ValueError(f"self_conditioning_gradient='chain' replays the rollout's whole record, and this "
                                 f"batch lacks {missing}: build it with this loss's sample_states (a loss made with "
                                 "self_conditioning_gradient='recorded' keeps only the sampled states).")
            chain = SelfConditioningChain(steps=pick("sampled_steps").clamp_min(0),
                                          state_ids=batch["chain_state_ids"][rows],
                                          canvas=batch["chain_canvas"][rows],
                                          temperature=batch["chain_temperature"][rows])
            sc = present = None
        else:
            chain, sc, present = None, pick("state_self_conditioning"), pick("state_has_self_conditioning")
        logits = replay_logits(model, batch["rollout_prompt_ids"][rows], batch["rollout_prompt_mask"][rows],
                               batch["rollout_ids"][rows], canvas, pick("state_ids"), sc, present, carrier, chain)
        where = live.nonzero(as_tuple=True)
        scaled = logits.float() / pick("state_temperature")[where].view(-1, 1, 1)
        return where, scaled.log_softmax(-1)

    def state_logps(self, model, batch, rows, steps, with_entropy=False, entropy_grad=True):
        """``log π(target | x_n, sc_n, T_n)`` (len(rows), len(steps), L) of the states ``steps`` of ``rows`` (zeros
        for padding steps); with ``with_entropy``, also the entropy of that tempered distribution."""
        where, log_probs = self.state_log_probs(model, batch, rows, steps)
        targets = batch["state_target_ids"][rows][:, steps][where]
        values = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        shape = (rows.numel(), len(steps), values.shape[-1])
        out = values.new_zeros(shape).index_put(where, values)
        if not with_entropy:
            return out
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        entropy = entropy if entropy_grad else entropy.detach()
        return out, entropy.new_zeros(shape).index_put(where, entropy)

    def score_states(self, model, batch, step_index=None, batch_size=None):
        """(B, k, L) log-probs of each sampled state's targets (TRL's old-policy and reference passes)."""
        sampled = batch["sampled_steps"]
        steps = list(range(sampled.shape[1])) if step_index is None else [step_index]
        out = torch.zeros(*sampled.shape, batch["state_ids"].shape[-1], device=sampled.device)
        live = (sampled[:, steps] != INVALID_STEP).any(1).nonzero().squeeze(1)
        for part in live.split(batch_size or sampled.shape[0]) if live.numel() else ():
            out[part.unsqueeze(1), torch.tensor(steps, device=part.device)] = self.state_logps(model, batch, part, steps)
        return out

    # ------------------------------------------------------------------------------------------------- loss
    def loss_chunks(self, model, inputs, steps: list[int]) -> list[list[int]]:
        """The sampled steps grouped into forwards (each followed by its backward under per-step backward): all in one
        by default, where one encoder pass over the prompt and the canvases serves them all; ``states_per_forward``
        steps per forward otherwise (each forward encodes again, and holds only its states' logits)."""
        width = self.states_per_forward or len(steps)
        return [steps[i : i + width] for i in range(0, len(steps), width)] if steps else []

    def chunk_loss(self, model, inputs, steps, call):
        sampled = inputs["sampled_steps"]
        rows = (sampled[:, steps] != INVALID_STEP).any(1).nonzero().squeeze(1)
        logps, entropy = self.state_logps(model, inputs, rows, steps, with_entropy=True,
                                          entropy_grad=self.args.entropy_coef != 0.0)
        where = torch.full((sampled.shape[0],), -1, dtype=torch.long, device=rows.device)
        where[rows] = torch.arange(rows.numel(), device=rows.device)
        loss = 0.0
        for n, j in enumerate(steps):
            active = (sampled[:, j] != INVALID_STEP).nonzero().squeeze(1)
            loss = loss + self.step_loss(model, inputs, j, call, scored=(logps[where[active], n],
                                                                         entropy[where[active], n]))
        return loss

    def stand_in(self, inputs) -> dict:
        """:meth:`RLDFLoss.stand_in` with a canvas a dropped row leaves unset (-1) made valid (the first recorded
        state of the first row)."""
        batch = super().stand_in(inputs)
        batch["state_canvas"] = batch["state_canvas"].clamp_min(0)
        return batch


class DiffusionGemmaTrustRegionLoss(TrustRegionTerms, DiffusionGemmaRLDFLoss):
    """The (predictive) divergence trust-region mask (paper 2, SPEC §3) on DiffusionGemma's sampled steps: the masked
    policy gradient ``−M · w · A · log π_θ(a)`` per target token instead of REINFORCE / PPO, ``β`` · k3 KL as before.

    ``μ``, the behaviour distribution of a target: for an accepted token (``behaviour_source="rollout"``), the
    tempered distribution it was drawn from, as the rollout recorded it (its top-K, ``record_topk``, and the drawn
    token's log-prob); for the clean targets (and every target with ``behaviour_source="old"``), ``π_old(· | x_n, sc_n,
    T_n)`` from the old-policy pass, or the loss forward's own distribution, detached, on an on-policy batch. ``π_θ``
    is the same tempered distribution, recomputed by the replay. Use it with
    :class:`~dllm_trl.trainers.DiffusionDPPOMaskTrainer` (``loss=``, ``sampler=`` as for RLDF).
    """

    logs_ppo_terms = False

    def __init__(self, args, vocab_size: int, states_per_forward: int | None = None,
                 self_conditioning_gradient: str = "recorded"):
        DiffusionGemmaRLDFLoss.__init__(self, args, states_per_forward, self_conditioning_gradient)
        TrustRegionTerms.__init__(self, args, vocab_size, 1.0)  # π_θ is tempered per step (T_n), not by args

    @property
    def record_topk(self) -> int:
        return max(self.args.divergence_top_k, 1)

    def check_model(self, model) -> None:
        super().check_model(model)
        if not hasattr(self.args, "divergence"):
            raise ValueError(f"{type(self).__name__} reads the trust-region settings of a DPPOMaskConfig; got "
                             f"{type(self.args).__name__}.")

    def sample_states(self, prompt_ids, prompt_mask, output, generator, mask_seed_generator):
        record = output.denoising_steps
        if record is None or record.topk_ids is None:
            raise ValueError(f"{type(self).__name__} needs the rollout's top-K per step: the sampler must honour its "
                             "config's record_topk (DiffusionGemmaSampler does).")
        trajectory, uncertainty = super().sample_states(prompt_ids, prompt_mask, output, generator, mask_seed_generator)
        rows = torch.arange(record.state_ids.shape[0], device=record.state_ids.device).unsqueeze(1)
        s = trajectory["sampled_steps"].clamp_min(0)
        top_k = self.args.divergence_top_k
        # The behaviour record under the masked-diffusion loss's key names, per sampled state: (B, k, L, K).
        trajectory["rollout_topk_ids"] = record.topk_ids[rows, s][..., :top_k]
        trajectory["rollout_topk_logps"] = record.topk_logps[rows, s][..., :top_k]
        return trajectory, uncertainty

    def score_for_policy_pass(self, model, batch, batch_size=None, old_pass=False):
        """The old-policy pass also keeps π_old's top-K per target position (``old_topk_ids`` / ``old_topk_logps``,
        (B, k, L, K)) from the same replay."""
        if not old_pass:
            return super().score_for_policy_pass(model, batch, batch_size)
        sampled = batch["sampled_steps"]
        top_k, length = self.args.divergence_top_k, batch["state_ids"].shape[-1]
        logps = torch.zeros(*sampled.shape, length, device=sampled.device)
        ids = torch.full((*sampled.shape, length, top_k), -1, dtype=torch.int32, device=sampled.device)
        values = torch.zeros(*sampled.shape, length, top_k, device=sampled.device)
        steps = list(range(sampled.shape[1]))
        live = (sampled != INVALID_STEP).any(1).nonzero().squeeze(1)
        with torch.no_grad():
            for part in live.split(batch_size or sampled.shape[0]) if live.numel() else ():
                (r, j), log_probs = self.state_log_probs(model, batch, part, steps)
                targets = batch["state_target_ids"][part[r], j]
                logps[part[r], j] = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
                top = log_probs.topk(top_k, dim=-1)
                ids[part[r], j], values[part[r], j] = top.indices.to(torch.int32), top.values
        return logps, {"old_topk_ids": ids, "old_topk_logps": values}

    def begin(self, inputs, normalizer, beta, epsilon_low, epsilon_high, count_targets=False) -> LossCall:
        call = super().begin(inputs, normalizer, beta, epsilon_low, epsilon_high, count_targets)
        call.extra = self.mask_buffers(inputs["target_mask"].shape, inputs["target_mask"].device)
        return call

    def chunk_loss(self, model, inputs, steps, call):
        args = self.args
        sampled = inputs["sampled_steps"]
        rows = (sampled[:, steps] != INVALID_STEP).any(1).nonzero().squeeze(1)
        (r, n), log_probs = self.state_log_probs(model, inputs, rows, steps)
        step_index = torch.as_tensor(steps, device=rows.device)[n]
        targets = inputs["target_mask"][rows[r], step_index]  # (states, L)
        state, column = targets.nonzero(as_tuple=True)
        b, j = rows[r][state], step_index[state]
        action = inputs["state_target_ids"][b, j, column]
        from_rollout = inputs["state_accept"][b, j, column] & (args.behaviour_source == "rollout")
        own = log_probs[state, column]  # (tokens, V)
        if "old_topk_ids" in inputs:
            other_ids = inputs["old_topk_ids"][b, j, column].long()
            other_logps = inputs["old_topk_logps"][b, j, column]
            other_action = inputs["old_per_token_logps"][b, j, column]
        else:  # on-policy: π_old is this forward's distribution
            top = own.detach().topk(args.divergence_top_k, dim=-1)
            other_ids, other_logps = top.indices, top.values
            other_action = own.detach().gather(-1, action.unsqueeze(-1)).squeeze(-1)
        keep_rollout = from_rollout.unsqueeze(-1)
        mu_ids = torch.where(keep_rollout, inputs["rollout_topk_ids"][b, j, column].long(), other_ids)
        mu_logps = torch.where(keep_rollout, inputs["rollout_topk_logps"][b, j, column], other_logps)
        mu_action = torch.where(from_rollout, inputs["state_rollout_logps"][b, j, column], other_action)
        pi_support = own.gather(-1, torch.cat([mu_ids, action.unsqueeze(-1)], dim=-1))
        advantages = inputs["advantages"][b]
        terms, parts = self.masked_terms(pi_support, mu_ids, mu_logps, action, mu_action, advantages)
        parts["from_rollout"] = from_rollout
        old = inputs["old_per_token_logps"][b, j, column] if "old_per_token_logps" in inputs else None
        terms = self.kl_and_parts(call, inputs, (b, j, column), terms, parts, pi_support[..., -1], old)
        self.record(torch.ones_like(from_rollout), mu_ids=mu_ids, mu_logps=mu_logps, mu_action_logps=mu_action,
                    pi_support=pi_support, action=action, advantages=advantages, **parts)
        return (terms * call.normalizer[b, j]).sum()

    def metric_sums(self, inputs, call: LossCall) -> dict:
        sums = super().metric_sums(inputs, call)
        sums.update(self.target_mask_metric_sums(inputs, call))
        return sums
