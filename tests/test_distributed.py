"""Context parallelism (bamgen.distributed) on spawned gloo processes, against one process.

Four CPU processes are started once for the whole file (starting torch in a process costs
seconds on two cores) and joined in a gloo group with sub-groups: ranks {0, 1} (2-way context
parallelism), all four (4-way), {0} (1-way, for the memory test) and a 2 x 2 mesh (context
parallel {0, 1}, {2, 3}; data parallel {0, 2}, {1, 3}). Each test sends a function of this file
to the ranks it needs; the ranks run it and report back, an assertion on a rank fails the test
with that rank's traceback.

Every case draws the whole sequence on every rank, runs the one-process `mod.attention` on it,
then `shard` -> `ring_attention` -> `unshard` with backward through it, and gathers the
gradients of the shards: the output, dq, dk, dv and every prior-parameter gradient must match
the float64 reference to the tolerance of docs/architecture.md, "Testing" (as the one-process run does) and the
one-process run itself to float32 rounding.
"""
from __future__ import annotations

import gc
import importlib
import os
import re
import socket
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bamgen.distributed import ring_attention, shard, unshard
from tests.reference import reference_attention
from tests.runtime.test_library import LIBRARY, as_reference, fold_shared
from tests.tolerance import assert_all_close

WORLD = 4
TIMEOUT_S = 120          # a case that deadlocks fails after this long instead of hanging


# --------------------------------------------------------------------------------------------
# the priors, written again in plain torch (as in test_properties.py / test_library.py)
def _ggd(d, p):
    return -(torch.abs(d - p["mu"]) / p["alpha"]) ** p["beta"]


def _bam(d, p):
    return -torch.exp(p["ta"]) * (torch.abs(-d - 2 * torch.sinh(p["tm"])) + 1e-5) ** p["tb"]


def _ssmax_score(s, lp, n, p):
    return (s + lp) * p["ssmax"] * torch.log(n.to(s.dtype))


PRIORS = {   # name: (log_prior, score, kink, per-head values for 4 heads)
    "generalized_gaussian": (_ggd, None, lambda d, p: (d - p["mu"]) == 0,
                             {"alpha": [3.0, 20.0, 1.5, 60.0], "beta": [0.7, 1.6, 1.0, 2.5],
                              "mu": [0.0, 2.5, -1.0, 4.0]}),
    "bam_ssmax": (_bam, _ssmax_score, None,
                  {"ta": [-1.0, -3.0, 0.5, -2.0], "tb": [1.0, -0.5, 0.3, 1.7],
                   "tm": [0.0, 0.3, -1.2, 2.0], "ssmax": [0.4, 0.2, 0.7, 1.1]}),
    "laplace": (lambda d, p: -torch.abs(d) / p["b"], None, lambda d, p: d == 0,
                {"b": [1.0, 4.0, 16.0, 0.5]}),
    # vector parameters (tests/runtime/test_library.py): T5's tables, FIRE's shared MLP layer
    "t5": (LIBRARY["t5"][0], None, None, LIBRARY["t5"][2]),
    "t5_bidirectional": (LIBRARY["t5_bidirectional"][0], None, None, LIBRARY["t5_bidirectional"][2]),
    "fire": (LIBRARY["fire"][0], None, None, LIBRARY["fire"][2]),
    "uniform": (None, None, None, {}),
}


