"""Prefix-aware routing over several prefill replicas (decode_service/replicas.py, routing.py,
prefill_targets.py): prompts that share their leading pages go to one replica; keys spread evenly;
a replica loaded above (1 + epsilon) x the mean, or down, passes its keys to the next in their order,
and a down one takes them back once a Handshake answers; a replica added takes ~1/n of the keys and
no other key moves. Then real processes: two prefill services behind one decode."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from decode_service import routing
from decode_service.prefill_client import PrefillClient, PrefillFailed
from decode_service.prefill_targets import Address, handshake_all, parse_targets, resolve
from decode_service.replicas import KEY_PAGES, address_seed, preference, prefix_key
from decode_service.routing import Membership, PrefillRouter, Route
from shared.client.client import Client
from shared.transfer.base import KVLayout
from tests.services.service_testutil import (
    PrefillInfo,
    ServerProcess,
    kv_layout,
    random_spec,
    stop_all,
    wait_pool_idle,
)
from tests.services.test_prefill_routing import COMMON, GENERATE, GREEDY, _expected, _prefill
from tests.telemetry.telemetry_testutil import Span, wait_spans

PAGE = 4
LAYOUT = KVLayout.from_pb(kv_layout(PAGE))


def _client(target: str) -> PrefillClient:
    return PrefillClient(target, 10.0, LAYOUT)  # never called: a fake handshake where one is needed


def _router(n: int, **kw) -> PrefillRouter:  # type: ignore[no-untyped-def]
    return PrefillRouter([_client(f"10.0.0.{i}:50052") for i in range(n)], **kw)


def _prompt(rng: random.Random, n: int = 40) -> list[int]:
    return [rng.randrange(97) for _ in range(n)]


def _first_choice(router: PrefillRouter, prompt: Sequence[int]) -> str:
    return preference(prefix_key(prompt, PAGE), router.replicas.values())[0].address


def test_the_key_is_the_leading_whole_pages() -> None:
    rng = random.Random(0)
    head = _prompt(rng, KEY_PAGES * PAGE)
    assert prefix_key([*head, 1, 2, 3], PAGE) == prefix_key([*head, 9], PAGE) == prefix_key(head, PAGE)
    other = [*head[:-1], (head[-1] + 1) % 97]  # differs in the last token of the key
    assert prefix_key(other, PAGE) != prefix_key(head, PAGE)
    # Shorter than KEY_PAGES pages: its whole pages (the partial one left out); under a page: all of it.
    assert prefix_key(head[:6], PAGE) == prefix_key(head[:7], PAGE) == prefix_key(head[:4], PAGE)
    assert prefix_key(head[:2], PAGE) != prefix_key(head[:3], PAGE)


def test_prompts_sharing_their_leading_pages_go_to_one_replica_and_keys_spread() -> None:
    router = _router(4, max_queued_tokens=0)
    rng = random.Random(1)
    system = _prompt(rng, 64)
    picked = set()
    for _ in range(20):  # sequential sessions: each done before the next
        route = router.route(80, [*system, *_prompt(rng, 16)])
        assert route.remote and route.replica is not None
        picked.add(route.replica.address)
        router.done(route)
    assert len(picked) == 1
    counts = Counter(_first_choice(router, _prompt(rng)) for _ in range(4000))
    assert set(counts) == set(router.replicas)
    assert all(800 < c < 1200 for c in counts.values()), counts  # 1000 each, give or take


def test_a_replica_over_the_load_bound_passes_the_key_to_the_next() -> None:
    router = _router(3, max_queued_tokens=0)
    rng = random.Random(2)
    prompt = _prompt(rng)
    order = [r.address for r in preference(prefix_key(prompt, PAGE), router.replicas.values())]
    first = router.route(1000, prompt)  # all idle: the first choice
    assert first.replica is not None and first.replica.address == order[0]
    second = router.route(1000, prompt)  # 1000 > 1.25 x 333: over the bound
    assert second.replica is not None and second.replica.address == order[1]
    third = router.route(1000, prompt)  # loads 1000, 1000, 0: both over 1.25 x 667
    assert third.replica is not None and third.replica.address == order[2]
    fourth = router.route(100, prompt)  # every load 1000 = the mean: back to the first choice
    assert fourth.replica is not None and fourth.replica.address == order[0]
    for r in (first, second, third, fourth):
        router.done(r)
    assert router.route(100, prompt).replica.address == order[0]  # type: ignore[union-attr]


def test_queue_deep_only_when_no_replica_within_the_bound_would_take_it() -> None:
    router = _router(2, max_queued_tokens=100)
    rng = random.Random(3)
    a, b = _prompt(rng), _prompt(rng)
    ra, rb = router.route(90, a), router.route(90, b)
    assert ra.remote and rb.remote
    assert router.queue_limit() == 200 and router.queue_estimate() == 180
    assert router.route(20, a).reason == "queue_deep"  # 90 + 20 > 100 on either replica
    router.done(ra)
    route = router.route(20, a)
    assert route.remote and route.replica is ra.replica


class _Handshakes:
    """A fake Handshake per replica: `up` says who answers."""

    def __init__(self, router: PrefillRouter) -> None:
        self.up = set(router.replicas)
        self.calls: Counter[str] = Counter()
        for r in router.replicas.values():
            self.install(r.client)

    def install(self, client: PrefillClient) -> None:
        async def handshake(timeout: float = 5.0) -> None:
            self.calls[client.target] += 1
            if client.target not in self.up:
                raise PrefillFailed("UNAVAILABLE: connection refused")

        client.handshake = handshake  # type: ignore[method-assign]


async def _until(pred, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_a_down_replica_passes_its_keys_to_the_next_and_takes_them_back(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(routing, "REHANDSHAKE_S", 0.02)
    rng = random.Random(4)
    prompts = [_prompt(rng) for _ in range(400)]

    async def run() -> None:
        router = _router(4, max_queued_tokens=0)
        fake = _Handshakes(router)

        def where() -> list[str]:  # each prompt done before the next: no load
            out = []
            for p in prompts:
                route = router.route(40, p)
                router.done(route)
                out.append(route.replica.address if route.replica is not None else route.reason)
            return out

        before = where()
        victim = before[0]
        fake.up.discard(victim)
        route = router.route(40, prompts[0])
        router.done(route)
        router.unavailable(route, "no answer within 10.0s")  # its circuit opens, its only
        assert not router.replicas[victim].usable and router.usable
        during = where()
        for p, b, d in zip(prompts, before, during, strict=True):
            if b == victim:  # the next in the key's order takes it
                order = preference(prefix_key(p, PAGE), router.replicas.values())
                assert d == order[1].address != victim
            else:
                assert d == b  # no other key moves
        await asyncio.sleep(0.1)
        assert fake.calls[victim] >= 2 and not router.replicas[victim].usable  # asked again and again
        fake.up.add(victim)
        await _until(lambda: router.replicas[victim].usable)
        assert where() == before

    asyncio.run(run())


def test_with_every_replica_down_prompts_prefill_here_for_the_first_choice_reason() -> None:
    async def run() -> None:
        router = _router(2, max_queued_tokens=0)
        _Handshakes(router).up.clear()
        rng = random.Random(5)
        prompt = _prompt(rng)
        order = preference(prefix_key(prompt, PAGE), router.replicas.values())
        first = router.route(40, prompt)
        router.refused(first, "page_size: 4 != 8")
        second = router.route(40, prompt)
        assert second.replica is order[1]
        router.unavailable(second, "connection refused")
        assert not router.usable
        route = router.route(40, prompt)
        assert (route.remote, route.reason, route.replica) == (False, "prefill_mismatch", None)
        other = next(
            p for p in (_prompt(rng) for _ in range(100)) if _first_choice(router, p) != order[0].address
        )
        assert router.route(40, other).reason == "prefill_unavailable"

    asyncio.run(run())


def test_adding_a_replica_moves_only_its_share_of_the_keys() -> None:
    async def run() -> None:
        router = _router(4, max_queued_tokens=0)
        fake = _Handshakes(router)
        rng = random.Random(6)
        prompts = [_prompt(rng) for _ in range(5000)]
        before = [_first_choice(router, p) for p in prompts]
        new = Address("10.0.0.9:50052")
        fake.up.add(new.target)

        def make_client(a: Address) -> PrefillClient:
            client = _client(a.target)
            fake.install(client)
            return client

        addresses = [Address(t) for t in router.replicas]
        router.update([*addresses, new], make_client)
        assert not router.replicas[new.target].usable  # until its first Handshake answers
        await _until(lambda: router.replicas[new.target].usable)
        after = [_first_choice(router, p) for p in prompts]
        moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
        assert all(a == new.target for _, a in moved)  # only to the new replica
        assert 0.15 < len(moved) / len(prompts) < 0.25  # ~1/5
        gone = router.replicas[addresses[0].target]
        router.update([*addresses[1:], new], make_client)  # one left the set: only its keys move
        assert gone.gone and addresses[0].target not in router.replicas
        again = [_first_choice(router, p) for p in prompts]
        assert all(x == y for x, y in zip(after, again, strict=True) if x != gone.address)
        await asyncio.sleep(0)  # its channel's close (none was opened) runs

    asyncio.run(run())


def test_the_replica_set_follows_dns() -> None:
    first, second = Address("10.0.0.0:50052", "pf"), Address("10.0.0.5:50052", "pf")
    # What DNS says, lookup after lookup: nothing (an outage: the set is kept), then a second pod.
    answers: list[list[Address] | None] = [None, [first, second]]

    async def run() -> None:
        fake: _Handshakes | None = None

        async def lookup() -> list[Address] | None:
            return answers.pop(0) if len(answers) > 1 else answers[0]

        def make_client(a: Address) -> PrefillClient:
            assert a.server_name == "pf"  # the name its certificate must carry
            client = _client(a.target)
            assert fake is not None
            fake.install(client)
            return client

        router = PrefillRouter(
            [_client(first.target)], max_queued_tokens=0,
            membership=Membership(lookup, make_client, every_s=0.01),
        )  # fmt: skip
        fake = _Handshakes(router)
        fake.up.add(second.target)
        router.start()
        await _until(lambda: second.target in router.replicas)
        assert first.target in router.replicas  # the failed lookup dropped nothing
        await _until(lambda: router.replicas[second.target].usable)  # handshaked at once

    asyncio.run(run())


def test_targets_parse_and_dns_names_resolve_to_their_addresses() -> None:
    entries = parse_targets("10.1.1.1:50052, dns:///localhost:7,[::1]:9")
    assert [(e.text, e.dns) for e in entries] == [("10.1.1.1:50052", False), ("dns:///localhost:7", True),
                                                  ("[::1]:9", False)]  # fmt: skip
    addresses = resolve(entries)
    assert addresses[0] == Address("10.1.1.1:50052") and addresses[-1] == Address("[::1]:9")
    local = addresses[1:-1]
    assert local and all(a.server_name == "localhost" for a in local)
    assert {a.target for a in local} <= {"127.0.0.1:7", "[::1]:7"}
    for bad in ("dns:///name", "dns://8.8.8.8/name:5", "a:1,,b:2"):
        with pytest.raises(ValueError):
            parse_targets(bad)


def test_start_up_waits_for_every_replica_or_a_grace_after_the_first() -> None:
    release = threading.Event()

    def shake(a: Address) -> None:
        if a.target == "slow":
            release.wait(10)
        if a.target == "refuses":
            raise RuntimeError("prefill service refuses refused the handshake")

    start = time.monotonic()
    assert handshake_all([Address("a"), Address("slow")], shake, grace_s=0.2) == {"a"}
    assert time.monotonic() - start < 5
    release.set()
    assert handshake_all([Address("a"), Address("slow")], shake, grace_s=5) == {"a", "slow"}
    with pytest.raises(RuntimeError, match="refused"):
        handshake_all([Address("a"), Address("refuses")], shake, grace_s=5)


def test_a_resolved_replica_checks_its_certificate_against_the_name() -> None:
    from decode_service.prefill_client import _channel_options

    assert ("grpc.ssl_target_name_override", "pf") in _channel_options(True, "pf")
    assert all(k != "grpc.ssl_target_name_override" for k, _ in _channel_options(False, "pf"))
    assert all(k != "grpc.lb_policy_name" for k, _ in _channel_options(True, ""))  # one replica per channel


def test_route_names_its_replica() -> None:
    router = _router(2, max_queued_tokens=0)
    route = router.route(40, list(range(40)))
    assert isinstance(route, Route) and route.replica is not None and route.replica.address in router.replicas
    assert PrefillRouter(None).route(40, list(range(40))) == Route(False, "no_prefill")


@dataclass(frozen=True)
class _Named:  # an address as the policy sees it
    address: str

    @property
    def seed(self) -> int:
        return address_seed(self.address)


def _attrs(spans: Path, rid: str) -> tuple[str, str, str]:
    """(pdserve.prefill, pdserve.prefill.reason, pdserve.prefill.replica or "") of `rid`'s Generate span."""

    def find(all_spans: list[Span]) -> Span | None:
        return next(
            (s for s in all_spans if s["name"] == GENERATE and s["attributes"]["gen_ai.response.id"] == rid),
            None,
        )

    span = find(wait_spans(spans, lambda ss: find(ss) is not None))
    assert span is not None, f"no Generate span for {rid}"
    a = span["attributes"]
    return a["pdserve.prefill"], a["pdserve.prefill.reason"], a.get("pdserve.prefill.replica", "")


