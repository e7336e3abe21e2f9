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

import ast
import hashlib
import io
import keyword
import pprint
import re
import dataclasses
import tokenize
from dataclasses import dataclass
from pathlib import Path

import jinja2
import sympy as sp

from .. import __version__
from ..errors import SpecWarning
from .lower import CodeBlock, KernelPlan
from ..resources import GENERATED_BY, template_dir
from ..runtime.traits import (GRAD_CLAMPED, GRAD_LOGIT_FACTOR, GRAD_TABLE, HOOK_HELPERS,
                             RUNTIME_ABI, ParamTraits, PriorTraits)
from .spec import PriorSpec
from .symbolic import S
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
    warnings: tuple[SpecWarning, ...] = ()   # what builds but is likely not meant (PriorIR.warnings)


def render(spec: PriorSpec, plan: KernelPlan) -> Artifact:
    """The module of a planned prior (no file is touched)."""
    template = _templates().get_template("module.py.jinja")
    text = _tidy(template.render(**_context(spec, plan, _HASH_SLOT)))
    _check_syntax(spec.name, text)
    build_hash = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    return Artifact(name=spec.name, filename=f"{spec.name}.py",
                    text=text.replace(_HASH_SLOT, build_hash), build_hash=build_hash,
                    notes=plan.ir.notes, strategy=plan.strategy, warnings=plan.ir.warnings)


def _check_syntax(name: str, text: str) -> None:
    """Refuse to hand out a module Python cannot parse: a compiler bug (a name the renaming
    missed, a printed line broken in the wrong place) then stops the build, before anything is
    written, instead of surfacing as a SyntaxError at import, far from its cause."""
    try:
        ast.parse(text)
    except SyntaxError as error:
        line = text.splitlines()[error.lineno - 1].strip() if error.lineno else ""
        raise RuntimeError(f"bamgen generated invalid Python for the prior {name!r} (line "
                           f"{error.lineno}: {error.msg}: {line!r}): a bug of bamgen's, not of "
                           f"the prior file; please report it with the file") from error


def traits(spec: PriorSpec, plan: KernelPlan) -> PriorTraits:
    """What the runtime reads about the prior (bamgen.runtime.traits), from the plan."""
    attrs = storage_attributes(plan)
    params = tuple(
        ParamTraits(name=p.name, slot=p.index, learnable=p.learnable, per_head=p.per_head,
                    domain=p.domain.kind, lo=p.domain.lo, hi=p.domain.hi, grad_slot=p.grad_index,
                    size=p.size, attr=attrs[p.name])
        for p in plan.params)
    return PriorTraits(
        name=spec.name, class_name=spec.class_name, params=params,
        reads=tuple(plan.positions_used), distance_only=plan.ir.distance_only,
        distance_table=plan.distance_table is not None, score_is_s=plan.score_is_identity,
        strategy=plan.strategy,
        table_grads=tuple(plan.distance_table.grads) if plan.distance_table is not None else (),
        window=_hides_keys(plan),
        skip=plan.skip, skip_below=spec.skip_below, has_bias=plan.has_bias_hook,
        ramp=plan.ramp is not None, ramp_symmetric=plan.ramp_symmetric,
        row_factors=plan.row_factors is not None,
        row_cache=plan.row_factors is not None and not plan.row_factors.reads_i,
        logit_fma=plan.row_factors is not None and plan.row_factors.logit_fma,
        grad_modes=_grad_modes(plan), tile_kind=tile_kind(plan),
        center_grads=_centres_grads(plan),
        dist_sums=dist_sums(plan), channels=spec.channels, tensor_positions=plan.tensor_positions,
        position_grads=any(g != 0 for _, g in plan.ir.position_grads),
        causal_only=spec.causal_only)


