"""`ditserve bench`: the seed's scenarios side by side on real services (see docs/performance.md)."""
