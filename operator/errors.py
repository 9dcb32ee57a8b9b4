"""The operator's exception tree.

`OperatorError` is the root. Handlers map the branches on purpose: `InvalidSpecError` and
`ChildConflictError` stop processing (kopf.PermanentError, `Ready=False` with the error's reason), an
`ApiError` that `transient` says may pass is retried with backoff (kopf.TemporaryError), and a
`WorkloadUnavailableError` is `Ready=False` with its reason and retried (kopf.TemporaryError).
"""

from __future__ import annotations


class OperatorError(Exception):
    """Root of everything the operator raises on purpose."""

    reason = "OperatorError"


class InvalidSpecError(OperatorError, ValueError):
    """A DecodeService spec that cannot be served; the message names the field."""

    reason = "InvalidSpec"


class InvalidRoutingError(InvalidSpecError):
    """spec.routing and spec.autoscaling that cannot serve together (minReplicas 0 without a router that
    holds requests, or without an autoscaler that starts a replica)."""

    reason = "InvalidRouting"


class DeterministicUnsupportedError(InvalidSpecError):
    """spec.engine.deterministic where the engine cannot give it: vLLM (no recorded release takes a
    batch-invariance switch on its command line), or the builtin engine on a GPU (its row-invariant
    kernels are CPU ones)."""

    reason = "DeterministicUnsupported"


class ChildConflictError(OperatorError):
    """A child object with our name exists and is controlled by some other owner."""

    reason = "ChildConflict"


class WorkloadUnavailableError(OperatorError):
    """The cluster cannot take the workload kind a spec needs (a multi-node service's LeaderWorkerSet, a
    routed service's router RBAC): its API is not served, or the operator may not write it. Ready=False
    with `reason` and Progressing=False with `progress`; retried later, since an admin may install LWS or
    upgrade the chart's RBAC without the spec changing."""

    def __init__(self, message: str, *, reason: str,
                 progress: str = "waiting for the cluster to serve the LeaderWorkerSet API") -> None:
        super().__init__(message)
        self.reason = reason
        self.progress = progress


class ApiError(OperatorError):
    """A Kubernetes API request that failed, with the HTTP status and the API's own reason."""

    reason = "ApiError"

    def __init__(self, *, status: int, api_reason: str, message: str) -> None:
        super().__init__(f"{status} {api_reason}: {message}")
        self.status = status
        self.api_reason = api_reason
        self.message = message

    @property
    def transient(self) -> bool:
        # 409 is transient too: a concurrent writer won the race; re-reading and retrying resolves it.
        return self.status in (409, 429) or self.status >= 500 or self.status == 0

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409
