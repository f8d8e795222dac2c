"""The OpenAI-compatible HTTP gateway: `/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/health` and `/metrics`, translated to `RouterService.Generate`.

Request bodies become a `GenerationPlan` (params.py, chat_template.py), the plan
becomes one gRPC stream to the router (upstream.py), and the stream becomes an
OpenAI JSON body or SSE events (responses.py). gRPC status codes map to HTTP
status codes and OpenAI error objects in one place (errors.py). app.py wires the
routes; main.py runs it under uvicorn.
"""
