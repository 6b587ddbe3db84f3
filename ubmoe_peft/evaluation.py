"""Evaluations the method is judged by, in any mode: STS correlation, language-model loss, multiple choice.

- `sts_spearman` is sentence-transformers' `EmbeddingSimilarityEvaluator` on our embedding wrapper.
- `lm_loss` and `multiple_choice_accuracy` score continuations by their log-likelihood, as lm-evaluation-harness
  does (``acc``, and ``acc_norm``: divided by the choice's length in characters). They are written here because the
  harness evaluates its own hub task definitions, while these take a user's local rows (chat ``messages``,
  ``prompt``/``completion``, plain ``text`` or ``question``/``choices``/``label``) and run in a chosen UBMoE mode.
"""

from __future__ import annotations

import copy
import math
import numbers
import operator
import os
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ._extras import require
from .modes import forward_in_mode, get_mode, ubmoe_layers


def sts_spearman(
    model: nn.Module,
    tokenizer: Any,
    sentences1: Sequence[str],
    sentences2: Sequence[str],
    scores: Sequence[float],
    mode: str | None = "bi",
    prompt: str | None = None,
    pooling: str = "mean",
    batch_size: int = 32,
    max_length: int = 128,
) -> float:
    """Spearman correlation x 100 between the cosine similarity of the two sentences' embeddings and the gold score,
    embedded in ``mode`` (None: the model's current mode, as in the other evaluations)."""
    require("sts_spearman", "train", "sentence_transformers")
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    from .embedding import sentence_transformer_of

    model = model_to_evaluate(model)
    check_tokenizer(tokenizer)
    _check_texts(sentences1, "sentences1")
    _check_texts(sentences2, "sentences2")
    check_collection(scores, "scores", kind="numbers")  # None or a generator failed on len(), a text as 1 row
    if not (len(sentences1) == len(sentences2) == len(scores)) or len(scores) < 2:
        raise ValueError(
            f"STS needs at least 2 rows and as many sentences1 ({len(sentences1)}), sentences2 ({len(sentences2)}) "
            f"as scores ({len(scores)})."
        )
    gold = [_gold_score(i, score) for i, score in enumerate(scores)]
    if len(set(gold)) < 2:
        raise ValueError(
            f"All {len(gold)} gold scores are {gold[0]}: a rank correlation with constant scores is undefined. "
            "Pass pairs with different gold scores."
        )
    check_sizes(batch_size, max_length)
    if mode is None and ubmoe_layers(model):  # without layers, the encoder names what to do instead
        mode = get_mode(model)
    # never saved: a module inside the PeftModel (model.base_model) evaluates as the PeftModel does
    st = sentence_transformer_of(model, tokenizer, pooling, prompt, max_length, mode)
    evaluator = EmbeddingSimilarityEvaluator(
        list(sentences1),
        list(sentences2),
        gold,
        batch_size=batch_size,
        main_similarity="cosine",
        similarity_fn_names=["cosine"],
        write_csv=False,
    )
    with _evaluating(model):
        return 100 * float(evaluator(st)[evaluator.primary_metric])


def _gold_score(row: int, score: Any) -> float:
    """A gold score as a float: any real number (numpy's and 0-d tensors too), not a bool, a text or NaN."""
    if isinstance(score, torch.Tensor) and score.ndim == 0 and score.dtype != torch.bool:
        score = score.item()
    if isinstance(score, bool) or not isinstance(score, numbers.Real):
        raise ValueError(
            f"STS score {row} (counting from 0) is {score!r} ({type(score).__name__}); gold scores must be numbers. "
            "Convert the column to numbers first (float(score))."
        )
    if not math.isfinite(score):
        raise ValueError(
            f"STS score {row} (counting from 0) is {score!r}; gold scores must be finite. Fill it in or drop the row."
        )
    return float(score)


def _check_texts(texts: Any, name: str) -> None:
    """``texts`` is a sized collection of non-empty strings (a list, a numpy array, a pandas column; a single string
    would be read character by character)."""
    check_collection(texts, name)
    if isinstance(texts, AbstractSet):  # pairs are matched by position, and a set has none
        raise TypeError(
            f"{name} is a {type(texts).__name__}, which has no order; pass a list (pairs match by position)."
        )
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{name}[{i}] is {text!r}: every entry must be a non-empty text.")


