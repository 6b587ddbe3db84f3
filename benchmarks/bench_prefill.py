"""Question 1: does a top-1 mode-moe prefill cost what the base model's does, at any routing share?

Cases: the base model; UBMoE LoRA and copy experts in mode moe with 0%, 50% and 100% of tokens routed to the bi
expert; and a deliberately naive top-1 that runs both experts on every token and then picks one per token (written
here, not in the library) - the cost the library avoids. ``--merge-control`` adds the LoRA expert at 100% bi with
the merged-weight projections off (every projection on the rank-r path, `lora._project`): what they save, measured
in the same run. Each case has its own model (same weights, same seed).

Timing (``--timing lockstep``, the default): the cases' forwards of a round run in lockstep, one decoder layer per
turn (`common.Lockstep`, as ``bench_decode.py`` runs its steps), so layer l of every case runs back to back and a slow
spell of a shared machine hits them alike; a case's time is the sum of its turns. Whole forwards timed round-robin
(``--timing round-robin``, 1-2 s each on 2 CPU cores) let the per-round ratios spread by about +-7% on a shared VM.
On a GPU, where turns would drain the device's queue at every layer, use round-robin.
"""

from __future__ import annotations

import statistics
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
    lockstep_times,
    machine,
    paired_times,
    pin_threads,
    rank_r_only,
    ratio_stats,
    row,
    set_share,
    token_batch,
    wrap,
)
from torch import nn

import ubmoe_peft
from ubmoe_peft.architectures import decoder_layers

TARGETS = {"lora": 1.05, "copy": 1.03}
CONTROL = "lora 100%, rank-r path (control)"


def naive_forward(self: ubmoe_peft.UBMoELayer, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Top-1 the expensive way: both experts on all tokens, then a per-token select."""
    adapter = self._current_adapter()
    logits = self.router_logits(adapter, x)  # (B, T, 2)
    to_bi = logits[..., 1] > logits[..., 0]  # (B, T)
    self._state.record(self.layer_idx, to_bi, logits=False)
    uni = self.base_layer(x)  # (B, T, C)
    bi = self._bi_expert(adapter, x)  # (B, T, C)
    return torch.where(to_bi.unsqueeze(-1), bi, uni)  # (B, T, C)


def set_naive(model: nn.Module) -> nn.Module:
    for layer in ubmoe_peft.modes.ubmoe_layers(model):
        layer.forward = types.MethodType(naive_forward, layer)
    return model


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
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="the device's dense peak (H200 bf16: 989): report the fraction"
    )
    parser.add_argument("--merge-control", action="store_true", help="add LoRA 100%% with merged projections off")
    parser.add_argument("--timing", choices=["lockstep", "round-robin"], default="lockstep", help="see the docstring")
    args = parser.parse_args()
    threads = pin_threads(args.threads)
    build = dict(shape=args.shape, layers=args.layers, device=args.device, dtype=args.dtype)
    models = {"base": build_model(**build)}
    for kind in ("lora", "copy"):
        for share in SHARES:
            models[f"{kind} {share:.0%}"] = wrap(build_model(**build), kind)
            set_share(models[f"{kind} {share:.0%}"], share)
        models[f"{kind} naive 50%"] = set_naive(wrap(build_model(**build), kind))
        set_share(models[f"{kind} naive 50%"], 0.5)
    if args.merge_control:
        models[CONTROL] = wrap(build_model(**build), "lora")
        set_share(models[CONTROL], 1.0)
    ids = token_batch(args.batch, args.seq, models["base"].config.vocab_size, args.device)  # (B, T)

    def forward(model: nn.Module, handover: Any = None) -> Any:
        """One prefill; in lockstep, the turn passes after each decoder layer (forward hooks, removed after)."""
        layers = decoder_layers(model) if handover is not None else []
        handles = [layer.register_forward_hook(lambda *_: handover()) for _, layer in layers]
        try:
            with torch.inference_mode():
                return model(input_ids=ids, logits_to_keep=1, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()

    runs = {name: (rank_r_only(forward) if name == CONTROL else forward) for name in models}
    shares = {}
    for name, model in models.items():
        if name != "base":
            runs[name](model)
            shares[name] = achieved_share(model)
    if args.timing == "lockstep":
        calls = {name: lambda handover, n=name: runs[n](models[n], handover) for name in models}
        cases = lockstep_times(calls, args.warmup, args.repeats, args.device)
    else:
        cases = [Case(name, lambda n=name: runs[n](models[n])) for name in models]
        paired_times(cases, args.warmup, args.repeats, args.device)
    base = models["base"]

    base_case, rows = cases[0], []
    base_ms = 1000 * statistics.median(base_case.times)  # as the ratios: an even count averages the middle two
    for case in cases[1:]:
        kind = case.name.split()[0]
        stats = ratio_stats(case, base_case)
        naive, control = "naive" in case.name, case.name == CONTROL
        target = "informational (expected >= 1.5)" if naive else f"<= {TARGETS[kind]}"
        target = "informational (control)" if control else target
        ok = None if naive or control else stats["ratio"] <= TARGETS[kind]
        ms = 1000 * statistics.median(case.times)
        rows.append(
            row("prefill", case.name, "latency ms", ms, "base", base_ms, stats, target, ok, bi_share=shares[case.name])
        )
    result = {
        "name": "prefill",
        "machine": machine() | {"torch_threads": threads},
        "config": vars(args) | {"out": None, "layers": base.config.num_hidden_layers},
        "rows": rows,
    }
    if args.peak_tflops is not None:
        tflops = prefill_flops(base, args.batch, args.seq) / (base_ms / 1000) / 1e12
        result["base_tflops"] = {"achieved": tflops, "peak": args.peak_tflops, "fraction": tflops / args.peak_tflops}
    emit(result, args.out)


if __name__ == "__main__":
    main()
