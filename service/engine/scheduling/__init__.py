"""How a worker orders its work: who is admitted, who fetches and decodes next, what each forward holds.

Every rule is a pure function of one ``rules.WorkerView`` (view in, decision out); ``scheduler.Scheduler``
builds the view and carries the decision out, and the batcher only forms and runs what the plans say. The
reasons and figures behind each rule: docs/SCHEDULING.md, under the rule's key.

key                     rule
                        decided by · setting · test (tests/unit/engine/scheduling/)

admit                   503 while the model loads, or with the worker's queue full
                        rules.admission · GREENSERVE_MAX_QUEUE_IMAGES · test_rules::test_admission
share                   429 for a caller over its share of the queue
                        rules.admission · GREENSERVE_MAX_CALLER_IMAGES · test_rules::test_admission
fair-tags               a caller's requests follow each other; callers interleave image by image
                        admission.FairTags.start · — · test_admission::test_fair_tags
light-caller            a caller whose work here is at most fetch_ahead images (a search, a one-photo call)
                        rules.light_caller · GREENSERVE_FETCH_CONCURRENCY · test_rules::test_light_caller
fetch-pacing            a request fetches once earlier ones have at most fetch_ahead images on their way; a light caller at once
                        rules.may_fetch · GREENSERVE_FETCH_CONCURRENCY · test_rules::test_may_fetch
decode-lookahead        decode threads go in tag order; a later image waits while the model has decode_threads earlier ones queued
                        rules.may_decode · GREENSERVE_DECODE_THREADS · test_rules::test_may_decode
first-image             a caller's first image (nothing of its decoding or queued) decodes first, on a spare thread if need be
                        rules.decode_turn · — · test_rules::test_decode_turn
own-batch               a batch led by a request with images on their way holds only that request's
                        rules.members · GREENSERVE_BATCH_ACROSS_REQUESTS · test_rules::test_members
overtaken               a batch ends when another request's image is due before its next one
                        rules.overtaken · — · test_rules::test_overtaken
gather                  a batch waits for its request's images while decode runs, or across short gaps, 2 s at most
                        (on a share of the cores, until it holds the size past which the model's trial timed no
                        cheaper image, else 8; its caller's other requests' decoding counting as its own); for other
                        callers' images, GREENSERVE_MAX_BATCH_WAIT_MS
                        rules.gather_until · GREENSERVE_MAX_BATCH_WAIT_MS · test_rules::test_gather_until
gap-clock               after an urgent forward, a gap is timed from its end
                        rules.gap_start · — · test_rules::test_gap_start
quantum                 while callers share the worker, a forward that cannot be interrupted holds about a quantum
                        rules.batch_cap · GREENSERVE_FAIR_QUANTUM_MS · test_rules::test_batch_cap
interject               other callers' images run between the blocks of a running forward, at most as many as it holds
                        rules.interjection · GREENSERVE_PREEMPT_FORWARDS · test_rules::test_interjection
others-while-gathering  light callers' complete requests run while a batch gathers
                        rules.others_now · GREENSERVE_PREEMPT_FORWARDS · test_rules::test_others_now
first-row               a streamed answer's first row goes at once, alone
                        rules.first_row · — · test_rules::test_first_row
urgent                  first rows and other callers' images hold decodes and reads while they run, on every core only
                        rules.holds · — · test_rules::test_holds
first-decode            a streamed answer's first decode holds the reads
                        rules.first_decode · — · test_rules::test_first_decode
drop                    a cancelled request's images, and those past their deadline, never reach the model
                        order.still_due · GREENSERVE_REQUEST_TIMEOUT_S · test_order::test_still_due
backfill                a request that says Priority: u=4..7 (RFC 9218) queues behind every interactive image
                        rules.lane · — · test_rules::test_lane
text                    texts take a queue slot per 8, batch apart from images, wait only for texts being tokenised,
                        and run between the blocks of a running image forward (a search is interactive)
                        rules.text_slots, rules.text_plan · GREENSERVE_MAX_TEXT_BATCH · test_rules::test_text

How many cores a forward has is ``cores.CorePlan``'s (GREENSERVE_BORROW_IDLE_CORES).
"""

from service.engine.scheduling.admission import Admission
from service.engine.scheduling.scheduler import NOT_READY_RETRY_S, BatchRules, Scheduler, Signals
from service.engine.scheduling.view import Limits

__all__ = ["NOT_READY_RETRY_S", "Admission", "BatchRules", "Limits", "Scheduler", "Signals"]
