"""Stage 1: a prior file (YAML text) to a validated :class:`PriorSpec`.

The YAML is read with ``safe_load`` (no tags, no objects), every field is checked, and every
formula is parsed through :mod:`bamgen.compiler.formula`'s whitelist. Errors carry the field and its line.
Text that reaches the generated module (names, description, source, the file name) is refused
when it could break out of a docstring or an identifier.
"""
from __future__ import annotations

import builtins
import hashlib
import keyword
import math
import os
import re
import reprlib
import stat
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import sympy as sp
import yaml

from ..errors import SpecError
from .timeout import cpu_budget, working_on
from .formula import MAX_LITERAL, RESERVED, evaluate, parse_formula

MAX_FILE_BYTES = 64 * 1024
FLOAT32_TINY = 1.1754943508222875e-38   # float32's smallest normal value
MAX_PARAMS = 16
NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")          # used with fullmatch: no trailing newline
PARAM_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")

# Symbols a formula may use (docs/priors.md). Positions are real numbers in the kernel.
POSITION_SYMBOLS = ("d", "i", "j", "n")
SCORE_SYMBOLS = ("s", "log_prior")
INIT_SYMBOLS = ("h", "H")
TOP_LEVEL_FIELDS = ("name", "description", "source", "log_prior", "density", "score", "params",
                    "skip_below")
MAX_SKIP_BELOW = 1000.0   # nats; beyond this float32 softmax cannot tell the difference anyway
PARAM_FIELDS = ("init", "domain", "learnable", "per_head", "value")
DOMAINS = ("real", "positive", "nonnegative")
# A parameter is an argument of the generated attention(), forward_block(), backward_block()
# and log_prior_at(), so inside them its name hides whatever else has it: their other arguments
# (also key_mask, cu_seqlens_q, cu_seqlens_k: docs/masks.md), their locals, and the modules and functions they call.
# tests/compiler/test_spec.py derives the names the rendered module really uses there and checks that
# this list holds them all.
API_NAMES = ("q", "k", "v", "causal", "scale", "q_offset", "k_offset", "backend", "key_mask",
             "cu_seqlens_q", "cu_seqlens_k", "layout", "num_heads", "columns", "theta", "grad",
             "dout", "out", "out32", "stats", "dq", "dk", "dv", "dparams", "rows", "name", "t",
             "heads", "prm", "value", "values", "attention", "forward_block", "backward_block",
             "log_prior_at",
             "finish_param_grads", "default_params", "PRIOR",
             "PARAM_NAMES", "LEARNABLE", "LOG2E", "torch", "math", "triton", "tl", "self", "init",
             "device")
# Names the kernels derive from a parameter p (prm_p, tab_p, grad_p, dlogit_dp, ...) that the
# templates already use for something else, as (prefix, p): a learnable `rows` would give a
# table entry tab_rows, the name of the table's row pointers.
DERIVED_CLASHES = (("tab_", ("at", "cols", "ptrs", "rows", "slot", "stride_h", "v")),
                   ("dlogit_d", ("s",)))
# The nn.Module stores a learnable parameter p as raw_p and a buffer as p: neither may be an
# attribute torch.nn.Module (or the generated class) already has (tests/compiler/test_spec.py checks
# this list against the installed torch).
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
# A module <name>.py in a folder on sys.path hides an importable module of that name, for the
# generated module itself (`import torch`) and for the user's program: the standard library,
# and what the generated module imports, directly or through torch and triton.
IMPORTED_MODULES = frozenset(("torch", "triton", "numpy", "sympy", "mpmath", "typing_extensions",
                              "torchgen", "filelock", "fsspec", "jinja2", "markupsafe", "networkx",
                              "setuptools", "pkg_resources", "bamgen", "generated"))
# (i, j) where each formula is first computed in float64 at the initial parameters, a cheap early
# refusal of values no float can carry (the whole domain is scanned later: bamgen/checks/scan.py).
CHECK_POINTS = ((0, 0), (5, 2), (40, 1), (3, 7))


