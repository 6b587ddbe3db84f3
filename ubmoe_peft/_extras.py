"""Optional dependencies: the error that names what is missing and the extra that installs it.

A missing optional package used to surface as a bare ``ModuleNotFoundError`` from deep inside a call (or as another
feature's message), and the command line printed it as a traceback. An installed release older than the extra's
minimum fails as obscurely, so that is checked too, against this package's own metadata (pyproject.toml's extras)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

from packaging.requirements import Requirement

_PIP_NAMES = {"sentence_transformers": "sentence-transformers"}  # import name -> pip name, where they differ


class MissingPackageError(ImportError):
    """An optional package a feature needs is not installed, or too old; the message names it and the install."""


def _minimums(extra: str) -> dict[str, Requirement]:
    """pip name -> requirement, of ``extra`` as installed (none when this package runs from a source tree)."""
    try:
        declared = importlib.metadata.requires("ubmoe-peft") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    found = (Requirement(line) for line in declared)
    return {r.name: r for r in found if r.marker is not None and r.marker.evaluate({"extra": extra})}


def require(feature: str, extra: str, *modules: str) -> None:
    """Raise `MissingPackageError` unless every module in ``modules`` is installed in a release ``extra`` allows."""
    minimums = _minimums(extra)
    problems = []
    for module in modules:
        name = _PIP_NAMES.get(module, module)
        spec = importlib.util.find_spec(module)
        if spec is None:
            problems.append(f"{name} (not installed)")
            continue
        if spec.origin is None and spec.submodule_search_locations:  # a namespace package: none of ours is one
            folders = ", ".join(spec.submodule_search_locations)
            problems.append(f"{name} (not installed; the folder {folders} has its import name and is imported instead)")
            continue
        wanted = minimums.get(name)
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # importable without metadata (a source folder): unchecked
            continue
        if wanted is not None and not wanted.specifier.contains(version, prereleases=True):
            problems.append(f"{name}{wanted.specifier} ({version} is installed)")
    if problems:
        raise MissingPackageError(
            f"{' and '.join(problems)} {'is' if len(problems) == 1 else 'are'} needed for {feature}. "
            f'Install with: pip install "ubmoe-peft[{extra}]"'
        )
