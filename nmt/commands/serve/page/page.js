// The page of `nmt serve`: sentences in, and for each sentence and model the translation, its
// n-best list and its attention heatmap; with a reference, the reference's forced attention and
// its word alignment. It talks only to the JSON API of the same server (nmt/commands/serve).
"use strict";

// Hovering a piece highlights the fewest pieces, strongest first, that carry this share of its
// attention: one piece where the attention is sharp, many where it is spread.
const HIGHLIGHT_MASS = 0.5;
// The heatmap's colour ramp, from weight 0 to weight 1 (RGB).
const RAMP_LOW = [247, 249, 252];
const RAMP_HIGH = [23, 63, 160];

const byId = (id) => document.getElementById(id);
let models = []; // ModelInfo objects of GET /api/models, the default first

class ApiError extends Error {}

// --- the API ----------------------------------------------------------------------------------

async function api(path, body) {
  const init =
    body === undefined
      ? {}
      : { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
  let response;
  try {
    response = await fetch(path, init);
  } catch (error) {
    throw new ApiError(`cannot reach the server (${error.message})`);
  }
  let data = null;
  try {
    data = await response.json();
  } catch {
    // not JSON: the status line says what went wrong
  }
  if (!response.ok) {
    const message = data && typeof data.error === "string" ? data.error : "";
    throw new ApiError(message || `${path}: HTTP ${response.status} ${response.statusText}`);
  }
  return data;
}

// One model's answers for all sentences: its translations (with attention) and, for the
// sentences that have a reference, the reference's forced score and attention and its links.
async function askModel(model, sentences, references, beam, nBest) {
  const translating = api("api/translate", {
    model,
    sentences,
    beam_size: beam,
    n_best: nBest,
    length_penalty: null,
    coverage_penalty: null,
    max_len_ratio: null,
    no_repeat_ngram: null,
    prefixes: null,
    constraints: null,
    attention: true,
    alignments: false,
  });
  const rows = references.length
    ? sentences.map((_, i) => i).filter((i) => sentences[i].trim() && references[i].trim())
    : [];
  const sources = rows.map((i) => sentences[i]);
  const targets = rows.map((i) => references[i]);
  const scoring = rows.length
    ? api("api/score", {
        model, sources, targets, length_penalty: null, coverage_penalty: null, tokens: false,
        attention: true,
      })
    : null;
  const aligning = rows.length
    ? api("api/align", {
        model, sources, targets, extract: "argmax", use_attention: false,
      })
    : null;
  const [translated, scored, aligned] = await Promise.all([translating, scoring, aligning]);
  const perSentence = sentences.map(() => null);
  rows.forEach((i, k) => {
    perSentence[i] = { text: references[i], score: scored.scores[k], alignment: aligned.alignments[k] };
  });
  return {
    model: translated.model,
    translations: translated.translations,
    references: perSentence,
    batchedWith: translated.batched_with,
    elapsedMs: translated.elapsed_ms,
  };
}

// --- small DOM helpers ------------------------------------------------------------------------

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function lines(text) {
  const out = text.replace(/\r\n?/g, "\n").split("\n");
  while (out.length && !out[out.length - 1].trim()) out.pop();
  return out;
}

function plural(count, noun) {
  return `${count} ${noun}${count === 1 ? "" : "s"}`;
}

function number(value, digits = 3) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}

function showError(message) {
  const box = byId("error");
  box.textContent = message;
  box.hidden = false;
}

function clearError() {
  const box = byId("error");
  box.textContent = "";
  box.hidden = true;
}

// --- the models -------------------------------------------------------------------------------

async function loadModels() {
  try {
    models = (await api("api/models")).models;
  } catch (error) {
    showError(error.message);
    return;
  }
  const a = byId("model-a");
  const b = byId("model-b");
  for (const info of models) {
    a.append(new Option(info.name, info.name));
    b.append(new Option(info.name, info.name));
  }
  const decoding = (models[0] && models[0].config && models[0].config.decoding) || {};
  if (decoding.beam_size) {
    byId("beam").placeholder = String(decoding.beam_size);
    byId("beam").value = String(decoding.beam_size);
    byId("nbest").value = String(Math.min(3, decoding.beam_size));
  }
  showModelInfo();
}

