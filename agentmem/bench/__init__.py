"""Benchmarks: one module per `agentmem bench X`, each timing its peer in the same run and
printing its JSON last."""
