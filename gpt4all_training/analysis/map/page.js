"use strict";
const D = JSON.parse(document.getElementById("map-data").textContent);
const N = D.x.length;
const canvas = document.getElementById("map"), ctx = canvas.getContext("2d");
const overlay = document.getElementById("overlay"), overlayCtx = overlay.getContext("2d");
const tip = document.getElementById("tip");
let view = {scale: 1, ox: 0, oy: 0}, selected = null, activeCluster = null, buckets = null;

// Colour modes: every point's colour code, the order codes are drawn in (the notable last, so on top), a legend.
// The ramps' codes, colours, order and ticks come from Python (render.py), the same ones the PNG uses.
const clusterNames = [];
for (const c of D.clusters) clusterNames[c.cluster] = c.cluster + ": " + c.label;
const ramp = s => ({codes: s.code, colors: s.colors, order: s.order, legend: {kind: "ramp", ...s}});
function categorical(codes, names, title) {
  const colors = names.map((_, i) => D.categories[i % D.categories.length]);
  return {codes, colors, order: names.map((_, i) => i), legend: {kind: "list", title, names, colors}};
}
const modes = {
  loss: () => ramp(D.scales.loss),
  cluster: () => categorical(D.cluster, clusterNames, "cluster"),
  source: () => categorical(D.source, D.sources, "source"),
  split: () => categorical(D.split, D.splits, "split"),
};
// Then the loss change (--compare) and every other numeric column of the run: n_tokens and inference's scores.
for (const name of Object.keys(D.scales)) if (!modes[name]) modes[name] = () => ramp(D.scales[name]);

function group(mode) {
  const m = modes[mode](), lists = m.colors.map(() => []);
  for (let i = 0; i < N; i++) lists[m.codes[i]].push(i);
  return Object.assign(m, {lists});
}

function resize() {
  const r = canvas.parentElement.getBoundingClientRect(), dpr = window.devicePixelRatio || 1;
  for (const [c, context] of [[canvas, ctx], [overlay, overlayCtx]]) {
    c.width = Math.max(1, Math.round(r.width * dpr));
    c.height = Math.max(1, Math.round(r.height * dpr));
    context.setTransform(dpr, 0, 0, dpr, 0, 0);
  }
  draw();
}
function frame() {
  const w = canvas.clientWidth, h = canvas.clientHeight, pad = 12, side = Math.max(1, Math.min(w, h) - 2 * pad);
  return {left: (w - side) / 2, top: (h - side) / 2, side, w, h};
}
function toScreen(i, f) {
  return [(f.left + D.x[i] * f.side) * view.scale + view.ox, (f.top + (1 - D.y[i]) * f.side) * view.scale + view.oy];
}
// About a third of the spacing that evenly spread points would have (2 to 8 pixels), growing as you zoom in.
function pointSize(f) {
  const even = Math.min(Math.max(0.35 * f.side / Math.sqrt(Math.max(N, 1)), 2), 8);
  return Math.min(even * Math.sqrt(view.scale), 16);
}

