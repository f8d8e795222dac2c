"""RouterService over gRPC: validate and convert messages, call the Router, convert back.

Every check of a request happens in `parse_generate`, before any worker is
touched; the first failure is an INVALID_ARGUMENT naming the field. Generate
streams `TokenDelta`s (all tokens ready at once in one message, with the text
they complete) and ends with a `GenerateFinal`; the request id (as sent or
assigned) goes back in the "x-request-id" initial metadata.

Two listeners (services/router/listeners.py): `add_public_to_server` registers
Generate and Cancel only, `add_internal_to_server` the mesh's methods
(membership, ListWorkers, Stats); a method not registered on a port is
UNIMPLEMENTED there.

With API keys on (services/router/auth.py) Generate and Cancel need
`authorization: Bearer <key>` (UNAUTHENTICATED otherwise); the key's tenant
replaces the request's `tenant`, its cap lowers `priority`. Request ids are
scoped by tenant: another tenant's request with the same id neither collides
(ALREADY_EXISTS) nor can be cancelled. ListWorkers (it shows internal
addresses) needs an admin/router certificate or an admin key. A worker may only
register, heartbeat or deregister itself (services/router/membership.py).
Which certificates may call which method with mTLS is MeshServer's business
(services/common/call_guards.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import grpc

from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common import tracing
from services.common.call_guards import ADMIN_ROLES
from services.common.errors import FailedPrecondition, InvalidArgument, PermissionDenied, grpc_errors
from services.common.tls import peer_identity
from services.common.validation import (
    RequestLimits,
    check_enum,
    check_ident,
    check_priority,
    check_prompt,
    check_prompt_length,
)
from services.model.sampling import check_sampling, sampling_to_proto
from services.router.auth import TenantGrant
from services.router.circuit_breaker import BreakerState
from services.router.config import ModelSpec
from services.router.convert import info_from_proto, info_to_proto, load_from_proto, load_to_proto
from services.router.detokenizer import make_detokenizer
from services.router.generate import FlowFinal, FlowRequest
from services.router.membership import Caller
from services.router.registry import JoinRefused
from services.router.retries import SharedFlow, fingerprint, idempotency_key
from services.router.router import Router, WorkerView
from services.router.stop_text import StopTextFilter

SERVICE_NAME = "pdmesh.v1.RouterService"
PUBLIC_METHODS = frozenset({"Generate", "Cancel"})  # all the public listener serves
INTERNAL_METHODS = frozenset({"ListWorkers", "RegisterWorker", "Heartbeat", "DeregisterWorker", "Stats"})
_ROLE_NAMES = {common_pb2.WORKER_ROLE_DECODE: "decode", common_pb2.WORKER_ROLE_PREFILL: "prefill"}

_Delta = router_pb2.TokenDelta
_Response = router_pb2.GenerateResponse

# ---- the wire form of a delta, without building a message ------------------------------
# Every relayed token costs one GenerateResponse on the gRPC door. Building it with
# upb (two messages, a repeated field, a string) and then serialising it was ~7 us of
# the router's ~55 us per message (bench/results/profile_front_tuned.txt); these bytes
# are the same encoding built directly: GenerateResponse.delta (field 1, length-
# delimited) holding TokenDelta.token_ids (field 1, packed varints) and .text (field 2).

_VARINTS: dict[int, bytes] = {}


def _varint(n: int) -> bytes:
    b = _VARINTS.get(n)
    if b is None:
        out, v = bytearray(), n
        while v > 0x7F:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
        b = bytes(out)
        if n < 1 << 21:  # token ids: a vocabulary's worth of entries at most
            _VARINTS[n] = b
    return b


def delta_bytes(token_ids: list[int], text: str) -> bytes:
    """`GenerateResponse(delta=TokenDelta(token_ids=token_ids, text=text)).SerializeToString()`."""
    packed = _varint(token_ids[0]) if len(token_ids) == 1 else b"".join([_varint(t) for t in token_ids])
    inner = (b"\x0a" + _varint(len(packed)) + packed) if packed else b""
    if text:
        raw = text.encode()
        inner += b"\x12" + _varint(len(raw)) + raw
    return b"\x0a" + _varint(len(inner)) + inner


def _proto_delta(token_ids: list[int], text: str) -> router_pb2.GenerateResponse:
    return _Response(delta=_Delta(token_ids=token_ids, text=text))


class DeltaItem:
    """A delta as the HTTP door's app reads a GenerateResponse (`HasField`, `.delta.text`,
    `.delta.token_ids`), without building the protobuf message it would only read back."""

    __slots__ = ("text", "token_ids")

    def __init__(self, token_ids: list[int], text: str):
        self.token_ids = token_ids
        self.text = text

    @property
    def delta(self) -> DeltaItem:
        return self

    @staticmethod
    def HasField(name: str) -> bool:
        return name == "delta"


def _serialize_response(msg: Any) -> bytes:
    # Generate writes pre-encoded deltas (bytes) and final messages (protos).
    return msg if type(msg) is bytes else msg.SerializeToString()


def parse_generate(
    request: router_pb2.GenerateRequest,
    model: ModelSpec,
    limits: RequestLimits,
    timeout_s: float | None,
    prompt_ids: Sequence[int] | None = None,
) -> FlowRequest:
    """Validate a GenerateRequest and tokenize its prompt (raises InvalidArgument).
    `prompt_ids`: the prompt's token ids when the caller kept them out of `request` (the
    HTTP door, in-process), checked exactly as `token_ids` would be."""
    check_ident(request.request_id, "request_id", limits.max_request_id_bytes)
    # The id goes back in the "x-request-id" header, whose values are printable ASCII.
    if not all(" " <= c <= "~" for c in request.request_id):
        raise InvalidArgument("request_id: must be printable ASCII (it is sent back as x-request-id)")
    check_ident(request.tenant, "tenant", limits.max_tenant_bytes)
    check_priority(request.priority, limits)
    if request.model and request.model != model.model_id:
        raise InvalidArgument(
            f"model: unknown model {request.model!r}; this router serves {model.model_id!r}"
        )
    if request.HasField("workflow"):
        check_ident(request.workflow.workflow_id, "workflow.workflow_id", limits.max_request_id_bytes)
    sampling = check_sampling(  # public field names: this is what clients (and HTTP) see
        request.sampling if request.HasField("sampling") else None, limits, model.vocab_size, prefix=""
    )
    kind = request.WhichOneof("prompt") if prompt_ids is None else "ids"
    if kind == "ids":
        assert prompt_ids is not None
        check_prompt_length(len(prompt_ids), model.max_model_len, limits, "prompt")
        ids = prompt_ids
    elif kind == "text":
        if not request.text:
            raise InvalidArgument("prompt: the prompt is empty")
        if len(request.text) > limits.max_prompt_tokens * 8:  # bound tokenizer work before tokenizing
            raise InvalidArgument(f"prompt: longer than {limits.max_prompt_tokens * 8} characters")
        ids = model.tokenizer.encode(request.text)
    elif kind == "token_ids":
        # Count before copying: len() of a repeated field reads its size, list() would
        # make a Python int per entry of whatever the client sent.
        check_prompt_length(len(request.token_ids.ids), model.max_model_len, limits, "prompt")
        ids = list(request.token_ids.ids)
    else:
        raise InvalidArgument("prompt: set text or token_ids")
    check_prompt(
        ids, sampling.max_tokens, model.vocab_size, model.max_model_len, limits, "prompt", "max_tokens"
    )
    return FlowRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_token_ids=tuple(ids),
        sampling=sampling_to_proto(sampling),
        tenant=request.tenant,
        priority=request.priority,
        workflow=request.workflow if request.HasField("workflow") else None,
        timeout_s=timeout_s,
    )


def scoped_request_id(tenant: str, request_id: str) -> str:
    """The id a request runs under in the router and on the workers: the client's id,
    made unique per tenant (a readable prefix, a digest of tenant and id). Tenant ""
    (no keys, no tenant field) keeps the id as sent. <= 105 bytes, as workers allow 128."""
    if not tenant:
        return request_id
    digest = hashlib.sha256(f"{tenant}\0{request_id}".encode()).hexdigest()[:16]
    return f"{request_id[:88]}.{digest}"


def final_to_proto(f: FlowFinal, request_id: str) -> router_pb2.GenerateResponse:
    return _Response(
        final=router_pb2.GenerateFinal(
            finish_reason=f.finish_reason,  # type: ignore[arg-type]
            usage=common_pb2.Usage(
                prompt_tokens=f.prompt_tokens,
                completion_tokens=f.completion_tokens,
                cached_prompt_tokens=f.cached_prompt_tokens,
                computed_tokens=f.computed_tokens,
            ),
            request_id=request_id,
            worker_id=f.worker_id,
            migrations=f.migrations,
            prefill_path=f.prefill_path,
        )
    )


def status_to_proto(view: WorkerView) -> router_pb2.WorkerStatus:
    rec = view.record
    if view.breaker is BreakerState.OPEN:
        health = router_pb2.WORKER_HEALTH_BREAKER_OPEN
    elif rec.healthy:
        health = router_pb2.WORKER_HEALTH_SERVING
    else:
        health = router_pb2.WORKER_HEALTH_NOT_SERVING
    return router_pb2.WorkerStatus(
        info=info_to_proto(rec.info),
        load=load_to_proto(rec.load),
        health=health,
        indexed_blocks=view.indexed_blocks,
        source=rec.source.value,
        inflight=rec.inflight,
        measured_prefill_s_per_token=(view.profile and view.profile.prefill_s_per_token) or 0.0,
        measured_decode_s_per_token=(view.profile and view.profile.decode_s_per_token) or 0.0,
        prefill_speed_factor=view.speed[0],
        decode_speed_factor=view.speed[1],
    )


class Generation:
    """One Generate request as both of the router's doors serve it: gRPC (`Generate`
    below) and HTTP (services/router/http_door.py, in-process, no second hop).

    Checks the API key (the key's tenant and priority cap win over the request's
    fields), validates and tokenizes (`parse_generate`), scopes the request id by
    tenant and opens the flow; `responses()` turns the flow's token-id lists into
    GenerateResponse messages (detokenized, stop strings held back), the final
    one last. Raises the flow's MeshErrors; each door maps them to its status.
    Iterate `responses()` once, then `close()`.
    """

    def __init__(
        self,
        router: Router,
        request: router_pb2.GenerateRequest,
        metadata: Iterable[tuple[str, Any]] | None,
        timeout_s: float | None,
        prompt_ids: Sequence[int] | None = None,
    ):
        """`prompt_ids`: a token-id prompt kept out of `request` (the HTTP door's)."""
        auth = router.auth
        grant = auth.authenticate(metadata) if auth is not None else None  # Unauthenticated
        try:
            req = parse_generate(request, router.model, router.settings.limits, timeout_s, prompt_ids)
        except InvalidArgument:
            router.metrics.invalid()
            raise
        if grant is not None:  # the key decides the tenant, never the request's field
            req = dataclasses.replace(req, tenant=grant.tenant, priority=grant.cap(req.priority))
        self.client_id = req.request_id
        self.tenant = req.tenant
        req = dataclasses.replace(req, request_id=scoped_request_id(req.tenant, self.client_id))
        self.router = router
        self.prompt_tokens = len(req.prompt_token_ids)
        self._stop = req.sampling.stop
        # A keyed request (services/router/retries.py) runs shared, and its retries follow it.
        self.shared: SharedFlow | None = None
        key = idempotency_key(metadata)
        if key is not None and router.retried is not None:
            if prompt_ids is not None:  # the fingerprint covers the prompt, as a gRPC request's does
                full = type(request)()
                full.CopyFrom(request)
                full.token_ids.ids.extend(prompt_ids)
                request = full
            print_ = fingerprint(request)
            self.shared = router.follow_retry(req.tenant, key, print_) or router.open_shared(
                req, self.client_id, key, print_
            )
            self.flow = self.shared.flow
            return
        self.flow = router.open_flow(req, self.client_id)  # AlreadyExists, shed, Unavailable

    def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        # x-prompt-tokens: the HTTP door logs it for streams its client closes before the final.
        return (("x-request-id", self.client_id), ("x-prompt-tokens", str(self.prompt_tokens)))

    def responses(self) -> AsyncIterator[router_pb2.GenerateResponse]:
        """GenerateResponse messages: deltas, then the final one."""
        return self._stream(_proto_delta)

    def encoded(self) -> AsyncIterator[bytes | router_pb2.GenerateResponse]:
        """`responses()` for the gRPC door: deltas as their wire bytes (`delta_bytes`)."""
        return self._stream(delta_bytes)

    def light(self) -> tuple[AsyncIterator[Any], Deltas]:
        """For the HTTP door, which reads in-process: the flow's items and the `Deltas` that
        turn them into `DeltaItem`s and the final message. The door translates each item
        itself (no generator of ours between it and the flow: two Python calls less per
        streamed token) and must `aclose()` the iterator."""
        return self._items(), Deltas(self, DeltaItem)

    def _items(self) -> AsyncIterator[Any]:
        return self.flow.run() if self.shared is None else self.shared.follow()

    async def _stream(self, delta: Callable[[list[int], str], Any]) -> AsyncIterator[Any]:
        deltas = Deltas(self, delta)
        run = self._items()
        try:
            async for item in run:
                if type(item) is list:
                    yield deltas.tokens(item)
                else:
                    for msg in deltas.end(item):
                        yield msg
        finally:
            # aclose() of this generator (the HTTP door's cancel) stops at our yield: close
            # the flow's too, now, so its cleanup (admission slot, ledger) is not left to GC.
            await run.aclose()

    def cancel(self, why: str) -> None:
        """The client went away: cancel the flow, unless it is shared (its retry may follow)."""
        if self.shared is None:
            self.flow.cancel(why)

    def close(self) -> None:
        if self.shared is None:  # a shared flow is closed when it ends (Router.open_shared)
            self.router.close_flow(self.flow)


class Deltas:
    """A flow's items as one door's messages: each token-id list a delta (detokenized,
    stop strings held back), the FlowFinal the held text and then the final message."""

    __slots__ = ("_client_id", "_delta", "_push", "_stops")

    def __init__(self, gen: Generation, delta: Callable[[list[int], str], Any]):
        self._delta = delta
        self._push = make_detokenizer(gen.router.model.tokenizer).push_many
        self._stops = StopTextFilter(gen._stop)
        self._client_id = gen.client_id

    def tokens(self, ids: list[int]) -> Any:
        return self._delta(ids, self._stops.push(self._push(ids)))

    def end(self, final: FlowFinal) -> list[Any]:
        out = [self._delta([], held)] if (held := self._stops.flush()) else []
        out.append(final_to_proto(final, self._client_id))
        return out


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, router: Router):
        self.router = router
        self.limits = router.settings.limits

    def _grant(self, context) -> TenantGrant | None:
        """The caller's tenant grant when API keys are on (raises Unauthenticated), else None."""
        auth = self.router.auth
        return auth.authenticate(context.invocation_metadata()) if auth is not None else None

    @grpc_errors
    async def Generate(self, request, context):
        # A coroutine writing with context.write, not an async generator: every wrapper
        # around it (errors, drain gate, malformed-request guard) then awaits it once
        # instead of re-yielding each message through its own generator frame.
        gen = Generation(self.router, request, context.invocation_metadata(), context.time_remaining())
        tracing.annotate(request_id=gen.client_id, tenant=gen.tenant)
        it = gen.encoded()
        # The headers go out while the flow routes the request and waits for its first
        # token, not before it starts: one gRPC completion less on the hop's critical path.
        # They are out before the first message (awaited below) and before any status.
        headers: asyncio.Future[None] | None = asyncio.ensure_future(
            context.send_initial_metadata(gen.initial_metadata())
        )
        try:
            write = context.write
            async for msg in it:
                if headers is not None:
                    await headers
                    headers = None
                await write(msg)
        finally:
            if headers is not None:  # the flow ended first (an error, a cancel): headers first
                with contextlib.suppress(Exception):
                    await headers
            # Cancelled in write (the client went away), the generator is still open at its
            # yield: close it now so the flow's cleanup runs here, not in GC.
            await it.aclose()
            gen.close()
            if tracing.recording():
                journey = gen.flow.journey
                tracing.annotate(
                    worker=gen.flow.worker_id, attempts=len(journey.attempts), migrations=journey.migrations
                )

    @grpc_errors
    async def Cancel(self, request, context):
        grant = self._grant(context)
        check_ident(request.request_id, "request_id", self.limits.max_request_id_bytes, required=True)
        check_ident(request.tenant, "tenant", self.limits.max_tenant_bytes)
        # With keys the key's tenant, never the field: Cancel reaches only the caller's requests.
        tenant = grant.tenant if grant is not None else request.tenant
        scoped = scoped_request_id(tenant, request.request_id)
        return router_pb2.CancelResponse(cancelled=self.router.cancel(scoped, tenant))

    @grpc_errors
    async def ListWorkers(self, request, context):
        self._check_admin(context)
        return router_pb2.ListWorkersResponse(workers=[status_to_proto(v) for v in self.router.workers()])

    def _check_admin(self, context) -> None:
        """Operators only: an admin/router certificate, or (keys on) an admin key."""
        ident = peer_identity(context)
        if ident is not None and ident.role in ADMIN_ROLES:
            return
        auth = self.router.auth
        if auth is None:
            if ident is None:
                return  # no keys and no mTLS: this mesh authenticates nobody
            raise PermissionDenied(f"ListWorkers needs an admin or router certificate, not {ident.role!r}")
        if not auth.authenticate(context.invocation_metadata()).admin:
            raise PermissionDenied("ListWorkers needs an admin key (pdmesh keys add --admin)")

    @staticmethod
    def _caller(context, incarnation: str) -> Caller:
        ident = peer_identity(context)
        return Caller(certified_worker=ident.name if ident is not None else "", incarnation=incarnation)

    @grpc_errors
    async def RegisterWorker(self, request, context):
        w = request.worker
        check_ident(w.worker_id, "worker.worker_id", self.limits.max_request_id_bytes, required=True)
        check_ident(w.address, "worker.address", 512, required=True)
        check_ident(request.incarnation, "incarnation", 128)
        check_enum(w.role, common_pb2.WorkerRole, "worker.role")
        check_enum(w.accelerator, common_pb2.AcceleratorKind, "worker.accelerator")
        if w.role == common_pb2.WORKER_ROLE_UNSPECIFIED:
            raise InvalidArgument("worker.role: must be WORKER_ROLE_DECODE or WORKER_ROLE_PREFILL")
        ident = peer_identity(context)  # mTLS: a worker joins only in the role its certificate names
        if ident is not None and _ROLE_NAMES.get(w.role) != ident.role:
            raise PermissionDenied(f"worker.role: the client certificate is for role {ident.role!r}")
        lease_s = request.lease_ms / 1000 if request.lease_ms else None
        try:
            result, secret = await self.router.register(
                info_from_proto(w), lease_s, caller=self._caller(context, request.incarnation)
            )
        except JoinRefused as e:
            raise FailedPrecondition(f"worker refused: {e}") from e
        rec = result.record
        return router_pb2.RegisterWorkerResponse(
            heartbeat_interval_ms=int((result.heartbeat_interval_s or 0) * 1000),
            lease_ms=int((rec.lease_s or 0) * 1000),
            incarnation=secret,
        )

    @grpc_errors
    async def Heartbeat(self, request, context):
        check_ident(request.worker_id, "worker_id", self.limits.max_request_id_bytes, required=True)
        check_ident(request.incarnation, "incarnation", 128)
        caller = self._caller(context, request.incarnation)
        known = self.router.heartbeat(request.worker_id, load_from_proto(request.load), caller)
        return router_pb2.RouterServiceHeartbeatResponse(known=known)

    @grpc_errors
    async def DeregisterWorker(self, request, context):
        check_ident(request.worker_id, "worker_id", self.limits.max_request_id_bytes, required=True)
        check_ident(request.incarnation, "incarnation", 128)
        caller = self._caller(context, request.incarnation)
        return router_pb2.DeregisterWorkerResponse(
            removed=await self.router.deregister(request.worker_id, caller)
        )

    @grpc_errors
    async def Stats(self, request, context):
        s = self.router.stats()
        return router_pb2.RouterServiceStatsResponse(
            requests_total=s.requests_total,
            requests_succeeded=s.requests_succeeded,
            requests_failed=s.requests_failed,
            requests_cancelled=s.requests_cancelled,
            requests_shed=s.requests_shed,
            retries=s.retries,
            retries_denied=s.retries_denied,
            migrations=s.migrations,
            tokens_per_successful_request=s.tokens_per_successful_request,
            wasted_tokens=s.wasted_tokens,
            computed_tokens=s.computed_tokens,
            inflight=s.inflight,
            queued=s.queued,
            prompt_tokens=s.prompt_tokens,
            completion_tokens=s.completion_tokens,
            **{name: _histogram(*h) for name, h in s.latency.items()},
        )


