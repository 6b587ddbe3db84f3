"""Quantized (bitsandbytes) bases: the one place that knows about 4-bit and 8-bit linear layers.

A LoRA expert needs nothing here: bnb's ``Linear4bit`` / ``Linear8bitLt`` subclass ``nn.Linear`` and the LoRA
delta is added by a forward hook on their output, in the adapter's own float dtype. A copy expert must be trainable,
so quantized projections are dequantized into plain ``nn.Linear`` layers in the base's compute dtype.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def is_quantized_linear(module: nn.Module) -> bool:
    """True for bitsandbytes 4-bit and 8-bit linear layers (checked without importing bitsandbytes)."""
    return type(module).__module__.startswith("bitsandbytes") and isinstance(module, nn.Linear)


def dequantized_weight(module: nn.Linear) -> torch.Tensor:
    """The float weight (out, in) of a linear layer, dequantizing bitsandbytes storage."""
    if not is_quantized_linear(module):
        return module.weight.detach()
    import bitsandbytes as bnb

    weight = module.weight
    if getattr(weight, "quant_state", None) is not None:  # 4-bit
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state)  # (out, in)
    scb = getattr(weight, "SCB", None)
    if scb is None:
        scb = getattr(getattr(module, "state", None), "SCB", None)
    if weight.dtype == torch.int8 and scb is not None:  # 8-bit: row-wise absmax scaling
        return weight.data.float() * scb.float().unsqueeze(1) / 127.0  # (out, in)
    return weight.data.float()


def compute_dtype(module: nn.Linear) -> torch.dtype:
    """The dtype a quantized linear computes in (its float dtype for plain layers)."""
    if is_quantized_linear(module):
        dtype = getattr(module, "compute_dtype", None)
        return dtype if isinstance(dtype, torch.dtype) else torch.float32
    return module.weight.dtype


def _to_dense(module: nn.Linear) -> nn.Linear:
    dtype = compute_dtype(module)
    dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, dtype=dtype,
                      device=module.weight.device)
    with torch.no_grad():
        dense.weight.copy_(dequantized_weight(module).to(dtype))
        if module.bias is not None:
            dense.bias.copy_(module.bias.detach().to(dtype))
    return dense


def make_dense_copy(ffn: nn.Module, hook_handles: list) -> nn.Module:
    """A trainable copy of ``ffn`` without our LoRA hooks, with quantized linears dequantized to ``nn.Linear``."""
    ids = {h.id for h in hook_handles}
    replica = copy.deepcopy(ffn)
    for module in replica.modules():
        for hooks in (module._forward_hooks, module._forward_hooks_with_kwargs, module._forward_hooks_always_called):
            for hook_id in ids:
                hooks.pop(hook_id, None)
    for name, module in list(replica.named_modules()):
        if is_quantized_linear(module):
            parent_name, _, child = name.rpartition(".")
            parent = replica.get_submodule(parent_name) if parent_name else replica
            setattr(parent, child, _to_dense(module))
    replica.requires_grad_(True)
    return replica
