// segserve playground: streams from the router's own API and shows how each token came about.
// Chat and completion use /v1 with stream_options.include_speculation, whose `segserve` object says per
// token whether it was an accepted draft or the model's own, in which segment kind, and the tree of its
// step; /v2 generate_stream shows plain text. No libraries, nothing fetched from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { mode: "chat", sessionId: newSessionId(), messages: [], controller: null, model: null };
const live = { start: 0, samples: [], segments: new Map(), numTokens: 0, numDrafted: 0 };

function newSessionId() {
  return "pg-" + Date.now().toString(36) + "-" + Math.random().toString(36).slice(2, 8);
}

function apiHeaders() {
  const headers = { "Content-Type": "application/json", "X-Session-Id": state.sessionId };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

// ---- errors: the API's message as it is -------------------------------------------------------------
function showError(text) {
  $("error").textContent = text;
  $("error").hidden = false;
}

function hideError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

async function errorText(response) {
  const raw = await response.text();
  try {
    const body = JSON.parse(raw);
    const error = body.error ?? body;
    const message = typeof error === "string" ? error : error.message ?? raw;
    return `HTTP ${response.status}: ${message}`;
  } catch {
    return `HTTP ${response.status}: ${raw}`;
  }
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: apiHeaders() });
    if (!response.ok) {
      showError(await errorText(response));
      return;
    }
    state.model = (await response.json()).data[0].id;
    $("model").textContent = "model: " + state.model;
    hideError();
  } catch (exc) {
    showError(String(exc));
  }
}

// ---- parameters --------------------------------------------------------------------------------------
function field(name) {
  return $("params").elements[name];
}

function numberOf(name) {
  const value = field(name).value.trim();
  return value === "" ? undefined : Number(value);
}

function sampling() {
  const out = {};
  for (const name of ["temperature", "top_p", "top_k", "typical_p", "repetition_penalty", "frequency_penalty",
                      "presence_penalty", "seed"]) {
    const value = numberOf(name);
    if (value !== undefined) out[name] = value;
  }
  const stops = field("stop").value.split("\n").filter((s) => s !== "");
  if (stops.length) out.stop = stops;
  const bias = field("logit_bias").value.trim();
  if (bias) out.logit_bias = JSON.parse(bias);  // a SyntaxError is shown like an API error
  if (field("ignore_eos").checked) out.ignore_eos = true;
  return out;
}

function openaiBody(extra) {
  const body = { model: state.model, stream: true, max_tokens: numberOf("max_tokens"), ...sampling(), ...extra };
  body.stream_options = { include_usage: true, include_speculation: field("include_speculation").checked };
  return body;
}

function v2Body(text) {
  const parameters = { max_new_tokens: numberOf("max_tokens") };
  for (const name of ["temperature", "top_p", "top_k", "typical_p", "repetition_penalty", "seed"]) {
    const value = numberOf(name);
    if (value !== undefined && !(name === "temperature" && value === 0)) parameters[name] = value;
  }
  for (const name of ["do_sample", "watermark", "details", "perf_stat"]) {
    if (field(name).checked) parameters[name] = true;
  }
  return { text_input: text, parameters };
}

function requestFor(text) {
  if (state.mode === "chat") {
    return { url: "/v1/chat/completions", body: openaiBody({ messages: [...state.messages] }) };
  }
  if (state.mode === "completion") {
    return { url: "/v1/completions", body: openaiBody({ prompt: text }) };
  }
  return { url: `/v2/models/${encodeURIComponent(state.model)}/generate_stream`, body: v2Body(text) };
}

// ---- the transcript ------------------------------------------------------------------------------------
function addTurn(role, text) {
  const turn = document.createElement("div");
  turn.className = "turn " + role;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  turn.append(label, body);
  $("transcript").append(turn);
  $("transcript").scrollTop = $("transcript").scrollHeight;
  return { el: body, content: "", pieces: [] };
}

function hue(segment) {
  let h = 0;
  for (const ch of segment || "default") h = (h * 31 + ch.charCodeAt(0)) % 360;
  return h;
}

function describe(piece) {
  const origin = piece.origin === "draft" ? "accepted draft" : "model-decoded";
  const tree = piece.tree_size ? `tree of ${piece.tree_size} drafts, depth ${piece.tree_depth}` : "no tree this step";
  return `${origin} · segment ${piece.segment || "(default)"} · ${tree}`;
}

