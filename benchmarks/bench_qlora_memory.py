"""QLoRA memory: a 4-bit (nf4, double quantization, bf16 compute) base against a bf16 base, same shape, same run.

For each model shape (random weights built from the published config) and each base, a fresh process builds the
model, wraps it with a LoRA UBMoE adapter (r=8 on gate/up/down) and runs stage-1 training steps (mode bi,
in-batch-negatives contrastive loss, AdamW, gradient checkpointing). It reports

- ``weights``: bytes of the base's parameters, buffers and bitsandbytes quantization state (absmax, nested absmax,
  codebooks; these live outside ``state_dict``-visible parameters), split into the decoder layers' linear weights
  (what 4-bit quantizes) and everything else (embeddings, norms; tied lm_head), counted exactly from tensor sizes;
- ``training_peak``: the process's peak resident memory during the training steps minus its resident memory just
  before them (activations, gradients, AdamW state, bnb's per-layer dequantized temporaries), from the kernel's
  high-water mark (VmHWM, reset through /proc/self/clear_refs; psutil sampling at 1 ms where that is unavailable),
  with glibc told to return freed memory at once so that resident memory follows live tensors.

Ratios are 4-bit / bf16 from the same run. Target: 4-bit decoder-layer linear weights <= 0.35x of bf16.
Run: ``python benchmarks/bench_qlora_memory.py`` (3-5 minutes on 2 CPU cores); writes results_qlora.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, PeakRss, machine, pin_threads, rss_bytes  # noqa: E402

HERE = Path(__file__).resolve().parent
TARGET = 0.35
BATCH, SEQ, STEPS = 2, 16, 1


def build(shape: str, base: str, layers: int | None = None, seed: int = 0) -> nn.Module:
    """A random model of ``shape`` (``layers`` decoder layers, default the shape's own); for ``base == 'nf4'`` its
    decoder linears are quantized one at a time."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = SHAPES[shape] | ({} if layers is None else {"num_hidden_layers": layers})
    config = AutoConfig.for_model(**spec, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if base == "nf4":
        quantize_decoder_linears(model)
    return model


def quantize_decoder_linears(model: nn.Module) -> None:
    """What BitsAndBytesConfig(load_in_4bit=True, nf4, double quant, bf16 compute) does to a loaded model."""
    import bitsandbytes as bnb

    for name, module in list(model.named_modules()):
        if not (isinstance(module, nn.Linear) and ".layers." in name):
            continue
        quantized = bnb.nn.Linear4bit(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            compute_dtype=torch.bfloat16,
            compress_statistics=True,
            quant_type="nf4",
            device="meta",
        )
        quantized.weight = bnb.nn.Params4bit(
            module.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4", module=quantized
        )
        if module.bias is not None:
            quantized.bias = nn.Parameter(module.bias.data, requires_grad=False)
        quantized = quantized.to("cpu")  # bitsandbytes quantizes on the move to a device
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, quantized)  # the bf16 weight is freed here
    model.is_loaded_in_4bit = True


def _quant_state_tensors(module: nn.Module) -> list[torch.Tensor]:
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    if state is None:
        return []
    found = [state.absmax, state.code, getattr(state, "offset", None)]
    if getattr(state, "state2", None) is not None:
        found += [state.state2.absmax, state.state2.code]
    return [t for t in found if isinstance(t, torch.Tensor)]


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Exact bytes of parameters + buffers + quantization state: decoder linears vs the rest (shared ones once)."""
    seen: set[int] = set()
    out = {"linear": 0, "other": 0}
    for name, module in model.named_modules():
        is_linear = isinstance(module, nn.Linear) and ".layers." in name
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False), *_quant_state_tensors(module)]
        for t in tensors:
            if t.data_ptr() in seen or "ubmoe_" in name:
                continue
            seen.add(t.data_ptr())
            out["linear" if is_linear else "other"] += t.numel() * t.element_size()
    return out


def contrastive_step(model: nn.Module, optimizer: torch.optim.Optimizer, vocab: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)  # (B, T)

    def embed(x: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, C), mean pooling
        hidden = model(input_ids=x, output_hidden_states=True).hidden_states[-1]  # (B, T, C)
        return nn.functional.normalize(hidden.float().mean(1), dim=-1)

    sims = embed(ids) @ embed(ids[:, :-1]).T * 20.0  # (B, B)
    loss = nn.functional.cross_entropy(sims, torch.arange(BATCH))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def measure(shape: str, base: str, threads: int, layers: int | None = None) -> dict[str, Any]:
    """One (shape, base) case; runs in its own process so that nothing of another case stays resident."""
    import peft

    import ubmoe_peft

    pin_threads(threads)
    start = time.perf_counter()
    rss_start = rss_bytes()
    model = build(shape, base, layers)
    weights = weight_bytes(model)
    rss_model = rss_bytes() - rss_start
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = peft.get_peft_model(model, ubmoe_peft.UBMoEConfig(expert_type="lora", lora_dropout=0.0))
    ubmoe_peft.set_stage(model, "contrastive")
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    with PeakRss() as peak:
        step_start = time.perf_counter()
        losses = [contrastive_step(model, optimizer, SHAPES[shape]["vocab_size"], seed) for seed in range(STEPS)]
        step_seconds = (time.perf_counter() - step_start) / STEPS
    return {
        "shape": shape,
        "base": base,
        "weights_linear_bytes": weights["linear"],
        "weights_other_bytes": weights["other"],
        "weights_total_bytes": weights["linear"] + weights["other"],
        "rss_after_build_bytes": rss_model,
        "adapter_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "training_peak_bytes": peak.peak - peak.before,
        "peak_method": peak.method,
        "losses": losses,
        "seconds_per_step": step_seconds,
        "seconds_total": time.perf_counter() - start,
    }


def _child(shape: str, base: str, threads: int, layers: int | None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", shape, base, "--threads", str(threads)]
    cmd += [] if layers is None else ["--layers", str(layers)]
    # glibc keeps freed heap memory resident and reuses it, so an RSS delta would depend on what the model build
    # happened to free (the nf4 build frees the bf16 weights; a first run showed a 5x "training peak" from that).
    # Serving allocations >= 64 KiB by mmap and trimming at once makes resident memory follow live tensors.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: each shape's own)")
    parser.add_argument("--out", type=Path, default=HERE / "results_qlora.json")
    parser.add_argument("--child", nargs=2, metavar=("SHAPE", "BASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child, args.threads, args.layers)))
        return
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        sys.exit("bench_qlora_memory needs bitsandbytes: pip install ubmoe-peft[bnb]")

    rows, lines = [], []
    lines.append("| shape | metric | bf16 base (MiB) | nf4 base (MiB) | nf4 / bf16 | target |")
    lines.append("|---|---|---:|---:|---:|---|")
    for shape in args.shapes:
        cases = {base: _child(shape, base, args.threads, args.layers) for base in ("bf16", "nf4")}
        for metric, target in (
            ("weights_linear_bytes", TARGET),
            ("weights_total_bytes", None),
            ("rss_after_build_bytes", None),
            ("training_peak_bytes", None),
        ):
            bf16, nf4 = cases["bf16"][metric], cases["nf4"][metric]
            ratio = nf4 / bf16
            met = None if target is None else ratio <= target
            rows.append(
                dict(
                    benchmark="qlora_memory",
                    case=f"{shape}/nf4",
                    metric=metric,
                    value=nf4,
                    baseline=f"{shape}/bf16",
                    baseline_value=bf16,
                    ratio=ratio,
                    target=None if target is None else f"<= {target}",
                    met=met,
                )
            )
            shown = "-" if target is None else f"<= {target} ({'met' if met else 'MISSED'})"
            lines.append(
                f"| {shape} | {metric.removesuffix('_bytes')} | {_mib(bf16)} | {_mib(nf4)} | {ratio:.3f} | {shown} |"
            )
        rows.append(dict(benchmark="qlora_memory", case=shape, metric="raw", cases=cases))
    result = {"machine": machine(), "batch": BATCH, "seq": SEQ, "steps": STEPS, "layers": args.layers, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