def check_sizes(batch_size: Any, max_length: Any) -> None:
    """Both positive integers (0 or less used to skip truncation, cut from the wrong end, or fail deep inside)."""
    for name, value in (("batch_size", batch_size), ("max_length", max_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: give a positive integer (texts per batch, tokens per text).")


def with_pad_token(tokenizer: Any) -> Any:
    """``tokenizer``, or a copy of it that pads with its end-of-text token where it has no pad token (most decoders'
    do not): setting it on the caller's own tokenizer lasted beyond the call, and a collator that masks pad ids would
    then never train the end-of-text token."""
    if tokenizer.pad_token is not None:
        return tokenizer
    if tokenizer.eos_token is None:
        raise ValueError(
            f"The tokenizer ({type(tokenizer).__name__}) has neither a pad token nor an end-of-text token to pad a "
            "batch with; give it one: tokenizer.pad_token = tokenizer.eos_token (or any token of its vocabulary)."
        )
    try:
        padded = copy.deepcopy(tokenizer)
    except Exception:  # e.g. a custom (Python) pre-tokenizer: "Custom PreTokenizer cannot be serialized"
        padded = copy.copy(tokenizer)  # shares the backend; its own special-token map, so the caller's stays as is
        if isinstance(getattr(tokenizer, "_special_tokens_map", None), dict):
            padded._special_tokens_map = dict(tokenizer._special_tokens_map)
    padded.pad_token = padded.eos_token
    return padded


def encoder_model(model: Any) -> Any:
    """The UBMoE model of a SentenceTransformer made by `to_sentence_transformer` (``st[0].model``), which the mode
    functions take too (the likelihood scores and `attention_dependence` failed on one with a bare TypeError from the
    pooling module's forward); anything else as given."""
    if "sentence_transformers" not in sys.modules:  # then no SentenceTransformer exists: the extra is optional
        return model
    from sentence_transformers import SentenceTransformer

    if not isinstance(model, SentenceTransformer):
        return model
    from .embedding import UBMoEEncoder

    encoders = [module for module in model if isinstance(module, UBMoEEncoder)]
    if not encoders:
        raise TypeError(
            f"model is a SentenceTransformer without a UBMoE encoder (modules {[type(m).__name__ for m in model]}); "
            "pass the model itself, or a SentenceTransformer made by ubmoe_peft.to_sentence_transformer."
        )
    return encoders[0].model


def model_to_evaluate(model: Any) -> nn.Module:
    """``model`` as the evaluations run it: a torch module (a plain model too, as a baseline), or `encoder_model` of
    a SentenceTransformer. A tokenizer in its place is named (model and tokenizer swapped failed deep inside, with
    the embedding layer's TypeError)."""
    model = encoder_model(model)
    if not isinstance(model, nn.Module):
        swapped = "; it is a tokenizer: pass the model first, then the tokenizer" if hasattr(model, "pad_token") else ""
        raise TypeError(
            f"model must be a model (a torch module), got {type(model).__name__} {str(model)[:60]!r}{swapped}. Pass "
            "the wrapped model (peft.get_peft_model or PeftModel.from_pretrained), or a plain transformers model."
        )
    return model


def check_tokenizer(tokenizer: Any) -> None:
    """A transformers tokenizer, not a path or None (which would fail deep inside with "'NoneType' object is not
    callable")."""
    if isinstance(tokenizer, (str, os.PathLike)) or not callable(tokenizer) or not hasattr(tokenizer, "pad_token"):
        raise TypeError(
            f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__} {str(tokenizer)[:60]!r}; "
            "load it with AutoTokenizer.from_pretrained(...)."
        )


def _appended_eos(tokenizer: Any, text: str, ids: list[int]) -> bool:
    """Whether ``ids`` (``tokenizer(text)``) ends with an end-of-text token the tokenizer appended, not one the text
    itself spells."""
    if not ids or ids[-1] != tokenizer.eos_token_id:
        return False
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    return len(ids) > len(plain) and ids[len(ids) - 1 - len(plain) : -1] == plain


def _pair(tokenizer: Any, example: str | dict) -> tuple[list[int], list[int]]:
    """One example -> (context ids, continuation ids); only the continuation is scored."""
    if isinstance(example, str):
        ids = tokenizer(example)["input_ids"]
        return ids[:1], ids[1:]
    if not isinstance(example, dict):
        raise TypeError(f"An example is {type(example).__name__} {example!r}: give a text or a row (a dict).")
    if "messages" in example:  # score the last (assistant) turn given the conversation before it
        messages = example["messages"]
        roles = [m.get("role") if isinstance(m, dict) else type(m).__name__ for m in messages or []]
        if not roles or roles[-1] != "assistant" or len(roles) < 2:
            raise ValueError(
                f"A chat example with roles {roles}: the score is the loss of a chat's last turn given the turns "
                "before it, so a chat needs at least one turn before a last turn by the 'assistant'. End each chat "
                "with the assistant's reply (drop a trailing user turn)."
            )
        return _chat_pair(tokenizer, messages[:-1], messages)
    if "prompt" in example and "completion" in example:
        prompt, completion = example["prompt"], example["completion"]
        if isinstance(prompt, list) and isinstance(completion, list) and prompt and completion:
            return _chat_pair(tokenizer, prompt, prompt + completion)  # TRL's conversational prompt/completion
        for field, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str):
                raise TypeError(
                    f"Its {field!r} is {type(value).__name__} {repr(value)[:60]}; give 'prompt' and 'completion' as "
                    "two texts, or as two non-empty lists of chat turns (TRL's conversational format)."
                )
        return _prompt_completion(tokenizer, prompt, completion)
    if "text" in example:
        if not isinstance(example["text"], str):
            raise TypeError(f"Its 'text' is {type(example['text']).__name__} {example['text']!r}; give a text.")
        return _pair(tokenizer, example["text"])
    raise ValueError(
        f"Cannot score an example with keys {sorted(example)}: give 'messages', 'prompt' and 'completion', or 'text'."
    )


