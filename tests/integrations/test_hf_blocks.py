"""Queries in blocks that see both ways inside a causal call, cut into runs of bamgen's attention
(bamgen/integrations/hf_blocks.py); the models that hand such masks are tested in test_hf.py."""
import torch

import pytest
from bamgen.integrations.hf_blocks import Run, runs, seen_ranges


def hf_mask(blocks, length, window=None):
    """HF's mask for one row: causal OR (same block), AND the causal window overlay (a key
    more than window - 1 back hidden), as Gemma 3's sliding layers build it."""
    ids = torch.tensor(blocks)
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    seen = (k <= q) | ((ids[q] == ids[k]) & (ids[q] >= 0))
    if window is not None:
        seen &= k > q - window
    return seen[None]


def ranges_of(seen):
    real_q, real_k = torch.ones(seen.shape[:2], dtype=torch.bool), torch.ones(seen.shape[::2], dtype=torch.bool)
    return seen_ranges(seen, real_q, real_k, 0)


def test_a_block_runs_both_ways_within_the_window_and_sliced_beyond_it():
    """A block of 4 (queries 2..5) under a window of 3: the queries whose block end lies 3 or
    more keys ahead see exactly their keys (no window, keys sliced), the others the windowed
    prior over the keys up to the block's end; the text around, and the block's last query
    (which sees no key after it), run causal."""
    blocks = [-1, -1, 0, 0, 0, 0, -1, -1]
    got = runs(ranges_of(hf_mask(blocks, 8, window=3)), 0, window=3)
    assert got == [Run(slice(0, 2), slice(0, 2), True, True),
                   Run(slice(2, 3), slice(0, 6), False, False),
                   Run(slice(3, 5), slice(0, 6), False, True),
                   Run(slice(5, 8), slice(0, 8), True, True)]
    without_window = runs(ranges_of(hf_mask(blocks, 8)), 0, window=None)
    assert [run.rows for run in without_window] == [slice(0, 2), slice(2, 5), slice(5, 8)]


def test_keys_that_are_not_one_range_or_not_the_windows_are_refused():
    """A block that is not one run of tokens shows some query keys with a gap: no ranges (the
    integration refuses the call); a mask whose window is not the layer's: a ValueError."""
    assert ranges_of(hf_mask([0, 0, -1, 0], 4)) is None
    ranges = ranges_of(hf_mask([-1, 0, 0, -1, -1, -1], 6, window=2))
    with pytest.raises(ValueError, match=r"neither causal within the layer's window \(3\)"):
        runs(ranges, 0, window=3)