# --------------------------------------------------------------------------------------------
# the process pool
GROUPS = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank, port, inbox, outbox):
    """A rank: join the group, make the sub-groups, run what arrives until None."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=TIMEOUT_S))
    GROUPS["all"] = dist.group.WORLD
    GROUPS["pair"] = dist.new_group([0, 1])
    GROUPS["solo"] = dist.new_group([0])
    GROUPS["cp"] = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])[0]
    GROUPS["dp"] = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])[0]
    while True:
        task = inbox.get()
        if task is None:
            break
        fn, args = task
        try:
            outbox.put((rank, "ok", fn(rank, *args)))
        except BaseException:
            outbox.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class _Pool:
    def __init__(self):
        ctx = mp.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(WORLD)]
        port = _free_port()
        # a freed tensor goes straight back to the OS, so peak RSS measures live tensors
        saved = {k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
        os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        try:
            self.procs = [ctx.Process(target=_serve, args=(r, port, self.inboxes[r], self.outbox),
                                      daemon=True) for r in range(WORLD)]
            for p in self.procs:
                p.start()
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        self.broken = False

    def run(self, fn, ranks, *args):
        """fn(rank, *args) on each of `ranks`; {rank: result}. A failure on a rank raises."""
        if self.broken:
            pytest.fail("an earlier case left the process group broken")
        for r in ranks:
            self.inboxes[r].put((fn, args))
        results, errors = {}, []
        try:
            for _ in ranks:
                rank, status, value = self.outbox.get(timeout=TIMEOUT_S + 30)
                (results.__setitem__(rank, value) if status == "ok" else errors.append(f"rank {rank}:\n{value}"))
        except Exception as err:   # queue.Empty: a rank hangs
            self.broken = True
            raise AssertionError(f"no answer from every rank within {TIMEOUT_S + 30} s ({err!r})")
        if errors:
            raise AssertionError("\n".join(errors))
        return results

    def close(self):
        for box in self.inboxes:
            box.put(None)
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.terminate()


@pytest.fixture(scope="module")
def pool():
    p = _Pool()
    yield p
    p.close()


# --------------------------------------------------------------------------------------------
# helpers run on the ranks
def _inputs(B, Hq, Hk, N, D, seed):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, Hq, N, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, Hk, N, D, generator=g) for _ in range(2))
    return q, k, v, dout


def _gather(x, group):
    with torch.no_grad():
        return unshard(x.contiguous(), group=group)


def _ring_case(rank, group_name, prior, causal, B, Hq, Hk, chunk, D, cuts=None):
    """One case: returns the errors against the one-process run (asserts inside). cuts: packed
    documents (the whole sequence's cu_seqlens), else None."""
    group = GROUPS[group_name]
    world = dist.get_world_size(group)
    mod = importlib.import_module(f"generated.{prior}")
    log_prior, score, kink, values = PRIORS[prior]
    N = 2 * world * chunk
    q, k, v, dout = _inputs(B, Hq, Hk, N, D, seed=N + Hk)
    params = {n: torch.tensor(vals[:Hq] if mod.TRAITS.param(n).per_head else vals)
              for n, vals in values.items()}
    docs = {} if cuts is None else dict(cu_seqlens_q=torch.tensor(cuts), cu_seqlens_k=torch.tensor(cuts))

    # the one-process run
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    p_one = {n: t.clone().requires_grad_(n in mod.LEARNABLE) for n, t in params.items()}
    one = mod.attention(*leaves, **p_one, causal=causal, **docs)
    one_grads = torch.autograd.grad(one, leaves + [p_one[n] for n in mod.LEARNABLE], dout)

    # the ring: every rank draws the whole sequence and keeps its shard
    shards = [shard(t, group=group).requires_grad_() for t in (q, k, v)]
    p_ring = {n: t.clone().requires_grad_(n in mod.LEARNABLE) for n, t in params.items()}
    ring_docs = {} if cuts is None else dict(cu_seqlens=torch.tensor(cuts))
    out = unshard(ring_attention(mod, *shards, causal=causal, group=group, **ring_docs, **p_ring),
                  group=group)
    out.backward(dout)        # every rank holds the same loss on the full output
    ring = [out.detach()] + [_gather(t.grad, group) for t in shards]
    ring += [p_ring[n].grad for n in mod.LEARNABLE]

    kw = dict(causal=causal, score=score, kink=kink, dout=dout, **docs)
    ref = reference_attention(q, k, v, as_reference(mod, params), log_prior, **kw)
    pt = reference_attention(q, k, v, as_reference(mod, params), log_prior,
                             compute_dtype=torch.float32, **kw)
    fold_shared(mod, ref, pt)
    names = ["out", "dq", "dk", "dv"] + [f"d{n}" for n in mod.LEARNABLE]
    refs = [ref.out, ref.dq, ref.dk, ref.dv] + [ref.dparams[n] for n in mod.LEARNABLE]
    pts = [pt.out, pt.dq, pt.dk, pt.dv] + [pt.dparams[n] for n in mod.LEARNABLE]
    gross = [ref.gross.get(n) for n in names]
    context = f"{prior} causal={causal} world={world} rank={rank} documents={cuts}"
    for label, got in (("ring", ring), ("one process", [one.detach(), *one_grads])):
        assert_all_close([(n, g, r, p, s) for n, g, r, p, s in zip(names, got, refs, pts, gross)],
                         torch.float32, context=f"{label}: {context}")
    errors = {}
    for n, got, want in zip(names, ring, [one.detach(), *one_grads]):
        scale = max(1.0, want.abs().max().item())
        errors[n] = (got - want).abs().max().item() / scale
        assert errors[n] <= 1e-5, f"{n}: ring and one process differ by {errors[n]:.2e} ({context})"
    return errors


CASES = [   # (group, prior, causal, B, Hq, Hk, chunk, D)
    ("pair", "generalized_gaussian", True, 2, 4, 2, 5, 16),
    ("pair", "generalized_gaussian", False, 1, 4, 4, 6, 16),
    ("pair", "bam_ssmax", True, 1, 4, 2, 5, 16),
    ("pair", "bam_ssmax", False, 2, 4, 1, 4, 8),
    ("pair", "uniform", False, 1, 2, 1, 7, 16),
    ("all", "generalized_gaussian", True, 1, 4, 2, 4, 16),
    ("all", "generalized_gaussian", False, 1, 4, 4, 3, 16),
    ("all", "bam_ssmax", True, 1, 4, 4, 3, 16),
    ("all", "bam_ssmax", False, 1, 4, 2, 3, 8),
    ("all", "laplace", True, 2, 2, 1, 3, 16),
    ("pair", "t5", True, 1, 4, 2, 5, 16),
    ("all", "t5_bidirectional", False, 1, 4, 4, 3, 8),
    ("pair", "fire", True, 1, 4, 2, 4, 8),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:3])) + f"-gqa{c[4] // c[5]}")
def test_ring_matches_one_process(pool, case):
    ranks = [0, 1] if case[0] == "pair" else list(range(WORLD))
    pool.run(_ring_case, ranks, *case)


DOC_CASES = [   # (group, prior, causal, B, Hq, Hk, chunk, D, cu_seqlens of the whole sequence)
    # an empty document, one of length 1, documents across chunk and rank boundaries
    ("pair", "generalized_gaussian", True, 1, 4, 2, 5, 16, [0, 3, 3, 11, 12, 20]),
    ("pair", "bam_ssmax", False, 1, 4, 4, 5, 8, [0, 7, 8, 20]),   # n: the document's length
    ("all", "bam_ssmax", True, 1, 4, 2, 4, 16, [0, 9, 10, 23, 32]),
    ("all", "laplace", True, 1, 2, 1, 4, 16, [0, 1, 17, 30, 32]),
]


