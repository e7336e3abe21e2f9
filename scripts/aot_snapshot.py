"""Every shipped prior's kernels compiled for sm_80 and sm_90: resources, modelled cost and a
hash of the SASS, for checking that a refactor leaves the GPU code as it was.

    python scripts/aot_snapshot.py generated/ /tmp/before.json [--jobs 2]
    python scripts/aot_snapshot.py --compare /tmp/before.json /tmp/after.json

For each module in the folder, each target (sm_80, sm_90), head dim (64, 128) and layout
(causal and plain; at head dim 128 also non-causal, padded and packed) it records, per kernel,
registers, stack, spills, shared memory, the main loop's instruction mix, the throughput model's
cycles per tile and a sha256 of the SASS instructions (addresses left out). --compare lists every
difference (docs/architecture.md, "How a refactor is checked").
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

CASES = [(arch, dim, causal, layout)
         for arch in ("sm_80", "sm_90") for dim in (64, 128)
         for causal, layout in ((True, "plain"), (False, "plain"), (True, "padded"), (True, "packed"))
         if dim == 128 or (causal, layout) == (True, "plain")]


def _load(path: str):
    spec = importlib.util.spec_from_file_location(f"aot_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _one(path: str) -> dict:
    from bamgen.aot import compile_module, disassemble, loop_model
    module = _load(path)
    out = {}
    for arch, dim, causal, layout in CASES:
        kernels = compile_module(module, arch=arch, head_dim=dim, causal=causal, layout=layout)
        record = {}
        for k in kernels:
            sass = "\n".join(f"{op} {rest.strip()}" for _, op, rest in disassemble(k.cubin))
            model = loop_model(k.main_loop, arch, k.num_warps) if k.main_loop.get("total") else {}
            record[k.name] = {
                "registers": k.registers, "stack": k.stack_bytes, "local": k.local_bytes,
                "shared": k.shared_bytes, "sass_total": k.sass["total"],
                "main_loop": {key: v for key, v in k.main_loop.items() if key != "mma_shapes"},
                "cycles_per_tile": model.get("cycles_per_tile"),
                "sass_sha256": hashlib.sha256(sass.encode()).hexdigest()[:16]}
        out[f"{arch}/{dim}/{'causal' if causal else 'full'}/{layout}"] = record
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs=2)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", action="append")
    args = parser.parse_args()
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.paths)
        bad = 0
        for prior in sorted(set(a) | set(b)):
            for case in sorted(set(a.get(prior, {})) | set(b.get(prior, {}))):
                ka, kb = a.get(prior, {}).get(case, {}), b.get(prior, {}).get(case, {})
                for kernel in sorted(set(ka) | set(kb)):
                    if ka.get(kernel) != kb.get(kernel):
                        bad += 1
                        x, y = ka.get(kernel, {}), kb.get(kernel, {})
                        diff = {f: (x.get(f), y.get(f)) for f in set(x) | set(y) if x.get(f) != y.get(f)}
                        print(f"{prior} {case} {kernel}: {diff}")
        print("identical" if not bad else f"{bad} kernels differ")
        sys.exit(1 if bad else 0)
    paths = [str(p) for p in sorted(Path(args.paths[0]).glob("*.py"))
             if not p.stem.startswith("_") and (not args.only or p.stem in args.only)]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = dict(zip((Path(p).stem for p in paths), pool.map(_one, paths)))
    Path(args.paths[1]).write_text(json.dumps(results, indent=1, sort_keys=True))
    print(f"{len(results)} modules, {len(CASES)} cases each")


if __name__ == "__main__":
    main()
