"""Client side: the producer and its queue selectors."""