@pytest.mark.parametrize("case", DOC_CASES, ids=lambda c: "-".join(map(str, c[:3])) + "-packed")
def test_ring_with_packed_documents_matches_one_process(pool, case):
    """Packed documents through the ring: each document alone, positions restarting at its
    start, equal to the one-process `attention(..., cu_seqlens_q=cu, cu_seqlens_k=cu)`."""
    ranks = [0, 1] if case[0] == "pair" else list(range(WORLD))
    pool.run(_ring_case, ranks, *case)


def _ring_positions_case(rank, group_name, prior, causal, B, Hq, Hk, chunk, D, per_head, cuts=None):
    """Positions as tensors through the ring (docs/positions.md): every rank draws the whole
    sequence and its positions, shards both, and the ring's output and gradients (q, k, v, the
    parameters and the positions) equal one process's `mod.attention(..., pos_q=c, pos_k=c)`.
    FoX's c is a per-head cumulative sum of log-sigmoid gates; another prior reads sorted random
    float positions shared by the heads ([B, N])."""
    group = GROUPS[group_name]
    world = dist.get_world_size(group)
    mod = importlib.import_module(f"generated.{prior}")
    N = 2 * world * chunk
    q, k, v, dout = _inputs(B, Hq, Hk, N, D, seed=N + Hk + 7)
    g = torch.Generator().manual_seed(N + 11)
    if per_head:
        gates = torch.randn(B, Hq, N, generator=g) + 2.0
    else:
        gates = torch.rand(B, N, generator=g) * 3.0
    params = {n: t for n, t in mod.default_params(Hq).items()}
    docs = {} if cuts is None else dict(cu_seqlens_q=torch.tensor(cuts), cu_seqlens_k=torch.tensor(cuts))

    def positions(gate_leaf):
        return (torch.nn.functional.logsigmoid(gate_leaf).cumsum(-1) if per_head
                else gate_leaf.cumsum(-1))

    leaves = [t.clone().requires_grad_() for t in (q, k, v, gates)]
    p_one = {n: t.clone().requires_grad_() for n, t in params.items()}
    c = positions(leaves[3])
    one = mod.attention(*leaves[:3], **p_one, causal=causal, pos_q=c, pos_k=c, **docs)
    want = [one] + list(torch.autograd.grad(one, leaves + list(p_one.values()), dout))

    shards = [shard(t, group=group).requires_grad_() for t in (q, k, v)]
    gate_leaf = gates.clone().requires_grad_()
    c_shard = shard(positions(gate_leaf), group=group, dim=-1)
    p_ring = {n: t.clone().requires_grad_() for n, t in params.items()}
    ring_docs = {} if cuts is None else dict(cu_seqlens=torch.tensor(cuts))
    out = unshard(ring_attention(mod, *shards, causal=causal, group=group, pos_q=c_shard,
                                 pos_k=c_shard, **ring_docs, **p_ring), group=group)
    out.backward(dout)
    # each rank's gates reach the loss through its own shard of c: the whole gradient is the sum
    dist.all_reduce(gate_leaf.grad, group=group)
    got = [out.detach()] + [_gather(t.grad, group) for t in shards] + [gate_leaf.grad]
    got += [p_ring[n].grad for n in params]
    names = ["out", "dq", "dk", "dv", "dgates"] + [f"d{n}" for n in params]
    context = f"{prior} causal={causal} world={world} rank={rank} per_head={per_head} documents={cuts}"
    for n, a, b in zip(names, got, want):
        scale = max(1.0, b.abs().max().item())
        err = (a - b).abs().max().item() / scale
        assert err <= 1e-5, f"{n}: ring and one process differ by {err:.2e} ({context})"
    return True


POSITION_CASES = [   # (group, prior, causal, B, Hq, Hk, chunk, D, per-head positions, cu_seqlens)
    ("pair", "forget_gate", True, 2, 4, 2, 5, 16, True, None),
    ("all", "forget_gate", True, 1, 4, 4, 3, 8, True, None),
    ("pair", "forget_gate", True, 1, 2, 1, 5, 8, True, [0, 3, 3, 11, 12, 20]),
    ("pair", "generalized_gaussian", False, 1, 4, 2, 4, 16, False, None),
    ("all", "laplace", True, 1, 2, 1, 3, 8, False, None),
]


@pytest.mark.parametrize("case", POSITION_CASES,
                         ids=lambda c: "-".join(map(str, c[:3])) + ("-packed" if c[-1] else ""))
def test_ring_with_positions_matches_one_process(pool, case):
    ranks = [0, 1] if case[0] == "pair" else list(range(WORLD))
    pool.run(_ring_positions_case, ranks, *case)


@pytest.mark.parametrize("causal", [True, False])
def test_packed_documents_skip_chunk_pairs_that_share_none(causal):
    """The schedule from the documents alone: a (query chunk, key chunk) pair is computed, and
    its keys sent, exactly when some query of the one sees a key of the other."""
    from bamgen.distributed import _Documents, _Ring
    world, chunk = 3, 4
    cuts = [0, 2, 9, 9, 10, 17, 24]
    docs = _Documents(tuple((a, b) for a, b in zip(cuts, cuts[1:]) if b > a))
    doc_of = torch.bucketize(torch.arange(2 * world * chunk), torch.tensor(cuts[1:]), right=True)
    for q_rank in range(world):
        ring = _Ring(None, q_rank, world, chunk, causal, None, docs)
        for k_rank in range(world):
            want = []
            for qs, qx in enumerate((q_rank, 2 * world - 1 - q_rank)):
                for ks, kx in enumerate((k_rank, 2 * world - 1 - k_rank)):
                    i = torch.arange(qx * chunk, (qx + 1) * chunk)[:, None]
                    j = torch.arange(kx * chunk, (kx + 1) * chunk)[None, :]
                    sees = doc_of[i] == doc_of[j]
                    if causal:
                        sees &= j <= i
                    if bool(sees.any()):
                        want.append((qs, ks))
            assert ring.pairs(q_rank, k_rank) == want, (q_rank, k_rank)


