"""Hugging Face's padding and cache geometry, turned into bamgen's masks and per-row positions.

HF describes a batch with a 2-D ``attention_mask`` of tokens (1 = real, 0 = padding, over every
token seen so far) and the cache's sizes: the queries start at slot ``q_start`` of the cache and
the keys handed to attention are slots ``kv_start .. kv_start + kv_length`` (a static cache
hands all of its ``max_cache_len`` slots, written or not). bamgen wants positions instead
(docs/masks.md): a row's positions start at 0 at its first real token, so a left-padded row
with ``pad`` padding tokens has ``q_offset = q_start - pad`` and ``k_offset = kv_start - pad``,
and its padding keys are hidden by ``key_mask``. Slots past the last written one are hidden by
the causal rule (their positions lie after every query), so unwritten static-cache slots are
never seen, and ``n`` counts only the real keys.

Documents packed into one row (HF's packed format, as ``DataCollatorWithFlattening`` makes it)
are the other geometry: :func:`packed_documents` reads their bounds from whichever marker the
call carries, as bamgen's ``cu_seqlens_q/k``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PaddingLayout:
    """What one attention call needs besides q, k, v: built once per forward by
    :func:`padding_layout` (HF's mask function) and handed to every layer as its
    ``attention_mask``.

    ``key_mask`` is None or bool [B, kv_length]; the offsets are ints (no padding) or int64
    tensors [B].
    """
    key_mask: torch.Tensor | None
    q_offset: int | torch.Tensor
    k_offset: int | torch.Tensor

    # HF's generate() builds the mask ahead of a static-cache forward, calls .contiguous() on it
    # and passes it back in as the model's attention_mask; these let it travel that way (ndim 4
    # so that HF does not take it for a 2-D token mask).
    ndim = 4

    def contiguous(self):
        return self


def padding_layout(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                   attention_mask: torch.Tensor | PaddingLayout | None = None,
                   **_unused) -> PaddingLayout:
    """The mask function bamgen registers with HF's ``AttentionMaskInterface``: HF calls it
    with the sizes of the cache (``q_offset`` may be a 0-d tensor for a static cache) and the
    2-D token mask, if any."""
    if isinstance(attention_mask, PaddingLayout):
        return attention_mask   # built by generate() for this very step
    q_start = int(q_offset)
    kv_start = int(kv_offset)
    query_end = q_start + q_length
    if attention_mask is None:
        return PaddingLayout(None, q_start, kv_start)
    tokens = _token_mask(attention_mask, batch_size, kv_start + kv_length)
    key_mask = tokens[:, kv_start:kv_start + kv_length]
    pad = _left_padding(tokens)
    if torch.compiler.is_compiling():
        # no branch on the data in a compiled graph: the general layout (per-row offsets and
        # the key mask), right with or without padding
        return PaddingLayout(key_mask, q_start - pad, kv_start - pad)
    if not bool(pad.any()):
        if bool(key_mask[:, :min(kv_length, max(query_end - kv_start, 0))].all()):
            key_mask = None   # no padding among the keys any query can see: the plain kernels
        return PaddingLayout(key_mask, q_start, kv_start)
    return PaddingLayout(key_mask, q_start - pad, kv_start - pad)


def _token_mask(attention_mask: torch.Tensor, batch_size: int, slots: int) -> torch.Tensor:
    """HF's 2-D mask as bool [B, slots]: cut or padded with False (a static cache has more slots
    than tokens seen)."""
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size:
        raise ValueError(f"attention_mask: bamgen takes Hugging Face's 2-D padding mask "
                         f"[batch, tokens] (1 = real token, 0 = padding), got shape "
                         f"{tuple(attention_mask.shape)}; pass the tokenizer's attention_mask")
    mask = attention_mask.to(torch.bool)
    if mask.shape[1] < slots:
        mask = torch.nn.functional.pad(mask, (0, slots - mask.shape[1]), value=False)
    return mask[:, :slots]


def _left_padding(tokens: torch.Tensor) -> torch.Tensor:
    """Padding tokens before each row's first real token (int64 [B])."""
    return (~tokens).to(torch.int64).cumprod(dim=1).sum(dim=1)


def packed_documents(layout: PaddingLayout, query, key, kwargs) -> tuple | None:
    """(cu_seqlens_q, cu_seqlens_k) for documents packed into one row, from whichever form HF
    passes them in (DataCollatorWithFlattening's options: ``cu_seq_lens_q``/``cu_seq_lens_k``,
    ``seq_idx``, or ``position_ids`` restarting at each document); None for an ordinary batch.
    Each document then sees only itself, its positions from 0. No branch on the data under
    torch.compile (docs/huggingface.md, "torch.compile")."""
    plain = (layout.key_mask is None and isinstance(layout.q_offset, int) and layout.q_offset == 0
             and query.shape[2] == key.shape[2])
    cu_q, cu_k, seq_idx = (kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"))
    if cu_q is not None or cu_k is not None or seq_idx is not None:
        _check_packed(plain, query, cu_q, cu_k)
        if cu_q is not None:
            return cu_q.to(torch.int32), cu_k.to(torch.int32)
        starts = seq_idx[0, 1:] != seq_idx[0, :-1]       # a token whose document is new
        cu = _bounds(starts, query.shape[2])
        return cu, cu
    position_ids = kwargs.get("position_ids")
    if position_ids is None or not plain:
        return None
    starts = position_ids[:, 1:] - position_ids[:, :-1] != 1
    if torch.compiler.is_compiling():
        # one row: the bounds, [0, N, N, ...] when nothing restarts (one document); a batch of
        # rows is taken as ordinary sequences (eager calls check it)
        one_row = position_ids.shape[0] == 1 and query.shape[0] == 1
        return (_bounds(starts[0], query.shape[2]),) * 2 if one_row else None
    if not bool(starts.any()):
        return None
    if position_ids.shape[0] != 1:
        raise ValueError(f"position_ids: documents packed into a batch of "
                         f"{position_ids.shape[0]} rows; bamgen's attention takes packed "
                         f"documents in one row (batch size 1), as FlashAttention's varlen does")
    cu = torch.unique_consecutive(_bounds(starts[0], query.shape[2]))   # (no empty documents)
    return cu, cu


def _check_packed(plain, query, cu_q, cu_k) -> None:
    """Packed documents by cu_seq_lens or seq_idx: one row, no padding, no cache."""
    if (cu_q is None) != (cu_k is None):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k come together (the collator's "
                         "return_flash_attn_kwargs=True gives both)")
    if not plain or query.shape[0] != 1:
        raise ValueError(f"cu_seq_lens_q / seq_idx: packed documents are taken in one row "
                         f"(batch size 1, got {query.shape[0]}) with no attention_mask and no "
                         f"cache, as DataCollatorWithFlattening makes them")


def _bounds(starts, length: int) -> torch.Tensor:
    """cu_seqlens int32 [length + 1] from starts (bool [length - 1]: token t + 1 begins a new
    document): 0, the starts in order, then length repeated (empty documents). Its size
    follows the length alone, so a compiled graph holds for any packing."""
    index = torch.arange(1, length, device=starts.device)
    cut = torch.where(starts, index, torch.full_like(index, length)).sort().values
    ends = torch.tensor([0, length], device=starts.device)
    return torch.cat([ends[:1], cut, ends[1:]]).to(torch.int32)
