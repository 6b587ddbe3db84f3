"""The two training stages as the field's trainers: stage 1 on sentence-transformers, stage 2 on TRL.

- `ContrastiveTrainer` (stage 1) is a `SentenceTransformerTrainer`: it wraps the UBMoE model with
  `to_sentence_transformer` (mode bi) and trains only the bidirectional experts with in-batch-negatives contrastive
  loss (`MultipleNegativesRankingLoss`, the paper's scale 20), batches without duplicate texts.
- `RouterTrainer` (stage 2) is TRL's `SFTTrainer`: mode moe, only the routers train, and the share of tokens sent to
  the bidirectional expert is logged as ``bi_share`` beside TRL's own metrics.

Each has a config dataclass on its library's `TrainingArguments` whose defaults are the paper's where it gives them.
Nothing here is a training loop of our own: the trainers only put the model in its stage and add our metric.
"""

from __future__ import annotations

import json
import math
import numbers
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._extras import require

# ruff: noqa: E402 (the imports below need the optional extra, named first)
require("the UBMoE trainers (ContrastiveTrainer, RouterTrainer)", "train", "sentence_transformers", "trl", "datasets")

from datasets import Dataset
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.base.model import BaseModel
from sentence_transformers.base.sampler import BatchSamplers
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from trl import SFTConfig, SFTTrainer

from .architectures import attention_module, decoder_layers
from .data import HARD_NEGATIVE, refuse_graded_pairs
from .embedding import ADAPTER_FOLDER, not_the_peft_model
from .io import CONFIG_NAME, OUTPUT_SETTINGS, PICKLE_WEIGHTS_NAME, WEIGHTS_NAME, AdapterMismatchError, read_json_config
from .modes import float16_trainable, mode_state, prepare_stage, set_stage, ubmoe_layers, use_mode
from .tuners.ubmoe.state import RoutingTally

PAPER_PROMPT = 'The representative word for sentence {text} is:"'


def _check_dataset(
    dataset: Any, trainer: str, needs: list[tuple[str, ...]] | None = None, hint: str = "", name: str = "train_dataset"
) -> None:
    """A train dataset with rows and, when ``needs`` is given, one of its column sets (else a clear error now, not a
    bare KeyError or StopIteration from inside the library that reads it)."""
    if dataset is None or not hasattr(dataset, "column_names"):  # an IterableDataset or a dict of them: theirs
        return
    try:
        empty = len(dataset) == 0
    except TypeError:
        empty = False
    if empty:
        raise ValueError(f"{trainer} got a {name} with no rows; pass the data to train on.")
    columns = dataset.column_names
    if isinstance(columns, list) and needs and not any(set(c) <= set(columns) for c in needs):
        wanted = " or ".join("(" + ", ".join(c) + ")" for c in needs)
        raise ValueError(f"{trainer}'s {name} has columns {columns}; it needs columns {wanted}.{hint}")


def _check_pairs(train_dataset: Any, loss: Any, batch_size: int) -> None:
    """Each training dataset (also each of a DatasetDict, which passed every check as one dataset and trained
    nothing) has rows, and, under the default loss, text pairs and more than one pair per batch."""
    datasets = train_dataset if isinstance(train_dataset, dict) else {"": train_dataset}
    for key, dataset in datasets.items():
        name = f"train_dataset[{key!r}]" if key else "train_dataset"
        _check_dataset(dataset, "ContrastiveTrainer", name=name)
        columns = getattr(dataset, "column_names", None)
        if loss is not None or not isinstance(columns, list):
            continue
        if len(columns) < 2:
            raise ValueError(
                f"ContrastiveTrainer's {name} has the one column {columns}; the contrastive loss needs text pairs "
                "(anchor, positive[, negative]). For unsupervised SimCSE, pair each text with itself: "
                "ubmoe_peft.data.contrastive_pairs(dataset) on a 'text' column, and train with "
                "ContrastiveConfig(attention_dropout=0.1), since the two views differ only by dropout."
            )
        rows = len(dataset) if hasattr(dataset, "__len__") else batch_size  # streamed: full batches
        if len(columns) == 2 and min(batch_size, rows) < 2:  # one pair, no negative: the in-batch loss is exactly 0
            raise ValueError(
                f"ContrastiveTrainer would put 1 pair in each batch of {name} (per_device_train_batch_size="
                f"{batch_size}, {rows} rows) and the data has no negative column: the in-batch-negatives "
                "loss is then 0 for every batch and nothing trains. Use at least 2 pairs per batch (and rows), or "
                "add a hard-negative column (anchor, positive, negative)."
            )


def _check_loss_model(loss: Any, model: nn.Module) -> None:
    """Refuse a loss module built on another SentenceTransformer than the one the trainer trains: it would embed with
    that model's pooling while the trainer tokenizes, evaluates and saves with its own (sentence-transformers points a
    loss at the trained model only when it reloads one). A loss class or function is built on the right one."""
    for item in loss.values() if isinstance(loss, dict) else [loss]:
        if not isinstance(item, nn.Module):
            continue
        for child in item.modules():
            other = getattr(child, "model", None)
            if isinstance(other, BaseModel) and other is not model:  # the field sentence-transformers repoints
                raise ValueError(
                    f"The loss {type(item).__name__} was built on another SentenceTransformer than the one "
                    "ContrastiveTrainer trains (made from ContrastiveConfig's pooling, prompt and max_length, as "
                    "trainer.sentence_transformer). Pass the loss class or a function of that model instead: "
                    "loss=CoSENTLoss, or loss=lambda st: MatryoshkaLoss(st, MultipleNegativesRankingLoss(st), [64])."
                )


