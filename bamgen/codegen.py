"""Stage 4: render the templates with a kernel plan and write the module.

The artifact's header names every specialisation and a build hash (bamgen version, strategy,
source and template contents), so two builds of the same input give the same bytes. Files are
written only when their bytes change, atomically and under a file lock (bamgen/files.py), so
concurrent builds and half-written modules cannot happen.
"""
from __future__ import annotations

import hashlib
import os
import pprint
import re
from dataclasses import dataclass
from pathlib import Path

import jinja2
import sympy as sp

from . import __version__
from .errors import SpecError
from .files import holds, write_if_different
from .lower import CodeBlock, KernelPlan, plan as make_plan
from .resources import resolve_prior, template_dir
from .spec import PriorSpec, load_spec
from .symbolic import analyse
from .tiles import tile_kind, tiles_for


@dataclass(frozen=True)
class Artifact:
    """A rendered module: where it goes and what it holds."""
    name: str
    filename: str
    text: str
    build_hash: str
    notes: tuple[str, ...]
    strategy: str              # the lowering strategy used (the cost model's pick or the override)


def compile_spec(spec: PriorSpec, strategy: str | None = None) -> Artifact:
    """PriorSpec -> rendered module text (no file is touched)."""
    ir = analyse(spec)
    kernel_plan = make_plan(ir, strategy)
    templates = _templates()
    build_hash = _build_hash(spec, kernel_plan.strategy)
    text = templates.get_template("module.py.jinja").render(
        **_context(spec, kernel_plan, build_hash))
    return Artifact(name=spec.name, filename=f"{spec.name}.py", text=_tidy(text),
                    build_hash=build_hash, notes=ir.notes, strategy=kernel_plan.strategy)


def build_file(path: str | os.PathLike, out_dir: str | os.PathLike = "generated", *,
               strategy: str | None = None, check: bool = False) -> tuple[Path, str]:
    """Build ``path`` (a prior file or a shipped prior's name) into ``out_dir``. Returns
    (target, status) with status one of "written", "unchanged", "stale" (check mode, differs)
    or "fresh" (check mode, same)."""
    try:
        artifact = compile_spec(load_spec(resolve_prior(path)), strategy)
    except SpecError as err:
        raise err.located(str(path)) from None
    target = Path(out_dir) / artifact.filename
    if check:
        return target, "fresh" if holds(target, artifact.text) else "stale"
    return target, "written" if write_if_different(target, artifact.text) else "unchanged"


def _templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir())),
                             undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=True,
                             autoescape=False)
    env.filters["assignments"] = _assignments
    return env


def _assignments(lines, indent: int) -> str:
    """Render (name, code) pairs as statements; the template supplies the first indentation."""
    return ("\n" + " " * indent).join(f"{name} = {code}" for name, code in lines)


# The compiler modules whose code decides a build's output (the CLI, AOT and analysis do not).
EMITTING_MODULES = ("formula", "spec", "symbolic", "lower", "printers", "tiles", "codegen")


def _build_hash(spec: PriorSpec, strategy: str) -> str:
    """Everything that decides the module's bytes: bamgen, the strategy, the prior file's bytes
    and name (the header cites it), the templates and the compiler stages."""
    digest = hashlib.sha256()
    digest.update(f"bamgen {__version__}\nstrategy {strategy}\nsource {spec.source_hash}\n"
                  f"file {Path(spec.path).name!r}\n".encode())
    # the templates and the compiler stages: any change to what a build emits changes the hash
    compiler_dir = Path(__file__).parent
    stages = [compiler_dir / f"{name}.py" for name in EMITTING_MODULES]
    for path in sorted(template_dir().glob("*.jinja")) + stages:
        digest.update(path.name.encode() + b"\n" + path.read_bytes())
    return digest.hexdigest()[:16]


def _scalar_args(plan: KernelPlan, block: CodeBlock) -> str:
    """The per-program scalars a printed hook reads: parameters, then hoisted constants."""
    names = [f"prm_{p.name}" for p in plan.params] + [name for name, _ in block.hoisted]
    return "".join(f", {n}" for n in names)


def _init_code(plan: KernelPlan) -> dict[str, str]:
    spec_params = {p.name: p for p in plan.ir.spec.params}
    def code(expr):
        return repr(float(expr)) if expr.is_number else sp.pycode(expr, fully_qualified_modules=True)
    return {p.name: code(spec_params[p.name].init_expr) for p in plan.params}


