"""KV store storage node: one preallocated memory segment served over UCX, mounted at the master."""
