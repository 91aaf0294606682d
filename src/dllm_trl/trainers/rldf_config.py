"""Configuration of :class:`~dllm_trl.RLDFTrainer` (paper 1, App. C defaults)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

import torch
from trl import GRPOConfig

from ..generation.config import CACHE_MODES, SAMPLING_STYLES, UNMASKING_MODES, DiffusionGenerationConfig
from ..losses.estimators import ESTIMATORS
from ..losses.rollout_mismatch import IMPORTANCE_SAMPLING_MODES, REPLAYING_ESTIMATORS
from ..models.engines import check_launch_environment

BACKWARD_MODES = ("auto", "per_step", "per_micro_batch")

_VLLM = ("diffusion rollouts run in the trainer's block-wise sampler, which records the per-step denoising trajectory "
         "the loss trains on (vLLM returns final tokens only); to roll out a causal LM with vLLM use "
         "CausalDPPOMaskConfig(use_vllm=True) with CausalDPPOMaskTrainer")
_VLLM_IS = (_VLLM + "; the KV-cache mismatch of the rollout's record is corrected by the rollout_importance_sampling_* "
            "fields (same modes and bounds)")
GRPO_FIELDS_REFUSED = {
    "trust_remote_code": "checkpoints map onto transformers' own classes (load_diffusion_model); no remote code runs",
    "router_aux_loss_coef": "MoE router losses are not added to the diffusion losses",
    "cast_lm_head_to_fp32": "the KL reference is a copy of the policy made before TRL would cast it; log-probs are "
    "already taken in float32",
    "repetition_penalty": "a diffusion rollout has no left-to-right history to penalise repetitions against",
    "generation_kwargs": "decoding is set by the RLDFConfig fields (block_length, unmasking, unmasking_threshold, "
    "diffusion_steps, cache_mode, sampling_style, temperature, top_p, top_k, min_p)",
    "cache_implementation": "the sampler's KV cache is set by cache_mode ('none', 'prefix', 'dual')",
    "use_vllm": _VLLM,
    "vllm_mode": _VLLM, "vllm_model_impl": _VLLM, "vllm_enable_sleep_mode": _VLLM,
    "vllm_structured_outputs_regex": _VLLM, "vllm_server_base_url": _VLLM, "vllm_server_host": _VLLM,
    "vllm_server_port": _VLLM, "vllm_server_timeout": _VLLM, "vllm_group_port": _VLLM,
    "vllm_gpu_memory_utilization": _VLLM, "vllm_max_model_length": _VLLM, "vllm_tensor_parallel_size": _VLLM,
    "vllm_importance_sampling_correction": _VLLM_IS, "vllm_importance_sampling_mode": _VLLM_IS,
    "vllm_importance_sampling_clip_max": _VLLM_IS, "vllm_importance_sampling_clip_min": _VLLM_IS,
    "vllm_importance_sampling_cap": _VLLM_IS,
    "use_transformers_continuous_batching": "diffusion rollouts use their own block-wise sampler",
    "transformers_continuous_batching_config": "diffusion rollouts use their own block-wise sampler",
    "use_transformers_paged": "diffusion rollouts use their own block-wise sampler",
    "loss_type": "RLDF aggregates its per-token terms with loss_normalization ('token' ≈ TRL's 'dapo', 'sample' ≈ "
    "'grpo'); set that instead",
    "sapo_temperature_neg": "only used by loss_type='sapo', which RLDF does not implement",
    "sapo_temperature_pos": "only used by loss_type='sapo', which RLDF does not implement",
    "vespo_k_pos": "only used by loss_type='vespo'", "vespo_lambda_pos": "only used by loss_type='vespo'",
    "vespo_k_neg": "only used by loss_type='vespo'", "vespo_lambda_neg": "only used by loss_type='vespo'",
    "importance_sampling_level": "RLDF's ratios are per token at each sampled state ('token')",
    "sync_ref_model": "not implemented for the diffusion trainers' reference copy",
    "ref_model_mixup_alpha": "only used with sync_ref_model", "ref_model_sync_steps": "only used with sync_ref_model",
    "top_entropy_quantile": "high-entropy token selection is not implemented for diffusion states",
    "use_adaptive_entropy": "the adaptive entropy controller is not implemented; a fixed entropy_coef is",
    "entropy_coef_min": "only used with use_adaptive_entropy", "entropy_coef_max": "only used with use_adaptive_entropy",
    "entropy_coef_delta": "only used with use_adaptive_entropy", "entropy_target": "only used with use_adaptive_entropy",
    "max_tool_calling_iterations": "tool calling is not supported by diffusion rollouts",
    "off_policy_mask_threshold": "off-policy sequence masking is not implemented for RLDF's states; DPPOMaskTrainer's "
    "trust-region mask is the supported off-policy control",
}
"""GRPOConfig fields that RLDFConfig refuses when set to anything but TRL's default, with the reason."""

