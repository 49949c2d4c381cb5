// pagedlm's web page: a chat over /v1/chat/completions and a live view of /engine/events.
// Everything stays in this browser: the conversation, settings and API key in localStorage.
"use strict";

const $ = (id) => document.getElementById(id);
const KEYS = { chat: "pagedlm.chat", settings: "pagedlm.settings", apiKey: "pagedlm.apiKey" };

const state = {
  apiKey: localStorage.getItem(KEYS.apiKey) || "",
  model: null,
  messages: JSON.parse(localStorage.getItem(KEYS.chat) || "[]"),
  controller: null,      // the streaming chat request's AbortController
  events: null,          // the engine events stream's AbortController
  history: [],           // [{prefill, decode}] per engine view, for the chart
  last: null,            // the previous engine view
};

function authHeaders(extra = {}) {
  return state.apiKey ? { ...extra, Authorization: `Bearer ${state.apiKey}` } : extra;
}

async function errorMessage(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || `HTTP ${resp.status}`;
  } catch (_) {
    return `HTTP ${resp.status}`;
  }
}

// ---- API key ---------------------------------------------------------------------------------
function askForKey(message) {
  $("key-message").textContent = message;
  $("key-panel").hidden = false;
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  state.apiKey = $("key-input").value.trim();
  localStorage.setItem(KEYS.apiKey, state.apiKey);
  $("key-input").value = "";
  $("key-panel").hidden = true;
  start();
});
$("key-button").addEventListener("click", () => askForKey("API key for this server:"));

// ---- chat ------------------------------------------------------------------------------------
function loadSettings() {
  const s = JSON.parse(localStorage.getItem(KEYS.settings) || "{}");
  if (s.system !== undefined) $("system-prompt").value = s.system;
  if (s.temperature !== undefined) $("temperature").value = s.temperature;
  if (s.top_p !== undefined) $("top-p").value = s.top_p;
  if (s.max_tokens !== undefined) $("max-tokens").value = s.max_tokens;
}

function saveSettings() {
  localStorage.setItem(KEYS.settings, JSON.stringify({
    system: $("system-prompt").value, temperature: $("temperature").value,
    top_p: $("top-p").value, max_tokens: $("max-tokens").value,
  }));
}

for (const id of ["system-prompt", "temperature", "top-p", "max-tokens"]) {
  $(id).addEventListener("change", saveSettings);
}

function saveChat() {
  localStorage.setItem(KEYS.chat, JSON.stringify(state.messages));
}

function renderMessage(m) {
  const div = document.createElement("div");
  div.className = `msg ${m.role}`;
  div.textContent = m.content;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function renderChat() {
  $("messages").replaceChildren();
  state.messages.forEach(renderMessage);
}

function showChatError(text) {
  $("chat-error").textContent = text;
  $("chat-error").hidden = !text;
}

function setStreaming(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

async function send(text) {
  showChatError("");
  const user = { role: "user", content: text };
  state.messages.push(user);
  renderMessage(user);
  saveChat();
  const reply = { role: "assistant", content: "" };
  const div = renderMessage(reply);
  div.classList.add("streaming");
  const system = $("system-prompt").value.trim();
  const body = {
    model: state.model || undefined,
    messages: [...(system ? [{ role: "system", content: system }] : []),
               ...state.messages],
    stream: true,
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  state.controller = new AbortController();
  setStreaming(true);
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (resp.status === 401) {
      const message = await errorMessage(resp);
      askForKey(`API key refused: ${message}`);
      throw new Error(message);
    }
    if (!resp.ok) throw new Error(await errorMessage(resp));
    for await (const data of sseData(resp, state.controller.signal)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        reply.content += delta.content;
        div.textContent = reply.content;
        $("messages").scrollTop = $("messages").scrollHeight;
      }
    }
  } catch (err) {
    if (err.name !== "AbortError") showChatError(err.message);
  } finally {
    div.classList.remove("streaming");
    state.controller = null;
    setStreaming(false);
    if (reply.content) {
      state.messages.push(reply);
    } else {
      div.remove();
    }
    saveChat();
  }
}

$("chat-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || state.controller) return;
  $("chat-input").value = "";
  send(text);
});
$("chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("chat-form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.messages = [];
  saveChat();
  renderChat();
  showChatError("");
});

// ---- server-sent events over fetch (EventSource cannot send the Authorization header) -------
async function* sseData(resp, signal) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    while (true) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data) yield data;
      }
    }
  } finally {
    if (!signal || !signal.aborted) reader.cancel().catch(() => {});
  }
}

// ---- engine view -----------------------------------------------------------------------------
function renderBlocks(map) {
  const box = $("block-map");
  if (box.childElementCount !== map.length) {
    box.replaceChildren(...Array.from(map, () => document.createElement("div")));
  }
  const cells = box.children;
  for (let i = 0; i < map.length; i++) {
    const cls = map[i] === "." ? "" : map[i];
    if (cells[i].className !== cls) cells[i].className = cls;
  }
}

