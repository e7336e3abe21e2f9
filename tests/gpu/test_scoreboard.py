"""bamgen.scoreboard: the control bits ptxas writes into each SASS instruction, and one warp's
path through a loop from them. Hand-made loops with known answers, then a real kernel."""
import pytest

from bamgen.scoreboard import Scheduled, control, parse, resident_ctas, warp_cycles
from tests.helpers import run_script_aot


def _ins(op, stall=1, write=None, read=None, waits=(), operands=""):
    return Scheduled(0, op, operands, stall, write, read, tuple(waits))


def test_control_bits_of_words_cuobjdump_printed():
    # from an sm_90 cubin: LDC R1 (stall 8, sets scoreboard 1), LDC R17 (sets 2), and IABS R5,
    # R17, which waits on scoreboard 2 before it reads R17
    assert control(0x000E700000000800) == (8, 1, None, ())
    assert control(0x000EA20000000800) == (1, 2, None, ())
    assert control(0x004FCE0000000000) == (7, None, None, (2,))
    assert control(0x020FE40000000000) == (2, None, None, (5,))


def test_parse_reads_each_instruction_with_its_second_word():
    sass = """
        /*0010*/                   LDC R17, c[0x0][0x2d8] ;            /* 0x0000b600ff117b82 */
                                                                       /* 0x000ea20000000800 */
        /*00e0*/                   IABS R5, R17 ;                      /* 0x0000001100057213 */
                                                                       /* 0x004fce0000000000 */
        /*0100*/              @!P6 LDG.E.128 R24, desc[UR30][R2.64] ;  /* 0x0000001e0218e981 */
                                                                       /* 0x000f620000000000 */
    """
    ins = parse(sass)
    assert [(i.address, i.op) for i in ins] == [(0x10, "LDC"), (0xE0, "IABS"), (0x100, "LDG.E.128")]
    assert ins[0].write_barrier == 2 and ins[1].waits == (2,) and ins[1].stall == 7
    assert ins[2].operands.strip().startswith("R24")


def test_a_load_used_at_once_costs_its_latency_and_one_used_later_costs_nothing():
    at_once = [_ins("LDS", write=0), _ins("FADD", waits=(0,))]
    assert warp_cycles(at_once, 4) == 30 + 1          # the load's 30 cycles, then the add
    later = [_ins("LDS", write=0), *[_ins("FFMA", stall=15)] * 2, _ins("FADD", waits=(0,))]
    assert warp_cycles(later, 4) == 1 + 30 + 1        # 30 cycles of other work hide it
    far = [_ins("LDS", write=0), *[_ins("FFMA", stall=15)] * 3, _ins("FADD", waits=(0,))]
    assert warp_cycles(far, 4) == 1 + 45 + 1          # the stall counts alone


def test_a_deeper_copy_pipeline_waits_less():
    """LDGSTS copies committed as a group (LDGDEPBAR), DEPBAR.LE SB0, n waiting until n groups
    are in flight: one stage waits for its own copy every pass, two overlap it with a pass."""
    def loop(depth, work=10):
        return [_ins("LDGSTS.E.BYPASS.128"), _ins("LDGDEPBAR", write=0),
                _ins("DEPBAR.LE", operands=f" SB0, {hex(depth)}"), *[_ins("FFMA", stall=10)] * work]
    one, two, three = (warp_cycles(loop(d), 4) for d in (0, 1, 2))
    # a pass is the copy (500 cycles) and the rest of the pass (3 + 100 issue cycles, the copy's
    # issue among them) over the groups in flight: one, two, three
    assert one == 500 + 1 + 100
    assert two == pytest.approx((500 + 1 + 100) / 2, abs=1)
    assert three == pytest.approx((500 + 1 + 100) / 3, abs=1)
    assert warp_cycles(loop(2, work=60), 4) == 3 + 600   # enough work hides the copy entirely


def test_warpgroup_mma_is_waited_for_and_shares_the_tensor_cores():
    loop = [_ins("WARPGROUP.ARRIVE"), *[_ins("HGMMA.64x64x16.F32.BF16")] * 4,
            _ins("WARPGROUP.DEPBAR.LE", operands=" gsb0, 0x0")]
    mma = 2 * 64 * 64 * 16 / 4096                    # 32 cycles each at the SM's whole rate
    assert warp_cycles(loop, 4) == pytest.approx(1 + 4 * mma + 1, abs=1)
    assert warp_cycles(loop, 8) == pytest.approx(1 + 8 * mma + 1, abs=1)   # two warpgroups


def test_resident_ctas_from_registers_shared_memory_and_warps():
    assert resident_ctas(128, 48 * 1024, 4) == 4        # 16 K registers, 49 KB: four of each
    assert resident_ctas(255, 64 * 1024, 8) == 1        # 255 registers x 256 threads: the file
    assert resident_ctas(64, 200 * 1024, 4) == 1        # shared memory
    assert resident_ctas(32, 0, 4) == 16                # warp slots (64 a SM)
    assert resident_ctas(255, 250 * 1024, 8) == 1       # never below one


@pytest.mark.slow
def test_a_compiled_kernel_s_main_loop(monkeypatch):
    """NoPE's forward for sm_90: every instruction decoded, the loop the model's, and the warp's
    path at least its own stall counts and its MMAs."""
    monkeypatch.delenv("BAMGEN_INTERPRET_TILES", raising=False)
    res = run_script_aot("""
from bamgen.aot import compile_module, disassemble
from bamgen.driver.loader import load_prior
from bamgen.resources import shipped_prior
from bamgen.scoreboard import main_loop, scheduled, warp_cycles
[k] = compile_module(load_prior(shipped_prior("uniform")), arch="sm_90", head_dim=64, only=("attn_fwd",))
every = scheduled(k.cubin)
assert [(i.address, i.op) for i in every] == [(a, op) for a, op, _ in disassemble(k.cubin)]
assert all(0 <= i.stall <= 15 for i in every)
loop = main_loop(every)
assert len(loop) == k.main_loop["total"]
assert any(i.op.startswith("WARPGROUP.DEPBAR") for i in loop)
path = warp_cycles(loop, k.num_warps)
mma = sum(2 * 64 * 64 * 16 for i in loop if i.op.startswith("HGMMA.64x64x16"))
assert path >= sum(max(i.stall, 1) for i in loop), path
assert path >= mma / 4096, path
print("ok", len(loop), path)
""")
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stdout + res.stderr
