"""No request can freeze or exhaust ComfyUI through the pack (issue 53): every size, count, list and
text an input can carry is bounded before anything is built from it, the pack's messages stay under
1 KB, the validate route answers malformed bodies 400 and never 500, and the node refuses exactly
what the route refuses. The cases of the issue's table first, in process and timed; then a fuzz
through a real server (the route and /prompt), with /system_stats polled throughout."""
import importlib
import json
import math
import random
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import PACK

config_mod = PACK.parallel_runtime.config
routes = importlib.import_module("hybrid_parallel_pack.parallel_runtime.comfyui_glue.routes")
memory = importlib.import_module("hybrid_parallel_pack.parallel_runtime.world.memory")
CPU2 = config_mod.HostDevices("cpu", cpu_count=2)
MESSAGE_MAX = 1000
HANDLING_S = 0.1  # the pack's own handling of one request, at most


def checked(values: dict, host=CPU2) -> dict:
    """The route's answer for ``values``, timed, with the node's verdict on the same values."""
    start = time.perf_counter()
    answer = routes.validate(values, host)
    took = time.perf_counter() - start
    assert took < HANDLING_S, f"validate took {took:.3f} s for {str(values)[:200]}"
    assert len(answer["message"]) <= MESSAGE_MAX, len(answer["message"])
    return answer


def node_verdict(values: dict):
    return PACK.nodes.ParallelConfigNode.validate_inputs(**values)


# The table: each gets a short refusal at once.
@pytest.mark.parametrize("values, words", [
    ({"ulysses_size": 100_000_000}, "from 1 to 1024"),
    ({"ulysses_size": 10**12}, "from 1 to 1024"),
    ({"ulysses_size": 1024, "ring_size": 1024, "tp_size": 1024, "cfg_size": 1024}, "at most 1024 ranks"),
    ({"ulysses_size": 1024, "ring_size": 1024, "tp_size": 100}, "world size of 104857600"),
    ({"devices": ",".join(["cpu"] * 100_000)}, "399999 characters"),
    ({"devices": ",".join(["cpu"] * 2000)}, "it lists 2000 devices"),
    ({"weights": "1,inf", "devices": "cpu,cpu", "ulysses_size": 2}, "finite positive number"),
    ({"weights": "nan,1", "devices": "cpu,cpu", "ulysses_size": 2}, "finite positive number"),
    ({"ulysses_size": "9" * 5000}, "from 1 to 1024"),
    ({"ulysses_size": float("nan")}, "from 1 to 1024"),
    ({"ulysses_size": float("inf")}, "from 1 to 1024"),
    ({"ulysses_size": 1e300}, "from 1 to 1024"),
    ({"devices": "cpu,\x00cpu"}, "control characters"),
    ({"devices": 12}, "it is a int; give a text"),
    ({"hosts": True}, "it is a bool; give a text"),
    ({"devices": "9" * 5000}, "neither 'cpu' nor a CUDA index"),
    ({"hosts": "local:1,b:" + "9" * 5000, "ulysses_size": 2}, "is not 'name:ranks'"),
    ({"hosts": "local:1,b:1", "rendezvous": "10.0.0.1:" + "9" * 5000, "ulysses_size": 2}, "free port"),
])
def test_bad_values_get_short_refusals_at_once_from_route_and_node_alike(values, words):
    answer = checked(values)
    assert answer["ok"] is False and words in answer["message"], answer["message"]
    assert node_verdict(values) == answer["message"]


def test_several_hosts_without_the_cluster_key_are_refused_before_the_run(monkeypatch):
    monkeypatch.delenv("PARALLEL_CLUSTER_KEY", raising=False)
    values = {"ulysses_size": 2, "devices": "cpu", "hosts": "local:1,gpu-b:1", "rendezvous": "0.0.0.0:29655"}
    answer = checked(values)
    assert answer["ok"] is False and "PARALLEL_CLUSTER_KEY" in answer["message"], answer
    assert node_verdict(values) == answer["message"]
    monkeypatch.setenv("PARALLEL_CLUSTER_KEY", "x" * 16)
    assert checked(values)["ok"] is True


def test_devices_of_several_hosts_are_counted_against_this_hosts_ranks(monkeypatch):
    monkeypatch.setenv("PARALLEL_CLUSTER_KEY", "x" * 16)
    values = {"ulysses_size": 2, "devices": "cpu,cpu", "hosts": "local:1,gpu-b:1", "rendezvous": "10.0.0.1:29655"}
    message = checked(values)["message"]
    assert "this host runs 1 of the world's 2 ranks" in message and "world size of 1" not in message, message


