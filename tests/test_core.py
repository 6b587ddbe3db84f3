"""The core contract: modes, routing, bidirectional attention, save/load, stages, generation.

Parametrized over architectures x expert kinds x modes (and attention implementations where attention matters).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import (
    ARCH_ATTNS,
    ARCHS,
    ATTNS,
    EXPERTS,
    NO_SDPA,
    batch,
    config_of,
    hidden,
    perturb_adapters,
    tiny_model,
    w,
)
from peft import PeftConfig, PeftModel, get_peft_model
from peft.utils import PeftType
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig

import ubmoe_peft
from ubmoe_peft import UBMoEConfig, UBMoELayer
from ubmoe_peft.tuners.ubmoe import layer as layer_module
from ubmoe_peft.tuners.ubmoe import lora as lora_module
from ubmoe_peft.tuners.ubmoe.layer import _gated_mlp_forward

MODES = ["uni", "bi", "moe"]


def wrap(arch="llama", expert="lora", attn=None, **kw):
    base = tiny_model(arch, attn)
    reference = copy.deepcopy(base)
    model = get_peft_model(base, UBMoEConfig(expert_type=expert, **kw)).eval()
    return model, reference


def logits_per_mode(model, ids, mask):
    out = {}
    for mode in MODES:
        with ubmoe_peft.use_mode(model, mode):
            out[mode] = logits(model, ids, mask)
    return out


def layers(model):
    return [m for m in model.modules() if isinstance(m, UBMoELayer)]


def logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


# ---- registration -------------------------------------------------------------------------------------------------
def test_registered_with_peft(tmp_path):
    assert PeftType("UBMOE") is PeftType.UBMOE and PeftType.UBMOE in list(PeftType)
    model, _ = wrap()
    model.save_pretrained(tmp_path)
    config = PeftConfig.from_pretrained(tmp_path)
    assert isinstance(config, UBMoEConfig) and config.peft_type == PeftType.UBMOE
    assert config.target_modules == ["mlp"]
    trainable, total = model.get_nb_trainable_parameters()
    assert 0 < trainable < total


def test_fresh_model_is_in_mode_moe_and_has_no_stats():
    model, _ = wrap()
    assert ubmoe_peft.get_mode(model) == "moe"
    assert ubmoe_peft.routing_stats(model) is None
    ids, mask = batch()
    logits(model, ids, mask)
    assert ubmoe_peft.routing_stats(model) == {0: 0.0, 1: 0.0}


# ---- the base-model invariants ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("arch", "attn"), ARCH_ATTNS)
@pytest.mark.parametrize("expert", EXPERTS)
def test_mode_uni_equals_base_after_training(arch, expert, attn):
    model, reference = wrap(arch, expert, attn)
    perturb_adapters(model)
    ubmoe_peft.set_mode(model, "uni")
    ids, mask = batch()
    assert torch.equal(logits(model, ids, mask), logits(reference, ids, mask))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("expert", EXPERTS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_fresh_moe_equals_base(arch, expert, top_k):
    model, reference = wrap(arch, expert, top_k=top_k)
    ids, mask = batch(padding="left")
    assert torch.equal(logits(model, ids, mask), logits(reference, ids, mask))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(**kwargs), reference.generate(**kwargs))


@pytest.mark.parametrize("router_dtype", ["float16", "bfloat16"])
def test_fresh_top2_moe_equals_a_half_precision_base_with_a_router_in_half_precision(router_dtype):
    """The two-expert mixture 0.5 * u + 0.5 * u was computed in the router's dtype: in float16 it lost the low bits of
    small outputs (subnormal halves), and a fresh model was not the base model."""
    base = tiny_model("qwen2").to(torch.float16).eval()
    reference = copy.deepcopy(base)
    model = get_peft_model(base, UBMoEConfig(top_k=2, router_dtype=router_dtype)).eval()
    layer = layers(model)[0]
    h = torch.randn(2, 7, 32, dtype=torch.float16) * 1e-3  # outputs where fp16's halves are subnormal
    with torch.no_grad():
        assert torch.equal(layer(h), layer.base_layer(h))
    ids, mask = batch(padding="left")
    assert torch.equal(logits(model, ids, mask), logits(reference, ids, mask))


@pytest.mark.parametrize("expert", EXPERTS)
def test_a_layer_takes_token_rows_without_a_batch_dimension(expert):
    """Decode-sized inputs are routed on the host, which read the logits as (B, T, 2): an (N, C) input of at most 64
    rows failed with a TypeError (larger ones worked)."""
    model, _ = wrap("llama", expert)
    perturb_adapters(model, std=0.3)
    layer = layers(model)[0]
    for rows in (8, 100):
        x = torch.randn(rows, 32)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), layer(x[None])[0], rtol=0, atol=0)


# ---- bidirectional attention --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("arch", "attn"), ARCH_ATTNS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_only_mode_bi_sees_later_tokens(arch, attn, mode, padding):
    model, _ = wrap(arch, "lora", attn)
    perturb_adapters(model, std=0.1)
    ubmoe_peft.set_mode(model, mode)
    ids, mask = batch(padding=padding)
    changed = ids.clone()
    changed[1:, -1] = (changed[1:, -1] + 1 - 3) % (128 - 3) + 3  # last real token of the unpadded rows
    with torch.no_grad():
        h1 = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        h2 = model(input_ids=changed, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    first_changes = (h1[1:, 0] - h2[1:, 0]).abs().max()  # (first token of rows 1..)
    if mode == "bi":
        assert first_changes > 1e-4
    else:
        assert first_changes == 0
    # the padded row did not change at all: no real token looks at another row or (in bi) at pads' values
    assert torch.equal(h1[0][mask[0].bool()], h2[0][mask[0].bool()])


# Flex attention compiles (torch inductor) for each kind of mask (causal or not, windowed, padded) and input shape.
FLEX_CASES = [(arch, None) for arch in ARCHS] + [("mistral", 4), ("gemma2", 4)]  # windows shorter than the text


def _flex_and_reference(arch: str, window: int | None = None, **kwargs) -> list[PeftModel]:
    """The same wrapped tiny model (adapters perturbed alike) on flex attention and on sdpa (Gemma2: eager)."""
    models = []
    for attn in ("flex_attention", "eager" if arch in NO_SDPA else "sdpa"):
        torch.manual_seed(0)
        config = config_of(arch)
        if window is not None:
            config.sliding_window = window
        config._attn_implementation = attn
        model = get_peft_model(AutoModelForCausalLM.from_config(config), UBMoEConfig(**kwargs)).eval()
        perturb_adapters(model, std=0.1)
        models.append(model)
    return models


@pytest.fixture
def flex_compiles():
    """Dynamo compiles flex attention once per kind of mask (causal or not, windowed, padded) and shape, for the whole
    process, and past its recompile limit (8) runs flex attention's unfused reference path: every case here runs the
    compiled kernel (those of one kind are shared across architectures)."""
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


@pytest.mark.parametrize(("arch", "window"), FLEX_CASES)
@pytest.mark.usefixtures("flex_compiles")
def test_flex_attention_runs_every_mode_as_sdpa_does(arch, window):
    """Flex attention gets a BlockMask, which transformers builds bidirectional (padding only) from mode bi's
    is_causal=False as it builds sdpa's tensor mask, sliding windows too, and which the mode-bi check reads. Every
    mode equals the sdpa model (Gemma2: eager, soft-capped), the mode-bi attention adapter included, with and
    without padding, and only mode bi sees later tokens."""
    flex, reference = _flex_and_reference(arch, window, attention_r=4)
    for padding in (None, "left", "right"):
        ids, mask = batch(padding=padding)
        changed = ids.clone()
        changed[1:, -1] = (changed[1:, -1] + 1 - 3) % (128 - 3) + 3  # last real token of the unpadded rows
        real = mask.bool()
        for mode in MODES:
            with ubmoe_peft.use_mode(flex, mode), ubmoe_peft.use_mode(reference, mode):
                h1, h2, expected = hidden(flex, ids, mask), hidden(flex, changed, mask), hidden(reference, ids, mask)
            torch.testing.assert_close(h1[real], expected[real], rtol=1e-4, atol=1e-5)
            first_changes = (h1[1:, 0] - h2[1:, 0]).abs().max()  # (first token of rows 1..)
            if mode == "bi":
                assert first_changes > 1e-4
            else:
                assert first_changes == 0


# Windows shorter than the documents: each layer type gets its own per-document mask
PACKED_CASES = [(arch, attn, None) for arch, attn in ARCH_ATTNS] + [
    ("mistral", "sdpa", 3),
    ("gemma2", "eager", 3),
    ("llama", "flex_attention", None),
    ("gemma2", "flex_attention", 3),
]


@pytest.mark.parametrize(("arch", "attn", "window"), PACKED_CASES)
@pytest.mark.usefixtures("flex_compiles")
def test_a_packed_row_keeps_its_documents_apart_in_every_mode(arch, attn, window):
    """A packed row (TRL's padding_free and packing: documents side by side, position_ids restarting at 0, no
    attention_mask). transformers' bidirectional mask ignores the position_ids, so mode bi's documents attended to each
    other (hidden states off by about 1 on a tiny model), silently. In every mode each document now computes what it
    computes alone, and mode bi still attends bidirectionally within a document."""
    torch.manual_seed(0)
    config = config_of(arch)
    if window is not None:
        config.sliding_window = window
    if arch == "mistral" and window is not None:  # kept by MistralConfig, unread by Mistral's code: every layer slides
        config.layer_types = [("full_attention", "sliding_attention")[i % 2] for i in range(config.num_hidden_layers)]
    config._attn_implementation = attn
    model = get_peft_model(AutoModelForCausalLM.from_config(config), UBMoEConfig()).eval()
    perturb_adapters(model, std=0.1)
    ids, _ = batch(b=1, padding=None)  # (1, 9): document A (5 tokens), then document B (4 tokens)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])  # (1, 9)
    changed = ids.clone()
    changed[0, 4] = (changed[0, 4] + 1 - 3) % (128 - 3) + 3  # the last token of document A
    for mode in MODES:
        with ubmoe_peft.use_mode(model, mode):
            packed = hidden(model, ids, None, position_ids=position_ids, use_cache=False)[0]  # (9, C)
            alone = [hidden(model, ids[:, :5], None, use_cache=False)[0], hidden(model, ids[:, 5:], None)[0]]
            torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-4, atol=1e-5)
            moved = hidden(model, changed, None, position_ids=position_ids, use_cache=False)[0]  # (9, C)
        assert torch.equal(moved[5:], packed[5:])  # document B never sees document A
        assert bool((moved[0] - packed[0]).abs().max() > 1e-4) is (mode == "bi")  # A's first token sees its last


def test_a_packed_row_in_mode_bi_is_refused_where_a_layer_type_has_no_per_document_mask():
    """Qwen 3.5's linear-attention layers take a mask of their own: mode bi cannot keep packed documents apart."""
    model = get_peft_model(tiny_model("qwen3_5_text"), UBMoEConfig()).eval()
    ids, _ = batch(b=1, padding=None)  # (1, 9)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])  # (1, 9): two documents
    with ubmoe_peft.use_mode(model, "bi"), pytest.raises(ValueError, match=r"linear_attention.*padding_free=False"):
        hidden(model, ids, None, position_ids=position_ids, use_cache=False)
    with ubmoe_peft.use_mode(model, "bi"):
        hidden(model, ids, None, position_ids=torch.arange(9)[None], use_cache=False)  # one document: fine


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("padding", ["left", "right"])
def test_mode_bi_ignores_pad_tokens(attn, padding):
    model, _ = wrap("llama", "lora", attn)
    perturb_adapters(model, std=0.1)
    ubmoe_peft.set_mode(model, "bi")
    ids, mask = batch(padding=padding)
    other_pads = ids.clone()
    other_pads[mask == 0] = 77
    with torch.no_grad():
        h1 = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        h2 = model(input_ids=other_pads, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    real = mask.bool()
    torch.testing.assert_close(h1[real], h2[real], rtol=0, atol=1e-5)


def test_disable_adapter_is_the_base_model_even_in_mode_bi():
    model, reference = wrap()
    perturb_adapters(model)
    ubmoe_peft.set_mode(model, "bi")
    ids, mask = batch()
    with model.disable_adapter():
        assert torch.equal(logits(model, ids, mask), logits(reference, ids, mask))
    assert not torch.equal(logits(model, ids, mask), logits(reference, ids, mask))


@pytest.mark.parametrize("stage", ["router", "contrastive", None])
def test_disable_adapter_leaves_the_stage_and_frozen_adapters_as_they_were(tmp_path, stage):
    """PEFT unfreezes the active adapter when it enables adapters again: a reference forward under
    `disable_adapter()` (as DPO-style training does) must not make a stage's frozen experts or routers trainable."""
    model, _ = wrap("llama", "lora")
    perturb_adapters(model)
    if stage is None:  # an adapter loaded for inference: nothing trainable
        model.save_pretrained(tmp_path)
        model = PeftModel.from_pretrained(tiny_model(), tmp_path, is_trainable=False)
    else:
        ubmoe_peft.set_stage(model, stage)
    model.train()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    torch.manual_seed(0)
    before = model(*batch()).logits
    with model.disable_adapter():
        model(*batch())
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    torch.manual_seed(0)
    assert torch.equal(model(*batch()).logits, before)  # same dropout (none on a frozen LoRA expert)


def test_trainability_set_while_adapters_are_disabled_is_kept_on_enabling():
    """Enabling adapters restores the trainability that disabling found, but set_adapter, set_stage and
    set_requires_grad inside `disable_adapter()` were then undone: the new active adapter was frozen and the old one
    trained, a stage router trained its experts, a frozen adapter was unfrozen."""

    def trainable(model):
        return {n.split("base_model.model.")[-1] for n, p in model.named_parameters() if p.requires_grad}

    model, _ = wrap()
    model.add_adapter("copy", UBMoEConfig(expert_type="copy"))
    with model.disable_adapter():
        model.set_adapter("copy")
    names = trainable(model)
    assert names and all(".copy." in n for n in names)
    assert any("ubmoe_copy.copy" in n for n in names) and any("ubmoe_router.copy" in n for n in names)

    model, _ = wrap()
    with model.disable_adapter():
        ubmoe_peft.set_stage(model, "router")
    assert ubmoe_peft.get_mode(model) == "moe"
    names = trainable(model)
    assert names and all("ubmoe_router.default" in n for n in names)

    model, _ = wrap()
    with model.disable_adapter():
        model.set_requires_grad("default", False)
    assert not trainable(model)
    with model.disable_adapter():  # and with nothing set inside, what disabling found comes back
        pass
    assert not trainable(model)

    model, _ = wrap()  # what an operation inside does not address keeps what disabling found
    ubmoe_peft.set_stage(model, "router")
    routers = trainable(model)
    with model.disable_adapter():
        model.add_adapter("two", UBMoEConfig())
        model.set_adapter("two")
        model.set_adapter("default")
        model.set_requires_grad("two", False)
    assert trainable(model) == routers
    model.delete_adapter("default")  # "two" becomes active: nothing kept from when it was left comes back
    ubmoe_peft.set_stage(model, "contrastive")
    model.set_adapter("two")  # set again while active: all trainable, as in PEFT
    assert {n.split(".two.")[0].split(".")[-1] for n in trainable(model)} == {
        "ubmoe_lora_A", "ubmoe_lora_B", "ubmoe_router"
    }  # fmt: skip


def test_trainability_inside_disable_adapter_is_what_the_same_calls_give_outside():
    """Deleting the active adapter inside `disable_adapter()` left the new active one frozen; `set_adapter` of the
    active adapter there was undone on exit; and `set_requires_grad` on an adapter left earlier was overridden by
    what it had when left, once set again."""

    def counts(model, name):
        flags = [p.requires_grad for n, p in model.named_parameters() if f".{name}." in n]
        return sum(flags), len(flags)

    def fresh():
        model, _ = wrap()
        model.add_adapter("b", UBMoEConfig())
        ubmoe_peft.set_stage(model, "router")
        return model

    for call in (lambda m: m.delete_adapter("default"), lambda m: m.set_adapter("default")):
        outside, inside = fresh(), fresh()
        call(outside)
        with inside.disable_adapter():
            call(inside)
        name = outside.active_adapter
        assert counts(inside, name) == counts(outside, name) == (14, 14)  # PEFT's rule: all trainable
    model = fresh()
    model.set_adapter("b")
    model.set_requires_grad("default", False)
    model.set_adapter("default")
    assert counts(model, "default") == (0, 14)
    outside, inside = fresh(), fresh()  # PEFT's set_adapter freezes the other adapters too
    for model in (outside, inside):
        model.set_requires_grad("b", True)
    outside.set_adapter("default")
    with inside.disable_adapter():
        inside.set_adapter("default")
    assert counts(inside, "b") == counts(outside, "b") == (0, 14)

    def three():  # a third adapter's modules_to_save copy: PEFT's switch leaves it as it is
        model, _ = wrap(modules_to_save=["lm_head"])
        for name in ("b", "c"):
            model.add_adapter(name, UBMoEConfig(modules_to_save=["lm_head"]))
        ubmoe_peft.set_stage(model, "router")
        model.set_requires_grad("b", True)
        return model

    outside, inside = three(), three()
    outside.set_adapter("c")
    with inside.disable_adapter():
        inside.set_adapter("c")
    flags = [{n: p.requires_grad for n, p in model.named_parameters()} for model in (inside, outside)]
    assert flags[0] == flags[1] and flags[1]["base_model.model.lm_head.modules_to_save.b.weight"]


def test_an_adapter_saves_whole_under_torchs_activation_checkpoint_wrapper(tmp_path):
    """Module names then hold `_checkpoint_wrapped_module.` (accelerate applies the wrapper under FSDP) and the
    state-dict keys do not: the tuner's weights were saved as none, and a `modules_to_save` copy inside a decoder
    layer failed the save with a bare KeyError."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = get_peft_model(tiny_model(), UBMoEConfig(modules_to_save=["post_attention_layernorm", "lm_head"]))
    perturb_adapters(model)
    with torch.no_grad():  # the copies differ from the base's modules
        for name, param in model.named_parameters():
            if ".modules_to_save." in name:
                param.mul_(1.5)
    ids, mask = batch()
    expected = logits(model.eval(), ids, mask)
    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, LlamaDecoderLayer))
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_modules())
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_model(), tmp_path).eval()
    assert torch.equal(logits(reloaded, ids, mask), expected)
    model.save_pretrained(tmp_path / "given", state_dict=model.state_dict())  # as the Trainer saves under FSDP
    reloaded = PeftModel.from_pretrained(tiny_model(), tmp_path / "given").eval()
    assert torch.equal(logits(reloaded, ids, mask), expected)


@pytest.mark.parametrize("name", ["mlp", "gate_proj", "0", "layers", "weight", "ubmoe_router", "a.b", "base_layer"])
def test_an_adapter_named_like_a_part_of_the_keys_is_refused(tmp_path, name):
    """PEFT saves one adapter by dropping every key that holds another adapter's name as a dotted part; UBMoE keys
    hold the base's module path, so a second adapter named "mlp" made save_pretrained write 0 of the first
    adapter's 14 tensors, without a word (its reload was then refused as another adapter's)."""
    model, _ = wrap()
    with pytest.raises(ValueError, match=f"Adapter name {name!r}.*Choose another name"):
        model.add_adapter(name, UBMoEConfig(expert_type="copy"))
    assert list(model.peft_config) == ["default"]
    with pytest.raises(ValueError, match=f"Adapter name {name!r}"):
        get_peft_model(tiny_model(), UBMoEConfig(), adapter_name=name)
    model.add_adapter("chat", UBMoEConfig(expert_type="copy"))  # a name that is no part of the keys
    perturb_adapters(model)
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_model(), tmp_path).eval()
    ids, mask = batch()
    assert torch.equal(logits(reloaded, ids, mask), logits(model.eval(), ids, mask))


def test_a_forward_with_adapter_weights_never_loaded_is_refused():
    """`get_peft_model(..., low_cpu_mem_usage=True)` makes the adapter on the meta device; a forward before its
    weights were loaded computed on uninitialised memory (torch's linear with a meta weight), and generate ran."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    trained, _ = wrap()
    perturb_adapters(trained)
    model = get_peft_model(tiny_model(), UBMoEConfig(), low_cpu_mem_usage=True).eval()
    ids, mask = batch()
    for mode in ("moe", "bi"):
        ubmoe_peft.set_mode(model, mode)
        with pytest.raises(RuntimeError, match="meta device .*set_peft_model_state_dict"):
            logits(model, ids, mask)
    ubmoe_peft.set_mode(model, "moe")
    with pytest.raises(RuntimeError, match="meta device"):
        model.generate(input_ids=ids[:1, :3], max_new_tokens=2, do_sample=False)
    ubmoe_peft.set_mode(model, "uni")
    assert torch.isfinite(logits(model, ids, mask)).all()  # the base model needs no adapter weights
    set_peft_model_state_dict(model, get_peft_model_state_dict(trained), low_cpu_mem_usage=True)
    for mode in MODES:
        ubmoe_peft.set_mode(model, mode), ubmoe_peft.set_mode(trained, mode)
        assert torch.equal(logits(model, ids, mask), logits(trained.eval(), ids, mask))


def test_new_layers_follow_the_mode_of_the_module_they_wrap():
    """A new module starts in training mode: UBMoE layers made on a base in eval mode (as from_pretrained returns it),
    or by add_adapter after model.eval() on layers the first adapter does not wrap, ran their LoRA dropout at
    inference, so two equal calls differed."""
    model = get_peft_model(tiny_model(), UBMoEConfig(layers_to_transform=[0], lora_dropout=0.5))
    assert not any(module.training for module in model.get_base_model().modules())
    model.eval().add_adapter("two", UBMoEConfig(layers_to_transform=[1], lora_dropout=0.5))
    model.set_adapter("two")
    perturb_adapters(model)
    assert not any(module.training for module in model.modules())
    ids, mask = batch()
    with ubmoe_peft.use_mode(model, "bi"):
        assert torch.equal(logits(model, ids, mask), logits(model, ids, mask))
    model.train()
    assert all(module.training for module in model.modules())


def _training(model, checkpointing: bool | None) -> None:
    """Perturbed adapters, train mode, and gradient checkpointing (reentrant or not; None: off); seeds the dropout."""
    perturb_adapters(model, std=0.3)
    model.train()
    if checkpointing is not None:
        kwargs = {"use_reentrant": checkpointing}
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    torch.manual_seed(0)


@pytest.mark.parametrize("expert", EXPERTS)
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_recomputes_each_forward_in_its_own_mode(expert, reentrant):
    """Gradient checkpointing runs the layers again in backward. One loss over a mode-bi forward (in `use_mode`), one
    with adapters disabled and a mode-moe forward of another shape: the layers were recomputed in the mode set at
    backward (silently wrong gradients with reentrant checkpointing, a CheckpointError without; a layer without a
    UBMoE layer failed the mode-bi mask check), and the recompute recorded its routing again, over the last forward's
    (routing_stats and track_routing then showed the first forward's, without its padding)."""

    def run(checkpointing):
        model, _ = wrap("llama", expert, attention_r=4, layers_to_transform=[1] if expert == "copy" else None)
        _training(model, checkpointing)
        with ubmoe_peft.track_routing(model) as tally:
            with ubmoe_peft.use_mode(model, "bi"):
                embedded = model(*batch(b=3, t=9), output_hidden_states=True).hidden_states[-1]  # (B, T, C)
            with model.disable_adapter():
                base = model(*batch(seed=2, b=2, t=7)).logits  # (B, T, V)
            generated = model(*batch(seed=1, b=2, t=5)).logits  # (B, T, V)
            (embedded.square().mean() + base.square().mean() + generated.square().mean()).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return grads, ubmoe_peft.routing_stats(model), tally.shares()

    expected, stats, tallied = run(None)
    grads, got_stats, got_tallied = run(reentrant)
    assert {"ubmoe_attn_A", "ubmoe_router", f"ubmoe_{'copy' if expert == 'copy' else 'lora_A'}"} <= {
        part for name in expected for part in name.split(".")
    }
    assert set(grads) == set(expected)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6)
    assert got_stats == stats and got_tallied == tallied


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_recomputes_with_the_adapters_of_its_forward(reentrant):
    """Two adapters in one loss (`set_adapter` between the forwards, which freezes the other) and `modules_to_save`
    copies inside the layers under `disable_adapter()`: the recompute ran the adapters as set at backward (silently
    wrong gradients with reentrant checkpointing) or saved fewer tensors than its forward (a CheckpointError)."""

    def run(checkpointing):
        model, _ = wrap("llama", "lora", modules_to_save=["o_proj"])
        model.add_adapter("two", UBMoEConfig(modules_to_save=["o_proj"]))
        _training(model, checkpointing)
        first = model(*batch()).logits  # (B, T, V)
        with model.disable_adapter():
            plain = model(*batch(seed=2)).logits  # (B, T, V)
        model.set_adapter("two")
        second = model(*batch(seed=1, b=2, t=5)).logits  # (B, T, V)
        (first.square().mean() + plain.square().mean() + second.square().mean()).backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    expected, grads = run(None), run(reentrant)
    assert any(".modules_to_save.two." in name for name in expected) and set(grads) == set(expected)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-5)


