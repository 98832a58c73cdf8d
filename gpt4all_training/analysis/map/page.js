"use strict";
const D = JSON.parse(document.getElementById("map-data").textContent);
const N = D.x.length;
const canvas = document.getElementById("map"), ctx = canvas.getContext("2d");
const tip = document.getElementById("tip");
const rgb = c => "rgb(" + c[0] + "," + c[1] + "," + c[2] + ")";
const BINS = 64;
let view = {scale: 1, ox: 0, oy: 0}, highlight = null, activeCluster = null, buckets = null;

// Colour modes: each maps a point to a bucket (drawn in bucket order, so high values end on top) and a legend.
const clusterNames = [];
for (const c of D.clusters) clusterNames[c.cluster] = c.cluster + ": " + c.label;
const modes = {
  loss: () => ramp(D.loss, D.loss_range, D.loss_stops, "loss"),
  cluster: () => categorical(D.cluster, clusterNames, "cluster"),
  source: () => categorical(D.source, D.sources, "source"),
  split: () => categorical(D.split, D.splits, "split"),
};
if (D.change) modes["loss change"] = () => ramp(D.change, D.change_range, D.change_stops, "loss change", true);

function mix(stops, t) {
  const x = Math.min(Math.max(t, 0), 1) * (stops.length - 1), i = Math.min(Math.floor(x), stops.length - 2);
  const f = x - i;
  return stops[i].map((v, j) => Math.round(v * (1 - f) + stops[i + 1][j] * f));
}
function ramp(values, range, stops, name, byMagnitude) {
  const [lo, hi] = range, colours = [], bucketOf = new Int32Array(N), order = [];
  for (let b = 0; b < BINS; b++) colours.push(rgb(mix(stops, b / (BINS - 1))));
  colours.push(rgb(D.missing));
  for (let i = 0; i < N; i++) {
    const v = values[i];
    bucketOf[i] = v === null ? BINS : Math.round(Math.min(Math.max((v - lo) / (hi - lo), 0), 1) * (BINS - 1));
  }
  // Missing first, then by value (by distance from the middle for changes): the notable points are drawn last.
  const rank = b => b === BINS ? -1 : (byMagnitude ? Math.abs(b - (BINS - 1) / 2) : b);
  for (let b = 0; b <= BINS; b++) order.push(b);
  order.sort((a, c) => rank(a) - rank(c));
  const stopsCss = stops.map((s, i) => rgb(s) + " " + (100 * i / (stops.length - 1)) + "%").join(",");
  const css = "linear-gradient(to right," + stopsCss + ")";
  return {bucketOf, colours, order, legend: {kind: "ramp", name, lo, hi, css}};
}
function categorical(codes, names, name) {
  const bucketOf = Int32Array.from(codes), order = names.map((_, i) => i);
  const colours = names.map((_, i) => rgb(D.categories[i % D.categories.length]));
  return {bucketOf, colours, order, legend: {kind: "list", name, names, colours}};
}

function group(mode) {
  const m = modes[mode](), lists = m.colours.map(() => []);
  for (let i = 0; i < N; i++) lists[m.bucketOf[i]].push(i);
  return Object.assign(m, {lists});
}

function resize() {
  const r = canvas.parentElement.getBoundingClientRect(), dpr = window.devicePixelRatio || 1;
  canvas.width = Math.max(1, Math.round(r.width * dpr));
  canvas.height = Math.max(1, Math.round(r.height * dpr));
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  draw();
}
function frame() {
  const w = canvas.clientWidth, h = canvas.clientHeight, pad = 12, side = Math.max(1, Math.min(w, h) - 2 * pad);
  return {left: (w - side) / 2, top: (h - side) / 2, side, w, h};
}
function toScreen(i, f) {
  return [(f.left + D.x[i] * f.side) * view.scale + view.ox, (f.top + (1 - D.y[i]) * f.side) * view.scale + view.oy];
}

function draw() {
  const f = frame();
  ctx.fillStyle = rgb(D.background);
  ctx.fillRect(0, 0, f.w, f.h);
  let drawn = 0;
  const size = N < 2000 ? 4 : N < 20000 ? 3 : 2, half = size / 2;
  const pass = (alpha, wanted) => {
    ctx.globalAlpha = alpha;
    for (const b of buckets.order) {
      ctx.fillStyle = buckets.colours[b];
      for (const i of buckets.lists[b]) {
        if (D.x[i] === null || (highlight !== null && highlight[i] !== wanted)) continue;
        const [sx, sy] = toScreen(i, f);
        if (sx < -3 || sy < -3 || sx > f.w + 3 || sy > f.h + 3) continue;
        ctx.fillRect(sx - half, sy - half, size, size);
        drawn++;
      }
    }
  };
  if (highlight === null) pass(0.9, 0);
  else {
    pass(0.12, 0);
    ctx.globalAlpha = 1;
    ctx.strokeStyle = "#fff";
    for (let i = 0; i < N; i++) {
      if (!highlight[i] || D.x[i] === null) continue;
      const [sx, sy] = toScreen(i, f);
      ctx.strokeRect(sx - 3, sy - 3, 6, 6);
    }
    pass(1, 1);
  }
  ctx.globalAlpha = 1;
  document.getElementById("rendered-count").textContent = drawn;
}

