import gc

from hybridlm.runtime import freeze_loaded_objects


def test_objects_alive_at_freeze_leave_the_collectors_generations():
    loaded = [[i] for i in range(1000)]  # what loading a model leaves behind (lists: always tracked)
    assert all(gc.is_tracked(o) for o in loaded)
    try:
        frozen = freeze_loaded_objects()
        assert frozen >= len(loaded)
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in tracked for o in loaded)
        made_later = [1]
        assert any(o is made_later for o in gc.get_objects())
    finally:
        gc.unfreeze()
