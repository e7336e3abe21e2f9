"""The GPU throughput model against the kernels a GPU timed: one row per (prior, head dim,
kernel) of a `benchmarks/gpu.py --kernels` run (pinned variants, bamgen-<prior>@<pins>, compiled
with their pins), the model's cycles per 1000 scores beside the measured ones, and the
leave-one-out error of a one-factor fit (docs/performance.md, "Second GPU session").

    python benchmarks/model_check.py docs/results/gpu/h200_2026-11-26_priors.json [more.json ...]
    python benchmarks/model_check.py run.json --ghz 1.98 --sms 132 --pairs pairs.json
    python benchmarks/model_check.py run.json --with-pairs docs/results/gpu/h200_2026-11-26_pairs.json

Measured: each kernel's device time from torch.profiler (`--kernels`), as cycles per 1000
scores: time x clock x SMs / (B*H*N^2/2 / 1000) for a causal call. Modelled: the kernel compiled
ahead of time for the GPU's family with the tile the run used (the first candidate, or a
variant's pins: `bamgen.aot.compile_spec`), its main loop through `bamgen.aot.loop_model`: the
largest of its tensor, MUFU, FP32, issue and load/store cycles per 1000 scores; dQ counts every launch of a prior with
several groups of learnable scalars. LOO: each point predicted from the median
measured/modelled ratio of the other priors' same kernel and head dim, so a term the model
lacks shows as that point's error. `--pairs` writes the points as JSON for the next fit;
`--with-pairs` adds an earlier run's points (as compiled then) to this one's fit and table.

The fit (`fit_units`): the model's bound is the largest of its units, as if they overlapped
perfectly; the fitted model is a sum, cycles = sum of w_u x (unit u's cycles), with one
non-negative weight per unit for every kernel, fitted to relative error (non-negative least
squares). Its LOO refits without the point. Each point also carries the latency term (one
warp's path through the main loop from the SASS scoreboards, over the CTAs an SM holds:
bamgen.scoreboard), and where every point does, the table fits it with the units too: the term
on trial (docs/performance.md, "Latency and occupancy, tested"). Compile with the Triton the GPU
ran (the AOT compile uses the Triton imported here): another version's kernels are other kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

if __name__ == "__main__":   # the AOT compile needs the compiler's kernels, not the interpreter's
    os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# benchmarks/gpu.py's peer names -> (prior, AOT layout)
PRIORS = {"uniform": ("uniform", "plain"), "laplace": ("laplace", "plain"),
          "ggd": ("generalized_gaussian", "plain"), "ssmax": ("bam_ssmax", "plain"),
          "t5": ("t5", "plain"), "fire": ("fire", "plain"), "fox": ("forget_gate", "positions"),
          "rpe": ("generalized_gaussian", "positions_table"),
          "rpe-inline": ("generalized_gaussian", "positions")}
# the profiler's kernel names -> (phase of gpu.py's kernel_times, AOT kernel name)
KERNELS = {"fwd": ("fwd", "_attn_fwd", "attn_fwd"), "dkdv": ("bwd", "_attn_bwd_dkdv", "attn_bwd_dkdv"),
           "dq": ("bwd", "_attn_bwd_dq", "attn_bwd_dq")}
DTYPES = {"bf16": "bf16", "fp16": "fp16"}


@dataclass(frozen=True)
class Point:
    """One kernel of one run: modelled and measured cycles per 1000 scores."""
    prior: str
    head_dim: int
    kernel: str
    modelled: float
    measured: float
    device: str
    units: tuple[tuple[str, float], ...] = ()   # each unit's modelled cycles per 1000 scores
    arch: str = "sm_90"   # the family the kernel was compiled for (the fit holds for it alone)
    run: str = ""         # the file it was measured in (a gpu.py JSON; a --pairs file's name
                          # for pairs written before runs were kept): "vs NoPE" stays in a run
    n: int = 0            # the sequence length it was measured at (0: not kept, older pairs)


UNITS = ("tensor", "mufu", "fp32", "issue", "lsu")
# The candidate term each point carries beside the units (its pairs too, so that each run
# tests it on points the fit has not seen): docs/performance.md, "Latency and occupancy, tested"
LATENCY = "latency"
GHZ, SMS = 1.98, 132   # the measured cycles' clock and SMs by default: an H100's or H200's


def measured_cycles(us: float, result: dict, ghz: float = GHZ, sms: int = SMS) -> float:
    """A causal call's kernel time (a gpu.py result's) as cycles per 1000 scores on ``sms``
    SMs at ``ghz``, the unit the model counts in: time x clock x SMs / (B*H*N^2/2 / 1000)."""
    scores = result["B"] * result["H"] * result["N"] ** 2 / 2
    return us * 1e-6 * ghz * 1e9 * sms / (scores / 1000)


def load_pairs(path) -> list[Point]:
    """The points a --pairs file holds (the next fit's input); a point written before runs were
    kept takes the file's name as its run."""
    return [Point(**{"run": Path(path).name, **p, "units": tuple(tuple(u) for u in p["units"])})
            for p in json.loads(Path(path).read_text())]


def read_pairs(paths) -> list[Point]:
    """The points of several --pairs files together; ValueError naming a file that is not one."""
    points = []
    for path in paths:
        try:
            points += load_pairs(path)
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise ValueError(f"{path} is not a benchmarks/model_check.py --pairs file ({err})") from None
    return points


def measured_points(run: dict, ghz: float, sms: int) -> list[tuple[str, int, str, float, dict, int]]:
    """(peer prior, head dim, kernel, measured cycles per 1000 scores, pins, N) of a gpu.py JSON:
    a pinned variant (bamgen-<prior>@<pins>) is the prior "<prior>@<pins>", its pins the
    run's ``variants`` entry ({} for the shipped tiles)."""
    out = []
    for result in run["results"]:
        if result.get("mode") == "decode":   # a generation step's kernels: not a prefill's scores
            continue
        for peer, kernels in result.get("kernels", {}).items():
            prior = peer.removeprefix("bamgen-")
            if prior.partition("@")[0] not in PRIORS:
                continue
            pins = result.get("variants", {}).get(peer, {})
            for kernel, (phase, profiled, _) in KERNELS.items():
                entry = kernels.get(f"{phase}:{profiled}")
                if entry:
                    out.append((prior, result["D"], kernel,
                                measured_cycles(entry["us"], result, ghz, sms), pins, result["N"]))
    return out


def pinned_spec(spec: tuple, kernel: str | None, pins: dict, tile_for=None) -> tuple:
    """A kernel spec (triton_kernel_specs) with a variant's pinned tile, table gather, splits
    and K/V reads, as bamgen.runtime.triton.launch.pinned launches it; kernel: the tile table's
    name of it ("fwd", "bwd_dkdv", "bwd_dq", "decode"). tile_for(tma): the forward's default
    tile for a read (launch.candidates' first), which a kv pin that changes the read without a
    pinned tile launches with."""
    name, fn, signature, constexprs, warps, stages = spec
    constexprs = dict(constexprs)
    tile = pins.get("tiles", {}).get(kernel)
    if kernel in ("fwd", "decode") and pins.get("kv") is not None:
        # (a pinned "tma" where the spec's layout or dtype cannot take it keeps pointers, as
        # launch.kv_tma does; the decode kernel's tile is the same either way)
        tma = pins["kv"] == "tma" and signature["Q"] != "*fp32" and not any(
            constexprs.get(flag) for flag in ("HAS_KEY_MASK", "ROW_OFFSETS", "VARLEN")
        ) and constexprs["D"] % 8 == 0
        if kernel == "fwd" and tma != constexprs.get("KV_TMA", False) and not tile:
            if tile_for is None:
                raise ValueError(f"{name}: kv={pins['kv']} changes the forward's tile; pin it "
                                 f"(fwd=BMxBNxWARPSxSTAGES) or give tile_for")
            tile = tile_for(tma)
        constexprs["KV_TMA"] = tma
    if tile:
        constexprs.update(BLOCK_M=tile[0], BLOCK_N=tile[1])
        warps, stages = tile[2], tile[3]
    if kernel in ("fwd", "decode") and pins.get("gather"):
        constexprs["TABLE_GATHER"] = pins["gather"]
    for split_kernel, pin in (("bwd_dq", "dq_split"), ("bwd_dkdv", "dkdv_split")):
        if kernel == split_kernel and pins.get(pin) is not None:
            constexprs["SPLIT_STEADY"] = pins[pin]
    if kernel == "bwd_dq" and pins.get("dq_group") and constexprs.get("GRAD_COUNT"):
        constexprs["GRAD_COUNT"] = min(pins["dq_group"], constexprs["NUM_GRADS"])
    if constexprs.get("KV_TMA"):   # the descriptors' block follows the tile
        from bamgen.runtime.triton.launch import kv_descriptor_type
        dtype = signature["Q"].lstrip("*")
        signature = dict(signature, **{t: kv_descriptor_type(dtype, constexprs["BLOCK_N"],
                                                             constexprs["HEAD_DIM"]) for t in "KV"})
    elif spec[3].get("KV_TMA"):   # descriptors the pin turned into pointers
        signature = dict(signature, K=signature["Q"], V=signature["Q"])
    return name, fn, signature, constexprs, warps, stages


def forward_tile(module, head_dim: int, arch: str, layout: str, tma: bool) -> tuple:
    """The forward's default tile a launch of this AOT layout takes with K and V read through
    TMA or pointers (launch.candidates)."""
    from bamgen.runtime.triton.launch import candidates
    return candidates(module._prior, "fwd", head_dim, arch, layout not in ("plain", "positions"),
                      tma)[0]


def modelled(prior: str, head_dim: int, arch: str, dtype: str, pins: dict | None = None,
             kernels: tuple[str, ...] = tuple(KERNELS)) -> dict:
    """{kernel: {unit: modelled cycles per 1000 scores}} of a prior's kernels (KERNELS' names:
    those a run measured), compiled with a variant's pins."""
    from bamgen.aot import compile_spec, loop_model
    from bamgen.driver.loader import load_prior
    from bamgen.resources import shipped_prior
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from aot_report import dq_launches
    name, layout = PRIORS[prior.partition("@")[0]]
    module = load_prior(shipped_prior(name))
    wanted = {aot: kernel for kernel, (_, _, aot) in KERNELS.items() if kernel in kernels}
    kwargs = {} if layout == "plain" else {"layout": layout}
    cycles = {}
    for spec in module.triton_kernel_specs(dtype, head_dim, True, arch=arch, **kwargs):
        if spec[0] not in wanted:
            continue
        k = compile_spec(pinned_spec(spec, spec[0].removeprefix("attn_"), pins or {},
                                     lambda tma: forward_tile(module, head_dim, arch, layout, tma)),
                         arch)
        model = loop_model(k.main_loop, arch, k.num_warps)
        scale = 1000 / (k.block[0] * k.block[1]) * (
            dq_launches(module, (pins or {}).get("dq_group")) if k.name == "attn_bwd_dq" else 1)
        cycles[wanted[k.name]] = {**{u: c * scale for u, c in model["cycles"].items()},
                                  LATENCY: latency_per_tile(k) * scale}
    return cycles


def latency_per_tile(k) -> float:
    """The latency term of a compiled kernel (benchmarks/model_terms.py tested it): one warp's
    steady pass through the main loop, from the SASS scoreboards (bamgen.scoreboard), over the
    CTAs an SM holds, in cycles per tile."""
    from bamgen.scoreboard import main_loop, resident_ctas, scheduled, warp_cycles
    path = warp_cycles(main_loop(scheduled(k.cubin)), k.num_warps, k.arch,
                       stages=getattr(k, "num_stages", 2))
    return path / resident_ctas(k.registers, k.shared_bytes, k.num_warps, k.arch)


def _modelled(key: tuple) -> dict:
    prior, head_dim, arch, dtype, pins, kernels = key
    return modelled(prior, head_dim, arch, dtype, json.loads(pins), kernels)


def compile_all(keys: list[tuple]) -> dict:
    """{key: modelled(*key)} for (prior, head dim, arch, dtype, pins as JSON, kernels) keys, compiled
    once each, in parallel processes (a compile is single-threaded; a GPU machine has many
    cores, and make gpu-check gives this step a minute)."""
    if len(keys) <= 1:
        return {key: _modelled(key) for key in keys}
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    workers = min(len(keys), os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return dict(zip(keys, pool.map(_modelled, keys)))


def points(runs: list[dict], ghz: float, sms: int, arch: str) -> list[Point]:
    measured = []
    for i, run in enumerate(runs):
        dtype = DTYPES.get(run["args"].get("dtype", "bf16"), "bf16")
        name = run_name(run) or f"run {i + 1}"
        measured += [(run, name, n, (prior, head_dim, arch, dtype, json.dumps(pins, sort_keys=True)), kernel, cycles)
                     for prior, head_dim, kernel, cycles, pins, n in measured_points(run, ghz, sms)]
    needed = {}   # the kernels each (prior, head dim, ..., pins) was measured for
    for _, _, _, key, kernel, _ in measured:
        needed.setdefault(key, set()).add(kernel)
    keys = {key: key + (tuple(k for k in KERNELS if k in kernels),) for key, kernels in needed.items()}
    compiled = compile_all(list(keys.values()))
    out = []
    for run, name, n, key, kernel, cycles in measured:
        units = compiled[keys[key]][kernel]
        out.append(Point(key[0], key[1], kernel, max(units[u] for u in UNITS), cycles, run["env"]["device"],
                         tuple(sorted(units.items())), arch, name, n))
    return out


def _nnls(a, b):
    """min |a x - b| with x >= 0 (a small active-set solver: drop the most negative weight and
    solve again), float64 torch tensors."""
    import torch
    active = list(range(a.shape[1]))
    while active:
        x = torch.linalg.lstsq(a[:, active], b[:, None]).solution[:, 0]
        if (x >= 0).all():
            full = torch.zeros(a.shape[1], dtype=a.dtype)
            full[active] = x
            return full
        del active[int(torch.argmin(x))]
    return torch.zeros(a.shape[1], dtype=a.dtype)


def fit_units(pts: list[Point], units=UNITS) -> dict[str, float]:
    """The weights of the fitted model (see the module's docstring), to relative error."""
    import torch
    a = torch.tensor([[dict(p.units)[u] / p.measured for u in units] for p in pts],
                     dtype=torch.float64)
    x = _nnls(a, torch.ones(len(pts), dtype=torch.float64))
    return {u: float(w) for u, w in zip(units, x)}


def weighted(units, weights: dict[str, float]) -> float:
    """The fitted model's cycles: ``units`` ((unit, modelled cycles) pairs or a dict) weighted."""
    return sum(w * dict(units)[u] for u, w in weights.items())


def fitted(p: Point, weights: dict[str, float]) -> float:
    return weighted(p.units, weights)


def _kin(p: Point, q: Point) -> bool:
    """q is p's kernel of the same prior (p itself, a pinned variant of it, or the shipped
    kernel of a variant): a point leave-one-out must not predict p from."""
    return (q.kernel, q.head_dim, base_prior(q)) == (p.kernel, p.head_dim, base_prior(p))


def base_prior(p: Point) -> str:
    """The prior a point's kernel computes: "ggd" for ggd@gather=coalesced."""
    return p.prior.partition("@")[0]


def leave_one_out_fit(pts: list[Point], units=UNITS) -> list[float | None]:
    """Each point's relative error under the fit of the points of other priors or kernels
    (its own variants left out with it: they are the same kernel but for a tile or a read),
    fitted on ``units`` (benchmarks/model_terms.py tries more)."""
    if len(pts) <= len(units):
        return [None] * len(pts)
    return [fitted(p, fit_units([q for q in pts if not _kin(p, q)], units)) / p.measured - 1
            for p in pts]


def leave_one_out(pts: list[Point]) -> list[float | None]:
    """Each point's relative error when its kernel's factor (measured / modelled) is the
    median over the other priors of the same kernel and head dim, variants of its own prior
    left out (None: no other prior)."""
    errors = []
    for p in pts:
        others = [q.measured / q.modelled for q in pts
                  if q.kernel == p.kernel and q.head_dim == p.head_dim and base_prior(q) != base_prior(p)]
        errors.append(None if not others else statistics.median(others) * p.modelled / p.measured - 1)
    return errors


def run_name(run: dict) -> str:
    """A gpu.py JSON's file name (its --json argument), the key of its points' run."""
    return Path(run.get("args", {}).get("json") or "").name


def nope_of(pts: list[Point]):
    """p -> the NoPE point its "vs NoPE" columns divide by: the same run's (sequence length,
    kernel and head dim), else the last one measured on the same device; None if neither."""
    same_run = {(q.run, q.n, q.head_dim, q.kernel): q for q in pts if q.prior == "uniform"}
    same_device = {(q.device, q.head_dim, q.kernel): q for q in pts if q.prior == "uniform"}
    return lambda p: (same_run.get((p.run, p.n, p.head_dim, p.kernel))
                      or same_device.get((p.device, p.head_dim, p.kernel)))


def table(pts: list[Point]) -> list[str]:
    """The points beside the raw model, one factor per kernel and the fitted sum of units, each
    with its leave-one-out error; where every point carries the latency term, the fitted sum
    with it too (the term on trial: docs/performance.md, "Latency and occupancy, tested")."""
    nope = nope_of(pts)
    weights = fit_units(pts) if len(pts) > len(UNITS) else None
    with_latency = bool(pts) and all(LATENCY in dict(p.units) for p in pts)
    terms = UNITS + (LATENCY,)
    weights_latency = fit_units(pts, terms) if with_latency and len(pts) > len(terms) else None
    head = ["prior", "D", "kernel", "modelled", "measured", "measured / modelled",
            "vs NoPE, modelled", "vs NoPE, measured", "LOO error", "fitted", "LOO error, fitted"]
    if with_latency:
        head += ["fitted + latency", "LOO error, + latency"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    loo, loo_fit = leave_one_out(pts), leave_one_out_fit(pts)
    loo_latency = leave_one_out_fit(pts, terms) if with_latency else [None] * len(pts)
    for p, err, err_fit, err_latency in zip(pts, loo, loo_fit, loo_latency):
        base = nope(p)
        rel = (f"{p.modelled / base.modelled:.2f}x | {p.measured / base.measured:.2f}x" if base
               else "- | -")
        row = (f"| {p.prior} | {p.head_dim} | {p.kernel} | {p.modelled:.0f} | "
               f"{p.measured:.0f} | {p.measured / p.modelled:.2f} | {rel} | {_pct(err)} | "
               f"{_cycles(p, weights)} | {_pct(err_fit)} |")
        if with_latency:
            row += f" {_cycles(p, weights_latency)} | {_pct(err_latency)} |"
        lines.append(row)
    summaries = [("one factor per kernel and head dim", loo), ("the fitted sum of units", loo_fit)]
    if with_latency:
        summaries.append(("the fitted sum of units and latency", loo_latency))
    for name, errs in summaries:
        errors = [abs(e) for e in errs if e is not None]
        if errors:
            lines.append(f"\nwithin 15% (leave one out, {name}): "
                         f"{sum(e <= 0.15 for e in errors)} of {len(errors)}")
    for name, w in (("", weights), (", with latency", weights_latency)):
        if w:
            lines.append(f"\nfitted weights{name} (cycles per modelled cycle): "
                         + ", ".join(f"{u} {x:.2f}" for u, x in w.items()))
    return lines


def _cycles(p: Point, weights: dict | None) -> str:
    return "-" if weights is None else f"{fitted(p, weights):.0f}"


def _pct(err: float | None) -> str:
    return "-" if err is None else f"{err * 100:+.0f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", help="JSON files of benchmarks/gpu.py --kernels")
    ap.add_argument("--with-pairs", action="append", default=[], metavar="PATH",
                    help="the points of earlier runs (a --pairs file), fitted and reported with "
                         "these: each GPU run adds to the fit (their kernels as compiled then)")
    ap.add_argument("--ghz", type=float, default=GHZ, help="SM clock (default: an H100/H200's max)")
    ap.add_argument("--sms", type=int, default=SMS, help="multiprocessors (default: H100/H200)")
    ap.add_argument("--arch", default="sm_90", choices=["sm_90", "sm_80"])
    ap.add_argument("--pairs", metavar="PATH", help="also write the points as JSON")
    ap.add_argument("--append", metavar="PATH", help="also append the table to this markdown "
                                                      "report (what make gpu-check does)")
    args = ap.parse_args(argv)
    if not args.runs and not args.with_pairs:
        ap.error("give runs (JSON files of benchmarks/gpu.py --kernels) or --with-pairs files")
    try:
        earlier = read_pairs(args.with_pairs)
    except ValueError as err:
        ap.error(f"--with-pairs: {err}")
    other = [p for p in earlier if p.arch != args.arch]
    if other:   # one family's units, one fit: another family's points are left out
        print(f"--with-pairs: left out {len(other)} points compiled for "
              f"{', '.join(sorted({p.arch for p in other}))} (this fit is for {args.arch})", file=sys.stderr)
        earlier = [p for p in earlier if p.arch == args.arch]
    runs = []
    for path in args.runs:
        try:
            runs.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as err:
            ap.error(f"{path}: not a benchmarks/gpu.py JSON ({err})")
    pts = points(runs, args.ghz, args.sms, args.arch) if runs else []
    if not pts and not earlier:
        print("no kernel times in these runs: run benchmarks/gpu.py with --kernels" if runs
              else f"no points compiled for {args.arch} in the --with-pairs files")
        return 1
    lines = table(earlier + pts)
    print("\n".join(lines))
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n## The throughput model against these kernels (benchmarks/model_check.py)\n\n"
                    + "\n".join(lines) + "\n")
    if args.pairs:
        Path(args.pairs).write_text(json.dumps([asdict(p) for p in pts], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
