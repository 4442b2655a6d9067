// The inspector of the chat page (see the comment at the top of index.html): for one answer,
// its tokens coloured by probability (hover or focus one: the alternatives, raw logit against
// processed score and probability, and the processors applied at that step), the request's
// timeline (queue, prefill, each step's select and decode, where it stopped), and a comparison
// with another answer (the server's trace diff; the first divergent token is marked in both).
// Data: GET /traces/{id}/inspect (the trace, recorded at "full" by the chat) and
// GET /traces/{a}/diff/{b}; without a kept trace, the answer's own logprobs.
// Everything from the model or the server is inserted as text.
"use strict";
globalThis.PipelineInspector = (() => {
  const panel = document.getElementById("inspector");
  const tip = document.getElementById("tip");
  let opened = 0;  // which opening: a late answer for an earlier one is dropped

  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }
  const pct = (p) => (p === null || p === undefined ? "—" : (100 * p).toFixed(p >= 0.1 ? 1 : 2) + "%");
  const num = (x) => (x === null || x === undefined ? "—" : Number(x).toFixed(3));
  const ms = (x) => (x === null || x === undefined ? "—" : Number(x).toFixed(1) + " ms");
  const bucket = (p) => (p >= 0.9 ? "p4" : p >= 0.6 ? "p3" : p >= 0.3 ? "p2" : p >= 0.1 ? "p1" : "p0");
  const shown = (text, id) => (text === null || text === undefined ? "#" + id : text);

  async function getJson(ctx, path) {
    let response;
    try {
      response = await ctx.api(path);
    } catch (e) {
      return { error: "cannot reach the server: " + e.message };
    }
    if (!response.ok) return { error: await ctx.errorText(response) };
    return { body: await response.json() };
  }

  // The tokens to show: the trace's steps (with alternatives) when kept, else the answer's
  // own logprobs (text, logprob, top alternatives), also when the trace holds no top-k.
  function tokensOf(answer, inspected) {
    const own = answer.tokens || [];
    const full = inspected && inspected.steps.length && (inspected.recording === "full" || !own.length);
    if (full) {
      return inspected.steps.map((s) => ({
        text: shown(s.text, s.token_id), id: s.token_id, prob: s.logprob === null || s.logprob === undefined ? null : Math.exp(s.logprob),
        step: s.step, processed: s.processed, raw: s.raw, processors: s.processors, candidates: s.candidates,
      }));
    }
    return own.map(([text, logprob, top], i) => ({
      text, prob: Math.exp(logprob), step: i + 1,
      processed: top.map(([t, lp]) => ({ text: t, prob: Math.exp(lp) })), raw: [], processors: null,
    }));
  }

  function strip(tokens, label) {
    const box = element("div", "tokens");
    box.setAttribute("aria-label", label);
    tokens.forEach((token, i) => {
      const span = element("span", "tok", token.text);
      if (token.prob !== null) span.classList.add(bucket(token.prob));
      if (/^<\|.*\|>$/.test(token.text)) span.classList.add("special");
      span.tabIndex = 0;
      span.setAttribute("aria-describedby", "tip");
      span.dataset.index = String(i);
      span.dataset.step = String(token.step);
      if (token.prob !== null) span.dataset.prob = token.prob.toFixed(4);
      const show = () => showTip(span, token);
      span.addEventListener("mouseenter", show);
      span.addEventListener("focus", show);
      span.addEventListener("mouseleave", hideTip);
      span.addEventListener("blur", hideTip);
      box.append(span);
    });
    return box;
  }

  function legend() {
    const box = element("div", "legend");
    box.append(element("span", "", "probability:"));
    for (const [cls, text] of [["p0", "< 10%"], ["p1", "10–30%"], ["p2", "30–60%"], ["p3", "60–90%"], ["p4", "≥ 90%"]]) {
      box.append(element("span", cls, text));
    }
    return box;
  }

  // The tooltip: the step's candidates, processed (score, probability) beside raw (logit).
  function showTip(span, token) {
    const raw = new Map((token.raw || []).map((r) => [r.token_id, r]));
    const rows = (token.processed || []).map((p) => ({ ...p, raw: raw.get(p.token_id) }));
    const seen = new Set(rows.map((r) => r.token_id));
    for (const r of token.raw || []) if (!seen.has(r.token_id)) rows.push({ token_id: r.token_id, text: r.text, raw: r, removed: true });
    const head = element("div", "", "step " + token.step + ": " + JSON.stringify(token.text) + " · p " + pct(token.prob));
    const table = element("table");
    const header = element("tr");
    for (const h of ["token", "prob", "processed", "raw logit"]) header.append(element("th", "", h));
    table.append(header);
    for (const row of rows) {
      const tr = element("tr", row.token_id !== undefined && row.token_id === token.id ? "chosen" : "");
      tr.append(element("td", "", JSON.stringify(shown(row.text, row.token_id))),
                element("td", "", row.removed ? "removed" : pct(row.prob)),
                element("td", "", row.score === undefined ? "—" : num(row.score)),
                element("td", "", row.raw ? num(row.raw.logit) : "—"));
      table.append(tr);
    }
    tip.replaceChildren(head, table);
    if (token.processors) {
      tip.append(element("div", "processors", "processors: " + (token.processors.length ? token.processors.join(" → ") : "none")
                         + (token.candidates ? " · " + token.candidates + " candidates left" : "")));
    } else if (!(token.raw || []).length) {
      tip.append(element("div", "processors", "the trace is not kept: alternatives from the answer's logprobs"));
    }
    tip.hidden = false;
    const box = span.getBoundingClientRect();
    const width = tip.offsetWidth, height = tip.offsetHeight;
    tip.style.left = Math.max(4, Math.min(window.innerWidth - width - 4, box.left)) + "px";
    tip.style.top = (box.bottom + height + 8 < window.innerHeight ? box.bottom + 4 : Math.max(4, box.top - height - 4)) + "px";
  }
  function hideTip() { tip.hidden = true; }

  // The timeline: one lane per track, bars placed by CSSOM (no style attributes).
  function timeline(data) {
    const box = element("div", "timeline");
    const phases = data.phases || [];
    const total = Math.max(...phases.map((p) => p.start_ms + p.duration_ms), 0.001);
    const lanes = new Map();
    for (const name of ["request", "phase", "select", "decode"]) {
      const track = element("div", "track");
      const lane = element("div", "lane");
      track.append(element("span", "track-name", name === "phase" ? "phases" : name), lane);
      lanes.set(name, lane);
      box.append(track);
    }
    for (const p of phases) {
      const lane = lanes.get(p.track);
      if (!lane) continue;
      const kind = p.track === "phase" ? p.name : p.track;
      const bar = element("div", "bar " + kind);
      bar.dataset.phase = p.name;
      bar.title = p.name + ": " + ms(p.duration_ms) + " (from " + ms(p.start_ms) + ")";
      bar.style.left = (100 * p.start_ms / total) + "%";
      bar.style.width = (100 * p.duration_ms / total) + "%";
      lane.append(bar);
    }
    for (const stop of data.stops || []) {
      const mark = element("div", "stop");
      mark.title = "stopped: " + stop.reason + (stop.detail !== null && stop.detail !== undefined ? " (" + stop.detail + ")" : "");
      mark.style.left = "calc(" + (100 * stop.at_ms / total) + "% - 1px)";
      lanes.get("request").append(mark);
    }
    const s = data.summary || {};
    const rate = s.decode_tokens_per_s ? s.decode_tokens_per_s.toFixed(1) + " tokens/s decode" : "—";
    const line = element("div", "summary", "prepare " + ms(s.prepare_ms) + " · queue " + ms(s.queue_ms) + " · prefill " + ms(s.prefill_ms)
      + " · first token " + ms(s.first_token_ms) + " · " + rate + " · total " + ms(s.total_ms) + " · " + (s.completion_tokens ?? 0)
      + " tokens · finish: " + (s.finish ?? "—"));
    const wrap = element("div");
    wrap.append(box, line);
    return wrap;
  }

  function label(answer) { return answer.requestId || "(no request id)"; }

  async function compare(ctx, state, choice, out) {
    const other = ctx.others[Number(choice.value)];
    if (!other) return;
    out.replaceChildren(element("p", "note", "comparing…"));
    const diff = await getJson(ctx, "/traces/" + encodeURIComponent(ctx.answer.requestId) + "/diff/" + encodeURIComponent(other.requestId));
    const theirs = await getJson(ctx, "/traces/" + encodeURIComponent(other.requestId) + "/inspect");
    if (diff.error) { out.replaceChildren(element("p", "note", "compare: " + diff.error)); return; }
    const d = diff.body.divergence;
    const summary = d === null ? "no divergence: the two runs agree on every product"
      : "first divergence: " + d.product + (d.step !== null ? " at step " + d.step : "") + " (" + d.level + " level)";
    const head = element("p", "divergence", summary);
    head.dataset.level = d === null ? "" : d.level;
    const tokensB = tokensOf(other, theirs.body || null);
    const stripB = strip(tokensB, "tokens of the other answer");
    stripB.classList.add("other");
    const step = diff.body.first_token_step;
    for (const s of [state.strip, stripB]) for (const node of s.querySelectorAll(".tok.diverge")) node.classList.remove("diverge");
    if (step !== null) {
      for (const s of [state.strip, stripB]) {
        const node = s.querySelector('.tok[data-step="' + step + '"]');
        if (node) { node.classList.add("diverge"); node.title = "first token that differs (step " + step + ")"; }
      }
    }
    const first = step === null ? "the tokens are the same throughout" : "first different token: step " + step;
    out.replaceChildren(head, element("p", "note", first), element("h2", "", "other answer · " + label(other)), stripB,
                        element("pre", "report", diff.body.text));
    const marked = state.strip.querySelector(".tok.diverge");
    if (marked) marked.scrollIntoView({ block: "nearest" });
  }

  // Open the inspector on ``ctx.answer`` ({requestId, content, tokens}); ``ctx.others``: the
  // answers it may be compared with; ``ctx.api(path)``: fetch with the key; ``ctx.errorText``.
  async function open(ctx) {
    const mine = ++opened;
    hideTip();
    panel.hidden = false;
    const close = element("button", "close", "close");
    close.type = "button";
    close.addEventListener("click", closePanel);
    const bar = element("div", "inspector-bar");
    bar.append(element("strong", "", "Inspector"), element("code", "", label(ctx.answer)), close);
    panel.replaceChildren(bar, element("p", "note", "loading the trace…"));
    const inspected = ctx.answer.requestId ? await getJson(ctx, "/traces/" + encodeURIComponent(ctx.answer.requestId) + "/inspect")
                                           : { error: "no request id" };
    if (mine !== opened) return;
    const data = inspected.body || null;
    const tokens = tokensOf(ctx.answer, data);
    const state = { strip: strip(tokens, "tokens of this answer") };
    const parts = [bar, element("h2", "", "Tokens"), legend(), state.strip];
    if (inspected.error) parts.push(element("p", "note", "trace: " + inspected.error));
    else if (data.recording !== "full") parts.push(element("p", "note", "this trace was recorded at \"" + data.recording + "\": no alternatives per step"));
    if (data) {
      const order = (data.processors || []).join(" → ") || "none";
      parts.push(element("p", "note", "processors applied (in order): " + order + " · declared chain: " + (data.processor_chain || []).join(", ")));
      const timelineBox = timeline(data.timeline);
      timelineBox.classList.add("timeline-box");
      parts.push(element("h2", "", "Timeline"), timelineBox);
    }
    parts.push(element("h2", "", "Compare"));
    const out = element("div", "comparison");
    if (ctx.others.length) {
      const choice = element("select", "compare-with");
      choice.setAttribute("aria-label", "answer to compare with");
      ctx.others.forEach((o, i) => {
        const option = element("option", "", o.label + " · " + label(o));
        option.value = String(i);
        choice.append(option);
      });
      const go = element("button", "compare", "compare");
      go.type = "button";
      go.addEventListener("click", () => compare(ctx, state, choice, out));
      const row = element("div", "actions");
      row.append(choice, go);
      parts.push(row);
    } else {
      parts.push(element("p", "note", "no other answer to compare with: regenerate this one, or ask again"));
    }
    parts.push(out);
    panel.replaceChildren(...parts);
  }

  function closePanel() {
    opened += 1;
    hideTip();
    panel.hidden = true;
    panel.replaceChildren();
  }

  document.addEventListener("keydown", (event) => { if (event.key === "Escape") hideTip(); });
  return { open, close: closePanel };
})();
