// Number, size, time formatting and tiny DOM helpers shared by the dashboard's scripts.
// Everything that shows data sets textContent: run data never becomes markup.
"use strict";

const fmt = {
  int(n) {
    return n == null ? "–" : Math.round(n).toLocaleString("en-US");
  },
  si(n, digits = 3) {
    if (n == null) return "–";
    const a = Math.abs(n);
    if (a >= 1e9) return (n / 1e9).toPrecision(digits) + " G";
    if (a >= 1e6) return (n / 1e6).toPrecision(digits) + " M";
    if (a >= 1e4) return (n / 1e3).toPrecision(digits) + " k";
    return fmt.int(n);
  },
  bytes(n) {
    if (n == null) return "–";
    const units = ["B", "kB", "MB", "GB", "TB"];
    let i = 0;
    while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return (i === 0 ? String(n) : n.toPrecision(3)) + " " + units[i];
  },
  num(n, digits = 4) {
    if (n == null || !isFinite(n)) return "–";
    return Number(n).toPrecision(digits).replace(/\.?0+$/, "").replace(/\.?0+e/, "e");
  },
  seconds(s) {
    if (s == null || !isFinite(s)) return "–";
    if (s < 1) return Math.round(s * 1000) + " ms";
    if (s < 60) return s.toFixed(s < 10 ? 2 : 1) + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
    return Math.floor(s / 3600) + " h " + Math.round((s % 3600) / 60) + " min";
  },
  age(s) {
    if (s == null || !isFinite(s)) return "–";
    if (s < 1.5) return "just now";
    if (s < 90) return Math.round(s) + " s ago";
    if (s < 5400) return Math.round(s / 60) + " min ago";
    return Math.round(s / 3600) + " h ago";
  },
  clock(ts) {
    if (ts == null) return "–";
    const d = new Date(ts * 1000);
    return d.toLocaleTimeString("en-GB", { hour12: false });
  },
  percent(w) {
    return w == null ? "–" : (w * 100).toFixed(w >= 0.1 ? 0 : 1) + "%";
  },
  value(v) {
    if (v === null || v === undefined) return "null";
    return typeof v === "string" ? v : JSON.stringify(v);
  },
};

// el("td", {class: "num", text: "12"}, child, ...) -> element
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null || v === false) continue;
    if (k === "text") node.textContent = v;
    else if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) if (c != null) node.append(c);
  return node;
}

// One colour per participant, stable for the page's life (in order of first appearance).
const palette = ["#2563eb", "#d97706", "#059669", "#dc2626", "#7c3aed", "#0891b2", "#db2777", "#65a30d",
  "#9333ea", "#ea580c", "#0d9488", "#4f46e5"];
const colorOf = (() => {
  const seen = new Map();
  return (id) => {
    if (!seen.has(id)) seen.set(id, palette[seen.size % palette.length]);
    return seen.get(id);
  };
})();
