"""The sentence-transformers wrapper: mode-bi embeddings, prompt templates, shared parameters, training."""

from __future__ import annotations

import copy
import functools
import shutil

import pytest
import torch
from conftest import batch, perturb_adapters, tiny_model, w
from peft import PeftModel, get_peft_model
from sentence_transformers import losses
from transformers import AutoModelForCausalLM

import ubmoe_peft
from ubmoe_peft import UBMoEConfig, load_sentence_transformer, to_sentence_transformer
from ubmoe_peft.modes import ubmoe_layers


def _wrapped(expert="lora"):
    model = get_peft_model(tiny_model(), UBMoEConfig(expert_type=expert)).eval()
    perturb_adapters(model, std=0.1)
    return model


@pytest.mark.parametrize("expert", ["lora", "copy"])
def test_embeddings_are_mode_bi_mean_pooled_hidden_states(tokenizer, expert):
    model = _wrapped(expert)
    st = to_sentence_transformer(model, tokenizer, pooling="mean")
    texts = [w(5, 6, 7, 8), w(9, 10)]
    got = st.encode(texts, convert_to_tensor=True)  # (2, C)
    assert ubmoe_peft.get_mode(model) == "moe"  # restored after encoding

    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with ubmoe_peft.use_mode(model, "bi"), torch.no_grad():
        hidden = model(**batch, output_hidden_states=True).hidden_states[-1]  # (2, T, C)
    mask = batch["attention_mask"].unsqueeze(-1).float()  # (2, T, 1)
    expected = (hidden * mask).sum(1) / mask.sum(1)  # (2, C)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_prompt_template_puts_the_text_mid_prompt(tokenizer):
    st = to_sentence_transformer(_wrapped(), tokenizer, prompt=w(20) + " {text} " + w(21))
    features = st[0].preprocess([w(5, 6)])
    assert features["input_ids"].tolist() == [[20, 5, 6, 21]]
    prefix = to_sentence_transformer(_wrapped(), tokenizer, prompt=w(20) + " ")
    assert prefix[0].preprocess([w(5)])["input_ids"].tolist() == [[20, 5]]
    with pytest.raises(ValueError, match="more than one"):
        to_sentence_transformer(_wrapped(), tokenizer, prompt="{text} {text}")


