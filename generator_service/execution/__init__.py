"""Running admitted requests (no gRPC): a `Run` and its events, admission and the bounded queue, the executor
thread, prefetch, mux, drain and step bounds, the registry of live runs."""
