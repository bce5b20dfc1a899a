"""Pure pieces: rank layout over the mesh, and what can (not) be sent to workers."""
import pytest
import torch

from parallel_runtime.world import protocol
from parallel_runtime.distributed.mesh import MeshLayout
from parallel_runtime.parallel.sequence import SeqShard


def test_tp_is_innermost_and_groups_partition_the_world():
    layout = MeshLayout.from_sizes({"cfg": 2, "ulysses": 2, "tp": 2})
    assert layout.world_size == 8
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("ulysses") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("cfg") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for rank in range(8):
        assert layout.rank_of(layout.coords(rank)) == rank


def test_sequence_parallel_group_spans_ring_and_ulysses():
    layout = MeshLayout.from_sizes({"ring": 2, "ulysses": 2})
    assert layout.groups("sp") == [[0, 1, 2, 3]]
    assert layout.size("sp") == 4


@pytest.mark.parametrize("total,parts", [(45, 2), (7, 4), (8, 2), (1, 2)])
def test_shards_cover_the_sequence_exactly_once(total, parts):
    shards = [SeqShard(total, parts, i) for i in range(parts)]
    covered = [i for s in shards for i in range(s.start, s.stop)]
    assert covered == list(range(total))
    assert all(s.padded_total >= total and s.chunk * parts == s.padded_total for s in shards)


def test_call_specs_round_trip_with_tensors_replaced():
    x = torch.randn(2, 3)
    obj = ((x, 5, "a"), {"transformer_options": {"sigmas": x * 2, "cond_or_uncond": [0, 1]}, "flag": None})
    tensors = []
    spec = protocol.flatten(obj, tensors)
    assert len(tensors) == 2
    meta = protocol.tensor_meta(tensors)
    assert meta == [((2, 3), torch.float32), ((2, 3), torch.float32)]
    back = protocol.unflatten(spec, tensors)
    assert back[0][1:] == (5, "a") and torch.equal(back[1]["transformer_options"]["sigmas"], x * 2)


def test_tuple_types_round_trip():
    """A namedtuple is rebuilt from its fields, other tuple types (torch.Size in a model's
    options) from an iterable: a worker failed to rebuild a torch.Size before."""
    import collections

    Pair = collections.namedtuple("Pair", "a b")
    obj = {"size": torch.Size([2, 3, 4]), "pair": Pair(torch.ones(1), 7)}
    tensors = []
    back = protocol.unflatten(protocol.flatten(obj, tensors), tensors)
    assert back["size"] == torch.Size([2, 3, 4]) and type(back["size"]) is torch.Size
    assert type(back["pair"]) is Pair and back["pair"].b == 7 and torch.equal(back["pair"].a, torch.ones(1))


def test_comfyui_data_objects_round_trip_and_others_are_refused():
    """A data object of ComfyUI's own (MiniMax-H3's PackedLayout in its conditioning) travels as its
    class and attributes, tensors by broadcast; one holding a callable is refused by its path."""
    import types

    cls = type("PackedLayout", (), {"__module__": "comfy.ldm.fake_family"})
    obj = cls()
    obj.position_ids, obj.segments, obj.signature = torch.arange(6.0), [(0, 2, "text"), (2, 6, "video")], (2, 4)
    tensors = []
    back = protocol.unflatten(protocol.flatten({"layout": obj}, tensors), tensors)["layout"]
    assert type(back) is cls and len(tensors) == 1 and torch.equal(back.position_ids, obj.position_ids)
    assert back.segments == obj.segments and back.signature == (2, 4)
    obj.hook = lambda: 0
    with pytest.raises(protocol.UnsupportedInput, match=r"input\['layout'\]\.hook is a builtins.function"):
        protocol.flatten({"layout": obj}, [])
    with pytest.raises(protocol.UnsupportedInput, match="types.SimpleNamespace"):  # not ComfyUI's
        protocol.flatten(types.SimpleNamespace(a=1), [])


def test_objects_that_cannot_reach_workers_are_named():
    with pytest.raises(protocol.UnsupportedInput, match=r"input\[1\]\['hook'\] is a builtins.function"):
        protocol.flatten(((), {"hook": lambda: 0}), [])


def test_patches_from_other_nodes_are_refused_and_orchestration_is_dropped():
    # "patches" travels: parallel/model_patches.py has made its declared patches data (tests/test_model_patches.py).
    options = {"wrappers": {"x": 1}, "callbacks": {}, "sigmas": torch.ones(1), "patches": {}}
    assert set(protocol.worker_transformer_options(options)) == {"sigmas", "patches"}
    with pytest.raises(protocol.UnsupportedInput, match="optimized_attention_override"):
        protocol.worker_transformer_options({"optimized_attention_override": print})


def test_a_tensor_that_appears_many_times_travels_once():
    """A ControlNet's residuals repeat one block's tensor for several blocks of the model: the
    broadcast carries it once, and every place it appeared gets it back."""
    a, b = torch.randn(2, 3), torch.randn(4)
    tensors: list = []
    spec = protocol.flatten(({"input": [a, a, a, b], "output": (b, b)},), tensors)
    assert len(tensors) == 2 and tensors[0] is a and tensors[1] is b
    (control,) = protocol.unflatten(spec, tensors)
    assert [t is a for t in control["input"]] == [True, True, True, False]
    assert all(t is b for t in control["output"]) and control["input"][3] is b
