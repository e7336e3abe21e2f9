"""The modelled GPU backward of a learned table (T5's buckets) as the table grows, without a GPU.

A prior of the distance alone gets every learnable scalar's gradient from per-distance sums of
dS (DIST_SUMS: the dQ kernel sums dS over each i - j = d of its tile, then contracts those sums
with the derivative tables), at a cost meant not to grow with the parameter count. The other
way, used by every other prior, keeps an accumulator per learnable scalar per score, in launches
of GRAD_GROUP scalars (each launch recomputes P and dS). This script compiles both for T5-like
causal bucket tables of 8, 32 and 128 entries (max distance 4x the entries), next to GGD and
NoPE, and prints the model's cycles per 1000 scores (bamgen/aot.py: the main loop's slowest
unit) of dK/dV, dQ and the whole backward. Per-scalar dQ is the sum of its launches: the first
(which also writes dQ) plus the others; each at its best spill-free tile of those listed.

    python benchmarks/table_grads.py [--arch sm_90] [--head-dim 128] [--sizes 8 32 128]
"""
import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bamgen.aot import compile_spec, loop_model  # noqa: E402
from bamgen.driver.loader import load_prior  # noqa: E402
from bamgen.resources import shipped_priors  # noqa: E402
from bamgen.runtime.triton.launch import GRAD_GROUP, grad_groups  # noqa: E402

# dQ tiles tried for the per-scalar accumulators (the best spill-free one counts)
PER_SCALAR_DQ_TILES = ((64, 32, 4, 2), (32, 32, 4, 2), (32, 16, 4, 2), (16, 16, 4, 2))

T5_LIKE = """\
name: t5_{size}
params:
  w: {{size: {size}, init: 0.0}}
let:
  r: Max(d, 0)
  bucket: Piecewise((r, r < {exact}), (Min({last}, {exact} + floor(log(r/{exact})/log(8)*{exact})), True))
log_prior: w[bucket]
"""


def t5_like(size: int, folder: Path):
    """A causal T5 bucket table of `size` entries: half exact, half logarithmic up to 4x."""
    path = folder / f"t5_{size}.yaml"
    path.write_text(T5_LIKE.format(size=size, exact=size // 2, last=size - 1))
    return load_prior(path)


def cost(kernel, arch):
    """The model's cycles per 1000 scores of a compiled kernel's main loop."""
    model = loop_model(kernel.main_loop, arch, kernel.num_warps)
    return max(model["cycles"].values()) * 1000 / (kernel.block[0] * kernel.block[1])


def specs(module, args):
    return {s[0]: s for s in module.triton_kernel_specs("bf16", args.head_dim, True, arch=args.arch)}


def with_constexprs(spec, tile=None, **changes):
    name, fn, signature, constexprs, warps, stages = spec
    constexprs = {**constexprs, **changes}
    if tile is not None:
        constexprs.update(BLOCK_M=tile[0], BLOCK_N=tile[1])
        warps, stages = tile[2], tile[3]
    return (name, fn, signature, constexprs, warps, stages)


def per_scalar_dq(module, args):
    """(cycles per 1k scores, tile, launches) of the dQ kernel with an accumulator per scalar,
    at its best spill-free (group size, tile): GRAD_GROUP scalars a launch, or fewer where
    that spills (a table prior's eight accumulators spill at every tile listed)."""
    prior = module._prior
    saved = prior.traits
    prior.traits = dataclasses.replace(saved, dist_sums=False, tile_kind="table")
    try:
        spec = specs(module, args)["attn_bwd_dq"]
    finally:
        prior.traits = saved
    grads = saved.num_grads
    best = None
    for size in (GRAD_GROUP, GRAD_GROUP // 2, GRAD_GROUP // 4):
        groups = grad_groups(grads, size=size)
        for tile in PER_SCALAR_DQ_TILES:
            first = compile_spec(with_constexprs(spec, tile, GRAD_BASE=0, GRAD_COUNT=groups[0][1]),
                                 args.arch)
            if first.stack_bytes:
                print(f"  (per-scalar dQ, {size} a launch, {tile[0]}x{tile[1]}: spills "
                      f"{first.stack_bytes} B)", file=sys.stderr)
                continue
            total = cost(first, args.arch)
            if len(groups) > 1:
                other = compile_spec(with_constexprs(spec, tile, GRAD_BASE=groups[1][0],
                                                     GRAD_COUNT=groups[1][1]), args.arch)
                total += cost(other, args.arch) * (len(groups) - 1)
            if best is None or total < best[0]:
                best = (total, tile, len(groups))
        if best is not None:
            return best
    raise RuntimeError("every per-scalar dQ configuration spills")


def row(label, module, args, per_scalar=False):
    kernels = specs(module, args)
    dkdv = compile_spec(kernels["attn_bwd_dkdv"], args.arch)
    if per_scalar:
        dq_cost, tile, launches = per_scalar_dq(module, args)
        spills = 0
    else:
        dq = compile_spec(kernels["attn_bwd_dq"], args.arch)
        dq_cost, tile, launches, spills = cost(dq, args.arch), dq.block + (dq.num_warps,), 1, dq.stack_bytes
    return dict(label=label, dkdv=cost(dkdv, args.arch), dq=dq_cost, tile=tile, launches=launches,
                spills=dkdv.stack_bytes + spills)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90", choices=["sm_90", "sm_80"])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 128])
    args = parser.parse_args(argv)
    shipped = {p.stem: p for p in shipped_priors()}
    rows = [row("NoPE", load_prior(shipped["uniform"]), args),
            row("GGD (3 learnable)", load_prior(shipped["generalized_gaussian"]), args)]
    with tempfile.TemporaryDirectory() as folder:
        for size in args.sizes:
            module = t5_like(size, Path(folder))
            rows.append(row(f"T5, {size} entries: per-distance sums", module, args))
            rows.append(row(f"T5, {size} entries: per-scalar accumulators", module, args, per_scalar=True))
    nope = rows[0]["dkdv"] + rows[0]["dq"]
    print(f"\n{args.arch}, bf16, head dim {args.head_dim}, causal: modelled cycles per 1000 scores\n")
    print("| prior | dK/dV | dQ | dQ tile | dQ launches | backward | vs NoPE | spills |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        total = r["dkdv"] + r["dq"]
        tile = "x".join(map(str, r["tile"][:2])) + f"/{r['tile'][2]}"
        print(f"| {r['label']} | {r['dkdv']:.0f} | {r['dq']:.0f} | {tile} | {r['launches']} | "
              f"{total:.0f} | {total / nope:.2f}x | {r['spills']} |", flush=True)


if __name__ == "__main__":
    main()