def test_sentence_transformers_length_and_tokenizer_options_are_honoured(tokenizer):
    st = to_sentence_transformer(_wrapped(), tokenizer, max_length=64)
    text = w(*range(5, 25))  # 20 tokens
    assert st.max_seq_length == 64
    st.max_seq_length = 4  # sentence-transformers' own spelling (it was read as None and ignored when set)
    assert st[0].preprocess([text])["input_ids"].shape == (1, 4)
    short = to_sentence_transformer(_wrapped(), tokenizer, max_length=4)
    torch.testing.assert_close(st.encode([text]), short.encode([text]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="max_length=0"):
        st.max_seq_length = 0

    st.max_seq_length = 64  # per-call tokenizer options, as sentence-transformers' Transformer takes them
    per_call = st.encode([text], processing_kwargs={"text": {"max_length": 4}})
    torch.testing.assert_close(per_call, short.encode([text]), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"processing_kwargs\['image'\].*embeds text only"):
        st.encode([text], processing_kwargs={"image": {"size": 8}})


def test_truncation_keeps_the_end_of_the_template(tokenizer):
    """The paper's template ends in `is:"` after the text, where last-token pooling reads: an over-long text loses
    its own end, not the template's (right truncation used to cut it)."""
    st = to_sentence_transformer(_wrapped(), tokenizer, pooling="lasttoken", prompt=w(100) + " {text} " + w(101, 102))
    st.max_seq_length = 6
    features = st[0].preprocess([w(*range(5, 13)), w(5, 6)])  # 11 tokens in all, and 5
    assert features["input_ids"].tolist() == [[100, 5, 6, 7, 101, 102], [100, 5, 6, 101, 102, 0]]
    assert features["attention_mask"].tolist() == [[1] * 6, [1] * 5 + [0]]
    calls = []
    st[0].tokenizer = functools.partial(_counted, tokenizer, calls)
    alone = st[0].preprocess([w(5, 6)])  # a batch without a row at the limit: the tokenizer's own output, one pass
    assert alone["input_ids"].tolist() == [[100, 5, 6, 101, 102]] and len(calls) == 1
    st[0].tokenizer = tokenizer
    at_limit = st[0].preprocess([w(5, 6, 7), w(5)])  # 6 tokens: at the limit, not over it
    assert at_limit["input_ids"].tolist() == [[100, 5, 6, 7, 101, 102], [100, 5, 101, 102, 0, 0]]
    from transformers.tokenization_utils_base import TruncationStrategy

    for strategy in ("longest_first", "only_first", TruncationStrategy.LONGEST_FIRST):  # cut the end of the template
        by_name = st[0].preprocess([w(*range(5, 13))], processing_kwargs={"text": {"truncation": strategy}})
        assert by_name["input_ids"].tolist() == [[100, 5, 6, 7, 101, 102]], strategy
    # a template ending in a special token (`{text}<|im_end|>`): it was counted twice, and the text's last token kept
    ended = to_sentence_transformer(_wrapped(), tokenizer, pooling="lasttoken", prompt=w(100) + " {text} " + w(101, 2))
    ended.max_seq_length = 6
    assert ended[0].preprocess([w(*range(5, 13))])["input_ids"].tolist() == [[100, 5, 6, 7, 101, 2]]


def test_truncation_counts_the_template_end_as_the_row_holds_it(tmp_path):
    """A SentencePiece tokenizer (Metaspace, a dummy prefix) tokenizes ``: a`` alone as three tokens but as two after a
    word: counted alone, an over-long row kept a token of its text's cut-off end ("... three ten: a")."""
    from tokenizers import Tokenizer, models, processors, trainers
    from tokenizers import pre_tokenizers as pt
    from transformers import PreTrainedTokenizerFast

    words = "The representative word for sentence is one two three four five six seven eight nine ten is: a b"
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pt.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.train_from_iterator([words] * 20, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>"]))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", unk_token="<unk>", pad_token="<unk>")
    template = "The representative word for sentence {text}: a"
    assert len(fast(": a", add_special_tokens=False)["input_ids"]) == 3  # alone; 2 in the row
    text = "one two three four five six seven eight nine ten"
    st = to_sentence_transformer(_wrapped(), fast, pooling="lasttoken", prompt=template, max_length=12)
    kept = fast.convert_ids_to_tokens(st[0].preprocess([text])["input_ids"][0].tolist())
    expected = fast.convert_ids_to_tokens(fast(template.replace("{text}", "one two three four"))["input_ids"])
    assert kept == expected and len(kept) == 12


def test_per_call_tokenizer_options_apply_to_a_row_cut_to_keep_the_template_end():
    """processing_kwargs (``add_special_tokens=False``, ``padding_side``) were dropped when a batch held a row over the
    limit: the same text embedded otherwise beside an over-long one."""
    from conftest import WORDS
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token=WORDS[3]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single=f"{WORDS[1]} $A", special_tokens=[(WORDS[1], 1)])
    with_bos = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=WORDS[1], pad_token=WORDS[0])
    st = to_sentence_transformer(_wrapped(), with_bos, prompt=w(100) + " {text} " + w(101, 102), max_length=6)
    options = {"text": {"add_special_tokens": False, "padding_side": "left"}}
    alone = st[0].preprocess([w(5)], processing_kwargs=options)["input_ids"].tolist()
    beside = st[0].preprocess([w(*range(5, 13)), w(5)], processing_kwargs=options)["input_ids"].tolist()
    assert alone == [[100, 5, 101, 102]] and beside == [[100, 5, 6, 7, 101, 102], [0, 0, 100, 5, 101, 102]]
    features = st[0].preprocess([w(5)], prompt=w(20) + " ", processing_kwargs=options)
    assert features["prompt_length"] == 1  # the prompt's token, without the BOS these options leave out


def test_a_max_length_passed_to_preprocess_wins(tokenizer):
    """sentence-transformers' data collator passes the training arguments' max_length to preprocess, which its own
    Transformer honours over max_seq_length."""
    st = to_sentence_transformer(_wrapped(), tokenizer)
    assert st[0].preprocess([w(*range(5, 17))], max_length=6)["input_ids"].shape == (1, 6)
    assert st[0].preprocess([w(*range(5, 17))])["input_ids"].shape == (1, 12)
    with pytest.raises(ValueError, match="max_length=-1"):
        st[0].preprocess([w(5)], max_length=-1)
    with pytest.raises(ValueError, match="max_length=0: give the longest input"):  # was read as unset: 512
        st[0].preprocess([w(*range(5, 17))], max_length=0)
    assert st[0].preprocess([w(*range(5, 17))], max_length=None)["input_ids"].shape == (1, 12)


def test_truncation_pads_to_max_length_and_refuses_a_max_length_the_template_cannot_fit(tokenizer):
    st = to_sentence_transformer(_wrapped(), tokenizer, pooling="lasttoken", prompt=w(100) + " {text} " + w(101, 102))
    st.max_seq_length = 6
    options = {"text": {"padding": "max_length"}}  # the re-pad after keeping the template's end lost max_length
    features = st[0].preprocess([w(*range(5, 13)), w(5)], processing_kwargs=options)
    assert features["input_ids"].tolist() == [[100, 5, 6, 7, 101, 102], [100, 5, 101, 102, 0, 0]]
    for limit in (2, 3):  # the template's 2 tokens after {text} filled 2: the row came back whole, 11 tokens; at 3
        st.max_seq_length = limit  # every text was cut away and embedded as the template alone (train loss ln 8)
        with pytest.raises(ValueError, match=rf"max_length={limit} leaves no room for the text: .* take 3 tokens"):
            st[0].preprocess([w(*range(5, 13)), w(5)])
        with pytest.raises(ValueError, match=rf"max_length={limit} leaves no room"):  # any truncation strategy
            st[0].preprocess([w(*range(5, 13))], processing_kwargs={"text": {"truncation": "longest_first"}})
    st.max_seq_length = 4
    assert st[0].preprocess([w(*range(5, 13))])["input_ids"].tolist() == [[100, 5, 101, 102]]


