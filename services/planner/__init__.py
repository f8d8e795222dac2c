"""The planner: a control loop that sizes the prefill and decode pools against TTFT/ITL SLOs.

Plain-Python cores first (this package's modules are pure and clock-injected):
`forecast` (what the next interval's load will be), `capacity` (what one worker
can do at a given prompt length and ITL target), `sizing` (how many workers of
each role the forecast needs, jointly, within a budget) and `hysteresis` (when a
new size may be applied, so the loop never flaps). Around them: `observe` (an
interval's Observation from two reads of cumulative counters), `stats_reader`
(those reads over gRPC), `loop` (read, decide, actuate), `actuators`,
`metrics`, `config` and `main` (the service); pdmesh/local_planner.py runs the
same loop inside `pdmesh up --planner`.
"""
