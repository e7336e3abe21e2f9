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

import dataclasses
import functools
import inspect
import types
from dataclasses import dataclass

import torch

from .hf_blocks import SeenRanges, seen_ranges


@dataclass(frozen=True)
class PaddingLayout:
    """What one attention call needs besides q, k, v: built once per forward by
    :func:`padding_layout` (HF's mask function) and handed to every layer as its
    ``attention_mask``.

    ``key_mask`` is None or bool [B, kv_length]; the offsets are ints (no padding) or int64
    tensors [B]. ``window`` is the sliding window HF built the mask with (its ``local_size``:
    a query sees the keys fewer than ``window`` tokens back), or None: some families put the
    window into the mask alone and pass none to attention (Qwen2-MoE, PhiMoE).
    ``window_inclusive``: HF built that window both ways with its own overlay
    (``sliding_window_bidirectional_overlay``), which shows the keys up to ``window`` tokens
    away either side, |q - k| <= window: one more than the causal window shows
    (:func:`window_inclusive`).
    ``seen``: where an or-rule lets some queries of an eager causal call see keys after them
    (``both_ways``: Gemma 3's and Gemma 4's image blocks, PaliGemma's prefix), the range of
    keys HF's mask shows each query, which bamgen runs as several calls
    (bamgen/integrations/hf_blocks.py); None where it is no such call, or compiled.
    """
    key_mask: torch.Tensor | None
    q_offset: int | torch.Tensor
    k_offset: int | torch.Tensor
    window: int | None = None
    window_inclusive: bool = False
    both_ways: bool = False   # the mask lets some keys after a query be seen (an or-rule)
    # The direction HF's mask gives the call (:func:`mask_direction`): True, causal (HF built
    # it on its causal rule and no rule OR-ed into it opens it both ways throughout); False,
    # both ways; None, its form does not tell (a compiled call's OR-ed or AND-ed rules).
    causal_rule: bool | None = None
    q_length: int | None = None   # the queries HF built the mask for (None: not known)
    seen: SeenRanges | None = None
    batch_size: int | None = None   # (with q_length and kv_length: :attr:`shape`)
    kv_length: int | None = None

    # HF's generate() builds the mask ahead of a static-cache forward, calls .contiguous() on it
    # and passes it back in as the model's attention_mask; these let it travel that way (ndim 4
    # so that HF does not take it for a 2-D token mask).
    ndim = 4

    def contiguous(self):
        return self

    @property
    def shape(self) -> tuple:
        """[B, 1, Nq, Nk], a 4-D mask's shape. A multimodal model that hands its language model
        the mask it built as one mask (PaliGemma's) has HF build it again there, which reads
        the keys' count from it when there is no cache (``use_cache=False``: training,
        generate() without a cache); every such forward failed (no attribute 'shape')."""
        return (self.batch_size, 1, self.q_length, self.kv_length)

    def __getitem__(self, index):
        """The layout of some of the call's queries, as HF slices a 4-D mask's query rows
        (``mask[:, :, rows, :]``): Gemma 4 keeps only the last ``logits_to_keep`` queries
        before its KV-shared layers, which read the keys of earlier layers whole. The queries
        kept start ``rows.start`` later; the keys, and so ``key_mask``, are the same."""
        rows = _query_rows(index)
        if rows is None or self.q_length is None:
            raise ValueError(f"attention_mask: bamgen's padding layout takes a slice of its query "
                             f"rows alone (mask[:, :, start:stop, :], with its number of queries "
                             f"known: {self.q_length}), got the index {index!r}; run the layers "
                             f"on every query, or with another attention implementation")
        start, stop, _ = rows.indices(self.q_length)
        seen = None if self.seen is None else self.seen.rows(start, stop)
        return dataclasses.replace(self, q_offset=self.q_offset + start,
                                   q_length=max(stop - start, 0), seen=seen)


