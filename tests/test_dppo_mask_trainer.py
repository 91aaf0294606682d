"""End-to-end checks of DPPOMaskTrainer on tiny random causal and diffusion LMs (CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from dllm_trl.losses.rldf_terms import k3_kl
from tests.tiny_models import build_tiny_llada
from dllm_trl.trainers import DPPOMaskConfig, DPPOMaskTrainer
from dllm_trl.trainers.dppo_mask_trainer import appended_logits_processor, detect_model_kind

from .conftest import addition_dataset, length_reward, make_char_tokenizer, tiny_training_args

DPPO_METRICS = (
    "dppo/masked_frac",
    "dppo/masked_frac_pos",
    "dppo/masked_frac_neg",
    "dppo/divergence_mean",
    "dppo/direction_disagree_frac",
    "dppo/is_weight_mean",
    "dppo/mu_from_rollout",
    "dppo/mu_from_old",
    "dppo/mask_disagree_frac",
)


def make_args(tmp_path, **overrides):
    return tiny_training_args(DPPOMaskConfig, tmp_path, **{"num_sampled_timesteps": 2, "divergence_top_k": 4, **overrides})


def digit_reward(completions, **kwargs):
    """Dense toy reward that varies even when no completion ends (EOS) early."""
    return [float(sum(ch in "13579" for ch in c)) for c in completions]


def tiny_causal(family="llama", seed=0):
    tokenizer = make_char_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(seed)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    return Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))


def tiny_diffusion():
    tokenizer = make_char_tokenizer()
    return build_tiny_llada(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                            eos_token_id=tokenizer.eos_token_id)


def make_trainer(tmp_path, model, peft_config=None, reward=length_reward, **overrides):
    return DPPOMaskTrainer(
        model=model,
        reward_funcs=reward,
        args=make_args(tmp_path, **overrides),
        train_dataset=addition_dataset(),
        processing_class=make_char_tokenizer(),
        peft_config=peft_config,
    )


def snapshot(module):
    return {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}


def changed(before, module):
    after = dict(module.named_parameters())
    return [name for name, value in before.items() if not torch.equal(value, after[name].detach())]


def loss_logs(trainer):
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def check_logs(trainer, steps=2):
    logs = loss_logs(trainer)
    assert len(logs) == steps
    for entry in logs:
        assert math.isfinite(entry["loss"])
        for key in (*DPPO_METRICS, *(["kl"] if trainer.beta else [])):
            assert key in entry, key
            assert math.isfinite(entry[key]), key
        assert entry["dppo/mu_from_rollout"] + entry["dppo/mu_from_old"] == pytest.approx(1.0)
        assert 0.0 <= entry["dppo/masked_frac"] <= 1.0
    assert "reward" in logs[0]
    return logs


# ---------------------------------------------------------------------------------------------- the rule by hand
def rule_by_hand(record, args, vocab_size):
    """Recompute D, g and the keep-mask of every recorded token from the SPEC §3 formulas, in float64."""
    mu_ids = record["mu_ids"].long()
    action = record["action"].long()
    adv = record["advantages"].double()
    mu_logp_a = record["mu_action_logps"].double()
    pi_logps = record["pi_support"].double()
    k = mu_ids.shape[1]
    in_topk = (mu_ids == action[:, None]).any(1)
    valid = torch.cat([mu_ids >= 0, ~in_topk[:, None]], dim=1)
    mu = torch.cat([record["mu_logps"].double().exp(), mu_logp_a.exp()[:, None]], dim=1) * valid
    pi = pi_logps.exp() * valid
    mu_tail = (1 - mu.sum(1)).clamp(min=1e-12)
    pi_tail = (1 - pi.sum(1)).clamp(min=1e-12)
    pi_a, mu_a = pi_logps[:, k].exp(), mu_logp_a.exp()
    if args.divergence == "kl":
        seen = torch.where(mu > 0, mu * (mu.clamp(min=1e-12).log() - pi.clamp(min=1e-12).log()), 0.0).sum(1)
        div = seen + mu_tail * (mu_tail.log() - pi_tail.log())
        tail = pi_tail * (pi_tail - mu_tail)
        if args.tail_estimator == "uniform":
            tail = tail / (vocab_size - valid.sum(1))
        g = (pi_a - mu_a) - ((pi * (pi - mu)).sum(1) + tail)
    else:
        div = 0.5 * ((pi - mu).abs().sum(1) + (pi_tail - mu_tail).abs())
        s = torch.sign(pi - mu) * valid
        s_t = torch.sign(pi_tail - mu_tail)
        s_bar = (s * pi).sum(1) + s_t * pi_tail
        tail = pi_tail**2 * (s_t - s_bar)
        if args.tail_estimator == "uniform":
            tail = tail / (vocab_size - valid.sum(1))
        g = 0.5 * ((torch.sign(pi_a - mu_a) - s_bar) * pi_a - (pi**2 * (s - s_bar[:, None]) * valid).sum(1) - tail)
    # TV's direction has sign(π − μ) in it: where a difference is at rounding level (π = μ in float32, so the
    # trainer's sign is 0 while float64's is ±1), the two directions differ by a coin flip, not by the rule.
    signs_clear = torch.ones_like(div, dtype=torch.bool)
    if args.divergence != "kl":
        signs_clear = (((pi - mu).abs() > 1e-6) | ~valid).all(1) & ((pi_tail - mu_tail).abs() > 1e-6)
        signs_clear &= (pi_a - mu_a).abs() > 1e-6
    log_ratio = pi_logps[:, k] - mu_logp_a
    direction = g if args.mask_direction == "predictive" else torch.sign(log_ratio)
    delta = torch.where(adv > 0, args.divergence_threshold_high or args.divergence_threshold,
                        args.divergence_threshold_low or args.divergence_threshold)
    keep = ~((div > delta) & (adv * direction > 0))
    # Tokens whose decision is not a rounding coin-flip: D clearly on one side of δ, and the direction's sign clear
    # where it matters (outside the trust region).
    clear = ((div - delta).abs() > 1e-6) & ((div < delta) | ((adv * direction).abs() > 1e-9))
    weight = log_ratio.exp().clamp(max=args.is_cap)
    return div, g, keep, clear, weight, signs_clear


def check_masks_follow_rule(trainer, vocab_size):
    records = trainer.loss.records
    assert records
    fired = 0
    for record in records:
        div, g, keep, clear, weight, signs_clear = rule_by_hand(record, trainer.args, vocab_size)
        torch.testing.assert_close(record["div"].double(), div, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(record["direction"].double()[signs_clear], g[signs_clear], rtol=1e-3, atol=1e-7)
        torch.testing.assert_close(record["weights"].double(), weight, rtol=1e-5, atol=1e-6)
        assert clear.float().mean() > 0.5
        assert torch.equal(record["keep"][clear], keep[clear])
        fired += int((~record["keep"]).sum())
    return fired


# ------------------------------------------------------------------------------------------------------- config
def test_hooks_exist_in_pinned_libraries():
    """The methods DPPOMaskTrainer overrides or calls into are still there (TRL, RLDFTrainer, transformers)."""
    from transformers.generation.utils import GenerationMixin
    from trl import GRPOTrainer

    from dllm_trl.trainers import RLDFTrainer

    for name in ("_generate_single_turn", "_get_per_token_logps_and_entropies", "_generate_and_score_completions",
                 "_compute_loss"):
        assert hasattr(GRPOTrainer, name), name
    from dllm_trl.losses import RLDFLoss

    for name in ("_loss_normalizer", "make_loss"):
        assert hasattr(RLDFTrainer, name), name
    for name in ("step_loss", "metric_sums", "normalizer", "score_for_policy_pass", "begin"):
        assert hasattr(RLDFLoss, name), name
    assert hasattr(GenerationMixin, "_get_logits_processor")


def test_config_validation_names_the_field(tmp_path):
    for field, value in [
        ("divergence", "js"),
        ("divergence_top_k", -1),
        ("divergence_threshold", -0.1),
        ("divergence_threshold_low", float("nan")),
        ("divergence_threshold_high", -1.0),
        ("mask_direction", "clip"),
        ("tail_estimator", "gaussian"),
        ("is_cap", 0.0),
        ("behaviour_source", "vllm"),
        ("model_kind", "encoder"),
        ("loss_type", "cispo"),
        ("delta", 2.0),
        ("off_policy_mask_threshold", 0.5),
        ("entropy_coef", 0.1),
        ("use_transformers_continuous_batching", True),
    ]:
        with pytest.raises(ValueError, match=field):
            make_args(tmp_path, **{field: value})
    args = make_args(tmp_path)
    assert args.mask_rule == "predictive" and args.tail_estimator == "uniform" and args.divergence_top_k == 4
    from dllm_trl.losses import DiffusionTrustRegionLoss

    assert DiffusionTrustRegionLoss(args, 16, 1.0, 1, 0).record_topk == 4  # what the loss asks the sampler to record
    assert DiffusionTrustRegionLoss(make_args(tmp_path, divergence_top_k=0), 16, 1.0, 1, 0).record_topk == 1
    assert make_args(tmp_path, mask_direction="ratio").mask_rule == "dppo"
    assert make_args(tmp_path, block_length=None, max_completion_length=12).block_length is None  # the model's own
    defaults = DPPOMaskConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert (defaults.divergence, defaults.divergence_top_k, defaults.divergence_threshold, defaults.is_cap) == (
        "kl", 20, 0.15, 20.0)


def test_model_kind_detection_and_vocabulary_check(tmp_path):
    assert detect_model_kind(tiny_diffusion()) == "diffusion"
    plain = tiny_causal()
    assert detect_model_kind(plain) == "causal"
    plain.config.mask_token_id = 1  # a masked model not yet made bidirectional is one (the loss makes it so)
    assert detect_model_kind(plain) == "diffusion"
    with pytest.raises(ValueError, match="divergence_top_k"):
        make_trainer(tmp_path, tiny_diffusion(), divergence_top_k=15)  # 15 tokens, one of them the mask


# --------------------------------------------------------------------------------------------------- causal LMs
def test_causal_capture_is_the_sampled_distribution(tmp_path):
    """μ(a) and the top-K travelling with the batch equal a recomputation with the same temperature / top-k / top-p."""
    temperature, top_k, top_p, k = 0.7, 6, 0.9, 4
    trainer = make_trainer(tmp_path, tiny_causal(), temperature=temperature, top_k=top_k, top_p=top_p, divergence_top_k=k)
    trainer.model.train()
    dataset = addition_dataset()
    batch = trainer._generate_and_score_completions([dataset[i] for i in range(2) for _ in range(4)])
    base = trainer.accelerator.unwrap_model(trainer.model)
    assert "_get_logits_processor" not in vars(base)  # the hook is gone after generation

    prompt_ids, completion_ids = batch["prompt_ids"], batch["completion_ids"]
    mask = batch["completion_mask"].bool()
    assert batch["behaviour_topk_ids"].shape == (*completion_ids.shape, k)
    assert batch["behaviour_logps"].shape == completion_ids.shape
    with torch.no_grad():
        ids = torch.cat([prompt_ids, completion_ids], 1)
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        logits = base(input_ids=ids, attention_mask=attention).logits[:, prompt_ids.shape[1] - 1 : -1].double()
    scores = logits / temperature
    kth = scores.topk(top_k, dim=-1).values[..., -1:]
    scores = scores.masked_fill(scores < kth, float("-inf"))
    ascending, order = scores.sort(dim=-1)
    cumulative = ascending.softmax(-1).cumsum(-1)
    drop = cumulative <= 1 - top_p
    drop[..., -1] = False
    scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    reference = scores.log_softmax(-1)

    sampled = reference.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(batch["behaviour_logps"][mask].double(), sampled[mask], rtol=1e-4, atol=1e-4)
    assert torch.isfinite(batch["behaviour_logps"][mask]).all()
    values, top = reference.topk(k, dim=-1)
    captured = batch["behaviour_topk_logps"].double()
    finite = torch.isfinite(values) & mask.unsqueeze(-1)
    assert torch.equal(torch.isfinite(captured) & mask.unsqueeze(-1), finite)
    torch.testing.assert_close(captured[finite], values[finite], rtol=1e-4, atol=1e-4)
    assert torch.equal(batch["behaviour_topk_ids"][finite], top[finite])
    # The capture saw the truncated distribution, not just logits / T: truncation renormalises the kept tokens up.
    untruncated = (logits / temperature).log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    gain = batch["behaviour_logps"].double() - untruncated
    assert (gain[mask] > -1e-4).all() and (gain[mask] > 1e-2).any()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_causal_train_updates_parameters_and_logs(tmp_path, family):
    trainer = make_trainer(tmp_path, tiny_causal(family), max_steps=1)
    assert trainer.model_kind == "causal"
    assert not hasattr(trainer.model.config, "diffusion_logit_shift")
    before = snapshot(trainer.model)
    trainer.train()
    assert changed(before, trainer.model)
    for entry in check_logs(trainer, steps=1):
        assert entry["dppo/mu_from_rollout"] == 1.0


def test_causal_lora_with_grpo_normalisation(tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = make_trainer(tmp_path, tiny_causal(), peft_config=lora, max_steps=1, loss_type="grpo")
    before = snapshot(trainer.model)
    assert before and all("lora_" in name for name in before)
    trainer.train()
    assert changed(before, trainer.model)
    check_logs(trainer, steps=1)


@pytest.mark.parametrize(
    "direction,divergence,tail,top_k",
    [("predictive", "kl", "uniform", 4), ("ratio", "kl", "aggregated", 0), ("predictive", "tv", "aggregated", 4)],
)
def test_causal_off_policy_masks_follow_the_rule(tmp_path, direction, divergence, tail, top_k):
    """num_iterations = 2 with a large learning rate: the second pass is off-policy, D > 0 and the mask drops exactly
    the tokens the rule says (top_k = 0: DPPO's binary view)."""
    trainer = make_trainer(
        tmp_path, tiny_causal(), reward=digit_reward, num_iterations=2, learning_rate=3e-2, beta=0.0,
        mask_direction=direction, divergence=divergence, tail_estimator=tail, divergence_top_k=top_k,
        divergence_threshold=2e-3, divergence_threshold_high=1e-3,
    )
    trainer.loss.records = []
    trainer.train()
    first, second = trainer.loss.records
    assert first["div"].abs().max() < 1e-4  # on-policy: μ is the sampling distribution itself
    assert second["div"].max() > 1e-3
    assert check_masks_follow_rule(trainer, vocab_size=len(make_char_tokenizer())) > 0
    logs = check_logs(trainer)
    assert logs[1]["dppo/masked_frac"] > 0 and logs[1]["dppo/divergence_mean"] > 0


# ------------------------------------------------------------------------------------------------ diffusion LMs
def test_diffusion_train_updates_parameters_and_logs(tmp_path):
    """On-policy batches with temperature and top-k sampling: μ of tokens committed at t is the rollout record, the
    others take the current policy itself (π_old = π_θ), so their divergence is 0."""
    trainer = make_trainer(tmp_path, tiny_diffusion(), reward=digit_reward, max_steps=1, temperature=0.8, top_k=8,
                           clean_target_threshold=0.05)
    assert trainer.model_kind == "diffusion"
    trainer.loss.records = []
    before = snapshot(trainer.model)
    trainer.train()
    assert changed(before, trainer.model)
    logs = check_logs(trainer, steps=1)
    assert all("rldf/token_utility" in entry for entry in logs)
    tokens = {name: torch.cat([r[name] for r in trainer.loss.records]) for name in trainer.loss.records[0]}
    assert tokens["from_rollout"].any() and (~tokens["from_rollout"]).any()
    own = ~tokens["from_rollout"]
    assert tokens["div"][own].abs().max() < 1e-5
    torch.testing.assert_close(tokens["weights"][own], torch.ones_like(tokens["weights"][own]))


@pytest.mark.parametrize("source", ["rollout", "old"])
def test_diffusion_off_policy_masks_follow_the_rule(tmp_path, source):
    trainer = make_trainer(
        tmp_path, tiny_diffusion(), reward=digit_reward, num_iterations=2, learning_rate=3e-2, behaviour_source=source,
        clean_target_threshold=0.05, divergence_threshold=2e-3,
    )
    trainer.loss.records = []
    trainer.train()
    tokens = {name: torch.cat([r[name] for r in trainer.loss.records]) for name in trainer.loss.records[0]}
    assert tokens["div"].max() > 1e-3
    if source == "old":
        assert not tokens["from_rollout"].any()
    else:
        assert tokens["from_rollout"].any() and (~tokens["from_rollout"]).any()
    assert check_masks_follow_rule(trainer, vocab_size=len(make_char_tokenizer()) - 1) > 0
    logs = check_logs(trainer)
    # The mask replaces PPO clipping and there is no entropy term: neither is logged (as zeros) for DPPO.
    assert not any(key.startswith("clip_ratio/") or key == "entropy" for entry in logs for key in entry)
    if source == "old":
        assert all(entry["dppo/mu_from_old"] == 1.0 for entry in logs)


def test_hook_restores_generation(tmp_path):
    model = tiny_causal()
    with appended_logits_processor(model, lambda ids, scores: scores) as state:
        assert "_get_logits_processor" in vars(model)
    assert "_get_logits_processor" not in vars(model) and state["calls"] == 0


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_causal_checkpoint_resumes_exactly(tmp_path, beta):
    """Save, resume: the same final weights as the uninterrupted run (RNG states, optimizer, step).

    The checkpoint sits at a generation boundary (TRL keeps a rollout batch for ``num_iterations`` steps in memory
    only, so a resume inside that window generates a new batch, as in TRL)."""
    settings = dict(model_kind="causal", max_steps=4, save_strategy="steps", save_steps=2, beta=beta,
                    num_iterations=2)
    trainer = make_trainer(tmp_path, tiny_causal(), reward=digit_reward, **settings)
    trainer.train()
    final = snapshot(trainer.model)
    resumed = make_trainer(tmp_path, tiny_causal(), reward=digit_reward, **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    for name, value in snapshot(resumed.model).items():
        torch.testing.assert_close(value, final[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("iterations", [1, 2])
def test_diffusion_step_loss_matches_a_full_vocabulary_reference(tmp_path, iterations):
    """The loss reads the policy only at the targets, chunk by chunk: its value and gradients equal a plain reference
    that builds the full-vocabulary log-softmax of every state (the sampler's distribution: logits / T, mask token
    excluded) and gathers the support from it; on-policy (1 iteration) μ of the other targets is π's own top-K."""
    from dllm_trl.losses.rldf_terms import noisy_state

    trainer = make_trainer(tmp_path, tiny_diffusion(), reward=digit_reward, max_steps=1, temperature=0.8,
                           num_iterations=iterations, beta=0.05, clean_target_threshold=0.05, bf16=False)
    trainer.train()
    inputs = trainer._buffered_inputs[0]
    assert ("old_topk_ids" in inputs) == (iterations > 1)
    model, top_k = trainer.model, trainer.args.divergence_top_k
    params = [p for p in model.parameters() if p.requires_grad]
    expected = torch.zeros(())
    normalizer = trainer._loss_normalizer(inputs, "train")
    sampled, prompt = inputs["sampled_steps"], inputs["rollout_prompt_ids"]
    for b, j in (sampled != -1).nonzero().tolist():
        t = sampled[b, j]
        state = noisy_state(inputs["rollout_ids"][b : b + 1], inputs["commit_step"][b : b + 1], t.view(1),
                            trainer.loss.mask_token_id)
        ids = torch.cat([prompt[b : b + 1], state], dim=1)
        mask = torch.cat([inputs["rollout_prompt_mask"][b : b + 1], torch.ones_like(state)], dim=1)
        logits = model(input_ids=ids, attention_mask=mask).logits[0, prompt.shape[1]:].float()
        scaled = (logits / trainer.loss.score_temperature).index_fill(-1, torch.tensor([trainer.loss.mask_token_id]),
                                                                   float("-inf"))
        logp, raw = scaled.log_softmax(-1), logits.log_softmax(-1)
        for g in inputs["target_mask"][b, j].nonzero().squeeze(1).tolist():
            a = inputs["rollout_ids"][b, g]
            if inputs["commit_step"][b, g] == t:  # committed at t: the rollout's record (behaviour_source="rollout")
                mu_ids, mu_logps = inputs["rollout_topk_ids"][b, g, :top_k], inputs["rollout_topk_logps"][b, g, :top_k]
                mu_a = inputs["rollout_commit_prob"][b, g].log()
            elif "old_topk_ids" in inputs:
                mu_ids, mu_logps = inputs["old_topk_ids"][b, j, g].long(), inputs["old_topk_logps"][b, j, g]
                mu_a = inputs["old_behaviour_logps"][b, j, g]
            else:
                mu_logps, mu_ids = logp[g].detach().topk(top_k)
                mu_a = logp[g, a].detach()
            support = logp[g].gather(-1, torch.cat([mu_ids.clamp(min=0), a.view(1)]))
            terms, _ = trainer.loss.masked_terms(support[None], mu_ids[None], mu_logps[None], a.view(1), mu_a.view(1),
                                             inputs["advantages"][b].view(1))
            old = inputs["old_per_token_logps"][b, j, g] if "old_per_token_logps" in inputs else raw[g, a].detach()
            kl = trainer.beta * k3_kl(raw[g, a], inputs["ref_per_token_logps"][b, j, g]) * (raw[g, a] - old).exp()
            expected = expected + (terms[0] + kl) * normalizer[b, j]
    want = torch.autograd.grad(expected, params)
    trainer.args.backward_mode = "per_micro_batch"  # one graph, so that autograd.grad sees the whole loss
    loss = trainer._compute_loss(model, inputs)
    got = torch.autograd.grad(loss, params)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
