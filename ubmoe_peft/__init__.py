"""ubmoe-peft: one decoder LLM that serves both embeddings and generation (UBMoE-LLM, ICML 2025) as a PEFT tuner.

Importing this package registers the ``UBMOE`` method with PEFT, so ``peft.get_peft_model(model, UBMoEConfig())``,
``save_pretrained`` and ``PeftModel.from_pretrained`` work as for any PEFT method.
"""

from .modes import get_mode, routing_stats, set_mode, set_stage, use_mode
from .tuners.ubmoe import UBMoEConfig, UBMoELayer, UBMoEModel

__version__ = "0.1.0"

__all__ = [
    "UBMoEConfig",
    "UBMoELayer",
    "UBMoEModel",
    "get_mode",
    "routing_stats",
    "set_mode",
    "set_stage",
    "use_mode",
]
