"""Ahead-of-time compilation of a generated module's Triton kernels for a GPU target.

No GPU is needed: Triton compiles to PTX and a cubin for a ``GPUTarget``, and the ``cuobjdump``
bundled with Triton reads the cubin's resource usage (registers, stack, shared memory). This is
how bamgen proves, on a CPU-only machine, that its kernels build and fit on an A100 or H100.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from types import ModuleType

ARCHS = {"sm_80": 80, "sm_90": 90}


# Per-SM, per-clock throughputs used by the cost model (dense, no sparsity):
#   tensor: bf16/fp16 flops; H100 SXM 989 TFLOP/s over 132 SMs at 1.83 GHz = 4096, A100 312
#   TFLOP/s over 108 SMs at 1.41 GHz = 2048. fp32: FMA-pipe lanes (2 flops each) — 128 on
#   sm_90, 64 on sm_80. mufu: special-function lanes (ex2, lg2, rcp, ...) — 16 on both.
#   issue: warp-instructions per clock (4 schedulers, one each). lsu: 128-byte shared-memory / L1
#   wavefronts per clock (one; a warp's 32-bit access is one wavefront, a 128-bit one four).
THROUGHPUT = {
    "sm_80": {"tensor": 2048, "fp32": 64, "mufu": 16, "issue": 4, "lsu": 1},
    "sm_90": {"tensor": 4096, "fp32": 128, "mufu": 16, "issue": 4, "lsu": 1},
}
CATEGORIES = {
    "mma": ("HMMA", "HGMMA", "IMMA"),
    "mufu": ("MUFU",),
    "fp32": ("FFMA", "FMUL", "FADD"),
    "ld_global": ("LDG", "LDGSTS", "UTMALDG"),
    "ld_shared": ("LDS", "LDSM"),
    "st_global": ("STG",),
    "st_shared": ("STS",),
    # register spills' traffic (reported, not modelled: the shipped kernels keep no stack, and
    # where one does the AOT tests bound these counts in its loop)
    "ld_local": ("LDL",),
    "st_local": ("STL",),
}
MEMORY = ("ld_global", "ld_shared", "st_shared")


@dataclass(frozen=True)
class CompiledKernel:
    """One kernel compiled for one target, with what the cubin says about its resources."""
    name: str
    arch: str
    registers: int
    stack_bytes: int
    local_bytes: int
    shared_bytes: int
    cubin: bytes
    num_warps: int = 4
    sass: dict | None = None        # instruction mix of the whole kernel
    main_loop: dict | None = None   # instruction mix of the innermost loop holding the MMAs
    block: tuple[int, ...] = ()     # the tile: (BLOCK_M, BLOCK_N), or (BLOCK_M,) for the preprocess
    loops: tuple[dict, ...] = ()    # instruction mix of every MMA loop (mma_loops), in program order
    num_stages: int = 2             # the software pipeline's stages it was compiled with

    @property
    def spills(self) -> bool:
        return self.stack_bytes > 0 or self.local_bytes > 0


def _cuobjdump() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of the (single) function in a cubin, via cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        text = subprocess.run([_cuobjdump(), "-res-usage", fh.name], capture_output=True,
                              text=True, check=True).stdout
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k: int(v) for k, v in fields.items()}


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)(.*?);")
_ADDRESS = re.compile(r"0x([0-9a-f]+)")


def _branch_target(op: str, operands: str) -> int | None:
    """The address a BRA jumps to (its guard, if any, dropped by the disassembly), else None."""
    found = _ADDRESS.search(operands) if op.startswith("BRA") else None
    return int(found.group(1), 16) if found else None


def disassemble(cubin: bytes) -> list[tuple[int, str, str]]:
    """(address, opcode with modifiers, operands) of every SASS instruction, via cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        text = subprocess.run([_cuobjdump(), "-sass", fh.name], capture_output=True, text=True,
                              check=True).stdout
    return [(int(a, 16), op, rest) for a, op, rest in _INSTRUCTION.findall(text)]


def instruction_mix(instructions) -> dict:
    """Counts per category (CATEGORIES) plus the total, and the MMA shapes seen."""
    mix = {"total": len(instructions), **{k: 0 for k in CATEGORIES}, "wavefronts": 0,
           "mma_shapes": {}}
    for _, op, _ in instructions:
        base = op.split(".")[0]
        for category, names in CATEGORIES.items():
            if base in names:
                mix[category] += 1
                if category in MEMORY:
                    mix["wavefronts"] += _wavefronts(op)
        if base in CATEGORIES["mma"]:
            mix["mma_shapes"][op] = mix["mma_shapes"].get(op, 0) + 1
    return mix


