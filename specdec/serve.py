"""OpenAI-compatible server: `python -m specdec.serve [--target NAME|PATH] [--drafter ...] [--port 8000]`.

Loads the model (and its drafter) like `python -m specdec.generate`, in an engine process of its own
(specdec/server/engine_process.py), then serves /v1/completions, /v1/chat/completions, /v1/models, /tokenize,
/detokenize, /health and /metrics on --host:--port (127.0.0.1:8000 by default). Requests join the running batch as they
arrive. SIGINT / SIGTERM stop accepting
connections, let in-flight requests finish for up to --timeout-graceful-shutdown seconds, abort what
is left, and exit 0. Exit status 2: bad arguments or a model that cannot be loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import sys

from specdec.arguments import (DefaultsHelpFormatter, add_engine_arguments, add_model_arguments, chosen_drafter,
                               engine_options, revisions)
from specdec.engine.prompts import chat_template_text
from specdec.engine.reasoning import REASONING_PARSERS
from specdec.server.api_key import API_KEY_ENV, checked_api_key
from specdec.server.body_limit import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from specdec.server.header_timeout import DEFAULT_HEADER_TIMEOUT_S, header_timeout_protocol
from specdec.server.sampling_defaults import sampling_defaults
from specdec.weights.demo_models import resolve_model

PROG = "python -m specdec.serve"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    add_model_arguments(p)
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 exposes the server)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --target)")
    p.add_argument("--api-key", default=None,
                   help="a key every request but /health and /metrics must send as 'Authorization: Bearer KEY' (the "
                        f"openai client's api_key); default: ${API_KEY_ENV} if set, else no key is asked for")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGINT/SIGTERM")
    p.add_argument("--engine-thread", action="store_true",
                   help="run the engine on a thread of the server's process instead of a process of its own (one "
                        "process to debug or profile; slower under load: HTTP work shares the engine's interpreter)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="the largest request body accepted (a larger one gets 413 before it is read)")
    p.add_argument("--request-body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="seconds a client may take to send a request's body (then 408)")
    p.add_argument("--request-header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds a client may take to send a request's headers (then 408 and the connection closes)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="chat answers of a model that thinks between <think> and </think> carry that reasoning as "
                        "message.reasoning_content, apart from their content (vLLM's; both names read those tags)")
    p.add_argument("--generation-config", default="auto",
                   help="defaults for the sampling settings a request leaves out (temperature, top_p, top_k, min_p, "
                        "repetition_penalty), as vLLM and SGLang take them: auto = the model's generation_config.json "
                        "if it has one, none = OpenAI's defaults, or a folder holding a generation_config.json")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def main(argv=None, prog: str = PROG) -> int:
    """`prog` names the command in --help and usage errors (`specdec serve` runs this too)."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    import uvicorn

    from specdec.server.engine_process import EngineStartError
    from specdec.server.openai_api import build_app
    from specdec.server.startup_heap import freeze_startup_heap

    try:
        api_key = chosen_api_key(args)
        template = chat_template_text(args.chat_template) if args.chat_template is not None else None
        # the model's folder is found (fetched or converted, the first time) here, before the engine process starts
        defaults = sampling_defaults(args.generation_config, resolve_model(args.target, revision=args.revision))
        llm_args = dict(target=args.target, drafter=chosen_drafter(args), chat_template=template, **revisions(args),
                        **engine_options(args))
        engine = start_engine(llm_args, args.engine_thread, args.log_level.upper())
        if template is not None:  # the server's process templates chats with its own copy of the tokenizer
            engine.tokenizer.chat_template = template
    except (EngineStartError, ValueError, FileNotFoundError, ImportError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    if defaults:
        logging.getLogger(__name__).info("requests that leave them out get the sampling settings %s of the model's "
                                         "generation config (--generation-config none: OpenAI's defaults)", defaults)
    app = build_app(engine, args.served_model_name or args.target, max_body_bytes=args.max_request_bytes,
                    body_timeout_s=args.request_body_timeout, api_key=api_key, reasoning_parser=args.reasoning_parser,
                    sampling_defaults=defaults)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.timeout_graceful_shutdown,
                            http=header_timeout_protocol(args.request_header_timeout))
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again under the handler it
    # found: with these no-op handlers that re-raise ends nothing, so a stop by signal exits 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    server = draining_server(uvicorn, config, engine, args.timeout_graceful_shutdown)
    freeze_startup_heap()  # this process serves until it exits (specdec/server/startup_heap.py)
    server.run()
    return 0 if server.started else 1


def chosen_api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $SPECDEC_API_KEY (a key kept out of the command line, which other users of the machine can
    read), checked before the model loads; None: no key."""
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    return checked_api_key(key) if key is not None else None


def draining_server(uvicorn, config, engine, grace_s: float):
    """uvicorn's server, which ends what is still in flight just before its grace period runs out: every
    stream gets an error event and `[DONE]`, every whole answer a JSON error (uvicorn alone would cut
    them off at the deadline: streams without an end, whole answers as a plain-text 500)."""

    class DrainingServer(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame) -> None:  # the signal handler, on the event loop's thread
            if not self.draining and self.started:
                self.draining = True
                loop = asyncio.get_event_loop()
                loop.call_soon_threadsafe(loop.call_later, max(0.0, grace_s - min(1.0, grace_s / 2)),
                                          engine.end_all, "the server is shutting down")
            super().handle_exit(sig, frame)

    return DrainingServer(config)


def start_engine(llm_args: dict, on_thread: bool, log_level: str):
    """The loaded model's engine, on a thread of this process or (default) in a process of its own."""
    from specdec.llm import LLM

    if on_thread:
        from specdec.server.async_engine import ThreadedEngine

        llm = LLM(**llm_args)
        logging.getLogger(__name__).info("serving %s", llm.describe())
        return ThreadedEngine(llm)
    from specdec.server.engine_process import ProcessEngine

    return ProcessEngine.start(functools.partial(LLM, **llm_args), log_level=log_level)


if __name__ == "__main__":
    sys.exit(main())
