"""Question 2: does greedy decoding with a KV cache in mode moe keep the base model's tokens/s?

Base model against UBMoE LoRA and copy experts (top-1, routers steered to send the tokens from the lower half of the
vocabulary to the bi expert), batch 1 and batch 8, exactly ``--new-tokens`` new tokens per sequence, each through
``model.generate`` (greedy, KV cache). Left to itself, greedy decoding of the random model repeats one token, so the
share routed to bi would be whatever that token's half gives (none at batch 1). Every model therefore runs with the
same logits processor (`ForcedTokens`, equal cost for all), which makes step s emit a fixed pseudo-random token,
half of each sequence's from each vocabulary half: the prompt and the decode steps send about 50% of their tokens to
bi at every batch size, whatever the model computes. The "bi share" of a row is the share achieved, measured
(`decode_share`). With ``--adapters`` (the real model, its trained routers), nothing is forced: routing follows the
text the model generates, as it would in use.

The three generations of a round run in lockstep: each runs in its own thread, and a stopping criterion (called by
``generate`` once per step, after the step's token is chosen) hands the turn to the next model, so only one model
computes at a time and step s of every model runs back to back before step s + 1 of any. A slow spell of a shared
machine then hits every model's step s alike, where a whole ``generate`` call per model (seconds) let the rounds
spread by about +-10% on a shared VM. A model's time is the sum of its turns: exactly its ``generate`` call, every
step's forward, logits processing and token choice included, without the waits for the others. Targets are judged on
these. The "whole calls" rows (informational, ``--whole-repeats``) time whole calls round-robin, as before lockstep.

The two differ in more than noise: in lockstep the three models' weights (3 x 200 MB at 6 layers) take turns in the
caches, so every step reads its weights from memory, as decoding any model larger than the last-level cache does; a
whole call keeps one model's 200 MB warm in this machine's 300 MB L3 for its 128 steps.
"""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch
from common import (
    Case,
    base_parser,
    build_model,
    emit,
    lockstep_times,
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
from transformers import LogitsProcessor, StoppingCriteria

import ubmoe_peft
from ubmoe_peft.tuners.ubmoe import layer as layer_module

TARGET = 0.95
CONTROL = "base, second copy (A/A control)"
COPY_ZERO = "copy, routers zeroed (control)"
COPY_CLONED, COPY_ALIASED = "copy, bi = base FFN cloned (control)", "copy, bi = base FFN aliased (control)"
GENERAL = ", general path (control)"  # after the model's expert type
_GENERAL_LAYERS: set[int] = set()  # ids of the layers that never take the decode plan


class HandOver(StoppingCriteria):
    """Ends a model's lockstep turn after each step's token is chosen (``generate`` calls it once per step)."""

    def __init__(self, handover: Any) -> None:
        self.handover = handover

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.handover()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # never stops


class ForcedTokens(LogitsProcessor):
    """Makes decode step s of a ``prompt``-token input choose ``schedule[:, s]`` whatever the model's logits: every
    other token's score becomes -inf, so greedy search picks the scheduled one."""

    def __init__(self, schedule: torch.Tensor, prompt: int) -> None:
        self.schedule, self.prompt = schedule, prompt  # (B, N) token ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt
        return torch.full_like(scores, -torch.inf).scatter_(1, self.schedule[:, step, None], 0.0)  # (B, V)


def token_schedule(model: nn.Module, batch: int, steps: int, device: str) -> torch.Tensor:
    """The tokens `ForcedTokens` makes every model emit: (B, N), exactly half of each row from the lower vocabulary
    half (the tokens the steered routers send to bi), in a pseudo-random order, and no end-of-sequence id."""
    schedule = token_batch(batch, steps, model.config.vocab_size, device, seed=2)  # (B, N)
    eos = model.generation_config.eos_token_id
    ends = torch.tensor([] if eos is None else eos, dtype=torch.long, device=device).flatten()
    # An end-of-sequence id would end its row early; its neighbour id ^ 1 stands in, from the same vocabulary half
    # (which starts at an even id). `generate` checks afterwards that every row emitted exactly its schedule.
    return torch.where(torch.isin(schedule, ends), schedule ^ 1, schedule)


def general_path_control(model: nn.Module) -> nn.Module:
    """A copy of a UBMoE model whose layers never take the decode plan (``--plan-control``): the same outputs through
    the general path of `layer.py`, so the plan's gain is measured in the same run. The library has no switch for
    this (the plan is always right where it applies), so the benchmark wraps the function the layers call; the other
    models pay one extra Python call and set lookup per layer, well under a microsecond."""
    twin = copy.deepcopy(model)
    _GENERAL_LAYERS.update(id(layer) for layer in ubmoe_peft.modes.ubmoe_layers(twin))
    if not hasattr(layer_module.planned_moe, "planned"):
        planned = layer_module.planned_moe

        def planned_unless_control(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
            return None if id(layer) in _GENERAL_LAYERS else planned(layer, x)

        planned_unless_control.planned = planned  # type: ignore[attr-defined]
        layer_module.planned_moe = planned_unless_control
    return twin


def decode_share(model: nn.Module, generate: Any) -> dict[str, float]:
    """Over every mode-moe forward of one generation (prefill and each decode step): the mean bi share over layers,
    and the share of (layer, forward) pairs whose tokens went to both experts (a copy expert then reads both FFNs)."""
    last = ubmoe_peft.modes.ubmoe_layers(model)[-1]
    shares: list[float] = []
    mixed: list[bool] = []

    def record(*_: Any) -> None:
        per_layer = list(ubmoe_peft.routing_stats(model).values())
        shares.extend(per_layer)
        mixed.extend(0.0 < share < 1.0 for share in per_layer)

    handle = last.register_forward_hook(record)
    try:
        generate()
    finally:
        handle.remove()
    return {"mean": sum(shares) / max(len(shares), 1), "mixed_layer_steps": sum(mixed) / max(len(mixed), 1)}


def random_models(args: Any) -> dict[str, nn.Module]:
    """The base model and LoRA / copy UBMoE models of a random SmolLM2-shaped model, routers steered to ``--share``."""
    build = dict(shape=args.shape, layers=args.layers, device=args.device, dtype=args.dtype)
    models: dict[str, nn.Module] = {"base": build_model(**build)}
    for kind in ("lora", "copy"):
        models[kind] = wrap(build_model(**build), kind)
        set_share(models[kind], args.share)
    if args.attention_r:
        models["lora+attention"] = wrap(build_model(**build), "lora", attention_r=args.attention_r)
        set_share(models["lora+attention"], args.share)
    return models


def real_models(adapters: list[str], device: str) -> dict[str, nn.Module]:
    """The real SmolLM2-135M-Instruct, and one copy of it per trained adapter (named by its expert type)."""
    from peft import PeftModel

    from ubmoe_peft.smollm2 import load_smollm2

    # Frozen like every wrapped model's base (see common.build_model: the prefill's LM head runs faster unfrozen)
    models: dict[str, nn.Module] = {"base": load_smollm2()[0].to(device).requires_grad_(False)}
    for folder in adapters:
        model = PeftModel.from_pretrained(load_smollm2()[0].to(device), folder).eval()
        models[f"{model.peft_config['default'].expert_type} (trained)"] = model
    return models


def copy_controls(model: nn.Module) -> dict[str, nn.Module]:
    """Three controls for a copy-expert model (``--copy-controls``), taking its cost at batch > 1 apart:
    - routers zeroed: every token goes to uni, so this costs the routers and the routing code, nothing more;
    - bi experts given the base FFN's own weights, as separate tensors ("cloned") and as the same tensors ("aliased").
      Both route alike and compute the same values op for op; a layer-step with tokens for both experts runs the
      FFN twice, on its own rows each, over two sets of weights (cloned) or the same set twice (aliased)."""
    controls = {}
    for name, alias in ((COPY_ZERO, None), (COPY_CLONED, False), (COPY_ALIASED, True)):
        twin = copy.deepcopy(model)
        for layer in ubmoe_peft.modes.ubmoe_layers(twin):
            if alias is None:
                for router in layer.ubmoe_router.values():
                    router.weight.data.zero_()  # equal logits: every token to uni
                continue
            for expert in layer.ubmoe_copy.values():
                for mine, base in zip(expert.parameters(), layer.base_layer.parameters(), strict=True):
                    mine.data = base.data if alias else base.data.clone()
        controls[name] = twin
    return controls


def chat_prompts(batch: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` user questions of the demo chats in SmolLM2's chat template, left-padded: (ids, mask), (B, P)."""
    from ubmoe_peft.data import load_rows
    from ubmoe_peft.smollm2 import load_smollm2_tokenizer

    tokenizer = load_smollm2_tokenizer()
    tokenizer.padding_side = "left"
    chats = load_rows(None, "sft").shuffle(seed=0).select(range(batch))  # the first held-out chats of the demo
    texts = [
        tokenizer.apply_chat_template(c["messages"][:1], add_generation_prompt=True, tokenize=False) for c in chats
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--share", type=float, default=0.5, choices=[0.0, 0.5, 1.0])
    parser.add_argument(
        "--whole-repeats", type=int, default=3, help="timed rounds of whole generate() calls (informational rows)"
    )
    parser.add_argument(
        "--adapters",
        nargs="+",
        default=None,
        help="saved UBMoE adapter folders of the real SmolLM2-135M-Instruct (e.g. from `ubmoe demo`): time them on "
        "the real model with the demo's chat prompts and their trained routers, instead of the random model",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="also time a second copy of the base model (an A/A control row): how far two identical models read "
        "apart in this run, from memory placement and machine noise alone",
    )
    parser.add_argument(
        "--attention-r",
        type=int,
        default=0,
        help="also time a LoRA model with a mode-bi attention adapter of this rank (mode moe never uses it, so this "
        "measures only its hooks' cost)",
    )
    parser.add_argument(
        "--copy-controls",
        action="store_true",
        help="also time the copy-expert model with its routers zeroed, and with its bi experts set to the base FFN's "
        "weights, cloned and aliased (informational rows): takes the routing cost, the second FFN pass and the "
        "second set of weights apart",
    )
    parser.add_argument(
        "--plan-control",
        action="store_true",
        help="also time the LoRA and copy models with the decode plan off (every layer on the general path; "
        "informational): the plan's gain, measured in the same run",
    )
    args = parser.parse_args()
    threads = pin_threads(args.threads)
    models = real_models(args.adapters, args.device) if args.adapters else random_models(args)
    if args.control:
        models[CONTROL] = copy.deepcopy(models["base"])  # the same weights in freshly allocated memory
    if args.copy_controls:
        copy_model = next((m for name, m in models.items() if name.startswith("copy")), None)
        if copy_model is None:
            parser.error("--copy-controls needs a copy-expert model: pass a copy adapter in --adapters")
        models.update(copy_controls(copy_model))
    twins = {}  # general-path control: its model's name
    if args.plan_control:
        for name in [n for n in models if n.split()[0] in ("lora", "copy") and "(control)" not in n]:
            twins[name.split()[0] + GENERAL] = name
        models.update({twin: general_path_control(models[name]) for twin, name in twins.items()})
    informational = (CONTROL, COPY_ZERO, COPY_CLONED, COPY_ALIASED, *twins)

    rows = []
    for batch in args.batches:
        schedule = None
        if args.adapters:
            ids, mask = chat_prompts(batch, args.device)  # (B, P), left-padded real questions
        else:
            ids = token_batch(batch, args.prompt, models["base"].config.vocab_size, args.device)  # (B, P)
            mask = torch.ones_like(ids)  # (B, P)
            schedule = token_schedule(models["base"], batch, args.new_tokens, args.device)  # (B, N)

        def generate(
            model: nn.Module,
            criteria: list | None = None,
            logits: bool = False,
            ids: torch.Tensor = ids,
            mask: torch.Tensor = mask,
            schedule: torch.Tensor | None = schedule,
        ) -> Any:
            """The generated ids (B, P + N), or with ``logits`` the logits of each step before processing (B, N, V)."""
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    pad_token_id=0,
                    use_cache=True,
                    logits_processor=None if schedule is None else [ForcedTokens(schedule, ids.shape[1])],
                    stopping_criteria=criteria,
                    output_logits=logits,
                    return_dict_in_generate=logits,
                )
            tokens = out.sequences if logits else out
            if tokens.shape[1] != ids.shape[1] + args.new_tokens:
                raise RuntimeError(f"generated {tokens.shape[1] - ids.shape[1]} tokens, not {args.new_tokens}")
            if schedule is not None and not torch.equal(tokens[:, ids.shape[1] :], schedule):
                raise RuntimeError("a row did not emit the forced token schedule")
            return torch.stack(out.logits, dim=1) if logits else tokens

        shares = {k: decode_share(m, lambda m=m: generate(m)) for k, m in models.items() if k not in ("base", CONTROL)}
        for twin, name in twins.items():  # the plan changes how, never what: the same logits on both paths
            if not torch.equal(generate(models[name], logits=True), generate(models[twin], logits=True)):
                raise RuntimeError(f"the {name} model computed other logits with the decode plan than without it")
        calls = {kind: lambda handover, m=model: generate(m, [HandOver(handover)]) for kind, model in models.items()}
        timings = {"": lockstep_times(calls, args.warmup, args.repeats, args.device)}
        if args.whole_repeats:
            whole = [Case(kind, lambda m=model: generate(m)) for kind, model in models.items()]
            timings[", whole calls"] = paired_times(whole, 1, args.whole_repeats, args.device)
        for suffix, cases in timings.items():
            base_case, judged = cases[0], not suffix
            base_tps = batch * args.new_tokens / statistics.median(base_case.times)
            for case in cases[1:]:
                stats = ratio_stats(base_case, case)  # tokens/s ratio = t_base / t_case
                tps = batch * args.new_tokens / statistics.median(case.times)
                judged_case = judged and case.name not in informational
                rows.append(
                    row(
                        "decode",
                        f"{case.name} batch {batch}{suffix}",
                        "tokens/s",
                        tps,
                        "base",
                        base_tps,
                        stats,
                        f">= {TARGET}" if judged_case else "informational",
                        stats["ratio"] >= TARGET if judged_case else None,
                        bi_share=shares.get(case.name),
                    )
                )
    result = {
        "name": "decode",
        "machine": machine() | {"torch_threads": threads},
        "config": vars(args) | {"out": None, "layers": models["base"].config.num_hidden_layers},
        "model": "SmolLM2-135M-Instruct with trained adapters"
        if args.adapters
        else "random, routers steered, tokens forced",
        "timing": "generate() calls in lockstep; rows 'whole calls': whole generate() calls round-robin",
        "rows": rows,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
