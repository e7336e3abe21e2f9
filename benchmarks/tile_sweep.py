"""Sweep tile configurations of the generated kernels by compiling them ahead of time (no GPU).

    python benchmarks/tile_sweep.py --kernel fwd --arch sm_90 --head-dim 128 \\
        --configs 128,64,8,2 64,64,4,2 --priors uniform laplace generalized_gaussian

For each shipped prior and (BLOCK_M, BLOCK_N, num_warps, num_stages) it compiles one kernel for
the target and prints registers, stack (spills), shared memory and the main-loop model of
bamgen.aot, per 1000 scores, so tiles of different sizes compare. This is how the candidate
lists in bamgen/runtime/triton/tiles.py (per kind of prior) were chosen: the largest tiles with
no stack on every shipped prior, then the lowest modelled cost.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)          # compile for the GPU, not the interpreter
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KERNEL_NAMES = {"fwd": "attn_fwd", "bwd_dkdv": "attn_bwd_dkdv", "bwd_dq": "attn_bwd_dq",
                "decode": "attn_decode"}


def compile_one(module, kernel: str, arch: str, head_dim: int, config: tuple,
                layout: str = "plain") -> dict:
    """Compile `kernel` of `module` (its `layout`'s kernels: bamgen inspect --layout) with
    `config` for `arch`; its resources and model."""
    from bamgen import aot
    from bamgen.runtime.triton.tiles import FWD_TMA_AT, TILES
    positional = layout in ("positions", "positions_packed")
    traits = module.POSITIONAL_TRAITS if positional else module.TRAITS
    if layout.startswith("positions_table"):   # a table prior at integer positions
        traits = module._prior.position_table.traits
    table = TILES[traits.tile_kind][arch]
    bucket = min(b for b in table if b >= head_dim)
    saved = table[bucket][kernel]
    table[bucket][kernel] = [config]
    # a forward that reads K and V through TMA takes FWD_TMA_AT's tile first: the swept one there
    tma_key = (traits.tile_kind, arch, bucket)
    tma_saved = FWD_TMA_AT.get(tma_key) if kernel == "fwd" else None
    if tma_saved is not None:
        FWD_TMA_AT[tma_key] = config
    try:
        (k,) = aot.compile_module(module, arch=arch, head_dim=head_dim, layout=layout,
                                  only=(KERNEL_NAMES[kernel],))
    finally:
        table[bucket][kernel] = saved
        if tma_saved is not None:
            FWD_TMA_AT[tma_key] = tma_saved
    model = aot.loop_model(k.main_loop, arch, k.num_warps)
    # the decode kernel's useful work is one row per key (a generation step): per 1000 keys
    scores = config[1] if kernel == "decode" else config[0] * config[1]
    return {"registers": k.registers, "stack": k.stack_bytes, "spill": k.local_bytes,
            "shared": k.shared_bytes,
            "per_1k": {unit: round(c * 1000 / scores) for unit, c in model["cycles"].items()}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=sorted(KERNEL_NAMES), default="fwd")
    parser.add_argument("--arch", choices=["sm_80", "sm_90"], default="sm_90")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--configs", nargs="+", required=True, help="BLOCK_M,BLOCK_N,warps,stages")
    parser.add_argument("--priors", nargs="+", default=None, help="default: every shipped prior")
    parser.add_argument("--layout", default="plain",
                        choices=["plain", "padded", "packed", "positions", "positions_packed",
                                 "positions_table", "positions_table_packed"],
                        help="which kernels (bamgen inspect --layout): positions = pos_q/pos_k's")
    args = parser.parse_args(argv)
    from bamgen.driver.loader import load_prior
    from bamgen.resources import shipped_priors
    paths = {p.stem: p for p in shipped_priors()}
    names = args.priors or sorted(paths)
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs]
    print(f"| prior | config | regs | stack | shared | tensor | mufu | fp32 | issue | lsu |  "
          f"({args.arch}, {args.kernel}, {args.layout}, head dim {args.head_dim}; cycles per 1000 "
          f"{'keys' if args.kernel == 'decode' else 'scores'})")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        module = load_prior(paths[name])
        for config in configs:
            try:
                r = compile_one(module, args.kernel, args.arch, args.head_dim, config, args.layout)
            except Exception as exc:     # a config the compiler rejects (shared memory, ...)
                print(f"| {name} | {config} | failed: {str(exc).splitlines()[0][:80]} |")
                continue
            c = r["per_1k"]
            print(f"| {name} | {','.join(map(str, config))} | {r['registers']} | {r['stack']} | "
                  f"{r['shared']} | {c['tensor']} | {c['mufu']} | {c['fp32']} | {c['issue']} | "
                  f"{c['lsu']} |", flush=True)


if __name__ == "__main__":
    main()
