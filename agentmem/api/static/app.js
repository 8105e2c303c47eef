// The memory inspector: one tenant's users, their memories, core blocks, sessions, the
// prompt of each turn and a timeline. State lives in the URL hash so views can be linked.

import { api, ApiError, forgetKey, getKey, setKey } from "./api.js";
import { h, when } from "./dom.js";
import { renderTurn } from "./prompt.js";
import { hitRatioPlot, memoryPlot } from "./timeline.js";

const $ = (sel) => document.querySelector(sel);
const TABS = ["memories", "core", "sessions", "turn", "timeline"];

function route() {
  const p = new URLSearchParams(location.hash.slice(1));
  return { user: p.get("user"), tab: TABS.includes(p.get("tab")) ? p.get("tab") : "memories",
    session: p.get("session"), turn: p.get("turn"), focus: p.get("focus") };
}

function go(changes) {
  const p = new URLSearchParams(location.hash.slice(1));
  for (const [k, v] of Object.entries(changes)) {
    if (v === null || v === undefined) p.delete(k); else p.set(k, v);
  }
  const hash = p.toString();
  if (hash === location.hash.slice(1)) return;
  document.body.dataset.busy = "1";  // set before the hashchange so a caller can wait for the view
  location.hash = hash;
}

function showError(err) {
  const box = $("#error");
  box.textContent = err instanceof Error ? err.message : String(err);
  box.hidden = false;
  if (err instanceof ApiError && (err.status === 401 || err.status === 403)) {
    $("#users").replaceChildren();
    $("#tabs").hidden = true;
    $("#view").replaceChildren(h("p", { class: "hint" }, "No data: the key was refused."));
  }
}

function clearError() { $("#error").hidden = true; $("#error").textContent = ""; }

let rendering = 0;

// Views render asynchronously; body[data-busy] is set until the latest one is on screen.
async function render() {
  const ticket = ++rendering;
  document.body.dataset.busy = "1";
  try {
    await draw(ticket);
  } finally {
    if (ticket === rendering) delete document.body.dataset.busy;
  }
}

async function draw(ticket) {
  const r = route();
  if (!getKey()) {
    $("#users").replaceChildren();
    $("#tabs").hidden = true;
    $("#view").replaceChildren(h("p", { class: "hint" }, "Paste an API key and connect to see this tenant's users."));
    return;
  }
  try {
    const users = await api.users();
    if (ticket !== rendering) return;
    clearError();
    $("#users").replaceChildren(...users.map((u) => h("li", {},
      h("a", { class: u.id === r.user ? "active" : "", "data-user": u.id,
        onclick: () => go({ user: u.id, tab: r.tab, session: null, turn: null, focus: null }) }, u.id))));
    if (!users.length) {
      $("#view").replaceChildren(h("p", { class: "hint" }, "This tenant has no users yet."));
      return;
    }
    if (!r.user) {
      $("#tabs").hidden = true;
      $("#view").replaceChildren(h("p", { class: "hint" }, `Pick one of ${users.length} users.`));
      return;
    }
    $("#tabs").hidden = false;
    for (const a of document.querySelectorAll("#tabs a")) a.classList.toggle("active", a.dataset.tab === r.tab);
    const view = await VIEWS[r.tab](r);
    if (ticket !== rendering) return;
    $("#view").replaceChildren(view);
    if (r.focus) {
      const el = document.querySelector(`[data-focus="${CSS.escape(r.focus)}"]`);
      if (el) { el.classList.add("flash"); el.scrollIntoView({ block: "center" }); }
    }
  } catch (err) {
    if (ticket === rendering) showError(err);
  }
}

// A ref names a memory ("memory:12") or a message ("message:5"); follow it to its view.
async function follow(r, ref) {
  const [kind, id] = String(ref).split(":");
  if (kind === "memory") return go({ tab: "memories", focus: `memory-${id}` });
  if (kind === "core") return go({ tab: "core", focus: `core-${id}` });
  if (kind !== "message") return;
  try {
    for (const sess of await api.sessions(r.user)) {
      const msgs = await api.messages(r.user, sess.id);
      if (msgs.some((m) => String(m.id) === id)) return go({ tab: "sessions", session: sess.id, focus: `message-${id}` });
    }
    showError(new Error(`message ${id} is no longer in the archive`));
  } catch (err) { showError(err); }
}

