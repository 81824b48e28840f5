"""Launches of the tests' scripts forked from a warm process (a zygote), in place of a fresh
interpreter for each process: each launch of a DeepSpeed run paid 5-7 s of CPU per process
before its first step (importing torch, DeepSpeed, smartinf, and the torch.compile stack that
DeepSpeed's optimizer check pulls in), for a run of the tiny model of about a second.

A zygote is started once per pytest worker and kind (``zygote(kind)``, on first use by
``run``, ``start`` or ``spawn``; ``fresh()``: where a CUDA GPU is visible, or with
SMARTINF_TESTS_FRESH=1, these launch fresh interpreters as before): a plain interpreter
with the environment the launches share, that imports the kind's modules and then waits.
Each launch forks a launcher from it (a session of its own), which forks the processes:

- ``run(argv, world=W)``: ``argv[0]`` (a Python script) run as ``__main__`` in W ranks, with
  the environment ``torch.distributed.run`` gives its workers (RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE, MASTER_ADDR/PORT, the TORCHELASTIC_ ones; rank 0 hosts the rendezvous
  store, as without an agent); like torchrun, the first rank to fail ends the others
  (SIGTERM, then SIGKILL) and the launch fails. ``world=None``: one plain process, as
  ``python script``. The result is ``subprocess.run``'s (args, returncode, stdout, stderr).
- ``spawn(fn, args, nprocs)``: ``fn(rank, *args)`` in each process, as
  ``torch.multiprocessing.spawn`` (fn a module-level function of an importable module); a
  process that raises fails it with its traceback.

A forked process is the zygote's state plus its own: its environment, working directory,
``sys.argv`` and ``sys.path[0]`` as a fresh ``python script`` would have them, its own
seeds of ``random`` and numpy's global generator (a fresh interpreter draws new ones; torch's
default generator is untouched, fixed at start as in a fresh one), its stdout and stderr. It
leaves as the scripts do, with ``os._exit`` (after the atexit functions): no C++ static
destructors. Nothing is shared between launches: each is a fork of the same warm state.

    python tests/warm.py SOCKET MODULE[,MODULE...]      (the zygote; started by zygote())
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN_ENV = {"GROUP_RANK": "0", "ROLE_NAME": "default", "GROUP_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
GRACE_S = 30  # torchrun's: SIGTERM, then SIGKILL


# -- the client (a pytest worker) -------------------------------------------------------------
class Zygote:
    def __init__(self, modules: tuple, env: dict):
        self.env = dict(env)
        self.dir = tempfile.mkdtemp(prefix="smartinf-zygote-")
        self.socket = os.path.join(self.dir, "socket")
        self.proc = subprocess.Popen([sys.executable, __file__, self.socket, ",".join(modules)],
                                     cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the zygote for {modules} did not start: {line!r}")
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        subprocess.run(["rm", "-rf", self.dir], check=False)

    def _launch(self, request: dict, timeout: float, what) -> tuple:
        launch = self._start(request, what)
        try:
            code = launch.wait(timeout)
            return code, launch.stdout(), launch.stderr()
        finally:
            launch.close()

    def _start(self, request: dict, what) -> "Launch":
        out, err = (tempfile.NamedTemporaryFile(dir=self.dir, delete=False) for _ in range(2))
        out.close(), err.close()
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(self.socket)
            s.sendall(pickle.dumps(dict(request, stdout=out.name, stderr=err.name)))
            s.shutdown(socket.SHUT_WR)
            launch = Launch(what, s, out.name, err.name)
            launch.pid = int(launch.line(None))
            return launch
        except BaseException:
            s.close()
            os.unlink(out.name)
            os.unlink(err.name)
            raise

    def start(self, argv: list, *, world: int, env: dict, cwd=ROOT, port: int = 0) -> "Launch":
        """``run``'s launch, not waited for: its launcher's pid (its session's), its output
        as it comes."""
        argv = [str(a) for a in argv]
        what = ["warm-torchrun", f"--nproc_per_node={world}", "--master_port", str(port)] + argv
        return self._start({"kind": "script", "argv": argv, "world": world, "port": port,
                            "cwd": str(cwd), "env": dict(env)}, what)

    def run(self, argv: list, *, world: int | None = None, env: dict | None = None,
            cwd=ROOT, port: int = 0, timeout: float = 900) -> subprocess.CompletedProcess:
        """``argv`` ([script, *args]) as ``python`` (world None) or ``torchrun
        --nproc_per_node=world --master_port=port`` would run it."""
        argv = [str(a) for a in argv]
        what = (["warm-python"] if world is None else
                ["warm-torchrun", f"--nproc_per_node={world}", "--master_port", str(port)]) + argv
        code, out, err = self._launch({"kind": "script", "argv": argv, "world": world,
                                       "port": port, "cwd": str(cwd),
                                       "env": dict(self.env if env is None else env)},
                                      timeout, what)
        return subprocess.CompletedProcess(what, code, out, err)

    def spawn(self, fn, args: tuple = (), nprocs: int = 1, env: dict | None = None,
              timeout: float = 900) -> None:
        """``torch.multiprocessing.spawn(fn, args, nprocs)`` (join): raises with the failing
        process's output where one fails."""
        what, request = self._call(fn, args, nprocs, env)
        code, out, err = self._launch(request, timeout, what)
        if code != 0:
            raise RuntimeError(f"{' '.join(what)} failed ({code}):\n{out[-3000:]}\n{err[-6000:]}")

    def start_spawn(self, fn, args: tuple = (), nprocs: int = 1, env: dict | None = None) -> "Launch":
        """``spawn``'s launch, not waited for (``torch.multiprocessing.start_processes(...,
        join=False)``): its processes are its launcher's children, and one that fails does not
        end the others."""
        what, request = self._call(fn, args, nprocs, env)
        return self._start(dict(request, end_others=False), what)

    @staticmethod
    def _call(fn, args: tuple, nprocs: int, env: dict | None) -> tuple:
        what = ["warm-spawn", f"{fn.__module__}.{fn.__qualname__}", f"nprocs={nprocs}"]
        return what, {"kind": "call", "fn": (fn.__module__, fn.__qualname__), "args": args,
                      "world": nprocs, "cwd": os.getcwd(),
                      "env": dict(os.environ if env is None else env)}


class Launch:
    """A launch under way: ``pid`` its launcher (the leader of the launch's session)."""

    def __init__(self, what, sock, out: str, err: str):
        self.what, self.sock, self.out, self.err = what, sock, out, err
        self.buffer, self.pid, self.code = b"", 0, None

    def line(self, timeout: float | None, block: bool = True) -> str | None:
        """The launcher's next line (its pid, then its exit status); None where not blocking
        and none has come."""
        self.sock.settimeout(timeout if block else 0.0)
        while b"\n" not in self.buffer:
            try:
                got = self.sock.recv(256)
            except BlockingIOError:
                return None
            except (socket.timeout, TimeoutError):
                if not block:
                    return None
                _kill_session(self.pid)
                raise subprocess.TimeoutExpired(self.what, timeout)
            if not got:
                raise RuntimeError(f"the zygote's launcher of {' '.join(self.what)} died")
            self.buffer += got
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    def wait(self, timeout: float | None = None) -> int:
        if self.code is None:
            self.code = int(self.line(timeout))
        return self.code

    def done(self) -> bool:
        if self.code is None:
            line = self.line(None, block=False)
            if line is None:
                return False
            self.code = int(line)
        return True

    def lines(self, poll_s: float = 0.01):
        """Its stdout's lines as they are written, until it ends."""
        with open(self.out, errors="replace") as f:
            part = ""
            while True:
                ended = self.done()
                part += f.read()
                *whole, part = part.split("\n")
                for line in whole:
                    yield line + "\n"
                if ended:
                    if part:
                        yield part
                    return
                time.sleep(poll_s)

    def stdout(self) -> str:
        return Path(self.out).read_text(errors="replace")

    def stderr(self) -> str:
        return Path(self.err).read_text(errors="replace")

    def close(self) -> None:
        self.sock.close()
        for path in (self.out, self.err):
            if os.path.exists(path):
                os.unlink(path)


class FreshLaunch:
    """``Launch``'s interface over ``torch.distributed.run`` itself (``start`` where fresh)."""

    def __init__(self, what, env: dict, cwd):
        self.what = what
        self.proc = subprocess.Popen(what, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.pid = self.proc.pid

    def lines(self):
        yield from self.proc.stdout

    def stderr(self) -> str:
        return ""  # (in stdout)

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        self.proc.wait()
        self.proc.stdout.close()


_zygotes: dict = {}


def zygote(kind: str, modules: tuple, env: dict) -> Zygote:
    """This process's zygote of ``kind`` (started on first use, with ``env``, importing
    ``modules``)."""
    if kind not in _zygotes or _zygotes[kind].proc.poll() is not None:
        _zygotes[kind] = Zygote(modules, env)
    return _zygotes[kind]


def fresh() -> bool:
    """Launches start fresh interpreters through the launchers themselves (as before
    tests/warm.py) where a CUDA GPU is visible (a fork must not inherit a CUDA context the
    warm process may have made, and CUDA runs are few), or where SMARTINF_TESTS_FRESH=1."""
    import torch
    return os.environ.get("SMARTINF_TESTS_FRESH") == "1" or torch.cuda.is_available()


def torchrun_cmd(world: int | None, port: int, argv: list) -> list:
    return [sys.executable, *(["-m", "torch.distributed.run", f"--nproc_per_node={world}",
                               "--master_port", str(port)] if world is not None else []),
            *map(str, argv)]


def run(kind: str, modules: tuple, argv: list, *, world: int | None, env: dict, port: int = 0,
        cwd=ROOT, timeout: float = 900, fresh_: bool = False) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=world --master_port=port argv`` (``python argv`` where world
    is None), forked from the zygote of ``kind``; fresh (``fresh_`` or ``fresh()``): run so."""
    if fresh_ or fresh():
        return subprocess.run(torchrun_cmd(world, port, argv), cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
    return zygote(kind, modules, env).run(argv, world=world, env=env, cwd=cwd, port=port,
                                          timeout=timeout)


def start(kind: str, modules: tuple, argv: list, *, world: int, env: dict, port: int,
          cwd=ROOT):
    """``run``'s launch, not waited for: a ``Launch`` (or a ``FreshLaunch``)."""
    if fresh():
        return FreshLaunch(torchrun_cmd(world, port, argv), env, cwd)
    return zygote(kind, modules, env).start(argv, world=world, env=env, cwd=cwd, port=port)


def spawn(kind: str, modules: tuple, fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, forked from the zygote of ``kind``
    (or that itself, where fresh)."""
    if fresh():
        import torch.multiprocessing
        torch.multiprocessing.spawn(fn, args=args, nprocs=nprocs)
    else:
        zygote(kind, modules, dict(os.environ)).spawn(fn, args, nprocs)


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- the zygote ---------------------------------------------------------------------------
def _serve(path: str, modules: list) -> None:
    sys.path.insert(1, str(ROOT))  # (for the modules below; a launch's own is a fresh one's)
    for name in modules:
        importlib.import_module(name)
    import gc
    gc.collect()
    gc.freeze()  # (the forks' collections leave the warm objects' pages shared)
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(8)
    server.settimeout(1.0)
    parent = os.getppid()
    print("ready", flush=True)
    while os.getppid() == parent:  # (its pytest worker gone: so is it)
        try:
            conn, _ = server.accept()
        except (socket.timeout, TimeoutError):
            continue
        conn.settimeout(None)
        try:
            request = pickle.loads(b"".join(iter(lambda: conn.recv(1 << 16), b"")))
        except Exception:  # (a client gone mid-request: the next one is served)
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        first = os.fork()
        if first == 0:  # a launcher of its own session, reparented once this one leaves
            server.close()
            if os.fork() == 0:
                os.setsid()
                code = 1
                try:
                    conn.sendall(f"{os.getpid()}\n".encode())
                    code = _launch(request, conn.fileno())
                finally:
                    try:
                        conn.sendall(f"{code}\n".encode())
                    finally:
                        os._exit(0)
            os._exit(0)
        os.waitpid(first, 0)
        conn.close()


def _launch(request: dict, conn: int) -> int:
    out = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND)
    world = request["world"]
    ranks = {}
    for rank in range(world or 1):
        pid = os.fork()
        if pid == 0:
            os.close(conn)  # (the client hears of the launcher alone)
            os.dup2(out, 1)
            os.dup2(err, 2)
            _child(request, rank)  # (does not return)
        ranks[pid] = rank
    os.dup2(out, 1)
    os.dup2(err, 2)
    failed = code = 0
    while ranks:
        pid, status = os.wait()
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = code
            if world is not None and request.get("end_others", True):
                os.write(2, f"warm launch: rank {rank} exited with {code}: ending the "
                            f"others\n".encode())
                _end(ranks)
    if world is None:
        return code
    return 1 if failed else 0


def _end(ranks: dict) -> None:
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + GRACE_S
    while ranks and time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            ranks.pop(pid, None)
        else:
            time.sleep(0.05)
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _child(request: dict, rank: int) -> None:
    code = 1
    try:
        env = dict(request["env"])
        world = request["world"]
        if request["kind"] == "script" and world is not None:
            env.update(TORCHRUN_ENV, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank),
                       WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       ROLE_WORLD_SIZE=str(world), MASTER_PORT=str(request["port"]))
            env.setdefault("OMP_NUM_THREADS", "1")
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        import random
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        if "torch" in sys.modules and env.get("OMP_NUM_THREADS"):
            sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
        if request["kind"] == "script":
            import runpy
            script = os.path.abspath(request["argv"][0])
            sys.argv = [request["argv"][0], *request["argv"][1:]]
            sys.path[:] = [os.path.dirname(script), *FRESH_PATH[1:]]
            runpy.run_path(script, run_name="__main__")
        else:
            module, name = request["fn"]
            fn = importlib.import_module(module)
            for part in name.split("."):
                fn = getattr(fn, part)
            fn(rank, *request["args"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    FRESH_PATH = list(sys.path)  # what `python script` starts with, but for path[0]
    _serve(sys.argv[1], [m for m in sys.argv[2].split(",") if m])
