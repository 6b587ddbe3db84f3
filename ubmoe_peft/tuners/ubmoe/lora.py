"""The LoRA pieces of a UBMoE layer and the gated MLP written out: the math `layer.UBMoELayer` runs per projection,
kept apart from the layer's routing and bookkeeping.

- LoRA deltas ``out + scale * B A x`` (`_add_lora`), added through a temporary forward hook on a projection
  (`_lora_delta`) or inline (`_gated_mlp_forward`); ``scale`` is a float or a per-token column that is 0 on rows
  routed to the uni expert.
- `_gated_mlp_forward`: a Llama-style gated MLP's forward written out for inference, where Python's per-call cost is
  of the order of the matmuls (decode).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """A LoRA B weight (C_out, r) stored transposed, ``B^T`` contiguous: same shape, values and saved file.

    ``out + h B^T`` then reads B^T row by row. With PyTorch's CPU BLAS that made the (N, r) x (r, C_out) product
    2-3x faster at decode sizes (N = 1: 7.4 vs 3.0 us for C_out = 1536) and a training forward and backward through
    it 25% faster at N = 2048, never slower (benchmarks in docs/performance.md). A layout, not a cached copy: nothing
    can go stale, and where an operation drops it the math is the same, only slower.
    """
    return weight.t().contiguous().t()  # (C_out, r), strides (1, C_out)


_NO_DROPOUT = nn.Identity().eval()  # stands in for the dropout of a frozen LoRA expert (`UBMoELayer._lora_ffn`)


def _dropout_while_trained(dropout: nn.Module, lora_a: torch.Tensor) -> nn.Module:
    """The LoRA dropout while the LoRA weights train; none on frozen ones (stage router, or an adapter loaded for
    inference in train mode), which then run as at inference, like a copy expert. Dropout regularizes training the
    LoRA weights; on frozen ones it would only show the router a noisier expert than it will route to, and it cost
    about 5% of a router step (docs/performance.md)."""
    return dropout if dropout.training and lora_a.requires_grad else _NO_DROPOUT


def _lora_pair(proj: nn.Module, r: int, device: torch.device) -> tuple[nn.Linear, nn.Linear]:
    """LoRA's A (r, C_in), initialised as PEFT's LoRA, and B (C_out, r), zero and `column_major`, for ``proj``: in
    fp32 (fp64 on an fp64 base, whose merges then keep its precision), whatever the base's compute dtype."""
    dtype = torch.float64 if getattr(proj.weight, "dtype", None) == torch.float64 else torch.float32
    a = nn.Linear(proj.in_features, r, bias=False, device=device, dtype=dtype)
    nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))  # as PEFT's LoRA
    b = nn.Linear(r, proj.out_features, bias=False, device=device, dtype=dtype)
    b.weight = nn.Parameter(column_major(torch.zeros_like(b.weight)))  # delta 0
    return a, b


def _lora_delta(
    a: nn.Linear,
    b: nn.Linear,
    dropout: nn.Module,
    scale: float | torch.Tensor,
    module: nn.Module,
    args: tuple,
    out: Any,
) -> torch.Tensor:
    """Forward hook on a base projection, installed only for one routed FFN call (or one mode-bi attention call):
    adds ``scale * B A x`` to its output.

    ``scale`` is the adapter's scaling (every row routed to bi) or an (N, 1) column that is the scaling on the rows
    routed to bi and 0 on the others, whose output then stays bit-identical to the base projection's.
    """
    # Weights are used functionally (F.linear) and dropout only when it is active: at decode sizes the per-call
    # overhead of module calls, not the rank-r matmuls, was the hook's cost (docs/performance.md).
    x = args[0].reshape(-1, args[0].shape[-1])  # (N, C_in)
    if dropout.training:
        x = dropout(x.to(a.weight.dtype))  # (N, C_in)
    flat = out.reshape(-1, out.shape[-1])  # (N, C_out)
    if _intercepted(a, b):
        # Hooks that put the weights in place only during a call (accelerate's offloading keeps them on the meta
        # device otherwise): the deltas through the modules' calls.
        h = a(x.to(a.weight.dtype)) * scale  # (N, r)
        return (flat + b(h).to(flat.dtype)).view(out.shape)
    return _add_lora(flat, x, a.weight, b.weight, scale).view(out.shape)