def _require_ubmoe(model: Any, trainer: str) -> None:
    from sentence_transformers import SentenceTransformer

    if isinstance(model, SentenceTransformer):  # it holds UBMoE layers, and failed deep in training with a TypeError
        raise TypeError(
            f"{trainer} takes the PEFT model, not a SentenceTransformer: pass st[0].model for one made by "
            "to_sentence_transformer. ContrastiveTrainer builds its own SentenceTransformer around it from "
            "ContrastiveConfig's pooling, prompt and max_length (trainer.sentence_transformer)."
        )
    if not isinstance(model, nn.Module) or not ubmoe_layers(model):
        raise ValueError(
            f"{trainer} got {type(model).__name__}, which has no UBMoE layers: pass the wrapped model, "
            "peft.get_peft_model(base, UBMoEConfig()) or PeftModel.from_pretrained(base, adapter_dir)."
        )
    what = not_the_peft_model(model, trainer)
    if what:  # the inner model trained, then its save wrote the whole base (or failed)
        raise ValueError(
            f"{trainer} got {what}: it trains, but saving it writes the whole base model instead of the adapter. "
            "Pass the PeftModel that peft.get_peft_model or PeftModel.from_pretrained returned."
        )


def _drop_repeated_input_grad_hooks(model: nn.Module) -> None:
    """Keep one of transformers' ``make_inputs_require_grads`` hooks per input embedding. Gradient checkpointing
    adds one at every ``train()`` and none is ever removed; sentence-transformers enables it on every submodule that
    has it (PeftModel, tuner, causal LM, backbone): a model trained by stage 1 and stage 2 in turn gained 5 hooks per
    round, each called by every later forward and decode step. Only its name tells the hook apart."""
    for module in model.modules():  # each sub-model's input embeddings (a multimodal model's vision tower too)
        hooks = module._forward_hooks
        named = [key for key, hook in hooks.items() if getattr(hook, "__name__", None) == "make_inputs_require_grads"]
        for key in named[1:]:
            del hooks[key]
            module._forward_hooks_with_kwargs.pop(key, None)
            module._forward_hooks_always_called.pop(key, None)


def _refuse_float16_weights(model: nn.Module, trainer: str) -> None:
    """AdamW's update of a float16 weight is NaN or inf for a gradient below about 2e-4 (its square is 0, and so is
    eps 1e-8): an fp16 copy expert turned NaN within a few steps while the logged loss read 0 (transformers drops
    NaN losses from its log). transformers' fp16 mixed precision refuses float16 weights as well."""
    names = float16_trainable(model)
    if names:
        raise ValueError(
            f"{trainer} would train {len(names)} float16 parameters (e.g. {names[0]}), whose optimizer updates "
            "underflow to NaN. Load the base in bfloat16 or float32 (from_pretrained(..., dtype=...), the command "
            "line's --dtype; fp16=True in the training arguments then gives float16 mixed precision), or keep float16 "
            "weights out of training: UBMoEConfig(expert_type='lora') (fp32 adapters, unless PEFT's "
            "autocast_adapter_dtype=False was passed), router_dtype='float32', and no modules_to_save (full float16 "
            "copies)."
        )


def check_training_counts(config: Any) -> None:
    """Counts that transformers' TrainingArguments take unchecked: a batch size of 0 failed in torch's sampler
    without naming the option (an evaluation batch size of 0 at the first evaluation, after training steps), 0
    accumulation steps divided by zero, 0 epochs "trained" and saved an untrained adapter, infinite epochs failed
    with an OverflowError traceback, a negative ``max_steps`` other than -1 ("not set") silently trained by epochs,
    and a seed outside numpy's range failed only when the trainer seeded."""
    counts = {
        "per_device_train_batch_size": "rows per device in each training batch, e.g. 8",
        "per_device_eval_batch_size": "rows per device in each evaluation batch, e.g. 8",
        "gradient_accumulation_steps": "batches per optimizer step, e.g. 1",
    }
    for name, meaning in counts.items():
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer ({meaning}).")
    if config.max_steps == 0 or config.max_steps < -1:
        raise ValueError(
            f"max_steps={config.max_steps!r} must be a positive number of optimizer steps, or -1 (the default) to "
            "train for num_train_epochs."
        )
    epochs = config.num_train_epochs
    # inf: an OverflowError in the trainer's step count; nan: nothing trained (with max_steps set they are ignored)
    if config.max_steps == -1 and not math.isfinite(epochs):
        raise ValueError(
            f"num_train_epochs={epochs!r} must be a finite number of passes over the data (0 < x < inf), e.g. 3; to "
            "train for a number of optimizer steps instead, set max_steps."
        )
    if config.max_steps == -1 and not epochs > 0:
        raise ValueError(
            f"num_train_epochs={epochs!r} with max_steps unset would train nothing and save the "
            "untrained adapter; give a positive number of epochs, or set max_steps."
        )
    seed = config.seed
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**32:
        raise ValueError(
            f"seed={seed!r} must be a whole number from 0 to 2**32 - 1 (the range numpy's generator takes; the "
            "default is 42)."
        )
    if not 0 < config.learning_rate < math.inf:  # inf saved NaN weights, nan failed in torch, 0 trained nothing
        raise ValueError(
            f"learning_rate={config.learning_rate!r} must be a positive, finite number (e.g. 3e-4): 0 trains "
            "nothing (and saves the untrained adapter), a negative one trains away from the data, inf or nan break "
            "the weights."
        )
    neftune = getattr(config, "neftune_noise_alpha", None)
    if neftune is not None and not 0 < neftune < math.inf:  # a negative one failed in training, in torch's uniform_
        raise ValueError(f"neftune_noise_alpha={neftune!r} must be a positive number (NEFTune's paper uses 5).")
    max_length = getattr(config, "max_length", None)
    if max_length is not None and max_length < 2:  # 1 trained on nothing (SFT: no next token) and saved the adapter
        raise ValueError(
            f"max_length={max_length!r} must be at least 2 tokens (a one-token text has no next token to learn and "
            "gives every pair the same embedding), e.g. 512, or None for no limit."
        )