def _chat_pair(tokenizer: Any, context: list, turns: list) -> tuple[list[int], list[int]]:
    """(ids of the chat ``context`` with the assistant's generation prompt, ids of the rest of ``turns``)."""
    first = _ids(tokenizer.apply_chat_template(context, add_generation_prompt=True, tokenize=True))
    whole = _ids(tokenizer.apply_chat_template(turns, tokenize=True))
    if whole[: len(first)] != first:
        parted = (i for i, (a, b) in enumerate(zip(first, whole, strict=False)) if a != b)
        at = next(parted, min(len(first), len(whole)))  # the first token where the two renderings differ
        raise ValueError(
            "Cannot cut the scored turns out of this chat: the tokenizer's chat template renders the context with its "
            f"generation prompt as ...{tokenizer.decode(first[max(at - 8, 0) :])!r}, but the whole chat as "
            f"...{tokenizer.decode(whole[max(at - 8, 0) : at + 8])!r}... (they part at token {at}): its generation "
            "prompt is not how it renders the assistant's turn (e.g. one that opens a <think> block only in the "
            "prompt). Score such rows as 'prompt' and 'completion' texts, or use a tokenizer whose template renders "
            "both alike."
        )
    return first, whole[len(first) :]


def _prompt_completion(tokenizer: Any, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) with every completion token scored. As lm-evaluation-harness does, a prompt's
    trailing whitespace moves to the completion (BPE tokenizers attach a space to the next word: "Answer: " +
    "Paris" would otherwise score " is it" without "Paris"), and an end-of-text token a tokenizer appends to the
    prompt alone is no part of the context. Where a token still spans the boundary, the completion is tokenized on
    its own after the prompt's tokens."""
    spaces = len(prompt) - len(prompt.rstrip())
    if spaces:
        prompt, completion = prompt[:-spaces], prompt[-spaces:] + completion
    context = tokenizer(prompt)["input_ids"]
    if len(context) > 1 and _appended_eos(tokenizer, prompt, context):  # not one the prompt ends with
        context = context[:-1]
    if not context:  # nothing to condition the first completion token on: as lm-evaluation-harness, BOS (else EOS)
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if start is None:
            raise ValueError(
                "The prompt is empty, and the tokenizer has neither a BOS nor an EOS token to put before the "
                "completion: its first token could not be scored. Give a prompt, or score the row as a text."
            )
        return [start], tokenizer(completion, add_special_tokens=False)["input_ids"]
    whole = tokenizer(prompt + completion)["input_ids"]
    if whole[: len(context)] == context:
        return context, whole[len(context) :]
    return context, tokenizer(completion, add_special_tokens=False)["input_ids"]