def _add_lora(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float | torch.Tensor
) -> torch.Tensor:
    """``out + scale * x A^T B^T`` for out (N, C_out), x (N, C_in), A (r, C_in), B (C_out, r); written into ``out``
    when no graph is recorded. ``scale`` is a float or an (N, 1) column (see `_lora_delta`)."""
    h = F.linear(x if x.dtype == a.dtype else x.to(a.dtype), a)  # (N, r)
    alpha = 1.0
    if isinstance(scale, torch.Tensor) or b.dtype != out.dtype:
        # Scale the rank-r side, not the (N, C_out) delta: elementwise passes over wide tensors, not the LoRA matmuls,
        # were the LoRA expert's prefill overhead. A zero-scaled row costs a rank-r product, far less than the gather
        # of the routed rows and the scatter of their deltas it replaces (bench_prefill.py, docs/performance.md).
        h = h * scale  # (N, r)
    else:
        alpha = scale  # a float scale rides on the matmul: one small op fewer per projection (decode)
    inplace = not torch.is_grad_enabled()  # no graph to keep: add into the projection's fresh output, no new tensor
    if b.dtype == out.dtype:
        return out.addmm_(h, b.t(), alpha=alpha) if inplace else torch.addmm(out, h, b.t(), alpha=alpha)  # (N, C_out)
    delta = F.linear(h, b).to(out.dtype)  # (N, C_out)
    return out.add_(delta) if inplace else out + delta  # (N, C_out)


def _is_gated_mlp(ffn: nn.Module) -> bool:
    """Whether ``ffn``'s class runs the gated MLP of Llama, Mistral, Qwen2/3, Gemma 1-3, OLMo 2, Granite, SmolLM3 and
    others: LlamaMLP's very forward (same bytecode, so a subclass that changes the computation is not taken for one).
    Whether its projections are plain linears is checked at each call (`_gated_mlp_forward`): they can be swapped."""
    try:
        from transformers.models.llama.modeling_llama import LlamaMLP
    except ImportError:  # a transformers without it: every FFN keeps the generic paths
        return False
    forward, reference = type(ffn).forward.__code__, LlamaMLP.forward.__code__
    return (forward.co_code, forward.co_names, forward.co_consts) == (
        reference.co_code,
        reference.co_names,
        reference.co_consts,
    )


def _gated_mlp_forward(
    ffn: nn.Module, x: torch.Tensor, lora: tuple[nn.ModuleDict, nn.ModuleDict, float | torch.Tensor] | None = None
) -> torch.Tensor | None:
    """A gated MLP's forward (`_is_gated_mlp`) written out, for inference: ``down(act(gate(x)) * up(x))``, with the
    LoRA deltas ``lora = (A, B, scale)`` (`_add_lora`) inline on the projections they name. None where calling the
    modules would do more than their math: a projection that is not a plain linear (quantized), or a hook or a
    replaced forward on the MLP, a projection or the activation (e.g. accelerate's offloading).

    Why by hand: at decode sizes Python's per-call costs are of the order of the matmuls. On a CPU, a step of one
    token spent about 70 us per layer in the MLP module's own four module calls, and adding the LoRA deltas through
    three temporary hooks cost about 130 us more than adding them here (bench_layer.py, docs/performance.md).
    Outputs are the module's (without deltas) and the hook path's (with them); rows scaled by 0 stay bit-identical
    to the module's.
    """
    get = ffn._modules.get  # four lookups, not a generator: this runs per layer and decode step
    gate, up, down, act = get("gate_proj"), get("up_proj"), get("down_proj"), get("act_fn")
    if type(gate) is not nn.Linear or type(up) is not nn.Linear or type(down) is not nn.Linear:
        return None
    if not x.is_contiguous():  # nn.Linear adds a bias to a strided 3-D input separately: other bits than addmm's
        return None
    if not isinstance(act, nn.Module) or _intercepted(ffn, gate, up, down, act):
        return None
    flat = x.reshape(-1, x.shape[-1])  # (N, C)
    if lora is None:
        out = _gated_mlp_math((gate, up, down, act), flat)  # (N, C)
    else:
        lora_a, lora_b, scale = lora
        deltas = tuple((lora_a[n].weight, lora_b[n].weight) if n in lora_a else None for n in GATED_PROJECTIONS)
        out = _gated_mlp_math((gate, up, down, act), flat, deltas, scale)  # (N, C)
    return out.view(*x.shape[:-1], out.shape[-1])  # (B, T, C); -1 is ambiguous on 0 tokens


