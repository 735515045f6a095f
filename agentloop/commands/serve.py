"""`agentloop serve`: its arguments. The engine (torch, transformers) is imported only when it runs,
so other subcommands and `--help` start fast."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve the CPU reference engine over SGLang's HTTP API")
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="HF causal LM folder (default: the shipped tiny tool model); --model-path as in SGLang")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 = a free port, named in the log")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--context-length", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--max-prefill-tokens", type=int, default=8192,
                   help="padded tokens of one batched prefill forward (a longer single prompt still runs alone)")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--seed", type=int, default=0, help="seeds requests that carry no sampling_seed")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--return-original-logprob", action="store_true",
        help="report log_softmax(logits) instead of SGLang's default temperature-scaled logprobs",
    )
    p.add_argument("--log-level", default="info")
    return p


def run(args: argparse.Namespace) -> int:
    from ..engine.local import server

    return server.run(args)
