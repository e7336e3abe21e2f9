"""Do latency and occupancy explain what the throughput model misses? The GPU runs' points (the
--pairs files of benchmarks/model_check.py), their kernels compiled again as they were, and the
fit's leave-one-out error with and without each candidate term (docs/performance.md, "Latency
and occupancy, tested").

    python benchmarks/model_terms.py \
        docs/results/gpu/h200_2026-11-26_pairs.json@ae517cd \
        docs/results/gpu/nvidia-h200-2026-11-26-pairs.json@e94bb54 \
        docs/results/gpu/nvidia-h100-80gb-hbm3-2026-11-27-pairs.json@811b17e

Each argument is a pairs file and the commit whose kernels it holds (the commit that wrote
it). The commit is checked out in a temporary git worktree and every point's kernel compiled
there with the Triton imported here (the GPU runs' was 3.6: use it, or the kernels are other
kernels); a point whose recompiled units differ from the file's by more than 2% is reported and
left out. Per kernel, bamgen.scoreboard gives one warp's steady path through the main loop
(the scoreboards and stall counts ptxas wrote) and the CTAs an SM holds (registers, shared
memory, warps). The terms, each in cycles per 1000 scores as the units are:

    latency      the warp's path / resident CTAs (other CTAs fill a warp's waits)
    single-CTA   each unit again, where one CTA fills the SM (no other CTA to overlap with)

The fit is model_check's (non-negative weights, relative error, a point's own prior and kernel
left out of its own fit).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

if __name__ == "__main__":   # the AOT compile needs the compiler's kernels, not the interpreter's
    os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parents[1]

TOLERANCE = 0.02   # recompiled units within 2% of the file's: the same kernel
GATHERS = ("async", "coalesced", "direct", "prefetch")  # a variant's table reads (pins)
TILE_KERNELS = ("fwd", "bwd_dkdv", "bwd_dq", "decode")  # a variant's pinned tiles
KV_READS = ("pointers", "tma")   # the forward's K and V reads (launch.KV_READS)


def _this_checkout(name: str, path: str):
    """A module of this checkout, by path, whichever bamgen and benchmarks the process imports
    (the child compiles with a worktree's, and an older commit has no bamgen.scoreboard)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def _model_check():
    """This checkout's model_check (the parent's fit; loading it puts this checkout's bamgen
    first on sys.path, which the child must not)."""
    return _this_checkout("model_check_here", "benchmarks/model_check.py")


UNITS = ("tensor", "mufu", "fp32", "issue", "lsu")   # model_check.UNITS (checked in report)


def pins_of(prior: str) -> dict:
    """A variant's pins from its name, as benchmarks/gpu.py's Variant.as_json gives them:
    "ggd@fwd=128x64x8x3,gather=async,dq_split=off" -> {"tiles": {"fwd": [128, 64, 8, 3]},
    "gather": "async", "dq_split": False}; kv=pointers|tma the forward's K and V reads,
    table=device|host where the distance table is built, dq_group=N the scalars a dQ launch
    sums."""
    pins: dict = {}
    for part in filter(None, prior.partition("@")[2].split(",")):
        key, _, value = part.partition("=")
        if key == "gather" and value in GATHERS:
            pins["gather"] = value
        elif key in TILE_KERNELS and re.fullmatch(r"\d+x\d+x\d+x\d+", value):
            pins.setdefault("tiles", {})[key] = [int(x) for x in value.split("x")]
        elif key in ("dq_split", "dkdv_split") and value in ("on", "off"):
            pins[key] = value == "on"
        elif key == "kv" and value in KV_READS:
            pins["kv"] = value
        elif key == "table" and value in ("device", "host"):
            pins["table"] = value   # (where the table is built: no kernel of the model's changes)
        elif key == "dq_group" and value.isdigit() and int(value) > 0:
            pins["dq_group"] = int(value)
        else:
            raise ValueError(f"{prior!r}: {part!r} is not gather=async|coalesced|direct|prefetch, "
                             f"<kernel>=BMxBNxWARPSxSTAGES ({', '.join(TILE_KERNELS)}), "
                             f"dq_split=on|off, dkdv_split=on|off, kv={'|'.join(KV_READS)}, "
                             f"table=device|host or dq_group=<count>")
    return pins


def kernel_terms(points: list[dict]) -> list[dict]:
    """Each point's kernel compiled by the bamgen this process imports (the worktree's): its
    units as model_check computes them, and the terms' inputs."""
    import bamgen.aot as aot
    import model_check as then   # the worktree's (PYTHONPATH; main() took this folder off the path)
    board = _this_checkout("bamgen.scoreboard", "bamgen/scoreboard.py")   # (its .aot: the worktree's)
    compiled = {}
    compile_as_then = aot.compile_spec

    def compile_spec(spec, arch):   # keeps each kernel model_check compiles
        kernel = compile_as_then(spec, arch)
        compiled[kernel.name] = kernel
        return kernel

    aot.compile_spec = compile_spec
    cache, out = {}, []
    for p in points:
        key = (p["prior"], p["head_dim"], p.get("arch", "sm_90"))
        if key not in cache:
            compiled.clear()
            units = then.modelled(p["prior"], p["head_dim"], key[2], "bf16", pins_of(p["prior"]))
            cache[key] = {}
            for kernel, (_, _, name) in then.KERNELS.items():
                k = compiled[name]
                raw = aot.loop_model(k.main_loop, key[2], k.num_warps)["cycles"]
                loop = board.main_loop(board.scheduled(k.cubin))
                cache[key][kernel] = {
                    "units": units[kernel], "scale": units[kernel]["tensor"] / raw["tensor"],
                    # (a worktree before TMA copies knows no stages: its loops hold none)
                    "path": board.warp_cycles(loop, k.num_warps, key[2], **(
                        {"stages": k.num_stages} if hasattr(k, "num_stages") else {})),
                    "ctas": board.resident_ctas(k.registers, k.shared_bytes, k.num_warps, key[2])}
        out.append(cache[key][p["kernel"]])
    return out


def compile_at(pairs: Path, commit: str) -> list[dict]:
    """kernel_terms of a pairs file's points, in a worktree of ``commit`` (a child process)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), commit],
                       check=True, capture_output=True)
        try:
            env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'benchmarks'}",
                   "BAMGEN_CACHE_DIR": str(Path(tmp) / "cache")}
            env.pop("TRITON_INTERPRET", None)
            res = subprocess.run([sys.executable, __file__, "--child", str(pairs.resolve())],
                                 cwd=tree, env=env, capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"compiling {pairs} at {commit} failed:\n{res.stderr[-3000:]}")
            return json.loads(res.stdout.splitlines()[-1])
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                           capture_output=True)


def latency_of(terms: dict) -> float:
    """The latency term in cycles per 1000 scores (model_check.latency_per_tile's, scaled)."""
    return terms["path"] * terms["scale"] / terms["ctas"]


def add_latency(path: str, matched: dict[int, dict]) -> None:
    """Write the latency term into a pairs file's points (index -> their kernel's terms), as
    model_check writes it for a new run: each run's pairs then test it (docs/performance.md,
    "Latency and occupancy, tested")."""
    points = json.loads(Path(path).read_text())
    for i, terms in matched.items():
        units = [u for u in points[i]["units"] if u[0] != "latency"]
        points[i]["units"] = sorted(units + [["latency", round(latency_of(terms), 3)]])
    Path(path).write_text(json.dumps(points, indent=1))


def with_terms(point, terms: dict):
    """A model_check Point whose units carry the candidate terms too."""
    units = dict(point.units)
    one_cta = terms["ctas"] == 1
    extra = {"latency": latency_of(terms),
             **{f"{u} (single CTA)": units[u] * one_cta for u in UNITS}}
    return replace(point, units=tuple(sorted({**units, **extra}.items())))


def same_kernel(point, terms: dict) -> bool:
    stored = dict(point.units)
    return all(abs(terms["units"][u] - stored[u]) <= TOLERANCE * max(1.0, stored[u]) for u in UNITS)


TERM_SETS = {"the five units": UNITS,
             "+ latency": UNITS + ("latency",),
             "+ single-CTA units": UNITS + tuple(f"{u} (single CTA)" for u in UNITS),
             "+ both": UNITS + ("latency",) + tuple(f"{u} (single CTA)" for u in UNITS)}


def report(points) -> list[str]:
    mc = _model_check()
    assert mc.UNITS == UNITS, "model_check's units changed: update UNITS"
    lines = ["| terms | within 15% (leave one out) | median |error| | worst |", "|---|---:|---:|---|"]
    errors = {}
    for name, units in TERM_SETS.items():
        errs = mc.leave_one_out_fit(points, units)
        errors[name] = errs
        worst = max(zip(points, errs), key=lambda pe: abs(pe[1]))
        absolute = sorted(abs(e) for e in errs)
        lines.append(f"| {name} | {sum(e <= 0.15 for e in absolute)} of {len(errs)} | "
                     f"{absolute[len(absolute) // 2] * 100:.0f}% | {worst[0].prior} {worst[0].head_dim} "
                     f"{worst[0].kernel} {mc._pct(worst[1])} |")
    lines += ["", "| prior | D | kernel | measured | latency term | " + " | ".join(TERM_SETS) + " |",
              "|---|---|---|---:|---:|" + "---:|" * len(TERM_SETS)]
    for i, p in enumerate(points):
        latency = dict(p.units)["latency"]
        lines.append(f"| {p.prior} | {p.head_dim} | {p.kernel} | {p.measured:.0f} | {latency:.0f} | "
                     + " | ".join(mc._pct(errors[name][i]) for name in TERM_SETS) + " |")
    return lines


def predictions(points, peers: list[str], head_dims: list[int], commit: str) -> list[str]:
    """The forward's cycles per 1000 scores each term set's fit predicts for ``peers`` (a
    model_check prior name: "ssmax", "ggd@gather=async") compiled at ``commit``: what the next
    GPU run's variants step will measure, written down before it does."""
    mc = _model_check()
    wanted = [{"prior": peer, "head_dim": d, "kernel": "fwd"} for d in head_dims for peer in peers]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as fh:
        json.dump(wanted, fh)
        fh.flush()
        terms = compile_at(Path(fh.name), commit)
    weights = {name: mc.fit_units(points, units) for name, units in TERM_SETS.items()}
    lines = ["| prior | D | latency term | " + " | ".join(TERM_SETS) + " |",
             "|---|---|---:|" + "---:|" * len(TERM_SETS)]
    for want, term in zip(wanted, terms):
        point = with_terms(mc.Point(want["prior"], want["head_dim"], "fwd", 0.0, 1.0, "",
                                    tuple(sorted(term["units"].items()))), term)
        lines.append(f"| {want['prior']} | {want['head_dim']} | {dict(point.units)['latency']:.0f} | "
                     + " | ".join(f"{mc.fitted(point, w):.0f}" for w in weights.values()) + " |")
    return lines


def _commit(ap, commit: str, what: str) -> str:
    """The full hash of ``commit``, or the parser's error naming ``what``."""
    res = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
                         capture_output=True, text=True)
    if res.returncode or not commit:
        ap.error(f"{what}: {commit!r} is not a commit of this repository")
    return res.stdout.strip()


def _pairs_files(ap, args, mc) -> list[tuple[str, str, list]]:
    """(path, commit, points) of each PAIRS@COMMIT argument, every one checked before any
    compile starts."""
    out = []
    for arg in args.pairs:
        path, at, commit = arg.rpartition("@")
        if not at or not path:
            ap.error(f"{arg}: expected PAIRS@COMMIT, a model_check.py --pairs file and a commit")
        try:
            points = mc.load_pairs(path)
        except OSError as err:
            ap.error(f"{arg}: cannot read {path} ({err.strerror or err})")
        except (ValueError, TypeError, KeyError) as err:
            ap.error(f"{path} is not a model_check.py --pairs file ({err})")
        out.append((path, _commit(ap, commit, arg), points))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pairs", nargs="*", metavar="PAIRS@COMMIT",
                    help="a model_check.py --pairs file and the commit whose kernels it holds")
    ap.add_argument("--predict", action="append", metavar="PRIOR", default=[],
                    help="also predict this forward (a model_check name: ssmax, "
                         "ggd@gather=async, ...) as compiled at --at, with each fit; repeat it")
    ap.add_argument("--head-dim", type=int, nargs="+", default=[64, 128], help="for --predict")
    ap.add_argument("--at", default="HEAD", help="the commit --predict compiles (default: HEAD)")
    ap.add_argument("--add-latency", action="store_true",
                    help="write the latency term into each pairs file's points (those whose "
                         "kernel compiled the same), as model_check writes it for a new run")
    ap.add_argument("--child", metavar="PAIRS", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        here = str(Path(__file__).resolve().parent)   # the worktree's model_check, not this one
        sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != here]
        print(json.dumps(kernel_terms(json.loads(Path(args.child).read_text()))))
        return 0
    if not args.pairs:
        ap.error("give PAIRS@COMMIT arguments")
    mc = _model_check()
    files = _pairs_files(ap, args, mc)
    if args.predict:
        at = _commit(ap, args.at, "--at")
        for prior in args.predict:
            if prior.partition("@")[0] not in mc.PRIORS:
                ap.error(f"--predict {prior}: the prior is one of {', '.join(mc.PRIORS)}")
            try:
                pins_of(prior)
            except ValueError as err:
                ap.error(f"--predict {err}")
    points = []
    for path, commit, loaded in files:
        matched = {}
        for i, (point, terms) in enumerate(zip(loaded, compile_at(Path(path), commit))):
            if same_kernel(point, terms):
                points.append(with_terms(point, terms))
                matched[i] = terms
            else:
                print(f"left out {point.prior} {point.head_dim} {point.kernel} of {path}: compiled at "
                      f"{commit[:12]}, its units differ from the file's", file=sys.stderr)
        if args.add_latency:
            add_latency(path, matched)
    if len(points) <= len(TERM_SETS["+ both"]):
        print("too few points to fit the terms", file=sys.stderr)
        return 1
    print("\n".join(report(points)))
    if args.predict:
        print(f"\npredicted forwards at {args.at} (cycles per 1000 scores):\n")
        print("\n".join(predictions(points, args.predict, args.head_dim, at)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
