"""common.recent_ids.RecentIds: bounded in time and number, oldest out first, a re-added id
counted from its latest sighting."""

from __future__ import annotations

from common.recent_ids import RecentIds


def test_ids_expire_after_the_ttl_and_the_oldest_go_first_past_the_size() -> None:
    now = [0.0]
    ids = RecentIds(ttl_s=10.0, max_size=3, clock=lambda: now[0])
    for i, key in enumerate("abcd"):
        now[0] = float(i)
        ids.add(key)
    assert "a" not in ids and all(k in ids for k in "bcd")  # size 3: the oldest went
    now[0] = 4.0
    ids.add("b")  # seen again: now the newest
    ids.add("e")
    assert "c" not in ids and all(k in ids for k in "bde")
    now[0] = 13.5  # d (3.0) is 10.5 s old, b and e (4.0) 9.5 s
    assert "d" not in ids and "b" in ids and "e" in ids
    ids.add("f")
    assert len(ids._seen) == 3  # what expired left on the next add
