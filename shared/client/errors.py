"""What a failed call says about the request's fields: the `google.rpc.BadRequest` field violations the
servers attach to INVALID_ARGUMENT (in the `grpc-status-details-bin` trailer), read back for callers."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

__all__ = ["FieldViolation", "field_violations"]


@dataclass(frozen=True)
class FieldViolation:
    field: str  # a path into the request, e.g. "sampling.top_p" or "token_ids.ids[3]"
    description: str


def field_violations(err: grpc.RpcError) -> list[FieldViolation]:
    """The BadRequest field violations an RpcError (sync or aio) carries; [] when it has none."""
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]  # RpcErrors are also Calls
    except (AttributeError, ValueError):
        return []
    out: list[FieldViolation] = []
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out.extend(FieldViolation(v.field, v.description) for v in bad.field_violations)
    return out
