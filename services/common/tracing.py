"""OpenTelemetry tracing of the mesh, off unless an OTLP endpoint is set.

`TracingConfig` is one frozen dataclass every gRPC service takes with no prefix:
`--otlp-endpoint` / `PDMESH_OTLP_ENDPOINT` (empty = off), `--trace-service-name`,
`--trace-sample-ratio`. `Tracing.start(config, service)` returns None when the
endpoint is empty: then no interceptor is installed, the SDK is not even
imported, and the helpers below (`annotate`, `event`, `span`) find no
recording span in the context and return at once.

When on, a `Tracing` owns one SDK `TracerProvider` (resource `service.name`,
parent-based ratio sampler, batched OTLP/gRPC export) and hands out:

- `server_interceptor()`, installed first by `MeshServer`: extracts the W3C
  trace context (`traceparent`/`tracestate`, through `opentelemetry.propagate`)
  from the call's metadata and runs the handler inside a SERVER span named
  `pdmesh.v1.DecodeService/Generate` etc., with the gRPC status at the end. A
  call with no trace context starts a new trace only at an entry RPC
  (`ROOT_METHODS`); health checks, reflection and the periodic polls (Stats,
  Heartbeat, KV-event subscriptions) without one are not traced, so traces
  hold requests, not background chatter;
- `client_interceptors()`, for the channels a service creates (ChannelCache,
  the router's worker connections): inject the current context into the
  call's metadata, so the callee's server span is a child of whatever span is
  current at the caller when it makes the call.

Both interceptors are written here over `opentelemetry.propagate` rather than
taken from opentelemetry-instrumentation-grpc: that package patches grpc
globally or wraps channels its own way, pulls in the instrumentation
framework and its dependency checks, and would create a CLIENT span per call
and server spans for health probes; the mesh needs forty lines of extract /
inject and a filter on which RPCs are traced.

The tracer travels in the OpenTelemetry context with the server span, so the
application code's child spans (`span("kv.pull")`) come from the provider of
the service that handles the call: several services in one test process each
keep their own provider and `service.name`, and no global provider is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from services.common.config import require, setting

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

# Calls with no incoming trace context start a trace only here (the mesh's entry points).
ROOT_METHODS = frozenset(
    {
        "/pdmesh.v1.RouterService/Generate",
        "/pdmesh.v1.RouterService/Cancel",
        "/pdmesh.v1.DecodeService/Generate",
        "/pdmesh.v1.PrefillService/Prefill",
    }
)
_NEVER_TRACED = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_TRACER_KEY = otel_context.create_key("pdmesh-tracer")
ATTRIBUTE_PREFIX = "pdmesh."


@dataclass(frozen=True)
class TracingConfig:
    otlp_endpoint: str = setting(
        "",
        "OpenTelemetry collector for traces (OTLP/gRPC), host:port or http(s)://host:port; "
        "plaintext unless https:// ('' = tracing off)",
    )
    trace_service_name: str = setting("", "service.name of this process's spans ('' = pdmesh-<service>)")
    trace_sample_ratio: float = setting(
        1.0, "fraction of new traces recorded; a traced call follows its caller's decision"
    )

    def __post_init__(self) -> None:
        require(
            0.0 <= self.trace_sample_ratio <= 1.0,
            f"trace_sample_ratio must be in [0, 1], got {self.trace_sample_ratio}",
        )

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_endpoint)


class Tracing:
    """One process's (or one in-process service's) tracer provider and its interceptors."""

    def __init__(self, provider: TracerProvider):
        self.provider = provider
        self.tracer = provider.get_tracer("pdmesh")

    @classmethod
    def start(cls, config: TracingConfig, service: str) -> Tracing | None:
        """None when tracing is off; else a provider exporting to `config.otlp_endpoint`."""
        if not config.enabled:
            return None
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = config.otlp_endpoint
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
        return cls.with_exporter(
            exporter, config.trace_service_name or f"pdmesh-{service}", config.trace_sample_ratio
        )

    @classmethod
    def with_exporter(
        cls, exporter: SpanExporter, service_name: str, sample_ratio: float = 1.0, batch: bool = True
    ) -> Tracing:
        """A provider over any exporter (tests pass the SDK's InMemorySpanExporter, batch=False)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}),
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
        )
        provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        return cls(provider)

    def server_interceptor(self) -> grpc.aio.ServerInterceptor:
        return _ServerSpans(self.tracer)

    def client_interceptors(self) -> tuple[grpc.aio.ClientInterceptor, ...]:
        return (_InjectUnary(), _InjectStream())

    def shutdown(self) -> None:
        """Export what is buffered and stop (after the server has drained)."""
        self.provider.shutdown()


def client_interceptors(tracing: Tracing | None) -> tuple[grpc.aio.ClientInterceptor, ...]:
    """The interceptors a service's channels get: none when tracing is off."""
    return tracing.client_interceptors() if tracing is not None else ()


