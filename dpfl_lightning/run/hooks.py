"""The plugins of a run by hook: which of them run at each point of a round, in their order."""

from __future__ import annotations

from typing import Any

from dpfl_lightning.plugins.callback import FederatedCallback

HOOKS = ("before_round", "on_client_start", "on_before_optimizer_step", "wrap_optimizer", "on_client_end",
         "on_client_released", "on_aggregate", "on_server_update", "on_round_end", "on_fit_start", "on_fit_end",
         "evaluation_params")


def overrides(plugin: Any, hook: str) -> bool:
    return getattr(type(plugin), hook) is not getattr(FederatedCallback, hook)


class HookTable:
    """``table[hook]``: the plugins that implement ``hook``, in plugin order."""

    def __init__(self, plugins: list[FederatedCallback]) -> None:
        self.plugins = plugins
        self._by_hook = {h: [p for p in plugins if overrides(p, h)] for h in HOOKS}
        self.bounders = [p for p in plugins if overrides(p, "value_bound")]
        #: clients train on the rank where their state lives (see dpfl_lightning.federated.placement)
        self.keeps_client_state = any(p.keeps_client_state for p in plugins)

    def __getitem__(self, hook: str) -> list[FederatedCallback]:
        return self._by_hook[hook]

    def call(self, hook: str, **kwargs: Any) -> None:
        for p in self._by_hook[hook]:
            getattr(p, hook)(**kwargs)

    def changing_local_steps(self) -> list[str]:
        """The plugins that wrap optimizers or change gradients inside local steps (executors refuse
        what they cannot run)."""
        found = self._by_hook["on_before_optimizer_step"] + self._by_hook["wrap_optimizer"]
        return list(dict.fromkeys(type(p).__name__ for p in found))

    def value_bounds(self, segments: list[str], max_client_samples: float, weighting: str) -> dict[str, float | None]:
        """Every payload segment's declared bound for this round (see ``value_bound``)."""
        bounds: dict[str, float | None] = {"nonfinite": 1.0, "skipped": 1.0, "weight": max_client_samples}
        for seg in segments:
            for p in self.bounders:
                bounds[seg] = p.value_bound(segment=seg, bound=bounds.get(seg))
        if weighting == "samples" and bounds.get("update") is not None:
            bounds["update"] *= max_client_samples  # the update is multiplied by the client's weight
        return bounds