def test_checkpointing_keeps_no_deleted_or_unloaded_layer_alive(tmp_path):
    """The recompute keeps each decoder layer's UBMoE layers and parameters on it (walking them at every training
    forward cost 8 ms at 30 layers). Deleting an adapter, loading one (PEFT may assign new parameters), wrapping the
    base again (which drops the earlier adapter) or unloading drops them: a copy expert's weights stayed alive."""
    model, _ = wrap("llama", "copy")
    model.add_adapter("two", UBMoEConfig(expert_type="copy"))
    _training(model, False)
    layers = model.base_model._decoder_layers

    def step_then_kept() -> bool:
        model(*batch()).logits.square().mean().backward()
        return all("_ubmoe_parts" in layer.__dict__ for layer in layers)

    assert step_then_kept()
    model.delete_adapter("two")
    assert not any("_ubmoe_parts" in layer.__dict__ for layer in layers)
    assert step_then_kept()
    model.save_pretrained(tmp_path)
    model.load_adapter(tmp_path, "default", is_trainable=True, low_cpu_mem_usage=True)
    assert not any("_ubmoe_parts" in layer.__dict__ for layer in layers)
    assert step_then_kept()
    model = PeftModel.from_pretrained(model.get_base_model(), tmp_path, is_trainable=True)
    assert not any("_ubmoe_parts" in layer.__dict__ for layer in layers)
    assert step_then_kept()
    merged = model.merge_and_unload(target="bi")
    assert not [key for layer in layers for key in layer.__dict__ if key.startswith("_ubmoe")]
    assert not any(isinstance(m, UBMoELayer) for m in merged.modules())


# ---- routing ------------------------------------------------------------------------------------------------------
def _merged_lora_ffn(layer: UBMoELayer, adapter: str = "default") -> torch.nn.Module:
    """Reference bi expert built another way: the FFN with W + scale * B A merged into each projection."""
    ffn = copy.deepcopy(layer.base_layer)
    for m in ffn.modules():
        m._forward_hooks.clear()
    with torch.no_grad():
        for key, a in layer.ubmoe_lora_A[adapter].items():
            b = layer.ubmoe_lora_B[adapter][key]
            proj = ffn.get_submodule(key.replace("__", "."))
            proj.weight += layer.scaling[adapter] * (b.weight @ a.weight)  # (out, r) @ (r, in)
    return ffn


def _bi_reference(layer, expert):
    return _merged_lora_ffn(layer) if expert == "lora" else layer.ubmoe_copy["default"]


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma2"])
@pytest.mark.parametrize("expert", EXPERTS)
def test_top1_routes_each_token_to_one_expert(arch, expert):
    model, _ = wrap(arch, expert)
    perturb_adapters(model, std=0.1)
    layer = layers(model)[0]
    x = torch.randn(4, 16, 32)  # (B, T, C)
    with torch.no_grad():
        out = layer(x)  # (B, T, C)
        logits_ = layer.router_logits("default", x)  # (B, T, 2)
        to_bi = logits_[..., 1] > logits_[..., 0]  # (B, T)
        uni, bi = layer.base_layer(x), _bi_reference(layer, expert)(x)  # (B, T, C) each
    assert 0 < to_bi.sum() < to_bi.numel(), "the test needs both routes"
    # merged weights round differently from separate deltas: float32 tolerance
    torch.testing.assert_close(out[to_bi], bi[to_bi], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[~to_bi], uni[~to_bi], rtol=1e-6, atol=1e-6)
    assert (bi[to_bi] - uni[to_bi]).abs().max() > 1e-3  # routing to bi changed those tokens


@pytest.mark.parametrize("expert", EXPERTS)
def test_top2_mixes_both_experts(expert):
    model, _ = wrap("llama", expert, top_k=2)
    perturb_adapters(model, std=0.1)
    layer = layers(model)[0]
    x = torch.randn(2, 8, 32)  # (B, T, C)
    with torch.no_grad():
        p = layer.router_logits("default", x).softmax(-1)  # (B, T, 2)
        expected = p[..., :1] * layer.base_layer(x) + p[..., 1:] * _bi_reference(layer, expert)(x)  # (B, T, C)
        torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-5)
    ids, mask = batch()
    logits(model, ids, mask)
    stats = ubmoe_peft.routing_stats(model)
    assert set(stats) == {0, 1} and all(0.0 < s < 1.0 for s in stats.values())


