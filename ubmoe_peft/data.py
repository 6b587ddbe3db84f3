"""Datasets for the command line: a local file, a local folder or a hub dataset id, else the embedded demo data.

Loading is `datasets.load_dataset`; this module only picks the loader for a file's suffix, names the columns each
task needs and turns a mismatch into an error that lists what the data has.
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path
from typing import Any

from ._extras import require

DEMO_DATA = Path(__file__).parent / "demo_data"
DEMO_FILES = {"contrastive": "triplets.jsonl", "sts": "sts.tsv", "sft": "chat.jsonl"}
_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv", ".txt": "text", ".parquet": "parquet"}
_COMPRESSED = (".gz", ".bz2", ".xz")  # datasets reads these compressions of text formats, by the file name
_FORMATS = {"json": "JSON lines", "csv": "CSV / tab-separated with a header row", "text": "one text per line",
            "parquet": "Parquet"}  # fmt: skip

# Per task, the accepted column sets, first match wins.
COLUMNS = {
    "contrastive": [("anchor", "positive", "negative"), ("anchor", "positive"), ("sentence1", "sentence2"), ("text",)],
    "sts": [("sentence1", "sentence2", "score")],
    "sft": [("messages",), ("prompt", "completion"), ("text",)],
    "lm": [("question", "choices", "label"), ("messages",), ("prompt", "completion"), ("text",)],
    "texts": [("text",), ("sentence1",), ("anchor",), ("question",), ("messages",)],
}


HARD_NEGATIVE = re.compile(r"negative(_?\d+)?")  # negative, negative_1, negative2: more hard negatives of a row


def load_rows(
    spec: str | None,
    task: str,
    split: str = "train",
    limit: int | None = None,
    config: str | None = None,
    text_field: str = "text",
    config_option: str = "--data_config",
) -> Any:
    """A `datasets.Dataset` for ``task`` from ``spec`` (a file, a folder, a hub id, with its ``config`` where it has
    several; None: the demo data). ``text_field`` is read as the plain-text column "text" (TRL's
    ``dataset_text_field``); ``config_option`` is the command-line option that gave ``config``, for errors."""
    require("reading data (load_rows, the command line's --data)", "train", "datasets")
    from datasets import load_from_disk

    if spec is None:
        spec = str(DEMO_DATA / DEMO_FILES["sft" if task in ("lm", "texts") else task])
    path = Path(spec)
    card = path.is_dir() and _declares_configs(path)  # a clone of a hub dataset: its card says how to read it
    if config is not None and path.exists() and not card:
        raise ValueError(
            f"{config_option} {config!r} names a configuration of a hub dataset, but {spec!r} is a local "
            f"{'folder' if path.is_dir() else 'file'} without any (no dataset card lists configs). Drop "
            f"{config_option}."
        )
    if not path.exists() and _suffix(path) in _SUFFIXES:
        raise ValueError(f"Data file {spec!r} does not exist; check the path (relative to {Path.cwd()}).")
    if path.is_file():
        rows = _select_split({"train": _read_file(path)}, split, "a single data file")
    elif card:
        rows = _load_hub_dataset(spec, config, split, config_option, _content_cache(path))
    elif (path / "dataset_info.json").is_file() and (path / "state.json").is_file():
        # One `Dataset.save_to_disk` folder, which load_dataset refuses: it holds one split, as a single file does,
        # and --split slices it the same way.
        rows = _select_split({"train": load_from_disk(str(path))}, split, "a saved Dataset folder")
    elif (path / "dataset_dict.json").is_file():
        # A `DatasetDict.save_to_disk` folder: its own splits. load_dataset re-guessed them from the folder names
        # (train_sft and train_gen read as one "train"; validation_matched unreachable).
        rows = _select_split(dict(load_from_disk(str(path))), split, "a saved DatasetDict folder")
    elif path.is_dir():
        rows = _select_split(_read_folder(path.absolute()), split, f"data folder {spec!r}")
    else:
        rows = _load_hub_dataset(spec, config, split, config_option)
    if text_field != "text":
        if text_field not in rows.column_names:
            raise ValueError(
                f"--dataset_text_field {text_field!r} is not a column of data {spec!r} (its columns: "
                f"{rows.column_names}). Name the column of plain texts, or drop the option."
            )
        rows = rows.select_columns([text_field]).rename_column(text_field, "text")  # the texts, under TRL's name
    rows = _select(rows, task, spec)
    one_row = len(rows) == 1  # of the whole data, before --max_rows: a file of one object of columns reads as one
    if limit is not None and limit < len(rows):
        rows = rows.select(range(limit))
    if len(rows) == 0:
        raise ValueError(f"Data {spec!r} has no rows for {task!r}.")
    _check_cells(rows, spec, one_row)
    return rows


def _declares_configs(folder: Path) -> bool:
    """Whether ``folder``'s dataset card (README.md) lists configs, as a hub dataset repository's does."""
    import yaml
    from huggingface_hub.repocard import metadata_load

    card = folder / "README.md"
    if not card.is_file():
        return False
    try:  # a data folder's own README (any text, any front matter) is no dataset card
        configs = (metadata_load(card) or {}).get("configs")
    except (UnicodeDecodeError, ValueError, yaml.YAMLError):
        return False
    return isinstance(configs, list) and all(isinstance(c, dict) for c in configs) and bool(configs)


def _load_hub_dataset(
    spec: str, config: str | None, split: str, config_option: str = "--data_config", cache: dict | None = None
) -> Any:
    """``load_dataset(spec, config, split=split)``, its failures named for the command line; ``cache``: the
    keywords of a local folder's `_content_cache`."""
    from datasets import load_dataset

    try:
        return load_dataset(spec, name=config, split=split, **(cache or {}))
    except (FileNotFoundError, ConnectionError) as err:
        raise ValueError(
            f"Cannot load data {spec!r}: it is not an existing file and loading it as a dataset folder or hub "
            f"dataset id failed ({err}). Pass a local .jsonl/.csv/.tsv/.txt/.parquet file or a reachable hub id."
        ) from err
    except ValueError as err:  # e.g. "Config name is missing", an unknown config or split: datasets lists them
        detail = " ".join(str(err).split("Example of usage")[0].split())  # one line, without a Python call
        option = f"{config_option} NAME" if "config" in detail.lower() else "--split NAME"
        raise ValueError(f"Cannot load data {spec!r}: {detail} Choose with {option}.") from err