def test_the_route_answers_malformed_bodies_400_and_schema_values_200():
    for raw in [b"not json", b"[1, 2]", b"\"text\"", b"{" * 100_000, b"1" * 5000, b"\xff\xfe",
                json.dumps({"devices": "cpu," * 50_000}).encode(), json.dumps({"ulysses_size": [2]}).encode()]:
        start = time.perf_counter()
        values, problem = routes.parse_body(raw)
        assert time.perf_counter() - start < HANDLING_S
        assert values is None and problem and len(problem) <= MESSAGE_MAX, (raw[:40], problem)
    values, problem = routes.parse_body(b'{"ulysses_size": 2, "devices": "cpu,cpu", "unknown": [1]}')
    assert problem is None and routes.validate(values, CPU2)["ok"] is True
    assert checked({"ulysses_size": 0})["malformed"] is True      # no widget holds 0: 400
    assert checked({"ulysses_size": 3})["malformed"] is False     # a widget's value the config refuses: 200


def test_status_reads_each_process_memory_at_most_twice_a_second(monkeypatch):
    reads = []
    monkeypatch.setattr(memory, "process_memory", lambda pid: reads.append(pid) or {"rss_bytes": 1})
    monkeypatch.setattr(memory, "_recent", {})
    start = time.monotonic()
    while time.monotonic() - start < 1.2:
        assert memory.recent_process_memory(4242) == {"rss_bytes": 1}
    assert 2 <= len(reads) <= 3, len(reads)


# Through a real server.
RNG_SEED = 53


def _sizes(rng):
    return rng.choice([0, 1, 2, 3, -1, 1024, 1025, 10**8, 10**12, 10**40, int("9" * 4000), 2.0, 2.5, 1e300,
                       float("nan"), float("inf"), -float("inf"), True, "2", "x", "9" * 4000, "\x00", "",
                       rng.randint(-10**6, 10**6)])


def _text(rng):
    alphabet = "cpu,cuda:0123456789 \t.-@:;/\\'\"\x00\x01\x1b\x7fé✓"
    return rng.choice([
        "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))),
        ",".join(["cpu"] * rng.choice([2, 3, 1025, 100_000])), "cuda:" + "9" * 3000, "auto", "cpu", "manual",
        "nccl", "gloo", "local:1,gpu-b:1", "0.0.0.0:29655", "1,inf", "nan,1", "1,0.5", 5, 2.5, float("nan"),
        True, ""])


def fuzz_values(rng) -> dict:
    values = {}
    for spec in config_mod.CONFIG_INPUTS:
        if rng.random() < 0.5:
            values[spec.name] = _sizes(rng) if spec.kind == "int" else _text(rng)
        elif not spec.optional:  # ComfyUI refuses a prompt that lacks a required input before the node sees it
            values[spec.name] = spec.default
    return values


def widget_typed(values: dict) -> bool:
    """Every value of the type its widget holds: whole numbers for sizes, texts for the rest."""
    kinds = {spec.name: spec.kind for spec in config_mod.CONFIG_INPUTS}
    return all(isinstance(v, int) and not isinstance(v, bool) if kinds[k] == "int" else isinstance(v, str)
               for k, v in values.items())


