"""The evaluations against references computed another way: transformers' own loss, scipy's Spearman."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import perturb_adapters, tiny_model, w
from peft import get_peft_model
from scipy.stats import spearmanr

import ubmoe_peft
from ubmoe_peft import UBMoEConfig, lm_loss, multiple_choice_accuracy, sts_spearman  # usage.md gives these names


@pytest.fixture
def model():
    wrapped = get_peft_model(tiny_model(), UBMoEConfig()).eval()
    perturb_adapters(wrapped, std=0.3)
    return wrapped


@pytest.mark.parametrize("mode", ["uni", "moe"])
def test_lm_loss_of_texts_is_transformers_loss_over_all_tokens(model, tokenizer, mode):
    texts = [w(*range(5, 14)), w(20, 21, 22, 23), w(40, 41, 42, 43, 44, 45)]  # different lengths: padding in play
    got = lm_loss(model, tokenizer, texts, mode=mode, batch_size=2)
    total, count = 0.0, 0
    with torch.no_grad(), ubmoe_peft.use_mode(model, mode):
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")["input_ids"]  # (1, T)
            total += float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    assert got["tokens"] == count
    assert got["loss"] == pytest.approx(total / count, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)


def test_lm_loss_scores_only_the_completion_and_the_last_chat_turn(model, tokenizer):
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    prompt, completion = w(5, 6, 7), w(8, 9)
    as_chat = {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]}
    as_pair = {"prompt": prompt + " ", "completion": completion}
    chat, pair = lm_loss(model, tokenizer, [as_chat], mode="uni"), lm_loss(model, tokenizer, [as_pair], mode="uni")
    assert chat["tokens"] == pair["tokens"] == 2
    assert chat["loss"] == pytest.approx(pair["loss"], rel=1e-6)
    with torch.no_grad(), ubmoe_peft.use_mode(model, "uni"):
        logits = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]])).logits[0].log_softmax(-1)  # (5, V)
    assert pair["loss"] == pytest.approx(-float(logits[2, 8] + logits[3, 9]) / 2, rel=1e-5)


def test_every_completion_token_is_scored_whatever_the_tokenizer_does_at_the_boundary(tokenizer):
    """The completion's tokens were taken as `whole[len(prompt ids):]`: a tokenizer that appends EOS to the prompt
    alone lost the completion's first token, and a token spanning the boundary lost its start (both silently)."""
    from tokenizers import processors

    from ubmoe_peft.evaluation import _pair

    pair = {"prompt": w(5, 6) + " ", "completion": w(7, 8, 9)}
    assert _pair(tokenizer, pair) == ([5, 6], [7, 8, 9])
    eos = tokenizer.eos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {tokenizer.eos_token}", special_tokens=[(tokenizer.eos_token, eos)]
    )
    assert _pair(tokenizer, pair) == ([5, 6], [7, 8, 9, eos])  # was ([5, 6, eos], [8, 9, eos])
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A")
    joined = w(5) + w(6)  # no space: the whole tokenizes as one unknown word, the prompt alone as w(5)
    assert _pair(tokenizer, {"prompt": w(5), "completion": w(6)})[1] == [6]  # was []: nothing scored
    assert tokenizer(joined)["input_ids"] == [tokenizer.unk_token_id]


