"""Blocks of queries that attend both ways inside a causal call (Gemma 3's and Gemma 4's image
tokens, PaliGemma's prefix), run as several calls of bamgen's attention.

Such a family ORs a rule into HF's causal mask: a query in a block (an image's tokens, a
prefix) also sees every key of its block, so query i sees the keys j <= max(i, the block's
last key), within the layer's window where it has one. bamgen's kernels take one rule per call
(causal or not), so a batch row's queries are cut into runs, each one call: a run of queries
that see causally runs causal; a block's queries run both ways over the keys up to the block's
last one. Every call keeps the row's positions (its offsets grow by where the run and its keys
start), so d = i - j and the padding (``key_mask``) are those of the whole sequence, and the
outputs, concatenated, are what one call with HF's mask would give; gradients flow through the
slices and the concatenation.

Where a layer has a sliding window ``W`` (HF's rule: a key more than ``W - 1`` back is hidden,
keys ahead are not), a block's queries run the layer's windowed prior (``|d| < W``) over the
keys up to the block's end, which is HF's rule wherever the block's end lies fewer than ``W``
keys ahead of the query; a query farther from it runs the prior without the window over exactly
the keys it sees. The mask HF built is read once a forward (:class:`SeenRanges`, in
bamgen/integrations/hf_layout.py's ``MaskGrid``), and each call checks that its runs show
every query those keys: a rule of another form is refused. docs/huggingface.md, "Masks".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .hf_variants import LayerExtras

CAUSAL, WINDOWED_BLOCK, SLICED_BLOCK = 0, 1, 2   # how a query runs (:func:`query_kinds`)


@dataclass(frozen=True)
class SeenRanges:
    """The keys an eager call's mask lets each real query see, where they are the real keys of
    one range of key columns: ``low`` and ``high`` (int64 [B, Nq]; ``low = Nk`` and ``high =
    -1`` for a padding query, which sees none), the real queries and keys (bool [B, Nq] and
    [B, Nk]), and ``diagonal``, the key column of query 0's own slot (the columns of the
    cache's slots are ``diagonal`` behind the queries' rows)."""
    low: torch.Tensor
    high: torch.Tensor
    real_query: torch.Tensor
    real_key: torch.Tensor
    diagonal: int

    def rows(self, start: int, stop: int) -> "SeenRanges":
        """The ranges of query rows ``start:stop`` (HF slices a mask's query rows so: Gemma 4's
        KV-shared layers)."""
        return SeenRanges(self.low[:, start:stop], self.high[:, start:stop],
                          self.real_query[:, start:stop], self.real_key, self.diagonal + start)


def seen_ranges(seen: torch.Tensor, real_query: torch.Tensor, real_key: torch.Tensor,
                diagonal: int) -> SeenRanges | None:
    """The :class:`SeenRanges` of ``seen`` (bool [B, Nq, Nk], HF's mask over the call's grid),
    or None where some real query sees real keys that are not one range (a rule these runs
    cannot give: refused)."""
    seen = seen & real_query[:, :, None] & real_key[:, None, :]
    keys = seen.shape[-1]
    if keys == 0:
        return None
    cols = torch.arange(keys, device=seen.device)
    high = torch.where(seen, cols, -1).amax(-1)
    low = torch.where(seen, cols, keys).amin(-1)
    one_range = real_key[:, None, :] & (cols >= low[..., None]) & (cols <= high[..., None])
    if not bool((one_range == seen).all()):
        return None
    return SeenRanges(low, high, real_query, real_key, diagonal)


@dataclass(frozen=True)
class Run:
    """One call of a batch row: its query rows, key columns, direction, and whether it runs the
    layer's own prior, its window included (else the prior without the window)."""
    rows: slice
    keys: slice
    causal: bool
    with_window: bool


def attend_by_runs(attend, extras: LayerExtras, query, key, value, call: dict,
                   ranges: SeenRanges) -> torch.Tensor:
    """bamgen's attention over a causal call with blocks of queries that see both ways: each
    batch row cut into :func:`runs`, each run one call of ``attend(extras, q, k, v, **call)``
    (the layer's prior, under ``extras`` or those without the window); [B, Hq, Nq, D]."""
    batch = query.shape[0]
    q_offsets, k_offsets = _per_row(call["q_offset"], batch), _per_row(call["k_offset"], batch)
    unwindowed = LayerExtras(None, extras.softcap)
    rows = []
    for b in range(batch):
        parts = []
        for run in runs(ranges, b, extras.sliding_window):
            key_mask = call["key_mask"]
            parts.append(attend(
                extras if run.with_window else unwindowed,
                query[b:b + 1, :, run.rows], key[b:b + 1, :, run.keys], value[b:b + 1, :, run.keys],
                causal=run.causal, scale=call["scale"], q_offset=q_offsets[b] + run.rows.start,
                k_offset=k_offsets[b] + run.keys.start,
                key_mask=None if key_mask is None else key_mask[b:b + 1, run.keys]))
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)


