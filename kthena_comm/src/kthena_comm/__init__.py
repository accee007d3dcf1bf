"""kthena_comm."""
