"""`to_sentence_transformer`: a SentenceTransformer that embeds with a UBMoE model in mode ``"bi"``.

sentence-transformers' own `Transformer` module loads a model by name; ours must wrap an already wrapped PEFT model
and switch it to mode bi around every forward, so it is a small `InputModule` of our own. Pooling, normalisation,
`encode`, losses and the trainer all stay sentence-transformers'.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from ._extras import require
from .architectures import backbone, text_config
from .evaluation import check_tokenizer, encoder_model, with_pad_token
from .io import UBMoEFileError, _looks_local, read_json_config
from .modes import forward_in_mode, mode_state, ubmoe_layers
from .tuners.ubmoe.model import UBMoEModel
from .tuners.ubmoe.state import MODES

# ruff: noqa: E402 (the imports below need the optional extra, named first)
require(
    "the sentence-transformers wrapper (to_sentence_transformer, load_sentence_transformer, sts_spearman)",
    "train",
    "sentence_transformers",
)
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules.input_module import InputModule
from sentence_transformers.sentence_transformer.modules import Pooling


def prompt_or_none(prompt: str | None) -> str | None:
    """``prompt``, or None for the command line's spellings of "no prompt" ("none", "None", ""), alike in every
    command (eval-sts embedded "None" before each text where train-contrastive read no prompt)."""
    return None if isinstance(prompt, str) and prompt.lower() in ("", "none") else prompt  # other types: check_prompt


def check_prompt(prompt: str | None) -> None:
    """An embedding prompt has at most one ``{text}`` and no other placeholder (``{sentence}``, ``{}``: a typo that
    would leave the braces in every text and append the text at the end)."""
    if prompt is None:
        return
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string or None, got {type(prompt).__name__} {prompt!r}.")
    if prompt.count("{text}") > 1:
        raise ValueError(f"prompt={prompt!r} has more than one '{{text}}' placeholder; use at most one.")
    others = [p for p in re.findall(r"\{[^{}]*\}", prompt) if p != "{text}"]
    if others:
        raise ValueError(
            f"prompt={prompt!r} has the placeholder {others[0]!r}; the text's placeholder is '{{text}}' "
            "(without one, the text is appended)."
        )


def check_pooling(pooling: Any) -> None:
    """``pooling`` is a sentence-transformers pooling mode or a list of them; checked before a model loads (the
    command line) and before sentence-transformers' Pooling, which fails on None or [] with "'NoneType' object is not
    iterable"."""
    modes = [pooling] if isinstance(pooling, str) else pooling
    known = list(Pooling.POOLING_MODES)
    if not isinstance(modes, (list, tuple)) or not modes or not all(isinstance(m, str) and m in known for m in modes):
        raise ValueError(f"pooling={pooling!r} is not a pooling mode: give one of {known} (or a list of them).")


_CUTS_THE_TEXT = ("longest_first", "only_first")  # truncation strategies that cut a single sequence, as True does
# tokenizer options of a whole batch; the others (add_special_tokens...) say how each text is tokenized
_BATCH_OPTIONS = ("padding", "truncation", "max_length", "pad_to_multiple_of", "padding_side", "return_tensors")


