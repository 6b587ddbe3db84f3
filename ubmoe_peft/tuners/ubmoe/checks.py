"""Checks of a UBMoE config against its base model, and of an adapter checkpoint against the model it loads into:
every one raises before anything is changed, naming what was given and the fix."""

from __future__ import annotations

import copy
import inspect
import re
import sys
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import nn

from ...architectures import (
    attention_module,
    decoder_layers,
    default_ffn_target,
    layer_index,
    linear_projections,
    text_config,
)
from ...io import AdapterMismatchError
from .bnb import ComputeDtypeLinear, is_quantized_linear
from .config import UBMoEConfig
from .layer import UBMoELayer, selected_projections

ADAPTER_SEGMENT = r"(\.ubmoe_[A-Za-z_]+)\.{name}(?=\.|$)"

_CONTAINERS = (*UBMoELayer.adapter_layer_names, "ubmoe_dropout")  # the ModuleDicts a UBMoE layer holds
# PEFT's modules_to_save per task type: the heads its task models add to every adapter's config
TASK_HEADS = {"SEQ_CLS": ("classifier", "score"), "TOKEN_CLS": ("classifier", "score"), "QUESTION_ANS": ("qa_outputs",)}


# Packages whose frames a warning skips, to point at the user's line (a trainer's `train()`, a forward call) rather
# than at torch's hook-calling code. `warnings.warn(skip_file_prefixes=...)` does this from Python 3.12 on only.
_LIBRARIES = frozenset({"torch", "transformers", "peft", "trl", "accelerate", "sentence_transformers", "ubmoe_peft"})


def stacklevel_outside_libraries() -> int:
    """The `stacklevel` of the first frame, above the caller, that is not code of `_LIBRARIES`."""
    frame, level = sys._getframe(1), 1  # level 1: the function that calls warnings.warn
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _LIBRARIES:
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


def task_heads(config: UBMoEConfig) -> tuple[str, ...]:
    return TASK_HEADS.get(str(getattr(config.task_type, "value", config.task_type)), ())


