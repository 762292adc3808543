"""Wire-format conversions for the tinker 0.38 protocol (no HTTP, no torch).

The SDK sends ``forward`` / ``forward_backward`` bodies as protobuf
(``tinker.proto.tinker_public_pb2.ForwardBackwardRequest``, optionally zstd-compressed) and
accepts forward/backward results and sampling results only as protobuf
(``ForwardBackwardOutput`` / ``SampleResponse``). Everything else is JSON. This module turns
those messages into plain Python / numpy values for the engine and back, and parses the
``tinker://`` checkpoint URIs the server hands out.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from .datatypes import MediaChunk


class BodyTooLarge(ValueError):
    """A request body that decompresses to more than the server accepts."""


class ProtocolError(ValueError):
    """A request that does not follow the wire protocol (user error, category "user")."""


# ---------------------------------------------------------------------------------------------
# Datums
# ---------------------------------------------------------------------------------------------


@dataclass
class WireDatum:
    """Fallback engine datum, field-compatible with ``tinker_local.engine.Datum``.

    tokens: model input, flattened token ids (N,).
    inputs: loss_fn_inputs by name, numpy arrays (e.g. ``target_tokens`` int64 (N,),
        ``weights`` float32 (N,) or (N, K)).
    """

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    chunks: list[Any] | None = None


_PB_TO_NUMPY: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}


def tensor_from_proto(msg: pb.Tensor, *, name: str = "tensor") -> np.ndarray:
    """Decode a protobuf ``Tensor`` (dense or sparse CSR) into a dense numpy array.

    float32 / int32 / int64 / bfloat16 (widened to float32) are accepted; int32 is widened to
    int64. A sparse CSR tensor is densified with zeros in unlisted cells.
    Raises ProtocolError naming ``name`` on an unknown dtype or inconsistent sizes.
    """
    shape = [int(s) for s in msg.shape]
    if msg.dtype == pb.DTYPE_BFLOAT16:

        def decode(raw: bytes) -> np.ndarray:
            return (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif msg.dtype in _PB_TO_NUMPY:
        np_dtype = _PB_TO_NUMPY[msg.dtype]

        def decode(raw: bytes) -> np.ndarray:
            return np.frombuffer(raw, dtype=np_dtype)
    else:
        raise ProtocolError(f"loss_fn_inputs[{name!r}]: unsupported tensor dtype {msg.dtype}")
    try:
        if msg.HasField("sparse_csr"):
            if len(shape) != 2:
                raise ProtocolError(f"loss_fn_inputs[{name!r}]: sparse CSR needs a 2-D shape, got {shape}")
            values = decode(msg.sparse_csr.values)
            crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
            col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
            dense = np.zeros(shape, dtype=values.dtype)
            rows = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
            dense[rows, col] = values
            arr = dense
        else:
            arr = decode(msg.dense)
            if shape:
                arr = arr.reshape(shape)
    except ValueError as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(f"loss_fn_inputs[{name!r}]: data does not match shape {shape}: {e}") from e
    if arr.dtype == np.int32:
        arr = arr.astype(np.int64)
    return np.array(arr)  # writable copy


def datums_from_proto(msg: pb.ForwardBackwardRequest, datum_cls: type = WireDatum) -> list[Any]:
    """Convert the datums of a ``ForwardBackwardRequest`` to ``datum_cls(tokens=, inputs=)``.

    A datum with image or DMel chunks also gets ``chunks=`` (token lists and
    ``tinker_local.datatypes.MediaChunk`` s in order; ``tokens`` then holds its text tokens only).
    Raises ProtocolError naming the datum index for an empty or unknown chunk.
    """
    out = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        chunks: list[Any] = []
        for j, chunk in enumerate(d.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind == "encoded_text":
                run = np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
                tokens.extend(run)
                chunks.append(run)
            elif kind == "image":
                im = chunk.image
                chunks.append(
                    MediaChunk(
                        "image",
                        data=bytes(im.data),
                        format=im.format or None,
                        expected_tokens=int(im.expected_tokens) if im.HasField("expected_tokens") else None,
                    )
                )
            elif kind == "dmel":
                chunks.append(MediaChunk("dmel", data=bytes(chunk.dmel.dmel)))
            else:
                raise ProtocolError(f"datum {i}: model_input chunk {j} has no content (type {kind!r})")
        inputs = {name: tensor_from_proto(t, name=name) for name, t in d.loss_fn_inputs.items()}
        media = any(isinstance(c, MediaChunk) for c in chunks)
        out.append(
            datum_cls(tokens=tokens, inputs=inputs, chunks=chunks) if media else datum_cls(tokens=tokens, inputs=inputs)
        )
    return out


def count_tokens(msg: pb.ForwardBackwardRequest) -> int:
    """Model-input tokens of a ``ForwardBackwardRequest``: text tokens, and media chunks by their
    ``expected_tokens`` (0 when not given), without decoding the datums."""
    n = 0
    for d in msg.data:
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind == "encoded_text":
                n += len(chunk.encoded_text.tokens) // 4
            elif kind == "image" and chunk.image.HasField("expected_tokens"):
                n += int(chunk.image.expected_tokens)
    return n


def loss_fn_config_from_proto(msg: pb.ForwardBackwardRequest) -> dict[str, float | str] | None:
    """The loss config: ``loss_fn_config_v2`` when set, else the legacy float map; None if empty."""
    if len(msg.loss_fn_config_v2):
        cfg: dict[str, float | str] = {}
        for k, v in msg.loss_fn_config_v2.items():
            cfg[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
        return cfg
    if len(msg.loss_fn_config):
        return {k: float(v) for k, v in msg.loss_fn_config.items()}
    return None


def parse_forward_backward(
    body: bytes, content_encoding: str | None, max_bytes: int = 1 << 31
) -> pb.ForwardBackwardRequest:
    """Parse (and zstd-decompress when ``Content-Encoding: zstd``) a forward/backward body.
    Raises ProtocolError for a malformed body, ``BodyTooLarge`` when it decompresses to more than
    ``max_bytes`` (read in a stream: a frame's declared size is not trusted)."""
    if content_encoding and "zstd" in content_encoding.lower():
        import io

        import zstandard

        try:
            parts, size = [], 0
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
                while size <= max_bytes:
                    part = reader.read(min(1 << 20, max_bytes + 1 - size))
                    if not part:
                        break
                    parts.append(part)
                    size += len(part)
            body = b"".join(parts)
        except zstandard.ZstdError as e:
            raise ProtocolError(f"forward_backward body: bad zstd data: {e}") from e
        if len(body) > max_bytes:
            raise BodyTooLarge(f"forward_backward body decompresses to more than {max_bytes} bytes")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # google.protobuf.message.DecodeError
        raise ProtocolError(f"forward_backward body is not a ForwardBackwardRequest protobuf: {e}") from e
    return msg


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


def _np_to_pb_dtype(arr: np.ndarray) -> tuple[np.ndarray, int]:
    if np.issubdtype(arr.dtype, np.floating):
        return arr.astype(np.float32, copy=False), pb.DTYPE_FLOAT32
    if np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
        return arr.astype(np.int64, copy=False), pb.DTYPE_INT64
    raise ValueError(f"cannot encode array of dtype {arr.dtype}")


def forward_backward_output_to_proto(outputs: Sequence[dict[str, Any]], metrics: dict[str, float]) -> bytes:
    """Encode per-datum outputs + metrics as a serialized ``ForwardBackwardOutput``.

    outputs[i] maps field name -> array (N_i, *trailing); consecutive datums sharing the same
    field names, dtypes and trailing shapes go into one ``ArrayRecord`` (byte offsets per datum).
    Metric keys must look like ``name:reduction``; a key without ':' gets ':sum' appended
    (the SDK crashes on keys without a reduction).
    """
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k if ":" in k else f"{k}:sum"] = float(v)

    prepared = []
    for out in outputs:
        fields = {}
        for name, value in out.items():
            arr, dt = _np_to_pb_dtype(np.asarray(value))
            if arr.ndim == 0:
                arr = arr.reshape(1)
            fields[name] = (np.ascontiguousarray(arr), dt)
        sig = tuple(sorted((n, dt, a.shape[1:]) for n, (a, dt) in fields.items()))
        prepared.append((sig, fields))

    start = 0
    while start < len(prepared):
        end = start
        while end < len(prepared) and prepared[end][0] == prepared[start][0]:
            end += 1
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=end - start)
        for name, (_, dt) in prepared[start][1].items():
            arrays = [prepared[j][1][name][0] for j in range(start, end)]
            offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
            bt = record.fields[name]
            bt.data = b"".join(a.tobytes() for a in arrays)
            bt.offsets = offsets.tobytes()
            bt.dtype = dt
            bt.trailing_shape.extend(int(s) for s in arrays[0].shape[1:])
        start = end
    return msg.SerializeToString()


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