def _centres_grads(plan: KernelPlan) -> bool:
    """PriorTraits.center_grads: an inline prior with learnable scalars whose logit is s +
    log_prior and reads an absolute position (i, j or n; over several channels i0, j1, .., n), so
    that a derivative may hold a part constant along each row."""
    absolute = any(name[0] in "ijn" for name in plan.positions_used)
    return (plan.strategy == "inline" and plan.score_is_identity and plan.ramp is None
            and bool(plan.learnable) and absolute)


# A table prior with more tabulated learnable scalars than this sums dS per distance in the dQ
# kernel (PriorTraits.dist_sums) instead of accumulating each derivative per score: its cost
# then barely grows with their number (docs/performance.md, "Per-distance sums").
DIST_SUMS_MIN = 4


def dist_sums(plan: KernelPlan) -> bool:
    """The dQ kernel can take every gradient from per-distance sums of dS: the logit is
    s + log_prior(d) from the table, every learnable scalar's derivative is tabulated, and there
    are more than DIST_SUMS_MIN of them."""
    scalars = _learnable_scalars(plan)
    return (plan.table is not None and plan.score_is_identity and plan.ir.distance_only
            and len(plan.table.grads) == len(scalars) > DIST_SUMS_MIN)


# Attributes of torch.nn.Module (and of the generated class) that a parameter's storage must
# not take (tests/compiler/test_spec.py checks the list against the installed torch).
MODULE_ATTRIBUTES = frozenset((
    "T_destination", "add_module", "apply", "bfloat16", "buffers", "call_super_init", "children",
    "compile", "cpu", "cuda", "double", "dump_patches", "eval", "extra_repr", "float", "forward",
    "get_buffer", "get_extra_state", "get_parameter", "get_submodule", "half", "ipu",
    "load_state_dict", "modules", "mtia", "named_buffers", "named_children", "named_modules",
    "named_parameters", "parameters", "register_backward_hook", "register_buffer",
    "register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
    "register_full_backward_pre_hook", "register_load_state_dict_post_hook",
    "register_load_state_dict_pre_hook", "register_module", "register_parameter",
    "register_state_dict_post_hook", "register_state_dict_pre_hook", "requires_grad_",
    "set_extra_state", "set_submodule", "share_memory", "state_dict", "to", "to_empty", "train",
    "training", "type", "xpu", "zero_grad", "num_heads", "prior_params",
    # added to torch.nn.Module by transformers' modeling_utils once a model is built (the HF
    # integration, bamgen.integrations.transformers)
    "smart_apply"))


def storage_attributes(plan: KernelPlan) -> dict[str, str]:
    """{parameter: the nn.Module attribute that stores it, where it is not the default}: a
    learnable x is raw_x and a buffer x is x, unless that name is torch.nn.Module's own
    (training, cuda), private to it (_parameters) or another parameter's: then prior_<name>,
    with '_' appended until it is free. The state dict keys follow."""
    default = {p.name: f"raw_{p.name}" if p.learnable else p.name for p in plan.params}
    taken = set(MODULE_ATTRIBUTES)
    out = {}
    for p in plan.params:
        attr = default[p.name]
        clash = (attr in taken or attr.startswith("_")
                 or any(default[o.name] == attr for o in plan.params if o.name != p.name))
        if clash:
            attr = f"prior_{p.name}"
            while attr in taken or attr in default.values():
                attr += "_"
        taken.add(attr)
        out[p.name] = "" if attr == default[p.name] else attr
    return out


def _learnable_scalars(plan: KernelPlan) -> list[tuple[str, str]]:
    """(label, identifier stem) of each learnable scalar, in gradient-slot order."""
    return [(label, ident) for p in plan.learnable
            for label, ident in zip(_labels(p), p.idents)]


def _labels(p) -> tuple[str, ...]:
    return (p.name,) if p.size is None else tuple(f"{p.name}[{k}]" for k in range(p.size))


