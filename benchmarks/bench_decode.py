"""Question 2: does greedy decoding with a KV cache in mode moe keep the base model's tokens/s?

Base model against UBMoE LoRA and copy experts (top-1, routers steered to send the tokens from one half of the
vocabulary, about 50%, to the bi expert), batch 1 and batch 8, exactly ``--new-tokens`` new tokens per sequence.
"""

from __future__ import annotations

from typing import Any

import torch
from common import (
    Case,
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

TARGET = 0.95


def decode_share(model: nn.Module, generate: Any) -> float:
    """Mean bi share over every mode-moe forward (prefill and each decode step) of one generation, layer 0 hooked."""
    layer = ubmoe_peft.modes.ubmoe_layers(model)[0]
    seen: list[float] = []
    handle = layer.register_forward_hook(lambda m, a, o: seen.append(ubmoe_peft.routing_stats(model)[m.layer_idx]))
    try:
        generate()
    finally:
        handle.remove()
    return sum(seen) / max(len(seen), 1)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--share", type=float, default=0.5, choices=[0.0, 0.5, 1.0])
    args = parser.parse_args()
    threads = pin_threads(args.threads)
    build = dict(shape=args.shape, layers=args.layers, device=args.device, dtype=args.dtype)
    models: dict[str, nn.Module] = {"base": build_model(**build)}
    for kind in ("lora", "copy"):
        models[kind] = wrap(build_model(**build), kind)
        set_share(models[kind], args.share)

    rows = []
    for batch in args.batches:
        ids = token_batch(batch, args.prompt, models["base"].config.vocab_size, args.device)  # (B, P)

        def generate(model: nn.Module, ids: torch.Tensor = ids) -> Any:
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    pad_token_id=0,
                    use_cache=True,
                )
            if out.shape[1] != ids.shape[1] + args.new_tokens:
                raise RuntimeError(f"generated {out.shape[1] - ids.shape[1]} tokens, not {args.new_tokens}")
            return out

        shares = {k: decode_share(m, lambda m=m: generate(m)) for k, m in models.items() if k != "base"}
        cases = paired_times(
            [Case(kind, lambda m=model: generate(m)) for kind, model in models.items()],
            args.warmup,
            args.repeats,
            args.device,
        )
        base_case = cases[0]
        base_tps = batch * args.new_tokens / torch.tensor(base_case.times).median().item()
        for case in cases[1:]:
            stats = ratio_stats(base_case, case)  # tokens/s ratio = t_base / t_case
            tps = batch * args.new_tokens / torch.tensor(case.times).median().item()
            rows.append(
                row(
                    "decode",
                    f"{case.name} batch {batch}",
                    "tokens/s",
                    tps,
                    "base",
                    base_tps,
                    stats,
                    f">= {TARGET}",
                    stats["ratio"] >= TARGET,
                    bi_share={"mean": shares[case.name]},
                )
            )
    result = {
        "name": "decode",
        "machine": machine() | {"torch_threads": threads},
        "config": vars(args) | {"out": None, "layers": models["base"].config.num_hidden_layers},
        "rows": rows,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
