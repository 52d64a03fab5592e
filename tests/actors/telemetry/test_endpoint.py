"""A role's ``/metrics`` endpoint and the pieces under it, without a run: the families a collector
builds (checked against the catalogue), histogram buckets, request latencies, the bearer key, the
target file, a port in use, and the ``[metrics]`` config's checks."""

from __future__ import annotations

import json
import math
import re
import socket
import threading
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from helpers.timeouts import guard
from prometheus_client.parser import text_string_to_metric_families

from specroll.actors.config import RunConfig
from specroll.actors.config.metrics_section import MetricsConfig
from specroll.actors.config.network_section import NetworkConfig
from specroll.actors.telemetry import catalogue as c
from specroll.actors.telemetry import endpoint
from specroll.actors.telemetry.endpoint import MetricsEndpoint, open_endpoint
from specroll.actors.telemetry.families import Buckets, family, role_families
from specroll.actors.telemetry.generator_metrics import RequestLatency, SyncCounters
from specroll.engine.spec.stats import SpeculativeStats


def _config(tmp_path: Path, **metrics: object) -> RunConfig:
    return RunConfig(run_dir=str(tmp_path / "run"), metrics=MetricsConfig(enabled=True, port=0, **metrics))


def _get(url: str, key: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=guard(30)) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_buckets_count_each_value_in_the_first_bucket_at_or_above_it() -> None:
    b = Buckets((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0, math.nan):
        b.observe(v)
    b.observe(0.5, count=3)
    assert b.cumulative() == [("0.1", 2.0), ("1.0", 7.0), ("+Inf", 8.0)]
    assert b.sum == pytest.approx(0.05 + 0.1 + 0.5 * 4 + 1.0 + 7.0)


def test_family_refuses_what_the_catalogue_does_not_say() -> None:
    with pytest.raises(ValueError, match="label values"):
        family(c.GENERATION_TOKENS, [(("model",), 1)])  # model_name and engine expected
    with pytest.raises(ValueError, match="needs Buckets"):
        family(c.TTFT, [(("m", "0"), 1.0)])
    with pytest.raises(ValueError, match="needs a number"):
        family(c.GENERATION_TOKENS, [(("m", "0"), Buckets((1.0,)))])


def test_request_latency_times_first_token_each_later_step_and_the_whole_request() -> None:
    lat = RequestLatency()
    lat.admitted("r", 10.0)
    lat.emitted("r", 10.5)  # first token: TTFT 0.5
    lat.admitted("r", 11.0)  # a re-prefill (kv_policy = "recompute") keeps the request's times
    lat.emitted("r", 11.5)  # ITL 1.0
    lat.emitted("r", 11.6)  # ITL 0.1
    lat.finished_now("r", "stop", 12.0)  # e2e 2.0
    lat.emitted("gone", 13.0)  # after its finish (or never admitted): nothing
    assert (sum(lat.ttft.counts), lat.ttft.sum) == (1, 0.5)
    assert sum(lat.itl.counts) == 2 and lat.itl.sum == pytest.approx(1.1)
    assert (sum(lat.e2e.counts), lat.e2e.sum, lat.finished) == (1, 2.0, Counter(stop=1))
    lat.admitted("refused", 1.0)
    lat.forget("refused")
    assert not lat._times


def test_sync_counters_and_accepted_tokens_per_draft_position() -> None:
    sync = SyncCounters()
    sync.applied(1000, fetch_started=0.0, pause_s=0.25)
    assert (sync.syncs, sync.bytes, sync.pause_s) == (1, 1000, 0.25) and sync.seconds > 0
    step, total = SpeculativeStats(), SpeculativeStats()
    step.count_verify(4, 2)
    step.count_verify(4, 0)
    step.count_verify(4, 3)
    total.add(step)
    total.add(step)
    assert step.accepted_per_pos == [2, 2, 1] and total.accepted_per_pos == [4, 4, 2]
    assert total.num_accepted == sum(total.accepted_per_pos)


def test_endpoint_serves_the_families_and_its_target_file_then_removes_it(tmp_path: Path) -> None:
    refusals: Counter[str] = Counter(malformed=2)
    ep = MetricsEndpoint(_config(tmp_path), "drafter", "drafter-0", lambda: role_families(refusals, "drafter", "x"))
    try:
        target = json.loads((tmp_path / "run" / "metrics" / "targets" / "drafter-0.json").read_text())
        assert target == [{"targets": [f"127.0.0.1:{ep.port}"],
                       "labels": {"run": "run", "role": "drafter", "actor": "drafter-0"}}]
        status, text = _get(ep.url)
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(text)}
        refused = {s.labels["code"]: s.value for s in families["specroll:refusals"].samples}
        assert refused["malformed"] == 2 and refused["internal"] == 0  # every code, 0 included
        assert "process_resident_memory_bytes" in families
        assert _get(ep.url.replace("/metrics", "/other"))[0] == 404
    finally:
        ep.close()
    assert not (tmp_path / "run" / "metrics" / "targets" / "drafter-0.json").exists()
    ep.close()  # again: nothing


