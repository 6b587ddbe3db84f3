"""Question 1: does a top-1 mode-moe prefill cost what the base model's does, at any routing share?

Cases, all timed round-robin in one process: the base model; UBMoE LoRA and copy experts in mode moe with 0%, 50%
and 100% of tokens routed to the bi expert; and a deliberately naive top-1 that runs both experts on every token and
then picks one per token (written here, not in the library) - the cost the library avoids.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from common import (
    SHARES,
    Case,
    achieved_share,
    base_parser,
    build_model,
    emit,
    machine,
    paired_times,
    pin_threads,
    ratio_stats,
    row,
    set_share,
    token_batch,
    wrap,
)
from torch import nn

import ubmoe_peft

TARGETS = {"lora": 1.05, "copy": 1.03}


def naive_forward(self: ubmoe_peft.UBMoELayer, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Top-1 the expensive way: both experts on all tokens, then a per-token select."""
    adapter = self._current_adapter()
    logits = self.router_logits(adapter, x)  # (B, T, 2)
    to_bi = logits[..., 1] > logits[..., 0]  # (B, T)
    self._state.record(self.layer_idx, to_bi)
    uni = self.base_layer(x)  # (B, T, C)
    bi = self._bi_expert(adapter, x)  # (B, T, C)
    return torch.where(to_bi.unsqueeze(-1), bi, uni)  # (B, T, C)


def set_naive(model: nn.Module, naive: bool) -> None:
    for layer in ubmoe_peft.modes.ubmoe_layers(model):
        if naive:
            layer.forward = types.MethodType(naive_forward, layer)
        else:
            layer.__dict__.pop("forward", None)


def prefill_flops(model: nn.Module, batch: int, seq: int) -> float:
    """Matmul FLOPs of one prefill with logits for the last position only (causal attention counted as half)."""
    cfg = model.config
    linear = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in n)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = 2 * batch * seq * seq * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers  # QK^T + PV, half
    return 2.0 * linear * batch * seq + attention + 2.0 * batch * cfg.hidden_size * cfg.vocab_size


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak of the GPU (H200: 989)")
    args = parser.parse_args()
    threads = pin_threads(args.threads)
    build = dict(shape=args.shape, layers=args.layers, device=args.device, dtype=args.dtype)
    base = build_model(**build)
    models = {kind: wrap(build_model(**build), kind) for kind in ("lora", "copy")}
    ids = token_batch(args.batch, args.seq, base.config.vocab_size, args.device)  # (B, T)

    def forward(model: nn.Module) -> Any:
        with torch.inference_mode():
            return model(input_ids=ids, logits_to_keep=1, use_cache=False)

    def configure(kind: str, share: float, naive: bool = False) -> None:
        set_share(models[kind], share)
        set_naive(models[kind], naive)

    cases = [Case("base", lambda: forward(base))]
    for kind in models:
        for share in SHARES:
            cases.append(
                Case(f"{kind} {share:.0%}", lambda k=kind: forward(models[k]), lambda k=kind, s=share: configure(k, s))
            )
        cases.append(
            Case(f"{kind} naive 50%", lambda k=kind: forward(models[k]), lambda k=kind: configure(k, 0.5, True))
        )
    shares = {}
    for case in cases[1:]:
        case.setup()
        forward(models[case.name.split()[0]])
        shares[case.name] = achieved_share(models[case.name.split()[0]])
    paired_times(cases, args.warmup, args.repeats, args.device)

    base_case, rows = cases[0], []
    base_ms = 1000 * torch.tensor(base_case.times).median().item()
    for case in cases[1:]:
        kind = case.name.split()[0]
        stats = ratio_stats(case, base_case)
        naive = "naive" in case.name
        target = "informational (expected >= 1.5)" if naive else f"<= {TARGETS[kind]}"
        ok = None if naive else stats["ratio"] <= TARGETS[kind]
        ms = 1000 * torch.tensor(case.times).median().item()
        rows.append(
            row("prefill", case.name, "latency ms", ms, "base", base_ms, stats, target, ok, bi_share=shares[case.name])
        )
    result = {
        "name": "prefill",
        "machine": machine() | {"torch_threads": threads},
        "config": vars(args) | {"out": None, "layers": base.config.num_hidden_layers},
        "rows": rows,
    }
    if args.device.startswith("cuda"):
        flops = prefill_flops(base, args.batch, args.seq)
        tflops = flops / (base_ms / 1000) / 1e12
        result["base_tflops"] = {"achieved": tflops, "peak": args.peak_tflops, "fraction": tflops / args.peak_tflops}
    emit(result, args.out)


if __name__ == "__main__":
    main()
