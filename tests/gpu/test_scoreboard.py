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


def test_a_tma_copy_is_waited_for_stages_minus_one_passes_later():
    """UTMALDG copies, each waited for on its mbarrier (SYNCS.PHASECHK...TRYWAIT) in the order
    they were issued; the loop enters with stages - 1 passes' copies in flight, so two stages
    wait for the copy the previous pass issued, three for the one before it."""
    def loop(work=10):
        return [_ins("SYNCS.PHASECHK.TRANS64.TRYWAIT"), *[_ins("FFMA", stall=10)] * work,
                _ins("UTMALDG.3D")]
    two, three = (warp_cycles(loop(), 4, stages=s) for s in (2, 3))
    # two stages: the copy issued at a pass's end (500 cycles), then the pass's work (101
    # issue cycles), every pass; three: one copy's 500 cycles and two passes' work, over two
    assert two == pytest.approx(500 + 101, abs=1)
    assert three == pytest.approx((500 + 101) / 2, abs=1)
    assert warp_cycles(loop(work=60), 4, stages=3) == pytest.approx(602, abs=1)   # hidden
    assert warp_cycles(loop(), 4, stages=3, latency={"UTMALDG": 5000}) > 2000


def test_warpgroup_mma_is_waited_for_and_shares_the_tensor_cores():
    loop = [_ins("WARPGROUP.ARRIVE"), *[_ins("HGMMA.64x64x16.F32.BF16")] * 4,
            _ins("WARPGROUP.DEPBAR.LE", operands=" gsb0, 0x0")]
    mma = 2 * 64 * 64 * 16 / 4096                    # 32 cycles each at the SM's whole rate
    assert warp_cycles(loop, 4) == pytest.approx(1 + 4 * mma + 1, abs=1)
    assert warp_cycles(loop, 8) == pytest.approx(1 + 8 * mma + 1, abs=1)   # two warpgroups


def test_a_scoreboard_counts_its_loads_and_a_store_releases_its_registers():
    """DEPBAR.LE SBk, n on ordinary loads: all but the newest n; a read barrier: the store's
    source registers read, READ_LATENCY later."""
    loads = [_ins("LDG.E", write=1, stall=10), _ins("LDG.E", write=1, stall=10),
             _ins("LDG.E", write=1, stall=10), _ins("DEPBAR.LE", operands=" SB1, 0x1")]
    # the second load (issued at 10) arrives at 260; the wait for the last two would be 270
    assert warp_cycles(loads, 4, warm_up=0, passes=1) == 250 + 10 + 1
    store = [_ins("STS", read=2), _ins("IADD3", waits=(2,))]
    assert warp_cycles(store, 4, warm_up=0, passes=1) == 15 + 1


def test_resident_ctas_from_registers_shared_memory_and_warps():
    assert resident_ctas(128, 8 * 1024, 4) == 4        # registers: 16 K a CTA
    assert resident_ctas(64, 48 * 1024, 4) == 4        # shared memory (registers allow 8)
    assert resident_ctas(16, 0, 8) == 8                # warp slots, 64 an SM
    assert resident_ctas(16, 0, 1) == 32               # the SM's 32 CTAs
    assert resident_ctas(255, 64 * 1024, 8) == 1       # 255 registers x 256 threads: the file
    with pytest.raises(ValueError, match="does not fit"):
        resident_ctas(64, 250 * 1024, 4)


@pytest.mark.slow
def test_a_compiled_kernel_s_main_loop(monkeypatch):
    """NoPE's forward for sm_90 at head dim 64 with K and V through TMA (pinned(kv="tma"):
    FWD_TMA_AT's tile; pointers ship): every instruction decoded, the loop the model's, and its
    path made of what its control bits say: it waits for the K/V copies (a slower copy, a
    longer pass; fewer stages, a longer pass) and for the warpgroup MMAs (two warpgroups
    sharing the tensor cores, a longer pass), but not for a load kind it does not hold."""
    monkeypatch.delenv("BAMGEN_INTERPRET_TILES", raising=False)
    res = run_script_aot("""
import sys
sys.path.insert(0, "benchmarks")
from bamgen.aot import compile_spec, disassemble
from bamgen.driver.loader import load_prior
from bamgen.resources import shipped_prior
from bamgen.scoreboard import main_loop, scheduled, warp_cycles
import model_check
module = load_prior(shipped_prior("uniform"))
[spec] = [s for s in module.triton_kernel_specs("bf16", 64, True, arch="sm_90") if s[0] == "attn_fwd"]
tile_for = lambda tma: model_check.forward_tile(module, 64, "sm_90", "plain", tma)
k = compile_spec(model_check.pinned_spec(spec, "fwd", {"kv": "tma"}, tile_for), "sm_90")
every = scheduled(k.cubin)
assert [(i.address, i.op) for i in every] == [(a, op) for a, op, _ in disassemble(k.cubin)]
loop = main_loop(every)
assert len(loop) == k.main_loop["total"]
assert k.num_stages == 3
path = warp_cycles(loop, k.num_warps, stages=k.num_stages)
assert warp_cycles(loop, k.num_warps, stages=k.num_stages, latency={"UTMALDG": 5000}) > path + 1000
assert warp_cycles(loop, k.num_warps, stages=2) > path
assert warp_cycles(loop, 2 * k.num_warps, stages=k.num_stages) > path
assert warp_cycles(loop, k.num_warps, stages=k.num_stages, latency={"LDL": 5000, "LDGSTS": 5000}) == path
print("ok", len(loop), path)
""")
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stdout + res.stderr
