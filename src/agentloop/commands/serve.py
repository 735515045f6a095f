"""`agentloop serve`: its arguments. The engine (torch, transformers) is imported only when it runs,
so other subcommands and `--help` start fast."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any


LIMITS_HELP = """request limits (each request is checked against them before any work; the server keeps serving):
  body size      every endpoint reads at most --max-request-bytes of body, except
                 /update_weights_from_tensor (weight payloads): --max-weights-request-bytes.
                 A larger body is refused with 413, before it is read when Content-Length says so.
  bodies held    all bodies being read or handled at once hold at most --max-held-request-bytes
                 (429 past it, before reading when Content-Length says so).
  weight updates one at a time (body included); another waits up to --weight-update-wait seconds
                 without its body being read, then gets 409.
  n              /generate's sampling_params.n may be at most --max-n (400 above).
  total work     one /generate may ask for at most --max-request-tokens tokens: prompt tokens +
                 max_new_tokens summed over all its inputs and samples (400 above: send it in parts).
  malformed      a body that is not JSON, not an object, nested too deeply or with fields of the
                 wrong type is answered 4xx with a message (SGLang's error bodies), never 500."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from ..engine.local.limits import RequestLimits

    d = RequestLimits()
    p = subparsers.add_parser("serve", help="serve the CPU reference engine over SGLang's HTTP API",
                              epilog=LIMITS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="HF causal LM folder (default: the shipped tiny tool model); --model-path as in SGLang")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 = a free port, named in the log")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--context-length", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--max-prefill-tokens", type=int, default=8192,
                   help="padded tokens of one batched prefill forward (a longer single prompt still runs alone)")
    p.add_argument("--weight-version", default="default")
    # SGLang's priority scheduling flags, with its defaults (agentloop/engine/local/priority.py)
    p.add_argument("--enable-priority-scheduling", action="store_true",
                   help="admit queued requests by their `priority` (higher first) and let a full batch preempt "
                   "lower-priority running ones")
    p.add_argument("--schedule-low-priority-values-first", action="store_true",
                   help="with --enable-priority-scheduling: lower priority values go first")
    p.add_argument("--disable-priority-preemption", action="store_true", help="priority orders the queue only")
    p.add_argument("--priority-scheduling-preemption-threshold", type=int, default=10,
                   help="how much a waiting request's priority must beat a running one's to preempt it")
    p.add_argument("--abort-on-priority-when-disabled", action="store_true",
                   help="without --enable-priority-scheduling, refuse requests that carry a priority")
    p.add_argument("--seed", type=int, default=0, help="seeds requests that carry no sampling_seed")
    # One thread by default: measured fastest for the small models this engine serves, by far on a
    # machine shared with the trainer or other jobs (benchmarks/results/serve_threads.json).
    p.add_argument("--num-threads", type=int, default=1, metavar="N",
                   help="torch CPU threads of the engine (default 1: fastest for small models, measured in "
                   "benchmarks/serve_threads.py; raise it for a large model on idle cores; 0 = torch's choice, "
                   "one per core)")
    p.add_argument(
        "--return-original-logprob", action="store_true",
        help="report log_softmax(logits) instead of SGLang's default temperature-scaled logprobs",
    )
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="most body bytes of any request but weight payloads (default: %(default)s = 16 MiB)")
    p.add_argument("--max-weights-request-bytes", type=int, default=d.max_weights_request_bytes,
                   help="most body bytes of /update_weights_from_tensor (default: %(default)s = 1 GiB)")
    p.add_argument("--max-n", type=int, default=d.max_n, help="most sampling_params.n of one /generate (default: %(default)s)")
    p.add_argument("--max-request-tokens", type=int, default=d.max_request_tokens,
                   help="most tokens of work of one /generate: prompt + max_new_tokens over all its samples "
                   "(default: %(default)s)")
    p.add_argument("--max-held-request-bytes", type=int, default=d.max_held_request_bytes,
                   help="most body bytes held at once over all requests (default: %(default)s = 1.25 GiB)")
    p.add_argument("--weight-update-wait", type=float, default=d.weight_update_wait, metavar="SECONDS",
                   help="how long a weight update waits for the one in progress before 409 (default: %(default)s)")
    p.add_argument("--log-level", default="info")
    return p


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT, then end the process (this does not return to an in-process caller).

    By then the server has shut down (requests finished, the engine thread stopped); the interpreter's
    own teardown of torch and transformers would add ~1 CPU-second and 1-3 s to every stop on a 2-core
    machine (measured) with nothing left to release, so the process exits here once its output is flushed.
    """
    from ..engine.local import server

    # No `agentloop.allocator.tune_allocator()` here, on purpose: the model's forward passes run in this
    # process, and pinned thresholds slow torch's CPU work (see the allocator's module docstring).
    code = server.run(args)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
