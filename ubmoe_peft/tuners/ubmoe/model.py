"""`UBMoEModel`: the PEFT tuner that wraps FFNs in UBMoE layers and switches attention per mode."""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTuner, _filter_state_dict_by_key_prefixes, _get_tuner_state_dict_key_prefixes
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers import PreTrainedConfig

from ...architectures import (
    ATTENTION_TAKES_IS_CAUSAL,
    FFN_MODULES,
    NO_BIDIRECTIONAL_IMPLEMENTATION,
    attention_module,
    decoder_layers,
    layer_index,
    linear_projections,
    text_config,
)
from ...export import export_moe, saved_module
from ...io import unwrapped_name
from .bnb import prepare_quantized_base
from .checks import (
    ADAPTER_SEGMENT,
    check_checkpoint,
    in_decoder,
    matches_target,
    refuse_other_tuners,
    refuse_sentence_transformers_module,
    stacklevel_outside_libraries,
    task_heads,
    validate_config,
    widen_quantized_copies,
)
from .config import UBMoEConfig
from .layer import UBMoELayer, merge_unsupported
from .lora import column_major
from .state import (
    ModeState,
    allowed_pairs,
    block_mask_allows,
    first_real_sees_second,
    forget_parts,
    no_adapter_error,
    packed_bidirectional_mask,
    recompute_in_forward_mode,
    superseded_error,
)

# Attention implementations that honour `is_causal=False` in transformers >= 5.2: through the mask they are given (a
# tensor, flex attention's BlockMask), or the kernel's own flag (flash).
BIDIRECTIONAL_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")

_PEFT_PREFIX = "base_model.model."  # PeftModel's key prefix
_LORA_B = re.compile(r"\.ubmoe_(lora|attn)_B\.")  # keys of LoRA B weights


def _drop_saved_copy_duplicates(state_dict: dict, adapter_name: str) -> dict:
    """Drop a resized embedding's ``modules_to_save`` copy saved a second time under the saving adapter's name.

    PEFT's save of a resized embedding (``save_embedding_layers``) takes every key under the embedding's prefix, the
    wrapper's ``modules_to_save.<saved name>.weight`` included, beside the copy it saves without the name. Loaded under
    another name, that duplicate had no place (refused), or would overwrite the copy of an adapter of the saved name
    (PEFT loads with strict=False). The copy is loaded from its nameless key (`ModulesToSaveWrapper`'s load map).
    """
    copy = re.compile(r"^(.*)\.modules_to_save\.([^.]+)\.(.+)$")
    kept = {}
    for key, value in state_dict.items():
        match = copy.match(key)
        if match and match[2] != adapter_name and f"{match[1]}.modules_to_save.{adapter_name}.{match[3]}" in state_dict:
            continue
        kept[key] = value
    return kept


