// agentjet dashboard: polls the run's /api every POLL_MS, keeps what it read in
// window.agentjetState, draws line charts on canvases and shows trajectories token by token.
// No libraries and nothing from another origin: the page works offline.
"use strict";

(function () {
  const POLL_MS = 2500;
  const GROUPS_SHOWN = 100;
  const COLORS = ["#2f6fdf", "#d2462f", "#2a9d5c", "#9b59b6", "#e08a00", "#17a2b8", "#7f8c8d", "#c2185b"];
  const token = new URLSearchParams(location.search).get("token") || "";

  // What the page has read; tests read it too (series lengths against the metrics files).
  const state = {
    run: "",
    rows: {},     // role -> rows read from metrics/<role>.jsonl
    offsets: {},  // role -> byte offset of the next read
    series: {},   // chart id -> series name -> [[unix time, value], ...]
    nodes: [],
    groups: [],
    envs: [],
    openGroup: null,
    polls: 0,
    lastError: "",
  };
  window.agentjetState = state;

  const isNumber = (v) => typeof v === "number" && Number.isFinite(v);
  const mean = (values) => values.reduce((a, b) => a + b, 0) / values.length;
  const stepRow = (r) => r.event === "step";
  const batchRow = (r) => r.event === "batch";

  // Each chart: which role's rows feed it, and the [series, value] points a row gives.
  const CHARTS = [
    {id: "reward", title: "Reward mean (rollout batches, per env)", from: {
      rollout: (r) => batchRow(r) && isNumber(r["charts/reward_mean"])
        ? [[r.env || "all", r["charts/reward_mean"]]] : []}},
    {id: "eval", title: "Held-out accuracy (per env)", from: {
      rollout: (r) => r.event !== "eval" ? [] : Object.keys(r)
        .filter((k) => /^eval\/.+\/accuracy$/.test(k) && isNumber(r[k]))
        .map((k) => [k.slice(5, -"/accuracy".length), r[k]])}},
    {id: "zero_variance", title: "Zero-variance groups (share of the step's groups)", from: {
      trainer: (r) => {
        const groups = Array.isArray(r.trained_group_ids) ? r.trained_group_ids.length : 0;
        const zero = r["charts/zero_variance_groups"];
        return stepRow(r) && isNumber(zero) && groups > 0 ? [["share", Math.min(zero / groups, 1)]] : [];
      }}},
    {id: "samples", title: "Samples/s", from: {
      trainer: (r) => stepRow(r) && isNumber(r["perf/samples_per_s"]) ? [["trainer", r["perf/samples_per_s"]]] : [],
      rollout: (r) => batchRow(r) && isNumber(r["perf/samples_per_s"]) ? [["rollout", r["perf/samples_per_s"]]] : []}},
    {id: "gen_tokens", title: "Generated tokens/s (rollout)", from: {
      rollout: (r) => batchRow(r) && isNumber(r["perf/gen_tokens_per_s"]) ? [["rollout", r["perf/gen_tokens_per_s"]]] : []}},
    {id: "staleness", title: "Staleness (policy versions behind)", from: {
      trainer: (r) => !stepRow(r) ? [] : [["mean", r["charts/staleness_mean"]], ["max", r["charts/staleness_max"]]]
        .filter((p) => isNumber(p[1]))}},
    {id: "step_time", title: "Step time (s)", from: {
      trainer: (r) => !stepRow(r) ? [] : [["learner step", r["perf/step_s"]], ["per version", r["perf/s_per_version"]]]
        .filter((p) => isNumber(p[1]))}},
    {id: "logprob_gap", title: "Logprob gap, sampler vs learner (nats)", from: {
      trainer: (r) => {
        if (!stepRow(r)) return [];
        const points = isNumber(r["charts/logprob_gap_max"]) ? [["max", r["charts/logprob_gap_max"]]] : [];
        const gaps = Object.values(r.logprob_gaps || {}).filter(isNumber);
        return gaps.length ? points.concat([["mean", mean(gaps)]]) : points;
      }}},
    {id: "trained_tokens", title: "Trained tokens per step", from: {
      trainer: (r) => stepRow(r) && isNumber(r["charts/trained_tokens"]) ? [["tokens", r["charts/trained_tokens"]]] : []}},
  ];
  // One chart per losses/* key of the trainer's step rows, made when the key first appears.
  const lossChart = (key) => ({id: key, title: key, from: {
    trainer: (r) => stepRow(r) && isNumber(r[key]) ? [[key.slice("losses/".length), r[key]]] : []}});

  // ── fetching ────────────────────────────────────────────────────────────────────────

  async function api(path) {
    const headers = token ? {Authorization: "Bearer " + token} : {};
    const reply = await fetch(path, {headers: headers, cache: "no-store"});
    const body = await reply.json();
    if (!reply.ok) {
      const error = new Error(body.error || reply.statusText);
      error.status = reply.status;
      throw error;
    }
    return body;
  }

  async function readMetrics(role) {
    for (;;) {
      const offset = state.offsets[role] || 0;
      let body;
      try {
        body = await api("/api/metrics?role=" + encodeURIComponent(role) + "&offset=" + offset);
      } catch (e) {
        if (e.status === 400 && offset > 0) {  // the file was replaced: read it all again
          resetMetrics();
          return false;
        }
        throw e;
      }
      for (const row of body.rows) addRow(role, row);
      state.rows[role] = (state.rows[role] || 0) + body.rows.length;
      state.offsets[role] = body.next_offset;
      if (!body.more) return body.rows.length > 0 || offset === 0;
    }
  }

  function resetMetrics() {
    state.rows = {};
    state.offsets = {};
    state.series = {};
  }

  function addRow(role, row) {
    if (!isNumber(row.time)) return;
    if (role === "trainer" && stepRow(row)) {
      for (const key of Object.keys(row)) {
        if (key.startsWith("losses/") && !CHARTS.some((c) => c.id === key)) CHARTS.push(lossChart(key));
      }
    }
    for (const chart of CHARTS) {
      const points = chart.from[role] ? chart.from[role](row) : [];
      if (!points.length) continue;
      const series = (state.series[chart.id] = state.series[chart.id] || {});
      for (const [name, value] of points) (series[name] = series[name] || []).push([row.time, value]);
    }
  }

  async function loadGroups() {
    const env = document.getElementById("env-filter").value;
    const list = await api("/api/trajectories?limit=" + GROUPS_SHOWN + (env ? "&env=" + encodeURIComponent(env) : ""));
    const changed = JSON.stringify(list.groups) !== JSON.stringify(state.groups) || list.envs.length !== state.envs.length;
    state.groups = list.groups;
    state.envs = list.envs;
    return changed;
  }

  async function poll() {
    try {
      const roles = await api("/api/roles");
      state.run = roles.run;
      let changed = false;
      for (const {role} of roles.roles) changed = (await readMetrics(role)) || changed;
      state.nodes = (await api("/api/nodes")).nodes;
      const groupsChanged = await loadGroups();
      state.polls += 1;
      state.lastError = "";
      render(changed, groupsChanged);
      setStatus("updated " + new Date().toLocaleTimeString(), false);
    } catch (e) {
      state.lastError = String(e.message || e);
      setStatus("cannot read the run: " + state.lastError + " (retrying)", true);
    }
    setTimeout(poll, POLL_MS);
  }

  // ── rendering ───────────────────────────────────────────────────────────────────────

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;  // never innerHTML: model text is data
    return node;
  }

  function setStatus(text, error) {
    const status = document.getElementById("status");
    status.textContent = text;
    status.classList.toggle("error", error);
  }

  function activeTab() {
    return document.querySelector("nav button.active").dataset.tab;
  }

  function render(metricsChanged, groupsChanged) {
    document.getElementById("run").textContent = state.run ? "run " + state.run : "";
    if (activeTab() === "curves" && metricsChanged) drawCharts();
    renderNodes();
    if (groupsChanged) renderGroups();
  }

  const fmt = (v, digits) => isNumber(v) ? (Number.isInteger(v) ? String(v) : v.toFixed(digits === undefined ? 3 : digits)) : "-";

  function ago(time) {
    if (!isNumber(time)) return "-";
    const s = Math.max(0, Date.now() / 1000 - time);
    return s < 120 ? s.toFixed(0) + " s ago" : (s / 60).toFixed(0) + " min ago";
  }

  function renderNodes() {
    const body = document.querySelector("#nodes tbody");
    body.replaceChildren();
    for (const n of state.nodes) {
      const tr = el("tr", {"data-role": n.role});
      tr.append(el("td", {}, n.role));
      tr.append(el("td", {class: "num"}, fmt(n.policy_version)));
      tr.append(el("td", {class: "num"}, fmt(n.queue)));
      tr.append(el("td", {class: "num"}, fmt(n.samples_per_s, 2)));
      tr.append(el("td", {class: "num"}, ago(n.time)));
      tr.append(el("td", {}, n.event || "-"));
      const memory = Object.entries(n.memory || {}).map(([k, v]) => k + " " + fmt(v, 0)).join(", ");
      tr.append(el("td", {class: "memory"}, memory || "-"));
      body.append(tr);
    }
  }

  // ── charts ──────────────────────────────────────────────────────────────────────────

  function drawCharts() {
    const holder = document.getElementById("charts");
    let start = Infinity, end = -Infinity;
    for (const chart of Object.values(state.series)) {
      for (const points of Object.values(chart)) {
        if (points.length) [start, end] = [Math.min(start, points[0][0]), Math.max(end, points[points.length - 1][0])];
      }
    }
    // The x axis of every chart: time since the run's first point, in a unit that fits it.
    const span = end - start;
    const axis = {start: start, ...(span < 180 ? {per: 1, unit: "s"} : span < 3 * 3600 ? {per: 60, unit: "min"} : {per: 3600, unit: "h"})};
    for (const chart of CHARTS) {
      let card = document.getElementById("chart-" + chart.id);
      if (!card) {
        card = el("div", {class: "chart", id: "chart-" + chart.id});
        card.append(el("h2", {}, chart.title), el("canvas"));
        holder.append(card);
      }
      drawChart(card.querySelector("canvas"), state.series[chart.id] || {}, axis);
    }
  }

  function niceTicks(low, high, count) {
    const span = high - low || Math.abs(high) || 1;
    const raw = span / count;
    const step = Math.pow(10, Math.floor(Math.log10(raw)));
    const unit = [1, 2, 5, 10].map((m) => m * step).find((s) => s >= raw) || raw;
    const ticks = [];
    for (let t = Math.ceil(low / unit) * unit; t <= high + unit * 1e-9; t += unit) ticks.push(t);
    return ticks;
  }

  function range(values) {  // not Math.min(...values): a long run has too many to spread
    let low = Infinity, high = -Infinity;
    for (const v of values) { if (v < low) low = v; if (v > high) high = v; }
    return [low, high];
  }

  function drawChart(canvas, series, axis) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth, height = canvas.clientHeight;
    if (!width || !height) return;
    canvas.width = width * ratio;
    canvas.height = height * ratio;
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    ctx.clearRect(0, 0, width, height);
    ctx.font = "11px system-ui, sans-serif";
    const names = Object.keys(series).sort();
    const all = names.flatMap((n) => series[n]);
    if (!all.length) {
      ctx.fillStyle = "#6b7480";
      ctx.fillText("no data yet", 8, 20);
      return;
    }
    const at = (t) => (t - axis.start) / axis.per;
    const xs = all.map((p) => at(p[0])), ys = all.map((p) => p[1]);
    let [x0, x1] = range(xs);
    let [y0, y1] = range(ys);
    if (x1 === x0) x1 = x0 + 1;
    if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
    const pad = {left: 46, right: 10, top: 20, bottom: 22};
    const px = (x) => pad.left + (x - x0) / (x1 - x0) * (width - pad.left - pad.right);
    const py = (y) => height - pad.bottom - (y - y0) / (y1 - y0) * (height - pad.top - pad.bottom);
    ctx.strokeStyle = "#e6e8ec";
    ctx.fillStyle = "#6b7480";
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    for (const t of niceTicks(y0, y1, 4)) {
      ctx.beginPath(); ctx.moveTo(pad.left, py(t)); ctx.lineTo(width - pad.right, py(t)); ctx.stroke();
      ctx.fillText(Number(t.toPrecision(4)).toString(), pad.left - 4, py(t) + 4);
    }
    ctx.textAlign = "center";
    for (const t of niceTicks(x0, x1, 5)) ctx.fillText(Number(t.toPrecision(4)) + "", px(t), height - 6);
    ctx.textAlign = "right";
    ctx.fillText(axis.unit, width - 2, height - 6);
    let legendX = pad.left;
    names.forEach((name, i) => {
      const color = COLORS[i % COLORS.length];
      const points = series[name];
      ctx.strokeStyle = ctx.fillStyle = color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      points.forEach(([t, v], j) => {
        const x = px(at(t)), y = py(v);
        if (j === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
      });
      ctx.stroke();
      if (points.length < 60) {
        for (const [t, v] of points) {
          ctx.beginPath(); ctx.arc(px(at(t)), py(v), 2, 0, 2 * Math.PI); ctx.fill();
        }
      }
      const label = name + " " + fmt(points[points.length - 1][1]);
      ctx.textAlign = "left";
      ctx.fillRect(legendX, 6, 10, 3);
      ctx.fillText(label, legendX + 14, 11);
      legendX += ctx.measureText(label).width + 28;
    });
  }

  // ── trajectories ────────────────────────────────────────────────────────────────────

  function renderGroups() {
    const select = document.getElementById("env-filter");
    const chosen = select.value;
    select.replaceChildren(el("option", {value: ""}, "all"));
    for (const env of state.envs) select.append(el("option", {value: env}, env));
    select.value = state.envs.includes(chosen) ? chosen : "";
    document.getElementById("no-groups").hidden = state.groups.length > 0;
    document.getElementById("group-count").textContent = state.groups.length ? state.groups.length + " newest groups" : "";
    const body = document.querySelector("#groups tbody");
    body.replaceChildren();
    for (const g of state.groups) {
      const tr = el("tr", {"data-group": g.group_id, title: "group " + g.group_id + " from " + (g.node_id || "?")});
      if (g.group_id === state.openGroup) tr.classList.add("open");
      tr.append(el("td", {}, isNumber(g.time) ? new Date(g.time * 1000).toLocaleTimeString() : "-"));
      tr.append(el("td", {}, g.env || "-"));
      tr.append(el("td", {}, g.task_id || "-"));
      tr.append(el("td", {class: "num"}, fmt(g.policy_version)));
      const rewards = el("td", {class: "rewards"});
      for (const r of g.rewards) rewards.append(el("span", {class: "reward" + (isNumber(r) && r > 0 ? " good" : "")}, fmt(r, 2)));
      tr.append(rewards);
      tr.addEventListener("click", () => openGroup(g.group_id));
      body.append(tr);
    }
  }

  async function openGroup(groupId) {
    state.openGroup = groupId;
    for (const tr of document.querySelectorAll("#groups tbody tr")) tr.classList.toggle("open", tr.dataset.group === groupId);
    const holder = document.getElementById("group");
    let group;
    try {
      group = await api("/api/trajectories/" + encodeURIComponent(groupId));
    } catch (e) {
      holder.replaceChildren(el("p", {class: "muted"}, "cannot open group " + groupId + ": " + (e.message || e)));
      return;
    }
    if (state.openGroup !== groupId) return;  // another was opened meanwhile
    holder.replaceChildren();
    holder.dataset.group = groupId;
    holder.append(el("h2", {}, (group.env || "?") + " · task " + (group.task_id || "?") + " · policy v" + fmt(group.policy_version) + " · " + (group.node_id || "")));
    const legend = el("p", {class: "legend"});
    for (const [cls, text] of [["prompt", "prompt"], ["context", "context (mask 0: not trained)"], ["trained", "trained (mask 1)"]]) {
      const item = el("span");
      item.append(el("span", {class: "swatch tok " + cls}), document.createTextNode(text));
      legend.append(item);
    }
    const mark = el("span");
    mark.append(el("span", {class: "boundary"}), document.createTextNode("a model call's reply starts (mask 0 → 1)"));
    legend.append(mark);
    holder.append(legend);
    const samples = Array.isArray(group.samples) ? group.samples : [];
    samples.forEach((sample, i) => holder.append(renderSample(sample || {}, i)));
  }

  function renderSample(sample, index) {
    const box = el("div", {class: "sample", "data-index": String(index)});
    const facts = ["reward " + fmt(sample.reward), "advantage " + fmt(sample.advantage)];
    if (sample.finish_reason) facts.push("finish " + sample.finish_reason);
    if (isNumber(sample.turns)) facts.push(sample.turns + " turns");
    if (sample.episode !== undefined && sample.episode !== null) facts.push("episode " + sample.episode);
    if (isNumber(sample.policy_version)) facts.push("policy v" + sample.policy_version);
    box.append(el("h3", {}, "sample " + (index + 1) + ": " + facts.join(" · ")));
    if (sample.error) box.append(el("p", {class: "error"}, String(sample.error)));
    const tip = " · reward " + fmt(sample.reward) + " · advantage " + fmt(sample.advantage);
    const tokens = el("div", {class: "tokens"});
    for (const t of Array.isArray(sample.prompt) ? sample.prompt : []) {
      const text = Array.isArray(t) ? String(t[0]) : "";
      tokens.append(el("span", {class: "tok prompt", title: "prompt " + JSON.stringify(text) + tip}, text));
    }
    let previous = 0;  // the prompt is context
    for (const t of Array.isArray(sample.completion) ? sample.completion : []) {
      if (!Array.isArray(t)) continue;
      const text = String(t[0]);
      const mask = t[1] ? 1 : 0;
      if (mask === 1 && previous === 0) tokens.append(el("span", {class: "boundary", title: "mask 0 → 1: the model's reply starts"}));
      const title = JSON.stringify(text) + " · logprob " + fmt(t[2], 4) + " · mask " + mask + tip;
      tokens.append(el("span", {class: "tok completion " + (mask ? "trained" : "context"), "data-mask": String(mask), title: title}, text));
      previous = mask;
    }
    box.append(tokens);
    return box;
  }

  // ── tabs ────────────────────────────────────────────────────────────────────────────

  for (const button of document.querySelectorAll("nav button")) {
    button.addEventListener("click", () => {
      for (const b of document.querySelectorAll("nav button")) b.classList.toggle("active", b === button);
      for (const s of document.querySelectorAll(".tab")) s.classList.toggle("active", s.id === "tab-" + button.dataset.tab);
      if (button.dataset.tab === "curves") drawCharts();
    });
  }
  document.getElementById("env-filter").addEventListener("change", () => {
    loadGroups().then(renderGroups, (e) => setStatus("cannot list trajectories: " + (e.message || e), true));
  });
  window.addEventListener("resize", () => { if (activeTab() === "curves") drawCharts(); });
  poll();
})();
