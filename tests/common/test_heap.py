"""common.heap: start-up objects leave the collector's walks; garbage and later objects do not, and the young
generation is collected less often, but still on its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# In a child process: the freeze is process-wide and would change every later test's collections.
_CHILD = textwrap.dedent("""
    import gc, weakref
    from common.heap import YOUNG_COLLECTION_THRESHOLD, freeze_startup_heap

    class Node:
        pass

    state = [Node() for _ in range(10_000)]  # what start-up keeps
    cycle = Node(); cycle.me = cycle  # garbage start-up left behind, a reference cycle
    dead = weakref.ref(cycle); del cycle
    num_frozen = freeze_startup_heap()
    assert dead() is None, "the freeze must collect start-up garbage first"
    assert num_frozen == gc.get_freeze_count() >= len(state)
    walked = {id(o) for o in gc.get_objects()}
    assert not any(id(node) in walked for node in state), "start-up objects are still walked"
    later = Node(); later.me = later  # made while serving: collected as before
    gone = weakref.ref(later); del later
    gc.collect()
    assert gone() is None
    assert gc.get_threshold()[0] == YOUNG_COLLECTION_THRESHOLD > 700
    first = Node(); first.me = first  # cyclic garbage made while serving goes without an explicit collect
    first_gone = weakref.ref(first); del first
    for _ in range(2 * YOUNG_COLLECTION_THRESHOLD):
        node = Node(); node.me = node
    assert first_gone() is None, "young collections no longer run"
    print("ok")
""")


def test_freeze_collects_start_up_garbage_and_exempts_the_survivors():
    result = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
