"""Bounded fuzzing of the adapter loaders: random and mutated adapter_config.json / adapter_model.safetensors.

The contract (docs/reliability.md): loading either succeeds with a working model or raises ``ValueError`` with a
clear message; damaged files raise `ubmoe_peft.io.UBMoEFileError` subclasses. Never a crash, a bare KeyError /
TypeError / JSONDecodeError / SafetensorError, a partly loaded adapter, or an unpickler call. The number of
examples per test is ``UBMOE_FUZZ_EXAMPLES`` (default 40; CI can raise it for a longer run).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct

import peft
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_reliability import logits, tiny, trained, wrap

from ubmoe_peft.io import UBMoEFileError

EXAMPLES = int(os.environ.get("UBMOE_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("adapter")
    trained(wrap()).save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an unpickler was called while loading an adapter")

    monkeypatch.setattr(torch, "load", refuse)


def _load_expecting_contract(folder: pathlib.Path, damaged: str) -> None:
    try:
        model = peft.PeftModel.from_pretrained(tiny(), folder)
    except UBMoEFileError as exc:
        message = str(exc)
        assert len(message) > 40, message
        if "was made for" not in message:  # a file error names the file; a mismatch names both models
            assert damaged in message or "NaN or inf" in message, message
        return
    except ValueError as exc:  # config values the model rejects (e.g. targets it does not have): still ours
        assert type(exc) is ValueError and len(str(exc)) > 40, repr(exc)
        return
    logits(model, torch.arange(6).view(1, 6))  # it runs; flipped data bits may make values huge, which is allowed


def _copy(original: pathlib.Path, tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    folder = tmp_path / name
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(original, folder)
    return folder


# ---- adapter_config.json ------------------------------------------------------------------------------------------
@st.composite
def mutated_config(draw, text: str) -> str:
    config = json.loads(text)
    kind = draw(st.sampled_from(["value", "drop", "add", "truncate", "bytes", "retype"]))
    if kind == "value":
        key = draw(st.sampled_from(sorted(config)))
        config[key] = draw(JSON_VALUES)
    elif kind == "drop":
        for key in draw(st.lists(st.sampled_from(sorted(config)), max_size=4, unique=True)):
            del config[key]
    elif kind == "add":
        config[draw(st.text(max_size=10))] = draw(JSON_VALUES)
    elif kind == "truncate":
        return text[: draw(st.integers(0, len(text) - 1))]
    elif kind == "bytes":
        return draw(st.binary(max_size=200)).decode("latin-1")
    else:  # a value of another type at the same key (numbers as strings, lists as dicts, ...)
        key = draw(st.sampled_from(sorted(config)))
        config[key] = {"as_text": str(config[key])} if draw(st.booleans()) else str(config[key])
    return json.dumps(config)


@FUZZ
@given(data=st.data())
def test_fuzzed_config_loads_or_fails_clearly(original, tmp_path, data):
    folder = _copy(original, tmp_path, "config")
    text = data.draw(mutated_config((original / CONFIG).read_text()))
    (folder / CONFIG).write_text(text, encoding="latin-1")
    _load_expecting_contract(folder, CONFIG)


# ---- adapter_model.safetensors ------------------------------------------------------------------------------------
def _header(blob: bytes) -> tuple[int, dict]:
    (size,) = struct.unpack("<Q", blob[:8])
    return size, json.loads(blob[8 : 8 + size])


def _with_header(blob: bytes, header: dict) -> bytes:
    size, _ = _header(blob)
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + blob[8 + size :]


@st.composite
def mutated_weights(draw, blob: bytes) -> bytes:
    size, header = _header(blob)
    kind = draw(st.sampled_from(["truncate", "flip", "random", "shape", "dtype", "offsets", "rename", "size"]))
    tensors = sorted(k for k in header if k != "__metadata__")
    if kind == "truncate":
        return blob[: draw(st.integers(0, len(blob) - 1))]
    if kind == "flip":  # anywhere: header or data
        data = bytearray(blob)
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
        return bytes(data)
    if kind == "random":
        return draw(st.binary(max_size=300))
    if kind == "size":  # a header length that lies
        return struct.pack("<Q", draw(st.integers(0, 2**64 - 1))) + blob[8:]
    key = draw(st.sampled_from(tensors))
    if kind == "shape":
        header[key]["shape"] = draw(st.lists(st.integers(0, 70), max_size=3))
    elif kind == "dtype":
        header[key]["dtype"] = draw(st.sampled_from(["F16", "BF16", "I64", "U8", "BOOL", "F64", "XYZ"]))
    elif kind == "offsets":
        header[key]["data_offsets"] = sorted(draw(st.lists(st.integers(0, len(blob)), min_size=2, max_size=2)))
    else:
        header[draw(st.text(min_size=1, max_size=30))] = header.pop(key)
    return _with_header(blob, header)


@FUZZ
@given(data=st.data())
def test_fuzzed_weights_load_or_fail_clearly(original, tmp_path, data):
    folder = _copy(original, tmp_path, "weights")
    blob = data.draw(mutated_weights((original / WEIGHTS).read_bytes()))
    (folder / WEIGHTS).write_bytes(blob)
    _load_expecting_contract(folder, WEIGHTS)
