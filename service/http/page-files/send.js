// Sending photos: the cards not sent yet go in requests of a few photos, at most IN_FLIGHT at a time, each a
// streamed answer (NDJSON) read line by line with "partial": true, so a bad photo fails only its own card.
// Every card a request carried is settled when it ends: by its item, by the request's error, or as cut short.
"use strict";

// The server runs a streamed answer's first row alone and the rest of that request as one forward
// (docs/SCHEDULING.md#first-row): an album sent as one request shows its first photo, then all the others at
// once. So the page sends requests of about TARGET_S of the server's work each, at the pace the server has
// shown this page; two under way keep the model busy while the next one uploads. Each request costs a first
// row of its own: 30 photos on resnet50 (random weights; 2 cores other tests kept busy; 4 rounds in Chromium) took
// 3.9 s sent whole, every one but the first at the end; in requests of 3 s, half came at 2.9 s, all at 4.9 s
// (medians; at 2 s: 2.7 and 5.5 s). A model fast for its request costs (ViT-S-32) lost 1.2 -> 1.6 s.
const TARGET_S = 3;
const FIRST_BATCH = 8;  // before the pace is known
const MIN_BATCH = 4;
const MAX_BATCH = 32;
const IN_FLIGHT = 2;
const RETRIES = 3;  // a 503 or 429 is tried again, half the photos, after its Retry-After, this many times
const sending = { queue: [], busy: 0, aborts: new Set(), run: null, pace: 0 };  // pace: seconds a photo

function enqueue(cards) {
  if (!cards.length) return;
  if (!sending.run) sending.run = { photos: 0, answered: 0, started: performance.now() };
  sending.run.photos += cards.length;
  sending.queue.push(...cards);
  pump();
}

function pump() {
  while (sending.busy < IN_FLIGHT) {
    const batch = nextBatch();
    if (!batch.length) break;
    sending.busy++;
    sendBatch(batch)
      .catch((e) => fail(batch, e.name === "AbortError" ? "cancelled" : "network", e.message))
      .finally(() => { sending.busy--; pump(); finished(); });
  }
}

// the next photos of one kind (files go as a form, URLs as JSON), skipping cards removed while they waited
function nextBatch() {
  sending.queue = sending.queue.filter((c) => !c.removed);
  const batch = [];
  const size = batchSize(sending.pace);
  const sameKind = (c) => !batch.length || Boolean(c.file) === Boolean(batch[0].file);
  while (batch.length < size && sending.queue.length && sameKind(sending.queue[0])) batch.push(sending.queue.shift());
  return batch;
}

function batchSize(pace) {
  return pace ? Math.min(MAX_BATCH, Math.max(MIN_BATCH, Math.round(TARGET_S / pace))) : FIRST_BATCH;
}

// the run's time over its photos answered so far: what the server gets through for this page, each request's
// own costs included
function measure() {
  const run = sending.run;
  if (run && run.answered) sending.pace = (performance.now() - run.started) / 1000 / run.answered;
}

function finished() {
  if (sending.busy || sending.queue.length || !sending.run) return;
  const { photos, started } = sending.run;
  sending.run = null;
  say(`${photos} photo(s) in ${Math.round(performance.now() - started)} ms`);
}

function cancelAll() {
  sending.queue = [];
  sending.aborts.forEach((a) => a.abort());
  sending.run = null;
}

function post(batch, signal) {
  const task = state.info.towers.includes("text") ? "embeddings" : "classify";
  const h = headers({ Accept: "application/x-ndjson" });
  let body;
  if (batch[0].file) {
    body = new FormData();
    batch.forEach((c) => body.append("images", c.file, c.name));
    body.append("partial", "true");
  } else {
    body = JSON.stringify({ images: batch.map((c) => c.url), partial: true });
    h["Content-Type"] = "application/json";
  }
  return fetch("/v1/" + task, { method: "POST", headers: h, body, signal });
}

async function sendBatch(batch) {
  const abort = new AbortController();
  sending.aborts.add(abort);
  try {
    for (let tries = 0; ; tries++) {
      const r = await post(batch, abort.signal);
      if ((r.headers.get("Content-Type") || "").startsWith("application/x-ndjson")) return await readLines(r, batch);
      const e = (await r.json().catch(() => ({}))).error || {};
      const wait = Number(r.headers.get("Retry-After") || 1);
      if ((r.status === 503 || r.status === 429) && tries < RETRIES) {
        // fewer photos a request: the server's queue (or this caller's share) may hold fewer than a batch
        sending.queue.unshift(...batch.splice(Math.ceil(batch.length / 2)));
        say(`the server is busy (${r.status}); trying again in ${wait} s`);
        await new Promise((resolve) => setTimeout(resolve, 1000 * wait));
        continue;
      }
      if (r.status === 401) askToken("refused", e.message);
      return fail(batch, e.code || String(r.status), e.message || r.statusText);
    }
  } finally {
    sending.aborts.delete(abort);
  }
}

async function readLines(r, batch) {
  const reader = r.body.getReader();
  const text = new TextDecoder();
  let rest = "";
  for (;;) {
    const { value, done } = await reader.read();
    rest += text.decode(value, { stream: !done });
    let at;
    while ((at = rest.indexOf("\n")) >= 0) {
      onLine(rest.slice(0, at), batch);
      rest = rest.slice(at + 1);
    }
    if (done) break;
  }
  onLine(rest, batch);  // a last line without its newline
  fail(batch, "cut_short", "the answer ended before this photo's result; add it again");
}

function onLine(raw, batch) {
  if (!raw.trim()) return;
  const line = JSON.parse(raw);
  if (line.event === "item") {
    settle(batch[line.index], line);
    if (sending.run) sending.run.answered++;
  } else if (line.event === "failed") fail(batch, line.error.code, line.error.message);
  else if (line.event === "done") measure();
}

// the cards of a batch still waiting get this error (those settled keep what they have)
function fail(batch, code, message) {
  batch.forEach((c) => settle(c, { error: { code, message } }));
}