// The text of record is the stream's content; the pieces (one per token) colour it in order.
function renderTurn(turn) {
  const fragment = document.createDocumentFragment();
  let offset = 0;
  for (const piece of turn.pieces) {
    const text = turn.content.slice(offset, offset + piece.text.length);
    offset += piece.text.length;
    if (!text) continue;
    const span = document.createElement("span");
    span.className = "tok " + piece.origin;
    span.style.setProperty("--hue", hue(piece.segment));
    span.dataset.origin = piece.origin;
    span.dataset.segment = piece.segment;
    span.dataset.treeSize = piece.tree_size;
    span.dataset.treeDepth = piece.tree_depth;
    span.title = describe(piece);
    span.textContent = text;
    fragment.append(span);
  }
  if (offset < turn.content.length) fragment.append(document.createTextNode(turn.content.slice(offset)));
  turn.el.replaceChildren(fragment);
  $("transcript").scrollTop = $("transcript").scrollHeight;
}

// ---- live numbers and the chart ------------------------------------------------------------------------
function resetLive() {
  Object.assign(live, { start: performance.now(), samples: [], segments: new Map(), numTokens: 0, numDrafted: 0 });
  $("stat-finish").textContent = "-";
  updateStats();
}

function noteTokens(numTokens, speculation) {
  live.numTokens += numTokens;
  for (const step of speculation ? speculation.steps : []) {
    if (!step.tree_size) continue;  // a step without a tree: nothing drafted, nothing to accept
    const name = step.segment || "(default)";
    if (step.num_accepted) addSegmentToLegend(step.segment);
    const seg = live.segments.get(name) ?? { drafts: 0, accepted: 0 };
    seg.drafts += step.tree_size;
    seg.accepted += step.num_accepted;
    live.segments.set(name, seg);
    live.numDrafted += step.num_accepted;
  }
  live.samples.push({ t: (performance.now() - live.start) / 1000, tokens: live.numTokens });
  updateStats();
}

function addSegmentToLegend(segment) {
  const name = segment || "(default)";
  const legend = $("segments");
  if ([...legend.children].some((chip) => chip.dataset.segment === name)) return;
  const chip = document.createElement("span");
  chip.className = "tok draft";
  chip.dataset.segment = name;
  chip.style.setProperty("--hue", hue(segment));
  chip.textContent = "segment " + name;
  legend.append(chip);
}

function rateAt(index) {
  const now = live.samples[index];
  let first = index;
  while (first > 0 && now.t - live.samples[first - 1].t <= 1.0) first -= 1;
  const base = first > 0 ? live.samples[first - 1] : { t: 0, tokens: 0 };
  return now.t > base.t ? (now.tokens - base.tokens) / (now.t - base.t) : 0;
}

function updateStats() {
  const n = live.samples.length;
  $("stat-tokens").textContent = live.numTokens;
  $("stat-rate").textContent = n ? rateAt(n - 1).toFixed(1) : "0";
  $("stat-drafted").textContent = live.numDrafted;
  let drafts = 0;
  for (const seg of live.segments.values()) drafts += seg.drafts;
  $("stat-acceptance").textContent = drafts ? (100 * live.numDrafted / drafts).toFixed(0) + "%" : "-";
  drawChart();
}