GRPO_FIELDS_KEPT = frozenset({
    "model_init_kwargs", "disable_dropout", "num_generations", "num_generations_eval", "max_completion_length",
    "ds3_gather_for_generation", "shuffle_dataset", "pad_to_multiple_of", "generation_batch_size",
    "steps_per_generation", "temperature", "top_p", "top_k", "min_p", "chat_template_kwargs", "beta",
    "num_iterations", "epsilon", "delta", "epsilon_high", "reward_weights", "multi_objective_aggregation",
    "scale_rewards", "mask_truncated_completions", "entropy_coef", "use_bias_correction_kl", "log_completions",
    "log_multimodal", "num_completions_to_print", "log_unique_prompts", "log_completions_hub_repo",
})
"""GRPOConfig fields whose TRL meaning holds for the diffusion trainers (TRL's machinery or RLDF's own code honours
them). Together with :data:`GRPO_FIELDS_REFUSED` they cover every GRPOConfig field (tests/test_config_fields.py)."""

_SAMPLER_NAMES = {"gen_length": "max_completion_length", "threshold": "unmasking_threshold", "steps": "diffusion_steps",
                  "cache": "cache_mode", "sampling": "sampling_style"}
"""DiffusionGenerationConfig field -> the RLDFConfig field that sets it (for error messages)."""


@dataclass
class SafeRunArguments:
    r"""
    Checkpoint integrity and reward checks shared by every config of the package.

    Parameters:
        verify_checkpoints (`bool`, *optional*, defaults to `True`):
            Write a checksum manifest (size and SHA-256 of every file) with each checkpoint and with `save_model`, and
            verify it on `train(resume_from_checkpoint=...)` (and in `load_diffusion_model`), so that a truncated or
            corrupted file stops the run with an error naming it; a checkpoint without its manifest is refused.
            `False` skips writing and checking the manifest.
        raise_on_unscorable_rewards (`bool`, *optional*, defaults to `False`):
            A reward function that returns `None`, NaN or ±inf for a completion gives it no advantage from that
            function (TRL's rule for `None`); the fraction is logged as `rewards/<name>/unscorable_frac` and warned about once. `True` stops the run
            instead.
    """

    verify_checkpoints: bool = field(
        default=True, metadata={"help": "Checksum manifest written with each save and verified on resume / load."}
    )
    raise_on_unscorable_rewards: bool = field(
        default=False, metadata={"help": "Stop when a reward function returns None, NaN or ±inf (default: log and warn)."}
    )

    def bf16_from_hardware(self) -> None:
        """``bf16=None`` (not asked): bf16 mixed precision where the training device computes in bf16 (a CUDA GPU
        that supports it, or another accelerator), float32 on a CPU, where TRL's ``True`` would stop the config
        ("Your setup doesn't support bf16/gpu") or, with ``use_cpu``, slow every forward down."""
        if self.bf16 is None and not self.fp16:
            if self.use_cpu or not torch.accelerator.is_available():
                self.bf16 = False
            elif torch.cuda.is_available():
                self.bf16 = torch.cuda.is_bf16_supported()
            else:
                self.bf16 = True


