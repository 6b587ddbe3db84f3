"""Reliability promises (docs/reliability.md): bad configs, bad or foreign adapter files, pickle-free loading,
atomic saves, numerical edge cases and per-model mode state. Tiny random models, built in-process."""

from __future__ import annotations

import ast
import collections
import copy
import dataclasses
import json
import os
import pathlib
import pickle
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import ubmoe_peft
from ubmoe_peft.io import (
    AdapterFileError,
    AdapterMismatchError,
    UBMoEFileError,
    atomic_folder,
    atomic_write,
    atomic_write_text,
    check_new_folder,
)
from ubmoe_peft.modes import ubmoe_layers

REPO = pathlib.Path(__file__).resolve().parents[1]
ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
VOCAB = 100


def tiny(
    arch: str = "llama",
    hidden: int = 32,
    layers: int = 2,
    attn: str = "sdpa",
    intermediate: int = 64,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    kv_heads: int = 2,
) -> torch.nn.Module:
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB,
        attn_implementation=attn,
    )
    torch.manual_seed(seed)
    return model_cls(config).to(dtype).eval()


def trained(model: torch.nn.Module, seed: int = 1, scale: float = 0.1) -> torch.nn.Module:
    """Give every UBMoE parameter random values, so bi differs from uni and routers send tokens both ways."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "ubmoe_" in name:
                noise = torch.randn(param.shape, generator=gen) * scale
                param.copy_(noise.to(param.dtype))  # the same values for the same seed, whatever came before
    return model.eval()


def wrap(model: torch.nn.Module | None = None, **kwargs) -> peft.PeftModel:
    kwargs.setdefault("lora_dropout", 0.0)
    return peft.get_peft_model(model if model is not None else tiny(), ubmoe_peft.UBMoEConfig(**kwargs)).eval()


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_state(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return now.keys() == before.keys() and all(torch.equal(now[k], before[k]) for k in before)


def logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()


@pytest.fixture
def saved(tmp_path) -> tuple[pathlib.Path, torch.Tensor]:
    """A trained LoRA adapter of tiny() saved to a folder, with its mode-moe logits on fixed ids."""
    model = trained(wrap())
    model.save_pretrained(tmp_path)
    return tmp_path, logits(model, torch.arange(10).view(1, 10))


# ---- 1. bad configuration: clear error, model untouched -----------------------------------------------------------
def _rename_ffn(model: torch.nn.Module) -> torch.nn.Module:
    model.config.model_type = "mystery"
    for layer in model.model.layers:
        layer.mixer = layer.mlp
        del layer.mlp
    return model


def _bidirectional(model: torch.nn.Module) -> torch.nn.Module:
    model.config.is_causal = False  # as a bi export saves it: modes uni and moe were bidirectional too
    return model


def _embedding_gemma(model: torch.nn.Module) -> torch.nn.Module:
    model.config.use_bidirectional_attention = True  # Gemma 2/3's flag (EmbeddingGemma): modes uni and moe too
    return model


BAD_WRAPS = {
    "a bidirectional base": (dict(), _bidirectional, ["is_causal=False", "bi export", "original causal base"]),
    "an embedding base": (dict(), _embedding_gemma, ["use_bidirectional_attention=True", "EmbeddingGemma"]),
    "target not found": (dict(target_modules=["feedforward"]), None, ["['feedforward']", "not found", "'mlp'"]),
    "no known FFN": (dict(), _rename_ffn, ["mystery", "'mixer'", "target_modules"]),
    "layers out of range": (dict(layers_to_transform=[5]), None, ["[5]", "2 decoder layers", "0..1"]),
    "rank too large": (dict(r=128), None, ["r=128", "min(in, out)", "smaller r"]),
    "single linear target": (dict(target_modules=["gate_proj"]), None, ["single linear layer", "target_modules"]),
    "unknown projection": (dict(ffn_projections=["w1"]), None, ["['w1']", "gate_proj"]),
    # accepted, then every forward failed: the attention's forward takes more than the hidden states
    "the attention as target": (dict(target_modules=["self_attn"]), None, ["self_attn'", "attention, not the FFN"]),
    "a regex on the name end": (dict(target_modules="mlp"), None, ["'mlp' not found", "whole module name"]),
    # PEFT matches modules_to_save by name ending, after the experts exist: refused before any change
    "modules_to_save is the FFN": (dict(modules_to_save=["p"]), None, ["['p']", "'model.layers.0.mlp'", "lm_head"]),
    "modules_to_save is an expert": (dict(modules_to_save=["A"]), None, ["['A']", "mlp.ubmoe_lora_A'", "lm_head"]),
    "modules_to_save is inside the FFN": (dict(modules_to_save=["up_proj"]), None, ["'model.layers.0.mlp.up_proj'"]),
    # PEFT would run a copy of the layer: its UBMoE layers got a mode state of their own, out of set_mode's reach
    "modules_to_save holds the FFN": (dict(modules_to_save=["layers.1"]), None, ["'layers.1'", "holds an FFN"]),
    # PEFT would run a copy of the attention without the attention adapter's hooks: that adapter did nothing
    "modules_to_save is an adapted attention": (
        dict(attention_r=2, modules_to_save=["self_attn"]),
        None,
        ["'self_attn'", "'model.layers.0.self_attn'", "attention_r", "lm_head"],
    ),
    "modules_to_save is in an adapted attention": (
        dict(attention_r=2, modules_to_save=["q_proj"]),
        None,
        ["'q_proj'", "'model.layers.0.self_attn.q_proj'", "attention_r"],
    ),
    # accepted and saved in the config, and nothing was trained or saved for it
    "modules_to_save matches nothing": (dict(modules_to_save=["lm_heads"]), None, ["'lm_heads'", "matches no module"]),
    "modules_to_save a task head of another task": (
        dict(task_type="CAUSAL_LM", modules_to_save=["score"]),
        None,
        ["'score'", "matches no module"],
    ),
    # "not found" blamed target_modules
    "targets kept out by layers_to_transform": (
        dict(target_modules=["layers.0.mlp"], layers_to_transform=[1]),
        None,
        ["match ['model.layers.0.mlp'] (layers [0])", "layers_to_transform=[1]) keeps none"],
    ),
}


def test_modules_to_save_beside_an_attention_adapter_that_stay_allowed():
    """Only the attention an adapter hooks, its linear layers and what holds them are refused: the first version
    also refused Qwen3's attention norms ('norm' matches 'q_norm') and the attentions of layers without an adapter."""
    from conftest import tiny_model

    for entry in (["norm"], ["q_norm"], ["lm_head", "embed_tokens"]):
        model = peft.get_peft_model(tiny_model("qwen3"), ubmoe_peft.UBMoEConfig(attention_r=2, modules_to_save=entry))
        assert model.peft_config["default"].modules_to_save == entry
    model = wrap(layers_to_transform=[1], attention_r=2, modules_to_save=["layers.0.self_attn.q_proj"])
    assert list(model.peft_config) == ["default"]
    model = peft.get_peft_model(tiny_model("qwen3"), ubmoe_peft.UBMoEConfig(modules_to_save=["q_norm"]))
    model.add_adapter("two", ubmoe_peft.UBMoEConfig(attention_r=2))  # a copy of a norm holds no linear layer


def test_modules_to_save_reaching_another_adapters_ffns_are_refused():
    """The FFN check looked only at the new adapter's targets: entries on another adapter's wrapped FFN failed
    half-way in PEFT (the model changed), and a copy of its decoder layer was accepted (its save then failed)."""
    model = wrap(layers_to_transform=[0])
    before = snapshot(model)
    for entry in (["layers.0.mlp"], ["0.mlp.base_layer.gate_proj"], ["layers.0"]):
        with pytest.raises(ValueError, match="FFN UBMoE wraps"):
            model.add_adapter("two", ubmoe_peft.UBMoEConfig(layers_to_transform=[1], modules_to_save=entry))
        assert same_state(model, before) and list(model.peft_config) == ["default"]


def test_modules_to_save_and_an_attention_adapter_of_two_adapters_are_refused_both_ways():
    """Another adapter's attention adapter got PEFT's copies of its LoRA modules (its save no longer loaded), and an
    attention adapter built after another adapter's copy of q_proj was keyed by PEFT's wrapper internals."""
    model = wrap(attention_r=2)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"'q_proj'.*attention_r"):
        model.add_adapter("two", ubmoe_peft.UBMoEConfig(modules_to_save=["q_proj"]))
    assert same_state(model, before) and list(model.peft_config) == ["default"]
    model = wrap(modules_to_save=["q_proj"])  # no attention adapter: a trained copy of q_proj is the user's choice
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"attention_r=2.*'q_proj', a trained copy.*attention_r=0"):
        model.add_adapter("two", ubmoe_peft.UBMoEConfig(attention_r=2))
    assert same_state(model, before) and list(model.peft_config) == ["default"]
    model = wrap(modules_to_save=["layers.0.self_attn"])  # a copy of the whole attention (it was named '')
    with pytest.raises(ValueError, match=r"of 'model.layers.0.mlp' is a trained copy of another adapter's"):
        model.add_adapter("two", ubmoe_peft.UBMoEConfig(attention_r=2))


@pytest.mark.parametrize("case", sorted(BAD_WRAPS))
def test_bad_config_fails_before_any_weight_changes(case):
    kwargs, edit, phrases = BAD_WRAPS[case]
    model = tiny()
    if edit is not None:
        model = edit(model)
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        wrap(model, **kwargs)
    for phrase in phrases:
        assert phrase in str(info.value), (phrase, str(info.value))
    assert same_state(model, before)
    assert not ubmoe_layers(model) and not hasattr(model, "peft_config")


