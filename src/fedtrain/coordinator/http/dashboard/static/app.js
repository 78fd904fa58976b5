// The fedtrain dashboard: signs in with a run token, follows the run over server-sent events
// (GET v1/stream), and calls the same /v1 API as every other client. URLs are relative so
// that the page also works behind a reverse proxy under a path prefix.
"use strict";

const $ = (id) => document.getElementById(id);
const TOKEN_KEY = "fedtrain.token";
const STATUS_REFRESH_MS = 5000; // heartbeats do not push a status: refresh ages now and then
const GLOBAL_EVAL_REFRESH_MS = 10000; // the coordinator's global eval runs on its own thread, unannounced
const MAX_EVENTS = 500;
const EVENT_KIND_KEY = "fedtrain.eventKind"; // the event log's filter, kept across reloads
const NOT_ROUND = "not-round"; // the filter value for every kind but "round"

// Live fields offered as a form; anything else can be typed into the JSON change.
const QUICK_FIELDS = [
  ["train.sync_every", "H: inner steps per round"],
  ["train.lr", "Inner learning rate"],
  ["train.batch_size", "Batch size"],
  ["train.eval_batches", "Eval batches"],
  ["outer.algorithm", "Outer algorithm", ["fedavg", "diloco", "fedavgm", "fedadam", "fedyogi"]],
  ["outer.lr", "Outer learning rate"],
  ["outer.momentum", "Outer momentum"],
  ["min_participants", "Min participants"],
  ["round_timeout_s", "Round deadline (s)"],
];

