"""qosd: the mmmesh node daemon (policy store, reconciler, admin API, metrics)."""
