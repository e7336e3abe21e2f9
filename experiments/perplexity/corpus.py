"""The corpus: the Python standard library's own source files, read as bytes.

Every machine with Python has it, nobody on this project wrote it, and it is read offline from
the running interpreter (`sysconfig.get_paths()["stdlib"]`). The split is fixed and documented:

* files: every `*.py` below the stdlib folder, skipping `site-packages`, `dist-packages` and
  `__pycache__` folders; named by their path relative to that folder, with `/` separators;
* held-out: a file whose relative path's SHA-256 (hex) read as an integer is 0 modulo 10 (about
  one file in ten; the rest train). The rule depends on the file name alone, so a file lands on
  the same side on every machine and in every Python version that ships it;
* streams: the files of each side joined in the order of that hash, each followed by one NUL
  byte (never in a source file) that marks the end of a document.

The vocabulary is the 256 byte values plus BOS (256), which starts every training window and
every evaluation chunk, so that every byte of a chunk is scored.
"""
import hashlib
import os
import platform
import sys
import sysconfig

import torch

BOS = 256
VOCAB_SIZE = 257
SEPARATOR = b"\x00"
HELD_OUT_EVERY = 10
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root():
    return sysconfig.get_paths()["stdlib"]


def _hash(relpath):
    return int(hashlib.sha256(relpath.encode("utf-8")).hexdigest(), 16)


def list_files(root=None):
    """Relative paths (with '/') of the stdlib's *.py files, sorted."""
    root = root or stdlib_root()
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), root)
                found.append(rel.replace(os.sep, "/"))
    return sorted(found)


def is_held_out(relpath):
    return _hash(relpath) % HELD_OUT_EVERY == 0


def split_files(files):
    """(train, held_out) lists of relative paths, each in the order of their hash."""
    ordered = sorted(files, key=_hash)
    return ([f for f in ordered if not is_held_out(f)], [f for f in ordered if is_held_out(f)])


def read_stream(root, files):
    """The files' bytes, each followed by SEPARATOR, as one uint8 tensor."""
    parts = []
    for rel in files:
        with open(os.path.join(root, rel), "rb") as f:
            parts.append(f.read())
        parts.append(SEPARATOR)
    data = b"".join(parts)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def load_corpus(root=None, max_files=None):
    """{'train': uint8 tensor, 'held_out': uint8 tensor, 'info': dict}: the two streams and what
    identifies them (Python version, folder, file and byte counts, SHA-256 of each stream).
    max_files keeps the first files of each side (the smoke test)."""
    root = root or stdlib_root()
    train_files, held_files = split_files(list_files(root))
    if max_files is not None:
        train_files, held_files = train_files[:max_files], held_files[:max_files]
    if not train_files or not held_files:
        raise SystemExit(f"no Python source files under {root}: is this a full Python install?")
    train, held = read_stream(root, train_files), read_stream(root, held_files)
    info = dict(python=platform.python_version(), implementation=platform.python_implementation(),
                executable=sys.executable, stdlib=root, split_rule=(
                    f"held out iff int(sha256(relative path), 16) % {HELD_OUT_EVERY} == 0"),
                train_files=len(train_files), held_out_files=len(held_files),
                train_bytes=int(train.numel()), held_out_bytes=int(held.numel()),
                train_sha256=hashlib.sha256(train.numpy().tobytes()).hexdigest(),
                held_out_sha256=hashlib.sha256(held.numpy().tobytes()).hexdigest(),
                held_out_first_files=held_files[:20])
    return dict(train=train, held_out=held, info=info)


def train_batch(stream, batch, length, gen):
    """Random windows of the training stream: input [batch, length] (BOS then length - 1 bytes)
    and target [batch, length] (the length bytes themselves), int64."""
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(length)[None, :]
    target = stream[idx].long()
    return with_bos(target), target


def with_bos(target):
    """Inputs for targets [B, L]: BOS, then the targets shifted right by one."""
    return torch.cat([torch.full_like(target[:, :1], BOS), target[:, :-1]], dim=1)


def piece_offsets(stream_bytes, total, piece):
    """Start offsets of total / piece pieces of `piece` bytes, evenly spaced from the start to
    the end of a stream of stream_bytes bytes."""
    if total % piece:
        raise ValueError(f"evaluation bytes ({total}) must be a multiple of the piece length ({piece})")
    if stream_bytes < total:
        raise SystemExit(f"the held-out stream has {stream_bytes} bytes, fewer than the "
                         f"{total} asked for (--eval-bytes)")
    count = total // piece
    stride = (stream_bytes - piece) // (count - 1) if count > 1 else 0
    return [i * stride for i in range(count)]


def eval_pieces(stream, total, piece):
    """The evaluated held-out bytes: contiguous pieces of `piece` bytes at evenly spaced offsets
    across the whole held-out stream (so they come from many files, not the first few), as
    [total / piece, piece] int64 targets."""
    return torch.stack([stream[o:o + piece] for o in piece_offsets(stream.numel(), total, piece)]).long()


def files_touched(stream, total, piece):
    """How many documents (NUL-terminated files) the evaluated pieces overlap."""
    ends = torch.nonzero(stream == SEPARATOR[0]).flatten()
    touched = set()
    for off in piece_offsets(stream.numel(), total, piece):
        first = int(torch.searchsorted(ends, off))
        last = int(torch.searchsorted(ends, off + piece - 1))
        touched.update(range(first, last + 1))
    return len(touched)


def eval_chunks(pieces, length):
    """The pieces cut into non-overlapping chunks of `length` bytes: [pieces * (piece / length),
    length]; every length scores the same bytes."""
    if pieces.shape[1] % length:
        raise ValueError(f"chunk length {length} does not divide the piece length {pieces.shape[1]}")
    return pieces.reshape(-1, length)