def _counted(tokenizer, calls, *args, **kwargs):
    calls.append(args)
    return tokenizer(*args, **kwargs)


def test_pooling_without_the_prompt_leaves_the_encode_prompt_out(tokenizer):
    model = _wrapped()
    st = to_sentence_transformer(model, tokenizer, pooling="mean")
    st[1].include_prompt = False
    prompt, texts = w(20, 21) + " ", [w(5, 6, 7), w(8, 9)]
    got = st.encode(texts, prompt=prompt, convert_to_tensor=True)  # (2, C)

    batch = tokenizer([prompt + t for t in texts], padding=True, return_tensors="pt")
    with ubmoe_peft.use_mode(model, "bi"), torch.no_grad():
        hidden = model(**batch, output_hidden_states=True).hidden_states[-1]  # (2, T, C)
    mask = batch["attention_mask"].clone()
    mask[:, :2] = 0  # the two prompt tokens (right padding: the prompt starts every row)
    mask = mask.unsqueeze(-1).float()  # (2, T, 1)
    torch.testing.assert_close(got, (hidden * mask).sum(1) / mask.sum(1), rtol=1e-5, atol=1e-5)
    st[1].include_prompt = True
    assert not torch.allclose(st.encode(texts, prompt=prompt, convert_to_tensor=True), got, atol=1e-4)


def test_training_the_sentence_transformer_trains_the_experts(tokenizer):
    model = _wrapped()
    ubmoe_peft.set_stage(model, "contrastive")
    st = to_sentence_transformer(model, tokenizer)
    st.train()
    loss_fn = losses.MultipleNegativesRankingLoss(st)  # in-batch negatives, scale 20
    anchors, positives = [w(5, 6), w(7, 8, 9), w(10)], [w(5, 6, 11), w(7, 8), w(10, 12)]
    features = [st[0].preprocess(anchors), st[0].preprocess(positives)]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    loss = loss_fn(features, torch.empty(0))
    loss.backward()
    optimizer.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert moved and all("ubmoe_lora_" in n for n in moved)


def _checkpointed_grads(model, tokenizer, **checkpointing):
    """Gradients of one in-batch-negatives step through the SentenceTransformer; with ``checkpointing`` kwargs, under
    gradient checkpointing."""
    model.train()
    if checkpointing:
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    st = to_sentence_transformer(model, tokenizer)
    st.train()
    # Two batches of one width and different padding: the recompute of the first ran the mode-bi mask check against
    # the second's padding (a false "attention is causal" error).
    anchors, positives = [w(5, 6), w(7, 8, 9), w(10)], [w(5, 6, 11), w(7, 8), w(10, 12)]
    loss = losses.MultipleNegativesRankingLoss(st)([st[0].preprocess(anchors), st[0].preprocess(positives)], None)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("stage", [None, "contrastive"])
def test_gradient_checkpointing_recomputes_in_the_embedding_mode(tokenizer, reentrant, stage):
    """Checkpointing recomputes the layers during backward, after the encoder has restored the model's mode: a model
    left in mode moe crashed (non-reentrant) or got gradients of the wrong mode (reentrant); it was then refused.
    The recomputation now runs in the mode of its forward."""
    expected = _checkpointed_grads(_wrapped(), tokenizer)
    model = _wrapped()
    if stage is not None:
        ubmoe_peft.set_stage(model, stage)
    got = _checkpointed_grads(model, tokenizer, use_reentrant=reentrant)
    assert set(got) == set(expected) and all("ubmoe_lora_" in n for n in got)
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6)
    assert ubmoe_peft.get_mode(model) == ("moe" if stage is None else "bi")


def test_set_stage_on_the_sentence_transformer_stages_its_model(tokenizer):
    """A SentenceTransformer's `active_adapter` is a method (transformers' PEFT mixin): set_stage read it as the
    adapter's name."""
    for stage, mode in [("contrastive", "bi"), ("router", "moe")]:
        model, reference = _wrapped(), _wrapped()
        ubmoe_peft.set_stage(to_sentence_transformer(model, tokenizer), stage)
        ubmoe_peft.set_stage(reference, stage)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and trainable == {n for n, p in reference.named_parameters() if p.requires_grad}
        assert ubmoe_peft.get_mode(model) == mode


def test_unwrapped_model_is_refused(tokenizer):
    with pytest.raises(ValueError, match="no UBMoE layers.*merge_and_unload\\(target='bi'\\) is a plain"):
        to_sentence_transformer(tiny_model(), tokenizer)


