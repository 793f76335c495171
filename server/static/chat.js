// The chat page: streams /v1/chat/completions (SSE over fetch), one conversation kept in memory.
// No network but this server; the API key (when the server asks for one) stays in this tab's localStorage.
"use strict";
const $ = (id) => document.getElementById(id);
const state = { history: [], controller: null, key: localStorage.getItem("jaxpaged-api-key") || "", model: null };

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

function status(text) { $("status").textContent = text; }

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

async function connect() {
  // The model list tells whether a key is needed (401) and which name to send.
  const r = await fetch("/v1/models", { headers: headers() });
  if (r.status === 401) {
    $("keybox").hidden = false;
    $("send").disabled = true;
    status(state.key ? "The API key was refused; enter the server's API key." : "This server needs an API key.");
    return;
  }
  const body = await r.json();
  state.model = body.data[0].id;
  $("model").textContent = state.model;
  $("keybox").hidden = true;
  $("send").disabled = false;
  status("Ready.");
}

function settings() {
  const num = (id) => Number($(id).value);
  return { temperature: num("temperature"), top_p: num("top_p"), max_tokens: Math.max(1, Math.floor(num("max_tokens"))) };
}

// Reads an SSE body; calls onData(parsed JSON) per `data:` line until [DONE].
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

async function send(text) {
  state.history.push({ role: "user", content: text });
  bubble("user", text);
  const reply = bubble("assistant", "");
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(state.history);
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  let firstAt = null, chunks = 0, usage = null;
  const showSpeed = () => {
    const tokens = usage ? usage.completion_tokens : chunks;
    const seconds = (performance.now() - (firstAt || started)) / 1000;
    if (firstAt && seconds > 0) $("speed").textContent = (tokens / seconds).toFixed(1) + " tokens/s";
  };
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: state.controller.signal,
      body: JSON.stringify({ model: state.model, messages, stream: true, stream_options: { include_usage: true },
                             ...settings() }),
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || r.statusText);
    }
    status("Generating…");
    await readEvents(r, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      const piece = choice && choice.delta && choice.delta.content;
      if (piece) {
        if (firstAt === null) firstAt = performance.now();
        chunks += 1;
        reply.textContent += piece;
        $("messages").scrollTop = $("messages").scrollHeight;
        showSpeed();
      }
    });
    showSpeed();
    status("Done.");
  } catch (err) {
    if (err.name === "AbortError") {
      status("Stopped.");
      reply.dataset.stopped = "true";
    } else {
      reply.classList.add("error");
      reply.textContent += (reply.textContent ? "\n" : "") + "Error: " + err.message;
      status("Error.");
    }
  } finally {
    state.history.push({ role: "assistant", content: reply.textContent });
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
$("clear").addEventListener("click", () => { state.history = []; $("messages").textContent = ""; status("New chat."); });
$("savekey").addEventListener("click", () => {
  state.key = $("apikey").value.trim();
  localStorage.setItem("jaxpaged-api-key", state.key);
  connect();
});
connect().catch((err) => status("Cannot reach the server: " + err.message));
