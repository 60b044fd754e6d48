"""Agent programs: an OpenAI-compatible chat-completions endpoint served by the rollout engine's
executor, and the environment that turns a program's requests into a trajectory's turns.

[Note: agent programs] A generate call given `program="package.module:function"`
(flowkit.ops.AgentConfig, instead of an `environment`) rolls out each sample by running that
function, an agent written against the OpenAI chat-completions API, in a thread of the rollout
executor. ``function(task)`` gets a `Task` (messages, answer, `base_url`, the trajectory's own
`api_key`; ``task.client()``) and returns the reward (None: the flow's reward op scores it).
Each request is one model turn: its key says which trajectory it continues (127.0.0.1 only, one
request at a time per trajectory, bounded bodies, 400 naming what was wrong); the first
request's messages and tools, rendered by the chat template, are the prompt; each later one
repeats the conversation so far and only its new messages are rendered and appended (ChatTurns
in turns.py): the history is never tokenized again, and a request that rewrites it ends the
trajectory. Turns are sampled with the flow's settings; Hermes ``<tool_call>`` blocks come back
as `tool_calls`. Why: token in, token out, so the same program and seeds give an in-process
Environment's trajectory (tests/torch/test_endpoint.py); `flowkit bench agent --programs` times
a turn. In full: docs/rl.md, "Agent programs: an OpenAI-compatible endpoint".
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import attrs

from flowkit.ops import Conversation, Environment, EnvStep
from flowkit.ops.toolcalls import hermes_calls

__all__ = ["Endpoint", "ProgramEnvironment", "Task", "open_program", "shared_endpoint"]

log = logging.getLogger("flowkit.executor")

MAX_BODY_BYTES = 8 << 20  # a request's JSON body: a long conversation, never a flood
MAX_MESSAGES = 4096
_ROLES = ("system", "developer", "user", "assistant", "tool")
ENDED = "trajectory_ended"


@attrs.frozen(kw_only=True)
class Task:
    """What an agent program gets: its prompt, and where and as whom to ask the model."""

    prompt_id: int
    sample: int
    prompt: str  # the prompt's text as the prompt source rendered it
    messages: list[dict] | None  # the messages it rendered (dataset_prompts keeps them)
    answer: str | None
    base_url: str
    api_key: str

    def client(self, **settings: Any) -> Any:
        """An ``openai.OpenAI`` client of this trajectory (the openai package: the agents
        extra), without retries: a refused request is the program's to see."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key,
                             **{"max_retries": 0, **settings})


class RequestError(Exception):
    """A request the endpoint refuses: its HTTP status, OpenAI's error code, and why."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@attrs.define(eq=False)
class _Call:
    """One chat-completions request, waiting for its answer."""

    body: dict
    done: threading.Event = attrs.field(factory=threading.Event)
    status: int = 200
    reply: dict = attrs.field(factory=dict)

    def answer(self, status: int, reply: dict) -> None:
        if not self.done.is_set():
            self.status, self.reply = status, reply
            self.done.set()

    def refuse(self, error: RequestError) -> None:
        self.answer(error.status, _error_body(error.code, str(error)))


def _error_body(code: str, message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code,
                      "param": None}}


class _Session:
    """One trajectory's side of the endpoint: its program's requests and its end, each the
    answer to what the engine expects next (`expect`), in order."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.lock = threading.Lock()
        self.waiting: _Call | None = None  # a request the engine has not answered yet
        self.closed = False
        self._expected: Future | None = None  # the engine's wait for the program's next event
        self._early: list[tuple[str, Any]] = []  # events before the engine asked

    def expect(self) -> Future:
        """The program's next event (a request, its return, its failure), as a Future; asked
        before the answer that lets the program go on."""
        future: Future = Future()
        with self.lock:
            if self.closed:
                future.set_exception(RuntimeError("the trajectory ended"))
            elif self._early:
                future.set_result(self._early.pop(0))
            else:
                self._expected = future
        return future

    def offer(self, call: _Call) -> None:
        """A request from the program (the server's thread)."""
        with self.lock:
            if self.closed:
                raise RequestError(409, ENDED, "this trajectory has ended")
            if self.waiting is not None:
                raise RequestError(409, "request_in_flight", "this trajectory is waiting for "
                                   "the answer to its previous request: one at a time")
            self.waiting = call
        self.event("request", call)

    def event(self, kind: str, value: Any) -> None:
        with self.lock:
            if self.closed:
                return
            future, self._expected = self._expected, None
            if future is None:
                self._early.append((kind, value))
        if future is not None:  # its callbacks run here, outside the lock
            future.set_result((kind, value))

    def end(self) -> None:
        with self.lock:
            self.closed, waiting, self.waiting = True, self.waiting, None
            future, self._expected = self._expected, None
        if waiting is not None:
            waiting.refuse(RequestError(409, ENDED, "this trajectory has ended (a budget cut it, "
                                        "or its environment call failed or timed out)"))
        if future is not None:
            future.set_exception(RuntimeError("the trajectory ended"))