def test_the_merged_embedding_model_embeds_the_same_through_sentence_transformers_alone(tokenizer, tmp_path):
    """The way the docs give for embedding a ``merge_and_unload(target="bi")`` model without ubmoe-peft. A plain
    ``Transformer(folder)`` gives a tokenizer with a chat template (every chat model's) the "message" modality:
    sentence-transformers then wraps each text in the chat template, and the embeddings differed by 2.1."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    tokenizer.chat_template = "{% for m in messages %}" + w(30, 31) + " {{ m['content'] }} {% endfor %}"
    model = _wrapped()
    texts = [w(5, 6, 7, 8), w(9, 10)]
    expected = to_sentence_transformer(model, tokenizer, prompt=None).encode(texts, convert_to_tensor=True)
    model.merge_and_unload(target="bi").save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    text = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}  # as in docs/usage.md
    module = Transformer(str(tmp_path), modality_config=text, module_output_name="token_embeddings")
    st = SentenceTransformer(modules=[module, Pooling(module.get_embedding_dimension(), "mean")], device="cpu")
    torch.testing.assert_close(st.encode(texts, convert_to_tensor=True), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["unload", "merge bi"])
def test_a_model_unloaded_in_place_refuses_to_embed_or_run(tokenizer, how):
    """unload() and the bi merge take the UBMoE layers out of the base in place. The SentenceTransformer made
    before embedded on, silently, with the causal base model (unload), and the spent PeftModel still reported mode
    moe while running as the returned model."""
    model = _wrapped()
    st = to_sentence_transformer(model, tokenizer)
    returned = model.unload() if how == "unload" else model.merge_and_unload(target="bi")
    with pytest.raises(ValueError, match=r"UBMoE layers were removed by unload\(\) or merge_and_unload"):
        st.encode([w(5, 6)])
    with pytest.raises(ValueError, match="Use the model that call returned"):
        ubmoe_peft.get_mode(model)
    with pytest.raises(ValueError, match="Use the model that call returned"):
        model(input_ids=torch.tensor([[5, 6]]))
    # a new encoder of the spent model names the cause (it said "wrap it first: peft.get_peft_model", refused)
    with pytest.raises(ValueError, match=r"UBMoE layers were removed by unload\(\) or merge_and_unload"):
        to_sentence_transformer(model, tokenizer)
    assert returned(input_ids=torch.tensor([[5, 6]])).logits.isfinite().all()  # the returned model runs


def test_a_saved_sentence_transformer_loads_back_with_all_its_settings(tokenizer, tmp_path):
    """The by-hand reload (PeftModel.from_pretrained, then to_sentence_transformer) lost what sentence-transformers
    saved: a default prompt, the similarity function, truncate_dim, the pooling's include_prompt, a Normalize module.
    Embeddings differed by 0.48 and had another size. Also an adapter that is not the default one."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

    from ubmoe_peft import load_sentence_transformer

    model = get_peft_model(tiny_model(), UBMoEConfig(), adapter_name="emb").eval()
    perturb_adapters(model, std=0.1)
    encoder = to_sentence_transformer(model, tokenizer, prompt=w(20) + " {text} " + w(21), max_length=24)[0]
    pooling = Pooling(encoder.get_embedding_dimension(), "mean", include_prompt=False)
    st = SentenceTransformer(
        modules=[encoder, pooling, Normalize()],
        prompts={"query": w(30) + " "},
        default_prompt_name="query",
        similarity_fn_name="dot",
        truncate_dim=16,
        device="cpu",
    )
    texts = [w(5, 6, 7), w(9)]
    expected = st.encode(texts, convert_to_tensor=True)
    st.save(str(tmp_path / "st"))
    loaded = load_sentence_transformer(tiny_model(), tmp_path / "st", device="cpu")
    torch.testing.assert_close(loaded.encode(texts, convert_to_tensor=True), expected, rtol=1e-5, atol=1e-5)
    assert expected.shape[-1] == 16 and loaded.similarity_fn_name == "dot" and loaded.default_prompt_name == "query"
    assert loaded[0].prompt == encoder.prompt and loaded[0].max_length == 24 and not loaded[1].include_prompt
    assert loaded[0].model.active_adapter == "emb" and ubmoe_peft.get_mode(loaded[0].model) == "moe"
    loaded.save(str(tmp_path / "again"))  # it saves as it was saved, and loads again
    again = load_sentence_transformer(tiny_model(), tmp_path / "again", device="cpu")
    torch.testing.assert_close(again.encode(texts, convert_to_tensor=True), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="already wrapped with UBMoE layers; pass the plain base model"):
        load_sentence_transformer(model, tmp_path / "st")
    with pytest.raises(TypeError, match="base must be the base model .* got str"):
        load_sentence_transformer(str(tmp_path), tmp_path / "st")
    with pytest.raises(ValueError, match="model_kwargs=.* load the base model with those settings"):
        load_sentence_transformer(tiny_model(), tmp_path / "st", model_kwargs={"dtype": "bfloat16"})
    model.save_pretrained(str(tmp_path / "st" / "ubmoe_adapter"))  # an earlier release's save: every adapter
    model.add_adapter("other", UBMoEConfig())
    model.save_pretrained(str(tmp_path / "st" / "ubmoe_adapter"), selected_adapters=["other"])
    base = tiny_model()
    with pytest.raises(FileNotFoundError, match=r"it holds \['emb', 'other'\]. A save by an earlier"):
        load_sentence_transformer(base, tmp_path / "st")
    assert not ubmoe_layers(base)  # the failed load left the base as it was
    SentenceTransformer(modules=[Pooling(8)], device="cpu").save(str(tmp_path / "plain"))
    with pytest.raises(ValueError, match="without a UBMoE encoder .* Load it with SentenceTransformer"):
        load_sentence_transformer(tiny_model(), tmp_path / "plain")


