"""Question 4: does a stage-2 step (mode moe, only routers trainable) cost what a frozen base model's backward does?

Baseline: the base model with every weight frozen, forward and backward of the causal LM loss. Its backward starts
from layer 0's FFN output (made a tensor that requires grad), as deep as the routers' backward goes: the layer-0
router needs the gradient at its FFN's output and nothing below it, since the layer's input requires no grad. Both
backwards thus run through every layer above layer 0's FFN and into neither that FFN nor layer 0's attention; what
the router step adds is the routers' own work. UBMoE: LoRA and copy experts after ``set_stage(model, "router")`` with
the routers steered to send 50% of tokens to the bi expert, the same loss, and an AdamW step whose state holds the
routers only (checked: no optimizer state for frozen weights). Each expert runs with both router gradients:
``router_gradient="scale"`` (only the chosen expert runs: the base model's cost, target 1.05x) and the default
``"compare"`` (both experts run on every token so that the router learns which is better: about one more FFN pass,
reported without a target).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import peft
import torch
from common import base_parser, build_model, set_share, token_batch, training_benchmark

import ubmoe_peft
from ubmoe_peft.architectures import decoder_layers


def frozen_base(args: argparse.Namespace) -> Callable[[], float]:
    model = build_model(args.shape, args.layers, args.device, args.dtype).train()
    model.requires_grad_(False)
    first_ffn = decoder_layers(model)[0][1].mlp
    first_ffn.register_forward_hook(lambda _module, _args, out: out.detach().requires_grad_(True))  # (B, T, C)
    ids = token_batch(args.batch, args.seq, model.config.vocab_size, args.device)  # (B, T)

    def step() -> float:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.item()

    return step


def router_stage(expert_type: str, gradient: str) -> Callable[[argparse.Namespace], Callable[[], float]]:
    def make(args: argparse.Namespace) -> Callable[[], float]:
        base = build_model(args.shape, args.layers, args.device, args.dtype)
        config = ubmoe_peft.UBMoEConfig(expert_type=expert_type, router_gradient=gradient)
        model = peft.get_peft_model(base, config).train()
        ubmoe_peft.set_stage(model, "router")  # mode moe, only routers trainable
        set_share(model, 0.5)
        params = [p for p in model.parameters() if p.requires_grad]
        routers = {id(p) for layer in ubmoe_peft.modes.ubmoe_layers(model) for p in layer.ubmoe_router.parameters()}
        if {id(p) for p in params} != routers:
            raise RuntimeError("set_stage('router') left parameters other than the routers trainable")
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        ids = token_batch(args.batch, args.seq, base.config.vocab_size, args.device)  # (B, T)

        def step() -> float:
            optimizer.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            return loss.item()

        return step

    return make


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    baseline = "base, all frozen (fwd+bwd)"
    variants = {baseline: frozen_base}
    for expert in ("lora", "copy"):
        name = "LoRA" if expert == "lora" else "copy"
        variants[f"ubmoe {name} expert, router stage 50%, scale gradient"] = router_stage(expert, "scale")
        variants[f"ubmoe {name} expert, router stage 50%, compare gradient"] = router_stage(expert, "compare")
    targets = {name: 1.05 for name in variants if name.endswith("scale gradient")}
    training_benchmark("stage-2 router step", Path(__file__), parser, variants, baseline, targets)


if __name__ == "__main__":
    main()