@pytest.mark.parametrize("expert", EXPERTS)
def test_top1_runs_one_ffn_per_token(expert):
    model, _ = wrap("llama", expert)
    perturb_adapters(model)
    layer = layers(model)[0]
    seen = {"uni": 0, "bi": 0}

    def count(kind):
        return lambda module, args, output: seen.__setitem__(kind, seen[kind] + args[0].shape[:-1].numel())

    hooks = [layer.base_layer.gate_proj.register_forward_hook(count("uni"))]
    if expert == "copy":
        hooks.append(layer.ubmoe_copy["default"].register_forward_hook(count("bi")))
    x = torch.randn(3, 10, 32)  # (B, T, C)
    with torch.no_grad():
        logits_ = layer.router_logits("default", x)  # (B, T, 2)
        to_bi = logits_[..., 1] > logits_[..., 0]  # (B, T)
        n_bi = int(to_bi.sum())
        out = layer(x)  # (B, T, C)
        for h in hooks:
            h.remove()
        uni, bi = layer.base_layer(x), _bi_reference(layer, expert)(x)  # (B, T, C) each
    assert 0 < n_bi < 30
    if expert == "copy":  # each expert saw only its own tokens
        assert (seen["uni"], seen["bi"]) == (30 - n_bi, n_bi)
    else:  # the shared base projections ran once per token: the deltas ride on them, no second FFN pass
        assert seen["uni"] == 30
    # uni tokens get exactly the base FFN's output (a LoRA delta scaled by 0 adds exact zeros), bi tokens the expert's
    assert torch.equal(out[~to_bi], uni[~to_bi])
    torch.testing.assert_close(out[to_bi], bi[to_bi], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("expert", EXPERTS)
@pytest.mark.parametrize("stage", [None, "router"])
def test_host_and_device_routing_decide_alike(expert, stage, monkeypatch):
    """Top-1 decides on the host for small inputs (decode steps) and with tensor ops otherwise: same outputs, stats and
    router gradients, ties to uni included."""
    from ubmoe_peft.tuners.ubmoe import layer as layer_module

    model, _ = wrap("llama", expert)
    perturb_adapters(model)
    first = layers(model)[0].ubmoe_router["default"].weight
    with torch.no_grad():
        first[1] = first[0]  # layer 0: every token ties, so every token goes to uni on both paths
    if stage:
        ubmoe_peft.set_stage(model, stage)
    ids, mask = batch()
    results = []
    for limit in (0, 10**9):
        monkeypatch.setattr(layer_module, "HOST_ROUTING_TOKENS", limit)
        model.zero_grad()
        with torch.set_grad_enabled(stage is not None):
            out = model(input_ids=ids, attention_mask=mask).logits
        if stage:
            out.float().pow(2).mean().backward()
        grads = [layer.ubmoe_router["default"].weight.grad for layer in layers(model)] if stage else []
        results.append((out.detach(), ubmoe_peft.routing_stats(model), [g.clone() for g in grads]))
    (out_a, stats_a, grads_a), (out_b, stats_b, grads_b) = results
    assert torch.equal(out_a, out_b) and stats_a == stats_b and stats_a[0] == 0.0 and 0 < stats_a[1] < 1
    for g_a, g_b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(g_a, g_b, rtol=0, atol=0)


def test_lora_hooks_exist_only_during_a_routed_call():
    model, _ = wrap("llama", "lora")
    perturb_adapters(model)
    ffn = layers(model)[0].base_layer
    seen = []
    probe = ffn.gate_proj.register_forward_hook(lambda m, a, o: seen.append(len(m._forward_hooks)))
    ids, mask = batch()
    for mode in ("uni", "bi", "moe"):
        ubmoe_peft.set_mode(model, mode)
        logits(model, ids, mask)
    probe.remove()
    assert all(not m._forward_hooks for m in ffn.modules())  # nothing left behind: mode uni takes the fast call path
    assert seen and max(seen) == 2 and seen[0] == 1  # the probe alone in mode uni, probe + delta hook while routed


def test_router_hooks_see_every_routing_decision():
    """Routers are called as modules where someone listens (aux losses, monitoring), as plain math otherwise."""
    model, _ = wrap("llama", "lora")
    perturb_adapters(model)
    router = layers(model)[0].ubmoe_router["default"]
    seen = []
    handle = router.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    ids, mask = batch()
    logits(model, ids, mask)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    handle.remove()
    assert seen == [(3, 9, 2), (3, 9, 2), (3, 1, 2)]  # a forward, then generate's prefill and one decode step


GATED_MLP_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"]  # LlamaMLP's forward; phi3 fuses gate_up


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_out_gated_mlp_equals_the_hook_path(arch, dtype):
    """At inference the gated MLP runs written out, without temporary hooks: the hook path's outputs for an all-bi
    float scale and a per-row column, rows scaled by 0 bit-identical to the base FFN; other FFNs keep the hooks."""
    base = tiny_model(arch, dtype=dtype)
    model = get_peft_model(base, UBMoEConfig(expert_type="lora")).eval()
    perturb_adapters(model, std=0.1)
    layer = layers(model)[0]
    x = torch.randn(3, 5, 32, dtype=dtype)  # (B, T, C)
    scale = layer.scaling["default"]
    to_bi = torch.arange(15) % 3 == 0  # (N,)
    scales = [scale, to_bi.view(-1, 1) * scale]  # float; (N, 1) column
    with torch.no_grad():
        fast = [_gated_mlp_forward(layer.base_layer, x, lora(layer, s)) for s in scales]
        handle = layer.base_layer.register_forward_pre_hook(lambda module, args: None)  # any hook: the generic path
        hooked = [layer._lora_ffn("default", x, s) for s in scales]
        handle.remove()
        uni = layer.base_layer(x)  # (B, T, C)
    if arch not in GATED_MLP_ARCHS:
        assert fast == [None, None]
        return
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    for out, reference in zip(fast, hooked, strict=True):
        torch.testing.assert_close(out, reference, **tol)
    rows_uni = ~to_bi.view(3, 5)  # (B, T)
    assert torch.equal(fast[1][rows_uni], uni[rows_uni])
    assert (fast[0].float() - uni.float()).abs().max() > 1e-2  # the deltas were added


def lora(layer: UBMoELayer, scale: float | torch.Tensor, adapter: str = "default") -> tuple:
    return layer.ubmoe_lora_A[adapter], layer.ubmoe_lora_B[adapter], scale


def test_written_out_gated_mlp_with_a_subset_of_projections():
    model, _ = wrap("qwen2", "lora", ffn_projections=["up_proj"])
    perturb_adapters(model, std=0.1)
    layer = layers(model)[0]
    x = torch.randn(2, 4, 32)  # (B, T, C)
    with torch.no_grad():
        fast = _gated_mlp_forward(layer.base_layer, x, lora(layer, layer.scaling["default"]))  # (B, T, C)
        torch.testing.assert_close(fast, _merged_lora_ffn(layer)(x), rtol=1e-5, atol=1e-6)


def test_written_out_gated_mlp_is_taken_only_where_it_applies(monkeypatch):
    model, _ = wrap("llama", "lora", lora_dropout=0.1)
    perturb_adapters(model, std=0.1)
    layer = layers(model)[0]
    ffn = layer.base_layer
    x = torch.randn(2, 4, 32)  # (B, T, C)
    with torch.no_grad():
        assert _gated_mlp_forward(ffn, x) is not None
        ffn.up_proj.forward = ffn.up_proj.forward  # a replaced forward, as accelerate's offloading hooks install
        assert _gated_mlp_forward(ffn, x) is None
        del ffn.up_proj.forward
        handle = ffn.act_fn.register_forward_hook(lambda module, args, out: None)
        assert _gated_mlp_forward(ffn, x) is None
        handle.remove()
        handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)  # global
        assert _gated_mlp_forward(ffn, x) is None
        handle.remove()
        down = ffn.down_proj
        ffn.down_proj = torch.nn.Sequential(down)  # no longer a plain linear
        assert _gated_mlp_forward(ffn, x) is None
        ffn.down_proj = down
        assert _gated_mlp_forward(ffn, x.transpose(0, 1)) is None  # strided input: a biased nn.Linear rounds otherwise
        ffn.up_proj.compile()  # compiled in place (lazily: nothing compiles unless it is called)
        assert _gated_mlp_forward(ffn, x) is None
        ffn.up_proj._compiled_call_impl = None
    taken = []
    original = layer_module._gated_mlp_forward

    def record(ffn, x, lora=None):  # "deltas" or "plain" per written-out run
        taken.append("plain" if lora is None else "deltas")
        return original(ffn, x, lora)

    monkeypatch.setattr(layer_module, "_gated_mlp_forward", record)
    with torch.no_grad():
        layer._bi_expert("default", x)
        layer._uni_expert(x)
        assert taken == ["deltas", "plain"]  # eval, no graph: the deltas inline, then the original FFN
        model.train()
        layer._bi_expert("default", x)  # active dropout: the hook path applies it
        layer._uni_expert(x)  # no dropout on the original FFN
        assert taken == ["deltas", "plain", "plain"]
    ubmoe_peft.set_mode(model, "bi")
    layer(x).sum().backward()  # training records a graph: the module and hook paths, never the written-out one
    assert taken == ["deltas", "plain", "plain"]


@pytest.mark.parametrize("arch", GATED_MLP_ARCHS)
@pytest.mark.parametrize("expert", EXPERTS)
def test_written_out_experts_at_inference_are_bit_identical(arch, expert, monkeypatch):
    """Top-1 at inference runs the original FFN (tokens routed to uni) and a copy expert written out: bit-identical
    to calling the modules on the same rows, whether every token goes to one expert or the router splits them."""
    base = tiny_model(arch)
    model = get_peft_model(base, UBMoEConfig(expert_type=expert)).eval()
    perturb_adapters(model, std=0.1)
    layer = layers(model)[0]
    x = torch.randn(2, 3, 32)  # (B, T, C)
    router = layer.ubmoe_router["default"].weight  # (2, C)
    taken = []  # written-out FFN runs per layer call (the general path's and the planned path's, decode.py)
    original = lora_module._gated_mlp_math
    monkeypatch.setattr(lora_module, "_gated_mlp_math", lambda *args: taken.append(1) or original(*args))
    with torch.no_grad():
        direction = router[1] - router[0]  # (C,)
        signs = torch.sign(x @ direction)  # (B, T), routed to bi where positive
        expert_ffn = layer.ubmoe_copy["default"] if expert == "copy" else _merged_lora_ffn(layer)
        for route in (-1.0, 1.0, None):  # all to uni, all to bi, as the router says (mixed)
            inputs = x * (signs * route).unsqueeze(-1) if route is not None else x  # (B, T, C)
            to_bi = inputs @ direction > 0  # (B, T)
            taken.clear()
            out = layer(inputs)  # (B, T, C)
            assert len(taken) == (2 if route is None and expert == "copy" else 1)  # never the modules
            if route is None:
                assert 0 < int(to_bi.sum()) < to_bi.numel()
                if expert == "lora":  # one FFN pass over every row, the deltas scaled by 0 on the uni rows
                    assert torch.equal(out[~to_bi], layer.base_layer(inputs)[~to_bi])
                    continue
                flat, rows = inputs.reshape(-1, 32), to_bi.reshape(-1)  # (N, C), (N,)
                for ffn, picked in ((layer.base_layer, ~rows), (expert_ffn, rows)):  # each FFN on its own rows
                    assert torch.equal(out.reshape(-1, 32)[picked], ffn(flat[picked].unsqueeze(0)).squeeze(0))
            elif route < 0 or expert == "copy":
                assert torch.equal(out, (expert_ffn if route > 0 else layer.base_layer)(inputs))
            else:
                torch.testing.assert_close(out, expert_ffn(inputs), rtol=1e-5, atol=1e-6)


def test_lora_expert_splits_mixed_prefill_routing_onto_merged_weights(monkeypatch):
    """At inference, when a call routes enough tokens to the LoRA expert for merged weights to pay (`_merge_pays`: 22
    for this 32 -> 64 FFN), each expert runs on its own rows: the routed rows on merged weights, bit-identical to the
    merged FFN on those rows, and the others bit-identical to the base FFN on those rows. With fewer routed tokens
    the call keeps the per-token scale column, whose uni rows are the base FFN's on the whole batch."""
    model = get_peft_model(tiny_model("llama"), UBMoEConfig()).eval()
    perturb_adapters(model, std=0.1)
    layer = layers(model)[0]
    router = layer.ubmoe_router["default"].weight  # (2, C)
    merged = _merged_lora_ffn(layer)
    with torch.no_grad():
        weights = layer.bi_weights("default")
        for name, proj in ((n, merged.get_submodule(n)) for n in weights):
            proj.weight.copy_(weights[name])  # merged_weight's bits, as the split computes them
        x = torch.randn(4, 20, 32)  # (B, T, C): 80 rows, more than host routing takes (decode sizes)
        to_bi = (x @ (router[1] - router[0]) > 0).reshape(-1)  # (N,)
        assert 22 <= int(to_bi.sum()) < to_bi.numel()
        splits = []
        original = layer_module.UBMoELayer._split
        monkeypatch.setattr(layer_module.UBMoELayer, "_split", lambda *args: splits.append(1) or original(*args))
        out = layer(x).reshape(-1, 32)  # (N, C)
        assert splits == [1]
        flat = x.reshape(-1, 32)  # (N, C)
        assert torch.equal(out[to_bi], merged(flat[to_bi].unsqueeze(0)).squeeze(0))
        assert torch.equal(out[~to_bi], layer.base_layer(flat[~to_bi].unsqueeze(0)).squeeze(0))
        few = torch.cat([flat[to_bi][:10], flat[~to_bi]]).view(1, -1, 32)  # (1, N', C): 10 rows routed to bi
        out = layer(few)
        assert splits == [1]  # the scale column
        rows = torch.arange(few.shape[1]) >= 10  # (N',), the uni rows
        assert torch.equal(out[0, rows], layer.base_layer(few)[0, rows])


def _planned_and_general(layer: UBMoELayer, x: torch.Tensor, monkeypatch) -> tuple:
    """The layer's output at inference through its decode plan (when it applies) and through the general path."""
    with torch.no_grad():
        planned = layer(x)
        with monkeypatch.context() as patch:
            patch.setattr(layer_module, "planned_moe", lambda *args: None)
            general = layer(x)
    return planned, general