def test_embedding_in_threads_leaves_other_threads_in_the_models_mode(tokenizer):
    """One model serving embeddings and generation from several threads (a web server): each embedding call set the
    model to mode bi and back, so a forward in another thread ran in mode bi, and two overlapping calls left the model
    in mode bi for good (10 times in 10: every later generate ran bidirectional). With the mode-bi attention adapter,
    whose deltas ride on temporary hooks of the shared attention modules."""
    import threading

    model = get_peft_model(tiny_model(), UBMoEConfig(attention_r=4)).eval()
    perturb_adapters(model, std=0.1)
    st = to_sentence_transformer(model, tokenizer)
    texts = [w(5, 6, 7, 8), w(9, 10), w(11)]
    expected = st.encode(texts, convert_to_tensor=True)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        moe = model(input_ids=ids).logits
    wrong: list[str] = []
    embedding_done = threading.Event()

    def embed() -> None:
        for _ in range(10):
            if not torch.allclose(st.encode(texts, convert_to_tensor=True, batch_size=2), expected, atol=1e-5):
                wrong.append("embedding")

    def generate() -> None:
        while not embedding_done.is_set():
            with torch.no_grad():
                if not torch.allclose(model(input_ids=ids).logits, moe, atol=1e-5):
                    wrong.append("moe forward")

    embedders = [threading.Thread(target=embed) for _ in range(2)]
    generator = threading.Thread(target=generate)
    for thread in [*embedders, generator]:
        thread.start()
    for thread in embedders:
        thread.join()
    embedding_done.set()
    generator.join()
    assert wrong == []
    assert ubmoe_peft.get_mode(model) == "moe"


def _hold_inside_forward(model, worker):
    """Events that pause ``worker``'s next decoder forward once it holds the model's forward lock (a pre-hook on
    the first decoder layer): ``inside`` is set there, and it goes on when ``proceed`` is set."""
    import threading

    inside, proceed = threading.Event(), threading.Event()

    def pause(module, args):
        if threading.current_thread() is worker and not inside.is_set():
            inside.set()
            proceed.wait(10)

    model.base_model.model.model.layers[0].register_forward_pre_hook(pause)
    return inside, proceed


def test_generation_beside_an_embedding_thread_keeps_its_cache(tokenizer):
    """The generating thread released the forward lock before it tagged the prefill's KV cache with its mode: an
    embedding call that took the lock in between (mode bi) got the cache tagged 'bi', and the next decode step
    refused it ("This KV cache was filled in mode 'bi'"; 9 of 40 generate calls beside two embedding threads)."""
    import threading

    from ubmoe_peft.modes import mode_state

    model = get_peft_model(tiny_model(), UBMoEConfig()).eval()
    perturb_adapters(model, std=0.1)
    st = to_sentence_transformer(model, tokenizer)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    expected = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    worker = threading.Thread(target=lambda: st.encode([w(5, 6, 7)]))
    inside, proceed = _hold_inside_forward(model, worker)
    state = mode_state(model)
    release = state.end_forward

    def unlock_then_embed(failed: bool = False) -> None:  # the embedding thread takes the lock as the prefill ends
        release(failed)
        if threading.current_thread() is threading.main_thread() and not worker.is_alive() and not inside.is_set():
            worker.start()
            inside.wait(10)  # it holds the lock, in mode bi
            threading.Timer(0.3, proceed.set).start()

    state.end_forward = unlock_then_embed
    try:
        assert torch.equal(model.generate(input_ids=ids, max_new_tokens=3, do_sample=False), expected)
    finally:
        proceed.set()
        worker.join()
        del state.end_forward
    assert inside.is_set()  # the embedding ran between the prefill and the first decode step


def test_routing_read_during_another_threads_forward_is_the_last_whole_forward(tokenizer):
    """routing_stats read while another thread's mode-moe forward ran gave None or a dict of the layers done so far
    (18,631 None and 1,218 partial in 20,000 reads); track_routing counted a half-done forward's layers."""
    import threading

    model = get_peft_model(tiny_model(), UBMoEConfig()).eval()
    perturb_adapters(model, std=0.5)
    ids, mask = batch()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    expected = ubmoe_peft.routing_stats(model)
    worker = threading.Thread(target=lambda: model(input_ids=ids[:1, :4]))
    inside, proceed = _hold_inside_forward(model, worker)
    with torch.no_grad():
        worker.start()
        inside.wait(10)  # the worker's forward began (its routing is being filled), and waits
        reads: list = []
        reader = threading.Thread(target=lambda: reads.append(ubmoe_peft.routing_stats(model)))
        reader.start()
        reader.join(0.3)
        assert reads == []  # it waits for the running forward to end
        proceed.set()
        worker.join()
        reader.join()
    assert reads[0] is not None and set(reads[0]) == set(expected)  # that forward's, whole: every layer