def _ids(rendered: Any) -> list[int]:
    # apply_chat_template returns a list of ids, or a BatchEncoding with input_ids, depending on the version
    return list(rendered["input_ids"] if not isinstance(rendered, list) else rendered)


def input_device(model: nn.Module) -> torch.device:
    """The device a model's inputs go to: its first parameter's, or where a model offloaded by accelerate computes
    (its weights wait on the meta device, and an input sent there holds no data for the hooks to move back)."""
    device = next(model.parameters()).device
    if device.type != "meta":
        return device
    for module in model.modules():
        execution = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if execution is not None:
            return torch.device(execution)
    return torch.device("cpu")


@torch.no_grad()
def _continuation_logprobs(
    model: nn.Module,
    pairs: Sequence[tuple[list[int], list[int]]],
    pad_id: int,
    batch_size: int,
    max_length: int,
    mode: str | None = None,
) -> list[tuple[float, int]]:
    """(sum of log p(continuation | context), continuation length) per pair, each forward in ``mode`` (None: the
    model's); long inputs lose their left end."""
    device = input_device(model)
    out: list[tuple[float, int]] = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        seqs = [(ctx + cont)[-max_length:] for ctx, cont in chunk]
        n_cont = [_scored_tokens(ctx, cont, max_length) for ctx, cont in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, T) right-padded
        mask = torch.zeros_like(ids)  # (B, T)
        for row, seq in enumerate(seqs):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        with forward_in_mode(model, mode):  # per forward: other threads' forwards keep their own mode
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()  # (B, T, V)
        logprobs = torch.log_softmax(logits[:, :-1], dim=-1)  # (B, T-1, V): position t predicts token t+1
        targets = logprobs.gather(-1, ids[:, 1:].to(device).unsqueeze(-1)).squeeze(-1)  # (B, T-1)
        for row, seq in enumerate(seqs):
            end = len(seq) - 1
            out.append((float(targets[row, end - n_cont[row] : end].sum()), n_cont[row]))
    return out


@contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) for the block; the model's training flag is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def check_scoring_mode(mode: str | None) -> None:
    """Refuse mode bi for likelihood scores: there every token attends to later ones, so a next-token score would
    read the very token it predicts."""
    if mode == "bi":
        raise ValueError(
            "Likelihood scores in mode 'bi' are meaningless: bidirectional attention lets each position see the "
            "token it is asked to predict. Score modes 'uni' or 'moe'; evaluate mode bi with sts_spearman (ubmoe "
            "eval-sts)."
        )


def _check_mode(model: nn.Module, mode: str | None) -> None:
    """`check_scoring_mode` of ``mode``, or of the model's current mode when None."""
    check_scoring_mode(mode or (get_mode(model) if ubmoe_layers(model) else None))


_EXP_LIMIT = math.log(sys.float_info.max)  # about 709.78


