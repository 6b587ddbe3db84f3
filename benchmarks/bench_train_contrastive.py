"""Question 3: does a stage-1 step (mode bi, contrastive) cost what plain PEFT LoRA on the same FFN projections does?

Both run bidirectional attention (UBMoE through mode bi, plain LoRA by passing ``is_causal=False``), the same rank,
alpha, dropout and rsLoRA, mean pooling, an in-batch-negatives loss (scale 20) and one AdamW step over the trainable
parameters. Time: paired rounds in one process. Peak memory: one fresh process per variant.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import peft
import torch
import torch.nn.functional as F
from common import base_parser, build_model, token_batch, training_benchmark
from torch import nn

import ubmoe_peft

PROJECTIONS = ["gate_proj", "up_proj", "down_proj"]
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.05, use_rslora=True)


def contrastive_loss(query: torch.Tensor, doc: torch.Tensor, scale: float = 20.0) -> torch.Tensor:
    """In-batch negatives: query i's positive is doc i, every other doc is a negative."""
    sim = F.normalize(query, dim=-1) @ F.normalize(doc, dim=-1).T * scale  # (B, B)
    return F.cross_entropy(sim, torch.arange(sim.shape[0], device=sim.device))


def make_step(args: argparse.Namespace, peft_model: nn.Module, **forward_kwargs: Any) -> Callable[[], float]:
    backbone = peft_model.get_base_model().model  # the decoder stack, without the LM head
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-4)
    vocab = peft_model.config.vocab_size
    queries = token_batch(args.batch, args.seq, vocab, args.device, seed=2)  # (B, T)
    docs = token_batch(args.batch, args.seq, vocab, args.device, seed=3)  # (B, T)
    mask = torch.ones_like(queries)  # (B, T)
    peft_model.train()

    def embed(ids: torch.Tensor) -> torch.Tensor:
        hidden = backbone(input_ids=ids, attention_mask=mask, **forward_kwargs).last_hidden_state  # (B, T, C)
        return (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)  # (B, C), mean pooling

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = contrastive_loss(embed(queries), embed(docs))
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def ubmoe_lora(args: argparse.Namespace) -> Callable[[], float]:
    model = peft.get_peft_model(build(args), ubmoe_peft.UBMoEConfig(expert_type="lora", **LORA))
    ubmoe_peft.set_stage(model, "contrastive")  # mode bi, only the expert's LoRA weights train
    return make_step(args, model)


def peft_lora(args: argparse.Namespace) -> Callable[[], float]:
    model = peft.get_peft_model(build(args), peft.LoraConfig(target_modules=PROJECTIONS, **LORA))
    return make_step(args, model, is_causal=False)


def build(args: argparse.Namespace) -> nn.Module:
    return build_model(args.shape, args.layers, args.device, args.dtype)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="pairs per step")
    parser.add_argument("--seq", type=int, default=64)
    variants = {"peft LoRA (bi attention)": peft_lora, "ubmoe LoRA expert, mode bi": ubmoe_lora}
    training_benchmark(
        "stage-1 contrastive step",
        Path(__file__),
        parser,
        variants,
        "peft LoRA (bi attention)",
        {"ubmoe LoRA expert, mode bi": 1.05},
    )


if __name__ == "__main__":
    main()
