"""Command line of ``tinker_local``.

    python -m tinker_local serve --model tiny [--model M2] --port 8000 --host 127.0.0.1 \
        --root ~/.prefect-tinker [--dtype auto|float32|bfloat16] [--device cpu|cuda] \
        [--fail-every N] [--drop-every M] [--threads T] [--sampler-workers N] \
        [--tls-cert CERT.pem --tls-key KEY.pem] [--max-models-per-user N] \
        [--max-queued-per-user N] [--max-checkpoint-bytes-per-user B] \
        [--compute-seconds-per-user-hour S] [--max-base-model-bytes B] \
        [--max-body-bytes B] [--max-datums-per-request N] [--max-tokens-per-request N] \
        [--max-num-samples N] [--max-sample-tokens N] \
        [--loss-max-nodes N] [--loss-max-elements N] [--loss-time-budget S] \
        [--record-requests DIR] [--sampling-seed request|content] [--lora-seed N]

    python -m tinker_local status [--root DIR]    the server recorded in DIR/server.json (exit 1: none)
    python -m tinker_local stop [--root DIR]      stop it: SIGTERM, SIGKILL after 5 s; remove the record
    python -m tinker_local keys add NAME [--admin] [--root DIR]   print a new API key of user NAME once
    python -m tinker_local keys list [--root DIR]                  users, creation times, admin flags
    python -m tinker_local keys revoke NAME [--root DIR]           delete NAME's key (next request: 401)
    python -m tinker_local models allow NAME|PATH [--root DIR]     let a served server with keys load it
    python -m tinker_local models deny NAME [--root DIR]           take it off the allow-list
    python -m tinker_local models list [--root DIR]                the allow-list

A server on a non-loopback ``--host`` needs at least one key (``tinker_local.keys``); with keys,
every caller must present one, loopback callers included, and only the base models of ``--model``
and of the allow-list (``tinker_local.allowed_models``) may be loaded.

``status``/``stop`` act on the server that flows start in embedded-local mode
(``TinkerCredentials(local=True)``, recorded in ``<local_root>/server.json``).
``main(argv, prog="prefect-tinker local")`` is what ``prefect-tinker local ...`` calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from .launcher import default_root, healthy, read_record, stop_server
from .loss_limits import GraphLimits
from .procs import pid_alive
from .request_limits import RequestLimits

DTYPES = {"auto": "auto", "fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}


def build_parser(prog: str = "python -m tinker_local") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Local Tinker-compatible server.")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the Tinker API on host:port")
    s.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="M",
        help="base model to preload (repeatable): 'tiny', 'smollm2', an HF id or a "
        "local HF model directory; others load lazily on create_model",
    )
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    s.add_argument(
        "--root",
        type=Path,
        default=None,
        help="folder for checkpoints, model cache and registry (default $PREFECT_TINKER_HOME or ~/.prefect-tinker)",
    )
    s.add_argument(
        "--dtype",
        default="auto",
        choices=sorted(DTYPES),
        help="training/forward compute dtype (default auto: bf16 autocast where the "
        "CPU/GPU supports it, else fp32); sampling always runs in fp32",
    )
    s.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    s.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads in all, trainer plus sampler workers (default: all cores)",
    )
    s.add_argument(
        "--sampler-workers",
        type=int,
        default=0,
        metavar="N",
        help="run sampling in N worker processes apart from the trainer, so sampling "
        "and training overlap (default 0: one engine serves both in turn); "
        "each worker gets --threads // (N + 1) torch threads, the trainer the rest",
    )
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument(
        "--fail-every",
        type=int,
        default=None,
        metavar="N",
        help="fault injection: answer every N-th API request with HTTP 503 "
        "(default $TINKER_LOCAL_FAIL_EVERY or 0 = off)",
    )
    s.add_argument(
        "--drop-every",
        type=int,
        default=None,
        metavar="M",
        help="fault injection: run every M-th API request, then drop its connection "
        "before the response body (default $TINKER_LOCAL_DROP_EVERY or 0 = off)",
    )
    s.add_argument(
        "--client-side-custom-losses",
        action="store_true",
        help="do not run uploaded custom losses here: the SDK then runs "
        "create_custom_loss losses client-side (a forward plus a forward_backward)",
    )
    s.add_argument(
        "--jwt-auth",
        action="store_true",
        help="exchange API keys for short-lived JWTs (client config pjwt_auth_enabled); RestClient.whoami() needs it",
    )
    s.add_argument(
        "--tls-cert",
        type=Path,
        default=None,
        metavar="PEM",
        help="serve HTTPS with this certificate (chain) file; needs --tls-key",
    )
    s.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="private key of --tls-cert")
    s.add_argument(
        "--max-models-per-user",
        type=int,
        default=None,
        metavar="N",
        help="live training models a user may hold (default: no limit; over it: 403)",
    )
    s.add_argument(
        "--max-queued-per-user",
        type=int,
        default=None,
        metavar="N",
        help="requests a user may have queued or running (default: no limit; over it: 429)",
    )
    s.add_argument(
        "--max-checkpoint-bytes-per-user",
        type=int,
        default=None,
        metavar="BYTES",
        help="checkpoint bytes a user may store; saves beyond it are refused (403)",
    )
    s.add_argument(
        "--record-requests",
        type=Path,
        default=None,
        metavar="DIR",
        help="write every request's full payload (datums, loss inputs, Adam parameters, sampling requests and their "
        "results) to DIR/<session id>.jsonl (tinker_local.request_log; for request-by-request comparisons)",
    )
    s.add_argument(
        "--sampling-seed",
        default="request",
        choices=["request", "content"],
        help="request (default): a sample request's own seed, random when it gives none; content: each sequence's "
        "seed derived from what the request asks (prompt, parameters, weights) and how often the session asked it "
        "before, so identical requests get identical completions whatever seed they pass (each sequence drawn alone, "
        "a batch of one: slower, but batch-invariant)",
    )
    s.add_argument(
        "--lora-seed",
        type=int,
        default=None,
        metavar="N",
        help="initialise a LoRA adapter created without a seed from N (default: a random seed)",
    )
    s.add_argument(
        "--compute-seconds-per-user-hour",
        type=float,
        default=None,
        metavar="S",
        help="compute seconds (trainer and sampler workers) a user may use per rolling hour "
        "(default: no limit; over it: 429 with Retry-After)",
    )
    s.add_argument(
        "--max-base-model-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="bytes of base-model weights kept loaded; the least recently used are unloaded "
        "(their adapters parked) to load another (default: half the device's memory)",
    )
    limits = RequestLimits()
    _add_limit_flags(
        s,
        [
            ("--max-body-bytes", limits.body_bytes, "N", "bytes of a request body, decompressed too"),
            ("--max-datums-per-request", limits.datums, "N", "datums of a forward / forward_backward"),
            (
                "--max-tokens-per-request",
                limits.tokens,
                "N",
                "tokens of a request (sampling: prompt + samples x max_tokens)",
            ),
            ("--max-num-samples", limits.num_samples, "N", "num_samples of a sampling request"),
            ("--max-sample-tokens", limits.sample_tokens, "N", "max_tokens of a sampling request"),
        ],
        over="; over it: 413",
    )
    graph = GraphLimits()
    _add_limit_flags(
        s,
        [
            ("--loss-max-nodes", graph.max_nodes, "N", "nodes of an uploaded custom loss"),
            ("--loss-max-elements", graph.max_elements, "N", "elements of any one intermediate of a custom loss"),
            ("--loss-time-budget", graph.time_budget_s, "S", "seconds of custom-loss evaluation per request"),
        ],
    )
    k = sub.add_parser("keys", help="API keys of a shared server (stored hashed in ROOT/server/api_keys.json)")
    k.add_argument(
        "--root",
        type=Path,
        default=None,
        help="the server's folder (default $PREFECT_TINKER_HOME or ~/.prefect-tinker)",
    )
    ksub = k.add_subparsers(dest="keys_command", required=True)
    add = ksub.add_parser("add", help="create the key of user NAME and print it (shown only this once)")
    add.add_argument("name")
    add.add_argument("--admin", action="store_true", help="the key may read the audit log")
    ksub.add_parser("list", help="list the users that hold keys (never the keys)")
    rev = ksub.add_parser("revoke", help="delete the key of user NAME")
    rev.add_argument("name")
    m = sub.add_parser(
        "models", help="base models a served server with keys may load (ROOT/server/allowed_models.json)"
    )
    m.add_argument(
        "--root",
        type=Path,
        default=None,
        help="the server's folder (default $PREFECT_TINKER_HOME or ~/.prefect-tinker)",
    )
    msub = m.add_subparsers(dest="models_command", required=True)
    allow = msub.add_parser("allow", help="allow base model NAME (preset, hub id in the local cache, or folder)")
    allow.add_argument("name")
    deny = msub.add_parser("deny", help="take base model NAME off the allow-list")
    deny.add_argument("name")
    msub.add_parser("list", help="list the allowed base models")
    for name, text in (
        ("status", "show the server recorded in ROOT/server.json (exit 1 when none runs)"),
        ("stop", "stop the server recorded in ROOT/server.json (SIGTERM, SIGKILL after 5 s)"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument(
            "--root",
            type=Path,
            default=None,
            help="the server's folder (local_root; default $PREFECT_TINKER_HOME or ~/.prefect-tinker)",
        )
    return parser


def _add_limit_flags(
    parser: argparse.ArgumentParser, rows: list[tuple[str, int | float, str, str]], over: str = ""
) -> None:
    """One ``FLAG METAVAR`` option per row ``(flag, default, metavar, text)``, typed like its
    default (int or float); help: ``text (default D<over>)``, a float default written with ``:g``."""
    for flag, default, metavar, text in rows:
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        parser.add_argument(
            flag, type=type(default), default=default, metavar=metavar, help=f"{text} (default {shown}{over})"
        )


def _is_server(record: dict) -> bool:
    """Whether the live pid of ``record`` is still our server (and not a reused pid): it answers
    the health check, or (Linux) its command line runs ``tinker_local``."""
    if healthy(str(record.get("base_url", "")), timeout=2.0):
        return True
    try:
        return b"tinker_local" in Path(f"/proc/{int(record['pid'])}/cmdline").read_bytes()
    except (OSError, KeyError, ValueError):
        return False


def status_or_stop(command: str, root: Path | None) -> int:
    """``status``: print the recorded server (pid, URL, health, log); 0 when it runs, 1 when not.
    ``stop``: stop it (SIGTERM, then SIGKILL after 5 s), remove ``server.json``; 0 either way,
    1 when a recorded live pid is not the server (the record is then left for inspection)."""
    root = (root.expanduser() if root else default_root()).resolve()
    record = read_record(root)
    if not record:
        print(f"no local server recorded in {root / 'server.json'}")
        return 1 if command == "status" else 0
    pid, url = int(record.get("pid", -1)), record.get("base_url", "?")
    alive = pid > 0 and pid_alive(pid)
    if command == "status":
        if not alive:
            print(f"not running: recorded pid {pid} ({url}) is gone; stale {root / 'server.json'}")
            return 1
        health = "healthy" if healthy(url, timeout=2.0) else "NOT answering /api/v1/healthz"
        print(f"running: pid {pid}, {url} ({health}), root {root}, log {record.get('log', '?')}")
        return 0
    if alive and not _is_server(record):
        print(
            f"error: pid {pid} recorded in {root / 'server.json'} does not look like the local "
            "server (no health answer, not tinker_local); not stopping it",
            file=sys.stderr,
        )
        return 1
    stopped = bool((stop_server(root, timeout=5.0) or {}).get("stopped"))
    print(
        f"stopped local server pid {pid} ({url})"
        if stopped
        else f"local server pid {pid} ({url}) was not running; removed its stale record"
    )
    return 0


def keys_command(args: argparse.Namespace) -> int:
    """``keys add|list|revoke``; 0 on success, 2 for a bad or duplicate name / unknown user."""
    from .keys import KeyStore, KeyStoreError

    root = (args.root.expanduser() if args.root else default_root()).resolve()
    store = KeyStore(root)
    try:
        if args.keys_command == "add":
            key = store.add(args.name, admin=args.admin)
            print(key)
            print(
                f"(key of user {args.name!r}{' (admin)' if args.admin else ''}, stored hashed in {store.path}; "
                "it is shown only now)",
                file=sys.stderr,
            )
        elif args.keys_command == "revoke":
            store.revoke(args.name)
            print(f"revoked the key of {args.name!r}")
        else:
            for e in store.entries():
                print(f"{e.name}\tcreated {e.created}{chr(9) + 'admin' if e.admin else ''}")
    except KeyStoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def models_command(args: argparse.Namespace) -> int:
    """``models allow|deny|list``; 0 on success, 2 for a name that does not resolve or is not listed."""
    from .allowed_models import ModelAllowList

    root = (args.root.expanduser() if args.root else default_root()).resolve()
    allowed = ModelAllowList(root)
    try:
        if args.models_command == "allow":
            print(f"allowed base model {allowed.allow(args.name)!r} (in {allowed.path})")
        elif args.models_command == "deny":
            print(f"denied base model {allowed.deny(args.name)!r} (in {allowed.path})")
        else:
            for name, rec in allowed.names().items():
                print(f"{name}\tadded {rec.get('added', '?')}")
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    except ValueError as e:  # UnknownModelError: the name does not resolve to a model
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


def port_unavailable(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (e.g. ``"[Errno 98] Address already in use"``), or None.

    Binds a TCP socket the way uvicorn does (``SO_REUSEADDR``, so a port in ``TIME_WAIT`` counts as
    free) and closes it again; the family follows ``host`` (IPv6 when it contains ``:``)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return str(exc)
    return None


def main(argv: list[str] | None = None, prog: str = "python -m tinker_local") -> int:
    """Parse ``argv`` (without the program name) and run the command; returns an exit code."""
    args = build_parser(prog).parse_args(argv)
    if args.command in ("status", "stop"):
        return status_or_stop(args.command, args.root)
    if args.command == "keys":
        return keys_command(args)
    if args.command == "models":
        return models_command(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        if args.sampler_workers < 0 or (args.threads is not None and args.threads < 1):
            print("error: --sampler-workers must be >= 0 and --threads >= 1", file=sys.stderr)
            return 2
        if not 0 < args.port < 65536:
            print(f"error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
            return 2
        if (args.tls_cert is None) != (args.tls_key is None):
            print("error: --tls-cert and --tls-key go together", file=sys.stderr)
            return 2
        for flag, f in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
            if f is not None and not f.is_file():
                print(f"error: {flag}: no such file {f}", file=sys.stderr)
                return 2
        for flag in (
            "max_models_per_user",
            "max_queued_per_user",
            "max_checkpoint_bytes_per_user",
            "compute_seconds_per_user_hour",
            "max_base_model_bytes",
            "max_body_bytes",
            "max_datums_per_request",
            "max_tokens_per_request",
            "max_num_samples",
            "max_sample_tokens",
            "loss_max_nodes",
            "loss_max_elements",
            "loss_time_budget",
        ):
            least = 0.001 if flag in ("loss_time_budget", "compute_seconds_per_user_hour") else 1
            if getattr(args, flag) is not None and getattr(args, flag) < least:
                print(
                    f"error: --{flag.replace('_', '-')} must be >= {least:g}, got {getattr(args, flag)}",
                    file=sys.stderr,
                )
                return 2
        busy = port_unavailable(args.host, args.port)
        if busy:  # before loading any model (seconds to minutes), not after
            print(
                f"error: cannot listen on {args.host}:{args.port}: {busy} (pick another --port; "
                "'prefect-tinker local status' shows the embedded server)",
                file=sys.stderr,
            )
            return 2
        from .faults import FaultConfig
        from .serve import InsecureBind, serve
        from .tenancy import Limits

        try:
            env = FaultConfig.from_env()
            faults = FaultConfig(
                env.fail_every if args.fail_every is None else args.fail_every,
                env.drop_every if args.drop_every is None else args.drop_every,
            )
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        try:
            serve(
                args.model,
                host=args.host,
                port=args.port,
                root=args.root or default_root(),
                dtype=DTYPES[args.dtype],
                device=args.device,
                num_threads=args.threads,
                log_level=args.log_level,
                faults=faults,
                custom_loss_server_side=not args.client_side_custom_losses,
                jwt_auth=args.jwt_auth,
                sampler_workers=args.sampler_workers,
                tls_cert=args.tls_cert,
                tls_key=args.tls_key,
                limits=Limits(
                    args.max_models_per_user,
                    args.max_queued_per_user,
                    args.max_checkpoint_bytes_per_user,
                    args.compute_seconds_per_user_hour,
                ),
                request_limits=RequestLimits(
                    args.max_body_bytes,
                    args.max_datums_per_request,
                    args.max_tokens_per_request,
                    args.max_num_samples,
                    args.max_sample_tokens,
                ),
                graph_limits=dataclasses.replace(
                    GraphLimits(),
                    max_nodes=args.loss_max_nodes,
                    max_elements=args.loss_max_elements,
                    time_budget_s=args.loss_time_budget,
                ),
                max_base_model_bytes=args.max_base_model_bytes,
                record_requests=args.record_requests,
                content_seeds=args.sampling_seed == "content",
                default_lora_seed=args.lora_seed,
            )
        except InsecureBind as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0