function drawChart() {
  const canvas = $("chart");
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, top = Math.round(h * 0.55);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "10px sans-serif";
  ctx.fillStyle = "#6b6b70";
  ctx.fillText("tokens/s", 4, 10);
  const rates = live.samples.map((_, i) => rateAt(i));
  const maxRate = Math.max(1, ...rates), maxT = Math.max(1, ...live.samples.map((s) => s.t));
  ctx.fillText(maxRate.toFixed(0), w - 24, 10);
  ctx.strokeStyle = "#2f6fdd";
  ctx.beginPath();
  live.samples.forEach((s, i) => {
    const x = 4 + (w - 8) * s.t / maxT, y = top - 4 - (top - 16) * rates[i] / maxRate;
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
  ctx.fillStyle = "#6b6b70";
  ctx.fillText("acceptance per segment", 4, top + 10);
  const segments = [...live.segments.entries()].filter(([, s]) => s.drafts > 0);
  const barW = segments.length ? Math.min(60, (w - 8) / segments.length - 6) : 0;
  segments.forEach(([name, seg], i) => {
    const rate = seg.accepted / seg.drafts, x = 4 + i * (barW + 6), barH = (h - top - 30) * rate;
    ctx.fillStyle = `hsl(${hue(name === "(default)" ? "" : name)} 70% 55%)`;
    ctx.fillRect(x, h - 14 - barH, barW, barH);
    ctx.fillStyle = "#1d1d1f";
    ctx.fillText(`${name} ${(100 * rate).toFixed(0)}%`, x, h - 3);
  });
}

// ---- streaming -----------------------------------------------------------------------------------------
function handleEvent(data, turn) {
  if (data === "[DONE]") return;
  const event = JSON.parse(data);
  if (event.error) {  // an error event mid-stream
    showError(typeof event.error === "string" ? event.error : event.error.message);
    return;
  }
  let text = "", finish = null;
  if (state.mode === "v2") {
    text = event.text_output ?? "";
    finish = event.finish_reason ?? null;
  } else if (event.choices && event.choices.length) {
    const choice = event.choices[0];
    text = (state.mode === "chat" ? choice.delta?.content : choice.text) ?? "";
    finish = choice.finish_reason ?? null;
  }
  turn.content += text;
  if (event.segserve) {
    for (const token of event.segserve.tokens) {
      turn.pieces.push({ ...event.segserve.steps[token.step], text: token.text, origin: token.origin });
    }
  }
  const numTokens = event.segserve ? event.segserve.tokens.length : (text ? 1 : 0);
  if (numTokens) noteTokens(numTokens, event.segserve);
  if (event.usage) $("stat-tokens").textContent = event.usage.completion_tokens;
  if (finish) $("stat-finish").textContent = finish;
  renderTurn(turn);
}

async function readStream(response, turn) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data:")) handleEvent(line.slice(5).trimStart(), turn);
      }
    }
  }
}

async function send(text) {
  hideError();
  if (!state.model) await loadModel();
  if (!state.model) return;
  if (state.mode === "chat") state.messages.push({ role: "user", content: text });
  let request;
  try {
    request = requestFor(text);
  } catch (exc) {
    showError(String(exc));
    if (state.mode === "chat") state.messages.pop();
    return;
  }
  $("request-body").textContent = `POST ${request.url}\n${JSON.stringify(request.body, null, 2)}`;
  addTurn(state.mode === "chat" ? "user" : "prompt", text);
  const turn = addTurn(state.mode === "chat" ? "assistant" : "completion", "");
  resetLive();
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  try {
    const response = await fetch(request.url, {
      method: "POST", headers: apiHeaders(), body: JSON.stringify(request.body), signal: state.controller.signal,
    });
    if (!response.ok) {
      showError(await errorText(response));
      if (state.mode === "chat") state.messages.pop();
      return;
    }
    await readStream(response, turn);
    if (state.mode === "chat") state.messages.push({ role: "assistant", content: turn.content });
  } catch (exc) {
    if (exc.name !== "AbortError") showError(String(exc));
    else if (state.mode === "chat") state.messages.push({ role: "assistant", content: turn.content });
  } finally {
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

// ---- wiring --------------------------------------------------------------------------------------------
function newSession() {
  state.sessionId = newSessionId();
  state.messages = [];
  $("session-id").textContent = state.sessionId;
  $("transcript").replaceChildren();
  hideError();
}

function setMode(mode) {
  state.mode = mode;
  for (const button of document.querySelectorAll("#modes button")) {
    button.classList.toggle("active", button.dataset.mode === mode);
  }
  $("prompt").placeholder = mode === "chat" ? "Type a message; Ctrl+Enter sends" : "Type a prompt; Ctrl+Enter sends";
}

document.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = localStorage.getItem("segserve-api-key") ?? "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem("segserve-api-key", $("api-key").value.trim());
    loadModel();
  });
  for (const button of document.querySelectorAll("#modes button")) {
    button.addEventListener("click", () => setMode(button.dataset.mode));
  }
  $("new-session").addEventListener("click", newSession);
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("composer").requestSubmit();
  });
  $("session-id").textContent = state.sessionId;
  drawChart();
  loadModel();
});
