"""Which modules of a mixture-of-experts model route tokens to experts, and which experts they chose in a forward.

transformers' MoE layers (Glm4Moe, onto which LLaDA2 loads; Qwen3-MoE, Mixtral, DeepSeek-V3 …) call a router module,
a class named ``*Router``, that returns ``(router logits, top-k weights, top-k expert indices (tokens, k))``: the
indices are a token's expert set at that layer. :class:`RoutingCapture` reads them with forward hooks that exist only
inside its ``with`` block, so a model that is not being observed runs exactly as before.
"""

from __future__ import annotations

import torch
from torch import nn

from .engines import unwrap_model


def router_modules(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of ``model`` (through any engine or PEFT wrapper), in the order of its layers."""
    return [module for module in unwrap_model(model).modules() if type(module).__name__.endswith("Router")]


class RoutingCapture:
    """Inside ``with RoutingCapture(model) as routing:``, every forward's expert choices, read by :meth:`take`.

    Refuses a model without routers (a dense model has no routing to record).
    """

    def __init__(self, model: nn.Module):
        self.routers = router_modules(model)
        if not self.routers:
            raise ValueError(
                f"{type(unwrap_model(model)).__name__} has no mixture-of-experts router (a module class named "
                "'*Router', as in transformers' MoE models), so there is no routing to record."
            )
        self._handles, self._chosen = [], []

    def __enter__(self) -> RoutingCapture:
        self._handles = [router.register_forward_hook(self._keep) for router in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._chosen = [], []

    def _keep(self, module, args, output) -> None:
        indices = output[-1] if isinstance(output, tuple) else None
        if not (torch.is_tensor(indices) and indices.dim() == 2 and not indices.is_floating_point()):
            raise TypeError(f"{type(module).__name__} does not return (logits, weights, expert indices (tokens, k)) as "
                            "transformers' MoE routers do, so its expert choices cannot be read.")
        self._chosen.append(indices.detach())

    def take(self) -> torch.Tensor:
        """(tokens, MoE layers, k): the experts each router chose for each token of the one forward run since the
        last ``take`` (tokens in the order of that forward's flattened ``(batch, sequence)``)."""
        if len(self._chosen) != len(self.routers):
            raise RuntimeError(f"Expected one forward through the {len(self.routers)} routers since the last take, "
                               f"saw {len(self._chosen)} router calls.")
        chosen, self._chosen = torch.stack(self._chosen, dim=1), []
        return chosen
