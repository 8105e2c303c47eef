// Two inline SVG plots of one user over time: the memories (height = importance, hollow =
// superseded, a dashed line to what replaced it) and the KV cache hit ratio of each turn.

import { s, when } from "./dom.js";
import { hitRatio } from "./prompt.js";

const W = 860, H = 230, PAD = { l: 48, r: 16, t: 26, b: 34 };

function frame(t0, t1, yTicks, yFmt) {
  const x = (t) => PAD.l + (t1 === t0 ? 0.5 : (t - t0) / (t1 - t0)) * (W - PAD.l - PAD.r);
  const y = (v) => H - PAD.b - v * (H - PAD.t - PAD.b);
  const parts = [];
  for (const v of yTicks) {
    parts.push(s("line", { class: "grid", x1: PAD.l, x2: W - PAD.r, y1: y(v), y2: y(v) }));
    parts.push(s("text", { x: PAD.l - 6, y: y(v) + 4, "text-anchor": "end" }, yFmt(v)));
  }
  parts.push(s("line", { class: "axis", x1: PAD.l, x2: W - PAD.r, y1: H - PAD.b, y2: H - PAD.b }));
  const label = (t, anchor) => s("text", { x: x(t), y: H - PAD.b + 16, "text-anchor": anchor }, tick(t, t1 - t0));
  if (t1 === t0) parts.push(label(t0, "middle"));
  else for (let i = 0; i <= 4; i++) parts.push(label(t0 + ((t1 - t0) * i) / 4, ["start", "middle", "middle", "middle", "end"][i]));
  return { x, y, parts };
}

// Tick labels as fine as the plotted span needs: days, minutes or seconds.
function tick(t, range) {
  const iso = when(new Date(t).toISOString());
  if (range >= 4 * DAY) return iso.slice(5, 10);
  if (range >= DAY / 4) return iso.slice(5, 16);
  return iso.slice(11, 19);
}

const DAY = 86_400_000;

function span(times) {
  const t0 = Math.min(...times), t1 = Math.max(...times);
  const pad = (t1 - t0) * 0.03;
  return [t0 - pad, t1 + pad];
}

const timeOf = (m) => new Date(m.event_time || m.created_at).getTime();

export function memoryPlot(memories, { onPick } = {}) {
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img", "aria-label": "memory timeline" });
  if (!memories.length) {
    svg.append(s("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no memories yet"));
    return svg;
  }
  const [t0, t1] = span(memories.map(timeOf));
  const { x, y, parts } = frame(t0, t1, [0, 0.5, 1], (v) => v.toFixed(1));
  svg.append(...parts, s("text", { x: 8, y: 12 }, "importance"));
  const byId = new Map(memories.map((m) => [m.id, m]));
  const jitter = (m) => ((m.id * 37) % 9) / 100 - 0.04;
  const at = (m) => [x(timeOf(m)), y(Math.max(0, Math.min(1, Number(m.importance ?? 0.5) + jitter(m))))];
  for (const m of memories) {
    const next = m.superseded_by != null && byId.get(m.superseded_by);
    if (next) {
      const [ax, ay] = at(m), [bx, by] = at(next);
      svg.append(s("line", { class: "link", x1: ax, y1: ay, x2: bx, y2: by }));
    }
  }
  for (const m of memories) {
    const [cx, cy] = at(m);
    const dot = s("circle", { cx, cy, r: 5, class: `dot-${m.status === "active" ? "active" : "superseded"}`,
      "data-memory": m.id }, s("title", {}, `#${m.id} ${m.status} · ${when(m.event_time || m.created_at)}\n${m.text}`));
    if (onPick) dot.addEventListener("click", () => onPick(m.id));
    svg.append(dot);
  }
  return svg;
}

export function hitRatioPlot(turns, { onPick } = {}) {
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img", "aria-label": "cache hit ratio" });
  const pts = turns.map((t) => ({ id: t.id, t: new Date(t.created_at).getTime(), r: hitRatio(t.trace || {}) }))
    .sort((a, b) => a.t - b.t);
  if (!pts.length) {
    svg.append(s("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no turns yet"));
    return svg;
  }
  const [t0, t1] = span(pts.map((p) => p.t));
  const { x, y, parts } = frame(t0, t1, [0, 0.25, 0.5, 0.75, 1], (v) => `${v * 100}%`);
  svg.append(...parts, s("text", { x: 8, y: 12 }, "KV from cache"));
  svg.append(s("polyline", { class: "ratio", points: pts.map((p) => `${x(p.t)},${y(p.r)}`).join(" ") }));
  for (const p of pts) {
    const dot = s("circle", { class: "ratio-dot", cx: x(p.t), cy: y(p.r), r: 4, "data-turn": p.id },
      s("title", {}, `turn ${p.id}: ${(p.r * 100).toFixed(0)}% of prompt KV from cache`));
    if (onPick) dot.addEventListener("click", () => onPick(p.id));
    svg.append(dot);
  }
  return svg;
}