class _TunerHook:
    """The tuner's mask check on an attention module, which a deep copy of that module alone shares. PEFT's
    modules_to_save deep-copies a module with its hooks: a bound method took a copy of the whole tuner (and of the
    model) along, and the trained copy then checked masks against that copy's frozen mode. A deep copy of the
    model (or of the PeftModel) still gets hooks of its own, bound to its copy of the tuner."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method
        self.__self__ = method.__self__  # the owning tuner, as for the bound method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.method(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> _TunerHook:
        tuner = self.__self__
        if id(tuner) not in memo and id(tuner.model) not in memo:  # one module copied alone
            return self
        return _TunerHook(copy.deepcopy(self.method, memo))  # the copy's tuner, made in the same deep copy


def kv_cache_in_mode_bi(what: str, from_embeds: bool = False, note: str = "") -> RuntimeError:
    """The refusal of a KV cache in mode bi; ``what`` completes "Cannot ... a KV cache", ``note`` ends it."""
    reason = "a bidirectional model's earlier states change with every new token"
    if from_embeds:  # transformers turns the cache on for a decoder generating from embeddings, whatever use_cache says
        return RuntimeError(
            f"Cannot generate from inputs_embeds in mode 'bi': transformers always uses a KV cache to generate from "
            f"embeddings, and {reason}. Pass input_ids with use_cache=False (each step encodes the whole text "
            "again), or generate in mode 'moe' (ubmoe_peft.set_mode(model, 'moe'))."
        )
    return RuntimeError(
        f"Cannot {what} a KV cache in mode 'bi': {reason}. Generate in mode 'moe' (ubmoe_peft.set_mode(model, "
        "'moe'); to train the routers through generation, as TRL's GRPO does, ubmoe_peft.set_stage(model, 'router')), "
        "or call generate with use_cache=False to have the bidirectional model generate by encoding the whole text "
        "again at every step (slow; how a bidirectional model's own generation is measured)." + note
    )


class UBMoEModel(BaseTuner):
    """Wraps each targeted FFN of ``model`` in a `UBMoELayer` and makes attention bidirectional in mode ``"bi"``."""

    prefix: str = "ubmoe_"
    tuner_layer_cls = UBMoELayer
    target_module_mapping = {model_type: [name] for model_type, name in FFN_MODULES.items()}

    def __init__(self, model, config, adapter_name, low_cpu_mem_usage: bool = False, state_dict=None) -> None:
        refuse_other_tuners(model)  # before PEFT's __init__ writes our config into a wrapped model's shared dict
        if isinstance(model, (PeftModel, BaseTuner)):  # wrapped again in place, it lost its trained adapter
            raise ValueError(
                f"The model given is a {type(model).__name__}, a model PEFT already wraps; wrapping it again would "
                "replace its adapter with a fresh one. Pass its base model (model.get_base_model()) for a new model, "
                "or add an adapter to it with model.add_adapter(name, config) or model.load_adapter(folder, name)."
            )
        refuse_sentence_transformers_module()
        # The layers created during super().__init__ share this object, so it must exist before injection.
        object.__setattr__(self, "_ubmoe_state", ModeState())
        object.__setattr__(self, "_ubmoe_hooks", [])
        with warnings.catch_warnings():
            if any(isinstance(m, UBMoELayer) for m in model.modules()):  # wrapped again: `_take_over` handles it
                warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute in the model")
            super().__init__(model, config, adapter_name, low_cpu_mem_usage=low_cpu_mem_usage, state_dict=state_dict)
        self._install_forward_hooks()

    # ---- injection ----------------------------------------------------------------------------------------------
    def inject_adapter(self, model: nn.Module, adapter_name: str, **kwargs: Any) -> None:
        # A private copy: validate_config fills in targets and the base's signature, which must not leak into a config
        # object the caller reuses for another model (or another adapter).
        if not isinstance(self.peft_config[adapter_name], UBMoEConfig):  # a bare AttributeError deep in the checks
            raise ValueError(
                f"UBMoEModel got a {type(self.peft_config[adapter_name]).__name__} for adapter {adapter_name!r}; it "
                "takes a UBMoEConfig. Wrap with peft.get_peft_model(base, UBMoEConfig())."
            )
        self.peft_config[adapter_name] = config = copy.deepcopy(self.peft_config[adapter_name])
        # PEFT's token-classification and question-answering models add their heads to the config object they hold
        # once the tuner is built, not to this copy, and then read them from it (a bare TypeError on None): so now.
        missing = [head for head in task_heads(config) if head not in (config.modules_to_save or [])]
        if missing:
            config.modules_to_save = [*(config.modules_to_save or []), *missing]
        validate_config(model, self.peft_config[adapter_name], adapter_name)  # every check before any change
        self._take_over(model, adapter_name)
        self._ubmoe_decoder = in_decoder(model)  # for `_check_target_module_exists`, once, not per module name
        prepare_quantized_base(model)  # bitsandbytes layers: a backward-safe path before any expert is built
        self._ubmoe_injecting = True  # its set_adapter(active adapters) is PEFT's housekeeping, not a user's switch
        try:
            super().inject_adapter(model, adapter_name, **kwargs)
        finally:
            self._ubmoe_injecting = False
        self._activate_copies(model)  # a base wrapped again: `_take_over` left its modules_to_save wrappers inactive
        self._ubmoe_state.keep_trainable(self._adapter_parameters(adapter_name, model))  # a new one while disabled
        self._ubmoe_state.left_adapters.pop(adapter_name, None)  # new parameters under that name
        forget_parts(model.modules())  # new layers and adapters; a base wrapped again: the dropped earlier adapter's

    def _take_over(self, model: nn.Module, adapter_name: str) -> None:
        """Make UBMoE layers of an earlier PeftModel on this same base follow this model.

        get_peft_model changes the base in place, and PEFT then wraps it again (with a warning): the MISSION's
        ``model.save_pretrained(d); PeftModel.from_pretrained(base, d)`` does exactly that. PEFT's LoRA layers simply
        gain the adapter; ours also read their mode from the model that made them, and that model's backbone hooks
        stay on the base. Left so, set_mode on the new model would not reach the layers (its mode uni would not be
        the base model) and the old hooks would keep a mode-bi attention bidirectional. So the layers follow this
        model, the old hooks go, and the old model refuses mode switches from now on, naming why. The earlier model's
        adapter of the name being added goes from every layer first (PEFT's LoRA replaces a same-named adapter too):
        one saved with other settings (the other expert type, no attention adapter, fewer layers) would otherwise sit
        beside the new one, and loading the new one's weights would fail on the leftover parameters."""
        layers = [m for m in model.modules() if isinstance(m, UBMoELayer) and m._state is not self._ubmoe_state]
        if not layers:
            return
        backbone = getattr(model, "base_model", model)
        owners = {id(h.__self__): h.__self__ for h in backbone._forward_pre_hooks.values() if hasattr(h, "__self__")}
        for owner in owners.values():
            if isinstance(owner, UBMoEModel) and owner is not self:
                owner._remove_hooks()
        for layer in layers:
            layer._state.superseded = "wrapped again"
            layer._state = self._ubmoe_state
            layer.drop_adapter(adapter_name)
            layer.set_attention_hooks(self._ubmoe_state.attention_hooked)
        for module in model.modules():  # and its trained copies (modules_to_save), which PEFT would expect in the file
            if isinstance(module, AuxiliaryTrainingWrapper):
                module.delete_adapter(adapter_name, new_active_adapters=None)
        forget_parts(model.modules(), state=True)  # the earlier model's state (its last batch's routing) goes too

    def _activate_copies(self, model: nn.Module, inference_mode: bool | None = None) -> None:
        """Make each modules_to_save wrapper that holds the active adapter's copy run it. PEFT leaves a wrapper's
        active adapter as it was when it adds a copy to it, and when it deletes an adapter the wrapper never held. So
        the trained copy silently did not run (nor train) after `_take_over` (``PeftModel.from_pretrained(base, d)`` on
        the base of an earlier model: its copy was deleted, leaving none active), and after deleting the active
        adapter for one whose copies sit in other wrappers (PEFT's LoRA has the same gap)."""
        active = self.active_adapters
        if len(active) != 1:
            return
        (name,) = active
        for module in model.modules():
            wrapper = isinstance(module, AuxiliaryTrainingWrapper)
            if wrapper and name in module._adapters and module.active_adapters != active:
                frozen = self.peft_config[name].inference_mode if inference_mode is None else inference_mode
                module.set_adapter(name, inference_mode=frozen)

    def _prepare_adapter_config(self, peft_config: UBMoEConfig, model_config: dict) -> UBMoEConfig:
        return peft_config  # target_modules are resolved by validate_config, which can see the whole model

    def _check_target_module_exists(self, peft_config: UBMoEConfig, key: str) -> bool:
        decoder = getattr(self, "_ubmoe_decoder", None)
        return matches_target(peft_config, key, decoder if decoder is not None else in_decoder(self.model))

    def _create_and_replace(self, peft_config, adapter_name, target, target_name, parent, current_key, **_):
        if isinstance(target, UBMoELayer):
            target.update_layer(adapter_name, peft_config)
            return
        hidden = (
            getattr(text_config(self.model), "hidden_size", None)
            or next(iter(linear_projections(target).values())).in_features
        )
        index = layer_index(current_key) or 0
        attention = attention_module(parent)  # kept even without an attention adapter: a later adapter may add one
        new = UBMoELayer(target, adapter_name, peft_config, self._ubmoe_state, index, hidden, attention=attention)
        if adapter_name not in self.active_adapters:
            new.requires_grad_(False)
        new.train(target.training)  # a new module is in training mode: after model.eval(), its dropout ran at inference
        self._replace_module(parent, target_name, new, target)

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        """Dtypes are chosen when experts are built: LoRA in fp32, copies in the base's (compute) dtype, the router in
        config.router_dtype; PEFT's blanket fp32 upcast would break a bf16 copy expert's forward. As in PEFT,
        ``autocast_adapter_dtype=False`` leaves LoRA weights in the dtype of the weights they adapt (bf16 / fp16 on
        such a base: half the memory, merges then as exact as the base dtype; it was ignored)."""
        if autocast_adapter_dtype:
            return
        for layer in self.model.modules():
            if not isinstance(layer, UBMoELayer):
                continue
            for a, b, adapted in (
                (layer.ubmoe_lora_A, layer.ubmoe_lora_B, layer.base_layer),
                (layer.ubmoe_attn_A, layer.ubmoe_attn_B, layer._attention),  # the mode-bi attention adapter
            ):
                if adapter_name not in a:
                    continue
                dtype = next(p.dtype for p in adapted.parameters())  # a quantized base's packed codes: kept in fp32
                if dtype in (torch.float16, torch.bfloat16):
                    for param in (*a[adapter_name].parameters(), *b[adapter_name].parameters()):
                        param.data = param.data.to(dtype)  # `.to` keeps B's column-major strides

    def delete_adapter(self, adapter_name: str) -> None:
        state, active = self._ubmoe_state, list(self.active_adapters)
        super().delete_adapter(adapter_name)
        self._activate_copies(self.model, inference_mode=False)  # as PEFT's delete path sets the new active one
        for name in (adapter_name, *self.active_adapters):  # the new active one is set: what it was left with goes
            state.left_adapters.pop(name, None)
        if state.trainable is not None:  # inside disable_adapter(): deleted weights go, a new active one's flags hold
            alive = {id(p) for p in self.model.parameters()}
            state.trainable = [(p, flag) for p, flag in state.trainable if id(p) in alive]
            new = [name for name in self.active_adapters if name not in active]
            state.keep_trainable(p for name in new for p in self._adapter_parameters(name))
        forget_parts(self._decoder_layers)  # they held the deleted adapter's modules

    def add_weighted_adapter(self, adapters: Any, weights: Any, adapter_name: str, *args: Any, **kwargs: Any) -> None:
        """Not supported (it failed with a bare AttributeError): PEFT's LoRA combines adapters' low-rank updates, but
        a mixture of UBMoE adapters has no such form, since each router was trained for its own bi expert."""
        raise NotImplementedError(
            f"add_weighted_adapter({adapters!r}, ...): UBMoE adapters cannot be combined by weights, since each router "
            "was trained to choose between the FFN and its own bi expert. Switch between them with "
            "model.set_adapter(name), or train one adapter on the combined data."
        )

    def set_adapter(self, adapter_name: str | list[str], inference_mode: bool = False) -> None:
        if not isinstance(adapter_name, (str, list, tuple)):
            raise ValueError(
                f"set_adapter({adapter_name!r}): pass the name of one of this model's adapters, "
                f"{list(self.peft_config)}."
            )
        names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        unknown = [name for name in names if name not in self.peft_config]
        if unknown:  # every layer switched to an adapter it lacks, and the model ran the base model without a word
            raise ValueError(
                f"set_adapter({adapter_name!r}): {unknown[0]!r} is not an adapter of this model; its adapters are "
                f"{list(self.peft_config)}."
            )
        # PEFT's multi-adapter call: adapters on other layers each ran there, a silent mix. None is PEFT's own call
        # once every adapter was deleted; with one still active it ran the base's FFNs under the mode's attention.
        if len(names) > 1 or (not names and self.active_adapters):
            raise ValueError(
                f"set_adapter({adapter_name!r}): UBMoE runs one adapter at a time (each layer routes between its FFN "
                "and one adapter's bidirectional expert). Pass one adapter name."
            )
        # PEFT makes the adapter set all trainable. TRL's DPO, KTO, GRPO and RLOO switch to a frozen "ref" copy and
        # back around every reference forward, which made a stage-router model train its experts (and run their
        # dropout) from the second step on: an adapter set again gets the trainability it had when left.
        state = self._ubmoe_state
        active = list(self.active_adapters)
        flags = dict(state.trainable) if state.trainable is not None else {}  # inside disable_adapter(): the kept
        for name in active:
            if name not in names:
                state.left_adapters[name] = [(p, flags.get(p, p.requires_grad)) for p in self._adapter_parameters(name)]
        super().set_adapter(adapter_name, inference_mode=inference_mode)
        for name in names:
            left = state.left_adapters.pop(name, ())
            for param, trainable in () if name in active else left:  # set again while active: PEFT's rule
                param.requires_grad_(trainable and not inference_mode)
        if getattr(self, "_ubmoe_injecting", False):  # PEFT sets the active one again on every new adapter
            changed = {*active, *names} - (set(active) & set(names))
            state.keep_trainable(p for name in changed for p in self._adapter_parameters(name))
            return
        touched = [p for name in {*active, *names} for p in self._adapter_parameters(name)]
        others = set(self.peft_config) - {*active, *names}
        if others and state.trainable is not None:  # only inside disable_adapter() is anything kept
            # PEFT's set_adapter freezes every other adapter's UBMoE weights too, but not its modules_to_save copies
            wrappers = [m for m in self.model.modules() if isinstance(m, AuxiliaryTrainingWrapper)]
            copies = {id(p) for m in wrappers for p in m.parameters()}
            touched += [p for name in others for p in self._adapter_parameters(name) if id(p) not in copies]
        state.keep_trainable(touched)

    def _adapter_parameters(self, adapter_name: str, model: nn.Module | None = None) -> list[nn.Parameter]:
        """The adapter's parameters in ``model`` (the base), UBMoE's and its modules_to_save copies: those with the
        name as a dotted part of their key (exact: `checks._check_adapter_name` refuses names that are parts of other
        keys)."""
        model = self.model if model is None else model
        return [p for n, p in model.named_parameters() if f".{adapter_name}." in f".{n}."]

    def set_requires_grad(self, adapter_names: str | Sequence[str], requires_grad: bool = True) -> None:
        super().set_requires_grad(adapter_names, requires_grad=requires_grad)
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        state = self._ubmoe_state
        for name in names:  # an inactive adapter: what was set now is what it has when set again
            params = self._adapter_parameters(name)
            if name in self.active_adapters:
                state.left_adapters.pop(name, None)
            else:
                state.left_adapters[name] = [(p, p.requires_grad) for p in params]
            state.keep_trainable(params)

    def _enable_adapter_layers(self, enabled: bool = True) -> None:
        # PEFT freezes every adapter weight when disabling and makes the active adapter's all trainable when
        # enabling, so `with model.disable_adapter():` (a reference forward, as in DPO) left a stage-router model
        # training its experts too, with LoRA dropout back on. Enabling restores what disabling found.
        # Trainability set while disabled (set_adapter, set_stage, ...) replaces what is restored (ModeState).
        state = self._ubmoe_state
        if not enabled and state.trainable is None:
            state.trainable = [(p, p.requires_grad) for p in self.model.parameters()]
        super()._enable_adapter_layers(enabled)
        if enabled and state.trainable is not None:
            for param, trainable in state.trainable:
                param.requires_grad_(trainable)
            state.trainable = None
        self._ubmoe_state.adapters_enabled = enabled  # disabled adapters also mean causal attention

    # ---- save / load keys ---------------------------------------------------------------------------------------
    @classmethod
    def _get_adapter_state_dict(cls, model, config, adapter_name, state_dict, unwanted_adapter_names):
        # PEFT finds the adapter's keys under its modules' names, stripping FSDP's `_fsdp_wrapped_module.` only from
        # their front; FSDP1 units inside the model (decoder layers) keep it in the middle, which no key of FSDP's
        # full state dict has: the adapter was saved with no tensor at all.
        # (torch's activation-checkpoint wrapper, which accelerate applies under FSDP, likewise)
        prefixes = {unwrapped_name(prefix) for prefix in _get_tuner_state_dict_key_prefixes(model)}
        return _filter_state_dict_by_key_prefixes(state_dict, prefixes)

    @classmethod
    def _remove_adapter_name_from_key(cls, key: str, adapter_name: str) -> str:
        # Our adapter keys are `...mlp.ubmoe_lora_A.<adapter>.gate_proj.weight`: the adapter name follows the
        # `ubmoe_*` container, not the end of the key, so PEFT's default rule would keep it and a checkpoint saved as
        # "default" would silently not load under another name. Loading inverts this same function.
        return re.sub(ADAPTER_SEGMENT.format(name=re.escape(adapter_name)), r"\1", key)

    @classmethod
    def _remap_adapter_state_dict_for_load(cls, model, config, adapter_name, state_dict):
        # PEFT loads with strict=False, so a checkpoint for another base would load partly and silently. Every
        # UBMoE tensor must have a home of the same shape, and every adapter parameter a tensor.
        # A state dict of a model made with inject_adapter_in_model has no PeftModel prefix: PEFT maps a PeftModel's
        # keys onto such a model, not the other way round (it was refused as "saved with other settings").
        if isinstance(model, PeftModel) and state_dict and not any(k.startswith(_PEFT_PREFIX) for k in state_dict):
            state_dict = {_PEFT_PREFIX + key: value for key, value in state_dict.items()}
        remapped = super()._remap_adapter_state_dict_for_load(
            model=model, config=config, adapter_name=adapter_name, state_dict=state_dict
        )
        remapped = _drop_saved_copy_duplicates(remapped, adapter_name)
        check_checkpoint(model, config, adapter_name, remapped)
        forget_parts(model.modules())  # PEFT may assign new parameters (low_cpu_mem_usage): not the ones kept
        widen_quantized_copies(model, remapped)
        # Where PEFT assigns the loaded tensors instead of copying them into the parameters (low_cpu_mem_usage): each
        # in its parameter's dtype (a bf16 file kept the routers bf16, a copy expert of another dtype failed in its
        # first forward), and B in its fast layout.
        # parameters and buffers by name, not state_dict(), which would serialize every 4-bit quant_state once more
        own = {
            **dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False)),
        }

        def fitted(key: str, value: torch.Tensor) -> torch.Tensor:
            if key in own and value.is_floating_point():
                value = value.to(own[key].dtype)
            return column_major(value) if _LORA_B.search(key) else value

        return {key: fitted(key, value) for key, value in remapped.items()}

    # ---- forward hooks: attention per mode ----------------------------------------------------------------------
    def _install_forward_hooks(self) -> None:
        backbone = getattr(self.model, "base_model", self.model)
        # Bound methods: a deep copy of the backbone holds the layers, whose mode state it copies too
        self._ubmoe_hooks.append(backbone.register_forward_pre_hook(self._before_backbone, with_kwargs=True))
        self._ubmoe_hooks.append(backbone.register_forward_hook(self._after_backbone, always_call=True))
        if self.model is not backbone and getattr(self.model, "can_generate", lambda: False)():  # a causal LM
            self._ubmoe_hooks.append(self.model.register_forward_pre_hook(self._before_lm, with_kwargs=True))
        layers = decoder_layers(self.model)
        self._decoder_layers = [layer for _, layer in layers]  # whose checkpoint function `_before_backbone` wraps
        # Any attention name: a backbone that drops `is_causal=False` (Falcon, GPT-Neo) must fail here, not run causal.
        # The first layer of each layer type that has one: a hybrid's first layer may be a convolution or state-space
        # block (LFM2, Bamba), and each type gets its own mask (Llama 4's chunked layers stayed causal in mode bi
        # behind a full-attention first layer).
        types = getattr(text_config(self.model), "layer_types", None)
        types = types if isinstance(types, (list, tuple)) and len(types) == len(layers) else [None] * len(layers)
        checked = set()
        hand_flag = getattr(text_config(self.model), "model_type", None) in ATTENTION_TAKES_IS_CAUSAL
        for (_, layer), kind in zip(layers, types, strict=True):
            attention = attention_module(layer)
            if attention is not None and hand_flag:  # first, so that the check below sees the flag it was handed
                hook = _TunerHook(self._attention_not_causal)
                self._ubmoe_hooks.append(attention.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
            if attention is not None and kind not in checked:
                checked.add(kind)
                check = _TunerHook(self._check_bidirectional)
                self._ubmoe_hooks.append(attention.register_forward_pre_hook(check, with_kwargs=True))

    def _remove_hooks(self, every_tuner: bool = False) -> None:
        """Remove this tuner's forward hooks, also from the trained copies of hooked modules (modules_to_save); with
        ``every_tuner`` (unload: no UBMoE layer is left for any) every UBMoE tuner's, such as those a refused load
        onto this wrapped base left behind."""

        def ours(hook: Any) -> bool:
            owner = getattr(hook, "__self__", None)
            return isinstance(owner, UBMoEModel) if every_tuner else isinstance(hook, _TunerHook) and owner is self

        for handle in self._ubmoe_hooks:
            handle.remove()
        self._ubmoe_hooks.clear()
        for module in self.model.modules():
            for hooks in (module._forward_pre_hooks, module._forward_hooks):
                for key in [k for k, h in hooks.items() if ours(h)]:
                    del hooks[key]
                    for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs"):
                        getattr(module, extra).pop(key, None)
                    module._forward_hooks_always_called.pop(key, None)

    def _attn_implementation(self) -> str | None:
        return getattr(text_config(self.model), "_attn_implementation", None)

    def _cache_tag(self) -> tuple:
        """What a KV cache filled now holds the states of: the mode (or the base model) and the adapter."""
        state = self._ubmoe_state
        return (state.mode if state.adapters_enabled else "adapters disabled", tuple(self.active_adapters))

    def _after_backbone(self, module: nn.Module, args: tuple, output: Any) -> None:
        # The cache is tagged with the mode before the lock goes: a thread waiting for it (an embedding call) could
        # switch to mode bi in between, and the prefill's cache was tagged 'bi' (its next decode step refused it).
        try:
            # The plain dict lookup: transformers 5 names it `cache` and warns on any access by the older name
            cache = dict.get(output, "cache", dict.get(output, "past_key_values")) if isinstance(output, dict) else None
            if cache is not None and getattr(cache, "_ubmoe_filled_in", None) is None:
                try:
                    cache._ubmoe_filled_in = self._cache_tag()
                except AttributeError:  # a cache type without attributes: unchecked
                    pass
        finally:
            # Also when the forward raised (always_call), which PyTorch says with no output
            self._ubmoe_state.end_forward(failed=output is None)

    def _before_backbone(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        state = self._ubmoe_state
        state.lock_forward()  # one forward at a time (ModeState); `_after_backbone` releases, also on errors
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = _cached_length(cache)
        # models mixing sliding and full layers get one 4D mask per layer type from generate (static or hybrid cache,
        # Gemma 2/3's default): the full layers' marks every real token, else the sliding layers' (a model whose layers
        # all slide); none was read, so padding counted as real tokens
        counted = mask.get("full_attention", mask.get("sliding_attention")) if isinstance(mask, dict) else mask
        state.begin_forward(counted if isinstance(counted, torch.Tensor) else None, past)
        # a 4D tensor or a flex BlockMask: transformers uses it as given
        # (also a dict of them, one per layer type, which models mixing sliding and full layers take as given)
        state.user_mask_4d = any(_is_4d_mask(m) for m in (mask.values() if isinstance(mask, dict) else [mask]))
        self._check_cache_mode(cache, past)
        if module.training and torch.is_grad_enabled():  # checkpointing recomputes a layer in its forward's mode
            recompute_in_forward_mode(self._decoder_layers, state)
        if state.attention_hooked != (state.spec.ffn == "bi"):  # a mode change since the last forward
            state.attention_hooked = state.spec.ffn == "bi"
            for layer in self.model.modules():
                if isinstance(layer, UBMoELayer):
                    layer.set_attention_hooks(state.attention_hooked)
        if state.adapters_enabled and state.mode != "uni" and not self.active_adapters:
            # the active adapter deleted (one added or loaded after it is not made active, as in PEFT): the layers ran
            # the base FFNs, and mode bi's attention bidirectional, silently
            raise no_adapter_error(state.mode, list(self.peft_config))
        if state.spec.causal or not state.adapters_enabled:
            return None
        return self._bidirectional_inputs(module, mask, args, kwargs)

    def _check_cache_mode(self, cache: Any, past: int) -> None:
        """Refuse a KV cache filled in another mode (or adapter): it holds that mode's keys and values, and decoding
        would continue from them (logits off by about 0.1 on a tiny model, with no sign)."""
        if past == 0 and getattr(cache, "_ubmoe_filled_in", None) is not None:
            del cache._ubmoe_filled_in  # emptied (`cache.reset()`, transformers' way to reuse a static cache)
        filled_in = getattr(cache, "_ubmoe_filled_in", None)
        if filled_in is not None and filled_in != self._cache_tag():
            raise RuntimeError(
                f"This KV cache was filled in mode {filled_in[0]!r} (adapter {list(filled_in[1])}), but this forward "
                f"runs in {self._cache_tag()[0]!r} (adapter {list(self.active_adapters)}): decoding would continue "
                "from another model's states. Continue in the mode that filled it, or run the whole text again in "
                "this mode (without past_key_values)."
            )

    def _bidirectional_inputs(self, module: nn.Module, mask: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Mode bi's backbone inputs: ``is_causal=False`` and no KV cache, after refusing what cannot attend
        bidirectionally (an attention implementation, a cache, a causal 4D mask of the caller's)."""
        state = self._ubmoe_state
        implementation = self._attn_implementation()
        model_type = getattr(text_config(self.model), "model_type", None)
        broken = NO_BIDIRECTIONAL_IMPLEMENTATION.get(model_type, ())
        if implementation not in BIDIRECTIONAL_ATTENTION or implementation in broken:
            supported = tuple(a for a in BIDIRECTIONAL_ATTENTION if a not in broken)
            raise ValueError(
                f"Mode 'bi' needs bidirectional attention, which attn_implementation={implementation!r} does not "
                f"support here ({model_type!r}). Load the model with attn_implementation='sdpa' (or one of "
                f"{supported})."
                + (  # attention_dependence switches to eager attention, the only one that gives attention weights
                    " attention_dependence needs eager attention, so it cannot measure this model in mode bi."
                    if implementation in broken
                    else ""
                )
            )
        if kwargs.get("cache", kwargs.get("past_key_values")) is not None:
            # `generate` always passes a cache object; a plain forward does not. Refusing here stops generation at
            # its first step, whichever wrapper's `generate` was called.
            embeds = kwargs.get("inputs_embeds") is not None  # generate caches from embeddings, whatever use_cache says
            raise kv_cache_in_mode_bi(
                "generate with (or use)",
                note=" Generate from input_ids, not inputs_embeds, with "
                "use_cache=False: transformers caches whenever it generates from embeddings."
                if embeds
                else "",
            )
        if state.user_mask_4d:  # a 4D mask is used as given, so it must itself be bidirectional
            for kind, given in mask.items() if isinstance(mask, dict) else [(None, mask)]:
                if not _is_4d_mask(given) or _user_mask_sees_later(given):
                    continue
                which = f" for {kind!r} layers" if kind is not None else ""
                raise ValueError(
                    f"Mode 'bi' attends bidirectionally, but the 4D attention_mask passed in{which}, of shape "
                    f"{tuple(given.shape)}, lets no token see a later one (a causal or block-causal mask). Pass the 2D "
                    "padding mask (transformers then builds a bidirectional one), or a 4D mask that lets tokens see "
                    "later ones."
                )
        elif mask is None:  # where transformers looks for packed rows (no mask, no cache)
            args, kwargs = self._keep_documents_apart(module, args, kwargs)
        kwargs["is_causal"] = False  # transformers >= 5.2 then builds a bidirectional (padding-only) mask
        # No KV cache either: mode bi's keys and values (bidirectional, bi experts) are no prefix for later tokens,
        # and a cache returned here could be passed on to decoding in another mode, which would continue from them.
        kwargs["use_cache"] = False
        return args, kwargs

    def _keep_documents_apart(self, backbone: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Mode bi's inputs with, for packed rows, a mask that keeps each row's documents apart
        (`packed_bidirectional_mask`); unchanged where no row is packed."""
        embeds = kwargs.get("inputs_embeds")
        reference = embeds if embeds is not None else kwargs.get("input_ids", args[0] if args else None)
        if reference is None:
            return args, kwargs
        dtype = embeds.dtype if embeds is not None else backbone.get_input_embeddings().weight.dtype
        position_ids = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
        packed = packed_bidirectional_mask(backbone.config, reference, position_ids, dtype)
        built = packed.values() if isinstance(packed, dict) else [packed]
        if all(mask is None for mask in built):  # none packed, or flash: its varlen path splits them by position_ids
            return args, kwargs
        self._ubmoe_state.user_mask_4d = True  # bidirectional per document, which the check after attention misreads
        if len(args) > 1:
            return (args[0], packed, *args[2:]), kwargs
        return args, {**kwargs, "attention_mask": packed}

    def _before_lm(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Warn (once) when the causal LM's logits train in mode bi: TRL's trainers (DPO, KTO, ORPO, SFT) run after a
        ContrastiveTrainer, which leaves the model in stage contrastive, trained the bi experts on next-token losses
        with bidirectional attention, where every position sees the token it predicts, without a word. An embedding
        forward asks for hidden states (or runs the backbone alone), so it is not warned about."""
        state = self._ubmoe_state
        if state.spec.causal or not state.adapters_enabled or not (module.training and torch.is_grad_enabled()):
            return
        if kwargs.get("output_hidden_states", getattr(module.config, "output_hidden_states", False)):
            return
        if not getattr(self, "_warned_lm_in_bi", False):
            self._warned_lm_in_bi = True
            warnings.warn(
                "The causal LM trains in mode 'bi': its attention is bidirectional, so every position sees the token "
                "it is asked to predict, and the bi experts are what trains. To train the routers with TRL's trainers "
                "(SFT, DPO, KTO, ORPO, GRPO), call ubmoe_peft.set_stage(model, 'router') first (a ContrastiveTrainer "
                "leaves the model in stage contrastive). If a next-token loss in mode bi is meant (masked next-token "
                "training), ignore this warning.",
                stacklevel=stacklevel_outside_libraries(),
            )

    def _attention_not_causal(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Mode bi's `is_causal=False`, handed to an attention module whose decoder layer drops it (StableLM,
        Nemotron: one unpadded text ran causal on sdpa)."""
        state = self._ubmoe_state
        if state.spec.causal or not state.adapters_enabled:
            return None
        return args, {**kwargs, "is_causal": False}

    def _check_bidirectional(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Fail loudly if a transformers release turned mode bi's attention causal again (seen in peer projects)."""
        state = self._ubmoe_state
        # A user's 4D mask was checked above; a recompute's mask by its forward (`user_mask_4d` is the last forward's)
        if state.spec.causal or not state.adapters_enabled or state.user_mask_4d or state.recomputing:
            return
        mask = kwargs.get("attention_mask")
        if mask is None:
            if kwargs.get("is_causal", getattr(module, "is_causal", True)) is not False:
                raise _causal_error(self.model, self._attn_implementation(), module)
            return
        # A tensor mask (eager, sdpa) or flex attention's BlockMask, whose mask_mod and block lists are read
        if not first_real_sees_second(mask):
            raise _causal_error(self.model, self._attn_implementation(), module)

    # ---- forward, generation, unload ----------------------------------------------------------------------------
    @contextmanager
    def _enable_peft_forward_hooks(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        """PEFT's per-call hook point: PeftModel (every task type) enters it around each forward and generate call,
        also those that call the base model directly, bypassing this tuner's own forward."""
        if self._ubmoe_state.superseded:  # its layers follow a newer model, or are gone: it would run as another
            raise superseded_error(self._ubmoe_state.superseded)
        if kwargs.get("adapter_names") is not None:  # PeftModel would drop it and run the active adapter on every row
            raise ValueError(
                f"adapter_names={kwargs['adapter_names']!r}: UBMoE runs one adapter per forward, not one per batch "
                "row (PEFT's mixed-adapter batches). Run each adapter's rows separately, after model.set_adapter(name)."
            )
        try:
            yield
        except BaseException:
            self._ubmoe_state.end_stale_forward()  # a KeyboardInterrupt out of a forward: its lock, its routing
            raise

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._enable_peft_forward_hooks(**kwargs):
            return super().forward(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        with self._enable_peft_forward_hooks(**kwargs):  # the same per-call checks as a forward
            if self._in_mode_bi():
                if kwargs.get("inputs_embeds") is not None and kwargs.get("input_ids") is None:
                    raise kv_cache_in_mode_bi("generate with", from_embeds=True)
                config = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
                if self._generation_setting("cache_implementation", kwargs, config) == "paged":
                    # generate hands over to continuous batching, whose loop only logs a forward's error
                    raise kv_cache_in_mode_bi("run generate(cache_implementation='paged') (continuous batching) with")
                if self._generation_setting("use_cache", kwargs, config) is not False:
                    raise kv_cache_in_mode_bi("generate with")
            return self.model.generate(*args, **kwargs)

    # Continuous batching (transformers' paged cache) caches keys and values, and its generation loop only logs an
    # error raised by a forward: a request in mode bi came back empty, without an exception. Refused up front instead.
    def init_continuous_batching(self, *args: Any, **kwargs: Any) -> Any:
        if self._in_mode_bi():
            raise kv_cache_in_mode_bi("run init_continuous_batching (continuous batching) with")
        return self.model.init_continuous_batching(*args, **kwargs)

    def generate_batch(self, *args: Any, **kwargs: Any) -> Any:
        if self._in_mode_bi():
            raise kv_cache_in_mode_bi("run generate_batch (continuous batching) with")
        return self.model.generate_batch(*args, **kwargs)

    def continuous_batching_context_manager(self, *args: Any, **kwargs: Any) -> Any:
        if self._in_mode_bi():
            raise kv_cache_in_mode_bi("run continuous_batching_context_manager (continuous batching) with")
        return self.model.continuous_batching_context_manager(*args, **kwargs)

    def _generation_setting(self, name: str, kwargs: dict, config: Any) -> Any:
        """The value transformers' generate uses: the keyword (even None), else the config passed, else the model's
        generation config, where None is unset (transformers fills them so); use_cache then defaults to True."""
        if name in kwargs:
            return kwargs[name]
        for source in (vars(config) if config is not None else {}, vars(self.model.generation_config)):
            if source.get(name) is not None:
                return source[name]
        return True if name == "use_cache" else None

    def _in_mode_bi(self) -> bool:
        with self._ubmoe_state.forward_lock:  # not mid-way through another thread's embedding call (mode bi)
            return not self._ubmoe_state.spec.causal and self._ubmoe_state.adapters_enabled

    def merge_and_unload(
        self,
        target: str = "moe",
        progressbar: bool = False,
        safe_merge: bool = False,
        adapter_names: list[str] | None = None,
    ) -> nn.Module:
        """The adapted model as a plain transformers model that needs no ubmoe-peft to load.

        ``target="moe"`` (default): a new transformers MoE model (the base family's MoE twin, e.g. Mixtral for Llama)
        with the original FFN and the bi expert as its two experts and our routers; it equals mode moe (see
        ``ubmoe_peft.export``). The wrapped model is left as it is.
        ``target="bi"``: the dense embedding model, made in place as PEFT's merge does: each wrapped FFN becomes its
        bi expert (LoRA deltas merged into the projections, or the FFN copy) and ``config.is_causal`` is set to
        False, which transformers' mask functions read, so the saved model loads with bidirectional attention.
        ``safe_merge`` checks every merged weight for NaN/inf; all checks run before anything changes.
        """
        if self._ubmoe_state.superseded:  # it would merge (or export) the layers another model now runs, or none
            raise superseded_error(self._ubmoe_state.superseded)
        if target not in ("moe", "bi"):
            raise ValueError(f"merge_and_unload(target={target!r}): target must be 'moe' or 'bi'.")
        adapter = self._merge_adapter(adapter_names)
        offloaded = [name for name, p in self.model.named_parameters() if p.is_meta]
        if offloaded:
            raise ValueError(
                f"merge_and_unload(target={target!r}) reads every weight, but {len(offloaded)} are on the meta device "
                f"(offloaded by accelerate, e.g. {offloaded[0]!r}). Merge before offloading, or load the base with "
                "every weight in memory, load the adapter on it (PeftModel.from_pretrained) and merge there."
            )
        if target == "moe":
            return export_moe(self.model, adapter, check_finite=safe_merge)
        self._probe_bidirectional()
        layers = [m for m in self.model.modules() if isinstance(m, UBMoELayer) and adapter in m.ubmoe_router]
        weights = {id(layer): layer.bi_weights(adapter, check_finite=safe_merge) for layer in layers}  # all checks
        attention = {id(layer): layer.attention_weights(adapter, check_finite=safe_merge) for layer in layers}
        merged = {id(layer): layer.bi_ffn(adapter, weights[id(layer)]) for layer in layers}
        for layer in layers:
            layer.merge_attention(attention[id(layer)])
        model = self._unwrap(lambda layer: merged.get(id(layer), layer.base_layer), adapter)
        _own_config(model)
        for config in {id(c): c for c in (getattr(model, "config", None), text_config(model)) if c}.values():
            config.is_causal = False  # masking_utils: a bidirectional mask for every attention implementation
        return model

    def _probe_bidirectional(self) -> None:
        """Run two tokens in mode bi before the bi merge changes anything: the merged model is bidirectional only
        where mode bi is (its config's ``is_causal=False`` is what mode bi passes at each forward). GPT-Neo, which
        ignores both, was merged into a causal model presented as the embedding model, without a word."""
        model_type = getattr(text_config(self.model), "model_type", None)
        if model_type in ATTENTION_TAKES_IS_CAUSAL:
            raise ValueError(
                f"merge_and_unload(target='bi') cannot make a bidirectional {model_type!r} model: its decoder layers "
                "drop is_causal=False on the way to attention, so the merged model, loaded without ubmoe-peft, would "
                "attend causally to any text without padding (mode bi hands the flag to each attention module "
                "itself). Keep the adapter and embed in mode bi (ubmoe_peft.to_sentence_transformer(model))."
            )
        ids = torch.zeros(1, 2, dtype=torch.long, device=self.model.get_input_embeddings().weight.device)
        state = self._ubmoe_state
        # Under the forward lock throughout: no other thread's forward runs in mode bi meanwhile
        with state.forward_lock, state.switched("bi"), torch.no_grad():
            try:
                self.model(input_ids=ids)
            except (RuntimeError, ValueError) as err:
                raise type(err)(
                    f"merge_and_unload(target='bi') makes the mode-bi model, which this model cannot run: {err}"
                ) from err

    def _merge_adapter(self, adapter_names: list[str] | None) -> str:
        names = list(self.active_adapters) if adapter_names is None else list(adapter_names)
        if len(names) != 1 or names[0] not in self.peft_config:
            raise ValueError(
                f"merge_and_unload merges exactly one UBMoE adapter; got adapter_names={adapter_names!r} with active "
                f"adapters {list(self.active_adapters)} and loaded adapters {list(self.peft_config)}. Pass "
                "adapter_names=[name] with one of the loaded adapters."
            )
        return names[0]

    def _unload_and_optionally_merge(
        self,
        merge: bool = True,
        progressbar: bool = False,
        safe_merge: bool = False,
        adapter_names: list[str] | None = None,
    ) -> nn.Module:
        if self._ubmoe_state.superseded:  # it would strip the layers that a newer model on this base runs
            raise superseded_error(self._ubmoe_state.superseded)
        if merge:
            raise merge_unsupported()
        return self._unwrap(lambda layer: layer.base_layer)

    @staticmethod
    def hook_owners(model: nn.Module) -> set[UBMoEModel]:
        """The UBMoE tuners whose forward hooks sit on ``model``'s modules."""
        return {
            owner
            for module in model.modules()
            for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
            if isinstance(owner := getattr(hook, "__self__", None), UBMoEModel)
        }

    def _unwrap(self, replacement: Any, adapter: str | None = None, original: bool = False) -> nn.Module:
        """Remove the hooks and put ``replacement(layer)`` in place of every UBMoE layer, and the trained module in
        place of every ``modules_to_save`` wrapper: ``adapter``'s, or the active adapter's as PEFT's unload does when
        None; the bare model. This model is spent: its modes, forward and `generate` refuse from now on (a
        SentenceTransformer made from it embedded silently with the base model)."""
        self._ubmoe_state.superseded = "unloaded"
        self._remove_hooks(every_tuner=True)
        forget_parts(self._decoder_layers, state=True)  # kept, the parts held the UBMoE layers (and copies) alive
        for name, module in list(self.model.named_modules()):
            if isinstance(module, UBMoELayer):
                module.remove_attention_hooks()
                new = replacement(module)
            elif hasattr(module, "unload_and_optionally_merge_module"):  # PEFT's modules_to_save wrapper
                new = module.original_module if original else saved_module(module, adapter)
            else:
                continue
            parent_name, _, child = name.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            setattr(parent, child, new)
        if hasattr(self.model, "peft_config"):
            del self.model.peft_config
        config, head = getattr(self.model, "config", None), self.model.get_output_embeddings()
        if getattr(config, "tie_word_embeddings", False) and head is not None:
            if head.weight is not self.model.get_input_embeddings().weight:  # a trained copy of one of them
                config.tie_word_embeddings = False  # else a reload would tie them again (and warn)
        return self.model


def _cached_length(cache: Any) -> int | None:
    """Tokens a KV cache holds before this forward (0 without one); None for a cache that cannot tell."""
    if cache is None:
        return 0
    try:
        return int(cache.get_seq_length())
    except (AttributeError, TypeError, ValueError):  # a legacy tuple cache, or a cache type of its own
        return None


def _is_4d_mask(mask: Any) -> bool:
    """A mask transformers uses as given: a 4D tensor or flex attention's BlockMask."""
    return isinstance(mask, BlockMask) or (isinstance(mask, torch.Tensor) and mask.dim() == 4)


def _user_mask_sees_later(mask: Any) -> bool:
    """Whether a caller's 4D mask (tensor or BlockMask) lets tokens see later ones, as mode bi needs.

    A query that may attend to every key is filler (a padding row left open, so that softmax has no empty row, as
    transformers' `_unmask_unattended` makes them) and says nothing about the real tokens: a causal mask with such
    rows let a padding query "see later tokens" and ran causal. A batch row is bidirectional if every query in it is
    open (no padding) or another query sees a later key. A BlockMask is read pair by pair, one batch row at a time
    (the check only runs on a mask the caller passed in mode bi)."""
    rows = [allowed_pairs(mask)] if isinstance(mask, torch.Tensor) else _block_mask_rows(mask)  # (B|1, 1|H, Q, K)
    for allowed in rows:
        queries, keys = allowed.shape[-2:]
        later = torch.ones(queries, keys, dtype=torch.bool, device=allowed.device).triu(1 + keys - queries)
        open_rows = allowed.all(dim=-1)  # (B, 1|H, Q)
        later_seen = (allowed & ~open_rows[..., None] & later).flatten(-2).any(-1)  # (B, 1|H)
        if bool((open_rows.all(-1) | later_seen).any()):
            return True
    return False


def _block_mask_rows(mask: BlockMask) -> Iterator[torch.Tensor]:
    """The pairs a BlockMask allows (head 0), one (1, 1, Q, K) bool tensor per batch row."""
    queries, keys = mask.seq_lengths
    device = mask.kv_num_blocks.device
    pairs = torch.cartesian_prod(torch.arange(queries, device=device), torch.arange(keys, device=device))  # (Q * K, 2)
    for row in range(mask.kv_num_blocks.shape[0]):
        rows = torch.full((pairs.shape[0],), row, device=device)
        yield block_mask_allows(mask, rows, pairs[:, 0], pairs[:, 1]).view(1, 1, queries, keys)


def _causal_error(model: nn.Module, implementation: str | None, attention: nn.Module) -> RuntimeError:
    import transformers

    config = text_config(model)
    index = getattr(attention, "layer_idx", None)  # transformers' attention modules know their layer
    types = getattr(config, "layer_types", None)
    kind = (
        f" ({types[index]})"
        if isinstance(index, int) and isinstance(types, (list, tuple)) and index < len(types)
        else ""
    )
    where = f"attention layer {index}{kind}" if isinstance(index, int) else "an attention layer"
    return RuntimeError(
        f"Mode 'bi' asked for bidirectional attention, but transformers {transformers.__version__} with "
        f"attn_implementation={implementation!r} gave {where} of this {getattr(config, 'model_type', None)!r} model "
        "a causal mask. Mode bi passes is_causal=False to the decoder, which transformers' masking reads for Llama, "
        "Mistral, Qwen, Gemma and most current decoders; this architecture (or this transformers release) ignores it. "
        "Use a supported architecture (docs/usage.md) or the transformers range that ubmoe-peft declares; modes uni "
        "and moe are not affected."
    )


def _own_config(model: nn.Module) -> None:
    """Give ``model`` a private copy of its config (and of each sub-config), on every submodule that holds one.

    transformers' ``from_config`` keeps the config object it is given, so models built from one object share it; the
    bi merge's ``is_causal = False`` on a shared object would turn every other model built from it bidirectional."""
    config = getattr(model, "config", None)
    if not isinstance(config, PreTrainedConfig):
        return
    private = copy.deepcopy(config)
    copies: dict[int, PreTrainedConfig] = {}
    pending = [(config, private)]
    while pending:  # the config and its sub-configs (a multimodal model's text and vision configs), old -> new
        old, new = pending.pop()
        copies[id(old)] = new
        pending.extend(
            (value, getattr(new, key)) for key, value in vars(old).items() if isinstance(value, PreTrainedConfig)
        )
    for module in model.modules():
        held = module.__dict__.get("config")
        if held is not None and id(held) in copies:
            module.config = copies[id(held)]