def _post(server, path: str, body: bytes, timeout: float = 30) -> tuple[int, dict, float]:
    request = urllib.request.Request(server.url + path, data=body, headers={"Content-Type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            code, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        code, raw = err.code, err.read()
    took = time.monotonic() - start
    try:
        return code, json.loads(raw), took
    except ValueError:
        return code, {"raw": raw[:300].decode("utf-8", "replace")}, took


def _strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _strings(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _strings(value)


class Poller(threading.Thread):
    """GET /system_stats every 0.25 s; the slowest answer and any failure are kept."""

    def __init__(self, server):
        super().__init__(daemon=True)
        self.server, self.slowest, self.failures, self.stop = server, 0.0, [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                self.server.get("/system_stats", timeout=10)
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                self.failures.append(repr(exc))
            self.slowest = max(self.slowest, time.monotonic() - start)
            self.stop.wait(0.25)


def _world_pids(server):
    status = server.get("/parallel/status")
    return [rank["pid"] for rank in status["ranks"]], status["state"]


def _queue_drained(server, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queue = server.get("/queue")
        if not queue["queue_running"] and not queue["queue_pending"]:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.smoke
def test_fuzzed_inputs_through_a_real_server_are_answered_at_once_and_start_nothing(tiny_server):
    rng = random.Random(RNG_SEED)
    info = tiny_server.object_info()
    assert "PreviewAny" in info, "this host's ComfyUI lacks PreviewAny, the output node the fuzz prompts end in"
    before = _world_pids(tiny_server)
    poller = Poller(tiny_server)
    poller.start()
    try:
        # The table's prompt that stopped the server: sizes within the widgets, a product of 10^8.
        huge = {"ulysses_size": 1024, "ring_size": 1024, "tp_size": 100, "cfg_size": 1, "devices": "auto",
                "backend": "auto"}
        pcode, pbody, ptook = _post(tiny_server, "/prompt", json.dumps({"prompt": {
            "1": {"class_type": "ParallelConfig", "inputs": huge},
            "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}}).encode())
        assert pcode == 400 and ptook < 2 and "at most 1024 ranks" in json.dumps(pbody), (pcode, ptook, pbody)
        for _ in range(60):
            values = fuzz_values(rng)
            body = json.dumps(values).encode()
            code, answer, took = _post(tiny_server, routes.VALIDATE_ROUTE, body)
            assert code in (200, 400) and took < 3, (code, took, str(values)[:300])
            assert len(answer["message"]) <= MESSAGE_MAX
            prompt = {"1": {"class_type": "ParallelConfig", "inputs": values},
                      "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
            pcode, pbody, ptook = _post(tiny_server, "/prompt", json.dumps({"prompt": prompt}).encode())
            assert pcode in (200, 400) and ptook < 5, (pcode, ptook, pbody, str(values)[:300])
            if answer["ok"] is False:  # refused by the route: refused at /prompt too
                assert pcode == 400, (answer, pbody)
                # ComfyUI converts a value to its widget's type before the node sees it (int("x") fails
                # there, 5 becomes "5"); values already of those types reach the node as the route saw them.
                if widget_typed(values):
                    assert any(answer["message"] in s for s in _strings(pbody)), (answer, pbody)
            elif code == 200 and answer.get("world_size") is not None:
                assert pcode == 200, (values, pbody)
        for raw in [b"not json", b"{" * 50_000, b"[" + b"1," * 100_000 + b"1]", b"9" * 5000,
                    json.dumps({"devices": "cpu," * 200_000}).encode(), b'{"ulysses_size": NaN}',
                    b'{"ulysses_size": Infinity}', b'{"ulysses_size": 1e999}', b'{"tp_size": {"a": 1}}']:
            code, answer, took = _post(tiny_server, routes.VALIDATE_ROUTE, raw)
            assert code == 400 and took < 3 and len(answer["message"]) <= MESSAGE_MAX, (raw[:40], code, answer)
        model = {"10": {"class_type": "UNETLoader",
                        "inputs": {"unet_name": "tiny_wan21_t2v.safetensors", "weight_dtype": "default"}},
                 "11": {"class_type": "ParallelConfig", "inputs": {"ulysses_size": 2, "devices": "cpu"}}}
        for _ in range(20):
            flag = rng.choice([True, False, 0, 1, "yes", "", None, float("nan"), 10**30, [1]])
            cache = {name: rng.choice([0, 1, 3, -1, 10**9, 1e300, float("nan"), float("inf"), "x", 0.5])
                     for name in ("front_blocks", "back_blocks", "threshold", "warmup_steps", "max_cached_steps",
                                  "taylor_order")}
            prompt = {**model,
                      "12": {"class_type": "ShardTransformer", "inputs": {"model": ["10", 0], "parallel_config":
                                                                          ["11", 0], "verify_first_step": flag}},
                      "13": {"class_type": "PreviewAny", "inputs": {"source": ["12", 0]}},
                      "14": {"class_type": "HybridBlockCache", "inputs": {"model": ["10", 0], **cache}},
                      "15": {"class_type": "PreviewAny", "inputs": {"source": ["14", 0]}}}
            pcode, pbody, ptook = _post(tiny_server, "/prompt", json.dumps({"prompt": prompt}).encode())
            assert pcode in (200, 400) and ptook < 5, (pcode, ptook, pbody)
        assert _queue_drained(tiny_server), "the fuzz prompts did not finish within 2 minutes"
    finally:
        poller.stop.set()
        poller.join(15)
    assert not poller.failures and poller.slowest < 5, (poller.failures, poller.slowest)
    assert _world_pids(tiny_server) == before, "a world was started or changed by the fuzz prompts"


def test_messages_are_cut_to_their_bound_with_the_length_said():
    error = config_mod.ConfigError("x" * 10_000)
    assert len(str(error)) <= MESSAGE_MAX and "10000 characters" in str(error)
    shown = config_mod.shown("cpu," * 1000)
    assert len(shown) <= 100 and "4000 characters" in shown
    assert math.isclose(len(config_mod.example_list("cpu", 1024)), len("cpu,cpu,... (1024 entries)"))
