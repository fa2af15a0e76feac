"""Facts about this host (architecture, kernel, CRIU, GPUs) and whether it can take a given checkpoint."""
