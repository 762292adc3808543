"""``prefect-tinker capture serve``: run the OpenAI-compatible capture endpoint.

Example::

    prefect-tinker capture serve --model tiny --store ~/pt-store --port 8100
    # any OpenAI client:  OpenAI(base_url="http://127.0.0.1:8100/v1", api_key="unused")
    # tagged:             base_url="http://127.0.0.1:8100/r/agent-a/v1"

``--model alias:LINE@ALIAS`` serves what that alias of a model line holds (the model registry of
the training store at ``--registry-store``, default the ``--store`` root), checked again every
``--follow-seconds``: after a promotion or a rollback the new weights answer the next requests,
while requests in flight finish on the old ones. Clients rate a returned sequence with ``POST
/v1/feedback`` (``{"id": <completion id>, "rating": "good"}``), stored in ``ratings``.

Backends as in the flows' ``backend`` config: ``--credentials-block NAME`` (a saved
``TinkerCredentials``), else ``--base-url URL`` (API key from ``TINKER_API_KEY``), else the
embedded local server (``--local-root``). The store is ``--store ROOT`` (a folder or
``s3://bucket/prefix``, S3 credentials from the AWS_* variables) or ``--store-block NAME`` (a saved
``CaptureStore``); it is checked before the server binds.

Security: bound to anything but loopback, the server refuses to start without a bearer token
(``--token-file F``, first line, or ``$PREFECT_TINKER_CAPTURE_TOKEN``); tokens never go on the
command line, in logs or in the store. The parser is registered in ``cli/main.py`` through
:func:`add_parser`. Exit status: 0 after a clean shutdown, 2 for bad usage (refused bind, bad
options), 1 when the backend or the store cannot be reached.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import secrets
import signal
import socket
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["TOKEN_ENV", "add_parser", "default_session_id", "is_loopback", "read_token", "run"]

TOKEN_ENV = "PREFECT_TINKER_CAPTURE_TOKEN"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

logger = logging.getLogger("prefect_tinker.capture")


class _UsageError(Exception):
    pass


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address (127.0.0.0/8, ::1).
    ``0.0.0.0``, ``::`` and names that resolve elsewhere (or not at all) are not."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def read_token(token_file: str | None) -> str | None:
    """The bearer token: the first line of ``token_file``, else ``$PREFECT_TINKER_CAPTURE_TOKEN``,
    else None.

    Raises:
        _UsageError: the file cannot be read or its first line is empty or shorter than 16 characters.
    """
    if token_file:
        try:
            lines = Path(token_file).expanduser().read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise _UsageError(f"--token-file {token_file}: {exc.strerror or exc}") from None
        token = lines[0].strip() if lines else ""
        where = f"--token-file {token_file}"
    else:
        token = (os.environ.get(TOKEN_ENV) or "").strip()
        where = f"${TOKEN_ENV}"
        if not token:
            return None
    if len(token) < 16:
        raise _UsageError(
            f"{where}: the token must be at least 16 characters (e.g. `python -c "
            '"import secrets; print(secrets.token_urlsafe(32))"`)'
        )
    return token


def default_session_id() -> str:
    """``capture-<UTC time>-<4 hex>``, e.g. ``capture-20250101-120000-3fa2``."""
    return f"capture-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _credentials(args: argparse.Namespace) -> Any:
    from tinker_blocks import TinkerCredentials

    if args.credentials_block:
        return TinkerCredentials.load(args.credentials_block)
    if args.base_url:
        return TinkerCredentials(base_url=args.base_url, api_key=os.environ.get("TINKER_API_KEY"))
    return TinkerCredentials(local=True, local_root=args.local_root)


def _store(args: argparse.Namespace) -> Any:
    from tinker_blocks import CaptureStore

    if args.store_block:
        return CaptureStore.load(args.store_block)
    return CaptureStore(root=os.path.expanduser(args.store))


def _follower(args: argparse.Namespace, store: Any, open_model: Any) -> Any:
    """The :class:`~prefect_tinker.capture.follow.ModelFollower` of ``--model alias:...`` (or
    ``run:...``): resolved through the registry store, served under the reference's own name."""
    from prefect_tinker.capture.follow import ModelFollower
    from tinker_blocks.model_registry import resolve_weights
    from tinker_blocks.stores import TrainingStore

    registry = TrainingStore(root=os.path.expanduser(args.registry_store or store.root))
    names = (args.model, *(args.served_model_name or ()))
    return ModelFollower(
        lambda: resolve_weights(registry, args.model, "--model").checkpoint,
        lambda checkpoint: open_model(checkpoint, names),
        refresh_s=args.follow_seconds,
    )


