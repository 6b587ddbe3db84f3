"""attention_dependence: percentages add to 100, causal modes never depend on later tokens, bi does."""

from __future__ import annotations

import pytest
import torch
from conftest import perturb_adapters, tiny_model, w
from peft import get_peft_model

import ubmoe_peft
from ubmoe_peft import UBMoEConfig, attention_dependence

TEXTS = [w(5, 6, 7, 8, 9), w(10, 11), w(12, 13, 14, 15, 16, 17, 18)]


@pytest.fixture
def model():
    wrapped = get_peft_model(tiny_model(attn="sdpa"), UBMoEConfig()).eval()
    perturb_adapters(wrapped, std=0.1)
    return wrapped


def test_causal_modes_have_no_subsequent_dependence(model, tokenizer):
    for mode in ("uni", "moe"):
        res = attention_dependence(model, tokenizer, TEXTS, mode=mode)
        assert res.average["subsequent"] == pytest.approx(0.0, abs=1e-6)
        assert sum(res.average.values()) == pytest.approx(100.0, abs=1e-3)
        assert len(res.per_layer) == 2
    assert ubmoe_peft.get_mode(model) == "moe"  # restored
    assert model.config._attn_implementation == "sdpa"  # restored


def test_mode_bi_depends_on_later_tokens_and_matches_a_manual_count(model, tokenizer):
    res = attention_dependence(model, tokenizer, TEXTS, mode="bi", batch_size=2)
    assert res.average["subsequent"] > 1.0
    for layer in res.per_layer:
        assert sum(layer.values()) == pytest.approx(100.0, abs=1e-3)

    # the same number computed text by text, without padding, with explicit loops over the matrix
    model.config._attn_implementation = "eager"
    expected = torch.zeros(2, 3)
    with ubmoe_peft.use_mode(model, "bi"), torch.no_grad():
        for text in TEXTS:
            ids = tokenizer(text, return_tensors="pt")
            for layer, attn in enumerate(model(**ids, output_attentions=True).attentions):
                a = attn[0].mean(0)  # (n, n)
                n = a.shape[0]
                for i in range(n):
                    for j in range(n):
                        expected[layer, 0 if j < i else 1 if j == i else 2] += a[i, j] / n * 100 / len(TEXTS)
    got = torch.tensor([[row[k] for k in ("preceding", "self", "subsequent")] for row in res.per_layer])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_bad_texts_are_refused(model, tokenizer):
    with pytest.raises(TypeError, match="texts must be a list of texts or rows, got str"):
        attention_dependence(model, tokenizer, "one string")
    with pytest.raises(TypeError, match="texts must be a list .*, got generator"):  # a bare len() error
        attention_dependence(model, tokenizer, (t for t in [w(5, 6)]))
    with pytest.raises(ValueError, match="non-empty list"):
        attention_dependence(model, tokenizer, [])
    with pytest.raises(TypeError, match="tokenizer must be a transformers tokenizer, got NoneType"):
        attention_dependence(model, None, [w(5, 6)])


def test_numpy_and_pandas_texts_are_read_as_lists(model, tokenizer):
    """Both failed on their truth value; a Series indexed by labels would have been sliced by label."""
    import numpy as np
    import pandas as pd

    expected = attention_dependence(model, tokenizer, TEXTS, mode="bi", batch_size=2).average
    for texts in (np.array(TEXTS), pd.Series(TEXTS, index=[7, 3, 5])):
        assert attention_dependence(model, tokenizer, texts, mode="bi", batch_size=2).average == pytest.approx(expected)


def test_generation_between_its_batches_runs_in_the_models_own_mode(model, tokenizer, monkeypatch):
    """attention_dependence(mode="bi") held mode bi and eager attention model-wide for its whole run: a thread
    generating meanwhile failed ("Cannot generate ... in mode 'bi'"), and a plain forward ran silently in mode bi."""
    import threading

    ids = torch.tensor([[5, 6, 7, 8]])
    expected = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    generated: list = []
    tokenize = type(tokenizer).__call__
    calls = []

    def tokenize_then_generate(self, *args, **kwargs):  # between two batches, another thread generates
        calls.append(1)
        if len(calls) == 2:
            thread = threading.Thread(
                target=lambda: generated.append(model.generate(input_ids=ids, max_new_tokens=3, do_sample=False))
            )
            thread.start()
            thread.join(30)
        return tokenize(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", tokenize_then_generate)
    attention_dependence(model, tokenizer, TEXTS[:2], mode="bi", batch_size=1)
    assert len(generated) == 1 and torch.equal(generated[0], expected)


def test_empty_texts_are_named_not_averaged_in(model, tokenizer):
    with pytest.raises(ValueError, match=r"texts\[1\] is '' \(2 such texts\): every text must be non-empty"):
        attention_dependence(model, tokenizer, [w(5, 6), "", "  "])
    with pytest.raises(ValueError, match=r"texts\[0\] is None"):
        attention_dependence(model, tokenizer, [None])
    with pytest.raises(ValueError, match=r"texts\[0\] is \{'text': 'a b'\}, a dict .*\[row\['text'\] for row"):
        attention_dependence(model, tokenizer, [{"text": "a b"}])  # it was called empty


def test_a_text_of_no_tokens_is_named(model, tokenizer):
    """A text the tokenizer's normalizer empties (control characters) is not blank, yet has no token: 0/0 made every
    average NaN."""
    from tokenizers import normalizers

    tokenizer.backend_tokenizer.normalizer = normalizers.Replace("\x01", "")
    with pytest.raises(ValueError, match=r"texts\[1\] \('\\x01\\x01'\) tokenizes to no tokens"):
        attention_dependence(model, tokenizer, [w(5, 6, 7), "\x01\x01"])


def test_dependence_is_measured_without_dropout_in_a_model_being_trained(tokenizer):
    """Right after training the model is in train mode: attention and LoRA dropout made the measurement random (the
    three shares no longer summed to 100)."""
    base = tiny_model("llama", attn="eager")
    base.config.attention_dropout = 0.3
    model = get_peft_model(base, UBMoEConfig(lora_dropout=0.3))
    perturb_adapters(model)
    texts = [w(5, 6, 7, 8, 9), w(10, 11, 12)]
    expected = attention_dependence(model.eval(), tokenizer, texts, mode="bi").per_layer
    model.train()
    assert attention_dependence(model, tokenizer, texts, mode="bi").per_layer == expected
    assert model.training
    with pytest.raises(ValueError, match="batch_size=0: give a positive integer"):
        attention_dependence(model, tokenizer, texts, batch_size=0)
    with pytest.raises(ValueError, match="max_length=1 keeps one token per text, .* would read 100% self"):
        attention_dependence(model, tokenizer, texts, max_length=1)


def test_a_sentence_transformer_is_measured_as_its_model_and_a_swap_is_named(model, tokenizer):
    """Given a SentenceTransformer made by to_sentence_transformer (which the mode functions take), or the tokenizer
    first, it failed with a bare TypeError."""
    st = ubmoe_peft.to_sentence_transformer(model, tokenizer)
    expected = attention_dependence(model, tokenizer, TEXTS, mode="bi").average
    assert attention_dependence(st, tokenizer, TEXTS, mode="bi").average == pytest.approx(expected)
    with pytest.raises(TypeError, match="model must be a model .* it is a tokenizer: pass the model first"):
        attention_dependence(tokenizer, model, TEXTS)
