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


def compile_module(module: ModuleType, *, arch: str = "sm_90", dtype: str = "bf16",
                   head_dim: int = 64, causal: bool = True) -> list[CompiledKernel]:
    """Compile every Triton kernel of a generated module for ``arch``; raises on a compile error."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    target = GPUTarget("cuda", ARCHS[arch], 32)
    compiled = []
    for name, fn, signature, constexprs, warps, stages in module.triton_kernel_specs(dtype, head_dim, causal):
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                target=target, options={"num_warps": warps, "num_stages": stages})
        cubin = kernel.asm["cubin"]
        usage = resource_usage(cubin)
        compiled.append(CompiledKernel(name=name, arch=arch, registers=usage.get("REG", 0),
                                       stack_bytes=usage.get("STACK", 0),
                                       local_bytes=usage.get("LOCAL", 0),
                                       shared_bytes=kernel.metadata.shared, cubin=cubin))
    return compiled
