"""``merge_and_unload(target="moe")``: a UBMoE model as a plain transformers MoE model with two experts per layer.

transformers already has the architecture a UBMoE model is: a decoder whose FFN is a routed set of experts. Where a
dense family has an MoE twin that differs from it in the FFN alone (same attention, norms, rope, embedding and logit
scaling), the export is that twin (`MOE_EXPORTS`): Llama, Mistral and the models transformers runs as Llama (EXAONE 3,
InternLM3, IQuest-Coder) map to Mixtral, Qwen2 and Seed-OSS to Qwen2-MoE, Qwen3 to Qwen3-MoE, Qwen3.5 (text) to
Qwen3.5-MoE, Granite to Granite-MoE, Granite-SWA to Granite-MoE-SWA, ERNIE 4.5 to ERNIE 4.5-MoE, OLMo 2 to FlexOlmo and
Command R7B (Cohere2) to Cohere2-MoE. Expert 0 is the original FFN (uni), expert 1 the bi expert, the router's weight
is ours, and ``num_experts_per_tok`` is our ``top_k``, so the exported model loads with
``AutoModelForCausalLM.from_pretrained`` alone. A twin's shared expert gets width 0 and its auxiliary routing bias
0, so they add exactly nothing. Writing the weights in by hand is needed because no library converts a dense FFN plus
an adapter into fused MoE experts.

What carries over exactly and what does not:
- top-1: every twin picks the larger logit and weights the chosen expert by p / p = 1. Exact ties go to uni in
  UBMoE but to ``torch.topk``'s choice in transformers; a layer whose router can never pick bi (equal rows, as a
  freshly initialised router) therefore gets the uni FFN as both experts, so the exported fresh model is still the base
  model. Other exact ties need ``x . (w_bi - w_uni) == 0`` exactly and are left alone.
- top-2: every twin mixes the two experts with the softmax weights (some renormalise them, a rounding-level
  difference).
- transformers computes router logits in the model's dtype (ERNIE 4.5-MoE: in fp32); UBMoE in ``router_dtype`` (fp32
  by default). In a bf16 model the exported router is rounded to bf16 (and in an fp32 model a bf16 router's input is no
  longer rounded), which can flip a token whose two logits are within rounding; the export warns whenever the two
  dtypes differ.
- Near twins are not exported: their MoE model differs outside the FFN (OLMo 3 / CWM: sliding-window layers the twin
  lacks; Ministral 3: position-dependent query scaling; SmolLM3: NoPE layers; GLM: interleaved rope; GLM-4: extra
  norms; Hunyuan-MoE: an always-on full-width shared expert) or in the top-2 weights (sigmoid routers: GLM-4-MoE,
  LFM2-MoE, Solar-Open).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .architectures import decoder_layers, linear_projections

# model_type -> the transformers MoE model_type it is exported to
MOE_EXPORTS: dict[str, str] = {
    "llama": "mixtral",
    "mistral": "mixtral",
    "exaone": "mixtral",  # EXAONE 3, InternLM3 and IQuest-Coder run as LlamaForCausalLM
    "internlm3": "mixtral",
    "iquestcoder": "mixtral",
    "qwen2": "qwen2_moe",
    "seed_oss": "qwen2_moe",  # Qwen2's decoder with optional q/k/v biases, which Qwen2-MoE's qkv_bias takes
    "qwen3": "qwen3_moe",
    "qwen3_5_text": "qwen3_5_moe_text",
    "granite": "granitemoe",
    "granite_swa": "granitemoe_swa",
    "ernie4_5": "ernie4_5_moe",
    "olmo2": "flex_olmo",
    "cohere2": "cohere2_moe",
}
_DROP = ("model_type", "architectures", "transformers_version", "auto_map", "_name_or_path", "dtype", "torch_dtype")
_BIASES = ("attention_bias", "attention_out_bias", "mlp_bias", "use_bias")  # no twin's experts have biases
# a zero-width shared expert and its gate: Qwen2/Qwen3.5-MoE add sigmoid(gate(x)) * shared_expert(x) to every token,
# and with intermediate size 0 that is an empty sum, exactly 0
_SHARED = tuple(f"shared_expert.{name}_proj.weight" for name in ("gate", "up", "down")) + ("shared_expert_gate.weight",)


@dataclass(frozen=True)
class MoETwin:
    """A transformers MoE architecture that, given two experts, computes what its dense family computes in mode moe."""

    fields: Callable[[Any, int, list[int]], dict[str, Any]]  # (dense config, top_k, dense layers) -> MoE config fields
    block: str = "mlp"  # the MoE block's name in a decoder layer
    router: str = "gate"  # the router's name in the block
    dense_layers: bool = False  # layers without a UBMoE FFN stay dense FFNs; else they get uni as both experts
    # tensors that add exactly nothing when zero: a zero-width shared expert and its gate, an aux routing bias
    zeros: tuple[str, ...] = ()
    fp32_router: bool = False  # the twin keeps its router weight in fp32 and computes its gate in fp32
    biases: tuple[str, ...] = ()  # the dense config's bias flags that the twin takes over (others are refused)


def _qwen_moe(config: Any, top_k: int, dense: list[int]) -> dict[str, Any]:
    return dict(
        num_experts=2,
        moe_intermediate_size=config.intermediate_size,
        norm_topk_prob=top_k == 1,  # top-1: weight p / p = 1; top-2: the softmax weights as they are
        decoder_sparse_step=1,
        mlp_only_layers=dense,
    )


MOE_TWINS: dict[str, MoETwin] = {
    "mixtral": MoETwin(lambda c, k, d: dict(num_local_experts=2, router_jitter_noise=0.0)),
    "qwen2_moe": MoETwin(  # q/k/v biases: Qwen2 always has them, Seed-OSS where attention_bias says so
        lambda c, k, d: (
            _qwen_moe(c, k, d) | dict(shared_expert_intermediate_size=0, qkv_bias=getattr(c, "attention_bias", True))
        ),
        dense_layers=True,
        zeros=_SHARED,
        biases=("attention_bias",),
    ),
    "qwen3_moe": MoETwin(_qwen_moe, dense_layers=True, biases=("attention_bias",)),
    "qwen3_5_moe_text": MoETwin(
        lambda c, k, d: dict(
            num_experts=2, moe_intermediate_size=c.intermediate_size, shared_expert_intermediate_size=0
        ),
        zeros=_SHARED,
        biases=("attention_bias",),
    ),
    "granitemoe": MoETwin(
        lambda c, k, d: dict(num_local_experts=2), block="block_sparse_moe", router="router", biases=("attention_bias",)
    ),
    "granitemoe_swa": MoETwin(
        lambda c, k, d: dict(num_local_experts=2, shared_intermediate_size=0),  # 0: no shared MLP at all
        block="block_sparse_moe",
        router="router",
        biases=("attention_bias",),
    ),
    "ernie4_5_moe": MoETwin(
        lambda c, k, d: dict(
            moe_num_experts=2,
            moe_intermediate_size=c.intermediate_size,
            moe_num_shared_experts=0,
            moe_layer_start_index=0,
            moe_layer_end_index=-1,
            moe_layer_interval=1,
        ),
        zeros=("gate.moe_statics.e_score_correction_bias",),  # added to the probabilities before top-k
        fp32_router=True,
    ),
    "flex_olmo": MoETwin(lambda c, k, d: dict(num_experts=2, norm_topk_prob=k == 1), biases=("attention_bias",)),
    "cohere2_moe": MoETwin(
        lambda c, k, d: dict(
            num_experts=2,
            num_shared_experts=0,
            expert_selection_fn="softmax",
            mlp_layer_types=["sparse"] * c.num_hidden_layers,  # its dense layers apply rope on every layer
            rms_norm_eps=None,  # None: Cohere2's LayerNorm
        ),
        biases=("attention_bias",),
    ),
}


def _config(base_config: Any, target: str, top_k: int, dense_layers: list[int]) -> Any:
    from transformers import AutoConfig

    twin = MOE_TWINS[target]
    unsupported = [flag for flag in _BIASES if getattr(base_config, flag, False) and flag not in twin.biases]
    if unsupported:
        name = type(AutoConfig.for_model(target)).__name__.removesuffix("Config")
        raise ValueError(
            f"Cannot export model_type={base_config.model_type!r} with {unsupported}=True to {name}, which has no such "
            "biases. Use merge_and_unload(target='bi') or keep the adapter separate."
        )
    sliding = "sliding_attention" in (getattr(base_config, "layer_types", None) or [])  # the flag alone slides none
    if target == "qwen3_moe" and sliding:
        raise ValueError(
            "Cannot export a Qwen3 model with sliding-window layers: Qwen3-MoE places the sliding-window layers "
            "differently, so the export would not equal mode moe. Keep the adapter separate (model.save_pretrained) "
            "or use merge_and_unload(target='bi')."
        )
    fields = {k: v for k, v in base_config.to_dict().items() if k not in _DROP}
    if "layer_types" not in AutoConfig.for_model(target).to_dict():
        # Qwen3's (all full attention here; sliding windows are refused above): Qwen3-MoE does not define it, but
        # generate reads it and then hands the model one mask per layer type, which its forward cannot take
        fields.pop("layer_types", None)
        if target == "qwen3_moe":  # its use_sliding_window slides every layer; here none does
            fields.update(use_sliding_window=False, sliding_window=None)
    fields.update(num_experts_per_tok=top_k, output_router_logits=False)
    fields.update(twin.fields(base_config, top_k, dense_layers))
    return AutoConfig.for_model(target, **fields)


def _experts(uni: dict[str, torch.Tensor], bi: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Fused expert tensors in transformers' layout: gate_up_proj (2, 2I, C), down_proj (2, C, I)."""
    missing = {"gate_proj", "up_proj", "down_proj"} - set(uni)
    if missing:
        raise ValueError(f"Cannot export {prefix}: a SwiGLU FFN with gate_proj, up_proj and down_proj is needed.")
    return {
        f"{prefix}.experts.gate_up_proj": torch.stack(
            [torch.cat([w["gate_proj"], w["up_proj"]]) for w in (uni, bi)]
        ),  # (2, 2I, C)
        f"{prefix}.experts.down_proj": torch.stack([uni["down_proj"], bi["down_proj"]]),  # (2, C, I)
    }


