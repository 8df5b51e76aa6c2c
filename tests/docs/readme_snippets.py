"""The README's fenced `bash` and `python` snippets as the README test runs them: parsed with
their section, line and skip marker, and run in order by a `SnippetRunner` that keeps the
servers a snippet starts (`kvstrata serve|launch|router`) running in the background. The
runner moves every fixed port to a free one (the same one for every mention), so the test
passes while something else holds 30000."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvstrata.config import ServerConfig

# `<!-- readme-test: skip (why) -->` on the line just before a fence: the decision not to run
# a snippet is written next to it in the README, never hidden in the test.
SKIP_MARKER = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
SERVER_COMMAND = re.compile(r"\bkvstrata\s+(serve|launch|router)\b")
# `# -> TEXT` after a command: TEXT must appear in that command's output.
EXPECTED_OUTPUT = re.compile(r"^\s*#\s*->\s*(?P<text>.+?)\s*$")
# `kvstrata serve`, `router` and `launch` all listen on this --port unless told otherwise.
DEFAULT_PORT: int = {f.name: f.default for f in dataclasses.fields(ServerConfig)}["port"]
# A fixed port as the README writes one: a --port value or the port of a local URL.
FIXED_PORT = re.compile(
    r"(?P<lead>--port[ =]|\b(?:localhost|127\.0\.0\.1|0\.0\.0\.0):)(?P<port>[1-9][0-9]{3,4})\b"
)
PORT_FLAG = re.compile(r"--port[ =]")
COMMAND_TIMEOUT_S = 240.0
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
LOG_TAIL_CHARS = 4000


@dataclass(frozen=True)
class Snippet:
    section: str  # the `## ` heading it is under
    index: int  # 1-based position among the section's snippets
    line: int  # 1-based line of its opening fence
    lang: str
    text: str
    skip_reason: str | None

    @property
    def name(self) -> str:
        """A test id that stays put when other sections change: `serve-2-python`."""
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")
        return f"{slug}-{self.index}-{self.lang}"


def parse_snippets(markdown: str) -> list[Snippet]:
    """Every fenced block of `markdown` in order (any language: the test refuses the ones it
    cannot run rather than skipping them quietly)."""
    snippets: list[Snippet] = []
    lines = markdown.splitlines()
    section = ""
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("## "):
            section = line[3:].strip()
        fence = FENCE.match(line)
        if fence is None:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        marker = SKIP_MARKER.search(lines[index - 1]) if index else None
        snippets.append(
            Snippet(
                section,
                1 + sum(s.section == section for s in snippets),
                index + 1,
                fence["lang"],
                "\n".join(lines[index + 1 : end]) + "\n",
                marker["reason"].strip() if marker else None,
            )
        )
        index = end + 1
    return snippets


@dataclass(frozen=True)
class Command:
    """One logical shell line (backslash continuations joined) and the output it promises."""

    text: str
    expected: tuple[str, ...] = ()


def shell_commands(text: str) -> list[Command]:
    commands: list[Command] = []
    pending = ""
    for raw in text.splitlines():
        expected = EXPECTED_OUTPUT.match(raw)
        if expected and not pending and commands:
            last = commands[-1]
            commands[-1] = Command(last.text, (*last.expected, expected["text"].strip('"')))
            continue
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line = (pending + raw).strip()
        pending = ""
        if line and not line.startswith("#"):
            commands.append(Command(line))
    return commands


def server_port(command: str) -> int:
    words = shlex.split(command, comments=True)
    for index, word in enumerate(words):
        if word == "--port" and index + 1 < len(words):
            return int(words[index + 1])
        if word.startswith("--port="):
            return int(word.split("=", 1)[1])
    return DEFAULT_PORT


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        # As the servers bind: connections of a stopped server left in TIME_WAIT do not count.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class BackgroundServer:
    command: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]

    def stop(self) -> int:
        """SIGTERM (a launcher stops its children on it), as Ctrl-C in its terminal would;
        SIGKILL to its whole process group if it does not exit, and to any child left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()