function draw() {
  const f = frame(), size = pointSize(f), half = size / 2, round = size >= 4;
  ctx.fillStyle = D.background;
  ctx.fillRect(0, 0, f.w, f.h);
  let drawn = 0;
  const pass = (alpha, wanted) => {
    ctx.globalAlpha = alpha;
    for (const b of buckets.order) {
      const list = buckets.lists[b];
      if (!list.length) continue;
      ctx.fillStyle = buckets.colors[b];
      if (round) ctx.beginPath();
      for (const i of list) {
        if (D.x[i] === null || (selected !== null && selected[i] !== wanted)) continue;
        const [sx, sy] = toScreen(i, f);
        if (sx < -half || sy < -half || sx > f.w + half || sy > f.h + half) continue;
        if (round) { ctx.moveTo(sx + half, sy); ctx.arc(sx, sy, half, 0, 2 * Math.PI); }
        else ctx.fillRect(sx - half, sy - half, size, size);
        drawn++;
      }
      if (round) ctx.fill();
    }
  };
  if (selected === null) pass(0.9, 0);
  else {
    pass(0.12, 0);
    ctx.globalAlpha = 1;
    ctx.strokeStyle = "#fff";
    for (let i = 0; i < N; i++) {
      if (!selected[i] || D.x[i] === null) continue;
      const [sx, sy] = toScreen(i, f);
      ctx.strokeRect(sx - half - 1.5, sy - half - 1.5, size + 3, size + 3);
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
    const bar = document.createElement("div"), ticks = document.createElement("div");
    const title = document.createElement("div");
    bar.className = "bar";
    bar.style.background = "linear-gradient(to right," + lg.colors.slice(0, -1).join(",") + ")";
    ticks.className = "ticks";
    for (const [position, label] of lg.ticks) {
      const s = document.createElement("span");
      s.style.left = (100 * position) + "%";
      s.textContent = label;
      ticks.appendChild(s);
    }
    title.className = "legend-title";
    title.textContent = lg.title;
    legend.append(bar, ticks, title);
  } else {
    lg.names.forEach((name, i) => {
      const item = document.createElement("div"), sw = document.createElement("span");
      sw.className = "swatch"; sw.style.background = lg.colors[i];
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
  const f = frame(), scale = f.side * view.scale, radius = Math.max(8, pointSize(f) / 2);
  const dx = ((mx - view.ox) / view.scale - f.left) / f.side, dy = 1 - ((my - view.oy) / view.scale - f.top) / f.side;
  const r = radius / scale, c0 = Math.floor((dx - r) * G), c1 = Math.floor((dx + r) * G);
  const d0 = Math.floor((dy - r) * G), d1 = Math.floor((dy + r) * G);
  let best = -1, bestD = radius * radius;
  for (let cx = Math.max(0, c0); cx <= Math.min(G - 1, c1); cx++)
    for (let cy = Math.max(0, d0); cy <= Math.min(G - 1, d1); cy++)
      for (let k = cellStart[cx * G + cy]; k < cellStart[cx * G + cy + 1]; k++) {
        const i = cellItems[k];
        if (selected !== null && !selected[i]) continue;
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
  const values = Object.keys(D.values).map(name => name + " " + fmt(D.values[name][i]));
  if (values.length) head += "\n" + values.join("  ");
  head += "\ncluster " + D.cluster[i] + ": " + cl.label;
  tip.replaceChildren();
  const b1 = document.createElement("b"), b2 = document.createElement("b");
  b1.textContent = "\nprompt: "; b2.textContent = "\nresponse: ";
  tip.append(document.createTextNode(head), b1, document.createTextNode(D.prompt[i]), b2,
             document.createTextNode(D.response[i]));
  if (D.model_answer) {
    const b3 = document.createElement("b");
    b3.textContent = "\nmodel's answer: ";
    tip.append(b3, document.createTextNode(D.model_answer[i]));
  }
  tip.style.display = "block";
  const w = canvas.clientWidth;
  tip.style.left = Math.min(mx + 14, w - 450) + "px";
  tip.style.top = (my + 14) + "px";
}

// The selection: search matches, a cluster (a click on its row) or a lasso. Its example ids (the records' index in
// the dataset) are what `gpt4all-training curate --exclude-ids FILE` and `--include-ids FILE` read.
function selectedIds() {
  const ids = [];
  if (selected) for (let i = 0; i < N; i++) if (selected[i]) ids.push(D.index[i]);
  return ids.sort((a, b) => a - b);
}
const selectionJson = () => JSON.stringify({input: D.input, ids: selectedIds()});
function setSelection(mask) {
  selected = mask;
  let count = 0;
  if (mask) for (let i = 0; i < N; i++) count += mask[i];
  document.getElementById("match-count").textContent = count;
  document.getElementById("export").disabled = document.getElementById("clear").disabled = !mask;
  document.getElementById("selection-json").textContent = mask ? selectionJson() : "";
  draw();
}
function clearCluster() {
  activeCluster = null;
  document.querySelectorAll("tr.cluster-row.active").forEach(r => r.classList.remove("active"));
}
document.getElementById("export").addEventListener("click", () => {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([selectionJson()], {type: "application/json"}));
  link.download = "selection.json";
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
});
document.getElementById("clear").addEventListener("click", () => {
  clearCluster();
  document.getElementById("search").value = "";
  setSelection(null);
});

const haystack = D.prompt.map((p, i) => (p + "\n" + D.response[i]).toLowerCase());
document.getElementById("search").addEventListener("input", e => {
  const q = e.target.value.trim().toLowerCase();
  clearCluster();
  setSelection(q ? Uint8Array.from(haystack, t => t.includes(q) ? 1 : 0) : null);
});

let lassoMode = false, lasso = null;
const lassoButton = document.getElementById("lasso");
lassoButton.addEventListener("click", () => {
  lassoMode = !lassoMode;
  lassoButton.setAttribute("aria-pressed", String(lassoMode));
  canvas.classList.toggle("lasso", lassoMode);
});
function drawLasso() {
  overlayCtx.clearRect(0, 0, overlay.width, overlay.height);
  if (!lasso) return;
  overlayCtx.strokeStyle = "#fff";
  overlayCtx.setLineDash([4, 3]);
  overlayCtx.beginPath();
  lasso.forEach(([x, y], k) => k ? overlayCtx.lineTo(x, y) : overlayCtx.moveTo(x, y));
  overlayCtx.closePath();
  overlayCtx.stroke();
}
function inside(polygon, x, y) {  // even-odd rule: a ray to the right crosses the boundary an odd number of times
  let odd = false;
  for (let a = 0, b = polygon.length - 1; a < polygon.length; b = a++) {
    const [xa, ya] = polygon[a], [xb, yb] = polygon[b];
    if ((ya > y) !== (yb > y) && x < xa + (y - ya) * (xb - xa) / (yb - ya)) odd = !odd;
  }
  return odd;
}
function finishLasso() {
  const polygon = lasso;
  lasso = null;
  drawLasso();
  if (polygon.length < 3) return;
  const f = frame(), mask = new Uint8Array(N);
  const xs = polygon.map(p => p[0]), ys = polygon.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  for (let i = 0; i < N; i++) {
    if (D.x[i] === null) continue;
    const [sx, sy] = toScreen(i, f);
    if (sx >= x0 && sx <= x1 && sy >= y0 && sy <= y1 && inside(polygon, sx, sy)) mask[i] = 1;
  }
  clearCluster();
  document.getElementById("search").value = "";
  fillTable();
  setSelection(mask);
}

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
      setSelection(activeCluster === null ? null : Uint8Array.from(D.cluster, v => v === activeCluster ? 1 : 0));
    });
    body.appendChild(tr);
  }
}

