"""Measure candidates on other machines through TVM's RPC tracker (issue #35, part 2).

TVM users already spread tuning over a rack of devices this way: a tracker
(``python -m tvm.exec.rpc_tracker --port 9190``) and, on every device, a server registered
under a key. A Collage server is TVM's RPC server started with this module's
``server_init`` (``python -m collage_tvm.measure.remote --tracker HOST:9190 --key KEY``):
its sessions answer ``collage.measure`` by handing the request to a measuring child
process (``worker.Worker``, as a local search measures), so a candidate that crashes or
hangs costs that candidate (inf, with the reason), not the server. The server's machine
needs collage-tvm and the backends' libraries installed: library candidates (ONNX
Runtime, OpenVINO, oneDNN, MKL) and TVM's kernels alike are built and timed there.

The searching side (``RemoteDevices``) opens a session with every server registered
under the key, sends each request as the local worker's message (pickled: the backends'
lowering specs, the candidate's function as JSON with its large weights left behind,
the target, the ``build_vm`` reference) and spreads a batch over the free sessions
(``map``). A session whose server dies or hangs past ``timeout_s`` is dropped and its
request goes to another server: nothing is lost while one server lives. Costs are keyed
by the servers' device (``device``), not by the searching machine.

Trusted networks only: like TVM's RPC itself, a server runs what it is sent.
"""
from __future__ import annotations

import argparse
import json
import logging
import pickle
import queue
import socket
import threading
import time

logger = logging.getLogger("collage_tvm")

MEASURE_FUNC = "collage.measure"
WHOAMI_FUNC = "collage.whoami"
_REPLY_TIMEOUT_S = 600.0  # beyond the server's own per-candidate timeout (worker: 300 s)


class RemoteError(RuntimeError):
    """The tracker cannot be reached, no server serves the key, or every server died."""


# ------------------------------------------------------------------------- server side

_worker = None


def _measure(message: bytes) -> bytes:
    """``collage.measure``: the local worker's reply to one pickled request."""
    global _worker
    from .worker import _TIMEOUT_S, CALLBACK_TIMEOUT_S, Worker

    if _worker is None:
        _worker = Worker()
    request = pickle.loads(message)
    _worker.timeout_s = CALLBACK_TIMEOUT_S if request[0] == "run_callback" else _TIMEOUT_S
    return pickle.dumps(_worker._ask(request))


def _whoami(target_json: str) -> str:
    """``collage.whoami``: JSON of the fingerprint this machine's costs are keyed by
    ("device") and which server answers ("server": host and the server's process; each
    session is a process forked from it)."""
    import os
    import socket

    import tvm

    from ..target import device_fingerprint

    device = device_fingerprint(tvm.target.Target(json.loads(target_json)))
    return json.dumps({"device": device, "server": f"{socket.gethostname()}:{os.getppid()}"})


def server_init() -> None:
    """TVM RPC server's ``server_init_callback``: registers Collage's functions in the
    server process (its sessions are forked from it and see them)."""
    import tvm

    tvm.register_global_func(MEASURE_FUNC, _measure, override=True)
    tvm.register_global_func(WHOAMI_FUNC, _whoami, override=True)


def start_server(tracker: str, key: str, host: str = "0.0.0.0", port: int = 9090,
                 port_end: int = 9199, custom_addr: str | None = None, silent: bool = True):
    """A TVM RPC server that measures Collage's candidates, registered at ``tracker``
    ("HOST:PORT") under ``key``; returns ``tvm.rpc.Server`` (``terminate()`` stops it)."""
    from tvm import rpc

    return rpc.Server(host, port=port, port_end=port_end, key=key,
                      tracker_addr=parse_address(tracker), custom_addr=custom_addr,
                      server_init_callback=server_init, silent=silent)


def parse_address(address: str) -> tuple:
    """("HOST", PORT) of "HOST:PORT"; a clear ValueError otherwise."""
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"an RPC tracker address is HOST:PORT, got {address!r}")
    return host, int(port)


# ------------------------------------------------------------------------- client side

class _Session:
    def __init__(self, sess, target_json: str):
        self.sess = sess
        self.measure = sess.get_function(MEASURE_FUNC)
        me = json.loads(sess.get_function(WHOAMI_FUNC)(target_json))
        self.device, self.address = me["device"], me["server"]


# Seconds to wait for the tracker to accept a connection.
_CONNECT_TIMEOUT_S = 10.0


