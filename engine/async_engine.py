"""Asyncio front of the engine: one background thread steps the engine; coroutines stream results.

The engine is not thread-safe, so only the loop thread touches it. Coroutines hand it commands through
a queue and receive `RequestOutput`s through per-request asyncio queues. If the loop crashes, every
pending and future request gets `EngineDeadError` instead of hanging.

`AsyncEngine.launch` builds the engine on the loop thread itself. libgomp gives every thread that opens
a parallel region a pool of its own; while a second pool lives (the thread that loaded the weights and
ran the start-up kernel race, kept by asyncio's executor), libgomp counts more threads than CPUs and
stops spin-waiting at its barriers, so each of a step's hundreds of parallel regions sleeps on a futex
(benchmarks/step_thread_layout.py measures both layouts).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from decodeservice.engine.engine import EncodedPrompt, Engine, Prompt
from decodeservice.engine.errors import EngineDeadError, EngineError
from decodeservice.engine.outputs import EngineStats, RequestOutput
from decodeservice.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: EncodedPrompt
    params: SamplingParams
    priority: int
    cache_salt: str | None
    sink: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._sinks: dict[str, _Add] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_error: BaseException | None = None
        self._stats = engine.stats()

    # -- lifecycle ---------------------------------------------------------------------------------
    @classmethod
    async def launch(cls, factory: Callable[[], Engine]) -> AsyncEngine:
        """Build the engine on a new thread and step it there: one thread, one OpenMP pool. Raises what
        `factory` raises; if the caller is cancelled while the engine loads, the thread stops after it."""
        loop = asyncio.get_running_loop()
        built: asyncio.Future[AsyncEngine] = loop.create_future()

        def hand_over(aengine: AsyncEngine | None, error: BaseException | None) -> None:
            if built.cancelled():
                if aengine is not None:
                    aengine.shutdown(timeout=0)
            elif error is not None:
                built.set_exception(error)
            else:
                built.set_result(aengine)  # type: ignore[arg-type]

        def build_then_run() -> None:
            try:
                aengine = cls(factory())
            except BaseException as exc:  # handed to the awaiting caller, not lost on this thread
                loop.call_soon_threadsafe(hand_over, None, exc)
                return
            aengine._thread = threading.current_thread()
            loop.call_soon_threadsafe(hand_over, aengine, None)
            aengine._run()

        threading.Thread(target=build_then_run, name="decode-engine-loop", daemon=True).start()
        return await built

    def start(self) -> None:
        """Step an engine built elsewhere on a new thread (tests; the server uses `launch`)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="decode-engine-loop", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._commands.put(None)
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The counters as of the last finished step (a consistent snapshot)."""
        return self._stats

    @property
    def num_unfinished(self) -> int:
        return len(self._sinks)

    # -- requests ----------------------------------------------------------------------------------
    def encode(self, prompt: Prompt, *, add_special_tokens: bool = True) -> EncodedPrompt:
        """Tokenize and validate a prompt (`Engine.encode_prompt`, which only reads the tokenizer and the
        limits, so it is safe off the loop thread); raises the engine's InvalidRequestError family."""
        return self.engine.encode_prompt(prompt, add_special_tokens=add_special_tokens)

    async def generate(self, prompt: Prompt | EncodedPrompt, params: SamplingParams, *, request_id: str | None = None,
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs: deltas, then the finished one with the totals. A raw prompt is
        validated here, in the caller's task, so bad input raises before anything is queued; an
        `EncodedPrompt` (from `encode`) is not checked again. Closing the iterator early (a client went
        away) aborts the request, which frees its KV blocks within one engine step."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop has died: {self.dead_error}")
        encoded = prompt if isinstance(prompt, EncodedPrompt) else self.encode(prompt)
        request_id = request_id or f"areq-{next(self._ids)}"
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._commands.put(_Add(request_id, encoded, params, priority, cache_salt, sink,
                                asyncio.get_running_loop()))
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))
        self._wakeup.set()

    # -- the loop thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(0.5)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                self._stats = self.engine.stats()
                self._deliver(outputs)
        except BaseException as exc:
            self.dead_error = exc
            dead = EngineDeadError(f"the engine loop has died: {exc!r}")
            for add in list(self._sinks.values()):
                add.loop.call_soon_threadsafe(add.sink.put_nowait, dead)
            self._sinks.clear()
            if not isinstance(exc, Exception):
                raise

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is None:
                return
            if isinstance(command, _Abort):
                if self._sinks.pop(command.request_id, None) is not None:
                    self.engine.abort_request(command.request_id)
                    self._stats = self.engine.stats()  # an idle loop takes no step to refresh them
                continue
            try:
                self.engine.add_request(command.prompt, command.params, request_id=command.request_id,
                                        priority=command.priority, cache_salt=command.cache_salt)
            except EngineError as exc:
                command.loop.call_soon_threadsafe(command.sink.put_nowait, exc)
                continue
            self._sinks[command.request_id] = command

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs reach each event loop in one call: one wake-up of the loop per step, not one
        per stream (each wake-up is a write to the loop's self-pipe and a turn of the loop)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, RequestOutput]]] = {}
        for out in outputs:
            add = self._sinks.get(out.request_id)
            if add is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            by_loop.setdefault(add.loop, []).append((add.sink, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


_Sink = asyncio.Queue[RequestOutput | BaseException]


def _put_all(items: list[tuple[_Sink, RequestOutput]]) -> None:
    for sink, out in items:
        sink.put_nowait(out)
