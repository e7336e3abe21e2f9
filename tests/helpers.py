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


def run_cli_in_process(*args: str, cwd: Path | None = None):
    """The CLI in this process (click's runner; its result has exit_code, stdout and stderr),
    with ``cwd`` as the working folder: for a corpus of refusals, where a fresh interpreter per
    file would cost seconds each and test nothing more than run_cli's few cases do."""
    import os

    from click.testing import CliRunner

    from bamgen.cli import main
    here = os.getcwd()
    os.chdir(cwd or ROOT)
    try:
        return CliRunner().invoke(main, list(args))
    finally:
        os.chdir(here)


def load_script(path: Path, name: str):
    """Import a script that is not in a package (benchmarks/*.py) as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
