"""The optional mode-bi attention adapter (``UBMoEConfig(attention_r=...)``): LoRA on the attention projections that
only mode bi uses. Modes uni and moe never see it; mode bi, merging, export, saving and training handle it."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, batch, perturb_adapters, tiny_model
from peft import LoraConfig, PeftModel, get_peft_model

import ubmoe_peft
from ubmoe_peft import UBMoEConfig, UBMoELayer


def wrapped(arch: str = "llama", **kwargs) -> PeftModel:
    kwargs.setdefault("attention_r", 4)
    kwargs.setdefault("lora_dropout", 0.0)
    model = get_peft_model(tiny_model(arch), UBMoEConfig(**kwargs)).eval()
    perturb_adapters(model, std=0.3)
    return model


def outputs(model, mode: str, ids, mask) -> torch.Tensor:
    with torch.no_grad(), ubmoe_peft.use_mode(model, mode):
        return model(input_ids=ids, attention_mask=mask).logits


def hooks_on(module: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


@pytest.mark.parametrize("arch", ARCHS)
def test_modes_uni_and_moe_never_see_it(arch):
    model = wrapped(arch)
    without = get_peft_model(tiny_model(arch), UBMoEConfig(lora_dropout=0.0)).eval()
    without.load_state_dict({k: v for k, v in model.state_dict().items() if ".ubmoe_attn_" not in k}, strict=True)
    ids, mask = batch()
    for mode in ("uni", "moe"):
        torch.testing.assert_close(outputs(model, mode, ids, mask), outputs(without, mode, ids, mask), rtol=0, atol=0)
    assert not torch.allclose(outputs(model, "bi", ids, mask), outputs(without, "bi", ids, mask), atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_mode_bi_is_peft_lora_on_attention_and_ffn_with_bidirectional_attention(arch):
    """Reference computed another way: PEFT's own LoRA on the same projections with the same weights, run with
    transformers' ``is_causal=False``."""
    model = wrapped(arch, r=4)
    attn_names = sorted({n.split(".ubmoe_attn_A.default.")[1].rsplit(".", 1)[0] for n, _ in model.named_parameters()
                         if ".ubmoe_attn_A." in n})  # fmt: skip
    ffn_names = ["gate_proj", "up_proj", "down_proj"] if arch != "phi3" else ["gate_up_proj", "down_proj"]
    reference = get_peft_model(
        tiny_model(arch),
        LoraConfig(r=4, lora_alpha=16, use_rslora=True, lora_dropout=0.0, target_modules=attn_names + ffn_names),
    ).eval()
    ours = model.state_dict()
    mapped = {}
    for key in reference.state_dict():
        if ".lora_" not in key:
            continue
        layer, rest = key.split(".layers.")[1].split(".", 1)
        block, proj = rest.split(".")[0], rest.split(".")[1]
        kind = "A" if ".lora_A." in key else "B"
        container = f"ubmoe_attn_{kind}" if block == "self_attn" else f"ubmoe_lora_{kind}"
        mapped[key] = ours[f"base_model.model.model.layers.{layer}.mlp.{container}.default.{proj}.weight"]
    assert len(mapped) == 2 * len(attn_names + ffn_names) * 2  # A and B, every projection, both layers
    reference.load_state_dict(mapped, strict=False)
    ids, mask = batch(padding="right")
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, is_causal=False).logits
    real = mask.bool()
    torch.testing.assert_close(outputs(model, "bi", ids, mask)[real], expected[real], rtol=1e-4, atol=1e-5)


def test_merge_bi_includes_it_and_the_moe_export_leaves_it_out(tmp_path):
    ids, mask = batch(padding="right")
    real = mask.bool()
    model = wrapped()
    moe, bi = outputs(model, "moe", ids, mask), outputs(model, "bi", ids, mask)
    exported = model.merge_and_unload()  # mode moe never uses the attention adapter, so the export is exact without it
    torch.testing.assert_close(outputs_plain(exported, ids, mask)[real], moe[real], rtol=1e-4, atol=1e-4)
    merged = model.merge_and_unload(target="bi")
    assert not any("ubmoe" in n for n, _ in merged.named_parameters()) and hooks_on(merged) == 0
    torch.testing.assert_close(outputs_plain(merged, ids, mask)[real], bi[real], rtol=1e-4, atol=1e-4)


