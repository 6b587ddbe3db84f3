"""QLoRA: UBMoE on bitsandbytes 4-bit (nf4/fp4, double quantization, bf16/fp32 compute) and 8-bit bases, on CPU.

The reference for every numeric check is the *dequantized float model*: the same tiny model with each quantized
linear replaced by an fp32 ``nn.Linear`` holding exactly the weight bitsandbytes multiplies with (in training, for
8-bit layers: LLM.int8() quantizes the activations too in eval). Whatever differs
between the two is then the quantized backend's arithmetic (compute dtype, kernels), not quantization error.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training
from torch import nn
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

import ubmoe_peft
from ubmoe_peft import UBMoEConfig, UBMoELayer
from ubmoe_peft.tuners.ubmoe.bnb import backend_for, dequantized_weight, is_quantized_linear

bnb = pytest.importorskip("bitsandbytes")  # a dev dependency; CI installs it (pip install ubmoe-peft[dev])

VOCAB = 128
QUANTS = {
    "nf4-bf16-dq": dict(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    ),
    "fp4-fp32": dict(
        load_in_4bit=True,
        bnb_4bit_quant_type="fp4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_use_double_quant=False,
    ),
    "int8": dict(load_in_8bit=True),
}
# Relative gradient error ||g_q - g_ref|| / ||g_ref|| allowed per expert tensor, by the compute arithmetic:
# - fp32 compute multiplies with exactly the reference weights, only the summation order differs: fp32 unit
#   roundoff 6e-8 times a few hundred accumulated terms per dot product is ~1e-5; 1e-4 leaves a 10x margin.
# - bf16 compute rounds the input, the dequantized weight and the output of every projection to bf16 (unit
#   roundoff u = 2^-9 = 2e-3), forward and backward (bnb's backward multiplies the bf16 output gradient with the
#   bf16 weight): ~3u = 6e-3 per projection, and a gradient passes through up to ~6 projections in 2 layers, so
#   errors of 1-2e-2 are expected; 5e-2 still catches a lost or doubled gradient path (error >= ~0.3).
# - LLM.int8() training on CPU multiplies with the dequantized int8 weight in the input dtype (fp32), the same
#   weight as the reference: fp32 tolerance.
GRAD_RTOL = {"nf4-bf16-dq": 5e-2, "fp4-fp32": 1e-4, "int8": 1e-4}


def _config(intermediate: int = 128) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )


@pytest.fixture(scope="module")
def saved_dirs(tmp_path_factory):
    """Float checkpoints of the tiny model (intermediate 128, and 688 which bnb's CPU repacking rejects)."""
    dirs = {}
    for intermediate in (128, 688):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(intermediate), attn_implementation="sdpa")
        dirs[intermediate] = tmp_path_factory.mktemp(f"tiny{intermediate}")
        model.save_pretrained(dirs[intermediate])
    return dirs


def load_quantized(path, quant: str) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=BitsAndBytesConfig(**QUANTS[quant]), device_map="cpu", attn_implementation="sdpa"
    )
    return model.eval()


def dequantized_float_copy(quantized: nn.Module, path) -> nn.Module:
    """The float model whose linears hold exactly the weights ``quantized`` multiplies with (fp32)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if is_quantized_linear(module):
                model.get_submodule(name).weight.copy_(dequantized_weight(module).float())  # (out, in)
    return model


def perturb(model: nn.Module, seed: int = 1) -> None:
    """Non-zero LoRA B / copy offsets and routers, so every expert parameter gets a gradient and routing is mixed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".ubmoe_" in name and any(kind in name for kind in ("lora_B", "attn_B", "router", "copy")):
                noise = torch.randn(param.shape, generator=gen) * (1.0 if "router" in name else 0.05)
                param.add_(noise.to(param.dtype))


def copy_adapter(source: nn.Module, target: nn.Module) -> None:
    params = dict(target.named_parameters())
    with torch.no_grad():
        for name, param in source.named_parameters():
            if ".ubmoe_" in name:
                params[name].copy_(param)


def ids_batch(b: int, t: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))  # (B, T)


def probe_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A scalar that depends on every hidden state: a fixed random projection of the last layer's states."""
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]  # (B, T, C)
    probe = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(7))  # (C,)
    return (hidden.float() @ probe).pow(2).mean()


