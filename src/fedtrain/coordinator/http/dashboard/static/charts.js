// Small SVG line charts, written for this dashboard (no library, no build step).
//
//   lineChart(container, series, {xLabel, empty, height})
//   series: [{key, label, color, dash, width, points: [[x, y], ...]}]
//
// The chart is redrawn from scratch on every call; the container's width sets the size.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v != null) node.setAttribute(k, v);
  if (text != null) node.textContent = text;
  return node;
}

// About `count` round numbers covering [min, max].
function niceTicks(min, max, count) {
  if (!(max > min)) { const d = Math.abs(min) * 0.1 || 1; min -= d; max += d; }
  const raw = (max - min) / Math.max(1, count);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || 10 * mag;
  const lo = Math.floor(min / step) * step;
  const hi = Math.ceil(max / step) * step;
  const ticks = [];
  for (let v = lo; v <= hi + step * 1e-9; v += step) ticks.push(Number(v.toPrecision(12)));
  return { lo, hi, step, ticks };
}

function tickLabel(v, step) {
  const decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  return v.toFixed(Math.min(decimals, 6));
}

function lineChart(container, series, opts = {}) {
  container.replaceChildren();
  const drawn = series.filter((s) => s.points.length > 0);
  if (drawn.length === 0) {
    container.append(el("div", { class: "chart-empty", text: opts.empty || "No data yet." }));
    return;
  }
  const width = Math.max(320, container.clientWidth || 600);
  const height = opts.height || 250;
  const m = { left: 54, right: 14, top: 12, bottom: 36 };
  const xs = drawn.flatMap((s) => s.points.map((p) => p[0]));
  const ys = drawn.flatMap((s) => s.points.map((p) => p[1]));
  let xMin = Math.min(...xs), xMax = Math.max(...xs);
  if (xMin === xMax) { xMin -= 1; xMax += 1; }
  const yPad = (Math.max(...ys) - Math.min(...ys)) * 0.05;
  const yt = niceTicks(Math.min(...ys) - yPad, Math.max(...ys) + yPad, 5);
  const xt = niceTicks(xMin, xMax, Math.min(10, Math.max(2, Math.floor((width - 80) / 70))));
  const xStep = Math.max(1, Math.ceil(xt.step)); // rounds are integers
  const xTicks = [];
  for (let v = Math.ceil(xMin / xStep) * xStep; v <= xMax; v += xStep) xTicks.push(v);
  const px = (x) => m.left + ((x - xMin) / (xMax - xMin)) * (width - m.left - m.right);
  const py = (y) => m.top + (1 - (y - yt.lo) / (yt.hi - yt.lo)) * (height - m.top - m.bottom);

  const root = svgEl("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "chart-svg", role: "img" });
  const grid = svgEl("g", { class: "grid" });
  for (const v of yt.ticks) {
    grid.append(svgEl("line", { x1: m.left, x2: width - m.right, y1: py(v), y2: py(v) }));
    grid.append(svgEl("text", { x: m.left - 6, y: py(v) + 4, "text-anchor": "end" }, tickLabel(v, yt.step)));
  }
  for (const v of xTicks) {
    grid.append(svgEl("line", { x1: px(v), x2: px(v), y1: m.top, y2: height - m.bottom, class: "vgrid" }));
    grid.append(svgEl("text", { x: px(v), y: height - m.bottom + 16, "text-anchor": "middle" }, String(v)));
  }
  grid.append(svgEl("text", { x: (m.left + width - m.right) / 2, y: height - 4, "text-anchor": "middle",
    class: "axis-label" }, opts.xLabel || "round"));
  root.append(grid);

  for (const s of drawn) {
    const pts = [...s.points].sort((a, b) => a[0] - b[0]);
    const d = pts.map((p, i) => `${i ? "L" : "M"}${px(p[0]).toFixed(1)},${py(p[1]).toFixed(1)}`).join("");
    const g = svgEl("g", { class: "series-group" });
    g.append(svgEl("path", { d, class: "series", "data-key": s.key, stroke: s.color, fill: "none",
      "stroke-width": s.width || 2, "stroke-dasharray": s.dash || null, "stroke-linejoin": "round" }));
    if (pts.length <= 80) {
      for (const p of pts) {
        const dot = svgEl("circle", { cx: px(p[0]), cy: py(p[1]), r: s.dash ? 2.2 : 2.8, fill: s.color });
        dot.append(svgEl("title", {}, `${s.label} · round ${p[0]}: ${fmt.num(p[1])}`));
        g.append(dot);
      }
    }
    root.append(g);
  }
  container.append(root);

  const legend = el("div", { class: "legend" });
  const seen = new Set();
  for (const s of drawn) {
    const key = s.legendKey || s.key;
    if (seen.has(key)) continue;
    seen.add(key);
    const swatch = el("span", { class: "swatch" });
    swatch.style.background = s.color;
    legend.append(el("span", { class: "legend-item" }, swatch, s.legendLabel || s.label));
  }
  for (const note of opts.notes || []) legend.append(el("span", { class: "legend-note", text: note }));
  container.append(legend);
}