BAD_FIELDS = {
    "expert_type": ("moe", ["'moe'", "'lora'", "'copy'"]),
    "top_k": (3, ["top_k=3", "1", "2"]),
    "r": (0, ["r=0", "positive"]),
    "lora_dropout": (1.5, ["1.5", "[0, 1)"]),
    "router_dtype": ("int8", ["'int8'", "float32"]),
    "router_gradient": ("straight", ["'straight'", "'compare'", "'scale'"]),
    "router_gradient:list": (["compare"], ["['compare']", "'compare'"]),
    "layers_to_transform": (-1, ["-1", "non-negative"]),
    "lora_alpha": ("big", ["'big'", "number"]),
    "use_rslora": ("yes", ["'yes'", "True or False"]),
    "target_modules": (5, ["5", "module names"]),
    "target_modules:empty": ("", ["''", "matches no module", "['mlp']"]),
    "target_modules:bad regex": ("(", ["'('", "not a valid regular expression", "['mlp']"]),
    "lora_alpha:overflow": (1e308, ["1e+308", "finite float32", "16"]),
    "lora_alpha:inf": (float("inf"), ["inf", "finite float32"]),
    "lora_alpha:zero": (0, ["lora_alpha=0", "never trains", "16"]),  # PEFT allows it: the expert would never move
    "lora_alpha:negative": (-16.0, ["-16.0", "positive"]),
    "top_k:float": (1.0, ["top_k=1.0", "1", "2"]),  # 1.0 == 1 passed, was saved, and broke the MoE export's int
    "lora_dropout:text": ("abc", ["'abc'", "number in [0, 1)"]),  # float() raised first, naming no field
    # an empty list named nothing, and the errors that followed contradicted themselves
    "layers_to_transform:empty": ([], ["selects no layer", "None for every layer"]),
    "layers_to_transform:empty tuple": ((), ["selects no layer", "None for every layer"]),
    "ffn_projections:empty": ([], ["selects no projection", "None for every projection"]),
    "target_modules:empty list": ([], ["selects no module", "None for the FFN found"]),
    # ignored: the copy expert trained the whole FFN
    "ffn_projections:copy": (["down_proj"], ["['down_proj']", "expert_type='copy'", "Leave ffn_projections None"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_bad_field_names_value_and_fix(case):
    field = case.split(":")[0]
    value, phrases = BAD_FIELDS[case]
    with pytest.raises(ValueError) as info:
        ubmoe_peft.UBMoEConfig(**{field: value}, **({"expert_type": "copy"} if case.endswith(":copy") else {}))
    assert f"{field}=" in str(info.value)
    for phrase in phrases:
        assert phrase in str(info.value), (phrase, str(info.value))


def test_numpy_numbers_are_taken_as_python_ones(tmp_path):
    """``top_k=np.int64(1)`` was refused as "must be 1 or 2" (and JSON cannot save NumPy numbers)."""
    import numpy as np

    config = ubmoe_peft.UBMoEConfig(
        top_k=np.int64(1), r=np.int32(4), layers_to_transform=[np.int64(0)], lora_alpha=np.float32(8)
    )
    assert (config.top_k, config.r, config.layers_to_transform, config.lora_alpha) == (1, 4, [0], 8.0)
    assert {type(config.top_k), type(config.r), type(config.layers_to_transform[0])} == {int}
    model = wrap(tiny(), **{k: getattr(config, k) for k in ("top_k", "r", "layers_to_transform", "lora_alpha")})
    model.save_pretrained(tmp_path)
    assert ubmoe_peft.UBMoEConfig.from_pretrained(tmp_path).layers_to_transform == [0]
    assert ubmoe_peft.UBMoEConfig(layers_to_transform=np.int64(1)).layers_to_transform == [1]


@pytest.mark.parametrize("signature", [True, False])
def test_an_adapter_saved_with_an_entry_that_matches_nothing_still_loads(tmp_path, signature):
    """Earlier versions saved such entries (with no tensors for them): refused at load, the adapter was lost. The
    first version saved no base_model_signature, by which the checks told a saved config from a new one."""
    model = trained(wrap(modules_to_save=["lm_head"]))
    model.peft_config["default"].modules_to_save = ["lm_head", "lm_heads"]  # as an earlier version saved it
    if not signature:
        model.peft_config["default"].base_model_signature = None
    model.save_pretrained(tmp_path)
    ids = torch.arange(8).view(1, 8)
    with pytest.warns(UserWarning, match=r"entry 'lm_heads' matches no module .* adapter_config\.json"):
        loaded = peft.PeftModel.from_pretrained(tiny(), tmp_path).eval()
    torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=0, atol=0)


@pytest.mark.parametrize("signature", [True, False])
def test_a_copy_expert_saved_with_ffn_projections_still_loads(tmp_path, signature):
    """A new copy expert given ffn_projections is refused (they were ignored); one saved so, also by the first
    version (no base_model_signature), is what it is and loads."""
    model = trained(wrap(expert_type="copy"))
    model.peft_config["default"].ffn_projections = ["up_proj"]  # as an earlier version saved it
    if not signature:
        model.peft_config["default"].base_model_signature = None
    model.save_pretrained(tmp_path)
    ids = torch.arange(8).view(1, 8)
    loaded = peft.PeftModel.from_pretrained(tiny(), tmp_path).eval()
    torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=0, atol=0)
    # PEFT's generic loader (PeftConfig, AutoPeftModel) builds the config from the file's dict: it was refused there
    assert peft.PeftConfig.from_pretrained(tmp_path).ffn_projections == ["up_proj"]
    with pytest.raises(ValueError, match=r"ffn_projections=\['up_proj'\]\) chooses the projections of a LoRA"):
        ubmoe_peft.UBMoEConfig(expert_type="copy", ffn_projections=["up_proj"])  # a new one still is refused
    with pytest.raises(ValueError, match=r"ffn_projections=\['up_proj'\]\) chooses the projections of a LoRA"):
        dataclasses.replace(ubmoe_peft.UBMoEConfig(ffn_projections=["up_proj"]), expert_type="copy")  # also made so


def test_a_module_named_like_the_ffn_inside_the_ffn_is_not_a_target():
    """CPM-Ant's FFN holds a module of its own name (``ffn.ffn``): both matched, and wrapping failed half-way with a
    bare AttributeError, leaving the base partly wrapped."""
    model, reference = tiny(), tiny()
    for layers in (model.model.layers, reference.model.layers):
        for layer in layers:
            layer.mlp.mlp = torch.nn.Identity()  # never called: a name, as CPM-Ant's inner ffn is to its outer one
    wrapped = wrap(model)
    names = [n for n, m in wrapped.named_modules() if isinstance(m, ubmoe_peft.UBMoELayer)]
    assert names == [f"base_model.model.model.layers.{i}.mlp" for i in (0, 1)]
    ids = torch.arange(3, 11).view(1, 8)
    with ubmoe_peft.use_mode(wrapped, "uni"):
        torch.testing.assert_close(logits(wrapped, ids), logits(reference, ids), rtol=0, atol=0)


def test_a_module_named_like_the_ffn_deeper_in_the_layer_is_not_a_target():
    """AXK2 keeps a gate MLP named ``mlp`` inside each layer's ``input_layernorm``: the name ending matched it too,
    and it was wrapped as a second FFN of the layer (and its dense copy made layers of MoE blocks look wrappable)."""

    def gated():
        model = tiny()
        for layer in model.model.layers:  # never called: only its name matters
            layer.input_layernorm.mlp = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.Linear(8, 32))
        return model

    def wrapped_names(model):
        return [
            n.removeprefix("base_model.model.model.")
            for n, m in model.named_modules()
            if isinstance(m, ubmoe_peft.UBMoELayer)
        ]

    assert wrapped_names(wrap(gated())) == ["layers.0.mlp", "layers.1.mlp"]
    both = wrap(gated(), target_modules=r".*layers\.\d+\.(input_layernorm\.)?mlp")  # a regex is taken as it reads
    assert len(wrapped_names(both)) == 4


@pytest.mark.parametrize(
    ("auto", "task", "head"),
    [
        ("AutoModelForSequenceClassification", "SEQ_CLS", "score"),
        ("AutoModelForTokenClassification", "TOKEN_CLS", "score"),
        ("AutoModelForQuestionAnswering", "QUESTION_ANS", "qa_outputs"),
    ],
)
def test_task_models_train_save_and_load_their_head(auto, task, head, tmp_path):
    """PEFT's token-classification and question-answering models add their head to the config once the tuner is
    built, to the object they hold, and read it back: the tuner's private copy lacked it (a bare TypeError on None)."""
    import transformers

    def base():
        torch.manual_seed(0)
        config = tiny().config
        config.num_labels = 3
        return getattr(transformers, auto).from_config(config).eval()

    model = trained(wrap(base(), task_type=task))
    copy_ = next(m for n, m in model.named_modules() if n.endswith(f"{head}.modules_to_save.default"))
    assert all(p.requires_grad for p in copy_.parameters())
    with torch.no_grad():
        for p in copy_.parameters():
            p.add_(0.5)  # the trained head, which the load must bring back
    model.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(base(), tmp_path).eval()
    ids = torch.arange(3, 11).view(1, 8)
    for mode in ("uni", "bi", "moe"):
        with ubmoe_peft.use_mode(model, mode), ubmoe_peft.use_mode(loaded, mode), torch.no_grad():
            expected, got = model(input_ids=ids, use_cache=False), loaded(input_ids=ids, use_cache=False)
            assert expected.keys() == got.keys()
            for key, value in expected.items():
                torch.testing.assert_close(got[key], value, rtol=0, atol=0)