def contrastive_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """In-batch-negatives InfoNCE (scale 20) between two views: the text and the text without its last token."""

    def embed(x):  # (B, T) -> (B, C), mean pooling
        return nn.functional.normalize(model(input_ids=x, output_hidden_states=True).hidden_states[-1].mean(1), dim=-1)

    sims = embed(ids) @ embed(ids[:, :-1]).T * 20.0  # (B, B)
    return nn.functional.cross_entropy(sims.float(), torch.arange(ids.shape[0]))


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()  # (B, T, V)


# ---- forward in all modes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("expert", ["lora", "copy"])
@pytest.mark.parametrize("quant", list(QUANTS))
def test_forward_in_all_modes(saved_dirs, quant, expert):
    reference_base = load_quantized(saved_dirs[128], quant)
    model = get_peft_model(load_quantized(saved_dirs[128], quant), UBMoEConfig(expert_type=expert)).eval()
    ids = ids_batch(2)
    from ubmoe_peft.tuners.ubmoe.bnb import prepare_quantized_base

    prepare_quantized_base(reference_base)  # the same bnb kernel path as the wrapped model (see bnb.py)
    base = logits(reference_base, ids)
    assert torch.equal(logits(model, ids), base)  # fresh mode moe is the base model
    ubmoe_peft.set_mode(model, "uni")
    assert torch.equal(logits(model, ids), base)
    perturb(model)
    ubmoe_peft.set_mode(model, "bi")
    bi = logits(model, ids)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    assert not torch.allclose(logits(model, changed)[:, 0], bi[:, 0])  # bi: the first token sees the last one
    ubmoe_peft.set_mode(model, "moe")
    moe = logits(model, ids)
    share = ubmoe_peft.routing_stats(model)
    assert set(share) == {0, 1} and all(0.0 < s < 1.0 for s in share.values())  # both experts in use
    assert torch.isfinite(bi).all() and torch.isfinite(moe).all() and not torch.equal(moe, base)
    torch.testing.assert_close(logits(model, changed)[:, :-1], moe[:, :-1])  # moe stays causal


# ---- stage steps --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["contrastive", "router"])
@pytest.mark.parametrize(("quant", "expert"), [("nf4-bf16-dq", "lora"), ("nf4-bf16-dq", "copy"), ("int8", "lora")])
def test_stage_step_changes_only_trainable_parameters(saved_dirs, quant, expert, stage):
    base = prepare_model_for_kbit_training(load_quantized(saved_dirs[128], quant), use_gradient_checkpointing=True)
    model = get_peft_model(base, UBMoEConfig(expert_type=expert, lora_dropout=0.0))
    perturb(model)
    ubmoe_peft.set_stage(model, stage)
    model.train()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    kind = "router" if stage == "router" else ("lora" if expert == "lora" else "copy")
    assert trainable and all(f"ubmoe_{kind}" in n for n in trainable)
    before = {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}  # includes 4-bit codes, absmax
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    ids = ids_batch(4)
    loss = contrastive_loss(model, ids) if stage == "contrastive" else model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {n for n in trainable}, (sorted(changed ^ trainable))[:5]


def test_a_copy_expert_under_fp16_compute_trains_with_loss_scaling(saved_dirs):
    """bnb_4bit_compute_dtype=float16 (QLoRA on GPUs without bf16) made the copy expert trainable fp16, which fp16
    mixed precision refuses at its first step ("Attempting to unscale FP16 gradients")."""
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float16)
    base = AutoModelForCausalLM.from_pretrained(saved_dirs[128], quantization_config=quant, device_map="cpu")
    model = get_peft_model(prepare_model_for_kbit_training(base), UBMoEConfig(expert_type="copy"))
    ubmoe_peft.set_stage(model, "contrastive")
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and {p.dtype for p in trainable} == {torch.float32}
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    before = [p.detach().clone() for p in trainable]
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = contrastive_loss(model, ids_batch(4))
    scaler.scale(loss).backward()
    scaler.step(optimizer)  # unscales first: the step that failed
    scaler.update()
    assert any(not torch.equal(b, p) for b, p in zip(before, trainable, strict=True))


