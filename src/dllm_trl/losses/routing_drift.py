"""Routing drift of a mixture-of-experts policy: does the loss forward send each token to the experts its rollout did?

In an MoE model the experts a token is routed to are a discrete choice made anew in every forward, so two forwards of
the same state can route it differently wherever the router scores are close (another engine's numerics, bf16, a
changed router) — a known source of instability in RL of MoE models, since the trained distribution is then not the
one the rollout drew from. :class:`RoutingDriftMixin` measures it on the tokens where the comparison is exact: for a
sampled step ``t``, the tokens the rollout committed at ``t`` were drawn in the forward of the very state ``o_t`` that
the loss forward scores (for a block-diffusion model over the exact cache of finished blocks), so their expert sets
at every MoE layer should be the same in both.

Metrics (over those tokens of the loss forwards, all processes):

* ``moe/routing_drift``: the fraction of (token, MoE layer) pairs whose top-k expert set differs from the rollout's;
* ``moe/rerouted_token_frac``: the fraction of tokens whose expert set differs at one MoE layer or more;
* ``moe/routing_overlap``: the mean Jaccard overlap ``|A ∩ B| / |A ∪ B|`` of the two sets over the pairs.

On the first pass over a batch (on-policy) they measure numerics and engines only; after an optimizer step on the
batch (``num_iterations > 1``, or off-policy steps) they also hold the update's own change of the routing.
"""

from __future__ import annotations

import contextlib

import torch

from ..models.routing import RoutingCapture, router_modules
from .packed_states import packed_read_positions
from .rldf_loss import RLDFLoss

ROUTING_RECORD = "rollout_routed_experts"
"""Batch key of the rollout's routing record (B, G, MoE layers, k)."""


def expert_set_agreement(rollout: torch.Tensor, trained: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(differs, overlap)`` (..., L) of two sets of top-k expert indices (..., L, k) per (token, layer): whether the
    sets differ, and their Jaccard overlap ``|A ∩ B| / |A ∪ B|`` (the k indices of a set are distinct, their order is
    irrelevant)."""
    shared = (rollout.long().unsqueeze(-1) == trained.long().unsqueeze(-2)).sum((-2, -1))
    k = rollout.shape[-1]
    return shared < k, shared / (2 * k - shared)


class RoutingDriftMixin:
    """Routing-drift metrics (module docstring) for a loss object that scores block-diffusion states in packed
    forwards, mixed in before it: asks the sampler for its routing record (``record_routing``), carries it with the
    batch, and compares it with the loss forward's routing of the tokens committed at each sampled step."""

    def sampler_requests(self) -> dict:
        return {**super().sampler_requests(), "record_routing": True}

    def check_model(self, model) -> None:
        super().check_model(model)
        if not router_modules(model):
            raise ValueError(f"{type(self).__name__} measures the routing of a mixture-of-experts model, and "
                             f"{type(model).__name__} has no router; use {RLDFLoss.__name__}.")
        if not self._packs(model):
            raise ValueError(f"{type(self).__name__} reads the routing of packed block-diffusion forwards; this "
                             "model's states are scored one per forward.")

    def sample_states(self, prompt_ids, prompt_mask, output, generator, mask_seed_generator):
        if output.routed_experts is None:
            raise ValueError(f"{type(self).__name__} needs the rollout's routing record: the sampler returned none "
                             "(it must honour its config's record_routing).")
        trajectory, uncertainty = super().sample_states(prompt_ids, prompt_mask, output, generator, mask_seed_generator)
        trajectory[ROUTING_RECORD] = output.routed_experts
        return trajectory, uncertainty

    def begin(self, inputs, normalizer, beta, epsilon_low, epsilon_high, count_targets=False):
        call = super().begin(inputs, normalizer, beta, epsilon_low, epsilon_high, count_targets)
        shape, device = inputs["target_mask"].shape, inputs["target_mask"].device
        call.extra.update(
            routing_compared=torch.zeros(shape, dtype=torch.bool, device=device),  # (B, k, G)
            routing_changed_layers=torch.zeros(shape, dtype=torch.long, device=device),
            routing_overlap=torch.zeros(shape, device=device),  # summed over the MoE layers
        )
        return call

    @contextlib.contextmanager
    def observe_loss_forward(self, model, batch, rows, steps, packed, read, call):
        with RoutingCapture(model) as routing:
            yield
            chosen = routing.take()
        trained = chosen.view(rows.numel(), packed.input_ids.shape[1], *chosen.shape[1:])
        r, columns, (_, j, i) = packed_read_positions(packed, read, shift=0)  # each read token's own column
        t = batch["sampled_steps"][rows][:, steps][r, j]
        now = (batch["commit_step"][rows[r], i] == t) & batch["valid_mask"][rows[r], i].bool()
        r, columns, j, i = r[now], columns[now], j[now], i[now]
        differs, overlap = expert_set_agreement(batch[ROUTING_RECORD][rows[r], i], trained[r, columns])
        at = (rows[r], torch.as_tensor(steps, device=rows.device)[j], i)
        call.extra["routing_compared"][at] = True
        call.extra["routing_changed_layers"][at] = differs.sum(-1)
        call.extra["routing_overlap"][at] = overlap.sum(-1).float()

    def metric_sums(self, inputs, call) -> dict:
        sums = super().metric_sums(inputs, call)
        compared = call.extra["routing_compared"]
        tokens = compared.sum().float()
        pairs = tokens * inputs[ROUTING_RECORD].shape[-2]
        changed = call.extra["routing_changed_layers"]
        sums["moe/routing_drift"] = (changed.sum().float(), pairs, True)
        sums["moe/rerouted_token_frac"] = ((changed > 0).sum().float(), tokens, True)
        sums["moe/routing_overlap"] = (call.extra["routing_overlap"].sum(), pairs, True)
        return sums


class MoERLDFLoss(RoutingDriftMixin, RLDFLoss):
    """:class:`RLDFLoss` with the routing-drift metrics, for MoE block-diffusion models (LLaDA2): pass
    ``loss=MoERLDFLoss(args)`` to :class:`~dllm_trl.RLDFTrainer`."""