def _wavefronts(op: str) -> int:
    """128-byte L1/shared wavefronts of one warp memory instruction, from its width suffix."""
    if ".128" in op or ".M88.4" in op:
        return 4
    if ".64" in op or ".M88.2" in op:
        return 2
    return 1


def mma_loops(instructions) -> list[list]:
    """Every loop (a backward branch's span) that contains tensor-core instructions and no
    such loop inside it, in program order. A fused kernel has several: Triton's tutorial
    backward walks a masked and an unmasked loop for dK/dV, then the same two for dQ. A branch
    from past a loop's end back into its middle (a stub the compiler placed after the loop)
    spans no loop of its own and is left out."""
    loops = []
    for addr, op, rest in instructions:
        lo = _branch_target(op, rest)
        if lo is None or lo >= addr:
            continue
        body = [ins for ins in instructions if lo <= ins[0] <= addr]
        if any(ins[1].split(".")[0] in CATEGORIES["mma"] for ins in body):
            loops.append(body)
    spans = [(body[0][0], body[-1][0]) for body in loops]
    return [body for body, (lo, hi) in zip(loops, spans)
            if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in spans)
            and not any(a < lo <= b < hi for a, b in spans)]


def main_loop(instructions) -> list:
    """The shortest pass (shortest_pass) through the innermost loop that contains tensor-core
    instructions (the shortest, where a kernel has several: a bamgen kernel's unmasked loop)."""
    return min((shortest_pass(loop) for loop in mma_loops(instructions)), key=len, default=[])


def shortest_pass(body: list) -> list:
    """The instructions of the shortest way through one pass of a loop body (mma_loops'): a
    branch forward to an instruction of the body skips a block that only some passes run, and
    the model takes the passes that skip it, the steady state, as it takes a kernel's unmasked
    loop for its masked ones. (The dK/dV kernel's SPLIT_STEADY applies its mask under such a
    branch, on the diagonal's and the ragged end's query tiles alone.) The disassembly drops
    branch guards, so each such branch counts as conditional: a path through an unconditional
    one's fall-through holds both blocks of an if/else, never the shorter. A branch out of the
    body (a stub placed after the loop: a TMA barrier's retry) falls through, as before."""
    at = {ins[0]: i for i, ins in enumerate(body)}
    steps = [0] + [len(body) + 1] * len(body)   # fewest instructions before each one (and the end)
    came_from = [-1] * (len(body) + 1)
    for i, (addr, op, rest) in enumerate(body):
        target = _branch_target(op, rest) if i + 1 < len(body) else None   # (last: the way back)
        skip = [at[target]] if target is not None and target > addr and target in at else []
        for j in [i + 1, *skip]:
            if steps[i] + 1 < steps[j]:
                steps[j], came_from[j] = steps[i] + 1, i
    path, i = [], len(body)
    while came_from[i] >= 0:
        i = came_from[i]
        path.append(body[i])
    return path[::-1]


def _mma_flops(op: str) -> int:
    """Flops of one MMA instruction: HMMA.16816 -> 2*16*8*16; HGMMA.64x128x16 -> 2*64*128*16."""
    shape = re.search(r"(\d+)x(\d+)x(\d+)", op)
    if shape:
        m, n, k = (int(x) for x in shape.groups())
        return 2 * m * n * k
    digits = re.search(r"MMA\.(\d{2})(\d)(\d{2})", op)
    if digits:
        m, n, k = (int(x) for x in digits.groups())
        return 2 * m * n * k
    return 0


def loop_model(mix: dict, arch: str, num_warps: int) -> dict:
    """Cycles one SM spends on one pass of the main loop (one K/V tile), per unit, and the bound.

    Tensor work: each HMMA is issued by every warp; an HGMMA is issued by the 4 warps of a
    warpgroup together, so it counts once per warpgroup. MUFU and FP32 instructions run on all
    32 lanes of every warp. Every instruction of every warp takes an issue slot; every shared /
    L1 access takes LSU wavefronts. The estimate is the slowest unit (the units overlap
    perfectly), which is optimistic about latency and ignores DRAM/L2 stalls.

    What it cannot see (docs/performance.md, "Why the copy is slow at head dim 64"): where an
    access's addresses go (a warp's 4-byte access counts one wavefront whether its 32 threads
    read one 128-byte line or 32 sectors; the table copy at head dim 64 is the latter), how
    deep the software pipeline is (two stages wait for every copy at each tile's top, so only
    another CTA hides a load's latency), and how many CTAs share an SM. benchmarks/model_check.py
    fits weights to its units against a GPU's kernel times; `make gpu-check` times the variants
    it cannot rank.
    """
    rates = THROUGHPUT[arch]
    flops = 0
    for op, count in mix["mma_shapes"].items():
        per_issue = num_warps / 4 if op.startswith("HGMMA") else num_warps
        flops += count * _mma_flops(op) * per_issue
    cycles = {
        "tensor": flops / rates["tensor"],
        "mufu": mix["mufu"] * 32 * num_warps / rates["mufu"],
        "fp32": mix["fp32"] * 32 * num_warps / rates["fp32"],
        "issue": mix["total"] * num_warps / rates["issue"],
        "lsu": mix.get("wavefronts", 0) * num_warps / rates["lsu"],
    }
    bound = max(cycles, key=cycles.get)
    return {"cycles_per_tile": round(cycles[bound], 1), "bound": bound,
            "cycles": {k: round(v, 1) for k, v in cycles.items()}, "mma_flops_per_tile": flops}


