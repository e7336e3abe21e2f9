"""What the CPU path's forward and backward share: tiles, worker threads, the call's parts
(documents, runs of batch rows with the same offsets), positions, padding and dead rows."""
from __future__ import annotations

import math
import threading

import torch

from ..tables import acc_dtype

TORCH_BLOCK_M = 128           # generic path tile: query rows
TORCH_BLOCK_N = 512           # generic path tile: keys
TORCH_TABLE_FWD_BLOCK = 512   # table path: query rows per fused-kernel call (causal)
TORCH_TABLE_BLOCK_M = 256     # table path backward tile: query rows
TORCH_TABLE_BLOCK_N = 512     # table path backward tile: keys
TORCH_INLINE_SCORES = 1 << 18  # below this many scores no worker threads are started
TORCH_FUSED_MAX_LSE = 64.0     # table path: above this |log-sum-exp| the fused kernel's is redone
try:
    FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
except (AttributeError, RuntimeError):  # an older torch: the generic forward is used instead
    FLASH_CPU = None


def tile_entries(tables, h0, h1, G, Nq, i0, i1, j0, j1):
    """The [h1 - h0, G, i1 - i0, j1 - j0] entries of each table at the distances of a tile
    (entry m of a table holds d = dmax - m: the tile's are (Nq - 1 - i) + j)."""
    idx = (Nq - 1 - torch.arange(i0, i1, device=tables[0].device))[:, None] \
        + torch.arange(j0, j1, device=tables[0].device)[None, :]
    return [t[h0 * G:h1 * G].reshape(h1 - h0, G, -1)[..., idx] for t in tables]


def positions(i0, i1, j0, j1, q_offset, k_offset, counts, causal, device, dtype=torch.float32,
              clamp=False):
    """Position tiles (exact integers up to 2**24 in float32) and the visibility mask of one block;
    counts: n of this batch row's queries (_row_key_counts). clamp (PriorTraits.clamp_positions):
    the positions a formula sees are those of real tokens, a padding token's negative one read as
    0 (d from the positions so read); visibility follows the positions as they are."""
    i_abs = torch.arange(i0 + q_offset, i1 + q_offset, device=device, dtype=dtype)[:, None]
    j_abs = torch.arange(j0 + k_offset, j1 + k_offset, device=device, dtype=dtype)[None, :]
    visible = j_abs <= i_abs if causal else None
    pos_n = counts[i0:i1, None].to(dtype)
    if clamp:
        i_abs, j_abs = i_abs.clamp_min(0), j_abs.clamp_min(0)
    return i_abs - j_abs, i_abs, j_abs, pos_n, visible


def tensor_positions(pos, b, h0, h1, G, i0, i1, j0, j1):
    """(pos_d, pos_i, pos_j) of one block from position tensors (docs/positions.md): pos =
    (pos_q [B, Hq, Nq, C], pos_k [B, Hq, Nk, C]); KV heads h0..h1 of batch row b, each of its G
    query heads with its own positions. Tiles [h1 - h0, G, rows, 1] and [.., 1, keys]; with
    several channels, a tuple of C such tiles each (the hooks read pos_d[c])."""
    pq, pk = pos
    n = h1 - h0
    rows = pq[b, h0 * G:h1 * G, i0:i1].reshape(n, G, i1 - i0, 1, -1)
    cols = pk[b, h0 * G:h1 * G, j0:j1].reshape(n, G, 1, j1 - j0, -1)
    if rows.shape[-1] == 1:
        pos_i, pos_j = rows[..., 0], cols[..., 0]
        return pos_i - pos_j, pos_i, pos_j
    pos_i = tuple(rows[..., c] for c in range(rows.shape[-1]))
    pos_j = tuple(cols[..., c] for c in range(cols.shape[-1]))
    return tuple(a - b_ for a, b_ in zip(pos_i, pos_j)), pos_i, pos_j


