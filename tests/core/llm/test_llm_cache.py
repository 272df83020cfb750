"""The sqlite response cache: stable keys, round trips, concurrent writers, cache dir."""

from __future__ import annotations

import threading
from pathlib import Path

from core.llm.cache import ResponseCache, cache_key, default_cache_path, user_cache_dir

MSG = [{"role": "user", "content": "hi"}]
PARAMS = {"temperature": 0.7, "max_tokens": 64, "stop": None}


def test_key_is_stable_across_versions_of_the_code():
    # A changed digest silently invalidates every user's cache: bump CACHE_VERSION
    # on purpose instead, and update this literal.
    key = cache_key("embedded/qwen2.5-coder-1.5b-instruct", MSG, PARAMS, 0, 0)
    assert key == "10223ffa2290ef46506b6b03cb31371b5e79aea0a451f5c796c868276c795d00"


def test_key_ignores_dict_order_and_none_params_but_not_values():
    base = cache_key("m", MSG, PARAMS, 0, 0)
    assert cache_key("m", MSG, {"max_tokens": 64, "temperature": 0.7}, 0, 0) == base
    assert cache_key("m", [{"content": "hi", "role": "user"}], PARAMS, 0, 0) == base
    variants = [
        cache_key("m2", MSG, PARAMS, 0, 0),
        cache_key("m", [{"role": "user", "content": "hi!"}], PARAMS, 0, 0),
        cache_key("m", MSG, {**PARAMS, "temperature": 0.8}, 0, 0),
        cache_key("m", MSG, {**PARAMS, "stop": ["x"]}, 0, 0),
        cache_key("m", MSG, PARAMS, 1, 0),
        cache_key("m", MSG, PARAMS, 0, 1),
    ]
    assert base not in variants and len(set(variants)) == len(variants)


def test_round_trip_and_first_writer_wins(tmp_path: Path):
    cache = ResponseCache(tmp_path / "sub" / "c.sqlite")
    assert cache.get("k") is None
    cache.put("k", {"text": "a", "n": 1}, model="m")
    cache.put("k", {"text": "b", "n": 2}, model="m")
    assert cache.get("k") == {"text": "a", "n": 1}
    assert len(ResponseCache(tmp_path / "sub" / "c.sqlite")) == 1


def test_concurrent_writers_share_one_file(tmp_path: Path):
    path = tmp_path / "c.sqlite"
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            cache = ResponseCache(path)
            for i in range(25):
                cache.put(f"{w}-{i}", {"i": i})
                assert cache.get(f"{w}-{i}") == {"i": i}
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(ResponseCache(path)) == 100


def test_user_cache_dir_precedence(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("LLM4RL_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("LLM4RL_CACHE_DIR")
    assert user_cache_dir() == tmp_path / "xdg" / "llm4rl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_cache_dir() == tmp_path / "home" / ".cache" / "llm4rl"
    assert default_cache_path().parent == user_cache_dir()


def test_replies_dumped_from_a_cache_load_into_another_under_the_same_keys(tmp_path: Path):
    from core.llm.cache import ResponseCache, dump_replies, load_replies

    source = ResponseCache(tmp_path / "a.sqlite")
    source.put("k1", {"text": "def compute_reward(): ..."}, model="m")
    source.put("k2", {"text": "second"}, model="m")
    assert dump_replies(tmp_path / "a.sqlite", tmp_path / "replies.jsonl.gz") == 2
    target = ResponseCache(tmp_path / "b.sqlite")
    assert load_replies(tmp_path / "replies.jsonl.gz", target) == 2
    assert target.get("k1") == {"text": "def compute_reward(): ..."} and target.get("k2") == {"text": "second"}


def test_a_dump_keeps_the_replies_the_file_held_and_the_caches_win_on_a_shared_key(tmp_path: Path):
    """A study resumed in a new store (the old one lost) still reports earlier sessions' runs:
    their replies are only in the committed file, so a dump from the new cache adds to it."""
    from core.llm.cache import ResponseCache, dump_replies, load_replies

    earlier = ResponseCache(tmp_path / "earlier.sqlite")
    earlier.put("old", {"text": "an earlier session's reply"}, model="m")
    earlier.put("both", {"text": "stale"}, model="m")
    out = tmp_path / "replies.jsonl.gz"
    assert dump_replies(tmp_path / "earlier.sqlite", out) == 2
    now = ResponseCache(tmp_path / "now.sqlite")
    now.put("new", {"text": "this session's reply"}, model="m")
    now.put("both", {"text": "fresh"}, model="m")
    assert dump_replies(tmp_path / "now.sqlite", out) == 3
    target = ResponseCache(tmp_path / "target.sqlite")
    assert load_replies(out, target) == 3
    assert target.get("old") == {"text": "an earlier session's reply"}
    assert target.get("new") == {"text": "this session's reply"} and target.get("both") == {"text": "fresh"}


def test_a_dump_carries_the_places_of_the_replies_and_counts_only_the_replies(tmp_path: Path):
    from core.llm.cache import ResponseCache, dump_replies, load_replies, position_key

    source = ResponseCache(tmp_path / "a.sqlite")
    source.put("k1", {"text": "reply"}, model="m")
    place = position_key("m", {"temperature": 1.0}, 0, "run", "eureka-it1", 0, 0)
    source.put(place, {"position_of": "k1"}, model="m")
    assert dump_replies(tmp_path / "a.sqlite", tmp_path / "replies.jsonl.gz") == 1
    target = ResponseCache(tmp_path / "b.sqlite")
    assert load_replies(tmp_path / "replies.jsonl.gz", target) == 1
    assert target.get(place) == {"position_of": "k1"} and target.get("k1") == {"text": "reply"}