function setMode(mode) {
  buckets = group(mode);
  const legend = document.getElementById("legend"), lg = buckets.legend;
  legend.replaceChildren();
  if (lg.kind === "ramp") {
    const bar = document.createElement("div"), ends = document.createElement("div");
    bar.className = "bar"; bar.style.background = lg.css; ends.className = "ends";
    for (const t of [lg.lo.toPrecision(3), lg.name, lg.hi.toPrecision(3)]) {
      const s = document.createElement("span"); s.textContent = t; ends.appendChild(s);
    }
    legend.append(bar, ends);
  } else {
    lg.names.forEach((name, i) => {
      const item = document.createElement("div"), sw = document.createElement("span");
      sw.className = "swatch"; sw.style.background = lg.colours[i];
      item.append(sw, document.createTextNode(name));
      legend.appendChild(item);
    });
  }
  draw();
}

// Hover: a uniform grid over data space finds the nearest point without scanning all of them.
const G = 128, cellStart = new Int32Array(G * G + 1), cellItems = new Int32Array(N);
(function buildGrid() {
  const cell = i => Math.min(G - 1, Math.floor(D.x[i] * G)) * G + Math.min(G - 1, Math.floor(D.y[i] * G));
  const counts = new Int32Array(G * G + 1);
  for (let i = 0; i < N; i++) if (D.x[i] !== null) counts[cell(i) + 1]++;
  for (let c = 0; c < G * G; c++) counts[c + 1] += counts[c];
  cellStart.set(counts);
  const fill = counts.slice();
  for (let i = 0; i < N; i++) if (D.x[i] !== null) cellItems[fill[cell(i)]++] = i;
})();
function nearest(mx, my) {
  const f = frame(), scale = f.side * view.scale, radius = 8;
  const dx = ((mx - view.ox) / view.scale - f.left) / f.side, dy = 1 - ((my - view.oy) / view.scale - f.top) / f.side;
  const r = radius / scale, c0 = Math.floor((dx - r) * G), c1 = Math.floor((dx + r) * G);
  const d0 = Math.floor((dy - r) * G), d1 = Math.floor((dy + r) * G);
  let best = -1, bestD = radius * radius;
  for (let cx = Math.max(0, c0); cx <= Math.min(G - 1, c1); cx++)
    for (let cy = Math.max(0, d0); cy <= Math.min(G - 1, d1); cy++)
      for (let k = cellStart[cx * G + cy]; k < cellStart[cx * G + cy + 1]; k++) {
        const i = cellItems[k];
        if (highlight !== null && !highlight[i]) continue;
        const [sx, sy] = toScreen(i, f), d = (sx - mx) ** 2 + (sy - my) ** 2;
        if (d < bestD) { bestD = d; best = i; }
      }
  return best;
}
function showTip(i, mx, my) {
  if (i < 0) { tip.style.display = "none"; return; }
  const fmt = v => v === null ? "n/a" : v.toFixed(4);
  const cl = D.clusters.find(c => c.cluster === D.cluster[i]);
  let head = D.splits[D.split[i]] + " #" + D.index[i] + "  source " + D.sources[D.source[i]] +
             "\nloss " + fmt(D.loss[i]) + " over " + D.n_tokens[i] + " tokens";
  if (D.change) head += "  change " + fmt(D.change[i]);
  head += "\ncluster " + D.cluster[i] + ": " + cl.label;
  tip.replaceChildren();
  const b1 = document.createElement("b"), b2 = document.createElement("b");
  b1.textContent = "\nprompt: "; b2.textContent = "\nresponse: ";
  tip.append(document.createTextNode(head), b1, document.createTextNode(D.prompt[i]), b2,
             document.createTextNode(D.response[i]));
  tip.style.display = "block";
  const w = canvas.clientWidth;
  tip.style.left = Math.min(mx + 14, w - 450) + "px";
  tip.style.top = (my + 14) + "px";
}

