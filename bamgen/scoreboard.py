"""One warp's time through a SASS loop, from the scheduling the compiler wrote into it.

The throughput model (`bamgen.aot.loop_model`) counts what a loop asks of each unit, as if its
warps always had an instruction ready. What it cannot see is a warp waiting: on a load, on the
tensor cores, on a copy several tiles ahead. ptxas writes that schedule into every instruction's
control bits (Volta and later: the top 21 bits of the 128-bit word):

    stall (4 bits)         cycles before the warp may issue its next instruction
    yield (1)              (a scheduler hint, unused here)
    write barrier (3)      the scoreboard a variable-latency result releases (7: none)
    read barrier (3)       the scoreboard released once its source registers are read
    wait mask (6)          the scoreboards to wait on before issuing
    reuse (4)              (operand cache hints, unused here)

`warp_cycles` walks a loop as one warp would, passes after pass, with a fixed latency per kind
of variable-latency instruction (LATENCY) and the copy groups of `cp.async` (LDGSTS committed
by LDGDEPBAR, waited for by DEPBAR.LE with a count: the software pipeline's depth) and of
warpgroup MMA (HGMMA, waited for by WARPGROUP.DEPBAR). Its steady pass is the warp's critical
path; a loop whose path is longer than its busiest unit is latency-bound unless other CTAs on
the SM (`resident_ctas`) fill the gaps. benchmarks/model_terms.py tests these terms against
the GPU's measurements (docs/performance.md, "Latency and occupancy, tested").
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass

_INSTRUCTION = re.compile(
    r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)(.*?);\s*"
    r"/\*\s*0x([0-9a-f]{16})\s*\*/\s*/\*\s*0x([0-9a-f]{16})\s*\*/")

# Latencies (cycles) of the variable-latency instructions on Hopper, from published
# microbenchmarks: shared memory ~30, L2 hits ~250 (a global load: the tables and the
# per-row statistics are L2-resident in steady state), a cp.async group of K/V tiles ~500
# (L2 or DRAM). Anything else that sets a scoreboard: LATENCY_OTHER.
LATENCY = {"LDS": 30, "LDSM": 30, "LDG": 250, "LDGSTS": 500, "LDL": 250, "MUFU": 20, "LDC": 30,
           "S2R": 20, "S2UR": 20, "SHFL": 25, "I2F": 15, "F2I": 15, "F2F": 15, "HMMA": 32,
           "ATOMS": 50, "RED": 250, "ATOMG": 300}
LATENCY_OTHER = 20
READ_LATENCY = 15        # until a store's (or load's) source registers have been read
TENSOR_RATE = {"sm_80": 2048, "sm_90": 4096}   # MMA flops per SM-clock (as bamgen.aot's)
REGISTERS_PER_SM = 65536
SHARED_PER_SM = {"sm_80": 167936, "sm_90": 233472}   # bytes, with 1 KB reserved per CTA
WARPS_PER_SM = {"sm_80": 64, "sm_90": 64}


@dataclass(frozen=True)
class Scheduled:
    """One SASS instruction and its control bits."""
    address: int
    op: str
    operands: str
    stall: int
    write_barrier: int | None
    read_barrier: int | None
    waits: tuple[int, ...]   # the scoreboards it waits on


def control(high_word: int) -> tuple[int, int | None, int | None, tuple[int, ...]]:
    """(stall, write barrier, read barrier, waited scoreboards) of an instruction's second
    64-bit word (cuobjdump prints it on the line below the instruction)."""
    bits = high_word >> 41
    write, read, mask = (bits >> 5) & 7, (bits >> 8) & 7, (bits >> 11) & 63
    return (bits & 15, None if write == 7 else write, None if read == 7 else read,
            tuple(b for b in range(6) if mask >> b & 1))


def parse(sass: str) -> list[Scheduled]:
    """The instructions of cuobjdump -sass output, with their control bits."""
    return [Scheduled(int(address, 16), op, operands, *control(int(high, 16)))
            for address, op, operands, _, high in _INSTRUCTION.findall(sass)]


def scheduled(cubin: bytes) -> list[Scheduled]:
    """Every instruction of a cubin (one function) with its control bits."""
    from .aot import _cuobjdump
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        text = subprocess.run([_cuobjdump(), "-sass", fh.name], capture_output=True, text=True,
                              check=True).stdout
    return parse(text)


def main_loop(instructions: list[Scheduled]) -> list[Scheduled]:
    """The loop bamgen.aot's model takes as the main one (its innermost MMA loop)."""
    from .aot import main_loop as loop_of
    addresses = {a for a, _, _ in loop_of([(i.address, i.op, i.operands) for i in instructions])}
    return [i for i in instructions if i.address in addresses]


