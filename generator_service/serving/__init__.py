"""The public port: the Generator and Jobs gRPC servicers, the server (health, reflection, graceful stop),
request-handler slots and the send watchdog, uploaded references, proto <-> domain conversion (requests, results,
GetStatus)."""
