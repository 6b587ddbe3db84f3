"""Tiny random decoder models built in-process from configs (no downloads)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

import ubmoe_peft  # noqa: F401  (registers the tuner)

VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**_COMMON),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=8),
    "gemma": lambda: GemmaConfig(**_COMMON, head_dim=8),
    "gemma2": lambda: Gemma2Config(**_COMMON, head_dim=8, sliding_window=64),
    "phi3": lambda: Phi3Config(**_COMMON),
}


def _export_config(model_type: str, **kwargs):
    return lambda: AutoConfig.for_model(model_type, **_COMMON, **kwargs)


_GRANITE = dict(embedding_multiplier=3.0, residual_multiplier=0.7, attention_multiplier=0.2, logits_scaling=2.5)
# Dense families tested for the MoE export only (tests/test_merge.py); CONFIGS holds those every test covers. Each
# sets what its MoE twin has to carry over: Granite's multipliers, a head_dim apart from hidden / heads,
# sliding-window layers shorter than the test texts, Cohere2's rope-free global layer, Qwen3.5's linear attention.
EXPORT_CONFIGS = dict(
    granite=_export_config("granite", **_GRANITE),
    granite_swa=_export_config(
        "granite_swa", **_GRANITE, sliding_window=4, layer_types=["full_attention", "sliding_attention"]
    ),
    ernie4_5=_export_config("ernie4_5", head_dim=16),
    olmo2=_export_config("olmo2"),
    cohere2=_export_config(
        "cohere2", sliding_window=4, layer_types=["sliding_attention", "full_attention"], logit_scale=0.5
    ),
    seed_oss=_export_config("seed_oss", head_dim=16),
    qwen3_5_text=_export_config("qwen3_5_text", head_dim=8, layer_types=["linear_attention", "full_attention"]),
    exaone=_export_config("exaone"),
    internlm3=_export_config("internlm3", head_dim=16),
    iquestcoder=_export_config("iquestcoder", head_dim=16),
)
ARCHS = list(CONFIGS)
ATTNS = ["eager", "sdpa"]
EXPERTS = ["lora", "copy"]
# transformers refuses sdpa for Gemma2 (soft-capped attention) and Granite-SWA (attention sinks)
NO_SDPA = {"gemma2", "granite_swa"}
ARCH_ATTNS = [(arch, attn) for arch in ARCHS for attn in ATTNS if not (attn == "sdpa" and arch in NO_SDPA)]


def config_of(arch: str):
    """A new config of a tested architecture (CONFIGS) or of one tested for the MoE export only."""
    return (CONFIGS | EXPORT_CONFIGS)[arch]()


def tiny_model(arch: str = "llama", attn: str | None = None, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A tiny random causal LM of ``arch`` in eval mode; the same seed gives the same weights."""
    attn = attn or ("eager" if arch in NO_SDPA else "sdpa")
    torch.manual_seed(seed)
    config = config_of(arch)
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def perturb_adapters(model: torch.nn.Module, std: float = 0.5, seed: int = 1) -> None:
    """Give every expert and router parameter random values, so the experts differ from the base FFN."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".ubmoe_" in name:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32).to(param.dtype) * std)


def hidden(model, ids, mask, **kwargs) -> torch.Tensor:
    """The last layer's hidden states, without gradients."""
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **kwargs).hidden_states[-1]


def batch(seed: int = 0, b: int = 3, t: int = 9, padding: str | None = "left"):
    """Random ids and an attention mask; the first row is padded (left/right) by 3 tokens when ``padding`` is set."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, t), generator=gen)  # (B, T)
    mask = torch.ones_like(ids)  # (B, T)
    if padding == "left":
        ids[0, :3], mask[0, :3] = 0, 0
    elif padding == "right":
        ids[0, -3:], mask[0, -3:] = 0, 0
    return ids, mask


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


WORDS = [a + b for a in "abcdefghijklmnop" for b in "abcdefgh"]  # 128 words, word i has id i


def w(*ids: int) -> str:
    """A text whose word-level token ids are ``ids``."""
    return " ".join(WORDS[i] for i in ids)


@pytest.fixture
def tokenizer():
    """A word-level tokenizer over ``WORDS`` (ids match the tiny models' vocabulary)."""
    tok = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token=WORDS[3]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=WORDS[0], eos_token=WORDS[2], unk_token=WORDS[3])
