"""``merge_and_unload(target="moe")``: a UBMoE model as a plain transformers MoE model with two experts per layer.

transformers already has the architecture a UBMoE model is: a decoder whose FFN is a routed set of experts. Llama and
Mistral map to Mixtral (same attention, RMSNorm and SwiGLU experts), Qwen2 to Qwen2-MoE (its shared expert gets
width 0, so it adds nothing) and Qwen3 to Qwen3-MoE. Expert 0 is the original FFN
(uni), expert 1 the bi expert, the router's weight is ours, and ``num_experts_per_tok`` is our ``top_k``, so the
exported model loads with ``AutoModelForCausalLM.from_pretrained`` alone. Writing the weights in by hand is needed
because no library converts a dense FFN plus an adapter into fused MoE experts.

What carries over exactly and what does not:
- top-1: both routers pick the larger logit and weight the chosen expert by p / p = 1. Exact ties go to uni in
  UBMoE but to ``torch.topk``'s choice in transformers; a layer whose router can never pick bi (equal rows, as a
  freshly initialised router) therefore gets the uni FFN as both experts, so the exported fresh model is still the base
  model. Other exact ties need ``x . (w_bi - w_uni) == 0`` exactly and are left alone.
- top-2: both mix the two experts with the softmax weights (Mixtral renormalises them, a rounding-level difference).
- transformers computes router logits in the model's dtype; UBMoE in ``router_dtype`` (fp32 by default). In a bf16
  model the exported router is rounded to bf16 (and in an fp32 model a bf16 router's input is no longer rounded),
  which can flip a token whose two logits are within rounding; the export warns whenever the two dtypes differ.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

from .architectures import decoder_layers, linear_projections

# model_type -> the transformers MoE model_type it is exported to
MOE_EXPORTS: dict[str, str] = {"llama": "mixtral", "mistral": "mixtral", "qwen2": "qwen2_moe", "qwen3": "qwen3_moe"}
_DROP = ("model_type", "architectures", "transformers_version", "auto_map", "_name_or_path", "dtype", "torch_dtype")


def _config(base_config: Any, target: str, top_k: int, dense_layers: list[int]) -> Any:
    from transformers import AutoConfig

    unsupported = [flag for flag in ("attention_bias", "mlp_bias") if getattr(base_config, flag, False)]
    if target == "mixtral" and unsupported:
        raise ValueError(
            f"Cannot export model_type={base_config.model_type!r} with {unsupported}=True to Mixtral, which has no "
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
    if target == "mixtral":
        fields.update(num_local_experts=2, router_jitter_noise=0.0)
    else:  # qwen2_moe / qwen3_moe: layers without a UBMoE FFN stay dense
        fields.update(
            num_experts=2,
            moe_intermediate_size=base_config.intermediate_size,
            norm_topk_prob=top_k == 1,  # top-1: weight p / p = 1; top-2: the softmax weights as they are
            decoder_sparse_step=1,
            mlp_only_layers=dense_layers,
        )
        if target == "qwen2_moe":  # its always-on shared expert gets no width: it adds exactly zero
            fields.update(shared_expert_intermediate_size=0)
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


def _empty_shared_expert(down: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    """Qwen2-MoE adds ``sigmoid(gate(x)) * shared_expert(x)`` to every token; with intermediate size 0 the shared
    expert's output is an empty sum, exactly 0, so the block is the routed experts alone."""
    hidden = down.shape[0]
    empty = dict(dtype=down.dtype, device=down.device)
    return {
        f"{prefix}.shared_expert.gate_proj.weight": torch.zeros(0, hidden, **empty),  # (0, C)
        f"{prefix}.shared_expert.up_proj.weight": torch.zeros(0, hidden, **empty),  # (0, C)
        f"{prefix}.shared_expert.down_proj.weight": torch.zeros(hidden, 0, **empty),  # (C, 0)
        f"{prefix}.shared_expert_gate.weight": torch.zeros(1, hidden, **empty),  # (1, C)
    }