class _Doubled(torch.nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


@pytest.mark.parametrize("expert", EXPERTS)
def test_the_decode_plan_follows_every_change_to_the_layer(expert, monkeypatch):
    """Decode steps run through a plan made once per layer and adapter (decode.py). Whatever changes after it is made
    - weights in place or replaced, a module swapped, hooked, parametrized or given another forward, the mode,
    the adapter, an adapter made again under the same name - the layer computes what the general path computes,
    bit for bit, and the plan is used wherever nothing forbids it."""
    from ubmoe_peft.tuners.ubmoe.decode import planned_moe

    model, _ = wrap("llama", expert, lora_dropout=0.1)
    perturb_adapters(model, std=0.2)
    layer = layers(model)[0]
    ffn = layer.base_layer
    x = torch.randn(4, 1, 32)  # (B, 1, C): a decode step of four sequences
    outputs = []

    def check(planned_applies: bool = True, changed: bool = True) -> None:
        with torch.no_grad():
            assert (planned_moe(layer, x) is not None) == planned_applies
        planned, general = _planned_and_general(layer, x, monkeypatch)
        assert torch.equal(planned, general)
        assert changed != any(torch.equal(planned, earlier) for earlier in outputs)  # the change changed the output
        outputs.append(planned)

    check()
    shares = ubmoe_peft.routing_stats(model)[0]
    assert 0 < shares < 1  # the tokens go to both experts
    with torch.no_grad():
        expert_weight = next(iter(layer.expert_parameters("default")))
        expert_weight.mul_(1.5)  # in place
    check()
    ffn.gate_proj.weight = torch.nn.Parameter(ffn.gate_proj.weight * 0.5)  # a new parameter object
    check()
    ffn.up_proj = torch.nn.Linear(32, ffn.up_proj.out_features, bias=False)  # a new module
    check()
    handle = ffn.down_proj.register_forward_hook(lambda module, args, out: out * 3)
    check(planned_applies=False)
    handle.remove()
    ffn.act_fn.forward = torch.relu  # a forward replaced on the instance
    check(planned_applies=False)
    del ffn.act_fn.forward
    torch.nn.utils.parametrize.register_parametrization(ffn.gate_proj, "weight", _Doubled())
    check(planned_applies=False)
    torch.nn.utils.parametrize.remove_parametrizations(ffn.gate_proj, "weight")  # the weight stays doubled
    check(changed=False)
    with ubmoe_peft.use_mode(model, "uni"):
        check(planned_applies=False)
    with model.disable_adapter():
        planned, general = _planned_and_general(layer, x, monkeypatch)
        assert torch.equal(planned, general) and torch.equal(planned, outputs[-1])
    model.add_adapter("other", UBMoEConfig(expert_type=expert))
    model.set_adapter("other")
    perturb_adapters(model, std=0.3, seed=2)
    model.eval()
    check()
    model.delete_adapter("other")
    model.add_adapter("other", UBMoEConfig(expert_type=expert, r=4))  # the same name again: new weights and shapes
    model.set_adapter("other")
    perturb_adapters(model, std=0.3, seed=3)
    model.eval()
    check()
    model.double()
    x = x.double()
    check()
    if expert == "lora":
        model.train()  # the LoRA dropout of a trainable expert applies (also without a graph): the hook path
        with torch.no_grad():
            assert planned_moe(layer, x) is None
        layer.requires_grad_(False)  # a frozen expert runs without dropout, as at inference
        with torch.no_grad():
            assert planned_moe(layer, x) is not None


@pytest.mark.parametrize("tokens", [9, 80])  # decided on the host (<= 64 tokens), on the device
@pytest.mark.parametrize("grad", [False, True])
def test_mixed_top1_lora_in_a_model_cast_to_bf16_and_under_a_float64_default(tokens, grad):
    """The per-token scale column takes the LoRA weights' dtype: a model cast whole to bf16 (bf16 LoRA weights) and
    torch.set_default_dtype(torch.float64) both route mixed batches, and the latter exactly as under float32."""
    model, _ = wrap("llama", "lora")
    perturb_adapters(model, std=0.3)
    ids = torch.randint(3, 100, (2, tokens), generator=torch.Generator().manual_seed(0))  # (B, T)
    cast = copy.deepcopy(model).to(torch.bfloat16)
    with torch.set_grad_enabled(grad):
        expected = model(input_ids=ids).logits  # (B, T, V)
        shares = ubmoe_peft.routing_stats(model)
        assert any(0.0 < share < 1.0 for share in shares.values()), shares  # mixed batches
        torch.testing.assert_close(cast(input_ids=ids).logits.float(), expected, rtol=0.05, atol=0.05)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            assert torch.equal(model(input_ids=ids).logits, expected)
        finally:
            torch.set_default_dtype(default)


@pytest.mark.parametrize("expert", EXPERTS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_router_gets_gradient(expert, top_k):
    model, _ = wrap("llama", expert, top_k=top_k)
    perturb_adapters(model, std=0.05)
    ubmoe_peft.set_stage(model, "router")
    ids, mask = batch()
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    for layer in layers(model):
        grad = layer.ubmoe_router["default"].weight.grad
        assert grad is not None and grad.abs().sum() > 0


def test_top1_gate_is_exactly_one_and_ties_go_to_uni():
    model, _ = wrap("llama", "lora")
    layer = layers(model)[0]
    with torch.no_grad():
        layer.ubmoe_lora_B["default"]["down_proj"].weight.normal_()
    x = torch.randn(2, 5, 32)  # (B, T, C)
    with torch.no_grad():
        assert torch.equal(layer(x), layer.base_layer(x))  # zero router: every logit ties -> uni
    layer.train(False)
    out = layer(x)  # with grad: the straight-through gate multiplies by p / p.detach() == 1
    assert torch.equal(out.detach(), layer.base_layer(x).detach())


@pytest.mark.parametrize("expert", EXPERTS)
def test_compare_router_gradient_is_the_two_experts_difference(expert):
    """router_gradient="compare" (default): the chosen expert's output, and d loss / d logit_bi =
    p_bi p_uni <d loss / d y, E_bi(x) - E_uni(x)> per token; "scale" gets the selected expert's p / sg(p) gate."""
    model, _ = wrap("llama", expert)
    perturb_adapters(model, std=0.1)
    ubmoe_peft.set_stage(model, "router")
    layer = layers(model)[0].eval()
    x = torch.randn(2, 5, 32)  # (B, T, C)
    g = torch.randn(2, 5, 32)  # d loss / d y
    with torch.no_grad():
        uni, bi = layer._uni_expert(x), layer._bi_expert("default", x)  # (B, T, C) each
        expected_out = layer(x)  # inference: top-1, only the chosen expert
    router = layer.ubmoe_router["default"].weight
    logits = (x @ router.detach().T).detach()  # (B, T, 2)
    assert bool((logits[..., 1] > logits[..., 0]).any()) and bool((logits[..., 1] < logits[..., 0]).any())
    out = layer(x)
    torch.testing.assert_close(out.detach(), expected_out, rtol=1e-6, atol=1e-6)  # the value is top-1's
    (out * g).sum().backward()
    p = logits.softmax(-1)  # (B, T, 2)
    d_bi = p[..., 0] * p[..., 1] * (g * (bi - uni)).sum(-1)  # (B, T)
    d_logits = torch.stack([-d_bi, d_bi], dim=-1)  # (B, T, 2)
    expected = torch.einsum("btk,btc->kc", d_logits, x)  # (2, C)
    torch.testing.assert_close(router.grad, expected, rtol=1e-4, atol=1e-6)

    scaled, _ = wrap("llama", expert, router_gradient="scale")
    perturb_adapters(scaled, std=0.1)
    ubmoe_peft.set_stage(scaled, "router")
    layer = layers(scaled)[0].eval()
    out = layer(x)
    (out * g).sum().backward()
    router = layer.ubmoe_router["default"].weight
    p = (x @ router.detach().T).softmax(-1)  # (B, T, 2)
    to_bi = p[..., 1] > p[..., 0]  # (B, T)
    p_sel = torch.where(to_bi, p[..., 1], p[..., 0])  # (B, T)
    d_sel = (g * out.detach()).sum(-1) / p_sel  # (B, T): d loss / d p_sel through the gate p_sel / sg(p_sel)
    d_bi = torch.where(to_bi, d_sel * p[..., 1] * p[..., 0], -d_sel * p[..., 0] * p[..., 1])  # (B, T)
    expected = torch.einsum("btk,btc->kc", torch.stack([-d_bi, d_bi], dim=-1), x)  # (2, C)
    torch.testing.assert_close(router.grad, expected, rtol=1e-4, atol=1e-6)


def test_compare_router_gradient_is_zero_while_the_experts_are_equal():
    """A fresh bi expert equals the base FFN: there is nothing to compare, and the router stays at zero."""
    model, _ = wrap("llama", "lora")
    ubmoe_peft.set_stage(model, "router")
    ids, mask = batch()
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert all(float(layer.ubmoe_router["default"].weight.grad.abs().sum()) == 0 for layer in layers(model))


def test_compare_router_gradient_ignores_a_non_finite_expert_not_chosen():
    """An fp16 bi expert overflowing to inf where every token went to the uni expert: the straight-through term
    0 * (inf - uni) made the training loss NaN, while inference gave the base model's loss."""
    model = get_peft_model(tiny_model("llama").to(torch.float16), UBMoEConfig(expert_type="copy"))
    for layer in layers(model):
        copy = layer.ubmoe_copy["default"]
        copy.up_proj.weight.data.fill_(100.0)
        copy.down_proj.weight.data.fill_(60000.0)  # finite weights, outputs beyond fp16's range
    ubmoe_peft.set_stage(model, "router")  # zero routers: every token to the uni expert
    ids, mask = batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    with ubmoe_peft.use_mode(model, "uni"):
        expected = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    assert torch.equal(loss, expected) and not expected.isnan()
    with ubmoe_peft.use_mode(model, "bi"):
        assert model(input_ids=ids, attention_mask=mask).logits.isnan().all()  # the bi expert overflows
    loss.backward()
    assert all(bool(layer.ubmoe_router["default"].weight.grad.isfinite().all()) for layer in layers(model))


# ---- stages and training ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("expert", EXPERTS)
@pytest.mark.parametrize("stage", ["contrastive", "router"])
def test_set_stage_trains_exactly_the_named_parameters(expert, stage):
    model, _ = wrap("llama", expert)
    perturb_adapters(model, std=0.05)
    ubmoe_peft.set_stage(model, stage)
    assert ubmoe_peft.get_mode(model) == ("bi" if stage == "contrastive" else "moe")
    expected = ("ubmoe_lora_", "ubmoe_copy") if stage == "contrastive" else ("ubmoe_router",)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(any(e in n for e in expected) for n in trainable)
    assert trainable == {n for n, _ in model.named_parameters() if any(e in n for e in expected)}

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model.train()
    ids, mask = batch()
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    optimizer.step()
    for name, param in model.named_parameters():
        moved = not torch.equal(before[name], param.detach())
        assert moved == (name in trainable), name


def test_lora_dropout_applies_only_while_the_lora_expert_trains():
    """Stage contrastive trains the LoRA weights with dropout on their input; stage router freezes them, and the
    frozen expert then runs as at inference (like a copy expert), also in train mode, with the router's gradient."""
    model, _ = wrap("llama", "lora", lora_dropout=0.5)
    perturb_adapters(model, std=0.3)
    ids, mask = batch()

    def run() -> torch.Tensor:
        return model(input_ids=ids, attention_mask=mask).logits

    ubmoe_peft.set_stage(model, "contrastive")
    model.train()
    assert not torch.equal(run(), run())  # dropout draws differ
    ubmoe_peft.set_stage(model, "router")
    with torch.no_grad():
        for layer in layers(model):
            layer.ubmoe_router["default"].weight[1].fill_(0.05)  # send some tokens to the bi expert
    model.train()
    first = run()
    first.square().mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "ubmoe_router" in n)
    torch.testing.assert_close(run(), first, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=ids, attention_mask=mask).logits, first, rtol=1e-6, atol=1e-6)
    assert 0 < sum(ubmoe_peft.routing_stats(model).values()) < len(layers(model))  # both experts ran


def test_use_mode_restores_previous_mode():
    model, _ = wrap()
    ubmoe_peft.set_mode(model, "uni")
    with ubmoe_peft.use_mode(model, "bi"):
        assert ubmoe_peft.get_mode(model) == "bi"
    assert ubmoe_peft.get_mode(model) == "uni"
    with pytest.raises(ValueError, match="Unknown mode 'sideways'"):
        ubmoe_peft.set_mode(model, "sideways")
    with pytest.raises(ValueError, match=r"Unknown mode \['bi'\]"):  # not a bare TypeError (unhashable)
        ubmoe_peft.set_mode(model, ["bi"])
    with pytest.raises(ValueError, match=r"Unknown stage \['router'\]"):
        ubmoe_peft.set_stage(model, ["router"])
    with pytest.raises(ValueError, match="Unknown mode 'BI'"):  # checked at the call: without `with` it passed
        ubmoe_peft.use_mode(model, "BI")


def test_mode_functions_name_an_export_as_a_model_without_modes():
    """The advice "Wrap it first" was refused for exports: a bi merge is not causal, an MoE export has MoE blocks."""
    model, _ = wrap()
    perturb_adapters(model)
    for target, kind in (("bi", "is_causal=False"), ("moe", "a mixture-of-experts model")):
        exported = copy.deepcopy(model).merge_and_unload(target=target)
        with pytest.raises(ValueError, match=rf"no UBMoE layers and modes: .*{kind}.*PeftModel.from_pretrained"):
            ubmoe_peft.set_mode(exported, "bi")


def test_a_target_modules_entry_that_selects_nothing_beside_one_that_does_is_named():
    """A typo beside a matching entry was silent (a list naming nothing at all is refused)."""
    with pytest.warns(UserWarning, match=r"\['feed_fwd'\] select no FFN of this model .*children") as w:
        get_peft_model(tiny_model("llama"), UBMoEConfig(target_modules=["mlp", "feed_fwd"]))
    assert w[0].filename == __file__
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*select no FFN")
        get_peft_model(tiny_model("llama"), UBMoEConfig(target_modules=["mlp"]))


def test_set_stage_warns_where_it_makes_float16_weights_trainable():
    """The trainers refuse float16 weights (AdamW's update underflows to NaN); any other training loop after
    set_stage turned an fp16 copy expert NaN in one step, without a word."""
    model = get_peft_model(tiny_model("llama").to(torch.float16), UBMoEConfig(expert_type="copy"))
    with pytest.warns(UserWarning, match=r"set_stage\('contrastive'\) makes \d+ float16 parameters trainable") as w:
        ubmoe_peft.set_stage(model, "contrastive")
    assert w[0].filename == __file__
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*float16 parameters")
        ubmoe_peft.set_stage(model, "router")  # fp32 routers
        ubmoe_peft.set_stage(get_peft_model(tiny_model("llama").to(torch.float16), UBMoEConfig()), "contrastive")


