"""Registration off the controller's event loop (issue 29, items 1 and 3), on the plain ``Registrar`` with a
real ``ControllerCore`` and fake worker links: reads on a thread while the loop answers, each name's calls in
arrival order (the last call wins), batches whose bad items fail alone, the workers told before any plan.

Reads are held at exact moments with threading events (a wrapper around the core's real read), never sleeps.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.peft import WEIGHTS_FILE, AdapterSpec, KnownVersion
from lora_cache.adapters.shapes import MODULE_ORDER, SHAPES
from lora_cache.adapters.synth import write_adapter
from lora_cache.api.client import LoraCacheClient
from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
from lora_cache.controller import registrations
from lora_cache.controller.core import ControllerConfig, ControllerCore
from lora_cache.controller.fanout import RankAnswers, Sent, WorkerFanout
from lora_cache.controller.registrations import Registrar, Turns
from lora_cache.errors import AdapterFormatError, AdapterPathError, ConflictError, NotFoundError
from lora_cache.vocab import WorkerId, worker_name


def adapter(directory: Path, seed: int) -> Path:
    return write_adapter(directory, SHAPES["tiny"], 8, 16.0, list(MODULE_ORDER), torch.bfloat16,
                         torch.Generator().manual_seed(seed))


class Links:
    """The workers as the registrar sees them: what was submitted, in order, and each call's answers."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.sent = log, []  # type: ignore[var-annotated]
        self.refuse: dict[str, str] = {}  # name -> the error every rank answers for it
        self.outstanding = self.most_outstanding = 0

    def submit_registrations(self, entries: list[tuple[str, str, KnownVersion | None]]) -> Sent:
        self.sent.append(entries)
        self.log += [f"submit {name}@{known.version if known else '?'}" for name, _, known in entries]
        self.outstanding += 1
        self.most_outstanding = max(self.most_outstanding, self.outstanding)
        return Sent(entries, [])

    async def registered(self, sent: Sent) -> list[RankAnswers]:
        self.outstanding -= 1
        return [RankAnswers([f"replica/0: {self.refuse[name]}"] if name in self.refuse else [], [])
                for name, _, _ in sent.entries]


class Held:
    """The core's read of chosen adapters, held at its start until released; says when it arrived."""

    def __init__(self, core: ControllerCore) -> None:
        self.arrived: dict[str, threading.Event] = {}
        self.release: dict[str, threading.Event] = {}
        real = core.read_adapter

        def read(name: str, path: str, known: KnownVersion | None = None) -> AdapterSpec:
            if name in self.release:
                self.arrived[name].set()
                assert self.release[name].wait(30), "never released"
            return real(name, path, known)

        core.read_adapter = read  # type: ignore[method-assign]

    def hold(self, name: str) -> None:
        self.arrived[name], self.release[name] = threading.Event(), threading.Event()

    async def until_arrived(self, name: str) -> None:
        assert await asyncio.to_thread(self.arrived[name].wait, 30), f"the read of {name} never started"


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[ControllerCore, Registrar, Links, list[str], Path]]:
    for i in range(4):
        adapter(tmp_path / f"a{i}", i)
    core = ControllerCore(ControllerConfig(catalog=CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny",
                                                                 max_rank=16)), epoch=1)
    log: list[str] = []
    links = Links(log)

    async def plan() -> None:
        log.append("plan")

    yield core, Registrar(core, links, set(), plan), links, log, tmp_path


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_read_runs_off_the_loop_and_the_loop_answers_meanwhile(world) -> None:
    core, registrar, _, log, root = world
    held = Held(core)
    held.hold("a0")

    async def scenario() -> None:
        registering = asyncio.create_task(registrar.register([("a0", str(root / "a0"))]))
        await held.until_arrived("a0")
        for _ in range(3):  # the loop is free: what a status call does, done while the read is held
            assert core.status()["adapters"] == 0
            await asyncio.sleep(0)
        assert not registering.done()
        held.release["a0"].set()
        (done,) = await registering
        assert done.error is None and done.version == core.catalog.get("a0").version and done.previous == ""

    run(scenario())
    assert log == [f"submit a0@{core.catalog.get('a0').version}", "plan"]


