"""``rdmakv bench``: rdmakv side by side with the stores users would pick instead.

(The top-level ``bench/`` folder holds the benchmark scripts, their results and
bench/README.md; this package is the command.)

* :mod:`~rdmakv.perf.command` -- one run: the three sections, then the files.
* :mod:`~rdmakv.perf.settings` -- what a run measures (:class:`BenchConfig`).
* :mod:`~rdmakv.perf.measure` -- the throughput timing loop: the same blocks
  through each system, every byte verified; arenas and checks the others share.
* :mod:`~rdmakv.perf.latency` -- lookups and a 1-block get beside a round trip.
* :mod:`~rdmakv.perf.concurrency` -- several client processes on one server.
* :mod:`~rdmakv.perf.report` -- ratios and the JSON result; :mod:`~rdmakv.perf.plot`
  -- its PNG plots (matplotlib, imported only there).
* :mod:`~rdmakv.perf.driver` -- what every system's driver implements (the contract).
* :mod:`~rdmakv.perf.drivers` -- one module per system (rdmakv, socket loop, Redis,
  Mooncake Transfer Engine, InfiniStore, perftest).
* :mod:`~rdmakv.perf.placement` -- where the latency section's client and servers run;
  :mod:`~rdmakv.perf.provenance` -- the ``meta`` block of every bench result.
"""