function modelLine(info) {
  const line = el("div", "model-card");
  line.append(el("strong", "", info.name), el("span", "summary", info.summary));
  const t = info.training || {};
  const facts = [
    `${info.precision} on ${info.device}`,
    t.step !== null && t.step !== undefined ? `step ${t.step}` : null,
    t.dev_bleu !== null && t.dev_bleu !== undefined ? `dev BLEU ${number(t.dev_bleu, 1)}` : null,
    t.dev_loss !== null && t.dev_loss !== undefined ? `dev loss ${number(t.dev_loss, 2)}` : null,
    info.alignment_head ? "alignment head" : null,
  ].filter(Boolean);
  const shown = el("span", "facts", facts.join(" · "));
  shown.title = info.decoding_plan.line;
  line.append(shown);
  line.title = info.path;
  return line;
}

function selectedModels() {
  const names = [byId("model-a").value, byId("model-b").value].filter(Boolean);
  return [...new Set(names)];
}

function showModelInfo() {
  const box = byId("model-info");
  box.replaceChildren();
  for (const name of selectedModels()) {
    const info = models.find((m) => m.name === name);
    if (info) box.append(modelLine(info));
  }
}

// --- the heatmap ------------------------------------------------------------------------------

function shade(weight) {
  const w = Math.min(Math.max(weight, 0), 1);
  const rgb = RAMP_LOW.map((low, k) => Math.round(low + (RAMP_HIGH[k] - low) * w));
  return `rgb(${rgb.join(",")})`;
}

// The fewest indices, largest values first (ties: the first), whose values sum to at least
// HIGHLIGHT_MASS of all (none if all are 0).
function strongest(values) {
  let total = 0;
  for (const v of values) total += v;
  if (!(total > 0)) return [];
  const order = values.map((_, k) => k).sort((a, b) => values[b] - values[a] || a - b);
  const out = [];
  let mass = 0;
  for (const k of order) {
    out.push(k);
    mass += values[k];
    if (mass >= HIGHLIGHT_MASS * total) break;
  }
  return out;
}

// Runs of equal word indices: [[word, first piece, count], ...] (null words stand alone).
function wordRuns(pieceWord, length) {
  const runs = [];
  for (let k = 0; k < length; k++) {
    const word = pieceWord[k] ?? null;
    const last = runs[runs.length - 1];
    if (last && word !== null && last[0] === word) last[2] += 1;
    else runs.push([word, k, 1]);
  }
  return runs;
}

// The cells (row, column) of the pieces of linked words: links are [source word, target word].
function linkedCells(attention, links) {
  const linked = new Set(links.map(([s, t]) => `${s} ${t}`));
  const cells = new Set();
  attention.target.forEach((_, i) => {
    const t = attention.target_piece_word[i];
    if (t === null || t === undefined) return;
    attention.source.forEach((_, j) => {
      const s = attention.source_piece_word[j];
      if (s !== null && s !== undefined && linked.has(`${s} ${t}`)) cells.add(`${i} ${j}`);
    });
  });
  return cells;
}