@dataclass(frozen=True)
class Domain:
    """Where a parameter lives: ``real``, ``positive``, ``nonnegative`` or an open interval.
    Membership is decided for the value the module stores, a float32."""
    kind: str
    lo: float | None = None
    hi: float | None = None

    def contains(self, x: float) -> bool:
        if not math.isfinite(x):
            return False
        if self.kind == "positive":
            return x > 0
        if self.kind == "nonnegative":
            return x >= 0
        if self.kind == "interval":
            return self.lo < x < self.hi
        return True

    def inside(self, values):
        """contains() elementwise on a tensor of stored float32 values (a bool tensor)."""
        values = values.double()
        ok = values.isfinite()
        if self.kind == "positive":
            return ok & (values > 0)
        if self.kind == "nonnegative":
            return ok & (values >= 0)
        if self.kind == "interval":
            return ok & (values > self.lo) & (values < self.hi)
        return ok

    def __str__(self) -> str:
        return f"({self.lo:g}, {self.hi:g})" if self.kind == "interval" else self.kind


@dataclass(frozen=True)
class ParamSpec:
    """One declared prior parameter."""
    name: str
    init: str                  # formula text in h (head index) and H (number of heads)
    init_expr: sp.Expr
    domain: Domain
    learnable: bool
    per_head: bool
    value: float | None        # set: a compile-time constant folded into the kernels
    line: int | None = None    # of its key in the prior file, for messages

    @property
    def is_constant(self) -> bool:
        return self.value is not None

    def symbol(self) -> sp.Symbol:
        return param_symbol(self.name, self.domain)


@dataclass(frozen=True)
class PriorSpec:
    """A validated prior file: formulas as SymPy expressions plus where they came from."""
    name: str
    description: str
    source: str
    log_prior: sp.Expr         # log_prior, or log(density) before simplification
    from_density: bool
    score: sp.Expr | None      # over s, log_prior and positions; None means s + log_prior
    params: tuple[ParamSpec, ...]
    formulas: tuple[tuple[str, str], ...]   # (field, text) as written, for PRIOR metadata
    path: str
    source_hash: str
    skip_below: float | None = None   # nats: GPU tiles whose log-prior is all below -skip_below are skipped

    @property
    def class_name(self) -> str:
        return "".join(part.capitalize() for part in self.name.split("_") if part) + "Attention"


def param_symbol(name: str, domain: Domain) -> sp.Symbol:
    """The SymPy symbol of a parameter, with the assumptions its domain gives."""
    if domain.kind == "positive" or (domain.kind == "interval" and domain.lo >= 0):
        return sp.Symbol(name, positive=True)
    if domain.kind == "nonnegative":
        return sp.Symbol(name, nonnegative=True)
    return sp.Symbol(name, real=True)


def position_symbols() -> dict[str, sp.Symbol]:
    return {name: sp.Symbol(name, real=True) for name in POSITION_SYMBOLS}


def _show(value) -> str:
    """repr for messages, bounded: a YAML alias bomb or a 5000-digit integer stays one short line."""
    shower = reprlib.Repr()
    shower.maxlevel, shower.maxlist, shower.maxstring, shower.maxother = 2, 4, 60, 60
    try:
        return shower.repr(value)
    except ValueError:   # int too large to print
        return f"<{type(value).__name__}>"


def _unsafe_text(text: str, *, newlines: bool) -> str | None:
    """Why ``text`` cannot be copied into the generated module's docstring, or None."""
    if '"""' in text:
        return "contains '\"\"\"'"
    if "\\" in text:
        return "contains a backslash"
    if any(not (c.isprintable() or (newlines and c in "\n\t")) for c in text):
        return "contains a control or non-printable character"
    return None


def load_spec(path: str | Path) -> PriorSpec:
    """Read and validate a prior file from disk."""
    path = Path(path)
    return parse_spec(_read_bounded(path), path=str(path))


