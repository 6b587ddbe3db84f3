"""ubmoe-peft: one decoder LLM that serves both embeddings and generation (UBMoE-LLM, ICML 2025) as a PEFT tuner.

Importing this package registers the ``UBMOE`` method with PEFT, so ``peft.get_peft_model(model, UBMoEConfig())``,
``save_pretrained`` and ``PeftModel.from_pretrained`` work as for any PEFT method.
"""

import importlib.util

from .dependence import DependenceResult, attention_dependence
from .evaluation import lm_loss, multiple_choice_accuracy, sts_spearman
from .modes import get_mode, routing_stats, set_mode, set_stage, track_routing, use_mode
from .tuners.ubmoe import UBMoEConfig, UBMoELayer, UBMoEModel

__version__ = "0.1.0"


_TRAINERS = ("ContrastiveConfig", "ContrastiveTrainer", "RouterConfig", "RouterTrainer")


def __getattr__(name: str):
    # sentence-transformers and TRL are an optional extra: import them only when asked for
    if name in ("to_sentence_transformer", "load_sentence_transformer"):
        from . import embedding

        return getattr(embedding, name)
    if name in _TRAINERS:
        from . import trainers

        return getattr(trainers, name)
    raise AttributeError(f"module 'ubmoe_peft' has no attribute {name!r}")


__all__ = [
    "DependenceResult",
    "UBMoEConfig",
    "UBMoELayer",
    "UBMoEModel",
    "attention_dependence",
    "get_mode",
    "lm_loss",
    "multiple_choice_accuracy",
    "routing_stats",
    "set_mode",
    "set_stage",
    "sts_spearman",
    "track_routing",
    "use_mode",
]
# the names of the optional extra, where it is installed (a star import resolves each name in __all__)
if all(importlib.util.find_spec(name) for name in ("sentence_transformers", "trl", "datasets")):
    __all__ += [*_TRAINERS, "load_sentence_transformer", "to_sentence_transformer"]
