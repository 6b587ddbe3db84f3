"""The wrapped FFN: the original FFN (unidirectional expert), a bidirectional expert and a token-level router.

Routing (Mixtral / Qwen3-MoE form, experts ordered [uni, bi])::

    logits = x W_r^T                 W_r: (2, C), bias-free, zero at init
    p      = softmax(logits)
    top-1: e = bi if logits_bi > logits_uni else uni     (ties -> uni: a fresh router is the base model)
           y = (p_e / sg(p_e)) * E_e(x)                  (= E_e(x) exactly; sg = stop-gradient)
    top-2: y = p_uni * E_uni(x) + p_bi * E_bi(x)

``p_e / sg(p_e)`` is Mixtral's top-k renormalisation ``p_e / sum(top-k p)`` with the denominator detached: the value
is exactly 1, as in an exported Mixtral-style model, but the router still receives d loss / d p_e (with a plain
renormalisation the top-1 weight is the constant 1 and the router would get no gradient at all). That gradient only
says whether to scale the chosen expert up or down (``router_gradient="scale"``); by default a training router sees
both experts instead (``"compare"``, `UBMoELayer._compare`): same value, gradient from their difference.

At inference (and in training with ``"scale"``) top-1 never runs two FFNs on a token. A LoRA expert shares the base
projections, so the FFN runs once and each projection adds ``B A x * scale`` with ``scale`` zero on the rows routed to
uni (a forward hook on the projection, which keeps the FFN's own forward - whatever the architecture - untouched); those
rows stay bit-identical to the base FFN's, and the rank-r product they cost is cheaper than gathering and scattering the
routed rows. A copy expert runs only on its rows, and so does a LoRA expert at inference once its rows are enough for
merged weights to pay (`_split`, `lora._project`). At inference, Llama-style gated MLPs run written out instead of
through modules and hooks (`lora._gated_mlp_forward`): the same math with fewer Python calls per layer and decode step.
At decode sizes top-1 mode moe runs through a plan made once per layer and adapter (`decode.planned_moe`): the same
outputs, with the lookups and hook checks of every call done once."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ...architectures import ATTENTION_NAMES, linear_projections
from .bnb import is_quantized_linear, make_dense_copy
from .config import UBMoEConfig
from .decode import DecodePlan, planned_moe
from .lora import (
    _dropout_while_trained,
    _gated_mlp_forward,
    _intercepted,
    _is_gated_mlp,
    _lora_delta,
    _lora_pair,
    _merge_pays,
    merged_weight,
)
from .state import ModeState

_ROUTER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HOST_ROUTING_TOKENS = 64  # top-1 decides on the host for at most this many tokens per forward (decode steps)


def _module_key(name: str) -> str:
    """A projection's dotted name as a ModuleDict key (dots are not allowed there)."""
    return name.replace(".", "__")


def _module_name(key: str) -> str:
    """The projection's dotted name in the FFN from its ModuleDict key (the inverse of ``_module_key``)."""
    return key.replace("__", ".")


