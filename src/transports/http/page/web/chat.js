// The chat of the page served at GET / (see the comment at the top of index.html).
// Text from the model goes through marked (raw HTML in it escaped, never passed through) and
// then DOMPurify (a short list of tags and attributes) before it becomes elements; everything
// else from the model or the server is inserted as text (textContent).
"use strict";
(() => {
  const KEY_ITEM = "pipeline.apiKey";  // sessionStorage: this tab only
  const CHATS_ITEM = "pipeline.chats";  // localStorage: every conversation, across reloads
  const OLD_CHAT_ITEM = "pipeline.chat";  // the one conversation earlier pages kept
  const byId = (id) => document.getElementById(id);
  const ui = {
    key: byId("key"), model: byId("model"), temperature: byId("temperature"), topP: byId("top-p"),
    maxTokens: byId("max-tokens"), seed: byId("seed"), taps: byId("taps"), system: byId("system"), clear: byId("clear"),
    settings: byId("settings"), log: byId("log"), error: byId("error"), composer: byId("composer"),
    input: byId("input"), send: byId("send"), stop: byId("stop"), dialog: byId("key-dialog"),
    keyForm: byId("key-form"), keyInput: byId("key-input"), keyReason: byId("key-reason"),
    keyCancel: byId("key-cancel"), chatList: byId("chat-list"), modelAbout: byId("model-about"),
  };
  // The conversations: {current: id, chats: [conversation...]}, most recently used first. A
  // conversation is {id, system, turns, updated}; a turn is {role, content}, and an answer
  // also has reasoning, requestId, model, stats, tokens [[text, logprob, [[text, logprob]...]]...],
  // and its other versions: ``versions`` (in order, without itself) and ``version`` (its own
  // place among them all). ``state`` is the open conversation.
  const store = load();
  let state = store.chats.find((c) => c.id === store.current) || store.chats[0];
  let controller = null;  // the AbortController of the answer being streamed
  const models = new Map();  // served name -> {display_name, description} (GET /v1/models)

  function conversation(system) {
    const id = Date.now().toString(36) + "-" + Math.random().toString(36).slice(2, 8);
    return { id, system: system || "", turns: [], updated: Date.now() };
  }
  function readable(chat) {
    return chat && typeof chat.id === "string" && Array.isArray(chat.turns)
      ? { id: chat.id, system: String(chat.system || ""), turns: chat.turns, updated: Number(chat.updated) || 0 }
      : null;
  }
  function parsed(item) {
    try { return JSON.parse(localStorage.getItem(item) || "null"); } catch (e) { return null; }  // unreadable: none
  }
  function load() {
    const saved = parsed(CHATS_ITEM);
    const chats = saved && Array.isArray(saved.chats) ? saved.chats.map(readable).filter(Boolean) : [];
    let current = saved ? String(saved.current) : "";
    const old = parsed(OLD_CHAT_ITEM);  // an earlier page's one conversation joins the list, open
    if (old && Array.isArray(old.turns) && old.turns.length) {
      const chat = { ...conversation(old.system), turns: old.turns };
      chats.unshift(chat);
      current = chat.id;
    }
    const kept = chats.filter((c) => c.turns.length || c.id === current);  // no empty ones but the open one
    if (!kept.length) kept.push(conversation(""));
    return { current, chats: kept };
  }
  function save() {
    store.current = state.id;
    try {
      localStorage.setItem(CHATS_ITEM, JSON.stringify(store));
      localStorage.removeItem(OLD_CHAT_ITEM);
    } catch (e) { /* full: keep going */ }
  }
  function touch(chat) {  // used now: first in the list
    chat.updated = Date.now();
    store.chats = [chat].concat(store.chats.filter((c) => c !== chat));
  }
  function title(chat) {
    const first = chat.turns.find((t) => t.role === "user");
    const text = first ? first.content.replace(/\s+/g, " ").trim() : "";
    return text ? (text.length > 48 ? text.slice(0, 47) + "…" : text) : "New chat";
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

  // What the served name is: "default (SmolLM2-135M-Instruct.Q4_1)" when the server says.
  function modelLabel(id) {
    const known = models.get(id);
    const name = known && known.display_name;
    return name && name !== id ? id + " (" + name + ")" : id;
  }
  function describeModel() {
    const known = models.get(ui.model.value);
    const parts = known ? [known.display_name, known.description].filter((x) => typeof x === "string" && x) : [];
    ui.modelAbout.textContent = parts.join(" · ");
    ui.modelAbout.title = parts.length ? "the model served under this name: " + parts.join(", ") : "";
  }

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
    models.clear();
    for (const model of body.data) {
      models.set(model.id, { display_name: model.display_name, description: model.description });
      const label = modelLabel(model.id) + (model.state === "ready" ? "" : " [" + model.state + "]");
      const option = element("option", "", label);
      option.value = model.id;
      if (typeof model.description === "string") option.title = model.description;
      ui.model.append(option);
    }
    if (Array.from(ui.model.options).some((o) => o.value === previous)) ui.model.value = previous;
    describeModel();
    clearError();
    for (const item of ui.log.querySelectorAll("article.message.assistant[data-index]")) {  // answers name their model
      const turn = state.turns[Number(item.dataset.index)];
      if (turn && turn.model) item.querySelector(".role").textContent = "assistant · " + modelLabel(turn.model);
    }
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

  // --- versions of an answer ----------------------------------------------------------------

  // Every version of an answer, in order (the turn shows one of them).
  function allVersions(turn) {
    const others = Array.isArray(turn.versions) ? turn.versions : [];
    const at = Number.isInteger(turn.version) ? Math.min(turn.version, others.length) : others.length;
    const self = { ...turn };
    delete self.versions;
    delete self.version;
    return others.slice(0, at).concat([self], others.slice(at));
  }
  // The turn that shows version ``k`` of ``list``, keeping the others.
  function showing(list, k) {
    return { ...list[k], versions: list.filter((_, i) => i !== k), version: k };
  }
  function switcher(index) {
    const list = allVersions(state.turns[index]);
    const at = state.turns[index].version ?? list.length - 1;
    const box = element("span", "versions");
    const go = (k) => {
      if (controller !== null || k < 0 || k >= list.length) return;
      state.turns[index] = showing(list, k);
      save();
      render();
    };
    const previous = button("‹", "version-previous", "previous version of this answer", () => go(at - 1));
    const next = button("›", "version-next", "next version of this answer", () => go(at + 1));
    previous.disabled = at === 0;
    next.disabled = at === list.length - 1;
    const count = element("span", "version-count", (at + 1) + "/" + list.length);
    count.title = "version " + (at + 1) + " of " + list.length + " (regenerate adds one; the one shown is what the conversation goes on from)";
    box.append(previous, count, next);
    return box;
  }

  // --- the list of conversations -----------------------------------------------------------

  function renderChats() {
    ui.chatList.replaceChildren();
    for (const chat of store.chats) {
      const item = element("li", "chat-item");
      item.dataset.id = chat.id;
      item.setAttribute("aria-current", chat === state ? "true" : "false");
      const name = title(chat);
      const open = button(name, "chat-open", "open this conversation: " + name, () => openChat(chat));
      const remove = button("×", "chat-delete", "delete this conversation", () => deleteChat(chat));
      remove.setAttribute("aria-label", "delete the conversation " + name);
      item.append(open, remove);
      ui.chatList.append(item);
    }
  }

  function openChat(chat) {
    if (controller !== null) controller.abort();  // its answer, so far, stays in its conversation
    if (state !== chat && !state.turns.length) store.chats = store.chats.filter((c) => c !== state);  // nothing to keep
    state = chat;
    touch(chat);
    save();
    ui.system.value = state.system;
    clearError();
    if (typeof PipelineInspector !== "undefined") PipelineInspector.close();
    render();
  }
  function newChat() {
    const empty = state.turns.length === 0 ? state : conversation(ui.system.value);
    if (empty !== state) store.chats.unshift(empty);
    openChat(empty);
  }
  function deleteChat(chat) {
    store.chats = store.chats.filter((c) => c !== chat);
    if (chat === state) {
      if (controller !== null) controller.abort();
      if (!store.chats.length) store.chats.push(conversation(""));
      openChat(store.chats[0]);
    } else {
      save();
      renderChats();
    }
  }

  function render() {
    renderChats();
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
      if (turn.model) view.role.textContent = "assistant · " + modelLabel(turn.model);
      if (turn.reasoning) { view.reasoning.textContent = turn.reasoning; view.reasoning.hidden = false; }
      renderContent(view.content, turn.content);
      describeStats(view, turn);
      if (turn.versions && turn.versions.length) view.actions.append(switcher(index));
      if (index === lastAssistant()) {
        view.actions.append(button("regenerate", "regenerate",
                                   "answer the last message again (this answer is kept as a version)", regenerate));
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

  // "thinking", shown in an answer from its request until its first token (the server reads
  // the whole conversation first: the prefill), or until it fails or is stopped.
  function typing() {
    const node = element("div", "typing", "thinking");
    node.setAttribute("role", "status");
    node.title = "the model is reading the conversation (prefill); the answer starts with its first token";
    for (let i = 0; i < 3; i++) node.append(element("span", "dot", "."));
    return node;
  }
  function doneTyping(view) {
    if (view.typing) { view.typing.remove(); view.typing = null; }
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
        if (run.first !== null) doneTyping(view);
        if (!pending) { pending = true; requestAnimationFrame(paint); }
      }
    } catch (e) {
      if (e.name === "AbortError") run.outcome = "stopped";
      else run.failure = e.message;
    }
    doneTyping(view);
    if (run.failure !== null) run.outcome = "failed";
  }

  function messages(chat) {
    const out = chat.system ? [{ role: "system", content: chat.system }] : [];
    return out.concat(chat.turns.map((t) => ({ role: t.role, content: t.content })));
  }

  // Put ``chat`` back as ``before`` was (a copy of its system prompt and turns).
  function restore(chat, before) {
    chat.system = before.system;
    chat.turns = before.turns;
  }

  // Answer ``chat`` as it stands (it ends with a user turn). ``before`` is the conversation
  // to put back when no answer came (``text``: what goes back into the input box);
  // ``previous``, the answer this one regenerates (a new version of it).
  async function answer(chat, before, text, previous) {
    clearError();
    const model = ui.model.value;
    const fields = samplingFields();
    if (!model || fields === null) {
      if (!model) showError("no model to talk to: the model list is empty (is the API key right?)");
      restore(chat, before);
      render();
      return;
    }
    render();
    const body = {  // max_tokens only when set: the server's default applies otherwise
      model, messages: messages(chat), stream: true, stream_options: { include_usage: true },
      logprobs: true, top_logprobs: 5, ...fields,
    };
    controller = new AbortController();
    setBusy(true);
    const view = messageView("assistant");
    view.role.textContent = "assistant · " + modelLabel(model);
    view.typing = typing();
    view.content.before(view.typing);
    view.item.scrollIntoView({ block: "end" });
    const run = {
      start: performance.now(), first: null, end: null, chunks: 0, usage: null, content: "",
      reasoning: "", outcome: "finished", failure: null, requestId: null, tokens: [],
    };
    let response = null;
    try {
      response = await api("/v1/chat/completions", {
        method: "POST", body: JSON.stringify(body), signal: controller.signal,
        // the inspector's raw and processed top-k; with layer taps, each layer's hidden state too
        headers: { "x-pipeline-recording": ui.taps.checked ? "taps" : "full" },
      });
    } catch (e) {
      run.failure = e.name === "AbortError" ? "stopped before the server answered"
                                            : "cannot reach the server: " + e.message;
    }
    if (response !== null && !response.ok) run.failure = await errorText(response);
    if (run.failure !== null) {  // nothing was generated: the conversation is as it was
      doneTyping(view);
      controller = null;
      setBusy(false);
      restore(chat, before);
      if (chat !== state) { save(); return; }
      render();
      if (text && !ui.input.value) ui.input.value = text;
      showError(run.failure);
      return;
    }
    run.requestId = response.headers.get("x-request-id");
    await streamAnswer(response, run, view);
    run.end = performance.now();
    controller = null;
    setBusy(false);
    if (run.content || run.reasoning) {  // kept in its conversation, open or not
      const made = {
        role: "assistant", content: run.content, reasoning: run.reasoning, requestId: run.requestId,
        model, stats: stats(run), tokens: run.tokens,
      };
      chat.turns.push(previous ? showing(allVersions(previous).concat([made]), allVersions(previous).length)
                               : { ...made, versions: [] });
      save();
      if (chat === state) render();
    } else {  // an empty answer (stopped, failed) does not enter the conversation
      view.item.remove();
      restore(chat, before);
      save();
      if (chat !== state) return;
      render();
      if (text && !ui.input.value) ui.input.value = text;
    }
    if (run.failure !== null && chat === state) showError("the answer failed: " + run.failure);
  }

  function snapshot(chat) { return JSON.parse(JSON.stringify({ system: chat.system, turns: chat.turns })); }

  function send(text) {
    const chat = state;
    const before = snapshot(chat);
    chat.turns.push({ role: "user", content: text });
    touch(chat);
    save();
    answer(chat, before, text, null);
  }

  function regenerate() {
    if (controller !== null) return;
    const index = lastAssistant();
    if (index < 0) return;
    const chat = state;
    const before = snapshot(chat);
    const previous = chat.turns[index];
    chat.turns = chat.turns.slice(0, index);
    answer(chat, before, "", previous);
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
      const chat = state;
      const before = snapshot(chat);
      chat.turns = chat.turns.slice(0, index).concat([{ role: "user", content: area.value }]);
      touch(chat);
      save();
      answer(chat, before, "", null);
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
      const versions = allVersions(t);
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
  ui.clear.addEventListener("click", newChat);
  ui.system.addEventListener("input", () => { state.system = ui.system.value; save(); });
  ui.model.addEventListener("change", describeModel);
  ui.system.addEventListener("change", () => { if (controller === null) render(); });
  ui.settings.addEventListener("submit", (event) => event.preventDefault());
  ui.key.addEventListener("change", applyKey);  // on leaving the field
  ui.key.addEventListener("keydown", (event) => {
    if (event.key === "Enter") { event.preventDefault(); applyKey(); }
  });

  ui.key.value = sessionStorage.getItem(KEY_ITEM) || "";
  ui.system.value = state.system;
  save();
  render();
  document.body.dataset.ready = "true";
  loadModels();
})();
