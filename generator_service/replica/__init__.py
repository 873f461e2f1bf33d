"""A replica of N generator ranks (no gRPC): rank 0's link to the others, the followers' loop, the work items
they exchange."""