# ---- gradients against the dequantized float model ----------------------------------------------------------------
def _expert_grads(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    probe_loss(model, ids).backward()
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("attention_r", [0, 4])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("expert", ["lora", "copy"])
@pytest.mark.parametrize("quant", list(QUANTS))
def test_expert_gradients_match_dequantized_float_model(saved_dirs, quant, expert, batch_size, attention_r):
    quantized = load_quantized(saved_dirs[128], quant)
    ids = ids_batch(batch_size)
    with torch.no_grad():
        quantized(input_ids=ids)  # an eval forward first: bnb would repack 4-bit layers into a no-backward layout
    reference = dequantized_float_copy(quantized, saved_dirs[128])
    config = UBMoEConfig(expert_type=expert, lora_dropout=0.0, attention_r=attention_r)  # 4: + mode-bi attention
    model = get_peft_model(quantized, config)
    reference = get_peft_model(reference, copy.deepcopy(config))
    perturb(model)
    copy_adapter(model, reference)
    for m in (model, reference):
        ubmoe_peft.set_stage(m, "contrastive")
        m.eval()
        with torch.no_grad():
            m(input_ids=ids)  # and an eval forward on the wrapped model, before the backward
        m.train()  # dropout is 0; train mode is what matters for LLM.int8(), whose eval path quantizes activations
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*autograd kernel was not registered.*")
        grads = _expert_grads(model, ids)
    expected = _expert_grads(reference, ids)
    count = (12 if expert == "lora" else 6) + (16 if attention_r else 0)  # 2 layers; q, k, v, o with A and B
    assert grads.keys() == expected.keys() and len(grads) == count
    for name, grad in grads.items():
        scale = expected[name].norm()
        assert scale > 0, name  # every expert parameter is on the gradient path
        error = float((grad - expected[name]).norm() / scale)
        assert error < GRAD_RTOL[quant], f"{name}: relative gradient error {error:.2e} (tolerance {GRAD_RTOL[quant]})"


def test_gradient_checkpointing_gives_the_same_gradients(saved_dirs):
    grads = []
    for checkpointing in (False, True):
        base = prepare_model_for_kbit_training(
            load_quantized(saved_dirs[128], "fp4-fp32"), use_gradient_checkpointing=checkpointing
        )
        assert base.is_activation_checkpointing == checkpointing
        torch.manual_seed(0)  # the same LoRA A initialisation in both runs
        model = get_peft_model(base, UBMoEConfig(expert_type="lora", lora_dropout=0.0))
        perturb(model)
        model.train()
        ids = ids_batch(3)
        for stage in ("contrastive", "router"):
            ubmoe_peft.set_stage(model, stage)
            model.zero_grad()
            loss = contrastive_loss(model, ids) if stage == "contrastive" else model(input_ids=ids, labels=ids).loss
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    for plain, checkpointed in zip(grads[:2], grads[2:], strict=True):
        assert plain.keys() == checkpointed.keys() and plain
        for name in plain:
            torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7)