def test_multiple_choice_picks_the_likeliest_continuation(model, tokenizer):
    tokenizer.pad_token = tokenizer.eos_token
    rows = [{"question": w(5, 6), "choices": [w(7), w(8), w(9, 10)], "label": label} for label in range(3)]
    got = multiple_choice_accuracy(model, tokenizer, rows, mode="uni")
    with torch.no_grad(), ubmoe_peft.use_mode(model, "uni"):
        scores = []
        for choice in rows[0]["choices"]:
            context = tokenizer(f"Question: {rows[0]['question']}\nAnswer:")["input_ids"]
            full = tokenizer(f"Question: {rows[0]['question']}\nAnswer: {choice}")["input_ids"]
            logp = model(input_ids=torch.tensor([full])).logits[0].log_softmax(-1)  # (T, V)
            scores.append(sum(float(logp[t - 1, full[t]]) for t in range(len(context), len(full))))
    best = max(range(3), key=scores.__getitem__)
    assert got["n"] == 3 and got["accuracy"] == pytest.approx(100 / 3)  # the same pick is right for 1 label of 3
    assert multiple_choice_accuracy(model, tokenizer, [rows[best]], mode="uni")["accuracy"] == 100
    # lm-evaluation-harness's acc_norm: log-likelihood / len(choice) in characters (no leading space, not bytes)
    best_norm = max(range(3), key=lambda k: scores[k] / len(rows[0]["choices"][k]))
    assert multiple_choice_accuracy(model, tokenizer, [rows[best_norm]], mode="uni")["accuracy_norm"] == 100


def test_non_finite_outputs_are_named_not_scored(model, tokenizer):
    """NaN scores made max() pick choice 0 (25% on a broken model, above the working one); a loss past ~709 raised
    OverflowError in math.exp instead of giving an infinite perplexity."""
    row = {"question": w(5, 6), "choices": [w(7), w(8)], "label": 0}
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"Row 0: the log-likelihood of choice 0 is NaN, so the model's outputs"):
        multiple_choice_accuracy(model, tokenizer, [row])
    with torch.no_grad():
        head.normal_(0, 1).mul_(1e4)  # confident and wrong: a loss in the thousands
    result = lm_loss(model, tokenizer, [w(*range(5, 25))], mode="uni")
    assert result["loss"] > 710 and result["perplexity"] == math.inf
    with torch.no_grad():
        head.fill_(float("nan"))
    assert math.isnan(lm_loss(model, tokenizer, [w(5, 6, 7)], mode="uni")["perplexity"])  # not inf


def test_multiple_choice_refuses_choices_it_cannot_score(model, tokenizer):
    row = {"question": w(5, 6), "choices": [w(7), w(8)], "label": 0}
    for bad in ["", None, "  "]:
        with pytest.raises(ValueError, match=f"Row 0: choice 1 is {bad!r}; every choice must be a text"):
            multiple_choice_accuracy(model, tokenizer, [{**row, "choices": [w(7), bad]}])
    with pytest.raises(ValueError, match="Row 0: choice 0 has no token left to score .*max_length=1"):
        multiple_choice_accuracy(model, tokenizer, [row], max_length=1)
    for kwargs in [dict(batch_size=0), dict(max_length=-3), dict(batch_size=True)]:
        with pytest.raises(ValueError, match=f"{next(iter(kwargs))}=.*give a positive integer"):
            multiple_choice_accuracy(model, tokenizer, [row], **kwargs)
        with pytest.raises(ValueError, match="give a positive integer"):
            lm_loss(model, tokenizer, [w(5, 6)], **kwargs)
    with pytest.raises(TypeError, match="Example 1 \\(counting from 0\\): An example is int 3"):
        lm_loss(model, tokenizer, [w(5, 6), 3])


def test_an_end_of_text_token_the_prompt_spells_stays_in_the_context(tokenizer):
    """Only an end-of-text token the tokenizer appended is dropped from the prompt; one the prompt's text ends with
    (a rendered chat turn, say) used to be dropped too, and scored as the completion's first token."""
    from tokenizers import processors

    from ubmoe_peft.evaluation import _pair

    eos = tokenizer.eos_token_id
    pair = {"prompt": w(5) + " " + tokenizer.eos_token, "completion": " " + w(7)}
    assert _pair(tokenizer, pair) == ([5, eos], [7])
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {tokenizer.eos_token}", special_tokens=[(tokenizer.eos_token, eos)]
    )
    assert _pair(tokenizer, pair) == ([5, eos], [7, eos])


