"""Collectives that work on every backend and device pair (``comm``), and the rank mesh with its process groups (``mesh``)."""