# --------------------------------------------------------------------------------------------
# what is computed and what is sent
def _count_work(rank, group_name, module_path, causal, chunk, window):
    """Run one ring (forward and backward) counting block calls and the chunks of K/V each
    rank sends; returns them with the positions-only expectation."""
    from bamgen.driver.loader import import_module_file
    group = GROUPS[group_name]
    world = dist.get_world_size(group)
    mod = import_module_file(module_path) if module_path else importlib.import_module("generated.laplace")
    calls, sent = {"fwd": 0, "bwd": 0}, []
    real_fwd, real_bwd, real_batch = mod.forward_block, mod.backward_block, dist.batch_isend_irecv

    def fwd(*a, **kw):
        calls["fwd"] += 1
        return real_fwd(*a, **kw)

    def bwd(*a, **kw):
        calls["bwd"] += 1
        return real_bwd(*a, **kw)

    def batch(ops):
        sent.extend(op.tensor.numel() for op in ops if op.op is dist.isend)
        return real_batch(ops)

    mod.forward_block, mod.backward_block, dist.batch_isend_irecv = fwd, bwd, batch
    N = 2 * world * chunk
    q, k, v, dout = _inputs(1, 2, 2, N, 8, seed=5)
    b = torch.tensor([2.0, 7.0])
    try:
        shards = [shard(t, group=group).requires_grad_() for t in (q, k, v)]
        b_ring = b.clone().requires_grad_()
        out = ring_attention(mod, *shards, causal=causal, group=group, b=b_ring)
        out.backward(shard(dout, group=group))
    finally:
        mod.forward_block, mod.backward_block, dist.batch_isend_irecv = real_fwd, real_bwd, real_batch
    leaves = [t.clone().requires_grad_() for t in (q, k, v, b)]
    one = mod.attention(*leaves[:3], b=leaves[3], causal=causal)
    one.backward(dout)
    got = [_gather(out, group)] + [_gather(t.grad, group) for t in shards] + [b_ring.grad]
    for name, g, want in zip(("out", "dq", "dk", "dv", "db"), got, [one.detach()] + [t.grad for t in leaves]):
        err = (g - want).abs().max().item() / max(1.0, want.abs().max().item())
        assert err < 1e-5, (name, err, module_path)

    # expected, from positions alone: chunk x of 2W covers [x c, (x+1) c); rank r holds r, 2W-1-r
    def sees(qx, kx):
        i = torch.arange(qx * chunk, (qx + 1) * chunk)[:, None]
        j = torch.arange(kx * chunk, (kx + 1) * chunk)[None, :]
        ok = torch.ones(chunk, chunk, dtype=torch.bool)
        if causal:
            ok &= j <= i
        if window is not None:
            ok &= (i - j).abs() <= window
        return bool(ok.any())

    def held(r):
        return (r, 2 * world - 1 - r)

    def needs(q_rank, k_rank):   # chunks of k_rank that q_rank's queries see
        return sum(any(sees(qx, kx) for qx in held(q_rank)) for kx in held(k_rank))

    others = [o for o in range(world) if o != rank]
    give = sum(needs(o, rank) for o in others)      # K/V chunks this rank sends (fwd, bwd)
    take = sum(needs(rank, o) for o in others)      # dK/dV chunks it returns
    kv_chunk = 2 * 1 * 2 * chunk * 8                # k and v of one chunk: [2, B, Hk, chunk, D]
    pairs = sum(sees(qx, kx) for qx in held(rank) for kx in range(2 * world))
    return {"calls": calls, "pairs": pairs, "sent": sum(sent), "give": give * kv_chunk,
            "expected_sent": (2 * give + take) * kv_chunk}


WINDOW_PRIOR = """
name: ring_window
description: ALiBi inside a window of 5 keys back and forward, nothing beyond
log_prior: Piecewise((-Abs(d) / b, Abs(d) <= 5), (-oo, True))
params:
  b: {init: 4.0, domain: positive}
"""


SKIP_PRIOR = """
name: ring_skip
description: a cubic fall-off whose far tail skip_below drops (|d| > 6 for b = 7, > 4 for b = 2)
log_prior: -Abs(d)**3 / b
skip_below: 40
params:
  b: {init: 4.0, domain: positive}
"""


@pytest.mark.parametrize("causal", [True, False])
def test_invisible_blocks_are_neither_computed_nor_sent(pool, tmp_path, causal):
    """Causal zigzag: a rank needs only the head chunk of a lower rank. A window of 5 keys with
    chunks of 4: a query chunk sees at most its neighbours; the other steps exchange nothing.
    skip_below: distances more than 40 nats under the head's best count as outside the window
    (6 keys here), as the GPU kernels' block skipping reads them.
    Every rank's block calls and the elements it sends equal what the positions alone say: the
    K/V chunks its peers' queries see (forward and backward) and the dK/dV of the chunks it
    received."""
    import bamgen
    (tmp_path / "ring_window.yaml").write_text(WINDOW_PRIOR)
    window_mod = bamgen.load(tmp_path / "ring_window.yaml", cache_dir=tmp_path / "cache")
    (tmp_path / "ring_skip.yaml").write_text(SKIP_PRIOR)
    skip_mod = bamgen.load(tmp_path / "ring_skip.yaml", cache_dir=tmp_path / "cache")
    for path, window in ((None, None), (window_mod.__file__, 5), (skip_mod.__file__, 6)):
        res = pool.run(_count_work, list(range(WORLD)), "all", path, causal, 4, window)
        for rank, r in res.items():
            assert r["calls"] == {"fwd": r["pairs"], "bwd": r["pairs"]}, (rank, r, window)
            assert r["sent"] == r["expected_sent"], (rank, r, window)
        if window is None and causal:   # a quarter of a plain ring's K/V traffic is never sent
            total = sum(r["give"] for r in res.values())
            assert total == 0.75 * WORLD * (WORLD - 1) * 2 * (2 * 2 * 4 * 8)


