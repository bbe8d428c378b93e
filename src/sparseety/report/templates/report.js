"use strict";
/* SparSEEty report: draws every chart from the embedded JSON. No network, no globals. */
const root = document.getElementById(ROOT_ID);
const D = JSON.parse(root.querySelector("script.spx-data").textContent);
const SVGNS = "http://www.w3.org/2000/svg";
const COLORS = {kept: [43, 140, 190], partly: [253, 174, 97], evicted: [215, 48, 31], unseen: [238, 241, 244], window: [154, 165, 177]};
const PALETTE = ["#2b6cb0", "#d7301f", "#2f855a", "#b7791f", "#6b46c1", "#c05621", "#319795", "#97266d"];
const tip = root.querySelector(".tip");
const q = (sel) => root.querySelector(sel);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}
function svg(tag, attrs, text) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}
function fmt(v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "—";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return v.toLocaleString("en");
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(2) : v.toFixed(digits === undefined ? 4 : digits);
}
function half(h) {
  const s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, f = h & 0x3ff;
  if (e === 0) return s * Math.pow(2, -14) * (f / 1024);
  if (e === 31) return f ? NaN : s * Infinity;
  return s * Math.pow(2, e - 15) * (1 + f / 1024);
}
function unpack(p) {
  if (!p) return null;
  const bin = atob(p.b64), bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  const buf = bytes.buffer;
  let arr;
  if (p.dtype === "u8") arr = bytes;
  else if (p.dtype === "u16") arr = new Uint16Array(buf);
  else if (p.dtype === "u32") arr = new Uint32Array(buf);
  else if (p.dtype === "i32") arr = new Int32Array(buf);
  else if (p.dtype === "f32") arr = new Float32Array(buf);
  else if (p.dtype === "f16") { const h = new Uint16Array(buf); arr = new Float32Array(h.length); for (let i = 0; i < h.length; i++) arr[i] = half(h[i]); }
  return {data: arr, shape: p.shape, row: (r) => arr.subarray(r * p.shape[1], (r + 1) * p.shape[1])};
}
function showTip(ev, node) {
  tip.replaceChildren(node);
  tip.style.display = "block";
  const w = tip.offsetWidth, h = tip.offsetHeight;
  let x = ev.clientX + 14, y = ev.clientY + 14;
  if (x + w > window.innerWidth - 8) x = Math.max(8, ev.clientX - w - 14);
  if (y + h > window.innerHeight - 8) y = Math.max(8, ev.clientY - h - 14);
  tip.style.left = x + "px"; tip.style.top = y + "px";
}
function hideTip() { tip.style.display = "none"; }
function ranges(nums) {
  const out = []; let start = null, prev = null;
  for (const n of nums) {
    if (start === null) { start = prev = n; continue; }
    if (n === prev + 1) { prev = n; continue; }
    out.push(start === prev ? `${start}` : `${start}–${prev}`); start = prev = n;
  }
  if (start !== null) out.push(start === prev ? `${start}` : `${start}–${prev}`);
  return out.join(", ");
}