def test_the_tuners_set_adapter_refuses_a_name_that_is_no_adapter():
    """Every layer switched to the misspelt adapter it lacks: the model ran the base model while active_adapter and
    get_mode still named the trained one, and set_stage then trained routers that never ran."""
    model = trained(wrap())
    ids = torch.arange(3, 11).view(1, 8)
    before, expected = snapshot(model), logits(model, ids)
    for name in ("defualt", ["defualt"], None, 3):
        with pytest.raises(ValueError, match=r"set_adapter\(.*(is not an adapter of this model|pass the name).*"):
            model.base_model.set_adapter(name)
    assert same_state(model, before) and model.active_adapters == ["default"]
    torch.testing.assert_close(logits(model, ids), expected, rtol=0, atol=0)


def test_the_tuner_class_refuses_another_methods_config():
    base = tiny()
    before = snapshot(base)
    with pytest.raises(ValueError, match=r"UBMoEModel got a LoraConfig for adapter 'default'; it takes a UBMoEConfig"):
        ubmoe_peft.UBMoEModel(base, peft.LoraConfig(), "default")  # a bare AttributeError
    assert same_state(base, before)


def test_modes_bi_and_moe_refuse_a_model_without_an_active_adapter(tokenizer, tmp_path):
    """Once the active adapter was deleted, the SentenceTransformer went on embedding with the base FFNs under
    bidirectional attention (an untrained model), and set_stage called the deleted adapter "not a UBMoE adapter of
    this model"; an adapter loaded after that is not made active (as in PEFT), and the model ran the base FFNs."""
    from conftest import tiny_model

    model = trained(wrap(tiny_model("llama")))  # the tokenizer's vocabulary
    model.save_pretrained(tmp_path)
    ids = torch.arange(3, 11).view(1, 8)
    expected = {mode: logits_in(model, mode, ids) for mode in ("bi", "moe")}
    st = ubmoe_peft.to_sentence_transformer(model, tokenizer)
    model.delete_adapter("default")
    with pytest.raises(ValueError, match=r"Mode 'bi' needs an active UBMoE adapter, and this model has none"):
        st.encode(["a b c"])
    inner = model.base_model.model
    for mode in ("bi", "moe"):
        with pytest.raises(ValueError, match=rf"Mode '{mode}' needs an active UBMoE adapter.*add_adapter"):
            logits_in(inner, mode, ids)
    for stage in ("contrastive", "router"):
        with pytest.raises(ValueError, match=r"has none \(delete_adapter removed the active one\)"):
            ubmoe_peft.set_stage(model, stage)
    torch.testing.assert_close(logits_in(inner, "uni", ids), logits(tiny_model("llama"), ids))  # the base model
    model.load_adapter(tmp_path, adapter_name="default")  # loaded, not active
    with pytest.raises(ValueError, match=r"activate one of its adapters \['default'\] with model.set_adapter"):
        logits_in(inner, "moe", ids)
    with pytest.raises(ValueError, match=r"needs an active UBMoE adapter"):
        ubmoe_peft.set_stage(model, "router")
    model.set_adapter("default")
    for mode, value in expected.items():
        torch.testing.assert_close(logits_in(model.eval(), mode, ids), value, rtol=0, atol=0)


def test_loading_from_a_file_or_a_missing_local_path_names_the_fix(tmp_path):
    """PEFT said "Can't find 'adapter_config.json' at ..." for the weights file itself, and asked the Hub for a
    local path that does not exist."""
    wrap(tiny()).save_pretrained(tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    for load in (lambda p, **kw: peft.PeftModel.from_pretrained(tiny(), p, **kw), wrap(tiny()).load_adapter):
        with pytest.raises(ValueError, match=rf"{weights} is a file.*Pass {tmp_path}\."):
            load(str(weights), adapter_name="other")
        with pytest.raises(ValueError, match=rf"{tmp_path / 'missing'} does not exist \(a local path"):
            load(str(tmp_path / "missing"), adapter_name="other")
        with pytest.raises(ValueError, match=rf"{tmp_path / 'nope'} does not exist"):
            load(str(tmp_path), adapter_name="other", subfolder="nope")


def test_mode_bi_refuses_an_attention_without_bidirectional_support():
    """An attention function registered under a name of its own gets no mask from transformers (its mask interface
    has no entry for that name), so whether it attends bidirectionally is the function's affair: refused, naming
    the implementations that are checked."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("ubmoe_test_attention", sdpa_attention_forward)
    model = wrap(tiny(attn="ubmoe_test_attention"))
    logits(model, torch.arange(4).view(1, 4))  # mode moe runs it
    ubmoe_peft.set_mode(model, "bi")
    with pytest.raises(ValueError, match=r"attn_implementation='ubmoe_test_attention'.*'sdpa'.*'flex_attention'"):
        logits(model, torch.arange(4).view(1, 4))


def _block_mask(mask_mod, padding: list[int], length: int = 8):
    """A BlockMask of ``mask_mod`` with ``padding[b]`` pad tokens on the left of row b, in blocks of 2 tokens, as
    transformers' flex_attention_mask builds one (the padding mask on the keys)."""
    from torch.nn.attention.flex_attention import create_block_mask

    real = torch.arange(length)[None, :] >= torch.tensor(padding)[:, None]  # (B, T)

    def padded(b, h, q, k):
        return mask_mod(b, h, q, k) & real[b, k]

    return create_block_mask(padded, B=len(padding), H=None, Q_LEN=length, KV_LEN=length, device="cpu", BLOCK_SIZE=2)


MASK_MODS = {
    "causal": lambda b, h, q, k: k <= q,
    "sliding causal": lambda b, h, q, k: (k <= q) & (k > q - 3),
    "bidirectional": lambda b, h, q, k: q >= 0,
    "sliding bidirectional": lambda b, h, q, k: (k - q).abs() <= 3,
}


@pytest.mark.parametrize(
    ("kind", "padding", "bidirectional"),
    [
        ("causal", [0], False),
        ("causal", [3, 0], False),  # caught in the unpadded row
        ("sliding causal", [1, 0], False),
        ("bidirectional", [0], True),
        ("bidirectional", [3, 0, 7, 8], True),  # rows of one real token and of none have nothing to check
        ("sliding bidirectional", [0, 1], True),
    ],
)
def test_the_mode_bi_check_reads_a_block_mask_as_flex_attention_does(kind, padding, bidirectional):
    """Flex attention's BlockMask is read only at the pairs the check needs (each token with itself for the real
    tokens, then each row's first real token with its second), never expanded to (B, Q, K)."""
    from ubmoe_peft.tuners.ubmoe.state import first_real_sees_second

    assert first_real_sees_second(_block_mask(MASK_MODS[kind], padding)) is bidirectional


def test_the_mode_bi_check_needs_both_the_mask_mod_and_the_block_lists_of_a_block_mask():
    """A pair counts as attended only where the mask_mod allows it and the block lists hold its block: flex
    attention's compiled kernel visits listed blocks only (and skips the mask_mod in full ones), its reference path
    applies the mask_mod everywhere. With one pad token the first two real tokens fall into two blocks."""
    from torch.nn.attention.flex_attention import BlockMask

    from ubmoe_peft.tuners.ubmoe.state import first_real_sees_second

    causal, both = (_block_mask(MASK_MODS[kind], [1]) for kind in ("causal", "bidirectional"))
    assert first_real_sees_second(both) and not first_real_sees_second(causal)
    for blocks, mask_mod in ((causal, both.mask_mod), (both, causal.mask_mod)):
        lists = (blocks.kv_num_blocks, blocks.kv_indices, blocks.full_kv_num_blocks, blocks.full_kv_indices)
        mixed = BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=2, mask_mod=mask_mod, seq_lengths=(8, 8))
        assert not first_real_sees_second(mixed)


def test_failed_wrap_leaves_the_model_wrappable():
    model = tiny()
    with pytest.raises(ValueError):
        wrap(model, layers_to_transform=[9])
    assert torch.allclose(logits(wrap(model), torch.arange(6).view(1, 6)), logits(tiny(), torch.arange(6).view(1, 6)))


# ---- 2. loading: foreign bases, bad files, no pickle, no remote code ----------------------------------------------
FOREIGN = {
    "hidden size": (dict(hidden=64), ["hidden_size=32", "hidden_size=64"]),
    "layer count": (dict(layers=3), ["num_layers=2", "num_layers=3"]),
    "architecture": (dict(arch="qwen2"), ["model_type='llama'", "model_type='qwen2'"]),
    "FFN size": (dict(intermediate=48), ["intermediate_size=64", "intermediate_size=48"]),  # Llama-2-7B vs 3-8B
    # an FFN adapter fits such a base shape for shape: it loaded silently
    "key-value heads": (dict(kv_heads=1), ["num_key_value_heads=2", "num_key_value_heads=1"]),
}


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_adapter_for_another_base_fails_naming_both(saved, case):
    folder, _ = saved
    kwargs, phrases = FOREIGN[case]
    base = tiny(**kwargs)
    before = snapshot(base)
    with pytest.raises(AdapterMismatchError) as info:
        peft.PeftModel.from_pretrained(base, folder)
    for phrase in phrases:
        assert phrase in str(info.value)
    assert "made for" in str(info.value) and "loaded into" in str(info.value)
    assert same_state(base, before)  # the check runs before the adapter is injected


def test_a_signature_saved_before_an_entry_existed_is_checked_on_the_others(saved):
    """Adapters saved before `intermediate_size` joined the signature still load, and are still checked."""
    folder, expected = saved
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    del config["base_model_signature"]["intermediate_size"]
    path.write_text(json.dumps(config))
    loaded = peft.PeftModel.from_pretrained(tiny(), folder)
    assert torch.allclose(logits(loaded, torch.arange(10).view(1, 10)), expected)
    with pytest.raises(AdapterMismatchError, match="hidden_size=32.*hidden_size=64"):
        peft.PeftModel.from_pretrained(tiny(hidden=64), folder)


