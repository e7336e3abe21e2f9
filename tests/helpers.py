"""Small helpers shared by the compiler tests."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_prior(folder: Path, text: str, name: str = "prior.yaml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m bamgen.cli ARGS`` in a fresh interpreter, as a user's shell would."""
    return subprocess.run([sys.executable, "-m", "bamgen.cli", *args], cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=300, env=env)


def load_script(path: Path, name: str):
    """Import a script that is not in a package (benchmarks/*.py) as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
