"""The diffusion sampler truncates its tempered logits exactly as ``transformers`` sampling does.

The oracle is transformers itself: the warper list that ``GenerationMixin._get_logits_processor`` builds for a
sampling ``GenerationConfig`` (temperature → top-k → top-p → min-p in the pinned version), applied to the same
logits with the mask token removed. The sampler's distribution (``draw_candidates``' ``log_probs``) must keep the
same tokens and give them the same probabilities.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dllm_trl.generation import draw_candidates
from tests.tiny_models import build_tiny_llada


@pytest.fixture(scope="module")
def hf_model():
    """Any transformers model: only its ``_get_logits_processor`` (the warper list and order) is used."""
    return build_tiny_llada()


def transformers_log_probs(model, logits, mask_token_id, temperature, top_k, top_p, min_p):
    """log-softmax of ``logits`` (..., V) after transformers' own sampling warpers, mask token removed."""
    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    warpers = model._get_logits_processor(config, device="cpu")
    assert all(isinstance(w, (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper))
               for w in warpers), warpers  # nothing else can enter the comparison
    scores = logits.to(torch.float32, copy=True)
    scores[..., mask_token_id] = float("-inf")
    flat = scores.reshape(-1, scores.shape[-1])
    for warper in warpers:
        flat = warper(None, flat)
    return flat.log_softmax(-1).view(scores.shape)


def assert_same_distribution(ours, theirs):
    kept, expected_kept = ours > float("-inf"), theirs > float("-inf")
    assert torch.equal(kept, expected_kept), (
        f"kept {kept.sum(-1).flatten().tolist()} tokens per row, transformers keeps "
        f"{expected_kept.sum(-1).flatten().tolist()}"
    )
    torch.testing.assert_close(ours[kept], theirs[kept])


@pytest.mark.parametrize("sampling", ["gumbel", "categorical"])
def test_issue_example_top_p_then_min_p_keeps_two_tokens(hf_model, sampling):
    """p = (.6, .25, .15), top_p 0.7, min_p 0.3: top-p keeps {.6, .25} (renormalised .71, .29) and min-p, applied
    after it as in transformers, keeps both (.29 ≥ .3 × .71)."""
    mask = 3
    logits = torch.tensor([[math.log(0.6), math.log(0.25), math.log(0.15), 5.0]])
    _, _, log_probs = draw_candidates(logits, mask, 1.0, 0.7, None, sampling, torch.Generator().manual_seed(0),
                                      min_p=0.3)
    assert (log_probs[0, :2] > float("-inf")).all() and (log_probs[0, 2:] == float("-inf")).all()
    torch.testing.assert_close(log_probs[0, :2].exp(), torch.tensor([0.6, 0.25]) / 0.85)
    assert_same_distribution(log_probs, transformers_log_probs(hf_model, logits, mask, 1.0, None, 0.7, 0.3))


@pytest.mark.parametrize("top_k, top_p, min_p", [
    (2, None, 0.5),      # top-k first, then min-p relative to the renormalised best
    (None, 0.8, None),   # cumulative mass meets top_p exactly at a boundary token
    (None, 0.5, 1.0),    # min_p 1: only the ties of the best survive
    (3, 0.9, 0.2),
    (1, 0.3, 0.9),
])
def test_hand_made_boundaries_match_transformers(hf_model, top_k, top_p, min_p):
    probs = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.05, 0.05])
    logits = torch.cat([probs.log(), torch.tensor([9.0])]).expand(2, -1).clone()  # id 6 is the mask
    _, _, log_probs = draw_candidates(logits, 6, 1.0, top_p, top_k, "categorical", torch.Generator().manual_seed(0),
                                      min_p=min_p)
    assert_same_distribution(log_probs, transformers_log_probs(hf_model, logits, 6, 1.0, top_k, top_p, min_p))


@pytest.mark.parametrize("seed", range(12))
def test_random_truncations_match_transformers(hf_model, seed):
    """Random logits (some with ties), temperatures and (top_k, top_p, min_p) combinations, each of the three
    present or absent; rows of (N, V) and (B, L, V) logits alike."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for case in range(25):
        vocab = rng.choice([2, 3, 7, 50, 257])
        shape = (rng.randint(1, 6), vocab) if case % 2 else (2, rng.randint(1, 4), vocab)
        logits = torch.randn(shape, generator=gen) * rng.choice([0.5, 2.0, 6.0])
        if case % 5 == 0:
            logits = logits.round()  # ties between tokens
        mask = rng.randrange(vocab)
        temperature = rng.choice([1.0, 0.4, 0.7, 1.6])
        top_k = rng.choice([None, 1, 2, 5, vocab, vocab + 3])
        top_p = rng.choice([None, 1.0, rng.uniform(0.05, 0.99), 0.5])
        min_p = rng.choice([None, 0.0, rng.uniform(0.01, 0.6), 1.0])
        _, _, log_probs = draw_candidates(logits, mask, temperature, top_p, top_k, "gumbel", gen, min_p=min_p)
        expected = transformers_log_probs(hf_model, logits, mask, temperature, top_k, top_p, min_p)
        assert (log_probs[..., mask] == float("-inf")).all(), "the mask token is never drawn"
        assert_same_distribution(log_probs, expected)
