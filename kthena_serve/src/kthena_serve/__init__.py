"""kthena_serve."""