# ---- the weight a 4-bit layer multiplies with ---------------------------------------------------------------------
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
def test_dequantized_weight_is_what_the_layer_multiplies_with(tmp_path, storage, compute):
    """Also from a bf16 checkpoint under fp32 compute (BitsAndBytesConfig's default compute dtype), where bitsandbytes
    >= 0.50 dequantizes into fp32 directly: a copy expert starts as exactly the FFN it copies."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(), dtype=storage).save_pretrained(tmp_path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quant, device_map="cpu")
    from ubmoe_peft.tuners.ubmoe.bnb import make_dense_copy, prepare_quantized_base

    prepare_quantized_base(model)  # the generic kernel path, as in every wrapped model
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))  # (B, T, C)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            layer = getattr(mlp, name)
            inputs = torch.randn(2, 5, layer.in_features, generator=torch.Generator().manual_seed(2))  # (B, T, in)
            weight = dequantized_weight(layer).to(compute)  # (out, in)
            assert torch.equal(layer(inputs), nn.functional.linear(inputs.to(compute), weight).float()), name
        assert torch.equal(make_dense_copy(mlp)(x), mlp(x))


# ---- shapes bnb's CPU kernels reject ------------------------------------------------------------------------------
@pytest.mark.parametrize("expert", ["lora", "copy"])
def test_intermediate_size_bnb_cpu_packing_rejects(saved_dirs, expert):
    # 688 % 32 != 0: bnb's CPU inference repacking asserts on it (on AVX512-BF16 CPUs); UBMoE uses the generic path.
    quantized = load_quantized(saved_dirs[688], "nf4-bf16-dq")
    reference = dequantized_float_copy(quantized, saved_dirs[688])
    model = get_peft_model(quantized, UBMoEConfig(expert_type=expert)).eval()
    ids = ids_batch(2)
    for mode in ("uni", "bi", "moe"):
        ubmoe_peft.set_mode(model, mode)
        assert torch.isfinite(logits(model, ids)).all()
    ubmoe_peft.set_mode(model, "uni")
    # bf16 compute against the fp32 reference: logits agree to bf16 precision (~1e-2 absolute at this scale).
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), rtol=0, atol=5e-2)


@pytest.mark.parametrize("expert", ["lora", "copy"])
@pytest.mark.parametrize("quant", ["nf4-bf16-dq", "fp4-fp32"])
def test_bnb_cpu_repacking_is_undone_when_wrapping(saved_dirs, quant, expert):
    """On an AVX512-BF16 CPU bitsandbytes repacks a Linear4bit for its inference kernel at the first eval-mode
    no-grad forward (a check of the base before wrapping it does that); wrapping undoes it. bitsandbytes' inverse
    puts the absmax scales back in order only for double quantization: without it (BitsAndBytesConfig's default)
    every weight wider than one 64-column block was read with other blocks' scales, 21-26% off, silently. The
    repacking is applied here with bitsandbytes' own function, as its forward would on such a CPU."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    reference = load_quantized(saved_dirs[128], quant)
    model = load_quantized(saved_dirs[128], quant)
    for module in model.modules():
        if is_quantized_linear(module):
            module.weight.data, module.weight.quant_state = _convert_weight_packed_for_cpu(
                module.weight.data, module.weight.quant_state
            )
    with pytest.warns(UserWarning, match=r"\d+ 4-bit layers of this base were repacked .* wrap the base"):
        model = get_peft_model(model, UBMoEConfig(expert_type=expert)).eval()  # the scales' rounding stays: said
    for name, module in reference.named_modules():
        if is_quantized_linear(module):
            ours = model.get_base_model().get_submodule(name.replace(".mlp.", ".mlp.base_layer."))
            assert not ours.weight.quant_state.packing_format_for_cpu, name
            want = dequantized_weight(module).float()  # (out, in)
            # the repacking rounds the absmax scales to bf16 (unit roundoff 2^-9): that much error stays
            error = (dequantized_weight(ours).float() - want).norm() / want.norm()
            assert error < 5e-3, (name, float(error))
    ubmoe_peft.set_mode(model, "uni")
    prepare_reference = get_peft_model(reference, UBMoEConfig(expert_type=expert)).eval()  # the generic kernel path
    ubmoe_peft.set_mode(prepare_reference, "uni")
    ids = ids_batch(2)
    torch.testing.assert_close(logits(model, ids), logits(prepare_reference, ids), rtol=0, atol=5e-2)


def test_unquantized_bnb_layer_gets_a_clear_error():
    ffn_model = AutoModelForCausalLM.from_config(_config())
    layer = ffn_model.model.layers[0].mlp
    # A Linear4bit whose weight was never quantized (bnb quantizes when the layer is moved to a device).
    layer.up_proj = bnb.nn.Linear4bit(64, 128, bias=False, quant_type="nf4")
    with pytest.raises(TypeError, match="not quantized yet.*device_map"):
        get_peft_model(ffn_model, UBMoEConfig())
    with pytest.raises(TypeError, match="not quantized yet"):
        backend_for(layer.up_proj)


def test_an_8bit_base_keeping_float_weights_is_named(saved_dirs):
    """llm_int8_has_fp16_weight=True keeps float weights in Linear8bitLt: the error said the layer was not
    quantized yet and told the user to load it with a BitsAndBytesConfig, which they had done."""
    quant = BitsAndBytesConfig(load_in_8bit=True, llm_int8_has_fp16_weight=True)
    base = AutoModelForCausalLM.from_pretrained(saved_dirs[128], quantization_config=quant, device_map="cpu")
    with pytest.raises(TypeError, match=r"llm_int8_has_fp16_weight=True.*does not support.*load_in_8bit=True"):
        get_peft_model(base, UBMoEConfig())


# ---- save / load --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("expert", ["lora", "copy"])
def test_adapter_from_4bit_run_loads_on_4bit_and_full_precision_bases(saved_dirs, tmp_path, expert):
    quant = "fp4-fp32"  # fp32 compute: the float-base comparison below is then exact up to fp32 summation order
    model = get_peft_model(load_quantized(saved_dirs[128], quant), UBMoEConfig(expert_type=expert))
    perturb(model)
    model.eval()
    ids = ids_batch(2)
    outputs = {}
    for mode in ("uni", "bi", "moe"):
        ubmoe_peft.set_mode(model, mode)
        outputs[mode] = logits(model, ids)
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert saved and all(".ubmoe_" in k for k in saved)  # adapter only: no quantized base weights

    quantized_base = load_quantized(saved_dirs[128], quant)
    dequantized_base = dequantized_float_copy(quantized_base, saved_dirs[128])
    original_base = AutoModelForCausalLM.from_pretrained(saved_dirs[128], dtype=torch.float32).eval()
    loaded = {
        name: PeftModel.from_pretrained(base, tmp_path).eval()
        for name, base in (("4bit", quantized_base), ("dequantized", dequantized_base), ("original", original_base))
    }
    for mode in ("uni", "bi", "moe"):
        for peft_model in loaded.values():
            ubmoe_peft.set_mode(peft_model, mode)
        torch.testing.assert_close(logits(loaded["4bit"], ids), outputs[mode], rtol=0, atol=0)
        # A full-precision base holding the dequantized weights reproduces the 4-bit run: the adapter carries over.
        torch.testing.assert_close(logits(loaded["dequantized"], ids), outputs[mode], rtol=1e-4, atol=1e-4)
        # On the original weights W instead of Q(W), the outputs move by the quantization error, in every mode alike.
        quantization_error = (logits(loaded["original"], ids) - outputs[mode]).abs().max()
        assert 1e-3 < quantization_error < 1.0


@pytest.mark.parametrize("expert", ["lora", "copy"])
def test_merge_into_a_quantized_base_is_refused_before_any_change(saved_dirs, expert):
    model = get_peft_model(load_quantized(saved_dirs[128], "nf4-bf16-dq"), UBMoEConfig(expert_type=expert))
    perturb(model)
    before = {k: v.detach().clone() for k, v in model.state_dict().items() if v.dtype.is_floating_point}
    with pytest.raises(ValueError, match=r"quantized layers .*Load the base model without quantization"):
        model.merge_and_unload(target="bi")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    ubmoe_peft.set_mode(model, "bi")
    assert torch.isfinite(logits(model.eval(), ids_batch(2))).all()  # still wrapped and usable
    fresh = get_peft_model(load_quantized(saved_dirs[128], "nf4-bf16-dq"), UBMoEConfig(expert_type=expert))
    with pytest.raises(ValueError, match=r"Cannot export to a MoE model: \d+ layers are quantized .*without quant"):
        fresh.merge_and_unload()  # zero routers never read the bi expert, so the FFN check was never reached


@pytest.mark.parametrize("quant", ["nf4-bf16-dq", "int8"])
def test_modules_to_save_naming_a_quantized_layer_is_refused_before_any_change(saved_dirs, quant):
    """PEFT copies a modules_to_save module and makes its weights trainable: on a packed bitsandbytes weight that
    failed with "only Tensors of floating point dtype can require gradients", after the UBMoE layers were built in
    the caller's base and its embeddings and norms frozen."""
    base = load_quantized(saved_dirs[128], quant)
    trainable = {n for n, p in base.named_parameters() if p.requires_grad}
    with pytest.raises(ValueError, match=r"'o_proj'.*quantized linear layer.*llm_int8_skip_modules"):
        get_peft_model(base, UBMoEConfig(modules_to_save=["o_proj"]))
    assert not any(isinstance(m, UBMoELayer) for m in base.modules())
    assert {n for n, p in base.named_parameters() if p.requires_grad} == trainable
    model = get_peft_model(base, UBMoEConfig(modules_to_save=["embed_tokens"]))  # a float module is fine
    assert any(isinstance(m, UBMoELayer) for m in model.modules())


def test_router_trainer_on_a_4bit_base_keeps_the_router_dtype(saved_dirs, tmp_path):
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ubmoe_peft import RouterConfig, RouterTrainer

    words = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", eos_token="w2", unk_token="w3")
    texts = Dataset.from_dict({"text": [" ".join(f"w{j}" for j in range(i, i + 12)) for i in range(3, 40)]})
    model = get_peft_model(load_quantized(saved_dirs[128], "nf4-bf16-dq"), UBMoEConfig())
    with torch.no_grad():  # a bi expert that differs from the base FFN, as after stage 1: the routers get a gradient
        for name, param in model.named_parameters():
            if ".ubmoe_lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(0)) * 0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".ubmoe_router." in n}
    args = RouterConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, max_length=32, report_to="none"
    )
    RouterTrainer(model, args=args, train_dataset=texts, processing_class=tokenizer).train()
    routers = {n: p for n, p in model.named_parameters() if ".ubmoe_router." in n}
    assert {p.dtype for p in routers.values()} == {torch.float32}  # TRL had cast them to bf16
    assert all(not torch.equal(p, before[n]) for n, p in routers.items())


