"""Keep the garbage collector's full collections short in long-running processes.

A leaf module (stdlib only), so every service may import it. A service holds a large,
long-lived heap from start-up on (torch and transformers modules, a tokenizer, a model's
Python objects), and CPython's full (generation 2) collection walks all of it: measured
in the running stack on the 2-core CPU, 100-270 ms per full collection in the worker,
the drafter and the router, each a stall of every stream the process serves. Once
start-up is over, `freeze_startup_heap` collects what start-up left behind and moves
every surviving object to the permanent generation (`gc.freeze`), which later
collections never walk, as vLLM does after its start-up. Objects made while serving are
collected as before.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect, then exempt every object alive now from future collections; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    num_frozen = gc.get_freeze_count()
    logger.debug("froze %d start-up objects out of the garbage collector's walks", num_frozen)
    return num_frozen
