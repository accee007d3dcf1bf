"""mooncake_ops."""
