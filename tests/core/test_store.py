from __future__ import annotations

from core.records import Candidate, RewardProgram, TrainResult
from core.store import ResultStore, job_key, results_path


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


def test_job_key_changes_with_the_code_that_trains():
    config = {"env": {"name": "cartpole"}, "trainer": {"frames": 10}, "plugins": {"p": {"beta": 0.1}}}
    c = Candidate("a", 0)
    code = {"framework": "f1", "plugin:p": "p1"}
    assert job_key(c, config, 0, code) == job_key(c, config, 0, dict(code))
    assert job_key(c, config, 0, code) != job_key(c, config, 0, {**code, "plugin:p": "p2"})
    assert job_key(c, config, 0, code) != job_key(c, config, 0, {**code, "framework": "f2"})
    assert job_key(c, config, 0, code) != job_key(c, {**config, "plugins": {"p": {"beta": 0.2}}}, 0, code)


def test_source_hash_follows_the_file(tmp_path, monkeypatch):
    import importlib
    import sys

    from core.config import source_hash

    path = tmp_path / "llm4rl_test_hashed.py"
    path.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("llm4rl_test_hashed")
    try:
        before = source_hash(module)
        assert source_hash(module) == before
        path.write_text("X = 2\n")
        assert source_hash(module) != before
    finally:
        sys.modules.pop("llm4rl_test_hashed", None)


def _settings(**config):
    from core.config import Settings

    return Settings.of(config)


def test_results_live_beside_the_tracking_store(tmp_path):
    db = tmp_path / "study" / "mlflow.db"
    assert results_path(_settings(tracking={"uri": f"sqlite:///{db}"})) == db.parent / "llm4rl-results.sqlite"
    assert (
        results_path(_settings(tracking={"uri": str(tmp_path / "mlruns")}))
        == tmp_path / "mlruns" / "llm4rl-results.sqlite"
    )
    assert (
        results_path(_settings(tracking={"uri": "http://host:5000"}, cache_dir=str(tmp_path)))
        == tmp_path / "results.sqlite"
    )
    chosen = tmp_path / "mine.sqlite"
    assert results_path(_settings(tracking={"uri": f"sqlite:///{db}"}, results_store=str(chosen))) == chosen
