"""``rdmakv bench``: rdmakv side by side with the stores users would pick instead.

* :mod:`~rdmakv.bench.driver` -- what every system's driver implements (the contract).
* :mod:`~rdmakv.bench.drivers` -- one module per system (rdmakv, socket loop, Redis,
  Mooncake Transfer Engine, InfiniStore, perftest).
* :mod:`~rdmakv.bench.runner` -- moves the same blocks through each, verifies every
  byte, measures latency and concurrency, writes JSON and plots.
"""