def test_each_names_calls_apply_in_arrival_order_whatever_order_their_reads_end(world) -> None:
    """Two registrations of one name: the first's read is held until the second's has ended; the second
    waits for its turn, then wins (the last call), and the workers hear them in arrival order."""
    core, registrar, _, log, root = world
    first_dir, second_dir = str(root / "a0"), str(root / "a1")
    first_started, release_first, second_read = threading.Event(), threading.Event(), threading.Event()
    real = core.read_adapter

    def read(name: str, path: str, known: KnownVersion | None = None) -> AdapterSpec:
        if path == first_dir:
            first_started.set()
            assert release_first.wait(30), "never released"
        spec = real(name, path, known)
        if path == second_dir:
            second_read.set()
        return spec

    core.read_adapter = read  # type: ignore[method-assign]

    async def scenario() -> None:
        first = asyncio.create_task(registrar.register([("a0", first_dir)]))
        assert await asyncio.to_thread(first_started.wait, 30)
        second = asyncio.create_task(registrar.register([("a0", second_dir)]))
        assert await asyncio.to_thread(second_read.wait, 30)
        for _ in range(5):  # every chance to apply out of turn
            await asyncio.sleep(0)
        assert not second.done() and "a0" not in core.catalog, "the second call went before the first"
        release_first.set()
        (a,), (b,) = await first, await second
        assert a.error is None and b.error is None and a.version != b.version
        assert b.previous == a.version  # the second replaced the first, not the other way round
        assert core.catalog.get("a0").version == b.version and core.catalog.versions("a0") == [a.version, b.version]
        assert [e for e in log if e.startswith("submit")] == [f"submit a0@{a.version}", f"submit a0@{b.version}"]
        assert len(registrar.turns) == 0

    run(scenario())


def test_a_batch_checks_every_item_first_and_a_bad_one_fails_alone(world) -> None:
    core, registrar, _links, log, root = world
    before = run(registrar.register([("a3", str(root / "a3"))]))[0].version
    log.clear()
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text("{not json")
    adapter(root / "cut", 9)
    (root / "cut" / WEIGHTS_FILE).write_bytes((root / "cut" / WEIGHTS_FILE).read_bytes()[:100])
    items = [("a0", str(root / "a0")), ("bad name!", str(root / "a1")), ("a1", ""), ("a2", str(root / "missing")),
             ("a0", str(root / "a2")), ("x", "/etc"), ("b", str(root / "broken")), ("a3", str(root / "cut")),
             ("a2", str(root / "a2"))]
    done = run(registrar.register(items))
    assert [d.name for d in done] == ["a0", "bad name!", "a1", "a2", "a0", "x", "b", "a3", "a2"]
    ok = {d.name for d in done if d.error is None}
    assert ok == {"a0"} and done[3].error is not None
    errors = {i: str(d.error) for i, d in enumerate(done) if d.error is not None}
    assert "adapter name 'bad name!' is invalid" in errors[1]
    assert "path '' is empty" in errors[2] and "give the adapter's directory" in errors[2]
    assert "does not exist; check the path" in errors[3]
    assert "named again in this batch (first as item 0)" in errors[4]
    assert isinstance(done[5].error, AdapterPathError) and "outside the adapter roots" in errors[5]
    assert isinstance(done[6].error, AdapterFormatError) and "is not valid JSON" in errors[6]
    assert "truncated or corrupt" in errors[7]
    assert "adapter 'a2' is named again in this batch (first as item 3)" in errors[8]
    assert core.catalog.get("a3").version == before, "a failed registration changed the catalog"
    assert "b" not in core.catalog and "x" not in core.catalog
    assert log.count("plan") == 1 and log[-1] == "plan"  # one plan, after every item was sent to the workers


def test_chunks_are_sent_as_they_are_read_and_at_most_max_sent_wait_for_answers(world, monkeypatch) -> None:
    core, registrar, links, _log, root = world
    monkeypatch.setattr(registrations, "CHUNK_ITEMS", 1)
    done = run(registrar.register([(f"a{i}", str(root / f"a{i}")) for i in range(4)]))
    assert all(d.error is None for d in done)
    assert [len(s) for s in links.sent] == [1, 1, 1, 1]
    assert links.most_outstanding <= registrations.MAX_SENT + 1 and links.outstanding == 0
    for (name, path, known), d in zip((e for s in links.sent for e in s), done):
        assert known is not None and known.version == d.version == core.catalog.get(name).version
        assert path == str(root / name)


