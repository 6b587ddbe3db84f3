"""Optional dependencies: the error that names what is missing and the extra that installs it.

A missing optional package used to surface as a bare ``ModuleNotFoundError`` from deep inside a call (or as another
feature's message), and the command line printed it as a traceback."""

from __future__ import annotations

import importlib.util

_PIP_NAMES = {"sentence_transformers": "sentence-transformers"}  # import name -> pip name, where they differ


class MissingPackageError(ImportError):
    """An optional package a feature needs is not installed; the message names it and the install command."""


def require(feature: str, extra: str, *modules: str) -> None:
    """Raise `MissingPackageError` unless every module in ``modules`` can be imported."""
    missing = [_PIP_NAMES.get(name, name) for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingPackageError(
            f"{feature} needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed. "
            f'Install with: pip install "ubmoe-peft[{extra}]"'
        )