# What makes a resumed run the run it continues: the settings that change what the adapter computes, and the two
# that act only in training.
_RUN_SETTINGS = (*OUTPUT_SETTINGS, "router_gradient", "lora_dropout")
# Stage 1 never routes (mode bi): its resume may change the routers' settings, which its checkpoint's weights (the
# experts, bit for bit) do not depend on; a stage-1 run resumed under top_k=2 trains exactly as under 1.
_ROUTING_SETTINGS = ("top_k", "router_gradient", "router_dtype")


def _canonical(value: Any) -> Any:
    return sorted(value, key=str) if isinstance(value, (list, tuple, set)) else value


def check_checkpoint_settings(
    model: nn.Module, adapter: str, folder: Path, checkpoint: str, stage: str = "router"
) -> None:
    """Refuse to resume adapter ``adapter`` of ``model`` from a checkpoint saved with other settings.

    The checkpoint's weights are loaded into the running adapter, whose settings win: a checkpoint trained with
    ``lora_alpha=16`` resumed under 64 went on with a LoRA scale of 8 instead of 5.66, and in stage router a changed
    ``top_k`` or ``router_gradient`` silently became another run. Only tensors of another shape were refused."""
    path = folder / CONFIG_NAME
    configs = getattr(model, "peft_config", {})
    if adapter not in configs or not path.is_file():  # a missing file is named by the weights loader
        return
    saved, current = read_json_config(path), configs[adapter].to_dict()
    settings = [k for k in _RUN_SETTINGS if stage == "router" or k not in _ROUTING_SETTINGS]
    differ = [k for k in settings if _canonical(saved.get(k)) != _canonical(current.get(k))]
    if differ:
        shown = ", ".join(f"{k}={saved.get(k)!r} (the model has {current.get(k)!r})" for k in differ)
        raise AdapterMismatchError(
            f"Checkpoint {checkpoint!r} was saved by adapter {adapter!r} with {shown}; resuming would go on training "
            "its weights under the model's settings. Resume with the checkpoint's settings (on the command line, the "
            "same adapter options as the run that saved it), or start a new run without resume_from_checkpoint."
        )


def checkpoint_adapter(model: nn.Module, folder: Path, checkpoint: str) -> Path:
    """The folder of ``folder`` (a checkpoint's adapter save) whose weights resume ``model``'s active adapter.

    PEFT saves adapter "default" at the top and every other adapter in a subfolder of its name. Like transformers'
    resume, a checkpoint with the top-level files only resumes whichever adapter is active (a run renamed since); one
    with subfolders must hold the active adapter's. transformers loaded a subfolder as a new, inactive adapter and
    went on training the active one from where it stood, with no sign (its weights were never restored), and
    sentence-transformers' resume failed with a hub error on the missing folder.
    """
    adapter = model.active_adapter

    def has_weights(path: Path) -> bool:
        return (path / WEIGHTS_NAME).is_file() or (path / PICKLE_WEIGHTS_NAME).is_file()

    saved = {"default": folder} if has_weights(folder) else {}
    if folder.is_dir():
        saved |= {sub.name: sub for sub in sorted(folder.iterdir()) if sub.is_dir() and has_weights(sub)}
    if adapter in saved:
        return saved[adapter]
    if list(saved) == ["default"]:
        return folder
    if (folder / ADAPTER_FOLDER).is_dir():  # sentence-transformers' layout (a named adapter in a subfolder): stage 1
        raise AdapterMismatchError(
            f"Checkpoint {checkpoint!r} is a stage-1 (contrastive) checkpoint, which stage 2 cannot resume: its "
            f"adapter ({folder / ADAPTER_FOLDER}) is what stage 2 starts from (--adapter on the command line). Resume "
            "stage 2 from one of its own checkpoints, or start it without resume_from_checkpoint."
        )
    if not saved:  # no name to change: another kind of folder, or a damaged checkpoint
        raise AdapterMismatchError(
            f"Checkpoint {checkpoint!r} holds no adapter weights ({WEIGHTS_NAME} in {folder} or a subfolder), so it "
            "is not a checkpoint of this kind of run, or it is damaged. Resume from another checkpoint of this run, "
            "or start a new run without resume_from_checkpoint."
        )
    raise AdapterMismatchError(
        f"Checkpoint {checkpoint!r} holds adapters {list(saved)} ({folder}), but the model trains adapter {adapter!r}: "
        "its weights would not be restored. Resume with the adapter name the checkpoint was saved under (set_adapter, "
        "or the same adapter_name as the run that saved it), or start a new run without resume_from_checkpoint."
    )