def outputs_plain(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_saved_adapter_reloads_under_any_name_and_unload_leaves_no_hook(tmp_path):
    model = wrapped()
    ids, mask = batch()
    expected = outputs(model, "bi", ids, mask)
    model.save_pretrained(tmp_path)
    base = tiny_model()
    loaded = PeftModel.from_pretrained(base, tmp_path, adapter_name="other").eval()
    assert loaded.peft_config["other"].attention_r == 4
    torch.testing.assert_close(outputs(loaded, "bi", ids, mask), expected, rtol=0, atol=0)
    assert hooks_on(base.model.layers[0].self_attn.q_proj) == 0  # the deltas' hooks live only inside a bi forward
    unloaded = loaded.unload()
    assert hooks_on(unloaded) == 0
    torch.testing.assert_close(outputs_plain(unloaded, ids, mask), outputs_plain(tiny_model(), ids, mask))


def test_contrastive_stage_trains_it_router_stage_does_not_and_checkpointing_agrees():
    ids, mask = batch(padding=None)
    grads = []
    for checkpointing in (False, True):
        model = wrapped()
        if checkpointing:  # the recomputed attention must add the deltas again (hooks installed per attention call)
            model.base_model.model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()
        ubmoe_peft.set_stage(model, "contrastive")
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert any(".ubmoe_attn_A." in n for n in trainable) and not any(".ubmoe_router." in n for n in trainable)
        with ubmoe_peft.use_mode(model, "bi"):
            model(input_ids=ids, attention_mask=mask).logits.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if ".ubmoe_attn_" in n})
        ubmoe_peft.set_stage(model, "router")
        assert not any(p.requires_grad for n, p in model.named_parameters() if ".ubmoe_attn_" in n)
    assert all(grad.abs().sum() > 0 for grad in grads[0].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6)


def test_a_frozen_attention_adapter_runs_without_dropout_as_the_ffn_expert_does():
    model = wrapped(lora_dropout=0.5)
    ids, mask = batch()
    expected = outputs(model.eval(), "bi", ids, mask)
    ubmoe_peft.set_stage(model, "router")  # experts and attention adapter frozen
    model.train()
    torch.testing.assert_close(outputs(model, "bi", ids, mask), expected, rtol=0, atol=0)
    ubmoe_peft.set_stage(model, "contrastive")  # trained: its dropout is on
    model.train()
    assert not torch.allclose(outputs(model, "bi", ids, mask), expected, atol=1e-3)


def test_every_attention_projection_gets_a_delta():
    layer = next(m for m in wrapped().modules() if isinstance(m, UBMoELayer))
    assert set(layer.ubmoe_attn_A["default"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert layer.attention_scaling["default"] == pytest.approx(16 / 4**0.5)  # rsLoRA, like the FFN expert


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(attention_r=-1), r"attention_r=-1\) is invalid"),
        (dict(attention_r=True), r"attention_r=True\) is invalid"),
        (dict(attention_r=64), r"attention_r=64\) is larger than the attention's"),
    ],
)
def test_bad_attention_rank_fails_before_any_change(kwargs, message):
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        get_peft_model(model, UBMoEConfig(**kwargs))
    assert not any(isinstance(m, UBMoELayer) for m in model.modules()) and hooks_on(model) == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_deep_copy_has_its_own_hooks():
    import copy

    model = wrapped()
    ids, mask = batch()
    expected = outputs(model, "bi", ids, mask)
    twin = copy.deepcopy(model)
    torch.testing.assert_close(outputs(twin, "bi", ids, mask), expected, rtol=0, atol=0)
    twin.unload()  # removes the copy's hooks only
    assert hooks_on(twin.base_model.model.model.layers[1].self_attn) == 0
    assert hooks_on(model.base_model.model.model.layers[1].self_attn) == 2  # the original's pre/post pair
    torch.testing.assert_close(outputs(model, "bi", ids, mask), expected, rtol=0, atol=0)


def test_attention_is_hooked_only_while_the_model_runs_in_mode_bi():
    """Modes uni and moe (every decode step) run the attention without any hook of ours; a forward in mode bi hooks
    it in, and the first forward in another mode detaches again, with mode bi's outputs unchanged by the round trips."""
    model = wrapped()
    attention = model.base_model.model.model.layers[1].self_attn  # layer 0's also has the model's mask check
    ids, mask = batch()
    counts, bi = [], []
    for mode in ("moe", "bi", "uni", "bi", "moe"):
        result = outputs(model, mode, ids, mask)
        counts.append(hooks_on(attention))
        if mode == "bi":
            bi.append(result)
    assert counts == [0, 2, 0, 2, 0]
    torch.testing.assert_close(bi[1], bi[0], rtol=0, atol=0)


def test_an_attention_adapter_added_in_mode_bi_is_hooked_at_once():
    model = get_peft_model(tiny_model(), UBMoEConfig(lora_dropout=0.0)).eval()
    attention = model.base_model.model.model.layers[1].self_attn
    ids, mask = batch()
    ubmoe_peft.set_mode(model, "bi")
    outputs(model, "bi", ids, mask)
    assert hooks_on(attention) == 0  # no attention adapter yet: nothing to hook
    model.add_adapter("second", UBMoEConfig(lora_dropout=0.0, attention_r=4))
    model.set_adapter("second")
    perturb_adapters(model, std=0.3)
    assert hooks_on(attention) == 2
    first = outputs(model, "bi", ids, mask)
    outputs(model, "moe", ids, mask)  # detaches
    torch.testing.assert_close(outputs(model, "bi", ids, mask), first, rtol=0, atol=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".ubmoe_attn_B." in name:
                param.zero_()
    assert not torch.allclose(outputs(model, "bi", ids, mask), first, atol=1e-3)  # the first forward had the deltas
