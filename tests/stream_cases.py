"""Tensors for the weight stream's tests with real ranks (tests/test_weight_transport.py): imported
by the test and by each rank's process."""
import torch


def stream_case(world: int):
    """Tensors of every kind a stream carries (replicated fp32 / fp16 / an odd-sized bool, TP row and
    column segments, rank 0's bias), repeated so that small buckets make many buckets of changing
    sizes; entries, TP 2, each world rank's TP coordinate."""
    from parallel_runtime.weights import stream
    from parallel_runtime.weights.shards import Cut

    g = torch.Generator().manual_seed(11)
    tensors, entries = [], []
    for layer in range(6):
        specs = [(torch.randn(37 + layer, 70, generator=g), None),
                 (torch.randn(64, 33 + 2 * layer, generator=g).to(torch.bfloat16), Cut("q", "segments", 0, (64,))),
                 (torch.randn(48, 40 + 4 * layer, generator=g), Cut("o", "segments", 1, (40 + 4 * layer,))),
                 (torch.rand(17 + layer, generator=g) > 0.5, None),
                 (torch.randn(50 + 2 * layer, generator=g), Cut("o.bias", "bias_once")),
                 (torch.randn(300 + 10 * layer, generator=g).half(), None)]
        for t, cut in specs:
            tensors.append(t)
            entries.append(stream.Entry(tuple(t.shape), t.dtype, cut))
    return tensors, entries, 2, [r % 2 for r in range(world)]
