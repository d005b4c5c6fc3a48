// The comparison's load: embeddings requests of the whole album plus a /healthz probe every 50 ms.
//
//   MODE=closed  the widely shared experiment: N users send 1 request each, all at once
//                (`k6 run --vus N --iterations N`), as per-vu-iterations so each user sends exactly one
//   MODE=open    constant-arrival-rate: RATE_PER_MIN requests/min for DURATION_S, at most MAX_INFLIGHT
//                in flight (arrivals beyond that are dropped and counted, so the queue stays bounded)
//
// The probe is open-loop and corrected for coordinated omission: PROBE_VUS users share a 50 ms
// schedule and each probe's latency is counted from its *scheduled* send time, so a server that stalls
// for 3 s shows 3 s, 2.95 s, 2.9 s ... instead of one slow sample. It stops when the load is done
// (closed: all iterations finished; open: DURATION_S passed), or at PROBE_MAX_S.
//
// Everything is bounded (maxDuration, gracefulStop, request timeouts) and talks only to TARGET, which
// the Python side (bench/k6/__init__.py) checks is 127.0.0.1. The summary goes to SUMMARY_PATH as JSON.

import http from 'k6/http';
import exec from 'k6/execution';
import { sleep } from 'k6';
import { Counter, Trend } from 'k6/metrics';

const TARGET = __ENV.TARGET;
const IMAGES = JSON.parse(__ENV.IMAGES);
const BODY = JSON.stringify({ images: IMAGES });
const MODE = __ENV.MODE;
const VUS = Number(__ENV.VUS || 1);
const DURATION_S = Number(__ENV.DURATION_S || 20);
const PROBE_VUS = Number(__ENV.PROBE_VUS || 20);
const PROBE_PERIOD_MS = Number(__ENV.PROBE_PERIOD_MS || 50);
const PROBE_MAX_S = Number(__ENV.PROBE_MAX_S || 600);
const REQUEST_TIMEOUT = __ENV.REQUEST_TIMEOUT || '300s';

const latency = new Trend('load_latency', true);
const doneAt = new Trend('load_done_at', true); // when each successful response ended, from the start
const images = new Counter('load_images');
const errors = new Counter('load_errors');
const health = new Trend('health_latency', true);
const healthErrors = new Counter('health_errors');

function loadScenario() {
  if (MODE === 'closed') {
    return { executor: 'per-vu-iterations', exec: 'embed', vus: VUS, iterations: 1,
             maxDuration: `${PROBE_MAX_S}s`, gracefulStop: '10s' };
  }
  if (MODE === 'open') {
    const inflight = Number(__ENV.MAX_INFLIGHT || 8);
    return { executor: 'constant-arrival-rate', exec: 'embed', rate: Number(__ENV.RATE_PER_MIN),
             timeUnit: '1m', duration: `${DURATION_S}s`, preAllocatedVUs: inflight, maxVUs: inflight,
             gracefulStop: __ENV.GRACEFUL_STOP || '60s' };
  }
  throw new Error(`MODE must be closed or open, not ${MODE}`);
}

export const options = {
  scenarios: {
    load: loadScenario(),
    probe: { executor: 'per-vu-iterations', exec: 'probe', vus: PROBE_VUS, iterations: 1,
             maxDuration: `${PROBE_MAX_S}s`, gracefulStop: '5s' },
  },
  summaryTrendStats: ['avg', 'min', 'med', 'max', 'p(95)', 'p(99)', 'count'],
  discardResponseBodies: true, // 0.7-1.3 MB of embeddings per answer: k6 needs only the status
  noUsageReport: true,
};

export function embed() {
  const res = http.post(`${TARGET}/v1/embeddings`, BODY, {
    headers: { 'Content-Type': 'application/json' }, timeout: REQUEST_TIMEOUT, tags: { name: 'embeddings' },
  });
  if (res.status === 200) {
    latency.add(res.timings.duration);
    doneAt.add(Date.now() - exec.scenario.startTime);
    images.add(IMAGES.length);
  } else {
    errors.add(1);
    // the Python side keeps a few of these lines in the report: what kind of failure it was
    console.error(`LOAD_ERROR status=${res.status} error_code=${res.error_code} error=${res.error}`);
  }
}

function loadDone(startedAt) {
  if (Date.now() - startedAt > PROBE_MAX_S * 1000) return true;
  if (MODE === 'closed') {
    // probe iterations only complete when they return, so this counts the load's iterations
    return exec.instance.iterationsCompleted + exec.instance.iterationsInterrupted >= VUS;
  }
  return Date.now() - startedAt >= DURATION_S * 1000;
}

export function probe() {
  const startedAt = exec.scenario.startTime;
  const slot0 = exec.scenario.iterationInInstance; // 0..PROBE_VUS-1: this user's place in the schedule
  for (let j = 0; !loadDone(startedAt); j++) {
    const due = startedAt + (slot0 + j * PROBE_VUS) * PROBE_PERIOD_MS;
    // sleep in short steps so the probe notices the end of the load within ~PROBE_PERIOD_MS
    while (Date.now() < due && !loadDone(startedAt)) sleep(Math.min(due - Date.now(), PROBE_PERIOD_MS) / 1000);
    if (loadDone(startedAt)) break;
    const res = http.get(`${TARGET}/healthz`, { timeout: '120s', tags: { name: 'healthz' } });
    health.add(Date.now() - due);
    if (res.status !== 200) {
      healthErrors.add(1);
      console.error(`HEALTH_ERROR status=${res.status} error_code=${res.error_code} error=${res.error}`);
    }
  }
}

export function handleSummary(data) {
  return { [__ENV.SUMMARY_PATH]: JSON.stringify(data, null, 1) };
}
