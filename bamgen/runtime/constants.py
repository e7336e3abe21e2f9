"""Numbers every part of the runtime shares."""
LOG2E = 1.4426950408889634  # log2(e): softmax runs in base 2 (exp2) on both paths
FLOAT32_MAX = 3.4028234663852886e38  # derivatives are clamped to it (see tables.prior_tables)
TABLE_PAD = 256   # entries either side of a distance table, >= every GPU BLOCK_M and BLOCK_N
# Integer position tensors read a distance table (docs/positions.md, "Integer positions") when
# their distances span at most this many times the call's Nq + Nk; a wider span (positions far
# apart) is evaluated per score.
POSITION_TABLE_SPAN = 8
