"""The memory inspector page, in a real headless browser against a real server on loopback.

One server per module (uvicorn in a thread, the shared fp32 engine and embedder), one
Debian chromium driven by Playwright. Data is written and checked through the REST API;
the page is only ever driven through its own buttons.
"""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

CHROMIUM = os.environ.get("AGENTMEM_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
VIEWS = ["memories", "core", "sessions", "turn", "timeline"]


class Server:
    """A live agentmem server: its base URL, one tenant's key, and an httpx client with it."""

    def __init__(self, app, store):
        from agentmem.api.auth import create_tenant_with_key
        from agentmem.api.local import LocalServer

        self.store = store
        self.tenant_id, self.key = create_tenant_with_key(store, "ui-test")
        self._local = LocalServer(app).__enter__()
        self.base = self._local.url
        self.http = httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {self.key}"}, timeout=120)

    def stop(self) -> None:
        self.http.close()
        self._local.__exit__(None, None, None)


@pytest.fixture(scope="module")
def server(tmp_path_factory, embedder):
    """Its own engine with chunk-KV reuse on (the shared one runs kv_mode "full"), so turns
    report reused / blended / prefilled segments as in real use."""
    from agentmem.api.app import create_app
    from agentmem.config import Config
    from agentmem.engine import Engine
    from agentmem.tiers.store import MemoryStore

    data = tmp_path_factory.mktemp("ui-data")
    config = Config(dtype="float32", device="cpu", data_dir=data, kv_disk_dir=data / "chunks", reply_tokens=8,
                    kv_mode="blend")
    store = MemoryStore(config, embedder=embedder)
    srv = Server(create_app(config, engine=Engine.load(config), store=store), store)
    yield srv
    srv.stop()
    store.close()


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no chromium at {CHROMIUM}: `make setup` installs Debian's chromium (or set AGENTMEM_CHROMIUM)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.set_default_timeout(15_000)
    yield p
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def settle(page) -> None:
    """Wait until the page has drawn its latest view (it marks body[data-busy] meanwhile)."""
    page.wait_for_selector("body:not([data-busy])")


def connect(page, server: Server, key: str | None = None) -> None:
    page.goto(f"{server.base}/ui/")
    page.fill("#key", server.key if key is None else key)
    page.click("#key-form button[type=submit]")
    settle(page)


def open_user(page, server: Server, user: str, tab: str = "memories") -> None:
    connect(page, server)
    page.click(f'#users a[data-user="{user}"]')
    settle(page)
    page.click(f'#tabs a[data-tab="{tab}"]')
    settle(page)


def api_memories(server: Server, user: str) -> list[dict]:
    r = server.http.get(f"/v1/users/{user}/memories", params={"status": "all"})
    r.raise_for_status()
    return r.json()["data"]


QUESTIONS = ("Where do I live now?", "Any dinner idea for tonight?", "Where do I live now?")
SEEDED_TURNS = len(QUESTIONS)


@pytest.fixture(scope="module")
def iris(server) -> str:
    """A user worth looking at: core blocks, two sessions, facts (one superseded), real turns."""
    user = "iris"
    http, store, tid = server.http, server.store, server.tenant_id
    http.put(f"/v1/users/{user}/core/persona", json={"value": "You are Ada, a warm and concise assistant."})
    http.put(f"/v1/users/{user}/core/human", json={"value": "Name: Iris. Nurse. Vegetarian. Lives in Lyon."})
    first = http.post(f"/v1/users/{user}/messages", json={"session_id": "trip-planning", "messages": [
        {"role": "user", "content": "Hi, I'm Iris. I live in Paris and I work night shifts as a nurse."},
        {"role": "assistant", "content": "Nice to meet you, Iris! Night shifts are hard; how can I help?"},
        {"role": "user", "content": "I'm vegetarian, so suggest restaurants without meat, please."}]}).json()["data"]
    moved = http.post(f"/v1/users/{user}/messages", json={"session_id": "moving", "messages": [
        {"role": "user", "content": "Big news: I moved to Lyon last week."}]}).json()["data"]
    ago = lambda days: datetime.now(UTC) - timedelta(days=days)  # noqa: E731
    paris = store.add_memory(tid, user, "Iris lives in Paris.", 0.7, source_ids=[first[0]["id"]], event_time=ago(40))
    store.add_memory(tid, user, "Iris works night shifts as a nurse.", 0.6, source_ids=[first[0]["id"]],
                     event_time=ago(39))
    store.add_memory(tid, user, "Iris is vegetarian.", 0.8, source_ids=[first[2]["id"]], event_time=ago(30))
    lyon = store.add_memory(tid, user, "Iris lives in Lyon.", 0.75, source_ids=[moved[0]["id"]], event_time=ago(7))
    store.supersede(tid, user, paris.id, lyon.id)
    for text in QUESTIONS:
        r = http.post("/v1/chat/completions", json={"model": "agentmem", "user": user, "session_id": "moving",
                                                    "max_tokens": 8, "messages": [{"role": "user", "content": text}]})
        assert r.status_code == 200, r.text
    assert len(http.get(f"/v1/users/{user}/turns").json()["data"]) == SEEDED_TURNS
    return user


# --- serving -----------------------------------------------------------------------------
def test_ui_is_served_without_a_key_and_data_is_not(server):
    with httpx.Client(base_url=server.base) as anon:
        assert anon.get("/ui", follow_redirects=False).headers["location"].endswith("/ui/")
        page = anon.get("/ui/")
        assert page.status_code == 200 and "memory inspector" in page.text
        for asset in ("app.js", "api.js", "dom.js", "prompt.js", "timeline.js", "style.css"):
            assert anon.get(f"/ui/{asset}").status_code == 200, asset
        assert not re.search(r'(src|href)="(https?:)?//', page.text), "the page must load nothing from elsewhere"
        assert anon.get("/v1/users").status_code == 401


# --- the browser -------------------------------------------------------------------------
def test_memory_written_through_api_is_shown_then_deleted_through_page(server, page):
    mem = server.http.post("/v1/users/ana/memories", json={"text": "Ana keeps bees on her roof.", "importance": 0.7})
    assert mem.status_code == 201
    mem_id = mem.json()["id"]
    open_user(page, server, "ana")
    row = page.locator(f'#memories tr[data-memory="{mem_id}"]')
    assert "Ana keeps bees on her roof." in row.inner_text()
    assert "active" in row.inner_text()

    page.reload()  # the key survives a reload (sessionStorage)
    row.wait_for()
    page.once("dialog", lambda d: d.accept())
    row.locator('button[data-action="delete"]').click()
    row.wait_for(state="detached")

    assert mem_id not in [m["id"] for m in api_memories(server, "ana")]
    assert server.http.get(f"/v1/users/ana/memories/{mem_id}").status_code == 404


def test_declined_delete_keeps_the_memory(server, page):
    mem_id = server.http.post("/v1/users/ben/memories", json={"text": "Ben is allergic to peanuts."}).json()["id"]
    open_user(page, server, "ben")
    row = page.locator(f'#memories tr[data-memory="{mem_id}"]')
    page.once("dialog", lambda d: d.dismiss())
    row.locator('button[data-action="delete"]').click()
    page.wait_for_timeout(300)
    assert row.count() == 1
    assert mem_id in [m["id"] for m in api_memories(server, "ben")]


def test_wrong_key_shows_an_error_not_data(server, page):
    server.http.post("/v1/users/cleo/memories", json={"text": "Cleo's secret is the blue door."}).raise_for_status()
    connect(page, server, key="am-not-a-real-key")
    error = page.locator("#error")
    error.wait_for(state="visible")
    assert "refused" in error.inner_text() and "401" in error.inner_text()
    assert page.locator("#users li").count() == 0
    assert "blue door" not in page.content()
    assert page.locator("#tabs").is_hidden()

    page.fill("#key", server.key)  # the right key recovers without a reload
    page.click("#key-form button[type=submit]")
    page.locator('#users a[data-user="cleo"]').wait_for()
    assert page.locator("#error").is_hidden()


def test_correct_a_memory_through_page(server, page):
    mem_id = server.http.post("/v1/users/dan/memories", json={"text": "Dan lives in Oslo."}).json()["id"]
    open_user(page, server, "dan")
    row = page.locator(f'#memories tr[data-memory="{mem_id}"]')
    row.locator('button[data-action="correct"]').click()
    row.locator('input[aria-label="corrected text"]').fill("Dan lives in Bergen.")
    row.locator("button.primary").click()
    page.locator(f'#memories tr[data-memory="{mem_id}"] td.text', has_text="Dan lives in Bergen.").wait_for()
    assert server.http.get(f"/v1/users/dan/memories/{mem_id}").json()["text"] == "Dan lives in Bergen."


def test_superseded_fact_links_to_its_replacement_and_sources(server, page):
    msgs = server.http.post("/v1/users/eve/messages", json={"messages": [
        {"role": "user", "content": "I work at the bakery."}, {"role": "user", "content": "I quit the bakery, I teach now."}]})
    assert msgs.status_code == 201
    src_old, src_new = (m["id"] for m in msgs.json()["data"])
    store, tid = server.store, server.tenant_id
    old = store.add_memory(tid, "eve", "Eve works at a bakery.", source_ids=[src_old])
    new = store.add_memory(tid, "eve", "Eve is a teacher.", source_ids=[src_new])
    store.supersede(tid, "eve", old.id, new.id)

    open_user(page, server, "eve")
    old_row = page.locator(f'#memories tr[data-memory="{old.id}"]')
    assert "superseded" in old_row.inner_text()
    old_row.locator("a.ref", has_text=f"#{new.id}").click()
    page.locator(f'#memories tr[data-memory="{new.id}"].flash').wait_for()

    page.locator(f'#memories tr[data-memory="{new.id}"] a.ref', has_text=f"msg {src_new}").click()
    msg = page.locator(f'.msg[data-message="{src_new}"]')
    msg.wait_for()
    assert "I teach now" in msg.inner_text()

    page.click('#tabs a[data-tab="timeline"]')
    settle(page)
    page.locator("#memory-plot circle").first.wait_for()
    dots = page.locator("#memory-plot circle")
    assert dots.count() == len(api_memories(server, "eve"))
    assert page.locator(f'#memory-plot circle.dot-superseded[data-memory="{old.id}"]').count() == 1
    assert page.locator("#memory-plot line.link").count() == 1


def test_core_block_edit_through_page(server, page):
    server.http.put("/v1/users/fay/core/human", json={"value": "Name: Fay."}).raise_for_status()
    open_user(page, server, "fay", "core")
    block = page.locator('.block[data-block="human"]')
    assert block.locator("textarea").input_value() == "Name: Fay."
    block.locator("textarea").fill("Name: Fay. Prefers short answers.")
    block.locator("button.primary").click()
    page.locator('.block[data-block="human"] .meta', has_text="33/").wait_for()
    blocks = {b["label"]: b["value"] for b in server.http.get("/v1/users/fay/core").json()["data"]}
    assert blocks["human"] == "Name: Fay. Prefers short answers."


def test_turn_view_shows_the_prompt_segments_and_their_kv(server, iris, page):
    turns = server.http.get(f"/v1/users/{iris}/turns").json()["data"]
    assert len(turns) == SEEDED_TURNS
    last = turns[-1]
    segs, stats = last["trace"]["segments"], last["trace"]["stats"]

    open_user(page, server, iris, "turn")
    rows = page.locator("table.segments tbody tr")
    rows.first.wait_for()
    assert rows.count() == len(segs)
    for i, seg in enumerate(segs):
        cells = rows.nth(i).locator("td")
        assert cells.nth(1).inner_text().strip() == seg["tier"]
        assert int(cells.nth(2).inner_text()) == seg["tokens"]
        assert rows.nth(i).get_attribute("data-kv") in ("reused", "blended", "prefilled")
    assert page.locator(".bar:not(.kv) > div").count() == len(segs)
    ttft_ms = round(stats["ttft_s"] * 1000)
    assert page.locator(".stat", has_text="time to first token").inner_text().startswith(f"{ttft_ms} ms")
    ratio = round(stats["cache_hit_ratio"] * 100)
    assert page.locator(".stat", has_text="KV cache hit ratio").inner_text().startswith(f"{ratio}%")
    assert "Lives in Lyon." in page.locator(".prompt").inner_text()

    page.click('#tabs a[data-tab="sessions"]')
    settle(page)
    page.click('.list a[data-session="moving"]')
    settle(page)
    link = page.locator(".msg.user a.ref", has_text="inspect prompt").first
    link.click()
    page.locator(f'.turn[data-turn="{turns[0]["id"]}"]').wait_for()

    page.click('#tabs a[data-tab="timeline"]')
    settle(page)
    page.locator("#ratio-plot circle").first.wait_for()
    assert page.locator("#ratio-plot circle").count() == len(turns)


def test_prefix_cache_reuse_is_attributed_to_the_first_segments(server, page):
    """Without per-segment KV info, a trace's reused_tokens are the prompt's first tokens."""
    page.goto(f"{server.base}/ui/")
    segs = page.evaluate("""async () => {
      const { segmentsOf } = await import("./prompt.js");
      const trace = { segments: [{ tier: "system", tokens: 10, kv: "prefilled" }, { tier: "core", tokens: 20, kv: "prefilled" },
        { tier: "user", tokens: 5, kv: "prefilled" }], stats: { reused_tokens: 16, recomputed_tokens: 0 } };
      const mixed = { segments: [{ tier: "recall", tokens: 8, kv: "blended" }, { tier: "user", tokens: 4, kv: "prefilled" }],
        stats: { reused_tokens: 6, recomputed_tokens: 2 } };
      return [segmentsOf(trace), segmentsOf(mixed)];
    }""")
    prefix, blended = segs
    assert [(x["kv"], x["cached"]) for x in prefix] == [("reused", 10), ("reused", 6), ("prefilled", 0)]
    assert [(x["kv"], x["cached"]) for x in blended] == [("blended", 8), ("prefilled", 0)]


def test_stored_markup_is_shown_as_text(server, page):
    server.http.post("/v1/users/hal/memories", json={"text": '<img src=x onerror="window.pwned=1">hi'}).raise_for_status()
    open_user(page, server, "hal")
    page.locator("#memories td.text", has_text="<img").wait_for()
    assert page.evaluate("window.pwned === undefined")
    assert page.locator("#memories img").count() == 0


def take_screenshots(page, server: Server, user: str, out: Path) -> list[Path]:
    """One PNG per view, `ui-<view>.png`: the tenant's users, each tab of `user`, and the
    wrong-key error."""
    out.mkdir(parents=True, exist_ok=True)
    shots = []

    def shot(name: str, full_page: bool = True) -> None:
        shots.append(out / f"ui-{name}.png")
        page.screenshot(path=str(shots[-1]), full_page=full_page)

    connect(page, server)
    page.locator(f'#users a[data-user="{user}"]').wait_for()
    shot("users")
    open_user(page, server, user)
    for view in VIEWS:
        page.click(f'#tabs a[data-tab="{view}"]')
        settle(page)
        shot(view)
    connect(page, server, key="am-wrong")
    page.locator("#error").wait_for(state="visible")
    shot("wrong-key", full_page=False)
    return shots


def test_screenshot_of_each_view(server, iris, page, tmp_path):
    """Every view renders. `AGENTMEM_UI_SCREENSHOTS=docs/img pytest tests/api/test_ui.py -k
    screenshot` keeps the images (docs/img/ui-<view>.png, shown in docs/ui.md)."""
    out = Path(os.environ.get("AGENTMEM_UI_SCREENSHOTS") or tmp_path)
    shots = take_screenshots(page, server, iris, out)
    assert [p.name for p in shots] == [f"ui-{v}.png" for v in ["users", *VIEWS, "wrong-key"]]
    for shot in shots:
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5_000
