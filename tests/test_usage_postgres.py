"""The usage store on PostgreSQL (:mod:`transports.http.accounting.usage_postgres`), against a real server.

The test starts its own PostgreSQL server from Debian's package (``initdb`` and ``postgres`` in
a temporary directory, as the ``postgres`` user when run as root) and reads the rows back with
a connection of its own. Without the package the tests skip saying so, unless
``PIPELINE_REQUIRE_POSTGRES=1`` (``make test`` sets it and installs the package), where they
fail. Oracles: the rows PostgreSQL returns, its own refusal while stopped, the HTTP answers.
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx
import pytest

from pipeline.errors import InvalidValueError
from tests.http_support import config, free_port, running
from transports.http import Gateway, ServerConfig
from transports.http.accounting.usage import UsageRecord, UsageStore
from transports.http.accounting.usage_postgres import PostgresUsage, read_records, shown

psycopg = pytest.importorskip("psycopg")


def _binary(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


class Server:
    """A PostgreSQL server of this test's own in ``folder``, on 127.0.0.1:``port``."""

    def __init__(self, folder: Path) -> None:
        initdb, self.postgres = _binary("initdb"), _binary("postgres")
        if initdb is None or self.postgres is None:
            reason = ("PostgreSQL is not installed (Debian: apt-get install postgresql); "
                      "make test installs it")
            if os.environ.get("PIPELINE_REQUIRE_POSTGRES") == "1":
                pytest.fail(reason)
            pytest.skip(reason)
        self.data, self.port = folder / "data", free_port()
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(folder, "postgres")
        subprocess.run([*self.as_user, initdb, "-D", str(self.data), "-A", "trust", "-U",
                        "pipeline", "--no-sync", "-E", "UTF8"], check=True,
                       capture_output=True, timeout=120)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"postgresql://pipeline@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        self.proc = subprocess.Popen([*self.as_user, self.postgres, "-D", str(self.data), "-p",
                                      str(self.port), "-c", "listen_addresses=127.0.0.1",
                                      "-c", "unix_socket_directories=", "-c", "fsync=off"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                assert time.monotonic() < deadline and self.proc.poll() is None, \
                    "PostgreSQL did not start"
                time.sleep(0.1)

    def stop(self) -> None:
        """Stop the server with its own tool (``pg_ctl stop -m fast``) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            pg_ctl = _binary("pg_ctl")
            assert pg_ctl is not None
            subprocess.run([*self.as_user, pg_ctl, "stop", "-D", str(self.data), "-m", "fast",
                            "-w"], check=True, capture_output=True, timeout=60)
            self.proc.wait(60)
        self.proc = None

    def clear(self) -> None:
        with psycopg.connect(self.url) as db:
            db.execute("DROP TABLE IF EXISTS usage")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # its own directory under the system's temporary one: the postgres user must reach it,
    # and pytest's are private to this user
    folder = Path(tempfile.mkdtemp(prefix="pipeline-pg-"))
    try:
        started = Server(folder)
        try:
            yield started
        finally:
            started.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def url(server: Server) -> str:
    server.clear()
    return server.url


def record(i: int, tokens: int = 4) -> UsageRecord:
    return UsageRecord(f"req-{i}", "m", "chat.completions", 3, tokens, 0, "stop", None, 0.0,
                       0.1, 0.2, time.time(), "abc")


def append_all(store: UsageStore, records: list[UsageRecord]) -> list[bool]:
    outcomes: dict[str, bool] = {}
    done = threading.Event()

    def on_done(rid: str, durable: bool) -> None:
        outcomes[rid] = durable
        if len(outcomes) == len(records):
            done.set()

    for r in records:
        store.append(r, lambda durable, rid=r.request_id: on_done(rid, durable))
    assert done.wait(60), "a record's callback never ran"
    return [outcomes[r.request_id] for r in records]


def test_records_land_once_and_a_retried_record_replaces_its_row(url: str, tmp_path: Path
                                                                 ) -> None:
    store = UsageStore(tmp_path, database=PostgresUsage(url))
    try:
        assert append_all(store, [record(i) for i in range(20)]) == [True] * 20
        assert append_all(store, [record(3, tokens=99)]) == [True]
    finally:
        store.close()
    rows = {r.request_id: r for r in read_records(url)}
    assert len(rows) == 20 and rows["req-3"].completion_tokens == 99
    want = record(7)  # every field back as written (finished_at is the write's own clock)
    assert rows["req-7"] == attrs.evolve(want, finished_at=rows["req-7"].finished_at)


def test_two_replicas_share_the_store_without_losing_or_doubling_a_row(url: str,
                                                                       tmp_path: Path) -> None:
    stores = [UsageStore(tmp_path / str(i), database=PostgresUsage(url)) for i in range(2)]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            done = list(pool.map(lambda k: append_all(
                stores[k], [record(1000 * k + i) for i in range(200)]), range(2)))
        assert done == [[True] * 200] * 2
    finally:
        for store in stores:
            store.close()
    ids = [r.request_id for r in read_records(url)]
    assert len(ids) == len(set(ids)) == 400


def test_a_stopped_server_spills_then_every_record_lands(server: Server, url: str,
                                                         tmp_path: Path) -> None:
    store = UsageStore(tmp_path, database=PostgresUsage(url, connect_timeout_s=1),
                       backoff_s=0.05, max_backoff_s=0.2)
    try:
        assert append_all(store, [record(i) for i in range(3)]) == [True] * 3
        server.stop()
        assert append_all(store, [record(i) for i in range(3, 8)]) == [False] * 5
        health = store.health()
        assert health.down is not None and health.spill_depth == 5
        server.start()
        deadline = time.monotonic() + 60
        while store.health().down is not None or store.health().spill_depth:
            assert time.monotonic() < deadline, "the spill never reached the database"
            time.sleep(0.05)
    finally:
        store.close()
    assert sorted(r.request_id for r in read_records(url)) == sorted(
        f"req-{i}" for i in range(8))


def test_two_servers_behind_one_store_record_each_request_once(url: str, tmp_path: Path
                                                               ) -> None:
    gateways = [Gateway(config(tmp_path / str(i), usage_database=url)) for i in range(2)]
    body = {"model": "default", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]}
    try:
        with running(gateways[0]) as a, running(gateways[1]) as b:
            def ask(i: int) -> str:
                base = (a, b)[i % 2]
                stream = i % 3 == 0
                with httpx.Client(timeout=60) as client:
                    if stream:
                        with client.stream("POST", f"{base}/v1/chat/completions",
                                           json={**body, "stream": True}) as r:
                            lines = list(r.iter_lines())
                            assert r.status_code == 200 and "data: [DONE]" in lines
                            return ""
                    r = client.post(f"{base}/v1/chat/completions", json=body)
                    assert r.status_code == 200
                    rid: str = r.json()["id"]
                    return rid

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                answered = [rid for rid in pool.map(ask, range(40)) if rid]
    finally:
        for gateway in gateways:
            gateway.close()
    rows = read_records(url)
    ids = [r.request_id for r in rows]
    assert len(ids) == len(set(ids)) == 40
    assert set(answered) <= set(ids)
    assert all(r.endpoint == "chat.completions" and r.completion_tokens == 3 for r in rows)


def test_a_bad_url_is_refused_and_a_password_never_shown() -> None:
    with pytest.raises(InvalidValueError, match="usage_database") as caught:
        ServerConfig(models={"default": None}, usage_database="postgresq://me:hunter2@db/u")
    assert "hunter2" not in str(caught.value)
    assert shown("postgresql://me:secret@db:5433/usage") == "postgresql://me@db:5433/usage"
    assert shown("postgresql://me@db/usage?password=secret&sslmode=require") == \
        "postgresql://me@db/usage?sslmode=require"
    assert "secret" not in shown("postgresql://me:secret@h1:5432,h2:5432/usage")
    config = ServerConfig(models={"default": None},
                          usage_database="postgresql://me:secret@db/usage")
    assert "secret" not in repr(config)


def test_replicas_starting_together_create_the_table_once(url: str) -> None:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        opened = list(pool.map(lambda _: PostgresUsage(url), range(4)))  # none raises
    for db in opened:
        db.close()


def test_a_record_with_a_nul_character_lands(url: str, tmp_path: Path) -> None:
    store = UsageStore(tmp_path, database=PostgresUsage(url))
    bad = attrs.evolve(record(1), error="a\x00b")
    try:
        assert append_all(store, [bad, record(2)]) == [True, True]
    finally:
        store.close()
    assert {r.request_id: r.error for r in read_records(url)}["req-1"] == "a\\0b"


class FrozenDatabase:
    """A database whose write never returns until released (a server frozen mid-write)."""

    name = "frozen"

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def write(self, records: object) -> None:
        self.entered.set()
        self.release.wait(60)

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_write_that_does_not_return_makes_the_store_report_down(tmp_path: Path) -> None:
    now = [100.0]
    db = FrozenDatabase()
    store = UsageStore(tmp_path, database=db, clock=lambda: now[0])
    try:
        store.append(record(1))
        assert db.entered.wait(30)
        assert store.health().down is None          # a write in flight is not yet a fault
        now[0] += 11                                # the injected clock: past WRITE_STALL_S
        down = store.health().down
        assert down is not None and "has not returned for 11 s" in down
    finally:
        db.release.set()
        store.close()
