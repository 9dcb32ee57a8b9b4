"""kopf handlers for DecodeService: short, typed, idempotent.

create, update and resume all run `_reconcile`; a timer runs it again every `resync_seconds` to repair
drift (a child deleted or edited by hand) and to refresh the status from the Deployment's (or the
LeaderWorkerSet's). Handlers are
registered on a registry built per operator (`build_registry`), so the state they share (the API client)
belongs to that registry's closure, not to the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kopf

from decodeservice.operator.autoscaler.controller import Autoscaling, AutoscalingConfig, settings_for
from decodeservice.operator.cold_start import cold_start
from decodeservice.operator.errors import (
    ApiError,
    ChildConflictError,
    InvalidSpecError,
    WorkloadUnavailableError,
)
from decodeservice.operator.kube import KINDS, KubeClient
from decodeservice.operator.kube import login as kube_login
from decodeservice.operator.manifests import BuildOptions, build_children, desired_replicas, serving_selector
from decodeservice.operator.reconcile import apply_children
from decodeservice.operator.router import routed
from decodeservice.operator.spec import GROUP, PLURAL, VERSION, AutoscalingMode, ValidatedSpec, validate_spec
from decodeservice.operator.status import derive_status, invalid_status, workload_state

ANNOTATION_PREFIX = "decode.dev"


@dataclass(frozen=True, kw_only=True)
class OperatorConfig:
    build: BuildOptions = BuildOptions()
    resync_seconds: float = 60.0
    retry_base_seconds: float = 1.0
    retry_max_seconds: float = 60.0
    request_timeout_seconds: float = 30.0
    autoscaling: AutoscalingConfig = AutoscalingConfig()
    # Given: use these credentials (tests, out-of-cluster runs). None: in-cluster service account, then kubeconfig.
    connection: kopf.ConnectionInfo | None = None

    def __post_init__(self) -> None:
        if self.resync_seconds <= 0 or self.retry_base_seconds <= 0 or self.request_timeout_seconds <= 0:
            raise ValueError("resync_seconds, retry_base_seconds and request_timeout_seconds must be > 0")
        if self.retry_max_seconds < self.retry_base_seconds:
            raise ValueError("retry_max_seconds must be >= retry_base_seconds")

    def backoff(self, retry: int) -> float:
        return float(min(self.retry_max_seconds, self.retry_base_seconds * 2 ** min(retry, 16)))


class _Session:
    """The API client, made lazily inside the operator's loop from the credentials kopf logged in with."""

    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self.connection: kopf.ConnectionInfo | None = config.connection
        self.client: KubeClient | None = None
        self.closed = False

    def get(self) -> KubeClient:
        if self.closed:
            # The operator is stopping: a late timer tick must not open a session nobody will close.
            raise kopf.TemporaryError("the operator is shutting down", delay=self.config.retry_max_seconds)
        if self.client is None:
            if self.connection is None:
                raise kopf.TemporaryError("not logged in to the API yet", delay=self.config.retry_base_seconds)
            self.client = KubeClient(self.connection, timeout_seconds=self.config.request_timeout_seconds)
        return self.client

    async def relogin(self, connection: kopf.ConnectionInfo) -> None:
        self.connection = connection
        if self.client is not None:
            await self.client.close()
            self.client = None


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """Persistence in our own annotations (not in status.kopf, which our schema does not declare)."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/operator"


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    session = _Session(config)
    autoscaling = Autoscaling(config.autoscaling)

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_settings(settings)

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = config.connection or kube_login(**kwargs)
        if info is not None:
            await session.relogin(info)
        return info

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        session.closed = True
        await autoscaling.close()
        if session.client is not None:
            await session.client.close()
            session.client = None

    async def reconcile(body: kopf.Body, patch: kopf.Patch, retry: int, logger: kopf.Logger,
                        *, permanent_on_invalid: bool) -> None:
        # Serialized with the autoscaler's writes: the replicas it reads below are the ones it applies.
        async with autoscaling.lock(str(body.metadata.uid)):
            v = await _reconcile(body, patch, retry, logger, permanent_on_invalid=permanent_on_invalid)
        # In builtin mode each tick lists the pods anyway and writes status.coldStart itself.
        if v is not None and v.spec.autoscaling.mode is not AutoscalingMode.BUILTIN:
            await _cold_start(v, body, patch, logger)

    async def _cold_start(v: ValidatedSpec, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> None:
        name, namespace = str(body.metadata.name), str(body.metadata.namespace)
        try:
            cold = cold_start(await session.get().list_pods(namespace, serving_selector(name, v)))
        except ApiError as exc:  # the figure is a courtesy: the rest of the status still goes out
            logger.debug(f"pods not listed for status.coldStart: {exc}")
            return
        if cold is not None:
            patch["status"]["coldStart"] = cold

    async def _reconcile(body: kopf.Body, patch: kopf.Patch, retry: int, logger: kopf.Logger,
                         *, permanent_on_invalid: bool) -> ValidatedSpec | None:
        """Apply the children and derive the status; the spec it served, None where it served none."""
        name, namespace = str(body.metadata.name), str(body.metadata.namespace)
        generation = int(body.metadata.get("generation") or 0)
        previous = dict(body.get("status") or {})
        try:
            v = validate_spec(body.get("spec"))
            if v.spec.autoscaling.mode is AutoscalingMode.BUILTIN:
                settings_for(v, default_interval=config.autoscaling.interval_seconds)  # knobs that clash
            replicas = await autoscaling.replicas_for(session.get(), v, uid=str(body.metadata.uid), name=name,
                                                      namespace=namespace)
            children = build_children(name=name, namespace=namespace, v=v, options=config.build, replicas=replicas)
        except InvalidSpecError as exc:
            patch["status"] = invalid_status(name=name, generation=generation, reason=exc.reason,
                                             message=str(exc), previous=previous)
            if permanent_on_invalid:
                raise kopf.PermanentError(f"{exc.reason}: {exc}") from exc
            return None
        except ApiError as exc:  # reading the live replicas (builtin mode): retry, never guess them
            delay = config.backoff(retry)
            logger.warning(f"API error, retrying in {delay:.1f}s: {exc}")
            raise kopf.TemporaryError(str(exc), delay=delay) from exc
        kopf.adopt(children.all(), owner=body)
        try:
            applied = await apply_children(session.get(), children, owner_uid=str(body.metadata.uid),
                                              namespace=namespace, name=name)
        except ChildConflictError as exc:
            patch["status"] = invalid_status(name=name, generation=generation, reason=exc.reason,
                                             message=str(exc), previous=previous)
            raise kopf.PermanentError(str(exc)) from exc
        except WorkloadUnavailableError as exc:
            # Not the spec's fault and not a crash loop: say so, and look again at the slowest retry pace
            # (installing LWS or upgrading the chart's RBAC takes an admin, not a second).
            patch["status"] = invalid_status(name=name, generation=generation, reason=exc.reason, message=str(exc),
                                             previous=previous, progress=exc.progress)
            logger.warning(f"{exc.reason}: {exc}")
            raise kopf.TemporaryError(str(exc), delay=config.retry_max_seconds) from exc
        except ApiError as exc:
            if not exc.transient and exc.status not in (401, 403):
                patch["status"] = invalid_status(name=name, generation=generation, reason="ApiRejected",
                                                 message=str(exc), previous=previous)
                raise kopf.PermanentError(f"the API rejected a child: {exc}") from exc
            # Transient, or RBAC that an admin may still fix: back off and try the whole reconcile again.
            delay = config.backoff(retry)
            logger.warning(f"API error, retrying in {delay:.1f}s: {exc}")
            raise kopf.TemporaryError(str(exc), delay=delay) from exc
        pool = applied.inference_pool
        scaling = v.spec.autoscaling
        patch["status"] = derive_status(
            name=name, namespace=namespace, generation=generation,
            desired_replicas=desired_replicas(v) if replicas is None else replicas,
            workload=workload_state(applied.workload, kind=str(children.workload["kind"])),
            selector=serving_selector(name, v), slo_percentile=v.policy.slo.percentile, previous=previous,
            slo=autoscaling.latest_slo(str(body.metadata.uid)),
            holds_at_zero=routed(v) and scaling.mode is not AutoscalingMode.OFF and scaling.min_replicas == 0)
        if pool.enabled:  # InferencePoolReady, only while spec.routing.inferencePool is on
            patch["status"]["conditions"].append(pool.condition(generation=generation, previous=previous))
        return v

    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    async def on_change(body: kopf.Body, patch: kopf.Patch, retry: int, logger: kopf.Logger, **_: Any) -> None:
        await reconcile(body, patch, retry, logger, permanent_on_invalid=True)

    @kopf.timer(GROUP, VERSION, PLURAL, interval=config.resync_seconds, initial_delay=config.resync_seconds,
                registry=registry)
    async def resync(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
        # The change handlers already reported an invalid spec; the timer only refreshes that status.
        # A timer has no retry counter: the next tick is its retry.
        await reconcile(body, patch, 0, logger, permanent_on_invalid=False)

    def builtin_mode(spec: kopf.Spec, **_: Any) -> bool:
        return bool((spec.get("autoscaling") or {}).get("mode") == AutoscalingMode.BUILTIN.value)

    @kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, when=builtin_mode, cancellation_timeout=5.0)
    async def autoscale(stopped: kopf.DaemonStopped, body: kopf.Body, uid: str, logger: kopf.Logger,
                        **_: Any) -> None:
        # A daemon, not a timer: each DecodeService has its own intervalSeconds. kopf stops it when the
        # mode leaves builtin or the object goes away; `body` is a live view, so a spec change applies
        # on the next tick.
        await autoscaling.run(uid=uid, body=body, client=session.get, stopped=stopped, logger=logger)

    return registry


__all__ = ["KINDS", "OperatorConfig", "build_registry", "configure_settings"]
