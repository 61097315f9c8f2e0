// Canvas charts for the latency tester: a histogram of the heard latencies and the latencies over
// the run (lost probes marked on the axis), with the p50 and p90 lines on both.

import { histogram, percentile } from "./latency-report.js";

const PAD = { left: 44, right: 10, top: 20, bottom: 26 };

function setup(canvas) {
  // Draw at the device's pixel density so lines stay sharp.
  const scale = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.width;
  const height = canvas.clientHeight || canvas.height;
  canvas.width = Math.round(width * scale);
  canvas.height = Math.round(height * scale);
  const g = canvas.getContext("2d");
  g.setTransform(scale, 0, 0, scale, 0, 0);
  g.clearRect(0, 0, width, height);
  const style = getComputedStyle(canvas);
  g.font = `11px ${style.fontFamily || "sans-serif"}`;
  return { g, width, height, ink: style.color || "#333" };
}

function niceStep(range, ticks) {
  const raw = range / Math.max(ticks, 1);
  const mag = 10 ** Math.floor(Math.log10(raw || 1));
  return [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) ?? 10 * mag;
}

function axes(c, x0, x1, y0, y1, xLabel, yLabel) {
  const { g, width, height, ink } = c;
  const w = width - PAD.left - PAD.right;
  const h = height - PAD.top - PAD.bottom;
  const sx = (x) => PAD.left + ((x - x0) / (x1 - x0 || 1)) * w;
  const sy = (y) => PAD.top + h - ((y - y0) / (y1 - y0 || 1)) * h;
  g.strokeStyle = ink;
  g.fillStyle = ink;
  g.globalAlpha = 0.6;
  g.beginPath();
  g.moveTo(PAD.left, PAD.top);
  g.lineTo(PAD.left, PAD.top + h);
  g.lineTo(PAD.left + w, PAD.top + h);
  g.stroke();
  g.globalAlpha = 1;
  const xs = niceStep(x1 - x0, 6);
  for (let x = Math.ceil(x0 / xs) * xs; x <= x1; x += xs) g.fillText(String(Math.round(x * 100) / 100), sx(x) - 8, PAD.top + h + 14);
  const ys = niceStep(y1 - y0, 4);
  for (let y = Math.ceil(y0 / ys) * ys; y <= y1; y += ys) g.fillText(String(Math.round(y * 100) / 100), 4, sy(y) + 4);
  g.fillText(xLabel, PAD.left + w - g.measureText(xLabel).width, PAD.top + h + 24);
  g.fillText(yLabel, 4, 12); // above the plot, clear of the markers' labels
  return { sx, sy, w, h };
}

function marker(c, x1, y1, x2, y2, color, label) {
  const { g } = c;
  g.save();
  g.strokeStyle = color;
  g.fillStyle = color;
  g.setLineDash([4, 3]);
  g.beginPath();
  g.moveTo(x1, y1);
  g.lineTo(x2, y2);
  g.stroke();
  g.fillText(label, x2 + 3 > x1 ? x1 + 3 : x2, Math.min(y1, y2) + 10);
  g.restore();
}

export function drawHistogram(canvas, latencies) {
  const c = setup(canvas);
  if (!latencies.length) return;
  const span = Math.max(...latencies) - Math.min(...latencies);
  const bin = Math.max(0.5, niceStep(span, 30));
  const hist = histogram(latencies, bin);
  const x1 = hist.start + hist.counts.length * bin;
  const { sx, sy } = axes(c, hist.start, x1, 0, Math.max(...hist.counts), "ms", "probes");
  c.g.fillStyle = "#6d9eeb";
  hist.counts.forEach((n, i) => {
    const left = sx(hist.start + i * bin);
    const right = sx(hist.start + (i + 1) * bin);
    c.g.fillRect(left + 0.5, sy(n), Math.max(1, right - left - 1), sy(0) - sy(n));
  });
  for (const [q, color] of [[50, "#38761d"], [90, "#b45f06"]]) {
    const x = sx(percentile(latencies, q));
    marker(c, x, sy(0), x, sy(Math.max(...hist.counts)), color, `p${q}`);
  }
}

export function drawSeries(canvas, probes) {
  const c = setup(canvas);
  const heard = probes.filter((p) => p.latency_ms !== null);
  if (!probes.length) return;
  const values = heard.map((p) => p.latency_ms);
  const lo = values.length ? Math.min(...values) : 0;
  const hi = values.length ? Math.max(...values) : 1;
  const margin = Math.max(1, (hi - lo) * 0.1);
  const { sx, sy } = axes(c, 0, Math.max(1, probes.length - 1), Math.max(0, lo - margin), hi + margin, "probe", "ms");
  const { g } = c;
  g.strokeStyle = "#3d85c6";
  g.beginPath();
  heard.forEach((p, i) => (i ? g.lineTo(sx(p.index), sy(p.latency_ms)) : g.moveTo(sx(p.index), sy(p.latency_ms))));
  g.stroke();
  g.fillStyle = "#3d85c6";
  for (const p of heard) g.fillRect(sx(p.index) - 1.5, sy(p.latency_ms) - 1.5, 3, 3);
  g.fillStyle = "#cc0000";
  for (const p of probes) if (p.latency_ms === null) g.fillText("×", sx(p.index) - 3, sy(Math.max(0, lo - margin)) - 2);
  if (values.length) {
    for (const [q, color] of [[50, "#38761d"], [90, "#b45f06"]]) {
      const y = sy(percentile(values, q));
      marker(c, sx(0), y, sx(Math.max(1, probes.length - 1)), y, color, `p${q}`);
    }
  }
}
