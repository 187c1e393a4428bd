"""api_keys.py: the keys file, who a bearer token is, and the per-key quotas."""
import json

import pytest

from scheduler_service.api_keys import OPEN, KeyRing, Quotas, parse

KEYS = [{"name": "a", "key": "sk-aaaaaaaa", "max_concurrent": 2},
        {"name": "b", "key": "sk-bbbbbbbb", "tokens_per_minute": 100, "highest_priority": 3,
         "default_priority": 7}]


@pytest.mark.parametrize("text, why", [
    ("nope", "not valid JSON"), ("[]", "non-empty list"), ('[{"name": "a"}]', "required"),
    ('[{"name": "a", "key": "short"}]', "shorter than 8"),
    ('[{"name": "a", "key": "sk-aaaaaaaa", "max_concurent": 1}]', "unknown field"),
    ('[{"name": "a", "key": "sk-aaaaaaaa", "max_concurrent": "1"}]', "must be a int"),
    ('[{"name": "a", "key": "sk-aaaaaaaa"}, {"name": "a", "key": "sk-cccccccc"}]', "twice"),
    ('[{"name": "a", "key": "sk-aaaaaaaa"}, {"name": "c", "key": "sk-aaaaaaaa"}]', "same key"),
])
def test_bad_files_say_why_without_the_secret(text, why):
    with pytest.raises(ValueError, match=why) as e:
        parse(text)
    assert "sk-aaaaaaaa" not in str(e.value)


def test_lookup_reload_and_the_single_key(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": KEYS}))
    ring = KeyRing(str(path), "legacy-key")
    assert ring.from_bearer("Bearer sk-aaaaaaaa").name == "a"
    assert ring.from_bearer("Bearer legacy-key").name == "default"
    assert ring.from_bearer("Bearer legacy-key").load_adapters
    assert ring.from_bearer("Bearer sk-zzzzzzzz") is None and ring.from_bearer(None) is None
    assert ring.from_metadata([("authorization", "Bearer sk-bbbbbbbb")]).default_priority == 7
    assert ring.by_name("b").check_priority(2) and ring.by_name("b").check_priority(3) is None
    path.write_text("[")
    assert not ring.reload() and ring.from_bearer("Bearer sk-aaaaaaaa").name == "a"
    path.write_text(json.dumps(KEYS[1:]))
    assert ring.reload() and ring.from_bearer("Bearer sk-aaaaaaaa") is None
    assert KeyRing().from_bearer(None) is OPEN


def test_quotas(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    q = Quotas(KeyRing(str(path)))
    assert q.admit(1, "a", 1, 10) is None and q.admit(2, "a", 1, 10) is None
    why, retry = q.admit(3, "a", 1, 10)
    assert "limit is 2" in why and retry == 1.0
    q.release(1)
    assert q.admit(4, "a", 1, 10) is None and q.live["a"] == 2
    assert q.admit(10, "b", 1, 60, now=100.0) is None
    why, retry = q.admit(11, "b", 1, 60, now=130.0)
    assert "used 60 of its 100" in why and retry == pytest.approx(30.0)
    assert q.admit(12, "b", 1, 60, now=160.5) is None      # the first charge left the window
    assert q.admit(13, "b", 1, 101, now=1000.0)[1] == 60.0  # never fits: says so
    assert q.admit(20, "", 4, 10**9) is None and not q.live[""]   # no key, no limits
