"""Stage 4: render a kernel plan as the generated module's text.

A generated module holds its prior and nothing else (docs/architecture.md, "The generated
module"): the PRIOR metadata, default_params, the hooks printed from the plan (torch functions
for the CPU path and the host's distance tables, @triton_hook functions for the Triton kernels)
and its PriorTraits, bound to bamgen.runtime in a few lines. Codegen only renders: the build
driver (bamgen/driver/build.py) runs the stages and the checks and writes files.

The build hash is the sha256 of the module's own text (with the hash left out): the cache key
covers exactly what the module contains, so a change to the runtime reaches built modules
without a rebuild, and a change to what the compiler prints gives a new key.
"""
from __future__ import annotations

import hashlib
import pprint
import re
from dataclasses import dataclass
from pathlib import Path

import jinja2
import sympy as sp

from .. import __version__
from .lower import CodeBlock, KernelPlan
from ..resources import template_dir
from ..runtime.traits import (GRAD_CLAMPED, GRAD_LOGIT_FACTOR, GRAD_TABLE, RUNTIME_ABI,
                             ParamTraits, PriorTraits)
from .spec import PriorSpec
from .tiles import tile_kind

_HASH_SLOT = "#" * 16   # where the build hash goes, while the text is hashed


@dataclass(frozen=True)
class Artifact:
    """A rendered module: where it goes and what it holds."""
    name: str
    filename: str
    text: str
    build_hash: str
    notes: tuple[str, ...]
    strategy: str              # the lowering strategy used (the cost model's pick or the override)


def render(spec: PriorSpec, plan: KernelPlan) -> Artifact:
    """The module of a planned prior (no file is touched)."""
    template = _templates().get_template("module.py.jinja")
    text = _tidy(template.render(**_context(spec, plan, _HASH_SLOT)))
    build_hash = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    return Artifact(name=spec.name, filename=f"{spec.name}.py",
                    text=text.replace(_HASH_SLOT, build_hash), build_hash=build_hash,
                    notes=plan.ir.notes, strategy=plan.strategy)


def traits(spec: PriorSpec, plan: KernelPlan) -> PriorTraits:
    """What the runtime reads about the prior (bamgen.runtime.traits), from the plan."""
    params = tuple(
        ParamTraits(name=p.name, slot=p.index, learnable=p.learnable, per_head=p.per_head,
                    domain=p.domain.kind, lo=p.domain.lo, hi=p.domain.hi, grad_slot=p.grad_index)
        for p in plan.params)
    return PriorTraits(
        name=spec.name, class_name=spec.class_name, params=params,
        reads=tuple(plan.positions_used), distance_only=plan.ir.distance_only,
        distance_table=plan.distance_table is not None, score_is_s=plan.score_is_identity,
        strategy=plan.strategy,
        table_grads=tuple(plan.distance_table.grads) if plan.distance_table is not None else (),
        window=plan.ir.log_prior.has(sp.S.NegativeInfinity),
        skip=plan.skip, skip_below=spec.skip_below, has_bias=plan.has_bias_hook,
        ramp=plan.ramp is not None, ramp_symmetric=plan.ramp_symmetric,
        row_factors=plan.row_factors is not None,
        row_cache=plan.row_factors is not None and not plan.row_factors.reads_i,
        logit_fma=plan.row_factors is not None and plan.row_factors.logit_fma,
        grad_modes=_grad_modes(plan), tile_kind=tile_kind(plan),
        center_grads=(plan.strategy == "inline" and plan.score_is_identity and plan.ramp is None
                      and bool(plan.learnable) and bool(set(plan.positions_used) & {"i", "j", "n"})))


def _grad_modes(plan: KernelPlan) -> tuple[int, ...]:
    """How the dQ kernel takes each learnable parameter's per-score derivative: a table entry
    (clamped on the host), the logit's own factor u (row factors), else a printed derivative."""
    if plan.table is not None and plan.row_factors is not None:
        outputs = plan.row_factors.score.outputs
    elif plan.table is not None:
        outputs = plan.triton_bwd.outputs[0 if plan.score_is_identity else 2:]
    else:
        outputs = ("",) * len(plan.learnable)
    logit_factor = plan.row_factors.logit_factor if plan.row_factors is not None else ()
    modes = []
    for p, out in zip(plan.learnable, outputs):
        if out == f"tab_{p.name}":
            modes.append(GRAD_TABLE)
        elif p.name in logit_factor:
            modes.append(GRAD_LOGIT_FACTOR)
        else:
            modes.append(GRAD_CLAMPED)
    return tuple(modes)