def key_limit(i1, n_keys, causal, q_offset, k_offset):
    """One past the last key any query row < i1 can see."""
    if not causal:
        return n_keys
    return max(0, min(n_keys, i1 - 1 + q_offset - k_offset + 1))


def run_items(items, fn, scores):
    """fn(item) for every item, on up to torch.get_num_threads() worker threads, each with one
    intra-op thread (torch releases the GIL inside an op) and denormals flushed to zero; inline
    in the caller's thread when there are fewer than TORCH_INLINE_SCORES scores in all (a decode
    step, say), where starting threads would cost more than it saves.

    Why threads: each torch op is an OpenMP parallel region, and on a shared machine a region
    stalls until its last thread is scheduled again; independent single-threaded workers pulling
    items from a queue do not wait for each other. Why flush-to-zero: exp2 of a very negative
    number (a masked or far-away score) takes a microcode assist per element otherwise, 5-10x
    slower. Both settings are per thread, so the caller's thread is left as it was.
    Returns the results in item order."""
    if scores < TORCH_INLINE_SCORES:
        with torch.no_grad():
            return [fn(item) for item in items]
    threads = max(1, torch.get_num_threads())
    results = [None] * len(items)
    errors = []
    pending = list(range(len(items)))[::-1]
    lock = threading.Lock()

    def worker():
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
        with torch.no_grad():
            while True:
                with lock:
                    if not pending or errors:
                        return
                    n = pending.pop()
                try:
                    results[n] = fn(items[n])
                except BaseException as err:  # re-raised in the caller
                    errors.append(err)
                    return

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(min(threads, len(items)))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    torch.set_num_threads(threads)  # a worker's set_num_threads(1) also set the default for new threads
    if errors:
        raise errors[0]
    return results


