// immich's server as a client of its machine-learning URL, written from what immich's
// server/src/repositories/machine-learning.repository.ts does (its behaviour, not its code):
//   - availability: GET new URL('ping', url) with AbortSignal.timeout(2000); healthy when response.ok
//   - predict: POST new URL('predict', url) with a multipart body: 'entries' (JSON.stringify of the tasks), then
//     'image' (the preview file as a nameless Blob: filename "blob", application/octet-stream) or 'text';
//     response.ok → response.json(), anything else is a failure (immich logs the status, marks the URL unhealthy)
//   - encodeImage / encodeText / detectFaces / ocr build their entries as immich does
// The body is built with the platform's FormData (--encoder formdata: immich until its hand encoding), or by hand
// as newer immich does (--encoder manual: boundary immich-<uuid>, the same parts). Each result carries the exact
// bytes and Content-Type sent, so a test can check that a forward passed them on unchanged.
//
// usage: node immich_client.mjs plan.json   plan: {"url", "encoder", "calls": [{"op", ...}]}
// prints one JSON array: per call {op, ok, status, statusText, contentType, body (JSON or text), sent, sentType}

import { randomUUID } from 'node:crypto';
import { readFile } from 'node:fs/promises';

const TASK = { FACIAL_RECOGNITION: 'facial-recognition', SEARCH: 'clip', OCR: 'ocr' };
const TYPE = { DETECTION: 'detection', RECOGNITION: 'recognition', TEXTUAL: 'textual', VISUAL: 'visual' };

function formDataBody(entries, payload) {
  const formData = new FormData();
  formData.append('entries', entries);
  if ('image' in payload) {
    formData.append('image', new Blob([new Uint8Array(payload.image)]));
  } else if ('text' in payload) {
    formData.append('text', payload.text);
  }
  return formData;
}

function manualBody(entries, payload) {
  const boundary = `immich-${randomUUID()}`;
  const parts = [];
  const addPart = (name, value, filename) => {
    const head = [`--${boundary}`, `Content-Disposition: form-data; name="${name}"${filename ? `; filename="${filename}"` : ''}`];
    if (filename) head.push('Content-Type: application/octet-stream');
    parts.push(Buffer.from(`${head.join('\r\n')}\r\n\r\n`), typeof value === 'string' ? Buffer.from(value) : value, Buffer.from('\r\n'));
  };
  addPart('entries', entries);
  if ('image' in payload) addPart('image', payload.image, 'blob');
  else if ('text' in payload) addPart('text', payload.text);
  parts.push(Buffer.from(`--${boundary}--\r\n`));
  return { body: Buffer.concat(parts), contentType: `multipart/form-data; boundary=${boundary}` };
}

async function predict(url, encoder, entries, payload) {
  let request;
  if (encoder === 'manual') {
    const { body, contentType } = manualBody(entries, payload);
    request = new Request(new URL('predict', url), { method: 'POST', body, headers: { 'Content-Type': contentType } });
  } else {
    request = new Request(new URL('predict', url), { method: 'POST', body: formDataBody(entries, payload) });
  }
  // the bytes on the wire: a clone reads the same body, with the boundary the request itself carries
  const sent = Buffer.from(await request.clone().arrayBuffer());
  const response = await fetch(request);
  const text = await response.text();
  let body = text;
  try {
    body = JSON.parse(text);
  } catch {
    // not JSON: kept as text
  }
  return {
    ok: response.ok, status: response.status, statusText: response.statusText,
    contentType: response.headers.get('content-type'), body,
    sent: sent.toString('base64'), sentType: request.headers.get('content-type'),
  };
}

async function ping(url) {
  try {
    const response = await fetch(new URL('ping', url), { signal: AbortSignal.timeout(2000) });
    return { ok: response.ok, status: response.status, body: await response.text() };
  } catch (error) {
    return { ok: false, status: 0, body: String(error) };
  }
}

async function imagePayload(call) {
  return { image: await readFile(call.imagePath) };
}

async function run(url, encoder, call) {
  const send = async (request, payload) => predict(url, encoder, JSON.stringify(request), payload);
  switch (call.op) {
    case 'ping':
      return ping(url);
    case 'encodeImage':
      return send({ [TASK.SEARCH]: { [TYPE.VISUAL]: { modelName: call.modelName } } }, await imagePayload(call));
    case 'encodeText':
      return send({ [TASK.SEARCH]: { [TYPE.TEXTUAL]: { modelName: call.modelName, options: { language: call.language } } } },
        { text: call.text });
    case 'detectFaces':
      return send({
        [TASK.FACIAL_RECOGNITION]: {
          [TYPE.DETECTION]: { modelName: call.modelName, options: { minScore: call.minScore } },
          [TYPE.RECOGNITION]: { modelName: call.modelName },
        },
      }, await imagePayload(call));
    case 'ocr':
      return send({
        [TASK.OCR]: {
          [TYPE.DETECTION]: { modelName: call.modelName, options: { minScore: call.minDetectionScore, maxResolution: call.maxResolution } },
          [TYPE.RECOGNITION]: { modelName: call.modelName, options: { minScore: call.minRecognitionScore } },
        },
      }, await imagePayload(call));
    case 'raw': // entries as given (a malformed one), with an image, a text or neither
      return predict(url, encoder, call.entries, call.imagePath ? await imagePayload(call) : 'text' in call ? { text: call.text } : {});
    default:
      throw new Error(`unknown op ${call.op}`);
  }
}

const plan = JSON.parse(await readFile(process.argv[2], 'utf8'));
const results = [];
for (const call of plan.calls) {
  results.push({ op: call.op, ...(await run(plan.url, plan.encoder ?? 'formdata', call)) });
}
process.stdout.write(JSON.stringify(results));
