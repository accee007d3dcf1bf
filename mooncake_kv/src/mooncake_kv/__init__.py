"""mooncake_kv."""