def _per_text(options: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer options that say how each text is tokenized (not `_BATCH_OPTIONS`)."""
    return {k: v for k, v in options.items() if k not in _BATCH_OPTIONS}


class UBMoEEncoder(InputModule):
    """Tokenizes (optionally inside a ``{text}`` template) and returns token embeddings in ``mode`` (bi)."""

    config_keys = ["prompt", "max_length", "mode"]

    def __init__(
        self, model: nn.Module, tokenizer: Any, prompt: str | None = None, max_length: int = 512, mode: str = "bi"
    ) -> None:
        super().__init__()
        check_prompt(prompt)
        _check_max_length(max_length)
        if mode not in MODES:
            raise ValueError(f"Unknown mode {mode!r}: use one of {list(MODES)} ('bi' for embeddings).")
        self.mode = mode
        self.model = model  # registered as a child: ST training updates the expert parameters in place
        self.tokenizer = with_pad_token(tokenizer)
        try:
            embeddings = model.get_input_embeddings()
        except (AttributeError, NotImplementedError):  # UBMoE never needs it: no check then
            embeddings = None
        rows = getattr(embeddings, "num_embeddings", None)
        if isinstance(rows, int) and len(self.tokenizer) > rows:  # the added tokens' ids failed in encode: IndexError
            raise ValueError(
                f"The tokenizer has {len(self.tokenizer)} tokens but the model's input embeddings have {rows} rows: "
                "tokens were added to the tokenizer and the model was not resized (or was saved resized and loaded "
                "onto a base that is not). Call base.resize_token_embeddings(len(tokenizer)) before wrapping and "
                "loading, and train or save the new rows with UBMoEConfig(modules_to_save=['embed_tokens', "
                "'lm_head'])."
            )
        self.prompt = prompt
        self.max_length = max_length

    @property
    def max_seq_length(self) -> int:
        """sentence-transformers' name for ``max_length``: ``SentenceTransformer.max_seq_length`` reads and sets it."""
        return self.max_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        _check_max_length(value)
        self.max_length = value

    def _apply_prompt(self, text: str) -> str:
        if self.prompt is None:
            return text
        return self.prompt.replace("{text}", text) if "{text}" in self.prompt else self.prompt + text

    def preprocess(
        self,
        inputs: Sequence[str],
        prompt: str | None = None,
        processing_kwargs: dict[str, dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Tokenized ``prompt + template(text)`` for each text. As sentence-transformers' ``Transformer`` does:
        ``processing_kwargs`` ("text" or "common" tokenizer options) override the defaults per call, and a ``prompt``
        sets ``prompt_length``, which a ``Pooling(include_prompt=False)`` leaves out of the pooled span (the
        template's own words stay in it). A ``max_length`` (sentence-transformers' data collator passes the training
        arguments' one) wins over ``max_seq_length``, as in ``Transformer``. Other ``kwargs`` (``task``) select
        nothing here: this model has one input route."""
        wrong = [(i, t) for i, t in enumerate(inputs) if not isinstance(t, str)]
        if wrong:  # str(None) would be embedded as the text "None"
            i, value = wrong[0]
            raise TypeError(f"Text {i} to embed is {type(value).__name__} {value!r}; this model embeds strings only.")
        if prompt and "{text}" in prompt:  # it was embedded as written, braces and all, before the template
            raise ValueError(
                f"The sentence-transformers prompt {prompt!r} holds '{{text}}', but such prompts are prefixes put "
                "before the text: a template with '{text}' in it belongs in to_sentence_transformer(prompt=...). "
                "Drop '{text}' from the prompt (st.prompts / encode(prompt=...))."
            )
        max_length = kwargs.get("max_length")
        if max_length is None:  # only None is unset: max_length=0 used to fall back to the default silently
            max_length = self.max_length
        _check_max_length(max_length)
        options: dict[str, Any] = {"padding": True, "truncation": True, "max_length": max_length}
        options["return_attention_mask"] = True  # also where the tokenizer's model_input_names lack it
        for modality, values in (processing_kwargs or {}).items():
            if modality not in ("text", "common") or not isinstance(values, dict):
                raise ValueError(
                    f"processing_kwargs[{modality!r}] = {values!r}: this model embeds text only; pass tokenizer "
                    "options as processing_kwargs={'text': {...}} (or 'common')."
                )
            options.update(values)
        texts = [(prompt or "") + self._apply_prompt(t) for t in inputs]
        features = self._tokenize(texts, options, (prompt or "") + self._apply_prompt(""))
        empty = [i for i, row in enumerate(features["attention_mask"]) if not row.any()]
        if empty:  # alone it failed inside attention; in a batch it pooled an all-padding row into a zero vector
            raise ValueError(  # sentence-transformers sorts a batch by length: name the text, not an index
                f"A text to embed, {inputs[empty[0]]!r}, becomes no token at all (no special token, prompt or "
                "template adds any), so there is nothing to embed. Leave out empty texts, or set a template with "
                "'{text}' in it."
            )
        if prompt:
            features["prompt_length"] = self._prompt_length(prompt, options)
        return features

    def _tokenize(self, texts: list[str], options: dict[str, Any], frame: str) -> dict[str, Any]:
        """The tokenizer's batch, except that a row over ``max_length`` keeps the end of the template (the paper's
        ``is:"``, which last-token pooling reads) and loses the end of its text instead: right truncation used to cut
        the template's words after ``{text}``. ``frame``: the prompt and template around an empty text. The caller's
        per-text options (``add_special_tokens``...) apply to every tokenization here: a row cut here lost them, so a
        text embedded otherwise beside an over-long one."""
        features = dict(self.tokenizer(texts, return_tensors="pt", **options))
        limit = options.get("max_length")
        if options.get("truncation") in (None, False, "do_not_truncate") or not isinstance(limit, int):
            return features
        mask = features.get("attention_mask")
        if mask is not None and int(mask.sum(-1).max()) < limit:  # no row reached the limit: none was cut
            return features
        per_text = _per_text(options)
        frame_length = len(self.tokenizer(frame, **per_text)["input_ids"])
        if frame_length >= limit:  # truncation kept the frame alone: every text was embedded as the same one
            raise ValueError(
                f"max_length={limit} leaves no room for the text: the prompt and template around it ({frame!r} for "
                f"an empty text) take {frame_length} tokens. Raise max_length above {frame_length} (or shorten the "
                "prompt)."
            )
        suffix = self.prompt.split("{text}", 1)[1] if self.prompt and "{text}" in self.prompt else ""
        truncation = options.get("truncation")  # True, or a strategy by name or as transformers' enum
        cuts_the_text = truncation is True or getattr(truncation, "value", truncation) in _CUTS_THE_TEXT
        if not suffix.strip() or not cuts_the_text:
            return features
        offsets = bool(getattr(self.tokenizer, "is_fast", False))
        full = self.tokenizer(texts, return_offsets_mapping=offsets, **per_text)  # only a batch with a row at the limit
        if all(len(ids) <= limit for ids in full["input_ids"]):
            return features
        rows = []
        for i, ids in enumerate(full["input_ids"]):
            if len(ids) <= limit:
                rows.append(ids)
                continue
            if offsets:
                keep = self._end_in_context(full["offset_mapping"][i], len(texts[i]) - len(suffix))
            else:
                keep = self._end_alone(ids, suffix)
            if keep >= limit:  # returned whole, the row was longer than max_length
                raise ValueError(
                    f"max_length={limit} cannot hold the end of prompt={self.prompt!r}: the text after '{{text}}' "
                    f"and the closing special tokens take {keep} tokens, which leaves no room for the text. Raise "
                    f"max_length above {keep} (or shorten the prompt's end)."
                )
            rows.append(ids[: limit - keep] + ids[len(ids) - keep :])
        padding = {k: v for k, v in options.items() if k in ("padding", "pad_to_multiple_of", "padding_side")}
        if padding.get("padding") == "max_length":  # else the tokenizer warns that it ignores max_length
            padding["max_length"] = limit
        return dict(self.tokenizer.pad({"input_ids": rows}, return_tensors="pt", return_attention_mask=True, **padding))

    @staticmethod
    def _end_in_context(offsets: list[tuple[int, int]], start: int) -> int:
        """Tokens from the first one that reaches into the template's end (character ``start`` on) to the row's end,
        closing special tokens included, as the row's own offsets say. Tokenized alone, the end could count other
        tokens than it takes in the row (a SentencePiece dummy prefix, a merge across the text's end), and the row
        then kept a token of its text's cut-off end."""
        first = next((j for j, (a, b) in enumerate(offsets) if b > max(a, start)), len(offsets))
        return len(offsets) - first

    def _end_alone(self, ids: list[int], suffix: str) -> int:
        """`_end_in_context` for a tokenizer without offsets: the template's end tokenized alone, and the row's
        closing special tokens."""
        specials = set(self.tokenizer.all_special_ids)
        suffix_ids = self.tokenizer(suffix, add_special_tokens=False)["input_ids"]
        tail = len(suffix_ids)
        # the template's own closing special tokens (`<|im_end|>`), which `tail` holds already: counted twice, they
        # kept a token of the text's cut-off end before the template's end
        own = next((i for i, t in enumerate(reversed(suffix_ids)) if t not in specials), tail)
        end = next(i for i in range(len(ids), -1, -1) if i == 0 or ids[i - 1] not in specials)  # before EOS etc.
        return tail + max(0, len(ids) - end - own)

    def _prompt_length(self, prompt: str, options: dict[str, Any]) -> int:
        """Tokens of ``prompt`` at the start of an input (a leading special token included, a trailing one not)."""
        ids = self.tokenizer(prompt, **_per_text(options))["input_ids"]
        return len(ids) - (1 if ids and ids[-1] in self.tokenizer.all_special_ids else 0)

    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        # The switch to mode bi and back happens while this thread holds the model's forward lock: a thread that
        # generates meanwhile waits for its next forward instead of running it in mode bi (ModeState)
        with forward_in_mode(self.model, self.mode):
            out = backbone(self.model)(input_ids=features["input_ids"], attention_mask=features["attention_mask"])
        features["token_embeddings"] = out.last_hidden_state  # (B, T, C)
        return features

    def get_embedding_dimension(self) -> int:
        return text_config(backbone(self.model)).hidden_size  # a multimodal config holds it in its text config

    def save(self, output_path: str, *args: Any, safe_serialization: bool = True, **kwargs: Any) -> None:
        """Saves the adapter that embeds (the active one; not the base model), the tokenizer and this module's
        config. The adapter folder is written beside the old one and swapped in whole (a re-save under another
        adapter name kept both, and the folder no longer loaded); the config goes last, atomically, with a digest of
        the adapter's weights, so that a folder mixing two saves is refused at load (it loaded as the new weights
        under the old prompt)."""
        from .io import atomic_folder, atomic_write_text

        _check_saves_the_adapter(self.model, "The encoder's save")  # before anything is written
        # sentence-transformers writes config_sentence_transformers.json before this module and the later modules
        # (Pooling, Normalize...) and modules.json after it, each in place: a save that failed part-way over an
        # earlier one loaded mixed (new adapter under the old pooling, old adapter under the new prompts and
        # truncate_dim). Without modules.json until the whole save has succeeded, such a folder is refused at load.
        (Path(output_path) / "modules.json").unlink(missing_ok=True)
        active = getattr(self.model, "active_adapter", None)
        selected = {"selected_adapters": [active]} if isinstance(active, str) else {}
        with atomic_folder(Path(output_path) / ADAPTER_FOLDER, replace=True) as staged:
            self.model.save_pretrained(staged, **selected)
        self.save_tokenizer(output_path)
        settings = {**self.get_config_dict(), DIGEST_KEY: _weights_digest(Path(output_path))}
        atomic_write_text(Path(output_path) / self.config_file_name, json.dumps(settings, indent=4))

    # The base model a `load_sentence_transformer` call loads the adapter onto (set on a subclass made per call).
    _load_onto: nn.Module | None = None

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", **kwargs: Any) -> UBMoEEncoder:
        """The encoder `save` wrote, on the base model of `load_sentence_transformer` (no other caller has one)."""
        if cls._load_onto is not None:
            from peft import PeftModel
            from transformers import AutoTokenizer

            hub = {k: kwargs[k] for k in ("token", "cache_folder", "revision", "local_files_only") if k in kwargs}
            folder = Path(cls.load_dir_path(model_name_or_path, subfolder=subfolder, **hub))
            if not (folder / cls.config_file_name).is_file():  # its defaults loaded silently: no prompt, 512 tokens
                raise UBMoEFileError(
                    f"{str(folder)!r} has no {cls.config_file_name}, the encoder's prompt, max_length and mode that "
                    "st.save writes: the save was cut short or the file removed. Save the encoder again."
                )
            settings = read_json_config(folder / cls.config_file_name)  # a damaged file is named
            adapter, name = _saved_adapter(folder / ADAPTER_FOLDER)
            if DIGEST_KEY in settings and settings[DIGEST_KEY] != _weights_digest(folder):  # older saves have none
                raise UBMoEFileError(
                    f"{str(folder)!r} mixes two saves: its {cls.config_file_name} (prompt, max_length, mode) was "
                    f"written with other adapter weights than {ADAPTER_FOLDER} holds, as a save that failed part-way "
                    "over an earlier one leaves it. Save the encoder again (st.save(folder))."
                )
            tokenizer = AutoTokenizer.from_pretrained(str(folder))  # first: a failure leaves the base unwrapped
            model = PeftModel.from_pretrained(cls._load_onto, str(adapter), adapter_name=name)
            return UBMoEEncoder(model, tokenizer, **{k: settings[k] for k in cls.config_keys if k in settings})
        raise NotImplementedError(
            "A saved UBMoE SentenceTransformer holds only the adapter. Load the base model, then "
            "ubmoe_peft.load_sentence_transformer(base, '<folder>'), which loads the adapter onto it and restores "
            "the rest. sentence-transformers' own "
            "trainer cannot load such a checkpoint, so with it load_best_model_at_end keeps the last weights and "
            "resume_from_checkpoint fails: train with ubmoe_peft.ContrastiveTrainer, which takes any "
            "sentence-transformers loss (loss=...) and loads its checkpoints."
        )


def not_the_peft_model(model: nn.Module, caller: str) -> str | None:
    """What ``model`` is, when it holds UBMoE layers but is not the PeftModel whose ``save_pretrained`` writes the
    adapter: a module inside it (the tuner, ``model.base_model``, or the transformers model,
    ``model.base_model.model``), whose save is transformers' own (it wrote the whole base model where the adapter
    belongs, then failed naming a missing adapter). The PeftModel compiled by ``torch.compile`` is refused here."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        return None
    if isinstance(getattr(model, "_orig_mod", None), PeftModel):
        raise ValueError(
            f"{caller} got {type(model).__name__}, the PeftModel compiled by torch.compile; it takes the PeftModel "
            "itself (model._orig_mod), whose save_pretrained writes the adapter."
        )
    return f"{type(model).__name__}, a module inside the wrapped model (model.base_model or model.base_model.model)"


def _check_saves_the_adapter(model: nn.Module, caller: str) -> None:
    what = not_the_peft_model(model, caller)
    if what:
        raise ValueError(
            f"{what} is not the PeftModel: it embeds alike, but a save of the encoder would write the "
            "whole base model instead of the adapter. Build the encoder from the PeftModel that peft.get_peft_model "
            "or PeftModel.from_pretrained returned: to_sentence_transformer(model, tokenizer)."
        )


ADAPTER_FOLDER = "ubmoe_adapter"  # the saved encoder's adapter, inside the SentenceTransformer folder
DIGEST_KEY = "adapter_sha256"  # the encoder config's record of the adapter weights it was saved with


def _weights_digest(folder: Path) -> str:
    """SHA-256 of the weights of the adapter saved in ``folder``'s adapter folder."""
    import hashlib

    from .io import WEIGHTS_NAME

    digest = hashlib.sha256()
    with open(_saved_adapter(folder / ADAPTER_FOLDER)[0] / WEIGHTS_NAME, "rb") as weights:
        for block in iter(lambda: weights.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _saved_adapter(folder: Path) -> tuple[Path, str]:
    """The adapter `UBMoEEncoder.save` wrote into ``folder`` and its name: ``default`` at the top, another name in a
    subfolder of its own (as PEFT's `save_pretrained` lays them out)."""
    top = (folder / "adapter_config.json").is_file()
    named = sorted(p.parent for p in folder.glob("*/adapter_config.json")) if folder.is_dir() else []
    if top + len(named) != 1:
        found = (["default"] if top else []) + [p.name for p in named]
        raise FileNotFoundError(
            f"{str(folder)!r} should hold the one adapter a UBMoE SentenceTransformer saves (the one that embeds: "
            f"adapter_config.json at the top, or in a subfolder named after the adapter); it holds {found or 'none'}"
            ". A save by an earlier ubmoe-peft holds every adapter of the model and not which one embedded: load "
            "that one with PeftModel.from_pretrained and rebuild with to_sentence_transformer."
        )
    return (folder, "default") if top else (named[0], named[0].name)


def load_sentence_transformer(base: nn.Module, folder: str | Path, **kwargs: Any) -> SentenceTransformer:
    """What ``st.save(folder)`` wrote for a `to_sentence_transformer` model, loaded back onto ``base``.

    ``base`` is the base model the adapter was trained on, loaded as it was then (not wrapped). The adapter that
    embedded is loaded onto it (`PeftModel.from_pretrained`), with the saved tokenizer, prompt template,
    ``max_length`` and mode; sentence-transformers restores everything it saved around them: the pooling and its
    options, modules after it (``Normalize``, ``Dense``), ``prompts``, ``default_prompt_name``,
    ``similarity_fn_name`` and ``truncate_dim``. ``kwargs`` go to `SentenceTransformer` (``device``, ...).

    Why not ``SentenceTransformer(folder)``: it imports each saved module's class by name and calls its ``load`` with
    the folder alone, and a UBMoE folder holds no base model. sentence-transformers' ``_load_with_module_classes``
    (what its own trainer uses to reload a model whose modules it already has) takes the classes to use instead, so
    the encoder's class is handed over with the base attached. That method is private: a sentence-transformers
    release without it is named, with the steps to follow by hand.
    """
    if not isinstance(base, nn.Module):
        raise TypeError(f"base must be the base model (a torch module), got {type(base).__name__} {str(base)[:60]!r}.")
    if ubmoe_layers(base):
        raise ValueError(
            f"base ({type(base).__name__}) is already wrapped with UBMoE layers; pass the plain base model (loaded as "
            "for training): the saved adapter is loaded onto it."
        )
    if kwargs.get("model_kwargs"):
        raise ValueError(
            f"model_kwargs={kwargs['model_kwargs']!r} would go to the modules that load a model, and this folder holds "
            "none: load the base model with those settings (dtype, attn_implementation...) and pass it as base."
        )
    _check_saved_folder(folder)
    loader = getattr(SentenceTransformer, "_load_with_module_classes", None)
    if loader is None:  # pragma: no cover - depends on the installed sentence-transformers
        import sentence_transformers

        raise NotImplementedError(
            f"sentence-transformers {sentence_transformers.__version__} cannot be handed the base model. Load the "
            f"adapter with PeftModel.from_pretrained(base, '{folder}/{ADAPTER_FOLDER}') and rebuild with "
            "ubmoe_peft.to_sentence_transformer(...), passing the prompt, pooling and max_length again."
        )
    encoder = type(UBMoEEncoder.__name__, (UBMoEEncoder,), {"_load_onto": base, "__module__": __name__})
    st = loader(str(folder), {f"{__name__}.{UBMoEEncoder.__qualname__}": encoder}, **kwargs)
    if not any(isinstance(module, UBMoEEncoder) for module in st):
        raise ValueError(
            f"{str(folder)!r} holds a SentenceTransformer without a UBMoE encoder (modules "
            f"{[type(m).__name__ for m in st]}), so base was not used. Load it with SentenceTransformer(folder)."
        )
    return st


def _check_saved_folder(folder: Any) -> None:
    """``folder`` names what ``st.save`` wrote: a local folder holding modules.json, or a Hub id. An adapter folder
    (``model.save_pretrained``'s, or the save's own ``ubmoe_adapter``), None, or a local path that does not exist went
    on to the Hub and failed there with a network error."""
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(
            f"folder must be the folder st.save(folder) wrote (a path), got {type(folder).__name__} {folder!r}."
        )
    path = Path(folder)
    if not path.exists():
        if _looks_local(os.fspath(folder)):
            where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
            raise FileNotFoundError(f"{str(folder)!r} does not exist; pass the folder st.save(folder) wrote{where}.")
        return  # a Hub id ('name' or 'owner/name'): sentence-transformers downloads it
    if not path.is_dir():
        raise ValueError(f"{str(folder)!r} is a file; pass the folder st.save(folder) wrote.")
    if (path / "modules.json").is_file():
        return
    if (path / ADAPTER_FOLDER).is_dir():  # st.save's own layout, cut short before sentence-transformers' modules.json
        raise UBMoEFileError(
            f"{str(folder)!r} holds a UBMoE encoder ({ADAPTER_FOLDER}/) but no modules.json: st.save into it was cut "
            "short (its modules after the encoder, or the list of modules, were never written). Save the encoder "
            "again (st.save(folder))."
        )
    top = (path / "adapter_config.json").is_file()
    if top or any(path.glob("*/adapter_config.json")):  # PEFT saves an adapter not named "default" in a subfolder
        around = (path.parent / "modules.json").is_file()
        saved = f"{str(path.parent)!r}, the folder st.save wrote around it" if around else "the folder st.save wrote"
        raise ValueError(
            f"{str(folder)!r} holds an adapter (adapter_config.json{'' if top else ' in a subfolder'}), not a saved "
            f"SentenceTransformer (modules.json, with the adapter in {ADAPTER_FOLDER}/): pass {saved}. For an "
            "adapter saved with model.save_pretrained, build the encoder with "
            "to_sentence_transformer(PeftModel.from_pretrained(base, folder), tokenizer)."
        )
    raise FileNotFoundError(
        f"{str(folder)!r} holds no modules.json, so st.save did not write it (or the save was cut short): pass the "
        "folder st.save(folder) wrote."
    )


def _check_max_length(max_length: Any) -> None:
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length={max_length!r}: give the longest input in tokens, a positive integer.")


def to_sentence_transformer(
    model: nn.Module,
    tokenizer: Any,
    pooling: str = "mean",
    prompt: str | None = None,
    max_length: int = 512,
    mode: str = "bi",
) -> SentenceTransformer:
    """A SentenceTransformer sharing ``model``'s parameters that always embeds in ``mode`` (``"bi"``, the default).

    ``prompt`` is prepended, or, when it contains ``{text}``, the text is put in its place (the paper's
    ``'The representative word for sentence {text} is:"'``). ``pooling`` is any sentence-transformers pooling mode
    ("mean", "lasttoken", "cls", "max", ...); the pooled span includes the prompt. ``mode`` is for comparisons
    only: "uni" embeds with the base model (causal attention), as a baseline. ``model`` is the PeftModel (a module
    inside it would save the whole base model), or a SentenceTransformer made here (its model is taken).
    """
    return sentence_transformer_of(model, tokenizer, pooling, prompt, max_length, mode, saves=True)


def sentence_transformer_of(
    model: nn.Module,
    tokenizer: Any,
    pooling: str = "mean",
    prompt: str | None = None,
    max_length: int = 512,
    mode: str = "bi",
    saves: bool = False,
) -> SentenceTransformer:
    """`to_sentence_transformer`; without ``saves``, ``model`` may be a module inside the PeftModel (only a save
    needs the PeftModel), for `sts_spearman`, which evaluates such a module as the other evaluations do."""
    check_tokenizer(tokenizer)
    check_pooling(pooling)
    model = encoder_model(model)
    if not ubmoe_layers(model) and not isinstance(getattr(model, "base_model", None), UBMoEModel):
        raise ValueError(
            f"{type(model).__name__} has no UBMoE layers; wrap a base model first: peft.get_peft_model(base, "
            "UBMoEConfig()). A model exported with merge_and_unload(target='bi') is a plain bidirectional model: embed "
            "it with sentence-transformers directly, as text rather than chat messages (see 'Embeddings and "
            "diagnosis' in docs/usage.md: Transformer(folder, modality_config={'text': {'method': 'forward', "
            "'method_output_name': 'last_hidden_state'}}, module_output_name='token_embeddings'), then Pooling)."
        )
    # a UBMoE model that unload() / merge_and_unload(target="bi") emptied in place, or whose layers a later wrap of
    # its base took over: named as such (it was told to wrap itself again, which is refused for a PeftModel)
    mode_state(model)
    if saves:
        _check_saves_the_adapter(model, "to_sentence_transformer")
    encoder = UBMoEEncoder(model, tokenizer, prompt=prompt, max_length=max_length, mode=mode)
    pool = Pooling(encoder.get_embedding_dimension(), pooling_mode=pooling)
    device = next(model.parameters()).device
    return SentenceTransformer(modules=[encoder, pool], device=str(device))
