"""Sessions through the router app in process, in front of scripted ranks (the harness of
test_router_proxy.py): turns stay on their rank where round robin alternates, the session
headers reach the rank unchanged, a bad one is a 400 naming it that no rank sees, a final
turn closes its session, `user` names one only with --session-id-from-user, and a chain
of Responses API answers is one session."""

from __future__ import annotations

import re

import httpx
from test_router_proxy import DECODE, FakeRanks, with_router

from kvstrata.router.response_homes import RESPONSE_ID_HEADER


def rank_of(request: httpx.Request) -> str:
    return f"http://{request.url.host}:{request.url.port}"


async def metric(client: httpx.AsyncClient, name: str, **labels: str) -> float:
    """The value of the router's sample `name` with exactly `labels`."""
    text = (await client.get("/metrics")).text
    for line in text.splitlines():
        found = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if found is None or found[1] != name:
            continue
        if dict(re.findall(r'(\w+)="([^"]*)"', found[2] or "")) == labels:
            return float(found[3])
    raise AssertionError(f"no sample {name}{labels}")


def test_a_session_s_turns_stay_on_one_rank_where_round_robin_alternates() -> None:
    fake = FakeRanks()

    async def test(client: httpx.AsyncClient) -> None:
        for session in ("s", None, "s", None, "s"):
            headers = {"X-Session-ID": session} if session else {}
            response = await client.post("/v1/completions", json={"prompt": "x"}, headers=headers)
            assert response.status_code == 200
        sent = [rank_of(r) for r in fake.generation_requests()]
        # The session's first turn takes round robin's next rank and keeps it; the others
        # alternate around it.
        assert sent == [DECODE[0], DECODE[1], DECODE[0], DECODE[0], DECODE[0]]
        routes = "kvstrata_router_session_routes_total"
        assert await metric(client, routes, outcome="new") == 1
        assert await metric(client, routes, outcome="kept") == 2
        assert await metric(client, "kvstrata_router_sessions") == 1
        labels = {"role": "decode", "policy": "session", "branch": "kept"}
        assert await metric(client, "kvstrata_router_decisions_total", **labels) == 2

    with_router(fake, test, load_balance_method="round_robin")


def test_the_session_headers_reach_the_rank_unchanged() -> None:
    fake = FakeRanks()
    headers = {
        "X-Dynamo-Session-ID": "Agent.7",
        "X-Parent-Session-ID": "root",
        "X-Dynamo-Session-Final": "False",
    }

    async def test(client: httpx.AsyncClient) -> None:
        await client.post("/v1/chat/completions", json={"messages": []}, headers=headers)
        await client.post("/v1/chat/completions", json={"messages": []})
        with_session, without = fake.generation_requests()
        assert {name: with_session.headers[name] for name in headers} == headers
        assert not any(name.lower() in without.headers for name in headers)

    with_router(fake, test)


def test_a_bad_session_header_is_a_400_naming_it_that_no_rank_sees() -> None:
    fake = FakeRanks()
    bad = {  # the header named -> the headers sent
        "x-session-id": {"X-Session-ID": "two words"},
        "x-session-affinity": {"X-Session-Affinity": "x" * 129},
        "x-session-final": {"X-Session-ID": "s", "X-Session-Final": "maybe"},
        "x-dynamo-parent-session-id": {"X-Session-ID": "s", "X-Dynamo-Parent-Session-ID": ""},
    }

    async def test(client: httpx.AsyncClient) -> None:
        for name, headers in bad.items():
            response = await client.post("/generate", json={"text": "x"}, headers=headers)
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert name in error["message"]
            assert (error["param"], error["code"]) == ("session", "invalid_session")
        assert fake.generation_requests() == []

    with_router(fake, test)


def test_a_final_turn_closes_its_session_once_answered() -> None:
    fake = FakeRanks()

    async def test(client: httpx.AsyncClient) -> None:
        final = {"X-Session-ID": "s", "X-Session-Final": "true"}
        for headers in ({"X-Session-ID": "s"}, final, {"X-Session-ID": "s"}):
            await client.post("/v1/completions", json={"prompt": "x"}, headers=headers)
            if headers is final:
                assert await metric(client, "kvstrata_router_sessions") == 0
        routes = "kvstrata_router_session_routes_total"
        assert await metric(client, routes, outcome="kept") == 1
        assert await metric(client, routes, outcome="new") == 2  # the same id, begun again

    with_router(fake, test, load_balance_method="round_robin")


def test_the_user_field_names_a_session_only_when_the_router_is_told_so() -> None:
    for from_user, num_sessions in ((False, 0), (True, 1)):
        fake = FakeRanks()

        async def test(
            client: httpx.AsyncClient, num_sessions: int = num_sessions, fake: FakeRanks = fake
        ) -> None:
            for _ in range(3):
                await client.post("/v1/completions", json={"prompt": "x", "user": "alice"})
            assert await metric(client, "kvstrata_router_sessions") == num_sessions
            if num_sessions:
                assert {rank_of(r) for r in fake.generation_requests()} == {DECODE[0]}

        with_router(fake, test, load_balance_method="round_robin", session_id_from_user=from_user)


class ResponseRanks(FakeRanks):
    """Scripted ranks whose Responses API answers name themselves, as ranks do."""

    def __init__(self) -> None:
        super().__init__()
        self.num_responses = 0

    def handle(self, request: httpx.Request) -> httpx.Response:
        answer = super().handle(request)
        if request.url.path == "/v1/responses":
            self.num_responses += 1
            answer.headers[RESPONSE_ID_HEADER] = f"resp_{self.num_responses}"
        return answer


def test_a_chain_of_responses_is_one_session_on_one_rank() -> None:
    fake = ResponseRanks()

    async def test(client: httpx.AsyncClient) -> None:
        await client.post("/v1/responses", json={"input": "hi"})
        for previous in ("resp_1", "resp_2"):  # no session header: the chain names it
            body = {"input": "more", "previous_response_id": previous}
            await client.post("/v1/responses", json=body)
        assert {rank_of(r) for r in fake.generation_requests()} == {DECODE[0]}
        routes = "kvstrata_router_session_routes_total"
        assert await metric(client, routes, outcome="kept") == 2
        assert await metric(client, "kvstrata_router_sessions") == 1

    with_router(fake, test, load_balance_method="round_robin")