def _per_row(offset, batch: int) -> list[int]:
    """A layout's offset (an int, or int64 [B]) as one int per batch row."""
    if isinstance(offset, torch.Tensor) and offset.dim() > 0:
        return [int(x) for x in offset.tolist()]
    return [int(offset)] * batch


def runs(ranges: SeenRanges, b: int, window: int | None) -> list[Run]:
    """Batch row ``b``'s queries cut into runs of one call each: consecutive queries that run
    alike (:func:`query_kinds`); a ValueError where a query's keys are not what its run shows."""
    kinds, diagonal = query_kinds(ranges, b, window), ranges.diagonal
    low, high = ranges.low[b], ranges.high[b]
    block_end = torch.where(kinds == CAUSAL, -1, high)
    block_start = torch.where(kinds == SLICED_BLOCK, low, -1)
    change = ((kinds[1:] != kinds[:-1]) | (block_end[1:] != block_end[:-1])
              | (block_start[1:] != block_start[:-1]))
    starts = [0] + (change.nonzero().flatten() + 1).tolist() + [kinds.shape[0]]
    found, keys = [], ranges.real_key.shape[1]
    for start, stop in zip(starts[:-1], starts[1:]):
        kind = int(kinds[start])
        if kind == CAUSAL:   # (the keys up to the last query's own slot)
            last = min(keys, max(1, diagonal + stop))
            found.append(Run(slice(start, stop), slice(0, last), True, True))
        else:
            first = int(low[start]) if kind == SLICED_BLOCK else 0
            found.append(Run(slice(start, stop), slice(first, int(high[start]) + 1), False,
                             kind == WINDOWED_BLOCK))
    return found


def query_kinds(ranges: SeenRanges, b: int, window: int | None) -> torch.Tensor:
    """How each query of batch row ``b`` runs (int64 [Nq]): CAUSAL where it sees no key after
    its own; in a block, WINDOWED_BLOCK (both ways, the layer's window, the keys up to the
    block's end) where the layer has no window or that end lies fewer than ``window`` keys
    ahead, else SLICED_BLOCK (both ways, no window, exactly its keys). Checked against the keys
    HF's mask shows it: a ValueError where they differ (a rule of another form)."""
    low, high, real = ranges.low[b], ranges.high[b], ranges.real_query[b]
    own = ranges.diagonal + torch.arange(low.shape[0], device=low.device)   # its own key column
    block = real & (high > own)
    reach = torch.full_like(own, -1) if window is None else own - window + 1   # the window's
    windowed = block if window is None else block & (high - own < window)
    kinds = torch.where(windowed, WINDOWED_BLOCK, torch.where(block, SLICED_BLOCK, CAUSAL))
    first_seen = _next_real(ranges.real_key[b], reach)
    last_causal = _last_real(ranges.real_key[b], own)
    shown = torch.where(kinds == CAUSAL, (low == first_seen) & (high == last_causal),
                        (kinds == SLICED_BLOCK) | (low == first_seen))
    if not bool((shown | ~real).all()):
        raise ValueError(f"attention_mask: its rule OR-ed into the causal mask lets a query see "
                         f"keys that are neither causal within the layer's window "
                         f"({window}) nor its block's up to the block's last one (query rows "
                         f"{(~shown & real).nonzero().flatten().tolist()[:8]} of batch row "
                         f"{b}), which bamgen's attention does not model; use inputs whose "
                         f"blocks (token_type_ids, mm_token_type_ids) are runs of tokens")
    return kinds


def _next_real(real_key: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The first real key column at or after each of ``columns`` (Nk where none)."""
    keys = real_key.shape[0]
    cols = torch.arange(keys, device=real_key.device)
    following = torch.where(real_key, cols, keys).flip(0).cummin(0).values.flip(0)
    found = following[columns.clamp(0, keys - 1)]
    return torch.where(columns > keys - 1, keys, found)


def _last_real(real_key: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The last real key column at or before each of ``columns`` (-1 where none)."""
    keys = real_key.shape[0]
    cols = torch.arange(keys, device=real_key.device)
    preceding = torch.where(real_key, cols, -1).cummax(0).values
    found = preceding[columns.clamp(0, keys - 1)]
    return torch.where(columns < 0, -1, found)
