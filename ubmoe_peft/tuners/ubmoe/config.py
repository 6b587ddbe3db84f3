"""`UBMoEConfig`: the adapter configuration, saved as ``adapter_config.json``."""

from __future__ import annotations

import json
import numbers
import os
import re
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal

from peft.config import PeftConfig

from ..._peft_type import UBMOE_PEFT_TYPE
from ...io import CONFIG_NAME, AdapterFileError, atomic_write_text

EXPERT_TYPES = ("lora", "copy")
ROUTER_GRADIENTS = ("compare", "scale")
ROUTER_DTYPES = ("float32", "bfloat16", "float16")
_FLOAT32_MAX = 3.4028234663852886e38
_LOADING: ContextVar[bool] = ContextVar("ubmoe_config_loading", default=False)  # inside from_pretrained


def _plain_number(value: Any) -> Any:
    """A NumPy (or other library's) integer or real as Python's int or float: they were refused as not a number
    (``top_k=np.int64(1)``: "top_k must be 1 or 2"), and JSON cannot save them. Anything else as given."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


@dataclass
class UBMoEConfig(PeftConfig):
    """Pairs every targeted FFN (the unidirectional expert) with a bidirectional expert and a token-level router."""

    expert_type: Literal["lora", "copy"] = field(
        default="lora",
        metadata={
            "help": "How the bidirectional expert is built: 'lora' adds LoRA deltas on the FFN's projections (base "
            "weights shared and frozen); 'copy' is a full trainable copy of the FFN."
        },
    )
    r: int = field(default=8, metadata={"help": "LoRA rank of the bidirectional expert (expert_type='lora')."})
    lora_alpha: float = field(
        default=16, metadata={"help": "LoRA alpha; the delta is scaled by alpha/r (alpha/sqrt(r) with rsLoRA)."}
    )
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input, in [0, 1)."})
    use_rslora: bool = field(
        default=True, metadata={"help": "Rank-stabilized LoRA scaling alpha/sqrt(r), as in the UBMoE paper."}
    )
    attention_r: int = field(
        default=0,
        metadata={
            "help": "Rank of an optional LoRA on the attention projections that only mode 'bi' uses (beyond the "
            "paper: better embeddings); modes 'uni' and 'moe' never see it. 0 (default): no attention adapter."
        },
    )
    target_modules: list[str] | str | None = field(
        default=None,
        metadata={
            "help": "Names of the FFN modules to wrap (matched against the end of module names, or a regex when a "
            "string). Default: found from the model_type table, else the decoder layers' 'mlp'/'feed_forward'/'ffn'."
        },
    )
    ffn_projections: list[str] | None = field(
        default=None,
        metadata={
            "help": "Names, relative to the FFN, of the linear layers that get LoRA deltas. Default: every linear "
            "layer inside the FFN (e.g. gate_proj, up_proj, down_proj). LoRA expert only (a copy expert copies the "
            "whole FFN)."
        },
    )
    top_k: int = field(
        default=1,
        metadata={
            "help": "Experts per token in mode 'moe': 1 routes each token to one expert (the paper, base-model "
            "cost); 2 is a soft mixture of both experts (about twice the FFN cost)."
        },
    )
    router_gradient: Literal["compare", "scale"] = field(
        default="compare",
        metadata={
            "help": "How a top-1 router learns in stage router. 'compare' (default): both experts run on every token "
            "while the routers train; the output is still the chosen expert's, and each router gets the gradient of "
            "p_bi times the two experts' difference (a straight-through estimator): it learns which expert is better "
            "for a token. 'scale': only the chosen expert runs (base-model cost) and the router learns only whether "
            "to scale that expert's output up or down (the Switch / Mixtral-style signal). Inference is the same."
        },
    )
    router_dtype: str = field(
        default="float32",
        metadata={"help": f"dtype of the router weights and logits, one of {ROUTER_DTYPES}; float32 is safest."},
    )
    layers_to_transform: list[int] | int | None = field(
        default=None,
        metadata={"help": "Decoder layer indices whose FFN is wrapped. Default: every layer."},
    )
    modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Extra modules to train and save in full (PEFT's usual option)."}
    )
    base_model_signature: dict | None = field(
        default=None,
        metadata={
            "help": "Filled in when the adapter is created: the base's model_type, hidden_size, FFN (intermediate) "
            "size, number of decoder layers and attention head counts (query and key-value). Loading the adapter "
            "onto a model that differs in any of them fails "
            "with a message naming both."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = UBMOE_PEFT_TYPE
        for name in ("r", "top_k", "attention_r", "lora_alpha", "lora_dropout"):  # NumPy's numbers, as Python's
            setattr(self, name, _plain_number(getattr(self, name)))
        if isinstance(self.layers_to_transform, (list, tuple)):
            self.layers_to_transform = [_plain_number(i) for i in self.layers_to_transform]
        else:
            self.layers_to_transform = _plain_number(self.layers_to_transform)
        if self.expert_type not in EXPERT_TYPES:
            raise ValueError(
                f"UBMoEConfig(expert_type={self.expert_type!r}) is not supported: use one of {list(EXPERT_TYPES)}."
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k not in (1, 2):
            raise ValueError(
                f"UBMoEConfig(top_k={self.top_k!r}) is invalid: UBMoE has two experts, so top_k must be 1 "
                "(route each token to one expert) or 2 (mix both)."
            )
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"UBMoEConfig(r={self.r!r}) is invalid: the LoRA rank must be a positive integer.")
        if isinstance(self.attention_r, bool) or not isinstance(self.attention_r, int) or self.attention_r < 0:
            raise ValueError(
                f"UBMoEConfig(attention_r={self.attention_r!r}) is invalid: use 0 (no attention adapter) or a positive "
                "LoRA rank."
            )
        if isinstance(self.lora_dropout, bool) or not isinstance(self.lora_dropout, (int, float)):
            raise ValueError(f"UBMoEConfig(lora_dropout={self.lora_dropout!r}) must be a number in [0, 1).")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"UBMoEConfig(lora_dropout={self.lora_dropout!r}) must be in [0, 1).")
        if not isinstance(self.router_gradient, str) or self.router_gradient not in ROUTER_GRADIENTS:
            raise ValueError(
                f"UBMoEConfig(router_gradient={self.router_gradient!r}) is not supported: use one of "
                f"{list(ROUTER_GRADIENTS)}."
            )
        if self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(
                f"UBMoEConfig(router_dtype={self.router_dtype!r}) is not supported: use one of {list(ROUTER_DTYPES)}."
            )
        if isinstance(self.layers_to_transform, int) and not isinstance(self.layers_to_transform, bool):
            self.layers_to_transform = [self.layers_to_transform]
        if self.layers_to_transform is not None and (
            not isinstance(self.layers_to_transform, (list, tuple))
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.layers_to_transform)
        ):
            raise ValueError(
                f"UBMoEConfig(layers_to_transform={self.layers_to_transform!r}) must be a non-negative int or a "
                "list of them (decoder layer indices)."
            )
        if isinstance(self.target_modules, (list, tuple, set)):
            self.target_modules = list(self.target_modules)
        chosen = (("layers_to_transform", "layer"), ("ffn_projections", "projection"), ("target_modules", ""))
        for name, means in chosen:
            value = getattr(self, name)
            if isinstance(value, (list, tuple)) and not value:  # named nothing: the errors after it contradicted
                raise ValueError(
                    f"UBMoEConfig({name}={value!r}) selects no {means or 'module'}: leave it None for "
                    + ("the FFN found from the model" if name == "target_modules" else f"every {means}")
                    + ", or name some."
                )
        self._check_types()
        # Ignored, it trained the whole FFN. Only a new adapter's (one saved so still loads: its copy is what it is)
        if self.expert_type == "copy" and self.ffn_projections is not None and not self.is_saved:
            raise ValueError(
                f"UBMoEConfig(ffn_projections={self.ffn_projections!r}) chooses the projections of a LoRA expert, but "
                "expert_type='copy' trains a copy of the whole FFN. Leave ffn_projections None, or use "
                "expert_type='lora'."
            )

    def _check_types(self) -> None:
        """Types that a hand-edited or corrupted adapter_config.json could get wrong, checked before any use."""
        number = (int, float)
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, number):
            raise ValueError(f"UBMoEConfig(lora_alpha={self.lora_alpha!r}) must be a number, e.g. 16.")
        if not abs(self.lora_alpha) <= _FLOAT32_MAX:  # also NaN and inf: the scaling rides on float32 matmuls
            raise ValueError(
                f"UBMoEConfig(lora_alpha={self.lora_alpha!r}) is not a finite float32 number; use a usual LoRA alpha, "
                "e.g. 16."
            )
        if self.lora_alpha <= 0:  # PEFT allows 0, which makes a LoRA expert the original FFN with no gradient
            raise ValueError(
                f"UBMoEConfig(lora_alpha={self.lora_alpha!r}) must be positive: the LoRA scaling is lora_alpha / r "
                "(or / sqrt(r) with rsLoRA), and at 0 the bi expert stays the original FFN and never trains. Use a "
                "usual LoRA alpha, e.g. 16."
            )
        if isinstance(self.lora_dropout, bool) or not isinstance(self.lora_dropout, number):
            raise ValueError(f"UBMoEConfig(lora_dropout={self.lora_dropout!r}) must be a number in [0, 1).")
        if not isinstance(self.use_rslora, bool):
            raise ValueError(f"UBMoEConfig(use_rslora={self.use_rslora!r}) must be True or False.")
        for name in ("target_modules", "ffn_projections", "modules_to_save"):
            value = getattr(self, name)
            names_ok = isinstance(value, list) and all(isinstance(v, str) and v for v in value)
            if value is not None and not names_ok and not (name == "target_modules" and isinstance(value, str)):
                raise ValueError(
                    f"UBMoEConfig({name}={value!r}) must be None or a list of module names"
                    + (" (or one regex string)." if name == "target_modules" else ".")
                )
        if isinstance(self.target_modules, str):
            try:
                re.compile(self.target_modules)
            except re.error as exc:
                raise ValueError(
                    f"UBMoEConfig(target_modules={self.target_modules!r}) is not a valid regular expression ({exc}). "
                    "Give a list of module names (e.g. ['mlp']) or a valid regex."
                ) from exc
            if not self.target_modules:
                raise ValueError(
                    "UBMoEConfig(target_modules='') matches no module name. Give the FFN's name, e.g. ['mlp'], or None "
                    "for the default."
                )
        if self.base_model_signature is not None and not isinstance(self.base_model_signature, dict):
            raise ValueError(
                f"UBMoEConfig(base_model_signature={self.base_model_signature!r}) must be None or the dict that "
                "ubmoe-peft records when it creates an adapter; leave it None for a new adapter."
            )

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None:
        """Write adapter_config.json atomically (PEFT's content, written to a temp file and renamed)."""
        if os.path.isfile(save_directory):
            raise ValueError(f"save_pretrained needs a folder, but {save_directory} is a file.")
        os.makedirs(save_directory, exist_ok=True)
        output = {k: list(v) if isinstance(v, set) else v for k, v in self.to_dict().items()}
        auto_mapping = kwargs.pop("auto_mapping_dict", None)
        if auto_mapping is not None:
            output["auto_mapping"] = auto_mapping
        atomic_write_text(os.path.join(save_directory, CONFIG_NAME), json.dumps(output, indent=2, sort_keys=True))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, subfolder: str | None = None, **kwargs: Any):
        """Load adapter_config.json; any invalid content raises `AdapterFileError` naming the file."""
        token = _LOADING.set(True)
        try:
            config = super().from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)
            config._from_file = True  # not a dataclass field: never saved
            return config
        except AdapterFileError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            where = os.path.join(os.fspath(pretrained_model_name_or_path), subfolder or "", CONFIG_NAME)
            raise AdapterFileError(
                f"{where} is not a valid UBMoE adapter config: {exc} Fix or regenerate the file with "
                "model.save_pretrained(folder)."
            ) from exc
        finally:
            _LOADING.reset(token)

    @property
    def is_saved(self) -> bool:
        """Read from an adapter_config.json (also one written before base_model_signature existed), not new."""
        return self.base_model_signature is not None or getattr(self, "_from_file", False) or _LOADING.get()

    @property
    def scaling(self) -> float:
        """The factor on the LoRA delta B(A(x))."""
        return self.lora_scaling(self.r)

    def lora_scaling(self, rank: int) -> float:
        """alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.lora_alpha / (rank**0.5 if self.use_rslora else rank)
