"""Wire-format conversions of the sampling requests of the tinker 0.38 protocol (no HTTP, no torch).

A sampling request is JSON: its prompt (``prompt_from_json``: token ids, or chunks with media),
``SamplingParams.stop`` (``stop_from_json``) and the token ids whose prompt logprobs it asks for
(``target_ids_from_json``).  The SDK accepts the result only as protobuf: ``SampleResponse``
(``sample_response_to_proto``).  Each sample gets a sequence id (``sequence_ids``).  Malformed
input raises ``tinker_local.protocol.ProtocolError``.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from .datatypes import MediaChunk
from .protocol import ProtocolError


def _topk_to_proto(rows: Sequence[Sequence[tuple[int, float]] | None], target: pb.TopkLogprobs) -> None:
    k = max((len(r) for r in rows if r), default=0)
    n = len(rows)
    ids = np.zeros((n, k), dtype=np.int32)
    lps = np.full((n, k), -99999.0, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (tok, lp) in enumerate(row or []):
            ids[i, j] = int(tok)
            lps[i, j] = float(lp)
    target.token_ids = ids.tobytes()
    target.logprobs = lps.tobytes()
    target.k = k
    target.length = n


def _tensor_to_proto(arr: np.ndarray, target: pb.Tensor, csr: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Fill ``target`` with float32 / int64 ``arr``: dense, or sparse CSR with the row pointers and
    column indices ``csr`` (values read from ``arr`` at those cells)."""
    target.dtype = pb.DTYPE_INT64 if arr.dtype.kind in "iu" else pb.DTYPE_FLOAT32
    arr = arr.astype(np.int64 if arr.dtype.kind in "iu" else np.float32)
    target.shape.extend(int(d) for d in arr.shape)
    if csr is None:
        target.dense = arr.tobytes()
        return
    crow, col = csr
    rows = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
    target.sparse_csr.values = arr[rows, col].tobytes()
    target.sparse_csr.crow_indices = crow.astype(np.int64).tobytes()
    target.sparse_csr.col_indices = col.astype(np.int64).tobytes()