# ---------------------------------------------------------------------------------------------
# JSON helpers
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# tinker:// paths
# ---------------------------------------------------------------------------------------------

_NAME_RE = re.compile(r"^[A-Za-z0-9._\-]+$")
KIND_SEGMENT = {"state": "weights", "sampler": "sampler_weights", "external": "external_weights"}
SEGMENT_KIND = {v: k for k, v in KIND_SEGMENT.items()}


@dataclass(frozen=True)
class TinkerPath:
    """``tinker://<model_id>/<segment>/<name>`` with segment ``weights``, ``sampler_weights`` or
    ``external_weights`` (PEFT export of ``save_weights_external``)."""

    model_id: str
    kind: str  # "state" | "sampler" | "external"
    name: str

    @property
    def uri(self) -> str:
        return f"tinker://{self.model_id}/{KIND_SEGMENT[self.kind]}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{KIND_SEGMENT[self.kind]}/{self.name}"


def parse_tinker_path(uri: str) -> TinkerPath:
    """Parse a checkpoint URI; raises ProtocolError with the accepted form on anything else."""
    if not isinstance(uri, str) or not uri.startswith("tinker://"):
        raise ProtocolError(f"checkpoint path must start with 'tinker://', got {uri!r}")
    parts = uri[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in SEGMENT_KIND or not parts[0] or not parts[2]:
        raise ProtocolError(
            f"checkpoint path {uri!r} is not of the form tinker://<model_id>/weights/<name>, "
            "tinker://<model_id>/sampler_weights/<name> or tinker://<model_id>/external_weights/<name>"
        )
    return TinkerPath(parts[0], SEGMENT_KIND[parts[1]], parts[2])


def check_checkpoint_name(name: Any) -> str:
    """Validate a checkpoint name (letters, digits, '.', '_', '-'; not '.' or '..')."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise ProtocolError(f"checkpoint name {name!r} is invalid: use letters, digits, '.', '_' and '-' only")
    return name


def engine_id(model_id: str) -> str:
    """The engine's id for a wire model id: ':' (from the SDK's ``<session>:train:<n>`` form)
    becomes '.', since engine ids name folders (root/checkpoints/<engine id>/...)."""
    return model_id.replace(":", ".")


def sequence_ids(request_id: str, n: int) -> list[str]:
    """One sequence id per requested sample, stable for a request id."""
    return [f"{request_id}:{i}" for i in range(n)]


def as_str_dict(meta: dict[str, Any] | None) -> dict[str, str] | None:
    """user_metadata as the REST types want it (dict[str, str])."""
    if meta is None:
        return None
    return {str(k): str(v) for k, v in meta.items()}
