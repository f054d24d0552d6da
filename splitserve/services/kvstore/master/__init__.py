"""KV store metadata master: pure state machine (``core``) behind a thin gRPC servicer (``server``)."""