DEFAULT_SCALE = 20.0  # the in-batch-negatives loss's inverse temperature in the paper (sentence-transformers' too)


@dataclass
class ContrastiveConfig(SentenceTransformerTrainingArguments):
    """Stage 1 (contrastive) settings: sentence-transformers' training arguments plus how texts are embedded."""

    output_dir: str | None = field(
        default="ubmoe-contrastive",
        metadata={"help": "Folder for checkpoints and, from the command line, the trained adapter."},
    )
    prompt: str | None = field(
        default=PAPER_PROMPT,
        metadata={
            "help": "Template each text is embedded in; '{text}' marks where the text goes (else it is appended). "
            "None (or 'none' on the command line) embeds the bare text. Default: the paper's prompt."
        },
    )
    pooling: str = field(
        default="mean", metadata={"help": "sentence-transformers pooling mode: 'mean' (the paper), 'lasttoken'..."}
    )
    max_length: int = field(default=128, metadata={"help": "Longest tokenized text (prompt included) in tokens."})
    scale: float = field(
        default=DEFAULT_SCALE,
        metadata={"help": "Inverse temperature of the default in-batch-negatives loss (the paper: 20)."},
    )
    learning_rate: float = field(default=3e-4, metadata={"help": "Peak learning rate (the paper: 3e-4)."})
    per_device_train_batch_size: int = field(
        default=64,
        metadata={
            "help": "Pairs per batch; each pair's negatives are the batch's other texts (gradient accumulation does "
            "not add negatives: use CachedMultipleNegativesRankingLoss for a large batch in little memory)."
        },
    )
    batch_sampler: BatchSamplers | str = field(
        default=BatchSamplers.NO_DUPLICATES,
        metadata={"help": "Default 'no_duplicates': a repeated text in a batch would be a false negative."},
    )
    gather_across_devices: bool = field(
        default=False,
        metadata={
            "help": "With several processes (DDP), give each pair the other processes' texts as negatives too (the "
            "default loss's option): then N processes x B pairs train as one batch of N x B, as on one device. "
            "Without it each process's negatives are its own B pairs'."
        },
    )
    attention_dropout: float | None = field(
        default=None,
        metadata={
            "help": "Dropout on the attention weights while training (the base's own attention dropout, set for "
            "train() and restored after; evaluation runs without). Unsupervised SimCSE, each text paired with itself, "
            "needs it: the two views differ only by dropout, and a fresh LoRA expert's own dropout changes nothing "
            "until its B weights grow. None: the model's own (0 for most decoders), or 0.1 (SimCSE's) for "
            "text-only data on the command line."
        },
    )

    def __post_init__(self) -> None:
        from .embedding import check_pooling, check_prompt, prompt_or_none

        self.prompt = prompt_or_none(self.prompt)

        check_prompt(self.prompt)
        check_pooling(self.pooling)  # before a model loads (the command line)
        if isinstance(self.max_length, bool) or not isinstance(self.max_length, int) or self.max_length < 2:
            raise ValueError(
                f"max_length={self.max_length!r} must be at least 2 tokens (e.g. 128): stage 1 embeds texts "
                "truncated to it, so it has no 'no limit' value (RouterConfig's None)."
            )
        dropout = self.attention_dropout
        if dropout is not None and (
            isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1
        ):
            raise ValueError(
                f"attention_dropout={dropout!r} must be a probability in [0, 1) (SimCSE's is 0.1), or None."
            )
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not 0 < self.scale < math.inf:
            raise ValueError(
                f"scale={self.scale!r} must be a positive, finite number, the loss's inverse temperature (as 20)"
            )
        if self.neftune_noise_alpha is not None:  # transformers' NEFTune needs the LM's get_input_embeddings
            raise ValueError(
                f"neftune_noise_alpha={self.neftune_noise_alpha} (NEFTune) is not supported in stage 1: "
                "sentence-transformers' trainer cannot reach the embeddings of the model it trains, and failed at "
                "train() with an AttributeError. Leave it unset here; stage 2 (RouterConfig) supports it."
            )
        check_training_counts(self)
        super().__post_init__()