@pytest.mark.slow
def test_two_prefill_replicas_keep_each_prefix_on_one_and_a_stopped_one_is_skipped(tmp_path: Path) -> None:
    spans = tmp_path / "spans.jsonl"
    pf = {p.target: p for p in (_prefill(), _prefill())}
    decode = ServerProcess(
        random_spec(), *COMMON, "--prefill-target", ",".join(pf), "--local-prefill-max-tokens", "0",
        "--prefill-timeout", "2", env={"PDSERVE_TEST_SPAN_FILE": str(spans)},
    )  # fmt: skip
    infos = {t: PrefillInfo(t) for t in pf}

    def first_choice(prompt: list[int]) -> str:
        return preference(prefix_key(prompt, PAGE), [_Named(t) for t in pf])[0].address

    # A 40-token shared prefix (10 pages of 4), and another whose first choice is the other replica.
    system = list(range(3, 43))
    x = first_choice(system)
    other = next(
        s for s in ([(5 * i + k) % 97 for i in range(40)] for k in range(100)) if first_choice(s) != x
    )
    y = first_choice(other)
    prompts = [[*system, 50 + i] for i in range(6)] + [[*other, 60 + i] for i in range(2)]
    expected = _expected(prompts)
    try:
        with Client(decode.target) as c:

            def run(i: int) -> tuple[str, str, str]:
                got = c.complete(prompts[i], request_id=f"r{i}", **GREEDY)
                assert list(got.token_ids) == expected[i], f"request {i}"
                return _attrs(spans, f"r{i}")

            assert [run(i) for i in range(3)] == [("remote", "remote", x)] * 3
            assert infos[x].model_info().kv_pool.pages_cached >= 10  # the shared pages, cached there
            assert infos[y].model_info().kv_pool.pages_cached == 0
            assert [run(i) for i in (6, 7)] == [("remote", "remote", y)] * 2
            assert infos[y].model_info().kv_pool.pages_cached >= 10
            stop_all(pf[x])  # the prefix's replica goes away: its next prompt waits out its time once
            assert run(3) == ("local", "prefill_unavailable", x)
            assert run(4) == ("remote", "remote", y)  # then the next in the key's order takes its keys
            stop_all(pf[y])  # every replica gone: prompts prefill here
            assert run(5) == ("local", "prefill_unavailable", y)
            c_prompt = len(prompts)
            prompts.append([*system, 90])
            expected.extend(_expected(prompts[c_prompt:]))
            assert run(c_prompt) == ("local", "prefill_unavailable", "")  # no replica usable: not asked
            wait_pool_idle(c)
        assert decode.log().count("re-handshaking") == 2  # once per replica
    finally:
        for info in infos.values():
            info.close()
        stop_all(decode, *pf.values())


