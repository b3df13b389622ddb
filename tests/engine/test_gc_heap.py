"""engine/util/gc_heap.py: after freeze_heap, what was alive is skipped by full collections, and what is
allocated later is still collected."""

from __future__ import annotations

import gc


def test_freeze_heap_skips_startup_objects_and_still_collects_later_cycles():
    from conflux_cluster.engine.util.gc_heap import freeze_heap

    class Node:
        pass

    before = [Node()]  # a tracked container alive at the freeze
    try:
        frozen = freeze_heap()
        # other threads of the process (pytest-xdist's, Ray's) may free frozen objects, never add any
        assert frozen > 1000 and gc.get_freeze_count() <= frozen
        assert not any(o is before for o in gc.get_objects())  # moved out of the collected generations
        a, b = Node(), Node()  # a reference cycle made after the freeze
        a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 2  # collected: the freeze covers only what was alive at the time
    finally:
        gc.unfreeze()  # this test process's heap goes back to normal