def _prm_unpack(plan: KernelPlan, source: str) -> tuple[str, ...]:
    """A hook's statements that name the parameters it receives as a list of columns in slot
    order: (prm_a, prm_b) = prm, or one line a parameter where a vector takes a slice
    (prm_w = prm[0:32], a tuple: its elements are prm_w[0], ...)."""
    if all(p.size is None for p in plan.params):
        return _unpack([f"prm_{p.name}" for p in plan.params], source)
    return tuple(f"prm_{p.name} = {source}[{p.index}]" if p.size is None
                 else f"prm_{p.name} = tuple({source}[{p.index}:{p.index + p.size}])"
                 for p in plan.params)


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
    scalars = _learnable_scalars(plan)
    if len(outputs) < len(scalars):
        outputs = ("",) * len(scalars)
    for (label, ident), out in zip(scalars, outputs):
        if out == f"tab_{ident}":
            modes.append(GRAD_TABLE)
        elif label in logit_factor:
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
    prm = _prm_unpack(plan, "prm")
    pos = "pos_d, pos_i, pos_j, pos_n, prm"
    hooks = [Hook("torch_logit", f"s, {pos}", "the logit of a block of scores", prm,
                  plan.torch_fwd.hoisted + plan.torch_fwd.body, plan.torch_fwd.outputs[0]),
             Hook("torch_logit_grads", f"s, {pos}",
                  "(logit, d logit / d s, d logit / d p per learnable p) of a block of scores", prm,
                  plan.torch_bwd.hoisted + plan.torch_bwd.body, _tuple(plan.torch_bwd.outputs))]
    grads = plan.torch_position_grads
    if grads is not None:
        labels = ", ".join(label for label, _ in plan.ir.position_grads)
        hooks.append(Hook("torch_position_grads", f"s, {pos}",
                          f"(d logit / d {labels}) of a block of scores: the gradients of "
                          f"position tensors", prm, grads.hoisted + grads.body,
                          _tuple(grads.outputs, always=True)))
    table = plan.distance_table
    if table is not None:
        if not plan.score_is_identity:
            idents = dict(_learnable_scalars(plan))
            entries = tuple(f"tab_{idents[label]} = tabs[{k}]" for k, label in enumerate(table.grads))
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
    if plan.triton_position_grads is not None:
        blocks.append(plan.triton_position_grads)
    return blocks


def triton_hooks(plan: KernelPlan, prefix: str = "") -> list[Hook]:
    """The prior printed for the Triton kernels (bamgen/runtime/triton/hooks.py); prefix: before
    each hook's name (pos_: the hooks of the positional plan, beside the main plan's)."""
    if not plan.params and plan.score_is_identity and not plan.has_bias_hook:
        return []    # NoPE: the library's defaults
    hooks = _triton_hooks(plan)
    return [dataclasses.replace(h, name=prefix + h.name) for h in hooks] if prefix else hooks


def _triton_hooks(plan: KernelPlan) -> list[Hook]:
    scalars = [f"prm_{p.name}" for p in plan.params]
    num_scalars = len(scalars)
    hoisted = [item for block in _scalar_blocks(plan) for item in block.hoisted]
    scalars += [name for name, _ in hoisted]
    unpack = _unpack(scalars, "sc")
    tables = _table_slots(plan)

    def tab(block):
        reads = sorted(block.table_reads, key=tables.index)
        return tuple(f"{name} = tab[{tables.index(name)}]" for name in reads)

    pos = "pos_d, pos_i, pos_j, pos_n"
    loads = tuple((f"prm_{p.name}", f"tl.load(Theta_h + {p.index})" if p.size is None
                   else f"Theta_h + {p.index}" if plan.vectors_in_memory   # (a pointer)
                   else f"_load_vector(Theta_h + {p.index}, {p.size})") for p in plan.params)
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
        prm = _unpack(scalars[:num_scalars],
                      "sc" if len(scalars) == num_scalars else f"sc[:{num_scalars}]")
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
    table = plan.distance_table
    if plan.table is not None and table is not None and table.triton is not None:
        hooks.append(_distance_hook(plan, table.triton))
    grads = plan.triton_position_grads
    if grads is not None:
        labels = ", ".join(label for label, _ in plan.ir.position_grads)
        hooks.append(Hook("prior_position_grads", f"s, {pos}, sc",
                          f"(d logit / d {labels}): the gradients of position tensors", unpack,
                          grads.body, _tuple(grads.outputs, always=True), triton=True))
    return hooks