function count(map, ch) {
  let n = 0;
  for (const c of map) if (c === ch) n++;
  return n;
}

function renderChart() {
  const canvas = $("token-chart");
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const data = state.history;
  const max = Math.max(1, ...data.map((d) => d.prefill + d.decode));
  const bw = w / 60;
  const css = getComputedStyle(document.documentElement);
  data.forEach((d, i) => {
    const x = i * bw;
    const hp = (d.prefill / max) * (h - 4), hd = (d.decode / max) * (h - 4);
    ctx.fillStyle = css.getPropertyValue("--decode");
    ctx.fillRect(x, h - hd, bw - 1, hd);
    ctx.fillStyle = css.getPropertyValue("--prefill");
    ctx.fillRect(x, h - hd - hp, bw - 1, hp);
  });
}

function renderView(v) {
  $("q-running").textContent = v.num_running;
  $("q-waiting").textContent = v.num_waiting;
  $("q-swapped").textContent = v.num_swapped;
  $("steps").textContent = v.num_steps;
  $("preemptions").textContent = v.num_preemptions;
  $("hit-rate").textContent = `${(100 * v.prefix_cache_hit_rate).toFixed(0)}%`;
  // Speculative decoding, since start-up: shown only when the engine speculates.
  document.querySelectorAll(".spec").forEach((el) => { el.hidden = !v.speculative; });
  if (v.speculative && v.spec_num_draft_tokens > 0) {
    $("spec-rate").textContent = `${(100 * v.spec_acceptance_rate).toFixed(0)}%`;
    $("spec-length").textContent = v.spec_mean_acceptance_length.toFixed(2);
  }
  $("kv-used").textContent = count(v.block_map, "u");
  $("kv-shared").textContent = count(v.block_map, "s");
  $("kv-cached").textContent = count(v.block_map, "c");
  $("kv-free").textContent = count(v.block_map, ".");
  renderBlocks(v.block_map);
  const last = state.last;
  if (last) {
    const steps = v.num_steps - last.num_steps;
    const prefill = v.num_prompt_tokens - last.num_prompt_tokens;
    const decode = v.num_generation_tokens - last.num_generation_tokens;
    const dt = Math.max(1e-3, v.time - last.time);
    $("throughput").textContent = ((prefill + decode) / dt).toFixed(0);
    const per = (n) => (steps > 0 ? n / steps : 0);
    $("tok-prefill").textContent = per(prefill).toFixed(1);
    $("tok-decode").textContent = per(decode).toFixed(1);
    state.history.push({ prefill: per(prefill), decode: per(decode) });
    if (state.history.length > 60) state.history.shift();
    renderChart();
  }
  state.last = v;
  const rows = v.requests.map((r) => {
    const tr = document.createElement("tr");
    for (const val of [r.request_id, r.queue, r.num_seqs, r.num_prompt_tokens,
                       r.num_output_tokens, r.num_computed_tokens, r.num_blocks]) {
      const td = document.createElement("td");
      td.textContent = val;
      tr.appendChild(td);
    }
    return tr;
  });
  $("requests").tBodies[0].replaceChildren(...rows);
}

async function watchEngine() {
  if (state.events) state.events.abort();
  const controller = new AbortController();
  state.events = controller;
  while (!controller.signal.aborted) {
    try {
      const resp = await fetch("/engine/events", { headers: authHeaders(),
                                                    signal: controller.signal });
      if (resp.status === 401) {
        $("engine-state").textContent = "API key refused";
        askForKey(`API key refused: ${await errorMessage(resp)}`);
        return;
      }
      if (!resp.ok) throw new Error(await errorMessage(resp));
      $("engine-state").textContent = "live";
      for await (const data of sseData(resp, controller.signal)) renderView(JSON.parse(data));
      continue;  // the server ends each stream after a few seconds: reconnect at once
    } catch (err) {
      if (controller.signal.aborted) return;
      $("engine-state").textContent = `disconnected (${err.message}); retrying`;
    }
    await new Promise((r) => setTimeout(r, 2000));
  }
}

// ---- start -----------------------------------------------------------------------------------
async function start() {
  $("status").textContent = "";
  try {
    const resp = await fetch("/v1/models", { headers: authHeaders() });
    if (resp.status === 401) {
      $("status").textContent = "API key needed";
      $("engine-state").textContent = "API key needed";
      askForKey(state.apiKey ? `API key refused: ${await errorMessage(resp)}`
                             : "This server needs an API key.");
      return;
    }
    if (!resp.ok) throw new Error(await errorMessage(resp));
    const models = await resp.json();
    state.model = models.data.length ? models.data[0].id : null;
    $("model-name").textContent = state.model || "";
    watchEngine();
  } catch (err) {
    $("status").textContent = `server unreachable: ${err.message}`;
  }
}

loadSettings();
renderChat();
start();
