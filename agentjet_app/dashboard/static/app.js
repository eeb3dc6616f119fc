// agentjet dashboard: polls /api every POLL_MS (a run dir, or a live swarm: the same JSON),
// keeps what it read in window.agentjetState, draws charts on canvases, shows the nodes,
// the coordinator's scheduler and trajectories token by token.
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
    mode: "",     // "run" (a run dir) or "swarm" (live, --join)
    kinds: {},    // role -> coordinator | trainer | rollout (which charts its rows feed)
    labels: {},   // role -> what the page calls it (a node id in a swarm)
    rows: {},     // role -> rows read (metrics/<role>.jsonl, or a node's recent rows)
    offsets: {},  // role -> cursor of the next read (a byte offset, or a row number)
    series: {},   // chart id -> series name -> [[unix time, value], ...]
    histograms: {},  // chart id -> bucket -> count
    nodes: [],
    problems: [],
    scheduler: null,  // the last /api/scheduler reply
    schedulerPolls: 0,
    groups: [],
    envs: [],
    groupsNote: "",
    openGroup: null,
    polls: 0,
    lastError: "",
  };
  window.agentjetState = state;

  const isNumber = (v) => typeof v === "number" && Number.isFinite(v);
  const mean = (values) => values.reduce((a, b) => a + b, 0) / values.length;
  const stepRow = (r) => r.event === "step";
  const batchRow = (r) => r.event === "batch";

  const heartbeatRow = (r) => r.event === "heartbeat";  // a rollout node's record (live mode)
  const points = (pairs) => pairs.filter((p) => isNumber(p[1]));

  // Each chart: which kind of role's rows feed it, and the [series, value] points a row
  // gives (a histogram chart: the [bucket, count] a row adds).
  const CHARTS = [
    {id: "reward", title: "Reward mean (rollout batches per env; coordinator: reported groups)", from: {
      rollout: (r) => batchRow(r) && isNumber(r["charts/reward_mean"])
        ? [[r.env || "all", r["charts/reward_mean"]]] : [],
      coordinator: (r) => points([["coordinator", r["charts/mean_reward"]]])}},
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
    {id: "samples", title: "Samples/s (effective: samples with a gradient, per second of step)", from: {
      trainer: (r) => !stepRow(r) ? [] : points([
        ["trainer", r["perf/samples_per_s"]],
        ["trainer effective", r["charts/trained_samples"] / r["perf/s_per_version"]]]),
      rollout: (r) => (batchRow(r) || heartbeatRow(r)) && isNumber(r["perf/samples_per_s"])
        ? [["rollout", r["perf/samples_per_s"]]] : []}},
    {id: "gen_tokens", title: "Generated tokens/s (rollout)", from: {
      rollout: (r) => batchRow(r) && isNumber(r["perf/gen_tokens_per_s"]) ? [["rollout", r["perf/gen_tokens_per_s"]]] : []}},
    {id: "staleness", title: "Staleness (policy versions behind)", from: {
      trainer: (r) => !stepRow(r) ? [] : points([["mean", r["charts/staleness_mean"]], ["max", r["charts/staleness_max"]]])}},
    {id: "staleness_hist", histogram: true, title: "Staleness of trained groups (versions behind, count)", from: {
      trainer: (r) => !stepRow(r) || !Array.isArray(r.trained_group_versions) ? [] : r.trained_group_versions
        .filter(isNumber).map((v) => [Math.max(0, r.policy_version - 1 - v), 1])}},
    {id: "step_time", title: "Step time (s): learner step, waiting for groups, rollout batch, weight load", from: {
      trainer: (r) => !stepRow(r) ? [] : points([
        ["learner step", r["perf/step_s"]],
        ["waiting for groups", Math.max(0, r["perf/s_per_version"] - r["perf/step_s"])],
        ["per version", r["perf/s_per_version"]]]),
      rollout: (r) => points([["rollout batch", r["perf/batch_s"]], ["weight load", r["perf/load_s"]]])}},
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
  // Scheduler tables: [column, row key, digits] (digits "%": a share).
  const SCHEDULER_COLUMNS = {
    env: [["visits", "visits"], ["reward", "mean_reward", 3], ["variance", "variance", 3], ["P(mixed)", "mixed", 2],
          ["target", "target_share", 2], ["failed", "failure_rate", 2], ["keep", "keep", 2],
          ["grants", "grant_share", "%"]],
    cell: [["visits", "visits"], ["reward", "mean_reward", 3], ["variance", "variance", 3], ["P(mixed)", "mixed", 2],
           ["score", "score", 3], ["grants", "grant_share", "%"]],
    task: [["visits", "visits"], ["reward", "mean_reward", 3], ["variance", "variance", 3], ["P(mixed)", "mixed", 2],
           ["grants", "grant_share", "%"]],
  };

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
    state.histograms = {};
  }

  function addRow(role, row) {
    if (!isNumber(row.time)) return;
    const kind = state.kinds[role] || role;
    if (kind === "trainer" && stepRow(row)) {
      for (const key of Object.keys(row)) {
        if (key.startsWith("losses/") && !CHARTS.some((c) => c.id === key)) CHARTS.push(lossChart(key));
      }
    }
    // In a swarm several nodes share a kind: their series carry the node's name.
    const prefix = role === kind ? "" : (state.labels[role] || role) + " ";
    for (const chart of CHARTS) {
      const found = chart.from[kind] ? chart.from[kind](row) : [];
      if (!found.length) continue;
      if (chart.histogram) {
        const counts = (state.histograms[chart.id] = state.histograms[chart.id] || {});
        for (const [bucket, count] of found) counts[bucket] = (counts[bucket] || 0) + count;
        continue;
      }
      const series = (state.series[chart.id] = state.series[chart.id] || {});
      for (const [name, value] of found) (series[prefix + name] = series[prefix + name] || []).push([row.time, value]);
    }
  }

  async function loadGroups() {
    const env = document.getElementById("env-filter").value;
    const list = await api("/api/trajectories?limit=" + GROUPS_SHOWN + (env ? "&env=" + encodeURIComponent(env) : ""));
    const note = list.note || "";  // live mode: where trajectories are instead
    const changed = JSON.stringify(list.groups) !== JSON.stringify(state.groups) ||
      list.envs.length !== state.envs.length || note !== state.groupsNote;
    state.groups = list.groups;
    state.envs = list.envs;
    state.groupsNote = note;
    return changed;
  }

  async function loadScheduler() {
    state.scheduler = await api("/api/scheduler");
    state.schedulerPolls += 1;
    renderScheduler();
  }

  async function poll() {
    try {
      const roles = await api("/api/roles");
      state.run = roles.run;
      state.mode = roles.mode;
      state.problems = roles.problems || [];
      for (const {role, kind, label} of roles.roles) [state.kinds[role], state.labels[role]] = [kind, label];
      let changed = false;
      for (const {role} of roles.roles) changed = (await readMetrics(role)) || changed;
      state.nodes = (await api("/api/nodes")).nodes;
      // The viewer's list and the scheduler are read only while their tab is open.
      const groupsChanged = activeTab() === "trajectories" && await loadGroups();
      if (activeTab() === "scheduler") await loadScheduler();
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
    const live = state.mode === "swarm";
    document.getElementById("run").textContent = !state.run ? "" : (live ? "live swarm " : "run ") + state.run;
    for (const node of document.querySelectorAll(".live-only")) node.hidden = !live;
    for (const node of document.querySelectorAll(".run-only")) node.hidden = live;
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
      const tr = el("tr", {"data-role": n.role, "data-kind": n.kind || n.role});
      const name = el("td", {title: n.endpoint || n.label || n.role}, n.label || n.role);
      if (n.error) name.append(el("span", {class: "warn", title: n.error}, " (unreachable)"));
      tr.append(name);
      tr.append(el("td", {}, n.kind || "-"));
      tr.append(el("td", {class: "num"}, fmt(n.policy_version)));
      tr.append(el("td", {class: "num"}, fmt(n.queue) + (isNumber(n.capacity) ? "/" + n.capacity : "")));
      tr.append(el("td", {class: "num"}, fmt(n.samples_per_s, 2)));
      tr.append(el("td", {class: "num"}, ago(n.time)));
      tr.append(el("td", {}, n.source === "directory" ? "heartbeat" : (n.event || "-")));
      const rounds = [n.rounds_failed, n.rounds_partial, n.rounds_repaired];
      tr.append(el("td", {class: "num rounds"}, rounds.some(isNumber) ? rounds.map((v) => fmt(v)).join(" / ") : "-"));
      const quarantined = n.quarantined || [];
      const count = isNumber(n.quarantined_count) ? Math.max(n.quarantined_count, quarantined.length) : quarantined.length;
      tr.append(el("td", {class: "quarantined", title: quarantined.join(", ")}, count ? count + ": " + quarantined.join(", ") : "-"));
      const memory = Object.entries(n.memory || {}).map(([k, v]) => k + " " + fmt(v, 0)).join(", ");
      tr.append(el("td", {class: "memory"}, memory || "-"));
      body.append(tr);
    }
    document.getElementById("problems").textContent = state.problems.join("; ");
  }

  // ── scheduler ───────────────────────────────────────────────────────────────────────

  function renderScheduler() {
    const reply = state.scheduler;
    if (!reply) return;
    const holder = document.getElementById("scheduler");
    holder.replaceChildren();
    const where = el("p", {class: "muted"}, reply.endpoint ? "coordinator at " + reply.endpoint : "");
    holder.append(where);
    if (!reply.running) {
      holder.append(el("p", {class: "notice", id: "scheduler-message"}, reply.message));
      return;
    }
    const s = reply.status;
    const counters = [
      ["scheduler", s.scheduler || "?"], ["grants issued", s.grants_issued], ["completed", s.grants_completed],
      ["expired", s.grants_expired], ["leases open", s.leases_open], ["queued for re-grant", s.regrants_queued],
      ["messages rejected", s.rejected_messages], ["connections refused", s.denied_handshakes],
    ];
    const facts = el("p", {class: "facts"});
    for (const [name, value] of counters) {
      const item = el("span");
      item.append(el("b", {}, String(value)), document.createTextNode(" " + name));
      facts.append(item);
    }
    holder.append(facts);
    const nodes = Object.entries(s.nodes || {}).sort().map(([node, age]) => node + " (" + fmt(age, 1) + " s ago)");
    holder.append(el("p", {class: "muted"}, "nodes: " + (nodes.join(", ") || "none")));
    const titles = {env: "Environments (observed)", cell: "Top cells (predicted)", task: "Top tasks (predicted)"};
    for (const level of ["env", "cell", "task"]) {
      const rows = (s.table || []).filter((r) => r.level === level);
      if (!rows.length) continue;
      holder.append(el("h2", {}, titles[level]));
      const table = el("table", {class: "scheduler-table", "data-level": level});
      const head = el("tr");
      head.append(el("th", {}, level === "env" ? "environment" : level));
      for (const [title] of SCHEDULER_COLUMNS[level]) head.append(el("th", {}, title === "grants" ? "grants (last " + s.recent_grants + ")" : title));
      table.append(el("thead"), el("tbody"));
      table.tHead.append(head);
      for (const r of rows) {
        const tr = el("tr");
        tr.append(el("td", {}, r.name));
        for (const [, key, digits] of SCHEDULER_COLUMNS[level]) {
          const value = r[key];
          tr.append(el("td", {class: "num"}, digits === "%" ? (isNumber(value) ? (100 * value).toFixed(0) + "%" : "-") : fmt(value, digits)));
        }
        table.tBodies[0].append(tr);
      }
      holder.append(table);
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
      const canvas = card.querySelector("canvas");
      if (chart.histogram) drawHistogram(canvas, state.histograms[chart.id] || {});
      else drawChart(canvas, state.series[chart.id] || {}, axis);
    }
  }

  function prepare(canvas) {  // a canvas sized to its box; null while it has none
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth, height = canvas.clientHeight;
    if (!width || !height) return null;
    canvas.width = width * ratio;
    canvas.height = height * ratio;
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    ctx.clearRect(0, 0, width, height);
    ctx.font = "11px system-ui, sans-serif";
    return {ctx: ctx, width: width, height: height};
  }

  function drawHistogram(canvas, counts) {
    const box = prepare(canvas);
    if (!box) return;
    const {ctx, width, height} = box;
    const buckets = Object.keys(counts).map(Number).sort((a, b) => a - b);
    if (!buckets.length) {
      ctx.fillStyle = "#6b7480";
      ctx.fillText("no data yet", 8, 20);
      return;
    }
    const last = buckets[buckets.length - 1];
    const top = Math.max(...buckets.map((b) => counts[b]));
    const pad = {left: 46, right: 10, top: 20, bottom: 22};
    const slot = (width - pad.left - pad.right) / (last + 1);
    const py = (y) => height - pad.bottom - y / top * (height - pad.top - pad.bottom);
    ctx.strokeStyle = "#e6e8ec";
    ctx.fillStyle = "#6b7480";
    ctx.textAlign = "right";
    for (const t of niceTicks(0, top, 4)) {
      ctx.beginPath(); ctx.moveTo(pad.left, py(t)); ctx.lineTo(width - pad.right, py(t)); ctx.stroke();
      ctx.fillText(Number(t.toPrecision(4)).toString(), pad.left - 4, py(t) + 4);
    }
    ctx.textAlign = "center";
    for (let b = 0; b <= last; b++) {
      const x = pad.left + b * slot;
      ctx.fillStyle = COLORS[0];
      if (counts[b]) ctx.fillRect(x + slot * 0.15, py(counts[b]), slot * 0.7, py(0) - py(counts[b]));
      ctx.fillStyle = "#6b7480";
      if (last < 30 || b % Math.ceil(last / 15) === 0) ctx.fillText(String(b), x + slot / 2, height - 6);
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
    const box = prepare(canvas);
    if (!box) return;
    const {ctx, width, height} = box;
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
    // The legend: each series' name and newest value, in as many lines as it needs.
    const legend = [];
    let lineX = 46, line = 0;
    names.forEach((name, i) => {
      const label = name + " " + fmt(series[name][series[name].length - 1][1]);
      const w = ctx.measureText(label).width + 28;
      if (lineX + w > width && lineX > 46) [lineX, line] = [46, line + 1];
      legend.push({label: label, color: COLORS[i % COLORS.length], x: lineX, y: 11 + 13 * line});
      lineX += w;
    });
    const pad = {left: 46, right: 10, top: 20 + 13 * line, bottom: 22};
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
    names.forEach((name, i) => {
      const points = series[name];
      ctx.strokeStyle = ctx.fillStyle = legend[i].color;
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
      ctx.textAlign = "left";
      ctx.fillRect(legend[i].x, legend[i].y - 5, 10, 3);
      ctx.fillText(legend[i].label, legend[i].x + 14, legend[i].y);
    });
  }

  // ── trajectories ────────────────────────────────────────────────────────────────────

  function renderGroups() {
    const select = document.getElementById("env-filter");
    const chosen = select.value;
    select.replaceChildren(el("option", {value: ""}, "all"));
    for (const env of state.envs) select.append(el("option", {value: env}, env));
    select.value = state.envs.includes(chosen) ? chosen : "";
    const none = document.getElementById("no-groups");
    none.hidden = state.groups.length > 0;
    if (state.groupsNote) none.textContent = state.groupsNote;
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
      if (button.dataset.tab === "trajectories") {
        loadGroups().then(renderGroups, (e) => setStatus("cannot list trajectories: " + (e.message || e), true));
      }
      if (button.dataset.tab === "scheduler") {
        loadScheduler().catch((e) => setStatus("cannot ask the scheduler: " + (e.message || e), true));
      }
    });
  }
  document.getElementById("env-filter").addEventListener("change", () => {
    loadGroups().then(renderGroups, (e) => setStatus("cannot list trajectories: " + (e.message || e), true));
  });
  window.addEventListener("resize", () => { if (activeTab() === "curves") drawCharts(); });
  poll();
})();
