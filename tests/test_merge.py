"""merge_and_unload: target="moe" exports a plain transformers MoE model equal to mode moe; target="bi" gives the dense
embedding model, saved as a plain transformers model that loads bidirectional; errors leave the model untouched."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCH_ATTNS, CONFIGS, EXPERTS, batch, config_of, hidden, perturb_adapters, tiny_model
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import ubmoe_peft
from ubmoe_peft import UBMoEConfig, UBMoELayer


def wrapped(arch="llama", expert="lora", attn=None):
    model = get_peft_model(tiny_model(arch, attn), UBMoEConfig(expert_type=expert)).eval()
    perturb_adapters(model)
    return model


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("expert", EXPERTS)
@pytest.mark.parametrize(("arch", "attn"), ARCH_ATTNS)
def test_merged_bi_model_is_mode_bi(arch, attn, expert):
    model = wrapped(arch, expert, attn)
    ids, mask = batch(padding="left")
    ubmoe_peft.set_mode(model, "bi")
    expected = hidden(model, ids, mask)  # (B, T, C)
    merged = model.merge_and_unload(target="bi")
    assert not any(isinstance(m, UBMoELayer) for m in merged.modules())
    assert not any("ubmoe" in name for name, _ in merged.named_parameters())
    assert type(merged).__module__.startswith("transformers.models.")
    assert merged.config.is_causal is False
    real = mask.bool()  # (B, T): padded query positions carry no meaning
    got = hidden(merged, ids, mask)
    # LoRA: W + scale * B A merged in fp32 rounds differently from the separate delta; a copy is the same weights
    tol = dict(rtol=1e-4, atol=1e-5) if expert == "lora" else dict(rtol=0, atol=0)
    torch.testing.assert_close(got[real], expected[real], **tol)


def test_an_fp64_model_merges_with_its_attention_adapter_in_fp64():
    """The attention adapter's LoRA weights were fp32 on an fp64 base (the FFN's fp64): the bi merge differed from
    mode bi by 3e-6 where the FFN alone merges to 1e-15."""
    model = get_peft_model(tiny_model("llama", dtype=torch.float64), UBMoEConfig(attention_r=4)).eval()
    perturb_adapters(model)
    assert {p.dtype for n, p in model.named_parameters() if "_A." in n or "_B." in n} == {torch.float64}
    ids, mask = batch(padding=None)
    ubmoe_peft.set_mode(model, "bi")
    expected = hidden(model, ids, mask)
    torch.testing.assert_close(hidden(model.merge_and_unload(target="bi"), ids, mask), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("expert", EXPERTS)
def test_merged_bi_model_saves_and_loads_bidirectional_without_ubmoe(expert, tmp_path):
    model = wrapped("qwen2", expert)
    ids, mask = batch(padding="right")
    merged = model.merge_and_unload(target="bi")
    before = hidden(merged, ids, mask)
    merged.save_pretrained(tmp_path)
    assert not (tmp_path / "adapter_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert loaded.config.is_causal is False
    torch.testing.assert_close(hidden(loaded, ids, mask), before, rtol=0, atol=0)
    # bidirectional after loading: the first token's state changes with the last token
    last = int(mask[0].nonzero().max())  # row 0's last real token
    changed = ids.clone()
    changed[0, last] = (changed[0, last] + 1 - 3) % (128 - 3) + 3
    assert (hidden(loaded, changed, mask)[0, 0] - before[0, 0]).abs().max() > 1e-6


def test_merge_bi_leaves_models_sharing_the_config_object_causal():
    """transformers' ``from_config`` keeps the config object it is given: the merge set ``is_causal=False`` on it, so
    every other model built from it silently turned bidirectional."""
    torch.manual_seed(0)
    config = CONFIGS["llama"]()
    config._attn_implementation = "sdpa"
    other = AutoModelForCausalLM.from_config(config).eval()
    model = get_peft_model(AutoModelForCausalLM.from_config(config).eval(), UBMoEConfig()).eval()
    assert other.config is model.config
    ids, mask = batch(padding=None)
    before = hidden(other, ids, mask)
    merged = model.merge_and_unload(target="bi")
    assert merged.config.is_causal is False and getattr(config, "is_causal", None) is not False
    assert all(m.config is merged.config for m in merged.modules() if hasattr(m, "config"))
    torch.testing.assert_close(hidden(other, ids, mask), before, rtol=0, atol=0)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1 - 3) % (128 - 3) + 3
    torch.testing.assert_close(hidden(other, changed, mask)[:, 0], before[:, 0], rtol=0, atol=0)  # still causal
    assert (hidden(merged, changed, mask)[:, 0] - hidden(merged, ids, mask)[:, 0]).abs().max() > 1e-6


def test_merge_bi_in_bf16_stays_close_to_mode_bi():
    model = get_peft_model(tiny_model("llama", dtype=torch.bfloat16), UBMoEConfig()).eval()
    perturb_adapters(model, std=0.05)
    ids, mask = batch()
    ubmoe_peft.set_mode(model, "bi")
    expected = hidden(model, ids, mask).float()
    merged = model.merge_and_unload(target="bi")
    assert all(p.dtype == torch.bfloat16 for p in merged.parameters())
    real = mask.bool()
    # bf16 rounds the merged weight once (unit roundoff 2^-9 relative) where mode bi rounds the projection outputs
    torch.testing.assert_close(hidden(merged, ids, mask).float()[real], expected[real], rtol=5e-2, atol=5e-2)


def test_safe_merge_refuses_nan_before_changing_any_weight():
    model = wrapped("llama", "lora")
    last = [m for m in model.modules() if isinstance(m, UBMoELayer)][-1]
    with torch.no_grad():
        last.ubmoe_lora_B["default"]["down_proj"].weight[0, 0] = float("nan")
    before = state(model)
    with pytest.raises(ValueError, match=r"NaN/inf weights in \['down_proj'\] of layer 1"):
        model.merge_and_unload(target="bi", safe_merge=True)
    after = state(model)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) or before[k].isnan().any() for k in before)
    assert sum(isinstance(m, UBMoELayer) for m in model.modules()) == 2  # still wrapped and usable
    ids, mask = batch()
    ubmoe_peft.set_mode(model, "uni")
    assert torch.isfinite(hidden(model, ids, mask)).all()


def test_safe_merge_refuses_a_nan_router_in_the_moe_export():
    """Mode moe sends a NaN router's tokens to uni (NaN > NaN is False) and stays finite; the exported gate's softmax
    made every output NaN, past safe_merge."""
    model = wrapped("llama", "lora")
    last = [m for m in model.modules() if isinstance(m, UBMoELayer)][-1]
    with torch.no_grad():
        last.ubmoe_router["default"].weight[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"router of adapter 'default' has NaN/inf weights in layer 1"):
        model.merge_and_unload(safe_merge=True)
    with torch.no_grad():
        assert torch.isfinite(model(*batch()).logits).all()


@pytest.mark.parametrize("how", ["wrapped again", "unloaded"])
@pytest.mark.parametrize("call", ["moe", "bi", "unload"])
def test_a_spent_model_refuses_to_merge_or_unload(tmp_path, how, call):
    """A model whose base was wrapped again (the MISSION's save, then PeftModel.from_pretrained(base, d)) merged or
    stripped the newer model's layers in place (its next forward failed); one already unloaded "merged" into the
    plain base marked bidirectional, off from mode bi."""
    model = wrapped("llama", "lora")
    newer = None
    if how == "wrapped again":
        model.save_pretrained(tmp_path)
        newer = PeftModel.from_pretrained(model.get_base_model(), tmp_path).eval()
        expected = newer(*batch()).logits
    else:
        model.unload()
    spent = {"unload": model.unload, "moe": model.merge_and_unload, "bi": lambda: model.merge_and_unload(target="bi")}
    with pytest.raises(ValueError, match="Use the model that call returned"):
        spent[call]()
    if newer is not None:
        torch.testing.assert_close(newer(*batch()).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"target": "dense"}, ValueError, r"target='dense'.*'moe' or 'bi'"),
        ({"target": "bi", "adapter_names": ["other"]}, ValueError, r"adapter_names=\['other'\].*loaded adapters"),
    ],
)
def test_merge_errors_leave_the_model_untouched(kwargs, error, match):
    model = wrapped()
    before = state(model)
    with pytest.raises(error, match=match):
        model.merge_and_unload(**kwargs)
    after = state(model)
    assert all(torch.equal(before[k], after[k]) for k in before) and before.keys() == after.keys()
    with pytest.raises(NotImplementedError, match="merge_and_unload\\(target='bi'\\)"):
        [m for m in model.modules() if isinstance(m, UBMoELayer)][0].merge()


def test_merge_picks_the_active_adapter(tmp_path):
    model = wrapped()
    model.save_pretrained(tmp_path / "first")
    ids, mask = batch()
    ubmoe_peft.set_mode(model, "bi")
    expected = hidden(model, ids, mask)
    base = tiny_model("llama")
    loaded = PeftModel.from_pretrained(base, tmp_path / "first", adapter_name="first")
    loaded.add_adapter("second", UBMoEConfig())
    loaded.set_adapter("first")
    merged = loaded.merge_and_unload(target="bi")
    real = mask.bool()
    torch.testing.assert_close(hidden(merged, ids, mask)[real], expected[real], rtol=1e-4, atol=1e-5)


# ---- target="moe": a transformers MoE model -----------------------------------------------------------------------
MOE_ARCHS = {
    "llama": "MixtralForCausalLM",
    "mistral": "MixtralForCausalLM",
    "qwen2": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3MoeForCausalLM",
    "exaone": "MixtralForCausalLM",
    "internlm3": "MixtralForCausalLM",
    "iquestcoder": "MixtralForCausalLM",
    "seed_oss": "Qwen2MoeForCausalLM",
    "qwen3_5_text": "Qwen3_5MoeForCausalLM",
    "granite": "GraniteMoeForCausalLM",
    "granite_swa": "GraniteMoeSWAForCausalLM",
    "ernie4_5": "Ernie4_5_MoeForCausalLM",
    "olmo2": "FlexOlmoForCausalLM",
    "cohere2": "Cohere2MoeForCausalLM",
}


def logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("expert", EXPERTS)
@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_exported_moe_model_is_mode_moe(arch, expert, top_k, tmp_path):
    model = get_peft_model(tiny_model(arch), UBMoEConfig(expert_type=expert, top_k=top_k)).eval()
    perturb_adapters(model)
    ids, mask = batch(padding="left")
    expected = logits(model, ids, mask)  # mode moe
    shares = ubmoe_peft.routing_stats(model)
    assert all(0.0 < share < 1.0 for share in shares.values())  # both experts are used
    exported = model.merge_and_unload()  # target="moe" is the default
    assert type(exported).__name__ == MOE_ARCHS[arch]
    assert exported.config.num_experts_per_tok == top_k
    assert not any("ubmoe" in name for name, _ in exported.named_parameters())
    real = mask.bool()  # (B, T)
    # fp32 rounding only: the fused gate/up matmul and the merged LoRA weights sum in another order
    torch.testing.assert_close(logits(exported, ids, mask)[real], expected[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits(model, ids, mask), expected, rtol=0, atol=0)  # the wrapped model is unchanged

    exported.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(loaded).__name__ == MOE_ARCHS[arch]
    torch.testing.assert_close(logits(loaded, ids, mask), logits(exported, ids, mask), rtol=0, atol=0)
    # a static cache (compiled serving): Qwen3's layer_types, copied into the Qwen3-MoE config, made generate hand
    # the model one mask per layer type, and it failed
    greedy = dict(input_ids=ids[1:], max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected_tokens = model.generate(**greedy)
        assert torch.equal(loaded.generate(**greedy, cache_implementation="static"), expected_tokens)


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_exported_fresh_model_is_the_base_model(arch):
    base = tiny_model(arch)
    reference = tiny_model(arch)
    model = get_peft_model(base, UBMoEConfig())
    perturb_adapters(model)
    for layer in [m for m in model.modules() if isinstance(m, UBMoELayer)]:
        layer.ubmoe_router["default"].weight.data.zero_()  # a fresh router: every token ties, and ties go to uni
    exported = model.merge_and_unload(target="moe")
    ids, mask = batch(padding=None)
    torch.testing.assert_close(logits(exported, ids, mask), logits(reference, ids, mask), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(exported.generate(input_ids=ids, **greedy), reference.generate(input_ids=ids, **greedy))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "seed_oss"])
def test_export_with_layers_to_transform(arch):
    model = get_peft_model(tiny_model(arch), UBMoEConfig(layers_to_transform=[1])).eval()
    perturb_adapters(model)
    ids, mask = batch(padding="right")
    expected = logits(model, ids, mask)
    exported = model.merge_and_unload()
    if arch != "llama":
        assert exported.config.mlp_only_layers == [0]  # the untouched layer stays a dense FFN
    real = mask.bool()
    torch.testing.assert_close(logits(exported, ids, mask)[real], expected[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("arch", ["granite", "ernie4_5", "olmo2", "cohere2", "qwen3_5_text"])
def test_export_to_a_twin_without_dense_layers(arch, top_k):
    """Only Qwen2/Qwen3-MoE keep a layer dense: in the other twins (Mixtral's way) a layer outside layers_to_transform
    gets the original FFN as both experts and a zero router, which top-1 and top-2 both turn into that FFN."""
    model = get_peft_model(tiny_model(arch), UBMoEConfig(layers_to_transform=[1], top_k=top_k)).eval()
    perturb_adapters(model)
    ids, mask = batch(padding="right")
    expected = logits(model, ids, mask)
    exported = model.merge_and_unload()
    experts = [p for n, p in exported.named_parameters() if ".layers.0." in n and ".experts." in n]
    assert len(experts) == 2 and all(torch.equal(p[0], p[1]) for p in experts)  # uni twice in layer 0
    real = mask.bool()
    torch.testing.assert_close(logits(exported, ids, mask)[real], expected[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target", ["bi", "moe"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_merging_an_adapter_on_fewer_layers_than_another(arch, target):
    """Adapter "two" wraps layer 0 only, "default" every layer: the export of "two" reads the other layers' FFNs
    from inside default's UBMoE layers (it used to take those layers for plain FFNs and fail on their names)."""
    model = get_peft_model(tiny_model(arch), UBMoEConfig(expert_type="copy")).eval()
    model.add_adapter("two", UBMoEConfig(layers_to_transform=[0]))
    perturb_adapters(model)
    model.eval().set_adapter("two")
    ids, mask = batch(padding="right")
    with ubmoe_peft.use_mode(model, target):
        expected = logits(model, ids, mask)
    out = model.merge_and_unload(target=target, adapter_names=["two"])
    real = mask.bool()
    torch.testing.assert_close(logits(out, ids, mask)[real], expected[real], rtol=1e-4, atol=1e-4)


def test_export_refuses_architectures_without_a_transformers_moe_twin():
    model = wrapped("gemma")
    before = state(model)
    with pytest.raises(NotImplementedError, match=r"model_type='gemma'.*target='bi'"):
        model.merge_and_unload()
    assert all(torch.equal(before[k], v) for k, v in state(model).items())


@pytest.mark.parametrize(
    ("auto", "task_type"), [("AutoModel", None), ("AutoModelForSequenceClassification", "SEQ_CLS")]
)
def test_export_refuses_a_model_that_is_not_a_causal_lm(auto, task_type):
    """The export built a MixtralForCausalLM whatever the base was: a strict load_state_dict then failed with a
    screen of missing keys (no LM head) or an unexpected classifier ``score.weight``."""
    import transformers

    torch.manual_seed(0)
    base = getattr(transformers, auto).from_config(CONFIGS["llama"]()).eval()
    model = get_peft_model(base, UBMoEConfig(task_type=task_type)).eval()
    perturb_adapters(model)
    before = state(model)
    with pytest.raises(ValueError, match=rf"\(LlamaForCausalLM here\).*is a {type(base).__name__}.*target='bi'"):
        model.merge_and_unload()
    assert all(torch.equal(before[k], v) for k, v in state(model).items())
    assert type(model.merge_and_unload(target="bi")) is type(base)  # the embedding model is fine


@pytest.mark.parametrize(("model_dtype", "router_dtype"), [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_export_warns_when_the_routers_compute_in_another_dtype_than_the_export(model_dtype, router_dtype):
    """transformers computes a MoE gate in the model's dtype: an fp32 model with bf16 routers exported silently
    differed from mode moe (logits by up to 0.12 on a tiny model) where tokens' two logits lay within bf16 rounding."""
    import warnings

    config = UBMoEConfig(router_dtype=router_dtype)
    model = get_peft_model(tiny_model("llama", dtype=getattr(torch, model_dtype)), config).eval()
    perturb_adapters(model)
    with pytest.warns(UserWarning, match=rf"routers compute in torch.{router_dtype} .*dtype, torch.{model_dtype}") as w:
        model.merge_and_unload()
    assert w[0].filename == __file__  # pointed at the caller of merge_and_unload
    same = get_peft_model(tiny_model("llama", dtype=getattr(torch, model_dtype)), UBMoEConfig(router_dtype=model_dtype))
    perturb_adapters(same)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*routers compute in")
        same.merge_and_unload()  # the same dtype: an exact export, no warning


def test_export_refuses_biases_mixtral_does_not_have():
    config = CONFIGS["llama"]()
    config.attention_bias = True  # read when the attention layers are built
    model = get_peft_model(AutoModelForCausalLM.from_config(config), UBMoEConfig())
    with pytest.raises(ValueError, match=r"\['attention_bias'\]=True to Mixtral"):
        model.merge_and_unload()


@pytest.mark.parametrize(
    ("arch", "flag", "twin"),
    [
        ("exaone", "mlp_bias", "Mixtral"),
        ("granite", "mlp_bias", "GraniteMoe"),
        ("ernie4_5", "use_bias", "Ernie4_5_Moe"),
        ("seed_oss", "attention_out_bias", "Qwen2Moe"),
    ],
)
def test_export_refuses_biases_the_moe_twin_does_not_have(arch, flag, twin):
    config = config_of(arch)
    setattr(config, flag, True)  # read when the layers are built
    model = get_peft_model(AutoModelForCausalLM.from_config(config), UBMoEConfig())
    with pytest.raises(ValueError, match=rf"\['{flag}'\]=True to {twin}, which has no such biases"):
        model.merge_and_unload()


@pytest.mark.parametrize(("arch", "bias"), [("granite", True), ("olmo2", True), ("cohere2", True), ("seed_oss", False)])
def test_export_carries_the_attention_biases_of_its_twin(arch, bias):
    """The twins with attention biases take the dense model's setting (Seed-OSS's as Qwen2-MoE's qkv_bias)."""
    config = config_of(arch)
    config.attention_bias = bias
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(config), UBMoEConfig()).eval()
    perturb_adapters(model)
    ids, mask = batch(padding="left")
    expected = logits(model, ids, mask)
    exported = model.merge_and_unload()
    assert any(n.endswith("q_proj.bias") for n, _ in exported.named_parameters()) == bias
    real = mask.bool()
    torch.testing.assert_close(logits(exported, ids, mask)[real], expected[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("router_dtype", ["float32", "bfloat16"])
def test_ernie_export_keeps_its_gates_in_fp32(router_dtype):
    """ERNIE 4.5-MoE keeps its router weight in fp32 and computes its gate in fp32 in any model dtype: the export of a
    bf16 model takes our fp32 routers as they are (they used to be rounded to bf16) and warns only for bf16 routers."""
    import warnings

    model = get_peft_model(tiny_model("ernie4_5", dtype=torch.bfloat16), UBMoEConfig(router_dtype=router_dtype))
    perturb_adapters(model)
    routers = [m.ubmoe_router["default"].weight.detach().clone() for m in model.modules() if isinstance(m, UBMoELayer)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported = model.merge_and_unload()
    warned = [w for w in caught if "routers compute in" in str(w.message)]
    assert len(warned) == (router_dtype == "bfloat16")
    assert all("gates in torch.float32" in str(w.message) for w in warned)
    gates = [exported.model.layers[i].mlp.gate.weight for i in range(2)]
    assert all(g.dtype == torch.float32 and torch.equal(g, r.float()) for g, r in zip(gates, routers, strict=True))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("trained", ["lm_head", "embed_tokens"])
@pytest.mark.parametrize("target", ["unload", "bi", "moe"])
def test_modules_to_save_carry_over(target, trained, tied, tmp_path):
    """A trained lm_head or embedding (modules_to_save) is part of what unload, the bi merge and the export return,
    as in PEFT, also saved and reloaded, and also on a base with tied embeddings (SmolLM2's), which a trained copy
    unties: the export used to tie them again and differ from mode moe."""
    config = CONFIGS["llama"]()
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    model = get_peft_model(base, UBMoEConfig(modules_to_save=[trained])).eval()
    perturb_adapters(model)
    copy = model.get_submodule(f"base_model.model.{'lm_head' if trained == 'lm_head' else 'model.embed_tokens'}")
    with torch.no_grad():
        copy.modules_to_save["default"].weight.mul_(-2.0)
    ids, mask = batch(padding="left")
    ubmoe_peft.set_mode(model, {"unload": "uni"}.get(target, target))
    expected = logits(model, ids, mask)
    out = model.unload() if target == "unload" else model.merge_and_unload(target=target)
    assert type(out.lm_head) is torch.nn.Linear
    out.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    real = mask.bool()
    for got in (out, reloaded):
        torch.testing.assert_close(logits(got, ids, mask)[real], expected[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target", ["bi", "moe"])
def test_merging_another_adapter_takes_its_modules_to_save(target):
    """merge_and_unload(adapter_names=["two"]) while "default" is active: PEFT's unload of a modules_to_save wrapper
    returns the active adapter's copy, and the result used to be two's experts with default's head."""
    model = get_peft_model(tiny_model("llama"), UBMoEConfig(modules_to_save=["lm_head"])).eval()
    model.add_adapter("two", UBMoEConfig(modules_to_save=["lm_head"]))
    head = model.get_submodule("base_model.model.lm_head")
    with torch.no_grad():
        head.modules_to_save["default"].weight.mul_(1.5)
        head.modules_to_save["two"].weight.mul_(-0.5)
    perturb_adapters(model)
    ids, mask = batch(padding="left")
    model.set_adapter("two")
    with ubmoe_peft.use_mode(model, target):
        expected = logits(model, ids, mask)
    model.set_adapter("default")
    out = model.merge_and_unload(target=target, adapter_names=["two"])
    real = mask.bool()
    torch.testing.assert_close(logits(out, ids, mask)[real], expected[real], rtol=1e-4, atol=1e-4)


def test_export_refuses_qwen3_with_sliding_window_layers_only():
    """Qwen3-MoE places its sliding layers differently; a Qwen3 with use_sliding_window=True but no sliding layer
    (max_window_layers >= its layers) was refused too."""
    from conftest import _COMMON
    from transformers import Qwen3Config

    for window_layers, slides in ((1, True), (2, False)):
        config = Qwen3Config(
            **_COMMON, head_dim=8, use_sliding_window=True, sliding_window=4, max_window_layers=window_layers
        )
        assert ("sliding_attention" in config.layer_types) == slides
        model = get_peft_model(AutoModelForCausalLM.from_config(config), UBMoEConfig())
        perturb_adapters(model)
        if slides:
            with pytest.raises(ValueError, match="Qwen3 model with sliding-window layers"):
                model.merge_and_unload()
            continue
        ids, mask = batch(padding="left", t=12)
        expected = logits(model.eval(), ids, mask)
        out = model.merge_and_unload()
        real = mask.bool()
        torch.testing.assert_close(logits(out, ids, mask)[real], expected[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma"])
def test_mode_bi_at_prefill_sizes_computes_with_the_merged_weights(arch, monkeypatch):
    """At inference, a call with as many rows as the product B A costs (`_merge_pays`: 22 for this 32 -> 64 FFN)
    runs each LoRA projection once on `merged_weight`, the weight the bi merge writes: mode bi then gives the merged
    model's bits. Fewer rows take the rank-r path, equal within rounding, and so do
    mode moe's per-token scale columns."""
    from ubmoe_peft.tuners.ubmoe import lora as lora_module

    model = wrapped(arch, "lora")
    decided = []
    original = lora_module._merge_pays
    monkeypatch.setattr(lora_module, "_merge_pays", lambda *args: decided.append(original(*args)) or decided[-1])
    ubmoe_peft.set_mode(model, "bi")
    large, small = batch(b=3, t=9, padding=None), batch(b=2, t=9, padding=None)  # 27 and 18 rows per FFN call
    expected = {rows: hidden(model, ids, mask) for rows, (ids, mask) in (("large", large), ("small", small))}
    assert decided == [True] * 6 + [False] * 6  # 2 layers x 3 projections, per batch
    ubmoe_peft.set_mode(model, "moe")
    decided.clear()
    hidden(model, *large)  # mixed routing, too few routed tokens per layer to split: the per-token scale column
    assert decided and not any(decided)
    merged = model.merge_and_unload(target="bi")
    torch.testing.assert_close(hidden(merged, *large), expected["large"], rtol=0, atol=0)
    torch.testing.assert_close(hidden(merged, *small), expected["small"], rtol=1e-4, atol=1e-5)


def test_merge_pays_only_for_whole_calls_in_full_precision():
    from ubmoe_peft.tuners.ubmoe.lora import _merge_pays

    weight, b = torch.zeros(64, 32), torch.zeros(64, 8)  # (C_out, C_in), (C_out, r): break-even 32 * 64 / 96 rows
    assert _merge_pays(22, weight, b, 2.0) and not _merge_pays(21, weight, b, 2.0)
    assert not _merge_pays(1000, weight, b, torch.full((1000, 1), 2.0))  # a per-token column: some rows are uni
    assert not _merge_pays(1000, weight.bfloat16(), b.bfloat16(), 2.0)  # a bf16 merged weight would round the delta
    assert not _merge_pays(1000, weight.bfloat16(), b, 2.0)  # the rank-r side in fp32 keeps its precision
    assert _merge_pays(1000, weight.double(), b.double(), 2.0)


def test_merged_weight_is_full_precision_math_under_autocast():
    from ubmoe_peft.tuners.ubmoe.lora import merged_weight

    gen = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(shape, generator=gen) for shape in ((64, 32), (8, 32), (64, 8)))
    expected = merged_weight(w, a, b, 2.0)
    torch.testing.assert_close(expected, w + 2.0 * b @ a, rtol=1e-6, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # addmm would run in bf16 here
        assert torch.equal(merged_weight(w, a, b, 2.0), expected)
    assert merged_weight(w.bfloat16(), a, b, 2.0).dtype == torch.bfloat16  # fp32 math, the weight's dtype
