"""The Monte-Carlo ELBO of ``log p(continuation | context)`` (``dllm_trl.losses.elbo``) against slow references: the
exact ELBO by enumerating every mask with hand-built forwards, and a hand-written left-to-right loop."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dllm_trl.losses.elbo import dream_masks, llada_masks, mc_elbo, sequence_elbo
from dllm_trl.toy import load_toy, toy_problems
from dllm_trl.toy.block import load_toy_block
from tests.tiny_models import build_tiny_dream, build_tiny_diffusion_gemma


def hand_logps(model, prompt: list[int], state: list[int], target: list[int]) -> torch.Tensor:
    """(L,) ``log p(target_i | prompt ⊕ state)`` from one plain forward built by hand (a block model's prompt is
    left-padded to a block boundary with masked-out mask tokens, as the sampler's canvas)."""
    config = model.config
    shift = int(config.diffusion_logit_shift)
    block = getattr(config, "diffusion_block_size", None)
    pad = -len(prompt) % block if block else 0
    ids = torch.tensor([[config.mask_token_id] * pad + prompt + state])
    attention = torch.tensor([[0] * pad + [1] * (len(prompt) + len(state))])
    with torch.no_grad():
        logps = model(input_ids=ids, attention_mask=attention).logits[0].double().log_softmax(-1)
    start = pad + len(prompt)
    return torch.stack([logps[start + i - shift, t] for i, t in enumerate(target)])


def segments(model, length):
    block = getattr(model.config, "diffusion_block_size", None) or length
    return [(s, min(s + block, length)) for s in range(0, length, block)]


def exact_elbo(model, prompt: list[int], continuation: list[int]) -> float:
    """Σ over every non-empty mask ``M`` (k tokens) of ``(k−1)!(L−k)!/L! · Σ_{i∈M} log p(x_i | …)``, per block
    for a block model (earlier blocks clean, later absent)."""
    total = 0.0
    mask = model.config.mask_token_id
    for start, stop in segments(model, len(continuation)):
        context, target = prompt + continuation[:start], continuation[start:stop]
        length = len(target)
        for k in range(1, length + 1):
            weight = math.factorial(k - 1) * math.factorial(length - k) / math.factorial(length)
            for masked in itertools.combinations(range(length), k):
                state = [mask if i in masked else t for i, t in enumerate(target)]
                logps = hand_logps(model, context, state, target)
                total += weight * sum(logps[i].item() for i in masked)
    return total


def left_to_right_loop(model, prompt, continuation) -> float:
    total = 0.0
    mask = model.config.mask_token_id
    for start, stop in segments(model, len(continuation)):
        context, target = prompt + continuation[:start], continuation[start:stop]
        for j in range(len(target)):
            state = target[:j] + [mask] * (len(target) - j)
            total += hand_logps(model, context, state, target)[j].item()
    return total


@pytest.fixture(scope="module")
def toy():
    return load_toy()


def toy_request(tokenizer, index=0, eos_count=1):
    """A test problem's prompt ids and its answer's ids followed by ``eos_count`` EOS (the toy's completion form)."""
    prompt, answer = toy_problems("test")[index]
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    continuation = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * eos_count
    return prompt_ids, continuation


def estimates(model, prompt, continuation, estimator, seeds, mc_num=8, stratified=True):
    p, c = torch.tensor(prompt), torch.tensor(continuation)
    return torch.tensor([sequence_elbo(model, p, c, estimator, mc_num, mc_num, torch.Generator().manual_seed(s),
                                       stratified=stratified).value for s in seeds], dtype=torch.float64)


@pytest.mark.parametrize("estimator", ["llada", "dream"])
@pytest.mark.parametrize("which", ["toy", "toy_block"])
def test_mean_of_estimates_is_the_exact_elbo(toy, estimator, which):
    if which == "toy":
        model, tokenizer = toy
        prompt, continuation = toy_request(tokenizer, 4, eos_count=2)  # "48+87=" -> "135" + 2 EOS
    else:  # blocks of 4: "7=13" | "5" EOS, the second block's digit decided by the first block's operand digit
        model, tokenizer = load_toy_block()
        ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        prompt, continuation = ids("48+8"), ids("7=135") + [tokenizer.eos_token_id]
    exact = exact_elbo(model, prompt, continuation)
    values = estimates(model, prompt, continuation, estimator, range(300))
    sem = values.std().item() / len(values) ** 0.5
    assert values.std() > 0.05  # the masks matter on this model: the test can tell a biased estimator
    assert abs(values.mean().item() - exact) < 4 * sem, (values.mean().item(), exact, sem)


def test_left_to_right_is_the_loop_of_forwards(toy):
    dream = build_tiny_dream(vocab_size=32)  # logit shift: the first token is read at the prompt's last position
    for model, tokenizer in (toy, load_toy_block(), (dream, None)):
        prompt, continuation = ([5, 7, 9], [3, 11, 12, 4]) if tokenizer is None else toy_request(tokenizer, 1)
        got = sequence_elbo(model, torch.tensor(prompt), torch.tensor(continuation), "left_to_right",
                            mc_batch_size=2).value
        assert got == pytest.approx(left_to_right_loop(model, prompt, continuation), abs=1e-5)


def test_one_token_is_exact_with_one_state(toy):
    model, tokenizer = toy
    prompt, continuation = toy_request(tokenizer, 2)
    exact = hand_logps(model, prompt, [model.config.mask_token_id], continuation[:1]).item()
    for estimator in ("llada", "dream"):
        got = sequence_elbo(model, torch.tensor(prompt), torch.tensor(continuation[:1]), estimator, 4, 4)
        assert got.value == pytest.approx(exact, abs=1e-5) and got.stderr == 0


def test_seeded_estimates_repeat_and_greedy_is_the_argmax_check(toy):
    model, tokenizer = toy
    prompt, continuation = toy_request(tokenizer, 0)
    p, c = torch.tensor(prompt), torch.tensor(continuation)
    first = sequence_elbo(model, p, c, "llada", 16, 8, torch.Generator().manual_seed(5), with_greedy=True)
    again = sequence_elbo(model, p, c, "llada", 16, 8, torch.Generator().manual_seed(5), with_greedy=True)
    other = sequence_elbo(model, p, c, "llada", 16, 8, torch.Generator().manual_seed(6))
    assert first == again and first.value != other.value and first.stderr > 0
    mask = model.config.mask_token_id
    argmax_ok = all(
        hand_logps(model, prompt, continuation[:j] + [mask] * (len(c) - j), continuation)[j].item()
        >= hand_logps(model, prompt, continuation[:j] + [mask] * (len(c) - j), [t] * len(c))[j].item() - 1e-9
        for j in range(len(c)) for t in range(model.config.vocab_size))
    assert first.greedy is argmax_ok


def test_stratified_rows_have_lower_variance(toy):
    model, tokenizer = toy
    prompt, continuation = toy_request(tokenizer, 4, eos_count=2)
    stratified = estimates(model, prompt, continuation, "llada", range(100))
    plain = estimates(model, prompt, continuation, "llada", range(100), stratified=False)
    assert stratified.var() < plain.var()


def test_mask_draws_have_the_stated_laws():
    generator = torch.Generator().manual_seed(0)
    mask, weight = llada_masks(5, 10, generator)
    assert (mask.sum(1) >= 1).all() and torch.equal(weight, 5 / mask.sum(1).double())
    counts = torch.cat([llada_masks(3, 7, generator)[0].sum(1) for _ in range(3000)])
    assert torch.bincount(counts, minlength=4)[1:].double().div(len(counts)).sub(1 / 3).abs().max() < 0.01
    mask, weight = dream_masks(4, 6, generator)
    k = mask.sum(1).double()
    assert torch.equal(weight, torch.where(k > 0, 5 / k.clamp(min=1), 0.0))
    # Dream's masked count is uniform on {0..L} (t uniform, Bernoulli(t) per token)
    counts = torch.cat([dream_masks(3, 8, generator)[0].sum(1) for _ in range(3000)])
    assert torch.bincount(counts, minlength=4).double().div(len(counts)).sub(1 / 4).abs().max() < 0.01


def test_bad_settings_and_uniform_noise_models_are_refused(toy):
    model, _ = toy
    with pytest.raises(ValueError, match="estimator='elbo'"):
        sequence_elbo(model, torch.tensor([7]), torch.tensor([8]), "elbo")
    with pytest.raises(ValueError, match="mc_num=10 is not a multiple of mc_batch_size=4"):
        mc_elbo(lambda m: torch.zeros(m.shape), 3, "llada", 10, 4, torch.Generator())
    with pytest.raises(ValueError, match="DiffusionGemma"):
        sequence_elbo(build_tiny_diffusion_gemma(), torch.tensor([7]), torch.tensor([8, 9]))
