"""Adapter files, safely: atomic writes, safetensors-only loading, and errors that name the file at fault.

PEFT writes ``adapter_model.safetensors`` with ``safe_save_file`` (imported by name into ``peft.peft_model``) and
reads it with ``load_peft_weights`` (likewise); it reads ``adapter_config.json`` with ``PeftConfig.from_json_file``
and ``PeftConfig._get_peft_type``, the latter before it even knows the file is a UBMoE adapter. PEFT has no hook
for any of these, so `install` swaps those four names and ``PeftModel.save_pretrained``, ``from_pretrained`` and
``load_adapter`` for the wrappers below when ubmoe-peft is imported:

- the weights writer becomes atomic (temp file in the same folder, flush + fsync, ``os.replace``, fsync of the
  folder), so a save killed half-way leaves the previous file intact; this holds for every PEFT method. Recent
  safetensors releases already rename a temp file into place, older ones that our pins allow write in place, and
  we rely on neither; the config, which PEFT writes with a plain ``open(..., "w")``, gets the same treatment in
  ``UBMoEConfig.save_pretrained``;
- the config readers turn unreadable or malformed JSON into `AdapterFileError` naming the file (PEFT raised a bare
  ``JSONDecodeError`` / ``KeyError``); valid files are read exactly as before;
- ``PeftModel.save_pretrained`` refuses ``safe_serialization=False`` for UBMoE adapters before anything is written
  (PEFT would ``torch.save`` a pickle in place, which the reader below refuses);
- the weights reader, for a local UBMoE adapter folder, refuses ``adapter_model.bin`` (a pickle) and turns a
  missing, truncated or corrupted ``adapter_model.safetensors`` into `AdapterFileError`; other methods' adapters
  are loaded by PEFT's own code unchanged;
- ``PeftModel.load_adapter`` into an existing UBMoE adapter (and ``from_pretrained`` given a ``config=``) refuses a
  saved adapter of other settings (scaling, routing, experts), whose weights PEFT would run under the existing ones.

All errors raised here subclass ``ValueError`` (see `UBMoEFileError`), so callers can catch one type.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import errno
import functools
import inspect
import itertools
import json
import os
import secrets
import tempfile
from collections.abc import Callable
from typing import Any

from safetensors import safe_open

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_WEIGHTS_NAME = "adapter_model.bin"
UBMOE_TYPE = "UBMOE"
SETTINGS_KEY = "ubmoe_settings"  # safetensors metadata: the settings the weights were saved with
# The settings that change what a loaded adapter computes (lora_dropout and router_gradient act only in training).
OUTPUT_SETTINGS = (
    "expert_type", "r", "lora_alpha", "use_rslora", "attention_r", "target_modules", "ffn_projections", "top_k",
    "router_dtype", "layers_to_transform", "modules_to_save",
)  # fmt: skip
# Module names hold FSDP1's and torch's activation-checkpoint wrappers as segments (in the middle, for decoder layers
# as units); the state-dict keys of such a model do not.
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
_PENDING_SETTINGS: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("ubmoe_pending_settings")
_OWN_CONFIG: contextvars.ContextVar[bool] = contextvars.ContextVar("ubmoe_own_config")  # from_pretrained, no config=


def unwrapped_name(name: str) -> str:
    """``name`` (a module's or key's) without `WRAPPER_SEGMENTS`: the key its tensors have in the state dict."""
    return functools.reduce(lambda found, segment: found.replace(segment, ""), WRAPPER_SEGMENTS, name)


def settings_json(config: dict[str, Any]) -> str:
    """``config``'s `OUTPUT_SETTINGS` as canonical JSON (sets sorted), to store beside the weights and compare."""
    return json.dumps({k: config.get(k) for k in OUTPUT_SETTINGS}, sort_keys=True, default=sorted)


class UBMoEFileError(ValueError):
    """Base of the errors ubmoe-peft raises for adapter files and adapter/model mismatches."""


class AdapterFileError(UBMoEFileError):
    """An adapter file is missing, unreadable, truncated, corrupted or of a refused kind; the message names it."""


class AdapterMismatchError(UBMoEFileError):
    """An adapter does not fit the model it is loaded into; the message describes both."""


# ---- atomic writes ------------------------------------------------------------------------------------------------
def _fsync_dir(folder: str) -> None:
    with contextlib.suppress(OSError):  # some filesystems (and Windows) cannot open a folder for fsync
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask_mode(full: int) -> int:
    """``full`` (0o666 for files, 0o777 for folders) less the process umask: the mode a plain open/mkdir gives."""
    try:  # Linux shows the umask; elsewhere reading it means setting it, which other threads could see
        with open("/proc/self/status", encoding="ascii") as status:
            mask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0)
        os.umask(mask)
    return full & ~mask


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Write ``path`` all or nothing: ``write(tmp)`` fills a temp file beside it, which is fsynced and renamed.

    A crash or kill at any point leaves either the old file or the complete new one under ``path``; at worst a
    stray ``.<name>.*.tmp`` file remains beside it, which no loader reads. The file gets the mode a plain write
    would give (the old file's, else 0o666 less the umask), not mkstemp's private 0o600.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        mode = os.stat(path).st_mode & 0o7777 if os.path.exists(path) else _umask_mode(0o666)
        write(tmp)
        os.chmod(tmp, mode)  # after the writer, which may itself have renamed a new file onto tmp
        with open(tmp, "rb+") as handle:
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(folder)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)

    atomic_write(path, write)