def lm_loss(
    model: nn.Module,
    tokenizer: Any,
    examples: Iterable[str | dict],
    mode: str | None = None,
    batch_size: int = 4,
    max_length: int = 512,
) -> dict[str, float | int]:
    """Mean negative log-likelihood per scored token (``loss``), its ``perplexity``, and the number of ``tokens``
    scored (an int).

    Scored: every token but the first of a text; the completion of a prompt/completion row (every completion turn
    of TRL's conversational rows, lists of turns); the last turn of a chat. ``examples`` may be a datasets.Dataset.
    """
    model = model_to_evaluate(model)
    check_tokenizer(tokenizer)  # None failed per example, as "'NoneType' object is not callable"
    check_collection(examples, "examples")
    examples = list(examples)  # a datasets.Dataset gives its rows as dicts
    if not examples:
        raise ValueError("lm_loss needs at least one example.")
    check_sizes(batch_size, max_length)
    pairs = []
    for i, example in enumerate(examples):
        try:
            pairs.append(_pair(tokenizer, example))
        except (ValueError, TypeError) as err:  # name the example: the data can be thousands of rows
            raise type(err)(f"Example {i} (counting from 0): {err}") from err
    empty = [i for i, (context, continuation) in enumerate(pairs) if not context and not continuation]
    if empty:
        raise ValueError(
            f"Example {empty[0]} ({examples[empty[0]]!r}) has no tokens ({len(empty)} such examples): drop empty texts "
            "(a blank line of a text file is one)."
        )
    _check_mode(model, mode)  # a refused mode (bi) is named before any warning about the inputs
    _warn_if_cut(pairs, list(range(len(pairs))), max_length, "examples")
    scored = _score(model, tokenizer, pairs, mode, batch_size, max_length)
    tokens = sum(n for _, n in scored)
    if tokens == 0:
        raise ValueError("No token to score: every example is empty after its context.")
    loss = -sum(lp for lp, _ in scored) / tokens
    perplexity = math.inf if loss >= _EXP_LIMIT else math.exp(loss)  # math.exp raised OverflowError past ~709.8
    return {"loss": loss, "perplexity": perplexity, "tokens": tokens}


def multiple_choice_accuracy(
    model: nn.Module,
    tokenizer: Any,
    rows: Sequence[dict],
    mode: str | None = None,
    batch_size: int = 8,
    max_length: int = 512,
) -> dict[str, float | int]:
    """Accuracy of picking the most likely choice (``accuracy``; ``accuracy_norm`` divides the log-likelihood by the
    choice's length in characters, as lm-evaluation-harness's ``acc_norm``). Rows hold ``question``, ``choices`` and
    the 0-based ``label``. As in the harness, each choice is scored as " " + choice without an end-of-text token a
    tokenizer appends."""
    model = model_to_evaluate(model)
    check_tokenizer(tokenizer)
    check_collection(rows, "rows", sized=False)  # one row (a dict) would be read as its keys
    check_sizes(batch_size, max_length)
    appends_eos = _appended_eos(tokenizer, "a", tokenizer("a")["input_ids"])
    pairs, spans, lengths = [], [], []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):  # None failed as "not iterable", a list as "unhashable type"
            raise TypeError(
                f"Row {i} is {type(row).__name__} {str(row)[:60]!r}; a multiple-choice row is a dict with the keys "
                "question, choices and label. Give each row as a dict."
            )
        missing = {"question", "choices", "label"} - set(row)
        if missing:
            raise ValueError(f"Row {i} lacks {sorted(missing)}; multiple-choice rows need question, choices, label.")
        question, choices = row["question"], row["choices"]
        if not isinstance(question, str):  # str(None) would be scored as the question "None"
            raise ValueError(
                f"Row {i}: question is {type(question).__name__} {question!r}; every question must be a text. Fill "
                "it in or drop the row."
            )
        if isinstance(choices, str) or not isinstance(choices, Sequence) or len(choices) < 2:
            raise ValueError(f"Row {i}: choices must be a list of at least 2 answers, got {choices!r}.")
        label = _label(i, row["label"], len(choices))
        blank = [k for k, choice in enumerate(choices) if not isinstance(choice, str) or not choice.strip()]
        if blank:  # an empty choice scores no token, log-likelihood 0: it would always win
            raise ValueError(f"Row {i}: choice {blank[0]} is {choices[blank[0]]!r}; every choice must be a text.")
        context = f"Question: {question}\nAnswer:"
        spans.append((len(pairs), len(choices), label))
        for choice in choices:
            prompt_ids, choice_ids = _pair(tokenizer, {"prompt": context, "completion": f" {choice}"})
            if appends_eos and choice_ids[-1:] == [tokenizer.eos_token_id]:
                choice_ids = choice_ids[:-1]
            pairs.append((prompt_ids, choice_ids))
            lengths.append(len(choice))
    if not spans:
        raise ValueError("multiple_choice_accuracy needs at least one row.")
    _check_mode(model, mode)  # a refused mode (bi) is named before any warning about the inputs
    _warn_if_cut(pairs, [row for row, (_, count, _) in enumerate(spans) for _ in range(count)], max_length, "rows")
    scored = _score(model, tokenizer, pairs, mode, batch_size, max_length)
    right = right_norm = 0
    for row, (first, count, label) in enumerate(spans):
        unscored = [k for k in range(count) if scored[first + k][1] == 0]
        if unscored:
            raise ValueError(
                f"Row {row}: choice {unscored[0]} has no token left to score (it tokenizes to nothing, or "
                f"max_length={max_length} cuts it); its log-likelihood 0 would always win. Raise max_length."
            )
        sums = [scored[first + k][0] for k in range(count)]
        broken = [k for k, s in enumerate(sums) if math.isnan(s)]
        if broken:  # max() over NaN scores picked choice 0, an accuracy of chance or better for a broken model
            raise ValueError(
                f"Row {row}: the log-likelihood of choice {broken[0]} is NaN, so the model's outputs are not finite "
                f"(mode {mode or 'as set'}): a diverged or damaged adapter, or an overflow in float16."
            )
        norms = [s / lengths[first + k] for k, s in enumerate(sums)]
        right += max(range(count), key=sums.__getitem__) == label
        right_norm += max(range(count), key=norms.__getitem__) == label
    n = len(spans)
    return {"accuracy": 100 * right / n, "accuracy_norm": 100 * right_norm / n, "n": n}