class ContrastiveTrainer(SentenceTransformerTrainer):
    """Stage 1: trains the bidirectional experts of ``model`` in mode bi with in-batch-negatives contrastive loss.

    ``train_dataset`` is a `datasets.Dataset` of text columns (anchor, positive[, hard negative], in that order), as
    for any sentence-transformers loss. ``self.sentence_transformer`` is the embedding model being trained; it shares
    ``model``'s parameters, so after `train()` the PEFT model holds the trained experts. ``loss`` (default: in-batch
    negatives at ``args.scale``) is a sentence-transformers loss class or a function of that model (``loss=CoSENTLoss``,
    ``loss=lambda st: ...``), or a dict of them per dataset, since the model is made here.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        args: ContrastiveConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        loss: Any = None,
        **kwargs: Any,
    ) -> None:
        from .embedding import to_sentence_transformer

        _require_ubmoe(model, "ContrastiveTrainer")
        processing_class = kwargs.pop("processing_class", None)  # the TRL / transformers Trainer spelling
        if tokenizer is None:
            tokenizer = processing_class
        if tokenizer is None:
            raise TypeError(
                "ContrastiveTrainer needs the model's tokenizer: ContrastiveTrainer(model, tokenizer, ...)."
            )
        args = args or ContrastiveConfig()
        if not isinstance(args, ContrastiveConfig):
            raise TypeError(f"args is a {type(args).__name__}; pass a ubmoe_peft.ContrastiveConfig.")
        _check_pairs(train_dataset, loss, args.per_device_train_batch_size)
        prepare_stage(model, "contrastive")  # set_stage's float16 warning would precede this refusal
        _refuse_float16_weights(model, "ContrastiveTrainer")
        self.peft_model = model
        self.sentence_transformer = to_sentence_transformer(
            model, tokenizer, pooling=args.pooling, prompt=args.prompt, max_length=args.max_length
        )
        if loss is None:
            # The eval loss is the same in-batch-negatives loss: graded pairs would be scored as positives there too.
            for role, given in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
                datasets = given if isinstance(given, dict) else {"": given}
                for name, dataset in datasets.items():
                    columns = getattr(dataset, "column_names", None)
                    if isinstance(columns, list):
                        what = f"ContrastiveTrainer's {role}{f'[{name!r}]' if name else ''}"
                        fix = "Pass a loss that reads it (e.g. loss=sentence_transformers.losses.CoSENTLoss), or: "
                        refuse_graded_pairs(columns, what, fix)
                        _check_text_columns(dataset, columns, what)
            loss = MultipleNegativesRankingLoss(
                self.sentence_transformer, scale=args.scale, gather_across_devices=args.gather_across_devices
            )
        else:
            if args.gather_across_devices:  # it would be dropped silently: the option is the default loss's
                raise ValueError(
                    "ContrastiveConfig(gather_across_devices=True) sets the default loss's option, but a loss was "
                    "given: pass the option to that loss itself (e.g. loss=lambda st: "
                    "CachedMultipleNegativesRankingLoss(st, gather_across_devices=True)), and leave it False here."
                )
            if args.scale != DEFAULT_SCALE:  # the same: the given loss has its own scale (or none)
                raise ValueError(
                    f"ContrastiveConfig(scale={args.scale}) sets the default loss's inverse temperature, but a loss "
                    f"was given, which keeps its own: pass it to that loss (e.g. loss=lambda st: "
                    f"CachedMultipleNegativesRankingLoss(st, scale={args.scale})), and leave scale at {DEFAULT_SCALE} "
                    "here."
                )
            _check_loss_model(loss, self.sentence_transformer)
        super().__init__(
            model=self.sentence_transformer,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            loss=loss,
            **kwargs,
        )

    def get_batch_sampler(
        self,
        dataset: Any,
        batch_size: int,
        drop_last: bool,
        valid_label_columns: list[str] | None = None,
        generator: torch.Generator | None = None,
        seed: int = 0,
    ) -> Any:
        # sentence-transformers seeds its batch samplers with args.seed: args.data_seed did nothing in stage 1 while
        # it ordered stage 2's data. transformers' Trainer seeds its samplers with data_seed when it is set.
        data_seed = self.args.data_seed
        if data_seed is not None:
            seed = data_seed
            if generator is not None:  # a plain random sampler draws from it without reseeding
                generator.manual_seed(data_seed)
        return super().get_batch_sampler(dataset, batch_size, drop_last, valid_label_columns, generator, seed)

    def get_multi_dataset_batch_sampler(
        self, dataset: Any, batch_samplers: list, generator: torch.Generator | None = None, seed: int | None = 0
    ) -> Any:
        # the order of a DatasetDict's datasets, as above
        if self.args.data_seed is not None:
            seed = self.args.data_seed
        return super().get_multi_dataset_batch_sampler(dataset, batch_samplers, generator, seed)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        # Stage again when training starts, not only when the trainer is made: another trainer (stage 2) or a
        # set_mode made since then would leave this one training nothing, silently (the optimizer is built here).
        set_stage(self.peft_model, "contrastive")
        try:
            with attention_dropout(self.peft_model, self.args.attention_dropout):
                return super().train(*args, **kwargs)
        finally:
            _drop_repeated_input_grad_hooks(self.peft_model)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            _routers_in_their_dtype(self.peft_model)  # as RouterTrainer.evaluate

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().predict(*args, **kwargs)
        finally:
            _routers_in_their_dtype(self.peft_model)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # transformers 5 checks the rank in `Trainer._save`, which sentence-transformers' override skips: every
        # process saved, and the second one's swap into the same folder failed (a run under torchrun died at its
        # first checkpoint, `save_model` too).
        if self.args.should_save:
            super()._save(output_dir, state_dict=state_dict)

    def _load_from_checkpoint(self, checkpoint_path: str) -> None:
        """Load a checkpoint of this run (``train(resume_from_checkpoint=...)``, ``load_best_model_at_end``) into the
        model being trained.

        Why not sentence-transformers' own: it rebuilds a whole SentenceTransformer from the folder, and a UBMoE
        encoder saves only its adapter (`UBMoEEncoder.save`), so resuming stopped with an error. The checkpoint's
        adapter weights are loaded through PEFT, which checks that they fill this adapter exactly.
        """
        from peft import set_peft_model_state_dict
        from peft.peft_model import load_peft_weights  # ubmoe_peft.io's safe reader (peft.utils' is PEFT's own)

        _refuse_incomplete(checkpoint_path)  # before transformers' raw error on its missing trainer_state.json
        adapter = self.peft_model.active_adapter
        folder = Path(checkpoint_path) / _encoder_path(checkpoint_path) / ADAPTER_FOLDER
        folder = checkpoint_adapter(self.peft_model, folder, checkpoint_path)
        check_checkpoint_settings(self.peft_model, adapter, folder, checkpoint_path, stage="contrastive")
        set_peft_model_state_dict(self.peft_model, load_peft_weights(str(folder)), adapter_name=adapter)


@contextmanager
def attention_dropout(model: nn.Module, p: float | None) -> Iterator[None]:
    """Set the attention dropout of every decoder layer of ``model`` that has an attention module to ``p`` in the
    block (transformers' attention modules read their ``attention_dropout`` at each training forward), and restore
    it after; None leaves the model's own. A hybrid's convolution or state-space layers have none to set."""
    if p is None:
        yield
        return
    modules = [m for _, layer in decoder_layers(model) if (m := attention_module(layer)) is not None]
    lacking = [m for m in modules if not isinstance(getattr(m, "attention_dropout", None), (int, float))]
    if not modules or lacking:
        found = (
            f"its attention ({type(lacking[0]).__name__}) has" if lacking else "no decoder layer has an attention with"
        )
        raise ValueError(
            f"ContrastiveConfig(attention_dropout={p}) sets the attention dropout of each decoder layer, but in this "
            f"model {found} no 'attention_dropout' to set. Use attention_dropout=None and text pairs (anchor, "
            "positive) rather than texts paired with themselves."
        )
    saved = [m.attention_dropout for m in modules]
    for module in modules:
        module.attention_dropout = p
    try:
        yield
    finally:
        for module, value in zip(modules, saved, strict=True):
            module.attention_dropout = value


def _check_text_columns(dataset: Any, columns: list[str], what: str) -> None:
    """The in-batch-negatives loss embeds every column (sentence-transformers' rule): a number failed deep in the
    tokenizer without naming its column, and a metadata column (a source) became one more hard negative, silently (a
    constant one made the no-duplicates sampler yield batches of one row). More than three text columns can be real
    hard negatives, so those are named in a warning, unless they are named as such (negative, negative_1...)."""
    features = getattr(dataset, "features", None) or {}
    kinds = {c: getattr(features.get(c), "dtype", None) for c in columns}
    not_text = [
        c for c, kind in kinds.items() if kind is not None and kind not in ("string", "large_string", "string_view")
    ]
    keep = "dataset.select_columns(['anchor', 'positive'(, 'negative')]) (with your names)"
    if not_text:
        raise ValueError(
            f"{what} has columns {columns}: column {not_text[0]!r} holds {kinds[not_text[0]]}, not text. The default "
            f"in-batch-negatives loss embeds every column, the third and later ones as hard negatives. Keep the text "
            f"columns: {keep}."
        )
    if len(columns) > 3 and not all(HARD_NEGATIVE.fullmatch(c) for c in columns[2:]):  # negative_1...: named so
        warnings.warn(
            f"{what} has {len(columns)} columns {columns}: the default in-batch-negatives loss embeds every column, "
            f"{columns[2:]} as hard negatives. If one of them is not a text to embed (a source, an id), keep the text "
            f"columns: {keep}.",
            stacklevel=3,  # the code that made the trainer
        )


def _refuse_incomplete(checkpoint: str) -> None:
    """A checkpoint without ``trainer_state.json``, which transformers writes last, is one whose save was cut short
    (resume_from_checkpoint=True takes the newest folder, complete or not): name it so, with the ones to use."""
    folder = Path(checkpoint)
    if not re.fullmatch(r"checkpoint-\d+", folder.name) or (folder / "trainer_state.json").is_file():
        return
    complete = sorted(
        (p.name for p in folder.parent.glob("checkpoint-*") if (p / "trainer_state.json").is_file()),
        key=lambda name: int(name.rsplit("-", 1)[-1]) if name.rsplit("-", 1)[-1].isdigit() else -1,
    )
    raise FileNotFoundError(
        f"Checkpoint {checkpoint!r} is incomplete: it has no trainer_state.json, which transformers writes last, so "
        f"its save was interrupted. Resume from a complete checkpoint ({complete or 'none found beside it'}), by its "
        "path, or delete the incomplete one."
    )


def _encoder_path(checkpoint: str) -> str:
    """The UBMoE encoder's folder inside a saved SentenceTransformer (its entry in modules.json; "" at the top)."""
    modules_file = Path(checkpoint) / "modules.json"
    if not modules_file.is_file():
        raise FileNotFoundError(
            f"{checkpoint!r} has no modules.json, so it is not a checkpoint of a ContrastiveTrainer run. Pass the "
            "checkpoint-<step> folder the trainer saved in its output_dir."
        )
    entries = json.loads(modules_file.read_text())
    paths = [e.get("path", "") for e in entries if str(e.get("type", "")).endswith(".UBMoEEncoder")]
    if not paths:
        raise ValueError(f"{checkpoint!r} holds a SentenceTransformer without a UBMoE encoder ({modules_file}).")
    return paths[0]


@dataclass
class RouterConfig(SFTConfig):
    """Stage 2 (router) settings: TRL's SFT configuration with router-sized defaults."""

    output_dir: str | None = field(
        default="ubmoe-router",
        metadata={"help": "Folder for checkpoints and, from the command line, the trained adapter."},
    )
    learning_rate: float = field(
        default=1e-3,
        metadata={
            "help": "Peak learning rate. Higher than TRL's 2e-5: only the routers train (2 x hidden size weights per "
            "layer, starting from zero), so each step moves few parameters."
        },
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "bf16 mixed precision. Default (None): on when a CUDA device supports bf16 and neither fp16 nor "
            "use_cpu is set, else off. (TRL turns it on everywhere, which fails on a CPU-only machine unless "
            "use_cpu is set.)"
        },
    )

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = (
                not self.fp16 and not self.use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
            )
            self._bf16_chosen = True  # `cli._trained_on` chooses again for the CPU
        check_training_counts(self)
        super().__post_init__()


def _report_dropped_rows(trainer: Any, train: Any, evals: Any) -> None:
    """TRL's SFT preparation drops rows that `max_length` left without a token to train on (a prompt alone filling
    it), silently; with all of them gone, training failed in torch's sampler ("num_samples=0")."""
    args = trainer.args
    eval_packing = args.packing if args.eval_packing is None else args.eval_packing
    # TRL drops rows only where it truncates (max_length set, not packing); packing merges rows into fewer
    given = {} if args.packing else {"train_dataset": train}
    given.update({} if eval_packing else _named(evals))
    prepared = {"train_dataset": trainer.train_dataset, **_named(trainer.eval_dataset)}
    for name, rows in given.items():
        _report_dropped(name, rows, prepared.get(name), trainer.args)
    packed = [n for n in prepared if (args.packing if n == "train_dataset" else eval_packing)]
    for name in packed:
        _refuse_unscored(name, prepared[name], args)


def _refuse_unscored(name: str, rows: Any, args: Any) -> None:
    """Packed rows are not dropped: a packed dataset whose every label TRL masked (prompts filling max_length)
    trained with a loss of 0. Stops at the first row that scores a token, so it reads one row in the usual case."""
    if not isinstance(rows, Dataset) or "labels" not in rows.column_names or len(rows) == 0:
        return
    if any(any(label != -100 for label in row["labels"]) for row in rows.select_columns(["labels"])):
        return
    raise ValueError(
        f"RouterTrainer: {name} has no token to train on after TRL packed it: every completion or assistant reply "
        f"was cut by max_length={args.max_length}, so the prompts alone fill it. Raise max_length (--max_length), "
        "or shorten the prompts."
    )


def _named(evals: Any) -> dict[str, Any]:
    if isinstance(evals, dict):
        return {f"eval_dataset[{key!r}]": rows for key, rows in evals.items()}
    return {"eval_dataset": evals}


def _report_dropped(name: str, given: Any, kept: Any, args: Any) -> None:
    try:
        before, after = len(given), len(kept)
    except TypeError:  # None, or an iterable dataset: no count
        return
    cut = f"max_length={args.max_length} (truncation_mode={args.truncation_mode!r})"
    if after == 0 and before > 0:
        raise ValueError(
            f"RouterTrainer: all {before} rows of {name} were dropped while TRL prepared them: none has a token left "
            f"to train on (a completion or assistant reply) within {cut}, so the prompts alone fill it. Raise "
            "max_length (--max_length), or shorten the prompts."
        )
    if after < before:
        warnings.warn(
            f"RouterTrainer: {before - after} of the {before} rows of {name} were dropped while TRL prepared them: "
            f"they have no token left to train on within {cut} (or an empty completion). Raise max_length to keep "
            "them.",
            stacklevel=4,  # the code that made the trainer
        )


def _routers_in_their_dtype(model: nn.Module) -> None:
    """Put the routers back in config.router_dtype after a cast of the whole model (TRL's QLoRA recipe, or
    transformers' bf16_full_eval outside train()): their logits, and so every top-1 decision, are computed and saved
    in it."""
    configs = getattr(model, "peft_config", {})
    for layer in ubmoe_layers(model):
        for adapter, router in layer.ubmoe_router.items():
            if adapter in configs:
                router.weight.data = router.weight.data.to(getattr(torch, configs[adapter].router_dtype))


class RouterTrainer(SFTTrainer):
    """Stage 2: trains only the routers of ``model`` by SFT in mode moe (the default ``router_gradient="compare"``
    runs both experts on every token while the routers train, about one more FFN pass per step; ``"scale"`` keeps the
    base model's cost).

    Takes what `SFTTrainer` takes (chat ``messages``, prompt/completion or ``text`` datasets) except ``peft_config``:
    the model is already a UBMoE model. Logs ``bi_share``, the mean share of tokens routed to the bidirectional
    expert over the layers (every process's tokens counted), averaged over the logging interval's forwards
    (micro-batches), each counted alike, as TRL averages its own per-batch metrics.
    """

    def __init__(self, model: nn.Module, args: RouterConfig | None = None, **kwargs: Any) -> None:
        _require_ubmoe(model, "RouterTrainer")
        if kwargs.get("peft_config") is not None:
            raise ValueError(
                "RouterTrainer trains the routers of an existing UBMoE model; peft_config would wrap it in a second "
                "adapter. Drop peft_config (wrap the base with get_peft_model(base, UBMoEConfig()) beforehand)."
            )
        args = args or RouterConfig()
        if not isinstance(args, RouterConfig):
            raise TypeError(f"args is a {type(args).__name__}; pass a ubmoe_peft.RouterConfig.")
        if args.dataset_text_field == "text":  # TRL reads these dataset formats (a custom text field: theirs to check)
            needs = [("messages",), ("prompt", "completion"), ("text",), ("input_ids",)]
            hint = " A column of plain texts under another name: RouterConfig(dataset_text_field=name)."
            _check_dataset(kwargs.get("train_dataset"), "RouterTrainer", needs, hint)
        if kwargs.get("processing_class") is None and not getattr(getattr(model, "config", None), "_name_or_path", ""):
            raise TypeError(  # TRL would load a tokenizer by the model's name: a bare hub error for a model built here
                "RouterTrainer needs the model's tokenizer, since this model has no name to load one by (it was "
                "built from a config): RouterTrainer(model, args, train_dataset=..., processing_class=tokenizer)."
            )
        prepare_stage(model, "router")
        _refuse_float16_weights(model, "RouterTrainer")
        super().__init__(model=model, args=args, **kwargs)
        _routers_in_their_dtype(model)  # TRL's QLoRA recipe casts every trainable parameter to bf16
        _report_dropped_rows(self, kwargs.get("train_dataset"), kwargs.get("eval_dataset"))

    def train(self, *args: Any, **kwargs: Any) -> Any:
        # Stage again when training starts (see ContrastiveTrainer.train): a stage-1 trainer made after this one left
        # the model in mode bi with the experts trainable, and SFT then trained them with bidirectional attention.
        set_stage(self.model, "router")
        try:
            return super().train(*args, **kwargs)
        finally:
            _drop_repeated_input_grad_hooks(self.model)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with use_mode(self.model, "moe"):  # the stage's mode, whatever the model was left in since
                return super().evaluate(*args, **kwargs)
        finally:
            _routers_in_their_dtype(self.model)  # bf16_full_eval / fp16_full_eval cast the whole model outside train

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with use_mode(self.model, "moe"):
                output = super().predict(*args, **kwargs)
        finally:
            _routers_in_their_dtype(self.model)
        # TRL collects per-batch metrics in eval mode and empties them only when it logs, which predict never does:
        # the next evaluate() averaged the predicted batches into its bi_share (and TRL's entropy)
        metrics = getattr(self, "_metrics", {}).get("eval")
        if metrics is not None:
            metrics.clear()
        return output

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        _refuse_incomplete(resume_from_checkpoint)  # before transformers' raw error on its missing trainer_state.json
        # transformers saves the adapter "default" at the checkpoint's top and every other one in a subfolder
        folder = Path(resume_from_checkpoint)
        active = checkpoint_adapter(self.model, folder, resume_from_checkpoint)
        for adapter in getattr(self.model, "peft_config", {}):
            if adapter == self.model.active_adapter:
                saved = active
            elif adapter != "default":
                saved = folder / adapter
            elif active != folder:  # the top-level files are "default"'s only beside subfolders (transformers' rule)
                saved = folder
            else:
                continue
            check_checkpoint_settings(self.model, adapter, saved, resume_from_checkpoint)
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        # transformers reloads a checkpoint of a named (not "default") adapter with PEFT's set_adapter, which makes
        # every weight of the adapter trainable: the experts would join the routers, and resuming failed on the saved
        # optimizer state. Stage 2 trains the routers only.
        set_stage(self.model, "router")

    def _load_best_model(self) -> None:
        """transformers' version reloads only the best checkpoint's top-level adapter files (adapter "default") into
        the active adapter: a named adapter's best weights were not restored (a log line said so), and with several
        adapters the active one got "default"'s. A resume reads every adapter of a checkpoint under its own name, so
        the best checkpoint is loaded the same way."""
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:  # their own checkpoint formats
            super()._load_best_model()
            return
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        counts = mode_state(self.model).counts()
        if counts:
            # Summed over processes, as TRL reduces its own metrics: each rank routed only its share of the batch
            local = torch.tensor([counts[layer] for layer in sorted(counts)], device=self.accelerator.device)  # (L, 2)
            summed = self.accelerator.gather(local).view(-1, *local.shape).sum(0)  # (L, 2)
            tally = RoutingTally()  # the one rule for a share of routed tokens
            for layer, (routed, real) in zip(sorted(counts), summed.tolist(), strict=True):
                tally.add(layer, routed, real)
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["bi_share"].append(tally.mean())
        return result
