// The turn inspector: what went into one assembled prompt, segment by segment, and where
// each segment's KV came from (reused from the chunk cache, blended, or prefilled anew).

import { h, when } from "./dom.js";

export const TIERS = ["system", "core", "summary", "recall", "turn", "user", "generation"];
export const KV = ["reused", "blended", "prefilled"];

// A turn's trace is written by the session; its numbers may sit at the top or under "stats".
export function stat(trace, key) {
  return trace?.[key] ?? trace?.stats?.[key] ?? null;
}

function kvOf(how) {
  const v = String(how ?? "").toLowerCase();
  if (v.startsWith("reuse") || v === "prefix" || v === "cached") return "reused";
  if (v.startsWith("blend")) return "blended";
  return "prefilled";
}

export function segmentsOf(trace) {
  const segs = (trace?.segments ?? trace?.stats?.segments ?? []).map((seg) => {
    const tokens = Number(seg.tokens ?? seg.n_tokens ?? 0);
    const kv = kvOf(seg.how ?? seg.kv ?? seg.cache);
    return { tier: TIERS.includes(seg.tier) ? seg.tier : "other", label: seg.tier || "other", tokens, kv,
      cached: kv === "prefilled" ? 0 : tokens, prefix: false, ref: seg.ref ?? null, text: seg.text ?? "" };
  });
  return attributePrefix(segs, trace);
}

// Without a chunk-KV planner the engine serves a prompt prefix from its paged prefix cache
// and reports only how many tokens that was, so every segment reads "prefilled" while
// reused_tokens > 0. Those tokens are the prompt's first ones (segments are tokenized alone
// and concatenated), so they are attributed to segments in prompt order.
function attributePrefix(segs, trace) {
  const reused = Number(stat(trace, "reused_tokens") ?? 0);
  if (!reused || Number(stat(trace, "recomputed_tokens") ?? 0) || segs.some((x) => x.kv !== "prefilled")) return segs;
  let left = reused;
  return segs.map((x) => {
    const cached = Math.min(left, x.tokens);
    left -= cached;
    return cached ? { ...x, kv: "reused", cached, prefix: true } : x;
  });
}

function kvLabel(x) {
  if (!x.prefix) return x.kv;
  return x.cached === x.tokens ? "reused (prefix cache)" : `reused ${x.cached}/${x.tokens} (prefix cache)`;
}

// Share of prompt tokens whose KV was not computed from scratch in this turn.
export function hitRatio(trace) {
  const given = stat(trace, "cache_hit_ratio");
  if (given !== null) return Number(given);
  const prompt = stat(trace, "prompt_tokens");
  const reused = stat(trace, "reused_tokens");
  if (prompt && reused !== null) return reused / prompt;
  const segs = segmentsOf(trace);
  const total = segs.reduce((a, x) => a + x.tokens, 0);
  const cached = segs.reduce((a, x) => a + x.cached, 0);
  return total ? cached / total : 0;
}

function legend(items, prefix) {
  return h("div", { class: "legend" }, items.map((t) => h("span", {}, h("i", { class: `${prefix}-${t}` }), t)));
}

function statBox(value, label) {
  return h("div", { class: "stat" }, h("b", {}, value), h("span", {}, label));
}

function fmtS(x) { return x === null || x === undefined ? "–" : `${(Number(x) * 1000).toFixed(0)} ms`; }

// Refs to a memory, message or core block lead to it; others (e.g. "recall:header") only name a piece.
function refLink(ref, onRef) {
  if (!ref) return "";
  if (!/^(memory|message|core):/.test(ref)) return h("span", { class: "hint" }, ref);
  return h("a", { class: "ref", onclick: () => onRef?.(ref) }, ref);
}

function memoriesUsed(trace, onRef) {
  const used = trace.memories_used || [];
  if (!used.length) return null;
  return h("div", { class: "used" }, h("h3", {}, `Memories recalled (${used.length})`),
    h("ul", {}, used.map((m) => h("li", {},
      refLink(m.ref, onRef), ` ${m.kind ?? ""} · score ${m.score ?? "–"} · `, m.text))));
}

// The loop detector cut this reply (engine/repetition.py): say so, and what was kept.
function looped(trace) {
  if (stat(trace, "finish_reason") !== "repetition") return null;
  return h("p", { class: "looped" }, h("span", { class: "badge looped" }, "looped"),
    " the reply repeated itself; it was stopped and stored with one cycle, and recall ranks it lower: ",
    h("q", {}, trace.reply ?? ""));
}

export function renderTurn(turn, { onRef } = {}) {
  const trace = turn.trace || {};
  const segs = segmentsOf(trace);
  const total = segs.reduce((a, x) => a + x.tokens, 0) || 1;
  const prompt = stat(trace, "prompt_tokens") ?? total;
  const tip = (x) => `${x.label} · ${x.tokens} tokens · ${kvLabel(x)}`;
  return h("div", { class: "turn", "data-turn": turn.id },
    h("h3", {}, `Turn ${turn.id}`, h("span", { class: "hint" }, ` · session ${turn.session_id} · ${when(turn.created_at)}`)),
    h("div", { class: "stats" },
      statBox(fmtS(stat(trace, "ttft_s")), "time to first token"),
      statBox(String(prompt), "prompt tokens"),
      statBox(`${(hitRatio(trace) * 100).toFixed(0)}%`, "KV cache hit ratio"),
      statBox(String(stat(trace, "completion_tokens") ?? "–"), "reply tokens"),
      statBox(String(stat(trace, "finish_reason") || "–"), "finish reason"),
      statBox(String(segs.length), "segments")),
    looped(trace),
    h("div", { class: "bar", title: "segments by tier, width = tokens" },
      segs.map((x) => h("div", { class: `tier-${x.tier}`, style: `flex:${x.tokens}`, title: tip(x) }))),
    h("div", { class: "bar kv", title: "where each segment's KV came from" },
      segs.map((x) => x.cached > 0 && x.cached < x.tokens
        ? [h("div", { class: `kv-${x.kv}`, style: `flex:${x.cached}`, title: tip(x) }),
          h("div", { class: "kv-prefilled", style: `flex:${x.tokens - x.cached}`, title: tip(x) })]
        : h("div", { class: `kv-${x.kv}`, style: `flex:${x.tokens}`, title: tip(x) }))),
    legend([...TIERS, "other"], "tier"),
    legend(KV, "kv"),
    segs.some((x) => x.text) ? h("div", { class: "prompt", title: "the assembled prompt, coloured by tier" },
      segs.map((x) => h("span", { class: `p-${x.tier}`, title: tip(x) }, x.text))) : null,
    memoriesUsed(trace, onRef),
    h("table", { class: "segments" },
      h("thead", {}, h("tr", {}, ["#", "tier", "tokens", "KV", "source", "text"].map((c) => h("th", {}, c)))),
      h("tbody", {}, segs.map((x, i) => h("tr", { "data-kv": x.kv, "data-tier": x.label },
        h("td", {}, String(i)),
        h("td", { class: "nowrap" }, h("span", { class: `swatch tier-${x.tier}` }), x.label),
        h("td", {}, String(x.tokens)),
        h("td", { class: "nowrap" }, h("span", { class: `swatch kv-${x.kv}` }), kvLabel(x)),
        h("td", {}, refLink(x.ref, onRef)),
        h("td", { class: "seg-text", title: x.text }, x.text.length > 160 ? `${x.text.slice(0, 160)}…` : x.text))))));
}
