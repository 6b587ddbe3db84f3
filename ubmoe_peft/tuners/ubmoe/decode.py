"""The planned path of a UBMoE layer: top-1 mode moe at inference, at decode sizes (`planned_moe`).

A decode step runs every wrapped FFN on one token (or one per sequence), and on a CPU the Python around its few
kernels costs as much as they do once a layer's weights have streamed through the caches. Finding the adapter,
mode, router, FFN modules, LoRA weights and dropout, and checking that none of a dozen modules has a hook, cost about
2-3% of a SmolLM2-135M decode step (docs/performance.md). A plan finds all that once per layer and adapter; each call
then checks only what can change under it, cheaply:

- a hook registered anywhere (a module's or a global one) since the plan was made: PyTorch numbers every hook handle
  from one counter (`RemovableHandle.next_id`), so an unchanged counter means no new hook, and a changed one makes a
  new plan, which is negative (the general path) wherever a module is hooked;
- each module the plan calls around is still its parent's child under that name, of the same class (a
  parametrization swaps it), without a forward replaced on it (accelerate's offloading) or compiled in place; a
  change makes a new plan;
- the mode, disabled adapters, the active adapter, autograd, autocast, an active LoRA dropout, the input's layout.

A negative plan re-checks the modules it found hooked, so a removed hook brings the plan back.
Anything else takes the general path in `layer.py`, whose outputs these are, bit for bit (tested).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import lora as lora_math

if TYPE_CHECKING:
    from .layer import UBMoELayer


class DecodePlan(NamedTuple):
    hook_id: int  # `RemovableHandle.next_id` when the plan was made
    router: nn.Module | None  # None: a negative plan, this adapter takes the general path
    checked: tuple[tuple[nn.Module, str, nn.Module | None, type], ...] = ()  # (parent, name, module, class)
    hooked: tuple[nn.Module, ...] = ()  # a negative plan's modules that were hooked (`lora._intercepted`)
    ffn: tuple = ()  # (gate, up, down, act) of the original FFN
    copy: tuple | None = None  # the same of a copy expert
    lora: tuple | None = None  # (A's, B's parameter dicts) or None per projection of a LoRA expert
    dropout: nn.Module | None = None


_GATED_CHILDREN = (*lora_math.GATED_PROJECTIONS, "act_fn")


def make_plan(layer: UBMoELayer, adapter: str) -> DecodePlan:
    """A plan for ``adapter`` on ``layer``, or a negative one (``router=None``) where the general path must run.

    A negative plan keeps the modules it looked at: when one of them is swapped or (`hooked`) loses its hooks, the
    next call makes a new plan. One for a layer the plan never covers (another FFN, top-2) is made again only after a
    hook registration or an adapter change."""
    hook_id = RemovableHandle.next_id
    router = layer.ubmoe_router._modules.get(adapter)
    if router is None or type(router) is not nn.Linear or not layer._gated_mlp or layer.top_k[adapter] != 1:
        return DecodePlan(hook_id, None)
    ffn = layer.base_layer
    found = [(layer, "base_layer", ffn), (layer.ubmoe_router, adapter, router)]
    found += [(ffn, name, ffn._modules.get(name)) for name in _GATED_CHILDREN]
    linears = [entry[2] for entry in found[2:5]]
    lora = dropout = copy = None
    if layer.expert_type[adapter] == "copy":
        expert = layer.ubmoe_copy[adapter]
        found += [(layer.ubmoe_copy, adapter, expert), *[(expert, n, expert._modules.get(n)) for n in _GATED_CHILDREN]]
        linears += [entry[2] for entry in found[-4:-1]]
        copy = tuple(entry[2] for entry in found[-4:])
    else:
        lora_a, lora_b, dropout = layer.ubmoe_lora_A[adapter], layer.ubmoe_lora_B[adapter], layer.ubmoe_dropout[adapter]
        found += [(layer.ubmoe_lora_A, adapter, lora_a), (layer.ubmoe_lora_B, adapter, lora_b)]
        found += [(layer.ubmoe_dropout, adapter, dropout)]
        found += [(pairs, name, pairs[name]) for pairs in (lora_a, lora_b) for name in pairs]  # LoRA keys: projections
        linears += [*lora_a.values(), *lora_b.values()]
        lora = tuple(
            (lora_a[n]._parameters, lora_b[n]._parameters) if n in lora_a else None  # these dicts live with the modules
            for n in lora_math.GATED_PROJECTIONS
        )
        if any(name not in lora_math.GATED_PROJECTIONS for name in lora_a):
            return DecodePlan(hook_id, None)
    checked = tuple((parent, name, module, type(module)) for parent, name, module in found)
    modules = list({id(entry[2]): entry[2] for entry in checked}.values())
    if any(type(m) is not nn.Linear for m in linears) or not all(isinstance(m, nn.Module) for m in modules):
        return DecodePlan(hook_id, None, checked)  # quantized, parametrized, wrapped or missing modules
    hooked = tuple(m for m in modules if lora_math._intercepted(m))
    if hooked:
        return DecodePlan(hook_id, None, checked, hooked)
    return DecodePlan(hook_id, router, checked, (), tuple(entry[2] for entry in checked[2:6]), copy, lora, dropout)


def _current_plan(layer: UBMoELayer, adapter: str) -> DecodePlan:
    """The layer's plan for ``adapter``, made again where anything it relies on changed (module docstring)."""
    plan = layer._plans.get(adapter)
    if plan is not None and plan.hook_id == RemovableHandle.next_id:
        positive = plan.router is not None
        for parent, name, module, cls in plan.checked:
            if parent._modules.get(name) is not module or module.__class__ is not cls:
                break
            if positive:  # a forward replaced on the instance (accelerate's offloading) or compiled in place
                attributes = module.__dict__
                if "forward" in attributes or attributes.get("_compiled_call_impl") is not None:
                    break
        else:
            if positive or not plan.hooked or lora_math._intercepted(*plan.hooked):
                return plan
    plan = layer._plans[adapter] = make_plan(layer, adapter)
    return plan