@dataclass
class RLDFConfig(SafeRunArguments, GRPOConfig):
    r"""
    Configuration class for [`RLDFTrainer`]: everything of [`~trl.GRPOConfig`] plus what RLDF needs.

    TRL's names keep their meaning: `max_completion_length` is the diffusion generation length,
    `num_generations` the group size, `temperature` / `top_p` / `top_k` the rollout sampling settings,
    `beta` the k3-KL weight, `epsilon` / `epsilon_high` the PPO clip range (used when `num_iterations > 1`,
    REINFORCE otherwise). Defaults follow paper 1 App. C where the paper fixes a value.

    Parameters:
        block_length (`int` or `None`, *optional*, defaults to `None`):
            Block size of block-wise diffusion decoding; `max_completion_length` must be a multiple of it. `None`:
            the model's own, from its family — the attention block of a block-diffusion model, the canvas of
            DiffusionGemma, 32 on a bidirectional model (LLaDA, Dream) when it divides `max_completion_length`, else
            one block of the whole completion.
        unmasking (`str`, *optional*, defaults to `"dynamic"`):
            `"dynamic"` (commit every position above `unmasking_threshold`) or `"static"` (`diffusion_steps`
            steps in total).
        unmasking_threshold (`float`, *optional*, defaults to `0.9`):
            Confidence threshold of dynamic unmasking.
        diffusion_steps (`int` or `None`, *optional*, defaults to `None`):
            Total steps of static unmasking (`None` = one token per step).
        cache_mode (`str`, *optional*, defaults to `"dual"`):
            KV cache of the rollout: `"none"`, `"prefix"` or `"dual"`.
        sampling_style (`str` or `None`, *optional*, defaults to `None`):
            `"gumbel"` or `"categorical"`; `None` uses the model's default (LLaDA: Gumbel, Dream: categorical).
        num_sampled_timesteps (`int`, *optional*, defaults to `16`):
            `k`, denoising steps sampled per completion for the loss (Eq. 6, Alg. 2).
        timestep_temperature (`float`, *optional*, defaults to `1.0`):
            `τ` of the weighted timestep sampling; 0 = top-k by uncertainty, `inf` = uniform.
        clean_target_threshold (`float`, *optional*, defaults to `0.2`):
            `c`: still-masked tokens join the target set when the (detached) policy predicts them with
            probability ≥ c (Alg. 3). The reference code ships 0.6.
        loss_normalization (`str`, *optional*, defaults to `"token"`):
            `"token"`: every target token of the micro-batch weighs the same (paper §6.3, more stable).
            `"sample"`: mean over target tokens, then over sampled steps, then over completions (Eq. 10).
        drop_zero_variance_groups (`bool`, *optional*, defaults to `True`):
            Skip the loss of groups whose rewards are all equal (paper App. C.3). Batch shapes are kept: the
            rows stay but contribute no forward pass and no loss.
        policy_estimator (`str`, *optional*, defaults to `"rldf"`):
            How the per-token policy `log π(o_i | ·)` is estimated (paper 1 App. A, SPEC §2.4; see
            `dllm_trl.losses.estimators`): `"rldf"` (the `k` sampled states `o_t`, clipped clean targets `Ô_t`),
            `"sequential"` (the same states, targets `I_t` only: the x_{t−1} variant), `"all_masking"` (d1: one
            state with the whole completion masked, every valid token a target) or `"random_masking"` (one state
            masking each completion position with a per-row ratio `t ~ U(ε, 1]`, the masked valid tokens as
            targets, weighted by their inverse masking probability ≈ `1/t`). Masks derive from a per-row seed
            carried in the batch, so old, reference and current passes see the same states.
        prompt_mask_prob (`float`, *optional*, defaults to `0.0`):
            `"all_masking"` only: probability with which each prompt token is masked (d1 uses 0.15).
        complementary_masking (`bool`, *optional*, defaults to `False`):
            `"random_masking"` only: add a second state that masks exactly the positions the first leaves
            visible (a complementary pair: every valid token is a target of exactly one of the two).
        use_bias_correction_kl (`bool`, *optional*, defaults to `False`):
            TRL's importance correction of the KL term: the k3 estimate weighted by `π_θ/π_old` (with gradient). Paper 1
            uses the plain k3 estimator, hence the default (TRL's is `True`).
        backward_mode (`str`, *optional*, defaults to `"auto"`):
            `"per_step"`: one backward per sampled step, so only one state's activations are alive (least memory;
            SPEC §2.3). `"per_micro_batch"`: the steps' losses are summed and backpropagated once (k states'
            activations alive, one gradient reduction). Under DDP and FSDP the per-step backwards accumulate locally
            (no_sync), so their gradient traffic is that of one backward; DeepSpeed ZeRO-2/3 reduce gradients in
            every backward, so there per-step costs k times the traffic. `"auto"`: `"per_micro_batch"` under
            DeepSpeed ZeRO-2/3 with several processes, `"per_step"` otherwise. Both give the same gradients.
        rollout_importance_sampling_correction (`bool`, *optional*, defaults to `False`):
            TRL's importance-sampling correction (its `vllm_importance_sampling_correction`) of the mismatch between the
            rollout's record `μ(a)` and the training forward `π_old(a | q, o_t)` at the tokens committed at each
            sampled step: the policy term is multiplied by a detached ratio `ρ` from `π_old/μ`
            (`dllm_trl.losses.rollout_mismatch`). Only a prefix / dual cache on a bidirectional model makes the
            record approximate, so it is refused with `cache_mode="none"`, on a block-diffusion model (exact cache),
            with `temperature=0` (nothing is sampled) and with the estimators whose states are not the rollout's
            (`"all_masking"`, `"random_masking"`). Off by default: paper 1 trains without it, and the mismatch is
            logged either way (`sampling/*`). On, TRL's rule applies: an old-policy pass runs for every batch (one
            no-grad forward per sampled state), so that `ρ` is known before the first loss forward.
        rollout_importance_sampling_mode (`str`, *optional*, defaults to `"token_truncate"`):
            TRL's `vllm_importance_sampling_mode`: `"token_truncate"` / `"token_mask"` (each recorded token's own
            ratio clamped to / zeroed outside `[clip_min, clip_max]`; `ρ = 1` for the clean targets, which the rollout
            did not draw at that state), `"sequence_truncate"` / `"sequence_mask"` (one ratio per completion, the
            product over its recorded tokens at its sampled states, applied to all its targets).
        rollout_importance_sampling_clip_max (`float` or `None`, *optional*, defaults to `3.0`):
            `C_max` of the mode (TRL's `vllm_importance_sampling_clip_max`); `None`: no upper bound.
        rollout_importance_sampling_clip_min (`float` or `None`, *optional*, defaults to `None`):
            `C_min` of the mode (TRL's `vllm_importance_sampling_clip_min`); `None`: no lower bound.
        verify_checkpoints (`bool`, *optional*, defaults to `True`):
            Checksum manifest written with each checkpoint and `save_model`, verified on resume (see
            [`SafeRunArguments`]).
        raise_on_unscorable_rewards (`bool`, *optional*, defaults to `False`):
            Stop when a reward function returns `None`, NaN or ±inf (default: log the fraction and warn once).
    """

    block_length: int | None = field(
        default=None,
        metadata={"help": "Block size of block-wise diffusion decoding (None: the model's own, from its family)."},
    )
    unmasking: str = field(default="dynamic", metadata={"help": "'dynamic' (threshold) or 'static' unmasking."})
    unmasking_threshold: float = field(default=0.9, metadata={"help": "Confidence threshold of dynamic unmasking."})
    diffusion_steps: int | None = field(
        default=None, metadata={"help": "Total steps of static unmasking (None = one token per step)."}
    )
    cache_mode: str = field(default="dual", metadata={"help": "Rollout KV cache: 'none', 'prefix' or 'dual'."})
    sampling_style: str | None = field(
        default=None, metadata={"help": "'gumbel', 'categorical' or None (the model's default)."}
    )
    num_sampled_timesteps: int = field(default=16, metadata={"help": "k: denoising steps sampled per completion."})
    timestep_temperature: float = field(
        default=1.0, metadata={"help": "τ of weighted timestep sampling (0 = top-k, inf = uniform)."}
    )
    clean_target_threshold: float = field(
        default=0.2, metadata={"help": "c: probability above which still-masked tokens become targets."}
    )
    loss_normalization: str = field(default="token", metadata={"help": "'token' or 'sample' normalisation."})
    drop_zero_variance_groups: bool = field(
        default=True, metadata={"help": "Skip the loss of groups whose rewards are all equal (App. C.3)."}
    )
    policy_estimator: str = field(
        default="rldf",
        metadata={
            "help": "Per-token policy estimator: 'rldf' (sampled states, clipped clean targets), 'sequential' (same "
            "states, targets I_t: x_{t-1}), 'all_masking' (d1: completion fully masked) or 'random_masking' "
            "(ELBO-style random mask ratio, 1/t weights).",
            "choices": list(ESTIMATORS),
        },
    )
    prompt_mask_prob: float = field(
        default=0.0, metadata={"help": "'all_masking' only: probability of masking each prompt token (d1: 0.15)."}
    )
    complementary_masking: bool = field(
        default=False, metadata={"help": "'random_masking' only: add the complementary mask as a second state."}
    )
    backward_mode: str = field(
        default="auto",
        metadata={
            "help": "'per_step' (one backward per sampled step: least memory), 'per_micro_batch' (one backward: least "
            "gradient traffic under DeepSpeed ZeRO-2/3) or 'auto' (per engine).",
            "choices": list(BACKWARD_MODES),
        },
    )
    rollout_importance_sampling_correction: bool = field(
        default=False,
        metadata={"help": "Correct the mismatch between the rollout's recorded μ (prefix / dual KV cache) and the "
                          "training forward with TRL's importance-sampling ratio (an old-policy pass runs every "
                          "batch)."},
    )
    rollout_importance_sampling_mode: str = field(
        default="token_truncate",
        metadata={"help": "TRL's modes: 'token_truncate', 'token_mask', 'sequence_truncate' or 'sequence_mask'.",
                  "choices": list(IMPORTANCE_SAMPLING_MODES)},
    )
    rollout_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "C_max: ratios clamped to it (*_truncate) or zeroed above it (*_mask)."}
    )
    rollout_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "C_min: ratios clamped to it (*_truncate) or zeroed below it (*_mask)."}
    )
    # Paper 1 App. C values for fields GRPOConfig already has.
    num_generations: int | None = field(default=4, metadata={"help": "Completions per prompt (paper: 4)."})
    max_completion_length: int | None = field(default=256, metadata={"help": "Diffusion generation length."})
    beta: float = field(default=0.01, metadata={"help": "k3-KL weight (paper: 0.01 LLaDA, 0.04 Dream)."})
    learning_rate: float = field(default=1e-6, metadata={"help": "Learning rate (paper: 1e-6)."})
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={"help": "Weight the k3 KL by π_θ/π_old with gradient (TRL's correction); paper 1 uses the plain k3."},
    )

    def __post_init__(self):
        if self.max_completion_length is None or self.max_completion_length <= 0:
            raise ValueError("max_completion_length must be a positive int: it is the diffusion generation length.")
        if self.block_length is not None and (
            self.block_length <= 0 or self.max_completion_length % self.block_length != 0
        ):
            raise ValueError(
                f"max_completion_length={self.max_completion_length} must be a multiple of "
                f"block_length={self.block_length}."
            )
        if self.unmasking not in UNMASKING_MODES:
            raise ValueError(f"unmasking={self.unmasking!r}: expected one of {UNMASKING_MODES}.")
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode={self.cache_mode!r}: expected one of {CACHE_MODES}.")
        if self.sampling_style is not None and self.sampling_style not in SAMPLING_STYLES:
            raise ValueError(f"sampling_style={self.sampling_style!r}: expected one of {SAMPLING_STYLES} or None.")
        if self.num_sampled_timesteps < 1:
            raise ValueError(f"num_sampled_timesteps={self.num_sampled_timesteps} must be ≥ 1.")
        if math.isnan(self.timestep_temperature) or self.timestep_temperature < 0:
            raise ValueError(f"timestep_temperature={self.timestep_temperature} must be ≥ 0 (inf = uniform).")
        if not 0.0 <= self.clean_target_threshold <= 1.0:
            raise ValueError(f"clean_target_threshold={self.clean_target_threshold} must lie in [0, 1].")
        if self.loss_normalization not in ("token", "sample"):
            raise ValueError(f"loss_normalization={self.loss_normalization!r}: expected 'token' or 'sample'.")
        if self.beta < 0:
            raise ValueError(f"beta={self.beta} must be ≥ 0.")
        if self.policy_estimator not in ESTIMATORS:
            raise ValueError(f"policy_estimator={self.policy_estimator!r}: expected one of {ESTIMATORS}.")
        if math.isnan(self.prompt_mask_prob) or not 0.0 <= self.prompt_mask_prob < 1.0:
            raise ValueError(f"prompt_mask_prob={self.prompt_mask_prob} must lie in [0, 1).")
        if self.prompt_mask_prob > 0 and self.policy_estimator != "all_masking":
            raise ValueError(
                f"prompt_mask_prob={self.prompt_mask_prob} applies to policy_estimator='all_masking' only "
                f"(got {self.policy_estimator!r})."
            )
        if self.complementary_masking and self.policy_estimator != "random_masking":
            raise ValueError(
                f"complementary_masking=True applies to policy_estimator='random_masking' only "
                f"(got {self.policy_estimator!r})."
            )
        if self.backward_mode not in BACKWARD_MODES:
            raise ValueError(f"backward_mode={self.backward_mode!r}: expected one of {BACKWARD_MODES}.")
        self.check_rollout_correction()
        check_grpo_fields(self, self.refused_grpo_fields())
        self.bf16_from_hardware()
        super().__post_init__()
        # Validate the sampler settings now rather than at the first rollout, naming this config's fields.
        try:  # (a block length of None is the model's, checked by the trainer: one block stands in for it here)
            self.diffusion_generation_config(block_length=self.max_completion_length)
        except ValueError as error:
            message = str(error)
            for sampler_name, own_name in _SAMPLER_NAMES.items():
                message = re.sub(rf"\b{sampler_name}=", f"{own_name}=", message)
            raise ValueError(message) from None

    def check_rollout_correction(self) -> None:
        """Validate the ``rollout_importance_sampling_*`` fields, and refuse the correction where nothing would be
        corrected (an exact rollout) or the record does not apply (states that are not the rollout's)."""
        mode = self.rollout_importance_sampling_mode
        if mode not in IMPORTANCE_SAMPLING_MODES:
            raise ValueError(f"rollout_importance_sampling_mode={mode!r}: expected one of {IMPORTANCE_SAMPLING_MODES}.")
        low, high = self.rollout_importance_sampling_clip_min, self.rollout_importance_sampling_clip_max
        bounds = (("rollout_importance_sampling_clip_min", low), ("rollout_importance_sampling_clip_max", high))
        for name, value in bounds:
            if value is not None and (math.isnan(value) or value < 0):
                raise ValueError(f"{name}={value} must be ≥ 0 or None (no bound).")
        if low is not None and high is not None and low > high:
            raise ValueError(f"rollout_importance_sampling_clip_min={low} exceeds rollout_importance_sampling_clip_max="
                             f"{high}.")
        if not self.rollout_importance_sampling_correction:
            return
        refusal = None
        if self.cache_mode == "none":
            refusal = ("cache_mode='none' decodes with full forwards, so the record is exactly the training forward's "
                       "(the ratio is 1 up to float rounding): there is nothing to correct")
        elif self.policy_estimator not in REPLAYING_ESTIMATORS:
            refusal = (f"policy_estimator={self.policy_estimator!r} scores states the rollout never decoded from, so "
                       f"its record does not apply; use one of {REPLAYING_ESTIMATORS}")
        elif not self.temperature > 0:
            refusal = (f"temperature={self.temperature} decodes greedily: no token is sampled, so there is no "
                       "behaviour distribution to correct for")
        if refusal:
            raise ValueError(f"rollout_importance_sampling_correction=True is not supported here: {refusal}. Leave it "
                             "False (the mismatch is still logged as sampling/*).")

    @classmethod
    def refused_grpo_fields(cls) -> dict[str, str]:
        """The GRPOConfig fields this config refuses at a non-default value (:data:`GRPO_FIELDS_REFUSED`)."""
        return dict(GRPO_FIELDS_REFUSED)

    def diffusion_generation_config(self, seed: int | None = None,
                                    block_length: int | None = None) -> DiffusionGenerationConfig:
        """The sampler settings these arguments describe; ``block_length`` stands for :attr:`block_length` when that is
        ``None`` (the trainer passes the model's own, :meth:`~dllm_trl.families.ModelFamily.block_length`)."""
        block_length = self.block_length if self.block_length is not None else block_length
        if block_length is None:
            raise ValueError("block_length=None is the model's own block length, which the trainer resolves from the "
                             "model's family: pass block_length= here, or set RLDFConfig.block_length.")
        return DiffusionGenerationConfig(
            gen_length=self.max_completion_length,
            block_length=block_length,
            unmasking=self.unmasking,
            threshold=self.unmasking_threshold,
            steps=self.diffusion_steps,
            temperature=self.temperature,
            top_p=self.top_p if self.top_p < 1.0 else None,
            top_k=self.top_k if self.top_k else None,
            min_p=self.min_p,
            sampling=self.sampling_style,
            cache=self.cache_mode,
            seed=seed,
        )