# --------------------------------------------------------------------------------------------
# the hooks, printed


@dataclass(frozen=True)
class Hook:
    """A function of the generated module: its name, arguments, docstring, the statements that
    unpack its inputs, the printed statements, and what it returns."""
    name: str
    args: str
    doc: str
    unpack: tuple[str, ...]
    statements: tuple[tuple[str, str], ...]
    result: str
    triton: bool = False


def torch_hooks(plan: KernelPlan) -> list[Hook]:
    """The prior printed for torch (bamgen.runtime.TorchHooks)."""
    prm = tuple(f"prm_{p.name} = prm[{p.index}]" for p in plan.params)
    pos = "pos_d, pos_i, pos_j, pos_n, prm"
    hooks = [Hook("torch_logit", f"s, {pos}", "the logit of a block of scores", prm,
                  plan.torch_fwd.hoisted + plan.torch_fwd.body, plan.torch_fwd.outputs[0]),
             Hook("torch_logit_grads", f"s, {pos}",
                  "(logit, d logit / d s, d logit / d p per learnable p) of a block of scores", prm,
                  plan.torch_bwd.hoisted + plan.torch_bwd.body, _tuple(plan.torch_bwd.outputs))]
    table = plan.distance_table
    if table is not None:
        if not plan.score_is_identity:
            entries = tuple(f"tab_{name} = tabs[{k}]" for k, name in enumerate(table.grads))
            hooks += [
                Hook("torch_table_logit", f"s, tab_v, {pos}",
                     "the logit, the log-prior read from the distance table (tab_v)", prm,
                     table.logit.hoisted + table.logit.body, table.logit.outputs[0]),
                Hook("torch_table_logit_grads", f"s, tab_v, tabs, {pos}",
                     "(logit, d logit / d s, d logit / d p per learnable p), the log-prior and "
                     "its tabulated derivatives read from the distance table", prm + entries,
                     table.backward.hoisted + table.backward.body, _tuple(table.backward.outputs))]
    return hooks


def _scalar_blocks(plan: KernelPlan) -> list[CodeBlock]:
    """The blocks whose hoisted values prior_scalars computes once per program: the kernels'
    logit and derivative blocks and the row factors' per-score block. (prior_ramp computes its
    own, where the kernels ask for the ramp; the row hooks theirs, once per row.)"""
    blocks = [plan.triton_fwd, plan.triton_bwd] if plan.score_is_identity else [plan.triton_bwd]
    if plan.row_factors is not None:
        blocks.append(plan.row_factors.score)
    return blocks