/* ---------- generic charts (inline SVG) ---------- */
function niceTicks(lo, hi, n, integer) {
  if (!(hi > lo)) { hi = lo + 1; }
  const span = hi - lo, step0 = Math.pow(10, Math.floor(Math.log10(span / n))), err = span / n / step0;
  let step = step0 * (err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1);
  if (integer) step = Math.max(1, Math.round(step));
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(+t.toFixed(10));
  return ticks;
}
function frame(o) {
  const W = o.width || 760, H = o.height || 260, m = {l: 58, r: 16, t: 14, b: 42};
  const s = svg("svg", {viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img"});
  if (o.title) s.append(svg("title", {}, o.title));
  return {s, W, H, m, pw: W - m.l - m.r, ph: H - m.t - m.b};
}
function axes(f, xt, yt, sx, sy, xLabel, yLabel, xfmt) {
  for (const t of yt) {
    f.s.append(svg("line", {x1: f.m.l, x2: f.m.l + f.pw, y1: sy(t), y2: sy(t), class: "grid"}));
    f.s.append(svg("text", {x: f.m.l - 6, y: sy(t) + 4, "text-anchor": "end"}, fmt(t, 2)));
  }
  for (const t of xt) f.s.append(svg("text", {x: sx(t), y: f.m.t + f.ph + 16, "text-anchor": "middle"}, xfmt ? xfmt(t) : fmt(t, 2)));
  f.s.append(svg("line", {x1: f.m.l, x2: f.m.l + f.pw, y1: f.m.t + f.ph, y2: f.m.t + f.ph, class: "axis"}));
  f.s.append(svg("line", {x1: f.m.l, x2: f.m.l, y1: f.m.t, y2: f.m.t + f.ph, class: "axis"}));
  f.s.append(svg("text", {x: f.m.l + f.pw / 2, y: f.H - 6, "text-anchor": "middle", class: "axis-title"}, xLabel));
  f.s.append(svg("text", {x: 14, y: f.m.t + f.ph / 2, "text-anchor": "middle", class: "axis-title",
    transform: `rotate(-90 14 ${f.m.t + f.ph / 2})`}, yLabel));
}
function lineChart(o) {
  const f = frame(o), all = o.series.flatMap((s) => s.ys.filter((v) => v !== null && !Number.isNaN(v)));
  const xs = o.series.flatMap((s) => s.xs);
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  let y0 = o.yMin !== undefined ? o.yMin : Math.min(0, ...all), y1 = o.yMax !== undefined ? o.yMax : Math.max(...all, 1e-9);
  if (o.hline) y1 = Math.max(y1, o.hline.y * 1.08);
  const sx = (v) => f.m.l + (x1 > x0 ? (v - x0) / (x1 - x0) : 0.5) * f.pw;
  const sy = (v) => f.m.t + f.ph - (v - y0) / (y1 - y0 || 1) * f.ph;
  const intX = xs.every(Number.isInteger);
  axes(f, niceTicks(x0, x1, 8, intX).filter((t) => t >= x0 && t <= x1), niceTicks(y0, y1, 5), sx, sy, o.xLabel, o.yLabel, o.xfmt);
  o.series.forEach((s, i) => {
    const color = s.color || PALETTE[i % PALETTE.length];
    let d = "";
    s.xs.forEach((x, j) => { const y = s.ys[j]; if (y === null || Number.isNaN(y)) return; d += (d ? "L" : "M") + sx(x).toFixed(1) + "," + sy(y).toFixed(1); });
    f.s.append(svg("path", {d, fill: "none", stroke: color, "stroke-width": 2}));
    if (s.points !== false && s.xs.length <= 80) s.xs.forEach((x, j) => {
      const y = s.ys[j]; if (y === null || Number.isNaN(y)) return;
      const c = svg("circle", {cx: sx(x), cy: sy(y), r: 3.2, fill: s.pointColor ? s.pointColor(j) : color});
      c.append(svg("title", {}, `${s.name}: ${o.xLabel} ${fmt(x, 3)} → ${fmt(y)}`));
      f.s.append(c);
    });
  });
  if (o.hline) {
    f.s.append(svg("line", {x1: f.m.l, x2: f.m.l + f.pw, y1: sy(o.hline.y), y2: sy(o.hline.y), stroke: "#d7301f", "stroke-dasharray": "5 4", "stroke-width": 1.5}));
    f.s.append(svg("text", {x: f.m.l + f.pw - 4, y: sy(o.hline.y) - 5, "text-anchor": "end", style: "fill:#d7301f"}, o.hline.label));
  }
  const box = el("div", {class: "chart"}, f.s);
  if (o.series.length > 1 || o.legend) box.prepend(legend(o.series.map((s, i) => [s.name, s.color || PALETTE[i % PALETTE.length]]).concat(o.legend || [])));
  return box;
}
function barChart(o) {
  /* o.labels, o.stacks: [{name, values, color}], o.highlight, o.onClick, o.hline */
  const f = frame(o), n = o.labels.length;
  const totals = o.labels.map((_, i) => o.stacks.reduce((a, s) => a + (s.values[i] || 0), 0));
  const y1 = o.yMax !== undefined ? o.yMax : Math.max(...totals, o.hline ? o.hline.y : 0, 1e-9);
  const bw = f.pw / Math.max(n, 1);
  const sy = (v) => f.m.t + f.ph - v / y1 * f.ph;
  const every = Math.ceil(n / 30);
  const intY = o.stacks.every((s) => s.values.every((v) => Number.isInteger(v)));
  axes(f, [], niceTicks(0, y1, 5, intY).filter((t) => t <= y1 * 1.0001), null, sy, o.xLabel, o.yLabel);
  const barW = Math.min(bw * 0.76, 48);
  o.labels.forEach((lab, i) => {
    let base = 0;
    const g = svg("g", {"data-index": i, style: o.onClick ? "cursor:pointer" : ""});
    o.stacks.forEach((s, k) => {
      const v = s.values[i] || 0;
      const r = svg("rect", {x: f.m.l + (i + 0.5) * bw - barW / 2, width: Math.max(barW, 1), y: sy(base + v), height: Math.max(sy(base) - sy(base + v), 0),
        fill: s.color || PALETTE[k], opacity: o.highlight === null || o.highlight === undefined || o.highlight === i ? 1 : 0.45});
      base += v; g.append(r);
    });
    g.append(svg("title", {}, `${o.xLabel} ${lab}: ` + o.stacks.map((s) => `${s.name} ${fmt(s.values[i])}`).join(", ")));
    if (o.onClick) g.addEventListener("click", () => o.onClick(i));
    f.s.append(g);
    if (i % every === 0) f.s.append(svg("text", {x: f.m.l + (i + 0.5) * bw, y: f.m.t + f.ph + 16, "text-anchor": "middle"}, String(lab)));
  });
  if (o.hline) {
    f.s.append(svg("line", {x1: f.m.l, x2: f.m.l + f.pw, y1: sy(o.hline.y), y2: sy(o.hline.y), stroke: "#d7301f", "stroke-dasharray": "5 4"}));
    f.s.append(svg("text", {x: f.m.l + f.pw - 4, y: sy(o.hline.y) - 5, "text-anchor": "end", style: "fill:#d7301f"}, o.hline.label));
  }
  const box = el("div", {class: "chart"}, f.s);
  if (o.stacks.length > 1) box.prepend(legend(o.stacks.map((s, k) => [s.name, s.color || PALETTE[k]])));
  return box;
}
function legend(items) {
  return el("div", {class: "legend"}, ...items.map(([name, color]) => el("span", {}, el("i", {style: `background:${color}`}), name)));
}
function heatColor(v) {  /* 0..1 -> white..deep blue (sequential, readable) */
  const t = Math.max(0, Math.min(1, v)), c0 = [247, 251, 255], c1 = [8, 69, 148];
  return `rgb(${c0.map((a, i) => Math.round(a + (c1[i] - a) * t)).join(",")})`;
}
function heatTable(grid, rowTitle, colTitle, fmtCell) {
  const table = el("table", {class: "heat"});
  table.append(el("tr", {}, el("th", {text: `${rowTitle} \\ ${colTitle}`}), ...grid.columns.map((c) => el("th", {text: c}))));
  grid.rows.forEach((r, i) => table.append(el("tr", {}, el("th", {text: r}), ...grid.values[i].map((v) => {
    const td = el("td", {text: v === null ? "—" : fmtCell(v)});
    if (v !== null) { td.style.background = heatColor(v); td.style.color = v > 0.55 ? "#fff" : "#1f2933"; }
    return td;
  }))));
  return table;
}
function heatRamp(lo, hi, label) {
  return el("div", {class: "legend"}, el("span", {text: `${label}: ${lo}`}),
    el("span", {class: "ramp", style: `background:linear-gradient(90deg,${heatColor(0)},${heatColor(1)})`}), el("span", {text: hi}));
}
function kvTable(obj) {
  const t = el("table", {class: "kv"});
  for (const [k, v] of Object.entries(obj || {})) {
    if (v !== null && typeof v === "object") continue;
    t.append(el("tr", {}, el("td", {text: k}), el("td", {text: fmt(v)})));
  }
  return t;
}

/* ---------- trace report ---------- */
function traceReport() {
  const P = D.prompt_len, N = D.positions, L = D.layers;
  const texts = D.tokens.text, ids = D.tokens.ids;
  const imp = unpack(D.importance), rk = unpack(D.ranks);
  const T = D.timeline, NEVER = T ? T.never : 0;
  const first = T ? unpack(T.first_step) : null, full = T ? unpack(T.all_step) : null, cnt = T ? unpack(T.heads_evicted) : null;
  const edges = T && T.window_edge ? unpack(T.window_edge) : null;  /* [layers, steps]: sliding layers' window edge */
  const hiddenBy = (l, step, p) => edges !== null && p < edges.data[l * T.steps + step];
  const select = q("select.layer-select");
  let layer = D.layer === null ? -1 : D.layer;   /* -1: all layers */
  const marked = {}; for (const [name, list] of Object.entries(D.marks || {})) marked[name] = new Set(list);
  const MARK_TEXT = [["cached", "prefill skipped: KV served from the prefix cache"],
                     ["recomputed", "KV freed by a preemption, computed again"],
                     ["rejected", "a speculative draft proposed here was rejected"],
                     ["sink", "attention sink: left out of the rankings and of the shading scale"]];
  const spans = [];

  function layerName(l) { return l < 0 ? "all layers" : `layer ${l}`; }
  function evictInfo(p) {
    /* per first-eviction step: layers where every KV head went, layers where only some did */
    if (!T) return null;
    const groups = new Map();
    for (let l = 0; l < L; l++) {
      const i = l * N + p, f = first.data[i];
      if (f === NEVER) continue;
      const a = full.data[i];
      const at = (s) => { if (!groups.has(s)) groups.set(s, {all: [], some: []}); return groups.get(s); };
      if (a === f) at(f).all.push(l);
      else { at(f).some.push(l); if (a !== NEVER) at(a).all.push(l); }
    }
    return new Map([...groups.entries()].sort((a, b) => a[0] - b[0]));
  }
  let layerMax = 0;  /* the highest score of the selected layer: scores are shown divided by it, as in the table */
  function tokenTip(p) {
    const box = el("div");
    box.append(el("div", {}, el("b", {text: JSON.stringify(texts[p])}), el("span", {class: "muted", text: `  ${p < P ? "prompt" : "generated"}`})));
    box.append(el("div", {text: `id ${ids[p]} · position ${p}`}));
    if (imp) {
      const row = layer + 1, s = imp.data[row * N + p];
      box.append(el("div", {text: `score (${layerName(layer)}): ${fmt(layerMax > 0 ? s / layerMax : s)} of 1 (raw ${fmt(s)}) · rank ${Number.isNaN(s) ? "—" : rk.data[row * N + p]} (0 = most important) of ${N}`}));
      const grid = el("div", {class: "ranks"});
      for (let l = 0; l < L; l++) { const v = imp.data[(l + 1) * N + p]; grid.append(el("span", {text: `L${l} #${Number.isNaN(v) ? "—" : rk.data[(l + 1) * N + p]}`})); }
      box.append(el("div", {class: "muted", text: "rank per layer:"}), grid);
    }
    for (const [name, why] of MARK_TEXT) if (marked[name] && marked[name].has(p)) box.append(el("div", {text: why}));
    const groups = evictInfo(p);
    if (groups) {
      if (p >= N - 1 && groups.size === 0) box.append(el("div", {class: "muted", text: "last token: never fed back, never cached"}));
      else if (groups.size === 0) box.append(el("div", {text: "evicted: never (kept in every layer)"}));
      else {
        const hit = new Set(); for (const g of groups.values()) for (const l of g.all.concat(g.some)) hit.add(l);
        const n = hit.size;
        box.append(el("div", {text: `evicted in ${n} of ${L} layers:`}));
        for (const [step, g] of groups) {
          const parts = [];
          const layers = (ls) => `layer${ls.length > 1 ? "s" : ""} ${ranges(ls)}`;
          if (g.all.length) parts.push(`${layers(g.all)} (all KV heads)`);
          if (g.some.length) parts.push(`${layers(g.some)} (some of ${T.kv_heads} KV heads)`);
          box.append(el("div", {text: `  step ${step}${step === 0 ? " (prefill)" : ""}: ${parts.join("; ")}`}));
        }
      }
    }
    return box;
  }

  /* text view */
  const prompt = q(".text.prompt"), output = q(".text.output");
  if (prompt) {
    const fp = document.createDocumentFragment(), fo = document.createDocumentFragment();
    for (let p = 0; p < N; p++) {
      const marks = MARK_TEXT.filter(([name]) => marked[name] && marked[name].has(p)).map(([name]) => " mark-" + name).join("");
      const s = el("span", {class: "tok" + (p >= P ? " gen" : "") + marks, "data-p": p, text: texts[p]});
      spans.push(s); (p < P ? fp : fo).append(s);
    }
    prompt.append(fp); output.append(fo);
    for (const box of [prompt, output]) {
      box.addEventListener("mouseover", (ev) => { const t = ev.target.closest(".tok"); if (t) showTip(ev, tokenTip(+t.dataset.p)); });
      box.addEventListener("mousemove", (ev) => { if (tip.style.display === "block") { const t = ev.target.closest(".tok"); if (t) showTip(ev, tip.firstChild); } });
      box.addEventListener("mouseleave", hideTip);
    }
  }
  function shadeText() {
    if (!spans.length) return;
    const row = layer + 1;
    let max = 0;
    const sinks = marked.sink || new Set();  /* attention sinks: the scale is set without them */
    if (imp) for (let p = 0; p < N; p++) { const v = imp.data[row * N + p]; if (v > max && !sinks.has(p)) max = v; }
    layerMax = max;
    for (let p = 0; p < N; p++) {
      const s = spans[p];
      const v = imp ? imp.data[row * N + p] : NaN;
      s.style.background = Number.isNaN(v) || max <= 0 || sinks.has(p) ? "" : `rgba(${getHeat()},${Math.sqrt(v / max).toFixed(3)})`;
      let evAll = false, evPart = false;
      if (T) {
        if (layer >= 0) { const i = layer * N + p; evAll = full.data[i] !== NEVER; evPart = !evAll && first.data[i] !== NEVER; }
        else { let a = 0, any = 0; for (let l = 0; l < L; l++) { if (full.data[l * N + p] !== NEVER) a++; if (first.data[l * N + p] !== NEVER) any++; } evAll = a === L && L > 0; evPart = !evAll && any > 0; }
      }
      s.classList.toggle("ev-all", evAll); s.classList.toggle("ev-part", evPart);
    }
    const m = q(".imp-max"); if (m) m.textContent = imp ? `1 = the highest score of ${layerName(layer)}, ${fmt(max)} raw; square-root scale` : "no scores";
  }
  let heat = null;
  function getHeat() { if (!heat) heat = getComputedStyle(root).getPropertyValue("--heat").trim() || "255,140,0"; return heat; }

  /* eviction timeline on a canvas: rows = steps, columns = positions, binned past max_axis */
  function drawTimeline() {
    const canvas = q("canvas.timeline");
    if (!canvas || !T) return;
    const steps = T.steps, pb = Math.ceil(N / D.max_axis), sb = Math.ceil(steps / D.max_axis);
    const cols = Math.ceil(N / pb), rows = Math.ceil(steps / sb);
    const off = document.createElement("canvas"); off.width = cols; off.height = rows;
    const ctx = off.getContext("2d"), img = ctx.createImageData(cols, rows);
    const layers = layer >= 0 ? [layer] : [...Array(L).keys()];
    const acc = new Float64Array(cols * 5);
    for (let r = 0; r < rows; r++) {
      const step = Math.min(steps - 1, (r + 1) * sb - 1), seq = Math.min(P + step, N);
      acc.fill(0);
      for (const l of layers) {
        const o = l * N;
        for (let p = 0; p < N; p++) {
          let st;
          if (p >= seq) st = 3;
          else { const a = full.data[o + p], f = first.data[o + p]; st = a !== NEVER && a <= step ? 2 : hiddenBy(l, step, p) ? 4 : f !== NEVER && f <= step ? 1 : 0; }
          acc[Math.floor(p / pb) * 5 + st] += 1;
        }
      }
      for (let c = 0; c < cols; c++) {
        const w = acc.subarray(c * 5, c * 5 + 5), tot = w[0] + w[1] + w[2] + w[3] + w[4] || 1, k = (r * cols + c) * 4;
        const mix = [COLORS.kept, COLORS.partly, COLORS.evicted, COLORS.unseen, COLORS.window];
        for (let ch = 0; ch < 3; ch++) img.data[k + ch] = (w[0] * mix[0][ch] + w[1] * mix[1][ch] + w[2] * mix[2][ch] + w[3] * mix[3][ch] + w[4] * mix[4][ch]) / tot;
        img.data[k + 3] = 255;
      }
    }
    ctx.putImageData(img, 0, 0);
    const W = Math.min(root.clientWidth - 300, 860), H = Math.max(220, Math.min(460, rows * 6 + 60)), m = {l: 56, r: 10, t: 10, b: 40};
    const dpr = window.devicePixelRatio || 1;
    canvas.width = W * dpr; canvas.height = H * dpr; canvas.style.width = W + "px"; canvas.style.height = H + "px";
    const g = canvas.getContext("2d"); g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, W, H); g.imageSmoothingEnabled = false;
    const pw = W - m.l - m.r, ph = H - m.t - m.b;
    g.drawImage(off, m.l, m.t, pw, ph);
    g.strokeStyle = "#9aa5b1"; g.strokeRect(m.l, m.t, pw, ph);
    g.fillStyle = "#616e7c"; g.font = "11px -apple-system, Segoe UI, Roboto, Arial, sans-serif";
    g.textAlign = "center";
    for (const t of niceTicks(0, N, 8, true)) if (t <= N) g.fillText(fmt(t), m.l + t / N * pw, m.t + ph + 14);
    g.textAlign = "right";
    for (const t of niceTicks(0, steps - 1, 5, true)) if (t <= steps - 1) g.fillText(fmt(t), m.l - 6, m.t + (t + 0.5) / steps * ph + 4);
    g.fillStyle = "#1f2933"; g.font = "12px -apple-system, Segoe UI, Roboto, Arial, sans-serif"; g.textAlign = "center";
    g.fillText("position", m.l + pw / 2, H - 6);
    g.save(); g.translate(14, m.t + ph / 2); g.rotate(-Math.PI / 2); g.fillText("decode step (0 = prefill)", 0, 0); g.restore();
    /* prompt boundary */
    g.strokeStyle = "rgba(31,41,51,.55)"; g.setLineDash([3, 3]);
    g.beginPath(); g.moveTo(m.l + P / N * pw, m.t); g.lineTo(m.l + P / N * pw, m.t + ph); g.stroke(); g.setLineDash([]);
    canvas.onmousemove = (ev) => {
      const b = canvas.getBoundingClientRect(), x = ev.clientX - b.left - m.l, y = ev.clientY - b.top - m.t;
      if (x < 0 || y < 0 || x >= pw || y >= ph) { hideTip(); return; }
      const p = Math.min(N - 1, Math.floor(x / pw * N)), step = Math.min(steps - 1, Math.floor(y / ph * steps));
      const box = el("div", {}, el("div", {text: `step ${step} · position ${p} ${JSON.stringify(texts[p])}`}));
      if (layer >= 0) {
        const i = layer * N + p, seq = Math.min(P + step, N);
        const st = p >= seq ? "not yet seen" : full.data[i] !== NEVER && full.data[i] <= step ? "evicted (all KV heads)"
          : hiddenBy(layer, step, p) ? "outside the sliding window" : first.data[i] !== NEVER && first.data[i] <= step ? `evicted by ${cnt.data[i]}/${T.kv_heads} KV heads` : "kept";
        box.append(el("div", {text: `${layerName(layer)}: ${st}`}));
      }
      showTip(ev, box);
    };
    canvas.onmouseleave = hideTip;
    const side = q(".kept-per-step");
    const kps = layer >= 0 ? T.kept_per_step[layer] : T.kept_per_step_mean;
    const xs = kps.map((_, i) => i);
    side.replaceChildren(lineChart({series: [{name: "slots held", xs, ys: kps, points: false, color: "#2b8cbe"},
      {name: "sequence length", xs, ys: xs.map((s) => Math.min(P + s, N)), points: false, color: "#9aa5b1"}],
      hline: D.budget ? {y: D.budget, label: `budget ${D.budget}`} : null, yMin: 0,
      xLabel: "decode step", yLabel: "tokens per KV head", width: 300, height: 300, title: "Slots held per step"}));
  }

  /* per-layer kept fraction */
  function drawLayers() {
    const box = q(".layers-chart");
    if (!box || !D.kept_fraction.length) return;
    box.replaceChildren(barChart({labels: D.kept_fraction.map((_, i) => i), stacks: [{name: "kept", values: D.kept_fraction, color: "#2b8cbe"}],
      yMax: 1, xLabel: "layer", yLabel: "kept fraction (final)", highlight: layer >= 0 ? layer : null, width: 1000, height: 240,
      onClick: (i) => setLayer(layer === i ? -1 : i)}));
  }

  /* top important tokens, sortable */
  let sortKey = "rank", sortDir = 1;
  function drawTop() {
    const table = q("table.top");
    if (!table) return;
    const want = layer >= 0 ? layer : null;
    const rows = D.top.filter((r) => (r.layer === undefined ? null : r.layer) === want);
    rows.sort((a, b) => { const x = a[sortKey], y = b[sortKey]; return (x < y ? -1 : x > y ? 1 : 0) * sortDir; });
    const cols = [["rank", "rank"], ["position", "position"], ["text", "token"], ["token_id", "id"], ["token_type", "type"], ["score", "score"]];
    const head = el("tr", {}, ...cols.map(([k, label]) => {
      const th = el("th", {text: label, "data-key": k, scope: "col"});
      if (k === sortKey) th.setAttribute("aria-sort", sortDir > 0 ? "ascending" : "descending");
      th.addEventListener("click", () => { if (sortKey === k) sortDir = -sortDir; else { sortKey = k; sortDir = k === "score" ? -1 : 1; } drawTop(); });
      return th;
    }));
    const body = rows.map((r) => el("tr", {"data-p": r.position}, ...cols.map(([k]) => {
      const v = r[k];
      return el("td", {class: k === "text" ? "tokcell" : typeof v === "number" ? "num" : "", text: k === "text" ? JSON.stringify(v) : fmt(v)});
    })));
    table.replaceChildren(el("thead", {}, head), el("tbody", {}, ...body));
    q(".top-caption").textContent = rows.length ? `${rows.length} tokens ranked for ${layerName(layer)} (special tokens excluded). Click a column to sort.`
      : `No ranking stored for ${layerName(layer)}.`;
  }

  function setLayer(l) {
    layer = l; if (select) select.value = String(l);
    hideTip(); shadeText(); drawTimeline(); drawLayers(); drawTop();
    const lab = q(".timeline-layer"); if (lab) lab.textContent = layerName(layer);
  }
  if (select) select.addEventListener("change", () => setLayer(+select.value));

  if (D.compare) drawCompare(D.compare);
  if (D.window_frees) drawWindowFrees(D.window_frees);
  if (D.moe) drawMoe(D.moe);
  if (D.routing) drawRouting(D.routing, D.moe);
  if (D.drafts) drawDrafts(D.drafts);
  if (D.pruning) drawPruning(D.pruning);
  setLayer(layer);
}

function drawCompare(c) {
  const box = q(".compare-body");
  const diff = c.diff || {};
  const base = el("div", {class: "text"}), sparse = el("div", {class: "text"});
  const join = (t) => Array.isArray(t) ? t.join("") : String(t || "");
  for (const op of diff.ops || []) {
    const a = join(op.baseline_tokens), b = join(op.sparse_tokens);
    if (op.tag === "equal") { base.append(el("span", {text: a})); sparse.append(el("span", {text: b})); }
    else {
      const cls = op.tag === "replace" ? "rep" : op.tag === "delete" ? "del" : "ins";
      if (a) base.append(el("span", {class: op.tag === "replace" ? "del" : cls, title: op.tag, text: a}));
      if (b) sparse.append(el("span", {class: op.tag === "replace" ? "ins" : cls, title: op.tag, text: b}));
    }
  }
  box.append(el("div", {class: "legend"}, el("span", {}, el("i", {style: "background:#ffd8d3"}), "only in the dense baseline"),
    el("span", {}, el("i", {style: "background:#c9f0d3"}), "only in the sparse run"),
    el("span", {text: `similarity ${fmt(diff.ratio, 3)} · first divergence at token ${fmt(diff.first_divergence)}`})));
  box.append(el("div", {class: "diff"}, el("div", {}, el("div", {class: "label", text: `baseline ${c.baseline_request_id || ""}`}), base),
    el("div", {}, el("div", {class: "label", text: "sparse"}), sparse)));
  const kl = (c.fidelity || {}).kl_per_step;
  if (Array.isArray(kl) && kl.length) box.append(el("h3", {text: "KL(dense ‖ sparse) per step", style: "margin-top:14px"}),
    lineChart({series: [{name: "KL", xs: kl.map((_, i) => i), ys: kl, color: "#6b46c1"}], yMin: 0, xLabel: "decode step", yLabel: "KL divergence (nats)", width: 1000, height: 260}));
  const cards = el("div", {class: "cards"});
  for (const key of ["fidelity", "quality"]) if (c[key]) cards.append(el("div", {class: "card"}, el("h3", {text: key}), kvTable(c[key])));
  box.append(cards);
}
function drawMoe(m) {
  const box = q(".moe-body");
  const which = el("select", {}, ...m.grids.map((k) => el("option", {value: k, text: m.labels[k]})));
  const holder = el("div", {class: "chart"});
  function draw() {
    const grid = m[which.value], max = Math.max(...grid.flat(), 1e-9);
    const cell = Math.max(6, Math.min(28, Math.floor(900 / m.experts))), rowH = Math.max(10, Math.min(22, Math.floor(420 / m.layers.length)));
    const W = 70 + cell * m.experts + 20, H = 20 + rowH * m.layers.length + 40;
    const s = svg("svg", {viewBox: `0 0 ${W} ${H}`, width: W, height: H});
    grid.forEach((row, i) => {
      s.append(svg("text", {x: 64, y: 20 + i * rowH + rowH / 2 + 4, "text-anchor": "end"}, `layer ${m.layers[i]}`));
      row.forEach((v, e) => { const r = svg("rect", {x: 70 + e * cell, y: 20 + i * rowH, width: cell - 1, height: rowH - 1, fill: heatColor(v / max)});
        r.append(svg("title", {}, `layer ${m.layers[i]}, expert ${e}: ${fmt(v, 3)}`)); s.append(r); });
    });
    for (let e = 0; e < m.experts; e += Math.ceil(m.experts / 16)) s.append(svg("text", {x: 70 + (e + 0.5) * cell, y: 16, "text-anchor": "middle"}, e));
    s.append(svg("text", {x: 70 + cell * m.experts / 2, y: H - 8, "text-anchor": "middle", class: "axis-title"}, "expert"));
    holder.replaceChildren(heatRamp("0", fmt(max, 3), which.selectedOptions[0].textContent), s);
  }
  which.addEventListener("change", draw);
  box.append(el("div", {class: "legend"}, el("span", {text: "show "}), which), holder);
  draw();
}
function drawWindowFrees(w) {
  const layers = Object.entries(w.windows).map(([l, n]) => `${l} (${n})`).join(", ");
  const groups = w.groups.map((g) => `group ${g.group}: ${g.blocks} blocks`).join(", ");
  q(".window-frees-body").append(
    el("div", {class: "sub", text: `${fmt(w.freed_bytes / 1048576, 3)} MiB in ${w.freed_blocks} blocks returned to vLLM's pool as tokens left the windows of layers ${layers} (layer (window)); per KV-cache group: ${groups}.`}),
    lineChart({series: [{name: "freed by all windowed groups", xs: w.steps, ys: w.bytes.map((b) => b / 1048576), color: "#2b8cbe"}],
      yMin: 0, xLabel: "decode step (0: prefill)", yLabel: "freed so far (MiB)", width: 1000, height: 260}));
}
function drawRouting(r, m) {
  /* rows: the most important tokens; columns: MoE layers; cell: top-1 expert, shaded by that expert's load in the layer */
  const load = m && m[m.grids[0]], row = m ? Object.fromEntries(m.layers.map((l, i) => [l, i])) : {};
  const head = el("tr", {}, el("th", {text: "rank"}), el("th", {text: "token"}), ...r.layers.map((l) => el("th", {text: `L${l}`})));
  const body = r.tokens.map((t, i) => el("tr", {"data-p": t.position}, el("td", {class: "num", text: fmt(t.rank)}),
    el("td", {class: "tokcell", text: JSON.stringify(t.text)}),
    ...r.layers.map((l, j) => {
      const e = r.experts[i][j], share = load && row[l] !== undefined && e >= 0 ? load[row[l]][e] : null;
      const td = el("td", {class: "num", text: e >= 0 ? String(e) : "—", title: e >= 0 ? `layer ${l}: expert ${e}` + (share === null ? "" : `, ${fmt(100 * share, 3)}% of the layer's load`) : "not computed"});
      if (share !== null) { const v = Math.min(1, share * m.experts / 2); td.style.background = heatColor(v); if (v > 0.55) td.style.color = "#fff"; }
      return td;
    })));
  q(".routing-body").append(el("div", {class: "sub", text: "The expert each important token was routed to first, per MoE layer; shade: that expert's share of the layer's load (darkest at twice the even share)."}),
    el("div", {class: "scroll"}, el("table", {class: "data routing"}, el("thead", {}, head), el("tbody", {}, ...body))));
}
function drawDrafts(d) {
  q(".drafts-body").append(el("div", {class: "sub", text: `${d.proposed.reduce((a, b) => a + b, 0)} draft tokens proposed, ${d.rejected.reduce((a, b) => a + b, 0)} rejected`}),
    barChart({labels: d.step, stacks: [{name: "accepted", values: d.accepted, color: "#2f855a"}, {name: "rejected", values: d.rejected, color: "#d7301f"}],
      xLabel: "decode step", yLabel: "draft tokens", width: 1000, height: 240}));
}
function drawPruning(p) {
  q(".pruning-body").append(barChart({labels: p.layers, stacks: [{name: "tokens processed", values: p.remaining, color: "#2b8cbe"}, {name: "pruned", values: p.pruned, color: "#fdae61"}],
    xLabel: "layer", yLabel: "tokens", width: 1000, height: 240, hline: {y: p.total, label: `${p.total} prompt tokens`}}));
}

/* ---------- passkey / tune reports ---------- */
function passkeyReport() {
  const pct = (v) => `${(v * 100).toFixed(0)}%`;
  q(".accuracy-body").append(heatRamp("0%", "100%", "accuracy"), heatTable(D.accuracy, "policy", "compression ratio", pct));
  const byDepth = q(".depth-body");
  byDepth.append(heatTable(D.by_depth, "policy", "depth", pct));
  const xs = D.by_depth.columns.map(Number);
  if (xs.length > 1 && xs.every((x) => !Number.isNaN(x)))
    byDepth.append(lineChart({series: D.by_depth.rows.map((r, i) => ({name: r, xs, ys: D.by_depth.values[i]})), yMin: 0, yMax: 1,
      xLabel: "needle depth", yLabel: "accuracy", width: 1000, height: 260, legend: []}));
}
function rulerReport() {
  const pct = (v) => `${(v * 100).toFixed(0)}%`;
  q(".accuracy-body").append(heatRamp("0%", "100%", "recall"), heatTable(D.accuracy, "policy", "compression ratio", pct));
  D.tasks.forEach((t, i) => q(`.task-body-${i}`).append(heatTable(t.grid, "policy", "compression ratio", pct)));
  q(".kv-body").append(heatTable(D.kv_fraction, "policy", "compression ratio", (v) => v.toFixed(3)));
}
function faithfulnessReport() {
  const t = q(".aopc");
  t.append(el("tr", {}, ...["ranking", "AOPC comprehensiveness (nats)", "of leave-one-out", "AOPC sufficiency (nats)"].map((h) => el("th", {text: h}))));
  const f2 = (v) => v === null || v === undefined ? "—" : Number(v).toFixed(2);
  for (const r of D.table) t.append(el("tr", {}, el("td", {text: r.method}), el("td", {class: "num", text: f2(r.aopc_comprehensiveness)}),
    el("td", {class: "num", text: f2(r.of_leave_one_out)}), el("td", {class: "num", text: f2(r.aopc_sufficiency)})));
  for (const [key, body, title] of [["comprehensiveness", ".comp-body", "comprehensiveness: top k% deleted"], ["sufficiency", ".suff-body", "sufficiency: only top k% kept"]])
    q(body).append(lineChart({series: D.table.map((r) => ({name: r.method, xs: D.percents, ys: r[key]})), xLabel: `% of prompt tokens (${title})`,
      yLabel: "drop of log p(answer)", width: 1000, height: 280}));
  const box = q(".top5-body");
  for (const c of D.top5) {
    const tt = el("table", {class: "data top5"});
    tt.append(el("tr", {}, el("th", {text: "mode"}), ...[1, 2, 3, 4, 5].map((i) => el("th", {text: `#${i}`}))));
    for (const [mode, toks] of Object.entries(c.tokens)) tt.append(el("tr", {}, el("td", {text: mode}), ...toks.map((x) => el("td", {class: "tok-cell", text: JSON.stringify(x)}))));
    box.append(el("h3", {text: `${c.title} — answer ${JSON.stringify(c.answer)}`}), tt);
  }
}
function tuneReport() {
  const c = D.curve;
  q(".tune-body").append(lineChart({series: [{name: D.metric || "value", xs: c.map((p) => p.budget), ys: c.map((p) => p.value), color: "#2b6cb0",
      pointColor: (j) => c[j].meets ? "#2f855a" : "#d7301f"}],
    hline: D.threshold !== null && D.threshold !== undefined ? {y: D.threshold, label: `threshold ${D.threshold}`} : null,
    xLabel: "budget (tokens per KV head)", yLabel: D.metric || "value", width: 1000, height: 300,
    legend: [["meets the threshold", "#2f855a"], ["misses it", "#d7301f"]]}));
  const t = el("table", {class: "data"});
  t.append(el("tr", {}, ...["budget", "ratio", D.metric || "value", "meets"].map((h) => el("th", {text: h}))));
  for (const p of c) t.append(el("tr", {}, el("td", {class: "num", text: fmt(p.budget)}), el("td", {class: "num", text: fmt(p.ratio, 3)}),
    el("td", {class: "num", text: fmt(p.value)}), el("td", {text: p.meets ? "yes" : "no"})));
  q(".tune-table").append(t);
  q(".answer-body").append(kvTable(D.answer));
}

try {
  if (D.kind === "trace") traceReport(); else if (D.kind === "passkey") passkeyReport(); else if (D.kind === "ruler") rulerReport(); else if (D.kind === "faithfulness") faithfulnessReport(); else if (D.kind === "tune") tuneReport();
  root.setAttribute("data-ready-ms", performance.now().toFixed(1));
  root.setAttribute("data-ready", "1");
} catch (err) {
  root.prepend(el("div", {class: "note", text: `This report could not draw its charts: ${err}`}));
  throw err;
}