def run(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM (then flush the captures and exit 0)."""
    import uvicorn

    from prefect_tinker.capture.app import create_app
    from prefect_tinker.capture.model import open_served_model
    from prefect_tinker.capture.recorder import CaptureRecorder
    from tinker_blocks.model_registry import is_weights_ref
    from tinker_blocks.store_schemas import StoreError, validate_run_id

    try:
        if bool(args.store) == bool(args.store_block):
            raise _UsageError("give exactly one of --store ROOT and --store-block NAME")
        token = read_token(args.token_file)
        if token is None and not is_loopback(args.host):
            raise _UsageError(
                f"refusing to bind {args.host!r} without a bearer token: anything but loopback "
                f"needs --token-file FILE (or ${TOKEN_ENV})"
            )
        session = args.session or default_session_id()
        try:
            validate_run_id(session)
        except StoreError as exc:
            raise _UsageError(f"--session: {exc}") from None
        if args.flush_seconds <= 0 or args.flush_rows < 1:
            raise _UsageError("--flush-seconds must be > 0 and --flush-rows >= 1")
        if args.follow_seconds <= 0:
            raise _UsageError("--follow-seconds must be > 0")
    except _UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        store = _store(args)
        store.check()
        credentials = _credentials(args)

        def open_model(model: str, names: tuple[str, ...] = tuple(args.served_model_name or ())) -> Any:
            return open_served_model(
                credentials,
                model,
                renderer=args.renderer,
                tokenizer=args.tokenizer,
                names=names,
                max_context=args.max_context,
                default_max_tokens=args.default_max_tokens,
            )

        served = _follower(args, store, open_model) if is_weights_ref(args.model) else open_model(args.model)
    except Exception as exc:
        print(f"error: cannot start the capture server: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    recorder = CaptureRecorder(
        store, flush_seconds=args.flush_seconds, flush_rows=args.flush_rows, writer_id=f"capture_{os.getpid()}"
    )
    ratings = CaptureRecorder(
        store,
        flush_seconds=args.flush_seconds,
        flush_rows=args.flush_rows,
        writer_id=f"rating_{os.getpid()}",
        table="ratings",
    )
    app = create_app(served, recorder, session_id=session, token=token, ratings=ratings)
    now = served.current()
    print(
        f"capture server on http://{args.host}:{args.port}/v1 (session {session}, model "
        f"{', '.join(now.names)} = {now.checkpoint}, renderer {now.renderer.name}, store {store.root}, "
        f"flush every {args.flush_seconds:g} s, auth {'bearer token' if token else 'none (loopback)'})",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, access_log=False, timeout_graceful_shutdown=30
    )
    # uvicorn shuts down gracefully on SIGINT/SIGTERM (the app's lifespan flushes the recorder),
    # then re-raises the signal to the handler it found: make that one a no-op, so a requested
    # shutdown exits 0 instead of dying by the signal.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(config).run()
    finally:
        recorder.close()
        ratings.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return EXIT_OK


def add_parser(sub: Any) -> None:
    """Register ``capture serve`` on the ``prefect-tinker`` subparsers ``sub``."""
    cap = sub.add_parser("capture", help="OpenAI-compatible endpoint recording every sample (capture serve --help)")
    csub = cap.add_subparsers(dest="capture_command", metavar="COMMAND", required=True)
    s = csub.add_parser(
        "serve",
        help="serve a model over the OpenAI API and record to the capture store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument(
        "--model",
        required=True,
        help="base model (tiny, a HF id or directory), a tinker:// sampler path, or alias:LINE@ALIAS / run:RUN "
        "(followed: re-resolved every --follow-seconds)",
    )
    s.add_argument(
        "--served-model-name",
        action="append",
        metavar="NAME",
        help="name clients use in 'model' (repeatable; the --model value is always accepted)",
    )
    s.add_argument("--store", metavar="ROOT", help="capture store root: a folder or s3://bucket/prefix")
    s.add_argument("--store-block", metavar="NAME", help="a saved CaptureStore block instead of --store")
    s.add_argument("--session", help="capture session id, the run_id of the rows (default capture-<time>-<hex>)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; others need a token)")
    s.add_argument("--port", type=int, default=8100)
    s.add_argument("--renderer", default="auto", help="renderer name or auto (default)")
    s.add_argument("--tokenizer", help="tokenizer directory or id, when the sampler's cannot be loaded")
    s.add_argument("--token-file", metavar="FILE", help=f"bearer token file (first line); else ${TOKEN_ENV}")
    s.add_argument("--base-url", help="a Tinker-compatible server (API key from TINKER_API_KEY)")
    s.add_argument("--credentials-block", metavar="NAME", help="a saved TinkerCredentials block")
    s.add_argument("--local-root", help="folder of the embedded local server (default ~/.prefect-tinker)")
    s.add_argument("--flush-seconds", type=float, default=5.0, help="most seconds a row waits in memory (default 5)")
    s.add_argument("--flush-rows", type=int, default=500, help="rows that trigger a flush (default 500)")
    s.add_argument("--max-context", type=int, help="context length override (tokens)")
    s.add_argument(
        "--registry-store",
        metavar="ROOT",
        help="training store whose model registry resolves --model alias:... (default: the --store root)",
    )
    s.add_argument(
        "--follow-seconds",
        type=float,
        default=10.0,
        help="seconds between two resolutions of --model alias:... (default 10)",
    )
    s.add_argument("--default-max-tokens", type=int, default=4096, help="max_tokens when a request sets none")
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=run)