def test_autocast_adapter_dtype_false_keeps_lora_weights_in_the_base_dtype(tmp_path):
    """PEFT's ``autocast_adapter_dtype=False`` (adapter weights in the base's bf16) was ignored: LoRA stayed fp32."""
    base = tiny_model("llama", dtype=torch.bfloat16)
    model = get_peft_model(base, UBMoEConfig(attention_r=4), autocast_adapter_dtype=False).eval()
    lora = {n: p for n, p in model.named_parameters() if "ubmoe_lora" in n or "ubmoe_attn" in n}
    assert lora and {p.dtype for p in lora.values()} == {torch.bfloat16}
    assert all(p.stride(0) == 1 for n, p in lora.items() if "_B." in n)  # B stays column-major
    perturb_adapters(model, std=0.1)
    ids, mask = batch(padding="left")
    real = mask.bool()
    reference = get_peft_model(tiny_model("llama", dtype=torch.bfloat16), UBMoEConfig(attention_r=4)).eval()
    reference.load_state_dict(model.state_dict())  # the same weights, LoRA in fp32
    for mode in ("bi", "moe"):
        with ubmoe_peft.use_mode(model, mode), ubmoe_peft.use_mode(reference, mode):
            ours, theirs = hidden(model, ids, mask)[real].float(), hidden(reference, ids, mask)[real].float()
            assert (ours - theirs).norm() / theirs.norm() < 5e-2, mode  # bf16 rounding (the adapters move it by > 1)
    model.save_pretrained(tmp_path)
    fresh = tiny_model("llama", dtype=torch.bfloat16)
    loaded = PeftModel.from_pretrained(fresh, tmp_path, autocast_adapter_dtype=False)
    assert {p.dtype for n, p in loaded.named_parameters() if "ubmoe_lora" in n} == {torch.bfloat16}
    ubmoe_peft.set_mode(loaded, "bi")
    ubmoe_peft.set_mode(model, "bi")
    assert torch.equal(hidden(loaded.eval(), ids, mask), hidden(model, ids, mask))
    ubmoe_peft.set_stage(model, "contrastive")
    hidden_states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    hidden_states[real].float().pow(2).mean().backward()
    grads = [p.grad for p in lora.values() if p.requires_grad]
    assert grads and all(g is not None and g.dtype == torch.bfloat16 and g.isfinite().all() for g in grads)


def _enter_use_mode(model, mode):
    with ubmoe_peft.use_mode(model, mode):
        pass


@pytest.mark.parametrize("call", ["set_mode", "get_mode", "set_stage", "routing_stats", "use_mode"])
def test_mode_functions_name_a_model_that_is_not_a_ubmoe_model(call):
    args = {"set_mode": ("bi",), "set_stage": ("router",), "use_mode": ("bi",)}.get(call, ())
    function = _enter_use_mode if call == "use_mode" else getattr(ubmoe_peft, call)
    with pytest.raises(TypeError, match="model must be a UBMoE model .*got NoneType 'None'.*get_peft_model"):
        function(None, *args)  # was a bare AttributeError: 'NoneType' has no attribute 'modules'
    with pytest.raises(ValueError, match="LlamaForCausalLM has no UBMoE layers. Wrap it first"):
        function(tiny_model(), *args)


# ---- save / load --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
@pytest.mark.parametrize("expert", EXPERTS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_save_load_reproduces_all_modes(tmp_path, arch, expert, top_k):
    model, _ = wrap(arch, expert, top_k=top_k)
    perturb_adapters(model, std=0.2)
    ids, mask = batch()
    expected = {}
    for mode in MODES:
        ubmoe_peft.set_mode(model, mode)
        expected[mode] = logits(model, ids, mask)
    model.save_pretrained(tmp_path)

    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert saved and all(".ubmoe_" in k for k in saved)
    assert all(".default" not in k for k in saved)
    assert any("ubmoe_router" in k for k in saved)

    loaded = PeftModel.from_pretrained(tiny_model(arch), tmp_path, adapter_name="renamed").eval()
    assert ubmoe_peft.get_mode(loaded) == "moe"
    for mode in MODES:
        ubmoe_peft.set_mode(loaded, mode)
        assert torch.equal(logits(loaded, ids, mask), expected[mode]), mode


@pytest.mark.parametrize("expert_type", EXPERTS)
def test_low_cpu_mem_usage_loads_each_tensor_in_its_parameters_dtype(tmp_path, expert_type):
    """PEFT assigns the file's tensors there instead of copying them in: an adapter saved from a bf16 model kept bf16
    routers and LoRA weights (other routing, silently), and a bf16 copy expert failed on a float32 base."""
    model = get_peft_model(tiny_model("llama"), UBMoEConfig(expert_type=expert_type)).eval()
    perturb_adapters(model, std=0.2)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    ids, mask = batch()
    loads = [PeftModel.from_pretrained(tiny_model("llama"), tmp_path, low_cpu_mem_usage=low).eval() for low in (0, 1)]
    dtypes = [{n: p.dtype for n, p in m.named_parameters()} for m in loads]
    assert dtypes[1] == dtypes[0] and dtypes[0][next(n for n in dtypes[0] if "ubmoe_router" in n)] == torch.float32
    torch.testing.assert_close(logits(loads[1], ids, mask), logits(loads[0], ids, mask), rtol=0, atol=0)


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True])
def test_lora_b_is_stored_column_major_through_load_cast_and_copy(tmp_path, low_cpu_mem_usage):
    """LoRA B weights (C_out, r) keep B^T contiguous (the fast layout, `column_major`) whether built, loaded by copy
    or by assignment, cast or deep-copied; the saved file holds the same values, contiguous."""

    def b_weights(model):
        return {n: p for n, p in model.named_parameters() if "ubmoe_lora_B" in n or "ubmoe_attn_B" in n}

    def column_major(weights):
        return all(w.t().is_contiguous() and not w.is_contiguous() for w in weights.values())

    model, _ = wrap("llama", "lora", attention_r=4)
    perturb_adapters(model, std=0.2)
    assert len(b_weights(model)) == 2 * (3 + 4) and column_major(b_weights(model))  # 2 layers x (FFN + attention)
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path, low_cpu_mem_usage=low_cpu_mem_usage)
    assert column_major(b_weights(loaded))
    for (name, saved), (_, restored) in zip(b_weights(model).items(), b_weights(loaded).items(), strict=True):
        assert torch.equal(saved, restored), name
    assert column_major(b_weights(copy.deepcopy(loaded))) and column_major(b_weights(loaded.to(torch.bfloat16)))


@pytest.mark.parametrize("saved_in", ["bi", "moe"])
def test_loading_onto_the_base_that_was_wrapped_gives_a_working_model(saved_in, tmp_path):
    """MISSION's ``model.save_pretrained(d); PeftModel.from_pretrained(base, d)`` reuses ``base``, which
    get_peft_model changed in place. The reused layers followed the first model's mode (set_mode on the new model
    did not reach them: its mode uni was not the base model) and its hooks stayed on the backbone."""
    base = tiny_model("llama")
    reference = copy.deepcopy(base)
    model = get_peft_model(base, UBMoEConfig(attention_r=4)).eval()
    perturb_adapters(model)
    ids, mask = batch(padding="left")
    expected = logits_per_mode(model, ids, mask)
    ubmoe_peft.set_mode(model, saved_in)
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = PeftModel.from_pretrained(base, tmp_path).eval()
    assert not [w for w in caught if "peft_config" in str(w.message)]  # PEFT's "multiple adapters" does not apply
    assert ubmoe_peft.get_mode(loaded) == "moe"
    torch.testing.assert_close(logits(loaded, ids, mask), expected["moe"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits_per_mode(loaded, ids, mask), expected, rtol=1e-5, atol=1e-5)
    with ubmoe_peft.use_mode(loaded, "uni"):
        torch.testing.assert_close(logits(loaded, ids, mask), logits(reference, ids, mask), rtol=0, atol=0)
    for use_old in (lambda: ubmoe_peft.set_mode(model, "uni"), lambda: model(ids), lambda: model.generate(ids)):
        with pytest.raises(ValueError, match="base was wrapped again .*Use the model that call returned"):
            use_old()  # the old model would run in the new one's mode


@pytest.mark.parametrize(
    ("first", "saved"),
    [
        (dict(expert_type="lora"), dict(expert_type="copy")),
        (dict(expert_type="copy"), dict(expert_type="lora", attention_r=4)),
        (dict(attention_r=4), dict()),
        (dict(), dict(layers_to_transform=[1])),
        (dict(modules_to_save=["lm_head"]), dict()),  # the first's head copy stayed: PEFT sought it in the file
    ],
)
def test_loading_an_adapter_of_other_settings_onto_the_wrapped_base_replaces_the_first(first, saved, tmp_path):
    """The earlier wrap's same-named adapter was left in the layers beside the loaded one (a LoRA expert beside a copy,
    an attention adapter, a layer the saved adapter does not cover), so the load failed blaming the file and left
    the base holding both."""
    source = get_peft_model(tiny_model("llama"), UBMoEConfig(**saved)).eval()
    perturb_adapters(source)
    source.save_pretrained(tmp_path)
    ids, mask = batch(padding="left")
    expected = logits_per_mode(source, ids, mask)
    base = tiny_model("llama")
    perturb_adapters(get_peft_model(base, UBMoEConfig(**first)), seed=2)
    loaded = PeftModel.from_pretrained(base, tmp_path).eval()
    assert sorted(n for n, _ in loaded.named_parameters() if ".ubmoe_" in n) == sorted(
        n for n, _ in source.named_parameters() if ".ubmoe_" in n
    )
    torch.testing.assert_close(logits_per_mode(loaded, ids, mask), expected, rtol=1e-5, atol=1e-5)


def perturb_copies(model, seed=3):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".modules_to_save." in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.5)


@pytest.mark.parametrize("name", ["default", "other"])
def test_a_head_copy_loaded_or_added_onto_the_wrapped_base_runs_and_trains(name, tmp_path):
    """The README's ``PeftModel.from_pretrained(base, d)`` on the base of a model with a modules_to_save copy: the
    loaded copy sat in the wrapper switched off (PEFT keeps a wrapper's active adapter when it adds a copy, and the
    earlier model's was deleted), so every mode ran the original head; a second get_peft_model's copy had no grad."""
    config = UBMoEConfig(modules_to_save=["lm_head"])
    source = get_peft_model(tiny_model("llama"), copy.deepcopy(config)).eval()
    perturb_adapters(source)
    perturb_copies(source)
    source.save_pretrained(tmp_path)
    ids, mask = batch(padding="left")
    expected = logits_per_mode(source, ids, mask)
    base = tiny_model("llama")
    get_peft_model(base, copy.deepcopy(config))
    loaded = PeftModel.from_pretrained(base, tmp_path, adapter_name=name).eval()
    torch.testing.assert_close(logits_per_mode(loaded, ids, mask), expected, rtol=1e-5, atol=1e-5)
    base = tiny_model("llama")
    get_peft_model(base, copy.deepcopy(config), adapter_name=name)
    again = get_peft_model(base, copy.deepcopy(config), adapter_name=name)
    again(ids, attention_mask=mask).logits.sum().backward()
    head = again.base_model.model.lm_head
    assert head.active_adapters == [name] and head.modules_to_save[name].weight.grad is not None


def test_deleting_the_active_adapter_runs_the_next_ones_head_copy():
    """The next active adapter's copy stayed switched off where the deleted adapter had none (PEFT's LoRA too)."""
    model = get_peft_model(tiny_model("llama"), UBMoEConfig(), adapter_name="a")
    model.add_adapter("b", UBMoEConfig(modules_to_save=["lm_head"]))
    perturb_adapters(model)
    perturb_copies(model)
    model.eval()
    ids, mask = batch(padding="left")
    model.set_adapter("b")
    expected = logits_per_mode(model, ids, mask)
    model.set_adapter("a")
    model.delete_adapter("a")
    assert model.active_adapters == ["b"]
    torch.testing.assert_close(logits_per_mode(model, ids, mask), expected, rtol=0, atol=0)
    # its copy trains as its experts do, as PEFT's delete path leaves the next adapter (also one loaded frozen)
    b = model.base_model.model.lm_head.modules_to_save["b"].weight
    assert b.requires_grad and all(p.requires_grad for n, p in model.named_parameters() if "ubmoe_lora_A.b" in n)


def test_a_mixed_adapter_batch_is_refused():
    """PEFT's ``adapter_names=`` (one adapter per row) was dropped by PeftModel: every row ran the active adapter."""
    for task_type in (None, "CAUSAL_LM"):
        model = get_peft_model(tiny_model("llama"), UBMoEConfig(task_type=task_type))
        with pytest.raises(ValueError, match=r"adapter_names=\['default', 'other'\].*one adapter per forward"):
            model(torch.tensor([[5, 6], [7, 8]]), adapter_names=["default", "other"])