def export_moe(model: nn.Module, adapter: str, check_finite: bool = False) -> nn.Module:
    """The transformers MoE model equal to ``model`` (a causal LM holding UBMoE layers) in mode moe."""
    from transformers import AutoModelForCausalLM

    from .tuners.ubmoe.layer import UBMoELayer

    config = model.config
    target = _export_target(model)
    twin = MOE_TWINS[target]
    layers = decoder_layers(model)
    ffns = {i: getattr(layer, "mlp", None) for i, (_, layer) in enumerate(layers)}
    wrapped = {i: f for i, f in ffns.items() if isinstance(f, UBMoELayer) and adapter in f.ubmoe_router}
    if not wrapped:
        raise ValueError(f"Cannot export: no decoder layer's 'mlp' holds a UBMoE FFN of adapter {adapter!r}.")
    top_k = next(iter(wrapped.values())).top_k[adapter]  # one adapter, one config
    dense = [i for i in ffns if i not in wrapped]
    state = _ffn_state(layers, ffns, wrapped, adapter, twin, top_k, check_finite)

    wrappers = {n: m for n, m in model.named_modules() if hasattr(m, "unload_and_optionally_merge_module")}
    for key, value in model.state_dict().items():  # attention, norms, embeddings, head: same names in both
        if ".mlp." not in key and not any(key.startswith(f"{name}.") for name in wrappers):
            state[key] = value
    for name, wrapper in wrappers.items():  # PEFT's modules_to_save: the trained module, as PEFT's unload gives it
        module = saved_module(wrapper, adapter)
        state.update({f"{name}.{key}": value for key, value in module.state_dict().items()})

    dtype = next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)
    device = next(model.parameters()).device
    _warn_on_router_dtypes(wrapped, adapter, dtype, twin)
    moe_config = _config(config, target, top_k, dense)
    head, embedding = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if (
        moe_config.tie_word_embeddings
        and head is not None
        and embedding is not None
        and not torch.equal(head, embedding)
    ):
        # A trained modules_to_save copy of the head or the embeddings unties them in the adapted model; a tied
        # export would load one of the two tensors into both and silently differ from mode moe.
        moe_config.tie_word_embeddings = False
    with torch.device(device):
        exported = AutoModelForCausalLM.from_config(
            moe_config, dtype=dtype, attn_implementation=config._attn_implementation
        )
    zeros = {k: torch.zeros_like(v) for k, v in exported.state_dict().items() if k.endswith(twin.zeros)}
    exported.load_state_dict(zeros | state, strict=True)
    if moe_config.tie_word_embeddings:
        exported.tie_weights()
    exported.generation_config = copy.deepcopy(model.generation_config)
    return exported.eval()


