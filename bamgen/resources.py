"""Where the templates, the shipped priors and their built modules live.

Installed, they are the package data ``bamgen.templates`` and ``bamgen.priors`` and the package
``bamgen.generated`` (pyproject maps the repository's top-level ``templates/``, ``priors/`` and
``generated/`` there); in a source checkout, they are those folders themselves.
"""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from .errors import SpecError

_PACKAGE = Path(__file__).resolve().parent
_REPO = _PACKAGE.parent
GENERATED_PACKAGE = "bamgen.generated"
_NAME = re.compile(r"[a-z][a-z0-9_]*")


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


def generated_dir() -> Path | None:
    """The shipped priors' built modules: ``bamgen/generated`` installed, else ``generated/``."""
    for folder in (_PACKAGE / "generated", _REPO / "generated"):
        if folder.is_dir():
            return folder
    return None


def shipped_priors() -> list[Path]:
    """The shipped prior files, sorted by name."""
    return sorted(prior_dir().glob("*.yaml"))


def shipped_prior(name: str) -> Path | None:
    """The shipped prior file of ``name`` (as ``bamgen list`` prints it), or None."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return None
    path = prior_dir() / f"{name}.yaml"
    return path if path.is_file() else None


def resolve_prior(prior: str | os.PathLike) -> Path:
    """A prior file's path from a path or a shipped prior's name; an existing file wins."""
    path, text = Path(prior), os.fspath(prior)
    if text == "":   # (Path("") is the current folder)
        raise SpecError("the path is empty", file="''",
                        hint="give the path of a prior file (.yaml) or a shipped prior's name")
    if path.exists() or not isinstance(text, str) or not _NAME.fullmatch(text):
        return path
    shipped = shipped_prior(text)
    if shipped is None:
        names = ", ".join(p.stem for p in shipped_priors())
        raise SpecError(f"no such file, and no shipped prior named '{text}'", file=text,
                        hint=f"shipped priors: {names}; or give the path of a .yaml file")
    return shipped
