"""Stage 1: a prior file (YAML text) to a validated :class:`PriorSpec`.

The YAML is read with ``safe_load`` (no tags, no objects), every field is checked, and every
formula is parsed through :mod:`bamgen.compiler.formula`'s whitelist. Errors carry the field and its line.
Text that reaches the generated module (names, description, source, the file name) is refused
when it could break out of a docstring or an identifier.
"""
from __future__ import annotations

import hashlib
import keyword
import math
import os
import re
import reprlib
import stat
import struct
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import sympy as sp
import yaml

from ..errors import SpecError
from .timeout import cpu_budget, working_on
from .formula import MAX_LITERAL, MAX_NAME, RESERVED, ElementSymbol, evaluate, parse_formula

MAX_FILE_BYTES = 64 * 1024
FLOAT32_TINY = 1.1754943508222875e-38   # float32's smallest normal value
MAX_PARAMS = 64          # declared parameters
MAX_SIZE = 256           # elements of one vector parameter
MAX_ELEMENTS = 512       # scalars of all the parameters together (a vector counts its elements)
MAX_LETS = 64            # named sub-formulas
NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")          # used with fullmatch: no trailing newline

# Symbols a formula may use (docs/priors.md). Positions are real numbers in the kernel.
POSITION_SYMBOLS = ("d", "i", "j", "n")
# A prior over C position channels (`positions: C`, docs/positions.md) writes d0, i0, j0, ...
MAX_CHANNELS = 4
SCORE_SYMBOLS = ("s", "log_prior")
INIT_SYMBOLS = ("h", "H")
INIT_SYMBOLS_HINT = ("an init reads only numbers (pi and E too), h (head index, 0-based) and H (number of "
                     "heads), not the positions or other parameters: e.g. init: 2.0 or "
                     "init: \"2**(-8*(h + 1)/H)\"")
TOP_LEVEL_FIELDS = ("name", "description", "source", "log_prior", "density", "score", "params",
                    "let", "skip_below", "positions", "causal_only")
MAX_SKIP_BELOW = 1000.0   # nats; beyond this float32 softmax cannot tell the difference anyway
PARAM_FIELDS = ("init", "domain", "learnable", "per_head", "value", "size")
DOMAINS = ("real", "positive", "nonnegative")
RANDOM_INITS = ("uniform", "normal")
# The generated attention() takes every parameter as a keyword argument beside these, so a
# parameter cannot have their names. Every other identifier is the user's: the compiler renames
# its own names around them (docs/priors.md, "Names").
ATTENTION_ARGS = ("q", "k", "v", "causal", "scale", "q_offset", "k_offset", "key_mask",
                  "cu_seqlens_q", "cu_seqlens_k", "pos_q", "pos_k", "backend")
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

    def init_hint(self) -> str:
        """How to fix a constant init outside the domain: the domain as an interval and a
        value inside it (a message's hint)."""
        if self.kind == "real":
            return "give a finite number, e.g. init: 1.0"
        inside = {"positive": "(0, inf)", "nonnegative": "[0, inf)"}.get(self.kind, str(self))
        return f"give an init inside {inside}, e.g. init: {self._example()}"

    def _example(self) -> str:
        if self.kind != "interval":
            return "1.0"
        mid = self.lo + (self.hi - self.lo) / 2
        return f"{mid:g}" if self.contains(float(f"{mid:g}")) else repr(mid)


