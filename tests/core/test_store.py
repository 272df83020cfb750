from __future__ import annotations

from core.records import Candidate, RewardProgram, TrainResult
from core.store import ResultStore, job_key


def test_store_round_trip_and_old_records_get_new_fields(tmp_path):
    store = ResultStore(tmp_path / "r.sqlite")
    result = TrainResult("c0", ok=True, frames=10)
    del result.__dict__["series"]  # a record pickled before the field existed
    store.put("k", result)
    back = store.get("k")
    assert back is not None and back.frames == 10
    assert back.series == {} and back.texts == {}
    assert store.get("missing") is None


def test_job_key_ignores_prompt_text_but_not_code_or_seed():
    config = {"env": {"name": "cartpole"}, "trainer": {"frames": 10}, "plugins": {}}
    a = Candidate("a", 0, reward=RewardProgram(source="x = 1", prompt="p1", reply="r1"))
    b = Candidate("b", 0, reward=RewardProgram(source="x = 1", prompt="p2", reply="r2"))
    c = Candidate("c", 0, reward=RewardProgram(source="x = 2"))
    assert job_key(a, config, 0) == job_key(b, config, 0)
    assert job_key(a, config, 0) != job_key(c, config, 0)
    assert job_key(a, config, 0) != job_key(a, config, 1)
