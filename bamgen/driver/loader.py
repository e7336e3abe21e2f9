"""``bamgen.load``: build a prior into the cache (bamgen/driver/cache.py) and import it in one call."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

from .cache import CacheUnwritable, cache_root, import_cached, store
from .build import compile_spec
from ..errors import PriorWarning, SpecError
from .files import BuildLockTimeout
from ..resources import resolve_prior
from ..compiler.spec import MAX_FILE_BYTES, PriorSpec, load_spec


def load_prior(prior: str | os.PathLike, *, strategy: str | None = None,
               cache_dir: str | os.PathLike | None = None) -> ModuleType:
    """Build ``prior`` (a file, or a shipped prior's name) into the cache and import it.

    The same prior, strategy and bamgen give the same artifact, written once; an entry that is
    missing or whose bytes differ (a crash, a full disk, an edit) is written again.
    """
    path = resolve_prior(prior)
    spec = load_spec(path)
    root = cache_root(cache_dir)
    ident = build_into_cache(spec, _source_bytes(path, spec), path.name, strategy, root)
    return import_cached(root, ident)


def build_into_cache(spec: PriorSpec, source: bytes, source_name: str, strategy: str | None,
                     root: Path) -> str:
    """Compile ``spec`` and store it under ``root``; returns the artifact id. Each of the
    build's SpecWarnings becomes a PriorWarning (the caller's: bamgen.load's).

    The build's checks compute with CPU tensors whatever default device the caller has set
    (a model built under ``with torch.device("meta")`` or ``"cuda"`` loads its prior there)."""
    import torch
    with torch.device("cpu"):
        artifact = compile_spec(spec, strategy)
    for warning in artifact.warnings:
        warn_once(str(warning))
    try:
        return store(root, artifact, source, source_name)
    except BuildLockTimeout:
        raise
    except OSError as exc:
        raise CacheUnwritable(exc.errno, f"cannot write the bamgen cache in {root} "
                                 f"({exc.strerror or exc}); set BAMGEN_CACHE_DIR to a writable "
                                 f"folder") from exc


_WARNED: set[str] = set()   # the PriorWarnings this process has shown


def warn_once(message: str) -> None:
    """A build's warning as a PriorWarning, once per process (a prior loaded again, or by every
    layer of a model, says it once: Python's own once-per-line record is reset whenever any
    code changes the warning filters), attributed to the first caller outside bamgen (the
    user's bamgen.load or apply_prior line, not bamgen's own)."""
    if message in _WARNED:
        return
    _WARNED.add(message)
    warnings.warn(message, PriorWarning, stacklevel=_outside_bamgen())


def _outside_bamgen() -> int:
    """warnings.warn's stacklevel of the first frame whose code is not bamgen's."""
    package = str(Path(__file__).resolve().parents[1])
    frame, level = sys._getframe(2), 2   # (warn_once's caller is level 2 of warnings.warn)
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _source_bytes(path: Path, spec: PriorSpec) -> bytes:
    """The bytes load_spec validated, for build.json (read again, bounded, and checked)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise SpecError(f"cannot read the file: {exc.strerror}", file=str(path)) from None
    if hashlib.sha256(raw).hexdigest() != spec.source_hash:
        raise SpecError("the file changed while it was being read", file=str(path),
                        hint="load it again once it is saved")
    return raw


def import_module_file(path, module_name: str | None = None) -> ModuleType:
    """Import a generated module from its file (once per name); for `bamgen inspect x.py`."""
    path = Path(path).resolve()
    module_name = module_name or f"bamgen_file.{path.stem}_{abs(hash(str(path))):x}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module   # Triton reads kernel source through the module's file
    spec.loader.exec_module(module)
    return module
