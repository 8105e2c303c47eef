"""Archive, recall and the MemoryStore facade (no language model needed)."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from agentmem.config import Config
from agentmem.tiers import Archive, InvalidInput, MemoryStore, NotFound, archive


@pytest.fixture
def store(tmp_path, embedder):
    s = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    yield s
    s.close()


def _session(store, user="alice", tenant="default"):
    return store.open_session(tenant, user).id


def _head() -> str:
    from alembic.config import Config as AlembicConfig
    from alembic.script import ScriptDirectory

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(Path(archive.__file__).parent / "migrations"))
    return ScriptDirectory.from_config(cfg).get_current_head()


def test_migrations_reach_head_and_reopen_is_idempotent(tmp_path, embedder):
    MemoryStore(Config(data_dir=tmp_path), embedder=embedder).close()
    s = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    with s.archive.engine.connect() as c:
        assert c.execute(sa.text("select version_num from alembic_version")).scalar() == _head()
        assert c.execute(sa.text("pragma journal_mode")).scalar() == "wal"
    assert {"messages", "memories", "core_blocks", "turns"} <= set(sa.inspect(s.archive.engine).get_table_names())


def test_other_tenants_ids_look_missing(store):
    a, b = store.create_tenant("a"), store.create_tenant("b")
    m = store.add_memory(a, "u", "The user's dog is Biscuit.")
    assert store.get_memory(a, "u", m.id).text == "The user's dog is Biscuit."
    for call in (lambda: store.get_memory(b, "u", m.id), lambda: store.update_memory(b, "u", m.id, "x"),
                 lambda: store.delete_memory(b, "u", m.id), lambda: store.get_memory(a, "other", m.id),
                 lambda: store.get_memory(a, "u", 10_000), lambda: store.get_memory(a, "u", "nope")):
        with pytest.raises(NotFound):
            call()
    assert store.search(b, "u", "dog") == []
    sid = store.open_session(a, "u").id
    store.add_messages(a, "u", sid, [{"role": "user", "content": "a's words"}])
    with pytest.raises(NotFound):
        store.session_messages(b, "u", sid)
    # session ids are per tenant and user: b gets a session of its own under the same id
    assert store.open_session(b, "u", sid).message_count == 0
    assert store.session_messages(b, "u", sid) == [] and len(store.session_messages(a, "u", sid)) == 1


def test_memory_lifecycle_and_supersede(store):
    old = store.add_memory("default", "u", "User lives in Lisbon.", importance=0.7, source_ids=[1])
    store.update_memory("default", "u", old.id, compressed_text="lives Lisbon")
    assert store.get_memory("default", "u", old.id).compressed_text == "lives Lisbon"
    new = store.add_memory("default", "u", "User lives in Osaka.", importance=0.7)
    store.supersede("default", "u", old.id, new.id)
    assert [m.id for m in store.list_memories("default", "u", status="active")] == [new.id]
    got = store.get_memory("default", "u", old.id)
    assert (got.status, got.superseded_by) == ("superseded", new.id)
    assert [h.id for h in store.search("default", "u", "where does the user live") if h.kind == "fact"] == [new.id]
    edited = store.update_memory("default", "u", new.id, "User lives in Kyoto.")
    assert edited.compressed_text is None
    assert store.search("default", "u", "Kyoto", k=1)[0].text == "User lives in Kyoto."
    store.delete_memory("default", "u", new.id)
    with pytest.raises(NotFound):
        store.get_memory("default", "u", new.id)
    with pytest.raises(InvalidInput):
        store.add_memory("default", "u", "x", importance=2.0)


def test_core_blocks_limits_and_history(store):
    store.set_core_block("default", "u", "human", "Name: Alice", limit=30)
    store.set_core_block("default", "u", "human", "Name: Alice. Cat: Tom")
    with pytest.raises(InvalidInput):
        store.set_core_block("default", "u", "human", "x" * 31)
    with pytest.raises(InvalidInput):
        store.set_core_block("default", "u", "bad label!", "x")
    assert store.core_blocks("default", "u")[0].value == "Name: Alice. Cat: Tom"
    hist = store.core_block_history("default", "u", "human")
    assert [(h.old_value, h.new_value) for h in hist] == [("", "Name: Alice"), ("Name: Alice", "Name: Alice. Cat: Tom")]


@pytest.mark.parametrize("bad", [b"\xff\xfe bad", "", "   ", "nul\x00here", "lone \udc80 surrogate", 42])
def test_bad_message_text_is_rejected(store, bad):
    sid = _session(store)
    with pytest.raises(InvalidInput):
        store.add_messages("default", "alice", sid, [{"role": "user", "content": bad}])
    assert store.session_messages("default", "alice", sid) == []


def test_bad_roles_and_times_are_rejected(store):
    sid = _session(store)
    with pytest.raises(InvalidInput):
        store.add_messages("default", "alice", sid, [{"role": "wizard", "content": "hi"}])
    with pytest.raises(InvalidInput):
        store.add_messages("default", "alice", sid, [{"role": "user", "content": "hi", "created_at": "yesterday"}])
    ok = store.add_messages("default", "alice", sid, [{"role": "user", "content": "caf\u00e9".encode()}])
    assert ok[0].text == "caf\u00e9"


def test_recall_ranks_time_filters_and_recency(store):
    sid = _session(store)
    now = datetime.now(UTC)
    store.add_messages("default", "alice", sid, [
        {"role": "user", "content": "My dog is called Biscuit.", "created_at": now - timedelta(days=300)},
        {"role": "user", "content": "I went sailing on the lake.", "created_at": now - timedelta(days=100)},
        {"role": "user", "content": "My dog is called Biscuit.", "created_at": now - timedelta(days=1)},
        {"role": "user", "content": "Trains were late again today.", "event_time": now - timedelta(days=50)},
    ])
    hits = store.search("default", "alice", "what is my dog's name", k=4)
    dogs = [h for h in hits if h.text == "My dog is called Biscuit."]
    assert len(dogs) == 2 and hits[0] is dogs[0]
    assert dogs[0].time > dogs[1].time and dogs[0].score > dogs[1].score  # same text: the newer wins
    assert hits[-1] is dogs[1]  # the older twin repeats what the first said: it counts less (DUPLICATE_DECAY)
    assert hits[0].source_ids == [hits[0].id] and hits[0].kind == "message"
    window = store.search("default", "alice", "dog", k=10, since=now - timedelta(days=200),
                          until=now - timedelta(days=10))
    assert {h.text for h in window} == {"I went sailing on the lake.", "Trains were late again today."}


def test_huge_message_is_stored_whole_and_chunked_for_recall(store):
    sid = _session(store)
    filler = "The quarterly report covers revenue, costs and hiring plans in detail. " * 320
    text = filler + "The secret vault code is 4417 and it opens the blue door. " + filler
    m = store.add_messages("default", "alice", sid, [{"role": "user", "content": text}])[0]
    assert store.session_messages("default", "alice", sid)[0].text == text
    ui = store.recall.sync("default", "alice")
    assert ui.messages[m.id] > 30
    hit = store.search("default", "alice", "secret vault code blue door", k=1)[0]
    assert hit.id == m.id and hit.chunk > 0 and "4417" in hit.text and len(hit.text) <= 1000


def test_recall_index_persists_rebuilds_and_follows_other_writers(tmp_path, embedder):
    cfg = Config(data_dir=tmp_path)
    a = MemoryStore(cfg, embedder=embedder)
    sid = a.open_session("default", "bob").id
    a.add_messages("default", "bob", sid, [{"role": "user", "content": "I play the cello every evening."}])
    index_path, meta_path = a.recall._paths("default", "bob")
    assert not index_path.exists()  # writes never wait for embeddings: the index follows on use
    assert a.search("default", "bob", "cello", k=1)[0].text == "I play the cello every evening."
    a.close()  # saved on close (and every FLUSH_VECTORS new vectors)
    assert index_path.exists() and meta_path.exists()
    b = MemoryStore(cfg, embedder=embedder)  # another process on the same archive
    b.add_messages("default", "bob", sid, [{"role": "user", "content": "My sister Greta lives in Oslo."}])
    assert a.search("default", "bob", "sister", k=1)[0].text == "My sister Greta lives in Oslo."
    index_path.unlink()
    c = MemoryStore(cfg, embedder=embedder)
    assert c.search("default", "bob", "cello", k=1)[0].text == "I play the cello every evening."
    c.close()
    assert index_path.exists()
    meta_path.write_text("{not json")
    d = MemoryStore(cfg, embedder=embedder)
    ui = d.recall.sync("default", "bob")
    assert len(ui.messages) == 2 and ui.index.ntotal == 4  # each message alone and in context


def test_concurrent_writers_of_one_user(store):
    sids = [store.open_session("default", "carol").id for _ in range(4)]
    errors = []

    def write(sid, n):
        try:
            for i in range(8):
                store.add_messages("default", "carol", sid, [{"role": "user", "content": f"writer {n} line {i}"}])
        except Exception as e:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(sid, n)) for n, sid in enumerate(sids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(s.message_count for s in store.list_sessions("default", "carol")) == 32
    ui = store.recall.sync("default", "carol")
    assert len(ui.messages) == 32 and ui.index.ntotal == sum(ui.messages.values())


def test_export_import_and_delete(store):
    sid = _session(store, "dave")
    msgs = store.add_messages("default", "dave", sid, [{"role": "user", "content": "I am allergic to sesame."}])
    old = store.add_memory("default", "dave", "Allergic to peanuts.", source_ids=[msgs[0].id])
    new = store.add_memory("default", "dave", "Allergic to sesame.", source_ids=[msgs[0].id])
    store.supersede("default", "dave", old.id, new.id)
    store.set_core_block("default", "dave", "human", "Allergy: sesame")
    doc = store.export_user("default", "dave")
    t2 = store.create_tenant("copy")
    r = store.import_user(t2, "dave", doc)
    assert r["created"] == {"sessions": 1, "messages": 1, "memories": 2, "core_blocks": 1} and r["unchanged"] is False
    # the source rows' ids are taken in this database: the new ones are returned, references follow them
    old_ids = {str(m.id) for m in (old, new)}
    assert set(r["id_map"]["memories"]) == old_ids and set(r["id_map"]["messages"]) == {str(msgs[0].id)}
    assert store.import_user(t2, "dave", doc)["unchanged"] is True  # a second import changes nothing
    mems = store.list_memories(t2, "dave")
    assert [m.status for m in mems] == ["superseded", "active"] and mems[0].superseded_by == mems[1].id
    assert mems[1].source_ids == [store.archive.messages(t2, "dave")[0].id]
    assert store.search(t2, "dave", "allergy", k=1)[0].text in {"I am allergic to sesame.", "Allergic to sesame."}
    calls = []
    store.forget_hooks.append(lambda t, u: calls.append((t, u)))
    store.delete_user("default", "dave")
    assert calls == [("default", "dave")]
    assert not store.recall._paths("default", "dave")[0].exists()
    with pytest.raises(NotFound):
        store.export_user("default", "dave")
    assert store.list_memories(t2, "dave")  # the copy in the other tenant is untouched
    store.delete_tenant(t2)
    assert store.list_memories(t2, "dave") == [] and t2 not in {t.id for t in store.list_tenants()}


def test_api_keys(store):
    t = store.create_tenant("acme")
    store.add_api_key(t, "hash1", "ci")
    assert store.tenant_for_key_hash("hash1") == t and store.tenant_for_key_hash("nope") is None
    with pytest.raises(NotFound):
        store.add_api_key("missing", "hash2")


def _compare_with_models(engine) -> list:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from agentmem.tiers.schema import Base, include_object

    with engine.connect() as c:
        return compare_metadata(MigrationContext.configure(c, opts={"include_object": include_object}), Base.metadata)


def _open_together(url: str, n: int = 4) -> list:
    """Open `n` archives on one new database at once (replicas starting together)."""
    archives, errors = [], []

    def open_one():
        try:
            archives.append(Archive(url))
        except Exception as e:  # noqa: BLE001 - surfaced by the caller's assertion
            errors.append(e)

    threads = [threading.Thread(target=open_one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a in archives:
        a.close()
    return errors


def test_migrations_create_exactly_the_models_schema(tmp_path):
    a = Archive(f"sqlite:///{tmp_path / 'm.db'}")
    assert _compare_with_models(a.engine) == []
    a.close()


def test_processes_opening_a_new_archive_together_migrate_once(tmp_path):
    url = f"sqlite:///{tmp_path / 'together.db'}"
    assert _open_together(url) == []
    with sa.create_engine(url).connect() as c:
        assert c.execute(sa.text("select count(*) from alembic_version")).scalar() == 1


def _upgrade_keeps_rows(url: str) -> None:
    """0001 with a message in it, then upgrade to head: the row survives the new column;
    downgrade to base drops every table; upgrade again matches the models."""
    from alembic import command
    from alembic.config import Config as AlembicConfig

    from agentmem.tiers.archive import _MIGRATIONS, migrate

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    engine = sa.create_engine(url)
    with engine.begin() as c:
        migrate(c, "0001")
        c.execute(sa.text("insert into messages (tenant_id, user_id, session_id, role, text, created_at) "
                          "values ('t', 'u', 's', 'user', 'kept across upgrades', :now)"), {"now": datetime.now()})
        c.execute(sa.text("insert into core_blocks (tenant_id, user_id, label, value, char_limit, updated_at) "
                          "values ('t', 'u', 'human', 'Name: Ada', 2000, :now)"), {"now": datetime.now()})
    with engine.begin() as c:
        migrate(c)
        assert c.execute(sa.text("select text, compressed_text from messages")).one() == ("kept across upgrades", None)
        assert c.execute(sa.text("select value, version from core_blocks")).one() == ("Name: Ada", 1)
    assert _compare_with_models(engine) == []
    with engine.begin() as c:
        cfg.attributes["connection"] = c
        command.downgrade(cfg, "base")
    assert set(sa.inspect(engine).get_table_names()) <= {"alembic_version"}
    with engine.begin() as c:
        migrate(c)
    assert _compare_with_models(engine) == []
    engine.dispose()


def test_migration_upgrade_keeps_rows_sqlite(tmp_path):
    _upgrade_keeps_rows(f"sqlite:///{tmp_path / 'up.db'}")


def test_postgresql_migrations_upgrade_and_concurrent_start(pg_url, tmp_path):
    _upgrade_keeps_rows(pg_url)
    with sa.create_engine(pg_url).begin() as c:
        for table in sa.inspect(c).get_table_names():
            c.execute(sa.text(f"drop table {table} cascade"))
    assert _open_together(pg_url) == []
    with sa.create_engine(pg_url).connect() as c:
        assert c.execute(sa.text("select count(*) from alembic_version")).scalar() == 1


def test_postgresql_archive(tmp_path, embedder, pg_url):
    s = MemoryStore(Config(data_dir=tmp_path, db_url=pg_url), embedder=embedder)
    a, b = s.create_tenant(f"pg-{uuid.uuid4().hex[:8]}"), s.create_tenant("pg-other")
    try:
        sid = s.open_session(a, "alice").id
        s.add_messages(a, "alice", sid, [{"role": "user", "content": "My dog is called Biscuit."}])
        m = s.add_memory(a, "alice", "Dog: Biscuit", source_ids=[1, 2])
        assert s.get_memory(a, "alice", m.id).source_ids == [1, 2]
        with pytest.raises(NotFound):
            s.get_memory(b, "alice", m.id)
        with pytest.raises(InvalidInput):
            s.add_messages(a, "alice", sid, [{"role": "user", "content": "nul\x00"}])
        assert s.search(a, "alice", "dog name", k=1)[0].text == "My dog is called Biscuit."
        s.set_core_block(a, "alice", "human", "Dog: Biscuit", limit=20)
        with pytest.raises(InvalidInput):
            s.set_core_block(a, "alice", "human", "x" * 21)
        assert [h.new_value for h in s.core_block_history(a, "alice")] == ["Dog: Biscuit"]
        s.delete_user(a, "alice")
        assert s.search(a, "alice", "dog") == [] and s.list_memories(a, "alice") == []
    finally:
        s.delete_tenant(a)
        s.delete_tenant(b)
        s.close()