def check_sts_scores(rows: Any, spec: str) -> None:
    """A rank correlation needs 2 rows and 2 different scores: ``eval-sts`` checks that before the model loads, so
    the error names the data (the evaluation's own check cannot)."""
    values = [float(score) for score in rows["score"]]
    bad = next((i for i, value in enumerate(values) if not math.isfinite(value)), None)
    if bad is not None:
        raise ValueError(
            f"Data {spec!r}: row {bad} (counting from 0) has the score {values[bad]}; gold scores must be finite. "
            "Fill it in or drop the row."
        )
    scores = set(values)
    if len(rows) < 2 or len(scores) < 2:
        found = f"{len(rows)} row" if len(rows) < 2 else f"the same score {scores.pop()} in all {len(rows)} rows"
        raise ValueError(
            f"Data {spec!r} has {found}: a rank correlation with the gold scores needs at least 2 rows with different "
            "scores. Pass more pairs (or a larger --max_rows)."
        )


def _read_file(path: Path) -> Any:
    """One data file, whole, by its suffix: ``.tsv`` without quoting (STS sentences hold quote marks), only an empty
    CSV/TSV cell missing, blank lines of a ``.txt`` dropped. Any failure names the file."""
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    suffix = _suffix(path)
    loader = _SUFFIXES.get(suffix)
    if loader is None:
        raise ValueError(
            f"Data file {str(path)!r} has suffix {suffix!r}; use one of {sorted(_SUFFIXES)} (JSON lines, CSV, "
            "tab-separated with a header, one text per line, or Parquet), the text formats compressed or not "
            f"({', '.join(_COMPRESSED)})."
        )
    if suffix == ".parquet" and path.suffix.lower() in _COMPRESSED:  # Parquet compresses inside; datasets reads no .gz
        raise ValueError(f"Data file {str(path)!r} is a compressed Parquet file; decompress it first (Parquet files "
                         "compress their own columns).")  # fmt: skip
    if path.stat().st_size == 0:
        raise ValueError(f"Data file {str(path)!r} is empty. Pass a file that holds data.")
    extra: dict[str, Any] = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if suffix == ".tsv" else {}
    if loader == "csv":  # only an empty cell is missing (pandas by default also takes "NA", "null", "nan")
        extra.update(keep_default_na=False, na_values=[""])
    try:
        rows = load_dataset(loader, data_files=str(path), split="train", **extra, **_content_cache(path))
    except (DatasetGenerationError, StopIteration, ValueError) as err:  # pandas' and pyarrow's errors are ValueErrors
        cause = err.__cause__ or err
        if "corresponds to no data" in str(cause):  # datasets' words for a file without rows (a header alone)
            raise ValueError(f"Data file {str(path)!r} holds no rows. Pass a file that holds data.") from err
        raise ValueError(
            f"Cannot read data file {str(path)!r} as {_FORMATS[loader]} ({type(cause).__name__}: {cause}). Fix the "
            "file, or give it the suffix of its format."
        ) from err
    if loader == "text":  # one text per line: blank lines separate texts, they are not texts
        rows = rows.filter(lambda row: bool(row["text"].strip()))
        if len(rows) == 0:  # else refused later for a --split slice nobody gave
            raise ValueError(f"Data file {str(path)!r} holds only blank lines. Pass a file that holds texts.")
    return rows


