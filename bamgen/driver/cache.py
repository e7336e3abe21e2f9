"""The cache behind ``bamgen.load``, and the import hook that makes its modules picklable.

One folder per artifact, named after every specialisation (as FlashInfer's JIT cache names
its artifacts), under the cache root (:func:`cache_root`)::

    <prior name>_<strategy>_<build hash>/
        <prior name>.py     the generated module
        build.json          how to rebuild it: the prior file's text and name, the strategy,
                            and the sha256 of the module's bytes

The build hash is the hash of the module's own text (bamgen/compiler/codegen.py): what the module holds,
the prior and what the compiler printed for it, and nothing of the runtime it binds to (a
runtime fix reaches every cached module without a rebuild). So a folder's content never changes
meaning, and any folder may be deleted while no build is running: the next ``bamgen.load``
writes it again.

A cached module is imported as ``bamgen._cache.<folder name>``, and pickle (``torch.save``,
``torch.multiprocessing``) records its classes under that name. The import hook, installed when
``bamgen`` is imported, resolves the name in any process: it finds the folder under the cache
roots, checks the module's bytes against build.json, and rebuilds the module from build.json
(or, for a shipped prior, from the shipped file) when it is missing or damaged.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from types import ModuleType

from .files import write_if_different
from ..resources import GENERATED_PACKAGE, generated_dir, shipped_prior

PACKAGE = "bamgen._cache"
MANIFEST = "build.json"
CACHE_ENV = "BAMGEN_CACHE_DIR"
_ARTIFACT = re.compile(r"(?P<name>[a-z][a-z0-9_]*)_(?P<strategy>[a-z]+)_(?P<hash>[0-9a-f]{16})")



class CacheUnwritable(OSError):
    """The cache folder cannot be written (BAMGEN_CACHE_DIR names a file, a read-only folder):
    the user's setting to change, which the CLI reports as one line, not as a bug."""


# Cache roots that bamgen.load used in this process (cache_dir=...), searched before the default.
_roots_used: list[Path] = []


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else $BAMGEN_CACHE_DIR, else $XDG_CACHE_HOME/bamgen, else ~/.cache/bamgen."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bamgen"


def artifact_id(name: str, strategy: str, build_hash: str) -> str:
    """The folder and module name of one artifact: ``<name>_<strategy>_<build hash>``."""
    return f"{name}_{strategy}_{build_hash}"


def store(root: Path, artifact, source: bytes, source_name: str) -> str:
    """Write ``artifact`` (a codegen.Artifact) and its build.json under ``root``, each only if
    different; returns the artifact id."""
    ident = artifact_id(artifact.name, artifact.strategy, artifact.build_hash)
    module = artifact.text.encode("utf-8")
    write_if_different(root / ident / artifact.filename, module)
    write_if_different(root / ident / MANIFEST,
                       _manifest(artifact, hashlib.sha256(module).hexdigest(), source, source_name))
    return ident