def _read_bounded(path: Path) -> bytes:
    """At most MAX_FILE_BYTES + 1 bytes of a regular file: a link to /dev/zero, a FIFO with no
    writer or a 10 GB file is refused without reading it whole (or waiting on it)."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (no effect on a regular file)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise SpecError(f"cannot read the file: {exc.strerror}", file=str(path),
                        hint="check the path") from None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SpecError("not a regular file (a device, FIFO, socket or folder)", file=str(path),
                            hint="give the path of a prior file (.yaml)")
        try:
            raw = fh.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise SpecError(f"cannot read the file: {exc.strerror}", file=str(path)) from None
    if len(raw) > MAX_FILE_BYTES:
        raise SpecError(f"the file is larger than {MAX_FILE_BYTES} bytes; the limit is "
                        f"{MAX_FILE_BYTES}", file=str(path), hint="a prior file is a few lines")
    return raw


def parse_spec(raw: bytes | str, *, path: str = "<prior>") -> PriorSpec:
    """Validate prior-file text; every problem is a SpecError naming the field."""
    try:
        with cpu_budget(None, "reading the prior file"):
            return _parse(raw, path)
    except SpecError as err:
        raise err.located(path) from None


def _parse(raw: bytes | str, path: str) -> PriorSpec:
    problem = _unsafe_text(Path(path).name, newlines=False)
    if problem:   # the file name is written into the module's header and docstring
        raise SpecError(f"the file name {problem}", hint="rename the file")
    if isinstance(raw, str):
        raw = raw.encode("utf-8")
    if len(raw) > MAX_FILE_BYTES:
        raise SpecError(f"the file is {len(raw)} bytes; the limit is {MAX_FILE_BYTES}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError("the file is not UTF-8 text", hint="save the prior file as UTF-8") from None
    if "\x00" in text:
        raise SpecError("the file contains NUL bytes; it is not a text file")
    if not text.strip():
        raise SpecError("the file is empty", hint="see priors/laplace.yaml for an example")
    data, lines = _load_yaml(text)
    _check_fields(data, TOP_LEVEL_FIELDS, lines, where="the prior file")

    name = data.get("name", Path(path).stem if path != "<prior>" else None)
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise SpecError(f"invalid name {_show(name)}", field="name", line=lines.get("name"),
                        hint="use lower-case letters, digits and '_', starting with a letter")
    if name in IMPORTED_MODULES or name in sys.stdlib_module_names or keyword.iskeyword(name):
        why = ("is a Python keyword" if keyword.iskeyword(name) else
               f"would hide the module '{name}': {name}.py in a folder on sys.path is imported "
               f"in its place (by the generated module itself or by your program)")
        raise SpecError(f"the name '{name}' {why}", field="name", line=lines.get("name"),
                        hint=f"choose another name, e.g. {name}_prior")
    description = _string(data, "description", lines, default="")
    source = _string(data, "source", lines, default="")

    params = _parse_params({} if data.get("params") is None else data["params"], lines)
    symbols = {**position_symbols(),
               **{p.name: p.symbol() if not p.is_constant else _constant(p.value) for p in params}}

    has_lp, has_density = "log_prior" in data, "density" in data
    if has_lp == has_density:
        raise SpecError("give exactly one of 'log_prior' or 'density'", field="log_prior",
                        hint="log_prior: -Abs(d)/b   or   density: exp(-Abs(d)/b)")
    field = "log_prior" if has_lp else "density"
    expr = _formula(data[field], symbols, field, lines)
    if has_density:
        expr = sp.log(expr)
    score = None
    if data.get("score") is not None:
        score_symbols = {**symbols, **{n: sp.Symbol(n, real=True) for n in SCORE_SYMBOLS}}
        score = _formula(data["score"], score_symbols, "score", lines)
        if sp.Symbol("s", real=True) not in score.free_symbols:
            raise SpecError("the score does not use s, the content score", field="score",
                            line=lines.get("score"), hint="e.g. (s + log_prior) * t * log(n)")
    _check_evaluable(expr, score, params, field, lines)
    formulas = tuple((f, str(data[f])) for f in ("log_prior", "density", "score")
                     if data.get(f) is not None)
    return PriorSpec(name=name, description=description, source=source, log_prior=expr,
                     from_density=has_density, score=score, params=params, formulas=formulas,
                     path=path, source_hash=hashlib.sha256(raw).hexdigest(),
                     skip_below=_skip_below(data, lines))


def _skip_below(data: dict, lines: dict) -> float | None:
    """The optional tile-skipping bound, in nats: a positive number."""
    value = data.get("skip_below")
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not 0 < value <= MAX_SKIP_BELOW):
        raise SpecError(f"skip_below must be a number of nats in (0, {MAX_SKIP_BELOW:g}], got "
                        f"{_show(value)}", field="skip_below", line=lines.get("skip_below"),
                        hint="e.g. skip_below: 30 (tiles whose log-prior is below -30 are skipped)")
    return float(value)


def _load_yaml(text: str) -> tuple[dict, dict[str, int]]:
    """safe_load the text and remember the line of each top-level and parameter key."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _refuse_merge_keys(node)    # before anything is constructed from the nodes
        data = loader.construct_document(node) if node is not None else None
    except SpecError:
        raise
    except (ValueError, OverflowError) as exc:   # a 5000-digit integer, a date such as 2001-02-30
        raise SpecError(f"not valid YAML: a value cannot be read ({str(exc)[:80]})",
                        hint="quote the value") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"not valid YAML: {problem}", line=mark.line + 1 if mark else None,
                        hint="check indentation and quoting; tags such as !!python are refused") from None
    except RecursionError:
        raise SpecError("not valid YAML: it is nested too deeply",
                        hint="a prior file needs two levels of nesting at most") from None
    finally:
        loader.dispose()
    duplicate = _duplicate_key(node)
    if duplicate:
        field, line = duplicate
        raise SpecError(f"the key '{field.rpartition('.')[2]}' is given twice", field=field,
                        line=line, hint="keep one of them")
    if data is None:
        raise SpecError("the file is empty", hint="see priors/laplace.yaml for an example")
    if not isinstance(data, dict):
        raise SpecError("the file must be a YAML mapping of fields",
                        hint="start with 'name: my_prior' and 'log_prior: ...'")
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            lines[str(key.value)] = key.start_mark.line + 1
            if key.value == "params" and isinstance(value, yaml.MappingNode):
                for pkey, _ in value.value:
                    lines[f"params.{pkey.value}"] = pkey.start_mark.line + 1
    return data, lines


