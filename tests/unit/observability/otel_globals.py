"""A global OpenTelemetry SDK tracer provider for the length of a test.

The API lets a process set its global provider once; tests that need one
(to show that pdmesh with tracing off records nothing even then) set it here
and put the API's globals back afterwards, the way OpenTelemetry's own test
utilities do (opentelemetry.test.globals_test.reset_trace_globals).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once


@contextlib.contextmanager
def global_tracer_provider() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    saved = (trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER)
    trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER = Once(), None
    trace.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        provider.shutdown()
        trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER = saved
