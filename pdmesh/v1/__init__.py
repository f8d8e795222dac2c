"""Generated gRPC stubs of the pdmesh.v1 contract (never edit; run `make proto`)."""