class UBMoELayer(nn.Module, BaseTunerLayer):
    """A UBMoE-wrapped FFN. Adapters live in ModuleDicts keyed by adapter name, next to the untouched ``base_layer``."""

    adapter_layer_names = ("ubmoe_lora_A", "ubmoe_lora_B", "ubmoe_copy", "ubmoe_router", "ubmoe_attn_A", "ubmoe_attn_B")
    other_param_names = ("ubmoe_dropout", "scaling", "top_k", "expert_type", "attention_scaling", "router_gradient")

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: UBMoEConfig,
        state: ModeState,
        layer_idx: int,
        hidden_size: int,
        attention: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.ubmoe_lora_A = nn.ModuleDict()
        self.ubmoe_lora_B = nn.ModuleDict()
        self.ubmoe_copy = nn.ModuleDict()
        self.ubmoe_router = nn.ModuleDict()
        self.ubmoe_dropout = nn.ModuleDict()
        self.ubmoe_attn_A = nn.ModuleDict()  # the optional mode-bi attention adapter, on the sibling attention
        self.ubmoe_attn_B = nn.ModuleDict()
        self.attention_scaling: dict[str, float] = {}
        # The decoder layer's attention, as a plain attribute: it is the parent's child, not ours (state_dict keys).
        object.__setattr__(self, "_attention", attention)
        self._attention_hooks: list[Any] = []
        self.scaling: dict[str, float] = {}
        self.top_k: dict[str, int] = {}
        self.expert_type: dict[str, str] = {}
        self.router_gradient: dict[str, str] = {}
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self._active_adapter = adapter_name
        self._state = state
        self.layer_idx = layer_idx
        self.hidden_size = hidden_size
        self._gated_mlp = _is_gated_mlp(base_layer)  # `_gated_mlp_forward` may apply (a copy is of the same class)
        self._plans: dict[str, DecodePlan] = {}  # per adapter, for `planned_moe` (decode steps)
        self.update_layer(adapter_name, config)

    def __getstate__(self) -> dict:
        # Decode plans are made again: a plan is valid while torch's hook counter stands where it stood, and a pickle
        # loaded in another process sets that counter from the pickled handles, so a hook added after the plan (and
        # before the save) went unseen by one-token forwards
        state = super().__getstate__()  # nn.Module's: drops a compiled forward (`module.compile()`) from the copy
        state["_plans"] = {}
        return state

    # ---- construction -------------------------------------------------------------------------------------------
    def update_layer(self, adapter_name: str, config: UBMoEConfig) -> None:
        """Add adapter ``adapter_name``: a bi expert (LoRA deltas or an FFN copy) and a zero-initialised router."""
        self._plans.pop(adapter_name, None)
        ref = next(self.base_layer.parameters())
        device = ref.device
        if config.expert_type == "lora":
            projections = selected_projections(self.base_layer, config)
            a_dict, b_dict = nn.ModuleDict(), nn.ModuleDict()
            for name, proj in projections.items():
                # B = 0: the bi expert starts as the original FFN
                a_dict[_module_key(name)], b_dict[_module_key(name)] = _lora_pair(proj, config.r, device)
            self.ubmoe_lora_A[adapter_name], self.ubmoe_lora_B[adapter_name] = a_dict, b_dict
            self.ubmoe_dropout[adapter_name] = nn.Dropout(config.lora_dropout) if config.lora_dropout else nn.Identity()
            self.scaling[adapter_name] = config.scaling
        else:
            self.ubmoe_copy[adapter_name] = make_dense_copy(self.base_layer)
        if config.attention_r:
            self._add_attention_adapter(adapter_name, config, device)
        router = nn.Linear(self.hidden_size, 2, bias=False, device=device, dtype=_ROUTER_DTYPES[config.router_dtype])
        nn.init.zeros_(router.weight)  # equal logits -> every token to the uni expert (our tie rule)
        self.ubmoe_router[adapter_name] = router
        self.top_k[adapter_name] = config.top_k
        self.expert_type[adapter_name] = config.expert_type
        self.router_gradient[adapter_name] = config.router_gradient
        for name in (*self.adapter_layer_names, "ubmoe_dropout"):  # new modules start in training mode: follow ours
            modules = getattr(self, name)
            if adapter_name in modules:
                modules[adapter_name].train(self.training)
        self.set_adapter(self.active_adapters)

    def drop_adapter(self, adapter_name: str) -> None:
        """Remove every part of adapter ``adapter_name`` from this layer, keeping the active adapter names as they are
        (PEFT's ``delete_adapter`` would switch to another; here the same name is about to be added again)."""
        for name in (*self.adapter_layer_names, *self.other_param_names):
            if adapter_name in getattr(self, name):  # ModuleDict.pop takes no default
                del getattr(self, name)[adapter_name]
        self._plans.pop(adapter_name, None)

    def enable_adapters(self, enabled: bool) -> None:
        # PEFT's layer-level switch (the only one on a model made with inject_adapter_in_model, and what transformers'
        # disable_adapters() calls): disabled adapters also mean causal attention, as UBMoEModel's switch sets.
        super().enable_adapters(enabled)
        self._state.adapters_enabled = enabled

    def delete_adapter(self, adapter_name: str) -> None:
        # A decode plan holds the adapter's modules: PEFT's deletion would leave them (a copy expert's whole FFN) alive.
        self._plans.pop(adapter_name, None)
        super().delete_adapter(adapter_name)

    def _add_attention_adapter(self, adapter_name: str, config: UBMoEConfig, device: torch.device) -> None:
        """LoRA on every linear layer of the decoder layer's attention, used only in mode bi (see `_attention_on`)."""
        if self._attention is None:
            raise ValueError(
                f"UBMoEConfig(attention_r={config.attention_r}) adds an attention adapter, but decoder layer "
                f"{self.layer_idx} has no self-attention module UBMoE can find (named one of {list(ATTENTION_NAMES)}). "
                "Use attention_r=0."
            )
        a_dict, b_dict = nn.ModuleDict(), nn.ModuleDict()
        for name, proj in linear_projections(self._attention).items():
            # B = 0: mode bi starts as the base attention, made bidirectional
            pair = _lora_pair(proj, config.attention_r, device)
            a_dict[_module_key(name)], b_dict[_module_key(name)] = pair
        self.ubmoe_attn_A[adapter_name], self.ubmoe_attn_B[adapter_name] = a_dict, b_dict
        self.attention_scaling[adapter_name] = config.lora_scaling(config.attention_r)
        if adapter_name not in self.ubmoe_dropout:
            self.ubmoe_dropout[adapter_name] = nn.Dropout(config.lora_dropout) if config.lora_dropout else nn.Identity()
        self.set_attention_hooks(self._state.attention_hooked)

    def _attention_on(self, module: nn.Module, args: tuple) -> None:
        if self._state.spec.ffn != "bi":  # modes uni and moe (every decode step): return before anything else
            return
        self._drop_attention_deltas()  # left by a call that never reached `_attention_off` (KeyboardInterrupt)
        adapter = self._current_adapter()
        if adapter is None or adapter not in self.ubmoe_attn_A:
            return
        self._refuse_fsdp_units(adapter)  # the attention runs before this layer's own forward checks
        a_weight = next(iter(self.ubmoe_attn_A[adapter].values())).weight
        dropout = _dropout_while_trained(self.ubmoe_dropout[adapter], a_weight)
        scale = self.attention_scaling[adapter]
        self._attention_deltas = [
            module.get_submodule(_module_name(key)).register_forward_hook(
                functools.partial(_lora_delta, a, self.ubmoe_attn_B[adapter][key], dropout, scale)
            )
            for key, a in self.ubmoe_attn_A[adapter].items()
        ]

    def _attention_off(self, module: nn.Module, args: tuple, out: Any) -> None:
        self._drop_attention_deltas()

    def _drop_attention_deltas(self) -> None:
        # PyTorch calls an always-called hook (`_attention_off`) after an Exception, not after a KeyboardInterrupt:
        # deltas left on the projections would then change every mode, and the next mode-bi call add them twice.
        for handle in self.__dict__.pop("_attention_deltas", []):
            handle.remove()

    def set_attention_hooks(self, on: bool) -> None:
        """Hook the attention module for the mode-bi adapter (``on``), or detach from it.

        Around each attention call (also a gradient-checkpointing recompute) the pre/post pair adds the deltas through
        temporary hooks on the projections. The model installs the pair only while it runs in mode bi
        (`UBMoEModel._before_backbone`): in modes uni and moe, every decode step included, the attention module has no
        hook of ours at all (even one that returns at once cost 1-2% of decode throughput, docs/performance.md).
        """
        if on and not self._attention_hooks and self.ubmoe_attn_A:
            self._attention_hooks = [
                self._attention.register_forward_pre_hook(self._attention_on),
                self._attention.register_forward_hook(self._attention_off, always_call=True),
            ]
        elif not on:
            for handle in self._attention_hooks:
                handle.remove()
            self._attention_hooks = []
            self._drop_attention_deltas()

    def remove_attention_hooks(self) -> None:
        """Detach from the attention module (unload, merge): no hook of ours stays behind on the base model."""
        self.set_attention_hooks(False)

    # ---- forward ------------------------------------------------------------------------------------------------
    def _current_adapter(self) -> str | None:
        if self.disable_adapters:
            return None
        active = self.active_adapters
        if len(active) == 1:  # the common case, without a list per layer and token
            return active[0] if active[0] in self.ubmoe_router else None
        if len(active) > 1:  # also adapters on different layers (PEFT's module-level set_adapter(model, [a, b]),
            # which bypasses UBMoEModel.set_adapter): each layer ran its own one, a silent mix
            raise ValueError(
                f"UBMoE runs one adapter at a time, but {list(active)} are active. Choose one with "
                "model.set_adapter(name) (or peft.tuners.tuners_utils.set_adapter(model, name) on a model made with "
                "inject_adapter_in_model)."
            )
        return None  # no active adapter

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not args and not kwargs and not torch.is_grad_enabled() and x.shape[:-1].numel() <= HOST_ROUTING_TOKENS:
            out = planned_moe(self, x)  # decode steps: the same outputs with less Python per call (decode.py)
            if out is not None:
                return out
        adapter = self._current_adapter()
        ffn = self._state.spec.ffn
        if adapter is None or ffn == "uni":
            return self.base_layer(x, *args, **kwargs)
        if args or kwargs:  # dropping them would run another FFN than the decoder asked for, or fail deep inside it
            raise ValueError(self._extra_inputs_error(args, kwargs))
        router = self.ubmoe_router[adapter]
        # torch computes on uninitialised memory with a meta weight, silently; accelerate's offloading (a hook on the
        # module) brings its weights in for the call
        if router.weight.is_meta and not _intercepted(router):
            raise RuntimeError(
                f"Adapter {adapter!r} has its weights on the meta device (made with low_cpu_mem_usage=True, and never "
                "loaded): a forward would compute garbage. Load its weights with set_peft_model_state_dict(model, "
                "state_dict, adapter_name, low_cpu_mem_usage=True), or make it without low_cpu_mem_usage."
            )
        self._refuse_fsdp_units(adapter)
        if ffn == "bi":
            return self._bi_expert(adapter, x)
        return self._moe(adapter, x)

    def _extra_inputs_error(self, args: tuple, kwargs: dict) -> str:
        def shown(value: Any) -> str:
            return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)

        given = [shown(a) for a in args] + [f"{k}={shown(v)}" for k, v in kwargs.items()]
        return (
            f"This model's decoder layer calls its FFN ({type(self.base_layer).__name__}) with the extra arguments "
            f"[{', '.join(given)}] besides the hidden states, and the FFN computes with them (Zamba2's shared FFN "
            "takes the layer index, Moshi's depth decoder the codebook). UBMoE runs its experts on the hidden states "
            f"alone, so mode {self._state.mode!r} cannot run this FFN; mode 'uni' runs it as the base model does. This "
            "architecture is not supported: use one whose decoder layers call the FFN with the hidden states alone."
        )

    def _refuse_fsdp_units(self, adapter: str) -> None:
        """FSDP1 gathers a unit's weights only in its own forward; routers and LoRA weights (of the FFN expert and of
        the attention adapter) are read as tensors, so as units of their own they gave garbage or a bare shape error."""
        modules = [self.ubmoe_router[adapter]]
        for name in ("ubmoe_lora_A", "ubmoe_lora_B", "ubmoe_attn_A", "ubmoe_attn_B"):
            container = getattr(self, name)
            modules.extend(container[adapter].values() if adapter in container else ())
        if any("_fsdp_wrapped_module" in module._modules for module in modules):
            raise RuntimeError(
                f"Adapter {adapter!r}'s routers or LoRA weights are FSDP units of their own (FSDP1 with PEFT's "
                "fsdp_auto_wrap_policy, which transformers' Trainer applies to every PeftModel): UBMoE reads their "
                "weights where FSDP1 has not gathered them. Use FSDP2 (fsdp_version 2 in the Trainer's fsdp_config "
                "or accelerate), or wrap only the decoder layers as FSDP1 units."
            )

    def _bi_expert(self, adapter: str, x: torch.Tensor) -> torch.Tensor:
        """The bi expert on every token."""
        if self.expert_type[adapter] == "copy":
            return self._run_ffn(self.ubmoe_copy[adapter], x).to(x.dtype)
        return self._lora_ffn(adapter, x, self.scaling[adapter])

    def _lora_ffn(self, adapter: str, x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
        """The FFN with the LoRA deltas of ``adapter`` scaled by ``scale`` (a float, or an (N, 1) per-token column).

        At inference the gated MLP runs written out with the deltas inline (`_gated_mlp_forward`). Elsewhere the
        deltas ride on the FFN's own projections through forward hooks that exist only during this call, so the FFN's
        forward - whatever the architecture - runs untouched and once, and a call without a routed token (mode uni, a
        token routed to uni) pays nothing for them: a module without hooks takes PyTorch's fast call path.
        """
        dropout = _dropout_while_trained(self.ubmoe_dropout[adapter], self._lora_a_weight(adapter))
        lora_a, lora_b = self.ubmoe_lora_A[adapter], self.ubmoe_lora_B[adapter]
        if not dropout.training and not _intercepted(*lora_a.values(), *lora_b.values()):
            out = self._written_out(self.base_layer, x, (lora_a, lora_b, scale))
            if out is not None:
                return out
        handles = [
            self.base_layer.get_submodule(_module_name(key)).register_forward_hook(
                functools.partial(_lora_delta, a, self.ubmoe_lora_B[adapter][key], dropout, scale)
            )
            for key, a in self.ubmoe_lora_A[adapter].items()
        ]
        try:
            return self.base_layer(x)
        finally:
            for handle in handles:
                handle.remove()

    def _lora_a_weight(self, adapter: str) -> torch.Tensor:
        """One LoRA A weight of ``adapter``: the expert's dtype and whether it trains (all its weights share both)."""
        return next(iter(self.ubmoe_lora_A[adapter].values())).weight

    def _uni_expert(self, x: torch.Tensor) -> torch.Tensor:
        """The original FFN on every token of ``x`` (at inference the gated MLP written out: bit-identical, faster)."""
        return self._run_ffn(self.base_layer, x)

    def _run_ffn(self, ffn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``ffn(x)`` for the base FFN or a copy expert; at inference the gated MLP written out where it applies."""
        out = self._written_out(ffn, x)
        return ffn(x) if out is None else out

    def _written_out(self, ffn: nn.Module, x: torch.Tensor, lora: tuple | None = None) -> torch.Tensor | None:
        """`_gated_mlp_forward` at inference (no graph recorded) on a gated MLP; None elsewhere."""
        return _gated_mlp_forward(ffn, x, lora) if self._gated_mlp and not torch.is_grad_enabled() else None

    def router_logits(self, adapter: str, x: torch.Tensor) -> torch.Tensor:
        """Router logits in the router's dtype (fp32 by default), also under bf16/fp16 autocast: (B, T, 2)."""
        router = self.ubmoe_router[adapter]
        weight = router.weight  # (2, C)
        if x.dtype != weight.dtype:
            x = x.to(weight.dtype)
        # A module call only where someone listens (aux-loss hooks on routers): at decode sizes the call costs more
        # than the (N, C) x (C, 2) product.
        intercepted = _intercepted(router)
        if not torch.is_autocast_enabled(x.device.type):  # entering a context per layer and token costs ~30 us
            return router(x) if intercepted else F.linear(x, weight)  # (B, T, 2)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return router(x) if intercepted else F.linear(x, weight)  # (B, T, 2)

    def _moe(self, adapter: str, x: torch.Tensor) -> torch.Tensor:
        logits = self.router_logits(adapter, x)  # (B, T, 2)
        if self.top_k[adapter] == 2:
            # Weights and mixture in fp32 at least: with a float16 router, 0.5 * u + 0.5 * u lost u's low bits, so a
            # fresh model was not the base model
            probs = logits.softmax(dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # (B, T, 2)
            self._state.record(self.layer_idx, probs[..., 1].detach(), logits=False)
            uni = self._uni_expert(x)  # (B, T, C)
            bi = self._bi_expert(adapter, x)  # (B, T, C)
            return (probs[..., :1] * uni + probs[..., 1:] * bi).to(x.dtype)  # (B, T, C)

        self._state.record(self.layer_idx, logits if not logits.requires_grad else logits.detach(), logits=True)
        router_trains = torch.is_grad_enabled() and self.ubmoe_router[adapter].weight.requires_grad
        if router_trains and self.router_gradient[adapter] == "compare":
            return self._compare(adapter, x, logits)
        picks: list[bool] | None = None
        if logits.shape[:-1].numel() <= HOST_ROUTING_TOKENS:
            # Decode sizes: one copy of the 2N logits to the host and a comparison in Python replace the compare, sum
            # and sync kernels. After a layer's weights have streamed through the caches every small kernel costs
            # ~20 us on CPU, more than the work it does (docs/performance.md). Same strict rule: ties go to uni.
            picks = [bi > uni for uni, bi in logits.reshape(-1, 2).tolist()]  # (N,): inputs of any rank
            n_bi = sum(picks)
        else:
            to_bi = logits[..., 1] > logits[..., 0]  # (B, T), strict: ties go to the uni expert
            n_bi = int(to_bi.sum())  # one host sync per layer; it lets a layer with no routed token skip the expert
        lora = self.expert_type[adapter] == "lora"
        if picks is not None and (torch.is_grad_enabled() or (0 < n_bi < len(picks) and not lora)):
            to_bi = torch.tensor(picks, dtype=torch.bool, device=x.device).view(logits.shape[:-1])  # (B, T)
        if n_bi == 0:
            out = self._uni_expert(x)  # (B, T, C)
        elif n_bi == logits.shape[:-1].numel():
            out = self._bi_expert(adapter, x)  # (B, T, C)
        elif lora and picks is None and self._merges(adapter, n_bi):
            out = self._split(adapter, x, to_bi)  # prefill sizes: the bi rows on merged weights (`lora._project`)
        elif lora:  # scaling on bi tokens, 0 on uni tokens (their output stays exact)
            scale = self.scaling[adapter]
            # In the rank-r side's dtype (a model cast whole to bf16 has bf16 LoRA weights), not torch's default one.
            dtype = self._lora_a_weight(adapter).dtype
            if picks is not None:  # the column built on the host in one op
                rows = [[scale if pick else 0.0] for pick in picks]
                column = torch.tensor(rows, dtype=dtype, device=x.device)  # (N, 1)
            else:
                column = to_bi.reshape(-1, 1).to(dtype) * scale  # (N, 1)
            out = self._lora_ffn(adapter, x, column)  # (B, T, C)
        else:
            out = self._split(adapter, x, to_bi)  # (B, T, C)

        # Top-1 needs p only for the router's gradient.
        if router_trains:
            probs = logits.softmax(dim=-1)  # (B, T, 2)
            p_sel = torch.where(to_bi, probs[..., 1], probs[..., 0])  # (B, T)
            gate = p_sel / p_sel.detach()  # (B, T), exactly 1, gradient 1/p
            out = out * gate.unsqueeze(-1).to(out.dtype)  # (B, T, C)
        return out

    def _compare(self, adapter: str, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Top-1 while the router trains, with ``router_gradient="compare"``: the chosen expert's output, plus
        ``(p_bi - sg(p_bi)) * (E_bi(x) - E_uni(x))``, which is exactly 0 but gives the router
        ``d loss / d p_bi = <d loss / d y, E_bi(x) - E_uni(x)>``: how much better the bi expert's output would be for
        the token than the uni expert's (a straight-through estimator).

        Why not the top-1 path below: there only the chosen expert runs, and its ``p / sg(p)`` gate tells the router
        only whether to scale that expert's output up or down. From a zero router every token whose gradient says
        "scale the base FFN down" flips to the bi expert whether or not that expert is better, and on SmolLM2 the
        demo's router stage then made held-out chats worse than the base model (docs/usage.md). Both experts run on
        every token here, so a router step costs about one more FFN pass (docs/performance.md).
        """
        to_bi = (logits[..., 1] > logits[..., 0]).unsqueeze(-1)  # (B, T, 1), strict: ties go to uni
        p_bi = logits.softmax(dim=-1)[..., 1:]  # (B, T, 1)
        uni = self._uni_expert(x)  # (B, T, C)
        bi = self._bi_expert(adapter, x).to(uni.dtype)  # (B, T, C)
        chosen = torch.where(to_bi, bi, uni)  # (B, T, C)
        # The term's gradient reaches the router only (through the experts it is (p - sg(p)) * g = 0), hence the
        # detach; an expert's non-finite output where it was not chosen (fp16 overflow) made its value 0 * inf = NaN.
        diff = torch.nan_to_num((bi - uni).detach(), nan=0.0, posinf=0.0, neginf=0.0)  # (B, T, C)
        return chosen + ((p_bi - p_bi.detach()) * diff).to(chosen.dtype)  # (B, T, C), value: chosen

    def _merges(self, adapter: str, rows: int) -> bool:
        """Whether the LoRA expert of ``adapter`` on ``rows`` tokens at once runs on merged weights: at inference, on
        a written-out gated MLP whose projections are plain linears, where `lora._merge_pays` says so."""
        if not self._gated_mlp or torch.is_grad_enabled():
            return False
        key = next(iter(self.ubmoe_lora_A[adapter]))  # gate, up and down share the threshold
        proj = self.base_layer._modules.get(_module_name(key))
        if type(proj) is not nn.Linear:
            return False
        return _merge_pays(rows, proj.weight, self.ubmoe_lora_B[adapter][key].weight, self.scaling[adapter])

    def _split(self, adapter: str, x: torch.Tensor, to_bi: torch.Tensor) -> torch.Tensor:
        """Top-1 with each expert only on its own tokens: a copy expert, or a LoRA expert whose routed rows run on
        merged weights (`_merges`). Mixed routing on the rank-r path with a per-token scale column (`_moe`) kept a
        LoRA expert's uni rows bit-identical to the base FFN on the whole batch, but cost 4-6% of a prefill at this
        size; split, the LoRA expert at 50% bi read 1.006x the base against 1.055x (docs/performance.md). Uni rows
        are still exactly the base FFN's on those rows."""
        flat = x.reshape(-1, x.shape[-1])  # (N, C)
        rows_bi = to_bi.reshape(-1).nonzero().squeeze(1)  # (R,)
        rows_uni = (~to_bi).reshape(-1).nonzero().squeeze(1)  # (N - R,)
        out_uni = self._uni_expert(flat.index_select(0, rows_uni).unsqueeze(0)).squeeze(0)  # (N - R, C)
        out_bi = self._bi_expert(adapter, flat.index_select(0, rows_bi).unsqueeze(0)).squeeze(0)  # (R, C)
        out = out_uni.new_empty(flat.shape[0], out_uni.shape[-1])  # (N, C)
        out = out.index_copy(0, rows_uni, out_uni).index_copy(0, rows_bi, out_bi.to(out.dtype))  # (N, C)
        return out.view(*x.shape[:-1], out.shape[-1])  # (B, T, C)

    # ---- merging (mode bi as a plain FFN) ----------------------------------------------------------------------
    def bi_weights(self, adapter: str, check_finite: bool = False) -> dict[str, torch.Tensor]:
        """{projection name in the FFN: weight of the bi expert}, in the base's dtype: the copy's weights, or
        ``W + scale * B A`` (`merged_weight`, at least fp32 math) for LoRA-adapted projections and ``W`` for the
        others. Nothing is written; every check of a merge or an export happens here, before anything changes."""
        quantized = [name for name, module in self.base_layer.named_modules() if is_quantized_linear(module)]
        if quantized:
            raise ValueError(
                f"Cannot merge or export layer {self.layer_idx}: its FFN has the quantized layers {quantized}, and a "
                "merged or exported model is a plain dense model. Load the base model without quantization "
                "(dtype=torch.bfloat16 or float32), load the adapter onto it with PeftModel.from_pretrained(base, "
                "adapter_dir), then merge."
            )
        source = self.ubmoe_copy[adapter] if self.expert_type[adapter] == "copy" else self.base_layer
        weights = {name: proj.weight.detach() for name, proj in linear_projections(source).items()}  # (out, in)
        lora_a = self.ubmoe_lora_A[adapter] if adapter in self.ubmoe_lora_A else {}
        for key, a in lora_a.items():
            name = _module_name(key)
            b = self.ubmoe_lora_B[adapter][key].weight
            weights[name] = merged_weight(weights[name], a.weight, b, self.scaling[adapter])  # (out, in)
        if check_finite:
            broken = [name for name, weight in weights.items() if not bool(torch.isfinite(weight).all())]
            if broken:
                raise ValueError(
                    f"The bi expert of adapter {adapter!r} has NaN/inf weights in {broken} of layer {self.layer_idx} "
                    "(safe_merge=True checked before changing any weight); the adapter is broken."
                )
        return weights

    def bi_ffn(self, adapter: str, weights: dict[str, torch.Tensor]) -> nn.Module:
        """The bi expert as a plain FFN of the base's own classes, from ``bi_weights(adapter)``: the FFN copy, or
        ``base_layer`` with the merged weights written into it."""
        if self.expert_type[adapter] == "copy":
            return self.ubmoe_copy[adapter].requires_grad_(False)
        with torch.no_grad():
            for key in self.ubmoe_lora_A[adapter]:
                name = _module_name(key)
                self.base_layer.get_submodule(name).weight.copy_(weights[name])
        return self.base_layer

    def attention_weights(self, adapter: str, check_finite: bool = False) -> dict[str, torch.Tensor]:
        """{projection name in the attention: ``W + scale * B A``} (`merged_weight`) for the mode-bi
        attention adapter; empty without one. Nothing is written."""
        if adapter not in self.ubmoe_attn_A:
            return {}
        weights = {}
        for key, a in self.ubmoe_attn_A[adapter].items():
            proj = self._attention.get_submodule(_module_name(key))
            if is_quantized_linear(proj):
                raise ValueError(
                    f"Cannot merge layer {self.layer_idx}'s attention adapter into the quantized {_module_name(key)}; "
                    "load the base model without quantization, load the adapter onto it, then merge."
                )
            b, scale = self.ubmoe_attn_B[adapter][key].weight, self.attention_scaling[adapter]
            weights[_module_name(key)] = merged_weight(proj.weight.detach(), a.weight, b, scale)  # (out, in)
        if check_finite and not all(bool(torch.isfinite(w).all()) for w in weights.values()):
            raise ValueError(
                f"The attention adapter of {adapter!r} has NaN/inf weights in layer {self.layer_idx} (safe_merge=True "
                "checked before changing any weight); the adapter is broken."
            )
        return weights

    def merge_attention(self, weights: dict[str, torch.Tensor]) -> None:
        """Write ``attention_weights(...)`` into the attention projections (the bi merge; the attention is then
        the bidirectional model's for good)."""
        with torch.no_grad():
            for name, weight in weights.items():
                self._attention.get_submodule(name).weight.copy_(weight)

    # ---- PEFT protocol ------------------------------------------------------------------------------------------
    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise merge_unsupported()

    def unmerge(self) -> None:
        raise NotImplementedError("UBMoE adapters are never merged, so there is nothing to unmerge.")

    def expert_parameters(self, adapter: str) -> list[nn.Parameter]:
        """Parameters of the bi expert of ``adapter`` (and of its mode-bi attention adapter, if any)."""
        experts = (self.ubmoe_lora_A, self.ubmoe_lora_B, self.ubmoe_copy, self.ubmoe_attn_A, self.ubmoe_attn_B)
        mods = [d[adapter] for d in experts if adapter in d]
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
        "A UBMoE adapter is not merged layer by layer: a routed 2-expert FFN has no dense equivalent in mode 'moe'. "
        "Use model.merge_and_unload(target='bi') for the dense embedding model, keep the adapter separate "
        "(model.save_pretrained), or call model.unload() for the base model."
    )
