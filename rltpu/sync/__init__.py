"""Trainer -> sampler weights: over collectives between processes (``collective``), in-process in
colocated mode (``colocated``), and the TCP stores both rendezvous on (``stores``)."""