def test_a_kv_cache_continues_only_in_the_mode_that_filled_it():
    """A cache filled in mode uni and continued in mode moe (or the other way round) mixed two models' states."""
    model, _ = wrap()
    perturb_adapters(model, std=0.2)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        for first, then in [("uni", "moe"), ("moe", "uni")]:
            with ubmoe_peft.use_mode(model, first):
                cache = model(input_ids=ids[:, :5], use_cache=True).past_key_values
            with ubmoe_peft.use_mode(model, then), pytest.raises(RuntimeError, match=f"filled in mode '{first}'"):
                model(input_ids=ids[:, 5:], past_key_values=cache)
        with model.disable_adapter():
            cache = model(input_ids=ids[:, :5], use_cache=True).past_key_values
        with pytest.raises(RuntimeError, match="filled in mode 'adapters disabled'"):
            model(input_ids=ids[:, 5:], past_key_values=cache)
        cache = model(input_ids=ids[:, :5], use_cache=True).past_key_values  # mode moe, continued in it: fine
        step = model(input_ids=ids[:, 5:], past_key_values=cache).logits[:, -1]
    torch.testing.assert_close(step, logits(model, ids, torch.ones_like(ids))[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_static_cache_routes_and_counts_as_a_dynamic_one_and_is_reusable_after_reset(arch):
    """A static cache's 4D mask spans all its slots: routing_stats and track_routing read empty slots as the current
    tokens (a share of 0 at every decode step). And a cache emptied by `reset()` (transformers' way to reuse one)
    was refused in another mode as if it still held the first mode's states. Gemma 2 mixes sliding and full layers:
    generate then passes one mask per layer type, and the padding was counted as real tokens."""
    from transformers import StaticCache

    model, _ = wrap(arch)
    perturb_adapters(model, std=0.5)
    ids, mask = batch(b=3, t=9)
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    results = []
    for cache in (None, StaticCache(config=model.config, max_cache_len=64)):
        with torch.no_grad(), ubmoe_peft.track_routing(model) as tally:
            tokens = model.generate(**settings, pad_token_id=0, **({"cache": cache} if cache is not None else {}))
        results.append((tokens, tally.shares(), ubmoe_peft.routing_stats(model)))
    (tokens, shares, last), (static_tokens, static_shares, static_last) = results
    assert torch.equal(static_tokens, tokens)
    assert 0 < min(shares.values()) and static_shares == pytest.approx(shares) and static_last == pytest.approx(last)
    cache = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        with ubmoe_peft.use_mode(model, "uni"):
            model.generate(**settings, pad_token_id=0, cache=cache)
        cache.reset()
        again = model.generate(**settings, pad_token_id=0, cache=cache)  # mode moe, on the emptied cache
    assert torch.equal(again, tokens)


def test_a_static_cache_counts_routing_over_real_tokens_when_every_layer_slides():
    """generate then passes one mask per layer type with no full-attention one; the padding was counted."""
    from conftest import _COMMON
    from transformers import Qwen3Config, StaticCache

    config = Qwen3Config(**_COMMON, head_dim=8, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    model = get_peft_model(AutoModelForCausalLM.from_config(config), UBMoEConfig()).eval()
    perturb_adapters(model, std=0.5)
    ids, mask = batch(b=3, t=9)
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    shares = []
    for cache in ({}, {"cache": StaticCache(config=model.config, max_cache_len=64)}):
        with torch.no_grad(), ubmoe_peft.track_routing(model) as tally:
            model.generate(**settings, pad_token_id=0, **cache)
        shares.append(tally.shares())
    assert shares[1] == pytest.approx(shares[0])


def test_mode_bi_takes_a_bidirectional_4d_mask_and_names_a_causal_one():
    """A user's 4D mask is used as given: one that encodes padding was refused with an error blaming transformers;
    a causal one is refused as the caller's mask."""
    model, _ = wrap()
    perturb_adapters(model, std=0.2)
    ids, mask = batch(padding="left")  # (B, T)
    real = mask.bool()
    visible = real[:, None, None, :] & real[:, None, :, None]  # (B, 1, T, T): real tokens see every real token
    visible |= torch.eye(ids.shape[1], dtype=torch.bool)  # padding queries see themselves (no empty rows)
    four_d = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    with ubmoe_peft.use_mode(model, "bi"):
        torch.testing.assert_close(
            logits(model, ids, four_d)[real], logits(model, ids, mask)[real], rtol=1e-5, atol=1e-5
        )
        causal = torch.full((ids.shape[1],) * 2, torch.finfo(torch.float32).min).triu(1)[None, None]  # (1, 1, T, T)
        with pytest.raises(ValueError, match="4D attention_mask passed in, of shape .* lets no token see a later one"):
            logits(model, ids, causal.expand(ids.shape[0], 1, -1, -1))
        # padding query rows left open (no empty softmax row, as transformers' _unmask_unattended made them) are
        # filler: such a causal mask ran causal, silently, since a padding query "saw" later tokens
        open_padding = causal.expand(ids.shape[0], 1, -1, -1).masked_fill(~real[:, None, :, None], 0.0)
        with pytest.raises(ValueError, match="4D attention_mask passed in, of shape .* lets no token see a later one"):
            logits(model, ids, open_padding)
        visible |= ~real[:, None, :, None]  # the same open rows in a bidirectional mask
        torch.testing.assert_close(
            logits(model, ids, torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min))[real],
            logits(model, ids, mask)[real],
            rtol=1e-5,
            atol=1e-5,
        )
        # flex attention's BlockMask is used as given too: a causal one is the caller's (it was blamed on transformers)
        from torch.nn.attention.flex_attention import create_block_mask

        length = ids.shape[1]
        block = create_block_mask(lambda b, h, q, k: k <= q, B=None, H=None, Q_LEN=length, KV_LEN=length, device="cpu")
        with pytest.raises(ValueError, match="4D attention_mask passed in, of shape .* lets no token see a later one"):
            logits(model, ids, block)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("lengths", [[9], [6], [6, 9], [1, 9]])
def test_a_callers_4d_mask_is_judged_by_its_real_tokens(lengths, side):
    """Mode bi's check of a mask passed in, as a tensor and as flex attention's BlockMask. Padding query rows left
    open (no empty softmax row) made a causal mask pass as bidirectional (it then ran causal, silently); padding rows
    that see only themselves made a left-padded bidirectional BlockMask fail."""
    from torch.nn.attention.flex_attention import create_block_mask

    from ubmoe_peft.tuners.ubmoe.model import _user_mask_sees_later

    length = 9
    positions = torch.arange(length)
    pad = torch.stack([positions < length - n if side == "left" else positions >= n for n in lengths])  # (B, T)
    masks = {  # name: (mask_mod, bidirectional)
        "bi, padding rows open": (lambda b, h, q, k: ~pad[b, k] | pad[b, q], True),
        "bi, padding rows see themselves": (lambda b, h, q, k: ~pad[b, k] & ~pad[b, q] | (k == q), True),
        "bi, as transformers builds it": (lambda b, h, q, k: ~pad[b, k], True),
        "causal, padding rows open": (lambda b, h, q, k: (k <= q) & ~pad[b, k] | pad[b, q], False),
        "causal, padding rows see themselves": (lambda b, h, q, k: (k <= q) & ~pad[b, k] | (k == q), False),
    }
    b, q, k = torch.meshgrid(torch.arange(len(lengths)), positions, positions, indexing="ij")
    for name, (allows, bidirectional) in masks.items():
        tensor = allows(b, None, q, k)[:, None]  # (B, 1, T, T)
        block = create_block_mask(allows, B=len(lengths), H=None, Q_LEN=length, KV_LEN=length, device="cpu")
        for mask in (tensor, torch.zeros(tensor.shape).masked_fill(~tensor, torch.finfo(torch.float32).min), block):
            assert _user_mask_sees_later(mask) == bidirectional, (name, type(mask).__name__)


def test_mode_bi_takes_a_dict_of_4d_masks_per_layer_type_as_the_callers():
    """Models mixing sliding and full layers (Gemma 2) take a dict of 4D masks, one per layer type, as given: a
    bidirectional one was refused with an error blaming transformers, and a causal one was blamed on it too."""
    model, _ = wrap("gemma2")
    perturb_adapters(model, std=0.2)
    ids, mask = batch(padding="left")
    real = mask.bool()
    visible = real[:, None, None, :] & real[:, None, :, None] | torch.eye(ids.shape[1], dtype=torch.bool)
    causal = visible & torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()

    def per_type(allowed):
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        return {"full_attention": additive, "sliding_attention": additive}

    with ubmoe_peft.use_mode(model, "bi"):
        torch.testing.assert_close(
            logits(model, ids, per_type(visible))[real], logits(model, ids, mask)[real], rtol=1e-5, atol=1e-5
        )
        with pytest.raises(
            ValueError, match=r"4D attention_mask passed in for '\w+_attention' layers, of shape \(3, 1, 9, 9\)"
        ):
            logits(model, ids, per_type(causal))
    with ubmoe_peft.use_mode(model, "uni"):
        torch.testing.assert_close(logits(model, ids, per_type(causal))[real], logits(model, ids, mask)[real])


# ---- accelerate offloading -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("expert", EXPERTS)
def test_a_wrapped_model_offloaded_by_accelerate_computes_the_same(expert, tmp_path):
    """accelerate's cpu_offload keeps every weight on the meta device outside its module's call. The LoRA deltas read
    their weights directly and computed on meta tensors (moe off by 0.5, bi NaN, silently); hooked LoRA modules are
    now called. Merging and saving such a model refuse, naming why."""
    from accelerate import cpu_offload

    model, _ = wrap("llama", expert, attention_r=4 if expert == "lora" else 0)
    perturb_adapters(model)
    ids, mask = batch(padding="left")
    expected = logits_per_mode(model, ids, mask)
    cpu_offload(model.get_base_model(), execution_device=torch.device("cpu"))
    assert layers(model)[0].ubmoe_router["default"].weight.is_meta
    torch.testing.assert_close(logits_per_mode(model, ids, mask), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(
        ValueError, match=r"merge_and_unload\(target='moe'\) reads every weight, but \d+ are on the meta"
    ):
        model.merge_and_unload()
    with pytest.raises(ValueError, match="tensors are on the meta device .*Save the adapter before offloading"):
        model.save_pretrained(tmp_path)
    assert not (tmp_path / "adapter_config.json").exists()


def test_a_base_with_offloaded_ffn_weights_is_refused_before_any_change():
    base = tiny_model("llama")
    base.model.layers[1].mlp.to("meta")  # what a device_map with a 'disk' entry leaves in the module
    with pytest.raises(ValueError, match="'model.layers.1.mlp' has its weights on the meta device.*in memory"):
        get_peft_model(base, UBMoEConfig())
    assert not any(isinstance(m, UBMoELayer) for m in base.modules())


def test_loading_onto_a_base_with_disk_offloaded_layers_is_refused_before_any_change(tmp_path):
    """PEFT's loader moves disk-offloaded weights by LoRA-style layer names: onto a base whose attention (not FFN) of
    one layer sits on disk, loading a UBMoE adapter failed with a bare KeyError, after wrapping the base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tiny_model("llama").save_pretrained(tmp_path / "base")
    get_peft_model(tiny_model("llama"), UBMoEConfig()).save_pretrained(tmp_path / "adapter")
    on_disk = {"model.layers.1.self_attn": "disk"}
    kept = ["model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head", "model.layers.0", "model.layers.1.mlp"]
    kept += ["model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm"]
    device_map = {**dict.fromkeys(kept, "cpu"), **on_disk}
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", device_map=device_map, offload_folder=tmp_path / "o")
    with pytest.raises(ValueError, match="into a model with layers offloaded to disk .*device_map='cpu'"):
        PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert not any(isinstance(m, UBMoELayer) for m in base.modules())


@pytest.mark.parametrize("lora_targets", [["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj"]])
def test_a_base_holding_another_peft_methods_layers_is_refused_and_left_intact(lora_targets, tmp_path):
    """Wrapping a LoRA model's base was accepted: the experts took LoRA's own modules for FFN projections, the save
    held the LoRA tensors and loaded nowhere, and the LoRA model's config entry became a UBMoEConfig."""
    from peft import LoraConfig

    lora = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=lora_targets)).eval()
    ids, mask = batch()
    expected = logits(lora, ids, mask)
    for target in (lora.get_base_model(), lora):
        with pytest.raises(ValueError, match=r"already holds \d+ layers of another PEFT method .*merge_and_unload"):
            get_peft_model(target, UBMoEConfig())
    assert type(lora.peft_config["default"]).__name__ == "LoraConfig"
    assert not any(isinstance(m, UBMoELayer) for m in lora.modules())
    assert torch.equal(logits(lora, ids, mask), expected)
    model = get_peft_model(lora.merge_and_unload(), UBMoEConfig())  # the named fix
    assert layers(model)


def test_another_peft_methods_adapter_onto_a_ubmoe_wrapped_base_is_refused(tmp_path):
    """PEFT only warned: the LoRA model kept the UBMoE layers routing inside it, and its save held their tensors."""
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer

    get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "lora")
    base = tiny_model("llama")
    model = get_peft_model(base, UBMoEConfig())
    for config in (None, LoraConfig(r=4, target_modules=["q_proj"])):  # the folder's type, or config='s
        with pytest.raises(ValueError, match=r"is a LORA adapter, but the model passed holds UBMoE layers.*unload"):
            PeftModel.from_pretrained(base, tmp_path / "lora", config=config)
    with pytest.raises(ValueError, match="The input config must be a PeftConfig"):  # PEFT's own error
        PeftModel.from_pretrained(base, tmp_path / "lora", config={"peft_type": "LORA"})
    assert layers(model) and not any(isinstance(m, LoraLayer) for m in base.modules())
    assert layers(PeftModel.from_pretrained(model.unload(), tmp_path / "lora")) == []  # the named fix


def test_another_peft_method_on_a_ubmoe_model_is_refused_and_a_peft_model_is_no_base(tmp_path):
    """Another PEFT method's tuner on a model holding UBMoE layers (get_peft_model on the UBMoE model or its base,
    inject_adapter_in_model): PEFT only warned, then wrote its config over the UBMoE model's (whose save then loaded
    as a LoRA model), saved the UBMoE tensors in its own file and kept them routing. A PeftModel given as the base
    of a UBMoE model (get_peft_model, from_pretrained) had its trained adapter replaced by a fresh one."""
    from peft import LoraConfig, PromptTuningConfig, inject_adapter_in_model

    model = get_peft_model(tiny_model("llama"), UBMoEConfig()).eval()
    perturb_adapters(model)
    ids, mask = batch()
    expected = logits(model, ids, mask)
    lora = LoraConfig(r=4, target_modules=["q_proj"])
    inner = model.get_base_model()
    for wrap_it in (
        lambda: get_peft_model(model, lora),
        lambda: get_peft_model(inner, lora),
        lambda: inject_adapter_in_model(lora, inner),
    ):
        with pytest.raises(ValueError, match="LoraModel cannot wrap a model that holds UBMoE layers.*unload"):
            wrap_it()
    prompt = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)  # builds no tuner: checked apart
    for target in (model, inner):
        with pytest.raises(ValueError, match="PromptTuningConfig cannot wrap a model that holds UBMoE layers"):
            get_peft_model(target, prompt)
    model.save_pretrained(tmp_path)
    for wrap_it in (lambda: get_peft_model(model, UBMoEConfig()), lambda: PeftModel.from_pretrained(model, tmp_path)):
        with pytest.raises(ValueError, match="is a PeftModel, a model PEFT already wraps.*get_base_model"):
            wrap_it()
    assert model.peft_config["default"].peft_type == PeftType.UBMOE
    torch.testing.assert_close(logits(model, ids, mask), expected, rtol=0, atol=0)
    torch.testing.assert_close(logits(PeftModel.from_pretrained(tiny_model(), tmp_path), ids, mask), expected)


# ---- multiple adapters --------------------------------------------------------------------------------------------
def test_adapter_names_that_are_module_names(tmp_path):
    """An adapter named "mlp" (its ModuleDict entries "...mlp.ubmoe_lora_A.mlp" were also taken for FFNs by every
    later adapter) is refused as it loads, leaving the base as it was; a load under another name works."""
    get_peft_model(tiny_model("llama"), UBMoEConfig()).save_pretrained(tmp_path)
    base = tiny_model("llama")
    with pytest.raises(ValueError, match=r"Adapter name 'mlp' is a part of this model's parameter names"):
        PeftModel.from_pretrained(base, tmp_path, adapter_name="mlp")
    assert not any(isinstance(m, UBMoELayer) for m in base.modules())
    model = PeftModel.from_pretrained(base, tmp_path, adapter_name="first")
    with pytest.raises(ValueError, match=r"Adapter name 'layers' is a part"):
        model.load_adapter(tmp_path, adapter_name="layers")
    model.load_adapter(tmp_path, adapter_name="second")
    assert all(set(layer.ubmoe_router) == {"first", "second"} for layer in layers(model))
    with pytest.raises(ValueError, match=r"Adapter name 'lm_head' ends with the modules_to_save entry 'lm_head'"):
        model.add_adapter("lm_head", UBMoEConfig(modules_to_save=["lm_head"]))


def test_several_active_adapters_are_refused():
    """PEFT's set_adapter([...]) on adapters of other layers ran each on its layers, a silent mix (the per-layer
    check caught only adapters sharing a layer)."""
    model = get_peft_model(tiny_model("llama"), UBMoEConfig(layers_to_transform=[0]))
    model.add_adapter("two", UBMoEConfig(layers_to_transform=[1]))
    for names in (["default", "two"], []):  # [] ran the base's FFNs under the mode's attention
        with pytest.raises(ValueError, match=r"UBMoE runs one adapter at a time .*Pass one adapter name"):
            model.base_model.set_adapter(names)
    assert model.active_adapters == ["default"]
    model.base_model.set_adapter(["two"])
    assert model.active_adapters == ["two"]
    with pytest.raises(NotImplementedError, match=r"UBMoE adapters cannot be combined by weights"):
        model.add_weighted_adapter(["default", "two"], [0.5, 0.5], "mix")  # a bare AttributeError before
    # PEFT's module-level set_adapter bypasses the tuner's check: the layers refuse the mix at the forward
    from peft.tuners.tuners_utils import set_adapter as set_adapter_of_layers

    set_adapter_of_layers(model.get_base_model(), ["default", "two"])
    ids, mask = batch()
    with pytest.raises(ValueError, match=r"UBMoE runs one adapter at a time, but \['default', 'two'\] are active"):
        model(input_ids=ids, attention_mask=mask)
    model.base_model.set_adapter("default")
    model.delete_adapter("default")
    model.delete_adapter("two")
    model.add_adapter("three", UBMoEConfig())  # PEFT sets the active adapters, none by then: that is no mix
    assert layers(model) and all(set(layer.ubmoe_router) == {"three"} for layer in layers(model))