def export_moe(model: nn.Module, adapter: str, check_finite: bool = False) -> nn.Module:
    """The transformers MoE model equal to ``model`` (a causal LM holding UBMoE layers) in mode moe."""
    from transformers import AutoModelForCausalLM

    from .tuners.ubmoe.bnb import is_quantized_linear
    from .tuners.ubmoe.layer import UBMoELayer

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
            f"merge_and_unload(target='moe') exports {sorted(MOE_EXPORTS)} models (to Mixtral / Qwen-MoE); "
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
    layers = decoder_layers(model)
    ffns = {i: getattr(layer, "mlp", None) for i, (_, layer) in enumerate(layers)}
    wrapped = {i: f for i, f in ffns.items() if isinstance(f, UBMoELayer) and adapter in f.ubmoe_router}
    if not wrapped:
        raise ValueError(f"Cannot export: no decoder layer's 'mlp' holds a UBMoE FFN of adapter {adapter!r}.")
    top_k = next(iter(wrapped.values())).top_k[adapter]  # one adapter, one config
    dense = [i for i in ffns if i not in wrapped]
    state: dict[str, torch.Tensor] = {}
    for i, ffn in ffns.items():  # every check (quantization, finiteness, FFN shape) before building anything
        prefix = f"{layers[i][0]}.mlp"
        base = ffn.base_layer if isinstance(ffn, UBMoELayer) else ffn  # another adapter may wrap this layer
        uni = {name: proj.weight.detach() for name, proj in linear_projections(base).items()}  # (out, in)
        if i not in wrapped and target != "mixtral":
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
        state[f"{prefix}.gate.weight"] = router.to(down.dtype)
        state.update(_experts(uni, {k: v.to(down.dtype) for k, v in bi.items()}, prefix))
        if target == "qwen2_moe":
            state.update(_empty_shared_expert(down, prefix))

    wrappers = {n: m for n, m in model.named_modules() if hasattr(m, "unload_and_optionally_merge_module")}
    for key, value in model.state_dict().items():  # attention, norms, embeddings, head: same names in both
        if ".mlp." not in key and not any(key.startswith(f"{name}.") for name in wrappers):
            state[key] = value
    for name, wrapper in wrappers.items():  # PEFT's modules_to_save: the trained module, as PEFT's unload gives it
        module = saved_module(wrapper, adapter)
        state.update({f"{name}.{key}": value for key, value in module.state_dict().items()})

    dtype = next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)
    device = next(model.parameters()).device
    router_dtypes = sorted({str(ffn.ubmoe_router[adapter].weight.dtype) for ffn in wrapped.values()} - {str(dtype)})
    if router_dtypes:
        warnings.warn(
            f"The routers compute in {', '.join(router_dtypes)} (UBMoEConfig.router_dtype), but the exported model "
            f"computes its gates in the model's dtype, {dtype}: a token whose two router logits lie within rounding "
            "of each other may pick the other expert, so the export can differ slightly from mode moe. For an exact "
            "export, merge a model whose dtype is the router_dtype.",
            stacklevel=3,
        )
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
    exported.load_state_dict(state, strict=True)
    if moe_config.tie_word_embeddings:
        exported.tie_weights()
    exported.generation_config = copy.deepcopy(model.generation_config)
    return exported.eval()


def saved_module(wrapper: nn.Module, adapter: str | None) -> nn.Module:
    """What a PEFT ``modules_to_save`` wrapper stands for under ``adapter``: that adapter's trained copy, or the
    original module where the adapter has none. PEFT's own unload (``adapter`` None, and other kinds of wrapper)
    returns the active adapter's copy, whichever adapter is being merged."""
    copies = getattr(wrapper, "modules_to_save", None)
    if adapter is None or not isinstance(copies, nn.ModuleDict):
        names = None if adapter is None else [adapter]
        return wrapper.unload_and_optionally_merge_module(merge=False, safe_merge=False, adapter_names=names)
    return copies[adapter] if adapter in copies else wrapper.original_module
