"""Imports that do not depend on the current folder: a generated module imports bamgen.runtime
and nothing else of bamgen, a standalone build nothing of bamgen at all, a module built into a
user's own package imports (and unpickles) from anywhere, and an installed bamgen (a wheel, not
this checkout) ships the built modules as ``bamgen.generated``."""
from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import bamgen
from tests.helpers import ROOT, run_cli, write_prior

# Third-party packages a generated module may import; everything else must be the standard library.
ALLOWED_THIRD_PARTY = {"torch", "triton", "numpy"}

PRIOR = """
name: my_cauchy
description: Cauchy prior — heavy tails
log_prior: -log(1 + ((d - mu) / g) ** 2)
params:
  g: {init: "2**(8*(h + 1)/H)", domain: positive}
  mu: {init: 0.0}
"""


def _run(code: str, cwd: Path, pythonpath: Path | None = None, **env):
    environ = dict(os.environ, TRITON_INTERPRET="1", **env)
    environ.pop("PYTHONPATH", None)
    if pythonpath is not None:
        environ["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=300)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(level, module) of every import statement in ``path``, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(0, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or ""))
    return found


def _assert_standalone(path: Path, runtime: bool = True) -> None:
    """path imports the standard library, torch, triton, numpy and (runtime) bamgen.runtime."""
    source = path.read_text(encoding="utf-8")
    for level, module in _imports(path):
        assert level == 0, f"{path.name}: relative import of {module!r}"
        top = module.split(".")[0]
        if runtime and module == "bamgen.runtime":
            continue
        assert top in ALLOWED_THIRD_PARTY or top in sys.stdlib_module_names, \
            f"{path.name} imports {module!r}, which a user's project may not have"
    for marker in ("sys.path", "os.getcwd", "os.chdir", "__import__"):
        assert marker not in source, f"{path.name} uses {marker}"


@pytest.mark.parametrize("path", sorted((ROOT / "generated").glob("*.py")), ids=lambda p: p.stem)
def test_shipped_modules_import_nothing_relative_to_the_current_folder(path):
    _assert_standalone(path)


def _build_user_package(tmp_path: Path) -> Path:
    """A project with a package ``mypkg`` whose ``attention`` folder holds built modules."""
    project = tmp_path / "project"
    (project / "mypkg").mkdir(parents=True)
    (project / "mypkg" / "__init__.py").write_text("")
    prior = write_prior(tmp_path, PRIOR, "my_cauchy.yaml")
    res = run_cli("build", str(prior), "laplace", "-o", str(project / "mypkg" / "attention"),
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (project / "mypkg" / "attention").iterdir()) == \
        ["laplace.py", "my_cauchy.py"]
    return project


def test_modules_built_into_a_users_package_import_and_unpickle_from_anywhere(tmp_path):
    project = _build_user_package(tmp_path)
    _assert_standalone(project / "mypkg" / "attention" / "my_cauchy.py")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    saved = _run("""
        import torch
        from mypkg.attention.my_cauchy import MyCauchyAttention
        from mypkg.attention.laplace import attention
        attn = MyCauchyAttention(num_heads=2)
        q = torch.randn(1, 2, 7, 8)
        out = attn(q, q, q, causal=True)
        out.sum().backward()
        assert attn.raw_g.grad is not None and torch.isfinite(out).all()
        assert torch.isfinite(attention(q, q, q, b=4.0)).all()
        torch.save(attn, "attn.pt")
    """, cwd=elsewhere, pythonpath=project)
    assert saved.returncode == 0, saved.stderr
    loaded = _run("""
        import torch
        attn = torch.load("attn.pt", weights_only=False)
        print(type(attn).__module__)
    """, cwd=elsewhere, pythonpath=project)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "mypkg.attention.my_cauchy"


def test_standalone_build_runs_without_bamgen(tmp_path):
    """`bamgen build --standalone` writes one file with the runtime inlined: it imports nothing
    of bamgen, and it trains, compiles its kernels (interpreted) and pickles in a process where
    bamgen cannot be imported."""
    out = tmp_path / "vendored"
    res = run_cli("build", "--standalone", "generalized_gaussian", "-o", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    path = out / "generalized_gaussian.py"
    _assert_standalone(path, runtime=False)
    ran = _run("""
        import sys
        sys.modules["bamgen"] = None          # as in a project without bamgen installed
        import torch
        from generalized_gaussian import GeneralizedGaussianAttention, attention
        attn = GeneralizedGaussianAttention(num_heads=2)
        q = torch.randn(1, 2, 9, 16, requires_grad=True)
        for backend in ("torch", "triton"):
            out = attn(q, q, q, causal=True, backend=backend)
            out.sum().backward()
        assert attn.raw_alpha.grad is not None and torch.isfinite(q.grad).all()
        torch.save(attn, "attn.pt")
        print(torch.load("attn.pt", weights_only=False).extra_repr())
    """, cwd=tmp_path, pythonpath=out)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "prior='generalized_gaussian'" in ran.stdout


def test_a_standalone_prior_over_a_grid_offers_grid_without_bamgen(tmp_path):
    """A prior over two position channels needs each patch's coordinates: its standalone build
    offers grid() itself (bamgen.positions cannot be imported there), the same coordinates as
    bamgen.positions.grid, and its attention over them gives the plain module's output."""
    out = tmp_path / "vendored"
    res = run_cli("build", "--standalone", "alibi_2d", "-o", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    _assert_standalone(out / "alibi_2d.py", runtime=False)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 12, 16, generator=g) for _ in range(3))
    torch.save({"q": q, "k": k, "v": v}, tmp_path / "qkv.pt")
    ran = _run("""
        import sys
        sys.modules["bamgen"] = None          # as in a project without bamgen installed
        import torch
        from alibi_2d import attention, grid
        t = torch.load("qkv.pt")
        pos_q = grid(3, 4).expand(2, -1, -1)
        pos_k = grid(3, 4, dtype=torch.float64)[None]
        torch.save({"grid": grid(3, 4), "video": grid(2, 3, 4), "pos_k": pos_k,
                    "out": attention(t["q"], t["k"], t["v"], b=2.0, causal=False, pos_q=pos_q,
                                     pos_k=pos_k.expand(2, -1, -1).float())}, "got.pt")
        try:
            grid(3, 0)
        except ValueError as e:
            print(e)
    """, cwd=tmp_path, pythonpath=out)
    assert ran.returncode == 0, ran.stderr[-3000:]
    got = torch.load(tmp_path / "got.pt")
    plain = importlib.import_module("generated.alibi_2d")
    assert torch.equal(got["grid"], bamgen.positions.grid(3, 4))
    assert torch.equal(got["video"], bamgen.positions.grid(2, 3, 4))
    assert got["pos_k"].dtype == torch.float64
    pos = bamgen.positions.grid(3, 4).expand(2, -1, -1)
    assert torch.equal(got["out"], plain.attention(q, k, v, b=2.0, causal=False, pos_q=pos, pos_k=pos))
    assert ran.stdout.strip() == "grid() takes positive int sizes, e.g. grid(14, 14); got (3, 0)"
    assert plain.grid is bamgen.positions.grid


def test_bamgen_generated_imports_the_shipped_modules_from_any_folder(tmp_path):
    res = _run("""
        import torch
        from bamgen.generated.generalized_gaussian import GeneralizedGaussianAttention
        attn = GeneralizedGaussianAttention(num_heads=2)
        q = torch.randn(1, 2, 5, 8)
        assert torch.isfinite(attn(q, q, q)).all()
    """, cwd=tmp_path)
    assert res.returncode == 0, res.stderr


def _copy_source(dest: Path) -> Path:
    """The files a wheel is built from, so the build leaves nothing in the checkout."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for folder in ("bamgen", "templates", "priors", "generated"):
        shutil.copytree(ROOT / folder, dest / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


@pytest.mark.slow
def test_an_installed_wheel_imports_builds_and_loads_outside_the_repository(tmp_path):
    source = _copy_source(tmp_path / "src")
    wheels, site, work = tmp_path / "wheels", tmp_path / "site", tmp_path / "work"
    work.mkdir()
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(wheels), str(source)], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("bamgen-*.whl")
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q",
                                "--target", str(site), str(wheel)], capture_output=True, text=True,
                               timeout=300, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    shipped = sorted(p.name for p in (site / "bamgen" / "generated").glob("*.py"))
    assert shipped == sorted(p.name for p in (ROOT / "generated").glob("*.py"))

    res = _run("""
        import pathlib, sys, torch
        import bamgen
        site = pathlib.Path("SITE")
        assert pathlib.Path(bamgen.__file__).is_relative_to(site), bamgen.__file__
        from bamgen.generated.laplace import LaplaceAttention
        from bamgen.resources import template_dir, prior_dir
        assert template_dir().is_relative_to(site) and prior_dir().is_relative_to(site)
        q = torch.randn(1, 2, 5, 8)
        assert torch.isfinite(LaplaceAttention(num_heads=2)(q, q, q)).all()
        module = bamgen.load("laplace")                 # built by the installed compiler
        shipped = pathlib.Path(sys.modules["bamgen.generated.laplace"].__file__)
        assert pathlib.Path(module.__file__).read_bytes() == shipped.read_bytes()
        torch.save(module.LaplaceAttention(num_heads=2), "attn.pt")
        import bamgen.integrations.transformers as hf        # the bamgen[hf] extra's module
        assert pathlib.Path(hf.__file__).is_relative_to(site), hf.__file__
        from bamgen.cli import main
        main(["build", "generalized_gaussian", "-o", "mypkg/attention"])
    """.replace("SITE", str(site)), cwd=work, pythonpath=site, BAMGEN_CACHE_DIR=str(work / "cache"))
    assert res.returncode == 0, res.stderr
    assert (work / "mypkg" / "attention" / "generalized_gaussian.py").is_file()
    again = _run("""
        import torch
        print(type(torch.load("attn.pt", weights_only=False)).__module__)
    """, cwd=work, pythonpath=site, BAMGEN_CACHE_DIR=str(work / "cache"))
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("bamgen._cache.laplace_")


def test_a_standalone_build_beside_the_installed_one_runs_its_own_kernels(tmp_path):
    """A standalone file's runtime is frozen at its build: imported beside the installed
    bamgen's build of the same prior (the same math, so the same op name), it registers its own
    ops under its runtime's tag rather than share the first one's, which may be another
    runtime's kernels. Both give the same numbers here, as both runtimes are this one."""
    out = tmp_path / "vendored"
    res = run_cli("build", "--standalone", "laplace", "-o", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    ran = _run("""
        import torch
        import laplace as vendored
        import bamgen
        installed = bamgen.load("laplace")
        assert vendored.OP_NAME.startswith("laplace_") and installed.OP_NAME.startswith(vendored.OP_NAME + "_")
        assert vendored._prior.ops is not installed._prior.ops
        q = torch.randn(1, 2, 9, 16)
        assert torch.equal(vendored.attention(q, q, q, b=4.0), installed.attention(q, q, q, b=4.0))
        print("ok")
    """, cwd=tmp_path, pythonpath=out)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.strip() == "ok"
