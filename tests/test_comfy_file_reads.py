"""The GPU ranks' weight path through a real ComfyUI server: the stream (forced on the CPU with
PARALLEL_WEIGHT_TRANSPORT=process_group), with every worker reading what it holds from the file
ComfyUI's loader recorded (ComfyUI 0.33 on), the LoRA-patched tensors travelling merged. The
latents equal the unsharded run's; on a ComfyUI that records no file everything travels and the
status says why."""
import sys
import time

import pytest
from safetensors.torch import load_file

from comfy_server import ComfyServer
from workflows import edited, remove_passthrough

pytestmark = pytest.mark.comfy_server
TOL = 1e-4  # fp32 rounding of a sharded run against one process (tests/test_comfy_e2e.py)
PATCHED = "patched (a LoRA or another weight patch): sent merged"


def final_latent(server, prompt):
    entry = server.run(prompt, timeout=300)
    (path,) = server.outputs(entry, "latents")
    return load_file(str(path))["latent_tensor"]


@pytest.fixture(scope="module")
def stream_server(tiny_base, comfyui_path):
    server = ComfyServer(comfyui_path, tiny_base, python=sys.executable,
                         env={"PARALLEL_WEIGHT_TRANSPORT": "process_group"}).start()
    yield server
    server.stop()


def records_files(comfyui_path) -> bool:
    return "cached_patcher_init" in (comfyui_path / "comfy" / "model_patcher.py").read_text()


@pytest.mark.parametrize("sizes", [{"ulysses_size": 2, "tp_size": 1}, {"ulysses_size": 1, "tp_size": 2}],
                         ids=["ulysses2", "tp2"])
def test_workers_read_the_unpatched_weights_from_comfyuis_file(stream_server, tiny_prompt, comfyui_path, sizes):
    from pathlib import Path

    prompt = edited(tiny_prompt, ParallelConfig=sizes)
    reference = final_latent(stream_server, remove_passthrough(prompt, "ShardTransformer", "model"))
    result = final_latent(stream_server, prompt)
    err = (result - reference).abs().max().item()
    status = stream_server.get("/parallel/status")
    send = status["last_weight_send"]
    reads = send["file_reads"]
    print(f"\n{sizes}: max abs err {err:.2e}; {reads}")
    assert status["transport"] == "process_group" and err <= TOL
    if records_files(Path(comfyui_path)):
        # The demo's LoRAs (one before the node, one after) patch some tensors: those travel merged.
        assert reads["file"] == "tiny_wan21_t2v.safetensors" and reads["tensors"] > 0
        assert set(reads["why_streamed"]) == {PATCHED}, reads
        assert reads["bytes_per_worker"][0] > 0
    else:
        assert reads["tensors"] == 0 and list(reads["why_streamed"]) == [
            "this ComfyUI does not record the file a model came from (0.33 does), or a custom loader built it"]
    load = status["ranks"][1]["load"]
    assert load["via"] == "process_group" and load["done_bytes"] == load["total_bytes"] > 0


def test_two_models_in_turn_stay_on_the_ranks(stream_server, tiny_prompt):
    """Wan 2.2's way: a high-noise and a low-noise model, each behind its own Shard Transformer, in
    one prompt. Run again (another seed), nothing is sent: the ranks hold both models until ComfyUI
    unloads one; the latents equal the unsharded run's."""
    from workflows import two_model_prompt

    prompt = two_model_prompt(tiny_prompt, {"ulysses_size": 2}, {"ulysses_size": 2})
    reference = final_latent(stream_server, remove_passthrough(prompt, "ShardTransformer", "model"))
    assert (final_latent(stream_server, prompt) - reference).abs().max().item() <= 2 * TOL
    sends = stream_server.get("/parallel/status")["weight_sends"]
    again = edited(prompt, KSampler={"seed": 7}, KSamplerAdvanced={"noise_seed": 7})
    final_latent(stream_server, again)
    status = stream_server.get("/parallel/status")
    print(f"\nweight sends: {sends} after the first prompt, {status['weight_sends']} after the second")
    assert status["weight_sends"] == sends
    held = status["models"]  # each model, and which way its weights came
    assert len(held) == 2 and len({m["key"] for m in held}) == 2
    assert all(m["transport"] == "process_group" and m["file_reads"] is not None for m in held), held
    assert status["ranks"][1]["param_bytes"] > status["ranks"][1]["load"]["total_bytes"] > 0  # both models