def work_items(B, Hk, G, blocks):
    """Work items (b, first KV head, end KV head, query block starts) and whether two items may
    share a head: chunks of at most two query heads' worth of KV heads when there are enough
    heads for the threads (items disjoint), otherwise interleaved query blocks of one head
    (balanced under a causal mask)."""
    threads = max(1, torch.get_num_threads())
    if B * Hk >= threads:
        step = max(1, min(2 // G, (B * Hk) // (2 * threads)))
        return [(b, h, min(Hk, h + step), blocks) for b in range(B) for h in range(0, Hk, step)], False
    parts = max(1, min(threads, len(blocks)))
    return [(b, h, h + 1, blocks[t::parts]) for b in range(B) for h in range(Hk) for t in range(parts)], True


def gather_items(items, shared, run, add, scores):
    """Run the items. Disjoint items (no head in common) accumulate straight into the outputs:
    run(item, False). Items that share heads accumulate into private buffers, run(item, True)
    returns them and add(item, *buffers) sums them in item order, so that the result does not
    depend on thread timing."""
    if not shared:
        run_items(items, lambda item: run(item, False), scores)
        return
    for item, partials in zip(items, run_items(items, lambda item: run(item, True), scores)):
        add(item, *partials)


def call_parts(B, Nq, Nk, q_offset, k_offset, cu_seqlens_q, cu_seqlens_k):
    """The independent calls one call splits into on the CPU path, each with int offsets:
    (b0, b1, i0, i1, j0, j1, q_offset, k_offset) for the batch rows b0..b1, queries i0..i1 and
    keys j0..j1. One per document (packed: positions restart in each), one per run of batch rows
    with the same offsets (offsets given per row), or the whole call."""
    if cu_seqlens_q is not None:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        return [(0, 1, cq[d], cq[d + 1], ck[d], ck[d + 1], 0, 0) for d in range(len(cq) - 1)]
    if not (isinstance(q_offset, torch.Tensor) or isinstance(k_offset, torch.Tensor)):
        return [(0, B, 0, Nq, 0, Nk, q_offset, k_offset)]
    qo = torch.as_tensor(q_offset).expand(B).tolist()
    ko = torch.as_tensor(k_offset).expand(B).tolist()
    parts, b0 = [], 0
    for b in range(1, B + 1):
        if b == B or (qo[b], ko[b]) != (qo[b0], ko[b0]):
            parts.append((b0, b, 0, Nq, 0, Nk, qo[b0], ko[b0]))
            b0 = b
    return parts


def doc_bucket(length):
    """A document's length rounded up for batching: to a multiple of a quarter of the next power
    of two and of 16, so a batch pads a document by less than half its length or 15 tokens."""
    step = max(16, (1 << max(length - 1, 0).bit_length()) // 4)
    return -(-length // step) * step


class DocGroup:
    """Packed documents of similar lengths, run as one batch: each document padded at its end to
    the batch's lengths (Lq, Lk). Padding keys come after a document's keys, so no query of the
    document sees them under the causal rule unless the document has more queries than keys or
    the call is not causal: key_mask then hides them (and carries the user's key_mask)."""

    def __init__(self, spans, Lq, Lk, key_mask):
        self.spans, self.L, self.key_mask = spans, (Lq, Lk), key_mask

    def gather(self, t, side, fill=None):
        """[docs, H, L, ...] from a packed [1, H, N, ...] tensor (side 0: queries, 1: keys)."""
        out = t.new_zeros((len(self.spans), t.shape[1], self.L[side]) + tuple(t.shape[3:]))
        if fill is not None:
            out[:] = fill
        for r, span in enumerate(self.spans):
            a, b = span[2 * side], span[2 * side + 1]
            out[r, :, :b - a] = t[0, :, a:b]
        return out

    def scatter(self, t, batch, side):
        for r, span in enumerate(self.spans):
            a, b = span[2 * side], span[2 * side + 1]
            t[0, :, a:b] = batch[r, :, :b - a]


def doc_groups(parts, causal, key_mask, device):
    """The packed documents of a call (call_parts; empty ones left out: their rows stay 0)
    grouped by bucketed lengths (doc_bucket): one call per group instead of one per
    document, whose fixed costs (a distance table, the work items) dominate short documents."""
    by_shape = {}
    for _, _, i0, i1, j0, j1, _, _ in parts:
        if i1 > i0 and j1 > j0:
            by_shape.setdefault((doc_bucket(i1 - i0), doc_bucket(j1 - j0)), []).append(
                (i0, i1, j0, j1))
    groups = []
    for (Lq, Lk), spans in sorted(by_shape.items()):
        # a document's padding keys are visible to its queries unless the causal rule hides them
        pad_visible = [(j1 - j0 < Lk) and (not causal or i1 - i0 > j1 - j0) for i0, i1, j0, j1 in spans]
        km = None
        if key_mask is not None or any(pad_visible):
            km = torch.zeros(len(spans), Lk, dtype=torch.bool, device=device)
            for r, (i0, i1, j0, j1) in enumerate(spans):
                km[r, :j1 - j0] = True if key_mask is None else key_mask[0, j0:j1]
        groups.append(DocGroup(spans, Lq, Lk, km))
    return groups


def masks_nothing(Nk, causal, q_offset, k_offset):
    """True when every query row sees every key (not causal, or causal with the first row past
    the last key: a decode step, a chunk after its cache): no score is masked, so a NaN cannot
    reach a row that does not see it, and the inputs need no scan (inputs_finite)."""
    return not causal or q_offset - k_offset >= Nk - 1


def inputs_finite(q, k):
    """The distance-table path adds its bias, -inf where a key is masked, to q.k: a NaN or inf in
    q or k would turn a masked score into NaN and spread to rows that never see that key. With
    such inputs (one pass over q and k finds them) it replaces masked scores instead."""
    return bool(torch.isfinite(q).all()) and bool(torch.isfinite(k).all())


def hide_padding(k, v, key_mask):
    """k and v with the padding keys (key_mask False) read as 0: a padding key's weight is 0, and
    0 * NaN would carry a NaN stored there (uninitialised memory) into every row."""
    if key_mask is None:
        return k, v
    pad = ~key_mask[:, None, :, None]
    return k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)


def quiet_dead_rows(q, dout, out, v, stats):
    """q, dout, out and v such that the rows that see no key (l = 0: padding queries, rows before
    the first key, rows whose every visible key has a log-prior of -inf) contribute exactly 0,
    as they must, where a non-finite value would otherwise leak: 0 * NaN in dK = dS^T q or
    dV = P^T dO carries a NaN stored in q or dO into every key's gradient, and a NaN in v reaches
    dS = P * (dO v^T - delta) of a dead row as 0 * NaN. Such a row's q, dO and O read as 0, and
    v's non-finite entries as 0: a live row that weighs such a key has a non-finite O, hence a
    non-finite delta, and stays poisoned, as the forward's output says. (A row whose logits are
    NaN, a NaN in its q, may carry l = 0 beside m = NaN: it is poisoned, not dead: row_terms.)"""
    dead = (stats[..., 1] == 0) & ~torch.isnan(stats[..., 0])
    if not bool(dead.any()) or (bool(torch.isfinite(q).all()) and bool(torch.isfinite(dout).all())
                                and bool(torch.isfinite(v).all())):
        return q, dout, out, v
    dead = dead[..., None]
    return (q.masked_fill(dead, 0.0), dout.masked_fill(dead, 0.0), out.masked_fill(dead, 0.0),
            torch.where(torch.isfinite(v), v, torch.zeros_like(v)))


def row_terms(dout, out, stats, B, Hk, G, Nq):
    """Per row: m (0 for an empty row), 1 / l (0 for an empty row) and delta = rowsum(dO * O),
    each [B, Hk, G, Nq]. The backward works with E = exp2(z - m) and dO / l, delta / l, so that
    dV = E^T (dO / l) and dS = E * ((dO / l) v^T - delta / l) need no pass to divide E by l.
    A row that a NaN reached (a NaN or +inf logit: its l is NaN, or m is NaN or +inf) gets m = +inf, 1 / l = 1
    and delta = 0, as the Triton kernels read it (_bwd_row_stats): E and dS are 0 at every key
    whose logit is a number or -inf and NaN where it is NaN or +inf, so the row poisons the keys
    that poisoned it and no other (docs/reliability.md, "Non-finite inputs")."""
    m, l = stats[..., 0].reshape(B, Hk, G, Nq), stats[..., 1].reshape(B, Hk, G, Nq)
    poisoned = torch.isnan(m) | torch.isnan(l) | (m == math.inf)
    m = torch.where(poisoned, math.inf, torch.where(torch.isinf(m), torch.zeros_like(m), m))
    inv_l = torch.where(l == 0, torch.zeros_like(l), 1.0 / torch.where(l == 0, torch.ones_like(l), l))
    inv_l = torch.where(poisoned, 1.0, inv_l)
    cdt = acc_dtype(out)
    delta = (dout.to(cdt) * out).sum(-1).reshape(B, Hk, G, Nq)
    return m, inv_l, torch.where(poisoned, 0.0, delta * inv_l)


def param_columns(theta, h0, h1, G):
    """theta [Hq, P] -> a list of P tensors [h1 - h0, G, 1, 1] (KV heads h0..h1 of one item)."""
    return [theta[h0 * G:h1 * G, p].reshape(h1 - h0, G, 1, 1) for p in range(theta.shape[1])]


def table_tile(Nq, Nk, G):
    """Backward (and exact forward) tile: G * BM query rows (the GQA group is folded into the
    GEMMs' rows) by BN keys."""
    return min(max(64, TORCH_TABLE_BLOCK_M // G), Nq), min(TORCH_TABLE_BLOCK_N, Nk)


def empty_stats(B, Hk, G, Nq, device, dtype):
    """Statistics of rows that see no key: m = -inf, l = 0."""
    stats = torch.zeros(B, Hk, G, Nq, 2, dtype=dtype, device=device)
    stats[..., 0] = -math.inf
    return stats
