"""Imports deferred until first use: the registries' "module:Name" entries (models, attention backends),
and modules whose import pulls in an optional kernel library (Triton)."""
from __future__ import annotations

import functools
import importlib

from attnzoo.errors import BackendError


def import_object(spec: str):
    """``"package.module:Name"`` -> that object, importing its module now (registries call this on use)."""
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


class _LazyModule:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


def lazy_module(name: str) -> _LazyModule:
    """Module ``name``, imported on first attribute access. The page-table kernels import Triton: a
    backend module holding them this way stays importable (its declaration readable) without it."""
    return _LazyModule(name)


@functools.lru_cache(maxsize=None)
def optional_module(name: str):
    """Module ``name``, or None where a package it needs is not installed (kernels that need Triton: their torch
    references still run). A package installed in a version that lacks what the module imports is an error,
    not a quiet switch to the references."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] == "attnzoo":
            raise
        return None
    except ImportError as e:
        raise BackendError(f"importing {name} failed: {e}",
                           fix="install the versions pyproject.toml asks for (triton>=3.4 for the Triton kernels), "
                               "or uninstall the package to run the torch references") from e