def test_peft_layer_level_switches_of_an_injected_model_behave_as_the_peft_model_ones():
    """A model made with PEFT's inject_adapter_in_model has no PeftModel: its adapters are disabled layer by layer
    (BaseTunerLayer.enable_adapters, also what transformers' disable_adapters calls), which left mode bi's attention
    bidirectional, neither the base model nor mode bi; and its state dict, whose keys lack PeftModel's prefix, was
    refused by a PeftModel as "saved with other settings"."""
    from peft import get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict
    from peft.tuners.tuners_utils import BaseTunerLayer

    ids, mask = batch()
    base = logits(tiny_model("llama"), ids, mask)
    inner = inject_adapter_in_model(UBMoEConfig(), tiny_model("llama"))
    perturb_adapters(inner)
    inner.eval()
    ubmoe_peft.set_mode(inner, "bi")
    in_bi = logits(inner, ids, mask)
    for module in inner.modules():
        if isinstance(module, BaseTunerLayer):
            module.enable_adapters(False)
    assert torch.equal(logits(inner, ids, mask), base)
    for module in inner.modules():
        if isinstance(module, BaseTunerLayer):
            module.enable_adapters(True)
    assert torch.equal(logits(inner, ids, mask), in_bi)

    model = get_peft_model(tiny_model("llama"), UBMoEConfig()).eval()
    set_peft_model_state_dict(model, get_peft_model_state_dict(inner))
    for mode in MODES:
        with ubmoe_peft.use_mode(model, mode), ubmoe_peft.use_mode(inner, mode):
            assert torch.equal(logits(model, ids, mask), logits(inner, ids, mask))


def test_an_adapter_added_to_a_model_in_eval_mode_has_no_active_dropout():
    """New modules start in training mode; an adapter added to an eval-mode model used to drop out at inference
    once set active (PEFT's LoRA still does)."""
    model, _ = wrap("llama", "lora", attention_r=4)
    model.add_adapter("two", UBMoEConfig(lora_dropout=0.5, attention_r=4))
    perturb_adapters(model)
    model.set_adapter("two")
    assert not any(m.training for m in model.modules())
    ids, mask = batch()
    for mode in MODES:
        with ubmoe_peft.use_mode(model, mode):
            assert torch.equal(logits(model, ids, mask), logits(model, ids, mask))
    model.train()
    model.add_adapter("three", UBMoEConfig(lora_dropout=0.5))
    assert all(m.training for m in model.modules())


def test_multiple_adapters_by_name():
    model, reference = wrap()
    model.add_adapter("second", UBMoEConfig(expert_type="copy"))
    perturb_adapters(model)
    ubmoe_peft.set_mode(model, "bi")
    ids, mask = batch()
    first = logits(model, ids, mask)
    model.set_adapter("second")
    second = logits(model, ids, mask)
    assert not torch.equal(first, second)
    model.set_adapter("default")
    assert torch.equal(logits(model, ids, mask), first)
    ubmoe_peft.set_stage(model, "router")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("ubmoe_router.default" in n for n in trainable)


@pytest.mark.parametrize("expert", EXPERTS)
def test_delete_adapter_frees_its_modules_after_a_decode_step(expert):
    """A decode step caches a plan per adapter that holds its modules: PEFT's delete_adapter left them, and a copy
    expert's whole FFN per layer, alive."""
    import gc
    import weakref

    model, _ = wrap("llama", expert)
    model.add_adapter("big", UBMoEConfig(expert_type=expert))
    model.set_adapter("big")
    model.eval()
    logits(model, *batch(b=1, t=1, padding=None))  # a decode-sized forward (at most 64 tokens) builds the plans
    layer = layers(model)[0]
    assert "big" in layer._plans
    container = layer.ubmoe_copy if expert == "copy" else layer.ubmoe_lora_A
    freed = weakref.ref(container["big"])
    model.set_adapter("default")
    model.delete_adapter("big")
    gc.collect()
    assert freed() is None and not any("big" in lay._plans for lay in layers(model))


def test_a_take_over_frees_the_earlier_models_state(tmp_path):
    """A training forward with gradient checkpointing keeps the model's mode state on each decoder layer (for the
    recompute); after `from_pretrained(base, d)` took the base over, that earlier state, with its last batch's routing
    and mask, stayed alive on the layers until the new model's first training forward."""
    import gc
    import weakref

    model, _ = wrap()
    model.get_base_model().gradient_checkpointing_enable()
    model.train()
    model(*batch()).logits.sum().backward()
    model.save_pretrained(tmp_path)
    state = weakref.ref(model.base_model._ubmoe_state)
    base = model.get_base_model()
    new = PeftModel.from_pretrained(base, tmp_path)
    del model
    gc.collect()
    assert state() is None
    new.train()
    new(*batch()).logits.sum().backward()  # and the new model's own checkpointed training runs
    assert all(layer.__dict__["_ubmoe_mode_state"] is new.base_model._ubmoe_state for layer in base.model.layers)


def test_layers_to_transform_wraps_only_those_layers():
    model, _ = wrap(layers_to_transform=[1])
    assert [layer.layer_idx for layer in layers(model)] == [1]


# ---- generation ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("expert", EXPERTS)
def test_generate_in_moe_after_training_uses_the_cache_correctly(expert):
    model, _ = wrap("llama", expert)
    perturb_adapters(model, std=0.2)
    ids, mask = batch(padding="left")
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    # the same tokens from full forwards without a cache
    full_mask = torch.cat([mask, torch.ones(3, 5, dtype=mask.dtype)], dim=1)  # (B, T + 5)
    next_tokens = logits(model, out[:, :-1], full_mask[:, :-1])[:, ids.shape[1] - 1 :].argmax(-1)  # (B, 5)
    assert torch.equal(next_tokens, out[:, ids.shape[1] :])


def test_mode_bi_returns_no_kv_cache_to_decode_from():
    model, _ = wrap()
    ids, mask = batch()
    with torch.no_grad():
        with ubmoe_peft.use_mode(model, "moe"):
            assert model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values is not None
        with ubmoe_peft.use_mode(model, "bi"):
            assert model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values is None


def test_generate_refuses_in_mode_bi():
    model, _ = wrap()
    ubmoe_peft.set_mode(model, "bi")
    ids, mask = batch()
    with pytest.raises(RuntimeError, match="mode 'bi'"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="mode 'bi'"):
        model.base_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2)
    # continuous batching's loop only logged the forward's refusal: the request came back empty, without an error
    config = GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=0)
    for call in ("generate_batch", "init_continuous_batching", "continuous_batching_context_manager"):
        message = f"Cannot run {call} \\(continuous batching\\) with a KV cache in mode 'bi'"
        with pytest.raises(RuntimeError, match=message):
            getattr(model, call)(**({"inputs": [[5, 6, 7]]} if call == "generate_batch" else {}))
    # generate hands cache_implementation="paged" over to continuous batching (through the PeftModel for a causal LM;
    # a PeftModel without task_type calls the transformers model's generate, whose batching loop logs the refusal)
    causal_lm = get_peft_model(tiny_model(), UBMoEConfig(task_type="CAUSAL_LM"))
    ubmoe_peft.set_mode(causal_lm, "bi")
    with pytest.raises(RuntimeError, match=r"Cannot run generate\(cache_implementation='paged'\)"):
        causal_lm.generate(input_ids=ids[:1], max_new_tokens=2, cache_implementation="paged", use_cache=False)
    with pytest.raises(RuntimeError, match=r"Cannot run generate\(cache_implementation='paged'\)"):
        causal_lm.generate(input_ids=ids[:1], generation_config=GenerationConfig(cache_implementation="paged"))
    with ubmoe_peft.use_mode(model, "moe"):  # the other modes batch as transformers does
        out = model.generate_batch(inputs=[[5, 6, 7]], generation_config=config, warmup=False)
        expected = model.generate(input_ids=torch.tensor([[5, 6, 7]]), generation_config=config)[0, 3:]
    assert list(next(iter(out.values())).generated_tokens) == expected.tolist()


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_mode_bi_generates_without_a_cache_by_encoding_again(task_type):
    """Without a cache, the bidirectional model generates: every step encodes the whole text in mode bi. Both PEFT
    wrappers agree (a plain PeftModel's generate bypasses UBMoEModel.generate: only a cache was refused there)."""
    model = get_peft_model(tiny_model("llama"), UBMoEConfig(task_type=task_type)).eval()
    perturb_adapters(model, std=0.2)
    ubmoe_peft.set_mode(model, "bi")
    ids, mask = batch(padding="left")
    with pytest.raises(RuntimeError, match="KV cache in mode 'bi'.*use_cache=False"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, use_cache=False
    )
    # use_cache=False given in a generation config, or set on the model's, counts too (they were refused, naming
    # use_cache=False as the fix)
    config = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, generation_config=config), out)
    assert torch.equal(model.generate(ids, config, attention_mask=mask), out)
    model.generation_config.use_cache = False
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False), out)
    unset = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0)  # use_cache None: the model's counts
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, generation_config=unset), out)
    model.generation_config.use_cache = True
    # transformers caches whenever it generates from embeddings: named as such (the message said to pass use_cache)
    embeds = model.get_input_embeddings()(ids)
    named = r"from inputs_embeds in mode 'bi'.*Pass input_ids with use_cache=False"  # by UBMoEModel.generate
    if task_type is None:  # PEFT's plain PeftModel.generate calls the transformers model's: refused at the forward
        named = r"KV cache in mode 'bi'.*Generate from input_ids, not inputs_embeds, with use_cache=False"
    with pytest.raises(RuntimeError, match=named):
        model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=2, use_cache=False)
    with pytest.raises(RuntimeError, match=r"KV cache in mode 'bi'.*Generate from input_ids, not inputs_embeds"):
        model(inputs_embeds=embeds, attention_mask=mask, past_key_values=DynamicCache(config=model.config))
    for step in range(4):  # each token is the argmax of a full mode-bi forward over everything before it
        seen = out[:, : ids.shape[1] + step]
        seen_mask = torch.cat([mask, torch.ones(3, step, dtype=mask.dtype)], dim=1)
        assert torch.equal(logits(model, seen, seen_mask)[:, -1].argmax(-1), out[:, ids.shape[1] + step])


@pytest.mark.parametrize("attn", [*ATTNS, "flex_attention"])
def test_a_transformers_release_that_ignores_is_causal_is_caught(attn):
    """Simulate the failure seen in peer projects: the backbone silently drops `is_causal=False` (flex attention
    then gets a causal BlockMask)."""
    model, _ = wrap("llama", "lora", attn)
    ubmoe_peft.set_mode(model, "bi")
    backbone = model.base_model.model.model
    handle = backbone.register_forward_pre_hook(lambda m, a, k: (a, {**k, "is_causal": None}), with_kwargs=True)
    ids, mask = batch(padding=None)
    with pytest.raises(RuntimeError, match="causal mask"):
        logits(model, ids, mask)
    handle.remove()
    logits(model, ids, mask)


def _foreign(model_type: str, attn: str = "eager") -> torch.nn.Module:
    """A tiny decoder of an architecture outside the tested set (vocabulary of the shared tokenizer)."""
    import transformers as tf

    small = dict(vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    configs = {
        "falcon": lambda: tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **small),
        "gpt_neo": lambda: tf.GPTNeoConfig(
            hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global"], 2]], **small
        ),
        "bloom": lambda: tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, **small),
        "mpt": lambda: tf.MptConfig(d_model=32, n_layers=2, n_heads=4, **small),
        "gpt2": lambda: tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, **small),
        "rwkv": lambda: tf.RwkvConfig(hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, **small),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(  # layer 0 dense, layer 1 an MoE block with a shared expert
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            mlp_only_layers=[0],
            **small,
        ),
        "opt": lambda: tf.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, **small),
        "lfm2": lambda: tf.Lfm2Config(  # a convolution block first, attention second
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["conv", "full_attention"],
            **small,
        ),
        "nemotron_h": lambda: tf.NemotronHConfig(  # every layer's block is its `mixer`: Mamba, FFN, attention, FFN
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
            num_hidden_layers=4,
            mamba_num_heads=8,
            mamba_head_dim=16,
            ssm_state_size=16,
            chunk_size=16,
            n_groups=1,
            **small,
        ),
        "zamba2": lambda: tf.Zamba2Config(  # a Mamba layer, then a hybrid one whose FFN takes the layer index
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["linear_attention", "hybrid"],
            hybrid_layer_ids=[1],
            mamba_headdim=16,
            mamba_d_state=16,
            **small,
        ),
        "llama4_text": lambda: tf.Llama4TextConfig(  # full attention, then chunked attention in an MoE layer
            hidden_size=32,
            intermediate_size=64,
            intermediate_size_mlp=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            moe_layers=[1],
            attention_chunk_size=4,
            layer_types=["full_attention", "chunked_attention"],
            no_rope_layers=[0, 1],
            **small,
        ),
        **{  # decoder layers that drop is_causal=False
            name: lambda cls=cls: cls(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                **small,
            )
            for name, cls in (("stablelm", tf.StableLmConfig), ("nemotron", tf.NemotronConfig))
        },
        "modernbert-decoder": lambda: tf.ModernBertDecoderConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            local_attention=4,
            global_attn_every_n_layers=2,
            **small,
        ),
    }
    torch.manual_seed(0)
    config = configs[model_type]()
    config._attn_implementation = attn
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(("model_type", "attn"), [("falcon", "sdpa"), ("falcon", "eager"), ("gpt_neo", "eager")])
def test_an_architecture_that_ignores_is_causal_fails_in_mode_bi_not_silently(model_type, attn):
    """Falcon and GPT-Neo drop the `is_causal=False` forward argument; their attention is not named `self_attn`."""
    model = get_peft_model(_foreign(model_type, attn), UBMoEConfig())
    perturb_adapters(model)
    ids, mask = batch(padding=None)
    ubmoe_peft.set_mode(model, "bi")
    with pytest.raises(
        RuntimeError, match=f"gave (attention layer 0|an attention layer) of this '{model_type}' model a causal mask"
    ):
        logits(model, ids, mask)
    for mode in ("uni", "moe"):
        ubmoe_peft.set_mode(model, mode)
        assert torch.isfinite(logits(model, ids, mask)).all()
    # the bi merge is what mode bi runs: it returned GPT-Neo causal, as if it were the embedding model
    with pytest.raises(RuntimeError, match="merge_and_unload.target='bi'. makes the mode-bi model, which this model"):
        model.merge_and_unload(target="bi")
    assert ubmoe_peft.get_mode(model) == "moe" and any(isinstance(m, UBMoELayer) for m in model.modules())


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", ["stablelm", "nemotron"])
def test_mode_bi_hands_is_causal_to_attention_a_decoder_layer_drops_it(model_type, attn):
    """StableLM's and Nemotron's decoder layers drop is_causal=False on the way to attention: with padding the mask
    was bidirectional, but one text alone (mask None) ran causal on sdpa, and mode bi refused it."""
    model = get_peft_model(_foreign(model_type, attn), UBMoEConfig())
    perturb_adapters(model)
    ids, mask = batch(padding="right")
    changed = ids.clone()
    changed[1:, -1] = (changed[1:, -1] + 5) % 128  # the last token of the unpadded rows
    for mode, sees_later in (("bi", True), ("moe", False), ("uni", False)):
        ubmoe_peft.set_mode(model, mode)
        alone = torch.cat([logits(model, ids[i : i + 1], None) for i in (1, 2)])  # one unpadded text per call
        moved = torch.cat([logits(model, changed[i : i + 1], None) for i in (1, 2)])
        assert bool((alone[:, 0] - moved[:, 0]).abs().max() > 1e-3) is sees_later, mode
        torch.testing.assert_close(alone, logits(model, ids, mask)[1:])  # as in a padded batch
    with pytest.raises(ValueError, match=f"cannot make a bidirectional '{model_type}' model: its decoder layers drop"):
        model.merge_and_unload(target="bi")
    assert any(isinstance(m, UBMoELayer) for m in model.modules())