def _scored_tokens(context: list[int], continuation: list[int], max_length: int) -> int:
    """How many continuation tokens are scored once the pair is cut to its last ``max_length`` tokens (the first
    token kept predicts nothing)."""
    return max(0, min(len(continuation), min(len(context) + len(continuation), max_length) - 1))


def _warn_if_cut(pairs: list, owners: list[int], max_length: int, what: str) -> None:
    """Warn, counting them, of the examples (``owners[i]``: the example of pair i) longer than ``max_length``: they lose
    their left end (`_continuation_logprobs`), which used to shift the scores unannounced."""
    long = [i for i, (ctx, cont) in enumerate(pairs) if len(ctx) + len(cont) > max_length]
    if long:
        lost = sum(len(pairs[i][1]) - _scored_tokens(*pairs[i], max_length) for i in long)
        total = sum(len(cont) for _, cont in pairs)
        warnings.warn(
            f"{len({owners[i] for i in long})} of {len(set(owners))} {what} are longer than max_length={max_length} "
            f"tokens and lose their left end: their scored tokens see less context, and {lost} of {total} tokens to "
            "score are cut. Raise max_length (--max_length on the command line) to score them whole.",
            stacklevel=3,  # the caller of lm_loss / multiple_choice_accuracy
        )


def check_collection(items: Any, name: str, sized: bool = True, kind: str = "texts or rows") -> None:
    """A list of examples (``kind``), not one example: a dict iterates over its keys and a string over its characters.
    With ``sized``, a collection with a length (not a generator)."""
    single = isinstance(items, (str, dict)) or not isinstance(items, Iterable)
    if single or (sized and not hasattr(items, "__len__")):
        if items is None:
            fix = f"give the list of {kind}"
        elif single:
            fix = "wrap a single example in a list (a datasets.Dataset or another sized collection is taken as it is)"
        else:
            fix = "pass list(...) of it (it has no length)"
        raise TypeError(f"{name} must be a list of {kind}, got {type(items).__name__} {str(items)[:60]!r}; {fix}.")


def _label(row: int, label: Any, count: int) -> int:
    """A 0-based choice index: any integer (numpy's too, or "1" from a text column), not a bool."""
    index = None
    if isinstance(label, str) and label.strip().isdigit():
        index = int(label)
    elif not isinstance(label, bool):
        try:
            index = operator.index(label)
        except TypeError:
            pass
    if index is None or not 0 <= index < count:
        raise ValueError(
            f"Row {row}: label {label!r} is not a 0-based index of its {count} choices (0..{count - 1}) (it is "
            f"{type(label).__name__}); give the right choice's index. Rows without a known answer cannot be scored."
        )
    return index


def _score(
    model: nn.Module, tokenizer: Any, pairs: list, mode: str | None, batch_size: int, max_length: int
) -> list[tuple[float, int]]:
    """`_continuation_logprobs` in eval mode and in ``mode``; the model's training flag and mode are restored."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    _check_mode(model, mode)
    with _evaluating(model):
        return _continuation_logprobs(model, pairs, int(pad or 0), batch_size, max_length, mode)