def _content_cache(path: Path) -> dict[str, str]:
    """``load_dataset``'s ``cache_dir`` for local data ``path`` (a file, or a folder's files), keyed by each file's
    name, size, modification and change times. datasets keys its cache of a local file by path and modification time
    alone, so a file rewritten keeping its time (``cp -p``, ``rsync -t``, ``tar x``) was read from the cache: the old
    rows, without a word; and a local clone of a hub dataset by its folder's name, so another clone of the same name
    gave its rows. The change time (``st_ctime``) moves on every write and cannot be set back; no file is read here
    (hashing the contents read a whole multi-GB clone for one configuration of it, on every load). Unchanged data still
    reads from its cache (``download_mode="force_redownload"`` would rebuild it on every load, and under torchrun each
    process would rebuild the folder the others read)."""
    import datasets
    import xxhash  # datasets' own fingerprint hash

    def hidden(file: Path) -> bool:  # .git of a cloned hub dataset: not data, and often large
        return any(part.startswith(".") for part in file.relative_to(path).parts)

    digest = xxhash.xxh3_128(str(path.resolve()).encode())
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file() and not hidden(f))
    for file in files:
        stat = file.stat()
        name = "" if file == path else str(file.relative_to(path))
        digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ctime_ns}\0".encode())
    return {"cache_dir": str(Path(datasets.config.HF_DATASETS_CACHE) / "ubmoe-content" / digest.hexdigest())}


def _suffix(path: Path) -> str:
    """The suffix that names a file's format: ``.tsv`` for ``pairs.tsv`` and for ``pairs.tsv.gz``."""
    suffixes = [suffix.lower() for suffix in path.suffixes]
    if len(suffixes) > 1 and suffixes[-1] in _COMPRESSED:
        return suffixes[-2]
    return suffixes[-1] if suffixes else ""


def _read_folder(path: Path) -> dict[str, Any]:
    """A folder of data files as datasets reads one (a split per file-name pattern, ``train*``, ``test*``,
    ``validation*``/``dev*``, else every file in ``train``), each file read by `_read_file`'s rules.

    Why not ``load_dataset(folder)``: it applied none of those rules to the files, and where some file names name a
    split it silently left out every file that names none (a folder of five chat files trained on the one called
    ``*_train.jsonl``)."""
    from datasets import concatenate_datasets
    from datasets.data_files import DataFilesDict, get_data_patterns

    def data_file(file: Path) -> bool:
        hidden = any(part.startswith(".") for part in file.relative_to(path).parts)
        return file.is_file() and not hidden and _suffix(file) in _SUFFIXES

    present = sorted(f for f in path.rglob("*") if data_file(f))
    if not present:
        raise ValueError(
            f"Data folder {str(path)!r} holds no data file ({', '.join(sorted(_SUFFIXES))}) and is not a saved "
            "dataset (save_to_disk). Pass a data file, or a folder holding some."
        )
    patterns = DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
    by_split = {str(name): sorted(Path(f) for f in files if data_file(Path(f))) for name, files in patterns.items()}
    unassigned = sorted(set(present) - {f for files in by_split.values() for f in files})
    if unassigned:
        named = {name: [str(f.relative_to(path)) for f in files] for name, files in by_split.items() if files}
        raise ValueError(
            f"Data folder {str(path)!r}: datasets takes file names as splits ({named}), and "
            f"{[str(f.relative_to(path)) for f in unassigned]} name none, so they would be left out. Pass one file, "
            "or a folder whose files all name their split (train*, test*, validation* or dev*) or none do."
        )
    splits = {}
    for name, files in by_split.items():
        parts = [(f, _read_file(f)) for f in files]
        (first, rows), features = parts[0], parts[0][1].features
        for file, other in parts[1:]:
            common = _common_features(features, other.features)  # e.g. one file's scores all whole numbers
            if common is None:
                raise ValueError(
                    f"Data folder {str(path)!r}: {str(first.relative_to(path))!r} and {str(file.relative_to(path))!r} "
                    f"differ in columns or types ({dict(rows.features)} and {dict(other.features)}); the files of a "
                    "split are read as one table. Pass one file, or make the columns alike."
                )
            features = common
        parts = [(f, part if part.features == features else part.cast(features)) for f, part in parts]
        splits[name] = concatenate_datasets([rows for _, rows in parts]) if len(parts) > 1 else rows
    return splits


