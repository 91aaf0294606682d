"""Configurations of the trust-region trainers (SPEC §3, "Predictive Divergence Masks").

:class:`TrustRegionArguments` holds the mask's fields; :class:`DPPOMaskConfig` adds them to [`RLDFConfig`] (diffusion
LMs, and the name users know for both kinds), :class:`CausalDPPOMaskConfig` to TRL's [`~trl.GRPOConfig`] (causal LMs:
no RLDF field).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl import GRPOConfig

from .rldf_config import RLDFConfig, SafeRunArguments, check_grpo_fields

MODEL_KINDS = ("auto", "diffusion", "causal")
DIVERGENCES = ("kl", "tv")
MASK_DIRECTIONS = ("predictive", "ratio")
TAIL_ESTIMATORS = ("uniform", "aggregated")
BEHAVIOUR_SOURCES = ("rollout", "old")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
_CLIP = "there is no PPO ratio clipping: the divergence mask replaces it (set divergence_threshold, δ)"
REFUSED_BY_THE_MASK = {
    "epsilon": _CLIP, "epsilon_high": _CLIP, "delta": _CLIP,
    "entropy_coef": "the masked policy gradient has no entropy bonus",
    "use_transformers_continuous_batching": "the behaviour top-K is captured through generate()'s logits processors",
}
"""GRPOConfig fields every trust-region config refuses at a non-default value, with the reason."""
_ENGINE_CORRECTION = ("the masked loss weighs each token by min(π_θ(a)/μ(a), is_cap) against vLLM's μ, which is "
                      "the correction of the engine's mismatch; TRL's ratio π_old/μ on top would correct twice")


@dataclass
class TrustRegionArguments:
    r"""
    The trust-region mask's fields, shared by [`DPPOMaskConfig`] and [`CausalDPPOMaskConfig`].

    Parameters:
        divergence (`str`, *optional*, defaults to `"kl"`):
            Divergence of the proximity test: `"kl"` (top-K KL(μ‖π), paper Eq. 5) or `"tv"` (top-K total variation).
        divergence_top_k (`int`, *optional*, defaults to `20`):
            `K`: size of the behaviour top-K kept per token (`S = topK(μ) ∪ {a}` plus a tail bucket). `0` uses the
            binary view `S = {a}` (DPPO's binary KL / TV). Named so as not to clash with the sampling `top_k`.
        divergence_threshold (`float`, *optional*, defaults to `0.15`):
            `δ`: tokens with `D > δ` are outside the trust region (paper main value 0.15; DPPO's public configs use
            0.05 for KL, 0.15 for TV).
        divergence_threshold_low (`float` or `None`, *optional*, defaults to `None`):
            `δ` for tokens with advantage ≤ 0 (defaults to `divergence_threshold`).
        divergence_threshold_high (`float` or `None`, *optional*, defaults to `None`):
            `δ` for tokens with advantage > 0 (defaults to `divergence_threshold`).
        mask_direction (`str`, *optional*, defaults to `"predictive"`):
            Direction test of a token outside the trust region: `"predictive"` drops it when `A · g > 0`, `g` the
            first-order change of `D` along the token's own gradient (the paper's mask); `"ratio"` drops it when
            `A · (r − 1) > 0` (DPPO, the paper's baseline).
        tail_estimator (`str`, *optional*, defaults to `"uniform"`):
            How `g` models the unseen tail: `"uniform"` spreads it over the `V − |S|` unseen tokens (paper Eq. 11),
            `"aggregated"` treats it as one token (Eq. 10). The paper finds both train alike; the uniform one is the
            closer estimate of the full-vocabulary `g` (SPEC §3.2), hence the default.
        is_cap (`float` or `None`, *optional*, defaults to `20.0`):
            `C`: truncation of the importance weight `w = min(π_θ(a)/μ(a), C)` (no gradient through `w`). `None`
            disables the truncation.
        use_bias_correction_kl (`bool`, *optional*, defaults to `True`):
            TRL's importance correction of the KL term (k3 weighted by `π_θ/π_old`, with gradient), as in TRL.
    """

    divergence: str = field(default="kl", metadata={"help": "Divergence of the proximity test: 'kl' or 'tv'."})
    divergence_top_k: int = field(
        default=20, metadata={"help": "K: behaviour top-K kept per token (0 = binary view S = {a})."}
    )
    divergence_threshold: float = field(
        default=0.15, metadata={"help": "δ: tokens with D(μ‖π) > δ are outside the trust region."}
    )
    divergence_threshold_low: float | None = field(
        default=None, metadata={"help": "δ for tokens with advantage ≤ 0 (default: divergence_threshold)."}
    )
    divergence_threshold_high: float | None = field(
        default=None, metadata={"help": "δ for tokens with advantage > 0 (default: divergence_threshold)."}
    )
    mask_direction: str = field(
        default="predictive",
        metadata={"help": "'predictive' (sign of the divergence's first-order change) or 'ratio' (DPPO's A·(r−1))."},
    )
    tail_estimator: str = field(
        default="uniform", metadata={"help": "Tail model of the predictive direction: 'uniform' or 'aggregated'."}
    )
    is_cap: float | None = field(
        default=20.0, metadata={"help": "C: importance weights are truncated at C (None = no truncation)."}
    )
    use_bias_correction_kl: bool = field(
        default=True, metadata={"help": "Weight the k3 KL by π_θ/π_old with gradient (TRL's default correction)."}
    )


    @property
    def mask_rule(self) -> str:
        """The rule name of :func:`~dllm_trl.losses.divergence_masks.trust_region_mask`."""
        return "predictive" if self.mask_direction == "predictive" else "dppo"

    def check_trust_region(self) -> None:
        """Refuse values the mask cannot use, naming the field."""
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence={self.divergence!r}: expected one of {DIVERGENCES}.")
        if not isinstance(self.divergence_top_k, int) or self.divergence_top_k < 0:
            raise ValueError(f"divergence_top_k={self.divergence_top_k!r} must be an int ≥ 0 (0 = binary view).")
        for name in ("divergence_threshold", "divergence_threshold_low", "divergence_threshold_high"):
            value = getattr(self, name)
            if value is None and name != "divergence_threshold":
                continue
            if value is None or math.isnan(value) or value < 0:
                raise ValueError(f"{name}={value!r} must be a number ≥ 0.")
        if self.mask_direction not in MASK_DIRECTIONS:
            raise ValueError(f"mask_direction={self.mask_direction!r}: expected one of {MASK_DIRECTIONS}.")
        if self.tail_estimator not in TAIL_ESTIMATORS:
            raise ValueError(f"tail_estimator={self.tail_estimator!r}: expected one of {TAIL_ESTIMATORS}.")
        if self.is_cap is not None and (math.isnan(self.is_cap) or self.is_cap <= 0):
            raise ValueError(f"is_cap={self.is_cap!r} must be > 0 (or None for no truncation).")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(
                f"loss_type={self.loss_type!r}: the masked policy gradient aggregates with one of {LOSS_TYPES}."
            )


@dataclass
class CausalDPPOMaskConfig(TrustRegionArguments, SafeRunArguments, GRPOConfig):
    r"""
    Configuration class for [`CausalDPPOMaskTrainer`]: TRL's [`~trl.GRPOConfig`] plus the trust-region mask's fields
    ([`TrustRegionArguments`]) — the paper's own setting, a causal LM that samples through ``generate()``.

    `μ` is the distribution each token was actually sampled from (after temperature / top-k / top-p), its
    top-`divergence_top_k` captured during TRL's own generation. The terms are aggregated with TRL's `loss_type`
    (`grpo`, `bnpo`, `dr_grpo`, `dapo`). There is no PPO clipping, so `epsilon` / `epsilon_high` / `delta` are
    refused. Checkpoint and reward checks: [`SafeRunArguments`] (`verify_checkpoints`, `raise_on_unscorable_rewards`).

    Parameters:
        loss_type (`str`, *optional*, defaults to `"dapo"`):
            Aggregation of the per-token terms: TRL's `grpo`, `bnpo`, `dr_grpo` or `dapo`.
        use_vllm (`bool`, *optional*, defaults to `False`):
            Roll out with vLLM (TRL's `vllm_mode`: `"colocate"` or `"server"`); `μ` is then the engine's top-
            `divergence_top_k` log-probs of each sampled token, as sampled (`processed_logprobs`), and the weights are
            synced into the engine at every step as TRL does (LoRA merged). See `docs/vllm.md`.
        vllm_importance_sampling_correction (`bool`, *optional*, defaults to `False`):
            Must stay `False` (TRL's default is `True`): the masked loss already weighs each token by
            `min(π_θ(a)/μ(a), is_cap)` against the engine's `μ`; TRL's ratio `π_old/μ` on top would correct twice.
            The `sampling/*` mismatch metrics are logged with `use_vllm` regardless.
        vllm_engine_kwargs (`dict` or `None`, *optional*, defaults to `None`):
            Extra `vllm.LLM` arguments of the colocate engine, e.g. `{"dtype": "float32", "enforce_eager": True}`
            (`max_logprobs` defaults to what `divergence_top_k` needs). Arguments TRL sets from its own `vllm_*`
            fields are refused. Server mode: pass them on the server's command line.
    """

    loss_type: str = field(default="dapo", metadata={"help": f"Aggregation of the per-token terms: one of {LOSS_TYPES}."})
    use_vllm: bool = field(
        default=False, metadata={"help": "Roll out with vLLM; μ = the engine's top-K log-probs as sampled."}
    )
    vllm_importance_sampling_correction: bool = field(
        default=False,
        metadata={"help": "Must stay False: the mask's weight min(π_θ/μ, is_cap) already corrects against vLLM's μ."},
    )
    vllm_engine_kwargs: dict | None = field(
        default=None, metadata={"help": "Extra vllm.LLM arguments in colocate mode (e.g. dtype, enforce_eager)."}
    )

    @classmethod
    def refused_grpo_fields(cls) -> dict[str, str]:
        refused = dict(REFUSED_BY_THE_MASK)
        for name in ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
                     "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap"):
            refused[name] = _ENGINE_CORRECTION
        return refused

    def __post_init__(self):
        self.check_trust_region()
        check_grpo_fields(self, self.refused_grpo_fields())
        if self.vllm_importance_sampling_correction:
            raise ValueError(f"vllm_importance_sampling_correction=True is not supported: {_ENGINE_CORRECTION}. "
                             "Set it to False (the sampling/* mismatch metrics are logged with use_vllm regardless).")
        if self.vllm_engine_kwargs and not (self.use_vllm and self.vllm_mode == "colocate"):
            raise ValueError(f"vllm_engine_kwargs={self.vllm_engine_kwargs!r} configures the colocate vLLM engine: "
                             "set use_vllm=True, vllm_mode='colocate', or leave it None.")
        if self.use_vllm and "logprobs" in (self.generation_kwargs or {}):
            raise ValueError("generation_kwargs['logprobs'] would change the top-K vLLM returns for μ: remove it and "
                             "set divergence_top_k instead.")
        self.bf16_from_hardware()
        super().__post_init__()


@dataclass
class DPPOMaskConfig(TrustRegionArguments, RLDFConfig):
    r"""
    Configuration class for [`DPPOMaskTrainer`]: the divergence trust-region mask of SPEC §3
    ([`TrustRegionArguments`]) on top of [`RLDFConfig`] (itself a [`~trl.GRPOConfig`]).

    The loss is the masked, truncated-importance-weighted policy gradient
    `−Σ M · min(π_θ(a)/μ(a), C) · A · log π_θ(a)` (+ `beta` · k3-KL to the reference): a token is dropped (`M = 0`)
    when its divergence `D(μ‖π_θ)` exceeds the threshold AND the update would push it further out. There is no
    PPO clipping, so `epsilon` / `epsilon_high` / `delta` are refused.

    On a masked diffusion LM ([`DiffusionDPPOMaskTrainer`]): RLDF rollouts, sampled states and clean targets (see
    [`RLDFConfig`]); `μ` comes from the rollout record for tokens committed at the sampled step and from
    `π_old(· | q, o_t)` elsewhere (`behaviour_source`), aggregated with `loss_normalization` like RLDF. With
    `model_kind="causal"` [`DPPOMaskTrainer`] trains a causal LM ([`CausalDPPOMaskTrainer`]), which reads only the
    GRPO and trust-region fields of this config: for a causal LM prefer [`CausalDPPOMaskConfig`], which has no RLDF
    field.

    Parameters:
        model_kind (`str`, *optional*, defaults to `"auto"`):
            `"auto"` detects the kind from the model (a diffusion LM carries `config.mask_token_id` and the
            diffusion properties set by `dllm_trl.models.set_diffusion_properties`), `"diffusion"` or `"causal"`
            force it.
        behaviour_source (`str`, *optional*, defaults to `"rollout"`):
            Diffusion LMs only (SPEC §3.3). `"rollout"`: tokens committed at the sampled step take `μ` from the
            rollout record (the distribution the sampler drew them from, KV-cache approximation included), the
            other targets from `π_old(· | q, o_t)`. `"old"`: every target takes `μ` from `π_old`.
    """

    model_kind: str = field(default="auto", metadata={"help": "'auto' (detect), 'diffusion' or 'causal'."})
    behaviour_source: str = field(
        default="rollout",
        metadata={"help": "Diffusion LMs: μ of tokens committed at the sampled step from the 'rollout' or 'old'."},
    )

    @classmethod
    def refused_grpo_fields(cls) -> dict[str, str]:
        """RLDFConfig's list, with TRL's ``loss_type`` honoured (causal LMs; restricted to :data:`LOSS_TYPES`) and the
        ratio clipping and entropy terms refused: the divergence mask replaces clipping."""
        refused = super().refused_grpo_fields()
        del refused["loss_type"]
        refused.update(REFUSED_BY_THE_MASK)
        return refused

    def __post_init__(self):
        if self.model_kind not in MODEL_KINDS:
            raise ValueError(f"model_kind={self.model_kind!r}: expected one of {MODEL_KINDS}.")
        self.check_trust_region()
        if self.behaviour_source not in BEHAVIOUR_SOURCES:
            raise ValueError(f"behaviour_source={self.behaviour_source!r}: expected one of {BEHAVIOUR_SOURCES}.")
        if self.rollout_importance_sampling_correction:
            self.check_trust_region_correction()
        super().__post_init__()

    def check_trust_region_correction(self) -> None:
        """What ``rollout_importance_sampling_correction`` needs on top of :meth:`RLDFConfig.check_rollout_correction`
        in the trust-region loss: the decoupled form (trust region around ``π_old``, ``ρ = π_old/μ`` apart)."""
        refusal = None
        if self.model_kind == "causal":
            refusal = "a causal LM's generate() records μ under an exact KV cache: there is nothing to correct"
        elif self.behaviour_source != "old":
            refusal = (f"behaviour_source={self.behaviour_source!r} already weighs the recorded tokens by "
                       "min(π_θ/μ, is_cap) against the record, which the ratio would correct a second time; set "
                       "behaviour_source='old' (trust region around π_old, TRL's ratio π_old/μ on top)")
        elif self.top_p < 1.0 or self.top_k or self.min_p:
            refusal = (f"top_p={self.top_p}, top_k={self.top_k}, min_p={self.min_p}: the trust-region forward "
                       "scores the untruncated distribution, so π_old/μ would measure the truncation, not the cache")
        if refusal:
            raise ValueError(f"rollout_importance_sampling_correction=True is not supported here: {refusal}.")