# Integer arguments that Triton's launcher sees as multiples of 16 in a typical training call
# (B, H, N, D powers of two >= 16, zero offsets). At run time Triton specialises every pointer
# that is 16-byte aligned and every such integer (``tt.divisibility = 16``), which is what lets it
# emit vector loads; an AOT compile without these hints would judge a kernel that never runs.
ALIGNED_INTS = ("Hq", "Hk", "Nq", "Nk", "q_offset", "k_offset")


def _alignment_hints(fn, signature: dict) -> dict:
    """``attrs`` for ASTSource: the divisibility hints of a typical call (see ALIGNED_INTS)."""
    hints = {}
    for index, name in enumerate(fn.arg_names):
        kind = signature.get(name)
        if kind is None or kind == "constexpr":
            continue
        if kind.startswith("*") or name.startswith("stride_") or name in ALIGNED_INTS:
            hints[(index,)] = [["tt.divisibility", 16]]
    return hints


def _fp_fusion(kernel: str) -> bool:
    """The kernel's FMA-contraction setting as the runtime launches it: the attention kernels
    run with FP_FUSION (off: the backward must recompute the forward's logits bit for bit), and
    so do the distance table's (the host's torch build, which they match, fuses nothing), the
    other kernels with Triton's default (on)."""
    from .runtime.triton.launch import FP_FUSION
    if kernel in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq", "attn_decode", "table_shift",
                  "distance_table"):
        return FP_FUSION
    return True


