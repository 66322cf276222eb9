"""Training side: losses, FSDP2 wrapping, optimizer, checkpoints and the trainer engine."""
