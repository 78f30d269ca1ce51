"""Process groups and sharding: the (pp, dp) mesh, launcher environment, FSDP2 wrapping, local spawning."""
