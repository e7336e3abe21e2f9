"""bamgen.aot's reading of a kernel's SASS: which spans are its loops with tensor-core work
(mma_loops), which of them the model takes as the main loop (main_loop), and the pass through it
that it models (shortest_pass). Instruction lists written by hand, shaped as disassemble
returns them: (address, opcode, operands)."""
from bamgen.aot import main_loop, mma_loops, shortest_pass


def _code(*blocks):
    """Instructions 16 bytes apart: each block a list of opcodes, "BRA <label>" jumping to the
    address of the instruction at index <label> of the whole list (back: a loop; forward: a
    skipped block, or past the code: a stub after the loop)."""
    flat = [op for block in blocks for op in block]
    out = []
    for i, op in enumerate(flat):
        if op.startswith("BRA "):
            out.append((i * 16, "BRA", f" `(.L_x_{i}) 0x{int(op.split()[1]) * 16:x}"))
        else:
            out.append((i * 16, op, " R0, R1"))
    return out


def _spans(loops):
    return [(body[0][0] // 16, body[-1][0] // 16) for body in loops]


def test_sibling_loops_in_program_order_and_loops_without_mma_left_out():
    code = _code(["MOV"],                                    # 0
                 ["HGMMA.64x64x16.F32", "FADD", "BRA 1"],     # 1-3: a masked loop (longer)
                 ["LDS", "FADD", "BRA 4"],                    # 4-6: no tensor core
                 ["HGMMA.64x64x16.F32", "BRA 7"],             # 7-8: the unmasked loop
                 ["EXIT"])
    assert _spans(mma_loops(code)) == [(1, 3), (7, 8)]
    assert _spans([main_loop(code)]) == [(7, 8)]


def test_an_outer_loop_is_not_a_main_loop_of_its_own():
    code = _code(["MOV", "HMMA.16816.F32", "HMMA.16816.F32", "BRA 1", "BRA 0", "EXIT"])
    assert _spans(mma_loops(code)) == [(1, 3)]


def test_a_branch_back_into_a_loop_from_after_it_is_no_loop():
    # a stub placed after the loop jumps back into its middle: it spans 2-8 and its MMA, and
    # overlaps the loop 1-5 without containing it (Triton's tutorial forward has two such stubs)
    code = _code(["MOV"], ["FADD", "HGMMA.64x64x16.F32", "ISETP", "FMUL", "BRA 1"],
                 ["EXIT", "MOV", "BRA 2"])
    assert _spans(mma_loops(code)) == [(1, 5)]
    assert main_loop(_code(["EXIT"])) == []


def _ops(instructions):
    return [op for _, op, _ in instructions]


def test_the_model_takes_the_pass_that_skips_a_block_inside_the_loop():
    # the dK/dV kernel's steady tiles: a branch over the mask's selects, taken on most passes
    code = _code(["MOV"],
                 ["HGMMA.64x64x16.F32", "MUFU.EX2", "BRA 6"],   # 1-3: branch over 4-5
                 ["ISETP", "FSEL"],                             # 4-5: the mask (some passes)
                 ["HGMMA.64x64x16.F32", "BRA 1"],               # 6-7: the rest, and back
                 ["EXIT"])
    assert _spans(mma_loops(code)) == [(1, 7)]
    assert _ops(main_loop(code)) == ["HGMMA.64x64x16.F32", "MUFU.EX2", "BRA",
                                     "HGMMA.64x64x16.F32", "BRA"]


def test_a_branch_out_of_the_loop_falls_through_and_an_if_else_takes_its_shorter_arm():
    # 2: a branch to a stub past the loop (a TMA barrier's retry): the pass goes on; 4: an
    # if/else, its then-arm 5-7 ending in a jump over the else-arm 8: the else-arm is shorter
    code = _code(["MOV"],
                 ["HGMMA.64x64x16.F32", "BRA 12", "FADD", "BRA 8"],     # 1-4
                 ["FMUL", "FMUL", "BRA 9"],                             # 5-7: then
                 ["FADD"],                                              # 8: else
                 ["HGMMA.64x64x16.F32", "BRA 1"],                       # 9-10
                 ["EXIT", "BRA 2"])                                     # 11-12: the stub
    loop = mma_loops(code)[0]
    assert _ops(shortest_pass(loop)) == ["HGMMA.64x64x16.F32", "BRA", "FADD", "BRA", "FADD",
                                         "HGMMA.64x64x16.F32", "BRA"]


def test_a_loop_without_a_forward_branch_is_its_own_pass():
    loop = mma_loops(_code(["MOV", "HGMMA.64x64x16.F32", "ISETP", "FSEL", "BRA 1", "EXIT"]))[0]
    assert shortest_pass(loop) == loop