def test_the_mode_bi_check_covers_a_hybrid_whose_first_layer_is_not_attention():
    """LFM2's first layer is a convolution block: the check hooked only the first layer's attention, so it had none,
    and a decoder dropping is_causal=False ran mode bi causal without a word."""
    model = get_peft_model(_foreign("lfm2", "sdpa"), UBMoEConfig())
    ids, mask = batch(padding=None)
    ubmoe_peft.set_mode(model, "bi")
    logits(model, ids, mask)
    backbone = model.base_model.model.model
    handle = backbone.register_forward_pre_hook(lambda m, a, k: (a, {**k, "is_causal": None}), with_kwargs=True)
    with pytest.raises(
        RuntimeError, match=r"gave attention layer 1 \(full_attention\) of this 'lfm2' model a causal mask"
    ):
        logits(model, ids, mask)
    handle.remove()


def test_the_mode_bi_check_covers_each_layer_type():
    """Llama 4 gives its chunked-attention layers a mask of their own, which ignores is_causal=False: behind a
    full-attention first layer (bidirectional, and the only one checked) they ran mode bi causal without a word."""
    model = get_peft_model(_foreign("llama4_text", "sdpa"), UBMoEConfig(layers_to_transform=[0]))  # 1 is MoE
    ids, mask = batch(padding=None)
    ubmoe_peft.set_mode(model, "bi")
    with pytest.raises(RuntimeError, match=r"gave attention layer 1 \(chunked_attention\) of this 'llama4_text' model"):
        logits(model, ids, mask)
    ubmoe_peft.set_mode(model, "moe")
    assert torch.isfinite(logits(model, ids, mask)).all()


def test_a_decoder_whose_get_decoder_is_its_lm_head_is_wrapped():
    """ModernBERT's decoder answers get_decoder() with its LM head (a Linear named "decoder"): no decoder layer was
    found, and even target_modules=['mlp'] was "not found"."""
    base = _foreign("modernbert-decoder", "sdpa")
    ids, mask = batch(padding=None)
    expected = logits(base, ids, mask)
    model = get_peft_model(base, UBMoEConfig())
    assert sum(isinstance(m, UBMoELayer) for m in model.modules()) == 2
    torch.testing.assert_close(logits(model, ids, mask), expected)  # a fresh adapter in mode moe: the base


def test_mode_bi_refuses_an_attention_implementation_that_fails_bidirectional_in_transformers():
    """ModernBERT-decoder's eager attention adds its mask without checking for None (what is_causal=False gives with
    no padding): mode bi failed with transformers' bare TypeError."""
    model = get_peft_model(_foreign("modernbert-decoder", "eager"), UBMoEConfig())
    ids, mask = batch(padding=None)
    ubmoe_peft.set_mode(model, "bi")
    with pytest.raises(ValueError, match=r"attn_implementation='eager' .*\('modernbert-decoder'\).*'sdpa'"):
        logits(model, ids, mask)
    ubmoe_peft.set_mode(model, "moe")
    assert torch.isfinite(logits(model, ids, mask)).all()


@pytest.mark.parametrize(
    ("model_type", "message"),
    [
        ("bloom", r"'transformer.h.0.mlp' \(BloomMLP\) needs \['residual'\] besides the hidden states"),
        ("mpt", r"'transformer.blocks.0.ffn' \(MptMLP\) needs \['residual'\]"),
        ("gpt2", r"\(GPT2MLP\) has no nn.Linear inside \(it holds \['Conv1D', .*Conv1D and fused MoE experts"),
        # its (1, 1, C) token-shift weights were taken for fused experts
        (
            "rwkv",
            r"'rwkv.blocks.0.feed_forward' \(RwkvFeedForward\) holds 'time_mix_key' of shape \(1, 1, 32\).*not supp",
        ),
        ("opt", r"'opt' keeps its FFN's linears \['fc1', 'fc2'\] directly in each decoder layer .*not supported"),
        # its router and shared expert are linears: the LoRA expert adapted those alone, silently
        (
            "qwen2_moe",
            r"'model.layers.1.mlp' \(1 of 2 targets\) is a mixture-of-experts block: it holds fused expert weights "
            r"\('experts.gate_up_proj', 3-D\).*UBMoEConfig\(layers_to_transform=\[0\]\)",
        ),
    ],
)
def test_ffns_that_cannot_be_experts_are_refused_when_wrapping(model_type, message):
    base = _foreign(model_type)
    for expert in ("lora", "copy"):
        with pytest.raises(ValueError, match=message):
            get_peft_model(base, UBMoEConfig(expert_type=expert, r=1))
    assert not any(isinstance(m, UBMoELayer) for m in base.modules())
    if model_type == "qwen2_moe":  # the fix the error names works
        model = get_peft_model(base, UBMoEConfig(layers_to_transform=[0]))
        assert [m.layer_idx for m in model.modules() if isinstance(m, UBMoELayer)] == [0]


def test_hybrid_blocks_named_alike_and_ffns_called_with_more_than_the_hidden_states_are_refused_clearly():
    """Nemotron-H names every layer's block `mixer`: the advice of the first refusal wrapped its attention as an FFN
    (every forward then failed with a bare TypeError), and a Mamba convolution was named fused experts. Zamba2's
    decoder calls its FFN with the layer index, which the experts dropped (a bare KeyError deep inside it)."""
    base = _foreign("nemotron_h", "sdpa")
    with pytest.raises(
        ValueError,
        match=r"'model.layers.2.mixer' \(1 of 4 targets\) is the layer's attention.*"
        r"whose 'mixer' is an FFN: UBMoEConfig\(layers_to_transform=\[1, 3\]\)",
    ):
        get_peft_model(base, UBMoEConfig(target_modules=["mixer"]))
    with pytest.raises(
        ValueError,
        match=r"'model.layers.0.mixer' \(NemotronHMamba2Mixer, 1 of 3 targets\) holds a "
        r"convolution \('conv1d.weight'\).*UBMoEConfig\(layers_to_transform=\[1, 3\]\)",
    ):
        get_peft_model(base, UBMoEConfig(target_modules=["mixer"], layers_to_transform=[0, 1, 3]))
    assert not any(isinstance(m, UBMoELayer) for m in base.modules())
    model = get_peft_model(base, UBMoEConfig(target_modules=["mixer"], layers_to_transform=[1, 3]))
    ids, mask = batch(padding="left")
    with ubmoe_peft.use_mode(model, "uni"):
        expected = logits(model, ids, mask)
    assert torch.equal(logits(model, ids, mask), expected)  # a fresh adapter's mode moe is the base model

    model = get_peft_model(_foreign("zamba2", "sdpa"), UBMoEConfig(target_modules=["feed_forward"]))
    with ubmoe_peft.use_mode(model, "uni"):
        assert torch.isfinite(logits(model, ids, mask)).all()
    for mode in ("moe", "bi"):
        with (
            ubmoe_peft.use_mode(model, mode),
            pytest.raises(
                ValueError,
                match=rf"calls its FFN \(Zamba2MLP\) with the extra arguments \[1\] besides the hidden .*mode '{mode}'",
            ),
        ):
            logits(model, ids, mask)


def test_a_multimodal_model_wraps_its_language_model_only(tokenizer):
    """A vision tower deeper than the text model, with another hidden size: its FFNs are not decoder FFNs. Its text
    embeds through the SentenceTransformer (it read the hidden size from the top config, which has none)."""
    import transformers as tf
    from conftest import CONFIGS

    torch.manual_seed(0)
    vision = tf.CLIPVisionConfig(
        hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, image_size=16, patch_size=8
    )
    config = tf.LlavaConfig(
        vision_config=vision, text_config=CONFIGS["llama"](), image_token_index=5, vision_feature_select_strategy="full"
    )
    config._attn_implementation = "sdpa"
    base = tf.LlavaForConditionalGeneration(config).eval()
    reference = copy.deepcopy(base)
    model = get_peft_model(base, UBMoEConfig()).eval()
    perturb_adapters(model)

    wrapped = [n for n, m in model.named_modules() if isinstance(m, UBMoELayer)]
    assert wrapped == [f"base_model.model.model.language_model.layers.{i}.mlp" for i in (0, 1)]
    assert model.peft_config["default"].base_model_signature["num_layers"] == 2
    ids = torch.tensor([[5, 5, 5, 5, 5, 10, 11, 12]])  # five image tokens (CLS and four 8x8 patches), then text
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.randn(1, 3, 16, 16))
    with torch.no_grad():
        expected = reference(**inputs).logits
        outputs = {}
        for mode in ("uni", "moe", "bi"):
            with ubmoe_peft.use_mode(model, mode):
                outputs[mode] = model(**inputs).logits
    torch.testing.assert_close(outputs["uni"], expected, rtol=0, atol=0)
    assert not torch.allclose(outputs["bi"], expected, atol=1e-3) and torch.isfinite(outputs["moe"]).all()
    assert set(ubmoe_peft.routing_stats(model)) == {0, 1}
    st = ubmoe_peft.to_sentence_transformer(model, tokenizer)
    assert st.get_sentence_embedding_dimension() == 32
    text = w(10, 11, 12)
    with torch.no_grad(), ubmoe_peft.use_mode(model, "bi"):
        hidden = model.base_model.model.model(input_ids=tokenizer(text, return_tensors="pt")["input_ids"])
    expected = hidden.last_hidden_state.mean(1)[0]  # (C,)
    torch.testing.assert_close(st.encode(text, convert_to_tensor=True), expected, rtol=1e-5, atol=1e-5)


def test_registration_survives_reimport():
    import importlib
    import subprocess
    import sys

    import ubmoe_peft.tuners.ubmoe as tuner

    importlib.reload(tuner)  # registering twice must be a no-op, not PEFT's "already registered" KeyError
    code = "import ubmoe_peft, peft; print(peft.PeftType('UBMOE').value)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "UBMOE"


def test_routing_stats_count_only_real_tokens():
    model, _ = wrap()
    perturb_adapters(model)
    layer = layers(model)[0]
    seen = {}
    handle = layer.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0]))
    ids, mask = batch(padding="left")
    logits(model, ids, mask)
    handle.remove()
    with torch.no_grad():
        router = layer.router_logits("default", seen["x"])  # (B, T, 2)
    to_bi = (router[..., 1] > router[..., 0]).float()  # (B, T)
    expected = float((to_bi * mask).sum() / mask.sum())
    assert ubmoe_peft.routing_stats(model)[0] == pytest.approx(expected)
    assert expected != pytest.approx(float(to_bi.mean()))  # the pads would have changed the share
    # The same padding as a 4D mask (used as given): the pads, keys no query attends to, were counted too.
    real = mask.bool()
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()  # (T, T)
    visible = causal & real[:, None, None, :] & real[:, None, :, None]  # (B, 1, T, T); padding rows see nothing
    for four_d in (visible, torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)):
        logits(model, ids, four_d)
        assert ubmoe_peft.routing_stats(model)[0] == pytest.approx(expected)


@pytest.mark.parametrize("expert", EXPERTS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_a_wrapped_ffn_given_2d_4d_or_empty_inputs_routes_and_counts_like_a_3d_one(top_k, expert):
    """An FFN called on (N, C), 4-D or 0-token inputs (as some models and callers do): its share is of those tokens
    (the rank used to say which kind of routing was kept: raw logits were summed), and 0 tokens give 0 tokens out,
    as the base FFN does, in every mode and with or without autograd."""
    model, _ = wrap(expert=expert, top_k=top_k, router_gradient="scale")
    perturb_adapters(model, std=0.3)
    model.eval()
    layer = layers(model)[0]
    state = layer._state
    for shape in [(60, 32), (200, 32), (2, 3, 20, 32)]:
        x = torch.randn(shape)
        state.routing = state.routing_mask = state.token_mask = None  # no forward of the model around this call
        with torch.no_grad():
            layer(x)
            router = layer.router_logits("default", x)  # (..., 2)
        bi = (router[..., 1] > router[..., 0]).float() if top_k == 1 else router.softmax(-1)[..., 1]
        assert ubmoe_peft.routing_stats(model)[0] == pytest.approx(float(bi.mean()), abs=1e-6), shape
    for shape in [(2, 0, 32), (0, 5, 32), (0, 32)]:
        x = torch.randn(shape)
        for mode in ("uni", "bi", "moe"):
            ubmoe_peft.set_mode(model, mode)
            for grad in (False, True):
                with torch.set_grad_enabled(grad):
                    assert layer(x).shape == layer.base_layer(x).shape == shape, (shape, mode, grad)


def test_a_text_generation_pipeline_generates_in_the_models_mode(tokenizer):
    """usage.md's claim: the pipeline gives what generate gives in mode moe, and leaves the mode."""
    from transformers import pipeline

    model = get_peft_model(tiny_model(), UBMoEConfig(task_type="CAUSAL_LM"))
    perturb_adapters(model, std=0.3)
    generator = pipeline("text-generation", model=model.eval(), tokenizer=tokenizer)
    text = w(5, 6, 7, 8)
    out = generator(text, max_new_tokens=4, do_sample=False, return_full_text=False)[0]["generated_text"]
    assert ubmoe_peft.get_mode(model) == "moe"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :]
    assert out.split() == tokenizer.decode(expected).split()
