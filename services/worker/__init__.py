"""The worker framework: what decode and prefill workers share (bootstrap, the
RPCs they serve alike, engine metrics). It sits above services/common, the
engine and the kvtransfer library, and below the worker services."""
