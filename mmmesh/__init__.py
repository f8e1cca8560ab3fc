"""mmmesh."""