def _distance_hook(plan: KernelPlan, block) -> Hook:
    """prior_distance: the distance table's entries over float64 distances pos_d, the head's
    parameters read in float64 (vectors as tuples of scalars), for the table kernel
    (bamgen/runtime/triton/table.py)."""
    loads = tuple((f"prm_{p.name}", f"tl.load(Theta_h + {p.index}).to(tl.float64)" if p.size is None
                   else f"_load_vector64(Theta_h + {p.index}, {p.size})")
                  for p in plan.params)
    return Hook("prior_distance", "pos_d, Theta_h",
                "the table's entries in float64: log_prior, then d log_prior / d p per tabulated p",
                (),
                loads + block.hoisted + block.body, _tuple(block.outputs, always=True), triton=True)


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


# Columns a printed statement (a formula's, an init's) fills before it is broken over lines.
WIDTH = 100


def _fit(statement: str, indent: int) -> str:
    """A printed statement (`name = code`, `return code`) that starts at column ``indent``, as
    it is where every line fits in WIDTH columns, else broken over lines after a comma or
    before a binary + or -, if or else, at the outermost brackets first (an expression broken
    at its own level is put in parentheses), each level of continuation lines indented 4
    columns more. Text in, text out: the hooks' code and the op hash stay as they are, and the
    same statement always breaks the same way."""
    lines = statement.split("\n")
    if len(lines[0]) + indent <= WIDTH and all(len(line) <= WIDTH for line in lines[1:]):
        return statement
    flat = " ".join(line.strip() for line in lines)   # (earlier breaks are inside brackets)
    split = len("return ") if flat.startswith("return ") else flat.index(" = ") + 3
    head, code = flat[:split], flat[split:]
    breaks = _breaks(code)
    if any(depth == 0 for _, depth in breaks):
        code = f"({code})"
        breaks = _breaks(code)
    if not breaks:
        return statement
    return head + _fill(code, breaks, indent + len(head), indent)


def _breaks(code: str) -> list[tuple[int, int]]:
    """(index of a space where ``code`` may break, bracket depth there): the space after a
    comma, or before a binary + or - (spaced on both sides, as the printers write it), an if or
    an else."""
    out, depth = [], 0
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        start, end = tok.start[1], tok.end[1]
        if tok.string in (")", "]", "}"):
            depth -= 1
        if tok.string == "," and code[end:end + 1] == " ":
            out.append((end, depth))
        elif (tok.string in ("+", "-", "if", "else") and start > 0 and code[start - 1] == " "
              and code[end:end + 1] == " "):
            out.append((start - 1, depth))
        if tok.string in ("(", "[", "{"):
            depth += 1
    return out


def _fill(code: str, breaks: list[tuple[int, int]], column: int, indent: int) -> str:
    """``code`` placed from ``column`` on (see _fit), its continuation lines indented from
    ``indent`` + 4."""
    return _layout(code, 0, len(code), breaks, column, indent + 4)


def _layout(code: str, start: int, end: int, breaks: list[tuple[int, int]], column: int,
            indent: int) -> str:
    """code[start:end] placed from ``column`` on: as it is where it fits, else cut at its
    outermost breaks into pieces packed onto lines at ``indent``, a piece too long for a line
    laid out in turn one level (4 columns) deeper."""
    if column + end - start <= WIDTH:
        return code[start:end]
    inner = [(at, depth) for at, depth in breaks if start < at < end]
    if not inner:
        return code[start:end]
    outermost = min(depth for _, depth in inner)
    cuts = [at for at, depth in inner if depth == outermost]
    text = ""
    for k, (a, b) in enumerate(zip([start] + [at + 1 for at in cuts], cuts + [end])):
        if k > 0 and column + 1 + b - a <= WIDTH:
            text, column = text + " ", column + 1
        elif k > 0:
            text, column = text + "\n" + " " * indent, indent
        piece = _layout(code, a, b, breaks, column, indent + 4)
        text += piece
        column = len(piece) - piece.rfind("\n") - 1 if "\n" in piece else column + len(piece)
    return text


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
    idents = dict(_learnable_scalars(plan))
    return ["tab_v"] + [f"tab_{idents[label]}" for label in plan.table.grads]


