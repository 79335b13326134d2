"""Scheduling and KV-cache bookkeeping: no tensors live here."""
