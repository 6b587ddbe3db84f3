"""Put a model back as it was when a `PeftModel.from_pretrained` onto it, or a `load_adapter` into it, is refused.

Loading onto a base that an earlier UBMoE model wraps changes that model in place before the files can be checked:
PEFT writes the new adapter's config into the shared ``peft_config``, `UBMoEModel._take_over` moves the layers to the
new model and drops the earlier adapter of that name, and the new layers and hooks come in. The weights are checked
only as PEFT loads them, after all that (their shapes against the layers built). A refused load (a damaged file, in
the README's own ``save_pretrained(d); PeftModel.from_pretrained(base, d)``) left the earlier, trained model with a
fresh adapter and refusing every call; a refused ``load_adapter`` under a new name left that never-loaded adapter
in the model. Neither PEFT nor torch can undo an injection, so this records what those
steps change - every module's attributes (children, adapter dicts, hook tables, flags), the parameters'
``requires_grad``, the mode states and the earlier tuners' hook handles - and writes it back, in place (the containers
are shared: the earlier tuner and the base hold the same ``peft_config`` dict). Tensors are kept by reference: the
load writes only into the new adapter's own parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from torch import nn


def _saved(obj: Any) -> dict[str, tuple[Any, Any]]:
    """``obj``'s attributes, each with a shallow copy of its contents where it is a dict, set or list (of any
    subclass: ``copy.copy`` keeps a defaultdict's factory, which its constructor does not take positionally)."""
    return {
        key: (value, copy.copy(value) if isinstance(value, (dict, set, list)) else None)
        for key, value in vars(obj).items()
    }


def _restore(obj: Any, saved: dict[str, tuple[Any, Any]]) -> None:
    for key in [key for key in vars(obj) if key not in saved]:  # attributes the refused load added
        object.__delattr__(obj, key)
    for key, (value, contents) in saved.items():
        if isinstance(value, list):  # the same container, its contents as they were
            value[:] = contents
        elif contents is not None:
            value.clear()
            value.update(contents)
        object.__setattr__(obj, key, value)


def snapshot(model: nn.Module, owners: set[Any]) -> Callable[[], None]:
    """Record ``model`` (a base that UBMoE tuners ``owners`` wrap); the function returned writes it back."""
    from .layer import UBMoELayer

    modules = {id(m): (m, _saved(m)) for m in model.modules()}
    states = {id(m._state): m._state for m in model.modules() if isinstance(m, UBMoELayer)}
    states |= {id(owner._ubmoe_state): owner._ubmoe_state for owner in owners}
    kept = [(state, _saved(state)) for state in states.values()]
    handles = [(owner._ubmoe_hooks, list(owner._ubmoe_hooks)) for owner in owners]
    trainable = [(p, p.requires_grad) for p in model.parameters()]

    def restore() -> None:
        for module, saved in modules.values():
            _restore(module, saved)
        for state, saved in kept:
            _restore(state, saved)
        for hooks, contents in handles:
            hooks[:] = contents
        for parameter, flag in trainable:
            parameter.requires_grad_(flag)

    return restore
