"""``bamgen.load``: build a prior into a cache keyed by its content and import it in one call."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from .codegen import compile_spec, write_atomic
from .spec import load_spec


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """$BAMGEN_CACHE_DIR, else $XDG_CACHE_HOME/bamgen, else ~/.cache/bamgen."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("BAMGEN_CACHE_DIR"):
        return Path(os.environ["BAMGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bamgen"


def load_prior(path, *, strategy=None, cache_dir=None) -> ModuleType:
    """Compile ``path`` (cached by build hash: same prior, version and templates, no rebuild)."""
    artifact = compile_spec(load_spec(path), strategy)
    folder = cache_root(cache_dir) / f"{artifact.name}-{artifact.build_hash}"
    target = folder / artifact.filename
    if not target.is_file() or target.read_text(encoding="utf-8") != artifact.text:
        write_atomic(target, artifact.text)
    return import_module_file(target, f"bamgen_cache.{artifact.name}_{artifact.build_hash}")


def import_module_file(path, module_name: str | None = None) -> ModuleType:
    """Import a generated module from its file (once per name)."""
    path = Path(path).resolve()
    module_name = module_name or f"bamgen_file.{path.stem}_{abs(hash(str(path))):x}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module   # Triton reads kernel source through the module's file
    spec.loader.exec_module(module)
    return module
