"""Build a prior: run the compiler's stages, then the checks of its printed code, then render
(and write) the module. The compiler writes nothing and imports no torch; the checks run the
printed code (bamgen/checks); this module is the only one that does both, in order."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ..compiler import lower
from ..compiler.codegen import Artifact, render
from ..compiler.spec import PriorSpec, load_spec
from ..compiler.symbolic import analysed, formula_field
from ..compiler.timeout import cpu_budget, working_on
from ..checks.inits import check_inits
from ..errors import SpecError
from ..resources import GENERATED_BY, resolve_prior
from .files import generated_by_bamgen, holds, write_if_different
from .standalone import inline_runtime


def plan_prior(ir, strategy: str | None = None) -> lower.KernelPlan:
    """The kernel plan of ``ir`` (bamgen/compiler/lower.py), its printed code then run over the
    prior's whole domain (bamgen/checks/scan.py), both within one CPU budget."""
    from ..checks import scan   # imports torch: before the CPU budget starts
    field = formula_field(ir.spec)
    with cpu_budget(field, "lowering the formula"):
        kernel_plan = lower.plan(ir, strategy)
        with working_on(field, "checking the formula over its domain"):
            scan.check_plan(kernel_plan, lower.kernel_names(ir))
    return kernel_plan


def compile_spec(spec: PriorSpec, strategy: str | None = None, *, standalone: bool = False) -> Artifact:
    """A validated prior file -> its module (no file is touched); standalone: the runtime
    inlined (bamgen/driver/standalone.py)."""
    try:   # (every stage's error names the file: the stages below the spec do not know it)
        check_inits(spec)
        artifact = render(spec, analysed(spec, lambda ir: plan_prior(ir, strategy)))
    except SpecError as err:
        raise err.located(spec.path) from None
    artifact = replace(artifact, warnings=tuple(w.located(spec.path) for w in artifact.warnings))
    if standalone:
        return replace(artifact, text=inline_runtime(artifact.text))
    return artifact


def check_target(target: Path, prior: str | os.PathLike) -> None:
    """Refuse to replace a file at ``target`` that bamgen did not generate (a module of the
    user's package that has the prior's name, utils.py or layers.py): a SpecError naming it and
    how to fix it. A module bamgen generated, by any version, is replaced as before."""
    if target.is_file() and not generated_by_bamgen(target):
        raise SpecError(f"exists and bamgen did not generate it (its first line is not "
                        f"'# {GENERATED_BY} ...'): the module of {prior} would replace it; "
                        f"nothing was written", file=str(target),
                        hint=f"give the prior another name with `name:` in {prior}, build into "
                             f"another --out folder, or remove {target} if it is not needed")


def build_file(path: str | os.PathLike, out_dir: str | os.PathLike = "generated", *,
               strategy: str | None = None, check: bool = False,
               standalone: bool = False) -> tuple[Path, str]:
    """Build ``path`` (a prior file or a shipped prior's name) into ``out_dir``. Returns
    (target, status) with status one of "written", "unchanged", "stale" (check mode, differs)
    or "fresh" (check mode, same)."""
    try:
        artifact = compile_spec(load_spec(resolve_prior(path)), strategy, standalone=standalone)
    except SpecError as err:
        raise err.located(str(path)) from None
    target = Path(out_dir) / artifact.filename
    if check:
        return target, "fresh" if holds(target, artifact.text) else "stale"
    check_target(target, path)
    return target, "written" if write_if_different(target, artifact.text) else "unchanged"