def test_bad_arguments_and_inputs_are_named(tokenizer):
    model = _wrapped()
    with pytest.raises(TypeError, match="tokenizer must be a transformers tokenizer, got str 'model_dir'"):
        to_sentence_transformer(model, "model_dir")
    with pytest.raises(TypeError, match="model must be a UBMoE model .* got str 'model_dir'"):
        to_sentence_transformer("model_dir", tokenizer)
    for pooling in (None, [], ["mean", None]):  # sentence-transformers' own error was "'NoneType' is not iterable"
        with pytest.raises(ValueError, match=r"pooling=.* is not a pooling mode: give one of \['cls'"):
            to_sentence_transformer(model, tokenizer, pooling=pooling)
    with pytest.raises(ValueError, match="max_length=0: give the longest input in tokens"):
        to_sentence_transformer(model, tokenizer, max_length=0)
    with pytest.raises(ValueError, match="placeholder '{sentence}'"):
        to_sentence_transformer(model, tokenizer, prompt="Say {sentence}")
    st = to_sentence_transformer(model, tokenizer, prompt="{text} {")  # a lone brace is text, not a placeholder
    assert st[0].preprocess([w(5)])["input_ids"].shape[0] == 1
    with pytest.raises(TypeError, match="Text 1 to embed is NoneType None; this model embeds strings only"):
        st.encode([w(5), None])
    # A text that becomes no token (no special token, no template): alone it failed inside attention, in a batch it
    # was pooled from padding alone into a zero vector
    bare = to_sentence_transformer(model, tokenizer, prompt=None)
    for texts in ([""], [w(5), ""], [w(5, 6), "", w(7)]):
        with pytest.raises(ValueError, match=r"A text to embed, '', becomes no token at all.*a template"):
            bare.encode(texts, batch_size=2)
    assert bare.encode([w(5)]).shape[0] == 1
    assert st.encode([""]).shape[0] == 1  # a template gives it words
    assert bare.encode([""], prompt=w(9) + " ").shape[0] == 1  # and so does a prompt (pooled with it)
    with pytest.raises(TypeError, match="prompt"):  # not a bare AttributeError from reading "none"
        ubmoe_peft.ContrastiveConfig(output_dir="unused", prompt=5)
    grown = copy.deepcopy(tokenizer)
    grown.add_tokens(["added"])  # its id failed in encode with a bare IndexError
    with pytest.raises(ValueError, match="tokenizer has 129 tokens but the model's input embeddings have 128 rows"):
        to_sentence_transformer(model, grown)
    st.prompts = {"query": w(9) + " {text} " + w(10)}  # a prefix: it was embedded braces and all
    with pytest.raises(ValueError, match=r"prompt .* holds '\{text\}'.*to_sentence_transformer\(prompt=...\)"):
        st.encode_query([w(5)])


def test_save_writes_the_adapter_that_reproduces_the_embeddings(tokenizer, tmp_path):
    from peft import PeftModel

    model = _wrapped()
    st = to_sentence_transformer(model, tokenizer)
    texts = [w(5, 6, 7), w(9)]
    expected = st.encode(texts, convert_to_tensor=True)
    st.save(str(tmp_path))
    reloaded = PeftModel.from_pretrained(tiny_model(), tmp_path / "ubmoe_adapter").eval()
    again = to_sentence_transformer(reloaded, tokenizer).encode(texts, convert_to_tensor=True)
    assert torch.equal(again, expected)
    # sentence-transformers' own loader (and so its trainer's best-model restore) reaches our module's load: the
    # error it gets names the steps above and the trainer that does load checkpoints
    from sentence_transformers import SentenceTransformer

    with pytest.raises(NotImplementedError, match="(?s)load_sentence_transformer.*load_best_model_at_end keeps the "):
        SentenceTransformer(str(tmp_path), trust_remote_code=True)


