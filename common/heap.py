"""Keep the garbage collector's full collections short in long-running processes.

A leaf module (stdlib only), so every service may import it. A service holds a large,
long-lived heap from start-up on (torch and transformers modules, a tokenizer, a model's
Python objects), and CPython's full (generation 2) collection walks all of it: measured
in the running stack on the 2-core CPU, 100-270 ms per full collection in the worker,
the drafter and the router, each a stall of every stream the process serves. Once
start-up is over, `freeze_startup_heap` collects what start-up left behind and moves
every surviving object to the permanent generation (`gc.freeze`), which later
collections never walk, as vLLM does after its start-up. Objects made while serving are
collected as before, though less often: a serving process builds and drops thousands of objects
per step (the per-sequence contract values, outputs and events), and CPython's young generation,
collected every 700 net allocations, was collected many times a step. After start-up the young
threshold is YOUNG_COLLECTION_THRESHOLD.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


YOUNG_COLLECTION_THRESHOLD = 50_000
"""Net allocations between collections of the young generation once serving (CPython's default: 700). Garbage
without reference cycles is freed at once either way; cyclic garbage waits for at most this many allocations. On
the 2-core CPU (segserve bench engine --tiny, three alternated pairs), the output part of a step at batch 256
went from 1.48-1.50 ms to 1.32-1.36; at batch 64 the difference was within the noise."""


def freeze_startup_heap() -> int:
    """Collect, then exempt every object alive now from future collections, and collect the young generation less
    often from now on (YOUNG_COLLECTION_THRESHOLD); returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_COLLECTION_THRESHOLD), *older)
    num_frozen = gc.get_freeze_count()
    logger.debug("froze %d start-up objects out of the garbage collector's walks", num_frozen)
    return num_frozen
