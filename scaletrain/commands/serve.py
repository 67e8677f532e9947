"""`scaletrain serve --checkpoint DIR --port P`: an OpenAI-compatible HTTP endpoint.

POST /v1/completions and /v1/chat/completions, GET /v1/models and /health, over scaletrain's
batched KV-cache generation. A worker thread decodes up to `--batch-size` rows at once with
continuous batching: waiting rows join the running batch between two tokens and finished or
abandoned ones leave it (`--batching static`: whole batches of rows with the same sampling
settings, the fallback for models with learned absolute positions or LongRoPE). Binds to
loopback unless `--host` says otherwise.
Streaming (`stream: true`) sends server-sent events. See docs/serve.md for the fields and
the limits (body size, read timeout, n, prompts per request).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from scaletrain.commands._checkpoint_flags import add_trust_flags, trust_settings
from scaletrain.inference.generators import LocalGenerator
from scaletrain.serving.http import ServerLimits, make_server

logger = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="scaletrain serve", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory (HF, native, or a run directory) with tokenizer.json")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default loopback; 0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    p.add_argument("--batch-size", type=int, default=8, help="most rows decoded together")
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="continuous: rows join and leave a running batch between tokens "
                        "(models with learned absolute positions or LongRoPE fall back to "
                        "static); static: a batch runs until all its rows have finished")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    p.add_argument("--model-name", default=None, help="the name /v1/models reports")
    p.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client may take to send a whole request (head and body, "
                        "from its first byte; 408 after)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a client may take to send a request's head (408 after)")
    p.add_argument("--idle-timeout", type=float, default=15.0,
                   help="seconds an open connection may wait for its next request")
    p.add_argument("--max-n", type=int, default=16, help="largest n per request")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open connections in all; beyond, the oldest idle or still-sending "
                        "one is closed (503 only when all are being answered)")
    p.add_argument("--max-slow-per-client", type=int, default=64,
                   help="idle or still-sending connections of one client address; beyond, "
                        "its oldest is closed")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every route but /health "
                        "(401 without); also read from SCALETRAIN_API_KEY")
    p.add_argument("--max-rows", type=int, default=256,
                   help="most completions (prompts x n) per request")
    add_trust_flags(p)
    args = p.parse_args(argv)
    api_key = args.api_key or os.environ.get("SCALETRAIN_API_KEY") or None
    for name in ("read_timeout", "header_timeout", "idle_timeout"):
        if getattr(args, name) <= 0:
            print(f"scaletrain serve: error: --{name.replace('_', '-')} must be > 0",
                  file=sys.stderr)
            return 2
    if args.max_connections < 1 or args.max_slow_per_client < 1:
        print("scaletrain serve: error: --max-connections and --max-slow-per-client must be "
              ">= 1", file=sys.stderr)
        return 2
    try:
        with trust_settings(args):
            gen = LocalGenerator.from_checkpoint(args.checkpoint, device=args.device,
                                                 batch_size=args.batch_size)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"scaletrain serve: error: {e}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s: reachable from other machines%s", args.host,
                       "" if api_key else ", with no authentication (see --api-key)")
    name = args.model_name or str(args.checkpoint).rstrip("/").split("/")[-1]
    limits = ServerLimits(max_n=args.max_n, max_rows=args.max_rows,
                          max_body_bytes=int(args.max_body_mb * (1 << 20)),
                          read_timeout_s=args.read_timeout,
                          header_timeout_s=args.header_timeout,
                          idle_timeout_s=args.idle_timeout,
                          max_connections=args.max_connections,
                          max_slow_per_client=args.max_slow_per_client)
    try:
        server = make_server(gen, args.host, args.port, name, args.batch_size, limits,
                             continuous=args.batching == "continuous", api_key=api_key)
    except OSError as e:
        print(f"scaletrain serve: error: cannot listen on {args.host}:{args.port}: {e}",
              file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    print(f"serving {name} on http://{host}:{port}/v1 (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


__all__ = ["main", "make_server", "ServerLimits"]
