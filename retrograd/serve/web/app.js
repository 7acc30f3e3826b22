// retrograd-server's page: the runs (polled), the selected run's curves and log (server-sent
// events read through fetch, so the API-key cookie or header applies), and a chat box that talks to
// any RUN_ID@... through the same /v1/chat/completions route every OpenAI client uses.
"use strict";

const CURVES = ["loss", "reward_mean", "kl", "eval_loss", "eval_reward", "grad_norm"];
let selected = null;
let follow = null;           // AbortController of the selected run's event stream
let points = {};             // curve name -> [[step, value], ...]
const history = [];          // chat messages of the current conversation

const $ = (id) => document.getElementById(id);

async function api(path, options = {}) {
  const r = await fetch(path, options);
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error((body.error && body.error.message) || r.status + " " + r.statusText);
  return body;
}

function fmt(v) {
  if (v === undefined || v === null) return "";
  return Math.abs(v) >= 1000 || (Math.abs(v) < 0.001 && v !== 0) ? v.toExponential(2) : (+v).toPrecision(4);
}

async function refreshRuns() {
  let runs;
  try {
    runs = (await api("/api/runs")).runs;
    $("status").textContent = runs.length + " run" + (runs.length === 1 ? "" : "s");
  } catch (e) {
    $("status").textContent = "server unreachable: " + e.message;
    return;
  }
  const body = $("runs").querySelector("tbody");
  body.innerHTML = "";
  $("no-runs").style.display = runs.length ? "none" : "";
  for (const run of runs.slice().reverse()) {
    const tr = document.createElement("tr");
    tr.className = "run" + (run.id === selected ? " selected" : "");
    tr.dataset.run = run.id;
    const step = run.total ? run.step + "/" + run.total : String(run.step);
    tr.innerHTML = `<td>${run.id}</td><td>${run.algorithm}</td><td class="state ${run.state}">${run.state}</td>` +
      `<td>${step}</td><td>${fmt(run.last.loss)}</td><td>${fmt(run.last.reward_mean)}</td><td></td>`;
    const action = ["queued", "running"].includes(run.state) ? "stop"
      : ["stopped", "failed", "crashed"].includes(run.state) ? "resume" : null;
    if (action) {
      const b = document.createElement("button");
      b.textContent = action;
      b.className = "action-" + action;
      b.onclick = async (ev) => {
        ev.stopPropagation();
        try { await api(`/api/runs/${run.id}/${action}`, { method: "POST" }); } catch (e) { alert(e.message); }
        refreshRuns();
      };
      tr.lastChild.appendChild(b);
    }
    if (run.error) tr.title = run.error;
    tr.onclick = () => select(run.id);
    body.appendChild(tr);
  }
  if (!selected && runs.length) select(runs[runs.length - 1].id);
  refreshModels();
}

async function refreshModels() {
  const sel = $("chat-model");
  let ids;
  try { ids = (await api("/v1/models")).data.map((m) => m.id); } catch (e) { return; }
  const keep = sel.value;
  if (ids.join() === Array.from(sel.options).map((o) => o.value).join()) return;
  sel.innerHTML = "";
  for (const id of ids) sel.add(new Option(id, id));
  if (ids.includes(keep)) sel.value = keep;
}

function select(runId) {
  selected = runId;
  points = {};
  $("detail-title").textContent = runId;
  $("log").textContent = "";
  draw();
  document.querySelectorAll("tr.run").forEach((tr) => tr.classList.toggle("selected", tr.dataset.run === runId));
  if (follow) follow.abort();
  follow = new AbortController();
  stream(`/api/runs/${runId}/events`, follow.signal, onEvent).catch(() => {});
}

// Reads a text/event-stream response and calls handle(kind, data) for each event.
async function stream(path, signal, handle) {
  const r = await fetch(path, { signal });
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let kind = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) kind = line.slice(7);
        else if (line.startsWith("data: ")) data.push(line.slice(6));
      }
      handle(kind, data.join("\n"));
    }
  }
}

function onEvent(kind, data) {
  if (kind === "metrics") {
    const rec = JSON.parse(data);
    for (const k of CURVES) {
      if (typeof rec[k] === "number") (points[k] = points[k] || []).push([rec.step, rec[k]]);
    }
    draw();
  } else if (kind === "reset") {
    points = {};
  } else if (kind === "log") {
    const log = $("log");
    log.textContent += data + "\n";
    log.scrollTop = log.scrollHeight;
  } else if (kind === "state") {
    refreshRuns();
  }
}

function draw() {
  const box = $("charts");
  box.innerHTML = "";
  for (const k of CURVES) {
    const pts = points[k];
    if (!pts || !pts.length) continue;
    const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1), y0 = Math.min(...ys), y1 = Math.max(...ys);
    const span = y1 - y0 || Math.abs(y1) || 1;
    const W = 400, H = 120, P = 6;
    const xy = pts.map((p) => [P + (W - 2 * P) * (p[0] - x0) / (x1 - x0), H - P - (H - 2 * P) * (p[1] - y0) / span]);
    const path = xy.map((q, i) => (i ? "L" : "M") + q[0].toFixed(1) + " " + q[1].toFixed(1)).join(" ");
    // points as dots while there are few of them (a single evaluation is otherwise invisible)
    const dots = xy.length < 30 ? xy.map((q) => `<ellipse cx="${q[0].toFixed(1)}" cy="${q[1].toFixed(1)}" rx="3" ry="3"` +
      ` fill="#2f6fde"/>`).join("") : "";
    const div = document.createElement("div");
    div.className = "chart";
    div.dataset.curve = k;
    div.innerHTML = `<span class="name">${k}</span><span class="value">step ${xs[xs.length - 1]}: ${fmt(ys[ys.length - 1])}` +
      ` (min ${fmt(y0)}, max ${fmt(y1)})</span><svg viewBox="0 0 ${W} ${H}" preserveAspectRatio="none">` +
      `<path d="${path}" fill="none" stroke="#2f6fde" stroke-width="1.6" vector-effect="non-scaling-stroke"/>${dots}</svg>`;
    box.appendChild(div);
  }
}

function say(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.innerHTML = `<span class="who"></span>`;
  div.firstChild.textContent = role;
  div.appendChild(document.createTextNode(text));
  $("chat-log").appendChild(div);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return div;
}

$("chat-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const text = $("chat-input").value.trim();
  const model = $("chat-model").value;
  if (!text || !model) return;
  $("chat-input").value = "";
  history.push({ role: "user", content: text });
  say("user", text);
  const wait = say("assistant", "…");
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model, messages: history, temperature: 0, max_tokens: 128 }),
    });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : String(r.status));
    const answer = body.choices[0].message.content || "";
    const step = r.headers.get("X-Retrograd-Step");
    history.push({ role: "assistant", content: answer });
    wait.lastChild.textContent = answer;
    wait.firstChild.textContent = model + (step ? " (step " + step + ")" : "");
  } catch (err) {
    history.pop();
    wait.className = "msg error";
    wait.lastChild.textContent = err.message;
  }
});

$("submit-btn").addEventListener("click", async () => {
  const path = $("submit-path").value.trim(), toml = $("submit-toml").value;
  const body = path ? { config: path } : { toml };
  try {
    const run = await api("/api/runs", { method: "POST", headers: { "Content-Type": "application/json" },
                                         body: JSON.stringify(body) });
    $("submit-msg").textContent = "submitted " + run.id;
    select(run.id);
  } catch (e) {
    $("submit-msg").textContent = e.message;
  }
  refreshRuns();
});

refreshRuns();
setInterval(refreshRuns, 2000);