def in_decoder(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """``model``'s decoder layers: each one's name prefix, mapped to the names of the modules inside it (relative to
    the layer). Only FFNs under these prefixes are wrapped (not a vision tower's)."""
    return {f"{name}.": tuple(n for n, _ in layer.named_modules() if n) for name, layer in decoder_layers(model)}


def _names_target(targets: list[str] | str | None, key: str) -> bool:
    if isinstance(targets, str):  # a regular expression on the whole name, as in PEFT
        return re.fullmatch(targets, key) is not None
    return any(key == t or key.endswith(f".{t}") for t in targets or [])  # name endings


def matches_target(config: UBMoEConfig, key: str, decoder: dict[str, tuple[str, ...]] | None = None) -> bool:
    layer = None
    if decoder is not None:
        layer = next((prefix for prefix in decoder if key.startswith(prefix)), None)
        if layer is None:
            return False
    if any(part in _CONTAINERS for part in key.split(".")):  # a UBMoE layer's own modules, keyed by adapter names:
        return False  # an adapter named "mlp" made its ModuleDict entries look like FFNs to every later adapter
    hit = _names_target(config.target_modules, key)
    if hit:  # inside another match: the FFN's own module of that name (CPM-Ant's ffn.ffn), which is not a layer's FFN
        parts = key.split(".")  # (wrapping both failed half-way with a bare AttributeError)
        hit = not any(_names_target(config.target_modules, ".".join(parts[:i])) for i in range(1, len(parts)))
    if hit and layer is not None and not isinstance(config.target_modules, str):
        # Name endings match at any depth: a layer's FFN is its shallowest match, and a deeper module of that name
        # elsewhere in the layer is some other block's (AXK2's gate MLP `input_layernorm.mlp` beside the layer's
        # `mlp`: both were wrapped). A regular expression says exactly which modules it means, so it is taken as is.
        depth = key.count(".", len(layer))
        hit = not any(
            name.count(".") < depth and _names_target(config.target_modules, layer + name)
            for name in decoder[layer]
            if not any(part in _CONTAINERS for part in name.split("."))
        )
    if hit and config.layers_to_transform is not None:
        hit = layer_index(key) in config.layers_to_transform
    return hit


def base_signature(model: nn.Module) -> dict[str, Any]:
    """What an adapter must match in its base: architecture, hidden and FFN sizes, number of decoder layers, and the
    attention's query and key-value head counts. (Llama-2-7B and Llama-3-8B share the first sizes; the FFN size tells
    them apart. An FFN adapter fits a base of other head counts shape for shape: only the signature tells.)"""
    config = text_config(model)
    ffn_size = getattr(config, "intermediate_size", None)
    return {
        "model_type": getattr(config, "model_type", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "intermediate_size": list(ffn_size) if isinstance(ffn_size, tuple) else ffn_size,  # as JSON reads it back
        "num_layers": len(decoder_layers(model)),
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
    }


def signature_differences(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """The entries in which a model's ``current`` base signature differs from a saved one. Only entries both have
    count: files saved before an entry was added (intermediate_size) are still checked on the others."""
    return sorted(k for k in current if k in (saved or {}) and saved[k] != current[k])


def _describe(name: str | None, signature: dict[str, Any] | None) -> str:
    shown = ", ".join(f"{k}={v!r}" for k, v in sorted((signature or {}).items())) or "no recorded shape"
    return f"{name or 'an unnamed base model'} ({shown})"


def _mismatch(config: UBMoEConfig, model: nn.Module, problem: str) -> AdapterMismatchError:
    model_name = getattr(text_config(model), "_name_or_path", None) or getattr(model, "name_or_path", None)
    return AdapterMismatchError(
        f"This UBMoE adapter was made for {_describe(config.base_model_name_or_path, config.base_model_signature)}, "
        f"but the model it is loaded into is {_describe(model_name, base_signature(model))}: {problem} Load the "
        "adapter onto the base model it was trained on (its adapter_config.json names it)."
    )


def check_checkpoint(model: nn.Module, config: UBMoEConfig, adapter_name: str, state_dict: dict) -> None:
    """Raise `AdapterMismatchError` unless ``state_dict`` (keys already mapped to the model) fills exactly the
    adapter's UBMoE parameters and its copies of ``modules_to_save`` with tensors of the same shapes, all finite."""
    own = re.compile(ADAPTER_SEGMENT.format(name=re.escape(adapter_name)))
    saved_copy = re.compile(rf"\.modules_to_save\.{re.escape(adapter_name)}\.")  # PEFT's copies (modules_to_save)
    state = model.state_dict()
    expected = {k: v.shape for k, v in state.items() if own.search(k) or saved_copy.search(k)}
    # PEFT adds the base's embeddings to a save when they were resized (save_embedding_layers) and loads them back
    optional = {k: v for k, v in _embedding_shapes(model, state).items() if k not in expected}
    given = dict(state_dict)  # a UBMoE file holds the adapter's tensors (and those embeddings) and nothing else
    unexpected = sorted(k for k in given if k not in expected and k not in optional)
    missing = sorted(k for k in expected if k not in given)
    shapes = {**optional, **expected}
    misfits = [k for k, v in given.items() if k in shapes and tuple(v.shape) != tuple(shapes[k])]
    wrong = [f"{k}: {tuple(given[k].shape)} in the file, {tuple(shapes[k])} in the model" for k in misfits]
    problems = []
    if wrong:
        problems.append(f"{len(wrong)} tensors differ in shape (e.g. {wrong[0]}).")
    if unexpected:
        problems.append(f"{len(unexpected)} tensors have no place in the model (e.g. {unexpected[0]}).")
    if missing:
        problems.append(f"{len(missing)} adapter parameters are not in the file (e.g. {missing[0]}).")
    if problems and signature_differences(config.base_model_signature, base_signature(model)):
        raise _mismatch(config, model, " ".join(problems))
    if misfits and all(".modules_to_save." in k or k in optional for k in misfits):  # e.g. another vocabulary
        raise AdapterMismatchError(
            f"The adapter's trained copies of base modules (modules_to_save={config.modules_to_save}) or the "
            f"embeddings saved with it do not fit the model's: {' '.join(problems)} The base differs from the one "
            "the adapter was trained on, e.g. in vocabulary size. Load the adapter onto that base (or resize this "
            "one's token embeddings to the saved size first, model.resize_token_embeddings(n))."
        )
    if problems:  # the right base: the weights were saved by an adapter of other settings (or the file was edited)
        settings = ", ".join(
            f"{k}={getattr(config, k)!r}" for k in ("expert_type", "r", "attention_r", "target_modules")
        )
        raise AdapterMismatchError(
            f"The adapter weights being loaded (an adapter_model.safetensors, or a state dict) do not fit adapter "
            f"{adapter_name!r} ({settings}): {' '.join(problems)} They were saved by an adapter with other settings "
            "(or edited); load them with the adapter_config.json saved beside them."
        )
    bad = [k for k, v in given.items() if v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        raise AdapterMismatchError(
            f"The adapter weights hold NaN or inf values (e.g. {bad[0]}), so the file is corrupted or was saved "
            "from a diverged run. Save a healthy checkpoint again with model.save_pretrained(folder)."
        )


def widen_quantized_copies(model: nn.Module, state_dict: dict) -> None:
    """A copy expert of a quantized FFN is built in the compute dtype (bf16, say); one that trained wider
    (prepare_model_for_kbit_training upcasts it to fp32) was rounded to the built dtype when loaded back, silently.
    Its layers take inputs of any dtype, so they take the saved tensors' dtype where that is wider."""
    for name, module in model.named_modules():
        if isinstance(module, ComputeDtypeLinear):
            for key, param in module.named_parameters(recurse=False):
                saved = state_dict.get(f"{name}.{key}")
                if saved is not None and saved.is_floating_point() and saved.dtype.itemsize > param.dtype.itemsize:
                    param.data = param.data.to(saved.dtype)


def refuse_sentence_transformers_module() -> None:
    """Refuse an adapter put in by sentence-transformers' own model code: ``SentenceTransformer(folder)`` of an
    adapter folder holding a tokenizer (its ``Transformer`` module has transformers load the adapter) and
    ``SentenceTransformer.load_adapter``. sentence-transformers then runs the model as it is, in mode moe (causal),
    and with none of a saved encoder's prompt and pooling: the embeddings were silently not the bidirectional ones.
    No hook of either library says who is loading, so the calling frames' code is read, once per adapter (only names:
    reading a frame's local variables would keep them alive). ``add_adapter`` is refused by transformers itself
    (peft < 0.22)."""
    frame = inspect.currentframe()
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module.startswith("sentence_transformers.") and (
            module.lower().endswith((".transformer", ".peft_mixin"))  # its Transformer module, its adapter methods
        ):
            raise ValueError(
                "A UBMoE adapter is being loaded by sentence-transformers' own model code (SentenceTransformer(folder) "
                "of an adapter folder with a tokenizer, or SentenceTransformer.load_adapter): it would embed in mode "
                "'moe', with causal attention, not the bidirectional mode 'bi', and without the prompt and pooling of "
                "a saved encoder. Build the encoder with ubmoe_peft.to_sentence_transformer(PeftModel.from_pretrained("
                "base, adapter_folder), tokenizer), or load one saved by its .save(folder) with "
                "ubmoe_peft.load_sentence_transformer(base, folder)."
            )
        frame = frame.f_back


def refuse_other_tuners(model: nn.Module) -> None:
    """Another PEFT method's layers in the base (a LoRA model wrapped again) were taken for FFN projections: the
    experts adapted or copied LoRA's own modules, the save held the LoRA's tensors and loaded nowhere, and the LoRA
    model's shared ``peft_config`` entry was overwritten by ours."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    foreign = [
        (n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer) and not isinstance(m, UBMoELayer)
    ]
    if foreign:
        name, layer = foreign[0]
        kind = f"{type(layer).__module__}.{type(layer).__qualname__}"
        raise ValueError(
            f"The model already holds {len(foreign)} layers of another PEFT method (e.g. {name!r}, a {kind}), so UBMoE "
            "cannot be added to it: its experts would take that method's modules for FFN projections and its saves "
            "could not be loaded back. Merge the other adapter into the base first (base = peft_model."
            "merge_and_unload()), or start from a fresh base model."
        )


def _embedding_shapes(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Size]:
    """The shapes of ``model``'s input and output embeddings in its state dict ``state`` (with a PEFT wrapper's
    entries, if any)."""
    layers = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:  # transformers' fallback raises where it cannot find the embedding (a custom model's own name for it)
            layers.append(getattr(model, getter, lambda: None)())
        except (NotImplementedError, AttributeError):
            continue
    ids = {id(layer) for layer in layers if layer is not None}
    prefixes = tuple(f"{name}." for name, module in model.named_modules() if id(module) in ids)
    return {k: v.shape for k, v in state.items() if prefixes and k.startswith(prefixes)}


def _check_ffn_inputs(name: str, ffn: nn.Module) -> None:
    """The FFN takes the hidden states alone: the experts are run as ``ffn(x)`` on the tokens routed to them."""
    extra = [
        p.name
        for p in list(inspect.signature(ffn.forward).parameters.values())[1:]
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if extra:
        raise ValueError(
            f"Target module {name!r} ({type(ffn).__name__}) needs {extra} besides the hidden states in its forward, "
            "so UBMoE cannot run it as an expert on the tokens routed to it (Bloom and MPT fold the residual into "
            "their FFN). This architecture is not supported: use one whose FFN takes the hidden states alone."
        )


def _refuse_expert_blocks(targets: dict[str, nn.Module]) -> None:
    """A mixture-of-experts block keeps its experts' weights fused in 3-D parameters. One that also holds an
    nn.Linear (its router, a shared expert) was wrapped: the LoRA expert adapted only those linears and the copy
    expert duplicated every expert, silently; others failed later on the block's tuple output."""
    fused = {}
    for name, module in targets.items():
        module = _unwrapped(module)
        weight = _fused_weight(module)
        if weight is not None and weight[2][0] == 1:  # (1, 1, C): not experts but a per-channel mix, RWKV's token shift
            raise ValueError(
                f"Target module {name!r} ({type(module).__name__}) holds {weight[0]!r} of shape {weight[2]}, a "
                "per-channel weight that no FFN made of nn.Linear projections has (RWKV's feed-forward mixes each "
                "token with the previous one through such weights). UBMoE wraps FFNs that compute each token from its "
                "own hidden state, so this architecture is not supported."
            )
        if weight is not None:
            fused[name] = weight[:2]
    if not fused:
        return
    dense = sorted({layer_index(name) for name in targets if name not in fused} - {None})  # no attention: refused
    name, (weight, dims) = next(iter(fused.items()))
    fix = (
        f"Wrap only the layers with a dense FFN: UBMoEConfig(layers_to_transform={dense})."
        if dense
        else "The targeted layers hold no dense FFN; use a dense model."
    )
    module = _unwrapped(targets[name])
    if isinstance(module.get_submodule(weight.rpartition(".")[0]), nn.modules.conv._ConvNd):
        raise ValueError(
            f"Target module {name!r} ({type(module).__name__}, {len(fused)} of {len(targets)} targets) holds a "
            f"convolution ({weight!r}): a state-space (Mamba) or convolution block, not an FFN. UBMoE wraps FFNs "
            f"that compute each token from its own hidden state. {fix}"
        )
    raise ValueError(
        f"Target module {name!r} ({len(fused)} of {len(targets)} targets) is a mixture-of-experts block: it holds "
        f"fused expert weights ({weight!r}, {dims}-D). UBMoE pairs a dense FFN with its bidirectional twin and "
        f"cannot make experts of an MoE block. {fix}"
    )


def _fused_weight(module: nn.Module) -> tuple[str, int, tuple[int, ...]] | None:
    """The first parameter of 3 or more dimensions in ``module`` (name, dims, shape): no FFN of linears has one."""
    params = _unwrapped(module).named_parameters()
    return next(((key, p.dim(), tuple(p.shape)) for key, p in params if p.dim() >= 3), None)


def _is_attention(module: nn.Module) -> bool:
    """An attention module, also under another name than the decoder layers' usual ones (`attention_module`)."""
    return "Attention" in type(_unwrapped(module)).__name__


def _unwrapped(module: nn.Module) -> nn.Module:
    """The FFN itself where a UBMoE layer (of another adapter) wraps it."""
    return module.base_layer if isinstance(module, UBMoELayer) else module


_QUANT_STATE_PARTS = {"absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state", "SCB", "weight_format"}
_QUANT_STATE_PARTS |= {f"bitsandbytes__{kind}" for kind in ("nf4", "fp4")}


def _check_adapter_name(model: nn.Module, adapter_name: str) -> None:
    """PEFT saves one adapter by dropping every key that holds another adapter's name as a dotted part
    (``_filter_state_dict_for_adapter_name``). UBMoE keys hold the base's module path, so a second adapter named
    like a part of it ("mlp", "0", "gate_proj") made every save drop the first adapter's tensors, silently."""
    existing = {name for m in model.modules() if isinstance(m, UBMoELayer) for name in m.ubmoe_router}
    existing |= {name for m in model.modules() if isinstance(m, AuxiliaryTrainingWrapper) for name in m.modules_to_save}
    if adapter_name in existing:  # the same adapter again (a load over it): its keys are known
        return
    # Names, not state_dict(): bitsandbytes' state_dict hook changes CPU-repacked 4-bit weights; its extra keys' parts
    keys = [name for named in (model.named_parameters(), model.named_buffers()) for name, _ in named]
    parts = {part for key in keys for part in key.split(".")} | _QUANT_STATE_PARTS
    parts |= {"base_model", "model", "modules_to_save", "original_module", "base_layer", *_CONTAINERS}  # after wrap
    if "." in adapter_name or adapter_name in parts:
        raise ValueError(
            f"Adapter name {adapter_name!r} "
            + ("holds a dot" if "." in adapter_name else "is a part of this model's parameter names")
            + ": PEFT saves each adapter by dropping the keys that hold another adapter's name as a dotted part, so "
            "with it every save would drop other adapters' weights. Choose another name (e.g. 'stage1' or 'chat')."
        )


def validate_config(model: nn.Module, config: UBMoEConfig, adapter_name: str = "default") -> None:
    """Resolve ``target_modules`` and check the config against ``model``, raising before anything is changed."""
    _refuse_bidirectional_base(model)
    saved = _check_signature(model, config)
    targets = _resolve_targets(model, config, saved)
    _check_modules_to_save(config, model, targets, adapter_name, saved)
    _check_adapter_name(model, adapter_name)
    _refuse_expert_blocks(targets)
    layers = decoder_layers(model)
    for name, module in targets.items():
        _check_target(config, name, module, layers)


def _refuse_bidirectional_base(model: nn.Module) -> None:
    """A base model configured bidirectional (a bi export, an embedding model) would leave no causal mode."""
    base = text_config(model)
    # masking_utils then builds no causal mask at all; Gemma 2/3 read their own flag (EmbeddingGemma's config)
    flag = "is_causal=False" if getattr(base, "is_causal", True) is False else None
    flag = "use_bidirectional_attention=True" if getattr(base, "use_bidirectional_attention", False) is True else flag
    if flag is not None:
        raise ValueError(
            f"The base model ({type(model).__name__}) has {flag} in its config: it is a bidirectional "
            "model (such as a bi export, `ubmoe export --target bi`, merge_and_unload(target='bi'), or an embedding "
            "model such as EmbeddingGemma), so modes uni "
            "and moe would not be causal either. UBMoE pairs a causal decoder's FFNs with bidirectional twins: wrap "
            "the original causal base model."
        )


def _check_signature(model: nn.Module, config: UBMoEConfig) -> bool:
    """Record the base model's signature in a new config, or check the one a config carries against the model.
    Returns whether the config comes from an earlier save or wrap (whose entries are then warned about, not refused)."""
    signature = base_signature(model)
    if config.base_model_signature is None:
        saved = config.is_saved  # a loaded adapter's config saved before signatures were recorded; read first
        config.base_model_signature = signature
        return saved
    differ = signature_differences(config.base_model_signature, signature)
    if differ:
        raise _mismatch(config, model, f"they differ in {', '.join(differ)}.")
    return True


def _layer_children(layers: list[tuple[str, nn.Module]]) -> list[str]:
    """The names of the first decoder layer's children, which error messages offer as targets."""
    return sorted({child for _, layer in layers[:1] for child, _ in layer.named_children()})


def _resolve_targets(model: nn.Module, config: UBMoEConfig, saved: bool) -> dict[str, nn.Module]:
    """The FFN modules ``config`` targets (``target_modules`` found per architecture where unset); an error naming
    what the model has where they match nothing or the attention, a warning where a new config's entry matches none."""
    if config.target_modules is None:
        config.target_modules = [default_ffn_target(model)]
    decoder = in_decoder(model)
    targets = {name: m for name, m in model.named_modules() if name and matches_target(config, name, decoder)}
    layers = decoder_layers(model)
    if config.layers_to_transform is not None:
        bad = [i for i in config.layers_to_transform if i >= len(layers)]
        if bad:
            raise ValueError(
                f"UBMoEConfig(layers_to_transform={config.layers_to_transform}) names layers {bad}, but the model has "
                f"{len(layers)} decoder layers (0..{len(layers) - 1})."
            )
    if not targets and config.layers_to_transform is not None:
        unfiltered = copy.copy(config)
        unfiltered.layers_to_transform = None
        found = [name for name, _ in model.named_modules() if name and matches_target(unfiltered, name, decoder)]
        if found:  # "not found" blamed the name
            raise ValueError(
                f"Target modules {config.target_modules!r} match {found[:4]} (layers "
                f"{sorted({layer_index(n) for n in found} - {None})}), but UBMoEConfig(layers_to_transform="
                f"{config.layers_to_transform}) keeps none of them. Name their layers in layers_to_transform, or "
                "widen target_modules (e.g. ['mlp'])."
            )
    if not targets:
        children = _layer_children(layers)
        regex = (  # a string is matched against the whole module name, as in PEFT
            " A string is a regular expression matched against the whole module name (e.g. r'.*\\.mlp' for every "
            "layer's mlp); a list matches name endings."
            if isinstance(config.target_modules, str)
            else ""
        )
        raise ValueError(
            f"Target modules {config.target_modules!r} not found in the base model. Its decoder layers have the "
            f"children {children}; set UBMoEConfig(target_modules=[...]) to the FFN's name (e.g. ['mlp']).{regex}"
        )
    listed = [] if isinstance(config.target_modules, str) or saved else config.target_modules  # str: one regex
    unused = [t for t in listed if not any(_names_target([t], n) for n in targets)]
    if unused:  # a typo beside a match was silent
        children = _layer_children(layers)
        warnings.warn(
            f"UBMoEConfig(target_modules={config.target_modules!r}): {unused} select no FFN of this model and are "
            f"ignored ({len(targets)} FFNs are wrapped through the other entries). Its decoder layers have the "
            f"children {children}: correct or remove those entries.",
            stacklevel=stacklevel_outside_libraries(),
        )
    attentions = {id(attention_module(layer)) for _, layer in layers}
    wrong = [name for name, m in targets.items() if id(m) in attentions or _is_attention(m)]
    if wrong:  # accepted, then every forward failed: a UBMoE layer is called with the hidden states alone
        # hybrids name every layer's block alike (Nemotron-H's `mixer`: a Mamba mixer, an attention or an FFN)
        ffns = sorted({layer_index(n) for n, m in targets.items() if n not in wrong and not _fused_weight(m)} - {None})
        fix = (
            f"Wrap only the layers whose {'/'.join(sorted({n.rpartition('.')[2] for n in wrong}))!r} is an FFN: "
            f"UBMoEConfig(layers_to_transform={ffns})"
            if ffns
            else "Target the FFN, e.g. UBMoEConfig(target_modules=['mlp']) (or None to find it)"
        )
        raise ValueError(
            f"Target module {wrong[0]!r} ({len(wrong)} of {len(targets)} targets) is the layer's attention, not the "
            f"FFN: UBMoE wraps the decoder layers' FFNs. {fix}."
        )
    return targets


def _check_target(config: UBMoEConfig, name: str, module: nn.Module, layers: list[tuple[str, nn.Module]]) -> None:
    """One targeted FFN can hold experts: a whole FFN of linear projections, in memory, fit for the config's rank."""
    if isinstance(module, UBMoELayer):
        module = module.base_layer
    if isinstance(module, nn.Linear):
        raise ValueError(
            f"Target module {name!r} is a single linear layer, but UBMoE wraps a whole FFN (its projections "
            f"become the experts). Target the FFN module instead, e.g. target_modules=['mlp']."
        )
    projections = selected_projections(module, config)
    if not projections:
        kinds = sorted({type(m).__name__ for m in module.children()}) or "no submodules"
        raise ValueError(
            f"Target module {name!r} ({type(module).__name__}) has no nn.Linear inside (it holds {kinds}), so "
            "UBMoE cannot build experts for it. UBMoE wraps dense FFNs made of nn.Linear projections: GPT-2's "
            "Conv1D and fused MoE experts are not supported. If this is not the FFN, name the decoder layers' "
            "FFN module in UBMoEConfig(target_modules=[...])."
        )
    _check_ffn_inputs(name, module)
    if any(p.is_meta for p in module.parameters()):
        raise ValueError(
            f"Target module {name!r} has its weights on the meta device: accelerate offloads them (a device_map "
            "with 'cpu' or 'disk' entries beside a GPU, or disk_offload) or they were never loaded. UBMoE adds its "
            "experts beside the FFN's weights and cannot follow them out of memory. Load the base with every "
            "decoder layer in memory (device_map='cpu', one GPU, or a 4-bit base as in docs/qlora.md), wrap it, "
            "and offload after wrapping if you must (accelerate.cpu_offload)."
        )
    if config.attention_r:
        _check_attention(config, name, layers)
    if config.expert_type == "lora":
        for proj_name, proj in projections.items():
            if config.r > min(proj.in_features, proj.out_features):
                raise ValueError(
                    f"UBMoEConfig(r={config.r}) is larger than {name}.{proj_name} ({proj.in_features} -> "
                    f"{proj.out_features}); a LoRA rank must be at most min(in, out). Use a smaller r."
                )


def _check_modules_to_save(
    config: UBMoEConfig, model: nn.Module, targets: dict[str, nn.Module], adapter_name: str, saved: bool = False
) -> None:
    """PEFT wraps every module whose name ends with an entry of ``modules_to_save`` (plain ``str.endswith``) in a
    trained copy, after the experts are built, and runs the copy instead. Entries that would reach UBMoE's own modules
    are refused here, before anything changes:

    - inside a wrapped FFN (this adapter's experts-to-be or any adapter's): wrapping fails half-way (a UBMoE layer or
      its ModuleDicts cannot be wrapped), or trains a projection the experts share;
    - a module holding a wrapped FFN (a decoder layer, ``layers``): the copy's UBMoE layers got a mode state of their
      own, and ``set_mode`` no longer reached them;
    - in a layer with a mode-bi attention adapter (``attention_r``, this adapter's or another's): the attention, a
      module holding it, or one of its linear layers, whose hooks the copy would not run (the adapter silently did
      nothing) or whose copy the adapter's own modules were taken for. Its norms (Qwen3's ``q_norm``) are fine.
    """
    if not config.modules_to_save:
        return
    named_after = [entry for entry in config.modules_to_save if adapter_name.endswith(entry)]
    if named_after:  # the adapter's own modules end with its name: PEFT would wrap them too
        raise ValueError(
            f"Adapter name {adapter_name!r} ends with the modules_to_save entry {named_after[0]!r}, and PEFT matches "
            "modules_to_save against the end of module names: the adapter's own modules, named after it, would be "
            "wrapped as well. Give the adapter another name."
        )
    modules = list(model.named_modules(remove_duplicate=False))
    names = _module_names_once_built(modules, targets, adapter_name)
    _check_entries_match(config, names, saved)
    reasons = _clashes(config, model, modules, targets)
    for entry in config.modules_to_save:
        for name in names:
            if not name.endswith(entry):
                continue
            why = next((why for clash, why in reasons if clash(name)), None)
            if why is not None:
                raise ValueError(
                    f"UBMoEConfig(modules_to_save={config.modules_to_save}) has {entry!r}, which would match "
                    f"{name!r} (PEFT matches the end of module names), which {why}. Keep modules_to_save to "
                    "modules outside the wrapped FFNs and the adapted attentions, e.g. ['lm_head']."
                )


def _module_names_once_built(modules: list[tuple[str, nn.Module]], targets: dict[str, nn.Module], adapter: str) -> list:
    """The model's module names, with those this adapter's experts will add to the wrapped FFNs."""
    names = [n for n, _ in modules if n]
    for name, module in targets.items():  # what this adapter adds to the wrapped FFNs
        ffn = _unwrapped(module)
        inner = [n for n, _ in ffn.named_modules() if n]
        names += [f"{name}.base_layer", *(f"{name}.base_layer.{n}" for n in inner)]
        for container in _CONTAINERS:
            names += [f"{name}.{container}", f"{name}.{container}.{adapter}"]
            names += [f"{name}.{container}.{adapter}.{n}" for n in inner]  # copies, LoRA keys
    return names


def _check_entries_match(config: UBMoEConfig, names: list[str], saved: bool) -> None:
    """Every ``modules_to_save`` entry names a module (a saved adapter's that does not is warned about)."""
    # Entries that match no module, now or once the experts are built, were accepted and saved, and nothing was
    # trained or saved for them. PEFT adds both "classifier" and "score" for a (sequence or token) classification task.
    heads = task_heads(config)
    unmatched = [e for e in config.modules_to_save if e not in heads and not any(n.endswith(e) for n in names)]
    if unmatched and saved:  # an adapter saved so (by an earlier version) loads as it did: PEFT skips the entry
        warnings.warn(
            f"The adapter's modules_to_save entry {unmatched[0]!r} matches no module of this model, so it holds no "
            "trained copy for it and the entry is skipped. Remove it from the adapter's adapter_config.json to "
            "silence this.",
            stacklevel=stacklevel_outside_libraries(),
        )
    elif unmatched:
        outside = [n for n in names if n.count(".") < 2]  # the top of the model: its head, embeddings, norm...
        raise ValueError(
            f"UBMoEConfig(modules_to_save={config.modules_to_save!r}): {unmatched[0]!r} matches no module of the "
            "model (PEFT matches the end of module names), so nothing would be trained or saved for it. Name one of "
            f"its modules, e.g. {outside[:8]}."
        )


def _clashes(
    config: UBMoEConfig, model: nn.Module, modules: list[tuple[str, nn.Module]], targets: dict[str, nn.Module]
) -> tuple:
    """(test, why) pairs: a module name a ``modules_to_save`` entry may not reach, and why."""
    wrapped = {n for n, m in modules if isinstance(m, UBMoELayer)} | set(targets)  # every adapter's FFNs
    # The attentions that get or have a mode-bi attention adapter, and the linear layers it hooks in them
    layers = decoder_layers(model)
    adapted = {layer_index(n) for n in targets} if config.attention_r else set()
    adapted |= {m.layer_idx for _, m in modules if isinstance(m, UBMoELayer) and m.ubmoe_attn_A}
    index = {id(m): n for n, m in modules}
    attentions, hooked = [], []
    for i in sorted(i for i in adapted if i is not None and i < len(layers)):
        if (attention := attention_module(layers[i][1])) is not None and id(attention) in index:
            attentions.append(index[id(attention)])
            hooked += [f"{attentions[-1]}.{n}" for n in linear_projections(attention)]

    quantized = [n for n, m in modules if is_quantized_linear(m)]

    def under(name: str, roots: Iterable[str]) -> bool:
        return any(name == root or name.startswith(f"{root}.") for root in roots)

    def holds(name: str, roots: Iterable[str]) -> bool:
        return any(root.startswith(f"{name}.") for root in roots)

    return (
        (
            lambda n: under(n, wrapped),
            "is inside an FFN UBMoE wraps: the FFNs are the experts, trained through the adapter",
        ),
        (
            lambda n: holds(n, wrapped),
            "holds an FFN UBMoE wraps: PEFT would run a copy of it, whose UBMoE layers the adapter's modes no longer "
            "reach",
        ),
        (
            lambda n: n in attentions or under(n, hooked) or holds(n, attentions),
            "is, holds or is a linear layer of an attention that a mode-bi attention adapter (attention_r) hooks: "
            "PEFT would run a copy without those hooks",
        ),
        (
            lambda n: n in quantized or holds(n, quantized),
            "is or holds a quantized linear layer (bitsandbytes): its packed 4-bit/8-bit weights cannot be trained in "
            "full. Keep that module unquantized when loading (BitsAndBytesConfig(llm_int8_skip_modules=[...])) or "
            "train attention through attention_r",
        ),
    )


def _check_attention(config: UBMoEConfig, ffn_name: str, layers: list[tuple[str, nn.Module]]) -> None:
    """The mode-bi attention adapter needs the FFN's decoder layer to have a self-attention with linear layers the
    rank fits; checked before anything is built."""
    index = layer_index(ffn_name)
    attention = attention_module(layers[index][1]) if index is not None and index < len(layers) else None
    if attention is None:
        raise ValueError(
            f"UBMoEConfig(attention_r={config.attention_r}) adds a mode-bi attention adapter, but the decoder layer "
            f"of {ffn_name!r} has no self-attention module named 'self_attn', 'attention' or 'attn' with linear "
            "layers. Use attention_r=0."
        )
    wrapped = next(
        (
            n
            for n, m in attention.named_modules()
            if isinstance(m, AuxiliaryTrainingWrapper) and any(isinstance(x, nn.Linear) for x in m.modules())
        ),
        None,
    )
    if wrapped is not None:  # LoRA on the wrapper's inner linear layers, keyed by PEFT's internals: no save loads back
        raise ValueError(
            f"UBMoEConfig(attention_r={config.attention_r}) adds a mode-bi attention adapter, but the attention of "
            f"{ffn_name!r} {f'holds {wrapped!r},' if wrapped else 'is'} a trained copy of another adapter's "
            "modules_to_save. Use attention_r=0, or keep that adapter's modules_to_save outside the attention."
        )
    for proj_name, proj in linear_projections(attention).items():
        if config.attention_r > min(proj.in_features, proj.out_features):
            raise ValueError(
                f"UBMoEConfig(attention_r={config.attention_r}) is larger than the attention's {proj_name} "
                f"({proj.in_features} -> {proj.out_features}); use a rank of at most min(in, out)."
            )
