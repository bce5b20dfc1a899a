"""Rank 0's World and its workers: starting them, the messages between them, the watchdog, memory figures, other hosts."""
