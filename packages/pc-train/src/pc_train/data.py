"""``pc-train``'s data: a corpus as one stream of token ids, and the global
batch of each step drawn from it by (seed, step) alone, so every rank, a
single process and a resumed run all see the same batches in the same
order without any sampler state to save.

Corpora: the Python standard library's own sources (default: every
machine with Python has them, nothing is downloaded), a text file, a
directory of text files (``*.txt``, ``*.md``, ``*.py``, recursively), or a
``datasets`` directory written by ``save_to_disk`` (its ``text`` column).
Text becomes bytes (vocabulary 256) unless a tokenizer directory is given.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "batch_offsets",
    "corpus_bytes_available",
    "load_byte_corpus",
    "load_corpus",
    "load_tokenizer",
    "min_corpus_tokens",
    "split_corpus",
    "tokenizer_source",
    "windows",
]

_TEXT_SUFFIXES = ("*.txt", "*.md", "*.py")
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def _text_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    top = sorted(p for ext in _TEXT_SUFFIXES for p in root.glob(ext))
    return top or sorted(p for ext in _TEXT_SUFFIXES for p in root.rglob(ext))


def _dataset_texts(root: Path, limit: int) -> list[str]:
    try:
        import datasets  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        raise ValueError(
            f"corpus {str(root)!r} is a datasets directory; reading it needs the datasets "
            "package: pip install datasets."
        ) from None
    loaded: Any = datasets.load_from_disk(str(root))
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    if "text" not in loaded.column_names:
        raise ValueError(
            f"corpus {str(root)!r}: the data set has columns {loaded.column_names}; pc-train "
            "reads a 'text' column. Rename the column holding the text to 'text'."
        )
    texts, total = [], 0
    for row in loaded:
        texts.append(str(row["text"]))
        total += len(texts[-1])
        if total >= limit:
            break
    return texts


def load_corpus(source: str | None, limit: int, tokenizer: Any = None) -> torch.Tensor:
    """Up to ``limit`` bytes of text from ``source`` as a 1-D int64 tensor
    of token ids (bytes, or ``tokenizer``'s ids)."""
    root = Path(source) if source else Path(sysconfig.get_paths()["stdlib"])
    if not root.exists():
        raise ValueError(
            f"corpus {str(root)!r} does not exist; pass a text file, a directory of text "
            "files, or a datasets directory (save_to_disk)."
        )
    if root.is_dir() and any((root / marker).exists() for marker in _DATASET_MARKERS):
        text = "\n\n".join(_dataset_texts(root, limit)).encode()[:limit]
    else:
        chunks, total = [], 0
        for path in _text_files(root):
            data = path.read_bytes()[: limit - total]
            chunks.append(data)
            total += len(data)
            if total >= limit:
                break
        text = b"".join(chunks)
    if not text:
        raise ValueError(
            f"corpus {str(root)!r} holds no text (looked for {', '.join(_TEXT_SUFFIXES)})."
        )
    if tokenizer is None:
        return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    ids = tokenizer(text.decode(errors="replace"))["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def tokenizer_source(tokenizer: str | None, pretrained: Path | None) -> str | None:
    """The tokenizer to read the corpus with: ``--tokenizer``, else the
    pretrained model's directory when it holds one; None: bytes."""
    source = tokenizer
    files = ("tokenizer.json", "tokenizer_config.json")
    if source is None and pretrained is not None:
        source = str(pretrained) if any((pretrained / f).exists() for f in files) else None
    return source


def load_tokenizer(source: str | None) -> Any:
    """The tokenizer in directory ``source`` (None: none, the text is bytes)."""
    if source is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def corpus_bytes_available(source: str | None, limit: int) -> int | None:
    """The bytes :func:`load_corpus` would read from ``source`` (text
    files, measured by their sizes, read nothing); None for a datasets
    directory or a missing source (the load says why)."""
    root = Path(source) if source else Path(sysconfig.get_paths()["stdlib"])
    if not root.exists() or (
        root.is_dir() and any((root / marker).exists() for marker in _DATASET_MARKERS)
    ):
        return None
    total = 0
    for path in _text_files(root):
        try:
            total += path.stat().st_size
        except OSError:
            continue
        if total >= limit:
            return limit
    return total


def min_corpus_tokens(seq_len: int) -> int:
    """The shortest corpus a run of ``seq_len`` tokens per sequence takes:
    its last 5% (the held-out split) holds a sequence and its next token."""
    return 20 * (seq_len + 2)


def split_corpus(
    tokens: torch.Tensor, seq_len: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training part (the first 95%) and the held-out part of a corpus,
    checked: long enough for ``seq_len`` and within a vocabulary of
    ``vocab_size``. Raises ValueError with the fix."""
    least = min_corpus_tokens(seq_len)
    if len(tokens) < least:
        raise ValueError(
            f"the corpus holds {len(tokens):,} token(s); --seq-len {seq_len} needs at "
            f"least {least:,} (95% trains, 5% is held out, each longer than a sequence); "
            "pass a larger --corpus / --corpus-bytes or a shorter --seq-len."
        )
    if int(tokens.max()) >= vocab_size:
        raise ValueError(
            f"the tokenizer makes ids up to {int(tokens.max())}, beyond the model's "
            f"vocabulary ({vocab_size}); use a model with a matching vocabulary."
        )
    split = int(len(tokens) * 0.95)
    return tokens[:split], tokens[split:]


def load_byte_corpus(source: str | None, limit: int) -> torch.Tensor:
    """Up to ``limit`` bytes of ``source`` (default: the stdlib) as byte ids."""
    return load_corpus(source, limit)


def batch_offsets(seed: int, step: int, batch: int, seq_len: int, length: int) -> torch.Tensor:
    """Start positions of step ``step``'s global batch: a function of
    (seed, step) only, the same on every rank and after a resume."""
    if length <= seq_len + 1:
        raise ValueError(
            f"the corpus has {length} tokens, too few for sequences of {seq_len}; use a larger "
            "corpus or a shorter --seq-len."
        )
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, length - seq_len, (batch,), generator=gen)


def windows(tokens: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
    index = offsets[:, None] + torch.arange(seq_len)[None, :]
    return tokens[index]