@pytest.mark.parametrize("case", ["wrong shape", "extra tensor", "non-finite"])
def test_modules_to_save_tensors_are_checked_like_the_adapters(tmp_path, case):
    """The trained copies PEFT keeps for modules_to_save (here the head) pass the same checks as the experts."""
    model = trained(wrap(modules_to_save=["lm_head"]))
    model.save_pretrained(tmp_path)
    key = "base_model.model.lm_head.weight"  # PEFT saves the copy under the module's own name
    base, message = tiny(), {"extra tensor": "no place in the model", "non-finite": "NaN or inf"}.get(case)
    if case == "wrong shape":  # a base with a resized vocabulary
        base.resize_token_embeddings(VOCAB + 2)
        message = rf"modules_to_save=.*\({VOCAB}, 32\) in the file, \({VOCAB + 2}, 32\) in the model.*resize_token"
    elif case == "extra tensor":
        _edit_weights(tmp_path, lambda t: t.update({"base_model.model.model.norm.weight": torch.ones(32)}))
    else:
        _edit_weights(tmp_path, lambda t: t[key].view(-1)[0].fill_(float("inf")))
    with pytest.raises(AdapterMismatchError, match=message):
        peft.PeftModel.from_pretrained(base, tmp_path)


def _edit_weights(folder: pathlib.Path, edit) -> None:
    tensors = load_file(folder / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})


def _drop_last_layer(tensors: dict) -> None:
    for key in [k for k in tensors if ".layers.1." in k]:
        del tensors[key]


def _add_a_layer(tensors: dict) -> None:
    tensors.update(
        {k.replace(".layers.1.", ".layers.2."): v.clone() for k, v in list(tensors.items()) if ".layers.1." in k}
    )


def _reshape_router(tensors: dict) -> None:
    key = next(k for k in tensors if "ubmoe_router" in k)
    tensors[key] = torch.zeros(2, 48)


def _poison(tensors: dict) -> None:
    key = next(k for k in tensors if "ubmoe_lora_B" in k)
    tensors[key][0, 0] = float("nan")


TAMPERED = {
    "missing tensors": (_drop_last_layer, ["not in the file", "layers.1."]),
    "extra tensors": (_add_a_layer, ["no place in the model", "layers.2."]),
    "wrong shape": (_reshape_router, ["(2, 48) in the file", "(2, 32) in the model"]),
    "non-finite": (_poison, ["NaN or inf", "ubmoe_lora_B"]),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_checkpoint_that_does_not_fill_the_adapter_is_refused(saved, case):
    folder, _ = saved
    edit, phrases = TAMPERED[case]
    _edit_weights(folder, edit)
    with pytest.raises(AdapterMismatchError) as info:
        peft.PeftModel.from_pretrained(tiny(), folder)
    for phrase in phrases:
        assert phrase in str(info.value), (phrase, str(info.value))


@pytest.mark.parametrize("case", ["wrong shape", "non-finite"])
def test_a_refused_load_adapter_leaves_no_adapter_behind(tmp_path, case):
    """The weights are checked as PEFT loads them, after the new adapter's layers exist: the never-loaded adapter
    stayed in the model (set_adapter ran it, save_pretrained saved it, a good load under its name was refused)."""
    model = trained(wrap(modules_to_save=["lm_head"]))
    model.save_pretrained(tmp_path / "good")
    model.save_pretrained(tmp_path / "bad")
    _edit_weights(tmp_path / "bad", TAMPERED[case][0] if case != "wrong shape" else _reshape_router)
    loaded = peft.PeftModel.from_pretrained(tiny(), tmp_path / "good", is_trainable=True).eval()
    before, flags = snapshot(loaded), {n: p.requires_grad for n, p in loaded.named_parameters()}
    with pytest.raises(AdapterMismatchError):
        loaded.load_adapter(tmp_path / "bad", adapter_name="x")
    assert list(loaded.peft_config) == ["default"] and loaded.active_adapter == "default"
    assert same_state(loaded, before)
    assert {n: p.requires_grad for n, p in loaded.named_parameters()} == flags
    loaded.load_adapter(tmp_path / "good", adapter_name="x")  # the name is free again
    assert sorted(loaded.peft_config) == ["default", "x"]


@pytest.mark.parametrize("earlier", [{}, dict(layers_to_transform=[0], attention_r=4, modules_to_save=["lm_head"])])
@pytest.mark.parametrize("damage", ["router of another shape", "NaN weights", "truncated file"])
def test_a_refused_load_onto_a_wrapped_base_gives_the_earlier_model_back(saved, tmp_path, earlier, damage):
    """The README's save_pretrained(d); PeftModel.from_pretrained(base, d), with a damaged file: the load changes the
    earlier model in place before the weights are checked (its adapter of that name dropped for a fresh one, its
    layers following the new model), so the refusal left the trained model untrained and refusing every call. The
    refused model's hooks also stayed on the base, tagging later KV caches."""
    folder, _ = saved
    if damage == "truncated file":
        _truncate(folder / "adapter_model.safetensors")
    else:
        _edit_weights(folder, _reshape_router if damage == "router of another shape" else _poison)
    base = tiny()
    base.model.layers[0].seen = collections.defaultdict(list, {"a": [1]})  # a user's bookkeeping (copied as it is)
    first = trained(wrap(base, **earlier))
    ids = torch.arange(10).view(1, 10)
    expected = {mode: logits_in(first, mode, ids) for mode in ("uni", "bi", "moe")}
    state, config = snapshot(first), first.peft_config["default"].to_dict()
    trainable = {n for n, p in first.named_parameters() if p.requires_grad}
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in base.modules())
    with pytest.raises((AdapterMismatchError, AdapterFileError)):
        peft.PeftModel.from_pretrained(base, folder)
    assert same_state(first, state) and first.peft_config["default"].to_dict() == config
    assert {n for n, p in first.named_parameters() if p.requires_grad} == trainable
    assert hooks == sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in base.modules())
    assert base.model.layers[0].seen == {"a": [1]} and base.model.layers[0].seen["b"] == []
    for mode, values in expected.items():
        torch.testing.assert_close(logits_in(first, mode, ids), values, rtol=0, atol=0)
    first.save_pretrained(tmp_path / "again")
    torch.testing.assert_close(logits(peft.PeftModel.from_pretrained(tiny(), tmp_path / "again"), ids), expected["moe"])
    plain = first.base_model.unload()
    assert not [h for m in plain.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    again = wrap(plain)
    ubmoe_peft.set_mode(again, "uni")
    greedy = dict(input_ids=ids[:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(again.generate(**greedy), tiny().generate(**greedy))


def logits_in(model: torch.nn.Module, mode: str, ids: torch.Tensor) -> torch.Tensor:
    with ubmoe_peft.use_mode(model, mode):
        return logits(model, ids)


def _truncate(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _garble(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32  # inside the safetensors JSON header / the config's first keys
    path.write_bytes(bytes(data))


BAD_FILES = {
    "weights missing": ("adapter_model.safetensors", lambda p: p.unlink()),
    "weights truncated": ("adapter_model.safetensors", _truncate),
    "weights garbled": ("adapter_model.safetensors", _garble),
    "weights empty": ("adapter_model.safetensors", lambda p: p.write_bytes(b"")),
    "config missing": ("adapter_config.json", lambda p: p.unlink()),
    "config truncated": ("adapter_config.json", _truncate),
    "config garbled": ("adapter_config.json", _garble),
    "config not an object": ("adapter_config.json", lambda p: p.write_text("[1, 2]")),
    "config without peft_type": ("adapter_config.json", lambda p: p.write_text('{"r": 8}')),
    "config with a bad value": (
        "adapter_config.json",
        lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "top_k": "two"})),
    ),
    "config names modules_to_save the weights lack": (  # PEFT looked them up by key: a bare KeyError
        "adapter_config.json",
        lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "modules_to_save": ["lm_head"]})),
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_missing_or_corrupted_file_fails_naming_it(saved, case):
    folder, _ = saved
    name, damage = BAD_FILES[case]
    damage(folder / name)
    with pytest.raises(AdapterFileError) as info:
        peft.PeftModel.from_pretrained(tiny(), folder)
    assert name in str(info.value) and str(folder) in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("saved_with", "loaded_into", "named"),
    [(dict(top_k=2), dict(), "top_k=2 in the file, 1 in the model"), (dict(lora_alpha=64), dict(), "lora_alpha=64")],
)
def test_loading_into_an_adapter_of_other_settings_is_refused(tmp_path, saved_with, loaded_into, named):
    """PEFT loads into an existing adapter of that name as it is: the weights ran under its scaling or routing
    (mode moe off by 0.8 for top_k, 0.4 for lora_alpha), silently; from_pretrained with a config= of other
    settings did the same."""
    trained(wrap(**saved_with)).save_pretrained(tmp_path)
    ids = torch.arange(10).view(1, 10)
    model = trained(wrap(**loaded_into), seed=2)
    before = snapshot(model)
    with pytest.raises(AdapterMismatchError, match=rf"other settings .*'default' .*{named}.*Nothing was loaded"):
        model.load_adapter(tmp_path, adapter_name="default")
    assert same_state(model, before)
    with pytest.raises(AdapterMismatchError, match=named):
        peft.PeftModel.from_pretrained(tiny(), tmp_path, config=ubmoe_peft.UBMoEConfig(**loaded_into))
    expected = logits(peft.PeftModel.from_pretrained(tiny(), tmp_path).eval(), ids)
    model.load_adapter(tmp_path, adapter_name="other")  # the named fixes: another name, or delete it first
    model.set_adapter("other")
    torch.testing.assert_close(logits(model.eval(), ids), expected, rtol=0, atol=0)
    model.set_adapter("other")
    model.delete_adapter("default")
    model.add_adapter("default", ubmoe_peft.UBMoEConfig(**saved_with))
    model.load_adapter(tmp_path, adapter_name="default")  # the same settings: loads into it
    model.set_adapter("default")
    torch.testing.assert_close(logits(model.eval(), ids), expected, rtol=0, atol=0)


