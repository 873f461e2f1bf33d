"""The durable jobs API's core (no gRPC): the jobs service and its dispatcher, the job store and its schema,
result files, retention, the jobs flags."""