def check_grpo_fields(config, refused: dict[str, str]) -> None:
    """What every config of the package does before ``GRPOConfig.__post_init__``: check the launch, refuse the
    GRPOConfig fields in ``refused`` (name -> reason) at a non-default value, and pass settings under the names the
    installed transformers expects."""
    check_launch_environment(config.use_cpu)
    defaults = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    for name, reason in refused.items():
        default = defaults[name].default
        if default is dataclasses.MISSING:
            default = defaults[name].default_factory()
        if getattr(config, name) != default:
            raise ValueError(
                f"{name}={getattr(config, name)!r} is not supported by {type(config).__name__}: {reason}. Leave it at "
                f"TRL's default ({default!r})."
            )
    # TRL turns checkpointing off around each rollout and back on with these kwargs passed to torch's checkpoint as
    # they are: transformers' own keys would hold until the first rollout, then every layer is checkpointed on device.
    for key, default in (("every_n_layers", 1), ("offload", False)):
        value = (config.gradient_checkpointing_kwargs or {}).get(key, default)
        if value != default:
            raise ValueError(
                f"gradient_checkpointing_kwargs={{{key!r}: {value!r}}} is not supported: TRL re-enables checkpointing "
                f"after every rollout without it (every layer checkpointed, nothing offloaded from then on). Remove "
                f"{key!r} from gradient_checkpointing_kwargs."
            )
    if config.dataloader_pin_memory and not torch.accelerator.is_available():
        config.dataloader_pin_memory = False  # nothing to pin for; the DataLoader would warn on every run
    # Newer transformers renamed gradient_checkpointing* to activation_checkpointing* and warn whenever the old
    # name is set — which GRPOConfig's own default (True) always does. Pass the value under the new name.
    for old_name, new_name in (("gradient_checkpointing", "activation_checkpointing"),
                               ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
        if hasattr(config, new_name) and getattr(config, new_name) is None and getattr(config, old_name) is not None:
            setattr(config, new_name, getattr(config, old_name))
            setattr(config, old_name, None)
