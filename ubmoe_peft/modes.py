"""Public mode and stage switches: `set_mode`, `get_mode`, `use_mode`, `set_stage`, `routing_stats`,
`track_routing`."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from peft.utils import ModulesToSaveWrapper
from torch import nn

from .architectures import backbone
from .export import MOE_TWINS
from .tuners.ubmoe.checks import stacklevel_outside_libraries
from .tuners.ubmoe.layer import UBMoELayer
from .tuners.ubmoe.state import MODES, ModeState, RoutingTally, no_adapter_error, superseded_error

STAGES = {"contrastive": "bi", "router": "moe"}


def ubmoe_layers(model: nn.Module) -> list[UBMoELayer]:
    """Every UBMoE layer in ``model`` (a PeftModel, the tuner, the inner transformers model, or a wrapper of it)."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a UBMoE model (a torch module), got {type(model).__name__} {str(model)[:60]!r}; wrap a "
            "transformers model with peft.get_peft_model(model, UBMoEConfig()) or load one with "
            "PeftModel.from_pretrained(base, adapter_dir)."
        )
    return [m for m in model.modules() if isinstance(m, UBMoELayer)]


def mode_state(model: nn.Module) -> ModeState:
    """The mode state ``model``'s UBMoE layers share; refuses a model without them, or one superseded."""
    state = getattr(getattr(model, "base_model", None), "_ubmoe_state", None) or getattr(model, "_ubmoe_state", None)
    if state is not None and state.superseded:
        raise superseded_error(state.superseded)
    if state is not None:
        return state
    layers = ubmoe_layers(model)
    config = getattr(model, "config", None)
    if not layers and getattr(config, "is_causal", True) is False:  # wrapping it is refused: it has no causal mode
        raise ValueError(
            f"{type(model).__name__} has no UBMoE layers and modes: its config says is_causal=False, a bidirectional "
            "model such as merge_and_unload(target='bi') makes, which always embeds as mode bi did. Use it without "
            "modes, or load the adapter onto the original causal base (PeftModel.from_pretrained(base, adapter_dir))."
        )
    if not layers and getattr(config, "model_type", None) in MOE_TWINS:  # a model type exports go to
        raise ValueError(
            f"{type(model).__name__} has no UBMoE layers and modes: it is a mixture-of-experts model (what "
            "merge_and_unload() exports; UBMoE wraps dense FFNs), which runs as it is. Use it without modes; to switch "
            "modes, load a UBMoE adapter onto the dense base it was trained on (PeftModel.from_pretrained(base, dir))."
        )
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no UBMoE layers. Wrap it first: peft.get_peft_model(model, UBMoEConfig())."
        )
    return layers[0]._state


