"""mmmesh sidecar: frames and tags tensor streams, runs a model stage, measures SLAs."""