class RemoteDevices:
    """Sessions with the servers registered under ``key`` at the tracker ``tracker``
    ("HOST:PORT"). ``device``: the fingerprint their costs are keyed by (the first
    server's; the servers under one key are meant to be alike)."""

    def __init__(self, tracker: str, key: str, target_json: str,
                 timeout_s: float = _REPLY_TIMEOUT_S):
        from tvm import rpc

        if not key:
            raise ValueError("measuring through an RPC tracker needs the servers' key "
                             "(rpc_key / --rpc-key)")
        self.tracker, self.key, self.timeout_s = tracker, key, timeout_s
        host, port = parse_address(tracker)
        try:
            # TVM's connect_tracker retries a refused connection for 60 s: a wrong address
            # is answered at once instead.
            socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S).close()
            self.client = rpc.connect_tracker(host, port)
        except Exception as err:  # noqa: BLE001 - say which tracker
            raise RemoteError(f"cannot reach the RPC tracker at {tracker}: {err}") from err
        self.target_json = target_json
        self.sessions: list = []
        for _ in range(self.servers()):
            self.sessions.append(self._open())
        if not self.sessions:
            raise RemoteError(
                f"no server is registered under the key {key!r} at the RPC tracker {tracker}: "
                f"start one on each device with python -m collage_tvm.measure.remote "
                f"--tracker {tracker} --key {key}")
        self.device = self.sessions[0].device
        others = sorted({s.device for s in self.sessions} - {self.device})
        if others:
            logger.warning("the servers under %r are not alike (%s and %s): their costs are "
                           "all keyed as %s", key, self.device, ", ".join(others), self.device)
        self.requeued = 0  # requests sent again after their server failed
        self.dropped: list = []  # (server, why) of the sessions lost
        logger.info("measuring on %d server(s) under %r at %s (%s)", len(self.sessions), key,
                    tracker, self.device)

    def servers(self) -> int:
        """Servers registered under the key (free or busy)."""
        try:
            info = self.client.summary()
        except Exception as err:  # noqa: BLE001
            raise RemoteError(f"the RPC tracker at {self.tracker} did not answer: {err}") from err
        return sum(1 for s in info.get("server_info", [])
                   if s.get("key", "").split(":", 1)[-1] == self.key)

    def _open(self) -> _Session:
        try:
            sess = self.client.request(self.key, priority=1, session_timeout=0, max_retry=2)
            return _Session(sess, self.target_json)
        except Exception as err:  # noqa: BLE001
            raise RemoteError(f"cannot open a session with a server under {self.key!r} at "
                              f"{self.tracker}: {err}") from err

    def call(self, message, timeout_s: float | None = None) -> tuple:
        """The reply (cost, reason, extra) to one request, on a free session."""
        return next(iter(self.map([message], timeout_s)))[1]

    def map(self, messages: list, timeout_s: float | None = None):
        """Yields ``(index, (cost, reason, extra))`` for each request as replies come,
        the requests spread over every session; ``extra["server"]`` names the session that
        answered. A session that fails or passes ``timeout_s`` (default: the devices') is
        dropped and its request sent again to another; raises ``RemoteError`` when no
        session is left."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        todo: queue.Queue = queue.Queue()
        for i, m in enumerate(messages):
            todo.put((i, pickle.dumps(m)))
        done: queue.Queue = queue.Queue()
        left = len(messages)
        if not left:
            return
        stop = threading.Event()
        threads = [threading.Thread(target=self._serve, args=(s, todo, done, stop, timeout_s),
                                    daemon=True)
                   for s in list(self.sessions)]
        for t in threads:
            t.start()
        try:
            while left:
                try:
                    item = done.get(timeout=1.0)
                except queue.Empty:
                    if not any(t.is_alive() for t in threads):
                        raise RemoteError(
                            f"every server under {self.key!r} at {self.tracker} failed "
                            f"({'; '.join(f'{a}: {w}' for a, w in self.dropped[-3:])}); "
                            f"{left} request(s) not measured") from None
                    continue
                left -= 1
                yield item
        finally:
            stop.set()
            for t in threads:
                t.join(0.1)

    def _serve(self, session: _Session, todo: queue.Queue, done: queue.Queue,
               stop: threading.Event, timeout_s: float) -> None:
        """One session's loop: take a request, send it, hand the reply on, until the batch
        is done (``stop``) or the session fails. An idle session keeps waiting: a request
        another server fails on comes back to the queue for it."""
        while not stop.is_set():
            try:
                i, payload = todo.get(timeout=0.1)
            except queue.Empty:
                continue
            reply = self._ask(session, payload, timeout_s)
            if reply is None:  # the session failed: the request goes back for another
                todo.put((i, payload))
                self.requeued += 1
                return
            done.put((i, reply))

    def _ask(self, session: _Session, payload: bytes, timeout_s: float):
        """The reply, or None after dropping a session that failed or hung."""
        box: list = []
        t = threading.Thread(target=lambda: box.append(self._send(session, payload)),
                             daemon=True)
        t.start()
        t.join(timeout_s)
        if not box:
            self._drop(session, f"no reply in {timeout_s:.0f} s")
            return None
        ok, value = box[0]
        if not ok:
            self._drop(session, value)
            return None
        cost, reason, extra = value
        return cost, reason, {**extra, "server": session.address}

    @staticmethod
    def _send(session: _Session, payload: bytes) -> tuple:
        try:
            return True, pickle.loads(bytes(session.measure(payload)))
        except Exception as err:  # noqa: BLE001 - a dead server, a closed session
            return False, f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"

    def _drop(self, session: _Session, why: str) -> None:
        if session in self.sessions:
            self.sessions.remove(session)
            self.dropped.append((session.address, why))
            logger.warning("RPC server %s dropped (%s); its candidate goes to another server",
                           session.address, why)

    def close(self) -> None:
        self.sessions = []


def main(argv=None) -> None:
    """``python -m collage_tvm.measure.remote --tracker HOST:PORT --key KEY``."""
    p = argparse.ArgumentParser(
        prog="python -m collage_tvm.measure.remote",
        description="A TVM RPC server that measures Collage's candidates on this machine, "
                    "registered at a TVM RPC tracker (collage-tvm optimize --rpc-tracker "
                    "HOST:PORT --rpc-key KEY sends it candidates)")
    p.add_argument("--tracker", required=True, metavar="HOST:PORT")
    p.add_argument("--key", required=True, help="the device kind the searches ask for")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=9090)
    p.add_argument("--port-end", type=int, default=9199)
    p.add_argument("--custom-addr", default=None,
                   help="the address to report to the tracker (default: as the tracker sees it)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    server = start_server(args.tracker, args.key, args.host, args.port, args.port_end,
                          args.custom_addr, silent=False)
    print(f"collage-tvm RPC server on port {server.port}, key {args.key!r}, tracker "
          f"{args.tracker}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.terminate()


if __name__ == "__main__":
    main()