def _export_target(model: nn.Module) -> str:
    """The MoE ``model_type`` that ``model`` exports to; an error naming why where it cannot be exported."""
    from transformers import AutoModelForCausalLM

    from .tuners.ubmoe.bnb import is_quantized_linear

    config = model.config
    quantized = [name for name, module in model.named_modules() if is_quantized_linear(module)]
    if quantized:  # checked for the whole model: a layer whose bi expert is never picked reads no merged weights
        raise ValueError(
            f"Cannot export to a MoE model: {len(quantized)} layers are quantized (e.g. {quantized[0]!r}), and the "
            "export is a plain dense transformers model. Load the base model without quantization (dtype="
            "torch.bfloat16 or float32), load the adapter onto it with PeftModel.from_pretrained(base, adapter_dir), "
            "then merge (ubmoe export: pass the unquantized base as --model)."
        )
    target = MOE_EXPORTS.get(config.model_type)
    if target is None:
        raise NotImplementedError(
            f"merge_and_unload(target='moe') exports {sorted(MOE_EXPORTS)} models (to their transformers MoE twin); "
            f"transformers has no MoE architecture matching model_type={config.model_type!r}. Keep the adapter "
            "separate (model.save_pretrained) for generation, or use target='bi' for the embedding model."
        )
    causal_lm = AutoModelForCausalLM._model_mapping[type(config)]  # e.g. LlamaForCausalLM for a LlamaConfig
    if not isinstance(model, causal_lm):
        raise ValueError(
            f"merge_and_unload(target='moe') exports a causal language model ({causal_lm.__name__} here) to its MoE "
            f"counterpart, but this model is a {type(model).__name__}, whose head (or lack of one) the MoE model "
            "cannot hold. Use target='bi' for the dense embedding model, or keep the adapter separate "
            "(model.save_pretrained)."
        )
    return target