# [Note: bounded endpoint] A connection holds a thread, so connections are capped
# (`max_connections`, 512: a program needs one at a time, and an executor runs at most a few
# hundred trajectories): one past the cap is closed at once, before a thread or a byte of it,
# and counted (`refused`). A connection that sends nothing for `idle_timeout_s` (60 s; a
# keep-alive one between a program's turns too: its client reconnects) is closed, so idle
# connections cannot keep the slots (tests/torch/test_endpoint.py holds 600 idle ones).
class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # every trajectory's program connects at about the same time: socketserver's backlog of 5
    # would have the kernel reset the connections past it
    request_queue_size = 1024

    def __init__(self, address: tuple, handler: type, max_connections: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # [Note: bounded endpoint]
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class Endpoint:
    """The chat-completions server of this executor's agent programs, on loopback, with at
    most `max_connections` at once, each closed after `idle_timeout_s` without a byte [Note:
    bounded endpoint]."""

    def __init__(self, host: str = "127.0.0.1", *, max_connections: int = 512,
                 idle_timeout_s: float = 60.0) -> None:
        self.sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self.server = _Server((host, 0), _handler_for(self, idle_timeout_s), max_connections)
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       name="flowkit-endpoint", daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def open(self) -> _Session:
        session = _Session(secrets.token_urlsafe(24))
        with self._lock:
            self.sessions[session.key] = session
        return session

    def close(self, session: _Session) -> None:
        with self._lock:
            self.sessions.pop(session.key, None)
        session.end()

    def session_of(self, key: str) -> _Session | None:
        with self._lock:
            return self.sessions.get(key)

    def shutdown(self) -> None:
        for session in list(self.sessions.values()):
            self.close(session)
        self.server.shutdown()
        self.server.server_close()


_shared: Endpoint | None = None
_shared_lock = threading.Lock()


def shared_endpoint() -> Endpoint:
    """This process's endpoint, started by its first agent program."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Endpoint()
        return _shared


# -- the HTTP side ------------------------------------------------------------------------------
def _handler_for(endpoint: Endpoint, idle_timeout_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        pass

    Handler.endpoint = endpoint
    Handler.timeout = idle_timeout_s  # the socket's: a read that waits longer ends it
    return Handler


class _Handler(BaseHTTPRequestHandler):
    endpoint: Endpoint
    protocol_version = "HTTP/1.1"
    server_version = "flowkit-agents"
    # an answer goes out as its headers, then its body: without this, Nagle's algorithm holds
    # the body until the client acknowledges the headers, which it delays (40 ms a turn)
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        log.debug("endpoint: " + format, *args)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        try:
            self._session()
            if self.path.rstrip("/") != "/v1/models":
                raise RequestError(404, "not_found", f"no {self.path}: this endpoint serves "
                                   "POST /v1/chat/completions and GET /v1/models")
            self._send(200, {"object": "list", "data": [
                {"id": "flowkit", "object": "model", "created": 0, "owned_by": "flowkit"}]})
        except RequestError as error:
            self._send(error.status, _error_body(error.code, str(error)))

    def do_POST(self) -> None:  # noqa: N802
        try:
            session = self._session()
            if self.path.rstrip("/") != "/v1/chat/completions":
                raise RequestError(404, "not_found", f"no {self.path}: this endpoint serves "
                                   "POST /v1/chat/completions and GET /v1/models")
            call = _Call(body=_checked_request(self._body()))
            session.offer(call)
        except RequestError as error:
            self._send(error.status, _error_body(error.code, str(error)))
            return
        except Exception:  # a request no check foresaw: refused, and the server serves on
            log.warning("endpoint: a request failed", exc_info=True)
            self._send(400, _error_body("invalid_request", "the request could not be read"))
            return
        call.done.wait()  # answered by the engine's turn, or by the trajectory's end
        self._send(call.status, call.reply)

    def _session(self) -> _Session:
        auth = self.headers.get("Authorization", "")
        key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        session = self.endpoint.session_of(key) if key else None
        if session is None:
            raise RequestError(401, "invalid_api_key", "the API key is no trajectory's in "
                               "flight here: each trajectory's program gets its own "
                               "(task.api_key), valid until the trajectory ends")
        return session

    def _body(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise RequestError(411, "length_required", "a request needs its Content-Length") \
                from None
        if length < 0:
            raise RequestError(400, "invalid_request", "a negative Content-Length")
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # its body is left unread
            raise RequestError(413, "request_too_large", f"a request's body is at most "
                               f"{MAX_BODY_BYTES} bytes, this one has {length}")
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as error:
            raise RequestError(400, "invalid_json", f"the body is not JSON: {error}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "invalid_request", "the body must be a JSON object")
        return body

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _checked_request(body: dict) -> dict:
    """The request's messages and tools, checked for what the engine relies on."""
    if body.get("stream"):
        raise RequestError(400, "unsupported", "stream=true is not served: ask without it")
    if body.get("n", 1) != 1:
        raise RequestError(400, "unsupported", "n must be 1: a trajectory is one sample (the "
                           "flow's n samples are n trajectories, each its own program)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise RequestError(400, "invalid_messages", f"messages must be a list of 1 to "
                           f"{MAX_MESSAGES} chat messages")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise RequestError(400, "invalid_tools", "tools must be a list of tool objects")
    return {"messages": [_message(m, k) for k, m in enumerate(messages)], "tools": tools or None,
            "model": str(body.get("model", "flowkit"))[:200]}


def _message(message: Any, index: int) -> dict:
    """A message as the template and the history check read it: role, text content, and the
    assistant's tool calls or a tool result's id."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise RequestError(400, "invalid_messages", f"{where} must be an object whose role is "
                           f"one of {', '.join(_ROLES)}")
    content = message.get("content")
    if isinstance(content, list):  # text parts
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise RequestError(400, "invalid_messages", f"{where}: only text content parts "
                               "are served")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise RequestError(400, "invalid_messages", f"{where}.content must be a string")
    out: dict[str, Any] = {"role": message["role"], "content": content or ""}
    calls = message.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise RequestError(400, "invalid_messages", f"{where}.tool_calls must be a list")
    if calls:
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls") for c in calls]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _tool_call(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise RequestError(400, "invalid_messages", f"{where}: each call needs a function "
                           "with a name")
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise RequestError(400, "invalid_messages", f"{where}: arguments are not JSON") \
            from None
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


# -- the environment side -----------------------------------------------------------------------
class ProgramEnvironment(Environment):
    """One trajectory of an agent program: its requests are the model's turns, the messages
    each adds are the environment's, its return is the end and the reward. The engine calls
    `reset_async` and `step_async`, which answer at once with a Future of the program's next
    event, so no thread waits while a program thinks; `reset` and `step` wait for it."""

    def __init__(self, program: Callable[[Task], Any], endpoint: Endpoint, *, timeout_s: float,
                 prompt: Any, sample: int) -> None:
        self.program, self.endpoint = program, endpoint
        self.timeout_s = float(timeout_s)
        self.prompt, self.sample = prompt, int(sample)
        self.session: _Session | None = None
        self.history: list[dict] = []  # the conversation as the server has answered it
        self.tools: list[dict] | None = None
        self.turns = 0

    def reset(self, prompt: str, answer: str | None = None) -> Conversation:
        return self.reset_async(prompt, answer).result(self.timeout_s)

    def step(self, action: str) -> EnvStep:
        return self.step_async(action).result(self.timeout_s)

    def reset_async(self, prompt: str, answer: str | None = None) -> Future:
        """The program started; a Future of the Conversation its first request opens."""
        self.session = self.endpoint.open()
        task = Task(prompt_id=int(self.prompt.prompt_id), sample=self.sample, prompt=prompt,
                    messages=getattr(self.prompt, "messages", None), answer=answer,
                    base_url=self.endpoint.base_url, api_key=self.session.key)
        opened = _then(self.session.expect(), self._opened)
        threading.Thread(target=self._run, args=(task,), daemon=True,
                         name=f"flowkit-agent-{task.prompt_id}-{task.sample}").start()
        return opened

    def step_async(self, action: str) -> Future:
        """The model's turn answers the program's request; a Future of the EnvStep its next
        request (or its end) makes."""
        assert self.session is not None and self.session.waiting is not None
        self.turns += 1
        message = self._assistant(action)
        self.history.append(message)
        with self.session.lock:
            call, self.session.waiting = self.session.waiting, None
        stepped = _then(self.session.expect(), self._stepped)  # before the program goes on
        call.answer(200, self._completion(message, call.body["model"]))
        return stepped

    def close(self) -> None:
        if self.session is not None:
            self.endpoint.close(self.session)

    def _run(self, task: Task) -> None:
        assert self.session is not None
        try:
            result = self.program(task)
        except BaseException as error:  # the program's failure ends its trajectory
            self.session.event("raised", error)
        else:
            self.session.event("returned", result)

    def _opened(self, event: tuple[str, Any]) -> Conversation:
        kind, value = _checked(event)
        if kind != "request":
            raise RuntimeError("the agent program returned before its first request: a "
                               "trajectory needs at least one model turn")
        self.history, self.tools = list(value.body["messages"]), value.body["tools"]
        return Conversation(messages=list(self.history), tools=self.tools)

    def _stepped(self, event: tuple[str, Any]) -> EnvStep:
        kind, value = _checked(event)
        if kind == "returned":
            return EnvStep(reward=_reward(value), done=True)
        new = self._added(value)
        self.history.extend(new)
        return EnvStep(observation=new)
    def _added(self, call: _Call) -> list[dict]:
        """The messages a request adds after the conversation so far, which it must repeat."""
        messages, tools = call.body["messages"], call.body["tools"]
        problem = None
        if tools != self.tools:
            problem = "its tools differ from the first request's"
        elif messages[:len(self.history)] != self.history:
            problem = next(f"messages[{k}] differs from the conversation so far (the "
                           "assistant's answers as given, earlier messages unchanged)"
                           for k, (a, b) in enumerate(zip(messages, self.history)) if a != b) \
                if len(messages) >= len(self.history) else \
                f"it has {len(messages)} messages, fewer than the {len(self.history)} so far"
        elif len(messages) == len(self.history):
            problem = "it adds no message after the assistant's answer"
        if problem is not None:
            error = RequestError(400, "history_rewritten", f"this request does not continue "
                                 f"the trajectory: {problem}. flowkit never tokenizes a "
                                 "conversation again, so a trajectory only grows")
            with self.session.lock:  # type: ignore[union-attr]
                self.session.waiting = None  # type: ignore[union-attr]
            call.refuse(error)
            raise ValueError(str(error))
        return messages[len(self.history):]

    def _assistant(self, text: str) -> dict:
        """The turn as the assistant's message, its tool calls read when tools were given."""
        if not self.tools:
            return {"role": "assistant", "content": text}
        content, calls = hermes_calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"type": "function", "function": call} for call in calls]
        return message

    def _completion(self, message: dict, model: str) -> dict:
        wire = {"role": "assistant", "content": message["content"] or None}
        if "tool_calls" in message:
            wire["tool_calls"] = [
                {"id": f"call_{self.turns}_{k}", "type": "function",
                 "function": {"name": c["function"]["name"],
                              "arguments": json.dumps(c["function"]["arguments"])}}
                for k, c in enumerate(message["tool_calls"])]
        return {"id": f"chatcmpl-{self.prompt.prompt_id}-{self.sample}-{self.turns}",
                "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "message": wire, "logprobs": None,
                             "finish_reason": "tool_calls" if "tool_calls" in message
                             else "stop"}]}


def open_program(make: Callable[[Any, int], Any], prompt: Any, sample: int,
                 text: str) -> Future:
    """open_episode (turns.py) for an agent program, on the engine's thread: a Future of its
    environment and the Conversation its first request opens."""
    env = make(prompt, sample)
    return _then(env.reset_async(text, getattr(prompt, "answer", None)),
                 lambda conversation: (env, conversation))


def _checked(event: tuple[str, Any]) -> tuple[str, Any]:
    kind, value = event
    if kind == "raised":
        raise RuntimeError(f"the agent program raised {type(value).__name__}: {str(value)[:200]}")
    return kind, value


def _then(future: Future, fn: Callable[[Any], Any]) -> Future:
    """A Future of `fn` of `future`'s result, computed by whichever thread completes it."""
    out: Future = Future()

    def done(source: Future) -> None:
        try:
            out.set_result(fn(source.result()))
        except BaseException as error:  # the trajectory's failure, for the engine to see
            out.set_exception(error)

    future.add_done_callback(done)
    return out


def _reward(value: Any) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"the agent program returned {type(value).__name__}, not a reward (a "
                        "number, or None)")
    return float(value)
