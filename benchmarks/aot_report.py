"""GPU readiness without a GPU: compile every shipped prior's kernels for sm_80 and sm_90 and
print a markdown table of registers, spills, the main loop's instruction mix and the modelled
cost, with ratios against the NoPE (uniform) kernel of the same target, then the whole backward
(dK/dV + dQ) of each prior against NoPE's. Tiles differ between kinds of prior
(bamgen/runtime/triton/tiles.py), so costs compare per 1000 scores: the model's cycles per K/V tile of the
main loop divided by the tile's scores.

    python benchmarks/aot_report.py [--head-dim 128] [--dtype bf16] [--arch sm_90 ...]
"""
import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bamgen.aot import compile_module, loop_model  # noqa: E402
from bamgen.driver.loader import load_prior  # noqa: E402
from bamgen.resources import shipped_priors  # noqa: E402
from bamgen.runtime.triton.launch import grad_groups  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--arch", nargs="+", default=["sm_90", "sm_80"])
    parser.add_argument("--priors", nargs="+", default=None, help="prior names (default: all shipped)")
    args = parser.parse_args(argv)
    paths = [p for p in shipped_priors() if args.priors is None or p.stem in args.priors]
    paths.sort(key=lambda p: (p.stem != "uniform", p.stem))       # NoPE first: the baseline
    for arch in args.arch:
        print(f"\n### {arch}, {args.dtype}, head dim {args.head_dim}, causal\n")
        print("| prior | strategy | kernel | tile | regs | stack | main loop: all | MMA | MUFU | FP32 "
              "| LDG | LDS | cycles/1k scores: tensor | mufu | fp32 | issue | lsu | model | bound "
              "| vs NoPE |")
        print("|" + "---|" * 20)
        baseline = {}
        backward = {}   # prior -> {kernel: modelled cycles per 1000 scores} of dK/dV and dQ
        for path in paths:
            module = load_prior(path)
            for k in compile_module(module, arch=arch, dtype=args.dtype, head_dim=args.head_dim):
                if k.name in ("bwd_preprocess", "decode_combine"):   # row reductions: no key tiles
                    continue
                model = loop_model(k.main_loop, arch, k.num_warps)
                per_k = {unit: c * 1000 / (k.block[0] * k.block[1]) for unit, c in model["cycles"].items()}
                cost = max(per_k.values())
                baseline.setdefault(k.name, cost)
                loop = k.main_loop
                units = " | ".join(f"{per_k[u]:.0f}" for u in ("tensor", "mufu", "fp32", "issue", "lsu"))
                print(f"| {path.stem} | {module.PRIOR['strategy']} | {k.name} | "
                      f"{k.block[0]}x{k.block[1]}/{k.num_warps} | {k.registers} | {k.stack_bytes} | "
                      f"{loop['total']} | {loop['mma']} | {loop['mufu']} | {loop['fp32']} | "
                      f"{loop['ld_global']} | {loop['ld_shared']} | {units} | {cost:.0f} | "
                      f"{model['bound']} | {cost / baseline[k.name]:.2f}x |", flush=True)
                if k.name in ("attn_bwd_dkdv", "attn_bwd_dq"):
                    # (a prior with many learnable scalars launches dQ once per group of them)
                    launches = dq_launches(module) if k.name == "attn_bwd_dq" else 1
                    backward.setdefault(path.stem, {})[k.name] = cost * launches
        print_backward(backward)


def dq_launches(module, size: int | None = None) -> int:
    """How many times the backward launches the dQ kernel: once, or once per group of learnable
    scalars (bamgen/runtime/triton/launch.py, grad_groups; of ``size``, a pinned dq_group);
    each launch costs about what the first does (the first also writes dQ)."""
    traits = module.TRAITS
    return 1 if traits.dist_sums else len(grad_groups(traits.num_grads, traits.tile_kind, size))


def print_backward(backward: dict) -> None:
    """The whole backward (dK/dV + dQ, parameter gradients included: every dQ launch) per prior
    against NoPE's, in modelled cycles per 1000 scores: the table behind the backward's bar."""
    if "uniform" not in backward:
        return
    nope = sum(backward["uniform"].values())
    print("\n| prior | dK/dV | dQ | backward | vs NoPE |\n|---|---|---|---|---|")
    for name, kernels in backward.items():
        total = sum(kernels.values())
        print(f"| {name} | {kernels['attn_bwd_dkdv']:.0f} | {kernels['attn_bwd_dq']:.0f} | "
              f"{total:.0f} | {total / nope:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