def _tuple(items, always=False) -> str:
    """Printed items as a tuple (one item: itself, unless always), broken over lines where
    long (the continuation lines indented for a hook's `return`)."""
    items = list(items)
    if len(items) == 1 and not always:
        return items[0]
    if len(items) == 1:
        return f"({items[0]},)"
    return _wrap(items, "(", " " * 12, ")", column=11)


# A name in printed code: a Python identifier, whose letters may be any Unicode letters (a
# parameter σ prints as prm_σ, its derivative's table as tab_σ).
_IDENTIFIER = r"[^\W\d]\w*"


def _first_output_first(block) -> tuple[tuple, tuple]:
    """block's body as (the statements its first output needs, the others), each in the body's
    order: run in that order they compute the same values with the same operations, so a caller
    that wants the first output alone stops after the first part (the distance table of a call
    without a backward: the log-prior, not its derivatives) and gets it bit for bit."""
    needed = set(re.findall(_IDENTIFIER, block.outputs[0]))
    first = []
    for name, code in reversed(block.body):
        if name in needed:
            first.append((name, code))
            needed |= set(re.findall(_IDENTIFIER, code))
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
    env.filters["fit"] = _fit
    return env


def _assignments(lines, indent: int) -> str:
    """Render (name, code) pairs as statements; the template supplies the first indentation."""
    return ("\n" + " " * indent).join(f"{name} = {code}" for name, code in lines)


def _init_lines(plan: KernelPlan) -> list[str]:
    """default_params' statements, one per parameter: its init formula in h (H bound there),
    or a random draw (bamgen.runtime.params.init_formula, init_random)."""
    spec_params = {p.name: p for p in plan.ir.spec.params}
    lines = []
    for p in plan.params:
        spec = spec_params[p.name]
        shape = "" if p.size is None else f", size={p.size}"
        shape += "" if p.per_head else ", per_head=False"
        if spec.random is not None:
            kind, a, b = spec.random
            call = f"init_random({kind!r}, {a!r}, {b!r}, H{shape})"
        else:
            expr = spec.init_expr
            code = repr(float(expr)) if expr.is_number else sp.pycode(expr, fully_qualified_modules=True)
            call = f"init_formula({p.name!r}, lambda h: {code}, H{shape})"
        lines.append(f'values["{p.name}"] = {call}')
    return lines


def _triton_globals(hooks: list[Hook]) -> list[str]:
    """`tl` and the runtime's helpers (bamgen/runtime/triton/helpers.py, traits.HOOK_HELPERS) that
    the Triton hooks call: names the module binds when its kernels are first made."""
    text = "\n".join(code for h in hooks for code in (*h.unpack, *(c for _, c in h.statements),
                                                      h.result))
    return ["tl"] + [name for name in HOOK_HELPERS if re.search(rf"\b{name}\(", text)]


