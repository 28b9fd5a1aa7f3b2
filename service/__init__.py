"""Decode service: model spec, checkpoints, JAX engine, scheduler, gRPC server, tracing."""
