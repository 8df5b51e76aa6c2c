"""README.md runs as written: every fenced `bash` and `python` snippet, in README order, in
the repository root (`/tmp/` paths moved under a temp dir, fixed ports such as 30000 moved
to free ones); servers a snippet starts stay up for the snippets after it. The run holds
port 30000 itself, so it proves that nothing needs it. A snippet marked
`<!-- readme-test: skip (why) -->` is reported as skipped with that reason; any other
kind of block fails the test."""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from readme_snippets import (
    DEFAULT_PORT,
    Snippet,
    SnippetError,
    SnippetRunner,
    parse_snippets,
    shell_commands,
)

REPO = Path(__file__).resolve().parents[2]
SNIPPETS = parse_snippets((REPO / "README.md").read_text())


@contextlib.contextmanager
def holding(port: int) -> Iterator[None]:
    """Listen on `port` meanwhile (as a reader's own `kvstrata serve` would), unless some
    other process already does: either way the README's servers cannot have it."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
        yield


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SnippetRunner]:
    with holding(DEFAULT_PORT):
        runner = SnippetRunner(REPO, tmp_path_factory.mktemp("readme"))
        yield runner
        failures = runner.close()
        assert not failures, "\n".join(failures)


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.name for s in SNIPPETS])
def test_readme_snippet(snippet: Snippet, runner: SnippetRunner) -> None:
    if snippet.skip_reason is not None:
        pytest.skip(f"README.md:{snippet.line}: {snippet.skip_reason}")
    runner.run(snippet)


def test_snippets_are_found_and_most_run() -> None:
    """The parser sees the README's blocks (a broken fence regex would skip them all)."""
    run = [s for s in SNIPPETS if s.skip_reason is None]
    assert {s.lang for s in SNIPPETS} <= {"bash", "python"}
    assert len(run) >= 8 and len(run) > len(SNIPPETS) - len(run)
    sections = {s.section for s in run}
    assert {"Use", "Serve", "Cluster", "Benchmark"} <= sections


def test_parser_joins_continuations_and_reads_expected_output() -> None:
    snippets = parse_snippets(
        "## A\n<!-- readme-test: skip (needs a GPU) -->\n```bash\nnvidia-smi\n```\n"
        "## B\n```bash\necho one \\\n  two  # a comment\n# -> one two\nls\n```\n"
    )
    assert [(s.name, s.line, s.skip_reason) for s in snippets] == [
        ("a-1-bash", 3, "needs a GPU"),
        ("b-1-bash", 7, None),
    ]
    commands = shell_commands(snippets[1].text)
    assert [c.text for c in commands] == ["echo one    two  # a comment", "ls"]
    assert commands[0].expected == ("one two",)


def test_runner_fails_a_failing_command_and_a_missing_output(tmp_path: Path) -> None:
    runner = SnippetRunner(REPO, tmp_path)
    failing, silent, other = parse_snippets(
        "```bash\ntrue\nfalse\n```\n```bash\necho hi\n# -> bye\n```\n```sh\nls\n```\n"
    )
    with pytest.raises(SnippetError, match=r"README\.md:1: `false` exited 1"):
        runner.run(failing)
    with pytest.raises(SnippetError, match="printed no 'bye'"):
        runner.run(silent)
    with pytest.raises(SnippetError, match="neither run nor marked"):
        runner.run(other)
    assert runner.localise("x /tmp/a /work/tmp/b") == f"x {tmp_path}/a /work/tmp/b"


def test_runner_moves_fixed_ports_to_free_ones(tmp_path: Path) -> None:
    runner = SnippetRunner(REPO, tmp_path)
    with holding(DEFAULT_PORT):
        text = runner.localise(
            f"kvstrata serve --model m --port {DEFAULT_PORT}\ncurl -s localhost:{DEFAULT_PORT}/x "
            "--port=31000\nOpenAI(base_url='http://127.0.0.1:31000/v1') --port 0 :80\n"
        )
    port, other = runner.ports[DEFAULT_PORT], runner.ports[31000]
    assert text == (
        f"kvstrata serve --model m --port {port}\ncurl -s localhost:{port}/x --port={other}\n"
        f"OpenAI(base_url='http://127.0.0.1:{other}/v1') --port 0 :80\n"
    )
    assert DEFAULT_PORT not in (port, other) and port != other
    # A server naming no port listens on its default one, moved like every mention of it.
    assert runner.with_port(".venv/bin/kvstrata launch --model m") == (
        f".venv/bin/kvstrata launch --port {port} --model m"
    )
    assert runner.with_port("kvstrata serve --port=5") == "kvstrata serve --port=5"
    assert runner.with_port("kvstrata bench --url u") == "kvstrata bench --url u"


def test_runner_refuses_a_port_someone_else_holds(tmp_path: Path) -> None:
    """The free port chosen for a README port, taken before its server starts."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        runner = SnippetRunner(REPO, tmp_path, ports={DEFAULT_PORT: port})
        (snippet,) = parse_snippets(f"```bash\nkvstrata serve --port {DEFAULT_PORT}\n```\n")
        with pytest.raises(SnippetError, match=f"port {port} .* is taken"):
            runner.run(snippet)