def _common_features(one: Any, other: Any) -> Any:
    """Features both files' columns read as, where they differ only in the kind of number or string; None where the
    columns differ in names or otherwise in type."""
    from datasets import Features, Value

    if set(one) != set(other):  # the same columns in another order are alike (each file's keys in its own order)
        return None
    common = {}
    for name in one:
        a, b = one[name], other[name]
        values = isinstance(a, Value) and isinstance(b, Value)
        kinds = {a.dtype, b.dtype} if values else set()
        if a == b:
            common[name] = a
        elif values and all(kind.startswith(("int", "uint")) for kind in kinds):
            common[name] = Value("int64")
        elif values and all(kind.startswith(("int", "uint", "float")) for kind in kinds):
            common[name] = Value("float64")
        elif values and kinds <= {"string", "large_string"}:
            common[name] = Value("large_string")
        else:
            return None
    return Features(common)


def _select_split(splits: dict[str, Any], split: str, what: str) -> Any:
    """The rows ``split`` names (``train``, ``train[:100]``, ``train[-2:]+test[:1]``...) of ``splits``, which ``what``
    holds (a name it lacked used to be ignored, and a whole file read as if it were that split)."""
    from datasets import ReadInstruction, concatenate_datasets

    try:
        parts = ReadInstruction.from_spec(split).to_absolute({name: len(rows) for name, rows in splits.items()})
    except (ValueError, AssertionError) as err:
        held = "one split, 'train'" if list(splits) == ["train"] else f"the splits {sorted(splits)}"
        raise ValueError(
            f"--split {split!r}: {what} holds {held} (a slice such as 'train[:100]' selects rows), and {split!r} "
            f"is not one ({err}). Name a split it holds, or drop --split."
        ) from None
    for part in parts:  # a slice past the end failed later as an IndexError from datasets
        size = len(splits[part.splitname])
        if not 0 <= part.from_ < part.to <= size:
            raise ValueError(
                f"--split {split!r}: {part.splitname!r} of {what} has {size} rows, so the slice selects none. Slice "
                f"within them (e.g. '{part.splitname}[:{max(size // 2, 1)}]'), or drop the slice."
            )
    picked = [splits[part.splitname].select(range(part.from_, part.to)) for part in parts]
    return picked[0] if len(picked) == 1 else concatenate_datasets(picked)


_TEXT_COLUMNS = {"anchor", "positive", "negative", "sentence1", "sentence2", "text", "question"}


def _check_cells(rows: Any, spec: str, one_row: bool = False) -> None:
    """Refuse a missing or empty cell: read on, it would be the text "None", a crash deep in a trainer, or an empty
    text scored as if it were data."""
    for column in rows.column_names:
        for i, value in enumerate(rows[column]):
            if _empty(value):
                raise ValueError(
                    f"Data {spec!r}: row {i} (counting from 0) has an empty {column!r} ({value!r}). Fill it in or "
                    "drop the row."
                )
            if column == "score" and isinstance(value, str) and not _is_number(value):  # one text makes all texts
                raise ValueError(
                    f"Data {spec!r}: row {i} (counting from 0) has the score {value!r}, which is not a number. Write a "
                    "number there or drop the row."
                )
            text_column = column in _TEXT_COLUMNS or HARD_NEGATIVE.fullmatch(column)
            if text_column and not isinstance(value, str):  # a number would be embedded as its digits
                columns_json = isinstance(value, list) and one_row
                fix = (
                    "The file holds one object of columns ({column: [values]}); write one JSON object per row "
                    "(JSON lines) instead."
                    if columns_json
                    else "Write it as a string (in quotes, for JSON) or drop the row."
                )
                raise ValueError(
                    f"Data {spec!r}: row {i} (counting from 0) has {type(value).__name__} {_shown(value)} in "
                    f"{column!r}, which holds texts. {fix}"
                )
            if column == "messages":
                _check_turns(value, i, spec, column)
            if column in ("prompt", "completion"):  # a text, or TRL's conversational form: a list of turns
                if isinstance(value, list):
                    _check_turns(value, i, spec, column)
                elif not isinstance(value, str):
                    raise ValueError(
                        f"Data {spec!r}: row {i} (counting from 0) has {type(value).__name__} {_shown(value)} in "
                        f"{column!r}, which holds a text or a list of chat turns. Write it as a string or drop the row."
                    )