def planned_moe(layer: UBMoELayer, x: torch.Tensor) -> torch.Tensor | None:
    """Top-1 mode moe through the layer's plan (see the module docstring), at inference; None where the general path
    must run. Callers ensure no graph is recorded and a decode-sized ``x`` (B, T, C)."""
    state = layer._state
    if state.mode != "moe" or not state.adapters_enabled or layer._disable_adapters:
        return None
    adapter = layer._active_adapter
    if type(adapter) is not str:
        if len(adapter) != 1:
            return None
        adapter = adapter[0]
    plan = _current_plan(layer, adapter)
    router = plan.router
    if router is None or not x.is_contiguous() or torch.is_autocast_enabled(x.device.type):
        return None
    if plan.lora is not None and plan.dropout.training:
        if next(p for p in plan.lora if p is not None)[0]["weight"].requires_grad:  # the dropout applies: hook path
            return None
    weight = router._parameters["weight"]  # (2, C)
    if weight.is_meta:  # never loaded: the general path says so
        return None
    logits = F.linear(x if x.dtype == weight.dtype else x.to(weight.dtype), weight)  # (B, T, 2)
    state.record(layer.layer_idx, logits, logits=True)
    picks = [bi > uni for uni, bi in logits.reshape(-1, 2).tolist()]  # strict: ties go to uni; any input rank
    n_bi = sum(picks)
    flat = x.view(-1, x.shape[-1])  # (N, C)
    if n_bi == 0:
        out = lora_math._gated_mlp_math(plan.ffn, flat)  # (N, C)
    elif plan.copy is not None:
        if n_bi < len(picks):  # each expert on its own rows
            return layer._split(adapter, x, torch.tensor(picks, dtype=torch.bool, device=x.device).view(x.shape[:-1]))
        out = lora_math._gated_mlp_math(plan.copy, flat).to(x.dtype)  # (N, C)
    else:
        deltas = tuple(None if p is None else (p[0]["weight"], p[1]["weight"]) for p in plan.lora)
        scale = layer.scaling[adapter]
        if n_bi < len(picks):  # the scaling on the rows routed to bi, 0 on the others (their output stays exact)
            dtype = next(d for d in deltas if d is not None)[0].dtype  # the rank-r side's (`_add_lora`)
            scale = torch.tensor([[scale if pick else 0.0] for pick in picks], dtype=dtype, device=x.device)
        out = lora_math._gated_mlp_math(plan.ffn, flat, deltas, scale)  # (N, C)
    return out.view(*x.shape[:-1], out.shape[-1])  # (B, T, C); -1 is ambiguous on 0 tokens
