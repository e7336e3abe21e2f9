"""The passkey-retrieval task: vocabulary and batch generation.

A sequence of N tokens is

    START  filler ... KEY d1 d2 d3 d4  filler ...  QUERY d1 d2 d3 d4

The filler is a fixed sentence looped from a random phase, so that it is predictable only
from nearby tokens; the passkey block (KEY and the digits) sits at a chosen depth of the
filler: depth 0 is right after START (the farthest from the question), depth 1 right
before QUERY. The model is asked to copy the digits after QUERY.
"""
from dataclasses import dataclass

import torch

SPECIAL = ["<start>", "<key>", "<query>"]
DIGITS = [str(i) for i in range(10)]
SENTENCE = ("the grass is green . the sky is blue . the sun is yellow . "
            "here we go . there and back again .").split()
FILLER_WORDS = sorted(set(SENTENCE), key=SENTENCE.index)
VOCAB = SPECIAL + DIGITS + FILLER_WORDS          # 3 + 10 + 16 = 29 tokens
TOKEN = {word: i for i, word in enumerate(VOCAB)}
START, KEY, QUERY = TOKEN["<start>"], TOKEN["<key>"], TOKEN["<query>"]
DIGIT0 = TOKEN["0"]
SENTENCE_IDS = torch.tensor([TOKEN[w] for w in SENTENCE])
PASSKEY_DIGITS = 4
BLOCK = 1 + PASSKEY_DIGITS                        # KEY d1..d4, and QUERY d1..d4
MIN_LENGTH = 1 + 2 * BLOCK + 1                    # START, both blocks, one filler token


def make_batch(batch, length, gen, depth=None):
    """A batch of passkey sequences [batch, length] (int64), the passkey digits [batch, 4] and
    the position of each sequence's KEY token.

    depth: None draws a depth uniformly in [0, 1] per sequence (training); a float puts every
    passkey at that depth (evaluation). gen: a torch.Generator, so batches are reproducible.
    """
    if length < MIN_LENGTH:
        raise ValueError(f"length must be at least {MIN_LENGTH}, got {length}")
    n_filler = length - 1 - 2 * BLOCK
    if depth is None:
        depths = torch.rand(batch, generator=gen)
    else:
        depths = torch.full((batch,), float(depth))
    key_pos = 1 + torch.round(depths * n_filler).long()          # in 1 .. n_filler + 1
    digits = torch.randint(0, 10, (batch, PASSKEY_DIGITS), generator=gen)
    phase = torch.randint(0, len(SENTENCE), (batch, 1), generator=gen)

    pos = torch.arange(length)[None, :].expand(batch, length)
    # Filler index of every position: positions after the passkey block skip its 5 tokens, so
    # the sentence continues across the block without a break.
    after = pos >= key_pos[:, None] + BLOCK
    filler_index = pos - 1 - BLOCK * after.long()
    seq = SENTENCE_IDS[(filler_index + phase) % len(SENTENCE)]

    seq[:, 0] = START
    rows = torch.arange(batch)
    seq[rows, key_pos] = KEY
    seq[:, length - BLOCK] = QUERY
    for t in range(PASSKEY_DIGITS):
        seq[rows, key_pos + 1 + t] = DIGIT0 + digits[:, t]
        seq[:, length - PASSKEY_DIGITS + t] = DIGIT0 + digits[:, t]
    return seq, digits, key_pos


def loss_weights(seq, key_pos):
    """Which next-token targets count in the language-model loss [batch, length - 1]: all but
    the passkey digits after KEY, which are random and would only add a constant ln(10)."""
    batch, length = seq.shape
    target_pos = torch.arange(1, length)[None, :]
    in_key = (target_pos > key_pos[:, None]) & (target_pos <= key_pos[:, None] + PASSKEY_DIGITS)
    return (~in_key).float()


def answer_positions(length):
    """Input positions whose next-token prediction is a passkey digit of the answer: QUERY and
    the first three answer digits (teacher forcing)."""
    first = length - BLOCK
    return torch.arange(first, first + PASSKEY_DIGITS)


def decode(seq):
    """The sequence as words, for eyeballing a sample."""
    return " ".join(VOCAB[i] for i in seq.tolist())


def packed_lengths(row_length, min_length, gen):
    """Document lengths, each in [min_length, row_length], that add up to exactly row_length.

    Each length is drawn uniformly from what the row still has room for; when the rest after
    a draw could not hold a valid document, the document takes the whole rest instead (so the
    last document of a row is somewhat longer on average than the others)."""
    if not MIN_LENGTH <= min_length <= row_length:
        raise ValueError(f"the shortest packed document must be between {MIN_LENGTH} and the "
                         f"row length {row_length} tokens, got {min_length}")
    lengths, rest = [], row_length
    while rest > 0:
        length = int(torch.randint(min_length, min(row_length, rest) + 1, (1,), generator=gen))
        if rest - length < min_length:
            length = rest
        lengths.append(length)
        rest -= length
    return lengths


@dataclass(frozen=True)
class PackedBatch:
    """Passkey documents packed into one sequence (B = 1), with what the loss needs.

    seq [1, N] int64; cu_seqlens [docs + 1] int32, the documents' cumulative lengths;
    key_pos [docs], each document's KEY position within it; loss_weights [N - 1], which
    next-token targets count in the language-model loss (loss_weights() per document, and 0
    for the target across a document boundary: the next document's START is not predictable
    from this one); answer_index [docs, 4], the input positions (in the packed sequence)
    whose next token is an answer digit."""
    seq: torch.Tensor
    cu_seqlens: torch.Tensor
    key_pos: torch.Tensor
    loss_weights: torch.Tensor
    answer_index: torch.Tensor


def make_packed_batch(rows, row_length, min_length, gen):
    """Passkey documents of random lengths (packed_lengths) packed into `rows` rows of exactly
    `row_length` tokens, all rows flattened into one packed sequence: the generated modules
    take packed documents with B = 1. Every document is a make_batch sample of its own length
    (passkey at a random depth, answer at its end)."""
    docs, keys, weights, answers, start = [], [], [], [], 0
    for _ in range(rows):
        for length in packed_lengths(row_length, min_length, gen):
            seq, _digits, key = make_batch(1, length, gen)
            docs.append(seq[0])
            keys.append(key)
            weights += [loss_weights(seq, key)[0], torch.zeros(1)]
            answers.append(start + answer_positions(length))
            start += length
    lengths = torch.tensor([len(d) for d in docs])
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    return PackedBatch(seq=torch.cat(docs)[None], cu_seqlens=cu_seqlens, key_pos=torch.cat(keys),
                       loss_weights=torch.cat(weights)[:-1], answer_index=torch.stack(answers))