def test_an_adapter_config_without_newer_settings_loads_as_before(saved, monkeypatch):
    """A release's adapter_config.json lacks the settings added later (attention_r) and older files lack the weights'
    settings metadata: from_pretrained without config= compared the bare file with the defaults filled in and refused
    it. An equal config= loads too. And a model whose get_input_embeddings raises (transformers' fallback for a custom
    name) still loads."""
    folder, expected = saved
    save_file(load_file(folder / "adapter_model.safetensors"), folder / "adapter_model.safetensors")  # no metadata
    config = json.loads((folder / "adapter_config.json").read_text())
    for key in ("attention_r", "router_dtype", "top_k", "use_rslora"):
        config.pop(key)
    config["layers_to_transform"] = None
    (folder / "adapter_config.json").write_text(json.dumps(config))
    ids = torch.arange(10).view(1, 10)
    loaded = peft.PeftModel.from_pretrained(tiny(), folder).eval()
    torch.testing.assert_close(logits(loaded, ids), expected, rtol=0, atol=0)
    equal = ubmoe_peft.UBMoEConfig(**{k: v for k, v in config.items() if k in ("r", "lora_alpha", "lora_dropout")})
    peft.PeftModel.from_pretrained(tiny(), folder, config=equal)

    def no_embeddings(self):
        raise NotImplementedError("`get_input_embeddings` not auto-handled for LlamaForCausalLM")

    monkeypatch.setattr(LlamaForCausalLM, "get_input_embeddings", no_embeddings)
    torch.testing.assert_close(
        logits(peft.PeftModel.from_pretrained(tiny(), folder).eval(), ids), expected, rtol=0, atol=0
    )


def test_a_folder_of_named_adapters_points_to_them(tmp_path):
    """save_pretrained puts an adapter not named 'default' in a subfolder; loading the folder itself names them."""
    model = peft.get_peft_model(tiny(), ubmoe_peft.UBMoEConfig(), adapter_name="mine")
    model.save_pretrained(tmp_path)
    with pytest.raises(AdapterFileError, match=r"It holds the adapters \['mine'\].*point to e.g. .*mine"):
        peft.PeftModel.from_pretrained(tiny(), tmp_path)
    peft.PeftModel.from_pretrained(tiny(), tmp_path / "mine")


def test_modules_to_save_round_trip(tmp_path):
    """A trained lm_head (modules_to_save) saves and loads with the adapter, through the same checked reader."""
    model = wrap(tiny(), modules_to_save=["lm_head"])
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    ids = torch.arange(6).view(1, 6)
    expected = logits(model.eval(), ids)
    model.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(tiny(), tmp_path).eval()
    torch.testing.assert_close(logits(loaded, ids), expected, rtol=0, atol=0)
    assert not torch.equal(expected, logits(wrap(tiny()).eval(), ids))


@pytest.mark.parametrize("case", ["resized", "resized, embeddings trained", "save_embedding_layers=True"])
def test_an_adapter_saved_with_the_embeddings_loads_back(tmp_path, case):
    """PEFT adds the base's embeddings to the save when the vocabulary was resized (or when asked), as for LoRA; the
    loader refused its own save, blaming the file."""
    tiny().save_pretrained(tmp_path / "base")  # PEFT compares the vocabulary with the saved base's config

    def base(seed):
        model = LlamaForCausalLM.from_pretrained(tmp_path / "base")
        if case != "save_embedding_layers=True":
            torch.manual_seed(seed)  # the new rows are drawn at random
            model.resize_token_embeddings(VOCAB + 8)
        return model.eval()

    extra = dict(modules_to_save=["embed_tokens", "lm_head"]) if "trained" in case else {}
    model = trained(wrap(base(seed=1), **extra))
    ids = torch.tensor([[3, 5, VOCAB - 1, 7]])
    if case != "save_embedding_layers=True":
        ids[0, 2] = VOCAB + 3  # a new token
    expected = logits(model, ids)
    model.save_pretrained(tmp_path / "adapter", **({"save_embedding_layers": True} if "=True" in case else {}))
    weights = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(k.endswith("embed_tokens.weight") for k in weights)
    loaded = peft.PeftModel.from_pretrained(base(seed=2), tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(loaded, ids), expected, rtol=0, atol=0)
    # Under another name, beside an adapter of the saved name: the save also holds the LM head's trained copy under
    # its saved name ("default"), which had no place (refused) or overwrote that adapter's copy
    other = wrap(base(seed=2), **extra)
    theirs = snapshot(other)
    other.load_adapter(tmp_path / "adapter", adapter_name="other")
    other.set_adapter("other")
    torch.testing.assert_close(logits(other.eval(), ids), expected, rtol=0, atol=0)
    now = other.state_dict()
    assert all(torch.equal(now[k], v) for k, v in theirs.items() if ".default." in k)
    if case == "resized":
        plain = LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()  # the vocabulary it was not saved with
        with pytest.raises(AdapterMismatchError, match=r"embeddings saved with it do not fit.*resize_token_embeddings"):
            peft.PeftModel.from_pretrained(plain, tmp_path / "adapter")