# --------------------------------------------------------------------------------------------
# data parallel beside context parallel
def _ddp_case(rank):
    """2 x 2: context-parallel pairs {0, 1} and {2, 3} each train on their own sequence, data
    parallel over {0, 2} and {1, 3}. The model: a qkv projection and a GGD attention layer. After
    backward (DDP averages over data parallel; ring_attention sums the prior's gradients over
    context parallel) the projection's gradient, partial per context-parallel rank, is summed
    over the context-parallel group; then every gradient equals one process training on both
    sequences with the mean of their losses."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    mod = importlib.import_module("generated.generalized_gaussian")
    cp, dp = GROUPS["cp"], GROUPS["dp"]
    H, D, E, chunk = 2, 8, 12, 3
    N = 4 * chunk

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.qkv = torch.nn.Linear(E, 3 * H * D)
            self.attn = mod.GeneralizedGaussianAttention(H)

        def forward(self, x, group=None, sharded=False):
            B, n, _ = x.shape
            q, k, v = self.qkv(x).view(B, n, 3, H, D).permute(2, 0, 3, 1, 4)
            if sharded:
                return ring_attention(mod, q, k, v, causal=True, group=group, **self.attn.prior_params())
            return self.attn(q, k, v, causal=True)

    seqs = [torch.randn(1, N, E, generator=torch.Generator().manual_seed(10 + s)) for s in range(2)]
    weights = [torch.randn(1, H, N, D, generator=torch.Generator().manual_seed(20 + s)) for s in range(2)]
    replica = rank // 2                                     # which sequence this rank trains on
    model = DDP(Layer(), process_group=dp)
    out = model(shard(seqs[replica], group=cp, dim=1), group=cp, sharded=True)
    (out * shard(weights[replica], group=cp)).sum().backward()
    for p in model.module.qkv.parameters():                # partial per cp rank: sum over cp
        dist.all_reduce(p.grad, group=cp)

    one = Layer()
    loss = sum((one(s) * w).sum() for s, w in zip(seqs, weights)) / 2
    loss.backward()
    got = dict(model.module.named_parameters())
    for name, p in one.named_parameters():
        err = (got[name].grad - p.grad).abs().max().item() / max(1.0, p.grad.abs().max().item())
        assert err < 1e-5, f"{name}: {err:.2e}"
    return True


def test_data_parallel_beside_context_parallel(pool):
    pool.run(_ddp_case, list(range(WORLD)))


# --------------------------------------------------------------------------------------------
# memory per rank
def _status(key):
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _peak_memory(rank, group_name, N, Hq, Hk, D):
    """Peak RSS over the inputs of one forward and backward of the ring, on rank 0."""
    group = GROUPS[group_name]
    mod = importlib.import_module("generated.uniform")
    q, k, v = (shard(t, group=group).requires_grad_() for t in _inputs(1, Hq, Hk, N, D, seed=1)[:3])
    dout = torch.randn(q.shape)

    def step():
        ring_attention(mod, q, k, v, causal=True, group=group).backward(dout)
        q.grad = k.grad = v.grad = None

    step()    # warm-up
    gc.collect()
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    step()
    return _status("VmHWM") - base


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
def test_memory_per_rank_falls_with_the_number_of_ranks(pool):
    """GQA as in Llama-style models (4 query heads per KV head), N = 1024, D = 256, causal,
    forward and backward. Ideal is half the memory for twice the ranks; the ring's K/V and
    dK/dV buffers in flight (none with one rank) and the module's fixed tile workspace keep it
    above that (about 0.6 per doubling when this was written; the bound is 0.75)."""
    N, Hq, Hk, D = 1024, 8, 2, 256
    peaks = [pool.run(_peak_memory, ranks, name, N, Hq, Hk, D)[0]
             for name, ranks in (("solo", [0]), ("pair", [0, 1]), ("all", list(range(WORLD))))]
    full_q = N * Hq * D * 4
    for w, peak in zip((1, 2, 4), peaks):
        print(f"{w} rank(s): peak {peak / 2**20:.1f} MiB over the inputs = {peak / full_q:.2f} x q's size")
    assert peaks[1] < 0.75 * peaks[0] and peaks[2] < 0.75 * peaks[1], peaks


# --------------------------------------------------------------------------------------------
# one process: shard/unshard, the block API's n, and the errors users see
def test_shard_unshard_layout_and_errors():
    x = torch.arange(12.0).reshape(1, 1, 12, 1)
    assert torch.equal(shard(x), x)                      # one process: both chunks, in order
    assert torch.equal(unshard(shard(x)), x)
    tokens = torch.arange(12).reshape(1, 12)
    assert torch.equal(unshard(shard(tokens, dim=1), dim=1), tokens)
    with pytest.raises(ValueError, match="multiple of 2"):
        shard(torch.zeros(1, 1, 7, 4))
    with pytest.raises(ValueError, match="sequence in dim 2"):
        shard(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="not initialised"):
        shard(x, group=object())


def _layout(rank, world):
    x = torch.arange(4.0 * world).reshape(1, 1, -1, 1)
    group = GROUPS["pair" if world == 2 else "all"]
    mine = shard(x, group=group)
    tokens = torch.arange(4 * world).reshape(1, -1)          # token ids [B, N]: dim 1
    back = shard(tokens, group=group, dim=1)
    return (mine.flatten().tolist(), torch.equal(unshard(mine, group=group), x),
            torch.equal(back.flatten(), mine.flatten().long()),
            torch.equal(unshard(back, group=group, dim=1), tokens))


def test_zigzag_layout(pool):
    res = pool.run(_layout, list(range(WORLD)), WORLD)
    # 8 chunks of 2: rank r holds chunks r and 7 - r
    assert [res[r][0] for r in range(WORLD)] == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                                 [6, 7, 8, 9]]
    assert all(all(r[1:]) for r in res.values())


def _valid_call(group):
    """A check that a valid call on `group` (GGD, causal, forward and backward) equals one
    process, output and dq: after a refused call, the group's next call runs."""
    mod = importlib.import_module("generated.generalized_gaussian")
    q, k, v, dout = _inputs(1, 2, 2, 8, 16, seed=6)
    params = mod.default_params(2)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    one = mod.attention(*whole, causal=True, **params)
    one.backward(dout)
    shards = [shard(t, group=group) for t in (q, k, v)]

    def check(after):
        ring = [t.clone().requires_grad_() for t in shards]
        out = unshard(ring_attention(mod, *ring, causal=True, group=group, **params), group=group)
        out.backward(dout)
        torch.testing.assert_close(out, one, rtol=1e-5, atol=1e-5, msg=f"after {after!r}")
        torch.testing.assert_close(_gather(ring[0].grad, group), whole[0].grad, rtol=1e-5, atol=1e-5,
                                   msg=f"after {after!r}")
    return check