def test_a_copy_expert_trained_in_fp32_on_a_bf16_compute_base_loads_back_unrounded(saved_dirs, tmp_path):
    """Wrapped, then prepared (prepare_model_for_kbit_training upcasts the bf16 copy to fp32, which trains and saves in
    fp32): the reload built the copy in bf16 first and rounded the saved weights (mode bi off by 2.5e-3 relative)."""
    model = prepare_model_for_kbit_training(
        get_peft_model(load_quantized(saved_dirs[128], "nf4-bf16-dq"), UBMoEConfig(expert_type="copy"))
    )
    copies = {n: p for n, p in model.named_parameters() if ".ubmoe_copy." in n}
    assert {p.dtype for p in copies.values()} == {torch.float32}
    with torch.no_grad():
        for param in copies.values():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(3)) * 1e-3)
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(load_quantized(saved_dirs[128], "nf4-bf16-dq"), tmp_path)
    restored = dict(loaded.named_parameters())
    for name, param in copies.items():
        assert restored[name].dtype == torch.float32 and torch.equal(restored[name], param), name
    ids = ids_batch(2)
    prepare_model_for_kbit_training(loaded)  # prepared the same way: the same outputs
    for mode in ("bi", "moe"):
        for m in (model, loaded):
            ubmoe_peft.set_mode(m.eval(), mode)
        torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=0, atol=0)


