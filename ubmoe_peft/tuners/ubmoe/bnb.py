"""Quantized (bitsandbytes) bases: the one place that knows about 4-bit and 8-bit linear layers.

Every linear layer is served by one backend, chosen by `backend_for` from ``BACKENDS`` (tried in order, like PEFT's
``dispatch_*`` list; bitsandbytes is imported lazily, only when a bitsandbytes layer is present). A backend says

- ``dequantize(module)``: the float weight ``W ~ Q(W)`` (out, in), what the layer actually multiplies with;
- ``compute_dtype(module)``: the dtype the layer computes in, which is the dtype of a trainable copy (fp32 where that
  would be fp16, which trains only with loss scaling, and for 8-bit layers);
- ``prepare(module)``: make the layer safe to train through (see `prepare_quantized_base`).

A LoRA expert needs no backend: ``Linear4bit`` / ``Linear8bitLt`` subclass ``nn.Linear`` and the LoRA delta is added
by a forward hook on their output, in the adapter's own fp32. A copy expert must be trainable, so quantized
projections are dequantized into `ComputeDtypeLinear` layers, which - like ``Linear4bit`` - cast their input to the
compute dtype and their output back to the input dtype.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def is_quantized_linear(module: nn.Module) -> bool:
    """True for bitsandbytes 4-bit and 8-bit linear layers (checked without importing bitsandbytes)."""
    return type(module).__module__.startswith("bitsandbytes") and isinstance(module, nn.Linear)


def _is_4bit(module: nn.Module) -> bool:
    return is_quantized_linear(module) and getattr(module.weight, "quant_state", None) is not None


def _is_8bit(module: nn.Module) -> bool:
    return is_quantized_linear(module) and module.weight.dtype == torch.int8


def _import_bnb():
    try:
        import bitsandbytes as bnb
    except ImportError as err:  # a bnb layer without bnb importable: a broken environment
        raise ImportError(
            "This model has bitsandbytes layers, but bitsandbytes cannot be imported. Install it with "
            '`pip install "ubmoe-peft[bnb]"`.'
        ) from err
    return bnb


# ---- 4-bit ----------------------------------------------------------------------------------------------------------
def _unpack_cpu_4bit(module: nn.Linear) -> None:
    """Undo bitsandbytes' CPU inference repacking (done by an eval, no-grad forward on AVX512-BF16 CPUs).

    The repacked layout is read only by ``gemv_4bit``, which has no backward: gradients through it are silently
    dropped. The inverse is exact for the 4-bit codes; the absmax scales keep the bf16 rounding the repacking applied.
    bitsandbytes 0.50's inverse puts the scales back in their order (one per 64-weight block, row-major) only when it
    re-quantizes them for double quantization: otherwise they stay as the repacking left them, a transposed
    (blocks per row, rows) bf16 matrix, and every row wider than one block would be read with other blocks' scales.
    """
    state = module.weight.quant_state
    if not getattr(state, "packing_format_for_cpu", False):
        return
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    data, state = _convert_weight_packed_for_cpu_inverse(module.weight.data, state)
    if not state.nested and state.absmax.dim() == 2:  # (in / blocksize, out): back to (out * in / blocksize,)
        state.absmax = state.absmax.T.reshape(-1).float()
    module.weight.data, module.weight.quant_state = data, state


def _prepare_4bit(module: nn.Linear) -> None:
    _unpack_cpu_4bit(module)
    # bitsandbytes repacks a CPU Linear4bit for its fused bf16 kernel on the first eval-mode no-grad forward. That
    # kernel (1) has no autograd: a later training forward through the layer loses every gradient that flows back
    # through it (torch only warns "autograd kernel was not registered"), so an evaluation during training would
    # silently freeze the experts below this layer; (2) asserts out_features % 32 == 0 (an FFN of intermediate size
    # 688 fails with a bare AssertionError). Switching it off keeps the generic dequantize-and-matmul path, which
    # trains correctly for every shape; on CUDA the flag is never read.
    if hasattr(module, "support_avx512bf16_for_cpu"):
        module.support_avx512bf16_for_cpu = False


def _dequantize_4bit(module: nn.Linear) -> torch.Tensor:
    _unpack_cpu_4bit(module)
    bnb = _import_bnb()
    state = module.weight.quant_state
    dtype = getattr(module, "compute_dtype", None)
    if hasattr(torch.ops.bitsandbytes, "gemm_4bit") and isinstance(dtype, torch.dtype) and state.dtype != dtype:
        # bitsandbytes >= 0.50 multiplies through its gemm_4bit op, which dequantizes straight into the compute dtype.
        # Dequantizing in the storage dtype (bf16 for a bf16 checkpoint) and casting, as earlier versions multiply,
        # would round the weight to bf16 first: a copy expert would then start off the FFN it copies under fp32
        # compute (BitsAndBytesConfig's default). (Its backward still rounds to the storage dtype.)
        state = copy.copy(state)
        state.dtype = dtype
    return bnb.functional.dequantize_4bit(module.weight.data, state)  # (out, in)


def _compute_dtype_4bit(module: nn.Linear) -> torch.dtype:
    # fp16 compute (the QLoRA recipe of GPUs without bf16): a trainable copy in fp16 is refused by fp16 mixed
    # precision ("Attempting to unscale FP16 gradients"), so such copies are fp32, as PEFT keeps LoRA weights.
    dtype = getattr(module, "compute_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) and dtype != torch.float16 else torch.float32


# ---- 8-bit ----------------------------------------------------------------------------------------------------------
def _dequantize_8bit(module: nn.Linear) -> torch.Tensor:
    scb = getattr(module.weight, "SCB", None)
    if scb is None:
        scb = getattr(getattr(module, "state", None), "SCB", None)
    if scb is None:
        raise ValueError(
            f"Cannot dequantize the 8-bit layer {type(module).__name__}({module.in_features} -> "
            f"{module.out_features}): it has no SCB scales (not yet quantized?). Load the model with "
            "BitsAndBytesConfig(load_in_8bit=True) and a device_map before wrapping it."
        )
    # (out, in), LLM.int8()'s row-wise absmax, rounded as its matmul rounds it: w * scb / 127 differed by 1 ulp in a
    # fifth of the weights, so a fresh copy expert was not exactly the FFN
    return module.weight.data.float() * (scb.float().unsqueeze(1) * (1.0 / 127.0))


def _compute_dtype_8bit(module: nn.Linear) -> torch.dtype:
    # LLM.int8() has no compute dtype of its own (it returns the input's dtype); a trainable copy in fp16 would need
    # loss scaling, so copies of 8-bit layers are fp32 (also beside an fp16 bias, which the copy then holds in fp32).
    return torch.float32


# ---- plain layers ---------------------------------------------------------------------------------------------------
def _dequantize_dense(module: nn.Linear) -> torch.Tensor:
    return module.weight.detach()


def _is_dense(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and not is_quantized_linear(module)


def _no_prepare(module: nn.Linear) -> None:
    return None


@dataclass(frozen=True)
class LinearBackend:
    """How UBMoE reads and trains through one kind of linear layer."""

    name: str
    matches: Callable[[nn.Module], bool]
    dequantize: Callable[[nn.Linear], torch.Tensor]
    compute_dtype: Callable[[nn.Linear], torch.dtype]
    prepare: Callable[[nn.Linear], None]


BACKENDS: tuple[LinearBackend, ...] = (
    LinearBackend("bnb-4bit", _is_4bit, _dequantize_4bit, _compute_dtype_4bit, _prepare_4bit),
    LinearBackend("bnb-8bit", _is_8bit, _dequantize_8bit, _compute_dtype_8bit, _no_prepare),
    LinearBackend("dense", _is_dense, _dequantize_dense, lambda m: m.weight.dtype, _no_prepare),
)


def backend_for(module: nn.Module) -> LinearBackend:
    """The backend of a linear layer: the single dispatch point for quantized layers."""
    for backend in BACKENDS:
        if backend.matches(module):
            return backend
    if is_quantized_linear(module) and getattr(module.weight, "has_fp16_weights", False):
        raise TypeError(
            f"{type(module).__name__}({module.in_features} -> {module.out_features}) keeps a {module.weight.dtype} "
            "weight (BitsAndBytesConfig(llm_int8_has_fp16_weight=True), LLM.int8() training in full precision), "
            "which UBMoE does not support. Load the base with BitsAndBytesConfig(load_in_8bit=True) (int8 weights, "
            "the default) or load_in_4bit=True, or unquantized."
        )
    if is_quantized_linear(module) and module.weight.dtype.is_floating_point:
        raise TypeError(
            f"{type(module).__name__}({module.in_features} -> {module.out_features}) is a bitsandbytes layer that is "
            f"not quantized yet (its weight is still {module.weight.dtype}; bitsandbytes quantizes when the layer is "
            "moved to a device). Load the base with from_pretrained(..., quantization_config=BitsAndBytesConfig(...), "
            "device_map=...) or call model.to(device) before wrapping it."
        )
    if is_quantized_linear(module):
        raise TypeError(
            f"{type(module).__module__}.{type(module).__name__} (weight dtype {module.weight.dtype}) is a bitsandbytes "
            "layer that UBMoE does not support; supported are 4-bit (Linear4bit: nf4/fp4) and 8-bit (Linear8bitLt) "
            "layers as loaded by transformers' BitsAndBytesConfig."
        )
    raise TypeError(f"{type(module).__name__} is not a linear layer, so UBMoE has no backend for it.")


def dequantized_weight(module: nn.Linear) -> torch.Tensor:
    """The float weight (out, in) of a linear layer, dequantizing bitsandbytes storage."""
    return backend_for(module).dequantize(module)


def compute_dtype(module: nn.Linear) -> torch.dtype:
    """The dtype a linear layer computes in (its weight dtype for plain layers)."""
    return backend_for(module).compute_dtype(module)


def prepare_quantized_base(model: nn.Module) -> None:
    """Make every bitsandbytes linear of ``model`` safe to backpropagate through (called once when wrapping).

    All of them, not only the FFN's: stage 1 backpropagates through attention projections to the experts below.
    """
    repacked = []
    for module in model.modules():
        if is_quantized_linear(module):
            state = getattr(module.weight, "quant_state", None)
            if getattr(state, "packing_format_for_cpu", False):
                repacked.append(module)
            backend_for(module).prepare(module)
    if repacked:
        warnings.warn(
            f"{len(repacked)} 4-bit layers of this base were repacked by bitsandbytes for CPU inference (an eval-mode "
            "forward whose input needed no gradient ran before wrapping). Their 4-bit codes are restored exactly, but "
            "bitsandbytes rounded their scales to bf16 in place: outputs differ from a freshly loaded base by about "
            "0.1-0.5%. For exact outputs, wrap the base (or load the adapter onto it) before any such forward.",
            stacklevel=3,
        )


# ---- copy experts ---------------------------------------------------------------------------------------------------
class ComputeDtypeLinear(nn.Linear):
    """A trainable linear layer in a compute dtype that, like bnb's Linear4bit, returns its input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)  # (..., out)


def _to_dense(module: nn.Linear) -> nn.Linear:
    backend = backend_for(module)
    dtype = backend.compute_dtype(module)
    dense = ComputeDtypeLinear(
        module.in_features, module.out_features, bias=module.bias is not None, dtype=dtype, device=module.weight.device
    )
    with torch.no_grad():
        dense.weight.copy_(backend.dequantize(module).to(dtype))  # (out, in)
        if module.bias is not None:
            dense.bias.copy_(module.bias.detach().to(dtype))  # (out,)
    return dense


def make_dense_copy(ffn: nn.Module) -> nn.Module:
    """A trainable copy of ``ffn``, with quantized linears dequantized to the compute dtype."""
    quantized = {name for name, module in ffn.named_modules() if is_quantized_linear(module)}
    # Deep-copying a quantized layer would duplicate its packed weight only to drop it: copy the FFN without them.
    memo = {id(ffn.get_submodule(name)): nn.Identity() for name in quantized}
    replica = copy.deepcopy(ffn, memo)
    for name in quantized:
        parent_name, _, child = name.rpartition(".")
        parent = replica.get_submodule(parent_name) if parent_name else replica
        setattr(parent, child, _to_dense(ffn.get_submodule(name)))
    replica.requires_grad_(True)
    return replica
