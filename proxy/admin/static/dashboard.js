// The operator's dashboard. Everything comes from <prefix>/api/overview (the ledger and the
// worker pool); writes (log out) carry the session's CSRF token. No secret is ever shown:
// the API never returns one here, and the admin key typed at login is sent once and dropped.
"use strict";

(function () {
  const prefix = location.pathname.replace(/\/+$/, "").replace(/\/index\.html$/, "");
  const state = { csrf: null, charts: {}, data: null, view: "spend" };
  const $ = (id) => document.getElementById(id);
  const palette = ["#2f6fde", "#e8590c", "#2b8a3e", "#c2255c", "#7048e8", "#0c8599", "#e67700", "#5c940d",
                   "#a61e4d", "#364fc7"];

  // Dollars from micro-dollars (the API's unit), exactly: cents always, then the further
  // digits the amount has (2810 -> "$0.00281", 1500000 -> "$1.50", 1234567890 -> "$1,234.56789").
  function money(micros) {
    if (micros === null || micros === undefined) return "-";
    const sign = micros < 0 ? "-" : "", abs = Math.abs(Math.round(micros));
    const whole = Math.floor(abs / 1e6), frac = String(abs % 1e6).padStart(6, "0").replace(/0{1,4}$/, "");
    return sign + "$" + whole.toLocaleString("en-US") + "." + frac.padEnd(2, "0");
  }
  function int(n) { return String(n); }

  async function api(path, options) {
    const opts = Object.assign({ credentials: "same-origin", headers: {} }, options || {});
    if (opts.method && opts.method !== "GET" && state.csrf) opts.headers["X-CSRF-Token"] = state.csrf;
    const response = await fetch(prefix + path, opts);
    let body = null;
    try { body = await response.json(); } catch (e) { body = null; }
    return { status: response.status, body: body };
  }

  function show(loggedIn) {
    $("login").hidden = loggedIn;
    $("app").hidden = !loggedIn;
    $("nav").hidden = !loggedIn;
    $("controls").hidden = !loggedIn;
  }

  async function start() {
    const session = await api("/api/session");
    if (session.status !== 200) { show(false); await loginOptions(); return; }
    state.csrf = session.body.csrf_token;
    $("who").textContent = session.body.role + ": " + session.body.name;
    state.role = session.body.role;
    // A viewer is shown no writing control, a team admin none that moves money (the server
    // refuses those writes all the same).
    document.querySelectorAll(".writes").forEach((el) => { el.hidden = !canWrite(); });
    document.querySelectorAll(".money").forEach((el) => { el.hidden = state.role !== "admin"; });
    show(true);
    await load();
  }

  // Single sign-on, when the operator configured it: a link to the provider; and why the last
  // sign-on was refused, when the provider's return was (the server says it in ?sso_error=).
  async function loginOptions() {
    const refused = new URLSearchParams(location.search).get("sso_error");
    if (refused) $("login-error").textContent = "Single sign-on refused: " + refused;
    const options = await api("/login-options");
    const oidc = options.status === 200 && options.body ? options.body.oidc : null;
    if (!oidc) return;
    $("sso").textContent = oidc.label;
    $("sso").href = oidc.url;
    $("sso-box").hidden = false;
  }

  async function login(event) {
    event.preventDefault();
    const input = $("admin-key");
    const result = await api("/login", { method: "POST", headers: { "Content-Type": "application/json" },
                                         body: JSON.stringify({ key: input.value }) });
    input.value = "";
    if (result.status !== 200) {
      $("login-error").textContent = (result.body && result.body.error && result.body.error.message) || "Login failed.";
      return;
    }
    $("login-error").textContent = "";
    await start();
  }

  async function logout() {
    await api("/api/logout", { method: "POST" });
    state.csrf = null;
    show(false);
  }

  function bucketLabel(iso, bucket) {
    return bucket === "hour" ? iso.slice(5, 13).replace("T", " ") + ":00" : iso.slice(0, 10);
  }

  // rows: [{<bucket>: iso, <dim>: name, ...sums}] -> Chart.js line datasets, one per dim value.
  function series(rows, bucket, dim, value, names, every) {
    const labels = [...new Set([...(every || []), ...rows.map((r) => r[bucket])])].sort();
    const groups = [...new Set(rows.map((r) => r[dim]))].sort();
    const datasets = groups.map((g, i) => {
      const byBucket = new Map(rows.filter((r) => r[dim] === g).map((r) => [r[bucket], value(r)]));
      const colour = palette[i % palette.length];
      return { label: (names && names[g]) ? names[g] + " (" + g + ")" : String(g), borderColor: colour,
               backgroundColor: colour + "55", data: labels.map((l) => byBucket.get(l) || 0), cubicInterpolationMode: "monotone",
               pointRadius: 2 };
    });
    return { labels: labels.map((l) => bucketLabel(l, bucket)), datasets: datasets };
  }

  function draw(id, type, data, options) {
    if (state.charts[id]) state.charts[id].destroy();
    state.charts[id] = new Chart($(id), { type: type, data: data, options: Object.assign({
      responsive: true, maintainAspectRatio: false, animation: false,
      plugins: { legend: { position: "bottom" } } }, options || {}) });
  }

  function area(data) {
    data.datasets.forEach((d) => { d.fill = true; });
    return data;
  }

  function cell(text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    return td;
  }

  function fill(tableId, rows, columns) {
    const body = $(tableId).querySelector("tbody");
    body.replaceChildren();
    rows.forEach((row) => {
      const tr = document.createElement("tr");
      columns.forEach(([value, cls]) => tr.appendChild(cell(value(row), cls)));
      body.appendChild(tr);
    });
  }

  function render(d) {
    const t = d.totals || {};
    $("total-requests").textContent = int(t.requests || 0);
    $("total-cost").textContent = money(t.cost_micros || 0);
    $("total-input").textContent = int(t.input_tokens || 0);
    $("total-cached").textContent = int(t.cached_tokens || 0);
    $("total-output").textContent = int(t.output_tokens || 0);
    $("window").textContent = "From " + d.since + " to " + d.until + " (UTC), by " + d.bucket + ".";
    const b = d.bucket, names = d.key_names;
    const spend = (r) => r.cost_micros / 1e6, tokens = (r) => r.input_tokens + r.output_tokens;
    const money_axis = {
      scales: { y: { beginAtZero: true, title: { display: true, text: "spend (USD)" }, ticks: { callback: (v) => "$" + v } } },
      plugins: { legend: { position: "bottom" },
                 tooltip: { callbacks: { label: (c) => c.dataset.label + ": " + money(Math.round(c.parsed.y * 1e6)) } } },
    };
    const stacked = { scales: { y: { stacked: true, beginAtZero: true, title: { display: true, text: "tokens" } } } };
    draw("chart-spend-key", "line", series(d.series.by_key, b, "key", spend, names, d.buckets), money_axis);
    draw("chart-spend-model", "line", series(d.series.by_model, b, "model", spend, null, d.buckets), money_axis);
    draw("chart-tokens-key", "line", area(series(d.series.by_key, b, "key", tokens, names, d.buckets)), stacked);
    draw("chart-tokens-model", "line", area(series(d.series.by_model, b, "model", tokens, null, d.buckets)), stacked);
    draw("chart-cached", "bar", {
      labels: d.workers.map((w) => w.name),
      datasets: [{ label: "cached share of input (%)", backgroundColor: palette[0],
                   data: d.workers.map((w) => Math.round(w.cached_share * 1000) / 10) }],
    }, { scales: { y: { beginAtZero: true, max: 100 } } });
    fill("workers-table", d.workers, [
      [(w) => w.name, "text"],
      [(w) => (w.available ? "healthy" : (w.ejected ? "ejected" : "unhealthy")), null],
      [(w) => int(w.in_flight)], [(w) => int(w.capacity)],
      [(w) => (w.ttfb_ms === null ? "-" : w.ttfb_ms.toFixed(1))],
      [(w) => int(w.requests)], [(w) => int(w.input_tokens)], [(w) => int(w.cached_tokens)],
      [(w) => (w.cached_share * 100).toFixed(1) + "%"],
    ]);
    fill("keys-table", d.top_keys, [
      [(k) => k.key, "text"], [(k) => k.name, "text"], [(k) => int(k.requests)], [(k) => int(k.input_tokens)],
      [(k) => int(k.cached_tokens)], [(k) => int(k.output_tokens)], [(k) => money(k.cost_micros)],
    ]);
    fill("endpoints-table", d.endpoints || [], [
      [(e) => e.endpoint, "text"], [(e) => int(e.requests)], [(e) => int(e.input_tokens)],
      [(e) => int(e.output_tokens)], [(e) => money(e.cost_micros)],
    ]);
    renderErrors(d);
    document.body.dataset.loaded = String(Date.now());
  }

  // Refusals (401, 402, 404, 429, 5xx: the access records) and failed answers (the ledger),
  // newest first; "no errors" when the window has none.
  function renderErrors(d) {
    const rows = d.errors || [], counts = d.error_counts || {};
    const parts = Object.keys(counts).map((status) => status + " \u00d7" + counts[status]);
    $("errors-summary").textContent = parts.length
      ? "Refusals by status: " + parts.join(", ") + " (" + (d.errors_scope || "this process") + ")." : "";
    $("errors-summary").hidden = parts.length === 0;
    $("errors-empty").hidden = rows.length > 0;
    $("errors-table").hidden = rows.length === 0;
    fill("errors-table", rows, [
      [(e) => e.created, "text"], [(e) => e.request_id || "-", "text"], [(e) => String(e.status), "text"],
      [(e) => e.error_code || "-", "text"], [(e) => e.key_id || "-", "text"], [(e) => e.model || "-", "text"],
      [(e) => e.path || "-", "text"], [(e) => e.transport || "-", "text"], [(e) => e.worker || "-", "text"],
      [(e) => money(e.cost_micros)],
    ]);
  }

  async function load() {
    const result = await api("/api/overview?range=" + encodeURIComponent($("range").value));
    if (result.status === 401) { show(false); return; }
    if (result.status !== 200) return;
    state.data = result.body;
    render(result.body);
  }

  // ------------------------------------------------------------------ managing keys

  function say(text, bad) {
    $("manage-message").textContent = text;
    $("manage-message").style.color = bad ? "var(--bad)" : "var(--ok)";
  }

  function failure(result) {
    return (result.body && result.body.error && result.body.error.message) || ("HTTP " + result.status);
  }

  function canWrite() { return state.role === "admin" || state.role === "team_admin"; }

  function showSecret(secret) {
    $("secret").textContent = secret;
    $("secret-box").hidden = false;
  }

  const DONE = { rotate: "new secret made", revoke: "revoked", block: "blocked", unblock: "unblocked",
                 "delete": "deleted" };

  async function keyAction(key, action, body) {
    const path = "/api/keys/" + encodeURIComponent(key.key_id) + (action === "delete" ? "" : "/" + action);
    const result = await api(path, { method: action === "delete" ? "DELETE" : "POST",
      headers: { "Content-Type": "application/json" }, body: JSON.stringify(body || {}) });
    if (result.status !== 200) { say(key.name + ": " + failure(result), true); return; }
    if (action === "rotate") showSecret(result.body.secret);
    say(key.name + ": " + (action === "topup" ? "balance " + money(result.body.balance_micros) : DONE[action]), false);
    await loadKeys();
  }

  function actions(key) {
    const td = document.createElement("td");
    td.className = "writes actions";
    td.hidden = !canWrite();
    if (key.revoked) return td;
    const amount = document.createElement("input");
    amount.placeholder = "$";
    amount.size = 6;
    amount.setAttribute("aria-label", "top-up amount in dollars for " + key.name);
    const button = (label, handler) => {
      const b = document.createElement("button");
      b.type = "button";
      b.textContent = label;
      b.dataset.action = label.toLowerCase().replace(" ", "-");
      b.addEventListener("click", handler);
      td.appendChild(b);
    };
    if (state.role === "admin" && key.own_balance) {
      td.appendChild(amount);
      button("Top up", () => keyAction(key, "topup", { usd: amount.value.trim() }));
    }
    const grace = document.createElement("select");
    grace.setAttribute("aria-label", "how long the old secret of " + key.name + " keeps working");
    [["0", "old secret stops now"], ["1h", "old works 1 hour"], ["24h", "old works 1 day"], ["7d", "old works 7 days"]]
      .forEach(([value, label]) => { const o = document.createElement("option"); o.value = value; o.textContent = label; grace.appendChild(o); });
    td.appendChild(grace);
    button("Rotate", () => { if (confirm("A new secret for " + key.name + "?")) keyAction(key, "rotate", grace.value === "0" ? {} : { grace: grace.value }); });
    button("Edit", () => editKey(key));
    button(key.blocked ? "Unblock" : "Block", () => keyAction(key, key.blocked ? "unblock" : "block"));
    button("Revoke", () => { if (confirm("Revoke " + key.name + "? It cannot be undone.")) keyAction(key, "revoke"); });
    button("Delete", () => { if (confirm("Delete " + key.name + "? It is revoked and leaves this list; its usage stays.")) keyAction(key, "delete"); });
    return td;
  }

  async function loadKeys() {
    const result = await api("/api/keys");
    if (result.status !== 200) return;
    const body = $("manage-table").querySelector("tbody");
    body.replaceChildren();
    result.body.data.forEach((k) => {
      const tr = document.createElement("tr");
      tr.dataset.keyId = k.key_id;
      [[k.key_id, "text"], [k.name, "text"], [k.user_id || k.team_id || "-", "text"],
       [k.own_balance ? money(k.balance_micros) : "the team's"],
       [k.allowed_models ? k.allowed_models.join(", ") : "every model", "text"],
       [money(k.daily_budget_micros) + " / " + money(k.monthly_budget_micros)],
       [k.expires || "never", "text"],
       [k.revoked ? "revoked" : (k.expired ? "expired" : (k.blocked ? "blocked" : "active")), "text"],
      ].forEach(([value, cls]) => tr.appendChild(cell(value, cls)));
      tr.appendChild(actions(k));
      body.appendChild(tr);
    });
    document.body.dataset.keysLoaded = String(Date.now());
  }

  // ------------------------------------------------------------------ changing a key or a level

  const usdOf = (micros) => (micros === null || micros === undefined ? "" : String(micros / 1e6));
  const listOf = (text) => { const items = text.split(",").map((m) => m.trim()).filter(Boolean); return items.length ? items : null; };
  const numberOf = (text) => (text.trim() ? Number(text.trim()) : null);

  function editKey(key) {
    state.editing = key;
    $("key-edit-name").textContent = key.name + " (" + key.key_id + ")";
    $("ke-models").value = key.allowed_models ? key.allowed_models.join(",") : "";
    $("ke-concurrency").value = key.concurrency || "";
    $("ke-rate").value = key.rate_per_min || "";
    $("ke-tpm").value = key.tokens_per_min || "";
    $("ke-daily").value = usdOf(key.daily_budget_micros);
    $("ke-monthly").value = usdOf(key.monthly_budget_micros);
    $("ke-expires").value = key.expires || "";
    $("ke-tags").value = (key.tags || []).join(",");
    $("key-edit").hidden = false;
  }

  async function saveKey(event) {
    event.preventDefault();
    const key = state.editing;
    const data = { allowed_models: listOf($("ke-models").value), concurrency: numberOf($("ke-concurrency").value),
                   rate_per_min: numberOf($("ke-rate").value), tokens_per_min: numberOf($("ke-tpm").value),
                   daily_budget_usd: $("ke-daily").value.trim() || null,
                   monthly_budget_usd: $("ke-monthly").value.trim() || null,
                   expires_at: $("ke-expires").value.trim() || null, tags: listOf($("ke-tags").value) || [] };
    const result = await api("/api/keys/" + encodeURIComponent(key.key_id), {
      method: "PATCH", headers: { "Content-Type": "application/json" }, body: JSON.stringify(data) });
    if (result.status !== 200) { say(key.name + ": " + failure(result), true); return; }
    say(key.name + ": changed", false);
    $("key-edit").hidden = true;
    await loadKeys();
  }

  function editLevel(kind, level) {
    state.editingLevel = [kind, level];
    $("level-edit-name").textContent = kind + " " + level.name + " (" + level.level_id + ")";
    $("le-name").value = level.name;
    $("le-models").value = level.allowed_models ? level.allowed_models.join(",") : "";
    $("le-concurrency").value = level.concurrency || "";
    $("le-rate").value = level.rate_per_min || "";
    $("le-tpm").value = level.tokens_per_min || "";
    $("le-budget").value = usdOf(level.budget_micros);
    $("le-period").value = level.budget_period || "monthly";
    $("le-tags").value = (level.tags || []).join(",");
    // A team admin changes their users, not their team (its budget is the owner's): the server says so too.
    document.querySelectorAll(".level-money").forEach((el) => { el.hidden = false; });
    $("level-edit").hidden = false;
  }

  async function saveLevel(event) {
    event.preventDefault();
    const [kind, level] = state.editingLevel;
    const budget = $("le-budget").value.trim();
    const data = { name: $("le-name").value.trim(), allowed_models: listOf($("le-models").value),
                   concurrency: numberOf($("le-concurrency").value), rate_per_min: numberOf($("le-rate").value),
                   tokens_per_min: numberOf($("le-tpm").value), budget_usd: budget || null,
                   budget_period: budget ? $("le-period").value : null, tags: listOf($("le-tags").value) || [] };
    await levelAction(kind, level, data, "", "PATCH");
    $("level-edit").hidden = true;
  }

  async function createKey(event) {
    event.preventDefault();
    const data = { name: $("new-name").value.trim() };
    const optional = [["new-balance", "balance_usd"], ["new-daily", "daily_budget_usd"],
                      ["new-monthly", "monthly_budget_usd"], ["new-expires", "expires_at"]];
    optional.forEach(([id, field]) => { const v = $(id).value.trim(); if (v) data[field] = v; });
    if ($("new-user").value) data.user_id = $("new-user").value;
    else if ($("new-team").value) data.team_id = $("new-team").value;
    const models = $("new-models").value.split(",").map((m) => m.trim()).filter(Boolean);
    if (models.length) data.allowed_models = models;
    const result = await api("/api/keys", { method: "POST", headers: { "Content-Type": "application/json" },
                                            body: JSON.stringify(data) });
    if (result.status !== 201) { say(failure(result), true); return; }
    showSecret(result.body.secret);
    say("Created " + result.body.key.name + " (" + result.body.key.key_id + ")" +
        (result.body.warnings ? "; " + result.body.warnings.join("; ") : ""), false);
    $("create-form").reset();
    await loadKeys();
  }

  // ------------------------------------------------------------------ the request browser

  async function loadRequests(more) {
    const params = new URLSearchParams({ limit: "50" });
    [["req-key", "key_id"], ["req-team", "team_id"], ["req-model", "model"], ["req-endpoint", "endpoint"],
     ["req-status", "status"]]
      .forEach(([id, name]) => { const v = $(id).value.trim(); if (v) params.set(name, v); });
    if (more && state.requestsCursor) params.set("cursor", String(state.requestsCursor));
    const result = await api("/api/requests?" + params.toString());
    if (result.status !== 200) return;
    const body = $("requests-table").querySelector("tbody");
    if (!more) body.replaceChildren();
    result.body.data.forEach((r) => {
      const tr = document.createElement("tr");
      [[r.created, "text"], [r.request_id, "text"], [r.key_name ? r.key_name + " (" + r.key_id + ")" : r.key_id, "text"],
       [r.team_id || "-", "text"], [r.served_model || r.model, "text"], [r.endpoint, "text"],
       [r.transport || "-", "text"], [r.worker || "-", "text"],
       [int(r.input_tokens)], [int(r.output_tokens)], [money(r.cost_micros)], [r.status, "text"],
       [r.latency_ms === null || r.latency_ms === undefined ? "-" : String(r.latency_ms)],
      ].forEach(([value, cls]) => tr.appendChild(cell(value, cls)));
      body.appendChild(tr);
    });
    state.requestsCursor = result.body.next_cursor;
    $("req-older").hidden = !state.requestsCursor;
    document.body.dataset.requestsLoaded = String(Date.now());
  }

  // ------------------------------------------------------------------ teams and users

  function options(selectId, levels, none) {
    const select = $(selectId);
    const kept = select.value;
    select.replaceChildren();
    if (none) { const o = document.createElement("option"); o.value = ""; o.textContent = none; select.appendChild(o); }
    levels.forEach((lv) => { const o = document.createElement("option"); o.value = lv.level_id; o.textContent = lv.name + " (" + lv.level_id + ")"; select.appendChild(o); });
    if ([...select.options].some((o) => o.value === kept)) select.value = kept;  // else the first stays chosen
  }

  function budget(lv) { return lv.budget_micros === null ? "none" : money(lv.budget_micros) + " / " + lv.budget_period; }

  async function levelAction(kind, lv, body, path, method) {
    const result = await api("/api/" + kind + "s/" + encodeURIComponent(lv.level_id) + (path || ""), {
      method: method || "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    $("teams-message").textContent = lv.name + ": " + (result.status === 200 ? "done" : failure(result));
    $("teams-message").style.color = result.status === 200 ? "var(--ok)" : "var(--bad)";
    await loadTeams();
  }

  function teamActions(team) {
    const td = document.createElement("td");
    td.className = "writes money actions";
    td.hidden = state.role !== "admin";
    const amount = document.createElement("input");
    amount.placeholder = "$";
    amount.size = 6;
    amount.setAttribute("aria-label", "amount in dollars for " + team.name);
    td.appendChild(amount);
    [["Top up", () => levelAction("team", team, { usd: amount.value.trim() }, "/topup")],
     ["Set budget", () => levelAction("team", team, { budget_usd: amount.value.trim() || null,
                                                      budget_period: team.budget_period || "monthly" }, "", "PATCH")],
     [team.blocked ? "Unblock" : "Block", () => levelAction("team", team, { blocked: !team.blocked }, "", "PATCH")],
     ["Edit", () => editLevel("team", team)],
    ].forEach(([label, handler]) => {
      const b = document.createElement("button");
      b.type = "button"; b.textContent = label; b.dataset.action = label.toLowerCase().replace(" ", "-");
      b.addEventListener("click", handler); td.appendChild(b);
    });
    return td;
  }

  async function loadTeams() {
    const [orgs, teams, users] = await Promise.all(["orgs", "teams", "users"].map((k) => api("/api/" + k)));
    if (teams.status !== 200) return;
    state.teams = teams.body.data;
    options("team-org", orgs.status === 200 ? orgs.body.data : [], "none");
    options("user-team", state.teams, null);
    options("new-team", state.teams, state.role === "admin" ? "none" : null);  // a team admin's keys are their team's
    options("new-user", users.status === 200 ? users.body.data : [], "none");
    const tbody = $("teams-table").querySelector("tbody");
    tbody.replaceChildren();
    state.teams.forEach((t) => {
      const tr = document.createElement("tr");
      tr.dataset.levelId = t.level_id;
      [[t.level_id, "text"], [t.name, "text"], [t.parent_id || "-", "text"],
       [t.balance_micros === null ? "none" : money(t.balance_micros)], [budget(t), "text"],
       [money(t.spent_this_period_micros)], [t.period_end || "-", "text"], [t.blocked ? "blocked" : "active", "text"],
      ].forEach(([value, cls]) => tr.appendChild(cell(value, cls)));
      tr.appendChild(teamActions(t));
      tbody.appendChild(tr);
    });
    const ubody = $("users-table").querySelector("tbody");
    ubody.replaceChildren();
    (users.status === 200 ? users.body.data : []).forEach((u) => {
      const tr = document.createElement("tr");
      tr.dataset.levelId = u.level_id;
      [[u.level_id, "text"], [u.name, "text"], [u.parent_id || "-", "text"], [budget(u), "text"],
       [money(u.spent_this_period_micros)], [u.period_end || "-", "text"],
      ].forEach(([value, cls]) => tr.appendChild(cell(value, cls)));
      const td = document.createElement("td");
      td.className = "writes actions";
      td.hidden = !canWrite();
      [["Edit", () => editLevel("user", u)],
       [u.blocked ? "Unblock" : "Block", () => levelAction("user", u, { blocked: !u.blocked }, "", "PATCH")],
      ].forEach(([label, handler]) => {
        const b = document.createElement("button");
        b.type = "button"; b.textContent = label; b.dataset.action = label.toLowerCase();
        b.addEventListener("click", handler); td.appendChild(b);
      });
      tr.appendChild(td);
      ubody.appendChild(tr);
    });
    document.body.dataset.teamsLoaded = String(Date.now());
  }

  async function createLevel(event, kind, fields) {
    event.preventDefault();
    const data = {};
    fields.forEach(([id, field]) => { const v = $(id).value.trim(); if (v) data[field] = v; });
    if (data.budget_usd === undefined) delete data.budget_period;
    const result = await api("/api/" + kind + "s", { method: "POST", headers: { "Content-Type": "application/json" },
                                                     body: JSON.stringify(data) });
    $("teams-message").textContent = result.status === 201 ? "Created " + result.body[kind].name + " (" + result.body[kind].level_id + ")" : failure(result);
    $("teams-message").style.color = result.status === 201 ? "var(--ok)" : "var(--bad)";
    if (result.status === 201) event.target.reset();
    await loadTeams();
  }

  function select(view) {
    state.view = view;
    document.querySelectorAll("#nav button").forEach((b) => b.classList.toggle("active", b.dataset.view === view));
    document.querySelectorAll(".view").forEach((v) => { v.hidden = v.id !== "view-" + view; });
    Object.values(state.charts).forEach((c) => c.resize());
    if (view === "manage") { loadTeams(); loadKeys(); }
    if (view === "teams") loadTeams();
    if (view === "requests") loadRequests(false);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", login);
    $("create-form").addEventListener("submit", createKey);
    $("key-edit").addEventListener("submit", saveKey);
    $("key-edit-cancel").addEventListener("click", () => { $("key-edit").hidden = true; });
    $("level-edit").addEventListener("submit", saveLevel);
    $("level-edit-cancel").addEventListener("click", () => { $("level-edit").hidden = true; });
    $("team-form").addEventListener("submit", (e) => createLevel(e, "team", [
      ["team-name", "name"], ["team-id", "level_id"], ["team-org", "parent_id"], ["team-balance", "balance_usd"],
      ["team-budget", "budget_usd"], ["team-period", "budget_period"]]));
    $("user-form").addEventListener("submit", (e) => createLevel(e, "user", [
      ["user-name", "name"], ["user-team", "parent_id"], ["user-budget", "budget_usd"], ["user-period", "budget_period"]]));
    $("requests-form").addEventListener("submit", (e) => { e.preventDefault(); loadRequests(false); });
    $("req-older").addEventListener("click", () => loadRequests(true));
    $("logout").addEventListener("click", logout);
    $("refresh").addEventListener("click", load);
    $("range").addEventListener("change", load);
    document.querySelectorAll("#nav button").forEach((b) => b.addEventListener("click", () => select(b.dataset.view)));
    start();
  });
})();
