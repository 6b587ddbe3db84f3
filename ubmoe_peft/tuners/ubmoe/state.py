"""The three modes of a wrapped model and the per-model state the wrapped layers read."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModeSpec:
    """What a mode does: whether attention is causal, and which FFN expert(s) run."""

    causal: bool
    ffn: str  # "uni" (original FFN), "bi" (bidirectional expert), "moe" (routed)


# A future attention adapter used only by mode "bi" adds one field here (e.g. attention="bi"), not a new mode system.
MODES: dict[str, ModeSpec] = {
    "uni": ModeSpec(causal=True, ffn="uni"),
    "bi": ModeSpec(causal=False, ffn="bi"),
    "moe": ModeSpec(causal=True, ffn="moe"),
}


class ModeState:
    """Mode and routing statistics of one wrapped model; every UBMoE layer of that model holds the same object."""

    def __init__(self) -> None:
        self.mode = "moe"
        self.adapters_enabled = True
        self.token_mask: torch.Tensor | None = None  # (B, S) 1 = real token, from the last forward's attention_mask
        self.routing: dict[int, torch.Tensor] | None = None  # layer index -> what record() kept, last moe forward
        self.routing_mask: torch.Tensor | None = None  # token_mask of that forward
        self.attention_hooked = False  # whether the layers' mode-bi attention adapters are hooked in (mode bi only)

    @property
    def spec(self) -> ModeSpec:
        return MODES[self.mode]

    def begin_forward(self, attention_mask: torch.Tensor | None) -> None:
        self.token_mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        if self.mode == "moe" and self.adapters_enabled:
            self.routing = {}
            self.routing_mask = self.token_mask

    def record(self, layer_idx: int, bi_weight: torch.Tensor) -> None:
        """Keep a layer's routing without a graph: top-1 router logits (B, T, 2) or the top-2 bi weight (B, T).

        Only a reference is kept; the share is computed when asked for (`shares`), because reducing it here, in every
        layer at every decode step, cost more than the router itself.
        """
        if self.routing is None:
            self.routing, self.routing_mask = {}, self.token_mask
        self.routing[layer_idx] = bi_weight  # callers pass tensors without a graph (detached)

    def shares(self) -> dict[int, float] | None:
        """{layer index: share of real tokens sent to the bi expert} for the last mode-moe forward, or None."""
        if not self.routing:
            return None
        result = {}
        for layer_idx, routed in sorted(self.routing.items()):
            weight = (routed[..., 1] > routed[..., 0] if routed.dim() == 3 else routed).float()  # (B, T)
            mask = self.routing_mask
            if mask is not None and mask.shape[0] == weight.shape[0] and mask.shape[1] >= weight.shape[1]:
                real = mask[:, -weight.shape[1] :].to(weight.device, torch.float32)  # (B, T), the current tokens
                share = (weight * real).sum() / real.sum().clamp_min(1.0)
            else:
                share = weight.mean()
            result[layer_idx] = float(share)
        return result
