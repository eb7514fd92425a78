"""Rich gRPC errors: `google.rpc.BadRequest` field violations in a status.

The server turns an `InvalidRequest` into INVALID_ARGUMENT whose details carry every violation
(grpcio-status packs them in the `grpc-status-details-bin` trailer); clients read them back with
`shared.client.errors.field_violations`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

__all__ = ["FieldViolation", "InvalidRequest", "status_with_violations"]


@dataclass(frozen=True)
class FieldViolation:
    field: str  # a path into the request, e.g. "sampling.top_p" or "token_ids.ids[3]"
    description: str


class InvalidRequest(ValueError):
    """A request with one or more bad fields; carries all of them, not just the first."""

    def __init__(self, violations: Sequence[FieldViolation]) -> None:
        if not violations:
            raise ValueError("InvalidRequest needs at least one violation")
        self.violations = tuple(violations)
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in self.violations))

    def to_status(self) -> grpc.Status:
        return status_with_violations(str(self), self.violations)


def status_with_violations(message: str, violations: Sequence[FieldViolation]) -> grpc.Status:
    bad = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
            for v in violations
        ]
    )
    detail = any_pb2.Any()
    detail.Pack(bad)
    status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=message, details=[detail])
    return rpc_status.to_status(status)