def triton_hooks(plan: KernelPlan) -> list[Hook]:
    """The prior printed for the Triton kernels (bamgen/runtime/triton/hooks.py)."""
    if not plan.params and plan.score_is_identity and not plan.has_bias_hook:
        return []    # NoPE: the library's defaults
    scalars = [f"prm_{p.name}" for p in plan.params]
    hoisted = [item for block in _scalar_blocks(plan) for item in block.hoisted]
    scalars += [name for name, _ in hoisted]
    unpack = _unpack(scalars, "sc")
    tables = _table_slots(plan)

    def tab(block):
        reads = sorted(block.table_reads, key=tables.index)
        return tuple(f"{name} = tab[{tables.index(name)}]" for name in reads)

    pos = "pos_d, pos_i, pos_j, pos_n"
    loads = tuple((f"prm_{p.name}", f"tl.load(Theta_h + {p.index})") for p in plan.params)
    hooks = [Hook("prior_scalars", "Theta_h",
                  "this head's parameters and what depends on them alone, once per program", (),
                  loads + tuple(hoisted), _tuple(scalars, always=True), triton=True)]
    if plan.has_bias_hook:
        hooks.append(Hook("prior_bias", f"{pos}, sc", "the log-prior", unpack,
                          plan.triton_fwd.body, plan.triton_fwd.outputs[0], triton=True))
    if plan.learnable or not plan.score_is_identity:
        bwd = plan.triton_bwd
        what = ("(d logit / d p per learnable p)" if plan.score_is_identity
                else "(logit, d logit / d s, d logit / d p per learnable p)")
        hooks.append(Hook("prior_grads", f"s, {pos}, tab, sc", what, unpack + tab(bwd), bwd.body,
                          _tuple(bwd.outputs, always=True), triton=True))
    if plan.ramp is not None:
        hooks.append(Hook("prior_ramp", "sc", "(slope, intercept, log(2) * d slope / d p per "
                          "learnable p) of log2(e) * log_prior on the causal side", unpack,
                          plan.ramp.hoisted, _tuple(plan.ramp.outputs, always=True), triton=True))
    factors = plan.row_factors
    if factors is not None:
        prm = _unpack([f"prm_{p.name}" for p in plan.params],
                      "sc" if len(scalars) == len(plan.params) else f"sc[:{len(plan.params)}]")
        hooks += [
            Hook("prior_row_factors", "pos_i, pos_n, sc", "(d logit / d s, then each learnable "
                 "parameter's row factor)", prm, factors.row.hoisted + factors.row.body,
                 _tuple(factors.row.outputs, always=True), triton=True),
            Hook("prior_score_factors", f"s, {pos}, tab, sc", "each learnable parameter's "
                 "per-score factor", unpack + tab(factors.score), factors.score.body,
                 _tuple(factors.score.outputs, always=True), triton=True),
            Hook("prior_logit_row", "pos_i, pos_n, sc", "the logit's row factor r",
                 prm, factors.logit_row.hoisted + factors.logit_row.body,
                 factors.logit_row.outputs[0], triton=True),
            Hook("prior_logit_score", f"s, {pos}, tab, sc",
                 "the v of the logit's per-score factor u = s + v" if factors.logit_fma
                 else "the logit's per-score factor u", prm + tab(factors.logit_score),
                 factors.logit_score.hoisted + factors.logit_score.body,
                 factors.logit_score.outputs[0], triton=True)]
    return hooks


def _wrap(items, first: str = "", rest: str = "", last: str = "", column: int = 0,
          width: int = 96) -> str:
    """`first`, the items joined by ", ", then `last`, broken before an item that would pass
    `width` columns (the first line starts at `column`; the others with `rest`)."""
    lines, cur, start = [], first, column
    for k, item in enumerate(items):
        piece = item + (", " if k < len(items) - 1 else "")
        if start + len((cur + piece).rstrip()) > width and cur.strip() and cur != first:
            lines.append(cur.rstrip())
            cur, start = rest, 0
        cur += piece
    return "\n".join(lines + [cur + last])


def _unpack(names, source: str) -> tuple[str, ...]:
    """`(a, b, ...) = source` as statement lines of a hook (none for no names)."""
    if not names:
        return ()
    return tuple(_wrap(names, "(", " ", (",) = " if len(names) == 1 else ") = ") + source,
                       column=4).split("\n"))


def _table_slots(plan: KernelPlan) -> list[str]:
    """The entries of a tile's `tab` tuple, in order: the log-prior, then its derivatives."""
    if plan.table is None:
        return []
    return ["tab_v"] + [f"tab_{name}" for name in plan.table.grads]


def _tuple(items, always=False) -> str:
    """Printed items as a tuple (one item: itself, unless always)."""
    items = list(items)
    if len(items) == 1 and not always:
        return items[0]
    if len(items) == 1:
        return f"({items[0]},)"
    return f"({', '.join(items)})"


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


# --------------------------------------------------------------------------------------------
# the module


def _templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir())),
                             undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=True,
                             autoescape=False)
    env.filters["assignments"] = _assignments
    env.filters["capitalize_first"] = lambda text: text[:1].upper() + text[1:]
    return env


def _assignments(lines, indent: int) -> str:
    """Render (name, code) pairs as statements; the template supplies the first indentation."""
    return ("\n" + " " * indent).join(f"{name} = {code}" for name, code in lines)


