"""An engine object (``LlamaCppModel``, ``LlamaCppSequences``) built and driven in a child process of its own, so
that a crash of the native code under it (a segmentation fault, an abort) is an exception naming the signal in the
caller, not the end of the caller's process.

llama.cpp is C++: a kernel fault on one CPU or a failed ``GGML_ASSERT`` kills whatever process loaded it. Tests and
``bench serve`` therefore reach it through ``EngineProcess``: the child is started with ``spawn`` (no copy of the
caller's threads, locks or torch state), builds the object from its class and arguments, then answers method calls
and attribute reads sent over a pipe. Results travel back pickled (numpy arrays, numbers, dataclasses). Timings the
engine measures are taken inside the child, so the pipe adds nothing to them.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import signal
import traceback
from typing import Any

from dha_train.errors import DhaTrainError

# How long a call may take before the child is taken for hung (a deadlock in native code): generous, since one
# bench serve decode round at 8K on 2 cores takes minutes.
CALL_TIMEOUT_S = 3600.0


class EngineCrashedError(DhaTrainError):
    """The engine's process died (by a signal or an exit) in the middle of a call: the message names it."""


class _Method:
    """The answer to reading an attribute that is a method: it is called through the proxy."""


class _RemoteError:
    """An exception raised in the child, carried back by type and message (its traceback as text)."""

    def __init__(self, exc: BaseException):
        self.exc = exc
        self.trace = traceback.format_exc()


def _send(connection, kind: str, value: Any) -> None:
    """Send an answer; one that does not pickle goes back as an error naming it."""
    try:
        connection.send((kind, value))
    except (pickle.PicklingError, TypeError, AttributeError) as exc:  # pickling refused the value (or the exception)
        what = value.exc if isinstance(value, _RemoteError) else value
        connection.send(('error', _RemoteError(RuntimeError(f'{type(what).__name__} {what!r:.200} did not pickle '
                                                              f'back from the engine process: {exc}'))))


def _serve(connection, cls, args, kwargs) -> None:
    """The child's loop: build ``cls(*args, **kwargs)``, then answer ('call', name, args, kwargs) and ('get', name)
    requests until ('close',) or the pipe closes."""
    try:
        engine = cls(*args, **kwargs)
    except BaseException as exc:  # noqa: B902  (every failure goes back to the caller)
        _send(connection, 'error', _RemoteError(exc))
        return
    connection.send(('ready', None))
    while True:
        try:
            request = connection.recv()
        except EOFError:
            break
        if request[0] == 'close':
            break
        try:
            value = getattr(engine, request[1])
            if request[0] == 'call':
                result = value(*request[2], **request[3])
            else:  # a method is called through the proxy; only its being one travels
                result = _Method() if callable(value) else value
            _send(connection, 'ok', result)
        except BaseException as exc:  # noqa: B902
            _send(connection, 'error', _RemoteError(exc))
    close = getattr(engine, 'close', None)
    if callable(close):
        close()
    connection.send(('closed', None))


def death(exitcode: int | None) -> str:
    """How a child process ended, in words: 'signal SIGSEGV (11)', 'exit code 1', or 'no exit (hung)'."""
    if exitcode is None:
        return 'no exit (hung)'
    if exitcode < 0:
        try:
            return f'signal {signal.Signals(-exitcode).name} ({-exitcode})'
        except ValueError:
            return f'signal {-exitcode}'
    return f'exit code {exitcode}'


class _Caller:
    """What ``run_isolated`` builds in the child: one function, called once."""

    def __init__(self, function):
        self.function = function

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)


def run_isolated(function, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` (a module-level function) in a child process of its own, as ``EngineProcess``
    runs an engine: a crash raises ``EngineCrashedError`` naming the signal."""
    with EngineProcess(_Caller, function) as caller:
        return caller.call('run', *args, **kwargs)


class EngineProcess:
    """``cls(*args, **kwargs)`` living in a child process; its methods and attributes are reached as if local.

    ``with EngineProcess(LlamaCppModel, path, n_ctx=64) as engine: engine.logits(tokens)``. An exception the engine
    raises is raised again here with its own type; a crash raises ``EngineCrashedError`` naming the signal and the
    call it happened in, and the child is gone (every later call raises the same)."""

    def __init__(self, cls: type, *args: Any, timeout_s: float = CALL_TIMEOUT_S, **kwargs: Any):
        context = multiprocessing.get_context('spawn')
        self._connection, child_end = context.Pipe()
        self._label = f'{cls.__name__}({", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])})'
        self._timeout_s = timeout_s
        self._crashed: str | None = None
        self._process = context.Process(target=_serve, args=(child_end, cls, args, kwargs), daemon=True)
        self._process.start()
        child_end.close()
        self._answer('starting')

    def _answer(self, what: str) -> Any:
        if self._crashed:
            raise EngineCrashedError(self._crashed)
        try:
            ready = self._connection.poll(self._timeout_s)
            kind, value = self._connection.recv() if ready else ('hung', None)
        except (EOFError, ConnectionError):
            kind, value = 'died', None
        if kind in ('hung', 'died'):
            if kind == 'hung':
                self._process.kill()
            self._process.join(10)
            self._crashed = f'the engine process crashed ({death(self._process.exitcode)}) while {what} {self._label}'
            raise EngineCrashedError(self._crashed)
        if kind == 'error':
            raise value.exc
        return value

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self._crashed:
            raise EngineCrashedError(self._crashed)
        self._connection.send(('call', name, args, kwargs))
        return self._answer(f'running {name} of')

    def __getattr__(self, name: str) -> Any:
        if name.startswith('_'):
            raise AttributeError(name)
        if self._crashed:
            raise EngineCrashedError(self._crashed)
        self._connection.send(('get', name))
        value = self._answer(f'reading {name} of')
        if isinstance(value, _Method):
            return lambda *args, **kwargs: self.call(name, *args, **kwargs)
        return value

    def close(self) -> None:
        if self._process.is_alive() and not self._crashed:
            # a child that dies while closing has nothing left to give back: the join below reaps it either way
            with contextlib.suppress(EOFError, ConnectionError):
                self._connection.send(('close',))
                if self._connection.poll(60):
                    self._connection.recv()
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._connection.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