def test_a_rank_that_refuses_a_version_is_named_in_the_items_result(world) -> None:
    core, registrar, links, _, root = world
    links.refuse["a1"] = "AdapterChangedError: its copy differs"
    done = run(registrar.register([("a0", str(root / "a0")), ("a1", str(root / "a1"))]))
    assert done[0].rank_errors == () and done[1].error is None
    assert done[1].rank_errors == ("replica/0: AdapterChangedError: its copy differs",)
    assert "a1" in core.catalog  # registered: the controller's catalog is the truth, the rank's loads fail


class _Rank:
    """A worker's handle whose ``register_adapters`` answers (every entry taken) or, ``restarting``, raises as Ray
    does for a call to a worker that died or restarts while the call is in flight."""

    def __init__(self, restarting: bool) -> None:
        self.restarting, self.register_adapters = restarting, self

    def remote(self, entries: list[Any]) -> Any:
        async def answer() -> list[tuple[str, str]]:
            if self.restarting:
                raise ConnectionError("the actor died unexpectedly before finishing this task")
            return [(known.version if known else "", "") for _, _, known in entries]
        return asyncio.ensure_future(answer())


def test_a_registration_a_restarting_rank_did_not_answer_is_registered_and_says_so(world) -> None:
    """Issue 46 item 3a: during a worker restart, registrations answered FAILED_PRECONDITION ("no answer") though
    the controller had applied them: a rank that did not answer counted as a rank that refused. Now it is named
    apart (``rank_pending``: it is given the registration when it is adopted again or restarts) and is no error;
    a refusal still is one. Through the real ``WorkerFanout``."""
    core, _, _, log, root = world

    links = SimpleNamespace(handles={WorkerId("r", 0): _Rank(restarting=False),
                                     WorkerId("r", 1): _Rank(restarting=True)})

    async def plan() -> None:
        log.append("plan")

    registrar = Registrar(core, WorkerFanout(links), set(), plan)  # type: ignore[arg-type]
    done = run(registrar.register([("a0", str(root / "a0")), ("a1", str(root / "a1"))]))
    for d in done:
        assert d.error is None and d.rank_errors == () and d.name in core.catalog
        assert d.rank_pending == (f"{worker_name(WorkerId('r', 1))}: no answer (ConnectionError); given it when it "
                                  "is adopted again or restarts",)


def test_a_registrations_answer_over_grpc_names_the_ranks_it_is_pending_on(world) -> None:
    """The same over the gateway's RegisterAdapters: the real servicer and client in front of a real ``Registrar``
    (a stand-in for the actor's forwarding only): the item is registered, with no error, and says which rank
    gets it later (``RegisteredAdapter.pending_ranks``)."""
    core, _, _, log, root = world
    links = SimpleNamespace(handles={WorkerId("r", 0): _Rank(restarting=True)})

    async def plan() -> None:
        log.append("plan")

    registrar = Registrar(core, WorkerFanout(links), set(), plan)  # type: ignore[arg-type]
    async def no_hints(batches: list[Any]) -> list[Any]:
        raise AssertionError("no hint is sent here")

    async def register(items: list[tuple[str, str]], request_ids: list[str]) -> list[Any]:
        assert all(request_ids)  # the client gives every item an id
        return await registrar.register(items)

    async def register_one(name: str, path: str, request_id: str) -> Any:  # the actor's, for one item
        (one,) = await register([(name, path)], [request_id])
        return one

    controller = SimpleNamespace(register_adapters=SimpleNamespace(remote=register),
                                 register_one=SimpleNamespace(remote=register_one),
                                 hint_batches=SimpleNamespace(remote=no_hints))
    gw = start_gateway_thread(GatewayConfig(grpc_port=0), controller)
    try:
        with LoraCacheClient(gw.target) as lc:
            (done,) = lc.register_many([("a2", str(root / "a2"))])
            single = lc.register("a1", str(root / "a1"))  # RegisterAdapter names them too (its pending_ranks)
    finally:
        gw.stop()
    assert single.version == core.catalog.get("a1").version and len(single.rank_pending) == 1
    assert done.error is None and done.version == core.catalog.get("a2").version and done.rank_errors == ()
    assert done.rank_pending == (f"{worker_name(WorkerId('r', 0))}: no answer (ConnectionError); given it when it "
                                 "is adopted again or restarts",)


def test_a_name_being_unregistered_is_refused_and_left_as_it_was(world) -> None:
    core, registrar, _, _, root = world
    run(registrar.register([("a0", str(root / "a0"))]))
    core.unregister_adapter("a0", 1.0)
    registrar.draining.add("a0")
    (done,) = run(registrar.register([("a0", str(root / "a0"))]))
    assert isinstance(done.error, ConflictError) and "is being unregistered" in str(done.error)
    with pytest.raises(NotFoundError):
        core.catalog.get("a0")


