"""`bamgen build --standalone`: one file, the runtime inlined, for a project without bamgen.

The generated module binds its prior to bamgen.runtime. A standalone build carries the runtime
with it: the sources of bamgen/runtime, each as a string, installed on import as a private
package (``_bamgen_runtime_<hash of the sources>``) by a small loader whose get_source serves
them, so that Triton, which reads a kernel's source to compile it, finds them. Then the module
imports from that package instead of bamgen.runtime; everything else is the module as
`bamgen build` writes it.

What it costs (docs/packaging.md): the file is the runtime's size (about 200 KB) on top of the
prior's few hundred lines; its runtime is frozen at the build, so bamgen's later fixes reach it
only by building it again; two standalone files of the same bamgen share one runtime package.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

# the generated module's one import of bamgen: the names it binds (codegen._runtime_imports)
RUNTIME_IMPORT = re.compile(r"^from bamgen\.runtime import (\([^)]*\)|[^\n(]*)\n", re.M)

_BOOTSTRAP = '''

def _bamgen_runtime():
    """bamgen's runtime, inlined by `bamgen build --standalone`: the sources in _RUNTIME_SOURCES,
    imported as the package {package} (one per set of sources, shared by every standalone file
    that carries them). Their loader serves the sources to inspect, which Triton reads to compile
    the kernels."""
    import importlib.abc
    import importlib.util
    import sys

    package = "{package}"
    if package in sys.modules:
        return sys.modules[package]

    class Loader(importlib.abc.InspectLoader):
        def __init__(self, source):
            self.source = source

        def get_source(self, fullname):
            return self.source

        def is_package(self, fullname):
            return fullname == package or _RUNTIME_SOURCES.get(
                fullname[len(package) + 1:].replace(".", "/") + "/__init__.py") is not None

        def exec_module(self, module):
            exec(compile(self.source, module.__spec__.origin, "exec"), module.__dict__)

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != package and not fullname.startswith(package + "."):
                return None
            relative = fullname[len(package) + 1:].replace(".", "/")
            for name, is_package in ((relative + "/__init__.py" if relative else "__init__.py", True),
                                     (relative + ".py", False)):
                if name in _RUNTIME_SOURCES:
                    origin = "/" + package + "/" + name   # (no such file: the loader serves it)
                    spec = importlib.util.spec_from_loader(fullname, Loader(_RUNTIME_SOURCES[name]),
                                                           origin=origin, is_package=is_package)
                    spec.has_location = True
                    if is_package:
                        spec.submodule_search_locations = []
                    return spec
            return None

    sys.meta_path.append(Finder())
    return importlib.import_module(package)



_runtime = _bamgen_runtime()
'''


def runtime_sources() -> dict[str, str]:
    """{path inside bamgen/runtime: source} of every runtime module, sorted by path."""
    root = Path(__file__).resolve().parent.parent / "runtime"
    return {path.relative_to(root).as_posix(): path.read_text(encoding="utf-8")
            for path in sorted(root.rglob("*.py"))}


def inline_runtime(text: str) -> str:
    """A generated module's text with bamgen's runtime inlined (the module docstring says what
    this means; the rest of the module is unchanged)."""
    found = RUNTIME_IMPORT.search(text)
    if found is None:
        raise ValueError("not a module built by this bamgen: its runtime import is missing")
    names = [name.strip() for name in found.group(1).strip("()").split(",") if name.strip()]
    sources = runtime_sources()
    digest = hashlib.sha256("".join(f"{k}\n{v}" for k, v in sources.items()).encode()).hexdigest()
    package = f"_bamgen_runtime_{digest[:16]}"
    blocks = []
    for name, source in sources.items():
        if "'''" in source or source.endswith("\\"):
            raise ValueError(f"bamgen/runtime/{name} cannot be inlined as a raw string")
        blocks.append(f"    {name!r}: r'''{source}''',")
    body = ("\n# bamgen's runtime (bamgen/runtime), inlined: the module's prior binds to it below.\n"
            "_RUNTIME_SOURCES = {\n" + "\n".join(blocks) + "\n}\n"
            + _BOOTSTRAP.format(package=package)
            + "".join(f"{name} = _runtime.{name}\n" for name in names))
    return text[:found.start()] + body.lstrip("\n") + text[found.end():]