def _ffn_state(
    layers: list, ffns: dict, wrapped: dict, adapter: str, twin: MoETwin, top_k: int, check_finite: bool
) -> dict[str, torch.Tensor]:
    """The MoE twin's FFN weights (router, uni and bi experts; a dense FFN where the twin keeps one) of every layer,
    checked (finiteness, FFN shape) before anything is built."""
    from .tuners.ubmoe.layer import UBMoELayer

    state: dict[str, torch.Tensor] = {}
    for i, ffn in ffns.items():
        prefix, block = f"{layers[i][0]}.mlp", f"{layers[i][0]}.{twin.block}"
        base = ffn.base_layer if isinstance(ffn, UBMoELayer) else ffn  # another adapter may wrap this layer
        uni = {name: proj.weight.detach() for name, proj in linear_projections(base).items()}  # (out, in)
        if i not in wrapped and twin.dense_layers:
            state.update({f"{prefix}.{name}.weight": weight for name, weight in uni.items()})
            continue
        down = uni["down_proj"]  # (C, I)
        router = torch.zeros(2, down.shape[0], dtype=down.dtype, device=down.device)  # (2, C): never routes to bi
        bi = uni
        if i in wrapped:
            router = ffn.ubmoe_router[adapter].weight.detach()  # (2, C)
            if check_finite and not bool(torch.isfinite(router).all()):  # mode moe sent NaN's tokens to uni (NaN > NaN
                # is False); the exported gate's softmax makes every output NaN
                raise ValueError(
                    f"The router of adapter {adapter!r} has NaN/inf weights in layer {i} (safe_merge=True checked "
                    "before building anything); the adapter is broken."
                )
            if top_k == 2 or not torch.equal(router[0], router[1]):  # equal rows: bi is never picked (ties -> uni)
                bi = ffn.bi_weights(adapter, check_finite=check_finite)
        state[f"{block}.{twin.router}.weight"] = router.to(torch.float32 if twin.fp32_router else down.dtype)
        state.update(_experts(uni, {k: v.to(down.dtype) for k, v in bi.items()}, block))
    return state


def _warn_on_router_dtypes(wrapped: dict, adapter: str, dtype: torch.dtype, twin: MoETwin) -> None:
    """Warn where the exported gates compute in another dtype than the routers did (a near tie may flip)."""
    gate_dtype = torch.float32 if twin.fp32_router else dtype
    router_dtypes = sorted(
        {str(ffn.ubmoe_router[adapter].weight.dtype) for ffn in wrapped.values()} - {str(gate_dtype)}
    )
    if not router_dtypes:
        return
    gates, fix = f"the model's dtype, {dtype}", "merge a model whose dtype is the router_dtype"
    if twin.fp32_router:  # ERNIE 4.5-MoE: fp32 router weight and input in any model dtype
        gates, fix = "torch.float32", "train the routers in router_dtype='float32' (the default)"
    warnings.warn(
        f"The routers compute in {', '.join(router_dtypes)} (UBMoEConfig.router_dtype), but the exported model "
        f"computes its gates in {gates}: a token whose two router logits lie within rounding of each other may "
        f"pick the other expert, so the export can differ slightly from mode moe. For an exact export, {fix}.",
        stacklevel=4,  # merge_and_unload's caller
    )


def saved_module(wrapper: nn.Module, adapter: str | None) -> nn.Module:
    """What a PEFT ``modules_to_save`` wrapper stands for under ``adapter``: that adapter's trained copy, or the
    original module where the adapter has none. PEFT's own unload (``adapter`` None, and other kinds of wrapper)
    returns the active adapter's copy, whichever adapter is being merged."""
    copies = getattr(wrapper, "modules_to_save", None)
    if adapter is None or not isinstance(copies, nn.ModuleDict):
        names = None if adapter is None else [adapter]
        return wrapper.unload_and_optionally_merge_module(merge=False, safe_merge=False, adapter_names=names)
    return copies[adapter] if adapter in copies else wrapper.original_module