@dataclass(frozen=True)
class ParamSpec:
    """One declared prior parameter: a scalar, or a vector of ``size`` elements w[0] ..
    w[size - 1] that share its settings (docs/priors.md, "Vectors")."""
    name: str
    init: str                  # as written: a formula in h (head index) and H (number of
                               # heads), or "uniform(a, b)" / "normal(mean, std)"
    init_expr: sp.Expr         # the formula; for a random init its centre (where scans start)
    domain: Domain
    learnable: bool
    per_head: bool
    value: float | None        # set: a compile-time constant folded into the kernels
    line: int | None = None    # of its key in the prior file, for messages
    size: int | None = None    # a vector's number of elements; None for a scalar
    random: tuple[str, float, float] | None = None   # ("uniform", lo, hi) or ("normal", mean, std)

    @property
    def is_constant(self) -> bool:
        return self.value is not None

    @property
    def width(self) -> int:
        """Scalars it stands for: its elements, or 1."""
        return self.size or 1

    def symbol(self) -> sp.Symbol:
        """A scalar's SymPy symbol (a vector has one per element: symbols())."""
        return param_symbol(self.name, self.domain)

    def symbols(self) -> tuple[sp.Symbol, ...]:
        """The symbol of each scalar it stands for, in slot order."""
        if self.size is None:
            return (self.symbol(),)
        return tuple(element_symbol(self.name, k, self.domain) for k in range(self.size))

    def labels(self) -> tuple[str, ...]:
        """Each scalar's name as a formula writes it: b, or w[0] .. w[size - 1]."""
        return tuple(sym.name for sym in self.symbols())


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
    lets: tuple[tuple[str, str], ...] = ()   # named sub-formulas (name, text as written), in order
    # (u, u as a Sum's body writes it) for each kink Abs(u) of an expanded Sum term: the limit
    # on kinks counts a body once (formula.parse_formula)
    sum_kinks: tuple[tuple[sp.Expr, sp.Expr], ...] = ()
    channels: int = 1          # position channels: 1 (d, i, j) or C (d0, i0, j0, ...)
    # the prior is for causal attention only: its formulas are checked, and its module called,
    # only where a key is at or before its query (d = i - j >= 0, j <= i)
    causal_only: bool = False

    @property
    def class_name(self) -> str:
        return "".join(part.capitalize() for part in self.name.split("_") if part) + "Attention"


def _assumptions(domain: Domain) -> dict:
    if domain.kind == "positive" or (domain.kind == "interval" and domain.lo >= 0):
        return {"positive": True}
    if domain.kind == "nonnegative":
        return {"nonnegative": True}
    return {"real": True}


def param_symbol(name: str, domain: Domain) -> sp.Symbol:
    """The SymPy symbol of a parameter, with the assumptions its domain gives."""
    return sp.Symbol(name, **_assumptions(domain))


def element_symbol(vector: str, index: int, domain: Domain) -> sp.Symbol:
    """The SymPy symbol of element ``index`` of a vector parameter (named ``w[3]``)."""
    return ElementSymbol(vector, index, **_assumptions(domain))


def position_names(channels: int = 1) -> tuple[str, ...]:
    """The position symbols of a prior over `channels` channels: d, i, j, n for one; d0, d1, ..,
    i0, .., j0, .., n for more (d_c = i_c - j_c; n stays the count of visible keys)."""
    if channels == 1:
        return POSITION_SYMBOLS
    return tuple(f"{x}{c}" for x in "dij" for c in range(channels)) + ("n",)