def _pair_of_its_own(rank):
    """A 2-rank group no other test uses, with a short timeout: a message left in flight, or a
    rank left waiting, fails the test in seconds (new_group is called on every rank of the
    world; None on ranks 2 and 3)."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=10))
    return group if rank < 2 else None


def _refused_then_valid(rank):
    """On a pair of its own, every rank makes the same refused call, then a valid one."""
    group = _pair_of_its_own(rank)
    if group is None:
        return
    mod = importlib.import_module("generated.generalized_gaussian")
    params = mod.default_params(2)
    shards = [shard(t, group=group) for t in _inputs(1, 2, 2, 8, 16, seed=6)[:3]]
    valid = _valid_call(group)
    wide = [torch.randn(1, 2, 4, 300)] * 3
    refusals = [   # (q, k, v, call's keywords, the refusal)
        (*shards, dict(params, alpha=-1.0), "alpha must be positive"),
        (*shards, dict(params, alpha=float("nan")), "alpha must be positive"),
        (*(t.long() for t in shards), params, "q has dtype torch.int64"),
        (*wide, params, r"head dim \(q.shape\[3\]\) must be in 1..256"),
        (*(t.double() for t in shards), dict(params, backend="triton"), "backend='triton'"),
    ]
    for bad_q, bad_k, bad_v, kw, message in refusals:
        with pytest.raises(ValueError, match=message):
            ring_attention(mod, bad_q, bad_k, bad_v, group=group, **kw)
        valid(message)
    dist.destroy_process_group(group)


def test_refused_call_leaves_no_message_in_flight(pool):
    """A call that every rank refuses (a parameter outside its domain, an input the block API
    refuses: dtype, head dim, backend) raises before the ring posts a message: the next call
    on the group then runs, where the refused call's K/V transfer, left in flight, paired with
    the next call's messages (gloo timed out; NCCL would hang)."""
    pool.run(_refused_then_valid, list(range(WORLD)))


def _one_rank_refuses(rank, refusing, message):
    """What `rank` says when `refusing` refuses with `message` (a regex): its own message, or
    the message naming the refusing rank."""
    return "^" + ("" if rank == refusing else rf"rank {refusing} refused this call: ") + message


def _disagreements(rank, group):
    """(label, q, k, v, call's keywords, what this rank's ValueError says) for calls that one
    rank refuses, or whose shards differ between ranks 0 and 1."""
    mod = importlib.import_module("generated.generalized_gaussian")
    params = mod.default_params(2)
    q, k, v = (shard(t, group=group) for t in _inputs(1, 2, 2, 8, 16, seed=8)[:3])
    on_1 = rank == 1
    tokens = shard(torch.arange(8).reshape(1, 8), group=group, dim=1)          # rank 1: 2 .. 5
    apart = shard(torch.arange(8).reshape(1, 8) * 2**22 - 2**24, group=group, dim=1)
    same_shape = r": every rank passes shards of the same shape \(bamgen.distributed.shard\)$"
    return [
        ("integer positions past 2**24 on rank 1 only", q, k, v,
         dict(params, pos_q=tokens + 2**24 * on_1, pos_k=tokens),
         _one_rank_refuses(rank, 1, r"pos_q holds 16777221: integer positions must lie in")),
        ("a parameter outside its domain on rank 0 only", q, k, v,
         dict(params, alpha=-1.0 if rank == 0 else 1.0),
         _one_rank_refuses(rank, 0, "alpha must be positive")),
        ("a longer shard on rank 1", *(torch.cat([t, t[:, :, :2]], 2) if on_1 else t for t in (q, k, v)),
         params, r"^q's shard is \[1, 2, 4, 16\] on rank 0 but \[1, 2, 6, 16\] on rank 1" + same_shape),
        ("a larger batch on rank 1", *(torch.cat([t, t]) if on_1 else t for t in (q, k, v)),
         params, r"^q's shard is \[1, 2, 4, 16\] on rank 0 but \[2, 2, 4, 16\] on rank 1" + same_shape),
        ("fewer key/value heads on rank 1", q, *(t[:, :1] if on_1 else t for t in (k, v)), params,
         r"^k's shard \(and v's\) is \[1, 2, 4, 16\] on rank 0 but \[1, 1, 4, 16\] on rank 1"
         + same_shape),
        ("causal on rank 0 only", q, k, v, dict(params, causal=not on_1),
         "^causal is True on rank 0 but False on rank 1: every rank makes the same call$"),
        # rank 0 learns the prior (its backward would sum the parameters' gradients over the
        # group), rank 1 passes them detached: rank 0 waited in that all_reduce
        ("parameters that require grad on rank 0 only", q, k, v,
         {name: t.clone().requires_grad_(not on_1) for name, t in params.items()},
         r"^the gradients wanted are of the prior's parameters on rank 0 but none on rank 1: "
         r"every rank runs the backward"),
        # each rank's shard lies within 2**24, the whole sequence's distances do not
        ("integer distances past 2**24 across ranks", q, k, v, dict(params, pos_q=apart, pos_k=apart),
         r"^pos_q and pos_k \(-16777216..12582912, -16777216..12582912\): distances between "
         r"queries and keys reach 29360128, beyond 2\*\*24"),
    ]


