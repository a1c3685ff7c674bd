"""What the signing tests share: ``PC_CHECKPOINT_KEY`` set (or unset) for
the length of a block, and the environment as it was afterwards."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from pc_train.signing import KEY_ENV


@contextlib.contextmanager
def key_env(value: str | None) -> Iterator[None]:
    """``PC_CHECKPOINT_KEY`` is ``value`` (unset for None) inside the block."""
    old = os.environ.pop(KEY_ENV, None)
    if value is not None:
        os.environ[KEY_ENV] = value
    try:
        yield
    finally:
        os.environ.pop(KEY_ENV, None)
        if old is not None:
            os.environ[KEY_ENV] = old
