"""Architecture knowledge as data: where each decoder keeps its FFN.

The UBMoE layer wraps a whole FFN module and finds its projections itself (every ``nn.Linear`` inside it, which
includes bitsandbytes' 4-bit and 8-bit linears), so the table only needs the FFN's attribute name per ``model_type``.
Models missing here still work when their decoder layers expose one of ``FALLBACK_FFN_NAMES``.
"""

from __future__ import annotations

import re

from torch import nn

# model_type -> name of the FFN module inside each decoder layer.
FFN_MODULES: dict[str, str] = {
    "llama": "mlp",
    "mistral": "mlp",
    "qwen2": "mlp",
    "qwen3": "mlp",
    "gemma": "mlp",
    "gemma2": "mlp",
    "gemma3_text": "mlp",
    "phi3": "mlp",
    "olmo": "mlp",
    "olmo2": "mlp",
    "granite": "mlp",
    "starcoder2": "mlp",
    "cohere": "mlp",
    "smollm3": "mlp",
}

FALLBACK_FFN_NAMES = ("mlp", "feed_forward", "ffn")

# model_type -> attention implementations whose mode-bi forward fails inside transformers (5.24): ModernBERT-decoder's
# eager attention adds its mask without checking for None, and is_causal=False with no padding gives None (the base
# model itself fails so with a bare TypeError).
NO_BIDIRECTIONAL_IMPLEMENTATION: dict[str, tuple[str, ...]] = {"modernbert-decoder": ("eager",)}

# model_types that build one mask for every layer, sliding all of them where `config.sliding_window` is set, whatever
# `config.layer_types` says (MistralConfig keeps layer_types it is given, and only logs that Ministral reads them).
ONE_MASK_FOR_ALL_LAYERS: frozenset[str] = frozenset({"mistral"})

# model_types whose decoder layer drops its extra keyword arguments (`is_causal=False` among them) on the way to
# attention, while the attention module passes its own on to transformers' attention function (5.24). With padding,
# the mask is bidirectional; without, the mask is None and sdpa / flash fall back on the module's `is_causal=True`.
# Mode bi hands the flag to each attention module itself; the functional tests cover each type per implementation.
ATTENTION_TAKES_IS_CAUSAL: frozenset[str] = frozenset({"stablelm", "nemotron"})

_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def text_config(model: nn.Module):
    """The model's (text) config: the language model's config of multimodal models, else ``model.config``."""
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_index(module_name: str) -> int | None:
    """The decoder layer index in a module name such as ``model.layers.3.mlp`` (the last number in it)."""
    found = _LAYER_INDEX.findall(module_name)
    return int(found[-1]) if found else None


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder layers, named as in ``model``: the items of the largest ``nn.ModuleList`` in its language model.

    The language model is transformers' ``model.get_decoder()``, so a multimodal model's vision tower (often deeper
    than its text model: 32 blocks against 28 in Qwen2-VL-2B) is neither taken for the decoder nor wrapped."""
    root, prefix = model, ""
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    # ModernBERT's decoder model answers get_decoder() with its LM head (a Linear named "decoder"): a decoder
    # without a layer list is not the language model, so the search covers the whole model
    if isinstance(decoder, nn.Module) and any(isinstance(m, nn.ModuleList) for m in decoder.modules()):
        found = [name for name, module in model.named_modules() if module is decoder]
        if found:
            root, prefix = decoder, found[0]
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in root.named_modules():
        if isinstance(module, nn.ModuleList) and (best is None or len(module) > len(best[1])):
            best = (name, module)
    if best is None:
        return []
    path = ".".join(part for part in (prefix, best[0]) if part)
    return [(f"{path}.{i}" if path else str(i), layer) for i, layer in enumerate(best[1])]


def backbone(model: nn.Module) -> nn.Module:
    """The transformer body (no LM head) of the first transformers model inside ``model`` (itself, a PeftModel or a
    SentenceTransformer holding one): what embedding runs, since it needs hidden states, not vocabulary logits."""
    from transformers import PreTrainedModel

    inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), model)
    return getattr(inner, "base_model", inner)


def default_ffn_target(model: nn.Module) -> str:
    """The FFN module name for ``model``: from the table, else the first fallback name its decoder layers have."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in FFN_MODULES:
        return FFN_MODULES[model_type]
    layers = decoder_layers(model)
    for candidate in FALLBACK_FFN_NAMES:
        if layers and all(hasattr(layer, candidate) for _, layer in layers):
            return candidate
    first = layers[0][1] if layers else None
    children = sorted(child for child, _ in first.named_children()) if first is not None else []
    loose = sorted(n for n, m in first.named_children() if isinstance(m, nn.Linear)) if first is not None else []
    if loose:  # OPT, XGLM, BioGPT: fc1 / fc2 sit in the layer itself, so there is no FFN module to name
        raise ValueError(
            f"model_type={model_type!r} keeps its FFN's linears {loose} directly in each decoder layer (its children: "
            f"{children}), with no FFN module around them. UBMoE wraps a whole FFN module, so this architecture is not "
            "supported."
        )
    raise ValueError(
        f"UBMoE does not know where the FFN of model_type={model_type!r} is: its decoder layers have the children "
        f"{children} and none is named one of {list(FALLBACK_FFN_NAMES)}. Pass the FFN module's name, for example "
        f"UBMoEConfig(target_modules=['<ffn name>'])."
    )


ATTENTION_NAMES = ("self_attn", "self_attention", "attention", "attn")  # transformers, Falcon / Bloom, GPT-NeoX, GPT-2


def attention_module(decoder_layer: nn.Module) -> nn.Module | None:
    """A decoder layer's self-attention: its first child named like one (``self_attn`` in transformers' decoders)."""
    for name in ATTENTION_NAMES:
        module = getattr(decoder_layer, name, None)
        if isinstance(module, nn.Module) and linear_projections(module):
            return module
    return None


def linear_projections(ffn: nn.Module) -> dict[str, nn.Linear]:
    """Every linear layer inside an FFN, keyed by its dotted name relative to the FFN."""
    return {name: m for name, m in ffn.named_modules() if name and isinstance(m, nn.Linear)}