def _refused_on_some_ranks_then_valid(rank):
    """On a pair of its own: calls that one rank refuses, or whose shards differ between the
    ranks, raise on both ranks (forward, and a backward that one rank refuses), then a valid
    call on the group equals one process."""
    group = _pair_of_its_own(rank)
    upper = dist.new_group([2, 3], timeout=timedelta(seconds=10))   # (made on every rank)
    if group is None:
        return _refused_on_a_subgroup(rank, upper)
    valid = _valid_call(group)
    for label, q, k, v, kw, says in _disagreements(rank, group):
        with pytest.raises(ValueError, match=says):
            ring_attention(importlib.import_module("generated.generalized_gaussian"), q, k, v,
                           group=group, **{"causal": True, **kw})
        valid(label)
    # both ranks learn the prior, only rank 0's q wants its gradient: both backwards run and
    # both sum the parameters' gradients, so the call runs (and the sums agree)
    ggd = importlib.import_module("generated.generalized_gaussian")
    learned = {name: t.clone().requires_grad_() for name, t in ggd.default_params(2).items()}
    q, k, v = (shard(t, group=group) for t in _inputs(1, 2, 2, 8, 16, seed=10)[:3])
    ring_attention(ggd, q.requires_grad_(rank == 0), k, v, causal=True, group=group,
                   **learned).sum().backward()
    grads = torch.stack([learned[name].grad for name in sorted(learned)])
    both = [torch.empty_like(grads) for _ in range(2)]
    dist.all_gather(both, grads, group=group)
    assert torch.equal(both[0], both[1])
    # a frozen parameter (bam's tm) written on rank 1 between the forward and the backward
    bam = importlib.import_module("generated.bam")
    params = bam.default_params(2)
    q, k, v = (shard(t, group=group).requires_grad_() for t in _inputs(1, 2, 2, 8, 16, seed=9)[:3])
    out = ring_attention(bam, q, k, v, causal=True, group=group, **params)
    if rank == 1:
        params["tm"].fill_(float("nan"))
    said = r"tm must be a real number and finite \(its domain in the prior file\), got nan"
    with pytest.raises(ValueError, match="^" + ("" if rank == 1 else
                                                "rank 1 refused this call's backward: ") + said):
        out.sum().backward()
    valid("a backward refused on rank 1")
    dist.destroy_process_group(group)


def _refused_on_a_subgroup(rank, group):
    """Global ranks 2 and 3 as ranks 0 and 1 of their group: the messages name both numbers."""
    mod = importlib.import_module("generated.generalized_gaussian")
    params = mod.default_params(2)
    shards = [shard(t, group=group) for t in _inputs(1, 2, 2, 8, 16, seed=6)[:3]]
    refused = "alpha must be positive"
    with pytest.raises(ValueError, match=refused if rank == 3 else
                       rf"^rank 1 \(global rank 3\) refused this call: {refused}"):
        ring_attention(mod, *shards, group=group, **dict(params, alpha=-1.0 if rank == 3 else 1.0))
    longer = [torch.cat([t, t[:, :, :2]], 2) if rank == 3 else t for t in shards]
    with pytest.raises(ValueError, match=r"^q's shard is \[1, 2, 4, 16\] on rank 0 \(global rank 2\) "
                                         r"but \[1, 2, 6, 16\] on rank 1 \(global rank 3\)"):
        ring_attention(mod, *longer, group=group, **params)
    _valid_call(group)("the refusals on ranks 2 and 3")
    dist.destroy_process_group(group)


def test_call_refused_on_some_ranks_raises_on_every_rank(pool):
    """The ranks agree on a call before the ring sends anything: a refusal on one rank only
    (integer positions past 2**24 or a parameter outside its domain in its shard alone, a
    frozen parameter written between forward and backward) raises a ValueError on every rank,
    the others naming the refusing rank and its reason; shards of different shapes, or calls
    with different settings, raise naming the ranks and their shapes. Before, the other ranks
    entered the ring and waited for messages never sent (gloo timed out, NCCL hung), and the
    group's next call paired its messages with theirs. On a sub-group (global ranks 2 and 3)
    the messages give both rank numbers. After each, a valid call on the group equals one
    process."""
    pool.run(_refused_on_some_ranks_then_valid, list(range(WORLD)))