@pytest.mark.parametrize("mode", ["uni", "bi"])
def test_sts_spearman_is_scipy_on_cosine_of_mean_pooled_states(model, tokenizer, mode):
    s1 = [w(i, i + 1, i + 2) for i in range(5, 17)]
    s2 = [w(i + 3, i + 1) for i in range(5, 17)]
    gold = [float((i * 7) % 5) for i in range(12)]
    got = sts_spearman(model, tokenizer, s1, s2, gold, mode=mode)

    def embed(texts):
        enc = tokenizer(texts, padding=True, return_tensors="pt")
        with torch.no_grad(), ubmoe_peft.use_mode(model, mode):
            hidden = model(**enc, output_hidden_states=True).hidden_states[-1]  # (B, T, C)
        m = enc["attention_mask"].unsqueeze(-1).float()  # (B, T, 1)
        return (hidden * m).sum(1) / m.sum(1)  # (B, C)

    cosine = torch.nn.functional.cosine_similarity(embed(s1), embed(s2)).tolist()
    assert got == pytest.approx(100 * spearmanr(gold, cosine).statistic, abs=1e-4)


def test_likelihood_scores_refuse_mode_bi(model, tokenizer):
    with pytest.raises(ValueError, match="mode 'bi' are meaningless"):
        lm_loss(model, tokenizer, [w(5, 6, 7)], mode="bi")
    with ubmoe_peft.use_mode(model, "bi"), pytest.raises(ValueError, match="mode 'bi' are meaningless"):
        multiple_choice_accuracy(model, tokenizer, [{"question": w(5), "choices": [w(6), w(7)], "label": 0}])
    assert lm_loss(tiny_model(), tokenizer, [w(5, 6, 7)])["tokens"] == 2  # a plain model has no modes to refuse


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, t: lm_loss(m, t, []), "at least one example"),
        (lambda m, t: lm_loss(m, t, [{"answer": "x"}]), r"keys \['answer'\]"),
        (lambda m, t: multiple_choice_accuracy(m, t, [{"question": "q"}]), r"lacks \['choices', 'label'\]"),
        (lambda m, t: sts_spearman(m, t, ["a", "b"], ["c"], [1.0, 2.0]), "as many sentences1"),
    ],
)
def test_bad_rows_are_named(model, tokenizer, call, message):
    with pytest.raises(ValueError, match=message):
        call(model, tokenizer)


def test_bad_examples_are_named_not_scored(model, tokenizer):
    with pytest.raises(TypeError, match="examples must be a list of texts or rows, got str"):
        lm_loss(model, tokenizer, w(5, 6, 7))
    with pytest.raises(ValueError, match="Example 1 \\(''\\) has no tokens"):
        lm_loss(model, tokenizer, [w(5, 6, 7), ""])
    with pytest.raises(TypeError, match="sentences1 must be a list of texts or rows, got str"):
        sts_spearman(model, tokenizer, w(5), w(6), [1.0, 2.0])
    with pytest.raises(ValueError, match="sentences2\\[1\\] is None"):
        sts_spearman(model, tokenizer, [w(5), w(6)], [w(7), None], [1.0, 2.0])
    with pytest.raises(ValueError, match="All 2 gold scores are 3.0: a rank correlation with constant scores"):
        sts_spearman(model, tokenizer, [w(5), w(6)], [w(7), w(8)], [3.0, 3.0])
    row = {"question": w(5), "choices": [w(6), w(7)]}
    for label, message in [(-1, "label -1 is not a 0-based index of its 2 choices"), ("A", "label 'A' is not")]:
        with pytest.raises(ValueError, match=message):
            multiple_choice_accuracy(model, tokenizer, [{**row, "label": label}])
    with pytest.raises(ValueError, match="choices must be a list of at least 2 answers, got 'ab'"):
        multiple_choice_accuracy(model, tokenizer, [{**row, "choices": "ab", "label": 0}])
    as_text = multiple_choice_accuracy(model, tokenizer, [{**row, "label": "1"}])  # a label read from a text column
    assert as_text == multiple_choice_accuracy(model, tokenizer, [{**row, "label": 1}])


