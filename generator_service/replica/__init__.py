"""A replica of N generator ranks (no gRPC): rank 0's link to the others (link), the followers' loop (follower),
the work items they exchange (work), the lockstep callback and lease adapters every rank's loop runs with (leases)."""