def _manifest(artifact, module_sha256: str, source: bytes, source_name: str) -> str:
    from .. import __version__
    record = {"name": artifact.name, "strategy": artifact.strategy,
              "build_hash": artifact.build_hash, "bamgen_version": __version__,
              "module_sha256": module_sha256, "source_name": source_name,
              "source": source.decode("utf-8")}
    return json.dumps(record, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def import_cached(root: Path, ident: str) -> ModuleType:
    """Import the artifact ``ident`` of cache ``root`` as ``bamgen._cache.<ident>``."""
    root = Path(root).absolute()
    if root not in _roots_used:
        _roots_used.insert(0, root)
    return importlib.import_module(f"{PACKAGE}.{ident}")


def search_roots() -> list[Path]:
    roots = _roots_used + [cache_root().absolute()]
    return list(dict.fromkeys(roots))


def locate(ident: str) -> Path:
    """The verified module file of artifact ``ident``, rebuilt if missing or damaged."""
    match = _ARTIFACT.fullmatch(ident)
    if match is None:
        raise ModuleNotFoundError(f"No module named '{PACKAGE}.{ident}': bamgen's cached modules "
                                  f"are named <prior>_<strategy>_<16 hex digits>",
                                  name=f"{PACKAGE}.{ident}")
    filename = f"{match['name']}.py"
    roots = search_roots()
    for root in roots:
        folder = root / ident
        manifest = _read_manifest(folder / MANIFEST)
        if manifest is None:
            continue
        if _sha256(folder / filename) == manifest.get("module_sha256"):
            return folder / filename
        return _rebuild(root, ident, manifest)
    rebuilt = _rebuild_shipped(ident, match["name"], match["strategy"])
    if rebuilt is not None:
        return rebuilt
    raise ModuleNotFoundError(
        f"No module named '{PACKAGE}.{ident}': no cache entry {ident} in "
        f"{', '.join(map(str, roots))}. It is a module that bamgen.load built in another "
        f"process; call bamgen.load(<its prior file>) in this process first, or set "
        f"{CACHE_ENV} to the cache folder that process used", name=f"{PACKAGE}.{ident}")


def _read_manifest(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return None
    needed = ("source", "source_name", "strategy", "module_sha256")
    if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in needed):
        return None
    return record


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _rebuild(root: Path, ident: str, manifest: dict) -> Path:
    """Rebuild a damaged or missing module from its build.json."""
    from .loader import build_into_cache   # the compiler: sympy, jinja2
    from ..compiler.spec import parse_spec
    source = manifest["source"].encode("utf-8")
    try:
        spec = parse_spec(source, path=manifest["source_name"])
        rebuilt = build_into_cache(spec, source, manifest["source_name"], manifest["strategy"], root)
    except Exception as exc:
        raise ImportError(f"{PACKAGE}.{ident}: the cached module in {root / ident} is damaged and "
                          f"could not be rebuilt ({type(exc).__name__}: {exc})") from exc
    if rebuilt != ident:
        from .. import __version__
        raise ImportError(
            f"{PACKAGE}.{ident}: the cached module in {root / ident} is damaged, and this bamgen "
            f"({__version__}) builds {rebuilt} from the same prior, not the module that was "
            f"pickled (bamgen {manifest.get('bamgen_version', '?')}). Rebuild the model with a "
            f"module from bamgen.load and load its state_dict instead")
    return root / ident / f"{_ARTIFACT.fullmatch(ident)['name']}.py"


def _rebuild_shipped(ident: str, name: str, strategy: str) -> Path | None:
    """Build a shipped prior into the default cache, if that gives exactly ``ident``."""
    path = shipped_prior(name)
    if path is None:
        return None
    from .loader import build_into_cache
    from ..compiler.spec import load_spec
    try:
        rebuilt = build_into_cache(load_spec(path), path.read_bytes(), path.name, strategy,
                                   cache_root())
    except ValueError:   # a strategy this bamgen does not have
        return None
    except OSError as exc:
        raise ImportError(f"{PACKAGE}.{ident}: cannot rebuild the shipped prior {name} into "
                          f"the cache: {exc}") from exc
    if rebuilt != ident:
        return None
    return cache_root() / ident / f"{name}.py"


class _PackageLoader(importlib.abc.Loader):
    """``bamgen._cache``: an empty package whose submodules the finder below resolves."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__doc__ = "Modules that bamgen.load built, by artifact id (see bamgen.driver.cache)."


class CacheFinder(importlib.abc.MetaPathFinder):
    """Resolves ``bamgen._cache.<artifact id>``, and ``bamgen.generated`` in a source checkout
    (an installed bamgen holds the shipped modules in its own ``bamgen/generated`` folder)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == PACKAGE:
            return importlib.util.spec_from_loader(PACKAGE, _PackageLoader(), is_package=True)
        if fullname.startswith(PACKAGE + "."):
            ident = fullname[len(PACKAGE) + 1:]
            return importlib.util.spec_from_file_location(fullname, locate(ident))
        if fullname == GENERATED_PACKAGE:
            folder = generated_dir()
            if folder is not None:
                spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
                spec.submodule_search_locations = [str(folder)]
                return spec
        return None


def install_import_hook() -> None:
    """Put the finder on ``sys.meta_path`` (once), after the standard finders."""
    if not any(isinstance(finder, CacheFinder) for finder in sys.meta_path):
        sys.meta_path.append(CacheFinder())