def _runtime_imports(plan: KernelPlan) -> list[str]:
    """What the module takes from bamgen.runtime: the binding, the init helpers it calls, and
    for a prior over several position channels grid(), whose coordinates its calls require (a
    standalone build cannot reach bamgen.positions: the module offers it itself)."""
    spec_params = {p.name: p for p in plan.ir.spec.params}
    names = ["ParamTraits", "Prior", "PriorAttention", "PriorTraits", "TorchHooks"]
    if any(spec_params[p.name].random is None for p in plan.params):
        names.append("init_formula")
    if any(spec_params[p.name].random is not None for p in plan.params):
        names.append("init_random")
    printed = "\n".join(code for block in (plan.torch_fwd, plan.torch_bwd, *(
        (plan.distance_table.code, plan.distance_table.logit, plan.distance_table.backward)
        if plan.distance_table is not None else ()))
        for code in (*(c for _, c in block.hoisted), *(c for _, c in block.body), *block.outputs))
    helpers = [name for name in ("element_at", "index_ceil", "index_floor")
               if re.search(rf"\b{name}\(", printed)]
    grid = ["grid"] if plan.ir.spec.channels > 1 else []
    return names[:5] + helpers + names[5:] + grid + ["triton_hook"]


def _param_doc(p) -> str:
    """The line attention()'s docstring gives a parameter."""
    if p.size is None:
        shape = "float or tensor [Hq]" if p.per_head else "float or 0-d tensor, shared by the heads"
    else:
        shape = (f"tensor [Hq, {p.size}] (or [{p.size}], the same for every head)" if p.per_head
                 else f"tensor [{p.size}], shared by the heads")
    extra = "" if p.learnable else ", no gradient"
    if keyword.iskeyword(p.name):   # (no signature can list it: **keyword_params takes it)
        return f'{p.name}: {shape} ({p.domain}{extra}), a Python keyword: **{{"{p.name}": ...}}.'
    return f"{p.name}: {shape} ({p.domain}{extra})."


def own_names(plan: KernelPlan) -> dict[str, str]:
    """The generated module's own names in the functions that take the parameters as
    arguments (backward_block's dout, out, stats; log_prior_at's num_heads; the bound Prior;
    the **keyword_params that take the parameters named by Python keywords),
    each with '_' appended while a parameter has it: the user's names win (docs/priors.md,
    "Names")."""
    taken = {p.name for p in plan.params}
    out = {}
    for name in ("dout", "out", "stats", "num_heads", "_prior", "keyword_params"):
        renamed = name
        while renamed in taken:
            renamed += "_"
        out[name] = renamed
    return out


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
    if p.size is not None:
        args.append(f"size={p.size}")
    if p.domain == "interval":
        args += [f"lo={_literal(p.lo)}", f"hi={_literal(p.hi)}"]
    if p.grad_slot is not None:
        args.append(f"grad_slot={p.grad_slot}")
    if p.attr:
        args.append(f"attr={p.attr!r}")
    return f"ParamTraits({', '.join(args)})"


def _literal(v) -> str:
    """A value as Python source (floats: inf and nan through float(); a long tuple broken
    over lines)."""
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return f'float("{v}")'
    if isinstance(v, tuple) and len(repr(v)) > 80:
        return _wrap([repr(x) for x in v], "(", " " * 8, ")", column=20)
    return repr(v)


def op_hash(traits_text: str, pos_traits: str | None, distance: dict | None,
            hooks: list[Hook]) -> str:
    """The hash of what the prior's custom ops run (16 hex): its traits, the printed hooks (their
    code, not their docstrings) and the runtime ABI that reads them. The ops' name carries it
    (runtime/ops.py: op_name), so a saved torch.export program or AOTInductor package finds the
    build whose math it was traced with, and no other: an edited formula, parameter or strategy
    is a new name, while the description, the parameters' initial values, the source line and
    the bamgen version are not part of it (a program survives an upgrade that prints the same
    hooks)."""
    math = repr((RUNTIME_ABI, traits_text, pos_traits, distance,
                 [dataclasses.replace(h, doc="") for h in hooks]))
    return hashlib.sha256(math.encode("utf-8")).hexdigest()[:16]