def test_a_chat_must_end_with_the_assistant_turn_it_scores(model, tokenizer):
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    user, assistant = {"role": "user", "content": w(5)}, {"role": "assistant", "content": w(6)}
    good = {"messages": [user, assistant]}
    for messages, roles in [
        ([user, assistant, user], "'user', 'assistant', 'user'"),
        ([assistant], "'assistant'"),
        ([], ""),
    ]:
        with pytest.raises(ValueError, match=rf"Example 1 \(counting from 0\): A chat example with roles \[{roles}\]"):
            lm_loss(model, tokenizer, [good, {"messages": messages}])
    assert lm_loss(model, tokenizer, [good])["tokens"] == 1


def test_a_chat_template_whose_generation_prompt_differs_from_its_assistant_turn_is_named(model, tokenizer):
    """A template that opens a block only in its generation prompt (DeepSeek-R1's <think>): the error said only that
    the template "does not render the conversation as a prefix", with no detail and no fix."""
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}think {% endif %}"
    )
    chat = {"messages": [{"role": "user", "content": w(5)}, {"role": "assistant", "content": w(6)}]}
    with pytest.raises(ValueError, match=r"(?s)part at token \d+.*Score such rows as 'prompt' and 'completion'"):
        lm_loss(model, tokenizer, [chat])


def test_track_routing_counts_every_batch_not_only_the_last(model, tokenizer):
    texts = [w(*range(i, i + 4 + i % 5)) for i in range(5, 14)]  # 9 texts of different lengths: padding in play
    with ubmoe_peft.track_routing(model) as whole:
        lm_loss(model, tokenizer, texts, mode="moe", batch_size=2)
    routed, real = {}, 0.0
    for text in texts:  # one text per forward: no padding, every token real
        lm_loss(model, tokenizer, [text], mode="moe")
        for layer, share in ubmoe_peft.routing_stats(model).items():
            routed[layer] = routed.get(layer, 0.0) + share * len(tokenizer(text)["input_ids"])
        real += len(tokenizer(text)["input_ids"])
    expected = {layer: r / real for layer, r in routed.items()}
    assert whole.shares() == pytest.approx(expected) and 0 < whole.mean() < 1
    assert whole.mean() == pytest.approx(sum(expected.values()) / len(expected))
    with ubmoe_peft.track_routing(model) as none:  # modes uni and bi route nothing; the forwards before do not count
        lm_loss(model, tokenizer, texts, mode="uni")
    assert none.shares() is None and none.mean() is None


def test_conversational_prompt_completion_is_scored_as_the_chat(model, tokenizer):
    """TRL's conversational rows ({"prompt": [turns], "completion": [turns]}), which RouterTrainer trains on, crashed
    with an AttributeError; every completion turn is scored."""
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    user, reply = {"role": "user", "content": w(5, 6)}, {"role": "assistant", "content": w(7, 8)}
    pair = lm_loss(model, tokenizer, [{"prompt": [user], "completion": [reply]}], mode="uni")
    assert pair == lm_loss(model, tokenizer, [{"messages": [user, reply]}], mode="uni") and pair["tokens"] == 2
    more = {"role": "assistant", "content": w(9)}
    assert lm_loss(model, tokenizer, [{"prompt": [user], "completion": [reply, more]}])["tokens"] == 3
    bad = [({"prompt": w(5), "completion": None}, "'completion' is NoneType None"), ({"text": 3}, "'text' is int 3")]
    for row, message in bad:
        with pytest.raises(TypeError, match=rf"Example 1 \(counting from 0\): Its {message}; give"):
            lm_loss(model, tokenizer, [w(5, 6), row])


