// A line chart as SVG: one or more series of [step, value] points, with the axes' ranges written at their ends.
// Written by hand: it is all the studio draws, and smaller than a charting package would be to vendor.

const NS = "http://www.w3.org/2000/svg";
const WIDTH = 320, HEIGHT = 150, LEFT = 48, RIGHT = 8, TOP = 18, BOTTOM = 20;

function node(name, attributes, text) {
  const element = document.createElementNS(NS, name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
  if (text !== undefined) element.textContent = text;
  return element;
}

export function formatNumber(value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "-";
  const magnitude = Math.abs(value);
  if (magnitude !== 0 && (magnitude < 1e-3 || magnitude >= 1e5)) return value.toExponential(2);
  return String(Number(value.toPrecision(4)));
}

// series: [{name, color, points: [[x, y], ...]}]. The svg's data-points says how many points are drawn.
export function drawChart(svg, title, series) {
  svg.replaceChildren();
  svg.setAttribute("viewBox", `0 0 ${WIDTH} ${HEIGHT}`);
  const all = series.flatMap(s => s.points).filter(([, y]) => Number.isFinite(y));
  svg.dataset.points = String(all.length);
  svg.append(node("text", {x: LEFT, y: 12, class: "chart-title"}, title));
  if (!all.length) {
    svg.append(node("text", {x: WIDTH / 2, y: HEIGHT / 2, class: "chart-empty", "text-anchor": "middle"},
                    "no data yet"));
    return;
  }
  const xs = all.map(([x]) => x), ys = all.map(([, y]) => y);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) {  // a constant (a flat learning rate): a band around it, not around zero
    const pad = Math.abs(y0) * 0.1 || 1;
    [y0, y1] = [y0 - pad, y1 + pad];
  }
  const px = x => LEFT + (x - x0) / (x1 - x0) * (WIDTH - LEFT - RIGHT);
  const py = y => HEIGHT - BOTTOM - (y - y0) / (y1 - y0) * (HEIGHT - TOP - BOTTOM);
  svg.append(node("rect", {x: LEFT, y: TOP, width: WIDTH - LEFT - RIGHT, height: HEIGHT - TOP - BOTTOM,
                           class: "chart-frame"}));
  svg.append(node("text", {x: LEFT - 4, y: TOP + 8, "text-anchor": "end", class: "chart-tick"}, formatNumber(y1)));
  svg.append(node("text", {x: LEFT - 4, y: HEIGHT - BOTTOM, "text-anchor": "end", class: "chart-tick"},
                  formatNumber(y0)));
  svg.append(node("text", {x: LEFT, y: HEIGHT - 6, class: "chart-tick"}, `step ${x0}`));
  svg.append(node("text", {x: WIDTH - RIGHT, y: HEIGHT - 6, "text-anchor": "end", class: "chart-tick"}, `${x1}`));
  for (const s of series) {
    const points = s.points.filter(([, y]) => Number.isFinite(y));
    if (!points.length) continue;
    const coordinates = points.map(([x, y]) => `${px(x).toFixed(1)},${py(y).toFixed(1)}`).join(" ");
    svg.append(node("polyline", {points: coordinates, stroke: s.color, class: "chart-line", "data-series": s.name}));
    if (points.length === 1) {
      svg.append(node("circle", {cx: px(points[0][0]), cy: py(points[0][1]), r: 2.5, fill: s.color}));
    }
  }
  if (series.length > 1) {
    series.forEach((s, i) => svg.append(node("text", {x: WIDTH - RIGHT - 70 * i, y: 12, "text-anchor": "end",
                                                      fill: s.color, class: "chart-tick"}, s.name)));
  }
}
