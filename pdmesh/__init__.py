"""pdmesh: disaggregated prefill/decode LLM serving over gRPC.

The client package: generated stubs of the `pdmesh.v1` contract under
`pdmesh.v1` (never edited; `make proto`), a small client and the CLI.
"""

__version__ = "0.1.0"