def test_ssmax_n_counts_the_whole_row():
    """The block API counts n over the keys of the block, so two blocks merged by log-sum-exp
    differ from one call for a prior that uses n; the ring (here one process, two chunks, which
    are two blocks) corrects it and matches."""
    mod = importlib.import_module("generated.bam_ssmax")
    q, k, v, _ = _inputs(1, 4, 2, 16, 16, seed=3)
    params = {n: torch.tensor(vals) for n, vals in PRIORS["bam_ssmax"][3].items()}
    whole = mod.attention(q, k, v, **params, causal=True)
    from tests.runtime.test_blocks import merge
    parts = [mod.forward_block(q, k[:, :, a:b], v[:, :, a:b], **params, k_offset=a) for a, b in ((0, 8), (8, 16))]
    assert (merge(parts)[0] - whole).abs().max() > 1e-3         # per-block n: not the whole row's
    ring = ring_attention(mod, q, k, v, causal=True, **params)
    torch.testing.assert_close(ring, whole, rtol=1e-5, atol=1e-5)


def test_ring_second_derivatives_raise():
    """A gradient through the ring taken with create_graph=True cannot be differentiated again:
    it raises, as attention()'s does, where it came back as a constant (a silent 0)."""
    mod = importlib.import_module("generated.generalized_gaussian")
    q, k, v, _ = _inputs(1, 2, 2, 8, 16, seed=4)
    q.requires_grad_()
    out = ring_attention(mod, q, k, v, causal=True, **mod.default_params(2))
    g, = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="has no second derivative"):
        torch.autograd.grad(g.square().sum(), q)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ring_takes_autocast_s_dtype_as_attention_does(backend):
    """Under torch.autocast the ring casts q, k, v to its dtype, as mod.attention does: float32
    q and k (a float32 rotary table) beside bfloat16 v ran into a dtype error, and a model
    moved from attention() to the ring under autocast changed precision. Equal to attention()
    under the same autocast; the gradients come back in the inputs' dtype."""
    mod = importlib.import_module("generated.generalized_gaussian")
    q, k, v, dout = _inputs(1, 4, 2, 16, 16, seed=5)
    params = mod.default_params(4)
    q.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ring = ring_attention(mod, q, k, v.bfloat16(), causal=True, backend=backend, **params)
        whole = mod.attention(q, k, v, causal=True, backend=backend, **params)
    assert ring.dtype == whole.dtype == torch.bfloat16
    torch.testing.assert_close(ring, whole, rtol=0, atol=2 ** -7)
    ring.backward(dout.bfloat16())
    assert q.grad.dtype == torch.float32 and q.grad.isfinite().all()


def test_ring_attention_argument_errors():
    mod = importlib.import_module("generated.generalized_gaussian")
    q = torch.randn(1, 2, 8, 16)
    p = {n: t for n, t in mod.default_params(2).items()}
    with pytest.raises(ValueError, match="missing parameter.*'mu'"):
        ring_attention(mod, q, q, q, alpha=1.0, beta=1.0)
    with pytest.raises(ValueError, match="unknown parameter.*'gamma'"):
        ring_attention(mod, q, q, q, **p, gamma=1.0)
    with pytest.raises(ValueError, match="ring_attention does not take key_mask: pad N"):
        ring_attention(mod, q, q, q, **p, key_mask=torch.ones(1, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="ring_attention does not take q_offset"):
        ring_attention(mod, q, q, q, **p, q_offset=3)
    with pytest.raises(ValueError, match=r"alpha must be a float or a tensor of shape \[2\] \(one value per query head\)"):
        ring_attention(mod, q, q, q, **{**p, "alpha": torch.ones(3)})
    with pytest.raises(ValueError, match="not its nn.Module"):
        ring_attention(mod.GeneralizedGaussianAttention(2), q, q, q, **p)
    with pytest.raises(ValueError, match="shards of one sequence"):
        ring_attention(mod, q, q[:, :, :6], q[:, :, :6], **p)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        ring_attention(mod, q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16), **p)
    with pytest.raises(ValueError, match="causal must be"):
        ring_attention(mod, q, q, q, causal=1, **p)
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0.*length 8"):
        ring_attention(mod, q, q, q, cu_seqlens=torch.tensor([0, 3, 7]), **p)
    with pytest.raises(ValueError, match=r"cu_seqlens must be an int32 or int64 tensor"):
        ring_attention(mod, q, q, q, cu_seqlens=[0, 8], **p)
    with pytest.raises(ValueError, match=r"packed documents \(cu_seqlens\) take B = 1"):
        two = torch.randn(2, 2, 8, 16)
        ring_attention(mod, two, two, two, cu_seqlens=torch.tensor([0, 8]), **p)
    with pytest.raises(ValueError, match=r"positions 0 .. 16777217 .* pass 2\*\*24"):
        long = torch.zeros(1, 1, 1, 1).expand(1, 1, 2 ** 24 + 2, 1)   # (no memory: refused first)
        ring_attention(mod, long, long, long, **mod.default_params(1))
    # positions as tensors: they come together, in a shape attention() takes
    with pytest.raises(ValueError, match="pos_k is missing"):
        ring_attention(mod, q, q, q, pos_q=torch.zeros(1, 8), **p)
    with pytest.raises(ValueError, match=r"pos_q has shape \[1, 7\]"):
        ring_attention(mod, q, q, q, pos_q=torch.zeros(1, 7), pos_k=torch.zeros(1, 8), **p)
    grid = importlib.import_module("generated.alibi_2d")
    with pytest.raises(ValueError, match="pos_q is required.*2 position channels"):
        ring_attention(grid, q, q, q, **grid.default_params(2))


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
def test_quick_benchmark_runs():
    """benchmarks/distributed.py --quick: four gloo processes, every configuration, the table."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "distributed.py"), "--quick"],
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    for config in ("| one process |", "| ring W=1 |", "| ring W=2 |", "| ring W=4 |"):
        assert config in res.stdout, res.stdout
