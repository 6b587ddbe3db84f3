"""`attention_dependence`: how much each token's attention rests on earlier tokens, itself, and later tokens.

For one text of n tokens and one layer, with A the attention weights averaged over heads (n x n, rows sum to 1)::

    preceding  = sum_{i > j} A[i, j] / n      (DP-before in the UBMoE paper)
    self       = sum_i A[i, i] / n            (DP-main)
    subsequent = sum_{i < j} A[i, j] / n      (DP-after)

reported in percent, per layer averaged over texts, and on average over layers and texts. The three add up to 100.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from .architectures import text_config
from .evaluation import (
    _evaluating,
    check_collection,
    check_sizes,
    check_tokenizer,
    input_device,
    model_to_evaluate,
    with_pad_token,
)
from .modes import forward_in_mode

KINDS = ("preceding", "self", "subsequent")


@dataclass
class DependenceResult:
    """Percentages of attention mass on preceding tokens, the token itself and subsequent tokens."""

    average: dict[str, float]
    per_layer: list[dict[str, float]] = field(default_factory=list)


@contextmanager
def _eager_attention(model: nn.Module):
    """Attention weights exist only in eager attention; switch to it for the measurement and back afterwards."""
    config = text_config(model)
    previous = getattr(config, "_attn_implementation", None)
    config._attn_implementation = "eager"
    try:
        yield
    finally:
        config._attn_implementation = previous


def _split(attn: torch.Tensor) -> torch.Tensor:
    """(n, n) head-averaged attention of one text -> (3,) percentages: preceding, self, subsequent."""
    n = attn.shape[-1]
    diagonal = attn.diagonal().sum()
    preceding = attn.tril(-1).sum()
    subsequent = attn.triu(1).sum()
    return torch.stack([preceding, diagonal, subsequent]) / n * 100  # (3,)


@torch.no_grad()
def attention_dependence(
    model: nn.Module,
    tokenizer,
    texts: Sequence[str],
    mode: str | None = None,
    batch_size: int = 8,
    max_length: int = 256,
) -> DependenceResult:
    """Attention dependence of ``texts`` in ``model``'s current mode (or ``mode``), averaged over texts and layers.
    ``model`` may be a SentenceTransformer made by `to_sentence_transformer` (its model is measured)."""
    model = model_to_evaluate(model)
    check_tokenizer(tokenizer)
    check_collection(texts, "texts")  # a generator failed on len() with a bare TypeError
    texts = list(texts)  # a numpy array or pandas Series has no truth value, and a Series indexes by label
    if not texts:
        raise ValueError(f"texts must be a non-empty list of strings, got {texts!r}.")
    # None and NaN (a missing cell of a table) are empty texts; a row (dict) or a number was called "empty" too
    missing = {i for i, t in enumerate(texts) if t is None or (isinstance(t, float) and math.isnan(t))}
    other = [i for i, t in enumerate(texts) if not isinstance(t, str) and i not in missing]
    if other:
        first = texts[other[0]]
        raise ValueError(
            f"texts[{other[0]}] is {repr(first)[:60]}, a {type(first).__name__} ({len(other)} such entries): "
            "attention_dependence measures plain texts. Pass strings, e.g. [row['text'] for row in rows]."
        )
    blank = [i for i, text in enumerate(texts) if not isinstance(text, str) or not text.strip()]
    if blank:
        raise ValueError(
            f"texts[{blank[0]}] is {texts[blank[0]]!r} ({len(blank)} such texts): every text must be non-empty "
            "(a blank line of a text file is one)."
        )
    tokenizer = with_pad_token(tokenizer)
    check_sizes(batch_size, max_length)
    if max_length < 2:  # one token attends only to itself: 100% self whatever the mode
        raise ValueError(
            f"max_length={max_length} keeps one token per text, which can attend only to itself, so every mode would "
            "read 100% self. Give at least 2 (e.g. 256) to measure preceding and subsequent attention."
        )
    device = input_device(model)
    totals: torch.Tensor | None = None  # (L, 3) sums over texts
    with _evaluating(model):  # eval: no dropout in the weights read
        for start in range(0, len(texts), batch_size):
            chunk = list(texts[start : start + batch_size])
            batch = tokenizer(
                chunk, return_tensors="pt", padding=True, truncation=True, max_length=max_length,
                return_attention_mask=True,
            )  # fmt: skip
            empty = [i for i, n in enumerate(batch["attention_mask"].sum(dim=1).tolist()) if n == 0]
            if empty:  # its 0/0 made every average NaN
                raise ValueError(
                    f"texts[{start + empty[0]}] ({chunk[empty[0]]!r}) tokenizes to no tokens, so it has no attention "
                    "to read; drop it."
                )
            batch = {k: v.to(device) for k, v in batch.items()}
            # mode and eager attention per forward, under the model's forward lock: other threads' forwards (a
            # generation) run before or after it in their own mode and attention
            with forward_in_mode(model, mode), _eager_attention(model):
                out = model(**batch, output_attentions=True)
            real = batch["attention_mask"].bool()  # (B, T)
            per_layer = []
            for layer_attn in out.attentions:  # each (B, H, T, T)
                mean_heads = layer_attn.float().mean(dim=1)  # (B, T, T)
                rows = [_split(mean_heads[b][real[b]][:, real[b]]) for b in range(len(chunk))]  # B x (3,)
                per_layer.append(torch.stack(rows).sum(0))  # (3,)
            chunk_totals = torch.stack(per_layer)  # (L, 3)
            totals = chunk_totals if totals is None else totals + chunk_totals
    per_layer_mean = (totals / len(texts)).cpu()  # (L, 3)
    average = per_layer_mean.mean(0)  # (3,)
    return DependenceResult(
        average={k: float(v) for k, v in zip(KINDS, average, strict=True)},
        per_layer=[{k: float(v) for k, v in zip(KINDS, row, strict=True)} for row in per_layer_mean],
    )