def test_an_8bit_copy_expert_is_fp32_beside_an_fp16_bias(tmp_path):
    """The copy took the dtype of an FFN bias (fp16 for an fp16 checkpoint of a model with FFN biases), which fp16
    mixed precision refuses to step; 8-bit copies are fp32, as docs/qlora.md says."""
    torch.manual_seed(0)
    config = _config()
    config.mlp_bias = True
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=BitsAndBytesConfig(load_in_8bit=True), device_map="cpu", dtype=torch.float16
    )
    model = get_peft_model(base, UBMoEConfig(expert_type="copy"))
    assert {p.dtype for n, p in model.named_parameters() if ".ubmoe_copy." in n} == {torch.float32}


def test_an_8bit_layer_in_training_multiplies_with_its_dequantized_weight(saved_dirs):
    """LLM.int8() in training multiplies with w * (scb * (1 / 127)); w * scb / 127 rounded otherwise in a fifth of the
    weights, so a fresh copy expert was not exactly the FFN it copies."""
    from ubmoe_peft.tuners.ubmoe.bnb import make_dense_copy, prepare_quantized_base

    model = load_quantized(saved_dirs[128], "int8").train()
    prepare_quantized_base(model)
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            layer = getattr(mlp, name)
            inputs = torch.randn(2, 5, layer.in_features, generator=torch.Generator().manual_seed(2))  # (B, T, in)
            assert torch.equal(layer(inputs), nn.functional.linear(inputs, dequantized_weight(layer))), name
        x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))  # (B, T, C)
        assert torch.equal(make_dense_copy(mlp)(x), mlp(x))
