"""The durable jobs API's core (no gRPC): the jobs service, its dispatcher and recorder and the live overlay they
share, the job store and its schema, result files, retention, the jobs flags."""