def position_symbols(channels: int = 1) -> dict[str, sp.Symbol]:
    return {name: sp.Symbol(name, real=True) for name in position_names(channels)}


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
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):   # (before fdopen, which refuses a folder with its own error)
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "a device, FIFO or socket"
        raise SpecError(f"not a regular file ({kind})", file=str(path),
                        hint="give the path of a prior file (.yaml)")
    with os.fdopen(fd, "rb") as fh:
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

    if "name" in data and data["name"] is None:
        raise SpecError("name: is empty", field="name", line=lines.get("name"),
                        hint="remove the line to use the file's name, or give a name")
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

    channels = _channels(data, lines)
    causal_only = _causal_only(data, lines, channels)
    params = _parse_params({} if data.get("params") is None else data["params"], lines)
    _check_channel_names(channels, params, data.get("let"), lines)
    symbols = {**position_symbols(channels),
               **{p.name: p.symbol() if not p.is_constant else _constant(p.value) for p in params
                  if p.size is None}}
    vectors = {p.name: p.symbols() for p in params if p.size is not None}
    kinks: dict = {}
    lets = _parse_lets({} if data.get("let") is None else data["let"], symbols, vectors, params,
                       lines, kinks)
    symbols.update(lets)

    has_lp, has_density = "log_prior" in data, "density" in data
    if has_lp == has_density:
        raise SpecError("give exactly one of 'log_prior' or 'density'", field="log_prior",
                        hint="log_prior: -Abs(d)/b   or   density: exp(-Abs(d)/b)")
    field = "log_prior" if has_lp else "density"
    expr = _formula(data[field], symbols, field, lines, vectors, kinks)
    if has_density:
        expr = sp.log(expr)
    score = None
    if data.get("score") is not None:
        score_symbols = {**symbols, **{n: sp.Symbol(n, real=True) for n in SCORE_SYMBOLS}}
        score = _formula(data["score"], score_symbols, "score", lines, vectors, kinks)
        if sp.Symbol("s", real=True) not in score.free_symbols:
            raise SpecError("the score does not use s, the content score", field="score",
                            line=lines.get("score"), hint="e.g. (s + log_prior) * t * log(n)")
    _check_evaluable(expr, score, params, field, lines, channels, causal_only)
    formulas = tuple((f, str(data[f])) for f in ("log_prior", "density", "score")
                     if data.get(f) is not None)
    return PriorSpec(name=name, description=description, source=source, log_prior=expr,
                     from_density=has_density, score=score, params=params, formulas=formulas,
                     path=path, source_hash=hashlib.sha256(raw).hexdigest(),
                     skip_below=_skip_below(data, lines),
                     lets=tuple((name, str(text)) for name, text in data["let"].items())
                     if lets else (),
                     sum_kinks=tuple(sorted(kinks.items(), key=lambda kv: sp.default_sort_key(kv[0]))),
                     channels=channels, causal_only=causal_only)


def _causal_only(data: dict, lines: dict, channels: int) -> bool:
    """`causal_only: true`: the prior is for causal attention, so its formulas need to hold
    only where a key is at or before its query (d >= 0). A prior over several channels takes
    its positions as tensors, where no mask says which key comes first: refused."""
    value = data.get("causal_only", False)
    if not isinstance(value, bool):
        raise SpecError(f"expected true or false, got {_show(value)}", field="causal_only",
                        line=lines.get("causal_only"), hint="causal_only: true")
    if value and channels > 1:
        raise SpecError(f"a prior over {channels} position channels cannot be causal only: its "
                        f"positions come as tensors, and no mask keeps their distances d0, d1, "
                        f".. at or above 0", field="causal_only", line=lines.get("causal_only"),
                        hint="remove causal_only, and make the formula hold for every distance")
    return value


def _channels(data: dict, lines: dict) -> int:
    """`positions: C`, the number of position channels (docs/positions.md): 1 by default."""
    value = data.get("positions", 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHANNELS:
        raise SpecError(f"expected a whole number of position channels from 1 to {MAX_CHANNELS}, "
                        f"got {_show(value)}", field="positions", line=lines.get("positions"),
                        hint="positions: 2 for a 2-D grid (the formula then reads d0, d1, i0, ...)")
    return value


def _check_channel_names(channels: int, params, lets, lines: dict) -> None:
    """With C channels, d0 .. j{C-1} are the formula's symbols: no parameter or let may take one."""
    if channels == 1:
        return
    taken = set(position_names(channels))
    for name in [p.name for p in params] + list(lets or {}):
        if name in taken:
            raise SpecError(f"'{name}' is a position symbol of a prior with positions: {channels}",
                            field="positions", line=lines.get("positions"),
                            hint=f"rename the parameter or sub-formula, e.g. {name}_")


def _skip_below(data: dict, lines: dict) -> float | None:
    """The optional tile-skipping bound, in nats: a positive number."""
    value = _yaml_number(data.get("skip_below"))
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not 0 < value <= MAX_SKIP_BELOW):
        raise SpecError(f"skip_below must be a number of nats in (0, {MAX_SKIP_BELOW:g}], got "
                        f"{_show(value)}", field="skip_below", line=lines.get("skip_below"),
                        hint="e.g. skip_below: 30 (tiles whose log-prior is below -30 are skipped)")
    return float(value)


