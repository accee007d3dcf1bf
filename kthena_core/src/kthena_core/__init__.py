"""kthena_core."""