def compile_module(module: ModuleType, *, arch: str = "sm_90", dtype: str = "bf16",
                   head_dim: int = 64, causal: bool = True, candidate: int = 0,
                   only: tuple[str, ...] | None = None, layout: str = "plain") -> list[CompiledKernel]:
    """Compile every Triton kernel of a generated module (or the ones named in ``only``) for
    ``arch`` with its ``candidate``-th tile config (the default: 0) and the ``layout``
    specialisation ("plain", "padded" or "packed": triton_kernel_specs); raises on a compile
    error."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    kwargs = {} if layout == "plain" else {"layout": layout}   # (modules built before layouts)
    specs = module.triton_kernel_specs(dtype, head_dim, causal, arch=arch, candidate=candidate, **kwargs)
    return [compile_spec(spec, arch) for spec in specs if only is None or spec[0] in only]


def compile_spec(spec: tuple, arch: str) -> CompiledKernel:
    """Compile one kernel spec (name, jit function, signature, constexprs, num_warps,
    num_stages: the tuples of triton_kernel_specs) for ``arch``; a benchmark may edit the
    constexprs first (benchmarks/table_grads.py compiles the dQ kernel's launch groups)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    name, fn, signature, constexprs, warps, stages = spec
    return compile_kernel(name, fn, signature, constexprs, _alignment_hints(fn, signature),
                          warps, stages, arch, fp_fusion=_fp_fusion(name))


def compile_kernel(name: str, fn, signature: dict, constexprs: dict, attrs: dict, warps: int,
                   stages: int, arch: str, *, fp_fusion: bool = True) -> CompiledKernel:
    """Compile one Triton jit function for ``arch`` as a launch would: ``signature`` maps each
    argument to its Triton type ("*fp16", "i32", "constexpr", ...), ``attrs`` holds the
    specialisation hints of the launch's values ({(index,): [["tt.divisibility", 16]]})."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", ARCHS[arch], 32),
                            options={"num_warps": warps, "num_stages": stages,
                                     "enable_fp_fusion": fp_fusion})
    cubin = kernel.asm["cubin"]
    usage = resource_usage(cubin)
    instructions = disassemble(cubin)
    return CompiledKernel(name=name, arch=arch, registers=usage.get("REG", 0),
                          stack_bytes=usage.get("STACK", 0), local_bytes=usage.get("LOCAL", 0),
                          shared_bytes=kernel.metadata.shared, cubin=cubin, num_warps=warps,
                          sass=instruction_mix(instructions),
                          block=tuple(constexprs[b] for b in ("BLOCK_M", "BLOCK_N", "BLOCK")
                                      if b in constexprs),
                          main_loop=instruction_mix(main_loop(instructions)),
                          loops=tuple(instruction_mix(loop) for loop in mma_loops(instructions)),
                          num_stages=stages)


# ----------------------------------------------------------------------------------------
# The decode step's modelled time: the split-KV decode kernels against the prefill kernel
# given one query row, on a whole GPU.
# ----------------------------------------------------------------------------------------
# SMs, SM clock (GHz) and DRAM bandwidth (GB/s) of the modelled GPUs: H100 SXM (132 SMs at
# 1.83 GHz, HBM3 at 3.35 TB/s) and A100 SXM 80GB (108 SMs at 1.41 GHz, HBM2e at 2.04 TB/s).
GPU = {"sm_90": {"sms": 132, "ghz": 1.83, "dram_gbs": 3350},
       "sm_80": {"sms": 108, "ghz": 1.41, "dram_gbs": 2039}}
LAUNCH_US = 2.0   # the fixed cost of one kernel launch outside a CUDA graph (an assumption)
# (batch, query heads, kv heads, keys) of the decode steps the report and the tests model:
# one sequence of a Llama-3-8B-like model (32 query heads over 8 kv heads) at three cache
# lengths, and batches of 8 and 64 sequences
DECODE_SHAPES = ((1, 32, 8, 1024), (1, 32, 8, 4096), (1, 32, 8, 32768), (8, 32, 8, 4096),
                 (64, 32, 8, 4096))


@dataclass(frozen=True)
class DecodeStep:
    """One modelled decode step (one query row per sequence): microseconds of the prefill
    kernel and of the split-KV pair (decode + combine), each with its launches."""
    shape: tuple[int, int, int, int]   # (batch, query heads, kv heads, keys)
    splits: int
    prefill_us: float
    decode_us: float

    @property
    def ratio(self) -> float:
        return self.decode_us / self.prefill_us


def _kernel_us(arch: str, programs: int, tiles: int, cycles_per_tile: float, dram_bytes: float) -> float:
    """A kernel's time: the slower of its SMs (waves of one program per SM, each walking `tiles`
    main-loop passes at the loop model's cycles) and DRAM streaming `dram_bytes`. Optimistic for
    both kernels alike: no per-SM bandwidth limit, no tail effects within a wave."""
    gpu = GPU[arch]
    waves = -(-programs // gpu["sms"])
    compute = waves * tiles * cycles_per_tile / (gpu["ghz"] * 1e3)
    return max(compute, dram_bytes / (gpu["dram_gbs"] * 1e3))


def decode_step_model(module: ModuleType, kernels: dict[str, dict], arch: str, head_dim: int,
                      dtype_bytes: int = 2, shapes=DECODE_SHAPES) -> list[DecodeStep]:
    """The decode step at each shape, from the compiled kernels' loop models (``kernels``: name ->
    {"block": (BLOCK_M, BLOCK_N), "cycles_per_tile": ...}, as `bamgen inspect` reports them) and
    the runtime's split rule (``decode_splits``). The prefill kernel gives one row a whole
    query tile and one program per (batch, head) that walks every key; the decode kernel splits
    the keys over programs, then the combine kernel merges the splits' partials (float32,
    written and read once: its DRAM traffic; its arithmetic is negligible)."""
    from .runtime.triton.launch import decode_splits
    fwd, dec = kernels["attn_fwd"], kernels["attn_decode"]
    steps = []
    for shape in shapes:
        batch, hq, hk, keys = shape
        kv_bytes = batch * hk * keys * head_dim * 2 * dtype_bytes   # K and V, read once from DRAM
        prefill = _kernel_us(arch, batch * hq, -(-keys // fwd["block"][1]), fwd["cycles_per_tile"],
                             kv_bytes) + LAUNCH_US
        per_split, splits = decode_splits(keys, batch * hq, dec["block"][1], GPU[arch]["sms"])
        partial_bytes = splits * batch * hq * (head_dim + 2) * 4
        decode = (_kernel_us(arch, batch * hq * splits, -(-per_split // dec["block"][1]),
                             dec["cycles_per_tile"], kv_bytes + partial_bytes)
                  + _kernel_us(arch, batch * hq, 0, 0.0, partial_bytes) + 2 * LAUNCH_US)
        steps.append(DecodeStep(shape, splits, round(prefill, 2), round(decode, 2)))
    return steps
