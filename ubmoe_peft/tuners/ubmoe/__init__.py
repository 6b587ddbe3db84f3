"""The UBMoE tuner, registered with PEFT on import (PEFT's own layout: config / layer / model)."""

from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING
from peft.utils import register_peft_method

from ... import io
from ..._peft_type import UBMOE_PEFT_TYPE
from .config import UBMoEConfig
from .layer import UBMoELayer
from .model import UBMoEModel

if UBMOE_PEFT_TYPE not in PEFT_TYPE_TO_TUNER_MAPPING:  # a re-import must not register twice
    register_peft_method(name="ubmoe", config_cls=UBMoEConfig, model_cls=UBMoEModel, prefix="ubmoe_")
io.install()  # atomic adapter saves and safe, clearly failing adapter loads (see ubmoe_peft/io.py for why)

__all__ = ["UBMoEConfig", "UBMoELayer", "UBMoEModel"]