def _context(spec: PriorSpec, plan: KernelPlan, build_hash: str) -> dict:
    source_name = Path(spec.path).name
    score_text = str(spec.score) if spec.score is not None else "s + log_prior"
    formulas = dict(spec.formulas)
    torch_side = torch_hooks(plan)
    distance = None
    if plan.distance_table is not None:
        first, rest = _first_output_first(plan.distance_table.code)
        distance = dict(prm=_prm_unpack(plan, "prm"),
                        hoisted=plan.distance_table.code.hoisted, first=first, rest=rest,
                        outputs=plan.distance_table.code.outputs,
                        returned=_tuple(plan.distance_table.code.outputs, always=True))
    triton_side = triton_hooks(plan)
    positional = plan.positional
    pos_side = [] if positional is None else triton_hooks(positional, prefix="pos_")
    traits_text = _traits_source(traits(spec, plan))
    pos_traits = None if positional is None else _traits_source(traits(spec, positional))
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
                            "per_head": p.per_head, **({"size": p.size} if p.size else {})}
                   for p in plan.params},
        **({"let": dict(spec.lets)} if spec.lets else {}),
        "constants": {p.name: p.value for p in spec.params if p.is_constant},
        "strategy": plan.strategy,
        "skip_below": spec.skip_below,
        **({"causal_only": True} if spec.causal_only else {}),
        "notes": list(plan.ir.notes),
        **({"warnings": [w.message for w in plan.ir.warnings]} if plan.ir.warnings else {}),
        "bamgen_version": __version__,
        "source_hash": spec.source_hash,
        "op_hash": op_hash(traits_text, pos_traits, distance, torch_side + triton_side + pos_side),
        "build_hash": build_hash,
    }
    header = [
        f"{GENERATED_BY} {__version__} from {source_name}. Do not edit: rebuild instead.",
        f"artifact={spec.name} strategy={plan.strategy} params={','.join(p.name for p in plan.params) or '-'}"
        f" positions={','.join(plan.positions_used) or '-'} build-hash={build_hash}",
        f"source-sha256={spec.source_hash}",
    ]
    return dict(
        spec=spec, plan=plan, header=header, source_name=source_name, abi=RUNTIME_ABI,
        prior_meta=pprint.pformat(meta, sort_dicts=False, width=96),
        traits=traits_text,
        params=plan.params, learnable=plan.learnable,
        param_names=repr(tuple(p.name for p in plan.params)),
        learnable_names=repr(tuple(p.name for p in plan.learnable)), init_lines=_init_lines(plan),
        param_docs=[_param_doc(p) for p in plan.params], own=own_names(plan),
        imports=_wrap(_runtime_imports(plan), "from bamgen.runtime import (", " " * 28, ")"),
        triton_globals=_triton_globals(triton_side + pos_side),
        pos_hooks=pos_side,
        pos_traits=pos_traits,
        pos_binding=_wrap([h.name for h in pos_side], "(", " " * 8,
                          ",)" if len(pos_side) == 1 else ")", column=35) if pos_side else "()",
        score_text=score_text, log_prior_text=log_prior_text,
        grid_sizes=_grid_sizes(spec.channels),
        position_shapes=_position_shapes(spec.channels),
        position_reads=_position_reads(spec.channels),
        distance=distance, torch_hooks=torch_side, triton_hooks=triton_side,
        torch_binding=_torch_binding(torch_side, distance is not None),
        triton_binding=_wrap([h.name for h in triton_side], "(", " " * 5,
                             ",)" if len(triton_side) == 1 else ")", column=4),
        values=_values_dicts(plan, own_names(plan)),
        param_args="".join(f"{p.name}, " for p in plan.params if not keyword.iskeyword(p.name)),
        keyword_args=(f"**{own_names(plan)['keyword_params']}"
                      if any(keyword.iskeyword(p.name) for p in plan.params) else ""),
        usage_args=_usage_args(plan),
    )


def _usage_args(plan: KernelPlan) -> str:
    """The parameters in the docstring's attention() call: name=..., and those named by Python
    keywords in one **{"lambda": ...}."""
    named = "".join(f", {p.name}=..." for p in plan.params if not keyword.iskeyword(p.name))
    keywords = [f'"{p.name}": ...' for p in plan.params if keyword.iskeyword(p.name)]
    return named + (f", **{{{', '.join(keywords)}}}" if keywords else "")


