"""ubmoe-peft: one decoder LLM that serves both embeddings and generation (UBMoE-LLM, ICML 2025) as a PEFT tuner.

Importing this package registers the ``UBMOE`` method with PEFT, so ``peft.get_peft_model(model, UBMoEConfig())``,
``save_pretrained`` and ``PeftModel.from_pretrained`` work as for any PEFT method.
"""

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
    "ContrastiveConfig",
    "ContrastiveTrainer",
    "RouterConfig",
    "RouterTrainer",
    "DependenceResult",
    "UBMoEConfig",
    "UBMoELayer",
    "UBMoEModel",
    "attention_dependence",
    "get_mode",
    "lm_loss",
    "load_sentence_transformer",
    "multiple_choice_accuracy",
    "routing_stats",
    "set_mode",
    "set_stage",
    "sts_spearman",
    "to_sentence_transformer",
    "track_routing",
    "use_mode",
]