GATED_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _gated_mlp_math(
    parts: tuple[nn.Linear, nn.Linear, nn.Linear, nn.Module],
    flat: torch.Tensor,
    deltas: tuple | None = None,
    scale: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` on rows ``flat`` (N, C), from ``parts`` = (gate, up, down, act) that are plain
    linears (their weights are read from ``_parameters``, without ``Module.__getattr__``). ``deltas``: one
    (A weight, B weight) LoRA pair or None per projection of `GATED_PROJECTIONS`, added by `_add_lora` at ``scale``.
    Straight-line code: it runs per layer and decode step."""
    gate, up, down, act = parts
    gate_p, up_p, down_p = gate._parameters, up._parameters, down._parameters
    if deltas is None:  # the original FFN
        hidden = act.forward(F.linear(flat, gate_p["weight"], gate_p["bias"])) * F.linear(
            flat, up_p["weight"], up_p["bias"]
        )  # (N, I)
        return F.linear(hidden, down_p["weight"], down_p["bias"])  # (N, C)
    on_gate, on_up, on_down = deltas
    hidden = act.forward(_project(flat, gate_p, on_gate, scale)) * _project(flat, up_p, on_up, scale)  # (N, I)
    return _project(hidden, down_p, on_down, scale)  # (N, C)


def _project(flat: torch.Tensor, params: dict, delta: tuple | None, scale: float | torch.Tensor) -> torch.Tensor:
    """One projection of `_gated_mlp_math`: ``flat W^T + bias`` with the LoRA pair ``delta`` = (A weight, B weight)
    added at ``scale`` (none: the base projection).

    Where every row takes the delta (a float ``scale``) and the rows outnumber what the product ``B A`` costs
    (`_merge_pays`), the projection runs once on ``W + scale * B A`` (`merged_weight`, what a merge into a dense
    model computes) instead of adding the rank-r path: at prefill and embedding sizes that path's two thin matmuls
    and its extra pass over the (N, C_out) output cost more than building the merged weight, which is freed when the
    projection returns (benchmarks/bench_prefill.py, docs/performance.md).
    """
    weight, bias = params["weight"], params["bias"]
    if delta is None:
        return F.linear(flat, weight, bias)
    a, b = delta
    if _merge_pays(flat.shape[0], weight, b, scale):
        return F.linear(flat, merged_weight(weight, a, b, scale), bias)
    return _add_lora(F.linear(flat, weight, bias), flat, a, b, scale)


def _merge_pays(rows: int, weight: torch.Tensor, b: torch.Tensor, scale: float | torch.Tensor) -> bool:
    """Whether `_project` runs on the merged weight: every row takes the delta (a float scale), the weight and the
    LoRA weights share a dtype of at least fp32 (so the merged weight holds the delta as exactly as the rank-r path
    does), and ``rows * (C_in + C_out) >= C_in * C_out``: the rank-r path's matmuls then cost at least the product
    ``B A``, and the merged weight takes no more memory than the projection's input and output together."""
    c_out, c_in = weight.shape
    if rows * (c_in + c_out) < c_in * c_out or isinstance(scale, torch.Tensor):  # first: decode steps stop here
        return False
    return weight.dtype == b.dtype and weight.dtype in (torch.float32, torch.float64)


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B A`` for W (C_out, C_in), A (r, C_in), B (C_out, r), computed in at least fp32 and returned in
    W's dtype: the bi expert's weight in a merge or an export (`UBMoELayer.bi_weights`) and in `_project`, one
    function so that both give the same bits."""
    dtype = torch.promote_types(weight.dtype, torch.float32)
    # A weight to compute with or to write, never to differentiate; and in fp32 even under autocast, which would
    # run addmm in bf16/fp16 (entered only when on: the context costs ~30 us).
    device = weight.device.type
    off = torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()
    with torch.no_grad(), off:
        return torch.addmm(weight.to(dtype), b.to(dtype), a.to(dtype), alpha=scale).to(weight.dtype)  # (C_out, C_in)


def _intercepted(*modules: nn.Module) -> bool:
    """Whether calling any of ``modules`` does more than its forward: global forward hooks, its own, a forward
    replaced on the instance (accelerate's offloading) or an in-place ``module.compile()``. Where it does, we call
    the module instead of its math."""
    hooks = nn.modules.module  # the global hooks, as Module.__call__ itself checks them
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return True
    for module in modules:
        if module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__:
            return True
        if getattr(module, "_compiled_call_impl", None) is not None:  # module.compile(): run what it compiled
            return True
    return False