def _load_yaml(text: str) -> tuple[dict, dict[str, int]]:
    """safe_load the text and remember the line of each top-level and parameter key, and of
    each key of a parameter's settings."""
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
            if key.value in ("params", "let") and isinstance(value, yaml.MappingNode):
                for pkey, settings in value.value:
                    lines[f"{key.value}.{pkey.value}"] = pkey.start_mark.line + 1
                    if key.value == "params" and isinstance(settings, yaml.MappingNode):
                        for skey, _ in settings.value:
                            lines[f"params.{pkey.value}.{skey.value}"] = skey.start_mark.line + 1
                    if pkey.tag.endswith(":bool"):   # off: read as False, named so in messages
                        as_read = yaml.SafeLoader.bool_values.get(str(pkey.value).lower())
                        lines.setdefault(f"{key.value}.{as_read}", pkey.start_mark.line + 1)
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


def _check_fields(data: dict, allowed: tuple[str, ...], lines: dict, where: str, prefix: str = "",
                  line: int | None = None):
    """Refuse a key not in ``allowed``, at its own line, else at ``line`` (the mapping's)."""
    for key in data:
        if not isinstance(key, str) or key not in allowed:
            shown = key if isinstance(key, str) else _show(key)
            raise SpecError(f"unknown field {_show(key)} in {where}", field=f"{prefix}{shown}",
                            line=lines.get(f"{prefix}{key}", line),
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


def _formula(text, symbols, field, lines, vectors=None, kinks=None, unavailable=None) -> sp.Expr:
    with working_on(field, "reading the formula"):
        return parse_formula(text, symbols, field=field, line=lines.get(field), vectors=vectors,
                             kinks=kinks, unavailable=unavailable)


def _parse_lets(raw, symbols: dict, vectors: dict, params, lines, kinks) -> dict[str, sp.Expr]:
    """The named sub-formulas, in order: each over the positions, the parameters and the
    sub-formulas above it. A name stands for its expression wherever it is used."""
    if not isinstance(raw, dict):
        raise SpecError("'let' must be a mapping of names to formulas", field="let",
                        line=lines.get("let"), hint="e.g. let: {r: Max(d, 0)}")
    if len(raw) > MAX_LETS:
        raise SpecError(f"{len(raw)} named sub-formulas; the limit is {MAX_LETS}", field="let",
                        line=lines.get("let"))
    taken = {p.name for p in params}
    lets: dict[str, sp.Expr] = {}
    names = list(raw)
    for position, (name, text) in enumerate(raw.items()):
        field = f"let.{name}"
        line = lines.get(field)
        _check_name(name, field, line, "sub-formula")
        if name in taken:
            raise SpecError(f"'{name}' is already a parameter", field=field, line=line,
                            hint="give the sub-formula another name")
        unavailable = _lets_not_yet_read(name, names[position + 1:])
        lets[name] = _formula(text, {**symbols, **lets}, field, {field: line}, vectors, kinks,
                              unavailable)
    return lets


def _lets_not_yet_read(name: str, below: list[str]) -> dict[str, tuple[str, str]]:
    """{let name: (message, hint)} for the entries the let entry ``name`` may not read: those
    below it and itself. Read as unknown symbols, with the hint to declare parameters, they
    sent the user looking for a typo."""
    order = "let entries are read in order, and each may use only those above it"
    out = {later: (f"'{later}' is a let entry below '{name}': {order}",
                   f"move '{later}' above '{name}' under 'let'") for later in below}
    out[name] = (f"the let entry '{name}' refers to itself: {order}",
                 f"write '{name}' with the symbols and the let entries above it; a let names a "
                 f"formula, it does not define one by recursion")
    return out


def _constant(value: float) -> sp.Expr:
    """A `value:` parameter as a SymPy number; integral values stay integers (beta = 2 -> x*x)."""
    return sp.Integer(int(value)) if float(value).is_integer() else sp.Float(repr(float(value)))


def _parse_params(raw, lines) -> tuple[ParamSpec, ...]:
    if not isinstance(raw, dict):
        raise SpecError("'params' must be a mapping of parameter names to settings",
                        field="params", line=lines.get("params"),
                        hint="e.g. params: {b: {init: 8.0, domain: positive}}")
    if len(raw) > MAX_PARAMS:
        raise SpecError(f"{len(raw)} parameters; the limit is {MAX_PARAMS}", field="params",
                        hint="group related scalars into a vector: {size: 32, init: 0.0}")
    params = []
    elements = 0
    for name, settings in raw.items():
        field = f"params.{name}"
        line = lines.get(field)
        _check_name(name, field, line, "parameter")
        if isinstance(settings, (int, float)) and not isinstance(settings, bool):
            settings = {"init": settings}
        if not isinstance(settings, dict):
            raise SpecError("parameter settings must be a mapping", field=field, line=line,
                            hint="e.g. {init: 1.0, domain: positive}")
        _check_fields(settings, PARAM_FIELDS, lines, where=f"parameter '{name}'",
                      prefix=field + ".", line=line)
        with working_on(field, "reading the parameter"):
            param = _parse_param(name, settings, field, line)
        elements += param.width
        if elements > MAX_ELEMENTS:
            raise SpecError(f"the parameters up to this one hold {elements} scalars; the limit "
                            f"is {MAX_ELEMENTS} in all", field=field, line=line,
                            hint="use smaller vectors")
        params.append(param)
    return tuple(params)


def _check_name(name, field: str, line: int | None, what: str) -> None:
    """A parameter's or sub-formula's name: an identifier that is not a name of the formula
    language or an argument of attention() (docs/priors.md, "Names"); a Python keyword such as
    lambda is the user's too."""
    if isinstance(name, (bool, int, float)) or name is None:
        # YAML reads the keys true/false/yes/no/on/off/null and numbers as such, not as text
        raise SpecError(f"invalid {what} name {_show(name)}: YAML reads that key as "
                        f"{type(name).__name__}, not as a name", field=field, line=line,
                        hint=_yaml_key_hint(name))
    if not isinstance(name, str) or not name.isidentifier() or len(name) > MAX_NAME:
        raise SpecError(f"invalid {what} name {_show(name)}", field=field, line=line,
                        hint="use letters (σ and λ are letters too), digits and '_', not "
                             f"starting with a digit (at most {MAX_NAME} characters)")
    python_reads = unicodedata.normalize("NFKC", name)
    if python_reads != name:
        raise SpecError(f"the {what} name '{name}' is read by Python as '{python_reads}' (its "
                        f"NFKC form): a formula or a keyword argument that spells it reaches "
                        f"'{python_reads}', never '{name}'", field=field, line=line,
                        hint=f"write it as {python_reads}")
    why = _reserved_because(name)
    if why:
        better = next(n for n in (f"{name}_", f"p_{name}") if not _reserved_because(n))
        raise SpecError(f"the {what} name '{name}' is reserved: {why}", field=field,
                        line=line, hint=f"rename it, e.g. {better}")


def _yaml_key_hint(name) -> str:
    """How to fix a key that YAML read as no text: a number needs a letter first; a boolean
    or null, quoting or another name."""
    if isinstance(name, bool):
        return "YAML reads the keys yes, no, on, off, true and false as booleans: quote it " \
               "(\"off\": ...) or choose another name"
    if name is None:
        return "YAML reads the key null or ~ (or an empty key) as null: choose a name"
    return "a name starts with a letter or '_', never a digit: e.g. p5 or b_5"


def _reserved_because(name: str) -> str | None:
    """Why ``name`` cannot name a parameter or a sub-formula, or None: only what would make it
    mean two things in a formula or in attention()'s arguments. Every other clash with a name
    of the generated code, or with Python's keywords, is the compiler's to avoid
    (docs/priors.md, "Names")."""
    if name in RESERVED or name in POSITION_SYMBOLS or name in SCORE_SYMBOLS or name in INIT_SYMBOLS:
        return "it is a symbol, function, constant or operator of the formula language"
    if name in ATTENTION_ARGS:
        return "it is an argument of the generated attention()"
    return None


def _parse_param(name: str, settings: dict, field: str, line: int | None) -> ParamSpec:
    domain = _parse_domain(settings.get("domain", "real"), f"{field}.domain", line)
    learnable = settings.get("learnable", True)
    per_head = settings.get("per_head", True)
    for flag, value in (("learnable", learnable), ("per_head", per_head)):
        if not isinstance(value, bool):
            raise SpecError(f"expected true or false, got {_show(value)}", field=f"{field}.{flag}",
                            line=line)
    size = _parse_size(settings.get("size"), f"{field}.size", line)
    value = _yaml_number(settings.get("value"))
    random = None
    if value is not None:
        if size is not None:
            raise SpecError("a vector cannot be a constant", field=f"{field}.value", line=line,
                            hint="give it an init and learnable: false (a buffer)")
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
                        hint="e.g. init: 1.0, init: \"2**(8*(h + 1)/H)\" or "
                             "init: {uniform: [-1, 1]}")
    elif isinstance(settings["init"], dict):
        random = _parse_random(settings["init"], domain, f"{field}.init", line)
        init_text = f"{random[0]}({random[1]!r}, {random[2]!r})"
    else:
        init_text = settings["init"]
    if random is not None:   # the scans start from the distribution's centre
        centre = (random[1] + random[2]) / 2 if random[0] == "uniform" else random[1]
        init_expr = sp.Float(repr(centre)) if not float(centre).is_integer() else sp.Integer(int(centre))
    else:
        init_symbols = {s: sp.Symbol(s, integer=True, nonnegative=True) for s in INIT_SYMBOLS}
        init_expr = parse_formula(init_text, init_symbols, field=f"{field}.init", line=line,
                                  symbols_hint=INIT_SYMBOLS_HINT)
        _check_init(init_expr, domain, f"{field}.init", line)
    return ParamSpec(name=name, init=str(init_text), init_expr=init_expr, domain=domain,
                     learnable=learnable and value is None, per_head=per_head,
                     value=float(value) if value is not None else None, line=line, size=size,
                     random=random)