def _empty(value: Any) -> bool:
    """A missing value, a blank text or an empty list."""
    return value is None or (
        isinstance(value, (str, list)) and not (value.strip() if isinstance(value, str) else value)
    )


def _shown(value: Any) -> str:
    """``repr(value)``, cut to a line: a whole column read as one cell was quoted in full (490,000 characters)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_turns(messages: list, row: int, spec: str, column: str) -> None:
    """Refuse a chat turn without a role or with empty content (a system prompt and a tool call may have none):
    trained on, it is a turn of nothing; scored, a last turn of no tokens."""
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(
                f"Data {spec!r}: row {row} (counting from 0), turn {j} of {column!r} is {str(message)[:60]!r}; every "
                "chat turn is a {'role': ..., 'content': ...} object."
            )
        content = message.get("content")
        # a system prompt may be empty, and a tool call has no content
        if _empty(content) and message["role"] != "system" and not message.get("tool_calls"):
            raise ValueError(
                f"Data {spec!r}: row {row} (counting from 0), turn {j} of {column!r} ({message['role']!r}) has empty "
                f"content ({content!r}). Fill it in or drop the row."
            )


def _select(rows: Any, task: str, spec: str) -> Any:
    for columns in COLUMNS[task]:
        if set(columns) <= set(rows.column_names):
            if task == "contrastive" and columns != ("text",):  # a text paired with itself: a label does not matter
                refuse_graded_pairs(rows.column_names, f"Data {spec!r}")  # select_columns would drop it unseen
            if columns[:2] == ("anchor", "positive"):  # every hard negative, not only one called "negative"
                columns += tuple(c for c in rows.column_names if c not in columns and HARD_NEGATIVE.fullmatch(c))
            return rows.select_columns(list(columns))
    wanted = " or ".join("(" + ", ".join(c) + ")" for c in COLUMNS[task])
    hint = (
        " 'conversations' of {'from': ..., 'value': ...} turns is the ShareGPT layout: rename it to 'messages' of "
        "{'role': ..., 'content': ...} turns (roles system, user, assistant)."
        if "conversations" in rows.column_names
        else ""
    )
    raise ValueError(f"Data {spec!r} has columns {rows.column_names}; {task!r} needs columns {wanted}.{hint}")


def refuse_graded_pairs(columns: list[str], what: str, fix: str = "") -> None:
    """Refuse pairs that carry a score or label (sentence-transformers hands those columns to the loss as labels):
    the in-batch-negatives loss ignores them and would take every pair as a positive."""
    graded = sorted({"score", "scores", "label", "labels"} & set(columns))
    if graded:
        raise ValueError(
            f"{what} has columns {columns}: sentence pairs with a {graded[0]!r} (STS or NLI data). Contrastive "
            f"training with in-batch negatives would take every pair as a positive, whatever its {graded[0]}. {fix}"
            "Use pairs that mean the same (anchor, positive[, negative]), or drop that column if every pair is a "
            "positive."
        )


def texts_of(rows: Any) -> list[str]:
    """Plain texts of a 'texts' dataset (chat rows give their first user turn)."""
    column = rows.column_names[0]
    if column != "messages":
        return [str(t) for t in rows[column]]
    texts = []
    for i, messages in enumerate(rows["messages"]):
        user = [_text(m["content"]) for m in messages if m.get("role") == "user"]
        if not user:
            roles = [m.get("role") for m in messages]
            raise ValueError(
                f"Chat row {i} (counting from 0) has no user turn (roles {roles}); the text measured is a chat's "
                "first user turn."
            )
        texts.append(user[0])
    return texts


def _text(content: Any) -> Any:
    """A turn's text: its content, or the text parts of content given as parts ([{"type": "text", "text": ...}])."""
    if not isinstance(content, list):
        return content
    return "\n".join(part["text"] for part in content if isinstance(part, dict) and part.get("type") == "text")


def contrastive_pairs(rows: Any) -> Any:
    """A dataset of (anchor, positive[, negative]) for the contrastive loss; one text column pairs each text with
    itself (unsupervised SimCSE: the two views differ only by dropout)."""
    names = rows.column_names
    if names == ["text"]:
        return rows.map(lambda row: {"anchor": row["text"], "positive": row["text"]}, remove_columns=["text"])
    if names == ["sentence1", "sentence2"]:
        return rows.rename_columns({"sentence1": "anchor", "sentence2": "positive"})
    return rows