def test_sentence_transformers_own_loader_refuses_an_adapter_folder(tokenizer, tmp_path):
    """SentenceTransformer(folder) of an adapter folder holding a tokenizer (a trainer checkpoint, or save_pretrained
    beside tokenizer.save_pretrained) loaded the adapter through transformers and embedded in mode moe, causal,
    silently; the ubmoe ways to build an encoder from that folder still work."""
    from peft import PeftModel
    from sentence_transformers import SentenceTransformer

    tiny_model().save_pretrained(tmp_path / "base")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), UBMoEConfig())
    model.save_pretrained(tmp_path / "adapter")
    tokenizer.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match="(?s)sentence-transformers' own model code.*mode 'moe'.*to_sentence_tr"):
        SentenceTransformer(str(tmp_path / "adapter"), device="cpu")
    tokenizer.save_pretrained(tmp_path / "base")
    plain = SentenceTransformer(str(tmp_path / "base"), device="cpu")
    with pytest.raises(ValueError, match="(?s)own model code.*load_adapter"):
        plain.load_adapter(str(tmp_path / "adapter"))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    st = to_sentence_transformer(loaded, tokenizer)
    st.save(str(tmp_path / "encoder"))
    again = load_sentence_transformer(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "encoder")
    assert torch.equal(again.encode([w(5, 6)], convert_to_tensor=True), st.encode([w(5, 6)], convert_to_tensor=True))


def test_a_save_that_fails_over_an_earlier_one_is_refused_at_load_not_mixed(tokenizer, tmp_path, monkeypatch):
    """st.save writes sentence-transformers' config, then the adapter, the tokenizer and the encoder's config, then
    the other modules (pooling, normalization) and the list of modules, each in place: failing anywhere over an earlier
    save loaded a mix (the new weights under the old prompt, or under the old pooling; the old weights with the new
    truncate_dim). A re-save under another adapter name kept both adapters (no longer loadable); a damaged config was
    a bare JSONDecodeError."""
    from sentence_transformers.models import Normalize

    from ubmoe_peft.io import UBMoEFileError

    old = to_sentence_transformer(_wrapped(), tokenizer, prompt="Old {text} prompt", max_length=128)
    old.save(str(tmp_path))
    other = _wrapped()
    perturb_adapters(other, std=0.1, seed=2)  # other weights
    new = to_sentence_transformer(other, tokenizer, prompt="New: ", max_length=64)
    new.append(Normalize())
    new.truncate_dim = 8

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    for owner, method in ((PeftModel, "save_pretrained"), (type(new[0]), "save_tokenizer"), (Normalize, "save")):
        monkeypatch.setattr(owner, method, full)
        with pytest.raises(OSError, match="No space"):
            new.save(str(tmp_path))
        monkeypatch.undo()
        with pytest.raises(UBMoEFileError, match="no modules.json: st.save into it was cut short.*Save the encoder"):
            load_sentence_transformer(tiny_model(), tmp_path)
    new.save(str(tmp_path))  # saved whole: loads
    again = load_sentence_transformer(tiny_model(), tmp_path)
    assert again[0].prompt == "New: " and (again.encode([w(5)]) == new.encode([w(5)])).all()
    old.save(str(tmp_path / "old"))  # an adapter folder copied in from another save
    adapter = tmp_path / "ubmoe_adapter"
    shutil.copytree(tmp_path / "old" / "ubmoe_adapter", adapter, dirs_exist_ok=True)
    with pytest.raises(UBMoEFileError, match="mixes two saves: its config.json .* Save the encoder again"):
        load_sentence_transformer(tiny_model(), tmp_path)
    new.save(str(tmp_path))

    renamed = get_peft_model(tiny_model(), UBMoEConfig(), adapter_name="emb").eval()
    perturb_adapters(renamed, std=0.1)
    emb = to_sentence_transformer(renamed, tokenizer)
    emb.save(str(tmp_path))  # over the "default" save: only "emb" remains
    assert sorted(p.name for p in (tmp_path / "ubmoe_adapter").iterdir()) == ["README.md", "emb"]
    assert (load_sentence_transformer(tiny_model(), tmp_path).encode([w(5)]) == emb.encode([w(5)])).all()
    (tmp_path / "config.json").unlink()  # its defaults loaded silently: no prompt, 512 tokens
    with pytest.raises(UBMoEFileError, match="has no config.json, the encoder's prompt"):
        load_sentence_transformer(tiny_model(), tmp_path)
    (tmp_path / "config.json").write_text('{"prompt": "a')  # truncated
    with pytest.raises(UBMoEFileError, match="config.json is not a readable JSON file"):
        load_sentence_transformer(tiny_model(), tmp_path)


def test_a_tokenizer_without_a_pad_token_or_attention_mask_embeds_and_stays_as_given(tokenizer):
    """The wrapper set the caller's own tokenizer's pad token (lasting beyond the call: a collator masking pad ids
    would never train the end-of-text token), attention_dependence failed on it ("Asking to pad"), and a tokenizer
    whose model_input_names lack attention_mask gave a bare KeyError in both."""
    from ubmoe_peft import attention_dependence

    model = _wrapped()
    texts = [w(5, 6, 7, 8), w(9, 10)]
    expected = to_sentence_transformer(model, tokenizer).encode(texts, convert_to_tensor=True)
    bare = copy.deepcopy(tokenizer)
    bare.pad_token = None
    bare.model_input_names = ["input_ids"]
    st = to_sentence_transformer(model, bare)
    torch.testing.assert_close(st.encode(texts, convert_to_tensor=True), expected, rtol=1e-5, atol=1e-6)
    assert bare.pad_token is None and st.tokenizer.pad_token == bare.eos_token
    result = attention_dependence(model, bare, texts, mode="bi").average
    assert result == pytest.approx(attention_dependence(model, tokenizer, texts, mode="bi").average)

    class Uncopyable(type(bare)):  # a custom (Python) pre-tokenizer: "Custom PreTokenizer cannot be serialized"
        def __deepcopy__(self, memo):
            raise Exception("Custom PreTokenizer cannot be serialized")

    uncopyable = copy.copy(bare)
    uncopyable.__class__ = Uncopyable
    st = to_sentence_transformer(model, uncopyable)
    torch.testing.assert_close(st.encode(texts, convert_to_tensor=True), expected, rtol=1e-5, atol=1e-6)
    assert uncopyable.pad_token is None and bare.pad_token is None
    bare.eos_token = None
    with pytest.raises(ValueError, match="neither a pad token nor an end-of-text token"):
        to_sentence_transformer(model, bare)