def _parse_size(raw, field: str, line: int | None) -> int | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= MAX_SIZE:
        raise SpecError(f"size must be a whole number of elements from 1 to {MAX_SIZE}, got "
                        f"{_show(raw)}", field=field, line=line, hint="e.g. size: 32")
    return raw


def _yaml_number(x):
    """x, or the float a string such as "2e-2" spells (PyYAML 1.1 needs a dot in a float): every
    field that takes a number (value, skip_below, a domain's bounds, a random init's arguments)
    reads it so, as init's formula does."""
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return x
    return x


def _parse_random(raw: dict, domain: Domain, field: str, line: int | None) -> tuple[str, float, float]:
    """{uniform: [lo, hi]} or {normal: [mean, std]}: drawn with torch's default generator when
    the module is built (docs/priors.md, "Random inits")."""
    if len(raw) != 1 or next(iter(raw)) not in RANDOM_INITS:
        raise SpecError(f"a random init is {{uniform: [lo, hi]}} or {{normal: [mean, std]}}, got "
                        f"{_show(raw)}", field=field, line=line,
                        hint="or give a number or a formula in h and H")
    kind, args = next(iter(raw.items()))
    if isinstance(args, list):   # (YAML reads 2e-2, with no dot, as a string)
        args = [_yaml_number(x) for x in args]
    if not (isinstance(args, list) and len(args) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            and abs(x) <= MAX_LITERAL for x in args)):
        raise SpecError(f"{kind} takes two numbers, got {_show(args)}", field=field, line=line,
                        hint="e.g. {uniform: [-1, 1]} or {normal: [0, 0.02]}")
    a, b = float(args[0]), float(args[1])
    if kind == "uniform":
        if not a < b:
            raise SpecError(f"uniform needs lo < hi, got [{a:g}, {b:g}]", field=field, line=line)
        outside = [x for x in (a, b) if not domain.contains(x)]
        if outside:
            raise SpecError(f"uniform [{a:g}, {b:g}] reaches {outside[0]:g}, outside the domain "
                            f"{domain}", field=field, line=line,
                            hint="keep both bounds inside the domain")
    else:
        if b < 0:
            raise SpecError(f"normal needs a standard deviation >= 0, got {b:g}", field=field,
                            line=line)
        if domain.kind != "real" and b > 0:
            raise SpecError(f"a normal init can leave the domain {domain}", field=field, line=line,
                            hint="use {uniform: [lo, hi]} inside the domain, or domain: real")
    return kind, a, b


