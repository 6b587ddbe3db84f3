"""mteb on a local STS task (no hub) through the SentenceTransformer wrapper: the scores `st.encode` gives."""

from __future__ import annotations

import mteb  # the `eval` extra (in `all`)
import numpy as np
import pytest
from conftest import perturb_adapters, tiny_model, w
from peft import get_peft_model
from scipy.stats import spearmanr

from ubmoe_peft import UBMoEConfig, get_mode, set_mode, to_sentence_transformer


def _task(query_document: bool):
    from datasets import Dataset, DatasetDict
    from mteb.abstasks.sts import AbsTaskSTS
    from mteb.abstasks.task_metadata import TaskMetadata
    from mteb.types import PromptType

    first = [w(i, i + 1, i + 2) for i in range(5, 45)]
    second = [w(i + 1, i + 7, i + 3, i + 9) for i in range(5, 45)]
    gold = [float((i * 7) % 11) / 2 for i in range(40)]
    metadata = TaskMetadata(
        name="STSBenchmark",  # a registered name: mteb applies prompts keyed by task name only to those it knows
        dataset={"path": "local/sts", "revision": "1"}, description="local", reference=None, type="STS",
        category="t2t", modalities=["text"], eval_splits=["test"], eval_langs=["eng-Latn"],
        main_score="cosine_spearman", date=("2012-01-01", "2017-12-31"), domains=["News"], task_subtypes=[],
        license="cc-by-sa-4.0", annotations_creators="human-annotated", dialect=[], sample_creation="found",
        bibtex_citation="",
    )  # fmt: skip

    class LocalSTS(AbsTaskSTS):
        min_score, max_score = 0, 5
        input1_prompt_type = PromptType.query if query_document else None
        input2_prompt_type = PromptType.document if query_document else None

        def load_data(self, **kwargs):
            rows = {"sentence1": first, "sentence2": second, "score": gold}
            self.dataset = DatasetDict({"test": Dataset.from_dict(rows)})
            self.data_loaded = True

    LocalSTS.metadata = metadata
    return LocalSTS(), first, second, gold


def _by_hand(one: np.ndarray, two: np.ndarray, gold: list[float]) -> float:
    cosine = (one * two).sum(1) / np.linalg.norm(one, axis=1) / np.linalg.norm(two, axis=1)
    return spearmanr(cosine, gold).statistic


@pytest.mark.parametrize("query_document", [False, True])
def test_mteb_scores_are_those_of_encode_with_prompts_and_mode_bi(tokenizer, monkeypatch, query_document):
    """mteb picks a prompt by task name, then by query / document (an asymmetric task goes through encode_query and
    encode_document), and embeds in mode bi whatever mode the model was left in."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = get_peft_model(tiny_model(), UBMoEConfig())
    perturb_adapters(model, std=0.3)
    st = to_sentence_transformer(model, tokenizer, prompt=w(100) + " {text} " + w(101))
    task, first, second, gold = _task(query_document)

    def score() -> float:
        result = mteb.evaluate(st, task, cache=None, show_progress_bar=False, encode_kwargs={"batch_size": 8})
        return result.task_results[0].scores["test"][0]["cosine_spearman"]

    set_mode(model, "moe")
    st.prompts = {"query": w(110) + " ", "document": w(111) + " ", "STSBenchmark": w(112) + " "}
    by_name = score()
    assert get_mode(model) == "moe"
    named = st.encode(first, prompt_name="STSBenchmark"), st.encode(second, prompt_name="STSBenchmark")
    assert by_name == pytest.approx(_by_hand(*named, gold), abs=1e-6)
    st.prompts = {"query": w(110) + " ", "document": w(111) + " "}
    by_type = score()
    typed = (st.encode_query(first), st.encode_document(second)) if query_document else None
    plain = st.encode(first), st.encode(second)
    assert by_type == pytest.approx(_by_hand(*(typed or plain), gold), abs=1e-6)
    if query_document:  # the two prompts made a difference
        assert _by_hand(*typed, gold) != pytest.approx(_by_hand(*plain, gold), abs=1e-6)
