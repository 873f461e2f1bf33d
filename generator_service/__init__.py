"""generator_service: the public gRPC service (request queue, denoise executor, plan client)."""