def _parse_domain(raw, field: str, line: int | None) -> Domain:
    if isinstance(raw, str) and raw in DOMAINS:
        return Domain(raw)
    if isinstance(raw, list):   # (YAML reads 1e3, with no dot, as a string)
        raw = [_yaml_number(x) for x in raw]
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
            if domain.contains(value):
                continue
            if not expr.free_symbols:   # a number: no head to name
                raise SpecError(f"the init {value!r} is outside the domain {domain}",
                                field=field, line=line, hint=domain.init_hint())
            raise SpecError(f"the init gives {value!r} for head {head} of {heads}, "
                            f"outside the domain {domain}", field=field, line=line,
                            hint="init may use h (head index, 0-based) and H (number of heads)")


def _check_evaluable(expr: sp.Expr, score: sp.Expr | None, params: tuple[ParamSpec, ...],
                     field: str, lines: dict, channels: int = 1, causal_only: bool = False) -> None:
    """Compute the log-prior and the score in float64 at CHECK_POINTS with the initial parameters,
    and refuse what overflows where no float can carry it (exp(exp(exp(d))), d**d**d): SymPy,
    which computes exactly, would need numbers of billions of digits for such a formula. A
    causal-only prior is computed only at the points whose key is at or before the query."""
    h, H = sp.Symbol("h", integer=True, nonnegative=True), sp.Symbol("H", integer=True, nonnegative=True)
    values = {sym: evaluate(p.init_expr, {h: 0, H: 8}) for p in params if not p.is_constant
              for sym in p.symbols()}
    pos = position_symbols(channels)
    checks = [(field, expr)]
    if score is not None:
        checks.append(("score", score.xreplace({sp.Symbol("log_prior", real=True): expr})))
    for where, formula in checks:
        for i, j in CHECK_POINTS:
            if causal_only and j > i:
                continue
            point = {pos["n"]: i + 1, sp.Symbol("s", real=True): 0.5}
            for c in (("",) if channels == 1 else range(channels)):
                point.update({pos[f"d{c}"]: i - j, pos[f"i{c}"]: i, pos[f"j{c}"]: j})
            try:
                evaluate(formula, {**values, **point})
            except OverflowError as exc:
                raise SpecError(f"the formula cannot be computed at i={i}, j={j} with the initial "
                                f"parameters: {exc}", field=where, line=lines.get(where),
                                hint="keep exponentials and powers of positions moderate, "
                                     "e.g. exp(-d/8), not exp(exp(d))") from None
