"""Quickstart: wrap the real SmolLM2-135M-Instruct with UBMoE, use its three modes, save and reload the adapter.

Run: python examples/quickstart.py   (about a minute on a laptop CPU)
"""

from __future__ import annotations

import tempfile

import torch
from peft import PeftModel, get_peft_model

import ubmoe_peft
from ubmoe_peft import UBMoEConfig
from ubmoe_peft.smollm2 import load_smollm2

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def answer(model, tokenizer) -> str:
    inputs = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def embed(model, tokenizer, texts: list[str]) -> torch.Tensor:
    """Mean-pooled last hidden states in mode bi: (N, C), L2-normalised."""
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    with ubmoe_peft.use_mode(model, "bi"), torch.no_grad():
        hidden = model(**inputs, output_hidden_states=True).hidden_states[-1]  # (N, T, C)
    mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (N, T, 1)
    pooled = (hidden * mask).sum(1) / mask.sum(1)  # (N, C)
    return torch.nn.functional.normalize(pooled, dim=-1)


def main() -> None:
    base, tokenizer = load_smollm2()
    model = get_peft_model(base, UBMoEConfig(expert_type="lora")).eval()
    model.print_trainable_parameters()

    for mode in ("uni", "moe"):
        ubmoe_peft.set_mode(model, mode)
        print(f"mode {mode!r:6} answers: {answer(model, tokenizer)!r}")
    stats = ubmoe_peft.routing_stats(model)
    print(f"share of tokens routed to the bi expert, mean over {len(stats)} layers: {sum(stats.values()) / len(stats)}")

    texts = ["A man is playing a guitar.", "Someone plays an instrument.", "The stock market fell today."]
    sims = embed(model, tokenizer, texts) @ embed(model, tokenizer, texts).T  # (3, 3)
    print(f"mode 'bi'   embeds: cos(guitar, instrument)={sims[0, 1]:.3f}  cos(guitar, stocks)={sims[0, 2]:.3f}")
    ubmoe_peft.set_mode(model, "bi")
    try:
        answer(model, tokenizer)
    except RuntimeError as err:
        print(f"mode 'bi'   refuses to generate: {err}")
    ubmoe_peft.set_mode(model, "moe")

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        reloaded = PeftModel.from_pretrained(model.unload(), folder).eval()
        print(f"saved and reloaded; mode {ubmoe_peft.get_mode(reloaded)!r} answers: {answer(reloaded, tokenizer)!r}")


if __name__ == "__main__":
    main()
