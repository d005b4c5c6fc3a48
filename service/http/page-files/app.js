// greenserve's album page: add photos (files or URLs), watch each result arrive from a streamed answer
// (Accept: application/x-ndjson), then, on a CLIP model, rank the album with a sentence or label it
// zero-shot from the embeddings already here (only the text is sent). It talks to this server only.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { token: sessionStorage.getItem("greenserve-token") || "", info: null, cards: [] };

function headers(extra) {
  return Object.assign(state.token ? { Authorization: "Bearer " + state.token } : {}, extra || {});
}

function say(text) { $("status").textContent = text; }

async function start() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (r.status === 401) {
    $("token-box").hidden = false;
    $("add").hidden = true;
    $("model").textContent = "this server requires a token";
    return;
  }
  const body = await r.json();
  if (r.status !== 200) {
    $("model").textContent = "the model is still loading; reload in a moment";
    return;
  }
  state.info = body.data[0];
  const clip = state.info.towers.includes("text");
  $("model").textContent = `${state.info.name} · ${state.info.towers.join(" + ")} · ${state.info.dtype}` +
    (clip ? " · search the album with words" : " · top-k labels");
  $("search").hidden = !clip;
  $("token-box").hidden = true;
  $("add").hidden = false;
}

function card(name, thumbnail) {
  const li = document.createElement("li");
  li.className = "card pending";
  li.innerHTML = `<img alt=""><div class="body"><div class="name"></div><div class="result">waiting…</div></div>`;
  li.querySelector(".name").textContent = name;
  li.querySelector(".name").title = name;
  if (thumbnail) li.querySelector("img").src = thumbnail;  // a local file: an object URL, never a remote one
  $("album").appendChild(li);
  const c = { el: li, name, embedding: null };
  state.cards.push(c);
  return c;
}

function showLabels(c, labels) {
  const ul = document.createElement("ul");
  ul.className = "labels";
  for (const l of labels.slice(0, 3)) {
    const li = document.createElement("li");
    li.innerHTML = "<span></span><span></span>";
    li.children[0].textContent = l.label;
    li.children[1].textContent = (100 * l.score).toFixed(1) + "%";
    ul.appendChild(li);
  }
  c.el.querySelector(".result").replaceChildren(ul);
}

function settle(c, item) {
  c.el.classList.remove("pending");
  if (item.error) {
    c.el.classList.add("failed");
    c.el.querySelector(".result").textContent = `${item.error.code}: ${item.error.message}`;
  } else if (item.embedding) {
    c.embedding = item.embedding;
    c.el.querySelector(".result").textContent = `embedded (${item.embedding.length} dimensions)`;
  } else if (item.labels) {
    showLabels(c, item.labels);
  }
  c.el.dataset.done = String(performance.now());  // when it came: the browser test reads it
}

async function stream(body, contentType, batch) {
  const task = state.info.towers.includes("text") ? "embeddings" : "classify";
  const h = headers({ Accept: "application/x-ndjson" });
  if (contentType) h["Content-Type"] = contentType;
  const r = await fetch("/v1/" + task, { method: "POST", headers: h, body });
  if (!(r.headers.get("Content-Type") || "").startsWith("application/x-ndjson")) {
    const err = await r.json().catch(() => ({}));
    const e = err.error || {};
    say(`refused (${r.status}): ${e.message || r.statusText}`);
    batch.forEach((c) => settle(c, { error: { code: e.code || String(r.status), message: e.message || "" } }));
    return;
  }
  const reader = r.body.getReader();
  const text = new TextDecoder();
  let rest = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    rest += text.decode(value, { stream: true });
    let at;
    while ((at = rest.indexOf("\n")) >= 0) {
      const line = JSON.parse(rest.slice(0, at));
      rest = rest.slice(at + 1);
      if (line.event === "item") settle(batch[line.index], line);
      else if (line.event === "done") say(`${batch.length} photo(s) in ${Math.round(line.timings_ms.total)} ms`);
      else if (line.event === "failed") say(`failed: ${line.error.message}`);
    }
  }
}

async function send() {
  const files = Array.from($("files").files);
  const urls = $("urls").value.split("\n").map((s) => s.trim()).filter(Boolean);
  if (!files.length && !urls.length) return say("add photos or URLs first");
  $("send").disabled = true;
  say("sending…");
  try {
    if (files.length) {
      const form = new FormData();
      files.forEach((f) => form.append("images", f, f.name));
      await stream(form, null, files.map((f) => card(f.name, URL.createObjectURL(f))));
    }
    if (urls.length) {
      await stream(JSON.stringify({ images: urls }), "application/json", urls.map((u) => card(u, null)));
    }
  } catch (e) {
    say("error: " + e);
  } finally {
    $("send").disabled = false;
    $("files").value = "";
    $("urls").value = "";
  }
}

async function embedTexts(texts) {
  const r = await fetch("/v1/embeddings", { method: "POST", body: JSON.stringify({ texts }),
    headers: headers({ "Content-Type": "application/json" }) });
  const body = await r.json();
  if (r.status !== 200) throw new Error(body.error ? body.error.message : r.statusText);
  return body.data.map((d) => d.embedding);
}

const dot = (a, b) => a.reduce((s, x, i) => s + x * b[i], 0);

async function rank() {
  const query = $("query").value.trim();
  const ready = state.cards.filter((c) => c.embedding);
  if (!query || !ready.length) return say("add photos and type a sentence first");
  const [q] = await embedTexts([query]);
  for (const c of state.cards) {
    const score = c.embedding ? dot(c.embedding, q) : -2;
    c.score = score;
    let badge = c.el.querySelector(".score");
    if (!badge) {
      badge = document.createElement("span");
      badge.className = "score";
      c.el.querySelector(".name").prepend(badge);
    }
    badge.textContent = c.embedding ? score.toFixed(3) : "";
  }
  state.cards.sort((a, b) => b.score - a.score).forEach((c) => $("album").appendChild(c.el));
  say(`ranked ${ready.length} photo(s) for "${query}"`);
}

async function zeroShot() {
  const labels = $("labels").value.split(",").map((s) => s.trim()).filter(Boolean);
  const ready = state.cards.filter((c) => c.embedding);
  if (!labels.length || !ready.length) return say("add photos and some labels first");
  const vectors = await embedTexts(labels.map((l) => `a photo of a ${l}.`));
  const { logit_scale: scale, logit_bias: bias } = state.info.text;
  for (const c of ready) {
    const logits = vectors.map((v) => scale * dot(c.embedding, v) + bias);
    const top = Math.max(...logits);
    const exp = logits.map((x) => Math.exp(x - top));
    const total = exp.reduce((s, x) => s + x, 0);
    showLabels(c, labels.map((label, i) => ({ label, score: exp[i] / total })).sort((a, b) => b.score - a.score));
  }
  say(`labelled ${ready.length} photo(s)`);
}

function wire() {
  const drop = $("drop");
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    $("files").files = e.dataTransfer.files;
    send();
  });
  $("send").addEventListener("click", send);
  $("rank").addEventListener("click", () => rank().catch((e) => say("error: " + e.message)));
  $("query").addEventListener("keydown", (e) => { if (e.key === "Enter") $("rank").click(); });
  $("zero-shot").addEventListener("click", () => zeroShot().catch((e) => say("error: " + e.message)));
  $("use-token").addEventListener("click", () => {
    state.token = $("token").value.trim();
    sessionStorage.setItem("greenserve-token", state.token);
    start();
  });
}

wire();
start().catch((e) => say("error: " + e));
