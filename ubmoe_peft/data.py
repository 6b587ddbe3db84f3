"""Datasets for the command line: a local file, a local folder or a hub dataset id, else the embedded demo data.

Loading is `datasets.load_dataset`; this module only picks the loader for a file's suffix, names the columns each
task needs and turns a mismatch into an error that lists what the data has.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

DEMO_DATA = Path(__file__).parent / "demo_data"
DEMO_FILES = {"contrastive": "triplets.jsonl", "sts": "sts.tsv", "sft": "chat.jsonl"}
_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv", ".txt": "text", ".parquet": "parquet"}

# Per task, the accepted column sets, first match wins.
COLUMNS = {
    "contrastive": [("anchor", "positive", "negative"), ("anchor", "positive"), ("sentence1", "sentence2"), ("text",)],
    "sts": [("sentence1", "sentence2", "score")],
    "sft": [("messages",), ("prompt", "completion"), ("text",)],
    "lm": [("question", "choices", "label"), ("messages",), ("prompt", "completion"), ("text",)],
    "texts": [("text",), ("sentence1",), ("anchor",), ("question",), ("messages",)],
}


def load_rows(spec: str | None, task: str, split: str = "train", limit: int | None = None) -> Any:
    """A `datasets.Dataset` for ``task`` from ``spec`` (a file, a folder, a hub id; None: the demo data)."""
    from datasets import ReadInstruction, load_dataset, load_from_disk
    from datasets.exceptions import DatasetGenerationError

    if spec is None:
        spec = str(DEMO_DATA / DEMO_FILES["sft" if task in ("lm", "texts") else task])
    path = Path(spec)
    if not path.exists() and path.suffix.lower() in _SUFFIXES:
        raise ValueError(f"Data file {spec!r} does not exist; check the path (relative to {Path.cwd()}).")
    try:
        if path.is_file():
            loader = _SUFFIXES.get(path.suffix.lower())
            if loader is None:
                raise ValueError(
                    f"Data file {spec!r} has suffix {path.suffix!r}; use one of {sorted(_SUFFIXES)} "
                    "(JSON lines, CSV, tab-separated with a header, one text per line, or Parquet)."
                )
            _check_one_split(split, "a single data file")
            extra = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if path.suffix.lower() == ".tsv" else {}
            if loader == "csv":  # only an empty cell is missing (pandas by default also takes "NA", "null", "nan")
                extra.update(keep_default_na=False, na_values=[""])
            rows = load_dataset(loader, data_files=str(path), split=split, **extra)
            if loader == "text":  # one text per line: blank lines separate texts, they are not texts
                rows = rows.filter(lambda row: bool(row["text"].strip()))
        elif (path / "dataset_info.json").is_file() and (path / "state.json").is_file():
            # One `Dataset.save_to_disk` folder, which load_dataset refuses (a saved DatasetDict has a folder per
            # split and loads below): it holds one split, as a single file does, and --split slices it the same way.
            _check_one_split(split, "a saved Dataset folder")
            rows = load_from_disk(str(path))
            parts = ReadInstruction.from_spec(split).to_absolute({"train": len(rows)})
            rows = rows.select([i for part in parts for i in range(part.from_, part.to)])
        else:
            rows = load_dataset(spec, split=split)
    except DatasetGenerationError as err:  # e.g. a folder of files of different formats or columns
        raise ValueError(
            f"Cannot read data {spec!r}: datasets failed to build it ({err.__cause__ or err}). A folder must hold "
            "files of one format with the same columns; or pass a single file."
        ) from err
    except (FileNotFoundError, ConnectionError) as err:
        raise ValueError(
            f"Cannot load data {spec!r}: it is not an existing file and loading it as a dataset folder or hub "
            f"dataset id failed ({err}). Pass a local .jsonl/.csv/.tsv/.txt/.parquet file or a reachable hub id."
        ) from err
    rows = _select(rows, task, spec)
    if limit is not None and limit < len(rows):
        rows = rows.select(range(limit))
    if len(rows) == 0:
        raise ValueError(f"Data {spec!r} has no rows for {task!r}.")
    _check_cells(rows, spec)
    return rows


def _check_one_split(split: str, what: str) -> None:
    """``split`` reads 'train' or a slice of it, the one split that ``what`` holds (a name it lacked was ignored)."""
    from datasets import ReadInstruction

    try:
        ReadInstruction.from_spec(split).to_absolute({"train": 10**6})  # any size: only the name and form count
    except (ValueError, AssertionError) as err:
        raise ValueError(
            f"--split {split!r}: {what} holds one split, 'train' (a slice such as 'train[:100]' selects rows), and "
            f"{split!r} is not it ({err}). Pass a dataset folder or hub id for other splits, or drop --split."
        ) from None


_TEXT_COLUMNS = {"anchor", "positive", "negative", "sentence1", "sentence2", "text", "question"}


def _check_cells(rows: Any, spec: str) -> None:
    """Refuse a missing or empty cell: read on, it would be the text "None", a crash deep in a trainer, or an empty
    text scored as if it were data."""
    for column in rows.column_names:
        for i, value in enumerate(rows[column]):
            empty = value is None or (
                isinstance(value, (str, list)) and not (value.strip() if isinstance(value, str) else value)
            )
            if empty:
                raise ValueError(
                    f"Data {spec!r}: row {i} (counting from 0) has an empty {column!r} ({value!r}). Fill it in or "
                    "drop the row."
                )
            if column in _TEXT_COLUMNS and not isinstance(value, str):  # a number would be embedded as its digits
                raise ValueError(
                    f"Data {spec!r}: row {i} (counting from 0) has {type(value).__name__} {value!r} in {column!r}, "
                    "which holds texts. Write it as a string (in quotes, for JSON) or drop the row."
                )
            if column == "messages":
                _check_turns(value, i, spec)


def _check_turns(messages: list, row: int, spec: str) -> None:
    """Refuse a chat turn without a role or with empty content (a system prompt and a tool call may have none):
    trained on, it is a turn of nothing; scored, a last turn of no tokens."""
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(
                f"Data {spec!r}: row {row} (counting from 0), turn {j} is {str(message)[:60]!r}; every turn of "
                "'messages' is a {'role': ..., 'content': ...} object."
            )
        content = message.get("content")
        blank = content is None or (
            isinstance(content, (str, list)) and not (content.strip() if isinstance(content, str) else content)
        )
        if blank and message["role"] != "system" and not message.get("tool_calls"):  # a tool call has no content
            raise ValueError(
                f"Data {spec!r}: row {row} (counting from 0), turn {j} ({message['role']!r}) has empty content "
                f"({content!r}). Fill it in or drop the row."
            )


def _select(rows: Any, task: str, spec: str) -> Any:
    for columns in COLUMNS[task]:
        if set(columns) <= set(rows.column_names):
            if task == "contrastive" and columns == ("sentence1", "sentence2"):
                refuse_graded_pairs(rows.column_names, f"Data {spec!r}")
            return rows.select_columns(list(columns))
    wanted = " or ".join("(" + ", ".join(c) + ")" for c in COLUMNS[task])
    raise ValueError(f"Data {spec!r} has columns {rows.column_names}; {task!r} needs columns {wanted}.")


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
        user = [m["content"] for m in messages if m.get("role") == "user"]
        if not user:
            roles = [m.get("role") for m in messages]
            raise ValueError(
                f"Chat row {i} (counting from 0) has no user turn (roles {roles}); the text measured is a chat's "
                "first user turn."
            )
        texts.append(user[0])
    return texts


def contrastive_pairs(rows: Any) -> Any:
    """A dataset of (anchor, positive[, negative]) for the contrastive loss; one text column pairs each text with
    itself (unsupervised SimCSE: the two views differ only by dropout)."""
    names = rows.column_names
    if names == ["text"]:
        return rows.map(lambda row: {"anchor": row["text"], "positive": row["text"]}, remove_columns=["text"])
    if names == ["sentence1", "sentence2"]:
        return rows.rename_columns({"sentence1": "anchor", "sentence2": "positive"})
    return rows
