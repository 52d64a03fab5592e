"""Lazy re-exports for a package's public names (PEP 562), so that importing a package for one
name does not import every module behind the others."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``exports`` maps each public name to the module
    that defines it, imported on first use and then cached in the package.

    Raises (from the returned function):
        AttributeError: a name that is not exported.
    """

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return getattr_