def _refuse_merge_keys(root) -> None:
    """YAML merge keys (``<<: *anchor``) copy the merged mapping's entries into the merging one
    when the document is constructed, so a chain of them multiplies: ten lines can ask for
    10**10 entries. A prior file has no use for them. Each node is visited once."""
    stack, seen = [(root, "")], set()
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.tag == "tag:yaml.org,2002:merge":
                    raise SpecError("YAML merge keys ('<<') are not supported in a prior file",
                                    field=path.rstrip(".") or None, line=key.start_mark.line + 1,
                                    hint="write the settings out in full")
                name = f"{path}{key.value}." if isinstance(key, yaml.ScalarNode) else path
                stack.append((value, name))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, path) for item in node.value)


def _duplicate_key(root) -> tuple[str, int] | None:
    """The first mapping key given twice (PyYAML keeps the last one silently), with its line.
    Each node is visited once, so an alias bomb costs no more than its text."""
    stack, seen = [(root, "")], set()
    while stack:
        node, path = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys = set()
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    if key.value in keys:
                        return f"{path}{key.value}", key.start_mark.line + 1
                    keys.add(key.value)
                stack.append((value, f"{path}{key.value}." if isinstance(key, yaml.ScalarNode) else path))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, path) for item in node.value)
    return None


def _check_fields(data: dict, allowed: tuple[str, ...], lines: dict, where: str, prefix: str = ""):
    for key in data:
        if not isinstance(key, str) or key not in allowed:
            shown = key if isinstance(key, str) else _show(key)
            raise SpecError(f"unknown field {_show(key)} in {where}", field=f"{prefix}{shown}",
                            line=lines.get(f"{prefix}{key}"),
                            hint="allowed fields: " + ", ".join(allowed))


def _string(data: dict, field: str, lines: dict, default: str) -> str:
    value = data.get(field, default)
    if not isinstance(value, str):
        raise SpecError(f"expected text, got {type(value).__name__}", field=field,
                        line=lines.get(field), hint="quote the value")
    if len(value) > 4000:
        raise SpecError("the text is longer than 4000 characters", field=field, line=lines.get(field))
    problem = _unsafe_text(value, newlines=True)
    if problem:
        raise SpecError(f"the text {problem}", field=field, line=lines.get(field),
                        hint="it is copied into the generated module's docstring")
    return value


def _formula(text, symbols, field, lines) -> sp.Expr:
    with working_on(field, "reading the formula"):
        return parse_formula(text, symbols, field=field, line=lines.get(field))


def _constant(value: float) -> sp.Expr:
    """A `value:` parameter as a SymPy number; integral values stay integers (beta = 2 -> x*x)."""
    return sp.Integer(int(value)) if float(value).is_integer() else sp.Float(repr(float(value)))


