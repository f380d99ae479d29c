"""Retention: how long queues keep their messages, and the trimming that enforces it."""