def test_added_tokens_embed_and_reload_with_the_resized_rows_in_modules_to_save(tokenizer, tmp_path):
    """The way the refusal of a tokenizer larger than the embeddings names: resize, and keep the new rows with
    modules_to_save, which st.save writes with the adapter."""
    grown = copy.deepcopy(tokenizer)
    grown.add_tokens(["added"])
    base = tiny_model()
    base.resize_token_embeddings(len(grown))
    model = get_peft_model(base, UBMoEConfig(modules_to_save=["embed_tokens", "lm_head"]))
    perturb_adapters(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".modules_to_save." in name:
                param.mul_(1.5)
    st = to_sentence_transformer(model, grown)
    texts = [w(5) + " added " + w(6)]
    expected = st.encode(texts, convert_to_tensor=True)
    st.save(str(tmp_path))
    fresh = tiny_model()
    fresh.resize_token_embeddings(len(grown))
    reloaded = load_sentence_transformer(fresh, str(tmp_path))
    torch.testing.assert_close(reloaded.encode(texts, convert_to_tensor=True), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inner", ["base_model", "base_model.model"])
def test_an_encoder_of_a_module_inside_the_peft_model_is_refused_before_anything_is_saved(tokenizer, tmp_path, inner):
    """The tuner (model.base_model) and the transformers model (model.base_model.model) embed as the PeftModel does,
    but st.save called their own save_pretrained: the whole base model went into ubmoe_adapter/, then the save failed
    saying that folder held no adapter."""
    from ubmoe_peft.embedding import sentence_transformer_of

    model = _wrapped()
    module = model.base_model if inner == "base_model" else model.base_model.model
    with pytest.raises(ValueError, match=r"a module inside the wrapped model .* is not the PeftModel: .* from the Pe"):
        to_sentence_transformer(module, tokenizer)
    st = sentence_transformer_of(module, tokenizer)  # sts_spearman's: it embeds, and never saves
    texts = [w(5, 6, 7), w(9)]
    expected = to_sentence_transformer(model, tokenizer).encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(st.encode(texts, convert_to_tensor=True), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="a save of the encoder would write the whole base model"):
        st.save(str(tmp_path / "st"))
    # refused before the encoder wrote anything (sentence-transformers writes its own settings file first)
    assert sorted(p.name for p in (tmp_path / "st").iterdir()) == ["config_sentence_transformers.json"]
    again = to_sentence_transformer(to_sentence_transformer(model, tokenizer), tokenizer)  # a SentenceTransformer:
    assert again[0].model is model  # its PeftModel, as the mode functions take it


def test_loading_an_adapter_folder_or_a_missing_one_as_a_sentence_transformer_is_named(tokenizer, tmp_path):
    """An adapter folder (model.save_pretrained's, or st.save's own ubmoe_adapter/), None or a missing local path went
    on to the Hub and failed with "We couldn't connect to 'https://huggingface.co'"."""
    model = _wrapped()
    to_sentence_transformer(model, tokenizer).save(str(tmp_path / "st"))
    model.save_pretrained(str(tmp_path / "adapter"))
    base = tiny_model()
    with pytest.raises(ValueError, match=r"holds an adapter \(adapter_config.json\), .* st.save wrote\. .*PeftModel"):
        load_sentence_transformer(base, tmp_path / "adapter")
    with pytest.raises(ValueError, match=rf"holds an adapter .* pass '{tmp_path / 'st'}', the folder st.save"):
        load_sentence_transformer(base, tmp_path / "st" / "ubmoe_adapter")
    with pytest.raises(TypeError, match="folder must be the folder st.save\(folder\) wrote .* got NoneType None"):
        load_sentence_transformer(base, None)
    with pytest.raises(FileNotFoundError, match="missing' does not exist; pass the folder st.save"):
        load_sentence_transformer(base, tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="holds no modules.json"):
        load_sentence_transformer(base, tmp_path / "st" / "1_Pooling")
    assert not ubmoe_layers(base)  # left as it was
    assert load_sentence_transformer(base, tmp_path / "st").encode([w(5, 6)]).shape[0] == 1
