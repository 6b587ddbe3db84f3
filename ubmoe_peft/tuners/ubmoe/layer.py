"""The wrapped FFN: the original FFN (unidirectional expert), a bidirectional expert and a token-level router.

Routing (Mixtral / Qwen3-MoE form, experts ordered [uni, bi])::

    logits = x W_r^T                 W_r: (2, C), bias-free, zero at init
    p      = softmax(logits)
    top-1: e = bi if logits_bi > logits_uni else uni     (ties -> uni: a fresh router is the base model)
           y = (p_e / sg(p_e)) * E_e(x)                  (= E_e(x) exactly; sg = stop-gradient)
    top-2: y = p_uni * E_uni(x) + p_bi * E_bi(x)

``p_e / sg(p_e)`` is Mixtral's top-k renormalisation ``p_e / sum(top-k p)`` with the denominator detached: the value
is exactly 1, as in an exported Mixtral-style model, but the router still receives d loss / d p_e (with a plain
renormalisation the top-1 weight is the constant 1 and the router would get no gradient at all).

Top-1 never runs both experts on a token. A LoRA expert shares the base projections, so the FFN runs once and each
projection adds ``B A x * scale`` only on the rows routed to bi (a forward hook on the projection, which keeps the
FFN's own forward - whatever the architecture - untouched). A copy expert runs only on its rows.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ...architectures import linear_projections
from .bnb import make_dense_copy
from .config import UBMoEConfig
from .state import ModeState

_ROUTER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _module_key(name: str) -> str:
    """A projection's dotted name as a ModuleDict key (dots are not allowed there)."""
    return name.replace(".", "__")


def _lora_hook(layer_ref: weakref.ref, key: str, module: nn.Module, args: tuple, output: torch.Tensor) -> Any:
    """Forward hook on a base projection: adds the active LoRA delta on the routed rows, if a route is set."""
    layer = layer_ref()
    route = None if layer is None else layer._route
    if route is None:
        return None
    adapter, rows = route
    lora_a = layer.ubmoe_lora_A[adapter]
    if key not in lora_a:
        return None
    # Weights are used functionally (F.linear) and dropout only when it is active: at decode sizes the per-call
    # overhead of module calls, not the rank-r matmuls, was the hook's cost (docs/performance.md).
    a_weight, b_weight = lora_a[key].weight, layer.ubmoe_lora_B[adapter][key].weight  # (r, C_in), (C_out, r)
    x = args[0].reshape(-1, args[0].shape[-1])  # (N, C_in)
    out = output.reshape(-1, output.shape[-1])  # (N, C_out)
    if rows is not None:
        x = x.index_select(0, rows)  # (R, C_in), only the tokens routed to bi
    if x.dtype != a_weight.dtype:
        x = x.to(a_weight.dtype)
    dropout = layer.ubmoe_dropout[adapter]
    if dropout.training:
        x = dropout(x)  # (R, C_in)
    # Scale the rank-r side, not the (R, C_out) delta: the elementwise passes over wide tensors, not the LoRA matmuls,
    # were the LoRA expert's prefill overhead (benchmarks/bench_prefill.py, docs/performance.md).
    h = F.linear(x, a_weight) * layer.scaling[adapter]  # (R, r)
    inplace = not torch.is_grad_enabled()  # no graph to keep: add into the projection's fresh output, no new tensor
    if rows is None and b_weight.dtype == out.dtype:
        fused = out.addmm_(h, b_weight.t()) if inplace else torch.addmm(out, h, b_weight.t())  # (N, C_out)
        return fused.view(output.shape)
    delta = F.linear(h, b_weight).to(out.dtype)  # (R, C_out)
    if rows is None:
        out = out.add_(delta) if inplace else out + delta  # (N, C_out)
    else:
        out = out.index_add_(0, rows, delta) if inplace else out.index_add(0, rows, delta)  # (N, C_out)
    return out.view(output.shape)


class _LoraHook:
    """The forward hook on one base projection. It holds its layer weakly (no reference cycle); a deep copy of the
    model (TRL's reference model, EMA copies) gets hooks that point to the copied layer, never the original's."""

    def __init__(self, layer_ref: weakref.ref, key: str) -> None:
        self.layer_ref, self.key = layer_ref, key

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> Any:
        return _lora_hook(self.layer_ref, self.key, module, args, output)

    def __deepcopy__(self, memo: dict) -> _LoraHook:
        layer = self.layer_ref()
        copied = memo.get(id(layer)) if layer is not None else None  # the layer is copied before its projections
        return _LoraHook(weakref.ref(copied), self.key) if copied is not None else self


