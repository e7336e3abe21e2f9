"""Where the templates and the shipped priors live.

Installed, they are the package data ``bamgen.templates`` and ``bamgen.priors`` (pyproject maps
the repository's top-level ``templates/`` and ``priors/`` there); in a source checkout that is not
installed, they are those folders themselves.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


def _package_dir(package: str, fallback: str) -> Path:
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if Path(location).is_dir():
                return Path(location)
    return _REPO / fallback


def template_dir() -> Path:
    return _package_dir("bamgen.templates", "templates")


def prior_dir() -> Path:
    return _package_dir("bamgen.priors", "priors")


def shipped_priors() -> list[Path]:
    """The shipped prior files, sorted by name."""
    return sorted(prior_dir().glob("*.yaml"))