def _parse_params(raw, lines) -> tuple[ParamSpec, ...]:
    if not isinstance(raw, dict):
        raise SpecError("'params' must be a mapping of parameter names to settings",
                        field="params", line=lines.get("params"),
                        hint="e.g. params: {b: {init: 8.0, domain: positive}}")
    if len(raw) > MAX_PARAMS:
        raise SpecError(f"{len(raw)} parameters; the limit is {MAX_PARAMS}", field="params")
    params = []
    for name, settings in raw.items():
        field = f"params.{name}"
        line = lines.get(field)
        if not isinstance(name, str) or not PARAM_RE.fullmatch(name):
            raise SpecError(f"invalid parameter name {_show(name)}", field=field, line=line,
                            hint="use letters, digits and '_', starting with a letter")
        why = _reserved_because(name)
        if why:
            better = next(n for n in (f"{name}_", f"p_{name}") if not _reserved_because(n))
            raise SpecError(f"the parameter name '{name}' is reserved: {why}", field=field,
                            line=line, hint=f"rename it, e.g. {better}")
        if isinstance(settings, (int, float)) and not isinstance(settings, bool):
            settings = {"init": settings}
        if not isinstance(settings, dict):
            raise SpecError("parameter settings must be a mapping", field=field, line=line,
                            hint="e.g. {init: 1.0, domain: positive}")
        _check_fields(settings, PARAM_FIELDS, {}, where=f"parameter '{name}'", prefix=field + ".")
        with working_on(field, "reading the parameter"):
            params.append(_parse_param(name, settings, field, line))
    return tuple(params)


def _reserved_because(name: str) -> str | None:
    """Why ``name`` cannot be a parameter of the generated module, or None. See docs/priors.md
    ("Parameters"): each rule stands for a way the name would break or silently change the
    generated code."""
    if name in RESERVED or name in POSITION_SYMBOLS or name in SCORE_SYMBOLS or name in INIT_SYMBOLS:
        return "it is a symbol, function or constant of the formula language"
    if keyword.iskeyword(name):
        return "it is a Python keyword"
    if name.startswith("_"):
        return "names starting with '_' are the generated module's own"
    if hasattr(builtins, name):
        return "it is a Python builtin, which the generated attention() would no longer see"
    if name in API_NAMES:
        return ("the generated attention(), forward_block(), backward_block() or log_prior_at() "
                "already uses this name (an argument, a local variable or a module it calls)")
    for prefix, taken in DERIVED_CLASHES:
        if name in taken:
            return (f"the kernels would name a value derived from it '{prefix}{name}', a name "
                    f"they already use")
    if name in MODULE_ATTRIBUTES:
        return (f"torch.nn.Module already has an attribute '{name}' (the generated module stores "
                f"a buffer under its parameter's name)")
    if name.startswith("raw_"):
        return ("names starting with 'raw_' are where the generated nn.Module stores its "
                "learnable parameters (raw_x for x)")
    return None


def _parse_param(name: str, settings: dict, field: str, line: int | None) -> ParamSpec:
    domain = _parse_domain(settings.get("domain", "real"), f"{field}.domain", line)
    learnable = settings.get("learnable", True)
    per_head = settings.get("per_head", True)
    for flag, value in (("learnable", learnable), ("per_head", per_head)):
        if not isinstance(value, bool):
            raise SpecError(f"expected true or false, got {_show(value)}", field=f"{field}.{flag}",
                            line=line)
    value = settings.get("value")
    if value is not None:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not abs(value) <= MAX_LITERAL or not domain.contains(float(value))):
            raise SpecError(f"the constant value {_show(value)} is not a number in the domain "
                            f"{domain} (or larger than {MAX_LITERAL:g})", field=f"{field}.value",
                            line=line)
        if value != 0 and abs(value) < FLOAT32_TINY:
            raise SpecError(f"the constant value {value!r} is below float32's smallest normal "
                            f"value 1.2e-38: the kernels would see 0", field=f"{field}.value",
                            line=line, hint="rescale the formula so that constants stay above 1e-30")
        if "init" in settings:
            raise SpecError("give either 'value' (a constant) or 'init' (a starting value)",
                            field=f"{field}.value", line=line)
        init_text = repr(float(value))
    elif "init" not in settings:
        raise SpecError("missing 'init'", field=f"{field}.init", line=line,
                        hint="e.g. init: 1.0 or init: \"2**(8*(h + 1)/H)\"")
    else:
        init_text = settings["init"]
    init_symbols = {s: sp.Symbol(s, integer=True, nonnegative=True) for s in INIT_SYMBOLS}
    init_expr = parse_formula(init_text, init_symbols, field=f"{field}.init", line=line)
    _check_init(init_expr, domain, f"{field}.init", line)
    return ParamSpec(name=name, init=str(init_text), init_expr=init_expr, domain=domain,
                     learnable=learnable and value is None, per_head=per_head,
                     value=float(value) if value is not None else None, line=line)