def _query_rows(index) -> slice | None:
    """The slice of query rows that a 4-D mask's ``index`` takes, every batch row, head and key
    kept; None for any other index."""
    whole = slice(None)
    if not (isinstance(index, tuple) and len(index) == 4 and isinstance(index[2], slice)):
        return None
    if index[0] != whole or index[1] != whole or index[3] != whole or index[2].step not in (None, 1):
        return None
    return index[2]


def padding_layout(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                   attention_mask: torch.Tensor | PaddingLayout | None = None,
                   local_size: int | None = None, mask_function=None,
                   allow_is_bidirectional_skip=None, **_unused) -> PaddingLayout:
    """The mask function bamgen registers with HF's ``AttentionMaskInterface``: HF calls it
    with the sizes of the cache (``q_offset`` may be a 0-d tensor for a static cache), the
    2-D token mask, if any, and a sliding window's size as ``local_size``; its bidirectional
    builders alone pass ``allow_is_bidirectional_skip``."""
    if isinstance(attention_mask, PaddingLayout):
        return attention_mask   # built by generate() for this very step
    layout = _padding_layout(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask)
    if torch.compiler.is_compiling():
        # the rule's tokens are data a graph may not branch on, and dynamo reads no function's
        # closures: only the mask function's form, an OR of rules or not, or HF's plain rules
        both_ways, causal_rule = _is_or_mask(mask_function), _plain_direction(mask_function)
    else:
        grid = MaskGrid(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask)
        both_ways = _or_rule(mask_function) and grid.sees_ahead(mask_function)
        causal_rule = mask_direction(mask_function, grid, both_ways)
        if causal_rule is False:
            layout = _every_key_masked(layout, attention_mask, batch_size, int(kv_offset), kv_length)
        elif both_ways:   # (causal, blocks of queries that see both ways: run by blocks)
            layout = dataclasses.replace(layout, seen=grid.seen_ranges(mask_function))
    inclusive = window_inclusive(mask_function, local_size, allow_is_bidirectional_skip is not None)
    return dataclasses.replace(layout, window=local_size or None, window_inclusive=inclusive,
                               both_ways=both_ways, causal_rule=causal_rule, q_length=q_length,
                               batch_size=batch_size, kv_length=kv_length)


def _every_key_masked(layout: PaddingLayout, attention_mask, batch_size: int, kv_start: int,
                      kv_length: int) -> PaddingLayout:
    """``layout`` with a key mask over every key, for a call HF's mask makes both ways: a static
    cache's slots past the last written one, which the causal rule hides (and the plain layout
    leaves to it), would be seen; HF's mask hides them by the token mask."""
    if layout.key_mask is not None or not isinstance(attention_mask, torch.Tensor):
        return layout
    keys = _token_mask(attention_mask, batch_size, kv_start + kv_length)[:, kv_start:]
    return layout if bool(keys.all()) else dataclasses.replace(layout, key_mask=keys)


def window_inclusive(mask_function, local_size: int | None, bidirectional_builder: bool) -> bool:
    """Whether HF built the mask's window of ``local_size`` with its bidirectional overlay
    (``sliding_window_bidirectional_overlay``: |q - k| <= W), not the causal one (the keys
    fewer than W back). Why: the same W shows one key more each way in the bidirectional
    overlay, which HF's eager attention follows (a decoder made bidirectional by is_causal,
    Mistral's, Gemma 4's ``use_bidirectional_attention="all"``), while a family's own overlay
    may count it as the causal one does (EmbeddingGemma's, |q - k| < W). Read from the mask
    function on an eager call; a compiled call cannot read its closures, and reads which
    builder made it (HF's bidirectional ones alone pass ``allow_is_bidirectional_skip``, and
    the sliding one alone a window with it)."""
    if not local_size:
        return False
    if torch.compiler.is_compiling():
        return bidirectional_builder
    from transformers.masking_utils import sliding_window_bidirectional_overlay
    return _built_on(mask_function, sliding_window_bidirectional_overlay(local_size))


