"""spec.routing: how requests reach the pods, typed, and the one place the routing mode is decided.

`router` puts the fleet router (`decodectl router`, router/) in front of the pods: it routes each request
to the pod whose prefix cache and queue suit it best, and with no ready pod it holds requests, which is
what lets a service scale to zero and back. `service` is a plain ClusterIP Service over the pods.
`inferencePool` adds a Gateway API InferencePool whose endpoint picker someone else runs.
"""

from __future__ import annotations

import enum

from pydantic import Field

from decodeservice.common.camel_model import CamelModel
from decodeservice.operator.errors import InvalidRoutingError
from decodeservice.operator.podspec import QUANTITY_PATTERN
from decodeservice.router.config import RouterConfig


class PortRef(CamelModel):
    number: int = Field(ge=1, le=65535)


class EndpointPickerFailureMode(enum.StrEnum):
    FAIL_OPEN = "FailOpen"
    FAIL_CLOSE = "FailClose"


# The upstream InferencePool's endpointPickerRef, field for field, so it is copied into the pool as given.
class EndpointPickerRef(CamelModel):
    group: str = Field("", max_length=253, pattern=r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    kind: str = Field("Service", min_length=1, max_length=63, pattern=r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")
    name: str = Field(min_length=1, max_length=253)
    port: PortRef | None = None
    failure_mode: EndpointPickerFailureMode = EndpointPickerFailureMode.FAIL_CLOSE


class InferencePoolSpec(CamelModel):
    enabled: bool = False  # the spelling before routing.mode: `enabled: true` means mode inferencePool
    endpoint_picker_ref: EndpointPickerRef | None = None


class RoutingMode(enum.StrEnum):
    ROUTER = "router"  # the fleet router (`decodectl router`) in front of the pods: holds requests at zero
    SERVICE = "service"  # a plain ClusterIP Service over the pods
    INFERENCE_POOL = "inferencePool"  # a Service plus a Gateway API InferencePool with someone else's picker


class RouterResourcesSpec(CamelModel):
    cpu: str = Field("250m", pattern=QUANTITY_PATTERN)
    memory: str = Field("256Mi", pattern=QUANTITY_PATTERN)


_ROUTER_DEFAULTS = RouterConfig()  # the router's defaults, one source for the CLI and the CRD


class RouterSpec(CamelModel):
    """The router's knobs; the defaults are `decodectl router`'s own (decodeservice.router.config)."""

    replicas: int = Field(2, ge=1, le=20)
    hold_seconds: float = Field(_ROUTER_DEFAULTS.hold_seconds, gt=0, le=3600)
    max_held: int = Field(_ROUTER_DEFAULTS.max_held, ge=1, le=100000)
    resources: RouterResourcesSpec = Field(default_factory=lambda: RouterResourcesSpec.model_validate({}))


class RoutingSpec(CamelModel):
    # None: `router` where the autoscaler may run more than one replica or none, else `service`
    # (`inferencePool` where the older inferencePool.enabled says so). routing_mode() decides it once.
    mode: RoutingMode | None = None
    router: RouterSpec = Field(default_factory=lambda: RouterSpec.model_validate({}))
    inference_pool: InferencePoolSpec = Field(default_factory=lambda: InferencePoolSpec.model_validate({}))


def routing_mode(routing: RoutingSpec, *, min_replicas: int, max_replicas: int, autoscaled: bool) -> RoutingMode:
    """The routing mode, decided once per spec (`autoscaled`: autoscaling.mode is not off); raises InvalidRoutingError for combinations that cannot serve.

    Left unset: the older `inferencePool.enabled: true` means inferencePool; a router where the
    autoscaler may run several replicas (it spreads prefixes and load over them) or none (it holds
    requests while the first replica starts); a plain Service otherwise."""
    pool = routing.inference_pool
    if routing.mode is not None and pool.enabled and routing.mode is not RoutingMode.INFERENCE_POOL:
        raise InvalidRoutingError(f"spec.routing.inferencePool.enabled: true conflicts with routing.mode "
                                  f"{routing.mode.value}; set routing.mode: inferencePool (enabled is its older "
                                  "spelling) or remove enabled")
    if routing.mode is not None:
        mode = routing.mode
    elif pool.enabled:
        mode = RoutingMode.INFERENCE_POOL
    elif autoscaled and (max_replicas > 1 or min_replicas == 0):
        mode = RoutingMode.ROUTER
    else:
        mode = RoutingMode.SERVICE
    if mode is RoutingMode.INFERENCE_POOL and pool.endpoint_picker_ref is None:
        raise InvalidRoutingError("spec.routing.inferencePool.endpointPickerRef: required with routing.mode "
                                  "inferencePool (the pool's endpoint picker)")
    if min_replicas == 0:
        if not autoscaled:
            raise InvalidRoutingError("spec.autoscaling.minReplicas: 0 needs autoscaling.mode builtin (it scales "
                                      "from zero on the requests the router holds) or external; with mode off "
                                      "nothing would ever start a replica")
        if mode is not RoutingMode.ROUTER:
            raise InvalidRoutingError(f"spec.autoscaling.minReplicas: 0 needs routing.mode router, not "
                                      f"{mode.value}: a Service without endpoints fails every request, while "
                                      "the router holds them until a replica is ready")
    return mode
