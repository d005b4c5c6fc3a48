// greenserve's album page: add photos (files or URLs) and watch each result arrive (send.js streams them into
// the album's cards, album.js), then, on a CLIP model, rank the album with a sentence or label it zero-shot
// from the embeddings already here (only the text is sent). It talks to this server only.
"use strict";

const TOKEN_KEY = "greenserve-token";
const state = { token: sessionStorage.getItem(TOKEN_KEY) || "", info: null };

function headers(extra) {
  return Object.assign(state.token ? { Authorization: "Bearer " + state.token } : {}, extra || {});
}

async function start() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (r.status === 401) return askToken(state.token ? "refused" : "needed");
  const body = await r.json();
  if (r.status !== 200) {
    $("model").textContent = "the model is still loading; reload in a moment";
    return;
  }
  state.info = body.data[0];
  const clip = state.info.towers.includes("text");
  $("model").textContent = `${state.info.name} · ${state.info.towers.join(" + ")} · ${state.info.dtype}` +
    (clip ? " · search the album with words" : " · top-k labels");
  showWeights(state.info.weights);
  $("search").hidden = !clip;
  $("token-box").hidden = true;
  $("add").hidden = false;
}

function showWeights(weights) {
  const random = weights === "random";
  $("notice").hidden = !random;
  $("notice").textContent = random ? "This server runs random weights: its model was never trained, so its labels, " +
    "scores and search results mean nothing (every photo looks alike to it). Whoever runs the server sets " +
    "GREENSERVE_WEIGHTS to real ones (docs/MODELS.md, Real weights)." : "";
}

// no token, or one the server refused (at start, or later on a photo's request): say so, and where tokens come from
function askToken(why, detail) {
  if (why === "refused") sessionStorage.removeItem(TOKEN_KEY);
  $("token-message").textContent = (why === "refused"
    ? "The server refused this token (401" + (detail ? `: ${detail}` : "") + "). "
    : "This server needs a token. ") +
    "Type one of the tokens in the server's GREENSERVE_API_TOKEN setting (its environment, e.g. " +
    "deploy/greenserve.env; ask whoever runs it) here:";
  $("token-box").hidden = false;
  $("add").hidden = true;
  $("search").hidden = true;
  $("model").textContent = "this server requires a token";
  $("token").focus();
}

function useToken() {
  state.token = $("token").value.trim();
  sessionStorage.setItem(TOKEN_KEY, state.token);
  $("token").value = "";
  start().catch((e) => say("error: " + e));
}

function addPhotos(sources) {  // File objects or URL strings
  if (!state.info) return say("the model is not ready yet");
  enqueue(Array.from(sources).map(addCard));
  showProgress();
}

function addUrls() {
  const urls = $("urls").value.split("\n").map((s) => s.trim()).filter(Boolean);
  if (!urls.length) return say("paste image URLs first, one per line");
  $("urls").value = "";
  addPhotos(urls);
}

async function embedTexts(texts) {
  const r = await fetch("/v1/embeddings", { method: "POST", body: JSON.stringify({ texts }),
    headers: headers({ "Content-Type": "application/json" }) });
  const body = await r.json();
  if (r.status === 401) askToken("refused", body.error && body.error.message);
  if (r.status !== 200) throw new Error(body.error ? body.error.message : r.statusText);
  return body.data.map((d) => d.embedding);
}

// the search stays on: a photo whose vector comes later takes its place in the ranking (an empty query ends it)
async function rank() {
  const query = $("query").value.trim();
  album.search = query ? { query, vector: (await embedTexts([query]))[0] } : null;
  rankCards();
  const ready = album.cards.filter((c) => c.embedding).length;
  say(query ? `ranked ${ready} photo(s) for "${query}"; photos added later take their place` : "ranking off");
}

async function zeroShot() {
  const names = $("labels").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (!names.length) return say("type some labels first, separated by commas");
  const vectors = await embedTexts(names.map((l) => `a photo of a ${l}.`));
  const { logit_scale: scale, logit_bias: bias } = state.info.text;
  album.labels = { names, vectors, scale, bias };
  const ready = album.cards.filter((c) => c.embedding);
  ready.forEach(labelCard);
  say(`labelled ${ready.length} photo(s); photos added later are labelled too`);
}

function clearAlbum() {
  cancelAll();
  clearCards();
}

function wire() {
  const drop = $("drop");
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    addPhotos(e.dataTransfer.files);
  });
  drop.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") $("files").click(); });
  $("files").addEventListener("change", () => {
    addPhotos($("files").files);  // shown and sent at once: picking is the only click
    $("files").value = "";
  });
  $("send").addEventListener("click", addUrls);
  $("clear").addEventListener("click", clearAlbum);
  $("rank").addEventListener("click", () => rank().catch((e) => say("error: " + e.message)));
  $("query").addEventListener("keydown", (e) => { if (e.key === "Enter") $("rank").click(); });
  $("zero-shot").addEventListener("click", () => zeroShot().catch((e) => say("error: " + e.message)));
  $("labels").addEventListener("keydown", (e) => { if (e.key === "Enter") $("zero-shot").click(); });
  $("use-token").addEventListener("click", useToken);
  $("token").addEventListener("keydown", (e) => { if (e.key === "Enter") useToken(); });
}

wire();
start().catch((e) => say("error: " + e));