def shutdown(tracing: Tracing | None) -> None:
    if tracing is not None:
        tracing.shutdown()


# ---- what application code calls (no-ops unless a recording span is current) ----


def _attributes(attrs: dict[str, Any]) -> dict[str, Any]:
    return {ATTRIBUTE_PREFIX + k: v for k, v in attrs.items() if v is not None}


def recording() -> bool:
    """Whether a recording span is current (to skip computing attributes otherwise)."""
    return trace.get_current_span().is_recording()


def annotate(**attrs: Any) -> None:
    """Set `pdmesh.<name>` attributes on the current span (None values are skipped)."""
    current = trace.get_current_span()
    if current.is_recording():
        current.set_attributes(_attributes(attrs))


def event(name: str, **attrs: Any) -> None:
    """Add an event with `pdmesh.<name>` attributes to the current span."""
    current = trace.get_current_span()
    if current.is_recording():
        current.add_event(name, _attributes(attrs))


@contextlib.contextmanager
def span(name: str, **attrs: Any) -> Iterator[trace.Span | None]:
    """A child span of the current one (made current), or None when nothing is traced.
    An exception leaving the block is recorded on the span and re-raised."""
    tracer = otel_context.get_value(_TRACER_KEY)
    if tracer is None or not trace.get_current_span().is_recording():
        yield None
        return
    with tracer.start_as_current_span(name, attributes=_attributes(attrs)) as child:  # type: ignore[attr-defined]
        yield child


# ---- interceptors -------------------------------------------------------------


# Two classes: a grpc.aio channel files each interceptor under the first call kind it
# implements (isinstance ... elif ...), so one class for both would never see streams.
class _InjectUnary(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the caller's current trace context to a unary call's metadata."""

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_trace_context(details), request)


class _InjectStream(grpc.aio.UnaryStreamClientInterceptor):
    """Adds the caller's current trace context to a server-streaming call's metadata."""

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_trace_context(details), request)


def _with_trace_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:  # no span current (a health probe, a background loop)
        return details
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    for key, value in carrier.items():
        metadata[key] = value
    return details._replace(metadata=metadata)  # type: ignore[attr-defined]


class _ServerSpans(grpc.aio.ServerInterceptor):
    """A SERVER span per traced call, current while the handler runs."""

    def __init__(self, tracer: trace.Tracer):
        self._tracer = tracer

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or method.startswith(_NEVER_TRACED):
            return handler
        carrier = {k: v for k, v in details.invocation_metadata or () if isinstance(v, str)}
        parent = propagate.extract(carrier)
        if not trace.get_current_span(parent).get_span_context().is_valid and method not in ROOT_METHODS:
            return handler
        return _traced_handler(handler, self._tracer, method, parent)


def _traced_handler(
    h: grpc.RpcMethodHandler, tracer: trace.Tracer, method: str, parent: otel_context.Context
) -> grpc.RpcMethodHandler:
    service, _, name = method.lstrip("/").rpartition("/")
    attrs = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
    ser = {"request_deserializer": h.request_deserializer, "response_serializer": h.response_serializer}

    def begin() -> tuple[trace.Span, object]:
        s = tracer.start_span(method.lstrip("/"), parent, trace.SpanKind.SERVER, attrs)
        ctx = otel_context.set_value(_TRACER_KEY, tracer, trace.set_span_in_context(s, parent))
        return s, otel_context.attach(ctx)

    if h.unary_unary is not None:
        inner_uu = h.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            s, token = begin()
            error: BaseException | None = None
            try:
                return await inner_uu(request, context)
            except BaseException as e:
                error = e
                raise
            finally:
                _finish(s, context, error)
                otel_context.detach(token)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **ser)

    if h.unary_stream is not None:
        inner = h.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            s, token = begin()
            error: BaseException | None = None
            try:
                if inspect.isasyncgenfunction(inner) or inspect.isasyncgenfunction(
                    getattr(inner, "__func__", None)
                ):
                    async for item in inner(request, context):
                        yield item
                else:
                    await inner(request, context)
            except BaseException as e:
                error = e
                raise
            finally:
                _finish(s, context, error)
                otel_context.detach(token)

        return grpc.unary_stream_rpc_method_handler(unary_stream, **ser)

    return h  # client-streaming kinds: not used by pdmesh services


def _finish(s: trace.Span, context: grpc.aio.ServicerContext, error: BaseException | None) -> None:
    """End the span with the call's gRPC status: the one set by abort/set_code, else
    CANCELLED for a cancelled handler, UNKNOWN for another exception, OK."""
    code = context.code()
    if not isinstance(code, grpc.StatusCode):
        if error is None:
            code = grpc.StatusCode.OK
        elif isinstance(error, asyncio.CancelledError):
            code = grpc.StatusCode.CANCELLED
        else:
            code = grpc.StatusCode.UNKNOWN
    s.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        s.set_status(trace.Status(trace.StatusCode.ERROR, f"{code.name}: {context.details() or ''}"))
    s.end()
