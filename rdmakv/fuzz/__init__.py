"""Structure-aware protocol fuzzer for the rdmakv node (issue 13).

It drives a REAL ``rdmakv serve`` (a child process on 127.0.0.1, ``--port 0``,
a shared-secret token required, tcp) over real sockets with Hypothesis-built
frames of every type -- HELLO, ALLOC, COMMIT, ABORT, LOOKUP, RELEASE, DELETE,
EXISTS, STATS, GET, PUT, RDMA_CONNECT / RDMA_DISCONNECT and unknown opcodes
(the retired WRITE / READ among them) -- both well-formed with hostile field
values and mutated (cut short, bits flipped, header lengths that lie, bytes
spliced, garbage), on
authenticated and unauthenticated connections, many frames per connection,
some pipelined. Before fuzzing, a victim stores values through the ordinary
:class:`~rdmakv.client.node_client.KVClient`; after every example the node must be alive,
hold exactly what the reference model says (no leaked lease or extent,
nothing evicted) and give the victim every value back byte for byte. Every
answer must be a well-formed frame (decoded with :mod:`rdmakv.wire`) that
the model accepts, or a clean close where the protocol says the node closes.

Modules: :mod:`~rdmakv.fuzz.strategies` (the Hypothesis strategies, reusable),
:mod:`~rdmakv.fuzz.wire` (raw frames and a deadlock-free socket),
:mod:`~rdmakv.fuzz.reference_node` (the oracle), :mod:`~rdmakv.fuzz.harness` (node,
victim, examples, :func:`run_fuzz`).

Running it (needs the dev extra: ``pip install -e '.[dev]'`` for Hypothesis):

* CI, bounded and reproducible (fixed seeds, no example database):
  ``pytest tests/test_fuzz_protocol.py``; ``RDMAKV_FUZZ_FRAMES`` sets the
  frame count (default 3000) and the test prints the frames sent.
* By hand, long: ``python -m rdmakv.fuzz --frames 1000000 [--seed N]
  [--progress 10] [--workdir DIR] [--known-bugs [NAMES]]``; prints a progress line
  every ``--progress`` seconds on stderr and the totals as JSON on stdout;
  exit status 1 on a failure, whose message ends with the transcript of the
  failing example and names the file holding the exact bytes sent
  (``send <cid> <hex>`` / ``shut <cid>`` / ``close <cid>`` lines after the
  commented transcript); ``python -m rdmakv.fuzz --replay FILE`` sends those
  bytes to a fresh node (same token) and prints every answer.

``--known-bugs [NAMES]`` chooses which input classes of
:data:`rdmakv.fuzz.strategies.KNOWN_BUGS` (node bugs the fuzzer found, now
fixed) are generated: all by default, so they stay fixed
(tests/test_fuzz_protocol.py keeps a reproducer of each as a regression test).
"""

from rdmakv.fuzz.harness import FuzzConfig, FuzzReport, Target, frames_from_env, run_fuzz
from rdmakv.fuzz.wire import FuzzFailure

__all__ = ["FuzzConfig", "FuzzFailure", "FuzzReport", "Target", "frames_from_env", "run_fuzz"]
