// The album: a card for each photo from the moment it is picked (its thumbnail before any answer) until it
// shows its result or its own error; the progress count; a search and zero-shot labels that stay on, so a
// photo whose vector comes later is ranked and labelled too. No request is made here: send.js sends the
// photos, app.js asks the server for the text vectors.
"use strict";

const $ = (id) => document.getElementById(id);
const album = { cards: [], search: null, labels: null };

function say(text) { $("status").textContent = text; }

function placeholder(thumb, text) {
  const div = document.createElement("div");
  div.className = "placeholder";
  div.textContent = text;
  thumb.replaceChildren(div);
}

// a file's own pixels (an object URL); a URL's image as the browser loads it, or a placeholder saying why not
function thumbnail(c, src) {
  const thumb = c.el.querySelector(".thumb");
  if (!src) return placeholder(thumb, "no preview: a name on the server's image host");
  const img = document.createElement("img");
  img.alt = "";
  img.referrerPolicy = "no-referrer";
  img.addEventListener("error", () => placeholder(thumb, "no preview: the browser cannot show this image"));
  img.src = src;
  thumb.replaceChildren(img);
}

function addCard(source) {
  const li = document.createElement("li");
  li.className = "card pending";
  li.innerHTML = `<div class="thumb"></div><button class="remove" type="button">×</button>` +
    `<div class="body"><div class="name"></div><div class="result">waiting…</div></div>`;
  const c = { el: li, state: "waiting", embedding: null, score: null, removed: false };
  if (source instanceof File) {
    Object.assign(c, { file: source, name: source.name, objectUrl: URL.createObjectURL(source) });
  } else {
    Object.assign(c, { url: source, name: source.replace(/[?#].*$/, "").split("/").filter(Boolean).pop() || source });
    if (source.startsWith("data:")) c.name = "data: URL";
  }
  const name = li.querySelector(".name");
  name.textContent = c.name;
  name.title = c.file ? c.name : c.url;
  const remove = li.querySelector(".remove");
  remove.title = "remove " + c.name;
  remove.setAttribute("aria-label", remove.title);
  remove.addEventListener("click", () => removeCard(c));
  thumbnail(c, c.objectUrl || (/^(https?:|data:image\/)/i.test(c.url) ? c.url : null));
  $("album").appendChild(li);
  album.cards.push(c);
  return c;
}

function removeCard(c) {
  c.removed = true;  // a result still on its way is dropped (send.js skips it if it was not sent yet)
  c.el.remove();
  if (c.objectUrl) URL.revokeObjectURL(c.objectUrl);
  album.cards.splice(album.cards.indexOf(c), 1);
  showProgress();
}

function clearCards() {
  album.cards.slice().forEach(removeCard);
  say("");
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

// an image's item or its error, once: what comes after for the same card (a late line, a cut answer) is ignored
function settle(c, item) {
  if (!c || c.removed || c.state !== "waiting") return;
  c.el.classList.remove("pending");
  if (item.error) {
    c.state = "failed";
    c.el.classList.add("failed");
    c.el.querySelector(".result").textContent = `${item.error.code}: ${item.error.message}`;
  } else {
    c.state = "done";
    if (item.labels) showLabels(c, item.labels);
    if (item.embedding) {
      c.embedding = item.embedding;
      c.el.querySelector(".result").textContent = `embedded (${item.embedding.length} dimensions)`;
      if (album.labels) labelCard(c);
      if (album.search) rankCards();
    }
  }
  c.el.dataset.done = String(performance.now());  // when it came: the browser tests read it
  showProgress();
}

function showProgress() {
  const total = album.cards.length;
  const settled = album.cards.filter((c) => c.state !== "waiting").length;
  const failed = album.cards.filter((c) => c.state === "failed").length;
  $("progress").textContent = total ? `${settled} of ${total}` + (failed ? ` · ${failed} failed` : "") : "";
  $("clear").hidden = !total;
}

const dot = (a, b) => a.reduce((s, x, i) => s + x * b[i], 0);

// every card with a vector gets its cosine to the query, best first; the others follow in the order added
function rankCards() {
  for (const c of album.cards) {
    c.score = album.search && c.embedding ? dot(c.embedding, album.search.vector) : null;
    let badge = c.el.querySelector(".score");
    if (!badge && c.score !== null) {
      badge = document.createElement("span");
      badge.className = "score";
      c.el.querySelector(".name").prepend(badge);
    }
    if (badge) badge.textContent = c.score === null ? "" : c.score.toFixed(3);
  }
  const key = (c) => (c.score === null ? -Infinity : c.score);
  album.cards.slice().sort((a, b) => key(b) - key(a)).forEach((c) => $("album").appendChild(c.el));
}

// softmax over logit_scale x cosine + logit_bias, as the server's zero-shot classify does
function labelCard(c) {
  const { names, vectors, scale, bias } = album.labels;
  const logits = vectors.map((v) => scale * dot(c.embedding, v) + bias);
  const top = Math.max(...logits);
  const exp = logits.map((x) => Math.exp(x - top));
  const total = exp.reduce((s, x) => s + x, 0);
  showLabels(c, names.map((label, i) => ({ label, score: exp[i] / total })).sort((a, b) => b.score - a.score));
}