def _plain_direction(mask_function) -> bool | None:
    """The direction of HF's plain causal or bidirectional mask function, compared by identity
    (which dynamo reads); None for any other (rules OR-ed or AND-ed into one of them)."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function
    if mask_function is causal_mask_function:
        return True
    return False if mask_function is bidirectional_mask_function else None


def mask_direction(mask_function, grid: "MaskGrid", both_ways: bool) -> bool | None:
    """The direction HF's mask gives an eager call, read from its mask function: causal where
    it is built on HF's causal rule (``causal_mask_function``, a window or packing AND-ed over
    it), unless a rule OR-ed into it makes it the same both ways (each of two tokens sees the
    other or neither: EmbeddingGemma's overlay, within its window and its packed documents;
    PaliGemma's prefix when the whole call is prefix); both ways where it is built on HF's
    bidirectional rule; None where it is neither.

    Why: a family may make its layers bidirectional (``is_causal=False``) and keep the causal
    rule in the mask alone (PaliGemma's Gemma: ``use_bidirectional_attention``, its causal
    mask OR-ed with the prefix), which HF's eager attention follows. A rule OR-ed into the
    causal mask that opens only some keys ahead stays causal, with ``both_ways``: its blocks
    run both ways (``PaddingLayout.seen``)."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function
    if _built_on(mask_function, causal_mask_function):
        return not (both_ways and grid.symmetric(mask_function))
    return False if _built_on(mask_function, bidirectional_mask_function) else None


def _is_or_mask(function) -> bool:
    """Whether ``function`` is one that HF's ``or_masks`` returned (compared by its code, which
    dynamo reads, unlike its name). HF ORs a rule that comes from the inputs in last
    (``block_sequence_ids``: Gemma 3's image tokens, PaliGemma's prefix), so a compiled call
    whose inputs carry one is found by it, and refused, text alone included; a rule inside a
    window (Gemma 3's sliding layers) is found on the call's other masks
    (:func:`mark_handed_masks`)."""
    from transformers.masking_utils import or_masks
    return getattr(function, "__code__", None) is or_masks(bool).__code__


def _inner_functions(mask_function) -> list:
    """The functions ``mask_function`` closes over (the rules HF's ``or_masks``, ``and_masks``
    and packing wrappers combine)."""
    inner = []
    for cell in mask_function.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        values = value if isinstance(value, tuple) else (value,)
        inner += [v for v in values if isinstance(v, types.FunctionType)]
    return inner


def _built_on(mask_function, rule, depth: int = 0) -> bool:
    """Whether HF's mask function ``rule`` is ``mask_function`` or one of the rules it
    combines, read from its closures (compared by code: an overlay HF builds for each window
    is a new function of the same code)."""
    if not isinstance(mask_function, types.FunctionType) or depth > 8:
        return False
    if mask_function is rule or mask_function.__code__ is rule.__code__:
        return True
    return any(_built_on(f, rule, depth + 1) for f in _inner_functions(mask_function))


def _or_rule(mask_function, depth: int = 0) -> bool:
    """Whether HF's mask function ORs the causal rule with another (``or_masks``: Gemma 3's
    image tokens attending both ways within an image, a bidirectional overlay), read from its
    closures: such a mask lets a query see keys after it, which a causal call cannot give."""
    if not isinstance(mask_function, types.FunctionType) or depth > 8:
        return False
    inner = _inner_functions(mask_function)
    if _is_or_mask(mask_function):
        if any(f.__qualname__ != "causal_mask_function" for f in inner):
            return True
    return any(_or_rule(f, depth + 1) for f in inner)


@dataclass(frozen=True)
class MaskGrid:
    """An eager call's (batch, query, key) grid, on which HF's mask function is evaluated as
    HF's SDPA mask evaluates it, and its real pairs: a query and a key that are no padding
    (``attention_mask``), whose outputs and weights the mask decides (padding is hidden by
    ``key_mask``, and a padding query's output is unused)."""
    batch_size: int
    q_length: int
    kv_length: int
    q_offset: object
    kv_offset: object
    attention_mask: torch.Tensor | None

    def sees_ahead(self, mask_function) -> bool:
        """Whether an OR-ed mask lets some real query of this call see a real key after it
        (Gemma 3's processor gives every prompt token_type_ids, so its overlay is there for
        text alone, where no token is in an image and the mask is causal). True (refuse) where
        the mask cannot be evaluated so."""
        seen = self._seen(mask_function)
        if seen is None:
            return True
        query, key = self._positions()
        return bool((seen & (key > query) & self._real_pairs()).any())

    def symmetric(self, mask_function) -> bool:
        """Whether the mask is the same both ways over the real tokens that are queries and keys
        alike (each of two sees the other or neither): bidirectional attention, whose window and
        packed documents bamgen takes from the call itself. False where it cannot be evaluated,
        or no token is both."""
        seen = self._seen(mask_function)
        q_start, kv_start = int(self.q_offset), int(self.kv_offset)
        start = max(q_start, kv_start)
        end = min(q_start + self.q_length, kv_start + self.kv_length)
        if seen is None or end <= start:
            return False
        rows, cols = slice(start - q_start, end - q_start), slice(start - kv_start, end - kv_start)
        square, real = seen[:, rows, cols], self._real_pairs()[:, rows, cols]
        return bool(((square == square.transpose(1, 2)) | ~real).all())

    def seen_ranges(self, mask_function) -> SeenRanges | None:
        """The range of real keys the mask shows each real query (hf_blocks.SeenRanges), or
        None where it cannot be evaluated or some query's keys are not one range."""
        seen = self._seen(mask_function)
        if seen is None:
            return None
        queries, keys = self._real_tokens()
        return seen_ranges(seen, queries, keys, int(self.q_offset) - int(self.kv_offset))

    def _positions(self):
        device = self._device()
        q_start, kv_start = int(self.q_offset), int(self.kv_offset)
        query = torch.arange(q_start, q_start + self.q_length, device=device)[None, :, None]
        key = torch.arange(kv_start, kv_start + self.kv_length, device=device)[None, None, :]
        return query, key

    def _device(self):
        mask = self.attention_mask
        return mask.device if isinstance(mask, torch.Tensor) else "cpu"

    def _seen(self, mask_function) -> torch.Tensor | None:
        """The mask function over the grid (bool [B, Nq, Nk]), or None where it fails there."""
        device = self._device()
        batch = torch.arange(self.batch_size, device=device)[:, None, None]
        query, key = self._positions()
        try:
            seen = mask_function(batch, torch.zeros((), dtype=torch.long, device=device), query, key)
            return seen.expand(self.batch_size, self.q_length, self.kv_length)
        except (IndexError, RuntimeError, TypeError, AttributeError):
            return None

    def _real_pairs(self) -> torch.Tensor:
        """bool [B, Nq, Nk]: the pairs of a real query and a real key (all, without a mask)."""
        queries, keys = self._real_tokens()
        return queries[:, :, None] & keys[:, None, :]

    def _real_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(bool [B, Nq], bool [B, Nk]): the real queries and keys (all, without a mask)."""
        if not isinstance(self.attention_mask, torch.Tensor):
            device = self._device()
            return (torch.ones(self.batch_size, self.q_length, dtype=torch.bool, device=device),
                    torch.ones(self.batch_size, self.kv_length, dtype=torch.bool, device=device))
        q_start, kv_start = int(self.q_offset), int(self.kv_offset)
        slots = max(q_start + self.q_length, kv_start + self.kv_length)
        tokens = _token_mask(self.attention_mask, self.batch_size, slots)
        return (tokens[:, q_start:q_start + self.q_length],
                tokens[:, kv_start:kv_start + self.kv_length])


def install_mask_marking(model) -> None:
    """Register (once) :func:`mark_handed_masks` on ``model`` and on every transformers model
    inside it, as a forward pre-hook that sees the call's keyword arguments."""
    for module in transformers_models(model):
        if mark_handed_masks not in module._forward_pre_hooks.values():
            module.register_forward_pre_hook(mark_handed_masks, with_kwargs=True)


def mark_handed_masks(model, args, kwargs):
    """A forward pre-hook on the masks a model is handed ready-made (a layout, or one per layer
    type) by a multimodal model around it, which built them for its language model. Returns
    the call with its layouts marked, or None to leave it as it is; a Python-level decision on
    static facts, so a compiled forward keeps one graph.

    - Compiled, an or-rule one of them carries is carried by all. Why: HF builds Gemma 3's
      sliding layers' mask as the window AND the or-rule, whose rule a compiled call cannot see
      (:func:`_is_or_mask`), while its global layers' mask, built in the same call, shows it;
      a model of sliding layers alone would run its images causal, silently. The rule is the
      inputs' (an image's tokens), so every causal layer refuses the call. Gemma 4 ORs it into
      its sliding layers' mask alone, which a compiled call tells by its missing window
      (:func:`_window_over_rule`). An eager call evaluates each mask's own rule (and runs its
      blocks: Gemma 4's global layers stay causal), so nothing is carried there.
    - One whose form does not tell its direction (a compiled call: :func:`_plain_direction`)
      is causal: the model around built it with HF's causal mask and its rules (PaliGemma's
      prefix, OR-ed in; a window or packing, AND-ed), and a compiled PaliGemma, whose Gemma
      layers say bidirectional, ran both ways, silently. A model that builds its own mask
      (EmbeddingGemma's overlay that opens every key) is not handed one: its layers decide."""
    masks = kwargs.get("attention_mask")
    named = masks if isinstance(masks, dict) else {None: masks}
    layouts = [mask for mask in named.values() if isinstance(mask, PaddingLayout)]
    if not layouts:
        return None
    spread = torch.compiler.is_compiling() and (any(layout.both_ways for layout in layouts)
                                                or _window_over_rule(named))
    if all((layout.both_ways or not spread) and layout.causal_rule is not None
           for layout in layouts):
        return None
    marked = {name: _marked(mask, spread) for name, mask in named.items()}
    return args, {**kwargs, "attention_mask": marked if isinstance(masks, dict) else marked[None]}


def _window_over_rule(named: dict) -> bool:
    """Whether a compiled call is handed a mask for its sliding layers that carries no window
    of HF's own (``local_size``). HF's sliding masks carry it (text alone); a multimodal model
    builds one without it where it ANDs the window over an or-rule itself: Gemma 3's and Gemma
    4's when the inputs mark images (``create_masks_for_vision_model``: AND(window, OR(causal,
    image blocks))), whose rule a compiled call cannot see under the AND. Gemma 3's global
    layers' mask shows it; Gemma 4's is plain causal, and a compiled Gemma 4 ran its images
    causal, silently. (An AND of rules is no sign of its own: HF wraps every mask so for
    packed documents, under torch.compile whenever a call has no 2-D mask and no cache.)"""
    sliding = named.get("sliding_attention")
    return (torch.compiler.is_compiling() and isinstance(sliding, PaddingLayout)
            and sliding.window is None)


def _marked(mask, spread: bool):
    if not isinstance(mask, PaddingLayout):
        return mask
    causal_rule = True if mask.causal_rule is None else mask.causal_rule
    return dataclasses.replace(mask, both_ways=mask.both_ways or spread, causal_rule=causal_rule)


def _padding_layout(batch_size, q_length, kv_length, q_offset, kv_offset,
                    attention_mask) -> PaddingLayout:
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


MARKERS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")   # besides restarting position_ids


def packed_documents(layout: PaddingLayout, query, key, kwargs) -> tuple | None:
    """(cu_seqlens_q, cu_seqlens_k) for documents packed into one row, from whichever form HF
    passes them in (DataCollatorWithFlattening's options: ``cu_seq_lens_q``/``cu_seq_lens_k``,
    ``seq_idx``, or ``position_ids`` restarting at each document); None for an ordinary batch.
    Each document then sees only itself, its positions from 0. No branch on the data under
    torch.compile (docs/huggingface.md, "torch.compile")."""
    plain = (layout.key_mask is None and isinstance(layout.q_offset, int) and layout.q_offset == 0
             and query.shape[2] == key.shape[2])
    cu_q, cu_k, seq_idx = (kwargs.get(name) for name in MARKERS)
    if cu_q is not None or cu_k is not None or seq_idx is not None:
        _check_packed(plain, query.shape[0], cu_q, cu_k)
        if cu_q is not None:
            return cu_q.to(torch.int32), cu_k.to(torch.int32)
        cu = _seq_idx_bounds(seq_idx, query.shape[2])
        return cu, cu
    position_ids = kwargs.get("position_ids")
    if position_ids is None or not plain:
        return None
    cu = _position_bounds(position_ids, query.shape[0], query.shape[2])
    return None if cu is None else (cu, cu)


def _check_packed(plain: bool, batch: int, cu_q, cu_k) -> None:
    """Packed documents by cu_seq_lens or seq_idx: one row, no padding, no cache."""
    if (cu_q is None) != (cu_k is None):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k come together (the collator's "
                         "return_flash_attn_kwargs=True gives both)")
    if not plain or batch != 1:
        raise ValueError(f"cu_seq_lens_q / seq_idx: packed documents are taken in one row "
                         f"(batch size 1, got {batch}) with no attention_mask and no "
                         f"cache, as DataCollatorWithFlattening makes them")


def _seq_idx_bounds(seq_idx, length: int) -> torch.Tensor:
    """cu_seqlens from seq_idx (each token's document, one row): a document starts where the
    index changes."""
    return _bounds(seq_idx[0, 1:] != seq_idx[0, :-1], length)


def _position_bounds(position_ids, batch: int, length: int) -> torch.Tensor | None:
    """cu_seqlens from position_ids that restart at each document, or None where they mark
    none (an ordinary sequence). Under torch.compile nothing branches on the data: one row
    always gets its bounds, [0, N, N, ...] when nothing restarts (one document), and a batch of
    rows is taken as ordinary sequences (eager calls check it)."""
    starts = position_ids[:, 1:] - position_ids[:, :-1] != 1
    rows = max(batch, position_ids.shape[0])
    if torch.compiler.is_compiling():
        return _bounds(starts[0], length) if rows == 1 else None
    if not bool(starts.any()):
        return None
    if rows != 1:
        raise ValueError(f"position_ids: documents packed into a batch of {rows} rows; "
                         f"bamgen's attention takes packed documents in one row (batch size "
                         f"1), as FlashAttention's varlen does")
    return torch.unique_consecutive(_bounds(starts[0], length))   # (no empty documents)


def _bounds(starts, length: int) -> torch.Tensor:
    """cu_seqlens int32 [length + 1] from starts (bool [length - 1]: token t + 1 begins a new
    document): 0, the starts in order, then length repeated (empty documents). Its size
    follows the length alone, so a compiled graph holds for any packing."""
    index = torch.arange(1, length, device=starts.device)
    cut = torch.where(starts, index, torch.full_like(index, length)).sort().values
    ends = torch.tensor([0, length], device=starts.device)
    return torch.cat([ends[:1], cut, ends[1:]]).to(torch.int32)


def install_document_markers(model) -> None:
    """Register (once) the forward pre-hook :func:`mark_documents` on ``model`` and on every
    transformers model inside it (a causal LM may call an inner one directly: OPT's calls its
    decoder, not its base model).

    Why: a packed row's documents reach attention only if the family's own code passes the
    collator's marker on, and some drop one: Persimmon's attention drops ``position_ids``,
    GPT-BigCode's model does not pass them to its layers, StableLM's decoder layer drops
    ``seq_idx`` and ``cu_seq_lens``. Families with absolute position embeddings (GPT-2,
    GPT-BigCode, OPT, BioGPT) also need ``position_ids`` to number each document from 0. The
    hook hands the model both forms, so whichever one a family passes on carries the documents.
    It keeps no state (it only adds keyword arguments), so torch.compile traces it like the
    rest of the forward: no graph break, no guard of its own."""
    for module in transformers_models(model):
        hooks = module._forward_pre_hooks.values()
        if not any(getattr(hook, "func", None) is mark_documents for hook in hooks):
            _register_marker_hook(module)


def transformers_models(model):
    """``model`` and every transformers model inside it: each may be called on its own (a
    causal LM's base model, OPT's decoder)."""
    from transformers import PreTrainedModel
    return [module for module in model.modules()
            if module is model or isinstance(module, PreTrainedModel)]


def install_read_scope(model) -> None:
    """Register (once) on ``model`` the hooks that keep what its layers' attention calls read of
    their shared layout on the host for the rest of its forward (runtime/host_reads.py: on a GPU
    a left-padded or packed forward then waits once, not once a layer)."""
    from ..runtime.host_reads import ReadScope
    if any(isinstance(getattr(hook, "__self__", None), ReadScope)
           for hook in model._forward_pre_hooks.values()):
        return
    scope = ReadScope()
    model.register_forward_pre_hook(scope.enter)
    model.register_forward_hook(scope.leave, always_call=True)


def _register_marker_hook(module) -> None:
    """The hook, told the forward's parameter names once here (the call may pass some by
    position), so that it inspects nothing while it runs."""
    parameters = inspect.signature(module.forward).parameters.values()
    names = tuple(p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    module.register_forward_pre_hook(functools.partial(mark_documents, names, takes_kwargs),
                                     with_kwargs=True)


def mark_documents(names: tuple, takes_kwargs: bool, module, args, kwargs):
    """A model's forward pre-hook (``names``: its forward's positional parameters;
    ``takes_kwargs``: whether it takes more). A packed call (no cache, no padding) gets the
    markers it lacks: restarting ``position_ids`` from ``cu_seq_lens_q`` or ``seq_idx``, and
    ``cu_seq_lens_q/k`` from restarting ``position_ids``. Returns the call with them added (as
    keyword arguments), or None to leave it as it is."""
    if len(args) > len(names):
        return None
    call = {**dict(zip(names, args)), **kwargs}
    added = _missing_markers(call)
    if not all(takes_kwargs or name in names for name in added):
        return None   # (a forward that cannot take them: the call as it was)
    return ((), {**call, **added}) if added else None


def _missing_markers(call: dict) -> dict:
    """The markers a call lacks, computed from the one it has (an empty dict if none)."""
    tokens = call.get("input_ids")
    tokens = call.get("inputs_embeds") if tokens is None else tokens
    if tokens is None:
        return {}
    batch, length = tokens.shape[0], tokens.shape[1]
    cu_q, cu_k, seq_idx = (call.get(name) for name in MARKERS)
    position_ids = call.get("position_ids")
    if cu_q is not None or cu_k is not None or seq_idx is not None:
        _check_packed(_packed_format(call), batch, cu_q, cu_k)
        if position_ids is not None:
            return {}
        bounds = cu_q if cu_q is not None else _seq_idx_bounds(seq_idx, length)
        return {"position_ids": _restarting_positions(bounds, length)}
    if position_ids is None or not _packed_format(call):
        return {}
    bounds = _position_bounds(position_ids, batch, length)
    return {} if bounds is None else {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds}


def _packed_format(call: dict) -> bool:
    """No cache, and no attention_mask or (eager) one without padding: HF's packed format."""
    mask = call.get("attention_mask")
    if call.get("past_key_values") is not None:
        return False
    return mask is None or (not torch.compiler.is_compiling() and isinstance(mask, torch.Tensor)
                            and mask.dim() == 2 and bool(mask.all()))


def _restarting_positions(bounds, length: int) -> torch.Tensor:
    """position_ids [1, length] that restart at 0 at each document's start (``bounds``:
    cu_seqlens, empty documents allowed)."""
    bounds = bounds.to(torch.int64)
    tokens = torch.arange(length, device=bounds.device)
    document = torch.searchsorted(bounds, tokens, right=True) - 1
    return (tokens - bounds[document]).unsqueeze(0)