def _position_shapes(channels: int) -> str:
    """The shapes attention() takes for pos_q and pos_k: a prior over several channels takes
    [.., C] alone, and requires them (docs/positions.md)."""
    if channels == 1:
        return "[B, N] or [B, Hq, N]"
    return f"[B, N, {channels}] or [B, Hq, N, {channels}], required"


def _position_reads(channels: int) -> str:
    """The formula's symbols that the position tensors give, as its prior file names them."""
    if channels == 1:
        return "i, j and d"
    last = channels - 1
    return f"i0..i{last}, j0..j{last} and d0..d{last}"


def _grid_sizes(channels: int) -> str:
    """grid()'s arguments in the usage lines of a prior over several channels (an image's
    h, w; a video's t, h, w), or "" for one channel, whose calls need no grid."""
    if channels < 2:
        return ""
    return {2: "h, w", 3: "t, h, w"}.get(channels, ", ".join(f"n{c}" for c in range(channels)))


def _torch_binding(hooks: list[Hook], distance: bool) -> str:
    """TorchHooks' arguments: each printed torch hook under its field's name."""
    fields = {"torch_logit": "logit", "torch_logit_grads": "logit_grads",
              "torch_position_grads": "position_grads",
              "torch_table_logit": "table_logit", "torch_table_logit_grads": "table_logit_grads"}
    args = [f"{fields[h.name]}={h.name}" for h in hooks]
    if distance:
        args.append("distance_prior=distance_prior")
    return _wrap(args, rest=" " * 15, column=15)


def _values_dicts(plan: KernelPlan, own: dict[str, str]) -> dict[str, str]:
    """{function: its parameters' dict}, each wrapped from the column the template's call
    line puts it at (after `q, k, v, `, backward_block's `dout, q, k, v, out, stats, `, `d, `)."""
    columns = {"attention": 17, "forward_block": 17, "log_prior_at": 11,
               "backward_block": 8 + len(f"{own['dout']}, q, k, v, {own['out']}, {own['stats']}, ")}
    return {function: _values_dict(plan, function, own, column)
            for function, column in columns.items()}


def _values_dict(plan: KernelPlan, function: str, own: dict[str, str], column: int) -> str:
    """The parameters as the dict the runtime takes, {"name": name, ...}, those named by Python
    keywords from **keyword_params, checked by the Prior as Python checks the others
    (continuation lines indented for the template's `return _prior.f(` calls)."""
    items = [f'"{p.name}": {p.name}' for p in plan.params if not keyword.iskeyword(p.name)]
    if not any(keyword.iskeyword(p.name) for p in plan.params):
        return _wrap(items, "{", " " * 12, "}", column=column)
    checked = f'{own["_prior"]}.keyword_params("{function}", {own["keyword_params"]})'
    return _wrap(items + [f"**{checked}"], "{", " " * 12, "}", column=column) if items else checked


def _tidy(text: str) -> str:
    """Strip trailing spaces (left by empty hooks) and runs of more than two blank lines."""
    text = "\n".join(line.rstrip() for line in text.splitlines()) + "\n"
    return re.sub(r"\n{4,}", "\n\n\n", text)


def _hides_keys(plan: KernelPlan) -> bool:
    """Whether the prior is -oo somewhere (a window): where it hides keys. For a score s + b,
    b is what hides them (b holds the log-prior, and may hold it under a function that maps
    -oo to a finite value: s + tanh(log_prior)); for any other score, the log-prior."""
    hider = plan.ir.logit.xreplace({S: sp.S.Zero}) if plan.score_is_identity else plan.ir.log_prior
    # (folded: exp(Piecewise((-oo, ...), ...)) is a Piecewise of exp(-oo) = 0, no -oo left)
    return hider.has(sp.S.NegativeInfinity) and sp.piecewise_fold(hider).has(sp.S.NegativeInfinity)