async function act(fn) {
  try { await fn(); clearError(); await render(); } catch (err) { showError(err); }
}

function memoryRow(r, m) {
  const text = h("td", { class: "text" }, m.text);
  const correct = () => {
    const input = h("input", { type: "text", value: m.text, "aria-label": "corrected text" });
    const save = h("button", { class: "primary", onclick: () => act(() => api.correctMemory(r.user, m.id, input.value)) }, "Save");
    text.replaceChildren(h("form", { class: "inline", onsubmit: (e) => { e.preventDefault(); save.click(); } },
      input, save, h("button", { type: "button", onclick: () => render() }, "Cancel")));
    input.focus();
  };
  const remove = () => {
    if (confirm(`Delete memory #${m.id}?\n\n${m.text}`)) act(() => api.deleteMemory(r.user, m.id));
  };
  const sources = (m.source_ids || []).map((id) => h("a", { class: "ref", onclick: () => follow(r, `message:${id}`) }, `msg ${id}`));
  return h("tr", { class: m.status === "active" ? "" : "superseded", "data-memory": m.id, "data-focus": `memory-${m.id}` },
    h("td", {}, `#${m.id}`),
    text,
    h("td", {}, h("span", { class: `badge ${m.status}` }, m.status),
      m.superseded_by != null ? h("div", {}, "by ",
        h("a", { class: "ref", onclick: () => go({ focus: `memory-${m.superseded_by}` }) }, `#${m.superseded_by}`)) : null),
    h("td", {}, m.kind || ""),
    h("td", {}, Number(m.importance ?? 0).toFixed(2)),
    h("td", {}, when(m.event_time || m.created_at)),
    h("td", {}, sources.length ? sources : h("span", { class: "hint" }, "by hand")),
    h("td", { class: "actions" },
      h("button", { onclick: correct, "data-action": "correct" }, "Correct"),
      h("button", { class: "danger", onclick: remove, "data-action": "delete" }, "Delete")));
}