def set_mode(model: nn.Module, mode: str) -> None:
    """Switch ``model`` to mode ``"uni"`` (base model), ``"bi"`` (embeddings) or ``"moe"`` (routed generation)."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"Unknown mode {mode!r}: use one of {list(MODES)}.")
    state = mode_state(model)
    with state.forward_lock:  # between forwards: another thread's forward keeps its mode to its end
        state.mode = mode


def get_mode(model: nn.Module) -> str:
    """The current mode of ``model`` (not the mode bi of another thread's embedding call in progress)."""
    state = mode_state(model)
    with state.forward_lock:
        return state.mode


def use_mode(model: nn.Module, mode: str) -> AbstractContextManager[nn.Module]:
    """Run a block in ``mode`` and restore the previous mode afterwards, also when the block raises. The mode and the
    model are checked at the call (a generator's checks ran only at `with`: a bad mode without `with` passed)."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"Unknown mode {mode!r}: use one of {list(MODES)}.")
    return _switched(model, mode_state(model), mode)


@contextmanager
def _switched(model: nn.Module, state: ModeState, mode: str) -> Iterator[nn.Module]:
    with state.switched(mode):
        yield model


def _active_adapter(model: nn.Module) -> str:
    active = getattr(model, "active_adapter", None)
    if not isinstance(active, (str, list)):  # None, or a method of that name (a SentenceTransformer's): ask a layer
        layers = ubmoe_layers(model)
        active = layers[0].active_adapters if layers else None
    if isinstance(active, list):
        if len(active) != 1:
            raise ValueError(
                f"set_stage trains one adapter at a time, but {active} are active; activate one first "
                "(model.set_adapter(name))."
            )
        active = active[0]
    return active


def set_stage(model: nn.Module, stage: str) -> None:
    """Prepare a training stage (`prepare_stage`), warning where it makes float16 weights trainable."""
    prepare_stage(model, stage)
    names = float16_trainable(model)
    if names:  # the stage trainers refuse these; any other training loop silently turned the expert NaN
        warnings.warn(
            f"set_stage({stage!r}) makes {len(names)} float16 parameters trainable (e.g. {names[0]}): AdamW's update "
            "of a float16 weight underflows to NaN for gradients below about 2e-4, so they turn NaN within a few "
            "steps. Load the base in bfloat16 or float32, or keep float16 weights out of training: "
            "UBMoEConfig(expert_type='lora') and router_dtype='float32', with PEFT's autocast_adapter_dtype left True "
            "(the default: fp32 LoRA weights).",
            stacklevel=stacklevel_outside_libraries(),
        )


def float16_trainable(model: nn.Module) -> list[str]:
    """The names of ``model``'s trainable float16 parameters: an optimizer's update of them underflows (AdamW's eps
    1e-8 is 0 in float16)."""
    return [name for name, param in model.named_parameters() if param.requires_grad and param.dtype == torch.float16]


def prepare_stage(model: nn.Module, stage: str) -> None:
    """Prepare a training stage: ``"contrastive"`` (mode bi, only the bi experts train) or ``"router"`` (mode moe,
    only the routers train). Every other parameter of the model is frozen, except the active adapter's
    ``modules_to_save`` copies (PEFT's option: modules the user asked to train and save in full), which train in
    the stages that run them: both for those in the transformer body (embeddings, a norm), stage router only for
    those after it (the LM head), since embedding runs the body alone (trainable and unused, the head failed
    DDP's check for unused parameters)."""
    if not isinstance(stage, str) or stage not in STAGES:
        raise ValueError(f"Unknown stage {stage!r}: use one of {list(STAGES)}.")
    mode_state(model)  # refuses a model without UBMoE layers, or a superseded one, before anything is frozen
    adapter = _active_adapter(model)
    layers = ubmoe_layers(model)
    if not any(layer.active_adapters for layer in layers):  # it named the deleted adapter "not a UBMoE adapter",
        # and one loaded after it, not made active, was staged while the layers ran the base FFNs
        raise no_adapter_error(STAGES[stage], sorted({name for layer in layers for name in layer.ubmoe_router}))
    if not any(adapter in layer.ubmoe_router for layer in layers):
        raise ValueError(f"Adapter {adapter!r} is not a UBMoE adapter of this model.")
    for param in model.parameters():
        param.requires_grad_(False)
    for layer in layers:
        params = layer.expert_parameters(adapter) if stage == "contrastive" else layer.router_parameters(adapter)
        for param in params:
            param.requires_grad_(True)
    used = backbone(model).modules() if stage == "contrastive" else model.modules()
    for module in used:
        if isinstance(module, ModulesToSaveWrapper) and adapter in module.modules_to_save:
            module.modules_to_save[adapter].requires_grad_(True)
    mode_state(model).keep_trainable(model.parameters())  # inside disable_adapter(): kept on leaving it
    set_mode(model, STAGES[stage])


@contextmanager
def forward_in_mode(model: nn.Module, mode: str | None) -> Iterator[None]:
    """Run the block (one forward) in ``mode`` (None: the current one) while holding ``model``'s forward lock: a
    forward of another thread then runs before or after it in its own mode, as with the embedding model. A model
    without UBMoE layers just runs the block."""
    if mode is None and not ubmoe_layers(model):
        yield
        return
    # DataParallel runs each replica's forward in a worker thread, which would wait for this thread's hold for ever
    state = None if isinstance(model, nn.DataParallel) else mode_state(model)
    with state.forward_lock if state is not None else nullcontext(), use_mode(model, mode) if mode else nullcontext():
        try:
            yield
        except BaseException:
            if state is not None:
                state.end_stale_forward()  # a KeyboardInterrupt out of the forward: its lock, its routing
            raise


def routing_stats(model: nn.Module) -> dict[int, float] | None:
    """{layer index: share of real tokens sent to the bi expert} in the last mode-moe forward (top_k=2: the mean bi
    weight); None before any mode-moe forward."""
    return mode_state(model).shares()


@contextmanager
def track_routing(model: nn.Module) -> Iterator[RoutingTally]:
    """Sum the routing of every mode-moe forward in the block (a whole evaluation, or every step of ``generate``):
    ``tally.shares()`` is {layer index: share of all real tokens sent to the bi expert}, ``tally.mean()`` its mean
    over layers. `routing_stats` keeps only the last forward."""
    state = mode_state(model)
    tally = RoutingTally()
    with state.forward_lock:  # between forwards: a forward running in another thread fills its routing layer by layer
        state.tally()  # open blocks get the last forward's routing now; the new block starts from the next forward
        state.tallies.append(tally)
        state._tallied = state.routing
    try:
        yield tally
    finally:
        with state.forward_lock:
            state.tally()  # the block's last forward
            state.tallies.remove(tally)
            if not state.tallies:
                state._tallied = None  # keep no routing tensors alive for nothing
