"""LocalNodeProcess: a real ``rdmakv serve`` child process on this machine.

Used by ``rdmakv demo`` and the test fixtures. The node is started with
``--port 0`` unless a port is given: it binds a free port and reports it on its
one stdout line (``rdmakv node ready on HOST:PORT ...``), which is parsed here,
so concurrent nodes never race for ports. The child is stopped when the object
is closed, and also when this process exits without closing it (killed,
crashed): the child's stdin is a pipe from this process and it runs with
``--exit-on-stdin-close``, so the end of that pipe stops it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from rdmakv.defaults import DEFAULT_HOST
from rdmakv.errors import RdmakvError

READY_TIMEOUT_S = 60.0
"""How long a starting node may take to print its ready line (imports included)."""
STOP_TIMEOUT_S = 15.0
READY_MARK = "ready on "


class NodeStartError(RdmakvError):
    """``rdmakv serve`` exited or stayed silent instead of reporting ready."""


class LocalNodeProcess:
    """A running ``rdmakv serve`` child; ``restart()`` comes back on the same port.

    ``options`` are CLI flags without the leading dashes, e.g.
    ``{"pool-size": "64MiB", "transport": "tcp"}``. Its stderr goes to
    ``stderr_path`` (or is inherited when None).
    """

    def __init__(
        self,
        options: dict[str, str] | None = None,
        *,
        host: str = DEFAULT_HOST,
        port: int = 0,
        stderr_path: Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.options = dict(options or {})
        self.host = host
        self.port = port
        self.stderr_path = stderr_path
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[str] | None = None
        self.ready_line = ""
        self.metrics_url: str | None = None  # http://HOST:PORT when started with metrics-port
        self.start()

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "rdmakv.cli", "serve", "--host", self.host]
        args += ["--port", str(self.port)]
        for name, value in self.options.items():
            args += ["--" + name.replace("_", "-"), str(value)]
        return [*args, "--exit-on-stdin-close", *self.extra_args]

    def start(self) -> None:
        err = self.stderr_path.open("ab") if self.stderr_path is not None else None
        try:
            self.proc = subprocess.Popen(
                self.argv(),
                stdin=subprocess.PIPE,  # never written: its end of file stops the node
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        finally:
            if err is not None:
                err.close()
        line: list[str] = []
        out = self.proc.stdout
        assert out is not None
        reader = threading.Thread(target=lambda: line.append(out.readline()), daemon=True)
        reader.start()
        reader.join(READY_TIMEOUT_S)
        if not line or READY_MARK not in line[0]:
            self.kill()
            detail = (
                self.stderr_path.read_text(errors="replace")[-2000:] if self.stderr_path else ""
            )
            raise NodeStartError(
                f"rdmakv serve did not report ready within {READY_TIMEOUT_S:.0f}s "
                f"(got {line[0].strip() if line else 'nothing'!r}). {detail}"
            )
        self.ready_line = line[0].strip()
        addr = self.ready_line.split(READY_MARK, 1)[1].split()[0]
        self.port = int(addr.rsplit(":", 1)[1])
        self.metrics_url = next(
            (w.split("=", 1)[1] for w in self.ready_line.split() if w.startswith("metrics=")),
            None,
        )

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def endpoint(self) -> str:
        """``HOST:PORT``, as the CLI and KVCacheManager take it."""
        return f"{self.host}:{self.port}"

    def alive(self) -> bool:
        """Whether the node process is still running: False once it has exited,
        reaped or not (a killed process has exited once its last thread has).

        ``Popen.poll()`` alone is not enough: while another thread is inside
        ``wait()`` (a fault proxy's thread running :meth:`kill`), it answers
        None even after the child died. So the kernel is asked too, without
        reaping the child (``WNOWAIT``), which leaves the waiter's result intact.
        """
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return False
        if not hasattr(os, "waitid"):  # Python before 3.13 on macOS: poll() is all there is
            return True
        try:
            return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:  # that other thread has reaped it already
            return False

    def kill(self) -> None:
        """SIGKILL: the node dies without any clean-up. Returns once it is reaped."""
        proc = self.proc  # the one killed, even if another thread restarts the node meanwhile
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
        self._close_pipes(proc)

    @staticmethod
    def _close_pipes(proc: subprocess.Popen[str] | None) -> None:
        """Our ends of a node's stdin and stdout, once it has exited."""
        if proc is not None and proc.poll() is not None:
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

    def terminate(self) -> int:
        """SIGTERM (clean shutdown) and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(STOP_TIMEOUT_S)

    def pause(self) -> None:
        """SIGSTOP, returning once the node is really stopped (alive but silent)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        # Delivery is asynchronous: without this wait, a request sent right
        # after could still be answered.
        stat = Path(f"/proc/{self.proc.pid}/stat")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
            if state in ("T", "t"):
                return
            time.sleep(0.001)
        raise NodeStartError(f"node pid {self.proc.pid} did not stop after SIGSTOP")

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate()
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipes(self.proc)

    def __enter__(self) -> LocalNodeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