def test_a_key_is_required_when_set(tmp_path: Path) -> None:
    ep = MetricsEndpoint(_config(tmp_path, api_key="s3cret"), "trainer", "trainer", lambda: iter(()))
    try:
        assert _get(ep.url)[0] == 401
        assert _get(ep.url, "wrong")[0] == 401
        assert _get(ep.url, "s3cret")[0] == 200
    finally:
        ep.close()


def test_a_port_in_use_is_named(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = RunConfig(run_dir=str(tmp_path), metrics=MetricsConfig(enabled=True, port=port))
        with pytest.raises(OSError, match=f"metrics endpoint of trainer: cannot bind 127.0.0.1:{port}"):
            MetricsEndpoint(config, "trainer", "trainer", lambda: iter(()))
    assert open_endpoint(RunConfig(), "trainer", "trainer", lambda: iter(())) is None  # disabled: nothing


def test_ports_by_role_and_the_config_checks() -> None:
    m = MetricsConfig(port=9400)
    assert [m.port_for(a) for a in ("trainer", "drafter-0", "generator-0", "generator-3", "gen-x", "server")] == \
        [9400, 9401, 9402, 9405, 9400, 9400]
    assert MetricsConfig(port=0).port_for("generator-3") == 0
    with pytest.raises(ValueError, match=re.escape("metrics.host='0.0.0.0', expected a loopback address")):
        RunConfig(metrics=MetricsConfig(enabled=True, host="0.0.0.0"))
    RunConfig(metrics=MetricsConfig(enabled=True, host="0.0.0.0", api_key="k"))  # a key: allowed
    RunConfig(metrics=MetricsConfig(enabled=True, host="0.0.0.0"), network=NetworkConfig(allow_insecure=True))
    with pytest.raises(ValueError, match="port=70000"):
        MetricsConfig(port=70000)
    with pytest.raises(ValueError, match="wandb_mode='cloud'"):
        MetricsConfig(wandb_mode="cloud")  # type: ignore[arg-type]


def test_the_catalogue_names_are_unique_and_bounded() -> None:
    names = [m.name for m in c.ALL]
    assert len(names) == len(set(names))
    for m in c.ALL:
        assert m.name.startswith(("vllm:", "specroll:")), m.name
        assert not {"request_id", "group_id", "session_id"} & set(m.labels), m.name
        assert (m.kind == "histogram") == bool(m.buckets), m.name
    assert c.of_role("generator", speculative=False) == tuple(m for m in c.of_role("generator") if not m.speculative)
    assert c.GENERATORS in c.of_role("server") and c.GENERATORS not in c.of_role("generator")


def test_the_text_format_keeps_the_colons_whatever_the_scraper_accepts(tmp_path: Path) -> None:
    """Prometheus 2 asks for OpenMetrics first; prometheus_client's OpenMetrics output would store
    ``vllm:generation_tokens_total`` as ``vllm_generation_tokens_total``."""
    ep = MetricsEndpoint(_config(tmp_path), "generator", "generator-0",
                         lambda: iter([family(c.GENERATION_TOKENS, [(("m", "0"), 5)])]))
    try:
        accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        with urllib.request.urlopen(urllib.request.Request(ep.url, headers={"Accept": accept}), timeout=guard(30)) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = r.read().decode()
        assert 'vllm:generation_tokens_total{engine="0",model_name="m"} 5.0' in text, text
    finally:
        ep.close()


def test_a_client_that_drips_or_stalls_holds_neither_other_scrapes_nor_the_exit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(endpoint, "CONNECTION_S", 600.0)  # the stalled ones outlive the test: they must not matter
    monkeypatch.setattr(endpoint._Handler, "timeout", 600.0)
    ep = MetricsEndpoint(_config(tmp_path), "trainer", "trainer", lambda: iter(()))
    stalled = [socket.create_connection(("127.0.0.1", ep.port)) for _ in range(3)]
    try:
        stalled[0].sendall(b"GET /metrics HTTP/1.1\r\nX-A: a")  # headers never finished
        assert _get(ep.url)[0] == 200  # served beside the stalled connections (one at a time: 600 s)
        closing = threading.Thread(target=ep.close)
        closing.start()
        closing.join(timeout=guard(60))  # a hang guard: it returns without waiting for them
        assert not closing.is_alive() and not ep._thread.is_alive()
    finally:
        for s in stalled:
            s.close()


def test_only_get_and_head_and_a_bearer_scheme_in_any_case(tmp_path: Path) -> None:
    ep = MetricsEndpoint(_config(tmp_path, api_key="k"), "generator", "../../generator 0", lambda: iter(()))
    try:
        post = urllib.request.Request(ep.url, data=b"x", method="POST", headers={"Authorization": "Bearer k"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(post, timeout=guard(30))
        assert refused.value.code == 405
        head = urllib.request.Request(ep.url, method="HEAD", headers={"Authorization": "bearer k"})
        with urllib.request.urlopen(head, timeout=guard(30)) as reply:
            assert reply.status == 200 and reply.read() == b""
        # an id that is not a file name is made one; the file is readable by a Prometheus of another user
        target = tmp_path / "run" / "metrics" / "targets" / ".._.._generator_0.json"
        assert target.exists() and target.stat().st_mode & 0o777 == 0o644
    finally:
        ep.close()


def test_launch_checks_every_role_s_metrics_port_also_under_serve(tmp_path: Path) -> None:
    from specroll.actors.config.generator_section import GeneratorConfig
    from specroll.actors.launch.errors import LaunchError
    from specroll.actors.launch.preflight import _check_metrics

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        base = busy.getsockname()[1] - 3  # generator-1's port is taken
        config = RunConfig(run_dir=str(tmp_path), generator=GeneratorConfig(count=2),
                           metrics=MetricsConfig(enabled=True, port=base))
        for serving in (False, True):
            with pytest.raises(LaunchError, match=re.escape(f"metrics.port (generator-1's)={base + 3}")):
                _check_metrics(config, serving)
    with pytest.raises(ValueError, match=re.escape("room for generator.count = 64 generators")):
        RunConfig(generator=GeneratorConfig(count=64), metrics=MetricsConfig(port=65471))


def test_restarts_come_from_the_launcher_s_file_so_a_restarted_trainer_never_reads_0(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from specroll.actors.telemetry.trainer_metrics import TrainerExport

    hub = SimpleNamespace(coordinator=SimpleNamespace(generators={"generator-0": None}, groups_dropped=Counter()),
                          dead_generators={},
                          mail=SimpleNamespace(errors_sent=Counter()))
    export = TrainerExport(hub, tmp_path)  # type: ignore[arg-type]
    (tmp_path / "restarts.json").write_text(json.dumps({"restarts_by_role": {"generator-1": 2}}))
    (restarts,) = [f for f in export.collect() if f.name == "specroll:restarts"]
    assert {s.labels["process"]: s.value for s in restarts.samples} == {"trainer": 0, "generator-0": 0,
                                                                         "generator-1": 2}
