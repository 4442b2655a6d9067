// The inspector of the chat page (see the comment at the top of index.html): for one answer,
// its tokens coloured by the model's own probability of each (the raw one, before temperature,
// top-p and the other sampling settings; hover or focus a token: that probability beside the
// one after the settings, the alternatives, and the processors applied at that step), the
// request's timeline (queue, prefill, each step's select and decode, where it stopped), and a
// comparison with another answer (the server's trace diff: how long the answers agree, the
// first token that differs, marked in both, the earliest internal difference, and with layer
// taps the first step and layer whose hidden states differ).
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

  const known = (x) => x !== null && x !== undefined;
  const RAW = "the model's own probability of this token: the softmax of its raw logits, before "
    + "temperature, top-p and the other sampling settings";
  const AFTER = "the probability the token was drawn with: after the sampling settings "
    + "(temperature, top-p, penalties...), renormalized over the candidates they leave";
  const LOGIT = "the model's raw score for the token (probability = exp(logit) / the sum over every token)";

  // The tokens to show: the trace's steps (with alternatives) when kept, else the answer's
  // own logprobs (text, logprob, top alternatives: after the sampling settings), also when
  // the trace holds no top-k. ``prob`` colours a token: the raw probability when known.
  function tokensOf(answer, inspected) {
    const own = answer.tokens || [];
    const full = inspected && inspected.steps.length && (inspected.content || !own.length);
    if (full) {
      return inspected.steps.map((s) => {
        const after = typeof s.processed_prob === "number" ? s.processed_prob : known(s.logprob) ? Math.exp(s.logprob) : null;
        const raw = known(s.raw_prob) ? s.raw_prob : null;
        const atMost = known(s.raw_prob_at_most) ? s.raw_prob_at_most : null;
        return {
          text: shown(s.text, s.token_id), id: s.token_id, step: s.step, rawProb: raw, rawAtMost: atMost,
          processedProb: after, processedAtMost: typeof s.processed_prob_at_most === "number" ? s.processed_prob_at_most : null,
          prob: raw ?? atMost ?? after, basis: raw !== null || atMost !== null ? "raw" : "processed",
          processedTop: s.processed, rawTop: s.raw, processors: s.processors, candidates: s.candidates,
        };
      });
    }
    return own.map(([text, logprob, top], i) => ({
      text, step: i + 1, rawProb: null, rawAtMost: null, processedProb: Math.exp(logprob), processedAtMost: null, prob: Math.exp(logprob),
      basis: "processed", processedTop: top.map(([t, lp]) => ({ text: t, prob: Math.exp(lp) })), rawTop: [],
      processors: null,
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
      span.dataset.basis = token.basis;
      if (token.prob !== null) span.dataset.prob = token.prob.toFixed(4);
      if (token.rawProb !== null) span.dataset.rawProb = token.rawProb.toFixed(4);
      if (token.rawAtMost !== null) span.dataset.rawProbAtMost = token.rawAtMost.toFixed(4);
      if (token.processedProb !== null) span.dataset.processedProb = token.processedProb.toFixed(4);
      const show = () => showTip(span, token);
      span.addEventListener("mouseenter", show);
      span.addEventListener("focus", show);
      span.addEventListener("mouseleave", hideTip);
      span.addEventListener("blur", hideTip);
      box.append(span);
    });
    return box;
  }

  function legend(tokens) {
    const box = element("div", "legend");
    const raw = tokens.some((t) => t.basis === "raw");
    const what = element("span", "basis", raw ? "colour: the model's own probability (before the sampling settings)"
                                               : "colour: the probability after the sampling settings (the model's own was not recorded)");
    what.title = raw ? RAW + ". Hover or focus a token for the probability after the settings, and the alternatives."
                     : AFTER + ". The trace that holds the model's own probabilities is no longer kept.";
    box.append(what);
    for (const [cls, text] of [["p0", "< 10%"], ["p1", "10–30%"], ["p2", "30–60%"], ["p3", "60–90%"], ["p4", "≥ 90%"]]) {
      const item = element("span", cls, text);
      item.title = (raw ? "the model gave the token " : "the token had ") + text;
      box.append(item);
    }
    return box;
  }
  const PROCESSOR_WORDS = { top_p: "top-p", top_k: "top-k", min_p: "min-p", typical_p: "typical-p",
    repetition_penalty: "repetition penalty", presence_penalty: "presence penalty",
    frequency_penalty: "frequency penalty", logit_bias: "logit bias", min_tokens: "min tokens",
    allowed_tokens: "allowed tokens", banned_tokens: "banned tokens", grammar: "grammar (structured output)" };
  const words = (names) => (names || []).map((n) => PROCESSOR_WORDS[n] || n.replace(/_/g, " "));
  const settingsName = (processors) => (processors && processors.length ? words(processors).join(", then ") : "the sampling settings");
  function rawText(token) {
    if (known(token.rawProb)) return pct(token.rawProb);
    if (known(token.rawAtMost)) return "below " + pct(token.rawAtMost);
    return "not recorded";
  }
  function afterText(token) {
    if (known(token.processedProb)) return pct(token.processedProb);
    if (known(token.processedAtMost)) return "below " + pct(token.processedAtMost);
    return "not recorded";
  }

  // The tooltip: the token's own probability beside the one after the settings, then the
  // step's candidates (the model's probability, after the settings, the raw logit).
  function showTip(span, token) {
    const after = new Map((token.processedTop || []).map((p) => [p.token_id, p]));
    const rows = (token.rawTop || []).map((r) => ({ token_id: r.token_id, text: r.text, raw: r, after: after.get(r.token_id) }));
    const seen = new Set(rows.map((r) => r.token_id));
    for (const p of token.processedTop || []) if (!seen.has(p.token_id)) { seen.add(p.token_id); rows.push({ token_id: p.token_id, text: p.text, after: p }); }
    if (known(token.id) && !seen.has(token.id) && rows.length) rows.push({ token_id: token.id, text: token.text, own: true });  // outside both top-k
    // every candidate the settings left is listed: one missing from them was removed
    const complete = known(token.candidates) && (token.processedTop || []).length >= token.candidates;
    const head = element("div", "", "step " + token.step + ": " + JSON.stringify(token.text));
    const probs = element("div", "probs", "the model's probability: " + rawText(token) + " · after "
                          + settingsName(token.processors) + ": " + afterText(token));
    probs.title = "the model's probability: " + RAW + ". After the settings: " + AFTER + ".";
    const table = element("table");
    const header = element("tr");
    for (const [h, why] of [["token", "the candidates at this step, most likely first"], ["model", RAW],
                            ["after settings", AFTER], ["logit", LOGIT]]) {
      const th = element("th", "", h);
      th.title = why;
      header.append(th);
    }
    table.append(header);
    for (const row of rows) {
      const tr = element("tr", row.token_id !== undefined && row.token_id === token.id ? "chosen" : "");
      const removed = !row.after && !row.own && complete;
      const afterCell = element("td", "", row.own ? afterText(token) : row.after ? pct(row.after.prob) : removed ? "removed" : "—");
      if (removed) afterCell.title = "the sampling settings removed this token: it could not be drawn";
      else if (!row.after) afterCell.title = "not among the top " + (token.processedTop || []).length + " after the settings";
      tr.append(element("td", "", JSON.stringify(shown(row.text, row.token_id))),
                element("td", "", row.own ? rawText(token) : row.raw && known(row.raw.prob) ? pct(row.raw.prob) : "—"),
                afterCell, element("td", "", row.raw ? num(row.raw.logit) : "—"));
      table.append(tr);
    }
    tip.replaceChildren(head, probs, table);
    if (token.processors) {
      tip.append(element("div", "processors", "processors applied in order: " + (token.processors.length ? words(token.processors).join(" → ") : "none")
                         + (token.candidates ? " · " + token.candidates + " candidates left to draw from" : "")));
    } else if (!(token.rawTop || []).length) {
      tip.append(element("div", "processors", "the trace is no longer kept: alternatives from the answer's logprobs, after the sampling settings"));
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

  const PRODUCT_WORDS = { rng: "the random draw", request: "the request", "rendered bytes": "the prompt as rendered",
    "token ids": "the prompt's tokens", positions: "the prompt's positions", "prefill logits": "the model's logits",
    "raw logits": "the model's logits", "processor order": "the order of the sampling settings",
    "processed distribution": "the probabilities after the sampling settings", "selected token": "the chosen token",
    "emitted bytes": "the text sent", finish: "how the run ended" };

  // One side of the first different token: from the diff's ``first_token`` (a, b) when the
  // server sends it, else from that step of the answer's inspected tokens.
  function side(name, given, tokens, step) {
    let t = null;
    if (given) {
      t = { text: shown(given.text, given.token_id), rawProb: given.raw_prob ?? null,
            rawAtMost: given.raw_prob_at_most ?? null, processedProb: given.processed_prob ?? null,
            processedAtMost: given.processed_prob_at_most ?? null };
    } else {
      const found = tokens.find((x) => x.step === step);
      if (found) t = found;
    }
    if (!t) return name + " had ended";
    return name + " chose " + JSON.stringify(t.text) + " (the model's probability " + rawText(t)
      + ", after the sampling settings " + afterText(t) + ")";
  }

  // The two lines of a comparison: where the answers' tokens part, and the earliest internal
  // difference of any kind (a random draw may differ from step 1 and change no token for long).
  function comparisonLines(body, mine, theirs) {
    const given = body.first_token;
    const step = given ? given.step : body.first_token_step ?? null;
    let first;
    if (step === null) first = "The answers have the same tokens throughout.";
    else {
      const agree = given && known(given.agree_tokens) ? given.agree_tokens : step - 1;
      first = (agree === 0 ? "The answers differ from their first token (step " + step + "): "
                           : "The answers agree for " + agree + " token" + (agree === 1 ? "" : "s")
                             + "; first different token at step " + step + ": ")
        + side("A (this answer)", given && given.a, mine, step) + ", " + side("B (the other)", given && given.b, theirs, step) + ".";
    }
    const d = body.divergence;
    let internal;
    if (d === null || d === undefined) internal = "No internal difference: the two runs agree on every product the traces hold.";
    else {
      internal = "Earliest internal difference: " + (PRODUCT_WORDS[d.product] || d.product) + (known(d.step) ? " at step " + d.step : "")
        + " (" + d.product + ", " + d.level + " level)";
      if (step !== null && known(d.step) && d.step < step) internal += "; it changed no token until step " + step;
      else if (step === null) internal += "; it changed no token";
      internal += ".";
    }
    return { step, first, internal, level: d ? d.level : "" };
  }

  // Where inside the model two answers part (traces recorded with layer taps): the first
  // step whose layers differ and every layer there, the first different one marked.
  function layerTable(layers) {
    if (!layers) {
      return element("p", "note", "Tick \u201cLayer taps\u201d before asking, for both answers, to see in which layer they first part.");
    }
    const table = element("table", "layers");
    const caption = "Inside the model: the layers first differ at step " + layers.step + ", from " + layers.first
      + (layers.first_beyond ? "; first beyond what rounding explains: " + layers.first_beyond : "");
    table.append(element("caption", "", caption));
    for (const tap of layers.taps) {
      let words;
      if (tap.same) words = "same bits";
      else if (tap.max_diff !== null && tap.explained !== null) {
        words = "differs by " + tap.max_diff.toExponential(2) + " (rounding explains " + tap.explained.toExponential(2)
          + "): " + (tap.within ? "within noise" : "not explained");
      } else {
        words = "differs: max |x| " + tap.a.max_abs.toPrecision(4) + " vs " + tap.b.max_abs.toPrecision(4)
          + ", rms " + tap.a.rms.toPrecision(4) + " vs " + tap.b.rms.toPrecision(4);
      }
      const row = element("tr", tap.name === layers.first ? "first" : tap.name === layers.first_beyond ? "beyond" : "");
      row.append(element("td", "", tap.name), element("td", "", words));
      table.append(row);
    }
    return table;
  }

  async function compare(ctx, state, choice, out) {
    const other = ctx.others[Number(choice.value)];
    if (!other) return;
    out.replaceChildren(element("p", "note", "comparing…"));
    const diff = await getJson(ctx, "/traces/" + encodeURIComponent(ctx.answer.requestId) + "/diff/" + encodeURIComponent(other.requestId));
    const theirs = await getJson(ctx, "/traces/" + encodeURIComponent(other.requestId) + "/inspect");
    if (diff.error) { out.replaceChildren(element("p", "note", "compare: " + diff.error)); return; }
    const tokensB = tokensOf(other, theirs.body || null);
    const lines = comparisonLines(diff.body, state.tokens, tokensB);
    const first = element("p", "first-token", lines.first);
    first.title = "the first step where the two answers committed different tokens (A: this answer, B: " + label(other) + ")";
    const head = element("p", "divergence", lines.internal);
    head.dataset.level = lines.level;
    head.title = "the first thing that differs inside the two runs, in the order the pipeline makes them "
      + "(prompt, model, sampling, text): a cause, which may change a token only later, or never";
    const stripB = strip(tokensB, "tokens of the other answer");
    stripB.classList.add("other");
    const step = lines.step;
    for (const s of [state.strip, stripB]) for (const node of s.querySelectorAll(".tok.diverge")) node.classList.remove("diverge");
    if (step !== null) {
      for (const s of [state.strip, stripB]) {
        const node = s.querySelector('.tok[data-step="' + step + '"]');
        if (node) { node.classList.add("diverge"); node.title = "first token that differs (step " + step + ")"; }
      }
    }
    out.replaceChildren(first, head, layerTable(diff.body.layers),
                        element("h2", "", "other answer · " + label(other)), stripB,
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
    const state = { tokens, strip: strip(tokens, "tokens of this answer") };
    const parts = [bar, element("h2", "", "Tokens"), legend(tokens), state.strip];
    if (inspected.error) parts.push(element("p", "note", "trace: " + inspected.error));
    else if (!data.content) parts.push(element("p", "note", "this trace was recorded at \"" + data.recording + "\": no alternatives per step"));
    if (data) {
      const order = words(data.processors).join(" → ") || "none (the model's own probabilities were used as they are)";
      const applied = element("p", "note processors-applied", "sampling settings applied, in order: " + order);
      applied.title = "the processors that changed this request's probabilities, in the order they ran";
      const chain = element("p", "note processor-chain", "every setting this server can apply, in the order it would: "
                            + words(data.processor_chain).join(", "));
      chain.title = "a setting left at its neutral value (temperature 1, top-p 1, no penalty...) is skipped";
      parts.push(applied, chain);
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
