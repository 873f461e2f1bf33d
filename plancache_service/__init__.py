"""plancache_service: the plan-cache sidecar (slab, slot table, LRU, leases, host tier, rebuild)."""