function heatmap(attention, kind, links) {
  const { source, target, weights } = attention;
  const sourceWords = attention.source_words || [];
  const targetWords = attention.target_words || [];
  const sourceWord = attention.source_piece_word || [];
  const targetWord = attention.target_piece_word || [];
  const table = el("table", "heatmap");
  table.dataset.kind = kind;
  const cells = links ? linkedCells(attention, links) : new Set();

  const words = el("tr", "words");
  words.append(el("th", "corner"), el("th", "corner"));
  for (const [word, first, count] of wordRuns(sourceWord, source.length)) {
    const th = el("th", "word src-word", word === null ? "" : sourceWords[word] ?? "");
    th.colSpan = count;
    th.dataset.first = first;
    th.dataset.count = count;
    words.append(th);
  }
  const pieces = el("tr", "pieces");
  pieces.append(el("th", "corner"), el("th", "corner"));
  source.forEach((piece, j) => {
    const th = el("th", "src");
    th.dataset.col = j;
    th.append(el("span", "", piece));
    th.title = `source piece ${j}: ${piece}`;
    pieces.append(th);
  });
  const head = el("thead");
  head.append(words, pieces);

  const body = el("tbody");
  const targetRuns = new Map(wordRuns(targetWord, target.length).map((run) => [run[1], run]));
  target.forEach((piece, i) => {
    const row = el("tr");
    const run = targetRuns.get(i);
    if (run) {
      const th = el("th", "word trg-word", run[0] === null ? "" : targetWords[run[0]] ?? "");
      th.rowSpan = run[2];
      th.dataset.first = run[1];
      th.dataset.count = run[2];
      row.append(th);
    }
    const label = el("th", "trg", piece);
    label.dataset.row = i;
    label.title = `target piece ${i}: ${piece}`;
    row.append(label);
    weights[i].forEach((weight, j) => {
      const td = el("td", "cell");
      td.dataset.row = i;
      td.dataset.col = j;
      td.dataset.weight = String(weight);
      td.style.background = shade(weight);
      td.title = `${piece} ← ${source[j]}: ${weight.toFixed(4)}`;
      if (cells.has(`${i} ${j}`)) td.classList.add("link");
      row.append(td);
    });
    body.append(row);
  });
  table.append(head, body);
  hoverable(table, weights);
  return table;
}

// Hover: a target piece (label or cell) highlights its row and the source pieces it attends to
// most; a source piece its column and the target pieces that attend to it most.
function hoverable(table, weights) {
  const clear = () => {
    table.classList.remove("hovering");
    for (const node of table.querySelectorAll(".hl, .focus")) node.classList.remove("hl", "focus");
  };
  const mark = (selector) => {
    const node = table.querySelector(selector);
    if (node) node.classList.add("hl");
  };
  const markWords = (kind, index) => {
    for (const th of table.querySelectorAll(`th.${kind}-word`)) {
      const first = Number(th.dataset.first);
      if (index >= first && index < first + Number(th.dataset.count)) th.classList.add("hl");
    }
  };
  const showRow = (i) => {
    table.classList.add("hovering");
    mark(`th.trg[data-row="${i}"]`);
    markWords("trg", i);
    for (const td of table.querySelectorAll(`td.cell[data-row="${i}"]`)) td.classList.add("focus");
    for (const j of strongest(weights[i])) {
      mark(`th.src[data-col="${j}"]`);
      mark(`td.cell[data-row="${i}"][data-col="${j}"]`);
      markWords("src", j);
    }
  };
  const showColumn = (j) => {
    table.classList.add("hovering");
    mark(`th.src[data-col="${j}"]`);
    markWords("src", j);
    for (const td of table.querySelectorAll(`td.cell[data-col="${j}"]`)) td.classList.add("focus");
    for (const i of strongest(weights.map((row) => row[j]))) {
      mark(`th.trg[data-row="${i}"]`);
      mark(`td.cell[data-row="${i}"][data-col="${j}"]`);
      markWords("trg", i);
    }
  };
  let shown = null;
  table.addEventListener("mouseover", (event) => {
    const node = event.target.closest("th.trg, td.cell, th.src");
    const key = node ? `${node.tagName}${node.dataset.row ?? ""},${node.dataset.col ?? ""}` : null;
    if (key === shown) return;
    shown = key;
    clear();
    if (!node) return;
    if (node.matches("th.src")) showColumn(Number(node.dataset.col));
    else showRow(Number(node.dataset.row));
  });
  table.addEventListener("mouseleave", () => {
    shown = null;
    clear();
  });
}

function figure(title, attention, kind, links) {
  const box = el("figure", `attention ${kind}`);
  box.append(el("figcaption", "", title));
  const scroll = el("div", "scroll");
  scroll.append(heatmap(attention, kind, links));
  box.append(scroll);
  return box;
}

// --- the results ------------------------------------------------------------------------------

