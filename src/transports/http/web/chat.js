// The chat of the page served at GET / (see the comment at the top of index.html).
// Text from the model goes through marked (raw HTML in it escaped, never passed through) and
// then DOMPurify (a short list of tags and attributes) before it becomes elements; everything
// else from the model or the server is inserted as text (textContent).
"use strict";
(() => {
  const KEY_ITEM = "pipeline.apiKey";  // sessionStorage: this tab only
  const CHAT_ITEM = "pipeline.chat";  // localStorage: the conversation, across reloads
  const byId = (id) => document.getElementById(id);
  const ui = {
    key: byId("key"), model: byId("model"), temperature: byId("temperature"), topP: byId("top-p"),
    maxTokens: byId("max-tokens"), seed: byId("seed"), system: byId("system"), clear: byId("clear"),
    settings: byId("settings"), log: byId("log"), error: byId("error"), composer: byId("composer"),
    input: byId("input"), send: byId("send"), stop: byId("stop"), dialog: byId("key-dialog"),
    keyForm: byId("key-form"), keyInput: byId("key-input"), keyReason: byId("key-reason"),
    keyCancel: byId("key-cancel"),
  };
  // The conversation: the system prompt, and turns {role, content} (an answer also has
  // reasoning, requestId, model, stats, tokens [[text, logprob, [[text, logprob]...]]...] and
  // its earlier versions, kept for "compare").
  let state = load();
  let controller = null;  // the AbortController of the answer being streamed
  let chat = 0;  // which conversation: "New chat" starts another

  function load() {
    try {
      const saved = JSON.parse(localStorage.getItem(CHAT_ITEM) || "null");
      if (saved && Array.isArray(saved.turns)) return { system: String(saved.system || ""), turns: saved.turns };
    } catch (e) { /* unreadable: start afresh */ }
    return { system: "", turns: [] };
  }
  function save() {
    try { localStorage.setItem(CHAT_ITEM, JSON.stringify(state)); } catch (e) { /* full: keep going */ }
  }

  // --- small helpers -----------------------------------------------------------------------

  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function button(text, className, title, onClick) {
    const node = element("button", className, text);
    node.type = "button";
    if (title) node.title = title;
    node.addEventListener("click", onClick);
    return node;
  }
  function showError(text) { ui.error.textContent = text; ui.error.hidden = false; }
  function clearError() { ui.error.textContent = ""; ui.error.hidden = true; }

  function headers(json) {
    const out = {};
    const key = ui.key.value.trim();
    if (key) out["Authorization"] = "Bearer " + key;
    if (json) out["Content-Type"] = "application/json";
    return out;
  }

  // The message of an error response of either dialect, or its status line.
  async function errorMessage(response) {
    let detail = response.statusText || "error";
    try {
      const body = await response.json();
      const error = body && body.error;
      detail = error && typeof error.message === "string" ? error.message : JSON.stringify(body);
    } catch (e) { /* not JSON: keep the status line */ }
    return detail;
  }
  async function errorText(response) { return response.status + ": " + await errorMessage(response); }

  // --- the API key: asked for when the server answers 401 -----------------------------------

  let asking = null;  // the open prompt's promise, shared by every call that got a 401
  function askKey(reason) {
    if (asking) return asking;
    asking = new Promise((resolve) => {
      ui.keyReason.textContent = reason;
      ui.keyInput.value = "";
      const done = (key) => {
        ui.keyForm.removeEventListener("submit", onSubmit);
        ui.keyCancel.removeEventListener("click", onCancel);
        ui.dialog.removeEventListener("cancel", onCancel);
        if (ui.dialog.open) ui.dialog.close();
        asking = null;
        resolve(key);
      };
      const onSubmit = (event) => { event.preventDefault(); done(ui.keyInput.value.trim() || null); };
      const onCancel = (event) => { event.preventDefault(); done(null); };
      ui.keyForm.addEventListener("submit", onSubmit);
      ui.keyCancel.addEventListener("click", onCancel);
      ui.dialog.addEventListener("cancel", onCancel);
      ui.dialog.showModal();
      ui.keyInput.focus();
    });
    return asking;
  }
  function setKey(key) {
    ui.key.value = key;
    if (key) sessionStorage.setItem(KEY_ITEM, key); else sessionStorage.removeItem(KEY_ITEM);
  }

  // fetch() on this server with the key; a 401 asks for a key and retries with it (the 401
  // response comes back only when the prompt is cancelled).
  async function api(path, options = {}) {
    for (;;) {
      const extra = options.headers || {};
      const response = await fetch(path, { ...options, headers: { ...headers(options.body !== undefined), ...extra } });
      if (response.status !== 401) return response;
      const why = await errorMessage(response.clone());
      const reason = ui.key.value.trim() ? "The server refused this key (" + why + ")."
                                         : "This server needs an API key.";
      const key = await askKey(reason);
      if (key === null) return response;
      setKey(key);
    }
  }

  function setBusy(busy) {
    ui.send.disabled = busy;
    ui.stop.disabled = !busy;
    for (const node of ui.log.querySelectorAll(".actions button")) node.disabled = busy;
  }

  // --- settings ----------------------------------------------------------------------------

  async function loadModels() {
    let response;
    try {
      response = await api("/v1/models");
    } catch (e) {
      showError("cannot reach the server: " + e.message);
      return;
    }
    if (!response.ok) {  // keep the models listed before
      showError("listing the models: " + await errorText(response));
      return;
    }
    const body = await response.json();
    const previous = ui.model.value;
    ui.model.replaceChildren();
    for (const model of body.data) {
      const label = model.state === "ready" ? model.id : model.id + " (" + model.state + ")";
      const option = element("option", "", label);
      option.value = model.id;
      ui.model.append(option);
    }
    if (Array.from(ui.model.options).some((o) => o.value === previous)) ui.model.value = previous;
    clearError();
  }

  function applyKey() {
    setKey(ui.key.value.trim());
    loadModels();
  }

  // A number field's value: undefined when empty (the server's or the model's default is
  // used: the page sends only what the user set), null (with the reason shown) when invalid.
  function numberField(input, name, check, why) {
    const text = input.value.trim();
    if (text === "") return undefined;
    const value = Number(text);
    if (!Number.isFinite(value) || !check(value)) {
      showError(name + " " + why);
      return null;
    }
    return value;
  }
  function samplingFields() {
    const specs = [
      ["temperature", ui.temperature, "temperature", (v) => v >= 0 && v <= 2, "must be a number from 0 to 2"],
      ["top_p", ui.topP, "top p", (v) => v > 0 && v <= 1, "must be a number above 0 and at most 1"],
      ["max_tokens", ui.maxTokens, "max tokens", (v) => Number.isInteger(v) && v >= 1, "must be a whole number of at least 1"],
      ["seed", ui.seed, "seed", Number.isSafeInteger, "must be a whole number"],
    ];
    const fields = {};
    for (const [field, input, name, check, why] of specs) {
      const value = numberField(input, name, check, why);
      if (value === null) return null;
      if (value !== undefined) fields[field] = value;
    }
    return fields;
  }

  // --- Markdown ----------------------------------------------------------------------------

  const ALLOWED_TAGS = ["p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "del",
    "code", "pre", "blockquote", "ul", "ol", "li", "a", "table", "thead", "tbody", "tr", "th",
    "td", "span", "input"];
  const SANITIZE = { ALLOWED_TAGS, ALLOWED_ATTR: ["href", "title", "class", "start", "align",
    "type", "checked", "disabled"], ALLOW_DATA_ATTR: false, RETURN_DOM_FRAGMENT: true };
  const markdown = typeof marked !== "undefined" && typeof DOMPurify !== "undefined" && DOMPurify.isSupported;
  function escapeHtml(text) {
    return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }
  if (markdown) {
    // raw HTML in the model's text is shown as text, never passed through
    marked.use({ gfm: true, breaks: true, renderer: { html(token) { return escapeHtml(token.text); } } });
    DOMPurify.addHook("afterSanitizeAttributes", (node) => {
      if (node.tagName === "A") { node.setAttribute("target", "_blank"); node.setAttribute("rel", "noopener noreferrer"); }
      if (node.tagName === "INPUT" && node.getAttribute("type") !== "checkbox") node.remove();
    });
  }
  if (typeof hljs !== "undefined") hljs.configure({ ignoreUnescapedHTML: true });

  async function copyText(text, control) {
    try {
      await navigator.clipboard.writeText(text);
    } catch (e) {  // no clipboard API here (not a secure context): select and copy
      const area = element("textarea");
      area.value = text;
      document.body.append(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
    control.textContent = "copied";
    setTimeout(() => { control.textContent = "copy"; }, 1500);
  }

  function decorateCode(root) {
    for (const code of root.querySelectorAll("pre > code")) {
      const pre = code.parentElement;
      const language = (Array.from(code.classList).find((c) => c.startsWith("language-")) || "").slice(9);
      if (typeof hljs !== "undefined") {
        if (language && !hljs.getLanguage(language)) code.classList.add("nohighlight");
        else hljs.highlightElement(code);
      }
      const box = element("div", "code");
      const bar = element("div", "code-bar");
      bar.append(element("span", "", language || "code"),
                 button("copy", "copy", "copy this code",
                        (event) => copyText(code.textContent.replace(/\n$/, ""), event.currentTarget)));
      pre.replaceWith(box);
      box.append(bar, pre);
    }
  }

  function renderContent(node, text) {
    if (!markdown) { node.classList.add("plain"); node.textContent = text; return; }
    const fragment = DOMPurify.sanitize(marked.parse(text), SANITIZE);
    node.replaceChildren(fragment);
    decorateCode(node);
  }

  // --- the conversation --------------------------------------------------------------------

  function messageView(role, index) {
    const item = element("article", "message " + role);
    item.dataset.role = role;
    if (index !== undefined) item.dataset.index = String(index);
    const view = {
      item, role: element("div", "role", role), reasoning: element("div", "reasoning"),
      content: element("div", "content"), meta: element("div", "meta"), actions: element("div", "actions"),
    };
    view.reasoning.hidden = true;
    view.meta.hidden = true;
    item.append(view.role, view.reasoning, view.content, view.meta, view.actions);
    ui.log.append(item);
    return view;
  }

  function lastAssistant() {
    for (let i = state.turns.length - 1; i >= 0; i--) if (state.turns[i].role === "assistant") return i;
    return -1;
  }

  function render() {
    ui.log.replaceChildren();
    if (state.system) {
      const view = messageView("system");
      view.content.classList.add("plain");
      view.content.textContent = state.system;
    }
    state.turns.forEach((turn, index) => {
      const view = messageView(turn.role, index);
      if (turn.role === "user") {
        view.content.textContent = turn.content;
        view.actions.append(button("edit", "edit", "edit this message and send it again from here",
                                   () => editTurn(index, view)));
        return;
      }
      if (turn.reasoning) { view.reasoning.textContent = turn.reasoning; view.reasoning.hidden = false; }
      renderContent(view.content, turn.content);
      describeStats(view, turn);
      if (index === lastAssistant()) {
        view.actions.append(button("regenerate", "regenerate", "answer the last message again", regenerate));
      }
    });
    if (ui.log.lastElementChild) ui.log.lastElementChild.scrollIntoView({ block: "end" });
  }

  // Server-sent events of a response body: {event, data} for each complete event.
  async function* serverEvents(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
      // lines end in CRLF, LF or CR; keep a trailing CR until its LF may follow
      const cut = !done && buffer.endsWith("\r") ? buffer.length - 1 : buffer.length;
      buffer = buffer.slice(0, cut).replace(/\r\n?/g, "\n") + buffer.slice(cut);
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const event = { event: "message", data: [] };
        for (const line of block.split("\n")) {
          if (line === "" || line.startsWith(":")) continue;  // a comment (keep-alive)
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          let value = colon < 0 ? "" : line.slice(colon + 1);
          if (value.startsWith(" ")) value = value.slice(1);
          if (field === "data") event.data.push(value);
          else if (field === "event") event.event = value;
        }
        if (event.data.length) yield { event: event.event, data: event.data.join("\n") };
      }
      if (done) return;  // an unterminated last event is dropped, as the SSE spec says
    }
  }

  // The answer's stats: time to the first token apart, and tokens/s over the decode time
  // only (after the first token), so the wait for the first token is not counted twice.
  function stats(run) {
    const tokens = run.usage ? run.usage.completion_tokens : run.chunks;
    const out = { tokens, unit: run.usage ? "tokens" : "chunks", outcome: run.outcome };
    if (run.first !== null) {
      out.ttftMs = run.first - run.start;
      const decode = (run.end - run.first) / 1000;
      out.tokensPerSecond = tokens > 1 && decode > 0 ? (tokens - 1) / decode : null;
    }
    return out;
  }

  function describeStats(view, turn) {
    const s = turn.stats || { tokens: 0, unit: "tokens", outcome: "" };
    const parts = [s.tokens + " " + s.unit];
    if (s.ttftMs !== undefined) {
      view.meta.dataset.timeToFirstTokenMs = s.ttftMs.toFixed(1);
      parts.push("first token " + s.ttftMs.toFixed(0) + " ms");
      if (s.tokensPerSecond !== null) {
        view.meta.dataset.tokensPerSecond = s.tokensPerSecond.toFixed(2);
        parts.push(s.tokensPerSecond.toFixed(1) + " " + s.unit + "/s decode");
      }
    }
    if (s.outcome) parts.push(s.outcome);
    view.meta.replaceChildren(element("span", "stats", parts.join(" · ")));
    view.meta.hidden = false;
    if (turn.requestId) {
      const trace = button("trace", "trace", "download this request's trace (JSONL; read it with: pipeline trace show FILE)",
                           () => downloadTrace(trace, turn.requestId));
      trace.dataset.requestId = turn.requestId;
      const inspect = button("inspect", "inspect", "inspect this answer: token probabilities, alternatives, timeline, compare",
                             () => openInspector(turn));
      view.meta.append(trace, inspect);
    }
  }

  async function downloadTrace(control, requestId) {
    let response;
    try {
      response = await api("/traces/" + encodeURIComponent(requestId));
    } catch (e) {
      showError("fetching the trace: " + e.message);
      return;
    }
    if (!response.ok) {
      showError("fetching the trace: " + await errorText(response));
      return;
    }
    const text = await response.text();
    const events = text.split("\n").filter((line) => line !== "").length;
    control.textContent = "trace (" + events + " events)";
    const url = URL.createObjectURL(new Blob([text], { type: "application/x-ndjson" }));
    const link = element("a");
    link.href = url;
    link.download = requestId + ".jsonl";
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  }

  // Apply one parsed chat.completion.chunk to the run.
  function applyChunk(run, chunk) {
    if (typeof chunk.id === "string" && !run.requestId) run.requestId = chunk.id;
    if (chunk.usage) run.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      const reasoning = typeof delta.reasoning_content === "string" ? delta.reasoning_content : "";
      const content = typeof delta.content === "string" ? delta.content : "";
      if (reasoning || content) {
        if (run.first === null) run.first = performance.now();
        run.chunks += 1;
      }
      run.reasoning += reasoning;
      run.content += content;
      const logprobs = choice.logprobs && Array.isArray(choice.logprobs.content) ? choice.logprobs.content : [];
      for (const lp of logprobs) {
        run.tokens.push([lp.token, lp.logprob, (lp.top_logprobs || []).map((t) => [t.token, t.logprob])]);
      }
      if (choice.finish_reason) run.outcome = "finish: " + choice.finish_reason;
    }
  }

  async function streamAnswer(response, run, view) {
    let pending = false;
    const paint = () => {
      pending = false;
      if (run.reasoning) { view.reasoning.textContent = run.reasoning; view.reasoning.hidden = false; }
      renderContent(view.content, run.content);
      view.item.scrollIntoView({ block: "end" });
    };
    try {
      for await (const event of serverEvents(response.body)) {
        if (event.data === "[DONE]") break;
        const chunk = JSON.parse(event.data);
        if (chunk.error) {
          run.failure = chunk.error.message || JSON.stringify(chunk.error);
          break;
        }
        applyChunk(run, chunk);
        if (!pending) { pending = true; requestAnimationFrame(paint); }
      }
    } catch (e) {
      if (e.name === "AbortError") run.outcome = "stopped";
      else run.failure = e.message;
    }
    if (run.failure !== null) run.outcome = "failed";
  }

  function messages() {
    const out = state.system ? [{ role: "system", content: state.system }] : [];
    return out.concat(state.turns.map((t) => ({ role: t.role, content: t.content })));
  }

  // Answer the conversation as it stands (it ends with a user turn). ``restore`` puts the
  // conversation back when no answer came (``text``: what goes back into the input box).
  async function answer(restore, text, previous) {
    clearError();
    const model = ui.model.value;
    const fields = samplingFields();
    if (!model || fields === null) {
      if (!model) showError("no model to talk to: the model list is empty (is the API key right?)");
      state = restore;
      render();
      return;
    }
    const current = chat;
    render();
    const body = {
      model, messages: messages(), stream: true, stream_options: { include_usage: true },
      logprobs: true, top_logprobs: 5, ...fields,
    };
    controller = new AbortController();
    setBusy(true);
    const run = {
      start: performance.now(), first: null, end: null, chunks: 0, usage: null, content: "",
      reasoning: "", outcome: "finished", failure: null, requestId: null, tokens: [],
    };
    let response = null;
    try {
      response = await api("/v1/chat/completions", {
        method: "POST", body: JSON.stringify(body), signal: controller.signal,
        headers: { "x-pipeline-recording": "full" },  // the inspector's raw and processed top-k
      });
    } catch (e) {
      run.failure = e.name === "AbortError" ? "stopped before the server answered"
                                            : "cannot reach the server: " + e.message;
    }
    if (response !== null && !response.ok) run.failure = await errorText(response);
    if (run.failure !== null) {  // nothing was generated: the conversation is as it was
      controller = null;
      setBusy(false);
      if (current !== chat) return;
      state = restore;
      render();
      if (text && !ui.input.value) ui.input.value = text;
      showError(run.failure);
      return;
    }
    run.requestId = response.headers.get("x-request-id");
    const view = messageView("assistant");
    await streamAnswer(response, run, view);
    run.end = performance.now();
    controller = null;
    setBusy(false);
    if (current !== chat) return;  // "New chat" was pressed meanwhile
    if (run.content || run.reasoning) {
      const versions = previous ? (previous.versions || []).concat([{ ...previous, versions: undefined }]) : [];
      state.turns.push({
        role: "assistant", content: run.content, reasoning: run.reasoning, requestId: run.requestId,
        model, stats: stats(run), tokens: run.tokens, versions,
      });
      save();
      render();
    } else {  // an empty answer (stopped, failed) does not enter the conversation
      view.item.remove();
      state = restore;
      render();
      if (text && !ui.input.value) ui.input.value = text;
    }
    if (run.failure !== null) showError("the answer failed: " + run.failure);
  }

  function snapshot() { return JSON.parse(JSON.stringify(state)); }

  function send(text) {
    const before = snapshot();
    state.turns.push({ role: "user", content: text });
    save();
    answer(before, text, null);
  }

  function regenerate() {
    if (controller !== null) return;
    const index = lastAssistant();
    if (index < 0) return;
    const before = snapshot();
    const previous = state.turns[index];
    state.turns = state.turns.slice(0, index);
    answer(before, "", previous);
  }

  function editTurn(index, view) {
    if (controller !== null) return;
    const editor = element("form", "editor");
    const area = element("textarea");
    area.value = state.turns[index].content;
    const save_ = element("button", "", "Send");
    save_.type = "submit";
    editor.append(area, element("div", "actions"));
    editor.lastChild.append(save_, button("Cancel", "", "", () => render()));
    editor.addEventListener("submit", (event) => {
      event.preventDefault();
      if (!area.value.trim() || controller !== null) return;
      const before = snapshot();
      state.turns = state.turns.slice(0, index).concat([{ role: "user", content: area.value }]);
      save();
      answer(before, "", null);
    });
    view.content.replaceWith(editor);
    view.actions.hidden = true;
    area.focus();
  }

  // --- the inspector (inspector.js) --------------------------------------------------------

  function openInspector(turn) {
    if (typeof PipelineInspector === "undefined") { showError("the inspector did not load"); return; }
    const others = [];  // every other answer of the conversation, earlier versions included
    let number = 0;
    for (const t of state.turns) {
      if (t.role !== "assistant") continue;
      number += 1;
      const versions = (t.versions || []).concat([t]);
      versions.forEach((v, k) => {
        if (!v.requestId || v.requestId === turn.requestId) return;
        others.push({ ...v, label: "answer " + number + (versions.length > 1 ? ", version " + (k + 1) : "") });
      });
    }
    PipelineInspector.open({ answer: turn, others, api, errorText });
  }

  // --- wiring ------------------------------------------------------------------------------

  ui.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = ui.input.value;
    if (!text.trim() || controller !== null) return;
    ui.input.value = "";
    send(text);
  });
  ui.input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      ui.composer.requestSubmit();
    }
  });
  ui.stop.addEventListener("click", () => { if (controller !== null) controller.abort(); });
  ui.clear.addEventListener("click", () => {
    if (controller !== null) controller.abort();
    chat += 1;
    state = { system: ui.system.value, turns: [] };
    save();
    render();
    clearError();
    if (typeof PipelineInspector !== "undefined") PipelineInspector.close();
  });
  ui.system.addEventListener("input", () => { state.system = ui.system.value; save(); });
  ui.system.addEventListener("change", () => { if (controller === null) render(); });
  ui.settings.addEventListener("submit", (event) => event.preventDefault());
  ui.key.addEventListener("change", applyKey);  // on leaving the field
  ui.key.addEventListener("keydown", (event) => {
    if (event.key === "Enter") { event.preventDefault(); applyKey(); }
  });

  ui.key.value = sessionStorage.getItem(KEY_ITEM) || "";
  ui.system.value = state.system;
  render();
  document.body.dataset.ready = "true";
  loadModels();
})();