@pytest.mark.slow
def test_a_dns_name_is_resolved_here_and_tls_checks_the_name_not_the_address(tmp_path: Path) -> None:
    import trustme

    from prefill_service.servicer import SERVICE_NAME as PREFILL
    from tests.services.security_testutil import write_ca

    ca = trustme.CA()
    leaf = ca.issue_cert("localhost")  # the name only: dialled by its IP, only the name can match
    cert, key = tmp_path / "prefill.crt", tmp_path / "prefill.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    prefill = ServerProcess(
        random_spec(), *COMMON, "--tls-cert", str(cert), "--tls-key", str(key), module="prefill_service",
        service=PREFILL, wait_ready=False,
    )  # fmt: skip
    spans = tmp_path / "spans.jsonl"
    port = prefill.target.rsplit(":", 1)[1]
    decode = None
    try:
        decode = ServerProcess(
            random_spec(), *COMMON, "--prefill-target", f"dns:///localhost:{port}",
            "--local-prefill-max-tokens", "0", "--prefill-tls-ca", write_ca(ca, tmp_path / "ca.crt"),
            env={"PDSERVE_TEST_SPAN_FILE": str(spans)},
        )  # fmt: skip
        prompt = list(range(3, 43))
        with Client(decode.target) as c:
            got = c.complete(prompt, request_id="tls", **GREEDY)
            assert list(got.token_ids) == _expected([prompt])[0]
        assert _attrs(spans, "tls") == ("remote", "remote", f"127.0.0.1:{port}")
    finally:
        stop_all(*(p for p in (decode, prefill) if p is not None))