def target_ids_from_json(obj: Any, name: str = "target_prompt_logprobs") -> tuple[np.ndarray, Any]:
    """A JSON ``TensorData`` of token ids (dense, or sparse CSR with ``sparse_crow_indices`` /
    ``sparse_col_indices``) -> ``(dense int64 array, (crow, col) | None)``; the cells a CSR tensor
    does not list become -1 ("nothing requested").  Raises ProtocolError naming ``name``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("data"), list):
        raise ProtocolError(f"{name} must be a TensorData object with a 'data' list, got {type(obj).__name__}")
    if obj.get("dtype") != "int64":
        raise ProtocolError(f"{name} must be an int64 tensor of token ids, got dtype {obj.get('dtype')!r}")
    shape = obj.get("shape")
    if not isinstance(shape, list) or len(shape) != 2:
        raise ProtocolError(f"{name} must be 2-D, [len(prompt) - 1, K], got shape {shape!r}")
    try:
        data = np.asarray(obj["data"], dtype=np.int64)
        crow, col = obj.get("sparse_crow_indices"), obj.get("sparse_col_indices")
        if crow is None and col is None:
            return data.reshape(shape), None
        crow, col = np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64)
        if (
            len(crow) != shape[0] + 1
            or len(col) != len(data)
            or crow[-1] != len(data)
            or (col.size and (col.min() < 0 or col.max() >= shape[1]))
        ):
            raise ProtocolError(f"{name}: sparse CSR indices do not match shape {shape} and {len(data)} values")
        dense = np.full(shape, -1, dtype=np.int64)
        dense[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = data
        return dense, (crow, col)
    except (TypeError, ValueError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(f"{name}: data does not match shape {shape}: {e}") from e


def sample_response_to_proto(
    sequences: Sequence[dict[str, Any]],
    prompt_logprobs: Sequence[float | None] | None = None,
    topk_prompt_logprobs: Sequence[Sequence[tuple[int, float]] | None] | None = None,
    prompt_logprobs_last_n: int | None = None,
    *,
    target_prompt_logprobs: np.ndarray | None = None,
    target_csr: tuple[np.ndarray, np.ndarray] | None = None,
    prompt_alt_tokens: tuple[np.ndarray, np.ndarray] | None = None,
    prompt_cache_hit_tokens: int = 0,
) -> bytes:
    """Encode a sampling result as a serialized ``SampleResponse``.

    sequences: dicts with ``tokens`` (list[int]), ``logprobs`` (list[float] or None),
    ``stop_reason`` ("stop" | "length") and optionally ``topk_logprobs`` (one list of
    ``(token_id, logprob)`` per token; sent as ``topk_sampled_logprobs``). prompt_logprobs: one
    entry per prompt token, None (sent as NaN) where not computed. With ``prompt_logprobs_last_n``
    only the last N entries are kept (the rest become NaN / None rows).  ``target_prompt_logprobs``: float32 (P - 1, K),
    sent dense, or as CSR with the request's layout ``target_csr``.  ``prompt_alt_tokens``: (ids,
    logprobs), both (P - 1, k).  ``prompt_cache_hit_tokens``: prompt tokens served from a prefix
    already computed.
    """
    msg = pb.SampleResponse()
    for seq in sequences:
        reason = seq.get("stop_reason", "length")
        if reason not in ("stop", "length"):
            raise ValueError(f"stop_reason must be 'stop' or 'length', got {reason!r}")
        s = msg.sequences.add()
        s.stop_reason = pb.STOP_REASON_STOP if reason == "stop" else pb.STOP_REASON_LENGTH
        s.tokens = np.asarray(list(seq["tokens"]), dtype=np.int32).tobytes()
        if seq.get("logprobs") is not None:
            s.logprobs = np.asarray(list(seq["logprobs"]), dtype=np.float32).tobytes()
        if seq.get("topk_logprobs") is not None:
            _topk_to_proto(list(seq["topk_logprobs"]), s.topk_sampled_logprobs)
    if prompt_logprobs is not None:
        lp = np.array([math.nan if v is None else float(v) for v in prompt_logprobs], dtype=np.float32)
        if prompt_logprobs_last_n is not None:
            lp[: max(0, len(lp) - prompt_logprobs_last_n)] = math.nan
        msg.prompt_logprobs = lp.tobytes()
    if topk_prompt_logprobs is not None:
        rows = list(topk_prompt_logprobs)
        if prompt_logprobs_last_n is not None:
            cut = max(0, len(rows) - prompt_logprobs_last_n)
            rows[:cut] = [None] * cut
        _topk_to_proto(rows, msg.topk_prompt_logprobs)
    if target_prompt_logprobs is not None:
        _tensor_to_proto(np.asarray(target_prompt_logprobs, dtype=np.float32), msg.target_prompt_logprobs, target_csr)
    if prompt_alt_tokens is not None:
        _tensor_to_proto(np.asarray(prompt_alt_tokens[0], dtype=np.int64), msg.prompt_alt_tokens.tokens)
        _tensor_to_proto(np.asarray(prompt_alt_tokens[1], dtype=np.float32), msg.prompt_alt_tokens.logprobs)
    msg.prompt_cache_hit_tokens = int(prompt_cache_hit_tokens)
    return msg.SerializeToString()


def prompt_from_json(prompt: dict[str, Any]) -> list[int] | list[Any]:
    """A JSON ``ModelInput``: its token ids when it is all text, else its chunks in order (token
    lists and ``MediaChunk`` s: ``image`` with base64 ``data``, ``image_asset_pointer`` with a
    ``location``, ``dmel`` with base64 ``dmel``).  ProtocolError names a malformed chunk."""
    chunks: list[Any] = []
    media = False
    for i, chunk in enumerate(prompt.get("chunks") or []):
        if not isinstance(chunk, dict):
            raise ProtocolError(f"prompt chunk {i}: must be an object, got {type(chunk).__name__}")
        kind = chunk.get("type", "encoded_text")
        try:
            if kind == "encoded_text":
                chunks.append([int(t) for t in chunk.get("tokens") or []])
                continue
            media = True
            exp = chunk.get("expected_tokens")
            exp = None if exp is None else int(exp)
            if kind == "image":
                chunks.append(
                    MediaChunk(
                        "image",
                        data=base64.b64decode(chunk.get("data") or ""),
                        format=chunk.get("format"),
                        expected_tokens=exp,
                    )
                )
            elif kind == "image_asset_pointer":
                chunks.append(
                    MediaChunk(
                        "image_asset_pointer",
                        location=str(chunk.get("location") or ""),
                        format=chunk.get("format"),
                        expected_tokens=exp,
                    )
                )
            elif kind == "dmel":
                chunks.append(MediaChunk("dmel", data=base64.b64decode(chunk.get("dmel") or "")))
            else:
                raise ProtocolError(
                    f"prompt chunk {i}: unknown type {kind!r} (encoded_text, image, image_asset_pointer, dmel)"
                )
        except (TypeError, ValueError) as e:
            if isinstance(e, ProtocolError):
                raise
            raise ProtocolError(f"prompt chunk {i} ({kind}): malformed: {e}") from e
    if not media:
        return [t for c in chunks for t in c]
    return chunks


def stop_from_json(stop: Any) -> list[str] | list[int] | None:
    """Normalise ``SamplingParams.stop``: None keeps EOS stopping; a str becomes [str]; [] disables."""
    if stop is None:
        return None
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list):
        if all(isinstance(s, str) for s in stop):
            return list(stop)
        if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
            return [int(s) for s in stop]
    raise ProtocolError(
        f"sampling_params.stop must be a string, a list of strings or a list of token ids; got {stop!r}"
    )


def sequence_ids(request_id: str, n: int) -> list[str]:
    """One sequence id per requested sample, stable for a request id."""
    return [f"{request_id}:{i}" for i in range(n)]