def test_a_second_adapters_copy_of_the_attention_shares_the_live_tuners_hooks(tmp_path):
    """PEFT deep-copies a modules_to_save module with its hooks: the attention's mode-bi check, a bound method, took
    a copy of the whole model along, whose frozen mode (bi, when loaded in mode bi) then refused every causal forward
    of that adapter."""
    trained(wrap(modules_to_save=["self_attn"])).save_pretrained(tmp_path / "b")
    ids = torch.arange(3, 12).view(1, 9)
    alone = peft.PeftModel.from_pretrained(tiny(), tmp_path / "b").eval()
    expected = {}
    for mode in ("moe", "bi"):
        ubmoe_peft.set_mode(alone, mode)
        expected[mode] = logits(alone, ids)
    wrap().save_pretrained(tmp_path / "a")
    model = peft.PeftModel.from_pretrained(tiny(), tmp_path / "a", adapter_name="first").eval()
    ubmoe_peft.set_mode(model, "bi")  # an embedding server loading a second adapter
    model.load_adapter(tmp_path / "b", adapter_name="second")
    model.set_adapter("second")
    model.eval()
    trained_copy = model.base_model.model.model.layers[0].self_attn.modules_to_save["second"]
    assert {h.__self__ for h in trained_copy._forward_pre_hooks.values()} == {model.base_model}  # the live tuner
    for mode in ("moe", "bi"):
        ubmoe_peft.set_mode(model, mode)
        torch.testing.assert_close(logits(model, ids), expected[mode], rtol=0, atol=0)
    twin = copy.deepcopy(model)  # a copy of the whole model still gets hooks of its own
    assert {h.__self__ for m in twin.modules() for h in m._forward_pre_hooks.values()} == {twin.base_model}
    inner = copy.deepcopy(model.get_base_model())  # and so does a copy of the wrapped base alone
    assert {h.__self__.model for m in inner.modules() for h in m._forward_pre_hooks.values()} == {inner}
    backbone = model.get_base_model().model  # and a copy of the decoder alone (its layers and mode state with it)
    ubmoe_peft.set_mode(model, "moe")
    with torch.no_grad():
        expected = backbone(input_ids=ids).last_hidden_state
        twin_backbone = copy.deepcopy(backbone)
        ubmoe_peft.set_mode(model, "bi")  # the original's mode, not the copy's
        torch.testing.assert_close(twin_backbone(input_ids=ids).last_hidden_state, expected, rtol=0, atol=0)
    plain = model.base_model.unload()
    hooks = [h for m in plain.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    assert not hooks  # none left on the copies either


def test_modules_to_save_train_in_the_stages_that_use_them_and_serve_every_mode():
    """set_stage froze them (no stage trained what the config asked to train); then it made the LM head trainable in
    stage contrastive too, whose embeddings never reach it (unused: DDP's unused-parameter check failed). They are
    used in every mode, mode uni included, and disable_adapter() gives the base model."""
    model = wrap(tiny(), modules_to_save=["lm_head", "embed_tokens"])
    head = model.base_model.model.lm_head.modules_to_save["default"]
    for stage, trains in (
        ("contrastive", ".ubmoe_lora_|embed_tokens.modules_to_save.default."),
        ("router", ".ubmoe_router.|.modules_to_save.default."),
    ):
        ubmoe_peft.set_stage(model, stage)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == {n for n, _ in model.named_parameters() if re.search(trains, n)}
        assert all(p.requires_grad == (stage == "router") for p in head.parameters())
    with torch.no_grad():
        head.weight.mul_(1.5)
    ids = torch.arange(6).view(1, 6)
    base = logits(tiny().eval(), ids)
    with ubmoe_peft.use_mode(model.eval(), "uni"):
        assert not torch.equal(logits(model, ids), base)
        with model.disable_adapter():
            torch.testing.assert_close(logits(model, ids), base, rtol=0, atol=0)


def test_a_pickle_save_is_refused_before_anything_is_written(saved):
    """PEFT's safe_serialization=False writes adapter_model.bin with a plain torch.save, in place; beside an older
    adapter_model.safetensors, the loader would then have read the older weights."""
    folder, _ = saved
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    model = trained(wrap(), seed=2)
    with pytest.raises(ValueError, match=r"safe_serialization=False.*\['default'\].*adapter_model\.bin.*Nothing was"):
        model.save_pretrained(folder, safe_serialization=False)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before
    lora = peft.get_peft_model(tiny(), peft.LoraConfig(target_modules=["q_proj"]))
    lora.save_pretrained(folder / "lora", safe_serialization=False)  # other PEFT methods keep PEFT's choice
    assert (folder / "lora" / "adapter_model.bin").exists()


def test_pickle_is_never_loaded(saved, tmp_path, monkeypatch):
    folder, _ = saved
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_bytes((folder / "adapter_config.json").read_bytes())
    torch.save(load_file(folder / "adapter_model.safetensors"), pickled / "adapter_model.bin")  # as PEFT writes it

    def refuse(*args, **kwargs):
        raise AssertionError("an unpickler was called")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    with pytest.raises(AdapterFileError, match=r"adapter_model\.bin \(a pickle\).*safetensors"):
        peft.PeftModel.from_pretrained(tiny(), pickled)
    peft.PeftModel.from_pretrained(tiny(), folder)  # the safetensors path needs no unpickler at all


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            yield node, name, {kw.arg: kw.value for kw in node.keywords}


def test_library_source_never_unpickles_or_trusts_remote_code():
    for path in sorted((REPO / "ubmoe_peft").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not {"pickle", "dill", "cloudpickle", "joblib"} & set(names), f"{path}: imports a pickler"
        for node, name, keywords in _calls(tree):
            where = f"{path}:{node.lineno}"
            remote = keywords.get("trust_remote_code")
            assert not (isinstance(remote, ast.Constant) and remote.value is True), f"{where}: trust_remote_code=True"
            if (
                name == "load"
                and isinstance(node.func, ast.Attribute)
                and getattr(node.func.value, "id", "") == "torch"
            ):
                only = keywords.get("weights_only")
                assert isinstance(only, ast.Constant) and only.value is True, (
                    f"{where}: torch.load without weights_only"
                )


# ---- 3. atomic saving ---------------------------------------------------------------------------------------------
def test_atomic_write_keeps_the_old_file_when_the_writer_fails(tmp_path):
    target = tmp_path / "adapter_config.json"
    atomic_write_text(target, '{"old": true}')

    def broken(tmp: str) -> None:
        pathlib.Path(tmp).write_text('{"ne')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, broken)
    assert target.read_text() == '{"old": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json"]  # the temp file is cleaned up


_SAVER = """
import os, sys, time, torch, peft, ubmoe_peft
sys.path.insert(0, {tests!r})
from test_reliability import copy_adapter
folder, how = sys.argv[1], sys.argv[2]
model = copy_adapter(seed=2)
if how == "block":  # the writer stops after writing the temp file, before it is renamed
    def block(fd):
        open(os.path.join(folder, "..", "blocked"), "w").close()
        time.sleep(600)
    os.fsync = block
    model.save_pretrained(folder)
else:  # save over and over, two alternating versions, until killed
    open(os.path.join(folder, "..", "ready"), "w").close()
    models = [model, copy_adapter(seed=3)]
    for i in range(100000):
        models[i % 2].save_pretrained(folder)
"""


def _start_saver(folder: pathlib.Path, how: str) -> subprocess.Popen:
    script = _SAVER.format(tests=str(REPO / "tests"))
    return subprocess.Popen(
        [sys.executable, "-c", script, str(folder), how], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def _wait_for(path: pathlib.Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the saver exited early: {proc.stderr.read().decode()[-2000:]}")
        assert time.monotonic() < deadline, "the saver never got going"
        time.sleep(0.05)


BIG = dict(hidden=256, intermediate=1024, layers=4)  # a 12 MB copy-expert adapter: writing it takes a while


def copy_adapter(seed: int) -> peft.PeftModel:
    return trained(wrap(tiny(**BIG), expert_type="copy"), seed=seed)


def _copy_adapter_versions(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[int, bytes]]:
    """A folder holding version 'seed 2' of a copy-expert adapter, and the bytes of versions 2 and 3."""
    versions = {}
    for seed in (3, 2):
        copy_adapter(seed).save_pretrained(tmp_path / f"v{seed}")
        versions[seed] = (tmp_path / f"v{seed}" / "adapter_model.safetensors").read_bytes()
    return tmp_path / "v2", versions


def _assert_intact(folder: pathlib.Path, versions: dict[int, bytes]) -> None:
    weights = (folder / "adapter_model.safetensors").read_bytes()
    assert weights in versions.values(), "the final file is neither the old nor the new adapter"
    json.loads((folder / "adapter_config.json").read_text())
    names = {p.name for p in folder.iterdir()} - {"adapter_model.safetensors", "adapter_config.json", "README.md"}
    assert all(n.startswith(".") for n in names), names  # only hidden temp files (ours, or safetensors' own)
    loaded = peft.PeftModel.from_pretrained(tiny(**BIG), folder)
    assert torch.isfinite(logits(loaded, torch.arange(8).view(1, 8))).all()


@pytest.mark.parametrize("changed", [dict(lora_alpha=64.0), dict(top_k=2), dict(use_rslora=False)])
def test_weights_beside_another_saves_config_are_refused(tmp_path, changed):
    """A save killed between its two renames leaves the new weights with the old config. Settings that keep every
    tensor's shape (alpha, top_k, rsLoRA) would then load silently with the wrong scaling or routing; the weights
    carry the settings they were saved with, and the loader compares them with the config."""
    old, new = tmp_path / "old", tmp_path / "new"
    trained(wrap()).save_pretrained(old)
    trained(wrap(**changed), seed=3).save_pretrained(new)
    (old / "adapter_model.safetensors").write_bytes((new / "adapter_model.safetensors").read_bytes())
    ((name, value),) = changed.items()
    with pytest.raises(AdapterFileError, match=rf"different saves: {name}={value!r} in the weights, .* in the config"):
        peft.PeftModel.from_pretrained(tiny(), old)
    peft.PeftModel.from_pretrained(tiny(), new)  # the pair as saved loads


def test_a_config_without_keys_that_have_defaults_loads_with_the_defaults(tmp_path):
    """PEFT fills in a missing key's default; the settings check read it as None and called the files two saves."""
    trained(wrap()).save_pretrained(tmp_path)
    path = tmp_path / "adapter_config.json"
    config = json.loads(path.read_text())
    del config["expert_type"], config["top_k"]
    path.write_text(json.dumps(config))
    loaded = peft.PeftModel.from_pretrained(tiny(), tmp_path)
    assert (loaded.peft_config["default"].expert_type, loaded.peft_config["default"].top_k) == ("lora", 1)


def test_saving_the_same_adapter_twice_gives_the_same_file(tmp_path):
    """safetensors orders metadata from a hash map; with the settings beside "format", the bytes changed per save."""
    model = trained(wrap(expert_type="copy"))
    files = set()
    for _ in range(6):
        model.save_pretrained(tmp_path)
        files.add((tmp_path / "adapter_model.safetensors").read_bytes())
    assert len(files) == 1


def test_save_killed_while_writing_keeps_the_previous_adapter(tmp_path):
    folder, versions = _copy_adapter_versions(tmp_path)
    (folder / "adapter_model.safetensors").write_bytes(versions[3])  # the "previous" adapter differs from the new
    proc = _start_saver(folder, "block")
    try:
        _wait_for(tmp_path / "blocked", proc)
        temp = [p for p in folder.iterdir() if p.name.endswith(".tmp")]
        assert temp and temp[0].stat().st_size > 0, "the new weights are being written beside the old file"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (folder / "adapter_model.safetensors").read_bytes() == versions[3]
    _assert_intact(folder, versions)


def test_save_stopped_or_killed_at_random_moments_never_exposes_a_partial_file(tmp_path):
    """A process frozen with SIGSTOP leaves on disk exactly what SIGKILL at that moment would, so 40 random freezes
    sample 40 kill points of a save loop cheaply (a non-atomic writer fails this test most runs); then a real kill."""
    folder, versions = _copy_adapter_versions(tmp_path)
    proc = _start_saver(folder, "loop")
    rng = random.Random(os.getpid())
    try:
        _wait_for(tmp_path / "ready", proc)
        for _ in range(40):
            time.sleep(rng.uniform(0.002, 0.05))
            proc.send_signal(signal.SIGSTOP)
            try:
                assert (folder / "adapter_model.safetensors").read_bytes() in versions.values()
                json.loads((folder / "adapter_config.json").read_text())
            finally:
                proc.send_signal(signal.SIGCONT)
        time.sleep(rng.uniform(0.002, 0.05))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    _assert_intact(folder, versions)


# ---- 4. numerics --------------------------------------------------------------------------------------------------
def _router_output_dtypes(model: torch.nn.Module) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    for layer in ubmoe_layers(model):
        for router in layer.ubmoe_router.values():
            router.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    return seen


@pytest.mark.parametrize(
    "base_dtype,autocast",
    [(torch.bfloat16, None), (torch.float16, None), (torch.float32, torch.bfloat16), (torch.float32, torch.float16)],
)
@pytest.mark.parametrize("top_k", [1, 2])
def test_router_computes_in_fp32_under_low_precision(base_dtype, autocast, top_k):
    model = trained(wrap(tiny(dtype=base_dtype), top_k=top_k))
    seen = _router_output_dtypes(model)
    ids, mask = torch.randint(0, VOCAB, (2, 7)), torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1]])
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = logits(model, ids, mask)
    assert seen and all(dtype == torch.float32 for dtype in seen)
    assert torch.isfinite(out).all()


EDGE_BATCHES = {
    "all-padding row, right": (torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]]), 5),
    "all-padding row, left": (torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]]), 5),
    "batch of one": (None, 6),
    "one token": (torch.tensor([[1], [1]]), 1),
    "one real token among pads": (torch.tensor([[0, 0, 0, 1], [1, 0, 0, 0]]), 4),
}


@pytest.mark.parametrize("case", sorted(EDGE_BATCHES))
@pytest.mark.parametrize("expert_type,top_k", [("lora", 1), ("lora", 2), ("copy", 1)])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_no_nan_or_inf_in_edge_batches(case, expert_type, top_k, attn):
    mask, length = EDGE_BATCHES[case]
    rows = 1 if mask is None else mask.shape[0]
    model = trained(wrap(tiny(attn=attn), expert_type=expert_type, top_k=top_k))
    ids = torch.randint(0, VOCAB, (rows, length))
    for mode in ("uni", "bi", "moe"):
        with ubmoe_peft.use_mode(model, mode):
            assert torch.isfinite(logits(model, ids, mask)).all(), mode
    stats = ubmoe_peft.routing_stats(model)
    assert stats and all(0.0 <= share <= 1.0 for share in stats.values())