def _mma_flops(op: str) -> int:
    shape = re.search(r"(\d+)x(\d+)x(\d+)", op)
    return 2 * int(shape[1]) * int(shape[2]) * int(shape[3]) if shape else 0


def warp_cycles(loop: list[Scheduled], num_warps: int, arch: str = "sm_90",
                latency: dict | None = None, warm_up: int = 6, passes: int = 12) -> float:
    """Cycles one warp takes for one pass of ``loop`` in steady state: the mean of ``passes``
    passes after ``warm_up`` (a pipeline of k groups repeats every k passes; 12 is a whole
    number of periods for one to four).

    A warp issues in order: an instruction waits for the scoreboards in its mask (each released
    when every result set on it has arrived), then the next one follows after its stall count.
    A cp.async group completes when its last copy does and DEPBAR.LE SBk, n waits until at most
    n groups are in flight; warpgroup MMAs run one after another on the tensor cores, shared by
    the CTA's warpgroups, and WARPGROUP.DEPBAR waits for the last. Branches inside the loop are
    taken as falling through (the steady loop of a bamgen kernel has none that skip work)."""
    latency = {**LATENCY, **(latency or {})}
    share = TENSOR_RATE[arch] / max(1, num_warps // 4)   # one warpgroup's MMA flops per clock
    pending: dict[int, list[float]] = {b: [] for b in range(6)}
    groups: list[float] = []       # committed cp.async groups' completion times, oldest first
    copies: list[float] = []       # the copies of the group not yet committed
    mma_done = 0.0
    t = start = 0.0
    for done in range(warm_up + passes):
        if done == warm_up:
            start = t
        for ins in loop:
            base = ins.op.split(".")[0]
            t = max([t] + [max(pending[b]) for b in ins.waits if pending[b]])
            for b in ins.waits:
                pending[b] = []
            if base == "DEPBAR":
                depth = re.search(r"SB\d,\s*0x([0-9a-f]+)", ins.operands)
                keep = int(depth[1], 16) if depth else 0
                if len(groups) > keep:
                    t = max(t, max(groups[:len(groups) - keep]))
                    groups = groups[len(groups) - keep:]
            elif ins.op.startswith("WARPGROUP.DEPBAR"):
                t = max(t, mma_done)
            elif base == "LDGSTS":
                copies.append(t + latency["LDGSTS"])
            elif base == "LDGDEPBAR":
                groups.append(max(copies, default=t))
                copies = []
            elif base == "HGMMA":
                mma_done = max(mma_done, t) + _mma_flops(ins.op) / share
            if ins.write_barrier is not None:
                done = mma_done if base == "HGMMA" else t + latency.get(base, LATENCY_OTHER)
                pending[ins.write_barrier].append(done)
            if ins.read_barrier is not None:
                pending[ins.read_barrier].append(t + READ_LATENCY)
            t += max(ins.stall, 1)
    return (t - start) / passes


def resident_ctas(registers: int, shared_bytes: int, num_warps: int, arch: str = "sm_90") -> int:
    """CTAs of a kernel one SM holds at once: the fewest that registers (allocated 256 a warp
    at a time), shared memory (1 KB reserved per CTA) and warp slots allow, at least 1."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = REGISTERS_PER_SM // max(per_warp, 1) // num_warps
    by_shared = SHARED_PER_SM[arch] // (shared_bytes + 1024)
    return max(1, min(by_registers, by_shared, WARPS_PER_SM[arch] // num_warps, 32))