// Search and cluster selection share one highlight mask.
const haystack = D.prompt.map((p, i) => (p + "\n" + D.response[i]).toLowerCase());
function setHighlight(mask) {
  highlight = mask;
  let count = 0;
  if (mask) for (let i = 0; i < N; i++) count += mask[i];
  document.getElementById("match-count").textContent = count;
  draw();
}
document.getElementById("search").addEventListener("input", e => {
  const q = e.target.value.trim().toLowerCase();
  activeCluster = null;
  document.querySelectorAll("tr.cluster-row.active").forEach(r => r.classList.remove("active"));
  if (!q) return setHighlight(null);
  setHighlight(Uint8Array.from(haystack, t => t.includes(q) ? 1 : 0));
});

const columns = [["cluster", "#"], ["label", "top prompt words"], ["size", "n"], ["mean_loss", "mean loss"]];
if (D.change) columns.push(["mean_loss_change", "mean change"]);
let sortKey = "mean_loss";
function fillTable() {
  const head = document.getElementById("cluster-head"), body = document.getElementById("cluster-body");
  head.replaceChildren();
  for (const [key, title] of columns) {
    const th = document.createElement("th");
    th.textContent = title + (key === sortKey ? " \u25bc" : "");
    th.addEventListener("click", () => { sortKey = key; fillTable(); });
    head.appendChild(th);
  }
  const numeric = sortKey !== "label";
  const rows = D.clusters.slice().sort((a, b) => numeric
      ? ((b[sortKey] ?? -Infinity) - (a[sortKey] ?? -Infinity)) || (a.cluster - b.cluster)
      : String(a.label).localeCompare(String(b.label)));
  body.replaceChildren();
  for (const c of rows) {
    const tr = document.createElement("tr");
    tr.className = "cluster-row" + (c.cluster === activeCluster ? " active" : "");
    tr.dataset.cluster = c.cluster;
    for (const [key] of columns) {
      const td = document.createElement("td"), v = c[key];
      td.textContent = typeof v === "number" && key.startsWith("mean") ? v.toFixed(4) : (v ?? "n/a");
      if (key !== "label") td.className = "num";
      tr.appendChild(td);
    }
    tr.addEventListener("click", () => {
      activeCluster = activeCluster === c.cluster ? null : c.cluster;
      document.getElementById("search").value = "";
      fillTable();
      setHighlight(activeCluster === null ? null : Uint8Array.from(D.cluster, v => v === activeCluster ? 1 : 0));
    });
    body.appendChild(tr);
  }
}

// Zoom around the cursor, drag to pan, double-click to reset.
let drag = null;
canvas.addEventListener("wheel", e => {
  e.preventDefault();
  const k = Math.exp(-e.deltaY * 0.0015);
  view.ox = e.offsetX - (e.offsetX - view.ox) * k;
  view.oy = e.offsetY - (e.offsetY - view.oy) * k;
  view.scale *= k;
  draw();
}, {passive: false});
canvas.addEventListener("mousedown", e => { drag = {x: e.offsetX, y: e.offsetY}; });
window.addEventListener("mouseup", () => { drag = null; });
canvas.addEventListener("mousemove", e => {
  if (drag) {
    view.ox += e.offsetX - drag.x; view.oy += e.offsetY - drag.y;
    drag = {x: e.offsetX, y: e.offsetY};
    tip.style.display = "none";
    return draw();
  }
  showTip(nearest(e.offsetX, e.offsetY), e.offsetX, e.offsetY);
});
canvas.addEventListener("mouseleave", () => { tip.style.display = "none"; });
canvas.addEventListener("dblclick", () => { view = {scale: 1, ox: 0, oy: 0}; draw(); });

document.getElementById("title").textContent = D.title;
document.getElementById("subtitle").textContent = D.subtitle;
document.getElementById("point-count").textContent = N;
const select = document.getElementById("colour-by");
for (const name of Object.keys(modes)) {
  const o = document.createElement("option"); o.value = o.textContent = name; select.appendChild(o);
}
// A link can carry the view: map.html#colour=source&search=volcano
const params = new URLSearchParams(location.hash.slice(1));
select.value = modes[params.get("colour")] ? params.get("colour") : (D.change ? "loss change" : "loss");
select.addEventListener("change", () => setMode(select.value));
fillTable();
buckets = group(select.value);
setMode(select.value);
if (params.get("search")) {
  const box = document.getElementById("search");
  box.value = params.get("search");
  box.dispatchEvent(new Event("input"));
}
window.addEventListener("resize", resize);
resize();
// #point=val:12 opens with that example's hover card, as if the pointer were on it.
const wanted = (params.get("point") || "").split(":");
const target = D.index.findIndex((v, i) => D.splits[D.split[i]] === wanted[0] && String(v) === wanted[1]);
if (target >= 0 && D.x[target] !== null) {
  const [sx, sy] = toScreen(target, frame());
  showTip(nearest(sx, sy), sx, sy);
}
document.body.dataset.ready = "1";