const VIEWS = {
  async memories(r) {
    const mems = await api.memories(r.user);
    const input = h("input", { type: "text", placeholder: "Add a memory about this user…", "aria-label": "new memory" });
    const add = h("form", { class: "inline", id: "add-memory", onsubmit: (e) => {
      e.preventDefault();
      if (input.value.trim()) act(() => api.addMemory(r.user, input.value.trim()));
    } }, input, h("button", { class: "primary" }, "Add"));
    const active = mems.filter((m) => m.status === "active").length;
    return h("div", {},
      h("p", { class: "hint" }, `${mems.length} memories, ${active} active, ${mems.length - active} superseded.`),
      add,
      h("table", { id: "memories" },
        h("thead", {}, h("tr", {}, ["id", "text", "status", "kind", "importance", "time", "sources", ""].map((c) => h("th", {}, c)))),
        h("tbody", {}, mems.map((m) => memoryRow(r, m)))));
  },

  async core(r) {
    const blocks = await api.coreBlocks(r.user);
    const block = (b) => {
      const area = h("textarea", { "aria-label": `core block ${b.label}`, maxlength: b.limit || undefined }, b.value);
      return h("div", { class: "block", "data-block": b.label, "data-focus": `core-${b.label}` },
        h("header", {}, h("b", {}, b.label),
          h("span", { class: "meta" }, ` · ${b.value.length}/${b.limit ?? "∞"} chars · updated ${when(b.updated_at)}`)),
        area,
        h("button", { class: "primary", onclick: () => act(() => api.setCoreBlock(r.user, b.label, area.value)) }, "Save"));
    };
    const label = h("input", { type: "text", placeholder: "new block label (e.g. human, persona)", "aria-label": "block label" });
    return h("div", {},
      h("p", { class: "hint" }, "Core memory blocks are always in the prompt. Edits apply from the next turn."),
      blocks.length ? blocks.map(block) : h("p", { class: "hint" }, "No core blocks yet."),
      h("form", { class: "inline", onsubmit: (e) => {
        e.preventDefault();
        if (label.value.trim()) act(() => api.setCoreBlock(r.user, label.value.trim(), ""));
      } }, label, h("button", {}, "Add block")));
  },

  async sessions(r) {
    const [sessions, turns] = await Promise.all([api.sessions(r.user), api.turns(r.user)]);
    const current = r.session ?? sessions[0]?.id;
    const list = h("div", { class: "list" }, sessions.map((x) => h("a", {
      class: x.id === current ? "active" : "", "data-session": x.id, onclick: () => go({ session: x.id, focus: null }) },
      h("div", {}, x.id), h("div", { class: "meta" }, `${x.message_count ?? "?"} messages · ${when(x.created_at)}`))));
    if (!current) return h("p", { class: "hint" }, "No sessions yet.");
    const msgs = await api.messages(r.user, current);
    const sessTurns = turns.filter((t) => t.session_id === current).sort((a, b) => a.id - b.id);
    const replies = msgs.filter((m) => m.role === "assistant");
    const turnFor = new Map();
    sessTurns.forEach((t, i) => {
      for (const id of t.trace?.message_ids ?? [replies[i]?.id]) if (id !== undefined) turnFor.set(String(id), t.id);
    });
    const msg = (m) => h("div", { class: `msg ${m.role}`, "data-message": m.id, "data-focus": `message-${m.id}` },
      h("div", { class: "meta" }, `#${m.id} · ${m.role} · ${when(m.event_time || m.created_at)} `,
        turnFor.has(String(m.id))
          ? h("a", { class: "ref", onclick: () => go({ tab: "turn", turn: turnFor.get(String(m.id)), focus: null }) }, "inspect prompt")
          : null),
      h("div", { class: "body" }, m.text));
    return h("div", { class: "cols" }, list, h("div", { class: "detail" },
      msgs.length ? msgs.map(msg) : h("p", { class: "hint" }, "No messages in this session.")));
  },

  async turn(r) {
    const turns = (await api.turns(r.user)).sort((a, b) => b.id - a.id);
    if (!turns.length) return h("p", { class: "hint" }, "No turns recorded for this user yet.");
    const chosen = turns.find((t) => String(t.id) === r.turn) ?? turns[0];
    const select = h("select", { "aria-label": "turn", onchange: (e) => go({ turn: e.target.value }) },
      turns.map((t) => h("option", { value: t.id, selected: t.id === chosen.id },
        `turn ${t.id} · ${when(t.created_at)} · session ${t.session_id}`)));
    return h("div", {}, h("label", {}, "Turn: ", select), renderTurn(chosen, { onRef: (ref) => follow(r, ref) }));
  },

  async timeline(r) {
    const [mems, turns] = await Promise.all([api.memories(r.user), api.turns(r.user)]);
    return h("div", {},
      h("h3", {}, "Memories over time"),
      h("p", { class: "hint" }, "Filled: active. Hollow: superseded; the dashed line leads to what replaced it. Click a dot to open it."),
      h("div", { class: "plot", id: "memory-plot" }, memoryPlot(mems, { onPick: (id) => go({ tab: "memories", focus: `memory-${id}` }) })),
      h("h3", {}, "KV cache hit ratio per turn"),
      h("div", { class: "plot", id: "ratio-plot" }, hitRatioPlot(turns, { onPick: (id) => go({ tab: "turn", turn: id }) })));
  },
};

function init() {
  $("#key").value = getKey();
  $("#key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    setKey($("#key").value.trim());
    render();
  });
  $("#forget").addEventListener("click", () => { forgetKey(); $("#key").value = ""; clearError(); render(); });
  for (const a of document.querySelectorAll("#tabs a")) a.addEventListener("click", () => go({ tab: a.dataset.tab, focus: null }));
  window.addEventListener("hashchange", render);
  render();
}

init();
