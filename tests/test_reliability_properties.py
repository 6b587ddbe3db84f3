"""Property-based checks (hypothesis) of padding / bidirectional masks and top-k routing on random layouts."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_reliability import VOCAB, logits, tiny, trained, wrap

import ubmoe_peft
from ubmoe_peft.modes import ubmoe_layers

FAST = settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def model(attn: str, expert_type: str, top_k: int):
    return trained(wrap(tiny(attn=attn), expert_type=expert_type, top_k=top_k))


@st.composite
def padded_batch(draw, max_rows: int = 3, max_len: int = 8):
    """(ids, mask, other_ids): random rows of random real length, left or right padded, pads re-drawn in other."""
    rows, length = draw(st.integers(1, max_rows)), draw(st.integers(1, max_len))
    left = draw(st.booleans())
    reals = draw(st.lists(st.integers(0, length), min_size=rows, max_size=rows))
    mask = torch.zeros(rows, length, dtype=torch.long)
    for row, real in enumerate(reals):
        if left:
            mask[row, length - real :] = 1
        else:
            mask[row, :real] = 1
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, length), generator=gen)
    other = torch.where(mask.bool(), ids, torch.randint(3, VOCAB, (rows, length), generator=gen))
    return ids, mask, other


@FAST
@given(batch=padded_batch(), mode=st.sampled_from(["uni", "bi", "moe"]), attn=st.sampled_from(["sdpa", "eager"]))
def test_real_tokens_never_see_pad_tokens_and_outputs_stay_finite(batch, mode, attn):
    ids, mask, other = batch
    net = model(attn, "lora", 1)
    with ubmoe_peft.use_mode(net, mode):
        a, b = logits(net, ids, mask), logits(net, other, mask)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    real = mask.bool()
    assert torch.allclose(a[real], b[real], atol=1e-5)


@FAST
@given(length=st.integers(2, 8), position=st.data(), mode=st.sampled_from(["uni", "bi", "moe"]))
def test_only_mode_bi_lets_a_token_see_later_tokens(length, position, mode):
    earlier = position.draw(st.integers(0, length - 2))
    ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % VOCAB
    net = model("sdpa", "lora", 1)
    with ubmoe_peft.use_mode(net, mode):
        a, b = logits(net, ids), logits(net, changed)
    moved = not torch.allclose(a[0, earlier], b[0, earlier], atol=1e-6)
    assert moved == (mode == "bi")


def _experts(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    state = layer._state
    previous = state.mode
    try:
        state.mode = "uni"
        uni = layer(x)
        state.mode = "bi"
        bi = layer(x)
    finally:
        state.mode = previous
    return uni, bi


@FAST
@given(
    expert_type=st.sampled_from(["lora", "copy"]),
    top_k=st.sampled_from([1, 2]),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 6)),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([0.0, 0.3, 3.0]),
)
def test_top_k_routing_sends_each_token_to_exactly_k_experts(expert_type, top_k, shape, seed, scale):
    net = model("sdpa", expert_type, top_k)
    layer = ubmoe_layers(net)[0]
    router = next(iter(layer.ubmoe_router.values()))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, layer.hidden_size, generator=gen)  # (B, T, C)
    saved = router.weight.detach().clone()
    rows = {"uni": 0, "bi": 0}  # tokens each expert ran on

    def counter(expert: str):
        return lambda module, args, out: rows.__setitem__(expert, rows[expert] + out[..., 0].numel())

    hooks = [layer.base_layer.register_forward_hook(counter("uni"))]
    hooks += [expert.register_forward_hook(counter("bi")) for expert in layer.ubmoe_copy.values()]
    try:
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * scale)
            uni, bi = _experts(layer, x)  # (B, T, C) each
            rows.update(uni=0, bi=0)
            with ubmoe_peft.use_mode(net, "moe"):
                out = layer(x)  # (B, T, C)
            logits_ = router(x)  # (B, T, 2)
    finally:
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            router.weight.copy_(saved)
    assert torch.isfinite(out).all()
    tokens = x.shape[0] * x.shape[1]
    if top_k == 1:
        to_bi = logits_[..., 1] > logits_[..., 0]  # (B, T); ties go to uni
        expected = torch.where(to_bi.unsqueeze(-1), bi, uni)
        assert torch.allclose(out, expected, atol=1e-5)
        if expert_type == "copy":  # each token ran through exactly one expert
            assert rows["uni"] + rows["bi"] == tokens and rows["bi"] == int(to_bi.sum())
        if scale == 0.0:
            assert not to_bi.any() and torch.equal(out, uni)  # a zero router is the base FFN, exactly
    else:
        p = logits_.softmax(-1)  # (B, T, 2)
        assert torch.allclose(out, p[..., :1] * uni + p[..., 1:] * bi, atol=1e-5)


@FAST
@given(batch=padded_batch(), expert_type=st.sampled_from(["lora", "copy"]), top_k=st.sampled_from([1, 2]))
def test_a_fresh_adapter_in_mode_moe_equals_the_base_model(batch, expert_type, top_k):
    ids, mask, _ = batch
    fresh = _fresh(expert_type, top_k)
    base_out = logits(_base(), ids, mask)
    real = mask.bool()
    if top_k == 1:
        assert torch.equal(logits(fresh, ids, mask)[real], base_out[real])
    else:  # top-2 mixes both experts half-half; a fresh bi expert is the base FFN, so only rounding differs
        assert torch.allclose(logits(fresh, ids, mask)[real], base_out[real], atol=1e-5)
    stats = ubmoe_peft.routing_stats(fresh)
    if real.any():  # the share is over real tokens
        assert stats is not None and all(share == (0.0 if top_k == 1 else 0.5) for share in stats.values())


@functools.cache
def _base():
    return tiny()


@functools.cache
def _fresh(expert_type: str, top_k: int):
    return wrap(tiny(), expert_type=expert_type, top_k=top_k)


@pytest.mark.parametrize("mode", ["uni", "moe"])
def test_mode_uni_and_fresh_moe_match_the_base_on_an_all_padding_batch(mode):
    mask = torch.zeros(2, 4, dtype=torch.long)
    ids = torch.randint(3, VOCAB, (2, 4))
    with ubmoe_peft.use_mode(_fresh("lora", 1), mode):
        assert torch.isfinite(logits(_fresh("lora", 1), ids, mask)).all()
