"""The chunked LM head of the scoring passes (models/scoring.py): same values and gradients as one full-vocabulary
log-softmax, and the graph never keeps more than one chunk of logits."""

from __future__ import annotations

import pytest
import torch

from dllm_trl.models.scoring import chunked_head_logps


def _reference(hidden, head, targets):
    log_probs = head(hidden).float().log_softmax(-1)
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(log_probs.exp() * log_probs).sum(-1)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("n", [0, 1, 7, 23])
def test_chunked_head_equals_full_log_softmax(n, with_entropy):
    torch.manual_seed(0)
    vocab, d = 50, 8
    head = torch.nn.Linear(d, vocab, bias=False)
    hidden = torch.randn(n, d, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    weights = torch.randn(n), torch.randn(n)

    expected_logps, expected_entropy = _reference(hidden, head, targets)
    expected = (expected_logps * weights[0]).sum() + (with_entropy and (expected_entropy * weights[1]).sum())
    expected_grads = torch.autograd.grad(expected, [hidden, head.weight], allow_unused=True)

    values = chunked_head_logps(hidden, head, targets, with_entropy, chunk_elements=3 * vocab)  # chunks of 3
    logps, entropy = values if with_entropy else (values, None)
    torch.testing.assert_close(logps, expected_logps.detach())
    if with_entropy:
        torch.testing.assert_close(entropy, expected_entropy.detach())
    total = (logps * weights[0]).sum() + (with_entropy and (entropy * weights[1]).sum())
    grads = torch.autograd.grad(total, [hidden, head.weight], allow_unused=True)
    for got, want in zip(grads, expected_grads):
        if want is None:
            assert got is None or got.abs().max() == 0
        else:
            torch.testing.assert_close(got, want)


def test_graph_keeps_one_chunk_of_logits_at_most():
    """Checkpointed chunks: what the graph saves for the backward is hidden-state sized; no chunk's (n, V) logits
    outlive its own computation."""
    torch.manual_seed(0)
    vocab, d, n, rows_per_chunk = 1000, 8, 64, 4
    head = torch.nn.Linear(d, vocab, bias=False)
    hidden = torch.randn(n, d, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logps, entropy = chunked_head_logps(hidden, head, targets, True, chunk_elements=rows_per_chunk * vocab)
    assert sum(saved) < n * vocab / 4, f"{sum(saved)} values saved for the backward: the logits are kept"
    (logps.sum() + entropy.sum()).backward()  # the recomputation gives the gradient
    assert hidden.grad is not None and hidden.grad.abs().max() > 0


def test_entropy_as_a_metric_has_no_graph():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(9, 8, requires_grad=True)
    targets = torch.randint(0, 50, (9,))
    expected_logps, expected_entropy = _reference(hidden, head, targets)
    logps, entropy = chunked_head_logps(hidden, head, targets, True, chunk_elements=100, entropy_grad=False)
    assert logps.requires_grad and not entropy.requires_grad
    torch.testing.assert_close(entropy, expected_entropy.detach())
    grad, = torch.autograd.grad(logps.sum(), hidden)
    torch.testing.assert_close(grad, torch.autograd.grad(expected_logps.sum(), hidden)[0])