def _parse_domain(raw, field: str, line: int | None) -> Domain:
    if isinstance(raw, str) and raw in DOMAINS:
        return Domain(raw)
    if isinstance(raw, list) and len(raw) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in raw):
        lo, hi = float(raw[0]), float(raw[1])
        if lo < hi:
            problem = _float32_interval_problem(lo, hi)
            if problem:
                raise SpecError(f"the domain {_show(raw)} {problem}", field=field, line=line,
                                hint="the module keeps the value in float32: use bounds within "
                                     "about 1e38 that differ in the first 6 digits")
            return Domain("interval", lo, hi)
    raise SpecError(f"invalid domain {_show(raw)}", field=field, line=line,
                    hint="use real, positive, nonnegative, or an interval [lo, hi] with lo < hi")


def _float32(x: float) -> float:
    """``x`` rounded to float32 (±inf beyond its range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _float32_interval_problem(lo: float, hi: float) -> str | None:
    """Why (lo, hi) cannot hold a float32 value strictly inside it, or None. The nn.Module maps
    a raw parameter r to lo + (hi - lo) * sigmoid(r) in float32."""
    lo32, hi32 = _float32(lo), _float32(hi)
    if math.isinf(lo32) or math.isinf(hi32) or math.isinf(_float32(hi - lo)):
        return "is beyond float32's range (3.4e38)"
    if (lo != 0 and abs(lo) < FLOAT32_TINY) or (hi != 0 and abs(hi) < FLOAT32_TINY):
        return "has a bound below float32's smallest normal value 1.2e-38"
    mid = _float32(lo32 + (hi32 - lo32) / 2)
    if not lo < mid < hi:
        return "holds no float32 value strictly between its bounds"
    return None


def _check_init(expr: sp.Expr, domain: Domain, field: str, line: int | None) -> None:
    """The init must give a finite value inside the domain for every head of 1..64-head models."""
    h, H = sp.Symbol("h", integer=True, nonnegative=True), sp.Symbol("H", integer=True, nonnegative=True)
    for heads in (1, 2, 3, 8, 64):
        for head in range(heads):
            try:
                value = evaluate(expr, {h: head, H: heads})
            except OverflowError as exc:
                raise SpecError(f"the init cannot be computed for head {head} of {heads}: {exc}",
                                field=field, line=line, hint="keep exponentials and powers moderate") from None
            if not domain.contains(value):
                raise SpecError(f"the init gives {value!r} for head {head} of {heads}, "
                                f"outside the domain {domain}", field=field, line=line,
                                hint="init may use h (head index, 0-based) and H (number of heads)")


def _check_evaluable(expr: sp.Expr, score: sp.Expr | None, params: tuple[ParamSpec, ...],
                     field: str, lines: dict) -> None:
    """Compute the log-prior and the score in float64 at CHECK_POINTS with the initial parameters,
    and refuse what overflows where no float can carry it (exp(exp(exp(d))), d**d**d): SymPy,
    which computes exactly, would need numbers of billions of digits for such a formula."""
    h, H = sp.Symbol("h", integer=True, nonnegative=True), sp.Symbol("H", integer=True, nonnegative=True)
    values = {p.symbol(): evaluate(p.init_expr, {h: 0, H: 8}) for p in params if not p.is_constant}
    pos = position_symbols()
    checks = [(field, expr)]
    if score is not None:
        checks.append(("score", score.xreplace({sp.Symbol("log_prior", real=True): expr})))
    for where, formula in checks:
        for i, j in CHECK_POINTS:
            point = {pos["d"]: i - j, pos["i"]: i, pos["j"]: j, pos["n"]: i + 1,
                     sp.Symbol("s", real=True): 0.5}
            try:
                evaluate(formula, {**values, **point})
            except OverflowError as exc:
                raise SpecError(f"the formula cannot be computed at i={i}, j={j} with the initial "
                                f"parameters: {exc}", field=where, line=lines.get(where),
                                hint="keep exponentials and powers of positions moderate, "
                                     "e.g. exp(-d/8), not exp(exp(d))") from None
