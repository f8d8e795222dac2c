"""The workflow context through the router's HTTP door (issue 21): X-Workflow-Id and its
step headers (or Dynamo's X-Dynamo-Session-ID) reach the decode worker as the request's
WorkflowContext, so HTTP clients get the affinity hint, pins and sunk-cost scheduling
the gRPC door gives; a malformed value is a 400 with an error object, not a traceback.
Real router, real HTTP door on port 0, fake decode workers (fakes.py)."""

from __future__ import annotations

import asyncio
import json

from tests.service.gateway import httpio
from tests.service.router.test_http_door import MODEL, door_of


async def post(address: str, body: dict, headers: dict[str, str]):
    return await asyncio.to_thread(
        httpio.request, address, "POST", "/v1/completions", {"model": MODEL, **body}, None, headers
    )


async def test_workflow_headers_reach_the_worker_and_close_the_workflow_at_its_final_step(mesh):
    a, b = await mesh.decode("a"), await mesh.decode("b")
    h = await mesh.router([a, b])
    async with door_of(h) as door:
        prompt = "an agent's conversation so far, " * 8
        steps = [
            {"X-Workflow-Id": "agent-7", "X-Workflow-Step": "0"},
            {"X-Workflow-Id": "agent-7", "X-Workflow-Step": "1", "X-Workflow-Tokens-Spent": "420"},
            {"X-Dynamo-Session-ID": "agent-7", "X-Workflow-Step": "2", "X-Dynamo-Session-Final": "true"},
        ]
        for k, headers in enumerate(steps):
            status, _, raw = await post(door.address, {"prompt": prompt * (k + 1), "max_tokens": 4}, headers)
            assert status == 200, raw
        calls = [c for w in (a, b) for c in w.calls]
        got = sorted((c.workflow.workflow_id, c.workflow.step_index, c.workflow.tokens_spent) for c in calls)
        assert got == [("agent-7", 0, 0), ("agent-7", 1, 420), ("agent-7", 2, 0)]
        assert [c.workflow.final_step for c in sorted(calls, key=lambda c: c.workflow.step_index)] == [
            False,
            False,
            True,
        ]
        homes = {w.worker_id for w in (a, b) if w.calls}
        assert len(homes) == 1, f"the steps were spread over {homes}"  # the hint kept them home
        st = h.router.workflows.stats()
        assert (st.completed, st.failed, st.open) == (1, 0, 0)  # the final step closed it
        # A request without the headers carries no workflow.
        status, _, _ = await post(door.address, {"prompt": "plain", "max_tokens": 2}, {})
        assert status == 200
        assert not any(c.workflow.workflow_id for c in (a.calls + b.calls)[-1:])


async def test_malformed_workflow_headers_are_a_400_and_reach_no_worker(mesh):
    a = await mesh.decode("a")
    h = await mesh.router([a])
    bad = [
        ({"X-Workflow-Id": "wf", "X-Workflow-Step": "two"}, "x-workflow-step"),
        ({"X-Workflow-Id": "wf", "X-Workflow-Step": "-1"}, "x-workflow-step"),
        ({"X-Workflow-Id": "wf", "X-Workflow-Step": str(2**32)}, "x-workflow-step"),
        ({"X-Workflow-Id": "wf", "X-Workflow-Tokens-Spent": "1e3"}, "x-workflow-tokens-spent"),
        ({"X-Workflow-Id": "wf", "X-Workflow-Final": "maybe"}, "x-workflow-final"),
        ({"X-Workflow-Id": "x" * 129}, "x-workflow-id"),
        ({"X-Workflow-Step": "3"}, "x-workflow-id"),  # a step of no workflow
    ]
    async with door_of(h) as door:
        for headers, param in bad:
            status, _, raw = await post(door.address, {"prompt": "x", "max_tokens": 2}, headers)
            assert status == 400, (headers, raw)
            err = json.loads(raw)["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param, err
        assert a.calls == []
        assert h.router.workflows.stats().open == 0
