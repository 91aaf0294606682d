"""Recording the behaviour distribution of a causal LM's own ``generate()`` (SPEC §3.3): its sampler is TRL's
generation, with :class:`BehaviourCapture` appended last to the logits processors."""

from __future__ import annotations

import contextlib

import torch
from transformers import LogitsProcessor

from ..models.engines import unwrap_peft


class BehaviourCapture(LogitsProcessor):
    """Record the distribution each generated token is drawn from: its top-K and ``μ(a)`` of the sampled token.

    Must run *last* in the processor list (see :func:`appended_logits_processor`) so that the scores it sees are
    the ones ``generate()`` samples from. It returns the scores unchanged. ``μ(a)`` of step ``s`` is read at step
    ``s + 1`` from ``input_ids[:, -1]`` (and from ``last_tokens`` in :meth:`finish`), so only one ``(B, V)``
    log-softmax is kept alive.
    """

    def __init__(self, top_k: int):
        self.top_k = top_k
        self.reset()

    def reset(self):
        self._previous = None
        self._topk_ids, self._topk_logps, self._action_logps = [], [], []

    @property
    def num_steps(self) -> int:
        return len(self._topk_logps)

    def _read_action(self, tokens: torch.Tensor):
        if self._previous is not None:
            tokens = tokens.to(self._previous.device).long().view(-1, 1)
            self._action_logps.append(self._previous.gather(-1, tokens).squeeze(-1))
            self._previous = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logps = torch.log_softmax(scores.float(), dim=-1)
        self._read_action(input_ids[:, -1])
        values, ids = logps.topk(self.top_k, dim=-1)
        self._topk_ids.append(ids)
        self._topk_logps.append(values)
        self._previous = logps
        return scores

    def finish(self, last_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """Flush the last step with the tokens sampled there; ``(B, T, K)`` ids / log-probs and ``(B, T)`` μ(a)."""
        self._read_action(last_tokens)
        if not self._topk_logps:
            raise RuntimeError("BehaviourCapture saw no generation step.")
        out = {
            "behaviour_topk_ids": torch.stack(self._topk_ids, dim=1),
            "behaviour_topk_logps": torch.stack(self._topk_logps, dim=1),
            "behaviour_logps": torch.stack(self._action_logps, dim=1),
        }
        self.reset()
        return out


@contextlib.contextmanager
def appended_logits_processor(model, processor: LogitsProcessor):
    """Within the context, every ``model.generate()`` call appends ``processor`` at the very end of the logits
    processor list it builds — after the sampling warpers (temperature, top-k, top-p, min-p …), which
    ``generate()`` puts *after* any user-supplied ``logits_processor``. Yields a dict counting the calls.

    ``model`` may be a PEFT model (the hook goes on its base transformers model).
    """
    target = unwrap_peft(model)
    own = vars(target).get("_get_logits_processor")
    original = target._get_logits_processor
    state = {"calls": 0}

    def build(*args, **kwargs):
        processors = original(*args, **kwargs)
        processors.append(processor)
        state["calls"] += 1
        return processors

    target._get_logits_processor = build
    try:
        yield state
    finally:
        if own is None:
            del target._get_logits_processor
        else:
            target._get_logits_processor = own