def test_long_sequence_stays_finite():
    model = trained(wrap(tiny(hidden=16, layers=1, intermediate=32)))
    ids = torch.randint(0, VOCAB, (1, 4096))
    mask = torch.ones_like(ids)
    mask[0, -96:] = 0
    for mode in ("bi", "moe"):
        with ubmoe_peft.use_mode(model, mode):
            assert torch.isfinite(logits(model, ids, mask)).all(), mode


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_mode_bi_never_attends_to_pad_tokens(padding_side, attn):
    model = trained(wrap(tiny(attn=attn)))
    ubmoe_peft.set_mode(model, "bi")
    real = torch.tensor([[1] * 8, [1] * 5 + [0] * 3, [1] * 2 + [0] * 6])  # (B, T)
    mask = real if padding_side == "right" else real.flip(-1)
    ids = torch.randint(3, VOCAB, mask.shape)
    other = torch.where(mask.bool(), ids, torch.randint(3, VOCAB, mask.shape))  # same real tokens, new pad ids
    a, b = logits(model, ids, mask), logits(model, other, mask)
    assert torch.allclose(a[mask.bool()], b[mask.bool()], atol=1e-5)
    assert not torch.allclose(a[~mask.bool()], b[~mask.bool()])  # the pads themselves did change


# ---- 5. mode state: per model, restored on errors ----------------------------------------------------------------
def test_use_mode_restores_the_mode_when_the_body_raises():
    model = wrap()
    ubmoe_peft.set_mode(model, "uni")
    with pytest.raises(KeyError), ubmoe_peft.use_mode(model, "bi"):
        assert ubmoe_peft.get_mode(model) == "bi"
        raise KeyError("boom")
    assert ubmoe_peft.get_mode(model) == "uni"
    with pytest.raises(ValueError, match="Unknown mode 'sideways'"), ubmoe_peft.use_mode(model, "sideways"):
        pass
    assert ubmoe_peft.get_mode(model) == "uni"


def test_two_wrapped_models_never_share_mode_state():
    first, second = trained(wrap()), trained(wrap(), seed=5)
    ubmoe_peft.set_mode(first, "bi")
    assert ubmoe_peft.get_mode(second) == "moe"
    logits(second, torch.arange(6).view(1, 6))
    assert ubmoe_peft.routing_stats(second) and ubmoe_peft.routing_stats(first) is None
    with ubmoe_peft.use_mode(second, "uni"):
        assert ubmoe_peft.get_mode(first) == "bi"


@pytest.mark.parametrize("expert_type", ["lora", "copy"])
def test_concurrent_forwards_compute_what_they_compute_alone(expert_type):
    """Forwards of one model from several threads at once, in train mode: the LoRA deltas then ride on temporary
    hooks on the shared FFN projections, so a forward running beside another one added the other's deltas to its
    own tokens. One forward of a model runs at a time (the forward lock)."""
    import threading

    model = trained(wrap(expert_type=expert_type))
    model.train()  # the hooked LoRA path (no dropout: lora_dropout=0)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, VOCAB, (2, 5 + i), generator=gen) for i in range(4)]
    expected = [logits(model, ids) for ids in inputs]
    wrong: list[int] = []

    def run(i: int) -> None:
        for _ in range(15):
            if not torch.allclose(logits(model, inputs[i]), expected[i], atol=1e-5):
                wrong.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_a_forward_stopped_by_keyboard_interrupt_leaves_the_lock_to_the_next_forward():
    """KeyboardInterrupt skips PyTorch's always-called hooks, so the interrupted forward kept the forward lock and
    every other thread's forward waited for ever. The interrupted thread's next forward releases it."""
    import threading

    model = trained(wrap())
    ids = torch.arange(6).view(1, 6)
    expected = logits(model, ids)

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    handle = ubmoe_layers(model)[0].register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        logits(model, ids)
    handle.remove()
    assert torch.equal(logits(model, ids), expected)  # the interrupted thread goes on
    done = []
    thread = threading.Thread(target=lambda: done.append(torch.equal(logits(model, ids), expected)), daemon=True)
    thread.start()
    thread.join(60)
    assert done == [True]


def test_a_mode_bi_forward_stopped_by_keyboard_interrupt_leaves_no_attention_delta_behind():
    """The attention adapter's deltas are taken off the projections by an always-called hook, which a KeyboardInterrupt
    skips: they stayed, and changed every mode after (uni was no longer the base, bi added them twice)."""
    model = trained(wrap(attention_r=2))
    ids = torch.arange(6).view(1, 6)
    expected = {mode: logits(ubmoe_peft.set_mode(model, mode) or model, ids) for mode in ("uni", "bi", "moe")}

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    o_proj = model.base_model.model.model.layers[0].self_attn.o_proj
    handle = o_proj.register_forward_hook(interrupt)  # inside layer 0's attention, with the deltas on, in mode bi
    ubmoe_peft.set_mode(model, "bi")
    with pytest.raises(KeyboardInterrupt):
        logits(model, ids)
    handle.remove()
    for order in (("uni", "bi", "moe"), ("bi", "uni", "moe")):  # the next forward, in another mode or the same
        for mode in order:
            ubmoe_peft.set_mode(model, mode)
            assert torch.equal(logits(model, ids), expected[mode]), mode
        ubmoe_peft.set_mode(model, "bi")
        with pytest.raises(KeyboardInterrupt):
            handle = o_proj.register_forward_hook(interrupt)
            try:
                logits(model, ids)
            finally:
                handle.remove()


@pytest.mark.parametrize("stop", [RuntimeError, KeyboardInterrupt])
def test_a_forward_that_raised_leaves_the_last_completed_routing(stop):
    """A mode-moe forward that raised half-way left the routing of the layers it ran: routing_stats named layer 0
    alone, and a track_routing block counted its tokens for layer 0 only. A KeyboardInterrupt (which skips the
    always-called hook) also kept the forward lock until the thread's next forward: other threads waited."""
    import threading

    model = trained(wrap(tiny(layers=3)))
    ids = torch.arange(6).view(1, 6)
    logits(model, ids[:, :2])
    completed = ubmoe_peft.routing_stats(model)

    def fail(module, args, output):
        raise stop("stop")

    with ubmoe_peft.track_routing(model) as tally:
        handle = ubmoe_layers(model)[1].register_forward_hook(fail)
        with pytest.raises(stop):
            logits(model, ids)
        handle.remove()
        assert ubmoe_peft.routing_stats(model) == completed
        assert tally.tokens == {}
        other: list = []  # the interrupted forward's lock is free (KeyboardInterrupt skipped its always-called hook)
        reader = threading.Thread(target=lambda: other.append(ubmoe_peft.routing_stats(model)), daemon=True)
        reader.start()
        reader.join(30)
        assert other == [completed]
        logits(model, ids[:, :2])
    assert set(tally.tokens.values()) == {2.0}  # the completed forward's two tokens, in every layer


def test_a_forward_that_failed_before_it_began_keeps_the_last_routing():
    """A forward that raised before UBMoE's pre-hook ran still reaches the always-called hook after it: it put back
    the routing from before the last completed forward, which a track_routing block then never counted."""
    model = trained(wrap(tiny(layers=3)))
    ids = torch.arange(6).view(1, 6)
    with ubmoe_peft.track_routing(model) as tally:
        logits(model, ids[:, :2])
        logits(model, ids)
        completed = ubmoe_peft.routing_stats(model)

        def fail(module, args, kwargs):
            raise RuntimeError("before the forward")

        backbone = model.base_model.model.model
        handle = backbone.register_forward_pre_hook(fail, prepend=True, with_kwargs=True)
        with pytest.raises(RuntimeError, match="before the forward"):
            logits(model, ids)
        handle.remove()
        assert ubmoe_peft.routing_stats(model) == completed
    assert set(tally.tokens.values()) == {8.0}  # both completed forwards, in every layer


def test_one_config_object_serves_many_models_and_adapters():
    config = ubmoe_peft.UBMoEConfig(lora_dropout=0.0)
    llama = peft.get_peft_model(tiny(), config)
    qwen = peft.get_peft_model(tiny("qwen2"), config)  # would fail if the llama wrap had written into `config`
    assert config.base_model_signature is None and config.target_modules is None
    assert llama.peft_config["default"] is not qwen.peft_config["default"]
    llama.add_adapter("second", config)
    assert llama.peft_config["second"] is not llama.peft_config["default"]


def test_deep_copy_is_independent_of_the_original():
    original = trained(wrap())
    ids = torch.arange(7).view(1, 7)
    ubmoe_peft.set_mode(original, "bi")
    expected = logits(original, ids)
    clone = copy.deepcopy(original)
    assert torch.allclose(logits(clone, ids), expected)  # the clone's LoRA hooks drive the clone's experts
    ubmoe_peft.set_mode(clone, "uni")
    assert ubmoe_peft.get_mode(original) == "bi"
    clone.unload()  # must not detach the original's hooks
    assert torch.allclose(logits(original, ids), expected)