class SnippetError(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class SnippetRunner:
    """Runs snippets in the repository root with every `/tmp/` path moved under `tmp_dir`
    (so runs never meet each other's files) and every fixed port moved to a free one
    chosen on its first mention (`ports`; a server with no --port gets the one its
    default port moved to). A server a snippet starts keeps running, as in a terminal
    left open, until a later snippet starts one on the same port or `close()`."""

    repo: Path
    tmp_dir: Path
    servers: dict[int, BackgroundServer] = field(default_factory=dict)
    ports: dict[int, int] = field(default_factory=dict)  # README port -> the port used

    def port_for(self, readme_port: int) -> int:
        if readme_port not in self.ports:
            port = _free_port()
            while port in self.ports.values():
                port = _free_port()
            self.ports[readme_port] = port
        return self.ports[readme_port]

    def localise(self, text: str) -> str:
        text = re.sub(r"(?<![\w.])/tmp/", f"{self.tmp_dir}/", text)
        return FIXED_PORT.sub(lambda m: f"{m['lead']}{self.port_for(int(m['port']))}", text)

    def with_port(self, command: str) -> str:
        """A server command that names no --port, given the port its default moved to."""
        if not SERVER_COMMAND.search(command) or PORT_FLAG.search(command):
            return command
        port = self.port_for(DEFAULT_PORT)
        return SERVER_COMMAND.sub(lambda m: f"{m[0]} --port {port}", command, count=1)

    def run(self, snippet: Snippet) -> None:
        if snippet.lang == "bash":
            for command in shell_commands(self.localise(snippet.text)):
                self._run_command(snippet, command)
        elif snippet.lang == "python":
            path = self.tmp_dir / f"snippet-{snippet.line}.py"
            path.write_text(self.localise(snippet.text))
            self._check(snippet, Command(f"{sys.executable} {path}"))
        else:
            raise SnippetError(
                f"README.md:{snippet.line}: a ```{snippet.lang} block is neither run nor marked "
                "`<!-- readme-test: skip (why) -->`"
            )

    def _run_command(self, snippet: Snippet, command: Command) -> None:
        command = Command(self.with_port(command.text), command.expected)
        if SERVER_COMMAND.search(command.text):
            self._start_server(snippet, command.text)
        else:
            self._check(snippet, command)

    def _check(self, snippet: Snippet, command: Command) -> None:
        try:
            done = subprocess.run(
                ["bash", "-o", "pipefail", "-c", command.text],
                cwd=self.repo,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as e:
            raise SnippetError(f"README.md:{snippet.line}: `{command.text}` did not end") from e
        output = done.stdout + done.stderr
        if done.returncode != 0:
            raise SnippetError(
                f"README.md:{snippet.line}: `{command.text}` exited {done.returncode}:\n"
                f"{output[-LOG_TAIL_CHARS:]}{self._server_logs()}"
            )
        for text in command.expected:
            if text not in output:
                raise SnippetError(
                    f"README.md:{snippet.line}: `{command.text}` printed no {text!r}:\n{output}"
                )

    def _start_server(self, snippet: Snippet, command: str) -> None:
        port = server_port(command)
        if port == 0:
            raise SnippetError(f"README.md:{snippet.line}: give `{command}` a fixed --port")
        if port in self.servers:
            self.servers.pop(port).stop()
        if not _port_is_free(port):
            raise SnippetError(
                f"README.md:{snippet.line}: port {port} (the free port this test chose for "
                "the README's) is taken by a process this test did not start"
            )
        log_path = self.tmp_dir / f"server-{snippet.line}-{port}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                ["bash", "-c", f"exec {command}"],
                cwd=self.repo,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() reaches every child
            )
        server = BackgroundServer(command, port, proc, log_path)
        self.servers[port] = server
        deadline_s = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline_s:
            if proc.poll() is not None:
                raise SnippetError(
                    f"README.md:{snippet.line}: `{command}` exited {proc.returncode} before "
                    f"answering /health on port {port}:\n{server.log_tail()}"
                )
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SnippetError(f"README.md:{snippet.line}: `{command}` never became healthy")

    def _server_logs(self) -> str:
        return "".join(
            f"\n--- log of `{s.command}`:\n{s.log_tail()}" for s in self.servers.values()
        )

    def close(self) -> list[str]:
        """Stop every server; returns a line for each that did not exit 0."""
        failures = []
        for server in self.servers.values():
            status = server.stop()
            if status != 0:
                failures.append(f"`{server.command}` exited {status}:\n{server.log_tail()}")
        self.servers.clear()
        return failures
