"""The three modes of a wrapped model and the per-model state the wrapped layers read."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...architectures import ONE_MASK_FOR_ALL_LAYERS


@dataclass(frozen=True)
class ModeSpec:
    """What a mode does: whether attention is causal, and which FFN expert(s) run."""

    causal: bool
    ffn: str  # "uni" (original FFN), "bi" (bidirectional expert), "moe" (routed)


# A future attention adapter used only by mode "bi" adds one field here (e.g. attention="bi"), not a new mode system.
MODES: dict[str, ModeSpec] = {
    "uni": ModeSpec(causal=True, ffn="uni"),
    "bi": ModeSpec(causal=False, ffn="bi"),
    "moe": ModeSpec(causal=True, ffn="moe"),
}


def allowed_pairs(mask: torch.Tensor) -> torch.Tensor:
    """Which query-key pairs a 4D attention mask (bool, or additive float) lets attend: (B, 1|H, Q, K) bool."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def block_mask_allows(mask: Any, rows: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Whether flex attention under the BlockMask ``mask`` lets each query attend to its key (head 0), for index
    tensors of shape (N,). Only where both parts of the mask agree: its ``mask_mod`` (which flex's reference path
    applies everywhere) and its block lists (the compiled kernel visits listed blocks only, and skips ``mask_mod`` in
    those listed as full); ``create_block_mask`` makes them agree, so this is what flex attention computes."""
    size_q, size_k = mask.BLOCK_SIZE
    listed = mask.to_dense()  # (B|1, H|1, Qb, Kb): blocks listed as partial or full
    listed = listed[rows % listed.shape[0], 0, queries // size_q, keys // size_k] > 0  # (N,)
    # one pair per mask_mod call, as flex attention calls it (transformers' mask functions index 2D padding masks)
    allowed = torch.vmap(mask.mask_mod)(rows, torch.zeros_like(rows), queries, keys)  # (N,)
    return listed & allowed.to(listed.device)  # (N,)


def first_real_sees_second(mask: Any) -> bool:
    """Whether, in every row with two or more real tokens, the first real token may attend to the second, under a 4D
    attention mask (bool, or additive float) or flex attention's BlockMask; True where there is nothing to check (a
    2D mask, a single query). A causal mask fails it in a batch's longest row, which has no padding."""
    if isinstance(mask, torch.Tensor):
        if mask.dim() != 4 or mask.shape[-2] < 2:
            return True
        allowed = allowed_pairs(mask)  # (B, 1|H, Q, K)
        # Real tokens: the keys some query attends to, read from this mask itself. (The model's last attention_mask
        # is another batch's when gradient checkpointing recomputes an earlier forward of the step.)
        real = allowed[:, 0].any(dim=-2)  # (B, K)

        def sees(rows: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
            return allowed[rows, 0, queries, keys]  # (N,)

    else:  # a BlockMask: read at the few pairs needed, never expanded to (B, Q, K)
        length = min(mask.seq_lengths)
        if length < 2:
            return True
        device = mask.kv_num_blocks.device
        sees = functools.partial(block_mask_allows, mask)
        index = torch.arange(length, device=device)  # (T,)
        grid = torch.cartesian_prod(torch.arange(mask.kv_num_blocks.shape[0], device=device), index)  # (B * T, 2)
        # Real tokens: those that may attend to themselves (a padding key is seen by no query, itself included)
        real = sees(grid[:, 0], grid[:, 1], grid[:, 1]).view(-1, length)  # (B, T)
    # In every row with two or more real tokens, the first real token must see the second one.
    first = real.int().argmax(dim=1)  # (B,)
    after_first = real & (torch.arange(real.shape[1], device=real.device) > first.unsqueeze(1))  # (B, K)
    second = after_first.int().argmax(dim=1)  # (B,)
    rows = torch.arange(real.shape[0], device=real.device)  # (B,)
    return not bool((after_first.any(dim=1) & ~sees(rows, first, second)).any())


def packed_bidirectional_mask(config: Any, reference: torch.Tensor, position_ids: Any, dtype: torch.dtype) -> Any:
    """Mode bi's attention mask for packed rows (several documents per row, their position_ids restarting at 0, no
    attention_mask: TRL's padding_free and packing), in which each document attends bidirectionally to itself alone;
    None where no row is packed. ``reference``: input_ids (B, T) or inputs_embeds (B, T, C).

    Hand-written because transformers (5.2 to 5.25) hands ``is_causal=False`` on to ``create_bidirectional_mask``
    without the position_ids, so its bidirectional mask covers padding only and a packed row's documents saw each
    other (eager, sdpa, flex), while its causal mask keeps them apart. The mask itself is transformers' own, built
    from the position_ids; models with sliding-window layers get theirs, as transformers builds them."""
    from transformers.masking_utils import (
        create_bidirectional_mask,
        create_bidirectional_sliding_window_mask,
        find_packed_sequence_indices,
    )

    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:  # (B|1, T); 3D: multimodal RoPE
        return None
    batch, length = reference.shape[:2]
    if find_packed_sequence_indices(position_ids.expand(batch, -1)) is None:
        return None
    proxy = torch.empty(batch, length, 0, dtype=dtype, device=reference.device)  # (B, T, 0): shape, dtype, device
    full = create_bidirectional_mask(config, proxy, None, position_ids=position_ids)
    types = set(getattr(config, "layer_types", None) or ())
    if getattr(config, "model_type", None) in ONE_MASK_FOR_ALL_LAYERS:
        types = set()
    if not types - {"full_attention"}:
        if types or getattr(config, "sliding_window", None) is None:
            return full
        # no layer types, a window: the whole model slides (Mistral, Phi-3), as transformers' mask for it does
        return create_bidirectional_sliding_window_mask(config, proxy, None, position_ids=position_ids)
    if not types <= {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"Mode 'bi' was given packed rows (position_ids restarting at 0 inside a row, no attention_mask), but "
            f"this model's layer types {sorted(types)} include ones whose mask it cannot build per document, so the "
            "documents would attend to each other. Pass one document per row, padded, with a 2D attention_mask "
            "(padding_free=False and packing=False in TRL)."
        )
    sliding = create_bidirectional_sliding_window_mask(config, proxy, None, position_ids=position_ids)
    return {"full_attention": full, "sliding_attention": sliding}  # one mask per layer type, as generate passes


def no_adapter_error(mode: str, adapters: list[str]) -> ValueError:
    """Raised in modes bi and moe (and by set_stage) while no UBMoE adapter is active: delete_adapter removed the
    active one, and an adapter added or loaded after that is not made active (as in PEFT)."""
    fix = (
        f"activate one of its adapters {adapters} with model.set_adapter(name)"
        if adapters
        else "add one with model.add_adapter(name, UBMoEConfig()) or model.load_adapter(folder, adapter_name=name), "
        "then model.set_adapter(name)"
    )
    return ValueError(
        f"Mode {mode!r} needs an active UBMoE adapter, and this model has none (delete_adapter removed the active "
        f"one): its layers would run the base model's FFNs (under bidirectional attention in mode bi). To go on, {fix}."
    )


def superseded_error(reason: str = "wrapped again") -> ValueError:
    """Raised by a model whose layers a later PeftModel on the same base took over (`UBMoEModel._take_over`), or
    that `unload()` / `merge_and_unload(target="bi")` took its layers from (``reason="unloaded"``)."""
    if reason == "unloaded":
        return ValueError(
            "This model's UBMoE layers were removed by unload() or merge_and_unload(target='bi'), which change the "
            "base in place: it has no modes any more, and would run as the model that call returned (the base model, "
            "or the merged bi model) whatever mode it reported. Use the model that call returned, or wrap a fresh "
            "base again."
        )
    return ValueError(
        "This model's base was wrapped again (get_peft_model or PeftModel.from_pretrained on the same base object "
        "change it in place), and its UBMoE layers now follow the newer model. Use the model that call returned."
    )


class ModeState:
    """Mode and routing statistics of one wrapped model; every UBMoE layer of that model holds the same object.

    The mode is the model's, in every thread (`set_mode`, `use_mode`): autograd's device threads (which recompute
    checkpointed layers) and DataParallel's workers must see it, and they see no thread-local state of ours.

    ``forward_lock`` lets one forward of the decoder run at a time (`UBMoEModel._before_backbone` takes it,
    `_after_backbone` releases it). A forward's padding mask and routing live here, and the LoRA deltas of training,
    quantized layers and the attention adapter ride on temporary hooks on modules the threads share: two forwards
    at once would read each other's. The SentenceTransformer holds it around its switch to mode bi and back
    (`UBMoEEncoder.forward`), so a thread generating meanwhile never runs in mode bi, and two overlapping
    embedding calls no longer left the model in mode bi (each restored the mode the other had set).
    """

    def __init__(self) -> None:
        self.mode = "moe"
        self.forward_lock = threading.RLock()
        self._threads = threading.local()  # .held: this thread's holds taken by `lock_forward`
        self.adapters_enabled = True
        self.token_mask: torch.Tensor | None = None  # (B, S) 1 = real token, from the last forward's attention_mask
        self.routing: dict[int, tuple] | None = None  # layer index -> what record() kept, last moe forward
        self.routing_mask: torch.Tensor | None = None  # token_mask of that forward
        self.attention_hooked = False  # whether the layers' mode-bi attention adapters are hooked in (mode bi only)
        self.tallies: list[RoutingTally] = []  # open `track_routing` blocks, each summing every mode-moe forward
        self._tallied: dict | None = None  # the routing dict last added to them (each forward's is added once)
        self.user_mask_4d = False  # whether the current forward was given a 4D attention mask (used as given)
        # Why this model no longer runs its layers: "wrapped again" (a later PeftModel on the same base took them
        # over, UBMoEModel._take_over) or "unloaded" (UBMoEModel._unwrap); None while it does
        self.superseded: str | None = None
        self.recomputing = False  # a checkpointed layer runs again in backward (`recompute_in`): routing not recorded
        # (parameter, requires_grad) to restore when adapters are enabled again; None while they are enabled
        self.trainable: list[tuple[nn.Parameter, bool]] | None = None
        # Each adapter's (parameter, requires_grad) when set_adapter switched away from it, restored when it is set
        # again (UBMoEModel.set_adapter)
        self.left_adapters: dict[str, list[tuple[nn.Parameter, bool]]] = {}

    def keep_trainable(self, parameters: Iterable[nn.Parameter]) -> None:
        """While adapters are disabled, make the trainability just set on ``parameters`` (those set_adapter,
        set_stage, set_requires_grad or a new adapter addressed) the one restored on enabling, instead of what
        disabling found; every other parameter keeps what disabling found (its live flag is disabling's)."""
        if self.trainable is not None:
            touched = {id(p): p for p in parameters}
            kept = [(p, touched.pop(id(p)).requires_grad if id(p) in touched else flag) for p, flag in self.trainable]
            self.trainable = kept + [(p, p.requires_grad) for p in touched.values()]

    @contextmanager
    def switched(self, mode: str) -> Iterator[None]:
        """Run the block in ``mode``, then restore the previous mode, also when the block raises. Both switches
        happen between forwards (under the forward lock), never in the middle of another thread's."""
        with self.forward_lock:
            previous, self.mode = self.mode, mode
        try:
            yield
        finally:
            with self.forward_lock:
                self.mode = previous

    def forward_settings(self, flagged: list[nn.Module], parameters: list[nn.Parameter]) -> tuple:
        """What a forward of a decoder layer depends on besides its inputs: the mode, whether adapters are disabled
        (PEFT's ``disable_adapter()``), the active adapter of each of its adapter layers ``flagged`` (ours, and PEFT's
        ``modules_to_save`` copies), and which of its ``parameters`` train (PEFT's ``set_adapter`` freezes the
        others: a recompute that saved fewer tensors than its forward was a CheckpointError)."""
        return self.mode, self.adapters_enabled, *_capture(flagged, parameters)

    @contextmanager
    def recompute_in(self, settings: tuple, layers: list[nn.Module]) -> Iterator[None]:
        """Gradient checkpointing runs a decoder layer again in backward: run it with the ``settings`` of its forward
        (`forward_settings`), also when they changed since (a forward in ``use_mode`` or ``disable_adapter()``, two
        forwards in two modes or of two adapters before one backward: the recompute of the settings at backward gave
        silently wrong gradients with reentrant checkpointing, a CheckpointError without), with the mode-bi attention
        adapter of its UBMoE ``layers`` hooked in as in that forward. Its routing was recorded by the forward:
        recorded again it replaced the last forward's (`record`), and its mask was checked (`_check_bidirectional`)."""
        mode, enabled, flags, trainable = settings
        with self.forward_lock:  # no other forward runs meanwhile: the mode is the model's, in every thread
            now = (self.mode, self.adapters_enabled, *_capture([m for m, *_ in flags], [p for p, _ in trainable]))
            self.mode, self.adapters_enabled, self.recomputing = mode, enabled, True
            hooked = MODES[mode].ffn == "bi"
            try:
                _set_flags(flags, trainable)
                for layer in layers if hooked != self.attention_hooked else []:
                    layer.set_attention_hooks(hooked)
                yield
            finally:
                self.mode, self.adapters_enabled, self.recomputing = now[0], now[1], False
                _set_flags(now[2], now[3])
                for layer in layers if hooked != self.attention_hooked else []:
                    layer.set_attention_hooks(self.attention_hooked)

    def lock_forward(self) -> None:
        """Take the forward lock for one forward of the decoder (`end_forward` releases it)."""
        self.end_stale_forward()
        self.forward_lock.acquire()
        self._threads.held = 1

    def end_forward(self, failed: bool = False) -> None:
        """Release what `lock_forward` took in this thread; nothing when it took nothing (a hook before ours raised
        before the forward could start). A forward that ``failed`` leaves no partial routing: the layers it ran are
        dropped and the last completed forward's kept (already tallied, so no `track_routing` block counts it
        twice)."""
        if getattr(self._threads, "held", 0) > 0:
            completed = self.__dict__.pop("_completed", None)  # what the routing was before this forward began
            if failed and completed is not None:
                self.routing, self.routing_mask = completed
            self._threads.held = 0
            self.forward_lock.release()

    def end_stale_forward(self) -> None:
        """End a forward of this thread that never reached its end: KeyboardInterrupt skips PyTorch's always-called
        hooks, so it kept the lock (every other thread's forward would wait for ever) and its partial routing.
        Called where the interrupt passes (the per-call hooks, the embedding call) and at the thread's next forward."""
        self.end_forward(failed=True)

    def __getstate__(self) -> dict:
        # A deep copy (TRL reference models) or a pickle gets its own lock, held by no thread, and no open
        # `track_routing` block: no one could read a copied tally, which went on counting every forward of the copy
        state = dict(self.__dict__)
        del state["_threads"], state["forward_lock"]
        state.update(tallies=[], _tallied=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._threads = threading.local()
        self.forward_lock = threading.RLock()

    @property
    def spec(self) -> ModeSpec:
        return MODES[self.mode]

    def begin_forward(self, attention_mask: torch.Tensor | None, past: int | None = 0) -> None:
        """A forward starts: keep which of its tokens are real, for the routing statistics. ``past``: tokens already
        in the KV cache (None: unknown)."""
        self.tally()  # the previous forward's routing, before it is replaced
        self._completed = (self.routing, self.routing_mask)  # what `end_forward` puts back if this forward fails
        if attention_mask is not None and attention_mask.dim() == 4:
            # A 4D mask (used as given): the real keys are those some query may attend to; a padding key none.
            queries = attention_mask.shape[-2]
            attention_mask = allowed_pairs(attention_mask).any(dim=-2)[:, 0]  # (B, K)
            if past is not None and attention_mask.shape[-1] > past + queries:
                # A static cache's mask spans all its slots, empty ones after the current tokens: keep the slots up
                # to the current tokens, which `_sums` reads at the end (it read empty slots: a share of 0)
                attention_mask = attention_mask[:, : past + queries]
        self.token_mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        if self.mode == "moe" and self.adapters_enabled:
            self.routing = {}
            self.routing_mask = self.token_mask

    def record(self, layer_idx: int, routed: torch.Tensor, logits: bool) -> None:
        """Keep a layer's routing without a graph: top-1 router logits (..., 2) (``logits``) or the top-2 bi weight
        (...), of the FFN input's shape less its features, usually (B, T). ``logits`` says which, not the rank: an FFN
        may be given (N, C) or 4-D inputs, where the rank read as the kind summed raw logits.

        Only a reference is kept; the share is computed when asked for (`shares`), because reducing it here, in every
        layer at every decode step, cost more than the router itself.
        """
        if self.recomputing:
            return
        if self.routing is None:
            self.routing, self.routing_mask = {}, self.token_mask
        self.routing[layer_idx] = (routed, logits)  # callers pass tensors without a graph (detached)

    def shares(self) -> dict[int, float] | None:
        """{layer index: share of real tokens sent to the bi expert} for the last mode-moe forward, or None."""
        last = RoutingTally()  # one forward's tally: the share is computed in one place
        for layer, (routed, real) in (self.counts() or {}).items():
            last.add(layer, routed, real)
        return last.shares()

    def counts(self) -> dict[int, tuple[float, float]] | None:
        """{layer index: (tokens sent to bi, real tokens)} of the last mode-moe forward, or None."""
        with self.forward_lock:  # a forward running in another thread fills its routing layer by layer
            return self._sums()

    def tally(self) -> None:
        """Add the last mode-moe forward's routing to every open `track_routing` block, once."""
        if not self.tallies or not self.routing or self.routing is self._tallied:
            return
        self._tallied = self.routing
        for layer, (routed, real) in self._sums().items():
            for tally in self.tallies:
                tally.add(layer, routed, real)

    def _sums(self) -> dict[int, tuple[float, float]] | None:
        """{layer index: (tokens sent to bi (top_k=2: summed bi weight), real tokens)} for the last mode-moe forward."""
        if not self.routing:
            return None
        result = {}
        for layer_idx, (routed, logits) in sorted(self.routing.items()):
            weight = (routed[..., 1] > routed[..., 0] if logits else routed).float()  # usually (B, T)
            mask = self.routing_mask
            fits = mask is not None and weight.dim() == 2 and mask.shape[0] == weight.shape[0]
            if fits and mask.shape[1] >= weight.shape[1]:
                real = mask[:, -weight.shape[1] :].to(weight.device, torch.float32)  # (B, T), the current tokens
                result[layer_idx] = (float((weight * real).sum()), float(real.sum()))
            else:
                result[layer_idx] = (float(weight.sum()), float(weight.numel()))
        return result


def _capture(modules: Iterable[nn.Module], parameters: Iterable[nn.Parameter]) -> tuple[list, list]:
    """The adapter flags of ``modules`` and the ``requires_grad`` of ``parameters``, as `_set_flags` takes them."""
    flags = [(m, getattr(m, "_disable_adapters", False), m._active_adapter) for m in modules]
    return flags, [(p, p.requires_grad) for p in parameters]


def _set_flags(flags: list, trainable: list) -> None:
    for module, disabled, active in flags:
        module._disable_adapters, module._active_adapter = disabled, active
    for parameter, flag in trainable:
        parameter.requires_grad_(flag)


def recompute_in_forward_mode(layers: list[nn.Module], state: ModeState) -> None:
    """Wrap the checkpoint function transformers gave each of these decoder layers (`gradient_checkpointing_enable`)
    so that a layer's recomputation in backward runs with the settings of its forward (`ModeState.recompute_in`), also
    a layer that holds no UBMoE layer (its attention's mask check reads the mode). The state is kept on each layer, so
    that a deep copy of the model (a TRL reference model) recomputes with its own. Hand-written: neither transformers
    nor PEFT knows of a mode, and torch's ``context_fn`` exists only without reentrant checkpointing (and is the
    user's to set)."""
    for layer in layers:
        layer.__dict__["_ubmoe_mode_state"] = state
        checkpoint = layer.__dict__.get("_gradient_checkpointing_func")
        if checkpoint is not None and not hasattr(checkpoint, "ubmoe_checkpoint"):
            layer._gradient_checkpointing_func = _in_forward_mode(checkpoint)


def _parts(owner: nn.Module, state: ModeState) -> tuple[list, list, list]:
    """The UBMoE layers, the adapter layers (with ``_active_adapter``) and the parameters of decoder layer ``owner``,
    kept on it until adapters or layers change (`forget_parts`): walking its modules at every training forward cost
    about 0.1 ms per layer (8 ms at 30 layers on a loaded 2-core VM)."""
    kept = owner.__dict__.get("_ubmoe_parts")
    if kept is None or kept[0] is not state:  # (a base wrapped again: another model's state)
        modules = list(owner.modules())
        ubmoe = [m for m in modules if isinstance(m.__dict__.get("_state"), ModeState)]
        flagged = [m for m in modules if "_active_adapter" in m.__dict__]
        kept = owner.__dict__["_ubmoe_parts"] = (state, ubmoe, flagged, list(owner.parameters()))
    return kept[1:]


def forget_parts(layers: Iterable[nn.Module], state: bool = False) -> None:
    """Drop what `_parts` kept on these decoder layers (adapters or layers came or went; it also kept deleted ones
    alive), and with ``state`` the model's state too (unloaded: the layers' checkpoint runs as transformers' own)."""
    for layer in layers:
        layer.__dict__.pop("_ubmoe_parts", None)
        if state:
            layer.__dict__.pop("_ubmoe_mode_state", None)


def _in_forward_mode(checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(checkpoint)
    def run(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # transformers checkpoints partial(forward, layer, ...) (5.x) or partial(layer.__call__, ...) (4.x)
        owner = function.args[0] if isinstance(function, functools.partial) and function.args else None
        owner = owner if isinstance(owner, nn.Module) else getattr(getattr(function, "func", None), "__self__", None)
        state = owner.__dict__.get("_ubmoe_mode_state") if isinstance(owner, nn.Module) else None
        if state is None or state.superseded:
            return checkpoint(function, *args, **kwargs)
        ubmoe, flagged, parameters = _parts(owner, state)
        settings, calls = state.forward_settings(flagged, parameters), []

        def in_forward_settings(*inner: Any, **options: Any) -> Any:
            calls.append(None)
            if len(calls) == 1:  # the forward itself
                return function(*inner, **options)
            with state.recompute_in(settings, ubmoe):
                return function(*inner, **options)

        return checkpoint(in_forward_settings, *args, **kwargs)

    run.ubmoe_checkpoint = checkpoint  # type: ignore[attr-defined]
    return run


class RoutingTally:
    """Routing summed over many mode-moe forwards (`ubmoe_peft.track_routing`): a whole evaluation or generation."""

    def __init__(self) -> None:
        self.routed: dict[int, float] = {}  # layer index -> tokens sent to bi (top_k=2: summed bi weight)
        self.tokens: dict[int, float] = {}  # layer index -> real tokens routed

    def add(self, layer_idx: int, routed: float, real: float) -> None:
        self.routed[layer_idx] = self.routed.get(layer_idx, 0.0) + routed
        self.tokens[layer_idx] = self.tokens.get(layer_idx, 0.0) + real

    def shares(self) -> dict[int, float] | None:
        """{layer index: share of all real tokens sent to the bi expert}; None when no mode-moe forward ran."""
        if not self.tokens:
            return None
        return {layer: self.routed[layer] / max(self.tokens[layer], 1.0) for layer in sorted(self.tokens)}

    def mean(self) -> float | None:
        """The share averaged over layers (as `RouterTrainer`'s ``bi_share``); None when no mode-moe forward ran."""
        shares = self.shares()
        return None if shares is None else sum(shares.values()) / len(shares)
