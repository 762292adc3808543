"""Wire-format conversions for the tinker 0.38 protocol (no HTTP, no torch).

The SDK sends ``forward`` / ``forward_backward`` bodies as protobuf
(``tinker.proto.tinker_public_pb2.ForwardBackwardRequest``, optionally zstd-compressed) and
accepts forward/backward results and sampling results only as protobuf
(``ForwardBackwardOutput`` / ``SampleResponse``). Everything else is JSON. This module holds the
protocol's errors and the training side: it turns ``ForwardBackwardRequest`` bodies into plain
Python / numpy values for the engine and its results back into ``ForwardBackwardOutput``.
The sampling side: ``tinker_local.protocol_sampling``; ``tinker://`` paths:
``tinker_local.tinker_paths``.
"""

from __future__ import annotations

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


def as_str_dict(meta: dict[str, Any] | None) -> dict[str, str] | None:
    """user_metadata as the REST types want it (dict[str, str])."""
    if meta is None:
        return None
    return {str(k): str(v) for k, v in meta.items()}