def test_a_copy_or_pickle_carries_no_open_tally_and_no_decode_plan():
    """A copy made inside `track_routing` kept a tally no one could read, counting every forward of the copy; a
    pickled decode plan was trusted in the process that loaded it, where torch's hook counter is set from the pickled
    handles, so a hook added after the plan (and before the save) went unseen by one-token forwards."""
    import pickle

    original = trained(wrap())
    ids = torch.arange(3, 10).view(1, 7)
    with torch.no_grad():
        original.generate(input_ids=ids, max_new_tokens=3, do_sample=False)  # decode steps make the plans
    assert all(layer._plans for layer in ubmoe_layers(original))
    with ubmoe_peft.track_routing(original) as tally:
        clone = copy.deepcopy(original)
        loaded = pickle.loads(pickle.dumps(original))
        logits(original, ids)
    for other in (clone, loaded):
        state = ubmoe_layers(other)[0]._state
        assert state.tallies == [] and state._tallied is None
        assert not any(layer._plans for layer in ubmoe_layers(other))
        assert torch.equal(logits(other, ids[:, :1]), logits(original, ids[:, :1]))
    assert tally.shares() and original.base_model._ubmoe_state.tallies == []
    ubmoe_layers(original)[0].compile(backend="eager")  # a copy ran the original's compiled forward
    assert "_compiled_call_impl" not in vars(ubmoe_layers(copy.deepcopy(original))[0])


def test_errors_are_value_errors():
    assert issubclass(AdapterFileError, UBMoEFileError) and issubclass(AdapterMismatchError, UBMoEFileError)
    assert issubclass(UBMoEFileError, ValueError)


def test_saved_config_is_complete_and_readable(saved):
    folder, expected = saved
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "UBMOE"
    signature = {"hidden_size": 32, "intermediate_size": 64, "model_type": "llama", "num_layers": 2}
    signature.update(num_attention_heads=4, num_key_value_heads=2)
    assert config["base_model_signature"] == signature
    loaded = peft.PeftModel.from_pretrained(tiny(), folder)
    assert torch.allclose(logits(loaded, torch.arange(10).view(1, 10)), expected, atol=1e-6)


def test_no_stray_files_after_a_normal_save(saved):
    folder, _ = saved
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]


def test_saved_files_get_the_mode_a_plain_write_gives(tmp_path):
    old = os.umask(0o022)
    try:
        model = wrap()
        model.save_pretrained(tmp_path / "a")
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            assert stat.S_IMODE((tmp_path / "a" / name).stat().st_mode) == 0o644  # not mkstemp's private 0o600
        weights = tmp_path / "a" / "adapter_model.safetensors"
        weights.chmod(0o640)
        model.save_pretrained(tmp_path / "a")  # replacing a file keeps its mode
        assert stat.S_IMODE(weights.stat().st_mode) == 0o640
        with atomic_folder(tmp_path / "export") as tmp:
            (pathlib.Path(tmp) / "config.json").write_text("{}")
        assert stat.S_IMODE((tmp_path / "export").stat().st_mode) == 0o755  # not mkdtemp's 0o700
    finally:
        os.umask(old)


def test_a_new_folder_is_checked_before_anything_is_made(tmp_path, monkeypatch):
    """An export found a file in its path, a symbolic link or a folder it cannot write to only when it moved its files
    into place, after loading and merging the model: a raw error naming a hidden temp folder."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"--output_dir '.*afile/sub' cannot be made: .*afile is a file"):
        check_new_folder(tmp_path / "afile" / "sub", "--output_dir")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not an empty folder .*; choose a new output folder"):
        check_new_folder(tmp_path / "full")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    with pytest.raises(ValueError, match=rf"cannot be made: {tmp_path} is not writable"):
        check_new_folder(tmp_path / "new" / "deeper")
    monkeypatch.undo()
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")  # a link to an empty folder: the export goes there
    with atomic_folder(tmp_path / "link") as tmp:
        (pathlib.Path(tmp) / "config.json").write_text("{}")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "empty" / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "empty", "full", "link"]


def test_a_save_that_fails_part_way_puts_the_earlier_save_back(tmp_path, monkeypatch):
    """An error or interrupt between an adapter's weights and its config left the new weights beside the earlier
    config: neither save loaded any more. PEFT's positional options also reach the wrapped save."""
    folder = tmp_path / "a"
    wrap(lora_alpha=16).save_pretrained(folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    other = wrap(lora_alpha=32)
    for fault in (OSError(28, "No space left on device"), KeyboardInterrupt()):

        def fail(*args, fault=fault, **kwargs):
            raise fault

        monkeypatch.setattr(ubmoe_peft.UBMoEConfig, "save_pretrained", fail)
        with pytest.raises(type(fault)):
            other.save_pretrained(folder)
        monkeypatch.undo()
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # no stray link either
    live = f".adapter_config.json.{os.getppid()}.ab12.previous"
    (folder / live).write_text("a live save's link")
    for left in (f"{os.getpid()}.cd34", "4194305.ef56", "99999999999999999999.0a0b", "x.0000"):  # this pid: a restart's
        (folder / f".adapter_model.safetensors.{left}.previous").write_text("a killed save's link")
    other.save_pretrained(folder)  # the next save removes links of no running process, not the live one's
    assert [p.name for p in folder.glob(".*.previous")] == [live]
    (folder / live).unlink()
    wrap(lora_alpha=16).save_pretrained(folder)
    peft.PeftModel.from_pretrained(tiny(), folder)
    other.save_pretrained(folder, True, ["default"])  # save_directory, safe_serialization, selected_adapters
    assert ubmoe_peft.UBMoEConfig.from_pretrained(folder).lora_alpha == 32


def test_a_folder_in_place_of_an_empty_one_or_a_mount_point(tmp_path, monkeypatch):
    """An empty folder that cannot be removed (a container's volume) made the export fail after the whole merge;
    an empty one lost its permissions; a failed export into a new nested path left its empty parents behind."""
    (tmp_path / "empty").mkdir(mode=0o750)
    (tmp_path / "empty").chmod(0o750)
    with atomic_folder(tmp_path / "empty") as tmp:
        (pathlib.Path(tmp) / "config.json").write_text("{}")
    assert stat.S_IMODE((tmp_path / "empty").stat().st_mode) == 0o750
    (tmp_path / "mount").mkdir()
    (tmp_path / "bind").mkdir()  # a bind mount within one filesystem: not seen by ismount, busy all the same
    real_rmdir, real_ismount = os.rmdir, os.path.ismount

    def busy(path, *args, **kwargs):  # a mount point cannot be removed, nor files renamed into it from outside
        if str(path) in (str(tmp_path / "mount"), str(tmp_path / "bind")):
            raise OSError(16, "Device or resource busy")
        return real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", busy)
    monkeypatch.setattr(os.path, "ismount", lambda p: str(p) == str(tmp_path / "mount") or real_ismount(p))
    with atomic_folder(tmp_path / "mount") as tmp:
        assert pathlib.Path(tmp).parent == tmp_path / "mount"  # staged inside it: same filesystem
        (pathlib.Path(tmp) / "config.json").write_text("{}")
    real_move = shutil.move

    def full(source, target):  # the copy into the folder fails part-way: nothing of it is left there
        if source.endswith("b.json"):
            raise OSError(28, "No space left on device")
        return real_move(source, target)

    monkeypatch.setattr(shutil, "move", full)
    with pytest.raises(OSError, match="No space"), atomic_folder(tmp_path / "bind") as tmp:
        (pathlib.Path(tmp) / "a.json").write_text("{}")
        (pathlib.Path(tmp) / "b.json").write_text("{}")
    assert not list((tmp_path / "bind").iterdir())
    monkeypatch.setattr(shutil, "move", real_move)
    with atomic_folder(tmp_path / "bind") as tmp:
        (pathlib.Path(tmp) / "config.json").write_text("{}")
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "mount").iterdir()] == ["config.json"]
    assert [p.name for p in (tmp_path / "bind").iterdir()] == ["config.json"]
    with pytest.raises(RuntimeError), atomic_folder(tmp_path / "a" / "b" / "out") as tmp:
        (pathlib.Path(tmp) / "config.json").write_text("{}")
        raise RuntimeError("the save failed")
    assert not (tmp_path / "a").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bind", "empty", "mount"]  # no temp folder left


def test_a_refused_load_leaves_the_base_as_it_was_passed(tmp_path):
    """The settings and integrity of the saved files are checked as PEFT loads the weights, after the layers exist: a
    refused load left the base holding UBMoE layers and hooks (with a bad target, a base that no longer ran)."""
    folder = tmp_path / "a"
    trained(wrap(modules_to_save=["lm_head"])).save_pretrained(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))
    base = tiny()
    base.gradient_checkpointing_enable()  # PEFT adds an input-grads hook for it, and freezes the base
    before, ids = snapshot(base), torch.arange(6).view(1, 6)
    expected, hooks = logits(base, ids), sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in base.modules())
    with pytest.raises(AdapterFileError, match="come from different saves"):
        peft.PeftModel.from_pretrained(base, folder)
    assert same_state(base, before) and not ubmoe_layers(base) and not hasattr(base, "peft_config")
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in base.modules()) == hooks
    assert all(p.requires_grad for p in base.parameters()) and torch.equal(logits(base, ids), expected)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    assert ubmoe_layers(peft.PeftModel.from_pretrained(base, folder))  # the same base takes the good files


def test_a_save_refuses_shards_but_not_a_copy_experts_norm(tmp_path):
    """A UBMoE adapter file must hold whole matrices (a sharded model wrote flat shards, silently); a copy expert's
    own 1-D weights (BitNet's FFN norm) are whole."""
    from ubmoe_peft.io import _refuse_shards

    key = "base_model.model.model.layers.0.mlp.ubmoe_{}.weight"
    _refuse_shards({key.format("copy.ffn_sub_norm"): torch.ones(8), key.format("router"): torch.ones(2, 8)}, "f")
    for tensors in ({key.format("lora_A.gate_proj"): torch.ones(16)}, {key.format("router"): torch.ones(3, 8)}, {}):
        with pytest.raises(ValueError, match="Cannot save f: .*(shape|no tensor).*Gather the full state dict"):
            _refuse_shards(tensors, "f")
