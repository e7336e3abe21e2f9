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
by LDGDEPBAR, waited for by DEPBAR.LE with a count: the software pipeline's depth), the TMA
copies (UTMALDG, each waited for on its mbarrier by a SYNCS.PHASECHK...TRYWAIT: the oldest copy
in flight, since a pipelined loop waits for its tiles in the order it issued them) and of
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
# (L2 or DRAM), and so a TMA copy of one (UTMALDG). Anything else that sets a scoreboard:
# LATENCY_OTHER.
LATENCY = {"LDS": 30, "LDSM": 30, "LDG": 250, "LDGSTS": 500, "UTMALDG": 500, "LDL": 250,
           "MUFU": 20, "LDC": 30,
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


def _wait_for(pending: list[float], keep: int) -> float | None:
    """The time by which all but the newest ``keep`` of a scoreboard's entries have arrived
    (None: no more than ``keep`` in flight), those entries dropped."""
    if len(pending) <= keep:
        return None
    done = max(pending[:len(pending) - keep])
    del pending[:len(pending) - keep]
    return done


def _count(operands: str) -> int:
    """The count of a DEPBAR.LE SBk, n or WARPGROUP.DEPBAR.LE gsb0, n (its last operand)."""
    return int(operands.rsplit(",", 1)[-1].strip(), 0)


def warp_cycles(loop: list[Scheduled], num_warps: int, arch: str = "sm_90",
                latency: dict | None = None, warm_up: int = 6, passes: int = 12,
                stages: int = 2) -> float:
    """Cycles one warp takes for one pass of ``loop`` in steady state: the mean of ``passes``
    passes after ``warm_up`` (a pipeline of k groups repeats every k passes; 12 is a whole
    number of periods for one to four).

    A warp issues in order: an instruction waits for the scoreboards in its mask (each released
    when every result set on it has arrived), then the next one follows after its stall count.
    A scoreboard is a counter of results in flight, oldest first: DEPBAR.LE SBk, n waits until
    at most n are left on SBk. LDGDEPBAR commits the cp.async copies (LDGSTS) issued since the
    last one as a group, which arrives with its last copy. Warpgroup MMAs run one after another
    on the tensor cores, shared by the CTA's warpgroups; one marked gsb0 closes a group and
    WARPGROUP.DEPBAR.LE gsb0, n waits until at most n groups are in flight. Branches inside the
    loop are taken as falling through (the steady loop of a bamgen kernel has none that skip
    work). A TMA copy's wait carries no count: the loop enters with the copies of its first
    stages - 1 tiles in flight (issued before it, arrived by the steady state), so each wait
    takes the copy issued stages - 1 passes before."""
    from .aot import _mma_flops
    latency = {**LATENCY, **(latency or {})}
    share = TENSOR_RATE[arch] / max(1, num_warps // 4)   # one warpgroup's MMA flops per clock
    pending: dict[int, list[float]] = {b: [] for b in range(6)}
    copies: list[float] = []       # the cp.async copies not yet committed
    per_pass = sum(ins.op.startswith("UTMALDG") for ins in loop)
    tma = [0.0] * (max(stages, 1) - 1) * per_pass   # TMA copies not yet waited for, oldest first
    mma_groups: list[float] = []   # the warpgroup MMA groups in flight
    mma_done = 0.0
    t = start = 0.0
    for count in range(warm_up + passes):
        if count == warm_up:
            start = t
        for ins in loop:
            base = ins.op.split(".")[0]
            ready = [t] + [max(pending[b]) for b in ins.waits if pending[b]]
            for b in ins.waits:
                pending[b] = []
            if base == "DEPBAR":
                board = re.search(r"SB(\d)", ins.operands)
                ready.append(_wait_for(pending[int(board[1])], _count(ins.operands)) or t)
            elif ins.op.startswith("WARPGROUP.DEPBAR"):
                groups = mma_groups or [mma_done]   # (no gsb0 seen: every MMA so far)
                ready.append(_wait_for(groups, _count(ins.operands)) or t)
            elif ins.op.startswith("SYNCS.PHASECHK") and tma:   # (the loop's first waits: none)
                ready.append(tma.pop(0))
            t = max(ready)
            arrives = t + latency.get(base, LATENCY_OTHER)
            if base == "LDGSTS":
                copies.append(t + latency["LDGSTS"])
            elif base == "UTMALDG":
                tma.append(t + latency["UTMALDG"])
            elif base == "LDGDEPBAR":
                arrives = max(copies, default=t)
                copies = []
            elif base == "HGMMA":
                mma_done = max(mma_done, t) + _mma_flops(ins.op) / share
                arrives = mma_done
                if "gsb0" in ins.operands:
                    mma_groups.append(mma_done)
            elif base == "HMMA":
                arrives = t + max(latency["HMMA"], _mma_flops(ins.op) * num_warps / TENSOR_RATE[arch])
            if ins.write_barrier is not None:
                pending[ins.write_barrier].append(arrives)
            if ins.read_barrier is not None:
                pending[ins.read_barrier].append(t + READ_LATENCY)
            t += max(ins.stall, 1)
    return (t - start) / passes


def resident_ctas(registers: int, shared_bytes: int, num_warps: int, arch: str = "sm_90") -> int:
    """CTAs of a kernel one SM holds at once: the fewest that registers (allocated 256 a warp
    at a time), shared memory (1 KB reserved per CTA), warp slots and the SM's 32 allow;
    ValueError for a kernel of which not one fits."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = REGISTERS_PER_SM // max(per_warp, 1) // num_warps
    by_shared = SHARED_PER_SM[arch] // (shared_bytes + 1024)
    ctas = min(by_registers, by_shared, WARPS_PER_SM[arch] // num_warps, 32)
    if ctas < 1:
        raise ValueError(f"a CTA of {num_warps} warps x {registers} registers and {shared_bytes} "
                         f"bytes of shared memory does not fit one {arch} SM")
    return ctas