def check_new_folder(path: str | os.PathLike, name: str | None = None) -> str:
    """The real path of ``path`` (a link is followed) after checking that a new folder can be made there: it does not
    exist or is empty, no part of it is a file, and the folder it goes in is writable. ``name`` (e.g. an option's
    name) is how errors refer to it; they used to come after a whole export, as a raw error naming a temp folder."""
    shown = f"{name} {os.fspath(path)!r}" if name else os.fspath(path)
    path = os.path.realpath(os.fspath(path))
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise FileExistsError(
            f"{shown} already exists and is not an empty folder (its files would mix with the new ones); choose a new "
            "output folder."
        )
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{shown} cannot be made: {existing} is a file, not a folder. Choose another output folder.")
    where = os.path.dirname(path) if existing == path else existing
    if not os.access(where, os.W_OK | os.X_OK):
        raise ValueError(f"{shown} cannot be made: {where} is not writable. Choose a folder you can write to.")
    return path


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, replace: bool = False):
    """Yield a temp folder beside ``path`` to fill; on success it takes the place of ``path``, on failure it is
    removed, with any parent folder made for it.

    ``path`` must not exist yet or be empty (an export never mixes its files with an older one's), unless
    ``replace``: then a folder there is swapped out whole and removed (a re-save leaves nothing of the old one). An
    existing empty folder keeps its permissions; one that cannot be removed (a mount point, as a container's volume
    is) gets the files moved into it instead.
    """
    import shutil

    path = os.path.realpath(os.fspath(path)) if replace else check_new_folder(path)
    parent = os.path.dirname(path)
    made = parent
    while not os.path.exists(os.path.dirname(made)):  # the topmost parent this call makes, removed on failure
        made = os.path.dirname(made)
    made = None if os.path.exists(made) else made
    os.makedirs(parent, exist_ok=True)
    # A mount point (a container's volume) cannot be removed, nor can files be renamed into it from outside: its
    # files are staged inside it. Anything else is staged beside it and swapped in.
    existing = os.path.isdir(path)
    had_files = existing and bool(os.listdir(path))
    inside = existing and not had_files and os.path.ismount(path)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=path if inside else parent)
    old = None
    try:
        os.chmod(tmp, os.stat(path).st_mode & 0o7777 if existing else _umask_mode(0o777))  # not mkdtemp's 0o700
        yield tmp
        if had_files and replace:
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".old", dir=parent)
            os.replace(path, os.path.join(old, "folder"))  # a kill from here to the next line leaves it in .old
        elif inside:
            _move_up(tmp, path)
            return
        elif existing:
            try:
                os.rmdir(path)  # empty
            except OSError as err:  # busy: a mount point ismount does not see (a bind mount within one filesystem)
                if err.errno != errno.EBUSY or os.listdir(path):  # not empty any more: another export filled it
                    raise
                inner = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=path)
                try:
                    for name in os.listdir(tmp):  # a copy across filesystems, into a hidden folder: all or nothing
                        shutil.move(os.path.join(tmp, name), os.path.join(inner, name))
                except BaseException:
                    shutil.rmtree(inner, ignore_errors=True)
                    raise
                os.rmdir(tmp)
                _move_up(inner, path)
                return
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not os.path.exists(path):
            os.replace(os.path.join(old, "folder"), path)
        if made is not None and not any(files for _, _, files in os.walk(made)):
            shutil.rmtree(made, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(parent)


def _move_up(staged: str, path: str) -> None:
    """Move the entries of ``staged``, a folder inside ``path``, into ``path``: renames within one filesystem."""
    for name in os.listdir(staged):
        os.replace(os.path.join(staged, name), os.path.join(path, name))
    os.rmdir(staged)


# ---- reading ------------------------------------------------------------------------------------------------------
def read_json_config(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in ``path``; a missing, unreadable or non-object file raises `AdapterFileError`."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            loaded = json.load(handle)
    except FileNotFoundError as exc:
        raise AdapterFileError(f"{path} does not exist; an adapter folder needs {CONFIG_NAME}.") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise AdapterFileError(
            f"{path} is not a readable JSON file ({type(exc).__name__}: {exc}). It is truncated or corrupted; "
            "save the adapter again with model.save_pretrained(folder)."
        ) from exc
    if not isinstance(loaded, dict):
        raise AdapterFileError(
            f"{path} holds a JSON {type(loaded).__name__}, not an object of adapter settings. It is corrupted; "
            "save the adapter again with model.save_pretrained(folder)."
        )
    return loaded


def _local_folder(model_id: Any, subfolder: str | None) -> str | None:
    if not isinstance(model_id, (str, os.PathLike)):
        return None
    folder = os.path.join(os.fspath(model_id), subfolder) if subfolder else os.fspath(model_id)
    return folder if os.path.isdir(folder) else None


def _looks_local(path: str) -> bool:
    """A path no Hub id can be (``name`` or ``owner/name``): absolute, relative with ``.``/``~``, or deeper."""
    return os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1 or os.sep in path.replace("/", "")


def is_ubmoe_folder(folder: str) -> bool:
    """True when ``folder``'s adapter_config.json says ``peft_type`` UBMOE (unreadable configs count as not)."""
    try:
        return read_json_config(os.path.join(folder, CONFIG_NAME)).get("peft_type") == UBMOE_TYPE
    except AdapterFileError:
        return False


def check_weights_file(folder: str) -> str:
    """The path of ``folder``'s adapter_model.safetensors after checking it exists and is not a pickle."""
    path = os.path.join(folder, WEIGHTS_NAME)
    if os.path.isfile(path):
        return path
    if os.path.exists(os.path.join(folder, PICKLE_WEIGHTS_NAME)):
        raise AdapterFileError(
            f"{folder} holds {PICKLE_WEIGHTS_NAME} (a pickle) but no {WEIGHTS_NAME}. UBMoE adapters are only "
            f"loaded from safetensors, since unpickling can run code. Save it again with "
            f"model.save_pretrained(folder) (safe_serialization=True, the default)."
        )
    raise AdapterFileError(
        f"{path} does not exist, so the adapter in {folder} has no weights. Save it again with "
        "model.save_pretrained(folder), or point to the folder that holds both adapter files."
    )


# ---- wrappers installed into PEFT ---------------------------------------------------------------------------------
class _Weights(dict):
    """A UBMoE adapter's loaded tensors. PEFT looks up the tensors of ``modules_to_save`` by key before any check of
    ours can run (a bare KeyError when the config names modules the file has no tensors for); a missing key here
    names both files instead. Every other use is a plain dict."""

    def __init__(self, tensors: dict, folder: str) -> None:
        super().__init__(tensors)
        self.folder = folder

    def __missing__(self, key: str) -> Any:
        raise AdapterFileError(
            f"{os.path.join(self.folder, CONFIG_NAME)} and {WEIGHTS_NAME} do not match: the model expects the tensor "
            f"{key!r} (for modules_to_save), which the weights file does not hold. The config was edited or belongs to "
            "another save; save the adapter again with model.save_pretrained(folder)."
        )


def _sort_metadata(path: str, metadata: dict[str, str]) -> None:
    """Put the metadata of the safetensors file at ``path`` in sorted key order, in place.

    safetensors writes metadata from a hash map, so with two or more keys their order, and with it the file's bytes,
    changes from save to save; saving the same adapter twice should give the same file (checksums, deduplication).
    The header is rewritten with the same length, only the order of the metadata's entries changing."""
    orders = [dict(order) for order in itertools.permutations(metadata.items())]
    texts = [json.dumps(order, separators=(",", ":"), ensure_ascii=False).encode() for order in orders]
    with open(path, "r+b") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = handle.read(size)
        found = [text for text in texts if b'"__metadata__":' + text in header]
        if len(found) != 1:  # not the layout expected of safetensors' writer: leave the file as written
            return
        handle.seek(8)
        handle.write(header.replace(found[0], texts[orders.index(dict(sorted(metadata.items())))], 1))


def _refuse_shards(tensors: dict, filename: str) -> None:
    """A UBMoE adapter's file must hold whole weights. Saved from a model FSDP shards, PEFT wrote no tensor, 1-D shards
    of flattened weights, or failed in safetensors on a DTensor; the loss showed only at the next load."""
    matrices = (".ubmoe_lora_A.", ".ubmoe_lora_B.", ".ubmoe_attn_A.", ".ubmoe_attn_B.", ".ubmoe_router.")
    whole = [k for k, t in tensors.items() if any(m in k for m in matrices) and t.dim() != 2]  # (a copy's norms: 1-D)
    whole += [k for k, t in tensors.items() if ".ubmoe_router" in k and t.dim() == 2 and t.shape[0] != 2]
    distributed = [k for k, t in tensors.items() if type(t).__name__ == "DTensor"]
    if tensors and not whole and not distributed:
        return
    found = (
        f"{distributed[0]!r} is a DTensor" if distributed
        else f"{whole[0]!r} has shape {tuple(tensors[whole[0]].shape)}" if whole
        else "it would hold no tensor"
    )  # fmt: skip
    raise ValueError(
        f"Cannot save {filename}: {found}, not a whole adapter weight. The model is sharded (FSDP) or the state dict "
        "given holds shards. Gather the full state dict on every process and save it from the main one: "
        "model.save_pretrained(folder, state_dict=full, is_main_process=rank == 0), with full from "
        "torch.distributed.checkpoint.state_dict.get_model_state_dict(model, options=StateDictOptions("
        "full_state_dict=True)) (FSDP2) or model.state_dict() under FSDP.state_dict_type(model, "
        "StateDictType.FULL_STATE_DICT) (FSDP1); the transformers Trainer's save_model does this."
    )


def _wrap_safe_save_file(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def atomic_safe_save_file(tensors: dict, filename: str, metadata: dict | None = None) -> None:
        offloaded = [key for key, tensor in tensors.items() if getattr(tensor, "is_meta", False)]
        if offloaded:  # safetensors' own error: "Cannot copy out of meta tensor; no data!"
            raise ValueError(
                f"Cannot save {filename}: {len(offloaded)} of its tensors are on the meta device (e.g. "
                f"{offloaded[0]!r}): accelerate has offloaded them and keeps their values outside the model. Save "
                "the adapter before offloading the model (model.save_pretrained, then accelerate.cpu_offload)."
            )
        settings = _PENDING_SETTINGS.get({}).get(os.path.abspath(filename))
        if settings is None:
            atomic_write(filename, lambda tmp: original(tensors, tmp, metadata=metadata))
            return
        _refuse_shards(tensors, filename)
        tensors = {unwrapped_name(key): tensor for key, tensor in tensors.items()}  # `_wrapped_copy_keys`
        metadata = {**(metadata or {}), SETTINGS_KEY: settings}  # a UBMoE adapter's weights (`_wrap_save_pretrained`)

        def write(tmp: str) -> None:
            original(tensors, tmp, metadata=metadata)
            _sort_metadata(tmp, metadata)

        atomic_write(filename, write)

    atomic_safe_save_file._ubmoe_wrapped = original  # type: ignore[attr-defined]
    return atomic_safe_save_file


def _wrap_save_pretrained(original: Callable[..., None]) -> Callable[..., None]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_pretrained(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)  # positional options too, as PEFT's signature takes them
        bound.apply_defaults()
        save_directory, safe_serialization = bound.arguments["save_directory"], bound.arguments["safe_serialization"]
        selected = bound.arguments.get("selected_adapters") or list(self.peft_config)
        ubmoe = [name for name in selected if getattr(self.peft_config.get(name), "peft_type", None) == UBMOE_TYPE]
        if ubmoe and not safe_serialization:  # PEFT would torch.save a pickle in place: not atomic, never loaded back
            raise ValueError(
                f"save_pretrained({save_directory!r}, safe_serialization=False) would write the UBMoE adapters "
                f"{ubmoe} as {PICKLE_WEIGHTS_NAME}, a pickle, which ubmoe-peft never loads (unpickling can run "
                f"code) and cannot write atomically. Nothing was written; save with safe_serialization=True (the "
                f"default) for {WEIGHTS_NAME}."
            )
        # PEFT writes each adapter's weights, then its config: a save killed between the two renames leaves new
        # weights beside an older config. The weights carry the settings they were saved with; the loader compares.
        pending = {}  # weights path: settings (PEFT puts an adapter not named "default" in a subfolder)
        for name in ubmoe:
            folder = save_directory if name == "default" else os.path.join(save_directory, name)
            settings = settings_json(self.peft_config[name].to_dict())
            pending[os.path.abspath(os.path.join(folder, WEIGHTS_NAME))] = settings
        given = bound.arguments.get("state_dict", bound.arguments.get("kwargs", {}).get("state_dict"))
        if ubmoe and given is None:  # PEFT failed first, in safetensors, on a DTensor (a base one is not saved)
            adapter = ((n, p) for n, p in self.named_parameters() if ".ubmoe_" in n or ".modules_to_save." in n)
            sharded = next((n for n, p in adapter if type(p.data).__name__ == "DTensor"), None)
            if sharded is not None:
                _refuse_shards({sharded: self.get_parameter(sharded)}, os.path.join(save_directory, WEIGHTS_NAME))
        if ubmoe:  # also a state dict given (transformers' Trainer under FSDP passes the full one)
            aliases = _wrapped_copy_keys(self, given)
            if aliases is not None:  # where the state dict was given, or PEFT's **kwargs
                held = bound.arguments if "state_dict" in bound.arguments else bound.arguments.setdefault("kwargs", {})
                held["state_dict"] = aliases
        token = _PENDING_SETTINGS.set(pending)
        writes = bound.arguments.get("is_main_process", True)  # other ranks write nothing, so keep nothing
        paths = [p for w in pending for p in (w, os.path.join(os.path.dirname(w), CONFIG_NAME))] if writes else []
        kept = _keep_previous(paths)
        try:
            return original(*bound.args, **bound.kwargs)
        except BaseException:  # an error or interrupt part-way: every file is the earlier save's again
            for path, previous in kept.items():
                with contextlib.suppress(OSError):  # the error that stopped the save is the one to see
                    os.replace(previous, path)
            raise
        finally:
            _PENDING_SETTINGS.reset(token)
            for previous in kept.values():
                with contextlib.suppress(OSError):
                    os.remove(previous)

    save_pretrained._ubmoe_wrapped = original  # type: ignore[attr-defined]
    return save_pretrained


def _wrapped_copy_keys(model: Any, given: dict | None = None) -> dict | None:
    """The state dict with each `modules_to_save` copy inside a wrapped unit (an FSDP1 decoder layer, torch's
    activation-checkpoint wrapper) also under its module's name, or None where there is none. PEFT reads such a copy's
    tensors under its module name, wrappers included, which no state-dict key holds: a bare KeyError; the keys saved
    lose the wrappers again when written (`_wrap_safe_save_file`)."""
    from peft.utils.other import AuxiliaryTrainingWrapper

    names = [n for n, m in model.named_modules() if isinstance(m, AuxiliaryTrainingWrapper) and unwrapped_name(n) != n]
    if not names:
        return None
    state = dict(model.state_dict() if given is None else given)
    for name in names:
        plain = unwrapped_name(name)
        state.update({name + key[len(plain) :]: v for key, v in list(state.items()) if key.startswith(plain + ".")})
    return state


def _alive(pid: str) -> bool:
    """Whether ``pid`` (from a link's name) is a running process other than this one (a link of this pid was left
    by an earlier process that had it; saves of one folder from two threads are not supported)."""
    if not (pid.isascii() and pid.isdigit()) or not 0 < int(pid) < 2**22 or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by another user
        return True
    return True


def _keep_previous(paths: list[str]) -> dict[str, str]:
    """{path: a hard link to its current file}, for each of ``paths`` that exists: an atomic rewrite replaces the
    name, the link keeps the earlier file, and moving it back restores that (a save that failed between an adapter's
    weights and its config left new weights beside the earlier config, and neither loaded). A filesystem without
    hard links keeps nothing, as before."""
    import glob

    kept = {}
    for path in paths:
        hidden = os.path.join(os.path.dirname(path), "." + os.path.basename(path))
        for stale in glob.glob(glob.escape(hidden) + ".*.previous"):  # left by a save that was killed
            pid = stale.rsplit(".", 3)[-3]  # .NAME.PID.RANDOM.previous
            if not _alive(pid):  # another live process's link is its way back: kept
                with contextlib.suppress(OSError):
                    os.remove(stale)
        if os.path.isfile(path):
            link = f"{hidden}.{os.getpid()}.{secrets.token_hex(4)}.previous"  # never taken, even by a restarted pid
            with contextlib.suppress(OSError):
                os.link(path, link)
                kept[path] = link
    return kept


def _wrap_load_peft_weights(original: Callable[..., dict]) -> Callable[..., dict]:
    @functools.wraps(original)
    def load_peft_weights(model_id: str, device: str | None = None, **kwargs: Any) -> dict:
        folder = _local_folder(model_id, kwargs.get("subfolder"))
        if folder is None or not is_ubmoe_folder(folder):
            return original(model_id, device, **kwargs)
        path = check_weights_file(folder)
        try:
            weights = _Weights(original(model_id, device, **kwargs), folder=folder)
            with safe_open(path, framework="pt") as handle:
                saved = (handle.metadata() or {}).get(SETTINGS_KEY)
        except Exception as exc:  # safetensors raises its own SafetensorError (an Exception) for bad headers
            raise AdapterFileError(
                f"{path} cannot be read as safetensors ({type(exc).__name__}: {exc}). It is truncated or corrupted; "
                "save the adapter again with model.save_pretrained(folder)."
            ) from exc
        if saved is not None:  # files saved before the settings were stored have none
            _check_settings(saved, os.path.join(folder, CONFIG_NAME), path)
        return weights

    load_peft_weights._ubmoe_wrapped = original  # type: ignore[attr-defined]
    return load_peft_weights


def _check_settings(saved: str, config_path: str, weights_path: str) -> None:
    """Refuse weights whose stored settings differ from the config beside them (another save's, or an edit)."""
    from .tuners.ubmoe.config import UBMoEConfig  # (it imports this module)

    # A key the config file lacks takes its default, as PEFT fills it in: "None in the config" contradicted the load
    defaults = {f.name: f.default for f in dataclasses.fields(UBMoEConfig) if f.default is not dataclasses.MISSING}
    current = json.loads(settings_json({**defaults, **read_json_config(config_path)}))
    try:
        stored = json.loads(saved)
        differ = [k for k in OUTPUT_SETTINGS if stored[k] != current[k]]
    except (ValueError, TypeError, KeyError) as exc:
        raise AdapterFileError(
            f"{weights_path} holds unreadable '{SETTINGS_KEY}' metadata ({type(exc).__name__}: {exc}). It is "
            "corrupted; save the adapter again with model.save_pretrained(folder)."
        ) from exc
    if differ:
        shown = ", ".join(f"{k}={stored[k]!r} in the weights, {current[k]!r} in the config" for k in differ)
        raise AdapterFileError(
            f"{config_path} and {weights_path} come from different saves: {shown}. A save was interrupted between its "
            "two files, or one file was copied or edited. Save the adapter again with model.save_pretrained(folder), "
            "or put back the adapter_config.json saved with these weights."
        )


def _wrap_from_pretrained(original: Any) -> Any:
    def from_pretrained(cls: type, model: Any, model_id: Any, *args: Any, **kwargs: Any) -> Any:
        # Without config=, PEFT builds the adapter from the folder's own config: there is nothing to compare (files
        # saved before a setting existed would differ from the defaults filled in, and load fine)
        config = args[2] if len(args) > 2 else kwargs.get("config")  # after adapter_name and is_trainable
        folder = _local_folder(model_id, kwargs.get("subfolder"))
        _refuse_disk_offload(model, model_id, folder)  # before any change
        from .tuners.ubmoe.layer import UBMoELayer
        from .tuners.ubmoe.model import UBMoEModel
        from .tuners.ubmoe.undo import snapshot

        if any(isinstance(m, UBMoELayer) for m in model.modules()):
            kind = _peft_type(model_id, config, kwargs)
            if kind not in (None, UBMOE_TYPE):  # PEFT only warned, then ran its layers beside the routing UBMoE ones
                raise ValueError(
                    f"{model_id!r} is a {kind} adapter, but the model passed holds UBMoE layers (get_peft_model and "
                    "PeftModel.from_pretrained change their base in place). Load it onto a fresh base model, or get "
                    "the bare base back first with unload() on the UBMoE model."
                )
        # PEFT wraps the base (and `_take_over` the layers of an earlier model on it) before the weights load and are
        # checked: a refused load gives the base, and that model, back as they were (`undo.py`)
        restore = snapshot(model, UBMoEModel.hook_owners(model))
        token = _OWN_CONFIG.set(config is None)  # reset in `finally` below, whatever happens from here
        try:
            return original.__func__(cls, model, model_id, *args, **kwargs)
        except BaseException:
            restore()
            raise
        finally:
            _OWN_CONFIG.reset(token)

    functools.update_wrapper(from_pretrained, original.__func__)  # PEFT's signature and docstring
    wrapped = classmethod(from_pretrained)
    wrapped.__func__._ubmoe_wrapped = original  # type: ignore[attr-defined]
    return wrapped


def _peft_type(model_id: Any, config: Any, kwargs: dict) -> str | None:
    """The PEFT method of the adapter that ``PeftModel.from_pretrained(model, model_id, config=config, **kwargs)``
    loads, read as PEFT reads it (the same call and arguments, so a missing config fails as PEFT's own load would);
    None for a ``config`` that is not a PeftConfig, which PEFT refuses itself."""
    from peft.config import PeftConfig

    if config is not None:
        return str(getattr(config.peft_type, "value", config.peft_type)) if isinstance(config, PeftConfig) else None
    hub = {key: kwargs.get(key) for key in ("subfolder", "revision", "cache_dir", "token")}
    if kwargs.get("use_auth_token"):
        hub["use_auth_token"] = kwargs["use_auth_token"]
    return str(PeftConfig._get_peft_type(model_id, **hub))


def _wrap_load_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_adapter(self: Any, model_id: Any, adapter_name: str, *args: Any, **kwargs: Any) -> Any:
        # PEFT loads into an adapter of that name as it is, so weights saved with another scaling or routing ran under
        # the existing adapter's settings, silently (from_pretrained with a config= of other settings did the same).
        own_config = _OWN_CONFIG.get(False)
        token = _OWN_CONFIG.set(False)  # only the outermost load is from_pretrained's own
        try:
            existing = self.peft_config.get(adapter_name)
            folder = _local_folder(model_id, kwargs.get("subfolder"))
            _refuse_disk_offload(self, model_id, folder)
            ubmoe = getattr(existing, "peft_type", None) == UBMOE_TYPE and folder is not None
            if ubmoe and not own_config and is_ubmoe_folder(folder):
                _check_same_settings(existing, folder, adapter_name)
            from .tuners.ubmoe.model import UBMoEModel
            from .tuners.ubmoe.undo import snapshot

            # The files are checked as PEFT loads their weights, after the new adapter's layers exist: a refused
            # load left that never-loaded adapter in the model (set_adapter ran it, save_pretrained saved it).
            restore = snapshot(self, UBMoEModel.hook_owners(self))
            try:
                return original(self, model_id, adapter_name, *args, **kwargs)
            except BaseException:
                restore()
                raise
        finally:
            _OWN_CONFIG.reset(token)

    load_adapter._ubmoe_wrapped = original  # type: ignore[attr-defined]
    return load_adapter


def _refuse_disk_offload(model: Any, model_id: Any, folder: str | None) -> None:
    """PEFT's loader moves disk-offloaded weights by the names of LoRA-style layers, which stand in place of their
    target module: a UBMoE layer replaces the whole FFN, and loading onto such a base failed with a bare KeyError."""
    offloaded = "disk" in set((getattr(model, "hf_device_map", None) or {}).values())
    if offloaded and folder is not None and is_ubmoe_folder(folder):
        raise ValueError(
            f"Cannot load the UBMoE adapter {model_id!r} into a model with layers offloaded to disk (a device_map "
            "with 'disk' entries): PEFT's loader cannot place a UBMoE adapter's weights there (its LoRA fails on such "
            "a base too). Load the base with every layer in memory (device_map='cpu' or one GPU), load the adapter, "
            "and offload afterwards if you must (accelerate.disk_offload)."
        )


def _check_same_settings(existing: Any, folder: str, adapter_name: str) -> None:
    """Refuse loading the adapter saved in ``folder`` into adapter ``adapter_name`` (config ``existing``) of other
    settings. Both are compared as config objects, with their defaults filled in the same way."""
    config_path = os.path.join(folder, CONFIG_NAME)
    read_json_config(config_path)  # a damaged file is named as such

    def canonical(value: Any) -> Any:  # PEFT may extend modules_to_save in memory (task heads), repeating names
        return sorted(set(value), key=repr) if isinstance(value, list) else value

    ours = json.loads(settings_json(existing.to_dict()))
    saved = json.loads(settings_json(type(existing).from_pretrained(folder).to_dict()))
    differ = [
        k
        for k in OUTPUT_SETTINGS
        if canonical(ours[k]) != canonical(saved[k]) and not (k == "target_modules" and saved[k] is None)
    ]  # no target_modules: the architecture's FFN, which the model's adapter names once wrapped
    if differ:
        shown = ", ".join(f"{k}={saved[k]!r} in the file, {ours[k]!r} in the model" for k in differ)
        raise AdapterMismatchError(
            f"{config_path} was saved with other settings than the model's adapter {adapter_name!r} it is loaded into "
            f"({shown}); its weights would run under the model's settings. Nothing was loaded. Load it under a new "
            f"name (load_adapter(folder, adapter_name=<a name not yet used>)), or "
            f"model.delete_adapter({adapter_name!r}) first; PeftModel.from_pretrained takes the saved settings when "
            "given no config=."
        )


def _wrap_from_json_file(original: Callable[..., dict]) -> Callable[..., dict]:
    def from_json_file(cls: type, path_json_file: str, **kwargs: Any) -> dict[str, Any]:
        read_json_config(path_json_file)  # raises AdapterFileError naming the file; PEFT then reads it as always
        return original.__func__(cls, path_json_file, **kwargs)

    wrapped = classmethod(from_json_file)
    wrapped.__func__._ubmoe_wrapped = original  # type: ignore[attr-defined]
    return wrapped


def _wrap_from_peft_type(original: Callable[..., Any]) -> Callable[..., Any]:
    """PEFT's loaders build a config from its file's dict here; PEFT's generic ones (``PeftConfig`` /
    ``AutoPeftModelForCausalLM.from_pretrained``) without ``UBMoEConfig.from_pretrained``, so a UBMoE config they read
    was taken for a new one: the first version's copy expert with ``ffn_projections`` was refused there."""

    def from_peft_type(cls: type, **kwargs: Any) -> Any:
        from .tuners.ubmoe.config import _LOADING

        token = _LOADING.set(True)
        try:
            config = original.__func__(cls, **kwargs)
        finally:
            _LOADING.reset(token)
        if hasattr(type(config), "is_saved"):  # a UBMoE config, read from a file
            config._from_file = True  # not a dataclass field: never saved
        return config

    wrapped = classmethod(from_peft_type)
    wrapped.__func__._ubmoe_wrapped = original  # type: ignore[attr-defined]
    return wrapped


def _wrap_get_peft_type(original: Callable[..., Any]) -> Callable[..., Any]:
    def _get_peft_type(cls: type, model_id: str, **kwargs: Any) -> Any:
        from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

        folder = _local_folder(model_id, kwargs.get("subfolder"))
        path = None
        if folder is None and isinstance(model_id, (str, os.PathLike)):
            subfolder = kwargs.get("subfolder")
            path = os.path.join(os.fspath(model_id), subfolder) if subfolder else os.fspath(model_id)
        if path is not None and os.path.isfile(path):  # PEFT said "Can't find 'adapter_config.json'" at the file
            raise AdapterFileError(
                f"{path} is a file, but an adapter is loaded from its folder (adapter_config.json and the weights "
                f"beside it). Pass {os.path.dirname(os.path.abspath(path))}."
            )
        if path is not None and not os.path.exists(path) and _looks_local(os.fspath(model_id)):  # PEFT asked the Hub
            raise AdapterFileError(
                f"{path} does not exist (a local path, not a Hub repository id). Pass the folder "
                "model.save_pretrained(folder) wrote."
            )
        if folder is not None and not os.path.isfile(os.path.join(folder, CONFIG_NAME)):
            # PEFT would go on to ask the Hub for a local folder's missing file; say what is missing instead.
            named = sorted(d for d in os.listdir(folder) if os.path.isfile(os.path.join(folder, d, CONFIG_NAME)))
            hint = (
                f" It holds the adapters {named}: save_pretrained puts an adapter not named 'default' in a subfolder "
                f"of that name, so point to e.g. {os.path.join(folder, named[0])}."
                if named
                else ""
            )
            raise AdapterFileError(
                f"{os.path.join(folder, CONFIG_NAME)} does not exist, so {folder} is not an adapter folder. Point to "
                f"the folder model.save_pretrained(folder) wrote.{hint}"
            )
        try:
            peft_type = original.__func__(cls, model_id, **kwargs)
        except KeyError as exc:
            raise AdapterFileError(
                f"{CONFIG_NAME} in {model_id} has no 'peft_type' entry, so it is not a PEFT adapter config (or it "
                "is corrupted). Save the adapter again with model.save_pretrained(folder)."
            ) from exc
        if not isinstance(peft_type, str) or peft_type not in PEFT_TYPE_TO_CONFIG_MAPPING:
            raise AdapterFileError(
                f"{CONFIG_NAME} in {model_id} names peft_type={peft_type!r}, which no installed PEFT method has "
                f"(UBMoE adapters say {UBMOE_TYPE!r}; import ubmoe_peft before loading one)."
            )
        return peft_type

    wrapped = classmethod(_get_peft_type)
    wrapped.__func__._ubmoe_wrapped = original  # type: ignore[attr-defined]
    return wrapped


def _wrap_tuner_init(original: Any) -> Any:
    """Another PEFT method's tuner (LoRA...) on a model that holds UBMoE layers (get_peft_model on the UBMoE model or
    its base, inject_adapter_in_model): PEFT only warned, then wrote its config over the UBMoE model's in the shared
    ``peft_config`` (that model's save became a LoRA config, loading as another model), saved the UBMoE tensors in
    its own file, and its ``disable_adapter()`` turned the UBMoE experts off but left mode bi's attention on. One
    check here covers every way in, before the tuner changes anything."""

    @functools.wraps(original)
    def __init__(self: Any, model: Any, *args: Any, **kwargs: Any) -> None:
        from .tuners.ubmoe.model import UBMoEModel

        if not isinstance(self, UBMoEModel):
            _refuse_ubmoe_inside(type(self).__name__, model)
        original(self, model, *args, **kwargs)

    __init__._ubmoe_wrapped = original  # type: ignore[attr-defined]
    return __init__


def _wrap_peft_model_init(original: Any) -> Any:
    """Prompt learning (prompt or prefix tuning...) builds no tuner, so `_wrap_tuner_init` does not see it: on a
    model holding UBMoE layers it was accepted, the UBMoE layers kept routing inside it, and its save reloaded onto a
    fresh base as another model."""

    @functools.wraps(original)
    def __init__(self: Any, model: Any, peft_config: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(peft_config, "is_prompt_learning", False):
            _refuse_ubmoe_inside(type(peft_config).__name__, model)
        original(self, model, peft_config, *args, **kwargs)

    __init__._ubmoe_wrapped = original  # type: ignore[attr-defined]
    return __init__


def _refuse_ubmoe_inside(method: str, model: Any) -> None:
    from .tuners.ubmoe.layer import UBMoELayer

    if any(isinstance(m, UBMoELayer) for m in model.modules()):
        raise ValueError(
            f"{method} cannot wrap a model that holds UBMoE layers: they would keep routing inside it, but its saves "
            "would not hold them (reloaded onto a fresh base, it is another model), and a tuner such as LoRA would "
            "write its config over the UBMoE model's (shared through the base). Wrap a fresh base, or the plain model "
            "that unload() (the base), merge_and_unload() (a MoE model) or merge_and_unload(target='bi') (the "
            "embedding model) returns from the UBMoE model."
        )


def install() -> None:
    """Install the wrappers into PEFT (idempotent). Called when ubmoe-peft is imported."""
    import peft.peft_model as peft_model
    from peft.config import PeftConfig
    from peft.tuners.tuners_utils import BaseTuner

    if not hasattr(peft_model.safe_save_file, "_ubmoe_wrapped"):
        peft_model.safe_save_file = _wrap_safe_save_file(peft_model.safe_save_file)
    if not hasattr(peft_model.PeftModel.save_pretrained, "_ubmoe_wrapped"):
        peft_model.PeftModel.save_pretrained = _wrap_save_pretrained(peft_model.PeftModel.save_pretrained)
    from_pretrained = inspect.getattr_static(peft_model.PeftModel, "from_pretrained")  # a classmethod
    if not hasattr(from_pretrained.__func__, "_ubmoe_wrapped"):
        peft_model.PeftModel.from_pretrained = _wrap_from_pretrained(from_pretrained)
    if not hasattr(peft_model.PeftModel.load_adapter, "_ubmoe_wrapped"):
        peft_model.PeftModel.load_adapter = _wrap_load_adapter(peft_model.PeftModel.load_adapter)
    if not hasattr(BaseTuner.__init__, "_ubmoe_wrapped"):
        BaseTuner.__init__ = _wrap_tuner_init(BaseTuner.__init__)
    if not hasattr(peft_model.PeftModel.__init__, "_ubmoe_wrapped"):
        peft_model.PeftModel.__init__ = _wrap_peft_model_init(peft_model.PeftModel.__init__)
    if not hasattr(peft_model.load_peft_weights, "_ubmoe_wrapped"):
        peft_model.load_peft_weights = _wrap_load_peft_weights(peft_model.load_peft_weights)
    from_json_file = inspect.getattr_static(PeftConfig, "from_json_file")  # a classmethod of PeftConfigMixin
    if not hasattr(from_json_file.__func__, "_ubmoe_wrapped"):
        PeftConfig.from_json_file = _wrap_from_json_file(from_json_file)
    from_peft_type = inspect.getattr_static(PeftConfig, "from_peft_type")  # a classmethod of PeftConfigMixin
    if not hasattr(from_peft_type.__func__, "_ubmoe_wrapped"):
        PeftConfig.from_peft_type = _wrap_from_peft_type(from_peft_type)
    get_peft_type = inspect.getattr_static(PeftConfig, "_get_peft_type")  # a classmethod of PeftConfigMixin
    if not hasattr(get_peft_type.__func__, "_ubmoe_wrapped"):
        PeftConfig._get_peft_type = _wrap_get_peft_type(get_peft_type)
