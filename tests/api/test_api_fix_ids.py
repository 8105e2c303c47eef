"""`agentmem tenant fix-ids`: users and sessions stored before ids were checked, with ids no
URL can carry, are renamed into the alphabet (the mapping printed) or deleted; afterwards a
real server reads, exports and deletes every one of them through REST, and nothing of the
old ids is left."""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
from _serve import serve
from sqlalchemy import func, select

from agentmem.api import admin
from agentmem.api.auth import hash_key, new_key
from agentmem.config import Config
from agentmem.tiers.schema import MessageRow, SessionRow, UserRow
from agentmem.tiers.scope import addressable
from agentmem.tiers.store import MemoryStore, default_session_id

BAD_USERS = ("a/b", "..", ".", "x/../y", "pin 4242", "a%2Fb", "zoë", "-dash", "q?x=1#f")
BAD_SESSION = "support/1"


def _legacy(store: MemoryStore, name: str) -> str:
    """A tenant whose users and a session were written as an older version allowed."""
    tid = store.create_tenant(name)
    a = store.archive
    with a.tx() as s:
        for uid in (*BAD_USERS, "alice"):
            s.add(UserRow(tenant_id=tid, id=uid))
        s.add(SessionRow(tenant_id=tid, user_id="alice", id=BAD_SESSION, agent_id="default"))
        for uid in BAD_USERS:
            s.add(SessionRow(tenant_id=tid, user_id=uid, id=default_session_id(tid, uid), agent_id="default"))
    for uid in (*BAD_USERS, "alice"):
        store.set_core_block(tid, uid, "notes", f"{uid}'s pin is 4242")
    for uid in BAD_USERS:
        a.append_messages(tid, uid, default_session_id(tid, uid), [{"role": "user", "content": f"I am {uid}"}])
    a.append_messages(tid, "alice", BAD_SESSION, [{"role": "user", "content": "my order is late"}])
    return tid


def _cli(data, *argv: str, capsys) -> dict:
    assert admin.main(["--data-dir", str(data), "--json", "fix-ids", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_fix_ids_renames_or_deletes_and_rest_then_reaches_every_user(engine, embedder, tmp_path, capsys):
    data = tmp_path / "data"
    store = MemoryStore(Config(data_dir=data), embedder=embedder)
    try:
        tid = _legacy(store, "legacy")
        gone = _legacy(store, "legacy-delete")
    finally:
        store.close()

    dry = _cli(data, tid, "--dry-run", capsys=capsys)
    assert sorted(u["old"] for u in dry["users"]) == sorted(BAD_USERS) and dry["dry_run"]
    out = _cli(data, tid, capsys=capsys)
    assert [(u["old"], u["new"]) for u in out["users"]] == [(u["old"], u["new"]) for u in dry["users"]]
    mapping = {u["old"]: u["new"] for u in out["users"]}
    assert all(addressable(n) for n in mapping.values()) and len(set(mapping.values())) == len(BAD_USERS)
    assert [(x["user_id"], x["old"]) for x in out["sessions"]] == [("alice", BAD_SESSION)]
    new_session = out["sessions"][0]["new"]
    assert addressable(new_session)
    assert _cli(data, tid, capsys=capsys)["users"] == []  # once is enough: nothing left to fix

    deleted = _cli(data, gone, "--delete", capsys=capsys)
    assert sorted(u["old"] for u in deleted["users"]) == sorted(BAD_USERS)
    assert all(u["new"] is None for u in deleted["users"]) and deleted["sessions"][0]["new"] is None

    with serve(engine, embedder, data, tenants=(), rate_per_minute=0) as s:
        key = new_key()
        s.store.add_api_key(tid, hash_key(key))
        s.store.add_api_key(gone, hash_key(other := new_key()))
        c = httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        listed = {u["id"] for u in c.get("/v1/users", params={"limit": 1000}).json()["data"]}
        assert listed == set(mapping.values()) | {"alice"}
        for old, new in mapping.items():
            path = "/v1/users/" + quote(new, safe="")
            assert c.get(path + "/core").json()["data"][0]["value"] == f"{old}'s pin is 4242"
            doc = c.get(path + "/export").json()
            assert [m["text"] for m in doc["messages"]] == [f"I am {old}"]
            # the default conversation followed the user: a chat without session_id continues it
            assert [x["id"] for x in doc["sessions"]] == [default_session_id(tid, new)]
        msgs = c.get(f"/v1/users/alice/sessions/{quote(new_session, safe='')}/messages").json()["data"]
        assert [m["text"] for m in msgs] == ["my order is late"]
        for new in mapping.values():
            assert c.delete("/v1/users/" + quote(new, safe="")).status_code == 200
        with s.store.archive.tx() as sql:
            left = sql.scalar(select(func.count()).select_from(MessageRow).where(MessageRow.tenant_id == tid,
                                                                                 MessageRow.user_id != "alice"))
            assert left == 0
        assert {u["id"] for u in c.get("/v1/users").json()["data"]} == {"alice"}

        d = httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {other}"}, timeout=60)
        assert {u["id"] for u in d.get("/v1/users").json()["data"]} == {"alice"}
        assert [x["id"] for x in d.get("/v1/users/alice/sessions").json()["data"]] == []
        with s.store.archive.tx() as sql:
            texts = list(sql.scalars(select(MessageRow.text).where(MessageRow.tenant_id == gone)))
        assert texts == []
