"""The ``bamgen`` command line: thin wrappers over the compiler stages.

Every user error exits with status 2 and one line on stderr naming the file and field; nothing
is written unless every requested build succeeded. ``--check`` exits 1 when an output is stale.
A build never shows a traceback: an unexpected exception is reported as an internal error.
Ctrl-C, at any point of a command, prints ``interrupted`` and exits 130; every file is written
atomically (bamgen/driver/files.py), so none is left half-written.

This module imports only what is light (click, bamgen's own small modules): torch, Triton and
SymPy are imported by the commands that need them, inside the command line's handling of
Ctrl-C, so that an interrupt during those imports (seconds) is reported as one line too.
"""
from __future__ import annotations

import errno
import io
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import click

from . import __version__
from .compiler import STRATEGIES
from .errors import SpecError
from .driver.cache import CacheUnwritable
from .driver.files import BuildLockTimeout, generated_by_bamgen, holds, write_if_different
from .resources import GENERATED_BY, resolve_prior, shipped_priors
from .compiler.timeout import BuildTimeout, time_limit

if TYPE_CHECKING:
    from .compiler.codegen import Artifact

INTERRUPTED = 130   # a shell's exit status for a command that SIGINT stopped (128 + 2)

BUILD_SECONDS = 120
# A prior file's path, or a shipped prior's name, as typed: a str, since Path("") would be the
# current folder (resolve_prior refuses an empty path by name); a folder is refused by
# load_spec in one line, as a FIFO is, not by click's three-line usage error.
PRIOR_ARG = click.Path()


def _fail(message: str) -> None:
    click.echo(f"error: {_one_line(message)}", err=True)
    sys.exit(2)


def _warn(message: str) -> None:
    """What builds but is likely not meant: one line on stderr, and the build goes on."""
    click.echo(f"warning: {_one_line(message)}", err=True)


def _one_line(message: str) -> str:
    """One line, whatever a file name or a prior put in the message: escape \n, ESC and the like."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


class _OneLineErrors(click.Group):
    """click's group, whose usage errors (a bad flag, a bad value for one) print as every other
    error does, one line naming the option and where its help is, exit code 2, rather than
    click's usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _Interrupted:
            _interrupted()
        except click.exceptions.NoArgsIsHelpError as err:   # bare `bamgen`: the help, as click
            err.show()
            sys.exit(err.exit_code)
        except click.UsageError as err:
            where = f" (see '{err.ctx.command_path} --help')" if err.ctx is not None else ""
            _fail(err.format_message().rstrip(".") + where)
        except click.ClickException as err:
            err.show()
            sys.exit(err.exit_code)
        except click.exceptions.Abort as err:
            if isinstance(err.__cause__, KeyboardInterrupt):   # (during click's own parsing)
                _interrupted()
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            _interrupted()
        except Exception as err:   # an import that Ctrl-C cut short fails again when retried
            if _after_interrupt(err):
                _interrupted()
            raise
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx):
        """A command, with Ctrl-C taken before click's own handler (which prints a blank line
        and 'Aborted!', exit 1) sees it: main reports it as one line, exit 130."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as err:
            raise _Interrupted() from err
        except Exception as err:
            if _after_interrupt(err):
                raise _Interrupted() from err
            raise


class _Interrupted(Exception):
    """Ctrl-C inside a command, carried past click's handler of KeyboardInterrupt."""


def _interrupted() -> None:
    click.echo("interrupted", err=True)
    sys.exit(INTERRUPTED)


