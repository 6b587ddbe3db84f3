"""QLoRA stage-1 check on CUDA: a 4-bit (nf4, double quant, bf16 compute) base trains its UBMoE LoRA expert.

Builds a random SmolLM2-135M-shaped model, quantizes it with bitsandbytes on the GPU (save + from_pretrained with
BitsAndBytesConfig, the path users take), wraps it, runs a few stage-1 steps (mode bi, in-batch contrastive loss,
gradient checkpointing via prepare_model_for_kbit_training) and checks that

- only LoRA expert parameters changed, the loss is finite, and each step's expert gradients are non-zero;
- the expert gradients agree with those of the dequantized float model (relative error < 5e-2, the bf16 tolerance
  argued in tests/test_qlora.py);
- peak CUDA memory of a step, and of the same step on a bf16 base, for the record.

Exits non-zero with a message when CUDA or bitsandbytes is missing. Called by benchmarks/gpu_check.sh; standalone:
``python benchmarks/gpu_qlora.py [--out results_gpu_qlora.json]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES  # noqa: E402

STEPS, BATCH, SEQ, GRAD_RTOL = 3, 8, 64, 5e-2


def _fail(message: str) -> None:
    print(f"gpu_qlora: {message}", file=sys.stderr)
    sys.exit(2)


def _contrastive(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    def embed(x: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, C)
        hidden = model(input_ids=x, output_hidden_states=True).hidden_states[-1]  # (B, T, C)
        return nn.functional.normalize(hidden.float().mean(1), dim=-1)

    sims = embed(ids) @ embed(ids[:, :-1]).T * 20.0  # (B, B)
    return nn.functional.cross_entropy(sims, torch.arange(ids.shape[0], device=ids.device))


def _expert_grads(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]  # (B, T, C)
    probe = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(7)).to(hidden.device)  # (C,)
    (hidden.float() @ probe).pow(2).mean().backward()
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        _fail("CUDA is not available (torch.cuda.is_available() is False); run this on a machine with an NVIDIA GPU.")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        _fail("bitsandbytes is not installed; install it with `pip install ubmoe-peft[bnb]`.")
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    import ubmoe_peft
    from ubmoe_peft.tuners.ubmoe.bnb import dequantized_weight, is_quantized_linear

    config = AutoConfig.for_model(**SHAPES["smollm2-135m"], attn_implementation="sdpa")
    torch.manual_seed(0)
    folder = tempfile.mkdtemp()
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb_config, device_map="cuda:0")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda()
    with torch.no_grad():
        for name, module in base.named_modules():
            if is_quantized_linear(module):
                reference.get_submodule(name).weight.copy_(dequantized_weight(module).float())  # (out, in)
    base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=True)
    ub_config = ubmoe_peft.UBMoEConfig(expert_type="lora", lora_dropout=0.0)
    model = peft.get_peft_model(base, ub_config)
    reference = peft.get_peft_model(reference, copy.deepcopy(ub_config))
    with torch.no_grad():  # non-zero B so that every expert tensor is on the gradient path
        for name, param in model.named_parameters():
            if "ubmoe_lora_B" in name:
                param.normal_(0.0, 0.02)
        ref_params = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            if ".ubmoe_" in name:
                ref_params[name].copy_(param)
    for m in (model, reference):
        ubmoe_peft.set_stage(m, "contrastive")
        m.train()

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen).cuda()  # (B, T)
    grads, expected = _expert_grads(model, ids), _expert_grads(reference, ids)
    errors = {n: float((g - expected[n]).norm() / expected[n].norm()) for n, g in grads.items()}
    worst = max(errors, key=errors.get)

    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    torch.cuda.reset_peak_memory_stats()
    start, losses = time.perf_counter(), []
    for _ in range(STEPS):
        loss = _contrastive(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    torch.cuda.synchronize()
    result = {
        "device": torch.cuda.get_device_name(0),
        "losses": losses,
        "seconds_per_step": (time.perf_counter() - start) / STEPS,
        "peak_cuda_bytes_nf4": torch.cuda.max_memory_allocated(),
        "model_footprint_bytes_nf4": base.get_memory_footprint(),
        "max_relative_grad_error": errors[worst],
        "worst_tensor": worst,
        "frozen_unchanged": all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen),
    }
    problems = []
    if not all(map(lambda v: v == v and abs(v) != float("inf"), losses)):
        problems.append(f"non-finite loss {losses}")
    if errors[worst] >= GRAD_RTOL:
        problems.append(f"expert gradient {worst} differs from the dequantized reference by {errors[worst]:.2e}")
    if not result["frozen_unchanged"]:
        problems.append("a frozen parameter changed during stage 1")
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    if problems:
        _fail("; ".join(problems))
    print("gpu_qlora: OK")


if __name__ == "__main__":
    main()