// Zoom around the cursor, drag to pan (shift-drag, or any drag with the lasso on, selects), double-click resets.
let drag = null;
canvas.addEventListener("wheel", e => {
  e.preventDefault();
  const k = Math.exp(-e.deltaY * 0.0015);
  view.ox = e.offsetX - (e.offsetX - view.ox) * k;
  view.oy = e.offsetY - (e.offsetY - view.oy) * k;
  view.scale *= k;
  draw();
}, {passive: false});
canvas.addEventListener("mousedown", e => {
  tip.style.display = "none";
  if (lassoMode || e.shiftKey) lasso = [[e.offsetX, e.offsetY]];
  else drag = {x: e.offsetX, y: e.offsetY};
});
window.addEventListener("mouseup", () => {
  drag = null;
  if (lasso) finishLasso();
});
canvas.addEventListener("mousemove", e => {
  if (lasso) { lasso.push([e.offsetX, e.offsetY]); return drawLasso(); }
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
const select = document.getElementById("color-by");
for (const name of Object.keys(modes)) {
  const o = document.createElement("option"); o.value = o.textContent = name; select.appendChild(o);
}
// A link can carry the view: map.html#color=source&search=volcano
const params = new URLSearchParams(location.hash.slice(1));
select.value = modes[params.get("color")] ? params.get("color") : D.color;
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
