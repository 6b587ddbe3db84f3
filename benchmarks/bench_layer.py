"""Diagnostic: what one wrapped FFN costs per decoder layer and decode step, written out or through hooks.

Decode-sized inputs ((B, 1, C), batch 1 and 8) go through the FFN of every decoder layer of a SmolLM2-135M-shaped
model (30 layers by default) in turn, so each call reads its layer's weights from memory as a decode step does.
Cases per batch and route (every token to uni, every token to bi, or half and half): the base FFN module (baseline),
the UBMoE layer with the LoRA expert as it runs at inference (the gated MLP written out, `_gated_mlp_forward`, also
for tokens routed to uni), and the same layer forced onto the generic paths (the FFN module; temporary hooks on its
projections for the deltas). Routes are forced by pointing the
routers along one direction and choosing the inputs' signs on it. Figures: per-layer time, the base FFN's time over
the case's (a throughput ratio, paired per round) and the overhead in microseconds per layer and step. No target:
it explains the decode rows of bench_decode.py.

``--splits K ...`` times instead what a copy expert's mixed batch-8 decode step does to the FFN work, without
UBMoE: the base FFNs on 8 rows in one pass against two passes of K and 8 - K rows (`split_passes`).
"""

from __future__ import annotations

import statistics

import torch
from common import Case, base_parser, build_model, emit, machine, paired_times, pin_threads, ratio_stats, row, wrap

import ubmoe_peft

PASSES = 10  # passes over all layers per timed round


def forced_input(batch: int, route: str, direction: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """(B, 1, C) inputs whose projection on ``direction`` (the routers' bi-minus-uni row) has the sign ``route``
    asks for: positive routes to bi, negative to uni; "mixed" alternates."""
    x = torch.randn(batch, 1, direction.numel(), generator=gen)  # (B, 1, C)
    sign = torch.sign(x[:, 0] @ direction)  # (B,)
    want = {
        "uni": -torch.ones(batch),
        "bi": torch.ones(batch),
        "mixed": torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(batch)]),
    }[route]  # (B,)
    return x * (sign * want).view(batch, 1, 1)  # (B, 1, C)


def split_passes(args, threads: int) -> dict:
    """The cost of a copy expert's mixed decode step, without UBMoE: every layer's base FFN (module calls) on 8 rows
    in one pass (baseline), on 1 row, and in two passes of k and 8 - k rows, over the same FFN twice or over the FFN
    of a second model with other weights. Rows are (8, 1, C) inputs, as in batch-8 decode."""
    ffns = [layer.mlp for layer in build_model(args.shape, args.layers, args.device, args.dtype).model.layers]
    others = [layer.mlp for layer in build_model(args.shape, args.layers, args.device, args.dtype, seed=1).model.layers]
    x = torch.randn(8, 1, ffns[0].gate_proj.in_features, generator=torch.Generator().manual_seed(0))  # (8, 1, C)
    x = x.to(args.device, getattr(torch, args.dtype))

    def case(name: str, parts: list[tuple[list, torch.Tensor]]) -> Case:
        def run() -> None:
            with torch.inference_mode():
                for _ in range(PASSES):
                    for i in range(len(ffns)):
                        for experts, rows in parts:
                            experts[i](rows)

        return Case(name, run)

    cases = [case("one pass, 8 rows", [(ffns, x)]), case("one pass, 1 row", [(ffns, x[:1])])]
    for k in args.splits:
        a, b = x[:k], x[k:]  # (k, 1, C), (8 - k, 1, C)
        cases.append(case(f"two passes, {k} + {8 - k} rows, same weights", [(ffns, a), (ffns, b)]))
        cases.append(case(f"two passes, {k} + {8 - k} rows, two weight sets", [(ffns, a), (others, b)]))
    timed = paired_times(cases, args.warmup, args.repeats)
    per_layer = PASSES * len(ffns)
    base_us = statistics.median(timed[0].times) / per_layer * 1e6
    rows = []
    for other in timed[1:]:
        us = statistics.median(other.times) / per_layer * 1e6
        stats = ratio_stats(timed[0], other)  # t_base / t_case
        rows.append(row("layer", other.name, "us per layer", us, timed[0].name, base_us, stats, "informational", None))
    return {
        "name": "layer (split passes)",
        "machine": machine() | {"torch_threads": threads},
        "config": vars(args) | {"out": None, "layers": len(ffns), "passes": PASSES},
        "rows": rows,
    }


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--splits",
        type=int,
        nargs="*",
        default=None,
        help="instead: the base FFNs on 8 decode rows in one pass against two passes of k and 8 - k rows (for each k "
        "given), over the same weights and over two sets (what a copy expert does on a mixed step), and one row",
    )
    parser.set_defaults(repeats=15)
    args = parser.parse_args()
    threads = pin_threads(args.threads)
    if args.splits is not None:
        emit(split_passes(args, threads), args.out)
        return
    model = wrap(build_model(args.shape, args.layers, args.device, args.dtype), "lora")
    layers = ubmoe_peft.modes.ubmoe_layers(model)
    gated = {id(layer): layer._gated_mlp for layer in layers}  # whether the FFN can run written out at all
    gen = torch.Generator().manual_seed(0)
    direction = torch.randn(layers[0].hidden_size, generator=gen)  # (C,)
    with torch.no_grad():
        for layer in layers:
            layer.ubmoe_router["default"].weight.zero_()  # (2, C)
            layer.ubmoe_router["default"].weight[1] = direction  # logit_bi - logit_uni = x . direction
            for b in layer.ubmoe_lora_B["default"].values():
                b.weight.normal_(std=0.01, generator=gen)  # a trained-looking, nonzero delta

    def case(x: torch.Tensor, base: bool, written_out: bool) -> Case:
        def setup() -> None:
            for layer in layers:
                layer._gated_mlp = gated[id(layer)] and written_out  # False: the module and hook paths

        def run() -> None:
            with torch.inference_mode():
                for _ in range(PASSES):
                    for layer in layers:
                        (layer.base_layer if base else layer)(x)

        name = "base FFN" if base else ("UBMoE, written out" if written_out else "UBMoE, hooks")
        return Case(name, run, setup)

    rows = []
    per_layer = PASSES * len(layers)
    for batch in args.batches:
        for route in ("uni", "bi", "mixed") if batch > 1 else ("uni", "bi"):
            x = forced_input(batch, route, direction, gen).to(args.device, getattr(torch, args.dtype))  # (B, 1, C)
            cases = paired_times(
                [case(x, True, True), case(x, False, True), case(x, False, False)], args.warmup, args.repeats
            )
            base_us = statistics.median(cases[0].times) / per_layer * 1e6
            for timed in cases[1:]:
                case_us = statistics.median(timed.times) / per_layer * 1e6
                rows.append(
                    row(
                        "layer",
                        f"{timed.name}, batch {batch}, {route}",
                        "us per layer",
                        case_us,
                        "base FFN",
                        base_us,
                        ratio_stats(cases[0], timed),  # t_base / t_case
                        "informational",
                        None,
                        overhead_us=case_us - base_us,
                    )
                )
    for layer in layers:
        layer._gated_mlp = gated[id(layer)]
    result = {
        "name": "layer",
        "machine": machine() | {"torch_threads": threads},
        "config": vars(args) | {"out": None, "layers": len(layers), "passes": PASSES},
        "rows": rows,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
