"""Rebalance: allocation strategies, the broker-side lock manager, client membership."""