function scoreLine(score, logProb) {
  return el("p", "score", `score ${number(score)} · log P ${number(logProb)}`);
}

function referenceView(reference) {
  const box = el("div", "reference-view");
  box.append(el("h4", "", "Reference"));
  box.append(el("p", "reference-text", reference.text));
  box.append(scoreLine(reference.score.score, reference.score.log_prob));
  const links = reference.alignment ? reference.alignment.links : [];
  if (reference.alignment) {
    box.append(el("p", "pharaoh", `alignment ${reference.alignment.pharaoh || "(no links)"}`));
  }
  if (reference.score.attention) {
    box.append(figure("Forced attention over the reference", reference.score.attention, "reference", links));
  }
  return box;
}

function resultView(answer, index) {
  const translation = answer.translations[index];
  const box = el("section", "result");
  box.dataset.model = answer.model;
  box.dataset.sentence = index;
  box.append(el("h3", "model-name", answer.model));
  box.append(el("p", "translation", translation.text));
  box.append(scoreLine(translation.score, translation.log_prob));
  if (translation.hypotheses.length > 1) {
    const list = el("ol", "nbest");
    for (const hypothesis of translation.hypotheses) {
      const item = el("li");
      item.append(el("span", "text", hypothesis.text), el("span", "value", number(hypothesis.score)));
      item.title = `log P ${number(hypothesis.log_prob)}`;
      list.append(item);
    }
    box.append(list);
  }
  if (translation.attention) {
    box.append(figure("Attention while translating", translation.attention, "translation", null));
  }
  const reference = answer.references[index];
  if (reference) box.append(referenceView(reference));
  return box;
}

function render(sentences, answers) {
  const results = byId("results");
  results.replaceChildren();
  sentences.forEach((sentence, i) => {
    const block = el("article", "sentence");
    const head = el("header");
    head.append(el("span", "number", String(i + 1)), el("p", "source", sentence || "(empty line)"));
    const columns = el("div", answers.length > 1 ? "columns two" : "columns");
    for (const answer of answers) columns.append(resultView(answer, i));
    block.append(head, columns);
    results.append(block);
  });
  byId("legend").hidden = sentences.length === 0;
}

// --- the form ---------------------------------------------------------------------------------

function positive(id) {
  const text = byId(id).value.trim();
  return text === "" ? null : Number(text);
}

async function translate(event) {
  event.preventDefault();
  clearError();
  const results = byId("results");
  const sentences = lines(byId("sentences").value);
  const references = lines(byId("reference").value);
  const names = selectedModels();
  let problem = null;
  if (!sentences.length) problem = "sentences: type or paste at least one sentence";
  else if (references.length && references.length !== sentences.length) {
    problem = `reference: ${references.length} lines for ${sentences.length} sentences; give one per sentence, or none`;
  } else if (!names.length) problem = "model: no model to translate with";
  if (problem) {
    showError(problem);
    return;
  }
  const button = byId("translate");
  button.disabled = true;
  results.setAttribute("aria-busy", "true");
  byId("status").textContent = "translating…";
  try {
    const answers = await Promise.all(
      names.map((name) => askModel(name, sentences, references, positive("beam"), positive("nbest") ?? 1)),
    );
    render(sentences, answers);
    byId("status").textContent = answers
      .map((a) => `${a.model}: ${number(a.elapsedMs, 0)} ms, ${plural(a.batchedWith, "sentence")} in its batch`)
      .join(" · ");
  } catch (error) {
    results.replaceChildren();
    byId("legend").hidden = true;
    byId("status").textContent = "";
    showError(error.message);
  } finally {
    button.disabled = false;
    results.setAttribute("aria-busy", "false");
    results.dataset.run = String(Number(results.dataset.run) + 1);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  byId("form").addEventListener("submit", translate);
  byId("model-a").addEventListener("change", showModelInfo);
  byId("model-b").addEventListener("change", showModelInfo);
  for (const id of ["sentences", "reference"]) {
    byId(id).addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) byId("form").requestSubmit();
    });
  }
  loadModels();
});
