"""capture.gc_paused: Python's cyclic GC is off inside (after one full collection) and restored after, even on an
error; a dead object in a reference cycle is collected on entry, before the capture."""

import gc

import pytest


def test_gc_off_inside_and_restored():
    from mlaserve.capture import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with gc_paused(False):  # no graphs to capture: nothing changes
        assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()  # a caller that had it off keeps it off
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_dead_cycles_collected_on_entry():
    from mlaserve.capture import gc_paused

    freed = []

    class Owner:  # stands in for a dead engine that still holds CUDA graphs
        def __del__(self):
            freed.append(True)

    a = Owner()
    a.self = a  # a reference cycle: only the cyclic GC frees it
    del a
    with gc_paused():
        assert freed == [True]  # collected before the capture starts, not by some allocation during it
