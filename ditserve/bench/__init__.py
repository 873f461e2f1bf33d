"""`ditserve bench`: the seed's scenarios side by side on real services (see README "Performance")."""