def _after_interrupt(err: BaseException) -> bool:
    """Whether err comes of a Ctrl-C: raised while handling one, or caused by one. numpy, its
    import cut short by Ctrl-C, fails the retry with ImportError ('cannot load module more than
    once per process') whose context is the KeyboardInterrupt."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="bamgen")
def main() -> None:
    """Compile positional priors into fused attention kernels."""


@main.command()
@click.argument("files", nargs=-1, type=PRIOR_ARG)
@click.option("-o", "--out", "out_dir", default="generated", show_default=True,
              type=click.Path(),   # (a str: Path("") would be the current folder)
              help="Folder for the generated modules, e.g. a package of yours: mypkg/attention "
                   "(a file there that bamgen did not generate is never replaced).")
@click.option("--all", "build_all", is_flag=True, help="Build every shipped prior.")
@click.option("--check", is_flag=True,
              help="Write nothing; exit 1 if an output is missing or differs.")
@click.option("--strategy", type=click.Choice(STRATEGIES), default=None,
              help="Override the lowering strategy the cost model picks.")
@click.option("--standalone", is_flag=True,
              help="Inline bamgen's runtime: one file per prior that runs without bamgen "
                   "installed (about 450 KB; it keeps the runtime of this build).")
def build(files: tuple[str, ...], out_dir: str, build_all: bool, check: bool,
          strategy: str | None, standalone: bool) -> None:
    """Build prior FILES (paths, or shipped priors' names) into Python modules."""
    paths = list(files) + (shipped_priors() if build_all else [])
    if not paths:
        _fail("no prior files given; pass FILE... or --all")
    out_dir = _out_folder(out_dir)
    artifacts = _compile_all(paths, strategy, standalone)
    _check_targets([out_dir / artifact.filename for artifact in artifacts], paths)
    stale = []
    for path, artifact in zip(paths, artifacts):
        target = out_dir / artifact.filename
        for warning in artifact.warnings:   # (it builds: a remark, never a refusal)
            _warn(str(warning))
        if check:
            if not holds(target, artifact.text):
                stale.append(_shown(target))
            continue
        click.echo(f"{'wrote' if _write(target, artifact.text) else 'unchanged'} {_shown(target)}")
        for note in artifact.notes:
            click.echo(f"  note: {note}")
    if check:
        if stale:
            click.echo("stale (run `bamgen build` to update): " + ", ".join(stale), err=True)
            sys.exit(1)
        click.echo(f"{len(paths)} module(s) up to date in {_shown(out_dir)}")


def _shown(path: str | os.PathLike) -> str:
    """A path for a line of output: a newline or ESC in its name escaped, as in an error."""
    return _one_line(os.fspath(path))


def _out_folder(out_dir: str) -> Path:
    """--out as a folder that is there or can be made, checked before anything is compiled;
    else one line saying what is in the way (Path.exists() raises some of these: a name too
    long for the file system, a folder that cannot be read)."""
    if out_dir == "":
        _fail("--out is empty; give a folder (e.g. --out generated, or --out . for the current "
              "folder)")
    path = Path(out_dir)
    if _stat(path, "--out") is not None:
        if not path.is_dir():
            _fail(f"--out {_shown(path)} exists and is not a folder; give a folder's path")
    elif path.is_symlink():
        _fail(f"--out {_shown(path)} is a symbolic link to {_shown(os.readlink(path))}, which "
              f"does not exist; create that folder, remove the link, or give another --out")
    return path


def _stat(path: Path, option: str) -> os.stat_result | None:
    """path's status, or None where nothing is there; any other failure is one line naming the
    option and what to change."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        _fail(f"{option} {_shown(path)}: {_path_problem(exc)}")


def _path_problem(exc: OSError) -> str:
    """Why a path cannot be used, and what to do about it, from the error that said so."""
    if exc.errno == errno.ENAMETOOLONG:
        return "the path is too long for the file system (a name is at most 255 bytes); give " \
               "a shorter one"
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):   # (EEXIST: making a folder where a file is)
        return "a part of the path is a file, not a folder; give a path whose parents are folders"
    return f"{exc.strerror or exc}; check the path and its permissions"


def _check_targets(targets: list[Path], paths: list) -> None:
    """Refuse, before anything is written, a target that is there but is no file (a folder, a
    FIFO): its write would fail after the modules before it had been replaced; and a file that
    bamgen did not generate (a module of the user's package named as the prior is). --check
    refuses them as the build would, rather than calling them stale."""
    from .driver.build import check_target
    for target, path in zip(targets, paths):
        there = _stat(target, "--out") is not None or target.is_symlink()
        if there and not target.is_file():
            _fail(f"cannot write {_shown(target)}: it exists and is not a regular file (a "
                  f"folder?); nothing was written (hint: remove it or build into another --out)")
        try:
            check_target(target, path)
        except SpecError as err:
            _fail(str(err))


def _write(target: Path, data: str | bytes) -> bool:
    """Write-if-different, atomically; a failed write or a held lock is one line and exit 2."""
    try:
        return write_if_different(target, data)
    except BuildLockTimeout as exc:
        _fail(str(exc))
    except (OSError, ValueError) as exc:
        _fail(f"cannot write {_shown(target)}: "
              f"{_path_problem(exc) if isinstance(exc, OSError) else exc}")


@contextmanager
def _reported(path: Path, doing: str = "building"):
    """Run one prior's compilation under the time limit; every failure becomes one line, exit 2."""
    try:
        with time_limit(BUILD_SECONDS):
            yield
    except SpecError as err:
        _fail(str(err.located(str(path))))
    except CacheUnwritable as err:   # (BAMGEN_CACHE_DIR: the user's setting, not a bug)
        _fail(f"{path}: {err.strerror}")
    except BuildTimeout:
        _fail(f"{path}: {doing} took longer than {BUILD_SECONDS} s; simplify the formula")
    except RecursionError:
        _fail(f"{path}: the formula is too deeply nested to compile")
    except Exception as exc:   # a bug in bamgen, not in the file: still one line, exit 2
        if _after_interrupt(exc):
            _interrupted()
        _fail(f"{path}: internal error while {doing} ({type(exc).__name__}: "
              f"{str(exc)[:200]}); please report it with the prior file")


def _compile_all(paths: list[Path], strategy: str | None, standalone: bool = False) -> list[Artifact]:
    """Compile every file in memory first: one bad file means nothing is written."""
    from .compiler.spec import load_spec
    from .driver.build import compile_spec
    artifacts, names = [], {}
    for path in paths:
        with _reported(path):
            artifact = compile_spec(load_spec(resolve_prior(path)), strategy, standalone=standalone)
        if artifact.name in names:
            _fail(_same_prior_twice(path, names[artifact.name], artifact.name))
        names[artifact.name] = path
        artifacts.append(artifact)
    return artifacts


def _same_prior_twice(path, earlier, name: str) -> str:
    """Two FILEs that would write one module: the same file given twice, or two that share a
    name."""
    if _same_file(resolve_prior(path), resolve_prior(earlier)):
        shown = str(path) if str(path) == str(earlier) else f"{path} (as {earlier} too)"
        return f"{shown} is given twice; give each prior file once"
    return (f"{path} and {earlier} both define the prior '{name}'; give one of them another "
            f"name: in its file")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


@main.command()
@click.argument("file", type=PRIOR_ARG)
@click.option("--arch", type=click.Choice(["sm_80", "sm_90"]), default="sm_90", show_default=True)
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True)
@click.option("--head-dim", type=click.IntRange(1, 256), default=64, show_default=True)
@click.option("--causal/--no-causal", default=True, show_default=True)
@click.option("--layout", type=click.Choice(["plain", "padded", "packed", "positions", "positions_packed",
                                             "positions_table", "positions_table_packed"]),
              default="plain",
              show_default=True,
              help="The kernels' specialisation: no masks, key_mask with per-row offsets, or "
                   "packed documents (cu_seqlens) with key_mask, or position tensors (pos_q, pos_k), "
                   "alone or with packed documents; positions_table: integer positions read "
                   "from a table prior's distance table.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option("--save", "save_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write each kernel's cubin into this directory.")
@click.option("--kernel", "kernels", multiple=True,
              type=click.Choice(["attn_fwd", "bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq",
                                 "attn_decode", "decode_combine"]),
              help="Compile only these kernels (repeat the option; attn_fwd always, the report's "
                   "model is its). Default: all.")
def inspect(file: str, arch: str, dtype: str, head_dim: int, causal: bool, layout: str,
            as_json: bool, save_dir: Path | None, kernels: tuple[str, ...]) -> None:
    """Compile FILE's kernels ahead of time for a GPU and report their resources.

    FILE is a prior (.yaml), a module bamgen generated (.py, as `bamgen build` wrote it: any
    other .py is refused before it is run) or a shipped prior's name. No GPU is needed. A .py
    is imported, which runs its code: inspect only files you trust.
    """
    import json
    import os
    interpret = os.environ.pop("TRITON_INTERPRET", None)   # compile for the GPU, not the interpreter
    if interpret is not None:   # (put back when the command ends: a caller in-process keeps it)
        click.get_current_context().call_on_close(
            lambda: os.environ.__setitem__("TRITON_INTERPRET", interpret))
    from .aot import compile_module, decode_step_model, loop_model
    from .driver.loader import import_module_file, load_prior
    file = _prior_path(file)
    found = _stat(file, "FILE") if file.suffix == ".py" else None   # (a name too long: one line)
    if file.suffix == ".py" and (found is None or not file.is_file()):
        _fail(f"{_shown(file)}: {'not a regular file' if found else 'no such file'} (give a "
              f"prior's .yaml, a generated module's .py or a shipped prior's name)")
    if file.suffix == ".py" and not generated_by_bamgen(file):   # (checked before it is run)
        _not_generated(file)
    with _reported(file):
        module = import_module_file(file) if file.suffix == ".py" else load_prior(file)
    if not all(hasattr(module, name) for name in ("PRIOR", "triton_kernel_specs")):
        _not_generated(file)   # (the header, and not the rest: edited by hand)
    if layout.startswith("positions_table") and getattr(module._prior, "position_table", None) is None:
        _fail(f"--layout {layout}: the prior '{module.PRIOR['name']}' reads no distance table at "
              f"integer positions (a table prior whose logit is s + log_prior(d) does); use "
              f"--layout positions")
    with _reported(file, f"compiling for {arch}"):
        kernels = compile_module(module, arch=arch, dtype=dtype, head_dim=head_dim, causal=causal,
                                 layout=layout, only=("attn_fwd", *kernels) if kernels else None)
    cubins = _save_cubins(save_dir, module.PRIOR["name"], kernels, arch, dtype, head_dim, causal)
    report = {"prior": module.PRIOR["name"], "arch": arch, "dtype": dtype, "head_dim": head_dim,
              "causal": causal, "layout": layout, "strategy": module.PRIOR.get("strategy"),
              "kernels": [{"name": k.name, "registers": k.registers, "stack_bytes": k.stack_bytes,
                           "spill_bytes": k.local_bytes, "shared_bytes": k.shared_bytes,
                           "num_warps": k.num_warps, "block": list(k.block),
                           "sass": _mix(k.sass), "main_loop": _mix(k.main_loop),
                           "model": loop_model(k.main_loop, arch, k.num_warps),
                           "cubin": cubins.get(k.name)}
                          for k in kernels]}
    fwd = next(k for k in report["kernels"] if k["name"] == "attn_fwd")
    scores = fwd["block"][0] * fwd["block"][1]
    report["model"] = {"cycles_per_tile": fwd["model"]["cycles_per_tile"],
                       "cycles_per_1k_scores": round(fwd["model"]["cycles_per_tile"] * 1000 / scores, 1),
                       "bound": fwd["model"]["bound"], "kernel": "attn_fwd",
                       "tile": fwd["block"], "cycles": fwd["model"]["cycles"],
                       "units": "SM cycles per K/V tile of the forward's steady-state loop "
                                "(see docs/performance.md)"}
    by_name = {k["name"]: {"block": k["block"], "cycles_per_tile": k["model"]["cycles_per_tile"]}
               for k in report["kernels"]}
    if "attn_decode" in by_name:
        steps = decode_step_model(module, by_name, arch, head_dim, 4 if dtype == "fp32" else 2)
        report["decode_model"] = [{"shape": list(s.shape), "splits": s.splits,
                                   "prefill_us": s.prefill_us, "decode_us": s.decode_us,
                                   "ratio": round(s.ratio, 3)} for s in steps]
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"{report['prior']}: {arch} {dtype} head_dim={head_dim} causal={causal} "
               f"layout={layout} strategy={report['strategy']}")
    click.echo(f"  {'kernel':16s} {'tile':>8s} {'regs':>5s} {'stack':>6s} {'spill':>6s} {'shared':>8s}"
               f" | main loop: {'all':>4s} {'mma':>4s} {'mufu':>5s} {'fp32':>5s} {'ldg':>4s} {'lds':>4s}"
               f" | model cycles/tile (bound)")
    for k in report["kernels"]:
        loop, model = k["main_loop"], k["model"]
        tile = "x".join(str(b) for b in k["block"])
        click.echo(f"  {k['name']:16s} {tile:>8s} {k['registers']:5d} {k['stack_bytes']:6d} "
                   f"{k['spill_bytes']:6d} {k['shared_bytes']:8d} | {'':10s} {loop['total']:4d} "
                   f"{loop['mma']:4d} {loop['mufu']:5d} {loop['fp32']:5d} {loop['ld_global']:4d} "
                   f"{loop['ld_shared']:4d} | {model['cycles_per_tile']:.0f} ({model['bound']})")
    if "decode_model" in report:
        click.echo("  decode step, modelled (one row; batch x q heads x kv heads x keys): "
                   "prefill kernel -> split-KV kernels")
        for step in report["decode_model"]:
            shape = "x".join(str(x) for x in step["shape"])
            click.echo(f"    {shape:>14s}  {step['prefill_us']:8.1f} us -> {step['decode_us']:7.1f} us"
                       f" ({step['splits']} splits, {step['ratio']:.2f}x)")
    for name, path in cubins.items():
        click.echo(f"  wrote {_shown(path)}")


def _not_generated(file: Path) -> None:
    _fail(f"{file}: not a module bamgen generated (its first line is not '# {GENERATED_BY} "
          f"...', or it lacks what bamgen writes); build it from its prior file (`bamgen build "
          f"PRIOR.yaml`) and inspect that module, or inspect the prior file itself")


def _save_cubins(save_dir: Path | None, prior: str, kernels, arch: str, dtype: str,
                 head_dim: int, causal: bool) -> dict[str, str]:
    """Write each cubin as <prior>.<kernel>.<arch>.<dtype>.d<head_dim>[.causal].cubin."""
    if save_dir is None:
        return {}
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _fail(f"--save {save_dir}: cannot create the directory ({exc.strerror})")
    paths = {}
    for k in kernels:
        path = save_dir / f"{prior}.{k.name}.{arch}.{dtype}.d{head_dim}{'.causal' if causal else ''}.cubin"
        _write(path, k.cubin)
        paths[k.name] = str(path)
    return paths


def _mix(mix: dict) -> dict:
    """An instruction mix for JSON: counts, with the MMA shapes as a sorted mapping."""
    return {**{k: v for k, v in mix.items() if k != "mma_shapes"},
            "mma_shapes": dict(sorted(mix["mma_shapes"].items()))}


def _prior_path(file: str | Path) -> Path:
    """FILE as a path: a file, or a shipped prior's name, as `bamgen build` takes them."""
    with _reported(file, "reading"):
        return resolve_prior(file)


def _load_ir(file: str | Path):
    from .compiler.spec import load_spec
    from .compiler.symbolic import analysed
    file = _prior_path(file)
    with _reported(file, "analysing"):
        return analysed(load_spec(file))


@main.command()
@click.argument("file", type=PRIOR_ARG)
@click.option("--heads", type=click.IntRange(1, 256), default=8, show_default=True,
              help="Number of heads for the analysis at init.")
def show(file: str, heads: int) -> None:
    """Show FILE's derived log-prior, its derivatives, the kernel plan and an analysis (FILE: a
    prior file or a shipped prior's name)."""
    from .compiler.analysis import analyse_prior
    from .compiler.spec import load_spec
    from .compiler.symbolic import analysed
    from .driver.build import plan_prior as make_plan
    path = _prior_path(file)
    with _reported(path, "analysing"):
        spec = load_spec(path)
    _check_inits_at(spec, heads)
    with _reported(file, "planning"):   # (the plan scans the printed code over the domain)
        # (analysed with its plan, as a build does: the same clamps where limits by sign outgrow it)
        ir, kernel_plan = analysed(spec, lambda ir: (ir, make_plan(ir)))
        analysis = analyse_prior(ir, num_heads=heads)
    click.echo(f"prior '{spec.name}' ({file})" + (f": {spec.description}" if spec.description else ""))
    if spec.source:
        click.echo(f"source: {spec.source}")
    click.echo(f"\nlog_prior          = {ir.log_prior}")
    click.echo(f"logit              = {ir.logit}")
    click.echo(f"d logit / d s      = {ir.dlogit_ds}")
    for name, grad in ir.grads:
        click.echo(f"d logit / d {name:6s} = {grad}")
    for note in ir.notes:
        click.echo(f"note: {note}")
    for warning in ir.warnings:
        click.echo(f"warning: {warning.located(str(file))}")
    block = kernel_plan.triton_bwd
    if spec.causal_only:
        click.echo("\ncausal only (causal_only: true): checked at d = i - j >= 0 alone; calls "
                   "with causal=False or with pos_q, pos_k are refused")
    click.echo(f"\nplan: strategy {kernel_plan.strategy}; positions used: "
               f"{', '.join(ir.positions_used) or 'none'}; distance-only: "
               f"{'yes' if ir.distance_only else 'no'}")
    costs = ", ".join(f"{name} {cost}" for name, cost in kernel_plan.cost)
    click.echo(f"  cost model (issue slots per score over NoPE's): {costs}")
    if kernel_plan.ramp is not None:
        click.echo(f"  causal side: log2(e) * log_prior = {kernel_plan.ramp.outputs[1]} + "
                   f"{kernel_plan.ramp.outputs[0]} * d (each row's scores from its own reference "
                   f"key: one subtract and one FMA per score)")
        for name, code in kernel_plan.ramp.hoisted:
            click.echo(f"    {name} = {code}")
    if kernel_plan.distance_table is not None:
        table = kernel_plan.distance_table
        used = "the GPU kernels' tables and the CPU path's bias" if kernel_plan.table is not None \
            else "the CPU path's bias"
        grads = f" and d/d({', '.join(table.grads)})" if table.grads else ""
        click.echo(f"  distance table ({used}): log_prior{grads} per (head, distance), float64")
        for name, code in table.code.hoisted + table.code.body:
            click.echo(f"    {name} = {code}")
    click.echo(f"  backward kernel: {len(block.hoisted)} per-head constant(s), "
               f"{len(block.body)} per-score temporaries")
    for name, code in block.hoisted + block.body:
        click.echo(f"    {name} = {code}")
    labels = [] if kernel_plan.score_is_identity else ["logit", "d logit / d s"]
    labels += [f"d logit / d {n}" for n, _ in ir.grads]
    for label, code in zip(labels, block.outputs):
        click.echo(f"    {label}: {code}")
    where = "" if analysis.distance_only else " (depends on i too: at query position 1024)"
    if spec.channels > 1:   # (read along the first channel: analysis.log_prior_function)
        rest = ", ".join(f"d{c}" for c in range(1, spec.channels))
        absolute = any(p[0] in "ij" for p in ir.positions_used)
        where = (f" (along d0, with {rest} = 0"
                 + ("; positions at 1024)" if absolute else ")"))
    click.echo(f"\nanalysis at init, {heads} heads{where}:")
    if analysis.causal_only:
        click.echo("  causal only: yes (analysed at d >= 0)")
    else:
        click.echo(f"  symmetric in d: {'yes' if analysis.symmetric else 'no'}")
    click.echo(f"  tail: {analysis.tail}")
    norm = {True: "yes", False: "no", None: "unknown"}[analysis.normalisable]
    over = "d >= 0" if analysis.causal_only else "the integers"
    click.echo(f"  normalisable over {over}: {norm}")
    click.echo(f"  {'head':>4s} {'mode':>6s} {'-20 nats beyond |d|':>20s}  params")
    for h in analysis.heads:
        reach = f"{h.reach:.0f}" if h.reach is not None else "never (< 2^30)"
        click.echo(f"  {h.head:4d} {h.mode:6d} {reach:>20s}  {_show_params(h.params)}")


def _check_inits_at(spec, heads: int) -> None:
    """--heads above the head counts the build checks: refused as the module built for that
    many heads refuses its inits, rather than analysed as nan."""
    from .checks.inits import init_problem_at
    from .checks.numeric import MAX_HEADS
    if heads > MAX_HEADS:
        problem = init_problem_at(spec, heads)
        if problem:
            _fail(f"--heads {heads}: {problem} (the build checks the inits for up to "
                  f"{MAX_HEADS} heads)")


def _show_params(values) -> str:
    """b=0.25, w=[0.041, -0.061, ... 32 elements]: a vector's elements grouped, the first few shown."""
    grouped: dict[str, list[float]] = {}
    for label, value in values:
        grouped.setdefault(label.partition("[")[0], []).append(value)
    parts = []
    for name, vals in grouped.items():
        if len(vals) == 1 and not any(label.startswith(name + "[") for label, _ in values):
            parts.append(f"{name}={vals[0]:.4g}")
        else:
            shown = ", ".join(f"{v:.3g}" for v in vals[:3])
            parts.append(f"{name}=[{shown}{', ...' if len(vals) > 3 else ''}] ({len(vals)})")
    return ", ".join(parts)


@main.command()
@click.argument("file", type=PRIOR_ARG)
@click.option("-o", "--out", "out_file", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Image to write; its extension picks the format: .png, .svg, .pdf, or any "
                   "other that matplotlib writes (.jpg, .eps, .webp, ...).")
@click.option("--heads", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option("--max-distance", type=click.IntRange(1, 1 << 20), default=256, show_default=True)
def plot(file: str, out_file: Path, heads: int, max_distance: int) -> None:
    """Plot FILE's prior at init, one curve per head (needs matplotlib; FILE: a prior file or a
    shipped prior's name)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _fail("bamgen plot needs matplotlib: pip install 'bamgen[plot]'")
    from .compiler.analysis import init_values, log_prior_function
    image_format = _image_format(out_file)
    ir = _load_ir(file)
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    start = 0 if ir.spec.causal_only else -max_distance // 8   # (causal only: d >= 0 alone)
    distances = list(range(start, max_distance + 1))
    for head, values in enumerate(init_values(ir, heads)):
        f = log_prior_function(ir, values)
        ax.plot(distances, [f(d) for d in distances], label=f"head {head}", linewidth=1.2)
    ax.set_xlabel(_distance_label(ir.spec.channels))
    ax.set_ylabel("log prior")
    ax.set_title(f"{ir.spec.name}: {ir.spec.formulas[0][1]}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    image = io.BytesIO()   # (written whole, by a rename: an interrupted plot leaves no half file)
    with warnings.catch_warnings():   # (a long --max-distance: 'loc="best" can be slow')
        warnings.filterwarnings("ignore", message='Creating legend with loc="best"')
        fig.tight_layout()
        try:
            fig.savefig(image, format=image_format)
        except Exception as exc:   # a format whose writer needs what is missing (.pgf: LaTeX)
            _fail(f"--out {out_file}: matplotlib could not write a .{image_format} file "
                  f"({type(exc).__name__}: {str(exc)[:200]}); give .png, .svg or .pdf")
    click.echo(f"{'wrote' if _write(out_file, image.getvalue()) else 'unchanged'} {_shown(out_file)}")


def _distance_label(channels: int) -> str:
    """The x axis: d, or for a prior over several position channels the first one, the others
    held at 0 (what log_prior_function draws)."""
    if channels == 1:
        return "d = i - j (how far back the key is)"
    rest = ", ".join(f"d{c}" for c in range(1, channels))
    return f"d0 = i0 - j0 (with {rest} = 0)"


def _image_format(out_file: Path) -> str:
    """The format --out's extension names, as matplotlib's savefig takes it; refused (one line,
    nothing written) where matplotlib has no writer for it, rather than by savefig's traceback."""
    from matplotlib.backend_bases import FigureCanvasBase
    formats = FigureCanvasBase.get_supported_filetypes()
    image_format = out_file.suffix.lower().lstrip(".")
    if image_format not in formats:
        problem = (f"'{out_file.suffix}' is not an image format matplotlib writes"
                   if out_file.suffix else "the name has no extension, which picks the format")
        _fail(f"--out {_shown(out_file)}: {problem}; end it with one of "
              f"{', '.join('.' + name for name in sorted(formats))}")
    return image_format


@main.command(name="list")
def list_priors() -> None:
    """List the shipped priors."""
    from .compiler.spec import load_spec
    for path in shipped_priors():
        spec = load_spec(path)
        click.echo(f"{spec.name:24s} {spec.description}")


if __name__ == "__main__":  # pragma: no cover
    main()