def test_a_slow_cold_read_is_a_load_not_a_hang_and_cancel_stops_it(tmp_path, comfyui_path, monkeypatch):
    """Workers reading a checkpoint from a slow disk (a wait per tensor, 4 s in all) with a start-up
    timeout of 1 s: the reads tick the world's progress, so rank 0 waits for them, and the result
    equals the unsharded one; the load's progress is told as it goes. Cancel pressed 1 s into a
    first load stops every worker's reads: the call raises LoadStopped well before the reads would
    have ended, no rank holds any of the model, the world stays up, and the next call loads it."""
    import torch
    from safetensors.torch import save_file

    from conftest import VersionedSource
    from parallel_runtime.weights.model_copies import LoadStopped
    from parallel_runtime.weights.shards import named_tensors
    from test_weight_transport import TEXT_DIM, reference, run, start_world, wan_inputs
    from tiny_models import TinyWan, build_wan_model

    model = build_wan_model(TinyWan(dim=128, ffn_dim=256, num_layers=2), seed=6, text_dim=TEXT_DIM)
    path = tmp_path / "slow.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    count = len(list(named_tensors(model)))
    monkeypatch.setenv("PARALLEL_TEST_SLOW_FILE_READS_MS", str(int(4000 / count)))
    world = start_world(comfyui_path, monkeypatch, {"PARALLEL_WEIGHT_TRANSPORT": "process_group"}, ulysses_size=2)
    heard: list[list[float]] = []  # what each load's progress listener heard (ComfyUI's bar on a server)
    world.on_load = lambda: heard.append([]) or heard[-1].append
    try:
        world.startup_timeout = 1.0
        args = wan_inputs(seed=3)
        source = VersionedSource(str(path))
        cancel_at = [time.monotonic() + 1.0]
        world.load_cancelled = lambda: time.monotonic() > cancel_at[0]
        with pytest.raises(LoadStopped, match="no rank holds the model"):
            run(world, model, args, source)
        stopped_after = time.monotonic() - (cancel_at[0] - 1.0)
        status = world.status()
        assert status["state"] == "ready" and status["weight_sends"] == 0 and status["models"] == []
        assert [r["param_bytes"] for r in status["ranks"][1:]] == [0]  # the one worker
        cancel_at[0] = float("inf")
        out = run(world, model, args, source)
        assert world.copies.last_send["file_reads"]["tensors"] == count
        assert world.copies.last_send["seconds"] > 3.0
        assert (out - reference(model, args)).abs().max().item() <= 1e-5
        assert torch.isfinite(out).all()
        run(world, model, args, source)  # held: nothing loads, nothing to tell
    finally:
        world.shutdown("test done")
    print(f"\nthe stopped load ended {stopped_after:.2f} s after it began (Cancel at 1 s, the reads take 4 s)")
    assert stopped_after < 2.5
    # The loads were told as they went: from the start (rank 0, which streams almost nothing here, is
    # done first: a third) through the workers' reads, to 1.0 when every rank was done, never going
    # back; the stopped load never reached 1.0.
    stopped, fractions = heard
    print(f"load progress heard: {[round(f, 2) for f in stopped]} (stopped), {[round(f, 2) for f in fractions]}")
    assert stopped and max(stopped) < 1.0
    assert len(fractions) >= 10 and fractions[-1] == 1.0
    assert fractions == sorted(fractions)
    assert fractions[0] < 0.75 and sum(fractions[0] < f < 1.0 for f in fractions) >= 5


def test_every_reason_to_stream_a_tensor_instead(tmp_path):
    """file_reads.checkpoint_of and plan_reads, one case per reason they name: each tensor the file
    cannot give exactly travels over the stream with its reason, the rest is read."""
    import types

    import torch
    from safetensors.torch import save_file

    from parallel_runtime.weights import file_reads

    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(6, 4, generator=gen) for name in ("a", "b", "c", "d", "e")}
    path = tmp_path / "m.safetensors"
    save_file({"model.diffusion_model." + n: t for n, t in tensors.items() if n != "c"}
              | {"model.diffusion_model.e": torch.randn(3, 4, generator=gen)}, str(path))
    changed = tensors["d"].clone()
    changed[0, 0] += 1.0  # the first sampled row differs from the file
    slots = [(0, "a", tensors["a"], False),          # read
             (1, "b", tensors["b"], True),           # patched
             (2, "c", tensors["c"], False),          # not in the file under its name
             (3, "d", changed, False),               # changed in place since the load
             (4, "e", tensors["e"], False),          # another shape in the file
             (5, None, torch.zeros(2), False)]       # no name (a tensor the module does not name)
    plan = file_reads.plan_reads(str(path), "", slots)
    assert plan.keys == {0: "model.diffusion_model.a"}
    assert plan.why_streamed == {
        "patched (a LoRA or another weight patch): sent merged": 1,
        "not under its name in the file (converted keys, or built in memory)": 2,
        "differs from the file (changed in place, or the file changed since the load)": 1,
        "another shape in the file": 1}
    assert file_reads.plan_reads(None, "why not", slots).why_streamed == {"why not": 6}

    def patcher(*args):
        return types.SimpleNamespace(cached_patcher_init=(print, args) if args else None)
    assert file_reads.checkpoint_of(patcher(str(path), {})) == (str(path), "")
    assert file_reads.checkpoint_of(patcher())[1].startswith("this ComfyUI does not record the file")
    assert file_reads.checkpoint_of(patcher({}, {}))[1] == "the model's loader recorded no file path"
    assert file_reads.checkpoint_of(patcher(str(tmp_path / "m.gguf"), {}))[1] == "m.gguf is not a .safetensors file"
    gone = tmp_path / "gone.safetensors"
    assert file_reads.checkpoint_of(patcher(str(gone), {}))[1] == f"{gone} is no longer there"
    # A row of the file that differs only in a row the sample does not look at is not seen: the
    # check is a sample (four rows of six), said in the module's docstring.
    unseen = tensors["a"].clone()
    unseen[2, 0] += 1.0  # rows 0, 1, 3 and 5 are sampled
    assert file_reads.plan_reads(str(path), "", [(0, "a", unseen, False)]).keys == {0: "model.diffusion_model.a"}


