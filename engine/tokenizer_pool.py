"""Copies of one tokenizer, lent one per concurrent user: tenants tokenize in parallel.

Why not one shared tokenizer behind a lock: a Hugging Face fast tokenizer is a Rust object that
``transformers`` reconfigures on every call (``encode`` sets ``encode_special_tokens``,
truncation and padding), and PyO3 answers a reconfiguration that meets a running call on
another thread with ``RuntimeError: Already borrowed``. A single engine-wide lock made that
safe but put every tenant behind whichever tenant was rendering: a 4,095-message chat render
(~1 s) held it, and another tenant's 3-word prompt, and the engine thread's detokenizing of
every running stream, waited for it (the audit's "one tokenizer lock" finding).

So each concurrent user borrows its own deep copy::

    borrow() ─► a free copy (or a new deepcopy of the pristine one) ─► encode / render / decode
            ◄─ returned to the free list on exit (no lock held while it is used)

Copies are made on demand and kept: their number is the peak number of threads tokenizing at
once (the gateway's tokenize workers, the engine's ``prepare_workers`` lane threads and its step
thread: a few), each the size of the tokenizer (tens of MB for a 100k vocabulary). The chat template's compiled
Jinja object is cached by ``transformers`` per template text and is safe to render from several
threads (every render has its own context). The Rust encoder releases the GIL, so two tenants'
encodes really run at the same time; a Jinja render is Python and shares the GIL.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

# Covariant: a pool of transformers tokenizers is a pool of what the engine needs of one
# (engine.llm_engine.TextCodec); a borrower only ever receives copies.
T = TypeVar("T", covariant=True)


class TokenizerPool(Generic[T]):
    """Lends private copies of ``tokenizer``; never lends ``tokenizer`` itself (its owner may
    still use it, e.g. to build the grammar vocabulary)."""

    def __init__(self, tokenizer: T) -> None:
        self._pristine = copy.deepcopy(tokenizer)  # only ever read, by deepcopy, under _copy_lock
        self._copy_lock = threading.Lock()
        self._free_lock = threading.Lock()
        self._free: list[T] = []
        self.copies = 0  # copies made so far (the peak number of concurrent borrowers)

    @contextmanager
    def borrow(self) -> Iterator[T]:
        """A copy for this thread alone until the block ends."""
        tok = self._take()
        try:
            yield tok
        finally:
            with self._free_lock:
                self._free.append(tok)

    def _take(self) -> T:
        with self._free_lock:
            if self._free:
                return self._free.pop()
        with self._copy_lock:  # the copy itself outside _free_lock: others keep borrowing meanwhile
            self.copies += 1
            return copy.deepcopy(self._pristine)