def test_an_unchanged_file_registered_again_keeps_its_version_without_hashing(world, monkeypatch) -> None:
    import lora_cache.adapters.peft as peft_module
    from lora_cache.adapters.files import RACY_NS

    core, registrar, _, _, root = world
    (first,) = run(registrar.register([("a0", str(root / "a0"))]))
    spec = core.catalog.get("a0")
    assert spec.source is not None
    settled = spec.source._replace(registered_ns=spec.source.identity.ctime_ns + 2 * RACY_NS)
    core.catalog.add(AdapterSpec(**{**spec.__dict__, "source": settled}))  # as if registered 2 s after the write
    calls: list[int] = []
    real = peft_module.digest_weights
    monkeypatch.setattr(peft_module, "digest_weights", lambda *a: calls.append(1) or real(*a))
    (again,) = run(registrar.register([("a0", str(root / "a0"))]))
    assert again.version == again.previous == first.version and calls == []
    (root / "a0" / WEIGHTS_FILE).write_bytes((root / "a1" / WEIGHTS_FILE).read_bytes())  # rewritten in place
    (new,) = run(registrar.register([("a0", str(root / "a0"))]))
    assert calls == [1] and new.version != first.version and new.previous == first.version


def test_turns_keep_arrival_order_and_forget_finished_names() -> None:
    async def scenario() -> list[str]:
        turns, order = Turns(), []
        a, b, c = turns.take("n"), turns.take("n"), turns.take("m")

        async def go(turn: Any, label: str, gate: asyncio.Event | None) -> None:
            await turn.wait()
            if gate is not None:
                await gate.wait()
            order.append(label)
            turn.done()

        gate = asyncio.Event()
        tasks = [asyncio.create_task(go(b, "b", None)), asyncio.create_task(go(a, "a", gate)),
                 asyncio.create_task(go(c, "c", None))]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(*tasks)
        assert len(turns) == 0
        return order

    order = run(scenario())
    assert order.index("a") < order.index("b") and "c" in order


def test_a_cancelled_waiter_does_not_break_the_chain() -> None:
    async def scenario() -> None:
        turns = Turns()
        a, b, c = turns.take("n"), turns.take("n"), turns.take("n")
        waiting = asyncio.create_task(b.wait())
        await asyncio.sleep(0)
        waiting.cancel()
        b.done()  # the cancelled call gives its turn up on its way out (register's finally)
        assert not a.mine.done()
        third = asyncio.create_task(c.wait())
        await asyncio.sleep(0)
        assert not third.done(), "the third call went before the first finished"
        a.done()
        await third
        c.done()
        assert len(turns) == 0

    run(scenario())



def test_a_replay_sends_each_chunk_as_registered_when_it_goes(world, monkeypatch) -> None:
    """A restarted worker is given every registration a chunk at a time; a name registered again while an
    earlier chunk is on its way is sent in its new version, never the one current when the replay began."""
    from types import SimpleNamespace

    from lora_cache.controller import links as links_module
    from lora_cache.controller.links import WorkerLinks

    core, _, _, _, root = world
    for i in range(3):
        core.register_adapter(f"a{i}", str(root / f"a{i}"))
    monkeypatch.setattr(links_module, "REPLAY_ENTRIES", 1)
    sent: list[list[tuple[str, str]]] = []

    class RegisterAdapters:
        def remote(self, entries: list[tuple[str, str, Any]]) -> asyncio.Future[list[tuple[str, str]]]:
            sent.append([(name, known.version) for name, _, known in entries])
            if len(sent) == 1:  # a registration applied while the first chunk is on its way
                core.register_adapter("a2", str(root / "a3"))
            answer = asyncio.get_running_loop().create_future()
            answer.set_result([(known.version, "") for _, _, known in entries])
            return answer

    async def replan() -> None:
        pass

    links = WorkerLinks(core, None, lambda events: None, replan, find=lambda name: None,  # type: ignore[arg-type]
                        named=lambda: [])
    run(links.replay([SimpleNamespace(register_adapters=RegisterAdapters())]))
    assert [chunk[0][0] for chunk in sent] == ["a0", "a1", "a2"]
    assert sent[2] == [("a2", core.catalog.get("a2").version)] and core.catalog.get("a2").path.name == "a3"
