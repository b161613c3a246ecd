"""Chaos suite: real nodes under kill -9, SIGSTOP, wire faults and restarts (marker ``chaos``)."""
