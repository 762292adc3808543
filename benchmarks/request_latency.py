"""Fixed cost of a request through the tinker SDK to ``tinker_local``, side by side with its compute.

For a one-token ``forward`` and for a ``forward_backward`` + ``optim_step`` pair of one token, each
request is timed on the client (submit to ``result()``), and the server's own timeline of the same
requests (``RestClient.export_session_trace``: each request's ``run_ms``, the time the engine
computed it) gives the compute. The fixed cost is client time minus compute; medians are reported.

Also timed, to find where the time goes: a bare HTTP round trip to the server (``/api/v1/healthz``
with the SDK's own httpx client settings), and the same engine calls made in-process (no HTTP, no
SDK), which bounds what the server adds outside compute.

    python benchmarks/request_latency.py                 # 200 requests of each kind
    python benchmarks/request_latency.py --n 500 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tinker_local_common import API_KEY, ServerProcess, build_model_dir, run_seconds, session_trace  # noqa: E402


def _median_ms(xs: list[float]) -> float:
    return round(1000 * statistics.median(xs), 3)


def _datum(tinker, n_tokens: int):
    return tinker.Datum(model_input=tinker.ModelInput.from_ints([5] * n_tokens),
                        loss_fn_inputs={"target_tokens": [6] * n_tokens, "weights": [1.0] * n_tokens})


def measure(base_url: str, model: str, n: int, warmup: int) -> dict:
    import httpx
    import tinker

    service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    tc = service.create_lora_training_client(base_model=model, rank=8).result()
    datum = [_datum(tinker, 1)]
    adam = tinker.AdamParams(learning_rate=1e-4)

    with httpx.Client(base_url=base_url, headers={"X-API-Key": API_KEY}) as http:
        for _ in range(warmup):
            http.get("/api/v1/healthz")
        t_http = []
        for _ in range(n):
            t0 = time.perf_counter()
            http.get("/api/v1/healthz")
            t_http.append(time.perf_counter() - t0)

    for _ in range(warmup):
        tc.forward(datum, "cross_entropy").result()
        tc.forward_backward(datum, "cross_entropy").result()
        tc.optim_step(adam).result()
    t_fwd, t_pair = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        tc.forward(datum, "cross_entropy").result()
        t_fwd.append(time.perf_counter() - t0)
    for _ in range(n):
        t0 = time.perf_counter()
        fb = tc.forward_backward(datum, "cross_entropy")
        op = tc.optim_step(adam)
        fb.result()
        op.result()
        t_pair.append(time.perf_counter() - t0)

    trace = session_trace(base_url, tc)
    compute = run_seconds(trace)
    fwd_c = compute.get("forward", [])[-n:]
    fb_c = compute.get("forward_backward", [])[-n:]
    op_c = compute.get("optim_step", [])[-n:]
    out = {
        "n": n,
        "http_roundtrip_ms": _median_ms(t_http),
        "forward_total_ms": _median_ms(t_fwd),
        "pair_total_ms": _median_ms(t_pair),
    }
    if fwd_c:
        out["forward_compute_ms"] = _median_ms(fwd_c)
        out["forward_fixed_ms"] = _median_ms([a - b for a, b in zip(t_fwd, fwd_c, strict=True)])
    if fb_c and op_c:
        pair_c = [a + b for a, b in zip(fb_c, op_c, strict=True)]
        out["pair_compute_ms"] = _median_ms(pair_c)
        out["pair_fixed_ms"] = _median_ms([a - b for a, b in zip(t_pair, pair_c, strict=True)])
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200, help="requests of each kind")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="server torch threads")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="latency-"))
    model = build_model_dir(work / "model")
    server = ServerProcess(model, work / "server", threads=args.threads)
    try:
        out = measure(server.base_url, str(model), args.n, args.warmup)
    finally:
        server.stop()
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
