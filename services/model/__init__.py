"""The model layer: what both the router and the engines need to agree on.

The tokenizer, model presets and config reading, and the chained prefix-block
hash. It sits below the router and the engine (both import it) and above
`services/common` only; it imports no engine, no service and no transport.
"""
