"""generator_service: the public gRPC service, one subpackage per concern: serving (the public port), jobs (the
durable jobs API), execution (runs: queue, executor, prefetch, mux, drain), replica (N ranks), backends (the model)."""