def _context(spec: PriorSpec, plan: KernelPlan, build_hash: str) -> dict:
    source_name = Path(spec.path).name
    score_text = str(spec.score) if spec.score is not None else "s + log_prior"
    formulas = dict(spec.formulas)
    log_prior_text = formulas.get("log_prior") or f"log({formulas['density']})"
    meta = {
        "name": spec.name,
        "class_name": spec.class_name,
        "description": spec.description,
        "source": spec.source,
        "log_prior": log_prior_text,
        "log_prior_simplified": str(plan.ir.log_prior),
        "score": score_text,
        "params": {p.name: {"init": p.init, "domain": str(p.domain), "learnable": p.learnable,
                            "per_head": p.per_head} for p in plan.params},
        "constants": {p.name: p.value for p in spec.params if p.is_constant},
        "strategy": plan.strategy,
        "skip_below": spec.skip_below,
        "notes": list(plan.ir.notes),
        "bamgen_version": __version__,
        "source_hash": spec.source_hash,
        "build_hash": build_hash,
    }
    header = [
        f"Generated by bamgen {__version__} from {source_name}. Do not edit: rebuild instead.",
        f"artifact={spec.name} strategy={plan.strategy} params={','.join(p.name for p in plan.params) or '-'}"
        f" positions={','.join(plan.positions_used) or '-'} build-hash={build_hash}",
        f"source-sha256={spec.source_hash}",
    ]
    return dict(
        spec=spec, plan=plan, header=header, source_name=source_name,
        prior_meta=pprint.pformat(meta, sort_dicts=False, width=96),
        params=plan.params, learnable=plan.learnable,
        param_names=repr(tuple(p.name for p in plan.params)),
        learnable_names=repr(tuple(p.name for p in plan.learnable)), init_code=_init_code(plan),
        score_text=score_text, log_prior_text=log_prior_text,
        triton_fwd=plan.triton_fwd, triton_bwd=plan.triton_bwd,
        torch_fwd=plan.torch_fwd, torch_bwd=plan.torch_bwd,
        fwd_args=_scalar_args(plan, plan.triton_fwd), bwd_args=_scalar_args(plan, plan.triton_bwd),
        # _logit2's hook: the forward hook for s + log_prior, else _prior_grads (bit-identical
        # logits in every kernel; see triton_common.py.jinja)
        logit_block=plan.triton_fwd if plan.score_is_identity else plan.triton_bwd,
        logit_args=_scalar_args(plan, plan.triton_fwd if plan.score_is_identity else plan.triton_bwd),
        prm_args="".join(f", prm_{p.name}" for p in plan.params),
        # the backward's preprocess kernel evaluates the row factors for dK/dV (_bwd_preprocess)
        row_cache=plan.row_factors is not None and not plan.row_factors.reads_i,
        score_args=_scalar_args(plan, plan.row_factors.score) if plan.row_factors else "",
        table=plan.table, distance_table=plan.distance_table, fwd_tab=_table_args(plan, grads=False), bwd_tab=_table_args(plan, grads=True),
        distance_value_first=(_first_output_first(plan.distance_table.code)
                              if plan.distance_table else None),
        clamp_free=_clamp_free(plan), table_groups=_table_groups(plan),
        tile_row_sums=len(plan.learnable) >= 2,   # see the dQ kernel in triton_backward.py.jinja
        skip_repr=_float_repr(plan.skip), tile_kind=tile_kind(plan),
        triton_config=_render_tiles(tiles_for(plan)),
    )


def _first_output_first(block) -> tuple[tuple, tuple]:
    """block's body as (the statements its first output needs, the others), each in the body's
    order: run in that order they compute the same values with the same operations, so a caller
    that wants the first output alone stops after the first part (the distance table of a call
    without a backward: the log-prior, not its derivatives) and gets it bit for bit."""
    needed = set(re.findall(r"[A-Za-z_]\w*", block.outputs[0]))
    first = []
    for name, code in reversed(block.body):
        if name in needed:
            first.append((name, code))
            needed |= set(re.findall(r"[A-Za-z_]\w*", code))
    first.reverse()
    taken = {name for name, _ in first}
    return tuple(first), tuple((name, code) for name, code in block.body if name not in taken)


def _render_tiles(table: dict) -> str:
    """TRITON_CONFIG as readable source: one line per (family, head dim)."""
    lines = ["{"]
    for arch, by_dim in table.items():
        lines.append(f"    {arch!r}: {{")
        for dim, kernels in by_dim.items():
            lines.append(f"        {dim}: {kernels!r},")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def _float_repr(value: float | None) -> str:
    if value is None:
        return "None"
    return 'float("-inf")' if value == float("-inf") else repr(value)


def _table_args(plan: KernelPlan, grads: bool) -> str:
    """The gathered table entries a hook reads (table strategy): tab_v (not for a score
    s + log_prior, whose hooks never see the value), then tab_<param>."""
    if plan.table is None:
        return ""
    names = [] if plan.score_is_identity else ["tab_v"]
    names += [f"tab_{n}" for n in plan.table.grads] if grads else []
    return "".join(f", {n}" for n in names)


def _table_groups(plan: KernelPlan) -> tuple[tuple[str, ...], ...]:
    """The dQ kernel's names for the interleaved backward table (table strategy with derivative
    tables): tab_v then tab_<param> per distance, in groups of four (one 16-byte vector load
    each), the last padded with unused names. Empty where there is no derivative table: the
    dQ kernel then reads the log-prior alone from the forward's table."""
    if plan.table is None or not plan.table.grads:
        return ()
    names = ["tab_v"] + [f"tab_{n}" for n in plan.table.grads]
    names += [f"_tab_pad{k}" for k in range(-len(names) % 4)]
    return tuple(tuple(names[k:k + 4]) for k in range(0, len(names), 4))


def _clamp_free(plan: KernelPlan) -> tuple[str, ...]:
    """Learnable parameters whose backward derivative is exactly a (pre-clamped) table entry."""
    if plan.table is None:
        return ()
    if plan.row_factors is not None:   # the dQ kernel accumulates the per-score factors
        outputs = plan.row_factors.score.outputs
    else:
        outputs = plan.triton_bwd.outputs[0 if plan.score_is_identity else 2:]
    return tuple(p.name for p, out in zip(plan.learnable, outputs) if out == f"tab_{p.name}")


def _tidy(text: str) -> str:
    """Strip trailing spaces (left by empty hooks) and runs of more than two blank lines."""
    text = "\n".join(line.rstrip() for line in text.splitlines()) + "\n"
    return re.sub(r"\n{4,}", "\n\n\n", text)