@pytest.fixture(scope="module")
def slow_load_server(tiny_base, comfyui_path):
    """The stream with a slow link and a slow disk: a load of the tiny model takes seconds."""
    server = ComfyServer(comfyui_path, tiny_base, python=sys.executable, log_path=tiny_base / "slow_load.log",
                         env={"PARALLEL_WEIGHT_TRANSPORT": "process_group", "PARALLEL_TEST_SLOW_LOAD_MS": "1500",
                              "PARALLEL_TEST_SLOW_FILE_READS_MS": "30"}).start()
    yield server
    server.stop()


class Listener:
    """ComfyUI's websocket messages to ``server``'s client, collected by a thread."""

    def __init__(self, server):
        import threading

        import websocket

        self.socket = websocket.create_connection(f"{server.url.replace('http', 'ws', 1)}/ws?clientId={server.client_id}",
                                                  timeout=600)
        self.messages: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        import json

        while True:
            try:
                frame = self.socket.recv()
            except Exception:
                return
            if isinstance(frame, str):
                self.messages.append(json.loads(frame))

    def progress(self, prompt_id: str, total: int) -> list[dict]:
        return [m["data"] for m in list(self.messages)
                if m["type"] == "progress" and m["data"].get("prompt_id") == prompt_id and m["data"]["max"] == total]


LOAD_BAR = 100  # the load's bar counts percent (comfyui_glue/load_bar.py)


def test_a_load_shows_in_comfyuis_progress_bar_and_cancel_stops_it(slow_load_server, tiny_prompt, comfyui_path):
    """A first prompt whose weights take seconds to reach the ranks: the sampler's node shows the
    load in ComfyUI's progress bar (percent, rising to 100) before its first step. Cancel pressed
    during the next load (another layout) is not swallowed by the bar's updates: the prompt ends
    interrupted, on ComfyUI 0.33 (where the workers read from the file) with the load stopped (no
    send completed, no worker keeps any of it); the ranks stay up and the next prompt loads the
    model and runs."""
    from pathlib import Path

    from comfy_server import PromptFailed

    server, listener = slow_load_server, Listener(slow_load_server)
    sampler = next(i for i, node in tiny_prompt.items() if node["class_type"] == "KSampler")
    steps = tiny_prompt[sampler]["inputs"]["steps"]
    assert steps != LOAD_BAR
    prompt_id = server.queue(edited(tiny_prompt, ParallelConfig={"ulysses_size": 2, "tp_size": 1}, KSampler={"seed": 71}))
    server.wait(prompt_id, timeout=300)
    load = listener.progress(prompt_id, LOAD_BAR)
    first_step = listener.messages.index(next(m for m in listener.messages if m["type"] == "progress"
                                              and m["data"].get("prompt_id") == prompt_id and m["data"]["max"] == steps))
    load_s = server.get("/parallel/status")["last_weight_send"]["seconds"]
    print(f"\nload bar: {[d['value'] for d in load]}; the load took {load_s:.1f} s")
    assert load and load[-1]["value"] == LOAD_BAR and any(0 < d["value"] < LOAD_BAR for d in load)
    assert all(d["node"] == sampler for d in load)
    assert max(i for i, m in enumerate(listener.messages) if m["type"] == "progress"
               and m["data"] in load) < first_step
    # Cancel during a load.
    tp2 = edited(tiny_prompt, ParallelConfig={"ulysses_size": 1, "tp_size": 2}, KSampler={"seed": 72})
    prompt_id = server.queue(tp2)
    deadline = time.monotonic() + 120
    while not any(0 < d["value"] < LOAD_BAR for d in listener.progress(prompt_id, LOAD_BAR)):
        assert time.monotonic() < deadline, "no load progress seen"
        time.sleep(0.05)
    sends = server.get("/parallel/status")["weight_sends"]
    server.interrupt()
    pressed = time.monotonic()
    with pytest.raises(PromptFailed) as info:
        server.wait(prompt_id, timeout=120)
    ended_s = time.monotonic() - pressed
    assert any(m[0] == "execution_interrupted" for m in info.value.status.get("messages", []))
    status = server.get("/parallel/status")
    print(f"Cancel during the load: the prompt ended {ended_s:.1f} s later; weight sends {sends} -> "
          f"{status['weight_sends']}")
    assert status["state"] == "ready" and all(r["alive"] for r in status["ranks"])
    if records_files(Path(comfyui_path)):  # the workers were reading: they stopped, keeping nothing
        assert status["weight_sends"] == sends and all(r["load"] is None for r in status["ranks"][1:])
    server.run(edited(tp2, KSampler={"seed": 73}), timeout=300)
    assert server.get("/parallel/status")["weight_sends"] == status["weight_sends"] + 1