class UBMoELayer(nn.Module, BaseTunerLayer):
    """A UBMoE-wrapped FFN. Adapters live in ModuleDicts keyed by adapter name, next to the untouched ``base_layer``."""

    adapter_layer_names = ("ubmoe_lora_A", "ubmoe_lora_B", "ubmoe_copy", "ubmoe_router")
    other_param_names = ("ubmoe_dropout", "scaling", "top_k", "expert_type")

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: UBMoEConfig,
        state: ModeState,
        layer_idx: int,
        hidden_size: int,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.ubmoe_lora_A = nn.ModuleDict()
        self.ubmoe_lora_B = nn.ModuleDict()
        self.ubmoe_copy = nn.ModuleDict()
        self.ubmoe_router = nn.ModuleDict()
        self.ubmoe_dropout = nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        self.top_k: dict[str, int] = {}
        self.expert_type: dict[str, str] = {}
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self._active_adapter = adapter_name
        self._state = state
        self.layer_idx = layer_idx
        self.hidden_size = hidden_size
        self._route: tuple[str, torch.Tensor | None] | None = None
        self._hook_handles: list[torch.utils.hooks.RemovableHandle] = []
        self.update_layer(adapter_name, config)

    # ---- construction -------------------------------------------------------------------------------------------
    def update_layer(self, adapter_name: str, config: UBMoEConfig) -> None:
        """Add adapter ``adapter_name``: a bi expert (LoRA deltas or an FFN copy) and a zero-initialised router."""
        ref = next(self.base_layer.parameters())
        device = ref.device
        if config.expert_type == "lora":
            projections = selected_projections(self.base_layer, config)
            a_dict, b_dict = nn.ModuleDict(), nn.ModuleDict()
            for name, proj in projections.items():
                dtype = torch.float64 if proj.weight.dtype == torch.float64 else torch.float32
                a = nn.Linear(proj.in_features, config.r, bias=False, device=device, dtype=dtype)
                b = nn.Linear(config.r, proj.out_features, bias=False, device=device, dtype=dtype)
                nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))  # as PEFT's LoRA
                nn.init.zeros_(b.weight)  # delta 0: the bi expert starts as the original FFN
                a_dict[_module_key(name)], b_dict[_module_key(name)] = a, b
            self.ubmoe_lora_A[adapter_name], self.ubmoe_lora_B[adapter_name] = a_dict, b_dict
            self.ubmoe_dropout[adapter_name] = nn.Dropout(config.lora_dropout) if config.lora_dropout else nn.Identity()
            self.scaling[adapter_name] = config.scaling
            self._register_lora_hooks(projections)
        else:
            self.ubmoe_copy[adapter_name] = make_dense_copy(self.base_layer, self._hook_handles)
        router = nn.Linear(self.hidden_size, 2, bias=False, device=device, dtype=_ROUTER_DTYPES[config.router_dtype])
        nn.init.zeros_(router.weight)  # equal logits -> every token to the uni expert (our tie rule)
        self.ubmoe_router[adapter_name] = router
        self.top_k[adapter_name] = config.top_k
        self.expert_type[adapter_name] = config.expert_type
        self.set_adapter(self.active_adapters)

    def _register_lora_hooks(self, projections: dict[str, nn.Linear]) -> None:
        hooked = {h.id for h in self._hook_handles}
        for name, proj in projections.items():
            if any(hid in proj._forward_hooks for hid in hooked):
                continue  # another adapter of this layer already hooked this projection
            hook = _LoraHook(weakref.ref(self), _module_key(name))
            self._hook_handles.append(proj.register_forward_hook(hook))

    def remove_hooks(self) -> None:
        """Detach the LoRA hooks from the base projections (on unload)."""
        ids = {handle.id for handle in self._hook_handles}
        for module in self.base_layer.modules():  # not handle.remove(): a deep copy's handles point to the original
            for hook_id in ids:
                module._forward_hooks.pop(hook_id, None)
        self._hook_handles.clear()

    # ---- forward ------------------------------------------------------------------------------------------------
    def _current_adapter(self) -> str | None:
        if self.disable_adapters:
            return None
        present = [a for a in self.active_adapters if a in self.ubmoe_router]
        if len(present) > 1:
            raise ValueError(
                f"UBMoE runs one adapter at a time, but {present} are active. Choose one with model.set_adapter(name)."
            )
        return present[0] if present else None

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        adapter = self._current_adapter()
        ffn = self._state.spec.ffn
        if adapter is None or ffn == "uni":
            return self.base_layer(x, *args, **kwargs)
        if ffn == "bi":
            return self._bi_expert(adapter, x, rows=None)
        return self._moe(adapter, x)

    def _bi_expert(self, adapter: str, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The bi expert on all tokens (``rows`` None), or the whole FFN output with the bi expert on ``rows`` only."""
        if self.expert_type[adapter] == "copy":
            return self.ubmoe_copy[adapter](x).to(x.dtype)  # rows are handled by _moe for copies
        self._route = (adapter, rows)
        try:
            return self.base_layer(x)
        finally:
            self._route = None

    def router_logits(self, adapter: str, x: torch.Tensor) -> torch.Tensor:
        """Router logits in the router's dtype (fp32 by default), also under bf16/fp16 autocast: (B, T, 2)."""
        router = self.ubmoe_router[adapter]
        if not torch.is_autocast_enabled(x.device.type):  # entering a context per layer and token costs ~30 us
            return router(x.to(router.weight.dtype))  # (B, T, 2)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return router(x.to(router.weight.dtype))  # (B, T, 2)

    def _moe(self, adapter: str, x: torch.Tensor) -> torch.Tensor:
        logits = self.router_logits(adapter, x)  # (B, T, 2)
        if self.top_k[adapter] == 2:
            probs = logits.softmax(dim=-1)  # (B, T, 2)
            self._state.record(self.layer_idx, probs[..., 1])
            uni = self.base_layer(x)  # (B, T, C)
            bi = self._bi_expert(adapter, x, rows=None)  # (B, T, C)
            return (probs[..., :1] * uni + probs[..., 1:] * bi).to(x.dtype)  # (B, T, C)

        to_bi = logits[..., 1] > logits[..., 0]  # (B, T), strict: ties go to the uni expert
        self._state.record(self.layer_idx, to_bi)
        rows_bi = to_bi.reshape(-1).nonzero().squeeze(1)  # (R,)
        n_tokens = to_bi.numel()
        if rows_bi.numel() == 0:
            out = self.base_layer(x)  # (B, T, C)
        elif rows_bi.numel() == n_tokens:
            out = self._bi_expert(adapter, x, rows=None)  # (B, T, C)
        elif self.expert_type[adapter] == "lora":
            out = self._bi_expert(adapter, x, rows=rows_bi)  # (B, T, C)
        else:
            out = self._split_copy(adapter, x, to_bi, rows_bi)  # (B, T, C)

        router = self.ubmoe_router[adapter]
        if torch.is_grad_enabled() and router.weight.requires_grad:  # top-1 needs p only for the router's gradient
            probs = logits.softmax(dim=-1)  # (B, T, 2)
            p_sel = torch.where(to_bi, probs[..., 1], probs[..., 0])  # (B, T)
            gate = p_sel / p_sel.detach()  # (B, T), exactly 1, gradient 1/p
            out = out * gate.unsqueeze(-1).to(out.dtype)  # (B, T, C)
        return out

    def _split_copy(self, adapter: str, x: torch.Tensor, to_bi: torch.Tensor, rows_bi: torch.Tensor) -> torch.Tensor:
        """Copy expert top-1: each expert runs only on its own tokens."""
        flat = x.reshape(-1, x.shape[-1])  # (N, C)
        rows_uni = (~to_bi).reshape(-1).nonzero().squeeze(1)  # (N - R,)
        out_uni = self.base_layer(flat.index_select(0, rows_uni).unsqueeze(0)).squeeze(0)  # (N - R, C)
        out_bi = self.ubmoe_copy[adapter](flat.index_select(0, rows_bi).unsqueeze(0)).squeeze(0)  # (R, C)
        out = out_uni.new_empty(flat.shape[0], out_uni.shape[-1])  # (N, C)
        out = out.index_copy(0, rows_uni, out_uni).index_copy(0, rows_bi, out_bi.to(out.dtype))  # (N, C)
        return out.view(*x.shape[:-1], out.shape[-1])  # (B, T, C)

    # ---- PEFT protocol ------------------------------------------------------------------------------------------
    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise merge_unsupported()

    def unmerge(self) -> None:
        raise NotImplementedError("UBMoE adapters are never merged, so there is nothing to unmerge.")

    def expert_parameters(self, adapter: str) -> list[nn.Parameter]:
        """Parameters of the bi expert of ``adapter``."""
        mods = [d[adapter] for d in (self.ubmoe_lora_A, self.ubmoe_lora_B, self.ubmoe_copy) if adapter in d]
        return [p for m in mods for p in m.parameters()]

    def router_parameters(self, adapter: str) -> list[nn.Parameter]:
        """Parameters of the router of ``adapter``."""
        return list(self.ubmoe_router[adapter].parameters()) if adapter in self.ubmoe_router else []


def selected_projections(ffn: nn.Module, config: UBMoEConfig) -> dict[str, nn.Linear]:
    """The FFN's linear layers that get LoRA deltas (all of them, or ``config.ffn_projections``)."""
    found = linear_projections(ffn)
    if config.ffn_projections is None:
        return found
    missing = [p for p in config.ffn_projections if p not in found]
    if missing:
        raise ValueError(
            f"UBMoEConfig(ffn_projections={config.ffn_projections}) names {missing}, which the FFN "
            f"{type(ffn).__name__} does not have; its linear layers are {sorted(found)}."
        )
    return {p: found[p] for p in config.ffn_projections}


def merge_unsupported() -> NotImplementedError:
    return NotImplementedError(
        "Merging a UBMoE adapter into the base weights is not available yet: a routed 2-expert FFN has no dense "
        "equivalent in mode 'moe'. Keep the adapter separate (model.save_pretrained) or call model.unload()."
    )
