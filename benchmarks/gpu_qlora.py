"""QLoRA stage-1 check: a 4-bit (nf4, double quant) base trains its UBMoE LoRA expert, against the same on a bf16 base.

Builds a random SmolLM2-135M-shaped model, quantizes it with bitsandbytes (save + from_pretrained with
BitsAndBytesConfig, the path users take), wraps it, and runs stage-1 steps (mode bi, in-batch contrastive loss,
gradient checkpointing via prepare_model_for_kbit_training). Checks, each failing the script:

- the expert gradients agree with those of the dequantized float model (relative error under 5e-2, the bf16
  tolerance argued in tests/test_qlora.py: the checkpoint is bf16, and bitsandbytes' backward multiplies with the
  weight rounded to it whatever the compute dtype);
- the loss stays finite and no frozen parameter changes.

Measures, as the other benchmarks do, against a baseline in the same run: the step time and throughput (pairs/s)
of the nf4 model against the same UBMoE LoRA expert on the unquantized base in the compute dtype, with gradient
checkpointing too, timed round-robin; on CUDA also each step's peak memory above what is resident before it, and
the weights' footprint. As in every QLoRA recipe, prepare_model_for_kbit_training leaves the nf4 model's embeddings
and norms in fp32; the baseline keeps them in bf16, as a user training on the bf16 base would.
Called by benchmarks/gpu_check.sh with ``--device cuda --dtype bfloat16`` (the defaults); ``--device cpu --layers 1``
runs the same code on bitsandbytes' CPU backend (the test suite's smoke run).
"""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, Case, base_parser, emit, machine, paired_times, pin_threads, ratio_stats, row  # noqa: E402

GRAD_RTOL = 5e-2
NF4, BASELINE = "ubmoe LoRA expert, nf4 base", "ubmoe LoRA expert, unquantized base"


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


def _trainer(model: nn.Module, ids: torch.Tensor, losses: list[float]) -> Callable[[], None]:
    """One stage-1 step (loss, backward, AdamW on the trainable parameters) per call; losses appended."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        loss = _contrastive(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    return step


def _step_peak_bytes(step: Callable[[], None], device: str) -> int | None:
    """Peak CUDA memory of one step above what was allocated before it (None off CUDA)."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - resident


def main() -> None:
    parser = base_parser(__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="pairs per step")
    parser.add_argument("--seq", type=int, default=64)
    parser.set_defaults(device="cuda", dtype="bfloat16", warmup=1, repeats=5)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        _fail(
            "CUDA is not available (torch.cuda.is_available() is False); run this on a machine with an NVIDIA GPU, "
            "or pass --device cpu for bitsandbytes' CPU backend."
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        _fail("bitsandbytes is not installed; install it with `pip install ubmoe-peft[bnb]`.")
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    import ubmoe_peft
    from ubmoe_peft.tuners.ubmoe.bnb import dequantized_weight, is_quantized_linear

    threads = pin_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    spec = dict(SHAPES[args.shape]) | ({} if args.layers is None else {"num_hidden_layers": args.layers})
    config = AutoConfig.for_model(**spec, attn_implementation="sdpa")
    torch.manual_seed(0)
    folder = tempfile.mkdtemp()
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
    )
    device_map = "cuda:0" if args.device == "cuda" else args.device
    base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb_config, device_map=device_map)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(args.device)
    unquantized = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(args.device)
    with torch.no_grad():
        for name, module in base.named_modules():
            if is_quantized_linear(module):
                reference.get_submodule(name).weight.copy_(dequantized_weight(module).float())  # (out, in)
    footprint = {NF4: base.get_memory_footprint(), BASELINE: unquantized.get_memory_footprint()}
    base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=True)
    # The baseline trains with gradient checkpointing too (prepare_model_for_kbit_training would upcast its weights
    # to fp32, so it is enabled here the way that function enables it), so the two steps recompute alike.
    unquantized.requires_grad_(False)
    unquantized.gradient_checkpointing_enable()
    unquantized.enable_input_require_grads()
    ub_config = ubmoe_peft.UBMoEConfig(expert_type="lora", lora_dropout=0.0)
    model = peft.get_peft_model(base, ub_config)
    reference = peft.get_peft_model(reference, copy.deepcopy(ub_config))
    baseline = peft.get_peft_model(unquantized, copy.deepcopy(ub_config))
    with torch.no_grad():  # non-zero B so that every expert tensor is on the gradient path
        for name, param in model.named_parameters():
            if "ubmoe_lora_B" in name:
                param.normal_(0.0, 0.02)
        for other in (reference, baseline):
            params = dict(other.named_parameters())
            for name, param in model.named_parameters():
                if ".ubmoe_" in name:
                    params[name].copy_(param)
    for m in (model, reference, baseline):
        ubmoe_peft.set_stage(m, "contrastive")
        m.train()

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen).to(args.device)  # (B, T)
    grads, expected = _expert_grads(model, ids), _expert_grads(reference, ids)
    errors = {n: float((g - expected[n]).norm() / expected[n].norm()) for n, g in grads.items()}
    worst = max(errors, key=errors.get)
    del reference

    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    losses: dict[str, list[float]] = {NF4: [], BASELINE: []}
    steps = {NF4: _trainer(model, ids, losses[NF4]), BASELINE: _trainer(baseline, ids, losses[BASELINE])}
    cases = paired_times(
        [Case(BASELINE, steps[BASELINE]), Case(NF4, steps[NF4])], args.warmup, args.repeats, args.device
    )
    base_case, case = cases
    peaks = {name: _step_peak_bytes(step, args.device) for name, step in steps.items()}

    def line(metric: str, value: float, base_value: float, ratio: dict | float) -> dict[str, Any]:
        return row("qlora stage-1 step", NF4, metric, value, BASELINE, base_value, ratio, None, None)

    base_s, case_s = statistics.median(base_case.times), statistics.median(case.times)
    rows = [
        line("step ms", 1000 * case_s, 1000 * base_s, ratio_stats(case, base_case)),
        line("pairs/s", args.batch / case_s, args.batch / base_s, ratio_stats(base_case, case)),
        line("weights MiB", footprint[NF4] / 2**20, footprint[BASELINE] / 2**20, footprint[NF4] / footprint[BASELINE]),
    ]
    if peaks[NF4] is not None:
        mib = {name: peak / 2**20 for name, peak in peaks.items()}
        rows.append(line("step peak MiB above resident", mib[NF4], mib[BASELINE], mib[NF4] / mib[BASELINE]))
    checks = {
        "max_relative_grad_error": errors[worst],
        "worst_tensor": worst,
        "grad_tolerance": GRAD_RTOL,
        "losses": losses,
        "frozen_unchanged": all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen),
    }
    result = {
        "name": "qlora stage-1 step",
        "machine": machine() | {"torch_threads": threads},
        "config": vars(args) | {"out": None, "layers": config.num_hidden_layers, "quant": "nf4, double quant"},
        "timing": "one step per variant per round, round-robin",
        "rows": rows,
        "checks": checks,
    }
    emit(result, args.out)
    problems = []
    if not all(v == v and abs(v) != float("inf") for values in losses.values() for v in values):
        problems.append(f"non-finite loss {losses}")
    if errors[worst] >= GRAD_RTOL:
        problems.append(f"expert gradient {worst} differs from the dequantized reference by {errors[worst]:.2e}")
    if not checks["frozen_unchanged"]:
        problems.append("a frozen parameter changed during stage 1")
    if problems:
        _fail("; ".join(problems))
    print("gpu_qlora: OK")


if __name__ == "__main__":
    main()