const S = {
  token: null, role: null, offset: 0, source: null, timers: [],
  status: null, config: null, model: null, history: [], events: [], metrics: [],
  evictArmed: null, kept: [], keptInForce: null, keptRound: null, keptSeq: 0, rollingBack: false,
  validateTimer: null, validateSeq: 0, chartsQueued: false,
  eventKind: localStorage.getItem(EVENT_KIND_KEY) || "all",
};

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, { method = "GET", body } = {}) {
  const headers = { Authorization: "Bearer " + S.token };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let r;
  try {
    r = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (e) {
    throw new ApiError(0, "cannot reach the coordinator (" + e.message + ")");
  }
  const data = await r.json().catch(() => null);
  if (!r.ok) throw new ApiError(r.status, (data && data.error && data.error.message) || r.status + " " + r.statusText);
  return data;
}

// -- signing in ------------------------------------------------------------------------------

function showLogin(message) {
  stop();
  $("main").hidden = true;
  $("login").hidden = false;
  $("signout").hidden = true;
  $("role").hidden = true;
  $("login-error").hidden = !message;
  $("login-error").textContent = message || "";
  setConn("idle", "not connected");
  $("token-input").focus();
}

async function signIn(token) {
  S.token = token;
  let who;
  try {
    who = await api("v1/whoami");
  } catch (e) {
    if (e.status === 401) localStorage.removeItem(TOKEN_KEY);
    showLogin(e.status === 401 ? "That is not a token of this run." : e.message);
    return;
  }
  localStorage.setItem(TOKEN_KEY, token);
  S.role = who.role;
  S.offset = who.server_time - Date.now() / 1000;
  document.body.dataset.role = who.role;
  $("role").textContent = who.role;
  $("role").hidden = false;
  $("signout").hidden = false;
  $("readonly-note").hidden = who.role === "admin";
  $("login").hidden = true;
  $("main").hidden = false;
  openStream();
  S.timers.push(setInterval(tickAges, 1000));
  S.timers.push(setInterval(() => api("v1/status").then(setStatus).catch(() => {}), STATUS_REFRESH_MS));
  S.timers.push(setInterval(loadGlobalEval, GLOBAL_EVAL_REFRESH_MS));
  if (who.role === "admin") S.timers.push(startTokens()); // tokens.js: the site tokens panel
}

function stop() {
  S.keptRound = null; // the next admin view fetches the kept versions afresh
  if (S.source) S.source.close();
  S.source = null;
  S.timers.forEach(clearInterval);
  S.timers = [];
}

function setConn(state, text) {
  $("conn").dataset.state = state;
  $("conn").textContent = text;
}

// -- the live stream -------------------------------------------------------------------------

function openStream() {
  const es = new EventSource("v1/stream?token=" + encodeURIComponent(S.token));
  S.source = es;
  setConn("connecting", "connecting…");
  const on = (kind, fn) => es.addEventListener(kind, (e) => fn(JSON.parse(e.data)));
  on("hello", (d) => {
    setConn("live", "live");
    S.config = d.config;
    S.model = d.config.model || null; // what the model is (custom: from --init-weights); fixed for the run
    S.keptRound = null; // (re)opened: fetch the kept versions whatever the round
    setStatus(d.status);
    renderConfig();
    reloadLists();
  });
  on("status", setStatus);
  on("event", (e) => addEvents([e]));
  on("config_change", () => loadHistory());
  on("config", (view) => { S.config = view; renderConfig(); loadHistory(); });
  on("metrics", (rows) => { S.metrics.push(...rows); queueCharts(); });
  es.onerror = () => {
    if (es.readyState !== EventSource.CLOSED) { setConn("reconnecting", "reconnecting…"); return; }
    setConn("offline", "offline");
    // The stream was refused (a revoked token?) or dropped: check the token, then follow again.
    setTimeout(() => {
      if (S.source !== es) return;
      api("v1/whoami").then(() => openStream()).catch((e) => {
        if (e.status === 401) showLogin("The coordinator no longer accepts this token.");
        else setTimeout(() => S.source === es && openStream(), 3000);
      });
    }, 2000);
  };
}

async function reloadLists() {
  const started = Date.now() / 1000 + S.offset;
  const [events, metrics] = await Promise.all([
    api("v1/events?limit=" + MAX_EVENTS).catch(() => null),
    api("v1/metrics?limit=30000").catch(() => null),
  ]);
  if (events) {
    const fresh = S.events.filter((e) => e.ts >= started - 1);
    S.events = [];
    addEvents([...events.events, ...fresh]);
  }
  if (metrics) { S.metrics = metrics.metrics.concat(S.metrics.filter((m) => m.ts >= started - 1)); queueCharts(); }
  await loadHistory();
  document.body.dataset.ready = "1";
}

async function loadGlobalEval() {
  const got = await api("v1/metrics?name=global_eval%2Floss&limit=10000").catch(() => null);
  if (!got) return;
  const known = new Set(S.metrics.filter((m) => m.participant_id == null).map((m) => m.name + "@" + m.round));
  const fresh = got.metrics.filter((m) => !known.has(m.name + "@" + m.round));
  if (fresh.length) { S.metrics.push(...fresh); queueCharts(); }
}

async function loadHistory() {
  const h = await api("v1/config/history?limit=50").catch(() => null);
  if (h) { S.history = h.versions; renderConfigVersions(); }
}

// -- status: cards, participants, rounds --------------------------------------------------------

function setStatus(st) {
  S.status = st;
  st.participants.forEach((p) => colorOf(p.id));
  renderCards(st);
  renderPrivacy(st);
  renderParticipants(st);
  renderRounds(st);
  renderConfigVersions();
  renderPlaceholders();
  if (S.role === "admin" && st.current_round !== S.keptRound) loadKept();
}

function renderCards(st) {
  // Streaming DiLoCo: each round syncs one of K fragments (round r: fragment r mod K)
  $("run-name").textContent = st.streaming ? `${st.run} · streaming, K = ${st.streaming.k} fragments` : st.run;
  document.title = "fedtrain · " + st.run;
  const by = (state) => st.participants.filter((p) => p.state === state);
  const active = by("active");
  $("c-round").textContent = st.rounds ? `${st.current_round} / ${st.rounds}` : String(st.current_round);
  const past = st.rounds_configured != null && st.rounds_configured !== st.rounds;
  $("c-round-sub").textContent = st.finished ? (past ? `run finished past the config's ${st.rounds_configured} rounds`
    : "run finished") : st.closing ? "closing: merging the updates"
    : `open · ${st.submitted.length} of ${active.length} active submitted` +
      (st.fragment != null ? ` · fragment ${st.fragment} of ${st.streaming.k}` : "");
  $("c-parts").textContent = `${active.length} active`;
  $("c-parts-sub").textContent = ["failed", "left", "evicted"].map((s) => `${by(s).length} ${s}`).join(" · ");
  $("c-tokens").textContent = fmt.si(st.participants.reduce((a, p) => a + p.tokens, 0));
  const rate = active.reduce((a, p) => a + (p.tokens_per_s || 0), 0);
  $("c-tokens-sub").textContent = `${fmt.si(rate)} tokens/s now`;
  $("c-bytes").replaceChildren(el("span", { class: "nowrap", text: `↑ ${fmt.bytes(st.bytes_in)}` }), " ",
    el("span", { class: "nowrap", text: `↓ ${fmt.bytes(st.bytes_out)}` }));
  $("c-bytes-sub").textContent = `model ${fmt.bytes(st.model_bytes)} · ${fmt.si(st.parameters)} parameters`;
  $("c-alg").textContent = st.algorithm;
  // the lr in force as the coordinator resolved it (an unset DiLoCo lr follows M and H), never "default"
  $("c-alg-sub").textContent = (st.outer_lr != null ? `lr ${fmt.num(st.outer_lr)} · ` : "") +
    `${st.mode || "rounds"} mode · config v${st.config_version}` +
    (st.latest_config_version > st.config_version ? ` · v${st.latest_config_version} from next round` : "");
  $("c-reason").textContent = st.reason;
}

// Privacy (issue #33): (ε, δ) spent after the rounds merged with noise, against the budget (central
// DP, or distributed with secure aggregation), and secure aggregation's phase in the open round
function renderPrivacy(st) {
  const p = st.privacy, a = st.secure_aggregation;
  $("c-privacy-card").hidden = p == null && a == null;
  if (p == null && a == null) return;
  $("c-privacy-label").textContent = p != null ? `Privacy (${p.mechanism || "central"} DP)` : "Privacy (secure aggregation)";
  $("c-privacy").textContent = p != null ? `ε ${fmt.num(p.epsilon)}` : `${a.phase}`;
  const dp = p == null ? "" : `δ ${p.delta} · ${p.rounds} rounds` +
    (p.budget != null ? ` · budget ${fmt.num(p.budget)}${p.over_budget ? " (over)" : ""}` : " · no budget") +
    ` · σ ${fmt.num(p.noise_multiplier)}, C ${fmt.num(p.clip_norm)}`;
  const sa = a == null ? "" : `secure aggregation: round ${a.round}, ${a.phase}, ${a.uploaded}/${a.sharing} uploaded, ` +
    `t ${a.threshold}` + (a.ring_bits ? `, 2^${a.ring_bits} ring` : "") +
    (a.refused_attempts ? ` · ${a.refused_attempts} refused` : "");
  $("c-privacy-sub").textContent = [dp, sa].filter((x) => x).join(" · ");
}

function renderParticipants(st) {
  const body = $("participants").querySelector("tbody");
  const isAdmin = S.role === "admin";
  body.replaceChildren(...st.participants.map((p) => {
    const swatch = el("span", { class: "swatch" });
    swatch.style.background = colorOf(p.id);
    const behind = p.config_version != null && p.config_version < st.config_version && p.state === "active";
    let action = null;
    if (isAdmin && p.state !== "evicted") {
      const armed = S.evictArmed === p.id;
      action = el("button", { type: "button", class: armed ? "danger armed" : "danger", text: armed ? "Confirm evict" : "Evict",
        dataset: { evict: p.id }, onclick: () => evictClicked(p.id) });
    }
    return el("tr", { dataset: { pid: p.id, state: p.state } },
      el("td", { class: "pid" }, swatch, p.id),
      el("td", {}, el("span", { class: "pill " + p.state, text: p.state })),
      el("td", { class: "ranks" }, ranksBadge(p)),
      el("td", { class: "num", text: fmt.int(p.round) }),
      el("td", { class: "num", text: fmt.int(p.step) }),
      renderTold(p, st),
      el("td", { class: "num", text: fmt.si(p.tokens) }),
      el("td", { class: "num", text: p.tokens_per_s == null ? "–" : fmt.si(p.tokens_per_s) }),
      el("td", { class: "num", text: fmt.num(p.loss) }),
      el("td", { class: "num age", dataset: { ts: p.last_seen }, text: ageOf(p.last_seen) }),
      el("td", { class: "num cfg" + (behind ? " behind" : ""), text: p.config_version == null ? "–" : "v" + p.config_version,
        title: behind ? `runs v${p.config_version}; v${st.config_version} is in force (it switches at its next round boundary)` : null }),
      el("td", { class: "num", text: fmt.percent(p.weight) }),
      el("td", { class: "num", text: p.staleness == null ? "–" : fmt.int(p.staleness),
        title: "versions committed since the one its last applied update was trained from" }),
      el("td", { class: "num", text: p.share == null ? "–" : `${fmt.percent(p.share)} (${fmt.int(p.applied)})`,
        title: "its share of the weight applied over the last 100 versions (its updates in brackets)" }),
      el("td", { class: "num", text: `${fmt.bytes(p.bytes_up)} / ${fmt.bytes(p.bytes_down)}` + transfersText(p),
        title: transfersTitle(p) }),
      el("td", { class: "admin-only" }, action));
  }));
  $("parts-empty").textContent = "No participant has joined yet."; // until the first status: "Connecting…"
  $("parts-empty").hidden = st.participants.length > 0;
  $("parts-hint").textContent = st.participants.length ? `${st.participants.length} joined` : "";
}

// Its transfers in flight (status `transfers`, each a Progress view with a `direction`): " · ↓ 48%".
function transfersOf(p) {
  return p.transfers || (p.transfer ? [p.transfer] : []);
}

function transfersText(p) {
  return transfersOf(p).map((t) => ` · ${t.direction === "up" ? "↑" : "↓"} ` +
    (t.total ? fmt.percent(t.bytes / t.total) : fmt.bytes(t.bytes))).join("");
}

function transfersTitle(p) {
  const lines = transfersOf(p).map((t) => `${t.what}: ${fmt.bytes(t.bytes)}` + (t.total ? ` of ${fmt.bytes(t.total)}` : "") +
    `, ${fmt.bytes(t.rate_bps)}/s` + (t.eta_s == null ? "" : `, ${fmt.seconds(t.eta_s)} left`));
  return lines.length ? lines.join("\n") : null;
}

// How a participant trains (status `parallel`, `world_size`): "1", "ddp×4", "fsdp×2"; "?" where it did not say.
function ranksBadge(p) {
  const n = p.world_size;
  const ranks = n ? `${n} rank${n === 1 ? "" : "s"}` : "ranks not said";
  const [kind, text, title] = p.parallel === "single" ? ["single", "1", "one process"]
    : p.parallel === "ddp" ? ["ddp", n ? `ddp×${n}` : "ddp", `DDP, ${ranks}: rank 0 syncs for the group`]
    : p.parallel === "fsdp" ? ["fsdp", n ? `fsdp×${n}` : "fsdp", `FSDP, ${ranks}: each rank uploads its own shard as a piece`]
    : ["unknown", n ? `?×${n}` : "?", `it did not say how it trains${n ? ` (${ranks})` : ""}`];
  return el("span", { class: "par " + kind, text, title });
}

// An update in pieces (status `pieces`): "1/2 pieces" for an FSDP group (a piece per rank), else "1 piece".
function piecesText(p) {
  const got = p.pieces.received;
  const of = p.parallel === "fsdp" && p.world_size >= got ? p.world_size : null;
  return of ? `${got}/${of} pieces` : `${got} piece${got === 1 ? "" : "s"}`;
}

// A participant's H for the open round (balanced rounds: its own, with the reason under it).
function renderTold(p, st) {
  const td = el("td", { class: "num told", title: p.sync_every_reason || null,
    text: p.sync_every == null ? "–" : fmt.int(p.sync_every) });
  if (st.schedule_mode === "balanced" && p.sync_every_reason) td.append(el("div", { class: "hint why", text: p.sync_every_reason }));
  return td;
}

const ageOf = (ts) => fmt.age(Date.now() / 1000 + S.offset - ts);

function tickAges() {
  for (const td of document.querySelectorAll("td.age")) td.textContent = ageOf(Number(td.dataset.ts));
}

async function evictClicked(pid) {
  if (S.evictArmed !== pid) {
    S.evictArmed = pid;
    renderParticipants(S.status);
    setTimeout(() => { if (S.evictArmed === pid) { S.evictArmed = null; renderParticipants(S.status); } }, 4000);
    return;
  }
  S.evictArmed = null;
  try {
    await api(`v1/participants/${encodeURIComponent(pid)}/evict`, { method: "POST" });
  } catch (e) {
    addEvents([{ ts: Date.now() / 1000 + S.offset, kind: "error", participant_id: pid, message: "evict failed: " + e.message }]);
  }
}

// The fragment a round synced (Streaming DiLoCo); the column shows only when the run streams.
const fragmentCell = (f) => el("td", { class: "num fragment-col", text: f == null ? "–" : String(f) });

function renderRounds(st) {
  const body = $("rounds").querySelector("tbody");
  $("rounds").classList.toggle("streaming", st.streaming != null);
  const rows = [];
  if (!st.finished) {
    rows.push(el("tr", { class: "open-round" },
      el("td", { class: "num", text: String(st.current_round) }),
      fragmentCell(st.fragment),
      el("td", { text: st.closing ? "closing…" : "open" }),
      el("td", {}),
      el("td", { class: "reason", text: st.reason }),
      el("td", {}, ...openChips(st)),
      el("td", {}), el("td", {}), el("td", {})));
  }
  const traffic = (r) => `up ${fmt.bytes(r.bytes_in)}` +
    (r.vs_fp32_in ? ` (fp32 would be ${fmt.bytes(r.fp32_bytes_in)}: ${r.vs_fp32_in}× as many)` : "") +
    `; down ${r.bytes_out == null ? "not counted since the coordinator started" : fmt.bytes(r.bytes_out)}` +
    (r.vs_fp32_out && r.vs_fp32_out !== 1 ? ` (fp32 would be ${fmt.bytes(r.fp32_bytes_out)}: ${r.vs_fp32_out}× as many)` : "");
  const longest = Math.max(1e-9, ...st.recent_rounds.map((r) => r.closed_at - r.opened_at));
  for (const r of st.recent_rounds) {
    const dur = r.closed_at - r.opened_at;
    const bar = el("span", { class: "bar" });
    bar.style.width = Math.max(2, (dur / longest) * 100) + "%";
    const back = r.close_reason.startsWith("rolled back to version"); // a break in the timeline: mark it
    rows.push(el("tr", { class: back ? "rolled-back" : null, dataset: { round: r.round } },
      el("td", { class: "num", text: String(r.round) }),
      fragmentCell(r.fragment),
      el("td", { text: fmt.clock(r.closed_at) }),
      el("td", { class: "duration" }, el("span", { class: "bar-track" }, bar), el("span", { text: fmt.seconds(dur) })),
      el("td", { class: "reason", text: r.close_reason }),
      el("td", {}, ...chips(r.submissions)),
      el("td", { class: "num", text: fmt.si(r.tokens) }),
      el("td", { class: "num bytes", title: traffic(r), text: fmt.bytes(r.bytes_in) +
        (r.vs_fp32_in && r.vs_fp32_in !== 1 ? ` (${r.vs_fp32_in}× < fp32)` : "") +
        (r.bytes_out != null ? ` / down ${fmt.bytes(r.bytes_out)}` +
          (r.vs_fp32_out && r.vs_fp32_out !== 1 ? ` (${r.vs_fp32_out}× < fp32)` : "") : "") }),
      el("td", { class: "num", text: fmt.seconds(r.merge_s) })));
  }
  body.replaceChildren(...rows);
  $("rounds-hint").textContent = st.recent_rounds.length ? `last ${st.recent_rounds.length} committed` : "none committed yet";
}

// -- rolling back to a kept version (admin) ----------------------------------------------------

// The kept versions change at every round (a commit adds one, pruning drops the oldest), so
// they are fetched when the admin view opens and whenever the round moves on.
async function loadKept() {
  const seq = ++S.keptSeq;
  S.keptRound = S.status ? S.status.current_round : null;
  const got = await api("v1/admin/checkpoints").catch(() => null);
  if (!got || seq !== S.keptSeq) return;
  S.kept = got.versions;
  S.keptInForce = got.committed_version;
  renderKept();
}

// The select is rebuilt only when its choices change, and keeps the choice while it is kept:
// a status arrives every few seconds, and a rebuilt select would close under the pointer.
function renderKept() {
  const select = $("rollback-version");
  const want = [["", S.kept.length ? "choose a kept version" : "no kept version"],
    ...S.kept.map((v) => [String(v), v === S.keptInForce ? `v${v} (in force)` : `v${v}`])];
  const same = select.options.length === want.length &&
    want.every(([v, t], i) => select.options[i].value === v && select.options[i].textContent === t);
  if (!same) {
    const chosen = select.value;
    select.replaceChildren(...want.map(([v, t]) => el("option", { value: v, text: t })));
    select.value = want.some(([v]) => v === chosen) ? chosen : "";
  }
  $("rollback-go").disabled = S.rollingBack || select.value === "";
}

function setRollbackResult(state, text) {
  $("rollback-result").dataset.state = state;
  $("rollback-result").textContent = text;
}

async function rollBackClicked() {
  const chosen = $("rollback-version").value;
  if (chosen === "" || !S.status || S.rollingBack) return;
  const v = Number(chosen), n = S.status.current_round;
  if (!confirm(`Roll back to version ${v}?\n\nRound ${n} closes with no updates and version ${n + 1} gets the ` +
    `weights of version ${v}. Participants fetch it at their next sync.`)) return;
  S.rollingBack = true;
  renderKept();
  setRollbackResult("busy", "Rolling back…");
  try {
    const r = await api("v1/admin/rollback", { method: "POST", body: { version: v } });
    setRollbackResult("ok", `Rolled back: version ${r.version} holds the weights of version ${r.restored}.`);
    $("rollback-version").value = "";
  } catch (e) {
    setRollbackResult("error", "Not rolled back: " + e.message);
  } finally {
    S.rollingBack = false;
    loadKept();
  }
}

// The open round's updates: one chip per submitted participant, and a dashed one per update
// whose pieces are still coming in ("site-a · 1/2 pieces").
function openChips(st) {
  const byId = new Map(st.participants.map((p) => [p.id, p]));
  const done = chips(st.submitted.map((pid) => ({ participant_id: pid, weight: null })));
  done.forEach((chip, i) => {
    const p = byId.get(st.submitted[i]);
    if (p && p.pieces) chip.title = `in ${piecesText(p)}: ${p.pieces.labels.join(", ")}`;
  });
  const coming = st.participants.filter((p) => p.pieces && !p.pieces.complete).map((p) => {
    const chip = el("span", { class: "chip partial", dataset: { pieces: p.id }, text: `${p.id} · ${piecesText(p)}`,
      title: `pieces in: ${p.pieces.labels.join(", ")} · ${fmt.percent(p.pieces.covered)} of the sync set` });
    chip.style.borderColor = colorOf(p.id);
    return chip;
  });
  return [...done, ...coming];
}

function chips(subs) {
  return subs.map((s) => {
    const chip = el("span", { class: "chip", text: s.weight == null ? s.participant_id : `${s.participant_id} ${fmt.percent(s.weight)}` });
    chip.style.borderColor = colorOf(s.participant_id);
    return chip;
  });
}

// -- events ------------------------------------------------------------------------------------

function addEvents(list) {
  for (const e of list) {
    const dup = S.events.slice(-50).some((x) => x.kind === e.kind && x.message === e.message && Math.abs(x.ts - e.ts) < 2);
    if (!dup) S.events.push(e);
  }
  S.events = S.events.slice(-MAX_EVENTS);
  renderEvents();
}

function eventShown(e, kind) {
  return kind === "all" || (kind === NOT_ROUND ? e.kind !== "round" : e.kind === kind);
}

function renderEvents() {
  const kind = S.eventKind;
  const counts = new Map();
  for (const e of S.events) counts.set(e.kind, (counts.get(e.kind) || 0) + 1);
  const rounds = counts.get("round") || 0;
  const options = [["all", "all", S.events.length]];
  if ((rounds && rounds < S.events.length) || kind === NOT_ROUND) {
    options.push([NOT_ROUND, "all but round", S.events.length - rounds]);
  }
  if (kind !== "all" && kind !== NOT_ROUND && !counts.has(kind)) counts.set(kind, 0); // a kept choice stays visible
  for (const k of [...counts.keys()].sort()) options.push([k, k, counts.get(k)]);
  renderEventFilter(options, kind);
  const shown = S.events.filter((e) => eventShown(e, kind));
  $("events").replaceChildren(...shown.reverse().map((e) => el("li", { dataset: { kind: e.kind } },
    el("span", { class: "ev-time", text: fmt.clock(e.ts) }),
    el("span", { class: "ev-kind " + e.kind, text: e.kind }),
    el("span", { class: "ev-msg", text: e.message }))));
  $("events-hint").textContent = kind === "all" ? `${S.events.length} shown, newest first`
    : `${shown.length} of ${S.events.length} shown, newest first`;
}

// The filter's chips are updated in place, never rebuilt: events arrive every round, and a
// chip replaced between a press and its release would swallow the click.
function renderEventFilter(options, kind) {
  const box = $("events-filter");
  const have = new Map([...box.children].map((b) => [b.dataset.kind, b]));
  const chips = options.map(([value, label, n]) => {
    const chip = have.get(value) || el("button", { type: "button", class: "ev-chip", dataset: { kind: value } },
      el("span", { class: "ev-chip-label", text: label }), " ", el("span", { class: "ev-chip-count" }));
    chip.querySelector(".ev-chip-count").textContent = String(n);
    chip.setAttribute("aria-pressed", String(value === kind));
    return chip;
  });
  if (chips.length !== box.children.length || chips.some((c, i) => box.children[i] !== c)) box.replaceChildren(...chips);
}

function setEventKind(kind) {
  S.eventKind = kind;
  localStorage.setItem(EVENT_KIND_KEY, kind);
  renderEvents();
}

// -- charts ------------------------------------------------------------------------------------

function queueCharts() {
  if (S.chartsQueued) return;
  S.chartsQueued = true;
  requestAnimationFrame(() => { S.chartsQueued = false; renderCharts(); });
}

function metricSeries() {
  const series = new Map(); // "pid|name" -> Map(round -> value); later rows win
  for (const m of S.metrics) {
    if (m.round == null) continue;
    const key = (m.participant_id ?? "(global)") + "|" + m.name; // "(" never starts a participant name
    if (!series.has(key)) series.set(key, new Map());
    series.get(key).set(m.round, m.value);
  }
  return series;
}

function renderCharts() {
  const all = metricSeries();
  const pick = (name, style) => [...all].filter(([k]) => k.endsWith("|" + name) && !k.startsWith("(global)|"))
    .map(([k, pts]) => { const pid = k.split("|")[0];
      return { key: k, label: pid, legendKey: pid, color: colorOf(pid), points: [...pts], ...style }; })
    .sort((a, b) => a.label.localeCompare(b.label));
  lineChart($("chart-train"), pick("train_loss", {}), { empty: "No round has been reported yet." });
  // The coordinator's own eval of each global version (no participant), where the run has one.
  const global = [...all].filter(([k]) => k.startsWith("(global)|") && k.endsWith("/loss"))
    .map(([k, pts]) => ({ key: k, label: "global model (held-out)", color: "#111827", width: 2.5,
      points: [...pts] }));
  const evals = [...global, ...pick("eval_before/loss", { dash: "5 4", width: 1.5 }), ...pick("eval_after/loss", { width: 2 })];
  lineChart($("chart-eval"), evals, { empty: "No evaluation has been reported yet (participants without eval_fn report none).",
    notes: ["- - before", "— after"] });
}

// -- config ------------------------------------------------------------------------------------

function getPath(obj, path) {
  return path.split(".").reduce((o, k) => (o && typeof o === "object" ? o[k] : undefined), obj);
}

function setPath(obj, path, value) {
  const keys = path.split(".");
  let o = obj;
  for (const k of keys.slice(0, -1)) { if (typeof o[k] !== "object" || o[k] === null) o[k] = {}; o = o[k]; }
  if (value === undefined) {
    delete o[keys[keys.length - 1]];
    if (keys.length > 1 && Object.keys(o).length === 0) delete obj[keys[0]];
  } else o[keys[keys.length - 1]] = value;
}

function renderConfig() {
  const view = S.config;
  if (!view) return;
  // A custom model's run (--init-weights): the config's `model` section (GPT defaults) describes nothing;
  // the coordinator's description of the model takes its place, as in `fedtrain config show`.
  const m = S.model;
  const shown = m && m.source === "custom" ? { ...view.config, model: { custom: true, init_weights: m.init_weights,
    tensors: m.tensors, parameters: m.parameters, dtypes: m.dtypes } } : view.config;
  $("config-json").textContent = JSON.stringify(shown, null, 2);
  if (!$("quick-fields").childElementCount) buildQuickFields();
  renderPlaceholders();
  renderConfigVersions();
}

// Each quick field shows the value in force. A field the config leaves unset shows what the
// coordinator resolved for it where the status says (outer.lr: `outer_lr`), else "default".
function renderPlaceholders() {
  const view = S.config;
  if (!view || !$("quick-fields").childElementCount) return;
  const resolved = { "outer.lr": S.status && S.status.outer_lr };
  for (const [path] of QUICK_FIELDS) {
    const input = $("f-" + path.replace(".", "-"));
    const now = getPath(view.config, path);
    if (input.tagName === "SELECT") input.options[0].textContent = `(no change: ${now})`;
    else input.placeholder = now != null ? String(now) : resolved[path] != null ? `${fmt.num(resolved[path])} (default)` : "default";
  }
}

function renderConfigVersions() {
  const view = S.config;
  if (!view) return;
  const latest = S.history[0];
  let text = `v${view.version} in force`;
  if (latest && latest.version > view.version) text += ` · v${latest.version} accepted, in force from round ${latest.effective_round}`;
  $("config-versions").textContent = text;
  $("config-history").replaceChildren(...S.history.map((h) => {
    const diff = Object.entries(h.diff).map(([k, [a, b]]) => `${k}: ${fmt.value(a)} → ${fmt.value(b)}`).join(", ");
    return el("li", { dataset: { version: h.version } },
      el("span", { class: "ver", text: "v" + h.version }),
      el("span", { class: "hint", text: `${fmt.clock(h.created_at)} · ${h.author} · from round ${h.effective_round}` }),
      el("span", { class: "diff", text: diff || "initial config" }));
  }));
}

function buildQuickFields() {
  for (const [path, label, options] of QUICK_FIELDS) {
    const id = "f-" + path.replace(".", "-");
    const input = options
      ? el("select", { id, dataset: { path } }, el("option", { value: "" }), ...options.map((o) => el("option", { value: o, text: o })))
      : el("input", { id, type: "text", inputmode: "decimal", spellcheck: "false", dataset: { path } });
    input.addEventListener(options ? "change" : "input", () => quickChanged(input));
    $("quick-fields").append(el("label", { class: "quick-field", for: id }, el("span", { text: label }), input));
  }
}

function quickChanged(input) {
  let patch;
  try { patch = JSON.parse($("config-patch").value || "{}"); } catch { patch = null; }
  if (!patch || typeof patch !== "object" || Array.isArray(patch)) {
    setValidation("invalid", "Fix the JSON change below first (or Reset), then use the fields.");
    return;
  }
  const raw = input.value.trim();
  const n = Number(raw);
  const value = raw === "" ? undefined : input.tagName === "SELECT" || !isFinite(n) ? raw : n;
  setPath(patch, input.dataset.path, value);
  $("config-patch").value = JSON.stringify(patch, null, 2);
  validateSoon(0);
}

function syncQuickFromPatch(patch) {
  for (const [path] of QUICK_FIELDS) {
    const v = patch && typeof patch === "object" ? getPath(patch, path) : undefined;
    $("f-" + path.replace(".", "-")).value = v === undefined || v === null || typeof v === "object" ? "" : String(v);
  }
}

function setValidation(state, message, diff) {
  const box = $("config-validation");
  box.dataset.state = state;
  box.replaceChildren(el("div", { class: "msg", text: message }));
  if (diff) box.append(el("ul", { class: "diff-list" },
    ...Object.entries(diff).map(([k, [a, b]]) => el("li", {}, el("code", { text: k }), ` ${fmt.value(a)} → ${fmt.value(b)}`))));
  $("config-apply").disabled = state !== "valid";
}

function validateSoon(delay = 250) {
  clearTimeout(S.validateTimer);
  $("config-apply").disabled = true;
  S.validateTimer = setTimeout(validateNow, delay);
}

async function validateNow() {
  const seq = ++S.validateSeq;
  const text = $("config-patch").value.trim();
  let patch;
  try { patch = JSON.parse(text || "{}"); } catch (e) { setValidation("invalid", "Not valid JSON: " + e.message); return; }
  if (!patch || typeof patch !== "object" || Array.isArray(patch)) {
    setValidation("invalid", 'A change is a JSON object, e.g. {"train": {"sync_every": 40}}');
    return;
  }
  if (Object.keys(patch).length === 0) { setValidation("idle", "No change yet."); return; }
  setValidation("checking", "Checking…");
  try {
    const r = await api("v1/config/validate", { method: "POST", body: { changes: patch } });
    if (seq !== S.validateSeq) return;
    if (!r.valid) setValidation("invalid", r.error);
    else if (Object.keys(r.diff).length === 0) setValidation("same", "Valid, but nothing would change.");
    else setValidation("valid", "Valid. Apply will make this change:", r.diff);
  } catch (e) {
    if (seq === S.validateSeq) setValidation("invalid", e.message);
  }
}

async function applyChange() {
  let patch;
  try { patch = JSON.parse($("config-patch").value); } catch { return; }
  $("config-apply").disabled = true;
  $("config-result").textContent = "";
  try {
    const r = await api("v1/config", { method: "PUT", body: { changes: patch } });
    const when = S.status && r.effective_round <= S.status.current_round ? "in force now" : `in force from round ${r.effective_round}`;
    $("config-result").textContent = r.changed ? `Accepted as v${r.version}, ${when}.` : "Nothing changed.";
    $("config-result").dataset.state = "ok";
    resetEditor();
    loadHistory();
  } catch (e) {
    setValidation("invalid", e.message);
    $("config-result").textContent = "Not applied.";
    $("config-result").dataset.state = "error";
  }
}

function resetEditor() {
  $("config-patch").value = "{}";
  syncQuickFromPatch({});
  setValidation("idle", "No change yet.");
}

// -- start -------------------------------------------------------------------------------------

function init() {
  $("login-form").addEventListener("submit", (e) => { e.preventDefault(); signIn($("token-input").value.trim()); });
  $("signout").addEventListener("click", () => { localStorage.removeItem(TOKEN_KEY); showLogin(); });
  $("config-patch").addEventListener("input", () => {
    try { syncQuickFromPatch(JSON.parse($("config-patch").value)); } catch { /* validateNow reports it */ }
    validateSoon();
  });
  $("config-apply").addEventListener("click", applyChange);
  $("rollback-version").addEventListener("change", () => { setRollbackResult("idle", ""); renderKept(); });
  $("rollback-go").addEventListener("click", rollBackClicked);
  $("events-filter").addEventListener("click", (e) => {
    const chip = e.target.closest("button[data-kind]");
    if (chip) setEventKind(chip.dataset.kind);
  });
  $("config-reset").addEventListener("click", () => { resetEditor(); $("config-result").textContent = ""; });
  window.addEventListener("resize", queueCharts);
  setValidation("idle", "No change yet.");
  // A link may carry the token in its fragment (never sent to a server): keep it, then drop it from the URL.
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("token");
  if (fromHash) history.replaceState(null, "", location.pathname + location.search);
  const token = fromHash || localStorage.getItem(TOKEN_KEY);
  if (token) signIn(token); else showLogin();
}

document.addEventListener("DOMContentLoaded", init);
