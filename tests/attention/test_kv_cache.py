"""The paged cache's layers: views of one tensor per dtype, whose rows move in every layer at once."""

import torch

from attention.kv_cache import FP8_DTYPE, KVCache
from attention.zero_pages import zeroed


def test_rows_move_in_every_layer_of_every_dtype_and_nothing_else_changes():
    """A token tree's accepted path moves into place: each destination slot gets its source's K and V as
    stored, in every layer (bf16 and e4m3 alike), sources read before destinations are written."""
    cache = KVCache(3, 6, 4, 2, 8, (torch.bfloat16, FP8_DTYPE, torch.bfloat16), "cpu")
    assert [layer.data.dtype for layer in cache.layers] == [torch.bfloat16, FP8_DTYPE, torch.bfloat16]
    assert cache.layers[0].data.shape == (7, 2, 4, 2, 8)  # one scratch page beyond the 6
    generator = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        layer.data.copy_(torch.randn(layer.data.shape, generator=generator).to(layer.data.dtype))
    before = [layer.data.view(torch.uint8).clone() for layer in cache.layers]
    # slot (page 2, offset 3) -> (1, 0), and (1, 0) -> (1, 1): the second reads the first's old row
    src_pages, src_offsets = torch.tensor([2, 1]), torch.tensor([3, 0])
    dst_pages, dst_offsets = torch.tensor([1, 1]), torch.tensor([0, 1])
    cache.move_rows(src_pages, src_offsets, dst_pages, dst_offsets)
    for layer, old in zip(cache.layers, before):
        new = layer.data.view(torch.uint8)
        assert torch.equal(new[1, :, 0], old[2, :, 3]) and torch.equal(new[1, :, 1], old[1, :, 0])
        untouched = torch.ones(7, 4, dtype=torch.bool)
        untouched[1, :2] = False
        assert torch.equal(new.transpose(1, 2)[untouched], old.transpose(1, 2)[untouched])


def test_a_cpu_pool_starts_zeroed_in_every_dtype_and_takes_writes():
    """On the CPU the pool is made of the operating system's zero pages (resident only once written): it must still
    read as zeros everywhere, in each dtype, with the shape asked, and hold what is written."""
    cache = KVCache(3, 6, 4, 2, 8, (torch.float32, FP8_DTYPE, torch.bfloat16), "cpu")
    for layer, dtype in zip(cache.layers, (torch.float32, FP8_DTYPE, torch.bfloat16)):
        assert layer.data.dtype == dtype and layer.data.shape == (7, 2, 4, 2, 8)
        assert not layer.data.float().any()
    cache.layers[2].data[3, 1, 2] = 1.5
    assert cache.layers[2].data.float().sum() == 1.5 * 2 * 8 and not cache.layers[0].data.float().any()
    assert zeroed((2, 3), torch.float32, "cpu").tolist() == [[0.0] * 3] * 2