def test_numpy_and_tensor_scores_and_labels_are_numbers(model, tokenizer):
    import numpy as np

    s1, s2, gold = [w(5, 6), w(7, 8), w(9)], [w(5), w(8), w(10)], [1.0, 3.0, 5.0]
    expected = sts_spearman(model, tokenizer, s1, s2, gold)
    for scores in ([np.int64(1), np.int64(3), np.int64(5)], np.array(gold, dtype=np.float32), torch.tensor(gold)):
        assert sts_spearman(model, tokenizer, s1, s2, list(scores)) == expected
    import pandas as pd  # a pandas table's columns as they are (a numpy or Series of texts was refused)

    table = pd.DataFrame({"s1": s1, "s2": s2, "score": gold}, index=[4, 9, 2])
    assert sts_spearman(model, tokenizer, table["s1"], np.array(s2), table["score"]) == expected
    with pytest.raises(TypeError, match="sentences1 is a set, which has no order"):  # pairs match by position
        sts_spearman(model, tokenizer, set(s1), s2, gold)
    for scores, message in [
        (["1.0", "3.0", "5.0"], r"STS score 0 \(counting from 0\) is '1.0' \(str\); gold scores must be numbers"),
        ([1.0, float("nan"), 5.0], r"STS score 1 \(counting from 0\) is nan; gold scores must be finite"),
        ([1.0, 3.0, True], r"STS score 2 \(counting from 0\) is True \(bool\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            sts_spearman(model, tokenizer, s1, s2, scores)
    row = {"question": w(5), "choices": [w(6), w(7)]}
    as_int = multiple_choice_accuracy(model, tokenizer, [{**row, "label": 1}])
    assert multiple_choice_accuracy(model, tokenizer, [{**row, "label": np.int64(1)}]) == as_int
    with pytest.raises(ValueError, match=r"Row 0: label 1.0 is not a 0-based index .* \(it is float\)"):
        multiple_choice_accuracy(model, tokenizer, [{**row, "label": 1.0}])


def test_a_question_that_is_not_a_text_is_refused(model, tokenizer):
    row = {"question": None, "choices": [w(6), w(7)], "label": 0}  # was scored as the question "None"
    with pytest.raises(ValueError, match="Row 0: question is NoneType None; every question must be a text"):
        multiple_choice_accuracy(model, tokenizer, [row])


def test_lm_loss_takes_a_dataset_like_a_list(model, tokenizer):
    from datasets import Dataset

    rows = [{"prompt": w(5, 6) + " ", "completion": w(7, 8)}, {"prompt": w(9) + " ", "completion": w(10)}]
    as_dataset = Dataset.from_list(rows)
    assert lm_loss(model, tokenizer, as_dataset, mode="uni") == lm_loss(model, tokenizer, rows, mode="uni")
    with pytest.raises(TypeError, match="examples must be a list of texts or rows, got generator"):
        lm_loss(model, tokenizer, (row for row in rows))
    row = {"question": w(5), "choices": [w(6), w(7)], "label": 0}  # a dict iterates over its keys: "Row 0 lacks ..."
    with pytest.raises(TypeError, match="rows must be a list of texts or rows, got dict .*wrap a single example"):
        multiple_choice_accuracy(model, tokenizer, row)


def test_an_empty_prompt_scores_every_completion_token(model, tokenizer):
    """With nothing before it, the completion's first token was never scored (3 of 4 tokens); as lm-evaluation-harness
    does, it is scored after the end-of-text token."""
    completion = w(7, 8, 9)
    for prompt in ("", " ", "\n"):  # whitespace moves to the completion: every token of the row is scored
        expected = len(tokenizer(prompt + completion, add_special_tokens=False)["input_ids"])
        row = {"prompt": prompt, "completion": completion}
        assert lm_loss(model, tokenizer, [row], mode="uni")["tokens"] == expected, repr(prompt)


def test_inputs_over_max_length_are_counted_in_a_warning(model, tokenizer):
    """eval-lm's default --max_length 256 cut 13 of 100 SFT chats from the left, unannounced: the loss moved by 2%."""
    import warnings

    rows = [{"prompt": w(*range(5, 25)), "completion": w(30, 31, 32)}, {"prompt": w(5), "completion": w(6)}]
    with pytest.warns(
        UserWarning, match=r"1 of 2 examples are longer than max_length=8 tokens .* Raise max_length"
    ) as w1:
        lm_loss(model, tokenizer, rows, mode="uni", max_length=8)
    questions = [
        {"question": w(*range(5, 25)), "choices": [w(6), w(7)], "label": 0},
        {"question": w(5), "choices": [w(8), w(9)], "label": 1},
    ]
    with pytest.warns(UserWarning, match=r"1 of 2 rows are longer than max_length=8") as w2:  # rows, not choices
        multiple_choice_accuracy(model, tokenizer, (q for q in questions), mode="uni", max_length=8)  # a generator
    assert w1[0].filename == w2[0].filename == __file__  # pointed at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refused mode is named first, with no warning about the inputs
        with pytest.raises(ValueError, match="mode 'bi' are meaningless"):
            lm_loss(model, tokenizer, rows, mode="bi", max_length=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lm_loss(model, tokenizer, rows, mode="uni", max_length=64)  # no warning when everything fits


def test_csv_cells_spelling_na_or_null_are_texts_not_missing(tmp_path):
    """pandas reads "NA", "null", "nan", "None" as missing by default: those sentences were refused as empty."""
    from ubmoe_peft.data import load_rows

    tsv = tmp_path / "sts.tsv"
    tsv.write_text("sentence1\tsentence2\tscore\nNA\tA man.\t3.0\nnull\tNone\t2.0\nA cat.\tnan\t1\n")
    rows = load_rows(str(tsv), "sts")
    assert rows["sentence1"] == ["NA", "null", "A cat."] and rows["sentence2"] == ["A man.", "None", "nan"]
    csv_file = tmp_path / "sts.csv"
    csv_file.write_text("sentence1,sentence2,score\nNA,,1.0\n")
    with pytest.raises(ValueError, match=r"row 0 \(counting from 0\) has an empty 'sentence2'"):  # a blank cell is
        load_rows(str(csv_file), "sts")


def test_evaluations_of_a_model_offloaded_by_accelerate_are_those_in_memory(model, tokenizer):
    """They sent their inputs to the first parameter's device, which offloading makes meta: the first call failed
    with "Cannot copy out of meta tensor" (and left weights loaded, so a second one ran)."""
    from accelerate import cpu_offload

    tokenizer.pad_token = tokenizer.eos_token
    texts = [w(*range(5, 14)), w(20, 21, 22, 23)]
    rows = [{"question": w(5, 6), "choices": [w(7), w(8), w(9, 10)], "label": label} for label in range(3)]

    def scores():
        return (
            lm_loss(model, tokenizer, texts, mode="moe"),
            multiple_choice_accuracy(model, tokenizer, rows, mode="moe"),
            ubmoe_peft.attention_dependence(model, tokenizer, texts, mode="bi").average,
        )

    expected = scores()
    cpu_offload(model.get_base_model(), execution_device=torch.device("cpu"))
    assert next(model.parameters()).is_meta
    got = scores()
    assert got[0]["tokens"] == expected[0]["tokens"] and got[0]["loss"] == pytest.approx(expected[0]["loss"])
    assert got[1] == expected[1]
    assert got[2] == pytest.approx(expected[2])


def test_a_sentence_transformer_evaluates_as_its_model(model, tokenizer):
    """sts_spearman and the mode functions took a SentenceTransformer made by to_sentence_transformer; lm_loss and
    multiple_choice_accuracy failed on it with a bare TypeError from the pooling module's forward."""
    st = ubmoe_peft.to_sentence_transformer(model, tokenizer)
    texts = [w(5, 6, 7, 8), w(9, 10, 11)]
    rows = [{"question": w(5, 6), "choices": [w(7), w(8)], "label": 0}]
    s1, s2, gold = [w(5, 6), w(7, 8), w(9, 10)], [w(5, 6), w(8, 7), w(11, 12)], [3.0, 2.0, 1.0]
    assert lm_loss(st, tokenizer, texts, mode="uni") == lm_loss(model, tokenizer, texts, mode="uni")
    assert multiple_choice_accuracy(st, tokenizer, rows) == multiple_choice_accuracy(model, tokenizer, rows)
    assert sts_spearman(st, tokenizer, s1, s2, gold) == sts_spearman(model, tokenizer, s1, s2, gold)
    # mode None is the model's current mode, as in the other evaluations (it was refused as an unknown mode)
    with ubmoe_peft.use_mode(model, "uni"):
        assert sts_spearman(model, tokenizer, s1, s2, gold, mode=None) == sts_spearman(
            model, tokenizer, s1, s2, gold, mode="uni"
        )
    # a module inside the PeftModel is evaluated as the PeftModel, as by lm_loss
    assert sts_spearman(model.base_model, tokenizer, s1, s2, gold) == sts_spearman(model, tokenizer, s1, s2, gold)


def test_a_missing_or_swapped_model_or_tokenizer_is_named(model, tokenizer):
    """A None tokenizer failed as "'NoneType' object is not callable"; model and tokenizer swapped failed in the
    embedding layer ("argument 'indices' must be Tensor, not str")."""
    texts, rows = [w(5, 6, 7)], [{"question": w(5, 6), "choices": [w(7), w(8)], "label": 0}]
    s1, s2, gold = [w(5, 6), w(7, 8)], [w(5, 6), w(8, 7)], [1.0, 2.0]
    for call in (
        lambda m, t: lm_loss(m, t, texts),
        lambda m, t: multiple_choice_accuracy(m, t, rows),
        lambda m, t: sts_spearman(m, t, s1, s2, gold),
    ):
        with pytest.raises(TypeError, match="tokenizer must be a transformers tokenizer, got NoneType"):
            call(model, None)
        with pytest.raises(TypeError, match="model must be a model .* it is a tokenizer: pass the model first"):
            call(tokenizer, model)


def test_malformed_rows_and_scores_are_named(model, tokenizer):
    """A row that is not a dict failed as "'NoneType' object is not iterable" or "unhashable type: 'list'"; scores
    that are None or a generator as "has no len()", a text as "as many ... as scores (3)" for 3 of each."""
    for row in (None, [w(5), [w(7), w(8)], 0]):
        with pytest.raises(TypeError, match=r"Row 0 is \w+ .*; a multiple-choice row is a dict with the keys"):
            multiple_choice_accuracy(model, tokenizer, [row])
    s1, s2 = [w(5, 6), w(7, 8), w(9, 10)], [w(5, 6), w(8, 7), w(11, 12)]
    for scores, fix in [(None, "give the list of numbers"), ("1.0", "wrap a single"), ((x for x in [1.0]), "list")]:
        with pytest.raises(TypeError, match=f"scores must be a list of numbers, got {type(scores).__name__} .*{fix}"):
            sts_spearman(model, tokenizer, s1, s2, scores)


def test_a_text_file_of_blank_lines_is_named(tmp_path):
    """It was refused for a --split slice nobody gave ("'train' of a single data file has 0 rows")."""
    from ubmoe_peft.data import load_rows

    blank = tmp_path / "blank.txt"
    blank.write_text("\n   \n\t\n")
    with pytest.raises(ValueError, match=r"Data file '.*blank.txt' holds only blank lines"):
        load_rows(str(blank), "texts")
