"""The ``bamgen`` command line: thin wrappers over the compiler stages.

Every user error exits with status 2 and one line on stderr naming the file and field; nothing
is written unless every requested build succeeded. ``--check`` exits 1 when an output is stale.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

from . import __version__
from .codegen import Artifact, compile_spec, write_atomic
from .errors import SpecError
from .lower import STRATEGIES
from .resources import shipped_priors
from .spec import load_spec
from .timeout import BuildTimeout, time_limit

BUILD_SECONDS = 120


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="bamgen")
def main() -> None:
    """Compile positional priors into fused attention kernels."""


@main.command()
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--out", "out_dir", default="generated", show_default=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="Folder for the generated modules.")
@click.option("--all", "build_all", is_flag=True, help="Build every shipped prior.")
@click.option("--check", is_flag=True,
              help="Write nothing; exit 1 if an output is missing or differs.")
@click.option("--strategy", type=click.Choice(STRATEGIES), default=None,
              help="Override the lowering strategy the cost model picks.")
def build(files: tuple[Path, ...], out_dir: Path, build_all: bool, check: bool,
          strategy: str | None) -> None:
    """Build prior FILES into standalone Python modules."""
    paths = list(files) + (shipped_priors() if build_all else [])
    if not paths:
        _fail("no prior files given; pass FILE... or --all")
    if out_dir.exists() and not out_dir.is_dir():
        _fail(f"--out {out_dir} exists and is not a folder")
    artifacts = _compile_all(paths, strategy)
    stale = []
    for path, artifact in zip(paths, artifacts):
        target = out_dir / artifact.filename
        current = target.read_text(encoding="utf-8") if target.is_file() else None
        if check:
            if current != artifact.text:
                stale.append(str(target))
            continue
        if current == artifact.text:
            click.echo(f"unchanged {target}")
        else:
            write_atomic(target, artifact.text)
            click.echo(f"wrote {target}")
        for note in artifact.notes:
            click.echo(f"  note: {note}")
    if check:
        if stale:
            click.echo("stale (run `bamgen build` to update): " + ", ".join(stale), err=True)
            sys.exit(1)
        click.echo(f"{len(paths)} module(s) up to date in {out_dir}")


def _compile_all(paths: list[Path], strategy: str | None) -> list[Artifact]:
    """Compile every file in memory first: one bad file means nothing is written."""
    artifacts, names = [], {}
    for path in paths:
        try:
            with time_limit(BUILD_SECONDS):
                artifact = compile_spec(load_spec(path), strategy)
        except SpecError as err:
            _fail(str(err.located(str(path))))
        except BuildTimeout:
            _fail(f"{path}: the build took longer than {BUILD_SECONDS} s; simplify the formula")
        except RecursionError:
            _fail(f"{path}: the formula is too deeply nested to compile")
        if artifact.name in names:
            _fail(f"{path} and {names[artifact.name]} both define the prior '{artifact.name}'")
        names[artifact.name] = path
        artifacts.append(artifact)
    return artifacts


@main.command()
@click.argument("file", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--arch", type=click.Choice(["sm_80", "sm_90"]), default="sm_90", show_default=True)
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True)
@click.option("--head-dim", type=click.IntRange(1, 256), default=64, show_default=True)
@click.option("--causal/--no-causal", default=True, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def inspect(file: Path, arch: str, dtype: str, head_dim: int, causal: bool, as_json: bool) -> None:
    """Compile FILE's kernels ahead of time for a GPU and report their resources.

    FILE is a prior (.yaml) or a generated module (.py). No GPU is needed.
    """
    import json
    import os
    os.environ.pop("TRITON_INTERPRET", None)   # compile for the GPU, not the interpreter
    from .aot import compile_module
    from .loader import import_module_file, load_prior
    try:
        with time_limit(BUILD_SECONDS):
            module = import_module_file(file) if file.suffix == ".py" else load_prior(file)
    except SpecError as err:
        _fail(str(err.located(str(file))))
    kernels = compile_module(module, arch=arch, dtype=dtype, head_dim=head_dim, causal=causal)
    report = {"prior": module.PRIOR["name"], "arch": arch, "dtype": dtype, "head_dim": head_dim,
              "causal": causal,
              "kernels": [{"name": k.name, "registers": k.registers, "stack_bytes": k.stack_bytes,
                           "spill_bytes": k.local_bytes, "shared_bytes": k.shared_bytes}
                          for k in kernels]}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"{report['prior']}: {arch} {dtype} head_dim={head_dim} causal={causal}")
    click.echo(f"  {'kernel':16s} {'regs':>5s} {'stack':>6s} {'spill':>6s} {'shared':>8s}")
    for k in report["kernels"]:
        click.echo(f"  {k['name']:16s} {k['registers']:5d} {k['stack_bytes']:6d} "
                   f"{k['spill_bytes']:6d} {k['shared_bytes']:8d}")


@main.command(name="list")
def list_priors() -> None:
    """List the shipped priors."""
    for path in shipped_priors():
        spec = load_spec(path)
        click.echo(f"{spec.name:24s} {spec.description}")


if __name__ == "__main__":  # pragma: no cover
    main()
