"""Endpoint data the scheduler reads: gateway-wide in-flight counters (more sources come with routing)."""