def _histogram(
    bounds: tuple[float, ...], counts: tuple[int, ...], total: float
) -> router_pb2.LatencyHistogram:
    return router_pb2.LatencyHistogram(upper_bounds_s=bounds, counts=counts, sum_s=total)


class _HandlerCapture:
    """Takes what the generated `add_RouterServiceServicer_to_server` registers, so one
    listener can get a subset of the methods."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.handlers = dict(handlers)


def _add_methods(servicer: RouterServicer, server: grpc.aio.Server, methods: frozenset[str]) -> None:
    capture = _HandlerCapture()
    router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, capture)  # type: ignore[arg-type]
    chosen = {name: h for name, h in capture.handlers.items() if name in methods}
    if "Generate" in chosen:  # it writes pre-encoded deltas (delta_bytes)
        chosen["Generate"] = grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=router_pb2.GenerateRequest.FromString,
            response_serializer=_serialize_response,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, chosen),))


def add_public_to_server(servicer: RouterServicer, server: grpc.aio.Server) -> None:
    """Generate and Cancel: what a client may reach."""
    _add_methods(servicer, server, PUBLIC_METHODS)


def add_internal_to_server(servicer: RouterServicer, server: grpc.aio.Server) -> None:
    """Membership, ListWorkers, Stats: the mesh's own methods."""
    _add_methods(servicer, server, INTERNAL_METHODS)


def add_to_server(router: Router, server: grpc.aio.Server) -> RouterServicer:
    """The public methods on `server` (RouterListeners serves both listeners)."""
    servicer = RouterServicer(router)
    add_public_to_server(servicer, server)
    return servicer