def _init_code(plan: KernelPlan) -> dict[str, str]:
    spec_params = {p.name: p for p in plan.ir.spec.params}

    def code(expr):
        return repr(float(expr)) if expr.is_number else sp.pycode(expr, fully_qualified_modules=True)
    return {p.name: code(spec_params[p.name].init_expr) for p in plan.params}


def _traits_source(value: PriorTraits) -> str:
    """TRAITS as readable source: keyword arguments, the defaults left out, one parameter a line."""
    defaults = PriorTraits("", "", (), (), False, False, False, "")
    always = ("name", "class_name", "reads", "distance_only", "distance_table", "score_is_s",
              "strategy")
    fields = [f"{name}={_literal(getattr(value, name))}" for name in PriorTraits.__dataclass_fields__
              if name != "params" and (name in always or getattr(value, name) != getattr(defaults, name))]
    params = "".join(f"\n        {_param_source(p)}," for p in value.params)
    return ("PriorTraits(\n" + _wrap(fields[:2], "    ", "    ", ",") + "\n"
            + (f"    params=({params}\n    ),\n" if params else "    params=(),\n")
            + _wrap(fields[2:], "    ", "    ", ")"))


def _param_source(p: ParamTraits) -> str:
    args = [repr(p.name), f"slot={p.slot}", f"learnable={p.learnable}", f"per_head={p.per_head}",
            f"domain={p.domain!r}"]
    if p.domain == "interval":
        args += [f"lo={_literal(p.lo)}", f"hi={_literal(p.hi)}"]
    if p.grad_slot is not None:
        args.append(f"grad_slot={p.grad_slot}")
    return f"ParamTraits({', '.join(args)})"


def _literal(v) -> str:
    """A value as Python source (floats: inf and nan through float())."""
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return f'float("{v}")'
    return repr(v)


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
    torch_side = torch_hooks(plan)
    distance = None
    if plan.distance_table is not None:
        first, rest = _first_output_first(plan.distance_table.code)
        distance = dict(prm=tuple(f"prm_{p.name} = prm[{p.index}]" for p in plan.params),
                        hoisted=plan.distance_table.code.hoisted, first=first, rest=rest,
                        outputs=plan.distance_table.code.outputs)
    triton_side = triton_hooks(plan)
    return dict(
        spec=spec, plan=plan, header=header, source_name=source_name, abi=RUNTIME_ABI,
        prior_meta=pprint.pformat(meta, sort_dicts=False, width=96),
        traits=_traits_source(traits(spec, plan)),
        params=plan.params, learnable=plan.learnable,
        param_names=repr(tuple(p.name for p in plan.params)),
        learnable_names=repr(tuple(p.name for p in plan.learnable)), init_code=_init_code(plan),
        score_text=score_text, log_prior_text=log_prior_text,
        distance=distance, torch_hooks=torch_side, triton_hooks=triton_side,
        torch_binding=_torch_binding(torch_side, distance is not None),
        triton_binding=_wrap([h.name for h in triton_side], "(", " " * 5,
                             ",)" if len(triton_side) == 1 else ")", column=4),
        values=_values_dict(plan),
        param_args="".join(f"{p.name}, " for p in plan.params),
    )


def _torch_binding(hooks: list[Hook], distance: bool) -> str:
    """TorchHooks' arguments: each printed torch hook under its field's name."""
    fields = {"torch_logit": "logit", "torch_logit_grads": "logit_grads",
              "torch_table_logit": "table_logit", "torch_table_logit_grads": "table_logit_grads"}
    args = [f"{fields[h.name]}={h.name}" for h in hooks]
    if distance:
        args.append("distance_prior=distance_prior")
    return _wrap(args, rest=" " * 15, column=15)


def _values_dict(plan: KernelPlan) -> str:
    """The parameters as the dict the runtime takes, {"name": name, ...} (continuation lines
    indented for the template's `return _prior.f(` calls)."""
    return _wrap([f'"{p.name}": {p.name}' for p in plan.params], "{", " " * 12, "}", column=17)


def _tidy(text: str) -> str:
    """Strip trailing spaces (left by empty hooks) and runs of more than two blank lines."""
    text = "\n".join(line.rstrip() for line in text.splitlines()) + "\n"
    return re.sub(r"\n{4,}", "\n\n\n", text)
